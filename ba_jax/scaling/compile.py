"""Compile a config's train step and sampler without weights; report memory and FLOPs.

    python -m ba_jax.dry_run --config=configs/qwen25_math_7b_dapo17k.py \\
        --num_cpu_devices=64

compiles the WHOLE train step (every PPO epoch and mini-batch, under their
``lax.scan``) and the rollout's program on the config's own mesh (fsdp 16 x
tensor 4 for the paper configs), and says per named TPU slice
(``TPU_HBM_GIB``) whether each program's per-device peak fits one chip's HBM.
The rollout's program is the continuous-batching engine when the config's
decode slots (``rl.max_slots`` per process, or ``rl.kv_cache_gib`` per
device) are fewer than the rows, else the static sampler
(``--config.rl.kv_cache_gib=0`` compiles that one for a paper config). For
the engine the report also gives, per named slice, the most slots per device
that fit: the compiled peak less its KV cache, plus the cache's bytes per
slot (``kv_cache.bytes_per_device``), an estimate (``slots_that_fit``).

``dry_run(config)`` builds the run abstractly with the trainer's own builder
(``setup_lib.make_setup(config, abstract=True)``: no tokenizer, no
parameter is ever allocated), then lowers and compiles
the trainer's own jitted train step and the sampler's jitted program on
``jax.ShapeDtypeStruct`` inputs that carry their shardings, and reports per
device the bytes of ``compiled.memory_analysis()`` and the FLOPs of
``compiled.cost_analysis()``, next to analytic FLOP estimates.

- Memory is per device on the mesh printed. ``peak`` = arguments + outputs -
  aliased (the donated state) + temporaries + generated code. On CPU it is
  XLA:CPU's buffer assignment: an estimate for an accelerator.
- XLA counts a loop's body once: the update, micro-batch and layer
  ``lax.scan`` of the train step and the decode ``while_loop`` of the
  sampler. The analytic figures are given for the whole program and "as XLA
  counts" (one micro-batch of one update through one layer and the LM head;
  the prefill and one decode step) to compare with XLA's.
- Analytic FLOPs: 2 x matmul parameters per token and pass (forward 1 pass,
  backward 2, remat 1 more), plus attention as this model computes it (the
  full L x S score matrix, no causal skipping).
- ``one_update=True`` (not the default) compiles a single mini-batch update
  (one of ``ppo_epochs x num_minibatches``, same rows and micro-batches)
  instead of the whole step. Since the updates run under one ``lax.scan``
  the whole step compiles in about the same time, so this is only a check:
  the full batch's argument bytes are added; temporaries and XLA's FLOPs are
  one update's either way.
"""
from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from ba_jax.policy import attention as attention_lib
from ba_jax.policy import compiling
from ba_jax.scaling import flops as flops_lib
from ba_jax.scaling import roofline as roofline_lib
from ba_jax.scaling import targets as targets_lib
from ba_jax.generation import engine as engine_lib
from ba_jax.policy import kv_cache as kv_cache_lib
from ba_jax.policy import model as model_lib
from ba_jax.run import setup as setup_lib
from ba_jax.generation import sampler as sampler_lib
from ba_jax.policy import sharding as sharding_lib
from ba_jax.update import train_step as ts
from ba_jax.run import trainer


# HBM per chip, GiB (Google Cloud's published TPU specifications).
TPU_HBM_GIB = {"v4": 32, "v5e": 16, "v5p": 95, "v6e": 32}
ESTIMATE_NOTE = ("memory is XLA:CPU's buffer assignment for these programs: "
                 "an estimate of an accelerator's, not a measurement on one")
MEMORY_FIELDS = targets_lib.MEMORY_FIELDS
# LLVM's optimisation level changes neither XLA's buffer assignment (memory)
# nor its HLO (FLOPs); lowering it halves the CPU compile time.
CPU_COMPILER_OPTIONS = {"xla_backend_optimization_level": 0,
                        "xla_llvm_disable_expensive_passes": True}




def _compile(lowered, platform: str) -> dict:
  t0 = time.perf_counter()
  compiled = lowered.compile(
      compiler_options=CPU_COMPILER_OPTIONS if platform == "cpu" else None)
  return dict(memory=targets_lib.memory_of(compiled),
              flops_per_device=targets_lib.cost_of(compiled).get("flops", float("nan")),
              compile_s=round(time.perf_counter() - t0, 1))


