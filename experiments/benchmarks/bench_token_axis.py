"""The decoder's dense products on one token axis against rows x positions, fwd+bwd.

    python -m experiments.benchmarks.bench_token_axis --steps=10 --out=experiments/benchmarks/results/token_axis_bench.md

`ba_jax.policy.model.token_einsum` merges a batch's rows and positions into one
token axis for every dense product (q/k/v/o projections, MLP, LM head), so the
weights' gradients contract over one axis. This script times the update's
fwd+bwd (the gradient of the response log-probs, `score_responses`, as the
train step differentiates it) with that form and with the two-axis einsum
("ble,em->blm") the model used before, in one process: both programs are
compiled first, then their timed steps alternate, so a change in the host's
load hits both. Shapes: the default job's policy (configs/tiny.py) at one of
its mini-batches, and SmolLM2-135M's layer shapes (random weights, fewer
layers: each layer is the same program) at one mini-batch of
configs/smollm2_reasoning_gym.py. The gradients of both forms are compared too.
"""
from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ba_jax.policy import model as model_lib
from ba_jax.policy import scoring
from ba_jax.policy.model import Decoder, ModelConfig

SHAPES = {
    "tiny (configs/tiny.py)": dict(
        config=ModelConfig(model_type="qwen3", vocab_size=32, hidden_size=64, intermediate_size=192,
                           num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True,
                           tie_word_embeddings=True),
        rows=64, prompt=16, response=32),
    "SmolLM2-135M layers (4 of 30)": dict(
        config=ModelConfig(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                           num_layers=4, num_heads=9, num_kv_heads=3, head_dim=64,
                           tie_word_embeddings=True, logprob_chunk=64),
        rows=32, prompt=64, response=32),
}


def two_axis_einsum(subscripts: str, x, kernel, *, einsum=jnp.einsum):
  """The model's products before `token_einsum`: rows and positions as two axes."""
  return einsum(subscripts.replace("t", "bl"), x, kernel)


def _grad_fn(model: Decoder, batch: dict, form):
  """The jitted gradient of the summed response log-probs, traced with `form`."""
  graphdef, params = nnx.split(model, nnx.Param)

  def loss(p):
    logp, _ = scoring.score_responses(nnx.merge(graphdef, p), *batch)
    return logp.sum()

  saved = model_lib.token_einsum, scoring.token_einsum
  model_lib.token_einsum = scoring.token_einsum = form
  try:
    fn = jax.jit(jax.grad(loss))
    grads = jax.block_until_ready(fn(params))  # traces (with `form`) and compiles
  finally:
    model_lib.token_einsum, scoring.token_einsum = saved
  return fn, params, grads


def _batch(rows: int, prompt: int, response: int, vocab: int, seed: int = 0):
  rng = np.random.default_rng(seed)
  p_len = rng.integers(prompt // 2, prompt + 1, rows)
  r_len = rng.integers(response // 2, response + 1, rows)
  p_mask = (np.arange(prompt)[None] >= prompt - p_len[:, None]).astype(np.int32)
  r_mask = (np.arange(response)[None] < r_len[:, None]).astype(np.int32)
  return (jnp.asarray(rng.integers(0, vocab, (rows, prompt)) * p_mask, jnp.int32), jnp.asarray(p_mask),
          jnp.asarray(rng.integers(0, vocab, (rows, response)) * r_mask, jnp.int32), jnp.asarray(r_mask))


def time_sides(sides: dict, steps: int) -> dict:
  """Alternates `steps` timed calls of each side's compiled gradient (`fn(params)`), so a change
  in the host's load hits every side; each side gets its `median` seconds, and the result the
  largest gradient difference between the first two sides (and the largest gradient)."""
  for side in sides.values():
    side["times"] = []
  for _ in range(steps):
    for side in sides.values():
      start = time.perf_counter()
      jax.block_until_ready(side["fn"](side["params"]))
      side["times"].append(time.perf_counter() - start)
  a, b = list(sides.values())[:2]
  diff = max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(jax.tree.leaves(a["grads"]),
                                                             jax.tree.leaves(b["grads"])))
  scale = max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(a["grads"]))
  for side in sides.values():
    side["median"] = float(np.median(side["times"]))
    del side["fn"], side["params"], side["grads"]
  names = list(sides)
  return dict(sides=sides, ratio=sides[names[1]]["median"] / sides[names[0]]["median"],
              grad_diff=diff, grad_scale=scale)


