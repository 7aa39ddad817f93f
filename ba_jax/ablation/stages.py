"""The stages of a study, each resumable, each refusing what would break the
protocol. Files, in the study's results folder:

- ``tune``: ``tuning.jsonl``, every arm at every rate on the tuning seeds
  (never reported).
- ``plan``: ``PLAN.md``, the paired SD per comparison from the tuning runs
  (or a pilot's rows, ``--pilot=``) and the seeds a confirmation needs for
  each of the spec's detectable differences (and, from the pooled SD, at
  Holm's first step over the family).
- ``predict``: ``predictions.json`` and ``PREDICTIONS.md`` from the tuning
  runs alone; never rewritten once written. Commit them (with the spec).
- ``confirm``: refuses unless the spec and both prediction files are
  committed and unchanged at HEAD and the tree is clean (or
  ``allow_dirty``); then the confirmation seeds, every row naming the
  protocol's and the code's commit (``results.jsonl``).
- ``report``: ``REPORT.md`` and ``curves_<setting>_<cell>.png``; with W&B
  tracking on, the study as one W&B run (``wandb_report``).

A study killed in any stage resumes where it was: a run with a row in its
stage's file is not run again. The protocol (the prediction files) always
lives in the study's results folder (``spec.results``), where it is
committed; ``outdir`` (default: the same folder) only says where the rows,
runs and report go, so a fresh clone reruns the committed protocol into
another folder.
"""
from __future__ import annotations

import json
import pathlib
import time

from ba_jax.ablation import legacy, planning, plots, protocol, texts
from ba_jax.ablation.runner import Job, execute, run_settings
from ba_jax.ablation.spec import Spec, sha256
from ba_jax.ablation.store import Store, config_hash, read_rows

STAGES = ("plan", "tune", "predict", "confirm", "report")


class StageError(RuntimeError):
  """A stage asked for before what it needs exists."""


def outdir_of(spec: Spec, outdir=None) -> pathlib.Path:
  out = pathlib.Path(outdir or study_dir(spec))
  out.mkdir(parents=True, exist_ok=True)
  return out


def study_dir(spec: Spec) -> pathlib.Path:
  """Where the study's protocol is committed: ``spec.results``, or
  ``results/`` beside the spec."""
  return pathlib.Path(spec.results or pathlib.Path(spec.path).parent / "results")


def tune_jobs(spec: Spec) -> list[Job]:
  if len(spec.rates) == 1:
    return []
  return [Job(s, c, a, lr) for s in spec.tune_seeds for c in spec.cells
          for a in spec.arms for lr in spec.rates]


def tune(spec: Spec, outdir, runner, *, parallel=1, log=print) -> list[dict]:
  outdir = outdir_of(spec, outdir)
  store = Store(outdir / "tuning.jsonl")
  jobs = tune_jobs(spec)
  if not jobs:
    log("one rate: nothing to tune")
    return []
  state = lambda: protocol.code_state(spec.path, exclude=[outdir])
  execute(jobs, spec, runner, store, outdir / "runs", parallel=parallel,
          row_fields=state, log=log)
  return store.rows()


def _tuning_rows(spec: Spec, outdir: pathlib.Path) -> list[dict]:
  """The tuning rows; an error unless every tuning run has one."""
  rows = _of_jobs(spec, read_rows(outdir / "tuning.jsonl"), tune_jobs(spec),
                  outdir / "tuning.jsonl", "tune")
  return rows


def _of_jobs(spec: Spec, rows: list[dict], jobs: list[Job], path, stage: str):
  """The rows of ``jobs`` (matched by config hash: a row of other settings,
  say from before the spec changed, is not one of them); an error naming
  the first job without a row."""
  keys = {config_hash(run_settings(spec, j)): j for j in jobs}
  mine = [r for r in rows if r.get("config_hash") in keys]
  missing = [j for k, j in keys.items() if k not in {r["config_hash"] for r in mine}]
  if missing:
    raise StageError(f"{len(missing)} of {len(jobs)} {stage} runs have no row in "
                     f"{path} (first: {missing[0].name}): run --stage={stage} first")
  return mine


