"""Command line: ``python -m ba_jax.train --config=configs/tiny.py --workdir=DIR``.

Overrides: ``--config.rl.steps=10``; variants: ``--config=configs/tiny.py:smoke``.
Memory and FLOPs of a config without weights: ``python -m ba_jax.dry_run``.
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
                               "its checkpoints)", required=True)
_COORDINATOR = flags.DEFINE_string("coordinator_address", None,
                                   "host:port of process 0 (jax.distributed)")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None,
                                      "processes in the job (jax.distributed)")
_PROCESS_ID = flags.DEFINE_integer("process_id", None,
                                   "this process's index (jax.distributed)")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  logging.set_verbosity(logging.WARNING)  # orbax logs every step at INFO
  import jax
  if _COORDINATOR.value or _NUM_PROCESSES.value:
    jax.distributed.initialize(coordinator_address=_COORDINATOR.value,
                               num_processes=_NUM_PROCESSES.value,
                               process_id=_PROCESS_ID.value)
  elif os.environ.get("BA_JAX_DISTRIBUTED") == "1":
    jax.distributed.initialize()
  from ba_jax import trainer
  overrides = config_flags.get_override_values(flags.FLAGS["config"])
  trainer.run(_CONFIG.value, _WORKDIR.value, explicit=set(overrides))


if __name__ == "__main__":
  app.run(main)
