"""A run on a non-local filesystem: every file through ``ba_jax.run.paths``."""
import os
import pathlib
import types

import pytest
from etils import epath

from ba_jax.run import checkpointing
from ba_jax.run import eval_lib
from ba_jax import export
from ba_jax.run import paths
from ba_jax.run import trainer
import fake_gcs
import trainer_utils as tu

EVAL_DIR = pathlib.Path(__file__).parent / "fixtures" / "eval"


def _files(root):
  return sorted(os.path.relpath(os.path.join(d, f), root)
                for d, _, files in os.walk(root) for f in files)


def test_jsonl_rows_on_a_bucket_are_added_and_dropped(tmp_path):
  fake_gcs.install(tmp_path)
  rows = paths.JsonlFile("gs://b/run/metrics.jsonl")
  for step in (1, 2, 3):
    rows.add({"step": step})
  assert rows.keep(lambda r: r["step"] <= 2) == 1
  rows.add({"step": 3, "again": True})
  assert (tmp_path / "b" / "run" / "metrics.jsonl").read_text() == (
      '{"step": 1}\n{"step": 2}\n{"step": 3, "again": true}\n')


@pytest.mark.slow
def test_train_export_evaluate_on_a_bucket_leave_nothing_local(tmp_path,
                                                              monkeypatch):
  """gs:// served offline by fsspec from ``bucket/``. The trainer (also
  resumed, and started from init_from on the bucket, TensorBoard on),
  export and evaluation write only there; the working directory stays empty (no folder "gs:").

  Orbax's arrays go through tensorstore's own gs:// driver, which needs the
  network: for this test orbax's directory is mapped to the bucket's
  backing folder, the one piece not under test here."""
  bucket = tmp_path / "bucket"
  fake_gcs.install(bucket)
  cwd = tmp_path / "cwd"
  cwd.mkdir()
  monkeypatch.chdir(cwd)
  monkeypatch.setattr(checkpointing, "paths", types.SimpleNamespace(
      path=lambda p: epath.Path(fake_gcs.local_path(str(p)))))
  def config(**overrides):
    return tu.smoke_config(**{
        "sft.steps": 0, "rl.steps": 2, "rl.num_minibatches": 1,
        "checkpoint.every": 1, "log.backends": "",
        "eval.num_problems": 8, "eval.samples_per_problem": 1, **overrides})

  first = trainer.run(config(stop_after_steps=1, **{"log.backends": "tensorboard"}),
                      "gs://b/run")
  assert first["step"] == 1
  out = trainer.run(config(**{"log.backends": "tensorboard"}), "gs://b/run")  # resumed from the bucket
  assert out["step"] == 2
  export.export("gs://b/run", "gs://b/hf")
  settings = eval_lib.EvalSettings(n_samples=1, rule="answer",
                                   template="answer")
  for model, results in (("gs://b/run", "gs://b/eval_run"),
                         ("gs://b/hf", "gs://b/eval_hf")):
    eval_lib.run_evaluation(model, ["aime24"], str(EVAL_DIR), results,
                            settings=settings, max_new_tokens=2, batch_size=8,
                            num_workers=1, limit=1)
  trainer.run(config(**{"rl.steps": 0, "init_from": "gs://b/hf"}),
              "gs://b/from_hf")

  files = _files(bucket / "b")
  for name in ("config.json", "model_config.json", "metrics.jsonl",
               "eval.jsonl", "summary.json", "tokenizer/tokenizer.json",
               "checkpoints/2/_CHECKPOINT_METADATA"):
    assert f"run/{name}" in files, name
  for name in ("config.json", "model.safetensors", "tokenizer.json"):
    assert f"hf/{name}" in files, name
  for name in ("eval_run/results.json", "eval_run/results.md",
               "eval_hf/results.json", "from_hf/config.json",
               "from_hf/summary.json"):
    assert name in files, name
  assert len([f for f in files if f.startswith("run/tb/events.")]) == 2
  metrics = (bucket / "b" / "run" / "metrics.jsonl").read_text().split("\n")
  assert [l[:11] for l in metrics if l] == ['{"step": 1,', '{"step": 2,']
  assert os.listdir(cwd) == []