def _abstract_batch(rows: int, prompt_len: int, response_len: int, mesh,
                    rules, with_ref: bool, with_behaviour: bool = False) -> dict:
  shapes = dict(prompt_ids=((rows, prompt_len), jnp.int32),
                prompt_mask=((rows, prompt_len), jnp.int32),
                response_ids=((rows, response_len), jnp.int32),
                response_mask=((rows, response_len), jnp.int32),
                advantages=((rows,), jnp.float32),
                old_logp=((rows, response_len), jnp.float32))
  if with_ref:
    shapes["ref_logp"] = ((rows, response_len), jnp.float32)
  if with_behaviour:  # the sampler's log-probs, kept when the trainer recomputes old ones
    shapes["behaviour_logp"] = ((rows, response_len), jnp.float32)
  return {name: jax.ShapeDtypeStruct(shape, dtype, sharding=(
      sharding_lib.data_sharding(mesh, rules, len(shape))))
          for name, (shape, dtype) in shapes.items()}


def _bytes_per_device(tree) -> int:
  return sum(int(np.prod(x.sharding.shard_shape(x.shape)))
             * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def dry_run(config, *, devices=None, target: targets_lib.Target | None = None,
            sample: bool = True, one_update: bool = False, train: bool = True) -> dict:
  """Compiles one train step (and the sampler) of ``config`` abstractly;
  with ``target``, for that chip's slice by its own compiler
  (``ba_jax.scaling.targets``), else on ``devices`` (XLA:CPU: an estimate).
  See ``_dry_run``."""
  if target is None:
    return _dry_run(config, devices=devices, sample=sample, one_update=one_update, train=train)
  devices = targets_lib.target_devices(target)
  capacity = targets_lib.hbm_capacity(target, devices)
  compile_fn = functools.partial(targets_lib.compile_on_target, capacity=capacity)
  notes = []
  if target.platform == "gpu" and attention_lib.resolve_impl(
      config.model.attention_impl,
      head_dim=config.model.head_dim or config.model.hidden_size // config.model.num_heads,
      dtype=config.model.dtype, backend="gpu") == "cudnn":
    # cuDNN's attention checks the cuDNN library while tracing, and a
    # compile-only host has none: XLA's own attention stands in for it.
    config = config.copy_and_resolve_references()
    config.model.attention_impl = "xla"
    notes.append("attention: cuDNN (what 'auto' picks on this GPU) cannot be traced "
                 "without the cuDNN library on this host, so XLA's fused attention "
                 "(jax.nn.dot_product_attention implementation='xla') was compiled in "
                 "its place; a run on the GPU uses cuDNN")
  with compiling.targeting(target.platform):
    report = _dry_run(config, devices=devices, sample=sample, one_update=one_update,
                      train=train, compile_fn=compile_fn)
  report["notes"] += notes
  engine = report.get("engine", {})
  if "memory" in engine:  # slots for this chip, with the headroom kept free
    usable = int((1 - targets_lib.HEADROOM) * capacity)
    engine["chip_bytes"] = {target.chip.name: usable}
    engine["slots_that_fit"] = slots_that_fit(engine, engine["rows_per_device"],
                                              engine["chip_bytes"])
  report["roofline"] = roofline_lib.estimate(report, target.chip)
  report["target"] = dict(name=target.name, chip=target.chip.name, topology=target.topology,
                          num_slices=target.num_slices, capacity_bytes=capacity,
                          device_kind=devices[0].device_kind,
                          compiler=("XLA:TPU (libtpu)" if target.platform == "tpu"
                                    else "XLA:GPU (jax-cuda12-plugin)"),
                          headroom=targets_lib.HEADROOM)
  return report


def _dry_run(config, *, devices=None, sample: bool = True, one_update: bool = False,
             train: bool = True, compile_fn=None) -> dict:
  """Compiles one train step (and the sampler) of ``config`` abstractly.

  Args:
    config: a trainer config (``configs/*.py``); ``config.mesh`` must fit
      ``devices``. Shapes: ``rl.prompts_per_step * rl.group_size`` rows of
      ``task.max_prompt_len`` prompt and ``rl.max_new_tokens`` response
      tokens.
    devices: the devices of the mesh (default: all).
    sample: also compile the rollout's program for one step's prompts: the
      continuous-batching engine when the config's decode slots
      (``rl.max_slots`` or ``rl.kv_cache_gib``) are fewer than the rows,
      else the static sampler (and the trainer's scoring program when the
      config recomputes old log-probs or has a KL term).
    one_update: compile one mini-batch update instead of the whole step
      (see the module docstring).
    train: compile the train step (False: only the rollout's programs).
  Returns:
    A JSON-able dict: mesh, shapes, parameter counts, analytic FLOPs, notes,
    and per program the per-device memory (bytes), XLA FLOPs per device and
    compile seconds.
  """
  if config.model.get("scan_unroll", 1) == 0:
    # "auto" would unroll every layer on these CPU devices; the dry run
    # compiles what the accelerator runs: one layer body per scan step.
    config = config.copy_and_resolve_references()
    config.model.scan_unroll = 1
  setup = setup_lib.make_setup(config, abstract=True, devices=devices)
  mesh, rules, rl = setup.mesh, setup.rules, setup.cfg.rl
  model_config = setup.model_config
  platform = mesh.devices.flat[0].platform
  compile_fn = compile_fn or functools.partial(_compile, platform=platform)
  B, G, T = rl.prompts_per_step, rl.group_size, rl.max_new_tokens
  N, P = B * G, setup.cfg.task.max_prompt_len
  state_in = setup_lib.abstract_state(setup)
  with_ref = setup.cfg.loss.kl_coef > 0
  with_behaviour = rl.old_logp == "recompute"
  batch_in = _abstract_batch(N, P, T, mesh, rules, with_ref, with_behaviour)

  counts = flops_lib.param_counts(setup.abstract_params, model_config)
  report = {
      "platform": platform,
      "devices": mesh.size,
      "mesh": {k: int(v) for k, v in mesh.shape.items()},
      "batch_shards": setup.batch_shards,
      "shapes": dict(prompts=B, group_size=G, rows=N, prompt_len=P,
                     response_len=T, ppo_epochs=rl.ppo_epochs,
                     num_minibatches=rl.num_minibatches,
                     num_microbatches=rl.num_microbatches,
                     micro_batch_rows=N // (rl.num_minibatches
                                            * rl.num_microbatches)),
      "model": dict(model_type=model_config.model_type,
                    params=counts["total"], matmul_params=counts["matmul"],
                    trainable=sum(int(np.prod(x.shape)) for x in jax.tree.leaves(
                        ts.trainable(setup.abstract_params)[0])),
                    lora_rank=setup.cfg.model.lora.rank,
                    remat=model_config.remat, dtype=model_config.dtype,
                    param_dtype=model_config.param_dtype),
      "analytic_flops": flops_lib.analytic_flops(
          model_config, counts["matmul"], rows=N, prompts=B, prompt_len=P,
          response_len=T, ppo_epochs=rl.ppo_epochs,
          micro_batches=rl.num_microbatches,
          prompt_bucket=sampler_lib.bucket_length(P),
          minibatches=rl.num_minibatches,
          logprob_chunk=model_config.logprob_chunk,
          attention_tile=(model_config.attention_block if attention_lib.resolve_impl(
              model_config.attention_impl, head_dim=model_config.head_dim,
              dtype=model_config.dtype, backend=platform) == "blockwise" else None)),
      "notes": _notes(model_config, P, T, platform),
  }

  if train:
    report["train_step"] = _dry_run_train(
        setup, state_in, batch_in, one_update=one_update,
        shapes=(P, T, mesh, rules, with_ref, with_behaviour), compile_fn=compile_fn)
  if sample and uses_engine(setup):
    # The trainer keeps the optimizer state (and a KL reference's
    # parameters) on the devices while it samples.
    resident = _bytes_per_device(state_in) - _bytes_per_device(state_in.params)
    if with_ref:
      resident += _bytes_per_device(state_in.params)
    report["engine"] = _dry_run_engine(setup, state_in.params, platform, compile_fn,
                                       resident)
  elif sample:
    report["sample"] = _dry_run_sampler(setup, state_in.params, compile_fn)
  if sample and (rl.old_logp == "recompute" or with_ref):
    report["score"] = _dry_run_score(setup, state_in.params, batch_in,
                                     compile_fn)
  return report


