"""Compile a config's train step and rollout on its own mesh, without weights,
and print per-device memory and FLOPs (``ba_jax.scaling``)::

    python -m ba_jax.dry_run --config=configs/qwen25_math_7b_dapo17k.py \\
        --num_cpu_devices=64
"""
import jax

from ba_jax.scaling import compile as compile_lib
from ba_jax.scaling import report as report_lib



def _main():
  """``python -m ba_jax.dry_run``: flags only (defined here, not on import,
  so that importing this module defines no flags)."""
  import json

  from absl import app, flags, logging
  from ml_collections import config_flags

  config = config_flags.DEFINE_config_file(
      "config", None, "ml_collections config file", lock_config=True)
  cpu_devices = flags.DEFINE_integer(
      "num_cpu_devices", 0, "fake this many CPU devices (0: leave JAX's "
      "default); the same as XLA_FLAGS=--xla_force_host_platform_device_count")
  one_update = flags.DEFINE_bool(
      "one_update", False, "compile one mini-batch update, not the whole "
      "step (a check; see ba_jax/scaling/compile.py)")
  sample = flags.DEFINE_bool(
      "sample", True, "also compile the rollout's program (the engine when "
      "the config's decode slots are fewer than the rows, else the static "
      "sampler)")
  train = flags.DEFINE_bool("train", True, "compile the train step")
  json_out = flags.DEFINE_string("json_out", None, "write the report here")

  def main(argv):
    logging.set_verbosity(logging.WARNING)
    if len(argv) > 1:
      raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if config.value is None:
      raise app.UsageError("--config=configs/<file>.py is required")
    if cpu_devices.value:
      jax.config.update("jax_num_cpu_devices", cpu_devices.value)
    report = compile_lib.dry_run(config.value, sample=sample.value,
                     one_update=one_update.value, train=train.value)
    print(report_lib.format_report(report))
    text = json.dumps(report, indent=1)
    if json_out.value:
      with open(json_out.value, "w") as f:
        f.write(text + "\n")
    else:
      print(text)

  app.run(main)



if __name__ == "__main__":
  _main()
