"""Code benchmarks: loaders of the published formats, sandbox grading of right,
wrong and hanging solutions, pass@k, and the evaluate command end to end."""
import base64
import json
import os
import pathlib
import pickle
import subprocess
import sys
import time
import zlib

import numpy as np
import pytest

from ba_jax.tasks import code_data
from ba_jax.tasks import data
from ba_jax.run import eval_lib

CODE_DIR = pathlib.Path(__file__).parent / "fixtures" / "code"
FAST = eval_lib.EvalSettings(n_samples=3, code_timeout_s=1.5)

# A right and a wrong (but running) solution per fixture problem, in the
# shapes models write: a bare body, a whole function, a fenced block.
RIGHT = {
    "add": "    return x + y\n",
    "mean_absolute_deviation": (  # off by 1e-9: passes within EvalPlus' float tolerance
        "Here it is:\n```python\nfrom typing import List\n\n"
        "def mean_absolute_deviation(numbers: List[float]) -> float:\n"
        "    m = sum(numbers) / len(numbers)\n"
        "    return sum(abs(v - m) for v in numbers) / len(numbers) + 1e-9\n```\nDone."),
    "find_zero": (  # another zero than the reference's: the oracle accepts any
        "```python\ndef find_zero(xs):\n    lo, hi = 100.0, -100.0\n    for _ in range(200):\n"
        "        mid = (lo + hi) / 2\n        if poly(xs, lo) * poly(xs, mid) <= 0:\n"
        "            hi = mid\n        else:\n            lo = mid\n    return hi\n```"),
    "incr_list": "    return [x + 1 for x in l]\n",
    "similar_elements": "def similar_elements(a, b):\n    return tuple(sorted(set(a) & set(b))[::-1])\n",
    "is_not_prime": "def is_not_prime(n):\n    return n == 1 or any(n % d == 0 for d in range(2, n))\n",
    "Diff": (  # another order than the reference's: EvalPlus compares this task as sets
        "def Diff(a, b):\n    return sorted(set(a) ^ set(b), reverse=True)\n"),
    "": "a, b = map(int, input().split())\nprint(a + b)\n```",  # the prompt opened the fence
    "maxValue": "class Solution:\n    def maxValue(self, nums, k):\n        return max(nums) * k\n```",
}
WRONG = {
    "add": "    return x - y\n",
    "mean_absolute_deviation": "    return 1.0\n",
    "find_zero": "    return 0.25\n",
    "incr_list": "    return l\n",
    "similar_elements": "def similar_elements(a, b):\n    return tuple(set(a) | set(b))\n",
    "is_not_prime": "def is_not_prime(n):\n    return n % 2 == 0\n",  # wrong on 35 only
    "Diff": "def Diff(a, b):\n    return sorted(set(a) - set(b))\n",
    "": "print(3)\n```",  # passes the public case only
    "maxValue": "class Solution:\n    def maxValue(self, nums, k):\n        return max(nums) + k\n```",
}
HANG = "```python\nwhile True:\n    pass\n```"


def load(name):
  return code_data.load_code_set(name, str(CODE_DIR))


def test_loaders_read_every_published_layout():
  he, mbpp, lcb = load("HumanEval+"), load("mbpp_plus"), load("lcb")
  assert [e.task_id for e in he] == ["HumanEval/53", "HumanEval/4", "HumanEval/32", "HumanEval/42"]
  # base_input + plus_input: two sandboxed runs; empty plus_input: one; a `test`: one.
  assert [len(e.tests) for e in he] == [2, 2, 1, 1]
  assert he[3].tests[0]["assert"].rstrip().endswith("check(incr_list)")
  assert he[3].tests[0]["entry_point"] == "incr_list" and he[3].tests[0]["context"] == he[3].prompt
  # The release layout: call tests whose expected outputs the reference gives, outside the
  # candidate's run.
  assert {k: he[0].tests[0][k] for k in ("call", "inputs", "compare", "atol")} == {
      "call": "add", "inputs": [[0, 1], [1, 0], [5, 7]], "compare": "evalplus", "atol": 0}
  assert [e.entry_point for e in mbpp] == ["similar_elements", "is_not_prime", "Diff"]
  stdin, leetcode = lcb
  assert (stdin.kind, leetcode.kind, leetcode.entry_point) == ("stdin", "leetcode", "maxValue")
  # One public case plus two private ones stored as a base64 zlib pickle.
  assert stdin.tests == ({"input": "1 2\n", "output": "3\n"}, {"input": "10 -4\n", "output": "6\n"},
                         {"input": "0 0\n", "output": "0\n"})
  assert stdin.meta["contest_date"].startswith("2024-09")
  assert code_data.is_code_benchmark("HumanEval+") and not code_data.is_code_benchmark("aime24")
  with pytest.raises(ValueError, match="unknown code benchmark 'apps'"):
    code_data.load_code_set("apps", str(CODE_DIR))


