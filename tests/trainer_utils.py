"""Shared helpers for the trainer tests: tiny configs, batches, comparisons."""
import os
import subprocess
import sys

import jax
import numpy as np

from ba_jax.policy import model as model_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_config(arg=None, path="configs/tiny.py"):
  import importlib.util
  spec = importlib.util.spec_from_file_location("_cfg", os.path.join(REPO, path))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg)


def tiny_model_config(**overrides) -> model_lib.ModelConfig:
  """Dims divisible by 2 on every sharded axis (for a 2x2x2 mesh)."""
  fields = dict(model_type="qwen3", vocab_size=32, hidden_size=32,
                intermediate_size=64, num_layers=2, num_heads=2,
                num_kv_heads=2, head_dim=16, qk_norm=True,
                tie_word_embeddings=False)
  fields.update(overrides)
  return model_lib.ModelConfig(**fields)


def rollout_batch(seed: int, *, n: int = 16, prompt_len: int = 8,
                  response_len: int = 12, vocab: int = 32) -> dict:
  """A batch of made-up rollouts: left-padded prompts, ragged responses,
  mixed-sign advantages and behaviour log-probs near the model's."""
  rng = np.random.default_rng(seed)
  lengths = rng.integers(2, response_len + 1, n)
  mask = (np.arange(response_len)[None] < lengths[:, None]).astype(np.int32)
  prompt_lengths = rng.integers(2, prompt_len + 1, n)
  prompt_mask = (np.arange(prompt_len)[None] >=
                 (prompt_len - prompt_lengths)[:, None]).astype(np.int32)
  return dict(
      prompt_ids=(rng.integers(3, vocab, (n, prompt_len)) * prompt_mask
                  ).astype(np.int32),
      prompt_mask=prompt_mask,
      response_ids=(rng.integers(3, vocab, (n, response_len)) * mask
                    ).astype(np.int32),
      response_mask=mask,
      advantages=rng.normal(size=n).astype(np.float32),
      old_logp=(np.log(1.0 / vocab) + 0.1 * rng.normal(
          size=(n, response_len))).astype(np.float32) * mask)


def smoke_config(**overrides):
  """configs/tiny.py:smoke with overrides given as dotted keys."""
  c = load_config("smoke")
  for key, value in overrides.items():
    node = c
    *parents, leaf = key.split(".")
    for p in parents:
      node = node[p]
    node[leaf] = value
  return c


def host_params(state_or_params) -> list[np.ndarray]:
  params = getattr(state_or_params, "params", state_or_params)
  return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(params))]


def max_abs_diff(a, b) -> float:
  return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b))


def run_module(args, *, env=None, timeout=600, **kwargs):
  """Runs ``python -m ...`` in the repo with the test environment."""
  full_env = dict(os.environ, **(env or {}))
  return subprocess.run([sys.executable, "-m", *args], cwd=REPO, env=full_env,
                        capture_output=True, text=True, timeout=timeout,
                        **kwargs)


def train_cli(args, capsys, monkeypatch) -> tuple[int, str]:
  """``python -m ba_jax.train ARGS`` in this process, from the repo root:
  (exit status, stderr). A ``SystemExit`` with a message counts as Python
  reports it: status 1, the message on stderr."""
  from ba_jax import train
  monkeypatch.chdir(REPO)
  capsys.readouterr()
  message = ""
  try:
    code = train.main(["train", *args])
  except SystemExit as e:
    code, message = (e.code, "") if isinstance(e.code, int) else (1, f"{e.code}\n")
  return code, capsys.readouterr().err + message


def char_tokenizer():
  """A character-level tokenizer over printable ASCII (pad 0, eos 1)."""
  import string

  import tokenizers
  from tokenizers import decoders, models, pre_tokenizers
  from transformers import PreTrainedTokenizerFast
  vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<unk>"])}
  for ch in string.printable:
    vocab.setdefault(ch, len(vocab))
  tok = tokenizers.Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.Split(tokenizers.Regex(r"[\s\S]"),
                                           behavior="isolated")
  tok.decoder = decoders.Fuse()
  return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>",
                                 eos_token="<eos>", unk_token="<unk>")
