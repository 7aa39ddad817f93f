"""``ba_jax.dry_run``: abstract compilation of the train step and the sampler.

The figures are checked against what they must be: the donated TrainState
(parameters and two AdamW moments) is the argument and the alias, XLA's FLOP
count matches the analytic one, and a 7.6B-parameter config compiles in a
process that never holds its weights.
"""
import json
import os
import pathlib
import resource
import subprocess
import sys

import jax
import pytest
from absl import flags
from ml_collections import config_flags

from ba_jax.scaling import compile as compile_lib
from ba_jax.scaling import report as report_lib

ROOT = pathlib.Path(__file__).resolve().parents[1]
STATE_COPIES = 3  # parameters + AdamW mu + nu, all in param_dtype


def load(spec: str):
  argv = ["prog", f"--config={ROOT / spec}"]
  values = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, "", flag_values=values,
                                  lock_config=False, sys_argv=argv)
  values(argv)
  return values.config


@pytest.fixture(scope="module")
def tiny_report():
  return compile_lib.dry_run(load("configs/tiny.py"))


def _batch_bytes_per_device(report) -> int:
  s = report["shapes"]
  rows = s["rows"] // report["batch_shards"]
  # int32 prompt ids/mask, int32 response ids/mask, float32 old_logp and
  # advantages.
  return 4 * rows * (2 * s["prompt_len"] + 3 * s["response_len"] + 1)


@pytest.mark.slow
def test_tiny_memory_is_the_state_plus_the_batch(tiny_report):
  r = tiny_report
  assert r["devices"] == 8 and r["mesh"] == {"data": 8, "fsdp": 1, "tensor": 1}
  mem = r["train_step"]["memory"]
  # float32 parameters, replicated on a pure data-parallel mesh.
  state = STATE_COPIES * 4 * r["model"]["params"]
  scalars = 64  # step, nonfinite, optax counts: a few int32 scalars
  assert state <= mem["alias"] <= state + scalars  # the donated state
  assert state <= mem["output"] <= state + scalars + 1024  # + metrics
  expected_args = state + _batch_bytes_per_device(r)
  assert expected_args <= mem["argument"] <= expected_args + scalars
  assert mem["temp"] > 0
  assert mem["peak"] == (mem["argument"] + mem["output"] - mem["alias"]
                         + mem["temp"] + mem["generated_code"])
  sample = r["sample"]["memory"]
  assert sample["argument"] >= 4 * r["model"]["params"]  # the parameters
  assert sample["temp"] > 0 and sample["output"] > 0


def test_tiny_flops_match_the_analytic_estimate(tiny_report):
  """XLA's count and ours agree to within the element-wise work (softmax,
  norms, the optimizer) that the analytic count leaves out."""
  r = tiny_report
  analytic = r["analytic_flops"]
  for program, key in (("train_step", "train_step_xla_counts"),
                       ("sample", "sample_xla_counts")):
    ratio = r[program]["flops_per_device"] / (analytic[key] / r["devices"])
    assert 0.5 < ratio < 2.0, (program, ratio)
  assert analytic["train_step"] > analytic["train_6ND"]  # attention on top
  assert analytic["sample"] > analytic["sample_xla_counts"]


def test_one_update_matches_the_whole_step(tiny_report):
  """The whole step scans its updates, so XLA counts one update in both
  programs; one_update only adds the rest of the batch to the arguments."""
  one = compile_lib.dry_run(load("configs/tiny.py"), sample=False,
                        one_update=True)
  full = tiny_report["train_step"]
  assert one["train_step"]["updates_compiled"] == 1
  assert full["updates_compiled"] == 2
  # Same per-update work; only the metric reductions differ.
  ratio = one["train_step"]["flops_per_device"] / full["flops_per_device"]
  assert abs(ratio - 1) < 0.02
  assert one["train_step"]["memory"]["argument"] == full["memory"]["argument"]


@pytest.mark.slow
def test_recompute_and_kl_compile_the_scoring_program():
  config = load("configs/tiny.py")
  config.rl.old_logp, config.loss.kl_coef = "recompute", 0.1
  r = compile_lib.dry_run(config, one_update=True)
  score = r["score"]
  assert score["memory"]["argument"] > 4 * r["model"]["params"]
  assert score["memory"]["temp"] > 0
  # One forward pass: the train step's analytic count without remat is
  # three of them.
  forward = r["analytic_flops"]["train_step"] / 3 / r["devices"]
  assert 0.5 < score["flops_per_device"] / forward < 2.0