def test_test_case_pickles_may_hold_only_a_string():
  cases = [{"input": "1\n", "output": "1\n", "testtype": "stdin"}]
  packed = base64.b64encode(zlib.compress(pickle.dumps(json.dumps(cases)))).decode()
  assert code_data.decode_test_cases(packed) == cases
  evil = base64.b64encode(zlib.compress(pickle.dumps(os.system))).decode()
  with pytest.raises(data.DataError, match="refusing to load"):
    code_data.decode_test_cases(evil, "f.jsonl", 3, "private_test_cases")


def test_bad_rows_name_the_file_row_and_field(tmp_path):
  rows = {"humanevalplus": {"task_id": "x", "prompt": "def f():\n", "entry_point": "f"},
          "livecodebench": {"question_content": "q", "public_test_cases": "[]",
                            "private_test_cases": json.dumps(
                                [{"input": "1", "output": "2", "testtype": "functional"}]),
                            "metadata": "{}"}}
  expected = {"humanevalplus": "row 0: field 'test': missing, and no 'base_input'",
              "livecodebench": "row 0: field 'metadata': functional tests need metadata.func_name"}
  for name, row in rows.items():
    path = tmp_path / f"{name}.jsonl"
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(data.DataError, match=expected[name]):
      code_data.load_code_set(name, str(path))


def test_test_cases_that_cannot_be_read_name_the_row_and_field(tmp_path, monkeypatch):
  bomb = base64.b64encode(zlib.compress(pickle.dumps("[" + " " * (16 << 20) + "]"))).decode()
  monkeypatch.setattr(code_data, "MAX_DECOMPRESSED_BYTES", 1 << 20)
  with pytest.raises(data.DataError, match=r"f.jsonl: row 3: field 'private_test_cases': "
                                           r"decompresses to more than 1048576 bytes"):
    code_data.decode_test_cases(bomb, "f.jsonl", 3, "private_test_cases")
  with pytest.raises(data.DataError, match=r"row 0: field 'public_test_cases': JSON nested too"):
    code_data.decode_test_cases("[" * 100_000 + "]" * 100_000, "f.jsonl", 0, "public_test_cases")
  row = {"question_content": "q", "metadata": json.dumps({"func_name": "f"}),
         "public_test_cases": json.dumps([{"input": "[1, 2]\n3", "output": "4",
                                           "testtype": "functional"},
                                          {"input": "[1, 2\n3", "output": "4",
                                           "testtype": "functional"}])}
  path = tmp_path / "livecodebench.jsonl"
  path.write_text(json.dumps(row) + "\n")
  with pytest.raises(data.DataError, match=r"row 0: field 'test_cases\[1\].input': not valid JSON"):
    code_data.load_code_set("livecodebench", str(path))


def test_responses_are_parsed_in_linear_time():
  example = load("humanevalplus")[0]
  for response in ("\n" * 40_000 + "x", "```" + " " * 100_000, "```\n" * 20_000,
                   ("```" + "a" * 10) * 20_000, "    return x + y\n" + "\n" * 40_000):
    start = time.monotonic()
    code_data.program_for(example, response)
    assert time.monotonic() - start < 0.5  # the regexes they replace took seconds


