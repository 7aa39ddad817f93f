"""The bundled synthetic task: tokenizer round trips, grading, length gap."""
import numpy as np
import pytest
from transformers import AutoTokenizer

from ba_jax.tasks import synthetic


def test_tokenizer_round_trips_and_reloads(tmp_path):
  tok = synthetic.build_tokenizer()
  text = "3+5+2=8,10 Answer: 10"
  ids = tok(text)["input_ids"]
  assert len(ids) == len(text)  # one token per character
  assert tok.decode(ids) == text
  tok.save_pretrained(tmp_path)
  again = AutoTokenizer.from_pretrained(tmp_path)
  assert again(text)["input_ids"] == ids
  assert (again.pad_token_id, again.eos_token_id) == (0, 1)
  batch = tok(["1+2=", "3+4+5="], padding=True, return_tensors="np")
  assert batch["attention_mask"][0].tolist() == [0, 0, 1, 1, 1, 1]  # left pad


def test_correct_response_grades_one_and_wrong_grades_zero():
  task = synthetic.TaskConfig(sft_correct_frac=0.5)
  rng = np.random.default_rng(0)
  for p in synthetic.train_problems(task, seed=0, start=0, n=200):
    assert synthetic.grade(synthetic.correct_response(p), p) == 1.0
    assert synthetic.grade(synthetic.wrong_response(p, rng), p) == 0.0
    assert synthetic.grade(synthetic.correct_response(p) + "1", p) == 0.0
  assert synthetic.extract_answer("no answer here") is None


@pytest.mark.parametrize("gap", [6, -4, 0])
def test_length_gap_knob_sets_wrong_minus_right_length(gap):
  task = synthetic.TaskConfig(length_gap=gap, sft_correct_frac=0.5)
  rng = np.random.default_rng(1)
  diffs = []
  for p in synthetic.train_problems(task, seed=3, start=0, n=400):
    text, correct = synthetic.sft_response(p, rng, task)
    assert synthetic.grade(text, p) == float(correct)
    diffs.append(len(text) - len(synthetic.correct_response(p)))
    if not correct:
      diffs[-1] = (len(text), len(synthetic.correct_response(p)), correct)
  # Correct traces are the plain trace, plus |gap| scratch tokens if gap < 0.
  rights = [d for d in diffs if not isinstance(d, tuple)]
  assert set(rights) == {max(-gap, 0)}
  # A wrong trace differs from the right one by gap, up to the digits its
  # error adds or removes (at most one per partial sum, here <= 4).
  wrongs = [w - r for w, r, _ in (d for d in diffs if isinstance(d, tuple))]
  assert abs(np.mean(wrongs) - max(gap, 0)) < 1.0
  assert max(abs(w - max(gap, 0)) for w in wrongs) <= 4


def test_response_length_grows_with_number_of_terms():
  short = synthetic.correct_response(synthetic.Problem((1, 2)))
  long = synthetic.correct_response(synthetic.Problem((1, 2, 3, 4, 5)))
  assert len(long) > len(short)
  bound = synthetic.max_response_tokens(synthetic.TaskConfig())
  task = synthetic.TaskConfig()
  rng = np.random.default_rng(2)
  tok = synthetic.build_tokenizer()
  for p in synthetic.train_problems(task, seed=0, start=0, n=300):
    text, _ = synthetic.sft_response(p, rng, task)
    assert len(tok(text)["input_ids"]) + 1 <= bound


def test_heldout_and_training_problems_are_disjoint_and_deterministic():
  task = synthetic.TaskConfig()
  held = synthetic.heldout_problems(task, 64, seed=0)
  assert len(set(held)) == 64
  train = synthetic.train_problems(task, 0, 0, 500, frozenset(held))
  assert not set(train) & set(held)
  assert synthetic.train_problems(task, 0, 100, 5) == synthetic.train_problems(
      task, 0, 0, 105)[100:]
  with pytest.raises(ValueError, match="max_terms"):
    synthetic.TaskConfig(min_terms=4, max_terms=3)
