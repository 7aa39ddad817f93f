"""Our policy loss equals TRL 1.16's `GRPOTrainer` loss for every
`loss_type` x `importance_sampling_level` x `vllm_importance_sampling_mode`
that maps onto our surrogate x aggregation x correction, on fixed float32
tensors: random log-probs (current, old and the sampler's), advantages of
both signs and ragged masks (one row empty).

TRL's side is its own code: `GRPOTrainer._compute_loss` with the trainer's
scorer replaced by the fixed log-probs (a leaf tensor, so a backward gives
d loss / d log-prob), and the vLLM importance-sampling ratio computed by the
block of `_generate_and_score_completions` that TRL runs after generation,
taken from its source and executed as it stands. The model-level parity
(scorer, parameters' gradients) is tests/test_trl_parity.py's.

The mapping (docs/aggregation.md has the table): TRL's `loss_type` is our
aggregation (`grpo`, `sapo` -> sequence; `dapo`, `bnpo`, `cispo` -> token;
`dr_grpo` -> dr_grpo with max_response_len = max_completion_length;
`luspo` -> dr_grpo with max_response_len = 1 at token level) and, for
`cispo`/`sapo`, our surrogate; `importance_sampling_level="sequence"` is our
`gspo` (`luspo` then our `luspo` under sequence); the vLLM modes are our
`tis_*`/`mis_*` with `clip_min`/`clip_max` = correction_floor/cap, and
`token_mask` with IcePop's bounds is our `icepop`. Not mapped: `vespo`, and
`cispo`/`sapo` at sequence level (no such surrogate here). TRL's `cispo`
takes `epsilon_high` as the cap on the ratio itself (ScaleRL's eps_max) =
our `cispo_cap`; MiniMax-M1's reading 1 + eps_high is
tests/test_objectives.py's.

Each TRL cell must match its mapped cell and no other of ours (every
surrogate x rule x correction, loss and gradient), so a swapped mapping
fails.
"""
import copy
import inspect
import itertools
import math
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from ba_jax.loss import losses
from model_utils import global_rng_kept, make_hf_model, make_tokenizer

G = 4
LENGTHS = [3, 10, 6, 0, 8, 2, 10, 5, 4, 7, 1, 9]
N, T = len(LENGTHS), 10
MAX_COMPLETION_LENGTH = 16
EPS_LOW, EPS_HIGH = 0.2, 0.28
CISPO_CAP = 1.3
TAU_POS, TAU_NEG = 1.0, 1.05
FLOOR, CAP = 0.6, 2.0
ICEPOP = (0.5, 2.5)
# float32 on both sides, the same formulas in other orders: a few ulps of
# O(1) terms, summed over ~60 tokens with weights summing to <= 1 (luspo,
# dr_grpo with constant 1: <= 10).
LOSS_ATOL = 1e-5
GRAD_ATOL = 1e-6
# Distinct cells of ours differ in loss or gradient by more than this
# fraction of TRL's (the mapped cell is within ~1e-4 of it).
DISTINCT = 1e-2

TRL_CELLS = {  # (loss_type, importance_sampling_level) -> (surrogate, rule, dr_grpo constant)
    ("grpo", "token"): ("ppo_clip", "sequence", None),
    ("grpo", "sequence"): ("gspo", "sequence", None),
    ("dapo", "token"): ("ppo_clip", "token", None),
    ("dapo", "sequence"): ("gspo", "token", None),
    ("bnpo", "token"): ("ppo_clip", "token", None),
    ("bnpo", "sequence"): ("gspo", "token", None),
    ("dr_grpo", "token"): ("ppo_clip", "dr_grpo", MAX_COMPLETION_LENGTH),
    ("dr_grpo", "sequence"): ("gspo", "dr_grpo", MAX_COMPLETION_LENGTH),
    ("cispo", "token"): ("cispo", "token", None),
    ("sapo", "token"): ("sapo", "sequence", None),
    ("luspo", "token"): ("ppo_clip", "dr_grpo", 1),
    ("luspo", "sequence"): ("luspo", "sequence", None),
}
# vllm_importance_sampling_mode (with its clip_min, clip_max) -> our correction.
MODES = {
    None: ("none", None),
    "token_truncate": ("tis_token", (FLOOR, CAP)),
    "token_mask": ("mis_token", (FLOOR, CAP)),
    "sequence_truncate": ("tis_sequence", (FLOOR, CAP)),
    "sequence_mask": ("mis_sequence", (FLOOR, CAP)),
    "token_mask@icepop": ("icepop", ICEPOP),
}


