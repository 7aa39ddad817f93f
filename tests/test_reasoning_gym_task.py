"""The reasoning-gym task: prompts, answer extraction, rewards equal to the
dataset's own verifier, disjoint held-out problems, clear errors, and a
seconds-scale run of configs/smollm2_reasoning_gym.py's code path."""
import json

import ml_collections
import numpy as np
import pytest
import reasoning_gym

from ba_jax.tasks import reasoning_gym_task as rgt
from ba_jax.tasks import registry as tasks
from model_utils import make_tokenizer, save_tiny_model
from trainer_utils import load_config

CONFIG = "configs/smollm2_reasoning_gym.py"
ARITH = dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1,
             operators=("+", "-"), allow_parentheses=False,
             allow_negation=False)


def make_task(num_heldout=16, **fields):
  cfg = rgt.section(dataset_config={"basic_arithmetic": ARITH},
                    train_size=256, max_prompt_len=160, system_prompt="")
  cfg.update(fields)
  eval_cfg = ml_collections.ConfigDict(dict(num_problems=num_heldout))
  return rgt.ReasoningGymTask(cfg, eval_cfg, seed=0,
                              tokenizer=make_tokenizer(),
                              max_prompt_len=cfg.max_prompt_len)


def test_registered_under_its_name():
  assert tasks.task_class("reasoning_gym") is rgt.ReasoningGymTask


def test_prompts_are_the_chat_template_around_question_and_instruction():
  # The character tokenizer spends a token per character.
  task = make_task(system_prompt="default", instruction="Be brief.",
                   max_prompt_len=600)
  problem = task.problems(0, 1)[0]
  ids, mask = task.encode_prompts([problem])
  assert ids.shape == mask.shape == (1, 600)
  text = task.tokenizer.decode(ids[0][mask[0].astype(bool)])
  from reasoning_gym.utils import SYSTEM_PROMPTS
  assert text == (f"<|im_start|>system\n{SYSTEM_PROMPTS['default']}<|im_end|>"
                  f"\n<|im_start|>user\n{problem['question']} Be brief."
                  "<|im_end|>\n<|im_start|>assistant\n")
  plain = make_task(system_prompt="", chat_template=False)
  assert plain._format(problem) == problem["question"] + "\n"


@pytest.mark.parametrize("rule,text,expected", [
    ("tags", "think... <answer>12</answer> then <answer> 7 </answer>", "7"),
    ("tags", "the answer is 7", None),
    ("last_number", "5 + 3 = 8, so -1,234 is it.", "-1234"),
    ("last_number", "half is 3/4 or 0.75", "0.75"),
    ("last_number", "no digits", None),
    ("last_line", "work\n\n 42 \n", "42"),
    ("full", "  x  ", "x"),
    ("full", "   ", None),
])
def test_answer_rules(rule, text, expected):
  assert rgt.extract_answer(text, rule) == expected


