"""bfloat16 and float16 compute on CPU: every kind samples (static sampler and engine) and scores,
agrees with its own scorer, and gives float32's greedy tokens wherever rounding cannot flip them.

Error model for the tolerances below: every path rounds each intermediate (norm outputs, q/k/v,
attention probabilities and output, MLP activations, the residual stream) to the compute dtype,
moving it by at most eps/2 relative (eps = `finfo(dtype).eps`: 2^-7 bfloat16, 2^-10 float16); a
one-layer model's path from the embedding to a logit holds about R = 16 such roundings, and its
logits here are |z| <= ~6. Products of two 16-bit numbers are exact in float32 and sums run in
float32 (`attention.einsum_f32`), so the roundings are the only low-precision error.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ba_jax.policy import attention
from ba_jax.policy import hf
from ba_jax.generation import sampler
from ba_jax.policy import scoring
from model_utils import KINDS, PAD_ID, left_padded_batch, save_tiny_model

DTYPES = ("bfloat16", "float16")
B, P, T = 3, 8, 4  # prompts (rows: greedy, one per prompt), prompt length, new tokens
ENGINE_SLOTS = 2  # < B rows: the continuous-batching engine, refilling a slot


# Sampled (cached decode) and scored (one uncached forward) log-probs in the same dtype round
# different intermediates. Each path's error on a logit, R roundings adding like a random walk, is
# ~sqrt(R) * eps/2 * |z| = 4 * eps/2 * 4 = 8 eps for a typical |z| ~ 4; a log-prob (the token's
# logit minus a log-sum-exp, which moves by a probability-weighted mean of the logits' errors)
# moves about as much, so two paths are up to 2 * 8 eps apart (measured: at most ~6 eps).
LOGP_TOL_EPS = 16
# A bound, not a typical size, for the float32 comparison: R roundings in the same direction move a
# logit by at most R * eps/2 * max|z| = 8 eps * max|z| (measured: at most ~3.7 eps * max|z|).
LOGIT_BOUND_EPS = 8


def _eps(dtype: str) -> float:
  return float(jnp.finfo(dtype).eps)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
def test_einsum_f32_runs_the_cached_prefill_product_on_cpu(dtype):
  """The product XLA:CPU could not run (its fallback dot has no BF16 x BF16 = F32): the cached
  prefill's q.K against keys [B, K, D, S] with K = 2 kv heads. It now equals float32's product of
  the same values up to summation order: products of 16-bit numbers are exact in float32, and a sum
  of D terms in any order is within D * 2^-24 * sum|terms| of the exact one."""
  q = jax.random.normal(jax.random.key(0), (2, 8, 2, 2, 16)).astype(dtype)  # [B, L, K, G, D]
  k = jax.random.normal(jax.random.key(1), (2, 2, 16, 12)).astype(dtype)  # [B, K, D, S]
  product = functools.partial(jnp.einsum, "blkgd,bkds->bkgls")
  got = jax.jit(functools.partial(attention.einsum_f32, "blkgd,bkds->bkgls"))(q, k)
  q32, k32 = q.astype(jnp.float32), k.astype(jnp.float32)
  assert got.dtype == jnp.float32
  assert np.all(np.abs(got - product(q32, k32)) <= 2 * 16 * 2.0**-24 * product(jnp.abs(q32), jnp.abs(k32)))


def test_einsum_f32_upcasts_16_bit_operands_on_cpu_only():
  """Accelerators get the 16-bit operands as they are (float32 accumulation); float32 operands
  trace to the same program on every backend (the float32 path is untouched)."""
  trace = lambda dtype, backend: str(jax.make_jaxpr(functools.partial(
      attention.einsum_f32, "ij,jk->ik", backend=backend))(jnp.ones((4, 8), dtype), jnp.ones((8, 3), dtype)))
  for dtype in DTYPES:
    assert "convert_element_type" in trace(dtype, "cpu")
    for backend in ("tpu", "gpu"):
      assert "convert_element_type" not in trace(dtype, backend)
  assert trace("float32", "cpu") == trace("float32", "tpu") == trace("float32", "gpu")
  assert "convert_element_type" not in trace("float32", "cpu")


@pytest.fixture(scope="module", params=KINDS)
def checkpoint(request, tmp_path_factory):
  """One layer (each compile is short) and weights rounded to bfloat16, so that the float32 model
  and the low-precision ones hold exactly the same weights (bfloat16 values are float16 values
  too at this scale)."""
  kind = request.param
  return save_tiny_model(kind, tmp_path_factory.mktemp(kind), dtype="bfloat16", with_tokenizer=False,
                         num_hidden_layers=1)


@pytest.fixture(scope="module")
def float32_logits(checkpoint):
  """The float32 model's logits of (ids, mask), same weights; one compile per kind."""
  model = hf.load_pretrained(checkpoint, dtype="float32", param_dtype="float32")[0]
  return jax.jit(lambda ids, mask: model(ids, mask))


