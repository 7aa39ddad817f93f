"""Statistics of a paired, seed-matched ablation (``python -m ba_jax.ablate``).

Every comparison is paired: run ``i`` of rule A and run ``i`` of rule B share
a seed (the warm-up, the problem stream and the sampler's key), so the unit
of analysis is the per-seed difference ``d_i = A_i - B_i``.

* ``paired_t``: Student's t-test on the differences (scipy.stats.ttest_1samp
  on ``d``, which is ``ttest_rel(a, b)``), with its confidence interval.
* ``sign_test``: the exact sign test (scipy.stats.binomtest on the non-zero
  differences; ties are dropped, the usual convention).
* ``mean_above``: one-sided t-test of H0 ``mean(d) <= bound`` against H1
  ``mean(d) > bound``, with the one-sided 95% lower bound of the mean.
* ``noninferiority``: ``mean_above`` at ``-margin`` (A is at most
  ``margin`` worse than B).
* ``holm``: Holm's step-down adjustment over a named family of p-values
  (R's ``p.adjust(p, "holm")``; neither scipy nor numpy has it, and
  statsmodels, which does, is not a dependency for ten lines).
* ``min_detectable_difference``: the smallest true mean difference a paired
  t-test detects with the given power, from the non-central t distribution
  (exact for normal differences; ``method="normal"`` gives the z
  approximation, which is smaller for few seeds).
* ``sampling_noise_share``: how much of the seed-to-seed variance of an
  accuracy is the binomial noise of its finite evaluation.

scipy gives every distribution and test (``ttest_1samp``, ``binomtest``,
``t``, ``nct``, ``brentq``); this module only names the comparisons.
"""
from __future__ import annotations

import math
from typing import Mapping, Sequence

import numpy as np
from scipy import optimize, stats

ALTERNATIVES = ("two-sided", "greater", "less")


def _diffs(d) -> np.ndarray:
  d = np.asarray(d, float)
  if d.ndim != 1:
    raise ValueError(f"differences: expected a 1-D array, got shape {d.shape}")
  d = d[np.isfinite(d)]
  return d


def _check_alternative(alternative: str) -> None:
  if alternative not in ALTERNATIVES:
    raise ValueError(f"alternative={alternative!r}: expected one of {ALTERNATIVES}")


def paired_t(d, *, alternative: str = "two-sided", confidence: float = 0.95) -> dict:
  """Paired t-test of the per-seed differences ``d`` (H0: mean 0).

  Returns n, mean, sd (ddof 1), t, p and the two-sided ``confidence``
  interval of the mean (NaN where undefined: n < 2, or every difference
  equal, where t is +-inf or NaN)."""
  _check_alternative(alternative)
  d = _diffs(d)
  n = len(d)
  out = dict(n=n, mean=float(d.mean()) if n else math.nan,
             sd=float(d.std(ddof=1)) if n > 1 else math.nan,
             t=math.nan, p=math.nan, low=math.nan, high=math.nan)
  if n < 2 or not out["sd"] > 0:
    return out
  res = stats.ttest_1samp(d, 0.0, alternative=alternative)
  half = stats.t.ppf(0.5 + confidence / 2, n - 1) * out["sd"] / math.sqrt(n)
  out.update(t=float(res.statistic), p=float(res.pvalue),
             low=out["mean"] - half, high=out["mean"] + half)
  return out


def sign_test(d, *, alternative: str = "two-sided") -> dict:
  """Exact sign test: wins (d > 0) among the non-zero differences against
  Binomial(n, 1/2); ``p`` is NaN when every difference is 0."""
  _check_alternative(alternative)
  d = _diffs(d)
  wins, losses = int((d > 0).sum()), int((d < 0).sum())
  p = math.nan
  if wins + losses:
    p = float(stats.binomtest(wins, wins + losses, 0.5,
                              alternative=alternative).pvalue)
  return dict(n=len(d), wins=wins, losses=losses, ties=len(d) - wins - losses, p=p)


def mean_above(d, bound: float) -> dict:
  """One-sided t-test of H0 ``mean(d) <= bound`` against H1 ``mean(d) >
  bound``. Returns n, mean, sd (ddof 1), t, p and ``low``, the one-sided 95%
  lower bound of the mean (NaN where undefined: n < 2 or every value equal);
  H0 is rejected at level 0.05 when ``low > bound``, i.e. ``p < 0.05``."""
  d = _diffs(d)
  n = len(d)
  out = dict(n=n, bound=float(bound), mean=float(d.mean()) if n else math.nan,
             sd=float(d.std(ddof=1)) if n > 1 else math.nan,
             t=math.nan, p=math.nan, low=math.nan)
  if n < 2 or not out["sd"] > 0:
    return out
  res = stats.ttest_1samp(d, bound, alternative="greater")
  out.update(t=float(res.statistic), p=float(res.pvalue),
             low=out["mean"] - stats.t.ppf(0.95, n - 1) * out["sd"] / math.sqrt(n))
  return out


def noninferiority(d, margin: float) -> dict:
  """One-sided test that A is not worse than B by ``margin`` or more:
  H0 ``mean(d) <= -margin`` vs H1 ``mean(d) > -margin``, ``d = A - B``
  (higher is better); ``mean_above(d, -margin)`` with the margin. ``low`` is
  the one-sided 95% lower bound of the mean; non-inferiority at level 0.05
  is ``low > -margin``, i.e. ``p < 0.05``."""
  if not margin > 0:
    raise ValueError(f"margin={margin!r}: expected a positive difference")
  out = mean_above(d, -margin)
  del out["bound"], out["sd"]
  return dict(out, margin=float(margin))


