"""The GRPO training loop: warm-up, rollouts, updates, checkpoints.

``run(config, workdir)`` is what ``python -m ba_jax.train`` calls; the
static setup (validation, mesh, shardings) is ``ba_jax.run_setup``. Each RL
step samples G responses per prompt (``ba_jax.rollout``), grades them, forms
advantages, then applies ``ba_jax.train_step`` (jitted once, sharded, state
donated). Metrics are logged one step behind; checkpoints are orbax, async,
every ``checkpoint.every`` steps and at the end; SIGTERM saves and returns.
"""
from __future__ import annotations

import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ba_jax import checkpointing, metrics as metrics_lib, rollout, sft
from ba_jax import train_step as ts
from ba_jax.run_setup import (  # noqa: F401  (public through this module)
    Setup, abstract_state, build_model_config, init_params, load_tokenizer,
    make_setup, step_config, to_device, validate)
from ba_jax.scoring import score_responses

EVAL_KEY = 2**31  # fold_in index of the evaluation key (RL steps use 0..)


def _score_fn(params, batch, *, graphdef, temperature):
  logp, _ = score_responses(nnx.merge(graphdef, params), batch["prompt_ids"],
                            batch["prompt_mask"], batch["response_ids"],
                            batch["response_mask"], temperature=temperature)
  return logp


def evaluate(setup: Setup, params, key) -> dict[str, float]:
  """Held-out accuracy: sampled (eval.temperature) and greedy."""
  if not setup.task.heldout:
    return {}
  c, model = setup.config, nnx.merge(setup.graphdef, params)
  common = dict(max_new_tokens=c.rl.max_new_tokens, mesh=setup.mesh,
                rules=setup.rules)
  return {
      "heldout_acc_sampled": rollout.heldout_accuracy(
          model, setup.task, samples=c.eval.samples_per_problem,
          temperature=c.eval.temperature, key=key, **common),
      "heldout_acc_greedy": rollout.heldout_accuracy(
          model, setup.task, samples=1, temperature=0.0, key=key, **common),
  }


class _Stop(Exception):
  pass


def run(config, workdir: str) -> dict:
  """Trains (or resumes) in ``workdir``; returns a summary dict."""
  setup = make_setup(config)
  c, mesh, rules = config, setup.mesh, setup.rules
  main = jax.process_index() == 0
  log = (lambda msg: print(msg, flush=True)) if main else (lambda msg: None)
  ckpt = checkpointing.Checkpointer(workdir, keep=c.checkpoint.keep,
                                    async_save=c.checkpoint.async_save)
  base_key = jax.random.key(c.seed)
  dev = lambda arrays: to_device(arrays, mesh, rules)
  summary = {"workdir": workdir}
  with checkpointing.PreemptionGuard() as guard:
    latest = ckpt.latest_step()
    if latest is None:
      if main:
        checkpointing.write_run_files(
            workdir, config_json=c.to_json(), model_config=setup.model_config,
            tokenizer=setup.tokenizer)
      params = init_params(setup)
      if c.sft.steps:
        log(f"supervised warm-up: {c.sft.steps} steps of {c.sft.batch_size}")
        params = sft.warmup(
            params, setup.graphdef, setup.task, steps=c.sft.steps,
            batch_size=c.sft.batch_size, learning_rate=c.sft.learning_rate,
            warmup_steps=c.sft.warmup_steps,
            max_new_tokens=c.rl.max_new_tokens, to_device=dev, mesh=mesh,
            rules=rules, local=rollout.process_slice(c.sft.batch_size),
            log=log, should_stop=lambda: guard.requested)
        if params is None:
          log("SIGTERM during the warm-up: exiting; it reruns on restart")
          ckpt.close()
          return dict(summary, preempted=True, step=0)
      before = evaluate(setup, params, jax.random.fold_in(base_key, EVAL_KEY))
      log(f"held-out accuracy on {len(setup.task.heldout)} problems "
          f"(sampled: T={c.eval.temperature}, {c.eval.samples_per_problem} "
          f"per problem; greedy: 1 each)")
      log("held-out accuracy before RL: " + _fmt(before))
      state = jax.jit(lambda p: ts.create_state(p, setup.tx),
                      out_shardings=setup.state_sharding)(params)
      meta = dict(data_position=0, before_rl=before,
                  rng_key=np.asarray(jax.random.key_data(base_key)).tolist())
      ckpt.save(0, state, meta)
      meta = dict(meta, fresh=True)
    else:
      state, meta = ckpt.restore(abstract_state(setup), latest)
      log(f"resumed from {ckpt.directory} at step {latest}")
      base_key = jax.random.wrap_key_data(
          jnp.asarray(meta["rng_key"], jnp.uint32))
    summary["before_rl"] = meta["before_rl"]
    summary.update(_loop(setup, state, meta, ckpt, guard, base_key, workdir,
                         dev, log))
  ckpt.close()
  return summary


def _fmt(acc: dict) -> str:
  if not acc:
    return "no held-out problems"
  return (f"sampled {acc['heldout_acc_sampled']:.3f}, "
          f"greedy {acc['heldout_acc_greedy']:.3f}")


