"""The report stage's W&B run (``ba_jax.ablation.wandb_report``): the
committed tiny_rules study reported with ``--wandb`` into an offline run,
read back from its own files: the tables hold REPORT.md's numbers, the
curves and the protocol artifact are the files the stage wrote, the config
holds the plan and the commits. Then when tracking is on, and the W&B Report
built (not saved) from what was logged."""
import base64
import dataclasses
import hashlib
import importlib.util
import json
import pathlib
import shutil

import numpy as np
import pytest

from ba_jax import ablate
from ba_jax.ablation import spec as spec_lib, stages, texts, wandb_report
from ba_jax.ablation.comparisons import run_tests, setting_rows, settings_of
from ba_jax.ablation.store import read_rows
import wandb_records

ROOT = pathlib.Path(__file__).resolve().parents[1]
STUDY = ROOT / "experiments" / "studies" / "tiny_rules"


def _report(tmp, monkeypatch, **kw):
  """The tiny_rules report stage, from copies of its committed rows, with a
  W&B run offline under ``tmp``; returns what it wrote and noted."""
  monkeypatch.chdir(ROOT)
  wandb_records.offline_env(monkeypatch, tmp / "wandb")
  out = tmp / "out"
  out.mkdir()
  for name in ("results.jsonl", "tuning.jsonl"):
    shutil.copy(STUDY / "results" / name, out)
  spec = spec_lib.load(STUDY / "spec.py")
  notes = []
  text = stages.report(spec, out, wandb="on", log=notes.append, **kw)
  (run_dir,) = wandb_records.runs(tmp / "wandb")
  return dict(spec=spec, out=out, text=text, notes=notes, run=run_dir,
              plan=stages.load_plan(spec), rows=read_rows(out / "results.jsonl"))


@pytest.fixture(scope="module")
def reported(tmp_path_factory):
  with pytest.MonkeyPatch.context() as mp:
    return _report(tmp_path_factory.mktemp("ablation_wandb"), mp)


def test_the_comparisons_table_holds_the_reports_tests(reported):
  plan, rows, run = reported["plan"], reported["rows"], reported["run"]
  logged = wandb_records.logged(run)
  got = wandb_records.table(run, logged["comparisons"])
  lines = reported["text"].splitlines()
  committed = (STUDY / "results" / "REPORT.md").read_text().splitlines()
  n = 0
  for setting in settings_of(plan):
    for outcome, _ in [plan["primary"], *plan["secondary"]]:
      confirmatory = setting == "tuned" and outcome == plan["primary"][0]
      for t in run_tests(plan, rows, setting, outcome):
        (g,) = [g for g in got if (g["setting"], g["outcome"], g["cell"], g["a"], g["b"],
                                   g["kind"]) == (setting, outcome, t["cell"], t["a"],
                                                  t["b"], t["kind"])]
        n += 1
        assert g["confirmatory"] == confirmatory
        assert g["n"] == t["t"]["n"] == len(plan["confirm_seeds"])
        for key, want in (("mean_d", t["t"]["mean"]), ("ci_low", t["t"]["low"]),
                          ("ci_high", t["t"]["high"]), ("p", t["p"]),
                          ("sign_p", t["sign"]["p"])):
          assert g[key] == pytest.approx(want, rel=1e-12), key
        assert (g["sign_wins"], g["sign_losses"]) == (t["sign"]["wins"], t["sign"]["losses"])
        assert g["p_holm"] == (pytest.approx(t["p_holm"], rel=1e-12) if confirmatory
                               else None)
        assert g["verdict"] == texts.verdict(plan, t, confirmatory)
        # the same test's line in REPORT.md (and in the committed one): its
        # estimate, CI, p and verdict
        cells = (f"| {t['cell']} | {t['a']} - {t['b']} ({t['kind']}) | {t['t']['n']} | "
                 f"{texts._f(g['mean_d'])} [{texts._f(g['ci_low'])}, "
                 f"{texts._f(g['ci_high'])}] | {texts._f(g['p'], '.3g')} |")
        for text in (lines, committed):
          assert any(l.startswith(cells) and f" {g['verdict']} |" in l for l in text)
        assert g["predicted"] == plan["predictions"]["tiny"]["balanced vs token"]
  assert n == len(got) == 4 == logged["comparisons"]["nrows"]


