"""Attention kernels by backend: each agrees with the blockwise path on CPU where it can run."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ba_jax.policy import attention
from ba_jax.policy import sharding as sh
from ba_jax.policy.model import Decoder, ModelConfig

B, L, H, K = 4, 256, 4, 2


def _qkv(D, seed=0):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.normal(size=(B, L, H, D)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(B, L, K, D)), jnp.float32)
  v = jnp.asarray(rng.normal(size=(B, L, K, D)), jnp.float32)
  mask = np.ones((B, L), np.int32)
  mask[1, :37] = 0  # left padding
  mask[2, 200:] = 0  # right padding
  mask[3, :130] = 0  # padding longer than a 128 tile
  return q, k, v, jnp.asarray(mask)


def _valid(x, mask):
  return np.asarray(x)[np.asarray(mask) == 1]


def test_auto_picks_the_backends_kernel():
  pick = functools.partial(attention.resolve_impl, "auto", head_dim=128)
  assert pick(dtype=jnp.float32) == "blockwise"  # this CPU
  assert pick(dtype=jnp.bfloat16, backend="tpu") == "splash"
  assert pick(dtype=jnp.bfloat16, backend="gpu") == "cudnn"
  assert pick(dtype=jnp.float32, backend="gpu") == "blockwise"  # cuDNN takes 16-bit inputs only
  assert attention.resolve_impl("auto", head_dim=256, dtype=jnp.bfloat16, backend="gpu") == "blockwise"
  assert attention.resolve_impl("xla", head_dim=128, dtype=jnp.float32, backend="tpu") == "xla"


def test_xla_dot_product_attention_equals_blockwise():
  q, k, v, mask = _qkv(16)
  ref = attention.blockwise_attention(q, k, v, mask, 64)
  got = attention.attend(q, k, v, mask, impl="xla", block=64)
  np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=2e-6, rtol=0)  # padded rows too
  grad = lambda impl: jax.grad(lambda q: jnp.sum(attention.attend(q, k, v, mask, impl=impl, block=64)
                                                 * mask[:, :, None, None]))(q)
  np.testing.assert_allclose(np.asarray(grad("xla")), np.asarray(grad("blockwise")), atol=1e-5, rtol=0)


def test_splash_kernel_in_interpret_mode_equals_blockwise():
  """The Pallas TPU kernel itself, run by the Pallas interpreter on CPU (head_dim 128, as on TPU)."""
  q, k, v, mask = _qkv(128)
  ref = attention.blockwise_attention(q, k, v, mask, 128)
  got = attention.splash_attention(q, k, v, mask, 128, interpret=True)
  np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=1e-5, rtol=0)
  # On a mesh it runs per device (rows over data x fsdp, heads over tensor) under shard_map.
  mesh = sh.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  kernel = functools.partial(attention.splash_attention, block=128, interpret=True)
  with sh.activation_sharding(mesh, sh.DEFAULT_RULES):
    sharded = jax.jit(lambda *a: attention._per_shard(kernel, *a))(q, k, v, mask)
  np.testing.assert_allclose(np.asarray(sharded), np.asarray(ref), atol=1e-5, rtol=0)


def test_splash_rejects_a_length_off_its_block():
  q, k, v, mask = _qkv(128)
  with pytest.raises(ValueError, match="sequence length 200 is not a multiple of its block 128"):
    attention.splash_attention(q[:, :200], k[:, :200], v[:, :200], mask[:, :200], 128, interpret=True)


@pytest.mark.parametrize("impl", ["xla", "auto"])
def test_model_logits_equal_full_attention(impl):
  config = ModelConfig("qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=8, attention_bias=True)
  full = Decoder(config, rngs=nnx.Rngs(0))
  other = Decoder(dataclasses.replace(config, attention_impl=impl, attention_block=8), rngs=nnx.Rngs(0))
  ids = jnp.asarray(np.random.default_rng(1).integers(0, 64, (2, 20)), jnp.int32)
  mask = jnp.asarray(np.concatenate([np.zeros((2, 5)), np.ones((2, 15))], 1).astype(np.int32))
  np.testing.assert_allclose(_valid(other(ids, mask), mask), _valid(full(ids, mask), mask), atol=1e-5, rtol=0)
