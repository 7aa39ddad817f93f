"""Hugging Face checkpoints <-> `ba_jax.policy.model.Decoder`.

`load_pretrained` reads config.json and model.safetensors (or a sharded index)
one tensor at a time on the host; given a mesh, each tensor goes straight into
its NamedSharding, so no device ever holds the whole model. `save_pretrained`
writes the same tensor names, layouts and dtypes `transformers` writes, so
import then export is bit-exact.
"""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save as safetensors_bytes

from ba_jax.policy import sharding as sharding_lib
from ba_jax.policy.model import Decoder, ModelConfig

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_SIZE = 5 * 1000**3  # bytes, as transformers' "5GB"


@dataclasses.dataclass(frozen=True)
class WeightSpec:
  hf_name: str
  path: tuple  # into nnx.to_pure_dict(nnx.state(model, nnx.Param))
  hf_shape: tuple
  to_ours: Callable[[np.ndarray], np.ndarray]
  to_hf: Callable[[np.ndarray], np.ndarray]
  layer: int | None = None  # index into the stacked layers' leading axis of `path`

  def lookup(self, tree: dict):
    """This tensor (our layout) in a pure dict shaped like `nnx.to_pure_dict(nnx.state(model))`."""
    for key in self.path:
      tree = tree[key]
    return tree if self.layer is None else tree[self.layer]


def _same(x):
  return x


def weight_specs(c: ModelConfig) -> list[WeightSpec]:
  """Every HF tensor: name and shape, our path (and layer, for the stacked layers), exact layout maps."""
  E, H, K, D, M, V = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size, c.vocab_size

  def dense_in(heads):  # HF [heads*D, E] <-> ours [E, heads, D]
    return (lambda w: w.T.reshape(E, heads, D), lambda w: w.reshape(E, heads * D).T)

  def bias(heads):
    return (lambda b: b.reshape(heads, D), lambda b: b.reshape(heads * D))

  transpose = (lambda w: w.T, lambda w: w.T)
  specs = [WeightSpec("model.embed_tokens.weight", ("embed_tokens",), (V, E), _same, _same)]
  for i in range(c.num_layers):
    hf, us = f"model.layers.{i}.", ("layers",)
    a = us + ("self_attn",)
    layer_specs = [
        WeightSpec(hf + "input_layernorm.weight", us + ("input_layernorm", "scale"), (E,), _same, _same),
        WeightSpec(hf + "self_attn.q_proj.weight", a + ("q_proj",), (H * D, E), *dense_in(H)),
        WeightSpec(hf + "self_attn.k_proj.weight", a + ("k_proj",), (K * D, E), *dense_in(K)),
        WeightSpec(hf + "self_attn.v_proj.weight", a + ("v_proj",), (K * D, E), *dense_in(K)),
        WeightSpec(hf + "self_attn.o_proj.weight", a + ("o_proj",), (E, H * D),
                   lambda w: w.T.reshape(H, D, E), lambda w: w.reshape(H * D, E).T),
    ]
    if c.attention_bias:
      layer_specs += [WeightSpec(hf + "self_attn.q_proj.bias", a + ("q_bias",), (H * D,), *bias(H)),
                WeightSpec(hf + "self_attn.k_proj.bias", a + ("k_bias",), (K * D,), *bias(K)),
                WeightSpec(hf + "self_attn.v_proj.bias", a + ("v_bias",), (K * D,), *bias(K))]
    if c.out_bias:
      layer_specs.append(WeightSpec(hf + "self_attn.o_proj.bias", a + ("o_bias",), (E,), _same, _same))
    if c.qk_norm:
      layer_specs += [WeightSpec(hf + "self_attn.q_norm.weight", a + ("q_norm", "scale"), (D,), _same, _same),
                WeightSpec(hf + "self_attn.k_norm.weight", a + ("k_norm", "scale"), (D,), _same, _same)]
    layer_specs += [
        WeightSpec(hf + "post_attention_layernorm.weight", us + ("post_attention_layernorm", "scale"), (E,),
                   _same, _same),
        WeightSpec(hf + "mlp.gate_proj.weight", us + ("mlp", "gate_proj"), (M, E), *transpose),
        WeightSpec(hf + "mlp.up_proj.weight", us + ("mlp", "up_proj"), (M, E), *transpose),
        WeightSpec(hf + "mlp.down_proj.weight", us + ("mlp", "down_proj"), (E, M), *transpose),
    ]
    specs += [dataclasses.replace(spec, layer=i) for spec in layer_specs]
  specs.append(WeightSpec("model.norm.weight", ("norm", "scale"), (E,), _same, _same))
  if not c.tie_word_embeddings:
    specs.append(WeightSpec("lm_head.weight", ("lm_head",), (V, E), *transpose))
  return specs


