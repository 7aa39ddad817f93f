"""Our policy loss equals verl 0.9.1's own policy-loss functions, loss and
gradient, on fixed float32 tensors: random log-probs (current, old and the
sampler's), advantages of both signs with one all-zero group, ragged masks
(one row empty), G = 4 responses per group.

verl's side is its code as installed: `core_algos.get_policy_loss_fn(mode)`
called as its actor calls it (token-level advantages, an `ActorConfig`, the
`global_batch_info` the actor fills in: `dp_size=1`, the mini-batch's token
count and `global_batch_size = N`), with the rollout-correction weights
from `rollout_corr_helper.compute_rollout_correction_and_rejection_mask`,
the function its trainer calls. verl 0.9.1 pins `transformers<5.11` (we need
>= 5.24), so it installs only with `--no-deps`: `.ci/run` does that; its
import-time dependencies are in the `test` extra (docs/aggregation.md).

The mapping (docs/aggregation.md, "Which peer calls each cell what"):
`loss_agg_mode` is our rule (`token-mean` -> token, `seq-mean-token-mean`
-> sequence, `seq-mean-token-sum-norm` -> dr_grpo with max_response_len =
`loss_scale_factor`, `seq-mean-token-sum` -> dr_grpo with 1); `loss_mode`
is our surrogate (`vanilla` -> ppo_clip with dual_clip = `clip_ratio_c`,
which verl always applies; `gspo` -> gspo_token; `geo_mean` -> gmpo and
`sapo` -> sapo, both under sequence whatever `loss_agg_mode` says;
`cispo` -> cispo with `1 + clip_ratio_high` = cispo_cap and no lower clip;
`gpg` -> gpg; `dro` -> dro with `dro_beta`; `dppo_tv`/`dppo_kl` ->
dppo_tv/dppo_kl with `clip_ratio_low`/`clip_ratio_high` as the divergence
thresholds and `clip_ratio_c` as dppo_cap; `kl_cov` -> kl_cov with
`kl_cov_ratio` and `ppo_kl_coef` as kl_cov_coef; `clip_cov` -> clip_cov
with `clip_cov_ratio`/`clip_cov_lb`/`clip_cov_ub`, no dual clip);
`rollout_is` x `rollout_is_threshold` is our correction (token/sequence
with a cap -> tis_token/tis_sequence without a floor; with "low_high" ->
icepop (= mis_token) / mis_sequence). Not mapped: `token-sum` (N times
dr_grpo with 1, tested below),
IS batch normalisation; `geo_mean` with a token-level correction and
rejection sampling differ from ours, and the tests below pin down how.

Each verl cell must match its mapped cell and no other of ours (every
surrogate x rule x correction, loss and gradient), so a swapped mapping
fails.

`clip_cov` zeroes a random subset of its candidate tokens, drawn with
`torch.randperm` there and with a PRNG key here: the draws cannot agree by
themselves. Two regimes: `clip_cov` (ratio 1) draws at least as many
tokens as there are candidates, so both take all of them whatever the
draw; `clip_cov@few` draws 4 of 12, and the test hands verl a
`torch.randperm` that lists the candidates ours drew first (in the order
verl's `torch.nonzero` lists the candidates), so both zero the same tokens.
"""
import importlib
import importlib.metadata
import itertools
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from ba_jax.loss import aggregation, losses, objectives

core_algos = pytest.importorskip(
    "verl.trainer.ppo.core_algos",
    reason="verl 0.9.1 pins transformers<5.11 (ba_jax needs >=5.24), so it "
    "installs only without its dependencies, as .ci/run does: "
    "pip install --no-deps verl==0.9.1")
rollout_corr = importlib.import_module("verl.trainer.ppo.rollout_corr_helper")

