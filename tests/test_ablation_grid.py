"""Studies whose arms cross several static axes (ba_jax.ablation.arms): the
arms expand and are named value/value/value, an arm the trainer would refuse
is refused as the spec loads with the trainer's reason, one-axis specs run
as before, the report groups the mechanism checks per surrogate and per
correction, and (slow) a 2x2 grid of real tiny runs end to end."""
import json
import pathlib
import shutil

import numpy as np
import pytest

from ba_jax.ablation import (arms, planning, protocol, runner, spec as spec_lib, stages,
                             stats, texts)
from ba_jax.ablation.store import config_hash, read_rows
from ba_jax.config import combinations

ROOT = pathlib.Path(__file__).resolve().parents[1]
KEYS = ["loss.surrogate", "loss.aggregation", "loss.correction"]
GRID = dict(name="g", config="configs/drafts.py", cells={"pos": {"variant": "gap=pos"}},
            arm_keys=KEYS, arms=arms.grid(["ppo_clip", "gspo"], ["token", "balanced"],
                                          ["none", "tis_token"]),
            rate_key="optim.learning_rate", rates=[3e-4], tune_seeds=[],
            confirm_seeds=[0, 1], overrides={"rl.steps": 20, "rl.old_logp": "recompute"},
            primary=["reward_auc", "w"],
            comparisons=[["gspo/balanced/none", ("gspo", "token", "none"), "superiority"]])


def refusal(**settings) -> str:
  """The trainer's one-line reason for ``settings`` (loss and rl keys)."""
  with pytest.raises(ValueError) as e:
    combinations.check_combination(**settings)
  return str(e.value)


def test_grid_arms_expand_and_are_named_by_their_values():
  assert arms.grid(["a", "b"], [1, 2.5]) == [("a", 1), ("a", 2.5), ("b", 1), ("b", 2.5)]
  spec = spec_lib.from_dict(GRID)
  assert spec.arms == ("ppo_clip/token/none", "ppo_clip/token/tis_token",
                       "ppo_clip/balanced/none", "ppo_clip/balanced/tis_token",
                       "gspo/token/none", "gspo/token/tis_token",
                       "gspo/balanced/none", "gspo/balanced/tis_token")
  assert spec.arm_keys == tuple(KEYS) and spec.arm_key == "/".join(KEYS)
  # a comparison may name an arm by its values
  assert [(c.a, c.b) for c in spec.comparisons] == [("gspo/balanced/none",
                                                     "gspo/token/none")]
  # a run is the spec plus one value per crossed key
  job = runner.Job(seed=1, cell="pos", arm="gspo/balanced/tis_token", lr=3e-4)
  s = runner.run_settings(spec, job)
  assert s["overrides"] == {"rl.steps": 20, "rl.old_logp": "recompute",
                            "loss.surrogate": "gspo", "loss.aggregation": "balanced",
                            "loss.correction": "tis_token", "optim.learning_rate": 3e-4,
                            "seed": 1}
  assert job.name == "pos_gspo+balanced+tis_token_lr0.0003_s1"  # one folder, no "/"
  # names and tuples mix; a float is named as :g prints it, and keeps its type
  mixed = spec_lib.from_dict(dict(
      GRID, arm_keys=["loss.aggregation", "loss.eps_high"],
      arms=["token/x", ("balanced", 0.28)], comparisons=[]))
  assert mixed.arms == ("token/x", "balanced/0.28")
  assert mixed.arm_settings("balanced/0.28") == {"loss.aggregation": "balanced",
                                                 "loss.eps_high": 0.28}
  assert mixed.arm_settings("token/x")["loss.eps_high"] == "x"


def test_grid_spec_errors_name_what_is_wrong():
  for change, words in (
      (dict(arm_key="loss.aggregation"), "not both"),
      (dict(arm_keys=["loss.surrogate"]), "two or more distinct config keys"),
      (dict(arms=[("ppo_clip", "token")] * 2), "has 2 value"),
      (dict(arms=["ppo_clip/token/none", ("ppo_clip", "token", "none")]), "given twice"),
      (dict(arms=[("ppo_clip", "a/b", "none"), ("gspo", "token", "none")]), "holds '/'"),
      (dict(comparisons=[["gspo/balanced/none", "gspo/dr_grpo/none", "superiority"]]),
       "comparison"),
      (dict(common_rate_arm=("gspo", "sequence", "none")), "common_rate_arm")):
    with pytest.raises(ValueError, match=words):
      spec_lib.from_dict(dict(GRID, **change))
  with pytest.raises(ValueError, match="not neither"):
    spec_lib.from_dict({k: v for k, v in GRID.items() if k != "arm_keys"})