def _read_json(file: pathlib.Path) -> dict:
  try:
    with open(file) as f:
      return json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise OSError(f"cannot read {file}: {e}") from e


def read_config(path) -> dict:
  """The config.json dict of a checkpoint directory."""
  return _read_json(pathlib.Path(path) / "config.json")


def _weight_files(path: pathlib.Path) -> dict[str, pathlib.Path]:
  """Tensor name -> safetensors file holding it."""
  index = path / SAFETENSORS_INDEX
  if index.exists():
    weight_map = _read_json(index).get("weight_map")
    if not isinstance(weight_map, dict):
      raise OSError(f"cannot read {index}: no 'weight_map' dict")
    return {name: path / file for name, file in weight_map.items()}
  single = path / SAFETENSORS
  if not single.exists():
    raise FileNotFoundError(f"no {SAFETENSORS} or {SAFETENSORS_INDEX} in {path}")
  try:
    with safe_open(single, framework="np") as f:
      return {name: single for name in f.keys()}
  except Exception as e:  # safetensors raises its own error types
    raise OSError(f"cannot read {single}: {e}") from e


class _TensorReader:
  """Reads one tensor at a time, keeping each safetensors file open once."""

  def __init__(self, files: dict[str, pathlib.Path]):
    self.files, self.handles = files, {}

  def get(self, name: str) -> np.ndarray:
    if name not in self.files:
      raise KeyError(f"tensor {name!r} is missing from the checkpoint")
    file = self.files[name]
    try:
      if file not in self.handles:
        self.handles[file] = safe_open(file, framework="np")
      return self.handles[file].get_tensor(name)
    except Exception as e:
      raise OSError(f"cannot read tensor {name!r} from {file}: {e}") from e


def _set_path(tree: dict, path: tuple, value):
  for key in path[:-1]:
    tree = tree[key]
  tree[path[-1]] = value


def load_pretrained(path, *, dtype: str = "float32", param_dtype: str | None = None, mesh=None, rules=None,
                    remat: str | bool = "none", attention_impl: str = "full",
                    attention_block: int = 512, **runtime) -> tuple[Decoder, ModelConfig]:
  """Loads a HF checkpoint directory. `param_dtype` defaults to the checkpoint's own dtype;
  `runtime`: further ModelConfig fields a checkpoint does not decide (e.g. logprob_chunk)."""
  path = pathlib.Path(path)
  hf_config = read_config(path)
  files = _weight_files(path)
  reader = _TensorReader(files)
  if param_dtype is None:
    param_dtype = str(reader.get("model.embed_tokens.weight").dtype)
  config = ModelConfig.from_hf_dict(hf_config, dtype=dtype, param_dtype=param_dtype, remat=remat,
                                    attention_impl=attention_impl, attention_block=attention_block,
                                    **runtime)
  abstract = nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0)))
  graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
  shardings = None
  if mesh is not None:
    shardings = nnx.to_pure_dict(sharding_lib.state_shardings(params, mesh, rules or sharding_lib.DEFAULT_RULES))
  values = nnx.to_pure_dict(params)
  by_path: dict[tuple, list[WeightSpec]] = {}
  for spec in weight_specs(config):
    by_path.setdefault(spec.path, []).append(spec)
  for path_key, specs in by_path.items():
    # One host buffer per parameter: the stacked layers' tensors are read one by one into it.
    target = values
    for key in path_key:
      target = target[key]
    ours = np.empty(target.shape, jnp.dtype(param_dtype))
    for spec in specs:
      hf_tensor = reader.get(spec.hf_name)
      if tuple(hf_tensor.shape) != spec.hf_shape:
        raise ValueError(f"tensor {spec.hf_name!r} has shape {tuple(hf_tensor.shape)}; "
                         f"expected {spec.hf_shape} from config.json")
      ours[() if spec.layer is None else spec.layer] = spec.to_ours(hf_tensor).astype(ours.dtype)
    if shardings is None:
      array = jnp.asarray(ours)
    else:
      sharding = shardings
      for key in path_key:
        sharding = sharding[key]
      array = jax.make_array_from_callback(ours.shape, sharding, lambda index, ours=ours: ours[index])
    _set_path(values, path_key, array)
    del ours
  nnx.replace_by_pure_dict(params, values)
  return nnx.merge(graphdef, params, rest), config


