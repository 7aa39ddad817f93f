"""The powered aggregation ablation on the drafts task (configs/drafts.py):
tune each rule's learning rate, pre-register, then confirm on fresh seeds.

    PYTHONPATH=. python experiments/powered_ablation.py --outdir=experiments/results/powered
    PYTHONPATH=. python experiments/powered_ablation.py --dry --outdir=/tmp/powered_dry

Run it from the repository root (the configs' paths are relative to it).

Another config is one cell (``all``) run as written, its rule, rate and
steps set by ``--config.`` keys; ``--init_from`` starts every run from a
pretrained directory instead of a per-seed warm-up, and ``--tune_seeds=0``
with one ``--rates`` value skips tuning (a pilot, its power not estimated)::

    PYTHONPATH=. python experiments/powered_ablation.py \\
        --config=configs/smollm2_reasoning_gym.py --init_from=/tmp/smollm2 \\
        --modes=token,sequence,balanced --tune_seeds=0 --rates=1e-5 \\
        --confirm_seeds=3 --steps=10 --start_within_min=120 \\
        --outdir=experiments/results/pilot

(the run in experiments/results/pilot/README.md adds the length probe's
prompt and smaller rollouts as ``--override`` flags).

``--start_within_min`` time-boxes the confirm stage: runs go seed by seed,
none starts after the box, and the report covers the seeds whose runs all
finished (a later call without the box runs the rest).

Stages (``--stage``, default ``all``, which runs them in order; every stage
resumes: a run whose ``summary.json`` exists is not rerun):

1. ``tune``: per cell (``--gaps``) and rule, every rate of ``--rates`` on the
   tuning seeds (``seed_split``: 1000, 1001, ...), which are never reported.
   Each rule's rate is chosen by the criterion named here in advance: the
   highest mean over tuning seeds of the primary outcome (``PRIMARY``: the
   mean training reward over the RL run), ties (equal to 3 decimals) to the
   lower rate (``choose_rate``).
2. ``predict``: writes ``PREDICTIONS.md`` and ``predictions.json`` from the
   tuning runs alone: the chosen rates, the common rate (``token``'s chosen
   rate: the drop-in-replacement question), the primary outcome, the named
   comparisons and their Holm family, the non-inferiority margin, and the
   minimum detectable difference for the confirmation seed count from the
   tuning runs' paired SD. Never rewritten once written.
3. ``confirm``: refuses to start unless ``PREDICTIONS.md`` exists unchanged
   (its sha256 is in ``predictions.json``); then per cell and rule the
   confirmation seeds (0, 1, ...; disjoint from the tuning seeds) at the
   rule's chosen rate (arm ``tuned``) and at the common rate (arm
   ``common``; a run both arms need runs once).
4. ``report``: ``REPORT.md`` (tables and tests) and ``curves_<arm>_<cell>.png``
   (experiments/powered_report.py) from ``results.jsonl``.

Every run of a seed starts RL from that seed's one supervised warm-up
(common random numbers: the warm-up does not depend on the rule or the
gap), with that seed.

Time on a 2-core CPU with ``--parallel=2`` (one core per run): a warm-up
took 124-190 s and an RL run 20-32 s (up to 55 s compiling), so the default
grid (2 cells x 4 rules x 3 rates x 3 tuning seeds = 72 runs, then 20
confirmation seeds x 4 rules x 2 arms, 240-280 runs, and 23 warm-ups) is
projected at 99-130 minutes (``projected_seconds``;
experiments/results/powered_timing.md). ``--dry`` runs every stage on a toy
policy (3 minutes from a cold compilation cache with all four rules and two
rates, each (rule, rate) compiling its own train step; less when warm).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import os
import pathlib
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ablate_aggregation as ablation  # noqa: E402
import ablation_stats as st  # noqa: E402
import stability  # noqa: E402

CONFIG = "configs/drafts.py"
MODES = ("token", "sequence", "dr_grpo", "balanced")
GAPS = ("neg", "none", "pos")
WHOLE = "all"  # the one cell of a config other than CONFIG: the config as written
PRIMARY = ("reward_auc", "mean training reward over the RL run")
SECONDARY = ("heldout_after", "held-out sampled accuracy after RL")
# (A, B, kind): the named comparisons, d = A - B per seed.
COMPARISONS = (("balanced", "sequence", "superiority"),
               ("balanced", "token", "noninferiority"),
               ("token", "dr_grpo", "control"))
TUNE_SEED_BASE = 1000
TIE_DECIMALS = 3


def seed_split(n_tune: int, n_confirm: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """(tuning seeds, confirmation seeds): disjoint, the tuning ones from
  ``TUNE_SEED_BASE``, the confirmation ones from 0."""
  if n_confirm > TUNE_SEED_BASE or n_tune < 0 or n_confirm < 2:
    raise ValueError(f"tune_seeds={n_tune}, confirm_seeds={n_confirm}: expected "
                     f">= 0 tuning and 2..{TUNE_SEED_BASE} confirmation seeds")
  return (tuple(range(TUNE_SEED_BASE, TUNE_SEED_BASE + n_tune)),
          tuple(range(n_confirm)))


def choose_rate(rows: list[dict], rates) -> tuple[float, dict]:
  """The rate with the highest mean primary outcome over ``rows`` (one
  rule's tuning runs), ties at ``TIE_DECIMALS`` to the lower; and the means."""
  means = {}
  for lr in sorted(rates):
    v = [r[PRIMARY[0]] for r in rows if r["lr"] == lr and np.isfinite(r[PRIMARY[0]])]
    means[lr] = float(np.mean(v)) if v else float("-inf")
  best = max(round(m, TIE_DECIMALS) for m in means.values())
  return min(lr for lr, m in means.items() if round(m, TIE_DECIMALS) == best), means


def run_name(gap: str, mode: str, lr: float, seed: int) -> str:
  return f"{gap}_{mode}_lr{lr:g}_s{seed}"


# --- running ----------------------------------------------------------------

class Runner:
  """Runs ``python -m ba_jax.train`` and export, as subprocesses (one core
  each, ``--parallel`` at a time) or, for ``--dry``, in this process."""

  def __init__(self, args):
    self.args, self.inprocess = args, args.dry
    self.threads = max(1, (os.cpu_count() or 2) // max(1, args.parallel))

  def train(self, variant: str, workdir: pathlib.Path, overrides: list[str]):
    workdir.mkdir(parents=True, exist_ok=True)
    cmd = ablation._train_cmd(self.args.config, variant, workdir, overrides)
    if not self.inprocess:
      return ablation._run(cmd, workdir / "log.txt", self.threads)
    from ba_jax import train
    status = train.main(["ba_jax.train", *cmd[3:]])
    if status:
      raise RuntimeError(f"{' '.join(cmd)} exited {status}")

  def export(self, workdir: pathlib.Path, out: pathlib.Path):
    if not self.inprocess:
      return ablation._run([sys.executable, "-m", "ba_jax.export",
                            f"--workdir={workdir}", f"--output_dir={out}"],
                           workdir / "export_log.txt", self.threads)
    from ba_jax.export import export
    export(str(workdir), str(out))


def _variant(*parts) -> str:
  return ",".join(p for p in parts if p)


def run_settings(args, gap: str, mode: str, lr: float) -> tuple[str, list[str]]:
  """(variant, overrides) of one RL run: ``configs/drafts.py``'s own
  variants, or for another config (one cell, ``WHOLE``) its ``--config.``
  keys."""
  if args.config == CONFIG:
    return _variant(f"gap={gap},agg={mode},lr={lr!r},steps={args.steps}",
                    args.variant), []
  return args.variant, [f"--config.loss.aggregation={mode}",
                        f"--config.optim.learning_rate={lr!r}",
                        f"--config.rl.steps={args.steps}"]


def warmup_seed(args, seed: int) -> int:
  """The seed whose warm-up a run of ``seed`` starts from: its own, or 0
  for every seed with ``--shared_warmup`` (or ``--init_from``: none)."""
  return 0 if args.shared_warmup or args.init_from else seed


def warmup(seed: int, args, runner: Runner) -> pathlib.Path:
  """The supervised warm-up of ``seed`` (a ``warmup_seed``), exported for
  ``init_from``; with ``--init_from`` (a pretrained start) that directory,
  and no warm-up."""
  if args.init_from:
    return pathlib.Path(args.init_from)
  workdir = args.outdir / "runs" / f"warmup_s{seed}"
  export_dir = workdir / "hf"
  if not (export_dir / "config.json").exists():
    runner.train(_variant("gap=none", args.variant), workdir,
                 [f"--config.seed={seed}", "--config.rl.steps=0", *args.override])
    runner.export(workdir, export_dir)
  return export_dir


def rl_run(job, init_dir: pathlib.Path, args, runner: Runner) -> dict:
  gap, mode, lr, seed = job
  workdir = args.outdir / "runs" / run_name(*job)
  if not (workdir / "summary.json").exists():
    t0 = time.perf_counter()
    try:
      variant, settings = run_settings(args, gap, mode, lr)
      runner.train(variant, workdir, [
          f"--config.seed={seed}", f"--config.init_from={init_dir}",
          "--config.sft.steps=0", *settings, *args.override])
    except RuntimeError:
      # A run the non-finite guard stopped still wrote its summary: at a rate
      # too large for a rule that is a result (a poor one), not a crash.
      if not (workdir / "summary.json").exists():
        raise
      print(f"{workdir.name}: stopped early (non-finite updates); kept", flush=True)
    (workdir / "wall_s.txt").write_text(f"{time.perf_counter() - t0:.1f}\n")
    print(f"[{time.strftime('%H:%M:%S')}] done {workdir.name}", flush=True)
  return summarise(workdir, dict(gap=gap, mode=mode, lr=lr, seed=seed))


def run_jobs(jobs: list[tuple], args, runner: Runner,
             start_by: float | None = None) -> dict[tuple, dict | None]:
  """Warm-ups, then each seed's RL runs as soon as its warm-up is done
  (queued behind the warm-ups still waiting, so no core idles on one);
  finished runs are read back, not rerun. Job -> row, seed by seed. A run
  not yet started at ``start_by`` (``time.monotonic()``) is not started:
  its row is None."""
  jobs = sorted(set(jobs), key=lambda j: (j[3], j))
  key = lambda seed: warmup_seed(args, seed)

  def run(job, init):
    late = start_by is not None and time.monotonic() > start_by
    if late and not (args.outdir / "runs" / run_name(*job) / "summary.json").exists():
      return None
    return rl_run(job, init, args, runner)

  if runner.inprocess:
    inits = {s: warmup(s, args, runner) for s in sorted({key(j[3]) for j in jobs})}
    return {j: run(j, inits[key(j[3])]) for j in jobs}
  with concurrent.futures.ThreadPoolExecutor(args.parallel) as pool:
    warm = {pool.submit(warmup, s, args, runner): s
            for s in sorted({key(j[3]) for j in jobs})}
    runs = {}
    for done in concurrent.futures.as_completed(warm):
      init = done.result()
      for job in jobs:
        if key(job[3]) == warm[done]:
          runs[job] = pool.submit(run, job, init)
    return {job: runs[job].result() for job in jobs}


def _mean(values) -> float:
  v = [x for x in values if x is not None and np.isfinite(x)]
  return float(np.mean(v)) if v else float("nan")


def _drift(values, width: int = 5) -> float:
  """Mean of the last ``width`` values over the mean of the first ``width``
  (fewer when the run is short, so that the two windows never overlap)."""
  v = np.array([np.nan if x is None else x for x in values], float)
  width = max(1, min(width, len(v) // 2))
  first, last = v[:width], v[-width:]
  if not (np.isfinite(first).any() and np.isfinite(last).any()):
    return float("nan")
  start, end = np.nanmean(first), np.nanmean(last)
  return float(end / start) if start else float("nan")


def summarise(workdir: pathlib.Path, key: dict) -> dict:
  """One run's row: outcomes, mechanism diagnostics and stability."""
  records = ablation._read_jsonl(workdir / "metrics.jsonl")
  summary = json.loads((workdir / "summary.json").read_text())
  config = json.loads((workdir / "config.json").read_text())
  series = lambda name: [r.get(name) for r in records]
  # A run the non-finite guard stopped has no final evaluation: its missing
  # steps' reward and its held-out accuracy count as 0 (a broken policy).
  stopped = "after_rl" not in summary
  rewards = [x for x in series("reward_mean") if x is not None]
  planned = max(config["rl"]["steps"], len(rewards)) if stopped else len(rewards)
  share_minus_frac = [s - f for s, f in zip(series("w_pos_share"), series("pos_frac"))
                      if s is not None and f is not None]
  wall = workdir / "wall_s.txt"
  return dict(
      key, steps=len(records), stopped_nonfinite=stopped,
      wall_s=float(wall.read_text()) if wall.exists() else None,
      reward_auc=float(np.sum(rewards) / planned) if planned else float("nan"),
      heldout_before=summary["before_rl"]["heldout_acc_sampled"],
      heldout_after=0.0 if stopped else summary["after_rl"]["heldout_acc_sampled"],
      heldout_samples=config["eval"]["num_problems"] * config["eval"]["samples_per_problem"],
      reward_samples=len(records) * config["rl"]["prompts_per_step"] * config["rl"]["group_size"],
      groups_mixed_frac=_mean(series("groups_mixed_frac")),
      pos_share_minus_frac=_mean(share_minus_frac),
      pos_frac=_mean(series("pos_frac")),
      entropy_drift=_drift(series("entropy")),
      length_drift=_drift(series("length_mean")),
      weight_length_corr=_mean(series("weight_length_corr")),
      length_cv=_mean(series("length_cv_in_group")),
      length_cv_first=_mean(series("length_cv_in_group")[:1]),
      length_gap_in_group_rel=_mean(series("length_gap_in_group_rel")),
      stability=dict(stability.report(records), **({"collapsed": True} if stopped else {})),
      curves={k: series(k) for k in ("reward_mean", "entropy", "length_mean")})


# --- the stages -------------------------------------------------------------

def tune(args, runner) -> list[dict]:
  tune_seeds, _ = seed_split(args.tune_seeds, args.confirm_seeds)
  jobs = [(g, m, lr, s) for s in tune_seeds for g in args.gaps
          for m in args.modes for lr in args.rates]
  rows = list(run_jobs(jobs, args, runner).values()) if jobs else []
  _write_jsonl(args.outdir / "tuning.jsonl", rows)
  return rows


def plan_from(rows: list[dict], args) -> dict:
  """The pre-registered plan from the tuning rows: rates, family, MDD."""
  tune_seeds, confirm_seeds = seed_split(args.tune_seeds, args.confirm_seeds)
  chosen, means = {}, {}
  for g in args.gaps:
    for m in args.modes:
      rs = [r for r in rows if (r["gap"], r["mode"]) == (g, m)]
      chosen[f"{g}/{m}"], per_rate = choose_rate(rs, args.rates)
      means[f"{g}/{m}"] = {f"{lr:g}": v for lr, v in per_rate.items()}
  common = {g: chosen.get(f"{g}/token", sorted(args.rates)[len(args.rates) // 2])
            for g in args.gaps}
  # Paired SD of the primary outcome over tuning seeds, at the chosen rates,
  # pooled (mean variance) over cells and comparisons.
  variances = []
  for g in args.gaps:
    by = {(r["mode"], r["seed"]): r[PRIMARY[0]] for r in rows
          if r["gap"] == g and r["lr"] == chosen.get(f"{g}/{r['mode']}")}
    for a, b, _ in COMPARISONS:
      d = [by[(a, s)] - by[(b, s)] for s in tune_seeds if (a, s) in by and (b, s) in by]
      if len(d) >= 2:
        variances.append(float(np.var(d, ddof=1)))
  sd = float(np.sqrt(np.mean(variances))) if variances else float("nan")
  family = [f"{g}: {a} vs {b} ({kind})" for g in args.gaps
            for a, b, kind in COMPARISONS if kind != "control"]
  n = len(confirm_seeds)
  mdd = lambda alpha, two_sided=True: (
      st.min_detectable_difference(n, sd, alpha=alpha, two_sided=two_sided)
      if sd > 0 else float("nan"))
  return dict(
      primary=PRIMARY, secondary=SECONDARY, gaps=list(args.gaps), modes=list(args.modes),
      rates=list(args.rates), steps=args.steps, variant=args.variant,
      config=args.config, init_from=args.init_from,
      override=args.override, tune_seeds=list(tune_seeds),
      confirm_seeds=list(confirm_seeds), chosen=chosen, tuning_means=means,
      common=common, margin=args.margin, comparisons=[list(c) for c in COMPARISONS],
      holm_family=family, alpha=0.05, paired_sd=sd, paired_sd_terms=len(variances),
      mdd=mdd(0.05), mdd_holm_first=mdd(0.05 / max(1, len(family))),
      ni_power_at_zero=(st.t_test_power(args.margin, n, sd, two_sided=False)
                        if sd > 0 else float("nan")))


def predict(rows: list[dict], args) -> dict:
  import powered_report
  path, md = args.outdir / "predictions.json", args.outdir / "PREDICTIONS.md"
  if path.exists() and md.exists():
    print(f"{md} exists: the plan is frozen, not rewritten", flush=True)
    return json.loads(path.read_text())
  plan = plan_from(rows, args)
  text = powered_report.predictions_md(plan, rows)
  md.write_text(text)
  plan["predictions_sha256"] = hashlib.sha256(text.encode()).hexdigest()
  plan["written_at"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
  path.write_text(json.dumps(plan, indent=1) + "\n")
  return plan


def frozen_plan(outdir: pathlib.Path) -> dict:
  """The plan ``predict`` wrote; an error unless PREDICTIONS.md is there,
  unchanged since."""
  path, md = outdir / "predictions.json", outdir / "PREDICTIONS.md"
  if not (path.exists() and md.exists()):
    raise SystemExit(f"{md} is missing: run --stage=predict (after tune) first; "
                     "the confirmation runs only after the predictions are written")
  plan = json.loads(path.read_text())
  if hashlib.sha256(md.read_bytes()).hexdigest() != plan["predictions_sha256"]:
    raise SystemExit(f"{md} changed after it was written (sha256 differs from "
                     f"{path}); restore it: the plan is frozen")
  return plan


def confirmation_jobs(plan: dict) -> dict[str, list[tuple]]:
  """Arm -> its runs (gap, mode, lr, seed): ``tuned`` at each rule's chosen
  rate, ``common`` at the cell's common rate."""
  arms = {"tuned": [], "common": []}
  for g in plan["gaps"]:
    for m in plan["modes"]:
      for s in plan["confirm_seeds"]:
        arms["tuned"].append((g, m, plan["chosen"][f"{g}/{m}"], s))
        arms["common"].append((g, m, plan["common"][g], s))
  return arms


def confirm(args, runner) -> list[dict]:
  plan = frozen_plan(args.outdir)
  for name in ("steps", "variant", "override", "config", "init_from"):
    frozen = plan.get(name, {"config": CONFIG, "init_from": ""}.get(name))
    if getattr(args, name) != frozen:  # the runs the plan describes
      print(f"--{name}={getattr(args, name)!r} ignored: the frozen plan's is "
            f"{frozen!r}", flush=True)
      setattr(args, name, frozen)
  arms = confirmation_jobs(plan)
  start_by = (time.monotonic() + 60 * args.start_within_min
              if args.start_within_min else None)
  done = run_jobs([j for js in arms.values() for j in js], args, runner, start_by)
  # A seed counts only when every one of its runs finished (paired tests).
  complete = [s for s in plan["confirm_seeds"]
              if all(row is not None for j, row in done.items() if j[3] == s)]
  rows = [dict(done[j], arm=arm) for arm, js in arms.items() for j in js
          if j[3] in complete]
  _write_jsonl(args.outdir / "results.jsonl", rows)
  if len(complete) < len(plan["confirm_seeds"]):
    print(f"seeds {complete} finished within --start_within_min="
          f"{args.start_within_min:g}; the rest of {plan['confirm_seeds']} "
          "were not started", flush=True)
  (args.outdir / "confirmed_seeds.json").write_text(json.dumps(dict(
      planned=plan["confirm_seeds"], complete=complete,
      start_within_min=args.start_within_min)) + "\n")
  return rows


def report(args) -> str:
  import powered_report
  plan = frozen_plan(args.outdir)
  rows = _read_rows(args.outdir / "results.jsonl")
  status = args.outdir / "confirmed_seeds.json"
  text = powered_report.report_md(plan, rows, _read_rows(args.outdir / "tuning.jsonl"),
                                  json.loads(status.read_text()) if status.exists() else None)
  (args.outdir / "REPORT.md").write_text(text)
  powered_report.plot(plan, rows, args.outdir)
  return text


def _write_jsonl(path: pathlib.Path, rows: list[dict]):
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _read_rows(path: pathlib.Path) -> list[dict]:
  return [json.loads(l) for l in path.read_text().splitlines()] if path.exists() else []


def projected_seconds(*, gaps: int, modes: int, rates: int, tune_seeds: int,
                      confirm_seeds: int, warmup_s: float, run_s: float,
                      parallel: int = 2, common_shared: float = 0.25) -> float:
  """Wall seconds of the whole grid: one warm-up per seed, the tuning runs,
  and the confirmation runs of both arms (``common_shared``: the share of
  common-arm runs that are a tuned-arm run too; token's always are)."""
  warmups = tune_seeds + confirm_seeds
  tune_runs = gaps * modes * rates * tune_seeds
  confirm_runs = gaps * modes * confirm_seeds * (2 - common_shared)
  return (warmups * warmup_s + (tune_runs + confirm_runs) * run_s) / parallel


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--stage", default="all",
                      choices=("all", "tune", "predict", "confirm", "report"))
  parser.add_argument("--outdir", default="experiments/results/powered")
  parser.add_argument("--config", default=CONFIG,
                      help=f"the runs' config; another than {CONFIG} is one "
                           f"cell ({WHOLE!r}) run as written, its rule, rate "
                           "and steps set by --config. keys")
  parser.add_argument("--init_from", default="",
                      help="start every run from this Hugging Face directory "
                           "(a pretrained model) instead of a per-seed warm-up")
  parser.add_argument("--gaps", default=None,
                      help=f"cells: some of {GAPS} for {CONFIG} (default "
                           f"neg,pos), {WHOLE!r} for another config")
  parser.add_argument("--modes", default=",".join(MODES))
  parser.add_argument("--rates", default="1.5e-4,3e-4,6e-4",
                      help="the learning rates each rule is tuned over")
  parser.add_argument("--tune_seeds", type=int, default=3,
                      help="0: no tuning (a pilot), one rate given in --rates")
  parser.add_argument("--confirm_seeds", type=int, default=20)
  parser.add_argument("--steps", type=int, default=20, help="RL steps per run")
  parser.add_argument("--start_within_min", type=float, default=0.0,
                      help="time box of the confirm stage: no run starts later "
                           "than this many minutes after the stage began (runs "
                           "go seed by seed); the report covers the seeds whose "
                           "runs all finished. 0: no time box")
  parser.add_argument("--margin", type=float, default=0.05,
                      help="non-inferiority margin on the primary outcome")
  parser.add_argument("--parallel", type=int, default=2)
  parser.add_argument("--variant", default="", help="extra configs/drafts.py variants")
  parser.add_argument("--override", action="append", default=[],
                      help="extra --config.key=value for every run")
  parser.add_argument("--shared_warmup", action="store_true",
                      help="one warm-up (seed 0's) for every seed: cheaper, but the "
                           "seed-to-seed spread then leaves out the warm-up's")
  parser.add_argument("--dry", action="store_true",
                      help="the whole pipeline at toy size: configs/drafts.py:smoke, "
                           "one gap, two rates, 1 RL step, 1 tuning and 2 "
                           "confirmation seeds, one shared warm-up, in this process")
  args = parser.parse_args(argv)
  if args.dry:
    args.variant = _variant("smoke", args.variant)
    args.gaps, args.steps = "pos", 1
    if args.rates == parser.get_default("rates"):
      args.rates = "1e-4,1e-3"
    args.tune_seeds, args.confirm_seeds, args.shared_warmup = 1, 2, True
    args.override = ["--config.sft.steps=4", "--config.eval.num_problems=4",
                     "--config.checkpoint.async_save=False", *args.override]
  drafts_cells = args.config == CONFIG
  args.gaps = _choices(args.gaps or ("neg,pos" if drafts_cells else WHOLE),
                       GAPS if drafts_cells else (WHOLE,), "gaps")
  args.modes = _choices(args.modes, MODES, "modes")
  args.rates = sorted(float(x) for x in args.rates.split(",") if x)
  if args.tune_seeds == 0 and len(args.rates) != 1:
    parser.error(f"--rates={args.rates}: with --tune_seeds=0 nothing is tuned; "
                 "give the one rate every rule runs at")
  if args.tune_seeds and len(args.rates) < 3 and not args.dry:
    parser.error(f"--rates={args.rates}: a sweep needs at least 3 rates")
  args.outdir = pathlib.Path(args.outdir)
  args.outdir.mkdir(parents=True, exist_ok=True)
  os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                        str((args.outdir / "runs" / "jax_cache").resolve()))
  runner = Runner(args)
  if args.stage in ("all", "tune"):
    rows = tune(args, runner)
  if args.stage in ("all", "predict"):
    rows = _read_rows(args.outdir / "tuning.jsonl")
    if not (args.outdir / "tuning.jsonl").exists():
      raise SystemExit(f"{args.outdir}/tuning.jsonl is missing: run --stage=tune first")
    predict(rows, args)
  if args.stage in ("all", "confirm"):
    confirm(args, runner)
  if args.stage in ("all", "report"):
    print(report(args))
  return args.outdir


def _choices(text: str, valid, name: str) -> list[str]:
  items = [x for x in text.split(",") if x]
  bad = sorted(set(items) - set(valid))
  if bad or not items:
    raise SystemExit(f"--{name}={text!r}: expected some of {list(valid)}")
  return items


if __name__ == "__main__":
  main()