def test_refused_combinations_are_refused_as_the_spec_loads(tmp_path):
  no_recompute = dict(GRID, overrides={"rl.steps": 20})
  with pytest.raises(ValueError) as e:
    spec_lib.from_dict(no_recompute, "grid.py")
  # the first refused arm, in the first cell, with the trainer's own reason
  assert str(e.value) == "grid.py: arm 'ppo_clip/token/tis_token' in cell 'pos': " + refusal(
      surrogate="ppo_clip", correction="tis_token", aggregation="token", old_logp="sampler")
  luspo = dict(GRID, arms=GRID["arms"] + [("luspo", "balanced", "none")])
  with pytest.raises(ValueError, match="arm 'luspo/balanced/none'") as e:
    spec_lib.from_dict(luspo)
  assert str(e.value).endswith(refusal(surrogate="luspo", correction="none",
                                       aggregation="balanced"))
  # a key the config file sets counts: dual_clip in the cell's config refuses gspo
  dual = dict(GRID, cells={"pos": {"variant": "gap=pos", "overrides": {"loss.dual_clip": 3.0}}})
  with pytest.raises(ValueError, match="arm 'gspo/token/none' in cell 'pos'.*dual clip"):
    spec_lib.from_dict(dual)
  # a value outside the schema's choices is named with them
  with pytest.raises(ValueError, match="loss.surrogate='gpso': expected one of"):
    spec_lib.from_dict(dict(GRID, arms=GRID["arms"] + [("gpso", "token", "none")]))
  # the config file's own settings are read, variant and all
  config = tmp_path / "recompute.py"
  config.write_text(
      "from ba_jax.config import common\n"
      "def get_config(arg=None):\n"
      "  c = common.base()\n"
      "  c.rl.old_logp = 'recompute' if arg == 'recompute' else 'sampler'\n"
      "  return c\n")
  ok = dict(no_recompute, config=str(config), cells={"a": {"variant": "recompute"}})
  assert len(spec_lib.from_dict(ok).arms) == 8
  with pytest.raises(ValueError, match="in cell 'b'.*set rl.old_logp='recompute'"):
    spec_lib.from_dict(dict(ok, cells={"a": {"variant": "recompute"}, "b": {}}))
  # a one-axis spec is checked the same way
  one = {k: v for k, v in GRID.items() if k != "arm_keys"}
  with pytest.raises(ValueError, match="arm 'luspo' in cell 'pos'"):
    spec_lib.from_dict(dict(one, arm_key="loss.surrogate", arms=["ppo_clip", "luspo"],
                            comparisons=[]))


def test_one_axis_specs_run_as_before():
  """The committed tiny_rules rows are found again by their config hashes
  (a changed job setting would orphan them), and a one-axis plan has no
  grid fields; tests/test_ablation_studies.py regenerates each committed
  report from its rows."""
  spec = spec_lib.load(ROOT / "experiments/studies/tiny_rules/spec.py")
  assert spec.arm_keys == () and spec.arm_settings("token") == {"loss.aggregation": "token"}
  rows = read_rows(ROOT / "experiments/studies/tiny_rules/results/results.jsonl")
  assert rows
  for r in rows:
    job = runner.Job(r["seed"], r["cell"], r["arm"], r["lr"])
    assert config_hash(runner.run_settings(spec, job)) == r["config_hash"], job
  assert runner.Job(0, "tiny", "token", 1e-3).name == "tiny_token_lr0.001_s0"
  plan = planning.make_plan(spec, read_rows(
      ROOT / "experiments/studies/tiny_rules/results/tuning.jsonl"))
  assert "arm_keys" not in plan and "arm_values" not in plan
  committed = json.loads(
      (ROOT / "experiments/studies/tiny_rules/results/predictions.json").read_text())
  assert {k: plan[k] for k in ("arms", "arm_key", "chosen", "holm_family")} == {
      k: committed[k] for k in ("arms", "arm_key", "chosen", "holm_family")}


