"""The ablation runner's protocol (ba_jax.ablation): confirmation refuses an
uncommitted or changed protocol and a dirty tree (unless --allow_dirty, which
rows and report then name), rows carry the protocol's and the code's commit,
and a killed study resumes without rerunning finished runs. Runs are a fake
runner's (no training); git is a real repository in tmp_path."""
import json
import pathlib
import subprocess

import numpy as np
import pytest

from ba_jax import ablate
from ba_jax.ablation import protocol, spec as spec_lib, stages
from ba_jax.ablation import runner as runner_lib
from ba_jax.ablation.store import Store, read_rows

SPEC = '''
def get_spec():
  return dict(
      name="fake study", config="configs/none.py",
      cells={"a": {"overrides": {"task.x": 1}}},
      arm_key="loss.aggregation", arms=["token", "balanced"],
      rate_key="optim.learning_rate", rates=[1e-4, 3e-4],
      tune_seeds=[100, 101, 102], confirm_seeds=[0, 1, 2, 3],
      primary=["reward_auc", "mean training reward"],
      secondary=[["heldout_after", "held-out accuracy"]],
      comparisons=[["balanced", "token", "superiority"],
                   ["balanced", "token", "noninferiority"]],
      margin=0.05, common_rate_arm="token", results="study/results")
'''


def reward(arm, lr, seed):
  shared = np.random.default_rng([seed, 1]).normal(0, 0.05)
  return 0.3 + (0.03 if arm == "balanced" else 0) + (0.02 if lr == 3e-4 else 0) + shared \
      + np.random.default_rng([seed, len(arm)]).normal(0, 0.01)


class FakeRunner:
  """Returns outcomes computed from the run's settings; ``kill_at``: from
  that call on, every run is interrupted, as a killed study's would be."""

  def __init__(self, kill_at=None):
    self.calls, self.kill_at = [], kill_at

  def warmup(self, settings, workdir):
    return "unused"

  def train(self, settings, workdir):
    o = settings["overrides"]
    self.calls.append((o["loss.aggregation"], o["optim.learning_rate"], o["seed"]))
    if self.kill_at is not None and len(self.calls) >= self.kill_at:
      raise KeyboardInterrupt("killed")
    r = reward(o["loss.aggregation"], o["optim.learning_rate"], o["seed"])
    return dict(reward_auc=r, heldout_after=r, heldout_before=0.1, heldout_samples=64,
                reward_samples=64, groups_mixed_frac=0.5, pos_share_minus_frac=0.0,
                entropy_drift=1.0, length_drift=1.0, weight_length_corr=0.0,
                length_cv_first=0.5, stability=dict(collapsed=False),
                curves=dict(reward_mean=[r, r], entropy=[1, 1], length_mean=[9, 9]))


def git(repo, *args):
  return protocol.git(list(args), repo)


@pytest.fixture
def study(git_repo):
  tmp_path = git_repo
  (tmp_path / "study").mkdir()
  (tmp_path / "study" / "spec.py").write_text(SPEC)
  (tmp_path / "code.py").write_text("x = 1\n")
  (tmp_path / ".gitignore").write_text("runs/\n")
  git(tmp_path, "add", ".")
  git(tmp_path, "commit", "-qm", "spec")
  spec = spec_lib.load("study/spec.py")
  runner = FakeRunner()
  stages.run("tune", spec, runner=runner, log=lambda *_: None)
  stages.run("predict", spec, runner=runner, log=lambda *_: None)
  return tmp_path, spec


def confirm(spec, **kw):
  runner = FakeRunner()
  stages.run("confirm", spec, runner=runner, log=lambda *_: None, **kw)
  return runner


def commit_protocol(repo):
  git(repo, "add", "study/results/predictions.json", "study/results/PREDICTIONS.md")
  git(repo, "commit", "-qm", "freeze")
  return git(repo, "rev-parse", "HEAD")


def test_confirm_refuses_a_protocol_not_committed(study):
  repo, spec = study
  with pytest.raises(protocol.ProtocolError, match="predictions.json is not committed"):
    confirm(spec)
  assert not (repo / "study/results/results.jsonl").exists()
  # the command says the same and exits non-zero
  assert ablate.main(["--spec=study/spec.py", "--stage=confirm"]) == 2


def test_confirm_runs_a_committed_protocol_and_names_its_commit(study):
  repo, spec = study
  frozen = commit_protocol(repo)
  (repo / "later.txt").write_text("a commit after the protocol\n")
  git(repo, "add", "later.txt")
  git(repo, "commit", "-qm", "later")
  head = git(repo, "rev-parse", "HEAD")
  runner = confirm(spec)
  plan = json.loads((repo / "study/results/predictions.json").read_text())
  assert plan["chosen"] == {"a/token": 3e-4, "a/balanced": 3e-4}
  # token's chosen rate is the common one: each (arm, seed) runs once
  assert sorted(runner.calls) == sorted((a, 3e-4, s) for a in ("token", "balanced")
                                        for s in range(4))
  rows = read_rows(repo / "study/results/results.jsonl")
  assert len(rows) == 8 and len({r["config_hash"] for r in rows}) == 8
  assert {r["protocol_commit"] for r in rows} == {frozen}
  assert {r["code_commit"] for r in rows} == {head}
  assert all(r["dirty"] == [] and r["allow_dirty"] is False for r in rows)
  text = stages.run("report", spec, log=lambda *_: None)
  assert f"protocol commit `{frozen}`, code commit `{head}`" in text
  assert "Dirty tree" not in text


