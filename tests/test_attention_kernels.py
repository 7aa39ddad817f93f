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
  assert pick(dtype=jnp.float32, backend="cpu") == "blockwise"
  assert pick(dtype=jnp.bfloat16, backend="tpu") == "splash"
  assert pick(dtype=jnp.bfloat16, backend="gpu") == "cudnn"
  assert pick(dtype=jnp.float32, backend="gpu") == "blockwise"  # cuDNN takes 16-bit inputs only
  assert attention.resolve_impl("auto", head_dim=256, dtype=jnp.bfloat16, backend="gpu") == "blockwise"
  assert attention.resolve_impl("xla", head_dim=128, dtype=jnp.float32, backend="tpu") == "xla"


@pytest.mark.slow
def test_xla_dot_product_attention_equals_blockwise():
  q, k, v, mask = _qkv(16)
  ref = attention.blockwise_attention(q, k, v, mask, 64)
  got = attention.attend(q, k, v, mask, impl="xla", block=64)
  np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=2e-6, rtol=0)  # padded rows too
  grad = lambda impl: jax.grad(lambda q: jnp.sum(attention.attend(q, k, v, mask, impl=impl, block=64)
                                                 * mask[:, :, None, None]))(q)
  np.testing.assert_allclose(np.asarray(grad("xla")), np.asarray(grad("blockwise")), atol=1e-5, rtol=0)


@pytest.mark.slow
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


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["xla", "auto"])
def test_model_logits_equal_full_attention(impl):
  config = ModelConfig("qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=8, attention_bias=True)
  full = Decoder(config, rngs=nnx.Rngs(0))
  other = Decoder(dataclasses.replace(config, attention_impl=impl, attention_block=8), rngs=nnx.Rngs(0))
  ids = jnp.asarray(np.random.default_rng(1).integers(0, 64, (2, 20)), jnp.int32)
  mask = jnp.asarray(np.concatenate([np.zeros((2, 5)), np.ones((2, 15))], 1).astype(np.int32))
  np.testing.assert_allclose(_valid(other(ids, mask), mask), _valid(full(ids, mask), mask), atol=1e-5, rtol=0)


# --- The kernels themselves on their own backend (python -m ba_jax.accelerator_check runs
# these there; on CPU they are skipped). Inputs are bfloat16, as the kernels take them; the
# reference is the blockwise path in float32 on the same bfloat16 values. Outputs are convex
# combinations of values |v| < ~4.5 (normal draws), so rounding the output to bfloat16 (relative
# 2^-9) and the kernels' bfloat16 probabilities before P.V (each p relative 2^-9, sum p = 1) each
# move it by at most 4.5 * 2^-9 ~ 9e-3: 2e-2 bounds both.
BF16_ATOL = 2e-2


def _bf16_case(D):
  q, k, v, mask = _qkv(D)
  q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
  ref = attention.blockwise_attention(*(x.astype(jnp.float32) for x in (q, k, v)), mask, 128)
  return q, k, v, mask, ref


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN's fused attention needs a GPU")
@pytest.mark.parametrize("D", [64, 128])
def test_cudnn_kernel_on_gpu_equals_blockwise(D):
  q, k, v, mask, ref = _bf16_case(D)
  assert attention.resolve_impl("auto", head_dim=D, dtype=q.dtype) == "cudnn"
  got = jax.jit(lambda *a: attention.attend(*a, impl="cudnn", block=128))(q, k, v, mask)
  np.testing.assert_allclose(_valid(got.astype(jnp.float32), mask), _valid(ref, mask),
                             atol=BF16_ATOL, rtol=0)
  # The backward pass the train step takes through it: dL/dq of sum(out * w) for a fixed w,
  # against the float32 blockwise gradient. Each element sums up to L = 256 keys' products,
  # each rounded to bfloat16 (relative 2^-9) on the way; independent roundings grow as
  # sqrt(L) * 2^-9 ~ 3e-2 of the terms' scale, so 5e-2 of the gradient's largest element.
  w = jnp.asarray(np.random.default_rng(3).normal(size=q.shape), jnp.float32) * mask[:, :, None, None]
  loss = lambda impl, dtype: lambda q: jnp.sum(attention.attend(
      q.astype(dtype), k.astype(dtype), v.astype(dtype), mask, impl=impl, block=128).astype(jnp.float32) * w)
  g = jax.jit(jax.grad(loss("cudnn", jnp.bfloat16)))(q.astype(jnp.float32))
  g_ref = jax.jit(jax.grad(loss("blockwise", jnp.float32)))(q.astype(jnp.float32))
  scale = float(jnp.max(jnp.abs(g_ref)))
  np.testing.assert_allclose(np.asarray(g), np.asarray(g_ref), atol=5e-2 * scale, rtol=0)


@pytest.mark.skipif(jax.default_backend() != "tpu", reason="the splash kernel compiles for a TPU")
def test_splash_kernel_on_tpu_equals_blockwise():
  q, k, v, mask, ref = _bf16_case(128)
  assert attention.resolve_impl("auto", head_dim=128, dtype=q.dtype) == "splash"
  got = jax.jit(lambda *a: attention.attend(*a, impl="splash", block=128))(q, k, v, mask)
  np.testing.assert_allclose(_valid(got.astype(jnp.float32), mask), _valid(ref, mask),
                             atol=BF16_ATOL, rtol=0)
