"""PREDICTIONS.md (from the plan, before any confirmation run) and REPORT.md
(from the confirmation rows): tables, paired tests, Holm, the null control,
sign tests, mechanism diagnostics, stability flags, power and noise."""
from __future__ import annotations

import math

import numpy as np

from ba_jax.ablation import stats
from ba_jax.ablation.comparisons import run_tests, setting_rows, settings_of


def _f(x, spec="+.3f") -> str:
  return "n/a" if x is None or (isinstance(x, float) and not math.isfinite(x)) \
      else format(x, spec)


def mean_sd(values) -> tuple[float, float] | None:
  """Mean and SD (ddof 1; 0 for one value) of the finite values; None if none."""
  v = np.asarray([x for x in values if x is not None and np.isfinite(x)], float)
  return (float(v.mean()), float(v.std(ddof=1)) if len(v) > 1 else 0.0) if len(v) else None


def _pm(values, spec=".3f") -> str:
  m = mean_sd(values)
  return f"{m[0]:{spec}} ± {m[1]:{spec}}" if m else "n/a"


def predicted(plan: dict, cell: str, a: str, b: str) -> str:
  return plan.get("predictions", {}).get(cell, {}).get(f"{a} vs {b}", "n/a")


def predictions_md(plan: dict) -> str:
  p, m = plan, plan["margin"]
  start = (f"every run starts from `{p['init_from']}`" if p.get("init_from") else
           {"per_seed": "every run of a seed starts from that seed's one warm-up "
                        "(common random numbers)",
            "shared": "every run starts from seed 0's warm-up",
            "none": "every run trains from its seed as the config says (its own "
                    "warm-up, if any)"}[p["warmup"]])
  rates = (f"- Rates (`{p['rate_key']}`) swept per cell and arm: {p['rates']}, on "
           f"the tuning seeds {p['tune_seeds']} (never reported)."
           if len(p["rates"]) > 1 else
           f"- No tuning: every arm at {p['rates'][0]:g}; the power below is "
           "not estimated.")
  kinds = {"superiority": "two-sided paired t-test",
           "noninferiority": f"one-sided t-test of H0 mean(d) <= -{_f(m, '.4g')}",
           "control": "null control: two-sided paired t-test, Holm over its "
                      "cells as a family of its own; a rejection says the tests' "
                      "error rate is not what it claims"}
  lines = [
      f"# Pre-registration: {p['name']} (`{p['config']}`)", "",
      f"Written by `python -m ba_jax.ablate --spec={p['spec']} --stage=predict` "
      "from the tuning runs alone, before any confirmation run. The "
      "confirmation refuses to start unless this file, `predictions.json` and "
      "the spec are committed and unchanged at HEAD, and names their commit in "
      "every row.", "",
      "## Design", "",
      f"- Config `{p['config']}`, cells {p['cells']}, arms (`{p['arm_key']}`) "
      f"{p['arms']}; {start}.", rates,
      f"- Confirmation seeds: {p['confirm_seeds']} (disjoint from the tuning seeds).",
      "- Setting `tuned`: each arm at its chosen rate (confirmatory)."
      + (" Setting `common`: every arm at the cell's common rate (exploratory)."
         if p.get("common") else ""), "",
      "## Outcomes", "",
      f"- **Primary**: `{p['primary'][0]}`, the {p['primary'][1]} (per run)."]
  lines += [f"- Secondary (exploratory): `{s[0]}`, {s[1]}." for s in p["secondary"]]
  lines += ["", "## Rate choice", "",
            "The rate with the highest mean primary outcome over the tuning "
            f"seeds; ties (equal to {p.get('tie_decimals', 3)} decimals) go to the "
            "lower rate.", "",
            "| cell | arm | " + " | ".join(f"lr {lr:g}" for lr in p["rates"]) + " | chosen |",
            "|---|---|" + "---:|" * (len(p["rates"]) + 1)]
  for cell in p["cells"]:
    for arm in p["arms"]:
      means = p["tuning_means"][f"{cell}/{arm}"]
      lines.append(f"| {cell} | {arm} | " + " | ".join(
          _f(means[f"{lr:g}"], ".3f") for lr in p["rates"]) +
          f" | {p['chosen'][f'{cell}/{arm}']:g} |")
  if p.get("common"):
    lines += ["", "Common rate per cell: " + ", ".join(
        f"{c}: {lr:g}" for c, lr in p["common"].items())]
  lines += ["", "## Named comparisons (d = A - B per confirmation seed)", ""]
  lines += [f"{i}. `{a}` vs `{b}`, {k}: {kinds[k]}."
            for i, (a, b, k) in enumerate(p["comparisons"], 1)]
  margin_from = (" (the one-sided detectable difference of the tuning runs' "
                 "paired SD, as the spec says)" if p.get("margin_rule") == "mdd" else "")
  lines += ["", f"Holm family (alpha {p['alpha']}, tuned setting, primary "
            "outcome): " + ("; ".join(p["holm_family"]) or "none") + ". A "
            "comparison is confirmed when its Holm-adjusted p <= alpha. The exact "
            "sign test is reported beside each t-test; it is not in the family. "
            "The common setting and the secondary outcomes are exploratory "
            "(unadjusted p)." + (f" Non-inferiority margin: {_f(m, '.4g')}"
                                 f"{margin_from}." if m else ""), "",
            "## Power", "",
            f"Paired SD of the primary outcome on the tuning seeds at the chosen "
            f"rates, pooled over {p['paired_sd_terms']} (cell, comparison) terms: "
            f"{_f(p['paired_sd'], '.4f')}. With {len(p['confirm_seeds'])} "
            "confirmation seeds the minimum detectable difference (paired t-test, "
            f"power {p['power']}, non-central t) is {_f(p['mdd'], '.4f')} at alpha "
            f"{p['alpha']} two-sided and {_f(p['mdd_holm_first'], '.4f')} at Holm's "
            "first step. The non-inferiority test's power when the true difference "
            f"is 0: {_f(p['ni_power_at_zero'], '.2f')}. The SD comes from few "
            "tuning seeds: these numbers are estimates.", ""]
  if p.get("predictions"):
    labels = list(dict.fromkeys(f"{a} vs {b}" for a, b, _ in p["comparisons"]))
    extra = [k for k in next(iter(p["predictions"].values())) if k not in labels]
    lines += ["## Predictions", "",
              "| cell | " + " | ".join(labels + extra) + " |",
              "|---|" + "---|" * (len(labels) + len(extra))]
    for cell in p["cells"]:
      pr = p["predictions"].get(cell, {})
      lines.append(f"| {cell} | " + " | ".join(
          [pr.get(k, "not predicted") for k in labels] + [pr.get(k, "") for k in extra])
          + " |")
    lines.append("")
  if p.get("notes"):
    lines += [p["notes"].strip(), ""]
  return "\n".join(lines)


