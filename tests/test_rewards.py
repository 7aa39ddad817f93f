"""Math rewards: answer rules, equivalence via math-verify, and the timeout pool."""
import time

import numpy as np
import pytest

import rewards_utils
from ba_jax.tasks import reward_pool
from ba_jax.tasks import rewards

# (response under the "answer" rule, ground truth) pairs that must be judged equal.
EQUIVALENT = [
    ("Answer: 0.5", "1/2"),
    ("Answer: 1/2", "\\frac{1}{2}"),
    ("Answer: $\\frac{1}{2}$", "0.5"),
    ("Answer: \\dfrac12", "0.5"),
    ("Answer: -3", "- 3"),
    ("Answer: $-\\frac{3}{4}$", "-0.75"),
    ("Answer: (1, 2]", "(1,2]"),
    ("Answer: [-1,\\ 3)", "[-1, 3)"),
    ("Answer: \\left( 3, \\frac{\\pi}{2} \\right)", "(3,\\frac{\\pi}{2})"),
    ("Answer: 1,000", "1000"),
    ("Answer: 25", "025"),
    ("Answer: x = \\sqrt{2}", "2^{1/2}"),
    ("Answer: 90^\\circ", "90"),
    ("Answer: \\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt 3}{2}"),
]
NOT_EQUIVALENT = [
    ("Answer: 3", "4"),
    ("Answer: (1,2]", "[1,2]"),
    ("Answer: -3", "3"),
    ("Answer: \\frac{1}{3}", "0.33"),
]
MISSING = ["The answer is 5.", "", "I give up.\n", "Answer:"]


def as_boxed(response):
  return "Reasoning... so the result is $\\boxed{" + response[len("Answer: "):] + "}$."


def test_extract_answer_rules():
  assert rewards.extract_answer("Work.\nAnswer: 12\nmore\nAnswer: $\\frac{1}{2}$", "answer") == \
      "\\frac{1}{2}"  # the last Answer: line wins
  assert rewards.extract_answer("ANSWER : 12 dollars.", "answer") == "12."  # units dropped
  assert rewards.extract_answer("Answer: 7" + "x" * 400, "answer") is None  # outside DAPO's window
  text = "first \\boxed{1} then \\boxed{\\frac{1}{\\sqrt{2}} + {x}^{2}} end"
  assert rewards.extract_answer(text, "boxed") == "\\frac{1}{\\sqrt{2}}+{x}^{2}"
  assert rewards.last_boxed(text) == "\\frac{1}{\\sqrt{2}} + {x}^{2}"
  assert rewards.last_boxed("cut off \\boxed{\\frac{1}{2") is None
  assert rewards.last_boxed("\\fbox{4}") == "4"
  assert rewards.extract_answer("no box here", "boxed") is None
  with pytest.raises(ValueError, match="rule must be one of .* got 'last'"):
    rewards.extract_answer("Answer: 1", "last")


@pytest.mark.parametrize("rule", ["answer", "boxed"])
def test_math_grading_in_process(rule):
  responses = [r for r, _ in EQUIVALENT + NOT_EQUIVALENT] + MISSING
  truths = [g for _, g in EQUIVALENT + NOT_EQUIVALENT] + ["5"] * len(MISSING)
  if rule == "boxed":
    responses = [as_boxed(r) if r.startswith("Answer: ") else r for r in responses]
  batch = rewards.score_math(responses, truths, rule=rule, correct_score=1.0, incorrect_score=-1.0)
  expected = np.array([True] * len(EQUIVALENT) + [False] * (len(NOT_EQUIVALENT) + len(MISSING)))
  wrong = [(responses[i], truths[i]) for i in np.flatnonzero(batch.correct != expected)]
  assert not wrong, f"misjudged under rule={rule}: {wrong}"
  assert batch.scores.dtype == np.float32
  np.testing.assert_array_equal(batch.scores, np.where(expected, 1.0, -1.0))
  assert batch.timeouts == 0 and batch.errors == 0
  assert all(batch.extracted[-i] is None for i in range(1, len(MISSING) + 1))


def test_integer_answers_are_judged_as_math_verify_judges_them():
  """Two integer literals skip math-verify's parse: the verdict must be its own."""
  pairs = [("12", "12"), ("12", "13"), ("-3", "3"), ("-3", "-3"), ("025", "25"), ("0", "-0"),
           ("100", "1000"), ("999999999999", "999999999999"), ("7", "007"), ("1", "10")]
  for answer, truth in pairs:
    fast, extracted = rewards.judge_extracted(answer, truth)
    assert extracted == rewards.normalize_answer(answer)
    assert fast == rewards._math_verify_equal(answer, truth, None), (answer, truth)
  # Not both integer literals: math-verify decides (e.g. a percentage against a fraction).
  assert rewards.judge_extracted("1,000", "1000")[0]
  assert not rewards.judge_extracted("12.5", "12")[0]


