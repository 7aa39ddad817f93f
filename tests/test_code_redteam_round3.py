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
Beside them: the comparison rules against EvalPlus' and LiveCodeBench's own checks on a table
of non-finite cases, the judge's budgets (a sample past them is rejected with the reason),
and a caller killed mid-run (nothing of its runs is left once the next process starts one).
Future rounds add a class as a dict of programs with a "right" entry, like those below."""
import glob
import json
import math
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
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
SAFE_LOG_PROMPT = ("import math\n\n\ndef safe_log(x: float) -> float:\n"
                   "    \"\"\"log(x); -inf at 0.\"\"\"\n")
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
POLE_PROMPT = ("import math\n\n\ndef pole(z: float) -> complex:\n"
               "    \"\"\"1/z as a complex; inf at 0.\"\"\"\n")
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
# quadratic time to build or compare. 100k of them took over a minute in the judge.
COLLIDING = "_M = 2 ** 61 - 1\n_COLLIDING = [k * _M for k in range(1, 100_001)]\n"
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
             "signal.SIGUSR1, signal.SIGQUIT, signal.SIGALRM, signal.SIGSTOP,\n"
             "           signal.SIGKILL):\n    try:\n        os.kill(1, _s)\n"
             "    except OSError:\n        pass\n")
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


# ----------------------------------------------------------------------------- the rules' table
def evalplus_reference(out, exp, atol):
  """EvalPlus' own check (evalplus/eval/__init__.py, `unsafe_execute`): `==`; then, for float
  outputs (atol 1e-6) or a task's atol, the same type and length and numpy.allclose."""
  exact_match = out == exp
  if atol == 0 and (isinstance(exp, float) or (isinstance(exp, (list, tuple)) and exp and
                                               all(isinstance(i, float) for i in exp))):
    atol = 1e-6
  if not exact_match and atol != 0:
    if type(out) != type(exp) or (isinstance(exp, (list, tuple)) and len(out) != len(exp)):
      return False
    return bool(np.allclose(out, exp, rtol=1e-07, atol=atol))
  return bool(exact_match)


def lcb_reference(prediction, expected):
  """LiveCodeBench's call-based check (lcb_runner/evaluation/testing_util.py): a tuple is read
  as a list, then `==`."""
  return (list(prediction) if isinstance(prediction, tuple) else prediction) == expected


INF, NAN = math.inf, math.nan
# (output, expected): built anew per use, so no NaN is shared between the two (as when the
# output comes back from the program's process).
TABLE = [
    lambda: (0.0, -INF), lambda: (1e308, INF), lambda: (INF, INF), lambda: (-INF, INF),
    lambda: (float("nan"), float("nan")), lambda: (1.0, float("nan")),
    lambda: (float("nan"), 1.0), lambda: (INF, float("nan")), lambda: (1.0 + 1e-9, 1.0),
    lambda: ([0.0, 1.0], [-INF, 1.0]), lambda: ([INF, 1.0], [INF, 1.0 + 1e-9]),
    lambda: ([float("nan")], [float("nan")]), lambda: ([[0.0]], [[INF]]),
    lambda: ([[INF, 2.0]], [[INF, 2.0 + 1e-9]]), lambda: ((0.0,), (INF,)),
    lambda: ((INF, 1.0), [INF, 1.0]), lambda: (complex(0, 0), complex(INF, 0)),
    lambda: (complex(INF, 1), complex(INF, 1)), lambda: (complex(1, 1), complex(1, 1 + 1e-9)),
    lambda: (complex(1, NAN), complex(1, NAN)), lambda: (10 ** 6, INF), lambda: (5, 5.0),
    lambda: (-0.0, 0.0), lambda: ([1, 2.0], [1.0, 2]), lambda: ([INF, -INF], [INF, -INF])]


@pytest.mark.parametrize("atol", [0, 1e-3])
def test_non_finite_values_compare_as_evalplus_and_livecodebench_do(atol):
  from ba_jax.sandboxing import outputs, sandbox_harness
  for make in TABLE:
    out, exp = make()
    want = {"evalplus": evalplus_reference(out, exp, atol), "lcb": lcb_reference(out, exp),
            "exact": out == exp}
    # The output as the judge reads it: through the harness's plain data and `decode`.
    wire = json.dumps({"outputs": [{"value": sandbox_harness.to_plain(out)}]}).encode()
    [(_, decoded)] = outputs.decode(wire, 1)
    for rule, expected in want.items():
      for value in (out, decoded):
        assert outputs.same(value, exp, rule, atol=atol) == expected, (rule, out, exp, atol)
    if isinstance(exp, list) and all(isinstance(v, (int, float)) for v in exp):
      # EvalPlus' set rule (`set(out) == set(exp)`, then its allclose step), on the same lists.
      rule_set = set(out) == set(exp) or evalplus_reference(out, exp, atol)
      assert outputs.same(decoded, exp, "set", atol=atol) == rule_set, (out, exp, atol)


