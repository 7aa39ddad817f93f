"""Our GRPO loss and gradient equal TRL's `GRPOTrainer`'s on the same inputs.

A tiny random Qwen2 (GQA: 4 query heads on 2 key/value heads, q/k/v biases,
untied head) is loaded into torch and into our Flax model. For one batch of
fixed prompts, completions (mixed lengths, one masked out), advantages and old
log-probs (perturbed so the clip acts), TRL's own `GRPOTrainer.compute_loss`
(its `_compute_loss`, TRL 1.16) and a torch backward give the reference;
`ba_jax.policy.scoring.score_responses`, `ba_jax.loss.losses.policy_loss` and `jax.grad`
give ours. Pairs: our `token` = TRL `dapo`, `sequence` = `grpo`, `dr_grpo` =
`dr_grpo` (our `max_response_len` = TRL `max_completion_length`). Both use the
same temperature (TRL divides the logits by `GRPOConfig.temperature` in its
fused LM head; we pass it to the scorer), `epsilon`/`epsilon_high` = our
`eps_low`/`eps_high`, and `beta = 0`.

Where TRL's definition differs from ours, and what is checked instead:
- Splitting the batch. TRL's `dapo` divides each micro-batch's token sum by the
  generation batch's token count (`num_items_in_batch`, summed over processes)
  times `gradient_accumulation_steps / steps_per_generation / num_processes`,
  i.e. by the average token count of an optimizer step; `grpo` and `dr_grpo`
  take the mean over the micro-batch's own rows, divided by the accumulation
  steps, and DDP averages processes. We weight by the optimizer step's
  (mini-batch's) own counts, computed once before any split (docs/aggregation.md).
  They agree whenever micro-batches have equal row counts (TRL splits them so)
  and, for `dapo`, when one generation batch is one optimizer step
  (`steps_per_generation == gradient_accumulation_steps`, TRL's default); with
  several optimizer steps per generation TRL divides by the average step's
  tokens, we by the step's own. Checked here: one process, one micro-batch,
  `steps_per_generation = 1`, where each side's formula is all of it.
- Advantages. TRL's default `scale_rewards="group"` is `(R - mean_g R) /
  (std_g R + 1e-4)`, unbiased std, as ours but with eps 1e-4 (ours 1e-6). TRL
  computes them during generation, so both losses get the same advantages
  from `group_advantages` (`std="group"`; for `dr_grpo`, `std="none"`, which is
  Dr. GRPO's choice and TRL's `scale_rewards="none"`).
- Clip. Both are `max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))`. TRL's
  `delta` caps the unclipped ratio for both signs of A; our `dual_clip` caps
  the loss of A < 0 tokens: different rules, both off here.
- `dr_grpo`'s constant: rows x a configured length on both sides (here 16,
  wider than the batch's 10 columns, so the config value is what is checked).
- KL and entropy. TRL adds `beta * k3` to each token's loss before the
  policy's aggregation and its entropy bonus is a per-micro-batch token mean;
  ours aggregate with their own `reg_aggregation` over the mini-batch, with a
  choice of estimator. Both off here (`beta = 0`, no entropy bonus).
- Precision. `GRPOConfig` defaults to bf16 autocast; it is off here
  (`bf16=False`): this compares float32 with float32.
- Positions. TRL's scorer passes no position ids, so `transformers` numbers
  left-padded prompts from the first pad; we number from the first real token.
  RoPE depends only on relative positions, so only rounding changes (the
  log-prob check bounds it).
- TRL-only options (`top_entropy_quantile`, `off_policy_mask_threshold`, vLLM
  importance weights, `importance_sampling_level="sequence"`) are at their
  off defaults.
- `balanced` (BA) has no TRL counterpart: TRL's loss types are `grpo`,
  `dr_grpo`, `dapo`, `bnpo`, `cispo`, `sapo`, `luspo` and `vespo`; none weights
  a group's positive and negative subsets separately. (`bnpo`, a token mean
  over the local micro-batch, is our `token` only without accumulation.)
"""

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from ba_jax.loss import advantages as advantages_lib
from ba_jax.policy import hf
from ba_jax.loss import losses
from ba_jax.policy import scoring
from model_utils import EOS_ID, PAD_ID, global_rng_kept, make_hf_model, make_tokenizer