G = 4
LENGTHS = [3, 10, 6, 0, 8, 2, 10, 5, 4, 7, 1, 9]
N, T = len(LENGTHS), 10
EPS_LOW, EPS_HIGH = 0.2, 0.28
DUAL = 3.0          # verl's clip_ratio_c default, always applied by `vanilla`
NO_DUAL = 1e4       # a clip_ratio_c no token reaches: the dual clip off
CISPO_CAP = 1.3
TAU_POS, TAU_NEG = 1.0, 1.05
DRO_BETA = 1.0
DPPO_TV = (0.12, 0.08)     # (low, high): verl's clip_ratio_low/high for dppo_tv
DPPO_KL = (0.03, 0.045)    # the same for dppo_kl, in nats
DPPO_CAP = DUAL            # verl passes its clip_ratio_c (default 3.0)
KL_COV_RATIO, KL_COV_COEF = 0.1, 1.0
CLIP_COV_LB, CLIP_COV_UB = 0.2, 0.62
# clip_cov's ratio per variant: every candidate drawn, or 4 of them.
CLIP_COV_RATIOS = {"clip_cov@all": 1.0, "clip_cov@few": 0.07}
KEY = jax.random.key(3)  # our clip_cov's draw
SCALE = 16          # loss_scale_factor, the dr_grpo constant
CAP, FLOOR = 2.0, 0.6
LOW, HIGH = 0.5, 2.5  # IcePop's bounds
# float32 on both sides, the same formulas in other orders: a few ulps of
# O(1) terms over ~60 tokens, weights summing to <= 1 (<= 10 for constant 1).
LOSS_ATOL = 1e-5
GRAD_ATOL = 1e-6
# Distinct cells of ours differ from verl's in loss or gradient by more than
# this fraction of verl's.
DISTINCT = 1e-2

# Our surrogates: key -> (loss.surrogate, loss.dual_clip).
SURROGATES = {
    "ppo_clip": ("ppo_clip", None), "ppo_clip@dual": ("ppo_clip", DUAL),
    "gspo": ("gspo", None), "gspo_token": ("gspo_token", None),
    "gmpo": ("gmpo", None), "cispo": ("cispo", None), "sapo": ("sapo", None),
    "luspo": ("luspo", None), "gpg": ("gpg", None), "dro": ("dro", None),
    "dppo_tv": ("dppo_tv", None), "dppo_kl": ("dppo_kl", None),
    "kl_cov": ("kl_cov", None), "clip_cov@all": ("clip_cov", None),
    "clip_cov@few": ("clip_cov", None)}
# Our rules: key -> (loss.aggregation, loss.max_response_len).
RULES = {"token": ("token", None), "sequence": ("sequence", None),
         f"dr_grpo@{SCALE}": ("dr_grpo", SCALE), "dr_grpo@1": ("dr_grpo", 1),
         "balanced": ("balanced", None)}
# Our corrections: key -> (loss.correction, its bounds).
CORRECTIONS = {
    "none": ("none", {}),
    "tis_token": ("tis_token", dict(correction_cap=CAP)),
    "tis_token@floor": ("tis_token", dict(correction_cap=CAP,
                                          correction_floor=FLOOR)),
    "tis_sequence": ("tis_sequence", dict(correction_cap=CAP)),
    "icepop": ("icepop", dict(icepop_low=LOW, icepop_high=HIGH)),
    "mis_token": ("mis_token", dict(correction_floor=LOW, correction_cap=HIGH)),
    "mis_sequence": ("mis_sequence", dict(correction_floor=LOW,
                                          correction_cap=HIGH)),
}
TOKEN_LEVEL = ("tis_token", "tis_token@floor", "icepop", "mis_token")

# verl loss_mode[@variant] -> (our surrogate, the rule it forces or None).
VERL_LOSSES = {
    "vanilla": ("ppo_clip@dual", None),
    "vanilla@no_dual": ("ppo_clip", None),
    "gspo": ("gspo_token", None),
    "geo_mean": ("gmpo", "sequence"),
    "cispo": ("cispo", None),
    "sapo": ("sapo", "sequence"),
    "gpg": ("gpg", None),
    "dro": ("dro", None),
    "dppo_tv": ("dppo_tv", None),
    "dppo_kl": ("dppo_kl", None),
    "kl_cov": ("kl_cov", None),
    "clip_cov": ("clip_cov@all", None),
    "clip_cov@few": ("clip_cov@few", None),
}
# verl loss_agg_mode -> our rule.
VERL_RULES = {"token-mean": "token", "seq-mean-token-mean": "sequence",
              "seq-mean-token-sum-norm": f"dr_grpo@{SCALE}",
              "seq-mean-token-sum": "dr_grpo@1"}
