"""Sampler throughput: ba_jax.generation.sampler vs transformers generate, same weights, one process.

    python -m experiments.benchmarks.bench_sampler            # the full setting, ~10 min on 2 cores
    python -m experiments.benchmarks.bench_sampler --quick    # a smoke run, tiny model

Writes experiments/benchmarks/results/sampler_bench.md (or --output). Setting: 16
prompts of 32 tokens, G=8 (128 rows), 256 new tokens, temperature 1.0 (no
top-k / top-p), a ~50M-parameter Qwen2-style model in float32. Also: greedy
for both, the per-step cost of three ways to draw a token, and model-FLOPs
utilisation against a measured float32 matmul peak.
"""
import argparse
import os
import pathlib
import platform
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from ba_jax.policy import hf
from ba_jax.generation import sampler

EOS_ID, PAD_ID = 1, 0
FULL = dict(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=6,
            num_attention_heads=8, num_key_value_heads=4, prompts=16, group_size=8,
            prompt_len=32, new_tokens=256)
QUICK = dict(vocab_size=2048, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, prompts=4, group_size=4,
             prompt_len=16, new_tokens=32)


def _timed(fn, repeats=1):
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    out = fn()
    best = min(best, time.perf_counter() - start)
  return best, out


def matmul_peak_gflops(n=2048, repeats=5):
  """Best float32 matmul rate JAX reaches on this machine (GFLOP/s)."""
  a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
  b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
  f = jax.jit(lambda a, b: a @ b)
  f(a, b).block_until_ready()
  seconds, _ = _timed(lambda: f(a, b).block_until_ready(), repeats)
  return 2 * n**3 / seconds / 1e9


def draw_step_ms(rows, vocab, repeats=20):
  """Per-step cost of drawing one token per row from [rows, vocab] logits."""
  logits = jax.random.normal(jax.random.key(0), (rows, vocab), jnp.float32)
  key = jax.random.key(1)
  fns = {
      "jax.random.categorical": jax.jit(lambda l, k: jax.random.categorical(k, l, axis=-1)),
      "inverse CDF (ours)": jax.jit(lambda l, k: sampler.draw_tokens(l, k, 1.0)[0]),
      "argmax (greedy)": jax.jit(lambda l, k: jnp.argmax(l, axis=-1)),
  }
  out = {}
  for name, f in fns.items():
    f(logits, key).block_until_ready()
    seconds, _ = _timed(lambda: f(logits, key).block_until_ready(), repeats)
    out[name] = 1e3 * seconds
  return out


def decode_attention_ms(rows, slots, kv_heads, q_per_kv, head_dim, steps=20):
  """One layer's decode-step attention (write the new k/v, attend over all
  slots), per step, for the cache layout the model uses ([B,S,K,D]) and for
  [B,K,S,D]: XLA:CPU transposes a [B,S,K,D] cache before the batched matmul."""
  keys = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(keys[0], (rows, kv_heads, q_per_kv, head_dim))
  cache = jax.random.normal(keys[1], (rows, slots, kv_heads, head_dim))
  new = jax.random.normal(keys[2], (rows, 1, kv_heads, head_dim))

  def bskd(q, k, v, i):
    k = jax.lax.dynamic_update_slice(k, new, (0, i, 0, 0))
    v = jax.lax.dynamic_update_slice(v, new, (0, i, 0, 0))
    p = jax.nn.softmax(jnp.einsum("bkgd,bskd->bkgs", q, k), axis=-1)
    return jnp.einsum("bkgs,bskd->bkgd", p, v), k, v

  def bksd(q, k, v, i):
    k = jax.lax.dynamic_update_slice(k, new.transpose(0, 2, 1, 3), (0, 0, i, 0))
    v = jax.lax.dynamic_update_slice(v, new.transpose(0, 2, 1, 3), (0, 0, i, 0))
    p = jax.nn.softmax(jnp.einsum("bkgd,bksd->bkgs", q, k), axis=-1)
    return jnp.einsum("bkgs,bksd->bkgd", p, v), k, v

  out = {}
  for name, fn, kv in (("[B,S,K,D] (model.py now)", bskd, cache),
                       ("[B,K,S,D]", bksd, cache.transpose(0, 2, 1, 3))):
    def run(q, k, v, fn=fn):
      return jax.lax.fori_loop(0, steps, lambda i, c: fn(q + c[0], c[1], c[2], i), (q, k, v))
    f = jax.jit(run)
    jax.block_until_ready(f(q, kv, kv))
    seconds, _ = _timed(lambda: jax.block_until_ready(f(q, kv, kv)), 3)
    out[name] = 1e3 * seconds / steps
  return out


