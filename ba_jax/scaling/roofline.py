"""A roofline estimate of a config's speed on a target chip (an upper bound).

A program cannot run faster than its FLOPs at the chip's peak, nor than its
bytes at the chip's memory bandwidth: ``time >= max(flops / peak, bytes / bw)``
per chip. The FLOPs are the model's own formula (``flops.analytic_flops``),
which counts the work inside Pallas kernels that the compiler's cost analysis
leaves out; the bytes are counted from the same shapes:

- train step: every micro-batch reads the weights each pass (forward,
  backward, and the remat forward), and the optimizer reads and writes the
  parameters and both AdamW moments once per update;
- decode step: every slot of the engine attends over its whole cache (the
  engine's attention reads every position), and the weights of a tensor
  shard are read once for all the slots of a device.

Activations are not counted, so these are speeds the chip cannot beat, not
predictions of what a run reaches; MFU is the model's 6ND (train) or 2ND
(decode) FLOPs over that time at the chip's peak.
"""
from __future__ import annotations

from ba_jax.scaling import targets as targets_lib


def _time(flops: float, nbytes: float, chip: targets_lib.Chip) -> dict:
  compute, memory = flops / chip.peak_bf16_flops, nbytes / chip.hbm_bytes_per_s
  return dict(flops=flops, bytes=nbytes, compute_s=compute, memory_s=memory,
              seconds=max(compute, memory), bound="compute" if compute >= memory else "memory")


def estimate(report: dict, chip: targets_lib.Chip) -> dict:
  """Per chip: the train step's and one decode step's roofline time, tokens/s and MFU."""
  n, s, m = report["devices"], report["shapes"], report["model"]
  flops = report["analytic_flops"]
  tensor = report["mesh"].get("tensor", 1)
  param_bytes = m["params"] * _itemsize(m["param_dtype"])
  compute_bytes = m["matmul_params"] * _itemsize(m["dtype"])
  passes = 3 if m["remat"] == "none" else 4
  updates = s["ppo_epochs"] * s["num_minibatches"]
  micro = updates * s["num_microbatches"]
  # Weights as computed with (each micro-batch, each pass, a tensor shard per
  # chip), plus the optimizer's read and write of parameters and 2 moments.
  trainable_bytes = m["trainable"] * 4
  train_bytes = micro * passes * compute_bytes / tensor + updates * (
      2 * param_bytes + 4 * trainable_bytes) / n
  out = {"chip": chip.name, "peak_bf16_flops": chip.peak_bf16_flops,
         "hbm_bytes_per_s": chip.hbm_bytes_per_s}
  train = _time(flops["train_step"] / n, train_bytes, chip)
  tokens = s["rows"] * (s["prompt_len"] + s["response_len"]) * s["ppo_epochs"]
  train.update(tokens_per_s=tokens / n / train["seconds"],
               mfu=flops["train_6ND"] / n / (train["seconds"] * chip.peak_bf16_flops))
  out["train_step"] = train
  engine = report.get("engine")
  if engine is not None:
    out["decode_step"] = decode_step(report, chip, rows=engine["slots"],
                                     cache_bytes_per_device=engine["cache_bytes_per_device"])
  return out


def decode_step(report: dict, chip: targets_lib.Chip, *, rows: int,
                cache_bytes_per_device: int) -> dict:
  """One token for each of ``rows`` rows (engine slots, or every row of the
  static sampler) attending over a cache of ``cache_bytes_per_device``."""
  n, s, m = report["devices"], report["shapes"], report["model"]
  tensor = report["mesh"].get("tensor", 1)
  per_row = report["analytic_flops"]["decode_step"] / s["rows"]  # at the full cache length
  decode = _time(per_row * rows / n, cache_bytes_per_device
                 + m["matmul_params"] * _itemsize(m["dtype"]) / tensor, chip)
  decode.update(rows_per_device=rows / n, tokens_per_s=rows / n / decode["seconds"],
                mfu=2 * m["matmul_params"] * rows / n / (decode["seconds"] * chip.peak_bf16_flops))
  return decode


def _itemsize(dtype: str) -> int:
  return {"float32": 4, "bfloat16": 2, "float16": 2}[str(dtype)]
