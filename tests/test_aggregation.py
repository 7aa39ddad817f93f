"""Aggregation weights against loop references and the identities of docs/aggregation.md."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from ba_jax.loss import aggregation as agg

MODES = agg.MODES


def reference_loss(values, mask, adv, *, mode, group_size, max_len=None,
                   ba_denominator="group", ba_scope="group"):
  """docs/aggregation.md's rules written as loops over sequences and tokens."""
  values, mask, adv = map(np.asarray, (values, mask, adv))
  n_seq, t_len = mask.shape
  lengths = [sum(mask[n, t] for t in range(t_len)) for n in range(n_seq)]
  seq_sum = [sum(values[n, t] * mask[n, t] for t in range(t_len))
             for n in range(n_seq)]
  if mode == "token":
    total = sum(lengths)
    return sum(seq_sum) / total if total else 0.0
  if mode == "sequence":
    return sum(s / l for s, l in zip(seq_sum, lengths) if l) / n_seq
  if mode == "dr_grpo":
    return sum(seq_sum) / (n_seq * max_len)
  # balanced: per group (|P|/D) tokenmean(P) + (|N|/D) tokenmean(N), then the
  # mean over groups.
  if ba_scope == "group":
    groups = [range(g, g + group_size) for g in range(0, n_seq, group_size)]
  else:
    groups = [range(n_seq)]
  total = 0.0
  for members in groups:
    pos = [n for n in members if adv[n] > 0]
    neg = [n for n in members if adv[n] < 0]
    denom = len(members) if ba_denominator == "group" else len(pos) + len(neg)
    for subset in (pos, neg):
      tokens = sum(lengths[n] for n in subset)
      if tokens:
        token_mean = sum(seq_sum[n] for n in subset) / tokens
        total += len(subset) / denom * token_mean
  return total / len(groups)


@st.composite
def batches(draw):
  group_size = draw(st.integers(1, 16))
  num_groups = draw(st.integers(1, 3))
  t_len = draw(st.integers(1, 10))
  n_seq = group_size * num_groups
  lengths = draw(st.lists(st.integers(0, t_len), min_size=n_seq,
                          max_size=n_seq))
  kinds = draw(st.lists(st.sampled_from(["mixed", "pos", "neg", "zero"]),
                        min_size=num_groups, max_size=num_groups))
  adv = []
  for kind in kinds:
    choices = {"mixed": [-1.5, -0.5, 0.0, 0.5, 2.0], "pos": [0.3, 1.0],
               "neg": [-1.0, -0.2], "zero": [0.0]}[kind]
    adv += draw(st.lists(st.sampled_from(choices), min_size=group_size,
                         max_size=group_size))
  seed = draw(st.integers(0, 2**31 - 1))
  rng = np.random.default_rng(seed)
  mask = (np.arange(t_len)[None, :] < np.array(lengths)[:, None])
  # Holes inside a response are legal too (e.g. masked tool output).
  mask = mask & (rng.random((n_seq, t_len)) > 0.1)
  values = rng.normal(size=(n_seq, t_len)).astype(np.float32)
  return (values, mask.astype(np.float32), np.array(adv, np.float32),
          group_size, t_len)


@pytest.mark.slow
@pytest.mark.parametrize("mode,options", [
    ("token", {}), ("sequence", {}), ("dr_grpo", {}),
    ("balanced", {}), ("balanced", {"ba_denominator": "signed"}),
    ("balanced", {"ba_scope": "batch"}),
    ("balanced", {"ba_scope": "batch", "ba_denominator": "signed"}),
])
@settings(max_examples=40, deadline=None)
@given(batch=batches())
def test_every_mode_matches_loop_reference(mode, options, batch):
  values, mask, adv, group_size, t_len = batch
  extra = {"max_response_len": t_len} if mode == "dr_grpo" else {}
  got = agg.aggregate(values, mask, adv, mode=mode, group_size=group_size,
                      **extra, **options)
  want = reference_loss(values, mask, adv, mode=mode, group_size=group_size,
                        max_len=t_len, **options)
  np.testing.assert_allclose(float(got), want, rtol=1e-5, atol=1e-6)
  weights = np.asarray(agg.token_weights(
      mask, adv, mode=mode, group_size=group_size, **extra, **options))
  assert np.all(np.isfinite(weights)) and np.all(weights >= 0)
  assert np.all(weights[mask == 0] == 0)


def _random_values(shape, seed=0):
  return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


def _prefix_mask(lengths, t_len):
  return (np.arange(t_len)[None] < np.array(lengths)[:, None]).astype(np.float32)