def synthetic_rows(spec):
  """Rows whose mechanism figures are a known function of the arm and seed."""
  rng = np.random.default_rng(0)
  rows = []
  for arm in spec.arms:
    s, a, c = arm.split("/")
    for seed in spec.confirm_seeds:
      rows.append(dict(
          cell="pos", arm=arm, lr=3e-4, seed=seed,
          config_hash=config_hash(runner.run_settings(spec, runner.Job(seed, "pos", arm, 3e-4))),
          pos_share_minus_frac=(0.06 if a == "token" else 0.0) + rng.normal(0, 0.01),
          weight_length_corr=(0.0 if a == "token" else -0.4) + rng.normal(0, 0.05),
          mismatch_k3=1e-7 * (1 + seed), mismatch_corrected_frac=(
              0.001 * seed if c == "tis_token" else float("nan")),
          reward_auc=0.3 + 0.01 * seed, heldout_after=0.3, heldout_before=0.1,
          heldout_samples=64, reward_samples=64, groups_mixed_frac=0.5,
          entropy_drift=1.0, length_drift=1.0, length_cv_first=0.5,
          stability=dict(collapsed=False)))
  return rows


def test_the_report_groups_the_mechanism_checks_per_surrogate_and_correction():
  spec = spec_lib.from_dict(dict(GRID, confirm_seeds=[0, 1, 2]))
  plan = planning.make_plan(spec, [])
  assert plan["arm_keys"] == KEYS
  assert plan["arm_values"]["gspo/token/tis_token"] == ["gspo", "token", "tis_token"]
  rows = synthetic_rows(spec)
  lines = texts.mechanism_by_axis(plan, rows)
  assert lines[0] == ("## Mechanism checks per `loss.surrogate` and per "
                      "`loss.correction` (tuned rates)")

  def pm(values, fmt):
    v = np.array([x for x in values if np.isfinite(x)])
    return f"{v.mean():{fmt}} ± {v.std(ddof=1):{fmt}}" if len(v) else "n/a"

  def line(key, value, rule):
    i = KEYS.index(key)
    rs = [r for r in rows if r["arm"].split("/")[i] == value
          and r["arm"].split("/")[1] == rule]
    return (f"| pos | {value} | {rule} | {len(rs)} | "
            f"{pm([r['pos_share_minus_frac'] for r in rs], '+.3f')} | "
            f"{pm([r['weight_length_corr'] for r in rs], '+.2f')} | "
            f"{pm([r['mismatch_k3'] for r in rs], '.1e')} | "
            f"{pm([r['mismatch_corrected_frac'] for r in rs], '.3f')} |")

  # per surrogate (both corrections pooled: 2 arms x 3 seeds) and per correction
  for key, values in (("loss.surrogate", ("ppo_clip", "gspo")),
                      ("loss.correction", ("none", "tis_token"))):
    for value in values:
      for rule in ("token", "balanced"):
        assert line(key, value, rule) in lines, (key, value, rule)
  assert "| pos | none | token | 6 |" in "\n".join(lines)
  assert lines.count("| cell | `loss.surrogate` | `loss.aggregation` | runs | share - "
                     "fraction | weight-length corr | sampler-trainer k3 | tokens corrected |") == 1
  # in the whole report, and nothing of it for a one-axis plan
  report = texts.report_md(plan, rows, 0)
  assert "\n".join(lines) in report
  one = spec_lib.from_dict(dict({k: v for k, v in GRID.items() if k != "arm_keys"},
                                arm_key="loss.aggregation", arms=["token", "balanced"],
                                comparisons=[]))
  assert texts.mechanism_by_axis(planning.make_plan(one, []), rows) == []


