"""Training and evaluation data: DAPO-Math-17k, Polaris-53K, six math benchmarks, prompts.

Loaders read local files (parquet, jsonl, json) or, for a directory or a
dataset name, go through `datasets.load_dataset` (the local cache when
offline). Every record becomes an `Example`; a bad row (malformed JSON, a value
nested too deeply or an integer too long to read, a missing or empty field)
raises a `DataError` naming the file, the row and, where one is to blame, the field.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from fractions import Fraction
from typing import Any

import numpy as np

from ba_jax.tasks import rows

DAPO_PREFIX = ("Solve the following math problem step by step. The last line of your response "
               "should be of the form Answer: $Answer (without quotes) where $Answer is the "
               "answer to the problem.\n\n")
DAPO_SUFFIX = "\n\nRemember to put your answer on its own line after \"Answer:\"."
BOXED_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
TEMPLATES = ("answer", "boxed", "chat", "raw")


@dataclasses.dataclass(frozen=True)
class Example:
  problem: str  # the bare problem text
  answer: str  # ground truth
  source: str  # dataset / benchmark name
  prompt: Any = None  # the dataset's own prompt (chat messages for DAPO), if it has one
  meta: dict = dataclasses.field(default_factory=dict, hash=False, compare=False)


class ExampleList(list):
  """A list of `Example`s that also carries load statistics (`stats`)."""

  def __init__(self, examples=(), stats: dict | None = None):
    super().__init__(examples)
    self.stats = dict(stats or {})


DataError, fail, preview, read_rows = rows.DataError, rows.fail, rows.preview, rows.read_rows
_fail = fail


def _text(path, row, record, field, *, required=True) -> str | None:
  value = record.get(field)
  if value is None or (isinstance(value, float) and np.isnan(value)):
    if required:
      _fail(path, row, field, f"missing (row has fields {sorted(record)})")
    return None
  if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
    return str(int(value))
  if isinstance(value, (float, np.floating)):
    # AMC/AIME answers are sometimes stored as floats (27.0): keep integers integral.
    return str(int(value)) if float(value).is_integer() else str(value)
  if not isinstance(value, str):
    _fail(path, row, field, f"expected a string, got {type(value).__name__}: {preview(value)}")
  if required and not value.strip():
    _fail(path, row, field, "empty string")
  return value


# ----------------------------------------------------------------------------- training sets


def _problem_from_dapo_prompt(content: str) -> str:
  problem = content
  if problem.startswith(DAPO_PREFIX):
    problem = problem[len(DAPO_PREFIX):]
  if problem.endswith(DAPO_SUFFIX):
    problem = problem[:-len(DAPO_SUFFIX)]
  return problem


def load_dapo_math(path_or_name: str, *, dedup: bool = True) -> ExampleList:
  """DAPO-Math-17k in verl's layout (prompt, reward_model.ground_truth, data_source, ...).

  The public copy repeats each prompt ~100 times; `dedup` keeps the first row
  of each (prompt, ground truth) and `stats["duplicates_dropped"]` counts the rest.
  A row whose user message holds no problem text once DAPO's instruction
  wrapper (and surrounding whitespace) is removed is a DataError, like any
  malformed row.
  """
  examples, seen, rows = [], set(), 0
  for row, record in read_rows(path_or_name):
    rows += 1
    messages = record.get("prompt")
    if isinstance(messages, np.ndarray):
      messages = list(messages)
    if not isinstance(messages, list) or not messages:
      _fail(path_or_name, row, "prompt", f"expected a non-empty list of chat messages, got "
            f"{type(messages).__name__}: {preview(messages)}")
    for j, message in enumerate(messages):
      if not isinstance(message, dict) or not isinstance(message.get("content"), str) \
          or not isinstance(message.get("role"), str):
        _fail(path_or_name, row, f"prompt[{j}]",
              f"expected {{'role': str, 'content': str}}, got {preview(message)}")
    reward_model = record.get("reward_model")
    if not isinstance(reward_model, dict):
      _fail(path_or_name, row, "reward_model", f"expected a dict with 'ground_truth', got "
            f"{type(reward_model).__name__}")
    if reward_model.get("ground_truth") is None:
      _fail(path_or_name, row, "reward_model.ground_truth", "missing")
    answer = _text(path_or_name, row, reward_model, "ground_truth")
    user = next((j for j, m in enumerate(messages) if m["role"] == "user"), len(messages) - 1)
    problem = _problem_from_dapo_prompt(messages[user]["content"])
    if not problem.strip():
      _fail(path_or_name, row, f"prompt[{user}].content", "no problem text once DAPO's "
            f"instruction wrapper is removed: {preview(messages[user]['content'])}")
    key = (tuple((m["role"], m["content"]) for m in messages), answer)
    if dedup and key in seen:
      continue
    seen.add(key)
    examples.append(Example(
        problem=problem, answer=answer,
        source=str(record.get("data_source") or "math_dapo"),
        prompt=[dict(role=m["role"], content=m["content"]) for m in messages],
        meta={"ability": record.get("ability"), "extra_info": record.get("extra_info"),
              "row": row}))
  if not examples:
    raise DataError(f"{path_or_name}: no training examples (the file has no rows)")
  stats = {"rows": rows, "examples": len(examples), "duplicates_dropped": rows - len(examples)}
  logging.getLogger(__name__).info("DAPO-Math %s: %d rows, %d unique, %d duplicates dropped",
                                   path_or_name, rows, len(examples), stats["duplicates_dropped"])
  return ExampleList(examples, stats)


def parse_difficulty(value, path="", row=0) -> float:
  """Polaris difficulty: a number or a pass-rate string such as "3/8"."""
  try:
    if isinstance(value, str):
      return float(Fraction(value.strip()))
    if isinstance(value, bool):
      raise TypeError
    return float(value)
  except (TypeError, ValueError, ZeroDivisionError, OverflowError):
    _fail(path, row, "difficulty",
          f"expected a number or a fraction like '3/8', got {preview(value)}")


def load_polaris(path: str, *, min_difficulty: float | None = None,
                 max_difficulty: float | None = None) -> ExampleList:
  """Polaris-53K jsonl (problem, answer, difficulty); keeps min <= difficulty <= max."""
  examples, rows = [], 0
  for row, record in read_rows(path):
    rows += 1
    problem = _text(path, row, record, "problem")
    answer = _text(path, row, record, "answer")
    difficulty = parse_difficulty(record.get("difficulty"), path, row) \
        if record.get("difficulty") is not None else None
    if difficulty is None and (min_difficulty is not None or max_difficulty is not None):
      _fail(path, row, "difficulty", "missing, but a difficulty filter was asked for")
    if min_difficulty is not None and difficulty < min_difficulty:
      continue
    if max_difficulty is not None and difficulty > max_difficulty:
      continue
    examples.append(Example(problem=problem, answer=answer, source="polaris",
                            meta={"difficulty": difficulty, "row": row}))
  if not examples:
    why = ("the file has no rows" if not rows else
           f"all {rows} rows are outside difficulty [{min_difficulty}, {max_difficulty}]")
    raise DataError(f"{path}: no training examples ({why})")
  return ExampleList(examples, {"rows": rows, "examples": len(examples),
                                "filtered_out": rows - len(examples)})


# ----------------------------------------------------------------------------- evaluation sets

# name -> (canonical source name, problem fields, answer fields), first present wins.
EVAL_SETS = {
    "aime24": ("aime24", ("problem", "Problem", "question"), ("answer", "Answer")),
    "aime25": ("aime25", ("problem", "question", "Problem"), ("answer", "Answer")),
    "amc23": ("amc23", ("question", "problem"), ("answer",)),
    "math500": ("math500", ("problem",), ("answer",)),
    "minerva": ("minerva", ("problem", "question"), ("answer", "final_answer")),
    "olympiadbench": ("olympiadbench", ("question", "problem"), ("final_answer", "answer")),
}
_ALIASES = {"aime_2024": "aime24", "aime2024": "aime24", "aime_2025": "aime25",
            "aime2025": "aime25", "amc_2023": "amc23", "amc2023": "amc23", "math-500": "math500",
            "math_500": "math500", "minerva_math": "minerva", "minervamath": "minerva",
            "olympiad_bench": "olympiadbench", "olympiad": "olympiadbench"}


def canonical_name(name: str, aliases: dict, known, what: str) -> str:
  """`name` lower-cased and de-aliased; an error naming `what` and the `known` names if unknown."""
  key = name.strip().lower()
  key = aliases.get(key, key)
  if key not in known:
    raise ValueError(f"unknown {what} {name!r}; expected one of {sorted(known)}")
  return key


def canonical_eval_name(name: str) -> str:
  return canonical_name(name, _ALIASES, EVAL_SETS, "evaluation set")


def _answer_from_solution(solution: str) -> str | None:
  from ba_jax.tasks.rewards import last_boxed
  return last_boxed(solution)


def _eval_answer(path, row, record, fields) -> str:
  for field in fields:
    value = record.get(field)
    if isinstance(value, (list, tuple, np.ndarray)):  # OlympiadBench: ["$\\frac{1}{2}$"]
      parts = [str(v).strip() for v in value]
      if not parts or not all(parts):
        _fail(path, row, field, f"expected a non-empty list of answers, got {preview(value)}")
      return ", ".join(p[1:-1] if len(p) > 1 and p[0] == p[-1] == "$" else p for p in parts)
    if value is not None:
      return _text(path, row, record, field)
  if isinstance(record.get("solution"), str):  # Minerva/MATH copies with only a solution
    boxed = _answer_from_solution(record["solution"])
    if boxed:
      return boxed
  _fail(path, row, "/".join(fields), f"no answer field (row has fields {sorted(record)})")


def load_eval_set(name: str, path: str) -> ExampleList:
  """An evaluation set (aime24, aime25, amc23, math500, minerva, olympiadbench) from `path`.

  `path` is its file, a directory holding `<name>.jsonl` / `test.jsonl` (or
  .json/.parquet), or a dataset name in the local Hugging Face cache.
  """
  key = canonical_eval_name(name)
  source, problem_fields, answer_fields = EVAL_SETS[key]
  path = _find_eval_file(key, os.fspath(path))
  examples = []
  for row, record in read_rows(path):
    field = next((f for f in problem_fields if record.get(f) is not None), problem_fields[0])
    problem = _text(path, row, record, field)
    answer = _eval_answer(path, row, record, answer_fields)
    meta = {k: record[k] for k in ("id", "ID", "unique_id", "subject", "level", "url", "year",
                                   "unit", "answer_type", "subfield") if k in record}
    meta["row"] = row
    examples.append(Example(problem=problem, answer=answer, source=source, meta=meta))
  if not examples:
    raise DataError(f"{path}: evaluation set {name!r} has no rows")
  return ExampleList(examples, {"rows": len(examples), "examples": len(examples)})


def _find_eval_file(key: str, path: str) -> str:
  if not os.path.isdir(path):
    return path
  names = [key] + [alias for alias, target in _ALIASES.items() if target == key]
  candidates = [os.path.join(path, n + ext) for n in names for ext in (".jsonl", ".json", ".parquet")]
  candidates += [os.path.join(path, n, f) for n in names for f in ("test.jsonl", "test.json",
                                                                    "test.parquet")]
  for candidate in candidates:
    if os.path.isfile(candidate):
      return candidate
  return path  # a dataset directory: `datasets.load_dataset` takes it


# ----------------------------------------------------------------------------- prompts


def format_prompt(example: Example, template: str = "answer", tokenizer=None, *,
                  chat_rule: str = "boxed") -> str:
  """The text fed to the policy.

  "answer": DAPO's instruction ending in an `Answer:` line; "boxed": the
  problem plus the `\\boxed{}` instruction; "chat": the tokenizer's chat
  template around the `chat_rule` instruction ("answer" or "boxed"), with the
  generation prompt; "raw": the dataset's own prompt text (or the problem).
  """
  if template == "answer":
    return DAPO_PREFIX + example.problem + DAPO_SUFFIX
  if template == "boxed":
    return example.problem + BOXED_SUFFIX
  if template == "raw":
    if isinstance(example.prompt, list):
      return "\n\n".join(m["content"] for m in example.prompt)
    return example.prompt if isinstance(example.prompt, str) else example.problem
  if template == "chat":
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
      raise ValueError("template='chat' needs a tokenizer with a chat_template, got "
                       f"{type(tokenizer).__name__ if tokenizer is not None else None}")
    if chat_rule not in ("answer", "boxed"):
      raise ValueError(f"chat_rule must be 'answer' or 'boxed', got {chat_rule!r}")
    content = format_prompt(example, chat_rule)
    return tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)
  raise ValueError(f"template must be one of {TEMPLATES}, got {template!r}")
