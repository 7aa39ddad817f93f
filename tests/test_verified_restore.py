"""Runs, export and evaluate on a workdir whose newest step is damaged in a
way orbax reads without an error: each uses the older step, named in one
warning, and the resumed run equals an uninterrupted one. A run that ends
in non-finite updates says how many in its summary and exit status."""
import json
import os
import shutil

import numpy as np
import pytest
from flax import nnx

from ba_jax import export, train
from ba_jax.policy import hf
from ba_jax.run import eval_lib
from ba_jax.run import metrics as metrics_lib
from ba_jax.run import setup as setup_lib
from ba_jax.run import trainer
from ba_jax.run import workdir as workdir_lib
import checkpoint_damage as cd
import trainer_utils as tu

TIMING = ("time_sampling", "time_rewards", "time_training", "time_step",
          "tokens_per_s")
# Checkpoints at every step; the soft overlong penalty makes the random
# policy's rewards vary, so every update moves the parameters.
RUN = {"sft.steps": 0, "rl.steps": 3, "rl.num_minibatches": 1,
       "checkpoint.every": 1, "checkpoint.keep": 5, "log.backends": "",
       "eval.num_problems": 8, "eval.samples_per_problem": 1,
       "rl.overlong": "soft", "rl.overlong_buffer": 20}
EVAL_DIR = os.path.join(tu.REPO, "tests", "fixtures", "eval")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """An uninterrupted 3-step run, and one stopped after step 2 (its
  checkpoints: steps 0, 1 and 2)."""
  root = tmp_path_factory.mktemp("runs")
  straight = trainer.run(tu.smoke_config(**RUN), str(root / "straight"))
  # Step 1's learning rate is 0 (optim.warmup_steps); the replayed steps
  # 2 and 3 move the parameters.
  assert [r["update_norm"] > 0 for r in straight["history"]] == [
      False, True, True]
  stopped = trainer.run(tu.smoke_config(**RUN, stop_after_steps=2),
                        str(root / "stopped"))
  assert stopped["step"] == 2
  return root, straight


def _damaged_copy(runs, tmp_path, kind: str, step: int = 2):
  """A copy of the stopped run with ``step`` damaged: (workdir, array)."""
  workdir = str(tmp_path / "run")
  shutil.copytree(runs[0] / "stopped", workdir)
  abstract = setup_lib.abstract_state(setup_lib.make_setup(
      tu.smoke_config(**RUN), abstract=True))
  return workdir, cd.DAMAGE[kind](workdir, step, abstract)


def _warnings(text: str) -> list[str]:
  return [l for l in text.split("\n") if l.startswith("WARNING")]


def _params(model) -> list[np.ndarray]:
  return tu.host_params(nnx.state(model))


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(cd.DAMAGE))
def test_a_run_resumes_past_a_damaged_step_exactly(runs, tmp_path, capsys,
                                                   kind):
  """Step 2 damaged, rerun: one warning, step 2 set aside, steps 2 and 3
  replayed from step 1; metrics and final parameters as the uninterrupted
  run's."""
  workdir, array = _damaged_copy(runs, tmp_path, kind)
  capsys.readouterr()
  resumed = trainer.run(tu.smoke_config(**RUN), workdir)
  out = capsys.readouterr().out
  ckpt_dir = os.path.join(workdir, "checkpoints")
  warnings = _warnings(out)
  assert len(warnings) == 1, warnings
  assert warnings[0].startswith(
      f"WARNING: checkpoint step 2 (state: {cd.says(kind, array)}")
  assert warnings[0].endswith(
      f"under {ckpt_dir} is damaged; falling back to step 1")
  assert f"resumed from {ckpt_dir} at step 1" in out
  assert os.path.isdir(os.path.join(workdir, "damaged_checkpoints", "2"))
  assert (resumed["step"], resumed["stopped"]) == (3, None)
  assert resumed["nonfinite_updates"] == 0
  got = metrics_lib.read_metrics(workdir)
  want = metrics_lib.read_metrics(str(runs[0] / "straight"))
  assert sorted(got) == sorted(want) == [1, 2, 3]
  for step in want:
    assert {k: v for k, v in got[step].items() if k not in TIMING} == {
        k: v for k, v in want[step].items() if k not in TIMING}, step
  assert tu.max_abs_diff(tu.host_params(resumed["state"]),
                         tu.host_params(runs[1]["state"])) == 0.0


