"""Our own studies through the ablation package: each committed REPORT.md is
what ``python -m ba_jax.ablate --stage=report`` makes of the committed result
files, figure for figure."""
import pathlib
import re
import shutil

import pytest

from ba_jax.ablation import spec as spec_lib, stages

ROOT = pathlib.Path(__file__).resolve().parents[1]
# (spec file, its results folder) for every spec whose report is committed;
# a study may hold several specs (powered_drafts: spec.py, fresh_spec.py).
STUDIES = sorted(
    (path, ROOT / spec_lib.load(path).results)
    for path in (ROOT / "experiments" / "studies").glob("*/*spec.py")
    if (ROOT / spec_lib.load(path).results / "REPORT.md").exists())
NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?")


def test_there_are_studies_to_check():
  assert {str(path.relative_to(ROOT / "experiments" / "studies"))
          for path, _ in STUDIES} >= {"powered_drafts/spec.py",
                                      "powered_drafts/fresh_spec.py",
                                      "tiny_rules/spec.py"}


@pytest.mark.parametrize(
    "spec_file,results", STUDIES,
    ids=[f"{path.parent.name}/{path.stem}" for path, _ in STUDIES])
def test_the_committed_report_regenerates_from_the_committed_rows(
    spec_file, results, tmp_path, monkeypatch):
  monkeypatch.chdir(ROOT)
  spec = spec_lib.load(spec_file)
  for name in ("results.jsonl", "tuning.jsonl", "confirmed_seeds.json"):
    if (results / name).exists():
      shutil.copy(results / name, tmp_path)
  text = stages.report(spec, tmp_path, log=lambda *_: None)
  committed = (results / "REPORT.md").read_text()
  assert NUMBER.findall(text) == NUMBER.findall(committed)
  assert text == committed
