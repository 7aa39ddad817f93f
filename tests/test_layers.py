"""The package's import structure: layers, bottom first, and no cycle.

A module may import modules of its own layer or of lower ones, never of a
higher one; within a layer the imports must not form a cycle. Every
``ba_jax/*.py`` module sits in exactly one layer, and README.md's Layout
section lists the same layers (one line each, same modules, same order).
Lazy imports inside functions count too.
"""
import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ba_jax"

LAYERS = (
    ("sandboxed child processes", ("sandbox_launcher", "sandbox_harness")),
    ("the path layer", ("paths",)),
    ("mesh and logical axes", ("sharding",)),
    ("the loss", ("aggregation", "advantages", "losses", "microbatch")),
    ("the policy", ("attention", "kv_cache", "model", "hf",
                    "scoring", "draw", "decoding", "engine", "sampler")),
    ("the update", ("train_step",)),
    ("data, rewards, tasks", ("sandbox", "reward_pool", "rewards", "data",
                              "code_data", "synthetic", "chains",
                              "dataset_task", "reasoning_gym_task", "tasks")),
    ("a run's pieces", ("checkpointing", "metrics", "resume", "rollout",
                        "sft")),
    ("the run builder", ("run_setup",)),
    ("what a command does", ("trainer", "export", "convert_gguf", "eval_lib",
                             "dry_run")),
    ("command lines", ("train", "evaluate")),
)
LAYER_OF = {m: i for i, (_, modules) in enumerate(LAYERS) for m in modules}


def imports_of(path: pathlib.Path) -> set[str]:
  """The ba_jax modules ``path`` imports, wherever the import statement is."""
  found = set()
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      found.update(a.name.split(".")[1] for a in node.names
                   if a.name.startswith("ba_jax."))
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      if node.module == "ba_jax":
        found.update(a.name for a in node.names)
      elif node.module.startswith("ba_jax."):
        found.add(node.module.split(".")[1])
    elif isinstance(node, ast.ImportFrom) and node.level:
      raise AssertionError(f"{path.name}: relative import; use ba_jax.")
  return found


def graph() -> dict[str, set[str]]:
  return {p.stem: imports_of(p) for p in sorted(PACKAGE.glob("*.py"))
          if p.stem != "__init__"}


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


def test_every_module_has_a_layer():
  modules = set(graph())
  assert not modules - set(LAYER_OF), (
      f"place {sorted(modules - set(LAYER_OF))} in LAYERS (and README)")
  assert not set(LAYER_OF) - modules, sorted(set(LAYER_OF) - modules)


def test_no_module_imports_a_higher_layer():
  upward = [f"{m} ({LAYERS[LAYER_OF[m]][0]}) imports {d} "
            f"({LAYERS[LAYER_OF[d]][0]})"
            for m, deps in graph().items() for d in sorted(deps)
            if LAYER_OF[d] > LAYER_OF[m]]
  assert not upward, upward


def test_no_import_cycle():
  assert find_cycle(graph()) is None, find_cycle(graph())


def test_the_checks_catch_what_they_look_for():
  assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c",
                                                             "a"]
  assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_readme_lists_the_layers():
  text = (ROOT / "README.md").read_text()
  section = text.split("## Layout", 1)[1].split("\n## ", 1)[0]
  rows = [re.findall(r"(\w+)\.py", line) for line in section.splitlines()]
  for name, modules in LAYERS:
    assert list(modules) in rows, (
        f"README's Layout lacks the layer {name!r}: a line naming "
        f"{' '.join(m + '.py' for m in modules)}")


def test_checkpointing_knows_nothing_of_ours_but_the_path_layer():
  assert imports_of(PACKAGE / "checkpointing.py") == {"paths"}
