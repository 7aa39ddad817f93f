"""Hard limits, as the caller (root here and in CI) and as an unprivileged user: memory the
address-space limit does not see, the total over every process, sockets outside AF_UNIX, the
caller's files, and samples that cannot run. Each attack fails (or scores 0) with one clear
line, and nothing is left on the host."""
import ast
import os
import shutil
import subprocess

import pytest

from ba_jax.sandboxing import cgroups
from ba_jax.sandboxing import sandbox
from ba_jax.tasks import rewards
from sandbox_modes import HERE, MODES, NOBODY, program, run_jobs
from sandbox_modes import nothing_left_behind  # noqa: F401 -- an autouse fixture
from sandbox_modes import shared_copy, judged_job

MB = 1 << 20


@pytest.fixture(scope="module")
def shared_dir():
  with shared_copy() as root:
    yield root


HOLD_MEMFD = ("import os\nfd = os.memfd_create('x')\nfor _ in range(384):\n"
              "    os.write(fd, b'x' * (1 << 20))\nprint('held 384 MB')\n")
HOLD_SYSV = ("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
             "segment = libc.shmget(0, 384 << 20, 0o1000 | 0o600)\n"
             "assert segment >= 0, f'shmget: errno {ctypes.get_errno()}'\nprint('held 384 MB')\n")
HOLD_POSIX = ("from multiprocessing import shared_memory\n"
              "m = shared_memory.SharedMemory(create=True, size=384 << 20)\n"
              "m.buf[::4096] = b'x' * len(m.buf[::4096])\nprint('held 384 MB')\n")
HOLD_MMAP = ("import mmap\nm = mmap.mmap(-1, 384 << 20, flags=mmap.MAP_SHARED)\n"
             "m[::4096] = b'x' * len(m[::4096])\nprint('held 384 MB')\n")
HOLD_NEW_TMPFS = ("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                  "ok = libc.unshare(0x10000000 | 0x00020000) == 0\n"  # user + mount namespaces
                  "assert ok, f'unshare: errno {ctypes.get_errno()}'\nprint('held 384 MB')\n")


@pytest.mark.parametrize("mode", MODES)
def test_memory_the_address_space_limit_does_not_see_is_refused(mode, shared_dir):
  jobs = [program(source, memory_mb=64, python_guards=False)
          for source in (HOLD_MEMFD, HOLD_SYSV, HOLD_POSIX, HOLD_MMAP, HOLD_NEW_TMPFS)]
  results = run_jobs(mode, jobs, shared_dir)
  for source, result in zip((HOLD_MEMFD, HOLD_SYSV, HOLD_POSIX, HOLD_MMAP, HOLD_NEW_TMPFS),
                            results):
    assert "held" not in result["stdout"] and result["returncode"] != 0, source
    last_line = result["stderr"].strip().splitlines()[-1]
    assert any(reason in last_line for reason in (
        "Operation not permitted", "errno 1", "No such file or directory",
        "Cannot allocate memory", "MemoryError")), (source, last_line)


# Four processes holding 100 MB each: every one is within RLIMIT_AS (256 MB), the run is not.
HOLD_IN_CHILDREN = """
import os, time
read_end, write_end = os.pipe()
for _ in range({children}):
    if os.fork() == 0:
        os.close(read_end)
        data = b"x" * ({mb} << 20)
        os.write(write_end, b"1")
        time.sleep(30)
        os._exit(0)
os.close(write_end)
held = 0
while held < {children}:
    if not os.read(read_end, 1):
        break
    held += 1
print("held", held, flush=True)
"""


@pytest.mark.parametrize("mode", MODES)
def test_the_memory_limit_counts_every_process_together(mode, shared_dir):
  over, under = run_jobs(mode, [
      program(HOLD_IN_CHILDREN.format(children=4, mb=100), wall_time_s=6.0),
      program(HOLD_IN_CHILDREN.format(children=2, mb=50), wall_time_s=6.0)], shared_dir)
  assert "held 4" not in over["stdout"] and over["memory_exceeded"], over
  assert under["stdout"].startswith("held 2") and not under["memory_exceeded"], under


