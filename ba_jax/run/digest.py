"""Content digests of a train state: proof that a restored state is the one
that was saved, whatever mesh it is restored onto.

An array's digest is an additive hash (AdHash): the sum, modulo 2**32 in two
lanes, of a mixed hash of each element's bits and its index in the global
array. A sum does not care how the array is cut, so

- each shard's digest (keyed by its index in the global array, e.g.
  ``"0:16,0:32"``) is computed by the device that holds it, all arrays in one
  XLA program that reads the state once (with the count of non-finite
  values, in the same pass), and only the small sums leave the devices;
- the array's digest is the sum of its shards' and the same on any mesh: a
  restore onto the saved mesh is verified shard by shard, one onto another
  mesh array by array.

A change of one element always changes both lanes (at a fixed index, the
element's hash is a bijection of its bits); more changes escape with odds of
about 2**-64. It detects corruption (a flipped byte, a torn write, a bad
transfer), not tampering: anyone can recompute it. Indices wrap at 2**32
elements (an array larger than that still gets a digest, position-aliased).
This module knows JAX and numpy only.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

ALGORITHM = "adhash-fmix32x2-v2"


def _fmix32(h):
  """murmur3's finaliser: a bijection of uint32 that mixes every bit."""
  h = h ^ (h >> 16)
  h = h * jnp.uint32(0x85EBCA6B)
  h = h ^ (h >> 13)
  h = h * jnp.uint32(0xC2B2AE35)
  return h ^ (h >> 16)


def _bits(x):
  """The element bits as uint32, same shape (wider types folded)."""
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32)
  size = jnp.dtype(x.dtype).itemsize
  if size == 4:
    return jax.lax.bitcast_convert_type(x, jnp.uint32)
  if size in (1, 2):
    unsigned = {1: jnp.uint8, 2: jnp.uint16}[size]
    return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)
  if size == 8:
    words = jax.lax.bitcast_convert_type(x, jnp.uint32)  # [..., 2]
    return words[..., 0] ^ _fmix32(words[..., 1] + jnp.uint32(0x9E3779B9))
  raise TypeError(f"no digest for dtype {x.dtype}")


def _lanes(bits, index):
  """Each element's two hash lanes from its bits and its index in the
  global array (``_sums`` states the formula)."""
  key = index * jnp.uint32(0x9E3779B1) + jnp.uint32(0x243F6A88)
  h1 = _fmix32(bits ^ key)
  return h1, h1 * (key | jnp.uint32(1))


def _nonfinite_mask(x):
  """True at NaN and inf (never for integer and bool arrays)."""
  if jnp.issubdtype(x.dtype, jnp.inexact):
    return ~jnp.isfinite(x)
  return jnp.zeros(x.shape, bool)


def _sums(x, shape, offsets):
  """``(lanes uint32 [2], nonfinite int32)`` over ``x``, a block of an
  array of ``shape`` that starts at ``offsets`` (uint32, one per dimension).

  Element i with bits b: key = i * 0x9E3779B1 + 0x243F6A88, lane 1 =
  fmix32(b ^ key), lane 2 = lane 1 * (key | 1), both bijections of b at a
  fixed i. One variadic reduction takes both lanes and the non-finite
  count, so XLA fuses the whole chain into it and reads ``x`` once, with no
  temporary the size of the array (separate sums made XLA:CPU materialise
  the shared terms and run 40x slower)."""
  index = jnp.zeros(x.shape, jnp.uint32)
  for d, offset in enumerate(offsets):
    stride = jnp.uint32(math.prod(shape[d + 1:]) % 2**32)
    index = index + (jax.lax.broadcasted_iota(jnp.uint32, x.shape, d)
                     + offset) * stride
  h1, h2 = _lanes(_bits(x), index)
  bad = _nonfinite_mask(x).astype(jnp.int32)
  zero = jnp.uint32(0)
  s1, s2, count = jax.lax.reduce(
      (h1, h2, bad), (zero, zero, jnp.int32(0)),
      lambda a, b: (a[0] + b[0], a[1] + b[1], a[2] + b[2]),
      tuple(range(x.ndim)))
  return jnp.stack([s1, s2]), count


def _axes(entry) -> tuple[str, ...]:
  return () if entry is None else (entry,) if isinstance(entry, str) else (
      tuple(entry))


