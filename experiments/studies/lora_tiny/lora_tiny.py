"""The default job with LoRA adapters next to the same job without them.

    python -m experiments.studies.lora_tiny.lora_tiny --workdir=/tmp/lora_tiny \
        --output=experiments/studies/lora_tiny/results/lora_tiny.md

Runs ``configs/tiny.py:lora`` (the warm-up trains the whole tiny policy, RL
trains rank-8 adapters on it) and ``configs/tiny.py`` (RL trains every
parameter), one after the other in fresh workdirs, and writes for each: the
trainable parameters, the wall time of the whole command (warm-up and
compiles included), the size of one checkpoint step, and held-out accuracy
before and after RL with the gain's 95% paired bootstrap interval over the
128 held-out problems (a problem's score: its mean over the samples).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

from experiments.studies.smollm2_reasoning_gym.smollm2_reasoning_gym import paired_interval

ROOT = pathlib.Path(__file__).resolve().parents[3]
RUNS = (("LoRA rank 8 (`configs/tiny.py:lora`)", "configs/tiny.py:lora", "lora"),
        ("every parameter (`configs/tiny.py`)", "configs/tiny.py", "full"))


def _size(path: pathlib.Path) -> int:
  return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _trainable(log: str) -> str:
  for line in log.splitlines():
    if line.startswith("LoRA:"):  # "...; 19,456 trainable of 120,192 parameters"
      return line.split("; ")[-1].replace(" trainable", "").replace(" parameters", "")
  return "all"


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--workdir", default="/tmp/lora_tiny")
  parser.add_argument("--output", default=str(ROOT / "experiments/studies/lora_tiny/results/lora_tiny.md"))
  args = parser.parse_args()
  rows = []
  for label, config, name in RUNS:
    workdir = pathlib.Path(args.workdir) / name
    if workdir.exists():
      raise SystemExit(f"{workdir} exists: pass a new --workdir (the wall times are of fresh runs)")
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "ba_jax.train", f"--config={config}",
                           f"--workdir={workdir}", "--config.log.progress_bar=false"],
                          cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode:
      raise SystemExit(f"{config} failed:\n{done.stderr[-3000:]}")
    summary = json.loads((workdir / "summary.json").read_text())
    steps = sorted(int(p.stem.split("_")[1]) for p in (workdir / "heldout").glob("step_*.json"))
    before = json.loads((workdir / "heldout" / f"step_{steps[0]}.json").read_text())
    after = json.loads((workdir / "heldout" / f"step_{steps[-1]}.json").read_text())
    cells = []
    for kind in ("sampled", "greedy"):
      gain, lo, hi = paired_interval([sum(r) / len(r) for r in before[kind]],
                                     [sum(r) / len(r) for r in after[kind]])
      cells.append(f"{summary['before_rl'][f'heldout_acc_{kind}']:.3f} -> "
                   f"{summary['after_rl'][f'heldout_acc_{kind}']:.3f} "
                   f"({gain:+.3f}, [{lo:+.3f}, {hi:+.3f}])")
    last = pathlib.Path(workdir / "checkpoints" / str(summary["step"]))
    rows.append(f"| {label} | {_trainable(done.stdout)} | {wall:.0f} | {_size(last) / 1024:.0f} KiB | "
                + " | ".join(cells) + " |")
  text = "\n".join([
      "# The default job with LoRA adapters and without",
      "",
      f"Written by `python -m experiments.studies.lora_tiny.lora_tiny` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
      f"{os.cpu_count()} CPU cores; the two runs one after the other. Held-out: 128 problems, "
      "sampled (T = 1, 4 each) and greedy; in brackets the gain and its 95% paired bootstrap "
      "interval over problems.",
      "",
      "| RL trains | trainable parameters | wall (s) | one checkpoint step | sampled: before -> after | "
      "greedy: before -> after |",
      "|---|---|---|---|---|---|",
      *rows, ""])
  pathlib.Path(args.output).write_text(text)
  print(text)


if __name__ == "__main__":
  main()
