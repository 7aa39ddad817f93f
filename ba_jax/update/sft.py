"""Supervised warm-up: teacher-forced cross-entropy on task responses.

The loss is the mean negative log-likelihood of the response tokens (EOS
included), from the same ``score_responses`` forward pass the RL loss uses.
The batch layout is the rollout layout (left-padded prompt, right-padded
response), so no second code path scores sequences. The examples are the
task's (``Task.warmup_examples``), the optimizer ``train_step.make_optimizer``.
"""
from __future__ import annotations

import functools
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from ba_jax.policy import compiling
from ba_jax.update import train_step as ts
from ba_jax.policy.scoring import score_responses

# optax.adamw's default, which the warm-up has always used.
WEIGHT_DECAY = 1e-4


def _sft_loss(params, batch, graphdef):
  model = nnx.merge(graphdef, params)
  logp_NxT, _ = score_responses(model, batch["prompt_ids"],
                                batch["prompt_mask"], batch["response_ids"],
                                batch["response_mask"])
  mask = batch["response_mask"].astype(jnp.float32)
  return -jnp.sum(logp_NxT * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def _sft_step(params, opt_state, batch, *, graphdef, tx):
  loss, grads = jax.value_and_grad(_sft_loss)(params, batch, graphdef)
  updates, opt_state = tx.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, loss


def warmup_batch(task, step: int, batch_size: int, max_new_tokens: int,
                 local: slice) -> dict:
  """Warm-up batch ``step`` of the task's examples, this process's rows."""
  problems, texts = task.warmup_examples(step, batch_size)
  problems, texts = problems[local], texts[local]
  prompt_ids, prompt_mask = task.encode_prompts(problems)
  response_ids, response_mask = task.encode_responses(texts, max_new_tokens)
  return dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask,
              response_ids=response_ids, response_mask=response_mask)


def optimizer(*, steps: int, learning_rate: float, warmup_steps: int):
  """AdamW, linear warm-up then cosine decay to 10% over ``steps``."""
  warmup_steps = max(1, min(warmup_steps, steps // 2))
  return ts.make_optimizer(
      learning_rate=learning_rate, warmup_steps=warmup_steps,
      total_steps=max(steps, warmup_steps + 1), schedule="cosine",
      end_lr_frac=0.1, weight_decay=WEIGHT_DECAY)


def warmup(params, graphdef, task, *, steps: int, batch_size: int,
           learning_rate: float, warmup_steps: int, max_new_tokens: int,
           to_device, mesh=None, rules=None, local=slice(None), log=print
           ) -> Iterator[tuple[int, Any]]:
  """Runs ``steps`` warm-up updates, yielding ``(steps done, params)`` after
  each, so the caller can stop between any two (the caller's ``params``
  arrays are not donated)."""
  tx = optimizer(steps=steps, learning_rate=learning_rate,
                 warmup_steps=warmup_steps)
  step_fn = functools.partial(_sft_step, graphdef=graphdef, tx=tx)
  if mesh is not None:
    param_sharding = ts.tree_shardings(params, mesh, rules)
    opt_sharding = ts.tree_shardings(jax.eval_shape(tx.init, params), mesh,
                                     rules)
    jitted = compiling.jit(step_fn, donate_argnums=(0, 1),
                           in_shardings=(param_sharding, opt_sharding, None),
                           out_shardings=(param_sharding, opt_sharding, None))
    opt_state = jax.jit(tx.init, out_shardings=opt_sharding)(params)
  else:
    jitted = compiling.jit(step_fn, donate_argnums=(0, 1))
    opt_state = tx.init(params)
  params = jax.tree.map(jnp.copy, params)
  losses = []
  for step in range(steps):
    batch = to_device(warmup_batch(task, step, batch_size, max_new_tokens,
                                   local))
    params, opt_state, loss = jitted(params, opt_state, batch)
    losses.append(loss)
    if (step + 1) % max(steps // 5, 1) == 0 or step + 1 == steps:
      log(f"warm-up step {step + 1}/{steps}: loss "
          f"{float(np.mean(jax.device_get(losses[-10:]))):.4f}")
    yield step + 1, params
