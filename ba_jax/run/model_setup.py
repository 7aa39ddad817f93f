"""The mesh and the policy's ModelConfig from a run config.

With ``init_from`` set, the architecture is the checkpoint's ``config.json``;
``config.model`` then supplies only what a checkpoint does not say (compute
and parameter dtypes, remat, the attention kernel).
"""
from __future__ import annotations

import dataclasses
from typing import Collection

import jax
import numpy as np

from ba_jax.config import schema
from ba_jax.policy import hf
from ba_jax.policy import model as model_lib
from ba_jax.policy import sharding as sharding_lib
from ba_jax.run import paths


# What a checkpoint's config.json decides (ModelConfig.from_hf_dict reads
# them); every other model field is how to run the model.
ARCHITECTURE_FIELDS = schema.ARCHITECTURE_KEYS


def config_rules(rules) -> tuple:
  """Sharding rules as hashable tuples (flags and JSON give lists)."""
  return tuple((name, tuple(axes) if isinstance(axes, list) else axes)
               for name, axes in rules)


def batch_shards(mesh, rules) -> int:
  """How many devices the "batch" logical axis is split over."""
  spec = sharding_lib.logical_to_spec(mesh, rules, ("batch",))[0]
  axes = () if spec is None else (spec,) if isinstance(spec, str) else spec
  return int(np.prod([mesh.shape[a] for a in axes]))


def make_mesh(mesh: schema.Mesh, devices=None) -> jax.sharding.Mesh:
  try:
    return sharding_lib.make_mesh(dataclasses.asdict(mesh), devices)
  except ValueError as e:
    raise ValueError(f"{e}; set config.mesh to fit, e.g. --config.mesh.data=1 "
                     "--config.mesh.fsdp=4 --config.mesh.tensor=2 on 8 "
                     "devices") from None


def runtime_fields(config: schema.RunConfig) -> dict:
  """The ``model`` section's fields a checkpoint does not decide."""
  return {k: v for k, v in _model_fields(config).items()
          if k not in ARCHITECTURE_FIELDS}


def _model_fields(config: schema.RunConfig) -> dict:
  """The ``model`` section's ModelConfig fields (``model.lora`` is the
  adapters', ``ba_jax.policy.lora``)."""
  return {k: v for k, v in dataclasses.asdict(config.model).items() if k != "lora"}


def build_model_config(config: schema.RunConfig, tokenizer=None, *,
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
    # The tokenizer's ids where the model section leaves them None.
    model_config = model_lib.ModelConfig(**{**fields, **{
        k: v for k, v in ids.items() if fields[k] is None}})
  if tokenizer is not None and model_config.vocab_size < len(tokenizer):
    raise ValueError(f"model.vocab_size={model_config.vocab_size} is smaller "
                     f"than the tokenizer's {len(tokenizer)} tokens")
  return model_config
