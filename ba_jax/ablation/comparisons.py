"""The named comparisons of a plan run on its result rows: the rows of a
rate setting, the paired tests per cell, Holm over the confirmatory family
and, apart, over the null controls."""
from __future__ import annotations

from ba_jax.ablation import stats

SETTINGS = ("tuned", "common")


def settings_of(plan: dict) -> tuple[str, ...]:
  """``tuned`` (each arm at its chosen rate; confirmatory) and, when the
  plan has a common rate, ``common`` (every arm at it; exploratory)."""
  return SETTINGS if plan.get("common") else SETTINGS[:1]


def rate_of(plan: dict, setting: str, cell: str, arm: str) -> float:
  if setting == "tuned":
    return plan["chosen"][f"{cell}/{arm}"]
  return plan["common"][cell]


def setting_rows(plan: dict, rows: list[dict], setting: str) -> list[dict]:
  """The rows of ``setting``: per cell and arm, the runs at its rate (a run
  both settings need is one row, read by both)."""
  return [r for r in rows if r["cell"] in plan["cells"] and r["arm"] in plan["arms"]
          and r["lr"] == rate_of(plan, setting, r["cell"], r["arm"])
          and r["seed"] in plan["confirm_seeds"]]


def _by(rows, cell, outcome):
  out = {}
  for r in rows:
    if r["cell"] == cell:
      out.setdefault(r["arm"], {})[r["seed"]] = r[outcome]
  return out


def run_tests(plan: dict, rows: list[dict], setting: str, outcome: str) -> list[dict]:
  """Every named comparison in every cell on ``outcome``, with Holm over
  the confirmatory family (superiority and non-inferiority) and, apart,
  over the controls."""
  out = []
  rows = setting_rows(plan, rows, setting)
  margin = plan.get("margin")
  for cell in plan["cells"]:
    by = _by(rows, cell, outcome)
    for a, b, kind in plan["comparisons"]:
      if a not in by or b not in by:
        continue
      c = stats.compare(by[a], by[b], margin=margin if kind == "noninferiority" else None)
      p = c["noninferiority"]["p"] if kind == "noninferiority" else c["t"]["p"]
      sign = c["sign"]
      if kind == "noninferiority":  # the sign test of d + margin > 0
        d = [by[a][s] - by[b][s] + margin for s in c["seeds"]]
        sign = stats.sign_test(d, alternative="greater")
      out.append(dict(cell=cell, a=a, b=b, kind=kind, p=p, t=c["t"], sign=sign,
                      ni=c.get("noninferiority"), name=f"{cell}: {a} vs {b} ({kind})"))
  for family in (("superiority", "noninferiority"), ("control",)):
    members = [t for t in out if t["kind"] in family]
    adjusted = stats.holm({t["name"]: t["p"] for t in members}, alpha=plan["alpha"])
    for t in members:
      t.update(p_holm=adjusted[t["name"]]["p_holm"], reject=adjusted[t["name"]]["reject"])
  return out
