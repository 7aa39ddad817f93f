"""The bundled synthetic verifiable task: add k small numbers.

Prompt ``3+5+2=``; a correct response writes the chain of partial sums and
then the answer, ``8,10 Answer: 10``, so its length grows with k. Answers are
graded by an exact-answer rule.

The supervised warm-up data mixes correct traces with wrong ones (one partial
sum off, errors carried forward). ``length_gap`` sets how many tokens longer a
wrong trace is than a correct one (negative: shorter): the longer class opens
with ``|length_gap|`` scratch tokens ``~``. A policy sampled after the warm-up
therefore produces incorrect responses that are systematically longer (or
shorter) than its correct ones by about ``length_gap`` tokens, the quantity
the paper's analysis of aggregation turns on. ``min_terms``/``max_terms`` set
how much response length varies across problems.

The tokenizer is character level, built with the ``tokenizers`` library and
wrapped in ``PreTrainedTokenizerFast``, so the Hugging Face code path
(padding, decoding, ``save_pretrained``) is the one used. ``SyntheticTask``
puts all of it behind ``ba_jax.tasks.registry.Task``.
"""
from __future__ import annotations

import dataclasses
import re

import numpy as np
import tokenizers
from tokenizers import decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from ba_jax.config import schema

PAD, EOS, BOS, UNK = "<pad>", "<eos>", "<bos>", "<unk>"
SCRATCH = "~"
CHARACTERS = "0123456789+=, :~Answer"
_ANSWER_RE = re.compile(r"Answer:\s*(-?\d+)\s*$")


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer; pad id 0, eos id 1, bos id 2."""
    vocab = {tok: i for i, tok in enumerate([PAD, EOS, BOS, UNK])}
    for ch in dict.fromkeys(CHARACTERS):
        vocab.setdefault(ch, len(vocab))
    tok = tokenizers.Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(
        tokenizers.Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, eos_token=EOS, bos_token=BOS,
        unk_token=UNK, padding_side="left", clean_up_tokenization_spaces=False)


@dataclasses.dataclass(frozen=True)
class TaskConfig:
    min_terms: int = 2
    max_terms: int = 5
    max_value: int = 9
    length_gap: int = 6
    sft_correct_frac: float = 0.4

    def __post_init__(self):
        if not 2 <= self.min_terms <= self.max_terms:
            raise ValueError(
                f"task.min_terms={self.min_terms}, task.max_terms="
                f"{self.max_terms}: expected 2 <= min_terms <= max_terms")
        if self.max_value < 1:
            raise ValueError(f"task.max_value={self.max_value}: expected >= 1")
        if not 0.0 <= self.sft_correct_frac <= 1.0:
            raise ValueError(f"task.sft_correct_frac={self.sft_correct_frac}:"
                             " expected a fraction in [0, 1]")


@dataclasses.dataclass(frozen=True)
class Problem:
    numbers: tuple[int, ...]

    @property
    def answer(self) -> int:
        return sum(self.numbers)

    @property
    def prompt(self) -> str:
        return "+".join(map(str, self.numbers)) + "="


def _random_problem(rng: np.random.Generator, task: TaskConfig) -> Problem:
    k = int(rng.integers(task.min_terms, task.max_terms + 1))
    return Problem(tuple(int(x) for x in rng.integers(1, task.max_value + 1, k)))


def heldout_problems(task: TaskConfig, n: int, seed: int) -> list[Problem]:
    """n distinct problems for evaluation; training never draws them."""
    rng = np.random.default_rng([seed, 1])
    out: dict[Problem, None] = {}
    for _ in range(100 * n):
        if len(out) == n:
            break
        out.setdefault(_random_problem(rng, task))
    if len(out) < n:
        raise ValueError(f"eval.num_problems={n}: only {len(out)} distinct "
                         "problems exist for this task; lower it")
    return list(out)


def train_problems(task: TaskConfig, seed: int, start: int, n: int,
                   exclude: frozenset[Problem] = frozenset()) -> list[Problem]:
    """Problems ``start .. start+n-1`` of the training stream.

    Problem i depends only on (seed, i), so a resumed run continues the same
    stream from its saved position; held-out problems are redrawn.
    """
    out = []
    for i in range(start, start + n):
        rng = np.random.default_rng([seed, 2, i])
        p = _random_problem(rng, task)
        while p in exclude:
            p = _random_problem(rng, task)
        out.append(p)
    return out


def correct_response(p: Problem) -> str:
    partial = np.cumsum(p.numbers)[1:]
    return ",".join(map(str, partial)) + f" Answer: {p.answer}"


def wrong_response(p: Problem, rng: np.random.Generator) -> str:
    """One partial sum off by a small nonzero amount, carried to the answer."""
    partial = list(np.cumsum(p.numbers)[1:])
    j = int(rng.integers(len(partial)))
    deltas = [d for d in (-3, -2, -1, 1, 2, 3) if partial[j] + d >= 0]
    delta = int(rng.choice(deltas))
    partial = [s + delta if i >= j else s for i, s in enumerate(partial)]
    return ",".join(map(str, partial)) + f" Answer: {partial[-1]}"


def sft_response(p: Problem, rng: np.random.Generator,
                 task: TaskConfig) -> tuple[str, bool]:
    """A warm-up trace for p and whether it is correct."""
    correct = bool(rng.random() < task.sft_correct_frac)
    body = correct_response(p) if correct else wrong_response(p, rng)
    longer_is_wrong = task.length_gap > 0
    if task.length_gap and correct != longer_is_wrong:
        body = SCRATCH * abs(task.length_gap) + body
    return body, correct


def max_response_tokens(task: TaskConfig) -> int:
  """An upper bound on a warm-up response's tokens, EOS included."""
  worst = Problem((task.max_value,) * task.max_terms)
  # an error can add a digit to every partial sum and the answer
  return len(correct_response(worst)) + task.max_terms + abs(task.length_gap) + 1


