"""SmolLM2-135M-Instruct on reasoning-gym: the difficulty probe and the RL
run's report (configs/smollm2_reasoning_gym.py).

    # 1. Before any RL run: the untrained model's held-out pass rate at a few
    #    difficulties (the config uses one whose rate lies in 0.1-0.6).
    python experiments/smollm2_reasoning_gym.py --stage=probe
    # 2. The run itself (python -m ba_jax.train ... --workdir=W), then:
    python experiments/smollm2_reasoning_gym.py --stage=report --workdir=W

The report reads the run's per-problem held-out results (W/heldout/
step_0.json and step_<last>.json, written by the trainer on the same
problems and keys) and gives the gain in greedy and sampled accuracy with a
95% paired bootstrap interval over problems (10,000 resamples; a problem's
sampled accuracy is the mean of its samples, so samples of one problem are
not counted as independent), and the curves (training reward, response
length, format failures, held-out accuracy) as a PNG.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import runpy
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "smollm2_reasoning_gym.py"
RESULTS = ROOT / "experiments" / "results"
# (label, basic_arithmetic settings) tried by the probe, easiest first.
CANDIDATES = (
    ("2 terms, 1 digit, + -", dict(min_digits=1, max_digits=1)),
    ("2 terms, 1-2 digits, + -", dict(min_digits=1, max_digits=2)),
)


def load_config(arg=None):
  return runpy.run_path(str(CONFIG))["get_config"](arg)


def paired_interval(before_P, after_P, *, resamples=10_000, seed=0):
  """Mean of after - before over problems and its 95% bootstrap interval."""
  diff = np.asarray(after_P, float) - np.asarray(before_P, float)
  rng = np.random.default_rng(seed)
  idx = rng.integers(0, len(diff), (resamples, len(diff)))
  means = diff[idx].mean(1)
  lo, hi = np.percentile(means, [2.5, 97.5])
  return float(diff.mean()), float(lo), float(hi)


def probe(output: pathlib.Path, num_problems: int) -> None:
  """The base model's held-out accuracy (greedy, and the config's eval
  samples) for each of CANDIDATES, written as a markdown table."""
  import jax
  from ba_jax.run import setup as setup_lib
  from ba_jax.run import trainer
  rows = []
  for label, settings in CANDIDATES:
    c = load_config()
    c.task.dataset_config.basic_arithmetic.update(settings)
    c.eval.num_problems = num_problems
    setup = setup_lib.make_setup(c)
    params = setup_lib.init_params(setup)
    t0 = time.perf_counter()
    tables = trainer.evaluate_correct(setup, params, jax.random.key(0))
    rows.append((label, settings, float(tables["greedy"].mean()),
                 float(tables["sampled"].mean()),
                 time.perf_counter() - t0))
    _write_probe(output, rows, c, num_problems)  # each candidate as it ends
  print(f"wrote {output}")


def _write_probe(output, rows, c, num_problems) -> None:
  lines = [
      "# SmolLM2-135M-Instruct on reasoning-gym basic_arithmetic: difficulty "
      "probe (before RL)", "",
      "`python experiments/smollm2_reasoning_gym.py --stage=probe`: the "
      "untrained model, the config's prompt (chat template, instruction "
      f"{c.task.instruction!r}) and answer rule ({c.task.answer_rule!r}), "
      f"{num_problems} held-out problems (heldout_seed={c.task.heldout_seed}),"
      f" max_new_tokens={c.rl.max_new_tokens}; greedy, and "
      f"{c.eval.samples_per_problem} samples per problem at "
      f"T={c.eval.temperature}. Every candidate has 2 terms and the operators "
      "+ and -, no parentheses or negation.", "",
      "| difficulty | settings | greedy | sampled | eval seconds |",
      "|---|---|---|---|---|"]
  lines += [f"| {label} | `{s}` | {g:.3f} | {sm:.3f} | {t:.0f} |"
            for label, s, g, sm, t in rows]
  lines += ["", "The config takes the difficulty whose two rates lie in "
            "0.1-0.6 (mixed groups). Eval seconds include compilation and "
            "depend on the host and its load."]
  output.write_text("\n".join(lines) + "\n")


def report(workdir: pathlib.Path, output: pathlib.Path, png: pathlib.Path,
           title: str) -> None:
  import json
  from ba_jax.run import metrics
  from ba_jax.run import trainer
  heldout = workdir / trainer.HELDOUT_DIR
  steps = sorted(int(p.stem.split("_")[1])
                 for p in heldout.glob("step_*.json"))
  first, last = steps[0], steps[-1]
  load = lambda s: json.loads((heldout / f"step_{s}.json").read_text())
  before, after = load(first), load(last)
  train = [dict(r, step=s) for s, r in
           sorted(metrics.read_metrics(str(workdir)).items())
           if "reward_mean" in r]
  lines = [f"# {title}", "",
           f"Run: `{workdir}`, steps {first} -> {last}. Held-out problems: "
           f"{len(before['greedy'])}, the same problems and sampling keys "
           "before and after. Interval: 95% paired bootstrap over problems "
           "(10,000 resamples).", "",
           "| held-out accuracy | before RL | after RL | gain | 95% interval |",
           "|---|---|---|---|---|"]
  for name in ("greedy", "sampled"):
    b = np.asarray(before[name], float).mean(1)
    a = np.asarray(after[name], float).mean(1)
    gain, lo, hi = paired_interval(b, a)
    lines.append(f"| {name} | {b.mean():.3f} | {a.mean():.3f} | "
                 f"{gain:+.3f} | [{lo:+.3f}, {hi:+.3f}] |")
  seconds = sum(r.get("time_step", 0.0) for r in train)
  lines += ["", f"RL steps: {len(train)}, their summed step time "
            f"{seconds / 60:.1f} min (sampling, rewards and updates; not the "
            "held-out evaluations or compilation).", "",
            "| step | reward | accuracy | length | format failures | "
            "mixed groups |", "|---|---|---|---|---|---|"]
  for r in train:
    lines.append(f"| {r['step']} | {r['reward_mean']:.3f} | "
                 f"{r['accuracy']:.3f} | {r['length_mean']:.1f} | "
                 f"{r.get('format_fail_frac', float('nan')):.3f} | "
                 f"{r['groups_mixed_frac']:.2f} |")
  output.write_text("\n".join(lines) + "\n")
  print("\n".join(lines))

  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
  x = [r["step"] for r in train]
  axes[0].plot(x, [r["reward_mean"] for r in train], label="reward")
  axes[0].plot(x, [r.get("format_fail_frac", np.nan) for r in train],
               label="format failures")
  axes[0].set(title="training batch", xlabel="RL step")
  axes[0].legend()
  axes[1].plot(x, [r["length_mean"] for r in train])
  axes[1].set(title="response length (tokens)", xlabel="RL step")
  evals = [(s, load(s)) for s in steps]
  for name in ("greedy", "sampled"):
    axes[2].plot([s for s, _ in evals],
                 [np.mean(t[name]) for _, t in evals], "o-", label=name)
  axes[2].set(title="held-out accuracy", xlabel="RL step")
  axes[2].legend()
  fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(png, dpi=100)
  print(f"wrote {output} and {png}")


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--stage", choices=("probe", "report"), required=True)
  p.add_argument("--workdir", help="the RL run's workdir (report)")
  p.add_argument("--num_problems", type=int, default=200)
  p.add_argument("--output", default=None)
  p.add_argument("--png", default=str(RESULTS / "smollm2_reasoning_gym.png"))
  p.add_argument("--title", default="SmolLM2-135M-Instruct, GRPO (balanced) "
                 "on reasoning-gym basic_arithmetic")
  args = p.parse_args(argv)
  if args.stage == "probe":
    probe(pathlib.Path(args.output or RESULTS / "smollm2_probe.md"),
          args.num_problems)
  else:
    if not args.workdir:
      sys.exit("--stage=report needs --workdir (the RL run's)")
    report(pathlib.Path(args.workdir),
           pathlib.Path(args.output or RESULTS / "smollm2_reasoning_gym.md"),
           pathlib.Path(args.png), args.title)


if __name__ == "__main__":
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  main()