def flops_per_token(c, context):
  """Model FLOPs for one generated token: 2 x matmul params + attention over `context`."""
  E, M, L = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
  H, K = c["num_attention_heads"], c["num_key_value_heads"]
  D = E // H
  per_layer = E * H * D + 2 * E * K * D + H * D * E + 3 * E * M
  matmul_params = L * per_layer + E * c["vocab_size"]
  return 2 * matmul_params + 4 * L * H * D * context


def response_lengths(tokens, eos_id, max_new):
  stops = tokens == eos_id
  first = np.where(stops.any(1), stops.argmax(1) + 1, max_new)
  return first


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--output", default=str(pathlib.Path(__file__).parent / "results" / "sampler_bench.md"))
  args = parser.parse_args()
  s = QUICK if args.quick else FULL
  torch.manual_seed(0)
  hf_config = Qwen2Config(vocab_size=s["vocab_size"], hidden_size=s["hidden_size"],
                          intermediate_size=s["intermediate_size"],
                          num_hidden_layers=s["num_hidden_layers"],
                          num_attention_heads=s["num_attention_heads"],
                          num_key_value_heads=s["num_key_value_heads"], max_position_embeddings=4096,
                          tie_word_embeddings=False, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
                          bos_token_id=2)
  theirs = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
  n_params = sum(p.numel() for p in theirs.parameters())
  with tempfile.TemporaryDirectory() as tmp:
    theirs.save_pretrained(tmp)
    ours, config = hf.load_pretrained(tmp)

  B, G, P, T = s["prompts"], s["group_size"], s["prompt_len"], s["new_tokens"]
  rng = np.random.default_rng(0)
  prompt_ids = rng.integers(3, s["vocab_size"], size=(B, P)).astype(np.int32)
  prompt_mask = np.ones_like(prompt_ids)
  rows = []

  def ours_run(temperature, key):
    res = sampler.sample_groups(ours, prompt_ids, prompt_mask, group_size=G, max_new_tokens=T,
                                temperature=temperature, eos_id=EOS_ID, pad_id=PAD_ID,
                                rng=jax.random.key(key))
    return jax.block_until_ready(res)

  def theirs_run(do_sample, max_new=T):
    kwargs = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0) if do_sample else {}
    with torch.no_grad():
      # Rows repeated group-major, as ours (num_return_sequences is sampling-only).
      out = theirs.generate(input_ids=torch.as_tensor(np.repeat(prompt_ids, G, 0), dtype=torch.long),
                            attention_mask=torch.as_tensor(np.repeat(prompt_mask, G, 0), dtype=torch.long),
                            max_new_tokens=max_new, eos_token_id=EOS_ID,
                            pad_token_id=PAD_ID, **({"do_sample": False} | kwargs))
    return out[:, P:].numpy()

  for mode, temperature in (("sample, T=1.0", 1.0), ("greedy", 0.0)):
    start = time.perf_counter()
    ours_run(temperature, 0)
    compile_s = time.perf_counter() - start
    seconds, res = _timed(lambda: ours_run(temperature, 1))
    ours_tokens = int(np.asarray(res.lengths).sum())
    print(f"ours {mode}: {seconds:.1f}s, {ours_tokens} tokens, first call {compile_s:.1f}s", flush=True)
    theirs_run(temperature > 0, max_new=2)  # warm-up
    t_seconds, out = _timed(lambda: theirs_run(temperature > 0))
    theirs_tokens = int(response_lengths(out, EOS_ID, T).sum())
    print(f"transformers {mode}: {t_seconds:.1f}s, {theirs_tokens} tokens", flush=True)
    rows.append((mode, ours_tokens / seconds, theirs_tokens / t_seconds, seconds, t_seconds,
                 compile_s))

  peak = matmul_peak_gflops()
  flops = flops_per_token(s, P + T / 2)
  draws = draw_step_ms(B * G, s["vocab_size"])
  heads, kv_heads = s["num_attention_heads"], s["num_key_value_heads"]
  attention = decode_attention_ms(B * G, P + T - 1, kv_heads, heads // kv_heads,
                                  s["hidden_size"] // heads)
  lines = [
      "# Sampler throughput: ba_jax vs transformers",
      "",
      f"Produced by `python -m experiments.benchmarks.bench_sampler{' --quick' if args.quick else ''}`"
      f" on {time.strftime('%Y-%m-%d')}.",
      f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores,"
      f" jax {jax.__version__} ({jax.default_backend()}), torch {torch.__version__}"
      f" ({torch.get_num_threads()} threads). The cores were shared with other work"
      " running at the same time, so treat the figures as rough.",
      "",
      f"Setting: {B} prompts x {P} tokens, G={G} ({B * G} rows), {T} new tokens, float32,"
      f" Qwen2-style model with {n_params / 1e6:.1f}M parameters (vocab {s['vocab_size']},"
      f" hidden {s['hidden_size']}, {s['num_hidden_layers']} layers), random weights, same"
      " weights in both. Tokens counted up to and including EOS (rows rarely stop).",
      " transformers: `generate(do_sample=True, temperature=1.0, top_k=0, top_p=1.0)` and"
      " `generate(do_sample=False)`, on the prompts repeated G times.",
      "",
      "| mode | ours tok/s | transformers tok/s | speed-up | ours s | transformers s |"
      " ours first call s (compile + one run) | ours MFU |",
      "|---|---|---|---|---|---|---|---|",
  ]
  for mode, ours_tps, theirs_tps, seconds, t_seconds, compile_s in rows:
    mfu = ours_tps * flops / (peak * 1e9)
    lines.append(f"| {mode} | {ours_tps:.0f} | {theirs_tps:.0f} | {ours_tps / theirs_tps:.2f}x |"
                 f" {seconds:.2f} | {t_seconds:.2f} | {compile_s:.1f} | {100 * mfu:.1f}% |")
  lines += [
      "",
      f"MFU = tok/s x {flops / 1e6:.1f} MFLOP/token (2 x matmul parameters incl. the LM head,"
      f" plus attention over the mean context {P + T // 2}) / measured matmul peak"
      f" {peak:.1f} GFLOP/s (jitted 2048x2048 float32 `a @ b`, best of 5).",
      "",
      f"Per-step cost of drawing one token for {B * G} rows over {s['vocab_size']} logits"
      " (jitted, best of 20):",
      "",
      "| draw | ms |",
      "|---|---|",
  ] + [f"| {name} | {ms:.2f} |" for name, ms in draws.items()] + [
      "",
      f"Decode attention of one layer per step ({B * G} rows, {P + T - 1} cache slots,"
      f" {kv_heads} kv heads; x{s['num_hidden_layers']} layers per step), by cache layout:",
      "",
      "| cache layout | ms per layer-step |",
      "|---|---|",
  ] + [f"| {name} | {ms:.2f} |" for name, ms in attention.items()]
  pathlib.Path(args.output).parent.mkdir(parents=True, exist_ok=True)
  pathlib.Path(args.output).write_text("\n".join(lines) + "\n")
  print("\n".join(lines))


if __name__ == "__main__":
  main()
