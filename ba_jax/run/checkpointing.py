"""Orbax checkpoints of a run: save, resume, the frozen KL reference.

A workdir holds ``checkpoints/<step>/`` (orbax: the TrainState, the RNG key
and a JSON ``meta`` with the data position) and ``reference/`` (the KL
reference policy); ``ba_jax.run.workdir`` adds the files that describe the run
and restores a policy from them. Saves are asynchronous and keep the newest
``keep``; restore takes abstract targets carrying the *current* mesh's
shardings, so a run can resume on a different mesh than it was saved from.
Every step's ``_CHECKPOINT_METADATA`` also holds each array's content
digest (``ba_jax.run.digest``, under ``custom_metadata.digest``), taken on
the devices at save time. A restore is verified before its state is used:
the files orbax needs, then the digests (shard by shard on the saved mesh,
array by array on another), then that no parameter or optimizer moment holds
NaN or inf, whatever the digests say.
``restore_intact`` falls back to the newest step that passes (a damaged step,
left by a crash, a full disk or a flipped byte, is named in a one-line
warning). This module knows orbax and JAX, nothing of the rest of ba_jax but
its path layer and the digests.
"""
from __future__ import annotations

import json
import logging
import signal
import sys
import threading
import time
from typing import Any, Callable

import jax
import numpy as np
import orbax.checkpoint as ocp

from ba_jax.run import digest as digest_lib
from ba_jax.run import paths


class NoIntactCheckpoint(Exception):
  """Every checkpoint step of a workdir is damaged (the message says how)."""


class DamagedStep(Exception):
  """A step that does not restore or does not verify: ``item`` (step
  metadata, meta, digest, state) and one line saying what is wrong."""

  def __init__(self, item: str, problem: str):
    super().__init__(f"{item}: {problem}")
    self.item, self.problem = item, problem


def _all_agree(ok: bool) -> bool:
  """True when every process found its part of a step intact (a process
  reads only its own shards, so one may fail where another does not)."""
  if jax.process_count() == 1:
    return ok
  from jax.experimental import multihost_utils
  return bool(np.all(multihost_utils.process_allgather(np.int32(ok))))


def _quiet_late_tensorstore_callbacks() -> None:
  """After a failed restore, tensorstore's callbacks for the reads still in
  flight reach orbax's already closed event loop, and Python prints one
  "Event loop is closed" traceback per array (hundreds of lines under the
  one-line warning). Drops exactly those; every other unraisable exception
  goes to the previous hook."""
  previous = sys.unraisablehook
  if getattr(previous, "_ba_jax_quiet", False):
    return

  def hook(unraisable):
    e = unraisable.exc_value
    if not (isinstance(e, RuntimeError) and str(e) == "Event loop is closed"):
      previous(unraisable)

  hook._ba_jax_quiet = True
  sys.unraisablehook = hook
  # The same reads can also end as asyncio tasks whose error nobody awaited: asyncio logs each
  # one ("Task exception was never retrieved", a traceback) when the task is collected, at a
  # moment that depends on the garbage collector, sometimes after the one-line error. The
  # failed restore has already been reported; drop exactly those records.
  logging.getLogger("asyncio").addFilter(_drop_unretrieved_restore_reads)


def _drop_unretrieved_restore_reads(record: logging.LogRecord) -> bool:
  message = record.getMessage()
  return not ("Task exception was never retrieved" in message and "async_deserialize" in message)


def first_line(error: BaseException) -> str:
  text = str(error).strip().split("\n")[0][:240]
  return f"{type(error).__name__}: {text}" if text else type(error).__name__


