"""A sandbox for model-written Python: limits, no network, private cwd, nothing left behind.

Each run is a fresh `python -I` process in its own session, started through a
launcher that, before running the program:
  * sets RLIMIT_CPU, RLIMIT_AS (memory), RLIMIT_FSIZE, RLIMIT_NOFILE, RLIMIT_CORE;
  * as root: enters a new, empty network namespace (no interface is up, so
    every connection fails), then drops to a fresh unprivileged uid used by no
    other process, so RLIMIT_NPROC bounds a fork bomb (the limit is ignored for
    root) and file permissions block writes to root-owned paths;
  * installs Python-level guards (sockets refused, `open` for writing outside
    the private temp dir refused) as defence in depth and for non-root runs.
The interpreter is this Python when a dropped uid can read its standard
library, else the system python3 (`sandbox_python`). After the run (or on the
wall-clock timeout) every process of the run's
session and of its uid is SIGKILLed, files the uid left in world-writable
temp dirs are removed and reported, and the private temp dir is deleted.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from typing import Sequence

_WORLD_WRITABLE_DIRS = ("/tmp", "/var/tmp", "/dev/shm")
_IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0

_LAUNCHER = r'''
import builtins, ctypes, io, json, os, resource, runpy, socket, sys
cfg = json.loads(sys.argv[1])
def limit(kind, value):
    try:
        resource.setrlimit(kind, (value, value))
    except (ValueError, OSError):
        pass
if cfg["uid"] is not None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(0x40000000) != 0:  # CLONE_NEWNET
        raise SystemExit("sandbox: could not enter a network namespace")
limit(resource.RLIMIT_CPU, cfg["cpu_s"])
limit(resource.RLIMIT_AS, cfg["memory_bytes"])
limit(resource.RLIMIT_FSIZE, cfg["file_bytes"])
limit(resource.RLIMIT_NOFILE, 64)
limit(resource.RLIMIT_CORE, 0)
limit(resource.RLIMIT_NPROC, cfg["nproc"])
if cfg["uid"] is not None:
    os.setgroups([])
    os.setgid(cfg["uid"])
    os.setuid(cfg["uid"])
root = os.path.realpath(os.getcwd())
if cfg["guards"]:
    _open = builtins.open
    def guarded_open(file, mode="r", *args, **kwargs):
        if not isinstance(file, int) and any(c in mode for c in "wax+"):
            path = os.path.realpath(os.fsdecode(file))
            if path != root and not path.startswith(root + os.sep):
                raise PermissionError(f"sandbox: writing outside {root} is not allowed: {path}")
        return _open(file, mode, *args, **kwargs)
    builtins.open = io.open = guarded_open
    class NoNetwork(socket.socket):
        def __init__(self, family=-1, *args, **kwargs):
            if family != socket.AF_UNIX:
                raise PermissionError("sandbox: network access is not allowed")
            super().__init__(family, *args, **kwargs)
    socket.socket = NoNetwork
del cfg, limit
sys.argv = ["solution.py"]
runpy.run_path("solution.py", run_name="__main__")
'''


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
  wall_time_s: float = 5.0
  cpu_time_s: int = 5
  memory_mb: int = 512
  max_processes: int = 16
  max_file_mb: int = 16
  max_output_chars: int = 1 << 20
  python_guards: bool = True


@dataclasses.dataclass
class RunResult:
  returncode: int | None
  stdout: str
  stderr: str
  timed_out: bool
  elapsed_s: float
  uid: int | None  # the throwaway uid the program ran as (None when not root)
  killed_processes: int = 0  # processes still alive after the main one exited or timed out
  escaped_files: list = dataclasses.field(default_factory=list)  # removed from shared temp dirs


@dataclasses.dataclass
class TestOutcome:
  passed: int
  total: int
  timeouts: int
  message: str = ""


def _live_processes(pgid: int, uid: int | None) -> list[int]:
  """Pids (zombies excluded) in process group `pgid` or owned by `uid`."""
  pids = []
  for entry in os.listdir("/proc"):
    if not entry.isdigit():
      continue
    try:
      with open(f"/proc/{entry}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
      state, pgrp = fields[0], int(fields[2])
      if state in "ZX":
        continue
      owner = os.stat(f"/proc/{entry}").st_uid if uid is not None else None
    except (OSError, ValueError, IndexError):
      continue
    if pgrp == pgid or (uid is not None and owner == uid):
      pids.append(int(entry))
  return pids


def _kill_everything(process: subprocess.Popen, uid: int | None) -> int:
  """SIGKILLs the run's process group and every process of its uid, until none is left."""
  killed = set()
  deadline = time.monotonic() + 10.0
  while time.monotonic() < deadline:
    try:
      os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
      pass
    process.poll()  # reap the main process so it does not linger as a zombie
    pids = [p for p in _live_processes(process.pid, uid) if p != os.getpid()]
    if not pids:
      break
    for pid in pids:
      try:
        os.kill(pid, signal.SIGKILL)
        killed.add(pid)
      except ProcessLookupError:
        pass
    time.sleep(0.005)
  return len(killed - {process.pid})


