"""The same attacks and reward hacks, run as the caller (root here and in CI) and as an unprivileged
user (`setpriv` to nobody), must be contained and score 0 in both modes."""
import os
import socket
import subprocess
import tempfile
import time

import pytest

from ba_jax.tasks import rewards
from ba_jax.sandboxing import judge
from ba_jax.sandboxing import sandbox
from sandbox_modes import IS_ROOT, LIMITS, MODES, NOBODY, program, run_jobs, sandbox_dirs_of
from sandbox_modes import shared_copy
from sandbox_modes import judged_job as assertion_job


@pytest.fixture(scope="module")
def shared_dir():
  with shared_copy() as root:
    yield root


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("guards", [True, False])
def test_raw_socket_cannot_reach_the_network(mode, guards, shared_dir):
  server = socket.socket()
  server.bind(("127.0.0.1", 0))
  server.listen(1)
  server.settimeout(0.2)
  port = server.getsockname()[1]
  source = ("import _socket\n"  # below socket.socket, where the Python guard sits
            "s = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)\ns.settimeout(1)\n"
            f"s.connect(('127.0.0.1', {port}))\ns.send(b'leak')\nprint('connected')\n")
  [result] = run_jobs(mode, [program(source, python_guards=guards)], shared_dir)
  try:
    leaked = server.accept()
  except OSError:
    leaked = None
  server.close()
  assert leaked is None and "connected" not in result["stdout"]
  assert result["returncode"] != 0 and "Operation not permitted" in result["stderr"]  # seccomp


@pytest.mark.parametrize("mode", MODES)
def test_unix_sockets_of_the_host_are_out_of_reach(mode, shared_dir):
  path = os.path.join(tempfile.gettempdir(), f"ba_jax_attack_{os.getpid()}_{mode}.sock")
  server = socket.socket(socket.AF_UNIX)
  server.bind(path)
  os.chmod(path, 0o777)  # anyone on the host may connect
  server.listen(1)
  server.settimeout(0.2)
  source = ("import _socket\ns = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)\n"
            f"s.connect({path!r})\ns.send(b'leak')\nprint('connected')\n")
  try:
    [result] = run_jobs(mode, [program(source)], shared_dir)
    try:
      leaked = server.accept()
    except OSError:
      leaked = None
  finally:
    server.close()
    os.unlink(path)
  assert leaked is None and "connected" not in result["stdout"]
  assert "No such file or directory" in result["stderr"]  # /tmp is an empty tmpfs in the sandbox


@pytest.mark.parametrize("mode", MODES)
def test_os_open_outside_the_work_dir_leaves_nothing(mode, shared_dir):
  shared = os.path.join(tempfile.gettempdir(), f"ba_jax_escape_{os.getpid()}_{mode}.txt")
  owned = os.path.join(shared_dir, "victim", f"pwned_{mode}.txt")  # world-writable on the host
  home = os.path.join(shared_dir, f"pwned_{mode}.txt")
  source = (
      "import os\n"
      f"for path in {[shared, owned, home]!r}:\n"
      "    try:\n"
      "        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)\n"
      "        os.write(fd, b'pwned')\n"
      "        print('wrote', path)\n"
      "    except OSError as e:\n"
      "        print('refused', e.strerror)\n"
      "fd = os.open('inside.txt', os.O_WRONLY | os.O_CREAT, 0o644)\n"  # its own dir is writable
      "print('inside', os.write(fd, b'ok'))\n")
  [result] = run_jobs(mode, [program(source, python_guards=False)], shared_dir)
  assert [p for p in (shared, owned, home) if os.path.exists(p)] == []
  assert "wrote" not in result["stdout"] and result["stdout"].count("refused") == 3
  assert result["stdout"].endswith("inside 2\n") and result["escaped_files"] == []


@pytest.mark.parametrize("mode", MODES)
def test_processes_are_bounded(mode, shared_dir):
  source = ("import os, time\nn = 0\nfor i in range(40):\n    try:\n        if os.fork() == 0:\n"
            "            time.sleep(5)\n            os._exit(0)\n        n += 1\n"
            "    except OSError:\n        break\nprint(n)\n")
  [result] = run_jobs(mode, [program(source)], shared_dir)
  assert int(result["stdout"]) == LIMITS["max_processes"] - 1  # the program itself is one


