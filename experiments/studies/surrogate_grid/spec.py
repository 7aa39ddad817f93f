"""The surrogate grid on the drafts task (configs/drafts.py): the policy term
x the aggregation rule x the sampler-trainer correction, each arm at its own
tuned rate, in the powered study's two gap cells. Not run yet; README.md
here has the commands, the seed count and the time it takes.

    python -m ba_jax.ablate --spec=experiments/studies/surrogate_grid/spec.py --stage=tune

Arms: {ppo_clip, gspo, cispo} x {token, sequence, balanced} x {none,
tis_token}, named "<surrogate>/<aggregation>/<correction>", and
ppo_clip/dr_grpo/none for the null control (the powered study's). Every run
recomputes the old log-probs (``rl.old_logp="recompute"``): TIS needs them
(with the sampler's, its weight exp(old - sampler) is 1 on every token, and
the spec is refused as it loads), and giving them to every arm keeps the
arms apart only in the three crossed keys.
"""
from ba_jax.ablation.arms import grid

SURROGATES = ("ppo_clip", "gspo", "cispo")
RULES = ("token", "sequence", "balanced")
CORRECTIONS = ("none", "tis_token")
CONTROL = ("ppo_clip/token/none", "ppo_clip/dr_grpo/none")

# Confirmation seeds: the fewest that detect 0.02 in the primary outcome at
# Holm's first step over this spec's 18 comparisons, at the powered study's
# pooled paired SD (python -m experiments.studies.surrogate_grid.plan_seeds;
# README.md shows the computation).
CONFIRM_SEEDS = 23


def comparisons():
  out = []
  for s in SURROGATES:
    out += [[f"{s}/balanced/none", f"{s}/token/none", "superiority"],
            [f"{s}/balanced/none", f"{s}/sequence/none", "superiority"],
            [f"{s}/balanced/tis_token", f"{s}/balanced/none", "superiority"]]
  return out + [[*CONTROL, "control"]]


def predictions():
  """Per cell: the direction the powered study found for ppo_clip (neg:
  BA above token and sequence; pos: above sequence, below token on held-out),
  the same for gspo and cispo (see NOTES), and no difference from TIS."""
  by_cell = {"neg": {"balanced/token": "A > B", "balanced/sequence": "A > B"},
             "pos": {"balanced/token": "A <= B", "balanced/sequence": "A > B"}}
  out = {}
  for cell, claims in by_cell.items():
    out[cell] = {}
    for s in SURROGATES:
      out[cell][f"{s}/balanced/none vs {s}/token/none"] = claims["balanced/token"]
      out[cell][f"{s}/balanced/none vs {s}/sequence/none"] = claims["balanced/sequence"]
      out[cell][f"{s}/balanced/tis_token vs {s}/balanced/none"] = "no difference"
    out[cell][f"{CONTROL[0]} vs {CONTROL[1]}"] = "no difference"
    out[cell]["share - fraction, every surrogate and correction"] = (
        "token: " + ("< 0" if cell == "neg" else "> 0") + "; balanced, sequence: 0")
  return out


NOTES = """\
The aggregation weights come from the mask, the advantages and the group
layout alone, so the mechanism checks (positive share minus positive
fraction; weight-length correlation) should not move with the surrogate or
the correction: under `balanced` and `sequence` the share equals the
positive fraction, under `token` it follows the subsets' token counts (above
the fraction in pos, below in neg); the weight-length correlation is 0 under
`token` and negative under `sequence` and `balanced`.

At a ratio of 1 (the first of the step's two mini-batches, whose old
log-probs are the current ones) ppo_clip, gspo and cispo give the same
gradient: each aggregation rule's weight is constant over a sequence's
tokens, so gspo's sequence ratio and cispo's stop-gradient weight change
nothing there. They part on the second mini-batch, one update off-policy;
so the rules' ordering is predicted to be the same under each surrogate.

TIS: the sampler and the trainer compute the same float32 model on CPU and
differ by rounding only (`mismatch_k3`, in the report), so the truncated
weight min(exp(old - sampler), 2) is about 1 on every token and TIS on
against off is predicted to show no difference: on this host it is a second
null, and the report's `tokens corrected` column says how often the cap bit.
"""


def get_spec():
  return dict(
      name="The surrogate x aggregation x correction grid",
      config="configs/drafts.py",
      cells={"neg": {"variant": "gap=neg"}, "pos": {"variant": "gap=pos"}},
      arm_keys=["loss.surrogate", "loss.aggregation", "loss.correction"],
      arms=grid(SURROGATES, RULES, CORRECTIONS) + [tuple(CONTROL[1].split("/"))],
      rate_key="optim.learning_rate",
      # the powered study's fresh_spec grid: a factor sqrt(2) around the rate
      # every rule chose there, ties at 4 decimals
      rates=[2.1e-4, 3e-4, 4.2e-4],
      tie_decimals=4,
      tune_seeds=[1000, 1001, 1002],
      confirm_seeds=list(range(CONFIRM_SEEDS)),
      overrides={"rl.steps": 20, "rl.old_logp": "recompute"},
      warmup="per_seed",
      warmup_variant="gap=none",  # the warm-up traces do not depend on the rule
      primary=["reward_auc", "mean training reward over the RL run"],
      secondary=[["heldout_after", "held-out sampled accuracy after RL"]],
      comparisons=comparisons(),
      common_rate_arm="ppo_clip/token/none",
      detectable=(0.03, 0.02),
      predictions=predictions(),
      notes=NOTES,
      results="experiments/studies/surrogate_grid/results",
  )
