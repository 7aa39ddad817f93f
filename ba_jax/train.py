"""Command line: ``python -m ba_jax.train --config=configs/tiny.py --workdir=DIR``.

Overrides: ``--config.rl.steps=10``; variants: ``--config=configs/tiny.py:smoke``.
Several processes (``jax.distributed``): pass ``--coordinator_address``,
``--num_processes`` and ``--process_id``, or set ``BA_JAX_DISTRIBUTED=1`` to
let JAX read the cluster from the environment (TPU pods, SLURM).
"""
import os

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file(
    "config", "configs/tiny.py", "ml_collections config file", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "run directory (resumes from "
                               "its checkpoints); required unless --dry_run")
_COORDINATOR = flags.DEFINE_string("coordinator_address", None,
                                   "host:port of process 0 (jax.distributed)")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None,
                                      "processes in the job (jax.distributed)")
_PROCESS_ID = flags.DEFINE_integer("process_id", None,
                                   "this process's index (jax.distributed)")
_DRY_RUN = flags.DEFINE_bool(
    "dry_run", False, "compile the sampler and the train step for the "
    "configured mesh on abstract shapes (no weights), print per-device memory "
    "and FLOPs per step, and exit; fake CPU devices come from XLA_FLAGS="
    "--xla_force_host_platform_device_count=N")
_ONE_UPDATE = flags.DEFINE_bool(
    "dry_run_one_update", False, "with --dry_run: compile one mini-batch "
    "update and scale its FLOPs (much faster for big configs)")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not _WORKDIR.value and not _DRY_RUN.value:
    raise app.UsageError("--workdir=DIR is required (the run directory)")
  logging.set_verbosity(logging.WARNING)  # orbax logs every step at INFO
  import jax
  if _COORDINATOR.value or _NUM_PROCESSES.value:
    jax.distributed.initialize(coordinator_address=_COORDINATOR.value,
                               num_processes=_NUM_PROCESSES.value,
                               process_id=_PROCESS_ID.value)
  elif os.environ.get("BA_JAX_DISTRIBUTED") == "1":
    jax.distributed.initialize()
  if _DRY_RUN.value:
    from ba_jax import dry_run
    print(dry_run.format_report(dry_run.dry_run(
        _CONFIG.value, one_update=_ONE_UPDATE.value)))
    return
  from ba_jax import trainer
  trainer.run(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
  app.run(main)
