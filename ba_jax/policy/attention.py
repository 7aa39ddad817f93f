"""Causal grouped-query attention, one kernel per backend.

`attend` computes the uncached forward's attention with the kernel that
`ModelConfig.attention_impl` names: "full" (one [L, L] score matrix),
"blockwise" (flash-style tiles in plain JAX, any backend), "xla"/"cudnn"
(`jax.nn.dot_product_attention`), "splash" (the Pallas TPU kernel) or "auto"
(splash on TPU, cuDNN on GPU where its constraints hold, blockwise elsewhere).
Every kernel treats padding the same way: a key with mask 0 gets no weight, and
a query that may see no key (left padding) gets the mean of all values, as a
softmax over a row of equal masked scores gives. The decode path keeps its KV
cache and calls `full_attention`. `einsum_f32` is the float32-accumulating product
that the kernels and the LM head share.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from ba_jax.config import schema
from ba_jax.policy import compiling
from ba_jax.policy import sharding as sharding_lib

IMPLS = schema.ATTENTION_IMPLS


def resolve_impl(impl: str, *, head_dim: int, dtype, backend: str | None = None) -> str:
  """The concrete kernel "auto" stands for on `backend` (default: `compiling.backend()`, the target being built for)."""
  if impl != "auto":
    return impl
  backend = backend or compiling.backend()
  if backend == "tpu":
    return "splash"
  # cuDNN's fused attention takes 16-bit inputs and head_dim a multiple of 8 up to 128.
  if backend == "gpu" and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16) and head_dim % 8 == 0 and head_dim <= 128:
    return "cudnn"
  return "blockwise"


def _upcast_16bit(x):
  return x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize < 4 else x


def einsum_f32(subscripts: str, a, b, *, backend: str | None = None):
  """`jnp.einsum` of two operands accumulated in float32, with a float32 result.

  Accelerators multiply 16-bit operands as they are, accumulating in float32. XLA:CPU has no such
  product in every layout: where its YNNPACK fusion declines a dot (the cached prefill's q.K, keys
  `[B, K, D, S]` with K > 1) the fallback `DotThunk` raises "Unsupported element type ... BF16 x
  BF16 = F32". So on CPU (`backend`, default `compiling.backend()`) 16-bit float operands (float16 too,
  one rule for all) are cast to float32 first: a product of two such numbers is exact in float32,
  so the result is the same float32 sum. float32 operands pass through unchanged everywhere.
  """
  if (backend or compiling.backend()) == "cpu":
    a, b = _upcast_16bit(a), _upcast_16bit(b)
  return jnp.einsum(subscripts, a, b, preferred_element_type=jnp.float32)


def _cache_attention_cpu(q_BxKxGxD, k_BxKxDxS, v_BxKxSxD, allowed_BxS):
  """One decode step's attention over the KV cache as multiply-and-sum reductions (float32).

  The same sums as the two einsums, which XLA:CPU hands to a batched matmul library call that
  reads the cache at ~10 GB/s for these [G x D] x [D x S] products. As fused reductions a
  step's attention (128 rows x 287 positions x 8 layers) took 42 instead of 53 ms in the engine,
  and about half that with the late normalisation below (experiments/benchmarks/results/engine_bench.md).
  Accelerators keep the matmuls.
  """
  f32 = jnp.float32
  D = q_BxKxGxD.shape[-1]
  scores = jnp.sum(q_BxKxGxD.astype(f32)[..., None] * k_BxKxDxS.astype(f32)[:, :, None], axis=3) * (D ** -0.5)
  scores = jnp.where(allowed_BxS[:, None, None], scores, jnp.finfo(f32).min)
  # Normalised after the sum over positions: with the division between them, XLA:CPU fused
  # the reduction into the output projection's matmul library call and ran it ~2x slower.
  weights = jnp.exp(scores - jnp.max(scores, axis=-1, keepdims=True))
  out = jnp.sum(weights[..., None] * v_BxKxSxD.astype(f32)[:, :, None], axis=3)
  return out / jnp.sum(weights, axis=-1)[..., None]


def full_attention(q_BxLxHxD, k, v, allowed_BxLxS, kv_axes: str = "bskd", k_axes: str | None = None):
  """Softmax attention with one [L, S] score matrix; `kv_axes` "bskd" or "bksd" (the values' layout),
  `k_axes` the keys' ("bkds" in the KV cache; default `kv_axes`)."""
  k_axes = k_axes or kv_axes
  B, L, H, D = q_BxLxHxD.shape
  K = k.shape[k_axes.index("k")]
  dt = q_BxLxHxD.dtype
  if L == 1:
    # A decode step: no unit query axis in the matmuls. XLA:CPU lowers them ~5x slower with it
    # (21 vs 4.3 ms for 128 rows x 287 cached positions, 4 kv heads of 64).
    q_BxKxGxD = q_BxLxHxD.reshape(B, K, H // K, D)
    if (k_axes, kv_axes) == ("bkds", "bksd") and compiling.backend() == "cpu":
      return _cache_attention_cpu(q_BxKxGxD, k, v, allowed_BxLxS[:, 0]).astype(dt).reshape(B, 1, H, D)
    scores = einsum_f32(f"bkgd,{k_axes}->bkgs", q_BxKxGxD, k.astype(dt)) * (D ** -0.5)
    scores = jnp.where(allowed_BxLxS[:, 0, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(dt)
    return jnp.einsum(f"bkgs,{kv_axes}->bkgd", probs, v.astype(dt)).reshape(B, 1, H, D)
  q_BxLxKxGxD = q_BxLxHxD.reshape(B, L, K, H // K, D)
  scores = einsum_f32(f"blkgd,{k_axes}->bkgls", q_BxLxKxGxD, k.astype(dt)) * (D ** -0.5)
  scores = jnp.where(allowed_BxLxS[:, None, None], scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1).astype(dt)
  return jnp.einsum(f"bkgls,{kv_axes}->blkgd", probs, v.astype(dt)).reshape(B, L, H, D)


def _mean_where_blind(out_BxLxHxD, v_BxLxKxD, mask_BxL):
  """Rows that see no key (left padding) get the mean of all values, as the "full" path gives."""
  B, L, H, D = out_BxLxHxD.shape
  K = v_BxLxKxD.shape[2]
  sees_a_key_BxL = jnp.cumsum(mask_BxL, axis=1) > 0
  mean_v = jnp.repeat(jnp.mean(v_BxLxKxD.astype(jnp.float32), axis=1), H // K, axis=1)  # [B,H,D]
  return jnp.where(sees_a_key_BxL[:, :, None, None], out_BxLxHxD, mean_v[:, None].astype(out_BxLxHxD.dtype))


def dot_product_attention(q_BxLxHxD, k_BxLxKxD, v_BxLxKxD, mask_BxL, implementation: str):
  """`jax.nn.dot_product_attention` ("xla" or "cudnn") with causality and key padding as one mask."""
  L = q_BxLxHxD.shape[1]
  allowed_Bx1xLxL = (jnp.tril(jnp.ones((L, L), bool))[None] & (mask_BxL[:, None, :] == 1))[:, None]
  out = jax.nn.dot_product_attention(q_BxLxHxD, k_BxLxKxD, v_BxLxKxD, mask=allowed_Bx1xLxL,
                                     implementation=implementation)
  return _mean_where_blind(out, v_BxLxKxD, mask_BxL)


@functools.lru_cache(maxsize=16)
def _splash_kernel(L: int, group: int, block: int, interpret: bool):
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as mask_lib
  mask = mask_lib.MultiHeadMask([mask_lib.CausalMask((L, L)) for _ in range(group)])
  sizes = kernel.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                            block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
  return kernel.make_splash_mqa(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret)


def splash_attention(q_BxLxHxD, k_BxLxKxD, v_BxLxKxD, mask_BxL, block: int, *, interpret: bool = False):
  """The Pallas TPU splash kernel: one multi-query call per (row, kv head); padding as segment ids.

  Padding is a segment id: every query is in segment 1, keys in segment `mask` (pad keys in 0),
  so no query sees a pad key, left or right padding alike, as on the other paths. L must be a
  multiple of the kernel's block (min(block, L)).
  """
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel
  B, L, H, D = q_BxLxHxD.shape
  K = k_BxLxKxD.shape[2]
  G, T = H // K, min(block, L)
  if L % T:
    raise ValueError(f"splash attention: sequence length {L} is not a multiple of its block {T}; "
                     "pad the batch or set model.attention_impl='blockwise'")
  splash = _splash_kernel(L, G, T, interpret)
  q_BxKxGxLxD = (q_BxLxHxD * (D ** -0.5)).reshape(B, L, K, G, D).transpose(0, 2, 3, 1, 4)
  k_BxKxLxD, v_BxKxLxD = k_BxLxKxD.transpose(0, 2, 1, 3), v_BxLxKxD.transpose(0, 2, 1, 3)

  def row(q_KxGxLxD, k_KxLxD, v_KxLxD, seg_L):
    segments = kernel.SegmentIds(q=jnp.ones_like(seg_L), kv=seg_L)
    return jax.vmap(lambda q, k, v: splash(q, k, v, segment_ids=segments))(q_KxGxLxD, k_KxLxD, v_KxLxD)

  out = jax.vmap(row)(q_BxKxGxLxD, k_BxKxLxD, v_BxKxLxD, mask_BxL.astype(jnp.int32))
  out = out.transpose(0, 3, 1, 2, 4).reshape(B, L, H, D).astype(q_BxLxHxD.dtype)
  return _mean_where_blind(out, v_BxLxKxD, mask_BxL)


def _per_shard(kernel, q_BxLxHxD, k_BxLxKxD, v_BxLxKxD, mask_BxL):
  """Runs a Pallas kernel (which the partitioner cannot split) on each device's rows and heads.

  Inside `sharding.activation_sharding`, rows go over the batch mesh axes and heads over the
  tensor axis when query and kv heads split alike (else heads stay whole); the sequence is never
  split, since the kernel's causal mask assumes whole rows.
  """
  mesh_rules = sharding_lib.current_mesh_rules()
  if mesh_rules is None:
    return kernel(q_BxLxHxD, k_BxLxKxD, v_BxLxKxD, mask_BxL)
  mesh, rules = mesh_rules
  q_spec = sharding_lib.logical_to_spec(mesh, rules, ("activation_batch", None, "heads", None), q_BxLxHxD.shape)
  kv_spec = sharding_lib.logical_to_spec(mesh, rules, ("activation_batch", None, "kv_heads", None),
                                         k_BxLxKxD.shape)
  if q_spec[2] != kv_spec[2]:
    q_spec = kv_spec = PartitionSpec(q_spec[0], None, None, None)
  return jax.shard_map(kernel, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, PartitionSpec(q_spec[0], None)),
                       out_specs=q_spec, check_vma=False)(q_BxLxHxD, k_BxLxKxD, v_BxLxKxD, mask_BxL)


def attend(q_BxLxHxD, k_BxLxKxD, v_BxLxKxD, mask_BxL, *, impl: str, block: int):
  """Causal attention of the uncached forward with the kernel `impl` names (see `resolve_impl`)."""
  impl = resolve_impl(impl, head_dim=q_BxLxHxD.shape[-1], dtype=q_BxLxHxD.dtype)
  if impl == "splash" and q_BxLxHxD.shape[1] < block:
    # Shorter than one of the kernel's tiles (e.g. the one-token call that creates LoRA
    # adapters): one small score matrix is the whole computation.
    impl = "full"
  if impl == "blockwise":
    return blockwise_attention(q_BxLxHxD, k_BxLxKxD, v_BxLxKxD, mask_BxL, block)
  if impl in ("xla", "cudnn"):
    return dot_product_attention(q_BxLxHxD, k_BxLxKxD, v_BxLxKxD, mask_BxL, impl)
  if impl == "splash":
    kernel = functools.partial(splash_attention, block=block)
    return _per_shard(kernel, q_BxLxHxD, k_BxLxKxD, v_BxLxKxD, mask_BxL)
  if impl == "full":
    L = q_BxLxHxD.shape[1]
    allowed_BxLxL = jnp.tril(jnp.ones((L, L), bool))[None] & (mask_BxL[:, None, :] == 1)
    return full_attention(q_BxLxHxD, k_BxLxKxD, v_BxLxKxD, allowed_BxLxL)
  raise ValueError(f"attention_impl={impl!r} is not supported; expected one of {IMPLS}")


def attend_shared_prefix(q_BxLxHxD, k_BxLxKxD, v_BxLxKxD, mask_BxL, *, prefix_len: int, group: int,
                         impl: str, block: int):
  """Causal attention over packed rows ``[prefix; suffix_1; ..; suffix_G]`` whose G suffixes each
  continue the one prefix, as if each were its own row ``[prefix; suffix_g]``.

  Row b's first ``prefix_len`` positions (P) are a prompt that the G responses of its group share;
  the remaining ``G * T`` positions are those responses, T each. A prefix query sees the causal
  prefix (the kernel ``impl`` names, as ``attend``); a suffix query sees every unmasked prefix key
  and the unmasked keys of its own suffix up to itself, never another suffix. So each output equals
  that of ``attend`` on the unpacked row ``[prefix; suffix_g]``, while the prefix's projections and
  MLP are computed once for its group instead of G times (the packed layout is the caller's:
  ``Decoder.hidden_states(shared_prefix=...)``). The suffixes' attention is one [T, P + T] score
  matrix per row and head (`full_attention`), whatever ``impl`` is: meant for responses of up to a
  few thousand tokens.
  """
  B, L, H, D = q_BxLxHxD.shape
  P, G = prefix_len, group
  if P < 1 or G < 1 or (L - P) % G:
    raise ValueError(f"attend_shared_prefix: {L} positions do not split into a prefix of {P} and "
                     f"{G} suffixes of equal length")
  T = (L - P) // G
  out_p = attend(q_BxLxHxD[:, :P], k_BxLxKxD[:, :P], v_BxLxKxD[:, :P], mask_BxL[:, :P],
                 impl=impl, block=block)

  def suffix_rows(x):  # [B, P + G*T, ...] -> [B*G, T, ...]
    return x[:, P:].reshape(B * G, T, *x.shape[2:])

  def with_prefix(x):  # [B*G, P + T, ...]: each suffix after its group's prefix
    return jnp.concatenate([jnp.repeat(x[:, :P], G, axis=0), suffix_rows(x)], axis=1)

  mask_NxS = with_prefix(mask_BxL)
  causal_TxS = jnp.arange(P + T)[None, :] <= P + jnp.arange(T)[:, None]
  allowed_NxTxS = causal_TxS[None] & (mask_NxS[:, None, :] == 1)
  out_s = full_attention(suffix_rows(q_BxLxHxD), with_prefix(k_BxLxKxD), with_prefix(v_BxLxKxD),
                         allowed_NxTxS)
  return jnp.concatenate([out_p, out_s.reshape(B, G * T, H, D)], axis=1)


def blockwise_attention(q_BxLxHxD, k_BxLxKxD, v_BxLxKxD, mask_BxL, block: int):
  """Causal grouped-query attention tile by tile with an online softmax (flash-attention style).

  Computes what the "full" path computes: keys after the query or with mask 0 get no weight, and
  a query that may see no key at all (left padding) gets the mean of all L values, as a softmax
  over a row of equal masked scores gives. Max and sum run in float32. L is padded up to a multiple
  of the tile (padded keys are masked, padded queries dropped); tiles above the diagonal are
  skipped. Both loops are checkpointed, so no more than one query tile's running state and one
  [B,H,tile,tile] score tile are live in the forward or the backward pass.
  """
  B, L, H, D = q_BxLxHxD.shape
  K = k_BxLxKxD.shape[2]
  G, dt, f32 = H // K, q_BxLxHxD.dtype, jnp.float32
  T = min(block, L)
  n = -(-L // T)

  def tiles(x):  # [B,L,...] -> [n,B,T,...]
    x = jnp.pad(x, [(0, 0), (0, n * T - L)] + [(0, 0)] * (x.ndim - 2))
    return jnp.moveaxis(x.reshape(B, n, T, *x.shape[2:]), 1, 0)

  q_tiles = tiles(q_BxLxHxD.reshape(B, L, K, G, D))
  k_tiles, v_tiles, mask_tiles = tiles(k_BxLxKxD), tiles(v_BxLxKxD), tiles(mask_BxL)
  neg, offsets, scale = jnp.finfo(f32).min, jnp.arange(T), D ** -0.5

  @jax.checkpoint
  def query_tile(args):
    q_BxTxKxGxD, qi = args

    @jax.checkpoint
    def key_tile(carry, xs):
      k_BxTxKxD, v_BxTxKxD, mask_BxT, ki = xs

      def update(carry):
        m, l, acc = carry
        s = einsum_f32("bqkgd,bskd->bkgqs", q_BxTxKxGxD, k_BxTxKxD) * scale
        causal_TxT = (qi * T + offsets)[:, None] >= (ki * T + offsets)[None, :]
        s = jnp.where((causal_TxT[None] & (mask_BxT[:, None, :] == 1))[:, None, None], s, neg)
        # The result does not depend on the running max, so no gradient flows through it.
        m_new = jax.lax.stop_gradient(jnp.maximum(m, s.max(-1)))
        p = jnp.exp(s - m_new[..., None])
        correction = jnp.exp(m - m_new)
        pv = einsum_f32("bkgqs,bskd->bkgqd", p.astype(dt), v_BxTxKxD)
        return m_new, l * correction + p.sum(-1), acc * correction[..., None] + pv

      return jax.lax.cond(ki <= qi, update, lambda c: c, carry), None

    init = (jnp.full((B, K, G, T), neg, f32), jnp.zeros((B, K, G, T), f32), jnp.zeros((B, K, G, T, D), f32))
    (_, l, acc), _ = jax.lax.scan(key_tile, init, (k_tiles, v_tiles, mask_tiles, jnp.arange(n)))
    return acc / l[..., None]  # l >= 1: a row's diagonal tile is always visited

  out = jax.lax.map(query_tile, (q_tiles, jnp.arange(n)))  # [n,B,K,G,T,D]
  out_BxLxKxGxD = out.transpose(1, 0, 4, 2, 3, 5).reshape(B, n * T, K, G, D)[:, :L]
  sees_a_key_BxL = jnp.cumsum(mask_BxL, axis=1) > 0
  mean_v_BxKxD = jnp.mean(v_BxLxKxD.astype(f32), axis=1)
  out_BxLxKxGxD = jnp.where(sees_a_key_BxL[:, :, None, None, None], out_BxLxKxGxD, mean_v_BxKxD[:, None, :, None])
  return out_BxLxKxGxD.reshape(B, L, H, D).astype(dt)
