"""compare_trl's hardware statements: both sides' threads per phase, each
library's matmul floor and the caches, on fake records and on the committed
results files (a file whose sides' threads differ must say so)."""
import copy
import json
import pathlib

import pytest

from experiments.studies.compare_trl import compare_trl_hardware as hardware
from experiments.studies.compare_trl import compare_trl_report as report
from experiments.studies.compare_trl import compare_trl_runs as runs

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "experiments" / "studies" / "compare_trl" / "results"
COMMITTED = sorted(p for p in RESULTS.glob("compare_trl_*.json"))


def _part(ours, theirs, tried=(), gflops=(200.0, 200.0)):
  """A part-1-shaped record with one pair and the given per-run threads."""
  return dict(
      cells={"token/0": dict(runs=dict(ba_jax=dict(threads=ours, cache="cold"),
                                       trl=dict(threads=theirs)),
                             trl_tried=[dict(threads={"generation": n, "update": n},
                                             run_seconds=1.0) for n in tried])},
      meta=dict(host=dict(schedulable=2, matmul_gflops=dict(
          jax=gflops[0], torch=gflops[1], n=2048))))


TWO, ONE = {"generation": 2, "update": 2}, {"generation": 1, "update": 1}


def test_equal_threads_are_stated_with_the_counts_tried():
  lines = hardware.thread_lines(_part(TWO, TWO, tried=(1, 2)))
  assert hardware.thread_differences(_part(TWO, TWO)) == []
  assert lines[0].startswith("**Threads equal** in all 1 pair(s): generation/update on 2/2")
  assert "timed at 1 and 2 torch thread(s)" in lines[0]


def test_differing_threads_are_stated_and_an_unequal_budget_is_flagged():
  # TRL timed at 1 and 2, its faster run on 1: the budget was equal.
  equal_budget = hardware.thread_lines(_part(TWO, ONE, tried=(1, 2)))[0]
  assert equal_budget.startswith("**Threads differ** between the two sides in 1 of 1")
  assert "ba_jax (XLA) 2/2 vs TRL (torch) 1/1" in equal_budget
  assert "the budget was equal" in equal_budget
  assert "not a same-hardware comparison" not in equal_budget
  # TRL only ever on 1 thread against XLA's 2.
  unequal = hardware.thread_lines(_part(TWO, ONE, tried=(1,)))[0]
  assert "**not a same-hardware comparison**" in unequal
  # A phase alone differing counts too (generation 2, update 1).
  mixed = hardware.thread_differences(_part(TWO, {"generation": 2, "update": 1}))
  assert [d["trl"] for d in mixed] == [{"generation": 2, "update": 1}]


def test_a_file_before_per_run_records_takes_the_parts_settings():
  part = dict(cells={"token/0": dict(runs=dict(ba_jax={}, trl={}))},
              torch_threads={"threads": 1}, meta=dict(host=dict(cores=2)))
  (diff,) = hardware.thread_differences(part)
  assert (diff["ba_jax"], diff["trl"], diff["recorded"]) == (TWO, ONE, False)
  assert "predates per-run thread records" in hardware.thread_lines(part)[0]


@pytest.mark.parametrize("path", COMMITTED, ids=lambda p: p.stem)
def test_every_committed_results_file_states_whether_its_sides_threads_differ(path, tmp_path):
  results = json.loads(path.read_text())
  committed = path.with_suffix(".md").read_text()
  out = tmp_path / path.with_suffix(".md").name
  report.report(results, out, None)
  rewritten = out.read_text()
  for name, part in results.items():
    word = "**Threads differ**" if hardware.thread_differences(part) else "**Threads equal**"
    expected = hardware.thread_lines(part)[0]
    assert expected.startswith(word)
    assert expected in committed, f"{path.name} part {name}: the report omits {word}"
    assert expected in rewritten


def test_the_speed_tests_file_says_trl_ran_on_fewer_threads_than_xla():
  speed = json.loads((RESULTS / "compare_trl_speed_test.json").read_text())["train"]
  diffs = hardware.thread_differences(speed)
  assert len(diffs) == len(speed["cells"]) and not any(d["budget_equal"] for d in diffs)


def test_the_matmul_floor_note_appears_beside_the_ratio_above_its_tolerance(tmp_path):
  assert hardware.floor_note(_part(TWO, TWO, gflops=(187.0, 188.0))) == ""
  note = hardware.floor_note(_part(TWO, TWO, gflops=(534.0, 237.0)))
  assert f"**Matmul floors differ {534 / 237:.2f}x**" in note and "JAX faster" in note
  results = json.loads((RESULTS / "compare_trl_speed_test.json").read_text())
  for gflops, shown in (((534.0, 237.0), True), ((187.0, 188.0), False)):
    r = copy.deepcopy(results)
    r["train"]["meta"]["host"]["matmul_gflops"].update(jax=gflops[0], torch=gflops[1])
    report.report(r, tmp_path / "c.md", None)
    text = (tmp_path / "c.md").read_text()
    ratio_line = next(l for l in text.splitlines() if l.startswith("All runs:"))
    verdict = next(l for l in text.splitlines() if l.startswith("Speed test ("))
    for line in (ratio_line, verdict):
      assert ("**Matmul floors differ" in line) == shown