def plan(spec: Spec, outdir, *, pilot=None, log=print) -> str:
  """PLAN.md: the seeds a confirmation needs, from the tuning runs or a
  pilot's rows."""
  outdir = outdir_of(spec, outdir)
  source = pathlib.Path(pilot) if pilot else outdir / "tuning.jsonl"
  rows = read_rows(source)
  if legacy.is_legacy_rows(rows):
    rows = legacy.rows(rows)
  if not rows:
    raise StageError(f"{source}: no rows; run --stage=tune or give --pilot=ROWS")
  lines = [f"# {spec.name}: plan", "",
           f"From {len(rows)} runs in `{source}`: the paired SD of "
           f"`{spec.primary[0]}` per comparison (each arm at its best rate "
           "there), the detectable difference at the spec's "
           f"{len(spec.confirm_seeds)} confirmation seeds, and the seeds needed "
           f"to detect each difference (paired t, two-sided alpha {spec.alpha}, "
           f"power {spec.power}, non-central t).", "",
           "| cell | comparison | pairs | paired SD | MDD at the confirmation seeds | "
           + " | ".join(f"seeds for {m:g}" for m in spec.detectable) + " |",
           "|---|---|---:|---:|---:|" + "---:|" * len(spec.detectable)]
  needed = planning.seeds_needed(spec, rows)
  for r in needed:
    lines.append(f"| {r['cell']} | {r['comparison']} | {r['pairs']} | "
                 f"{texts._f(r['sd'], '.4f')} | {texts._f(r['mdd_at_confirm'], '.4f')} | "
                 + " | ".join(str(n) if n else "n/a" for n in r["seeds_for"].values())
                 + " |")
  sd = planning.pooled_sd([r["sd"] for r in needed])
  family = len(planning.holm_family(spec))
  if sd > 0 and family > 1:
    holm = [planning.seeds_for_family(spec, sd, m) for m in spec.detectable]
    lines += ["", f"Pooled over these terms (root mean variance) the paired SD is "
              f"{sd:.4f}; at Holm's first step over the {family} comparisons of "
              f"the family (alpha {spec.alpha}/{family}) a confirmation needs "
              + ", ".join(f"{h['holm_first']} seeds for {h['detectable']:g}" for h in holm)
              + f" (the spec has {len(spec.confirm_seeds)})."]
  text = "\n".join(lines) + "\n"
  (outdir / "PLAN.md").write_text(text)
  log(text)
  return text


def predict(spec: Spec, outdir, *, log=print) -> dict:
  outdir = outdir_of(spec, outdir)
  home = outdir_of(spec)
  path, md = home / "predictions.json", home / "PREDICTIONS.md"
  if path.exists() and md.exists():
    log(f"{md} exists: the plan is frozen, not rewritten")
    return json.loads(path.read_text())
  p = planning.make_plan(spec, _tuning_rows(spec, outdir))
  text = texts.predictions_md(p)
  md.write_text(text)
  p.update(predictions_sha256=sha256(md), spec_sha256=sha256(spec.path),
           written_at=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
           **protocol.code_state(spec.path, exclude=[outdir]))
  path.write_text(json.dumps(p, indent=1) + "\n")
  log(f"wrote {md} and {path}: commit them and the spec, then --stage=confirm")
  return p


def load_plan(spec: Spec) -> dict:
  path = study_dir(spec) / "predictions.json"
  if not path.exists():
    raise StageError(f"{path} is missing: run --stage=predict (after tune) first; "
                     "the confirmation runs only after the predictions are written")
  p = json.loads(path.read_text())
  return legacy.plan(p, spec) if legacy.is_legacy_plan(p) else p


def confirm_jobs(plan: dict) -> list[Job]:
  jobs = set()
  for c in plan["cells"]:
    for a in plan["arms"]:
      for s in plan["confirm_seeds"]:
        jobs.add(Job(s, c, a, plan["chosen"][f"{c}/{a}"]))
        if plan.get("common"):
          jobs.add(Job(s, c, a, plan["common"][c]))
  return sorted(jobs)


def protocol_files(spec: Spec) -> list[pathlib.Path]:
  home = study_dir(spec)
  return [pathlib.Path(spec.path), home / "predictions.json", home / "PREDICTIONS.md"]


