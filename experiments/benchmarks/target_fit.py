"""The paper configs compiled by the chips' own compilers: fit, headroom, kernels, speed bound.

    pip install -e ".[aot]"
    python -m experiments.benchmarks.target_fit --output_dir=experiments/benchmarks/results/target_fit

Runs ``python -m ba_jax.dry_run --target=T`` (the train step and the rollout
engine) for each paper config, full and ``:lora``, on each target slice,
plus the 7B config on two v5e-64 slices, one process each, one after the
other; a combination whose JSON report is already in ``--output_dir`` is not
compiled again (delete it to redo it). Then writes ``README.md`` there: the
table of verdicts (compiler, memory per chip, headroom, compile time,
kernels) and the roofline table (``ba_jax.scaling.roofline``).
"""
from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONFIGS = (("7B", "configs/qwen25_math_7b_dapo17k.py"), ("1.7B", "configs/qwen3_1p7b_polaris.py"))
VARIANTS = (("full", ""), ("lora", ":lora"))
TARGETS = (("v5e:8x8", 1), ("h100:8x8", 1), ("v6e:8x8", 1), ("v5p:4x4x4", 1))
# Two slices double the data axis, so a micro-batch must hold 32 rows (data 2 x fsdp 16).
EXTRA = (("7B", "configs/qwen25_math_7b_dapo17k.py", "full", "", "v5e:8x8", 2,
          ("--config.rl.num_microbatches=16",)),)


def combos():
  """Target by target (the smallest chip first), so that a partial sweep covers whole targets."""
  for target, slices in TARGETS:
    for name, path in CONFIGS:
      for variant, suffix in VARIANTS:
        yield name, path, variant, suffix, target, slices, ()
  yield from EXTRA


def stem(name, variant, target, slices) -> str:
  t = target.replace(":", "_") + (f"_x{slices}" if slices > 1 else "")
  return f"{name}_{variant}_{t}"


def run(out_dir: pathlib.Path, name, path, variant, suffix, target, slices, flags=()) -> None:
  json_path = out_dir / f"{stem(name, variant, target, slices)}.json"
  if json_path.exists():
    return
  cmd = [sys.executable, "-m", "ba_jax.dry_run", f"--config={path}{suffix}", f"--target={target}",
         f"--num_slices={slices}", *flags, f"--json_out={json_path}.partial"]
  start = time.perf_counter()
  done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
  wall = time.perf_counter() - start
  # Exit 3 is a verdict (a program does not fit); anything else is a failure,
  # recorded with the end of its error so that the table shows it.
  if done.returncode not in (0, 3):
    error = [line for line in done.stderr.splitlines() if line.strip()][-1:]
    (out_dir / f"{json_path.stem}.error.txt").write_text(
        f"{' '.join(cmd)}\nexit {done.returncode}\n{done.stderr[-6000:]}")
    print(f"{json_path.name}: FAILED ({done.returncode}): {error}", flush=True)
    return
  report = json.loads(pathlib.Path(f"{json_path}.partial").read_text())
  report["wall_s"] = round(wall, 1)
  report["command"] = " ".join(["python -m ba_jax.dry_run", *cmd[3:-1]])
  json_path.write_text(json.dumps(report, indent=1) + "\n")
  pathlib.Path(f"{json_path}.partial").unlink()
  print(f"{json_path.name}: {wall:.0f} s", flush=True)


def _gib(n: float) -> str:
  return f"{n / 2**30:.2f}"


