"""The chains task: grading under each rule, warm-up data, and the length knobs."""
import ml_collections
import numpy as np
import pytest

from ba_jax.config import schema
from ba_jax.tasks import chains
from ba_jax.tasks import synthetic

P = synthetic.Problem((3, 5, 2))  # S = 10
RULES = ("answer", "min_chains:3", "max_chains:2", "min_count:3", "max_count:2")


def grades(text, p=P):
  return {rule: chains.grade(text, p, rule) for rule in RULES}


def test_chains_count_down_to_the_partial_sums_and_differ_everywhere():
  assert chains.chain(P, 0) == [0, 3, 8, 10]
  assert chains.chain(P, 2) == [2, 5, 10, 12]
  assert chains.correct_response(P, 1) == "0,3,8,10 Answer: 10"
  assert chains.correct_response(P, 3) == "2,5,10,12 1,4,9,11 0,3,8,10 Answer: 10"
  some = chains.chains_for(P, 12)
  assert all(a != b for i, x in enumerate(some) for y in some[i + 1:]
             for a, b in zip(x, y))


def test_grader_under_each_rule():
  two, three = chains.correct_response(P, 2), chains.correct_response(P, 3)
  assert grades(two) == {"answer": 1.0, "min_chains:3": 0.0, "max_chains:2": 1.0,
                         "min_count:3": 0.0, "max_count:2": 1.0}
  assert grades(three) == {"answer": 1.0, "min_chains:3": 1.0, "max_chains:2": 0.0,
                           "min_count:3": 1.0, "max_count:2": 0.0}
  # A wrong answer fails every rule, even after right chains.
  assert set(grades(three.replace("Answer: 10", "Answer: 11")).values()) == {0.0}
  # Only the answer counts under "answer"; the others need at least one chain.
  assert grades("Answer: 10") == {"answer": 1.0, "min_chains:3": 0.0,
                                  "max_chains:2": 0.0, "min_count:3": 0.0,
                                  "max_count:2": 0.0}
  for rule in ("max_chains:1", "min_chains:1", "max_count:1", "min_count:1"):
    assert chains.grade("0,3,8,10 Answer: 10", P, rule) == 1.0


def test_count_rules_check_the_last_chain_and_the_count_only():
  # A wrong value in an earlier chain fails the chain rules only.
  text = "2,5,10,12 1,4,9,12 0,3,8,10 Answer: 10"
  assert grades(text) == {"answer": 1.0, "min_chains:3": 0.0, "max_chains:2": 0.0,
                          "min_count:3": 1.0, "max_count:2": 0.0}
  # A wrong last chain fails them all but "answer", whatever the answer says.
  assert grades("1,4,9,11 0,3,9,10 Answer: 10") == {
      "answer": 1.0, "min_chains:3": 0.0, "max_chains:2": 0.0,
      "min_count:3": 0.0, "max_count:2": 0.0}
  # The count is of well-formed chains, wherever they start.
  assert chains.grade("5,8 5,8 0,3,8,10 Answer: 10", P, "min_count:3") == 1.0
  assert chains.grade("1,4,9,11 0,3,8,10 Answer: 10", P, "min_count:3") == 0.0
  # The bound is inclusive on both sides.
  for r in range(1, 7):
    text = chains.correct_response(P, r)
    assert chains.grade(text, P, "min_count:4") == float(r >= 4)
    assert chains.grade(text, P, "max_count:4") == float(r <= 4)


