"""Reads the result files that experiments/powered_ablation.py wrote before
this package existed (the powered drafts study and the SmolLM2 pilot): rows
keyed by ``gap``/``mode`` with a row per rate setting (``arm``), and a plan
with ``gaps``/``modes``. ``rows`` and ``plan`` give this package's form, so
the report regenerates from the committed files as they are."""
from __future__ import annotations


def is_legacy_plan(plan: dict) -> bool:
  return "gaps" in plan and "cells" not in plan


def plan(old: dict, spec) -> dict:
  """The plan of an old ``predictions.json``, with the spec's name,
  predictions and notes (the old script kept those in its code)."""
  new = dict(old)
  new.update(name=spec.name, spec=spec.path, cells=old["gaps"], arms=old["modes"],
             arm_key=spec.arm_key, rate_key=spec.rate_key,
             warmup="none" if old.get("init_from") else "per_seed",
             config=old.get("config", spec.config), power=0.8,
             predictions=spec.predictions, notes=spec.notes, margin_rule=old["margin"],
             secondary=[old["secondary"]])
  for key in ("gaps", "modes"):
    del new[key]
  return new


def rows(old: list[dict]) -> list[dict]:
  """One row per run (the old files repeat a run both settings used)."""
  out, seen = [], set()
  for r in old:
    key = (r["gap"], r["mode"], r["lr"], r["seed"])
    if key in seen:
      continue
    seen.add(key)
    new = {k: v for k, v in r.items() if k not in ("gap", "mode", "arm")}
    out.append(dict(new, cell=r["gap"], arm=r["mode"]))
  return out


def is_legacy_rows(rows: list[dict]) -> bool:
  return bool(rows) and "gap" in rows[0] and "cell" not in rows[0]