def _data():
  rng = np.random.default_rng(3)
  mask = (np.arange(T)[None] < np.array(LENGTHS)[:, None]).astype(np.float32)
  logp = (rng.normal(size=(N, T)) * 0.5 - 1.5).astype(np.float32)
  old = (logp + rng.uniform(-0.45, 0.45, (N, T))).astype(np.float32)
  sampler = (old + rng.uniform(-1.2, 1.2, (N, T))).astype(np.float32)
  adv = rng.normal(size=N).astype(np.float32)
  adv[8:] = 0.0  # a group whose rewards were all equal
  return logp, old, sampler, mask, adv


def _is_ratio_code() -> str:
  """TRL's block that turns the trainer's and vLLM's log-probs into the
  importance-sampling ratio, from `_generate_and_score_completions`."""
  from trl import GRPOTrainer
  source = inspect.getsource(GRPOTrainer._generate_and_score_completions)
  start = source.rindex("\n", 0, source.index(
      "# Compute the importance sampling ratio when using vLLM")) + 1
  end = source.rindex("\n", 0, source.index(
      "# Compute the per-token log probabilities for the reference model")) + 1
  block = textwrap.dedent(source[start:end])
  assert "vllm_importance_sampling_ratio = torch.clamp(" in block
  return block


@pytest.fixture(scope="module")
def trl(tmp_path_factory):
  from datasets import Dataset
  from trl import GRPOConfig, GRPOTrainer
  args = GRPOConfig(output_dir=str(tmp_path_factory.mktemp("trl")), use_cpu=True, report_to=[],
                    save_strategy="no", bf16=False, num_generations=G,
                    per_device_train_batch_size=N, gradient_accumulation_steps=1,
                    steps_per_generation=1, max_completion_length=MAX_COMPLETION_LENGTH,
                    epsilon=EPS_LOW, epsilon_high=EPS_HIGH, beta=0.0,
                    sapo_temperature_pos=TAU_POS, sapo_temperature_neg=TAU_NEG)
  with global_rng_kept():
    trainer = GRPOTrainer(model=copy.deepcopy(make_hf_model("qwen2")), args=args,
                          processing_class=make_tokenizer(),
                          reward_funcs=lambda completions, **_: [0.0] * len(completions),
                          train_dataset=Dataset.from_dict({"prompt": ["x"] * N}))
  trainer.model.train()
  trainer.current_gradient_accumulation_steps = 1
  return trainer


def _trl_loss(trainer, data, loss_type, level, mode):
  """TRL's loss and d loss / d logp for one cell."""
  logp, old, sampler, mask, adv = data
  leaf = torch.tensor(logp, requires_grad=True)
  trainer._get_per_token_logps_and_entropies = lambda *a, **k: (
      leaf, torch.zeros_like(leaf), None)
  trainer.loss_type, trainer.importance_sampling_level = loss_type, level
  trainer.epsilon_high = CISPO_CAP if loss_type == "cispo" else EPS_HIGH
  completion_mask = torch.tensor(mask).long()
  inputs = {
      "prompt_ids": torch.ones((N, 2), dtype=torch.long),
      "prompt_mask": torch.ones((N, 2), dtype=torch.long),
      "completion_ids": torch.ones((N, T), dtype=torch.long),
      "completion_mask": completion_mask,
      "advantages": torch.tensor(adv),
      "old_per_token_logps": torch.tensor(old),
      "num_items_in_batch": completion_mask.sum(),
  }
  trainer.use_vllm = trainer.vllm_importance_sampling_correction = mode is not None
  if mode is not None:
    trainer.vllm_importance_sampling_mode = mode.split("@")[0]
    trainer.vllm_importance_sampling_clip_min, trainer.vllm_importance_sampling_clip_max = (
        MODES[mode][1])
    scope = dict(self=trainer, torch=torch, math=math, tool_mask=None,
                 completion_mask=completion_mask, old_per_token_logps=torch.tensor(old),
                 sampling_per_token_logps=torch.tensor(sampler))
    exec(_is_ratio_code(), scope)
    inputs["importance_sampling_ratio"] = scope["vllm_importance_sampling_ratio"]
  loss = trainer.compute_loss(trainer.model, inputs)
  loss.backward()
  return loss.item(), leaf.grad.numpy().copy()


