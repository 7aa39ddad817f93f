"""Red team, round 3: wrong programs built by `code_data.program_for` on the fixture tasks
(HumanEval+, MBPP+ and synthetic call tasks) score 0, quickly, as the caller and as an
unprivileged user; an honest solution beside each class still scores 1. Each class scored a
wrong program 1 (or stalled the judge) before the fix it names:
  1. signal handlers, which get the interrupted frame, walked to the harness's token
     (assertion tests): seccomp refuses installing a handler once the harness is set up;
  2. infinity within the tolerance of any finite answer: non-finite values compare exactly;
  3. outputs whose ints all hash alike, which made building a set quadratic in the judge:
     sets and dicts are compared through a sorted canonical encoding, under budgets;
  4. signals to the namespace's init (unprivileged): the init has no handler left to run,
     and its own errors never reach the run's stderr.
Future rounds add a class as a dict of programs with a "right" entry, like those below."""
import os
import time

import pytest

from ba_jax.tasks import code_data
from sandbox_modes import MODES, judged_job, run_jobs, shared_copy
from sandbox_modes import nothing_left_behind  # noqa: F401 -- an autouse fixture
from test_code_hacks import CODE_DIR

# ----------------------------------------------------------------------------- 1. signals
# A handler gets the frame it interrupts; walking f_back from there raises no audit event and
# reaches run_assertions, whose locals hold the token that proves a pass and its fd.
GRAB = """
import os, signal, sys

def _grab(signum, frame):
    while frame is not None:
        found = frame.f_locals
        if "token" in found and "result_fd" in found:
            os.write(found["result_fd"], found["token"])
            os._exit(0)
        frame = frame.f_back

def _fire():
    try:
        signal.signal(signal.SIGUSR1, _grab)
        signal.raise_signal(signal.SIGUSR1)
    except OSError:
        pass
"""
SIGNALS = {
    "in_the_entry_point": GRAB + "def incr_list(l):\n    _fire()\n    return l\n",
    "at_the_top_level": GRAB + "_fire()\ndef incr_list(l):\n    return l\n",
    "exception_str_on_the_failure_path": GRAB + (
        "class Boom(Exception):\n    def __str__(self):\n        _fire()\n        return 'boom'\n"
        "def incr_list(l):\n    raise Boom()\n"),
    "stderr_flush_on_the_failure_path": GRAB + (
        "class Stream:\n    def write(self, text):\n        return len(text)\n"
        "    def flush(self):\n        _fire()\n"
        "sys.stderr = Stream()\ndef incr_list(l):\n    return l\n"),
    "timer_fired_during_the_test": GRAB + (  # installed and armed in one step, fires later
        "def incr_list(l):\n    try:\n        signal.signal(signal.SIGALRM, _grab)\n"
        "        signal.setitimer(signal.ITIMER_REAL, 0.001)\n    except OSError:\n"
        "        pass\n    for _ in range(10 ** 6):\n        pass\n    return l\n"),
}
SIGNALS_MBPP = {  # the MBPP+ script layout: the test loops over inputs at its top level
    "right": "def similar_elements(a, b):\n    return tuple(set(a) & set(b))\n",
    "in_the_entry_point": GRAB + "def similar_elements(a, b):\n    _fire()\n    return ()\n",
}

# ----------------------------------------------------------------------------- 2. infinity
# Synthetic call tasks whose reference returns an infinity, compared by EvalPlus' rule.
SAFE_LOG_PROMPT = "import math\n\n\ndef safe_log(x: float) -> float:\n    \"\"\"log(x); -inf at 0.\"\"\"\n"
SAFE_LOG = {
    "right": "    return math.log(x) if x > 0 else -math.inf\n",
    "finite_for_infinite": "    return math.log(x) if x > 0 else 0.0\n",
    "huge_for_infinite": "    return math.log(x) if x > 0 else -1e308\n",
}
BOUNDS_PROMPT = ("import math\n\n\ndef bounds(xs: list) -> list:\n"
                 "    \"\"\"[min, max] of xs; [inf, -inf] when empty.\"\"\"\n")
BOUNDS = {
    "right": "    return [min(xs), max(xs)] if xs else [math.inf, -math.inf]\n",
    "finite_in_a_list": "    return [min(xs), max(xs)] if xs else [0.0, 0.0]\n",
}
POLE_PROMPT = "import math\n\n\ndef pole(z: float) -> complex:\n    \"\"\"1/z as a complex; inf at 0.\"\"\"\n"
POLE = {
    "right": "    return complex(1 / z, 0.0) if z else complex(math.inf, 0.0)\n",
    "finite_complex": "    return complex(1 / z, 0.0) if z else complex(0.0, 0.0)\n",
}


def call_task(name, prompt, inputs, atol=0):
  reference = prompt + {"safe_log": SAFE_LOG, "bounds": BOUNDS, "pole": POLE}[name]["right"]
  return code_data.CodeExample(
      task_id=name, prompt=prompt, kind="function", source="test", entry_point=name,
      tests=({"call": name, "inputs": inputs, "reference": reference, "compare": "evalplus",
              "atol": atol},))


