"""The policy objective's per-token terms and the sampler-trainer correction.

Three log-probs of the same sampled tokens meet here (docs/aggregation.md):
the sampler's (behaviour, ``b``), the trainer's at the start of the step
(old, ``o``) and the current one (``logp``). A ``surrogate`` turns
``logp - o`` and the advantages into a term ``l[n, t]``; a ``correction``
turns ``o - b`` into a stop-gradient factor ``c[n, t]``; the aggregation
rule's weights ``w[n, t]`` (``ba_jax.loss.aggregation``) make the loss
``J = sum(w * c * l)``. A sequence-level term (gspo, gmpo, luspo) or
factor (``*_sequence``) is the same number on every token of its sequence,
so it meets the rule through the sequence's total weight ``sum_t w[n, t]``.
All three are static choices (``schema.SURROGATES``, ``schema.CORRECTIONS``).
Two surrogates read statistics of the whole call: ``kl_cov`` picks the
tokens it penalises among this call's response tokens, and ``clip_cov``
draws the tokens it zeroes among them with a PRNG key, so with
micro-batches their loss depends on how the mini-batch is split (as verl's).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ba_jax.config import schema
from ba_jax.config.combinations import check_combination  # noqa: F401 (public name)

SURROGATES = schema.SURROGATES
CORRECTIONS = schema.CORRECTIONS
# Surrogates whose ratio is one number per sequence.
SEQUENCE_SURROGATES = ("gspo", "gspo_token", "gmpo", "luspo")
# GMPO's token log-ratios are clamped to this before anything else (verl's
# geo_mean does the same), so that exp of their mean stays finite.
GMPO_LOG_RATIO_BOUND = 20.0
# DPPO-Binary-KL adds this to 1 - p and 1 - p_old (verl's constant), so a
# token at p = 1 (a log-prob of exactly 0 in float32) keeps a finite divergence.
DPPO_KL_EPS = 1e-8

_D = schema.default  # a key's run-config default (``ba_jax.config.schema``)


def clipped_surrogate(logp, old_logp, advantages, *, eps_low: float,
                      eps_high: float, dual_clip: float | None = None):
  """PPO surrogate per token, with clip-higher and an optional dual clip.

  ``l = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))`` with
  ``r = exp(logp - old_logp)``; with ``dual_clip = c`` (> 1) tokens of
  negative-advantage sequences are also capped: ``l = min(l, -A c)``.

  Returns:
    (loss_NxT, ratio_NxT, low_clipped_NxT, high_clipped_NxT, dual_clipped_NxT)
    where the three masks mark tokens whose gradient a clip has zeroed.
  """
  if dual_clip is not None and dual_clip <= 1.0:
    raise ValueError(f"dual_clip must be > 1 (or None); got {dual_clip!r}.")
  ratio = jnp.exp(logp - old_logp)
  adv = advantages[:, None]
  unclipped = -adv * ratio
  clipped = -adv * jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
  loss = jnp.maximum(unclipped, clipped)
  low_clipped = jnp.logical_and(adv < 0, ratio < 1.0 - eps_low)
  high_clipped = jnp.logical_and(adv > 0, ratio > 1.0 + eps_high)
  dual_clipped = jnp.zeros_like(low_clipped)
  if dual_clip is not None:
    cap = -adv * dual_clip
    dual_clipped = jnp.logical_and(adv < 0, loss > cap)
    loss = jnp.where(adv < 0, jnp.minimum(loss, cap), loss)
  return loss, ratio, low_clipped, high_clipped, dual_clipped


def sequence_log_ratio(logp, old_logp, mask):
  """``sum_t m (logp - old) / L`` per sequence, [N, 1] (0 for an empty row):
  the log of GSPO's length-normalised sequence ratio."""
  m = jnp.asarray(mask, jnp.float32)
  return (jnp.sum((logp - old_logp) * m, -1, keepdims=True)
          / jnp.maximum(jnp.sum(m, -1, keepdims=True), 1.0))


