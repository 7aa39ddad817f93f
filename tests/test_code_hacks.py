"""Wrong programs that game the benchmark's tests score 0 in every layout (EvalPlus release,
EvalPlus/HumanEval assertion code, LiveCodeBench functional), as the caller and unprivileged:
(a) reaching names the harness or the tests hold, (b) rebinding what the tests compare or
iterate with, at the top level, in builtins or in a shared module, (c) results whose
comparisons always agree. A right program still scores 1. Every wrong program here scored 1
when the tests ran in the program's own namespace."""
import pathlib

import pytest

from ba_jax.tasks import code_data
from sandbox_modes import MODES, judged_job, run_jobs, shared_copy
from sandbox_modes import nothing_left_behind  # noqa: F401 -- an autouse fixture

CODE_DIR = pathlib.Path(__file__).parent / "fixtures" / "code"
ALWAYS_EQUAL = ("class Anything(list):\n    def __eq__(self, other):\n        return True\n"
                "    __ne__ = lambda self, other: False\n    __hash__ = object.__hash__\n")

# HumanEval/53 in the release layout: call tests, outputs compared outside the program.
ADD = {
    "right": "    return x + y\n",
    "reference_in_namespace": "def add(x, y):\n    return _reference(x, y)\n",
    "reference_through_gc": (
        "import gc\ndef add(x, y):\n    for o in gc.get_objects():\n"
        "        if type(o).__name__ == 'function' and o.__name__ == 'add' and o is not add "
        "and not o.__code__.co_filename.startswith('/'):\n"
        "            return o(x, y)\n    return 0\n"),
    "top_level_rebinding": ("enumerate = lambda *a: iter(())\n"
                            "def add(x, y):\n    return 0\n"),
    "builtins_rebinding": ("import builtins\nbuiltins.enumerate = lambda *a: iter(())\n"
                           "def add(x, y):\n    return 0\n"),
    "module_rebinding": ("import json\njson.loads = lambda *a, **k: []\n"
                         "json.dumps = lambda *a, **k: '{\"outputs\": []}'\n"
                         "def add(x, y):\n    return 0\n"),
    "always_equal": ALWAYS_EQUAL + "def add(x, y):\n    return Anything()\n",
    "always_equal_int": ("class Int(int):\n    def __eq__(self, other):\n        return True\n"
                         "    __hash__ = int.__hash__\ndef add(x, y):\n    return Int(0)\n"),
}

# Mbpp/2: an assertion script looping over inputs and results with set() and zip().
SIMILAR = {
    "right": "def similar_elements(a, b):\n    return tuple(set(a) & set(b))\n",
    "test_names_in_namespace": (  # the loop's `exp` lived in the program's namespace
        "def similar_elements(a, b):\n    return globals()['exp']\n"),
    "top_level_rebinding": ("set = lambda *a: frozenset()\n"
                            "def similar_elements(a, b):\n    return ()\n"),
    "top_level_iteration": ("zip = lambda *a: iter(())\n"
                            "def similar_elements(a, b):\n    return ()\n"),
    "builtins_rebinding": ("import builtins\nbuiltins.zip = lambda *a: iter(())\n"
                           "builtins.set = lambda *a: frozenset()\n"
                           "def similar_elements(a, b):\n    return ()\n"),
    "frame_walking": ("import sys\ndef similar_elements(a, b):\n    frame = sys._getframe(1)\n"
                      "    while 'exp' not in frame.f_globals:\n        frame = frame.f_back\n"
                      "    return frame.f_globals['exp']\n"),
}

# HumanEval/42 with its `check(candidate)`.
INCR = {
    "right": "    return [x + 1 for x in l]\n",
    "always_equal": ALWAYS_EQUAL + "def incr_list(l):\n    return Anything()\n",
}

# A HumanEval/32-like task whose test uses a helper of the prompt and `math`.
FIND_ZERO_PROMPT = (
    "import math\n\n\ndef poly(xs: list, x: float):\n"
    "    return sum([coeff * math.pow(x, i) for i, coeff in enumerate(xs)])\n\n\n"
    "def find_zero(xs: list):\n    \"\"\"A zero of the polynomial with coefficients xs.\"\"\"\n")