def holm(pvalues: Mapping[str, float], alpha: float = 0.05) -> dict[str, dict]:
  """Holm's step-down procedure over the family ``pvalues`` (name -> p).

  Sort the m p-values ascending; the k-th smallest (k = 1..m) is adjusted to
  ``max_{j <= k} min(1, (m - j + 1) p_(j))`` and rejected when the adjusted
  value is <= ``alpha`` (equivalently: reject while ``p_(k) <= alpha / (m -
  k + 1)``, stop at the first that is not). NaN p-values stay NaN, are never
  rejected, and do not count in m."""
  names = [k for k, p in pvalues.items() if p == p]
  m = len(names)
  order = sorted(names, key=lambda k: pvalues[k])
  out, running = {}, 0.0
  for k, name in enumerate(order):
    running = max(running, min(1.0, (m - k) * float(pvalues[name])))
    out[name] = dict(p=float(pvalues[name]), p_holm=running,
                     reject=running <= alpha)
  for name, p in pvalues.items():
    if name not in out:
      out[name] = dict(p=math.nan, p_holm=math.nan, reject=False)
  return {name: out[name] for name in pvalues}


def t_test_power(delta: float, n: int, sd: float, *, alpha: float = 0.05,
                 two_sided: bool = True) -> float:
  """Power of the paired t-test (n pairs, differences ~ N(delta, sd^2)) at
  level ``alpha``, from the non-central t distribution."""
  df, nc = n - 1, delta * math.sqrt(n) / sd
  if two_sided:
    crit = stats.t.ppf(1 - alpha / 2, df)
    # the far tail underflows to NaN in scipy's nct for large |nc|: it is 0
    upper, lower = stats.nct.sf(crit, df, nc), stats.nct.cdf(-crit, df, nc)
    return float(np.nan_to_num(upper, nan=float(nc > 0))
                 + np.nan_to_num(lower, nan=float(nc < 0)))
  return float(stats.nct.sf(stats.t.ppf(1 - alpha, df), df, nc))


def min_detectable_difference(n: int, sd: float, *, alpha: float = 0.05,
                              power: float = 0.8, two_sided: bool = True,
                              method: str = "nct") -> float:
  """The smallest true mean difference the paired t-test over ``n`` seeds
  detects with probability ``power`` at level ``alpha``, for paired
  differences of standard deviation ``sd``.

  ``method``: ``"nct"`` solves ``t_test_power(mdd) = power`` exactly (the
  non-central t); ``"t"`` is the textbook approximation ``(t_{1-a/2,n-1} +
  t_{power,n-1}) sd / sqrt(n)``; ``"normal"`` is ``(z_{1-a/2} + z_power) sd /
  sqrt(n)``, too small for few seeds. With a Holm family of m tests, pass
  ``alpha / m`` for the MDD of its first (strictest) step."""
  if n < 2 or not sd > 0 or not 0 < alpha < 1 or not 0 < power < 1:
    raise ValueError(f"n={n}, sd={sd}, alpha={alpha}, power={power}: expected "
                     "n >= 2, sd > 0 and alpha, power in (0, 1)")
  a = alpha / 2 if two_sided else alpha
  if method == "normal":
    return float((stats.norm.ppf(1 - a) + stats.norm.ppf(power)) * sd / math.sqrt(n))
  approx = float((stats.t.ppf(1 - a, n - 1) + stats.t.ppf(power, n - 1))
                 * sd / math.sqrt(n))
  if method == "t":
    return approx
  if method != "nct":
    raise ValueError(f"method={method!r}: expected 'nct', 't' or 'normal'")
  return float(optimize.brentq(
      lambda x: t_test_power(x, n, sd, alpha=alpha, two_sided=two_sided) - power,
      1e-9 * sd, 2 * approx, xtol=1e-10 * sd))


def seeds_for(mdd: float, sd: float, **kw) -> int:
  """The fewest seeds whose ``min_detectable_difference`` is <= ``mdd``."""
  n = 2
  while min_detectable_difference(n, sd, **kw) > mdd:
    n += 1
    if n > 100_000:
      raise ValueError(f"mdd={mdd}, sd={sd}: no seed count up to 100000")
  return n


def sampling_noise_share(accuracies: Sequence[float], samples: int) -> dict:
  """How much of the seed-to-seed variance of per-run accuracies is the
  binomial noise of evaluating each run on ``samples`` graded responses:
  ``mean(p (1 - p)) / samples`` over the observed variance (ddof 1). Responses
  to one problem are correlated, so with several samples per problem this is
  a lower bound on the noise (an upper one needs ``samples`` = problems)."""
  acc = np.asarray([a for a in accuracies if a == a], float)
  if len(acc) < 2:
    return dict(n=len(acc), noise_var=math.nan, total_var=math.nan, share=math.nan)
  noise = float(np.mean(acc * (1 - acc)) / samples)
  total = float(acc.var(ddof=1))
  return dict(n=len(acc), noise_var=noise, total_var=total,
              share=noise / total if total > 0 else math.nan)


def compare(a: Mapping[int, float], b: Mapping[int, float], *,
            alternative: str = "two-sided", margin: float | None = None) -> dict:
  """A - B over the seeds both have (seed -> outcome): the paired t-test,
  the sign test and, with ``margin``, the non-inferiority test."""
  seeds = sorted(set(a) & set(b))
  d = np.array([a[s] - b[s] for s in seeds], float)
  out = dict(seeds=seeds, t=paired_t(d, alternative=alternative),
             sign=sign_test(d, alternative=alternative))
  if margin is not None:
    out["noninferiority"] = noninferiority(d, margin)
  return out