GROUP_SIZE = 4
EPS_LOW, EPS_HIGH = 0.2, 0.28
TEMPERATURE = 0.7
MAX_COMPLETION_LENGTH = 16  # > the padded width, so dr_grpo's constant is the config's, not the batch's
PAIRS = (("token", "dapo", "group"), ("sequence", "grpo", "group"),
         ("dr_grpo", "dr_grpo", "none"))  # (ours, TRL's loss_type, our advantage std)

PROMPT_LENGTHS = [6, 4, 5, 3, 6, 2, 4, 5, 6, 3, 5, 4]  # left-padded to 6
# Right-padded to 10; row 3 is a truncated completion masked out entirely, as
# TRL's `mask_truncated_completions` leaves it: 0 tokens, still one of N rows.
COMPLETION_LENGTHS = [3, 10, 6, 0, 8, 2, 10, 5, 4, 7, 1, 9]
# Group 0 binary, group 1 shaped, group 2 constant (all advantages 0).
REWARDS = [1.0, 0.0, 0.0, 1.0, 0.2, 1.0, 0.0, 0.7, 0.5, 0.5, 0.5, 0.5]

# Tolerances, from float32. Our logits match transformers' to ~1e-5 on these
# tiny models (test_scoring); a log-prob at temperature T moves by at most
# twice the logits' error over T: 2 * 1e-5 / 0.7 < 3e-5.
LOGP_ATOL = 3e-5
# J = sum_t w l with sum_t w <= 1 here and |dl/dlogp| = |A| r <= 1.5 * exp(0.45)
# (|A| <= (G-1)/sqrt(G) for G = 4, log-ratios within 0.45), so the log-probs
# move J by at most 2.4 * LOGP_ATOL; summation rounding of ~100 terms is ~1e-6.
# A normaliser off by one token (of ~60) would move J by ~1e-3.
LOSS_ATOL = 1e-4
# Each token's gradient term is off by LOGP_ATOL relative (through r = exp(logp
# - old)) plus float32 rounding of the backward through two layers (~1e-6); a
# tensor's entries are sums of such terms, so their error stays a few 1e-5 of
# the tensor's largest entry. A normaliser off by one token changes every entry
# by ~2e-2 relative, a flipped clip branch by a whole token's term.
GRAD_ATOL_OF_MAX = 1e-4
# No token's log-ratio is this close to a clip edge, so LOGP_ATOL cannot move a
# token from one branch of the clip to the other.
CLIP_MARGIN = 0.02


def _batch():
  rng = np.random.default_rng(0)
  n, p, t = len(REWARDS), max(PROMPT_LENGTHS), max(COMPLETION_LENGTHS)
  prompt_ids = np.full((n, p), PAD_ID, np.int64)
  prompt_mask = np.zeros((n, p), np.int64)
  completion_ids = np.full((n, t), PAD_ID, np.int64)
  completion_mask = np.zeros((n, t), np.int64)
  for i, (lp, lc) in enumerate(zip(PROMPT_LENGTHS, COMPLETION_LENGTHS)):
    prompt_ids[i, p - lp:] = rng.integers(4, 100, lp)
    prompt_mask[i, p - lp:] = 1
    if lc:
      completion_ids[i, :lc] = rng.integers(4, 100, lc)
      completion_ids[i, lc - 1] = EOS_ID
    else:  # cut at the length limit: no EOS, every column a token
      completion_ids[i] = rng.integers(4, 100, t)
    completion_mask[i, :lc] = 1
  return prompt_ids, prompt_mask, completion_ids, completion_mask