@pytest.mark.parametrize("text,counted", [
    ("2,5,10,12 2,5,10,12 0,3,8,10 Answer: 10", True),  # chain 2 copies chain 1
    ("1,4,9,11 2,5,10,12 0,3,8,10 Answer: 10", True),  # chains out of order
    ("3,6,11,13 1,4,9,11 0,3,8,10 Answer: 10", True),  # a first chain promising 4 chains
    ("2,5,10,12 1,4,9,12 0,3,8,10 Answer: 10", True),  # one value wrong
    ("2,5,10,12 1,4,9 0,3,8,10 Answer: 10", True),  # a chain cut short
    ("2,5,10,12 1,4,9,11,13 0,3,8,10 Answer: 10", True),  # a chain too long
    ("2,5,10,12 1,4,,9,11 0,3,8,10 Answer: 10", False),  # malformed: empty value
    ("2,5,10,12 1,4~9,11 0,3,8,10 Answer: 10", False),  # malformed: foreign token
    ("2,5,10,12,1,4,9,11,0,3,8,10 Answer: 10", False),  # chains run together
])
def test_bad_chains_fail_the_chain_rules_but_not_the_answer_rule(text, counted):
  """The count rules see three chains ending in the right one when the
  chains are well formed, however wrong the earlier ones are."""
  assert grades(text) == {"answer": 1.0, "min_chains:3": 0.0, "max_chains:2": 0.0,
                          "min_count:3": float(counted), "max_count:2": 0.0}


def test_answer_must_end_the_response():
  assert set(grades(chains.correct_response(P, 3) + " 4").values()) == {0.0}
  assert chains.parse_response("no answer") == (None, None)
  assert chains.parse_response("1,4 0,x Answer: 7") == (None, 7)
  assert chains.chain_count(chains.correct_response(P, 4)) == 4
  assert chains.chain_count("1,4 0,x Answer: 7") == 0


def test_bad_rules_and_configs_are_named():
  for bad in ("answers", "min_chains", "min_chains:0", "max_chains:x", "answer:3",
              "min_count", "max_count:0", "count:2"):
    with pytest.raises(ValueError, match="task.rule="):
      chains.parse_rule(bad)
  with pytest.raises(ValueError, match="task.chain_counts='1,x'"):
    chains.ChainsConfig(chain_counts="1,x")
  with pytest.raises(ValueError, match="task.chain_counts=\\(0, 2\\)"):
    chains.ChainsConfig(chain_counts=(0, 2))
  with pytest.raises(ValueError, match="rejects every chain count"):
    chains.ChainsConfig(chain_counts=(1, 2), rule="min_chains:3")
  with pytest.raises(ValueError, match="rejects every chain count"):
    chains.ChainsConfig(chain_counts=(4, 5), rule="max_count:3")
  with pytest.raises(ValueError, match="task.max_value=12"):
    chains.ChainsConfig(max_value=12)
  assert chains.ChainsConfig(chain_counts="4, 5").chain_counts == (4, 5)


@pytest.mark.parametrize("rule", RULES)
def test_warmup_traces_parse_back_and_grade_as_labelled(rule):
  task = chains.ChainsConfig(chain_counts=(1, 2, 3, 4), rule=rule)
  rng = np.random.default_rng(0)
  tok = chains.build_tokenizer()
  bound = chains.max_response_tokens(task)
  labels = []
  for p in synthetic.train_problems(task, seed=0, start=0, n=300):
    text, correct = chains.sft_response(p, rng, task)
    labels.append(correct)
    assert chains.grade(text, p, rule) == float(correct)
    parsed, answer = chains.parse_response(text)
    r = len(parsed)
    assert r in task.chain_counts
    # Every chain but the last is exact; the last is exact iff the answer is.
    assert parsed[:-1] == chains.chains_for(p, r)[:-1]
    assert (parsed[-1] == chains.chain(p, 0)) == (answer == p.answer)
    assert answer == parsed[-1][-1] and parsed[-1][0] == 0
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text) and tok.unk_token_id not in ids
    assert len(ids) + 1 <= bound
  assert 0.1 < np.mean(labels) < 0.7


def test_warmup_grades_agree_between_count_and_chain_rules():
  """Only a trace's last chain can be wrong, so a count rule and its chain
  rule label the warm-up data alike: one warm-up serves both."""
  for counted, checked in (("min_count:2", "min_chains:2"),
                           ("max_count:2", "max_chains:2")):
    task = chains.ChainsConfig(chain_counts=(1, 2, 8), rule=counted)
    rng = np.random.default_rng(1)
    for p in synthetic.train_problems(task, seed=1, start=0, n=200):
      text, correct = chains.sft_response(p, rng, task)
      assert chains.grade(text, p, checked) == float(correct)


