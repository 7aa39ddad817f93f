"""Chunked log-probs: the same numbers and gradients as one [N, T, V] block, in far less memory."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ba_jax.loss import aggregation as agg
from ba_jax.loss import losses
from ba_jax.policy import scoring
from ba_jax.policy.model import Decoder, ModelConfig

GROUP = 2


def _model(vocab=97, **overrides):
  overrides = {"num_layers": 2, **overrides}
  config = ModelConfig("qwen3", vocab_size=vocab, hidden_size=32, intermediate_size=64, num_heads=4,
                       num_kv_heads=2, head_dim=8, qk_norm=True, **overrides)
  return Decoder(config, rngs=nnx.Rngs(3))


def _unchunked(model, p_ids, p_mask, r_ids, r_mask, temperature):
  """What score_responses computed before chunking: all logits, then a log-softmax."""
  P, T = p_ids.shape[1], r_ids.shape[1]
  p_ids, p_mask = scoring.left_justify(p_ids, p_mask)
  logits = model(jnp.concatenate([p_ids, r_ids], 1), jnp.concatenate([p_mask, r_mask], 1))
  logp, entropy = scoring.token_logprobs(logits[:, P - 1:P - 1 + T], r_ids, temperature)
  keep = r_mask == 1
  return jnp.where(keep, logp, 0.0), jnp.where(keep, entropy, 0.0)


def _batch(n=4, p=5, t=11, vocab=97, seed=0):
  rng = np.random.default_rng(seed)
  p_ids = rng.integers(1, vocab, (n, p)).astype(np.int32)
  p_mask = np.ones((n, p), np.int32)
  r_ids = rng.integers(1, vocab, (n, t)).astype(np.int32)
  r_mask = np.ones((n, t), np.int32)
  for i in range(n):  # left-padded prompts, responses of different lengths
    p_mask[i, :i] = 0
    r_mask[i, t - 2 * i:] = 0
  return tuple(jnp.asarray(x) for x in (p_ids, p_mask, r_ids, r_mask))


@pytest.mark.parametrize("tied", [False, True])  # head [E, V] ("ev") or the embedding [V, E] ("ve")
@pytest.mark.parametrize("chunk", [1, 4, 11, 64])
def test_chunked_equals_unchunked(chunk, tied):
  model, batch = _model(tie_word_embeddings=tied), _batch()
  assert model.head_operand()[1] == ("ve" if tied else "ev")
  got = nnx.jit(lambda m: scoring.score_responses(m, *batch, temperature=0.7, chunk=chunk))(model)
  want = nnx.jit(lambda m: _unchunked(m, *batch, 0.7))(model)
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("chunk, tied", [(4, False), (64, True)])  # several chunks (remat) / one
def test_loss_gradients_equal_for_every_mode(chunk, tied):
  model, batch = _model(tie_word_embeddings=tied), _batch()
  rng = np.random.default_rng(1)
  adv = jnp.asarray(rng.normal(size=batch[0].shape[0]), jnp.float32)
  old = jnp.asarray(-np.abs(rng.normal(size=batch[2].shape)), jnp.float32)

  def loss(m, score, mode):
    logp, entropy = score(m)
    return losses.policy_loss(logp, old, adv, batch[3], group_size=GROUP, aggregation=mode, max_response_len=11,
                              entropy=entropy, entropy_coef=0.01)[0]

  def every_mode(score):  # one compiled program per scorer, one backward pass per mode
    return nnx.jit(lambda m: {mode: nnx.value_and_grad(lambda m: loss(m, score, mode))(m) for mode in agg.MODES})

  chunked = every_mode(lambda m: scoring.score_responses(m, *batch, temperature=0.7, chunk=chunk))(model)
  full = every_mode(lambda m: _unchunked(m, *batch, 0.7))(model)
  for mode in agg.MODES:
    (l_c, g_c), (l_f, g_f) = chunked[mode], full[mode]
    np.testing.assert_allclose(float(l_c), float(l_f), rtol=1e-6, err_msg=mode)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=1e-5,
                                                         err_msg=mode),
                 nnx.to_pure_dict(g_c), nnx.to_pure_dict(g_f))


@pytest.mark.slow
def test_chunked_scorer_needs_under_half_the_memory():
  vocab, chunk = 4096, 128
  # Blockwise attention, so no [L, L] scores hide what the LM head costs.
  model = _model(vocab=vocab, attention_impl="blockwise", attention_block=128, num_layers=1)
  batch = _batch(n=2, p=16, t=1024, vocab=vocab)
  graphdef, params = nnx.split(model)

  def value_and_grad(score):
    def loss(params):
      logp, entropy = score(nnx.merge(graphdef, params))
      return jnp.sum(logp) + 0.1 * jnp.sum(entropy), (logp, entropy)
    return jax.jit(jax.value_and_grad(loss, has_aux=True))

  chunked = value_and_grad(lambda m: scoring.score_responses(m, *batch, chunk=chunk))
  full = value_and_grad(lambda m: _unchunked(m, *batch, 1.0))
  temp = {name: fn.lower(params).compile().memory_analysis().temp_size_in_bytes
          for name, fn in (("chunked", chunked), ("full", full))}
  # Logits alone are 2 x 1040 x 4096 float32 = 33 MiB in the unchunked scorer.
  print(temp)
  assert temp["chunked"] < 0.5 * temp["full"], temp
  (_, got), _ = chunked(params)
  (_, want), _ = full(params)
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5, rtol=1e-5)


def test_bad_chunk_is_named():
  with pytest.raises(ValueError, match="chunk must be a positive int.*0"):
    scoring.score_responses(_model(), *_batch(), chunk=0)
  with pytest.raises(ValueError, match="logprob_chunk=0"):
    _model(logprob_chunk=0)
