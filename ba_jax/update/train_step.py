"""The pure GRPO update: PPO epochs over one sampled batch, jitted once.

``train_step(state, batch, graphdef=..., tx=..., cfg=...)`` takes the policy
parameters and optimizer state and a batch of scored rollouts and returns the
updated state and device metrics. Everything static (the model graph, the
optimizer, the aggregation mode, the surrogate, the correction and their
options) is bound before ``jax.jit``, so one compiled program serves the
whole run. Each step also logs the sampler-trainer gap
(``ba_jax.loss.mismatch``).

Aggregation weights are computed once per PPO mini-batch, before the
mini-batch is split into micro-batches, so the update does not depend on how
the batch is split (``ba_jax.update.microbatch``). A mini-batch whose loss or
gradient is not finite leaves the state untouched and is counted.

The step holds no PRNG key: the one random term, ``clip_cov``'s draw,
derives its key from ``cfg.seed`` and the step counter in the state
(``update_key``), then folds in the epoch, mini-batch and micro-batch, so
every loss call draws afresh and a resumed run draws what an uninterrupted
one would. Other surrogates trace no key at all.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from ba_jax.policy import compiling
from ba_jax.config import schema
from ba_jax.loss import aggregation as agg
from ba_jax.loss import losses
from ba_jax.loss import mismatch
from ba_jax.loss import objectives
from ba_jax.update import microbatch
from ba_jax.policy import lora as lora_lib
from ba_jax.policy import sharding as sharding_lib
from ba_jax.policy.scoring import score_responses

BATCH_KEYS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask",
              "advantages", "old_logp")


@flax.struct.dataclass
class TrainState:
  """What the update carries from step to step (and what is checkpointed)."""
  step: jax.Array  # int32 scalar: updates applied so far (RL steps)
  params: Any  # nnx.State of the policy's nnx.Param variables (LoRA adapters included)
  opt_state: Any  # optax state of the trainable part of params (``trainable``)
  nonfinite: jax.Array  # int32 scalar: skipped mini-batch updates in total


# StepConfig's fields -> the config keys whose schema entries check them.
SCHEMA_KEYS = {
    "group_size": "rl.group_size", "aggregation": "loss.aggregation",
    "eps_low": "loss.eps_low", "eps_high": "loss.eps_high",
    "dual_clip": "loss.dual_clip", "kl_coef": "loss.kl_coef",
    "kl_type": "loss.kl_type", "entropy_coef": "loss.entropy_coef",
    "reg_aggregation": "loss.reg_aggregation",
    "max_response_len": "loss.max_response_len",
    "ba_denominator": "loss.ba_denominator", "ba_scope": "loss.ba_scope",
    "surrogate": "loss.surrogate", "correction": "loss.correction",
    "correction_cap": "loss.correction_cap",
    "correction_floor": "loss.correction_floor",
    "icepop_low": "loss.icepop_low", "icepop_high": "loss.icepop_high",
    "cispo_cap": "loss.cispo_cap", "sapo_tau_pos": "loss.sapo_tau_pos",
    "sapo_tau_neg": "loss.sapo_tau_neg", "dro_beta": "loss.dro_beta",
    "dppo_tv_low": "loss.dppo_tv_low", "dppo_tv_high": "loss.dppo_tv_high",
    "dppo_kl_low": "loss.dppo_kl_low", "dppo_kl_high": "loss.dppo_kl_high",
    "dppo_cap": "loss.dppo_cap", "kl_cov_ratio": "loss.kl_cov_ratio",
    "kl_cov_coef": "loss.kl_cov_coef", "clip_cov_ratio": "loss.clip_cov_ratio",
    "clip_cov_lb": "loss.clip_cov_lb", "clip_cov_ub": "loss.clip_cov_ub",
    "seed": "seed", "old_logp": "rl.old_logp",
    "ppo_epochs": "rl.ppo_epochs", "num_minibatches": "rl.num_minibatches",
    "num_microbatches": "rl.num_microbatches", "temperature": "rl.temperature",
    "share_prompt": "rl.share_prompt"}


def _default(name: str):
  """The run config's default of StepConfig field ``name``."""
  return schema.default(SCHEMA_KEYS[name])


