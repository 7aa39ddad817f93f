"""The texts of experiments/powered_ablation.py: PREDICTIONS.md (from the
plan and the tuning runs) and REPORT.md (from the confirmation runs), with
the tests of experiments/ablation_stats.py."""
from __future__ import annotations

import collections
import math

import numpy as np

import ablation_stats as st

# The paper's mechanism, per cell: the predicted relation of A and B in
# d = A - B, and the sign of positive share minus positive fraction under
# token and dr_grpo (under balanced and sequence it is 0 by construction).
PREDICTED = {
    "pos": {("balanced", "sequence"): "A > B", ("balanced", "token"): "A >= B",
            ("token", "dr_grpo"): "no difference", "share": "> 0"},
    "neg": {("balanced", "sequence"): "A >= B (small)", ("balanced", "token"): "A > B",
            ("token", "dr_grpo"): "no difference", "share": "< 0"},
    "none": {("balanced", "sequence"): "A >= B (small)", ("balanced", "token"): "A = B",
             ("token", "dr_grpo"): "no difference", "share": "~0"},
}


def _f(x, spec="+.3f") -> str:
  return "n/a" if x is None or (isinstance(x, float) and not math.isfinite(x)) \
      else format(x, spec)


def _pm(values, spec=".3f") -> str:
  v = np.asarray([x for x in values if x is not None and np.isfinite(x)], float)
  return f"{v.mean():{spec}} ± {v.std(ddof=1) if len(v) > 1 else 0:{spec}}" if len(v) else "n/a"


def predictions_md(plan: dict, tuning_rows: list[dict]) -> str:
  p, m = plan, plan["margin"]
  config = p.get("config", "configs/drafts.py")
  start = (f"every run starts from `{p['init_from']}` (no warm-up)"
           if p.get("init_from") else
           "every run of a seed starts from that seed's one warm-up (common "
           "random numbers)")
  rates = (f"- Learning rates swept per cell and rule: {p['rates']}, on the "
           f"tuning seeds {p['tune_seeds']} (never reported)."
           if p["tune_seeds"] else
           f"- No tuning (a pilot): every rule at {p['rates'][0]:g}; nothing "
           "was seen before this file, and the power below is not estimated.")
  lines = [
      f"# Pre-registration: the powered aggregation ablation (`{config}`)", "",
      "Written by `experiments/powered_ablation.py --stage=predict` after the "
      "tuning runs and before any confirmation run; the tuning runs (seeds "
      f"{p['tune_seeds']}) are the only runs seen. The confirmation stage "
      "refuses to run if this file is missing or changed (its sha256 is in "
      "`predictions.json`).", "",
      "## Design", "",
      f"- Config `{config}` (variant `{p['variant'] or '-'}`), cells "
      f"{p['gaps']} (for the drafts task, the gap sign of the verifier rule), "
      f"rules {p['modes']}, {p['steps']} RL steps per run; {start}.",
      rates,
      f"- Confirmation seeds: {p['confirm_seeds'][0]}..{p['confirm_seeds'][-1]} "
      f"({len(p['confirm_seeds'])}; disjoint from the tuning seeds).",
      "- Arm `tuned`: each rule at its chosen rate (confirmatory). Arm "
      "`common`: every rule at the cell's common rate, `token`'s chosen rate "
      "(the drop-in replacement question; exploratory).", "",
      "## Outcomes", "",
      f"- **Primary**: `{p['primary'][0]}`, the {p['primary'][1]} (per run).",
      f"- Secondary (exploratory): `{p['secondary'][0]}`, {p['secondary'][1]}.",
      "- A run that the non-finite guard stops counts 0 reward for its missing "
      "steps and 0 held-out accuracy, and as unstable.", "",
      "## Rate choice (criterion fixed in the script before tuning)", "",
      "The rate with the highest mean primary outcome over the tuning seeds; "
      "ties (equal to 3 decimals) go to the lower rate.", "",
      "| cell | rule | " + " | ".join(f"lr {lr:g}" for lr in p["rates"]) + " | chosen |",
      "|---|---|" + "---:|" * (len(p["rates"]) + 1)]
  for g in p["gaps"]:
    for mode in p["modes"]:
      means = p["tuning_means"][f"{g}/{mode}"]
      lines.append(f"| {g} | {mode} | " + " | ".join(
          _f(means[f"{lr:g}"], ".3f") for lr in p["rates"]) +
          f" | {p['chosen'][f'{g}/{mode}']:g} |")
  lines += ["", "Common rate per cell: " + ", ".join(
      f"{g}: {lr:g}" for g, lr in p["common"].items()), "",
      "## Named comparisons (d = A - B per confirmation seed)", "",
      "1. `balanced` vs `sequence`, superiority: two-sided paired t-test.",
      f"2. `balanced` vs `token`, non-inferiority at margin {m}: one-sided "
      f"t-test of H0 mean(d) <= -{m}.",
      "3. `token` vs `dr_grpo`, negative control (their updates differ by one "
      "scalar per batch): two-sided paired t-test; Holm over its cells as a "
      "family of its own. A rejection says the tests' error rate is not what "
      "it claims.", "",
      f"Holm family (alpha {p['alpha']}, tuned arm, primary outcome): "
      + "; ".join(p["holm_family"]) + ". A comparison is confirmed when its "
      "Holm-adjusted p <= alpha. The exact sign test is reported beside each "
      "t-test as a check that does not assume normal differences; it is not in "
      "the family. Everything in the common arm and on the secondary outcome "
      "is exploratory (unadjusted p).", "",
      "## Power", "",
      f"Paired SD of the primary outcome on the tuning seeds at the chosen "
      f"rates, pooled over {p['paired_sd_terms']} (cell, comparison) terms: "
      f"{_f(p['paired_sd'], '.4f')}. With {len(p['confirm_seeds'])} "
      "confirmation seeds, the minimum detectable difference (paired t-test, "
      "power 0.8, non-central t) is "
      f"{_f(p['mdd'], '.4f')} at alpha 0.05 two-sided and "
      f"{_f(p['mdd_holm_first'], '.4f')} at Holm's first step "
      f"(alpha 0.05/{len(p['holm_family'])}). The non-inferiority test's power "
      f"when the true difference is 0: {_f(p['ni_power_at_zero'], '.2f')}. "
      "The SD comes from few tuning seeds: these numbers are estimates.", "",
      "## Predictions (the paper's mechanism)", "",
      "| cell | balanced vs sequence | balanced vs token | token vs dr_grpo "
      "| token/dr_grpo positive share - positive fraction |",
      "|---|---|---|---|---|"]
  for g in p["gaps"]:
    pr = PREDICTED.get(g, collections.defaultdict(lambda: "not predicted"))
    lines.append(f"| {g} | {pr[('balanced', 'sequence')]} | {pr[('balanced', 'token')]} | "
                 f"{pr[('token', 'dr_grpo')]} | {pr['share']} |")
  lines += ["",
            "Under `balanced` and `sequence` the positive share W+/(W+ + W-) "
            "equals the positive fraction by construction; under `token` and "
            "`dr_grpo` it follows the subsets' token counts, so it exceeds the "
            "fraction when correct responses are the longer ones (pos) and "
            "falls below it when they are the shorter (neg). Weight-length "
            "correlation: 0 under token and dr_grpo, most negative under "
            "sequence, between under balanced. A gap cell where groups are "
            "rarely mixed (`groups_mixed_frac` near 0) cannot tell the rules "
            "apart, whatever its result."]
  return "\n".join(lines) + "\n"