class Checkpointer:
  """Thin wrapper over ``ocp.CheckpointManager`` for a TrainState + meta."""

  def __init__(self, workdir: str, *, keep: int = 2, async_save: bool = True,
               digest: bool = True):
    """``digest=False`` saves no digests (for measuring their cost); a
    step saved so (or before digests existed) is verified by the non-finite
    check only."""
    if keep < 1:
      raise ValueError(f"checkpoint.keep={keep}: expected >= 1")
    self.directory = paths.path(workdir) / "checkpoints"
    self._digest = digest
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
    # In the step metadata orbax writes anyway: a JSON item of its own
    # costs a directory and a commit per save (+15% on the default job).
    custom = ({"digest": digest_lib.to_json(digest_lib.digests(state))}
              if self._digest else None)
    saved = self._manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
        custom_metadata=custom)
    if not saved:
      raise RuntimeError(f"orbax did not save step {step} under "
                         f"{self.directory}")
    return True

  def restore(self, abstract_state: Any, step: int | None = None
              ) -> tuple[Any, dict]:
    """Restores ``(state, meta)`` onto ``abstract_state``'s shardings and
    verifies them; raises ``DamagedStep`` when they do not verify."""
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no checkpoint under {self.directory}")
    if step not in self._manager.all_steps():
      raise FileNotFoundError(f"no checkpoint for step {step} under "
                              f"{self.directory}; have {self.all_steps()}")
    _quiet_late_tensorstore_callbacks()  # before: some fire during a restore
    return self._load(step, abstract_state)

  def _saved_digest(self, step: int) -> dict | None:
    """The step's digest table (None: saved without; checked by
    ``check_files``)."""
    metadata = json.loads((self.directory / str(step) /
                           "_CHECKPOINT_METADATA").read_text())
    return (metadata.get("custom_metadata") or {}).get("digest")

  def check_files(self, step: int) -> tuple[str, str] | None:
    """``(item, problem)`` when one of ``step``'s JSON files is missing or
    unreadable, else None; the arrays are verified by restoring them."""
    for item, name in (("step metadata", "_CHECKPOINT_METADATA"),
                       ("state", "state/_METADATA")):
      path = self.directory / str(step) / name
      if not path.exists():
        return item, f"{name} is missing"
      try:
        json.loads(path.read_text())
      except ValueError as e:
        return item, f"{name}: {first_line(e)}"
    return None

  def _load(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
    """``(state, meta)`` of ``step``, verified: files, digests, finite."""
    problem = self.check_files(step)
    if problem is not None:
      raise DamagedStep(*problem)
    saved = self._saved_digest(step)
    item = "meta"
    try:
      meta = self._manager.restore(step, args=ocp.args.Composite(
          meta=ocp.args.JsonRestore()))["meta"]
      item = "state"
      state = self._manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract_state)))["state"]
    except Exception as e:  # orbax/tensorstore raise many kinds
      raise DamagedStep(item, first_line(e)) from None
    table = digest_lib.digests(state)
    problem = ((saved is not None and digest_lib.mismatch(table, saved))
               or digest_lib.nonfinite(table))
    if problem:
      raise DamagedStep("state", problem)
    return state, dict(meta)

  def restore_intact(self, abstract_state: Any, *,
                     warn: Callable[[str], None] = print,
                     set_aside: bool = False) -> tuple[int, Any, dict]:
    """``(step, state, meta)`` of the newest step that restores and
    verifies (``restore``), the same step on every process.

    Each damaged newer step gets a one-line ``warn`` naming the step, the
    item and what is wrong (the error, or the array and shard whose digest
    differs, or that holds NaN or inf); with ``set_aside`` (pass it on
    every process: process 0 moves, all re-read) it is moved to
    ``damaged_checkpoints/`` next to ``checkpoints/`` (kept for inspection,
    and out of the way of the step's next save). Raises
    ``NoIntactCheckpoint`` (one line) when no step verifies.
    """
    steps = sorted(self.all_steps(), reverse=True)
    if not steps:
      raise FileNotFoundError(f"no checkpoint under {self.directory}")
    _quiet_late_tensorstore_callbacks()  # before: some fire during a restore
    problems = []
    for i, step in enumerate(steps):
      try:
        state, meta = self._load(step, abstract_state)
        damage = None
      except DamagedStep as e:
        damage = str(e)
      if not _all_agree(damage is None):
        problem = (f"step {step} "
                   f"({damage or 'state: damaged where another process read'})")
        problems.append(problem)
        older = (f"falling back to step {steps[i + 1]}" if i + 1 < len(steps)
                 else "no older step")
        warn(f"WARNING: checkpoint {problem} under {self.directory} is "
             f"damaged; {older}")
        if set_aside:
          self._set_aside(step)
        continue
      return step, state, meta
    raise NoIntactCheckpoint(
        f"no intact checkpoint under {self.directory}: " + "; ".join(problems))

  def _set_aside(self, step: int) -> None:
    if jax.process_index() == 0:
      target = self.directory.parent / "damaged_checkpoints"
      target.mkdir(parents=True, exist_ok=True)
      dest = target / str(step)
      if dest.exists():
        dest = target / f"{step}.{int(time.time())}"
      (self.directory / str(step)).rename(dest)
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils
      multihost_utils.sync_global_devices(f"ba_jax set aside step {step}")
    self._manager.reload()  # every process: its next save of step is new

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
  return frozen_params(
      workdir, "reference", params, abstract_params,
      missing="this run was started without a KL reference (loss.kl_coef=0); "
              "resume it with loss.kl_coef=0 or start anew",
      what="the KL reference policy", when="the policy at RL step 0")


def frozen_params(workdir: str, name: str, params: Any, abstract_params: Any, *,
                  missing: str, what: str, when: str) -> Any:
  """Parameters a run saves once under ``workdir/name`` (with their digests)
  and reads back on resume: saved from ``params`` when given and not yet
  saved, else restored onto ``abstract_params``' shardings and verified.
  ``missing``, ``what`` and ``when`` word the errors."""
  path = paths.path(workdir) / name
  digest_path = paths.path(workdir) / f"{name}_digest.json"
  checkpointer = ocp.StandardCheckpointer()
  try:
    if params is not None and not path.exists():
      table = digest_lib.to_json(digest_lib.digests(params))
      checkpointer.save(path, params)
      checkpointer.wait_until_finished()
      if jax.process_index() == 0:
        paths.write_json(digest_path, table)
      return jax.tree.map(lambda x: x.copy(), params)
    if not path.exists():
      raise FileNotFoundError(f"{path} not found: {missing}")
    restored = checkpointer.restore(path, abstract_params)
  finally:
    checkpointer.close()
  table = digest_lib.digests(restored)
  problem = ((digest_path.exists() and digest_lib.mismatch(
      table, paths.read_json(digest_path))) or digest_lib.nonfinite(table))
  if problem:
    raise NoIntactCheckpoint(
        f"{what} under {path} is damaged ({problem}); it is {when}: start "
        "the run anew in a new --workdir")
  return restored