@pytest.mark.slow
def test_mesh_override_shards_the_state():
  config = load("configs/tiny.py")
  config.mesh.data, config.mesh.fsdp, config.mesh.tensor = 2, 2, 2
  r = compile_lib.dry_run(config, sample=False, one_update=True)
  assert r["batch_shards"] == 4
  state = STATE_COPIES * 4 * r["model"]["params"]
  alias = r["train_step"]["memory"]["alias"]
  # fsdp x tensor = 4-way sharding of every matrix; norms stay replicated.
  assert state / 4 <= alias < state / 2


def test_bad_config_errors_name_the_value():
  config = load("configs/tiny.py")
  config.mesh.fsdp = 3
  with pytest.raises(ValueError, match="fsdp"):
    compile_lib.dry_run(config, sample=False)
  config = load("configs/tiny.py")  # the trainer's own checks
  config.rl.max_new_tokens = 8
  with pytest.raises(ValueError, match="rl.max_new_tokens=8"):
    compile_lib.dry_run(config, sample=False)
  config = load("configs/tiny.py")
  config.model.unknown_field = 1
  with pytest.raises(ValueError, match="unknown_field"):
    compile_lib.dry_run(config, sample=False)


@pytest.mark.slow
def test_7b_config_compiles_without_its_weights():
  """Qwen2.5-Math-7B's shapes (15 GB of bfloat16 weights, 46 GB with AdamW)
  compile on this machine; no array of the embedding's size is ever
  created, and the process stays far below the weights' size."""
  config = load("configs/qwen25_math_7b_dapo17k.py")
  config.model.param_dtype = "bfloat16"  # the variant; float32 by default
  config.mesh.data, config.mesh.fsdp, config.mesh.tensor = 1, 4, 2
  config.task.max_prompt_len, config.rl.max_new_tokens = 8, 8
  config.rl.prompts_per_step, config.rl.group_size = 4, 2
  config.rl.num_minibatches, config.rl.num_microbatches = 1, 1
  live_before = sum(x.nbytes for x in jax.live_arrays())
  r = compile_lib.dry_run(config, sample=False)
  params = r["model"]["params"]
  assert abs(params / 7.6e9 - 1) < 0.03
  weight_bytes = 2 * params
  # bfloat16 state split 8 ways (fsdp 4 x tensor 2); norms and the 4 kv
  # heads' biases do not divide and stay replicated.
  alias = r["train_step"]["memory"]["alias"]
  assert STATE_COPIES * weight_bytes / 8 <= alias
  assert alias < 1.01 * STATE_COPIES * weight_bytes / 8
  assert any("bfloat16" in note for note in r["notes"])
  assert sum(x.nbytes for x in jax.live_arrays()) - live_before < 2**20
  max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  assert max_rss < weight_bytes / 2, max_rss


