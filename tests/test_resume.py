"""Resuming a workdir: damaged checkpoints, changed configs, replayed rows."""
import glob
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ba_jax.run import checkpointing
from ba_jax import export
from ba_jax.run import metrics as metrics_lib
from ba_jax.run import resume
from ba_jax.run import trainer
import trainer_utils as tu


def _step_dir(workdir, step):
  return os.path.join(workdir, "checkpoints", str(step))


def _truncate(path, size=5):
  with open(path, "r+b") as f:
    f.truncate(size)


# Each way of damaging a step: a file of the state item, of the meta item,
# the step directory's own metadata (deleted or truncated).
DAMAGE = {
    "state file deleted": lambda d: os.remove(f"{d}/state/_METADATA"),
    "state manifest deleted": lambda d: os.remove(
        f"{d}/state/manifest.ocdbt"),
    "state data truncated": lambda d: [_truncate(p) for p in glob.glob(
        f"{d}/state/**/d/*", recursive=True)],
    "state item deleted": lambda d: shutil.rmtree(f"{d}/state"),
    "meta deleted": lambda d: os.remove(f"{d}/meta/metadata"),
    "meta truncated": lambda d: _truncate(f"{d}/meta/metadata"),
    "step metadata deleted": lambda d: os.remove(
        f"{d}/_CHECKPOINT_METADATA"),
    "step metadata truncated": lambda d: _truncate(
        f"{d}/_CHECKPOINT_METADATA", 3),
}


def _saved(workdir, steps=(1, 2)):
  """A workdir with a small state saved at ``steps`` (values = step)."""
  ckpt = checkpointing.Checkpointer(workdir, keep=5, async_save=False)
  for step in steps:
    state = {"w": jnp.full((8, 4), float(step)), "b": jnp.arange(3) + step}
    assert ckpt.save(step, state, {"data_position": 10 * step})
  ckpt.wait()
  return ckpt, checkpointing.abstract_like(state)


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_newest_step_falls_back_to_the_older_one(tmp_path, damage):
  workdir = str(tmp_path)
  ckpt, abstract = _saved(workdir)
  ckpt.close()
  DAMAGE[damage](_step_dir(workdir, 2))
  warnings = []
  ckpt = checkpointing.Checkpointer(workdir, keep=5, async_save=False)
  step, state, meta = ckpt.restore_intact(abstract, warn=warnings.append,
                                          set_aside=True)
  assert (step, meta) == (1, {"data_position": 10})
  np.testing.assert_array_equal(state["w"], np.full((8, 4), 1.0))
  np.testing.assert_array_equal(state["b"], [1, 2, 3])
  assert len(warnings) == 1 and "\n" not in warnings[0]
  assert warnings[0].startswith("WARNING: checkpoint step 2 (")
  assert "falling back to step 1" in warnings[0]
  # The damaged step is kept aside, out of the way of its next save.
  assert ckpt.all_steps() == [1]
  assert os.path.isdir(tmp_path / "damaged_checkpoints" / "2")
  assert ckpt.save(2, jax.tree.map(jnp.zeros_like, state), {"x": 1})
  ckpt.close()


def test_the_warning_names_the_item_and_the_file(tmp_path):
  workdir = str(tmp_path)
  ckpt, abstract = _saved(workdir)
  os.remove(os.path.join(_step_dir(workdir, 2), "meta", "metadata"))
  warnings = []
  ckpt.restore_intact(abstract, warn=warnings.append)
  assert "(meta: FileNotFoundError: " in warnings[0]
  assert "2/meta/metadata not found" in warnings[0]
  ckpt.close()


def test_no_intact_step_is_one_clear_line(tmp_path):
  workdir = str(tmp_path)
  ckpt, abstract = _saved(workdir)
  for step in (1, 2):
    os.remove(os.path.join(_step_dir(workdir, step), "meta", "metadata"))
  warnings = []
  with pytest.raises(checkpointing.NoIntactCheckpoint) as info:
    ckpt.restore_intact(abstract, warn=warnings.append)
  message = str(info.value)
  assert "\n" not in message
  assert message.startswith(f"no intact checkpoint under {ckpt.directory}: "
                            "step 2 (meta: FileNotFoundError")
  assert "; step 1 (meta: " in message
  assert warnings[-1].endswith("no older step")
  ckpt.close()


def _fast_config(**overrides):
  """The smoke config without warm-up: RL steps only, a small evaluation."""
  base = {"sft.steps": 0, "rl.steps": 3, "rl.num_minibatches": 1,
          "checkpoint.every": 1, "checkpoint.keep": 5,
          "log.backends": "", "eval.num_problems": 8,
          "eval.samples_per_problem": 1}
  base.update(overrides)
  return tu.smoke_config(**base)


TIMING = ("time_sampling", "time_rewards", "time_training", "time_step",
          "tokens_per_s")


def _rows(path):
  return [json.loads(l) for l in open(path).read().split("\n") if l]


