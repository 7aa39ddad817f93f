"""Step metrics: rollout statistics, and the writers (console, TensorBoard,
``metrics.jsonl``).

Device metrics are fetched one step behind: ``MetricsLogger.push`` keeps the
step's device arrays and writes the previous step's, so the host never waits
for the device just to log.
"""
from __future__ import annotations

import io
import json
import math
import sys
from typing import Any

import jax
import numpy as np

from ba_jax.loss import aggregation as agg
from ba_jax.run import paths


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


class _EventFile:
  """A TensorBoard event file at a URL, through ``ba_jax.run.paths``: object
  stores cannot append, so the buffered file is rewritten whole at each
  flush (tensorboardX flushes every couple of minutes)."""

  def __init__(self, url: str):
    self.path, self.buffer = paths.path(url), io.BytesIO()

  def write(self, data: bytes) -> None:
    self.buffer.write(data)

  def flush(self) -> None:
    self.path.write_bytes(self.buffer.getvalue())

  def close(self) -> None:
    self.flush()


class _EventFiles:
  """tensorboardX's writer factory for a URL scheme (its own gs:// one
  needs google-cloud-storage and credentials of its own)."""

  def open(self, url: str) -> _EventFile:
    return _EventFile(url)

  def directory_check(self, url: str) -> None:
    paths.path(url).mkdir(parents=True, exist_ok=True)


def _route_event_files(root) -> None:
  """Sends tensorboardX's files for ``root``'s URL scheme through epath."""
  if paths.is_remote(root):
    from tensorboardX import record_writer
    record_writer.register_writer_factory(str(root).split(":")[0],
                                          _EventFiles())


def _jsonable(value: float) -> Any:
  return value if math.isfinite(value) else None


class MetricsLogger:
  """Writes one record per step to the console, TensorBoard and jsonl."""

  def __init__(self, workdir: str, *, total_steps: int, first_step: int = 0,
               tensorboard: bool = True, progress_bar: bool = True,
               enabled: bool = True):
    self.enabled, self.workdir = enabled, workdir
    self._pending: tuple[int, Any, dict] | None = None
    self.history: list[dict] = []
    self._tb = self._bar = None
    if not enabled:
      return
    root = paths.path(workdir)
    self._jsonl = paths.JsonlFile(root / "metrics.jsonl")
    self._eval = paths.JsonlFile(root / "eval.jsonl")
    if tensorboard:
      # purge_step: TensorBoard drops the events a resumed run replays after
      # its checkpoint.
      import tensorboardX
      _route_event_files(root)
      self._tb = tensorboardX.SummaryWriter(
          str(root / "tb"), purge_step=first_step + 1 if first_step else None)
    if progress_bar:
      import tqdm
      self._bar = tqdm.tqdm(total=total_steps, initial=first_step,
                            desc="GRPO", dynamic_ncols=True, file=sys.stdout)

  def push(self, step: int, device_metrics: Any, host_metrics: dict
           ) -> dict | None:
    """Queues this step's metrics; writes and returns the previous step's
    record (None at the first push)."""
    record = self.flush()
    self._pending = (step, device_metrics, host_metrics)
    return record

  def flush(self) -> dict | None:
    """Writes and returns the queued record, if any."""
    if self._pending is None:
      return None
    step, device_metrics, host_metrics = self._pending
    self._pending = None
    fetched = {k: float(v) for k, v in jax.device_get(device_metrics).items()}
    record = dict(step=step, **host_metrics, **fetched,
                  **weight_shares(fetched))
    self.write(record)
    return record

  def write(self, record: dict) -> None:
    self.history.append(record)
    if not self.enabled:
      return
    step = record["step"]
    self._jsonl.add({k: _jsonable(v) if isinstance(v, float) else v
                     for k, v in record.items()})
    if self._tb is not None:
      for name, value in record.items():
        if (isinstance(value, (int, float)) and name != "step"
            and math.isfinite(value)):
          self._tb.add_scalar(name, value, step)
    if self._bar is not None and "reward_mean" in record:
      self._bar.n = step
      self._bar.set_postfix(reward=f"{record['reward_mean']:.3f}",
                            acc=f"{record.get('accuracy', 0.0):.2f}",
                            len=f"{record.get('length_mean', 0.0):.1f}",
                            refresh=False)
      self._bar.refresh()

  def write_eval(self, step: int, accuracy: dict) -> None:
    """Held-out accuracy at ``step`` (0: before RL) to ``eval.jsonl`` (one
    record per evaluation, so metrics.jsonl keeps one record per step) and
    TensorBoard."""
    if not self.enabled or not accuracy:
      return
    self._eval.add({"step": step, **accuracy})
    if self._tb is not None:
      for name, value in accuracy.items():
        self._tb.add_scalar(f"eval/{name}", value, step)

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
    if self._tb is not None:
      self._tb.close()
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
