"""A run's static pieces, built from its config before anything runs.

``make_setup(config)`` validates the config (modes, divisibility over
devices, processes and groups), builds the mesh, the tokenizer, the abstract
model and optimizer, and the shardings of the train state; ``init_params``
materialises the policy directly sharded. ``ba_jax.trainer`` runs the loop.
"""
from __future__ import annotations

import dataclasses

import jax
import ml_collections
import numpy as np
from flax import nnx

from ba_jax import checkpointing, rollout
from ba_jax import model as model_lib
from ba_jax import sharding as sharding_lib
from ba_jax import synthetic
from ba_jax import train_step as ts


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


def validate(config, mesh) -> ts.StepConfig:
  """Every check that can fail before anything runs; returns the step cfg."""
  cfg = step_config(config)
  rl = config.rl
  if rl.old_logp not in ("sampler", "recompute"):
    raise ValueError(f"rl.old_logp={rl.old_logp!r}: expected 'sampler' or "
                     "'recompute'")
  if rl.overlong not in rollout.OVERLONG_MODES:
    raise ValueError(f"rl.overlong={rl.overlong!r}: expected one of "
                     f"{list(rollout.OVERLONG_MODES)}")
  if rl.steps < 0 or rl.prompts_per_step < 1:
    raise ValueError(f"rl.steps={rl.steps}, rl.prompts_per_step="
                     f"{rl.prompts_per_step}: expected >= 0 and >= 1")
  synthetic_task = config.task.name == "synthetic_sum"
  if not synthetic_task:
    if config.sft.steps:
      raise ValueError(f"sft.steps={config.sft.steps}: task.name="
                       f"{config.task.name!r} has no warm-up data; set 0")
    if not config.init_from:
      raise ValueError(f"task.name={config.task.name!r} needs init_from, a "
                       "Hugging Face directory with the policy's tokenizer")
  else:
    task = synthetic.TaskConfig(**{k: config.task[k] for k in (
        "min_terms", "max_terms", "max_value", "length_gap",
        "sft_correct_frac")})
  need = synthetic.max_response_tokens(task) if synthetic_task else 0
  if config.sft.steps and need > rl.max_new_tokens:
    raise ValueError(f"rl.max_new_tokens={rl.max_new_tokens} is below the "
                     f"{need} tokens a warm-up response can take for task "
                     f"max_terms={task.max_terms}, length_gap="
                     f"{task.length_gap}; raise it")
  shards = _batch_shards(mesh, tuple(config.sharding_rules))
  cfg.check_batch(rl.prompts_per_step * rl.group_size, shards)
  procs = jax.process_count()
  counts = [("rl.prompts_per_step", rl.prompts_per_step),
            ("sft.batch_size", config.sft.batch_size)]
  if synthetic_task:
    counts.append(("eval.num_problems", config.eval.num_problems))
  for name, n in counts:
    if n % procs:
      raise ValueError(f"{name}={n} does not split over {procs} processes")
  if procs > 1:  # the sampler shards prompts over the batch axes too
    for name, n in counts:
      if n % shards:
        raise ValueError(f"{name}={n} does not split over the {shards} "
                         "devices of the batch mesh axes (needed with "
                         "several processes)")
  if config.sft.steps and config.sft.batch_size % shards:
    raise ValueError(f"sft.batch_size={config.sft.batch_size} does not split "
                     f"over the {shards} devices of the batch mesh axes")
  return cfg


def _batch_shards(mesh, rules) -> int:
  spec = sharding_lib.logical_to_spec(mesh, rules, ("batch",))[0]
  axes = () if spec is None else (spec,) if isinstance(spec, str) else spec
  return int(np.prod([mesh.shape[a] for a in axes]))


def build_model_config(config, tokenizer) -> model_lib.ModelConfig:
  fields = dict(config.model)
  if fields["vocab_size"] < len(tokenizer):
    raise ValueError(f"model.vocab_size={fields['vocab_size']} is smaller than "
                     f"the tokenizer's {len(tokenizer)} tokens")
  return model_lib.ModelConfig(**fields, bos_token_id=tokenizer.bos_token_id,
                               eos_token_id=tokenizer.eos_token_id)


