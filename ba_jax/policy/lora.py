"""LoRA adapters on the decoder's projections, through qwix.

``apply(model, lora)`` gives every decoder layer qwix's LoRA
(``qwix.LoraProvider`` + ``qwix.apply_lora_to_model``): each ``jnp.einsum``
of a projection weight inside a module whose path (within a layer:
``self_attn`` or ``mlp``) matches ``lora.module_path`` gains
``(alpha / rank) * (x @ A) @ B``, with ``A`` he-uniform and ``B`` zero, so an
adapted model starts equal to its base. qwix is applied to one layer inside
an ``nnx.vmap``, so the adapters are stacked on the layers' leading axis like
the weights they adapt and the layer scan, the cached decode loop, the
sampler and the engine all run the adapted layers unchanged.

The adapters are ``nnx.LoRAParam`` variables (a kind of ``nnx.Param``) named
``<weight>_lora_a`` / ``<weight>_lora_b`` next to ``<weight>``. Functions here
work on the model's state: ``split`` (adapters, base), ``adapters_off``
(the base policy: every ``B`` zero, no second copy of the weights),
``merged`` (the base weights with ``scale * A @ B`` added: a plain decoder)
and ``peft_tensors`` / ``peft_config`` (the adapters in PEFT's layout).
"""
from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ba_jax.policy import model as model_lib

# Module paths inside one decoder layer that hold projection weights.
LAYER_MODULES = ("self_attn", "mlp")
# Weights each of them adapts (every einsum against a weight of the module), in HF's names.
MODULE_WEIGHTS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
                  "mlp": ("gate_proj", "up_proj", "down_proj")}
SUFFIX_A, SUFFIX_B = "_lora_a", "_lora_b"


def enabled(lora) -> bool:
  """True when the ``model.lora`` section asks for adapters (rank > 0)."""
  return lora is not None and lora.rank > 0


def adapted_modules(module_path: str) -> tuple[str, ...]:
  """The layer modules ``module_path`` (a regex, full match) selects; raises when none."""
  try:
    pattern = re.compile(module_path)
  except re.error as e:
    raise ValueError(f"model.lora.module_path={module_path!r} is not a regular expression: {e}") from None
  chosen = tuple(m for m in LAYER_MODULES if pattern.fullmatch(m))
  if not chosen:
    raise ValueError(f"model.lora.module_path={module_path!r} matches none of a decoder layer's "
                     f"modules {list(LAYER_MODULES)}; e.g. '.*' (both) or 'self_attn'")
  return chosen


def _provider(lora):
  import qwix
  return qwix.LoraProvider(module_path=lora.module_path, rank=lora.rank, alpha=float(lora.alpha),
                           dropout=float(lora.dropout))


