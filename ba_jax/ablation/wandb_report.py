"""The report stage's Weights & Biases run, when tracking is on: one run per
report (job type ``ablation-report``, named after the study, in the W&B
project and entity of the study's base config) holding

- the tables ``arms`` (per setting, cell and arm: mean and SD over seeds of
  the outcomes REPORT.md's arm tables show), ``comparisons`` (every test of
  REPORT.md: mean difference, 95% CI, p, Holm p, sign test, verdict,
  prediction) and ``results`` (every confirmation row, nested fields as
  ``a/b``, the per-step curves left to the images);
- the curve figures as images ``curves/<setting>_<cell>``;
- an artifact (type ``ablation-report``) with REPORT.md, the protocol
  (PREDICTIONS.md, predictions.json, the spec) and the rows;
- the plan and the rows' protocol and code commits in the run's config.

The run starts as ``ba_jax.run.tracking.start_wandb`` decides for training
runs: online with an API key, else offline (``wandb sync`` uploads it). An
online run with ``wandb-workspaces`` installed also gets a W&B Report: the
verdicts as markdown, then the comparisons and arms tables and the curves.
"""
from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
import runpy
from typing import Callable

from ba_jax.ablation import protocol, texts
from ba_jax.ablation.comparisons import setting_rows, settings_of
from ba_jax.config import schema
from ba_jax.run import tracking

CHOICES = ("auto", "on", "off")
JOB_TYPE = "ablation-report"
REPORTS_PACKAGE = "wandb_workspaces"  # W&B's Reports API, in the tracking extra


def base_log(spec) -> schema.Log:
  """The ``log`` section of the study's base config: the spec's ``config``
  (its ``get_config(arg)``, the path as the runs see it, from the working
  directory) with the spec's ``log.*`` overrides (cells' are not read)."""
  path, _, arg = spec.config.partition(":")
  if not os.path.exists(path):
    raise FileNotFoundError(f"spec config {spec.config!r}: {path} not found from "
                            f"{os.getcwd()}; run ablate from the repository root")
  get_config = runpy.run_path(path)["get_config"]
  config = get_config(arg) if arg else get_config()
  log = dict(config.to_dict().get("log", {}))
  log.update({k[len("log."):]: v for k, v in spec.overrides.items()
              if k.startswith("log.")})
  return schema.parse({"log": log}).log


def tracking_on(choice: str, log: schema.Log) -> bool:
  """``on``, ``off``, or ``auto``: on when the base config's
  ``log.backends`` names wandb."""
  if choice not in CHOICES:
    raise ValueError(f"--wandb={choice!r}: expected one of {CHOICES}")
  return choice == "on" or (choice == "auto" and "wandb" in tracking.backend_names(log))


def resolve(choice: str, spec) -> schema.Log | None:
  """The base config's log settings when the report's W&B run is on
  (``tracking_on``), else None; an error naming the install command when
  it is on and wandb is not installed."""
  settings = base_log(spec) if choice != "off" else None
  if settings is None or not tracking_on(choice, settings):
    return None
  if importlib.util.find_spec("wandb") is None:
    raise ValueError(f"--wandb={choice}: the report's W&B run needs the wandb "
                     f"package, which is not installed: {tracking.EXTRA}")
  return settings


def slug(name: str) -> str:
  """``name`` as a W&B artifact name allows (letters, digits, ``-_.``)."""
  return re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-") or "study"


def _flat(row: dict, prefix: str = "") -> dict:
  out = {}
  for k, v in row.items():
    if not prefix and k == "curves":
      continue
    if isinstance(v, dict):
      out.update(_flat(v, f"{prefix}{k}/"))
    else:
      out[prefix + k] = json.dumps(v) if isinstance(v, (list, tuple)) else tracking.jsonable(v)
  return out


def _table(records: list[dict]) -> tuple[list[str], list[list]]:
  columns = list(dict.fromkeys(k for r in records for k in r))
  return columns, [[tracking.jsonable(r.get(c)) for c in columns] for r in records]


def arm_rows(plan: dict, rows: list[dict]) -> list[dict]:
  """REPORT.md's arm tables as numbers: per setting, cell and arm, each
  outcome's mean and SD over seeds (None where no value is finite)."""
  out = []
  for setting in settings_of(plan):
    for cell, arm, rs in texts.arm_groups(plan, setting_rows(plan, rows, setting)):
      row = dict(setting=setting, cell=cell, arm=arm, lr=rs[0]["lr"], seeds=len(rs))
      for field, _, _ in texts.arm_columns(plan):
        m = texts.mean_sd([r[field] for r in rs])
        row.update({f"{field}_mean": m and m[0], f"{field}_sd": m and m[1]})
      row["unstable"] = sum(bool(r["stability"]["collapsed"]) for r in rs)
      out.append(row)
  return out


def tables(plan: dict, rows: list[dict]) -> dict[str, tuple[list[str], list[list]]]:
  """``{name: (columns, data)}`` of the run's tables."""
  return {"arms": _table(arm_rows(plan, rows)),
          "comparisons": _table(texts.comparison_rows(plan, rows)),
          "results": _table([_flat(r) for r in rows])}


