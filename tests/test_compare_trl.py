"""experiments/studies/compare_trl/compare_trl.py's quick path end to end (2 RL steps, one seed,
one loss type, both trainers), so the comparison script cannot rot."""
import argparse
import json
import math
import pathlib

import pytest
from flax import nnx

from ba_jax.config import schema
from ba_jax.policy import hf
from ba_jax.policy import model as model_lib
from ba_jax.run import model_setup
from ba_jax.tasks import synthetic
import trainer_utils

pytest.importorskip("trl")
ROOT = pathlib.Path(__file__).resolve().parents[1]
from experiments.studies.compare_trl import compare_trl  # noqa: E402


@pytest.mark.slow
def test_quick_comparison_writes_both_trainers_numbers(tmp_path, monkeypatch):
  monkeypatch.chdir(ROOT)
  # A random smoke-sized policy as the start checkpoint (no warm-up run).
  tokenizer = synthetic.build_tokenizer()
  config = model_setup.build_model_config(
      schema.parse(trainer_utils.load_config("smoke")), tokenizer)
  start = tmp_path / "start"
  hf.save_pretrained(model_lib.Decoder(config, rngs=nnx.Rngs(0)), config,
                     start, tokenizer=tokenizer)
  out = tmp_path / "compare_trl.md"
  compare_trl.main(["--quick", "--config=configs/tiny.py:smoke",
                    f"--set=init_from={start}", "--set=sft.steps=0",
                    "--parts=train", f"--workdir={tmp_path / 'work'}",
                    f"--out={out}"])
  results = json.loads(out.with_suffix(".json").read_text())
  cell = results["train"]["cells"]["token/0"]
  assert cell["trl_loss"] == "dapo"
  for name in ("ba_jax", "trl"):
    run = cell["runs"][name]
    assert [s["step"] for s in run["steps"]] == [1, 2]
    for s in run["steps"]:
      assert s["total"] > 0 and s["generation"] > 0
      assert 0.0 <= s["reward"] <= 1.0
    assert 0 < run["rl_seconds"] <= run["run_seconds"]
    assert not math.isnan(run["run_seconds"])
    for value in cell["final"][name].values():
      assert 0.0 <= value <= 1.0
    assert [r["step"] for r in run["curve"] if 0 < r["step"] < 2] == [1]
  # TRL saw exactly our prompts, in our order (checked in the script).
  assert cell["runs"]["trl"]["prompts_checked"] == 2 * 4
  assert cell["runs"]["trl"]["prompt_order_ok"]
  assert results["train"]["meta"]["host"]["matmul_gflops"]["jax"] > 0
  # Both sides' threads per phase, as each library reported them in the run;
  # TRL timed at 1 and at every schedulable CPU, the faster whole run kept.
  from experiments.studies.compare_trl import compare_trl_runs as runs  # pylint: disable=import-outside-toplevel
  cpus = runs.schedulable_cores()
  assert cell["runs"]["ba_jax"]["threads"] == {"generation": runs.xla_threads(),
                                               "update": runs.xla_threads()}
  tried = cell["trl_tried"]
  assert sorted(t["threads"]["update"] for t in tried) == sorted({1, cpus})
  assert all(t["threads"]["generation"] == t["threads"]["update"] for t in tried)
  best = min(tried, key=lambda t: t["run_seconds"])
  assert cell["runs"]["trl"]["threads"] == best["threads"]
  assert cell["runs"]["trl"]["run_seconds"] == pytest.approx(best["run_seconds"], rel=1e-4)
  assert cell["runs"]["ba_jax"]["cache"] == "cold"
  text = out.read_text()
  assert "| token | 0 | ba_jax |" in text and "| token | trl | 0 |" in text
  assert out.with_suffix(".png").stat().st_size > 10_000


