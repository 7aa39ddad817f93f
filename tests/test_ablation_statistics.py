"""The ablation's statistics (ba_jax.ablation.stats) against R's and
scipy's values and against independent computations."""
import math

import numpy as np
import pytest
from scipy import stats

from ba_jax.ablation import stats as st

# Student's (1908) sleep data, R's ``sleep``: extra hours of sleep under two
# drugs, the same ten patients. R's ``t.test(extra ~ group, paired = TRUE)``
# reports t = -4.0621, df = 9, p-value = 0.002833, 95% CI [-2.4599, -0.7001]
# for group 1 - group 2.
DRUG1 = [0.7, -1.6, -0.2, -1.2, -0.1, 3.4, 3.7, 0.8, 0.0, 2.0]
DRUG2 = [1.9, 0.8, 1.1, 0.1, -0.1, 4.4, 5.5, 1.6, 4.6, 3.4]


def test_paired_t_on_students_sleep_data():
  d = np.subtract(DRUG2, DRUG1)
  out = st.paired_t(d)
  assert out["n"] == 10 and out["mean"] == pytest.approx(1.58)
  assert out["t"] == pytest.approx(4.0621, abs=5e-5)
  assert out["p"] == pytest.approx(0.002833, abs=5e-7)
  assert (out["low"], out["high"]) == pytest.approx((0.7001, 2.4599), abs=5e-5)
  # the same as scipy's two-sample paired test, and one-sided halves it
  assert out["p"] == pytest.approx(stats.ttest_rel(DRUG2, DRUG1).pvalue, rel=1e-12)
  assert st.paired_t(d, alternative="greater")["p"] == pytest.approx(out["p"] / 2)


def test_sign_test_is_the_binomial_tail():
  d = np.subtract(DRUG2, DRUG1)  # nine positive, one tie
  out = st.sign_test(d)
  assert (out["wins"], out["losses"], out["ties"]) == (9, 0, 1)
  assert out["p"] == pytest.approx(2 * 0.5 ** 9)
  # 7 wins of 9: two-sided p = 2 * P(X >= 7) = 2 * (36 + 9 + 1) / 512
  d = [1, 2, 3, 4, 5, 6, 7, -1, -2]
  assert st.sign_test(d)["p"] == pytest.approx(2 * 46 / 512)
  assert st.sign_test(d, alternative="greater")["p"] == pytest.approx(46 / 512)
  assert math.isnan(st.sign_test([0.0, 0.0])["p"])


# R's p.adjust(c(0.01, 0.04, 0.03, 0.005), "holm") gives 0.03 0.06 0.06 0.02
# and p.adjust(c(0.0002, 0.012, 0.0135, 0.04, 0.2, 0.7), "holm") gives
# 0.0012 0.0600 0.0600 0.1200 0.4000 0.7000. R was not run here: these are
# the values of p.adjust's own code for "holm",
# pmin(1, cummax((n - seq_len(n) + 1) * p[o]))[ro], written as literals; the
# test also recomputes them by that formula (holm_by_formula).
R_HOLM = (([0.01, 0.04, 0.03, 0.005], [0.03, 0.06, 0.06, 0.02]),
          ([0.0002, 0.012, 0.0135, 0.04, 0.2, 0.7],
           [0.0012, 0.06, 0.06, 0.12, 0.4, 0.7]))


def holm_by_formula(ps):
  """The documented formula: the k-th smallest (k = 1..m) becomes
  max_{j <= k} min(1, (m - j + 1) p_(j)), in the input's order."""
  m, order = len(ps), np.argsort(ps, kind="stable")
  out, running = np.empty(m), 0.0
  for k, i in enumerate(order):
    running = max(running, min(1.0, (m - k) * ps[i]))
    out[i] = running
  return out


def test_holm_matches_r_p_adjust_and_the_documented_formula():
  for ps, r_values in R_HOLM:
    out = st.holm(dict(enumerate(ps)))
    got = [out[i]["p_holm"] for i in range(len(ps))]
    assert got == pytest.approx(r_values, abs=1e-12)
    assert got == pytest.approx(list(holm_by_formula(ps)), abs=1e-15)


def test_holm_matches_the_textbook_and_the_step_down_rule():
  family = {"a": 0.01, "b": 0.04, "c": 0.03, "d": 0.005}
  out = st.holm(family)
  assert [out[k]["p_holm"] for k in "abcd"] == pytest.approx([0.03, 0.06, 0.06, 0.02])
  rng = np.random.default_rng(0)
  for _ in range(200):
    m = int(rng.integers(1, 7))
    ps = dict(zip("abcdefg", rng.uniform(0, 0.1, m)))
    # the step-down rule, written out: reject while p_(k) <= alpha/(m-k+1)
    rejected = set()
    for k, name in enumerate(sorted(ps, key=ps.get)):
      if ps[name] > 0.05 / (m - k):
        break
      rejected.add(name)
    got = st.holm(ps)
    assert {k for k, v in got.items() if v["reject"]} == rejected
    assert all(v["p_holm"] >= v["p"] for v in got.values())
  partial = st.holm({"x": 0.01, "y": float("nan")})
  assert partial["x"]["p_holm"] == 0.01 and not partial["y"]["reject"]


