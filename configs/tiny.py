"""The default CPU job: a tiny Qwen3-style policy on the bundled addition task.

    python -m ba_jax.train --config=configs/tiny.py --workdir=/tmp/tiny

Supervised warm-up on the synthetic task (ba_jax/tasks/synthetic.py), then GRPO with
balanced aggregation; held-out accuracy is printed before and after RL.
Every key's default and meaning: ``python -m ba_jax.train --helpconfig``;
this file states the model, the task and what differs. Variants (comma separated
``key=value`` after the colon):

    --config=configs/tiny.py:smoke          a few-second run for tests and CI
    --config=configs/tiny.py:agg=token      another aggregation rule
    --config=configs/tiny.py:gap=-6         wrong answers 6 tokens shorter
    --config=configs/tiny.py:lora           RL trains LoRA adapters (rank 8) on the
                                            warmed-up policy (lora=<rank> for another)
"""
from ba_jax.config import common

# The adapters' rate (the full-parameter run's is 1e-4).
LORA_LEARNING_RATE = 1e-3

VARIANTS = {"smoke": "a seconds-scale run", "agg": "<aggregation mode>",
            "gap": "<int> wrong minus right warm-up length", "lora": common.LORA_VARIANT}


def get_config(arg=None):
  args = common.parse_variants(arg, VARIANTS, "configs/tiny.py")
  c = common.base(aggregation=args.get("agg", "balanced"))

  # Policy: a random model (vocab_size is checked against the tokenizer).
  c.model = common.model(
      model_type="qwen3",  # qwen2 | qwen3 | llama
      vocab_size=32,  # >= the task tokenizer's 26, padded to shard evenly
      hidden_size=64, intermediate_size=192, num_layers=2, num_heads=4,
      num_kv_heads=2, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-6,
      tie_word_embeddings=True, qk_norm=True, max_position_embeddings=128)

  # The bundled synthetic task (ba_jax/tasks/synthetic.py).
  c.task = common.synthetic_task(length_gap=int(args.get("gap", 6)))
  c.sft.steps = 600
  # 1e-3 drifts the tiny policy off the task.
  c.optim.learning_rate = 1e-4
  # Compiles the tiny policy's programs in about half the time (ba_jax.policy.compiling).
  c.xla_cpu_compile = "fast"

  if args.get("lora"):
    common.lora(c, args["lora"], learning_rate=LORA_LEARNING_RATE)

  if args.get("smoke"):
    c.model.update(hidden_size=32, intermediate_size=64, num_heads=2,
                   num_kv_heads=1)
    c.sft.update(steps=20, batch_size=16)
    c.rl.update(steps=3, prompts_per_step=4, group_size=4, max_new_tokens=28)
    c.task.max_terms = 3
    c.eval.update(num_problems=8, samples_per_problem=2)
    c.checkpoint.every = 2
    c.log.progress_bar = False
  return c
