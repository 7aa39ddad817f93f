"""After a sandbox run: every process it started killed and reaped, files a run's uid left in
the shared temp dirs removed (none can be written there from the sandbox's root; this is the
second line). Before a process's first run: the temp dirs and memory cgroups of runs whose
creating process died (a caller killed mid-run or mid-judge) removed."""
from __future__ import annotations

import glob
import os
import shutil
import signal
import stat
import subprocess
import time

from ba_jax.sandboxing import cgroups

_WORLD_WRITABLE_DIRS = ("/tmp", "/var/tmp", "/dev/shm")


def live_processes(pgid: int, uid: int | None) -> list[int]:
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


def kill_everything(process: subprocess.Popen, uid: int | None,
                     cgroup) -> int:
  """SIGKILLs the run's process group, cgroup and every process of its uid, until none is left."""
  killed = set()
  deadline = time.monotonic() + 10.0
  while time.monotonic() < deadline:
    try:
      os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
      pass
    process.poll()  # reap the main process so it does not linger as a zombie
    if cgroup is not None:
      killed |= cgroup.kill_all()
    pids = [p for p in live_processes(process.pid, uid) if p != os.getpid()]
    if not pids and (cgroup is None or not cgroup.pids()):
      break
    for pid in pids:
      try:
        os.kill(pid, signal.SIGKILL)
        killed.add(pid)
      except ProcessLookupError:
        pass
    time.sleep(0.005)
  return len(killed - {process.pid})


def remove_escaped_files(uid: int, workdir: str) -> list[str]:
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


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    pass  # another user's: alive
  return True


def remove_stale_runs(temp_dir: str, hierarchy: cgroups.Hierarchy | None) -> list[str]:
  """Removes the run temp dirs under `temp_dir` and run cgroups under `hierarchy` that this
  user made from a process no longer alive (a killed caller's; a pid reused since is taken
  as alive, and its runs left alone); returns them."""
  found = [(path, None) for path in glob.glob(os.path.join(temp_dir, cgroups.PREFIX + "*"))]
  if hierarchy is not None:
    found += [(path, hierarchy.version)
              for path in glob.glob(os.path.join(hierarchy.parent, cgroups.PREFIX + "*"))]
  removed = []
  for path, version in found:
    creator = cgroups.run_creator(path)
    try:
      mine = os.stat(path).st_uid == os.geteuid()
    except OSError:
      continue
    if creator is None or creator == os.getpid() or not mine or _alive(creator):
      continue
    if version is None:
      shutil.rmtree(path, ignore_errors=True)
    else:
      cgroups.RunCgroup(path, version).remove()  # kills what is left in it first
    if not os.path.exists(path):
      removed.append(path)
  return removed
