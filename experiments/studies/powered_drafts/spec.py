"""The powered aggregation ablation on the drafts task (configs/drafts.py):
the four rules, each at its own tuned rate, in the two gap cells.

    python -m ba_jax.ablate --spec=experiments/studies/powered_drafts/spec.py --stage=all

The committed results (results/) were run by the script this spec replaced,
with these settings; ``--stage=report`` regenerates REPORT.md from them.
README.md here says what was found.
"""

# The paper's mechanism, per cell: the predicted relation of A and B in
# d = A - B, and the sign of positive share minus positive fraction under
# token and dr_grpo (under balanced and sequence it is 0 by construction).
PREDICTIONS = {
    "pos": {"balanced vs sequence": "A > B", "balanced vs token": "A >= B",
            "token vs dr_grpo": "no difference",
            "token/dr_grpo positive share - positive fraction": "> 0"},
    "neg": {"balanced vs sequence": "A >= B (small)", "balanced vs token": "A > B",
            "token vs dr_grpo": "no difference",
            "token/dr_grpo positive share - positive fraction": "< 0"},
}

NOTES = """\
Under `balanced` and `sequence` the positive share W+/(W+ + W-) equals the
positive fraction by construction; under `token` and `dr_grpo` it follows the
subsets' token counts, so it exceeds the fraction when correct responses are
the longer ones (pos) and falls below it when they are the shorter (neg).
Weight-length correlation: 0 under token and dr_grpo, most negative under
sequence, between under balanced. A cell where groups are rarely mixed
(`groups_mixed_frac` near 0) cannot tell the rules apart, whatever its result.
"""


def get_spec():
  return dict(
      name="The powered aggregation ablation",
      config="configs/drafts.py",
      cells={"neg": {"variant": "gap=neg"}, "pos": {"variant": "gap=pos"}},
      arm_key="loss.aggregation",
      arms=["token", "sequence", "dr_grpo", "balanced"],
      rate_key="optim.learning_rate",
      rates=[1.5e-4, 3e-4, 6e-4],
      tune_seeds=[1000, 1001, 1002],
      confirm_seeds=list(range(20)),
      overrides={"rl.steps": 20},
      warmup="per_seed",
      warmup_variant="gap=none",  # the warm-up traces do not depend on the rule
      primary=["reward_auc", "mean training reward over the RL run"],
      secondary=[["heldout_after", "held-out sampled accuracy after RL"]],
      comparisons=[["balanced", "sequence", "superiority"],
                   ["balanced", "token", "noninferiority"],
                   ["token", "dr_grpo", "control"]],
      margin=0.05,
      common_rate_arm="token",
      predictions=PREDICTIONS,
      notes=NOTES,
      results="experiments/studies/powered_drafts/results",
  )
