"""Tiny random `transformers` checkpoints and an offline tokenizer, for tests.

    from model_utils import save_tiny_model, make_tokenizer
    path = save_tiny_model("qwen3", tmp_path / "qwen3")   # config.json, safetensors, tokenizer
    model, config = ba_jax.policy.hf.load_pretrained(path)

Kinds: "qwen2" (untied, q/k/v bias), "qwen2_tied", "qwen3" (q/k norm, head_dim
independent of hidden/heads, tied like Qwen3-1.7B), "llama" (llama3 RoPE
scaling with all three frequency bands exercised, untied). Every weight,
biases and norm scales included, is random so that no mapping error hides
behind a zero or a one.
"""
from __future__ import annotations

import contextlib
import pathlib
import random

import numpy as np

KINDS = ("qwen2", "qwen2_tied", "qwen3", "llama")

PAD_TOKEN, EOS_TOKEN, BOS_TOKEN, UNK_TOKEN = "<|pad|>", "<|im_end|>", "<|im_start|>", "<unk>"
PAD_ID, EOS_ID, BOS_ID, UNK_ID = 0, 1, 2, 3
TOKENIZER_VOCAB = [PAD_TOKEN, EOS_TOKEN, BOS_TOKEN, UNK_TOKEN, "\n"] + [chr(i) for i in range(32, 127)]
MODEL_VOCAB_SIZE = 128  # > len(TOKENIZER_VOCAB) == 100, like real checkpoints' padded embeddings

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tiny_hf_config(kind: str, **overrides):
  """A `transformers` config for a ~100k-parameter model of the given kind."""
  from transformers import LlamaConfig, Qwen2Config, Qwen3Config
  common = dict(vocab_size=MODEL_VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=256, rms_norm_eps=1e-6,
                bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
  if kind in ("qwen2", "qwen2_tied"):
    cfg = dict(common, num_key_value_heads=2, tie_word_embeddings=kind == "qwen2_tied",
               rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    cfg.update(overrides)
    return Qwen2Config(**cfg)
  if kind == "qwen3":
    cfg = dict(common, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
               rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    cfg.update(overrides)
    return Qwen3Config(**cfg)
  if kind == "llama":
    # head_dim 16, theta 5e5: wavelengths 6, 33, 170, ... straddle [16, 64], so the llama3 rule's
    # unscaled, smoothed and scaled bands are all used.
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    cfg = dict(common, num_key_value_heads=1, head_dim=16, tie_word_embeddings=False, rope_parameters=rope)
    cfg.update(overrides)
    return LlamaConfig(**cfg)
  raise ValueError(f"kind={kind!r}; expected one of {KINDS}")


def make_hf_model(kind: str, *, seed: int = 0, dtype: str = "float32", **overrides):
  """A random `transformers` causal LM (eval mode) of the given kind."""
  import torch
  from transformers import AutoModelForCausalLM
  config = tiny_hf_config(kind, **overrides)
  torch.manual_seed(seed)
  model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      noise = torch.randn(p.shape, generator=gen)
      if "norm" in name:
        p.copy_(1.0 + 0.2 * noise)
      elif name.endswith("bias"):
        p.copy_(0.1 * noise)
      else:
        p.copy_(0.15 * noise)
  model = model.to(getattr(torch, dtype))
  model.eval()
  return model


def make_tokenizer():
  """An offline character-level `PreTrainedTokenizerFast` with pad/eos/bos and a chat template."""
  from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
  from transformers import PreTrainedTokenizerFast
  vocab = {tok: i for i, tok in enumerate(TOKENIZER_VOCAB)}
  tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
  tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
  tok.decoder = decoders.Fuse()
  fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD_TOKEN, eos_token=EOS_TOKEN,
                                 bos_token=BOS_TOKEN, unk_token=UNK_TOKEN)
  fast.chat_template = CHAT_TEMPLATE
  fast.padding_side = "left"
  return fast


def save_tiny_model(kind: str, path, *, seed: int = 0, dtype: str = "float32", with_tokenizer: bool = True,
                    max_shard_size=None, **overrides) -> pathlib.Path:
  """Writes a random checkpoint (config.json, safetensors, generation config, tokenizer) to `path`."""
  path = pathlib.Path(path)
  model = make_hf_model(kind, seed=seed, dtype=dtype, **overrides)
  kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
  model.save_pretrained(path, **kwargs)
  if with_tokenizer:
    make_tokenizer().save_pretrained(path)
  return path


def left_padded_batch(seed: int = 0, batch: int = 3, length: int = 9, vocab: int = MODEL_VOCAB_SIZE):
  """(ids, mask) int32 numpy arrays: row i has i*2 pad tokens on the left (row 0 none)."""
  rng = np.random.default_rng(seed)
  ids = rng.integers(4, vocab, size=(batch, length)).astype(np.int32)
  mask = np.ones((batch, length), np.int32)
  for i in range(batch):
    pad = min(2 * i, length - 1)
    mask[i, :pad] = 0
    ids[i, :pad] = PAD_ID
  return ids, mask


def torch_logits(hf_model, ids, mask):
  """float32 numpy logits of a `transformers` model on a (left-padded) batch."""
  import torch
  ids_t = torch.as_tensor(np.asarray(ids), dtype=torch.long)
  mask_t = torch.as_tensor(np.asarray(mask), dtype=torch.long)
  positions = torch.clamp(mask_t.cumsum(-1) - 1, min=0)
  with torch.no_grad():
    out = hf_model(input_ids=ids_t, attention_mask=mask_t, position_ids=positions)
  return out.logits.float().numpy()


@contextlib.contextmanager
def global_rng_kept():
  """Restores Python's, numpy's and torch's global RNGs on exit (TRL's GRPOTrainer seeds them;
  other tests keep theirs)."""
  import torch
  states = random.getstate(), np.random.get_state(), torch.get_rng_state()
  try:
    yield
  finally:
    random.setstate(states[0]), np.random.set_state(states[1]), torch.set_rng_state(states[2])