def verdicts_md(plan: dict, comparisons: list[dict]) -> str:
  """The confirmatory verdicts (tuned rates, primary outcome, Holm) as
  markdown lines, with what was predicted."""
  lines = [f"## Verdicts on `{plan['primary'][0]}` (tuned rates, Holm over the "
           f"pre-registered family, alpha {plan['alpha']})", ""]
  for c in comparisons:
    if c["confirmatory"]:
      lines.append(
          f"- {c['cell']}: {c['a']} - {c['b']} ({c['kind']}): d = {texts._f(c['mean_d'])} "
          f"[{texts._f(c['ci_low'])}, {texts._f(c['ci_high'])}], Holm p = "
          f"{texts._f(c['p_holm'], '.3g')}: **{c['verdict']}** (predicted: {c['predicted']})")
  return "\n".join(lines) + "\n"


def image_key(path: pathlib.Path) -> str:
  """``curves_<setting>_<cell>.png`` -> ``curves/<setting>_<cell>``."""
  return "curves/" + path.stem[len("curves_"):]


def run_config(spec, plan: dict, rows: list[dict]) -> dict:
  return dict(plan=plan, spec_path=str(spec.path),
              protocol_commits=sorted({r["protocol_commit"] for r in rows
                                       if r.get("protocol_commit")}),
              code_commits=sorted({r["code_commit"] for r in rows if r.get("code_commit")}),
              dirty_paths=sorted({p for r in rows for p in r.get("dirty") or []}),
              report_code_commit=protocol.code_state(spec.path)["code_commit"])


def artifact_files(spec, outdir: pathlib.Path, home: pathlib.Path,
                   images: list[pathlib.Path]) -> dict[str, pathlib.Path]:
  """``{name in the artifact: file}``: the report, the protocol, the rows."""
  files = {"REPORT.md": outdir / "REPORT.md", "PREDICTIONS.md": home / "PREDICTIONS.md",
           "predictions.json": home / "predictions.json",
           "spec.py": pathlib.Path(spec.path)}
  for name in ("results.jsonl", "tuning.jsonl", "PLAN.md", "confirmed_seeds.json"):
    if (outdir / name).exists():
      files[name] = outdir / name
  files.update({p.name: p for p in images})
  return {k: v for k, v in files.items() if v.exists()}


def build_report(plan: dict, comparisons: list[dict], *, entity: str, project: str,
                 run_id: str, image_keys: list[str]):
  """The W&B Report of the study's run (not saved): the verdicts, then a
  panel grid of that one run with the comparisons and arms tables and the
  curves."""
  import wandb_workspaces.reports.v2 as wr
  from wandb_workspaces import expr
  runset = wr.Runset(entity=entity, project=project, name=plan["name"][:100],
                     filters=[expr.Metric("ID") == run_id])
  panels = [wr.WeavePanelSummaryTable(table_name="comparisons", layout=wr.Layout(w=24, h=12)),
            wr.WeavePanelSummaryTable(table_name="arms", layout=wr.Layout(w=24, h=8)),
            wr.MediaBrowser(title="curves", media_keys=list(image_keys), num_columns=1,
                            layout=wr.Layout(w=24, h=10))]
  return wr.Report(
      project=project, entity=entity, title=f"{plan['name']}: ablation report"[:128],
      description=f"python -m ba_jax.ablate --spec={plan['spec']} --stage=report",
      blocks=[wr.MarkdownBlock(text=verdicts_md(plan, comparisons)),
              wr.PanelGrid(runsets=[runset], panels=panels)])


def log_study(spec, plan: dict, rows: list[dict], outdir, home, images, log: schema.Log,
              *, note: Callable[[str], None] = print) -> dict:
  """Logs the study as one W&B run (and, online, saves its Report); returns
  the run's id, mode and directory, and the Report's URL when one was saved.
  Its files go to ``$WANDB_DIR``, else ``<outdir>/runs``."""
  import wandb
  outdir, home = pathlib.Path(outdir), pathlib.Path(home)
  images = [pathlib.Path(p) for p in images]
  directory = os.environ.get("WANDB_DIR") or str(outdir / "runs")
  os.makedirs(directory, exist_ok=True)
  config = run_config(spec, plan, rows)
  run, mode = tracking.start_wandb(log, note=note, name=plan["name"], job_type=JOB_TYPE,
                                   dir=directory, config=config)
  out = dict(id=run.id, mode=mode, dir=os.path.dirname(run.dir))
  try:
    made = tables(plan, rows)
    record = {name: wandb.Table(columns=c, data=d, allow_mixed_types=True)
              for name, (c, d) in made.items()}
    record.update({image_key(p): wandb.Image(str(p)) for p in images})
    run.log(record)
    artifact = wandb.Artifact(slug(plan["name"]), type=JOB_TYPE, metadata=dict(
        study=plan["name"], protocol_commits=config["protocol_commits"],
        code_commits=config["code_commits"]))
    for name, path in artifact_files(spec, outdir, home, images).items():
      artifact.add_file(str(path), name=name)
    run.log_artifact(artifact)
    if mode == "online":
      out["report_url"] = _save_report(plan, run, made, images, note)
  finally:
    run.finish()
  return out


def _save_report(plan, run, made, images, note) -> str | None:
  if importlib.util.find_spec(REPORTS_PACKAGE) is None:
    note(f"W&B Report not built: it needs {REPORTS_PACKAGE} ({tracking.EXTRA})")
    return None
  columns, data = made["comparisons"]
  report = build_report(plan, [dict(zip(columns, d)) for d in data], entity=run.entity,
                        project=run.project, run_id=run.id,
                        image_keys=[image_key(p) for p in images])
  try:
    report.save()
  except Exception as e:  # the Reports API's many network and permission errors
    note(f"W&B Report not saved ({(str(e).splitlines() or [type(e).__name__])[0][:200]}); "
         "the run has its tables and images")
    return None
  note(f"W&B Report: {report.url}")
  return report.url
