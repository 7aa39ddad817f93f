"""Supervised warm-up: teacher-forced cross-entropy on task responses.

The loss is the mean negative log-likelihood of the response tokens (EOS
included), from the same ``score_responses`` forward pass the RL loss uses.
The batch layout is the rollout layout (left-padded prompt, right-padded
response), so no second code path scores sequences.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from ba_jax.scoring import score_responses
from ba_jax.train_step import tree_shardings


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
  """Warm-up batch ``step``: problems of stream 1, this process's rows."""
  problems = task.problems(step * batch_size, batch_size, stream=1)[local]
  rng = np.random.default_rng([task.seed, 3, step])
  texts = [task_response(task, p, rng) for p in problems]
  prompt_ids, prompt_mask = task.encode_prompts(problems)
  response_ids, response_mask = task.encode_responses(texts, max_new_tokens)
  return dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask,
              response_ids=response_ids, response_mask=response_mask)


def task_response(task, problem, rng) -> str:
  from ba_jax import synthetic
  return synthetic.sft_response(problem, rng, task.cfg)[0]


def warmup(params, graphdef, task, *, steps: int, batch_size: int,
           learning_rate: float, warmup_steps: int, max_new_tokens: int,
           to_device, mesh=None, rules=None, local=slice(None), log=print,
           should_stop=lambda: False):
  """Runs ``steps`` warm-up updates and returns the new params (or None when
  stopped early by ``should_stop``)."""
  warmup_steps = max(1, min(warmup_steps, steps // 2))
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, learning_rate, warmup_steps, max(steps, warmup_steps + 1),
      end_value=0.1 * learning_rate)
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule))
  step_fn = functools.partial(_sft_step, graphdef=graphdef, tx=tx)
  if mesh is not None:
    param_sharding = tree_shardings(params, mesh, rules)
    opt_sharding = tree_shardings(jax.eval_shape(tx.init, params), mesh, rules)
    jitted = jax.jit(step_fn, donate_argnums=(0, 1),
                     in_shardings=(param_sharding, opt_sharding, None),
                     out_shardings=(param_sharding, opt_sharding, None))
    opt_state = jax.jit(tx.init, out_shardings=opt_sharding)(params)
  else:
    jitted = jax.jit(step_fn, donate_argnums=(0, 1))
    opt_state = tx.init(params)
  params = jax.tree.map(jnp.copy, params)  # the caller's arrays survive
  losses = []
  for step in range(steps):
    if should_stop():
      return None
    batch = to_device(warmup_batch(task, step, batch_size, max_new_tokens,
                                   local))
    params, opt_state, loss = jitted(params, opt_state, batch)
    losses.append(loss)
    if (step + 1) % max(steps // 5, 1) == 0 or step + 1 == steps:
      log(f"warm-up step {step + 1}/{steps}: loss "
          f"{float(np.mean(jax.device_get(losses[-10:]))):.4f}")
  return params
