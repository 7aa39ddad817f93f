"""Group sampling: G responses per prompt from one jitted prefill + decode loop.

`sample_groups` left-justifies the prompts, pads them to a static bucket
length (so a new batch of the same bucket reuses the compiled program),
prefills a preallocated KV cache once on the B prompts, repeats the cache G
times and decodes with a `lax.while_loop` that stops as soon as every row has
emitted a stop token. Draws use an inverse CDF (one uniform per row), which on
CPU is several times cheaper than `jax.random.categorical` over the vocabulary.
"""

import dataclasses
import functools
import math
from typing import Sequence

import flax
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ba_jax import model as model_lib
from ba_jax import sharding as sharding_lib
from ba_jax.scoring import left_justify

DEFAULT_MIN_BUCKET = 16


@flax.struct.dataclass
class SampleResult:
  """Responses, group-major: row n answers prompt n // group_size.

  tokens: int32 [B*G, T], pad_id after the stop token.
  logprobs: float32 [B*G, T], log-prob of each sampled token under
    softmax(logits / temperature) over the full vocabulary (before top-k /
    top-p truncation; temperature 1.0 when greedy), 0 where mask is 0.
  mask: int32 [B*G, T], 1 up to and including the stop token.
  lengths: int32 [B*G], the number of response tokens (sum of mask).
  truncated: bool [B*G], True when the row hit max_new_tokens without a stop
    token.
  """
  tokens: jax.Array
  logprobs: jax.Array
  mask: jax.Array
  lengths: jax.Array
  truncated: jax.Array


@dataclasses.dataclass(frozen=True)
class _LoopConfig:
  """What the compiled program depends on (temperature and stop ids do not)."""
  group_size: int
  max_new_tokens: int
  pad_id: int
  greedy: bool
  top_k: int
  top_p: float


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


def _inverse_cdf(probs_NxK: jax.Array, u_N: jax.Array):
  """Index drawn from each row's (unnormalised) probabilities, one uniform each.

  Returns `(index_N, total_N)`, total being the row's summed mass.

  An entry of probability 0 is never returned: the target stays strictly below
  the row total, and the first cdf entry above it has positive mass.
  """
  cdf_NxK = jnp.cumsum(probs_NxK, axis=-1)
  total_N = cdf_NxK[:, -1]
  target_N = jnp.minimum(u_N * total_N, jnp.nextafter(total_N, 0.0))
  return jnp.sum(cdf_NxK <= target_N[:, None], axis=-1, dtype=jnp.int32), total_N


def draw_tokens(logits_NxV: jax.Array, rng: jax.Array, temperature=1.0, *,
                greedy: bool = False, top_k: int = 0, top_p: float = 1.0):
  """Draws one token per row; returns `(tokens_N, logprobs_N)`.

  `temperature` may be traced; `greedy`, `top_k` (0 = off) and `top_p`
  (1 = off) are static. The log-prob is under softmax(logits / temperature)
  over the full vocabulary, whatever top-k / top-p kept (under
  softmax(logits) when greedy), so it equals what `score_responses` gives.
  """
  logits_NxV = logits_NxV.astype(jnp.float32)
  if greedy:
    tok_N = jnp.argmax(logits_NxV, axis=-1).astype(jnp.int32)
    picked_N = jnp.take_along_axis(logits_NxV, tok_N[:, None], axis=-1)[:, 0]
    return tok_N, picked_N - jax.nn.logsumexp(logits_NxV, axis=-1)
  scaled_NxV = logits_NxV / temperature
  u_N = jax.random.uniform(rng, scaled_NxV.shape[:1], dtype=jnp.float32)
  max_N = jnp.max(scaled_NxV, axis=-1)
  if top_k == 0 and top_p >= 1.0:
    probs_NxV = jnp.exp(scaled_NxV - max_N[:, None])
    tok_N, total_N = _inverse_cdf(probs_NxV, u_N)
  else:
    vocab = scaled_NxV.shape[-1]
    top_NxK, top_idx_NxK = jax.lax.top_k(scaled_NxV, min(top_k or vocab, vocab))
    if top_p < 1.0:
      # Nucleus on the top-k distribution, as transformers does: keep the
      # smallest prefix whose mass reaches top_p (always the first token).
      probs_NxK = jax.nn.softmax(top_NxK, axis=-1)
      mass_before_NxK = jnp.cumsum(probs_NxK, axis=-1) - probs_NxK
      top_NxK = jnp.where(mass_before_NxK < top_p, top_NxK, -jnp.inf)
    pick_N, _ = _inverse_cdf(jnp.exp(top_NxK - max_N[:, None]), u_N)
    # Kept entries come first; a rounding gap in the cdf must not step past them.
    kept_N = jnp.sum(top_NxK > -jnp.inf, axis=-1, dtype=jnp.int32)
    pick_N = jnp.minimum(pick_N, kept_N - 1)
    tok_N = jnp.take_along_axis(top_idx_NxK, pick_N[:, None], axis=-1)[:, 0]
    total_N = jnp.sum(jnp.exp(scaled_NxV - max_N[:, None]), axis=-1)
  picked_N = jnp.take_along_axis(scaled_NxV, tok_N[:, None], axis=-1)[:, 0]
  return tok_N.astype(jnp.int32), picked_N - max_N - jnp.log(total_N)