def test_command_line(tmp_path):
  out = tmp_path / "report.json"
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  proc = subprocess.run(
      [sys.executable, "-m", "ba_jax.dry_run",
       "--config=configs/tiny.py:smoke", "--config.rl.max_new_tokens=24",
       "--config.sft.steps=0",  # 24 tokens are too few for the warm-up
       "--num_cpu_devices=8", "--config.mesh.fsdp=2", "--nosample",
       f"--json_out={out}"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  report = json.loads(out.read_text())
  assert report["devices"] == 8
  assert report["mesh"] == {"data": 4, "fsdp": 2, "tensor": 1}
  assert report["shapes"]["response_len"] == 24
  assert "sample" not in report
  assert "per device" in proc.stdout and "train_step" in proc.stdout
  assert "v5e-8: train_step fits" in proc.stdout
  assert "an estimate of an accelerator's" in proc.stdout


def test_report_says_per_tpu_slice_whether_the_peak_fits(tiny_report):
  """One line per named slice and program, judged against the chip's HBM;
  a peak over it is reported as not fitting."""
  text = report_lib.format_report(tiny_report)
  for chip in compile_lib.TPU_HBM_GIB:
    line = next(l for l in text.splitlines() if l.strip().startswith(
        f"{chip}-8:"))
    assert "train_step fits" in line and "sample fits" in line
  assert compile_lib.ESTIMATE_NOTE in text
  big = json.loads(json.dumps(tiny_report))
  big["sample"]["memory"]["peak"] = 20 * 2**30
  text = report_lib.format_report(big)
  assert "v5e-8: train_step fits" in text
  assert "sample does NOT fit (20 of 16 GiB)" in text
  assert "v5p-8: train_step fits" in text and "sample fits (20 of 95" in text


@pytest.mark.slow
def test_dry_run_compiles_the_step_with_activation_constraints():
  """The dry run compiles the trainer's step as the trainer jits it: with
  the mesh's activation constraints, whose sharded residual stream leaves
  fewer temporaries per device than the same step without them."""
  from ba_jax.update import train_step as ts
  config = load("configs/tiny.py")
  config.mesh.data, config.mesh.fsdp = 2, 4
  on = compile_lib.dry_run(config, sample=False)["train_step"]["memory"]
  original = ts.jit_train_step
  try:
    ts.jit_train_step = lambda **kw: original(
        **{**kw, "mesh": None, "rules": None})
    off = compile_lib.dry_run(config, sample=False)["train_step"]["memory"]
  finally:
    ts.jit_train_step = original
  assert on["temp"] < off["temp"], (on["temp"], off["temp"])


LAUNCH = ROOT / "experiments" / "launch"


@pytest.mark.parametrize("script", ["tpu_pod.sh", "multi_gpu.sh"])
def test_launch_scripts_parse(script):
  subprocess.run(["bash", "-n", str(LAUNCH / script)], check=True)


def _dry(script, **env):
  """The commands a launch script prints with DRY=1: the fit check's first."""
  env = {"TARGET": "v5e:2x2", **env}
  proc = subprocess.run(["bash", str(LAUNCH / script), "--config.rl.steps=2",
                         "--config.init_from=/models/m"],
                        env=dict(os.environ, DRY="1", **env),
                        capture_output=True, text=True, timeout=60)
  assert proc.returncode == 0, proc.stderr
  check, *commands = proc.stdout.strip().splitlines()
  assert check.startswith("fit check: python3 -m ba_jax.dry_run --config=") and (
      f"--target={env['TARGET']}" in check), check
  # The run's overrides reach the dry run, its local paths do not.
  assert "--config.rl.steps=2" in check and "init_from" not in check
  return commands


def test_multi_gpu_script_prints_one_command_per_process():
  lines = _dry("multi_gpu.sh", MODE="multi", NUM_GPUS="4",
               GPUS_PER_PROCESS="2", CONFIG="configs/tiny.py",
               WORKDIR="/tmp/run", PORT="1234")
  assert len(lines) == 2
  for i, line in enumerate(lines):
    assert f"--process_id={i}" in line and "--num_processes=2" in line
    assert "--coordinator_address=127.0.0.1:1234" in line
    assert "--config.rl.steps=2" in line
  assert "CUDA_VISIBLE_DEVICES=0\\,1" in lines[0]
  assert "CUDA_VISIBLE_DEVICES=2\\,3" in lines[1]
  single = _dry("multi_gpu.sh", CONFIG="configs/tiny.py", WORKDIR="/tmp/run")
  assert single == ["python3 -m ba_jax.train --config=configs/tiny.py "
                    "--workdir=/tmp/run --config.rl.steps=2 --config.init_from=/models/m"]


def test_multi_gpu_script_rejects_a_bad_mode():
  proc = subprocess.run(["bash", str(LAUNCH / "multi_gpu.sh")],
                        env=dict(os.environ, MODE="pods", CONFIG="c",
                                 WORKDIR="w"),
                        capture_output=True, text=True, timeout=60)
  assert proc.returncode == 2 and "MODE=pods" in proc.stderr


def test_tpu_script_runs_the_same_command_on_every_worker():
  (line,) = _dry("tpu_pod.sh", TPU_NAME="pod", CONFIG="configs/tiny.py",
                 WORKDIR="gs://bucket/run")
  assert line.startswith("gcloud compute tpus tpu-vm ssh pod --worker=all")
  assert "BA_JAX_DISTRIBUTED=1" in line and "ba_jax.train" in line
  assert "--coordinator_address" not in line


@pytest.mark.parametrize("script", ["tpu_pod.sh", "multi_gpu.sh"])
def test_launch_refuses_a_config_that_does_not_fit(script, tmp_path):
  """The fit check's verdict stops the launch, naming the program; no TARGET is an error."""
  fake = tmp_path / "fake_python"  # stands in for the dry run: exit 1 and its one line
  fake.write_text("#!/usr/bin/env bash\n"
                  "case \"$*\" in *ba_jax.dry_run*) echo 'dry run: engine does not fit v5e:8x8: "
                  "it needs 17.9 GiB per chip, the chip has 15.75 GiB' >&2; exit 3;; esac\n"
                  "echo launched\n")
  fake.chmod(0o755)
  env = dict(os.environ, PYTHON=str(fake), CONFIG="configs/tiny.py", WORKDIR=str(tmp_path),
             TPU_NAME="pod", NUM_GPUS="1", FIT_REPORT=str(tmp_path / "fit"))
  env.pop("DRY", None)
  run = lambda **extra: subprocess.run(["bash", str(LAUNCH / script)], env=dict(env, **extra),
                                       capture_output=True, text=True, timeout=60)
  refused = run(TARGET="v5e:8x8")
  assert refused.returncode == 3 and "launched" not in refused.stdout
  assert "refusing to launch: dry run: engine does not fit v5e:8x8" in refused.stderr
  untargeted = run()
  assert untargeted.returncode == 2 and "set TARGET" in untargeted.stderr
  if script == "multi_gpu.sh":  # SKIP_FIT_CHECK=1 launches, and says it checked nothing
    skipped = run(SKIP_FIT_CHECK="1")
    assert skipped.returncode == 0 and "launched" in skipped.stdout
    assert "fit check skipped" in skipped.stderr


def test_multi_gpu_script_stops_every_process_when_one_fails(tmp_path):
  """A stand-in for python: process 1 fails after a second, process 0 would
  run for a minute; the script must exit non-zero long before that."""
  fake = tmp_path / "fake_python"
  fake.write_text("#!/usr/bin/env bash\n"
                  "echo \"args: $*\"\n"
                  "case \"$*\" in *--process_id=1*) sleep 1; exit 3;; esac\n"
                  "sleep 60\n")
  fake.chmod(0o755)
  proc = subprocess.run(
      ["bash", str(LAUNCH / "multi_gpu.sh")],
      env=dict(os.environ, MODE="multi", NUM_GPUS="2", PYTHON=str(fake), SKIP_FIT_CHECK="1",
               CONFIG="configs/tiny.py", WORKDIR=str(tmp_path / "run")),
      capture_output=True, text=True, timeout=30)
  assert proc.returncode == 1, (proc.stdout, proc.stderr)
  assert "a process failed" in proc.stderr
  log0 = (tmp_path / "run" / "logs" / "process_0.log").read_text()
  assert "--process_id=0" in log0 and "127.0.0.1:29500" in log0


def _slot_config(**rl):
  """configs/tiny.py on data 2 x fsdp 2 x tensor 2 (its 2 kv heads split
  over the tensor axis), 512 rows."""
  config = load("configs/tiny.py")
  config.mesh.data, config.mesh.fsdp, config.mesh.tensor = 2, 2, 2
  config.rl.prompts_per_step = 64
  config.rl.update(rl)
  return config


def _slot_bytes(c, length: int) -> int:
  """One slot on each of the 4 batch shards, per device: float32 keys and
  values of half the kv heads in every layer, and the int32 mask."""
  return 2 * c.num_layers * (c.num_kv_heads // 2) * length * c.head_dim * 4 + 4 * length


def test_kv_cache_budget_sets_the_slots():
  from ba_jax.generation import engine
  from ba_jax.policy import kv_cache
  from ba_jax.run import setup as setup_lib
  length = engine.cache_length(16, 32)  # tiny: 16-token prompts, 32 new
  setup = setup_lib.make_setup(_slot_config(), abstract=True)
  c = setup.model_config
  per_slot = _slot_bytes(c, length)
  assert kv_cache.bytes_per_device(c, 4, length, mesh=setup.mesh,
                                   rules=setup.rules) == per_slot
  # The whole cache is 8x one device's keys/values, 4x its mask.
  assert kv_cache.cache_bytes(c, 4, length) == 8 * (per_slot - 4 * length) + 16 * length
  assert setup.rollout_cfg.max_slots == 0  # the default: every row at once
  gib = 10.5 * per_slot / 2**30
  setup = setup_lib.make_setup(_slot_config(kv_cache_gib=gib), abstract=True)
  assert setup.rollout_cfg.max_slots == 10 * 4  # 10 per device, 4 batch shards
  # Both keys: max_slots is used when it fits the budget, else an error.
  setup = setup_lib.make_setup(_slot_config(kv_cache_gib=gib, max_slots=40), abstract=True)
  assert setup.rollout_cfg.max_slots == 40
  with pytest.raises(ValueError, match=r"rl.max_slots=44 .* over rl.kv_cache_gib"):
    setup_lib.make_setup(_slot_config(kv_cache_gib=gib, max_slots=44), abstract=True)
  with pytest.raises(ValueError, match=r"rl.kv_cache_gib=.*holds no slot"):
    setup_lib.make_setup(_slot_config(kv_cache_gib=0.5 * per_slot / 2**30), abstract=True)
  with pytest.raises(ValueError, match=r"rl.kv_cache_gib=-1.0: expected >= 0"):
    setup_lib.make_setup(_slot_config(kv_cache_gib=-1.0), abstract=True)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dry_run_reports_the_engine_and_the_slots_that_fit(monkeypatch, dtype):
  """A config with decode slots compiles the engine; its KV cache is what
  kv_cache counts, and the peak grows by that count per slot, so the slots
  that fit a chip, estimated from one compile, are what a compile at that
  slot count peaks at. A bfloat16 cache compiles as float32 on XLA:CPU
  (which writes bfloat16 through float32 copies); the estimate swaps it
  back."""
  from ba_jax.generation import engine
  length = engine.cache_length(16, 32)
  per_slot = _slot_bytes(load("configs/tiny.py").model, length)  # float32
  compiled_per_slot = per_slot
  if dtype == "bfloat16":
    per_slot -= (per_slot - 4 * length) // 2  # keys and values halve
  gib = 16.5 * per_slot / 2**30
  config = _slot_config(kv_cache_gib=gib)
  r = compile_lib.dry_run(config if dtype == "float32" else _bf16(config), train=False)
  assert "sample" not in r and "train_step" not in r
  e = r["engine"]
  assert e["slots"] == 64 and e["slot_shards"] == 4 and e["slots_per_device"] == 16
  assert e["cache_len"] == length and e["prompt_bucket"] == 16
  assert (e["cache_dtype"], e["compiled_cache_dtype"]) == (dtype, "float32")
  assert e["slot_bytes_per_device"] == per_slot
  assert e["cache_bytes_per_device"] == 16 * per_slot
  assert e["compiled_cache_bytes_per_device"] == 16 * compiled_per_slot
  assert e["accelerator_peak"] == e["memory"]["peak"] - 16 * (compiled_per_slot - per_slot)
  assert e["memory"]["temp"] > e["compiled_cache_bytes_per_device"]  # the cache lives in the program
  assert e["memory"]["argument"] >= 4 * r["model"]["params"] // 8  # the sharded parameters
  assert set(e["slots_that_fit"]) == set(compile_lib.TPU_HBM_GIB)
  assert e["slots_that_fit"]["v5e"] == 512 // 4  # capped at the rows per device
  text = report_lib.format_report(r)
  assert "engine: 64 decode slots (16 per device on 4 batch shards)" in text
  assert "v5e-8 (16 GiB): 128 per device = 512 slots on the mesh" in text
  # Twice the slots: the compiled peak grows by the compiled cache's bytes.
  config = _slot_config(max_slots=128)
  r2 = compile_lib.dry_run(config if dtype == "float32" else _bf16(config), train=False)["engine"]
  grown = r2["memory"]["peak"] - e["memory"]["peak"]
  assert abs(grown / (16 * compiled_per_slot) - 1) < 0.05, (grown, 16 * compiled_per_slot)
  # The AdamW moments stay on the devices while the trainer samples
  # (two float32 copies of the parameters, split 8 ways but the norms).
  assert 8 * r["model"]["params"] / 8 < e["resident_bytes_per_device"] < 8 * r["model"]["params"] / 2
  hbm = r2["accelerator_peak"] + e["resident_bytes_per_device"]
  monkeypatch.setattr(compile_lib, "TPU_HBM_GIB", {"x": hbm / 2**30})
  fit = compile_lib.slots_that_fit(e, rows_per_device=10**9)["x"]
  assert abs(fit - 32) <= 1, fit


def _bf16(config):
  config.model.dtype = "bfloat16"  # compute and cache; float32 parameters
  return config


@pytest.mark.slow
def test_lora_variant_keeps_optimizer_state_for_the_adapters_only():
  """configs/tiny.py:lora: the donated state is the float32 weights plus two
  AdamW moments of the adapters alone, and the report says so."""
  r = compile_lib.dry_run(load("configs/tiny.py:lora"), sample=False)
  m = r["model"]
  assert m["lora_rank"] == 8 and 0 < m["trainable"] < m["params"] / 2
  state = 4 * (m["params"] + 2 * m["trainable"])
  assert state <= r["train_step"]["memory"]["alias"] <= state + 64
  text = report_lib.format_report(r)
  assert (f"LoRA: rank 8 adapters, {report_lib._count(m['trainable'])} trainable parameters"
          in text)


@pytest.mark.slow
def test_a_sampler_correction_compiles_with_the_behaviour_log_probs():
  """rl.old_logp=recompute keeps the sampler's log-probs beside the recomputed
  old ones: the dry run's batch holds them too, as the trainer's does."""
  config = load("configs/tiny.py:smoke")
  config.rl.old_logp = "recompute"
  config.loss.correction = "tis_token"
  report = compile_lib.dry_run(config, sample=False)
  assert report["train_step"]["memory"]["argument"] > 0
