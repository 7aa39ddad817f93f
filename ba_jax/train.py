"""Command line: ``python -m ba_jax.train --config=configs/tiny.py --workdir=DIR``.

Overrides: ``--config.rl.steps=10``; variants: ``--config=configs/tiny.py:smoke``;
every key with its default, range and meaning: ``--helpconfig``.
Memory and FLOPs of a config without weights: ``python -m ba_jax.dry_run``.
Several processes (``jax.distributed``): pass ``--coordinator_address``,
``--num_processes`` and ``--process_id``, or set ``BA_JAX_DISTRIBUTED=1`` to
let JAX read the cluster from the environment (TPU pods, SLURM).

Rerunning a workdir resumes it from its newest intact checkpoint; a config
that changes the experiment is refused unless ``--allow_config_change``
(recorded in the workdir's config_changes.jsonl). Exit status: 0 done or
stopped to resume later (SIGTERM, stop_after_steps), 2 a refused config or
no intact checkpoint (one line on stderr), 3 stopped by the non-finite
guard (rl.max_nonfinite) or ended by steps whose updates were all
non-finite (one line on stderr with the count; summary.json has it too).
"""
import os
import sys

from absl import flags, logging
from ml_collections import config_flags


def _define_flags(fv: flags.FlagValues, argv) -> dict:
  """The command's flags, defined on ``fv`` (a fresh set per call, so that
  importing this module defines no global flag); ``argv`` holds the
  ``--config.*`` overrides."""
  return dict(
      config=config_flags.DEFINE_config_file(
          "config", "configs/tiny.py", "ml_collections config file",
          lock_config=True, flag_values=fv, sys_argv=argv),
      workdir=flags.DEFINE_string(
          "workdir", None, "run directory (resumes from its checkpoints)",
          flag_values=fv),
      coordinator=flags.DEFINE_string(
          "coordinator_address", None,
          "host:port of process 0 (jax.distributed)", flag_values=fv),
      num_processes=flags.DEFINE_integer(
          "num_processes", None, "processes in the job (jax.distributed)",
          flag_values=fv),
      process_id=flags.DEFINE_integer(
          "process_id", None, "this process's index (jax.distributed)",
          flag_values=fv),
      allow_change=flags.DEFINE_bool(
          "allow_config_change", False, "resume a workdir even though the "
          "config changes its experiment (model, loss, rl, task, seed, optim, "
          "sft, init_from); the change is recorded in config_changes.jsonl",
          flag_values=fv),
  )


EXIT_REFUSED = 2
EXIT_NONFINITE = 3


def _one_line(error: BaseException) -> str:
  """The error's message on one line (a KeyError's comes quoted, with
  escaped newlines, and may be quoted again by ml_collections)."""
  text = error.args[0] if error.args and isinstance(error.args[0], str) else (
      str(error))
  text = text.replace("\\n", "\n").replace("\\'", "'")
  while len(text) > 1 and text[0] == text[-1] and text[0] in "'\"":
    text = text[1:-1]
  return "; ".join(" ".join(l.split()) for l in text.split("\n") if l.strip())


def parse_flags(argv, fv: flags.FlagValues):
  """absl's parsing of ``argv`` into ``fv``, with a bad ``--config.*``
  override (ml_collections raises KeyError/AttributeError/TypeError from
  inside the flag parser, a long chained traceback) turned into one line
  naming the override (``SystemExit`` with that line)."""
  try:
    return fv(argv)
  except flags.Error as e:
    sys.exit(f"FATAL Flags parsing error: {_one_line(e)}")
  except (KeyError, AttributeError, TypeError, ValueError) as e:
    overrides = [a for a in argv[1:] if a.startswith("--config.")]
    name = next((a for a in overrides
                 if any(f"'{p}'" in _one_line(e) or p in _one_line(e)
                        for p in a[len("--config."):].split("=")[0].split(
                            ".")[-1:])), " ".join(overrides))
    what = "no such key " if isinstance(e, (KeyError, AttributeError)) else ""
    sys.exit(f"error: bad config override {name}: {what}{_one_line(e)}")


def main(argv) -> int:
  """The command on ``argv`` (``argv[0]`` is the program): trains, and
  returns the exit status. ``--helpconfig`` prints every config key
  (``schema.help_text``). Bad flags and refused configs end in
  ``SystemExit`` / a status with one line on stderr."""
  if "--helpconfig" in argv[1:]:
    from ba_jax.config import schema
    print(schema.help_text())
    return 0
  fv = flags.FlagValues()
  f = _define_flags(fv, argv)
  if {"--help", "-h", "--helpfull"} & set(argv[1:]):
    print(fv.get_help())
    return 0
  rest = parse_flags(argv, fv)
  if len(rest) > 1:
    sys.exit(f"FATAL: unexpected arguments: {rest[1:]}")
  if not f["workdir"].value:
    sys.exit("FATAL Flags parsing error: flag --workdir=None: Flag --workdir "
             "must have a value other than None.")
  logging.set_verbosity(logging.WARNING)  # orbax logs every step at INFO
  import jax
  if f["coordinator"].value or f["num_processes"].value:
    jax.distributed.initialize(coordinator_address=f["coordinator"].value,
                               num_processes=f["num_processes"].value,
                               process_id=f["process_id"].value)
  elif os.environ.get("BA_JAX_DISTRIBUTED") == "1":
    jax.distributed.initialize()
  from ba_jax.run import checkpointing
  from ba_jax.tasks import data
  from ba_jax.run import resume
  from ba_jax.run import checks
  from ba_jax.run import trainer
  config = f["config"].value
  overrides = config_flags.get_override_values(fv["config"])
  try:
    summary = trainer.run(config, f["workdir"].value,
                          explicit=set(overrides),
                          allow_config_change=f["allow_change"].value)
  except (resume.ConfigChanged, checkpointing.NoIntactCheckpoint,
          checks.ConfigError, data.DataError) as e:
    print(f"error: {e}", file=sys.stderr, flush=True)
    return EXIT_REFUSED
  status, line = exit_status(summary, config.rl.max_nonfinite)
  if line:
    print(line, file=sys.stderr, flush=True)
  return status


def exit_status(summary: dict, max_nonfinite: int) -> tuple[int, str | None]:
  """The exit status of a run that returned ``summary``, and the line for
  stderr: EXIT_NONFINITE when the non-finite guard stopped it or its last
  steps (one or more, cut short by rl.steps) all skipped updates; else 0,
  with a warning when updates were skipped on the way."""
  skipped = summary.get("nonfinite_updates", 0)
  at_end = summary.get("nonfinite_steps_at_end", 0)
  if summary.get("stopped") == "nonfinite":
    return EXIT_NONFINITE, (
        f"error: stopped at step {summary['step']}: rl.max_nonfinite="
        f"{max_nonfinite} non-finite updates in a row")
  if at_end and summary.get("stopped") is None:
    return EXIT_NONFINITE, (
        f"error: the run ended at step {summary['step']} after {at_end} "
        f"step(s) in a row with non-finite updates; {skipped} updates were "
        "skipped in all (summary.json: nonfinite_updates)")
  if skipped:
    return 0, (f"warning: {skipped} non-finite updates were skipped in this "
               "run (summary.json: nonfinite_updates)")
  return 0, None


if __name__ == "__main__":
  sys.exit(main(sys.argv))
