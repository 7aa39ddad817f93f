"""Where an ablation's runs go (ba_jax.ablation.placement): sub-meshes of a
host's devices (``--placement=devices``) and one launch per slice
(``--placement=launcher``). The environment, groups, command lines and
refusals are checked as values; the schedules run a stand-in trainer (a
Python script that imports JAX under the run's environment, counts its
devices and writes a run's files), and one real tiny ``ba_jax.train`` run
checks that a run shown two of four devices builds its mesh on two."""
import os
import pathlib
import shlex
import subprocess
import sys

import pytest

from ba_jax import ablate
from ba_jax.ablation import placement, runner, spec as spec_lib
from ba_jax.ablation.store import Store, read_rows

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs/tiny.py") + ":smoke"

# Stands in for ``python -m ba_jax.train``: JAX under the run's environment
# counts its devices; the files are those summary.summarise reads.
FAKE_TRAIN = r'''
import json, os, pathlib, sys, time
args = dict(a[2:].split("=", 1) for a in sys.argv[1:] if a.startswith("--") and "=" in a)
wd = pathlib.Path(args["workdir"])
import jax
n = jax.device_count()
(wd / "devices.json").write_text(json.dumps(dict(
    platform=jax.default_backend(), kind="fake", devices=n, processes=1, mesh={"data": n})))
(wd / "config.json").write_text(json.dumps(dict(
    eval=dict(num_problems=4, samples_per_problem=2),
    rl=dict(prompts_per_step=2, group_size=2, steps=2))))
r = 0.25 if args["config.loss.aggregation"] == "balanced" else 0.5
(wd / "metrics.jsonl").write_text("".join(
    json.dumps(dict(step=i, reward_mean=r, entropy=1.0, length_mean=5.0)) + "\n"
    for i in (1, 2)))
(wd / "summary.json").write_text(json.dumps(dict(
    step=2, before_rl=dict(heldout_acc_sampled=0.1), after_rl=dict(heldout_acc_sampled=r))))
(wd / "cache.txt").write_text(os.environ.get("JAX_COMPILATION_CACHE_DIR", "-"))
time.sleep(1.0)  # long enough that runs started together overlap
'''

# A launcher: logs the slice and workdir it was given, then runs the command
# here; FAKE_LAUNCH_FAIL names a slice whose launches fail.
FAKE_LAUNCHER = r'''#!/usr/bin/env bash
slice="$1"; workdir="$2"; shift 2
echo "start ${slice} ${workdir} $(date +%s.%N)" >> "${LAUNCH_LOG}"
if [[ "${slice}" == "${FAKE_LAUNCH_FAIL:-}" ]]; then
  echo "slice ${slice} is down" >&2
  exit 7
fi
"$@"
status=$?
echo "end ${slice} ${workdir} $(date +%s.%N)" >> "${LAUNCH_LOG}"
exit ${status}
'''

SPEC = dict(name="placement", config=TINY, cells={"all": {}}, arm_key="loss.aggregation",
            arms=["token", "balanced"], rate_key="optim.learning_rate", rates=[1e-3],
            tune_seeds=[], confirm_seeds=[0, 1], overrides={"rl.steps": 1},
            primary=["reward_auc", "w"], comparisons=[["balanced", "token", "superiority"]])


def jobs(spec):
  return [runner.Job(s, "all", a, spec.rates[0]) for s in spec.confirm_seeds
          for a in spec.arms]


def cpu(n):
  return placement.Devices("cpu", tuple(str(i) for i in range(n)), "test")


@pytest.fixture
def fake_train(tmp_path):
  path = tmp_path / "fake_train.py"
  path.write_text(FAKE_TRAIN)
  return path


# --- devices: groups, environment, refusals -----------------------------------