def _log_ratio_offsets(mask, rng):
  """log(old) - log(current) per token: clipped and unclipped tokens of both signs.

  Draws from [-0.45, 0.45] and moves any value within CLIP_MARGIN of a clip
  edge (log(1 - eps_low), log(1 + eps_high)) off it by 2.5 margins.
  """
  d = rng.uniform(-0.45, 0.45, mask.shape)
  for edge in (np.log(1 - EPS_LOW), np.log(1 + EPS_HIGH)):
    d = np.where(np.abs(d + edge) < CLIP_MARGIN, d + 2.5 * CLIP_MARGIN, d)
  return d * mask


def _ours(model, config, batch, offsets_NxT):
  """Our log-probs, old log-probs and, per mode, (loss, advantages, {HF name: gradient, HF layout})."""
  prompt_ids, prompt_mask, completion_ids, completion_mask = (
      jnp.asarray(x, jnp.int32) for x in batch)
  mask_NxT = completion_mask.astype(jnp.float32)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def score(params):
    return scoring.score_responses(nnx.merge(graphdef, params, rest), prompt_ids, prompt_mask,
                                   completion_ids, completion_mask, temperature=TEMPERATURE)[0]

  # The gradient of loss(score(params)) is score's pullback of dloss/dlogp, as
  # jax.grad computes it; split so that the model's backward compiles once, not
  # once per mode.
  @jax.jit
  def score_and_pullback(params, dlogp_NxT):
    logp_NxT, pullback = jax.vjp(score, params)
    return logp_NxT, pullback(dlogp_NxT)[0]

  @jax.jit
  def losses_and_cotangents(logp_NxT, old_logp_NxT):
    out = []
    for mode, _, std in PAIRS:
      adv_N = advantages_lib.group_advantages(jnp.asarray(REWARDS), GROUP_SIZE, std=std)
      loss_of_logp = lambda lp, mode=mode, adv_N=adv_N: losses.policy_loss(
          lp, old_logp_NxT, adv_N, mask_NxT, group_size=GROUP_SIZE, aggregation=mode,
          eps_low=EPS_LOW, eps_high=EPS_HIGH, max_response_len=MAX_COMPLETION_LENGTH)[0]
      out.append((adv_N, *jax.value_and_grad(loss_of_logp)(logp_NxT)))
    return out

  logp, _ = score_and_pullback(params, jnp.zeros_like(mask_NxT))
  old_logp = logp + offsets_NxT
  results = {}
  for (mode, _, _), (adv, loss, dlogp) in zip(PAIRS, losses_and_cotangents(logp, old_logp)):
    logp_again, grads = score_and_pullback(params, dlogp)
    assert np.array_equal(logp_again, logp)
    grads = jax.tree.map(np.asarray, nnx.to_pure_dict(grads))
    results[mode] = (float(loss), np.asarray(adv),
                     {s.hf_name: s.to_hf(s.lookup(grads)) for s in hf.weight_specs(config)})
  return np.asarray(logp), np.asarray(old_logp), results


