"""The aggregation ablation: one config under every aggregation rule, S seeds.

    python -m experiments.studies.aggregation_ablation.ablate_aggregation --config=configs/tiny.py \
        --seeds=3 --outdir=experiments/studies/aggregation_ablation/results

For each seed the supervised warm-up runs once and is exported; every mode
then starts RL from that same policy (`--config.init_from`), so modes differ
only in how the loss aggregates. Runs go two at a time on separate cores.
A finished run (its `summary.json` exists) is not rerun, so an interrupted
ablation resumes. Writes, under --outdir: `results.jsonl` (one row per run),
`table.md`, and `curves.png`.

Collapse: a run collapsed when its training accuracy, smoothed over 5 steps,
ends below half of its peak (it fell and did not recover).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import pathlib
import subprocess
import sys

import numpy as np

from ba_jax.loss.aggregation import MODES
CURVES = (("reward_mean", "training reward"),
          ("heldout_acc_sampled", "held-out accuracy (sampled)"),
          ("length_mean", "response length"),
          ("w_pos_share", "positive share W+/(W+ + W-)"))


def _run(cmd: list[str], log_path: pathlib.Path, threads: int) -> None:
  env = dict(os.environ)
  # One process per core: keep each XLA and BLAS to its own threads.
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                      " --xla_cpu_multi_thread_eigen=false").strip()
  env["OMP_NUM_THREADS"] = env["OPENBLAS_NUM_THREADS"] = str(threads)
  with open(log_path, "w") as log:
    proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
  if proc.returncode:
    tail = log_path.read_text()[-3000:]
    raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}); "
                       f"log {log_path}:\n{tail}")


def _train_cmd(config: str, variant: str, workdir: pathlib.Path,
               overrides: list[str]) -> list[str]:
  spec = f"{config}:{variant}" if variant else config
  return [sys.executable, "-m", "ba_jax.train", f"--config={spec}",
          f"--workdir={workdir}", *overrides]


def warmup_and_export(config, variant, seed, outdir, overrides, threads):
  """SFT once per seed; returns the exported Hugging Face directory."""
  workdir = outdir / "runs" / f"warmup_s{seed}"
  export_dir = workdir / "hf"
  if (export_dir / "config.json").exists():
    return export_dir
  workdir.mkdir(parents=True, exist_ok=True)
  _run(_train_cmd(config, variant, workdir,
                  [f"--config.seed={seed}", "--config.rl.steps=0",
                   *overrides]), workdir / "log.txt", threads)
  _run([sys.executable, "-m", "ba_jax.export", f"--workdir={workdir}",
        f"--output_dir={export_dir}"], workdir / "export_log.txt", threads)
  return export_dir


def rl_run(config, variant, mode, seed, init_dir, outdir, overrides, threads,
           eval_every):
  workdir = outdir / "runs" / f"{mode}_s{seed}"
  if not (workdir / "summary.json").exists():
    workdir.mkdir(parents=True, exist_ok=True)
    agg = f"agg={mode}"
    spec_variant = f"{variant},{agg}" if variant else agg
    _run(_train_cmd(config, spec_variant, workdir,
                    [f"--config.seed={seed}", f"--config.init_from={init_dir}",
                     "--config.sft.steps=0", "--config.log.progress_bar=False",
                     f"--config.eval.every={eval_every}",
                     *overrides]), workdir / "log.txt", threads)
  return summarise(workdir, mode, seed)


def _read_jsonl(path: pathlib.Path) -> list[dict]:
  by_step = {}
  for line in path.read_text().splitlines():
    record = json.loads(line)
    by_step.setdefault(record["step"], {}).update(record)
  return [by_step[s] for s in sorted(by_step)]


def _smooth(x, width=5):
  x = np.asarray(x, float)
  return np.array([x[max(0, i - width + 1):i + 1].mean() for i in range(len(x))])


def collapsed(accuracy: list[float]) -> bool:
  """Smoothed training accuracy ends below half its peak."""
  if not accuracy:
    return False
  s = _smooth(accuracy)
  return bool(s.max() > 0 and s[-1] < 0.5 * s.max())


def summarise(workdir: pathlib.Path, mode: str, seed: int) -> dict:
  records = _read_jsonl(workdir / "metrics.jsonl")
  summary = json.loads((workdir / "summary.json").read_text())
  def series(key):
    return [r.get(key) for r in records]
  def nanmean(key):
    values = [v for v in series(key) if v is not None]
    return float(np.mean(values)) if values else float("nan")
  reward = [v for v in series("reward_mean") if v is not None]
  evals = _read_jsonl(workdir / "eval.jsonl")
  curves = {key: (series("step"), series(key)) for key, _ in CURVES
            if key != "heldout_acc_sampled"}
  curves["heldout_acc_sampled"] = ([r["step"] for r in evals],
                                   [r["heldout_acc_sampled"] for r in evals])
  return {
      "mode": mode, "seed": seed, "workdir": str(workdir),
      "steps": len(records),
      "heldout_before": summary["before_rl"]["heldout_acc_sampled"],
      "heldout_after": summary["after_rl"]["heldout_acc_sampled"],
      "heldout_greedy_before": summary["before_rl"]["heldout_acc_greedy"],
      "heldout_greedy_after": summary["after_rl"]["heldout_acc_greedy"],
      # Area under the training-reward curve, per step (the mean reward).
      "reward_auc": float(np.mean(reward)) if reward else float("nan"),
      "collapsed": collapsed([v for v in series("accuracy") if v is not None]),
      "pos_share_mean": nanmean("w_pos_share"),
      "pos_frac_mean": nanmean("pos_frac"),
      "length_mean": nanmean("length_mean"),
      "length_cv_mean": nanmean("length_cv_in_group"),
      "length_gap_mean": nanmean("length_gap_pos_neg"),
      "curves": curves,
  }


def _pm(values):
  values = np.asarray([v for v in values if v == v], float)
  if not len(values):
    return "n/a"
  return f"{values.mean():.3f} ± {values.std():.3f}"


def table(rows: list[dict], command: str) -> str:
  lines = [
      "# Aggregation ablation", "", f"Command: `{command}`", "",
      "Held-out accuracy is sampled accuracy on the config's held-out problems "
      "(mean ± std over seeds, std with ddof 0); reward AUC is the mean "
      "training reward over the RL steps; a run collapsed when its 5-step "
      "smoothed training accuracy ends below half its peak. Positive share is "
      "W+/(W+ + W-) averaged over steps, next to the mean fraction of "
      "positive sequences; lengths in tokens, gap = mean length of positive "
      "minus negative responses.", "",
      "| mode | seeds | held-out acc before | held-out acc after | greedy after "
      "| reward AUC | collapsed | positive share | positive fraction "
      "| length | length CV | length gap |",
      "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
  ]
  for mode in MODES:
    rs = [r for r in rows if r["mode"] == mode]
    if not rs:
      continue
    col = lambda k: [r[k] for r in rs]
    lines.append(
        f"| {mode} | {len(rs)} | {_pm(col('heldout_before'))} | "
        f"{_pm(col('heldout_after'))} | {_pm(col('heldout_greedy_after'))} | "
        f"{_pm(col('reward_auc'))} | {sum(col('collapsed'))}/{len(rs)} | "
        f"{_pm(col('pos_share_mean'))} | {_pm(col('pos_frac_mean'))} | "
        f"{_pm(col('length_mean'))} | {_pm(col('length_cv_mean'))} | "
        f"{_pm(col('length_gap_mean'))} |")
  return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: pathlib.Path) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, len(CURVES), figsize=(5 * len(CURVES), 3.6))
  for ax, (key, title) in zip(axes, CURVES):
    for mode in MODES:
      rs = [r for r in rows if r["mode"] == mode]
      if not rs:
        continue
      steps = rs[0]["curves"][key][0]
      values = np.array([[np.nan if v is None else v for v in r["curves"][key][1]]
                         for r in rs if r["curves"][key][0] == steps], float)
      if not values.size or np.all(np.isnan(values)):
        continue
      valid = ~np.all(np.isnan(values), axis=0)
      x = np.asarray(steps)[valid]
      v = values[:, valid]
      mean = np.nanmean(v, axis=0)
      ax.plot(x, mean, label=mode, marker="." if len(x) < 12 else None)
      if len(rs) > 1:
        ax.fill_between(x, np.nanmin(v, axis=0), np.nanmax(v, axis=0),
                        alpha=0.2)
    ax.set_title(title)
    ax.set_xlabel("RL step")
  axes[0].legend()
  fig.tight_layout()
  fig.savefig(path, dpi=90)
  plt.close(fig)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--config", default="configs/tiny.py")
  parser.add_argument("--variant", default="",
                      help="config arguments after the colon, e.g. gap=-6")
  parser.add_argument("--modes", default=",".join(MODES))
  parser.add_argument("--seeds", type=int, default=3)
  parser.add_argument("--parallel", type=int, default=2)
  parser.add_argument("--outdir", default="experiments/studies/aggregation_ablation/results")
  parser.add_argument("--eval_every", type=int, default=10,
                      help="held-out evaluation every this many RL steps")
  parser.add_argument("--override", action="append", default=[],
                      help="extra --config.key=value for every run")
  args = parser.parse_args(argv)
  modes = [m for m in args.modes.split(",") if m]
  for mode in modes:
    if mode not in MODES:
      parser.error(f"unknown mode {mode!r}; expected some of {list(MODES)}")
  outdir = pathlib.Path(args.outdir)
  outdir.mkdir(parents=True, exist_ok=True)
  threads = max(1, (os.cpu_count() or 2) // max(1, args.parallel))
  command = " ".join(["python", "experiments/studies/aggregation_ablation/ablate_aggregation.py",
                      *(argv if argv is not None else sys.argv[1:])])
  with concurrent.futures.ThreadPoolExecutor(args.parallel) as pool:
    inits = dict(zip(range(args.seeds), pool.map(
        lambda s: warmup_and_export(args.config, args.variant, s, outdir,
                                    args.override, threads),
        range(args.seeds))))
    jobs = [(m, s) for s in range(args.seeds) for m in modes]
    rows = list(pool.map(
        lambda job: rl_run(args.config, args.variant, job[0], job[1],
                           inits[job[1]], outdir, args.override, threads,
                           args.eval_every),
        jobs))
  with open(outdir / "results.jsonl", "w") as f:
    for row in rows:
      f.write(json.dumps(row) + "\n")
  (outdir / "table.md").write_text(table(rows, command))
  plot(rows, outdir / "curves.png")
  print((outdir / "table.md").read_text())
  return rows


if __name__ == "__main__":
  main()
