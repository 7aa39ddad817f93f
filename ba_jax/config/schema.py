"""Every key of a run config, once: its type, default, range or choices, one
line of documentation, and whether a resumed run may change it.

Users keep writing ml_collections config files and ``--config.x=y``
overrides; ``parse(config)`` turns that ConfigDict into a ``RunConfig`` of
frozen dataclasses once, at the top of a run, and each lower module receives
only its own section. An unknown key, a value of the wrong type or out of
range is a ``ValueError`` naming the dotted key, the value and what was
expected. ``defaults(section)`` gives the defaults as plain dicts (what
``configs/common.py`` starts from), ``free_keys()`` what a resume may change,
and ``help_text()`` the reference that ``python -m ba_jax.train
--helpconfig`` prints. The ``task`` section's keys depend on ``task.name``
(``TASK_SECTIONS``).
"""
from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any, Callable


@dataclasses.dataclass(frozen=True)
class Check:
  """A predicate on a value and the words for what it expects."""
  ok: Callable[[Any], bool]
  expected: str


def at_least(lo, note: str = "") -> Check:
  return Check(lambda x: _finite(x) and x >= lo,
               f">= {lo}" + (f" ({note})" if note else ""))


def above(lo, note: str = "") -> Check:
  return Check(lambda x: _finite(x) and x > lo,
               f"> {lo}" + (f" ({note})" if note else ""))


def between(lo, hi, *, hi_open: bool = False) -> Check:
  return Check(lambda x: _finite(x) and lo <= x and (x < hi if hi_open else x <= hi),
               f"in [{lo}, {hi}{')' if hi_open else ']'}")


FINITE = Check(lambda x: _finite(x), "finite")


def _finite(x) -> bool:
  return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def key(default, doc: str, *, check: Check | None = None,
        choices: tuple | None = None, free: bool = False):
  """One config key: ``default``, one line of ``doc``, an optional range
  ``check`` or ``choices``; ``free``: a resumed run may change it (it says
  how the run executes, not what it computes)."""
  kw = (dict(default_factory=lambda: dict(default)) if isinstance(default, dict)
        else dict(default=default))
  return dataclasses.field(**kw, metadata=dict(
      doc=doc, check=check, choices=choices, free=free))


# Logical axis name -> mesh axes (None: replicated). Every config uses this
# table unless it sets ``sharding_rules``; a new logical name is added here.
DEFAULT_SHARDING_RULES: tuple = (
    ("batch", ("data", "fsdp")),
    ("activation_batch", ("data", "fsdp")),  # rows of the residual stream
    ("length", None),  # sequence positions; a mesh axis here shards the sequence
    ("activation_embed", None),  # hidden features of the residual stream
    ("layers", None),  # the stacked decoder layers' axis (scanned, never split)
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("norm", None),
)
# Choices that the modules owning them (aggregation, losses, model,
# attention, reasoning_gym_task) take from here.
AGGREGATIONS = ("token", "sequence", "dr_grpo", "balanced")
BA_DENOMINATORS = ("group", "signed")
BA_SCOPES = ("group", "batch")
KL_TYPES = ("k1", "k2", "k3")
# The policy objective's per-token term and the sampler-trainer correction
# (ba_jax.loss.objectives; docs/aggregation.md).
SURROGATES = ("ppo_clip", "gspo", "gspo_token", "gmpo", "cispo", "sapo", "luspo", "gpg",
              "dro", "dppo_tv", "dppo_kl", "kl_cov", "clip_cov")
CORRECTIONS = ("none", "tis_token", "tis_sequence", "mis_token", "mis_sequence", "icepop")
OLD_LOGP_SOURCES = ("sampler", "recompute")
MODEL_TYPES = ("qwen2", "qwen3", "llama")
ANSWER_RULES = ("tags", "last_number", "last_line", "full")
REMAT_POLICIES = ("none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable",
                  "nothing_saveable", "everything_saveable")
ATTENTION_IMPLS = ("full", "blockwise", "xla", "cudnn", "splash", "auto")


@dataclasses.dataclass(frozen=True)
class Sft:
  """Supervised warm-up before RL (tasks with warm-up data)."""
  steps: int = key(0, "optimizer steps (0 skips the warm-up)", check=at_least(0))
  batch_size: int = key(64, "sequences per step", check=at_least(1))
  learning_rate: float = key(3e-3, "peak; linear warm-up then cosine to 10%", check=above(0))
  warmup_steps: int = key(20, "linear warm-up steps", check=at_least(0))


