"""The surrogate grid's seed count and wall time, from the powered study's
committed rows (experiments/studies/powered_drafts/results):

    python -m experiments.studies.surrogate_grid.plan_seeds

Seeds: the paired SD of the primary outcome per (cell, comparison) of the
powered study's confirmation runs (``ba_jax.ablation.planning.seeds_needed``),
pooled as the package pools (root mean variance), and the seeds the grid
needs to detect ``DETECTABLE`` at Holm's first step over its family
(``planning.seeds_for_family``); the largest single SD beside it.

Wall time: the runs' measured wall (the rows' ``wall_s``, one core each on
the 2-core host, two at a time) and the warm-up's (powered_timing.md), scaled
so that the same model gives the powered study's measured 1 h 47 min; then
the grid's runs on 2 slots, and on P slots (a host or pod with P cores free,
``--parallel=P``), stage by stage.
"""
from __future__ import annotations

import math
import pathlib

import numpy as np

from ba_jax.ablation import legacy, planning, spec as spec_lib
from ba_jax.ablation.store import read_rows

ROOT = pathlib.Path(__file__).resolve().parents[3]
POWERED = ROOT / "experiments/studies/powered_drafts"
GRID = ROOT / "experiments/studies/surrogate_grid/spec.py"
DETECTABLE = 0.02
# powered_timing.md: a warm-up and its export under load ~5, budget 96 tokens
WARMUP_S = 190.0
# the powered study as run: 232 RL runs and 23 warm-ups in 1 h 47 min, 2 slots
POWERED_RUNS, POWERED_WARMUPS, POWERED_WALL_S = 232, 23, 107 * 60
SLOTS = (2, 16, 64, 256)


def powered_rows():
  rows = read_rows(POWERED / "results/results.jsonl")
  return legacy.rows(rows) if legacy.is_legacy_rows(rows) else rows


def seeds(grid, powered, rows) -> tuple[list[str], int]:
  per = planning.seeds_needed(powered, rows)
  sds = [r["sd"] for r in per]
  pooled = planning.pooled_sd(sds)
  need = planning.seeds_for_family(grid, pooled, DETECTABLE)
  worst = planning.seeds_for_family(grid, max(sds), DETECTABLE)
  lines = ["| powered cell | comparison | pairs | paired SD |", "|---|---|---:|---:|"]
  lines += [f"| {r['cell']} | {r['comparison']} | {r['pairs']} | {r['sd']:.4f} |"
            for r in per]
  lines += ["", f"Pooled paired SD (root mean variance over the {len(sds)} terms): "
            f"{pooled:.4f}; largest: {max(sds):.4f}.", "",
            f"The grid's Holm family: {need['family']} comparisons "
            f"({len(grid.cells)} cells x {need['family'] // len(grid.cells)}), so "
            f"Holm's first step tests at alpha {grid.alpha}/{need['family']} = "
            f"{need['alpha_first']:.5f}. Seeds to detect {DETECTABLE} "
            f"(paired t, power {grid.power}, non-central t):", "",
            "| paired SD | at alpha 0.05 | at Holm's first step |", "|---|---:|---:|",
            f"| pooled {pooled:.4f} | {need['unadjusted']} | **{need['holm_first']}** |",
            f"| largest {max(sds):.4f} | {worst['unadjusted']} | {worst['holm_first']} |"]
  return lines, need["holm_first"]


def stage_wall(runs: int, warmups: int, slots: int, run_s: float, scale: float) -> float:
  """Warm-ups first, then the runs, ``slots`` at a time (whole waves)."""
  return scale * (math.ceil(warmups / slots) * WARMUP_S
                  + math.ceil(runs / slots) * run_s)


def _time(seconds: float) -> str:
  return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.0f} min"


def wall(grid, rows, n_seeds: int) -> list[str]:
  run_s = float(np.mean([r["wall_s"] for r in rows]
                        + [r["wall_s"] for r in read_rows(POWERED / "results/tuning.jsonl")]))
  model = (POWERED_RUNS * run_s + POWERED_WARMUPS * WARMUP_S) / 2
  scale = POWERED_WALL_S / model
  cells, arms = len(grid.cells), len(grid.arms)
  tune = cells * arms * len(grid.rates) * len(grid.tune_seeds)
  confirm = cells * arms * n_seeds
  lines = [f"Per run {run_s:.1f} s (mean `wall_s` of the powered study's "
           f"{POWERED_RUNS} runs), per warm-up {WARMUP_S:.0f} s; the powered "
           f"study's {POWERED_RUNS} runs and {POWERED_WARMUPS} warm-ups on 2 "
           f"slots model to {model / 60:.0f} min against the {POWERED_WALL_S / 60:.0f} "
           f"measured, so every figure below is scaled by {scale:.2f}.", "",
           f"Grid: {cells} cells x {arms} arms; tuning {tune} runs on "
           f"{len(grid.tune_seeds)} seeds ({len(grid.rates)} rates); confirmation "
           f"{confirm} runs on {n_seeds} seeds, plus up to {confirm} more if arms "
           f"choose another rate than `{grid.common_rate_arm}` (the `common` "
           "setting; none in the powered study, where every rule chose one rate).", "",
           "| slots (cores, one run each) | tune | confirm | confirm, every arm "
           "also at the common rate | total |", "|---:|---:|---:|---:|---:|"]
  for p in SLOTS:
    t = stage_wall(tune, len(grid.tune_seeds), p, run_s, scale)
    c = stage_wall(confirm, n_seeds, p, run_s, scale)
    c2 = stage_wall(2 * confirm, n_seeds, p, run_s, scale)
    lines.append(f"| {p} | {_time(t)} | {_time(c)} | {_time(c2)} | "
                 f"{_time(t + c)} to {_time(t + c2)} |")
  return lines


def main():
  grid = spec_lib.load(GRID)
  powered = spec_lib.load(POWERED / "spec.py")
  rows = powered_rows()
  lines, n = seeds(grid, powered, rows)
  print("\n".join(lines))
  print()
  print("\n".join(wall(grid, rows, n)))
  if n != len(grid.confirm_seeds):
    print(f"\nspec.py has {len(grid.confirm_seeds)} confirmation seeds; "
          f"this says {n}")


if __name__ == "__main__":
  main()
