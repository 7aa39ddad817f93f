"""The run builder: a run's static pieces, built once from its config.

``make_setup(config)`` validates the config (modes, divisibility over
devices, processes and groups), builds the mesh, the tokenizer, the model
config, the abstract model and optimizer, and the shardings of the train
state, with typed static configs for the step and the rollout. The trainer,
the dry run (``abstract=True``: no tokenizer, no weights), export and
evaluation (``workdir.restore_policy``) all start here. ``init_params``
materialises the policy directly sharded.
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Collection

import jax
import ml_collections
import numpy as np
from flax import nnx

from ba_jax.policy import compiling
from ba_jax.config import schema
from ba_jax.policy import hf
from ba_jax.policy import lora as lora_lib
from ba_jax.policy import model as model_lib
from ba_jax.policy import sharding as sharding_lib
from ba_jax.run import checkpointing, paths, rollout
from ba_jax.tasks import registry as tasks
from ba_jax.update import train_step as ts
from ba_jax.run.checks import config_checks, check_split, validate
from ba_jax.run.model_setup import (ARCHITECTURE_FIELDS, batch_shards, build_model_config,
                                   config_rules, make_mesh, runtime_fields)


@dataclasses.dataclass
class Setup:
  """Everything static about a run, built from its config."""
  config: ml_collections.ConfigDict  # as written to config.json; model section = the model built
  cfg: schema.RunConfig  # the same, typed and checked
  mesh: jax.sharding.Mesh
  rules: tuple
  step_cfg: ts.StepConfig
  rollout_cfg: rollout.RolloutConfig
  tokenizer: object  # None when built abstract
  model_config: model_lib.ModelConfig
  graphdef: object  # the policy's (with LoRA adapters when model.lora.rank > 0)
  abstract_params: object
  tx: object  # the RL optimizer (optax)
  state_sharding: object
  base_graphdef: object = None  # the policy without adapters (= graphdef without LoRA)
  _task: object = None

  @property
  def lora(self) -> bool:
    """True when the policy trains LoRA adapters on a frozen base."""
    return lora_lib.enabled(self.cfg.model.lora)

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
      task = tasks.make_task(self.cfg.task, self.cfg.eval, seed=self.cfg.seed,
                             tokenizer=self.tokenizer)
      check_split([("held-out problems", len(task.heldout))],
                  self.batch_shards)
      self._task = task
    return self._task


def make_setup(config, *, abstract: bool = False, devices=None,
               explicit: Collection[str] = (), model_config=None) -> Setup:
  """Builds and checks everything static about a run of ``config``.

  Unless ``abstract``, it also selects the XLA:CPU compile options of
  ``xla_cpu_compile`` and the persistent compilation cache of
  ``compilation_cache_dir`` for this process (``compiling.use``,
  ``compiling.use_cache``).

  Args:
    abstract: no tokenizer and no task (the dry run; restoring a workdir).
      The architecture is ``init_from``'s config.json when that file
      exists, else ``config.model``.
    devices: the mesh's devices (default all).
    explicit: dotted config keys set by the user (``build_model_config``).
    model_config: use this ModelConfig (a restored run's) as it is.
  """
  with config_checks():
    cfg = schema.parse(config)
    mesh = make_mesh(cfg.mesh, devices)
    rules = config_rules(cfg.sharding_rules)
    step_cfg = validate(cfg, mesh)
  tokenizer = None
  if not abstract:
    compiling.use(cfg.xla_cpu_compile)
    compiling.use_cache(cfg.compilation_cache_dir)
    tokenizer = tasks.make_tokenizer(cfg.task, paths.local(cfg.init_from))
  with config_checks():
    if model_config is None:
      model_config = build_model_config(cfg, tokenizer, explicit=explicit)
    config = copy.deepcopy(config)
    for key in ARCHITECTURE_FIELDS:
      if key in config.model:
        config.model[key] = getattr(model_config, key)
    cfg = schema.parse(config)
    rollout_cfg = rollout.RolloutConfig.from_section(cfg.rl)
    rollout_cfg = dataclasses.replace(rollout_cfg, max_slots=rollout.decode_slots(
        rollout_cfg, model_config, prompt_len=cfg.task.max_prompt_len,
        mesh=mesh, rules=rules))
    rl = cfg.rl
    tx = ts.optimizer(cfg.optim, rl.steps * rl.ppo_epochs * rl.num_minibatches)
    base = lambda: model_lib.Decoder(model_config, rngs=nnx.Rngs(config.seed))
    base_graphdef = nnx.split(nnx.eval_shape(base))[0]
    graphdef, abstract_params = nnx.split(nnx.eval_shape(
        lambda: _adapted(base(), cfg)))
  shapes = jax.eval_shape(lambda p: ts.create_state(p, tx), abstract_params)
  state_sharding = ts.tree_shardings(shapes, mesh, rules)
  return Setup(config, cfg, mesh, rules, step_cfg, rollout_cfg, tokenizer,
               model_config, graphdef, abstract_params, tx, state_sharding,
               base_graphdef)


def _adapted(model, cfg: schema.RunConfig):
  """``model`` with the config's LoRA adapters (unchanged without)."""
  if not lora_lib.enabled(cfg.model.lora):
    return model
  return lora_lib.apply(model, cfg.model.lora, seed=cfg.seed)


def with_adapters(setup: Setup, base_params):
  """The policy's state from its base weights: fresh LoRA adapters (``B``
  zero, so the policy equals its base) added when the run has them."""
  if not setup.lora:
    return base_params
  return nnx.state(_adapted(nnx.merge(setup.base_graphdef, base_params),
                            setup.cfg))


def saved_state(setup: Setup, state):
  """What a checkpoint holds of ``state``: all of it, or with LoRA only
  the adapters of its params (the base is ``base_params``')."""
  if not setup.lora:
    return state
  return state.replace(params=lora_lib.split(state.params)[0])


def full_state(setup: Setup, saved, base_params):
  """``saved_state``'s inverse: a restored checkpoint onto the base."""
  if not setup.lora:
    return saved
  return saved.replace(params=lora_lib.join(saved.params, base_params))


def abstract_state(setup: Setup):
  """The TrainState as ShapeDtypeStructs carrying their shardings."""
  shapes = jax.eval_shape(lambda p: ts.create_state(p, setup.tx),
                          setup.abstract_params)
  return checkpointing.abstract_like(shapes, setup.state_sharding)


def abstract_saved_state(setup: Setup):
  """``abstract_state`` as a checkpoint holds it (``saved_state``)."""
  return saved_state(setup, abstract_state(setup))


def base_params(setup: Setup, workdir: str, params=None):
  """A LoRA run's frozen base weights. On a fresh run (``params``: the
  base after init and warm-up) they are saved once to ``workdir/lora_base``
  unless they are ``init_from``'s own (no warm-up), which is read again on
  resume; the checkpoints hold only the adapters."""
  c = setup.cfg
  if c.init_from and not c.sft.steps:
    return params if params is not None else init_params(setup)
  abstract = lora_lib.split(abstract_state(setup).params)[1]
  return checkpointing.frozen_params(
      workdir, "lora_base", params, abstract,
      missing="a LoRA run saves its base weights there when it starts from "
              "a random model or a warm-up; start the run anew",
      what="the LoRA run's base weights", when="the policy before RL")


def init_params(setup: Setup):
  """Random init (or ``init_from``'s weights in ``model.param_dtype``),
  materialised directly sharded; without LoRA adapters
  (``with_adapters``)."""
  c, mc = setup.cfg, setup.model_config
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
