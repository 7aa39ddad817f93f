"""Analytic parameter and FLOP counts of a policy, to set beside XLA's."""
from __future__ import annotations

import jax
import numpy as np

from ba_jax.policy import model as model_lib


def param_counts(abstract_params, c: model_lib.ModelConfig) -> dict:
  """All parameters, and those in matmuls (the LM head counted, the
  embedding lookup not; with tied embeddings the table is the head)."""
  total = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(abstract_params))
  E, H, K, D = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
  per_layer = 2 * E * H * D + 2 * E * K * D + 3 * E * c.intermediate_size
  return {"total": total,
          "matmul": c.num_layers * per_layer + E * c.vocab_size}


def analytic_flops(c: model_lib.ModelConfig, matmul_params: int, *,
                   rows: int, prompts: int, prompt_len: int,
                   response_len: int, ppo_epochs: int,
                   micro_batches: int, prompt_bucket: int | None = None,
                   minibatches: int = 1, logprob_chunk: int | None = None,
                   attention_tile: int | None = None) -> dict:
  """FLOPs of one train step and one sampling call, whole mesh.

  Train: every row goes ``ppo_epochs`` times forward and backward over
  L = P + T tokens. Sampling: a prefill of the B prompts (padded to
  ``prompt_bucket`` tokens, default P, into a cache of S = bucket + T - 1
  slots), then T - 1 decode steps of all N = B * G rows, each attending
  over the whole cache.

  "As XLA counts": XLA's cost analysis counts a loop body once, and the
  train step is loops all the way down (PPO updates, micro-batches, the
  scanned layers), so its figure is one micro-batch of one update through
  one layer plus the LM head. The LM head runs over the response tokens
  only, ``logprob_chunk`` of them per iteration of the scorer's chunk scan
  (so XLA counts one chunk), and blockwise attention (``attention_tile``;
  None: the full [L, L] product) is a scan over tiles (XLA counts one
  query tile against one key tile).
  """
  attn = 4 * c.num_layers * c.num_heads * c.head_dim  # x queries x keys
  L = prompt_len + response_len
  passes = 4 if c.remat != "none" else 3
  head = c.hidden_size * c.vocab_size
  body = matmul_params - head  # the layers' matmuls
  train = passes * rows * ppo_epochs * (
      2 * body * L + 2 * head * response_len + attn * L * L)
  chunk = min(logprob_chunk or response_len, response_len)
  tile = min(attention_tile, L) if attention_tile else L
  one_layer_and_head = passes * rows * ppo_epochs * (
      2 * body / c.num_layers * L + 2 * head * chunk
      + attn / c.num_layers * tile * tile)
  bucket = prompt_bucket or prompt_len
  S = bucket + response_len - 1
  prefill = prompts * bucket * (2 * matmul_params + attn * S)
  decode_step = rows * (2 * matmul_params + attn * S)
  return {
      "train_step": float(train),
      "train_step_xla_counts": float(
          one_layer_and_head / (micro_batches * ppo_epochs * minibatches)),
      "train_6ND": float(6 * matmul_params * rows * L * ppo_epochs),
      "sample": float(prefill + (response_len - 1) * decode_step),
      "sample_xla_counts": float(prefill + decode_step),
      "sample_2ND": float(2 * matmul_params
                          * (prompts * bucket + rows * response_len)),
      "prefill": float(prefill),
      "decode_step": float(decode_step),
  }
