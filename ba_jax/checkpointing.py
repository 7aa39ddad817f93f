"""Orbax checkpoints of a run: save, resume, the frozen KL reference.

A workdir holds ``checkpoints/<step>/`` (orbax: the TrainState, the RNG key
and a JSON ``meta`` with the data position) and ``reference/`` (the KL
reference policy); ``ba_jax.run_setup`` adds the files that describe the run
and restores a policy from them. Saves are asynchronous and keep the newest
``keep``; restore takes abstract targets carrying the *current* mesh's
shardings, so a run can resume on a different mesh than it was saved from.
This module knows orbax and JAX, nothing of the rest of ba_jax.
"""
from __future__ import annotations

import os
import signal
import threading
from typing import Any

import jax
import orbax.checkpoint as ocp


class Checkpointer:
  """Thin wrapper over ``ocp.CheckpointManager`` for a TrainState + meta."""

  def __init__(self, workdir: str, *, keep: int = 2, async_save: bool = True):
    if keep < 1:
      raise ValueError(f"checkpoint.keep={keep}: expected >= 1")
    self.directory = os.path.join(os.path.abspath(workdir), "checkpoints")
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=async_save,
            create=True),
        item_names=("state", "meta"))

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self._manager.all_steps())

  def save(self, step: int, state: Any, meta: dict) -> bool:
    """Starts an (async) save of ``state`` and ``meta`` at ``step``.

    Returns False when ``step`` is already saved (orbax writes nothing then).
    """
    if step in self._manager.all_steps():
      return False
    saved = self._manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))
    if not saved:
      raise RuntimeError(f"orbax did not save step {step} under "
                         f"{self.directory}")
    return True

  def restore(self, abstract_state: Any, step: int | None = None
              ) -> tuple[Any, dict]:
    """Restores ``(state, meta)`` onto ``abstract_state``'s shardings."""
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no checkpoint under {self.directory}")
    if step not in self._manager.all_steps():
      raise FileNotFoundError(f"no checkpoint for step {step} under "
                              f"{self.directory}; have {self.all_steps()}")
    out = self._manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state),
        meta=ocp.args.JsonRestore()))
    return out["state"], dict(out["meta"])

  def wait(self) -> None:
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()


def abstract_like(tree: Any, shardings: Any = None) -> Any:
  """ShapeDtypeStructs for ``tree`` carrying ``shardings`` (or the arrays')."""
  if shardings is None:
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                       sharding=getattr(x, "sharding", None)),
        tree)
  return jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
      tree, shardings)


class PreemptionGuard:
  """Turns SIGTERM (a preempted VM) into a flag the loop polls.

  The loop saves a checkpoint and returns when ``requested`` is set; a second
  SIGTERM falls back to the previous handler.
  """

  def __init__(self):
    self.requested = False
    self._previous = None

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(signal.SIGTERM, self._handle)
    return self

  def _handle(self, signum, frame):
    if self.requested and callable(self._previous):
      self._previous(signum, frame)
    self.requested = True

  def __exit__(self, *exc):
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)
    return False


def reference_params(workdir: str, params: Any, abstract_params: Any) -> Any:
  """The frozen KL reference: saved from ``params`` on a fresh run, read
  back (onto ``abstract_params``' shardings) on a resumed one, so that
  pruning old checkpoints never loses it."""
  path = os.path.join(os.path.abspath(workdir), "reference")
  checkpointer = ocp.StandardCheckpointer()
  try:
    if params is not None and not os.path.exists(path):
      checkpointer.save(path, params)
      checkpointer.wait_until_finished()
      return jax.tree.map(lambda x: x.copy(), params)
    return checkpointer.restore(path, abstract_params)
  finally:
    checkpointer.close()