def _notes(c: model_lib.ModelConfig, prompt_len: int, response_len: int,
           platform: str) -> list[str]:
  notes = []
  if prompt_len + response_len > c.max_position_embeddings:
    notes.append(f"prompt_len + response_len = {prompt_len + response_len} "
                 f"exceeds model.max_position_embeddings = "
                 f"{c.max_position_embeddings}")
  if platform == "cpu" and "bfloat16" in (c.dtype, c.param_dtype):
    notes.append("XLA:CPU computes bfloat16 element-wise ops in float32, "
                 "and the float32-accumulated products (attention scores, "
                 "LM head) on float32 copies of their operands, so its "
                 "temporaries for them (optimizer update, softmax, those "
                 "operands) are up to twice an accelerator's")
  return notes


def _dry_run_train(setup, state_in, batch_in, *, one_update, shapes,
                   compile_fn) -> dict:
  """Compiles the trainer's jitted step (or one of its updates)."""
  step_cfg = setup.step_cfg
  updates = step_cfg.ppo_epochs * step_cfg.num_minibatches
  compiled_cfg, step_batch = step_cfg, batch_in
  if one_update and updates > 1:
    compiled_cfg = dataclasses.replace(step_cfg, ppo_epochs=1,
                                       num_minibatches=1)
    rows = batch_in["advantages"].shape[0] // step_cfg.num_minibatches
    step_batch = _abstract_batch(rows, *shapes)
  step_fn = ts.jit_train_step(
      graphdef=setup.graphdef, tx=setup.tx, cfg=compiled_cfg,
      state_sharding=setup.state_sharding,
      batch_sharding={k: v.sharding for k, v in step_batch.items()},
      mesh=setup.mesh, rules=setup.rules)
  out = compile_fn(step_fn.lower(state_in, step_batch))
  out["updates_compiled"] = (compiled_cfg.ppo_epochs
                             * compiled_cfg.num_minibatches)
  if out["updates_compiled"] != updates:
    extra = _bytes_per_device(batch_in) - _bytes_per_device(step_batch)
    out["one_update_memory"] = dict(out["memory"])
    out["memory"]["argument"] += extra
    out["memory"]["peak"] += extra
    # No FLOP scaling: the whole step's updates are a lax.scan, which XLA
    # counts once too, so both figures are one update's.
  return out


