"""Experiment tracking (``ba_jax.run.tracking``): one smoke job with the W&B
backend offline, resumed once, read back from its own files; samples.jsonl;
reward terms; a missing backend package; the retired ``log.tensorboard``."""
import importlib.util
import json
import os
import shutil

import numpy as np
import pytest

from ba_jax.config import schema
from ba_jax.loss import advantages as advantages_lib
from ba_jax.loss import aggregation as agg
from ba_jax.run import resume, trainer, workdir as workdir_lib
from ba_jax.tasks import registry, synthetic
import trainer_utils as tu
import wandb_records

STEPS, PROMPTS, G, MINIBATCHES = 3, 4, 4, 2


class TermsTask(synthetic.SyntheticTask):
  """The addition task with a reward of two terms: the answer's, and a
  brevity term that differs between responses (so every group has a
  signal and every aggregation weight is exercised)."""
  name = "synthetic_sum_terms"

  def grade_components(self, texts, problems):
    answer, correct = self.grade(texts, problems)
    brevity = np.array([-0.01 * len(t) for t in texts], np.float32)
    return {"answer": answer, "brevity": brevity}, correct


def _config():
  return tu.smoke_config(**{
      "task.name": TermsTask.name, "sft.steps": 0, "rl.steps": STEPS,
      "rl.prompts_per_step": PROMPTS, "rl.group_size": G,
      "rl.num_minibatches": MINIBATCHES, "rl.overlong": "soft",
      "checkpoint.every": 2, "eval.num_problems": 8,
      "eval.samples_per_problem": 1, "log.backends": "tensorboard,wandb",
      "log.samples_every": 1, "log.samples_groups": PROMPTS,
      "log.wandb_project": "ba_jax_test"})


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """The smoke job with TensorBoard and W&B (offline, files under the
  test's directory), then resumed after losing its last checkpoint: the
  rows of step 3 were written, its checkpoint was not."""
  tmp = tmp_path_factory.mktemp("tracking")
  registry.register(TermsTask, section=schema.SyntheticSumTask)
  try:
    with pytest.MonkeyPatch.context() as mp:
      wandb_records.offline_env(mp, tmp / "wandb_files")
      workdir = str(tmp / "run")
      first = trainer.run(_config(), workdir)
      shutil.rmtree(os.path.join(workdir, "checkpoints", str(STEPS)))
      resumed = trainer.run(_config(), workdir)
  finally:
    registry._REGISTRY.pop(TermsTask.name, None)
    schema.TASK_SECTIONS.pop(TermsTask.name, None)
  runs = wandb_records.runs(tmp / "wandb_files")
  return dict(workdir=workdir, first=first, resumed=resumed, wandb_runs=runs)


def _rows(path):
  return [json.loads(l) for l in open(path).read().split("\n") if l]


def test_wandb_offline_files_hold_the_scalars_table_and_config(run):
  first, resumed = run["wandb_runs"]  # one W&B run directory per session
  assert os.path.basename(first).split("-")[-1] == open(
      os.path.join(run["workdir"], "wandb_run_id")).read().strip()
  assert first.split("-")[-1] == resumed.split("-")[-1]  # the same W&B run
  history = wandb_records.history(first)
  metrics = {r["step"]: r for r in _rows(os.path.join(run["workdir"],
                                                      "metrics.jsonl"))}
  for step in range(1, STEPS + 1):
    for name in ("reward_mean", "loss", "grad_norm", "w_pos",
                 "reward/answer", "reward/brevity",
                 "reward/overlong_penalty"):
      assert history[step][name] == pytest.approx(metrics[step][name],
                                                  rel=1e-6), (step, name)
  evals = {r["step"]: r for r in _rows(os.path.join(run["workdir"],
                                                    "eval.jsonl"))}
  assert history[0]["eval/heldout_acc_greedy"] == evals[0]["heldout_acc_greedy"]
  # The completions table: W&B keeps it as a file beside the run.
  samples = _rows(os.path.join(run["workdir"], "samples.jsonl"))
  for step in range(1, STEPS + 1):
    ref = {k[len("samples/"):]: v for k, v in history[step].items()
           if k.startswith("samples/")}  # the table's reference
    assert ref["_type"] == "table-file" and ref["nrows"] == PROMPTS * G
    table = json.load(open(os.path.join(first, "files", ref["path"])))
    got = [dict(zip(table["columns"], row)) for row in table["data"]]
    want = [r for r in samples if r["step"] == step]
    assert [r["response"] for r in got] == [r["response"] for r in want]
    for g, w in zip(got, want):
      assert g.keys() == w.keys()
      for key in ("reward", "advantage", "weight", "length"):
        assert g[key] == pytest.approx(w[key], rel=1e-6)
  config = wandb_records.config(first)
  assert config["loss"]["aggregation"] == "balanced"
  assert config["rl"]["group_size"] == G
  # The resumed session replays step 3, which W&B already has: not sent.
  assert not [s for s in wandb_records.history(resumed) if s <= STEPS]


