"""pass@k / avg@k maths, the benchmark loop and its outputs, and an end-to-end CLI run."""
import itertools
import json
import math
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from ba_jax.tasks import data
from ba_jax.run import eval_lib

EVAL_DIR = pathlib.Path(__file__).parent / "fixtures" / "eval"


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_pass_at_k_matches_the_closed_form_and_enumeration(n):
  for c in range(n + 1):
    for k in range(1, n + 1):
      closed = 1.0 - math.comb(n - c, k) / math.comb(n, k)
      # Enumerate every k-subset of n samples (c of them correct): the fraction with a success.
      samples = [True] * c + [False] * (n - c)
      subsets = list(itertools.combinations(samples, k))
      enumerated = sum(any(s) for s in subsets) / len(subsets)
      estimate = eval_lib.pass_at_k(n, c, k)
      assert abs(estimate - closed) < 1e-12 and abs(estimate - enumerated) < 1e-12, (n, c, k)
  assert eval_lib.pass_at_k(n, 0, 1) == 0.0 and eval_lib.pass_at_k(n, n, n) == 1.0


def test_pass_at_k_rejects_bad_arguments():
  with pytest.raises(ValueError, match="n=4, c=5, k=1"):
    eval_lib.pass_at_k(4, 5, 1)
  with pytest.raises(ValueError, match="n=4, c=1, k=5"):
    eval_lib.pass_at_k(4, 1, 5)


def test_summarize_averages_over_problems():
  correct = np.array([[1, 0, 0, 0], [1, 1, 0, 1], [0, 0, 0, 0]], bool)
  s = eval_lib.summarize(correct)
  assert eval_lib.default_ks(4) == [1, 2, 4] and eval_lib.default_ks(6) == [1, 2, 4, 6]
  assert s["num_problems"] == 3 and s["samples_per_problem"] == 4
  assert abs(s["avg@4"] - 4 / 12) < 1e-12
  assert abs(s["pass@1"] - s["avg@4"]) < 1e-12  # pass@1 is the mean accuracy
  expected_p2 = np.mean([1 - math.comb(3, 2) / math.comb(4, 2), 1 - 0 / math.comb(4, 2), 0.0])
  assert abs(s["pass@2"] - expected_p2) < 1e-12
  assert abs(s["pass@4"] - 2 / 3) < 1e-12


def fake_generate(prompts, n):
  """Sample j of problem i is correct iff j < i (so problem i has min(i, n) correct)."""
  answers = {"Every morning Aya": "204", "There exist real": "25", "Find the sum of all": "70",
             "On $\\triangle ABC$": "588"}
  out = []
  for i, prompt in enumerate(prompts):
    truth = next(a for key, a in answers.items() if key in prompt)
    out.append([f"... so \\boxed{{{truth if j < i else 'wrong'}}}" for j in range(n)])
  return out


def test_benchmark_loop_and_outputs(tmp_path):
  sets = {name: data.load_eval_set(name, str(EVAL_DIR)) for name in ("aime24", "aime25")}
  settings = eval_lib.EvalSettings(n_samples=2, rule="boxed", template="boxed")
  results = eval_lib.evaluate_benchmarks(fake_generate, sets, settings)
  for name in sets:  # problem 0: 0 of 2 correct, problem 1: 1 of 2 correct
    summary = results["benchmarks"][name]["summary"]
    assert summary["avg@2"] == 0.25 and summary["pass@1"] == 0.25 and summary["pass@2"] == 0.5
    assert summary["grader_timeouts"] == 0 and summary["grader_errors"] == 0
    samples = results["benchmarks"][name]["samples"]
    assert [s["correct"] for s in samples] == [[False, False], [True, False]]
  json_path, md_path = eval_lib.write_results(results, str(tmp_path / "out"))
  assert json.loads(pathlib.Path(json_path).read_text()) == json.loads(json.dumps(results))
  table = pathlib.Path(md_path).read_text().splitlines()
  assert table[0] == "| benchmark | problems | avg@2 | pass@1 | pass@2 |"
  assert table[2] == "| aime24 | 2 | 25.0 | 25.0 | 50.0 |"
  assert table[3] == "| aime25 | 2 | 25.0 | 25.0 | 50.0 |"


def test_benchmark_loop_checks_generate_output():
  sets = {"aime24": data.load_eval_set("aime24", str(EVAL_DIR))}
  with pytest.raises(ValueError, match="aime24: generate_fn must return 2 lists of 3 responses"):
    eval_lib.evaluate_benchmarks(lambda p, n: [["x"]] * len(p), sets,
                                 eval_lib.EvalSettings(n_samples=3))