def _gmpo(logp, old_logp, adv_Nx1, mask, eps_low, eps_high):
  """GMPO: ``-A exp(mean_t d~)`` per sequence, ``d~`` the token log-ratio
  clipped to [-eps_low, eps_high] on the side that limits the update for the
  sign of A (the min of PPO's two branches, taken in log space)."""
  d = jnp.clip(logp - old_logp, -GMPO_LOG_RATIO_BOUND, GMPO_LOG_RATIO_BOUND)
  sign = jnp.sign(adv_Nx1)
  d_min = sign * jnp.minimum(sign * d, sign * jnp.clip(d, -eps_low, eps_high))
  m = jnp.asarray(mask, jnp.float32)
  ratio = jnp.exp(jnp.sum(d_min * m, -1, keepdims=True)
                  / jnp.maximum(jnp.sum(m, -1, keepdims=True), 1.0))
  low = (adv_Nx1 < 0) & (d < -eps_low)
  high = (adv_Nx1 > 0) & (d > eps_high)
  return -adv_Nx1 * ratio, ratio, low, high


def binary_kl(old_logp, logp):
  """KL(Bernoulli(p_old) || Bernoulli(p)) of each token's probability, the
  divergence DPPO-Binary-KL bounds; ``1 - p`` from ``expm1`` (exact near
  p = 0), smoothed by ``DPPO_KL_EPS`` near p = 1 and kept >= 0 (a log-prob
  rounded above 0 would otherwise give a NaN)."""
  p_old = jnp.exp(old_logp)
  rest_old = jnp.maximum(-jnp.expm1(old_logp), 0.0)
  rest = jnp.maximum(-jnp.expm1(logp), 0.0)
  return p_old * (old_logp - logp) + rest_old * (
      jnp.log(rest_old + DPPO_KL_EPS) - jnp.log(rest + DPPO_KL_EPS))


def _dppo(logp, old_logp, adv_Nx1, *, divergence: str, low: float,
          high: float, cap: float):
  """DPPO-Binary (Qi et al. 2026, arXiv 2602.04879): ``-A sg(min(r, cap))
  logp`` on tokens inside the trust region, 0 outside. The region bounds a
  divergence of the token's probability from the old one in the direction
  A pushes it: for A > 0 a rise of more than ``high``, for A < 0 a fall of
  more than ``low``, measured as the difference of probabilities (tv) or
  their binary KL (kl)."""
  ratio = jnp.exp(logp - old_logp)
  rise = jnp.exp(logp) - jnp.exp(old_logp)
  if divergence == "tv":
    rose_too_far, fell_too_far = rise > high, rise < -low
  else:
    kl = binary_kl(old_logp, logp)
    rose_too_far, fell_too_far = (rise > 0) & (kl > high), (rise < 0) & (kl > low)
  high_masked = (adv_Nx1 > 0) & rose_too_far
  low_masked = (adv_Nx1 < 0) & fell_too_far
  inside = ~(high_masked | low_masked)
  weight = jax.lax.stop_gradient(jnp.minimum(ratio, cap))
  loss = jnp.where(inside, -adv_Nx1 * weight * logp, 0.0)
  # The cap truncates the weight of a token that keeps its gradient: DPPO's
  # stand-in for the dual clip, reported in its place.
  return loss, ratio, low_masked, high_masked, inside & (ratio > cap)


def _covariance(advantages, logp, on):
  """``(A - mean A)(sg(logp) - mean sg(logp))`` per token, the means over
  the ``on`` tokens; and their count ``n`` (float32)."""
  m = on.astype(jnp.float32)
  n = jnp.sum(m)
  adv = jnp.broadcast_to(advantages[:, None], on.shape)
  logp = jax.lax.stop_gradient(logp)
  mean_adv = jnp.sum(adv * m) / jnp.maximum(n, 1.0)
  mean_logp = jnp.sum(logp * m) / jnp.maximum(n, 1.0)
  return (adv - mean_adv) * (logp - mean_logp), n