def _constrain(x, mesh_rules):
  """Shards x's leading (batch) axis as the rules map "batch", where it divides."""
  if mesh_rules is None or x.ndim == 0:
    return x
  mesh, rules = mesh_rules
  logical_axes = ("batch",) + (None,) * (x.ndim - 1)
  return jax.lax.with_sharding_constraint(
      x, sharding_lib.logical_sharding(mesh, rules, logical_axes, shape=x.shape))


def _sample_program(graphdef, state, prompt_ids_BxP, prompt_mask_BxP, rng,
                    temperature, eos_E, cfg: _LoopConfig, mesh_rules):
  global _TRACE_COUNT
  _TRACE_COUNT += 1  # Runs only while tracing: counts compilations.
  model = nnx.merge(graphdef, state)
  G, T = cfg.group_size, cfg.max_new_tokens
  B, P = prompt_ids_BxP.shape
  N = B * G
  ids_BxP, mask_BxP = left_justify(prompt_ids_BxP, prompt_mask_BxP, cfg.pad_id)
  cache = model_lib.init_cache(model.config, B, P + T - 1)  # the last token is not fed
  cache = jax.tree.map(lambda x: _constrain(x, mesh_rules), cache)
  layers = model.layer_slices()  # once, outside the decode loop (see Decoder.layer_slices)
  logits_BxPxV, cache = model(ids_BxP, mask_BxP, cache=cache, layers=layers)
  # Left-justified, so the last column holds every prompt's last token.
  repeat = lambda x: x if x.ndim == 0 else jnp.repeat(x, G, axis=0)
  cache = jax.tree.map(lambda x: _constrain(repeat(x), mesh_rules), cache)
  logits_NxV = _constrain(repeat(logits_BxPxV[:, -1]), mesh_rules)
  draw = functools.partial(draw_tokens, temperature=temperature, greedy=cfg.greedy,
                           top_k=cfg.top_k, top_p=cfg.top_p)

  tok_N, logp_N = draw(logits_NxV, jax.random.fold_in(rng, 0))
  tokens_NxT = jnp.full((N, T), cfg.pad_id, jnp.int32).at[:, 0].set(tok_N)
  logprobs_NxT = jnp.zeros((N, T), jnp.float32).at[:, 0].set(logp_N)
  tokens_NxT = _constrain(tokens_NxT, mesh_rules)
  logprobs_NxT = _constrain(logprobs_NxT, mesh_rules)
  done_N = jnp.isin(tok_N, eos_E)
  lengths_N = jnp.ones((N,), jnp.int32)

  def cond(carry):
    step, _, _, done_N, *_ = carry
    return (step < T) & ~jnp.all(done_N)

  def body(carry):
    step, cache, prev_N, done_N, lengths_N, tokens_NxT, logprobs_NxT = carry
    alive_N = ~done_N
    logits_Nx1xV, cache = model(prev_N[:, None], alive_N[:, None].astype(jnp.int32),
                                cache=cache, layers=layers)
    tok_N, logp_N = draw(logits_Nx1xV[:, 0], jax.random.fold_in(rng, step))
    tok_N = jnp.where(alive_N, tok_N, cfg.pad_id)
    logp_N = jnp.where(alive_N, logp_N, 0.0)
    tokens_NxT = jax.lax.dynamic_update_slice(tokens_NxT, tok_N[:, None], (0, step))
    logprobs_NxT = jax.lax.dynamic_update_slice(logprobs_NxT, logp_N[:, None],
                                                (0, step))
    lengths_N = lengths_N + alive_N.astype(jnp.int32)
    done_N = done_N | jnp.isin(tok_N, eos_E)
    return step + 1, cache, tok_N, done_N, lengths_N, tokens_NxT, logprobs_NxT

  carry = (jnp.int32(1), cache, tok_N, done_N, lengths_N, tokens_NxT, logprobs_NxT)
  _, _, _, done_N, lengths_N, tokens_NxT, logprobs_NxT = jax.lax.while_loop(
      cond, body, carry)
  mask_NxT = (jnp.arange(T)[None, :] < lengths_N[:, None]).astype(jnp.int32)
  return SampleResult(tokens=tokens_NxT, logprobs=logprobs_NxT, mask=mask_NxT,
                      lengths=lengths_N, truncated=~done_N)