def test_code_extraction_and_programs():
  assert code_data.extract_code("a\n```python\nx = 1\n```\nb\n```py\ny = 2\n```") == "y = 2\n"
  assert code_data.extract_code("x = 1\n```\ntrailing") == "x = 1\n"
  assert code_data.extract_code("```python\nx = 1\n") == "x = 1\n"  # cut short by the budget
  assert code_data.extract_code("    return 1\n") == "    return 1\n"
  prompt = "def f(a):\n    \"\"\"doc\"\"\"\n"
  assert code_data.build_program(prompt, "    return a\n", "f") == prompt + "    return a\n"
  whole = code_data.build_program(prompt, "def f(a):\n    return a\n", "f")
  namespace = {}
  exec(whole, namespace)  # the stub is redefined, not continued
  assert namespace["f"](7) == 7


@pytest.mark.parametrize("name", code_data.CODE_SETS)
def test_grading_right_wrong_and_hanging_solutions(name):
  examples = load(name)
  # Every problem: right and wrong; the first one-test problem also hangs.
  hang_at = next(i for i, e in enumerate(examples) if len(e.tests) == 1)
  responses = [[RIGHT[e.entry_point], WRONG[e.entry_point]] + ([HANG] if i == hang_at else [])
               for i, e in enumerate(examples)]
  flat_examples = [e for e, group in zip(examples, responses) for _ in group]
  batch = eval_lib.grade_code(flat_examples, [[r] for group in responses for r in group],
                              limits=eval_lib.code_limits(FAST))
  expected = [[True, False] + ([False] if i == hang_at else []) for i in range(len(examples))]
  assert batch.correct.tolist() == [c for group in expected for c in group], batch.messages
  assert batch.timeouts == 1 and batch.errors == 0
  hang = sum(len(g) for g in responses[:hang_at]) + 2
  assert "timed out" in batch.messages[hang]
  if name == "livecodebench":  # the stdin "print(3)" passes 1 of its 3 cases
    np.testing.assert_allclose(batch.scores[:2], [1.0, 1 / 3], atol=1e-6)


def test_evaluate_code_reports_pass_at_k_from_sandbox_grades():
  examples = load("livecodebench")
  calls = []

  def generate(prompts, n):  # problem 0: right, wrong, hang; problem 1: wrong x3
    calls.append(prompts)
    return [[RIGHT[""], WRONG[""], HANG], [WRONG["maxValue"]] * n]

  results = eval_lib.evaluate_benchmarks(generate, {"livecodebench": examples}, FAST)
  bench = results["benchmarks"]["livecodebench"]
  summary = bench["summary"]
  assert summary["avg@3"] == pytest.approx(1 / 6) and summary["pass@1"] == pytest.approx(1 / 6)
  assert summary["pass@2"] == pytest.approx((1 - 1 / 3) / 2)  # 1 - C(2,2)/C(3,2) on problem 0
  assert summary["pass@3"] == pytest.approx(0.5)
  assert summary["grader_timeouts"] == 3  # the hanging program, on each of its 3 cases
  assert [s["correct"] for s in bench["samples"]] == [[True, False, False], [False] * 3]
  assert bench["samples"][0]["tests_passed"] == pytest.approx([1.0, 1 / 3, 0.0])
  # Completion prompts: the question, the instruction and an opened fence.
  assert calls[0][0].startswith(examples[0].prompt) and calls[0][0].endswith("```python\n")
  assert "def maxValue(self, nums: List[int], k: int)" in calls[0][1]
  table = eval_lib.markdown_table(results).splitlines()
  assert table[2] == "| livecodebench | 2 | 16.7 | 16.7 | 33.3 | 50.0 |"


