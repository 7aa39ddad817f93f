"""The powered ablation's protocol (experiments/powered_ablation.py): the
split of tuning and confirmation seeds, the rate choice, predictions written
and frozen before any confirmation run, resuming; with a scripted runner
(fast) and, end to end, with real tiny runs (slow)."""
import itertools
import json
import pathlib
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))
import ablation_stats as st  # noqa: E402
import powered_ablation as pa  # noqa: E402


def test_seed_split_is_disjoint():
  tune, confirm = pa.seed_split(3, 20)
  assert len(tune) == 3 and len(confirm) == 20
  assert not set(tune) & set(confirm)
  assert confirm == tuple(range(20)) and min(tune) == pa.TUNE_SEED_BASE
  assert pa.seed_split(0, 4) == ((), (0, 1, 2, 3))  # a pilot: no tuning
  for bad in ((-1, 20), (3, 1), (3, pa.TUNE_SEED_BASE + 1)):
    with pytest.raises(ValueError, match="confirmation seeds"):
      pa.seed_split(*bad)


def test_choose_rate_takes_the_best_mean_and_ties_to_the_lower():
  rows = [dict(lr=lr, reward_auc=v) for lr, v in
          ((1e-4, 0.30), (1e-4, 0.40), (3e-4, 0.50), (3e-4, 0.30), (1e-3, 0.2))]
  rate, means = pa.choose_rate(rows, [1e-3, 1e-4, 3e-4])
  assert means == pytest.approx({1e-4: 0.35, 3e-4: 0.40, 1e-3: 0.2})
  assert rate == 3e-4
  rows.append(dict(lr=1e-3, reward_auc=0.6))  # 1e-3 now ties 3e-4 at 0.400
  assert pa.choose_rate(rows, [1e-4, 3e-4, 1e-3])[0] == 3e-4


# Scripted outcomes: reward = BASE[mode] + BEST_LR bonus + per-seed noise
# shared by every rule (common random numbers) + a small per-run term.
BASE = {"token": 0.30, "dr_grpo": 0.30, "sequence": 0.20, "balanced": 0.32}
BEST_LR = {"token": 3e-4, "dr_grpo": 3e-4, "sequence": 1e-4, "balanced": 6e-4}


def scripted_reward(gap, mode, lr, seed):
  rng = np.random.default_rng([seed, 7])
  shared = rng.normal(0, 0.05)
  own = np.random.default_rng([seed, sorted(BASE).index(mode), int(lr * 1e6)]).normal(0, 0.01)
  return BASE[mode] + (0.05 if lr == BEST_LR[mode] else 0.0) + shared + own


class ScriptedRunner:
  """Writes what a run leaves (metrics, summary, config) without training."""
  calls: list = []
  overrides: list = []
  KEYS = {"--config.loss.aggregation": "agg", "--config.optim.learning_rate": "lr"}

  def __init__(self, args):
    self.inprocess = False

  def train(self, variant, workdir, overrides):
    workdir.mkdir(parents=True, exist_ok=True)
    ScriptedRunner.overrides.append(overrides)
    kv = dict(x.partition("=")[::2] for x in variant.split(",") if x)
    for o in overrides:  # another config than drafts: its --config. keys
      k, _, v = o.partition("=")
      if k in self.KEYS:
        kv[self.KEYS[k]] = v
    kv.setdefault("gap", pa.WHOLE)
    seed = int(next(o for o in overrides if o.startswith("--config.seed="))
                .split("=")[1])
    ScriptedRunner.calls.append((kv.get("agg", "warmup"), seed))
    if "agg" not in kv:
      return
    r = scripted_reward(kv["gap"], kv["agg"], float(kv["lr"]), seed)
    share = 0.1 if kv["agg"] in ("token", "dr_grpo") else 0.0
    (workdir / "metrics.jsonl").write_text("".join(json.dumps(dict(
        step=i, reward_mean=r, accuracy=r, entropy=1.0 + 0.1 * i, length_mean=20.0,
        w_pos_share=0.4 + share, pos_frac=0.4, weight_length_corr=0.0,
        groups_mixed_frac=0.5, length_cv_in_group=0.6)) + "\n" for i in (1, 2)))
    (workdir / "summary.json").write_text(json.dumps(dict(
        before_rl=dict(heldout_acc_sampled=0.2), after_rl=dict(heldout_acc_sampled=r))))
    (workdir / "config.json").write_text(json.dumps(dict(
        eval=dict(num_problems=64, samples_per_problem=16),
        rl=dict(prompts_per_step=8, group_size=8, steps=2))))

  def export(self, workdir, out):
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text("{}")


