"""``curves_<setting>_<cell>.png``: the mean over seeds of each arm's
training reward, policy entropy and response length per RL step.

One static axis: one row of panels, a line per arm. Several crossed axes
(``arm_keys``): a row of panels per value of the first axis, a colour per
combination of the middle axes and a line style per value of the last, so
that arms differing in one axis sit side by side with the same colour."""
from __future__ import annotations

import pathlib

import numpy as np

from ba_jax.ablation.arms import name_of
from ba_jax.ablation.comparisons import setting_rows, settings_of

CURVES = (("reward_mean", "training reward"), ("entropy", "policy entropy"),
          ("length_mean", "response length"))
STYLES = ("-", "--", ":", "-.")


def layout(plan: dict) -> list[tuple[str, list[tuple[str, str, int, int]]]]:
  """``(row title, [(arm, label, colour index, style index)])`` per row of
  panels, in the plan's arm order."""
  arms = list(plan["arms"])
  values = plan.get("arm_values") or {}
  keys = plan.get("arm_keys") or []
  if len(keys) < 2 or set(values) != set(arms):
    return [("", [(arm, arm, i, 0) for i, arm in enumerate(arms)])]
  firsts = list(dict.fromkeys(values[a][0] for a in arms))
  middles = list(dict.fromkeys(tuple(values[a][1:-1]) for a in arms))
  lasts = list(dict.fromkeys(values[a][-1] for a in arms))
  rows = []
  for first in firsts:
    mine = [a for a in arms if values[a][0] == first]
    rows.append((f"{keys[0]}={name_of([first])}",
                 [(a, name_of(values[a][1:]), middles.index(tuple(values[a][1:-1])),
                   lasts.index(values[a][-1]) % len(STYLES)) for a in mine]))
  return rows


def plot(plan: dict, rows: list[dict], outdir: str | pathlib.Path) -> list[pathlib.Path]:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  groups = layout(plan)
  n_colours = 1 + max(c for _, members in groups for _, _, c, _ in members)
  cmap = plt.get_cmap("tab10" if n_colours <= 10 else "tab20")
  widest = max(len(members) for _, members in groups)
  outside = len(groups) > 1 or widest > 6  # a legend that would cover the lines
  paths = []
  for setting in settings_of(plan):
    srows = setting_rows(plan, rows, setting)
    for cell in plan["cells"]:
      fig, axes = plt.subplots(len(groups), len(CURVES), squeeze=False,
                               figsize=(5 * len(CURVES) + (2.6 if outside else 0),
                                        3.6 * len(groups)))
      for r, (row_title, members) in enumerate(groups):
        for ax, (name, title) in zip(axes[r], CURVES):
          for arm, label, colour, style in members:
            curves = [x["curves"][name] for x in srows if (x["cell"], x["arm"]) == (cell, arm)]
            if not curves:
              continue
            steps = min(len(c) for c in curves)
            v = np.array([[np.nan if y is None else y for y in c[:steps]] for c in curves])
            if steps and not np.isnan(v).all():
              ax.plot(np.arange(1, steps + 1), np.nanmean(v, axis=0), label=label,
                      color=cmap(colour % cmap.N), linestyle=STYLES[style],
                      marker="." if steps < 12 else None)
          where = f"{cell}, {setting} rates" + (f", {row_title}" if row_title else "")
          ax.set_title(f"{title} ({where})", fontsize="medium")
          ax.set_xlabel("RL step")
        if outside:
          axes[r][-1].legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.02, 1.0))
        else:
          axes[r][0].legend()
      fig.tight_layout()
      path = pathlib.Path(outdir) / f"curves_{setting}_{cell}.png"
      fig.savefig(path, dpi=90, bbox_inches="tight")
      plt.close(fig)
      paths.append(path)
  return paths
