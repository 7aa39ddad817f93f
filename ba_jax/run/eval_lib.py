"""Benchmark evaluation: sample k responses per problem, grade them, report avg@k and pass@k.

Math benchmarks are graded by `rewards.score_math`; code benchmarks
(`ba_jax.tasks.code_data`: HumanEval+, MBPP+, LiveCodeBench) run their tests in the
sandbox through `rewards.score_code`, a sample counting as correct when it
passes every test; a sample that could not be judged (too large, not text, a
dead sandbox, a failed reference) counts as wrong and in `grader_rejected`.

pass@k is the unbiased estimator of Chen et al. (2021): with n samples of
which c are correct, pass@k = 1 - C(n-c, k) / C(n, k), averaged over problems.
avg@n is the mean accuracy over all n samples (= pass@1).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import time
from typing import Callable, Sequence

import numpy as np

from ba_jax.tasks import code_data
from ba_jax.tasks import data as data_lib
from ba_jax.tasks import rewards

GenerateFn = Callable[[Sequence[str], int], list]  # (prompts, n) -> [len(prompts)][n] strings


def pass_at_k(n: int, c: int, k: int) -> float:
  """Unbiased pass@k for one problem with `c` correct out of `n` samples (k <= n)."""
  if not 0 <= c <= n or not 1 <= k <= n:
    raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
  if n - c < k:
    return 1.0
  # 1 - prod_{i=n-c+1}^{n} (1 - k/i): the ratio of binomials without big integers.
  return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def default_ks(n: int) -> list[int]:
  ks = [1]
  while ks[-1] * 2 <= n:
    ks.append(ks[-1] * 2)
  if ks[-1] != n:
    ks.append(n)
  return ks


def summarize(correct_PxN: np.ndarray, ks: Sequence[int] | None = None) -> dict[str, float]:
  """avg@n and pass@k (averaged over problems) from a [problems, samples] boolean table."""
  correct_PxN = np.asarray(correct_PxN, dtype=bool)
  if correct_PxN.ndim != 2 or correct_PxN.shape[1] < 1:
    raise ValueError(f"correct must be [problems, samples] with samples >= 1, got {correct_PxN.shape}")
  num_problems, n = correct_PxN.shape
  counts = correct_PxN.sum(axis=1)
  out = {"num_problems": int(num_problems), "samples_per_problem": int(n),
         f"avg@{n}": float(correct_PxN.mean()) if num_problems else 0.0}
  for k in (ks or default_ks(n)):
    out[f"pass@{k}"] = float(np.mean([pass_at_k(n, int(c), k) for c in counts])) \
        if num_problems else 0.0
  return out


@dataclasses.dataclass(frozen=True)
class EvalSettings:
  n_samples: int = 4
  rule: str = "boxed"
  template: str = "boxed"
  ks: tuple[int, ...] | None = None
  grader_timeout_s: float = 10.0
  code_timeout_s: float = 10.0  # sandbox wall time per code test case


def evaluate_benchmarks(generate_fn: GenerateFn, benchmarks: dict[str, Sequence[data_lib.Example]],
                        settings: EvalSettings, *, tokenizer=None,
                        pool: rewards.RewardPool | None = None) -> dict:
  """Samples, grades and summarises every benchmark; returns a JSON-ready dict."""
  n = settings.n_samples
  results = {"settings": dataclasses.asdict(settings), "benchmarks": {}}
  for name, examples in benchmarks.items():
    if examples and isinstance(examples[0], code_data.CodeExample):
      results["benchmarks"][name] = evaluate_code(name, generate_fn, examples, settings,
                                                  tokenizer=tokenizer, pool=pool)
      continue
    start = time.monotonic()
    prompts = [data_lib.format_prompt(e, settings.template, tokenizer) for e in examples]
    responses = _generate(name, generate_fn, prompts, n)
    flat = [r for group in responses for r in group]
    truths = [e.answer for e in examples for _ in range(n)]
    batch = rewards.score_math(flat, truths, rule=settings.rule, pool=pool,
                               timeout_s=settings.grader_timeout_s if pool else None)
    correct_PxN = batch.correct.reshape(len(examples), n)
    summary = summarize(correct_PxN, settings.ks)
    summary.update(grader_timeouts=batch.timeouts, grader_errors=batch.errors,
                   seconds=round(time.monotonic() - start, 2))
    samples = [{"problem": e.problem, "answer": e.answer, "meta": _jsonable(e.meta),
                "responses": list(responses[i]), "extracted": batch.extracted[i * n:(i + 1) * n],
                "correct": correct_PxN[i].tolist()} for i, e in enumerate(examples)]
    results["benchmarks"][name] = {"summary": summary, "samples": samples}
    logging.getLogger(__name__).info("%s: %s", name, summary)
  return results


def _generate(name, generate_fn, prompts, n) -> list:
  responses = generate_fn(prompts, n)
  if len(responses) != len(prompts) or any(len(r) != n for r in responses):
    raise ValueError(f"{name}: generate_fn must return {len(prompts)} lists of {n} responses, "
                     f"got {[len(r) for r in responses]}")
  return responses


def code_limits(settings: EvalSettings):
  from ba_jax.sandboxing import sandbox
  return sandbox.SandboxLimits(wall_time_s=settings.code_timeout_s,
                               cpu_time_s=max(1, int(np.ceil(settings.code_timeout_s))))


def grade_code(examples: Sequence[code_data.CodeExample], responses: Sequence[Sequence[str]], *,
               limits=None, pool: rewards.RewardPool | None = None) -> rewards.RewardBatch:
  """Runs every response (row-major: problem, then sample) against its problem's tests."""
  code_data.check_test_imports(list(examples))
  programs, tests = [], []
  for example, group in zip(examples, responses):
    for response in group:
      programs.append(code_data.program_for(example, response))
      tests.append(list(example.tests))
  return rewards.score_code(programs, tests, pool=pool, limits=limits)


