"""Every surrogate x correction x aggregation cell of the policy loss against
a plain-Python loop reference (loss and gradient), the identities between
cells that docs/aggregation.md states, and the combinations refused at
config time."""
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ba_jax.config import schema
from ba_jax.loss import aggregation
from ba_jax.loss import losses
from ba_jax.loss import objectives
from ba_jax.run import checks
from ba_jax.run import setup as setup_lib
from ba_jax.run.checks import ConfigError
import trainer_utils as tu

G = 4
LENGTHS = [3, 7, 1, 0, 5, 2, 7, 4]  # ragged, one empty row
ADV = [1.2, -0.4, -0.4, 0.0, 0.7, 0.7, -1.0, -1.0]
T = 7
MAX_LEN = 9  # dr_grpo's constant
OPTIONS = dict(eps_low=0.2, eps_high=0.28, cispo_cap=1.3, sapo_tau_pos=1.0,
               sapo_tau_neg=1.05, correction_cap=2.0, correction_floor=0.6,
               icepop_low=0.5, icepop_high=2.5, dro_beta=0.7, dppo_tv_low=0.1,
               dppo_tv_high=0.05, dppo_kl_low=0.03, dppo_kl_high=0.011,
               dppo_cap=1.3, kl_cov_ratio=0.2, kl_cov_coef=0.5,
               clip_cov_ratio=0.15, clip_cov_lb=0.05, clip_cov_ub=0.55)
# clip_cov's draw (every call here is one loss call with this key).
KEY = jax.random.key(7)


def _data(seed=0):
  rng = np.random.default_rng(seed)
  mask = (np.arange(T)[None] < np.array(LENGTHS)[:, None]).astype(np.float32)
  logp = (rng.normal(size=(8, T)) * 0.5 - 1.5).astype(np.float32)
  old = (logp + rng.uniform(-0.45, 0.45, (8, T))).astype(np.float32)
  behaviour = (old + rng.uniform(-1.2, 1.2, (8, T))).astype(np.float32)
  return logp, old, behaviour, mask, np.array(ADV, np.float32)


def _cells():
  for s, c, a in itertools.product(objectives.SURROGATES,
                                   objectives.CORRECTIONS,
                                   schema.AGGREGATIONS):
    if s != "luspo" or a == "sequence":
      yield s, c, a


# --- the loop reference (float64, one token at a time) ---------------------

def _ref_weights(m, adv, rule):
  n = len(m)
  L = [sum(row) for row in m]
  total = sum(L)
  w = [[0.0] * T for _ in range(n)]
  for i in range(n):
    for t in range(T):
      if not m[i][t]:
        continue
      if rule == "token":
        w[i][t] = 1.0 / total
      elif rule == "sequence":
        w[i][t] = 1.0 / (L[i] * n)
      elif rule == "dr_grpo":
        w[i][t] = 1.0 / (n * MAX_LEN)
      else:  # balanced: |S| / (T_S N) in the sequence's signed subset
        if adv[i] == 0:
          continue
        g0 = i // G * G
        subset = [j for j in range(g0, g0 + G)
                  if math.copysign(1, adv[j]) == math.copysign(1, adv[i])
                  and adv[j] != 0]
        w[i][t] = len(subset) / (sum(L[j] for j in subset) * n)
  return w


def _ref_correction(o, b, m, kind):
  """Per-token factor c[i][t] and its 'corrected' flag."""
  n = len(m)
  c = [[1.0] * T for _ in range(n)]
  if kind == "none":
    return c
  lo, hi = ((OPTIONS["icepop_low"], OPTIONS["icepop_high"]) if kind == "icepop"
            else (OPTIONS["correction_floor"], OPTIONS["correction_cap"]))
  for i in range(n):
    tokens = [t for t in range(T) if m[i][t]]
    if kind.endswith("_sequence"):
      rhos = [math.exp(sum(o[i][t] - b[i][t] for t in tokens))] * T
    else:
      rhos = [math.exp(o[i][t] - b[i][t]) for t in range(T)]
    for t in tokens:
      rho = rhos[t]
      if kind.startswith("tis"):
        c[i][t] = min(max(rho, lo), hi)
      else:  # mis, icepop: kept inside [lo, hi], else 0
        c[i][t] = rho if lo <= rho <= hi else 0.0
  return c


