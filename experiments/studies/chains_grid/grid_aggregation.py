"""The aggregation grid on the length-controlled chains task (configs/chains.py).

    python -m experiments.studies.chains_grid.grid_aggregation --seeds=5 --parallel=2 \
        --outdir=experiments/studies/chains_grid/results
    python -m experiments.studies.chains_grid.grid_aggregation --quick   # one cell, one seed

Cells: length-gap sign {neg, none, pos} x length spread {low, high}; in each,
the four aggregation rules x ``--seeds`` seeds. Common random numbers: per
(spread, seed) the supervised warm-up runs once and is exported (its traces
do not depend on the rule, so the three gaps share it), and every rule and
gap starts RL from that policy with the same seed, so runs of one seed differ
only in the verifier rule and the aggregation. Finished runs (``summary.json``
present) are not rerun. Jobs run seed by seed (a seed's warm-ups, then its
RL runs), so a grid stopped early leaves whole seeds behind; every process
shares one persistent XLA compilation cache (``runs/jax_cache``), so only the
first run of each (spread, aggregation) compiles. Writes under --outdir:
``results.jsonl`` (one row per run), ``table.md`` (per-cell means, paired differences, stability), and
``curves_<spread>_<gap>.png`` (accuracy, entropy, length per rule).

Paired differences: for each cell and pair of rules (BA - token, BA -
sequence, token - sequence), the per-seed difference of the outcome (held-out
sampled accuracy after RL, and the mean training reward over RL), with a 95%
percentile bootstrap interval of the mean over seeds (scipy.stats.bootstrap,
10,000 resamples) and an exact two-sided sign-test p-value
(scipy.stats.binomtest) over the non-zero differences.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import pathlib
import sys
import time

import numpy as np

from ba_jax.ablation import stability
from experiments.studies.aggregation_ablation import ablate_aggregation as ablation

MODES = ("token", "sequence", "dr_grpo", "balanced")
GAPS, SPREADS = ("neg", "none", "pos"), ("low", "high")
PAIRS = (("balanced", "token"), ("balanced", "sequence"), ("token", "sequence"))
OUTCOMES = (("heldout_after", "held-out accuracy after RL"),
            ("reward_auc", "mean training reward"))
CURVES = (("accuracy", "training accuracy"), ("entropy", "policy entropy"),
          ("length_mean", "response length"))
CONFIG = "configs/chains.py"


def _variant(*parts) -> str:
  return ",".join(p for p in parts if p)


def warmup(spread, seed, args, threads) -> pathlib.Path:
  """Once per (spread, seed): warm-up, then export for ``init_from``."""
  workdir = args.outdir / "runs" / f"warmup_{spread}_s{seed}"
  export_dir = workdir / "hf"
  if (export_dir / "config.json").exists():
    return export_dir
  workdir.mkdir(parents=True, exist_ok=True)
  ablation._run(ablation._train_cmd(
      CONFIG, _variant(f"spread={spread}", args.variant), workdir,
      [f"--config.seed={seed}", "--config.rl.steps=0", *args.override]),
      workdir / "log.txt", threads)
  ablation._run([sys.executable, "-m", "ba_jax.export", f"--workdir={workdir}",
                 f"--output_dir={export_dir}"], workdir / "export_log.txt",
                threads)
  return export_dir


def rl_run(job, init_dir, args, threads) -> dict:
  spread, gap, mode, seed = job
  workdir = args.outdir / "runs" / f"{spread}_{gap}_{mode}_s{seed}"
  if not (workdir / "summary.json").exists():
    workdir.mkdir(parents=True, exist_ok=True)
    variant = _variant(f"spread={spread},gap={gap},agg={mode}", args.variant)
    t0 = time.perf_counter()
    ablation._run(ablation._train_cmd(CONFIG, variant, workdir, [
        f"--config.seed={seed}", f"--config.init_from={init_dir}",
        "--config.sft.steps=0", "--config.log.progress_bar=False",
        "--config.log.backends=", *args.override]),
        workdir / "log.txt", threads)
    (workdir / "wall_s.txt").write_text(f"{time.perf_counter() - t0:.1f}\n")
    print(f"[{time.strftime('%H:%M:%S')}] done {workdir.name}", flush=True)
  return summarise(workdir, dict(spread=spread, gap=gap, mode=mode, seed=seed))


def summarise(workdir: pathlib.Path, key: dict) -> dict:
  records = ablation._read_jsonl(workdir / "metrics.jsonl")
  summary = json.loads((workdir / "summary.json").read_text())
  def series(name):
    return [r.get(name) for r in records]
  def mean(name):
    values = [v for v in series(name) if v is not None]
    return float(np.mean(values)) if values else float("nan")
  def first(name):
    values = [v for v in series(name) if v is not None]
    return float(values[0]) if values else float("nan")
  wall = workdir / "wall_s.txt"
  return dict(
      key, workdir=str(workdir), steps=len(records),
      wall_s=float(wall.read_text()) if wall.exists() else None,
      accuracy=mean("accuracy"),
      groups_mixed_frac=mean("groups_mixed_frac"),
      heldout_before=summary["before_rl"]["heldout_acc_sampled"],
      heldout_after=summary["after_rl"]["heldout_acc_sampled"],
      reward_auc=mean("reward_mean"),
      length_cv=mean("length_cv_in_group"),
      length_cv_in_subset=mean("length_cv_in_subset"),
      length_gap_in_group_rel=mean("length_gap_in_group_rel"),
      length_cv_first=first("length_cv_in_group"),
      length_gap_in_group_rel_first=first("length_gap_in_group_rel"),
      weight_length_corr=mean("weight_length_corr"),
      stability=stability.report(records),
      curves={name: series(name) for name, _ in CURVES})


def paired(rows: list[dict], a: str, b: str, outcome: str) -> dict:
  """Per-seed ``a - b`` of ``outcome`` over the seeds both ran, its mean,
  95% bootstrap interval and exact sign-test p-value."""
  from scipy import stats
  by = {(r["mode"], r["seed"]): r[outcome] for r in rows}
  seeds = sorted(s for m, s in by if m == a and (b, s) in by)
  d = np.array([by[(a, s)] - by[(b, s)] for s in seeds], float)
  d = d[np.isfinite(d)]
  out = dict(n=len(d), mean=float(d.mean()) if len(d) else float("nan"),
             low=float("nan"), high=float("nan"), sign_p=float("nan"),
             wins=int((d > 0).sum()), losses=int((d < 0).sum()))
  if len(d) >= 2 and np.ptp(d) > 0:
    ci = stats.bootstrap((d,), np.mean, n_resamples=10_000,
                         confidence_level=0.95, method="percentile",
                         random_state=np.random.default_rng(0))
    out.update(low=float(ci.confidence_interval.low),
               high=float(ci.confidence_interval.high))
  elif len(d):
    out.update(low=out["mean"], high=out["mean"])
  nonzero = out["wins"] + out["losses"]
  if nonzero:
    out["sign_p"] = float(stats.binomtest(out["wins"], nonzero).pvalue)
  return out


def _pm(values) -> str:
  v = np.asarray([x for x in values if x == x], float)
  return f"{v.mean():.3f} ± {v.std():.3f}" if len(v) else "n/a"


def table(rows: list[dict], command: str) -> str:
  cells = [(s, g) for s in SPREADS for g in GAPS
           if any(r["spread"] == s and r["gap"] == g for r in rows)]
  t = stability.THRESHOLDS
  lines = [
      "# Aggregation grid on the chains task", "", f"Command: `{command}`", "",
      "Means ± std (ddof 0) over seeds. Held-out: sampled accuracy after RL "
      "(before: the shared warm-up). Train acc: mean training accuracy over "
      "RL (the reward is 0/1, so it is also the mean training reward); "
      "mixed: share of groups holding both signs. "
      "CV: within-group length CV; subset CV: within (group, sign) subset; "
      "gap: within-group (positive - negative) mean length over their "
      "average; corr: per-token weight vs length. Unstable: runs whose "
      f"smoothed training accuracy fell > {t['accuracy_peak_drop']} below "
      f"its running peak, or entropy rose > {t['entropy_ratio_max']}x / fell "
      f"< {t['entropy_ratio_min']}x its start, or length rose > "
      f"{t['length_ratio_max']}x its start (ba_jax/ablation/stability.py).", "",
      "## Per cell", "",
      "| spread | gap | rule | seeds | held-out before | held-out after "
      "| train acc | mixed | CV | subset CV | gap | corr |",
      "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
  stab = ["", "## Stability", "",
          "| spread | gap | rule | peak drop | entropy max/start "
          "| entropy min/start | length max/start | clip frac | unstable |",
          "|---|---|---|---:|---:|---:|---:|---:|---:|"]
  for spread, gap in cells:
    for mode in MODES:
      rs = [r for r in rows if (r["spread"], r["gap"], r["mode"]) ==
            (spread, gap, mode)]
      if not rs:
        continue
      col = lambda k: [r[k] for r in rs]
      st = lambda k: [r["stability"][k] for r in rs]
      lines.append(
          f"| {spread} | {gap} | {mode} | {len(rs)} | "
          f"{_pm(col('heldout_before'))} | {_pm(col('heldout_after'))} | "
          f"{_pm(col('reward_auc'))} | {_pm(col('groups_mixed_frac'))} | "
          f"{_pm(col('length_cv'))} | "
          f"{_pm(col('length_cv_in_subset'))} | "
          f"{_pm(col('length_gap_in_group_rel'))} | "
          f"{_pm(col('weight_length_corr'))} |")
      stab.append(
          f"| {spread} | {gap} | {mode} | {_pm(st('accuracy_peak_drop'))} | "
          f"{_pm(st('entropy_ratio_max'))} | {_pm(st('entropy_ratio_min'))} | "
          f"{_pm(st('length_ratio_max'))} | {_pm(st('clip_frac_mean'))} | "
          f"{sum(st('collapsed'))}/{len(rs)} |")
  lines += stab
  lines += ["", "## Length statistics of the policy's own samples", "",
            "Pooled over the cell's rules and seeds, from every RL step's "
            "`metrics.jsonl` (`length_cv_in_group`; `length_gap_in_group_rel`, "
            "defined at steps with a group holding both signs): the mean over "
            "runs of each run's mean over steps [min, max over runs], and the "
            "mean over runs of the first value logged (the warm-up policy's "
            "samples at step 1 for the CV).", "",
            "| spread | gap | runs | within-group CV | CV, first step "
            "| relative gap | gap, first logged |",
            "|---|---|---:|---:|---:|---:|---:|"]
  for spread, gap in cells:
    rs = [r for r in rows if (r["spread"], r["gap"]) == (spread, gap)]
    def rng(k):
      v = np.asarray([r[k] for r in rs], float)
      v = v[np.isfinite(v)]
      return (f"{v.mean():+.3f} [{v.min():+.3f}, {v.max():+.3f}]"
              if len(v) else "n/a")
    lines.append(f"| {spread} | {gap} | {len(rs)} | {rng('length_cv')} | "
                 f"{rng('length_cv_first')} | "
                 f"{rng('length_gap_in_group_rel')} | "
                 f"{rng('length_gap_in_group_rel_first')} |")
  lines += ["", "## Paired differences per seed", "",
            "Mean of the per-seed difference [95% bootstrap interval], "
            "wins:losses over seeds, exact sign-test p.", "",
            "| spread | gap | outcome | " + " | ".join(
                f"{a} - {b}" for a, b in PAIRS) + " |",
            "|---|---|---|" + "---:|" * len(PAIRS)]
  for spread, gap in cells:
    rs = [r for r in rows if (r["spread"], r["gap"]) == (spread, gap)]
    for outcome, _ in OUTCOMES:
      parts = []
      for a, b in PAIRS:
        p = paired(rs, a, b, outcome)
        parts.append("n/a" if not p["n"] else
                     f"{p['mean']:+.3f} [{p['low']:+.3f}, {p['high']:+.3f}] "
                     f"{p['wins']}:{p['losses']} p={p['sign_p']:.2g}")
      lines.append(f"| {spread} | {gap} | {outcome} | " + " | ".join(parts)
                   + " |")
  return "\n".join(lines) + "\n"


def plot(rows: list[dict], outdir: pathlib.Path) -> list[pathlib.Path]:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  paths = []
  for spread, gap in sorted({(r["spread"], r["gap"]) for r in rows}):
    fig, axes = plt.subplots(1, len(CURVES), figsize=(5 * len(CURVES), 3.6))
    for ax, (name, title) in zip(axes, CURVES):
      for mode in MODES:
        curves = [r["curves"][name] for r in rows if (
            r["spread"], r["gap"], r["mode"]) == (spread, gap, mode)]
        if not curves:
          continue
        steps = min(len(c) for c in curves)
        v = np.array([[np.nan if x is None else x for x in c[:steps]]
                      for c in curves], float)
        if np.isnan(v).all():
          continue
        x = np.arange(1, steps + 1)
        mean = stability.smooth(np.nanmean(v, axis=0))
        ax.plot(x, mean, label=mode, marker="." if steps < 12 else None)
      ax.set_title(f"{title} ({spread} spread, {gap} gap)")
      ax.set_xlabel("RL step")
    axes[0].legend()
    fig.tight_layout()
    path = outdir / f"curves_{spread}_{gap}.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    paths.append(path)
  return paths


def _choices(text: str, valid, name: str) -> list[str]:
  items = [x for x in text.split(",") if x]
  bad = sorted(set(items) - set(valid))
  if bad or not items:
    raise SystemExit(f"--{name}={text!r}: expected some of {list(valid)}")
  return items


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--gaps", default=",".join(GAPS))
  parser.add_argument("--spreads", default=",".join(SPREADS))
  parser.add_argument("--modes", default=",".join(MODES))
  parser.add_argument("--seeds", type=int, default=5)
  parser.add_argument("--parallel", type=int, default=2)
  parser.add_argument("--outdir", default="experiments/studies/chains_grid/results")
  parser.add_argument("--variant", default="",
                      help="extra configs/chains.py variants, e.g. quick, lr=1e-3")
  parser.add_argument("--override", action="append", default=[],
                      help="extra --config.key=value for every run")
  parser.add_argument("--quick", action="store_true",
                      help="one cell (high spread, positive gap), one seed, "
                           "the config's quick variant, into --outdir "
                           "experiments/studies/chains_grid/results_quick unless given")
  args = parser.parse_args(argv)
  if args.quick:
    args.gaps, args.spreads, args.seeds = "pos", "high", 1
    args.variant = _variant("quick", args.variant)
    if args.outdir == parser.get_default("outdir"):
      args.outdir = "experiments/studies/chains_grid/results_quick"
  gaps = _choices(args.gaps, GAPS, "gaps")
  spreads = _choices(args.spreads, SPREADS, "spreads")
  modes = _choices(args.modes, MODES, "modes")
  args.outdir = pathlib.Path(args.outdir)
  args.outdir.mkdir(parents=True, exist_ok=True)
  threads = max(1, (os.cpu_count() or 2) // max(1, args.parallel))
  command = " ".join(["python", "experiments/studies/chains_grid/grid_aggregation.py",
                      *(argv if argv is not None else sys.argv[1:])])
  # The persistent compilation cache: runs of one (spread, rule) share their
  # programs, so only the first compiles (the seed and gap are data).
  os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                        str((args.outdir / "runs" / "jax_cache").resolve()))
  with concurrent.futures.ThreadPoolExecutor(args.parallel) as pool:
    # FIFO: a seed's warm-ups are taken before its RL runs, so an RL run that
    # waits on its warm-up waits on one already running (no deadlock).
    futures = []
    for seed in range(args.seeds):
      warm = {s: pool.submit(warmup, s, seed, args, threads) for s in spreads}
      for s in spreads:
        for g in gaps:
          for m in modes:
            futures.append(pool.submit(
                lambda j, w: rl_run(j, w.result(), args, threads),
                (s, g, m, seed), warm[s]))
    rows = [f.result() for f in futures]
  with open(args.outdir / "results.jsonl", "w") as f:
    for row in rows:
      f.write(json.dumps(row) + "\n")
  (args.outdir / "table.md").write_text(table(rows, command))
  plot(rows, args.outdir)
  print((args.outdir / "table.md").read_text())
  return rows


if __name__ == "__main__":
  main()
