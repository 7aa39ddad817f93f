"""Rollouts for the trainer: prompts -> G samples -> rewards -> advantages.

Host-side half of a GRPO step. The task
(``ba_jax.tasks.registry.Task``) feeds prompts and grades responses; ``collect`` runs the sampler, the rewards and
the options around them (DAPO dynamic sampling, overlong masking or soft
penalty) and returns this process's rows as numpy arrays. With several
processes each one holds a contiguous slice of the global batch (whole
groups), samples it through the sharded sampler and grades it locally; the
advantages use the gathered rewards only where a statistic spans the batch.
"""
from __future__ import annotations

import dataclasses
import math
import time

import jax
import numpy as np

from ba_jax.config import schema
from ba_jax.loss import advantages as advantages_lib
from ba_jax.generation import engine as engine_lib
from ba_jax.policy import kv_cache as kv_cache_lib
from ba_jax.generation import sampler as sampler_lib
from ba_jax.policy import sharding as sharding_lib



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
  max_slots: int = 0  # decode slots per process; 0: every row at once
  kv_cache_gib: float = 0.0  # KV-cache budget per device (0: unused); see decode_slots
  prefill_chunk: int = 0  # the engine prefills prompts this many tokens at a time; 0: whole
  cache_phases: int = 0  # cache lengths a decode loop runs through; 0: the backend's default
  prompt_pad_multiple: int = 0  # the batch's prompts: see narrow_prompts; 0: task.max_prompt_len
  advantage_std: str = "group"
  dynamic_sampling: bool = False
  max_sampling_rounds: int = 3
  oversample: float = 1.0
  overlong: str = "none"
  overlong_buffer: int = 0
  overlong_penalty: float = 1.0

  def __post_init__(self):
    for f in dataclasses.fields(self):
      schema.check(f"rl.{f.name}", getattr(self, f.name))

  @classmethod
  def from_section(cls, rl: schema.Rl) -> "RolloutConfig":
    """The fields of the config's ``rl`` section this dataclass has (the
    rest are the update's)."""
    return cls(**{f.name: getattr(rl, f.name) for f in dataclasses.fields(cls)})


def decode_slots(rl: RolloutConfig, model_config, *, prompt_len: int, mesh=None,
                 rules=None) -> int:
  """The decode slots per process the sampler runs with (``max_slots``; 0:
  every row at once): ``rl.max_slots``, or the most that ``rl.kv_cache_gib``
  GiB of KV cache per device hold.

  The engine's cache has ``engine.cache_length`` positions per slot (the
  prompt bucket of ``prompt_len``, in whole ``rl.prefill_chunk`` chunks, plus
  the response budget) and splits its
  slots over the batch mesh axes and its kv heads over the tensor axis
  (``kv_cache.bytes_per_device``), so a budget gives the same slots on every
  device whatever the process count: a multiple of the batch shards that
  also splits over the processes. With both keys set, ``rl.max_slots`` is
  used and must fit the budget.
  """
  if not rl.kv_cache_gib:
    return rl.max_slots
  rules = sharding_lib.DEFAULT_RULES if rules is None else tuple(rules)
  budget = int(rl.kv_cache_gib * 2**30)
  length = engine_lib.cache_length(sampler_lib.bucket_length(prompt_len),
                                   rl.max_new_tokens, rl.prefill_chunk)
  procs = jax.process_count()
  if rl.max_slots:
    need = kv_cache_lib.bytes_per_device(model_config, rl.max_slots * procs,
                                         length, mesh=mesh, rules=rules)
    if need > budget:
      raise ValueError(
          f"rl.max_slots={rl.max_slots} (per process, x {procs} processes) "
          f"needs {need / 2**30:.3g} GiB of KV cache per device ({length} "
          f"positions per slot), over rl.kv_cache_gib={rl.kv_cache_gib}; set "
          "one of them (the other 0) or make them agree")
    return rl.max_slots
  try:
    total = kv_cache_lib.slots_for_budget(model_config, budget, length,
                                          mesh=mesh, rules=rules)
  except ValueError as e:
    raise ValueError(f"rl.kv_cache_gib={rl.kv_cache_gib}: {e}") from None
  shards = kv_cache_lib.slot_shards(mesh, rules)
  step = math.lcm(shards, procs)  # slots split evenly over shards and processes
  if total < step:
    raise ValueError(
        f"rl.kv_cache_gib={rl.kv_cache_gib}: holds {total} slot(s), fewer "
        f"than the {step} that split over {shards} batch shards and {procs} "
        "processes; raise the budget")
  return (total - total % step) // procs