@dataclasses.dataclass(frozen=True)
class Rl:
  """GRPO: sampling, rewards shaping and the update's batch structure."""
  steps: int = key(60, "train steps (each: sample, reward, PPO epochs)", check=at_least(0))
  prompts_per_step: int = key(16, "B; the global batch is B x group_size rows", check=at_least(1))
  group_size: int = key(8, "G responses per prompt", check=at_least(
      2, "with one response per prompt every group advantage is 0"))
  max_new_tokens: int = key(32, "T, the response budget (truncated after)", check=at_least(1))
  temperature: float = key(1.0, "sampling temperature; the loss scores at it too", check=above(0))
  top_p: float = key(1.0, "nucleus sampling (1.0 = off)", check=Check(
      lambda x: _finite(x) and 0 < x <= 1, "in (0, 1]"))
  top_k: int = key(0, "top-k sampling (0 = off)", check=at_least(0))
  max_slots: int = key(0, "decode slots per process (0: every row at once; fewer: the "
                       "continuous-batching engine)", check=at_least(0))
  kv_cache_gib: float = key(0.0, "KV-cache budget per device, GiB (0: unused); the engine "
                            "runs the slots it holds", check=at_least(0))
  prefill_chunk: int = key(0, "the engine prefills prompts this many tokens at a time "
                           "(0: whole)", check=at_least(0), free=True)
  cache_phases: int = key(0, "cache lengths a decode loop runs through (0: the backend's "
                          "default); same tokens", check=at_least(0), free=True)
  prompt_pad_multiple: int = key(0, "the update's prompts: padded to the batch's longest, "
                                 "rounded up to a multiple of this (0: to task.max_prompt_len); "
                                 "a program per width met; same sums", check=at_least(0),
                                 free=True)
  share_prompt: bool = key(False, "the update and scoring compute each group's prompt once, "
                           "packed with its responses; same sums; responses' attention is one "
                           "[T, P+T] score matrix per row", free=True)
  ppo_epochs: int = key(1, "passes over the batch per step", check=at_least(1))
  num_minibatches: int = key(2, "optimizer updates per epoch (whole groups each)",
                             check=at_least(1))
  num_microbatches: int = key(1, "gradient accumulation inside a mini-batch", check=at_least(1))
  old_logp: str = key("sampler", "the surrogate's old log-probs: the sampler's, or recomputed "
                      "by the trainer at the step's start (one more forward pass, no backward); "
                      "loss.correction needs recompute", choices=OLD_LOGP_SOURCES)
  advantage_std: str = key("group", "advantage normalisation (none: Dr. GRPO)",
                           choices=("group", "batch", "none"))
  dynamic_sampling: bool = key(False, "DAPO: drop groups whose rewards are all equal")
  max_sampling_rounds: int = key(3, "dynamic sampling: extra rounds to refill", check=at_least(0))
  oversample: float = key(1.0, "dynamic sampling: prompts per round / prompts_per_step",
                          check=at_least(1))
  overlong: str = key("none", "truncated responses: kept, masked, or DAPO's soft penalty",
                      choices=("none", "mask", "soft"))
  overlong_buffer: int = key(8, "soft: the penalty ramps over the last this many tokens",
                             check=at_least(0))
  overlong_penalty: float = key(1.0, "soft: the penalty at the budget", check=at_least(0))
  max_nonfinite: int = key(5, "this many non-finite updates in a row stop the run",
                           check=at_least(1))