# ----------------------------------------------------------------------------- budgets
@pytest.mark.slow
def test_the_judge_has_budgets_and_a_sample_past_them_is_rejected_with_the_reason():
  from ba_jax.sandboxing import outputs
  M = 2 ** 61 - 1
  colliding = ["set"] + [["int", hex(k * M)] for k in range(1, 20_001)]
  wire = json.dumps({"outputs": [{"value": colliding}]}).encode()
  [(_, decoded)] = outputs.decode(wire, 1)
  assert len(decoded) == 20_000 and decoded == {k * M for k in range(1, 20_001)}
  for budget, reason in ((outputs.Budget(nodes=1000), "judge_too_large"),
                         (outputs.Budget(time_s=0.0), "judge_timeout")):
    with pytest.raises(outputs.OverBudget) as raised:
      outputs.decode(wire, 1, budget)
    assert raised.value.reason == reason
  nested = ["list"]
  for _ in range(150):
    nested = ["list", nested]
  with pytest.raises(outputs.OverBudget) as raised:
    outputs.decode(json.dumps({"outputs": [{"value": nested}]}).encode(), 1)
  assert raised.value.reason == "judge_too_deep"
  with pytest.raises(outputs.OverBudget):  # comparing has one too
    outputs.same([k * M for k in range(1, 5000)], [1], "set", budget=outputs.Budget(nodes=100))
  # End to end: the colliding set of `add` above, with a judge allowed 1 ms, is rejected.
  from ba_jax.sandboxing import sandbox
  from ba_jax.tasks import rewards
  he = {e.entry_point: e for e in code_data.load_code_set("humanevalplus", str(CODE_DIR))}
  programs = [code_data.program_for(he["add"], ADD[name])
              for name in ("right", "colliding_set_forged")]
  limits = sandbox.SandboxLimits(judge_time_s=0.001, wall_time_s=5.0)
  batch = rewards.score_code(programs, [list(he["add"].tests)] * 2, limits=limits)
  assert batch.scores.tolist() == [1.0, 0.0], batch.messages
  assert batch.metrics()["reward/rejected/judge_timeout"] == 1.0
  assert "judge_timeout" not in batch.messages[0] and "took over 0.001s" in batch.messages[1]


# ----------------------------------------------------------------------------- a killed caller
CALLER = """
import sys
from ba_jax.sandboxing import sandbox
sandbox.run_program("import time\\nprint('started', flush=True)\\ntime.sleep(60)",
                    limits=sandbox.SandboxLimits(wall_time_s=60, cpu_time_s=60))
"""


def test_a_caller_killed_mid_run_leaves_nothing_on_the_next_start(tmp_path):
  from ba_jax.sandboxing import cgroups, sandbox
  env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(
      code_data.__file__))))
  caller = subprocess.Popen([sys.executable, "-c", CALLER], env=env)
  pattern = os.path.join(tempfile.gettempdir(), f"{cgroups.PREFIX}{caller.pid}_*")
  deadline = time.monotonic() + 60
  while not glob.glob(pattern) and time.monotonic() < deadline:
    time.sleep(0.05)
  [workdir] = glob.glob(pattern)
  time.sleep(1.0)  # the program is running
  assert _processes_in(workdir)
  caller.kill()
  caller.wait()
  deadline = time.monotonic() + 10
  while _processes_in(workdir) and time.monotonic() < deadline:
    time.sleep(0.05)
  assert not _processes_in(workdir)  # the launcher died with its caller, the rest with it
  next_start = subprocess.run(
      [sys.executable, "-c", "from ba_jax.sandboxing import sandbox\n"
       "print(sandbox.run_program('print(1)').stdout, end='')"],
      env=env, capture_output=True, text=True, timeout=120)
  assert next_start.stdout == "1\n", next_start.stderr
  assert not glob.glob(pattern)
  where = cgroups.hierarchy()
  if where is not None:
    assert not glob.glob(os.path.join(where.parent, f"{cgroups.PREFIX}{caller.pid}_*"))


def _processes_in(workdir):
  """Processes whose working directory is the run's host dir (its launcher)."""
  found = []
  for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
      if os.readlink(f"/proc/{pid}/cwd").startswith(workdir):
        found.append(int(pid))
    except OSError:
      continue
  return found