def narrow_prompts(ids_NxP: np.ndarray, mask_NxP: np.ndarray, multiple: int, *,
                   pad_id: int) -> tuple[np.ndarray, np.ndarray]:
  """The prompts left-padded to the longest one of the global batch, rounded up
  to a multiple of ``multiple`` (never wider than ``P``): ``(ids, mask)``.

  Every real token is kept, in order, whatever the rows' padding side; only
  columns of padding go. The update and the log-prob scorers then compute on
  fewer padded positions (same sums: padding is masked out of attention), at
  the cost of one compiled program per width a run meets. With several
  processes the width is agreed over all of them (the batch is one array).
  """
  if multiple < 1:
    raise ValueError(f"rl.prompt_pad_multiple={multiple}: expected a positive multiple "
                     "(0 turns narrowing off before this is called)")
  N, P = ids_NxP.shape
  real_NxP = mask_NxP != 0
  longest = int(allgather(np.array([real_NxP.sum(axis=1).max(initial=0)])).max())
  width = min(P, max(1, -(-longest // multiple)) * multiple)
  if width == P:
    return ids_NxP, mask_NxP
  # A stable sort on the mask puts each row's padding first and its tokens after, in order.
  order_NxP = np.argsort(real_NxP, axis=1, kind="stable")[:, P - width:]
  ids = np.take_along_axis(ids_NxP, order_NxP, axis=1)
  mask = np.take_along_axis(mask_NxP, order_NxP, axis=1)
  return np.where(mask != 0, ids, pad_id).astype(ids_NxP.dtype), mask


@dataclasses.dataclass
class Rollout:
  """This process's rows of one step's batch, group-major."""
  prompt_ids: np.ndarray  # [N, P] (prompt n // G repeated)
  prompt_mask: np.ndarray
  response_ids: np.ndarray  # [N, T]
  response_mask: np.ndarray  # [N, T] what the loss sees (overlong masked)
  sample_mask: np.ndarray  # [N, T] as sampled
  old_logp: np.ndarray  # [N, T] the sampler's log-probs (behaviour; old unless rl.old_logp="recompute")
  rewards: np.ndarray  # [N]
  correct: np.ndarray  # [N] bool
  truncated: np.ndarray  # [N] bool
  advantages: np.ndarray  # [N]
  prompts_used: int  # global prompts consumed (data position advance)
  stats: dict
  # The terms that add up to ``rewards``, float32 [N] each: the task's
  # (``grade_components``; else one, "task") and "overlong_penalty" with
  # rl.overlong="soft".
  reward_parts: dict = dataclasses.field(default_factory=dict)


def soft_overlong_penalty(lengths_N, truncated_N, *, max_len: int,
                          buffer: int, penalty: float) -> np.ndarray:
  """DAPO's soft overlong punishment (<= 0), ramping over the last
  ``buffer`` tokens of the budget; ``-penalty`` when truncated."""
  start = max_len - buffer
  ramp = np.clip((lengths_N - start) / max(buffer, 1), 0.0, 1.0) * -penalty
  return np.where(truncated_N, -penalty, ramp).astype(np.float32)


def _grade(task, texts, problems) -> tuple[dict[str, np.ndarray], np.ndarray]:
  """(the reward's terms, correct) of responses: a task's
  ``grade_components`` when it has that optional method, else its ``grade``
  as one term, "task"."""
  if hasattr(task, "grade_components"):
    parts, correct = task.grade_components(texts, problems)
    return {k: np.asarray(v, np.float32) for k, v in parts.items()}, correct
  rewards, correct = task.grade(texts, problems)
  return {"task": np.asarray(rewards, np.float32)}, correct


def _final_parts(parts: dict, out, rl: RolloutConfig) -> dict:
  """The terms of the rewards the advantages see: graded, plus any soft
  overlong penalty."""
  if rl.overlong != "soft":
    return parts
  return dict(parts, overlong_penalty=soft_overlong_penalty(
      out.mask.sum(-1), out.truncated, max_len=rl.max_new_tokens,
      buffer=rl.overlong_buffer, penalty=rl.overlong_penalty))


def prompts_per_round(rl: RolloutConfig) -> int:
  """Global prompts sampled per round: ``prompts_per_step``, times
  ``oversample`` under dynamic sampling (rounded up to whole processes)."""
  if not rl.dynamic_sampling:
    return rl.prompts_per_step
  count = jax.process_count()
  wanted = math.ceil(rl.prompts_per_step * rl.oversample)
  return -(-wanted // count) * count


def collect(model, task, *, position: int, key, rl: RolloutConfig, mesh=None,
            rules=None) -> Rollout:
  """Samples, grades and (optionally) filters one step's batch.

  ``position`` is the global index of the next training prompt; ``key`` the
  step's PRNG key. Dynamic sampling, as DAPO: each round samples
  ``prompts_per_round`` fresh prompts and keeps the groups whose FINAL
  rewards (after the soft overlong penalty) differ, until the batch is full
  or ``1 + rl.max_sampling_rounds`` rounds have run. Only if still short
  are the remaining places filled with groups whose final rewards are all
  equal, whose advantage is then exactly 0 (never a group that is equal
  before the penalty but not after it: that one has a signal and is kept).
  """
  G, B = rl.group_size, rl.prompts_per_step
  per_round = prompts_per_round(rl)
  local_b = process_slice(B)
  n_local = local_b.stop - local_b.start
  local_round = process_slice(per_round)
  kept, spare, rounds, sampled_groups = [], [], 0, 0
  t_sample = t_reward = 0.0
  counts_format = hasattr(task, "answer_found")  # optional Task method
  format_fails = 0
  while True:
    problems = task.problems(position + rounds * per_round,
                             per_round)[local_round]
    ids, mask = task.encode_prompts(problems)
    t0 = time.perf_counter()
    out = sampler_lib.sample_groups(
        model, ids, mask, group_size=G, max_new_tokens=rl.max_new_tokens,
        temperature=rl.temperature, top_p=rl.top_p, top_k=rl.top_k,
        eos_id=task.eos_id, pad_id=task.pad_id,
        rng=jax.random.fold_in(key, rounds), mesh=mesh, rules=rules, max_slots=rl.max_slots,
        prefill_chunk=rl.prefill_chunk, cache_phases=rl.cache_phases)
    out = jax.tree.map(np.asarray, out)
    t1 = time.perf_counter()
    texts = task.decode(out.tokens, out.mask)
    parts, correct = _grade(task, texts, [p for p in problems for _ in range(G)])
    if counts_format:
      format_fails += len(texts) - int(task.answer_found(texts).sum())
    parts = _final_parts(parts, out, rl)
    final = np.sum(list(parts.values()), axis=0).astype(np.float32)
    t_reward += time.perf_counter() - t1
    t_sample += t1 - t0
    rounds += 1
    sampled_groups += len(problems)
    for g in range(len(problems)):
      rows = slice(g * G, (g + 1) * G)
      group = (ids[g], mask[g], out.tokens[rows], out.mask[rows],
               out.logprobs[rows], final[rows], correct[rows],
               out.truncated[rows], {k: v[rows] for k, v in parts.items()})
      mixed = final[rows].max() > final[rows].min()
      (kept if mixed or not rl.dynamic_sampling else spare).append(group)
    need = len(kept) < n_local
    if not rl.dynamic_sampling or rounds > rl.max_sampling_rounds or not (
        allgather(np.array([need])).any()):
      break
  filled = max(0, n_local - len(kept))
  groups = (kept + spare[:filled])[:n_local]
  cat = lambda i: np.concatenate([g[i] for g in groups])
  prompt_ids = np.repeat(np.stack([g[0] for g in groups]), G, axis=0)
  prompt_mask = np.repeat(np.stack([g[1] for g in groups]), G, axis=0)
  if rl.prompt_pad_multiple:
    prompt_ids, prompt_mask = narrow_prompts(prompt_ids, prompt_mask, rl.prompt_pad_multiple,
                                             pad_id=task.pad_id)
  tokens, sample_mask, logp = cat(2), cat(3), cat(4)
  rewards, correct, truncated = cat(5), cat(6), cat(7)
  reward_parts = {k: np.concatenate([g[8][k] for g in groups])
                  for k in groups[0][8]}
  lengths = sample_mask.sum(-1)
  loss_mask = sample_mask
  if rl.overlong == "mask":
    loss_mask = sample_mask * (~truncated)[:, None].astype(np.int32)
  all_rewards = allgather(rewards)
  adv = np.asarray(advantages_lib.group_advantages(
      all_rewards, G, std=rl.advantage_std))
  adv = adv[process_slice(len(all_rewards))]
  dynamic = rl.dynamic_sampling
  stats = dict(time_sampling=t_sample, time_rewards=t_reward,
               sampling_rounds=float(rounds),
               # this process's groups: used as equal-reward filler, and
               # sampled but not used (equal rewards, or beyond the batch)
               dapo_filled_groups=float(filled) if dynamic else 0.0,
               dapo_dropped_groups=float(sampled_groups - n_local)
               if dynamic else 0.0,
               sampled_tokens=float(lengths.sum()))
  if counts_format:  # over every response sampled
    stats["format_fail_frac"] = format_fails / (sampled_groups * G)
  return Rollout(prompt_ids, prompt_mask, tokens, loss_mask, sample_mask,
                 logp, rewards, correct, truncated, adv.astype(np.float32),
                 rounds * per_round, stats, reward_parts)


def heldout_correct(model, task, *, samples: int, temperature: float,
                    max_new_tokens: int, key, mesh=None, rules=None,
                    max_slots: int = 0, prefill_chunk: int = 0,
                    cache_phases: int = 0) -> np.ndarray:
  """Which held-out responses are correct: bool [problems, samples] over
  every process's problems (greedy when ``temperature == 0``; then one
  sample each). ``max_slots``, ``prefill_chunk`` and ``cache_phases``: as
  ``sampler.sample_groups`` (the config's ``rl``)."""
  problems = task.heldout[process_slice(len(task.heldout))]
  ids, mask = task.encode_prompts(problems)
  samples = 1 if temperature == 0 else samples
  out = sampler_lib.sample_groups(
      model, ids, mask, group_size=samples, max_new_tokens=max_new_tokens,
      temperature=temperature, eos_id=task.eos_id, pad_id=task.pad_id,
      rng=key, mesh=mesh, rules=rules, max_slots=max_slots,
      prefill_chunk=prefill_chunk, cache_phases=cache_phases)
  texts = task.decode(np.asarray(out.tokens), np.asarray(out.mask))
  _, correct = task.grade(texts, [p for p in problems for _ in range(samples)])
  return allgather(correct.astype(bool)).reshape(-1, samples)