@dataclasses.dataclass(frozen=True)
class Loss:
  """The policy loss (``ba_jax.loss.losses.policy_loss``); static in the step."""
  aggregation: str = key("balanced", "how per-token terms become one loss", choices=AGGREGATIONS)
  surrogate: str = key("ppo_clip", "the per-token (or per-sequence) policy term; "
                       "docs/aggregation.md", choices=SURROGATES)
  correction: str = key("none", "sampler-trainer mismatch: truncated (tis) or masked (mis) "
                        "importance weights exp(old - sampler), per token or sequence; "
                        "icepop", choices=CORRECTIONS)
  correction_cap: float = key(2.0, "tis/mis: the weight's upper bound C", check=above(0))
  correction_floor: float | None = key(None, "tis/mis: the weight's lower bound (None: none)",
                                       check=above(0))
  icepop_low: float = key(0.5, "icepop: tokens whose weight is below this are masked",
                          check=above(0))
  icepop_high: float = key(5.0, "icepop: tokens whose weight is above this are masked",
                           check=above(0))
  cispo_cap: float = key(5.0, "cispo: the stop-gradient IS weight is min(ratio, this) "
                         "(ScaleRL's eps_max; MiniMax's 1 + eps_high)", check=above(0))
  sapo_tau_pos: float = key(1.0, "sapo: the soft gate's temperature for A > 0", check=above(0))
  sapo_tau_neg: float = key(1.05, "sapo: the soft gate's temperature for A <= 0",
                            check=above(0))
  dro_beta: float | None = key(None, "dro: the weight of its penalty beta (logp - old)^2 / 2 "
                               "(None: unset; dro needs it)", check=above(0))
  dppo_tv_low: float = key(0.15, "dppo_tv: for A < 0, tokens whose probability fell by more "
                           "than this are masked", check=between(0, 1))
  dppo_tv_high: float = key(0.15, "dppo_tv: for A > 0, tokens whose probability rose by more "
                            "than this are masked", check=between(0, 1))
  dppo_kl_low: float = key(0.05, "dppo_kl: for A < 0, tokens whose probability fell with a "
                           "binary KL above this (nats) are masked", check=at_least(0))
  dppo_kl_high: float = key(0.05, "dppo_kl: for A > 0, tokens whose probability rose with a "
                            "binary KL above this (nats) are masked", check=at_least(0))
  dppo_cap: float = key(20.0, "dppo_tv/dppo_kl: the stop-gradient IS weight is min(ratio, this)",
                        check=above(0))
  kl_cov_ratio: float = key(2e-4, "kl_cov: the fraction of a loss call's tokens (largest "
                            "covariance of A and logp) that get the penalty",
                            check=Check(lambda x: _finite(x) and 0 < x <= 1, "in (0, 1]"))
  kl_cov_coef: float = key(0.1, "kl_cov: the penalty's weight on |logp - old|", check=at_least(0))
  clip_cov_ratio: float = key(2e-4, "clip_cov: the fraction of a loss call's tokens whose "
                              "term is zeroed, drawn at random among its candidates "
                              "(all of them when fewer)",
                              check=Check(lambda x: _finite(x) and 0 < x <= 1, "in (0, 1]"))
  clip_cov_lb: float = key(1.0, "clip_cov: the candidates are the tokens PPO did not clip "
                           "whose covariance of A and logp (as kl_cov's) lies above this "
                           "and below clip_cov_ub", check=FINITE)
  clip_cov_ub: float = key(5.0, "clip_cov: the candidates' covariance upper bound "
                           "(> clip_cov_lb)", check=FINITE)
  eps_low: float = key(0.2, "clip range below 1 (gmpo: of the log-ratio)",
                       check=between(0, 1, hi_open=True))
  eps_high: float = key(0.28, "clip range above 1 (clip-higher when > eps_low; gmpo: of the "
                        "log-ratio)", check=at_least(0))
  dual_clip: float | None = key(None, "c > 1 caps the ratio for A < 0 (None: off; ppo_clip only)",
                                check=above(1))
  kl_coef: float = key(0.0, "> 0 loads a frozen reference policy", check=at_least(0))
  kl_type: str = key("k3", "KL estimator", choices=KL_TYPES)
  entropy_coef: float = key(0.0, "entropy bonus", check=FINITE)
  reg_aggregation: str = key("token", "mode aggregating the KL and entropy terms",
                             choices=AGGREGATIONS)
  max_response_len: int | None = key(None, "dr_grpo's constant (None: rl.max_new_tokens)",
                                     check=at_least(1))
  ba_denominator: str = key("group", "balanced: normalise by the group or the signed subset",
                            choices=BA_DENOMINATORS)
  ba_scope: str = key("group", "balanced: subsets per group or over the batch",
                      choices=BA_SCOPES)


@dataclasses.dataclass(frozen=True)
class Optim:
  """optax AdamW for RL (``ba_jax.update.train_step.make_optimizer``)."""
  learning_rate: float = key(1e-4, "peak", check=above(0))
  warmup_steps: int = key(2, "linear warm-up from 0, in optimizer updates", check=at_least(0))
  schedule: str = key("constant", "after warm-up: constant, or cosine to end_lr_frac x peak",
                      choices=("constant", "cosine"))
  end_lr_frac: float = key(0.1, "cosine only", check=between(0, 1))
  weight_decay: float = key(0.0, "decoupled weight decay", check=at_least(0))
  b1: float = key(0.9, "Adam beta1", check=between(0, 1, hi_open=True))
  b2: float = key(0.999, "Adam beta2", check=between(0, 1, hi_open=True))
  eps: float = key(1e-8, "Adam epsilon", check=above(0))
  grad_clip: float = key(1.0, "clip by global norm (0: off)", check=at_least(0))


@dataclasses.dataclass(frozen=True)
class Mesh:
  """One device mesh; -1 takes the remaining devices."""
  data: int = key(-1, "data-parallel axis", check=at_least(-1), free=True)
  fsdp: int = key(1, "parameter-sharded data axis", check=at_least(-1), free=True)
  tensor: int = key(1, "tensor-parallel axis", check=at_least(-1), free=True)