FIND_ZERO_TEST = ("def check(candidate):\n    import math\n"
                  "    for xs in ([1, 2], [-6, 11, -6, 1]):\n"
                  "        assert math.fabs(poly(xs, candidate(xs))) < 1e-4\n\ncheck(find_zero)\n")
FIND_ZERO = {
    "right": ("    lo, hi = -100.0, 100.0\n    for _ in range(200):\n        mid = (lo + hi) / 2\n"
              "        if poly(xs, lo) * poly(xs, mid) <= 0:\n            hi = mid\n"
              "        else:\n            lo = mid\n    return hi\n"),
    "prompt_helper_rebinding": ("def poly(xs, x):\n    return 0.0\n\n"
                                "def find_zero(xs):\n    return 7.0\n"),
    "module_rebinding": ("import math\nmath.fabs = lambda x: 0.0\nmath.pow = lambda *a: 0.0\n\n"
                         "def find_zero(xs):\n    return 7.0\n"),
}

# LiveCodeBench functional: Solution().maxValue on JSON arguments.
MAX_VALUE = {
    "right": "class Solution:\n    def maxValue(self, nums, k):\n        return max(nums) * k\n",
    "expected_from_the_callers_code": (  # the expected outputs were constants of the test
        "import sys\ncalls = []\nclass Solution:\n    def maxValue(self, nums, k):\n"
        "        consts = [c for c in sys._getframe(1).f_code.co_consts\n"
        "                  if isinstance(c, str) and c.lstrip('-').isdigit()]\n"
        "        calls.append(1)\n        return int(consts[len(calls) - 1]) if consts else 0\n"),
    "always_equal": (ALWAYS_EQUAL + "class Solution:\n    def maxValue(self, nums, k):\n"
                     "        return Anything()\n"),
    "module_rebinding": ("import json\njson.loads = lambda s: 0\n"
                         "class Solution:\n    def maxValue(self, nums, k):\n        return 0\n"),
}


def tasks():
  he = {e.entry_point: e for e in code_data.load_code_set("humanevalplus", str(CODE_DIR))}
  mbpp = {e.entry_point: e for e in code_data.load_code_set("mbppplus", str(CODE_DIR))}
  lcb = {e.entry_point: e for e in code_data.load_code_set("livecodebench", str(CODE_DIR))}
  find_zero = code_data.CodeExample(
      task_id="find_zero", prompt=FIND_ZERO_PROMPT, kind="function", source="test",
      entry_point="find_zero",
      tests=({"assert": FIND_ZERO_TEST, "entry_point": "find_zero", "context": FIND_ZERO_PROMPT},))
  return [(he["add"], ADD), (mbpp["similar_elements"], SIMILAR), (he["incr_list"], INCR),
          (find_zero, FIND_ZERO), (lcb["maxValue"], MAX_VALUE)]


@pytest.fixture(scope="module")
def shared_dir():
  with shared_copy() as root:
    yield root


@pytest.mark.parametrize("mode", MODES)
def test_gaming_the_tests_scores_zero_and_right_programs_one(mode, shared_dir):
  jobs, names = [], []
  for example, programs in tasks():
    for name, response in programs.items():
      jobs.append(judged_job(code_data.program_for(example, response), list(example.tests)))
      names.append((example.entry_point, name))
  outcomes = run_jobs(mode, jobs, shared_dir)
  scores = {key: outcome["passed"] / outcome["total"] for key, outcome in zip(names, outcomes)}
  expected = {key: 1.0 if key[1] == "right" else 0.0 for key in names}
  assert scores == expected, [(k, o["message"]) for k, o in zip(names, outcomes)
                              if scores[k] != expected[k]]
  for key, outcome in zip(names, outcomes):
    assert not outcome["rejected"] and len(outcome["message"]) < 500, (key, outcome)