@pytest.mark.slow
def test_cli_end_to_end_on_a_tiny_random_model(tmp_path):
  import model_utils
  model_dir = model_utils.save_tiny_model("qwen2", tmp_path / "model")
  out = tmp_path / "eval"
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p),
             XLA_FLAGS="--xla_force_host_platform_device_count=1", JAX_PLATFORMS="cpu")
  cmd = [sys.executable, "-m", "ba_jax.evaluate", f"--model={model_dir}",
         "--benchmarks=aime24,amc23", f"--data_dir={EVAL_DIR}", "--k=3", "--pass_ks=1,3",
         f"--output_dir={out}", "--max_new_tokens=6", "--temperature=1.0", "--batch_size=2",
         "--num_workers=1", "--template=chat"]
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
  assert proc.returncode == 0, proc.stderr[-3000:]
  results = json.loads((out / "results.json").read_text())
  assert set(results["benchmarks"]) == {"aime24", "amc23"}
  for name, count in (("aime24", 2), ("amc23", 3)):
    bench = results["benchmarks"][name]
    summary = bench["summary"]
    assert summary["num_problems"] == count and summary["samples_per_problem"] == 3
    assert len(bench["samples"]) == count
    correct = np.array([s["correct"] for s in bench["samples"]], bool)
    assert correct.shape == (count, 3)
    assert all(len(s["responses"]) == 3 and all(isinstance(r, str) for r in s["responses"])
               for s in bench["samples"])
    # The stored summary is the estimator applied to the stored per-sample grades.
    recomputed = eval_lib.summarize(correct, (1, 3))
    for key in ("avg@3", "pass@1", "pass@3"):
      assert abs(summary[key] - recomputed[key]) < 1e-12
  # Six new tokens from a character-level tokenizer: no response can be longer.
  assert max(len(r) for b in results["benchmarks"].values() for s in b["samples"]
             for r in s["responses"]) <= 6
  assert "| aime24 | 2 |" in (out / "results.md").read_text()
  assert "| amc23 | 3 |" in proc.stdout


@pytest.mark.slow
def test_evaluation_through_the_engine_gives_the_same_samples(tmp_path, monkeypatch):
  """`max_slots` (the CLI's --max_slots) sends the evaluator's sampling through the
  continuous-batching engine: its slots, not batch_size x k rows, and the same responses."""
  import model_utils
  from ba_jax.generation import engine
  model_dir = model_utils.save_tiny_model("qwen2", tmp_path / "model")
  slots, real = [], engine.engine_jit
  monkeypatch.setattr(engine, "engine_jit", lambda *a, **k: slots.append(k["cfg"].slots) or real(*a, **k))
  kw = dict(settings=eval_lib.EvalSettings(n_samples=3, template="chat"), max_new_tokens=6,
            temperature=1.0, batch_size=2, num_workers=1, seed=3)
  static = eval_lib.run_evaluation(str(model_dir), ["amc23"], str(EVAL_DIR), str(tmp_path / "a"), **kw)
  assert slots == []  # 2 prompts x 3 samples a call, every row at once
  engine_run = eval_lib.run_evaluation(str(model_dir), ["amc23"], str(EVAL_DIR), str(tmp_path / "b"),
                                       **kw, max_slots=4, prefill_chunk=2, cache_phases=2)
  assert slots == [4, 4]  # amc23's 3 problems: two calls of 2 prompts (the second padded)
  assert engine_run["sampling"]["max_slots"] == 4 and static["sampling"]["max_slots"] == 0
  a, b = static["benchmarks"]["amc23"], engine_run["benchmarks"]["amc23"]
  assert [s["responses"] for s in a["samples"]] == [s["responses"] for s in b["samples"]]
  assert sum(len(r) for s in a["samples"] for r in s["responses"]) > 0
  assert {k: v for k, v in a["summary"].items() if k != "seconds"} == {
      k: v for k, v in b["summary"].items() if k != "seconds"}


@pytest.mark.slow
def test_cli_on_a_workdir_the_trainer_wrote(tmp_path):
  """`--model=WORKDIR` on a real trainer workdir (its own config.json does
  not make it a Hugging Face directory): the trained policy is evaluated."""
  import trainer_utils as tu
  from ba_jax.run import trainer
  workdir = tmp_path / "run"
  config = tu.smoke_config(**{"sft.steps": 0, "rl.steps": 1, "rl.num_minibatches": 1,
                              "log.backends": "", "eval.num_problems": 8,
                              "eval.samples_per_problem": 1})
  out = trainer.run(config, str(workdir))
  model, _, tokenizer = eval_lib.load_policy(str(workdir))
  from flax import nnx
  assert tu.max_abs_diff(tu.host_params(nnx.state(model)),
                         tu.host_params(out["state"])) == 0.0
  assert tokenizer("1+2=")["input_ids"] == [5, 14, 6, 15]
  results_dir = tmp_path / "eval"
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p),
             XLA_FLAGS="--xla_force_host_platform_device_count=1", JAX_PLATFORMS="cpu")
  cmd = [sys.executable, "-m", "ba_jax.evaluate", f"--model={workdir}",
         "--benchmarks=aime24", f"--data_dir={EVAL_DIR}", "--k=2", f"--output_dir={results_dir}",
         "--max_new_tokens=4", "--batch_size=2", "--num_workers=1", "--template=answer",
         "--rule=answer", "--max_slots=2", "--prefill_chunk=4", "--cache_phases=1"]
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
  assert proc.returncode == 0, proc.stderr[-3000:]
  results = json.loads((results_dir / "results.json").read_text())
  assert results["model"] == str(workdir) and results["sampling"]["max_slots"] == 2
  summary = results["benchmarks"]["aime24"]["summary"]
  assert summary["num_problems"] == 2 and summary["samples_per_problem"] == 2


def test_a_directory_that_is_neither_is_named(tmp_path):
  with pytest.raises(ValueError, match="neither a Hugging Face directory"):
    eval_lib.load_policy(str(tmp_path))
