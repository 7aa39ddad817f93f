"""PROPOSAL for configs/chains.py (not imported anywhere; it runs once the task
registry of ``ba_jax/tasks.py`` knows ``synthetic_chains`` -> ``ba_jax.chains.ChainsTask``
and ``sft.task_response`` asks the task for its warm-up trace).

The length-controlled task (ba_jax/chains.py) on a ~1M-parameter Qwen3-style
policy: supervised warm-up, then GRPO.

    python -m ba_jax.train --config=configs/chains.py:spread=high,gap=pos,agg=balanced \
        --workdir=/tmp/chains

Variants (comma separated ``key=value`` after the colon):

    spread=low|high   chain counts (4, 5): within-group length CV ~0.09;
                      (1, 2, 8): ~0.60 (measured on the warm-up data)
    gap=neg|none|pos  the verifier rule, and so the sign of the within-group
                      positive-minus-negative length gap on the warm-up data:
                        high: max_chains:2 (-0.65), answer (+0.03), min_chains:2 (+0.45)
                        low:  max_chains:4 (-0.12), answer (+0.01), min_chains:5 (+0.12)
                      (relative to the group's mean length; a low spread
                      caps the gap, since r is the only length source)
    agg=<mode>        token | sequence | dr_grpo | balanced
    lr=<float>        RL peak learning rate (stress: raise it)
    quick             a few-minute run of one cell
    smoke             a few-second run for tests

Figures: warm-up data, 400 problems x 8 responses, seed 0, computed with
tests/test_chains.py's group_lengths and within_group_gap (means over groups).
"""
import importlib.util
import os

import ml_collections

CHAIN_COUNTS = {"low": "4,5", "high": "1,2,8"}
RULES = {  # (spread, gap) -> task.rule
    ("low", "neg"): "max_chains:4", ("low", "none"): "answer",
    ("low", "pos"): "min_chains:5",
    ("high", "neg"): "max_chains:2", ("high", "none"): "answer",
    ("high", "pos"): "min_chains:2",
}


def _tiny_config(arg):
  """configs/tiny.py's config, the base this one edits."""
  here = os.path.dirname(os.path.abspath(__file__))
  for path in (os.path.join(here, "tiny.py"),
               os.path.join(here, os.pardir, "configs", "tiny.py")):
    if os.path.isfile(path):
      spec = importlib.util.spec_from_file_location("_tiny_config", path)
      module = importlib.util.module_from_spec(spec)
      spec.loader.exec_module(module)
      return module.get_config(arg)
  raise FileNotFoundError(f"configs/tiny.py not found next to {here}")


def _parse(arg):
  out = {}
  for item in filter(None, (arg or "").split(",")):
    key, _, value = item.partition("=")
    out[key] = value if value else True
  return out


def get_config(arg=None):
  args = _parse(arg)
  unknown = set(args) - {"spread", "gap", "agg", "lr", "quick", "smoke"}
  if unknown:
    raise ValueError(f"chains config: unknown variant(s) {sorted(unknown)} in "
                     f"{arg!r}; expected spread=low|high, gap=neg|none|pos, "
                     "agg=<mode>, lr=<float>, quick, smoke")
  spread, gap = args.get("spread", "high"), args.get("gap", "none")
  if spread not in CHAIN_COUNTS or gap not in ("neg", "none", "pos"):
    raise ValueError(f"chains config: spread={spread!r}, gap={gap!r}; expected "
                     "spread=low|high and gap=neg|none|pos")
  c = _tiny_config(f"agg={args['agg']}" if "agg" in args else None)

  # ~0.99M parameters: 5 layers x (49k attention + 147k MLP) + 4k embedding.
  c.model.update(dict(hidden_size=128, intermediate_size=384, num_layers=5,
                      num_heads=4, num_kv_heads=2, head_dim=32,
                      max_position_embeddings=128))

  # ba_jax/chains.py; max_response_tokens: 102 for (1, 2, 8), 69 for (4, 5).
  c.task = ml_collections.ConfigDict(dict(
      name="synthetic_chains",
      min_terms=2,  # numbers in the prompt: 2 or 3
      max_terms=3,
      max_value=9,  # single digits
      chain_counts=CHAIN_COUNTS[spread],  # warm-up draws r uniformly from these
      rule=RULES[(spread, gap)],  # answer | min_chains:k | max_chains:k
      sft_correct_frac=0.5,  # error-free warm-up traces (the rule may still fail them)
      grader="builtin",  # the chain rules are this task's own
      max_prompt_len=8,  # "9+9+9=" is 6 tokens
  ))
  c.sft.steps = 800
  c.rl.max_new_tokens = 112  # above max_response_tokens, so RL can lengthen
  c.rl.overlong_buffer = 16
  c.optim.learning_rate = float(args.get("lr", 3e-4))  # tiny.py's 1e-4 x 3: stress
  c.eval.num_problems = 128

  if args.get("quick"):
    c.sft.steps = 300
    c.rl.steps = 30
    c.eval.num_problems = 64
    c.log.progress_bar = False
  if args.get("smoke"):
    c.model.update(dict(hidden_size=32, intermediate_size=64, num_layers=2,
                        num_heads=2, num_kv_heads=1, head_dim=16))
    c.task.chain_counts = "1,2"
    c.task.rule = {"neg": "max_chains:1", "none": "answer",
                   "pos": "min_chains:2"}[gap]
    c.sft.steps, c.sft.batch_size = 20, 16
    c.rl.steps, c.rl.prompts_per_step, c.rl.group_size = 3, 4, 4
    c.rl.max_new_tokens = 40
    c.eval.num_problems, c.eval.samples_per_problem = 8, 2
    c.checkpoint.every = 2
    c.log.progress_bar = False
  return c
