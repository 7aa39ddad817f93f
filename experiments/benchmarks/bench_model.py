"""Forward+backward throughput and MFU of the decoder (~50M params, seq 512).

    python -m experiments.benchmarks.bench_model --steps=3 --batch=2 --out=experiments/benchmarks/results/model_bench.md

MFU is measured against the float32 matrix-multiply peak this script measures
on the same machine (best of several square matmuls), so it says how much of
the reachable matmul rate the model step uses, not a vendor peak.
Model FLOPs per token (fwd+bwd) = 6 * (matmul parameters, lm_head included,
embedding lookup excluded) + 12 * layers * seq * heads * head_dim (attention
scores and mixing, causal mask not discounted, as in the PaLM paper).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import pathlib
import platform
import time

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from ba_jax.policy.model import Decoder, ModelConfig

BENCH_CONFIG = ModelConfig(
    model_type="qwen2", vocab_size=32000, hidden_size=512, intermediate_size=1536, num_layers=6, num_heads=8,
    num_kv_heads=4, head_dim=64, attention_bias=True)


def _timed(fn, *args, repeats: int) -> list[float]:
  jax.block_until_ready(fn(*args))  # compile + warm up
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return times


def matmul_peak_flops(dtype=jnp.float32, sizes=(1024, 2048), repeats: int = 5) -> tuple[float, int]:
  """Best measured FLOP/s of a square matmul, and the size that reached it."""
  best, best_n = 0.0, 0
  for n in sizes:
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    b = jax.random.normal(jax.random.key(1), (n, n), dtype)
    seconds = min(_timed(jax.jit(jnp.matmul), a, b, repeats=repeats))
    rate = 2 * n**3 / seconds
    if rate > best:
      best, best_n = rate, n
  return best, best_n


def model_flops_per_token(c: ModelConfig, seq: int) -> tuple[float, int, int]:
  """(fwd+bwd FLOPs per token, total params, matmul params)."""
  E, H, K, D, M, V = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size, c.vocab_size
  per_layer = E * H * D + 2 * E * K * D + H * D * E + 3 * E * M
  matmul = c.num_layers * per_layer + E * V
  norms_bias = c.num_layers * (2 * E + (H + 2 * K) * D) + E
  total = matmul + V * E * (0 if c.tie_word_embeddings else 1) + norms_bias
  return 6 * matmul + 12 * c.num_layers * seq * H * D, total, matmul


def _step_fn(model: Decoder, layers: str):
  """(jitted value-and-grad step, its differentiated arguments).

  layers="scan": the model as it is (one `lax.scan` over the stacked layers).
  layers="loop": the pre-scan program: every layer's parameters are their own arrays (sliced
  from the stack once, outside the step) and the layers run in an unrolled Python loop.
  """
  graphdef, params = nnx.split(model, nnx.Param)
  _, stacked = nnx.split(model.layers, nnx.Param)
  xent = lambda logits, ids: optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], ids[:, 1:]).mean()
  if layers == "scan":
    return jax.jit(jax.value_and_grad(lambda p, ids: xent(nnx.merge(graphdef, p)(ids), ids))), (params,)
  layer_def, _ = nnx.split(model.layer_slices()[0], nnx.Param)
  per_layer = tuple(nnx.split(layer, nnx.Param)[1] for layer in model.layer_slices())
  per_layer = jax.tree.map(lambda x: jnp.array(x, copy=True), per_layer)  # own buffers

  def loss_fn(params, per_layer, ids):
    model = nnx.merge(graphdef, params)
    return xent(model(ids, layers=tuple(nnx.merge(layer_def, s) for s in per_layer)), ids)

  # The stacked layer parameters are passed but neither read nor differentiated.
  return jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1))), (params, per_layer)


def run(steps: int, batch: int, seq: int, scan_unroll: int = 0) -> dict:
  config = dataclasses.replace(BENCH_CONFIG, scan_unroll=scan_unroll)
  model = Decoder(config, rngs=nnx.Rngs(0))
  n_params = sum(p.size for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
  step, args = _step_fn(model, "scan")
  ids = jax.random.randint(jax.random.key(2), (batch, seq), 0, config.vocab_size)
  args = (*args, ids)
  start = time.perf_counter()
  jax.block_until_ready(step(*args))
  compile_s = time.perf_counter() - start
  peak_before, n_before = matmul_peak_flops()
  times = []
  for _ in range(steps):
    start = time.perf_counter()
    jax.block_until_ready(step(*args))
    times.append(time.perf_counter() - start)
  peak, peak_n = max((peak_before, n_before), matmul_peak_flops())
  flops_token, total, matmul = model_flops_per_token(config, seq)
  assert total == n_params, (total, n_params)
  step_s = min(times)  # best of: the least disturbed by other processes, like the peak
  tokens_s = batch * seq / step_s
  return dict(config=config, n_params=n_params, matmul_params=matmul, batch=batch, seq=seq, steps=steps,
              step_times=times, step_s=step_s, compile_s=compile_s, tokens_s=tokens_s,
              flops_token=flops_token, achieved=tokens_s * flops_token, peak=peak, peak_n=peak_n,
              mfu=tokens_s * flops_token / peak)


def compare_layers(steps: int, batch: int, seq: int) -> dict:
  """The scanned stack against the pre-scan unrolled loop, in one process: both compiled first,
  then their timed steps alternate (loop, scan, loop, scan, ...), so a load change hits both."""
  ids = jax.random.randint(jax.random.key(2), (batch, seq), 0, BENCH_CONFIG.vocab_size)
  sides = {}
  for name, layers, unroll in (("loop", "loop", 1), ("scan, scan_unroll=1", "scan", 1),
                               ("scan, scan_unroll=0 (auto)", "scan", 0)):
    model = Decoder(dataclasses.replace(BENCH_CONFIG, scan_unroll=unroll), rngs=nnx.Rngs(0))
    step, args = _step_fn(model, layers)
    start = time.perf_counter()
    loss, _ = jax.block_until_ready(step(*args, ids))
    sides[name] = dict(step=step, args=(*args, ids), compile_s=time.perf_counter() - start,
                         loss=float(loss), times=[])
  for _ in range(steps):
    for side in sides.values():
      start = time.perf_counter()
      jax.block_until_ready(side["step"](*side["args"]))
      side["times"].append(time.perf_counter() - start)
  best = {k: min(v["times"]) for k, v in sides.items()}
  return dict(batch=batch, seq=seq, steps=steps, sides=sides, best=best,
              ratios={k: v / best["loop"] for k, v in best.items() if k != "loop"},
              load=os.getloadavg()[0])


def compare_markdown(r: dict, command: str) -> str:
  ratios = "\n".join(f"- **{k} / loop step time: {v:.3f}** ({100 * (v - 1):+.1f}%)"
                     for k, v in r["ratios"].items())
  rows = "\n".join(
      f"| {name} | {r['best'][name]:.2f} | {', '.join(f'{t:.2f}' for t in side['times'])} | "
      f"{side['compile_s']:.1f} | {side['loss']:.6f} |" for name, side in r["sides"].items())
  return f"""
