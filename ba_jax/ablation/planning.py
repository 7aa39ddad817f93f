"""From tuning runs to a plan: each arm's rate, the paired SD of the primary
outcome, the detectable difference for the confirmation seeds, the margin
and the Holm family. Everything here is a function of the spec and the rows."""
from __future__ import annotations

import numpy as np

from ba_jax.ablation import stats


def choose_rate(rows: list[dict], rates, outcome: str, tie_decimals: int = 3):
  """The rate with the highest mean ``outcome`` over ``rows`` (one arm's
  tuning runs in one cell), ties at ``tie_decimals`` to the lower; and the
  mean per rate."""
  means = {}
  for lr in sorted(rates):
    v = [r[outcome] for r in rows if r["lr"] == lr and np.isfinite(r[outcome])]
    means[lr] = float(np.mean(v)) if v else float("-inf")
  best = max(round(m, tie_decimals) for m in means.values())
  return min(lr for lr, m in means.items() if round(m, tie_decimals) == best), means


def pooled_paired_sd(spec, rows: list[dict], chosen: dict) -> tuple[float, int]:
  """The paired SD of the primary outcome over the tuning seeds at the
  chosen rates, pooled (mean variance) over cells and comparisons; and the
  number of (cell, comparison) terms pooled."""
  outcome, variances = spec.primary[0], []
  seeds = sorted({r["seed"] for r in rows})
  for cell in spec.cells:
    by = {(r["arm"], r["seed"]): r[outcome] for r in rows
          if r["cell"] == cell and r["lr"] == chosen.get(f"{cell}/{r['arm']}")}
    for c in spec.comparisons:
      d = [by[(c.a, s)] - by[(c.b, s)] for s in seeds if (c.a, s) in by and (c.b, s) in by]
      if len(d) >= 2:
        variances.append(float(np.var(d, ddof=1)))
  return (float(np.sqrt(np.mean(variances))) if variances else float("nan"),
          len(variances))


def holm_family(spec) -> list[str]:
  return [f"{cell}: {c.a} vs {c.b} ({c.kind})" for cell in spec.cells
          for c in spec.comparisons if c.kind != "control"]


def make_plan(spec, rows: list[dict]) -> dict:
  """The plan ``predict`` freezes, from the spec and the tuning rows."""
  chosen, means = {}, {}
  for cell in spec.cells:
    for arm in spec.arms:
      rs = [r for r in rows if (r["cell"], r["arm"]) == (cell, arm)]
      if len(spec.rates) == 1:
        chosen[f"{cell}/{arm}"], per_rate = spec.rates[0], {spec.rates[0]: float("nan")}
      else:
        chosen[f"{cell}/{arm}"], per_rate = choose_rate(
            rs, spec.rates, spec.primary[0], spec.tie_decimals)
      means[f"{cell}/{arm}"] = {f"{lr:g}": v for lr, v in per_rate.items()}
  common = ({cell: chosen[f"{cell}/{spec.common_rate_arm}"] for cell in spec.cells}
            if spec.common_rate_arm else {})
  sd, terms = pooled_paired_sd(spec, rows, chosen)
  family = holm_family(spec)
  n = len(spec.confirm_seeds)

  def mdd(alpha, two_sided=True):
    return (stats.min_detectable_difference(n, sd, alpha=alpha, two_sided=two_sided,
                                            power=spec.power)
            if sd > 0 else float("nan"))

  margin = spec.margin_of(mdd(spec.alpha, two_sided=False))
  if spec.margin == "mdd" and not margin == margin:
    raise ValueError(f"{spec.path}: margin='mdd' needs the tuning runs' paired SD, "
                     "and there is none (no tuning seeds, or fewer than 2 pairs)")
  axes = (dict(arm_keys=list(spec.arm_keys),
               arm_values={arm: list(v) for arm, v in spec.arm_values.items()})
          if spec.arm_keys else {})  # a one-axis plan has no grid fields
  return dict(
      **axes,
      name=spec.name, spec=spec.path, config=spec.config, cells=list(spec.cells),
      arms=list(spec.arms), arm_key=spec.arm_key, rate_key=spec.rate_key,
      rates=list(spec.rates), warmup=spec.warmup, init_from=spec.init_from,
      tune_seeds=list(spec.tune_seeds), confirm_seeds=list(spec.confirm_seeds),
      primary=list(spec.primary), secondary=[list(s) for s in spec.secondary],
      chosen=chosen, tuning_means=means, common=common, tie_decimals=spec.tie_decimals,
      comparisons=[[c.a, c.b, c.kind] for c in spec.comparisons],
      holm_family=family, alpha=spec.alpha, power=spec.power,
      paired_sd=sd, paired_sd_terms=terms, mdd=mdd(spec.alpha),
      mdd_holm_first=mdd(spec.alpha / max(1, len(family))),
      margin=margin, margin_rule=spec.margin,
      ni_power_at_zero=(stats.t_test_power(margin, n, sd, alpha=spec.alpha,
                                           two_sided=False)
                        if margin and sd > 0 else float("nan")),
      predictions=spec.predictions, notes=spec.notes)


