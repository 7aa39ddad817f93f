"""reasoning-gym's procedural tasks behind ``ba_jax.tasks.registry.Task``.

reasoning-gym (``pip install -e ".[real]"``) generates problems from a seed,
so a run needs no download, and grades them with each dataset's own
``score_answer`` (partial credit where the verifier gives it). The config's
``task`` section (``section()`` below) names the dataset, or a weighted mix
(reasoning-gym's composite dataset), its difficulty settings, and disjoint
seeds for training and held-out problems; the prompt (system prompt,
instruction, chat template) and the rule that extracts the answer from a
response are part of it too, since for a small model they matter as much as
the difficulty. A response whose rule finds no answer scores 0 and counts as
a format failure (``answer_found``; the trainer logs its share).
"""
from __future__ import annotations

import dataclasses
import re

import ml_collections
import numpy as np

from ba_jax.config import schema
from ba_jax.tasks import dataset_task

NAME = "reasoning_gym"
# "tags": the last <answer>...</answer> (reasoning-gym's own format and
# extractor); "last_number": the last number in the response; "last_line":
# the last non-empty line; "full": the whole response, stripped.
ANSWER_RULES = schema.ANSWER_RULES
# An integer, decimal or fraction, with an optional sign; thousands commas
# are dropped before matching.
_NUMBER_RE = re.compile(r"-?\d+(?:\.\d+)?(?:/\d+)?")


def section(**fields) -> ml_collections.ConfigDict:
  """A ``task`` section for this task: ``fields`` over the schema's defaults
  (``ba_jax.config.schema.ReasoningGymTask``)."""
  return ml_collections.ConfigDict({**schema.defaults(schema.ReasoningGymTask),
                                    **fields})


def _import():
  try:
    import reasoning_gym
  except ImportError:
    raise ImportError(f"task.name={NAME!r} needs the reasoning-gym package: "
                      "pip install -e \".[real]\"") from None
  return reasoning_gym


def parse_mix(datasets: str) -> list[tuple[str, float]]:
  """``"a:2,b:1"`` (or ``"a"``) as [(name, weight)], names checked."""
  from reasoning_gym import factory
  mix = []
  for item in filter(None, (s.strip() for s in datasets.split(","))):
    name, _, weight = item.partition(":")
    if name not in factory.DATASETS or name == "composite":
      valid = sorted(set(factory.DATASETS) - {"composite"})
      raise ValueError(f"task.datasets: unknown reasoning-gym dataset "
                       f"{name!r}; valid names: {', '.join(valid)}")
    try:
      w = float(weight) if weight else 1.0
    except ValueError:
      w = -1.0
    if not w > 0:
      raise ValueError(f"task.datasets: weight of {name!r} is {weight!r}; "
                       "expected a number > 0, as in 'name:2'")
    mix.append((name, w))
  if not mix:
    raise ValueError(f"task.datasets={datasets!r}: expected a dataset name "
                     "or a mix 'name:weight,...'")
  return mix


def _dataset_kwargs(task_cfg, mix) -> dict[str, dict]:
  """Each dataset's difficulty settings, keys checked against its config."""
  from reasoning_gym import factory
  given = task_cfg.dataset_config or {}
  given = given.to_dict() if hasattr(given, "to_dict") else dict(given)
  names = [n for n, _ in mix]
  stray = sorted(set(given) - set(names))
  if stray:
    raise ValueError(f"task.dataset_config has settings for {stray}, which "
                     f"task.datasets={task_cfg.datasets!r} does not name")
  out = {}
  for name in names:
    kwargs = {k: list(v) if isinstance(v, tuple) else v
              for k, v in (given.get(name) or {}).items()}
    fields = {f.name for f in dataclasses.fields(factory.DATASETS[name][1])
              } - {"seed", "size"}
    bad = sorted(set(kwargs) - fields)
    if bad:
      raise ValueError(f"task.dataset_config.{name}: unknown key(s) {bad}; "
                       f"valid keys: {', '.join(sorted(fields))}")
    out[name] = kwargs
  return out


def make_dataset(task_cfg, *, seed: int, size: int):
  """The reasoning-gym dataset (a composite one for a mix) of ``size``
  problems from ``seed``; its ``score_answer`` is the verifier."""
  rg = _import()
  mix = parse_mix(task_cfg.datasets)
  kwargs = _dataset_kwargs(task_cfg, mix)
  try:
    if len(mix) == 1:
      name = mix[0][0]
      return rg.create_dataset(name, size=size, seed=seed, **kwargs[name])
    from reasoning_gym.composite import DatasetSpec
    return rg.create_dataset("composite", size=size, seed=seed, datasets=[
        DatasetSpec(name=n, weight=w, config=kwargs[n]) for n, w in mix])
  except (ValueError, AssertionError, TypeError) as e:
    raise ValueError(f"task.dataset_config for {task_cfg.datasets!r}: "
                     f"reasoning-gym rejected it: {e}") from None


