"""One Flax NNX decoder for the Qwen2/Qwen2.5, Qwen3 and Llama families.

The function equals `transformers`' PyTorch model on the same weights: RoPE
(default, linear or llama3 scaling), grouped-query attention, SwiGLU, RMSNorm,
q/k/v bias (Qwen2), q/k RMSNorm (Qwen3), tied or untied embeddings. Every
parameter carries logical axis names in its `out_sharding` metadata (the name
flax 0.12 gives to the `sharding=` metadata); `ba_jax.policy.sharding` maps them to
mesh axes.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ba_jax.config import schema
from ba_jax.policy import attention as attention_lib
from ba_jax.policy import compiling
from ba_jax.policy import sharding as sharding_lib
from ba_jax.policy import kv_cache as kv_cache_lib

SUPPORTED_MODEL_TYPES = schema.MODEL_TYPES
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
ATTENTION_IMPLS = attention_lib.IMPLS
# What the backward pass keeps of each layer: "none" keeps everything, "full" only the layer input,
# the others name a `jax.checkpoint_policies` entry (keep matmul outputs, recompute the rest).
REMAT_POLICIES = schema.REMAT_POLICIES
ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}


def _hashable(value: Any) -> Any:
  if isinstance(value, (list, tuple)):
    return tuple(_hashable(v) for v in value)
  if isinstance(value, dict):
    return tuple(sorted((k, _hashable(v)) for k, v in value.items()))
  return value


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Decoder hyperparameters; `from_hf_dict`/`to_hf_dict` convert config.json."""
  model_type: str
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rope_theta: float = 10000.0
  rope_scaling: tuple | None = None  # ((key, value), ...) incl. ("rope_type", ...)
  rms_norm_eps: float = 1e-6
  tie_word_embeddings: bool = False
  attention_bias: bool = False  # q/k/v bias (always on for Qwen2)
  qk_norm: bool = False  # Qwen3
  max_position_embeddings: int = 32768
  bos_token_id: int | None = None
  eos_token_id: int | tuple | None = None
  dtype: str = "float32"  # compute
  param_dtype: str = "float32"
  remat: str = "none"  # one of REMAT_POLICIES; True/False mean "full"/"none"
  # How the uncached forward computes attention and log-probs, not what the model is: kept out of
  # config.json and of ==/hash, so a config read back from config.json equals the one it was
  # written from. The modules keep them as static attributes, so jitted models still trace apart.
  attention_impl: str = dataclasses.field(default="full", compare=False)  # one of ATTENTION_IMPLS
  attention_block: int = dataclasses.field(default=512, compare=False)  # blockwise tile (queries, keys)
  logprob_chunk: int = dataclasses.field(default=512, compare=False)  # scoring: tokens per LM-head chunk
  # Layer bodies per iteration of the uncached forward's lax.scan (1: one body, the smallest
  # program; more trades compile time and code size for fewer loop iterations). 0 ("auto"): every
  # layer on XLA:CPU, where the scan's loop costs ~10% of a fwd+bwd step against the unrolled
  # layers (experiments/benchmarks/results/model_bench.md), and 1 on accelerators. See `layer_unroll`.
  scan_unroll: int = dataclasses.field(default=0, compare=False)

  def __post_init__(self):
    if isinstance(self.remat, bool):  # configs written before remat policies
      object.__setattr__(self, "remat", "full" if self.remat else "none")
    if self.remat not in REMAT_POLICIES:
      raise ValueError(f"remat={self.remat!r} is not supported; expected one of {REMAT_POLICIES} (or a bool)")
    if not isinstance(self.logprob_chunk, int) or self.logprob_chunk < 1:
      raise ValueError(f"logprob_chunk={self.logprob_chunk!r}; expected a positive int (tokens per chunk)")
    if not isinstance(self.scan_unroll, int) or self.scan_unroll < 0:
      raise ValueError(f"scan_unroll={self.scan_unroll!r}; expected a positive int (layers per scan step) "
                       "or 0 (auto: all layers on CPU, 1 elsewhere)")
    if self.attention_impl not in ATTENTION_IMPLS:
      raise ValueError(f"attention_impl={self.attention_impl!r} is not supported; expected one of {ATTENTION_IMPLS}")
    if not isinstance(self.attention_block, int) or self.attention_block < 1:
      raise ValueError(f"attention_block={self.attention_block!r}; expected a positive int (tokens per tile)")
    if self.model_type not in SUPPORTED_MODEL_TYPES:
      raise ValueError(f"model_type={self.model_type!r} is not supported; expected one of {SUPPORTED_MODEL_TYPES}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
    rope_type = dict(self.rope_scaling or ()).get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
      raise ValueError(f"rope_type={rope_type!r} is not supported; expected one of {SUPPORTED_ROPE_TYPES}")
    for field in ("dtype", "param_dtype"):
      try:
        jnp.dtype(getattr(self, field))
      except TypeError as e:
        raise ValueError(f"{field}={getattr(self, field)!r} is not a dtype name (e.g. 'float32', 'bfloat16')") from e

  @property
  def out_bias(self) -> bool:
    """o_proj bias: Llama and Qwen3 tie it to attention_bias; Qwen2 never has one."""
    return self.attention_bias and self.model_type != "qwen2"

  @classmethod
  def from_hf_dict(cls, d: dict, **overrides) -> "ModelConfig":
    """Builds a config from a transformers config.json dict (transformers 5 layout)."""
    model_type = d.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
      raise ValueError(
          f"unsupported architecture: model_type={model_type!r}, architectures={d.get('architectures')}; "
          f"supported model types are {SUPPORTED_MODEL_TYPES} ({', '.join(ARCHITECTURES.values())})")
    if d.get("hidden_act", "silu") != "silu":
      raise ValueError(f"hidden_act={d['hidden_act']!r} is not supported; expected 'silu'")
    if d.get("use_sliding_window", False):
      raise ValueError("use_sliding_window=True is not supported; expected full attention in every layer")
    if d.get("mlp_bias", False):
      raise ValueError("mlp_bias=True is not supported; expected mlp_bias=False")
    rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
      raise ValueError(f"partial_rotary_factor={rope['partial_rotary_factor']} is not supported; expected 1.0")
    theta = rope.pop("rope_theta", None) or d.get("rope_theta") or 10000.0
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    rope.pop("type", None)
    rope["rope_type"] = rope_type
    heads = d["num_attention_heads"]
    if model_type == "qwen2":
      attention_bias = True
    else:
      attention_bias = bool(d.get("attention_bias", False))
    kwargs = dict(
        model_type=model_type, vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
        intermediate_size=d["intermediate_size"], num_layers=d["num_hidden_layers"], num_heads=heads,
        num_kv_heads=d.get("num_key_value_heads") or heads,
        head_dim=d.get("head_dim") or d["hidden_size"] // heads, rope_theta=float(theta),
        rope_scaling=None if rope_type == "default" else _hashable(rope),
        rms_norm_eps=d.get("rms_norm_eps", 1e-6), tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        attention_bias=attention_bias, qk_norm=model_type == "qwen3",
        max_position_embeddings=d.get("max_position_embeddings", 32768),
        bos_token_id=d.get("bos_token_id"), eos_token_id=_hashable(d.get("eos_token_id")))
    kwargs.update(overrides)
    return cls(**kwargs)

  def to_hf_dict(self) -> dict:
    """The transformers config.json dict for this config (what `from_hf_dict` reads back)."""
    rope = {"rope_theta": self.rope_theta, "rope_type": "default"}
    rope.update({k: list(v) if isinstance(v, tuple) else v for k, v in (self.rope_scaling or ())})
    d = {
        "architectures": [ARCHITECTURES[self.model_type]], "model_type": self.model_type,
        "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
        "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_layers,
        "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
        "head_dim": self.head_dim, "hidden_act": "silu", "rms_norm_eps": self.rms_norm_eps,
        "rope_parameters": rope, "tie_word_embeddings": self.tie_word_embeddings,
        "max_position_embeddings": self.max_position_embeddings, "bos_token_id": self.bos_token_id,
        "eos_token_id": list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id,
        "dtype": self.param_dtype, "use_cache": True,
    }
    if self.model_type == "qwen2":
      d["use_sliding_window"] = False
    else:
      d["attention_bias"] = self.attention_bias
    if self.model_type == "llama":
      d["mlp_bias"] = False
    return d


# The cache layout lives in ba_jax.policy.kv_cache; these names stay importable from here.
KVCache = kv_cache_lib.KVCache
init_cache = kv_cache_lib.init_cache


def rope_inv_freq(config: ModelConfig) -> np.ndarray:
  """Inverse frequencies [head_dim/2] in float32, as transformers computes them."""
  dim = config.head_dim
  inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim))
  inv_freq = inv_freq.astype(np.float32)
  scaling = dict(config.rope_scaling or ())
  rope_type = scaling.get("rope_type", "default")
  if rope_type == "linear":
    inv_freq = inv_freq / np.float32(scaling["factor"])
  elif rope_type == "llama3":
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = (2 * math.pi / inv_freq).astype(np.float32)
    scaled = np.where(wavelen > low_wavelen, inv_freq / np.float32(factor), inv_freq).astype(np.float32)
    smooth = ((old_len / wavelen - low) / (high - low)).astype(np.float32)
    smoothed = ((1 - smooth) * scaled / np.float32(factor) + smooth * scaled).astype(np.float32)
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    inv_freq = np.where(medium, smoothed, scaled)
  return inv_freq.astype(np.float32)


