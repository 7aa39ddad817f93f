"""A study's spec: what is compared, on which runs, judged how.

A spec is a Python file whose ``get_spec()`` returns a dict with the keys of
``Spec`` (experiments/studies/tiny_rules/spec.py is a small one). Every run is
``python -m ba_jax.train --config=<config>[,<cell variant>]`` with the spec's
``overrides``, the cell's overrides, the arm's settings (``<arm_key>=<arm>``,
or with ``arm_keys`` one value per key: ``ba_jax.ablation.arms``),
``<rate_key>=<rate>`` and ``seed=<seed>``. Unknown keys, missing keys and
values of the wrong kind are errors that name the key, and an arm whose loss
settings the trainer would refuse is refused here, with the reason.
"""
from __future__ import annotations

import dataclasses
import hashlib
import pathlib
import runpy
from typing import Any

from ba_jax.ablation import arms as arms_lib

KINDS = ("superiority", "noninferiority", "control")
WARMUPS = ("none", "per_seed", "shared")


@dataclasses.dataclass(frozen=True)
class Comparison:
  """``d = a - b`` per seed (higher outcome is better). ``superiority``: a
  two-sided paired t-test; ``noninferiority``: one-sided at the spec's
  margin; ``control``: a null control (two arms that should not differ), Holm
  over its own family."""
  a: str
  b: str
  kind: str

  @property
  def label(self) -> str:
    return f"{self.a} vs {self.b}"


@dataclasses.dataclass(frozen=True)
class Spec:
  name: str
  config: str  # "configs/tiny.py" or "configs/tiny.py:smoke"
  cells: dict  # cell -> {"variant": "gap=pos", "overrides": {key: value}}
  arm_key: str  # the static axis the arms set, e.g. "loss.aggregation"
  arms: tuple  # the arms' names (with arm_keys: "gspo/balanced/none")
  rate_key: str  # "optim.learning_rate"
  rates: tuple
  tune_seeds: tuple
  confirm_seeds: tuple
  primary: tuple  # (row field, words)
  comparisons: tuple  # of Comparison
  secondary: tuple = ()  # ((row field, words), ...)
  overrides: dict = dataclasses.field(default_factory=dict)
  warmup: str = "none"  # per_seed: one exported warm-up per seed; shared: seed 0's
  warmup_variant: str = ""  # the warm-up's config variant (per_seed, shared)
  init_from: str = ""  # every run starts from this Hugging Face directory
  margin: Any = None  # a number, or "mdd": the tuning runs' detectable difference
  common_rate_arm: str = ""  # whose chosen rate is every arm's "common" rate
  alpha: float = 0.05
  power: float = 0.8
  detectable: tuple = (0.06, 0.03)  # differences the plan sizes seeds for
  predictions: dict = dataclasses.field(default_factory=dict)  # cell -> {label: text}
  notes: str = ""  # the study's mechanism, printed in PREDICTIONS.md
  tie_decimals: int = 3
  results: str = ""  # results folder, relative to the repository root
  path: str = ""  # the spec file (set by ``load``)
  # several static axes crossed ("loss.surrogate", "loss.aggregation"); then
  # arm_key is their names joined with "/", and arm_values holds each arm's
  # values (set by ``from_dict``)
  arm_keys: tuple = ()
  arm_values: dict = dataclasses.field(default_factory=dict)

  @property
  def cell_names(self) -> list[str]:
    return list(self.cells)

  def arm_settings(self, arm) -> dict:
    """The config overrides of ``arm``: {arm_key: arm}, or with several axes
    one per key."""
    if not self.arm_keys:
      return {self.arm_key: arm}
    return dict(zip(self.arm_keys, self.arm_values[arm]))

  def margin_of(self, mdd: float) -> float | None:
    if self.margin == "mdd":
      return mdd
    return None if self.margin is None else float(self.margin)


def _need(d: dict, key: str, kind, where: str):
  if key not in d:
    raise ValueError(f"{where}: the key {key!r} is missing")
  if not isinstance(d[key], kind):
    raise ValueError(f"{where}: {key}={d[key]!r}; expected {kind}")
  return d[key]


