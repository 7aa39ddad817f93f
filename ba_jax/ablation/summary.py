"""One run's result row from its workdir (``metrics.jsonl``, ``summary.json``,
``config.json``, ``devices.json``, as ``python -m ba_jax.train`` writes them):
the outcomes, the aggregation mechanism's diagnostics, stability, the curves
and the devices the run saw (``ran_on``)."""
from __future__ import annotations

import json
import pathlib

import numpy as np

from ba_jax.ablation import stability
from ba_jax.ablation.store import read_rows

CURVES = ("reward_mean", "entropy", "length_mean")


def _mean(values) -> float:
  v = [x for x in values if x is not None and np.isfinite(x)]
  return float(np.mean(v)) if v else float("nan")


def drift(values, width: int = 5) -> float:
  """Mean of the last ``width`` values over the mean of the first ``width``
  (fewer when the run is short, so that the two windows never overlap)."""
  v = np.array([np.nan if x is None else x for x in values], float)
  width = max(1, min(width, len(v) // 2))
  first, last = v[:width], v[-width:]
  if not (np.isfinite(first).any() and np.isfinite(last).any()):
    return float("nan")
  start, end = np.nanmean(first), np.nanmean(last)
  return float(end / start) if start else float("nan")


def summarise(workdir: str | pathlib.Path) -> dict:
  """The outcomes of the run in ``workdir``.

  ``reward_auc`` is the mean training reward over the RL run; a run the
  non-finite guard stopped counts 0 for its missing steps and 0 held-out
  accuracy (a broken policy), and as unstable."""
  workdir = pathlib.Path(workdir)
  records = read_rows(workdir / "metrics.jsonl")
  summary = json.loads((workdir / "summary.json").read_text())
  config = json.loads((workdir / "config.json").read_text())
  series = lambda name: [r.get(name) for r in records]
  stopped = "after_rl" not in summary
  rewards = [x for x in series("reward_mean") if x is not None]
  planned = max(config["rl"]["steps"], len(rewards)) if stopped else len(rewards)
  share_minus_frac = [s - f for s, f in zip(series("w_pos_share"), series("pos_frac"))
                      if s is not None and f is not None]
  return dict(
      steps=len(records), stopped_nonfinite=stopped,
      reward_auc=float(np.sum(rewards) / planned) if planned else float("nan"),
      heldout_before=summary["before_rl"]["heldout_acc_sampled"],
      heldout_after=0.0 if stopped else summary["after_rl"]["heldout_acc_sampled"],
      heldout_samples=config["eval"]["num_problems"] * config["eval"]["samples_per_problem"],
      reward_samples=len(records) * config["rl"]["prompts_per_step"] * config["rl"]["group_size"],
      groups_mixed_frac=_mean(series("groups_mixed_frac")),
      pos_share_minus_frac=_mean(share_minus_frac),
      pos_frac=_mean(series("pos_frac")),
      entropy_drift=drift(series("entropy")),
      length_drift=drift(series("length_mean")),
      weight_length_corr=_mean(series("weight_length_corr")),
      length_cv=_mean(series("length_cv_in_group")),
      length_cv_first=_mean(series("length_cv_in_group")[:1]),
      length_gap_in_group_rel=_mean(series("length_gap_in_group_rel")),
      # the sampler-trainer gap a correction (tis, mis) works on, and the share
      # of tokens it truncates or masks (NaN where the run does not log them)
      mismatch_k3=_mean(series("mismatch_k3")),
      mismatch_corrected_frac=_mean(series("mismatch_corrected_frac")),
      stability=dict(stability.report(records), **({"collapsed": True} if stopped else {})),
      curves={k: series(k) for k in CURVES},
      **({"ran_on": json.loads((workdir / "devices.json").read_text())}
         if (workdir / "devices.json").exists() else {}))
