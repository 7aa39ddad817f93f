"""The dry run compiled by real chips' compilers (``ba_jax.scaling.targets``).

libtpu and the CUDA plugin (the ``aot`` extra, in the test extra) compile for
compile-only TPU and GPU devices on this CPU host. The smallest TPU slice
libtpu accepts is ``v5e:2x2`` (4 chips).
"""
import os
import pathlib
import subprocess
import sys

import pytest
from ba_jax.policy import attention as attention_lib
from ba_jax.policy import compiling
from ba_jax.policy import kv_cache as kv_cache_lib
from ba_jax.scaling import compile as compile_lib
from ba_jax.scaling import report as report_lib
from ba_jax.scaling import targets as targets_lib

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.py")


def tiny_config(**model):
  import importlib.util
  spec = importlib.util.spec_from_file_location("tiny_cfg", TINY)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  c = module.get_config()
  c.model.update(model)
  return c


def test_parse_target_names_chip_and_topology():
  t = targets_lib.parse_target("v5e:8x8")
  assert (t.platform, t.chip.name, t.topology, t.num_slices) == ("tpu", "v5e", "v5e:8x8", 1)
  g = targets_lib.parse_target("h100:8x8", num_slices=2)
  assert (g.platform, g.topology) == ("gpu", "2x8x8")
  for bad in ("v9:8x8", "v5e", "v5e:8xq", "h100:8x8x2"):
    with pytest.raises(ValueError, match=bad.replace("x", "x")):
      targets_lib.parse_target(bad)


def test_parse_exhausted_reads_both_refusals():
  a = targets_lib.parse_exhausted(
      "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
      "temporaries (17.89G) exceeds available HBM (15.75G).")
  assert a == dict(what="HLO temporaries", needed=int(17.89 * 2**30),
                   available=int(15.75 * 2**30))
  b = targets_lib.parse_exhausted(
      "RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: XLA:TPU compile permanent error. Ran out "
      "of memory in memory space hbm. Used 15.81G of 15.75G hbm. Exceeded hbm capacity by 67.93M.")
  assert b == dict(what="the program", needed=int(15.81 * 2**30), available=int(15.75 * 2**30))
  assert targets_lib.parse_exhausted("INTERNAL: something else") is None


def test_verdict_keeps_headroom():
  program = dict(compiler_refused=False, capacity_bytes=100, memory=dict(peak=90))
  assert targets_lib.verdict(program)["fits"]
  assert not targets_lib.verdict(program, resident=6)["fits"]  # 96 > 95
  refused = dict(compiler_refused=True, capacity_bytes=100, needed_bytes=120)
  assert not targets_lib.verdict(refused)["fits"]


def test_targeting_picks_the_targets_kernels_and_cache_layout():
  assert attention_lib.resolve_impl("auto", head_dim=64, dtype="bfloat16") == "blockwise"
  assert kv_cache_lib.key_axes() == "bkds"
  with compiling.targeting("tpu"):
    assert attention_lib.resolve_impl("auto", head_dim=64, dtype="bfloat16") == "splash"
    assert kv_cache_lib.key_axes() == "bksd"
  with compiling.targeting("gpu"):
    assert attention_lib.resolve_impl("auto", head_dim=64, dtype="bfloat16") == "cudnn"
  assert compiling.backend() == "cpu"
  with pytest.raises(ValueError, match="'npu'"):
    with compiling.targeting("npu"):
      pass


@pytest.mark.slow
def test_tiny_config_compiles_for_a_tpu_slice_with_splash_and_the_engine():
  c = tiny_config(attention_impl="auto", attention_block=128, max_position_embeddings=128)
  c.rl.update(max_new_tokens=112, max_slots=16)
  report = compile_lib.dry_run(c, target=targets_lib.parse_target("v5e:2x2"))
  assert report["platform"] == "tpu" and report["devices"] == 4
  assert report["target"]["compiler"].startswith("XLA:TPU")
  capacity = report["target"]["capacity_bytes"]
  assert 15 * 2**30 < capacity <= 16 * 2**30  # a v5e chip's 16 GiB less what libtpu reserves
  train, engine = report["train_step"], report["engine"]
  assert train["kernels"].get("mosaic", 0) >= 1  # splash lowered to Mosaic calls
  assert engine["slots"] == 16 and engine["memory"]["peak"] > engine["cache_bytes_per_device"]
  verdicts = report_lib.program_verdicts(report)
  assert verdicts["train_step"]["fits"] and verdicts["engine"]["fits"]
  assert report_lib.misfit_line(report) is None
  roof = report["roofline"]
  assert roof["train_step"]["seconds"] > 0 and 0 < roof["train_step"]["mfu"] <= 1
  assert roof["decode_step"]["bound"] == "memory"
  text = report_lib.format_report(report)
  assert "target v5e:2x2" in text and "mosaic" in text and "roofline per v5e chip" in text
  # Leaving the target clears JAX's caches: the CPU suite is back on CPU kernels.
  assert compiling.backend() == "cpu"