@pytest.mark.slow
def test_cli_end_to_end_with_code_benchmarks(tmp_path):
  import model_utils
  model_dir = model_utils.save_tiny_model("qwen2", tmp_path / "model")
  out = tmp_path / "eval"
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p),
             XLA_FLAGS="--xla_force_host_platform_device_count=1", JAX_PLATFORMS="cpu")
  data_dir = tmp_path / "data"  # one --data_dir holds math and code sets alike
  data_dir.mkdir()
  for name in ("humanevalplus.jsonl", "livecodebench.jsonl"):
    (data_dir / name).symlink_to(CODE_DIR / name)
  (data_dir / "aime24.jsonl").symlink_to(CODE_DIR.parent / "eval" / "aime24.jsonl")
  cmd = [sys.executable, "-m", "ba_jax.evaluate", f"--model={model_dir}",
         "--benchmarks=humanevalplus,livecodebench,aime24", f"--data_dir={data_dir}", "--k=2",
         f"--output_dir={out}", "--max_new_tokens=4", "--temperature=1.0", "--batch_size=2",
         "--num_workers=1", "--code_timeout_s=3", "--limit=2"]
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
  assert proc.returncode == 0, proc.stderr[-3000:]
  results = json.loads((out / "results.json").read_text())
  assert list(results["benchmarks"]) == ["humanevalplus", "livecodebench", "aime24"]
  assert results["settings"]["code_timeout_s"] == 3.0
  for name in ("humanevalplus", "livecodebench"):
    bench = results["benchmarks"][name]
    assert bench["summary"]["num_problems"] == 2 and bench["summary"]["samples_per_problem"] == 2
    correct = np.array([s["correct"] for s in bench["samples"]], bool)
    assert correct.shape == (2, 2)
    # Four random characters solve nothing: graded, not crashed.
    assert not correct.any() and bench["summary"]["grader_errors"] == 0
    assert all(len(s["first_failure"]) == 2 for s in bench["samples"])
  table = (out / "results.md").read_text()
  for row in ("| humanevalplus | 2 | 0.0 | 0.0 | 0.0 |", "| livecodebench | 2 | 0.0 | 0.0 | 0.0 |",
              "| aime24 | 2 |"):
    assert row in table


def test_tests_needing_a_module_the_sandbox_lacks_are_an_error():
  example = code_data.CodeExample(task_id="Mbpp/9", prompt="", kind="function", source="mbppplus",
                                  entry_point="f", tests=("import no_such_module_xyz\nf()\n",))
  with pytest.raises(ValueError, match="Mbpp/9: its tests import 'no_such_module_xyz'"):
    eval_lib.grade_code([example], [["def f():\n    pass\n"]])


def test_benchmark_names_pick_the_loader():
  name, examples = eval_lib.load_benchmark("MBPP+", str(CODE_DIR))
  assert name == "mbppplus" and isinstance(examples[0], code_data.CodeExample)
  name, examples = eval_lib.load_benchmark("aime_2024", str(CODE_DIR.parent / "eval"))
  assert name == "aime24" and isinstance(examples[0], data.Example)
  with pytest.raises(ValueError, match="unknown benchmark 'gsm8k'; expected one of .*livecodebench"):
    eval_lib.load_benchmark("gsm8k", str(CODE_DIR))


def test_outputs_are_judged_by_the_benchmarks_rules_and_only_plain_data_is_read():
  from ba_jax.sandboxing import outputs
  same = outputs.same
  assert same(1.0 + 1e-9, 1.0, "evalplus") and not same(1.1, 1.0, "evalplus")
  assert same([0.1 + 2e-7], [0.1], "evalplus")  # 1e-6 for float outputs
  assert not same([0.1 + 2e-7], (0.1,), "evalplus")  # the tolerance needs the same type
  assert same(2, 2.0, "evalplus") and not same(True, 2, "evalplus")
  assert same([3, 1], [1, 3], "set") and same(0, 5, "not_none") and not same(None, 5, "not_none")
  assert same(-0.5, None, "find_zero", atol=1e-6, arguments=[[1, 2]])
  assert same((1, 2), [1, 2], "lcb") and not same((1, 2), [1, 2], "exact")
  assert not same(outputs.Opaque("Anything"), 5, "exact")
  assert not same("x" * 10, 5, "find_zero", atol=1.0, arguments=[[1, 2]])
  good = b'{"outputs": [{"value": ["tuple", 1, ["int", "0x10000000000000000000"], ' \
         b'["float", "0x1.8p+0"], ["set", "a"], ["dict", [1, null]]]}, {"raised": "ValueError"}]}'
  assert outputs.decode(good, 2) == [("value", (1, 1 << 76, 1.5, {"a"}, {1: None})),
                                     ("raised", "ValueError")]
  for bad in (b"[" * 100_000, b'{"outputs": [{"value": ' + b"7" * 5000 + b"}]}",
              b'{"outputs": [{"value": ["set", ["list"]]}]}', b'{"outputs": [{"v": 1}]}',
              b'{"outputs": [{"value": ["eval", "1"]}]}', b"\xff", b'{"outputs": [1, 2, 3]}'):
    with pytest.raises(outputs.Malformed):
      outputs.decode(bad, 2)