@pytest.mark.parametrize("mode", MODES)
def test_the_caller_and_other_processes_cannot_be_killed(mode, shared_dir):
  marker = f"{61 + os.getpid() % 1000 / 1000:.3f}"
  detached = ("import os\nif os.fork() == 0:\n    os.setsid()\n"
              f"    os.execv('/bin/sleep', ['sleep', '{marker}'])\n")
  jobs = [program("import os\ntry:\n    os.kill(os.getppid(), 9)\nexcept OSError:\n    pass\n"
                  "print('alive', os.getppid())\n"),
          program("import os\nos.kill(-1, 9)\n"),  # every process this uid may signal
          program(detached),
          assertion_job("def f(x):\n    return 2 * x\n", ["assert f(2) == 4"])]
  before = sandbox_dirs_of(NOBODY if mode == "unprivileged" else 0)
  started = time.monotonic()
  results = run_jobs(mode, jobs, shared_dir)
  assert time.monotonic() - started < 60
  assert results[0]["stdout"] == "alive 1\n"  # its parent is the namespace's init
  assert results[3]["passed"] == 1  # the caller went on to run the next job
  time.sleep(0.2)
  sleepers = []
  for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
      with open(f"/proc/{pid}/cmdline", "rb") as f:
        if marker.encode() in f.read():
          sleepers.append(pid)
    except OSError:
      pass
  assert sleepers == [], "a detached process of the program survived the run"
  if mode == "unprivileged":
    assert sandbox_dirs_of(NOBODY) <= before, "a run's temp dir was left behind"


HONEST = "def f(x):\n    return x * x\n"
ASSERTS = ["assert f(2) == 4", "assert f(3) == 9"]
HACKS = {
    "sys_exit": "import sys\nsys.exit(0)\n",
    "os_exit": "import os\nos._exit(0)\n",
    "atexit": "import atexit, os\natexit.register(lambda: os._exit(0))\ndef f(x):\n    return 0\n",
    "system_exit_in_try": ("def f(x):\n    try:\n        raise SystemExit(0)\n    finally:\n"
                           "        pass\n"),
    "excepthook": ("import sys, os\nsys.excepthook = lambda *a: os._exit(0)\n"
                   "def f(x):\n    return 0\n"),
    "patched_print_and_stdout": (
        "import builtins, io, sys\nbuiltins.print = lambda *a, **k: None\n"
        "sys.stdout = io.StringIO()\nsys.__stdout__.write('OK all tests passed\\n')\n"
        "def f(x):\n    return 0\n"),
    "redefined_assertion_error": (
        "import builtins\nclass AssertionError(Exception):\n    pass\n"
        "builtins.AssertionError = AssertionError\ndef f(x):\n    return 0\n"),
    "patched_exec_and_compile": ("import builtins\nbuiltins.exec = lambda *a, **k: None\n"
                                 "builtins.compile = lambda *a, **k: None\n"),
    "thread_exits_zero_mid_assert": (
        "import os, threading, time\n"
        "threading.Thread(target=lambda: (time.sleep(0.2), os._exit(0))).start()\n"
        "def f(x):\n    time.sleep(2)\n    return 0\n"),
    "trace_function_disables_the_harness_exec": (  # forges a pass when tracing is allowed
        "import sys\ndef f(x):\n    return 0\n"
        "def tracer(frame, event, arg):\n"
        "    if event == 'line' and 'exec_' in frame.f_locals:\n"
        "        frame.f_locals['exec_'] = lambda *args: None\n"
        "    return tracer\n"
        "harness = sys._getframe(1)\nharness.f_trace = tracer\nharness.f_trace_lines = True\n"
        "try:\n    sys.settrace(tracer)\nexcept RuntimeError:\n    pass\n"),
    "reads_harness_argv_files_and_fds": (
        "import os, re, sys\nfound = set()\n"
        "for path in ['harness.py', 'tests.json', '/proc/self/cmdline', '/proc/self/environ']:\n"
        "    try:\n        found |= set(re.findall(r'[0-9a-f]{32}', open(path).read()))\n"
        "    except OSError:\n        pass\n"
        "for token in found:\n    print(token)\n"
        "    for fd in range(3, 20):\n        try:\n            os.write(fd, token.encode())\n"
        "        except OSError:\n            pass\n"
        "sys.stdout.flush()\nos._exit(0)\n"),
    # The tests see the entry point's result as a copy in builtin types: no __eq__ of its own.
    "always_equal_result": ("class Anything:\n    def __eq__(self, other):\n        return True\n"
                            "def f(x):\n    return Anything()\n"),
}


@pytest.mark.parametrize("mode", MODES)
def test_reward_hacks_score_zero(mode, shared_dir):
  jobs = [assertion_job(HONEST, ASSERTS)] + [assertion_job(source, ASSERTS) for source in HACKS.values()]
  outcomes = run_jobs(mode, jobs, shared_dir)
  assert outcomes[0]["passed"] == 2
  scored = {name: outcome["passed"] for name, outcome in zip(HACKS, outcomes[1:])}
  assert scored == {name: 0 for name in HACKS}


