"""The one path layer for a run's own files: ``etils.epath``.

Orbax writes checkpoints through ``etils.epath`` (and tensorstore), so a
``gs://`` workdir works for them; every other file a run reads or writes
(config.json, model_config.json, devices.json, metrics.jsonl, eval.jsonl,
summary.json, the tokenizer, ``init_from``, export and evaluation outputs) goes through
this module so that it lands in the same place. Libraries that need a local
directory (a tokenizer's ``save_pretrained``, safetensors) go through a
local temporary copy (``local_dir``, ``upload_dir``).
"""
from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import tempfile
from typing import Iterator

from etils import epath


def path(p) -> epath.Path:
  """``p`` as an epath; a local path is made absolute (orbax needs it)."""
  out = epath.Path(p)
  return out if is_remote(out) else epath.Path(os.path.abspath(out))


def is_remote(p) -> bool:
  """True for a URL (``gs://...``, ...), False for a local path."""
  return "://" in str(p)


def read_text(p) -> str:
  return path(p).read_text()


def write_text(p, text: str) -> None:
  p = path(p)
  p.parent.mkdir(parents=True, exist_ok=True)
  p.write_text(text)


def read_json(p):
  return json.loads(read_text(p))


def write_json(p, value) -> None:
  write_text(p, json.dumps(value, indent=1))


class JsonlFile:
  """A jsonl file that rows are added to; ``keep(pred)`` drops rows.

  A local file is appended to; object stores cannot append, so a remote
  file is rewritten whole on each ``add`` (these files stay small).
  """

  def __init__(self, p):
    self.path = path(p)
    self._rows: list[str] | None = None  # the remote file's lines

  def _lines(self) -> list[str]:
    if not self.path.exists():
      return []
    return [l for l in self.path.read_text().split("\n") if l.strip()]

  def add(self, record: dict) -> None:
    line = json.dumps(record)
    if not is_remote(self.path):
      self.path.parent.mkdir(parents=True, exist_ok=True)
      with open(self.path, "a") as f:
        f.write(line + "\n")
      return
    if self._rows is None:
      self._rows = self._lines()
    self._rows.append(line)
    write_text(self.path, "\n".join(self._rows) + "\n")

  def keep(self, predicate) -> int:
    """Keeps the rows whose record satisfies ``predicate``; returns how many
    were dropped (a resumed run replays the steps after its checkpoint)."""
    lines = self._lines()
    kept = [l for l in lines if predicate(json.loads(l))]
    if len(kept) != len(lines):
      write_text(self.path, "".join(l + "\n" for l in kept))
    self._rows = kept if is_remote(self.path) else None
    return len(lines) - len(kept)


def upload_dir(local: str, remote) -> None:
  """Copies the files of the local directory ``local`` to ``remote``."""
  remote = path(remote)
  for root, _, files in os.walk(local):
    rel = os.path.relpath(root, local)
    target = remote if rel == "." else remote / rel
    target.mkdir(parents=True, exist_ok=True)
    for name in files:
      (target / name).write_bytes(
          epath.Path(os.path.join(root, name)).read_bytes())


_MIRRORS: dict[str, str] = {}


def local(p) -> str:
  """A local path with ``p``'s files: ``p`` itself when local, else a copy
  made once per process (removed at exit); for ``init_from``, read by
  libraries that open files by local path (transformers, safetensors)."""
  if not p or not is_remote(p):
    return p
  if str(p) not in _MIRRORS:
    tmp = tempfile.mkdtemp(prefix="ba_jax_")
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    _download(path(p), tmp)
    _MIRRORS[str(p)] = tmp
  return _MIRRORS[str(p)]


@contextlib.contextmanager
def local_dir(p) -> Iterator[str]:
  """A local directory with ``p``'s files: ``p`` itself when local, else a
  temporary copy (for libraries that open files by local path)."""
  p = path(p)
  if not is_remote(p):
    yield str(p)
    return
  tmp = tempfile.mkdtemp(prefix="ba_jax_")
  try:
    _download(p, tmp)
    yield tmp
  finally:
    shutil.rmtree(tmp, ignore_errors=True)


def _download(remote: epath.Path, local: str) -> None:
  os.makedirs(local, exist_ok=True)
  for child in remote.iterdir():
    if child.is_dir():
      _download(child, os.path.join(local, child.name))
    else:
      with open(os.path.join(local, child.name), "wb") as f:
        f.write(child.read_bytes())


@contextlib.contextmanager
def output_dir(p) -> Iterator[str]:
  """A local directory to write into whose files end up in ``p``."""
  p = path(p)
  if not is_remote(p):
    os.makedirs(p, exist_ok=True)
    yield str(p)
    return
  tmp = tempfile.mkdtemp(prefix="ba_jax_")
  try:
    yield tmp
    upload_dir(tmp, p)
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
