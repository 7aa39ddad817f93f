"""The results file and the curves of experiments/studies/compare_trl/compare_trl.py, written
from its raw results (the .json next to the markdown)."""
import math
import pathlib
import statistics

from scipy import stats

from ba_jax.ablation import stats as ablation_stats
from experiments.studies.compare_trl import compare_trl_hardware as hardware
from experiments.studies.compare_trl.compare_trl_runs import LOSS_TYPES


UNMATCHED = [
    ("Mini-batch composition",
     "the step's rows split in order into `num_minibatches` mini-batches of "
     "whole groups",
     "the generation batch's rows shuffled (`shuffle_sequence_dict`), then "
     "split into `steps_per_generation` equal slices, so a group's rows fall "
     "in different updates",
     "TRL shuffles its buffered generation batch unconditionally (no option)"),
    ("`token` / `dapo` normaliser",
     "each mini-batch's token sum / that mini-batch's token count",
     "each update's token sum / (generation batch's tokens x "
     "gradient_accumulation_steps / steps_per_generation): the average "
     "mini-batch's count",
     "TRL's definition of `dapo` (`num_items_in_batch`); equal on average, it "
     "differs per update by the halves' token-count imbalance (`grpo` and "
     "`dr_grpo` normalise per update as ours does)"),
    ("Old (behaviour) log-probs",
     "the sampler's (`rl.old_logp=sampler`, the config's)",
     "recomputed by one forward pass over the generation batch before the "
     "updates (TRL does so whenever steps_per_generation > "
     "gradient_accumulation_steps)",
     "TRL's generate returns no log-probs; the values agree to float rounding "
     "(~1e-5, tests/test_trl_parity.py); TRL's extra forward is in its "
     "'other' time"),
    ("Advantage epsilon",
     "(R - mean) / (std + 1e-6)", "(R - mean) / (std + 1e-4)",
     "fixed in each code base; with binary rewards a mixed group of 8 has "
     "std >= 0.35, so advantages differ by < 3e-4 relative"),
    ("Random streams",
     "JAX threefry keys from `seed` (sampling: inverse-CDF draw)",
     "torch's generator from `seed` (multinomial)",
     "different frameworks: a seed is matched by its number only, the "
     "responses differ; hence several seeds"),
    ("Padding and positions",
     "static shapes: prompts left-padded to `task.max_prompt_len` in "
     "sampling, and in the update to the batch's longest rounded up to a "
     "multiple of `rl.prompt_pad_multiple` when that is set (each part's "
     "padding line says how it ran); responses to the budget "
     "`rl.max_new_tokens`; positions counted from the first real token",
     "eager: prompts left-padded to the batch's longest, completions to the "
     "batch's longest; its scorer passes no position ids, so positions "
     "count from the first pad",
     "XLA compiles one program per shape, so ours computes on more padding "
     "tokens (part of its update time; `rl.prompt_pad_multiple` trims the "
     "prompts' share at one program per width met); RoPE depends on relative "
     "positions only, so the positions differ by rounding only"),
    ("CPU threads",
     "XLA's default (one thread per schedulable CPU) or as `XLA_FLAGS` says, "
     "recorded per run and phase",
     "torch intra-op threads: each TRL run timed at 1 and at every "
     "schedulable CPU, the faster whole run taken (`--torch_threads=N`: N "
     "only), recorded per run and phase",
     "the same CPUs for both; the threads line of each part says whether the "
     "counts used differed (files before per-run records: TRL's count came "
     "from a `generate` probe and held for its update too)"),
    ("What a step's time includes",
     "`time_step`: prompts, sampling, rewards, advantages, update (the "
     "trainer's own fields); the first step includes XLA compilation; "
     "decoding responses to text is in scoring (`time_rewards`)",
     "from the previous RL step's end: the Trainer's data loading and "
     "bookkeeping, generation (decoding to text included), rewards, the "
     "old log-probs' forward pass and advantages (in other), updates",
     "each trainer's natural step boundary; the whole-run time below covers "
     "everything either way"),
    ("What the whole run includes",
     "`trainer.run`: config checks, mesh, loading the start policy, orbax "
     "checkpoints at step 0 and at the end, XLA compilation, the RL steps",
     "`GRPOTrainer(...)` (loading the start policy, Trainer setup) and "
     "`train()`; no checkpoints (`save_strategy=\"no\"`)",
     "both from a Hugging Face directory to trained weights in memory; "
     "imports and every held-out evaluation excluded (timed and subtracted)"),
]