# verl (rollout_is, rollout_is_threshold) -> our correction.
VERL_CORRECTIONS = {
    "off": (None, None, "none"),
    "token:cap": ("token", CAP, "tis_token"),
    "sequence:cap": ("sequence", CAP, "tis_sequence"),
    "token:low_high": ("token", f"{LOW}_{HIGH}", "icepop"),
    "sequence:low_high": ("sequence", f"{LOW}_{HIGH}", "mis_sequence"),
}


def _data():
  rng = np.random.default_rng(45)
  mask = (np.arange(T)[None] < np.array(LENGTHS)[:, None]).astype(np.float32)
  logp = rng.normal(size=(N, T)) * 0.5 - 1.5
  # A per-row shift moves the sequence ratios out of the clip range (gspo,
  # gmpo); a few large token ratios reach the dual clip.
  old = (logp - rng.uniform(-0.5, 0.5, (N, 1))
         + rng.uniform(-0.45, 0.45, (N, T)) - 1.6 * (rng.random((N, T)) < 0.1))
  sampler = old + rng.uniform(-1.2, 1.2, (N, T))
  adv = rng.normal(size=N)
  adv[8:] = 0.0  # a group whose rewards were all equal
  return tuple(np.asarray(x, np.float32) for x in (logp, old, sampler, mask,
                                                   adv))


@pytest.fixture(scope="module")
def data():
  return _data()


def _config(loss_key: str, mask, **overrides):
  """verl's ActorConfig for one loss, with the actor's global_batch_info."""
  options = dict(clip_ratio_low=EPS_LOW, clip_ratio_high=EPS_HIGH,
                 clip_ratio_c=NO_DUAL if loss_key == "vanilla@no_dual" else DUAL,
                 tau_pos=TAU_POS, tau_neg=TAU_NEG, loss_scale_factor=SCALE)
  if loss_key == "cispo":  # no lower clip; 1 + clip_ratio_high is the cap
    options.update(clip_ratio_low=1.0, clip_ratio_high=CISPO_CAP - 1.0)
  if loss_key in ("dppo_tv", "dppo_kl"):  # the clip ratios are the thresholds
    low, high = DPPO_TV if loss_key == "dppo_tv" else DPPO_KL
    options.update(clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=DPPO_CAP)
  if loss_key in ("dro", "kl_cov", "clip_cov", "clip_cov@few"):
    options["policy_loss"] = rollout_corr.PolicyLossConfig(
        loss_mode=loss_key.split("@")[0], dro_beta=DRO_BETA,
        kl_cov_ratio=KL_COV_RATIO, ppo_kl_coef=KL_COV_COEF,
        clip_cov_ratio=CLIP_COV_RATIOS[VERL_LOSSES[loss_key][0]]
        if loss_key.startswith("clip_cov") else None,
        clip_cov_lb=CLIP_COV_LB, clip_cov_ub=CLIP_COV_UB)
  options.update(overrides)
  options.setdefault("global_batch_info", dict(
      dp_size=1, batch_num_tokens=int(np.sum(mask)), global_batch_size=N,
      loss_scale_factor=options["loss_scale_factor"]))
  return core_algos.ActorConfig(strategy="fsdp", rollout_n=G,
                                use_dynamic_bsz=True, **options)


def _verl(data, loss_key, agg_mode, correction_key="off", config=None,
          mask=None, old=None):
  """verl's loss and d loss / d logp for one cell."""
  logp, old_, sampler, mask_, adv = data
  old = old_ if old is None else old
  mask = mask_ if mask is None else mask
  leaf = torch.tensor(logp, requires_grad=True)
  level, threshold, _ = VERL_CORRECTIONS[correction_key]
  weights = None
  if level is not None:
    proto, _, _ = rollout_corr.compute_rollout_correction_and_rejection_mask(
        old_log_prob=torch.tensor(old), rollout_log_prob=torch.tensor(sampler),
        response_mask=torch.tensor(mask), rollout_is=level,
        rollout_is_threshold=threshold)
    weights = proto.batch["rollout_is_weights"]
  fn = core_algos.get_policy_loss_fn(loss_key.split("@")[0])
  loss, _ = fn(old_log_prob=torch.tensor(old), log_prob=leaf,
               advantages=torch.tensor(adv)[:, None].expand(N, T),
               response_mask=torch.tensor(mask), loss_agg_mode=agg_mode,
               config=config or _config(loss_key, mask),
               rollout_is_weights=weights)
  loss.backward()
  return loss.item(), leaf.grad.numpy().copy()