def _parse_size(size) -> int:
  if isinstance(size, int):
    return size
  match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B)?\s*", str(size), flags=re.IGNORECASE)
  if not match:
    raise ValueError(f"max_shard_size={size!r}; expected bytes as an int or a string like '5GB' or '500MB'")
  unit = (match.group(2) or "B").upper()
  scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}[unit]
  return int(float(match.group(1)) * scale)


def _to_host(x) -> np.ndarray:
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    from jax.experimental import multihost_utils
    x = multihost_utils.process_allgather(x, tiled=True)
  return np.asarray(jax.device_get(x))


def _write_safetensors(tensors: dict, file):
  # safetensors' save_file creates the file 0600; a plain open() gives 0644 under the usual
  # umask, like config.json and the tokenizer next to it.
  with open(file, "wb") as f:
    f.write(safetensors_bytes(tensors, metadata={"format": "pt"}))


def save_pretrained(model: Decoder, config: ModelConfig, path, tokenizer=None, *,
                    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE, generation_config: dict | None = None,
                    base_config: dict | None = None) -> None:
  """Writes config.json, generation_config.json, safetensors (sharded above `max_shard_size`), tokenizer.

  `base_config` (e.g. `read_config(source_dir)`) keeps fields we do not model (initializer_range, ...);
  every field `config` knows overrides it. `generation_config` defaults to bos/eos from `config`.
  """
  path = pathlib.Path(path)
  path.mkdir(parents=True, exist_ok=True)
  limit = _parse_size(max_shard_size)
  values = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  shards, current, current_size, total = [], {}, 0, 0
  for spec in weight_specs(config):
    tensor = spec.lookup(values)
    hf_tensor = np.ascontiguousarray(spec.to_hf(_to_host(tensor)))
    if current and current_size + hf_tensor.nbytes > limit:
      shards.append(current)
      current, current_size = {}, 0
    current[spec.hf_name] = hf_tensor
    current_size += hf_tensor.nbytes
    total += hf_tensor.nbytes
  shards.append(current)
  if jax.process_index() != 0:
    return
  for stale in list(path.glob("model*.safetensors")) + [path / SAFETENSORS_INDEX]:
    if stale.exists():
      stale.unlink()
  if len(shards) == 1:
    _write_safetensors(shards[0], path / SAFETENSORS)
  else:
    weight_map = {}
    for i, shard in enumerate(shards):
      name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
      _write_safetensors(shard, path / name)
      weight_map.update({k: name for k in shard})
    with open(path / SAFETENSORS_INDEX, "w") as f:
      json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
  with open(path / "config.json", "w") as f:
    json.dump({**(base_config or {}), **config.to_hf_dict()}, f, indent=2)
  if generation_config is None and (config.bos_token_id is not None or config.eos_token_id is not None):
    eos = config.eos_token_id
    generation_config = {"bos_token_id": config.bos_token_id,
                         "eos_token_id": list(eos) if isinstance(eos, tuple) else eos}
  if generation_config is not None:
    with open(path / "generation_config.json", "w") as f:
      json.dump(generation_config, f, indent=2)
  if tokenizer is not None:
    tokenizer.save_pretrained(os.fspath(path))