def _sharded(x, mesh, spec):
  """``(blocks, nonfinite)`` of ``x`` laid out as ``spec`` on ``mesh``:
  blocks uint32 [*shards per dimension, 2], each device summing its own
  shard (its offsets from its mesh coordinates)."""
  entries = tuple(spec) + (None,) * (x.ndim - len(spec))
  used = tuple(a for e in entries for a in _axes(e))

  def local(block):
    offsets = []
    for entry, size in zip(entries, block.shape):
      position = jnp.uint32(0)
      for axis in _axes(entry):
        position = position * jnp.uint32(mesh.shape[axis]) + (
            jax.lax.axis_index(axis).astype(jnp.uint32))
      offsets.append(position * jnp.uint32(size))
    lanes, count = _sums(block, x.shape, offsets)
    lanes = lanes.reshape((1,) * x.ndim + (2,))
    return lanes, jax.lax.psum(count, used) if used else count

  P = jax.sharding.PartitionSpec
  return jax.shard_map(local, mesh=mesh, in_specs=P(*entries),
                       out_specs=(P(*entries, None), P()))(x)


# Arrays the mesh does not cut and of at most this many elements are hashed
# together: one concatenated pass and one segmented sum instead of a chain
# of operations per array, which kept the default job's state (43 arrays)
# tracing and lowering for about 0.3 s at a run's first save.
GROUP_MAX_ELEMENTS = 1 << 20
_GROUP_TOTAL = 1 << 26  # elements per group: bounds its temporaries


def _grouped_sums(xs):
  """``_sums`` of each of ``xs`` (whole arrays), in one pass over their
  concatenation: ``(lanes uint32 [len(xs), 2], nonfinite [len(xs)])``. The
  same sums (addition mod 2**32 does not care about order), for a number of
  traced operations that barely grows with the number of arrays."""
  bits = jnp.concatenate([_bits(x).reshape(-1) for x in xs])
  index = jnp.concatenate([jax.lax.iota(jnp.uint32, x.size) for x in xs])
  segment = jnp.concatenate([jnp.full((x.size,), i, jnp.int32)
                             for i, x in enumerate(xs)])
  bad = jnp.concatenate([_nonfinite_mask(x).reshape(-1) for x in xs])
  h1, h2 = _lanes(bits, index)
  sums = jax.ops.segment_sum(
      jnp.stack([h1, h2, bad.astype(jnp.uint32)], axis=1), segment,
      num_segments=len(xs), indices_are_sorted=True)
  return sums[:, :2], sums[:, 2]


def _auto_axes(spec, mesh) -> bool:
  """Whether every mesh axis ``spec`` names is of type Auto (reshaping an
  array laid out over an Explicit axis needs its output's layout)."""
  if spec is None:
    return True
  types = dict(zip(mesh.axis_names, mesh.axis_types))
  return all(types[a] == jax.sharding.AxisType.Auto
             for entry in spec for a in _axes(entry))


def _groups(leaves, specs, mesh) -> list[list[int]]:
  """Indices of the leaves hashed together (uncut, small), in groups of at
  most ``_GROUP_TOTAL`` elements."""
  groups, total = [[]], 0
  for i, (x, spec) in enumerate(zip(leaves, specs)):
    size = math.prod(np.shape(x))
    if (size > GROUP_MAX_ELEMENTS or math.prod(_cuts(np.ndim(x), spec, mesh)) > 1
        or not _auto_axes(spec, mesh)):
      continue
    if total + size > _GROUP_TOTAL:
      groups.append([])
      total = 0
    groups[-1].append(i)
    total += size
  return [g for g in groups if g]


def _program(leaves, specs, mesh):
  """Every leaf's shard sums, then its non-finite count, in one uint32
  vector (one transfer to the host, not two per array)."""
  blocks, counts = [None] * len(leaves), [None] * len(leaves)
  for group in _groups(leaves, specs, mesh):
    lanes, count = _grouped_sums([leaves[i] for i in group])
    for row, i in enumerate(group):
      blocks[i], counts[i] = lanes[row], count[row].reshape(1)
  for i, (x, spec) in enumerate(zip(leaves, specs)):
    if blocks[i] is not None:
      continue
    if spec is None:  # on one device (or not a NamedSharding): one block
      lanes, count = _sums(x, x.shape, [jnp.uint32(0)] * x.ndim)
    else:
      lanes, count = _sharded(x, mesh, spec)
    blocks[i] = lanes.reshape(-1)
    counts[i] = count.astype(jnp.uint32).reshape(1)
  return jnp.concatenate(blocks + counts)


@functools.lru_cache(maxsize=16)
def _jitted(mesh):
  replicated = (None if mesh is None else jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec()))
  return jax.jit(functools.partial(_program, mesh=mesh), static_argnums=1,
                 out_shardings=replicated)


def _name(path) -> str:
  """orbax's name for a leaf: ``opt_state.1.0.mu.embed_tokens.value``."""
  parts = []
  for key in path:
    for attr in ("key", "idx", "name"):
      if hasattr(key, attr):
        parts.append(str(getattr(key, attr)))
        break
    else:
      parts.append(str(key))
  return ".".join(parts)


