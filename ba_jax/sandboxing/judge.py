"""Runs a program against test cases in the sandbox and judges them where it cannot reach.

A test case (what `ba_jax.tasks.rewards.score_code` takes) is one of:
  * {"input": stdin, "output": expected stdout}: passes when the program exits 0
    and its stdout matches, line by line, trailing spaces ignored;
  * {"call": entry point, "inputs": [[arguments], ...], "expected": [outputs]
    or "reference": a program with the same entry point, "compare": a rule of
    `outputs.RULES` (default "exact"), "atol": number, "class": optional class
    whose instance's method is called}: the sandboxed program's entry point is
    called on every input, the outputs come back as plain data and are compared
    here. A reference's outputs come from a sandbox run of their own (cached in
    this process): neither they nor the reference enter the candidate's run;
  * a string of Python, or {"assert": code, "entry_point": name, "context":
    trusted code such as the task's prompt}: assertion tests for benchmarks that
    only have test code. They run in the candidate's process, in a fresh
    namespace with pristine builtins and modules, and pass only on the
    harness's token (`sandbox_harness`, which states what remains possible).
Reading and comparing a call test's outputs have budgets (values, depth, time:
`outputs.Budget`) whatever the program sent. A sample that could not run
(`RunResult.rejected`), went over a budget ("judge_too_large", "judge_too_deep",
"judge_timeout") or whose reference failed scores 0 and says why in
`TestOutcome.rejected`.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Sequence

from ba_jax.sandboxing import outputs as outputs_lib
from ba_jax.sandboxing import sandbox

_REFERENCE_CACHE: dict[str, list | str] = {}  # key -> expected outputs, or why they failed
_REFERENCE_CACHE_SIZE = 4096
_STDERR_TAIL = 300


@dataclasses.dataclass
class TestOutcome:
  passed: int
  total: int
  timeouts: int
  message: str = ""  # the first failure; only the program's own output, capped
  rejected: str = ""  # why the sample could not be judged ("too_large", "reference_failed", ...)
  memory_exceeded: int = 0  # runs killed for going over the memory limit


def case_kind(case) -> str:
  if isinstance(case, str) or (isinstance(case, dict) and "assert" in case):
    return "assert"
  if isinstance(case, dict) and "call" in case:
    return "call"
  return "stdin"


def _problem(case) -> str:
  """What is wrong with a test case ("" when nothing is)."""
  if isinstance(case, str):
    return ""
  if not isinstance(case, dict):
    return f"got {type(case).__name__}: {str(case)[:80]!r}"
  if "assert" in case:
    if not isinstance(case["assert"], str) or not isinstance(case.get("entry_point", ""), str) \
        or not isinstance(case.get("context", ""), str):
      return "'assert', 'entry_point' and 'context' must be strings"
    return ""
  if "call" in case:
    if not (isinstance(case["call"], str) and case["call"].isidentifier()):
      return f"'call' must name a function, got {case['call']!r}"
    if not isinstance(case.get("inputs"), (list, tuple)) or \
        not all(isinstance(i, (list, tuple)) for i in case["inputs"]):
      return "'inputs' must be a list of argument lists"
    if ("expected" in case) == ("reference" in case):
      return "give either 'expected' (one output per input) or 'reference' (a program)"
    if "expected" in case and len(case["expected"]) != len(case["inputs"]):
      return f"{len(case['expected'])} expected outputs for {len(case['inputs'])} inputs"
    if case.get("compare", "exact") not in outputs_lib.RULES:
      return f"'compare' must be one of {outputs_lib.RULES}, got {case.get('compare')!r}"
    return ""
  if "input" in case and "output" in case:
    return ""
  return f"has keys {sorted(case)}"


def check_test_cases(test_cases: Sequence, where: str = "") -> None:
  """Raises ValueError naming the case when one is malformed (a caller bug)."""
  for i, case in enumerate(test_cases):
    problem = _problem(case)
    if problem:
      raise ValueError(
          f"{where}test case {i} must be a Python assertion string or a dict with 'input' and "
          f"'output', 'call' and 'inputs', or 'assert': {problem}")


def _assertion(case) -> dict:
  if isinstance(case, str):
    return {"code": case, "entry": None, "context": ""}
  entry = case.get("entry_point")
  return {"code": case["assert"], "entry": [entry] if entry else None,
          "context": case.get("context", "")}


def _call_spec(case) -> dict:
  return {"entry": case["call"], "class": case.get("class") or "",
          "inputs": [list(i) for i in case["inputs"]]}


class ReferenceFailed(Exception):
  pass


def expected_outputs(case, limits: sandbox.SandboxLimits) -> list:
  """The case's expected outputs: given, or computed by its reference in a run of its own."""
  if "expected" in case:
    return list(case["expected"])
  if case.get("compare") == "find_zero":
    return [None] * len(case["inputs"])  # the oracle checks the output against the input
  spec = _call_spec(case)
  key = hashlib.sha256(json.dumps([case["reference"], spec]).encode()).hexdigest()
  value = _REFERENCE_CACHE.get(key)
  if value is None:
    run = sandbox.run_program(case["reference"], limits=limits, call=spec)
    items = run.outputs or []
    if run.outputs is not None and len(items) == len(spec["inputs"]) and \
        all(kind == "value" and not isinstance(v, outputs_lib.Opaque) for kind, v in items):
      value = [v for _, v in items]
    else:
      value = "the reference solution " + _why_no_outputs(run, items, spec)
    # A reference killed by the clock, the memory limit or a dying sandbox may pass next time
    # (a loaded machine): only what it computed, or how it failed by itself, is kept.
    if not (run.timed_out or run.memory_exceeded or run.rejected):
      _REFERENCE_CACHE[key] = value
      while len(_REFERENCE_CACHE) > _REFERENCE_CACHE_SIZE:
        _REFERENCE_CACHE.pop(next(iter(_REFERENCE_CACHE)))
  if isinstance(value, str):
    raise ReferenceFailed(value)
  return value