def test_protocol_with_scripted_runs(tmp_path, monkeypatch):
  monkeypatch.setattr(pa, "Runner", ScriptedRunner)
  ScriptedRunner.calls = []
  common = [f"--outdir={tmp_path}", "--gaps=pos", "--rates=1e-4,3e-4,6e-4",
            "--tune_seeds=3", "--confirm_seeds=6", "--parallel=1"]
  tune_seeds, confirm_seeds = pa.seed_split(3, 6)
  pa.main(["--stage=tune", *common])
  assert {s for _, s in ScriptedRunner.calls} == set(tune_seeds)
  assert len([c for c in ScriptedRunner.calls if c[0] != "warmup"]) == 4 * 3 * 3
  # No confirmation before the predictions
  with pytest.raises(SystemExit, match="PREDICTIONS.md is missing"):
    pa.main(["--stage=confirm", *common])
  pa.main(["--stage=predict", *common])
  plan = json.loads((tmp_path / "predictions.json").read_text())
  assert plan["chosen"] == {f"pos/{m}": BEST_LR[m] for m in pa.MODES}
  assert plan["common"] == {"pos": BEST_LR["token"]}
  assert plan["tune_seeds"] == list(tune_seeds)
  assert plan["confirm_seeds"] == list(confirm_seeds)
  # The pooled paired SD and its MDD, computed here from the scripted values
  variances = []
  for a, b, _ in pa.COMPARISONS:
    d = [scripted_reward("pos", a, BEST_LR[a], s) - scripted_reward("pos", b, BEST_LR[b], s)
         for s in tune_seeds]
    variances.append(np.var(d, ddof=1))
  sd = np.sqrt(np.mean(variances))
  assert plan["paired_sd"] == pytest.approx(sd)
  assert plan["mdd"] == pytest.approx(st.min_detectable_difference(6, sd))
  text = (tmp_path / "PREDICTIONS.md").read_text()
  assert "balanced vs sequence (superiority)" in text and "Holm" in text
  assert f"{plan['mdd']:.4f}" in text
  # A changed PREDICTIONS.md stops the confirmation; a second predict keeps it
  md = tmp_path / "PREDICTIONS.md"
  md.write_text(text + "edited\n")
  with pytest.raises(SystemExit, match="changed after it was written"):
    pa.main(["--stage=confirm", *common])
  md.write_text(text)
  pa.main(["--stage=predict", *common, "--margin=0.2"])
  assert md.read_text() == text
  ScriptedRunner.calls = []
  pa.main(["--stage=confirm", *common])
  runs = [c for c in ScriptedRunner.calls if c[0] != "warmup"]
  assert {s for _, s in ScriptedRunner.calls} == set(confirm_seeds)
  # a run both arms need runs once: token's and dr_grpo's chosen rate is
  # the common one, so the common arm adds balanced and sequence only
  assert len(runs) == 4 * 6 + 2 * 6
  rows = [json.loads(l) for l in (tmp_path / "results.jsonl").read_text().splitlines()]
  assert {r["seed"] for r in rows} == set(confirm_seeds)
  assert len(rows) == 2 * 4 * 6
  tuned = {(r["mode"], r["seed"]): r["reward_auc"] for r in rows if r["arm"] == "tuned"}
  d = [tuned[("balanced", s)] - tuned[("sequence", s)] for s in confirm_seeds]
  share = [r["pos_share_minus_frac"] for r in rows if r["mode"] == "token"]
  assert share == pytest.approx([0.1] * len(share))
  assert all(r["entropy_drift"] == pytest.approx(1.2 / 1.1) for r in rows)
  # Resuming: nothing reruns, and the frozen plan's settings win
  ScriptedRunner.calls = []
  pa.main(["--stage=confirm", *common, "--steps=5"])
  assert ScriptedRunner.calls == []
  pa.main(["--stage=report", *common])
  report = (tmp_path / "REPORT.md").read_text()
  t = st.paired_t(d)
  assert f"{t['mean']:+.3f} [{t['low']:+.3f}, {t['high']:+.3f}]" in report
  assert "CONTROL FIRED" not in report.split("## Arm `common`")[0]
  assert "noise share" in report
  assert (tmp_path / "curves_tuned_pos.png").stat().st_size > 10_000


