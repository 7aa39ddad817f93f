"""A study's arms: the values of one static config axis (``arm_key``), or of
several crossed (``arm_keys``), each arm then named by its values joined
with "/" (``"gspo/balanced/tis_token"``); and the check, as the spec loads,
that the trainer accepts every arm's loss settings in every cell
(``ba_jax.config.combinations``), so that a study never stops on a refused
run halfway through.

    from ba_jax.ablation.arms import grid
    arms = grid(["ppo_clip", "gspo"], ["token", "balanced"])  # 4 tuples
"""
from __future__ import annotations

import itertools
import pathlib
import runpy

from ba_jax.config import combinations, schema

SEP = "/"


def grid(*axes) -> list[tuple]:
  """Every combination of the axes' values, the first axis slowest:
  ``grid(["a", "b"], [1, 2])`` is ``[("a", 1), ("a", 2), ("b", 1), ("b", 2)]``."""
  return list(itertools.product(*axes))


def name_of(values) -> str:
  """An arm's name: its values joined with "/" (a float as ``:g`` prints it)."""
  return SEP.join(f"{v:g}" if isinstance(v, float) else str(v) for v in values)


def parse(keys: tuple, arms, where: str) -> dict:
  """name -> the arm's values (one per key of ``keys``), in the spec's order.
  An arm is a tuple of values, or its name (each part then a string)."""
  out = {}
  for arm in arms:
    if isinstance(arm, str):
      values = tuple(arm.split(SEP))
    elif isinstance(arm, (list, tuple)):
      values = tuple(arm)
      bad = [v for v in values if SEP in str(v)]
      if bad:
        raise ValueError(f"{where}: arm {arm!r}: the value {bad[0]!r} holds "
                         f"{SEP!r}, which separates an arm's values in its name")
    else:
      raise ValueError(f"{where}: arm {arm!r}; with arm_keys, expected a tuple "
                       f"of {len(keys)} values or their names joined with {SEP!r}")
    if len(values) != len(keys):
      raise ValueError(f"{where}: arm {arm!r} has {len(values)} value(s); expected "
                       f"one per key of arm_keys={list(keys)}")
    name = name_of(values)
    if name in out:
      raise ValueError(f"{where}: arm {name!r} is given twice; arms must be distinct")
    out[name] = values
  return out


def config_arg(config: str, variant: str) -> str:
  """The ``--config=`` argument of a cell: the spec's config with the cell's
  variant after the colon (after the config's own variants, if any)."""
  if not variant:
    return config
  return f"{config},{variant}" if ":" in config else f"{config}:{variant}"


def _config_values(arg: str, where: str) -> dict:
  """The plain values of ``--config=arg``; none when its file is not there
  (a spec for a fake runner, in tests: its rule keys then take the schema's
  defaults)."""
  path, _, variant = arg.partition(":")
  if not pathlib.Path(path).is_file():
    return {}
  try:
    config = runpy.run_path(path)["get_config"](variant or None)
  except (ValueError, KeyError) as e:
    raise ValueError(f"{where}: --config={arg}: {e}") from None
  return config.to_dict() if hasattr(config, "to_dict") else dict(config)


def _default(dotted: str):
  section, _, name = dotted.partition(".")
  return schema.defaults(schema.SECTIONS[section])[name]


def check(spec, where: str) -> None:
  """Refuses an arm whose loss settings, in any cell, the trainer would
  refuse: a ``ValueError`` naming the arm and the cell, with
  ``combinations.check_combination``'s one-line reason. The settings are the
  cell's config file's, under the spec's, the cell's and the arm's
  overrides."""
  loaded = {}
  for cell_name, cell in spec.cells.items():
    arg = config_arg(spec.config, cell.get("variant", ""))
    if arg not in loaded:
      loaded[arg] = _config_values(arg, where)
    base = loaded[arg]
    for arm in spec.arms:
      settings = dict(spec.overrides, **cell.get("overrides", {}))
      settings.update(spec.arm_settings(arm))
      kwargs = {}
      try:
        for name, dotted in combinations.KEYS.items():
          if dotted in settings:
            kwargs[name] = schema.check(dotted, settings[dotted])
          else:
            section, _, key = dotted.partition(".")
            kwargs[name] = base.get(section, {}).get(key, _default(dotted))
        combinations.check_combination(**kwargs)
      except ValueError as e:
        raise ValueError(f"{where}: arm {arm!r} in cell {cell_name!r}: {e}") from None