def _spec(x, mesh):
  """x's PartitionSpec when it is laid out on ``mesh``, else None."""
  sharding = getattr(x, "sharding", None)
  if isinstance(sharding, jax.sharding.NamedSharding) and sharding.mesh == mesh:
    return sharding.spec
  return None


def _cuts(ndim: int, spec, mesh) -> tuple[int, ...]:
  """How many shards ``spec`` cuts each dimension into on ``mesh``."""
  if spec is None:
    return (1,) * ndim
  entries = tuple(spec) + (None,) * (ndim - len(spec))
  return tuple(math.prod(mesh.shape[a] for a in _axes(e)) for e in entries)


def _hex(lanes) -> str:
  return f"{int(lanes[0]):08x}{int(lanes[1]):08x}"


def _shard_key(block: tuple[int, ...], shard_shape: tuple[int, ...]) -> str:
  return ",".join(f"{b * s}:{(b + 1) * s}" for b, s in zip(block, shard_shape))


@dataclasses.dataclass(frozen=True)
class ArrayDigest:
  """One array's digests (16 hex digits each) and its non-finite count."""
  digest: str  # the whole array's: the same on any mesh
  shards: dict[str, str]  # shard index ("start:stop,...") -> its digest
  nonfinite: int  # NaN and inf values (0 for integer arrays)


def digests(tree: Any) -> dict[str, ArrayDigest]:
  """``{orbax name: ArrayDigest}`` of every array of ``tree``: one program
  over the devices' own shards; only the sums come back to the host."""
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  if not flat:
    return {}
  leaves = [x for _, x in flat]
  mesh = next((x.sharding.mesh for x in leaves if isinstance(
      getattr(x, "sharding", None), jax.sharding.NamedSharding)), None)
  specs = tuple(_spec(x, mesh) for x in leaves)
  sums = np.asarray(jax.device_get(_jitted(mesh)(leaves, specs)), np.uint32)
  counts = sums[-len(leaves):]
  out, start = {}, 0
  for (path, x), spec, nonfinite in zip(flat, specs, counts):
    cuts = _cuts(np.ndim(x), spec, mesh)
    blocks = sums[start:start + 2 * math.prod(cuts)].reshape(cuts + (2,))
    start += blocks.size
    shard_shape = tuple(n // k for n, k in zip(np.shape(x), cuts))
    total = blocks.reshape(-1, 2).sum(axis=0, dtype=np.uint32)  # wraps
    out[_name(path)] = ArrayDigest(
        _hex(total), {_shard_key(b, shard_shape): _hex(blocks[b])
                      for b in np.ndindex(*cuts)}, int(nonfinite))
  return out


def to_json(table: dict[str, ArrayDigest]) -> dict:
  """What a checkpoint stores (the non-finite counts are checked afresh)."""
  return {"algorithm": ALGORITHM,
          "arrays": {name: {"digest": d.digest, "shards": d.shards}
                     for name, d in table.items()}}


def _listed(problems: list[str], what: str) -> str:
  more = len(problems) - 1
  return problems[0] + (f" (and {more} more {what})" if more else "")


def mismatch(restored: dict[str, ArrayDigest], saved: dict) -> str | None:
  """Where ``restored`` differs from the ``saved`` table (``to_json``'s),
  on one line; None when it matches. Shard by shard when the restore cut
  each array as the save did, else array by array."""
  if saved.get("algorithm") != ALGORITHM:
    return (f"digest table of algorithm {saved.get('algorithm')!r}; this "
            f"version reads {ALGORITHM!r}")
  arrays = saved.get("arrays", {})
  if set(arrays) != set(restored):
    odd = sorted(set(arrays) ^ set(restored))
    return (f"digest table names other arrays than the state: "
            f"{', '.join(odd[:3])}" + (" ..." if len(odd) > 3 else ""))
  problems = []
  for name, got in restored.items():
    want = arrays[name]
    if set(want["shards"]) == set(got.shards):
      bad = [k for k, v in got.shards.items() if v != want["shards"][k]]
      if bad:
        problems.append(f"{name} shard [{bad[0]}]" + (
            f" and {len(bad) - 1} more of its shards" if len(bad) > 1 else ""))
    elif got.digest != want["digest"]:
      problems.append(f"{name} (whole array: restored on another mesh)")
  if problems:
    return "digest mismatch: " + _listed(problems, "arrays")
  return None


def nonfinite(restored: dict[str, ArrayDigest]) -> str | None:
  """The arrays holding NaN or inf, on one line; None when none does."""
  problems = [f"{d.nonfinite} in {name}" for name, d in restored.items()
              if d.nonfinite]
  if problems:
    return "non-finite values (NaN or inf): " + _listed(problems, "arrays")
  return None