def test_the_curves_put_a_row_per_first_axis_value_and_style_the_last(tmp_path):
  """Crossed arms: a row of panels per first-axis value, one colour per
  middle-axis value in every row, a line style per last-axis value; one
  axis: one row, a colour per arm."""
  from ba_jax.ablation import plots
  spec = spec_lib.from_dict(dict(GRID, arms=GRID["arms"] + [("ppo_clip", "dr_grpo", "none")]))
  plan = dict(arms=list(spec.arms), arm_keys=list(spec.arm_keys),
              arm_values={a: list(v) for a, v in spec.arm_values.items()})
  rows = plots.layout(plan)
  assert [title for title, _ in rows] == ["loss.surrogate=ppo_clip", "loss.surrogate=gspo"]
  ppo, gspo = (dict((arm, (label, colour, style)) for arm, label, colour, style in m)
               for _, m in rows)
  assert ppo["ppo_clip/balanced/tis_token"] == ("balanced/tis_token", 1, 1)
  assert gspo["gspo/balanced/tis_token"] == ("balanced/tis_token", 1, 1)
  assert gspo["gspo/token/none"] == ("token/none", 0, 0)
  assert ppo["ppo_clip/dr_grpo/none"] == ("dr_grpo/none", 2, 0)
  assert set(ppo) | set(gspo) == set(spec.arms)  # every arm drawn once
  # values that are not strings are named as the arms are (arms.name_of)
  floats = spec_lib.from_dict(dict(GRID, arm_keys=["loss.aggregation", "loss.eps_high"],
                                   arms=arms.grid(["token", "balanced"], [0.28, 0.2]),
                                   comparisons=[]))
  assert plots.layout(dict(arms=list(floats.arms), arm_keys=list(floats.arm_keys),
                           arm_values=dict(floats.arm_values)))[0] == (
      "loss.aggregation=token", [("token/0.28", "0.28", 0, 0), ("token/0.2", "0.2", 0, 1)])
  one = dict(arms=["token", "sequence", "balanced"])
  assert plots.layout(one) == [("", [("token", "token", 0, 0), ("sequence", "sequence", 1, 0),
                                     ("balanced", "balanced", 2, 0)])]
  curve = {"reward_mean": [0.1, 0.2], "entropy": [1.0, 0.9], "length_mean": [5, None]}
  made = plots.plot(dict(plan, cells={"pos": {}}, confirm_seeds=[0],
                         chosen={f"pos/{a}": 3e-4 for a in spec.arms}),
                    [dict(cell="pos", arm=a, lr=3e-4, seed=0, curves=curve) for a in spec.arms],
                    tmp_path)
  assert [p.name for p in made] == ["curves_tuned_pos.png"] and made[0].stat().st_size > 0


def test_plan_gives_the_seeds_at_holms_first_step(tmp_path):
  """PLAN.md's last line: the pooled paired SD of the pilot's comparisons
  and the seeds for each detectable difference at alpha / family size."""
  spec = spec_lib.from_dict(dict(GRID, detectable=(0.03, 0.02), comparisons=[
      ["ppo_clip/balanced/none", "ppo_clip/token/none", "superiority"],
      ["gspo/balanced/none", "gspo/token/none", "superiority"],
      ["gspo/balanced/tis_token", "gspo/balanced/none", "superiority"]]))
  rows = synthetic_rows(spec_lib.from_dict(dict(GRID, confirm_seeds=list(range(8)))))
  rng = np.random.default_rng(1)
  for r in rows:
    r["reward_auc"] = 0.3 + 0.01 * r["seed"] + rng.normal(0, 0.02)
  pilot = tmp_path / "pilot.jsonl"
  pilot.write_text("".join(json.dumps(r) + "\n" for r in rows))
  text = stages.plan(spec, tmp_path, pilot=pilot, log=lambda *_: None)
  by = {(r["arm"], r["seed"]): r["reward_auc"] for r in rows}
  sds = [np.std([by[(c.a, s)] - by[(c.b, s)] for s in range(8)], ddof=1)
         for c in spec.comparisons]
  sd = np.sqrt(np.mean(np.square(sds)))
  need = [stats.seeds_for(m, sd, alpha=0.05 / 3) for m in (0.03, 0.02)]
  assert text.strip().splitlines()[-1] == (
      f"Pooled over these terms (root mean variance) the paired SD is {sd:.4f}; at "
      f"Holm's first step over the 3 comparisons of the family (alpha 0.05/3) a "
      f"confirmation needs {need[0]} seeds for 0.03, {need[1]} seeds for 0.02 "
      "(the spec has 2).")


