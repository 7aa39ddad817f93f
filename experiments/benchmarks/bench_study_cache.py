"""A study's runs with JAX's persistent compilation cache cold and warm
(``ba_jax.ablate --compilation_cache``, ``ba_jax.ablation.runner``).

    python -m experiments.benchmarks.bench_study_cache [--reps 2]
    python -m experiments.benchmarks.bench_study_cache \
        --spec=experiments/studies/surrogate_grid/spec.py \
        --cell=neg --arm=gspo/balanced/tis_token --lr=3e-4 --seed=1001

Protocol: one job of a study spec (default: the surrogate grid's run named
above, one of its tuning runs) run by the study's own runner
(``runner.execute`` with ``LocalRunner(parallel=2)``: one thread, as each of
the study's two-at-a-time runs had), one run at a time, nothing else asked
of the host. Each repetition gives a new, empty cache directory to the job
twice: ``cold`` (it compiles and fills the cache), then ``warm`` (it loads
them). Reported: each run's wall time (the row's ``wall_s``, the whole
``ba_jax.train`` process: start, held-out evaluation before and after, 20
RL steps) and its first RL step's (``time_step`` of step 1, where the
programs are compiled or loaded), medians over the repetitions and the
warm/cold ratio; and whether every run's outcomes (the row's reward curve,
reward AUC, held-out accuracy, weight-length correlation, mechanism
checks) are identical to the bit, to each other and to the study's own row
of the job where ``tuning.jsonl`` has one. The warm-up the job starts from
is the study's (``runs/warmup_s*``, or under ``--runs``, linked) where
present, else trained once first. Writes experiments/benchmarks/results/study_cache.md.
"""
import argparse
import json
import os
import pathlib
import platform
import statistics
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[2]
OUTCOMES = ("reward_auc", "heldout_after", "heldout_before", "curves",
            "weight_length_corr", "pos_share_minus_frac", "groups_mixed_frac")


def main(argv=None):
  from ba_jax.ablation import runner, spec as spec_lib, stages  # pylint: disable=import-outside-toplevel
  from ba_jax.ablation.store import Store, config_hash, read_rows  # pylint: disable=import-outside-toplevel
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--spec", default="experiments/studies/surrogate_grid/spec.py")
  p.add_argument("--cell", default="neg")
  p.add_argument("--arm", default="gspo/balanced/tis_token")
  p.add_argument("--lr", type=float, default=3e-4)
  p.add_argument("--seed", type=int, default=1001)
  p.add_argument("--reps", type=int, default=2)
  p.add_argument("--runs", default=None,
                 help="where the study's warm-ups are (default: its results' runs/)")
  p.add_argument("--out", default=str(REPO / "experiments/benchmarks/results/study_cache.md"))
  args = p.parse_args(argv)

  spec = spec_lib.load(args.spec)
  job = runner.Job(args.seed, args.cell, args.arm, args.lr)
  key = config_hash(runner.run_settings(spec, job))
  outdir = stages.outdir_of(spec)
  study_runs = pathlib.Path(args.runs) if args.runs else outdir / "runs"
  # read_rows: [] where the study has no tuning rows yet
  committed = [r for r in read_rows(outdir / "tuning.jsonl") if r["config_hash"] == key]

  scratch = pathlib.Path(tempfile.mkdtemp(prefix="bench_study_cache_"))
  warm_src = runner.warmup_settings(spec, runner.warmup_seed(spec, args.seed))
  warm_name = f"warmup_s{args.seed}_{config_hash(warm_src)[:8]}"
  warm_dir = study_runs / warm_name
  if not (warm_dir / "hf" / "config.json").exists():
    warm_dir = scratch / warm_name  # trained once, shared by every run below
    runner.LocalRunner(1).warmup(warm_src, warm_dir)
  results = []
  for rep in range(args.reps):
    cache = scratch / f"cache_{rep}"
    for phase in ("cold", "warm"):
      runs = scratch / f"runs_{rep}_{phase}"
      runs.mkdir(parents=True)
      (runs / warm_name).symlink_to(warm_dir.resolve())
      r = runner.LocalRunner(2, compilation_cache=str(cache))
      t0 = time.perf_counter()
      (row,) = runner.execute([job], spec, r, Store(runs / "rows.jsonl"), runs,
                              log=lambda *_: None).values()
      first = json.loads((runs / job.name / "metrics.jsonl").read_text().splitlines()[0])
      results.append(dict(rep=rep, phase=phase, wall_s=row["wall_s"],
                          total_s=round(time.perf_counter() - t0, 1),
                          first_step_s=round(first["time_step"], 2),
                          entries=len(list(cache.glob("*-cache"))),
                          outcomes={k: row.get(k) for k in OUTCOMES}))
      print(json.dumps({k: v for k, v in results[-1].items() if k != "outcomes"}), flush=True)

  med = {ph: {k: statistics.median(x[k] for x in results if x["phase"] == ph)
              for k in ("wall_s", "first_step_s")} for ph in ("cold", "warm")}
  same = all(x["outcomes"] == results[0]["outcomes"] for x in results)
  vs_row = ("no row of this job in the study's tuning.jsonl" if not committed else
            "identical" if all(committed[0].get(k) == results[0]["outcomes"][k]
                               for k in OUTCOMES) else "DIFFERENT")
  lines = [
      "# A study's runs with the compilation cache cold and warm",
      "",
      f"`python -m experiments.benchmarks.bench_study_cache --spec={args.spec} "
      f"--cell={args.cell} --arm={args.arm} --lr={args.lr:g} --seed={args.seed} "
      f"--reps={args.reps}{' --runs=' + args.runs if args.runs else ''}` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
      f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
      "protocol in the script's docstring).",
      "",
      "| rep | phase | run wall (s) | first RL step (s) | cache entries after |",
      "|---|---|---|---|---|",
      *[f"| {x['rep']} | {x['phase']} | {x['wall_s']} | {x['first_step_s']} | {x['entries']} |"
        for x in results],
      "",
      f"Medians: run {med['cold']['wall_s']:.1f} s cold, {med['warm']['wall_s']:.1f} s "
      f"warm (warm/cold {med['warm']['wall_s'] / med['cold']['wall_s']:.2f}); first RL "
      f"step {med['cold']['first_step_s']:.1f} s cold, {med['warm']['first_step_s']:.1f} s "
      f"warm ({med['warm']['first_step_s'] / med['cold']['first_step_s']:.2f}).",
      "",
      f"Outcomes ({', '.join(OUTCOMES)}) of all {len(results)} runs identical: "
      f"**{'yes' if same else 'NO'}**; against the study's own row of the job "
      f"(run without the cache): **{vs_row}**.",
      "",
  ]
  pathlib.Path(args.out).write_text("\n".join(lines))
  print("\n".join(lines))
  return 0 if same and vs_row != "DIFFERENT" else 1


if __name__ == "__main__":
  raise SystemExit(main())