def _trl(base, loss_type, batch, advantages, old_logp, output_dir):
  """TRL's loss, {parameter name: gradient} and per-token log-probs, from its own trainer code."""
  from datasets import Dataset
  from trl import GRPOConfig, GRPOTrainer

  args = GRPOConfig(output_dir=str(output_dir), use_cpu=True, report_to=[], save_strategy="no",
                    bf16=False,  # TRL defaults to bf16 autocast; this is a float32 comparison
                    loss_type=loss_type, num_generations=GROUP_SIZE,
                    per_device_train_batch_size=len(REWARDS), gradient_accumulation_steps=1,
                    steps_per_generation=1,
                    max_completion_length=MAX_COMPLETION_LENGTH, temperature=TEMPERATURE,
                    epsilon=EPS_LOW, epsilon_high=EPS_HIGH, beta=0.0)
  with global_rng_kept():  # rewards and prompts are unused: compute_loss gets `inputs` ready-made
    trainer = GRPOTrainer(model=copy.deepcopy(base), args=args, processing_class=make_tokenizer(),
                          reward_funcs=lambda completions, **_: [0.0] * len(completions),
                          train_dataset=Dataset.from_dict({"prompt": ["x"] * len(REWARDS)}))
  model = trainer.model
  model.train()
  trainer.current_gradient_accumulation_steps = 1  # what Trainer's loop sets for a one-step window
  prompt_ids, prompt_mask, completion_ids, completion_mask = (torch.tensor(x) for x in batch)
  inputs = {
      "prompt_ids": prompt_ids, "prompt_mask": prompt_mask,
      "completion_ids": completion_ids, "completion_mask": completion_mask,
      "advantages": torch.tensor(advantages),
      "old_per_token_logps": torch.tensor(old_logp),
      # As _generate_and_score_completions makes it: the generation batch's token count.
      "num_items_in_batch": completion_mask.sum(),
  }
  model.zero_grad()
  loss = trainer.compute_loss(model, inputs)
  loss.backward()
  grads = {name: p.grad.numpy().copy() for name, p in model.named_parameters()}
  with torch.no_grad():
    logp = trainer._get_per_token_logps_and_entropies(
        model, torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1),
        completion_ids.shape[1])[0].numpy()
  return loss.item(), grads, logp


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
  base = make_hf_model("qwen2")
  path = tmp_path_factory.mktemp("qwen2")
  base.save_pretrained(path)
  model, config = hf.load_pretrained(path)
  batch = _batch()
  mask = batch[3].astype(np.float32)
  offsets = _log_ratio_offsets(mask, np.random.default_rng(1)).astype(np.float32)
  logp, old_logp, ours = _ours(model, config, batch, offsets)
  theirs = {}
  for mode, loss_type, _ in PAIRS:
    theirs[mode] = _trl(base, loss_type, batch, ours[mode][1], old_logp,
                        tmp_path_factory.mktemp(loss_type))
  return dict(ours=ours, theirs=theirs, logp=logp, old_logp=old_logp, mask=mask)


def test_log_probs_agree_and_clip_is_active(parity):
  mask = parity["mask"] > 0
  for mode, (_, _, trl_logp) in parity["theirs"].items():
    np.testing.assert_allclose(parity["logp"][mask], trl_logp[mask], atol=LOGP_ATOL, rtol=0,
                               err_msg=mode)
  log_ratio_NxT = parity["logp"] - parity["old_logp"]
  low, high = np.log(1 - EPS_LOW), np.log(1 + EPS_HIGH)
  assert np.abs(log_ratio_NxT[mask, None] - [low, high]).min() > CLIP_MARGIN
  for mode, (_, adv_N, _) in parity["ours"].items():
    adv_NxT = np.broadcast_to(adv_N[:, None], mask.shape)
    clipped = ((adv_NxT < 0) & (log_ratio_NxT < low)) | ((adv_NxT > 0) & (log_ratio_NxT > high))
    outside = (log_ratio_NxT < low) | (log_ratio_NxT > high)
    # Tokens whose gradient the clip zeroes, and tokens outside the range that it leaves alone.
    counts = [(mask & clipped).sum(), (mask & outside & ~clipped & (adv_NxT != 0)).sum()]
    assert min(counts) >= 3, (mode, counts)


@pytest.mark.parametrize("mode", [m for m, _, _ in PAIRS])
def test_loss_and_gradient_equal_trl(parity, mode):
  our_loss, _, our_grads = parity["ours"][mode]
  trl_loss, trl_grads, _ = parity["theirs"][mode]
  # Every TRL parameter is reached by the name map that loads the weights, and nothing else.
  assert set(our_grads) == set(trl_grads), sorted(set(our_grads) ^ set(trl_grads))
  assert abs(our_loss - trl_loss) <= LOSS_ATOL, (our_loss, trl_loss)
  for name, g in trl_grads.items():
    assert np.abs(g).max() > 0, name
    np.testing.assert_allclose(our_grads[name], g, rtol=0, atol=GRAD_ATOL_OF_MAX * np.abs(g).max(),
                               err_msg=name)
