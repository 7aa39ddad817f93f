"""Memory-efficient causal attention for long sequences (no [L, L] score matrix).

`ba_jax.model` uses it for the uncached forward when
`ModelConfig.attention_impl == "blockwise"`; the decode path keeps its cache.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


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
        s = jnp.einsum("bqkgd,bskd->bkgqs", q_BxTxKxGxD, k_BxTxKxD, preferred_element_type=f32) * scale
        causal_TxT = (qi * T + offsets)[:, None] >= (ki * T + offsets)[None, :]
        s = jnp.where((causal_TxT[None] & (mask_BxT[:, None, :] == 1))[:, None, None], s, neg)
        # The result does not depend on the running max, so no gradient flows through it.
        m_new = jax.lax.stop_gradient(jnp.maximum(m, s.max(-1)))
        p = jnp.exp(s - m_new[..., None])
        correction = jnp.exp(m - m_new)
        pv = jnp.einsum("bkgqs,bskd->bkgqd", p.astype(dt), v_BxTxKxD, preferred_element_type=f32)
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
