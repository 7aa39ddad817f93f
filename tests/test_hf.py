"""Hugging Face import/export: transformers reads what we write; round trips are bit-exact."""
import json

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.numpy import save_file

from ba_jax.policy import hf
from model_utils import KINDS, left_padded_batch, make_tokenizer, save_tiny_model, torch_logits


def _tensors(path):
  """name -> numpy array of every tensor in a checkpoint directory (single file or index)."""
  out = {}
  for file in sorted(path.glob("*.safetensors")):
    with safe_open(file, framework="np") as f:
      out.update({k: f.get_tensor(k) for k in f.keys()})
  return out


def _assert_bit_exact(a, b):
  assert sorted(a) == sorted(b)
  for name in a:
    assert a[name].dtype == b[name].dtype, name
    assert a[name].shape == b[name].shape, name
    assert a[name].tobytes() == b[name].tobytes(), name


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  return {kind: save_tiny_model(kind, tmp_path_factory.mktemp(kind)) for kind in KINDS}


@pytest.mark.parametrize("kind", KINDS)
def test_export_loads_in_transformers_with_same_logits(checkpoints, kind, tmp_path):
  from transformers import AutoModelForCausalLM
  model, config = hf.load_pretrained(checkpoints[kind])
  hf.save_pretrained(model, config, tmp_path, tokenizer=make_tokenizer(),
                     base_config=hf.read_config(checkpoints[kind]))
  original = json.loads((checkpoints[kind] / "config.json").read_text())
  exported = json.loads((tmp_path / "config.json").read_text())
  assert exported["model_type"] == original["model_type"]
  assert exported["architectures"] == original["architectures"]
  assert exported["initializer_range"] == original["initializer_range"]  # kept from base_config
  assert json.loads((tmp_path / "generation_config.json").read_text())["eos_token_id"] == config.eos_token_id
  reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
  ids, mask = left_padded_batch(seed=11, batch=3, length=9)
  valid = mask.astype(bool)
  np.testing.assert_allclose(np.asarray(model(ids, mask))[valid], torch_logits(reloaded, ids, mask)[valid],
                             atol=1e-4, rtol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_import_export_import_is_bit_exact(checkpoints, kind, tmp_path):
  model, config = hf.load_pretrained(checkpoints[kind])
  hf.save_pretrained(model, config, tmp_path / "a")
  _assert_bit_exact(_tensors(checkpoints[kind]), _tensors(tmp_path / "a"))
  again, config_again = hf.load_pretrained(tmp_path / "a")
  assert config_again == config
  hf.save_pretrained(again, config_again, tmp_path / "b")
  _assert_bit_exact(_tensors(tmp_path / "a"), _tensors(tmp_path / "b"))


def test_bfloat16_checkpoint_round_trip_keeps_dtype_and_bits(tmp_path):
  src = save_tiny_model("qwen2", tmp_path / "src", dtype="bfloat16", with_tokenizer=False)
  original = _tensors(src)
  assert original["model.embed_tokens.weight"].dtype.name == "bfloat16"
  model, config = hf.load_pretrained(src)  # param dtype follows the checkpoint, compute stays float32
  assert config.param_dtype == "bfloat16" and config.dtype == "float32"
  hf.save_pretrained(model, config, tmp_path / "out")
  _assert_bit_exact(original, _tensors(tmp_path / "out"))
  assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"


def test_sharded_export_above_threshold_and_sharded_import(checkpoints, tmp_path):
  from transformers import AutoModelForCausalLM
  model, config = hf.load_pretrained(checkpoints["llama"])
  hf.save_pretrained(model, config, tmp_path, max_shard_size="40KB")
  index = json.loads((tmp_path / hf.SAFETENSORS_INDEX).read_text())
  files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
  assert len(files) > 2 and not (tmp_path / hf.SAFETENSORS).exists()
  assert sorted(set(index["weight_map"].values())) == files
  assert index["metadata"]["total_size"] == sum(t.nbytes for t in _tensors(tmp_path).values())
  _assert_bit_exact(_tensors(checkpoints["llama"]), _tensors(tmp_path))
  reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
  ids, mask = left_padded_batch(seed=12)
  valid = mask.astype(bool)
  np.testing.assert_allclose(np.asarray(model(ids, mask))[valid], torch_logits(reloaded, ids, mask)[valid],
                             atol=1e-4, rtol=0)
  again, _ = hf.load_pretrained(tmp_path)  # reads through the index
  hf.save_pretrained(again, config, tmp_path / "single")
  assert (tmp_path / "single" / hf.SAFETENSORS).exists()
  _assert_bit_exact(_tensors(tmp_path), _tensors(tmp_path / "single"))


def test_transformers_sharded_checkpoint_loads(tmp_path):
  src = save_tiny_model("qwen3", tmp_path, max_shard_size="50KB", with_tokenizer=False)
  assert (src / hf.SAFETENSORS_INDEX).exists()
  model, _ = hf.load_pretrained(src)
  ids, mask = left_padded_batch(seed=13)
  from model_utils import make_hf_model
  valid = mask.astype(bool)
  np.testing.assert_allclose(np.asarray(model(ids, mask))[valid],
                             torch_logits(make_hf_model("qwen3"), ids, mask)[valid], atol=1e-4, rtol=0)


def test_tokenizer_files_reload(checkpoints, tmp_path):
  from transformers import AutoTokenizer
  model, config = hf.load_pretrained(checkpoints["qwen2"])
  hf.save_pretrained(model, config, tmp_path, tokenizer=make_tokenizer())
  tok = AutoTokenizer.from_pretrained(tmp_path)
  ids = tok("1+1=2")["input_ids"]
  assert tok.decode(ids) == "1+1=2" and tok.eos_token_id == config.eos_token_id


def _copy(src, dst):
  dst.mkdir()
  for f in src.iterdir():
    (dst / f.name).write_bytes(f.read_bytes())
  return dst


def test_unsupported_architecture_names_the_supported_ones(checkpoints, tmp_path):
  path = _copy(checkpoints["qwen2"], tmp_path / "m")
  cfg = json.loads((path / "config.json").read_text())
  cfg.update(model_type="gemma", architectures=["GemmaForCausalLM"])
  (path / "config.json").write_text(json.dumps(cfg))
  with pytest.raises(ValueError, match=r"'gemma'.*qwen2.*qwen3.*llama"):
    hf.load_pretrained(path)


def test_missing_tensor_is_named(checkpoints, tmp_path):
  path = _copy(checkpoints["qwen2"], tmp_path / "m")
  tensors = _tensors(path)
  del tensors["model.layers.1.self_attn.k_proj.bias"]
  save_file(tensors, path / hf.SAFETENSORS, metadata={"format": "pt"})
  with pytest.raises(KeyError, match=r"model\.layers\.1\.self_attn\.k_proj\.bias"):
    hf.load_pretrained(path)


def test_shape_mismatch_names_tensor_and_shapes(checkpoints, tmp_path):
  path = _copy(checkpoints["llama"], tmp_path / "m")
  cfg = json.loads((path / "config.json").read_text())
  cfg["intermediate_size"] = 96
  (path / "config.json").write_text(json.dumps(cfg))
  with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.gate_proj\.weight.*\(128, 64\).*\(96, 64\)"):
    hf.load_pretrained(path)


def test_unreadable_files_are_named_with_the_reason(checkpoints, tmp_path):
  path = _copy(checkpoints["qwen3"], tmp_path / "m")
  (path / hf.SAFETENSORS).write_bytes(b"not a safetensors file")
  with pytest.raises(OSError, match=r"model\.safetensors"):
    hf.load_pretrained(path)
  (path / "config.json").write_text("{ not json")
  with pytest.raises(OSError, match=r"config\.json.*Expecting"):
    hf.load_pretrained(path)
  (path / "config.json").unlink()
  with pytest.raises(OSError, match=r"config\.json"):
    hf.load_pretrained(path)
  empty = tmp_path / "empty"
  empty.mkdir()
  (empty / "config.json").write_text((checkpoints["qwen3"] / "config.json").read_text())
  with pytest.raises(FileNotFoundError, match="model.safetensors"):
    hf.load_pretrained(empty)


def test_bad_max_shard_size_is_an_error(checkpoints, tmp_path):
  model, config = hf.load_pretrained(checkpoints["qwen2"])
  with pytest.raises(ValueError, match="max_shard_size='lots'"):
    hf.save_pretrained(model, config, tmp_path, max_shard_size="lots")
