"""Run a pre-registered, powered ablation from a study spec.

    python -m ba_jax.ablate --spec=experiments/studies/tiny_rules/spec.py --stage=all

Stages (``--stage``): plan, tune, predict, confirm, report, or all (tune,
predict, confirm, report). ``confirm`` refuses unless the spec and the
predictions are committed and unchanged at HEAD and the tree is clean;
``--allow_dirty`` lets a dirty tree through and every row and the report say
so. Where runs go (``--placement``): local processes, ``--parallel`` at a
time (default); sub-meshes of this host's devices (``devices``,
``--devices_per_run``); or one launch command per slice (``launcher``,
``--launcher``, ``--slices``). The logic is ``ba_jax.ablation.stages`` and
``ba_jax.ablation.placement``. ``report`` also logs the study to Weights &
Biases as one run when the base config's ``log.backends`` names wandb, or
with ``--wandb`` (``--wandb=off``: never). Runs share JAX's persistent
compilation cache (``--compilation_cache``, default ``<outdir>/runs/xla_cache``),
so a study compiles each distinct program once, not once per run.
"""
from __future__ import annotations

import argparse
import sys

from ba_jax.ablation import placement, protocol, spec as spec_lib, stages
from ba_jax.ablation import runner as runner_lib


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--spec", required=True, help="a study spec file (get_spec())")
  parser.add_argument("--stage", default="all", choices=stages.STAGES + ("all",))
  parser.add_argument("--outdir", default=None,
                      help="where rows, runs and the report go (default: the "
                           "spec's results folder, where its protocol lives)")
  parser.add_argument("--placement", default="local",
                      choices=("local", "devices", "launcher"),
                      help="where runs go: local processes (--parallel), "
                           "sub-meshes of this host's devices "
                           "(--devices_per_run), or a launch command per "
                           "slice (--launcher, --slices); docs/ablations.md")
  parser.add_argument("--parallel", type=int, default=2,
                      help="local: runs at once, each on cores/parallel threads")
  parser.add_argument("--devices_per_run", type=int, default=None,
                      help="devices: K devices per run, D/K runs at a time")
  parser.add_argument("--devices", default=None,
                      help="devices: this host's devices, a count (8) or ids "
                           "(0,1,2,3); default read from the environment or "
                           "listed by a child process")
  parser.add_argument("--platform", default=None, choices=("cpu", "gpu", "tpu"),
                      help="devices: default JAX_PLATFORMS, else what a child "
                           "process finds")
  parser.add_argument("--launcher", default=None,
                      help="launcher: a shell command template with {cmd} (or "
                           "{args}), {slice} and {workdir}")
  parser.add_argument("--slices", default=None,
                      help="launcher: slice names, comma separated; one run "
                           "at a time on each")
  parser.add_argument("--python", default="python3",
                      help="launcher: the interpreter {cmd} names on the slices")
  parser.add_argument("--compilation_cache", default="auto",
                      help="JAX's persistent compilation cache for the runs: "
                           "auto (<outdir>/runs/xla_cache, or "
                           "JAX_COMPILATION_CACHE_DIR where set), off, or a "
                           "directory; results are the same either way")
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
    runner = None
    if args.stage in ("tune", "confirm", "all"):
      runner = placement.make_runner(
          args.placement, parallel=args.parallel,
          devices_per_run=args.devices_per_run, devices=args.devices,
          platform=args.platform, launcher=args.launcher, slices=args.slices,
          python=args.python, compilation_cache=args.compilation_cache)
    stages.run(args.stage, spec, args.outdir, runner=runner,
               parallel=args.parallel, allow_dirty=args.allow_dirty,
               pilot=args.pilot, wandb=args.wandb)
  except (protocol.ProtocolError, stages.StageError, runner_lib.StudyBusy,
          ValueError, FileNotFoundError) as e:
    print(f"ba_jax.ablate: {e}", file=sys.stderr)
    return 2
  except runner_lib.RunFailed as e:
    print(f"ba_jax.ablate: a run failed; the study stops, and the same command "
          f"resumes it from the rows: {e}", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
