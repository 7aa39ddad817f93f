"""A sandbox for model-written Python: namespaces, limits, nothing left behind, unforgeable tests.

Each run is a fresh `python -I` process (`sandbox_launcher`, then
`sandbox_harness`) in new mount, network, PID and IPC namespaces, as root
directly and otherwise inside a new user namespace, so the same containment
holds without root:
  * network: an empty network namespace (no interface is up);
  * files: every mount read-only, /tmp, /var/tmp, /dev/shm and /run hidden;
    the only writable place is a private tmpfs on the run's dir, gone with it;
  * processes: a PID namespace with a fresh /proc, so the caller and every
    other process can be neither seen nor signalled; when the run ends its
    init exits and the kernel kills whatever is left;
  * limits: RLIMIT_CPU/AS/FSIZE/NOFILE/CORE/NPROC, no_new_privs, no
    capabilities; as root also a fresh uid used by no other process;
  * Python-level guards (optional, on by default) as defence in depth.
Where the kernel refuses the namespaces the sandbox refuses to run anything
(`SandboxUnavailable`, with the reason); it never falls back to the guards.
Assertion tests pass only on a per-run token the harness emits after the last
assertion (`sandbox_harness`). The interpreter is this Python when a dropped
uid can read its standard library, else the system python3 (`sandbox_python`).
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

_HERE = os.path.dirname(os.path.abspath(__file__))
_LAUNCHER_FILE = os.path.join(_HERE, "sandbox_launcher.py")
_HARNESS_FILE = os.path.join(_HERE, "sandbox_harness.py")


class SandboxUnavailable(RuntimeError):
  """The kernel refused the isolation the sandbox needs; nothing was run."""


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
  wall_time_s: float = 5.0
  cpu_time_s: int = 5
  memory_mb: int = 512
  max_processes: int = 16
  max_file_mb: int = 16
  max_output_chars: int = 1 << 20
  max_workdir_mb: int = 64  # the private tmpfs the program may write to
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
  # Assertion runs: the harness wrote this run's token, i.e. every assertion ran without raising.
  assertions_passed: bool = False


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
    return max_processes  # the run's fresh uid has no other process
  # Counted per user namespace (Linux >= 5.14): the launcher and the init share the program's.
  return max_processes + 2


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


def _read_available(fd: int, limit: int) -> bytes:
  """What the pipe holds, without waiting (every writer is dead by now)."""
  os.set_blocking(fd, False)
  chunks, size = [], 0
  while size < limit:
    try:
      chunk = os.read(fd, min(65536, limit - size))
    except BlockingIOError:
      break
    if not chunk:
      break
    chunks.append(chunk)
    size += len(chunk)
  return b"".join(chunks)


def _parse_status(status: str, launcher_rc: int | None, stderr: str, timed_out: bool):
  """(returncode of the program, whether setup completed) from the launcher's status pipe."""
  lines = status.splitlines()
  errors = [line for line in lines if line.startswith("error: ")]
  if errors or (not lines and not timed_out):
    reason = errors[0][len("error: "):] if errors else (
        f"the launcher exited with code {launcher_rc} before setting up; stderr: {stderr[-300:]!r}")
    raise SandboxUnavailable(
        f"sandbox: refusing to run untrusted code: {reason}. It needs Linux >= 5.12 and "
        + ("CAP_SYS_ADMIN for mount/network/PID namespaces" if _IS_ROOT else
           "unprivileged user namespaces (sysctl user.max_user_namespaces > 0; on Ubuntu >= "
           "23.10 also kernel.apparmor_restrict_unprivileged_userns=0)"))
  for line in lines[1:]:
    kind, _, value = line.partition(" ")
    if kind == "exit":
      return int(value)
    if kind == "signal":
      return -int(value)
  return None  # killed on the wall-clock timeout before the program finished


