"""The decode KV cache: layout, writes at a shared or per-row position, slot reset.

Layout per layer: keys `[B, num_kv_heads, head_dim, S]` and values
`[B, num_kv_heads, S, head_dim]` (the kv-head axis before the sequence axis, so
a decode step's attention reads each head's entries contiguously: 30-43%
faster than `[B, S, K, D]` on CPU). Keys are stored transposed so that
both attention matmuls (q.K and p.V) contract a row-major operand's leading
axis: XLA:CPU ran `einsum("bkgd,bksd->bkgs")` ~14x slower than the same
product against `[B, K, D, S]` keys (23.0 vs 1.6 ms for 128 rows x 287
positions, 4 kv heads of 64: experiments/benchmarks/results/engine_bench.md). That is
XLA:CPU's layout only: for an accelerator (`compiling.backend()`) the keys are `[B, K, S, D]`
like the values (`key_axes`), since XLA:TPU keeps them in its own layout and
copied transposed keys into it every engine step. Then a mask
`[B, S]` (1 where a real token was written) and `index`, the next slot to write:

- a scalar: every row writes at the same position (the static sampler, which
  prefills and decodes all rows in lockstep); one `dynamic_update_slice`.
- int32 `[B]`: each row (decode slot) has its own length, as in the
  continuous-batching engine where a slot is refilled with a new prompt while
  the others decode on; the writes are a per-row `dynamic_update_slice` (vmap).

On a mesh (`constrain`, `CACHE_AXES`) the rows (slots) are split over the axes that
the logical name "batch" maps to and the kv heads over those of "kv_heads" (the
tensor axis, as the k/v projections that fill them), each where it divides; the
mask and index follow the rows. `bytes_per_device` and `slots_for_budget` count
that layout.

Attention reads every position of the cache, written or not, so a decode loop may
run on a shorter cache while its rows are short: the static sampler starts short and
`grow`s it (zero padding at the end of the sequence axes); the engine decodes on a
`prefix` and writes it back with `put_prefix` (`decoding.cache_phase_lengths`).

A write never checks bounds inside a trace: `dynamic_update_slice` clamps the
start, so a slot that runs past `S` overwrites its own last position. The
engine only lets idle slots get there, and their mask is reset on refill.
"""
from __future__ import annotations

import math

import flax
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from ba_jax.policy import compiling
from ba_jax.policy import sharding as sharding_lib


@flax.struct.dataclass
class KVCache:
  """Per-layer keys [B,num_kv_heads,head_dim,S] (`key_axes`) and values [B,num_kv_heads,S,head_dim]; mask [B,S];
  index = next slot ([] or [B])."""
  k: tuple
  v: tuple
  mask: jax.Array
  index: jax.Array


def key_axes() -> str:
  """The keys' layout for the platform being built for (`compiling.backend()`): "bkds" (sequence
  last, see the module docstring) on XLA:CPU; "bksd", the values' layout, on accelerators, whose
  compilers lay a decode step's keys out their own way: XLA:TPU copied every layer's [B,K,D,S]
  keys into that layout once per engine step, a second cache-sized buffer per layer."""
  return "bkds" if compiling.backend() == "cpu" else "bksd"


def key_seq_axis() -> int:
  """The sequence axis of the keys (`key_axes`)."""
  return key_axes().index("s")


def init_cache(config, batch_size: int, max_len: int, dtype=None, *, per_row: bool = False) -> KVCache:
  """An empty cache of `max_len` positions per row; `per_row` gives each row its own write index."""
  dtype = jnp.dtype(dtype or config.dtype)
  k_shape = ((batch_size, config.num_kv_heads, config.head_dim, max_len) if key_axes() == "bkds"
             else (batch_size, config.num_kv_heads, max_len, config.head_dim))
  v_shape = (batch_size, config.num_kv_heads, max_len, config.head_dim)
  index = jnp.zeros((batch_size,) if per_row else (), jnp.int32)
  return KVCache(k=tuple(jnp.zeros(k_shape, dtype) for _ in range(config.num_layers)),
                 v=tuple(jnp.zeros(v_shape, dtype) for _ in range(config.num_layers)),
                 mask=jnp.zeros((batch_size, max_len), jnp.int32), index=index)


# Logical axes of a cache's leaves (keys/values, mask, per-row index).
CACHE_AXES = dict(kv=("batch", "kv_heads", None, None), mask=("batch", None), index=("batch",))