def verdict(plan: dict, t: dict, confirmatory: bool) -> str:
  """The words for one test of ``run_tests``: by its Holm-adjusted p when
  ``confirmatory``, else by its unadjusted p."""
  ok = t["reject"] if confirmatory else (t["p"] == t["p"] and t["p"] <= plan["alpha"])
  if t["kind"] == "superiority" and ok:
    return "A > B" if t["t"]["mean"] > 0 else "A < B"
  return {"superiority": "A differs from B" if ok else "no difference shown",
          "noninferiority": "non-inferior" if ok else "non-inferiority not shown",
          "control": "CONTROL FIRED" if ok else "no difference (as it should)"}[t["kind"]]


def outcomes(plan: dict) -> list[tuple[str, str, str, bool]]:
  """``(setting, outcome, words, confirmatory)`` in the report's order: only
  the primary outcome at the tuned rates is confirmatory."""
  return [(setting, outcome, words, setting == "tuned" and outcome == plan["primary"][0])
          for setting in settings_of(plan)
          for outcome, words in [plan["primary"], *plan["secondary"]]]


def comparison_rows(plan: dict, rows: list[dict]) -> list[dict]:
  """Every test of the report as a flat row: setting, outcome, the paired
  mean difference with its 95% CI, p, Holm p (confirmatory tests only), the
  sign test, the verdict and what was predicted."""
  out = []
  for setting, outcome, _, confirmatory in outcomes(plan):
    for t in run_tests(plan, rows, setting, outcome):
      tt = t["t"]
      out.append(dict(
          setting=setting, outcome=outcome, confirmatory=confirmatory,
          cell=t["cell"], a=t["a"], b=t["b"], kind=t["kind"], n=tt["n"],
          mean_d=tt["mean"], ci_low=tt["low"], ci_high=tt["high"], p=t["p"],
          p_holm=t["p_holm"] if confirmatory else None,
          sign_wins=t["sign"]["wins"], sign_losses=t["sign"]["losses"],
          sign_p=t["sign"]["p"], verdict=verdict(plan, t, confirmatory),
          predicted=predicted(plan, t["cell"], t["a"], t["b"])))
  return out


