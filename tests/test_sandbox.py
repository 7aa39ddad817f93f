"""The code sandbox: correct scoring, and every harmful program contained, scored 0, cleaned up.

The harmful programs are bounded so that a failure of the sandbox cannot take
down a shared 2-core machine: small process and memory limits, 2 s walls.
"""
import dataclasses
import os
import socket
import tempfile
import time

import numpy as np
import pytest

from ba_jax.tasks import rewards
from ba_jax.sandboxing import cleanup
from ba_jax.sandboxing import sandbox

LIMITS = sandbox.SandboxLimits(wall_time_s=2.0, cpu_time_s=2, memory_mb=256, max_processes=8)
SLACK_S = 8.0  # process start-up and cleanup on a loaded 2-core machine
IS_ROOT = os.geteuid() == 0
DOUBLE = "print(2 * int(input()))"
IO_TESTS = [{"input": "3\n", "output": "6\n"}, {"input": "21", "output": "42"},
            {"input": "-4\n", "output": "-8"}]


def run(source, stdin="", **overrides):
  limits = dataclasses.replace(LIMITS, **overrides)
  created = []
  mkdtemp = tempfile.mkdtemp

  def recording_mkdtemp(*args, **kwargs):  # other sessions' sandboxes share /tmp
    created.append(mkdtemp(*args, **kwargs))
    return created[-1]

  sandbox.tempfile.mkdtemp = recording_mkdtemp
  try:
    start = time.monotonic()
    result = sandbox.run_program(source, stdin, limits)
    elapsed = time.monotonic() - start
  finally:
    sandbox.tempfile.mkdtemp = mkdtemp
  if result.uid is not None:
    assert cleanup.live_processes(-1, result.uid) == [], "processes of the sandbox uid survive"
  assert len(created) == 1 and not os.path.exists(created[0]), "the run's temp dir was not removed"
  return result, elapsed


def test_passing_and_failing_programs():
  result, _ = run(DOUBLE, "21\n")
  assert (result.returncode, result.stdout, result.timed_out) == (0, "42\n", False)
  batch = rewards.score_code(
      [DOUBLE, "print(int(input()) + 3)", "print(2 * int(input()))\nraise SystemExit(1)"],
      [IO_TESTS] * 3)
  np.testing.assert_allclose(batch.scores, [1.0, 1 / 3, 0.0], rtol=0, atol=1e-7)  # 3+3 == 6
  assert batch.correct.tolist() == [True, False, False] and batch.timeouts == 0
  strict = rewards.score_code([DOUBLE, "print(int(input()) + 3)"], [IO_TESTS] * 2,
                              all_or_nothing=True, correct_score=1.0, incorrect_score=-1.0)
  assert strict.scores.tolist() == [1.0, -1.0]


def test_assertion_style_tests_and_private_cwd():
  program = ("def f(x):\n    return x * x\n"
             "with open('scratch.txt', 'w') as fh:\n    fh.write('ok')\n")  # cwd is writable
  batch = rewards.score_code([program], [["assert f(3) == 9", "assert f(-2) == 4",
                                          "assert f(2) == 5"]])
  np.testing.assert_allclose(batch.scores, [2 / 3], atol=1e-7)
  with pytest.raises(ValueError, match="test case 0 must be a Python assertion string or a dict"):
    rewards.score_code([program], [[42]])


def test_infinite_loop_is_killed_within_the_limit():
  result, elapsed = run("while True:\n    pass\n")
  assert result.timed_out and result.returncode is None
  assert elapsed < LIMITS.wall_time_s + SLACK_S
  batch = rewards.score_code(["while True:\n    pass\n"], [IO_TESTS[:1]], limits=LIMITS)
  assert batch.scores.tolist() == [0.0] and batch.timeouts == 1


def test_cpu_limit_kills_a_busy_program_before_the_wall():
  result, _ = run("while True:\n    pass\n", wall_time_s=30.0, cpu_time_s=1)
  assert not result.timed_out and result.returncode != 0  # SIGXCPU from RLIMIT_CPU
  assert result.elapsed_s < 1.0 + SLACK_S


def test_memory_bomb_is_contained():
  bomb = "blocks = []\nwhile True:\n    blocks.append(bytearray(16 << 20))\n"
  result, elapsed = run(bomb)
  assert result.returncode != 0 and "MemoryError" in result.stderr
  assert elapsed < LIMITS.wall_time_s + SLACK_S
  assert rewards.score_code([bomb], [IO_TESTS[:1]], limits=LIMITS).scores.tolist() == [0.0]