def test_issue_example_and_io_tests_score_on_output_only():
  assert rewards.score_code(["import sys\nsys.exit(0)\n"], [["assert f(2) == 4"]]).scores.tolist() \
      == [0.0]
  io_case = [{"input": "3\n", "output": "6"}]
  batch = rewards.score_code(["import os\nos._exit(0)\n", "print(6, flush=True)\nimport os\nos._exit(0)\n",
                              "print(2 * int(input()))\n"], [io_case] * 3)
  assert batch.scores.tolist() == [0.0, 1.0, 1.0]


def test_a_kernel_without_user_namespaces_is_refused_with_the_reason(shared_dir):
  """Unprivileged, where the kernel allows no user namespace: a clear refusal, nothing run."""
  if not IS_ROOT:
    pytest.skip("needs root to build the restricted environment")
  python = sandbox.sandbox_python()
  # A user namespace whose own limit on nested user namespaces is 0, entered as a non-root uid.
  prelude = (
      "import ctypes, os, sys\nlibc = ctypes.CDLL(None, use_errno=True)\n"
      "assert libc.unshare(0x10000000) == 0\n"
      "open('/proc/self/uid_map', 'w').write('1000 0 1')\n"
      "open('/proc/self/setgroups', 'w').write('deny')\n"
      "open('/proc/self/gid_map', 'w').write('1000 0 1')\n"
      "open('/proc/sys/user/max_user_namespaces', 'w').write('0')\n"
      f"os.execv({python!r}, [{python!r}, '-I', '-c', sys.argv[1]])\n")
  check = ("import sys\nsys.path.insert(0, %r)\nfrom ba_jax.sandboxing import sandbox\n"
           "try:\n    sandbox.check_available()\nexcept sandbox.SandboxUnavailable as e:\n"
           "    print(e)\n" % shared_dir)
  done = subprocess.run([python, "-I", "-c", prelude, check], capture_output=True, text=True,
                        timeout=60, cwd=shared_dir)
  assert done.returncode == 0, done.stderr[-2000:]
  assert "refusing to run untrusted code" in done.stdout
  assert "unshare(user, mount, network, pid, ipc)" in done.stdout and "max_user_namespaces" in done.stdout


def test_a_program_written_against_the_harness_cannot_forge():
  """Reading every fd (the token's pipe was closed before the program ran), walking frames or
  the garbage collector to the harness's token, or an audit hook of its own: all score 0."""
  forgeries = [
      ("import os\ntoken = b''\nfor fd in range(3, 64):\n    try:\n"
       "        os.set_blocking(fd, False)\n        token = token or os.read(fd, 64)\n"
       "    except OSError:\n        pass\nfor fd in range(3, 64):\n    try:\n"
       "        os.write(fd, token)\n    except OSError:\n        pass\nos._exit(0)\n"),
      ("import inspect, os\nfor frame_info in inspect.stack():\n"
       "    token = frame_info.frame.f_locals.get('token')\n    if token:\n"
       "        os.write(frame_info.frame.f_locals['result_fd'], token)\n        os._exit(0)\n"),
      ("import gc, os\nfor o in gc.get_objects():\n"
       "    if isinstance(o, dict) and isinstance(o.get('token'), bytes):\n"
       "        os.write(o['result_fd'], o['token'])\n        os._exit(0)\n"),
      ("import os\ntry:\n    raise ValueError\nexcept ValueError as e:\n"
       "    frame = e.__traceback__.tb_frame\nwhile frame is not None:\n"
       "    if isinstance(frame.f_locals.get('token'), bytes):\n"
       "        os.write(frame.f_locals['result_fd'], frame.f_locals['token'])\n"
       "        os._exit(0)\n    frame = frame.f_back\n"),
      # Reads the expected value from the test's frame, or from the test's code as it is run.
      "import sys\ndef f(x):\n    return sys._getframe(2).f_globals['expected']\n",
      ("import sys\nconsts = []\ndef hook(event, args):\n    if event == 'exec':\n"
       "        consts.extend(c for c in args[0].co_consts if type(c) is int)\n"
       "sys.addaudithook(hook)\ndef f(x):\n    return consts[-1] if consts else 0\n"),
  ]
  for source in forgeries:
    outcome = judge.run_tests(source, ["expected = 4\nassert f(2) == expected"])
    assert outcome.passed == 0, source
