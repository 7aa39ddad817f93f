"""SmolLM2-135M-Instruct on reasoning-gym: the difficulty probe and the RL
run's report (configs/smollm2_reasoning_gym.py).

    # 1. Before any RL run: the untrained model's held-out pass rate at a few
    #    difficulties (the config uses one whose rate lies in 0.1-0.6).
    python -m experiments.studies.smollm2_reasoning_gym.smollm2_reasoning_gym --stage=probe
    # 2. The run itself (python -m ba_jax.train ... --workdir=W), then:
    python -m experiments.studies.smollm2_reasoning_gym.smollm2_reasoning_gym --stage=report --workdir=W
    # For the aggregation pilot: prompts that leave the response's length to
    # the model, and how much it varies within a group.
    python -m experiments.studies.smollm2_reasoning_gym.smollm2_reasoning_gym --stage=length_probe

The report reads the run's per-problem held-out results (W/heldout/
step_0.json and step_<last>.json, written by the trainer on the same
problems and keys) and gives the gain in greedy and sampled accuracy with a
95% paired bootstrap interval over problems (10,000 resamples; a problem's
sampled accuracy is the mean of its samples, so samples of one problem are
not counted as independent), and the curves (training reward, response
length, format failures, held-out accuracy) as a PNG.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import runpy
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[3]
CONFIG = ROOT / "configs" / "smollm2_reasoning_gym.py"
RESULTS = ROOT / "experiments" / "studies" / "smollm2_reasoning_gym" / "results"
# (label, basic_arithmetic settings) tried by the probe, easiest first.
CANDIDATES = (
    ("2 terms, 1 digit, + -", dict(min_digits=1, max_digits=1)),
    ("2 terms, 1-2 digits, + -", dict(min_digits=1, max_digits=2)),
)

# (label, dataset, its settings over the config's, instruction, response
# budget) tried by the length probe: the RL config's prompt first, then
# prompts that let the model choose how much to write.
LENGTH_CANDIDATES = (
    ("the RL config's prompt", "basic_arithmetic", {},
     "Give the final number only.", 32),
    ("explain, then the number", "basic_arithmetic", {},
     "Explain briefly, then give the final number.", 96),
    ("show the work, 3 terms", "basic_arithmetic", dict(min_terms=3, max_terms=3),
     "Show your work, then give the final number.", 96),
    ("chain_sum, 3 one-digit terms", "chain_sum",
     dict(min_terms=3, max_terms=3, min_digits=1, max_digits=1),
     "Show your work, then give the final number.", 96),
)


def load_config(arg=None):
  return runpy.run_path(str(CONFIG))["get_config"](arg)


def paired_interval(before_P, after_P, *, resamples=10_000, seed=0):
  """Mean of after - before over problems and its 95% bootstrap interval."""
  diff = np.asarray(after_P, float) - np.asarray(before_P, float)
  rng = np.random.default_rng(seed)
  idx = rng.integers(0, len(diff), (resamples, len(diff)))
  means = diff[idx].mean(1)
  lo, hi = np.percentile(means, [2.5, 97.5])
  return float(diff.mean()), float(lo), float(hi)


def probe(output: pathlib.Path, num_problems: int) -> None:
  """The base model's held-out accuracy (greedy, and the config's eval
  samples) for each of CANDIDATES, written as a markdown table."""
  import jax
  from ba_jax.run import setup as setup_lib
  from ba_jax.run import trainer
  rows = []
  for label, settings in CANDIDATES:
    c = load_config()
    c.task.dataset_config.basic_arithmetic.update(settings)
    c.eval.num_problems = num_problems
    setup = setup_lib.make_setup(c)
    params = setup_lib.init_params(setup)
    t0 = time.perf_counter()
    tables = trainer.evaluate_correct(setup, params, jax.random.key(0))
    rows.append((label, settings, float(tables["greedy"].mean()),
                 float(tables["sampled"].mean()),
                 time.perf_counter() - t0))
    _write_probe(output, rows, c, num_problems)  # each candidate as it ends
  print(f"wrote {output}")


def length_probe(output: pathlib.Path, num_prompts: int, group_size: int, *,
                 init_from: str = "", variant=None, prompt_len: int = 0,
                 candidates=LENGTH_CANDIDATES) -> list[dict]:
  """One step's rollout of the untrained model (``num_prompts`` training
  prompts x ``group_size`` samples at the config's temperature) per
  candidate: its pass rate, how often groups are mixed, and the
  within-group length statistics the aggregation rules turn on
  (``metrics.rollout_stats``). ``init_from``/``variant``: another
  checkpoint or config variant (tests: ``runlocal`` on a tiny model);
  ``prompt_len``: another ``task.max_prompt_len``."""
  import jax
  from flax import nnx
  from ba_jax.run import metrics as metrics_lib
  from ba_jax.run import rollout
  from ba_jax.run import setup as setup_lib
  rows = []
  for label, dataset, settings, instruction, budget in candidates:
    c = load_config(variant)
    c.init_from = init_from or c.init_from
    base = (c.task.dataset_config[dataset].to_dict()
            if dataset in c.task.dataset_config else {})
    c.task.datasets = dataset
    c.task.dataset_config = {dataset: {**base, **settings}}
    c.task.instruction = instruction
    c.task.max_prompt_len = prompt_len or c.task.max_prompt_len
    c.rl.update(max_new_tokens=budget, prompts_per_step=num_prompts,
                group_size=group_size)
    setup = setup_lib.make_setup(c)
    model = nnx.merge(setup.graphdef, setup_lib.init_params(setup))
    t0 = time.perf_counter()
    ro = rollout.collect(model, setup.task, position=0, key=jax.random.key(0),
                         rl=setup.rollout_cfg, mesh=setup.mesh, rules=setup.rules)
    stats = metrics_lib.rollout_stats(ro.rewards, ro.correct, ro.advantages,
                                      ro.sample_mask, ro.truncated, group_size)
    rows.append(dict(label=label, dataset=dataset,
                     settings=c.task.dataset_config[dataset].to_dict(),
                     instruction=instruction, budget=budget,
                     seconds=time.perf_counter() - t0, **stats))
    _write_length_probe(output, rows, c, num_prompts, group_size)
  print(f"wrote {output}")
  return rows


def _write_length_probe(output, rows, c, num_prompts, group_size) -> None:
  f = lambda x, spec=".2f": "n/a" if x != x else format(x, spec)
  lines = [
      "# SmolLM2-135M-Instruct on reasoning-gym: response-length probe "
      "(before RL)", "",
      "`python -m experiments.studies.smollm2_reasoning_gym.smollm2_reasoning_gym --stage=length_probe`: "
      f"the untrained model, one rollout of {num_prompts} training prompts x "
      f"{group_size} samples at T={c.rl.temperature} per candidate, the "
      "config's chat template and answer rule "
      f"({c.task.answer_rule!r}); reward is the dataset's own score. Length "
      "CV: within-group std/mean, averaged over groups; gap: (mean length of "
      "the positive-advantage responses - the negative ones) / their "
      "average, inside each mixed group, averaged over them.", "",
      "| candidate | dataset, settings | instruction | budget | pass rate "
      "| mixed groups | length mean | length CV in group | gap in group "
      "(rel) | truncated | seconds |",
      "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
  for r in rows:
    lines.append(
        f"| {r['label']} | {r['dataset']} `{r['settings']}` | {r['instruction']} "
        f"| {r['budget']} | {f(r['accuracy'])} | {f(r['groups_mixed_frac'])} "
        f"| {f(r['length_mean'], '.1f')} | {f(r['length_cv_in_group'])} "
        f"| {f(r['length_gap_in_group_rel'], '+.2f')} | {f(r['truncated_frac'])} "
        f"| {r['seconds']:.0f} |")
  lines += ["", "Seconds: the rollout (sampling and grading, compilation "
            "included) on this host under its load at the time."]
  output.write_text("\n".join(lines) + "\n")


def _write_probe(output, rows, c, num_problems) -> None:
  lines = [
      "# SmolLM2-135M-Instruct on reasoning-gym basic_arithmetic: difficulty "
      "probe (before RL)", "",
      "`python -m experiments.studies.smollm2_reasoning_gym.smollm2_reasoning_gym --stage=probe`: the "
      "untrained model, the config's prompt (chat template, instruction "
      f"{c.task.instruction!r}) and answer rule ({c.task.answer_rule!r}), "
      f"{num_problems} held-out problems (heldout_seed={c.task.heldout_seed}),"
      f" max_new_tokens={c.rl.max_new_tokens}; greedy, and "
      f"{c.eval.samples_per_problem} samples per problem at "
      f"T={c.eval.temperature}. Every candidate has 2 terms and the operators "
      "+ and -, no parentheses or negation.", "",
      "| difficulty | settings | greedy | sampled | eval seconds |",
      "|---|---|---|---|---|"]
  lines += [f"| {label} | `{s}` | {g:.3f} | {sm:.3f} | {t:.0f} |"
            for label, s, g, sm, t in rows]
  lines += ["", "The config takes the difficulty whose two rates lie in "
            "0.1-0.6 (mixed groups). Eval seconds include compilation and "
            "depend on the host and its load."]
  output.write_text("\n".join(lines) + "\n")


def report(workdir: pathlib.Path, output: pathlib.Path, png: pathlib.Path,
           title: str) -> None:
  import json
  from ba_jax.run import metrics
  from ba_jax.run import trainer
  heldout = workdir / trainer.HELDOUT_DIR
  steps = sorted(int(p.stem.split("_")[1])
                 for p in heldout.glob("step_*.json"))
  first, last = steps[0], steps[-1]
  load = lambda s: json.loads((heldout / f"step_{s}.json").read_text())
  before, after = load(first), load(last)
  train = [dict(r, step=s) for s, r in
           sorted(metrics.read_metrics(str(workdir)).items())
           if "reward_mean" in r]
  lines = [f"# {title}", "",
           f"Run: `{workdir}`, steps {first} -> {last}. Held-out problems: "
           f"{len(before['greedy'])}, the same problems and sampling keys "
           "before and after. Interval: 95% paired bootstrap over problems "
           "(10,000 resamples).", "",
           "| held-out accuracy | before RL | after RL | gain | 95% interval |",
           "|---|---|---|---|---|"]
  for name in ("greedy", "sampled"):
    b = np.asarray(before[name], float).mean(1)
    a = np.asarray(after[name], float).mean(1)
    gain, lo, hi = paired_interval(b, a)
    lines.append(f"| {name} | {b.mean():.3f} | {a.mean():.3f} | "
                 f"{gain:+.3f} | [{lo:+.3f}, {hi:+.3f}] |")
  seconds = sum(r.get("time_step", 0.0) for r in train)
  lines += ["", f"RL steps: {len(train)}, their summed step time "
            f"{seconds / 60:.1f} min (sampling, rewards and updates; not the "
            "held-out evaluations or compilation).", "",
            "| step | reward | accuracy | length | format failures | "
            "mixed groups |", "|---|---|---|---|---|---|"]
  for r in train:
    lines.append(f"| {r['step']} | {r['reward_mean']:.3f} | "
                 f"{r['accuracy']:.3f} | {r['length_mean']:.1f} | "
                 f"{r.get('format_fail_frac', float('nan')):.3f} | "
                 f"{r['groups_mixed_frac']:.2f} |")
  output.write_text("\n".join(lines) + "\n")
  print("\n".join(lines))

  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
  x = [r["step"] for r in train]
  axes[0].plot(x, [r["reward_mean"] for r in train], label="reward")
  axes[0].plot(x, [r.get("format_fail_frac", np.nan) for r in train],
               label="format failures")
  axes[0].set(title="training batch", xlabel="RL step")
  axes[0].legend()
  axes[1].plot(x, [r["length_mean"] for r in train])
  axes[1].set(title="response length (tokens)", xlabel="RL step")
  evals = [(s, load(s)) for s in steps]
  for name in ("greedy", "sampled"):
    axes[2].plot([s for s, _ in evals],
                 [np.mean(t[name]) for _, t in evals], "o-", label=name)
  axes[2].set(title="held-out accuracy", xlabel="RL step")
  axes[2].legend()
  fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(png, dpi=100)
  print(f"wrote {output} and {png}")


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--stage", choices=("probe", "length_probe", "report"),
                 required=True)
  p.add_argument("--num_prompts", type=int, default=16,
                 help="length_probe: prompts per candidate")
  p.add_argument("--group_size", type=int, default=8,
                 help="length_probe: samples per prompt")
  p.add_argument("--init_from", default="",
                 help="length_probe: another checkpoint than the config's")
  p.add_argument("--workdir", help="the RL run's workdir (report)")
  p.add_argument("--num_problems", type=int, default=200)
  p.add_argument("--output", default=None)
  p.add_argument("--png", default=str(RESULTS / "smollm2_reasoning_gym.png"))
  p.add_argument("--title", default="SmolLM2-135M-Instruct, GRPO (balanced) "
                 "on reasoning-gym basic_arithmetic")
  args = p.parse_args(argv)
  if args.stage == "probe":
    probe(pathlib.Path(args.output or RESULTS / "smollm2_probe.md"),
          args.num_problems)
  elif args.stage == "length_probe":
    length_probe(pathlib.Path(args.output or RESULTS / "smollm2_length_probe.md"),
                 args.num_prompts, args.group_size, init_from=args.init_from)
  else:
    if not args.workdir:
      sys.exit("--stage=report needs --workdir (the RL run's)")
    report(pathlib.Path(args.workdir),
           pathlib.Path(args.output or RESULTS / "smollm2_reasoning_gym.md"),
           pathlib.Path(args.png), args.title)


if __name__ == "__main__":
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  main()
