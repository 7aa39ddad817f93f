"""The drafts task (ba_jax/tasks/drafts.py), whose response length is chosen
at every draft, for the powered aggregation ablation
(experiments/studies/powered_drafts/spec.py): a small Qwen3-style policy, supervised
warm-up, then short GRPO runs.

    python -m ba_jax.train --config=configs/drafts.py:gap=pos,agg=balanced \
        --workdir=/tmp/drafts

Variants (comma separated ``key=value`` after the colon): see ``VARIANTS``.
``gap`` picks the verifier rule, and so the sign of the within-group
positive-minus-negative length gap; on the warm-up data (groups of 8,
continue_prob 0.6, at most 6 drafts; tests/test_drafts.py measures it) the
within-group length CV is ~0.60 for every rule and the relative gap is:

    neg: max_drafts:2 (~-0.60), none: answer (~0), pos: min_drafts:2 (~+0.60)

The warm-up traces do not depend on the rule (only their grades do), so the
three gaps share one warm-up per seed. The policy and RL sizes are
configs/chains.py's grid sizes; the held-out evaluation is larger (64
problems x 16 samples) so that its binomial noise is a small part of the
seed-to-seed spread.
"""
import os
import runpy
import types

from ba_jax.config import common
from ba_jax.tasks import drafts

chains_config = types.SimpleNamespace(**runpy.run_path(
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "chains.py")))
VARIANTS = {"gap": "neg|none|pos sign of the length gap (the rule)",
            "agg": "<aggregation mode>", "lr": "<float> RL peak learning rate",
            "steps": "<int> RL steps",
            "smoke": "a seconds-scale run for tests"}
RULES = {"neg": "max_drafts:2", "none": "answer", "pos": "min_drafts:2"}


def get_config(arg=None):
  args = common.parse_variants(arg, VARIANTS, "configs/drafts.py")
  gap = args.get("gap", "none")
  if gap not in RULES:
    raise ValueError(f"configs/drafts.py: gap={gap!r}; expected neg|none|pos")
  c = chains_config.get_config(f"agg={args['agg']}" if "agg" in args else None)
  c.model.max_position_embeddings = 128

  c.task = common.task(
      drafts.NAME,  # ba_jax/tasks/drafts.py; other keys at the schema's defaults
      rule=RULES[gap],  # answer | min_drafts:k | max_drafts:k
  )
  c.sft.update(steps=500, batch_size=32)
  c.rl.update(steps=int(args.get("steps", 20)), prompts_per_step=8)  # 8 x 8 responses
  c.rl.max_new_tokens = _budget(c.task)
  # Under min_drafts responses lengthen (1.5x in 20 steps); a response cut
  # at the budget has not chosen to stop, and where it was cut decides its
  # grade, so it is kept out of the loss.
  c.rl.overlong = "mask"
  c.optim.learning_rate = float(args.get("lr", 3e-4))
  # 64 of the 150 distinct problems (86 left to train on) x 16 samples
  c.eval.update(num_problems=64, samples_per_problem=16)
  c.checkpoint.every = 0
  c.log.update(progress_bar=False, backends="", samples_every=0)

  if args.get("smoke"):
    c.model.update(dict(hidden_size=32, intermediate_size=64, num_layers=2,
                        num_heads=2, num_kv_heads=1, head_dim=16))
    c.task.update(max_terms=2, max_drafts=3)
    c.sft.update(steps=20, batch_size=16)
    c.rl.update(steps=int(args.get("steps", 2)), prompts_per_step=4, group_size=4)
    c.rl.max_new_tokens = _budget(c.task)
    c.eval.update(num_problems=8, samples_per_problem=2)
  return c


def _budget(task) -> int:
  """The response budget: the longest warm-up trace plus room to lengthen."""
  return drafts.max_response_tokens(drafts.config_from(task)) + 28