def _ours(data, surrogate_key, rule_key, correction_key, *, mask=None,
          old=None, **options):
  logp, old_, sampler, mask_, adv = data
  surrogate, dual = SURROGATES[surrogate_key]
  rule, constant = RULES[rule_key] if rule_key in RULES else rule_key
  correction, bounds = CORRECTIONS[correction_key]
  options = dict(dict(
      cispo_cap=CISPO_CAP, dro_beta=DRO_BETA, dppo_tv_low=DPPO_TV[0],
      dppo_tv_high=DPPO_TV[1], dppo_kl_low=DPPO_KL[0], dppo_kl_high=DPPO_KL[1],
      dppo_cap=DPPO_CAP, kl_cov_ratio=KL_COV_RATIO, kl_cov_coef=KL_COV_COEF,
      clip_cov_ratio=CLIP_COV_RATIOS.get(surrogate_key, 2e-4),
      clip_cov_lb=CLIP_COV_LB, clip_cov_ub=CLIP_COV_UB, key=KEY), **options)
  def loss_of(lp):
    return losses.policy_loss(
        lp, jnp.asarray(old_ if old is None else old), jnp.asarray(adv),
        jnp.asarray(mask_ if mask is None else mask), group_size=G,
        aggregation=rule, eps_low=EPS_LOW, eps_high=EPS_HIGH, dual_clip=dual,
        max_response_len=constant, surrogate=surrogate, correction=correction,
        behaviour_logp=jnp.asarray(sampler), sapo_tau_pos=TAU_POS,
        sapo_tau_neg=TAU_NEG, **bounds, **options)[0]
  loss, g = jax.value_and_grad(loss_of)(jnp.asarray(logp))
  return float(loss), np.asarray(g)


@pytest.fixture(scope="module")
def our_cells(data):
  """Every cell of ours that a mapping could land on: (loss, gradient)."""
  cells = {}
  for s, r, c in itertools.product(SURROGATES, RULES, CORRECTIONS):
    if s != "luspo" or r == "sequence":
      cells[s, r, c] = _ours(data, s, r, c)
  return cells


def _clip_cov_tokens(data, ratio):
  """Our clip_cov's (candidates, drawn tokens) on the data, as the loss
  draws them (KEY, the whole batch one call)."""
  logp, old, _, mask, adv = data
  r = np.exp(logp - old)
  a = adv[:, None]
  clipped = -a * np.clip(r, 1 - EPS_LOW, 1 + EPS_HIGH) > -a * r
  chosen, candidates = objectives.clip_cov_tokens(
      jnp.asarray(adv), jnp.asarray(logp), jnp.asarray(mask), jnp.asarray(clipped),
      ratio=ratio, lb=CLIP_COV_LB, ub=CLIP_COV_UB, key=KEY)
  return np.asarray(candidates), np.asarray(chosen)


def _randperm_drawing(candidates, chosen):
  """A stand-in for torch.randperm(n) that puts the candidates ours drew
  first, numbered as verl's torch.nonzero lists them (row-major)."""
  drawn = chosen[candidates]  # row-major, as torch.nonzero
  def randperm(n, *args, **kwargs):
    assert n == candidates.sum(), (n, candidates.sum())  # verl's candidates are ours
    order = np.concatenate([np.flatnonzero(drawn), np.flatnonzero(~drawn)])
    return torch.tensor(order, dtype=torch.long)
  return randperm


def _equivalents(surrogate, rule, correction):
  """The cells of ours equal to this one by the identities
  docs/aggregation.md states (and tests/test_objectives.py checks)."""
  same = {(surrogate, rule, correction)}
  if correction == "icepop":  # icepop (a, b) is mis_token with (a, b)
    same.add((surrogate, rule, "mis_token"))
  for s, r, c in list(same):
    # gspo_token has gspo's gradient unless a token-level factor varies
    # inside the sequence.
    if s in ("gspo", "gspo_token") and c not in TOKEN_LEVEL:
      same |= {("gspo", r, c), ("gspo_token", r, c)}
  for s, r, c in list(same):
    if s == "gspo" and r == "dr_grpo@1":  # sum_n L l / N both ways
      same.add(("luspo", "sequence", c))
  return same