def _padding_line(st: dict) -> str:
  """How ba_jax padded the update's prompts in a part (``rl.prompt_pad_multiple``)
  and whether it computed them once per group (``rl.share_prompt``)."""
  k = st.get("prompt_pad_multiple", 0)
  if not k:
    line = ("ba_jax's update: prompts padded to `task.max_prompt_len` "
            "(`rl.prompt_pad_multiple=0`).")
  else:
    line = (f"ba_jax's update: prompts padded to the batch's longest rounded up to a "
            f"multiple of {k} (`rl.prompt_pad_multiple={k}`; TRL pads to the batch's "
            "longest), responses to the budget.")
  if st.get("share_prompt"):
    line += (" Each group's prompt computed once in the update's forward and backward "
             "pass, packed with the group's responses (`rl.share_prompt=true`; the same "
             "sums, tests/test_shared_prompt.py); TRL runs every row's prompt.")
  return line


NOTES_MARKER = "<!-- hand-written notes below; kept when the script rewrites this file -->"


def _mean(xs):
  xs = [x for x in xs if x is not None]
  return sum(xs) / len(xs) if xs else float("nan")


def _sd(xs):
  return statistics.stdev(xs) if len(xs) > 1 else float("nan")


def _steady(steps, key):
  """Mean of ``key`` over the RL steps after the first (which compiles)."""
  rest = steps[1:] or steps
  return _mean([s[key] for s in rest])


def _split_table(runs_by_name: dict[str, list[dict]]) -> list[str]:
  """Per-step time split (mean of steps 2..N over the given runs)."""
  lines = ["| trainer | generation | scoring | update | other | step "
           "(steps 2..N) | first step |", "|---|---|---|---|---|---|---|"]
  for name, runs in runs_by_name.items():
    cols = [_mean([_steady(r["steps"], k) for r in runs])
            for k in ("generation", "scoring", "update", "other", "total")]
    first = _mean([r["steps"][0]["total"] for r in runs if r["steps"]])
    lines.append(f"| {name} | " + " | ".join(f"{c:.3f}" for c in cols)
                 + f" | {first:.2f} |")
  return lines


