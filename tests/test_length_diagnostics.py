"""The diagnostics that separate BA from sequence aggregation, against numpy
loops; and BA's handling of masked (overlong) responses."""
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from ba_jax.loss import aggregation as agg


def _mask(lengths, width):
  return (np.arange(width)[None] < np.asarray(lengths)[:, None]).astype(
      np.float32)


def reference(lengths, adv, group_size, weights=None):
  """The definitions of aggregation.length_diagnostics, written as loops."""
  lengths, adv = np.asarray(lengths, float), np.asarray(adv, float)
  gaps, rels, cvs = [], [], []
  for g in range(len(lengths) // group_size):
    rows = slice(g * group_size, (g + 1) * group_size)
    L, a = lengths[rows], adv[rows]
    pos, neg = L[a > 0], L[a < 0]
    if len(pos) and len(neg):
      gaps.append(pos.mean() - neg.mean())
      if pos.mean() + neg.mean() > 0:
        rels.append(gaps[-1] / (0.5 * (pos.mean() + neg.mean())))
    cvs += [s.std() / s.mean() for s in (pos, neg)
            if len(s) >= 2 and s.mean() > 0]
  mean = lambda x: float(np.mean(x)) if x else float("nan")
  out = {"length_gap_in_group": mean(gaps), "length_gap_in_group_rel": mean(rels),
         "length_cv_in_subset": mean(cvs)}
  if weights is not None:
    use = (adv != 0) & (lengths > 0)
    per_token = np.asarray(weights, float).sum(-1)[use] / lengths[use]
    if use.sum() < 2 or np.ptp(lengths[use]) == 0:
      out["weight_length_corr"] = float("nan")
    elif np.ptp(per_token) <= 1e-5 * per_token.mean():
      out["weight_length_corr"] = 0.0
    else:
      out["weight_length_corr"] = float(np.corrcoef(per_token, lengths[use])[0, 1])
  return out


def _close(got, want, tol):
  assert set(want) <= set(got)
  for key, value in want.items():
    if np.isnan(value):
      assert np.isnan(float(got[key])), key
    else:
      assert float(got[key]) == pytest.approx(value, rel=tol, abs=tol), key


def test_explicit_case():
  # group 0: positives 2, 4 (mean 3, cv 1/3); negatives 6, 10 (mean 8, cv 1/4)
  # group 1: all positive (no gap); subset 5, 5, 5, 5 (cv 0)
  lengths = [2, 4, 6, 10, 5, 5, 5, 5]
  adv = np.array([1, 1, -1, -1, 1, 1, 1, 1], np.float32)
  d = agg.length_diagnostics(np.asarray(lengths, float), adv, group_size=4,
                             xp=np)
  assert d["length_gap_in_group"] == pytest.approx(3 - 8)
  assert d["length_gap_in_group_rel"] == pytest.approx(-5 / 5.5)
  assert d["length_cv_in_subset"] == pytest.approx((1 / 3 + 1 / 4 + 0) / 3)
  mask = _mask(lengths, 10)
  seq = agg.token_weights(mask, adv, mode="sequence", group_size=4)
  tok = agg.token_weights(mask, adv, mode="token", group_size=4)
  # sequence: per-token weight 1/(N L), perfectly anti-monotone in length
  assert float(agg.weight_length_correlation(seq, mask, adv)) < -0.8
  assert float(agg.weight_length_correlation(tok, mask, adv)) == 0.0


@pytest.mark.slow
@settings(max_examples=40, deadline=None)
@given(st.integers(1, 3), st.sampled_from([2, 4]), st.data())
def test_diagnostics_match_the_numpy_reference(groups, group_size, data):
  n = groups * group_size
  lengths = np.array(data.draw(st.lists(st.integers(0, 9), min_size=n,
                                        max_size=n)))
  adv = np.array(data.draw(st.lists(st.sampled_from([-1.0, 0.0, 1.0]),
                                    min_size=n, max_size=n)), np.float32)
  mode = data.draw(st.sampled_from(agg.MODES))
  mask = _mask(lengths, 9)
  w = agg.token_weights(mask, adv, mode=mode, group_size=group_size,
                        max_response_len=9)
  want = reference(lengths, adv, group_size, np.asarray(w))
  host = agg.length_diagnostics(lengths.astype(float), adv,
                                group_size=group_size, xp=np)
  host["weight_length_corr"] = agg.weight_length_correlation(
      np.asarray(w, np.float64), mask.astype(np.float64), adv, xp=np)
  _close(host, want, 1e-9)
  _close(agg.diagnostics(w, mask, adv, group_size=group_size), want, 1e-4)


def test_pos_share_equals_pos_frac_only_with_the_group_denominator():
  mask = _mask([2, 3, 4, 5, 6, 7, 2, 3], 8)
  # group 0: one positive of three signed; group 1: two of two
  adv = np.array([1, -1, -1, 0, 1, 1, 0, 0], np.float32)
  shares = {}
  for denominator in agg.BA_DENOMINATORS:
    w = agg.token_weights(mask, adv, mode="balanced", group_size=4,
                          ba_denominator=denominator)
    d = agg.diagnostics(w, mask, adv, group_size=4)
    shares[denominator] = float(d["pos_share"])
    assert float(d["pos_frac"]) == pytest.approx(3 / 5)
  assert shares["group"] == pytest.approx(3 / 5)
  assert shares["signed"] == pytest.approx((1 / 3 + 1) / 2)


def test_ba_counts_a_masked_overlong_response_in_its_subset():
  """rl.overlong="mask" zeroes a truncated row's mask but keeps its
  advantage: its subset keeps the share |S|/G, spread over the subset's
  remaining tokens (see aggregation.token_weights)."""
  lengths = [3, 6, 4, 4]
  adv = np.array([1, 1, -1, -1], np.float32)
  masked = _mask(lengths, 8)
  masked[1] = 0  # the second positive response was truncated and masked
  w = np.asarray(agg.token_weights(masked, adv, mode="balanced", group_size=4))
  assert w[1].sum() == 0.0
  # W+ is still |P|/G = 2/4, all of it on the first response's 3 tokens.
  assert w[0].sum() == pytest.approx(0.5)
  assert w[0, :3] == pytest.approx([0.5 / 3] * 3)
  assert w[2:].sum() == pytest.approx(0.5)
  # Masking the whole positive subset leaves it no weight: W+ = 0.
  masked[0] = 0
  w = np.asarray(agg.token_weights(masked, adv, mode="balanced", group_size=4))
  assert w[:2].sum() == 0.0 and w[2:].sum() == pytest.approx(0.5)