SOCKETS = """
import _socket
for name in ("AF_INET", "AF_INET6", "AF_VSOCK", "AF_PACKET", "AF_NETLINK", "AF_UNIX"):
    kind = _socket.SOCK_RAW if name == "AF_PACKET" else _socket.SOCK_DGRAM
    try:
        s = _socket.socket(getattr(_socket, name), kind)
        if name == "AF_VSOCK":
            s.bind((0xFFFFFFFF, 1234))
        print(name, "opened")
    except OSError as e:
        print(name, e.strerror)
try:
    _socket.socketpair(_socket.AF_UNIX)
    print("socketpair opened")
except OSError as e:
    print("socketpair", e.strerror)
"""


@pytest.mark.parametrize("mode", MODES)
def test_only_unix_sockets_open(mode, shared_dir):
  unix, none = run_jobs(mode, [program(SOCKETS, python_guards=False),
                               program(SOCKETS, python_guards=False, sockets="none")], shared_dir)
  refused = "Operation not permitted"
  expected = {name: refused for name in ("AF_INET", "AF_INET6", "AF_VSOCK", "AF_PACKET",
                                         "AF_NETLINK")}
  lines = dict(line.split(" ", 1) for line in unix["stdout"].splitlines())
  assert lines == dict(expected, AF_UNIX="opened", socketpair="opened"), unix
  lines = dict(line.split(" ", 1) for line in none["stdout"].splitlines())
  assert lines == dict(expected, AF_UNIX=refused, socketpair=refused), none


@pytest.fixture
def private_file():
  """A file only the caller can read, outside every dir the sandbox used to mask (/tmp etc.)."""
  directory = os.path.join(HERE, f".caller_private_{os.getpid()}")
  os.mkdir(directory, 0o700)
  path = os.path.join(directory, "token.txt")
  with open(path, "w") as f:
    f.write("CALLER-SECRET-7f3a")
  os.chmod(path, 0o600)
  try:
    yield path
  finally:
    shutil.rmtree(directory, ignore_errors=True)


@pytest.mark.parametrize("mode", MODES)
def test_the_callers_files_are_not_in_the_sandbox(mode, shared_dir, private_file):
  if mode == "unprivileged":  # the unprivileged caller owns it and can read it on the host
    for path in (os.path.dirname(private_file), private_file):
      os.chown(path, NOBODY, NOBODY)
    assert subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}",
                           "--clear-groups", "cat", private_file],
                          capture_output=True, text=True).stdout == "CALLER-SECRET-7f3a"
  leak = (f"import os, sys\nprint(sorted(os.listdir('/')))\n"
          f"sys.stderr.write(open({private_file!r}).read())\n")
  listing, judged = run_jobs(mode, [program(leak),
                                    judged_job(leak, [{"input": "", "output": "x"}])], shared_dir)
  assert "SECRET" not in listing["stdout"] + listing["stderr"]
  assert listing["stderr"].strip().splitlines()[-1].startswith("FileNotFoundError")
  root = set(ast.literal_eval(listing["stdout"]))
  assert {"sandbox", "usr", "etc"} <= root and not {"work", "home", "root", "proc", "sys", "run",
                                                     "var", "opt", "mnt"} & root
  assert judged["passed"] == 0 and "SECRET" not in judged["message"]
  assert len(judged["message"]) < 500