def test_a_pilot_from_a_pretrained_checkpoint_has_no_warmup_and_no_tuning(tmp_path, monkeypatch, capsys):
  """Another config (one cell), every run from --init_from, one rate for
  every rule, two runs at a time."""
  monkeypatch.setattr(pa, "Runner", ScriptedRunner)
  ScriptedRunner.calls, ScriptedRunner.overrides = [], []
  args = [f"--outdir={tmp_path}", "--config=configs/smollm2_reasoning_gym.py",
          "--init_from=/models/smollm2", "--modes=token,sequence,balanced",
          "--tune_seeds=0", "--rates=1e-5", "--confirm_seeds=3", "--steps=4",
          "--parallel=2"]
  pa.main(args)
  assert "warmup" not in {c[0] for c in ScriptedRunner.calls}
  # one rate: the common arm's runs are the tuned arm's, run once
  assert sorted(ScriptedRunner.calls) == sorted(
      (m, s) for m in ("token", "sequence", "balanced") for s in range(3))
  for o in ScriptedRunner.overrides:
    assert {"--config.init_from=/models/smollm2", "--config.sft.steps=0",
            "--config.rl.steps=4", "--config.optim.learning_rate=1e-05"} <= set(o)
  plan = json.loads((tmp_path / "predictions.json").read_text())
  assert plan["chosen"] == {f"all/{m}": 1e-5 for m in ("token", "sequence", "balanced")}
  assert plan["tune_seeds"] == [] and np.isnan(plan["paired_sd"])
  assert plan["config"] == "configs/smollm2_reasoning_gym.py"
  predictions = (tmp_path / "PREDICTIONS.md").read_text()
  assert "No tuning (a pilot): every rule at 1e-05" in predictions
  assert "every run starts from `/models/smollm2` (no warm-up)" in predictions
  rows = [json.loads(l) for l in (tmp_path / "results.jsonl").read_text().splitlines()]
  assert len(rows) == 2 * 3 * 3 and {r["gap"] for r in rows} == {"all"}
  report = (tmp_path / "REPORT.md").read_text()
  tuned = {(r["mode"], r["seed"]): r["reward_auc"] for r in rows if r["arm"] == "tuned"}
  t = st.paired_t([tuned[("balanced", s)] - tuned[("sequence", s)] for s in range(3)])
  assert f"{t['mean']:+.3f} [{t['low']:+.3f}, {t['high']:+.3f}]" in report
  # the power these runs had, and the seeds a next run needs at their SD
  d = np.array([tuned[("balanced", s)] - tuned[("sequence", s)] for s in range(3)])
  sd = d.std(ddof=1)
  assert (f"| all | balanced - sequence | 3 | {sd:.4f} | "
          f"{st.min_detectable_difference(3, sd):.3f} | {st.seeds_for(0.06, sd)} | "
          f"{st.seeds_for(0.03, sd)} |") in report
  with pytest.raises(SystemExit):
    pa.main([*args, "--rates=1e-5,2e-5"])
  assert "nothing is tuned" in capsys.readouterr().err
  with pytest.raises(SystemExit, match="--gaps='pos': expected some of \\['all'\\]"):
    pa.main([*args, "--gaps=pos"])