def test_the_arms_and_results_tables_hold_the_rows(reported):
  plan, rows, run = reported["plan"], reported["rows"], reported["run"]
  logged = wandb_records.logged(run)
  arms = wandb_records.table(run, logged["arms"])
  assert [(a["setting"], a["cell"], a["arm"]) for a in arms] == [
      ("tuned", "tiny", "token"), ("tuned", "tiny", "balanced")]
  for a in arms:
    rs = [r for r in setting_rows(plan, rows, "tuned") if r["arm"] == a["arm"]]
    assert a["seeds"] == len(rs) == 4 and a["lr"] == plan["chosen"][f"tiny/{a['arm']}"]
    for field in ("reward_auc", "heldout_after", "entropy_drift", "length_cv_first"):
      v = np.array([r[field] for r in rs])
      assert a[f"{field}_mean"] == pytest.approx(v.mean(), rel=1e-12), field
      assert a[f"{field}_sd"] == pytest.approx(v.std(ddof=1), rel=1e-12), field
    assert a["unstable"] == sum(r["stability"]["collapsed"] for r in rs)
    # REPORT.md's row of this arm shows the same primary outcome
    primary = f"{a['reward_auc_mean']:.3f} ± {a['reward_auc_sd']:.3f}"
    assert any(l.startswith(f"| tiny | {a['arm']} |") and primary in l
               for l in reported["text"].splitlines())
  results = wandb_records.table(run, logged["results"])
  assert len(results) == len(rows) == 8
  for got, row in zip(results, rows):
    assert (got["cell"], got["arm"], got["seed"], got["lr"]) == (
        row["cell"], row["arm"], row["seed"], row["lr"])
    assert got["reward_auc"] == row["reward_auc"]
    assert got["stability/collapsed"] == row["stability"]["collapsed"]
    assert got["overrides/loss.aggregation"] == row["arm"]
    assert json.loads(got["dirty"]) == row["dirty"]
    assert "curves" not in got and not any(k.startswith("curves/") for k in got)


def _md5(path) -> str:
  return base64.b64encode(hashlib.md5(pathlib.Path(path).read_bytes()).digest()).decode()


def test_curves_artifact_and_config(reported):
  run, out, plan, rows = reported["run"], reported["out"], reported["plan"], reported["rows"]
  logged = wandb_records.logged(run)
  image = logged["curves/tuned_tiny"]
  assert image["_type"] == "image-file"
  assert (pathlib.Path(run) / "files" / image["path"]).read_bytes() == (
      out / "curves_tuned_tiny.png").read_bytes()
  (artifact,) = [a for a in wandb_records.of_type(run, "artifact")
                 if a.type == "ablation-report"]
  assert artifact.name == "BA-against-token-on-the-tiny-job"
  files = {c.path: c.digest for c in artifact.manifest.contents}
  home = STUDY / "results"
  assert files == {
      "REPORT.md": _md5(out / "REPORT.md"), "PREDICTIONS.md": _md5(home / "PREDICTIONS.md"),
      "predictions.json": _md5(home / "predictions.json"), "spec.py": _md5(STUDY / "spec.py"),
      "results.jsonl": _md5(out / "results.jsonl"), "tuning.jsonl": _md5(out / "tuning.jsonl"),
      "curves_tuned_tiny.png": _md5(out / "curves_tuned_tiny.png")}
  (record,) = wandb_records.of_type(run, "run")
  assert record.job_type == "ablation-report" and record.display_name == plan["name"]
  assert record.project == "ba_jax"  # configs/tiny.py's log.wandb_project
  config = wandb_records.config(run)
  assert config["plan"] == json.loads((home / "predictions.json").read_text())
  assert config["protocol_commits"] == sorted({r["protocol_commit"] for r in rows})
  assert config["code_commits"] == sorted({r["code_commit"] for r in rows})
  assert len(config["protocol_commits"][0]) == 40 and config["dirty_paths"] == []
  assert any("logged offline" in n and "wandb sync" in n for n in reported["notes"])