def constrain(cache: KVCache, mesh_rules) -> KVCache:
  """Pins a cache to its layout on `mesh_rules = (mesh, rules)` (unchanged when None)."""
  if mesh_rules is None:
    return cache
  mesh, rules = mesh_rules

  def pin(x, axes):
    if x.ndim == 0:
      return x
    return jax.lax.with_sharding_constraint(
        x, sharding_lib.logical_sharding(mesh, rules, axes, shape=x.shape))
  return KVCache(k=tuple(pin(x, CACHE_AXES["kv"]) for x in cache.k),
                 v=tuple(pin(x, CACHE_AXES["kv"]) for x in cache.v),
                 mask=pin(cache.mask, CACHE_AXES["mask"]), index=pin(cache.index, CACHE_AXES["index"]))


def cache_bytes(config, slots: int, max_len: int, dtype=None) -> int:
  """Bytes of a cache of `slots` rows x `max_len` positions (keys, values and mask)."""
  itemsize = jnp.dtype(dtype or config.dtype).itemsize
  kv = 2 * config.num_layers * slots * config.num_kv_heads * max_len * config.head_dim * itemsize
  return kv + slots * max_len * 4


def slot_shards(mesh, rules) -> int:
  """Devices the slots are split over: those of the mesh axes "batch" maps to (1 without a mesh)."""
  if mesh is None:
    return 1
  spec = sharding_lib.logical_to_spec(mesh, rules, ("batch",))[0]
  axes = () if spec is None else (spec,) if isinstance(spec, str) else spec
  return math.prod(mesh.shape[a] for a in axes)


def bytes_per_device(config, slots: int, max_len: int, dtype=None, *, mesh=None, rules=None) -> int:
  """Bytes of keys, values and mask that one device holds of a cache of `slots` rows (all
  processes) in the layout `constrain` pins; `cache_bytes` without a mesh. A mesh axis that does
  not divide its dimension leaves it whole on every device (e.g. slots not a multiple of
  `slot_shards`: every device holds every slot)."""
  if mesh is None:
    return cache_bytes(config, slots, max_len, dtype)
  rules = sharding_lib.DEFAULT_RULES if rules is None else rules
  kv_shape = (slots, config.num_kv_heads, max_len, config.head_dim)
  mask_shape = (slots, max_len)
  shard = lambda shape, axes: math.prod(
      sharding_lib.logical_sharding(mesh, rules, axes, shape=shape).shard_shape(shape))
  itemsize = jnp.dtype(dtype or config.dtype).itemsize
  return (2 * config.num_layers * itemsize * shard(kv_shape, CACHE_AXES["kv"])
          + 4 * shard(mask_shape, CACHE_AXES["mask"]))


def slots_for_budget(config, budget_bytes: int, max_len: int, dtype=None, *, mesh=None,
                     rules=None) -> int:
  """The most slots of `max_len` positions whose cache fits in `budget_bytes`.

  Without a mesh the budget is the whole cache's (keys, values, mask). With one it is per
  device, and the answer is the slot count of the whole mesh: `slot_shards` times the
  slots each batch shard holds (so they split evenly), kv heads split over the tensor axis
  where it divides them (`bytes_per_device`).
  """
  if mesh is None:
    per_slot, shards = cache_bytes(config, 1, max_len, dtype), 1
  else:
    shards = slot_shards(mesh, rules if rules is not None else sharding_lib.DEFAULT_RULES)
    per_slot = bytes_per_device(config, shards, max_len, dtype, mesh=mesh, rules=rules)
  slots = int(budget_bytes) // per_slot
  if slots < 1:
    raise ValueError(f"KV-cache budget {budget_bytes} bytes holds no slot of {max_len} positions"
                     f" ({per_slot} bytes each{' per device' if mesh is not None else ''});"
                     " raise the budget or lower the lengths")
  return slots * shards


def check_capacity(cache: KVCache, new_tokens: int) -> None:
  """Raises if writing `new_tokens` would run past the cache (only when the index is concrete)."""
  if isinstance(cache.index, jax.core.Tracer):
    return
  S = cache.mask.shape[1]
  top = int(np.max(np.asarray(cache.index)))
  if top + new_tokens > S:
    raise ValueError(f"cache overflow: index {top} + {new_tokens} new tokens > {S} cache slots")


