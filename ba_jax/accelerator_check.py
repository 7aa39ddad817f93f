"""Command line: ``python -m ba_jax.accelerator_check [--json_out=FILE]``.

On this machine's GPU or TPU: names the devices and the chip's peak bf16
FLOP/s, runs the test suite's device-sensitive tests on the real backend,
times a train step and a decode step of a random ~0.5B-parameter Qwen2
(tokens/s, MFU) and sets the dry run's memory figures against the device's;
a few lines, and the whole report as JSON. On CPU: a tiny model, no tests,
seconds. The logic is ``ba_jax.scaling.accelerator``; ``--parts`` picks
some of it. Exit status 0, or 1 when a test failed or the device's memory
is exceeded.
"""
import json
import sys

from absl import flags


def _define_flags(fv: flags.FlagValues) -> dict:
  from ba_jax.scaling import accelerator
  return dict(
      parts=flags.DEFINE_list(
          "parts", list(accelerator.PARTS), "what to run: some of "
          + ", ".join(accelerator.PARTS), flag_values=fv),
      model=flags.DEFINE_enum(
          "model", "auto", ["auto", *accelerator.MODELS], "auto: qwen2_0p5b "
          "on an accelerator, tiny on CPU", flag_values=fv),
      iters=flags.DEFINE_integer("iters", 3, "timed calls after the first "
                                 "(the median is reported)", flag_values=fv),
      test_timeout=flags.DEFINE_integer(
          "test_timeout", 300, "seconds the tests may take", flag_values=fv),
      json_out=flags.DEFINE_string(
          "json_out", "accelerator_check.json", "the report, as JSON",
          flag_values=fv),
  )


def main(argv) -> int:
  """The command on ``argv`` (``argv[0]`` is the program); the exit status."""
  fv = flags.FlagValues()
  f = _define_flags(fv)
  if {"--help", "-h", "--helpfull"} & set(argv[1:]):
    print(fv.get_help())
    return 0
  try:
    rest = fv(argv)
  except flags.Error as e:
    sys.exit(f"FATAL Flags parsing error: {e}")
  if len(rest) > 1:
    sys.exit(f"FATAL: unexpected arguments: {rest[1:]}")
  from absl import logging
  logging.set_verbosity(logging.WARNING)
  from ba_jax.scaling import accelerator
  try:
    report = accelerator.check(parts=tuple(f["parts"].value),
                               model=f["model"].value, iters=f["iters"].value,
                               test_timeout=f["test_timeout"].value,
                               log=lambda line: print(line, flush=True))
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr, flush=True)
    return 2
  with open(f["json_out"].value, "w") as out:
    out.write(json.dumps(report, indent=1) + "\n")
  print(f"report: {f['json_out'].value} ({report['wall_s']:g} s)", flush=True)
  failed = report.get("tests", {}).get("ok") is False
  return 1 if failed or report.get("memory", {}).get("fits") is False else 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