def test_rewards_are_the_datasets_own_score_answer():
  task = make_task(answer_rule="last_number")
  problems = task.heldout[:8]
  texts = []
  for i, p in enumerate(problems):
    texts += [f"It is {p['answer']}.",  # right: full credit
              f"{p['answer']}1",  # contains the answer: partial credit
              "It is 1000.",  # wrong
              "I cannot say."]  # no number: a format failure
  rows = [p for p in problems for _ in range(4)]
  rewards, correct = task.grade(texts, rows)
  # The verifier, built independently from reasoning-gym with the same seed.
  ds = reasoning_gym.create_dataset("basic_arithmetic", size=16, seed=2,
                                    **dict(ARITH, operators=["+", "-"]))
  assert [ds[i]["question"] for i in range(8)] == [
      p["question"] for p in problems]
  expected = np.array([
      ds.score_answer(rgt.extract_answer(t, "last_number"), ds[i // 4])
      for i, t in enumerate(texts)], np.float32)
  np.testing.assert_array_equal(rewards, expected)
  np.testing.assert_array_equal(rewards[0::4], 1.0)
  assert np.all((rewards[1::4] > 0) & (rewards[1::4] < 1))  # partial credit
  np.testing.assert_array_equal(rewards[3::4], 0.0)
  np.testing.assert_array_equal(correct, rewards == 1.0)
  np.testing.assert_array_equal(task.answer_found(texts),
                                [True, True, True, False] * 8)


def test_a_weighted_mix_is_graded_by_each_source_datasets_verifier():
  task = make_task(datasets="basic_arithmetic:2,chain_sum:1",
                   dataset_config={"basic_arithmetic": ARITH,
                                   "chain_sum": dict(min_terms=2,
                                                     max_terms=2)},
                   num_heldout=32, answer_rule="full")
  sources = {p["metadata"]["source_dataset"] for p in task.heldout}
  assert sources == {"basic_arithmetic", "chain_sum"}
  rewards, _ = task.grade([str(p["answer"]) for p in task.heldout],
                          task.heldout)
  np.testing.assert_array_equal(rewards, 1.0)


def test_training_and_heldout_problems_never_share_a_question():
  # 1-digit a +/- b has at most 200 questions, so the pools do collide.
  task = make_task(num_heldout=64)
  train = {p["question"] for p in task.problems(0, len(task.examples))}
  held = {p["question"] for p in task.heldout}
  assert not train & held
  assert task.dropped_heldout_overlap > 0
  assert len(train) > 20
  # Training problem i depends only on the seed and i (resumable stream).
  again = make_task(num_heldout=64)
  assert again.problems(100, 5) == task.problems(100, 5)


@pytest.mark.parametrize("fields,message", [
    (dict(datasets="basic_arithmatic"),
     "unknown reasoning-gym dataset 'basic_arithmatic'; valid names: "),
    (dict(datasets="basic_arithmetic:x"), "weight of 'basic_arithmetic'"),
    (dict(dataset_config={"basic_arithmetic": dict(max_term=3)}),
     "task.dataset_config.basic_arithmetic: unknown key(s) ['max_term']; "
     "valid keys: "),
    (dict(dataset_config={"chain_sum": {}}),
     "settings for ['chain_sum'], which task.datasets="),
    (dict(answer_rule="boxed"), "task.answer_rule='boxed'"),
    (dict(heldout_seed=1), "task.train_seed and task.heldout_seed are both 1"),
    (dict(dataset_config={"basic_arithmetic": dict(min_terms=3,
                                                   max_terms=2)}),
     "reasoning-gym rejected it"),
])
def test_bad_settings_are_one_line_naming_them(fields, message):
  with pytest.raises(ValueError) as info:
    make_task(**fields)
  text = str(info.value)
  assert message in text and "\n" not in text
  if "valid names" in text:
    assert "basic_arithmetic" in text and "chain_sum" in text


@pytest.mark.slow
def test_runlocal_runs_the_real_configs_code_path(tmp_path):
  from ba_jax.run import trainer
  ckpt = save_tiny_model("llama", tmp_path / "model")
  c = load_config("runlocal", CONFIG)
  c.init_from = str(ckpt)
  out = trainer.run(c, str(tmp_path / "run"))
  assert out["step"] == c.rl.steps and out["stopped"] is None
  rows = [json.loads(line) for line in
          (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  train = [r for r in rows if "format_fail_frac" in r]
  assert len(train) == c.rl.steps
  assert all(0.0 <= r["format_fail_frac"] <= 1.0 for r in train)
  # Each problem's held-out results are kept for paired intervals.
  for step in (0, c.rl.steps):
    tables = json.loads((tmp_path / "run" / "heldout" /
                         f"step_{step}.json").read_text())
    assert np.asarray(tables["greedy"]).shape == (c.eval.num_problems, 1)
    assert np.asarray(tables["sampled"]).shape == (
        c.eval.num_problems, c.eval.samples_per_problem)
    acc = out["after_rl" if step else "before_rl"]
    assert acc["heldout_acc_greedy"] == np.mean(tables["greedy"])


def test_paired_interval_of_the_smollm2_report():
  from experiments.studies.smollm2_reasoning_gym import smollm2_reasoning_gym as report
  # Every problem gains exactly 1: the interval collapses onto the gain.
  assert report.paired_interval(np.zeros(50), np.ones(50)) == (1.0, 1.0, 1.0)
  rng = np.random.default_rng(0)
  before = rng.random(200) < 0.4
  after = before | (rng.random(200) < 0.3)
  gain, lo, hi = report.paired_interval(before, after)
  assert gain == pytest.approx(np.mean(after) - np.mean(before), abs=1e-12)
  assert 0 < lo < gain < hi
  # The paired bootstrap's spread is the standard error of the differences.
  se = np.std(after.astype(float) - before, ddof=1) / np.sqrt(200)
  assert abs((hi - lo) / 2 - 1.96 * se) < 0.2 * se


@pytest.mark.slow
def test_length_probe_reports_the_rollouts_own_statistics(tmp_path):
  """The pilot's length probe on a tiny model: per candidate, one rollout's
  pass rate and within-group length statistics, as a table."""
  from experiments.studies.smollm2_reasoning_gym import smollm2_reasoning_gym as report
  ckpt = save_tiny_model("llama", tmp_path / "model")
  # The tiny model's 256 positions: character-level prompts, a short budget
  candidates = tuple(c[:4] + (24,) for c in (report.LENGTH_CANDIDATES[0],
                                            report.LENGTH_CANDIDATES[-1]))
  out = tmp_path / "probe.md"
  rows = report.length_probe(out, 4, 4, init_from=str(ckpt), variant="runlocal",
                             prompt_len=224, candidates=candidates)
  assert [r["dataset"] for r in rows] == ["basic_arithmetic", "chain_sum"]
  assert rows[1]["settings"]["min_terms"] == 3  # the candidate's over the config's
  for r, (_, _, _, _, budget) in zip(rows, candidates):
    assert 0.0 <= r["accuracy"] <= 1.0 and 0.0 <= r["groups_mixed_frac"] <= 1.0
    assert 0 < r["length_mean"] <= budget and r["length_cv_in_group"] >= 0.0
  table = out.read_text()
  assert table.count("| chain_sum, 3 one-digit terms |") == 1
  assert f"| {rows[0]['length_mean']:.1f} |" in table
