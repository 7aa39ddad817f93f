"""Compile-only devices of real chips, and their compilers' verdicts.

``--target`` names a chip and a slice: a TPU topology as libtpu spells it
(``v5e:8x8``, ``v5p:4x4x4``, ``v6e:8x8``, ``v4:4x4x4``, ``v5e:2x2``, ...) or a
GPU mesh ``h100:HxG`` (H hosts of G GPUs). ``target_devices`` gives that
slice's devices without the hardware: libtpu (``pip install -e ".[aot]"``)
and the CUDA plugin compile for them on a CPU-only host
(``jax.experimental.topologies``), so a program's memory, fit and kernels come
from the compiler the chip runs, not from XLA:CPU.

- The fit verdict is the compiler's: XLA:TPU refuses a program that does not
  fit the chip's HBM (``RESOURCE_EXHAUSTED``: what it needed, what the chip
  has), and ``hbm_capacity`` reads the HBM a program may use from that same
  message (a probe that cannot fit). XLA:GPU compiles any size, so a GPU's
  capacity is its target description's device memory.
- Memory is ``compiled.memory_analysis()`` of the target's compiler; on TPU
  its temporaries are an upper bound of the compiler's own HBM figure.
- Kernels: the custom calls in the compiled program (Mosaic for Pallas on
  TPU, Triton and cuDNN on GPU).
"""
from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import time

import jax
import jax.numpy as jnp

GiB = 2**30
TARGET_CONFIGS = pathlib.Path(__file__).resolve().parent / "target_configs"


@dataclasses.dataclass(frozen=True)
class Chip:
  """Published figures of one chip (vendor specifications)."""
  name: str
  platform: str            # "tpu" or "gpu"
  hbm_bytes: int           # memory per chip
  peak_bf16_flops: float   # dense bfloat16 FLOP/s per chip
  hbm_bytes_per_s: float   # memory bandwidth per chip


# Google Cloud's TPU pages and NVIDIA's H100 SXM datasheet (dense, no sparsity).
CHIPS = {
    "v4": Chip("v4", "tpu", 32 * GiB, 275e12, 1228e9),
    "v5e": Chip("v5e", "tpu", 16 * GiB, 197e12, 819e9),
    "v5p": Chip("v5p", "tpu", 95 * GiB, 459e12, 2765e9),
    "v6e": Chip("v6e", "tpu", 32 * GiB, 918e12, 1640e9),
    "h100": Chip("h100", "gpu", 80 * 10**9, 989e12, 3.35e12),
}
# The share of a chip's capacity a run may plan for; the rest is headroom.
HEADROOM = 0.05


@dataclasses.dataclass(frozen=True)
class Target:
  name: str                # as given: "v5e:8x8", "h100:8x8"
  chip: Chip
  topology: str            # libtpu's topology, or the GPU's "slices x hosts x gpus"
  num_slices: int = 1

  @property
  def platform(self) -> str:
    return self.chip.platform


def parse_target(name: str, num_slices: int = 1) -> Target:
  """``"v5e:8x8"`` -> a Target; a clear error for anything else."""
  chip_name, _, shape = name.partition(":")
  chip = CHIPS.get(chip_name)
  dims = shape.split("x") if shape else []
  if chip is None or not dims or not all(d.isdigit() and int(d) > 0 for d in dims):
    raise ValueError(
        f"--target={name!r}: expected CHIP:AxB[xC] with CHIP one of {sorted(CHIPS)} "
        "(TPU topologies as libtpu names them, e.g. v5e:8x8, v5p:4x4x4; a GPU mesh as "
        "h100:HOSTSxGPUS, e.g. h100:8x8)")
  if num_slices < 1:
    raise ValueError(f"--num_slices={num_slices}: expected 1 or more")
  if chip.platform == "gpu":
    if len(dims) != 2:
      raise ValueError(f"--target={name!r}: a GPU mesh is HOSTSxGPUS, e.g. h100:8x8")
    topology = f"{num_slices}x{dims[0]}x{dims[1]}"
  else:
    topology = f"{chip_name}:{shape}"
  return Target(name, chip, topology, num_slices)


def _load_libtpu_quietly() -> None:
  # Several compile-only users of libtpu on one host (tests in parallel, a
  # training run beside a dry run) would otherwise fight over its lockfile.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")


def target_devices(target: Target) -> list:
  """The target slice's compile-only devices (slice-major for several slices)."""
  from jax.experimental import topologies
  try:
    if target.platform == "tpu":
      _load_libtpu_quietly()
      kwargs = {"num_slices": target.num_slices} if target.num_slices > 1 else {}
      desc = topologies.get_topology_desc(topology_name=target.topology,
                                          platform="tpu", **kwargs)
    else:
      desc = topologies.get_topology_desc(
          platform="cuda", topology_name="", topology=target.topology,
          target_config=(TARGET_CONFIGS / f"{target.chip.name}.txtpb").read_text())
  except (RuntimeError, ValueError, NotImplementedError) as e:
    package = "libtpu" if target.platform == "tpu" else "jax-cuda12-plugin"
    raise RuntimeError(
        f"--target={target.name}: no compile-only devices ({str(e).splitlines()[0]}); "
        f"is {package} installed at jax's version ({jax.__version__})? "
        'pip install -e ".[aot]"') from e
  devices = list(desc.devices)
  if target.num_slices > 1:
    devices.sort(key=lambda d: (getattr(d, "slice_index", 0), d.id))
  return devices