def test_groups_split_the_host_in_order_and_refuse_what_does_not_divide():
  assert placement.device_groups(cpu(4), 2) == [("0", "1"), ("2", "3")]
  assert placement.device_groups(cpu(4), 4) == [("0", "1", "2", "3")]
  with pytest.raises(ValueError, match=r"--devices_per_run=3 does not divide this "
                     r"host's 4 cpu devices .*use one of \[1, 2, 4\]"):
    placement.device_groups(cpu(4), 3)
  tpu = placement.Devices("tpu", tuple(map(str, range(8))), "test")
  assert len(placement.device_groups(tpu, 4)) == 2
  assert placement.parse_ids("4") == ("0", "1", "2", "3")
  assert placement.parse_ids("2,3,6,7") == ("2", "3", "6", "7")
  with pytest.raises(ValueError, match="distinct"):
    placement.parse_ids("1,1")


def test_the_host_is_read_from_flags_and_environment_without_jax():
  def no_probe(env):
    raise AssertionError("probed although the environment says it all")
  h = placement.host_devices(env={"JAX_PLATFORMS": "cpu", "XLA_FLAGS":
                                  "--xla_force_host_platform_device_count=6"},
                             probe=no_probe)
  assert (h.platform, h.ids) == ("cpu", tuple(map(str, range(6))))
  h = placement.host_devices(env={"JAX_PLATFORMS": "cuda",
                                  "CUDA_VISIBLE_DEVICES": "2,3,5,7"}, probe=no_probe)
  assert (h.platform, h.ids) == ("gpu", ("2", "3", "5", "7"))
  h = placement.host_devices("tpu", "0,1,2,3", env={}, probe=no_probe)
  assert (h.platform, h.ids) == ("tpu", ("0", "1", "2", "3"))
  # nothing said: a child process lists them (here a stand-in)
  listed = lambda env: dict(platform="tpu", kind="TPU v5 lite", count=8)
  h = placement.host_devices(env={}, probe=listed)
  assert (h.platform, len(h.ids)) == ("tpu", 8) and "TPU v5 lite" in h.found
  with pytest.raises(ValueError, match="two JAX devices per chip"):
    placement.host_devices(env={}, probe=lambda env: dict(platform="tpu",
                                                          kind="TPU v3", count=8))
  with pytest.raises(ValueError, match="platform 'rocm'"):
    placement.host_devices("rocm", "2", env={}, probe=no_probe)


def test_the_child_process_lists_the_devices_and_this_one_imports_no_jax(tmp_path):
  """The probe's child sees XLA_FLAGS' fake devices; planning a devices study
  (groups, the configs' meshes) never imports JAX in the parent."""
  env = {"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu",
         "XLA_FLAGS": "--xla_force_host_platform_device_count=3"}
  listed = placement.probe(env)
  assert (listed["platform"], listed["count"]) == ("cpu", 3)
  code = (f"import sys; from ba_jax.ablation import placement as p\n"
          f"r = p.make_runner('devices', devices_per_run=2, platform='cpu', devices='4',"
          f" log=lambda *_: None)\n"
          f"r.check([dict(config={TINY!r}, overrides={{'mesh.fsdp': 2}})])\n"
          f"print(len(r.groups), 'jax' in sys.modules)")
  out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
  assert out.returncode == 0, out.stderr
  assert out.stdout.split() == ["2", "False"]


