"""Blockwise (flash-style) attention computes what the full score matrix computes."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ba_jax.policy import hf
from ba_jax.policy.model import ModelConfig
from model_utils import left_padded_batch, save_tiny_model

# Both paths sum the same float32 terms in a different order (tile by tile, with rescaling):
# differences are a few ulps of logits of magnitude ~5, i.e. ~1e-6.
TOL = 1e-5
# 11 tokens in tiles of 4: the last tile is padded; row 2 has 4 pad tokens, so its first key tile is
# fully masked for its first real queries and its first 4 queries see no key at all.
LENGTH, BLOCK = 11, 4


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  kinds = ("qwen2", "qwen3", "llama")
  return {kind: save_tiny_model(kind, tmp_path_factory.mktemp(kind), with_tokenizer=False) for kind in kinds}


def _models(path, remat=False):
  full, _ = hf.load_pretrained(path, remat=remat)
  blockwise, config = hf.load_pretrained(path, remat=remat, attention_impl="blockwise", attention_block=BLOCK)
  assert config.attention_impl == "blockwise" and config.attention_block == BLOCK
  return full, blockwise


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "llama"])
def test_logits_equal_full_attention(checkpoints, kind):
  ids, mask = left_padded_batch(seed=1, batch=3, length=LENGTH)
  full, blockwise = _models(checkpoints[kind])
  ref = np.asarray(full(ids, mask))
  ours = np.asarray(blockwise(ids, mask))
  assert np.abs(ref).max() > 1.0
  # Every position, padding queries included: they see no key and must match too.
  np.testing.assert_allclose(ours, ref, atol=TOL, rtol=0)
  # One tile covering the whole sequence takes the same path.
  one_tile, _ = hf.load_pretrained(checkpoints[kind], attention_impl="blockwise", attention_block=64)
  np.testing.assert_allclose(np.asarray(one_tile(ids, mask)), ref, atol=TOL, rtol=0)


def _logp_sum(model, ids, mask):
  logp = jax.nn.log_softmax(model(ids, mask)[:, :-1], axis=-1)
  token_logp = jnp.take_along_axis(logp, jnp.asarray(ids)[:, 1:, None], axis=-1)[..., 0]
  return jnp.sum(token_logp * mask[:, 1:])


@pytest.mark.slow
@pytest.mark.parametrize("kind,remat", [("qwen2", False), ("qwen3", True), ("llama", False)])
def test_gradients_equal_full_attention(checkpoints, kind, remat):
  from flax import nnx
  ids, mask = left_padded_batch(seed=2, batch=3, length=LENGTH)
  grads = [nnx.grad(_logp_sum)(model, ids, mask) for model in _models(checkpoints[kind], remat)]
  ref_leaves, our_leaves = (jax.tree.leaves(nnx.to_pure_dict(g)) for g in grads)
  assert len(ref_leaves) == len(our_leaves) > 0
  for ref, ours in zip(ref_leaves, our_leaves):
    ref, ours = np.asarray(ref), np.asarray(ours)
    assert np.all(np.isfinite(ours))
    np.testing.assert_allclose(ours, ref, rtol=TOL, atol=TOL * np.abs(ref).max())


def test_config_choices_are_checked_and_stay_out_of_config_json():
  base = ModelConfig(model_type="qwen3", vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1,
                     num_heads=2, num_kv_heads=1, head_dim=4, qk_norm=True)
  with pytest.raises(ValueError, match="'flash'"):
    dataclasses.replace(base, attention_impl="flash")
  with pytest.raises(ValueError, match="attention_block=0"):
    dataclasses.replace(base, attention_block=0)
  blockwise = dataclasses.replace(base, attention_impl="blockwise", attention_block=16)
  hf_dict = blockwise.to_hf_dict()
  assert not any(key.startswith("attention_impl") or key == "attention_block" for key in hf_dict)
  assert ModelConfig.from_hf_dict(hf_dict) == blockwise  # the choice is not part of the model


@pytest.mark.slow
def test_backward_pass_holds_no_score_matrix():
  """XLA's buffers for a gradient stay below one float32 [B,H,L,L] score matrix (full needs several)."""
  from flax import nnx
  from ba_jax.policy.model import Decoder
  length, batch = 512, 1
  config = ModelConfig(model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True, remat=True,
                       attention_impl="blockwise", attention_block=64)
  graphdef, state = nnx.split(Decoder(config, rngs=nnx.Rngs(0)))
  ids = jnp.ones((batch, length), jnp.int32)

  def loss(state):
    return jnp.sum(nnx.merge(graphdef, state)(ids, jnp.ones_like(ids))[..., 0])

  temp = jax.jit(jax.grad(loss)).lower(state).compile().memory_analysis().temp_size_in_bytes
  score_matrix = 4 * batch * config.num_heads * length * length
  assert temp < score_matrix, (temp, score_matrix)