def report_train(part: dict) -> list[str]:
  cells = part["cells"]
  losses, seeds = part["losses"], part["seeds"]
  st = part["settings"]
  out = [f"## Part 1: train for train on `{part['config']}`", ""]
  out += [f"Start policy: the config's warm-up, exported with its tokenizer "
          f"to a Hugging Face directory ({part['warm']['seconds']:.0f} s). "
          f"RL: {part['steps']} steps of {st['prompts_per_step']} prompts x "
          f"{st['group_size']}, {st['max_new_tokens']} new tokens, "
          f"T={st['temperature']}, AdamW lr {st['learning_rate']:g} "
          f"({st['warmup_steps']}-update linear warm-up, {st['schedule']}), "
          f"clip {st['eps_low']}/{st['eps_high']}, {st['num_minibatches']} "
          f"mini-batches per step, beta 0. Held-out: "
          f"{st['heldout']} problems, sampled (T={st['eval_temperature']}, "
          f"{st['samples_per_problem']} each) and greedy."]
  out += ["", _padding_line(st), ""] + hardware.thread_lines(part) + [
      "", hardware.cache_line(part)]
  if part["steps"] != part["default_steps"]:
    out += ["", f"**Reduced:** {part['steps']} RL steps for both trainers "
            f"instead of the config's {part['default_steps']}."]
  if part.get("note"):
    out += ["", part["note"]]
  # --- time
  warm = part.get("warm_cache")
  first_does = "loads from the cache" if warm else "compiles"
  out += ["", "### Time", "",
          "Per RL step (seconds; mean over the steps after the first and "
          f"over every run of the loss type; ba_jax's first step {first_does}):", ""]
  for loss in losses:
    runs = {name: [cells[f"{loss}/{s}"]["runs"][name] for s in seeds
                   if f"{loss}/{s}" in cells] for name in ("ba_jax", "trl")}
    out += [f"`{loss}` (TRL `{LOSS_TYPES[loss]}`):", ""] + _split_table(runs)
    out += [""]
  out += ["Whole RL run per run pair (seconds; TRL / ba_jax is the ratio; "
          "runs of a pair ran one after the other in this process):", "",
          "| loss | seed | ran first | ba_jax whole run | TRL whole run | "
          f"ratio | ba_jax first step ({first_does}) | ba_jax steps 2..N, per step "
          "| TRL steps 2..N, per step | ratio |",
          "|---|---|---|---|---|---|---|---|---|---|"]
  steady = {"ba_jax": [], "trl": []}
  ratios, tot = [], {"ba_jax": 0.0, "trl": 0.0}
  for loss in losses:
    for s in seeds:
      c = cells.get(f"{loss}/{s}")
      if not c:
        continue
      o, t = c["runs"]["ba_jax"], c["runs"]["trl"]
      ratios.append(t["run_seconds"] / o["run_seconds"])
      tot["ba_jax"] += o["run_seconds"]
      tot["trl"] += t["run_seconds"]
      so, s_t = _steady(o["steps"], "total"), _steady(t["steps"], "total")
      steady["ba_jax"].append(so)
      steady["trl"].append(s_t)
      out.append(f"| {loss} | {s} | {c['order'][0]} | {o['run_seconds']:.1f} "
                 f"| {t['run_seconds']:.1f} | "
                 f"**{t['run_seconds'] / o['run_seconds']:.2f}x** | "
                 f"{o['steps'][0]['total']:.1f} | {so:.3f} | {s_t:.3f} | "
                 f"{s_t / so:.2f}x |")
  if ratios:
    overall = tot["trl"] / tot["ba_jax"]
    verdict = "met" if min(ratios) >= 2 else "NOT met"
    out += ["", f"All runs: ba_jax {tot['ba_jax']:.0f} s, TRL "
            f"{tot['trl']:.0f} s: **{overall:.2f}x**.{hardware.floor_note(part)} Per pair "
            f"{min(ratios):.3f}x to {max(ratios):.3f}x. "
            + ("The every-pair rule (2x in each pair; the criterion of runs "
               "before the speed test) is " if part.get("speed_ratio") else
               "The 2x requirement (every pair) is ")
            + f"**{verdict}**. Steps after the first: ba_jax "
            f"{_mean(steady['ba_jax']):.3f} s, TRL {_mean(steady['trl']):.3f} "
            f"s per step ({_mean(steady['trl']) / _mean(steady['ba_jax']):.2f}"
            f"x); ba_jax's first step ("
            + ("tracing and lowering the sampler and the train step, their "
               "executables loaded from the persistent cache" if warm else
               "XLA compilation of the sampler and the train step")
            + ") averaged "
            f"{_mean([cells[k]['runs']['ba_jax']['steps'][0]['total'] for k in cells]):.1f}"
            f" s, TRL's {_mean([cells[k]['runs']['trl']['steps'][0]['total'] for k in cells]):.2f} s."]
    if part.get("speed_ratio"):
      out += ["", speed_verdict(ratios, part["speed_ratio"]) + hardware.floor_note(part)]
    first = _mean([cells[k]["runs"]["ba_jax"]["steps"][0]["total"]
                   for k in cells])
    out += ["", f"Bound: TRL's whole run averaged "
            f"{tot['trl'] / len(ratios):.1f} s; ba_jax's first step alone "
            f"{first:.1f} s, so even with free steps after it ba_jax's "
            f"whole run could be at most "
            f"{tot['trl'] / len(ratios) / first:.2f}x faster than TRL's on "
            f"this job ({part['steps']} steps) and host."]
  # --- accuracy
  out += ["", "### Held-out accuracy after RL and training reward", "",
          "Same evaluator for both (`ba_jax.run.trainer.evaluate` on the exported "
          "final weights, same problems and PRNG key per seed). Final "
          "training reward: mean of the last 5 RL steps' batch reward.", "",
          "| loss | trainer | seed | sampled | greedy | final train reward "
          "|", "|---|---|---|---|---|---|"]
  verdicts, margin = [], part.get("margin", 0.0)
  for loss in losses:
    per = {}
    for name in ("ba_jax", "trl"):
      rows = []
      for s in seeds:
        c = cells.get(f"{loss}/{s}")
        if not c:
          continue
        acc = c["final"][name]
        reward = _mean([x["reward"] for x in c["runs"][name]["steps"][-5:]])
        rows.append((s, acc["heldout_acc_sampled"], acc["heldout_acc_greedy"],
                     reward))
        out.append(f"| {loss} | {name} | {s} | {rows[-1][1]:.3f} | "
                   f"{rows[-1][2]:.3f} | {reward:.3f} |")
      per[name] = rows
      if rows:
        cols = list(zip(*rows))
        out.append(f"| {loss} | {name} | mean +- sd | "
                   f"**{_mean(cols[1]):.3f} +- {_sd(cols[1]):.3f}** | "
                   f"{_mean(cols[2]):.3f} +- {_sd(cols[2]):.3f} | "
                   f"{_mean(cols[3]):.3f} +- {_sd(cols[3]):.3f} |")
    if per.get("ba_jax") and per.get("trl"):
      verdicts.append(_accuracy_verdict(loss, per["ba_jax"], per["trl"], margin))
  before = [cells[k]["before"] for k in cells]
  if before:
    out += ["", "Before RL (the start policy, same evaluator): sampled "
            f"{_mean([b['heldout_acc_sampled'] for b in before]):.3f}, greedy "
            f"{_mean([b['heldout_acc_greedy'] for b in before]):.3f} (mean "
            "over the seeds' held-out sets)."]
  header = ("| loss | ours - TRL, sampled: mean [95% CI, paired by seed] | "
            "criterion (ours mean >= TRL mean - TRL sd) | ")
  if margin > 0:
    header += "non-inferiority, sampled (one-sided 95% lower bound) | "
  out += ["", header + "same for greedy |",
          "|---|---|---|" + ("---|" if margin > 0 else "") + "---|"] + verdicts
  own = [(k, cells[k]["runs"]["ba_jax"]["own_after_rl"], cells[k]["final"]
          ["ba_jax"]) for k in cells]
  same = all(abs(a.get("heldout_acc_sampled", -1) - b["heldout_acc_sampled"])
             < 1e-9 for _, a, b in own)
  out += ["", "Check: ba_jax's own end-of-run evaluation (in memory) equals "
          f"the shared evaluator's on its exported weights in every run: "
          f"{'yes' if same else 'NO'}."]
  return out