def _verl_cells():
  for loss_key, agg_mode, correction_key in itertools.product(
      VERL_LOSSES, VERL_RULES, VERL_CORRECTIONS):
    # geo_mean folds a token-level correction into a geometric mean over the
    # sequence: test_geo_mean_takes_the_geometric_mean_of_token_weights.
    if loss_key == "geo_mean" and correction_key in ("token:cap",
                                                     "token:low_high"):
      continue
    yield loss_key, agg_mode, correction_key


def test_the_installed_verl_is_the_one_ci_installs():
  """The mapping above is verl 0.9.1's; .ci/run pins what CI installs."""
  run = (pathlib.Path(__file__).resolve().parents[1] / ".ci" / "run").read_text()
  pinned = re.search(r"--no-deps verl==([\w.]+)", run)
  assert pinned and pinned.group(1) == "0.9.1", pinned
  assert importlib.metadata.version("verl") == pinned.group(1)


def test_the_data_make_every_clip_act(data):
  logp, old, sampler, mask, adv = data
  on = mask > 0
  r = np.exp(logp - old)
  neg = (adv < 0)[:, None] & on
  assert (r[neg] > DUAL).sum() >= 2  # the dual clip
  assert (r[on] > 1 + EPS_HIGH).sum() >= 3 and (r[on] < 1 - EPS_LOW).sum() >= 3
  assert (r[on] > CISPO_CAP).sum() >= 3
  # gspo's clip zeroes a sequence's gradient for either sign.
  seq = np.exp(((logp - old) * mask).sum(-1) / np.maximum(mask.sum(-1), 1))
  assert ((seq > 1 + EPS_HIGH) & (adv > 0)).any()
  assert ((seq < 1 - EPS_LOW) & (adv < 0)).any()
  rho = np.exp(old - sampler)[on]
  assert (rho > HIGH).sum() >= 2 and (rho < LOW).sum() >= 2
  assert (rho > CAP).sum() >= 3 and (rho < FLOOR).sum() >= 3
  # Sequence-level weights above, below and inside the bounds, on rows
  # whose advantage is non-zero.
  rho_seq = np.exp(((old - sampler) * mask).sum(-1))
  rho_seq = rho_seq[(np.array(LENGTHS) > 0) & (adv != 0)]
  assert (rho_seq > HIGH).any() and (rho_seq < LOW).any()
  assert ((rho_seq >= LOW) & (rho_seq <= HIGH)).sum() >= 3
  # DPPO: both trust regions mask tokens of both signs (and differ), no
  # divergence lies within float32 reach of a threshold, and the cap
  # truncates tokens inside the region; over the tokens with A != 0 (one
  # with A = 0 has an old log-prob above 0, whose binary KL is undefined).
  signed = on & (adv != 0)[:, None]
  a = np.broadcast_to(adv[:, None], mask.shape)[signed]
  lp, lo = logp[signed].astype(np.float64), old[signed].astype(np.float64)
  p, p_old = np.exp(lp), np.exp(lo)
  kl = p_old * (lo - lp) + (1 - p_old) * np.log((1 - p_old) / (1 - p))
  outside = {}
  for (low, high), size in ((DPPO_TV, p - p_old), (DPPO_KL, np.sign(p - p_old) * kl)):
    up, down = (a > 0) & (size > high), (a < 0) & (size < -low)
    assert up.sum() >= 2 and down.sum() >= 2
    assert min(np.abs(np.abs(size) - high).min(), np.abs(np.abs(size) - low).min()) > 1e-5
    assert (~(up | down) & (r[signed] > DPPO_CAP)).sum() >= 1
    outside[low] = up | down
  assert (outside[DPPO_TV[0]] != outside[DPPO_KL[0]]).sum() >= 2
  # KL-Cov: the chosen tokens (among all of them) are separated from the next.
  a = np.broadcast_to(adv[:, None], mask.shape)[on]
  lp = logp[on].astype(np.float64)
  cov = np.sort((a - a.mean()) * (lp - lp.mean()))[::-1]
  k = max(1, int(KL_COV_RATIO * on.sum()))
  assert k >= 4 and cov[k - 1] - cov[k] > 1e-4
  # Clip-Cov: no covariance within 1e-5 of a bound; clipped tokens inside
  # the bounds (left out); candidates of both A != 0 and A = 0; "few" draws
  # fewer than them, tokens with A != 0 among its draw and among the rest.
  assert min(np.abs(cov - CLIP_COV_LB).min(), np.abs(cov - CLIP_COV_UB).min()) > 1e-5
  candidates, every = _clip_cov_tokens(data, CLIP_COV_RATIOS["clip_cov@all"])
  _, few = _clip_cov_tokens(data, CLIP_COV_RATIOS["clip_cov@few"])
  cov_nt = ((adv[:, None] - a.mean()) * (logp - lp.mean()))
  inside = on & (cov_nt > CLIP_COV_LB) & (cov_nt < CLIP_COV_UB)
  assert (inside & ~candidates).sum() >= 3
  signed = (adv != 0)[:, None]
  assert (candidates & signed).sum() >= 6 and (candidates & ~signed).sum() >= 2
  assert np.array_equal(every, candidates)
  assert few.sum() == max(1, int(CLIP_COV_RATIOS["clip_cov@few"] * on.sum())) == 4
  assert (few & signed).sum() >= 2 and (candidates & ~few & signed).sum() >= 2