def _ranks(keys):
  """Each entry's place when the 1-D ``keys`` are sorted (stable), int32."""
  order = jnp.argsort(keys, stable=True)
  return jnp.zeros(order.shape, jnp.int32).at[order].set(
      jnp.arange(order.size, dtype=jnp.int32))


def top_covariance_tokens(advantages, logp, mask, fraction: float):
  """KL-Cov's tokens: among this call's ``n`` response tokens, the
  ``max(1, floor(fraction * n))`` with the largest ``(A - mean A)(logp -
  mean logp)`` (means over those tokens); none when ``n = 0``. A bool
  [N, T], no gradient. The count is computed in float32, so where
  ``fraction * n`` lies within float32 rounding of an integer it may be one
  off Python's float64 product."""
  on = jnp.asarray(mask) > 0
  cov, n = _covariance(advantages, logp, on)
  cov = jnp.where(on, cov, -jnp.inf)
  count = jnp.maximum(1.0, jnp.floor(n * fraction))
  return (_ranks(-cov.ravel()).reshape(on.shape) < count) & on


def draw_tokens(candidates, count, key):
  """``min(count, candidates.sum())`` of the ``candidates`` (bool [N, T]),
  drawn uniformly without replacement with the PRNG ``key``: a bool [N, T].
  Each candidate gets a uniform score and those of lowest score are taken;
  the same key and candidates give the same tokens."""
  candidates = jnp.asarray(candidates, bool)
  scores = jax.random.uniform(key, candidates.shape)
  rank = _ranks(jnp.where(candidates, scores, 2.0).ravel())
  return (rank.reshape(candidates.shape) < count) & candidates


def clip_cov_tokens(advantages, logp, mask, clipped, *, ratio: float,
                    lb: float, ub: float, key):
  """Clip-Cov's tokens (verl's ``clip_cov``): the candidates are this call's
  ``n`` response tokens that PPO did not clip (``clipped``) and whose
  ``(A - mean A)(logp - mean logp)`` (as KL-Cov's) lies in ``(lb, ub)``;
  ``max(1, floor(ratio * n))`` of them are drawn with ``key``
  (``draw_tokens``; all when there are fewer). Returns ``(chosen,
  candidates)``, bool [N, T], no gradient; the count is float32's, as
  ``top_covariance_tokens``'."""
  on = jnp.asarray(mask) > 0
  cov, n = _covariance(advantages, logp, on)
  candidates = on & ~clipped & (cov > lb) & (cov < ub)
  count = jnp.maximum(1.0, jnp.floor(n * ratio))
  return draw_tokens(candidates, count, key), candidates


