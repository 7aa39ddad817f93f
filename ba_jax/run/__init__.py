"""Running a run, where the two columns meet: the config checks and run
builder (``checks``, ``model_setup``, ``setup``), rollouts (``rollout``), the
trainer loop, checkpoints, resume rules, metrics and the backends they go to
(``tracking``), the workdir's files and evaluation.

May import: config, generation, loss, policy, sandboxing, tasks, update.
"""