def extract_answer(response: str) -> int | None:
    m = _ANSWER_RE.search(response.strip())
    return int(m.group(1)) if m else None


def grade(response: str, p: Problem) -> float:
    """Exact-answer rule: 1.0 iff the response ends with ``Answer: <sum>``."""
    return float(extract_answer(response) == p.answer)


class SyntheticTask:
    """The addition task behind ``ba_jax.tasks.registry.Task`` (``task.name``
    "synthetic_sum"): training and warm-up problems are drawn from the seed,
    held-out ones are never drawn for training."""

    name = "synthetic_sum"
    section = schema.SyntheticSumTask  # the task section's keys
    has_warmup = True

    def __init__(self, task_cfg, *, seed: int, tokenizer, max_prompt_len: int,
                 num_heldout: int, grader: str = "builtin"):
        self.check_grader(grader)
        self.cfg = self.config_from(task_cfg)
        self.seed, self.tokenizer, self.grader = seed, tokenizer, grader
        self.max_prompt_len = max_prompt_len
        self.heldout = heldout_problems(self.cfg, num_heldout, seed)
        self._exclude = frozenset(self.heldout)
        self.pad_id = tokenizer.pad_token_id
        self.eos_id = tokenizer.eos_token_id

    @staticmethod
    def check_grader(grader: str) -> None:
        if grader not in ("builtin", "rewards"):
            raise ValueError(
                f"task.grader={grader!r}: expected 'builtin' or 'rewards' "
                "(ba_jax.tasks.rewards.score_math, rule='answer')")

    @staticmethod
    def config_from(task_cfg):
        """The generator's settings from the config's ``task`` section."""
        return task_config(task_cfg)

    @classmethod
    def from_section(cls, task, eval, *, seed: int, tokenizer) -> "SyntheticTask":
        return cls(task, seed=seed, tokenizer=tokenizer,
                   max_prompt_len=task.max_prompt_len,
                   num_heldout=eval.num_problems, grader=task.grader)

    @staticmethod
    def build_tokenizer(task) -> PreTrainedTokenizerFast:
        del task  # one tokenizer for every variant
        return build_tokenizer()

    @staticmethod
    def max_warmup_response_tokens(task_cfg) -> int:
        return max_response_tokens(task_config(task_cfg))

    def problems(self, start: int, n: int, stream: int = 0) -> list[Problem]:
        """Training problems ``start .. start+n-1`` (stream 1: warm-up data)."""
        return train_problems(self.cfg, self.seed + 7919 * stream, start, n,
                              self._exclude)

    def warmup_examples(self, step: int, batch_size: int
                        ) -> tuple[list[Problem], list[str]]:
        """Warm-up batch ``step``: its own problem stream and traces."""
        problems = self.problems(step * batch_size, batch_size, stream=1)
        rng = np.random.default_rng([self.seed, 3, step])
        return problems, [self.warmup_response(p, rng) for p in problems]

    def warmup_response(self, problem: Problem,
                        rng: np.random.Generator) -> str:
        """One warm-up trace for ``problem`` (a subclass's own traces)."""
        return sft_response(problem, rng, self.cfg)[0]

    def encode_prompts(self, problems) -> tuple[np.ndarray, np.ndarray]:
        prompts = [p.prompt for p in problems]
        # Checked before padding: a longer prompt would make ragged rows.
        longest = max(prompts, key=len)
        if len(self.tokenizer(longest)["input_ids"]) > self.max_prompt_len:
            raise ValueError(f"prompt {longest!r} is longer than "
                             f"task.max_prompt_len={self.max_prompt_len}; "
                             "raise it")
        enc = self.tokenizer(prompts, padding="max_length",
                             max_length=self.max_prompt_len,
                             return_tensors="np")
        return (enc["input_ids"].astype(np.int32),
                enc["attention_mask"].astype(np.int32))

    def encode_responses(self, texts, max_len: int
                         ) -> tuple[np.ndarray, np.ndarray]:
        """Right-padded responses ending in EOS; (ids, mask) [n, max_len]."""
        ids = np.full((len(texts), max_len), self.pad_id, np.int32)
        mask = np.zeros((len(texts), max_len), np.int32)
        for i, text in enumerate(texts):
            toks = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            toks = toks + [self.eos_id]
            if len(toks) > max_len:
                raise ValueError(f"warm-up response of {len(toks)} tokens "
                                 f"exceeds rl.max_new_tokens={max_len}; "
                                 "raise it")
            ids[i, :len(toks)], mask[i, :len(toks)] = toks, 1
        return ids, mask

    def decode(self, tokens_NxT, mask_NxT) -> list[str]:
        return [self.tokenizer.decode(row[m.astype(bool)],
                                      skip_special_tokens=True)
                for row, m in zip(np.asarray(tokens_NxT),
                                  np.asarray(mask_NxT))]

    def grade(self, texts, problems) -> tuple[np.ndarray, np.ndarray]:
        """(rewards float32, correct bool) by the exact-answer rule."""
        if self.grader == "rewards":
            from ba_jax.tasks import rewards
            out = rewards.score_math(texts, [str(p.answer) for p in problems],
                                     rule="answer")
            return out.scores.astype(np.float32), out.correct.astype(bool)
        correct = np.array([grade(t, p) > 0 for t, p in zip(texts, problems)],
                           bool)
        return correct.astype(np.float32), correct