def apply(model: model_lib.Decoder, lora, *, seed: int = 0) -> model_lib.Decoder:
  """``model`` with LoRA adapters on its layers (in place; also returned).

  ``lora``: the ``model.lora`` config section (rank, alpha, dropout,
  module_path). ``seed`` draws the ``A`` matrices (one key per layer).
  """
  adapted_modules(lora.module_path)
  c = model.config
  provider = _provider(lora)
  E, D = c.hidden_size, c.head_dim
  # qwix runs the layer once on inputs of these shapes to create the adapters. It finds which
  # weight an einsum reads by the array's identity, or under jit by tracing back through a cast;
  # under vmap a cast to the compute dtype hides it (k_proj and v_proj, gate_proj and up_proj
  # share shapes), so the layers compute in the parameters' dtype for this one call.
  compute, params_dtype = jnp.dtype(c.dtype), jnp.dtype(c.param_dtype)
  model.layers.set_attributes(dtype=params_dtype)
  x = jnp.zeros((1, 1, E), params_dtype)
  rope = jnp.zeros((1, 1, D), jnp.float32)
  mask = jnp.ones((1, 1), jnp.int32)

  @nnx.vmap(in_axes=(0, 0), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
  def adapt(layer, key):
    import qwix
    return qwix.apply_lora_to_model(layer, provider, x, rope, rope, mask, rngs=nnx.Rngs(params=key))

  keys = jax.random.split(jax.random.key(seed), c.num_layers)
  layers = adapt(model.layers, keys)
  layers.set_attributes(dtype=compute)
  model.layers = layers
  if len(jax.tree.leaves(nnx.state(layers, nnx.LoRAParam))) != 2 * len(_expected(lora)):
    raise RuntimeError(f"qwix created adapters for {sorted(_names(layers))}; expected "
                       f"{sorted(_expected(lora))}")
  return model


def _expected(lora) -> list[str]:
  return [w for m in adapted_modules(lora.module_path) for w in MODULE_WEIGHTS[m]]


def _names(layers) -> set[str]:
  pure = nnx.to_pure_dict(nnx.state(layers, nnx.LoRAParam))
  return {weight for _, weight in _adapter_pairs(pure)}


def split(params) -> tuple[Any, Any]:
  """A model state -> ``(adapters, base)`` states."""
  return nnx.split_state(params, nnx.LoRAParam, ...)


def join(adapters, base):
  """``split``'s inverse."""
  return nnx.merge_state(adapters, base)


def is_adapted(params) -> bool:
  """True when a model state holds LoRA adapters."""
  return bool(jax.tree.leaves(nnx.filter_state(params, nnx.LoRAParam)))


def adapters_off(params):
  """The base policy as the same state with every ``B`` zero (``A`` kept):
  its logits are the base model's exactly, with no copy of the weights."""
  adapters, base = split(params)
  def off(path, variable):
    if not str(path[-1]).endswith(SUFFIX_B):
      return variable
    if isinstance(variable, nnx.Variable):
      return variable.replace(jnp.zeros_like(variable.get_value()))
    return jnp.zeros_like(variable)

  return join(nnx.map_state(off, adapters), base)


def _adapter_pairs(pure: dict, prefix=()):
  """Yields ``(path to the module dict, weight name)`` for each adapted weight of a pure dict."""
  for name, value in pure.items():
    if isinstance(value, dict):
      yield from _adapter_pairs(value, prefix + (name,))
    elif isinstance(name, str) and name.endswith(SUFFIX_A):
      yield prefix, name[: -len(SUFFIX_A)]


def _delta(a, b, weight_shape, scale):
  """``scale * A @ B`` in the weight's layout; ``a``: [layers, *in, r], ``b``: [layers, r, *out]."""
  layers, rank = a.shape[0], a.shape[-1]
  a2 = a.reshape(layers, -1, rank).astype(jnp.float32)
  b2 = b.reshape(layers, rank, -1).astype(jnp.float32)
  return (scale * jnp.einsum("lir,lro->lio", a2, b2)).reshape(weight_shape)


def merged(model: model_lib.Decoder, lora, *, adapters: bool = True) -> model_lib.Decoder:
  """A plain decoder (no adapters) whose weights are the base's plus
  ``(alpha / rank) * A @ B``, in the base weights' dtype (``adapters=False``:
  the base's alone)."""
  c = model.config
  plain = nnx.eval_shape(lambda: model_lib.Decoder(c, rngs=nnx.Rngs(0)))
  pure = nnx.to_pure_dict(nnx.state(model))
  scale = float(lora.alpha) / lora.rank
  for prefix, weight in list(_adapter_pairs(pure)):
    node = pure
    for key in prefix:
      node = node[key]
    w = node[weight]
    a, b = node.pop(weight + SUFFIX_A), node.pop(weight + SUFFIX_B)
    if adapters:
      node[weight] = (w.astype(jnp.float32) + _delta(a, b, w.shape, scale)).astype(w.dtype)
    for key in [k for k in node if isinstance(k, str) and k.startswith(weight + "_lora")]:
      node.pop(key)
  graphdef, state = nnx.split(plain)
  nnx.replace_by_pure_dict(state, pure)
  return nnx.merge(graphdef, state)


def peft_tensors(model: model_lib.Decoder) -> dict[str, np.ndarray]:
  """The adapters as PEFT names them: ``base_model.model.model.layers.<i>.<module>.<weight>.lora_A.weight``
  [r, in_features] and ``lora_B.weight`` [out_features, r] (HF's feature order)."""
  pure = nnx.to_pure_dict(nnx.state(model, nnx.LoRAParam))
  out = {}
  for prefix, weight in _adapter_pairs(pure):
    node = pure
    for key in prefix:
      node = node[key]
    a = np.asarray(jax.device_get(node[weight + SUFFIX_A]))
    b = np.asarray(jax.device_get(node[weight + SUFFIX_B]))
    layers, rank = a.shape[0], a.shape[-1]
    module = prefix[-1]
    for i in range(layers):
      name = f"base_model.model.model.layers.{i}.{module}.{weight}"
      out[name + ".lora_A.weight"] = np.ascontiguousarray(a[i].reshape(-1, rank).T)
      out[name + ".lora_B.weight"] = np.ascontiguousarray(b[i].reshape(rank, -1).T)
  return out


def peft_config(model: model_lib.Decoder, lora, *, base_model: str = "") -> dict:
  """PEFT's ``adapter_config.json`` for ``peft_tensors(model)``."""
  targets = sorted(_names(model.layers))
  return {
      "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model or None,
      "r": int(lora.rank), "lora_alpha": float(lora.alpha), "lora_dropout": float(lora.dropout),
      "target_modules": targets, "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
      "use_dora": False, "init_lora_weights": True, "modules_to_save": None, "inference_mode": True,
  }


def save_peft(model: model_lib.Decoder, lora, path, *, base_model: str = "") -> None:
  """Writes ``adapter_config.json`` and ``adapter_model.safetensors`` to ``path``."""
  import json
  import os
  from safetensors.numpy import save as safetensors_bytes
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, "adapter_model.safetensors"), "wb") as f:
    f.write(safetensors_bytes(peft_tensors(model), metadata={"format": "pt"}))
  with open(os.path.join(path, "adapter_config.json"), "w") as f:
    json.dump(peft_config(model, lora, base_model=base_model), f, indent=2)