def run_program(source: str, stdin: str = "", limits: SandboxLimits = SandboxLimits(), *,
                assertions: Sequence[str] | None = None) -> RunResult:
  """Runs `source` as a Python program with `stdin`; returns its output and what was cleaned up.

  With `assertions` (Python source strings) they run after the program, in its
  namespace, and `assertions_passed` says whether the harness proved that all ran.
  """
  workdir = tempfile.mkdtemp(prefix="ba_jax_sandbox_")
  uid = 1_000_000 + secrets.randbelow(1 << 30) if _IS_ROOT else None
  token = secrets.token_hex(16).encode()
  pipes = []
  try:
    files = {"solution.py": source}
    with open(_HARNESS_FILE) as f:
      files["harness.py"] = f.read()
    if assertions is not None:
      files["tests.json"] = json.dumps(list(assertions))
    for name, content in files.items():
      with open(os.path.join(workdir, name), "w") as f:
        f.write(content)
    status_r, status_w = os.pipe()
    token_r, token_w = os.pipe()
    result_r, result_w = os.pipe()
    pipes = [status_r, status_w, token_r, token_w, result_r, result_w]
    os.write(token_w, token)
    program_fds = [token_r, result_w] if assertions is not None else []
    python = sandbox_python()
    config = {"uid": uid, "cpu_s": int(limits.cpu_time_s), "memory_bytes": int(limits.memory_mb) << 20,
              "file_bytes": int(limits.max_file_mb) << 20, "nproc": _nproc_limit(limits.max_processes),
              "workdir_bytes": int(limits.max_workdir_mb) << 20, "files": sorted(files),
              "status_fd": status_w, "program_fds": program_fds, "python": python,
              "harness": {"guards": bool(limits.python_guards), "token_fd": token_r,
                          "result_fd": result_w,
                          "tests_file": "tests.json" if assertions is not None else None}}
    env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8",
           "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1",
           "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, \
        tempfile.TemporaryFile() as inp:
      inp.write(stdin.encode())
      inp.seek(0)
      start = time.monotonic()
      process = subprocess.Popen(
          [python, "-I", _LAUNCHER_FILE, json.dumps(config)],
          cwd=workdir, env=env, stdin=inp, stdout=out, stderr=err, start_new_session=True,
          pass_fds=(status_w, token_r, result_w))
      for fd in (status_w, token_w, token_r, result_w):  # only the sandbox holds these now
        os.close(fd)
        pipes.remove(fd)
      try:
        process.wait(timeout=limits.wall_time_s)
        timed_out = False
      except subprocess.TimeoutExpired:
        timed_out = True
      elapsed = time.monotonic() - start
      killed = _kill_everything(process, uid)
      process.wait()
      stdout = _read_capped(out, limits.max_output_chars)
      stderr = _read_capped(err, limits.max_output_chars)
    status = _read_available(status_r, 1 << 16).decode("utf-8", errors="replace")
    result = _read_available(result_r, 1 << 10)
    returncode = _parse_status(status, process.returncode, stderr, timed_out)
    if timed_out:
      returncode = None
    escaped = _remove_escaped_files(uid, workdir) if uid is not None else []
    return RunResult(returncode=returncode, stdout=stdout, stderr=stderr, timed_out=timed_out,
                     elapsed_s=elapsed, uid=uid, killed_processes=killed, escaped_files=escaped,
                     assertions_passed=assertions is not None and returncode == 0 and result == token)
  finally:
    for fd in pipes:
      os.close(fd)
    shutil.rmtree(workdir, ignore_errors=True)


def isolation() -> str:
  """What contains a run in this process's mode (root or not), in words."""
  common = ("mount, network, PID and IPC namespaces; read-only file system with a private tmpfs "
            "work dir; rlimits; no_new_privs")
  if _IS_ROOT:
    return f"root: {common}; a fresh uid per run"
  return f"unprivileged: a user namespace with {common}; no capabilities"


_available: list = []


def check_available() -> str:
  """Runs a trivial program once per process; `isolation()`, or SandboxUnavailable with the reason."""
  if not _available:
    result = run_program("print('ok')", limits=SandboxLimits(wall_time_s=60.0, cpu_time_s=30))
    if result.stdout != "ok\n":
      raise SandboxUnavailable(
          f"sandbox: the probe program did not run (exit code {result.returncode}, timed out: "
          f"{result.timed_out}); stderr: {result.stderr[-300:]!r}")
    _available.append(isolation())
  return _available[0]


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
      result = run_program(program, "", limits, assertions=[case])
      ok = result.assertions_passed
    else:
      result = run_program(program, str(case["input"]), limits)
      ok = result.returncode == 0 and _same_output(result.stdout, str(case["output"]))
    passed += ok
    timeouts += result.timed_out
    if not ok and not first_failure:
      why = ("timed out" if result.timed_out else
             f"exit code {result.returncode}" if result.returncode != 0 else
             "exited 0 before the assertions completed" if isinstance(case, str) else
             "wrong output")
      first_failure = f"test {i}: {why}; stderr tail: {result.stderr[-300:]!r}"
  return TestOutcome(passed=passed, total=len(test_cases), timeouts=timeouts, message=first_failure)


def run_tests_item(item) -> TestOutcome:
  """Pool entry point: item = (program, test_cases, limits)."""
  program, test_cases, limits = item
  return run_tests(program, test_cases, limits)
