"""Group sampling: G responses per prompt from one jitted prefill + decode loop.

`sample_groups` left-justifies the prompts, pads them to a static bucket
length (so a new batch of the same bucket reuses the compiled program),
prefills a preallocated KV cache once on the B prompts, repeats the cache G
times and decodes with a `lax.while_loop` that stops as soon as every row has
emitted a stop token (or its row budget). Draws (`ba_jax.generation.draw`) use an
inverse CDF with one uniform per row from the row's own key.

With `max_slots` below the number of rows, the same call goes through the
continuous-batching engine (`ba_jax.generation.engine`): a KV cache of `max_slots` rows,
refilled as rows finish; for the same key it returns the same samples.
"""

import functools
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ba_jax.policy import compiling
from ba_jax.generation import decoding
from ba_jax.generation import engine
from ba_jax.policy import kv_cache as kv_cache_lib
from ba_jax.policy import model as model_lib
from ba_jax.policy import sharding as sharding_lib
from ba_jax.generation.draw import draw_tokens, row_uniforms
from ba_jax.policy.scoring import left_justify

DEFAULT_MIN_BUCKET = 16


SampleResult = decoding.SampleResult
_LoopConfig = decoding.LoopConfig
_constrain = decoding.constrain_batch


class _NoStop:
  def __repr__(self):
    return "sampler.NO_STOP"


# `sample_groups(eos_id=NO_STOP)`: no stop token, every row runs to its budget (fixed-length
# sampling, e.g. a benchmark's forced lengths). A sentinel, not None or (), so a tokenizer
# without an eos id cannot turn stopping off by accident.
NO_STOP = _NoStop()

_TRACE_COUNT = 0


def trace_count() -> int:
  """How many times the jitted sampling program has been traced (compiled)."""
  return _TRACE_COUNT


def bucket_length(length: int, buckets: Sequence[int] | None = None) -> int:
  """The static prompt length for `length`: the smallest bucket that holds it.

  Default buckets are powers of two, at least DEFAULT_MIN_BUCKET.
  """
  if buckets is None:
    return max(DEFAULT_MIN_BUCKET, 1 << max(0, math.ceil(math.log2(max(length, 1)))))
  fitting = [b for b in sorted(buckets) if b >= length]
  if not fitting:
    raise ValueError(f"prompt length {length} exceeds the largest prompt bucket"
                     f" {max(buckets)} (prompt_buckets={tuple(buckets)})")
  return fitting[0]


