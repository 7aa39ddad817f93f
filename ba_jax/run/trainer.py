"""The GRPO training loop: warm-up, rollouts, updates, checkpoints.

``run(config, workdir)`` is what ``python -m ba_jax.train`` calls; the
static setup (validation, mesh, shardings) is ``ba_jax.run.setup``. Each RL
step samples G responses per prompt (``ba_jax.run.rollout``), grades them, forms
advantages, then applies ``ba_jax.update.train_step`` (jitted once, sharded, state
donated). Metrics are logged one step behind; checkpoints are orbax, async,
every ``checkpoint.every`` steps and at the end. A run stops early for one
of ``StopReason``'s reasons, checked between steps: SIGTERM (saves and
returns), ``stop_after_steps`` (the same), or ``rl.max_nonfinite``
non-finite updates in a row (returns; the last checkpoint is intact). The
summary (and ``summary.json``) counts the skipped non-finite updates and
the non-finite steps in a row that ended the run.
"""
from __future__ import annotations

import dataclasses
import enum
import gc
import time
from typing import Callable, Collection

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ba_jax.policy import compiling
from ba_jax.run import checkpointing
from ba_jax.run import checks
from ba_jax.run import metrics as metrics_lib
from ba_jax.run import paths
from ba_jax.run import resume
from ba_jax.run import rollout
from ba_jax.run import tracking
from ba_jax.update import sft
from ba_jax.update import train_step as ts
from ba_jax.run.model_setup import ARCHITECTURE_FIELDS
from ba_jax.policy import lora as lora_lib
from ba_jax.run.setup import (Setup, abstract_saved_state, abstract_state, base_params,
                              full_state, init_params, make_setup, saved_state, to_device,
                              with_adapters)
from ba_jax.run.workdir import write_run_files
from ba_jax.policy.scoring import score_responses

EVAL_KEY = 2**31  # fold_in index of the evaluation key (RL steps use 0..;
# the update's clip_cov draws fold in ts.UPDATE_KEY)
HELDOUT_DIR = "heldout"  # per-problem held-out results, one file per step


class StopReason(enum.StrEnum):
  PREEMPTED = "preempted"  # SIGTERM: saved, resumes on restart
  STOP_AFTER_STEPS = "stop_after_steps"  # saved, resumes on restart
  NONFINITE = "nonfinite"  # rl.max_nonfinite bad updates in a row


def score_logp(params, batch, *, graphdef, temperature: float, prompt_group: int = 1):
  """Log-probs [N, T] of a batch's responses under ``params``: the
  program behind recomputed old log-probs and the KL reference's
  (``prompt_group``: see ``score_responses``)."""
  logp, _ = score_responses(nnx.merge(graphdef, params), batch["prompt_ids"],
                            batch["prompt_mask"], batch["response_ids"],
                            batch["response_mask"], temperature=temperature,
                            prompt_group=prompt_group)
  return logp


def evaluate_correct(setup: Setup, params, key) -> dict[str, np.ndarray]:
  """Held-out correctness per problem: ``sampled`` bool [P, samples] (at
  eval.temperature) and ``greedy`` bool [P, 1]; {} without held-out
  problems."""
  if not setup.task.heldout:
    return {}
  c, model = setup.cfg, nnx.merge(setup.graphdef, params)
  common = dict(max_new_tokens=c.rl.max_new_tokens, mesh=setup.mesh,
                rules=setup.rules, max_slots=setup.rollout_cfg.max_slots,
                prefill_chunk=setup.rollout_cfg.prefill_chunk,
                cache_phases=setup.rollout_cfg.cache_phases)
  return {
      "sampled": rollout.heldout_correct(
          model, setup.task, samples=c.eval.samples_per_problem,
          temperature=c.eval.temperature, key=key, **common),
      "greedy": rollout.heldout_correct(
          model, setup.task, samples=1, temperature=0.0, key=key, **common),
  }