@dataclasses.dataclass(frozen=True)
class StepConfig:
  """The static options of the update (hashable: part of the jit key).

  Each field is the run config's key ``SCHEMA_KEYS[field]``, with its
  default, except ``eps_high`` (0.2, the symmetric PPO clip, where a run
  config's default is clip-higher 0.28) and ``num_minibatches`` (1: one
  update a step, where a run config's default is 2)."""
  group_size: int
  aggregation: str = _default("aggregation")
  eps_low: float = _default("eps_low")
  eps_high: float = 0.2
  dual_clip: float | None = _default("dual_clip")
  kl_coef: float = _default("kl_coef")
  kl_type: str = _default("kl_type")
  entropy_coef: float = _default("entropy_coef")
  reg_aggregation: str = _default("reg_aggregation")
  max_response_len: int | None = _default("max_response_len")
  ba_denominator: str = _default("ba_denominator")
  ba_scope: str = _default("ba_scope")
  surrogate: str = _default("surrogate")
  correction: str = _default("correction")
  correction_cap: float = _default("correction_cap")
  correction_floor: float | None = _default("correction_floor")
  icepop_low: float = _default("icepop_low")
  icepop_high: float = _default("icepop_high")
  cispo_cap: float = _default("cispo_cap")
  sapo_tau_pos: float = _default("sapo_tau_pos")
  sapo_tau_neg: float = _default("sapo_tau_neg")
  dro_beta: float | None = _default("dro_beta")
  dppo_tv_low: float = _default("dppo_tv_low")
  dppo_tv_high: float = _default("dppo_tv_high")
  dppo_kl_low: float = _default("dppo_kl_low")
  dppo_kl_high: float = _default("dppo_kl_high")
  dppo_cap: float = _default("dppo_cap")
  kl_cov_ratio: float = _default("kl_cov_ratio")
  kl_cov_coef: float = _default("kl_cov_coef")
  clip_cov_ratio: float = _default("clip_cov_ratio")
  clip_cov_lb: float = _default("clip_cov_lb")
  clip_cov_ub: float = _default("clip_cov_ub")
  # The run's seed: clip_cov's draws derive from it (``update_key``).
  seed: int = _default("seed")
  # Where the batch's old_logp come from: "sampler" (its log-probs stand in
  # for old), or "recompute" (the batch then also holds the sampler's as
  # behaviour_logp).
  old_logp: str = _default("old_logp")
  ppo_epochs: int = _default("ppo_epochs")
  num_minibatches: int = 1
  num_microbatches: int = _default("num_microbatches")
  temperature: float = _default("temperature")
  # Each group's prompt computed once in the forward pass (score_responses'
  # prompt_group): micro-batches must then hold whole groups.
  share_prompt: bool = _default("share_prompt")

  @property
  def prompt_group(self) -> int:
    """``score_responses``' prompt_group: the group size when prompts are shared, else 1."""
    return self.group_size if self.share_prompt else 1

  def __post_init__(self):
    for name, dotted in SCHEMA_KEYS.items():
      value = getattr(self, name)
      if name != "max_response_len" or value is not None:
        schema.check(dotted, value)
    objectives.check_combination(
        surrogate=self.surrogate, correction=self.correction,
        aggregation=self.aggregation, dual_clip=self.dual_clip,
        old_logp=self.old_logp, correction_cap=self.correction_cap,
        correction_floor=self.correction_floor, icepop_low=self.icepop_low,
        icepop_high=self.icepop_high, dro_beta=self.dro_beta,
        clip_cov_lb=self.clip_cov_lb, clip_cov_ub=self.clip_cov_ub)

  @property
  def objective(self) -> dict:
    """The surrogate's and the correction's options, as ``policy_loss`` takes them."""
    return {name: getattr(self, name) for name in (
        "surrogate", "correction", "correction_cap", "correction_floor",
        "icepop_low", "icepop_high", "cispo_cap", "sapo_tau_pos", "sapo_tau_neg",
        "dro_beta", "dppo_tv_low", "dppo_tv_high", "dppo_kl_low", "dppo_kl_high",
        "dppo_cap", "kl_cov_ratio", "kl_cov_coef", "clip_cov_ratio",
        "clip_cov_lb", "clip_cov_ub")}

  def check_batch(self, num_rows: int, data_shards: int = 1) -> None:
    """Raises if ``num_rows`` does not split into groups, mini/micro-batches
    and ``data_shards`` devices."""
    g, mb, k = self.group_size, self.num_minibatches, self.num_microbatches
    if num_rows % (g * mb):
      raise ValueError(
          f"batch of {num_rows} rows (prompts_per_step * group_size) does not "
          f"split into rl.num_minibatches={mb} mini-batches of whole groups "
          f"of rl.group_size={g}; prompts_per_step must be a multiple of "
          f"num_minibatches")
    rows = num_rows // mb
    if rows % k:
      raise ValueError(
          f"mini-batch of {rows} rows does not split into "
          f"rl.num_microbatches={k} micro-batches")
    if self.share_prompt and (rows // k) % (g * data_shards):
      raise ValueError(
          f"rl.share_prompt=True: a micro-batch of {rows // k} rows must hold "
          f"whole groups of rl.group_size={g} that split over the "
          f"{data_shards} devices of the batch mesh axes (data x fsdp); "
          f"choose prompts_per_step / (num_minibatches * num_microbatches) "
          f"divisible by {data_shards}, or set rl.share_prompt=False")
    if (rows // k) % data_shards:
      raise ValueError(
          f"micro-batch of {rows // k} rows does not split over the "
          f"{data_shards} devices of the batch mesh axes (data x fsdp); "
          f"choose prompts_per_step * group_size / (num_minibatches * "
          f"num_microbatches) divisible by {data_shards}")


def tree_shardings(tree: Any, mesh, rules) -> Any:
  """NamedShardings for a tree of nnx Variables and plain arrays.

  A Variable is sharded by its logical ``out_sharding`` metadata through
  ``rules`` (optax moments inherit their parameter's metadata); anything
  else (step counters, scalars) is replicated.
  """
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

  def one(x):
    if isinstance(x, nnx.Variable):
      axes = x.get_metadata().get("out_sharding")
      if not axes:
        return x.replace(replicated)
      return x.replace(sharding_lib.logical_sharding(
          mesh, rules, axes, jnp.shape(x.get_value())))
    return replicated

  return jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, nnx.Variable))


