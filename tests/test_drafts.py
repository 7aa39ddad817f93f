"""The drafts task: grading under each rule, warm-up data, and the length knobs."""
import dataclasses

import numpy as np
import pytest

from ba_jax.config import schema
from ba_jax.tasks import drafts
from ba_jax.tasks import synthetic

P = synthetic.Problem((3, 5, 2))  # S = 10
RULES = ("answer", "min_drafts:3", "max_drafts:2")


def cfg(**fields):
  return drafts.config_from(dict(name=drafts.NAME, **fields))


def grades(text, p=P):
  return {rule: drafts.grade(text, p, rule) for rule in RULES}


def test_drafts_are_running_sums_from_their_start():
  assert drafts.draft(P, 0) == [0, 3, 8, 10]
  assert drafts.draft(P, 4) == [4, 7, 12, 14]
  assert drafts.correct_response(P) == "0,3,8,10"
  assert drafts.correct_response(P, [4, 7]) == "0,3,8,10 4,7,12,14 7,10,15,17"
  assert drafts.parse_response("0,3 4,7") == [[0, 3], [4, 7]]
  assert drafts.parse_response("0,3 4,,7") is None
  assert drafts.parse_response("") is None
  assert drafts.draft_count("0,3,8,10 4,1,12,1") == 2


def test_grader_under_each_rule():
  one, two, three = (drafts.correct_response(P, o) for o in ([], [4], [4, 9]))
  assert grades(one) == {"answer": 1.0, "min_drafts:3": 0.0, "max_drafts:2": 1.0}
  assert grades(two) == {"answer": 1.0, "min_drafts:3": 0.0, "max_drafts:2": 1.0}
  assert grades(three) == {"answer": 1.0, "min_drafts:3": 1.0, "max_drafts:2": 0.0}
  for r in range(1, 7):
    text = drafts.correct_response(P, [5] * (r - 1))
    assert drafts.grade(text, P, "min_drafts:4") == float(r >= 4)
    assert drafts.grade(text, P, "max_drafts:4") == float(r <= 4)


@pytest.mark.parametrize("text", [
    "0,3,8,11 4,7,12,14",  # the answer (the first draft's last value) wrong
    "0,3,9,10 4,7,12,14",  # a value of the answer draft wrong
    "0,3,8 4,7,12,14",  # the answer draft cut short
    "4,7,12,14 0,3,8,10",  # a check before the answer draft
    "0,3,8,10 0,3,8,10",  # two answers
    "0,3,8,10 4,7,12,14 x",  # a foreign word
    "4,7,12,14",  # no answer draft
])
def test_wrong_or_malformed_responses_fail_every_rule(text):
  assert set(grades(text).values()) == {0.0}


def test_checks_are_graded_for_form_only():
  # a check with any numbers counts, as chains' count rules' earlier chains
  assert grades("0,3,8,10 4,7,13,99 6,1") == {
      "answer": 1.0, "min_drafts:3": 1.0, "max_drafts:2": 0.0}


def test_bad_rules_and_configs_are_named():
  for bad in ("answers", "min_drafts", "min_drafts:0", "max_drafts:x", "answer:3",
              "min_count:2"):
    with pytest.raises(ValueError, match="task.rule="):
      drafts.parse_rule(bad)
    with pytest.raises(ValueError, match="task.rule="):
      cfg(rule=bad)
  with pytest.raises(ValueError, match="task.continue_prob=1.0"):
    cfg(continue_prob=1.0)
  with pytest.raises(ValueError, match="needs more drafts"):
    cfg(rule="min_drafts:7", max_drafts=6)
  with pytest.raises(ValueError, match="min_terms <= max_terms"):
    cfg(min_terms=3, max_terms=2)
  with pytest.raises(ValueError, match="task.chain_counts: unknown key"):
    cfg(chain_counts="1,2")


def test_the_generator_config_is_the_schema_section():
  c = cfg(rule="min_drafts:2")
  assert isinstance(c, schema.DraftsTask)
  defaults = schema.defaults(schema.DraftsTask)
  assert {f.name: getattr(c, f.name) for f in dataclasses.fields(c)} == dict(
      defaults, rule="min_drafts:2")
  assert drafts.config_from(c) is c