def _accuracy_verdict(loss, ours, theirs, margin: float = 0.0) -> str:
  """One row of the accuracy table: per column (sampled, greedy) the paired
  mean difference with its 95% t-interval, the spread criterion and, with a
  ``margin``, the non-inferiority test (one-sided, level 0.05)."""
  cells = []
  for col in (1, 2):
    o = [r[col] for r in ours]
    t = [r[col] for r in theirs]
    diffs = [a - b for a, b in zip(o, t)]
    paired = ablation_stats.paired_t(diffs)
    sd_t = _sd(t) if len(t) > 1 else 0.0
    ok = _mean(o) >= _mean(t) - sd_t
    text = (f"{paired['mean']:+.3f} [{paired['low']:+.3f}, {paired['high']:+.3f}]",
            f"{_mean(o):.3f} vs {_mean(t):.3f} - {sd_t:.3f}: "
            f"**{'met' if ok else 'NOT met'}**")
    if margin > 0:
      test = ablation_stats.noninferiority(diffs, margin)
      shown = test["low"] > -margin
      text += (f"lower bound {test['low']:+.3f} vs -{margin:g} (p = "
               f"{test['p']:.3f}): **{'shown' if shown else 'NOT shown'}**",)
    cells.append(text)
  row = f"| {loss} | {cells[0][0]} | {cells[0][1]} | "
  if margin > 0:
    row += f"{cells[0][2]} | "
  return row + "; ".join(cells[1]) + " |"


