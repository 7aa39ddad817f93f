"""The powered aggregation ablation's confirmation on fresh seeds (20-39;
seeds 0-19 were the first confirmation, see README.md), with the
non-inferiority margin set from the tuning runs' power and the rates tuned
on a finer grid with more seeds. Tuning partly run (102 of 144
runs in fresh_results/tuning.jsonl; the tune stage resumes them); the
rest not run yet:

    python -m ba_jax.ablate --spec=experiments/studies/powered_drafts/fresh_spec.py --stage=tune
    python -m ba_jax.ablate --spec=experiments/studies/powered_drafts/fresh_spec.py --stage=plan
    python -m ba_jax.ablate --spec=experiments/studies/powered_drafts/fresh_spec.py --stage=predict
    git add experiments/studies/powered_drafts && git commit -m "powered_drafts fresh seeds: predictions"
    python -m ba_jax.ablate --spec=experiments/studies/powered_drafts/fresh_spec.py --stage=confirm
    python -m ba_jax.ablate --spec=experiments/studies/powered_drafts/fresh_spec.py --stage=report

Changes from spec.py, each fixed here before any of these runs:
- confirm_seeds 20-39 (fresh); tune_seeds 1000-1005 (3 more than the first
  study, so the rate choice rests on 6 seeds);
- rates 2.1e-4, 3e-4, 4.2e-4: a factor sqrt(2) around the rate every rule
  chose on the factor-2 grid, and ties compared at 4 decimals (the first
  study's 3 could merge rates within rounding);
- margin "mdd": the one-sided detectable difference of the tuning runs'
  paired SD at 20 seeds (``ba_jax.ablation.planning.make_plan``), about
  0.01 at the first study's SD 0.0155, not a round 0.05;
- the masked-response treatment of each rule stated in the notes below.
"""
from experiments.studies.powered_drafts import spec as first

NOTES = first.NOTES + """
Masked responses (`rl.overlong="mask"`, these runs' setting): a response cut
at the budget has its loss mask zeroed but keeps its advantage, and the rules
treat it differently (`ba_jax/loss/aggregation.py`): `balanced` keeps it in
its subset's count |S|, so the subset keeps its share |S|/G spread over its
remaining tokens; `sequence` keeps it in N (its own weight is 0, the others'
stay 1/(N L_n)), so the batch's weights sum to less than 1; `dr_grpo` keeps
it in N as well (constant 1/(N L_max)); `token` drops it (it adds no tokens
to the normaliser). The difference matters most in `pos`, where the correct
responses are the longer ones and the most often cut.
"""


def get_spec():
  spec = first.get_spec()
  spec.update(
      name="The powered aggregation ablation, fresh seeds",
      rates=[2.1e-4, 3e-4, 4.2e-4],
      tune_seeds=list(range(1000, 1006)),
      confirm_seeds=list(range(20, 40)),
      margin="mdd",
      tie_decimals=4,
      notes=NOTES,
      results="experiments/studies/powered_drafts/fresh_results",
  )
  return spec
