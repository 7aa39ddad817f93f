"""Side by side with TRL's GRPOTrainer on the same job, in one process.

    python -m experiments.studies.compare_trl.compare_trl                      # part 1 and part 2
    python -m experiments.studies.compare_trl.compare_trl --parts=train        # part 1 only
    python -m experiments.studies.compare_trl.compare_trl --parts=real         # part 2 only
    python -m experiments.studies.compare_trl.compare_trl --quick --config=configs/tiny.py:smoke
    python -m experiments.studies.compare_trl.compare_trl --parts=train --warm_cache   # see below

Part 1 ("train", ``--config``, default the default job configs/tiny.py):
the config's supervised warm-up is run once and its policy exported to a
Hugging Face directory with its tokenizer; then, for every seed and every
loss type that TRL also has (our ``token`` = TRL ``dapo``, ``sequence`` =
``grpo``, ``dr_grpo`` = ``dr_grpo``), ba_jax (``ba_jax.run.trainer.run``) and
TRL (``GRPOTrainer``) each run GRPO from that directory, one after the other,
on the same prompts (the task's ``problems``, TRL's retokenised prompt ids
asserted equal to ours), with the same reward function (the task's
``grade``), group size, prompts per step, response budget, temperature,
optimizer and schedule, clip range, advantage scaling, beta = 0, mini-batches
and number of steps. Both final policies are exported to Hugging Face
directories and scored by one evaluator (``ba_jax.run.trainer.evaluate``: held-out
accuracy, sampled and greedy, the same PRNG key). Per RL step the wall time is
split into generation, scoring (rewards), update and the rest.

With ``--warm_cache``, ba_jax's runs use JAX's persistent compilation cache
(``compilation_cache_dir``), filled by an untimed 1-step run (part 1: for each
loss type before its first pair; part 2: before its run): each timed run still
traces and lowers its programs (the in-memory caches are cleared) but loads
them from the cache, as a fresh process of a repeated run does.

ba_jax pads the update's prompts as the config says; ``--set`` /
``--real_set rl.prompt_pad_multiple=k`` pads them to the batch's longest
rounded up to a multiple of k, as TRL pads to the batch's longest, and
``rl.share_prompt=true`` computes each group's prompt once in the update (each
part's padding line in the results says which).

Part 2 ("real", ``--real_config``): the first ``--real_steps`` steps of that
config in both trainers (no held-out evaluation): seconds per step, ratio.

``--protocol=FILE`` reads part 1's pre-stated criteria and arm (any of
``config``, ``seeds``, ``losses``, ``steps``, ``margin``, ``plan_sd``, ``speed_ratio``,
``speed_plan_sd``, ``torch_threads``, ``cores``, ``warm_cache``, ``floor_match``; a JSON
object; protocols/ holds the committed ones) from a file that must be committed and
unchanged at HEAD, on a clean tree (``--allow_dirty`` lets a dirty one
through and the results say so): ``ba_jax.ablation.protocol.guard``. Every
run record then names the protocol's and the code's commit.

Equal hardware: both trainers run in this one process on the same CPUs
(``--cores=N`` refuses to start unless the process may use exactly N: the
one-core arm is ``taskset -c 0 ... --cores=1``). XLA uses its default, one
thread per schedulable CPU (or as ``XLA_FLAGS`` says); each TRL run is timed
at 1 torch thread and at every schedulable CPU and the faster whole run is
the pair's TRL run (``--torch_threads=N``: N only). Every run record holds
its side's threads per phase (generation, update) and its compilation-cache
state; the results file states whether the two sides' threads differed, and
each library's float32 matmul rate measured at the start, with a note beside
the ratio when they differ by more than 1.3x (``--floor_match=R`` refuses
to start where they differ by more than R: a headline's host).

Results: ``--out`` (markdown; raw numbers in the .json next to it, merged
across invocations so the parts can run separately) and the curves' PNG.
Each run's records are kept under ``--workdir`` and a rerun skips finished
runs (``--fresh`` redoes them). The trainers are in compare_trl_runs.py,
the results file in compare_trl_report.py.
"""
import argparse
import copy
import datetime
import json
import os
import pathlib
import platform
import shutil
import sys
import time