def noninferiority_plan(margin: float, seeds: int, plan_sd: float) -> str:
  """The protocol's bullet for a pre-stated non-inferiority margin, with
  the test's power at ``plan_sd`` (the paired differences' SD expected)."""
  line = ("- **Non-inferiority** (stated before the runs, `--margin="
          f"{margin:g}`): for each loss type, sampled accuracy primary, ba_jax is "
          f"shown non-inferior to TRL when the one-sided 95% lower bound of the "
          f"mean paired difference (ours - TRL) over the {seeds} seeds is above "
          f"-{margin:g} (a paired t-test of H0: mean <= -{margin:g}). The "
          "claim for all loss types needs every one to pass (an "
          "intersection-union test: no multiplicity adjustment). Greedy "
          "accuracy is shown with the same test, secondary.")
  if plan_sd > 0 and seeds > 1:
    power = lambda true: ablation_stats.t_test_power(
        margin + true, seeds, plan_sd, two_sided=False)
    line += (f" Power at the planning SD of the paired differences, "
             f"{plan_sd:.3f} (`--plan_sd`): {power(0.0):.2f} when the two "
             f"trainers are equal, {power(-0.01):.2f} when ba_jax is 0.01 "
             "worse.")
  return line


def speed_verdict(ratios, floor: float) -> str:
  """The pre-stated speed test over the run pairs: the geometric mean of
  the whole-run ratios (TRL / ba_jax) and its one-sided 95% lower bound,
  from a t-test of H0 ``mean(log ratio) <= log(floor)``
  (``ablation_stats.mean_above``); shown when the bound is above ``floor``."""
  test = ablation_stats.mean_above([math.log(r) for r in ratios], math.log(floor))
  low = math.exp(test["low"])  # NaN (fewer than 2 pairs) stays NaN: not shown
  shown = low > floor
  return (f"Speed test (stated before the runs, `--speed_ratio={floor:g}`): "
          f"geometric mean of the {test['n']} pairs' whole-run ratios "
          f"**{math.exp(test['mean']):.3f}x**, one-sided 95% lower bound "
          f"**{low:.3f}x** (t-test of the log ratios, H0: at most {floor:g}x; "
          f"SD of the log ratios {test['sd']:.3f}, p = {test['p']:.2g}): ba_jax's "
          f"whole run at least {floor:g}x faster than TRL's is "
          f"**{'shown' if shown else 'NOT shown'}**.")


def speed_plan(floor: float, pairs: int, plan_sd: float) -> str:
  """The protocol's bullet for the pre-stated speed test, with its power at
  ``plan_sd`` (the SD of the per-pair log ratios expected)."""
  line = (f"- **Speed test** (stated before the runs, `--speed_ratio={floor:g}`): "
          f"ba_jax's whole run is shown at least {floor:g}x faster than TRL's "
          f"when the one-sided 95% lower bound of the geometric mean of the "
          f"{pairs} pairs' ratios (TRL / ba_jax) is above {floor:g}x: a t-test "
          f"of H0 mean(log ratio) <= log {floor:g} over the pairs, each pair "
          "one after the other in this process. Every pair's ratio is shown "
          "too (the every-pair rule, which a true ratio above the floor fails "
          "more often the more pairs are run).")
  if plan_sd > 0 and pairs > 1:
    power = lambda true: ablation_stats.t_test_power(
        math.log(true / floor), pairs, plan_sd, two_sided=False)
    line += (f" Power at the planning SD of the log ratios, {plan_sd:.3f} "
             f"(`--speed_plan_sd`): " + ", ".join(
                 f"{power(floor * k):.2f} when the true ratio is "
                 f"{floor * k:.2f}x" for k in (1.025, 1.05, 1.1)) + ".")
  return line