def evaluate(setup: Setup, params, key, *, workdir: str | None = None,
             step: int = 0) -> dict[str, float]:
  """Held-out accuracy: sampled (eval.temperature) and greedy. With
  ``workdir``, process 0 also writes each problem's results to
  ``heldout/step_<step>.json`` (for paired intervals between steps)."""
  tables = evaluate_correct(setup, params, key)
  if not tables:
    return {}
  if workdir is not None and jax.process_index() == 0:
    paths.write_json(
        paths.path(workdir) / HELDOUT_DIR / f"step_{step}.json",
        {name: table.astype(int).tolist() for name, table in tables.items()})
  return {f"heldout_acc_{name}": float(table.mean())
          for name, table in tables.items()}


@dataclasses.dataclass
class _Run:
  """What the phases of one run share."""
  setup: Setup
  workdir: str
  ckpt: checkpointing.Checkpointer
  guard: checkpointing.PreemptionGuard
  base_key: jax.Array
  log: Callable[[str], None]
  nonfinite_streak: int = 0  # non-finite updates in a row, as logged
  logged_until: int | None = None  # resumed: the last step logged before it stopped

  def note(self, record: dict | None) -> None:
    """Counts a logged step's record towards the non-finite streak."""
    if record is not None:
      self.nonfinite_streak = (self.nonfinite_streak + 1
                               if record.get("nonfinite") else 0)

  def stop_reason(self, step: int | None = None) -> StopReason | None:
    """Why the run should stop now (None: it goes on); ``step`` is the RL
    step just done (None during the warm-up)."""
    if self.guard.requested:
      return StopReason.PREEMPTED
    if self.nonfinite_streak >= self.setup.cfg.rl.max_nonfinite:
      return StopReason.NONFINITE
    if step is not None and step == self.setup.cfg.stop_after_steps:
      return StopReason.STOP_AFTER_STEPS
    return None

  def to_device(self, arrays: dict) -> dict:
    return to_device(arrays, self.setup.mesh, self.setup.rules)


def run(config, workdir: str, *, explicit: Collection[str] = (),
        allow_config_change: bool = False) -> dict:
  """Trains (or resumes) in ``workdir``; returns a summary dict.

  ``explicit``: the dotted config keys set on the command line (an
  architecture field among them must agree with ``init_from``).
  ``allow_config_change``: resume even though ``config`` changes the saved
  run's experiment (recorded in ``config_changes.jsonl``; see
  ``ba_jax.run.resume``). A resumed run restores the newest intact checkpoint.
  """
  setup = make_setup(config, explicit=explicit)
  with checks.config_checks():
    tracking.check_backends(setup.cfg.log)
  _ = setup.task  # built (a dataset task reads its files) and checked now
  main = jax.process_index() == 0
  log = (lambda msg: print(msg, flush=True)) if main else (lambda msg: None)
  ckpt = checkpointing.Checkpointer(workdir, keep=config.checkpoint.keep,
                                    async_save=config.checkpoint.async_save)
  summary = {"workdir": workdir}
  with checkpointing.PreemptionGuard() as guard, FrozenHeap() as heap:
    r = _Run(setup, workdir, ckpt, guard, jax.random.key(config.seed), log)
    if ckpt.latest_step() is None:
      state, meta = _start(r)
    else:
      changes = resume.check_config(
          workdir, setup.config, allow_changes=allow_config_change,
          architecture=ARCHITECTURE_FIELDS, record=main)
      if changes:
        log("resuming with a changed config (recorded in "
            f"{resume.CHANGES_FILE}): " + ", ".join(changes))
      latest, state, meta = ckpt.restore_intact(
          abstract_saved_state(setup), warn=log, set_aside=True)
      if setup.lora:
        state = full_state(setup, state, base_params(setup, workdir))
      if main:
        r.logged_until = resume.last_logged_step(workdir)
        resume.drop_replayed_rows(workdir, latest)
      log(f"resumed from {ckpt.directory} at step {latest}")
      r.base_key = jax.random.wrap_key_data(
          jnp.asarray(meta["rng_key"], jnp.uint32))
    if state is None:
      summary.update(stopped=StopReason.PREEMPTED, step=0)
    else:
      summary["before_rl"] = meta["before_rl"]
      summary.update(_loop(r, state, meta, heap))
  ckpt.close()
  return summary


