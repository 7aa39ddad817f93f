"""One mini-batch equals k micro-batches, in every aggregation mode."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ba_jax.loss import losses
from ba_jax.update import microbatch
from ba_jax.loss.aggregation import MODES

N, T, D, G = 8, 6, 5, 4


def _setup(seed=0):
  rng = np.random.default_rng(seed)
  params = {"w": jnp.asarray(rng.normal(size=D) * 0.3, jnp.float32),
            "b": jnp.asarray(rng.normal(size=D) * 0.1, jnp.float32)}
  lengths = np.array([1, 6, 3, 0, 5, 2, 6, 4])
  batch = {
      "features": jnp.asarray(rng.normal(size=(N, T, D)), jnp.float32),
      "mask": jnp.asarray(np.arange(T)[None] < lengths[:, None], jnp.float32),
      "advantages": jnp.asarray([1.0, -0.5, -0.5, 0.0, 1.0, 1.0, -1.0, -1.0]),
      "old_logp": jnp.asarray(rng.normal(size=(N, T)) * 0.05 - 1.0, jnp.float32),
      "ref_logp": jnp.asarray(rng.normal(size=(N, T)) * 0.05 - 1.0, jnp.float32),
  }
  return params, batch


def _loss_fn(mode):
  def loss_fn(params, mb):
    hidden = jnp.tanh(mb["features"] + params["b"]) @ params["w"]
    logp = -jax.nn.softplus(-hidden) - 1.0
    entropy = jax.nn.softplus(hidden)
    return losses.policy_loss(
        logp, mb["old_logp"], mb["advantages"], mb["mask"], group_size=G,
        aggregation=mode, eps_low=0.2, eps_high=0.28, ref_logp=mb["ref_logp"],
        kl_coef=0.05, entropy=entropy, entropy_coef=0.01,
        max_response_len=T, weights=mb["weights"],
        reg_weights=mb["reg_weights"])
  return loss_fn


@pytest.mark.parametrize("mode", MODES)
def test_loss_and_grad_independent_of_micro_batch_count(mode):
  params, batch = _setup()
  batch.update(microbatch.mini_batch_weights(
      batch["mask"], batch["advantages"], aggregation=mode, group_size=G,
      max_response_len=T))
  results = {}
  for k in (1, 2, 4):
    fn = jax.jit(lambda p, b, k=k: microbatch.accumulate_gradients(
        _loss_fn(mode), p, b, num_micro_batches=k))
    results[k] = fn(params, batch)
  loss1, grads1, metrics1 = results[1]
  assert np.isfinite(float(loss1)) and float(loss1) != 0.0
  for k in (2, 4):
    loss_k, grads_k, metrics_k = results[k]
    np.testing.assert_allclose(float(loss_k), float(loss1), rtol=1e-5,
                               atol=1e-7)
    for name in grads1:
      np.testing.assert_allclose(grads_k[name], grads1[name], rtol=1e-5,
                                 atol=1e-7)
    for name in ("w_pos", "w_neg", "num_tokens", "ratio_min", "ratio_max",
                 "clip_frac_high", "approx_kl", "entropy"):
      np.testing.assert_allclose(metrics_k[name], metrics1[name], rtol=1e-5,
                                 atol=1e-7)


def test_normalising_per_micro_batch_would_change_the_loss():
  """The bug the design avoids: weights recomputed inside each micro-batch."""
  params, batch = _setup()
  whole = microbatch.mini_batch_weights(
      batch["mask"], batch["advantages"], aggregation="token", group_size=G)
  halves = [microbatch.mini_batch_weights(
      batch["mask"][s], batch["advantages"][s], aggregation="token",
      group_size=G) for s in (slice(0, 4), slice(4, 8))]
  per_part = {k: jnp.concatenate([h[k] for h in halves]) for k in whole}
  exact = _loss_fn("token")(params, {**batch, **whole})[0]
  naive = sum(_loss_fn("token")(
      params, {**jax.tree.map(lambda x, s=s: x[s], batch),
               **{k: v[s] for k, v in per_part.items()}})[0]
              for s in (slice(0, 4), slice(4, 8)))
  assert abs(float(exact) - float(naive)) > 1e-3


def test_bad_micro_batch_count():
  _, batch = _setup()
  with pytest.raises(ValueError, match="divisor of the mini-batch size 8; got 3"):
    microbatch.split_micro_batches(batch, 3)