def report_real(part: dict) -> list[str]:
  o, t = part["runs"]["ba_jax"], part["runs"]["trl"]
  st = part["settings"]
  out = [f"## Part 2: the real model, first {part['steps']} steps of "
         f"`{part['config']}`", ""]
  if part.get("stand_in"):
    out += [f"**Stand-in:** {part['stand_in']}", ""]
  out += [f"Start policy `{part['init_from']}`; loss `{part['loss']}` (TRL "
          f"`{part['trl_loss']}`); {st['prompts_per_step']} prompts x "
          f"{st['group_size']}, {st['max_new_tokens']} new tokens, "
          f"{st['num_minibatches']} mini-batches per step; no held-out "
          "evaluation (timing only).", "", _padding_line(st), ""]
  if part.get("warm_cache"):
    out += ["With `--warm_cache`: ba_jax's run uses JAX's persistent compilation "
            "cache (`compilation_cache_dir`), filled by an untimed 1-step run "
            "before it, so its first step traces and lowers its programs and "
            "loads them from the cache, as a repeated run (a resume, another "
            "seed) does.", ""]
  out += hardware.thread_lines(part) + ["", hardware.cache_line(part), "",
          "| step | ba_jax (s) | TRL (s) | TRL / ba_jax |", "|---|---|---|---|"]
  for a, b in zip(o["steps"], t["steps"]):
    out.append(f"| {a['step']} | {a['total']:.2f} | {b['total']:.2f} | "
               f"{b['total'] / a['total']:.2f}x |")
  steady_o, steady_t = _steady(o["steps"], "total"), _steady(t["steps"], "total")
  out += [f"| steps 2..{len(o['steps'])} mean | {steady_o:.2f} | "
          f"{steady_t:.2f} | **{steady_t / steady_o:.2f}x** |",
          f"| whole run | {o['run_seconds']:.1f} | {t['run_seconds']:.1f} | "
          f"**{t['run_seconds'] / o['run_seconds']:.2f}x** |", "",
          hardware.floor_note(part).strip(), "",
          f"The 2x requirement is **"
          f"{'met' if t['run_seconds'] >= 2 * o['run_seconds'] else 'NOT met'}"
          f"** on the whole run and **"
          f"{'met' if steady_t >= 2 * steady_o else 'NOT met'}** on the "
          "steps after the first.", ""]
  out += _split_table({"ba_jax": [o], "trl": [t]})
  return out + [""]


def _load(host: dict) -> str:
  """The host's 1-minute load average at the part's start and end, as
  measured (runs before it was recorded ran on a host shared with other
  work, as their reports said)."""
  if "load_start" not in host:
    return "shared with other work"
  return (f"1-minute load average {host['load_start']:.1f} at the start and "
          f"{host['load_end']:.1f} at the end")


def protocol_record(train: dict) -> list[str]:
  """The committed protocol file and the commits of part 1's runs, when it
  ran under ``--protocol``."""
  record = train.get("protocol")
  if not record:
    return []
  commits = sorted({(c.get("protocol_commit", ""), c.get("code_commit", ""))
                    for c in train.get("cells", {}).values()})
  lines = [f"Criteria from `{record['file']}`, committed at "
           f"`{record['protocol_commit']}` and unchanged when the runs started; "
           "runs by protocol and code commit: " + "; ".join(
               f"`{p}` / `{c}`" for p, c in commits) + "."]
  dirty = sorted({x for c in train.get("cells", {}).values() for x in c.get("dirty", [])})
  if dirty:
    lines[0] += (f" **Dirty tree**: runs went with uncommitted changes to "
                 f"{', '.join(dirty)} (`--allow_dirty`).")
  return lines + [""]


