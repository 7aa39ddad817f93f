"""The accelerator check behind ``python -m ba_jax.accelerator_check``.

On the machine's devices it (1) names them and the chip's published peak
bf16 FLOP/s (``CHIPS``, matched on ``jax.devices()[0].device_kind``), (2)
runs the test suite's device-sensitive tests on the real backend
(``TEST_FILES``: the attention kernels, splash on TPU and cuDNN on GPU among
them, the train step, the sampler's and the engine's equality checks), (3)
times a train step and a decode step of a random Qwen2 of ~0.5B parameters
(Qwen2.5-0.5B's shapes; tokens/s and MFU against the peak), and (4) sets the
dry run's memory figures (``ba_jax.scaling.compile.dry_run``, compiled for
this device and, off CPU, XLA:CPU's estimate) against the device's memory
and the peak it measured while timing. On CPU it runs the same path with a
tiny model and skips (2): the suite itself runs there.

The device is only touched after the tests, which run in a subprocess (a
TPU serves one process at a time, and a GPU's memory is preallocated by the
first process that uses it); a short subprocess names the backend first.
"""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import platform
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

from ba_jax.scaling import report as report_lib

PARTS = ("tests", "train", "decode", "memory")

# Published peak dense bf16 FLOP/s per JAX device (a GPU; a TPU v4 and later
# chip; a TPU v2/v3 core, half a chip), matched in order on
# ``device_kind``: the first pattern that is a substring wins.
CHIPS: tuple[tuple[str, str, float], ...] = (
    ("GH200", "NVIDIA GH200", 989e12),
    ("H200", "NVIDIA H200", 989e12),
    ("H100 NVL", "NVIDIA H100 NVL", 835e12),
    ("H100 PCIe", "NVIDIA H100 PCIe", 756e12),
    ("H100", "NVIDIA H100 SXM", 989e12),
    ("B200", "NVIDIA B200", 2250e12),
    ("A100", "NVIDIA A100", 312e12),
    ("L40S", "NVIDIA L40S", 362e12),
    ("L40", "NVIDIA L40", 181e12),
    ("L4", "NVIDIA L4", 121e12),
    ("TPU v2", "TPU v2 (per core)", 22.5e12),
    ("TPU v3", "TPU v3 (per core)", 61.5e12),
    ("TPU v4", "TPU v4", 275e12),
    ("TPU v5 lite", "TPU v5e", 197e12),
    ("TPU v5e", "TPU v5e", 197e12),
    ("TPU v5", "TPU v5p", 459e12),
    ("TPU v6 lite", "TPU v6e", 918e12),
    ("TPU v6e", "TPU v6e", 918e12),
)

# The suite's tests whose numbers depend on the backend; on fewer than 8
# devices those that build a 2x2x2 mesh are left out (``MULTI_DEVICE_TESTS``).
TEST_FILES = ("tests/test_attention_kernels.py", "tests/test_train_step.py",
              "tests/test_sampler.py", "tests/test_engine.py")
MULTI_DEVICE_TESTS = (
    "tests/test_attention_kernels.py::test_splash_kernel_in_interpret_mode_equals_blockwise",
    "tests/test_train_step.py::test_sharded_step_equals_single_device_step",
    "tests/test_sampler.py::test_sharded_on_8_devices_equals_one_device",
    "tests/test_engine.py::test_sharded_on_8_devices_equals_one_device",
)

# Qwen2.5-0.5B's architecture (494M parameters), and a tiny one for CPU.
MODELS = {
    "qwen2_0p5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=896,
                       intermediate_size=4864, num_layers=24, num_heads=14,
                       num_kv_heads=2, head_dim=64, rope_theta=1e6,
                       tie_word_embeddings=True, attention_bias=True,
                       max_position_embeddings=32768),
    "tiny": dict(model_type="qwen2", vocab_size=512, hidden_size=64,
                 intermediate_size=128, num_layers=2, num_heads=4,
                 num_kv_heads=2, head_dim=16, tie_word_embeddings=True,
                 attention_bias=True, max_position_embeddings=256),
}