def _loop(setup, state, meta, ckpt, guard, base_key, workdir, dev, log):
  c, rl = setup.config, setup.config.rl
  step_fn = ts.jit_train_step(graphdef=setup.graphdef, tx=setup.tx,
                              cfg=setup.step_cfg,
                              state_sharding=setup.state_sharding)
  score = jax.jit(lambda p, b: _score_fn(p, b, graphdef=setup.graphdef,
                                         temperature=rl.temperature))
  ref_params = None
  if c.loss.kl_coef > 0:  # the policy at RL step 0 is the reference
    ref_params = checkpointing.reference_params(
        workdir, state.params if meta.get("fresh") else None,
        abstract_state(setup).params)
  start = int(jax.device_get(state.step))
  position = int(meta["data_position"])
  logger = metrics_lib.MetricsLogger(
      workdir, total_steps=rl.steps, first_step=start,
      tensorboard=c.log.tensorboard, progress_bar=c.log.progress_bar,
      enabled=jax.process_index() == 0)
  if start == 0:
    logger.write_eval(0, meta["before_rl"])
  bad_in_a_row = [0]

  def on_record(record):
    bad_in_a_row[0] = bad_in_a_row[0] + 1 if record.get("nonfinite") else 0
    if bad_in_a_row[0] >= rl.max_nonfinite:
      raise _Stop(f"{bad_in_a_row[0]} steps in a row with a non-finite loss "
                  f"or gradient (rl.max_nonfinite={rl.max_nonfinite}); "
                  f"stopping. The last checkpoint is intact: "
                  f"{ckpt.directory} step {ckpt.latest_step()}")

  logger.on_record = on_record
  meta = {k: v for k, v in meta.items() if k != "fresh"}
  save = lambda step: ckpt.save(step, state, dict(
      meta, data_position=position))
  out = {"stopped": None}
  step = start
  try:
    while step < rl.steps:
      t0 = time.perf_counter()
      key = jax.random.fold_in(base_key, step)
      model = nnx.merge(setup.graphdef, state.params)
      ro = rollout.collect(model, setup.task, position=position, key=key,
                           rl=rl, mesh=setup.mesh, rules=setup.rules)
      position += ro.prompts_used
      t1 = time.perf_counter()
      batch = dev(dict(prompt_ids=ro.prompt_ids, prompt_mask=ro.prompt_mask,
                       response_ids=ro.response_ids,
                       response_mask=ro.response_mask,
                       advantages=ro.advantages, old_logp=ro.old_logp))
      if rl.old_logp == "recompute":
        batch["old_logp"] = score(state.params, batch)
      if ref_params is not None:
        batch["ref_logp"] = score(ref_params, batch)
      state, device_metrics = step_fn(state, batch)
      jax.block_until_ready(state.step)  # honest time split (see docstring)
      step += 1
      t2 = time.perf_counter()
      gather = rollout.allgather  # statistics of the global batch
      host = metrics_lib.rollout_stats(
          gather(ro.rewards), gather(ro.correct), gather(ro.advantages),
          gather(ro.sample_mask), gather(ro.truncated), rl.group_size)
      host.update(ro.stats, time_training=t2 - t1, time_step=t2 - t0,
                  data_position=position)
      host["sampled_tokens"] = float(gather(ro.sample_mask).sum())
      host["tokens_per_s"] = host["sampled_tokens"] / (t2 - t0)
      logger.push(step, device_metrics, host)
      every = c.checkpoint.every
      if (every and step % every == 0) or step == rl.steps:
        save(step)
      if c.eval.every and step % c.eval.every == 0 and step < rl.steps:
        acc = evaluate(setup, state.params, jax.random.fold_in(base_key, EVAL_KEY + 1))
        logger.write_eval(step, acc)
        logger.log_text(f"step {step}: held-out accuracy " + _fmt(acc))
      if guard.requested or step == c.stop_after_steps:
        logger.flush()
        save(step)
        out["stopped"] = "preempted" if guard.requested else "stop_after_steps"
        log(f"stopping at step {step} ({out['stopped']}); checkpoint saved")
        break
    logger.flush()
    if step == rl.steps and out["stopped"] is None:
      ckpt.wait()
      out["after_rl"] = _final_eval(setup, state, meta, base_key, workdir,
                                    logger, step)
  except _Stop as e:
    out["stopped"] = "nonfinite"
    log(str(e))
  finally:
    logger.close()
  out.update(step=step, history=logger.history)
  out["state"] = state
  return out


def _final_eval(setup, state, meta, base_key, workdir, logger, step) -> dict:
  after = evaluate(setup, state.params, jax.random.fold_in(base_key, EVAL_KEY))
  logger.write_eval(step, after)
  logger.log_text("held-out accuracy after RL:  " + _fmt(after))
  before = meta["before_rl"]
  if after and before:
    logger.log_text(
        f"held-out accuracy, before -> after RL: sampled "
        f"{before['heldout_acc_sampled']:.3f} -> "
        f"{after['heldout_acc_sampled']:.3f}; greedy "
        f"{before['heldout_acc_greedy']:.3f} -> "
        f"{after['heldout_acc_greedy']:.3f}")
  if jax.process_index() == 0:
    with open(os.path.join(workdir, "summary.json"), "w") as f:
      json.dump({"step": step, "before_rl": before, "after_rl": after}, f,
                indent=1)
  return after