def report(results: dict, path: pathlib.Path, png: pathlib.Path | None):
  lines = ["# ba_jax vs TRL's GRPOTrainer on the same job", ""]
  for name in ("train", "real"):
    if name not in results:
      continue
    meta = results[name]["meta"]
    host, g = meta["host"], meta["host"]["matmul_gflops"]
    lines += [
        f"Part {1 if name == 'train' else 2} written by `{meta['command']}` "
        f"({meta['date']}). Host: {host['cpu']}, {host['cores']} cores, "
        f"{_load(host)}; float32 "
        f"{g['n']}x{g['n']} matmul measured at the start: **{g['jax']:.0f} "
        f"GFLOP/s (JAX), {g['torch']:.0f} GFLOP/s (torch, "
        f"{g['torch_threads']} threads)**, each library's own floor (hosts of this "
        f"kind differ several-fold). Versions: {host['versions']}.", ""]
  train = results.get("train", {})
  lines += protocol_record(train)
  n_seeds = max(len(train.get("seeds", [])), 2)
  t975 = float(stats.t.ppf(0.975, n_seeds - 1))
  margin = train.get("margin", 0.0)
  plan = [noninferiority_plan(margin, len(train.get("seeds", [])),
                              train.get("plan_sd", 0.0))] if margin > 0 else []
  if train.get("speed_ratio"):
    plan.append(speed_plan(train["speed_ratio"], len(train.get("seeds", []))
                           * len(train.get("losses", [])),
                           train.get("speed_plan_sd", 0.0)))
  lines += [
      "## Protocol (fixed before the results)", "",
      "- **What is compared.** ba_jax (`ba_jax.run.trainer.run`) and TRL "
      "(`GRPOTrainer`) run GRPO from the same Hugging Face checkpoint, on the "
      "same prompts (our task's prompt ids; TRL's retokenisation of their "
      "text is asserted equal), with the same reward function (the task's "
      "`grade`), group size, prompts per step, response budget, temperature, "
      "learning rate and schedule, AdamW settings, gradient clipping, clip "
      "range, advantage scaling, beta = 0, mini-batches per step and number "
      "of steps. Loss types mapped: our `token` = TRL `dapo`, `sequence` = "
      "`grpo`, `dr_grpo` = `dr_grpo` (`balanced` has no TRL counterpart). "
      "Settings that could not be matched exactly are listed below.",
      "- **Seeds.** Each seed sets both trainers' sampling seeds and the "
      "task's prompt stream and held-out set (the same for both trainers at "
      "that seed); the two runs of a seed are paired.",
      "- **Held-out accuracy** of both final policies is measured by one "
      "evaluator: the exported weights loaded by `ba_jax.policy.hf.load_pretrained` "
      "and scored by `ba_jax.run.trainer.evaluate` with the same PRNG key "
      "(sampled at the config's eval temperature, and greedy). Curves: every "
      "`eval_every` RL steps, by the same function (ba_jax: the trainer's "
      "`eval.every`; TRL: a callback that saves and loads the weights).",
      "- **Accuracy criterion** (per loss type, sampled accuracy primary, "
      "greedy also shown): *within the seeds' spread of TRL's (or better)* "
      "means ba_jax's mean over seeds >= TRL's mean minus TRL's standard "
      "deviation over seeds (sample SD). The paired mean difference and its "
      "95% t-interval over seeds are shown too.",
      "- **Power.** One sampled accuracy on 128 problems x 4 samples has a "
      "binomial standard error of about 0.02 near 0.5 (greedy, 128 "
      "responses: about 0.045), before the spread between RL runs; with "
      f"{n_seeds} seeds the paired interval's half-width is "
      f"{t975:.2f} x SD(diff) / sqrt({n_seeds}). The spread criterion "
      "checks that ba_jax is not clearly worse; it cannot show that the two "
      "train equally well"
      + (" (the non-inferiority test below bounds how much worse ba_jax "
         "can be)." if margin > 0 else "."),
  ] + plan + [
      "- **Time criterion.** ba_jax's whole RL run at least 2x faster than "
      + ("TRL's, by the speed test above (each pair one after the other in "
         "this process, alternating which goes first); the every-pair rule "
         "of earlier runs is reported beside it. " if train.get("speed_ratio")
         else "TRL's, for every pair of runs (each pair one after the other "
         "in this process, alternating which goes first). ")
      + "Whole run: from the start "
      "checkpoint to trained weights, compilation included, imports and "
      "held-out evaluations excluded. The JAX caches are cleared before "
      "each ba_jax run, so each one compiles as a fresh process would."
      + (" **Part 1 here (`--warm_cache`):** ba_jax's runs use JAX's "
         "persistent compilation cache (`compilation_cache_dir`), filled for "
         "each loss type by an untimed 1-step run before its first pair, so "
         "each run traces and lowers its programs and loads them from the "
         "cache, as a fresh process of a repeated run (another seed, a "
         "resume) does." if results.get("train", {}).get("warm_cache")
         else ""),
      ""]
  if "train" in results:
    lines += report_train(results["train"])
    if png is not None and png.is_file():
      lines += ["", f"Curves: ![training reward and held-out accuracy]"
                f"({png.name})", ""]
  if "real" in results:
    lines += report_real(results["real"])
  lines += ["## Settings not matched exactly, and why", "",
            "| setting | ba_jax | TRL | why |", "|---|---|---|---|"]
  lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in UNMATCHED]
  lines += ["", "TRL's other settings: `use_cpu=True`, float32 "
            "(`bf16=False`), no gradient checkpointing (ours: no remat), "
            "`shuffle_dataset=False` (prompt order = ours), "
            "`optim=\"adamw_torch\"`, `lr_scheduler_type="
            "\"constant_with_warmup\"` (lr x step / warm-up steps, from 0, as "
            "optax's linear warm-up), `max_grad_norm` = our `grad_clip`, "
            "generation by transformers' `generate` (TRL's CPU path; no vLLM)."]
  # Hand-written notes below the marker survive a re-run.
  if path.is_file() and NOTES_MARKER in path.read_text():
    lines += ["", NOTES_MARKER + path.read_text().split(NOTES_MARKER, 1)[1]]
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text("\n".join(lines).rstrip("\n") + "\n")