def _start(r: _Run):
  """A fresh run: the run files, the policy, the warm-up, the held-out
  accuracy before RL and the step-0 checkpoint. ``(None, None)`` when
  stopped during the warm-up (it reruns on restart)."""
  setup, c = r.setup, r.setup.cfg
  if jax.process_index() == 0:
    write_run_files(r.workdir, setup)
  if c.init_from:
    r.log(f"policy from {c.init_from} ({setup.model_config.model_type}, "
          f"{setup.model_config.num_layers} layers, params "
          f"{setup.model_config.param_dtype})")
  params = init_params(setup)
  if c.sft.steps:
    r.log(f"supervised warm-up: {c.sft.steps} steps of {c.sft.batch_size}")
    for _, params in sft.warmup(
        params, setup.base_graphdef, setup.task, steps=c.sft.steps,
        batch_size=c.sft.batch_size, learning_rate=c.sft.learning_rate,
        warmup_steps=c.sft.warmup_steps, max_new_tokens=c.rl.max_new_tokens,
        to_device=r.to_device, mesh=setup.mesh, rules=setup.rules,
        local=rollout.process_slice(c.sft.batch_size), log=r.log):
      if r.stop_reason() is not None:
        r.log("SIGTERM during the warm-up: exiting; it reruns on restart")
        return None, None
  if setup.lora:
    base = base_params(setup, r.workdir, params)
    params = with_adapters(setup, base)
    lora = c.model.lora
    r.log(f"LoRA: rank {lora.rank}, alpha {lora.alpha} on "
          f"{'/'.join(lora_lib.adapted_modules(lora.module_path))}; "
          f"{_count(lora_lib.split(params)[0]):,} trainable of "
          f"{_count(params):,} parameters")
  before = evaluate(setup, params, jax.random.fold_in(r.base_key, EVAL_KEY),
                    workdir=r.workdir, step=0)
  r.log(f"held-out accuracy on {len(setup.task.heldout)} problems "
        f"(sampled: T={c.eval.temperature}, {c.eval.samples_per_problem} "
        f"per problem; greedy: 1 each)")
  r.log("held-out accuracy before RL: " + _fmt(before))
  state = compiling.jit(lambda p: ts.create_state(p, setup.tx),
                        out_shardings=setup.state_sharding)(params)
  meta = dict(data_position=0, before_rl=before,
              rng_key=np.asarray(jax.random.key_data(r.base_key)).tolist())
  r.ckpt.save(0, saved_state(setup, state), meta)
  return state, dict(meta, fresh=True)


def _count(params) -> int:
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))


def _fmt(acc: dict) -> str:
  if not acc:
    return "no held-out problems"
  return (f"sampled {acc['heldout_acc_sampled']:.3f}, "
          f"greedy {acc['heldout_acc_greedy']:.3f}")


class FrozenHeap:
  """Keeps Python's cyclic garbage collector off the objects that live
  through a run (``gc.freeze``): the modules, the model, JAX's caches and,
  after ``again``, the programs the first RL step traces. A full collection otherwise
  rescans all of them, a pause of about 0.3 s with torch and transformers
  loaded, once or twice in a 60-step tiny run; objects made during the run are collected
  as usual. On exit the frozen objects go back to the collector
  (``gc.unfreeze``). Inactive when the caller has frozen objects of its own,
  which stay as they are."""

  def __init__(self):
    self.active = False

  def __enter__(self) -> "FrozenHeap":
    self.active = gc.get_freeze_count() == 0
    self.again()
    return self

  def again(self) -> None:
    """Also freezes what has been made since (e.g. the first step's traces)."""
    if self.active:
      gc.freeze()

  def __exit__(self, *exc) -> None:
    if self.active:
      gc.unfreeze()
      self.active = False