def trainable(params) -> tuple[Any, Any]:
  """``(trainable, frozen)`` parts of the policy's state: its LoRA adapters
  and the base weights when it has adapters (``ba_jax.policy.lora``), else
  every parameter and None."""
  if lora_lib.is_adapted(params):
    return lora_lib.split(params)
  return params, None


def _join(train, frozen):
  return train if frozen is None else lora_lib.join(train, frozen)


def create_state(params, tx: optax.GradientTransformation) -> TrainState:
  """Step 0; the optimizer holds state for the trainable part only."""
  return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                    opt_state=tx.init(trainable(params)[0]),
                    nonfinite=jnp.zeros((), jnp.int32))


# The fold_in index of the update's random draws under the run's key
# ``jax.random.key(seed)``; the trainer folds in 0, 1, ... (the RL step) for
# its rollouts and 2**31, 2**31 + 1 for its evaluations.
UPDATE_KEY = 2**31 + 2


def update_key(seed: int, step):
  """The key of RL step ``step``'s update: from the run's seed and the step
  counter alone, so a resumed run gets the key an uninterrupted one had."""
  return jax.random.fold_in(
      jax.random.fold_in(jax.random.key(seed), UPDATE_KEY), step)


def _loss_fn(params, micro, key=None, *, graphdef, cfg: StepConfig,
             keep_logp: bool = False):
  model = nnx.merge(graphdef, params)
  logp_NxT, entropy_NxT = score_responses(
      model, micro["prompt_ids"], micro["prompt_mask"], micro["response_ids"],
      micro["response_mask"], temperature=cfg.temperature,
      prompt_group=cfg.prompt_group)
  out = losses.policy_loss(
      logp_NxT, micro["old_logp"], micro["advantages"], micro["response_mask"],
      group_size=cfg.group_size, aggregation=cfg.aggregation,
      eps_low=cfg.eps_low, eps_high=cfg.eps_high, dual_clip=cfg.dual_clip,
      ref_logp=micro.get("ref_logp"), kl_coef=cfg.kl_coef,
      kl_type=cfg.kl_type, entropy=entropy_NxT,
      entropy_coef=cfg.entropy_coef, reg_aggregation=cfg.reg_aggregation,
      max_response_len=cfg.max_response_len,
      ba_denominator=cfg.ba_denominator, ba_scope=cfg.ba_scope,
      weights=micro["weights"], reg_weights=micro["reg_weights"],
      behaviour_logp=micro.get("behaviour_logp"), key=key, **cfg.objective)
  if keep_logp:  # the current log-probs, for the mismatch metrics
    loss, metrics = out
    return loss, dict(metrics, rows_logp=jax.lax.stop_gradient(logp_NxT))
  return out