def test_each_platform_is_shown_only_its_group():
  base = {"PATH": "/bin", "BA_JAX_DISTRIBUTED": "1", "TPU_VISIBLE_DEVICES": "0",
          "XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_dump_to=/x"}
  gpu = placement.run_env(base, "gpu", ("4", "5"), 2, 8, threads=3)
  assert gpu["CUDA_VISIBLE_DEVICES"] == "4,5" and gpu["JAX_PLATFORMS"] == "cuda"
  assert "BA_JAX_DISTRIBUTED" not in gpu  # one process, never jax.distributed
  tpu = placement.run_env(base, "tpu", ("4", "5", "6", "7"), 1, 8, threads=3)
  assert {k: v for k, v in tpu.items() if k.startswith(("TPU_", "CLOUD_TPU", "ALLOW"))} == {
      "TPU_VISIBLE_CHIPS": "4,5,6,7", "TPU_CHIPS_PER_PROCESS_BOUNDS": "2,2,1",
      "TPU_PROCESS_BOUNDS": "1,1,1", "TPU_PROCESS_PORT": "8477",
      "TPU_PROCESS_ADDRESSES": "localhost:8477", "CLOUD_TPU_TASK_ID": "0",
      "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
  assert placement.run_env(base, "tpu", ("0", "1"), 0, 8, 3)[
      "TPU_CHIPS_PER_PROCESS_BOUNDS"] == "1,2,1"
  whole = placement.run_env(base, "tpu", tuple(map(str, range(8))), 0, 8, threads=3)
  assert "TPU_VISIBLE_CHIPS" not in whole  # the whole host: libtpu's own defaults
  cpu_env = placement.run_env(base, "cpu", ("2", "3"), 1, 8, threads=3)
  assert cpu_env["XLA_FLAGS"].split() == [
      "--xla_dump_to=/x", "--xla_force_host_platform_device_count=2",
      "--xla_cpu_multi_thread_eigen=false"]
  assert cpu_env["OMP_NUM_THREADS"] == "3" and cpu_env["JAX_PLATFORMS"] == "cpu"


def test_a_mesh_the_group_cannot_hold_is_refused_before_any_run():
  r = placement.DeviceRunner(cpu(8), 2)
  assert placement.mesh_of(dict(config=TINY, overrides={})) == {
      "data": -1, "fsdp": 1, "tensor": 1}
  r.check([dict(config=TINY, overrides={"mesh.fsdp": 2, "seed": 1})])
  with pytest.raises(ValueError, match=r"--devices_per_run=2: the mesh .*'fsdp': 4.* "
                     r"needs a multiple of 4 devices"):
    r.check([dict(config=TINY, overrides={"mesh.fsdp": 4})])
  with pytest.raises(ValueError, match="needs exactly 4 devices"):
    r.check([dict(config=TINY, overrides={"mesh.data": 1, "mesh.fsdp": 4})])
  assert placement.mesh_problem({"data": -1, "fsdp": 2}, 4) is None


def test_a_flag_of_another_placement_is_refused(tmp_path, capsys):
  with pytest.raises(ValueError, match="--devices_per_run given with --placement=local"):
    placement.make_runner("local", devices_per_run=2)
  with pytest.raises(ValueError, match="needs --devices_per_run"):
    placement.make_runner("devices", platform="cpu", devices="4")
  spec = tmp_path / "spec.py"
  spec.write_text(f"def get_spec():\n  return {SPEC!r}\n")
  status = ablate.main([f"--spec={spec}", "--stage=tune", "--placement=devices",
                        "--platform=cpu", "--devices=4", "--devices_per_run=3",
                        f"--outdir={tmp_path / 'out'}"])
  err = capsys.readouterr().err.strip()
  assert status == 2 and len(err.splitlines()) == 1
  assert err.startswith("ba_jax.ablate: --devices_per_run=3 does not divide")


def test_devices_runs_see_their_own_k_devices_and_groups_never_overlap(
    tmp_path, fake_train, monkeypatch):
  """Four runs on a host of 4 CPU devices, 2 per run: two at a time, each
  process's JAX sees 2 devices, and runs that overlap in time hold disjoint
  groups."""
  real = runner.command
  monkeypatch.setattr(runner, "command", lambda s, w: [
      sys.executable, str(fake_train), *real(s, w)[1:]])
  spec = spec_lib.from_dict(dict(SPEC, warmup="none"))
  r = placement.DeviceRunner(cpu(4), 2)
  assert r.parallel == 2
  store = Store(tmp_path / "rows.jsonl")
  runner.execute(jobs(spec), spec, r, store, tmp_path / "runs", parallel=r.parallel,
                 log=lambda *_: None)
  rows = read_rows(tmp_path / "rows.jsonl")
  assert len(rows) == 4
  for row in rows:
    assert row["placement"]["kind"] == "devices"
    assert row["placement"]["devices"] in ([0, 1], [2, 3])
    assert row["ran_on"]["devices"] == 2 and row["ran_on"]["platform"] == "cpu"
  overlapping = 0
  slack = 0.1  # started_at is rounded to 0.01 s and wall_s to 0.1 s
  for i, a in enumerate(rows):
    for b in rows[i + 1:]:
      if (a["started_at"] < b["started_at"] + b["wall_s"] - slack and
          b["started_at"] < a["started_at"] + a["wall_s"] - slack):
        overlapping += 1
        assert a["placement"]["devices"] != b["placement"]["devices"]
  assert overlapping >= 1  # two did run at once


# --- launcher: one run per slice ----------------------------------------------

def test_the_launch_line_fills_in_the_run_quoted_for_the_shell():
  args = ["--config=configs/tiny.py:smoke", "--workdir=/shared/runs/a b",
          "--config.loss.aggregation=token"]
  line = placement.launch_line("SLICE={slice} launch --dir={workdir} -- {cmd}", args,
                               "python3", "pod-a", "/shared/runs/a b")
  assert shlex.split(line) == ["SLICE=pod-a", "launch", "--dir=/shared/runs/a b", "--",
                               "python3", "-m", "ba_jax.train", *args]
  line = placement.launch_line("tpu_pod.sh {args}", args, "python3", "a", "/w")
  assert shlex.split(line) == ["tpu_pod.sh", *args]
  with pytest.raises(ValueError, match=r"must hold \{cmd\}"):
    placement.LauncherRunner("ssh {slice}", ["a"])
  with pytest.raises(ValueError, match="distinct slice names"):
    placement.LauncherRunner("x {cmd}", ["a", "a"])


def test_tpu_pod_script_takes_a_runs_config_and_workdir_as_arguments(tmp_path):
  proc = subprocess.run(
      ["bash", str(ROOT / "experiments/launch/tpu_pod.sh"), "--config=configs/tiny.py:smoke",
       "--workdir=/shared/runs/x", "--config.rl.steps=2"],
      env=dict(os.environ, DRY="1", TPU_NAME="pod-b", TARGET="v5e:2x2",
               FIT_REPORT=str(tmp_path / "fit")),
      capture_output=True, text=True, timeout=60)
  assert proc.returncode == 0, proc.stderr
  check, line = proc.stdout.strip().splitlines()
  assert "--config=configs/tiny.py:smoke" in check and "--config.rl.steps=2" in check
  assert line.startswith("gcloud compute tpus tpu-vm ssh pod-b --worker=all")
  remote = shlex.split(shlex.split(line)[-1])
  assert remote[-4:] == ["ba_jax.train", "--config=configs/tiny.py:smoke",
                         "--workdir=/shared/runs/x", "--config.rl.steps=2"]


def launcher_study(tmp_path, fake_train, monkeypatch):
  launcher = tmp_path / "launch.sh"
  launcher.write_text(FAKE_LAUNCHER)
  launcher.chmod(0o755)
  python = tmp_path / "python"  # the interpreter {cmd} names: runs the stand-in
  python.write_text(f"#!/usr/bin/env bash\nshift 2\nexec {sys.executable} {fake_train} \"$@\"\n")
  python.chmod(0o755)
  log = tmp_path / "launches.txt"
  monkeypatch.setenv("LAUNCH_LOG", str(log))
  spec = tmp_path / "spec.py"
  spec.write_text("def get_spec():\n  return " + repr(dict(
      SPEC, rates=[1e-3, 3e-3], tune_seeds=[100], results=str(tmp_path / "results")))
      + "\n")
  argv = [f"--spec={spec}", "--stage=tune", "--placement=launcher",
          f"--launcher={launcher} {{slice}} {{workdir}} {{cmd}}", "--slices=a,b",
          f"--python={python}"]
  return argv, log, tmp_path / "results" / "tuning.jsonl"


def launches(log):
  out = {}
  for line in log.read_text().splitlines():
    what, slice_, workdir, t = line.split()
    out.setdefault(workdir, {})[what] = (slice_, float(t))
  return out


def test_launcher_runs_go_one_per_slice_and_rows_come_from_the_shared_workdir(
    tmp_path, fake_train, monkeypatch):
  argv, log, rows_path = launcher_study(tmp_path, fake_train, monkeypatch)
  assert ablate.main(argv + [f"--compilation_cache={tmp_path / 'xla'}"]) == 0
  rows = read_rows(rows_path)
  assert len(rows) == 4  # 2 arms x 2 rates x 1 tuning seed
  # every launch was given the study's compilation cache
  assert {p.read_text() for p in rows_path.parent.glob("runs/*/cache.txt")} == {
      str(tmp_path.resolve() / "xla")}
  runs = launches(log)
  assert len(runs) == 4
  for workdir, times in runs.items():
    assert pathlib.Path(workdir).is_absolute() and "end" in times
  by_slice = {}
  for workdir, t in runs.items():
    by_slice.setdefault(t["start"][0], []).append((t["start"][1], t["end"][1]))
  assert sorted(by_slice) == ["a", "b"]  # both slices took runs
  for spans in by_slice.values():  # one run at a time on a slice
    spans.sort()
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:]))
  first_two = sorted(runs.values(), key=lambda t: t["start"][1])[:2]
  assert {t["start"][0] for t in first_two} == {"a", "b"}
  for row in rows:
    assert row["placement"]["kind"] == "launcher"
    workdir = rows_path.parent.resolve() / "runs" / runner.Job(
        row["seed"], row["cell"], row["arm"], row["lr"]).name
    assert row["placement"]["slice"] == runs[str(workdir)]["start"][0]
    assert row["ran_on"]["platform"] == "cpu"  # the stand-in ran and wrote devices.json