## Scanned layers against the pre-scan unrolled loop

Produced by `{command}` on {datetime.date.today().isoformat()}; 1-minute load average at the end:
{r['load']:.1f}. Same model and weights, batch {r['batch']} x seq {r['seq']}, fwd+bwd. "loop" is the
program before the layers were stacked: each layer's parameters are their own arrays and the
layers run in an unrolled Python loop (`Decoder(...)(ids, layers=per_layer_modules)`); "scan" is
the model as it is (`lax.scan` over the stacked layers) with one layer body per loop iteration
(`model.scan_unroll=1`, what accelerators run) and with the default `scan_unroll=0` (auto: on
XLA:CPU the scan is unrolled over every layer). All are compiled first, then their
{r['steps']} timed steps alternate.

| layers | best step (s) | all steps (s) | compile (s) | loss |
|---|---|---|---|---|
{rows}

{ratios}
"""


def _load_note(load: float) -> str:
  if load < 1.5:
    return ("The machine was otherwise idle (load below 1.5 with this script running); the\n"
            "figures are still CPU figures: rerun on a GPU/TPU for accelerator numbers.")
  return ("**Other work shared the CPU cores while these figures were taken, so they are noisy\n"
          "and a lower bound**; rerun the command on an idle machine for clean numbers.")


def to_markdown(r: dict, command: str) -> str:
  c = r["config"]
  return f"""# Decoder forward+backward benchmark

Produced by `{command}` on {datetime.date.today().isoformat()}.

Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores visible, jax {jax.__version__}
on {jax.devices()[0].platform}; 1-minute load average at the end of the run: {os.getloadavg()[0]:.1f}. {_load_note(os.getloadavg()[0])}

Model: {c.model_type}, {r['n_params'] / 1e6:.1f}M parameters ({r['matmul_params'] / 1e6:.1f}M in matmuls),
hidden {c.hidden_size}, {c.num_layers} layers, {c.num_heads} heads / {c.num_kv_heads} kv heads of {c.head_dim},
MLP {c.intermediate_size}, vocab {c.vocab_size}, float32 params and compute.
Batch {r['batch']} x seq {r['seq']}; loss = next-token cross-entropy; {r['steps']} timed steps after one
compile+warm-up step ({r['compile_s']:.1f} s).

| figure | value |
|---|---|
| step time (best) | {r['step_s']:.2f} s (all: {', '.join(f'{t:.2f}' for t in r['step_times'])}) |
| fwd+bwd tokens/s | {r['tokens_s']:.0f} |
| model FLOPs per token (fwd+bwd) | {r['flops_token'] / 1e6:.1f} MFLOP |
| achieved | {r['achieved'] / 1e9:.1f} GFLOP/s |
| measured matmul peak (float32, {r['peak_n']}x{r['peak_n']}) | {r['peak'] / 1e9:.1f} GFLOP/s |
| MFU vs measured matmul peak | {100 * r['mfu']:.1f}% |

FLOPs per token = 6 x matmul params + 12 x layers x seq x heads x head_dim (attention, causal mask not
discounted). The peak is the best of jitted square float32 matmuls (1024 and 2048, five runs each, measured
before and after the model steps) timed by the same script; step time and peak are both best-of,
so contention from other processes affects both the same way as far as possible.
"""


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=3)
  parser.add_argument("--batch", type=int, default=2)
  parser.add_argument("--seq", type=int, default=512)
  parser.add_argument("--scan_unroll", type=int, default=0, help="model.scan_unroll (0: auto)")
  parser.add_argument("--out", default="experiments/benchmarks/results/model_bench.md")
  parser.add_argument("--compare_steps", type=int, default=0,
                      help="also time the scanned layers against the unrolled loop, this many steps each")
  args = parser.parse_args()
  result = run(args.steps, args.batch, args.seq, args.scan_unroll)
  command = (f"python -m experiments.benchmarks.bench_model --steps={args.steps} --batch={args.batch} --seq={args.seq} "
             f"--scan_unroll={args.scan_unroll} --out={args.out}")
  text = to_markdown(result, command)
  if args.compare_steps:
    command += f" --compare_steps={args.compare_steps}"
    text = text.replace(f"`{command.rsplit(' --compare', 1)[0]}`", f"`{command}`")
    text += compare_markdown(compare_layers(args.compare_steps, args.batch, args.seq), command)
  out = pathlib.Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(text)
  print(text)


if __name__ == "__main__":
  main()