def _rope_cos_sin(config, positions):
  """cos/sin [..., D] of integer `positions` [...] (the rotation angles repeated over both halves)."""
  freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(rope_inv_freq(config))
  emb = jnp.concatenate([freqs, freqs], axis=-1)
  return jnp.cos(emb), jnp.sin(emb)


def _rope_lookup(config, positions_BxL, size: int, anchor_B):
  """cos/sin [B,L,D] of `positions_BxL` (< size) gathered from a [size, D] table.

  The table's rows are `_rope_cos_sin` of 0..size-1, as the direct path computes them, so the
  values are the same bits; the table only depends on `size`, so a decode loop hoists it, and
  each layer's rotation gathers instead of recomputing cos/sin (XLA:CPU fused them into every
  layer). `anchor_B` (any traced [B] array) keeps the table from being constant-folded on the
  host, whose cos/sin need not round as the device's do.
  """
  pos_S = jnp.arange(size, dtype=jnp.int32) + 0 * anchor_B[0].astype(jnp.int32)
  cos_SxD, sin_SxD = _rope_cos_sin(config, pos_S)
  idx_BxL = jnp.clip(positions_BxL, 0, size - 1)
  return cos_SxD[idx_BxL], sin_SxD[idx_BxL]


def _rotate_half(x):
  x1, x2 = jnp.split(x, 2, axis=-1)
  return jnp.concatenate([-x2, x1], axis=-1)