def test_a_failing_launcher_fails_the_study_and_the_same_command_resumes(
    tmp_path, fake_train, monkeypatch, capsys):
  argv, log, rows_path = launcher_study(tmp_path, fake_train, monkeypatch)
  monkeypatch.setenv("FAKE_LAUNCH_FAIL", "b")
  assert ablate.main(argv) == 1
  err = capsys.readouterr().err
  assert "ba_jax.ablate: a run failed; the study stops, and the same command resumes" in err
  assert "on slice b: the launcher exited 7" in err and "slice b is down" in err
  first = read_rows(rows_path)
  assert 1 <= len(first) < 4 and all(r["placement"]["slice"] == "a" for r in first)
  monkeypatch.delenv("FAKE_LAUNCH_FAIL")
  log.unlink()
  assert ablate.main(argv) == 0
  rows = read_rows(rows_path)
  assert len(rows) == 4 and len({r["config_hash"] for r in rows}) == 4
  assert len(launches(log)) == 4 - len(first)  # finished runs did not run again


# --- one real run -------------------------------------------------------------

@pytest.mark.slow
def test_a_real_run_on_two_of_four_devices_builds_its_mesh_on_two(tmp_path):
  spec = spec_lib.from_dict(dict(
      SPEC, warmup="none",
      overrides={"rl.steps": 1, "sft.steps": 2, "eval.num_problems": 4,
                 "checkpoint.async_save": False}))
  r = placement.DeviceRunner(cpu(4), 2)
  store = Store(tmp_path / "rows.jsonl")
  (row,) = runner.execute([runner.Job(0, "all", "token", 1e-3)], spec, r, store,
                          tmp_path / "runs", parallel=r.parallel,
                          log=lambda *_: None).values()
  assert row["steps"] == 1
  assert row["placement"] == {"kind": "devices", "platform": "cpu", "devices": [0, 1]}
  assert row["ran_on"]["devices"] == 2 and row["ran_on"]["processes"] == 1
  assert row["ran_on"]["mesh"] == {"data": 2, "fsdp": 1, "tensor": 1}