@pytest.mark.parametrize("escape_session", [False, True])
def test_fork_bomb_is_contained_and_reaped(escape_session):
  # With escape_session each child leaves the process group, so only the per-run uid finds it.
  detach = "        if pid == 0:\n            os.setsid()\n" if escape_session else ""
  bomb = ("import os\nwhile True:\n    try:\n        pid = os.fork()\n" + detach +
          "    except OSError:\n        pass\n")
  result, elapsed = run(bomb)
  assert result.timed_out and elapsed < LIMITS.wall_time_s + SLACK_S
  # Whatever was still alive when the run ended: at most max_processes of the program's plus the
  # namespace's init. Often 0: when the init dies the kernel may reap the namespace before the scan.
  # run() has checked that nothing of the run's uid survives.
  assert result.killed_processes <= LIMITS.max_processes + 1
  assert rewards.score_code([bomb], [IO_TESTS[:1]], limits=LIMITS).scores.tolist() == [0.0]


def test_process_limit_holds():
  # Children that stay alive: the program (one process) gets max_processes - 1 forks, then EAGAIN.
  forks = ("import os, time\nn = 0\nfor _ in range(50):\n    try:\n        pid = os.fork()\n"
           "    except OSError:\n        break\n    if pid == 0:\n        time.sleep(30)\n"
           "        os._exit(0)\n    n += 1\nprint(n, flush=True)\n")
  result, _ = run(forks)
  assert result.returncode == 0 and not result.timed_out
  if IS_ROOT:  # a fresh uid: RLIMIT_NPROC counts exactly the program's processes
    assert int(result.stdout) == LIMITS.max_processes - 1
  else:
    assert 1 <= int(result.stdout) < 50


@pytest.mark.parametrize("guards", [True, False])
def test_write_outside_the_temp_dir_is_blocked(tmp_path, guards):
  shared = os.path.join(tempfile.gettempdir(), f"ba_jax_escape_{os.getpid()}_{guards}.txt")
  private = tmp_path / "victim.txt"  # a root-owned directory
  program = (f"import os\ntry:\n    open({str(private)!r}, 'w').write('pwned')\nexcept OSError:\n"
             f"    pass\nopen({shared!r}, 'w').write('pwned')\nprint(42)\n")
  result, _ = run(program, python_guards=guards)
  assert not private.exists() and not os.path.exists(shared)
  assert result.returncode != 0 and result.escaped_files == []
  assert ("writing outside" if guards else "Read-only file system") in result.stderr
  batch = rewards.score_code([program], [[{"input": "", "output": "42"}]],
                             limits=dataclasses.replace(LIMITS, python_guards=guards))
  assert not os.path.exists(shared)
  assert batch.scores.tolist() == [0.0]  # blocked write -> crash -> 0


@pytest.mark.parametrize("guards", [True, False])
def test_network_socket_attempt_fails(guards):
  server = socket.socket()
  server.bind(("127.0.0.1", 0))
  server.listen(1)
  server.settimeout(0.2)
  port = server.getsockname()[1]
  accepted = []

  def accept():
    try:
      accepted.append(server.accept())
    except OSError:
      pass

  program = (f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
             "s.sendall(b'leak')\nprint('connected')\n")
  result, _ = run(program, python_guards=guards)
  accept()
  server.close()
  assert "connected" not in result.stdout and result.returncode != 0
  assert accepted == []
  # Without the guards, the seccomp filter refuses socket() for any family but AF_UNIX.
  expected_error = "network access is not allowed" if guards else "Operation not permitted"
  assert expected_error in result.stderr


def test_score_code_in_the_pool():
  with rewards.RewardPool(num_workers=2, timeout_s=30.0, initializer=None) as pool:
    batch = rewards.score_code([DOUBLE, "while True:\n    pass\n", "print(int(input()) + 3)"],
                               [IO_TESTS[:2]] * 3, pool=pool,
                               limits=dataclasses.replace(LIMITS, wall_time_s=1.0))
  np.testing.assert_allclose(batch.scores, [1.0, 0.0, 0.5], atol=1e-7)
  assert batch.timeouts == 2 and batch.errors == 0