def token_einsum(subscripts: str, x, kernel, *, einsum=jnp.einsum):
  """``einsum(subscripts, x, kernel)`` with ``x``'s two leading axes (rows, positions) merged into one
  token axis for the product: ``subscripts`` names that axis ``t`` ("te,em->tm"); the result gets
  the two axes back.

  The same sums. With rows and positions as two axes, the weight's gradient contracts over both, and
  XLA:CPU ran such a backward about 2x slower than the one-axis form (an MLP's fwd+bwd at 64 rows x
  48 positions: 17 vs 9 ms; experiments/benchmarks/results/token_axis_bench.md); merging leading axes is a free
  reshape on every backend, sharded rows included.
  """
  B, L = x.shape[:2]
  y = einsum(subscripts, x.reshape(B * L, *x.shape[2:]), kernel)
  return y.reshape(B, L, *y.shape[1:])


def apply_rope(x_BxLxHxD, cos_BxLxD, sin_BxLxD):
  cos = cos_BxLxD[:, :, None, :].astype(x_BxLxHxD.dtype)
  sin = sin_BxLxD[:, :, None, :].astype(x_BxLxHxD.dtype)
  return x_BxLxHxD * cos + _rotate_half(x_BxLxHxD) * sin


def _param(rngs: nnx.Rngs, shape, axes, dtype, init: str = "normal") -> nnx.Param:
  if init == "normal":
    value = 0.02 * jax.random.normal(rngs.params(), shape, jnp.float32)
  elif init == "ones":
    value = jnp.ones(shape, jnp.float32)
  else:
    value = jnp.zeros(shape, jnp.float32)
  return nnx.Param(value.astype(dtype), out_sharding=axes, eager_sharding=False)