def _remove_escaped_files(uid: int, workdir: str) -> list[str]:
  """Deletes whatever the run's uid created outside `workdir` in the world-writable temp dirs.

  A process running as `uid` can only create entries in directories it may
  write to, so the walk only descends into world-writable directories and ones
  `uid` owns (not the whole of /tmp).
  """
  escaped = []
  stack = [d for d in _WORLD_WRITABLE_DIRS if os.path.isdir(d)]
  while stack:
    directory = stack.pop()
    try:
      entries = list(os.scandir(directory))
    except OSError:
      continue
    for entry in entries:
      path = entry.path
      if path == workdir:
        continue
      try:
        info = entry.stat(follow_symlinks=False)
      except OSError:
        continue
      if info.st_uid == uid:
        escaped.append(path)
        if entry.is_dir(follow_symlinks=False):
          shutil.rmtree(path, ignore_errors=True)
        else:
          try:
            os.unlink(path)
          except OSError:
            pass
      elif entry.is_dir(follow_symlinks=False) and info.st_mode & stat.S_IWOTH \
          and info.st_mode & stat.S_IXOTH:
        stack.append(path)
  return escaped


def _nproc_limit(max_processes: int) -> int:
  if _IS_ROOT:
    return max_processes
  # RLIMIT_NPROC counts every process of the real uid, so leave room for those running now.
  return sum(1 for e in os.listdir("/proc") if e.isdigit()) + max_processes


_PROBE = ("import os; os.setgroups([]); os.setgid({uid}); os.setuid({uid}); "
          "import runpy, pkgutil, json, collections, fractions, heapq, decimal")


@functools.lru_cache(maxsize=None)
def sandbox_python() -> str:
  """An interpreter whose standard library an unprivileged uid can read.

  When this Python lives under a private home (e.g. /root/.pyenv) a dropped
  uid cannot import from it; the system Python is used instead.
  """
  if not _IS_ROOT:
    return sys.executable
  for candidate in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
    if not os.path.exists(candidate):
      continue
    probe = subprocess.run([candidate, "-I", "-c", _PROBE.format(uid=1_000_000)],
                           capture_output=True, timeout=60)
    if probe.returncode == 0:
      return candidate
  raise RuntimeError(
      f"no Python interpreter readable by an unprivileged uid: tried {sys.executable}, "
      "/usr/bin/python3, /usr/local/bin/python3; install a system python3 or run as non-root")


def _read_capped(f, limit: int) -> str:
  f.seek(0)
  return f.read(limit).decode("utf-8", errors="replace")