def _tests_table(plan, rows, setting, outcome, confirmatory: bool) -> list[str]:
  lines = ["| cell | comparison | n | mean d [95% CI] | t-test p | "
           + ("Holm p | verdict |" if confirmatory else "verdict (unadjusted) |")
           + " sign test w:l p | predicted |",
           "|---|---|---:|---|---:|" + ("---:|---|" if confirmatory else "---|") + "---|---|"]
  for t in run_tests(plan, rows, setting, outcome):
    tt = t["t"]
    holm = f" {_f(t['p_holm'], '.3g')} |" if confirmatory else ""
    lines.append(
        f"| {t['cell']} | {t['a']} - {t['b']} ({t['kind']}) | {tt['n']} | "
        f"{_f(tt['mean'])} [{_f(tt['low'])}, {_f(tt['high'])}] | {_f(t['p'], '.3g')} |"
        f"{holm} {verdict(plan, t, confirmatory)} | {t['sign']['wins']}:{t['sign']['losses']} "
        f"p={_f(t['sign']['p'], '.3g')} | {predicted(plan, t['cell'], t['a'], t['b'])} |")
  return lines


PLANNING_MDDS = (0.06, 0.03)  # the differences a next run could be sized for


def power_seen(plan: dict, rows: list[dict]) -> list[str]:
  """The power these confirmation runs had, from their own paired SDs
  (tuned setting, primary outcome), and the seeds a run would need for the
  ``PLANNING_MDDS`` at that SD."""
  outcome = plan["primary"][0]
  lines = ["## Power seen in these runs", "",
           f"Paired SD of `{outcome}` per named comparison (tuned setting), the "
           "minimum detectable difference for this run's seeds (paired t-test, "
           "two-sided alpha 0.05, power 0.8, non-central t), and the seeds a run "
           "needs for " + " and ".join(f"{m:g}" for m in PLANNING_MDDS) + " at that "
           "SD. An SD from few seeds is itself uncertain: the seed counts are "
           "estimates.", "",
           "| cell | comparison | seeds | paired SD | MDD at these seeds | "
           + " | ".join(f"seeds for MDD {m:g}" for m in PLANNING_MDDS) + " |",
           "|---|---|---:|---:|---:|" + "---:|" * len(PLANNING_MDDS)]
  seen = set()
  for t in run_tests(plan, rows, "tuned", outcome):
    if (t["cell"], t["a"], t["b"]) in seen:  # one pair, two hypotheses: one SD
      continue
    seen.add((t["cell"], t["a"], t["b"]))
    n, sd = t["t"]["n"], t["t"]["sd"]
    known = n > 1 and sd > 0
    mdd = stats.min_detectable_difference(n, sd) if known else float("nan")
    need = [str(stats.seeds_for(m, sd)) if known else "n/a" for m in PLANNING_MDDS]
    lines.append(f"| {t['cell']} | {t['a']} - {t['b']} | {n} | {_f(sd, '.4f')} | "
                 f"{_f(mdd, '.3f')} | " + " | ".join(need) + " |")
  return lines + [""]


def arm_columns(plan: dict) -> list[tuple[str, str, str]]:
  """The per-arm table's outcomes: ``(row field, header, format)``."""
  return [(plan["primary"][0], "primary: reward", ".3f"),
          ("heldout_after", "held-out after", ".3f"),
          ("heldout_before", "held-out before", ".3f"),
          ("groups_mixed_frac", "mixed", ".2f"),
          ("pos_share_minus_frac", "share - fraction", "+.3f"),
          ("entropy_drift", "entropy end/start", ".2f"),
          ("length_drift", "length end/start", ".2f"),
          ("weight_length_corr", "weight-length corr", "+.2f"),
          ("length_cv_first", "CV, step 1", ".2f")]


def arm_groups(plan: dict, rows: list[dict]):
  """``(cell, arm, rows)`` for each cell and arm that has rows."""
  for cell in plan["cells"]:
    for arm in plan["arms"]:
      rs = [r for r in rows if (r["cell"], r["arm"]) == (cell, arm)]
      if rs:
        yield cell, arm, rs


