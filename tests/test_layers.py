"""The package's import structure: subpackages along the real import graph.

Two columns meet only in ``run``: the model and generation column (``loss``,
``policy``, ``generation``, ``update``) and the data and reward column
(``sandboxing``, ``tasks``); neither imports the other. ``config`` (the
schema) sits under both; ``scaling`` (the dry run), ``ablation`` (the
ablation runner, whose runs are ``ba_jax.train`` processes) and the command
modules at the top (``ba_jax/*.py``) may use anything below them. Each package may import
only the packages ``ALLOWED`` names (and itself), lazy imports included, and no
module-level import cycle exists. README.md's Layout section names every
package and module.
"""
import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ba_jax"

MODEL_COLUMN = ("loss", "policy", "generation", "update")
DATA_COLUMN = ("sandboxing", "tasks")
# package -> the packages it may import (besides itself).
ALLOWED = {
    "config": set(),
    "loss": {"config"},
    "policy": {"config"},
    "generation": {"config", "policy"},
    "update": {"config", "loss", "policy"},
    "sandboxing": {"config"},
    "tasks": {"config", "sandboxing"},
    "run": {"config", "loss", "policy", "generation", "update", "sandboxing",
            "tasks"},
    "scaling": {"config", "policy", "generation", "update", "run"},
    "ablation": {"config", "run"},
}
COMMANDS = ("train", "evaluate", "export", "dry_run", "convert_gguf",
            "accelerator_check", "ablate")


def module_name(path: pathlib.Path) -> str:
  """``ba_jax/run/trainer.py`` -> ``run.trainer``; ``ba_jax/train.py`` ->
  ``train``."""
  parts = path.relative_to(PACKAGE).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: pathlib.Path) -> set[str]:
  """The ba_jax modules ``path`` imports (as ``module_name`` gives them),
  wherever the import statement is."""
  modules = {module_name(p) for p in PACKAGE.rglob("*.py")}
  found = set()
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.ImportFrom) and node.level:
      raise AssertionError(f"{path}: relative import; use ba_jax.")
    if isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module:
      # ``from ba_jax.run import paths`` imports the module run.paths;
      # ``from ba_jax.run.paths import path`` imports run.paths too.
      names = [f"{node.module}.{a.name}" for a in node.names]
    else:
      continue
    for name in names:
      if name.startswith("ba_jax."):
        name = name[len("ba_jax."):]
        while name and name not in modules:
          name = name.rpartition(".")[0]
        if name:
          found.add(name)
  return found


def graph() -> dict[str, set[str]]:
  return {module_name(p): imports_of(p) - {module_name(p)}
          for p in sorted(PACKAGE.rglob("*.py")) if module_name(p)}


def package_of(module: str) -> str:
  return module.split(".")[0]


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
  """One import cycle as a list of modules, or None."""
  state: dict[str, int] = {}  # 1: on the current path, 2: done
  path: list[str] = []

  def visit(node):
    state[node] = 1
    path.append(node)
    for dep in sorted(edges.get(node, ())):
      if state.get(dep) == 1:
        return path[path.index(dep):] + [dep]
      if dep not in state:
        cycle = visit(dep)
        if cycle:
          return cycle
    state[node] = 2
    path.pop()
    return None

  for node in sorted(edges):
    if node not in state:
      cycle = visit(node)
      if cycle:
        return cycle
  return None


def test_every_module_is_in_a_package_or_a_command():
  top = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__")
  assert top == sorted(COMMANDS), (
      "ba_jax/*.py holds only the command modules; move the logic of "
      f"{sorted(set(top) - set(COMMANDS))} into a package")
  packages = sorted(p.name for p in PACKAGE.iterdir()
                    if (p / "__init__.py").is_file())
  assert packages == sorted(ALLOWED), (packages, sorted(ALLOWED))


def test_each_package_says_what_it_owns_and_may_import():
  for name, allowed in ALLOWED.items():
    doc = ast.get_docstring(ast.parse(
        (PACKAGE / name / "__init__.py").read_text())) or ""
    assert len(doc.split()) >= 12, f"ba_jax/{name}/__init__.py: no docstring"
    said = set(re.findall(r"May import: ([^.]*)\.", doc.replace("\n", " "))
               [0].replace(",", " ").replace("nothing", "").split()
               ) if "May import:" in doc else None
    assert said == allowed, (
        f"ba_jax/{name}/__init__.py should end 'May import: "
        f"{', '.join(sorted(allowed)) or 'nothing'}.' (says {said})")


def test_packages_import_only_what_they_may():
  wrong = []
  for module, deps in graph().items():
    if module in COMMANDS:
      assert not deps & set(COMMANDS), (module, deps & set(COMMANDS))
      continue
    pkg = package_of(module)
    for dep in sorted(deps):
      if package_of(dep) in COMMANDS:
        wrong.append(f"{module} imports the command {dep}")
      elif package_of(dep) != pkg and package_of(dep) not in ALLOWED[pkg]:
        wrong.append(f"{module} imports {dep}")
  assert not wrong, wrong


def test_the_columns_never_import_each_other():
  for a, b in ((MODEL_COLUMN, DATA_COLUMN), (DATA_COLUMN, MODEL_COLUMN)):
    for pkg in a:
      assert not ALLOWED[pkg] & set(b), (pkg, ALLOWED[pkg] & set(b))


def test_no_import_cycle():
  assert find_cycle(graph()) is None, find_cycle(graph())


def test_the_checks_catch_what_they_look_for():
  assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c",
                                                             "a"]
  assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None
  assert package_of("run.trainer") == "run"


def test_readme_draws_every_package():
  text = (ROOT / "README.md").read_text()
  section = text.split("## Layout", 1)[1].split("\n## ", 1)[0]
  for name in ALLOWED:
    modules = sorted(p.stem for p in (PACKAGE / name).glob("*.py")
                     if p.stem != "__init__")
    assert f"{name}/" in section, f"README's Layout lacks the package {name}/"
    missing = [m for m in modules if not re.search(rf"\b{m}\b", section)]
    assert not missing, f"README's Layout lacks {name}/{missing}"


def test_checkpointing_knows_nothing_of_ours_but_the_path_layer():
  # ("run" is the package of the two, named by ``from ba_jax.run import``.)
  assert imports_of(PACKAGE / "run" / "checkpointing.py") - {"run"} == {
      "run.paths", "run.digest"}
  assert imports_of(PACKAGE / "run" / "digest.py") == set()
