"""The training job end to end, and the errors it raises before running."""
import json
import os
import re

import numpy as np
import pytest

from ba_jax.run import metrics as metrics_lib
from ba_jax.run import checks
from ba_jax.run import setup as setup_lib
from ba_jax.run import trainer
import trainer_utils as tu


@pytest.mark.slow
def test_smoke_config_runs_end_to_end(tmp_path):
  """configs/tiny.py:smoke from the command line: warm-up, GRPO, eval."""
  workdir = tmp_path / "smoke"
  out = tu.run_module(["ba_jax.train", "--config=configs/tiny.py:smoke",
                       f"--workdir={workdir}"])
  assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
  assert "held-out accuracy before RL" in out.stdout
  assert "held-out accuracy, before -> after RL" in out.stdout
  records = metrics_lib.read_metrics(str(workdir))
  assert sorted(records) == [1, 2, 3]
  for record in records.values():
    assert record["length_mean"] > 0 and record["sampled_tokens"] > 0
    assert 0.0 <= record["accuracy"] <= 1.0
    assert np.isfinite(record["grad_norm"]) and record["nonfinite"] == 0
    for key in ("w_pos", "w_neg", "clip_frac_low", "entropy", "param_norm",
                "update_norm", "length_cv_in_group", "time_sampling",
                "time_rewards", "time_training", "tokens_per_s"):
      assert key in record, key
  evals = [json.loads(l) for l in (workdir / "eval.jsonl").read_text().split(
      "\n") if l]
  assert [e["step"] for e in evals] == [0, 3]  # before and after RL
  summary = json.loads((workdir / "summary.json").read_text())
  assert summary["after_rl"] == {k: v for k, v in evals[1].items()
                                 if k != "step"}
  assert set(summary["after_rl"]) == {"heldout_acc_sampled",
                                      "heldout_acc_greedy"}
  assert sorted(os.listdir(workdir / "checkpoints")) == ["2", "3"]  # keep=2
  assert os.listdir(workdir / "tb")  # TensorBoard event file written


def test_unknown_config_key_is_one_line_naming_it(tmp_path, capsys, monkeypatch):
  code, err = tu.train_cli(["--config=configs/tiny.py:smoke", f"--workdir={tmp_path}",
                            "--config.rl.stpes=3"], capsys, monkeypatch)
  assert code != 0
  assert err.strip() == (
      "error: bad config override --config.rl.stpes=3: no such key 'stpes'; "
      'Did you mean "steps" instead of "stpes"?')
  assert not os.listdir(tmp_path)  # nothing ran


def test_bad_config_value_is_one_line_naming_it(tmp_path, capsys, monkeypatch):
  """A value the run cannot use (not only an unknown key) is one line on
  stderr and exit status 2, not a traceback."""
  code, err = tu.train_cli(["--config=configs/tiny.py:smoke", f"--workdir={tmp_path}",
                            "--config.model.remat=some"], capsys, monkeypatch)
  assert code == 2, err[-2000:]
  assert err.strip().startswith("error: model.remat='some': expected one of"), err[-2000:]
  assert "Traceback" not in err and len(err.strip().splitlines()) == 1
  assert not os.listdir(tmp_path)  # nothing ran