def _loop(r: _Run, state, meta, heap: FrozenHeap) -> dict:
  """RL steps from ``state`` until ``rl.steps`` or a stop reason; ``heap``
  freezes again after the first step, whose programs live to the end."""
  setup = r.setup
  c, rl = setup.cfg, setup.cfg.rl
  step_fn = ts.jit_train_step(graphdef=setup.graphdef, tx=setup.tx,
                              cfg=setup.step_cfg,
                              state_sharding=setup.state_sharding,
                              mesh=setup.mesh, rules=setup.rules)
  group = setup.step_cfg.prompt_group
  score = compiling.jit(lambda p, b: score_logp(p, b, graphdef=setup.graphdef,
                                                temperature=rl.temperature, prompt_group=group))
  ref_params = None
  if c.loss.kl_coef > 0 and setup.lora:
    # The reference is the base: the same weights with the adapters off.
    score_ref = compiling.jit(lambda p, b: score_logp(
        lora_lib.adapters_off(p), b, graphdef=setup.graphdef,
        temperature=rl.temperature, prompt_group=group))
  elif c.loss.kl_coef > 0:  # the policy at RL step 0 is the reference
    ref_params = checkpointing.reference_params(
        r.workdir, state.params if meta.get("fresh") else None,
        abstract_state(setup).params)
  start = int(jax.device_get(state.step))
  position = int(meta["data_position"])
  logger = metrics_lib.MetricsLogger(
      r.workdir, total_steps=rl.steps, first_step=start, log=c.log,
      config=setup.config.to_dict(), enabled=jax.process_index() == 0,
      skip_until=r.logged_until)
  if start == 0:
    logger.write_eval(0, meta["before_rl"])
  meta = {k: v for k, v in meta.items() if k != "fresh"}
  save = lambda step: r.ckpt.save(step, saved_state(setup, state), dict(
      meta, data_position=position))
  reason, step = None, start
  while step < rl.steps and reason is None:
    t0 = time.perf_counter()
    key = jax.random.fold_in(r.base_key, step)
    model = nnx.merge(setup.graphdef, state.params)
    ro = rollout.collect(model, setup.task, position=position, key=key,
                         rl=setup.rollout_cfg, mesh=setup.mesh,
                         rules=setup.rules)
    position += ro.prompts_used
    t1 = time.perf_counter()
    batch = r.to_device(dict(
        prompt_ids=ro.prompt_ids, prompt_mask=ro.prompt_mask,
        response_ids=ro.response_ids, response_mask=ro.response_mask,
        advantages=ro.advantages, old_logp=ro.old_logp))
    if rl.old_logp == "recompute":  # the sampler's stay, as behaviour_logp
      batch["behaviour_logp"] = batch["old_logp"]
      batch["old_logp"] = score(state.params, batch)
    if ref_params is not None:
      batch["ref_logp"] = score(ref_params, batch)
    elif c.loss.kl_coef > 0:
      batch["ref_logp"] = score_ref(state.params, batch)
    state, device_metrics = step_fn(state, batch)
    # Wait for the update so that time_training is the update's own time.
    jax.block_until_ready(state.step)
    step += 1
    if step == start + 1:
      heap.again()
    t2 = time.perf_counter()
    samples = None
    if c.log.samples_every and step % c.log.samples_every == 0:
      samples = metrics_lib.sample_rows(ro, setup.task, step=step,
                                        groups=c.log.samples_groups,
                                        step_cfg=setup.step_cfg)
    r.note(logger.push(step, device_metrics, _host_metrics(
        ro, rl.group_size, t0=t0, t1=t1, t2=t2, position=position),
        samples=samples))
    reason = r.stop_reason(step)
    if reason is StopReason.NONFINITE:
      break
    # The step's rows are written before its checkpoint, so a resume from
    # it drops exactly the rows that it replays (resume.drop_replayed_rows).
    if c.eval.every and step % c.eval.every == 0 and step < rl.steps:
      acc = evaluate(setup, state.params,
                     jax.random.fold_in(r.base_key, EVAL_KEY + 1),
                     workdir=r.workdir, step=step)
      logger.write_eval(step, acc)
      logger.log_text(f"step {step}: held-out accuracy " + _fmt(acc))
    every = c.checkpoint.every
    if (every and step % every == 0) or step == rl.steps or reason:
      r.note(logger.flush())
      save(step)
    if reason is not None:
      r.log(f"stopping at step {step} ({reason}); checkpoint saved")
  r.note(logger.flush())
  logger.end_progress()
  if reason is None:
    reason = r.stop_reason()
    if reason is not None:  # SIGTERM after the last step's checkpoint
      r.log(f"stopping after the last step {step} ({reason}); its checkpoint "
            "is saved and the final evaluation runs on restart")
  # Skipped updates over the whole run (the count is part of the state) and
  # the steps in a row that ended it with some: the exit status reads both.
  skipped = {"nonfinite_updates": int(jax.device_get(state.nonfinite)),
             "nonfinite_steps_at_end": r.nonfinite_streak}
  out = {"stopped": reason, "step": step, **skipped}
  if reason is StopReason.NONFINITE:
    r.log(f"{r.nonfinite_streak} steps in a row with a non-finite loss or "
          f"gradient (rl.max_nonfinite={rl.max_nonfinite}); stopping. The "
          f"last checkpoint is intact: {r.ckpt.directory} step "
          f"{r.ckpt.latest_step()}")
    if jax.process_index() == 0:
      paths.write_json(paths.path(r.workdir) / "summary.json",
                       {"step": step, "stopped": str(reason),
                        "before_rl": meta["before_rl"], **skipped})
  elif reason is None:
    r.ckpt.wait()
    out["after_rl"] = _final_eval(r, state, meta["before_rl"], logger, step,
                                  skipped)
  logger.close()
  out.update(history=logger.history, state=state)
  return out


