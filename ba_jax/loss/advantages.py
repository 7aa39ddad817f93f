"""Group-relative advantages: A = (R - mean_g R) / (std R + eps)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ba_jax.loss.aggregation import check_option

STD_MODES = ("group", "batch", "none")


def group_advantages(rewards, group_size: int, *, std: str = "group",
                     eps: float = 1e-6):
  """Advantages for group-major rewards [N] (sequence n is in group n // G).

  Args:
    rewards: [N] scalar rewards.
    group_size: G.
    std: ``"group"`` divides by the unbiased std within the group (GRPO);
      ``"batch"`` by the unbiased std over the whole batch; ``"none"`` does not
      divide (Dr. GRPO).
    eps: added to the std.

  A group whose rewards are all equal gets advantage 0 (never NaN); a group of
  one response has no spread and also gets 0.
  """
  check_option("advantage std", std, STD_MODES)
  rewards_N = jnp.asarray(rewards, jnp.float32)
  if rewards_N.ndim != 1:
    raise ValueError(f"rewards must be [N]; got shape {rewards_N.shape}.")
  n = rewards_N.shape[0]
  if not isinstance(group_size, int) or group_size < 1 or n % group_size:
    raise ValueError(
        f"group_size must be a positive int dividing N={n}; got {group_size!r}.")
  if group_size == 1:
    return jnp.zeros_like(rewards_N)
  return _group_advantages(rewards_N, eps, group_size=group_size, std=std)


@functools.partial(jax.jit, static_argnames=("group_size", "std"))
def _group_advantages(rewards_N, eps, *, group_size: int, std: str):
  """`group_advantages` for G > 1 (one program, not a dispatch per op)."""
  n = rewards_N.shape[0]
  rewards_GxS = rewards_N.reshape(-1, group_size)
  centred = rewards_GxS - rewards_GxS.mean(-1, keepdims=True)
  if std == "group":
    scale = jnp.std(rewards_GxS, axis=-1, ddof=1, keepdims=True) + eps
  elif std == "batch":
    scale = (jnp.std(rewards_N, ddof=1) + eps) if n > 1 else 1.0 + eps
  else:
    scale = 1.0
  # A constant group carries no signal: exactly 0, whatever rounding left in
  # `centred` and even with eps == 0.
  constant = jnp.max(rewards_GxS, -1, keepdims=True) == jnp.min(
      rewards_GxS, -1, keepdims=True)
  safe_scale = jnp.where(constant, 1.0, scale)
  advantages = jnp.where(constant, 0.0, centred / safe_scale)
  return advantages.reshape(n)
