"""``curves_<setting>_<cell>.png``: the mean over seeds of each arm's
training reward, policy entropy and response length per RL step."""
from __future__ import annotations

import pathlib

import numpy as np

from ba_jax.ablation.comparisons import setting_rows, settings_of

CURVES = (("reward_mean", "training reward"), ("entropy", "policy entropy"),
          ("length_mean", "response length"))


def plot(plan: dict, rows: list[dict], outdir: str | pathlib.Path) -> list[pathlib.Path]:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  paths = []
  for setting in settings_of(plan):
    srows = setting_rows(plan, rows, setting)
    for cell in plan["cells"]:
      fig, axes = plt.subplots(1, len(CURVES), figsize=(5 * len(CURVES), 3.6))
      for ax, (name, title) in zip(axes, CURVES):
        for arm in plan["arms"]:
          curves = [r["curves"][name] for r in srows if (r["cell"], r["arm"]) == (cell, arm)]
          if not curves:
            continue
          steps = min(len(c) for c in curves)
          v = np.array([[np.nan if x is None else x for x in c[:steps]] for c in curves])
          if steps and not np.isnan(v).all():
            ax.plot(np.arange(1, steps + 1), np.nanmean(v, axis=0), label=arm,
                    marker="." if steps < 12 else None)
        ax.set_title(f"{title} ({cell}, {setting} rates)")
        ax.set_xlabel("RL step")
      axes[0].legend(fontsize="x-small" if len(plan["arms"]) > 6 else None)
      fig.tight_layout()
      path = pathlib.Path(outdir) / f"curves_{setting}_{cell}.png"
      fig.savefig(path, dpi=90)
      plt.close(fig)
      paths.append(path)
  return paths