def evaluate_code(name: str, generate_fn: GenerateFn, examples: Sequence[code_data.CodeExample],
                  settings: EvalSettings, *, tokenizer=None,
                  pool: rewards.RewardPool | None = None) -> dict:
  """Samples and sandbox-grades one code benchmark: {"summary", "samples"}."""
  n, start = settings.n_samples, time.monotonic()
  prompts = [code_data.format_code_prompt(e, settings.template, tokenizer) for e in examples]
  responses = _generate(name, generate_fn, prompts, n)
  batch = grade_code(examples, responses, limits=code_limits(settings), pool=pool)
  correct_PxN = batch.correct.reshape(len(examples), n)
  summary = summarize(correct_PxN, settings.ks)
  summary.update(grader_timeouts=batch.timeouts, grader_errors=batch.errors,
                 grader_rejected=dict(batch.rejected),  # samples scored 0 unjudged, by reason
                 memory_exceeded=batch.memory_exceeded,
                 seconds=round(time.monotonic() - start, 2))
  samples = [{"task_id": e.task_id, "meta": _jsonable(e.meta), "responses": list(responses[i]),
              "tests_passed": batch.scores[i * n:(i + 1) * n].tolist(),
              "first_failure": batch.messages[i * n:(i + 1) * n],
              "correct": correct_PxN[i].tolist()} for i, e in enumerate(examples)]
  logging.getLogger(__name__).info("%s: %s", name, summary)
  return {"summary": summary, "samples": samples}


def _jsonable(value):
  return json.loads(json.dumps(value, default=str))


def markdown_table(results: dict) -> str:
  summaries = {name: b["summary"] for name, b in results["benchmarks"].items()}
  if not summaries:
    return "(no benchmarks)\n"
  columns = [c for c in next(iter(summaries.values())) if c.startswith(("avg@", "pass@"))]
  lines = ["| benchmark | problems | " + " | ".join(columns) + " |",
           "|---|---:|" + "---:|" * len(columns)]
  for name, s in summaries.items():
    cells = " | ".join(f"{100 * s.get(c, float('nan')):.1f}" for c in columns)
    lines.append(f"| {name} | {s['num_problems']} | {cells} |")
  settings = results.get("settings", {})
  lines.append("")
  lines.append("Scores in percent. " + ", ".join(f"{k}={v}" for k, v in settings.items()))
  return "\n".join(lines) + "\n"


def write_results(results: dict, output_dir: str) -> tuple[str, str]:
  """Writes results.json (with every sample) and results.md (the table); `output_dir` may be
  a URL (`ba_jax.run.paths`)."""
  from ba_jax.run import paths
  json_path = paths.path(output_dir) / "results.json"
  md_path = paths.path(output_dir) / "results.md"
  paths.write_json(json_path, results)
  paths.write_text(md_path, markdown_table(results))
  return str(json_path), str(md_path)


# ----------------------------------------------------------------------------- model side


def load_policy(model_path: str, *, step: int | None = None, dtype: str = "float32"):
  """(model, model_config, tokenizer) from a trainer workdir or a Hugging Face directory
  (either may be a URL such as gs://..., read through `ba_jax.run.paths`)."""
  from ba_jax.run import paths
  from ba_jax.run import workdir as workdir_lib
  # A workdir first: it also holds a config.json (the run's), which is not a HF config.
  if workdir_lib.is_workdir(model_path):
    model, config, tokenizer = workdir_lib.restore_policy(model_path, step=step)
    if tokenizer is None:
      raise ValueError(f"{model_path}: the trainer workdir holds no tokenizer; export it "
                       "with `python -m ba_jax.export` and evaluate the exported directory")
    return model, config, tokenizer
  if (paths.path(model_path) / "config.json").is_file():
    from transformers import AutoTokenizer
    from ba_jax.policy import hf
    local = paths.local(model_path)
    model, config = hf.load_pretrained(local, dtype=dtype)
    return model, config, AutoTokenizer.from_pretrained(local)
  raise ValueError(f"--model={model_path!r} is neither a Hugging Face directory (config.json) "
                   "nor a trainer workdir (model_config.json and checkpoints/)")