_EXHAUSTED = re.compile(r"required for (.*?) \(([\d.]+)([KMGT]?)\) exceeds available HBM "
                        r"\(([\d.]+)([KMGT]?)\)")
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


# XLA:TPU says it in one of two ways, by the pass that runs out.
_USED = re.compile(r"Ran out of memory in memory space hbm\. Used ([\d.]+)([KMGT]?) of "
                   r"([\d.]+)([KMGT]?) hbm")


def parse_exhausted(message: str) -> dict | None:
  """What XLA:TPU's out-of-memory refusal says: {"what", "needed", "available"} (bytes)."""
  size = lambda number, unit: int(float(number) * _UNITS[unit])
  m = _EXHAUSTED.search(message)
  if m:
    return dict(what=m.group(1), needed=size(m.group(2), m.group(3)),
                available=size(m.group(4), m.group(5)))
  m = _USED.search(message)
  if m:
    return dict(what="the program", needed=size(m.group(1), m.group(2)),
                available=size(m.group(3), m.group(4)))
  return None


def hbm_capacity(target: Target, devices) -> int:
  """Bytes a program may use on one chip, by the target's compiler: on TPU,
  the 'available HBM' of its refusal of a program that cannot fit (a 1 TiB
  buffer); on GPU the target description's device memory."""
  if target.platform == "gpu":
    text = (TARGET_CONFIGS / f"{target.chip.name}.txtpb").read_text()
    return int(re.search(r"device_memory_size:\s*(\d+)", text).group(1))
  mesh = jax.sharding.Mesh(devices[:1], ("x",))
  huge = jax.ShapeDtypeStruct((2**38,), jnp.float32,
                              sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
  try:
    jax.jit(lambda a: a * 2).lower(huge).compile()
  except Exception as e:  # pylint: disable=broad-except  (XlaRuntimeError's module moves)
    parsed = parse_exhausted(str(e))
    if parsed:
      return parsed["available"]
    raise RuntimeError(f"{target.name}: could not read the HBM capacity from the compiler: {e}") from e
  raise RuntimeError(f"{target.name}: the compiler accepted a 1 TiB program; cannot read its HBM")


# Custom-call targets of accelerator kernels in a compiled program's text.
KERNEL_CALLS = {"mosaic": ("tpu_custom_call",), "triton": ("__gpu$xla.gpu.triton", "triton"),
                "cudnn": ("__cudnn$",)}


def kernel_calls(hlo_text: str) -> dict:
  """How many custom calls of each kernel family the compiled program makes."""
  counts = {}
  for line in hlo_text.splitlines():
    if "custom-call" not in line:
      continue
    target = re.search(r'custom_call_target="([^"]+)"', line)
    if not target:
      continue
    for family, prefixes in KERNEL_CALLS.items():
      if any(target.group(1).startswith(p) for p in prefixes):
        counts[family] = counts.get(family, 0) + 1
  return counts


MEMORY_FIELDS = ("argument", "output", "alias", "temp", "generated_code")


def memory_of(compiled) -> dict:
  """Bytes per device of a compiled program, by field, and its ``peak``: arguments + outputs -
  aliased (donated) + temporaries + generated code."""
  m = compiled.memory_analysis()
  out = {f: int(getattr(m, f"{f}_size_in_bytes", 0) or 0) for f in MEMORY_FIELDS}
  out["peak"] = (out["argument"] + out["output"] - out["alias"] + out["temp"]
                 + out["generated_code"])
  return out


def cost_of(compiled) -> dict:
  """The compiler's cost analysis ({} where it gives none, as XLA:GPU does)."""
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):  # older jax: one dict per program
    cost = cost[0] if cost else {}
  return dict(cost or {})


def compile_on_target(lowered, capacity: int) -> dict:
  """Compiles ``lowered`` with its devices' compiler: memory, the compiler's
  fit verdict against ``capacity``, compile seconds, kernels and the
  program's own cost figures. A refusal for lack of memory is a verdict,
  not an error: ``fits`` False with what the compiler said it needed."""
  t0 = time.perf_counter()
  try:
    compiled = lowered.compile()
  except Exception as e:  # pylint: disable=broad-except
    parsed = parse_exhausted(str(e))
    if parsed is None:
      raise
    return dict(fits=False, compiler_refused=True, needed_bytes=parsed["needed"],
                capacity_bytes=parsed["available"], refusal=str(e).splitlines()[0][:300],
                compile_s=round(time.perf_counter() - t0, 1))
  seconds = round(time.perf_counter() - t0, 1)
  cost = cost_of(compiled)
  return dict(fits=True, compiler_refused=False, memory=memory_of(compiled), capacity_bytes=capacity,
              compile_s=seconds, kernels=kernel_calls(compiled.as_text()),
              flops_per_device=float(cost.get("flops", float("nan"))),
              bytes_accessed_per_device=float(cost.get("bytes accessed", float("nan"))))


def verdict(program: dict, resident: int = 0) -> dict:
  """The program's fit with ``HEADROOM`` left: the compiler accepted it and
  its peak plus ``resident`` bytes (what the trainer holds beside it) is at
  most (1 - HEADROOM) of the chip's capacity."""
  capacity = program["capacity_bytes"]
  if program["compiler_refused"]:
    needed = program["needed_bytes"] + resident
  else:
    needed = program["memory"]["peak"] + resident
  return dict(needed_bytes=needed, capacity_bytes=capacity,
              headroom=1 - needed / capacity,
              fits=(not program["compiler_refused"]) and needed <= (1 - HEADROOM) * capacity)