def _arm_table(plan, rows, setting) -> list[str]:
  columns = arm_columns(plan)
  lines = ["| cell | arm | lr | seeds | " + " | ".join(h for _, h, _ in columns)
           + " | unstable |", "|---|---|---:|---:|" + "---:|" * (len(columns) + 1)]
  for cell, arm, rs in arm_groups(plan, rows):
    lines.append(
        f"| {cell} | {arm} | {rs[0]['lr']:g} | {len(rs)} | "
        + "".join(f"{_pm([r[k] for r in rs], spec)} | " for k, _, spec in columns)
        + f"{sum(r['stability']['collapsed'] for r in rs)}/{len(rs)} |")
  return lines


MECHANISM = (("pos_share_minus_frac", "share - fraction", "+.3f"),
             ("weight_length_corr", "weight-length corr", "+.2f"),
             ("mismatch_k3", "sampler-trainer k3", ".1e"),
             ("mismatch_corrected_frac", "tokens corrected", ".3f"))
WITHIN = "loss.aggregation"  # the axis the mechanism checks are about


def mechanism_by_axis(plan: dict, rows: list[dict], setting: str = "tuned") -> list[str]:
  """With several arm axes: the mechanism checks (positive share minus
  positive fraction, weight-length correlation, and a correction's: the
  sampler-trainer gap and the tokens it corrected) per value of each axis
  but the aggregation (per surrogate, per correction), and per aggregation
  rule within it; means ± SD over the runs of every arm with those values
  (all seeds, the other axes pooled). Nothing for a one-axis plan."""
  keys = plan.get("arm_keys")
  if not keys:
    return []
  values = {arm: dict(zip(keys, v)) for arm, v in plan["arm_values"].items()}
  srows = setting_rows(plan, rows, setting)
  inner = [WITHIN] if WITHIN in keys else []
  lines = [f"## Mechanism checks per {' and per '.join(f'`{k}`' for k in keys if k not in inner)}"
           f" ({setting} rates)", "",
           "Positive share minus positive fraction (0 by construction under "
           "`balanced` and `sequence`; under `token` it follows the subsets' "
           "lengths) and the weight-length correlation, per run, pooled over "
           "the seeds and the arms' other axes; beside them the sampler-trainer "
           "gap a correction works on (k3 estimate of KL, `mismatch_k3`) and "
           "the share of tokens it truncated or masked (n/a: no correction).", ""]
  for key in keys:
    if key in inner:
      continue
    lines += [f"| cell | `{key}` | " + "".join(f"`{k}` | " for k in inner)
              + "runs | " + " | ".join(w for _, w, _ in MECHANISM) + " |",
              "|---|---|" + "---|" * len(inner) + "---:|" + "---:|" * len(MECHANISM)]
    for cell in plan["cells"]:
      groups = dict.fromkeys((values[a][key], *(values[a][k] for k in inner))
                             for a in plan["arms"])
      for group in groups:
        arms = {a for a in plan["arms"]
                if (values[a][key], *(values[a][k] for k in inner)) == group}
        rs = [r for r in srows if r["cell"] == cell and r["arm"] in arms]
        if not rs:
          continue
        lines.append(f"| {cell} | " + " | ".join(str(v) for v in group) + f" | {len(rs)} | "
                     + " | ".join(_pm([r.get(f) for r in rs], spec)
                                  for f, _, spec in MECHANISM)
                     + " |")
    lines.append("")
  return lines


def _noise_lines(plan, rows, setting) -> list[str]:
  lines, srows = [], setting_rows(plan, rows, setting)
  for cell in plan["cells"]:
    for arm in plan["arms"]:
      rs = [r for r in srows if (r["cell"], r["arm"]) == (cell, arm)]
      if len(rs) > 1:
        held = stats.sampling_noise_share([r["heldout_after"] for r in rs],
                                          rs[0]["heldout_samples"])
        reward = stats.sampling_noise_share([r["reward_auc"] for r in rs],
                                            rs[0].get("reward_samples", math.nan))
        lines.append(f"| {setting} | {cell} | {arm} | {_f(held['share'], '.2f')} | "
                     f"{_f(reward['share'], '.2f')} |")
    by = {(r["arm"], r["seed"]): r for r in srows if r["cell"] == cell}
    for a, b in dict.fromkeys((a, b) for a, b, _ in plan["comparisons"]):
      pairs = [(by[(a, s)], by[(b, s)]) for s in plan["confirm_seeds"]
               if (a, s) in by and (b, s) in by]
      if len(pairs) > 1:
        d = np.array([x["heldout_after"] - y["heldout_after"] for x, y in pairs])
        noise = np.mean([sum(r["heldout_after"] * (1 - r["heldout_after"]) /
                             r["heldout_samples"] for r in pair) for pair in pairs])
        var = d.var(ddof=1)
        lines.append(f"| {setting} | {cell} | {a} - {b} | "
                     f"{_f(noise / var if var > 0 else float('nan'), '.2f')} | |")
  return lines