@dataclasses.dataclass(frozen=True)
class Checkpoint:
  """Orbax checkpoints under the workdir."""
  every: int = key(30, "save every this many RL steps and at the end (0: the end only)",
                   check=at_least(0), free=True)
  keep: int = key(2, "checkpoints kept", check=at_least(1), free=True)
  async_save: bool = key(True, "save in the background", free=True)


@dataclasses.dataclass(frozen=True)
class Eval:
  """Held-out evaluation before, during and after RL."""
  num_problems: int = key(128, "held-out problems (per benchmark; 0: all)", check=at_least(0))
  samples_per_problem: int = key(4, "sampled accuracy: responses per problem", check=at_least(1))
  temperature: float = key(1.0, "sampled accuracy's temperature (greedy is also reported)",
                           check=at_least(0))
  every: int = key(0, "evaluate every this many RL steps (0: before and after only)",
                   check=at_least(0), free=True)
  benchmarks: str = key("", "dataset tasks: comma-separated benchmark names")
  data_dir: str = key("", "dataset tasks: the folder of <benchmark>.jsonl files")


LOG_BACKENDS = ("tensorboard", "wandb")


def _backend_list(value) -> bool:
  names = [n.strip() for n in value.split(",") if n.strip()]
  return all(n in LOG_BACKENDS for n in names) and len(set(names)) == len(names)


@dataclasses.dataclass(frozen=True)
class Log:
  """Where metrics go (ba_jax.run.tracking; the workdir's jsonl files always)."""
  backends: str = key("tensorboard", "besides the workdir's jsonl files (always written): "
                      "comma-separated tensorboard, wandb ('': jsonl only)",
                      check=Check(lambda x: isinstance(x, str) and _backend_list(x),
                                  "comma-separated names among " + ", ".join(LOG_BACKENDS)),
                      free=True)
  progress_bar: bool = key(True, "a progress bar (off for pod logs: one line per step)",
                           free=True)
  samples_every: int = key(10, "every this many RL steps, a table of sampled completions "
                           "to samples.jsonl and W&B (0: never)", check=at_least(0),
                           free=True)
  samples_groups: int = key(2, "groups (a prompt's G responses) in each samples table",
                            check=at_least(1), free=True)
  wandb_project: str = key("ba_jax", "W&B project", free=True)
  wandb_entity: str = key("", "W&B entity ('': the account's default)", free=True)
  wandb_mode: str = key("auto", "W&B: online, offline (sync later), or auto: WANDB_MODE "
                        "if set, else online with an API key and offline without",
                        choices=("auto", "online", "offline"), free=True)


@dataclasses.dataclass(frozen=True)
class Lora:
  """LoRA adapters through qwix (``ba_jax.policy.lora``); rank 0 trains every parameter."""
  rank: int = key(0, "adapter rank (0: no adapters, full-parameter training)", check=at_least(0))
  alpha: float = key(16.0, "the adapters' output is scaled by alpha / rank", check=above(0))
  dropout: float = key(0.0, "dropout on the adapters' input", check=Check(
      lambda x: x == 0, "0.0: qwix would apply it in every forward, sampling and old log-probs "
      "included, so the PPO ratio's two log-probs would differ"))
  module_path: str = key(".*", "regex (full match) over a layer's modules, self_attn (q/k/v/o) "
                         "and mlp (gate/up/down): the projections that get adapters")


@dataclasses.dataclass(frozen=True)
class Model:
  """The policy (ModelConfig); with init_from set, only the non-architecture keys apply."""
  model_type: str = key("qwen3", "architecture family", choices=MODEL_TYPES)
  vocab_size: int = key(32, "embedding rows (>= the tokenizer's size)", check=at_least(1))
  hidden_size: int = key(64, "residual width", check=at_least(1))
  intermediate_size: int = key(192, "MLP width", check=at_least(1))
  num_layers: int = key(2, "decoder layers", check=at_least(1))
  num_heads: int = key(4, "query heads", check=at_least(1))
  num_kv_heads: int = key(2, "key/value heads (divides num_heads)", check=at_least(1))
  head_dim: int = key(16, "features per head", check=at_least(1))
  rope_theta: float = key(10000.0, "RoPE base", check=above(0))
  rope_scaling: tuple | None = key(None, "RoPE scaling ((key, value), ...), as in config.json")
  rms_norm_eps: float = key(1e-6, "RMSNorm epsilon", check=above(0))
  tie_word_embeddings: bool = key(False, "the LM head is the embedding")
  attention_bias: bool = key(False, "q/k/v projection bias (Qwen2)")
  qk_norm: bool = key(False, "RMSNorm on queries and keys (Qwen3)")
  max_position_embeddings: int = key(32768, "longest sequence", check=at_least(1))
  bos_token_id: int | None = key(None, "BOS id (None: the tokenizer's)")
  eos_token_id: int | tuple | None = key(None, "EOS id(s) (None: the tokenizer's)")
  dtype: str = key("float32", "compute dtype (float32, bfloat16, float16)")
  param_dtype: str = key("float32", "parameters and optimizer moments")
  remat: str = key("none", "what each scanned layer's backward keeps (full: recompute)",
                   choices=REMAT_POLICIES, free=True)
  attention_impl: str = key("full", "uncached attention kernel (auto: splash on TPU, cuDNN on "
                            "GPU, blockwise on CPU)", choices=ATTENTION_IMPLS)
  attention_block: int = key(512, "blockwise attention's tile, tokens", check=at_least(1))
  logprob_chunk: int = key(512, "tokens per LM-head chunk when scoring (never [rows, L, vocab])",
                           check=at_least(1))
  scan_unroll: int = key(0, "layers per layer-scan iteration (0: every layer on CPU, 1 on "
                         "accelerators)", check=at_least(0))
  lora: Lora = dataclasses.field(default_factory=Lora)