def task_config(task_cfg) -> TaskConfig:
    """The generator's fields of a config's ``task`` section."""
    return TaskConfig(**{f.name: getattr(task_cfg, f.name)
                         for f in dataclasses.fields(TaskConfig)})


class RuleTask(SyntheticTask):
    """A synthetic task graded by its own rule (``task.rule``) with its own
    warm-up traces: ``chains.ChainsTask``, ``drafts.DraftsTask``. A subclass
    sets ``name``, ``section`` and four functions of its module:
    ``config_from(task_cfg)``, ``response_bound(cfg)`` (the longest warm-up
    response, EOS included), ``trace(problem, rng, cfg) -> (text, correct)``
    and ``grade_one(text, problem, rule) -> float``. Prompts, problems,
    held-out split, encoding and decoding are the addition task's."""

    config_from = response_bound = trace = grade_one = None  # a subclass's

    def __init__(self, task_cfg, **kwargs):
        name = getattr(task_cfg, "name", self.name)
        if name != self.name:
            raise ValueError(f"task.name={name!r}: expected {self.name!r}")
        super().__init__(task_cfg, **kwargs)

    def check_grader(self, grader: str) -> None:
        if grader != "builtin":
            raise ValueError(
                f"task.grader={grader!r}: expected 'builtin' (task "
                f"{self.name!r} grades by task.rule, which checks more than "
                "the answer)")

    @classmethod
    def max_warmup_response_tokens(cls, task_cfg) -> int:
        return cls.response_bound(cls.config_from(task_cfg))

    def warmup_response(self, problem: Problem,
                        rng: np.random.Generator) -> str:
        return self.trace(problem, rng, self.cfg)[0]

    def grade(self, texts, problems) -> tuple[np.ndarray, np.ndarray]:
        """(rewards float32, correct bool) under ``task.rule``."""
        correct = np.array([self.grade_one(t, p, self.cfg.rule) > 0
                            for t, p in zip(texts, problems)], bool)
        return correct.astype(np.float32), correct