def extract_answer(text: str, rule: str) -> str | None:
  """The answer a response gives under ``rule`` (None: none found)."""
  if rule == "tags":
    from reasoning_gym.utils import extract_answer as tags
    return tags(text)
  if rule == "last_number":
    numbers = _NUMBER_RE.findall(text.replace(",", ""))
    return numbers[-1] if numbers else None
  if rule == "last_line":
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else None
  if rule == "full":
    return text.strip() or None
  raise ValueError(f"task.answer_rule={rule!r}: expected one of "
                   f"{list(ANSWER_RULES)}")


class ReasoningGymTask(dataset_task.DatasetTask):
  """Training problems from ``task.train_seed``, held-out ones from
  ``task.heldout_seed`` (training problems whose question is held out are
  dropped, so the two never share a question); no warm-up data."""

  section = schema.ReasoningGymTask  # the task section's keys

  def __init__(self, task_cfg, eval_cfg, *, seed: int, tokenizer,
               max_prompt_len: int):
    if task_cfg.answer_rule not in ANSWER_RULES:
      raise ValueError(f"task.answer_rule={task_cfg.answer_rule!r}: expected "
                       f"one of {list(ANSWER_RULES)}")
    if task_cfg.train_seed == task_cfg.heldout_seed:
      raise ValueError(f"task.train_seed and task.heldout_seed are both "
                       f"{task_cfg.train_seed}; held-out problems need a seed "
                       "of their own")
    if task_cfg.chat_template and not getattr(tokenizer, "chat_template", None):
      raise ValueError("task.chat_template=True but the tokenizer has no chat "
                       "template; set task.chat_template=False for a plain "
                       "prompt")
    self.system_prompt = self._system_prompt(task_cfg.system_prompt)
    super().__init__(task_cfg, eval_cfg, seed=seed, tokenizer=tokenizer,
                     max_prompt_len=max_prompt_len)

  @staticmethod
  def _system_prompt(value: str) -> str:
    from reasoning_gym.utils import SYSTEM_PROMPTS
    return SYSTEM_PROMPTS.get(value, value)

  def _load_heldout(self, eval_cfg) -> list:
    n = int(eval_cfg.num_problems)
    if n < 1:
      raise ValueError(f"eval.num_problems={n}: task.name={NAME!r} generates "
                       "its held-out problems; expected >= 1")
    self.heldout_dataset = make_dataset(self.cfg, seed=self.cfg.heldout_seed,
                                        size=n)
    return list(self.heldout_dataset)

  def _load_examples(self) -> list:
    self.train_dataset = make_dataset(self.cfg, seed=self.cfg.train_seed,
                                      size=int(self.cfg.train_size))
    held = {e["question"] for e in self.heldout}
    examples = [e for e in self.train_dataset if e["question"] not in held]
    self.dropped_heldout_overlap = len(self.train_dataset) - len(examples)
    if not examples:
      raise ValueError(f"every one of task.train_size={self.cfg.train_size} "
                       "training problems is also a held-out problem; the "
                       "task's difficulty settings allow too few problems")
    return examples

  def _format(self, example) -> str:
    question = example["question"]
    if self.cfg.instruction:
      question = f"{question} {self.cfg.instruction}"
    if not self.cfg.chat_template:
      return (f"{self.system_prompt}\n\n{question}\n" if self.system_prompt
              else f"{question}\n")
    messages = [{"role": "user", "content": question}]
    if self.system_prompt:
      messages.insert(0, {"role": "system", "content": self.system_prompt})
    return self.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)

  def answer_found(self, texts) -> np.ndarray:
    """Whether ``task.answer_rule`` finds an answer in each response."""
    return np.array([extract_answer(t, self.cfg.answer_rule) is not None
                     for t in texts], bool)

  def grade(self, texts, problems) -> tuple[np.ndarray, np.ndarray]:
    """The dataset's own ``score_answer`` of each extracted answer (0 when
    none is found); correct means full credit."""
    scores = np.array([
        self.train_dataset.score_answer(
            extract_answer(t, self.cfg.answer_rule), p)
        for t, p in zip(texts, problems)], np.float32)
    return scores, scores >= 1.0