ARCHITECTURE_KEYS = (
    "model_type", "vocab_size", "hidden_size", "intermediate_size",
    "num_layers", "num_heads", "num_kv_heads", "head_dim", "rope_theta",
    "rope_scaling", "rms_norm_eps", "tie_word_embeddings", "attention_bias",
    "qk_norm", "max_position_embeddings", "bos_token_id", "eos_token_id")


# --- task sections, one per task.name --------------------------------------

@dataclasses.dataclass(frozen=True)
class SyntheticSumTask:
  """The bundled addition task (``ba_jax.tasks.synthetic``)."""
  name: str = key("synthetic_sum", "the task (a name in ba_jax.tasks.registry)")
  min_terms: int = key(2, "fewest numbers to add", check=at_least(2))
  max_terms: int = key(4, "most numbers to add (the response length grows with it)",
                       check=at_least(2))
  max_value: int = key(9, "each number is drawn from 1..max_value", check=at_least(1))
  length_gap: int = key(6, "warm-up: wrong minus right response length, tokens")
  sft_correct_frac: float = key(0.5, "share of correct traces in the warm-up data",
                                check=between(0, 1))
  grader: str = key("rewards", "rewards: ba_jax.tasks.rewards.score_math; builtin: the "
                    "same rule without it", choices=("rewards", "builtin"))
  max_prompt_len: int = key(16, "prompt tokens, padded (static shape)", check=at_least(1))


@dataclasses.dataclass(frozen=True)
class ChainsTask:
  """The length-controlled chains task (``ba_jax.tasks.chains``)."""
  name: str = key("synthetic_chains", "the task (a name in ba_jax.tasks.registry)")
  min_terms: int = key(2, "fewest numbers in the prompt", check=at_least(2))
  max_terms: int = key(3, "most numbers in the prompt", check=at_least(2))
  max_value: int = key(9, "numbers are drawn from 1..max_value", check=between(1, 9))
  chain_counts: str = key("1,2,4,8", "chain counts the warm-up draws from, comma separated")
  rule: str = key("answer", "answer | min_count:k | max_count:k | min_chains:k | "
                  "max_chains:k (the verifier)")
  sft_correct_frac: float = key(0.5, "error-free warm-up traces", check=between(0, 1))
  grader: str = key("builtin", "the chain rules are this task's own", choices=("builtin",))
  max_prompt_len: int = key(8, "prompt tokens, padded (static shape)", check=at_least(1))


DRAFTS_RULE = Check(
    lambda x: isinstance(x, str) and (x == "answer" or (
        x.partition(":")[0] in ("min_drafts", "max_drafts")
        and x.partition(":")[2].isdigit() and int(x.partition(":")[2]) >= 1)),
    "'answer', 'min_drafts:k' or 'max_drafts:k' with an integer k >= 1")


@dataclasses.dataclass(frozen=True)
class DraftsTask:
  """The drafts task, whose length is chosen at every draft (``ba_jax.tasks.drafts``)."""
  name: str = key("synthetic_drafts", "the task (a name in ba_jax.tasks.registry)")
  min_terms: int = key(2, "fewest numbers in the prompt", check=at_least(2))
  max_terms: int = key(3, "most numbers in the prompt", check=at_least(2))
  max_value: int = key(5, "numbers are drawn from 1..max_value", check=between(1, 9))
  scratch: str = key("digits", "checks after the answer draft: free numbers, or the running "
                     "sums from their start", choices=("digits", "sums"))
  max_offset: int = key(9, "a check starts at a digit drawn from 1..max_offset",
                        check=between(1, 9))
  continue_prob: float = key(0.6, "warm-up: after each draft, another one with this "
                             "probability", check=between(0, 1, hi_open=True))
  max_drafts: int = key(6, "most drafts in a warm-up trace (the answer and the checks)",
                        check=at_least(1))
  rule: str = key("answer", "answer | min_drafts:k | max_drafts:k (the verifier)",
                  check=DRAFTS_RULE)
  sft_correct_frac: float = key(0.5, "warm-up traces whose answer draft is right",
                                check=between(0, 1))
  grader: str = key("builtin", "the draft rules are this task's own", choices=("builtin",))
  max_prompt_len: int = key(8, "prompt tokens, padded (static shape)", check=at_least(1))