def _ref_kl_cov_tokens(lp, m, adv):
  """KL-Cov's tokens: the max(1, int(ratio n)) largest covariances among the
  n response tokens of the call (the whole test batch)."""
  tokens = [(i, t) for i in range(len(m)) for t in range(T) if m[i][t]]
  mean_a = sum(adv[i] for i, _ in tokens) / len(tokens)
  mean_lp = sum(lp[i][t] for i, t in tokens) / len(tokens)
  cov = sorted(((adv[i] - mean_a) * (lp[i][t] - mean_lp), (i, t)) for i, t in tokens)
  k = max(1, int(OPTIONS["kl_cov_ratio"] * len(tokens)))
  return {cell for _, cell in cov[-k:]}, [c for c, _ in cov]


def _ref_clip_cov_candidates(lp, o, m, adv):
  """Clip-Cov's candidates (the response tokens PPO did not clip whose
  covariance lies in (lb, ub), means over the call's n tokens), its count
  max(1, int(ratio n)) and the covariances."""
  tokens = [(i, t) for i in range(len(m)) for t in range(T) if m[i][t]]
  mean_a = sum(adv[i] for i, _ in tokens) / len(tokens)
  mean_lp = sum(lp[i][t] for i, t in tokens) / len(tokens)
  cov = {(i, t): (adv[i] - mean_a) * (lp[i][t] - mean_lp) for i, t in tokens}
  el, eh = OPTIONS["eps_low"], OPTIONS["eps_high"]
  candidates = np.zeros((len(m), T), bool)
  for i, t in tokens:
    a, r = adv[i], math.exp(lp[i][t] - o[i][t])
    clipped = (a > 0 and r > 1 + eh) or (a < 0 and r < 1 - el)
    candidates[i, t] = (not clipped and OPTIONS["clip_cov_lb"] < cov[i, t]
                        < OPTIONS["clip_cov_ub"])
  return candidates, max(1, int(OPTIONS["clip_cov_ratio"] * len(tokens))), cov


def _ref_clip_cov_tokens(lp, o, m, adv):
  """The tokens clip_cov zeroes: the draw is ours (``draw_tokens`` with
  KEY, tested below), among the candidates computed here."""
  candidates, count, _ = _ref_clip_cov_candidates(lp, o, m, adv)
  chosen = np.asarray(objectives.draw_tokens(candidates, count, KEY))
  return {(i, t) for i, t in zip(*np.nonzero(chosen))}


def _ref_binary_kl(o, lp):
  p, po, eps = math.exp(lp), math.exp(o), objectives.DPPO_KL_EPS
  return po * (o - lp) + (1 - po) * math.log((1 - po + eps) / (1 - p + eps))


def _dppo(a, lp, o, divergence):
  """(term, d term / d logp) of DPPO-Binary-TV/KL."""
  p, po, r = math.exp(lp), math.exp(o), math.exp(lp - o)
  low, high = OPTIONS[f"dppo_{divergence}_low"], OPTIONS[f"dppo_{divergence}_high"]
  size = p - po if divergence == "tv" else math.copysign(_ref_binary_kl(o, lp), p - po)
  outside = (a > 0 and size > high) or (a < 0 and size < -low)
  weight = 0.0 if outside else min(r, OPTIONS["dppo_cap"])
  return -a * weight * lp, -a * weight


def _ppo(a, r):
  """(term, d term / d log r) of PPO-clip at ratio r."""
  el, eh = OPTIONS["eps_low"], OPTIONS["eps_high"]
  if (a > 0 and r > 1 + eh) or (a < 0 and r < 1 - el):
    return -a * min(max(r, 1 - el), 1 + eh), 0.0
  return -a * r, -a * r