def _stop_ids(tokenizer, config) -> tuple[int, ...]:
  ids = set()
  for value in (getattr(tokenizer, "eos_token_id", None), getattr(config, "eos_token_id", None)):
    if isinstance(value, (list, tuple)):
      ids.update(int(v) for v in value)
    elif value is not None:
      ids.add(int(value))
  if not ids:
    raise ValueError("neither the tokenizer nor the model config names an eos token")
  return tuple(sorted(ids))


def make_generate_fn(model, config, tokenizer, *, max_new_tokens: int, temperature: float = 0.6,
                     top_p: float = 1.0, top_k: int = 0, batch_size: int = 8, seed: int = 0,
                     add_special_tokens: bool = True, max_slots: int | None = None,
                     prefill_chunk: int = 0, cache_phases: int = 0) -> GenerateFn:
  """A `GenerateFn` that samples through `ba_jax.generation.sampler.sample_groups` (`max_slots`,
  `prefill_chunk`, `cache_phases`: its continuous-batching and cache options)."""
  import jax
  from ba_jax.generation import sampler

  eos_ids = _stop_ids(tokenizer, config)
  pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
  calls = [0]

  def generate(prompts: Sequence[str], n: int) -> list[list[str]]:
    out = []
    for start in range(0, len(prompts), batch_size):
      chunk = list(prompts[start:start + batch_size])
      real = len(chunk)
      chunk += [chunk[0]] * (batch_size - real)  # a fixed batch shape: no recompilation
      encoded = [tokenizer(p, add_special_tokens=add_special_tokens)["input_ids"] for p in chunk]
      width = max(len(e) for e in encoded)
      ids = np.full((len(chunk), width), pad_id, np.int32)
      mask = np.zeros((len(chunk), width), np.int32)
      for i, e in enumerate(encoded):  # left padding
        ids[i, width - len(e):] = e
        mask[i, width - len(e):] = 1
      rng = jax.random.fold_in(jax.random.key(seed), calls[0])
      calls[0] += 1
      result = sampler.sample_groups(
          model, ids, mask, group_size=n, max_new_tokens=max_new_tokens, temperature=temperature,
          top_p=top_p, top_k=top_k, eos_id=eos_ids, pad_id=pad_id, rng=rng, max_slots=max_slots,
          prefill_chunk=prefill_chunk, cache_phases=cache_phases)
      tokens = np.asarray(result.tokens)
      lengths = np.asarray(result.lengths)
      texts = [tokenizer.decode(tokens[r, :lengths[r]].tolist(), skip_special_tokens=True)
               for r in range(real * n)]
      out.extend(texts[i * n:(i + 1) * n] for i in range(real))
    return out

  return generate


def load_benchmark(benchmark: str, data_dir: str) -> tuple[str, list]:
  """(canonical name, examples) of a math (`data.EVAL_SETS`) or code
  (`code_data.CODE_SETS`) benchmark."""
  if code_data.is_code_benchmark(benchmark):
    name = code_data.canonical_code_name(benchmark)
    return name, code_data.load_code_set(name, data_dir)
  try:
    name = data_lib.canonical_eval_name(benchmark)
  except ValueError:
    raise ValueError(f"unknown benchmark {benchmark!r}; expected one of "
                     f"{sorted(data_lib.EVAL_SETS) + list(code_data.CODE_SETS)}") from None
  return name, list(data_lib.load_eval_set(name, data_dir))


def run_evaluation(model_path: str, benchmarks: Sequence[str], data_dir: str, output_dir: str, *,
                   settings: EvalSettings, max_new_tokens: int = 1024, temperature: float = 0.6,
                   top_p: float = 1.0, top_k: int = 0, batch_size: int = 8, seed: int = 0,
                   step: int | None = None, num_workers: int = 2,
                   limit: int | None = None, max_slots: int = 0, prefill_chunk: int = 0,
                   cache_phases: int = 0) -> dict:
  """Loads the policy and the benchmarks, evaluates, writes results.json and results.md.

  `max_slots` > 0 samples through the continuous-batching engine with that many decode slots
  (its KV cache holds `max_slots` rows whatever `batch_size` x k is); same samples as 0.
  """
  from ba_jax.run import paths
  sets = {}
  for benchmark in benchmarks:
    name, examples = load_benchmark(benchmark, data_dir)
    sets[name] = examples[:limit] if limit else examples
  model, config, tokenizer = load_policy(model_path, step=step)
  generate = make_generate_fn(model, config, tokenizer, max_new_tokens=max_new_tokens,
                              temperature=temperature, top_p=top_p, top_k=top_k,
                              batch_size=batch_size, seed=seed,
                              add_special_tokens=settings.template != "chat", max_slots=max_slots,
                              prefill_chunk=prefill_chunk, cache_phases=cache_phases)
  with rewards.RewardPool(num_workers=num_workers, timeout_s=settings.grader_timeout_s) as pool:
    results = evaluate_benchmarks(generate, sets, settings, tokenizer=tokenizer, pool=pool)
  results["model"] = str(paths.path(model_path))
  results["sampling"] = {"max_new_tokens": max_new_tokens, "temperature": temperature,
                         "top_p": top_p, "top_k": top_k, "seed": seed, "max_slots": max_slots}
  write_results(results, output_dir)
  return results
