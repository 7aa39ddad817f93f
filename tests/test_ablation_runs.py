"""How the ablation runner turns a spec into runs (ba_jax.ablation.runner,
summary), and, slow, one real study of tiny runs end to end."""
import json
import pathlib
import os
import shutil
import subprocess
import sys
import time

import pytest

from ba_jax.ablation import protocol, runner, spec as spec_lib, stages, summary
from ba_jax.ablation.store import Store, config_hash, read_rows

ROOT = pathlib.Path(__file__).resolve().parents[1]

BASE = dict(name="x", config="configs/drafts.py", arm_key="loss.aggregation",
            cells={"pos": {"variant": "gap=pos", "overrides": {"eval.num_problems": 4}}},
            arms=["token", "balanced"], rate_key="optim.learning_rate", rates=[3e-4],
            tune_seeds=[], confirm_seeds=[0, 1], overrides={"rl.steps": 20},
            primary=["reward_auc", "w"], comparisons=[["balanced", "token", "superiority"]],
            warmup="per_seed", warmup_variant="gap=none")


def test_a_job_is_the_spec_plus_cell_arm_rate_and_seed():
  spec = spec_lib.from_dict(BASE)
  job = runner.Job(seed=1, cell="pos", arm="balanced", lr=3e-4)
  s = runner.run_settings(spec, job)
  assert s["config"] == "configs/drafts.py:gap=pos"
  assert s["overrides"] == {"rl.steps": 20, "eval.num_problems": 4,
                            "loss.aggregation": "balanced",
                            "optim.learning_rate": 3e-4, "seed": 1, "sft.steps": 0}
  warm = runner.warmup_settings(spec, 1)
  assert warm == dict(config="configs/drafts.py:gap=none",
                      overrides={"rl.steps": 0, "seed": 1})
  assert s["init"] == config_hash(warm)  # the warm-up's hash, not a local path
  cmd = runner.command(dict(s, overrides=dict(s["overrides"], init_from="/w/hf")),
                       "/runs/x")
  assert cmd[1:5] == ["-m", "ba_jax.train", "--config=configs/drafts.py:gap=pos",
                      "--workdir=/runs/x"]
  assert "--config.optim.learning_rate=0.0003" in cmd and "--config.init_from=/w/hf" in cmd
  # every setting is in the key: another seed or arm is another run
  other = runner.run_settings(spec, runner.Job(seed=0, cell="pos", arm="balanced", lr=3e-4))
  assert config_hash(other) != config_hash(s)
  shared = spec_lib.from_dict(dict(BASE, warmup="shared"))
  assert runner.run_settings(shared, job)["init"] == config_hash(
      runner.warmup_settings(shared, 0))
  none = spec_lib.from_dict(dict(BASE, warmup="none", config="configs/tiny.py:smoke",
                                 cells={"all": {"variant": "gap=-6"}}))
  s = runner.run_settings(none, runner.Job(0, "all", "token", 3e-4))
  assert s["config"] == "configs/tiny.py:smoke,gap=-6" and "sft.steps" not in s["overrides"]


class OrderRunner:
  """Records the order of warm-ups and runs; each takes a moment, so runs
  started together overlap."""

  def __init__(self):
    self.events = []

  def warmup(self, settings, workdir):
    self.events.append(("warmup", settings["overrides"]["seed"]))
    time.sleep(0.05)  # a slot that took a job records it before another frees
    return f"/warm/{settings['overrides']['seed']}"

  def train(self, settings, workdir):
    o = settings["overrides"]
    assert o["init_from"] == f"/warm/{o['seed']}"  # its own seed's warm-up
    self.events.append(("run", o["seed"]))
    time.sleep(0.05)
    return dict(reward_auc=0.5)


