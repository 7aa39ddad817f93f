"""The sampler-trainer gap on the same tokens, as step metrics.

The sampler's log-probs of the tokens it drew (behaviour) and the trainer's
of the same tokens with the same parameters (old, at the step's start)
would be equal in exact arithmetic; the sampler decodes one position at a
time from a KV cache while the trainer scores every position in one
forward pass, so rounding (and, on accelerators, kernels and precision)
separates them. ``mismatch_metrics`` summarises ``rho = exp(old -
behaviour)`` over the response tokens, in total and by response-length
bucket (long responses are where the gap grows): the k3 estimate of
KL(sampler || trainer), quantiles of ``rho``, and the fraction of tokens
the configured correction truncates or masks (docs/aggregation.md).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ba_jax.loss import objectives

QUANTILES = (0.01, 0.1, 0.5, 0.9, 0.99)
LENGTH_BUCKETS = 4  # response lengths in quarters of the budget T


def _bucket_means(values_NxT, mask_NxT, bucket_N, num_buckets: int):
  """Token means of ``values`` within each length bucket (NaN: no token)."""
  one_hot_NxB = jax.nn.one_hot(bucket_N, num_buckets, dtype=jnp.float32)
  tokens_B = one_hot_NxB.T @ mask_NxT.sum(-1)
  sums_B = one_hot_NxB.T @ (values_NxT * mask_NxT).sum(-1)
  return jnp.where(tokens_B > 0, sums_B / jnp.maximum(tokens_B, 1.0),
                   jnp.nan), tokens_B


def mismatch_metrics(trainer_logp, behaviour_logp, mask, *,
                     correction: str = "none", **correction_options) -> dict:
  """Step metrics of the gap between the trainer's and the sampler's
  log-probs of the same tokens (rows: whatever the caller compared).

  ``mismatch_k3``: the token mean of ``rho - 1 - log rho`` (>= 0, 0 only
  where the two agree); ``mismatch_ratio_pXX``: quantiles of ``rho`` over
  the response tokens; ``mismatch_tokens``: how many tokens were compared;
  with a correction, ``mismatch_corrected_frac``: the fraction of tokens it
  truncates or masks (a sequence-level one counts every token of a
  corrected sequence). ``*_len{b}`` repeat the k3 mean, the 1st and 99th
  percentiles and the corrected fraction over the responses whose length
  falls in quarter ``b`` (1-4) of the budget ``T``, with
  ``mismatch_tokens_len{b}``. Undefined values (no token) are NaN.
  ``correction_options``: as ``objectives.correction_weights``.
  """
  stop = jax.lax.stop_gradient
  trainer_logp, behaviour_logp = stop(trainer_logp), stop(behaviour_logp)
  mask_NxT = jnp.asarray(mask, jnp.float32)
  T = mask_NxT.shape[1]
  log_rho = (trainer_logp - behaviour_logp) * mask_NxT
  k3_NxT = jnp.expm1(log_rho) - log_rho
  lengths_N = mask_NxT.sum(-1)
  # Bucket b holds lengths in ((b - 1) T / 4, b T / 4]; an empty row goes to 1.
  bucket_N = jnp.clip(jnp.ceil(lengths_N * LENGTH_BUCKETS / T) - 1, 0,
                      LENGTH_BUCKETS - 1).astype(jnp.int32)
  tokens = mask_NxT.sum()
  mean = lambda x: jnp.where(tokens > 0, jnp.sum(x * mask_NxT)
                             / jnp.maximum(tokens, 1.0), jnp.nan)
  out = {"mismatch_k3": mean(k3_NxT), "mismatch_tokens": tokens}
  rho = jnp.where(mask_NxT > 0, jnp.exp(log_rho), jnp.nan).reshape(-1)
  for q, value in zip(QUANTILES, jnp.nanquantile(rho, jnp.asarray(QUANTILES))):
    out[f"mismatch_ratio_p{round(q * 100):02d}"] = value
  k3_B, tokens_B = _bucket_means(k3_NxT, mask_NxT, bucket_N, LENGTH_BUCKETS)
  corrected_B = None
  if correction != "none":
    _, corrected = objectives.correction_weights(
        trainer_logp, behaviour_logp, mask_NxT, correction=correction,
        **correction_options)
    corrected_NxT = jnp.broadcast_to(corrected, mask_NxT.shape).astype(
        jnp.float32)
    out["mismatch_corrected_frac"] = mean(corrected_NxT)
    corrected_B, _ = _bucket_means(corrected_NxT, mask_NxT, bucket_N,
                                   LENGTH_BUCKETS)
  tails = jnp.asarray((QUANTILES[0], QUANTILES[-1]))
  for b in range(LENGTH_BUCKETS):
    in_bucket = jnp.repeat(bucket_N == b, T)
    low, high = jnp.nanquantile(jnp.where(in_bucket, rho, jnp.nan), tails)
    out[f"mismatch_ratio_p{round(QUANTILES[0] * 100):02d}_len{b + 1}"] = low
    out[f"mismatch_ratio_p{round(QUANTILES[-1] * 100):02d}_len{b + 1}"] = high
    out[f"mismatch_k3_len{b + 1}"] = k3_B[b]
    out[f"mismatch_tokens_len{b + 1}"] = tokens_B[b]
    if corrected_B is not None:
      out[f"mismatch_corrected_frac_len{b + 1}"] = corrected_B[b]
  return out
