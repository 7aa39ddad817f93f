"""Tasks: where prompts come from and how responses are graded.

A task is any class with the ``Task`` protocol's methods, registered under
the ``task.name`` its configs use. The trainer, the warm-up and the dry run
only talk to a task through this interface, so a new task is a class plus
one ``register`` call, e.g.::

    class MyTask(synthetic.SyntheticTask):  # or any class with Task's methods
      name = "my_task"
      ...
    register(MyTask)

Problems are whatever the task likes (the task grades its own); training
problem ``i`` must depend only on the seed and ``i``, so a data position
alone resumes the stream.
"""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Protocol, Sequence

import numpy as np

from ba_jax.config import schema
from ba_jax.tasks import chains
from ba_jax.tasks import dataset_task
from ba_jax.tasks import drafts
from ba_jax.tasks import reasoning_gym_task
from ba_jax.tasks import synthetic


class Task(Protocol):
  """What the trainer asks of a task (``synthetic.SyntheticTask``,
  ``chains.ChainsTask``, ``drafts.DraftsTask``, ``dataset_task.DatasetTask`` and
  ``reasoning_gym_task.ReasoningGymTask`` are the bundled ones). A task may
  also have ``answer_found(texts) -> bool [n]``, whether its answer rule
  found an answer in each response; the trainer then logs the share of
  format failures (``format_fail_frac``). A task whose reward is a sum of
  terms may have ``grade_components(texts, problems) -> ({term: float32
  [n]}, correct bool [n])``, which rollouts then call instead of ``grade``
  (the reward is the terms' sum); the trainer logs each term's mean
  (``reward/<term>``) and puts the terms in its samples tables."""

  name: str  # the task.name configs use (the registry key)
  has_warmup: ClassVar[bool]  # whether warmup_examples has data
  heldout: Sequence[Any]  # held-out problems, evaluated before/after RL
  pad_id: int
  eos_id: int

  @classmethod
  def from_section(cls, task: Any, eval: Any, *, seed: int, tokenizer) -> "Task":
    """The task of a run config's typed ``task`` and ``eval`` sections
    (``ba_jax.config.schema``) and its ``seed``."""

  @staticmethod
  def build_tokenizer(task: Any) -> Any:
    """The task's own tokenizer, or None to use ``init_from``'s."""

  @staticmethod
  def max_warmup_response_tokens(task: Any) -> int:
    """An upper bound on a warm-up response's tokens, EOS included (0 when
    the task has no warm-up data)."""

  def problems(self, start: int, n: int) -> list:
    """Training problems ``start .. start+n-1`` (global indices)."""

  def warmup_examples(self, step: int, batch_size: int
                      ) -> tuple[list, list[str]]:
    """Supervised warm-up batch ``step``: (problems, response texts)."""

  def encode_prompts(self, problems) -> tuple[np.ndarray, np.ndarray]:
    """Left-padded prompts: int32 (ids, mask) [n, task.max_prompt_len]."""

  def encode_responses(self, texts, max_len: int
                       ) -> tuple[np.ndarray, np.ndarray]:
    """Right-padded responses ending in EOS: int32 (ids, mask) [n, max_len]."""

  def decode(self, tokens_NxT, mask_NxT) -> list[str]:
    """Response texts of sampled tokens (where the mask is 1)."""

  def grade(self, texts, problems) -> tuple[np.ndarray, np.ndarray]:
    """(rewards float32 [n], correct bool [n]) of responses to problems."""


_REGISTRY: dict[str, type] = {}


def register(task_class: type, *names: str, section: type | None = None) -> type:
  """Makes ``task_class`` the task of ``task.name`` ``task_class.name`` (or
  of each of ``names``), with ``section`` (default ``task_class.section``),
  the frozen dataclass of its config keys, as its schema
  (``ba_jax.config.schema.TASK_SECTIONS``); returns the class, so it also
  works as a decorator."""
  section = section or getattr(task_class, "section", None)
  if not dataclasses.is_dataclass(section):
    raise ValueError(f"{task_class.__name__}: a task needs its config section's "
                     "dataclass (a ``section`` class attribute or argument)")
  for name in names or (task_class.name,):
    if name in _REGISTRY and _REGISTRY[name] is not task_class:
      raise ValueError(f"task name {name!r} is already registered to "
                       f"{_REGISTRY[name].__name__}")
    _REGISTRY[name] = task_class
    schema.TASK_SECTIONS[name] = section
  return task_class


def names() -> list[str]:
  return sorted(_REGISTRY)


def task_class(name: str) -> type:
  """The class registered for ``task.name`` = ``name``."""
  if name not in _REGISTRY:
    raise ValueError(f"task.name={name!r}: expected one of {names()}")
  return _REGISTRY[name]


def make_tokenizer(task, init_from: str = ""):
  """The task's own tokenizer, else the one saved in the local Hugging Face
  directory ``init_from``."""
  tokenizer = task_class(task.name).build_tokenizer(task)
  if tokenizer is not None:
    return tokenizer
  if not init_from:
    raise ValueError(f"task.name={task.name!r} needs init_from, a "
                     "Hugging Face directory with the policy's tokenizer")
  from transformers import AutoTokenizer
  return AutoTokenizer.from_pretrained(init_from)


def make_task(task, eval, *, seed: int, tokenizer) -> Task:
  """The task named by ``task.name``, from the config's typed ``task`` and
  ``eval`` sections."""
  return task_class(task.name).from_section(task, eval, seed=seed,
                                            tokenizer=tokenizer)


register(synthetic.SyntheticTask)
register(chains.ChainsTask)
register(drafts.DraftsTask)
register(dataset_task.DatasetTask, "dapo_math17k", section=schema.DapoMathTask)
register(dataset_task.DatasetTask, "polaris", section=schema.PolarisTask)
register(reasoning_gym_task.ReasoningGymTask, reasoning_gym_task.NAME)
