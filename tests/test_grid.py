"""The aggregation grid: stability verdicts on synthetic curves, paired
statistics, and the script end to end on a 2-step smoke setting."""
import json
import pathlib

import numpy as np
import pytest

from ba_jax.ablation import stability
from experiments.studies.chains_grid import grid_aggregation

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _records(accuracy, entropy=None, length=None):
  n = len(accuracy)
  entropy = [1.0] * n if entropy is None else entropy
  length = [20.0] * n if length is None else length
  return [dict(step=i + 1, accuracy=a, entropy=e, length_mean=l,
               clip_frac_low=0.01, clip_frac_high=0.02)
          for i, (a, e, l) in enumerate(zip(accuracy, entropy, length))]


def test_a_steady_learner_is_stable():
  r = stability.report(_records(list(np.linspace(0.2, 0.8, 30))))
  assert r["accuracy_peak_drop"] == 0.0 and not r["collapsed"]
  assert r["entropy_ratio_max"] == pytest.approx(1.0)
  assert r["clip_frac_mean"] == pytest.approx(0.03)


def test_each_signal_crosses_its_threshold():
  # Learned to 0.8, fell to 0.3 and partly recovered: the drop still counts.
  fell = stability.report(_records([0.8] * 10 + [0.3] * 10 + [0.6] * 10))
  assert fell["accuracy_peak_drop"] == pytest.approx(0.5)
  assert fell["accuracy_dropped"] and fell["collapsed"]
  blown = stability.report(_records([0.5] * 20, entropy=[1.0] * 10 + [3.0] * 10))
  assert blown["entropy_ratio_max"] == pytest.approx(3.0)
  assert blown["entropy_blew_up"] and not blown["entropy_collapsed"]
  frozen = stability.report(_records([0.5] * 20, entropy=[1.0] * 10 + [0.05] * 10))
  assert frozen["entropy_collapsed"] and frozen["collapsed"]
  long = stability.report(_records([0.5] * 20, length=[20.0] * 10 + [50.0] * 10))
  assert long["length_ratio_max"] == pytest.approx(2.5) and long["length_ran_away"]
  # A single bad step is smoothed away.
  blip = stability.report(_records([0.8] * 10 + [0.0] + [0.8] * 10))
  assert blip["accuracy_peak_drop"] == pytest.approx(0.16) and not blip["collapsed"]


def test_missing_series_are_nan_not_a_verdict():
  r = stability.report([dict(step=1, accuracy=None)])
  assert np.isnan(r["accuracy_peak_drop"]) and not r["collapsed"]


def test_paired_differences_and_sign_test():
  rows = [dict(mode=m, seed=s, heldout_after=v) for s, (a, b) in
          enumerate([(0.6, 0.5), (0.7, 0.5), (0.6, 0.55), (0.5, 0.4), (0.8, 0.6)])
          for m, v in (("balanced", a), ("token", b))]
  p = grid_aggregation.paired(rows, "balanced", "token", "heldout_after")
  d = np.array([0.1, 0.2, 0.05, 0.1, 0.2])
  assert p["n"] == 5 and p["mean"] == pytest.approx(d.mean())
  assert p["wins"] == 5 and p["losses"] == 0
  assert p["sign_p"] == pytest.approx(2 * 0.5 ** 5)  # exact two-sided
  assert d.min() <= p["low"] <= p["mean"] <= p["high"] <= d.max()
  # Only seeds both rules ran are paired.
  assert grid_aggregation.paired(rows[:-1], "balanced", "token",
                                 "heldout_after")["n"] == 4


def _row(spread, gap, mode, seed, acc, cv, gap_rel):
  st = stability.report(_records([acc] * 6))
  return dict(spread=spread, gap=gap, mode=mode, seed=seed, heldout_before=0.3,
              heldout_after=acc, reward_auc=acc, groups_mixed_frac=0.5,
              length_cv=cv, length_cv_in_subset=0.2,
              length_gap_in_group_rel=gap_rel, weight_length_corr=0.0,
              length_cv_first=cv + 0.1,
              length_gap_in_group_rel_first=float("nan"), stability=st)


def test_table_reports_cells_stability_lengths_and_pairs():
  rows = [_row("high", "pos", m, s, 0.4 + 0.1 * (m == "balanced") + 0.01 * s,
               0.5 + 0.02 * s, 0.3 + 0.1 * s)
          for m in grid_aggregation.MODES for s in range(3)]
  text = grid_aggregation.table(rows, "cmd")
  assert "| high | pos | balanced | 3 |" in text and "## Stability" in text
  # Pooled length statistics: mean over runs [min, max], first-step CV too.
  assert "| high | pos | 12 | +0.520 [+0.500, +0.540] | +0.620 [+0.600, " \
      "+0.640] | +0.400 [+0.300, +0.500] | n/a |" in text
  assert "| high | pos | heldout_after | +0.100 [+0.100, +0.100] 3:0 p=0.25 |" in text


@pytest.mark.slow
def test_grid_runs_a_smoke_cell_and_writes_its_reports(tmp_path, monkeypatch):
  monkeypatch.chdir(ROOT)
  out = tmp_path / "grid"
  rows = grid_aggregation.main([
      "--gaps=neg,pos", "--spreads=high", "--modes=token,balanced",
      "--seeds=1", "--variant=smoke", f"--outdir={out}",
      "--override=--config.rl.steps=2"])
  assert len(rows) == 2 * 2
  for row in rows:
    assert row["steps"] == 2 and len(row["curves"]["entropy"]) == 2
    assert "collapsed" in row["stability"]
  # Common random numbers: one warm-up per seed, shared by gaps and rules.
  assert len({r["heldout_before"] for r in rows if r["gap"] == "pos"}) == 1
  assert len(list((out / "runs").glob("warmup_*"))) == 1
  table = (out / "table.md").read_text()
  assert "| high | neg | balanced | 1 |" in table
  assert "balanced - token" in table
  assert (out / "curves_high_pos.png").stat().st_size > 10_000
  lines = (out / "results.jsonl").read_text().splitlines()
  assert len(lines) == len(rows) and json.loads(lines[0])["spread"] == "high"