def plot(part: dict, png: pathlib.Path) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  losses, seeds, cells = part["losses"], part["seeds"], part["cells"]
  fig, axes = plt.subplots(2, len(losses), figsize=(4.5 * len(losses), 7),
                           squeeze=False)
  colours = {"ba_jax": "tab:blue", "trl": "tab:orange"}
  for j, loss in enumerate(losses):
    for name in ("ba_jax", "trl"):
      for k, s in enumerate(seeds):
        c = cells.get(f"{loss}/{s}")
        if not c:
          continue
        label = name if k == 0 else None
        steps = c["runs"][name]["steps"]
        axes[0, j].plot([x["step"] for x in steps], [x["reward"] for x in steps],
                        color=colours[name], alpha=0.6, lw=1, label=label)
        curve = [(0, c["before"]["heldout_acc_sampled"])]
        curve += [(r["step"], r["heldout_acc_sampled"])
                  for r in c["runs"][name]["curve"]
                  if 0 < r["step"] < part["steps"]]
        curve.append((part["steps"], c["final"][name]["heldout_acc_sampled"]))
        axes[1, j].plot(*zip(*curve), marker="o", ms=3, color=colours[name],
                        alpha=0.6, lw=1, label=label)
    axes[0, j].set_title(f"{loss} (TRL {LOSS_TYPES[loss]})")
    axes[0, j].set_xlabel("RL step")
    axes[1, j].set_xlabel("RL step")
  axes[0, 0].set_ylabel("training reward (batch mean)")
  axes[1, 0].set_ylabel("held-out accuracy (sampled)")
  axes[0, 0].legend()
  fig.suptitle(f"{part['config']}: one line per seed ({len(seeds)} seeds)")
  fig.tight_layout()
  png.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(png, dpi=80)
  plt.close(fig)
