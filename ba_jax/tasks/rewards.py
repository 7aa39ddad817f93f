"""Verifiable rewards: math answers judged by math-verify, code run in a sandbox.

Two answer rules for math:
  * "answer": DAPO's rule. The last `Answer:` line in the last 300 characters
    of the response, normalised as in Lewkowycz et al. (2022, appendix D).
  * "boxed": the content of the last `\\boxed{...}` (nested braces allowed).
An extracted answer is correct when its normalised string equals the ground
truth's, or when math-verify judges the raw (or else the normalised) forms
equivalent (1/2 = 0.5 = \\frac{1}{2}). Each distinct (answer, ground truth)
pair of a batch is graded once.

math-verify's own timeouts are off everywhere (they turn a timeout into a silent
"wrong" and can add up to several times the budget). In process, one SIGALRM
deadline bounds each item and counts it in `timeouts`; in pool workers the pool
kills a worker whose item runs past the deadline (`ba_jax.tasks.reward_pool`).
"""
from __future__ import annotations

import dataclasses
import logging
import re
import signal
import threading
from typing import Sequence

import numpy as np

from ba_jax.tasks import reward_pool

RULES = ("answer", "boxed")
_DAPO_WINDOW_CHARS = 300
_ANSWER_LINE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
_BOX_COMMANDS = ("\\boxed", "\\fbox")