def seeds_needed(spec, rows: list[dict]) -> list[dict]:
  """Per cell and comparison of ``rows`` (tuning runs at each arm's best
  rate, or a pilot's runs): the paired SD, and the seeds a confirmation
  needs to detect each of ``spec.detectable`` (paired t, two-sided
  ``spec.alpha``, power ``spec.power``)."""
  out = []
  chosen = {}
  for cell in spec.cells:
    for arm in spec.arms:
      rs = [r for r in rows if (r["cell"], r["arm"]) == (cell, arm)]
      rates = sorted({r["lr"] for r in rs})
      if rates:
        chosen[f"{cell}/{arm}"] = choose_rate(rs, rates, spec.primary[0],
                                              spec.tie_decimals)[0]
  seeds = sorted({r["seed"] for r in rows})
  for cell in spec.cells:
    by = {(r["arm"], r["seed"]): r[spec.primary[0]] for r in rows
          if r["cell"] == cell and r["lr"] == chosen.get(f"{cell}/{r['arm']}")}
    for c in spec.comparisons:
      d = [by[(c.a, s)] - by[(c.b, s)] for s in seeds if (c.a, s) in by and (c.b, s) in by]
      sd = float(np.std(d, ddof=1)) if len(d) > 1 else float("nan")
      need = {m: (stats.seeds_for(m, sd, alpha=spec.alpha, power=spec.power)
                  if sd > 0 else None) for m in spec.detectable}
      out.append(dict(cell=cell, comparison=f"{c.a} - {c.b} ({c.kind})", pairs=len(d),
                      sd=sd, seeds_for=need,
                      mdd_at_confirm=(stats.min_detectable_difference(
                          len(spec.confirm_seeds), sd, alpha=spec.alpha,
                          power=spec.power) if sd > 0 else float("nan"))))
  return out


def pooled_sd(sds) -> float:
  """The root mean variance of paired SDs (``seeds_needed``'s ``sd``s;
  NaNs left out), as ``pooled_paired_sd`` pools them."""
  v = [s * s for s in sds if s == s]
  return float(np.sqrt(np.mean(v))) if v else float("nan")


def seeds_for_family(spec, sd: float, detectable: float) -> dict:
  """The confirmation seeds ``spec`` needs to detect ``detectable`` for
  paired differences of SD ``sd`` (paired t, power ``spec.power``): at
  ``spec.alpha`` unadjusted, and at Holm's first (strictest) step over the
  spec's family (``alpha / len(holm_family(spec))``), which is what makes
  every comparison of the family detectable at that difference."""
  family = len(holm_family(spec))
  return dict(sd=sd, detectable=detectable, family=family,
              alpha_first=spec.alpha / max(1, family),
              unadjusted=stats.seeds_for(detectable, sd, alpha=spec.alpha,
                                         power=spec.power),
              holm_first=stats.seeds_for(detectable, sd, alpha=spec.alpha / max(1, family),
                                         power=spec.power))