def test_score_math_checks_its_inputs():
  with pytest.raises(ValueError, match="responses has 2 items but ground_truths has 1"):
    rewards.score_math(["a", "b"], ["1"])
  with pytest.raises(ValueError, match="rule must be one of"):
    rewards.score_math(["a"], ["1"], rule="Answer")


@pytest.fixture(scope="module")
def pool():
  with rewards.RewardPool(num_workers=2, timeout_s=2.0) as p:
    yield p


def test_pool_grades_like_in_process(pool):
  responses = [r for r, _ in EQUIVALENT + NOT_EQUIVALENT] + MISSING
  truths = [g for _, g in EQUIVALENT + NOT_EQUIVALENT] + ["5"] * len(MISSING)
  here = rewards.score_math(responses, truths, rule="answer")
  there = rewards.score_math(responses, truths, rule="answer", pool=pool)
  np.testing.assert_array_equal(there.correct, here.correct)
  np.testing.assert_array_equal(there.scores, here.scores)
  assert there.extracted == here.extracted


def test_pathological_expression_times_out_without_stalling(pool):
  # sympy tries to evaluate (10^10)! exactly; math-verify's own timeout is off in workers.
  responses = ["Answer: 5", "Answer: $(10^{10})!$", "Answer: 0.5", "Answer: $(10^{10})!$"]
  truths = ["5", "5", "1/2", "5"]
  before = pool.timeouts
  start = time.monotonic()
  batch = rewards.score_math(responses, truths, rule="answer", pool=pool, incorrect_score=-1.0)
  elapsed = time.monotonic() - start
  assert elapsed < 2.0 + 10.0  # the deadline plus generous slack on a shared 2-core machine
  np.testing.assert_array_equal(batch.correct, [True, False, True, False])
  np.testing.assert_array_equal(batch.scores, [1.0, -1.0, 1.0, -1.0])
  # The repeated (answer, truth) pair is graded once but counted for both responses.
  assert batch.distinct_graded == 3 and pool.timeouts == before + 1
  assert batch.timeouts == 2 and batch.errors == 0 and "exceeded" in batch.messages[3]
  # The replacement worker grades the next batch normally.
  again = rewards.score_math(["Answer: 2"], ["2"], pool=pool)
  assert again.correct.tolist() == [True] and again.timeouts == 0


def test_timeout_pool_survives_crashing_and_hanging_graders():
  with reward_pool.TimeoutPool(num_workers=2, timeout_s=1.0, initializer=None) as p:
    results = p.map(rewards_utils.square_or_crash, [2, -1, 3, -2, 4])
    assert [r.status for r in results] == ["ok", "error", "ok", "error", "ok"]
    assert [r.value for r in results] == [4, None, 9, None, 16]
    assert "exit code 3" in results[1].message and "grader bug" in results[3].message
    start = time.monotonic()
    results = p.map(rewards_utils.square_or_hang, [1, -1, -1, 5, 6])
    assert time.monotonic() - start < 1.0 * 2 + 10.0
    assert [r.status for r in results] == ["ok", "timeout", "timeout", "ok", "ok"]
    assert [r.value for r in results if r.status == "ok"] == [1, 25, 36]
    assert (p.errors, p.timeouts, p.restarts) == (2, 2, 3)  # an exception does not cost a worker
    pids = {r.value for r in p.map(rewards_utils.worker_pid, list(range(6)))}
    assert len(pids) <= 2
  with pytest.raises(ValueError, match="timeout_s must be > 0 seconds, got 0"):
    reward_pool.TimeoutPool(timeout_s=0)


def test_in_process_timeout_is_counted_and_bounded():
  # Without a pool, the deadline covers the whole item, not each of math-verify's own
  # per-call timeouts (which alone would let it run ~2.6x the budget).
  rewards.score_math(["Answer: 1"], ["1"])  # import sympy/math-verify outside the timed part
  start = time.monotonic()
  batch = rewards.score_math(["Answer: $(10^{10})!$", "Answer: 0.5"], ["5", "1/2"], timeout_s=1.0)
  elapsed = time.monotonic() - start
  assert batch.correct.tolist() == [False, True]
  assert batch.timeouts == 1 and batch.errors == 0
  assert batch.messages[0] == "exceeded 1s (graded in process)" and batch.messages[1] == ""
  assert elapsed < 1.0 + 0.8  # the budget plus grading the easy item on a loaded machine
  again = rewards.score_math(["Answer: 2"], ["2"], timeout_s=1.0)  # the timer is cleared
  time.sleep(1.2)
  assert again.correct.tolist() == [True]
