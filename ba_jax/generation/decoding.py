"""What the static sampler (`ba_jax.generation.sampler`) and the continuous-batching engine
(`ba_jax.generation.engine`) share: the result type, the compiled loop's static options, and
the batch-axis sharding constraint of their rows."""
from __future__ import annotations

import dataclasses

import flax
import jax

from ba_jax.policy import compiling
from ba_jax.policy import sharding as sharding_lib


@flax.struct.dataclass
class SampleResult:
  """Responses, group-major: row n answers prompt n // group_size.

  tokens: int32 [B*G, T], pad_id after the stop token.
  logprobs: float32 [B*G, T], log-prob of each sampled token under
    softmax(logits / temperature) over the full vocabulary (before top-k /
    top-p truncation; temperature 1.0 when greedy), 0 where mask is 0.
  mask: int32 [B*G, T], 1 up to and including the stop token.
  lengths: int32 [B*G], the number of response tokens (sum of mask).
  truncated: bool [B*G], True when the row hit max_new_tokens without a stop
    token.
  """
  tokens: jax.Array
  logprobs: jax.Array
  mask: jax.Array
  lengths: jax.Array
  truncated: jax.Array


@dataclasses.dataclass(frozen=True)
class LoopConfig:
  """What the compiled program depends on (temperature and stop ids do not)."""
  group_size: int
  max_new_tokens: int
  pad_id: int
  greedy: bool
  top_k: int
  top_p: float
  # Cache lengths the decode loop runs through (1: the whole length from the start; 0: the
  # backend's default, `auto_cache_phases`); see `cache_phase_lengths`.
  cache_phases: int = 1


# Cache phases on XLA:CPU for caches of at least this many positions (see `auto_cache_phases`).
AUTO_PHASES, AUTO_PHASES_MIN_LENGTH = 8, 256


def auto_cache_phases(length: int, backend: str | None = None) -> int:
  """Phases for a `length`-position cache: `AUTO_PHASES` on CPU for long caches, else 1.

  A decode step's attention reads every position of the cache, written or not. On XLA:CPU,
  where that read is a third of a step, each step runs on the shortest of a few cache lengths
  that holds its rows (the static sampler grows its cache, `kv_cache.grow`; the engine slices
  a prefix, `kv_cache.prefix`): a step then reads ~the written part
  (experiments/benchmarks/results/engine_bench.md). Each phase compiles its own loop body, and growing or
  slicing holds up to two copies of the cache, so accelerators (where a paged or ragged
  attention kernel is the way to skip empty positions) and short caches keep one phase.
  """
  if length >= AUTO_PHASES_MIN_LENGTH and (backend or compiling.backend()) == "cpu":
    return AUTO_PHASES
  return 1


# Every cache length but the whole one is a multiple of this (16 float32 lanes, an AVX-512
# vector), so each row of the keys [B, K, D, S] is whole vectors: the static sampler's decode step
# on XLA:CPU ran ~6% faster with the same tokens, the engine's level within noise
# (experiments/benchmarks/results/engine_bench.md).
PHASE_ALIGN = 16


def cache_phase_lengths(total: int, phases: int, first: int) -> tuple[int, ...]:
  """Increasing cache lengths ending at `total`: `phases` about equal steps (0: `auto_cache_phases`),
  none below `first` (the shortest cache the loop can start on), each but `total` rounded up to a
  multiple of `PHASE_ALIGN`."""
  phases = phases or auto_cache_phases(total)
  align = lambda n: min(total, -(-n // PHASE_ALIGN) * PHASE_ALIGN)
  lengths = sorted({align(max(first, -(-total * j // phases))) for j in range(1, phases + 1)})
  return tuple(lengths)


def constrain_batch(x, mesh_rules):
  """Shards x's leading (batch) axis as the rules map "batch", where it divides."""
  if mesh_rules is None or x.ndim == 0:
    return x
  mesh, rules = mesh_rules
  logical_axes = ("batch",) + (None,) * (x.ndim - 1)
  return jax.lax.with_sharding_constraint(
      x, sharding_lib.logical_sharding(mesh, rules, logical_axes, shape=x.shape))
