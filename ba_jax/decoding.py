"""What the static sampler (`ba_jax.sampler`) and the continuous-batching engine
(`ba_jax.engine`) share: the result type, the compiled loop's static options, and
the batch-axis sharding constraint of their rows."""
from __future__ import annotations

import dataclasses

import flax
import jax

from ba_jax import sharding as sharding_lib


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


def constrain_batch(x, mesh_rules):
  """Shards x's leading (batch) axis as the rules map "batch", where it divides."""
  if mesh_rules is None or x.ndim == 0:
    return x
  mesh, rules = mesh_rules
  logical_axes = ("batch",) + (None,) * (x.ndim - 1)
  return jax.lax.with_sharding_constraint(
      x, sharding_lib.logical_sharding(mesh, rules, logical_axes, shape=x.shape))