@dataclasses.dataclass(frozen=True)
class Shapes:
  """One step's batch: ``prompts x group`` rows of ``prompt_len`` prompt and
  ``response_len`` response tokens; the update in ``microbatches``."""
  prompts: int
  group: int
  prompt_len: int
  response_len: int
  microbatches: int
  dtype: str


SHAPES = {"qwen2_0p5b": Shapes(16, 4, 128, 384, 8, "bfloat16"),
          "tiny": Shapes(8, 2, 16, 16, 1, "float32")}


def chip(device_kind: str) -> tuple[str, float | None]:
  """(the chip's name, its peak dense bf16 FLOP/s per device), or
  (``device_kind``, None) for a chip ``CHIPS`` does not know."""
  kind = device_kind.lower()
  for pattern, name, peak in CHIPS:
    if pattern.lower() in kind:
      return name, peak
  return device_kind, None


def run_config(model: str):
  """A run config of ``model``'s architecture (``MODELS``) with its
  ``SHAPES``: one update per step over ``microbatches``, the schema's
  defaults elsewhere; the synthetic task only gives the prompt length."""
  from ba_jax.config import common
  s = SHAPES[model]
  c = common.base()
  c.model = common.model(**MODELS[model], dtype=s.dtype,
                         param_dtype="float32", attention_impl="auto")
  c.task = common.synthetic_task(max_prompt_len=s.prompt_len)
  c.sft.steps = 0
  c.rl.update(steps=1, prompts_per_step=s.prompts, group_size=s.group,
              max_new_tokens=s.response_len, num_minibatches=1,
              num_microbatches=s.microbatches)
  return c


# --- (1) and (2): subprocesses, before this process touches a device -------

def probe() -> dict:
  """The backend, device count and kind, from a subprocess (so that this
  process has not claimed the device yet)."""
  code = ("import json, jax; d = jax.devices(); print(json.dumps(dict("
          "backend=jax.default_backend(), count=len(d), "
          "kind=d[0].device_kind, jax=jax.__version__)))")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                       text=True, timeout=300)
  if out.returncode:
    raise RuntimeError(f"could not start JAX: {out.stderr.strip()[-2000:]}")
  return json.loads(out.stdout.strip().splitlines()[-1])


def repo_root() -> pathlib.Path:
  return pathlib.Path(__file__).resolve().parents[2]


