"""Math rewards graded per second: 10,000 responses through `RewardPool`, and in-process;
code rewards (`score_code`, in the sandbox) in seconds per sample on the fixture tasks.

    python -m experiments.benchmarks.bench_rewards [--n=10000] [--workers=2] [--out=experiments/benchmarks/results/rewards_bench.md]
    python -m experiments.benchmarks.bench_rewards --skip_math --code_rounds=5 [--code_out=experiments/benchmarks/results/code_rewards_bench.md]

Responses are ~1.5k characters of reasoning ending in an answer line (DAPO's
"Answer:" rule) or a \\boxed{} answer: a mix of equal forms (1/2 vs 0.5),
wrong answers, missing answers, over typical ground truths (integers,
fractions, radicals, intervals, tuples, polynomials).
"""
import argparse
import json
import math
import os
import platform
import random
import time

from ba_jax.tasks import rewards  # noqa: E402

def _integer(rng):
  v = rng.randint(-50, 9999)
  equal = [str(v), f"${v}$", f"{v} \\text{{ units}}", f"{v:,}".replace(",", "{,}")]
  return str(v), equal, [str(v + rng.randint(1, 9)), str(-v - 1)]


def _fraction(rng):
  q = rng.choice([2, 3, 4, 5, 6, 7, 8, 9, 11, 12, 16, 20, 25])
  p = rng.choice([k for k in range(1, 4 * q) if math.gcd(k, q) == 1])
  equal = [f"\\frac{{{p}}}{{{q}}}", f"{p}/{q}", f"\\dfrac{{{p}}}{{{q}}}"]
  if 10_000 % q == 0:
    equal.append(f"{p / q:g}")
  return f"\\frac{{{p}}}{{{q}}}", equal, [f"\\frac{{{q}}}{{{p}}}", f"\\frac{{{p + 1}}}{{{q}}}"]


def _radical(rng):
  a, b = rng.randint(2, 9), rng.choice([2, 3, 5, 6, 7, 10, 11, 13])
  loose = f"{a} \\sqrt {b}" if b < 10 else f"{a} \\sqrt{{ {b} }}"  # \\sqrt 11 is sqrt(1)*1
  equal = [f"{a}\\sqrt{{{b}}}", f"\\sqrt{{{a * a * b}}}", loose]
  return f"{a}\\sqrt{{{b}}}", equal, [f"{a + 1}\\sqrt{{{b}}}", f"\\sqrt{{{a * b}}}"]


def _interval(rng):
  lo = rng.randint(-20, 10)
  hi = lo + rng.randint(1, 20)
  equal = [f"({lo}, {hi}]", f"({lo},{hi}]", f"\\left({lo},{hi}\\right]"]
  return f"({lo},{hi}]", equal, [f"[{lo},{hi}]", f"({lo},{hi + 1}]"]


def _tuple(rng):
  r, k = rng.randint(1, 20), rng.choice([2, 3, 4, 6])
  equal = [f"\\left( {r}, \\frac{{\\pi}}{{{k}}} \\right)", f"({r}, \\pi/{k})"]
  return f"({r},\\frac{{\\pi}}{{{k}}})", equal, [f"({r}, \\pi)", f"({r + 1}, \\pi/{k})"]


def _polynomial(rng):
  a = rng.randint(1, 9)
  equal = [f"(x+{a})^2", f"x^{{2}} + {2 * a}x + {a * a}"]
  return f"x^2+{2 * a}x+{a * a}", equal, [f"x^2+{a * a}", f"(x-{a})^2"]


MIXED = (_integer, _fraction, _radical, _interval, _tuple, _polynomial)
FILLER = ("We consider the problem carefully. Let us denote the unknown by $x$ and expand the "
          "expression step by step, checking each case and simplifying the result. ")


def make_batch(n, rule, mix, seed=0):
  """Random values, so distinct (answer, truth) pairs are the norm and caches do not help."""
  rng = random.Random(seed)
  makers = MIXED if mix == "mixed" else (_integer,)  # DAPO-Math-17k: integer answers only
  responses, truths = [], []
  for _ in range(n):
    truth, equal, wrong = rng.choice(makers)(rng)
    kind = rng.random()
    answer = rng.choice(equal) if kind < 0.5 else rng.choice(wrong) if kind < 0.9 else None
    body = FILLER * rng.randint(6, 14)
    if answer is None:
      tail = "I could not finish the computation."
    elif rule == "answer":
      tail = f"Answer: {answer}"
    else:
      tail = f"Therefore the answer is $\\boxed{{{answer}}}$."
    responses.append(body + "\n" + tail)
    truths.append(truth)
  return responses, truths


CODE_FIXTURES = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "code")


def code_samples():
  """Per HumanEval+/MBPP+ fixture task, its canonical solution (right) and the bare prompt
  (a stub returning None: wrong), as `score_code` takes them."""
  from ba_jax.tasks import code_data
  programs, tests, right = [], [], []
  for name in ("humanevalplus", "mbppplus"):
    solutions = {}
    with open(os.path.join(CODE_FIXTURES, f"{name}.jsonl")) as f:
      for line in f:
        record = json.loads(line)
        solutions[record["task_id"]] = record["canonical_solution"]
    for example in code_data.load_code_set(name, CODE_FIXTURES):
      for response, is_right in ((solutions[example.task_id], True), ("", False)):
        programs.append(code_data.program_for(example, response))
        tests.append(list(example.tests))
        right.append(is_right)
  return programs, tests, right


