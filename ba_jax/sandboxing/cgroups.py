"""A memory cgroup per sandbox run: every page its processes hold (anonymous, shared, tmpfs,
memfd), in total, under one limit.

cgroup v2 where this process may create a cgroup under one whose `cgroup.subtree_control`
enables the memory controller: `BA_JAX_SANDBOX_CGROUP` (a delegated directory), else its
own cgroup, else its parent. Else cgroup v1's memory hierarchy (writable as root in most
containers). Else None: the sandbox then falls back on its seccomp filter, RLIMIT_AS and
the launcher's watchdog (`sandbox_launcher`). The run's launcher joins the cgroup before
it enters its namespaces, so everything it starts is counted.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import os
import re
import secrets
import signal
import time

ENV_PARENT = "BA_JAX_SANDBOX_CGROUP"
PREFIX = "ba_jax_sandbox_"


def run_name() -> str:
  """A run's cgroup and work-dir name: the prefix, the creating process's pid, a random tag.
  The pid lets a cleanup (or a test) tell a run still in flight from one left behind."""
  return f"{PREFIX}{os.getpid()}_{secrets.token_hex(6)}"


def run_creator(path: str) -> int | None:
  """The pid of the process that made the run named by ``path``'s last
  component (a ``run_name``), or None for another name."""
  name = os.path.basename(path)
  creator = name[len(PREFIX):].split("_")[0] if name.startswith(PREFIX) else ""
  return int(creator) if creator.isdigit() else None


@dataclasses.dataclass(frozen=True)
class Hierarchy:
  version: int  # 1 or 2
  parent: str  # where run cgroups are made

  def describe(self) -> str:
    return f"a cgroup v{self.version} memory limit per run (under {self.parent})"


def _unescape(path: str) -> str:
  return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), path)


def parse_mountinfo(text: str) -> list[tuple[str, str, str, set]]:
  """(fstype, mount root, mount point, super options) per line of /proc/self/mountinfo."""
  mounts = []
  for line in text.splitlines():
    left, sep, right = line.partition(" - ")
    fields, tail = left.split(), right.split()
    if not sep or len(fields) < 5 or len(tail) < 3:
      continue
    mounts.append((tail[0], _unescape(fields[3]), _unescape(fields[4]), set(tail[2].split(","))))
  return mounts


def parse_proc_cgroup(text: str) -> dict[str, str]:
  """{"v2": path, "memory": path (v1)} from /proc/self/cgroup."""
  found = {}
  for line in text.splitlines():
    parts = line.split(":", 2)
    if len(parts) != 3:
      continue
    _, controllers, path = parts
    if controllers == "" and parts[0] == "0":
      found["v2"] = path
    elif "memory" in controllers.split(","):
      found["memory"] = path
  return found


def _locate(mounts, fstype, wanted_option, path):
  """The directory of cgroup `path` under a mount of `fstype` (with `wanted_option`)."""
  if path is None or "/.." in path:
    return None
  for kind, root, point, options in mounts:
    if kind != fstype or (wanted_option and wanted_option not in options):
      continue
    if root == "/":
      return os.path.normpath(point + path)
    if path == root or path.startswith(root.rstrip("/") + "/"):
      return os.path.normpath(point + path[len(root):])
  return None


def _read(path: str) -> str:
  try:
    with open(path) as f:
      return f.read()
  except OSError:
    return ""


def _v2_parent_ok(directory: str) -> bool:
  return ("memory" in _read(os.path.join(directory, "cgroup.subtree_control")).split()
          and os.access(directory, os.W_OK | os.X_OK))


def find_hierarchy(mountinfo: str, proc_cgroup: str, override: str = "") -> Hierarchy | None:
  """Where run cgroups can be made (see the module doc), from the two /proc files' text."""
  if override:
    return Hierarchy(2, override) if _v2_parent_ok(override) else None
  mounts = parse_mountinfo(mountinfo)
  own = parse_proc_cgroup(proc_cgroup)
  v2 = _locate(mounts, "cgroup2", "", own.get("v2"))
  if v2 is not None:
    for candidate in (v2, os.path.dirname(v2)):
      if _v2_parent_ok(candidate):
        return Hierarchy(2, candidate)
  v1 = _locate(mounts, "cgroup", "memory", own.get("memory"))
  if v1 is not None and os.path.isfile(os.path.join(v1, "memory.limit_in_bytes")) and \
      os.access(v1, os.W_OK | os.X_OK):
    return Hierarchy(1, v1)
  return None


@functools.lru_cache(maxsize=None)
def hierarchy() -> Hierarchy | None:
  """This process's `find_hierarchy`, checked by making (and removing) one cgroup."""
  found = find_hierarchy(_read("/proc/self/mountinfo"), _read("/proc/self/cgroup"),
                         os.environ.get(ENV_PARENT, ""))
  if found is None:
    return None
  try:
    RunCgroup.create(found, 64 << 20).remove()
  except OSError as e:
    logging.getLogger(__name__).warning("sandbox: cannot make memory cgroups under %s (%s); "
                                        "falling back on seccomp, rlimits and a watchdog",
                                        found.parent, e)
    return None
  return found


def _write(path: str, value) -> None:
  with open(path, "w") as f:
    f.write(str(value))


@dataclasses.dataclass
class RunCgroup:
  path: str
  version: int

  @classmethod
  def create(cls, where: Hierarchy, limit_bytes: int) -> "RunCgroup":
    path = os.path.join(where.parent, run_name())
    os.mkdir(path)
    group = cls(path, where.version)
    try:
      if where.version == 2:
        _write(os.path.join(path, "memory.max"), limit_bytes)
        for name, value in (("memory.swap.max", 0), ("memory.oom.group", 1)):
          if os.path.exists(os.path.join(path, name)):
            _write(os.path.join(path, name), value)
      else:
        _write(os.path.join(path, "memory.limit_in_bytes"), limit_bytes)
        if os.path.exists(os.path.join(path, "memory.memsw.limit_in_bytes")):  # swap too
          _write(os.path.join(path, "memory.memsw.limit_in_bytes"), limit_bytes)
    except OSError:
      group.remove()
      raise
    return group

  @property
  def procs_file(self) -> str:
    return os.path.join(self.path, "cgroup.procs")

  @property
  def events_file(self) -> str:
    """Where the kernel counts OOM kills ("oom_kill N")."""
    return os.path.join(self.path, "memory.events" if self.version == 2 else "memory.oom_control")

  def pids(self) -> list[int]:
    return [int(p) for p in _read(self.procs_file).split() if p.isdigit()]

  def oom_killed(self) -> bool:
    """Whether the kernel killed a process of the run for going over the limit."""
    for line in _read(self.events_file).splitlines():
      key, _, value = line.partition(" ")
      if key == "oom_kill" and value.strip().isdigit() and int(value) > 0:
        return True
    return False

  def kill_all(self) -> set[int]:
    killed = set()
    for pid in self.pids():
      try:
        os.kill(pid, signal.SIGKILL)
        killed.add(pid)
      except ProcessLookupError:
        pass
    return killed

  def remove(self) -> None:
    """Kills what is left in it and removes it (retrying while the dying leave)."""
    deadline = time.monotonic() + 10.0
    while True:
      self.kill_all()
      try:
        os.rmdir(self.path)
        return
      except FileNotFoundError:
        return
      except OSError as e:
        if time.monotonic() > deadline:
          logging.getLogger(__name__).warning("sandbox: could not remove %s: %s", self.path, e)
          return
      time.sleep(0.005)