def _reference(logp, old, behaviour, mask, adv, surrogate, correction, rule):
  lp, o, b, m = (x.astype(np.float64).tolist() for x in (logp, old, behaviour, mask))
  w = _ref_weights(m, adv, rule)
  c = _ref_correction(o, b, m, correction)
  chosen = (_ref_kl_cov_tokens(lp, m, adv)[0] if surrogate == "kl_cov" else
            _ref_clip_cov_tokens(lp, o, m, adv) if surrogate == "clip_cov" else set())
  loss, grad = 0.0, np.zeros((len(m), T))
  for i in range(len(m)):
    a = float(adv[i])
    tokens = [t for t in range(T) if m[i][t]]
    L = len(tokens)
    wc = {t: w[i][t] * c[i][t] for t in tokens}
    if surrogate in ("gspo", "gspo_token", "luspo", "gmpo"):
      if surrogate == "gmpo":
        el, eh = OPTIONS["eps_low"], OPTIONS["eps_high"]
        d = {t: lp[i][t] - o[i][t] for t in tokens}
        kept = {t: not ((a > 0 and d[t] > eh) or (a < 0 and d[t] < -el))
                for t in tokens}
        clipped = {t: (0.0 if a == 0 else min(d[t], eh) if a > 0 else max(d[t], -el))
                   for t in tokens}
        s = math.exp(sum(clipped.values()) / max(L, 1))
        term, dterm = -a * s, -a * s
      else:
        s = math.exp(sum(lp[i][t] - o[i][t] for t in tokens) / max(L, 1))
        term, dterm = _ppo(a, s)
        kept = {t: True for t in tokens}
      scale = L if surrogate == "luspo" else 1
      loss += scale * term * sum(wc.values())
      for u in tokens:
        if surrogate == "gspo_token":  # the gradient of token u's own log-prob
          grad[i, u] = wc[u] * dterm
        else:
          grad[i, u] = scale * sum(wc.values()) * dterm * kept[u] / max(L, 1)
      continue
    for t in tokens:
      r = math.exp(lp[i][t] - o[i][t])
      if surrogate == "ppo_clip":
        term, dterm = _ppo(a, r)
      elif surrogate == "clip_cov":  # PPO-clip, zeroed on the drawn tokens
        term, dterm = (0.0, 0.0) if (i, t) in chosen else _ppo(a, r)
      elif surrogate == "cispo":
        weight = min(r, OPTIONS["cispo_cap"])
        term, dterm = -weight * a * lp[i][t], -weight * a
      elif surrogate == "gpg":
        term, dterm = -a * lp[i][t], -a
      elif surrogate == "dro":
        beta, d = OPTIONS["dro_beta"], lp[i][t] - o[i][t]
        term, dterm = -(a * lp[i][t] - 0.5 * beta * d * d), -a + beta * d
      elif surrogate in ("dppo_tv", "dppo_kl"):
        term, dterm = _dppo(a, lp[i][t], o[i][t], surrogate[5:])
      elif surrogate == "kl_cov":
        term, dterm = -a * r, -a * r
        if (i, t) in chosen:
          d, coef = lp[i][t] - o[i][t], OPTIONS["kl_cov_coef"]
          term, dterm = term + coef * abs(d), dterm + coef * math.copysign(1, d)
      else:  # sapo
        tau = OPTIONS["sapo_tau_pos"] if a > 0 else OPTIONS["sapo_tau_neg"]
        sig = 1.0 / (1.0 + math.exp(-tau * (r - 1.0)))
        term, dterm = -a * 4.0 / tau * sig, -a * 4.0 * sig * (1.0 - sig) * r
      loss += wc[t] * term
      grad[i, t] = wc[t] * dterm
  return loss, grad


def _ours(logp, old, behaviour, mask, adv, surrogate, correction, rule,
          **overrides):
  options = dict(OPTIONS, key=KEY, **overrides)
  def loss_of(lp):
    return losses.policy_loss(
        lp, jnp.asarray(old), jnp.asarray(adv), jnp.asarray(mask), group_size=G,
        aggregation=rule, max_response_len=MAX_LEN, surrogate=surrogate,
        correction=correction, behaviour_logp=jnp.asarray(behaviour),
        **options)[0]
  loss, grad = jax.value_and_grad(loss_of)(jnp.asarray(logp))
  return float(loss), np.asarray(grad)


@pytest.fixture(scope="module")
def data():
  return _data()


