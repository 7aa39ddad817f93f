"""Evaluates a policy on math and code benchmarks: avg@k and pass@k, as JSON and a markdown table.

    python -m ba_jax.evaluate --model=<HF dir or trainer workdir> \
        --benchmarks=aime24,aime25,amc23,math500,minerva,olympiadbench \
        --data_dir=<dir with aime24.jsonl, ...> --k=16 --output_dir=<dir>

    python -m ba_jax.evaluate --model=... --benchmarks=humanevalplus,mbppplus,livecodebench \
        --data_dir=<dir with HumanEvalPlus-*.jsonl, MbppPlus-*.jsonl, livecodebench.jsonl> \
        --template=chat --k=8 --output_dir=<dir>

`--k` is the number of samples per problem (n); pass@1, 2, 4, ..., n are
reported with the unbiased estimator, and avg@n. Code benchmarks
(`ba_jax.tasks.code_data`) run their tests in `ba_jax.sandboxing.sandbox`; a sample is correct
when it passes all of them. With `--template=chat` a code prompt is an
instruction in the chat template; otherwise the completion prompt (the
function prompt, or the question with an opened code fence). Logic:
`ba_jax.run.eval_lib`.

A trainer workdir's checkpoint is verified as `python -m ba_jax.export`
verifies it: a damaged newest step is named in a one-line warning and the
newest intact one is evaluated; with none intact the command exits 2 with
one line.
"""
import sys

from absl import app, flags

from ba_jax.run import eval_lib

_MODEL = flags.DEFINE_string("model", None, "Hugging Face directory or trainer workdir.", required=True)
_BENCHMARKS = flags.DEFINE_list("benchmarks", ["aime24", "aime25", "amc23", "math500", "minerva",
                                               "olympiadbench"], "Benchmarks to run.")
_DATA_DIR = flags.DEFINE_string("data_dir", None, "Directory holding <benchmark>.jsonl files "
                                "(or a single file when one benchmark is given).", required=True)
_K = flags.DEFINE_integer("k", 4, "Samples per problem.")
_PASS_KS = flags.DEFINE_list("pass_ks", [], "pass@k values to report (default 1, 2, 4, ..., k).")
_OUTPUT_DIR = flags.DEFINE_string("output_dir", None, "Where results.json/.md go.", required=True)
_RULE = flags.DEFINE_enum("rule", "boxed", ["boxed", "answer"], "Answer extraction rule.")
_TEMPLATE = flags.DEFINE_enum("template", "boxed", ["boxed", "answer", "chat"], "Prompt template.")
_MAX_NEW_TOKENS = flags.DEFINE_integer("max_new_tokens", 1024, "Response budget.")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.6, "Sampling temperature (0 = greedy).")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass.")
_TOP_K = flags.DEFINE_integer("top_k", 0, "Top-k sampling (0 = off).")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 8, "Prompts per sampler call.")
_MAX_SLOTS = flags.DEFINE_integer(
    "max_slots", 0, "Decode slots of the continuous-batching engine (0: every row of a call at"
    " once); the KV cache then holds this many rows, whatever batch_size x k is.", lower_bound=0)
_PREFILL_CHUNK = flags.DEFINE_integer(
    "prefill_chunk", 0, "The engine prefills prompts this many tokens at a time (0: whole).",
    lower_bound=0)
_CACHE_PHASES = flags.DEFINE_integer(
    "cache_phases", 0, "Cache lengths a decode loop runs through (0: the backend's default).",
    lower_bound=0)
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step of a trainer workdir (default: latest).")
_NUM_WORKERS = flags.DEFINE_integer("num_workers", 2, "Grader processes.")
_GRADER_TIMEOUT = flags.DEFINE_float("grader_timeout_s", 10.0, "Seconds per graded response.")
_CODE_TIMEOUT = flags.DEFINE_float("code_timeout_s", 10.0,
                                   "Sandbox wall-clock seconds per code test case.")
_LIMIT = flags.DEFINE_integer("limit", None, "Only the first N problems of each benchmark.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  settings = eval_lib.EvalSettings(
      n_samples=_K.value, rule=_RULE.value, template=_TEMPLATE.value,
      ks=tuple(int(k) for k in _PASS_KS.value) or None, grader_timeout_s=_GRADER_TIMEOUT.value,
      code_timeout_s=_CODE_TIMEOUT.value)
  from ba_jax.run import checkpointing
  try:
    results = eval_lib.run_evaluation(
        _MODEL.value, _BENCHMARKS.value, _DATA_DIR.value, _OUTPUT_DIR.value, settings=settings,
        max_new_tokens=_MAX_NEW_TOKENS.value, temperature=_TEMPERATURE.value,
        top_p=_TOP_P.value, top_k=_TOP_K.value, batch_size=_BATCH_SIZE.value, seed=_SEED.value,
        step=_STEP.value, num_workers=_NUM_WORKERS.value, limit=_LIMIT.value,
        max_slots=_MAX_SLOTS.value, prefill_chunk=_PREFILL_CHUNK.value,
        cache_phases=_CACHE_PHASES.value)
  except checkpointing.NoIntactCheckpoint as e:
    print(f"error: {e}", file=sys.stderr, flush=True)
    sys.exit(2)
  print(eval_lib.markdown_table(results))


if __name__ == "__main__":
  app.run(main)
