"""Run a pre-registered, powered ablation from a study spec.

    python -m ba_jax.ablate --spec=experiments/studies/tiny_rules/spec.py --stage=all

Stages (``--stage``): plan, tune, predict, confirm, report, or all (tune,
predict, confirm, report). ``confirm`` refuses unless the spec and the
predictions are committed and unchanged at HEAD and the tree is clean;
``--allow_dirty`` lets a dirty tree through and every row and the report say
so. ``report`` also logs the study to Weights & Biases as one run when the
base config's ``log.backends`` names wandb, or with ``--wandb``
(``--wandb=off``: never). The logic is ``ba_jax.ablation.stages``.
"""
from __future__ import annotations

import argparse
import sys

from ba_jax.ablation import protocol, spec as spec_lib, stages


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--spec", required=True, help="a study spec file (get_spec())")
  parser.add_argument("--stage", default="all", choices=stages.STAGES + ("all",))
  parser.add_argument("--outdir", default=None,
                      help="where rows, runs and the report go (default: the "
                           "spec's results folder, where its protocol lives)")
  parser.add_argument("--parallel", type=int, default=2,
                      help="local runs at once, each on cores/parallel threads")
  parser.add_argument("--allow_dirty", action="store_true",
                      help="confirm on a tree with uncommitted changes (rows "
                           "and report say so)")
  parser.add_argument("--pilot", default=None,
                      help="--stage=plan: a pilot's rows (results.jsonl) "
                           "instead of the tuning runs")
  parser.add_argument("--wandb", nargs="?", const="on", default="auto",
                      choices=("auto", "on", "off"),
                      help="the report stage's W&B run of the study: auto (on "
                           "when the base config's log.backends names wandb), "
                           "on (--wandb), or off")
  args = parser.parse_args(argv)
  try:
    spec = spec_lib.load(args.spec)
    stages.run(args.stage, spec, args.outdir, parallel=args.parallel,
               allow_dirty=args.allow_dirty, pilot=args.pilot, wandb=args.wandb)
  except (protocol.ProtocolError, stages.StageError, ValueError,
          FileNotFoundError) as e:
    print(f"ba_jax.ablate: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
