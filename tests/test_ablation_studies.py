"""Our own studies through the ablation package: each committed REPORT.md is
what ``python -m ba_jax.ablate --stage=report`` makes of the committed result
files, figure for figure."""
import pathlib
import re
import shutil

import pytest

from ba_jax.ablation import spec as spec_lib, stages

ROOT = pathlib.Path(__file__).resolve().parents[1]
STUDIES = sorted(p.parent for p in (ROOT / "experiments" / "studies").glob("*/spec.py")
                 if (p.parent / "results" / "REPORT.md").exists())
NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?")


def test_there_are_studies_to_check():
  assert {p.name for p in STUDIES} >= {"powered_drafts", "tiny_rules"}


@pytest.mark.parametrize("study", STUDIES, ids=lambda p: p.name)
def test_the_committed_report_regenerates_from_the_committed_rows(study, tmp_path,
                                                                  monkeypatch):
  monkeypatch.chdir(ROOT)
  spec = spec_lib.load(study / "spec.py")
  results = study / "results"
  for name in ("results.jsonl", "tuning.jsonl", "confirmed_seeds.json"):
    if (results / name).exists():
      shutil.copy(results / name, tmp_path)
  text = stages.report(spec, tmp_path, log=lambda *_: None)
  committed = (results / "REPORT.md").read_text()
  assert NUMBER.findall(text) == NUMBER.findall(committed)
  assert text == committed