@dataclasses.dataclass(frozen=True)
class MathDatasetTask:
  """Shared keys of the math dataset tasks (``ba_jax.tasks.dataset_task``)."""
  name: str = key("", "the dataset's loader")
  path: str = key("", "local path (or Hugging Face cache name) of the data")
  template: str = key("answer", "prompt template (answer: 'Answer: ...'; boxed: \\boxed{})",
                      choices=("answer", "boxed"))
  rule: str = key("answer", "how the answer is extracted", choices=("answer", "boxed"))
  grader: str = key("rewards", "ba_jax.tasks.rewards.score_math (math-verify)",
                    choices=("rewards",))
  correct_score: float = key(1.0, "reward of a correct response", check=FINITE)
  incorrect_score: float = key(-1.0, "reward of a wrong or unparsable one", check=FINITE)
  max_prompt_len: int = key(2048, "prompt tokens, left-padded (static shape)",
                            check=at_least(1))


@dataclasses.dataclass(frozen=True)
class DapoMathTask(MathDatasetTask):
  """DAPO-Math-17k in verl's layout."""
  name: str = key("dapo_math17k", "the dataset's loader")
  dedup: bool = key(True, "keep the first of repeated prompts")


@dataclasses.dataclass(frozen=True)
class PolarisTask(MathDatasetTask):
  """Polaris-53K (problem, answer, difficulty)."""
  name: str = key("polaris", "the dataset's loader")
  min_difficulty: float | None = key(None, "keep rows at or above (None: no bound)",
                                     check=FINITE)
  max_difficulty: float | None = key(None, "keep rows at or below (None: no bound)",
                                     check=FINITE)


@dataclasses.dataclass(frozen=True)
class ReasoningGymTask:
  """reasoning-gym's procedural tasks (``ba_jax.tasks.reasoning_gym_task``)."""
  name: str = key("reasoning_gym", "the task (a name in ba_jax.tasks.registry)")
  datasets: str = key("basic_arithmetic", "a reasoning-gym dataset, or a mix 'a:2,b:1'")
  dataset_config: dict = key({"basic_arithmetic": {}}, "difficulty settings per dataset: "
                             "{name: {key: value}} (the dataset's own config fields)")
  train_seed: int = key(1, "training problems' generator seed", check=at_least(0))
  heldout_seed: int = key(2, "held-out problems' seed (eval.num_problems of them)",
                          check=at_least(0))
  train_size: int = key(4096, "training pool; reshuffled each epoch", check=at_least(1))
  system_prompt: str = key("default", "'' (none), a key of reasoning-gym's SYSTEM_PROMPTS, "
                           "or the text")
  instruction: str = key("", "appended to every question (after a space)")
  chat_template: bool = key(True, "wrap the prompt in the tokenizer's chat template")
  answer_rule: str = key("tags", "where the answer is in a response",
                         choices=ANSWER_RULES)
  max_prompt_len: int = key(256, "prompt tokens, left-padded (static shape)",
                            check=at_least(1))


XLA_CPU_COMPILE = ("default", "fast")  # ba_jax.policy.compiling.CPU_OPTIONS


TASK_SECTIONS: dict[str, type] = {
    cls().name: cls for cls in (SyntheticSumTask, ChainsTask, DraftsTask,
                                DapoMathTask, PolarisTask, ReasoningGymTask)}


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """A whole run."""
  seed: int = key(0, "parameters, data stream, sampling and clip_cov's draws all derive "
                  "from it",
                  check=at_least(0))
  init_from: str = key("", "a Hugging Face directory to start from ('': a random model "
                       "from the model section)")
  stop_after_steps: int = key(0, "> 0: stop (save and exit) after this many steps",
                              check=at_least(0), free=True)
  sharding_rules: tuple = key(DEFAULT_SHARDING_RULES, "logical axis name -> mesh axes",
                              free=True)
  xla_cpu_compile: str = key("default", "XLA:CPU compile options ('fast': about half the compile "
                             "time for tiny models, more for 100M+; see ba_jax.policy.compiling)",
                             choices=XLA_CPU_COMPILE, free=True)
  compilation_cache_dir: str = key("", "JAX's persistent compilation cache: a later process that "
                                   "compiles the same programs loads them from this directory "
                                   "('': off; see ba_jax.policy.compiling.use_cache)", free=True)
  model: Model = dataclasses.field(default_factory=Model)
  task: Any = dataclasses.field(default_factory=SyntheticSumTask)
  sft: Sft = dataclasses.field(default_factory=Sft)
  rl: Rl = dataclasses.field(default_factory=Rl)
  loss: Loss = dataclasses.field(default_factory=Loss)
  optim: Optim = dataclasses.field(default_factory=Optim)
  mesh: Mesh = dataclasses.field(default_factory=Mesh)
  checkpoint: Checkpoint = dataclasses.field(default_factory=Checkpoint)
  eval: Eval = dataclasses.field(default_factory=Eval)
  log: Log = dataclasses.field(default_factory=Log)