from ba_jax.ablation import protocol as protocol_lib
from experiments.studies.compare_trl import compare_trl_hardware as hardware
from experiments.studies.compare_trl import compare_trl_report as report_lib
from experiments.studies.compare_trl.compare_trl_runs import (LOSS_TYPES, REPO, Evaluator, cell_config,
                              load_config, matmul_gflops, run_ours, run_trl,
                              schedulable_cores, torch_thread_counts,
                              warm_up, xla_threads)

RESULTS = REPO / "experiments" / "studies" / "compare_trl" / "results"


def _slug(spec: str) -> str:
  return "".join(ch if ch.isalnum() else "_" for ch in spec).strip("_")


def _save(path: pathlib.Path, record: dict) -> dict:
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_suffix(".tmp")
  tmp.write_text(json.dumps(record, indent=1, default=float))
  tmp.replace(path)
  return record


PROTOCOL_KEYS = ("config", "seeds", "losses", "steps", "margin", "plan_sd", "speed_ratio",
                 "speed_plan_sd", "torch_threads", "cores", "warm_cache", "floor_match")


def check_cores(cores: int) -> None:
  """``--cores=N``: refuse unless this process may run on exactly N CPUs
  (both trainers then share them; ``taskset -c 0`` for one)."""
  if cores and schedulable_cores() != cores:
    cpus = "0" if cores == 1 else f"0-{cores - 1}"
    raise ValueError(f"--cores={cores}: this process may run on {schedulable_cores()} "
                     f"CPU(s); start it under `taskset -c {cpus}` (or pass --cores=0)")


def trl_best(config, workdir: pathlib.Path, counts: list[int], log, label: str,
             **kwargs) -> tuple[dict, list[dict]]:
  """TRL's run at each torch thread count of ``counts``; the faster whole
  run is the pair's TRL run (its final weights kept), and every try's
  threads and seconds are returned beside it."""
  tried = []
  for n in counts:
    log(f"{label} trl: torch threads {n}")
    tried.append(run_trl(config, workdir.with_name(f"{workdir.name}_t{n}"),
                         threads=n, **kwargs))
    log(f"{label} trl, {n} thread(s): {tried[-1]['run_seconds']:.1f} s")
  best = min(tried, key=lambda r: r["run_seconds"])
  for run in tried:
    if run is not best and "final_dir" in run:
      shutil.rmtree(run.pop("final_dir"), ignore_errors=True)
  return best, [dict(threads=r["threads"], run_seconds=r["run_seconds"],
                     rl_seconds=r["rl_seconds"]) for r in tried]


def apply_protocol(args, defaults: dict) -> dict:
  """Set ``args`` from the committed ``--protocol`` file; an error when a
  flag given on the command line says otherwise. The guard's record."""
  path = pathlib.Path(args.protocol)
  out = pathlib.Path(args.out).parent if args.out else RESULTS
  record = protocol_lib.guard([path], allow_dirty=args.allow_dirty,
                              exclude=[pathlib.Path(args.workdir).resolve(), out.resolve()])
  stated = json.loads(path.read_text())
  unknown = sorted(set(stated) - set(PROTOCOL_KEYS))
  if unknown:
    raise ValueError(f"{path}: unknown key(s) {unknown}; expected some of {PROTOCOL_KEYS}")
  for key, value in stated.items():
    given = getattr(args, key)
    if given != defaults[key] and given != value:
      raise ValueError(f"--{key}={given!r} contradicts {path}'s {key}={value!r}: "
                       "the protocol file decides")
    setattr(args, key, value)
  return dict(record, file=str(path))


