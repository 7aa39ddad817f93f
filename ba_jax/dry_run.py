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
(``run_setup.make_setup(config, abstract=True)``: no tokenizer, no
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

from ba_jax import attention as attention_lib
from ba_jax import engine as engine_lib
from ba_jax import kv_cache as kv_cache_lib
from ba_jax import model as model_lib
from ba_jax import run_setup
from ba_jax import sampler as sampler_lib
from ba_jax import sharding as sharding_lib
from ba_jax import train_step as ts
from ba_jax import trainer

# HBM per chip, GiB (Google Cloud's published TPU specifications).
TPU_HBM_GIB = {"v4": 32, "v5e": 16, "v5p": 95, "v6e": 32}
ESTIMATE_NOTE = ("memory is XLA:CPU's buffer assignment for these programs: "
                 "an estimate of an accelerator's, not a measurement on one")
MEMORY_FIELDS = ("argument", "output", "alias", "temp", "generated_code")
# LLVM's optimisation level changes neither XLA's buffer assignment (memory)
# nor its HLO (FLOPs); lowering it halves the CPU compile time.
CPU_COMPILER_OPTIONS = {"xla_backend_optimization_level": 0,
                        "xla_llvm_disable_expensive_passes": True}


def param_counts(abstract_params, c: model_lib.ModelConfig) -> dict:
  """All parameters, and those in matmuls (the LM head counted, the
  embedding lookup not; with tied embeddings the table is the head)."""
  total = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(abstract_params))
  E, H, K, D = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
  per_layer = 2 * E * H * D + 2 * E * K * D + 3 * E * c.intermediate_size
  return {"total": total,
          "matmul": c.num_layers * per_layer + E * c.vocab_size}


def analytic_flops(c: model_lib.ModelConfig, matmul_params: int, *,
                   rows: int, prompts: int, prompt_len: int,
                   response_len: int, ppo_epochs: int,
                   micro_batches: int, prompt_bucket: int | None = None,
                   minibatches: int = 1, logprob_chunk: int | None = None,
                   attention_tile: int | None = None) -> dict:
  """FLOPs of one train step and one sampling call, whole mesh.

  Train: every row goes ``ppo_epochs`` times forward and backward over
  L = P + T tokens. Sampling: a prefill of the B prompts (padded to
  ``prompt_bucket`` tokens, default P, into a cache of S = bucket + T - 1
  slots), then T - 1 decode steps of all N = B * G rows, each attending
  over the whole cache.

  "As XLA counts": XLA's cost analysis counts a loop body once, and the
  train step is loops all the way down (PPO updates, micro-batches, the
  scanned layers), so its figure is one micro-batch of one update through
  one layer plus the LM head. The LM head runs over the response tokens
  only, ``logprob_chunk`` of them per iteration of the scorer's chunk scan
  (so XLA counts one chunk), and blockwise attention (``attention_tile``;
  None: the full [L, L] product) is a scan over tiles (XLA counts one
  query tile against one key tile).
  """
  attn = 4 * c.num_layers * c.num_heads * c.head_dim  # x queries x keys
  L = prompt_len + response_len
  passes = 4 if c.remat != "none" else 3
  head = c.hidden_size * c.vocab_size
  body = matmul_params - head  # the layers' matmuls
  train = passes * rows * ppo_epochs * (
      2 * body * L + 2 * head * response_len + attn * L * L)
  chunk = min(logprob_chunk or response_len, response_len)
  tile = min(attention_tile, L) if attention_tile else L
  one_layer_and_head = passes * rows * ppo_epochs * (
      2 * body / c.num_layers * L + 2 * head * chunk
      + attn / c.num_layers * tile * tile)
  bucket = prompt_bucket or prompt_len
  S = bucket + response_len - 1
  prefill = prompts * bucket * (2 * matmul_params + attn * S)
  decode_step = rows * (2 * matmul_params + attn * S)
  return {
      "train_step": float(train),
      "train_step_xla_counts": float(
          one_layer_and_head / (micro_batches * ppo_epochs * minibatches)),
      "train_6ND": float(6 * matmul_params * rows * L * ppo_epochs),
      "sample": float(prefill + (response_len - 1) * decode_step),
      "sample_xla_counts": float(prefill + decode_step),
      "sample_2ND": float(2 * matmul_params
                          * (prompts * bucket + rows * response_len)),
  }


def _memory(compiled) -> dict:
  m = compiled.memory_analysis()
  out = {f: int(getattr(m, f"{f}_size_in_bytes", 0) or 0)
         for f in MEMORY_FIELDS}
  out["peak"] = (out["argument"] + out["output"] - out["alias"] + out["temp"]
                 + out["generated_code"])
  return out