@pytest.mark.slow
def test_real_part_times_both_trainers_on_the_real_configs_code_path(tmp_path, monkeypatch):
  """Part 2 on configs/smollm2_reasoning_gym.py:runlocal (a tiny random Llama
  with a chat template standing in for SmolLM2): both trainers run the
  reasoning-gym task's first 2 steps and the report gives their ratio."""
  from model_utils import save_tiny_model  # pylint: disable=import-outside-toplevel
  monkeypatch.chdir(ROOT)
  start = save_tiny_model("llama", tmp_path / "start")
  out = tmp_path / "compare_trl.md"
  compare_trl.main(["--parts=real", "--real_steps=2", "--matmul_n=256",
                    "--real_config=configs/smollm2_reasoning_gym.py:runlocal",
                    f"--real_set=init_from={start}", "--torch_threads=1",
                    f"--workdir={tmp_path / 'work'}", f"--out={out}"])
  real = json.loads(out.with_suffix(".json").read_text())["real"]
  assert real["steps"] == 2 and real["trl_loss"] == "dapo"
  for name in ("ba_jax", "trl"):
    run = real["runs"][name]
    assert [s["step"] for s in run["steps"]] == [1, 2]
    assert all(s["total"] > 0 and 0.0 <= s["reward"] <= 1.0 for s in run["steps"])
    assert 0 < run["rl_seconds"] <= run["run_seconds"]
  assert "## Part 2: the real model, first 2 steps of" in out.read_text()


def _rows(accuracies):
  """(seed, sampled, greedy, reward) rows as the report builds them."""
  return [(s, a, 1.0 - a, 0.5) for s, a in enumerate(accuracies)]


def test_accuracy_row_tests_non_inferiority_from_the_paired_differences():
  import numpy as np  # pylint: disable=import-outside-toplevel
  from scipy import stats  # pylint: disable=import-outside-toplevel
  from experiments.studies.compare_trl import compare_trl_report as report  # pylint: disable=import-outside-toplevel
  theirs = [0.50, 0.55, 0.48, 0.52, 0.60, 0.45]
  diffs = np.array([0.01, -0.02, 0.0, 0.03, -0.01, 0.007])
  ours = list(np.array(theirs) + diffs)
  # The one-sided 95% lower bound of the mean difference, by hand.
  low = diffs.mean() - stats.t.ppf(0.95, 5) * diffs.std(ddof=1) / np.sqrt(6)
  half = stats.t.ppf(0.975, 5) * diffs.std(ddof=1) / np.sqrt(6)
  assert -0.03 < low < -0.005
  row = report._accuracy_verdict("token", _rows(ours), _rows(theirs), 0.03)
  sampled = row.split(" | ")[1:4]
  assert sampled[0] == (f"{diffs.mean():+.3f} [{diffs.mean() - half:+.3f}, "
                        f"{diffs.mean() + half:+.3f}]")
  assert sampled[2].startswith(f"lower bound {low:+.3f} vs -0.03")
  assert sampled[2].endswith("**shown**")
  # A margin the bound does not clear is reported as not shown.
  tight = report._accuracy_verdict("token", _rows(ours), _rows(theirs), 0.005)
  assert "lower bound" in tight and tight.split(" | ")[3].endswith("**NOT shown**")
  # Without a margin the row has no non-inferiority column.
  assert "lower bound" not in report._accuracy_verdict(
      "token", _rows(ours), _rows(theirs))


def test_noninferiority_plan_states_the_power_at_the_planning_sd():
  from ba_jax.ablation import stats as ablation_stats  # pylint: disable=import-outside-toplevel
  from experiments.studies.compare_trl import compare_trl_report as report  # pylint: disable=import-outside-toplevel
  line = report.noninferiority_plan(0.03, 16, 0.04)
  equal = ablation_stats.t_test_power(0.03, 16, 0.04, two_sided=False)
  worse = ablation_stats.t_test_power(0.02, 16, 0.04, two_sided=False)
  assert 0.5 < worse < equal < 1.0
  assert f"{equal:.2f} when the two trainers are equal" in line
  assert f"{worse:.2f} when ba_jax is 0.01 worse" in line
  assert "over the 16 seeds is above -0.03" in line


def test_speed_test_bounds_the_geometric_mean_of_the_pairs_ratios():
  import numpy as np  # pylint: disable=import-outside-toplevel
  from scipy import stats  # pylint: disable=import-outside-toplevel
  from experiments.studies.compare_trl import compare_trl_report as report  # pylint: disable=import-outside-toplevel
  # One pair below 2x (the every-pair rule fails), the mean well above it.
  ratios = [2.05, 2.09, 2.27, 2.09, 1.999, 2.18, 2.08, 2.20, 2.19]
  logs = np.log(ratios)
  se = logs.std(ddof=1) / np.sqrt(len(logs))
  low = np.exp(logs.mean() - stats.t.ppf(0.95, len(logs) - 1) * se)
  assert 2.0 < low < np.exp(logs.mean())
  line = report.speed_verdict(ratios, 2.0)
  assert f"**{np.exp(logs.mean()):.3f}x**" in line
  assert f"lower bound **{low:.3f}x**" in line
  assert f"SD of the log ratios {logs.std(ddof=1):.3f}" in line
  assert line.endswith("**shown**.")
  # The same pairs do not show a floor the bound does not clear.
  assert report.speed_verdict(ratios, 2.1).endswith("**NOT shown**.")