class RMSNorm(nnx.Module):
  def __init__(self, dim: int, eps: float, dtype, param_dtype, *, rngs: nnx.Rngs):
    self.scale = _param(rngs, (dim,), ("norm",), param_dtype, "ones")
    self.eps = eps
    self.dtype = dtype

  def __call__(self, x):
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return self.scale[...].astype(self.dtype) * x32.astype(self.dtype)


class Attention(nnx.Module):
  def __init__(self, c: ModelConfig, *, rngs: nnx.Rngs):
    pd, E, H, K, D = c.param_dtype, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
    self.dtype = jnp.dtype(c.dtype)
    self.attention_impl, self.attention_block = c.attention_impl, c.attention_block
    self.q_proj = _param(rngs, (E, H, D), ("embed", "heads", "head_dim"), pd)
    self.k_proj = _param(rngs, (E, K, D), ("embed", "kv_heads", "head_dim"), pd)
    self.v_proj = _param(rngs, (E, K, D), ("embed", "kv_heads", "head_dim"), pd)
    self.o_proj = _param(rngs, (H, D, E), ("heads", "head_dim", "embed"), pd)
    bias = c.attention_bias
    self.q_bias = _param(rngs, (H, D), ("heads", "head_dim"), pd, "zeros") if bias else None
    self.k_bias = _param(rngs, (K, D), ("kv_heads", "head_dim"), pd, "zeros") if bias else None
    self.v_bias = _param(rngs, (K, D), ("kv_heads", "head_dim"), pd, "zeros") if bias else None
    self.o_bias = _param(rngs, (E,), ("embed",), pd, "zeros") if c.out_bias else None
    self.q_norm = RMSNorm(D, c.rms_norm_eps, self.dtype, pd, rngs=rngs) if c.qk_norm else None
    self.k_norm = RMSNorm(D, c.rms_norm_eps, self.dtype, pd, rngs=rngs) if c.qk_norm else None

  def _project(self, x, kernel, bias):
    # .astype: LoRA's delta (qwix) is in the adapters' dtype; the layer computes in self.dtype.
    y = token_einsum("te,ehd->thd", x, kernel[...].astype(self.dtype)).astype(self.dtype)
    return y if bias is None else y + bias[...].astype(self.dtype)

  def __call__(self, x_BxLxE, cos_BxLxD, sin_BxLxD, mask_BxL, cache_kv=None, index=None, allowed_BxLxS=None,
               shared=None):
    """Uncached: causal attention over `mask_BxL`, or with `shared=(P, G)` over packed rows of a
    shared prefix and G suffixes (`attention.attend_shared_prefix`). Cached: `allowed_BxLxS` says
    which cache slots each new token sees; the new keys/values are written at slot `index`."""
    q = self._project(x_BxLxE, self.q_proj, self.q_bias)
    k = self._project(x_BxLxE, self.k_proj, self.k_bias)
    v = self._project(x_BxLxE, self.v_proj, self.v_bias)
    if self.q_norm is not None:
      q, k = self.q_norm(q), self.k_norm(k)
    q, k = apply_rope(q, cos_BxLxD, sin_BxLxD), apply_rope(k, cos_BxLxD, sin_BxLxD)
    if cache_kv is None and shared is not None:
      out, new_kv = attention_lib.attend_shared_prefix(
          q, k, v, mask_BxL, prefix_len=shared[0], group=shared[1], impl=self.attention_impl,
          block=self.attention_block), None
    elif cache_kv is None:
      out, new_kv = attention_lib.attend(q, k, v, mask_BxL, impl=self.attention_impl,
                                         block=self.attention_block), None
    else:
      k, v = kv_cache_lib.write_kv(*cache_kv, k, v, index)  # [B,K,D,S], [B,K,S,D]; shared or per-row index
      new_kv = (k, v)
      out = attention_lib.full_attention(q, k, v, allowed_BxLxS, kv_axes="bksd", k_axes=kv_cache_lib.key_axes())
    out = token_einsum("thd,hde->te", out, self.o_proj[...].astype(self.dtype)).astype(self.dtype)
    if self.o_bias is not None:
      out = out + self.o_bias[...].astype(self.dtype)
    return out, new_kv