def compare(name: str, spec: dict, steps: int) -> dict:
  config = spec["config"]
  model = Decoder(config, rngs=nnx.Rngs(0))
  batch = _batch(spec["rows"], spec["prompt"], spec["response"], config.vocab_size)
  sides = {}
  for form_name, form in (("one token axis (token_einsum)", model_lib.token_einsum),
                          ("rows x positions", two_axis_einsum)):
    start = time.perf_counter()
    fn, params, grads = _grad_fn(model, batch, form)
    sides[form_name] = dict(fn=fn, params=params, grads=grads, compile_s=time.perf_counter() - start)
  return dict(name=name, rows=spec["rows"], prompt=spec["prompt"], response=spec["response"],
              config=config, **time_sides(sides, steps))


def to_markdown(results: list[dict], command: str, steps: int, *, title: str, what: str) -> str:
  """The results table: one row per shape, a column per side (the first is the ratio's
  denominator), under `title` and the `what is timed` paragraph."""
  names = list(results[0]["sides"])
  lines = [f"# {title}", "",
           f"Produced by `{command}` on {datetime.date.today().isoformat()}. Machine: "
           f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, jax "
           f"{jax.__version__} on {jax.devices()[0].platform}; 1-minute load average at the end: "
           f"{os.getloadavg()[0]:.1f}.", "", what, "",
           "| shapes | mini-batch (rows x prompt + response) | " + " | ".join(f"{n} (s)" for n in names)
           + " | ratio | max abs gradient difference (largest gradient) |",
           "|---|---|" + "---|" * len(names) + "---|---|"]
  for r in results:
    times = " | ".join(f"{side['median']:.4f}" for side in r["sides"].values())
    lines.append(f"| {r['name']} | {r['rows']} x {r['prompt']} + {r['response']} | {times} "
                 f"| **{r['ratio']:.2f}x** | {r['grad_diff']:.1e} ({r['grad_scale']:.1e}) |")
  lines += ["", "Compile seconds: " + "; ".join(
      f"{r['name']}: " + ", ".join(f"{k} {v['compile_s']:.1f}" for k, v in r["sides"].items())
      for r in results), ""]
  return "\n".join(lines)


def run(argv_name: str, default_out: str, compare_fn, *, title: str, what) -> None:
  """The command line both benchmarks share: --steps, --only, --out; writes and prints the
  table (`what(steps)`: the what-is-timed paragraph)."""
  parser = argparse.ArgumentParser(description=title)
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument("--only", default="", help="a substring of one shape's name")
  parser.add_argument("--out", default=default_out)
  args = parser.parse_args()
  results = [compare_fn(name, spec, args.steps) for name, spec in SHAPES.items()
             if args.only in name]
  command = f"python experiments/{argv_name} --steps={args.steps} --out={args.out}"
  if args.only:
    command += f" --only={args.only!r}"
  text = to_markdown(results, command, args.steps, title=title, what=what(args.steps))
  out = pathlib.Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(text)
  print(text)


# The opening of both benchmarks' what-is-timed paragraph.
TIMED = ("What is timed: the gradient of the summed response log-probs (`score_responses`, what the "
         "train step differentiates) with respect to every parameter, for one mini-batch")


def main():
  run("bench_token_axis.py", "experiments/benchmarks/results/token_axis_bench.md", compare,
      title="Dense products on one token axis vs rows x positions (update fwd+bwd)",
      what=lambda steps: f"{TIMED}; both forms compiled first, then {steps} timed steps of each, "
      "alternating. Median seconds per step; the ratio is rows x positions / one token axis "
      "(above 1: the token axis is faster).")


if __name__ == "__main__":
  main()