def test_a_time_boxed_confirmation_reports_whole_seeds_and_resumes(tmp_path, monkeypatch):
  """--start_within_min: no run starts after the box; a seed counts only when
  all its runs finished; a later call without the box runs the rest."""
  monkeypatch.setattr(pa, "Runner", ScriptedRunner)
  ScriptedRunner.calls, ScriptedRunner.overrides = [], []
  clock = itertools.count(0.0, 60.0)  # each look at the clock: one minute on
  monkeypatch.setattr(pa.time, "monotonic", lambda: next(clock))
  args = [f"--outdir={tmp_path}", "--config=configs/smollm2_reasoning_gym.py",
          "--init_from=/models/smollm2", "--modes=token,sequence,balanced",
          "--tune_seeds=0", "--rates=1e-5", "--confirm_seeds=3", "--steps=4",
          "--parallel=1"]
  pa.main([*args, "--start_within_min=4.5"])
  # the box opens at minute 0 and closes at 4.5: runs start at minutes 1-4,
  # so seed 0 (3 runs) and one run of seed 1
  assert ScriptedRunner.calls == [("balanced", 0), ("sequence", 0), ("token", 0),
                                  ("balanced", 1)]
  rows = [json.loads(l) for l in (tmp_path / "results.jsonl").read_text().splitlines()]
  assert {r["seed"] for r in rows} == {0} and len(rows) == 2 * 3
  status = json.loads((tmp_path / "confirmed_seeds.json").read_text())
  assert status == dict(planned=[0, 1, 2], complete=[0], start_within_min=4.5)
  report = (tmp_path / "REPORT.md").read_text()
  assert "6 confirmation rows over 1 seeds" in report
  assert "Seeds [0] of the planned [0, 1, 2] are reported" in report
  pa.main([*args, "--stage=confirm"])  # no box: the rest, finished runs read back
  assert sorted(ScriptedRunner.calls) == sorted(
      (m, s) for m in ("token", "sequence", "balanced") for s in range(3))
  rows = [json.loads(l) for l in (tmp_path / "results.jsonl").read_text().splitlines()]
  assert {r["seed"] for r in rows} == {0, 1, 2}
  assert "Time box" not in pa.report(pa.argparse.Namespace(outdir=tmp_path))


def test_a_run_stopped_by_the_nonfinite_guard_scores_zero_for_what_is_missing(tmp_path):
  (tmp_path / "metrics.jsonl").write_text("".join(
      json.dumps(dict(step=i, reward_mean=0.4)) + "\n" for i in (1, 2, 3)))
  (tmp_path / "summary.json").write_text(json.dumps(dict(
      step=3, stopped="nonfinite", before_rl=dict(heldout_acc_sampled=0.2))))
  (tmp_path / "config.json").write_text(json.dumps(dict(
      eval=dict(num_problems=4, samples_per_problem=2),
      rl=dict(prompts_per_step=2, group_size=2, steps=12))))
  row = pa.summarise(tmp_path, dict(mode="token"))
  assert row["stopped_nonfinite"] and row["steps"] == 3
  assert row["reward_auc"] == pytest.approx(0.4 * 3 / 12)
  assert row["heldout_after"] == 0.0 and row["stability"]["collapsed"]


@pytest.mark.slow
def test_dry_run_end_to_end(tmp_path, monkeypatch):
  """Real tiny runs, two rules at one rate (each (rule, rate) compiles its
  own train step): warm-up, tuning, predictions, confirmation, report."""
  monkeypatch.chdir(ROOT)
  out = pa.main(["--dry", f"--outdir={tmp_path}", "--modes=token,balanced",
                 "--rates=1e-3"])
  plan = json.loads((out / "predictions.json").read_text())
  assert set(plan["chosen"].values()) <= set(plan["rates"])
  rows = [json.loads(l) for l in (out / "results.jsonl").read_text().splitlines()]
  assert {r["seed"] for r in rows} == set(plan["confirm_seeds"])
  assert all(r["steps"] == 1 for r in rows)
  first_run = min((out / "runs").glob("pos_*_s0/summary.json"), key=lambda p: p.stat().st_mtime)
  assert (out / "PREDICTIONS.md").stat().st_mtime < first_run.stat().st_mtime
  assert "## Arm `tuned`" in (out / "REPORT.md").read_text()