def from_dict(d: dict, path: str = "<spec>") -> Spec:
  """A checked ``Spec`` from ``get_spec()``'s dict."""
  fields = {f.name for f in dataclasses.fields(Spec)} - {"path", "arm_values"}
  unknown = sorted(set(d) - fields)
  if unknown:
    raise ValueError(f"{path}: unknown key(s) {unknown}; expected some of "
                     f"{sorted(fields)}")
  for key in ("name", "config", "rate_key"):
    _need(d, key, str, path)
  if ("arm_key" in d) == ("arm_keys" in d):
    raise ValueError(f"{path}: give arm_key (one static axis) or arm_keys (several, "
                     f"crossed), not {'both' if 'arm_key' in d else 'neither'}")
  cells = _need(d, "cells", dict, path)
  if not cells:
    raise ValueError(f"{path}: cells is empty; give at least one")
  for name, cell in cells.items():
    extra = sorted(set(cell) - {"variant", "overrides"})
    if extra or not isinstance(cell.get("overrides", {}), dict):
      raise ValueError(f"{path}: cells[{name!r}]={cell!r}; expected a dict with "
                       "'variant' (str) and/or 'overrides' ({key: value})")
  axes = {}
  if "arm_keys" in d:
    keys = tuple(_need(d, "arm_keys", (list, tuple), path))
    if len(keys) < 2 or len(set(keys)) != len(keys) or not all(
        isinstance(k, str) for k in keys):
      raise ValueError(f"{path}: arm_keys={list(keys)}; expected two or more "
                       "distinct config keys (one axis: arm_key)")
    values = arms_lib.parse(keys, _need(d, "arms", (list, tuple), path), path)
    axes = dict(arm_keys=keys, arm_values=values, arm_key=arms_lib.SEP.join(keys))
    arms = tuple(values)
    d = dict(d, common_rate_arm=_arm_name(d.get("common_rate_arm", "")))
    if isinstance(d.get("comparisons"), (list, tuple)):
      d["comparisons"] = [[_arm_name(c[0]), _arm_name(c[1]), *c[2:]]
                          if isinstance(c, (list, tuple)) and len(c) > 1 else c
                          for c in d["comparisons"]]
  else:
    _need(d, "arm_key", str, path)
    arms = tuple(_need(d, "arms", (list, tuple), path))
  if len(arms) < 2 or len(set(arms)) != len(arms):
    raise ValueError(f"{path}: arms={arms!r}; expected two or more distinct values")
  rates = tuple(sorted(float(r) for r in _need(d, "rates", (list, tuple), path)))
  tune = tuple(int(s) for s in _need(d, "tune_seeds", (list, tuple), path))
  confirm = tuple(int(s) for s in _need(d, "confirm_seeds", (list, tuple), path))
  if set(tune) & set(confirm):
    raise ValueError(f"{path}: seeds {sorted(set(tune) & set(confirm))} are both "
                     "tuning and confirmation seeds; the two must be disjoint")
  if len(confirm) < 2:
    raise ValueError(f"{path}: confirm_seeds={list(confirm)}; a paired test needs 2+")
  if not rates or (len(rates) > 1 and not tune):
    raise ValueError(f"{path}: rates={list(rates)} with tune_seeds={list(tune)}: "
                     "several rates need tuning seeds; without them give one rate")
  comparisons = []
  for c in _need(d, "comparisons", (list, tuple), path):
    a, b, kind = c
    if kind not in KINDS or a not in arms or b not in arms:
      raise ValueError(f"{path}: comparison {c!r}; expected (arm, arm, kind) with "
                       f"arms from {list(arms)} and kind one of {KINDS}")
    comparisons.append(Comparison(a, b, kind))
  if any(c.kind == "noninferiority" for c in comparisons):
    m = d.get("margin")
    if not (m == "mdd" or (isinstance(m, (int, float)) and m > 0)):
      raise ValueError(f"{path}: margin={m!r}; a non-inferiority comparison needs "
                       "a positive margin or 'mdd' (the tuning runs' detectable "
                       "difference)")
  warmup = d.get("warmup", "none")
  if warmup not in WARMUPS:
    raise ValueError(f"{path}: warmup={warmup!r}; expected one of {WARMUPS}")
  common = d.get("common_rate_arm", "")
  if common and common not in arms:
    raise ValueError(f"{path}: common_rate_arm={common!r}; expected one of {list(arms)}")
  primary = tuple(_need(d, "primary", (list, tuple), path))
  secondary = tuple(tuple(s) for s in d.get("secondary", ()))
  spec = Spec(**dict(d, arms=arms, rates=rates, tune_seeds=tune,
                     confirm_seeds=confirm, comparisons=tuple(comparisons),
                     primary=primary, secondary=secondary,
                     detectable=tuple(d.get("detectable", (0.06, 0.03))), **axes),
              path=path)
  arms_lib.check(spec, path)
  return spec


def _arm_name(arm):
  """A grid arm as the spec may name it: its name, or the tuple of its values."""
  return arms_lib.name_of(arm) if isinstance(arm, (list, tuple)) else arm


def load(path: str | pathlib.Path) -> Spec:
  """The spec in ``path`` (a Python file with ``get_spec()``)."""
  path = pathlib.Path(path)
  if not path.is_file():
    raise FileNotFoundError(f"--spec={path}: no such file")
  module = runpy.run_path(str(path))
  if "get_spec" not in module:
    raise ValueError(f"{path}: defines no get_spec()")
  return from_dict(module["get_spec"](), str(path))


def sha256(path: str | pathlib.Path) -> str:
  return hashlib.sha256(pathlib.Path(path).read_bytes()).hexdigest()
