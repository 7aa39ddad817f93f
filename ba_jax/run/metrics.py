"""Step metrics: rollout statistics, reward terms, tables of sampled
completions, and the logger that writes them (console, and the backends of
``ba_jax.run.tracking``).

Device metrics are fetched one step behind: ``MetricsLogger.push`` keeps the
step's device arrays and writes the previous step's, so the host never waits
for the device just to log. A samples table is built from the rollout's
host arrays (no device value) and written with its step's record.
"""
from __future__ import annotations

import json
import sys
from typing import Any

import jax
import numpy as np

from ba_jax.config import schema
from ba_jax.loss import aggregation as agg
from ba_jax.run import paths
from ba_jax.run import rollout
from ba_jax.run import tracking


def rollout_stats(rewards_N, correct_N, advantages_N, mask_NxT, truncated_N,
                  group_size: int) -> dict[str, float]:
  """Reward, accuracy and the length diagnostics of docs/aggregation.md
  (``aggregation.length_diagnostics``: NaN where undefined)."""
  rewards_N = np.asarray(rewards_N, np.float64)
  lengths_N = np.asarray(mask_NxT).sum(-1).astype(np.float64)
  lengths = agg.length_diagnostics(lengths_N, np.asarray(advantages_N),
                                   group_size=group_size, xp=np)
  stats = {
      "reward_mean": rewards_N.mean(),
      "reward_std": rewards_N.std(),
      "accuracy": np.mean(correct_N),
      "length_mean": lengths_N.mean(),
      "length_max": lengths_N.max(),
      "length_cv_in_group": lengths["length_cv"],
      "truncated_frac": np.mean(truncated_N),
      "pos_frac": lengths["pos_frac"],
      "groups_mixed_frac": np.mean(
          rewards_N.reshape(-1, group_size).std(-1) > 0),
      "length_gap_pos_neg": lengths["length_gap"],
      "length_gap_rel": lengths["length_gap_rel"],
      "length_gap_in_group": lengths["length_gap_in_group"],
      "length_gap_in_group_rel": lengths["length_gap_in_group_rel"],
      "length_cv_in_subset": lengths["length_cv_in_subset"],
  }
  return {k: float(v) for k, v in stats.items()}


def weight_shares(device_metrics: dict[str, float]) -> dict[str, float]:
  """The positive share W+ / (W+ + W-) from the loss metrics."""
  if "w_pos" not in device_metrics or "w_neg" not in device_metrics:
    return {}
  return {"w_pos_share": float(agg.positive_share(
      device_metrics["w_pos"], device_metrics["w_neg"], np))}


def reward_terms(reward_parts: dict[str, np.ndarray]) -> dict[str, float]:
  """The mean of each term of the reward over the global batch, as
  ``reward/<term>``, when it has several (a task's ``grade_components``,
  the soft overlong penalty); {} for a reward of one term."""
  if len(reward_parts) < 2:
    return {}
  return {f"reward/{name}": float(np.mean(rollout.allgather(values)))
          for name, values in reward_parts.items()}