def run_tests(devices: int, *, timeout: int, root: pathlib.Path | None = None
              ) -> dict:
  """``TEST_FILES`` (not the slow ones) on the real backend in a pytest
  subprocess, float32 matmuls at full precision (the tests' tolerances are
  float32's; GPUs default to TF32 and TPUs to bf16 passes): counts and the
  failures' names."""
  root = root or repo_root()
  files = [f for f in TEST_FILES if (root / f).is_file()]
  if not files:
    return dict(ok=None, status="not run: no tests/ beside the package (run "
                "from a checkout)")
  deselect = [] if devices >= 8 else [
      a for t in MULTI_DEVICE_TESTS for a in ("--deselect", t)]
  env = dict(os.environ, JAX_DEFAULT_MATMUL_PRECISION="highest")
  with tempfile.TemporaryDirectory() as tmp:
    xml_path = os.path.join(tmp, "tests.xml")
    t0 = time.perf_counter()
    try:
      proc = subprocess.run(
          [sys.executable, "-m", "pytest", *files, "-q", "-m", "not slow",
           "-p", "no:cacheprovider", f"--junitxml={xml_path}", *deselect],
          cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
      return dict(ok=False, status=f"timed out after {timeout} s",
                  files=files)
    seconds = time.perf_counter() - t0
    if not os.path.exists(xml_path):
      return dict(ok=False, status="pytest did not run", files=files,
                  output=(proc.stdout + proc.stderr)[-2000:])
    suite = ET.parse(xml_path).getroot()
    suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
    failed = [f"{case.get('classname')}::{case.get('name')}"
              for case in suite.iter("testcase")
              if case.find("failure") is not None
              or case.find("error") is not None]
  count = lambda key: int(suite.get(key, 0))
  skipped, errors = count("skipped"), count("errors")
  failures = count("failures")
  ok = not failed and not proc.returncode
  return dict(ok=ok, status="passed" if ok else "FAILED",
              passed=count("tests") - skipped - errors - failures,
              failed=failures, errors=errors, skipped=skipped,
              deselected=len(deselect) // 2, seconds=round(seconds, 1),
              files=files, failures=failed)


# --- (3) and (4): this process on the device --------------------------------

def _median(times: list[float]) -> float:
  return sorted(times)[len(times) // 2]


def _timed(fn, iters: int) -> tuple[float, float]:
  """(seconds of the first call, compile included; median of ``iters``
  more)."""
  import jax
  t0 = time.perf_counter()
  jax.block_until_ready(fn())
  first = time.perf_counter() - t0
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  return first, _median(times)


def _peak_bytes(device) -> int | None:
  stats = device.memory_stats() if hasattr(device, "memory_stats") else None
  return int(stats["peak_bytes_in_use"]) if stats and "peak_bytes_in_use" in stats else None


def _mfu(flops: float, seconds: float, peak: float | None, devices: int):
  return None if peak is None else flops / seconds / (peak * devices)


def time_decode(setup, params, analytic: dict, *, iters: int, peak,
                devices: int) -> dict:
  """A decode step of every row at once (the static sampler, no stop
  token): the whole sampling call with each row's budget at the full
  response length less the same call with a budget of 1 token (the prefill
  and the first draw), over the response's other tokens."""
  import jax
  import numpy as np
  from flax import nnx

  from ba_jax.generation import sampler
  rl, P = setup.cfg.rl, setup.cfg.task.max_prompt_len
  rows, T = rl.prompts_per_step * rl.group_size, rl.max_new_tokens
  model = nnx.merge(setup.graphdef, params)
  rng = np.random.default_rng(0)
  ids = rng.integers(3, setup.model_config.vocab_size,
                     (rl.prompts_per_step, P)).astype(np.int32)
  mask = np.ones_like(ids)

  def sample(budget: int):
    return lambda: sampler.sample_groups(
        model, ids, mask, group_size=rl.group_size, max_new_tokens=T,
        temperature=1.0, eos_id=sampler.NO_STOP, pad_id=0,
        rng=jax.random.key(0), mesh=setup.mesh, rules=setup.rules,
        row_budgets=np.full(rows, budget, np.int32)).tokens

  first, full = _timed(sample(T), iters)
  _, prefill = _timed(sample(1), iters)
  step = max(full - prefill, 1e-9) / (T - 1)
  return dict(rows=rows, prompt_len=P, response_len=T,
              first_call_s=round(first, 3), sample_s=full, prefill_s=prefill,
              decode_step_s=step, tokens_per_s=rows / step,
              sampled_tokens_per_s=rows * T / full,
              mfu=_mfu(analytic["decode_step"], step, peak, devices),
              peak_bytes=_peak_bytes(jax.devices()[0]))


def time_train(setup, params, analytic: dict, *, iters: int, peak,
               devices: int) -> dict:
  """The trainer's jitted train step (state donated) on a random batch."""
  import jax
  import numpy as np

  from ba_jax.run import setup as setup_lib
  from ba_jax.update import train_step as ts
  rl, P = setup.cfg.rl, setup.cfg.task.max_prompt_len
  rows, T = rl.prompts_per_step * rl.group_size, rl.max_new_tokens
  vocab = setup.model_config.vocab_size
  rng = np.random.default_rng(1)
  batch = setup_lib.to_device(dict(
      prompt_ids=rng.integers(3, vocab, (rows, P)).astype(np.int32),
      prompt_mask=np.ones((rows, P), np.int32),
      response_ids=rng.integers(3, vocab, (rows, T)).astype(np.int32),
      response_mask=np.ones((rows, T), np.int32),
      advantages=rng.normal(size=rows).astype(np.float32),
      old_logp=np.full((rows, T), -np.log(vocab), np.float32)),
      setup.mesh, setup.rules)
  state = jax.jit(lambda p: ts.create_state(p, setup.tx), donate_argnums=0,
                  out_shardings=setup.state_sharding)(params)
  step_fn = ts.jit_train_step(graphdef=setup.graphdef, tx=setup.tx,
                              cfg=setup.step_cfg,
                              state_sharding=setup.state_sharding,
                              mesh=setup.mesh, rules=setup.rules)
  holder = {"state": state}

  def one():
    holder["state"], metrics = step_fn(holder["state"], batch)
    return metrics["loss"]

  first, step = _timed(one, iters)
  tokens = rows * (P + T) * rl.ppo_epochs
  return dict(rows=rows, tokens_per_row=P + T,
              microbatches=rl.num_microbatches,
              first_call_s=round(first, 3), step_s=step,
              tokens_per_s=tokens / step,
              mfu=_mfu(analytic["train_step"], step, peak, devices),
              nonfinite=int(jax.device_get(holder["state"].nonfinite)),
              peak_bytes=_peak_bytes(jax.devices()[0]))


def memory_check(config, measured: dict, device) -> dict:
  """The dry run's per-device peaks, compiled for this device and (off CPU)
  as XLA:CPU estimates them, beside the device's memory and the peaks
  measured while timing."""
  import jax

  from ba_jax.scaling import compile as compile_lib
  stats = device.memory_stats() if hasattr(device, "memory_stats") else None
  limit = int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None
  out = dict(device_bytes=limit, measured_peak_bytes=measured)
  targets = [("compiled", jax.devices())]
  if device.platform != "cpu":
    try:  # absent when JAX_PLATFORMS leaves the CPU out
      targets.append(("cpu_estimate", jax.devices("cpu")[:1]))
    except RuntimeError:
      pass
  for name, devices in targets:
    report = compile_lib.dry_run(config, devices=devices)
    programs = [p for p in ("train_step", "sample", "engine") if p in report]
    out[name] = {p: dict(peak_bytes=report[p]["memory"]["peak"],
                         compile_s=report[p]["compile_s"]) for p in programs}
  peaks = [v["peak_bytes"] for v in out["compiled"].values()]
  out["fits"] = None if limit is None else max(peaks) <= limit
  return out


# ``chip()``'s names -> ``ba_jax.scaling.targets.CHIPS`` (bandwidth and HBM known).
TARGET_CHIPS = {"TPU v4": "v4", "TPU v5e": "v5e", "TPU v5p": "v5p", "TPU v6e": "v6e", "H100": "h100"}


def predicted_steps(setup, analytic: dict, counts: dict, chip_name: str) -> dict | None:
  """The roofline bound (``ba_jax.scaling.roofline``) of the steps this check
  times, on its chip; None for a chip without published bandwidth here."""
  from ba_jax.generation import engine as engine_lib
  from ba_jax.generation import sampler
  from ba_jax.policy import kv_cache as kv_cache_lib
  from ba_jax.scaling import roofline
  from ba_jax.scaling import targets
  from ba_jax.update import train_step as ts
  import jax
  key = TARGET_CHIPS.get(chip_name)
  if key is None:
    return None
  mc, rl, P = setup.model_config, setup.cfg.rl, setup.cfg.task.max_prompt_len
  rows = rl.prompts_per_step * rl.group_size
  shaped = dict(
      devices=setup.mesh.size, mesh={k: int(v) for k, v in setup.mesh.shape.items()},
      shapes=dict(rows=rows, prompt_len=P, response_len=rl.max_new_tokens,
                  ppo_epochs=rl.ppo_epochs, num_minibatches=rl.num_minibatches,
                  num_microbatches=rl.num_microbatches),
      model=dict(params=counts["total"], matmul_params=counts["matmul"], dtype=mc.dtype,
                 param_dtype=mc.param_dtype, remat=mc.remat,
                 trainable=sum(x.size for x in jax.tree.leaves(
                     ts.trainable(setup.abstract_params)[0]))),
      analytic_flops=analytic)
  chip = targets.CHIPS[key]
  # The timed decode is the static sampler: every row, a cache of bucket + T - 1 positions.
  length = engine_lib.cache_length(sampler.bucket_length(P), rl.max_new_tokens) - 1
  cache = kv_cache_lib.bytes_per_device(mc, rows, length, mesh=setup.mesh, rules=setup.rules)
  return dict(chip=key, train_step=roofline.estimate(shaped, chip)["train_step"],
              decode_step=roofline.decode_step(shaped, chip, rows=rows,
                                               cache_bytes_per_device=cache))


def check(*, parts=PARTS, model: str = "auto", iters: int = 3,
          test_timeout: int = 300, log=print) -> dict:
  """Runs the check's ``parts`` and returns its report (see the module
  docstring); ``model``: ``auto`` (0.5B on an accelerator, tiny on CPU) or
  a key of ``MODELS``. ``log`` gets one line per part as it ends."""
  t_start = time.perf_counter()
  unknown = sorted(set(parts) - set(PARTS))
  if unknown:
    raise ValueError(f"--parts: unknown {unknown}; expected some of {list(PARTS)}")
  found = probe()
  name, peak = chip(found["kind"])
  report = dict(backend=found["backend"], devices=found["count"],
                device_kind=found["kind"], chip=name, peak_bf16_flops=peak,
                jax=found["jax"], python=platform.python_version())
  log(report_lib.device_line(report))
  if "tests" in parts:
    if found["backend"] == "cpu":
      report["tests"] = dict(ok=None, status="skipped on cpu (the whole "
                             "suite runs there: python -m pytest)")
    else:
      report["tests"] = run_tests(found["count"], timeout=test_timeout)
    log(report_lib.tests_line(report["tests"]))

  import jax
  from ba_jax.generation import sampler
  from ba_jax.run import setup as setup_lib
  from ba_jax.scaling import flops as flops_lib
  if model == "auto":
    model = "tiny" if found["backend"] == "cpu" else "qwen2_0p5b"
  config = run_config(model)
  setup = setup_lib.make_setup(config, abstract=True)
  mc, rl = setup.model_config, setup.cfg.rl
  counts = flops_lib.param_counts(setup.abstract_params, mc)
  P = setup.cfg.task.max_prompt_len
  analytic = flops_lib.analytic_flops(
      mc, counts["matmul"], rows=rl.prompts_per_step * rl.group_size,
      prompts=rl.prompts_per_step, prompt_len=P,
      response_len=rl.max_new_tokens, ppo_epochs=rl.ppo_epochs,
      micro_batches=rl.num_microbatches,
      prompt_bucket=sampler.bucket_length(P))
  report["model"] = dict(name=model, params=counts["total"],
                         matmul_params=counts["matmul"], dtype=mc.dtype,
                         param_dtype=mc.param_dtype,
                         attention_impl=mc.attention_impl)
  devices = setup.mesh.size
  measured = {}
  if "train" in parts or "decode" in parts:
    params = setup_lib.init_params(setup)
    if "decode" in parts:
      report["decode"] = time_decode(setup, params, analytic, iters=iters,
                                     peak=peak, devices=devices)
      measured["decode"] = report["decode"]["peak_bytes"]
      log(report_lib.decode_line(report["decode"], peak))
    if "train" in parts:
      report["train_step"] = time_train(setup, params, analytic, iters=iters,
                                        peak=peak, devices=devices)
      measured["train"] = report["train_step"]["peak_bytes"]
      log(report_lib.train_line(report["train_step"], report["model"], peak))
    del params
  predicted = predicted_steps(setup, analytic, counts, name)
  if predicted is not None:
    report["roofline"] = predicted
    log(report_lib.predicted_line(report))
  if "memory" in parts:
    report["memory"] = memory_check(config, measured, jax.devices()[0])
    log(report_lib.memory_line(report["memory"]))
  report["wall_s"] = round(time.perf_counter() - t_start, 1)
  return report