def run_program(source: str, stdin: str = "", limits: SandboxLimits = SandboxLimits()) -> RunResult:
  """Runs `source` as a Python program with `stdin`; returns its output and what was cleaned up."""
  workdir = tempfile.mkdtemp(prefix="ba_jax_sandbox_")
  uid = 1_000_000 + secrets.randbelow(1 << 30) if _IS_ROOT else None
  try:
    with open(os.path.join(workdir, "solution.py"), "w") as f:
      f.write(source)
    with open(os.path.join(workdir, "launcher.py"), "w") as f:
      f.write(_LAUNCHER)
    if uid is not None:
      os.chown(workdir, uid, uid)
      os.chmod(workdir, 0o700)
      os.chmod(os.path.join(workdir, "solution.py"), 0o644)
    config = {"uid": uid, "cpu_s": int(limits.cpu_time_s), "memory_bytes": int(limits.memory_mb) << 20,
              "file_bytes": int(limits.max_file_mb) << 20, "nproc": _nproc_limit(limits.max_processes),
              "guards": bool(limits.python_guards)}
    env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8",
           "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1",
           "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, \
        tempfile.TemporaryFile() as inp:
      inp.write(stdin.encode())
      inp.seek(0)
      start = time.monotonic()
      process = subprocess.Popen(
          [sandbox_python(), "-I", os.path.join(workdir, "launcher.py"), json.dumps(config)],
          cwd=workdir, env=env, stdin=inp, stdout=out, stderr=err, start_new_session=True,
          close_fds=True)
      try:
        returncode = process.wait(timeout=limits.wall_time_s)
        timed_out = False
      except subprocess.TimeoutExpired:
        returncode, timed_out = None, True
      elapsed = time.monotonic() - start
      killed = _kill_everything(process, uid)
      process.wait()
      stdout = _read_capped(out, limits.max_output_chars)
      stderr = _read_capped(err, limits.max_output_chars)
    escaped = _remove_escaped_files(uid, workdir) if uid is not None else []
    return RunResult(returncode=returncode, stdout=stdout, stderr=stderr, timed_out=timed_out,
                     elapsed_s=elapsed, uid=uid, killed_processes=killed, escaped_files=escaped)
  finally:
    shutil.rmtree(workdir, ignore_errors=True)


def _same_output(actual: str, expected: str) -> bool:
  def lines(text):
    out = [line.rstrip() for line in text.strip().splitlines()]
    return out
  return lines(actual) == lines(expected)


def check_test_cases(test_cases: Sequence, where: str = "") -> None:
  """Raises if a case is neither an assertion string nor {"input", "output"} (a caller bug)."""
  for i, case in enumerate(test_cases):
    if not (isinstance(case, str) or
            (isinstance(case, dict) and "input" in case and "output" in case)):
      raise ValueError(
          f"{where}test case {i} must be a Python assertion string or a dict with 'input' and "
          f"'output', got {type(case).__name__}: {str(case)[:80]!r}")


def run_tests(program: str, test_cases: Sequence, limits: SandboxLimits = SandboxLimits()
              ) -> TestOutcome:
  """Runs `program` once per test case; a case is {"input", "output"} or a Python assertion string."""
  check_test_cases(test_cases)
  passed = timeouts = 0
  first_failure = ""
  for i, case in enumerate(test_cases):
    if isinstance(case, str):
      result = run_program(program + "\n\n" + case + "\n", "", limits)
      ok = result.returncode == 0
    else:
      result = run_program(program, str(case["input"]), limits)
      ok = result.returncode == 0 and _same_output(result.stdout, str(case["output"]))
    passed += ok
    timeouts += result.timed_out
    if not ok and not first_failure:
      why = "timed out" if result.timed_out else f"exit code {result.returncode}"
      first_failure = f"test {i}: {why}; stderr tail: {result.stderr[-300:]!r}"
  return TestOutcome(passed=passed, total=len(test_cases), timeouts=timeouts, message=first_failure)


def run_tests_item(item) -> TestOutcome:
  """Pool entry point: item = (program, test_cases, limits)."""
  program, test_cases, limits = item
  return run_tests(program, test_cases, limits)