def _why_no_outputs(run, items, spec) -> str:
  if run.rejected:
    return f"could not run: {run.reason}"
  if run.timed_out:
    return "timed out"
  if run.memory_exceeded:
    return "went over the memory limit"
  if run.returncode != 0:
    return f"exited with code {run.returncode}"
  if run.outputs is None:
    return run.outputs_error or "exited before reporting its outputs"
  for i, (kind, value) in enumerate(items):
    if kind == "raised":
      return f"raised {value} on input {i}"
    if isinstance(value, outputs_lib.Opaque):
      return f"returned a {value.type_name} object (not plain data) on input {i}"
  return f"stopped after {len(items)} of {len(spec['inputs'])} inputs"


def _judge_call(run, case, expected, budget: outputs_lib.Budget) -> str:
  """Why the call test failed ("" when it passed); raises OverBudget past `budget`."""
  items = run.outputs or []
  rule, atol = case.get("compare", "exact"), case.get("atol") or 0
  for i, (kind, value) in enumerate(items):
    if kind == "raised":
      return f"input {i}: raised {value}"
    if not outputs_lib.same(value, expected[i], rule, atol=atol, arguments=case["inputs"][i],
                            budget=budget):
      return f"input {i}: wrong output {outputs_lib.preview(value)}"
  if run.outputs is None or len(items) < len(case["inputs"]):
    return _why_no_outputs(run, items, _call_spec(case))
  return ""


def _same_output(actual: str, expected: str) -> bool:
  def lines(text):
    return [line.rstrip() for line in text.strip().splitlines()]
  return lines(actual) == lines(expected)


def run_tests(program: str, test_cases: Sequence,
              limits: sandbox.SandboxLimits = sandbox.SandboxLimits()) -> TestOutcome:
  """Runs `program` once per test case (see the module doc) and judges each."""
  check_test_cases(test_cases)
  outcome = TestOutcome(passed=0, total=len(test_cases), timeouts=0)
  for i, case in enumerate(test_cases):
    kind, why = case_kind(case), ""
    if kind == "call":
      try:
        expected = expected_outputs(case, limits)
      except ReferenceFailed as e:
        outcome.rejected = outcome.rejected or "reference_failed"
        outcome.message = outcome.message or f"test {i}: {e}"
        continue
      result = sandbox.run_program(program, "", limits, call=_call_spec(case))
      try:
        why = "" if result.rejected else _judge_call(
            result, case, expected, outputs_lib.Budget(time_s=limits.judge_time_s))
      except outputs_lib.OverBudget as e:
        result.rejected, result.reason = e.reason, f"judging its outputs: {e}"
    elif kind == "assert":
      result = sandbox.run_program(program, "", limits, assertions=[_assertion(case)])
      why = "" if result.assertions_passed else "did not complete the assertions"
    else:
      result = sandbox.run_program(program, str(case["input"]), limits)
      why = ("" if result.returncode == 0 and _same_output(result.stdout, str(case["output"]))
             else "wrong output")
    if result.rejected:
      outcome.rejected = result.rejected
      outcome.message = f"test {i}: rejected: {result.reason}"
      break  # the same sample would be rejected by every test
    outcome.timeouts += result.timed_out
    outcome.memory_exceeded += result.memory_exceeded
    if not why:
      outcome.passed += 1
      continue
    if not outcome.message:
      if result.timed_out:
        why = "timed out"
      elif result.memory_exceeded:
        why = "went over the memory limit"
      elif result.returncode is None:
        why = "killed before it finished"
      elif result.returncode != 0 and kind != "call":
        why = f"exit code {result.returncode}"
      outcome.message = f"test {i}: {why}; stderr tail: {result.stderr[-_STDERR_TAIL:]!r}"
  return outcome


def run_tests_item(item) -> TestOutcome:
  """Pool entry point: item = (program, test_cases, limits)."""
  program, test_cases, limits = item
  return run_tests(program, test_cases, limits)