def sample_rows(ro: rollout.Rollout, task, *, step: int, groups: int,
                step_cfg) -> list[dict]:
  """A table of ``groups`` groups of this step's sampled completions (the
  first ones of process 0): prompt, response, reward (and its terms when it
  has several), correct, length, truncated, advantage, and the sequence's
  aggregation ``weight``, the sum of its token weights in its PPO mini-batch
  (``aggregation.sequence_weights``; each mini-batch's sum to at most 1).
  Every process calls it (the weights need the global batch's lengths and
  advantages, small host arrays); only process 0's rows are returned."""
  weights = agg.sequence_weights(
      rollout.allgather(ro.response_mask.sum(-1)),
      rollout.allgather(ro.advantages),
      num_minibatches=step_cfg.num_minibatches, mode=step_cfg.aggregation,
      group_size=step_cfg.group_size,
      max_response_len=step_cfg.max_response_len,
      ba_denominator=step_cfg.ba_denominator, ba_scope=step_cfg.ba_scope)
  if jax.process_index() != 0:
    return []
  G = step_cfg.group_size
  rows = np.arange(min(groups * G, len(ro.rewards)))
  prompts = task.decode(ro.prompt_ids[rows], ro.prompt_mask[rows])
  responses = task.decode(ro.response_ids[rows], ro.sample_mask[rows])
  terms = ro.reward_parts if len(ro.reward_parts) > 1 else {}
  out = []
  for i, n in enumerate(rows):
    out.append(dict(
        step=step, group=int(n // G), prompt=prompts[i], response=responses[i],
        reward=float(ro.rewards[n]),
        **{f"reward/{k}": float(v[n]) for k, v in terms.items()},
        correct=bool(ro.correct[n]), length=int(ro.sample_mask[n].sum()),
        truncated=bool(ro.truncated[n]), advantage=float(ro.advantages[n]),
        weight=float(weights[n])))
  return out


class MetricsLogger:
  """Writes one record per step to the console and every backend
  (``ba_jax.run.tracking``: the workdir's jsonl files, and those
  ``log.backends`` names); ``enabled=False`` (every process but 0) keeps
  the history and writes nothing."""

  def __init__(self, workdir: str, *, total_steps: int, first_step: int = 0,
               log: schema.Log = schema.Log(), config: dict | None = None,
               enabled: bool = True, skip_until: int | None = None):
    self.enabled, self.workdir = enabled, workdir
    self._pending: tuple | None = None
    self.history: list[dict] = []
    self._backends: list[tracking.Backend] = []
    self._bar = None
    if not enabled:
      return
    self._backends = tracking.make_backends(
        workdir, log, first_step=first_step, config=config,
        skip_until=skip_until, note=self.log_text)
    if log.progress_bar:
      import tqdm
      self._bar = tqdm.tqdm(total=total_steps, initial=first_step,
                            desc="GRPO", dynamic_ncols=True, file=sys.stdout)

  def push(self, step: int, device_metrics: Any, host_metrics: dict,
           samples: list[dict] | None = None) -> dict | None:
    """Queues this step's metrics (and its samples table, if any); writes
    and returns the previous step's record (None at the first push)."""
    record = self.flush()
    self._pending = (step, device_metrics, host_metrics, samples)
    return record

  def flush(self) -> dict | None:
    """Writes and returns the queued record, if any."""
    if self._pending is None:
      return None
    step, device_metrics, host_metrics, samples = self._pending
    self._pending = None
    fetched = {k: float(v) for k, v in jax.device_get(device_metrics).items()}
    record = dict(step=step, **host_metrics, **fetched,
                  **weight_shares(fetched))
    self.write(record)
    if samples:
      self.write_samples(step, samples)
    return record

  def write(self, record: dict) -> None:
    self.history.append(record)
    if not self.enabled:
      return
    step = record["step"]
    for backend in self._backends:
      backend.write(step, record)
    if self._bar is not None and "reward_mean" in record:
      self._bar.n = step
      self._bar.set_postfix(reward=f"{record['reward_mean']:.3f}",
                            acc=f"{record.get('accuracy', 0.0):.2f}",
                            len=f"{record.get('length_mean', 0.0):.1f}",
                            refresh=False)
      self._bar.refresh()

  def write_samples(self, step: int, rows: list[dict]) -> None:
    """A table of sampled completions: samples.jsonl and every backend
    with tables."""
    if self.enabled:
      for backend in self._backends:
        if backend.has_tables:
          backend.write_samples(step, rows)

  def write_eval(self, step: int, accuracy: dict) -> None:
    """Held-out accuracy at ``step`` (0: before RL) to ``eval.jsonl`` (one
    record per evaluation, so metrics.jsonl keeps one record per step) and
    the other backends (as ``eval/*``)."""
    if not self.enabled or not accuracy:
      return
    for backend in self._backends:
      backend.write_eval(step, accuracy)

  def end_progress(self) -> None:
    """Closes the progress bar (its line ends), so that what is printed
    after the RL steps gets lines of its own."""
    if self._bar is not None:
      self._bar.close()
      self._bar = None

  def log_text(self, message: str) -> None:
    if not self.enabled:
      return
    if self._bar is not None:
      self._bar.write(message)
    else:
      print(message, flush=True)

  def close(self) -> None:
    self.flush()
    if not self.enabled:
      return
    for backend in self._backends:
      backend.close()
    if self._bar is not None:
      self._bar.close()


def read_metrics(workdir: str) -> dict[int, dict]:
  """The last record per step of ``workdir/metrics.jsonl`` (a resumed run
  rewrites the steps after its checkpoint)."""
  out: dict[int, dict] = {}
  for line in paths.read_text(paths.path(workdir) / "metrics.jsonl").split(
      "\n"):
    if not line.strip():
      continue
    record = json.loads(line)
    if "step" in record and isinstance(record["step"], int):
      out[record["step"]] = record
  return out