def test_a_floor_matched_protocol_refuses_a_host_whose_floors_differ():
  hardware.check_floor_match(dict(jax=186.0, torch=160.0, n=2048), 1.3)
  hardware.check_floor_match(dict(jax=534.0, torch=237.0, n=2048), 0)  # no check asked
  with pytest.raises(ValueError, match=r"floor_match=1.3: .*JAX 534 and torch 237 GFLOP/s "
                     r"\(2048x2048\), a ratio of 2.25; expected at most 1.3"):
    hardware.check_floor_match(dict(jax=534.0, torch=237.0, n=2048), 1.3)
  with pytest.raises(ValueError, match="a ratio of unknown"):
    hardware.check_floor_match(dict(jax=534.0, n=2048), 1.3)


def test_a_warm_cache_says_trl_had_no_warm_start():
  part = _part(TWO, TWO)
  assert "cold against cold" in hardware.cache_line(part)
  part["cells"]["token/0"]["runs"]["ba_jax"]["cache"] = "warm"
  assert "**has no warm start**" in hardware.cache_line(part)


def test_xla_and_torch_thread_counts(monkeypatch):
  monkeypatch.setattr(runs, "schedulable_cores", lambda: 4)
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  assert runs.xla_threads() == 4
  monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")
  assert runs.xla_threads() == 1
  monkeypatch.setenv("XLA_FLAGS", "intra_op_parallelism_threads=3")
  assert runs.xla_threads() == 3
  assert runs.torch_thread_counts(0) == [1, 4] and runs.torch_thread_counts(2) == [2]
  with pytest.raises(ValueError, match="--torch_threads=-1"):
    runs.torch_thread_counts(-1)


def test_the_one_core_arm_refuses_a_process_on_more_cores(monkeypatch):
  pytest.importorskip("trl")
  from experiments.studies.compare_trl import compare_trl  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(compare_trl, "schedulable_cores", lambda: 2)
  with pytest.raises(ValueError, match=r"--cores=1: this process may run on 2 CPU\(s\); "
                     r"start it under `taskset -c 0`"):
    compare_trl.check_cores(1)
  compare_trl.check_cores(2)
  compare_trl.check_cores(0)


PROTOCOLS = sorted((ROOT / "experiments" / "studies" / "compare_trl" / "protocols").glob("*.json"))


@pytest.mark.parametrize("path", PROTOCOLS, ids=lambda p: p.stem)
def test_the_rerun_protocols_use_fresh_seeds_and_known_keys(path):
  """Every committed protocol names only keys the runner knows and seeds no
  run before the protocols used."""
  pytest.importorskip("trl")
  from experiments.studies.compare_trl import compare_trl  # pylint: disable=import-outside-toplevel
  stated = json.loads(path.read_text())
  assert set(stated) <= set(compare_trl.PROTOCOL_KEYS)
  # Seeds of the runs made before the protocols (parts without a protocol
  # record); the protocol runs themselves share seeds across arms by design.
  used = {s for p in COMMITTED for part in json.loads(p.read_text()).values()
          if not part.get("protocol") for s in part.get("seeds", [])}
  assert used and not used & set(stated["seeds"]), f"{path.name}: seeds already run"


@pytest.mark.parametrize("name", ["equal_threads", "matched_floor"])
def test_the_accuracy_margin_is_the_pilots_detectable_difference(name):
  """The protocol's margin: the one-sided detectable difference (power 0.8)
  at its seed count, from the pooled SD of the paired sampled-accuracy
  differences of the 16-seed run, rounded up to 3 decimals."""
  import math  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from ba_jax.ablation import stats  # pylint: disable=import-outside-toplevel
  stated = json.loads((RESULTS.parent / "protocols" / f"{name}.json").read_text())
  pilot = json.loads((RESULTS / "compare_trl_16seeds.json").read_text())["train"]
  variances = []
  for loss in pilot["losses"]:
    d = [pilot["cells"][f"{loss}/{s}"]["final"]["ba_jax"]["heldout_acc_sampled"]
         - pilot["cells"][f"{loss}/{s}"]["final"]["trl"]["heldout_acc_sampled"]
         for s in pilot["seeds"]]
    variances.append(np.var(d, ddof=1))
  sd = math.sqrt(np.mean(variances))
  assert stated["plan_sd"] == pytest.approx(sd, abs=5e-4)
  mdd = stats.min_detectable_difference(len(stated["seeds"]), sd, two_sided=False)
  assert stated["margin"] == math.ceil(mdd * 1000) / 1000
