"""Compile a config's train step and rollout on its own mesh, without weights,
and print per-device memory, fit and FLOPs (``ba_jax.scaling``)::

    python -m ba_jax.dry_run --config=configs/qwen25_math_7b_dapo17k.py --target=v5e:8x8

``--target`` compiles with the named chip's own compiler on compile-only
devices (``pip install -e ".[aot]"``; ``ba_jax.scaling.targets``): a TPU
topology as libtpu names it (``v5e:8x8``, ``v5p:4x4x4``, ``v6e:8x8``) or a
GPU mesh (``h100:8x8``), ``--num_slices`` for several TPU slices. A program
that does not fit is exit status 3 (``MISFIT_EXIT``) with one line naming it. Without a target,
``--num_cpu_devices=64`` compiles with XLA:CPU on fake devices: an estimate.
"""
import jax

from ba_jax.scaling import compile as compile_lib
from ba_jax.scaling import report as report_lib
from ba_jax.scaling import targets as targets_lib

MISFIT_EXIT = 3  # a program does not fit the target (1 stays Python's own error status)



def _main():
  """``python -m ba_jax.dry_run``: flags only (defined here, not on import,
  so that importing this module defines no flags)."""
  import json
  import sys

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
  target = flags.DEFINE_string(
      "target", None, "compile for this chip's slice with its own compiler: "
      "a libtpu topology (v5e:8x8, v5p:4x4x4, v6e:8x8, v4:4x4x4) or h100:HOSTSxGPUS")
  num_slices = flags.DEFINE_integer("num_slices", 1, "TPU slices of --target "
                                    "(data parallel across them)")

  def main(argv):
    logging.set_verbosity(logging.WARNING)
    if len(argv) > 1:
      raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if config.value is None:
      raise app.UsageError("--config=configs/<file>.py is required")
    if cpu_devices.value and target.value:
      raise app.UsageError("--num_cpu_devices and --target exclude each other")
    if cpu_devices.value:
      jax.config.update("jax_num_cpu_devices", cpu_devices.value)
    chosen = None
    if target.value:
      try:
        chosen = targets_lib.parse_target(target.value, num_slices.value)
      except ValueError as e:
        raise app.UsageError(str(e)) from e
    report = compile_lib.dry_run(config.value, target=chosen, sample=sample.value,
                                 one_update=one_update.value, train=train.value)
    print(report_lib.format_report(report))
    text = json.dumps(report, indent=1)
    if json_out.value:
      with open(json_out.value, "w") as f:
        f.write(text + "\n")
    else:
      print(text)
    misfit = report_lib.misfit_line(report)
    if misfit:
      print(misfit, file=sys.stderr)
      sys.exit(MISFIT_EXIT)

  app.run(main)



if __name__ == "__main__":
  _main()