def _sample_program(graphdef, state, prompt_ids_BxP, prompt_mask_BxP, rng,
                    temperature, eos_E, cfg: _LoopConfig, mesh_rules, budget_N=None):
  global _TRACE_COUNT
  _TRACE_COUNT += 1  # Runs only while tracing: counts compilations.
  model = nnx.merge(graphdef, state)
  G, T = cfg.group_size, cfg.max_new_tokens
  B, P = prompt_ids_BxP.shape
  N = B * G
  ids_BxP, mask_BxP = left_justify(prompt_ids_BxP, prompt_mask_BxP, cfg.pad_id)
  # The last token is not fed: P + T - 1 positions in all, reached through the loop's phases.
  lengths = decoding.cache_phase_lengths(P + T - 1, cfg.cache_phases, P + 1 if T > 1 else P)
  cache = model_lib.init_cache(model.config, B, lengths[0])
  cache = jax.tree.map(lambda x: _constrain(x, mesh_rules), cache)
  layers = model.layer_slices()  # once, outside the decode loop (see Decoder.layer_slices)
  logits_BxPxV, cache = model(ids_BxP, mask_BxP, cache=cache, layers=layers)
  # Left-justified, so the last column holds every prompt's last token.
  repeat = lambda x: x if x.ndim == 0 else jnp.repeat(x, G, axis=0)
  cache = jax.tree.map(lambda x: _constrain(repeat(x), mesh_rules), cache)
  logits_NxV = _constrain(repeat(logits_BxPxV[:, -1]), mesh_rules)
  draw = functools.partial(draw_tokens, temperature=temperature, greedy=cfg.greedy,
                           top_k=cfg.top_k, top_p=cfg.top_p)

  rows_N = jnp.arange(N, dtype=jnp.int32)
  tok_N, logp_N = draw(logits_NxV, None, uniforms_N=row_uniforms(rng, rows_N, 0 * rows_N))
  tokens_NxT = jnp.full((N, T), cfg.pad_id, jnp.int32).at[:, 0].set(tok_N)
  logprobs_NxT = jnp.zeros((N, T), jnp.float32).at[:, 0].set(logp_N)
  tokens_NxT = _constrain(tokens_NxT, mesh_rules)
  logprobs_NxT = _constrain(logprobs_NxT, mesh_rules)
  done_N = jnp.isin(tok_N, eos_E)
  lengths_N = jnp.ones((N,), jnp.int32)
  budget_N = jnp.full((N,), T, jnp.int32) if budget_N is None else _constrain(budget_N, mesh_rules)

  def cond(carry):
    step, _, _, done_N, lengths_N, *_ = carry
    return (step < T) & jnp.any(~done_N & (lengths_N < budget_N))

  def body(carry):
    step, cache, prev_N, done_N, lengths_N, tokens_NxT, logprobs_NxT = carry
    alive_N = ~done_N & (lengths_N < budget_N)
    logits_Nx1xV, cache = model(prev_N[:, None], alive_N[:, None].astype(jnp.int32),
                                cache=cache, layers=layers)
    tok_N, logp_N = draw(logits_Nx1xV[:, 0], None,
                         uniforms_N=row_uniforms(rng, rows_N, jnp.full_like(rows_N, step)))
    tok_N = jnp.where(alive_N, tok_N, cfg.pad_id)
    logp_N = jnp.where(alive_N, logp_N, 0.0)
    tokens_NxT = jax.lax.dynamic_update_slice(tokens_NxT, tok_N[:, None], (0, step))
    logprobs_NxT = jax.lax.dynamic_update_slice(logprobs_NxT, logp_N[:, None],
                                                (0, step))
    lengths_N = lengths_N + alive_N.astype(jnp.int32)
    done_N = done_N | (alive_N & jnp.isin(tok_N, eos_E))  # a row cut at its budget is truncated
    return step + 1, cache, tok_N, done_N, lengths_N, tokens_NxT, logprobs_NxT

  carry = (jnp.int32(1), cache, tok_N, done_N, lengths_N, tokens_NxT, logprobs_NxT)
  for i, length in enumerate(lengths):
    if i:  # the longest row reached the cache's end: grow it (kv_cache.grow)
      grown = jax.tree.map(lambda x: _constrain(x, mesh_rules), kv_cache_lib.grow(carry[1], length))
      carry = carry[:1] + (grown,) + carry[2:]
    # Each phase's loop runs while the next write fits its cache (the last one always does).
    carry = jax.lax.while_loop(lambda c, n=length: cond(c) & (c[1].index < n), body, carry)
  _, _, _, done_N, lengths_N, tokens_NxT, logprobs_NxT = carry
  mask_NxT = (jnp.arange(T)[None, :] < lengths_N[:, None]).astype(jnp.int32)
  return SampleResult(tokens=tokens_NxT, logprobs=logprobs_NxT, mask=mask_NxT,
                      lengths=lengths_N, truncated=~done_N)


_sample_jit = compiling.jit(_sample_program,
                            static_argnames=("graphdef", "cfg", "mesh_rules"))