@pytest.mark.slow
def test_resume_past_a_damaged_step_is_exact_and_logs_each_step_once(
    tmp_path):
  """3 steps straight == 2 steps, step 2's state damaged, rerun: it falls
  back to step 1 with a warning and replays step 2; every step is in
  metrics.jsonl once, with the straight run's values; export names nothing
  wrong then, and with every step damaged says so in one line."""
  straight = trainer.run(_fast_config(**{"eval.every": 1}),
                         str(tmp_path / "a"))
  workdir = str(tmp_path / "b")
  first = trainer.run(_fast_config(**{"eval.every": 1, "stop_after_steps": 2}),
                      workdir)
  assert first["stopped"] == "stop_after_steps"
  DAMAGE["state data truncated"](_step_dir(workdir, 2))
  resumed = trainer.run(_fast_config(**{"eval.every": 1}), workdir)
  assert resumed["step"] == 3 and resumed["stopped"] is None
  assert os.path.isdir(os.path.join(workdir, "damaged_checkpoints", "2"))
  rows = _rows(os.path.join(workdir, "metrics.jsonl"))
  assert [r["step"] for r in rows] == [1, 2, 3]
  expected = _rows(str(tmp_path / "a" / "metrics.jsonl"))
  for got, want in zip(rows, expected):
    assert {k: v for k, v in got.items() if k not in TIMING} == {
        k: v for k, v in want.items() if k not in TIMING}
  evals = _rows(os.path.join(workdir, "eval.jsonl"))
  assert evals == _rows(str(tmp_path / "a" / "eval.jsonl"))
  assert [e["step"] for e in evals] == [0, 1, 2, 3]
  assert tu.max_abs_diff(tu.host_params(resumed["state"]),
                         tu.host_params(straight["state"])) == 0.0

  steps = checkpointing.Checkpointer(workdir).all_steps()
  for step in steps[:-1]:
    DAMAGE["meta deleted"](_step_dir(workdir, step))
  # A failed tensorstore read leaves callbacks that would print one
  # "Event loop is closed" traceback per array: they must not show.
  DAMAGE["state manifest deleted"](_step_dir(workdir, steps[-1]))
  out = tu.run_module(["ba_jax.export", f"--workdir={workdir}",
                       f"--output_dir={tmp_path / 'hf'}"], timeout=300)
  assert out.returncode == 2
  assert out.stderr.strip().split("\n")[-1].startswith(
      "error: no intact checkpoint under ")
  assert "Traceback" not in out.stderr
  assert "Event loop is closed" not in out.stderr
  assert not os.path.exists(tmp_path / "hf")


@pytest.fixture(scope="module")
def resumable(tmp_path_factory):
  """A workdir with a step-0 checkpoint (no RL step: fast)."""
  workdir = str(tmp_path_factory.mktemp("resumable"))
  trainer.run(_fast_config(**{"rl.steps": 0}), workdir)
  return workdir


@pytest.mark.parametrize("overrides, listed", [
    ({"loss.aggregation": "token"}, "loss.aggregation: 'balanced' -> 'token'"),
    ({"seed": 3}, "seed: 0 -> 3"),
    ({"rl.group_size": 2, "rl.prompts_per_step": 8},
     "rl.group_size: 4 -> 2, rl.prompts_per_step: 4 -> 8"),
    ({"optim.learning_rate": 1e-3}, "optim.learning_rate: 0.0001 -> 0.001"),
    ({"task.max_terms": 4}, "task.max_terms: 3 -> 4"),
])
def test_resuming_with_another_experiment_is_refused(resumable, overrides,
                                                     listed):
  before = open(os.path.join(resumable, "config.json")).read()
  config = _fast_config(**{"rl.steps": 0, **overrides})
  with pytest.raises(resume.ConfigChanged) as info:
    trainer.run(config, resumable)
  message = str(info.value)
  assert "\n" not in message and listed in message
  assert "--allow_config_change" in message
  assert open(os.path.join(resumable, "config.json")).read() == before


def test_another_model_size_is_one_line_not_a_shape_error(resumable):
  config = _fast_config(**{"rl.steps": 0, "model.hidden_size": 64,
                           "model.intermediate_size": 128})
  with pytest.raises(resume.ConfigChanged) as info:
    trainer.run(config, resumable, allow_config_change=True)
  message = str(info.value)
  assert "\n" not in message
  assert "model.hidden_size: 32 -> 64" in message
  assert "cannot be restored into this architecture" in message


def test_a_config_saved_before_the_rollout_cache_keys_resumes():
  saved = {"rl": {"steps": 2, "max_slots": 0}}
  new = {"rl": {"steps": 2, "max_slots": 0, "prefill_chunk": 0, "cache_phases": 0}}
  assert resume.differences(saved, new) == {}
  assert resume.differences(saved, {"rl": {"steps": 2, "max_slots": 4}}) == {
      "rl.max_slots": (0, 4)}


@pytest.mark.slow
def test_runtime_keys_may_change_and_allowed_changes_are_recorded(resumable):
  free = {"rl.steps": 0, "log.backends": "tensorboard", "checkpoint.every": 7,
          "eval.every": 5, "mesh.data": 4, "mesh.fsdp": 2,
          "stop_after_steps": 9, "rl.prefill_chunk": 8, "rl.cache_phases": 1}
  out = trainer.run(_fast_config(**free), resumable)
  assert out["step"] == 0
  assert not os.path.exists(os.path.join(resumable, resume.CHANGES_FILE))
  saved = json.load(open(os.path.join(resumable, "config.json")))
  assert saved["checkpoint"]["every"] == 7  # the current run's settings
  out = trainer.run(_fast_config(**{"rl.steps": 0, "loss.entropy_coef": 0.01}),
                    resumable, allow_config_change=True)
  changes = _rows(os.path.join(resumable, resume.CHANGES_FILE))
  assert [c["changes"] for c in changes] == [{"loss.entropy_coef": [0.0, 0.01]}]
  saved = json.load(open(os.path.join(resumable, "config.json")))
  assert saved["loss"]["entropy_coef"] == 0.01