def _flops(compiled) -> float:
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):  # older jax: one dict per program
    cost = cost[0] if cost else {}
  return float((cost or {}).get("flops", float("nan")))


def _compile(lowered, platform: str) -> dict:
  t0 = time.perf_counter()
  compiled = lowered.compile(
      compiler_options=CPU_COMPILER_OPTIONS if platform == "cpu" else None)
  return dict(memory=_memory(compiled), flops_per_device=_flops(compiled),
              compile_s=round(time.perf_counter() - t0, 1))


def _abstract_batch(rows: int, prompt_len: int, response_len: int, mesh,
                    rules, with_ref: bool) -> dict:
  shapes = dict(prompt_ids=((rows, prompt_len), jnp.int32),
                prompt_mask=((rows, prompt_len), jnp.int32),
                response_ids=((rows, response_len), jnp.int32),
                response_mask=((rows, response_len), jnp.int32),
                advantages=((rows,), jnp.float32),
                old_logp=((rows, response_len), jnp.float32))
  if with_ref:
    shapes["ref_logp"] = ((rows, response_len), jnp.float32)
  return {name: jax.ShapeDtypeStruct(shape, dtype, sharding=(
      sharding_lib.data_sharding(mesh, rules, len(shape))))
          for name, (shape, dtype) in shapes.items()}


def _bytes_per_device(tree) -> int:
  return sum(int(np.prod(x.sharding.shard_shape(x.shape)))
             * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def dry_run(config, *, devices=None, sample: bool = True,
            one_update: bool = False, train: bool = True) -> dict:
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
  setup = run_setup.make_setup(config, abstract=True, devices=devices)
  mesh, rules, rl = setup.mesh, setup.rules, setup.config.rl
  model_config = setup.model_config
  platform = mesh.devices.flat[0].platform
  B, G, T = rl.prompts_per_step, rl.group_size, rl.max_new_tokens
  N, P = B * G, config.task.max_prompt_len
  state_in = run_setup.abstract_state(setup)
  with_ref = config.loss.kl_coef > 0
  batch_in = _abstract_batch(N, P, T, mesh, rules, with_ref)

  counts = param_counts(setup.abstract_params, model_config)
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
                    remat=model_config.remat, dtype=model_config.dtype,
                    param_dtype=model_config.param_dtype),
      "analytic_flops": analytic_flops(
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
        shapes=(P, T, mesh, rules, with_ref), platform=platform)
  if sample and uses_engine(setup):
    # The trainer keeps the optimizer state (and a KL reference's
    # parameters) on the devices while it samples.
    resident = _bytes_per_device(state_in) - _bytes_per_device(state_in.params)
    if with_ref:
      resident += _bytes_per_device(state_in.params)
    report["engine"] = _dry_run_engine(setup, state_in.params, platform,
                                       resident)
  elif sample:
    report["sample"] = _dry_run_sampler(setup, state_in.params, platform)
  if sample and (rl.old_logp == "recompute" or with_ref):
    report["score"] = _dry_run_score(setup, state_in.params, batch_in,
                                     platform)
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
                   platform) -> dict:
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
  out = _compile(step_fn.lower(state_in, step_batch), platform)
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


def _dry_run_sampler(setup, params_in, platform) -> dict:
  """The sampler's program for one step's prompts (the model skips remat on
  its cached path, so a remat config lowers as it is)."""
  rl = setup.rollout_cfg
  lowered = sampler_lib.lower_sample(
      setup.graphdef, params_in, prompts=rl.prompts_per_step,
      prompt_len=setup.config.task.max_prompt_len, group_size=rl.group_size,
      max_new_tokens=rl.max_new_tokens, temperature=rl.temperature,
      top_p=rl.top_p, top_k=rl.top_k, mesh=setup.mesh, rules=setup.rules)
  out = _compile(lowered, platform)
  out["prompt_bucket"] = sampler_lib.bucket_length(
      setup.config.task.max_prompt_len)
  return out