def group_lengths(task, *, problems=200, group_size=8, seed=0):
  """Warm-up responses, ``group_size`` per problem: [groups, G] lengths in
  tokens (EOS included, as the sampler counts them) and correctness."""
  rng = np.random.default_rng(seed)
  lengths, correct = [], []
  for p in synthetic.train_problems(task, seed=seed, start=0, n=problems):
    out = [chains.sft_response(p, rng, task) for _ in range(group_size)]
    lengths.append([len(t) + 1 for t, _ in out])
    correct.append([c for _, c in out])
  return np.array(lengths, float), np.array(correct, bool)


def within_group_gap(lengths_GxS, correct_GxS):
  """Mean over groups holding both signs of (pos - neg mean length), absolute
  and relative to the group's mean length."""
  gaps, rel = [], []
  for L, c in zip(lengths_GxS, correct_GxS):
    if c.any() and (~c).any():
      gaps.append(L[c].mean() - L[~c].mean())
      rel.append(gaps[-1] / L.mean())
  return float(np.mean(gaps)), float(np.mean(rel))


@pytest.mark.parametrize("counts,low,high", [((4, 5), 0.05, 0.15),
                                             ((1, 2, 8), 0.5, 1.0),
                                             ((1, 2, 4, 8), 0.5, 1.0)])
def test_chain_count_spread_sets_within_group_length_cv(counts, low, high):
  lengths, _ = group_lengths(chains.ChainsConfig(chain_counts=counts))
  cv = (lengths.std(-1) / lengths.mean(-1)).mean()
  assert low <= cv <= high, cv


@pytest.mark.parametrize("counts,rule,sign", [
    ((1, 2, 4, 8), "answer", 0), ((1, 2, 4, 8), "min_chains:4", 1),
    ((1, 2, 4, 8), "max_chains:2", -1), ((1, 2, 8), "answer", 0),
    ((1, 2, 8), "min_chains:2", 1), ((1, 2, 8), "max_chains:2", -1),
    ((1, 2, 8), "min_count:2", 1), ((1, 2, 8), "max_count:2", -1),
    ((1, 2, 8), "min_count:8", 1)])
def test_verifier_rule_sets_the_sign_of_the_length_gap(counts, rule, sign):
  task = chains.ChainsConfig(chain_counts=counts, rule=rule)
  lengths, correct = group_lengths(task, problems=400)
  gap, rel = within_group_gap(lengths, correct)
  if sign == 0:
    # A wrong trace differs from the right one by at most a few digits; what
    # remains is sampling noise (about +-0.04 over seeds at this size).
    assert abs(rel) < 0.06 and abs(gap) < 2.5, (gap, rel)
  else:
    assert sign * rel >= 0.3, (gap, rel)


def task_section(**overrides):
  """The ``task`` section of a config for this task."""
  c = ml_collections.ConfigDict(dict(
      name="synthetic_chains", min_terms=2, max_terms=3, max_value=9,
      chain_counts="1,2,4,8", rule="min_chains:4", sft_correct_frac=0.5,
      grader="builtin", max_prompt_len=8))
  c.update(overrides)
  return c