@pytest.mark.parametrize("loss_key,agg_mode,correction_key", list(_verl_cells()))
def test_loss_and_gradient_equal_verl(data, our_cells, loss_key, agg_mode,
                                      correction_key, monkeypatch):
  surrogate, forced_rule = VERL_LOSSES[loss_key]
  rule = forced_rule or VERL_RULES[agg_mode]
  correction = VERL_CORRECTIONS[correction_key][2]
  if loss_key == "clip_cov@few":  # verl draws the tokens ours drew
    monkeypatch.setattr(torch, "randperm", _randperm_drawing(
        *_clip_cov_tokens(data, CLIP_COV_RATIOS[surrogate])))
  verl_loss, verl_grad = _verl(data, loss_key, agg_mode, correction_key)
  loss, grad = our_cells[surrogate, rule, correction]
  assert abs(loss - verl_loss) <= LOSS_ATOL, (loss, verl_loss)
  np.testing.assert_allclose(grad, verl_grad, rtol=0, atol=GRAD_ATOL)
  assert np.abs(verl_grad).max() > 1e-3
  # No other cell of ours has verl's loss and gradient: a swapped axis fails.
  mapped = _equivalents(surrogate, rule, correction)
  scale = np.abs(verl_grad).max()
  near = [cell for cell, (value, g) in our_cells.items() if cell not in mapped
          and abs(value - verl_loss) <= DISTINCT * abs(verl_loss) + LOSS_ATOL
          and np.abs(g - verl_grad).max() <= DISTINCT * scale]
  assert not near, near


def test_a_swapped_mapping_fails(data, our_cells):
  """The check above has teeth: verl's token-mean is not our sequence rule,
  nor its vanilla our ppo_clip without the dual clip, on these data."""
  verl_loss, verl_grad = _verl(data, "vanilla", "token-mean")
  for cell in [("ppo_clip@dual", "sequence", "none"),
               ("ppo_clip", "token", "none"),
               ("ppo_clip@dual", "token", "tis_token")]:
    loss, grad = our_cells[cell]
    assert (abs(loss - verl_loss) > LOSS_ATOL
            or np.abs(grad - verl_grad).max() > GRAD_ATOL), cell


@pytest.mark.parametrize("agg_mode", list(VERL_RULES))
def test_without_global_batch_info_empty_rows_leave_the_mean(data, our_cells,
                                                             agg_mode):
  """Called without the actor's global_batch_info, verl's seq-mean-* modes
  divide by the rows that hold a token (11 here), ours (and verl's actor,
  which passes global_batch_size = N) by all N rows; token-mean agrees."""
  mask = data[3]
  config = _config("vanilla", mask,
                   global_batch_info=dict(loss_scale_factor=SCALE))
  verl_loss, verl_grad = _verl(data, "vanilla", agg_mode, config=config)
  loss, grad = our_cells["ppo_clip@dual", VERL_RULES[agg_mode], "none"]
  factor = 1.0 if agg_mode == "token-mean" else N / np.sum(mask.sum(-1) > 0)
  assert factor == 1.0 or factor == N / (N - 1)
  assert abs(loss * factor - verl_loss) <= LOSS_ATOL
  np.testing.assert_allclose(grad * factor, verl_grad, rtol=0, atol=GRAD_ATOL)


