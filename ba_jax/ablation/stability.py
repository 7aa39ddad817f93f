"""Training stability of one RL run, from its per-step metrics.

A run is unstable (``collapsed``) when any of three signals crosses its
threshold; each is computed on the 5-step trailing mean of its series
(``smooth``), so one noisy step does not decide it:

* ``accuracy_peak_drop``: the largest drop of smoothed training accuracy
  below its running peak (absolute); unstable above ``PEAK_DROP`` = 0.2.
  It catches a run that learned and then fell, even if it partly recovered.
* ``entropy_ratio_max`` / ``entropy_ratio_min``: the smoothed policy entropy's
  largest and smallest value over its start (the first window's mean);
  blow-up above ``ENTROPY_BLOWUP`` = 2.0 (the policy is turning into
  noise), collapse below ``ENTROPY_COLLAPSE`` = 0.1 (it stopped exploring).
* ``length_ratio_max``: the smoothed mean response length's largest value over
  its start; run-away above ``LENGTH_RUNAWAY`` = 2.0.

The per-step series come from the trainer's ``metrics.jsonl``: ``accuracy``
(training reward accuracy), ``entropy`` (ba_jax.loss.losses), ``length_mean`` and
``clip_frac_low``/``clip_frac_high`` (reported as their mean, not judged).
"""
from __future__ import annotations

import numpy as np

WIDTH = 5
PEAK_DROP = 0.2
ENTROPY_BLOWUP = 2.0
ENTROPY_COLLAPSE = 0.1
LENGTH_RUNAWAY = 2.0
THRESHOLDS = dict(accuracy_peak_drop=PEAK_DROP,
                  entropy_ratio_max=ENTROPY_BLOWUP,
                  entropy_ratio_min=ENTROPY_COLLAPSE,
                  length_ratio_max=LENGTH_RUNAWAY)


def smooth(values, width: int = WIDTH) -> np.ndarray:
  """Trailing mean over ``width`` steps (fewer at the start); NaNs skipped."""
  x = np.asarray(values, float)
  out = np.full(len(x), np.nan)
  for i in range(len(x)):
    window = x[max(0, i - width + 1):i + 1]
    if np.isfinite(window).any():
      out[i] = np.nanmean(window)
  return out


def peak_drop(accuracy) -> float:
  """Largest fall of the smoothed series below its running peak (0 if it
  never falls; NaN without data)."""
  s = smooth(accuracy)
  s = s[np.isfinite(s)]
  if not len(s):
    return float("nan")
  return float(np.max(np.maximum.accumulate(s) - s))


def _ratios(values) -> tuple[float, float]:
  """(max, min) of the smoothed series over its first window's mean."""
  x = np.asarray(values, float)
  start = x[:WIDTH][np.isfinite(x[:WIDTH])]
  s = smooth(x)
  s = s[np.isfinite(s)]
  if not len(start) or not len(s) or start.mean() <= 0:
    return float("nan"), float("nan")
  return float(s.max() / start.mean()), float(s.min() / start.mean())


def report(records: list[dict]) -> dict:
  """Stability metrics and verdicts of one run's per-step records."""
  def series(key):
    return [np.nan if r.get(key) is None else r[key] for r in records]
  entropy_max, entropy_min = _ratios(series("entropy"))
  length_max, _ = _ratios(series("length_mean"))
  clip = np.asarray(series("clip_frac_low"), float) + np.asarray(
      series("clip_frac_high"), float)
  out = dict(accuracy_peak_drop=peak_drop(series("accuracy")),
             entropy_ratio_max=entropy_max, entropy_ratio_min=entropy_min,
             length_ratio_max=length_max,
             clip_frac_mean=float(np.nanmean(clip)) if np.isfinite(
                 clip).any() else float("nan"))
  flags = dict(
      accuracy_dropped=out["accuracy_peak_drop"] > PEAK_DROP,
      entropy_blew_up=entropy_max > ENTROPY_BLOWUP,
      entropy_collapsed=entropy_min < ENTROPY_COLLAPSE,
      length_ran_away=length_max > LENGTH_RUNAWAY)
  out.update({k: bool(v) for k, v in flags.items()})
  out["collapsed"] = any(flags.values())
  return out
