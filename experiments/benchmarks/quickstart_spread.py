"""The quick start's closing line under settings that change floating-point rounding.

    python -m experiments.benchmarks.quickstart_spread \
        --output=experiments/benchmarks/results/quickstart_spread.md

Runs the README's default job (``configs/tiny.py``, same seeds) once per
variant, one after the other in fresh workdirs, and tabulates its closing
line. The variants change nothing but how XLA:CPU rounds: its compile options
(``xla_cpu_compile``), fast-math, and the threads a program may use (one
core through ``taskset``), as another host's CPU would. The spread of the
table is what a newcomer can expect on their own machine.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
LINE = re.compile(r"held-out accuracy, before -> after RL: sampled ([\d.]+) -> ([\d.]+); "
                  r"greedy ([\d.]+) -> ([\d.]+)")
# (name, extra flags, extra XLA_FLAGS, command prefix)
VARIANTS = (
    ("as shipped (`xla_cpu_compile=fast`, 2 cores)", [], "", []),
    ("`--config.xla_cpu_compile=default`", ["--config.xla_cpu_compile=default"], "", []),
    ("XLA:CPU fast-math on", [], "--xla_cpu_enable_fast_math=true", []),
    ("one core (`taskset -c 0`)", [], "", ["taskset", "-c", "0"]),
)


def run_variant(flags, xla_flags, prefix, workdir):
  env = dict(os.environ)
  if xla_flags:
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + xla_flags).strip()
  cmd = prefix + [sys.executable, "-m", "ba_jax.train", "--config=configs/tiny.py",
                  f"--workdir={workdir}", "--config.log.progress_bar=false", *flags]
  start = time.perf_counter()
  out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
  seconds = time.perf_counter() - start
  if out.returncode:
    raise SystemExit(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stderr[-3000:]}")
  match = LINE.search(out.stdout + out.stderr)
  if not match:
    raise SystemExit(f"{' '.join(cmd)}: no closing accuracy line in its output")
  return [float(x) for x in match.groups()], seconds


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--output", required=True)
  args = parser.parse_args()
  rows = []
  for name, flags, xla_flags, prefix in VARIANTS:
    workdir = tempfile.mkdtemp(prefix="ba_spread_")
    try:
      figures, seconds = run_variant(flags, xla_flags, prefix, workdir)
    finally:
      shutil.rmtree(workdir, ignore_errors=True)
    rows.append((name, figures, seconds))
    print(name, figures, f"{seconds:.0f} s", flush=True)
  lines = ["# The quick start's closing line across rounding variants", "",
           "`python -m experiments.benchmarks.quickstart_spread --output=" + args.output + "`",
           "", "128 held-out problems; sampled: T = 1, 4 samples each.", "",
           "| variant | sampled before | sampled after | greedy before | greedy after | wall s |",
           "|---|---|---|---|---|---|"]
  for name, f, seconds in rows:
    lines.append(f"| {name} | {f[0]:.3f} | {f[1]:.3f} | {f[2]:.3f} | {f[3]:.3f} | {seconds:.0f} |")
  cols = list(zip(*[f for _, f, _ in rows]))
  lines += ["", "Range over the variants: " + "; ".join(
      f"{label} {min(c):.3f}-{max(c):.3f}" for label, c in zip(
          ("sampled before", "sampled after", "greedy before", "greedy after"), cols)) + ".",
            "Wall times were taken with other work on the host: they say nothing about speed."]
  pathlib.Path(args.output).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
  main()