def test_speed_plan_states_the_power_at_the_planning_sd():
  from ba_jax.ablation import stats as ablation_stats  # pylint: disable=import-outside-toplevel
  from experiments.studies.compare_trl import compare_trl_report as report  # pylint: disable=import-outside-toplevel
  line = report.speed_plan(2.0, 15, 0.041)
  powers = [ablation_stats.t_test_power(math.log(k), 15, 0.041, two_sided=False)
            for k in (1.025, 1.05, 1.1)]
  assert 0.5 < powers[0] < powers[1] < powers[2] <= 1.0
  for k, power in zip((1.025, 1.05, 1.1), powers):
    assert f"{power:.2f} when the true ratio is {2 * k:.2f}x" in line
  assert "the 15 pairs' ratios (TRL / ba_jax) is above 2x" in line


@pytest.mark.parametrize("flags", [["--speed_plan_sd=0.04"], ["--speed_ratio=0.5"],
                                   ["--speed_ratio=2", "--speed_plan_sd=-1"]])
def test_a_speed_plan_sd_without_a_ratio_or_a_ratio_not_above_1_is_refused(tmp_path, flags):
  with pytest.raises(ValueError, match="--speed_ratio="):
    compare_trl.main(flags + ["--report_only", f"--out={tmp_path / 'x.md'}"])


@pytest.mark.parametrize("flags", [["--plan_sd=0.04"], ["--margin=-0.01"]])
def test_a_plan_sd_without_a_margin_or_a_negative_margin_is_refused(tmp_path, flags):
  with pytest.raises(ValueError, match="--margin="):
    compare_trl.main(flags + ["--report_only", f"--out={tmp_path / 'x.md'}"])


def test_a_protocol_file_must_be_committed_and_decides_the_criteria(tmp_path, monkeypatch, git_repo):
  """--protocol: the guard of ba_jax.ablation.protocol, the file's criteria
  set on the arguments, a contradicting flag refused, and the record
  printed in the results."""
  from ba_jax.ablation import protocol
  from experiments.studies.compare_trl import compare_trl_report as report
  (tmp_path / "code.py").write_text("x = 1\n")
  path = tmp_path / "protocol.json"
  path.write_text(json.dumps(dict(seeds=[6, 7], margin=0.03, plan_sd=0.04)))
  defaults = dict(seeds=[0, 1, 2], losses=["token"], steps=0, margin=0.0, plan_sd=0.0,
                  speed_ratio=0.0, speed_plan_sd=0.0)

  def args(**kw):
    return argparse.Namespace(**dict(defaults, protocol=str(path), allow_dirty=False,
                                     workdir=str(tmp_path / "work"),
                                     out=str(tmp_path / "out" / "c.md")) | kw)
  with pytest.raises(protocol.ProtocolError, match="protocol.json is not committed"):
    compare_trl.apply_protocol(args(), defaults)
  protocol.git(["add", "."], tmp_path)
  protocol.git(["commit", "-qm", "protocol"], tmp_path)
  a = args()
  record = compare_trl.apply_protocol(a, defaults)
  assert (a.seeds, a.margin, a.plan_sd) == ([6, 7], 0.03, 0.04)
  assert record["protocol_commit"] == record["code_commit"] == protocol.git(
      ["rev-parse", "HEAD"], tmp_path)
  with pytest.raises(ValueError, match="--margin=0.05 contradicts"):
    compare_trl.apply_protocol(args(margin=0.05), defaults)
  (tmp_path / "code.py").write_text("x = 2\n")
  with pytest.raises(protocol.ProtocolError, match="uncommitted changes"):
    compare_trl.apply_protocol(args(), defaults)
  dirty = compare_trl.apply_protocol(args(allow_dirty=True), defaults)
  cell = {k: dirty[k] for k in ("code_commit", "protocol_commit", "dirty")}
  lines = report.protocol_record(dict(protocol=dirty, cells={"token/6": cell}))
  assert f"committed at `{dirty['protocol_commit']}`" in lines[0]
  assert "**Dirty tree**: runs went with uncommitted changes to code.py" in lines[0]