def _host_metrics(ro: rollout.Rollout, group_size: int, *, t0: float,
                  t1: float, t2: float, position: int) -> dict:
  """The step's rollout statistics over the global batch, and timings."""
  gather = rollout.allgather
  host = metrics_lib.rollout_stats(
      gather(ro.rewards), gather(ro.correct), gather(ro.advantages),
      gather(ro.sample_mask), gather(ro.truncated), group_size)
  host.update(metrics_lib.reward_terms(ro.reward_parts))
  host.update(ro.stats, time_training=t2 - t1, time_step=t2 - t0,
              data_position=position)
  host["sampled_tokens"] = float(gather(ro.sample_mask).sum())
  host["tokens_per_s"] = host["sampled_tokens"] / (t2 - t0)
  return host


def _final_eval(r: _Run, state, before: dict, logger, step: int,
                skipped: dict) -> dict:
  after = evaluate(r.setup, state.params,
                   jax.random.fold_in(r.base_key, EVAL_KEY),
                   workdir=r.workdir, step=step)
  logger.write_eval(step, after)
  logger.log_text("held-out accuracy after RL:  " + _fmt(after))
  if after and before:
    logger.log_text(
        f"held-out accuracy, before -> after RL: sampled "
        f"{before['heldout_acc_sampled']:.3f} -> "
        f"{after['heldout_acc_sampled']:.3f}; greedy "
        f"{before['heldout_acc_greedy']:.3f} -> "
        f"{after['heldout_acc_greedy']:.3f}")
  if jax.process_index() == 0:
    paths.write_json(paths.path(r.workdir) / "summary.json",
                     {"step": step, "before_rl": before, "after_rl": after,
                      **skipped})
  return after