def test_balanced_equals_group_token_mean_when_subset_mean_lengths_match():
  # Group 0: P lengths {2, 6} (mean 4), N lengths {4, 4, 3, 5} (mean 4).
  # Group 1: P lengths {7, 7, 7}, N lengths {5, 9, 7} (both mean 7).
  # No zero advantages.
  lengths = [2, 6, 4, 4, 3, 5, 7, 5, 9, 7, 7, 7]
  adv = np.array([1, 1, -1, -1, -1, -1, 2, -1, -1, -1, 2, 2], np.float32)
  values = _random_values((12, 10))
  mask = _prefix_mask(lengths, 10)
  got = agg.aggregate(values, mask, adv, mode="balanced", group_size=6)
  group_token_means = [
      (values[g] * mask[g]).sum() / mask[g].sum()
      for g in (slice(0, 6), slice(6, 12))]
  np.testing.assert_allclose(float(got), np.mean(group_token_means), rtol=1e-6)


def test_balanced_equals_sequence_when_length_constant_inside_each_subset():
  # Positive responses of a group share one length, negatives another.
  lengths = [3, 3, 8, 8, 8, 5, 2, 5, 2, 2]
  adv = np.array([1, 1, -1, -1, -1, 0.5, -2, 0.5, -2, -2], np.float32)
  values = _random_values((10, 8), seed=1)
  mask = _prefix_mask(lengths, 8)
  ba = agg.aggregate(values, mask, adv, mode="balanced", group_size=5)
  seq = agg.aggregate(values, mask, adv, mode="sequence", group_size=5)
  np.testing.assert_allclose(float(ba), float(seq), rtol=1e-6)


def test_all_modes_agree_when_all_lengths_equal():
  length, max_len = 6, 10
  adv = np.array([1, -1, 0.5, -0.5, 2, -1, -1, 1], np.float32)
  values = _random_values((8, max_len), seed=2)
  mask = _prefix_mask([length] * 8, max_len)
  losses = {m: float(agg.aggregate(values, mask, adv, mode=m, group_size=4,
                                   max_response_len=max_len)) for m in MODES}
  np.testing.assert_allclose(losses["sequence"], losses["token"], rtol=1e-6)
  np.testing.assert_allclose(losses["balanced"], losses["token"], rtol=1e-6)
  # dr_grpo divides by the constant max_len instead of the common length.
  np.testing.assert_allclose(losses["dr_grpo"] * max_len / length,
                             losses["token"], rtol=1e-6)


def test_ba_denominators_differ_only_with_zero_advantages_in_mixed_groups():
  values = _random_values((8, 6), seed=3)
  mask = _prefix_mask([2, 5, 6, 1, 3, 3, 4, 6], 6)
  no_zero = np.array([1, -1, -1, 2, 1, -1, -1, -1], np.float32)
  with_zero = np.array([1, -1, 0, 0, 1, -1, -1, -1], np.float32)
  def loss(adv, denominator):
    return float(agg.aggregate(values, mask, adv, mode="balanced", group_size=4,
                               ba_denominator=denominator))
  assert loss(no_zero, "group") == pytest.approx(loss(no_zero, "signed"),
                                                 rel=1e-6)
  # Group 0 has 2 of 4 with A != 0: signed weights are |S|/2, group |S|/4.
  assert loss(with_zero, "group") != pytest.approx(loss(with_zero, "signed"),
                                                   rel=1e-3)


def test_sign_length_coupling_under_token_but_not_balanced():
  adv = np.array([1, 1, -1, -1], np.float32)
  shares = {}
  for neg_len in (10, 30):
    mask = _prefix_mask([10, 10, neg_len, neg_len], 30)
    for mode in ("token", "balanced", "sequence"):
      w = agg.token_weights(mask, adv, mode=mode, group_size=4)
      d = agg.diagnostics(w, mask, adv, group_size=4)
      shares[mode, neg_len] = float(d["pos_share"])
      assert float(d["pos_frac"]) == pytest.approx(0.5)
  # Token aggregation: the positive share falls from 20/40 to 20/80 when the
  # negative responses get three times longer.
  assert shares["token", 10] == pytest.approx(0.5, abs=1e-6)
  assert shares["token", 30] == pytest.approx(0.25, abs=1e-6)
  # Balanced: the positive share stays at the fraction of positive sequences.
  assert shares["balanced", 10] == pytest.approx(0.5, abs=1e-6)
  assert shares["balanced", 30] == pytest.approx(0.5, abs=1e-6)


