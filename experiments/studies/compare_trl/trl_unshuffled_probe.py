"""Probe: does TRL's shuffling of its mini-batch rows explain its small accuracy lead over ba_jax?

    python -m experiments.studies.compare_trl.trl_unshuffled_probe --workdir=/tmp/unshuffled \\
        --out=experiments/studies/compare_trl/results/trl_unshuffled_probe.md

Across the compare_trl results TRL's held-out accuracy after RL sits slightly
above ba_jax's in most loss-by-seed cells. One known difference between the
two is the mini-batch composition: TRL shuffles its generation batch's rows
(`shuffle_sequence_dict`) before splitting it into updates, so a group's rows
fall in different updates; ba_jax splits the rows in order, whole groups per
mini-batch. Protocol, fixed before running: on compare_trl's part-1 job
(configs/tiny.py, the same warmed-up start policy, the same settings via
`--set`), for each loss type and seed run ba_jax, TRL as it is, and TRL with
`shuffle_sequence_dict` replaced by the identity (rows in order, as ours), one
after the other; one evaluator for all three. If the shuffle explains the
lead, unshuffled TRL's mean should fall to ba_jax's. Power: with 3 seeds and
per-run spreads of 0.03-0.05 only shifts of about 0.05 or more are resolved,
so this is a probe that can point somewhere, not a result that settles it.
"""
from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import statistics

from experiments.studies.compare_trl.compare_trl import LOSS_TYPES
from experiments.studies.compare_trl.compare_trl_runs import (Evaluator, cell_config, load_config, pick_torch_threads, run_ours,
                              run_trl, warm_up)


def _run_trl(config, workdir, start_dir, evaluator, shuffle: bool) -> dict:
  import trl.trainer.grpo_trainer as grpo_module
  original = grpo_module.shuffle_sequence_dict
  if not shuffle:
    grpo_module.shuffle_sequence_dict = lambda batch: batch
  try:
    return run_trl(config, workdir, start_dir=start_dir, evaluator=evaluator, eval_every=0)
  finally:
    grpo_module.shuffle_sequence_dict = original


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default="configs/tiny.py")
  parser.add_argument("--set", action="append", default=[])
  parser.add_argument("--seeds", default="0,1,2")
  parser.add_argument("--losses", default="dr_grpo,token")
  parser.add_argument("--workdir", default="/tmp/trl_unshuffled")
  parser.add_argument("--out", default="experiments/studies/compare_trl/results/trl_unshuffled_probe.md")
  args = parser.parse_args()
  base = load_config(args.config, args.set)
  work = pathlib.Path(args.workdir)
  warm = warm_up(base, work / "warm", print)
  threads = pick_torch_threads(warm["dir"], 0)
  rows = []
  for loss in args.losses.split(","):
    for seed in [int(s) for s in args.seeds.split(",")]:
      config = cell_config(base, seed=seed, loss=loss, steps=base.rl.steps, init_from=warm["dir"],
                           eval_every=0)
      evaluator = Evaluator(config)
      runs = {"ba_jax": run_ours(config, work / f"ours_{loss}_{seed}", evaluate=True),
              "trl": _run_trl(config, work / f"trl_{loss}_{seed}", warm["dir"], evaluator, True),
              "trl unshuffled": _run_trl(config, work / f"trl_u_{loss}_{seed}", warm["dir"], evaluator,
                                         False)}
      acc = {name: evaluator(run["final_dir"]) for name, run in runs.items()}
      rows.append(dict(loss=loss, seed=seed, **{
          name: dict(sampled=a["heldout_acc_sampled"], greedy=a["heldout_acc_greedy"],
                     final_reward=statistics.mean(s["reward"] for s in runs[name]["steps"][-5:]))
          for name, a in acc.items()}))
      print(json.dumps(rows[-1]), flush=True)
  names = ("ba_jax", "trl", "trl unshuffled")
  lines = ["# Probe: TRL with and without its mini-batch shuffle, beside ba_jax", "",
           f"Written by `python -m experiments.studies.compare_trl.trl_unshuffled_probe --workdir={args.workdir} "
           f"--out={args.out}" + "".join(f" --set={s}" for s in args.set) + "` on "
           f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; TRL torch threads "
           f"{threads['threads']}. Protocol and power: the script's docstring (fixed before the run).",
           "", "Held-out accuracy after RL (sampled, greedy) and the final training reward (mean of "
           "the last 5 steps), one evaluator for all:", "",
           "| loss (TRL name) | seed | " + " | ".join(f"{n}: sampled / greedy / reward" for n in names)
           + " |", "|---|---|" + "---|" * len(names)]
  for r in rows:
    lines.append(f"| {r['loss']} ({LOSS_TYPES[r['loss']]}) | {r['seed']} | " + " | ".join(
        f"{r[n]['sampled']:.3f} / {r[n]['greedy']:.3f} / {r[n]['final_reward']:.3f}" for n in names)
        + " |")
  for loss in args.losses.split(","):
    sel = [r for r in rows if r["loss"] == loss]
    lines.append(f"| {loss} mean +- sd | | " + " | ".join(
        f"{statistics.mean(r[n]['sampled'] for r in sel):.3f} +- "
        f"{statistics.stdev(r[n]['sampled'] for r in sel):.3f} / "
        f"{statistics.mean(r[n]['greedy'] for r in sel):.3f} / "
        f"{statistics.mean(r[n]['final_reward'] for r in sel):.3f}" for n in names) + " |")
  text = "\n".join(lines) + "\n"
  out = pathlib.Path(args.out)
  out.write_text(text)
  out.with_suffix(".json").write_text(json.dumps(rows, indent=1))
  print(text)


if __name__ == "__main__":
  main()