def test_task_interface_from_a_config_section():
  c = task_section()
  tok = chains.build_tokenizer()
  task = chains.ChainsTask(c, seed=3, tokenizer=tok,
                           max_prompt_len=c.max_prompt_len, num_heldout=32,
                           grader=c.grader)
  assert task.cfg == chains.ChainsConfig(chain_counts=(1, 2, 4, 8),
                                         rule="min_chains:4")
  assert len(task.heldout) == 32
  train = task.problems(0, 200)
  assert not set(train) & set(task.heldout)
  assert task.problems(10, 5) == train[10:15]
  assert task.problems(0, 5, stream=1) != train[:5]
  ids, mask = task.encode_prompts(train[:4])
  assert ids.shape == mask.shape == (4, 8) and mask[:, -1].all()  # left padded
  rng = np.random.default_rng(0)
  texts = [task.warmup_response(p, rng) for p in train[:16]]
  max_len = chains.max_response_tokens(task.cfg)
  r_ids, r_mask = task.encode_responses(texts, max_len)
  assert task.decode(r_ids, r_mask) == texts
  assert (r_ids[np.arange(16), r_mask.sum(-1) - 1] == task.eos_id).all()
  rewards, correct = task.grade(texts, train[:16])
  expected = [chains.grade(t, p, "min_chains:4") for t, p in zip(texts, train)]
  assert rewards.tolist() == expected and correct.tolist() == [e > 0 for e in expected]
  right = [chains.correct_response(train[0], 4), chains.correct_response(train[0], 2)]
  assert task.grade(right, train[:1] * 2)[0].tolist() == [1.0, 0.0]
  with pytest.raises(ValueError, match="task.name='synthetic_sum'"):
    chains.ChainsTask(task_section(name="synthetic_sum"), seed=0, tokenizer=tok,
                      max_prompt_len=8, num_heldout=4)
  with pytest.raises(ValueError, match="task.grader='rewards'"):
    chains.ChainsTask(c, seed=0, tokenizer=tok, max_prompt_len=8,
                      num_heldout=4, grader="rewards")
  with pytest.raises(ValueError, match=r"task.chain_count: unknown key"):
    schema.task_section(task_section(chain_count="1,2"))
  with pytest.raises(ValueError, match="task.max_prompt_len=4"):
    chains.ChainsTask(c, seed=0, tokenizer=tok, max_prompt_len=4,
                      num_heldout=4).encode_prompts(train[:2])


def test_config_variants_pick_counts_and_rules():
  import trainer_utils as tu
  from ba_jax.tasks import registry as tasks
  high_neg = tu.load_config("spread=high,gap=neg,agg=token", "configs/chains.py")
  assert high_neg.task.name == chains.NAME and tasks.task_class(
      chains.NAME) is chains.ChainsTask
  assert high_neg.task.chain_counts == "1,2,8"
  assert high_neg.task.rule == "max_count:2"
  high_pos = tu.load_config("spread=high,gap=pos", "configs/chains.py")
  assert chains.parse_rule(high_pos.task.rule)[0] == "min_count"
  assert high_neg.loss.aggregation == "token"
  cfg = chains.config_from(high_neg.task)
  assert high_neg.rl.max_new_tokens > chains.max_response_tokens(cfg)
  assert tu.load_config("spread=low,gap=pos,lr=1e-3",
                        "configs/chains.py").optim.learning_rate == 1e-3
  with pytest.raises(ValueError, match=r"unknown variant\(s\) \['spred'\]"):
    tu.load_config("spred=low", "configs/chains.py")
  with pytest.raises(ValueError, match="gap='up'"):
    tu.load_config("gap=up", "configs/chains.py")


def test_task_built_from_the_config_warms_up_on_chains():
  import trainer_utils as tu
  from ba_jax.tasks import registry as tasks
  config = tu.load_config("smoke,gap=pos", "configs/chains.py")
  from ba_jax.config import schema
  cfg = schema.parse(config)
  task = tasks.make_task(cfg.task, cfg.eval, seed=cfg.seed,
                         tokenizer=tasks.make_tokenizer(cfg.task))
  assert isinstance(task, chains.ChainsTask) and task.has_warmup
  problems, texts = task.warmup_examples(step=1, batch_size=6)
  assert [chains.parse_response(t)[1] is not None for t in texts] == [True] * 6
  assert all(len(c) in (1, 2) for c in (chains.parse_response(t)[0] for t in texts))
  limit = task.max_warmup_response_tokens(config.task)
  ids, mask = task.encode_responses(texts, limit)
  assert task.decode(ids, mask) == texts
  assert problems == task.problems(6, 6, stream=1)
