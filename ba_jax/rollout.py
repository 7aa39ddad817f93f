"""Rollouts for the trainer: prompts -> G samples -> rewards -> advantages.

Host-side half of a GRPO step (DESIGN.md section 2). The task
(``ba_jax.tasks.Task``) feeds prompts and grades responses; ``collect`` runs the sampler, the rewards and
the options around them (DAPO dynamic sampling, overlong masking or soft
penalty) and returns this process's rows as numpy arrays. With several
processes each one holds a contiguous slice of the global batch (whole
groups), samples it through the sharded sampler and grades it locally; the
advantages use the gathered rewards only where a statistic spans the batch.
"""
from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np

from ba_jax import advantages as advantages_lib
from ba_jax import sampler as sampler_lib

OVERLONG_MODES = ("none", "mask", "soft")


def process_slice(n: int) -> slice:
  """This process's contiguous share of ``n`` global rows."""
  count, index = jax.process_count(), jax.process_index()
  if n % count:
    raise ValueError(f"{n} global rows do not split over {count} processes")
  per = n // count
  return slice(index * per, (index + 1) * per)


def allgather(x: np.ndarray) -> np.ndarray:
  """Concatenates every process's ``x`` along axis 0 (identity with one)."""
  if jax.process_count() == 1:
    return np.asarray(x)
  from jax.experimental import multihost_utils
  return np.asarray(multihost_utils.process_allgather(np.asarray(x),
                                                      tiled=True))


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
  """The static options of a step's rollout (the config's ``rl`` section)."""
  prompts_per_step: int
  group_size: int
  max_new_tokens: int
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  advantage_std: str = "group"
  dynamic_sampling: bool = False
  max_sampling_rounds: int = 3
  overlong: str = "none"
  overlong_buffer: int = 0
  overlong_penalty: float = 1.0

  def __post_init__(self):
    if self.overlong not in OVERLONG_MODES:
      raise ValueError(f"rl.overlong={self.overlong!r}: expected one of "
                       f"{list(OVERLONG_MODES)}")
    if self.prompts_per_step < 1:
      raise ValueError(f"rl.prompts_per_step={self.prompts_per_step}: "
                       "expected >= 1")

  @classmethod
  def from_config(cls, rl) -> "RolloutConfig":
    """The fields of ``rl`` this dataclass has (the rest are the step's)."""
    return cls(**{f.name: rl[f.name] for f in dataclasses.fields(cls)})


@dataclasses.dataclass
class Rollout:
  """This process's rows of one step's batch, group-major."""
  prompt_ids: np.ndarray  # [N, P] (prompt n // G repeated)
  prompt_mask: np.ndarray
  response_ids: np.ndarray  # [N, T]
  response_mask: np.ndarray  # [N, T] what the loss sees (overlong masked)
  sample_mask: np.ndarray  # [N, T] as sampled
  old_logp: np.ndarray  # [N, T] sampler log-probs
  rewards: np.ndarray  # [N]
  correct: np.ndarray  # [N] bool
  truncated: np.ndarray  # [N] bool
  advantages: np.ndarray  # [N]
  prompts_used: int  # global prompts consumed (data position advance)
  stats: dict


def soft_overlong_penalty(lengths_N, truncated_N, *, max_len: int,
                          buffer: int, penalty: float) -> np.ndarray:
  """DAPO's soft overlong punishment (<= 0), ramping over the last
  ``buffer`` tokens of the budget; ``-penalty`` when truncated."""
  start = max_len - buffer
  ramp = np.clip((lengths_N - start) / max(buffer, 1), 0.0, 1.0) * -penalty
  return np.where(truncated_N, -penalty, ramp).astype(np.float32)