def _update(state: TrainState, mini: dict, key=None, *, graphdef, tx,
            cfg: StepConfig, keep_logp: bool = False):
  """One optimizer update on one mini-batch; skipped when not finite. With
  ``keep_logp`` the metrics also hold ``rows_logp``, the mini-batch's
  log-probs before the update; ``key`` (clip_cov only) is the mini-batch's,
  its micro-batch's index folded in for each loss call."""
  mask_NxT = mini["response_mask"].astype(jnp.float32)
  mini = dict(mini, **microbatch.mini_batch_weights(
      mask_NxT, mini["advantages"], aggregation=cfg.aggregation,
      group_size=cfg.group_size, reg_aggregation=cfg.reg_aggregation,
      max_response_len=cfg.max_response_len,
      ba_denominator=cfg.ba_denominator, ba_scope=cfg.ba_scope))
  # Gradients and updates of the trainable part only (LoRA: the adapters).
  train, frozen = trainable(state.params)
  loss_fn = lambda p, micro, key=None: _loss_fn(
      _join(p, frozen), micro, key, graphdef=graphdef, cfg=cfg, keep_logp=keep_logp)
  loss, grads, metrics = microbatch.accumulate_gradients(
      loss_fn, train, mini, num_micro_batches=cfg.num_microbatches, key=key)
  grad_norm = optax.global_norm(grads)
  updates, opt_state = tx.update(grads, state.opt_state, train)
  update_norm = optax.global_norm(updates)
  finite = (jnp.isfinite(loss) & jnp.isfinite(grad_norm)
            & jnp.isfinite(update_norm))
  params = _join(optax.apply_updates(train, updates), frozen)
  keep = lambda new, old: jax.tree.map(
      lambda n, o: jnp.where(finite, n, o), new, old)
  metrics = dict(metrics, loss=loss, grad_norm=grad_norm,
                 update_norm=jnp.where(finite, update_norm, 0.0),
                 nonfinite=(~finite).astype(jnp.int32))
  state = state.replace(params=keep(params, state.params),
                        opt_state=keep(opt_state, state.opt_state),
                        nonfinite=state.nonfinite + metrics["nonfinite"])
  return state, metrics


