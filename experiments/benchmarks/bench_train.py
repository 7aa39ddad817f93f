"""Step-time split and throughput of the tiny GRPO config.

    python -m experiments.benchmarks.bench_train [--steps 20] [--grader rewards|builtin]
    python -m experiments.benchmarks.bench_train --full_job   # also time the default job

Runs configs/tiny.py (warm-up shortened: it only sets the policy's starting
point) and reports, over the RL steps after the first (which compiles): the
mean time per step in sampling, rewards and training, sampled tokens per
second, and the peak resident memory of the process. With ``--full_job`` it
also runs the whole default job, ``python -m ba_jax.train
--config=configs/tiny.py``, in a subprocess and records its wall time and
held-out accuracy before and after RL. Writes
experiments/benchmarks/results/train_bench.md.
"""
import argparse
import os
import platform
import json
import resource
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ba_jax.run import trainer  # noqa: E402
from tests import trainer_utils


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--sft_steps", type=int, default=100)
  parser.add_argument("--grader", default="rewards",
                      help="rewards (the config's default) or builtin")
  parser.add_argument("--full_job", action="store_true")
  parser.add_argument("--out", default=os.path.join(
      REPO, "experiments", "results", "train_bench.md"))
  args = parser.parse_args()
  config = trainer_utils.load_config()
  config.rl.steps = args.steps
  config.sft.steps = args.sft_steps
  config.task.grader = args.grader
  config.log.progress_bar = False
  config.log.backends = ""
  config.checkpoint.every = 0
  t0 = time.perf_counter()
  with tempfile.TemporaryDirectory() as workdir:
    out = trainer.run(config, workdir)
  wall = time.perf_counter() - t0
  rows = out["history"][1:]  # step 1 compiles the sampler and the update
  mean = lambda k: float(np.mean([r[k] for r in rows]))
  first = out["history"][0]
  peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
  rl = config.rl
  lines = [
      "# Train step benchmark: configs/tiny.py",
      "",
      f"Command: `python -m experiments.benchmarks.bench_train --steps {args.steps} "
      f"--sft_steps {args.sft_steps} --grader {args.grader}"
      + (" --full_job`" if args.full_job else "`"),
      "",
      f"Machine: {os.cpu_count()} CPU cores ({platform.processor() or 'cpu'}),"
      f" jax {jax.__version__}, {jax.device_count()} device(s). "
      "Figures taken on a 2-core CPU shared with other engineers' tests and "
      "benchmarks, so they are upper bounds on an idle machine's times.",
      "",
      f"Batch: {rl.prompts_per_step} prompts x {rl.group_size} samples, "
      f"max {rl.max_new_tokens} new tokens, {rl.num_minibatches} "
      f"mini-batches x {rl.ppo_epochs} epoch(s); model hidden "
      f"{config.model.hidden_size}, {config.model.num_layers} layers.",
      "",
      f"Mean over RL steps 2..{args.steps} (step 1 compiles: "
      f"{first['time_step']:.1f} s):",
      "",
      "| phase | seconds / step | share |",
      "|---|---|---|",
  ]
  total = mean("time_step")
  for name in ("sampling", "rewards", "training"):
    t = mean(f"time_{name}")
    lines.append(f"| {name} | {t:.4f} | {t / total:.0%} |")
  lines += [
      f"| whole step | {total:.4f} | 100% |",
      "",
      f"- sampled tokens per second (whole step): {mean('tokens_per_s'):.0f}",
      f"- sampled tokens per step: {mean('sampled_tokens'):.0f}",
      f"- peak resident memory of the benchmark process (warm-up + RL in process): {peak_mib:.0f} MiB",
      f"- wall time of the whole run (warm-up, evals, compiles): {wall:.0f} s",
      "",
  ]
  if args.full_job:
    lines += full_job_lines()
  with open(args.out, "w") as f:
    f.write("\n".join(lines))
  print("\n".join(lines))


def full_job_lines() -> list[str]:
  """Runs the default CPU job as a user would and reports it."""
  with tempfile.TemporaryDirectory() as workdir:
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "ba_jax.train", "--config=configs/tiny.py",
         f"--workdir={workdir}", "--config.log.progress_bar=False"],
        cwd=REPO, capture_output=True, text=True, check=True)
    wall = time.perf_counter() - t0
    with open(os.path.join(workdir, "summary.json")) as f:
      summary = json.load(f)
  before, after = summary["before_rl"], summary["after_rl"]
  return [
      "## The default CPU job",
      "",
      "`python -m ba_jax.train --config=configs/tiny.py --workdir=DIR` "
      "(warm-up, evaluation, 60 GRPO steps with balanced aggregation, "
      "evaluation), same shared machine:",
      "",
      f"- wall time: {wall:.0f} s",
      "- held-out accuracy, 128 problems, sampled at T=1.0 with 4 samples "
      f"each: {before['heldout_acc_sampled']:.3f} before RL -> "
      f"{after['heldout_acc_sampled']:.3f} after",
      f"- held-out accuracy, greedy: {before['heldout_acc_greedy']:.3f} -> "
      f"{after['heldout_acc_greedy']:.3f}",
      "",
  ]


if __name__ == "__main__":
  main()