# Keys a config no longer has -> what replaced them. A config setting one
# is an error that says so; a saved run's config.json may still hold one
# (``drop_retired``).
RETIRED = {"log.tensorboard": "log.backends (list 'tensorboard' there, or '' for none)"}


SECTIONS = {f.name: f.default_factory for f in dataclasses.fields(RunConfig)
            if f.default_factory is not dataclasses.MISSING and f.name != "task"}


# --- reading a config -------------------------------------------------------

def _plain(value):
  """ConfigDict/FrozenConfigDict/list -> dict/tuple, recursively."""
  if hasattr(value, "to_dict"):
    value = value.to_dict()
  if isinstance(value, dict):
    return {k: _plain(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return tuple(_plain(v) for v in value)
  return value


def _allowed(hint) -> tuple:
  """The plain types a type hint admits (``float`` admits ints)."""
  if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
    return tuple(t for arg in typing.get_args(hint) for t in _allowed(arg))
  if hint is type(None):
    return (type(None),)
  if hint is Any:
    return (object,)
  origin = typing.get_origin(hint) or hint
  return (origin,)


def _coerce(name: str, value, hint):
  allowed = _allowed(hint)
  if value is None and type(None) in allowed:
    return None
  if isinstance(value, bool) and bool not in allowed:
    pass  # a bool is an int to Python, never to a config
  elif float in allowed and isinstance(value, int) and not isinstance(value, bool):
    return value if int in allowed else float(value)
  elif tuple in allowed and isinstance(value, (list, tuple)):
    return tuple(value)
  elif any(isinstance(value, t) for t in allowed if t is not object) or object in allowed:
    return value
  names = " or ".join("None" if t is type(None) else t.__name__ for t in allowed)
  raise ValueError(f"{name}={value!r}: expected {names}")


def _section(cls, values: dict, prefix: str):
  hints = typing.get_type_hints(cls)
  fields = {f.name: f for f in dataclasses.fields(cls)}
  unknown = sorted(set(values) - set(fields))
  retired = [prefix + k for k in unknown if prefix + k in RETIRED]
  if retired:
    raise ValueError(f"{retired[0]}: no longer a key; use {RETIRED[retired[0]]}")
  if unknown:
    raise ValueError(f"{prefix}{unknown[0]}: unknown key (a typo?); the "
                     f"{prefix.rstrip('.') or 'top'} section's keys are "
                     f"{sorted(fields)}")
  out = {}
  for name, f in fields.items():
    if name not in values:
      continue
    dotted = prefix + name
    if dataclasses.is_dataclass(hints[name]):  # a nested section, e.g. model.lora
      if not isinstance(values[name], dict):
        raise ValueError(f"{dotted}={values[name]!r}: expected a section (keys "
                         f"{[g.name for g in dataclasses.fields(hints[name])]})")
      out[name] = _section(hints[name], values[name], dotted + ".")
      continue
    value = _coerce(dotted, values[name], hints[name])
    if value is not None:
      choices, check = f.metadata.get("choices"), f.metadata.get("check")
      raw = values[name]  # errors show the value as the user wrote it
      if choices and value not in choices:
        raise ValueError(f"{dotted}={raw!r}: expected one of {list(choices)}")
      if check is not None and not check.ok(value):
        raise ValueError(f"{dotted}={raw!r}: expected {check.expected}")
    out[name] = value
  return cls(**out)


def _section_class(section: str) -> type:
  """The dataclass of a dotted section (``""`` the top level, ``"model.lora"``
  a nested one)."""
  head, *nested = section.split(".") if section else [""]
  cls = SECTIONS[head] if head else RunConfig
  for part in nested:
    cls = typing.get_type_hints(cls)[part]
  return cls


def check(dotted: str, value):
  """``value`` checked (and coerced) as the schema's key ``dotted`` (e.g.
  ``"rl.group_size"``); the typed configs of lower modules check their
  fields with it."""
  section, _, name = dotted.rpartition(".")
  cls = _section_class(section)
  return getattr(_section(cls, {name: value}, f"{section}." if section else ""), name)


def default(dotted: str):
  """The default of the schema's key ``dotted`` (e.g. ``"loss.cispo_cap"``),
  for the typed configs and functions of lower modules that take the key
  as an option with the run config's default."""
  section, _, name = dotted.rpartition(".")
  cls = _section_class(section)
  for f in dataclasses.fields(cls):
    if f.name == name:
      return _default(f)
  raise KeyError(f"{dotted!r} is not a key of the run config")


def task_section(values) -> Any:
  """The typed ``task`` section for its ``name``."""
  values = _plain(values)
  name = values.get("name")
  if name not in TASK_SECTIONS:
    raise ValueError(f"task.name={name!r}: expected one of {sorted(TASK_SECTIONS)}")
  return _section(TASK_SECTIONS[name], values, "task.")


def drop_retired(values: dict) -> dict:
  """A plain config dict without the ``RETIRED`` keys (a saved run's
  config.json from before they were replaced; they only said how it ran)."""
  out = dict(values)
  for dotted in RETIRED:
    section, _, name = dotted.rpartition(".")
    if isinstance(out.get(section), dict) and name in out[section]:
      out[section] = {k: v for k, v in out[section].items() if k != name}
  return out


def parse(config) -> RunConfig:
  """A ConfigDict (or dict) -> the typed ``RunConfig``, every key checked.
  Sections the config lacks take their defaults."""
  values = _plain(config)
  top = {k: v for k, v in values.items() if k not in SECTIONS and k != "task"}
  sections = {name: _section(cls, values.get(name, {}), f"{name}.")
              for name, cls in SECTIONS.items()}
  task = task_section(values.get("task", {"name": "synthetic_sum"}))
  run = _section(RunConfig, top, "")
  return dataclasses.replace(run, task=task, **sections)


def _keys(cls) -> list:
  """A section's own key fields (RunConfig's sections excluded)."""
  return [f for f in dataclasses.fields(cls)
          if f.name not in SECTIONS and f.name != "task"]


def _nested(f) -> type | None:
  """The section class of a nested section field (e.g. ``model.lora``), else None."""
  factory = f.default_factory
  return factory if dataclasses.is_dataclass(factory) else None


def _default(f):
  return f.default_factory() if f.default is dataclasses.MISSING else f.default


def defaults(cls) -> dict:
  """A section's (or a task section's) defaults as a plain dict (nested sections as dicts)."""
  return {f.name: defaults(_nested(f)) if _nested(f) else _default(f) for f in _keys(cls)}


def _free(cls, prefix: str) -> list[str]:
  out = []
  for f in dataclasses.fields(cls):
    if _nested(f):
      out += _free(_nested(f), f"{prefix}{f.name}.")
    elif f.metadata.get("free"):
      out.append(prefix + f.name)
  return out


def free_keys() -> tuple[str, ...]:
  """Dotted keys a resumed run may change (how it runs, not what it computes)."""
  out = [f.name for f in dataclasses.fields(RunConfig) if f.metadata.get("free")]
  for name, cls in SECTIONS.items():
    out += _free(cls, f"{name}.")
  return tuple(out)


def rows(cls, prefix: str = "") -> list[tuple[str, str, str, str]]:
  """(dotted key, default, range or choices, documentation) of a section."""
  out = []
  for f in _keys(cls):
    if _nested(f):
      out += rows(_nested(f), f"{prefix}{f.name}.")
      continue
    meta = f.metadata
    allowed = ("one of " + "|".join(meta["choices"]) if meta.get("choices")
               else meta["check"].expected if meta.get("check") else "")
    doc = meta["doc"] + (" [resume may change]" if meta.get("free") else "")
    out.append((prefix + f.name, repr(_default(f)), allowed, doc))
  return out


def help_text() -> str:
  """Every key with its default, range and documentation, by section."""
  blocks = [("run", RunConfig, "")] + [
      (name, cls, f"{name}.") for name, cls in SECTIONS.items()] + [
      (f"task (task.name={name!r})", cls, "task.") for name, cls in TASK_SECTIONS.items()]
  lines = []
  for title, cls, prefix in blocks:
    lines.append(f"[{title}] {cls.__doc__.splitlines()[0]}")
    for dotted, default, allowed, doc in rows(cls, prefix):
      if title == "run" and dotted == "sharding_rules":
        default = "(logical axis -> mesh axes; ba_jax.config.schema.DEFAULT_SHARDING_RULES)"
      lines.append(f"  {dotted} = {default}" + (f"  ({allowed})" if allowed else "")
                   + f"\n      {doc}")
  return "\n".join(lines)
