"""The update: the jitted GRPO train step over PPO epochs, mini-batches and
micro-batches (``train_step``, ``microbatch``), its optimizer, and the
supervised warm-up step (``sft``).

May import: config, loss, policy.
"""