def table(out_dir: pathlib.Path) -> str:
  from ba_jax.scaling import report as report_lib  # noqa: PLC0415
  rows, roof = [], []
  for name, path, variant, suffix, target, slices, flags in combos():
    json_path = out_dir / f"{stem(name, variant, target, slices)}.json"
    error_path = out_dir / f"{stem(name, variant, target, slices)}.error.txt"
    if not json_path.exists():
      if error_path.exists():  # the compile itself failed: say how, not a verdict
        status = error_path.read_text().splitlines()[1]
        rows.append(f"| {name} {variant} | {target} | (the whole dry run) | - | - | - | - | **not compiled: the "
                    f"dry run ended with {status}** ([log]({error_path.name})) | - | - |")
      # A rerun of the train step alone (--nosample), where one was made.
      json_path = out_dir / f"{stem(name, variant, target, slices)}_nosample.json"
      if not json_path.exists():
        continue
    r = json.loads(json_path.read_text())
    t = r["target"]
    verdicts = report_lib.program_verdicts(r)
    where = target + (f" x {slices} slices" if slices > 1 else "") + "".join(
        f" `{flag}`" for flag in flags)
    for program, v in verdicts.items():
      p = r[program]
      memory = ("refused: " + _gib(p["needed_bytes"]) + " GiB asked" if p["compiler_refused"]
                else _gib(v["needed_bytes"]))
      extra = ""
      if program == "engine" and "slots_per_device" in p:
        extra = f"; {p['slots_per_device']} slots/chip, KV {_gib(p['cache_bytes_per_device'])} GiB"
      kernels = ", ".join(f"{k} {n}" for k, n in sorted(p.get("kernels", {}).items())) or "none"
      rows.append(f"| {name} {variant} | {where} | {program}{extra} | {t['compiler']} | {memory} | "
                  f"{_gib(t['capacity_bytes'])} | {100 * v['headroom']:.1f}% | "
                  f"{'fits' if v['fits'] else '**does not fit**'} | {p['compile_s']} | {kernels} |")
    if slices == 1 and "roofline" in r:
      x = r["roofline"]
      line = f"| {name} {variant} | {target} | {x['peak_bf16_flops'] / 1e12:g} | {x['hbm_bytes_per_s'] / 1e9:g} |"
      for part in ("train_step", "decode_step"):
        y = x.get(part)
        line += (f" {y['seconds'] * 1e3:.4g} ms ({y['bound']}), {y['tokens_per_s']:,.0f} tok/s, "
                 f"MFU <= {100 * y['mfu']:.0f}% |" if y else " - |")
      roof.append(line)
  head = ["# The paper configs on real targets, by their own compilers", "",
          "`python -m experiments.benchmarks.target_fit --output_dir=" + str(out_dir.relative_to(ROOT)) + "`"
          " (one `python -m ba_jax.dry_run --target=...` per row group; each JSON here holds its"
          " full report and command).", "",
          "Memory is per chip: the compiler's memory analysis of the program (arguments + outputs -"
          " aliased + temporaries + code; on TPU the temporaries are an upper bound of the"
          " compiler's own figure), plus, for the engine, the optimizer state the trainer keeps"
          " resident while it samples. Capacity is what the compiler lets a program use (libtpu's"
          " figure on TPU; the target description's memory on GPU). A fit leaves 5% of it free."
          " Compile seconds were taken on a 2-core host, often with other work running.", "",
          "| config | target | program | compiler | GiB per chip | capacity GiB | headroom | verdict"
          " | compile s | kernels |", "|---|---|---|---|---|---|---|---|---|---|", *rows, "",
          "## Roofline (an upper bound on speed, not a measurement)", "",
          "Per chip, from the model's own FLOP formula (Pallas kernels included) and the bytes the"
          " step must move (`ba_jax.scaling.roofline`): a step cannot be faster than its FLOPs at"
          " the chip's bf16 peak nor than its bytes at the chip's HBM bandwidth. Train step: one"
          " whole step (every mini- and micro-batch); decode step: one token for every engine"
          " slot.", "",
          "| config | target | peak TFLOP/s | HBM GB/s | train step | decode step |",
          "|---|---|---|---|---|---|", *roof]
  return "\n".join(head) + "\n"


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--output_dir", required=True)
  parser.add_argument("--only", default="", help="run only combinations whose file stem contains this")
  parser.add_argument("--table_only", action="store_true", help="compile nothing: rewrite README.md")
  args = parser.parse_args()
  out_dir = pathlib.Path(args.output_dir).resolve()
  out_dir.mkdir(parents=True, exist_ok=True)
  for combo in combos():
    name, _, variant, _, target, slices, _ = combo
    if args.only in stem(name, variant, target, slices) and not args.table_only:
      run(out_dir, *combo)
  (out_dir / "README.md").write_text(table(out_dir))


if __name__ == "__main__":
  main()
