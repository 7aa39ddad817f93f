"""The ablation script end to end on a 2-step config, so it cannot rot.

Two of the rules run (every rule's loss and gradient are checked in
test_aggregation, test_microbatch and test_chunked_scoring); each further
rule here would add a process start and a fresh train-step compile, the bulk
of this test's time in CI's cold cache."""
import json
import pathlib

import pytest

from experiments.studies.aggregation_ablation import ablate_aggregation

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_ablation_runs_the_named_modes_and_writes_its_reports(tmp_path,
                                                              monkeypatch):
  monkeypatch.chdir(ROOT)
  out = tmp_path / "ablation"
  args = ["--config=configs/tiny.py", "--variant=smoke", "--seeds=1",
          "--modes=token,balanced", f"--outdir={out}", "--eval_every=1",
          "--override=--config.rl.steps=2"]
  rows = ablate_aggregation.main(args)
  assert [r["mode"] for r in rows] == ["token", "balanced"]
  lines = (out / "results.jsonl").read_text().splitlines()
  assert [json.loads(l)["mode"] for l in lines] == [r["mode"] for r in rows]
  for row in rows:
    summary = json.loads(
        (pathlib.Path(row["workdir"]) / "summary.json").read_text())
    assert row["steps"] == 2
    assert row["heldout_after"] == summary["after_rl"]["heldout_acc_sampled"]
    # Every mode starts RL from the seed's one warm-up.
    assert row["heldout_before"] == rows[0]["heldout_before"]
    steps, acc = row["curves"]["heldout_acc_sampled"]
    assert steps == [0, 1, 2] and acc[0] == row["heldout_before"]
  table = (out / "table.md").read_text()
  for mode in ("token", "balanced"):
    assert f"| {mode} | 1 |" in table
  assert "| sequence |" not in table
  assert (out / "curves.png").stat().st_size > 10_000
  # A finished ablation is not rerun: a second call only re-reads results.
  before = {r["workdir"]: (pathlib.Path(r["workdir"]) / "metrics.jsonl")
            .stat().st_mtime for r in rows}
  ablate_aggregation.main(args)
  for workdir, mtime in before.items():
    assert (pathlib.Path(workdir) / "metrics.jsonl").stat().st_mtime == mtime


def test_collapse_definition():
  assert not ablate_aggregation.collapsed([0.2, 0.4, 0.5, 0.6, 0.6, 0.6])
  assert ablate_aggregation.collapsed([0.6] * 5 + [0.0] * 10)
  assert not ablate_aggregation.collapsed([])
