"""A small study of the whole protocol: `token` against BA on the tiny
addition job, short runs, a few seeds. It shows the command, not a finding
(4 confirmation seeds detect only large differences).

    python -m ba_jax.ablate --spec=experiments/studies/tiny_rules/spec.py --stage=all \\
        --outdir=/tmp/tiny_rules

From a fresh clone that reruns the tuning, keeps the committed predictions
(results/PREDICTIONS.md, frozen), reruns the confirmation under them and
writes the report to --outdir. Without --outdir the rows already committed in
results/ are read back and nothing runs.
"""


def get_spec():
  return dict(
      name="BA against token on the tiny job",
      config="configs/tiny.py:smoke",
      cells={"tiny": {}},
      arm_key="loss.aggregation",
      arms=["token", "balanced"],
      rate_key="optim.learning_rate",
      rates=[1e-4, 1e-3],
      tune_seeds=[100, 101],
      confirm_seeds=[0, 1, 2, 3],
      # a longer warm-up than smoke's 20 steps and larger RL batches, so that
      # rewards are ~0.15 and most groups mixed
      overrides={"sft.steps": 500, "rl.steps": 4, "rl.prompts_per_step": 8,
                 "rl.group_size": 8},
      primary=["reward_auc", "mean training reward over the RL run"],
      secondary=[["heldout_after", "held-out sampled accuracy after RL"]],
      comparisons=[["balanced", "token", "superiority"],
                   ["balanced", "token", "noninferiority"]],
      margin="mdd",
      predictions={"tiny": {"balanced vs token": "no difference detectable"}},
      results="experiments/studies/tiny_rules/results",
  )