def test_token_sum_norm_without_a_scale_divides_by_the_padded_width(data):
  """loss_scale_factor=None: verl's constant is the tensor's width T (here
  10), not the response budget; ours is loss.max_response_len."""
  mask = data[3]
  config = _config("vanilla", mask, loss_scale_factor=None)
  verl_loss, verl_grad = _verl(data, "vanilla", "seq-mean-token-sum-norm",
                               config=config)
  loss, grad = _ours(data, "ppo_clip@dual", ("dr_grpo", T), "none")
  assert abs(loss - verl_loss) <= LOSS_ATOL
  np.testing.assert_allclose(grad, verl_grad, rtol=0, atol=GRAD_ATOL)


def test_token_sum_is_n_times_dr_grpo_with_constant_one(data, our_cells):
  verl_loss, verl_grad = _verl(data, "vanilla", "token-sum")
  loss, grad = our_cells["ppo_clip@dual", "dr_grpo@1", "none"]
  assert abs(N * loss - verl_loss) <= N * LOSS_ATOL
  np.testing.assert_allclose(N * grad, verl_grad, rtol=0, atol=N * GRAD_ATOL)


def test_cispo_with_verls_default_lower_clip(data, our_cells):
  """verl clips CISPO's weight on both sides, clip(r, 1 - clip_ratio_low,
  1 + clip_ratio_high); MiniMax-M1 sets no lower bound in practice, which
  is ours (clip_ratio_low = 1 above). With verl's default 0.2 the gradient
  differs exactly on the tokens with r < 0.8: verl's is ours * 0.8 / r."""
  logp, old, _, mask, _ = data
  config = _config("cispo", mask, clip_ratio_low=EPS_LOW)
  verl_loss, verl_grad = _verl(data, "cispo", "token-mean", config=config)
  loss, grad = our_cells["cispo", "token", "none"]
  r = np.exp(logp - old)
  low = (r < 1 - EPS_LOW) & (mask > 0) & (data[4] != 0)[:, None]
  assert low.sum() >= 3
  assert np.abs(verl_grad - grad).max() > DISTINCT * np.abs(grad).max()
  expected = np.where(low, grad * (1 - EPS_LOW) / r, grad)
  np.testing.assert_allclose(verl_grad, expected, rtol=1e-5, atol=GRAD_ATOL)


@pytest.mark.parametrize("correction_key", ["token:cap", "token:low_high"])
def test_geo_mean_takes_the_geometric_mean_of_token_weights(data, our_cells,
                                                            correction_key):
  """verl's geo_mean scales sequence n's term by exp(mean_t log(c + 1e-10)),
  the geometric mean of its token weights (an IcePop-masked token scales
  the sequence by about exp(-23 / L)); ours multiplies each token's share of
  the term by its own factor: the arithmetic mean. Both readings, built from
  our weights, surrogate and correction functions."""
  logp, old, sampler, mask, adv = data
  correction = VERL_CORRECTIONS[correction_key][2]
  name, bounds = CORRECTIONS[correction]
  bounds = {k.replace("correction_", ""): v for k, v in bounds.items()}
  c, _ = objectives.correction_weights(jnp.asarray(old), jnp.asarray(sampler),
                                       jnp.asarray(mask), correction=name,
                                       **bounds)
  m = jnp.asarray(mask)
  geometric = jnp.exp(jnp.sum(jnp.log(c + 1e-10) * m, -1)
                      / (jnp.sum(m, -1) + 1e-8))
  weights = aggregation.token_weights(m, jnp.asarray(adv), mode="sequence",
                                      group_size=G)
  def verl_reading(lp):
    terms = objectives.surrogate_terms(
        lp, jnp.asarray(old), jnp.asarray(adv), m, surrogate="gmpo",
        eps_low=EPS_LOW, eps_high=EPS_HIGH)[0]
    return jnp.sum(weights * terms * geometric[:, None])
  reading, reading_grad = jax.value_and_grad(verl_reading)(jnp.asarray(logp))
  verl_loss, verl_grad = _verl(data, "geo_mean", "token-mean", correction_key)
  assert abs(float(reading) - verl_loss) <= LOSS_ATOL
  np.testing.assert_allclose(np.asarray(reading_grad), verl_grad, rtol=0,
                             atol=GRAD_ATOL)
  loss, grad = our_cells["gmpo", "sequence", correction]
  assert np.abs(grad - verl_grad).max() > DISTINCT * np.abs(verl_grad).max()


