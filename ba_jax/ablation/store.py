"""One result row per finished run, appended as it finishes, keyed by the
run's config hash: a killed study resumes by skipping the hashes it has.

A row is one JSON line; a line cut short by a kill is ignored on reading
(its run did not finish as far as the store knows, and runs again).
"""
from __future__ import annotations

import hashlib
import json
import os
import pathlib
import threading


def config_hash(settings: dict) -> str:
  """sha256 (first 16 hex digits) of a run's settings in canonical JSON: the
  config argument, the overrides, the seed and where it starts from."""
  text = json.dumps(settings, sort_keys=True, separators=(",", ":"))
  return hashlib.sha256(text.encode()).hexdigest()[:16]


def read_rows(path: str | pathlib.Path) -> list[dict]:
  """The rows of a JSON-lines file (none if it does not exist); a last line
  cut short is skipped."""
  path = pathlib.Path(path)
  if not path.exists():
    return []
  rows, lines = [], path.read_text().splitlines()
  for i, line in enumerate(lines):
    if not line.strip():
      continue
    try:
      rows.append(json.loads(line))
    except json.JSONDecodeError:
      if i != len(lines) - 1:
        raise ValueError(f"{path}:{i + 1}: not a JSON row") from None
  return rows


class Store:
  """The rows of one stage (``tuning.jsonl``, ``results.jsonl``)."""

  def __init__(self, path: str | pathlib.Path):
    self.path = pathlib.Path(path)
    self._lock = threading.Lock()
    self._rows = {r["config_hash"]: r for r in read_rows(self.path)
                  if "config_hash" in r}
    self._repair()

  def _repair(self):
    """Rewrite the file without a line cut short, so appends stay valid."""
    if self.path.exists():
      text = self.path.read_text()
      if text and not text.endswith("\n"):
        self.path.write_text("".join(json.dumps(r) + "\n"
                                     for r in read_rows(self.path)))

  def has(self, key: str) -> bool:
    return key in self._rows

  def get(self, key: str) -> dict | None:
    return self._rows.get(key)

  def rows(self) -> list[dict]:
    return list(self._rows.values())

  def append(self, row: dict) -> None:
    with self._lock:
      self.path.parent.mkdir(parents=True, exist_ok=True)
      with open(self.path, "a") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())
      self._rows[row["config_hash"]] = row
