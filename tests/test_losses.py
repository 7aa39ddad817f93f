"""The clipped surrogate, regularisers and the balanced loss's gradient."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ba_jax.loss import losses


def test_surrogate_clip_higher_and_dual_clip():
  logp = jnp.log(jnp.array([[0.5, 1.0, 1.5, 4.0]] * 2))
  old = jnp.zeros((2, 4))
  adv = jnp.array([1.0, -1.0])
  loss, ratio, low, high, dual = losses.clipped_surrogate(
      logp, old, adv, eps_low=0.2, eps_high=0.28, dual_clip=3.0)
  np.testing.assert_allclose(ratio[0], [0.5, 1.0, 1.5, 4.0], rtol=1e-6)
  # A > 0: min(r, 1.28) scaled by -A; the high clip hits r = 1.5 and 4.
  np.testing.assert_allclose(loss[0], [-0.5, -1.0, -1.28, -1.28], rtol=1e-6)
  # A < 0: max(r, 0.8) and, with the dual clip, at most 3.
  np.testing.assert_allclose(loss[1], [0.8, 1.0, 1.5, 3.0], rtol=1e-6)
  np.testing.assert_array_equal(high[0], [False, False, True, True])
  np.testing.assert_array_equal(low[1], [True, False, False, False])
  np.testing.assert_array_equal(dual[1], [False, False, False, True])


def test_kl_estimators():
  logp, ref = jnp.array([[-1.0, -2.0]]), jnp.array([[-1.5, -1.0]])
  d = logp - ref
  np.testing.assert_allclose(losses.kl_penalty(logp, ref, "k1"), d)
  np.testing.assert_allclose(losses.kl_penalty(logp, ref, "k2"), d**2 / 2)
  np.testing.assert_allclose(losses.kl_penalty(logp, ref, "k3"),
                             np.exp(-d) + d - 1, rtol=1e-6)
  with pytest.raises(ValueError, match="'k1', 'k2', 'k3'"):
    losses.kl_penalty(logp, ref, "k4")


def _balanced_closed_form(lengths, adv, group_size, t_len):
  """w[n, t] = m * |S| / (T_S * N) per docs/aggregation.md, written with numpy."""
  n = len(lengths)
  w = np.zeros((n, t_len))
  for g in range(0, n, group_size):
    members = range(g, g + group_size)
    for sign in (1, -1):
      subset = [i for i in members if np.sign(adv[i]) == sign]
      tokens = sum(lengths[i] for i in subset)
      for i in subset:
        w[i, :lengths[i]] = len(subset) / (tokens * n)
  return w


def test_balanced_gradient_is_weight_times_surrogate_derivative():
  lengths = [3, 7, 1, 5, 6, 2, 2, 4]
  adv = np.array([1.2, -0.4, -0.4, 0.0, 0.7, 0.7, -1.0, -1.0], np.float32)
  t_len = 7
  mask = (np.arange(t_len)[None] < np.array(lengths)[:, None]).astype(float)
  rng = np.random.default_rng(0)
  old = jnp.asarray(rng.normal(size=(8, t_len)) - 2.0, jnp.float32)
  # Ratios stay inside [1 - eps, 1 + eps], so no token is clipped.
  logp = old + jnp.asarray(rng.uniform(-0.1, 0.1, size=(8, t_len)),
                           jnp.float32)

  def loss_fn(lp):
    return losses.policy_loss(lp, old, adv, mask, group_size=4,
                              aggregation="balanced", eps_low=0.2,
                              eps_high=0.2)[0]

  grad = np.asarray(jax.grad(loss_fn)(logp))
  ratio = np.exp(np.asarray(logp) - np.asarray(old))
  want = _balanced_closed_form(lengths, adv, 4, t_len) * (-adv[:, None] * ratio)
  np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-8)


def test_regularisers_use_their_own_aggregation():
  # Every advantage is zero: BA puts no weight on the policy term, but the KL
  # and entropy terms still count through their token-mean aggregation.
  mask = np.ones((4, 3), np.float32)
  logp = jnp.full((4, 3), -1.0)
  ref = jnp.full((4, 3), -1.5)
  entropy = jnp.full((4, 3), 2.0)
  loss, metrics = losses.policy_loss(
      logp, logp, jnp.zeros(4), mask, group_size=2, aggregation="balanced",
      ref_logp=ref, kl_coef=0.1, kl_type="k1", entropy=entropy,
      entropy_coef=0.01)
  assert float(metrics["pg_loss_sum"]) == 0.0
  assert float(loss) == pytest.approx(0.1 * 0.5 - 0.01 * 2.0, rel=1e-6)
  assert float(metrics["entropy"]) == pytest.approx(2.0)


def test_metrics_and_errors():
  mask = np.array([[1, 1, 0], [1, 0, 0]], np.float32)
  logp = jnp.log(jnp.array([[1.5, 0.5, 9.0], [1.0, 9.0, 9.0]]))
  loss, m = losses.policy_loss(logp, jnp.zeros((2, 3)), jnp.array([1.0, -1.0]),
                               mask, group_size=2, aggregation="token",
                               eps_low=0.2, eps_high=0.2)
  assert float(m["num_tokens"]) == 3
  assert float(m["ratio_min"]) == pytest.approx(0.5)
  assert float(m["ratio_max"]) == pytest.approx(1.5)  # masked 9.0 ignored
  assert float(m["clip_frac_high"]) == pytest.approx(1 / 3)
  assert float(m["clip_frac_low"]) == 0.0
  assert float(m["ratio_mean"]) == pytest.approx(1.0)
  # Token mean of [-1.2, -0.5, +1.0].
  assert float(loss) == pytest.approx((-1.2 - 0.5 + 1.0) / 3, rel=1e-6)
  with pytest.raises(ValueError, match="needs ref_logp"):
    losses.policy_loss(logp, logp, jnp.ones(2), mask, group_size=2,
                       aggregation="token", kl_coef=0.1)
  with pytest.raises(ValueError, match="Unknown aggregation mode 'bal'"):
    losses.policy_loss(logp, logp, jnp.ones(2), mask, group_size=2,
                       aggregation="bal")


def test_all_masked_and_zero_advantages_are_finite():
  mask = np.zeros((4, 3), np.float32)
  logp = jnp.zeros((4, 3))
  for aggregation in ("token", "sequence", "balanced", "dr_grpo"):
    def loss_fn(lp):
      return losses.policy_loss(
          lp, logp, jnp.zeros(4), mask, group_size=2, aggregation=aggregation,
          max_response_len=3, ref_logp=logp, kl_coef=0.1, entropy=logp,
          entropy_coef=0.1)
    (loss, metrics), grad = jax.value_and_grad(loss_fn, has_aux=True)(logp)
    for value in [loss, grad, *metrics.values()]:
      assert np.all(np.isfinite(np.asarray(value))), aggregation