def test_warmup_traces_parse_back_and_grade_as_labelled():
  c = cfg(rule="min_drafts:2")
  rng = np.random.default_rng(0)
  tok = drafts.build_tokenizer()
  bound = drafts.max_response_tokens(c)
  counts, labels = [], []
  for p in synthetic.train_problems(c, seed=0, start=0, n=400):
    text, correct = drafts.sft_response(p, rng, c)
    parsed = drafts.parse_response(text)
    counts.append(len(parsed))
    labels.append(correct)
    assert drafts.grade(text, p, c.rule) == float(correct)
    assert all(d[0] != 0 for d in parsed[1:]) and parsed[0][0] == 0
    top = c.max_value * c.max_terms  # checks: free numbers in the sums' range
    assert all(len(d) == len(p.numbers) + 1 and max(d[1:]) <= top for d in parsed[1:])
    assert drafts.grade(text, p, "answer") == float(parsed[0] == drafts.draft(p, 0))
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text) and tok.unk_token_id not in ids
    assert len(ids) + 1 <= bound
  counts = np.array(counts)
  assert counts.max() <= c.max_drafts
  # the draft count is the truncated geometric: P(r >= k) = q^(k-1)
  for k in (2, 3, 4):
    assert np.mean(counts >= k) == pytest.approx(c.continue_prob ** (k - 1), abs=0.06)
  assert 0.2 < np.mean(labels) < 0.45


def test_sums_checks_are_running_sums_from_their_start():
  c = cfg(scratch="sums")
  rng = np.random.default_rng(1)
  for p in synthetic.train_problems(c, seed=1, start=0, n=50):
    parsed = drafts.parse_response(drafts.sft_response(p, rng, c)[0])
    assert all(d == drafts.draft(p, d[0]) and 1 <= d[0] <= 9 for d in parsed[1:])
  worst = synthetic.Problem((5, 5, 5))
  longest = drafts.correct_response(worst, [9] * (c.max_drafts - 1))
  assert drafts.max_response_tokens(c) >= len(longest) + 1


def group_stats(c, *, problems=300, group_size=8, seed=0):
  """Warm-up responses, ``group_size`` per problem: the mean within-group
  length CV, and the mean over groups holding both signs of (correct -
  incorrect mean length) over the group's mean length; lengths in tokens
  (EOS included, as the sampler counts them)."""
  rng = np.random.default_rng(seed)
  cvs, rel = [], []
  for p in synthetic.train_problems(c, seed=seed, start=0, n=problems):
    out = [drafts.sft_response(p, rng, c) for _ in range(group_size)]
    L = np.array([len(t) + 1 for t, _ in out], float)
    ok = np.array([k for _, k in out])
    cvs.append(L.std() / L.mean())
    if ok.any() and (~ok).any():
      rel.append((L[ok].mean() - L[~ok].mean()) / L.mean())
  return float(np.mean(cvs)), float(np.mean(rel))


@pytest.mark.parametrize("rule,sign", [("answer", 0), ("min_drafts:2", 1),
                                       ("max_drafts:2", -1)])
def test_length_control_on_the_warmup_distribution(rule, sign):
  """The warm-up data is the policy a perfect warm-up would give: its
  within-group length CV is >= 0.5 and the rule sets the gap's sign."""
  cv, rel = group_stats(cfg(rule=rule))
  assert cv >= 0.5, cv
  if sign:
    assert sign * rel >= 0.3, rel
  else:
    assert abs(rel) < 0.06, rel


def test_continue_prob_sets_the_spread():
  low, _ = group_stats(cfg(continue_prob=0.2), problems=150)
  high, _ = group_stats(cfg(continue_prob=0.6), problems=150)
  assert low < 0.4 < 0.5 < high


