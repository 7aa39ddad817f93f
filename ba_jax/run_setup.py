"""The run builder: a run's static pieces, built once from its config.

``make_setup(config)`` validates the config (modes, divisibility over
devices, processes and groups), builds the mesh, the tokenizer, the model
config, the abstract model and optimizer, and the shardings of the train
state, with typed static configs for the step and the rollout. The trainer,
the dry run (``abstract=True``: no tokenizer, no weights), export and
evaluation (``restore_policy``) all start here. ``init_params`` materialises
the policy directly sharded.

With ``init_from`` set, the architecture is the checkpoint's ``config.json``;
``config.model`` then supplies only what a checkpoint does not say (compute
and parameter dtypes, remat, the attention kernel).
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import math
from typing import Collection

import jax
import ml_collections
import numpy as np
from flax import nnx

from ba_jax import checkpointing, hf, paths, rollout, tasks
from ba_jax import model as model_lib
from ba_jax import sharding as sharding_lib
from ba_jax import train_step as ts

# What a checkpoint's config.json decides (ModelConfig.from_hf_dict reads
# them); every other model field is how to run the model.
ARCHITECTURE_FIELDS = (
    "model_type", "vocab_size", "hidden_size", "intermediate_size",
    "num_layers", "num_heads", "num_kv_heads", "head_dim", "rope_theta",
    "rope_scaling", "rms_norm_eps", "tie_word_embeddings", "attention_bias",
    "qk_norm", "max_position_embeddings", "bos_token_id", "eos_token_id")


def step_config(config) -> ts.StepConfig:
  """The static update options from the config (validates the mode)."""
  loss, rl = config.loss, config.rl
  return ts.StepConfig(
      group_size=rl.group_size, aggregation=loss.aggregation,
      eps_low=loss.eps_low, eps_high=loss.eps_high, dual_clip=loss.dual_clip,
      kl_coef=loss.kl_coef, kl_type=loss.kl_type,
      entropy_coef=loss.entropy_coef, reg_aggregation=loss.reg_aggregation,
      max_response_len=loss.max_response_len or rl.max_new_tokens,
      ba_denominator=loss.ba_denominator, ba_scope=loss.ba_scope,
      ppo_epochs=rl.ppo_epochs, num_minibatches=rl.num_minibatches,
      num_microbatches=rl.num_microbatches, temperature=rl.temperature)


def config_rules(config) -> tuple:
  """The config's sharding rules as hashable tuples (flags give lists)."""
  return tuple((name, tuple(axes) if isinstance(axes, list) else axes)
               for name, axes in config.sharding_rules)


def batch_shards(mesh, rules) -> int:
  """How many devices the "batch" logical axis is split over."""
  spec = sharding_lib.logical_to_spec(mesh, rules, ("batch",))[0]
  axes = () if spec is None else (spec,) if isinstance(spec, str) else spec
  return int(np.prod([mesh.shape[a] for a in axes]))


def make_mesh(config, devices=None) -> jax.sharding.Mesh:
  try:
    return sharding_lib.make_mesh(dict(config.mesh), devices)
  except ValueError as e:
    raise ValueError(f"{e}; set config.mesh to fit, e.g. --config.mesh.data=1 "
                     "--config.mesh.fsdp=4 --config.mesh.tensor=2 on 8 "
                     "devices") from None


def _finite(x) -> bool:
  return isinstance(x, (int, float)) and not isinstance(x, bool) and (
      math.isfinite(x))


def _count(x) -> bool:
  """An int >= 0 (a count, a seed, or a size where 0 means off or auto)."""
  return isinstance(x, int) and x >= 0