def test_the_surrogate_grid_is_sized_by_its_planner(capsys):
  """The study's README shows what plan_seeds computes from the powered
  study's rows, and spec.py has the seeds it computes (it loads, so none of
  its arms is refused)."""
  from experiments.studies.surrogate_grid import plan_seeds
  plan_seeds.main()
  out = capsys.readouterr().out
  readme = (ROOT / "experiments/studies/surrogate_grid/README.md").read_text()
  for line in filter(None, out.splitlines()):
    assert line in readme, line
  assert "spec.py has" not in out  # printed when the spec's seeds differ
  spec = spec_lib.load(plan_seeds.GRID)
  assert len(spec.arms) == 19 and len(planning.holm_family(spec)) == 18
  # the fewest seeds whose detectable difference at Holm's first step is 0.02
  need = planning.seeds_for_family(spec, 0.0223, 0.02)
  n = need["holm_first"]
  mdd = lambda k: stats.min_detectable_difference(k, 0.0223, alpha=0.05 / 18)
  assert need["alpha_first"] == pytest.approx(0.05 / 18)
  assert mdd(n) <= 0.02 < mdd(n - 1)
  assert need["unadjusted"] < n


@pytest.mark.slow
def test_a_grid_of_real_tiny_runs_end_to_end(tmp_path, monkeypatch, git_repo):
  """A 2x2 grid (surrogate x correction), one rate, two seeds, 1 RL step
  each, two runs at a time; plan (from the confirmation rows as a pilot),
  predict, confirm and report in a git repository made here."""
  monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "jax_cache"))
  (tmp_path / "study").mkdir()
  (tmp_path / "study" / "spec.py").write_text(f'''
from ba_jax.ablation.arms import grid

def get_spec():
  return dict(name="tiny grid", config={str(ROOT / "configs/tiny.py") + ":smoke"!r},
              cells={{"all": {{}}}},
              arm_keys=["loss.surrogate", "loss.correction"],
              arms=grid(["ppo_clip", "gspo"], ["none", "tis_token"]),
              rate_key="optim.learning_rate", rates=[1e-3], tune_seeds=[],
              confirm_seeds=[0, 1],
              overrides={{"rl.steps": 1, "sft.steps": 4, "eval.num_problems": 4,
                          "rl.old_logp": "recompute", "checkpoint.async_save": False}},
              primary=["reward_auc", "mean training reward"],
              comparisons=[["gspo/none", "ppo_clip/none", "superiority"],
                           [("ppo_clip", "tis_token"), "ppo_clip/none", "superiority"]],
              results="study/results")
''')
  protocol.git(["add", "."], tmp_path)
  protocol.git(["commit", "-qm", "spec"], tmp_path)
  spec = spec_lib.load("study/spec.py")
  quiet = lambda *_: None
  stages.run("tune", spec, log=quiet)  # one rate: nothing to tune
  stages.run("predict", spec, log=quiet)
  protocol.git(["add", "."], tmp_path)
  protocol.git(["commit", "-qm", "predictions"], tmp_path)
  stages.run("confirm", spec, parallel=2, log=quiet)
  rows = read_rows(tmp_path / "study/results/results.jsonl")
  assert sorted((r["arm"], r["seed"]) for r in rows) == sorted(
      (a, s) for a in spec.arms for s in (0, 1))
  assert all(r["steps"] == 1 and r["code_commit"] for r in rows)
  for r in rows:  # each run set its arm's keys (config.json of its workdir)
    config = json.loads((tmp_path / "study/results/runs" / runner.Job(
        r["seed"], r["cell"], r["arm"], r["lr"]).name / "config.json").read_text())
    assert "/".join([config["loss"]["surrogate"], config["loss"]["correction"]]) == r["arm"]
    assert config["rl"]["old_logp"] == "recompute"
    assert np.isfinite(r["mismatch_k3"])
    assert np.isfinite(r["mismatch_corrected_frac"]) == r["arm"].endswith("tis_token")
  text = stages.run("report", spec, log=quiet)
  assert "| all | gspo/none - ppo_clip/none (superiority) | 2 |" in text
  assert "## Mechanism checks per `loss.surrogate` and per `loss.correction`" in text
  assert "| all | tis_token | 4 |" in text  # per correction, surrogates pooled
  plan_text = stages.run("plan", spec, pilot="study/results/results.jsonl", log=quiet)
  assert "| all | ppo_clip/tis_token - ppo_clip/none (superiority) | 2 |" in plan_text
  shutil.rmtree(tmp_path / "study/results/runs")
