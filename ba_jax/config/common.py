"""What every config file shares: the variant parser, sections at the
schema's defaults (``ba_jax.config.schema``), the paper settings' recipe and
the CPU shrink (``runlocal``). A config file loads it with one line::

    from ba_jax.config import common

starts from ``common.base()`` and states only what differs;
``configs/tiny.py`` is the smallest example.
"""
import typing

import ml_collections
from ml_collections import config_dict

from ba_jax.config import schema


def parse_variants(arg, allowed: dict[str, str], config_file: str) -> dict:
  """``key=value,flag`` (what follows the colon in ``--config=file.py:...``)
  as a dict; a key not in ``allowed`` (name -> what it sets) is an error."""
  out = {}
  for item in filter(None, (arg or "").split(",")):
    key, _, value = item.partition("=")
    out[key] = value if value else True
  unknown = sorted(set(out) - set(allowed))
  if unknown:
    expected = "; ".join(f"{k}: {v}" for k, v in allowed.items())
    raise ValueError(f"{config_file}: unknown variant(s) {unknown} in {arg!r};"
                     f" expected some of: {expected}")
  return out


def _section(cls, **fields) -> ml_collections.ConfigDict:
  """A section's schema defaults (typed placeholders for optional numbers,
  so ``--config.loss.dual_clip=3`` parses) with ``fields`` over them."""
  hints = typing.get_type_hints(cls)
  out = {}
  for name, value in {**schema.defaults(cls), **fields}.items():
    args = [a for a in typing.get_args(hints[name]) if a is not type(None)]
    if value is None and len(args) == 1 and args[0] in (int, float, str):
      value = config_dict.placeholder(args[0])
    out[name] = value
  return ml_collections.ConfigDict(out)


def base(aggregation: str = "balanced") -> ml_collections.ConfigDict:
  """Every section but ``model`` and ``task`` at the schema's defaults
  (``python -m ba_jax.train --helpconfig`` lists them)."""
  c = _section(schema.RunConfig)
  for name, cls in schema.SECTIONS.items():
    if name != "model":
      c[name] = _section(cls)
  c.loss.aggregation = aggregation
  return c


def model(**fields) -> ml_collections.ConfigDict:
  """A ``model`` section: the schema's run keys (dtype, remat, attention,
  ...) at their defaults, with ``fields`` (architecture and overrides)."""
  runtime = {k: v for k, v in schema.defaults(schema.Model).items()
             if k not in schema.ARCHITECTURE_KEYS}
  return ml_collections.ConfigDict({**runtime, **fields})


LORA_VARIANT = "LoRA adapters (qwix) of rank 8, or lora=<rank>; the base stays frozen"


def lora(c: ml_collections.ConfigDict, value, *, learning_rate: float) -> None:
  """The ``:lora`` variant: adapters of rank ``value`` (``True``: 8) and
  alpha = 2 x rank on every projection, trained at ``learning_rate``."""
  rank = 8 if value is True else int(value)
  c.model.lora.update(rank=rank, alpha=float(2 * rank))
  c.optim.learning_rate = learning_rate


PAPER_VARIANTS = {"agg": "<aggregation mode>", "param_dtype": "<dtype>",
                  "lora": LORA_VARIANT,
                  "runlocal": "a few steps on this CPU: tiny random model of "
                              "the same family on the bundled synthetic task"}


def paper_config(arg, config_file: str, **architecture
                 ) -> tuple[ml_collections.ConfigDict, dict]:
  """A paper setting: ``base()``, the model ``architecture`` (ModelConfig
  fields) and ``dapo_recipe``, and the parsed variants (``PAPER_VARIANTS``);
  the caller adds ``init_from``, the lengths and the task, then applies
  ``runlocal`` when asked."""
  args = parse_variants(arg, PAPER_VARIANTS, config_file)
  c = base(aggregation=args.get("agg", "balanced"))
  c.model = model(**architecture)
  dapo_recipe(c, param_dtype=args.get("param_dtype", "float32"))
  if args.get("lora"):
    # 10x the full-parameter rate, the usual ratio for LoRA.
    lora(c, args["lora"], learning_rate=10 * c.optim.learning_rate)
  return c, args


def runlocal(c: ml_collections.ConfigDict) -> None:
  """Shrinks a paper config ``c`` (task already set) in place to a
  seconds-scale CPU run: a random model of the same family (model_type,
  qk_norm, attention bias and tied embeddings kept; every size tiny), no
  ``init_from``, and the bundled synthetic task instead of the dataset,
  whose prompts would need the checkpoint's tokenizer. The recipe's keys
  (loss, overlong shaping, dynamic sampling, optimizer) stay as they are
  at toy sizes, so what is exercised is the paper config's own path."""
  c.init_from = ""
  c.model.update(vocab_size=32, hidden_size=32, intermediate_size=64,
                 num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16,
                 max_position_embeddings=128, dtype="float32",
                 param_dtype="float32", attention_impl="full",
                 attention_block=16, logprob_chunk=16)
  c.task = synthetic_task()
  c.task.max_terms = 3
  c.sft.update(steps=20, batch_size=16, learning_rate=3e-3, warmup_steps=2)
  c.rl.update(steps=2, prompts_per_step=4, group_size=4, max_new_tokens=28,
              num_minibatches=2, num_microbatches=1, overlong_buffer=4,
              max_sampling_rounds=1)
  c.optim.update(learning_rate=1e-4, warmup_steps=2)
  c.mesh.update(data=-1, fsdp=1, tensor=1)
  c.checkpoint.update(every=0, keep=1)
  c.eval = base().eval
  c.eval.update(num_problems=8, samples_per_problem=2)