# (dotted key, test, what is expected): every numeric range and relation
# checked before anything runs. None passes for optional keys.
_RANGES = (
    ("seed", _count, "an int >= 0"),
    ("rl.steps", lambda x: x >= 0, ">= 0"),
    ("rl.prompts_per_step", lambda x: x >= 1, ">= 1"),
    ("rl.group_size", lambda x: x >= 2,
     ">= 2 (with one response per prompt every group advantage is 0)"),
    ("rl.max_new_tokens", lambda x: x >= 1, ">= 1"),
    ("rl.temperature", lambda x: _finite(x) and x > 0, "finite and > 0"),
    ("rl.top_p", lambda x: _finite(x) and 0 < x <= 1, "in (0, 1]"),
    ("rl.top_k", lambda x: x >= 0, ">= 0 (0 = off)"),
    ("rl.max_slots", _count, "an int >= 0 (0 = every row at once)"),
    ("rl.kv_cache_gib", lambda x: _finite(x) and x >= 0,
     "finite and >= 0 (GiB per device; 0 = unused)"),
    ("rl.prefill_chunk", _count, "an int >= 0 (0 = the whole prompt at once)"),
    ("rl.cache_phases", _count, "an int >= 0 (0 = the backend's default)"),
    ("rl.ppo_epochs", lambda x: x >= 1, ">= 1"),
    ("rl.num_minibatches", lambda x: x >= 1, ">= 1"),
    ("rl.num_microbatches", lambda x: x >= 1, ">= 1"),
    ("rl.max_sampling_rounds", lambda x: x >= 0, ">= 0"),
    ("rl.overlong_buffer", lambda x: x >= 0, ">= 0"),
    ("rl.overlong_penalty", lambda x: _finite(x) and x >= 0,
     "finite and >= 0"),
    ("rl.max_nonfinite", lambda x: x >= 1, ">= 1"),
    ("loss.eps_low", lambda x: _finite(x) and 0 <= x < 1, "in [0, 1)"),
    ("loss.eps_high", lambda x: _finite(x) and x >= 0, "finite and >= 0"),
    ("loss.dual_clip", lambda x: x is None or (_finite(x) and x > 1),
     "None or > 1"),
    ("loss.kl_coef", lambda x: _finite(x) and x >= 0, "finite and >= 0"),
    ("loss.entropy_coef", _finite, "finite"),
    ("loss.max_response_len", lambda x: x is None or x >= 1, "None or >= 1"),
    ("optim.learning_rate", lambda x: _finite(x) and x > 0, "finite and > 0"),
    ("optim.warmup_steps", lambda x: x >= 0, ">= 0"),
    ("optim.end_lr_frac", lambda x: _finite(x) and 0 <= x <= 1, "in [0, 1]"),
    ("optim.weight_decay", lambda x: _finite(x) and x >= 0,
     "finite and >= 0"),
    ("optim.b1", lambda x: _finite(x) and 0 <= x < 1, "in [0, 1)"),
    ("optim.b2", lambda x: _finite(x) and 0 <= x < 1, "in [0, 1)"),
    ("optim.eps", lambda x: _finite(x) and x > 0, "finite and > 0"),
    ("optim.grad_clip", lambda x: _finite(x) and x >= 0,
     "finite and >= 0 (0 = off)"),
    ("sft.steps", lambda x: x >= 0, ">= 0"),
    ("sft.batch_size", lambda x: x >= 1, ">= 1"),
    ("sft.learning_rate", lambda x: _finite(x) and x > 0, "finite and > 0"),
    ("sft.warmup_steps", lambda x: x >= 0, ">= 0"),
    ("eval.num_problems", lambda x: x >= 0, ">= 0 (0 = all)"),
    ("eval.samples_per_problem", lambda x: x >= 1, ">= 1"),
    ("eval.temperature", lambda x: _finite(x) and x >= 0,
     "finite and >= 0 (0 = greedy)"),
    ("eval.every", lambda x: x >= 0, ">= 0"),
    ("checkpoint.every", lambda x: x >= 0, ">= 0"),
    ("checkpoint.keep", lambda x: x >= 1, ">= 1"),
    ("stop_after_steps", lambda x: x >= 0, ">= 0"),
    ("task.max_prompt_len", lambda x: x >= 1, ">= 1"),
)


def check_ranges(config) -> None:
  """Every ``_RANGES`` entry (the relations between keys are checked in
  ``validate`` and the step config); the error names the key, its value and
  what was expected."""
  for key, ok, expected in _RANGES:
    node, *parts = config, *key.split(".")
    for part in parts:
      if part not in node:
        break
      node = node[part]
    else:
      try:
        good = ok(node)
      except TypeError:  # a string where a number belongs
        good = False
      if not good:
        raise ValueError(f"{key}={node!r}: expected {expected}")