_sample_jit = jax.jit(_sample_program,
                      static_argnames=("graphdef", "cfg", "mesh_rules"))


def _eos_tuple(eos_id, vocab_size: int) -> tuple[int, ...]:
  ids = (eos_id,) if isinstance(eos_id, (int, np.integer)) else eos_id
  try:
    ids = tuple(int(i) for i in ids)
  except TypeError:
    raise ValueError(f"eos_id must be an int or a sequence of ints, got {eos_id!r}")
  if not ids or any(not 0 <= i < vocab_size for i in ids):
    raise ValueError(f"eos_id must be one or more token ids in [0, {vocab_size}),"
                     f" got {eos_id!r}")
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


def sample_groups(model, prompt_ids, prompt_mask, *, group_size: int,
                  max_new_tokens: int, temperature: float = 1.0,
                  top_p: float = 1.0, top_k: int = 0, eos_id, pad_id: int,
                  rng: jax.Array, prompt_buckets: Sequence[int] | None = None,
                  mesh: jax.sharding.Mesh | None = None,
                  rules=None) -> SampleResult:
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
    eos_id: one stop token id or a sequence of them.
    pad_id: the id written after the stop token (and into prompt padding).
    rng: a PRNG key; the same key gives the same output.
    prompt_buckets: static prompt lengths to pad to (default: powers of two,
      at least 16), so new batches of a bucket do not recompile.
    mesh, rules: shard the batch over the mesh axes that the logical name
      "batch" maps to under `rules` (default `sharding.DEFAULT_RULES`). The
      mesh defaults to the one the model's parameters live on, if any. With
      several processes each passes and gets back its own rows.

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
  B, P = np.shape(prompt_ids)
  bucket = bucket_length(P, prompt_buckets)
  greedy = temperature == 0  # Greedy ignores top-k / top-p: one program for it.
  cfg = _LoopConfig(int(group_size), int(max_new_tokens), int(pad_id), greedy,
                    0 if greedy else int(top_k), 1.0 if greedy else float(top_p))

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
  result = _sample_jit(graphdef, state, ids_BxP, mask_BxP, rng,
                       jnp.float32(1.0 if greedy else temperature),
                       _padded_eos(eos_ids), cfg=cfg,
                       mesh_rules=mesh_rules)
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
    sharding = sharding_lib.logical_sharding(mesh, rules, ("batch", None))
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
