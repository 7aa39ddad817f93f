"""Per-token policy-gradient terms and the GRPO loss built from them.

The surrogate (``ba_jax.loss.objectives``: PPO-clip by default, or GSPO,
GMPO, CISPO, SAPO, LUSPO, GPG, DRO, DPPO, KL-Cov, Clip-Cov) times the sampler-trainer correction, the KL
penalty and the entropy bonus are per-token arrays [N, T];
``ba_jax.loss.aggregation`` turns each into a scalar. The policy term uses
the aggregation mode under study; the regularisers use their own mode
(``reg_aggregation``, default ``token``) so that BA's zero weight on
zero-advantage sequences never silently drops them (docs/aggregation.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ba_jax.config import schema
from ba_jax.loss import aggregation as agg
from ba_jax.loss import objectives
from ba_jax.loss.aggregation import check_option
from ba_jax.loss.objectives import clipped_surrogate  # noqa: F401 (public name)

KL_TYPES = schema.KL_TYPES

_D = schema.default  # a key's run-config default (``ba_jax.config.schema``)


def kl_penalty(logp, ref_logp, kind: str = "k3"):
  """Per-token estimate of KL(policy || reference) from sampled tokens.

  k1: ``logp - ref``; k2: ``(logp - ref)^2 / 2``; k3 (low variance, >= 0):
  ``exp(ref - logp) - (ref - logp) - 1``.
  """
  check_option("kl_type", kind, KL_TYPES)
  log_ratio = logp - ref_logp
  if kind == "k1":
    return log_ratio
  if kind == "k2":
    return 0.5 * jnp.square(log_ratio)
  return jnp.expm1(-log_ratio) + log_ratio


def _masked_mean(x, mask):
  return jnp.sum(x * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def policy_loss(logp, old_logp, advantages, mask, *, group_size: int,
                aggregation: str, eps_low: float = 0.2, eps_high: float = 0.2,
                dual_clip: float | None = None, ref_logp=None,
                kl_coef: float = 0.0, kl_type: str = "k3", entropy=None,
                entropy_coef: float = 0.0, reg_aggregation: str = "token",
                max_response_len: int | None = None,
                ba_denominator: str = "group", ba_scope: str = "group",
                weights=None, reg_weights=None, surrogate: str = "ppo_clip",
                correction: str = "none", behaviour_logp=None,
                correction_cap: float = _D("loss.correction_cap"),
                correction_floor: float | None = _D("loss.correction_floor"),
                icepop_low: float = _D("loss.icepop_low"),
                icepop_high: float = _D("loss.icepop_high"),
                cispo_cap: float = _D("loss.cispo_cap"),
                sapo_tau_pos: float = _D("loss.sapo_tau_pos"),
                sapo_tau_neg: float = _D("loss.sapo_tau_neg"),
                dro_beta: float | None = _D("loss.dro_beta"),
                dppo_tv_low: float = _D("loss.dppo_tv_low"),
                dppo_tv_high: float = _D("loss.dppo_tv_high"),
                dppo_kl_low: float = _D("loss.dppo_kl_low"),
                dppo_kl_high: float = _D("loss.dppo_kl_high"),
                dppo_cap: float = _D("loss.dppo_cap"),
                kl_cov_ratio: float = _D("loss.kl_cov_ratio"),
                kl_cov_coef: float = _D("loss.kl_cov_coef"),
                clip_cov_ratio: float = _D("loss.clip_cov_ratio"),
                clip_cov_lb: float = _D("loss.clip_cov_lb"),
                clip_cov_ub: float = _D("loss.clip_cov_ub"), key=None):
  """The GRPO loss and its metrics.

  Args:
    logp, old_logp: [N, T] log-probs of the response tokens under the current
      and the old policy (the trainer's at the step's start, or the
      sampler's standing in for it).
    surrogate: the policy term (static), ``objectives.SURROGATES``; its
      options ``eps_low``/``eps_high``/``dual_clip``, ``cispo_cap``,
      ``sapo_tau_pos``/``sapo_tau_neg``, ``dro_beta``,
      ``dppo_tv_low``/``dppo_tv_high``, ``dppo_kl_low``/``dppo_kl_high``,
      ``dppo_cap``, ``kl_cov_ratio``/``kl_cov_coef``,
      ``clip_cov_ratio``/``clip_cov_lb``/``clip_cov_ub`` (kl_cov and
      clip_cov pick their tokens among this call's, so they are the terms
      that depend on how a mini-batch is split into micro-batches).
    key: a PRNG key for clip_cov's draw (needed by it, unused otherwise).
    correction: the sampler-trainer correction (static),
      ``objectives.CORRECTIONS``, a stop-gradient factor on each token's
      term from ``old_logp - behaviour_logp`` (needed unless "none"); its
      bounds ``correction_cap``/``correction_floor``,
      ``icepop_low``/``icepop_high``.
    advantages: [N]. mask: [N, T] response mask.
    aggregation: the policy term's mode (static), see ``aggregation.MODES``.
    ref_logp: [N, T] reference-policy log-probs, needed when ``kl_coef > 0``.
    entropy: [N, T] policy entropy per position, needed when
      ``entropy_coef > 0``; the bonus is subtracted from the loss.
    reg_aggregation: the mode that aggregates the KL and entropy terms.
    weights, reg_weights: weights precomputed on the whole mini-batch (for
      micro-batching); computed here from ``mask``/``advantages`` when None.

  Returns:
    ``(loss, metrics)``. Metrics whose names start with ``w_`` or end with
    ``_sum`` add over micro-batches; ``*_min``/``*_max`` take min/max; the
    rest are means over this call's ``num_tokens`` response tokens.
  """
  check_option("aggregation mode", aggregation, agg.MODES)
  objectives.check_combination(
      surrogate=surrogate, correction=correction, aggregation=aggregation,
      dual_clip=dual_clip, correction_cap=correction_cap,
      correction_floor=correction_floor, icepop_low=icepop_low,
      icepop_high=icepop_high, dro_beta=dro_beta, clip_cov_lb=clip_cov_lb,
      clip_cov_ub=clip_cov_ub)
  check_option("reg_aggregation", reg_aggregation, agg.MODES)
  if kl_coef and ref_logp is None:
    raise ValueError(f"kl_coef={kl_coef} needs ref_logp; got None.")
  if entropy_coef and entropy is None:
    raise ValueError(f"entropy_coef={entropy_coef} needs entropy; got None.")
  mask_NxT = jnp.asarray(mask).astype(jnp.float32)
  advantages_N = jnp.asarray(advantages).astype(jnp.float32)
  weight_options = dict(group_size=group_size,
                        max_response_len=max_response_len,
                        ba_denominator=ba_denominator, ba_scope=ba_scope)
  if weights is None:
    weights = agg.token_weights(mask_NxT, advantages_N, mode=aggregation,
                                **weight_options)
  need_reg = bool(kl_coef) or bool(entropy_coef)
  if need_reg and reg_weights is None:
    reg_weights = agg.token_weights(mask_NxT, advantages_N,
                                    mode=reg_aggregation, **weight_options)

  if correction != "none" and behaviour_logp is None:
    raise ValueError(f"correction={correction!r} needs behaviour_logp (the "
                     "sampler's log-probs); got None.")
  if surrogate == "ppo_clip":
    terms, ratio, low, high, dual = clipped_surrogate(
        logp, old_logp, advantages_N, eps_low=eps_low, eps_high=eps_high,
        dual_clip=dual_clip)
  else:
    terms, ratio, low, high, dual = objectives.surrogate_terms(
        logp, old_logp, advantages_N, mask_NxT, surrogate=surrogate,
        eps_low=eps_low, eps_high=eps_high, dual_clip=dual_clip,
        cispo_cap=cispo_cap, sapo_tau_pos=sapo_tau_pos,
        sapo_tau_neg=sapo_tau_neg, dro_beta=dro_beta, dppo_tv_low=dppo_tv_low,
        dppo_tv_high=dppo_tv_high, dppo_kl_low=dppo_kl_low,
        dppo_kl_high=dppo_kl_high, dppo_cap=dppo_cap,
        kl_cov_ratio=kl_cov_ratio, kl_cov_coef=kl_cov_coef,
        clip_cov_ratio=clip_cov_ratio, clip_cov_lb=clip_cov_lb,
        clip_cov_ub=clip_cov_ub, key=key)
  metrics = {}
  if correction != "none":
    factor, corrected = objectives.correction_weights(
        old_logp, behaviour_logp, mask_NxT, correction=correction,
        cap=correction_cap, floor=correction_floor, icepop_low=icepop_low,
        icepop_high=icepop_high)
    terms = terms * factor
    metrics["correction_mean"] = _masked_mean(
        jnp.broadcast_to(factor, mask_NxT.shape), mask_NxT)
    metrics["corrected_frac"] = _masked_mean(
        jnp.broadcast_to(corrected, mask_NxT.shape), mask_NxT)
  pg_loss = jnp.sum(weights * terms)
  loss = pg_loss
  metrics["pg_loss_sum"] = pg_loss
  if kl_coef:
    kl = kl_penalty(logp, ref_logp, kl_type)
    kl_loss = jnp.sum(reg_weights * kl)
    loss = loss + kl_coef * kl_loss
    metrics["kl_loss_sum"] = kl_loss
  if ref_logp is not None:
    metrics["kl_ref"] = _masked_mean(kl_penalty(logp, ref_logp, "k3"), mask_NxT)
  if entropy_coef:
    entropy_bonus = jnp.sum(reg_weights * entropy)
    loss = loss - entropy_coef * entropy_bonus
    metrics["entropy_bonus_sum"] = entropy_bonus
  if entropy is not None:
    metrics["entropy"] = _masked_mean(entropy, mask_NxT)

  stats = jax.lax.stop_gradient
  has_token = mask_NxT > 0
  any_token = jnp.any(has_token)
  metrics.update({
      "num_tokens": jnp.sum(mask_NxT),
      "clip_frac_low": _masked_mean(low, mask_NxT),
      "clip_frac_high": _masked_mean(high, mask_NxT),
      "clip_frac_dual": _masked_mean(dual, mask_NxT),
      "ratio_mean": stats(_masked_mean(ratio, mask_NxT)),
      # With no response token at all the ratio is reported as 1, not +-inf.
      "ratio_min": stats(jnp.where(
          any_token, jnp.min(jnp.where(has_token, ratio, jnp.inf)), 1.0)),
      "ratio_max": stats(jnp.where(
          any_token, jnp.max(jnp.where(has_token, ratio, -jnp.inf)), 1.0)),
      "approx_kl": stats(_masked_mean(
          kl_penalty(old_logp, logp, "k3"), mask_NxT)),
  })
  metrics["w_pos"], metrics["w_neg"] = agg.signed_weights(weights,
                                                          advantages_N)
  # Over this call's rows (a micro-batch's, with the mini-batch's weights),
  # then averaged like the other means. Device metrics stay finite (they are
  # averaged over parts), so "undefined" (no signed rows of differing
  # lengths) is logged as 0 here; aggregation.diagnostics keeps the NaN.
  corr = agg.weight_length_correlation(weights, mask_NxT, advantages_N)
  metrics["weight_length_corr"] = jnp.where(jnp.isnan(corr), 0.0, corr)
  return loss, metrics