def part_train(args, log, stamp: dict | None = None) -> dict:
  base = load_config(args.config, args.set)
  steps = args.steps or base.rl.steps
  work = pathlib.Path(args.workdir)
  if args.warm_cache:
    shutil.rmtree(work / "jax_cache", ignore_errors=True)
    base.compilation_cache_dir = str(work / "jax_cache")
  filled = set()  # loss types whose programs are in the persistent cache
  warm = warm_up(base, work / f"warm_{_slug(args.config)}", log)
  log(f"start policy: {warm['dir']} (warm-up {warm['seconds']:.0f} s"
      f"{', reused' if warm['reused'] else ''})")
  counts = torch_thread_counts(args.torch_threads)
  threads = dict(torch_candidates=counts, xla=xla_threads(), cores=schedulable_cores())
  log(f"threads: {threads}")
  cells, index = {}, 0
  for seed in args.seeds:
    before = None
    for loss in args.losses:
      config = cell_config(base, seed=seed, loss=loss, steps=steps,
                           init_from=warm["dir"], eval_every=args.eval_every)
      record_file = work / "records" / "train" / f"{loss}_s{seed}.json"
      if record_file.is_file() and not args.fresh:
        cells[f"{loss}/{seed}"] = json.loads(record_file.read_text())
        log(f"[{loss} seed {seed}] reused {record_file}")
        index += 1
        continue
      evaluator = Evaluator(config)
      if args.warm_cache and loss not in filled:
        # An untimed run writes this loss type's programs to the cache.
        log(f"[{loss}] filling the compilation cache: 1 untimed step")
        fill = copy.deepcopy(config)
        fill.stop_after_steps = 1
        run_ours(fill, work / "runs" / f"fill_{loss}", evaluate=False)
        filled.add(loss)
      if before is None:
        before = evaluator(warm["dir"])
      # Alternate who goes first, so that a drift of the shared host's speed
      # does not always favour the same trainer.
      order = ["ba_jax", "trl"] if index % 2 == 0 else ["trl", "ba_jax"]
      runs, tried = {}, []
      for name in order:
        log(f"[{loss} seed {seed}] {name}: {steps} RL steps")
        if name == "ba_jax":
          runs[name] = run_ours(config, work / "runs" / f"ours_{loss}_s{seed}",
                                evaluate=True,
                                cache="warm" if args.warm_cache else "cold")
        else:
          runs[name], tried = trl_best(
              config, work / "runs" / f"trl_{loss}_s{seed}",
              counts if index % 2 == 0 else counts[::-1], log,
              f"[{loss} seed {seed}]", start_dir=warm["dir"], evaluator=evaluator,
              eval_every=config.eval.every)
        log(f"[{loss} seed {seed}] {name}: {runs[name]['run_seconds']:.1f} s"
            f" (RL steps {runs[name]['rl_seconds']:.1f} s)")
      final = {name: evaluator(runs[name]["final_dir"]) for name in runs}
      for name in runs:
        shutil.rmtree(runs[name].pop("final_dir"), ignore_errors=True)
      log(f"[{loss} seed {seed}] held-out after RL: " + "; ".join(
          f"{n} {a['heldout_acc_sampled']:.3f}/{a['heldout_acc_greedy']:.3f}"
          for n, a in final.items()) + " (sampled/greedy)")
      cells[f"{loss}/{seed}"] = _save(record_file, dict(
          loss=loss, trl_loss=LOSS_TYPES[loss], seed=seed, order=order,
          before=before, final=final, runs=runs, trl_tried=tried,
          **{k: stamp[k] for k in ("code_commit", "protocol_commit", "dirty")
             if stamp}))
      index += 1
  return dict(config=args.config, steps=steps, seeds=args.seeds,
              losses=args.losses, eval_every=args.eval_every,
              default_steps=base.rl.steps, warm=warm,
              settings=_settings(cell_config(
                  base, seed=args.seeds[0], loss=args.losses[0], steps=steps,
                  init_from=warm["dir"], eval_every=args.eval_every)),
              cells=cells, note=args.note, threads=threads, cores_required=args.cores,
              warm_cache=args.warm_cache, margin=args.margin,
              plan_sd=args.plan_sd, speed_ratio=args.speed_ratio,
              speed_plan_sd=args.speed_plan_sd)


