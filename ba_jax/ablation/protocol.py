"""Criteria fixed in git before the runs: the guard every confirmation calls.

``guard(paths)`` refuses (``ProtocolError``) unless each protocol file (a
study's spec and its frozen predictions, or a comparison's protocol) is
committed and unchanged at HEAD, and unless the tracked tree is clean (as
``git describe --dirty`` counts it: untracked files do not make it dirty;
``exclude`` leaves out the results folder the runs write). ``allow_dirty``
lets a dirty tree through, and the returned record says so: the caller
stores it in every result row and the report prints it. The record also
names the commit of the code (HEAD) and the commit that last touched the
protocol files.

    from ba_jax.ablation import protocol
    record = protocol.guard(["experiments/studies/x/spec.py"], allow_dirty=False)
"""
from __future__ import annotations

import pathlib
import subprocess


class ProtocolError(RuntimeError):
  """A confirmation that would break the protocol."""


def git(args: list[str], cwd: str | pathlib.Path, strip: bool = True) -> str:
  """``git <args>`` in ``cwd``; its stdout (stripped unless ``strip`` is
  False). A failure raises ``subprocess.CalledProcessError``."""
  out = subprocess.run(["git", *args], cwd=cwd, check=True, text=True,
                       capture_output=True).stdout
  return out.strip() if strip else out


def repo_root(path: str | pathlib.Path) -> pathlib.Path:
  """The top of the git work tree that holds ``path``."""
  path = pathlib.Path(path).resolve()
  start = path if path.is_dir() else path.parent
  try:
    return pathlib.Path(git(["rev-parse", "--show-toplevel"], start))
  except (subprocess.CalledProcessError, FileNotFoundError) as e:
    raise ProtocolError(f"{path} is not inside a git work tree: the protocol "
                        "must be a committed file") from e


def head(root: str | pathlib.Path) -> str:
  """HEAD's commit in ``root``."""
  return git(["rev-parse", "HEAD"], root)


def dirty_paths(root: str | pathlib.Path, exclude=()) -> list[str]:
  """Tracked files changed (staged or not) against HEAD, leaving out
  ``exclude`` (paths or folders, relative to ``root`` or absolute)."""
  root = pathlib.Path(root)
  specs = []
  for e in exclude:
    try:
      specs.append(f":(exclude){_relative(root, e)}")
    except ValueError:  # outside the work tree: nothing of it is tracked
      continue
  out = git(["status", "--porcelain", "--untracked-files=no", "--", ".", *specs],
            root, strip=False)
  return sorted(line[3:] for line in out.splitlines() if line.strip())


def _relative(root: pathlib.Path, path) -> str:
  path = pathlib.Path(path)
  if not path.is_absolute():
    path = pathlib.Path.cwd() / path
  return path.resolve().relative_to(root.resolve()).as_posix()


def check_committed(root: pathlib.Path, path) -> str:
  """The commit that last touched ``path``; a ``ProtocolError`` unless the
  file is in HEAD and its working copy equals HEAD's."""
  rel = _relative(root, path)
  if not (root / rel).is_file():
    raise ProtocolError(f"{rel}: the protocol file is missing")
  try:
    committed = git(["rev-parse", f"HEAD:{rel}"], root)
  except subprocess.CalledProcessError:
    raise ProtocolError(
        f"{rel} is not committed: commit the protocol (git add {rel} && git "
        "commit) before the confirmation runs; they refuse to start until "
        "it is in HEAD") from None
  if git(["hash-object", rel], root) != committed:
    raise ProtocolError(
        f"{rel} differs from its committed version at HEAD: the protocol is "
        f"frozen once committed; restore it (git checkout -- {rel}) or, for a "
        "new protocol, start a new study")
  return git(["log", "-1", "--format=%H", "--", rel], root)


def guard(paths, *, allow_dirty: bool = False, exclude=()) -> dict:
  """Refuse unless every file of ``paths`` is committed and unchanged at
  HEAD and the tree is clean (or ``allow_dirty``); the record to store in
  each result row: ``code_commit``, ``protocol_commit`` (the newest commit
  that touched the files), ``protocol_files`` (file -> its commit),
  ``dirty`` (the changed paths) and ``allow_dirty``."""
  paths = list(paths)
  if not paths:
    raise ValueError("guard: no protocol file named")
  root = repo_root(paths[0])
  commits = {_relative(root, p): check_committed(root, p) for p in paths}
  newest = git(["log", "-1", "--format=%H", "--", *commits], root)
  dirty = dirty_paths(root, exclude)
  if dirty and not allow_dirty:
    shown = ", ".join(dirty[:8]) + (f" (+{len(dirty) - 8} more)" if len(dirty) > 8 else "")
    raise ProtocolError(
        f"the work tree has uncommitted changes ({shown}): the rows could not "
        "name the code that made them. Commit or stash them, or pass "
        "--allow_dirty (every row and the report then say so)")
  return dict(code_commit=head(root), protocol_commit=newest,
              protocol_files=commits, dirty=dirty, allow_dirty=bool(allow_dirty))


def code_state(path: str | pathlib.Path, exclude=()) -> dict:
  """The code commit and dirty paths for rows that need no protocol (tuning
  runs); empty where ``path`` is outside git."""
  try:
    root = repo_root(path)
    return dict(code_commit=head(root), dirty=dirty_paths(root, exclude))
  except (ProtocolError, subprocess.CalledProcessError):
    return dict(code_commit="", dirty=[])
