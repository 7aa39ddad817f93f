"""ba_jax.policy.scoring: per-token log-probs and entropies against transformers."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers import AutoModelForCausalLM

from ba_jax.policy import hf
from ba_jax.policy import scoring
from model_utils import PAD_ID, left_padded_batch, save_tiny_model

# Our logits match transformers' to ~1e-5 in float32 on these tiny models; a
# log-softmax adds no more than a few ulps of its inputs' range.
TOL = 1e-4


@pytest.fixture(scope="module")
def models(tmp_path_factory):
  path = save_tiny_model("qwen3", tmp_path_factory.mktemp("qwen3"))
  theirs = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
  return hf.load_pretrained(path)[0], theirs


def _batch(n=3, p=8, t=6, seed=0):
  ids, mask = left_padded_batch(seed=seed, batch=n, length=p)
  rng = np.random.default_rng(seed + 1)
  resp = rng.integers(4, 128, size=(n, t)).astype(np.int32)
  resp_mask = np.ones((n, t), np.int32)
  for i in range(n):  # row i stops after t - i tokens
    resp_mask[i, t - i:] = 0
    resp[i, t - i:] = PAD_ID
  return ids, mask, resp, resp_mask


def _torch_reference(theirs, ids, mask, resp, resp_mask, temperature):
  full = np.concatenate([ids, resp], 1)
  full_mask = np.concatenate([mask, resp_mask], 1)
  positions = np.maximum(np.cumsum(full_mask, 1) - 1, 0)
  with torch.no_grad():
    logits = theirs(input_ids=torch.as_tensor(full, dtype=torch.long),
                    attention_mask=torch.as_tensor(full_mask, dtype=torch.long),
                    position_ids=torch.as_tensor(positions, dtype=torch.long)).logits
  P, T = ids.shape[1], resp.shape[1]
  logp_all = torch.log_softmax(logits[:, P - 1:P - 1 + T].double() / temperature, -1)
  logp = torch.gather(logp_all, -1, torch.as_tensor(resp, dtype=torch.long)[..., None])[..., 0]
  entropy = -(logp_all.exp() * logp_all).sum(-1)
  return logp.numpy() * resp_mask, entropy.numpy() * resp_mask


_score_jit = nnx.jit(scoring.score_responses, static_argnames="temperature")


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_matches_transformers_log_softmax(models, temperature):
  ours, theirs = models
  batch = _batch()
  logp, entropy = _score_jit(ours, *batch, temperature=temperature)
  ref_logp, ref_entropy = _torch_reference(theirs, *batch, temperature)
  np.testing.assert_allclose(np.asarray(logp), ref_logp, atol=TOL, rtol=0)
  np.testing.assert_allclose(np.asarray(entropy), ref_entropy, atol=TOL, rtol=0)
  resp_mask = batch[3]
  assert np.all(np.asarray(logp)[resp_mask == 0] == 0.0)
  assert np.all(np.asarray(logp)[resp_mask == 1] < 0.0)
  assert np.all(np.asarray(entropy)[resp_mask == 1] > 0.0)


def test_eager_equals_jit_and_padding_side_does_not_matter(models):
  ours, _ = models
  ids, mask, resp, resp_mask = _batch(seed=3)
  jitted = _score_jit(ours, ids, mask, resp, resp_mask)
  eager = scoring.score_responses(ours, ids, mask, resp, resp_mask)
  right_ids, right_mask = np.full_like(ids, PAD_ID), np.zeros_like(mask)
  for i in range(ids.shape[0]):
    real = ids[i][mask[i] == 1]
    right_ids[i, :real.size], right_mask[i, :real.size] = real, 1
  right = _score_jit(ours, right_ids, right_mask, resp, resp_mask)
  for a, b in zip(jitted, eager):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
  for a, b in zip(jitted, right):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


@pytest.mark.slow
def test_gradient_matches_finite_difference(models):
  ours, _ = models
  batch = _batch(seed=5)
  graphdef, params, rest = nnx.split(ours, nnx.Param, ...)

  def total_logp(params):
    model = nnx.merge(graphdef, params, rest)
    logp, _ = scoring.score_responses(model, *batch, temperature=0.8)
    return jnp.sum(logp)

  loss, grads = jax.jit(jax.value_and_grad(total_logp))(params)
  flat_grads = jax.tree.leaves(grads)
  assert all(bool(jnp.all(jnp.isfinite(g))) for g in flat_grads)
  assert sum(float(jnp.sum(jnp.abs(g))) for g in flat_grads) > 0
  # Directional derivative along a random direction vs a central difference.
  keys = jax.random.split(jax.random.key(0), len(flat_grads))
  direction = jax.tree.unflatten(jax.tree.structure(grads), [
      jax.random.normal(k, g.shape, g.dtype) for k, g in zip(keys, flat_grads)])
  analytic = sum(float(jnp.vdot(g, d)) for g, d in zip(flat_grads, jax.tree.leaves(direction)))
  eps = 1e-3
  f = jax.jit(total_logp)
  plus = f(jax.tree.map(lambda p, d: p + eps * d, params, direction))
  minus = f(jax.tree.map(lambda p, d: p - eps * d, params, direction))
  numeric = float(plus - minus) / (2 * eps)
  # float32 central difference: truncation O(eps^2) plus rounding ~ |loss|*1e-7/eps.
  assert abs(numeric - analytic) <= 1e-2 * abs(analytic) + abs(float(loss)) * 1e-4


@pytest.mark.parametrize("kwargs,match", [
    (dict(temperature=0.0), "temperature"),
    (dict(temperature=-1.0), "temperature"),
])
def test_bad_temperature_is_named(models, kwargs, match):
  with pytest.raises(ValueError, match=match):
    scoring.score_responses(models[0], *_batch(), **kwargs)


def test_shape_mismatch_is_named(models):
  ids, mask, resp, resp_mask = _batch()
  with pytest.raises(ValueError, match="response_mask shape"):
    scoring.score_responses(models[0], ids, mask, resp, resp_mask[:, :-1])
  with pytest.raises(ValueError, match="same N"):
    scoring.score_responses(models[0], ids, mask, resp[:-1], resp_mask[:-1])


def test_left_justify_keeps_token_order():
  ids = jnp.array([[7, 8, 0, 0], [0, 5, 0, 6], [1, 2, 3, 4]])
  mask = jnp.array([[1, 1, 0, 0], [0, 1, 0, 1], [1, 1, 1, 1]])
  out_ids, out_mask = scoring.left_justify(ids, mask, pad_id=9)
  np.testing.assert_array_equal(out_ids, [[9, 9, 7, 8], [9, 9, 5, 6], [1, 2, 3, 4]])
  np.testing.assert_array_equal(out_mask, [[0, 0, 1, 1], [0, 0, 1, 1], [1, 1, 1, 1]])
