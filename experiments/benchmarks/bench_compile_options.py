"""XLA:CPU compile options (``ba_jax.policy.compiling``) on a config's RL run: compile
time and step time, with and without them.

    python -m experiments.benchmarks.bench_compile_options [--reps 3] [--steps 20]
    python -m experiments.benchmarks.bench_compile_options --config=configs/smollm2_reasoning_gym.py \
        --steps=4 --reps=2 --out=experiments/benchmarks/results/compile_options_smollm2.md

Protocol: each run is a fresh process that runs ``--steps`` GRPO steps of
``--config`` (default ``configs/tiny.py``) from one start policy (the config's
warm-up, made once, first; or its ``init_from``) through
``ba_jax.run.trainer.run``, with XLA's compile log on; the modes alternate
within each repetition, so slow drift of the host hits all alike. Modes:
``default`` and ``fast`` (the config with ``xla_cpu_compile`` set to that:
``compiling.CPU_OPTIONS`` on the programs built with ``compiling.jit``), and
``xla_flags`` (``default``, with the ``fast`` options given to every program
of the process through ``XLA_FLAGS``). Reported per mode, as medians over the
repetitions: seconds compiling (the train step, the sampler, all programs),
the first RL step (which compiles) and the mean step after it. Writes
experiments/benchmarks/results/compile_options.md.
"""
import argparse
import json
import logging
import os
import pathlib
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[2]

MODES = ("default", "fast", "xla_flags")


def child(mode: str, spec: str, steps: int, warm: str, workdir: str):
  import jax  # pylint: disable=import-outside-toplevel
  from experiments.studies.compare_trl import compare_trl_runs as runs  # pylint: disable=import-outside-toplevel
  compiled = {}

  class Log(logging.Handler):
    def emit(self, record):
      m = re.match(r"Finished XLA compilation of jit\((\w+)\) in ([\d.]+) sec",
                   record.getMessage())
      if m:
        compiled[m.group(1)] = compiled.get(m.group(1), 0.0) + float(m.group(2))

  jax.config.update("jax_log_compiles", True)
  for name in ("jax._src.dispatch", "jax._src.interpreters.pxla"):
    logging.getLogger(name).addHandler(Log())
    logging.getLogger(name).propagate = False
  base = runs.load_config(spec, [])
  config = runs.cell_config(base, seed=0, loss="token", steps=steps,
                            init_from=warm, eval_every=0)
  config.xla_cpu_compile = "default" if mode == "xla_flags" else mode
  out = runs.run_ours(config, pathlib.Path(workdir), evaluate=False)
  s = out["steps"]
  print("RESULT " + json.dumps(dict(
      mode=mode, run=out["run_seconds"], first=s[0]["total"],
      step=statistics.mean(x["total"] for x in s[1:]),
      update=statistics.mean(x["update"] for x in s[1:]),
      compile_train=compiled.get("train_step", 0.0),
      compile_sample=compiled.get("_sample_program", 0.0),
      compile_all=sum(compiled.values()))))


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--reps", type=int, default=3)
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--config", default="configs/tiny.py")
  parser.add_argument("--out", default=str(REPO / "experiments/benchmarks/results/compile_options.md"))
  parser.add_argument("--child", nargs=3, metavar=("MODE", "WARM", "WORKDIR"))
  args = parser.parse_args()
  if args.child:
    child(args.child[0], args.config, args.steps, args.child[1], args.child[2])
    return
  from ba_jax.policy import compiling  # pylint: disable=import-outside-toplevel
  from experiments.studies.compare_trl import compare_trl_runs as runs  # pylint: disable=import-outside-toplevel
  work = pathlib.Path(tempfile.mkdtemp(prefix="compile_options_"))
  warm = runs.warm_up(runs.load_config(args.config, []), work / "warm", print)["dir"]
  flags = " ".join(f"--{k}={str(v).lower()}" for k, v in compiling.CPU_OPTIONS["fast"].items())
  rows = []
  for rep in range(args.reps):
    for mode in MODES:
      env = dict(os.environ)
      if mode == "xla_flags":
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + flags).strip()
      proc = subprocess.run(
          [sys.executable, "-m", "experiments.benchmarks.bench_compile_options", "--steps", str(args.steps), "--config", args.config,
           "--child", mode, warm,
           str(work / "run")], env=env, cwd=REPO, capture_output=True, text=True, check=False)
      line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
      if proc.returncode or not line:
        sys.exit(f"{mode} run failed:\n{proc.stderr[-3000:]}")
      rows.append(json.loads(line[0][len("RESULT "):]))
      print(rep, rows[-1], flush=True)
  keys = ("compile_train", "compile_sample", "compile_all", "first", "step", "update", "run")
  med = {m: {k: statistics.median(r[k] for r in rows if r["mode"] == m) for k in keys}
         for m in MODES}
  lines = [
      f"# XLA:CPU compile options on `{args.config}`",
      "",
      f"Written by `python -m experiments.benchmarks.bench_compile_options --config={args.config} "
      f"--reps={args.reps} --steps={args.steps}` "
      f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}); "
      f"host: {platform.processor() or platform.machine()}, {os.cpu_count()} cores. "
      f"`fast` options: `{flags}`. Each run is a fresh process; medians over {args.reps} "
      "repetitions, modes alternating (see the script's docstring).",
      "",
      "| mode | compile: train step (s) | compile: sampler (s) | compile: all (s) | "
      "first step (s) | step after (s) | of which update (s) | whole run (s) |",
      "|---|---|---|---|---|---|---|---|"]
  for m in MODES:
    v = med[m]
    lines.append(f"| {m} | {v['compile_train']:.2f} | {v['compile_sample']:.2f} | "
                 f"{v['compile_all']:.2f} | {v['first']:.2f} | {v['step']:.3f} | "
                 f"{v['update']:.3f} | {v['run']:.2f} |")
  d, b = med["default"], med["fast"]
  lines += ["", f"fast / default: compile (all) {b['compile_all'] / d['compile_all']:.2f}x, "
            f"first step {b['first'] / d['first']:.2f}x, steps after it "
            f"{b['step'] / d['step']:.2f}x, whole run {b['run'] / d['run']:.2f}x.", "",
            "Every run:", "", "```"] + [json.dumps(r) for r in rows] + ["```", ""]
  pathlib.Path(args.out).write_text("\n".join(lines))
  print("\n".join(lines))


if __name__ == "__main__":
  main()
