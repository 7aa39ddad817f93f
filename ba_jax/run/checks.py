"""Every check of a run config that can fail before anything runs."""
from __future__ import annotations

import contextlib
import math

import jax

from ba_jax.tasks import registry as tasks
from ba_jax.update import train_step as ts
from ba_jax.run.model_setup import batch_shards, config_rules


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
