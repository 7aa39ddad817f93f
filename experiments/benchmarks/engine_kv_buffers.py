"""Cache-sized buffers in the 7B config's rollout engine as XLA:TPU compiles it.

    pip install -e ".[aot]"
    python -m experiments.benchmarks.engine_kv_buffers --kv_cache_gib=8 \
        --output=experiments/benchmarks/results/engine_kv_buffers.json

Compiles the engine of ``configs/qwen25_math_7b_dapo17k.py`` for a v5e-64
slice (libtpu, compile-only devices) and counts, in the optimized program,
the instructions whose result is one layer's keys or values for the slots a
chip holds (a "layer buffer"), by opcode: the cache itself is 2 per layer
(broadcast at the start, then updated in place); a ``copy`` or an
``all-gather`` of one is a second copy of the cache. Also writes the
compiler's memory analysis. It uses only APIs the engine had before the
fixes, so the same script measures an older checkout (``--repo``).
"""
from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import os
import pathlib
import re
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

CONFIG = "configs/qwen25_math_7b_dapo17k.py"


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--kv_cache_gib", type=float, default=8.0)
  parser.add_argument("--topology", default="v5e:8x8")
  parser.add_argument("--output", required=True)
  args = parser.parse_args()
  root = pathlib.Path.cwd()
  import jax  # noqa: PLC0415
  from jax.experimental import topologies  # noqa: PLC0415
  from ba_jax.generation import engine as engine_lib, sampler as sampler_lib  # noqa: PLC0415
  from ba_jax.run import setup as setup_lib  # noqa: PLC0415

  spec = importlib.util.spec_from_file_location("config", root / CONFIG)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config(None)
  config.rl.kv_cache_gib = args.kv_cache_gib
  devices = topologies.get_topology_desc(topology_name=args.topology, platform="tpu").devices
  context = None
  try:  # a checkout with ba_jax.policy.compiling.targeting builds for the target
    from ba_jax.policy import compiling  # noqa: PLC0415
    context = compiling.targeting("tpu")
  except (ImportError, AttributeError):
    pass
  if context is not None:
    context.__enter__()
  setup = setup_lib.make_setup(config, abstract=True, devices=devices)
  rl, c = setup.rollout_cfg, setup.model_config
  state = setup_lib.abstract_state(setup)
  lowered = engine_lib.lower(
      setup.graphdef, state.params, prompts=rl.prompts_per_step,
      prompt_len=sampler_lib.bucket_length(setup.cfg.task.max_prompt_len),
      group_size=rl.group_size, max_new_tokens=rl.max_new_tokens, slots=rl.max_slots,
      mesh=setup.mesh, rules=setup.rules, temperature=rl.temperature, top_k=rl.top_k,
      top_p=rl.top_p, prefill_chunk=rl.prefill_chunk)
  start = time.perf_counter()
  compiled = lowered.compile()
  seconds = time.perf_counter() - start
  shards = 16  # the config's batch shards (fsdp 16); kv heads split over tensor 4
  held = rl.max_slots // shards
  kv_heads = max(1, c.num_kv_heads // setup.mesh.shape["tensor"])
  length = engine_lib.cache_length(sampler_lib.bucket_length(setup.cfg.task.max_prompt_len),
                                   rl.max_new_tokens, rl.prefill_chunk)
  dims = {f"{held},{kv_heads},{c.head_dim},{length}", f"{held},{kv_heads},{length},{c.head_dim}",
          f"{rl.max_slots},{kv_heads},{c.head_dim},{length}",
          f"{rl.max_slots},{kv_heads},{length},{c.head_dim}"}
  pattern = re.compile(r"= bf16\[([\d,]+)\]\{[^}]*\} ([a-z\-]+)\(")
  by_op = collections.Counter()
  for line in compiled.as_text().splitlines():
    m = pattern.search(line)
    if m and m.group(1) in dims and m.group(2) in ("copy", "all-gather", "broadcast"):
      by_op[f"{m.group(2)} {'all slots' if m.group(1).startswith(str(rl.max_slots) + ',') else 'own slots'}"] += 1
  m = compiled.memory_analysis()
  layer_bytes = held * kv_heads * c.head_dim * length * 2
  out = dict(config=CONFIG, kv_cache_gib=args.kv_cache_gib, topology=args.topology,
             slots=rl.max_slots, slots_per_chip=held, layers=c.num_layers,
             layer_buffer_bytes=layer_bytes, needed_layer_buffers=2 * c.num_layers,
             instructions=dict(by_op), temp_bytes=m.temp_size_in_bytes,
             temp_in_layer_buffers=round(m.temp_size_in_bytes / layer_bytes, 1),
             argument_bytes=m.argument_size_in_bytes, compile_s=round(seconds, 1),
             built_for_target=context is not None)
  if context is not None:
    context.__exit__(None, None, None)
  pathlib.Path(args.output).write_text(json.dumps(out, indent=1) + "\n")
  print(json.dumps(out, indent=1))


if __name__ == "__main__":
  sys.exit(main())