def _ours(data, surrogate, rule, constant, correction):
  logp, old, sampler, mask, adv = data
  bounds = (dict(icepop_low=ICEPOP[0], icepop_high=ICEPOP[1]) if correction == "icepop"
            else dict(correction_floor=FLOOR, correction_cap=CAP))
  def loss_of(lp):
    return losses.policy_loss(
        lp, jnp.asarray(old), jnp.asarray(adv), jnp.asarray(mask), group_size=G,
        aggregation=rule, eps_low=EPS_LOW, eps_high=EPS_HIGH,
        max_response_len=constant, surrogate=surrogate, correction=correction,
        behaviour_logp=jnp.asarray(sampler), cispo_cap=CISPO_CAP,
        sapo_tau_pos=TAU_POS, sapo_tau_neg=TAU_NEG, **bounds)[0]
  loss, g = jax.value_and_grad(loss_of)(jnp.asarray(logp))
  return float(loss), np.asarray(g)


@pytest.fixture(scope="module")
def data():
  return _data()


@pytest.fixture(scope="module")
def our_cells(data):
  """Every cell of ours that a mapping could land on: (loss, gradient)."""
  cells = {}
  rules = [("token", None), ("sequence", None), ("dr_grpo", MAX_COMPLETION_LENGTH),
           ("dr_grpo", 1), ("balanced", None)]
  for surrogate, (rule, constant), (correction, _) in itertools.product(
      ("ppo_clip", "gspo", "gmpo", "cispo", "sapo", "luspo"), rules, MODES.values()):
    if surrogate != "luspo" or rule == "sequence":
      cells[surrogate, rule, constant, correction] = _ours(
          data, surrogate, rule, constant, correction)
  return cells


def test_the_data_make_every_mode_act(data):
  logp, old, sampler, mask, adv = data
  on = mask > 0
  rho = np.exp(old - sampler)[on]
  assert (rho > CAP).sum() >= 3 and (rho < FLOOR).sum() >= 3 and (rho > ICEPOP[1]).sum() >= 1
  seq = np.exp(((old - sampler) * mask).sum(-1))[np.array(LENGTHS) > 0]
  assert (seq > CAP).any() and (seq < FLOOR).any() and ((seq >= FLOOR) & (seq <= CAP)).any()
  r = np.exp(logp - old)[on]
  assert (r > 1 + EPS_HIGH).sum() >= 3 and (r < 1 - EPS_LOW).sum() >= 3 and (r > CISPO_CAP).any()


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("loss_type,level", list(TRL_CELLS))
def test_loss_and_gradient_equal_trl(trl, data, our_cells, loss_type, level, mode):
  surrogate, rule, constant = TRL_CELLS[loss_type, level]
  correction = MODES[mode][0]
  trl_loss, trl_grad = _trl_loss(trl, data, loss_type, level, mode)
  loss, grad = _ours(data, surrogate, rule, constant, correction)
  assert abs(loss - trl_loss) <= LOSS_ATOL, (loss, trl_loss)
  np.testing.assert_allclose(grad, trl_grad, rtol=0, atol=GRAD_ATOL * max(1.0, constant or 1))
  assert np.abs(trl_grad).max() > 1e-3
  # No other cell of ours has TRL's loss: a swapped axis would fail above.
  mapped = {(surrogate, rule, constant, correction)}
  if surrogate == "luspo":  # the identity test_objectives checks: the same objective
    mapped.add(("gspo", "dr_grpo", 1, correction))
  scale = np.abs(trl_grad).max()
  near = [cell for cell, (value, g) in our_cells.items() if cell not in mapped
          and abs(value - trl_loss) <= DISTINCT * abs(trl_loss) + LOSS_ATOL
          and np.abs(g - trl_grad).max() <= DISTINCT * scale]
  assert not near, near
