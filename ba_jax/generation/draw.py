"""Drawing one token per row from logits: inverse CDF (sampling) and argmax (greedy).

Both are two-level on large vocabularies: XLA:CPU's cumsum over 32k entries (an
associative scan) and its variadic-reduce argmax cost 5-30x more than a reduction
per 256-entry block followed by the same work inside the one chosen block
(`experiments/benchmarks/results/engine_bench.md`).
"""
import jax
import jax.numpy as jnp

_BLOCK = 256


def _blocks(x_NxV: jax.Array, fill) -> jax.Array:
  N, V = x_NxV.shape
  nb = -(-V // _BLOCK)
  return jnp.pad(x_NxV, ((0, 0), (0, nb * _BLOCK - V)), constant_values=fill).reshape(N, nb, _BLOCK)


def _cumsum(x_NxK: jax.Array) -> jax.Array:
  """Inclusive cumsum as a triangular matmul (fast on every backend; full float32)."""
  upper_KxK = jnp.triu(jnp.ones((x_NxK.shape[1],) * 2, x_NxK.dtype))
  return jnp.matmul(x_NxK, upper_KxK, precision=jax.lax.Precision.HIGHEST)


def _argmax(x_NxV: jax.Array) -> jax.Array:
  """First index of each row's maximum, as `jnp.argmax`, via block maxima."""
  if x_NxV.shape[1] <= 2 * _BLOCK:
    return jnp.argmax(x_NxV, axis=-1).astype(jnp.int32)
  b_NxBxK = _blocks(x_NxV, -jnp.inf)
  block_N = jnp.argmax(jnp.max(b_NxBxK, axis=-1), axis=-1).astype(jnp.int32)
  inner_NxK = jnp.take_along_axis(b_NxBxK, block_N[:, None, None], axis=1)[:, 0]
  return block_N * _BLOCK + jnp.argmax(inner_NxK, axis=-1).astype(jnp.int32)


def _inverse_cdf(probs_NxK: jax.Array, u_N: jax.Array):
  """Index drawn from each row's (unnormalised) probabilities, one uniform each.

  Returns `(index_N, total_N)`, total being the row's summed mass.

  An entry of probability 0 is never returned: the target stays strictly below
  the row total, the first cdf entry above it has positive mass, and a
  rounding gap inside the chosen block is closed onto its last positive entry.
  """
  if probs_NxK.shape[1] <= 2 * _BLOCK:
    cdf_NxK = _cumsum(probs_NxK)
    total_N = cdf_NxK[:, -1]
    target_N = jnp.minimum(u_N * total_N, jnp.nextafter(total_N, 0.0))
    return jnp.sum(cdf_NxK <= target_N[:, None], axis=-1, dtype=jnp.int32), total_N
  b_NxBxK = _blocks(probs_NxK, 0.0)
  block_cdf_NxB = _cumsum(jnp.sum(b_NxBxK, axis=-1))
  total_N = block_cdf_NxB[:, -1]
  target_N = jnp.minimum(u_N * total_N, jnp.nextafter(total_N, 0.0))
  block_N = jnp.sum(block_cdf_NxB <= target_N[:, None], axis=-1, dtype=jnp.int32)
  before_N = jnp.take_along_axis(block_cdf_NxB, jnp.maximum(block_N - 1, 0)[:, None], axis=-1)[:, 0]
  before_N = jnp.where(block_N > 0, before_N, 0.0)
  inner_NxK = jnp.take_along_axis(b_NxBxK, block_N[:, None, None], axis=1)[:, 0]
  inner_N = jnp.sum(_cumsum(inner_NxK) <= (target_N - before_N)[:, None], axis=-1, dtype=jnp.int32)
  last_positive_N = _BLOCK - 1 - jnp.argmax(inner_NxK[:, ::-1] > 0, axis=-1).astype(jnp.int32)
  return block_N * _BLOCK + jnp.minimum(inner_N, last_positive_N), total_N


def row_uniforms(rng: jax.Array, rows_N: jax.Array, steps_N: jax.Array) -> jax.Array:
  """One uniform per row from `fold_in(fold_in(rng, row), step)`.

  A response's randomness depends on its row (group-major index) and token
  position only, not on which decode slot or batch it ran in.
  """
  key_N = jax.vmap(lambda r, t: jax.random.fold_in(jax.random.fold_in(rng, r), t))(rows_N, steps_N)
  return jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(key_N)


def draw_tokens(logits_NxV: jax.Array, rng: jax.Array | None, temperature=1.0, *,
                greedy: bool = False, top_k: int = 0, top_p: float = 1.0,
                uniforms_N: jax.Array | None = None):
  """Draws one token per row; returns `(tokens_N, logprobs_N)`.

  `temperature` may be traced; `greedy`, `top_k` (0 = off) and `top_p`
  (1 = off) are static. The log-prob is under softmax(logits / temperature)
  over the full vocabulary, whatever top-k / top-p kept (under
  softmax(logits) when greedy), so it equals what `score_responses` gives.
  `uniforms_N` (e.g. `row_uniforms`) replaces the draw from `rng`.
  """
  logits_NxV = logits_NxV.astype(jnp.float32)
  if greedy:
    tok_N = _argmax(logits_NxV)
    picked_N = jnp.take_along_axis(logits_NxV, tok_N[:, None], axis=-1)[:, 0]
    return tok_N, picked_N - jax.nn.logsumexp(logits_NxV, axis=-1)
  u_N = (jax.random.uniform(rng, logits_NxV.shape[:1], dtype=jnp.float32)
         if uniforms_N is None else uniforms_N)
  if top_k == 0 and top_p >= 1.0:
    # The temperature divides inside the exponent: no scaled copy of the [N, V] logits, one
    # pass over them fewer (~1 ms of a ~68 ms step for 128 rows x 32000 on XLA:CPU,
    # experiments/benchmarks/results/engine_bench.md). At temperature 1 the same bits as scaling first.
    max_N = jnp.max(logits_NxV, axis=-1)
    tok_N, total_N = _inverse_cdf(jnp.exp((logits_NxV - max_N[:, None]) / temperature), u_N)
    picked_N = jnp.take_along_axis(logits_NxV, tok_N[:, None], axis=-1)[:, 0]
    return tok_N.astype(jnp.int32), (picked_N - max_N) / temperature - jnp.log(total_N)
  scaled_NxV = logits_NxV / temperature
  max_N = jnp.max(scaled_NxV, axis=-1)
  vocab = scaled_NxV.shape[-1]
  top_NxK, top_idx_NxK = jax.lax.top_k(scaled_NxV, min(top_k or vocab, vocab))
  if top_p < 1.0:
    # Nucleus on the top-k distribution, as transformers does: keep the
    # smallest prefix whose mass reaches top_p (always the first token).
    probs_NxK = jax.nn.softmax(top_NxK, axis=-1)
    mass_before_NxK = jnp.cumsum(probs_NxK, axis=-1) - probs_NxK
    top_NxK = jnp.where(mass_before_NxK < top_p, top_NxK, -jnp.inf)
  pick_N, _ = _inverse_cdf(jnp.exp(top_NxK - max_N[:, None]), u_N)
  # Kept entries come first; a rounding gap in the cdf must not step past them.
  kept_N = jnp.sum(top_NxK > -jnp.inf, axis=-1, dtype=jnp.int32)
  pick_N = jnp.minimum(pick_N, kept_N - 1)
  tok_N = jnp.take_along_axis(top_idx_NxK, pick_N[:, None], axis=-1)[:, 0]
  total_N = jnp.sum(jnp.exp(scaled_NxV - max_N[:, None]), axis=-1)
  picked_N = jnp.take_along_axis(scaled_NxV, tok_N[:, None], axis=-1)[:, 0]
  return tok_N.astype(jnp.int32), picked_N - max_N - jnp.log(total_N)