def test_the_data_reach_every_branch(data):
  """Clips of both signs, tokens and sequences outside the correction's
  bounds on both sides, so no cell passes by being trivial."""
  logp, old, behaviour, mask, adv = data
  on = mask > 0
  r = np.exp(logp - old)[on]
  assert (r > 1 + OPTIONS["eps_high"]).sum() >= 3 and (r < 1 - OPTIONS["eps_low"]).sum() >= 3
  rho = np.exp(old - behaviour)[on]
  assert (rho > OPTIONS["correction_cap"]).sum() >= 3
  assert (rho < OPTIONS["correction_floor"]).sum() >= 3
  assert (rho > OPTIONS["icepop_high"]).sum() >= 1
  rho_seq = np.exp(((old - behaviour) * mask).sum(-1))[np.array(LENGTHS) > 0]
  assert (rho_seq > OPTIONS["correction_cap"]).any() and (rho_seq < OPTIONS["correction_floor"]).any()
  assert ((rho_seq >= OPTIONS["correction_floor"]) & (rho_seq <= OPTIONS["correction_cap"])).any()
  assert (r > OPTIONS["cispo_cap"]).sum() >= 3
  # DPPO: tokens outside each trust region for both signs of A, inside
  # tokens whose weight the cap truncates, no divergence within float32
  # reach of its threshold, and the two divergences disagreeing somewhere.
  a = np.broadcast_to(adv[:, None], mask.shape)[on]
  rise = (np.exp(logp.astype(np.float64)) - np.exp(old.astype(np.float64)))[on]
  kl = np.array([_ref_binary_kl(o_, l_) for o_, l_ in zip(old[on].astype(float),
                                                          logp[on].astype(float))])
  outside = {}
  for name, size in (("tv", rise), ("kl", np.sign(rise) * kl)):
    low, high = OPTIONS[f"dppo_{name}_low"], OPTIONS[f"dppo_{name}_high"]
    outside[name] = ((a > 0) & (size > high)) | ((a < 0) & (size < -low))
    assert ((a > 0) & (size > high)).sum() >= 2 and ((a < 0) & (size < -low)).sum() >= 2
    assert np.abs(np.abs(size) - high).min() > 1e-5 and np.abs(np.abs(size) - low).min() > 1e-5
    assert (~outside[name] & (a != 0) & (r > OPTIONS["dppo_cap"])).sum() >= 2
  assert (outside["tv"] != outside["kl"]).sum() >= 2
  # KL-Cov: several tokens chosen, separated from the next one.
  chosen, cov = _ref_kl_cov_tokens(logp.astype(float).tolist(), mask.tolist(), adv.tolist())
  assert len(chosen) >= 4 and cov[-len(chosen)] - cov[-len(chosen) - 1] > 1e-4
  # Clip-Cov: more candidates than it draws, each with A != 0 (so a drawn
  # token changes the loss), no covariance within 1e-5 of a bound, and
  # clipped tokens inside the bounds (excluded for being clipped).
  candidates, count, cov = _ref_clip_cov_candidates(
      *(x.astype(float).tolist() for x in (logp, old, mask)), adv.tolist())
  assert candidates.sum() >= count + 4 and count >= 3
  assert (adv[np.nonzero(candidates)[0]] != 0).all()
  for bound in (OPTIONS["clip_cov_lb"], OPTIONS["clip_cov_ub"]):
    assert min(abs(c - bound) for c in cov.values()) > 1e-5
  inside = [cell for cell, c in cov.items()
            if OPTIONS["clip_cov_lb"] < c < OPTIONS["clip_cov_ub"]]
  assert len(inside) > candidates.sum()


@pytest.mark.parametrize("surrogate,correction,rule", list(_cells()))
def test_every_cell_equals_the_loop_reference(data, surrogate, correction, rule):
  ref_loss, ref_grad = _reference(*data, surrogate, correction, rule)
  loss, grad = _ours(*data, surrogate, correction, rule)
  # float32 against float64: terms are O(1), weights sum to <= 1 (luspo:
  # times L <= 7), so rounding stays below 1e-6 of the largest entry.
  scale = max(1.0, abs(ref_loss))
  assert abs(loss - ref_loss) <= 2e-6 * scale, (loss, ref_loss)
  np.testing.assert_allclose(grad, ref_grad, rtol=0,
                             atol=2e-6 * max(np.abs(ref_grad).max(), 1e-3))
  assert np.abs(ref_grad).max() > 0