def _stack_rows(x, parts: int):
  """[N, ...] -> [parts, N // parts, ...], the rows still over the batch mesh axes."""
  x = x.reshape(parts, x.shape[0] // parts, *x.shape[1:])
  return sharding_lib.constrain(x, (None, "activation_batch") + (None,) * (x.ndim - 2))


def train_step(state: TrainState, batch: dict, *, graphdef, tx,
               cfg: StepConfig, mesh_rules=None):
  """PPO epochs x mini-batches of updates on one batch of rollouts.

  Both loops are ``lax.scan``s, so the compiled program holds one update
  body whatever their lengths.

  Args:
    state: the TrainState (donated by the jitted wrapper).
    batch: ``prompt_ids``/``prompt_mask`` [N, P], ``response_ids``/
      ``response_mask`` [N, T], ``advantages`` [N], ``old_logp`` [N, T],
      with ``cfg.old_logp="recompute"`` ``behaviour_logp`` [N, T] (the
      sampler's; needed by a correction) and, when ``cfg.kl_coef > 0``,
      ``ref_logp`` [N, T]; rows group-major.
    mesh_rules: ``(mesh, rules)`` to pin activations to (rows over the batch
      mesh axes, see ``sharding.activation_sharding``); None leaves them to
      the compiler.
  Returns:
    ``(state, metrics)``: metrics averaged over the updates, except
    ``nonfinite`` (summed) and ``*_max`` (max); and the sampler-trainer gap
    (``mismatch.mismatch_metrics``, ``mismatch_*``) over the whole batch
    when it holds ``behaviour_logp``, else over the first mini-batch, whose
    first forward pass is the trainer at the step's start.
  """
  with sharding_lib.activation_sharding(*(mesh_rules or (None,))):
    return _train_step(state, batch, graphdef=graphdef, tx=tx, cfg=cfg)


def _mismatch_source(batch: dict, cfg: StepConfig) -> str | None:
  """Where the trainer's log-probs at the step's start are: "batch" (old_logp,
  recomputed, next to behaviour_logp), "first_update" (the first mini-batch's
  forward pass, before any update) or None (recomputed without the
  sampler's: an abstract batch)."""
  if "behaviour_logp" in batch:
    return "batch"
  return "first_update" if cfg.old_logp == "sampler" else None


def _train_step(state: TrainState, batch: dict, *, graphdef, tx, cfg: StepConfig):
  n = batch["advantages"].shape[0]
  cfg.check_batch(n)
  minis = jax.tree.map(lambda x: _stack_rows(x, cfg.num_minibatches), batch)
  source = _mismatch_source(batch, cfg)
  track_first = source == "first_update"
  update = functools.partial(_update, graphdef=graphdef, tx=tx, cfg=cfg,
                             keep_logp=track_first)

  # clip_cov's keys: the step's, then the epoch's, then each mini-batch's
  # (None for every other surrogate: nothing random is traced).
  step_key = update_key(cfg.seed, state.step) if cfg.surrogate == "clip_cov" else None

  def one_update(carry, xs):
    state, first_logp = carry
    mini, is_first, key = xs
    state, metrics = update(state, mini, key)
    if track_first:
      first_logp = jnp.where(is_first, metrics.pop("rows_logp"), first_logp)
    return (state, first_logp), metrics

  def epoch(carry, epoch_index):
    is_first = (epoch_index == 0) & (jnp.arange(cfg.num_minibatches) == 0)
    keys = None
    if step_key is not None:
      epoch_key = jax.random.fold_in(step_key, epoch_index)
      keys = jax.vmap(lambda i: jax.random.fold_in(epoch_key, i))(
          jnp.arange(cfg.num_minibatches))
    return jax.lax.scan(one_update, carry, (minis, is_first, keys))

  first_logp = jnp.zeros_like(minis["old_logp"][0]) if track_first else None
  (state, first_logp), stacked = jax.lax.scan(
      epoch, (state, first_logp), jnp.arange(cfg.ppo_epochs))
  out = {}  # stacked metrics are [epochs, mini-batches]
  for name, values in stacked.items():
    if name == "nonfinite" or name.endswith("_sum"):
      out[name] = jnp.sum(values)
    elif name.endswith("_max"):
      out[name] = jnp.max(values)
    elif name.endswith("_min"):
      out[name] = jnp.min(values)
    else:
      out[name] = jnp.mean(values)
  # W+/W- over the first epoch: the whole batch's weights as sampled (each
  # mini-batch's weights sum to at most 1, so the batch's are their mean).
  out["w_pos"] = jnp.mean(stacked["w_pos"][0])
  out["w_neg"] = jnp.mean(stacked["w_neg"][0])
  out["param_norm"] = optax.global_norm(trainable(state.params)[0])  # LoRA: the adapters' norm
  options = dict(correction=cfg.correction, cap=cfg.correction_cap,
                 floor=cfg.correction_floor, icepop_low=cfg.icepop_low,
                 icepop_high=cfg.icepop_high)
  if source == "batch":
    out.update(mismatch.mismatch_metrics(batch["old_logp"], batch["behaviour_logp"],
                                         batch["response_mask"], **options))
  elif source == "first_update":  # old_logp are the sampler's here
    out.update(mismatch.mismatch_metrics(first_logp, minis["old_logp"][0],
                                         minis["response_mask"][0], **options))
  return state.replace(step=state.step + 1), out


def jit_train_step(*, graphdef, tx, cfg: StepConfig, state_sharding=None,
                   batch_sharding=None, mesh=None, rules=None):
  """``train_step`` jitted with the statics bound, shardings set and the
  state donated; with ``mesh``, activations are pinned by ``rules``."""
  mesh_rules = None if mesh is None else (mesh, rules or sharding_lib.DEFAULT_RULES)
  fn = functools.partial(train_step, graphdef=graphdef, tx=tx, cfg=cfg, mesh_rules=mesh_rules)
  kwargs = {}
  if state_sharding is not None:
    kwargs = dict(in_shardings=(state_sharding, batch_sharding),
                  out_shardings=(state_sharding, None))
  return compiling.jit(fn, donate_argnums=0, **kwargs)


def make_optimizer(*, learning_rate: float, warmup_steps: int,
                   total_steps: int, schedule: str = "constant",
                   end_lr_frac: float = 0.1, weight_decay: float = 0.0,
                   b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                   grad_clip: float = 1.0) -> optax.GradientTransformation:
  """AdamW with linear warm-up, then constant or cosine decay; global-norm
  clipping first. The schedule counts optimizer updates."""
  agg.check_option("optim.schedule", schedule, ("constant", "cosine"))
  if schedule == "cosine":
    lr = optax.warmup_cosine_decay_schedule(
        0.0, learning_rate, max(warmup_steps, 0), max(total_steps, 1),
        end_value=learning_rate * end_lr_frac)
  elif warmup_steps > 0:
    lr = optax.join_schedules([
        optax.linear_schedule(0.0, learning_rate, warmup_steps),
        optax.constant_schedule(learning_rate)], [warmup_steps])
  else:
    lr = optax.constant_schedule(learning_rate)
  parts = [optax.clip_by_global_norm(grad_clip)] if grad_clip > 0 else []
  parts.append(optax.adamw(lr, b1=b1, b2=b2, eps=eps,
                           weight_decay=weight_decay))
  return optax.chain(*parts)


def optimizer(optim: schema.Optim, total_updates: int) -> optax.GradientTransformation:
  """``make_optimizer`` from the config's ``optim`` section, for a run of
  ``total_updates`` optimizer updates."""
  return make_optimizer(
      learning_rate=optim.learning_rate, warmup_steps=optim.warmup_steps,
      total_steps=total_updates,
      schedule=optim.schedule, end_lr_frac=optim.end_lr_frac,
      weight_decay=optim.weight_decay, b1=optim.b1, b2=optim.b2,
      eps=optim.eps, grad_clip=optim.grad_clip)