def _write_rows(buffer, update, index_B, axis: int):
  """buffer[b, ..., index_B[b] : index_B[b]+L (on `axis`), ...] = update[b] for every row b."""
  def one(buf, upd, i):
    start = [0] * buf.ndim
    start[axis - 1] = i
    return jax.lax.dynamic_update_slice(buf, upd, start)
  return jax.vmap(one)(buffer, update, index_B)


def write_kv(cache_k, cache_v, k_BxLxKxD, v_BxLxKxD, index):
  """Writes a step's keys/values [B,L,K,D] into one layer's [B,K,D,S] keys and [B,K,S,D] values
  at `index`."""
  seq = key_seq_axis()
  k = k_BxLxKxD.transpose((0, 2, 3, 1) if seq == 3 else (0, 2, 1, 3)).astype(cache_k.dtype)
  v = v_BxLxKxD.transpose(0, 2, 1, 3).astype(cache_v.dtype)
  if jnp.ndim(index) == 0:
    k_start = tuple(index if a == seq else 0 for a in range(4))
    return (jax.lax.dynamic_update_slice(cache_k, k, k_start),
            jax.lax.dynamic_update_slice(cache_v, v, (0, 0, index, 0)))
  return _write_rows(cache_k, k, index, axis=seq), _write_rows(cache_v, v, index, axis=2)


def extend(cache: KVCache, mask_BxL):
  """The cache's mask with `mask_BxL` written at `index`, and what the new tokens may attend to.

  Returns `(new_mask_BxS, allowed_BxLxS, already_B)`: `allowed` is causal within
  each row (a token sees the positions up to its own) and masks unwritten and
  padded positions; `already_B` counts the real tokens before the new ones (the
  RoPE offset of each row).
  """
  B, L = mask_BxL.shape
  S = cache.mask.shape[1]
  index = cache.index
  if jnp.ndim(index) == 0:
    new_mask_BxS = jax.lax.dynamic_update_slice(cache.mask, mask_BxL, (0, index))
    index_B = jnp.broadcast_to(index, (B,))
  else:
    new_mask_BxS = _write_rows(cache.mask, mask_BxL, index, axis=1)
    index_B = index
  # Only positions before the write index count: a refilled slot's later positions may still
  # hold its last row's mask where the refill ran on a cache prefix (engine._phase_loop).
  position_S = jnp.arange(S)
  already_B = jnp.sum(jnp.where(position_S[None, :] < index_B[:, None], cache.mask, 0), axis=1)
  slot_BxL = index_B[:, None] + jnp.arange(L)[None, :]
  allowed_BxLxS = (position_S[None, None, :] <= slot_BxL[:, :, None]) & (new_mask_BxS[:, None, :] == 1)
  return new_mask_BxS, allowed_BxLxS, already_B


def advance(cache: KVCache, k: tuple, v: tuple, new_mask_BxS, length: int) -> KVCache:
  """The cache after a call that wrote `length` tokens per row."""
  return KVCache(k=tuple(k), v=tuple(v), mask=new_mask_BxS, index=cache.index + length)


def grow(cache: KVCache, length: int) -> KVCache:
  """The cache with room for `length` positions per row: the new positions empty (mask 0)."""
  extra = length - cache.mask.shape[1]
  if extra < 0:
    raise ValueError(f"cannot grow a cache of {cache.mask.shape[1]} positions to {length}")
  pad = lambda x, axis: jnp.pad(x, [(0, extra if a == axis else 0) for a in range(x.ndim)])
  return KVCache(k=tuple(pad(x, key_seq_axis()) for x in cache.k), v=tuple(pad(x, 2) for x in cache.v),
                 mask=pad(cache.mask, 1), index=cache.index)


def prefix(cache: KVCache, length: int) -> KVCache:
  """The cache's first `length` positions of every row (a copy); `put_prefix` writes them back."""
  take = lambda x, axis: jax.lax.slice_in_dim(x, 0, length, axis=axis)
  return KVCache(k=tuple(take(x, key_seq_axis()) for x in cache.k), v=tuple(take(x, 2) for x in cache.v),
                 mask=cache.mask[:, :length], index=cache.index)