def test_default_objective_is_the_ppo_clip_loss_bit_for_bit(data):
  """surrogate=ppo_clip, correction=none computes exactly sum(w * clip term),
  the loss the trainer had before the axes existed."""
  logp, old, behaviour, mask, adv = data
  for rule in schema.AGGREGATIONS:
    w = aggregation.token_weights(mask, adv, mode=rule, group_size=G,
                                 max_response_len=MAX_LEN)
    term = objectives.clipped_surrogate(logp, old, adv, eps_low=0.2, eps_high=0.28)[0]
    loss, _ = losses.policy_loss(logp, old, adv, mask, group_size=G, aggregation=rule,
                                 eps_low=0.2, eps_high=0.28, max_response_len=MAX_LEN)
    assert np.array_equal(np.asarray(loss), np.asarray(jnp.sum(w * term)))


@pytest.mark.parametrize("rule", schema.AGGREGATIONS)
def test_gspo_token_equals_gspo_unless_the_factor_varies_inside_a_sequence(data, rule):
  """Every rule's weight is constant inside a sequence (w = m c[n]), so with
  a per-sequence factor the token form has GSPO's value and gradient; a
  per-token correction makes the factor vary and separates them."""
  for correction in ("none", "tis_sequence", "mis_sequence"):
    a = _ours(*data, "gspo", correction, rule)
    b = _ours(*data, "gspo_token", correction, rule)
    assert abs(a[0] - b[0]) <= 1e-6
    np.testing.assert_allclose(a[1], b[1], rtol=0, atol=1e-6)
  a = _ours(*data, "gspo", "tis_token", rule)
  b = _ours(*data, "gspo_token", "tis_token", rule)
  assert abs(a[0] - b[0]) <= 1e-6
  assert np.abs(a[1] - b[1]).max() > 1e-3


def test_luspo_is_gspo_under_dr_grpo_times_the_constant(data):
  """LUSPO under sequence weights is sum over a sequence's tokens / N, i.e.
  GSPO under dr_grpo with max_response_len = 1."""
  luspo = _ours(*data, "luspo", "tis_token", "sequence")
  logp, old, behaviour, mask, adv = data
  def loss_of(lp):
    return losses.policy_loss(
        lp, old, adv, mask, group_size=G, aggregation="dr_grpo", max_response_len=1,
        surrogate="gspo", correction="tis_token", behaviour_logp=behaviour, **OPTIONS)[0]
  gspo = jax.value_and_grad(loss_of)(jnp.asarray(logp))
  assert abs(luspo[0] - float(gspo[0])) <= 1e-6 * abs(luspo[0])
  np.testing.assert_allclose(luspo[1], gspo[1], rtol=1e-5, atol=1e-7)


def test_icepop_is_mis_token_with_its_bounds(data):
  icepop = _ours(*data, "ppo_clip", "icepop", "balanced")
  mis = _ours(*data, "ppo_clip", "mis_token", "balanced",
              correction_floor=OPTIONS["icepop_low"], correction_cap=OPTIONS["icepop_high"])
  assert icepop[0] == mis[0]
  np.testing.assert_array_equal(icepop[1], mis[1])


def test_cispo_cap_is_minimax_one_plus_eps_high(data):
  """MiniMax-M1 writes CISPO's weight clip(r, 1 - eps_low, 1 + eps_high) with
  no lower bound in practice; ScaleRL (and TRL) min(r, eps_max): the same
  with cispo_cap = 1 + eps_high (the loop reference uses the clip form)."""
  logp, old, behaviour, mask, adv = data
  eps_high = 0.3
  r = np.exp(logp.astype(np.float64) - old)
  minimax = np.clip(r, 0.0, 1.0 + eps_high)
  w = np.asarray(aggregation.token_weights(mask, adv, mode="token", group_size=G))
  expected = np.sum(w * -minimax * adv[:, None] * logp)
  loss = _ours(*data, "cispo", "none", "token", cispo_cap=1.0 + eps_high)[0]
  assert abs(loss - expected) <= 1e-6 * abs(expected)


def test_corrections_are_exactly_the_identity_when_old_equals_behaviour(data):
  """Where the sampler's and the trainer's log-probs are the same numbers,
  every weight is exp(0) = 1 and no token is corrected: the loss is the
  uncorrected one bit for bit."""
  logp, old, _, mask, adv = data
  base = _ours(logp, old, old, mask, adv, "ppo_clip", "none", "balanced")
  for correction in objectives.CORRECTIONS:
    ours = _ours(logp, old, old, mask, adv, "ppo_clip", correction, "balanced")
    assert ours[0] == base[0], correction
    np.testing.assert_array_equal(ours[1], base[1])