@dataclasses.dataclass
class Setup:
  """Everything static about a run, built from its config."""
  config: ml_collections.ConfigDict
  mesh: jax.sharding.Mesh
  rules: tuple
  step_cfg: ts.StepConfig
  tokenizer: object
  model_config: model_lib.ModelConfig
  graphdef: object
  abstract_params: object
  tx: object
  state_sharding: object
  _task: object = None

  @property
  def task(self):
    """The task (built on first use: a dataset task reads its files)."""
    if self._task is None:
      c = self.config
      if c.task.name == "synthetic_sum":
        self._task = rollout.SyntheticTask(
            c.task, seed=c.seed, tokenizer=self.tokenizer,
            max_prompt_len=c.task.max_prompt_len,
            num_heldout=c.eval.num_problems, grader=c.task.grader)
      else:
        from ba_jax import dataset_task
        self._task = dataset_task.DatasetTask(
            c.task, c.eval, seed=c.seed, tokenizer=self.tokenizer,
            max_prompt_len=c.task.max_prompt_len)
    return self._task


def load_tokenizer(config):
  if config.task.name == "synthetic_sum":
    return synthetic.build_tokenizer()
  from transformers import AutoTokenizer
  return AutoTokenizer.from_pretrained(config.init_from)


def make_setup(config) -> Setup:
  mesh = sharding_lib.make_mesh(dict(config.mesh))
  rules = tuple(tuple(r) if isinstance(r, list) else r
                for r in config.sharding_rules)
  rules = tuple((name, tuple(ax) if isinstance(ax, list) else ax)
                for name, ax in rules)
  step_cfg = validate(config, mesh)
  tokenizer = load_tokenizer(config)
  model_config = build_model_config(config, tokenizer)
  abstract = nnx.eval_shape(
      lambda: model_lib.Decoder(model_config, rngs=nnx.Rngs(config.seed)))
  graphdef, abstract_params = nnx.split(abstract)
  tx = ts.optimizer_from_config(config)
  abstract_state = jax.eval_shape(lambda p: ts.create_state(p, tx),
                                  abstract_params)
  state_sharding = ts.tree_shardings(abstract_state, mesh, rules)
  return Setup(config, mesh, rules, step_cfg, tokenizer, model_config,
               graphdef, abstract_params, tx, state_sharding)


def abstract_state(setup: Setup):
  shapes = jax.eval_shape(lambda p: ts.create_state(p, setup.tx),
                          setup.abstract_params)
  return checkpointing.abstract_like(shapes, setup.state_sharding)


def init_params(setup: Setup):
  """Random init (or ``init_from``), materialised directly sharded."""
  c = setup.config
  if c.init_from:
    from ba_jax import hf
    model, loaded = hf.load_pretrained(c.init_from, mesh=setup.mesh,
                                       rules=setup.rules)
    fields = ("model_type", "vocab_size", "hidden_size", "intermediate_size",
              "num_layers", "num_heads", "num_kv_heads", "head_dim",
              "tie_word_embeddings", "qk_norm", "attention_bias")
    diff = {f: (getattr(setup.model_config, f), getattr(loaded, f))
            for f in fields
            if getattr(setup.model_config, f) != getattr(loaded, f)}
    if diff:
      raise ValueError(f"init_from={c.init_from!r} does not match config.model"
                       f" (config value, checkpoint value): {diff}")
    return nnx.state(model)
  return nnx.state(sharding_lib.create_sharded(
      lambda: model_lib.Decoder(setup.model_config, rngs=nnx.Rngs(c.seed)),
      setup.mesh, setup.rules))


def to_device(arrays: dict, mesh, rules) -> dict:
  """This process's rows -> global batch-sharded arrays."""
  out = {}
  for name, x in arrays.items():
    x = np.asarray(x)
    sharding = sharding_lib.data_sharding(mesh, rules, x.ndim)
    out[name] = jax.make_array_from_process_local_data(sharding, x)
  return out