def _dry_run_sampler(setup, params_in, compile_fn) -> dict:
  """The sampler's program for one step's prompts (the model skips remat on
  its cached path, so a remat config lowers as it is)."""
  rl = setup.rollout_cfg
  lowered = sampler_lib.lower_sample(
      setup.graphdef, params_in, prompts=rl.prompts_per_step,
      prompt_len=setup.cfg.task.max_prompt_len, group_size=rl.group_size,
      max_new_tokens=rl.max_new_tokens, temperature=rl.temperature,
      top_p=rl.top_p, top_k=rl.top_k, mesh=setup.mesh, rules=setup.rules)
  out = compile_fn(lowered)
  out["prompt_bucket"] = sampler_lib.bucket_length(
      setup.cfg.task.max_prompt_len)
  return out


def uses_engine(setup) -> bool:
  """Whether the config's rollouts run through the engine
  (``sampler.uses_engine`` with its slots per process, from ``rl.max_slots``
  or ``rl.kv_cache_gib``, and this process's rows)."""
  rl = setup.rollout_cfg
  return sampler_lib.uses_engine(
      rl.max_slots, rl.prompts_per_step * rl.group_size // jax.process_count())


def _dry_run_engine(setup, params_in, platform, compile_fn, resident: int) -> dict:
  """The engine's program for one step's prompts through the config's slots,
  and the cache's share of it (to size the slots for each named slice);
  ``resident``: bytes per device the trainer holds besides (the AdamW
  moments)."""
  rl, c = setup.rollout_cfg, setup.model_config
  mesh, rules = setup.mesh, setup.rules
  slots = rl.max_slots * jax.process_count()
  bucket = sampler_lib.bucket_length(setup.cfg.task.max_prompt_len)
  length = engine_lib.cache_length(bucket, rl.max_new_tokens, rl.prefill_chunk)
  # XLA:CPU has no bfloat16 scatter or dynamic-update-slice: it would write
  # a bfloat16 cache through float32 copies of its keys and values (convert,
  # write, convert back in the compiled HLO), which an accelerator writes in
  # place. So a float32 cache is compiled here and swapped for the model's
  # in the accelerator estimate.
  compiled_dtype = None
  if platform == "cpu" and jnp.dtype(c.dtype).itemsize < 4:
    compiled_dtype = "float32"
  lowered = engine_lib.lower(
      setup.graphdef, params_in, prompts=rl.prompts_per_step,
      prompt_len=bucket, group_size=rl.group_size,
      max_new_tokens=rl.max_new_tokens, slots=slots, mesh=mesh, rules=rules,
      temperature=rl.temperature, top_k=rl.top_k, top_p=rl.top_p,
      prefill_chunk=rl.prefill_chunk, cache_dtype=compiled_dtype)
  out = compile_fn(lowered)
  shards = kv_cache_lib.slot_shards(mesh, rules)
  cache = functools.partial(kv_cache_lib.bytes_per_device, c, mesh=mesh,
                            rules=rules)
  out.update(
      slots=slots, slot_shards=shards, kv_cache_gib=rl.kv_cache_gib,
      resident_bytes_per_device=resident,
      slots_per_device=slots // shards if slots % shards == 0 else slots,
      prompt_bucket=bucket, cache_len=length,
      cache_dtype=str(jnp.dtype(c.dtype)),
      compiled_cache_dtype=str(jnp.dtype(compiled_dtype or c.dtype)),
      cache_bytes_per_device=cache(slots, length),
      compiled_cache_bytes_per_device=cache(slots, length, compiled_dtype),
      # One more slot on every batch shard.
      slot_bytes_per_device=cache(shards, length))
  if "memory" not in out:  # the target's compiler refused it: nothing more to estimate
    return out
  out["accelerator_peak"] = (out["memory"]["peak"]
                             - out["compiled_cache_bytes_per_device"]
                             + out["cache_bytes_per_device"])
  # What a device holds while the trainer samples: the engine and the rest.
  out["rollout_peak"] = out["accelerator_peak"] + resident
  out["rows_per_device"] = rl.prompts_per_step * rl.group_size // shards
  out["slots_that_fit"] = slots_that_fit(out, rows_per_device=out["rows_per_device"])
  out["chip_bytes"] = {chip: gib * 2**30 for chip, gib in TPU_HBM_GIB.items()}
  return out


def slots_that_fit(engine: dict, rows_per_device: int, capacities: dict | None = None) -> dict:
  """Per named chip, the most slots per device whose engine peak, with the
  trainer's resident state, fits its HBM (0 if none; at most the rows per
  device, beyond which slots idle): the accelerator's estimated peak less
  its cache, plus the resident bytes, plus that many slots' cache bytes.

  An estimate: it assumes nothing else in the program grows with the slots.
  The decode step's activations and logits do, by far less than the cache
  at long lengths, and so do the refill's prefill lanes up to 64 slots
  (``engine.refill_widths``)."""
  per_slot = engine["slot_bytes_per_device"]
  rest = engine["rollout_peak"] - engine["cache_bytes_per_device"]
  if capacities is None:
    capacities = {chip: gib * 2**30 for chip, gib in TPU_HBM_GIB.items()}
  return {chip: min(rows_per_device, max(0, int((capacity - rest) // per_slot)))
          for chip, capacity in capacities.items()}


def _dry_run_score(setup, params_in, batch_in, compile_fn) -> dict:
  """The trainer's scoring program (old or reference log-probs)."""
  fn = jax.jit(functools.partial(
      trainer.score_logp, graphdef=setup.graphdef,
      temperature=setup.step_cfg.temperature,
      prompt_group=setup.step_cfg.prompt_group))
  keys = ("prompt_ids", "prompt_mask", "response_ids", "response_mask")
  return compile_fn(fn.lower(params_in, {k: batch_in[k] for k in keys}))

