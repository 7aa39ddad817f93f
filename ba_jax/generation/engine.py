"""Continuous-batching rollout engine: a fixed number of decode slots, refilled as rows finish.

The B*G rows of a call (group-major: row n answers prompt n // G) queue for M
decode slots, whose KV cache is [M, kv_heads, S, head_dim] per layer with S =
prompt + response budget, whatever B is. One jitted `while_loop` runs:

  refill: while a slot is free and a row is pending, prefill the next rows'
          prompts (all but their last token; lanes of a few fixed widths, the
          widest that the free slots fill, so one finished row costs one
          row's prefill; rows of one prompt share its prefill) into a small
          cache, copy it into the free slots (`kv_cache.fill_slots`) and
          queue each prompt's last token as the slot's next input;
  decode: one token for every slot (idle slots feed padding under mask 0);
          a row that emits a stop token or reaches its budget frees its slot.

With `LoopConfig.cache_phases` > 1 (the CPU default for long caches, see
`decoding.auto_cache_phases`) a step decodes on the shortest prefix of the
cache that holds every active slot (`_phase_loop`), one `while_loop` per
length, so attention skips the positions no slot has reached.

On a mesh the cache's slots split over the batch axes and its kv heads over
the tensor axis (`kv_cache.constrain`); `kv_cache.bytes_per_device` counts
that layout, and `rollout.decode_slots` turns a per-device budget into slots.

Each row's draws use `fold_in(fold_in(rng, row), position)`, so a response
does not depend on the slot it ran in or on when it was admitted; greedy is
the static sampler's output token for token. A given (slots, prompt bucket,
budget, rows) compiles once: refills are data, not shapes.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from ba_jax.policy import compiling
from ba_jax.generation import draw as draw_lib
from ba_jax.policy import sharding as sharding_lib
from ba_jax.policy import kv_cache as kv_cache_lib
from ba_jax.generation import decoding
from ba_jax.policy.scoring import left_justify


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """What the engine's compiled program depends on, besides the input shapes."""
  loop: decoding.LoopConfig
  slots: int  # M decode slots (whole call, all processes)
  prefill_chunk: int = 0  # prompt tokens per prefill call; 0 = the whole prompt at once
  # The slots' cache dtype; None: the model's compute dtype. The dry run sets
  # float32 for a bfloat16 model on XLA:CPU, which has no bfloat16 scatter and
  # would write the cache through float32 copies that an accelerator never makes.
  cache_dtype: str | None = None


_TRACE_COUNT = 0


def trace_count() -> int:
  """How many times the engine's program has been traced (compiled)."""
  return _TRACE_COUNT


def refill_widths(slots: int) -> tuple[int, ...]:
  """Prefill lane counts: one row when a single slot frees, wide when many do (start-up)."""
  return tuple(sorted({1, min(slots, 8), min(slots, 64)}))


