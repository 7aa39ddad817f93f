"""Every third-party module the code imports is declared in setup.cfg.

A fresh machine installs only what ``setup.cfg`` declares (``.ci/run``:
``pip install -e ".[test]"``), so a module that is present here only because
someone installed it by hand, or because another package happens to pull it
in, breaks the suite there. The rules:

- a module imported anywhere under ``tests/`` is declared by the package's
  ``install_requires`` or by the ``test`` extra; the one exception is
  ``pytest.importorskip(name, reason=...)`` with a stated reason;
- a module imported at the top level of a ``ba_jax`` file is declared by
  ``install_requires`` (``pip install -e .`` then runs the default job);
- a module imported inside a function of ``ba_jax`` or anywhere in
  ``experiments/`` or ``configs/`` is declared by ``install_requires`` or by
  some extra (it names what installs it).

A module counts as local when a ``.py`` file or package of that name lies in
the repository (the tests' helpers, the sandbox's sibling scripts, the
experiments' own modules); standard-library modules are skipped.
"""

from __future__ import annotations

import ast
import configparser
import dataclasses
import functools
import importlib
import importlib.metadata
import os
import pathlib
import re
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
SETUP_CFG = REPO / "setup.cfg"


def _normalise(name: str) -> str:
  return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_names(block: str) -> set[str]:
  """Distribution names of a setup.cfg requirement list (one per line)."""
  names = set()
  for line in block.splitlines():
    line = line.split("#", 1)[0].strip()
    if line:
      names.add(_normalise(re.split(r"[\s<>=!~;\[(]", line, maxsplit=1)[0]))
  return names


def declared(setup_cfg_text: str) -> dict[str, set[str]]:
  """``{"install_requires": names, "<extra>": names, ...}`` from setup.cfg."""
  parser = configparser.ConfigParser()
  parser.read_string(setup_cfg_text)
  groups = {"install_requires": _requirement_names(
      parser.get("options", "install_requires", fallback=""))}
  if parser.has_section("options.extras_require"):
    for extra, block in parser.items("options.extras_require"):
      groups[extra] = _requirement_names(block)
  return groups


@dataclasses.dataclass(frozen=True)
class Import:
  module: str       # the top-level module name
  path: str         # the importing file, relative to the repository
  line: int
  top_level: bool   # at module level (not inside a function)
  skip_reason: str | None = None  # set for pytest.importorskip(..., reason=)


