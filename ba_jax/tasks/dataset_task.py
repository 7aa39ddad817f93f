"""A dataset of math problems behind ``ba_jax.tasks.registry.Task``.

For the paper's settings: DAPO-Math-17k or Polaris-53K read by
``ba_jax.tasks.data``, prompts formatted by ``data.format_prompt``, graded by
``ba_jax.tasks.rewards.score_math``. Training problem ``i`` comes from a per-epoch
permutation fixed by the seed, so the data position alone resumes the
stream. Held-out problems are the config's evaluation benchmarks.
"""
from __future__ import annotations

import numpy as np

from ba_jax.tasks import data as data_lib

LOADERS = ("dapo_math17k", "polaris")


def _load(task_cfg):
  if task_cfg.name == "dapo_math17k":
    return data_lib.load_dapo_math(task_cfg.path, dedup=task_cfg.dedup)
  if task_cfg.name == "polaris":
    return data_lib.load_polaris(task_cfg.path,
                                 min_difficulty=task_cfg.min_difficulty,
                                 max_difficulty=task_cfg.max_difficulty)
  raise ValueError(f"task.name={task_cfg.name!r}: expected one of "
                   f"{list(LOADERS)}")


class DatasetTask:
  """Prompts from a math dataset, held-out problems from benchmarks; no
  warm-up data. Registered as each of ``LOADERS``, with that loader's
  section (``schema.DapoMathTask``, ``schema.PolarisTask``)."""

  has_warmup = False

  def __init__(self, task_cfg, eval_cfg, *, seed: int, tokenizer,
               max_prompt_len: int):
    self.name = task_cfg.name
    self.cfg, self.seed, self.tokenizer = task_cfg, seed, tokenizer
    self.max_prompt_len = max_prompt_len
    tokenizer.padding_side = "left"
    self.pad_id = (tokenizer.pad_token_id if tokenizer.pad_token_id is not None
                   else tokenizer.eos_token_id)
    self.eos_id = tokenizer.eos_token_id
    self.heldout = self._load_heldout(eval_cfg)
    examples = self._load_examples()
    fits = [len(ids) <= max_prompt_len for ids in tokenizer(
        [self._format(e) for e in examples], add_special_tokens=False
    )["input_ids"]]
    self.examples = [e for e, ok in zip(examples, fits) if ok]
    self.dropped_long_prompts = len(examples) - len(self.examples)
    if not self.examples:
      raise ValueError(f"no training prompt of task.name={self.name!r} fits "
                       f"task.max_prompt_len={max_prompt_len} tokens")
    self._orders: dict[int, np.ndarray] = {}

  def _load_examples(self) -> list:
    """The training problems (before prompts too long are dropped)."""
    return _load(self.cfg)

  def _load_heldout(self, eval_cfg) -> list:
    """The held-out problems: the config's evaluation benchmarks."""
    heldout = []
    names = [b for b in eval_cfg.benchmarks.split(",") if b]
    for name in names:
      bench = data_lib.load_eval_set(name, eval_cfg.data_dir)
      n = eval_cfg.num_problems or len(bench)
      heldout.extend(bench[:n])
    return heldout

  @classmethod
  def from_section(cls, task, eval, *, seed: int, tokenizer) -> "DatasetTask":
    return cls(task, eval, seed=seed, tokenizer=tokenizer,
               max_prompt_len=task.max_prompt_len)

  @staticmethod
  def build_tokenizer(task):
    del task  # the policy's own (init_from) tokenizer
    return None

  @staticmethod
  def max_warmup_response_tokens(task_cfg) -> int:
    del task_cfg
    return 0

  def _format(self, example) -> str:
    return data_lib.format_prompt(example, self.cfg.template, self.tokenizer,
                                  chat_rule=self.cfg.rule)

  def _order(self, epoch: int) -> np.ndarray:
    if epoch not in self._orders:
      self._orders = {epoch: np.random.default_rng(
          [self.seed, epoch]).permutation(len(self.examples))}
    return self._orders[epoch]

  def problems(self, start: int, n: int):
    size = len(self.examples)
    return [self.examples[self._order(i // size)[i % size]]
            for i in range(start, start + n)]

  def encode_prompts(self, problems) -> tuple[np.ndarray, np.ndarray]:
    enc = self.tokenizer([self._format(p) for p in problems],
                         padding="max_length", max_length=self.max_prompt_len,
                         truncation=True, add_special_tokens=False,
                         return_tensors="np")
    return (enc["input_ids"].astype(np.int32),
            enc["attention_mask"].astype(np.int32))

  def warmup_examples(self, step: int, batch_size: int):
    raise ValueError(f"task.name={self.name!r} has no supervised warm-up "
                     "data; set sft.steps=0")

  def encode_responses(self, texts, max_len: int):
    """Warm-up responses only, which this task has none of."""
    raise ValueError(f"task.name={self.name!r} has no supervised warm-up "
                     "data to encode; set sft.steps=0")

  def decode(self, tokens_NxT, mask_NxT) -> list[str]:
    return [self.tokenizer.decode(row[m.astype(bool)], skip_special_tokens=True)
            for row, m in zip(np.asarray(tokens_NxT), np.asarray(mask_NxT))]

  def grade(self, texts, problems) -> tuple[np.ndarray, np.ndarray]:
    from ba_jax.tasks import rewards
    out = rewards.score_math(texts, [p.answer for p in problems],
                             rule=self.cfg.rule,
                             correct_score=self.cfg.correct_score,
                             incorrect_score=self.cfg.incorrect_score)
    return out.scores.astype(np.float32), out.correct.astype(bool)
