"""What a resumed run checks and repairs in its workdir.

A run's ``config.json`` is the experiment it is; rerunning the workdir with
a config that changes the experiment (model, loss, RL, task, seed,
optimizer, warm-up, ``init_from``) is refused with the differing keys, unless
the caller allows it, which is then recorded in ``config_changes.jsonl``.
Keys that only say how to run (logging, checkpoint cadence, evaluation
cadence, the mesh, ``stop_after_steps``) may change freely. On resume from
step S, the metric and samples rows of the steps after S (written before the
run stopped, replayed now) are dropped so that each step is logged once.
"""
from __future__ import annotations

import dataclasses
import json
import time

from ba_jax.config import schema
from ba_jax.run import paths

# The keys a resumed run may change: how the run is executed, not what it
# computes (the schema's ``free`` keys).
FREE_KEYS = schema.free_keys()
CHANGES_FILE = "config_changes.jsonl"


class ConfigChanged(ValueError):
  """A resumed run's config changes the experiment (one-line message)."""


def flatten(tree, prefix: str = "") -> dict:
  """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (lists and tuples as lists)."""
  out = {}
  for key, value in tree.items():
    name = f"{prefix}{key}"
    if isinstance(value, dict):
      out.update(flatten(value, name + "."))
    else:
      out[name] = json.loads(json.dumps(value))  # tuples -> lists
  return out


def _free(key: str) -> bool:
  return any(key == k or key.startswith(k + ".") for k in FREE_KEYS)


def _typed(config: dict) -> dict:
  """The config with every schema default filled in (a key one side leaves
  at its default is no change), or as it is when it does not parse."""
  try:
    return dataclasses.asdict(schema.parse(schema.drop_retired(config)))
  except ValueError:
    return config


def differences(saved: dict, new: dict) -> dict[str, tuple]:
  """``{key: (saved value, new value)}`` over the experiment's keys (a key
  only one side has shows ``<absent>`` on the other)."""
  a, b = flatten(_typed(saved)), flatten(_typed(new))
  missing = "<absent>"
  return {k: (a.get(k, missing), b.get(k, missing))
          for k in sorted(set(a) | set(b))
          if not _free(k) and a.get(k, missing) != b.get(k, missing)}


def check_config(workdir, config, *, allow_changes: bool = False,
                 architecture: tuple = (), record: bool = True) -> dict:
  """Compares ``config`` with the run's saved ``config.json``.

  Returns the experiment's changes (empty: none). Raises ``ConfigChanged``
  naming every differing key unless ``allow_changes``; a change of a model
  ``architecture`` field is refused even then (the checkpoint's arrays have
  the old shapes). With changes allowed they are appended to
  ``config_changes.jsonl``; ``config.json`` then holds the new config
  (``record``: write these files; False on all processes but one).
  """
  path = paths.path(workdir) / "config.json"
  if not path.exists():
    return {}
  new = json.loads(config.to_json())
  saved = json.loads(path.read_text())
  diffs = differences(saved, new)
  listed = ", ".join(f"{k}: {old!r} -> {now!r}"
                     for k, (old, now) in diffs.items())
  arch = sorted(k for k in diffs if k.split(".", 1)[-1] in architecture
                and k.startswith("model."))
  if arch:
    raise ConfigChanged(
        f"{workdir} holds a run of another model ({listed}); its checkpoints "
        "cannot be restored into this architecture: use a new --workdir")
  if diffs and not allow_changes:
    raise ConfigChanged(
        f"{workdir} was started with another experiment config ({listed}); "
        "rerun with the saved values, use a new --workdir, or pass "
        "--allow_config_change to apply and record the change")
  if not record:
    return diffs
  if diffs:
    paths.JsonlFile(paths.path(workdir) / CHANGES_FILE).add(
        {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
         "changes": {k: list(v) for k, v in diffs.items()}})
  if flatten(saved) != flatten(new):
    paths.write_text(path, config.to_json())
  return diffs


def last_logged_step(workdir) -> int | None:
  """The last step in ``workdir/metrics.jsonl`` (None: no step logged):
  what the run logged before it stopped, read before ``drop_replayed_rows``."""
  path = paths.path(workdir) / "metrics.jsonl"
  if not path.exists():
    return None
  steps = [json.loads(l).get("step") for l in path.read_text().split("\n")
           if l.strip()]
  steps = [s for s in steps if isinstance(s, int)]
  return max(steps) if steps else None


def drop_replayed_rows(workdir, step: int) -> int:
  """Keeps the rows up to the checkpoint ``step`` (metrics.jsonl and
  samples.jsonl: steps <= step; eval.jsonl: evaluations <= step, none at
  step 0, which the resumed loop writes again). Returns the number of rows
  dropped."""
  root = paths.path(workdir)
  dropped = 0
  for name in ("metrics.jsonl", "samples.jsonl"):
    dropped += paths.JsonlFile(root / name).keep(
        lambda r: r.get("step", 0) <= step)
  dropped += paths.JsonlFile(root / "eval.jsonl").keep(
      lambda r: step > 0 and r.get("step", 0) <= step)
  return dropped