def protocol_lines(rows: list[dict]) -> list[str]:
  """Which commits made the rows, and whether any ran on a dirty tree."""
  lines = ["## Protocol and code", ""]
  commits = sorted({(r.get("protocol_commit", ""), r.get("code_commit", "")) for r in rows})
  if not any(p or c for p, c in commits):
    return lines + ["These rows name no commit: they were written before the "
                    "runner recorded the protocol's and the code's commit in "
                    "every row.", ""]
  for p, c in commits:
    n = sum((r.get("protocol_commit", ""), r.get("code_commit", "")) == (p, c) for r in rows)
    lines.append(f"- {n} rows: protocol commit `{p or 'none'}`, code commit `{c or 'none'}`")
  dirty = [r for r in rows if r.get("dirty")]
  if dirty:
    paths = sorted({x for r in dirty for x in r["dirty"]})
    lines += ["", f"**Dirty tree.** {len(dirty)} rows ran with uncommitted "
              f"changes to {', '.join(paths)}, let through by `--allow_dirty`: "
              "their code is not exactly the commit they name."]
  return lines + [""]


def report_md(plan: dict, rows: list[dict], n_tuning: int,
              status: dict | None = None) -> str:
  """REPORT.md. ``status``: the confirm stage's time box record
  (``confirmed_seeds.json``), when one was kept."""
  settings = settings_of(plan)
  by_setting = {s: setting_rows(plan, rows, s) for s in settings}
  n_rows = sum(len(v) for v in by_setting.values())
  n_seeds = len({r["seed"] for v in by_setting.values() for r in v})
  lines = [f"# {plan['name']}: report", "",
           "Pre-registration: [PREDICTIONS.md](PREDICTIONS.md). Rows: "
           f"`results.jsonl` ({n_rows} confirmation rows, each rate setting "
           f"counted apart, over {n_seeds} seeds; the {n_tuning} tuning runs are "
           "not reported). Means ± SD (ddof 1) over seeds.", ""]
  if status and len(status["complete"]) < len(status["planned"]):
    lines += [f"**Time box.** Seeds {status['complete']} of the planned "
              f"{status['planned']} are reported: no run started later than "
              f"{status['start_within_min']:g} min after the confirm stage began, "
              "runs went seed by seed, and a seed counts only when all its runs "
              "finished. The rule looks at the clock, not at results.", ""]
  for setting in settings:
    srows = by_setting[setting]
    lines += [f"## Rates `{setting}`" + (" (confirmatory)" if setting == "tuned"
                                         else " (exploratory)"), ""]
    lines += _arm_table(plan, srows, setting)
    for _, outcome, words, confirmatory in [o for o in outcomes(plan) if o[0] == setting]:
      lines += ["", f"Tests on `{outcome}` ({words})"
                + ("; Holm over the pre-registered family:" if confirmatory
                   else "; exploratory, unadjusted:"), ""]
      lines += _tests_table(plan, rows, setting, outcome, confirmatory)
    lines.append("")
  lines += mechanism_by_axis(plan, rows)
  lines += power_seen(plan, rows)
  lines += ["## How much of the seed-to-seed spread is sampling noise", "",
            "Binomial variance of a run's accuracy (p(1-p)/samples; held out: "
            "problems x samples per problem, whose responses to one problem "
            "are correlated, so this is a lower bound; training reward: every "
            "graded rollout of the run) over the variance across seeds, per "
            "arm; and for the held-out paired differences of the named "
            "comparisons (the sum of both runs' binomial variances over the "
            "variance of d). The runs of a seed share its sampling draws, so "
            "this sum assumes an independence paired runs lack: a share above "
            "1 says the two arms' runs answered alike more often than "
            "independent runs would (their policies barely differ), not that "
            "the noise exceeds the spread.", "",
            "| rates | cell | arm or comparison | held-out noise share "
            "| training-reward noise share |", "|---|---|---|---:|---:|"]
  for setting in settings:
    lines += _noise_lines(plan, rows, setting)
  lines.append("")
  runs = {r["config_hash"]: r for v in by_setting.values() for r in v if "config_hash" in r}
  lines += protocol_lines(list(runs.values()) or rows)
  return "\n".join(lines)