def test_samples_jsonl_rows_are_the_batch_once_per_step(run):
  rows = _rows(os.path.join(run["workdir"], "samples.jsonl"))
  assert [r["step"] for r in rows] == [s for s in range(1, STEPS + 1)
                                       for _ in range(PROMPTS * G)]
  assert set(rows[0]) == {
      "step", "group", "prompt", "response", "reward", "reward/answer",
      "reward/brevity", "reward/overlong_penalty", "correct", "length",
      "truncated", "advantage", "weight"}
  for step in range(1, STEPS + 1):
    batch = [r for r in rows if r["step"] == step]
    rewards = np.array([r["reward"] for r in batch], np.float32)
    terms = sum(np.array([r[f"reward/{k}"] for r in batch], np.float32)
                for k in ("answer", "brevity", "overlong_penalty"))
    np.testing.assert_allclose(terms, rewards, atol=1e-6)
    adv = np.array([r["advantage"] for r in batch], np.float32)
    np.testing.assert_allclose(
        adv, advantages_lib.group_advantages(rewards, G), atol=1e-6)
    lengths = np.array([r["length"] for r in batch])
    assert all(len(r["response"]) <= r["length"] for r in batch)
    # The weight is the row's sum of the train step's token weights in its
    # mini-batch (2 of 8 rows); each mini-batch's weights sum to 1 here.
    mask = (np.arange(lengths.max())[None] < lengths[:, None]).astype(np.float32)
    weights = np.array([r["weight"] for r in batch])
    rows_per = PROMPTS * G // MINIBATCHES
    for m in range(MINIBATCHES):
      part = slice(m * rows_per, (m + 1) * rows_per)
      want = np.asarray(agg.token_weights(mask[part], adv[part],
                                          mode="balanced", group_size=G))
      np.testing.assert_allclose(weights[part], want.sum(-1), rtol=1e-6)
      assert weights[part].sum() == pytest.approx(1.0, abs=1e-6)


def test_reward_terms_are_logged_and_add_up(run):
  rows = _rows(os.path.join(run["workdir"], "metrics.jsonl"))
  assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
  for r in rows:
    total = (r["reward/answer"] + r["reward/brevity"]
             + r["reward/overlong_penalty"])
    assert total == pytest.approx(r["reward_mean"], abs=1e-6)
  assert os.listdir(os.path.join(run["workdir"], "tb"))


def test_drop_replayed_rows_keeps_samples_up_to_the_checkpoint(tmp_path):
  with open(tmp_path / "samples.jsonl", "w") as f:
    for step in (1, 1, 2, 3, 3):
      f.write(json.dumps({"step": step, "response": "x"}) + "\n")
  with open(tmp_path / "metrics.jsonl", "w") as f:
    for step in (1, 2, 3):
      f.write(json.dumps({"step": step}) + "\n")
  assert resume.last_logged_step(str(tmp_path)) == 3
  assert resume.drop_replayed_rows(str(tmp_path), 2) == 3
  assert [r["step"] for r in _rows(tmp_path / "samples.jsonl")] == [1, 1, 2]
  assert resume.last_logged_step(str(tmp_path)) == 2


def test_a_missing_backend_package_is_one_line(tmp_path, capsys, monkeypatch):
  find_spec = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: (
      None if name == "wandb" else find_spec(name, *a)))
  code, err = tu.train_cli(
      ["--config=configs/tiny.py:smoke", f"--workdir={tmp_path / 'w'}",
       "--config.log.backends=tensorboard,wandb"], capsys, monkeypatch)
  assert code == 2
  assert err.strip() == (
      "error: log.backends='tensorboard,wandb': wandb needs the wandb "
      'package, which is not installed: pip install -e ".[tracking]"')
  assert not os.path.exists(tmp_path / "w" / "checkpoints")


def test_bad_backend_names_and_the_retired_tensorboard_key():
  config = tu.smoke_config(**{"log.backends": "tensorboard,mlflow"})
  with pytest.raises(ValueError, match=r"log.backends='tensorboard,mlflow': "
                     "expected comma-separated names among tensorboard, wandb"):
    schema.parse(config)
  config = tu.smoke_config()
  with config.unlocked():
    config.log.tensorboard = False
  with pytest.raises(ValueError, match=r"log.tensorboard: no longer a key; "
                     r"use log.backends"):
    schema.parse(config)
  # A run saved with it still resumes, exports and evaluates.
  saved = json.loads(config.to_json())
  assert resume.differences(saved, json.loads(tu.smoke_config().to_json())) == {}
  schema.parse(schema.drop_retired(saved))


def test_a_workdir_saved_with_log_tensorboard_loads(tmp_path):
  config = tu.smoke_config()
  with config.unlocked():
    config.log.tensorboard = True
  (tmp_path / "config.json").write_text(config.to_json())
  loaded = workdir_lib.load_run_config(str(tmp_path))
  assert "tensorboard" not in loaded.log
  schema.parse(loaded)
