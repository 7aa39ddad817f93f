"""The checks of a run config that relate keys to each other and to the
devices (each key's own type and range is ``ba_jax.config.schema``'s)."""
from __future__ import annotations

import contextlib
import functools

import jax

from ba_jax.config import schema
from ba_jax.tasks import registry as tasks
from ba_jax.update import train_step as ts
from ba_jax.run.model_setup import batch_shards, config_rules


def step_config(cfg: schema.RunConfig) -> ts.StepConfig:
  """The static update options: the config's keys ``ts.SCHEMA_KEYS`` names
  (``loss.*``, ``rl.*`` and the seed), with ``loss.max_response_len``
  defaulting to ``rl.max_new_tokens``."""
  values = {name: functools.reduce(getattr, dotted.split("."), cfg)
            for name, dotted in ts.SCHEMA_KEYS.items()}
  values["max_response_len"] = cfg.loss.max_response_len or cfg.rl.max_new_tokens
  return ts.StepConfig(**values)


def validate(config: schema.RunConfig, mesh) -> ts.StepConfig:
  """The relations between keys (each key's own type and range were checked
  by ``schema.parse``); returns the step config."""
  cfg = step_config(config)
  rl = config.rl
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
  shards = batch_shards(mesh, config_rules(config.sharding_rules))
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


class ConfigError(ValueError):
  """A config value that the run cannot use; the message names the key and what was expected."""


@contextlib.contextmanager
def config_checks():
  """Turns the typed configs' ValueError/TypeError into ConfigError (the CLI prints one line)."""
  try:
    yield
  except ConfigError:
    raise
  except (ValueError, TypeError) as e:
    raise ConfigError(str(e)) from e