NEW_TOKEN_TERMS = ("gpg", "dro", "dppo_tv", "dppo_kl", "kl_cov")


@pytest.mark.parametrize("rule", schema.AGGREGATIONS)
def test_on_policy_every_log_prob_term_has_the_policy_gradient(data, rule):
  """Where the current log-probs are the old ones (r = 1, the first
  mini-batch of an epoch), DRO's penalty and KL-Cov's |log r| have zero
  gradient, every token is inside DPPO's trust region with weight 1, and
  CISPO's weight is 1: all have GPG's gradient -A w c (their values
  differ: kl_cov and ppo_clip give -A, the rest -A logp)."""
  logp, _, behaviour, mask, adv = data
  gpg = _ours(logp, logp, behaviour, mask, adv, "gpg", "tis_token", rule)
  for surrogate in ("dro", "dppo_tv", "dppo_kl", "cispo", "kl_cov", "ppo_clip"):
    other = _ours(logp, logp, behaviour, mask, adv, surrogate, "tis_token", rule)
    np.testing.assert_allclose(other[1], gpg[1], rtol=1e-6, atol=1e-9, err_msg=surrogate)
  # ... and the gradient is the weights times -A c.
  w = aggregation.token_weights(mask, adv, mode=rule, group_size=G, max_response_len=MAX_LEN)
  c, _ = objectives.correction_weights(logp, behaviour, mask, correction="tis_token",
                                       cap=OPTIONS["correction_cap"],
                                       floor=OPTIONS["correction_floor"])
  np.testing.assert_allclose(gpg[1], -np.asarray(w * c) * adv[:, None], rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("surrogate", ["dppo_tv", "dppo_kl"])
def test_dppo_without_a_trust_region_is_cispo(data, surrogate):
  """Thresholds no token reaches leave DPPO's truncated IS weight alone:
  -sg(min(r, dppo_cap)) A logp, which is CISPO with cispo_cap = dppo_cap."""
  wide = dict(dppo_tv_low=1.0, dppo_tv_high=1.0, dppo_kl_low=1e9, dppo_kl_high=1e9)
  dppo = _ours(*data, surrogate, "mis_token", "balanced", **wide)
  cispo = _ours(*data, "cispo", "mis_token", "balanced", cispo_cap=OPTIONS["dppo_cap"])
  assert dppo[0] == cispo[0]
  np.testing.assert_array_equal(dppo[1], cispo[1])
  narrow = _ours(*data, surrogate, "mis_token", "balanced")
  assert np.abs(narrow[1] - cispo[1]).max() > 1e-3


def test_dppo_reports_masked_and_truncated_tokens_as_clips(data):
  """DPPO's masks fill the clip fractions: masked for A < 0 (low), A > 0
  (high), and tokens inside the region whose weight the cap truncated
  (dual), each over the response tokens."""
  logp, old, _, mask, adv = data
  for surrogate in ("dppo_tv", "dppo_kl"):
    _, ratio, low, high, dual = objectives.surrogate_terms(
        logp, old, adv, mask, surrogate=surrogate, **{
            k: v for k, v in OPTIONS.items() if k.startswith(("dppo", "eps"))})
    metrics = losses.policy_loss(logp, old, adv, mask, group_size=G,
                                 aggregation="token", surrogate=surrogate,
                                 **{k: v for k, v in OPTIONS.items() if k.startswith("dppo")})[1]
    on = mask > 0
    for name, m in (("low", low), ("high", high), ("dual", dual)):
      assert np.asarray(m)[on].sum() >= 2, (surrogate, name)
      assert float(metrics[f"clip_frac_{name}"]) == pytest.approx(
          np.asarray(m)[on].mean(), abs=1e-7)
    assert not (np.asarray(low) & (adv[:, None] >= 0)).any()
    assert not (np.asarray(high) & (adv[:, None] <= 0)).any()
    assert not (np.asarray(dual) & (np.asarray(low) | np.asarray(high))).any()


def test_kl_cov_picks_max_one_floor_ratio_n_tokens():
  rng = np.random.default_rng(3)
  logp = jnp.asarray(rng.normal(size=(4, 9)), jnp.float32)
  adv = jnp.asarray([1.0, -1.0, 0.5, 0.0])
  for lengths, ratio, count in [([9, 9, 9, 9], 0.1, 3), ([9, 9, 9, 9], 0.01, 1),
                                ([2, 0, 1, 0], 1.0, 3), ([0, 0, 0, 0], 0.5, 0),
                                ([9, 5, 9, 0], 0.25, 5)]:
    mask = jnp.asarray(np.arange(9)[None] < np.array(lengths)[:, None])
    chosen = objectives.top_covariance_tokens(adv, logp, mask, ratio)
    assert int(jnp.sum(chosen)) == count and not bool(jnp.any(chosen & ~mask))


def test_kl_cov_depends_on_how_the_mini_batch_is_split(data):
  """KL-Cov picks its tokens among the loss call's (as verl does per
  micro-batch): two halves with the whole batch's weights sum to another
  loss than one call; without the penalty they sum to the same."""
  logp, old, behaviour, mask, adv = data
  w = aggregation.token_weights(mask, adv, mode="balanced", group_size=G)
  def split_loss(coef):
    parts = [losses.policy_loss(logp[s], old[s], adv[s], mask[s], group_size=G,
                                aggregation="balanced", weights=w[s], surrogate="kl_cov",
                                kl_cov_ratio=OPTIONS["kl_cov_ratio"], kl_cov_coef=coef)[0]
             for s in (slice(0, 4), slice(4, 8))]
    whole = losses.policy_loss(logp, old, adv, mask, group_size=G, aggregation="balanced",
                               weights=w, surrogate="kl_cov",
                               kl_cov_ratio=OPTIONS["kl_cov_ratio"], kl_cov_coef=coef)[0]
    return float(sum(parts)), float(whole)
  parts, whole = split_loss(0.0)
  assert abs(parts - whole) <= 1e-6
  parts, whole = split_loss(OPTIONS["kl_cov_coef"])
  assert abs(parts - whole) > 1e-4


def test_draw_tokens_takes_min_count_of_the_candidates():
  """Exactly min(count, #candidates) tokens, all candidates; the same key
  draws the same tokens, other keys other tokens."""
  rng = np.random.default_rng(5)
  for shape, p, count in [((6, 9), 0.4, 5), ((6, 9), 0.4, 1), ((3, 4), 0.5, 40),
                          ((4, 5), 0.0, 3), ((8, 16), 0.9, 30)]:
    candidates = jnp.asarray(rng.random(shape) < p)
    drawn = [np.asarray(objectives.draw_tokens(candidates, count, jax.random.key(k)))
             for k in range(4)]
    for chosen in drawn:
      assert chosen.sum() == min(count, int(candidates.sum()))
      assert not (chosen & ~np.asarray(candidates)).any()
    again = objectives.draw_tokens(candidates, count, jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(again), drawn[0])
    if 0 < count < int(candidates.sum()):
      assert len({c.tobytes() for c in drawn}) > 1, (shape, count)


def test_clip_cov_draws_among_unclipped_tokens_inside_the_bounds(data):
  """With a ratio whose count exceeds the candidates, clip_cov zeroes every
  candidate: its gradient is ppo_clip's (no dual clip) with the
  candidates' entries set to 0; the clip fraction reports the drawn ones
  in the dual slot."""
  logp, old, behaviour, mask, adv = data
  candidates, _, _ = _ref_clip_cov_candidates(
      *(x.astype(float).tolist() for x in (logp, old, mask)), adv.tolist())
  every = _ours(*data, "clip_cov", "none", "token", clip_cov_ratio=1.0)
  ppo = _ours(*data, "ppo_clip", "none", "token")
  np.testing.assert_array_equal(every[1], np.where(candidates, 0.0, ppo[1]))
  assert np.abs(ppo[1][candidates]).min() > 0
  metrics = losses.policy_loss(logp, old, adv, mask, group_size=G, aggregation="token",
                               surrogate="clip_cov", key=KEY, **{
                                   k: v for k, v in OPTIONS.items() if "clip_cov" in k})[1]
  count = max(1, int(OPTIONS["clip_cov_ratio"] * mask.sum()))
  assert float(metrics["clip_frac_dual"]) == pytest.approx(count / mask.sum(), abs=1e-7)


def test_clip_cov_needs_a_key_and_valid_options(data):
  logp, old, _, mask, adv = data
  call = lambda **kw: objectives.surrogate_terms(
      logp, old, adv, mask, surrogate="clip_cov", eps_low=0.2, eps_high=0.2, **kw)
  with pytest.raises(ValueError, match="pass a PRNG key"):
    call()
  with pytest.raises(ValueError, match="loss.clip_cov_ratio must be in \\(0, 1\\]; got 0.0"):
    call(key=KEY, clip_cov_ratio=0.0)
  with pytest.raises(ValueError, match="loss.clip_cov_lb=2.0 must be below loss.clip_cov_ub=1.0"):
    call(key=KEY, clip_cov_lb=2.0, clip_cov_ub=1.0)


# --- refusals at config time -------------------------------------------------

REFUSED = [
    ({"loss.surrogate": "luspo", "loss.aggregation": "balanced"},
     "loss.surrogate='luspo' with loss.aggregation='balanced'"),
    ({"loss.surrogate": "gspo", "loss.dual_clip": 3.0},
     "loss.dual_clip=3.0 with loss.surrogate='gspo'"),
    ({"loss.correction": "tis_token"},
     "loss.correction='tis_token' with rl.old_logp='sampler'"),
    ({"loss.correction": "mis_sequence", "rl.old_logp": "recompute",
      "loss.correction_floor": 2.0}, "loss.correction_floor=2.0 must be below"),
    ({"loss.correction": "icepop", "rl.old_logp": "recompute", "loss.icepop_low": 6.0},
     "loss.icepop_low=6.0 must be below"),
    ({"loss.surrogate": "dro"}, "loss.surrogate='dro' with loss.dro_beta=None"),
    ({"loss.surrogate": "dro", "loss.dro_beta": 0.0}, "loss.dro_beta=0.0: expected > 0"),
    ({"loss.surrogate": "dro", "loss.dro_beta": -1.0}, "loss.dro_beta=-1.0: expected > 0"),
    ({"loss.dppo_tv_high": 1.5}, "loss.dppo_tv_high=1.5: expected in [0, 1]"),
    ({"loss.dppo_kl_low": -0.1}, "loss.dppo_kl_low=-0.1: expected >= 0"),
    ({"loss.dppo_cap": 0.0}, "loss.dppo_cap=0.0: expected > 0"),
    ({"loss.kl_cov_ratio": 0.0}, "loss.kl_cov_ratio=0.0: expected in (0, 1]"),
    ({"loss.kl_cov_ratio": 1.5}, "loss.kl_cov_ratio=1.5: expected in (0, 1]"),
    ({"loss.kl_cov_coef": -0.5}, "loss.kl_cov_coef=-0.5: expected >= 0"),
    ({"loss.clip_cov_ratio": 0.0}, "loss.clip_cov_ratio=0.0: expected in (0, 1]"),
    ({"loss.clip_cov_ratio": 1.5}, "loss.clip_cov_ratio=1.5: expected in (0, 1]"),
    ({"loss.clip_cov_ub": float("inf")}, "loss.clip_cov_ub=inf: expected finite"),
    ({"loss.surrogate": "clip_cov", "loss.clip_cov_lb": 5.0},
     "loss.clip_cov_lb=5.0 must be below loss.clip_cov_ub=5.0"),
    ({"loss.surrogate": "ppo_kl"}, "loss.surrogate='ppo_kl': expected one of"),
    ({"loss.correction": "tis"}, "loss.correction='tis': expected one of"),
]


@pytest.mark.parametrize("overrides,message", REFUSED)
def test_meaningless_combinations_are_refused_with_one_line(overrides, message):
  config = tu.smoke_config(**overrides)
  with pytest.raises(ConfigError) as err:
    setup_lib.make_setup(config, abstract=True)
  assert message in str(err.value)
  assert "\n" not in str(err.value)


def test_every_other_combination_is_accepted():
  """Each surrogate with each correction (rl.old_logp=recompute) and rule,
  luspo under sequence only (dro with its beta), passes the config checks."""
  for surrogate, correction, rule in _cells():
    config = tu.smoke_config(**{"loss.surrogate": surrogate, "loss.correction": correction,
                                "loss.aggregation": rule, "rl.old_logp": "recompute",
                                "loss.dro_beta": 0.5})
    cfg = checks.step_config(schema.parse(config))
    assert (cfg.surrogate, cfg.correction, cfg.aggregation) == (surrogate, correction, rule)
