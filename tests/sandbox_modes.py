"""Runs sandbox jobs as the caller (root here and in CI) and as an unprivileged user (`setpriv`
to nobody, from a world-readable copy of ba_jax's sandbox files), for tests that must hold in
both modes."""
import contextlib
import glob
import json
import os
import shutil
import subprocess
import tempfile
import time

import pytest

import sandbox_driver
from ba_jax.sandboxing import cgroups
from ba_jax.sandboxing import sandbox

NOBODY = 65534
IS_ROOT = os.geteuid() == 0
MODES = ["caller", "unprivileged"]
LIMITS = {"wall_time_s": 3.0, "cpu_time_s": 3, "memory_mb": 256, "max_processes": 8}
HERE = os.path.dirname(os.path.abspath(__file__))
PACKAGE = os.path.dirname(os.path.abspath(sandbox.__file__))


@contextlib.contextmanager
def shared_copy():
  """A world-readable copy of the sandbox and the driver, and a world-writable victim dir."""
  root = tempfile.mkdtemp(prefix="ba_jax_attack_")
  os.makedirs(os.path.join(root, "ba_jax", "sandboxing"))
  for sub in ("ba_jax", os.path.join("ba_jax", "sandboxing")):
    open(os.path.join(root, sub, "__init__.py"), "w").close()
  for name in glob.glob(os.path.join(PACKAGE, "*.py")):
    if not name.endswith("__init__.py"):
      shutil.copy(name, os.path.join(root, "ba_jax", "sandboxing"))
  shutil.copy(os.path.join(HERE, "sandbox_driver.py"), root)
  victim = os.path.join(root, "victim")
  os.makedirs(victim)
  for dirpath, dirnames, filenames in os.walk(root):
    os.chmod(dirpath, 0o755)
    for name in filenames:
      os.chmod(os.path.join(dirpath, name), 0o644)
  os.chmod(root, 0o755)
  os.chmod(victim, 0o777)
  try:
    yield root
  finally:
    shutil.rmtree(root, ignore_errors=True)


def run_jobs(mode, jobs, shared_dir):
  if mode == "caller":
    results = sandbox_driver.run_jobs(jobs)
    assert not isinstance(results, dict), results
    return results
  if not IS_ROOT:
    pytest.skip("the tests already run unprivileged: 'caller' is that mode")
  command = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
             sandbox.sandbox_python(), "-I", os.path.join(shared_dir, "sandbox_driver.py"),
             shared_dir]
  done = subprocess.run(command, input=json.dumps(jobs), capture_output=True, text=True,
                        timeout=240, cwd=shared_dir)
  assert done.returncode == 0, \
      f"the caller died (exit code {done.returncode}): {done.stderr[-2000:]}"
  results = json.loads(done.stdout)
  if isinstance(results, dict):  # e.g. AppArmor forbids unprivileged user namespaces
    assert "refusing to run untrusted code" in results["refused"]
    pytest.skip(f"refused, as it must be where the kernel forbids it: {results['refused']}")
  return results


def program(source, **limits):
  return {"kind": "program", "program": source, "limits": dict(LIMITS, **limits)}


def judged_job(source, cases, **limits):
  return {"kind": "tests", "program": source, "tests": cases, "limits": dict(LIMITS, **limits)}


def sandbox_dirs_of(uid):
  return {d for d in glob.glob(os.path.join(tempfile.gettempdir(), "ba_jax_sandbox_*"))
          if os.stat(d).st_uid == uid}


def leftovers():
  """What sandbox runs could leave on the host: temp dirs and memory cgroups."""
  found = set(glob.glob(os.path.join(tempfile.gettempdir(), "ba_jax_sandbox_*")))
  where = cgroups.hierarchy()
  if where is not None:
    found |= set(glob.glob(os.path.join(where.parent, "ba_jax_sandbox_*")))
  return found


def _creator_alive_elsewhere(path):
  """True when the run's name says another live process made it: a run still in flight in
  another test worker, not one this test left behind."""
  creator = cgroups.run_creator(path)
  if creator is None or creator == os.getpid():
    return False
  try:
    os.kill(creator, 0)
  except ProcessLookupError:
    return False
  return True  # alive (PermissionError too: alive, another user's)


def left_behind(before):
  return {path for path in leftovers() - before if not _creator_alive_elsewhere(path)}


@pytest.fixture(autouse=True)
def nothing_left_behind():
  """No run's temp dir or memory cgroup outlives the test. Runs that other test workers (or
  other sessions) still have in flight are told apart by the creating pid in the run's name.
  Test modules use it by importing it."""
  before = leftovers()
  yield
  deadline = time.monotonic() + 5.0
  while left_behind(before) and time.monotonic() < deadline:
    time.sleep(0.1)
  assert not left_behind(before), f"a run left its temp dir or cgroup behind: {left_behind(before)}"