def check_protocol(spec: Spec, outdir, *, allow_dirty=False) -> dict:
  """The guard of the confirmation: the frozen files as ``predict`` wrote
  them, committed and unchanged at HEAD, on a clean tree (or
  ``allow_dirty``); the record each row stores."""
  p = load_plan(spec)
  md = study_dir(spec) / "PREDICTIONS.md"
  if not md.exists() or sha256(md) != p["predictions_sha256"]:
    raise protocol.ProtocolError(f"{md} is missing or changed after predict wrote "
                                 "it (its sha256 is in predictions.json); restore it")
  if p.get("spec_sha256") and sha256(spec.path) != p["spec_sha256"]:
    raise protocol.ProtocolError(f"{spec.path} changed after the predictions were "
                                 "written from it; restore it, or start a new study")
  exclude = {pathlib.Path(outdir).resolve(), study_dir(spec).resolve()}
  return protocol.guard(protocol_files(spec), allow_dirty=allow_dirty,
                        exclude=sorted(exclude))


def confirm(spec: Spec, outdir, runner, *, parallel=1, allow_dirty=False,
            log=print) -> list[dict]:
  outdir = outdir_of(spec, outdir)
  record = check_protocol(spec, outdir, allow_dirty=allow_dirty)
  if record["dirty"]:
    log(f"--allow_dirty: running on a dirty tree ({', '.join(record['dirty'])}); "
        "every row and the report say so")
  p = load_plan(spec)
  store = Store(outdir / "results.jsonl")
  fields = lambda: check_protocol(spec, outdir, allow_dirty=allow_dirty)
  execute(confirm_jobs(p), spec, runner, store, outdir / "runs", parallel=parallel,
          row_fields=fields, log=log)
  return store.rows()


def report(spec: Spec, outdir, *, wandb: str = "off", log=print) -> str:
  """REPORT.md and the curves; with ``wandb`` ``on`` (or ``auto`` and the
  base config's ``log.backends`` naming wandb) also the study as one W&B
  run (``ba_jax.ablation.wandb_report``)."""
  outdir = outdir_of(spec, outdir)
  tracked = None  # the base config's log settings, when the W&B run is on
  if wandb != "off":  # decided first: a bad config stops before any file
    from ba_jax.ablation import wandb_report
    tracked = wandb_report.resolve(wandb, spec)
  p = load_plan(spec)
  rows = read_rows(outdir / "results.jsonl")
  tuning = read_rows(outdir / "tuning.jsonl")
  if legacy.is_legacy_rows(rows):
    rows = legacy.rows(rows)
  else:  # the confirmation runs of this plan; a partial study reports what it has
    keys = {config_hash(run_settings(spec, j)) for j in confirm_jobs(p)}
    rows = [r for r in rows if r.get("config_hash") in keys]
  if not rows:
    raise StageError(f"{outdir / 'results.jsonl'}: no rows of this plan's "
                     "confirmation runs; run --stage=confirm first")
  status = outdir / "confirmed_seeds.json"
  text = texts.report_md(p, rows, len(tuning),
                         json.loads(status.read_text()) if status.exists() else None)
  (outdir / "REPORT.md").write_text(text)
  images = plots.plot(p, rows, outdir)
  log(text)
  if tracked is not None:
    wandb_report.log_study(spec, p, rows, outdir, study_dir(spec), images, tracked,
                           note=log)
  return text


def run(stage: str, spec: Spec, outdir=None, *, runner=None, parallel=1,
        allow_dirty=False, pilot=None, wandb="off", log=print):
  """One stage (or ``all``: tune, predict, confirm, report in order);
  ``runner`` says where runs go (default ``LocalRunner(parallel)``; others
  are ``ba_jax.ablation.placement``'s). ``wandb``: the report's W&B run,
  ``on``, ``off`` or ``auto`` (see ``report``)."""
  if stage not in STAGES + ("all",):
    raise ValueError(f"--stage={stage!r}: expected one of {STAGES + ('all',)}")
  outdir = outdir_of(spec, outdir)
  if runner is None and stage in ("tune", "confirm", "all"):
    from ba_jax.ablation.runner import LocalRunner
    runner = LocalRunner(parallel)
  # as many runs at once as the runner has slots (device groups, slices)
  parallel = getattr(runner, "parallel", parallel)
  if stage == "plan":
    return plan(spec, outdir, pilot=pilot, log=log)
  if stage in ("tune", "all"):
    tune(spec, outdir, runner, parallel=parallel, log=log)
  if stage in ("predict", "all"):
    predict(spec, outdir, log=log)
  if stage in ("confirm", "all"):
    confirm(spec, outdir, runner, parallel=parallel, allow_dirty=allow_dirty, log=log)
  if stage in ("report", "all"):
    return report(spec, outdir, wandb=wandb, log=log)