def code_rows(rounds):
  """Seconds per sample of `score_code` (in-process, no pool): a first round that also runs
  the references (cached after), then `rounds` timed rounds."""
  from ba_jax.tasks import rewards
  programs, tests, right = code_samples()
  first = time.perf_counter()
  batch = rewards.score_code(programs, tests)
  first = time.perf_counter() - first
  assert batch.correct.tolist() == right, batch.messages
  times = []
  for _ in range(rounds):
    start = time.perf_counter()
    batch = rewards.score_code(programs, tests)
    times.append((time.perf_counter() - start) / len(programs))
    assert batch.correct.tolist() == right, batch.messages
  return len(programs), first / len(programs), times


def write_code_table(args, samples, first, times):
  mean = sum(times) / len(times)
  spread = (sum((t - mean) ** 2 for t in times) / max(len(times) - 1, 1)) ** 0.5
  lines = [
      "# Code reward time per sample", "",
      f"Command: `python -m experiments.benchmarks.bench_rewards --skip_math --code_rounds={args.code_rounds}`",
      "", f"Machine: {os.cpu_count()} CPU cores ({platform.processor() or platform.machine()}), "
      f"Python {platform.python_version()}, 1-minute load average {os.getloadavg()[0]:.1f} at "
      "the end (the cores were shared with other work).", "",
      f"{samples} samples: per HumanEval+/MBPP+ fixture task (tests/fixtures/code) its canonical "
      "solution and its bare prompt (wrong), scored by `rewards.score_code` in-process, "
      "each sample's tests run in the sandbox.", "",
      "| round | s per sample |", "|---|---:|",
      f"| first (references run too) | {first:.3f} |"]
  lines += [f"| {i + 1} | {t:.3f} |" for i, t in enumerate(times)]
  lines += [f"| mean of the timed rounds (sd) | {mean:.3f} ({spread:.3f}) |"]
  os.makedirs(os.path.dirname(args.code_out), exist_ok=True)
  with open(args.code_out, "w") as f:
    f.write("\n".join(lines) + "\n")
  print("\n".join(lines))


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--n", type=int, default=10_000)
  parser.add_argument("--workers", type=int, default=2)
  parser.add_argument("--in_process_n", type=int, default=2_000)
  parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                    "rewards_bench.md"))
  parser.add_argument("--skip_math", action="store_true")
  parser.add_argument("--code_rounds", type=int, default=3, help="0: no code table")
  parser.add_argument("--code_out", default=os.path.join(os.path.dirname(__file__), "results",
                                                         "code_rewards_bench.md"))
  args = parser.parse_args()
  if args.code_rounds:
    write_code_table(args, *code_rows(args.code_rounds))
  if args.skip_math:
    return
  rows = []
  load_before = os.getloadavg()[0]
  rewards.warm_up_math_verify()  # in-process rows: not timing the sympy import
  for mix, rule in (("integer", "answer"), ("integer", "boxed"), ("mixed", "answer")):
    responses, truths = make_batch(args.n, rule, mix)
    start = time.perf_counter()
    with rewards.RewardPool(num_workers=args.workers, timeout_s=10.0) as pool:
      started = time.perf_counter()
      batch = rewards.score_math(responses, truths, rule=rule, pool=pool)
      graded = time.perf_counter()
    total_pool = graded - start
    rows.append((mix, rule, f"pool, {args.workers} workers", args.n, batch.distinct_graded,
                 graded - started, total_pool, batch.correct.mean(), batch.timeouts, batch.errors))
    sub_r, sub_t = responses[:args.in_process_n], truths[:args.in_process_n]
    start = time.perf_counter()
    local = rewards.score_math(sub_r, sub_t, rule=rule)
    elapsed = time.perf_counter() - start
    assert (local.correct == batch.correct[:args.in_process_n]).all(), "pool and in-process differ"
    rows.append((mix, rule, "in-process, main thread", len(sub_r), local.distinct_graded, elapsed,
                 elapsed, local.correct.mean(), local.timeouts, local.errors))
    print(rows[-2], rows[-1], flush=True)
  lines = [
      "# Math reward throughput",
      "",
      f"Command: `python -m experiments.benchmarks.bench_rewards --n={args.n} --workers={args.workers} "
      f"--in_process_n={args.in_process_n}`",
      "",
      f"Machine: {os.cpu_count()} CPU cores ({platform.processor() or platform.machine()}), "
      f"Python {platform.python_version()}; the cores were shared with other engineers' work "
      f"(tests, builds) while this ran (1-minute load average {load_before:.1f} at the start, "
      f"{os.getloadavg()[0]:.1f} at the end), so figures are a lower bound.",
      "",
      "| answers | rule | grading | responses | distinct pairs graded | grading s "
      "| incl. pool start s | responses/s | accuracy | timeouts | errors |",
      "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
  ]
  for mix, rule, how, n, distinct, seconds, total, acc, timeouts, errors in rows:
    lines.append(f"| {mix} | {rule} | {how} | {n} | {distinct} | {seconds:.1f} | {total:.1f} | {n / seconds:.0f} | "
                 f"{acc:.3f} | {timeouts} | {errors} |")
  lines += ["", "Answers `integer`: integer ground truths only, as in DAPO-Math-17k; `mixed`: "
            "integers, fractions, radicals, intervals, tuples, polynomials (one kind drawn per response). "
            "Values are random (the table gives how many (answer, truth) pairs were distinct); `score_math` "
            "grades each distinct pair once, so RL batches where a group repeats an answer "
            "grade faster than this.",
            "", "Responses are ~1.5k characters of filler reasoning with a final answer: 50% an "
            "equal form of the ground truth, 40% wrong, 10% no answer. Answers that are "
            "string-equal after normalisation skip math-verify; wrong ones pay for two "
            "math-verify comparisons (raw and normalised forms). The in-process rows grade the "
            "first responses of the same batch and agree with the pool item by item."]
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  with open(args.out, "w") as f:
    f.write("\n".join(lines) + "\n")
  print("\n".join(lines))


if __name__ == "__main__":
  main()