def surrogate_terms(logp, old_logp, advantages, mask, *, surrogate: str,
                    eps_low: float, eps_high: float,
                    dual_clip: float | None = None,
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
  """The policy term ``l[n, t]`` of ``surrogate`` (see ``SURROGATES``).

  Args:
    logp, old_logp: [N, T] current and old log-probs; advantages: [N];
    mask: [N, T] (the sequence-level ratios average over its tokens;
      kl_cov and clip_cov pick their tokens among them).
    key: a PRNG key, clip_cov's draw (needed by it, unused by the rest).

  Returns:
    ``(loss_NxT, ratio_NxT, low_NxT, high_NxT, dual_NxT)`` as
    ``clipped_surrogate``: ``ratio`` is the ratio the surrogate clips (a
    sequence's on each of its tokens for the sequence-level ones); ``low`` /
    ``high`` mark tokens a clip acted on (for cispo: whose IS weight was
    capped, the gradient kept; for dppo: masked outside the trust region,
    A < 0 / A > 0); ``dual`` the dual clip's (for dppo: tokens in the trust
    region whose weight ``dppo_cap`` truncated; for clip_cov: the tokens it
    drew and zeroed).
  """
  if surrogate not in SURROGATES:
    raise ValueError(f"Unknown loss.surrogate {surrogate!r}; expected one of "
                     f"{list(SURROGATES)}.")
  if dual_clip is not None and surrogate != "ppo_clip":
    raise ValueError(f"loss.dual_clip={dual_clip} applies to ppo_clip's token "
                     f"ratios only; got loss.surrogate={surrogate!r}.")
  adv = advantages[:, None]
  shape = jnp.shape(logp)
  none = jnp.zeros(shape, bool)
  if surrogate == "ppo_clip":
    return clipped_surrogate(logp, old_logp, advantages, eps_low=eps_low,
                             eps_high=eps_high, dual_clip=dual_clip)
  if surrogate in ("gspo", "luspo"):
    # s_n = exp(mean_t (logp - old)): the gradient reaches every token of n.
    log_s = jnp.broadcast_to(sequence_log_ratio(logp, old_logp, mask), shape)
    loss, ratio, low, high, dual = clipped_surrogate(
        log_s, jnp.zeros(shape), advantages, eps_low=eps_low,
        eps_high=eps_high)
    if surrogate == "luspo":  # each sequence's term times its length L[n]
      loss = loss * jnp.sum(jnp.asarray(mask, jnp.float32), -1, keepdims=True)
    return loss, ratio, low, high, dual
  if surrogate == "gspo_token":
    # s_nt = sg(s_n) pi_t / sg(pi_t): the value s_n, the gradient of token t's
    # own log-prob only.
    log_s = jax.lax.stop_gradient(sequence_log_ratio(logp, old_logp, mask))
    log_s = log_s + logp - jax.lax.stop_gradient(logp)
    return clipped_surrogate(log_s, jnp.zeros(shape), advantages,
                             eps_low=eps_low, eps_high=eps_high)
  if surrogate == "gmpo":
    loss, ratio, low, high = _gmpo(logp, old_logp, adv, mask, eps_low,
                                   eps_high)
    return (jnp.broadcast_to(loss, shape), jnp.broadcast_to(ratio, shape),
            low, high, none)
  if surrogate in ("dppo_tv", "dppo_kl"):
    tv = surrogate == "dppo_tv"
    return _dppo(logp, old_logp, adv, divergence="tv" if tv else "kl",
                 low=dppo_tv_low if tv else dppo_kl_low,
                 high=dppo_tv_high if tv else dppo_kl_high, cap=dppo_cap)
  log_ratio = logp - old_logp
  ratio = jnp.exp(log_ratio)
  if surrogate == "gpg":  # the plain policy gradient
    return -adv * logp, ratio, none, none, none
  if surrogate == "dro":
    if dro_beta is None or not dro_beta > 0:
      raise ValueError(f"loss.surrogate='dro' needs loss.dro_beta > 0; got "
                       f"{dro_beta!r}.")
    return (-(adv * logp - 0.5 * dro_beta * jnp.square(log_ratio)), ratio,
            none, none, none)
  if surrogate == "kl_cov":
    if not 0.0 < kl_cov_ratio <= 1.0:
      raise ValueError(f"loss.kl_cov_ratio must be in (0, 1]; got "
                       f"{kl_cov_ratio!r}.")
    chosen = top_covariance_tokens(advantages, logp, mask, kl_cov_ratio)
    # |log r| as sign * log r: its gradient at r = 1 (the first update of a
    # step, where logp can equal old) is 0, as torch's abs, not jnp.abs's 1.
    penalty = jnp.where(chosen, kl_cov_coef * jnp.sign(log_ratio) * log_ratio, 0.0)
    return -adv * ratio + penalty, ratio, none, none, none
  if surrogate == "clip_cov":
    if not 0.0 < clip_cov_ratio <= 1.0:
      raise ValueError(f"loss.clip_cov_ratio must be in (0, 1]; got "
                       f"{clip_cov_ratio!r}.")
    if not clip_cov_lb < clip_cov_ub:
      raise ValueError(f"loss.clip_cov_lb={clip_cov_lb!r} must be below "
                       f"loss.clip_cov_ub={clip_cov_ub!r}.")
    if key is None:
      raise ValueError("loss.surrogate='clip_cov' draws its tokens at random: "
                       "pass a PRNG key (key=None given).")
    # verl's clip test: the clipped branch is the larger term (no dual clip).
    unclipped = -adv * ratio
    clipped = -adv * jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
    chosen, _ = clip_cov_tokens(advantages, logp, mask, clipped > unclipped,
                                ratio=clip_cov_ratio, lb=clip_cov_lb,
                                ub=clip_cov_ub, key=key)
    low = (adv < 0) & (ratio < 1.0 - eps_low)
    high = (adv > 0) & (ratio > 1.0 + eps_high)
    return (jnp.where(chosen, 0.0, jnp.maximum(unclipped, clipped)), ratio,
            low, high, chosen)
  if surrogate == "cispo":
    weight = jax.lax.stop_gradient(jnp.minimum(ratio, cispo_cap))
    return -weight * adv * logp, ratio, none, ratio > cispo_cap, none
  # sapo: a soft gate (4 / tau) sigmoid(tau (r - 1)) in place of the clip.
  tau = jnp.where(adv > 0, sapo_tau_pos, sapo_tau_neg)
  gate = jax.nn.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau
  return -gate * adv, ratio, none, none, none


def correction_weights(old_logp, behaviour_logp, mask, *, correction: str,
                       cap: float = _D("loss.correction_cap"),
                       floor: float | None = _D("loss.correction_floor"),
                       icepop_low: float = _D("loss.icepop_low"),
                       icepop_high: float = _D("loss.icepop_high")):
  """The stop-gradient factor ``c`` for the sampler-trainer mismatch.

  ``rho = exp(old - behaviour)`` per token (``*_token``, icepop) or its
  product over the sequence's tokens (``*_sequence``, one number per row).
  tis: ``clip(rho, floor, cap)``; mis: ``rho`` where ``floor <= rho <= cap``,
  else 0; icepop: ``rho`` where ``icepop_low <= rho <= icepop_high``, else 0
  (mis_token with those bounds). ``floor=None``: no lower bound.

  Returns:
    ``(c, corrected)``: float32 [N, T] (or [N, 1] at sequence level) and a
    bool of the same shape marking where the bounds truncated or masked.
  """
  if correction not in CORRECTIONS:
    raise ValueError(f"Unknown loss.correction {correction!r}; expected one "
                     f"of {list(CORRECTIONS)}.")
  m = jnp.asarray(mask, jnp.float32)
  if correction == "none":
    return jnp.ones_like(m), jnp.zeros(m.shape, bool)
  log_rho = (old_logp - behaviour_logp) * m
  if correction.endswith("_sequence"):
    log_rho = jnp.sum(log_rho, -1, keepdims=True)
  log_rho = jax.lax.stop_gradient(log_rho)
  if correction == "icepop":
    lo, hi = icepop_low, icepop_high
  else:
    lo, hi = floor, cap
  # In log space: a long sequence's product of ratios stays finite.
  below = (log_rho < jnp.log(lo)) if lo is not None else jnp.zeros_like(
      log_rho, bool)
  above = log_rho > jnp.log(hi)
  outside = below | above
  if correction.startswith("tis"):
    clipped = jnp.minimum(log_rho, jnp.log(hi))
    if lo is not None:
      clipped = jnp.maximum(clipped, jnp.log(lo))
    return jnp.exp(clipped), outside
  return jnp.where(outside, 0.0, jnp.exp(jnp.where(outside, 0.0, log_rho))), outside