@pytest.mark.parametrize("overrides, message", [
    ({"loss.aggregation": "tokenmean"}, "'tokenmean'"),
    ({"rl.prompts_per_step": 3}, "num_minibatches=2"),
    ({"rl.prompts_per_step": 1, "rl.num_minibatches": 1},
     "8 devices of the batch mesh axes"),
    ({"rl.old_logp": "policy"}, "rl.old_logp='policy'"),
    ({"rl.overlong": "cut"}, "rl.overlong='cut'"),
    ({"mesh.fsdp": 3}, "does not divide"),
    ({"rl.max_new_tokens": 8}, "rl.max_new_tokens=8"),
    # Every numeric range (ba_jax.config.schema), named before any warm-up.
    ({"optim.learning_rate": -1e-4}, r"optim.learning_rate=-0.0001: expected > 0"),
    ({"optim.learning_rate": float("nan")}, "optim.learning_rate=nan"),
    ({"sft.learning_rate": -3e-3}, "sft.learning_rate=-0.003"),
    ({"sft.learning_rate": float("inf")}, "sft.learning_rate=inf"),
    ({"loss.eps_low": -0.1}, r"loss.eps_low=-0.1: expected in \[0, 1\)"),
    ({"loss.eps_low": 1.0}, r"loss.eps_low=1.0: expected in \[0, 1\)"),
    ({"loss.eps_high": -0.2}, "loss.eps_high=-0.2"),
    ({"loss.dual_clip": 0.5}, "loss.dual_clip=0.5: expected > 1"),
    ({"loss.kl_coef": -0.1}, "loss.kl_coef=-0.1"),
    ({"loss.entropy_coef": float("nan")}, "loss.entropy_coef=nan"),
    ({"rl.group_size": 1}, "rl.group_size=1: expected >= 2"),
    ({"rl.top_p": 2.0}, r"rl.top_p=2.0: expected in \(0, 1\]"),
    ({"rl.top_p": 0.0}, "rl.top_p=0.0"),
    ({"rl.top_k": -1}, "rl.top_k=-1"),
    ({"rl.temperature": 0.0}, "rl.temperature=0.0: expected > 0"),
    ({"eval.temperature": -1.0}, "eval.temperature=-1.0"),
    ({"rl.max_new_tokens": 0}, "rl.max_new_tokens=0: expected >= 1"),
    ({"task.max_prompt_len": 0}, "task.max_prompt_len=0"),
    ({"rl.steps": -1}, "rl.steps=-1"),
    ({"optim.b2": 1.0}, "optim.b2=1.0"),
    ({"optim.grad_clip": -1.0}, "optim.grad_clip=-1.0"),
    ({"checkpoint.keep": 0}, "checkpoint.keep=0"),
    ({"rl.kv_cache_gib": -1.0}, "rl.kv_cache_gib=-1.0"),
    ({"rl.cache_phases": -1}, r"rl.cache_phases=-1: expected >= 0"),
    ({"rl.prefill_chunk": -2}, r"rl.prefill_chunk=-2: expected >= 0"),
    ({"rl.kv_cache_gib": 1e-9}, "rl.kv_cache_gib=1e-09: .* holds no slot"),
])
def test_bad_config_fails_before_anything_runs(tmp_path, overrides, message):
  config = tu.smoke_config(**overrides)
  with pytest.raises(ValueError, match=message):
    trainer.run(config, str(tmp_path / "run"))
  assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_kv_cache_budget_runs_rollouts_and_eval_through_the_engine(tmp_path, monkeypatch):
  """A budget of one slot per device (8 slots for the smoke config's 16
  rows on 8 devices) sends the step's rollout and the sampled evaluation
  (8 problems x 2) through the continuous-batching engine, with the config's
  prefill chunk and cache phases."""
  from ba_jax.generation import engine
  from ba_jax.policy import kv_cache
  from ba_jax.generation import sampler
  config = tu.smoke_config(**{"sft.steps": 0, "rl.steps": 1, "log.backends": "",
                              "checkpoint.every": 0, "rl.prefill_chunk": 4,
                              "rl.cache_phases": 2})
  calls, real = [], sampler.sample_groups
  monkeypatch.setattr(sampler, "sample_groups", lambda *a, **k: calls.append(k) or real(*a, **k))
  setup = setup_lib.make_setup(config)
  length = engine.cache_length(sampler.bucket_length(config.task.max_prompt_len),
                               config.rl.max_new_tokens, config.rl.prefill_chunk)
  per_slot = kv_cache.cache_bytes(setup.model_config, 1, length)  # data-parallel: whole slots
  config.rl.kv_cache_gib = 1.5 * per_slot / 2**30
  assert setup_lib.make_setup(config).rollout_cfg.max_slots == 8
  before = engine.trace_count()
  out = trainer.run(config, str(tmp_path))
  assert out["step"] == 1 and out["stopped"] is None
  assert np.isfinite(out["history"][0]["loss"])
  # The step's rollout and the sampled evaluation (the greedy one has 8
  # rows: one per slot, so every row at once).
  assert engine.trace_count() - before >= 2
  assert len(calls) >= 3 and all(  # the rollout and both evaluations
      (k["max_slots"], k["prefill_chunk"], k["cache_phases"]) == (8, 4, 2) for k in calls)