def test_rejection_sampling_drops_tokens_from_the_mask(data):
  """verl's rollout_rs="token_k1" with "a_b" keeps a token when
  a <= pi_rollout / pi_old <= b, that is 1/b <= rho <= 1/a for our
  rho = pi_old / pi_rollout, and removes the rest from the mask, so the
  rule's denominators shrink (the trainer recounts the tokens). That is our
  `none` on the kept mask, the kept set being the one our mis_token with
  floor 1/b and cap 1/a keeps; ours (mis_token, icepop) keeps a masked
  token in the denominators and weighs a kept one by rho."""
  logp, old, sampler, mask, adv = data
  a, b = 0.6, 2.5
  _, kept_mask, _ = rollout_corr.compute_rollout_correction_and_rejection_mask(
      old_log_prob=torch.tensor(old), rollout_log_prob=torch.tensor(sampler),
      response_mask=torch.tensor(mask), rollout_rs="token_k1",
      rollout_rs_threshold=f"{a}_{b}")
  kept_mask = kept_mask.numpy()
  _, outside = objectives.correction_weights(
      jnp.asarray(old), jnp.asarray(sampler), jnp.asarray(mask),
      correction="mis_token", floor=1 / b, cap=1 / a)
  np.testing.assert_array_equal(kept_mask, mask * ~np.asarray(outside))
  _, naive = objectives.correction_weights(
      jnp.asarray(old), jnp.asarray(sampler), jnp.asarray(mask),
      correction="mis_token", floor=a, cap=b)
  assert (np.asarray(naive) != np.asarray(outside))[mask > 0].sum() >= 3
  for agg_mode in ("token-mean", "seq-mean-token-mean"):
    verl_loss, verl_grad = _verl(data, "vanilla", agg_mode, mask=kept_mask,
                                 config=_config("vanilla", kept_mask))
    loss, grad = _ours(data, "ppo_clip@dual", VERL_RULES[agg_mode], "none",
                       mask=kept_mask)
    assert abs(loss - verl_loss) <= LOSS_ATOL
    np.testing.assert_allclose(grad, verl_grad, rtol=0, atol=GRAD_ATOL)


@pytest.mark.parametrize("agg_mode", ["token-mean", "seq-mean-token-mean"])
def test_bypass_mode(data, agg_mode):
  """Bypass mode (old = the sampler's log-probs, our rl.old_logp="sampler"):
  with loss_type="ppo_clip" it is vanilla; with "reinforce" and a token IS
  cap it weighs -A logp by sg(min(pi / pi_rollout, cap)), which is our
  cispo with cispo_cap = cap."""
  logp, old, sampler, mask, adv = data
  for loss_type, (surrogate, options) in {
      "ppo_clip": ("ppo_clip@dual", {}),
      "reinforce": ("cispo", dict(cispo_cap=CAP))}.items():
    rc = rollout_corr.RolloutCorrectionConfig(
        rollout_is="token", rollout_is_threshold=CAP, bypass_mode=True,
        loss_type=loss_type)
    config = _config("vanilla", mask, policy_loss=rollout_corr.PolicyLossConfig(
        loss_mode="bypass_mode", rollout_correction=rc))
    verl_loss, verl_grad = _verl(data, "bypass_mode", agg_mode, config=config,
                                 old=sampler)
    loss, grad = _ours(data, surrogate, VERL_RULES[agg_mode], "none",
                       old=sampler, **options)
    assert abs(loss - verl_loss) <= LOSS_ATOL, loss_type
    np.testing.assert_allclose(grad, verl_grad, rtol=0, atol=GRAD_ATOL,
                               err_msg=loss_type)