def part_real(args, log) -> dict:
  base = load_config(args.real_config, args.real_set)
  work = pathlib.Path(args.workdir)
  if args.warm_cache:
    shutil.rmtree(work / "jax_cache_real", ignore_errors=True)
    base.compilation_cache_dir = str(work / "jax_cache_real")
  warm = warm_up(base, work / f"warm_{_slug(args.real_config)}", log)
  loss = args.real_loss
  config = cell_config(base, seed=base.seed, loss=loss, steps=args.real_steps,
                       init_from=warm["dir"], eval_every=0)
  record_file = work / "records" / "real" / f"{_slug(args.real_config)}.json"
  if record_file.is_file() and not args.fresh:
    log(f"[real] reused {record_file}")
    return json.loads(record_file.read_text())
  counts = torch_thread_counts(args.torch_threads)
  threads = dict(torch_candidates=counts, xla=xla_threads(), cores=schedulable_cores())
  log(f"threads: {threads}")
  if args.warm_cache:
    log("[real] filling the compilation cache: 1 untimed step")
    fill = copy.deepcopy(config)
    fill.stop_after_steps = 1
    run_ours(fill, work / "runs" / "real_fill", evaluate=False)
  runs, tried = {}, []
  for name in ("ba_jax", "trl"):
    log(f"[real] {name}: the first {args.real_steps} steps of "
        f"{args.real_config}")
    if name == "ba_jax":
      runs[name] = run_ours(config, work / "runs" / "real_ours", evaluate=False,
                            cache="warm" if args.warm_cache else "cold")
    else:
      runs[name], tried = trl_best(config, work / "runs" / "real_trl", counts, log,
                                   "[real]", start_dir=warm["dir"], evaluator=None,
                                   eval_every=0)
    log(f"[real] {name}: {runs[name]['run_seconds']:.1f} s")
  return _save(record_file, dict(
      config=args.real_config, init_from=warm["dir"], steps=args.real_steps,
      loss=loss, trl_loss=LOSS_TYPES[loss], settings=_settings(config),
      runs=runs, trl_tried=tried, stand_in=args.real_stand_in, threads=threads,
      warm_cache=args.warm_cache))