# An entropy bonus of 1e300 is a valid float64 config value and infinite in
# the float32 loss: every update is non-finite (a NaN learning rate, the
# old way to get there, is now refused by the config validation).
NONFINITE = {"sft.steps": 0, "rl.steps": 6, "rl.num_minibatches": 1,
             "rl.max_nonfinite": 2, "loss.entropy_coef": 1e300,
             "log.backends": "", "checkpoint.every": 0}


@pytest.mark.slow
def test_non_finite_updates_in_a_row_stop_the_run(tmp_path):
  """Every update non-finite: each is skipped and counted, and
  rl.max_nonfinite of them in a row stop the run with the step-0
  checkpoint intact."""
  config = tu.smoke_config(**NONFINITE)
  out = trainer.run(config, str(tmp_path))
  assert out["stopped"] == "nonfinite"
  assert out["step"] < 6
  records = metrics_lib.read_metrics(str(tmp_path))
  assert [records[s]["nonfinite"] for s in (1, 2)] == [1.0, 1.0]
  assert int(out["state"].nonfinite) == out["step"]
  from ba_jax.run import checkpointing
  assert checkpointing.Checkpointer(str(tmp_path)).all_steps() == [0]
  start = tu.host_params(setup_lib.init_params(setup_lib.make_setup(config)))
  assert tu.max_abs_diff(tu.host_params(out["state"]), start) == 0.0


@pytest.mark.slow
def test_the_non_finite_guard_exits_with_status_3(tmp_path, capsys, monkeypatch):
  code, err = tu.train_cli(["--config=configs/tiny.py:smoke", f"--workdir={tmp_path}"] + [
      f"--config.{k}={v}" for k, v in NONFINITE.items()], capsys, monkeypatch)
  assert code == 3, err[-3000:]
  # metrics are read one step behind: the guard trips at step 2 or 3
  assert re.fullmatch(r"error: stopped at step [23]: rl.max_nonfinite=2 "
                      r"non-finite updates in a row", err.strip().split("\n")[-1])


def test_dataset_task_streams_formats_and_grades():
  """The dataset task behind the paper configs, on the bundled fixtures."""
  import ml_collections
  from ba_jax.tasks import dataset_task
  fixtures = os.path.join(tu.REPO, "tests", "fixtures")
  task_cfg = ml_collections.ConfigDict(dict(
      name="polaris", path=os.path.join(fixtures, "polaris.jsonl"),
      min_difficulty=None, max_difficulty=0.875, template="boxed",
      rule="boxed", correct_score=1.0, incorrect_score=-1.0))
  eval_cfg = ml_collections.ConfigDict(dict(
      benchmarks="aime24,math500", data_dir=os.path.join(fixtures, "eval"),
      num_problems=2))
  task = dataset_task.DatasetTask(task_cfg, eval_cfg, seed=0,
                                  tokenizer=tu.char_tokenizer(),
                                  max_prompt_len=160)
  n = len(task.examples)
  assert n >= 2  # the 8/8 row is over max_difficulty=0.875: dropped
  assert not any("binom{6}{2}" in e.problem for e in task.examples)
  epoch = task.problems(0, n)
  assert sorted(map(id, epoch)) == sorted(map(id, task.examples))
  assert task.problems(n, 3) == task.problems(n, 5)[:3]  # next epoch
  assert task.problems(2, 3) == epoch[2:5]
  assert len(task.heldout) == 4
  ids, mask = task.encode_prompts(epoch[:2])
  assert ids.shape == mask.shape == (2, 160)
  assert mask[:, -1].all() and not mask[:, 0].any()  # left-padded
  text = task.tokenizer.decode(ids[0][mask[0] == 1])
  assert text.startswith(epoch[0].problem) and "\\boxed{}" in text
  p = epoch[0]
  rewards, correct = task.grade([f"so \\boxed{{{p.answer}}}", "no idea"],
                                [p, p])
  assert rewards.tolist() == [1.0, -1.0] and correct.tolist() == [True, False]
  assert not task.has_warmup
  with pytest.raises(ValueError, match="sft.steps=0"):
    task.warmup_examples(0, 1)