# Lewkowycz et al. (2022), appendix D, as used by DAPO / verl `math_dapo`.
_SUBSTITUTIONS = (
    ("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), (r"\ ", ""), (" ", ""),
    ("mbox", "text"), (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"),
)
_REMOVED_EXPRESSIONS = (
    "square", "ways", "integers", "dollars", "mph", "inches", "ft", "hours", "km", "units",
    "\\ldots", "sue", "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm",
    "pounds", "meters", "meals", "edges", "students", "childrentickets", "multiples",
    "\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}",
    r"\mathrm{th}", r"^\circ", r"^{\circ}", r"\;", r",\!", "{,}", '"', "\\dots",
)


@dataclasses.dataclass
class RewardBatch:
  """Per-item rewards. `timeouts`/`errors` count items scored 0 because a grader hung/failed
  (per response: responses sharing an answer and ground truth are graded once)."""
  scores: np.ndarray  # float32 [N]
  correct: np.ndarray  # bool [N]
  timeouts: int = 0
  errors: int = 0
  extracted: list = dataclasses.field(default_factory=list)  # answer string or None, per item
  messages: list = dataclasses.field(default_factory=list)  # why an item failed, "" if fine
  distinct_graded: int = 0  # distinct (answer, ground truth) pairs sent to math-verify
  # Code: samples scored 0 without being judged, by reason ("too_large", "invalid_text",
  # "sandbox_died", "reference_failed", "judge_too_large", "judge_too_deep",
  # "judge_timeout": outputs past the judge's budget), and runs killed at the memory limit.
  rejected: dict = dataclasses.field(default_factory=dict)
  memory_exceeded: int = 0

  def metrics(self) -> dict[str, float]:
    n = max(len(self.scores), 1)
    out = {"reward/mean": float(np.mean(self.scores)) if len(self.scores) else 0.0,
           "reward/accuracy": float(np.mean(self.correct)) if len(self.correct) else 0.0,
           "reward/timeouts": float(self.timeouts), "reward/errors": float(self.errors),
           "reward/no_answer_frac": sum(e is None for e in self.extracted) / n}
    if self.rejected or self.memory_exceeded:
      out["reward/memory_exceeded"] = float(self.memory_exceeded)
      out["reward/rejected"] = float(sum(self.rejected.values()))
      out.update({f"reward/rejected/{reason}": float(count)
                  for reason, count in sorted(self.rejected.items())})
    return out


_INTEGER = re.compile(r"-?[0-9]+")


def _check_rule(rule: str):
  if rule not in RULES:
    raise ValueError(f"rule must be one of {RULES}, got {rule!r}")


def last_boxed(text: str) -> str | None:
  """Content of the last `\\boxed{...}` (or `\\fbox{...}`), with nested braces; None if absent."""
  best = None
  for command in _BOX_COMMANDS:
    start = text.rfind(command + "{")
    if start > (best[0] if best else -1):
      best = (start, command)
  if best is None:
    # `\boxed 5` (no braces) appears in some model outputs.
    match = re.search(r"\\boxed ([^\s$]+)", text)
    return match.group(1) if match else None
  i = best[0] + len(best[1]) + 1
  depth = 1
  for j in range(i, len(text)):
    if text[j] == "{":
      depth += 1
    elif text[j] == "}":
      depth -= 1
      if depth == 0:
        return text[i:j]
  return None  # unbalanced: the response was cut off inside the box


def normalize_answer(answer: str) -> str:
  """DAPO / Minerva normalisation of a final answer string."""
  answer = answer.split("=")[-1]
  for before, after in _SUBSTITUTIONS:
    answer = answer.replace(before, after)
  for expression in _REMOVED_EXPRESSIONS:
    answer = answer.replace(expression, "")
  answer = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$", answer)
  answer = re.sub(r"(\\text\{)(.*?)(\})", "\\2", answer)
  answer = re.sub(r"(\\textbf\{)(.*?)(\})", "\\2", answer)
  answer = re.sub(r"(\\overline\{)(.*?)(\})", "\\2", answer)
  answer = re.sub(r"(\\boxed\{)(.*)(\})", "\\2", answer)
  answer = re.sub(r"(frac)([^{])(.)", "frac{\\2}{\\3}", answer)
  answer = re.sub(r"(sqrt)([^{])", "sqrt{\\2}", answer)
  answer = answer.replace("$", "")
  if answer.replace(",", "").isdigit():
    answer = answer.replace(",", "")
  return answer.strip()


def _extract_raw(text: str, rule: str) -> str | None:
  if rule == "answer":
    matches = _ANSWER_LINE.findall(text[-_DAPO_WINDOW_CHARS:])
    return matches[-1].strip() if matches else None
  return last_boxed(text)


def extract_answer(text: str, rule: str) -> str | None:
  """The answer a response commits to under `rule`, normalised; None if it gives none."""
  _check_rule(rule)
  raw = _extract_raw(text, rule)
  if raw is None:
    return None
  answer = normalize_answer(raw)
  return answer or None


def _raw_ground_truth(ground_truth: str) -> str:
  ground_truth = str(ground_truth)
  boxed = last_boxed(ground_truth) if "\\boxed" in ground_truth else None
  return boxed if boxed is not None else ground_truth


def normalize_ground_truth(ground_truth: str) -> str:
  return normalize_answer(_raw_ground_truth(ground_truth))


def _as_latex(answer: str) -> str:
  return answer if "$" in answer else f"${answer}$"


def _math_verify_equal(answer: str, ground_truth: str, timeout_s: int | None) -> bool:
  import math_verify  # imported lazily: the trainer's main process need not pay for sympy
  config = [math_verify.LatexExtractionConfig(), math_verify.ExprExtractionConfig()]
  gold = math_verify.parse(_as_latex(ground_truth), config, parsing_timeout=timeout_s)
  pred = math_verify.parse(_as_latex(answer), config, parsing_timeout=timeout_s)
  if not gold or not pred:
    return False
  return bool(math_verify.verify(gold, pred, timeout_seconds=timeout_s))


def judge_extracted(raw: str | None, raw_truth: str, *, timeout_s: int | None = None
                    ) -> tuple[bool, str | None]:
  """(correct, normalised answer) for an extracted answer. Correct when the normalised strings
  match or math-verify finds the raw or the normalised forms equivalent (the DAPO
  normalisation can mangle LaTeX such as `\\left(`, so the raw forms go first); two integer
  literals are compared as integers, math-verify's verdict without its parse).
  `timeout_s` (math-verify's signal timeouts) only works on the main thread."""
  if timeout_s is None:  # the caller bounds the time; math-verify would warn on every parse
    logger = logging.getLogger("math_verify")
    if logger.level != logging.ERROR:  # setLevel clears every logger's cache: once is enough
      logger.setLevel(logging.ERROR)
  answer = normalize_answer(raw) if raw is not None else None
  if not answer:
    return False, None
  truth = normalize_answer(raw_truth)
  if _INTEGER.fullmatch(raw.strip()) and _INTEGER.fullmatch(raw_truth.strip()):
    # Two integer literals: math-verify's verdict, without its sympy parse.
    return int(answer) == int(truth), answer
  if answer == truth or _math_verify_equal(raw, raw_truth, timeout_s):
    return True, answer
  if (answer, truth) != (raw, raw_truth) and _math_verify_equal(answer, truth, timeout_s):
    return True, answer
  return False, answer


def judge(response: str, ground_truth: str, rule: str, *, timeout_s: int | None = None
          ) -> tuple[bool, str | None]:
  """(correct, normalised answer) for one response under `rule`."""
  _check_rule(rule)
  return judge_extracted(_extract_raw(response, rule), _raw_ground_truth(ground_truth),
                         timeout_s=timeout_s)


def grade_extracted_item(item: tuple[str, str]) -> tuple[bool, str | None]:
  """Pool entry point: (raw answer, raw ground truth), math-verify's own timeouts off."""
  return judge_extracted(item[0], item[1], timeout_s=None)


def warm_up_math_verify():
  """Pool initializer: import sympy/math-verify and fill their caches before the first deadline."""
  grade_extracted_item(("\\frac{1}{2}", "0.5"))


class RewardPool(reward_pool.TimeoutPool):
  """Process pool for graders: every item gets `timeout_s`; a hung or crashed worker is replaced.

      with RewardPool(num_workers=4, timeout_s=10.0) as pool:
        batch = score_math(responses, answers, rule="answer", pool=pool)
  """

  def __init__(self, num_workers: int = 2, timeout_s: float = 10.0, **kwargs):
    kwargs.setdefault("initializer", warm_up_math_verify)
    super().__init__(num_workers, timeout_s, **kwargs)


def _check_lengths(a: Sequence, b: Sequence, name_a: str, name_b: str):
  if len(a) != len(b):
    raise ValueError(f"{name_a} has {len(a)} items but {name_b} has {len(b)}; they must match")


def score_math(responses: Sequence[str], ground_truths: Sequence[str], *, rule: str = "answer",
               correct_score: float = 1.0, incorrect_score: float = 0.0,
               pool: reward_pool.TimeoutPool | None = None,
               timeout_s: float | None = None) -> RewardBatch:
  """Scores each response against its ground truth. DAPO uses correct/incorrect = +1/-1.

  With `pool`, grading runs in its workers with a deadline per item (`timeout_s`
  overrides the pool's). Without one it runs here with a SIGALRM deadline per
  item (default 10 s) when on the main thread, unbounded on other threads; a
  C-level sympy call is only interrupted when it returns to Python.
  """
  _check_rule(rule)
  _check_lengths(responses, ground_truths, "responses", "ground_truths")
  # Extraction is a cheap regex: do it here, then grade each distinct (answer, truth) once.
  keys = [(_extract_raw(str(r), rule), _raw_ground_truth(str(g)))
          for r, g in zip(responses, ground_truths)]
  distinct = list(dict.fromkeys(k for k in keys if k[0] is not None))
  if pool is not None:
    graded = pool.map(grade_extracted_item, distinct, timeout_s=timeout_s)
  else:
    graded = [_grade_in_process(key, timeout_s) for key in distinct]
  by_key = dict(zip(distinct, graded))
  no_answer = reward_pool.ItemResult("ok", (False, None))
  results = [by_key.get(k, no_answer) if k[0] is not None else no_answer for k in keys]
  correct = np.array([r.status == "ok" and bool(r.value[0]) for r in results], dtype=bool)
  scores = np.where(correct, correct_score, incorrect_score).astype(np.float32)
  return RewardBatch(
      scores=scores, correct=correct,
      timeouts=sum(r.status == "timeout" for r in results),
      errors=sum(r.status == "error" for r in results),
      extracted=[r.value[1] if r.status == "ok" else None for r in results],
      messages=[r.message for r in results], distinct_graded=len(distinct))


class _GradingDeadline(BaseException):
  """Raised by the SIGALRM handler; a BaseException so that sympy's `except Exception` blocks
  (and math-verify's, which turn its own timeouts into a silent False) cannot swallow it."""


def _grade_in_process(key: tuple[str, str], timeout_s: float | None) -> reward_pool.ItemResult:
  if threading.current_thread() is not threading.main_thread():
    return _grade_unbounded(key)  # signals only reach the main thread
  seconds = float(timeout_s or 10.0)

  def on_alarm(signum, frame):
    raise _GradingDeadline()

  # One timer for the whole item, math-verify's own (one per parse/verify call, which can add
  # up to several times the budget) off.
  previous = signal.signal(signal.SIGALRM, on_alarm)
  signal.setitimer(signal.ITIMER_REAL, seconds)
  try:
    return _grade_unbounded(key)
  except _GradingDeadline:
    return reward_pool.ItemResult("timeout", None, f"exceeded {seconds:g}s (graded in process)")
  finally:
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, previous)


def _grade_unbounded(key: tuple[str, str]) -> reward_pool.ItemResult:
  try:
    return reward_pool.ItemResult("ok", judge_extracted(*key, timeout_s=None))
  except Exception as e:  # noqa: BLE001 -- a grader failure scores 0 and is counted
    return reward_pool.ItemResult("error", None, f"{type(e).__name__}: {e}")


def score_code(programs: Sequence[str], test_cases: Sequence[Sequence], *,
               all_or_nothing: bool = False, pool: reward_pool.TimeoutPool | None = None,
               limits=None, correct_score: float = 1.0, incorrect_score: float = 0.0
               ) -> RewardBatch:
  """Runs each program against its tests in the sandbox (`ba_jax.sandboxing.judge`).

  A test case is `{"input": stdin, "output": expected_stdout}`, a call test
  (`{"call": name, "inputs": [...], "expected": [...]}` or with a `reference`
  program; the outputs are compared outside the program's process), or
  assertion code (e.g. `"assert f(2) == 4"`, passing only when the harness's
  per-run token proves that it ran to the end without raising). The score is
  the fraction of tests passed (mapped onto [incorrect_score, correct_score]),
  or all-or-nothing. A sample that cannot run (too large for the sandbox, not
  valid text, a launcher that died) scores incorrect_score and is counted in
  `rejected`; only a sandbox the kernel refuses raises. With `pool`, programs
  run concurrently in its workers.
  """
  from ba_jax.sandboxing import judge
  from ba_jax.sandboxing import sandbox
  _check_lengths(programs, test_cases, "programs", "test_cases")
  limits = limits or sandbox.SandboxLimits()
  for i, cases in enumerate(test_cases):
    judge.check_test_cases(cases, f"program {i}: ")
  sandbox.check_available()  # refuse here, with the reason, rather than score every program 0
  sandbox.check_limits(limits)
  items = [(p if isinstance(p, str) else str(p), list(t), limits)
           for p, t in zip(programs, test_cases)]
  if pool is not None:
    # A call test with a reference costs two runs the first time a worker sees it, each read
    # and compared within the judge's time budget.
    per_run = limits.wall_time_s + 2 * limits.judge_time_s
    budget = per_run * 2 * max([len(t) for t in test_cases] + [1]) + 30.0
    results = pool.map(judge.run_tests_item, items, timeout_s=max(budget, pool.timeout_s))
  else:
    results = []
    for item in items:
      try:
        results.append(reward_pool.ItemResult("ok", judge.run_tests_item(item)))
      except sandbox.SandboxUnavailable:
        raise
      except Exception as e:  # noqa: BLE001 -- counted, scored 0
        results.append(reward_pool.ItemResult("error", None, f"{type(e).__name__}: {e}"))
  fractions, timeouts, messages, rejected, memory = [], 0, [], {}, 0
  for r in results:
    if r.status != "ok":
      fractions.append(0.0)
      timeouts += r.status == "timeout"
      messages.append(r.message[:500])
      continue
    outcome = r.value
    fractions.append(outcome.passed / max(outcome.total, 1) if not outcome.rejected else 0.0)
    timeouts += outcome.timeouts
    memory += outcome.memory_exceeded
    if outcome.rejected:
      rejected[outcome.rejected] = rejected.get(outcome.rejected, 0) + 1
    messages.append(outcome.message)
  fractions = np.asarray(fractions, dtype=np.float64)
  correct = fractions >= 1.0
  if all_or_nothing:
    fractions = correct.astype(np.float64)
  scores = (incorrect_score + (correct_score - incorrect_score) * fractions).astype(np.float32)
  return RewardBatch(scores=scores, correct=correct, timeouts=int(timeouts),
                     errors=sum(r.status == "error" for r in results),
                     extracted=[None] * len(results), messages=messages, rejected=rejected,
                     memory_exceeded=memory)