def _by(rows, arm, gap, outcome):
  out = {}
  for r in rows:
    if r.get("arm") == arm and r["gap"] == gap:
      out.setdefault(r["mode"], {})[r["seed"]] = r[outcome]
  return out


def tests(plan: dict, rows: list[dict], arm: str, outcome: str) -> list[dict]:
  """Every named comparison in every cell, with Holm over the confirmatory
  family (superiority and non-inferiority) and, separately, the controls."""
  out = []
  for g in plan["gaps"]:
    by = _by(rows, arm, g, outcome)
    for a, b, kind in plan["comparisons"]:
      if a not in by or b not in by:
        continue
      c = st.compare(by[a], by[b], margin=plan["margin"] if kind == "noninferiority" else None)
      p = c["noninferiority"]["p"] if kind == "noninferiority" else c["t"]["p"]
      sign = c["sign"]
      if kind == "noninferiority":  # the sign test of d + margin > 0
        d = [by[a][s] - by[b][s] + plan["margin"] for s in c["seeds"]]
        sign = st.sign_test(d, alternative="greater")
      out.append(dict(gap=g, a=a, b=b, kind=kind, p=p, t=c["t"], sign=sign,
                      ni=c.get("noninferiority"),
                      name=f"{g}: {a} vs {b} ({kind})"))
  for family in (("superiority", "noninferiority"), ("control",)):
    members = [t for t in out if t["kind"] in family]
    adjusted = st.holm({t["name"]: t["p"] for t in members}, alpha=plan["alpha"])
    for t in members:
      t.update(p_holm=adjusted[t["name"]]["p_holm"], reject=adjusted[t["name"]]["reject"])
  return out