def validate(config, mesh) -> ts.StepConfig:
  """Every check that can fail before anything runs; returns the step cfg."""
  check_ranges(config)
  cfg = step_config(config)
  rl = config.rl
  if rl.old_logp not in ("sampler", "recompute"):
    raise ValueError(f"rl.old_logp={rl.old_logp!r}: expected 'sampler' or "
                     "'recompute'")
  task_class = tasks.task_class(config.task.name)
  if config.sft.steps:
    if not task_class.has_warmup:
      raise ValueError(f"sft.steps={config.sft.steps}: task.name="
                       f"{config.task.name!r} has no warm-up data; set 0")
    need = task_class.max_warmup_response_tokens(config.task)
    if need > rl.max_new_tokens:
      raise ValueError(f"rl.max_new_tokens={rl.max_new_tokens} is below the "
                       f"{need} tokens a warm-up response of task.name="
                       f"{config.task.name!r} can take with this config's "
                       "task section; raise it")
  shards = batch_shards(mesh, config_rules(config))
  cfg.check_batch(rl.prompts_per_step * rl.group_size, shards)
  counts = [("rl.prompts_per_step", rl.prompts_per_step)]
  if config.sft.steps:
    counts.append(("sft.batch_size", config.sft.batch_size))
    if config.sft.batch_size % shards:
      raise ValueError(f"sft.batch_size={config.sft.batch_size} does not "
                       f"split over the {shards} devices of the batch mesh "
                       "axes")
  check_split(counts, shards)
  return cfg


def check_split(counts, shards: int) -> None:
  """Each (name, n) must split over the processes, and with several
  processes over the batch shards too (the sampler shards prompts so)."""
  procs = jax.process_count()
  for name, n in counts:
    if n % procs:
      raise ValueError(f"{name}={n} does not split over {procs} processes")
    if procs > 1 and n % shards:
      raise ValueError(f"{name}={n} does not split over the {shards} "
                       "devices of the batch mesh axes (needed with "
                       "several processes)")


def _model_fields(config) -> dict:
  fields = dict(config.model)
  known = {f.name for f in dataclasses.fields(model_lib.ModelConfig)}
  unknown = sorted(set(fields) - known)
  if unknown:
    raise ValueError(f"config.model has fields {unknown} that ModelConfig "
                     f"does not take; expected some of {sorted(known)}")
  return fields


def runtime_fields(config) -> dict:
  """The ``config.model`` fields a checkpoint does not decide."""
  return {k: v for k, v in _model_fields(config).items()
          if k not in ARCHITECTURE_FIELDS}