def _rounded(x):
  """``x`` with every float to 5 significant digits (the raw file's size)."""
  if isinstance(x, float):
    return float(f"{x:.5g}")
  if isinstance(x, dict):
    return {k: _rounded(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_rounded(v) for v in x]
  return x


def _settings(config) -> dict:
  rl, optim, loss = config.rl, config.optim, config.loss
  return dict(
      prompts_per_step=rl.prompts_per_step, group_size=rl.group_size,
      max_new_tokens=rl.max_new_tokens, temperature=rl.temperature,
      top_p=rl.top_p, top_k=rl.top_k, num_minibatches=rl.num_minibatches,
      num_microbatches=rl.num_microbatches, ppo_epochs=rl.ppo_epochs,
      advantage_std=rl.advantage_std, eps_low=loss.eps_low,
      eps_high=loss.eps_high, learning_rate=optim.learning_rate,
      warmup_steps=optim.warmup_steps, schedule=optim.schedule,
      weight_decay=optim.weight_decay, grad_clip=optim.grad_clip,
      b1=optim.b1, b2=optim.b2, eps=optim.eps,
      heldout=config.eval.num_problems,
      samples_per_problem=config.eval.samples_per_problem,
      eval_temperature=config.eval.temperature, task=config.task.name,
      model_dtype=config.model.dtype, prompt_pad_multiple=rl.prompt_pad_multiple,
      share_prompt=rl.share_prompt)


def _ended(meta: dict) -> dict:
  """``meta`` with the host's 1-minute load average at the end of a part."""
  return dict(meta, host=dict(meta["host"], load_end=os.getloadavg()[0]))


def _host(matmul_n: int) -> dict:
  import importlib.metadata as md
  cpu = platform.processor() or platform.machine()
  try:
    for line in open("/proc/cpuinfo"):
      if line.startswith("model name"):
        cpu = line.split(":", 1)[1].strip()
        break
  except OSError:
    pass
  versions = ", ".join(f"{p} {md.version(p)}" for p in (
      "jax", "flax", "torch", "transformers", "trl"))
  return dict(cpu=cpu, cores=os.cpu_count(), schedulable=schedulable_cores(),
              xla_flags=os.environ.get("XLA_FLAGS", ""), versions=versions,
              load_start=os.getloadavg()[0],
              matmul_gflops=matmul_gflops(matmul_n))


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--config", default="configs/tiny.py")
  p.add_argument("--set", action="append", default=[],
                 help="dotted.key=value set on --config (repeatable), e.g. "
                      "--set=init_from=DIR --set=sft.steps=0")
  p.add_argument("--parts", default="train,real")
  p.add_argument("--seeds", default="0,1,2")
  p.add_argument("--losses", default=",".join(LOSS_TYPES))
  p.add_argument("--steps", type=int, default=0,
                 help="RL steps for both trainers (0: the config's)")
  p.add_argument("--eval_every", type=int, default=20,
                 help="held-out curve every this many RL steps (0: off)")
  p.add_argument("--real_config", default="configs/smollm2_reasoning_gym.py")
  p.add_argument("--real_set", action="append", default=[],
                 help="dotted.key=value set on --real_config (repeatable)")
  p.add_argument("--real_steps", type=int, default=3)
  p.add_argument("--real_loss", default="token", choices=list(LOSS_TYPES))
  p.add_argument("--real_stand_in", default="",
                 help="a line for the results file when --real_config stands "
                      "in for the real one")
  p.add_argument("--quick", action="store_true",
                 help="seconds-scale smoke: 2 steps, seed 0, token loss")
  p.add_argument("--note", default="", help="a line for part 1's results")
  p.add_argument("--warm_cache", action="store_true",
                 help="ba_jax with JAX's persistent compilation cache "
                      "(compilation_cache_dir under --workdir), filled by an "
                      "untimed 1-step run: in part 1 for each loss type "
                      "before its first pair, in part 2 before its run")
  p.add_argument("--margin", type=float, default=0.0,
                 help="part 1: a non-inferiority margin of held-out accuracy, "
                 "stated before the runs (0: no such test)")
  p.add_argument("--plan_sd", type=float, default=0.0,
                 help="with --margin: the SD of the paired differences "
                 "expected (from an earlier run), for the protocol's power")
  p.add_argument("--speed_ratio", type=float, default=0.0,
                 help="part 1: test that ba_jax's whole run is at least this "
                 "many times faster than TRL's (geometric mean over the pairs, "
                 "one-sided 95%%), stated before the runs (0: no such test)")
  p.add_argument("--speed_plan_sd", type=float, default=0.0,
                 help="with --speed_ratio: the SD of the per-pair log ratios "
                 "expected (from an earlier run), for the protocol's power")
  p.add_argument("--protocol", default="",
                 help="part 1's criteria from this committed JSON file "
                      "(refused unless committed and unchanged at HEAD)")
  p.add_argument("--allow_dirty", action="store_true",
                 help="with --protocol: run on a tree with uncommitted changes "
                      "(the results say so)")
  p.add_argument("--workdir", default="/tmp/compare_trl")
  p.add_argument("--out", default="")
  p.add_argument("--torch_threads", type=int, default=0,
                 help="torch intra-op threads for TRL (0: each TRL run timed at "
                      "1 and at every schedulable CPU, the faster whole run "
                      "taken per pair)")
  p.add_argument("--cores", type=int, default=0,
                 help="refuse to run unless this process may use exactly this "
                      "many CPUs (the one-core arm: `taskset -c 0 ... --cores=1`; "
                      "0: no check)")
  p.add_argument("--floor_match", type=float, default=0.0,
                 help="refuse to start unless the two libraries' float32 matmul "
                      "floors measured at the start are within this ratio of "
                      "each other (0: no check)")
  p.add_argument("--matmul_n", type=int, default=2048,
                 help="size of the floor reference's square matmul")
  p.add_argument("--fresh", action="store_true",
                 help="redo runs whose records exist under --workdir")
  p.add_argument("--report_only", action="store_true",
                 help="rewrite --out (and the PNG) from its .json; run nothing")
  args = p.parse_args(argv)
  args.parts = [x for x in args.parts.split(",") if x]
  args.seeds = [int(x) for x in args.seeds.split(",")]
  args.losses = [x for x in args.losses.split(",") if x]
  stamp = None
  if args.protocol and not args.report_only:
    defaults = dict(vars(p.parse_args([])), seeds=[0, 1, 2], losses=list(LOSS_TYPES))
    stamp = apply_protocol(args, defaults)
  if args.margin < 0 or args.plan_sd < 0 or (args.plan_sd and not args.margin):
    raise ValueError(f"--margin={args.margin} --plan_sd={args.plan_sd}: expected "
                     "a margin >= 0 (0: no test) and a plan_sd >= 0 only with a margin")
  if (not (args.speed_ratio == 0 or args.speed_ratio > 1) or args.speed_plan_sd < 0
      or (args.speed_plan_sd and not args.speed_ratio)):
    raise ValueError(f"--speed_ratio={args.speed_ratio} --speed_plan_sd="
                     f"{args.speed_plan_sd}: expected a ratio > 1 (0: no test) and a "
                     "speed_plan_sd >= 0 only with a ratio")
  if not args.report_only:
    check_cores(args.cores)
  if args.quick:
    args.steps, args.seeds, args.losses = 2, [0], ["token"]
    args.eval_every, args.real_steps, args.matmul_n = 1, 2, 1024
  out = pathlib.Path(args.out) if args.out else (
      pathlib.Path(args.workdir) / "compare_trl.md" if args.quick
      else RESULTS / "compare_trl.md")
  raw, png = out.with_suffix(".json"), out.with_suffix(".png")
  log = lambda msg: print(f"[compare_trl {time.strftime('%H:%M:%S')}] {msg}",
                          flush=True)
  results = json.loads(raw.read_text()) if raw.is_file() else {}
  if args.report_only:
    if "train" in results:
      report_lib.plot(results["train"], png)
    report_lib.report(results, out, png)
    return results
  meta = dict(command="python -m experiments.studies.compare_trl.compare_trl " + " ".join(
      argv if argv is not None else sys.argv[1:]),
      date=datetime.datetime.now(datetime.timezone.utc).strftime(
          "%Y-%m-%d %H:%M UTC"), host=_host(args.matmul_n))
  log(f"host: {meta['host']['cpu']}; matmul GFLOP/s "
      f"{meta['host']['matmul_gflops']}")
  hardware.check_floor_match(meta["host"]["matmul_gflops"], args.floor_match)
  for part in args.parts:
    if part == "train":
      results["train"] = dict(part_train(args, log, stamp), meta=_ended(meta),
                              **({"protocol": stamp} if stamp else {}))
      report_lib.plot(results["train"], png)
    elif part == "real":
      results["real"] = dict(part_real(args, log), meta=_ended(meta))
    else:
      raise ValueError(f"--parts: unknown part {part!r} (train, real)")
    raw.parent.mkdir(parents=True, exist_ok=True)
    raw.write_text(json.dumps(_rounded(results), separators=(",", ":")))
    report_lib.report(results, out, png)
  log(f"wrote {out}")
  return results


if __name__ == "__main__":
  main()
