"""A process pool with a deadline on every item, for graders that may hang or crash.

`concurrent.futures.ProcessPoolExecutor` cannot kill one hung worker: the whole
pool breaks. Here each worker owns a pipe, the parent knows which item each
worker holds and since when, and a worker past its deadline (or one that died)
is killed and replaced while the other items go on. The item scores as a
timeout or an error; the run never stalls.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_for_ready
from typing import Any, Callable, Sequence

_STARTUP_TIMEOUT_S = 120.0


@dataclasses.dataclass(frozen=True)
class ItemResult:
  status: str  # "ok" | "timeout" | "error"
  value: Any = None
  message: str = ""


def _worker_main(fd: int):
  """Entry point of a worker process: `python -c` calls it with its end of a socket pair."""
  signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's business.
  conn = Connection(fd)
  initializer, memory_limit_mb = conn.recv()
  if memory_limit_mb:
    import resource
    limit = int(memory_limit_mb) << 20
    try:
      resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    except (ValueError, OSError):
      pass
  if initializer is not None:
    initializer()
  conn.send(("ready", None, None))
  while True:
    try:
      message = conn.recv()
    except (EOFError, OSError):
      return
    if message is None:
      return
    task_id, fn, arg = message
    try:
      conn.send((task_id, "ok", fn(arg)))
    except BaseException as e:  # noqa: BLE001 -- any failure scores the item as an error
      conn.send((task_id, "error", f"{type(e).__name__}: {e}"[:500]))


class _Worker:
  """A fresh interpreter (not multiprocessing's spawn, which re-imports the caller's __main__)."""

  def __init__(self, initializer, memory_limit_mb):
    parent_socket, child_socket = socket.socketpair()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    fd = child_socket.fileno()
    self.process = subprocess.Popen(
        [sys.executable, "-c", f"from ba_jax.tasks.reward_pool import _worker_main; _worker_main({fd})"],
        pass_fds=(fd,), env=env, stdin=subprocess.DEVNULL)
    child_socket.close()
    self.conn = Connection(parent_socket.detach())
    self.conn.send((initializer, memory_limit_mb))
    self.started_at = time.monotonic()
    self.ready = False
    self.task = None  # (task_id, sent_at)

  @property
  def exitcode(self):
    return self.process.poll()

  def alive(self) -> bool:
    return self.process.poll() is None

  def kill(self):
    if self.alive():
      self.process.kill()
    try:
      self.process.wait(timeout=5)
    except subprocess.TimeoutExpired:
      pass
    self.conn.close()


class TimeoutPool:
  """Runs `fn(item)` for each item in worker processes, at most `timeout_s` per item.

  Use as a context manager. `map` returns one `ItemResult` per item, in order.
  Counters `timeouts`, `errors` and `restarts` accumulate over the pool's life.
  """

  def __init__(self, num_workers: int = 2, timeout_s: float = 10.0, *,
               initializer: Callable[[], None] | None = None,
               memory_limit_mb: int | None = 4096):
    if num_workers < 1:
      raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    if not timeout_s > 0:
      raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s}")
    self.num_workers = num_workers
    self.timeout_s = float(timeout_s)
    self._initializer = initializer
    self._memory_limit_mb = memory_limit_mb
    self._workers: list[_Worker] = []
    self.timeouts = 0
    self.errors = 0
    self.restarts = 0

  def __enter__(self):
    self.start()
    return self

  def __exit__(self, *exc):
    self.close()

  def start(self):
    if self._workers:
      return
    self._workers = [self._new_worker() for _ in range(self.num_workers)]
    for worker in self._workers:
      self._await_ready(worker)

  def close(self):
    for worker in self._workers:
      try:
        if worker.task is None and worker.alive():
          worker.conn.send(None)
          worker.process.wait(timeout=2)
      except (OSError, BrokenPipeError):
        pass
      worker.kill()
    self._workers = []

  def _new_worker(self) -> _Worker:
    return _Worker(self._initializer, self._memory_limit_mb)

  def _await_ready(self, worker: _Worker):
    if worker.conn.poll(max(0.0, _STARTUP_TIMEOUT_S - (time.monotonic() - worker.started_at))):
      try:
        tag, _, _ = worker.conn.recv()
        if tag == "ready":
          worker.ready = True
          return
      except (EOFError, OSError):
        pass
    raise RuntimeError(
        f"reward pool worker (pid {worker.process.pid}) did not start within "
        f"{_STARTUP_TIMEOUT_S:.0f}s (exit code {worker.exitcode}); "
        "check that the initializer imports cleanly in a fresh process")

  def _replace(self, index: int):
    self._workers[index].kill()
    self._workers[index] = self._new_worker()
    self.restarts += 1

  def map(self, fn: Callable[[Any], Any], items: Sequence[Any], *,
          timeout_s: float | None = None) -> list[ItemResult]:
    """`fn` must be a picklable module-level function; `items` picklable values."""
    if not self._workers:
      self.start()
    timeout_s = self.timeout_s if timeout_s is None else float(timeout_s)
    results: list[ItemResult | None] = [None] * len(items)
    pending = deque(range(len(items)))

    def finish(index, worker_index, result):
      results[index] = result
      if result.status == "timeout":
        self.timeouts += 1
      elif result.status == "error":
        self.errors += 1
      if worker_index is not None:
        self._workers[worker_index].task = None

    while pending or any(w.task is not None for w in self._workers):
      for i, worker in enumerate(self._workers):
        if worker.ready and worker.task is None and pending:
          index = pending.popleft()
          try:
            worker.conn.send((index, fn, items[index]))
          except OSError:  # the idle worker died (e.g. killed by the OOM killer): replace it
            pending.appendleft(index)
            self._replace(i)
            continue
          worker.task = (index, time.monotonic())
      now = time.monotonic()
      deadlines = [w.task[1] + timeout_s - now for w in self._workers if w.task is not None]
      deadlines += [w.started_at + _STARTUP_TIMEOUT_S - now for w in self._workers if not w.ready]
      wait_for_ready([w.conn for w in self._workers], timeout=max(0.0, min(deadlines, default=0.1)))
      for i, worker in enumerate(self._workers):
        died = False
        try:
          while worker.conn.poll():
            tag, status, value = worker.conn.recv()
            if tag == "ready":
              worker.ready = True
            elif worker.task is not None and tag == worker.task[0]:
              finish(tag, i, ItemResult(status, value if status == "ok" else None,
                                        "" if status == "ok" else value))
        except (EOFError, OSError):
          died = True
        if died:
          try:  # EOF can arrive before the process is reaped: wait for its exit code
            worker.process.wait(timeout=2)
          except subprocess.TimeoutExpired:
            pass
          if worker.task is not None:
            finish(worker.task[0], i, ItemResult(
                "error", None, f"grader process died (exit code {worker.exitcode})"))
          elif not worker.ready and worker.exitcode is not None:
            raise RuntimeError(
                f"reward pool worker failed to start (exit code {worker.exitcode})")
          self._replace(i)
          continue
        now = time.monotonic()
        if worker.task is not None and now - worker.task[1] > timeout_s:
          index = worker.task[0]
          finish(index, i, ItemResult("timeout", None, f"exceeded {timeout_s:g}s"))
          logging.getLogger(__name__).warning(
              "grader item %d exceeded %.3gs; killing worker pid %d", index, timeout_s,
              worker.process.pid)
          self._replace(i)
        elif not worker.ready and now - worker.started_at > _STARTUP_TIMEOUT_S:
          self._await_ready(worker)  # raises with a clear message
    return results  # type: ignore[return-value]