@pytest.mark.slow
def test_an_oversized_kv_budget_fails_with_one_line():
  """20 GiB of KV cache per chip on a 16 GiB v5e: the compiler refuses the engine."""
  env = dict(os.environ)
  cmd = [sys.executable, "-m", "ba_jax.dry_run", f"--config={TINY}", "--target=v5e:2x2",
         "--notrain", "--config.model.hidden_size=512", "--config.model.num_heads=4",
         "--config.model.num_kv_heads=4", "--config.model.head_dim=128",
         "--config.rl.max_new_tokens=32768", "--config.rl.kv_cache_gib=20",
         "--config.rl.prompts_per_step=64", "--json_out=/dev/null"]
  out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert out.returncode == 3, out.stderr[-2000:]
  last = [line for line in out.stderr.splitlines() if line.startswith("dry run:")]
  assert len(last) == 1, out.stderr[-2000:]
  assert "engine does not fit v5e:2x2" in last[0] and "15.75 GiB" in last[0]
  assert "does NOT fit: the compiler refused it (RESOURCE_EXHAUSTED" in out.stdout


@pytest.mark.slow
def test_tiny_train_step_compiles_for_an_h100_mesh():
  c = tiny_config(dtype="bfloat16", attention_impl="auto", head_dim=16)
  report = compile_lib.dry_run(c, target=targets_lib.parse_target("h100:1x2"), sample=False)
  assert report["platform"] == "gpu" and report["devices"] == 2
  assert report["target"]["capacity_bytes"] == 84942979072  # the H100 target description's
  assert report_lib.program_verdicts(report)["train_step"]["fits"]
  assert any("cuDNN" in note for note in report["notes"])  # what replaced it, and why


def test_a_cpu_only_host_does_not_start_libtpu():
  """With the target compilers installed, importing ba_jax keeps JAX on the CPU here."""
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
  code = "import ba_jax, jax, os; print(os.environ['JAX_PLATFORMS'], jax.default_backend())"
  out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
  assert out.returncode == 0, out.stderr
  assert out.stdout.split() == ["cpu", "cpu"]
  assert "TPU_ACCELERATOR_TYPE" not in out.stderr and "libtpu" not in out.stderr


def test_accelerator_check_sets_the_roofline_beside_its_timings():
  from ba_jax.generation import sampler
  from ba_jax.run import setup as setup_lib
  from ba_jax.scaling import accelerator
  from ba_jax.scaling import flops as flops_lib
  setup = setup_lib.make_setup(accelerator.run_config("tiny"), abstract=True)
  mc, rl = setup.model_config, setup.cfg.rl
  counts = flops_lib.param_counts(setup.abstract_params, mc)
  P = setup.cfg.task.max_prompt_len
  analytic = flops_lib.analytic_flops(
      mc, counts["matmul"], rows=rl.prompts_per_step * rl.group_size, prompts=rl.prompts_per_step,
      prompt_len=P, response_len=rl.max_new_tokens, ppo_epochs=rl.ppo_epochs,
      micro_batches=rl.num_microbatches, prompt_bucket=sampler.bucket_length(P))
  assert accelerator.predicted_steps(setup, analytic, counts, "cpu") is None
  predicted = accelerator.predicted_steps(setup, analytic, counts, "TPU v5e")
  train, decode = predicted["train_step"], predicted["decode_step"]
  chip = targets_lib.CHIPS["v5e"]
  assert train["seconds"] == max(train["flops"] / chip.peak_bf16_flops,
                                 train["bytes"] / chip.hbm_bytes_per_s) > 0
  assert decode["bound"] == "memory" and decode["seconds"] > 0
  line = report_lib.predicted_line(dict(roofline=predicted, train_step=dict(
      step_s=10 * train["seconds"]), decode=dict(decode_step_s=4 * decode["seconds"])))
  assert "measured" in line and "10% of the bound's speed" in line and "25% of" in line


def test_the_paper_mesh_lays_out_on_every_target_slice():
  """fsdp 16 x tensor 4 on a v6e 8x8 torus (no physical axis of 16), and data across slices."""
  from ba_jax.policy import sharding
  shape = {"data": -1, "fsdp": 16, "tensor": 4}
  v6e = sharding.make_mesh(shape, targets_lib.target_devices(targets_lib.parse_target("v6e:8x8")))
  assert dict(v6e.shape) == {"data": 1, "fsdp": 16, "tensor": 4}
  two = sharding.make_mesh(shape, targets_lib.target_devices(
      targets_lib.parse_target("v5e:8x8", num_slices=2)))
  assert dict(two.shape) == {"data": 2, "fsdp": 16, "tensor": 4}
  for i in range(2):  # each data index is one slice: only data parallelism crosses the DCN
    assert {d.slice_index for d in two.devices[i].flat} == {i}
  with pytest.raises(ValueError, match="multiple of the slices"):
    sharding.make_mesh({"tensor": 1, "fsdp": -1}, targets_lib.target_devices(
        targets_lib.parse_target("v5e:8x8", num_slices=2)))


def test_splash_hands_a_query_shorter_than_its_tile_to_full_attention():
  """The one-token call that creates LoRA adapters, traced for a TPU."""
  import jax
  import jax.numpy as jnp
  q, k, v = (jax.random.normal(jax.random.key(i), (2, 1, 4, 16)) for i in range(3))
  mask = jnp.ones((2, 1), jnp.int32)
  with compiling.targeting("tpu"):
    got = attention_lib.attend(q, k[:, :, :2], v[:, :, :2], mask, impl="auto", block=128)
  want = attention_lib.attend(q, k[:, :, :2], v[:, :, :2], mask, impl="full", block=128)
  assert jnp.allclose(got, want, atol=1e-6)
