"""The paper's second setting: Qwen3-1.7B trained on Polaris-53K.

    python -m ba_jax.train --config=configs/qwen3_1p7b_polaris.py:agg=balanced \\
        --config.init_from=/path/to/Qwen3-1.7B \\
        --config.task.path=/path/to/polaris-53k.jsonl \\
        --config.eval.data_dir=/path/to/eval --workdir=DIR

Every worker of a TPU pod runs it (experiments/launch/tpu_pod.sh); check
memory first with ``python -m ba_jax.dry_run`` and the same flags (README).

Variants: ``:agg=<mode>`` (token | sequence | dr_grpo | balanced, the
default), ``:param_dtype=<dtype>`` (float32 master weights by default: ~28 GB
for the whole model with its AdamW moments before sharding) and
``:runlocal`` (a few steps on this CPU: a tiny random qwen3 model on the
bundled synthetic task, ``ba_jax/config/common.py:runlocal``)::

    python -m ba_jax.train --config=configs/qwen3_1p7b_polaris.py:runlocal \\
        --workdir=/tmp/runlocal_1p7b

The recipe both paper configs share (DAPO's where the paper is silent),
with its citation and how its warm-up was converted, is ``dapo_recipe`` in
ba_jax/config/common.py.

Lengths: a 2048-token prompt and a 20480-token response with a 4096-token
soft overlong buffer, DAPO's published lengths (the DAPO paper's recipe;
Qwen3-1.7B's 40960-token context holds them). Polaris's own recipe trains
with longer, staged response budgets for Qwen3-4B; we did not verify a
published Polaris script for Qwen3-1.7B, so these lengths are our choice
(DAPO's), not a Polaris citation. The model fields describe Qwen3-1.7B for the dry run; a
run takes the architecture from ``init_from``'s config.json.

Polaris-specific: prompts end in the \\boxed{} instruction and answers
are read from the last \\boxed{}; problems are filtered by their difficulty
field (a pass rate such as "3/8"), dropping those solved every time.
"""

from ml_collections import config_dict
from ba_jax.config import common



def get_config(arg=None):
  c, args = common.paper_config(
      arg, "configs/qwen3_1p7b_polaris.py",
      model_type="qwen3", vocab_size=151936, hidden_size=2048,
      intermediate_size=6144, num_layers=28, num_heads=16, num_kv_heads=8,
      head_dim=128, rope_theta=1000000.0, rms_norm_eps=1e-6,
      tie_word_embeddings=True, attention_bias=False,
      qk_norm=True,  # RMSNorm on q and k per head (Qwen3)
      max_position_embeddings=40960)
  c.init_from = "/path/to/Qwen3-1.7B"  # SET IT: config.json, *.safetensors
  c.task = common.math_task(
      name="polaris",  # read by ba_jax.tasks.data.load_polaris
      path="/path/to/polaris-53k.jsonl",  # SET IT: the Polaris-53K jsonl
      # Keep problems whose difficulty (pass rate of a reference model,
      # e.g. "3/8") is within [min, max]; None = no bound. 7/8 drops the
      # problems solved every time, which give all-equal groups.
      min_difficulty=config_dict.placeholder(float),
      max_difficulty=0.875,
      # ba_jax.tasks.data.format_prompt: the problem and the \\boxed{} request;
      # "chat" wraps the same text in the tokenizer's chat template.
      template="boxed",
      rule="boxed",  # ba_jax.tasks.rewards rule: the last \\boxed{...}
      max_prompt_len=2048,  # prompt tokens, left-padded
  )
  c.rl.update(max_new_tokens=20480, overlong_buffer=4096)  # DAPO's
  # Rollouts through the continuous-batching engine with 12.5 GiB of KV
  # cache per device: 20 slots per device (616 MiB each: 22527 positions x
  # 28 layers x 2 of 8 kv heads on the tensor axis x 128 x 2 bytes x k and
  # v), 320 on the 16 batch shards of the 64-chip mesh. Set from the TPU
  # compiler's verdict (`python -m ba_jax.dry_run --config=<this file>
  # --target=v5e:8x8`): the engine plus the trainer's resident AdamW moments
  # use 13.99 GiB (LoRA: 14.33) of a v5e chip's 15.75, 11% (9%) free. A 21st
  # slot (`--config.rl.kv_cache_gib=12.75`) also compiles, with 7% free in
  # both; 20 leaves room for the decode step's own buffers. Larger chips fit
  # it with room to spare (docs/scaling.md has the table).
  c.rl.kv_cache_gib = 12.5
  if args.get("runlocal"):
    common.runlocal(c)
  return c