def collect(model, task, *, position: int, key, rl: RolloutConfig, mesh=None,
            rules=None) -> Rollout:
  """Samples, grades and (optionally) filters one step's batch.

  ``position`` is the global index of the next training prompt; ``key`` the
  step's PRNG key. Dynamic sampling keeps only groups with mixed rewards and
  samples further rounds of fresh prompts (at most ``rl.max_sampling_rounds``)
  to refill; if still short, constant groups fill the rest (their advantage
  is 0).
  """
  G, B = rl.group_size, rl.prompts_per_step
  local = process_slice(B)
  kept, spare, rounds = [], [], 0
  t_sample = t_reward = 0.0
  while True:
    problems = task.problems(position + rounds * B, B)[local]
    ids, mask = task.encode_prompts(problems)
    t0 = time.perf_counter()
    out = sampler_lib.sample_groups(
        model, ids, mask, group_size=G, max_new_tokens=rl.max_new_tokens,
        temperature=rl.temperature, top_p=rl.top_p, top_k=rl.top_k,
        eos_id=task.eos_id, pad_id=task.pad_id,
        rng=jax.random.fold_in(key, rounds), mesh=mesh, rules=rules, max_slots=rl.get("max_slots", 0))
    out = jax.tree.map(np.asarray, out)
    t1 = time.perf_counter()
    texts = task.decode(out.tokens, out.mask)
    rewards, correct = task.grade(texts, [p for p in problems for _ in range(G)])
    t_reward += time.perf_counter() - t1
    t_sample += t1 - t0
    rounds += 1
    for g in range(len(problems)):
      rows = slice(g * G, (g + 1) * G)
      group = (ids[g], mask[g], out.tokens[rows], out.mask[rows],
               out.logprobs[rows], rewards[rows], correct[rows],
               out.truncated[rows])
      mixed = rewards[rows].max() > rewards[rows].min()
      (kept if mixed or not rl.dynamic_sampling else spare).append(group)
    need = len(kept) < len(problems)
    if not rl.dynamic_sampling or rounds > rl.max_sampling_rounds or not (
        allgather(np.array([need])).any()):
      break
  n_local = len(problems)
  filled = max(0, n_local - len(kept))
  groups = (kept + spare[:filled])[:n_local]
  cat = lambda i: np.concatenate([g[i] for g in groups])
  prompt_ids = np.repeat(np.stack([g[0] for g in groups]), G, axis=0)
  prompt_mask = np.repeat(np.stack([g[1] for g in groups]), G, axis=0)
  tokens, sample_mask, logp = cat(2), cat(3), cat(4)
  rewards, correct, truncated = cat(5), cat(6), cat(7)
  lengths = sample_mask.sum(-1)
  if rl.overlong == "soft":
    rewards = rewards + soft_overlong_penalty(
        lengths, truncated, max_len=rl.max_new_tokens,
        buffer=rl.overlong_buffer, penalty=rl.overlong_penalty)
  loss_mask = sample_mask
  if rl.overlong == "mask":
    loss_mask = sample_mask * (~truncated)[:, None].astype(np.int32)
  all_rewards = allgather(rewards)
  adv = np.asarray(advantages_lib.group_advantages(
      all_rewards, G, std=rl.advantage_std))
  adv = adv[process_slice(len(all_rewards))]
  stats = dict(time_sampling=t_sample, time_rewards=t_reward,
               sampling_rounds=float(rounds),
               dapo_filled_groups=float(filled) if rl.dynamic_sampling else 0.0,
               sampled_tokens=float(lengths.sum()))
  return Rollout(prompt_ids, prompt_mask, tokens, loss_mask, sample_mask,
                 logp, rewards, correct, truncated, adv.astype(np.float32),
                 rounds * B, stats)


def heldout_accuracy(model, task, *, samples: int, temperature: float,
                     max_new_tokens: int, key, mesh=None, rules=None,
                     max_slots: int = 0) -> float:
  """Mean exact-answer accuracy on the held-out problems (greedy when
  ``temperature == 0``; then one sample each)."""
  problems = task.heldout[process_slice(len(task.heldout))]
  ids, mask = task.encode_prompts(problems)
  samples = 1 if temperature == 0 else samples
  out = sampler_lib.sample_groups(
      model, ids, mask, group_size=samples, max_new_tokens=max_new_tokens,
      temperature=temperature, eos_id=task.eos_id, pad_id=task.pad_id,
      rng=key, mesh=mesh, rules=rules, max_slots=max_slots)
  texts = task.decode(np.asarray(out.tokens), np.asarray(out.mask))
  _, correct = task.grade(texts, [p for p in problems for _ in range(samples)])
  return float(allgather(correct.astype(np.float32)).mean())