def _imports_of(source: str, rel: str) -> list[Import]:
  """The imports of one file's text; ``rel`` names the file in messages."""
  tree = ast.parse(source, filename=rel)
  found = []

  def visit(node, in_function: bool):
    for child in ast.iter_child_nodes(node):
      nested = in_function or isinstance(
          child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
      if isinstance(child, ast.Import):
        found.extend(Import(a.name.split(".")[0], rel, child.lineno,
                            not in_function) for a in child.names)
      elif (isinstance(child, ast.ImportFrom) and child.level == 0
            and child.module):
        found.append(Import(child.module.split(".")[0], rel, child.lineno,
                            not in_function))
      elif (isinstance(child, ast.Call)
            and isinstance(child.func, ast.Attribute)
            and child.func.attr == "importorskip" and child.args
            and isinstance(child.args[0], ast.Constant)):
        reason = next((k.value.value for k in child.keywords
                       if k.arg == "reason" and isinstance(k.value, ast.Constant)),
                      None)
        found.append(Import(str(child.args[0].value).split(".")[0], rel,
                            child.lineno, not in_function, reason or None))
      visit(child, nested)

  visit(tree, False)
  return found


def _imports_under(folder: str) -> list[Import]:
  return [imp for path in sorted((REPO / folder).rglob("*.py"))
          for imp in _imports_of(path.read_text(), str(path.relative_to(REPO)))]


@functools.cache
def _local_modules() -> set[str]:
  names = set()
  for path in REPO.rglob("*.py"):
    if any(part.startswith(".") for part in path.relative_to(REPO).parts):
      continue
    names.add(path.stem)
    names.add(path.parent.name)
  return names


@functools.cache
def _installed_distributions() -> dict[str, list[str]]:
  return importlib.metadata.packages_distributions()


def _distributions_of(module: str) -> set[str]:
  dists = _installed_distributions().get(module)
  return {_normalise(d) for d in dists} if dists else {_normalise(module)}


def undeclared(imports, allowed: set[str], local: set[str]) -> list[str]:
  """One message per import whose module no allowed distribution provides."""
  problems = []
  for imp in imports:
    if (imp.module in sys.stdlib_module_names or imp.module in local
        or imp.skip_reason):
      continue
    dists = _distributions_of(imp.module)
    if not dists & allowed:
      problems.append(
          f"{imp.path}:{imp.line} imports {imp.module!r} (installed by "
          f"{', '.join(sorted(dists))}), which setup.cfg does not declare "
          "where this file needs it")
  return problems


def _check(setup_cfg_text: str) -> list[str]:
  groups = declared(setup_cfg_text)
  base = groups["install_requires"]
  any_extra = set().union(*groups.values())
  local = _local_modules()
  test_imports = _imports_under("tests")
  package = _imports_under("ba_jax")
  scripts = _imports_under("experiments") + _imports_under("configs")
  return (undeclared(test_imports, base | groups.get("test", set()), local)
          + undeclared([i for i in package if i.top_level], base, local)
          + undeclared([i for i in package if not i.top_level]
                       + scripts, any_extra, local))


def test_no_requirement_is_listed_twice():
  """A duplicate would hide a removal from the test below (the other line still declares it)."""
  parser = configparser.ConfigParser()
  parser.read_string(SETUP_CFG.read_text())
  blocks = {"install_requires": parser.get("options", "install_requires")}
  blocks.update(parser.items("options.extras_require"))
  for group, block in blocks.items():
    names = [name for line in block.splitlines() for name in _requirement_names(line)]
    twice = sorted({n for n in names if names.count(n) > 1})
    assert not twice, f"setup.cfg lists {twice} more than once in {group}"


def test_every_imported_module_is_declared():
  problems = _check(SETUP_CFG.read_text())
  assert not problems, "\n".join(problems)


def _without(setup_cfg_text: str, group: str, dist: str) -> str:
  """setup.cfg with one requirement line removed from one group."""
  lines = setup_cfg_text.splitlines()
  section = "[options]" if group == "install_requires" else "[options.extras_require]"
  start = lines.index(section)
  in_group = False
  for i in range(start + 1, len(lines)):
    line = lines[i]
    if line.startswith("["):
      break
    if re.match(rf"{group}\s*=", line):
      in_group = True
      continue
    if in_group and line and not line[0].isspace():
      in_group = False
    if in_group and _requirement_names(line) == {_normalise(dist)}:
      return "\n".join(lines[:i] + lines[i + 1:])
  raise AssertionError(f"{dist!r} is not a requirement of {group!r} in setup.cfg")


@pytest.mark.parametrize("group,dist,module", [
    ("test", "peft", "peft"),
    ("test", "chex", "chex"),
    ("test", "tensorstore", "tensorstore"),
    ("install_requires", "scipy", "scipy"),
    ("install_requires", "safetensors", "safetensors"),
])
def test_removing_a_declared_dependency_is_caught(group, dist, module):
  problems = _check(_without(SETUP_CFG.read_text(), group, dist))
  assert problems, f"removing {dist} from {group} went unnoticed"
  assert all(f"imports {module!r}" in p for p in problems), problems


def test_importorskip_needs_a_stated_reason():
  source = ("import pytest\n"
            "pytest.importorskip('undeclared_mod')\n"
            "def f():\n"
            "  pytest.importorskip('optional_mod', reason='optional: X')\n")
  found = _imports_of(source, "tests/probe.py")
  assert [(i.module, i.top_level, i.skip_reason) for i in found] == [
      ("pytest", True, None), ("undeclared_mod", True, None),
      ("optional_mod", False, "optional: X")]
  problems = undeclared(found, {"pytest"}, set())
  assert problems == [
      "tests/probe.py:2 imports 'undeclared_mod' (installed by undeclared-mod), "
      "which setup.cfg does not declare where this file needs it"]


def test_ci_installs_verl_without_its_dependencies():
  """verl pins transformers<5.11, so no setup.cfg group can hold it next to
  ours: .ci/run installs its wheel with --no-deps, and under CI its parity
  tests (tests/test_verl_parity.py) must run, not skip."""
  run = (REPO / ".ci" / "run").read_text()
  assert re.search(r"pip install .*--no-deps verl==\d", run), run
  if os.environ.get("CI") == "true":
    importlib.import_module("verl.trainer.ppo.core_algos")