@pytest.mark.parametrize("config_file,data", [
    ("qwen25_math_7b_dapo17k.py", "dapo"), ("qwen3_1p7b_polaris.py", "polaris")])
def test_paper_config_task_sections_drive_the_dataset_task(tmp_path,
                                                           config_file, data):
  """The paper configs' own task and eval sections, pointed at fixtures."""
  import importlib.util
  import json

  import pyarrow as pa
  import pyarrow.parquet as pq
  from ba_jax.tasks import dataset_task
  fixtures = os.path.join(tu.REPO, "tests", "fixtures")
  spec = importlib.util.spec_from_file_location(
      "paper_config", os.path.join(tu.REPO, "configs", config_file))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config()
  if data == "dapo":
    with open(os.path.join(fixtures, "dapo_math_rows.json")) as f:
      rows = json.load(f)
    path = str(tmp_path / "dapo.parquet")
    pq.write_table(pa.Table.from_pylist(rows + rows), path)  # duplicated
  else:
    path = os.path.join(fixtures, "polaris.jsonl")
  config.task.path = path
  config.eval.data_dir = os.path.join(fixtures, "eval")
  config.eval.num_problems = 1
  task = dataset_task.DatasetTask(config.task, config.eval, seed=0,
                                  tokenizer=tu.char_tokenizer(),
                                  max_prompt_len=1024)
  if data == "dapo":
    assert len(task.examples) == len(rows)  # deduplicated
  assert len(task.heldout) == 6  # one problem of each of the six benchmarks
  p = task.problems(0, 1)[0]
  answer = (f"Answer: {p.answer}" if config.task.rule == "answer"
            else f"\\boxed{{{p.answer}}}")
  rewards, correct = task.grade([answer, "no idea"], [p, p])
  assert rewards.tolist() == [config.task.correct_score,
                              config.task.incorrect_score]
  assert correct.tolist() == [True, False]


def test_a_run_keeps_the_collector_off_its_long_lived_objects(tmp_path, monkeypatch):
  """trainer.run freezes the objects alive at its start and, after the first
  RL step, those that step made (its traced programs), so a full collection
  does not rescan them; on return they go back to the collector."""
  import gc  # pylint: disable=import-outside-toplevel
  from ba_jax.run import rollout  # pylint: disable=import-outside-toplevel
  config = tu.smoke_config(**{"sft.steps": 0, "rl.steps": 3, "log.backends": "",
                              "checkpoint.every": 0})
  frozen, real = [], rollout.collect
  monkeypatch.setattr(rollout, "collect",
                      lambda *a, **k: frozen.append(gc.get_freeze_count()) or real(*a, **k))
  assert gc.get_freeze_count() == 0
  out = trainer.run(config, str(tmp_path))
  assert out["step"] == 3 and len(frozen) == 3
  # Frozen at the start, and more after the first step (its programs).
  assert 0 < frozen[0] < frozen[1]
  assert gc.get_freeze_count() == 0


def test_frozen_heap_collects_what_is_made_inside_and_leaves_a_callers_freeze():
  import gc  # pylint: disable=import-outside-toplevel
  import weakref  # pylint: disable=import-outside-toplevel

  class Node:
    pass

  with trainer.FrozenHeap() as heap:
    assert heap.active and gc.get_freeze_count() > 0
    cycle = Node()
    cycle.self = cycle
    ref = weakref.ref(cycle)
    del cycle
    gc.collect()
    assert ref() is None  # garbage made inside is collected as usual
  assert gc.get_freeze_count() == 0
  gc.freeze()  # a caller's own freeze (e.g. before forking)
  try:
    with trainer.FrozenHeap() as heap:
      assert not heap.active
    assert gc.get_freeze_count() > 0  # not unfrozen (that empties it)
  finally:
    gc.unfreeze()
