"""A synthetic task whose length is chosen again at every step: an answer
draft, then as many check drafts as the policy likes.

The prompt is the addition task's (``ba_jax.tasks.synthetic.Problem``):
``3+5+2=``. A response is drafts separated by spaces, then EOS::

    0,3,8,10 4,17,2,25 7,9,0,13

The first draft is the answer: the running sums from 0, its last value the
sum. Each further draft is a check, starting at a digit in ``1..max_offset``
and then (``scratch="digits"``, the default) free numbers, or (``"sums"``)
that digit plus each running sum. After every draft the policy chooses, one
token, between EOS and another check, and a check's tokens are free, so the
length is decided throughout the response and its tokens carry real entropy,
unlike ``ba_jax.tasks.chains``, whose first token fixes the length. The
answer comes first, so whether it is right cannot depend on how long the
policy then writes: in a probe with the answer draft last, a small policy's
answer after long drafts was less often right (P(right | 1, 2, 3 drafts) =
0.17, 0.10, 0.05), which made the correct responses the shorter ones under
every rule.

* Warm-up traces (``sft_response``): after each draft another one follows
  with probability ``continue_prob`` (q), up to ``max_drafts``, so the draft
  count is a truncated geometric. The answer draft is right (share
  ``sft_correct_frac``) or goes wrong by a small amount from one value on,
  drawn independently of the count, so every rule grades a warm-up trace
  alike and the warm-up does not depend on the rule. There is no
  ``Answer:`` line: a fixed tail would dilute the length variation the
  drafts make (within-group CV 0.40 with one, at q = 0.6).
* ``rule``, the verifier: ``"answer"`` (the answer draft right and the
  checks well formed; no length gap by construction), ``"min_drafts:k"``
  (and at least ``k`` drafts: correct responses are the longer ones) or
  ``"max_drafts:k"`` (at most ``k``: the shorter ones). Checks are graded
  for form only, as chains' count rules grade its earlier chains.

The generator's settings are the config's typed ``task`` section
(``ba_jax.config.schema.DraftsTask``) itself. Problems, held-out split,
seeding and tokenizer are the addition task's.
"""
from __future__ import annotations

import re
from typing import Sequence

import numpy as np

from ba_jax.config import schema
from ba_jax.tasks import synthetic
from ba_jax.tasks.synthetic import Problem, build_tokenizer  # noqa: F401 -- this task's too

NAME = "synthetic_drafts"
_DRAFT_RE = re.compile(r"^\d+(,\d+)*$")


def parse_rule(rule: str) -> tuple[str, int]:
  """``"answer"`` -> ("answer", 0); ``"min_drafts:3"`` -> ("min_drafts", 3)."""
  if not schema.DRAFTS_RULE.ok(rule):
    raise ValueError(f"task.rule={rule!r}: expected {schema.DRAFTS_RULE.expected}")
  kind, _, bound = rule.partition(":")
  return kind, int(bound or 0)


def config_from(task_cfg) -> schema.DraftsTask:
  """The typed section of ``task_cfg`` (already one, or a ConfigDict/dict
  checked by the schema), with the checks across keys."""
  cfg = (task_cfg if isinstance(task_cfg, schema.DraftsTask)
         else schema.task_section(task_cfg))
  if not isinstance(cfg, schema.DraftsTask):
    raise ValueError(f"task.name={cfg.name!r}: expected {NAME!r}")
  if cfg.min_terms > cfg.max_terms:
    raise ValueError(f"task.min_terms={cfg.min_terms}, task.max_terms="
                     f"{cfg.max_terms}: expected min_terms <= max_terms")
  kind, bound = parse_rule(cfg.rule)
  if kind == "min_drafts" and bound > cfg.max_drafts:
    raise ValueError(f"task.rule={cfg.rule!r} needs more drafts than "
                     f"task.max_drafts={cfg.max_drafts}: no warm-up trace "
                     "could be correct")
  return cfg


def draft(p: Problem, start: int) -> list[int]:
  """The draft from ``start``: ``start`` then it plus each running sum."""
  return [start] + [start + int(s) for s in np.cumsum(p.numbers)]


