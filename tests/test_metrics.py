"""The logged rollout statistics use the aggregation module's diagnostics."""
import math

import numpy as np
import pytest

from ba_jax.loss import aggregation as agg
from ba_jax.run import metrics


def _mask(lengths, width=8):
  return (np.arange(width)[None] < np.asarray(lengths)[:, None]).astype(np.int32)


def test_rollout_stats_are_the_aggregation_diagnostics():
  lengths = [4, 8, 6, 2, 5, 5, 5, 5]
  adv = np.array([1, -1, -1, 0, 2, 2, -1, -1], np.float32)
  stats = metrics.rollout_stats(
      rewards_N=adv, correct_N=adv > 0, advantages_N=adv,
      mask_NxT=_mask(lengths), truncated_N=np.zeros(8, bool), group_size=4)
  d = agg.diagnostics(agg.token_weights(_mask(lengths), adv, mode="token",
                                        group_size=4),
                      _mask(lengths), adv, group_size=4)
  mean_pos, mean_neg = np.mean([4, 5, 5]), np.mean([8, 6, 5, 5])
  assert stats["length_gap_pos_neg"] == pytest.approx(mean_pos - mean_neg)
  assert stats["length_gap_rel"] == pytest.approx(float(d["length_gap_rel"]))
  assert stats["length_cv_in_group"] == pytest.approx(float(d["length_cv"]))
  assert stats["pos_frac"] == pytest.approx(3 / 7)
  assert stats["length_mean"] == np.mean(lengths)


def test_no_signed_pair_gives_nan_not_zero():
  adv = np.ones(4, np.float32)
  stats = metrics.rollout_stats(adv, adv > 0, adv, _mask([3, 4, 5, 6]),
                                np.zeros(4, bool), group_size=4)
  assert math.isnan(stats["length_gap_pos_neg"])
  assert math.isnan(stats["length_gap_rel"])
  assert stats["pos_frac"] == 1.0
  assert metrics.weight_shares({"w_pos": 0.5, "w_neg": 0.5}) == {
      "w_pos_share": 0.5}
  assert math.isnan(metrics.weight_shares({"w_pos": 0.0, "w_neg": 0.0})[
      "w_pos_share"])