def task(name: str, **fields) -> ml_collections.ConfigDict:
  """A ``task`` section for ``task.name`` = ``name``: ``fields`` over the
  schema's defaults for that task (``schema.TASK_SECTIONS``)."""
  if name not in schema.TASK_SECTIONS:
    raise ValueError(f"task.name={name!r}: expected one of {sorted(schema.TASK_SECTIONS)}")
  return _section(schema.TASK_SECTIONS[name], **fields)


def synthetic_task(**fields) -> ml_collections.ConfigDict:
  """The bundled synthetic addition task (ba_jax/tasks/synthetic.py)."""
  return task("synthetic_sum", **fields)


def dapo_recipe(c: ml_collections.ConfigDict, param_dtype: str) -> None:
  """The paper settings' shared recipe (DAPO's published one, Yu et al.
  2025, where the paper is silent), applied to ``c`` in place; lengths are
  set by each config file.

  AdamW lr 1e-6 after 10 warm-up RL steps then constant, weight decay 0.1,
  gradient clipping 1.0; 512 prompts x 16 responses per step in 16
  mini-batches of 32 prompts; soft overlong penalty; clip 0.2 / 0.28
  (clip-higher); no KL; temperature 1, top-p 1; dynamic sampling (as in
  verl's recipe/dapo/test_dapo_7b_math.sh, the DAPO recipe for
  Qwen2.5-Math-7B: lr 1e-6, lr_warmup_steps=10, weight_decay 0.1,
  grad_clip 1.0, train_prompt_bsz 512, n 16, mini-batch 32 prompts, clip
  0.2/0.28). RL steps are our choice.

  Warm-up: verl steps its LR scheduler once per RL step (after all of the
  step's mini-batches); ours counts optimizer updates, ppo_epochs x
  num_minibatches = 1 x 16 per RL step, so 10 RL steps = 160 updates.

  Float32 master weights and AdamW moments with bfloat16 compute by default
  (~16 bytes per parameter before sharding): bfloat16 parameters keep 8
  significant bits, and an AdamW step of ~1e-6 on a weight of magnitude
  1e-2 is below half an ulp there (~3e-5), so it is rounded away.
  ``:param_dtype=bfloat16`` halves the weights' memory at that cost.

  Remat "full" (each scanned layer recomputed in the backward pass) and the
  backend's attention kernel ("auto": splash on TPU, blockwise on CPU).
  """
  c.init_from = "/path/to/checkpoint"  # SET IT (a local HF directory)
  c.model.update(dtype="bfloat16", param_dtype=param_dtype, remat="full",
                 attention_impl="auto", attention_block=1024)
  c.sft.update(steps=0, batch_size=512, learning_rate=1e-6, warmup_steps=0)
  c.rl.update(
      steps=400, prompts_per_step=512, group_size=16,
      num_minibatches=16,
      # 512-row mini-batches in 16-row micro-batches: one row per batch
      # shard with data x fsdp = 16; raise this on a larger pod.
      num_microbatches=32,
      # The trainer would recompute in one forward over the whole batch,
      # far too large at this scale: the sampler's log-probs are used.
      old_logp="sampler", dynamic_sampling=True, overlong="soft")
  # verl's lr_warmup_steps=10 counts RL steps; ours counts updates.
  c.optim.update(learning_rate=1e-6,
                 warmup_steps=10 * c.rl.ppo_epochs * c.rl.num_minibatches,
                 weight_decay=0.1)
  # The configs' own 64-device pod mesh (v5e-64, v4-128's 64 chips, ...);
  # data=-1 takes any further devices (a multiple of 64).
  c.mesh.update(data=-1, fsdp=16, tensor=4)
  c.checkpoint.update(every=20, keep=3)
  c.eval = ml_collections.ConfigDict(dict(
      benchmarks="aime24,aime25,amc23,math500,minerva,olympiadbench",
      data_dir="/path/to/eval",  # SET IT: <benchmark>.jsonl files
      num_problems=0,  # problems per benchmark; 0 = all
      samples_per_problem=16,  # avg@k / pass@k
      temperature=1.0,  # sampling temperature (greedy also reported)
      every=50,  # evaluate every this many RL steps (0: before/after only)
  ))
  c.log.progress_bar = False


def math_task(name: str, **fields) -> ml_collections.ConfigDict:
  """A math dataset task section (ba_jax/tasks/dataset_task.py): ``fields``
  (path, the loader's filters, template and rule) over the shared grading."""
  return task(name, **fields)