class MLP(nnx.Module):
  def __init__(self, c: ModelConfig, *, rngs: nnx.Rngs):
    E, M, pd = c.hidden_size, c.intermediate_size, c.param_dtype
    self.dtype = jnp.dtype(c.dtype)
    self.gate_proj = _param(rngs, (E, M), ("embed", "mlp"), pd)
    self.up_proj = _param(rngs, (E, M), ("embed", "mlp"), pd)
    self.down_proj = _param(rngs, (M, E), ("mlp", "embed"), pd)

  def __call__(self, x_BxLxE):
    dt = self.dtype
    # einsum rather than `@`: LoRA (qwix) intercepts jnp.einsum calls made in the module itself
    # and adds its delta in the adapters' dtype (hence .astype).
    gate = token_einsum("te,em->tm", x_BxLxE, self.gate_proj[...].astype(dt)).astype(dt)
    up = token_einsum("te,em->tm", x_BxLxE, self.up_proj[...].astype(dt)).astype(dt)
    return token_einsum("tm,me->te", jax.nn.silu(gate) * up, self.down_proj[...].astype(dt)).astype(dt)


class DecoderLayer(nnx.Module):
  def __init__(self, c: ModelConfig, *, rngs: nnx.Rngs):
    dt = jnp.dtype(c.dtype)
    self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dt, c.param_dtype, rngs=rngs)
    self.self_attn = Attention(c, rngs=rngs)
    self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dt, c.param_dtype, rngs=rngs)
    self.mlp = MLP(c, rngs=rngs)

  def __call__(self, x, cos, sin, mask, cache_kv=None, index=None, allowed=None, shared=None):
    h, new_kv = self.self_attn(self.input_layernorm(x), cos, sin, mask, cache_kv, index, allowed, shared)
    x = x + h
    return x + self.mlp(self.post_attention_layernorm(x)), new_kv


# The residual stream between layers and at the LM head: rows over data x fsdp.
RESIDUAL_AXES = ("activation_batch", "length", "activation_embed")


def layer_unroll(config: ModelConfig, backend: str | None = None) -> int:
  """Layer bodies per scan iteration: `config.scan_unroll`, or for 0 ("auto") every layer on CPU
  and 1 on an accelerator (`backend`: default `compiling.backend()`)."""
  if config.scan_unroll:
    return config.scan_unroll
  return config.num_layers if (backend or compiling.backend()) == "cpu" else 1


def _remat(fn, policy: str):
  if policy == "none":
    return fn
  if policy == "full":
    return jax.checkpoint(fn, prevent_cse=False)
  return jax.checkpoint(fn, policy=getattr(jax.checkpoint_policies, policy), prevent_cse=False)


