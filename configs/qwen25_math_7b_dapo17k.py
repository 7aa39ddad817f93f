"""The paper's first setting: Qwen2.5-Math-7B trained on DAPO-Math-17k.

    python -m ba_jax.train --config=configs/qwen25_math_7b_dapo17k.py:agg=balanced \\
        --config.init_from=/path/to/Qwen2.5-Math-7B \\
        --config.task.path=/path/to/dapo-math-17k.parquet \\
        --config.eval.data_dir=/path/to/eval --workdir=DIR

Every worker of a TPU pod runs it (experiments/launch/tpu_pod.sh); check
memory first with ``python -m ba_jax.dry_run`` and the same flags (README).

Variants: ``:agg=<mode>`` (token | sequence | dr_grpo | balanced, the
default) and ``:param_dtype=<dtype>`` (e.g. float32 master weights: ~120 GB for
the whole model with its AdamW moments before sharding). The recipe both
paper configs share (DAPO's where the paper is silent), and why float32
master weights can matter at lr 1e-6, are ``dapo_recipe`` in
configs/common.py. The model fields describe Qwen2.5-Math-7B for the dry run; a
run takes the architecture from ``init_from``'s config.json.

Qwen2.5-Math-7B was pre-trained with a 4096-token context
(max_position_embeddings 4096), far below 2048 + 20480 tokens; a smaller
budget (--config.rl.max_new_tokens=..., with a smaller overlong_buffer) is a
common choice for this model.
"""
import os
import runpy
import types

common = types.SimpleNamespace(**runpy.run_path(
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "common.py")))


def get_config(arg=None):
  c = common.paper_config(
      arg, "configs/qwen25_math_7b_dapo17k.py",
      model_type="qwen2", vocab_size=152064, hidden_size=3584,
      intermediate_size=18944, num_layers=28, num_heads=28, num_kv_heads=4,
      head_dim=128, rope_theta=10000.0, rms_norm_eps=1e-6,
      tie_word_embeddings=False,
      attention_bias=True,  # q/k/v bias, as every Qwen2 checkpoint has
      qk_norm=False, max_position_embeddings=4096)
  c.init_from = "/path/to/Qwen2.5-Math-7B"  # SET IT: config.json, *.safetensors
  c.task = common.math_task(
      name="dapo_math17k",  # read by ba_jax.data.load_dapo_math
      path="/path/to/dapo-math-17k",  # SET IT: parquet/jsonl or dataset dir
      dedup=True,  # the public copy repeats each prompt ~100 times
      template="answer",  # ba_jax.data.format_prompt: DAPO's Answer: prompt
      rule="answer",  # ba_jax.rewards rule: the last "Answer:" line
  )
  return c