def _eos_tuple(eos_id, vocab_size: int) -> tuple[int, ...]:
  if eos_id is NO_STOP:
    return ()
  ids = (eos_id,) if isinstance(eos_id, (int, np.integer)) else eos_id
  try:
    ids = tuple(int(i) for i in ids)
  except TypeError:
    raise ValueError(f"eos_id must be an int or a sequence of ints, got {eos_id!r}")
  if not ids or any(not 0 <= i < vocab_size for i in ids):
    raise ValueError(f"eos_id must be one or more token ids in [0, {vocab_size})"
                     f" (or sampler.NO_STOP: no stop token), got {eos_id!r}")
  return ids


def _padded_eos(eos_ids: tuple[int, ...]) -> jax.Array:
  """Stop ids as an array whose length is a multiple of 4 (repeats are harmless),
  so a different set of stop ids rarely means a new program."""
  size = -(-len(eos_ids) // 4) * 4
  return jnp.asarray(eos_ids + eos_ids[:1] * (size - len(eos_ids)), jnp.int32)


def _infer_mesh(state):
  for leaf in jax.tree.leaves(state):
    sharding = getattr(leaf, "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding) and sharding.mesh.size > 1:
      return sharding.mesh
  return None


def _check_draw_args(temperature, top_k, top_p):
  if not isinstance(temperature, (int, float)) or temperature < 0:
    raise ValueError(f"temperature must be a number >= 0 (0 = greedy), got {temperature!r}")
  if not isinstance(top_k, (int, np.integer)) or top_k < 0:
    raise ValueError(f"top_k must be an int >= 0 (0 = off), got {top_k!r}")
  if not isinstance(top_p, (int, float)) or not 0.0 < top_p <= 1.0:
    raise ValueError(f"top_p must be in (0, 1] (1 = off), got {top_p!r}")


def uses_engine(max_slots: int, rows: int) -> bool:
  """Whether `sample_groups` runs the continuous-batching engine: fewer decode slots than this
  process's rows (0 slots: every row at once, the static program)."""
  return 0 < max_slots < rows


def sample_groups(model, prompt_ids, prompt_mask, *, group_size: int,
                  max_new_tokens: int, temperature: float = 1.0,
                  top_p: float = 1.0, top_k: int = 0, eos_id, pad_id: int,
                  rng: jax.Array, prompt_buckets: Sequence[int] | None = None,
                  mesh: jax.sharding.Mesh | None = None,
                  rules=None, max_slots: int | None = None,
                  prefill_chunk: int = 0, row_budgets=None,
                  cache_phases: int | None = None) -> SampleResult:
  """Samples `group_size` responses for each of B prompts in one jitted call.

  Args:
    model: a `Decoder` (parameters may be sharded on a mesh).
    prompt_ids, prompt_mask: int [B, P]; any padding (left is usual), every row
      with at least one real token.
    group_size: G, responses per prompt; rows are group-major (n // G).
    max_new_tokens: T, the response budget.
    temperature: 0 means greedy (top_k / top_p are then ignored).
    top_p: nucleus mass in (0, 1]; 1 turns it off. Applied after top-k.
    top_k: keep the k most likely tokens; 0 turns it off.
    eos_id: one stop token id or a sequence of them; `NO_STOP`: none, every row runs to
      its budget.
    pad_id: the id written after the stop token (and into prompt padding).
    rng: a PRNG key; the same key gives the same output.
    prompt_buckets: static prompt lengths to pad to (default: powers of two,
      at least 16), so new batches of a bucket do not recompile.
    mesh, rules: shard the batch over the mesh axes that the logical name
      "batch" maps to under `rules` (default `sharding.DEFAULT_RULES`). The
      mesh defaults to the one the model's parameters live on, if any. With
      several processes each passes and gets back its own rows.
    max_slots: decode slots per process for the continuous-batching engine
      (`ba_jax.generation.engine`): its KV cache holds `max_slots` rows, whatever B*G is,
      and a finished row's slot takes the next pending one. None or 0, or at
      least this process's B*G rows: every row decodes at once (the static
      program; the engine would have nothing to refill). Both give the same
      tokens for the same key.
    prefill_chunk: the engine prefills prompts this many tokens at a time
      (0: whole), bounding prefill activations for long prompts.
    row_budgets: optional int [B*G], each row's own budget in [1, T]; a row
      that reaches it is truncated (e.g. per-prompt budgets, or a benchmark's
      forced length schedule).
    cache_phases: how many cache lengths the decode loop runs through, so a step's attention
      reads about the written part of the cache, not all of it (`decoding.auto_cache_phases`;
      None or 0: 8 on CPU for caches of 256+ positions, else 1). Same tokens either way.

  Returns:
    A `SampleResult`. `logprobs` are full-vocabulary log-probs at the sampling
    temperature (1.0 when greedy), before top-k / top-p truncation: the numbers
    `score_responses` gives for the same tokens.
  """
  if not isinstance(group_size, (int, np.integer)) or group_size < 1:
    raise ValueError(f"group_size must be an int >= 1, got {group_size!r}")
  if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
  config = getattr(model, "config", None)
  if config is None:
    raise ValueError(f"model must be a ba_jax Decoder with a .config, got {type(model)}")
  eos_ids = _eos_tuple(eos_id, config.vocab_size)
  if not isinstance(pad_id, (int, np.integer)) or not 0 <= pad_id < config.vocab_size:
    raise ValueError(f"pad_id must be a token id in [0, {config.vocab_size}), got {pad_id!r}")
  _check_draw_args(temperature, top_k, top_p)
  if np.ndim(prompt_ids) != 2 or np.shape(prompt_ids) != np.shape(prompt_mask):
    raise ValueError("prompt_ids and prompt_mask must both be [B, P], got shapes"
                     f" {np.shape(prompt_ids)} and {np.shape(prompt_mask)}")
  local_mask = prompt_mask
  if not isinstance(prompt_mask, jax.Array) or prompt_mask.is_fully_addressable:
    local_mask = np.asarray(prompt_mask)
    empty = np.flatnonzero(local_mask.sum(axis=1) == 0)
    if empty.size:
      raise ValueError(f"prompt rows {empty.tolist()} have no real token (all of"
                       " prompt_mask is 0); every prompt needs at least one")
  if max_slots is not None and (not isinstance(max_slots, (int, np.integer)) or max_slots < 0):
    raise ValueError(f"max_slots must be None or an int >= 0 (0 = every row at once), got {max_slots!r}")
  if not isinstance(prefill_chunk, (int, np.integer)) or prefill_chunk < 0:
    raise ValueError(f"prefill_chunk must be an int >= 0 (0 = whole prompt), got {prefill_chunk!r}")
  B, P = np.shape(prompt_ids)
  if row_budgets is not None:
    row_budgets = np.asarray(row_budgets)
    if row_budgets.shape != (B * group_size,) or not (
        (row_budgets >= 1) & (row_budgets <= max_new_tokens)).all():
      raise ValueError(f"row_budgets must be ints in [1, max_new_tokens={max_new_tokens}] of shape"
                       f" [B*G] = ({B * group_size},), got shape {row_budgets.shape}")
    row_budgets = jnp.asarray(row_budgets, jnp.int32)
  if cache_phases is not None and (not isinstance(cache_phases, (int, np.integer)) or cache_phases < 0):
    raise ValueError(f"cache_phases must be None or 0 (auto) or an int >= 1, got {cache_phases!r}")
  bucket = bucket_length(P, prompt_buckets)
  greedy = temperature == 0  # Greedy ignores top-k / top-p: one program for it.
  cfg = _LoopConfig(int(group_size), int(max_new_tokens), int(pad_id), greedy,
                    0 if greedy else int(top_k), 1.0 if greedy else float(top_p),
                    int(cache_phases or 0))  # 0: the program's length picks (auto_cache_phases)

  ids_BxP = jnp.asarray(prompt_ids, jnp.int32)
  mask_BxP = jnp.asarray(local_mask, jnp.int32)
  if bucket > P:  # Left-pad to the bucket; left_justify keeps it that way.
    ids_BxP = jnp.pad(ids_BxP, ((0, 0), (bucket - P, 0)), constant_values=pad_id)
    mask_BxP = jnp.pad(mask_BxP, ((0, 0), (bucket - P, 0)))

  graphdef, state = nnx.split(model)
  mesh = mesh if mesh is not None else _infer_mesh(state)
  mesh_rules = None
  if mesh is not None:
    mesh_rules = (mesh, sharding_lib.DEFAULT_RULES if rules is None else tuple(rules))
    ids_BxP, mask_BxP = (_to_global(x, mesh_rules) for x in (ids_BxP, mask_BxP))
    if row_budgets is not None:
      row_budgets = _to_global(row_budgets, mesh_rules)
  args = (graphdef, state, ids_BxP, mask_BxP, rng, jnp.float32(1.0 if greedy else temperature),
          _padded_eos(eos_ids))
  if uses_engine(max_slots or 0, B * group_size):
    engine_cfg = engine.EngineConfig(cfg, int(max_slots) * jax.process_count(), int(prefill_chunk))
    result = engine.engine_jit(*args, cfg=engine_cfg, mesh_rules=mesh_rules, budget_N=row_budgets)
  else:
    result = _sample_jit(*args, cfg=cfg, mesh_rules=mesh_rules, budget_N=row_budgets)
  if mesh_rules is not None and jax.process_count() > 1:
    result = jax.tree.map(lambda x: _to_local(x, mesh_rules), result)
  return result


def _batch_sharding(x, mesh_rules):
  mesh, rules = mesh_rules
  logical_axes = ("batch",) + (None,) * (x.ndim - 1)
  return sharding_lib.logical_sharding(mesh, rules, logical_axes, shape=x.shape)


def _to_global(x_BxP, mesh_rules):
  """Places prompts batch-sharded; with several processes each gives its own rows."""
  if jax.process_count() > 1:
    mesh, rules = mesh_rules
    sharding = sharding_lib.logical_sharding(mesh, rules, ("batch",) + (None,) * (np.ndim(x_BxP) - 1))
    return jax.make_array_from_process_local_data(sharding, np.asarray(x_BxP))
  return jax.device_put(x_BxP, _batch_sharding(x_BxP, mesh_rules))


def _to_local(x, mesh_rules):
  """This process's rows of a batch-sharded global array."""
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  mesh, _ = mesh_rules
  return multihost_utils.global_array_to_host_local_array(
      x, mesh, _batch_sharding(x, mesh_rules).spec)


def lower_sample(graphdef, params, *, prompts: int, prompt_len: int,
                 group_size: int, max_new_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = 0, pad_id: int = 0,
                 mesh: jax.sharding.Mesh, rules) -> jax.stages.Lowered:
  """The program `sample_groups` runs for `prompts` prompts of `prompt_len`
  tokens, lowered on abstract inputs (`params` may be ShapeDtypeStructs
  carrying shardings): what the dry run compiles to size a rollout."""
  bucket = bucket_length(prompt_len)
  greedy = temperature == 0
  cfg = _LoopConfig(int(group_size), int(max_new_tokens), int(pad_id), greedy,
                    0 if greedy else int(top_k), 1.0 if greedy else float(top_p))
  ids = jax.ShapeDtypeStruct((prompts, bucket), jnp.int32, sharding=(
      sharding_lib.logical_sharding(mesh, rules, ("batch", None),
                                    shape=(prompts, bucket))))
  return _sample_jit.lower(
      graphdef, params, ids, ids, jax.eval_shape(lambda: jax.random.key(0)),
      jax.ShapeDtypeStruct((), jnp.float32), jax.ShapeDtypeStruct((1,), jnp.int32),
      cfg=cfg, mesh_rules=(mesh, tuple(rules)))