def build_model_config(config, tokenizer=None, *,
                       explicit: Collection[str] = ()
                       ) -> model_lib.ModelConfig:
  """The policy's ModelConfig: ``init_from``'s architecture plus
  ``runtime_fields``, or all of ``config.model`` without a checkpoint.

  ``explicit``: dotted config keys the user set (e.g. on the command line);
  an architecture field among them that the checkpoint contradicts is an
  error, the config file's own values simply give way.
  """
  fields = _model_fields(config)
  if config.init_from and (tokenizer is not None or (
      paths.path(config.init_from) / "config.json").is_file()):
    model_config = model_lib.ModelConfig.from_hf_dict(
        hf.read_config(paths.local(config.init_from)),
        **runtime_fields(config))
    clash = {k: (fields[k], getattr(model_config, k)) for k in fields
             if f"model.{k}" in explicit and k in ARCHITECTURE_FIELDS
             and fields[k] != getattr(model_config, k)}
    if clash:
      raise ValueError("the command line sets " + ", ".join(
          f"model.{k}={ours!r} but init_from={config.init_from!r} has {k}="
          f"{theirs!r}" for k, (ours, theirs) in clash.items()) +
                       "; drop the override or use a matching checkpoint")
  else:
    ids = {} if tokenizer is None else dict(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    model_config = model_lib.ModelConfig(**fields, **ids)
  if tokenizer is not None and model_config.vocab_size < len(tokenizer):
    raise ValueError(f"model.vocab_size={model_config.vocab_size} is smaller "
                     f"than the tokenizer's {len(tokenizer)} tokens")
  return model_config


@dataclasses.dataclass
class Setup:
  """Everything static about a run, built from its config."""
  config: ml_collections.ConfigDict  # model section = the model built
  mesh: jax.sharding.Mesh
  rules: tuple
  step_cfg: ts.StepConfig
  rollout_cfg: rollout.RolloutConfig
  tokenizer: object  # None when built abstract
  model_config: model_lib.ModelConfig
  graphdef: object
  abstract_params: object
  tx: object  # the RL optimizer (optax)
  state_sharding: object
  _task: object = None

  @property
  def batch_shards(self) -> int:
    return batch_shards(self.mesh, self.rules)

  @property
  def task(self) -> tasks.Task:
    """The task (built on first use: a dataset task reads its files)."""
    if self._task is None:
      if self.tokenizer is None:
        raise ValueError("this setup was built abstract (no tokenizer): it "
                         "has no task")
      task = tasks.make_task(self.config, self.tokenizer)
      check_split([("held-out problems", len(task.heldout))],
                  self.batch_shards)
      self._task = task
    return self._task


class ConfigError(ValueError):
  """A config value that the run cannot use; the message names the key and what was expected."""


@contextlib.contextmanager
def _config_checks():
  """Turns the typed configs' ValueError/TypeError into ConfigError (the CLI prints one line)."""
  try:
    yield
  except ConfigError:
    raise
  except (ValueError, TypeError) as e:
    raise ConfigError(str(e)) from e


def make_setup(config, *, abstract: bool = False, devices=None,
               explicit: Collection[str] = (), model_config=None) -> Setup:
  """Builds and checks everything static about a run of ``config``.

  Args:
    abstract: no tokenizer and no task (the dry run; restoring a workdir).
      The architecture is ``init_from``'s config.json when that file
      exists, else ``config.model``.
    devices: the mesh's devices (default all).
    explicit: dotted config keys set by the user (``build_model_config``).
    model_config: use this ModelConfig (a restored run's) as it is.
  """
  with _config_checks():
    mesh = make_mesh(config, devices)
    rules = config_rules(config)
    step_cfg = validate(config, mesh)
  tokenizer = None
  if not abstract:
    local = copy.deepcopy(config)
    with local.unlocked():
      local.init_from = paths.local(config.init_from)
    tokenizer = tasks.make_tokenizer(local)
  with _config_checks():
    if model_config is None:
      model_config = build_model_config(config, tokenizer, explicit=explicit)
    config = copy.deepcopy(config)
    for key in ARCHITECTURE_FIELDS:
      if key in config.model:
        config.model[key] = getattr(model_config, key)
    rollout_cfg = rollout.RolloutConfig.from_config(config.rl)
    rollout_cfg = dataclasses.replace(rollout_cfg, max_slots=rollout.decode_slots(
        rollout_cfg, model_config, prompt_len=config.task.max_prompt_len,
        mesh=mesh, rules=rules))
    tx = ts.optimizer_from_config(config)
  graphdef, abstract_params = nnx.split(nnx.eval_shape(
      lambda: model_lib.Decoder(model_config, rngs=nnx.Rngs(config.seed))))
  shapes = jax.eval_shape(lambda p: ts.create_state(p, tx), abstract_params)
  state_sharding = ts.tree_shardings(shapes, mesh, rules)
  return Setup(config, mesh, rules, step_cfg, rollout_cfg, tokenizer,
               model_config, graphdef, abstract_params, tx, state_sharding)


def abstract_state(setup: Setup):
  """The TrainState as ShapeDtypeStructs carrying their shardings."""
  shapes = jax.eval_shape(lambda p: ts.create_state(p, setup.tx),
                          setup.abstract_params)
  return checkpointing.abstract_like(shapes, setup.state_sharding)


def init_params(setup: Setup):
  """Random init (or ``init_from``'s weights in ``model.param_dtype``),
  materialised directly sharded."""
  c, mc = setup.config, setup.model_config
  if c.init_from:
    # Every runtime field as the run resolved it (the model config, not the
    # raw section), so a field added to ModelConfig needs no edit here.
    model, loaded = hf.load_pretrained(
        paths.local(c.init_from), mesh=setup.mesh, rules=setup.rules,
        **{k: getattr(mc, k) for k in runtime_fields(c)})
    if loaded != mc:
      raise ValueError(f"init_from={c.init_from!r} changed since the run was "
                       f"set up: {loaded} != {mc}")
    return nnx.state(model)
  return nnx.state(sharding_lib.create_sharded(
      lambda: model_lib.Decoder(mc, rngs=nnx.Rngs(c.seed)), setup.mesh,
      setup.rules))


def to_device(arrays: dict, mesh, rules) -> dict:
  """This process's rows -> global batch-sharded arrays."""
  out = {}
  for name, x in arrays.items():
    x = np.asarray(x)
    sharding = sharding_lib.data_sharding(mesh, rules, x.ndim)
    out[name] = jax.make_array_from_process_local_data(sharding, x)
  return out


def write_run_files(workdir: str, setup: Setup) -> None:
  """What ``restore_policy`` needs besides the arrays: the run's config
  (model section as built), the model config (transformers layout), the
  tokenizer."""
  root = paths.path(workdir)
  paths.write_text(root / "config.json", setup.config.to_json())
  paths.write_json(root / "model_config.json", setup.model_config.to_hf_dict())
  if setup.tokenizer is not None:
    with paths.output_dir(root / "tokenizer") as tok_dir:
      setup.tokenizer.save_pretrained(tok_dir)


def is_workdir(path) -> bool:
  """True when ``path`` holds a trainer run (its config and checkpoints)."""
  root = paths.path(path)
  return ((root / "model_config.json").is_file()
          and (root / "checkpoints").is_dir())


def load_run_config(workdir: str) -> ml_collections.ConfigDict:
  """The ml_collections config a run in ``workdir`` was started with."""
  path = paths.path(workdir) / "config.json"
  if not path.exists():
    raise FileNotFoundError(f"{path} not found: {workdir} is not a ba_jax "
                            "training workdir")
  return ml_collections.ConfigDict(json.loads(path.read_text()))


def restore_policy(workdir: str, step: int | None = None, *, mesh_shape=None,
                   warn=print):
  """The policy saved in ``workdir``: ``(model, model_config, tokenizer)``.

  Restores the newest intact checkpoint (a damaged newer one is named in a
  one-line ``warn``), or ``step``, onto a mesh of this machine's devices
  (``mesh_shape``, default the run's own, e.g. {"data": -1, ...}), whatever
  mesh it was saved from. Needs only the workdir (not init_from).
  """
  config = load_run_config(workdir)
  if mesh_shape is not None:
    config.mesh = dict(mesh_shape)
  model_config = model_lib.ModelConfig.from_hf_dict(
      paths.read_json(paths.path(workdir) / "model_config.json"),
      **runtime_fields(config))
  setup = make_setup(config, abstract=True, model_config=model_config)
  ckpt = checkpointing.Checkpointer(workdir, keep=max(config.checkpoint.keep, 1),
                                    async_save=False)
  try:
    if step is None:
      _, state, _ = ckpt.restore_intact(abstract_state(setup), warn=warn)
    else:
      try:
        state, _ = ckpt.restore(abstract_state(setup), step)
      except FileNotFoundError:
        raise
      except Exception as e:  # orbax/tensorstore raise many kinds
        raise checkpointing.NoIntactCheckpoint(
            f"checkpoint step {step} under {ckpt.directory} is damaged: "
            f"{checkpointing.first_line(e)}") from None
  finally:
    ckpt.close()
  model = nnx.merge(setup.graphdef, state.params)
  tok_dir = paths.path(workdir) / "tokenizer"
  tokenizer = None
  if tok_dir.is_dir():
    from transformers import AutoTokenizer
    with paths.local_dir(tok_dir) as local:
      tokenizer = AutoTokenizer.from_pretrained(local)
  return model, model_config, tokenizer