def put_prefix(cache: KVCache, part: KVCache) -> KVCache:
  """`cache` with its first positions replaced by `part` (from `prefix`), and `part`'s index."""
  put = lambda big, small: jax.lax.dynamic_update_slice(big, small, (0,) * big.ndim)
  return KVCache(k=tuple(put(a, b) for a, b in zip(cache.k, part.k)),
                 v=tuple(put(a, b) for a, b in zip(cache.v, part.v)),
                 mask=put(cache.mask, part.mask), index=part.index)


def fill_slots(cache: KVCache, slots_R, prefill: KVCache, mesh_rules=None) -> KVCache:
  """Resets slots `slots_R` and copies a prefilled [R, ..., P, ...] cache into their first P positions.

  An entry of `slots_R` equal to the slot count (out of range) is dropped, so a
  fixed-width refill can carry idle lanes. The slot's later positions keep stale
  keys/values under a zero mask. Where `cache` is a prefix of a longer cache (the
  engine's phases), the positions past the prefix keep the last row's mask too:
  `extend` reads only positions before a row's index (causal attention, RoPE
  offsets), so neither is ever seen.

  With `mesh_rules` (the cache laid out as `constrain` pins it) each device
  writes only the slots it holds (`jax.shard_map`): a scatter of replicated
  slot indices into a slot-sharded cache is otherwise partitioned by gathering
  the whole cache onto every device, one layer after another (on XLA:TPU, the
  7B config's engine held several all-gathered layers of every slot at once).
  """
  if mesh_rules is None:
    return _fill_local(cache, slots_R, prefill)
  mesh, rules = mesh_rules
  cache = cache.replace(index=jnp.broadcast_to(cache.index, cache.mask.shape[:1]))
  spec = lambda x, axes: sharding_lib.logical_to_spec(mesh, rules, axes, shape=x.shape)
  cache_specs = KVCache(k=tuple(spec(x, CACHE_AXES["kv"]) for x in cache.k),
                        v=tuple(spec(x, CACHE_AXES["kv"]) for x in cache.v),
                        mask=spec(cache.mask, CACHE_AXES["mask"]),
                        index=spec(cache.index, CACHE_AXES["index"]))
  # The prefill is replicated over the slots' axes; its kv heads split as the cache's.
  prefill_specs = KVCache(k=tuple(PartitionSpec(None, *sp[1:]) for sp in cache_specs.k),
                          v=tuple(PartitionSpec(None, *sp[1:]) for sp in cache_specs.v),
                          mask=PartitionSpec(), index=PartitionSpec())
  slot_axes = cache_specs.mask[0] if len(cache_specs.mask) else None
  slot_axes = () if slot_axes is None else (slot_axes,) if isinstance(slot_axes, str) else tuple(slot_axes)

  def local(cache_l, slots, prefill_l):
    held = cache_l.mask.shape[0]
    first = jax.lax.axis_index(slot_axes) * held if slot_axes else 0
    mine = (slots >= first) & (slots < first + held)
    return _fill_local(cache_l, jnp.where(mine, slots - first, held), prefill_l)

  return jax.shard_map(local, mesh=mesh, in_specs=(cache_specs, PartitionSpec(), prefill_specs),
                       out_specs=cache_specs, check_vma=False)(cache, slots_R, prefill)


def _fill_local(cache: KVCache, slots_R, prefill: KVCache) -> KVCache:
  M, S = cache.mask.shape
  P = prefill.mask.shape[1]
  if key_seq_axis() == 3:
    put_k = lambda big, small: big.at[slots_R, :, :, :P].set(small.astype(big.dtype), mode="drop")
  else:
    put_k = lambda big, small: big.at[slots_R, :, :P].set(small.astype(big.dtype), mode="drop")
  put_v = lambda big, small: big.at[slots_R, :, :P].set(small.astype(big.dtype), mode="drop")
  mask_RxS = jnp.pad(prefill.mask, ((0, 0), (0, S - P)))
  index_R = jnp.broadcast_to(prefill.index, slots_R.shape).astype(jnp.int32)
  index = jnp.broadcast_to(cache.index, (M,)).at[slots_R].set(index_R, mode="drop")
  return KVCache(k=tuple(put_k(a, b) for a, b in zip(cache.k, prefill.k)),
                 v=tuple(put_v(a, b) for a, b in zip(cache.v, prefill.v)),
                 mask=cache.mask.at[slots_R].set(mask_RxS, mode="drop"), index=index)
