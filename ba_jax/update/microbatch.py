"""Exact gradient accumulation over micro-batches.

Aggregation weights are computed once on the whole PPO mini-batch; each
micro-batch then contributes ``sum(w * l)`` and the parts are summed, never
averaged again (docs/aggregation.md). So the loss and the gradient do not
depend on how many micro-batches the mini-batch is split into.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from ba_jax.loss import aggregation as agg
from ba_jax.policy import sharding as sharding_lib


def mini_batch_weights(mask, advantages, *, aggregation: str, group_size: int,
                       reg_aggregation: str = "token", **options) -> dict:
  """Policy and regulariser weights for a whole mini-batch, to be split."""
  weights = agg.token_weights(mask, advantages, mode=aggregation,
                              group_size=group_size, **options)
  reg_weights = agg.token_weights(mask, advantages, mode=reg_aggregation,
                                  group_size=group_size, **options)
  return {"weights": weights, "reg_weights": reg_weights}


def split_micro_batches(batch: Any, num_micro_batches: int) -> Any:
  """Reshapes every leaf [N, ...] to [k, N // k, ...] (contiguous rows)."""
  leaves = jax.tree.leaves(batch)
  n = leaves[0].shape[0]
  if num_micro_batches < 1 or n % num_micro_batches:
    raise ValueError(
        f"num_micro_batches must be a positive divisor of the mini-batch size "
        f"{n}; got {num_micro_batches!r}.")
  for leaf in leaves:
    if leaf.shape[:1] != (n,):
      raise ValueError(
          f"every batch array must have leading size {n}; got {leaf.shape}.")
  # Inside a mesh context, each micro-batch's rows stay split over the batch
  # mesh axes (not the micro-batch axis, which the scan walks).
  return jax.tree.map(
      lambda x: sharding_lib.constrain(
          x.reshape(num_micro_batches, n // num_micro_batches, *x.shape[1:]),
          (None, "activation_batch") + (None,) * (x.ndim - 1)), batch)


def combine_metrics(metrics_k: dict) -> dict:
  """Reduces metrics stacked over micro-batches (leading axis k).

  ``w_*``, ``*_sum`` and ``num_tokens`` add; ``*_min``/``*_max`` take the
  min/max; ``rows_*`` (per-row arrays) are concatenated back into the
  mini-batch's rows; everything else is a mean weighted by each part's
  ``num_tokens`` (a plain mean when that is absent or zero).
  """
  tokens_k = metrics_k.get("num_tokens")
  combined = {}
  for name, values in metrics_k.items():
    if name.startswith("rows_"):
      combined[name] = values.reshape(-1, *values.shape[2:])
    elif name.startswith("w_") or name.endswith("_sum") or name == "num_tokens":
      combined[name] = jnp.sum(values, axis=0)
    elif name.endswith("_min"):
      combined[name] = jnp.min(values, axis=0)
    elif name.endswith("_max"):
      combined[name] = jnp.max(values, axis=0)
    elif tokens_k is None:
      combined[name] = jnp.mean(values, axis=0)
    else:
      total = jnp.sum(tokens_k)
      weighted = jnp.sum(values * tokens_k, axis=0) / jnp.maximum(total, 1.0)
      combined[name] = jnp.where(total > 0, weighted, jnp.mean(values, axis=0))
  return combined


def accumulate_gradients(loss_fn: Callable, params: Any, batch: Any, *,
                         num_micro_batches: int, key=None):
  """Sum of ``loss_fn`` and its gradient over micro-batches.

  Args:
    loss_fn: ``loss_fn(params, micro_batch) -> (loss, metrics)`` where the
      loss is this part's share of the mini-batch loss (``sum(w * l)`` with
      weights precomputed on the whole mini-batch, e.g. by
      ``mini_batch_weights``).
    params: the pytree to differentiate.
    batch: pytree of arrays with a leading axis N.
    num_micro_batches: k, a divisor of N; run sequentially with ``lax.scan``.
    key: None, or a PRNG key: ``loss_fn`` is then called as
      ``loss_fn(params, micro_batch, fold_in(key, i))`` for micro-batch i.

  Returns:
    ``(loss, grads, metrics)``, the loss and gradient summed over the parts.
  """
  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
  part = lambda micro_batch, micro_key: grad_fn(
      params, micro_batch, *(() if micro_key is None else (micro_key,)))
  keys = None if key is None else jax.vmap(lambda i: jax.random.fold_in(key, i))(
      jnp.arange(num_micro_batches))
  if num_micro_batches == 1:
    (loss, metrics), grads = part(batch, None if keys is None else keys[0])
    return loss, grads, metrics
  micro_batches = split_micro_batches(batch, num_micro_batches)

  def step(carry, xs):
    loss_sum, grad_sum = carry
    (loss, metrics), grads = part(*xs)
    grad_sum = jax.tree.map(lambda s, g: s + g.astype(jnp.float32), grad_sum,
                            grads)
    return (loss_sum + loss, grad_sum), metrics

  # Accumulate in float32 even for bfloat16 parameters, cast back at the end.
  zeros = jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), params)
  (loss, grads), metrics_k = jax.lax.scan(
      step, (jnp.zeros((), jnp.float32), zeros), (micro_batches, keys))
  grads = jax.tree.map(lambda g, p: g.astype(jnp.result_type(p)), grads, params)
  return loss, grads, combine_metrics(metrics_k)
