"""The paper's analysis: does the length gap / length variation pick the winner?

    python -m experiments.studies.length_sweep.sweep_length --gaps=-6,6 --terms=3-3,2-4 --seeds=1

For each cell (the synthetic task's length gap between wrong and right
responses, `task.length_gap`, and its length-variation setting,
`task.min_terms`-`task.max_terms`: how many numbers a problem adds, so the
spread of response lengths; 3-3 gives every problem three numbers) it runs the aggregation ablation with `token`, `sequence` and
`balanced` (experiments/studies/aggregation_ablation/ablate_aggregation.py, one warm-up per seed shared by
the modes) and reports which of token and sequence ends with the higher
held-out accuracy, and where balanced stands. Writes `sweep.md` and
`sweep.jsonl` under --outdir; finished runs are reused.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import numpy as np

from experiments.studies.aggregation_ablation import ablate_aggregation

# The rules the paper's length analysis compares (dr_grpo left out).
MODES = tuple(m for m in ablate_aggregation.MODES if m != "dr_grpo")


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--config", default="configs/tiny.py")
  parser.add_argument("--gaps", default="-6,0,6")
  parser.add_argument("--terms", default="3-3,2-4",
                      help="min-max numbers per problem, one range per cell")
  parser.add_argument("--seeds", type=int, default=2)
  parser.add_argument("--parallel", type=int, default=2)
  parser.add_argument("--outdir", default="experiments/studies/length_sweep/results")
  parser.add_argument("--override", action="append", default=[])
  args = parser.parse_args(argv)
  outdir = pathlib.Path(args.outdir)
  command = " ".join(["python", "experiments/studies/length_sweep/sweep_length.py",
                      *(argv if argv is not None else sys.argv[1:])])
  cells = []
  for terms in args.terms.split(","):
    min_terms, _, max_terms = terms.partition("-")
    for gap in [int(x) for x in args.gaps.split(",")]:
      cell_dir = outdir / f"terms{terms}_gap{gap}"
      rows = ablate_aggregation.main([
          f"--config={args.config}", f"--variant=gap={gap}",
          f"--modes={','.join(MODES)}", f"--seeds={args.seeds}",
          f"--parallel={args.parallel}", f"--outdir={cell_dir}",
          f"--override=--config.task.min_terms={min_terms}",
          f"--override=--config.task.max_terms={max_terms}",
          *[f"--override={o}" for o in args.override]])
      acc = {m: float(np.mean([r["heldout_after"] for r in rows
                               if r["mode"] == m])) for m in MODES}
      stats = {k: float(np.nanmean([r[k] for r in rows]))
               for k in ("length_cv_mean", "length_gap_mean", "length_mean")}
      ranked = sorted(MODES, key=lambda m: -acc[m])
      cells.append(dict(terms=terms, gap=gap, accuracy=acc, **stats,
                        token_vs_sequence=("token" if acc["token"] >
                                           acc["sequence"] else "sequence"
                                           if acc["sequence"] > acc["token"]
                                           else "tie"),
                        balanced_rank=ranked.index("balanced") + 1))
  outdir.mkdir(parents=True, exist_ok=True)
  with open(outdir / "sweep.jsonl", "w") as f:
    for cell in cells:
      f.write(json.dumps(cell) + "\n")
  lines = [
      "# Length sweep: token vs sequence, and balanced", "",
      f"Command: `{command}`", "",
      f"Held-out accuracy after RL (sampled), mean over {args.seeds} seeds. "
      "`length gap knob` is task.length_gap (tokens by which the warm-up's "
      "wrong traces exceed right ones); `measured gap` is the mean length of "
      "positive minus negative responses during RL; `length CV` the mean "
      "within-group coefficient of variation.", "",
      "| numbers per problem | length gap knob | measured gap | length CV | token "
      "| sequence | balanced | token vs sequence | balanced rank (of 3) |",
      "|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
  for c in cells:
    a = c["accuracy"]
    lines.append(
        f"| {c['terms']} | {c['gap']} | {c['length_gap_mean']:.2f} | "
        f"{c['length_cv_mean']:.3f} | {a['token']:.3f} | {a['sequence']:.3f} | "
        f"{a['balanced']:.3f} | {c['token_vs_sequence']} | "
        f"{c['balanced_rank']} |")
  (outdir / "sweep.md").write_text("\n".join(lines) + "\n")
  print((outdir / "sweep.md").read_text())


if __name__ == "__main__":
  main()
