"""The paper's first setting: Qwen2.5-Math-7B trained on DAPO-Math-17k.

    python -m ba_jax.train --config=configs/qwen25_math_7b_dapo17k.py:agg=balanced \\
        --config.init_from=/path/to/Qwen2.5-Math-7B \\
        --config.task.path=/path/to/dapo-math-17k.parquet \\
        --config.eval.data_dir=/path/to/eval --workdir=DIR

Every worker of a TPU pod runs it (experiments/launch/tpu_pod.sh); check
memory first with ``python -m ba_jax.dry_run`` and the same flags (README).

Variants: ``:agg=<mode>`` (token | sequence | dr_grpo | balanced, the
default), ``:param_dtype=<dtype>`` (float32 master weights by default: ~120 GB
for the whole model with its AdamW moments before sharding; bfloat16 halves
the weights) and ``:runlocal`` (a few steps on this CPU: a tiny random qwen2
model on the bundled synthetic task, ``ba_jax/config/common.py:runlocal``)::

    python -m ba_jax.train --config=configs/qwen25_math_7b_dapo17k.py:runlocal \\
        --workdir=/tmp/runlocal_7b

The recipe both paper configs share (DAPO's where the paper is silent),
with its citation and how its warm-up was converted, is ``dapo_recipe`` in
ba_jax/config/common.py. The model fields describe Qwen2.5-Math-7B for the dry
run; a run takes the architecture from ``init_from``'s config.json.

Lengths: Qwen2.5-Math-7B has a 4096-token context (max_position_embeddings
4096), so prompt + response must fit 4096. The prompt budget is 1024 tokens
as in Oat-Zero / Dr. GRPO's published script for this model
(sail-sg/understand-r1-zero, examples/qwen2.5-math-7b.sh:
--prompt_max_length 1024 --generate_max_length 3000, lr 1e-6 constant).
The response budget, 3072 = 4096 - 1024 (the rest of the context), and
the 512-token soft overlong buffer (DAPO's 4096 of 20480 scaled to this
budget, rounded) are our choices. DAPO's own verl script for this model
(verl recipe/dapo/test_dapo_7b_math.sh) instead uses 2048 + 8192 tokens
with a 4096 buffer by overriding max_position_embeddings to 32768, which
runs the model beyond its trained context.
"""
from ba_jax.config import common



def get_config(arg=None):
  c, args = common.paper_config(
      arg, "configs/qwen25_math_7b_dapo17k.py",
      model_type="qwen2", vocab_size=152064, hidden_size=3584,
      intermediate_size=18944, num_layers=28, num_heads=28, num_kv_heads=4,
      head_dim=128, rope_theta=10000.0, rms_norm_eps=1e-6,
      tie_word_embeddings=False,
      attention_bias=True,  # q/k/v bias, as every Qwen2 checkpoint has
      qk_norm=False, max_position_embeddings=4096)
  c.init_from = "/path/to/Qwen2.5-Math-7B"  # SET IT: config.json, *.safetensors
  c.task = common.math_task(
      name="dapo_math17k",  # read by ba_jax.tasks.data.load_dapo_math
      path="/path/to/dapo-math-17k",  # SET IT: parquet/jsonl or dataset dir
      dedup=True,  # the public copy repeats each prompt ~100 times
      template="answer",  # ba_jax.tasks.data.format_prompt: DAPO's Answer: prompt
      rule="answer",  # ba_jax.tasks.rewards rule: the last "Answer:" line
      max_prompt_len=1024,  # prompt tokens, left-padded (see the docstring)
  )
  # 1024 + 3072 = the model's 4096-token context (see the docstring).
  c.rl.update(max_new_tokens=3072, overlong_buffer=512)
  # Rollouts through the continuous-batching engine with 11 GiB of KV cache
  # per device: 201 slots per device (56 MiB each: 4095 positions x 28
  # layers x 1 of 4 kv heads on the tensor axis x 128 x 2 bytes x k and v),
  # 3216 on the 16 batch shards of the 64-chip mesh. Set from the TPU
  # compiler's verdict (`python -m ba_jax.dry_run --config=<this file>
  # --target=v5e:8x8`): the engine plus the trainer's resident AdamW moments
  # use 14.84 of a v5e chip's 15.75 GiB (5.8% free; 203 slots is the most
  # that keeps 5%), and larger chips fit it with room to spare
  # (docs/scaling.md has the table for v5e, v6e, v5p and H100).
  c.rl.kv_cache_gib = 11.0
  if args.get("runlocal"):
    common.runlocal(c)
  return c