# ----------------------------------------------------------------------------- 3. hashing
# Ints that are multiples of 2**61 - 1 all hash to 0: a set or dict of many of them takes
# quadratic time to build or compare. 150k of them took minutes in the judge.
COLLIDING = "_M = 2 ** 61 - 1\n_COLLIDING = [k * _M for k in range(1, 150_001)]\n"
# The program writes the call harness's result file itself, then leaves before the harness.
FORGE = COLLIDING + """
import json, os, stat

def _forge(value):
    text = json.dumps({"outputs": [{"value": value}]}).encode()
    for fd in range(3, 64):
        try:
            if stat.S_ISREG(os.fstat(fd).st_mode):
                os.lseek(fd, 0, 0)
                os.write(fd, text)
                os._exit(0)
        except OSError:
            pass
"""
DIFF = {  # Mbpp/769, compared as sets by EvalPlus
    "right": "def Diff(a, b):\n    return sorted(set(a) ^ set(b), reverse=True)\n",
    "colliding_list": COLLIDING + "def Diff(a, b):\n    return _COLLIDING\n",
}
ADD = {  # HumanEval/53, EvalPlus' rule
    "right": "    return x + y\n",
    "colliding_set_forged": FORGE + (
        "def add(x, y):\n    _forge(['set'] + [['int', hex(v)] for v in _COLLIDING])\n"),
    "colliding_dict_forged": FORGE + (
        "def add(x, y):\n    _forge(['dict'] + [[['int', hex(v)], 0] for v in _COLLIDING])\n"),
    "colliding_tuple_forged": FORGE + (  # tuples of colliding ints collide too, nested in a set
        "def add(x, y):\n"
        "    _forge(['set'] + [['tuple', ['int', hex(v)]] for v in _COLLIDING])\n"),
}

# ----------------------------------------------------------------------------- 4. init
KILL_INIT = ("import os, signal\nfor _s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, "
             "signal.SIGUSR1, signal.SIGQUIT, signal.SIGALRM, signal.SIGSTOP, signal.SIGKILL):\n    try:\n"
             "        os.kill(1, _s)\n    except OSError:\n        pass\n")
INIT = {
    "right": KILL_INIT + "import time\ntime.sleep(0.2)\n"  # the signals land while it runs
             "def incr_list(l):\n    return [x + 1 for x in l]\n",
    "wrong": KILL_INIT + "def incr_list(l):\n    return l\n",
}


def cases():
  """(class, task, program name, example, response) for every program above."""
  he = {e.entry_point: e for e in code_data.load_code_set("humanevalplus", str(CODE_DIR))}
  mbpp = {e.entry_point: e for e in code_data.load_code_set("mbppplus", str(CODE_DIR))}
  signals = dict(SIGNALS, right="    return [x + 1 for x in l]\n")
  groups = [
      ("signals", he["incr_list"], signals), ("signals", mbpp["similar_elements"], SIGNALS_MBPP),
      ("infinity", call_task("safe_log", SAFE_LOG_PROMPT, [[1.0], [0.0], [2.5]]), SAFE_LOG),
      ("infinity", call_task("bounds", BOUNDS_PROMPT, [[[1.0, 3.0]], [[]]]), BOUNDS),
      ("infinity", call_task("pole", POLE_PROMPT, [[2.0], [0.0]], atol=1e-6), POLE),
      ("hashing", mbpp["Diff"], DIFF), ("hashing", he["add"], ADD),
      ("init", he["incr_list"], INIT)]
  return [(kind, example.entry_point, name, example, response)
          for kind, example, programs in groups for name, response in programs.items()]


@pytest.fixture(scope="module")
def shared_dir():
  with shared_copy() as root:
    yield root


def run_cases(mode, shared_dir, kinds):
  """Scores every program of `kinds`; returns ({(kind, task, name): score}, outcomes, seconds)."""
  found = [c for c in cases() if c[0] in kinds]
  jobs = [judged_job(code_data.program_for(example, response), list(example.tests))
          for _, _, _, example, response in found]
  start = time.monotonic()
  outcomes = run_jobs(mode, jobs, shared_dir)
  elapsed = time.monotonic() - start
  scores = {(kind, task, name): o["passed"] / o["total"]
            for (kind, task, name, _, _), o in zip(found, outcomes)}
  expected = {key: 1.0 if key[2].startswith("right") else 0.0 for key in scores}
  assert scores == expected, [(k, o["message"], o["rejected"]) for k, o in
                              zip(scores, outcomes) if scores[k] != expected[k]]
  here = os.path.dirname(os.path.dirname(os.path.abspath(code_data.__file__)))
  for key, outcome in zip(scores, outcomes):
    # No host path, no traceback of the launcher or its init, in any score message.
    for host in ("sandbox_launcher", here, "ba_jax_sandbox_"):
      assert host not in outcome["message"], (key, outcome["message"])
  return scores, outcomes, elapsed


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_frames_infinity_and_init_attacks_score_zero_honest_solutions_one(mode, shared_dir):
  run_cases(mode, shared_dir, ("signals", "infinity", "init"))


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_colliding_outputs_are_judged_quickly(mode, shared_dir):
  scores, _, elapsed = run_cases(mode, shared_dir, ("hashing",))
  # Six sandbox runs take a few seconds each at most; the quadratic judge took minutes.
  assert elapsed < 60, elapsed
