"""Token weights for every aggregation rule of a GRPO-style loss.

Every rule is a table of token weights ``w_NxT`` computed from the response
mask, the sequence advantages and the group layout only (docs/aggregation.md);
the aggregated loss is ``sum(w * values)``. Rows are group-major: sequence
``n`` belongs to group ``n // group_size``. The mode and its options are static
(Python values), so each mode compiles its own function under ``jax.jit``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ba_jax.config import schema

MODES = schema.AGGREGATIONS
BA_DENOMINATORS = schema.BA_DENOMINATORS
BA_SCOPES = schema.BA_SCOPES


def check_option(name: str, value, valid) -> None:
  """Raises a ValueError naming the option, the value seen and the valid ones."""
  if value not in valid:
    raise ValueError(f"Unknown {name} {value!r}; expected one of {list(valid)}.")


def _safe_div(num, den, xp=jnp):
  """num / den where den > 0, else 0 (an empty subset contributes nothing)."""
  positive = den > 0
  return xp.where(positive, num / xp.where(positive, den, 1.0), 0.0)


def _check_layout(mask_NxT, advantages_N, group_size: int) -> None:
  if mask_NxT.ndim != 2:
    raise ValueError(f"mask must be [N, T]; got shape {mask_NxT.shape}.")
  n = mask_NxT.shape[0]
  if advantages_N.shape != (n,):
    raise ValueError(
        f"advantages must be [N] = [{n}] to match mask {mask_NxT.shape}; "
        f"got shape {advantages_N.shape}.")
  if not isinstance(group_size, int) or group_size < 1 or n % group_size:
    raise ValueError(
        f"group_size must be a positive int dividing N={n}; got {group_size!r}.")


def _balanced_coefficients(lengths_N, advantages_N, *, group_size: int,
                           ba_denominator: str, ba_scope: str, xp=jnp):
  """Per-sequence coefficient c[n] so that w[n, t] = m[n, t] * c[n]."""
  n = lengths_N.shape[0]
  if ba_scope == "group":
    groups = n // group_size
    lengths = lengths_N.reshape(groups, group_size)
    adv = advantages_N.reshape(groups, group_size)
  else:  # one positive and one negative subset pooled over the whole batch
    groups = 1
    lengths = lengths_N.reshape(1, n)
    adv = advantages_N.reshape(1, n)
  pos = (adv > 0).astype(xp.float32)
  neg = (adv < 0).astype(xp.float32)
  count_pos = pos.sum(-1, keepdims=True)
  count_neg = neg.sum(-1, keepdims=True)
  tokens_pos = (pos * lengths).sum(-1, keepdims=True)
  tokens_neg = (neg * lengths).sum(-1, keepdims=True)
  if ba_denominator == "group":
    denom = xp.full_like(count_pos, lengths.shape[1])
  else:  # "signed": only sequences with a non-zero advantage count
    denom = count_pos + count_neg
  # |S| / denom is the subset's share; dividing by T_S takes its token mean and
  # by the number of groups takes the mean over groups.
  coef_pos = _safe_div(count_pos, denom * tokens_pos, xp) / groups
  coef_neg = _safe_div(count_neg, denom * tokens_neg, xp) / groups
  coef = pos * coef_pos + neg * coef_neg
  return coef.reshape(n)


def sequence_coefficients(lengths_N, advantages_N, *, mode: str,
                          group_size: int, max_response_len: int | None = None,
                          ba_denominator: str = "group",
                          ba_scope: str = "group", xp=jnp):
  """Each rule's weight per token of sequence ``n``, ``c[n]``, from float32
  lengths [N] and advantages [N]: every rule is ``w[n, t] = m[n, t] c[n]``,
  so a sequence's total weight is ``lengths[n] c[n]``. ``xp``: jax.numpy
  (inside the step), or numpy (the trainer's samples table, on the host).
  Arguments as ``token_weights``."""
  check_option("aggregation mode", mode, MODES)
  check_option("ba_denominator", ba_denominator, BA_DENOMINATORS)
  check_option("ba_scope", ba_scope, BA_SCOPES)
  n = lengths_N.shape[0]
  if mode == "token":
    return xp.full_like(lengths_N, _safe_div(1.0, lengths_N.sum(), xp))
  if mode == "sequence":
    return _safe_div(1.0, lengths_N, xp) / n
  if mode == "dr_grpo":
    if max_response_len is None or max_response_len <= 0:
      raise ValueError(
          "mode 'dr_grpo' needs max_response_len, a positive int (the config's "
          f"maximum response length); got {max_response_len!r}.")
    return xp.full_like(lengths_N, 1.0 / (n * float(max_response_len)))
  return _balanced_coefficients(
      lengths_N, advantages_N, group_size=group_size,
      ba_denominator=ba_denominator, ba_scope=ba_scope, xp=xp)


def token_weights(mask, advantages, *, mode: str, group_size: int,
                  max_response_len: int | None = None,
                  ba_denominator: str = "group", ba_scope: str = "group"):
  """Aggregation weights ``w_NxT >= 0`` with ``J = sum(w * l)``.

  Args:
    mask: [N, T] response mask (0/1, any dtype).
    advantages: [N] sequence advantages.
    mode: one of ``MODES``.
    group_size: G, the responses per prompt; N must be a multiple of it.
    max_response_len: the constant of ``dr_grpo`` (required there only).
    ba_denominator: ``"group"`` (|S|/G) or ``"signed"`` (|S|/(|P|+|N|)).
    ba_scope: ``"group"`` or ``"batch"`` (subsets pooled over the batch).

  Returns:
    float32 [N, T] weights, with no gradient flowing through them.

  A masked row (``rl.overlong="mask"`` zeroes a truncated response's mask)
  keeps its advantage, so under ``balanced`` it still counts in its subset's
  ``|S|`` with 0 tokens: the subset keeps its share ``|S|/G`` of the group,
  spread over its remaining tokens (a subset with no token left gets 0).
  That is a choice: the shares stay the sampled outcome counts the
  advantages were normalised with, so truncation does not tilt W+ : W-.
  """
  check_option("aggregation mode", mode, MODES)
  mask_NxT = jnp.asarray(mask).astype(jnp.float32)
  advantages_N = jnp.asarray(advantages).astype(jnp.float32)
  _check_layout(mask_NxT, advantages_N, group_size)
  coef_N = sequence_coefficients(
      mask_NxT.sum(-1), advantages_N, mode=mode, group_size=group_size,
      max_response_len=max_response_len, ba_denominator=ba_denominator,
      ba_scope=ba_scope)
  return jax.lax.stop_gradient(mask_NxT * coef_N[:, None])


def sequence_weights(lengths_N, advantages_N, *, num_minibatches: int = 1,
                     **options):
  """Each sequence's total weight (the sum of its ``token_weights``) in the
  PPO mini-batch that holds it, on the host (numpy): float64 [N] from the
  lengths the loss sees and the advantages of a whole batch, split into
  ``num_minibatches`` contiguous mini-batches as the train step splits it;
  each mini-batch's weights sum to at most 1. ``options``: as
  ``token_weights``."""
  lengths = np.asarray(lengths_N, np.float32).reshape(num_minibatches, -1)
  adv = np.asarray(advantages_N, np.float32).reshape(num_minibatches, -1)
  return np.concatenate([
      (l * sequence_coefficients(l, a, xp=np, **options)).astype(np.float64)
      for l, a in zip(lengths, adv)])


def aggregate(values, mask, advantages, *, mode: str, group_size: int,
              **options):
  """``sum(token_weights(mask, advantages, ...) * values)``, a scalar."""
  weights = token_weights(mask, advantages, mode=mode, group_size=group_size,
                          **options)
  return jnp.sum(weights * jnp.asarray(values, jnp.float32))


def signed_weights(weights_NxT, advantages_N, xp=jnp):
  """``(W+, W-)``: the total weight on positive- and on negative-advantage
  sequences (additive over micro-batches)."""
  return (xp.sum(weights_NxT * (advantages_N > 0)[:, None]),
          xp.sum(weights_NxT * (advantages_N < 0)[:, None]))


def _ratio(num, den, xp):
  """num / den, NaN where den == 0 (the convention for undefined values)."""
  defined = den > 0
  return xp.where(defined, num / xp.where(defined, den, 1.0), xp.nan)


def positive_share(w_pos, w_neg, xp=jnp):
  """``W+ / (W+ + W-)``; NaN when neither subset has weight."""
  return _ratio(w_pos, w_pos + w_neg, xp)


def _within_group_gap(lengths_GxS, pos_GxS, neg_GxS, xp):
  """(mean gap, mean relative gap) over the groups holding both signs: the
  positive minus the negative mean length, and that over their average."""
  count_pos, count_neg = pos_GxS.sum(-1), neg_GxS.sum(-1)
  both = (count_pos > 0) & (count_neg > 0)
  mean_pos = (lengths_GxS * pos_GxS).sum(-1) / xp.maximum(count_pos, 1)
  mean_neg = (lengths_GxS * neg_GxS).sum(-1) / xp.maximum(count_neg, 1)
  gap = mean_pos - mean_neg
  middle = 0.5 * (mean_pos + mean_neg)
  has_rel = both & (middle > 0)
  rel = gap / xp.where(has_rel, middle, 1.0)
  return (_ratio(xp.sum(xp.where(both, gap, 0.0)), both.sum(), xp),
          _ratio(xp.sum(xp.where(has_rel, rel, 0.0)), has_rel.sum(), xp))


def _within_subset_cv(lengths_GxS, pos_GxS, neg_GxS, xp):
  """Mean CV of length over the (group, sign) subsets of >= 2 sequences with
  a non-zero mean: 0 exactly when BA and sequence aggregation coincide."""
  total, count = 0.0, 0.0
  for member in (pos_GxS, neg_GxS):
    n = member.sum(-1)
    mean = (lengths_GxS * member).sum(-1) / xp.maximum(n, 1)
    var = (xp.square(lengths_GxS - mean[:, None]) * member).sum(-1) / (
        xp.maximum(n, 1))
    ok = (n >= 2) & (mean > 0)
    total = total + xp.sum(xp.where(ok, xp.sqrt(var) / xp.where(ok, mean, 1.0),
                                    0.0))
    count = count + ok.sum()
  return _ratio(total, count, xp)


def length_diagnostics(lengths_N, advantages_N, *, group_size: int,
                       xp=jnp) -> dict:
  """Response-length statistics of docs/aggregation.md, from float lengths
  [N] (``xp``: jax.numpy on device, numpy on the host).

  ``pos_frac``: positive sequences among those with a non-zero advantage.
  ``length_cv``: within-group coefficient of variation of length
  (population std over mean), averaged over the groups with a non-zero
  mean. ``mean_len_pos``/``mean_len_neg``: mean length of the positive and
  negative sequences; ``length_gap`` their difference and
  ``length_gap_rel`` that divided by their average (pooled over the batch,
  so it mixes between-group length differences in).
  ``length_gap_in_group``/``length_gap_in_group_rel``: the same gap taken
  inside each group holding both signs, then averaged over those groups.
  ``length_cv_in_subset``: the CV of length inside each group's positive and
  negative subsets (``_within_subset_cv``). A statistic with nothing to
  measure (no signed sequence, an empty subset, no group with a length) is
  NaN, never a misleading 0.
  """
  pos_N = (advantages_N > 0).astype(lengths_N.dtype)
  neg_N = (advantages_N < 0).astype(lengths_N.dtype)
  count_pos, count_neg = pos_N.sum(), neg_N.sum()
  lengths_GxS = lengths_N.reshape(-1, group_size)
  mean_G = lengths_GxS.mean(-1)
  has_length_G = (mean_G > 0).astype(lengths_N.dtype)
  cv_G = xp.where(mean_G > 0, lengths_GxS.std(-1) / xp.maximum(mean_G, 1e-9),
                  0.0)
  mean_len_pos = _ratio(xp.sum(lengths_N * pos_N), count_pos, xp)
  mean_len_neg = _ratio(xp.sum(lengths_N * neg_N), count_neg, xp)
  gap = mean_len_pos - mean_len_neg
  pos_GxS, neg_GxS = pos_N.reshape(-1, group_size), neg_N.reshape(-1, group_size)
  gap_in_group, gap_in_group_rel = _within_group_gap(lengths_GxS, pos_GxS,
                                                     neg_GxS, xp)
  return {
      "pos_frac": _ratio(count_pos, count_pos + count_neg, xp),
      "length_cv": _ratio(xp.sum(cv_G * has_length_G), has_length_G.sum(), xp),
      "length_gap": gap,
      "length_gap_rel": _ratio(gap, 0.5 * (mean_len_pos + mean_len_neg), xp),
      "mean_len_pos": mean_len_pos,
      "mean_len_neg": mean_len_neg,
      "length_gap_in_group": gap_in_group,
      "length_gap_in_group_rel": gap_in_group_rel,
      "length_cv_in_subset": _within_subset_cv(lengths_GxS, pos_GxS, neg_GxS,
                                               xp),
  }


def weight_length_correlation(weights_NxT, mask_NxT, advantages_N, xp=jnp):
  """Pearson correlation of a sequence's per-token weight with its length,
  over the sequences with a non-zero advantage and a token.

  Token and ``dr_grpo`` aggregation give every token the same weight: no
  coupling to length, reported as 0 (weights equal to float32 precision,
  relative spread < 1e-5). Sequence aggregation gives 1/length: strongly
  negative. NaN with fewer than two such sequences or equal lengths.
  """
  lengths_N = mask_NxT.sum(-1)
  use_N = ((advantages_N != 0) & (lengths_N > 0)).astype(lengths_N.dtype)
  n = use_N.sum()
  per_token_N = weights_NxT.sum(-1) / xp.maximum(lengths_N, 1.0)
  def centred(x):
    return (x - _ratio(xp.sum(x * use_N), n, xp)) * use_N
  w, length = centred(per_token_N), centred(lengths_N)
  var_w, var_len = xp.sum(w * w), xp.sum(length * length)
  scale = _ratio(xp.sum(per_token_N * use_N), n, xp)
  flat_w = var_w <= xp.square(1e-5 * scale) * n
  corr = xp.sum(w * length) / xp.sqrt(xp.where(
      (var_w > 0) & (var_len > 0), var_w * var_len, 1.0))
  defined = (n >= 2) & (var_len > 0)
  return xp.where(defined, xp.where(flat_w, 0.0, corr), xp.nan)


def diagnostics(weights, mask, advantages, *, group_size: int) -> dict:
  """What the aggregation rule does to positive and negative responses.

  ``w_pos``/``w_neg`` (``signed_weights``) and ``pos_share = w_pos / (w_pos
  + w_neg)``, next to ``length_diagnostics`` and
  ``weight_length_correlation``. BA makes ``pos_share`` equal to ``pos_frac``
  whatever the lengths only with ``ba_denominator="group"`` (and every
  signed subset holding a token): with ``"signed"`` each group splits its
  weight by its own signed counts, so ``pos_share`` is the mean over groups
  of their positive fraction, not the pooled one. W+/W- are equal under BA
  and sequence aggregation by construction; ``length_cv_in_subset`` and
  ``weight_length_corr`` are what separate them. Undefined values are NaN.
  """
  mask_NxT = jnp.asarray(mask).astype(jnp.float32)
  advantages_N = jnp.asarray(advantages).astype(jnp.float32)
  _check_layout(mask_NxT, advantages_N, group_size)
  w_pos, w_neg = signed_weights(jnp.asarray(weights), advantages_N)
  return {"w_pos": w_pos, "w_neg": w_neg,
          "pos_share": positive_share(w_pos, w_neg),
          "weight_length_corr": weight_length_correlation(
              jnp.asarray(weights), mask_NxT, advantages_N),
          **length_diagnostics(mask_NxT.sum(-1), advantages_N,
                               group_size=group_size)}
