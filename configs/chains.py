"""The length-controlled task (ba_jax/tasks/chains.py) for the aggregation grid
(experiments/studies/chains_grid/grid_aggregation.py): a small Qwen3-style policy, supervised
warm-up, then short GRPO runs at a stressing learning rate.

    python -m ba_jax.train --config=configs/chains.py:spread=high,gap=pos,agg=balanced \
        --workdir=/tmp/chains

Variants (comma separated ``key=value`` after the colon): see ``VARIANTS``.
``spread`` picks the chain counts the warm-up draws ``r`` from, so the
within-group length CV: (4, 5) ~0.09, (1, 2, 8) ~0.60 (warm-up data, groups
of 8). ``gap`` picks the verifier rule, and so the sign of the within-group
positive-minus-negative length gap (relative to the group's mean length, on
the warm-up data, with numbers 1..5, from tests/test_chains.py's helpers
``group_lengths`` and ``within_group_gap``):

    high: max_count:2 (-0.65), answer (+0.03), min_count:8 (+1.12)
    low:  max_count:4 (-0.12), answer (+0.01), min_count:5 (+0.12)

A low spread caps the gap, since ``r`` is the only source of length variation
in a group. The warm-up traces do not depend on the rule (only their grades
do), so every gap of one spread shares its warm-up: experiments/
grid_aggregation.py warms up once per (spread, seed).

The rules are count rules (the answer, the last chain and the number of
chains); ``--config.task.rule=min_chains:2`` gives a chain rule, which also
checks every chain's arithmetic. Numbers are drawn from 1..5 so that most
partial sums stay single digits; ``big`` gives a ~1M-parameter policy
(``MODEL`` is smaller, so the grid fits its time budget). The study's
reasoning for these choices: experiments/studies/chains_grid/README.md.
"""
import os
import runpy
import types

from ba_jax.config import common
from ba_jax.tasks import chains

tiny = types.SimpleNamespace(**runpy.run_path(
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny.py")))
VARIANTS = {"spread": "low|high chain-count spread",
            "gap": "neg|none|pos sign of the length gap (the rule)",
            "agg": "<aggregation mode>", "lr": "<float> RL peak learning rate",
            "quick": "a minutes-scale run of one cell",
            "big": "the ~1M-parameter policy (too slow for the grid's budget)",
            "smoke": "a seconds-scale run for tests"}
CHAIN_COUNTS = {"low": "4,5", "high": "1,2,8"}
RULES = {  # (spread, gap) -> task.rule
    ("low", "neg"): "max_count:4", ("low", "none"): "answer",
    ("low", "pos"): "min_count:5",
    ("high", "neg"): "max_count:2", ("high", "none"): "answer",
    ("high", "pos"): "min_count:8",
}
SMOKE_RULES = {"neg": "max_count:1", "none": "answer", "pos": "min_count:2"}
# The grid's policy: ~0.15M parameters, 3 layers x (12k attention + 37k MLP).
MODEL = dict(hidden_size=64, intermediate_size=192, num_layers=3, num_heads=4,
             num_kv_heads=2, head_dim=16)
# ~0.99M parameters: 5 layers x (49k attention + 147k MLP) + 4k embedding.
BIG_MODEL = dict(hidden_size=128, intermediate_size=384, num_layers=5,
                 num_heads=4, num_kv_heads=2, head_dim=32)


def get_config(arg=None):
  args = common.parse_variants(arg, VARIANTS, "configs/chains.py")
  spread, gap = args.get("spread", "high"), args.get("gap", "none")
  if spread not in CHAIN_COUNTS or gap not in ("neg", "none", "pos"):
    raise ValueError(f"configs/chains.py: spread={spread!r}, gap={gap!r}; "
                     "expected spread=low|high and gap=neg|none|pos")
  c = tiny.get_config(f"agg={args['agg']}" if "agg" in args else None)

  c.model.update(dict(BIG_MODEL if args.get("big") else MODEL,
                      max_position_embeddings=160))

  c.task = common.task(
      chains.NAME,  # ba_jax/tasks/chains.py
      min_terms=2,  # numbers in the prompt: 2 or 3
      max_terms=3,
      max_value=5,  # numbers 1..5: mostly single-digit partial sums
      chain_counts=CHAIN_COUNTS[spread],  # warm-up draws r uniformly from these
      rule=RULES[(spread, gap)],  # answer | min_count:k | max_count:k (| *_chains:k)
      sft_correct_frac=0.5,  # error-free warm-up traces (the rule may fail them)
      grader="builtin",  # the chain rules are this task's own
      max_prompt_len=8,  # "5+5+5=" is 6 tokens
  )
  c.sft.update(steps=500, batch_size=32)
  c.rl.update(steps=20, prompts_per_step=8)  # 8 prompts x 8 responses
  c.rl.max_new_tokens = _budget(c.task)
  c.rl.overlong_buffer = 16
  # tiny.py's 1e-4 x 5: token aggregation collapsed at it in a probe of the
  # high-spread, negative-gap cell (PREDICTIONS.md's addendum); 3e-4 did not.
  c.optim.learning_rate = float(args.get("lr", 5e-4))
  c.eval.num_problems = 32  # of the 150 distinct problems; training never sees them
  c.checkpoint.every = 0  # the end only: runs are short
  # XLA's own options, as when the grid and the powered ablation (drafts.py)
  # were run: a rerun on the same host then samples the same tokens.
  c.xla_cpu_compile = "default"

  if args.get("quick"):  # one cell in minutes on 2 cores
    c.sft.steps = 300
    c.log.progress_bar = False
  if args.get("smoke"):
    c.model.update(dict(hidden_size=32, intermediate_size=64, num_layers=2,
                        num_heads=2, num_kv_heads=1, head_dim=16))
    c.task.update(chain_counts="1,2", rule=SMOKE_RULES[gap], max_terms=2)
    c.sft.update(steps=20, batch_size=16)
    c.rl.update(steps=3, prompts_per_step=4, group_size=4)
    c.rl.max_new_tokens = _budget(c.task)
    c.eval.update(num_problems=8, samples_per_problem=2)
    c.checkpoint.every = 2
    c.log.progress_bar = False
  return c


def _budget(task) -> int:
  """The response budget: the longest warm-up trace plus room to lengthen."""
  return chains.max_response_tokens(chains.config_from(task)) + 12