def test_task_interface_and_config_variants():
  import trainer_utils as tu
  from ba_jax.tasks import registry as tasks
  assert tasks.task_class(drafts.NAME) is drafts.DraftsTask
  for gap, kind in (("neg", "max_drafts"), ("none", "answer"), ("pos", "min_drafts")):
    config = tu.load_config(f"gap={gap},agg=token", "configs/drafts.py")
    assert drafts.parse_rule(config.task.rule)[0] == kind
    assert config.rl.max_new_tokens > drafts.max_response_tokens(
        drafts.config_from(config.task))
  config = tu.load_config("smoke,gap=pos", "configs/drafts.py")
  run = schema.parse(config)
  task = tasks.make_task(run.task, run.eval, seed=run.seed,
                         tokenizer=tasks.make_tokenizer(run.task))
  assert isinstance(task, drafts.DraftsTask) and task.cfg is run.task
  assert len(task.heldout) == run.eval.num_problems
  train = task.problems(0, 50)
  assert not set(train) & set(task.heldout)
  problems, texts = task.warmup_examples(step=1, batch_size=6)
  assert problems == task.problems(6, 6, stream=1)
  limit = task.max_warmup_response_tokens(config.task)
  ids, mask = task.encode_responses(texts, limit)
  assert task.decode(ids, mask) == texts
  rewards, correct = task.grade(texts, problems)
  assert rewards.tolist() == [drafts.grade(t, p, "min_drafts:2")
                              for t, p in zip(texts, problems)]
  with pytest.raises(ValueError, match="task.grader='rewards'"):
    drafts.DraftsTask(run.task, seed=0, tokenizer=task.tokenizer,
                      max_prompt_len=8, num_heldout=4, grader="rewards")
  with pytest.raises(ValueError, match="gap='up'"):
    tu.load_config("gap=up", "configs/drafts.py")


@pytest.mark.slow
def test_length_control_on_a_tiny_warmed_up_policy():
  """A tiny policy warmed up for 300 steps keeps the length knobs on its own
  samples: the spread, and the gap's sign under each rule (its answers are
  right ~8% of the time, enough for a fifth of the groups to be mixed)."""
  import jax
  from flax import nnx
  from ba_jax.generation import sampler
  from ba_jax.policy import model as model_lib
  from ba_jax.update import sft
  from experiments.studies.powered_drafts import drafts_warmup_probe as probe

  c = cfg(max_terms=2, max_drafts=5)
  task = drafts.DraftsTask(c, seed=0, tokenizer=drafts.build_tokenizer(),
                           max_prompt_len=8, num_heldout=16)
  budget = drafts.max_response_tokens(c) + 4
  mc = model_lib.ModelConfig(
      model_type="qwen3", vocab_size=32, hidden_size=32, intermediate_size=96,
      num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16,
      tie_word_embeddings=True, qk_norm=True, max_position_embeddings=64)
  graphdef, params = nnx.split(model_lib.Decoder(mc, rngs=nnx.Rngs(0)))
  for _, params in sft.warmup(params, graphdef, task, steps=300, batch_size=32,
                              learning_rate=3e-3, warmup_steps=20,
                              max_new_tokens=budget, to_device=lambda b: b,
                              log=lambda _: None):
    pass
  ids, mask = task.encode_prompts(task.heldout)
  out = jax.tree.map(np.asarray, sampler.sample_groups(
      nnx.merge(graphdef, params), ids, mask, group_size=8, max_new_tokens=budget,
      temperature=1.0, eos_id=task.eos_id, pad_id=task.pad_id, rng=jax.random.key(1)))
  texts = task.decode(out.tokens, out.mask)
  problems = [p for p in task.heldout for _ in range(8)]
  lengths = out.mask.sum(-1).reshape(-1, 8).astype(float)
  stats = {rule: probe.group_stats(lengths, np.array(
      [drafts.grade(t, p, rule) > 0 for t, p in zip(texts, problems)]).reshape(-1, 8))
      for rule in ("max_drafts:2", "answer", "min_drafts:2")}
  assert stats["answer"]["length_cv_in_group"] >= 0.5, stats
  assert min(s["groups_mixed_frac"] for s in stats.values()) >= 0.2, stats
  assert stats["min_drafts:2"]["length_gap_in_group_rel"] >= 0.3, stats
  assert stats["max_drafts:2"]["length_gap_in_group_rel"] <= -0.3, stats
  assert abs(stats["answer"]["length_gap_in_group_rel"]) < 0.3, stats