@pytest.mark.parametrize("parallel", [1, 2])
def test_runs_go_seed_by_seed_each_after_its_own_warm_up(tmp_path, parallel):
  """A study stopped part-way holds whole seeds: with one slot each seed's
  warm-up and runs finish before the next seed's warm-up starts; with two,
  no warm-up starts while an earlier seed has runs waiting, beyond the
  first two warm-ups."""
  spec = spec_lib.from_dict(dict(BASE, confirm_seeds=[0, 1, 2, 3]))
  jobs = [runner.Job(seed, "pos", arm, 3e-4) for seed in range(4)
          for arm in ("token", "balanced")]
  r = OrderRunner()
  runner.execute(jobs, spec, r, Store(tmp_path / "rows.jsonl"), tmp_path / "runs",
                 parallel=parallel, log=lambda *_: None)
  assert sorted(r.events) == sorted([("warmup", s) for s in range(4)] +
                                    [("run", s) for s in range(4) for _ in range(2)])
  if parallel == 1:
    assert r.events == [e for s in range(4) for e in
                        [("warmup", s), ("run", s), ("run", s)]]
  warmed = [s for kind, s in r.events if kind == "warmup"]
  assert warmed == sorted(warmed)
  for i, (kind, seed) in enumerate(r.events):
    if kind == "warmup" and seed >= parallel:
      # every run of seeds two or more back has started by then
      earlier = [s for k, s in r.events[i + 1:] if k == "run" and s < seed - parallel + 1]
      assert earlier == [], r.events


def test_every_run_is_given_the_compilation_cache_the_study_chose(tmp_path, monkeypatch):
  monkeypatch.delenv(runner.CACHE_ENV, raising=False)
  base = {"PATH": "/bin", runner.CACHE_ENV: "/from/the/shell"}
  auto = runner.LocalRunner(2)
  assert auto.with_cache(base) == base  # no study yet: the environment as given
  assert auto.open_study(tmp_path / "runs") == str((tmp_path / "runs/xla_cache").resolve())
  env = auto.with_cache(base)
  assert env[runner.CACHE_ENV] == str(tmp_path.resolve() / "runs/xla_cache")
  assert env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] == "0"
  assert env["PATH"] == "/bin" and base[runner.CACHE_ENV] == "/from/the/shell"
  # auto keeps a cache the user's environment already names
  monkeypatch.setenv(runner.CACHE_ENV, "/shared/xla")
  assert runner.LocalRunner(2).open_study(tmp_path / "runs") == "/shared/xla"
  off = runner.LocalRunner(2, compilation_cache="off")
  assert off.open_study(tmp_path / "runs") == ""
  assert runner.CACHE_ENV not in off.with_cache(base)
  mine = runner.LocalRunner(2, compilation_cache=str(tmp_path / "mine"))
  mine.open_study(tmp_path / "runs")
  assert mine.with_cache({})[runner.CACHE_ENV] == str(tmp_path.resolve() / "mine")
  with pytest.raises(ValueError, match="compilation_cache='': expected auto, off or a directory"):
    runner.LocalRunner(2, compilation_cache="")


def test_a_runs_folder_in_use_is_refused_while_any_run_of_its_study_lives(tmp_path):
  """The lock is held by the study process and inherited by its runs: a
  second study on the folder is refused, naming the folder and what to do,
  while a run the first one started is alive (here a stand-in process that
  outlives the study, as a run of a killed study does), and goes ahead once
  it has exited."""
  spec = spec_lib.from_dict(BASE)
  jobs = [runner.Job(0, "pos", "token", 3e-4)]
  runs = tmp_path / "runs"
  with runner.study_lock(runs) as fd:
    straggler = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                 pass_fds=(fd,))
  try:
    with pytest.raises(runner.StudyBusy, match=rf"{runs} is in use: the study process "
                       rf"pid {os.getpid()} holds .*\.study\.lock.*run the same command again"):
      runner.execute(jobs, spec, OrderRunner(), Store(tmp_path / "rows.jsonl"), runs,
                     log=lambda *_: None)
  finally:
    straggler.kill()
    straggler.wait()
  r = OrderRunner()
  runner.execute(jobs, spec, r, Store(tmp_path / "rows.jsonl"), runs, log=lambda *_: None)
  assert r.events == [("warmup", 0), ("run", 0)]