def _tests_table(plan, rows, arm, outcome, confirmatory: bool) -> list[str]:
  lines = ["| cell | comparison | n | mean d [95% CI] | t-test p | "
           + ("Holm p | verdict |" if confirmatory else "verdict (unadjusted) |")
           + " sign test w:l p | predicted |",
           "|---|---|---:|---|---:|" + ("---:|---|" if confirmatory else "---|") + "---|---|"]
  for t in tests(plan, rows, arm, outcome):
    tt = t["t"]
    ok = t["reject"] if confirmatory else (t["p"] == t["p"] and t["p"] <= plan["alpha"])
    verdict = {"superiority": "A differs from B" if ok else "no difference shown",
               "noninferiority": "non-inferior" if ok else "non-inferiority not shown",
               "control": "CONTROL FIRED" if ok else "no difference (as it should)"}[t["kind"]]
    if t["kind"] == "superiority" and ok:
      verdict = "A > B" if tt["mean"] > 0 else "A < B"
    pred = PREDICTED.get(t["gap"], {}).get((t["a"], t["b"]), "n/a")
    holm = f" {_f(t['p_holm'], '.3g')} |" if confirmatory else ""
    lines.append(
        f"| {t['gap']} | {t['a']} - {t['b']} ({t['kind']}) | {tt['n']} | "
        f"{_f(tt['mean'])} [{_f(tt['low'])}, {_f(tt['high'])}] | {_f(t['p'], '.3g')} |"
        f"{holm} {verdict} | {t['sign']['wins']}:{t['sign']['losses']} "
        f"p={_f(t['sign']['p'], '.3g')} | {pred} |")
  return lines


PLANNING_MDDS = (0.06, 0.03)  # the differences a next run could be sized for


def power_seen(plan: dict, rows: list[dict]) -> list[str]:
  """The power these confirmation runs had, from their own paired SDs (tuned
  arm, primary outcome), and the seeds a run would need for the
  ``PLANNING_MDDS`` at that SD: a pilot's answer to "how many seeds"."""
  outcome = plan["primary"][0]
  lines = ["## Power seen in these runs", "",
           f"Paired SD of `{outcome}` per named comparison (tuned arm), the minimum "
           "detectable difference for this run's seeds (paired t-test, two-sided "
           "alpha 0.05, power 0.8, non-central t), and the seeds a run needs for "
           + " and ".join(f"{m:g}" for m in PLANNING_MDDS) + " at that SD. An SD "
           "from few seeds is itself uncertain: the seed counts are estimates.", "",
           "| cell | comparison | seeds | paired SD | MDD at these seeds | "
           + " | ".join(f"seeds for MDD {m:g}" for m in PLANNING_MDDS) + " |",
           "|---|---|---:|---:|---:|" + "---:|" * len(PLANNING_MDDS)]
  for t in tests(plan, rows, "tuned", outcome):
    n, sd = t["t"]["n"], t["t"]["sd"]
    known = n > 1 and sd > 0
    mdd = st.min_detectable_difference(n, sd) if known else float("nan")
    need = [str(st.seeds_for(m, sd)) if known else "n/a" for m in PLANNING_MDDS]
    lines.append(f"| {t['gap']} | {t['a']} - {t['b']} | {n} | {_f(sd, '.4f')} | "
                 f"{_f(mdd, '.3f')} | " + " | ".join(need) + " |")
  return lines + [""]