def format_response(drafts: Sequence[Sequence[int]]) -> str:
  return " ".join(",".join(map(str, d)) for d in drafts)


def correct_response(p: Problem, offsets: Sequence[int] = ()) -> str:
  """The answer draft, then ``"sums"`` checks from ``offsets``."""
  return format_response([draft(p, 0)] + [draft(p, o) for o in offsets])


def parse_response(text: str) -> list[list[int]] | None:
  """The drafts, or None when the response is empty or any draft malformed."""
  words = text.split()
  if not words or not all(_DRAFT_RE.match(w) for w in words):
    return None
  return [[int(v) for v in w.split(",")] for w in words]


def grade(text: str, p: Problem, rule: str) -> float:
  """1.0 iff ``text`` is correct for ``p`` under ``rule`` (the module doc):
  the drafts well formed, the first equal to the running sums from 0 (so
  its last value is the answer), every later one a check (not starting at
  0), and the count within the bound."""
  kind, bound = parse_rule(rule)
  drafts = parse_response(text)
  if not drafts or drafts[0] != draft(p, 0):
    return 0.0
  if any(d[0] == 0 for d in drafts[1:]):  # a second answer
    return 0.0
  r = len(drafts)
  if kind == "min_drafts":
    return float(r >= bound)
  if kind == "max_drafts":
    return float(r <= bound)
  return 1.0


def draft_count(text: str) -> int:
  """How many well-formed drafts ``text`` writes (0 when malformed)."""
  drafts = parse_response(text)
  return len(drafts) if drafts else 0


def check_draft(p: Problem, rng: np.random.Generator, cfg) -> list[int]:
  """A warm-up check: a start drawn from ``1..max_offset``, then
  (``scratch="sums"``) it plus each running sum, or (``"digits"``) as many
  random numbers from ``0..max_value * max_terms`` (the running sums' range,
  so a check is about as long as the answer draft)."""
  start = int(rng.integers(1, cfg.max_offset + 1))
  if cfg.scratch == "sums":
    return draft(p, start)
  top = cfg.max_value * cfg.max_terms
  return [start] + [int(v) for v in rng.integers(0, top + 1, len(p.numbers))]


def draw_count(rng: np.random.Generator, cfg) -> int:
  """A warm-up trace's draft count: 1, then one more with ``continue_prob``
  after each draft, at most ``max_drafts``."""
  r = 1
  while r < cfg.max_drafts and rng.random() < cfg.continue_prob:
    r += 1
  return r


def sft_response(p: Problem, rng: np.random.Generator, cfg) -> tuple[str, bool]:
  """A warm-up trace for ``p`` and whether ``cfg.rule`` grades it correct."""
  r = draw_count(rng, cfg)
  answer = draft(p, 0)
  if rng.random() >= cfg.sft_correct_frac:
    i = int(rng.integers(1, len(answer)))  # its start, 0, is kept
    delta = int(rng.choice([d for d in (-3, -2, -1, 1, 2, 3) if answer[i] + d >= 0]))
    answer = answer[:i] + [v + delta for v in answer[i:]]
  drafts = [answer] + [check_draft(p, rng, cfg) for _ in range(r - 1)]
  text = format_response(drafts)
  return text, grade(text, p, cfg.rule) > 0


def max_response_tokens(cfg) -> int:
  """An upper bound on a warm-up response's tokens, EOS included."""
  worst = Problem((cfg.max_value,) * cfg.max_terms)
  text = correct_response(worst, [cfg.max_offset] * (cfg.max_drafts - 1))  # sums: longest
  # an error can add a digit to each value of the answer draft
  return len(text) + cfg.max_terms + 1


class DraftsTask(synthetic.RuleTask):
  """This task behind ``ba_jax.tasks.registry.Task``: ``synthetic.RuleTask``
  with this module's config, warm-up traces and grading."""

  name = NAME
  section = schema.DraftsTask  # the task section's keys
  config_from = staticmethod(config_from)
  response_bound = staticmethod(max_response_tokens)
  trace = staticmethod(sft_response)
  grade_one = staticmethod(grade)
