"""Group-relative advantages."""

import numpy as np
import pytest

from ba_jax.loss.advantages import group_advantages


def test_group_std_is_unbiased_and_per_group():
  rewards = np.array([1, 0, 0, 1, 1, 1, 0, 0.5], np.float32)
  got = np.asarray(group_advantages(rewards, 4, std="group", eps=0.0))
  for g in range(2):
    r = rewards[4 * g:4 * g + 4]
    want = (r - r.mean()) / r.std(ddof=1)
    np.testing.assert_allclose(got[4 * g:4 * g + 4], want, rtol=1e-6)


def test_batch_std_and_none():
  rewards = np.array([1, 0, 0, 0, 1, 1, 0, 1], np.float32)
  batch = np.asarray(group_advantages(rewards, 4, std="batch", eps=0.0))
  none = np.asarray(group_advantages(rewards, 4, std="none"))
  centred = rewards.reshape(2, 4) - rewards.reshape(2, 4).mean(1, keepdims=True)
  np.testing.assert_allclose(none, centred.ravel(), rtol=1e-6)
  np.testing.assert_allclose(batch, centred.ravel() / rewards.std(ddof=1),
                             rtol=1e-6)


@pytest.mark.parametrize("std", ["group", "batch", "none"])
def test_constant_group_gets_exactly_zero(std):
  rewards = np.array([0.1, 0.1, 0.1, 1.0, 0.0, 1.0, 3.0, 3.0, 3.0], np.float32)
  adv = np.asarray(group_advantages(rewards, 3, std=std, eps=0.0))
  assert np.all(np.isfinite(adv))
  assert np.all(adv[:3] == 0) and np.all(adv[6:] == 0)
  assert np.all(adv[3:6] != 0)
  # Every group constant, no eps: still zeros, never NaN.
  assert np.all(np.asarray(group_advantages(np.ones(6), 3, std=std,
                                            eps=0.0)) == 0)


def test_group_of_one_and_bad_input():
  assert np.all(np.asarray(group_advantages(np.arange(4.0), 1)) == 0)
  with pytest.raises(ValueError, match="'group', 'batch', 'none'"):
    group_advantages(np.ones(4), 2, std="global")
  with pytest.raises(ValueError, match="group_size.*N=5"):
    group_advantages(np.ones(5), 2)
