"""Can a small policy learn the chains task, and what length statistics do its own samples have?

    python -m experiments.studies.chains_grid.chains_warmup_probe --spread=high --gap=pos --sft_steps=400

Supervised warm-up of a random policy on ba_jax/tasks/chains.py's traces, then
``--group_size`` samples for each of ``--prompts`` held-out problems at
temperature 1. Reports the share of well-formed responses, accuracy under the
rule, the chain-count histogram, and the length statistics the trainer logs
(``metrics.rollout_stats``: within-group CV, positive-minus-negative gap) on
the policy's samples rather than on the warm-up data, and the within-group
gap (mean over groups holding both signs of positive minus negative mean
length, absolute and relative to the group's mean). Writes a JSON file.

The warm-up is ``ba_jax.update.sft.warmup`` on the task's ``warmup_examples``;
``python -m ba_jax.train --config=configs/chains.py`` runs the same task
through the trainer.
"""
from __future__ import annotations

import argparse
import collections
import json
import pathlib
import time

import jax
import ml_collections
import numpy as np
from flax import nnx

from ba_jax.loss import advantages
from ba_jax.tasks import chains
from ba_jax.run import metrics
from ba_jax.policy import model as model_lib
from ba_jax.generation import sampler
from ba_jax.update import sft

COUNTS = {"low": "4,5", "high": "1,2,8"}
RULES = {("low", "neg"): "max_chains:4", ("low", "none"): "answer", ("low", "pos"): "min_chains:5",
         ("high", "neg"): "max_chains:2", ("high", "none"): "answer",
         ("high", "pos"): "min_chains:2"}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--spread", default="high", choices=("low", "high"))
  parser.add_argument("--gap", default="pos", choices=("neg", "none", "pos"))
  parser.add_argument("--sft_steps", type=int, default=400)
  parser.add_argument("--batch_size", type=int, default=32)
  parser.add_argument("--learning_rate", type=float, default=3e-3)
  parser.add_argument("--hidden", type=int, default=128)
  parser.add_argument("--layers", type=int, default=5)
  parser.add_argument("--prompts", type=int, default=32)
  parser.add_argument("--group_size", type=int, default=8)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--out", default="experiments/results/chains_warmup_probe.json")
  args = parser.parse_args(argv)

  task_cfg = ml_collections.ConfigDict(dict(
      name=chains.NAME, min_terms=2, max_terms=3, max_value=9,
      chain_counts=COUNTS[args.spread], rule=RULES[(args.spread, args.gap)],
      sft_correct_frac=0.5))
  tokenizer = chains.build_tokenizer()
  task = chains.ChainsTask(task_cfg, seed=args.seed, tokenizer=tokenizer, max_prompt_len=8,
                           num_heldout=args.prompts)
  max_new_tokens = chains.max_response_tokens(task.cfg) + 8
  config = model_lib.ModelConfig(
      model_type="qwen3", vocab_size=32, hidden_size=args.hidden,
      intermediate_size=3 * args.hidden, num_layers=args.layers, num_heads=4, num_kv_heads=2,
      head_dim=args.hidden // 4, tie_word_embeddings=True, qk_norm=True,
      max_position_embeddings=128)
  graphdef, params = nnx.split(model_lib.Decoder(config, rngs=nnx.Rngs(args.seed)))
  n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))

  start = time.perf_counter()
  for _, params in sft.warmup(params, graphdef, task, steps=args.sft_steps,
                              batch_size=args.batch_size, learning_rate=args.learning_rate,
                              warmup_steps=20, max_new_tokens=max_new_tokens,
                              to_device=lambda b: b):
    pass  # sft.warmup yields (steps done, params) after each update
  sft_s = time.perf_counter() - start

  policy = nnx.merge(graphdef, params)
  ids, mask = task.encode_prompts(task.heldout)
  out = sampler.sample_groups(policy, ids, mask, group_size=args.group_size,
                              max_new_tokens=max_new_tokens, temperature=1.0,
                              eos_id=task.eos_id, pad_id=task.pad_id,
                              rng=jax.random.key(args.seed + 1))
  out = jax.tree.map(np.asarray, out)
  texts = task.decode(out.tokens, out.mask)
  problems = [p for p in task.heldout for _ in range(args.group_size)]
  rewards, correct = task.grade(texts, problems)
  adv = np.asarray(advantages.group_advantages(rewards, args.group_size))
  stats = metrics.rollout_stats(rewards, correct, adv, out.mask, out.truncated, args.group_size)
  lengths_GxS = out.mask.sum(-1).reshape(-1, args.group_size).astype(float)
  correct_GxS = correct.reshape(-1, args.group_size)
  gaps = [(L[c].mean() - L[~c].mean(), (L[c].mean() - L[~c].mean()) / L.mean())
          for L, c in zip(lengths_GxS, correct_GxS) if c.any() and (~c).any()]
  within = dict(groups_with_both=len(gaps),
                gap=float(np.mean([g for g, _ in gaps])) if gaps else float("nan"),
                gap_rel=float(np.mean([r for _, r in gaps])) if gaps else float("nan"))
  counts = [chains.chain_count(t) for t in texts]
  parsed = [chains.parse_response(t)[0] for t in texts]
  valid = [bool(c) and c == chains.chains_for(p, len(c)) for c, p in zip(parsed, problems)]
  answer_right = [chains.grade(t, p, "answer") > 0 for t, p in zip(texts, problems)]
  result = dict(
      args=vars(args), rule=task.cfg.rule, chain_counts=task.cfg.chain_counts,
      params=n_params, sft_seconds=round(sft_s, 1), responses=len(texts),
      well_formed=float(np.mean([c > 0 for c in counts])),
      chains_all_right=float(np.mean(valid)), answer_right=float(np.mean(answer_right)),
      chain_count_histogram=dict(sorted(collections.Counter(counts).items())),
      rollout_stats=stats, within_group_gap=within, examples=texts[:4])
  path = pathlib.Path(args.out)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(result, indent=1) + "\n")
  print(json.dumps({k: v for k, v in result.items() if k != "examples"}, indent=1))


if __name__ == "__main__":
  main()