def test_tracking_is_on_from_the_config_or_the_flag(monkeypatch):
  monkeypatch.chdir(ROOT)
  spec = spec_lib.load(STUDY / "spec.py")
  log = wandb_report.base_log(spec)
  assert log.backends == "tensorboard"  # configs/tiny.py:smoke, as the runs see it
  assert not wandb_report.tracking_on("auto", log) and wandb_report.resolve("auto", spec) is None
  assert wandb_report.tracking_on("on", log) and not wandb_report.tracking_on("off", log)
  tracked = dataclasses.replace(spec, overrides=dict(
      spec.overrides, **{"log.backends": "tensorboard,wandb", "log.wandb_project": "p2"}))
  log = wandb_report.resolve("auto", tracked)
  assert log.backends == "tensorboard,wandb" and log.wandb_project == "p2"
  with pytest.raises(ValueError, match=r"--wandb='yes': expected one of"):
    wandb_report.tracking_on("yes", log)
  missing = dataclasses.replace(spec, config="configs/missing.py")
  with pytest.raises(FileNotFoundError, match="configs/missing.py"):
    wandb_report.resolve("on", missing)
  assert wandb_report.resolve("off", missing) is None  # off reads no config
  # the command line: --wandb alone is on, the default auto
  seen = []
  monkeypatch.setattr(stages, "run", lambda *a, **kw: seen.append(kw["wandb"]))
  for argv, want in (([], "auto"), (["--wandb"], "on"), (["--wandb=off"], "off")):
    assert ablate.main([f"--spec={STUDY / 'spec.py'}", "--stage=report", *argv]) == 0
    assert seen.pop() == want
  # on without wandb installed: one line naming the install command
  find_spec = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: (
      None if name == "wandb" else find_spec(name, *a)))
  with pytest.raises(ValueError, match=r"--wandb=on: the report's W&B run needs the "
                     r'wandb package, which is not installed: pip install -e "\.\[tracking\]"'):
    wandb_report.resolve("on", spec)


def test_the_wandb_report_shows_the_logged_verdicts_tables_and_curves(reported):
  import wandb_workspaces.reports.v2 as wr
  run, plan = reported["run"], reported["plan"]
  logged = wandb_records.logged(run)
  comparisons = wandb_records.table(run, logged["comparisons"])
  images = [k for k, v in logged.items() if isinstance(v, dict) and v["_type"] == "image-file"]
  report = wandb_report.build_report(plan, comparisons, entity="e", project="p",
                                     run_id="r1d", image_keys=images)
  assert (report.entity, report.project) == ("e", "p")
  assert report.title == f"{plan['name']}: ablation report"
  markdown, grid = report.blocks
  assert isinstance(markdown, wr.MarkdownBlock) and isinstance(grid, wr.PanelGrid)
  confirmatory = [c for c in comparisons if c["confirmatory"]]
  verdicts = [l for l in markdown.text.splitlines() if l.startswith("- ")]
  assert len(verdicts) == len(confirmatory) == 2
  for line, c in zip(verdicts, confirmatory):
    assert line.startswith(f"- tiny: balanced - token ({c['kind']}): "
                           f"d = {texts._f(c['mean_d'])} [{texts._f(c['ci_low'])}, ")
    assert f"Holm p = {texts._f(c['p_holm'], '.3g')}: **{c['verdict']}**" in line
  (runset,) = grid.runsets
  assert (runset.entity, runset.project) == ("e", "p") and "'r1d'" in runset.filters
  tables = [p.table_name for p in grid.panels if isinstance(p, wr.WeavePanelSummaryTable)]
  assert tables == ["comparisons", "arms"] and set(tables) <= set(logged)
  (media,) = [p for p in grid.panels if isinstance(p, wr.MediaBrowser)]
  assert media.media_keys == images == ["curves/tuned_tiny"]


def test_an_online_run_saves_its_report(tmp_path, monkeypatch):
  """The online path with the network left out: the run itself offline but
  told it is online, and ``Report.save`` replaced by a recorder."""
  import wandb_workspaces.reports.v2 as wr
  start = wandb_report.tracking.start_wandb
  monkeypatch.setattr(wandb_report.tracking, "start_wandb",
                      lambda *a, **kw: (start(*a, **kw)[0], "online"))
  saved = []

  def save(report, draft=False, clone=False):
    saved.append(report)
    report.id = "saved"
  monkeypatch.setattr(wr.Report, "save", save)
  monkeypatch.setattr(wr.Report, "url", property(lambda r: f"report {r.id}"))
  result = _report(tmp_path, monkeypatch)
  (report,) = saved
  assert report.blocks[1].panels[0].table_name == "comparisons"
  assert "W&B Report: report saved" in result["notes"]
