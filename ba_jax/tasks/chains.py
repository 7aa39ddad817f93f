"""A synthetic task whose response length is the policy's choice: chains of sums.

The prompt is the addition task's (``ba_jax.tasks.synthetic.Problem``):
``3+5+2=``. A response writes ``r`` chains, then the answer::

    2,5,10,12 1,4,9,11 0,3,8,10 Answer: 10

The ``j``-th of ``r`` chains starts at ``r - j`` and adds the prompt's
numbers in order, so the last chain is the plain partial sums and the answer
is its total. No chain can be copied from another and there are no scratch
tokens; the first token fixes ``r``, and so the length.

* ``chain_counts``: the warm-up draws ``r`` uniformly from this set, which
  sets the within-group length variation (on warm-up data, groups of 8: CV
  0.09 for (4, 5), 0.51 for (1, 2, 4, 8), 0.60 for (1, 2, 8)).
* ``rule``, the verifier: ``"answer"`` (only ``Answer: S`` counts; no length
  gap by construction); ``"min_count:k"`` (the answer right, every chain well
  formed, the last one the plain partial sums, and ``r >= k``: correct
  responses are the longer ones) or ``"max_count:k"`` (the same with
  ``r <= k``: the shorter ones). ``"min_chains:k"`` and ``"max_chains:k"``
  also require every chain's arithmetic to be right.

Warm-up traces are error-free (share ``sft_correct_frac``) or have their last
chain go wrong by a small amount from one value on, carried to the answer;
the error is drawn independently of ``r``, and every rule grades a warm-up
trace alike, so the warm-up does not depend on the rule. Problems, held-out
split, seeding and tokenizer are the addition task's. Why the aggregation
grid uses the count rules: experiments/studies/chains_grid/README.md.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Sequence

import numpy as np

from ba_jax.tasks import synthetic
from ba_jax.tasks.synthetic import Problem, build_tokenizer  # noqa: F401 -- this task's too
from ba_jax.config import schema

NAME = "synthetic_chains"
RULES = ("answer", "min_count", "max_count", "min_chains", "max_chains")
MIN_RULES, MAX_RULES = ("min_count", "min_chains"), ("max_count", "max_chains")
_RESPONSE_RE = re.compile(r"^(?P<chains>.*?)\s*Answer:\s*(?P<answer>-?\d+)$", re.S)
_CHAIN_RE = re.compile(r"^\d+(,\d+)*$")


def parse_rule(rule: str) -> tuple[str, int]:
  """``"answer"`` -> ("answer", 0); ``"min_count:4"`` -> ("min_count", 4)."""
  kind, _, bound = str(rule).partition(":")
  ok = kind in RULES and (bound == "" if kind == "answer" else bound.isdigit())
  if not ok or (kind != "answer" and int(bound) < 1):
    raise ValueError(f"task.rule={rule!r}: expected 'answer', or one of "
                     "'min_count:k', 'max_count:k', 'min_chains:k', "
                     "'max_chains:k' with an integer k >= 1")
  return kind, int(bound or 0)


def parse_counts(counts) -> tuple[int, ...]:
  """``chain_counts`` from a sequence or a string such as ``"1,2,4,8"``."""
  items = counts.split(",") if isinstance(counts, str) else list(counts)
  try:
    out = tuple(int(c) for c in items)
  except (TypeError, ValueError):
    out = ()
  if not out or min(out) < 1:
    raise ValueError(f"task.chain_counts={counts!r}: expected a non-empty list "
                     "of chain counts >= 1, such as '1,2,4,8'")
  return out


@dataclasses.dataclass(frozen=True)
class ChainsConfig:
  """The problem fields are ``synthetic.TaskConfig``'s, so its problem
  streams (``train_problems``, ``heldout_problems``) serve this task too."""
  min_terms: int = 2
  max_terms: int = 3
  max_value: int = 9
  chain_counts: tuple[int, ...] = (1, 2, 4, 8)
  rule: str = "answer"
  sft_correct_frac: float = 0.5

  def __post_init__(self):
    object.__setattr__(self, "chain_counts", parse_counts(self.chain_counts))
    if not 2 <= self.min_terms <= self.max_terms:
      raise ValueError(
          f"task.min_terms={self.min_terms}, task.max_terms="
          f"{self.max_terms}: expected 2 <= min_terms <= max_terms")
    if not 1 <= self.max_value <= 9:
      raise ValueError(f"task.max_value={self.max_value}: expected single "
                       "digits, 1..9")
    if not 0.0 <= self.sft_correct_frac <= 1.0:
      raise ValueError(f"task.sft_correct_frac={self.sft_correct_frac}: "
                       "expected a fraction in [0, 1]")
    kind, bound = parse_rule(self.rule)
    counts = self.chain_counts
    if kind in MIN_RULES and bound > max(counts) or (
        kind in MAX_RULES and bound < min(counts)):
      raise ValueError(f"task.rule={self.rule!r} rejects every chain count in "
                       f"task.chain_counts={counts}: no warm-up trace could "
                       "be correct")


def chain(p: Problem, start: int) -> list[int]:
  """The chain from ``start``: ``start`` then it plus each partial sum."""
  return [start] + [start + int(s) for s in np.cumsum(p.numbers)]


def chains_for(p: Problem, r: int) -> list[list[int]]:
  """The ``r`` chains of a right response: starts ``r-1, ..., 1, 0``."""
  return [chain(p, r - j) for j in range(1, r + 1)]


def _format(chains: Sequence[Sequence[int]], answer: int) -> str:
  body = " ".join(",".join(map(str, c)) for c in chains)
  return f"{body} Answer: {answer}" if body else f"Answer: {answer}"


def correct_response(p: Problem, r: int) -> str:
  return _format(chains_for(p, r), p.answer)


def wrong_response(p: Problem, r: int, rng: np.random.Generator) -> str:
  """The last chain off by a small nonzero amount from one value on."""
  chains = chains_for(p, r)
  last = chains[-1]
  i = int(rng.integers(1, len(last)))  # its start, 0, is kept
  deltas = [d for d in (-3, -2, -1, 1, 2, 3)
            if last[i] + d >= 0 and p.answer + d >= 0]
  delta = int(rng.choice(deltas))
  chains[-1] = last[:i] + [v + delta for v in last[i:]]
  return _format(chains, chains[-1][-1])


def parse_response(text: str) -> tuple[list[list[int]] | None, int | None]:
  """(chains, answer); chains is None when any chain is malformed, answer is
  None without a final ``Answer: <int>``."""
  m = _RESPONSE_RE.match(text.strip())
  if not m:
    return None, None
  answer = int(m.group("answer"))
  words = m.group("chains").split()
  if not all(_CHAIN_RE.match(w) for w in words):
    return None, answer
  return [[int(v) for v in w.split(",")] for w in words], answer


def grade(text: str, p: Problem, rule: str) -> float:
  """1.0 iff ``text`` is correct for ``p`` under ``rule`` (see the module doc)."""
  kind, bound = parse_rule(rule)
  chains, answer = parse_response(text)
  if answer != p.answer:
    return 0.0
  if kind == "answer":
    return 1.0
  if not chains:
    return 0.0
  r = len(chains)
  if kind in ("min_chains", "max_chains"):
    if chains != chains_for(p, r):
      return 0.0
  elif chains[-1] != chain(p, 0):  # count rules: only the last chain
    return 0.0
  return float(r >= bound if kind in MIN_RULES else r <= bound)


def chain_count(text: str) -> int:
  """How many well-formed chains ``text`` writes before its answer (0 when
  malformed): the length the policy chose, for diagnostics."""
  chains, _ = parse_response(text)
  return len(chains) if chains else 0


def sft_response(p: Problem, rng: np.random.Generator,
                 task: ChainsConfig) -> tuple[str, bool]:
  """A warm-up trace for ``p`` and whether the rule grades it correct."""
  r = int(rng.choice(task.chain_counts))
  if rng.random() < task.sft_correct_frac:
    text = correct_response(p, r)
  else:
    text = wrong_response(p, r, rng)
  return text, grade(text, p, task.rule) > 0


def max_response_tokens(task: ChainsConfig) -> int:
  """An upper bound on a warm-up response's tokens, EOS included."""
  worst = Problem((task.max_value,) * task.max_terms)
  # an error can add a digit to each value of the last chain and the answer
  return (len(correct_response(worst, max(task.chain_counts)))
          + task.max_terms + 1 + 1)


def config_from(task_cfg) -> ChainsConfig:
  """A ``ChainsConfig`` from the config's ``task`` section."""
  return ChainsConfig(**{f.name: getattr(task_cfg, f.name)
                         for f in dataclasses.fields(ChainsConfig)
                         if hasattr(task_cfg, f.name)})


class ChainsTask(synthetic.RuleTask):
  """This task behind ``ba_jax.tasks.registry.Task``: ``synthetic.RuleTask``
  with this module's config, warm-up traces and grading."""

  name = NAME
  section = schema.ChainsTask  # the task section's keys
  config_from = staticmethod(config_from)
  response_bound = staticmethod(max_response_tokens)
  trace = staticmethod(sft_response)
  grade_one = staticmethod(grade)