def prefill_length(prompt_len: int, chunk: int) -> int:
  """Cache positions a prompt's prefill fills: all but its last token, in whole chunks."""
  head = prompt_len - 1
  if chunk <= 0 or head == 0:
    return head
  return -(-head // chunk) * chunk


def cache_length(prompt_len: int, max_new_tokens: int, chunk: int = 0) -> int:
  """Positions per slot of the engine's cache for prompts of `prompt_len` (bucketed) tokens."""
  return prefill_length(prompt_len, chunk) + max_new_tokens


def _prefill(model, ids_RxH, mask_RxH, chunk: int, layers=None) -> kv_cache_lib.KVCache:
  """Keys/values of [R, H] prompt heads in a fresh [R, ..., H, ...] cache, `chunk` tokens per call.

  The logits are dropped, so XLA drops the LM head from the prefill.
  """
  R, H = ids_RxH.shape
  cache = kv_cache_lib.init_cache(model.config, R, H)
  if chunk <= 0 or chunk >= H:
    return model(ids_RxH, mask_RxH, cache=cache, layers=layers)[1]

  def one_chunk(i, cache):
    take = lambda x: jax.lax.dynamic_slice_in_dim(x, i * chunk, chunk, axis=1)
    return model(take(ids_RxH), take(mask_RxH), cache=cache, layers=layers)[1]
  return jax.lax.fori_loop(0, H // chunk, one_chunk, cache)


def _phase_loop(state, lengths, busy, step, pin):
  """Runs `step` while `busy`, each step on the shortest cache prefix of `lengths` that holds
  every active slot's next write.

  One pass of the outer loop visits the lengths in turn: it copies the cache's first `length`
  positions out, decodes on them while every active slot fits and the slots do not fit two
  lengths shorter (then the pass ends and the next one starts over from the shortest), and
  writes them back. A slice per visit, not per step: XLA:CPU copies a sliced cache, and a
  visit lasts many steps. Phases without work run no step (their copies remain).
  """
  def need(s):  # the index of the shortest length that holds every active slot's next write
    top = jnp.max(jnp.where(s["row"] >= 0, s["cache"].index, 0))
    return jnp.sum(top >= jnp.asarray(lengths, jnp.int32), dtype=jnp.int32)

  def one_pass(s):
    for j, length in enumerate(lengths):
      part = pin(kv_cache_lib.prefix(s["cache"], length))
      part = jax.lax.while_loop(
          lambda t, j=j: busy(t) & (need(t) <= j) & (need(t) >= j - 1), step, dict(s, cache=part))
      s = dict(part, cache=pin(kv_cache_lib.put_prefix(s["cache"], part["cache"])))
    return s

  return jax.lax.while_loop(busy, one_pass, state)


def _engine_program(graphdef, state, prompt_ids_BxP, prompt_mask_BxP, rng, temperature, eos_E,
                    cfg: EngineConfig, mesh_rules, budget_N=None):
  global _TRACE_COUNT
  _TRACE_COUNT += 1  # Runs only while tracing: counts compilations.
  model = nnx.merge(graphdef, state)
  layers = model.layer_slices()  # once, outside the loops (see Decoder.layer_slices)
  loop, M = cfg.loop, cfg.slots
  G, T, pad = loop.group_size, loop.max_new_tokens, loop.pad_id
  B, P = prompt_ids_BxP.shape
  N = B * G
  constrain = functools.partial(decoding.constrain_batch, mesh_rules=mesh_rules)
  ids_BxP, mask_BxP = left_justify(prompt_ids_BxP, prompt_mask_BxP, pad)
  H = prefill_length(P, cfg.prefill_chunk)
  # Left-justified: the last column is every prompt's last token; the head is
  # left-padded to whole prefill chunks.
  head_ids_BxH = jnp.pad(ids_BxP[:, :P - 1], ((0, 0), (H - (P - 1), 0)), constant_values=pad)
  head_mask_BxH = jnp.pad(mask_BxP[:, :P - 1], ((0, 0), (H - (P - 1), 0)))
  last_B = ids_BxP[:, P - 1]
  budget_N = jnp.full((N,), T, jnp.int32) if budget_N is None else constrain(budget_N)
  draw = functools.partial(draw_lib.draw_tokens, temperature=temperature, greedy=loop.greedy,
                           top_k=loop.top_k, top_p=loop.top_p)

  # Slots over the batch axes, kv heads over the tensor axis (kv_cache.constrain), pinned
  # wherever the loop writes the cache so its carry keeps that layout.
  pin = functools.partial(kv_cache_lib.constrain, mesh_rules=mesh_rules)
  # The whole cache lives in the loop's state; with several phases (decoding.cache_phase_lengths)
  # each decode step runs on its first `length` positions, the shortest that holds every active
  # slot, so attention does not read positions no slot has reached (see `_phase_loop`).
  lengths = decoding.cache_phase_lengths(cache_length(P, T, cfg.prefill_chunk), loop.cache_phases, H + 1)
  cache = pin(kv_cache_lib.init_cache(model.config, M, lengths[-1], cfg.cache_dtype, per_row=True))
  state0 = dict(
      cache=cache,
      row=constrain(jnp.full((M,), -1, jnp.int32)),  # the row in each slot; -1 = free
      pos=constrain(jnp.zeros((M,), jnp.int32)),  # response tokens drawn so far
      prev=constrain(jnp.full((M,), pad, jnp.int32)),  # the slot's next input token
      next_row=jnp.int32(0),
      tokens=constrain(jnp.full((N, T), pad, jnp.int32)),
      logprobs=constrain(jnp.zeros((N, T), jnp.float32)),
      lengths=constrain(jnp.zeros((N,), jnp.int32)),
      stopped=constrain(jnp.zeros((N,), bool)))

  def admit(width, s):
    """Prefills the next `width` pending rows into the first free slots (idle lanes dropped)."""
    slot_R = jnp.nonzero(s["row"] < 0, size=width, fill_value=M)[0].astype(jnp.int32)
    row_R = s["next_row"] + jnp.arange(width, dtype=jnp.int32)
    valid_R = (slot_R < M) & (row_R < N)
    slot_R = jnp.where(valid_R, slot_R, M)
    prompt_R = jnp.minimum(row_R, N - 1) // G
    s = dict(s)
    if H:
      # Consecutive rows share prompts: prefill each of the (at most U) prompts
      # once, then give every row its prompt's lane.
      U = min(width, (width + G - 2) // G + 1)
      first = jnp.minimum(s["next_row"], N - 1) // G
      prompt_U = jnp.minimum(first + jnp.arange(U, dtype=jnp.int32), B - 1)
      prefill = _prefill(model, head_ids_BxH[prompt_U], head_mask_BxH[prompt_U], cfg.prefill_chunk, layers)
      lane_R = jnp.clip(prompt_R - first, 0, U - 1)
      prefill = jax.tree.map(lambda x: x if x.ndim == 0 else x[lane_R], prefill)
    else:
      prefill = kv_cache_lib.init_cache(model.config, width, 0)
    s["cache"] = pin(kv_cache_lib.fill_slots(s["cache"], slot_R, prefill, mesh_rules))
    s["row"] = s["row"].at[slot_R].set(row_R, mode="drop")
    s["pos"] = s["pos"].at[slot_R].set(0, mode="drop")
    s["prev"] = s["prev"].at[slot_R].set(last_B[prompt_R], mode="drop")
    s["next_row"] = s["next_row"] + jnp.sum(valid_R, dtype=jnp.int32)
    return s

  widths = refill_widths(M)

  def n_fill(s):
    return jnp.minimum(jnp.sum(s["row"] < 0, dtype=jnp.int32), N - s["next_row"])

  def refill(s):
    # Widest lanes first, each width in its own while_loop: a loop updates the
    # cache in place, where a switch between widths copied it on every refill.
    for width in reversed(widths):
      s = jax.lax.while_loop(lambda s, w=width: n_fill(s) >= w, functools.partial(admit, width), s)
    return s

  def decode(s):
    s = dict(s)
    active_M = s["row"] >= 0
    logits_Mx1xV, s["cache"] = model(s["prev"][:, None], active_M[:, None].astype(jnp.int32),
                                     cache=s["cache"], layers=layers)
    s["cache"] = pin(s["cache"])
    u_M = draw_lib.row_uniforms(rng, s["row"], s["pos"])
    tok_M, logp_M = draw(logits_Mx1xV[:, 0], None, uniforms_N=u_M)
    write_M = jnp.where(active_M, s["row"], N)  # out of range: dropped
    s["tokens"] = s["tokens"].at[write_M, s["pos"]].set(tok_M, mode="drop")
    s["logprobs"] = s["logprobs"].at[write_M, s["pos"]].set(logp_M, mode="drop")
    pos_M = s["pos"] + 1
    stop_M = jnp.isin(tok_M, eos_E)
    finish_M = active_M & (stop_M | (pos_M >= budget_N[jnp.maximum(s["row"], 0)]))
    end_M = jnp.where(finish_M, s["row"], N)
    s["lengths"] = s["lengths"].at[end_M].set(pos_M, mode="drop")
    s["stopped"] = s["stopped"].at[end_M].set(stop_M, mode="drop")
    s["row"] = jnp.where(finish_M, -1, s["row"])
    s["pos"], s["prev"] = pos_M, tok_M
    return s

  def busy(s):
    return jnp.any(s["row"] >= 0) | (s["next_row"] < N)

  step = lambda s: decode(refill(s))
  if len(lengths) == 1:
    s = jax.lax.while_loop(busy, step, state0)
  else:
    s = _phase_loop(state0, lengths, busy, step, pin)
  mask_NxT = (jnp.arange(T)[None, :] < s["lengths"][:, None]).astype(jnp.int32)
  return decoding.SampleResult(tokens=s["tokens"], logprobs=s["logprobs"], mask=mask_NxT,
                                  lengths=s["lengths"], truncated=~s["stopped"])


engine_jit = compiling.jit(_engine_program, static_argnames=("graphdef", "cfg", "mesh_rules"))


def lower(graphdef, params, *, prompts: int, prompt_len: int, group_size: int,
          max_new_tokens: int, slots: int, mesh=None, rules=None, temperature: float = 1.0,
          top_k: int = 0, top_p: float = 1.0, prefill_chunk: int = 0, num_eos: int = 4,
          pad_id: int = 0, cache_dtype: str | None = None) -> jax.stages.Lowered:
  """Lowers the engine's program on abstract inputs (for the dry run; compile it for memory).

  `params` may be a state of `jax.ShapeDtypeStruct`s with shardings; `prompts`
  x `prompt_len` is the global prompt batch (already bucketed), `slots` the
  global slot count. Prompts are batch-sharded on `mesh` under `rules`.
  `cache_dtype`: see `EngineConfig`.
  """
  greedy = temperature == 0
  cfg = EngineConfig(decoding.LoopConfig(
      int(group_size), int(max_new_tokens), int(pad_id), greedy,
      0 if greedy else int(top_k), 1.0 if greedy else float(top_p), cache_phases=1), int(slots),
      int(prefill_chunk), cache_dtype)
  mesh_rules = None
  sharding = None
  if mesh is not None:
    mesh_rules = (mesh, sharding_lib.DEFAULT_RULES if rules is None else tuple(rules))
    sharding = sharding_lib.logical_sharding(mesh, mesh_rules[1], ("batch", None),
                                             shape=(prompts, prompt_len))
  ids = jax.ShapeDtypeStruct((prompts, prompt_len), jnp.int32, sharding=sharding)
  return engine_jit.lower(graphdef, params, ids, ids, jax.eval_shape(lambda: jax.random.key(0)),
                          jax.ShapeDtypeStruct((), jnp.float32),
                          jax.ShapeDtypeStruct((num_eos,), jnp.int32), cfg=cfg, mesh_rules=mesh_rules)