@pytest.mark.slow
def test_export_and_evaluate_use_the_newest_intact_step(runs, tmp_path,
                                                        capsys):
  """A one-bit change in an AdamW moment of step 2 (export does not even
  write the moments): export and evaluate's loader warn and use step 1; a
  NaN in step 1's parameters (saved with its digests) too, down to step
  0; with every step damaged both commands refuse with one line."""
  workdir, moment = _damaged_copy(runs, tmp_path, "moment value, lowest bit")
  step1, _, _ = workdir_lib.restore_policy(workdir, step=1)
  capsys.readouterr()
  out_dir = str(tmp_path / "hf")
  export.export(workdir, out_dir)
  warnings = _warnings(capsys.readouterr().out)
  assert len(warnings) == 1 and warnings[0].startswith(
      f"WARNING: checkpoint step 2 (state: digest mismatch: {moment} shard [")
  exported, _ = hf.load_pretrained(out_dir)
  assert tu.max_abs_diff(_params(exported), _params(step1)) == 0.0

  abstract = setup_lib.abstract_state(setup_lib.make_setup(
      tu.smoke_config(**RUN), abstract=True))
  cd.DAMAGE["parameter saved as NaN"](workdir, 1, abstract)
  step0, _, _ = workdir_lib.restore_policy(workdir, step=0)
  capsys.readouterr()
  model, _, _ = eval_lib.load_policy(workdir)
  warnings = _warnings(capsys.readouterr().out)
  assert [w.split(" (")[0] for w in warnings] == [
      "WARNING: checkpoint step 2", "WARNING: checkpoint step 1"]
  assert f"(state: non-finite values (NaN or inf): 1 in {cd.PARAM})" in (
      warnings[1])
  assert tu.max_abs_diff(_params(model), _params(step0)) == 0.0

  cd.DAMAGE["parameter set to NaN"](workdir, 0, abstract)
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1",
             JAX_PLATFORMS="cpu")
  commands = {
      "export": ["ba_jax.export", f"--workdir={workdir}",
                 f"--output_dir={tmp_path / 'hf2'}"],
      "evaluate": ["ba_jax.evaluate", f"--model={workdir}",
                   "--benchmarks=aime24", f"--data_dir={EVAL_DIR}", "--k=1",
                   f"--output_dir={tmp_path / 'eval'}", "--num_workers=1"],
      "evaluate a damaged --step": [
          "ba_jax.evaluate", f"--model={workdir}", "--step=1",
          "--benchmarks=aime24", f"--data_dir={EVAL_DIR}", "--k=1",
          f"--output_dir={tmp_path / 'eval'}", "--num_workers=1"]}
  ckpt_dir = os.path.join(workdir, "checkpoints")
  for name, args in commands.items():
    done = tu.run_module(args, env=env, timeout=300)
    assert done.returncode == 2, (name, done.stderr[-3000:])
    last = done.stderr.strip().split("\n")[-1]
    assert "Traceback" not in done.stderr, name
    if name.endswith("--step"):
      assert last.startswith(f"error: checkpoint step 1 under {ckpt_dir} is "
                             "damaged (state: non-finite values"), last
    else:
      assert last.startswith(f"error: no intact checkpoint under {ckpt_dir}: "
                             "step 2 (state: digest mismatch: "), last
      assert "; step 0 (state: digest mismatch: " in last
  assert not os.path.exists(tmp_path / "hf2")
  assert not os.path.exists(tmp_path / "eval" / "results.json")


# Every update non-finite (an entropy bonus of 1e300 is infinite in float32),
# but the run has fewer steps than rl.max_nonfinite: it ends, not stopped.
ENDS_NONFINITE = {"sft.steps": 0, "rl.steps": 2, "rl.num_minibatches": 1,
                  "rl.max_nonfinite": 5, "loss.entropy_coef": 1e300,
                  "log.backends": "", "checkpoint.every": 0,
                  "eval.num_problems": 8, "eval.samples_per_problem": 1}


@pytest.mark.slow
def test_a_run_that_ends_in_non_finite_updates_exits_3(tmp_path, capsys, monkeypatch):
  code, err = tu.train_cli(["--config=configs/tiny.py:smoke", f"--workdir={tmp_path}"] + [
      f"--config.{k}={v}" for k, v in ENDS_NONFINITE.items()], capsys, monkeypatch)
  assert code == 3, err[-3000:]
  assert err.strip().split("\n")[-1] == (
      "error: the run ended at step 2 after 2 step(s) in a row with "
      "non-finite updates; 2 updates were skipped in all (summary.json: "
      "nonfinite_updates)")
  summary = json.load(open(tmp_path / "summary.json"))
  assert (summary["nonfinite_updates"], summary["nonfinite_steps_at_end"]) == (
      2, 2)


def test_the_exit_status_says_how_many_updates_were_skipped():
  """``ba_jax.train.exit_status``: the status and the stderr line."""
  cases = [
      {"stopped": None, "step": 9},
      {"stopped": None, "step": 9, "nonfinite_updates": 3,
       "nonfinite_steps_at_end": 0},
      {"stopped": None, "step": 9, "nonfinite_updates": 3,
       "nonfinite_steps_at_end": 1},
      {"stopped": "nonfinite", "step": 4, "nonfinite_updates": 5,
       "nonfinite_steps_at_end": 5},
      {"stopped": "preempted", "step": 4, "nonfinite_updates": 1,
       "nonfinite_steps_at_end": 1}]
  assert [list(train.exit_status(s, 5)) for s in cases] == [
      [0, None],
      [0, "warning: 3 non-finite updates were skipped in this run "
          "(summary.json: nonfinite_updates)"],
      [3, "error: the run ended at step 9 after 1 step(s) in a row with "
          "non-finite updates; 3 updates were skipped in all (summary.json: "
          "nonfinite_updates)"],
      [3, "error: stopped at step 4: rl.max_nonfinite=5 non-finite updates "
          "in a row"],
      [0, "warning: 1 non-finite updates were skipped in this run "
          "(summary.json: nonfinite_updates)"]]