def test_diagnostics_lengths_and_gap():
  adv = np.array([1, -1, -1, 0, 2, 2, -1, -1], np.float32)
  lengths = [4, 8, 6, 2, 5, 5, 5, 5]
  mask = _prefix_mask(lengths, 8)
  w = agg.token_weights(mask, adv, mode="balanced", group_size=4)
  d = {k: float(v) for k, v in agg.diagnostics(w, mask, adv,
                                               group_size=4).items()}
  mean_pos = np.mean([4, 5, 5])
  mean_neg = np.mean([8, 6, 5, 5])
  assert d["length_gap"] == pytest.approx(mean_pos - mean_neg)
  assert d["length_gap_rel"] == pytest.approx(
      (mean_pos - mean_neg) / (0.5 * (mean_pos + mean_neg)))
  group0 = np.array([4, 8, 6, 2], float)
  # Group 1 has zero length variation, so the mean over groups halves group 0.
  assert d["length_cv"] == pytest.approx(group0.std() / group0.mean() / 2)
  assert d["pos_frac"] == pytest.approx(3 / 7)
  assert d["pos_share"] == pytest.approx(3 / 7, rel=1e-6)
  assert d["w_pos"] + d["w_neg"] == pytest.approx(7 / 8, rel=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_weights_never_nan_and_diagnostics_nan_exactly_where_undefined(mode):
  """Weights stay finite for empty subsets, masked batches and zero
  advantages; a diagnostic is NaN exactly when it has nothing to measure."""
  signed = {"pos_frac", "length_gap", "length_gap_rel", "mean_len_pos",
            "mean_len_neg", "length_gap_in_group", "length_gap_in_group_rel",
            "length_cv_in_subset"}
  no_gap = {"length_gap", "length_gap_rel", "mean_len_neg",
            "length_gap_in_group", "length_gap_in_group_rel"}
  cases = {  # mask, advantages, the diagnostics that are undefined
      "all masked": (np.zeros((8, 5)), np.array([1, -1] * 4, np.float32),
                     {"length_cv", "pos_share", "length_gap_rel",
                      "length_gap_in_group_rel", "length_cv_in_subset",
                      "weight_length_corr"}),
      "all zero adv": (np.ones((8, 5)), np.zeros(8, np.float32),
                       signed | {"pos_share", "weight_length_corr"}),
      # Equal lengths: no correlation with length to measure.
      "all positive": (np.ones((8, 5)), np.ones(8, np.float32),
                       no_gap | {"weight_length_corr"}),
      "masked positives": (_prefix_mask([0, 0, 3, 3] * 2, 5),
                           np.array([1, 1, -1, -1] * 2, np.float32),
                           {"weight_length_corr"}),
  }
  for name, (mask, adv, undefined) in cases.items():
    w = agg.token_weights(mask, adv, mode=mode, group_size=4,
                          max_response_len=5)
    assert np.all(np.isfinite(np.asarray(w))), (mode, name)
    d = agg.diagnostics(w, mask, adv, group_size=4)
    nan = {k for k, v in d.items() if np.isnan(float(v))}
    assert nan == undefined, (mode, name)


def test_host_and_device_diagnostics_agree():
  rng = np.random.default_rng(0)
  lengths = rng.integers(0, 9, 16).astype(np.float64)
  adv = rng.normal(size=16).round()
  host = agg.length_diagnostics(lengths, adv, group_size=4, xp=np)
  device = agg.length_diagnostics(jnp.asarray(lengths, jnp.float32),
                                  jnp.asarray(adv), group_size=4)
  for key, value in host.items():
    assert float(device[key]) == pytest.approx(float(value), rel=1e-6), key


def test_unknown_options_raise_listing_valid_ones():
  mask, adv = np.ones((4, 3)), np.ones(4)
  with pytest.raises(ValueError, match="token.*sequence.*dr_grpo.*balanced"):
    agg.token_weights(mask, adv, mode="tokens", group_size=2)
  with pytest.raises(ValueError, match="'group', 'signed'"):
    agg.token_weights(mask, adv, mode="balanced", group_size=2,
                      ba_denominator="pos")
  with pytest.raises(ValueError, match="'group', 'batch'"):
    agg.token_weights(mask, adv, mode="balanced", group_size=2,
                      ba_scope="prompt")
  with pytest.raises(ValueError, match="max_response_len"):
    agg.token_weights(mask, adv, mode="dr_grpo", group_size=2)
  with pytest.raises(ValueError, match="group_size.*N=4.*3"):
    agg.token_weights(mask, adv, mode="token", group_size=3)


def test_jit_with_static_mode_does_not_retrace():
  traces = []

  @functools.partial(jax.jit, static_argnames=("mode", "group_size"))
  def loss(values, mask, adv, mode, group_size):
    traces.append(mode)
    return agg.aggregate(values, mask, adv, mode=mode, group_size=group_size)

  rng = np.random.default_rng(0)
  for _ in range(3):
    loss(rng.normal(size=(8, 6)), (rng.random((8, 6)) > 0.3) * 1.0,
         rng.normal(size=8), mode="balanced", group_size=4)
  assert traces == ["balanced"]
  loss(rng.normal(size=(8, 6)), np.ones((8, 6)), rng.normal(size=8),
       mode="token", group_size=4)
  assert traces == ["balanced", "token"]