def test_a_run_stopped_by_the_nonfinite_guard_scores_zero_for_what_is_missing(tmp_path):
  (tmp_path / "metrics.jsonl").write_text("".join(
      json.dumps(dict(step=i, reward_mean=0.4)) + "\n" for i in (1, 2, 3)))
  (tmp_path / "summary.json").write_text(json.dumps(dict(
      step=3, stopped="nonfinite", before_rl=dict(heldout_acc_sampled=0.2))))
  (tmp_path / "config.json").write_text(json.dumps(dict(
      eval=dict(num_problems=4, samples_per_problem=2),
      rl=dict(prompts_per_step=2, group_size=2, steps=12))))
  row = summary.summarise(tmp_path)
  assert row["stopped_nonfinite"] and row["steps"] == 3
  assert row["reward_auc"] == pytest.approx(0.4 * 3 / 12)
  assert row["heldout_after"] == 0.0 and row["stability"]["collapsed"]


@pytest.mark.slow
def test_a_study_of_real_tiny_runs_end_to_end(tmp_path, monkeypatch, git_repo):
  """Two rules, one rate, two seeds, 1 RL step each, as subprocesses two at
  a time; the protocol committed in a git repository made here."""
  (tmp_path / "study").mkdir()
  (tmp_path / "study" / "spec.py").write_text(f'''
def get_spec():
  return dict(name="tiny", config={str(ROOT / "configs/tiny.py") + ":smoke"!r},
              cells={{"all": {{}}}}, arm_key="loss.aggregation",
              arms=["token", "balanced"], rate_key="optim.learning_rate",
              rates=[1e-3], tune_seeds=[], confirm_seeds=[0, 1],
              overrides={{"rl.steps": 1, "sft.steps": 4, "eval.num_problems": 4,
                          "checkpoint.async_save": False}},
              primary=["reward_auc", "mean training reward"],
              comparisons=[["balanced", "token", "superiority"]],
              results="study/results")
''')
  protocol.git(["add", "."], tmp_path)
  protocol.git(["commit", "-qm", "spec"], tmp_path)
  spec = spec_lib.load("study/spec.py")
  stages.run("predict", spec, log=lambda *_: None)
  protocol.git(["add", "."], tmp_path)
  protocol.git(["commit", "-qm", "predictions"], tmp_path)
  stages.run("confirm", spec, parallel=2, log=lambda *_: None)
  rows = read_rows(tmp_path / "study/results/results.jsonl")
  assert sorted((r["arm"], r["seed"]) for r in rows) == [
      ("balanced", 0), ("balanced", 1), ("token", 0), ("token", 1)]
  assert all(r["steps"] == 1 and r["code_commit"] for r in rows)
  # the runs used the test session's compilation cache (auto keeps the
  # JAX_COMPILATION_CACHE_DIR conftest sets); the same run again with a cache
  # of its own, empty, compiles into it and gives the same outcomes, to the bit
  job = runner.Job(1, "all", "balanced", 1e-3)
  fresh = runner.LocalRunner(1, compilation_cache=str(tmp_path / "fresh_cache"))
  (cold,) = runner.execute([job], spec, fresh, Store(tmp_path / "cold.jsonl"),
                           tmp_path / "cold_runs", log=lambda *_: None).values()
  assert len(list((tmp_path / "fresh_cache").glob("*train_step*"))) == 1
  assert fresh.hold_fds == ()  # the study's lock went with it
  (warm,) = [r for r in rows if (r["arm"], r["seed"]) == ("balanced", 1)]
  for k in ("reward_auc", "heldout_after", "curves", "weight_length_corr"):
    assert cold[k] == warm[k], k
  text = stages.run("report", spec, log=lambda *_: None)
  assert "## Rates `tuned` (confirmatory)" in text
  assert (tmp_path / "study/results/curves_tuned_all.png").stat().st_size > 10_000
  shutil.rmtree(tmp_path / "study/results/runs")