@pytest.fixture(scope="module")
def prompts():
  return left_padded_batch(seed=3, batch=B, length=P)


def _greedy(model, ids, mask, max_slots):
  return jax.device_get(sampler.sample_groups(
      model, ids, mask, group_size=1, max_new_tokens=T, temperature=0.0, eos_id=sampler.NO_STOP,
      pad_id=PAD_ID, rng=jax.random.key(0), max_slots=max_slots))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
def test_samples_score_and_match_float32_greedy(checkpoint, float32_logits, prompts, dtype):
  """Greedy samples in `dtype` from the static sampler and the engine run, are finite, match their
  scores, and equal float32's argmax where float32's top-1 margin exceeds twice the logit error bound.

  Why equality must hold there: both models hold the same (bfloat16-exact) weights, so the
  low-precision logits z' at a step differ from float32's z on the same prefix only by rounding,
  |z' - z| <= delta = LOGIT_BOUND_EPS * eps * max|z| per entry; if z's top-1 beats its runner-up by
  more than 2 * delta, no entry of z' can overtake it. The float32 logits are taken on the
  low-precision tokens' own prefixes (teacher forcing), so every step is checked on its own.
  """
  ids, mask = prompts
  # float32 parameters, `dtype` compute: the paper configs' setting.
  model = hf.load_pretrained(checkpoint, dtype=dtype, param_dtype="float32")[0]
  static, engine = _greedy(model, ids, mask, 0), _greedy(model, ids, mask, ENGINE_SLOTS)
  for res in (static, engine):
    assert res.tokens.shape == res.logprobs.shape == res.mask.shape == (B, T)
    np.testing.assert_array_equal(res.lengths, T)  # no stop token: every row runs to its budget
    np.testing.assert_array_equal(res.mask, 1)
    assert np.all((res.tokens >= 0) & (res.tokens < model.config.vocab_size))
    assert np.all(np.isfinite(res.logprobs)) and np.all(res.logprobs <= 0.0)

  # Both samplers' rows in one scoring call and one float32 forward (one compile each).
  ids_2B, mask_2B = np.concatenate([ids, ids]), np.concatenate([mask, mask])
  tokens_2B, ones_2B = np.concatenate([static.tokens, engine.tokens]), np.ones((2 * B, T), np.int32)
  scored, entropy = jax.device_get(jax.jit(functools.partial(scoring.score_responses, model))(
      ids_2B, mask_2B, tokens_2B, ones_2B))
  assert np.all(np.isfinite(entropy))
  np.testing.assert_allclose(np.concatenate([static.logprobs, engine.logprobs]), scored, rtol=0,
                             atol=LOGP_TOL_EPS * _eps(dtype))

  z_2BxTxV = np.asarray(float32_logits(np.concatenate([ids_2B, tokens_2B], 1),
                                       np.concatenate([mask_2B, ones_2B], 1)))[:, P - 1:P - 1 + T]
  top2 = np.sort(z_2BxTxV, axis=-1)[..., -2:]
  delta = LOGIT_BOUND_EPS * _eps(dtype) * np.abs(z_2BxTxV).max(-1)
  must = top2[..., 1] - top2[..., 0] > 2 * delta
  assert must.sum() >= B  # the check binds (at 1/4 to 2/3 of the steps in bfloat16, most in float16)
  np.testing.assert_array_equal(tokens_2B[must], z_2BxTxV.argmax(-1)[must])