class Decoder(nnx.Module):
  """Causal LM: `model(ids_BxL, mask_BxL)` -> float32 logits [B,L,V].

  The layers are one `DecoderLayer` whose parameters carry a leading "layers" axis; the uncached
  forward runs them with `jax.lax.scan` (one compiled layer body, remat applied to it), the cached
  decode path loops over layer slices so each layer's KV cache stays its own buffer.
  """

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs | None = None):
    rngs = rngs if rngs is not None else nnx.Rngs(0)
    c = config
    self.config = c
    self.embed_tokens = _param(rngs, (c.vocab_size, c.hidden_size), ("vocab", "embed"), c.param_dtype)

    @nnx.split_rngs(splits=c.num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def stacked_layers(layer_rngs):
      return DecoderLayer(c, rngs=layer_rngs)

    self.layers = stacked_layers(rngs)
    self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, jnp.dtype(c.dtype), c.param_dtype, rngs=rngs)
    self.lm_head = (None if c.tie_word_embeddings else
                    _param(rngs, (c.hidden_size, c.vocab_size), ("embed", "vocab"), c.param_dtype))

  def __call__(self, input_ids_BxL, attention_mask_BxL=None, *, positions_BxL=None, cache: KVCache | None = None,
               attention_mask=None, layers: tuple | None = None):
    """Float32 logits [B,L,V] (and the updated cache when `cache` is given); `layers`: see `hidden_states`."""
    x, new_cache = self.hidden_states(input_ids_BxL, attention_mask_BxL, positions_BxL=positions_BxL,
                                      cache=cache, attention_mask=attention_mask, layers=layers)
    head, axes = self.head_operand()
    logits = token_einsum(f"te,{axes}->tv", x, head, einsum=attention_lib.einsum_f32)
    return logits if cache is None else (logits, new_cache)

  def head_weights(self) -> jax.Array:
    """The LM head [E,V] in the compute dtype (the embedding's transpose when tied)."""
    head = self.embed_tokens[...].T if self.lm_head is None else self.lm_head[...]
    return head.astype(jnp.dtype(self.config.dtype))

  def head_operand(self) -> tuple[jax.Array, str]:
    """``(weights, axes)`` of the LM head as stored, in the compute dtype: the tied embedding
    [V,E] (``"ve"``) or ``lm_head`` [E,V] (``"ev"``). Products name the axes (``f"te,{axes}->tv"``)
    instead of transposing: XLA:CPU copied a tied [V,E] embedding to [E,V] for every forward
    (about 0.1 s a call for SmolLM2's 49152 x 576)."""
    if self.lm_head is None:
      return self.embed_tokens[...].astype(jnp.dtype(self.config.dtype)), "ve"
    return self.lm_head[...].astype(jnp.dtype(self.config.dtype)), "ev"

  def layer_slices(self) -> tuple:
    """The stacked layers as one `DecoderLayer` per layer (slices of the stacked parameters).

    A decode loop that takes these once, outside the loop, and passes them as `layers=` reads each
    layer's weights in place; slicing the stack inside the loop copies every weight every step
    (XLA:CPU does not hoist the slices: 24.3 s vs 18.9 s for 128 rows x 64 tokens, see the report).
    """
    graphdef, state = nnx.split(self.layers)
    return tuple(nnx.merge(graphdef, jax.tree.map(lambda p, i=i: p[i], state))
                 for i in range(self.config.num_layers))

  def hidden_states(self, input_ids_BxL, attention_mask_BxL=None, *, positions_BxL=None,
                    cache: KVCache | None = None, attention_mask=None, layers: tuple | None = None,
                    shared_prefix: tuple[int, int] | None = None):
    """The final-norm hidden states [B,L,E] that the LM head reads, and the updated cache (or None).

    `layers`: `self.layer_slices()` (or per-layer modules), taken once outside a decode loop; on the
    uncached path they run in an unrolled Python loop instead of the layer scan (the pre-scan program,
    which `experiments/benchmarks/bench_model.py` times against the scan).

    `shared_prefix=(P, G)` (uncached only): each row is packed as a prefix of P positions followed
    by G suffixes of (L - P) / G positions that each continue it, e.g. a prompt and its group's
    responses. Every suffix position gets the hidden state it would get in the row
    `[prefix; suffix_g]` alone (`attention.attend_shared_prefix`), and the prefix is computed once.
    Default positions count from the prefix's first real token and continue into each suffix."""
    if attention_mask is not None:
      if attention_mask_BxL is not None:
        raise ValueError("pass the attention mask once, as attention_mask_BxL or attention_mask, not both")
      attention_mask_BxL = attention_mask
    c = self.config
    dt = jnp.dtype(c.dtype)
    input_ids_BxL = jnp.asarray(input_ids_BxL)
    if input_ids_BxL.ndim != 2:
      raise ValueError(f"input_ids must be [batch, length], got shape {input_ids_BxL.shape}")
    B, L = input_ids_BxL.shape
    mask_BxL = (jnp.ones((B, L), jnp.int32) if attention_mask_BxL is None
                else jnp.asarray(attention_mask_BxL).astype(jnp.int32))
    if mask_BxL.shape != (B, L):
      raise ValueError(f"attention_mask shape {mask_BxL.shape} does not match input_ids shape {(B, L)}")
    if shared_prefix is not None:
      P, G = shared_prefix
      if cache is not None:
        raise ValueError("shared_prefix is for the uncached forward; the KV cache holds one row per sequence")
      if not (isinstance(P, int) and isinstance(G, int) and 1 <= P <= L and G >= 1 and (L - P) % G == 0):
        raise ValueError(f"shared_prefix={shared_prefix!r}: expected (P, G) with L - P = {L} - P split into "
                         "G equal suffixes")
      if positions_BxL is None:
        prefix_B = jnp.sum(mask_BxL[:, :P], axis=1)
        suffix_BxGxT = mask_BxL[:, P:].reshape(B, G, (L - P) // G)
        positions_BxL = jnp.maximum(jnp.concatenate([
            jnp.cumsum(mask_BxL[:, :P], axis=1),
            (prefix_B[:, None, None] + jnp.cumsum(suffix_BxGxT, axis=2)).reshape(B, L - P)], axis=1) - 1, 0)
    if cache is not None:
      kv_cache_lib.check_capacity(cache, L)
      new_mask_BxS, allowed, already_B = kv_cache_lib.extend(cache, mask_BxL)
    else:
      already_B = jnp.zeros((B,), jnp.int32)
    if positions_BxL is None:
      positions_BxL = jnp.maximum(already_B[:, None] + jnp.cumsum(mask_BxL, axis=1) - 1, 0)
    if cache is not None:
      cos, sin = _rope_lookup(c, positions_BxL, cache.mask.shape[1] + L, already_B)
    else:
      cos, sin = _rope_cos_sin(c, positions_BxL)

    x = self.embed_tokens[...][input_ids_BxL].astype(dt)
    x = sharding_lib.constrain(x, RESIDUAL_AXES)
    if layers is not None:
      # Modules of this trace level: a layer taken outside a decode loop and called inside it
      # must not be mutated there, and LoRA (qwix) sets attributes on the module it runs in.
      layers = [nnx.merge(*nnx.split(layer)) for layer in layers]
    if cache is None and layers is not None:  # unrolled: one program body per layer
      for layer in layers:
        x, _ = _remat(lambda x, layer=layer: layer(x, cos, sin, mask_BxL, shared=shared_prefix), c.remat)(x)
        x = sharding_lib.constrain(x, RESIDUAL_AXES)
      new_cache = None
    elif cache is None:
      graphdef, layer_state = nnx.split(self.layers)

      def body(x, state):
        x, _ = nnx.merge(graphdef, state)(x, cos, sin, mask_BxL, shared=shared_prefix)
        return sharding_lib.constrain(x, RESIDUAL_AXES), None

      # Remat only pays in a backward pass; the cached (sampling) path has none.
      x, _ = jax.lax.scan(_remat(body, c.remat), x, layer_state, unroll=layer_unroll(c))
      new_cache = None
    else:
      new_k, new_v = [], []
      for i, layer in enumerate(self.layer_slices() if layers is None else layers):
        x, (k, v) = layer(x, cos, sin, mask_BxL, (cache.k[i], cache.v[i]), cache.index, allowed)
        new_k.append(k)
        new_v.append(v)
      new_cache = kv_cache_lib.advance(cache, new_k, new_v, new_mask_BxS, L)
    return sharding_lib.constrain(self.norm(x), RESIDUAL_AXES), new_cache
