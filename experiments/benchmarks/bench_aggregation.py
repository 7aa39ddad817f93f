"""Jitted GRPO loss + gradient time per aggregation mode.

    python -m experiments.benchmarks.bench_aggregation [--seqs 512] [--tokens 4096] [--rounds 15]

Times ``jax.value_and_grad`` of ``ba_jax.loss.losses.policy_loss`` with respect to
the per-token log-probs on a [seqs, tokens] batch (G = 16, random lengths,
binary rewards), for each mode. Modes are timed round-robin so that load from
other processes falls on all of them alike; the median is reported. Writes
``experiments/benchmarks/results/aggregation_bench.md``.
"""

import argparse
import functools
import os
import pathlib
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from ba_jax.loss import losses
from ba_jax.loss.aggregation import MODES

OUT = pathlib.Path(__file__).parent / "results" / "aggregation_bench.md"


@functools.partial(jax.jit, static_argnames=("mode", "group_size", "max_len"))
def loss_and_grad(logp, old_logp, advantages, mask, *, mode, group_size,
                  max_len):
  def loss_fn(lp):
    return losses.policy_loss(lp, old_logp, advantages, mask,
                              group_size=group_size, aggregation=mode,
                              eps_low=0.2, eps_high=0.28,
                              max_response_len=max_len)[0]
  return jax.value_and_grad(loss_fn)(logp)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--seqs", type=int, default=512)
  parser.add_argument("--tokens", type=int, default=4096)
  parser.add_argument("--group_size", type=int, default=16)
  parser.add_argument("--rounds", type=int, default=200)
  parser.add_argument("--out", default=str(OUT))
  args = parser.parse_args()
  rng = np.random.default_rng(0)
  n, t = args.seqs, args.tokens
  lengths = rng.integers(1, t + 1, size=n)
  mask = jnp.asarray(np.arange(t)[None] < lengths[:, None], jnp.float32)
  rewards = rng.integers(0, 2, size=n).astype(np.float32)
  adv = jnp.asarray((rewards - 0.5) * 2)
  old = jnp.asarray(rng.normal(size=(n, t)) * 0.1 - 2, jnp.float32)
  logp = old + jnp.asarray(rng.normal(size=(n, t)) * 0.05, jnp.float32)
  kwargs = dict(group_size=args.group_size, max_len=t)
  for mode in MODES:  # compile
    jax.block_until_ready(loss_and_grad(logp, old, adv, mask, mode=mode,
                                        **kwargs))
  times = {mode: [] for mode in MODES}
  for _ in range(args.rounds):
    for mode in MODES:
      start = time.perf_counter()
      jax.block_until_ready(loss_and_grad(logp, old, adv, mask, mode=mode,
                                          **kwargs))
      times[mode].append(time.perf_counter() - start)
  median = {m: statistics.median(v) for m, v in times.items()}
  lines = [
      "# Aggregation loss + gradient time",
      "",
      f"Command: `python -m experiments.benchmarks.bench_aggregation --seqs {n} "
      f"--tokens {t} --rounds {args.rounds}`",
      "",
      f"Batch {n} x {t} tokens, G = {args.group_size}, float32, jitted "
      f"`value_and_grad` of `policy_loss` w.r.t. the log-probs; "
      f"{os.cpu_count()} CPU cores ({platform.processor() or platform.machine()}), "
      f"jax {jax.__version__}; median of {args.rounds} round-robin rounds.",
      "",
      "| mode | median ms | min ms | vs token |",
      "|---|---:|---:|---:|",
  ]
  for mode in MODES:
    lines.append(f"| {mode} | {median[mode] * 1e3:.1f} | "
                 f"{min(times[mode]) * 1e3:.1f} | "
                 f"{median[mode] / median['token']:.3f}x |")
  overhead = median["balanced"] / median["token"] - 1
  best = min(times["balanced"]) / min(times["token"]) - 1
  lines += ["", f"balanced costs {overhead * 100:+.1f}% against token by the "
            f"median and {best * 100:+.1f}% by the fastest round (target: "
            "within 5%). On a machine shared with other work the fastest "
            "round is the least disturbed estimate."]
  pathlib.Path(args.out).write_text("\n".join(lines) + "\n")
  print("\n".join(lines))


if __name__ == "__main__":
  main()