def test_a_second_study_process_on_the_same_runs_is_refused(study, capsys):
  repo, spec = study
  commit_protocol(repo)
  with runner_lib.study_lock(repo / "study/results/runs"):
    assert ablate.main(["--spec=study/spec.py", "--stage=confirm"]) == 2
  err = capsys.readouterr().err
  assert "ba_jax.ablate: " in err and "study/results/runs is in use" in err
  assert not (repo / "study/results/results.jsonl").exists()


def test_confirm_refuses_a_changed_protocol(study):
  repo, spec = study
  commit_protocol(repo)
  path = repo / "study/results/predictions.json"
  committed = path.read_text()
  path.write_text(committed.replace('"margin": 0.05', '"margin": 0.5'))
  with pytest.raises(protocol.ProtocolError, match="differs from its committed version"):
    confirm(spec)
  path.write_text(committed)
  # a spec edited and committed after the predictions: refused too
  spec_path = repo / "study/spec.py"
  spec_path.write_text(SPEC.replace("margin=0.05", "margin=0.5"))
  git(repo, "commit", "-qam", "move the margin")
  with pytest.raises(protocol.ProtocolError, match="changed after the predictions"):
    confirm(spec_lib.load("study/spec.py"))


def test_confirm_refuses_a_dirty_tree_unless_allowed(study):
  repo, spec = study
  commit_protocol(repo)
  (repo / "code.py").write_text("x = 2\n")
  with pytest.raises(protocol.ProtocolError, match=r"uncommitted changes \(code.py\)"):
    confirm(spec)
  confirm(spec, allow_dirty=True)
  rows = read_rows(repo / "study/results/results.jsonl")
  assert rows and all(r["dirty"] == ["code.py"] and r["allow_dirty"] for r in rows)
  text = stages.run("report", spec, log=lambda *_: None)
  assert "**Dirty tree.** 8 rows ran with uncommitted changes to code.py" in text
  assert "--allow_dirty" in text


def test_a_killed_study_resumes_without_rerunning_finished_runs(study):
  repo, spec = study
  commit_protocol(repo)
  killed = FakeRunner(kill_at=3)
  with pytest.raises(KeyboardInterrupt):
    stages.run("confirm", spec, runner=killed, log=lambda *_: None)
  path = repo / "study/results/results.jsonl"
  first = read_rows(path)
  assert len(first) == 2  # two runs finished before the kill
  # a row cut short by the kill is dropped, and its run runs again
  with open(path, "a") as f:
    f.write('{"config_hash": "half a li')
  again = confirm(spec)
  done = {(r["arm"], r["lr"], r["seed"]) for r in first}
  assert len(again.calls) == 6 and not done & set(again.calls)
  assert len(killed.calls) < 8  # the queued runs did not start after the kill
  rows = read_rows(path)
  assert len(rows) == 8 and len({r["config_hash"] for r in rows}) == 8
  assert len(Store(path).rows()) == 8
  assert confirm(spec).calls == []  # everything has its row


def test_predictions_are_frozen_and_tuning_precedes_them(study):
  repo, spec = study
  md = repo / "study/results/PREDICTIONS.md"
  text = md.read_text()
  assert "balanced` vs `token`, noninferiority" in text and "Holm" in text
  stages.run("predict", spec, log=lambda *_: None)
  assert md.read_text() == text
  (repo / "study/results/tuning.jsonl").unlink()
  md.unlink()
  with pytest.raises(stages.StageError, match="run --stage=tune first"):
    stages.run("predict", spec, log=lambda *_: None)


def test_spec_errors_name_the_key(tmp_path):
  base = dict(name="x", config="c.py", cells={"a": {}}, arm_key="k", arms=["p", "q"],
              rate_key="r", rates=[1e-4], tune_seeds=[], confirm_seeds=[0, 1],
              primary=["reward_auc", "w"], comparisons=[["p", "q", "superiority"]])
  spec_lib.from_dict(base)
  for change, words in ((dict(arm="k"), "unknown key"),
                        (dict(arms=["p"]), "arms="),
                        (dict(tune_seeds=[0]), "both tuning and confirmation"),
                        (dict(rates=[1e-4, 2e-4]), "several rates need tuning"),
                        (dict(comparisons=[["p", "z", "superiority"]]), "comparison"),
                        (dict(comparisons=[["p", "q", "noninferiority"]]), "margin="),
                        (dict(warmup="maybe"), "warmup=")):
    with pytest.raises(ValueError, match=words):
      spec_lib.from_dict(dict(base, **change))


def test_plan_sizes_the_confirmation_from_the_tuning_runs(study):
  repo, spec = study
  from ba_jax.ablation import stats
  text = stages.run("plan", spec, log=lambda *_: None)
  rows = read_rows(repo / "study/results/tuning.jsonl")
  by = {(r["arm"], r["seed"]): r["reward_auc"] for r in rows if r["lr"] == 3e-4}
  d = [by[("balanced", s)] - by[("token", s)] for s in (100, 101, 102)]
  sd = np.std(d, ddof=1)
  want = (f"| a | balanced - token (superiority) | 3 | {sd:.4f} | "
          f"{stats.min_detectable_difference(4, sd):.4f} | "
          f"{stats.seeds_for(0.06, sd)} | {stats.seeds_for(0.03, sd)} |")
  assert want in text and (repo / "study/results/PLAN.md").read_text() == text
  # a margin from the tuning runs' power: the one-sided detectable difference
  (repo / "study/spec.py").write_text(SPEC.replace("margin=0.05", 'margin="mdd"'))
  for name in ("predictions.json", "PREDICTIONS.md"):
    (repo / "study/results" / name).unlink()
  plan = stages.predict(spec_lib.load("study/spec.py"), None, log=lambda *_: None)
  assert plan["margin"] == pytest.approx(stats.min_detectable_difference(
      4, plan["paired_sd"], two_sided=False))
