"""Sandbox stage 2: runs the model's program in its namespaces (see `sandbox_launcher`). Stdlib only.

Started as `python -I harness.py CONFIG` in the run's dir, as the sandbox uid.
With stdin/stdout tests the program simply runs; its output is the evidence.

With assertion tests, passing needs evidence the program cannot forge: the
sandbox writes a per-run random token into a pipe, and only after the last
assertion ran without raising does the harness read it and write it to a
result pipe. The token is nowhere in the process (not in its files, argv,
environment or memory) until then, so exiting 0 early (`sys.exit`,
`os._exit`, `atexit`, SystemExit caught in a `try`), printing, patching
`print`/`sys.stdout`/`AssertionError`/`exec`, or a thread, cannot produce
it; any exception ends the process at once with status 1, so no hook of the
program runs after a failed assertion, and trace functions (which could jump
over an assertion) are refused. What remains is code written against this
harness: reading the token pipe itself, or rewriting the interpreter's memory.
"""
import builtins
import io
import json
import os
import runpy
import socket
import sys
import traceback
import types


def install_guards(root):
  """Defence in depth; the namespaces are the containment."""
  _open = builtins.open

  def guarded_open(file, mode="r", *args, **kwargs):
    if not isinstance(file, int) and any(c in mode for c in "wax+"):
      path = os.path.realpath(os.fsdecode(file))
      if path != root and not path.startswith(root + os.sep):
        raise PermissionError(f"sandbox: writing outside {root} is not allowed: {path}")
    return _open(file, mode, *args, **kwargs)

  builtins.open = io.open = guarded_open

  class NoNetwork(socket.socket):
    def __init__(self, family=-1, *args, **kwargs):
      if family != socket.AF_UNIX:
        raise PermissionError("sandbox: network access is not allowed")
      super().__init__(family, *args, **kwargs)

  socket.socket = NoNetwork


_BLOCKED_EVENTS = frozenset({"sys.settrace", "sys.setprofile", "sys.monitoring.register_callback"})


def _refuse_tracing(event, args):
  # A trace function may jump over lines (an assertion) or rewrite the harness's locals.
  if event in _BLOCKED_EVENTS:
    raise RuntimeError(f"sandbox: {event} is not allowed while assertion tests run")


def run_assertions(tests, token_fd, result_fd):
  # Bound before the program runs, so that rebinding names in builtins/os cannot touch them.
  exit_, read, write, compile_, exec_ = os._exit, os.read, os.write, compile, exec
  print_exc = traceback.print_exc
  with open("solution.py", encoding="utf-8") as f:
    source = f.read()
  sys.addaudithook(_refuse_tracing)  # cannot be removed once added
  module = types.ModuleType("__main__")
  module.__file__ = os.path.abspath("solution.py")
  sys.modules["__main__"] = module
  try:
    exec_(compile_(source, "solution.py", "exec", dont_inherit=True, optimize=0), module.__dict__)
    for i, test in enumerate(tests):
      exec_(compile_(test, f"<test {i}>", "exec", dont_inherit=True, optimize=0), module.__dict__)
  except BaseException:  # noqa: BLE001 -- SystemExit included: leaving early is failing
    try:
      print_exc()
      sys.stderr.flush()
    finally:
      exit_(1)
  write(result_fd, read(token_fd, 256))
  try:
    sys.stdout.flush()
  finally:
    exit_(0)


def main():
  cfg = json.loads(sys.argv[1])
  root = os.path.realpath(os.getcwd())
  tests = None
  if cfg["tests_file"]:
    with open(cfg["tests_file"], encoding="utf-8") as f:
      tests = tuple(json.load(f))  # immutable: the program cannot empty it
    os.unlink(cfg["tests_file"])  # the program cannot read the assertions it is judged by
  if cfg["guards"]:
    install_guards(root)
  sys.argv = ["solution.py"]
  if tests is None:
    runpy.run_path("solution.py", run_name="__main__")
  else:
    run_assertions(tests, cfg["token_fd"], cfg["result_fd"])


if __name__ == "__main__":
  main()