def test_noninferiority_is_a_shifted_one_sided_t_test():
  rng = np.random.default_rng(1)
  d = rng.normal(-0.01, 0.05, 20)
  margin = 0.03
  out = st.noninferiority(d, margin)
  se = d.std(ddof=1) / math.sqrt(len(d))
  t = (d.mean() + margin) / se
  assert out["t"] == pytest.approx(t)
  assert out["p"] == pytest.approx(stats.t.sf(t, len(d) - 1))
  assert (out["low"] > -margin) == (out["p"] < 0.05)
  # a clearly worse A is not non-inferior
  assert st.noninferiority(d - 0.1, margin)["p"] > 0.5
  with pytest.raises(ValueError, match="margin"):
    st.noninferiority(d, 0.0)


def test_mean_above_is_a_one_sided_t_test_against_the_bound():
  rng = np.random.default_rng(3)
  d = rng.normal(0.75, 0.04, 15)
  bound = math.log(2)
  out = st.mean_above(d, bound)
  se = d.std(ddof=1) / math.sqrt(len(d))
  t = (d.mean() - bound) / se
  assert out["t"] == pytest.approx(t)
  assert out["p"] == pytest.approx(stats.t.sf(t, len(d) - 1))
  assert out["low"] == pytest.approx(d.mean() - stats.t.ppf(0.95, 14) * se)
  assert out["sd"] == pytest.approx(d.std(ddof=1)) and out["n"] == 15
  assert (out["low"] > bound) == (out["p"] < 0.05)
  # below the bound: not rejected; one value or no spread: undefined
  assert st.mean_above(d - 0.1, bound)["p"] > 0.5
  assert math.isnan(st.mean_above(d[:1], bound)["low"])
  assert math.isnan(st.mean_above(np.full(5, 0.8), bound)["p"])


def test_min_detectable_difference_has_the_stated_power():
  n, sd = 20, 0.08
  mdd = st.min_detectable_difference(n, sd)
  # independently: simulate paired differences at that mean and count how
  # often the two-sided t-test at 0.05 rejects
  rng = np.random.default_rng(2)
  d = rng.normal(mdd, sd, (40_000, n))
  t = d.mean(1) / (d.std(1, ddof=1) / math.sqrt(n))
  power = np.mean(np.abs(t) > stats.t.ppf(0.975, n - 1))
  assert power == pytest.approx(0.8, abs=0.01)
  z = (stats.norm.ppf(0.975) + stats.norm.ppf(0.8)) * sd / math.sqrt(n)
  assert st.min_detectable_difference(n, sd, method="normal") == pytest.approx(z)
  assert z < mdd < 1.05 * st.min_detectable_difference(n, sd, method="t")
  # a Holm family's first step (alpha/3) needs a larger difference
  assert st.min_detectable_difference(n, sd, alpha=0.05 / 3) > mdd
  assert st.seeds_for(mdd, sd) == n


def test_power_is_scipys_noncentral_t_tail():
  n, sd, delta = 12, 0.05, 0.04
  df, nc = n - 1, delta * math.sqrt(n) / sd
  crit = stats.t.ppf(0.975, df)
  want = stats.nct.sf(crit, df, nc) + stats.nct.cdf(-crit, df, nc)
  assert st.t_test_power(delta, n, sd) == pytest.approx(want, rel=1e-12)
  one = stats.nct.sf(stats.t.ppf(0.95, df), df, nc)
  assert st.t_test_power(delta, n, sd, two_sided=False) == pytest.approx(one, rel=1e-12)
  # the detectable difference is where that power reaches 0.8
  mdd = st.min_detectable_difference(n, sd, two_sided=False)
  assert st.t_test_power(mdd, n, sd, two_sided=False) == pytest.approx(0.8, abs=1e-8)


def test_paired_t_and_mean_above_are_scipys_tests():
  rng = np.random.default_rng(5)
  a, b = rng.normal(0.4, 0.05, 9), rng.normal(0.38, 0.05, 9)
  assert st.paired_t(a - b)["p"] == pytest.approx(stats.ttest_rel(a, b).pvalue, rel=1e-12)
  res = stats.ttest_1samp(a - b, -0.02, alternative="greater")
  assert st.mean_above(a - b, -0.02)["p"] == pytest.approx(res.pvalue, rel=1e-12)
  ci = stats.ttest_rel(a, b).confidence_interval(0.95)
  out = st.paired_t(a - b)
  assert (out["low"], out["high"]) == pytest.approx((ci.low, ci.high), rel=1e-12)


def test_sampling_noise_share_is_one_when_runs_differ_only_by_evaluation():
  rng = np.random.default_rng(3)
  acc = rng.binomial(256, 0.4, 4000) / 256
  out = st.sampling_noise_share(acc, 256)
  assert out["share"] == pytest.approx(1.0, abs=0.06)
  spread = rng.normal(0.4, 0.1, 4000).clip(0, 1)  # true seed-to-seed spread
  acc = rng.binomial(256, spread) / 256
  assert st.sampling_noise_share(acc, 256)["share"] < 0.15


def test_compare_pairs_by_seed():
  a = {0: 0.5, 1: 0.6, 2: 0.7, 3: 0.9}
  b = {1: 0.5, 2: 0.5, 3: 0.6, 4: 0.1}
  out = st.compare(a, b, margin=0.05)
  assert out["seeds"] == [1, 2, 3]
  assert out["t"]["mean"] == pytest.approx(np.mean([0.1, 0.2, 0.3]))
  assert out["sign"]["wins"] == 3 and "noninferiority" in out