def report_md(plan: dict, rows: list[dict], tuning_rows: list[dict],
              status: dict | None = None) -> str:
  """``status``: the confirm stage's ``confirmed_seeds.json`` (which planned
  seeds finished inside its time box), when it wrote one."""
  n_conf = len({r["seed"] for r in rows})
  lines = ["# The powered aggregation ablation: report", "",
           "Pre-registration: [PREDICTIONS.md](PREDICTIONS.md). Rows: "
           f"`results.jsonl` ({len(rows)} confirmation rows over "
           f"{n_conf} seeds; the {len(tuning_rows)} tuning runs are not "
           "reported). Means ± SD (ddof 1) over seeds.", ""]
  if status and len(status["complete"]) < len(status["planned"]):
    lines += [f"**Time box.** Seeds {status['complete']} of the planned "
              f"{status['planned']} are reported: no run started later than "
              f"{status['start_within_min']:g} min after the confirm stage began "
              "(`--start_within_min`), runs went seed by seed, and a seed counts "
              "only when all its runs finished. The rule looks at the clock, not "
              "at results.", ""]
  for arm in ("tuned", "common"):
    lines += [f"## Arm `{arm}`" + (" (confirmatory)" if arm == "tuned" else
                                   " (exploratory)"), "",
              "| cell | rule | lr | seeds | primary: reward | held-out after "
              "| held-out before | mixed | share - fraction | entropy end/start "
              "| length end/start | weight-length corr | CV, step 1 | unstable |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for g in plan["gaps"]:
      for mode in plan["modes"]:
        rs = [r for r in rows if (r.get("arm"), r["gap"], r["mode"]) == (arm, g, mode)]
        if not rs:
          continue
        col = lambda k: [r[k] for r in rs]
        lines.append(
            f"| {g} | {mode} | {rs[0]['lr']:g} | {len(rs)} | {_pm(col('reward_auc'))} | "
            f"{_pm(col('heldout_after'))} | {_pm(col('heldout_before'))} | "
            f"{_pm(col('groups_mixed_frac'), '.2f')} | "
            f"{_pm(col('pos_share_minus_frac'), '+.3f')} | "
            f"{_pm(col('entropy_drift'), '.2f')} | {_pm(col('length_drift'), '.2f')} | "
            f"{_pm(col('weight_length_corr'), '+.2f')} | {_pm(col('length_cv_first'), '.2f')} | "
            f"{sum(r['stability']['collapsed'] for r in rs)}/{len(rs)} |")
    for outcome, words in (plan["primary"], plan["secondary"]):
      confirmatory = arm == "tuned" and outcome == plan["primary"][0]
      lines += ["", f"Tests on `{outcome}` ({words})"
                + ("; Holm over the pre-registered family:" if confirmatory
                   else "; exploratory, unadjusted:"), ""]
      lines += _tests_table(plan, rows, arm, outcome, confirmatory)
    lines.append("")
  lines += power_seen(plan, rows)
  lines += ["## How much of the seed-to-seed spread is sampling noise", "",
            "Binomial variance of a run's accuracy (p(1-p)/samples; held out: "
            "problems x samples per problem, whose responses to one problem "
            "are correlated, so this is a lower bound; training reward: every "
            "graded rollout of the run) over the variance across seeds, per "
            "rule; and for the held-out paired differences of the named "
            "comparisons (the sum of both runs' binomial variances over the "
            "variance of d).", "",
            "| arm | cell | rule or comparison | held-out noise share "
            "| training-reward noise share |", "|---|---|---|---:|---:|"]
  for arm in ("tuned", "common"):
    for g in plan["gaps"]:
      for mode in plan["modes"]:
        rs = [r for r in rows if (r.get("arm"), r["gap"], r["mode"]) == (arm, g, mode)]
        if len(rs) > 1:
          held = st.sampling_noise_share([r["heldout_after"] for r in rs],
                                         rs[0]["heldout_samples"])
          reward = st.sampling_noise_share([r["reward_auc"] for r in rs],
                                           rs[0].get("reward_samples", math.nan))
          lines.append(f"| {arm} | {g} | {mode} | {_f(held['share'], '.2f')} | "
                       f"{_f(reward['share'], '.2f')} |")
      by = {(r["mode"], r["seed"]): r for r in rows if (r.get("arm"), r["gap"]) == (arm, g)}
      for a, b, _ in plan["comparisons"]:
        pairs = [(by[(a, s)], by[(b, s)]) for s in plan["confirm_seeds"]
                 if (a, s) in by and (b, s) in by]
        if len(pairs) > 1:
          d = np.array([x["heldout_after"] - y["heldout_after"] for x, y in pairs])
          noise = np.mean([sum(r["heldout_after"] * (1 - r["heldout_after"]) /
                               r["heldout_samples"] for r in pair) for pair in pairs])
          var = d.var(ddof=1)
          lines.append(f"| {arm} | {g} | {a} - {b} | "
                       f"{_f(noise / var if var > 0 else float('nan'), '.2f')} | |")
  return "\n".join(lines) + "\n"


CURVES = (("reward_mean", "training reward"), ("entropy", "policy entropy"),
          ("length_mean", "response length"))


def plot(plan: dict, rows: list[dict], outdir) -> list:
  """``curves_<arm>_<cell>.png``: the mean over seeds of each rule's
  training reward, entropy and length per RL step."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  paths = []
  for arm in ("tuned", "common"):
    for g in plan["gaps"]:
      fig, axes = plt.subplots(1, len(CURVES), figsize=(5 * len(CURVES), 3.6))
      for ax, (name, title) in zip(axes, CURVES):
        for mode in plan["modes"]:
          curves = [r["curves"][name] for r in rows
                    if (r.get("arm"), r["gap"], r["mode"]) == (arm, g, mode)]
          if not curves:
            continue
          steps = min(len(c) for c in curves)
          v = np.array([[np.nan if x is None else x for x in c[:steps]] for c in curves])
          if steps and not np.isnan(v).all():
            ax.plot(np.arange(1, steps + 1), np.nanmean(v, axis=0), label=mode,
                    marker="." if steps < 12 else None)
        ax.set_title(f"{title} ({g} gap, {arm} arm)")
        ax.set_xlabel("RL step")
      axes[0].legend()
      fig.tight_layout()
      path = outdir / f"curves_{arm}_{g}.png"
      fig.savefig(path, dpi=90)
      plt.close(fig)
      paths.append(path)
  return paths