@pytest.mark.parametrize("mode", MODES)
def test_a_sample_that_cannot_run_fails_alone(mode, shared_dir):
  oversized = "x = 1\n" + "# padding\n" * (2 * MB // 10)
  cases = [{"input": "", "output": "1"}]
  results = run_jobs(mode, [judged_job(oversized + "print(x)\n", cases, max_workdir_mb=1),
                            judged_job("print(1)\n# \ud800 is no text\n", cases),
                            judged_job("print(1)\n", cases)], shared_dir)
  too_large, invalid, fine = results
  assert (too_large["rejected"], too_large["passed"]) == ("too_large", 0)
  assert "do not fit the 1 MB work directory" in too_large["message"]
  assert (invalid["rejected"], invalid["passed"]) == ("invalid_text", 0)
  assert fine["passed"] == 1 and not fine["rejected"]


def test_rejected_samples_are_counted_and_the_batch_goes_on(monkeypatch, tmp_path):
  limits = sandbox.SandboxLimits(wall_time_s=3.0, max_workdir_mb=1)
  cases = [{"input": "2\n", "output": "4"}]
  batch = rewards.score_code(["print(2 * int(input()))\n" + "#" * (2 * MB),
                              "print(2 * int(input()))  # \udcff\n",
                              "print(2 * int(input()))\n"], [cases] * 3, limits=limits)
  assert batch.scores.tolist() == [0.0, 0.0, 1.0] and batch.errors == 0
  assert batch.rejected == {"too_large": 1, "invalid_text": 1}
  metrics = batch.metrics()
  assert metrics["reward/rejected"] == 2.0 and metrics["reward/rejected/too_large"] == 1.0
  # A launcher that dies before setting up (a crash, the OOM killer) fails its sample only.
  sandbox.check_available()
  dying = tmp_path / "launcher.py"
  dying.write_text("import os\nos._exit(3)\n")
  monkeypatch.setattr(sandbox, "_LAUNCHER_FILE", str(dying))
  batch = rewards.score_code(["print(4)\n"], [cases], limits=limits)
  assert batch.scores.tolist() == [0.0] and batch.rejected == {"sandbox_died": 1}
  assert "exited with code 3 before the program started" in batch.messages[0]


def test_memory_cgroups_are_found_where_they_can_be_made(tmp_path):
  def tree(layout):
    for path, text in layout.items():
      full = tmp_path / path
      full.parent.mkdir(parents=True, exist_ok=True)
      full.write_text(text)

  mount = tmp_path / "cg"
  # cgroup v2: our own cgroup holds processes, so run cgroups go under its parent.
  tree({"cg/jobs/cgroup.subtree_control": "cpu memory pids\n",
        "cg/jobs/me/cgroup.subtree_control": ""})
  mountinfo = f"41 31 0:38 / {mount} rw,relatime - cgroup2 cgroup2 rw\n"
  found = cgroups.find_hierarchy(mountinfo, "0::/jobs/me\n")
  assert found == cgroups.Hierarchy(2, str(mount / "jobs"))
  # A delegated directory named by BA_JAX_SANDBOX_CGROUP wins; one without memory does not.
  assert cgroups.find_hierarchy(mountinfo, "0::/jobs/me\n", str(mount / "jobs")).version == 2
  assert cgroups.find_hierarchy(mountinfo, "0::/jobs/me\n", str(mount / "jobs" / "me")) is None
  # cgroup v1: the memory hierarchy, under our own cgroup.
  tree({"mem/a/b/memory.limit_in_bytes": "9223372036854771712\n"})
  mountinfo_v1 = (f"35 31 0:32 / {tmp_path / 'mem'} rw,relatime - cgroup cgroup rw,memory\n"
                  f"36 31 0:33 / {tmp_path / 'cpu'} rw,relatime - cgroup cgroup rw,cpu\n")
  assert cgroups.find_hierarchy(mountinfo_v1, "5:cpu:/\n4:memory:/a/b\n0::/\n") == \
      cgroups.Hierarchy(1, str(tmp_path / "mem" / "a" / "b"))
  assert cgroups.find_hierarchy("", "0::/\n") is None
  # A run's cgroup gets the limit (and no swap), and is removed with what is in it.
  group = cgroups.RunCgroup.create(cgroups.Hierarchy(2, str(mount / "jobs")), 64 * MB)
  assert (tmp_path / group.path / "memory.max").read_text() == str(64 * MB)
  assert not group.oom_killed()
  os.remove(os.path.join(group.path, "memory.max"))  # a real cgroup dir has no files to delete
  group.remove()
  assert not os.path.exists(group.path)


def test_a_memory_cgroup_can_be_required():
  limits = sandbox.SandboxLimits(require_memory_cgroup=True)
  if cgroups.hierarchy() is None:
    with pytest.raises(sandbox.SandboxUnavailable, match="no writable cgroup v2"):
      sandbox.run_program("print(1)", limits=limits)
  else:
    assert sandbox.run_program("print(1)", limits=limits).stdout == "1\n"
