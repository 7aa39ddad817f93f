"""A sandbox for model-written Python: namespaces, a bare root, hard limits, nothing left behind.

Each run is a fresh `python -I` process (`sandbox_launcher`, then
`sandbox_harness`) in new mount, network, PID and IPC namespaces, as root
directly and otherwise inside a new user namespace, so the same containment
holds without root:
  * files: a new root holding read-only system dirs and the interpreter, five
    device nodes and /sandbox, a private tmpfs (`max_workdir_mb`) with the
    run's files, the only writable place; no home, /tmp, /work or socket of
    the host exists in it, so no file of the caller either (unprivileged mode);
  * network: an empty network namespace, and a seccomp filter that allows
    socket() for AF_UNIX only (or for nothing: `sockets="none"`);
  * processes: a PID namespace with a fresh /proc, so the caller and every
    other process can be neither seen nor signalled; when the run ends its
    init exits and the kernel kills whatever is left;
  * memory (`memory_mb`, all the run's processes together): a memory cgroup per
    run where one can be made (`cgroups`), else RLIMIT_AS per process plus the
    init's watchdog on the total; in both cases seccomp refuses memfd_create
    and SysV shared memory (`sandbox_seccomp`);
  * limits: RLIMIT_CPU/AS/FSIZE/NOFILE/CORE/NPROC/MSGQUEUE, no_new_privs, no
    capabilities, no new namespaces; as root also a fresh uid per run;
  * signals: the namespace's init keeps no handler, so the program's signals to
    it are dropped; in assertion runs the harness, once set up, adds a seccomp
    filter refusing new signal handlers (`sandbox_seccomp.signal_program`);
  * Python-level guards (optional, on by default) as defence in depth.
Where the kernel refuses any of this the sandbox refuses to run anything
(`SandboxUnavailable`, with the reason); it never falls back to the guards. A
sample that cannot run (files larger than /sandbox, text that is not UTF-8, a
launcher that dies, outputs past the judge's budget) fails alone:
`RunResult.rejected` says why. The launcher dies with its caller, and the first
run of a process removes the temp dirs and cgroups of runs whose caller died.
How tests are judged outside the program's reach is `judge`'s. The interpreter is this Python
when a dropped uid can read its standard library, else the system python3
(`sandbox_python`).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Sequence

from ba_jax.sandboxing import cgroups
from ba_jax.sandboxing import cleanup
from ba_jax.sandboxing import outputs as outputs_lib
from ba_jax.sandboxing import sandbox_seccomp

_IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0
INSIDE = "/sandbox"  # the run's work dir as the program sees it

_HERE = os.path.dirname(os.path.abspath(__file__))
_LAUNCHER_FILE = os.path.join(_HERE, "sandbox_launcher.py")
_HARNESS_FILE = os.path.join(_HERE, "sandbox_harness.py")
_SPEC_FILE = "spec.json"


class SandboxUnavailable(RuntimeError):
  """The kernel refused the isolation the sandbox needs; nothing was run."""


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
  wall_time_s: float = 5.0
  cpu_time_s: int = 5  # per process
  memory_mb: int = 512  # every page the run holds, all its processes (and /sandbox) together
  max_processes: int = 16
  max_file_mb: int = 16
  max_output_chars: int = 1 << 20  # stdout and stderr, each
  max_result_mb: int = 16  # a call test's outputs, as plain data
  max_workdir_mb: int = 64  # /sandbox, the private tmpfs holding the run's files
  judge_time_s: float = 10.0  # reading a call test's outputs, and comparing them, each
  sockets: str = "unix"  # "unix": socket() for AF_UNIX only; "none": no socket at all
  require_memory_cgroup: bool = False  # refuse to run where no memory cgroup can be made
  python_guards: bool = True

  def __post_init__(self):
    if self.sockets not in ("unix", "none"):
      raise ValueError(f"sockets must be 'unix' or 'none', got {self.sockets!r}")


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
  # Call runs: ("value", v) or ("raised", exception name) per input, in order, up to the first
  # exception; None when the program did not report (`outputs_error` says why).
  outputs: list | None = None
  outputs_error: str = ""
  memory_exceeded: bool = False  # killed for going over memory_mb (cgroup or watchdog)
  rejected: str = ""  # the sample could not run: "too_large", "invalid_text", "sandbox_died"
  reason: str = ""  # one line on why it was rejected


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


def _read_capped(f, limit: int) -> bytes:
  f.seek(0)
  return f.read(limit)


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


def _refuse(reason: str):
  hint = ""
  if "unshare" in reason or "mount" in reason or "pivot_root" in reason:
    hint = (" It needs Linux >= 5.12 and " + (
        "CAP_SYS_ADMIN for mount/network/PID namespaces" if _IS_ROOT else
        "unprivileged user namespaces (sysctl user.max_user_namespaces > 0; on Ubuntu >= "
        "23.10 also kernel.apparmor_restrict_unprivileged_userns=0)"))
  raise SandboxUnavailable(f"sandbox: refusing to run untrusted code: {reason}.{hint}")


def _parse_status(lines: list[str]) -> tuple[int | None, str]:
  """(returncode of the program, rejection) from the launcher's status pipe; raises
  SandboxUnavailable when the kernel refused the setup."""
  errors = [line for line in lines if line.startswith("error: ")]
  if errors:
    _refuse(errors[0][len("error: "):])
  rejects = [line for line in lines if line.startswith("reject: ")]
  if rejects:
    return None, rejects[0][len("reject: "):]
  for line in lines:
    kind, _, value = line.partition(" ")
    if kind == "exit":
      return int(value), ""
    if kind == "signal":
      return -int(value), ""
  return None, ""  # killed (the wall-clock timeout, the memory limit) before it finished


def _rejected(kind: str, reason: str, uid=None) -> RunResult:
  return RunResult(returncode=None, stdout="", stderr="", timed_out=False, elapsed_s=0.0,
                   uid=uid, rejected=kind, reason=reason)


def _tmpfs_bytes(files: dict) -> int:
  return sum(4096 * max(1, math.ceil(len(content) / 4096)) for content in files.values())


def _memory_cgroup(limits: SandboxLimits) -> cgroups.RunCgroup | None:
  where = cgroups.hierarchy()
  if where is not None:
    try:
      return cgroups.RunCgroup.create(where, int(limits.memory_mb) << 20)
    except OSError as e:
      if limits.require_memory_cgroup:
        _refuse(f"could not make a memory cgroup under {where.parent}: {e}")
      return None
  if limits.require_memory_cgroup:
    _refuse("no writable cgroup v2 with the memory controller (set BA_JAX_SANDBOX_CGROUP to a "
            "delegated one) nor cgroup v1 memory hierarchy, and require_memory_cgroup is set")
  return None


@functools.lru_cache(maxsize=None)
def _remove_stale_runs() -> tuple:
  """Once per process: what runs of a caller that died left behind (`cleanup`)."""
  return tuple(cleanup.remove_stale_runs(tempfile.gettempdir(), cgroups.hierarchy()))


def run_program(source: str, stdin: str = "", limits: SandboxLimits = SandboxLimits(), *,
                assertions: Sequence | None = None, call: dict | None = None) -> RunResult:
  """Runs `source` as a Python program with `stdin`; returns its output and what was cleaned up.

  With `assertions` (test dicts, see `judge`) they run after the program and
  `assertions_passed` says whether the harness proved that all ran. With
  `call` ({"entry", "class", "inputs"}) the program's entry point is called on
  each input and `outputs` holds the results, as plain data.
  """
  if assertions is not None and call is not None:
    raise ValueError("run_program takes assertions or call, not both")
  try:
    files = {"solution.py": source.encode("utf-8")}
  except UnicodeEncodeError as e:
    return _rejected("invalid_text", f"the program is not valid text: {e.reason} at character "
                                     f"{e.start}")
  with open(_HARNESS_FILE, "rb") as f:
    files["harness.py"] = f.read()
  mode = "assert" if assertions is not None else "call" if call is not None else "stdin"
  if mode != "stdin":
    spec = {"tests": list(assertions)} if mode == "assert" else call
    files[_SPEC_FILE] = json.dumps(spec).encode()
  workdir_bytes = int(limits.max_workdir_mb) << 20
  if _tmpfs_bytes(files) > workdir_bytes:
    sizes = ", ".join(f"{name} {len(content)}" for name, content in files.items())
    return _rejected("too_large", f"the run's files ({sizes} bytes) do not fit the "
                                  f"{limits.max_workdir_mb} MB work directory")
  check_limits(limits)
  _remove_stale_runs()
  cgroup = _memory_cgroup(limits)
  workdir = tempfile.mkdtemp(prefix=cgroups.run_name() + "_")
  uid = 1_000_000 + secrets.randbelow(1 << 30) if _IS_ROOT else None
  token = secrets.token_hex(16).encode()
  pipes = []
  try:
    for name, content in files.items():
      with open(os.path.join(workdir, name), "wb") as f:
        f.write(content)
    status_r, status_w = os.pipe()
    token_r, token_w = os.pipe()
    pipes = [status_r, status_w, token_r, token_w]
    os.write(token_w, token)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, \
        tempfile.TemporaryFile() as inp, tempfile.TemporaryFile() as result:
      program_fds = {"assert": [token_r, result.fileno()], "call": [result.fileno()],
                     "stdin": []}[mode]
      config = {"uid": uid, "caller_pid": os.getpid(), "cpu_s": int(limits.cpu_time_s),
                "memory_bytes": int(limits.memory_mb) << 20,
                "file_bytes": int(limits.max_file_mb) << 20,
                "nproc": _nproc_limit(limits.max_processes), "workdir_bytes": workdir_bytes,
                "files": sorted(files), "status_fd": status_w, "program_fds": program_fds,
                "python": sandbox_python(), "sockets": limits.sockets,
                "cgroup_procs": cgroup.procs_file if cgroup else None,
                "cgroup_events": cgroup.events_file if cgroup else None,
                "watchdog_bytes": None if cgroup else int(limits.memory_mb) << 20,
                "harness": {"mode": mode, "guards": bool(limits.python_guards),
                            "token_fd": token_r, "result_fd": result.fileno(),
                            "signal_filter": sandbox_seccomp.signal_program(
                                sandbox_seccomp.syscalls()) if mode == "assert" else None,
                            "spec_file": _SPEC_FILE if mode != "stdin" else None,
                            "max_result_bytes": int(limits.max_result_mb) << 20}}
      env = {"PATH": "/usr/bin:/bin", "HOME": INSIDE, "TMPDIR": INSIDE, "LANG": "C.UTF-8",
             "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1",
             "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
      inp.write(stdin.encode("utf-8", errors="surrogateescape"))
      inp.seek(0)
      start = time.monotonic()
      process = subprocess.Popen(
          [config["python"], "-I", _LAUNCHER_FILE, json.dumps(config)],
          cwd=workdir, env=env, stdin=inp, stdout=out, stderr=err, start_new_session=True,
          pass_fds=(status_w, token_r, result.fileno()))
      for fd in (status_w, token_w, token_r):  # only the sandbox holds these now
        os.close(fd)
        pipes.remove(fd)
      try:
        process.wait(timeout=limits.wall_time_s)
        timed_out = False
      except subprocess.TimeoutExpired:
        timed_out = True
      elapsed = time.monotonic() - start
      killed = cleanup.kill_everything(process, uid, cgroup)
      process.wait()
      limit = int(limits.max_output_chars)
      stdout = _read_capped(out, limit).decode("utf-8", errors="replace")
      stderr = _read_capped(err, limit).decode("utf-8", errors="replace")
      result_bytes = _read_capped(result, (int(limits.max_result_mb) << 20) + 1)
    status = _read_available(status_r, 1 << 16).decode("utf-8", errors="replace").splitlines()
    returncode, rejection = _parse_status(status)
    memory_exceeded = "memory" in status or (cgroup is not None and cgroup.oom_killed())
    escaped = cleanup.remove_escaped_files(uid, workdir) if uid is not None else []
    run = RunResult(returncode=None if timed_out else returncode, stdout=stdout, stderr=stderr,
                    timed_out=timed_out, elapsed_s=elapsed, uid=uid, killed_processes=killed,
                    escaped_files=escaped, memory_exceeded=memory_exceeded)
    if rejection:
      run.rejected, run.reason = "too_large", rejection
    elif not status and not timed_out and not memory_exceeded:
      run.rejected = "sandbox_died"
      run.reason = (f"the sandbox's launcher exited with code {process.returncode} before "
                    "the program started")
    elif mode == "assert":
      run.assertions_passed = run.returncode == 0 and result_bytes == token
  finally:
    for fd in pipes:
      os.close(fd)
    shutil.rmtree(workdir, ignore_errors=True)
    if cgroup is not None:
      cgroup.remove()
  if mode == "call" and run.returncode == 0 and not run.rejected:  # nothing left to clean up
    try:
      run.outputs = outputs_lib.decode(result_bytes, len(call["inputs"]),
                                       outputs_lib.Budget(time_s=limits.judge_time_s))
    except outputs_lib.OverBudget as e:
      run.rejected, run.reason = e.reason, f"reading its outputs: {e}"
    except outputs_lib.Malformed as e:
      run.outputs_error = f"the outputs could not be read: {e}"
  return run


def isolation() -> str:
  """What contains a run in this process's mode (root or not), in words."""
  where = cgroups.hierarchy()
  memory = (where.describe() if where is not None else
            "RLIMIT_AS per process and a watchdog on the run's total")
  common = ("mount, network, PID and IPC namespaces; a new read-only root with a private tmpfs "
            "work dir; seccomp (AF_UNIX sockets only, no memfd/SysV shm, no namespaces); "
            f"{memory}; rlimits; no_new_privs")
  if _IS_ROOT:
    return f"root: {common}; a fresh uid per run"
  return f"unprivileged: a user namespace with {common}; no capabilities"


_available: list = []


def check_limits(limits: SandboxLimits) -> None:
  """Raises SandboxUnavailable, before any run, where `limits` cannot be enforced here."""
  try:
    sandbox_seccomp.syscalls()
  except sandbox_seccomp.Unsupported as e:
    _refuse(str(e))
  if limits.require_memory_cgroup and cgroups.hierarchy() is None:
    _memory_cgroup(limits)  # raises with the reason


def check_available() -> str:
  """Runs a trivial program once per process; `isolation()`, or SandboxUnavailable with the reason."""
  if not _available:
    result = run_program("print('ok')", limits=SandboxLimits(wall_time_s=60.0, cpu_time_s=30))
    if result.stdout != "ok\n":
      raise SandboxUnavailable(
          f"sandbox: the probe program did not run (exit code {result.returncode}, timed out: "
          f"{result.timed_out}{', ' + result.reason if result.reason else ''}); stderr: "
          f"{result.stderr[-300:]!r}")
    _available.append(isolation())
  return _available[0]