def uses_engine(setup) -> bool:
  """Whether the config's rollouts run through the engine
  (``sampler.uses_engine`` with its slots per process, from ``rl.max_slots``
  or ``rl.kv_cache_gib``, and this process's rows)."""
  rl = setup.rollout_cfg
  return sampler_lib.uses_engine(
      rl.max_slots, rl.prompts_per_step * rl.group_size // jax.process_count())


def _dry_run_engine(setup, params_in, platform, resident: int) -> dict:
  """The engine's program for one step's prompts through the config's slots,
  and the cache's share of it (to size the slots for each named slice);
  ``resident``: bytes per device the trainer holds besides (the AdamW
  moments)."""
  rl, c = setup.rollout_cfg, setup.model_config
  mesh, rules = setup.mesh, setup.rules
  slots = rl.max_slots * jax.process_count()
  bucket = sampler_lib.bucket_length(setup.config.task.max_prompt_len)
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
  out = _compile(lowered, platform)
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
  out["accelerator_peak"] = (out["memory"]["peak"]
                             - out["compiled_cache_bytes_per_device"]
                             + out["cache_bytes_per_device"])
  # What a device holds while the trainer samples: the engine and the rest.
  out["rollout_peak"] = out["accelerator_peak"] + resident
  out["slots_that_fit"] = slots_that_fit(
      out, rows_per_device=rl.prompts_per_step * rl.group_size // shards)
  return out


def slots_that_fit(engine: dict, rows_per_device: int) -> dict:
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
  return {chip: min(rows_per_device, max(0, int((gib * 2**30 - rest) // per_slot)))
          for chip, gib in TPU_HBM_GIB.items()}


def _dry_run_score(setup, params_in, batch_in, platform) -> dict:
  """The trainer's scoring program (old or reference log-probs)."""
  fn = jax.jit(functools.partial(
      trainer.score_logp, graphdef=setup.graphdef,
      temperature=setup.step_cfg.temperature))
  keys = ("prompt_ids", "prompt_mask", "response_ids", "response_mask")
  return _compile(fn.lower(params_in, {k: batch_in[k] for k in keys}),
                  platform)


PROGRAMS = ("train_step", "sample", "engine", "score")


def _bytes(n: float) -> str:
  for unit in ("B", "KiB", "MiB", "GiB"):
    if abs(n) < 1024:
      return f"{n:.4g} {unit}"
    n /= 1024
  return f"{n:,.1f} TiB"


def _count(n: float) -> str:
  for unit in ("", "K", "M"):
    if n < 1000:
      return f"{n:.4g}{unit}"
    n /= 1000
  return f"{n:.4g}B"


def format_report(report: dict) -> str:
  """The report as a readable table."""
  s, m = report["shapes"], report["model"]
  mesh = " x ".join(f"{k} {v}" for k, v in report["mesh"].items())
  lines = [
      f"mesh: {mesh} = {report['devices']} {report['platform']} devices; "
      f"batch split over {report['batch_shards']}",
      f"model: {m['model_type']}, {_count(m['params'])} parameters "
      f"({_count(m['matmul_params'])} in matmuls), params "
      f"{m['param_dtype']}, compute {m['dtype']}, remat {m['remat']}",
      f"shapes: {s['prompts']} prompts x {s['group_size']} = {s['rows']} "
      f"rows; prompt {s['prompt_len']} + response {s['response_len']} "
      f"tokens; {s['ppo_epochs']} epoch(s) x {s['num_minibatches']} "
      f"mini-batches x {s['num_microbatches']} micro-batches of "
      f"{s['micro_batch_rows']} rows",
  ]
  lines += [f"note: {n}" for n in report["notes"]]
  programs = [p for p in PROGRAMS if p in report]
  lines.append("")
  lines.append(f"{'per device':<26}" + "".join(f"{p:>16}" for p in programs))
  for field in MEMORY_FIELDS + ("peak",):
    lines.append(f"{field:<26}" + "".join(
        f"{_bytes(report[p]['memory'][field]):>16}" for p in programs))
  lines.append(f"{'FLOPs (XLA)':<26}" + "".join(
      f"{report[p]['flops_per_device']:>16.3e}" for p in programs))
  lines.append(f"{'compile (s)':<26}" + "".join(
      f"{report[p]['compile_s']:>16}" for p in programs))
  n = report["devices"]
  a = {k: v / n for k, v in report["analytic_flops"].items()}
  lines += [
      "",
      "analytic FLOPs per device (whole mesh / devices):",
      f"  train step {a['train_step']:.3e} (6ND {a['train_6ND']:.3e}); "
      f"as XLA counts (each loop body once: one micro-batch of one update "
      f"through one layer, one attention tile and one LM-head chunk) "
      f"{a['train_step_xla_counts']:.3e}",
      f"  sampling   {a['sample']:.3e} (2ND {a['sample_2ND']:.3e}); "
      f"as XLA counts the static sampler (prefill + one decode step) "
      f"{a['sample_xla_counts']:.3e}",
  ]
  if "engine" in report:
    lines.append("  (the engine's XLA count is one decode step of its slots "
                 "plus one prefill per refill width, so not comparable)")
  lines.append("")
  lines.append(f"fits per chip ({report['devices']} chips; "
               "peak per device vs HBM per chip):")
  for chip, gib in TPU_HBM_GIB.items():
    verdicts = []
    for p in programs:
      peak, name = report[p]["memory"]["peak"] / 2**30, p
      if p == "engine":  # see _engine_lines
        e = report[p]
        peak = e["rollout_peak"] / 2**30
        name = "engine + optimizer state"
      verdicts.append(f"{name} {'fits' if peak <= gib else 'does NOT fit'}"
                      f" ({peak:.3g} of {gib} GiB)")
    lines.append(f"  {chip}-{report['devices']}: " + "; ".join(verdicts))
  if report["platform"] == "cpu":
    lines.append(f"note: {ESTIMATE_NOTE}")
  if "engine" in report:
    lines += ["", *_engine_lines(report)]
  train = report.get("train_step", {})
  if "one_update_memory" in train:
    lines.append(f"train_step: compiled {train['updates_compiled']} of "
                 f"{s['ppo_epochs'] * s['num_minibatches']} updates; "
                 "full batch added to the arguments")
  return "\n".join(lines)


def _engine_lines(report: dict) -> list[str]:
  e, n = report["engine"], report["devices"]
  source = (f"rl.kv_cache_gib={e['kv_cache_gib']:g} per device"
            if e["kv_cache_gib"] else "rl.max_slots per process")
  lines = [
      f"engine: {e['slots']} decode slots ({e['slots_per_device']} per "
      f"device on {e['slot_shards']} batch shards), {e['cache_len']} cache "
      f"positions each (prompt bucket {e['prompt_bucket']} - 1 + response); "
      f"KV cache {_bytes(e['cache_bytes_per_device'])} per device, "
      f"{_bytes(e['slot_bytes_per_device'])} per slot per device "
      f"(slots from {source})",
      f"engine peak {_bytes(e['memory']['peak'])} as compiled"
      + (f" with a {e['compiled_cache_dtype']} cache, "
         f"{_bytes(e['accelerator_peak'])} with the {e['cache_dtype']} one "
         "(XLA:CPU would write a bfloat16 cache through float32 copies "
         "that an accelerator does not make)"
         if e["compiled_cache_dtype"] != e["cache_dtype"] else "")
      + f"; + the trainer's resident optimizer state "
      f"({_bytes(e['resident_bytes_per_device'])}): "
      f"{_bytes(e['rollout_peak'])} "
      "per device",
      "slots per device that fit (estimate: that peak less its cache, plus "
      "the cache's bytes per slot):"]
  for chip, fit in e["slots_that_fit"].items():
    budget = fit * e["slot_bytes_per_device"] / 2**30
    lines.append(f"  {chip}-{n} ({TPU_HBM_GIB[chip]} GiB): {fit} per device "
                 f"= {fit * e['slot_shards']} slots on the mesh "
                 f"(KV cache {budget:.3g} GiB per device)")
  if not e["kv_cache_gib"]:
    lines.append("note: rl.max_slots counts slots per process and this dry "
                 "run is one process, so a pod of n processes holds n times "
                 "these slots; rl.kv_cache_gib (per device) gives the same "
                 "slots per device whatever the process count")
  return lines


def _main():
  """``python -m ba_jax.dry_run``: flags only (defined here, not on import,
  so that importing this module defines no flags)."""
  import json

  from absl import app, flags, logging
  from ml_collections import config_flags

  config = config_flags.DEFINE_config_file(
      "config", None, "ml_collections config file", lock_config=True)
  cpu_devices = flags.DEFINE_integer(
      "num_cpu_devices", 0, "fake this many CPU devices (0: leave JAX's "
      "default); the same as XLA_FLAGS=--xla_force_host_platform_device_count")
  one_update = flags.DEFINE_bool(
      "one_update", False, "compile one mini-batch update, not the whole "
      "step (a check; see ba_jax/dry_run.py)")
  sample = flags.DEFINE_bool(
      "sample", True, "also compile the rollout's program (the engine when "
      "the config's decode slots are fewer than the rows, else the static "
      "sampler)")
  train = flags.DEFINE_bool("train", True, "compile the train step")
  json_out = flags.DEFINE_string("json_out", None, "write the report here")

  def main(argv):
    logging.set_verbosity(logging.WARNING)
    if len(argv) > 1:
      raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if config.value is None:
      raise app.UsageError("--config=configs/<file>.py is required")
    if cpu_devices.value:
      jax.config.update("jax_num_cpu_devices", cpu_devices.value)
    report = dry_run(config.value, sample=sample.value,
                     one_update=one_update.value, train=train.value)
    print(format_report(report))
    text = json.dumps(report, indent=1)
    if json_out.value:
      with open(json_out.value, "w") as f:
        f.write(text + "\n")
    else:
      print(text)

  app.run(main)


if __name__ == "__main__":
  _main()
