"""The update's fwd+bwd with each group's prompt computed once against every row's own prompt.

    python -m experiments.benchmarks.bench_shared_prompt --steps=10 --out=experiments/benchmarks/results/shared_prompt_bench.md

`rl.share_prompt=true` scores a GRPO mini-batch as one packed row per group,
`[prompt; response_1; ..; response_G]` (`score_responses(prompt_group=G)`,
`attention.attend_shared_prefix`): the prompt's projections, MLP and their
gradients are computed once per group instead of G times, with the same sums.
This script times the gradient of the summed response log-probs (what the
train step differentiates) both ways in one process: both programs compiled
first, then their timed steps alternate, so a change in the host's load hits
both. Shapes as `bench_token_axis.py` (the default job's policy at one
mini-batch, SmolLM2-135M's layer shapes at one mini-batch of
configs/smollm2_reasoning_gym.py), groups of 8, prompts of half to full width
per group; the gradients of both ways are compared too.
"""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp
from flax import nnx

from ba_jax.policy import scoring
from ba_jax.policy.model import Decoder

from experiments.benchmarks.bench_token_axis import SHAPES, TIMED, _batch, run, time_sides

GROUP = 8


def _group_batch(rows: int, prompt: int, response: int, vocab: int):
  """`_batch` with one prompt per group of GROUP consecutive rows (the rollout's layout)."""
  p_ids, p_mask, r_ids, r_mask = _batch(rows, prompt, response, vocab)
  return jnp.repeat(p_ids[::GROUP], GROUP, 0), jnp.repeat(p_mask[::GROUP], GROUP, 0), r_ids, r_mask


def compare(name: str, spec: dict, steps: int) -> dict:
  config = spec["config"]
  graphdef, params = nnx.split(Decoder(config, rngs=nnx.Rngs(0)), nnx.Param)
  batch = _group_batch(spec["rows"], spec["prompt"], spec["response"], config.vocab_size)
  sides = {}
  for side_name, group in ((f"prompt once per group of {GROUP}", GROUP), ("every row's prompt", 1)):
    def loss(p, group=group):
      logp, _ = scoring.score_responses(nnx.merge(graphdef, p), *batch, prompt_group=group)
      return logp.sum()
    start = time.perf_counter()
    fn = jax.jit(jax.grad(loss))
    grads = jax.block_until_ready(fn(params))
    sides[side_name] = dict(fn=fn, params=params, grads=grads, compile_s=time.perf_counter() - start)
  return dict(name=name, rows=spec["rows"], prompt=spec["prompt"], response=spec["response"],
              **time_sides(sides, steps))


def main():
  run("bench_shared_prompt.py", "experiments/benchmarks/results/shared_prompt_bench.md", compare,
      title="Each group's prompt once vs every row's prompt (update fwd+bwd)",
      what=lambda steps: f"{TIMED} of groups of {GROUP} rows sharing a prompt; both ways compiled "
      f"first, then {steps} timed steps of each, alternating. Median seconds per step; the ratio is "
      "every row's prompt / prompt once per group (above 1: sharing is faster).")


if __name__ == "__main__":
  main()
