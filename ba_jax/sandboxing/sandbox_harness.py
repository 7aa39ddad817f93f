"""Sandbox stage 2: runs the model's program (see `sandbox_launcher`). Stdlib only.

Started as `python -I harness.py CONFIG` in /sandbox, as the sandbox uid, with
the test data in spec.json (read, then deleted). Three modes:

* "stdin": the program runs as __main__; the caller judges its stdout.
* "call": the program runs, then its entry point is called on each input and
  each result goes back on the result fd as plain data (`to_plain`: builtin
  scalars and containers, rebuilt from their contents; anything else only by
  its type's name). Nothing else is judged here: the expected outputs and any
  reference solution never enter this process, so patching names, builtins or
  modules, or returning objects whose `__eq__` always agrees, cannot pass a
  test (`ba_jax.sandboxing.judge` compares in the caller).
* "assert": test code that only runs as code. Before the program runs, the
  harness takes the run's token from its pipe (and closes it), makes itself
  non-dumpable, compiles the tests, imports what the tests and their trusted
  `context` (e.g. the task's prompt) import and copies those modules and
  builtins, runs the context, resets every Python-level signal handler to the
  default and adds a seccomp filter refusing new signal handlers (a handler gets
  the frame it interrupts, and walking `f_back` from it raises no audit event),
  then an audit hook that refuses frame, gc, ctypes and code-object
  introspection, tracing and further audit hooks. Each test then runs in a fresh
  namespace holding the context, the pristine copies and the program's entry
  point, wrapped so that it gives back (and leaves in its list/dict/set
  arguments) plain data only. The token is written to the result fd only after
  the last assertion ran without raising: exiting 0 early, printing, patching
  `print`, `AssertionError`, `exec`, builtins, modules or `sys.stderr`, objects
  whose `__eq__` always agrees, a thread, signal handlers or reading fds cannot
  produce it; any exception ends the process at once with status 1. What
  remains is code written against this harness by other means: a Python-level
  class or function shared with the module copies and mutated, a test that hands
  the program one of its own functions (whose `__globals__` is the test's
  namespace), crafted bytecode (`marshal`) or a C extension reading raw memory.
  `signal.signal` raises OSError (EPERM) in this mode.
"""
import ast
import builtins
import importlib
import json
import os
import runpy
import sys
import types

MAX_DEPTH = 100  # deeper values are sent as an "object"
_SCALARS = (int, float, complex, str, bytes)
_CONTAINERS = (list, tuple, dict, set, frozenset)


_GUARDS = """
import builtins, io, os, socket

def install(root):
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
"""


def install_guards(root):
  """Defence in depth; the namespaces and the seccomp filter are the containment. Defined in a
  namespace of their own: `open.__globals__` must not lead the program to this module's."""
  namespace = {"__name__": "sandbox_guards"}
  exec(compile(_GUARDS, "<sandbox guards>", "exec"), namespace)
  namespace["install"](root)


# ----------------------------------------------------------------------------- plain data
# Bound now, before the program runs: rebinding builtins cannot reach these.
_type, _len, _hex, _callable, _getattr = type, len, hex, callable, getattr
_int_value, _float_hex, _bytes_hex = int.__index__, float.hex, bytes.hex
_str_value = str.__str__
_complex_real, _complex_imag = complex.real.__get__, complex.imag.__get__
_iterate = {list: list.__iter__, tuple: tuple.__iter__, set: set.__iter__,
            frozenset: frozenset.__iter__}
_dict_items = dict.items
_PLAIN_TYPES = frozenset((type(None), bool) + _SCALARS + _CONTAINERS)


class NotPlain(TypeError):
  pass


def _plain_base(value):
  """The builtin plain type `value` is (or derives from), else None."""
  kind = _type(value)
  if kind in _PLAIN_TYPES:
    return kind
  for base in _type.__dict__["__mro__"].__get__(kind):
    if base in _PLAIN_TYPES and base is not bool:
      return base
  return None


def _has_tolist(value):
  """numpy's scalars and arrays (and anything else with `tolist`) are read as what it gives."""
  return _callable(_getattr(_type(value), "tolist", None))


def _tolist(value):
  return _type(value).tolist(value)


def to_plain(value, depth=0):
  """A JSON-ready image of `value`: null/true/false/str/small ints as themselves, everything
  else as [tag, ...]. Subclasses of builtin types are read through the base type's methods."""
  base = _plain_base(value)
  if base is None and depth <= MAX_DEPTH and _has_tolist(value):
    return to_plain(_tolist(value), depth + 1)
  if base is None or depth > MAX_DEPTH:
    name = _type.__dict__["__name__"].__get__(_type(value))
    return ["object", name if depth <= MAX_DEPTH else f"nested deeper than {MAX_DEPTH}"]
  if value is None or base is bool:
    return value
  if base is int:
    number = _int_value(value)
    return number if -(1 << 53) < number < (1 << 53) else ["int", _hex(number)]
  if base is float:
    return ["float", _float_hex(value)]
  if base is str:
    return _str_value(value)
  if base is bytes:
    return ["bytes", _bytes_hex(value)]
  if base is complex:
    return ["complex", _float_hex(_complex_real(value)), _float_hex(_complex_imag(value))]
  if base is dict:
    return ["dict"] + [[to_plain(k, depth + 1), to_plain(v, depth + 1)]
                       for k, v in _dict_items(value)]
  return [base.__name__] + [to_plain(item, depth + 1) for item in _iterate[base](value)]


def plain_copy(value, depth=0):
  """A fresh copy of `value` made of exact builtin types; raises NotPlain for anything else."""
  base = _plain_base(value)
  if base is None and depth <= MAX_DEPTH and _has_tolist(value):
    return plain_copy(_tolist(value), depth + 1)
  if base is None or depth > MAX_DEPTH:
    name = _type.__dict__["__name__"].__get__(_type(value))
    raise NotPlain(f"sandbox: the entry point gave a {name} object; assertion tests compare "
                   "plain data only (builtin numbers, strings, bytes and containers)")
  if value is None or base is bool:
    return value
  if base is int:
    return _int_value(value)
  if base is float:
    return float.fromhex(_float_hex(value))
  if base is str:
    return _str_value(value)[:]
  if base is bytes:
    return bytes.fromhex(_bytes_hex(value))
  if base is complex:
    return complex(_complex_real(value), _complex_imag(value))
  if base is dict:
    return {plain_copy(k, depth + 1): plain_copy(v, depth + 1) for k, v in _dict_items(value)}
  items = [plain_copy(item, depth + 1) for item in _iterate[base](value)]
  return items if base is list else base(items)


def _is_plain(value):
  try:
    plain_copy(value)
    return True
  except (NotPlain, RecursionError):
    return False


def launder(function):
  """`function` as the tests see it: its result, and what it left in list/dict/set arguments
  that were plain data, are copied into exact builtin types (objects whose comparisons
  always agree do not survive the copy)."""
  def entry_point(*args, **kwargs):
    mutable = [a for a in args if _type(a) in (list, dict, set) and _is_plain(a)]
    result = function(*args, **kwargs)
    for argument in mutable:
      fresh = plain_copy(argument)
      if _type(argument) is list:
        list.__setitem__(argument, slice(None), fresh)
      else:
        _type(argument).clear(argument)
        _type(argument).update(argument, fresh)
    return plain_copy(result)

  return entry_point


# ----------------------------------------------------------------------------- modes


def _exec_program(exec_, compile_):
  with open("solution.py", encoding="utf-8") as f:
    source = f.read()
  module = types.ModuleType("__main__")
  module.__file__ = os.path.abspath("solution.py")
  sys.modules["__main__"] = module
  exec_(compile_(source, "solution.py", "exec", dont_inherit=True, optimize=0), module.__dict__)
  return module.__dict__


def run_calls(spec, result_fd, max_bytes):
  """Calls the entry point on each input; writes {"outputs": [...]} (plain data) to result_fd."""
  exit_, write, dumps = os._exit, os.write, json.dumps
  namespace = _exec_program(exec, compile)
  target = namespace[spec["class"]]() if spec["class"] else None
  entry = getattr(target, spec["entry"]) if target is not None else namespace[spec["entry"]]
  outputs = []
  for arguments in spec["inputs"]:
    try:
      value = entry(*arguments)
    except BaseException as e:  # noqa: BLE001 -- SystemExit included: the call failed
      outputs.append({"raised": _type.__dict__["__name__"].__get__(_type(e))})
      break
    outputs.append({"value": to_plain(value)})
  text = dumps({"outputs": outputs}).encode()
  if _len(text) > max_bytes:
    text = dumps({"error": f"the outputs take {_len(text)} bytes, over the {max_bytes} "
                           "byte limit"}).encode()
  view = memoryview(text)
  while view:
    view = view[write(result_fd, view):]
  try:
    sys.stdout.flush()
  finally:
    exit_(0)


# What a program could read the tests, their namespace or the harness's state through
# (frames, the garbage collector, raw memory, crafted bytecode), see the tests' code with
# (an audit hook of its own) or jump over an assertion with (tracing). Refused while
# assertion tests run; there is no /proc in the sandbox, so no /proc/self/mem either.
_REFUSED_EVENTS = frozenset({
    "sys.settrace", "sys.setprofile", "sys.monitoring.register_callback", "sys.addaudithook",
    "sys._current_frames", "gc.get_objects", "gc.get_referrers", "gc.get_referents",
    "code.__new__"})
_FRAME_ATTRIBUTES = frozenset({"tb_frame", "gi_frame", "cr_frame", "ag_frame"})


def _refuse_introspection(event, args, refused=_REFUSED_EVENTS, frames=_FRAME_ATTRIBUTES,
                          value_error=ValueError, runtime_error=RuntimeError):
  # Only str/tuple/frozenset methods and default arguments: nothing the program can rebind.
  if event == "sys._getframe":  # ValueError: what callers (namedtuple, typing, logging) expect
    raise value_error("sandbox: frame introspection is not allowed while tests run")
  if event in refused or event.startswith("ctypes.") or (
      event == "object.__getattr__" and args[1] in frames):
    raise runtime_error(f"sandbox: {event} is not allowed while assertion tests run")


def _not_dumpable():
  """No other process of the run (same uid) may read this one's memory or fds (prctl)."""
  import ctypes
  if ctypes.CDLL(None, use_errno=True).prctl(4, ctypes.c_ulong(0), 0, 0, 0) != 0:  # DUMPABLE
    raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0)")


def _refuse_signal_handlers(code):
  """No Python-level signal handler is left (SIGINT's included), and the kernel refuses new
  ones (`code`: the caller's `sandbox_seccomp.signal_program`); no_new_privs is already set."""
  import ctypes
  import signal
  for number in signal.valid_signals():
    try:
      if _callable(signal.getsignal(number)):
        signal.signal(number, signal.SIG_DFL)
    except (ValueError, OSError):
      pass

  class SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte),
                ("k", ctypes.c_uint32)]

  class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(SockFilter))]

  filters = (SockFilter * len(code))(*[SockFilter(*instruction) for instruction in code])
  program = SockFprog(len(code), filters)
  ulong = ctypes.c_ulong
  libc = ctypes.CDLL(None, use_errno=True)
  if libc.prctl(22, ulong(2), ctypes.byref(program), ulong(0), ulong(0)) != 0:  # SECCOMP_FILTER
    raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP) for the signal filter")


def _imports(sources):
  """Absolute module names imported anywhere in `sources` (trusted test and context code)."""
  names = set()
  for source in sources:
    try:
      tree = ast.parse(source)
    except (SyntaxError, ValueError):
      continue
    for node in ast.walk(tree):
      if isinstance(node, ast.Import):
        names.update(alias.name for alias in node.names)
      elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        names.add(node.module)
        names.update(f"{node.module}.{alias.name}" for alias in node.names)
  return names


def pristine_builtins(module_names):
  """A copy of builtins whose `__import__` gives copies of `module_names`, all taken now."""
  copies = {}
  for name in sorted(module_names):
    parts = name.split(".")
    for i in range(1, len(parts) + 1):
      full = ".".join(parts[:i])
      if full in copies:
        continue
      try:
        module = importlib.import_module(full)
      except BaseException:  # noqa: BLE001 -- not a module (from a import name), or missing
        break
      copy = types.ModuleType(full)
      copy.__dict__.update(module.__dict__)
      copies[full] = copy
      if i > 1:
        setattr(copies[".".join(parts[:i - 1])], parts[i - 1], copy)
  real_import = builtins.__import__

  def pristine_import(name, globals=None, locals=None, fromlist=(), level=0):
    if level == 0 and name in copies:
      return copies[name] if fromlist else copies[name.partition(".")[0]]
    return real_import(name, globals, locals, fromlist, level)

  namespace = dict(builtins.__dict__)
  namespace["__import__"] = pristine_import
  return namespace


def _free_names(source):
  try:
    tree = ast.parse(source)
  except (SyntaxError, ValueError):
    return set()
  loaded, stored = set(), set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Name):
      (loaded if isinstance(node.ctx, ast.Load) else stored).add(node.id)
    elif isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
      stored.add(node.name)
  return loaded - stored


def run_assertions(spec, token_fd, result_fd, signal_filter):
  # Bound before the program runs, so that rebinding names in builtins/os cannot touch them.
  exit_, write, exec_, exc_info = os._exit, os.write, exec, sys.exc_info
  print_exc = sys.__excepthook__  # C: prints a traceback without reading frames from Python
  # The token is read now and its pipe closed: the program holds no fd to read it from, and
  # reaching this frame's locals needs the introspection the audit hook refuses, or a signal
  # handler, which the seccomp filter refuses.
  token = os.read(token_fd, 256)
  os.close(token_fd)
  _not_dumpable()
  tests = tuple(spec["tests"])
  clean = pristine_builtins(_imports([t["code"] for t in tests] + [t["context"] for t in tests]))
  codes = [compile(t["code"], f"<test {i}>", "exec", dont_inherit=True, optimize=0)
           for i, t in enumerate(tests)]  # now: the program's audit hooks never see the source
  contexts = {}
  for test in tests:  # the task's own code (e.g. the prompt's helpers), run before the program
    if test["context"] and test["context"] not in contexts:
      namespace = {"__builtins__": clean, "__name__": "__context__"}
      try:
        exec_(compile(test["context"], "<context>", "exec", dont_inherit=True), namespace)
      except BaseException:  # noqa: BLE001 -- a prompt that is no program alone: no helpers
        print_exc(*exc_info())
      contexts[test["context"]] = namespace
  free_names = [_free_names(t["code"]) if t["entry"] is None else None for t in tests]
  _refuse_signal_handlers(signal_filter)
  sys.addaudithook(_refuse_introspection)  # cannot be removed once added
  try:
    program = _exec_program(exec_, compile)
    for i, test in enumerate(tests):
      namespace = {"__builtins__": clean}
      namespace.update(contexts.get(test["context"], {}))
      namespace["__name__"] = "__test__"
      entries = test["entry"]
      if entries is None:  # names the test reads that only the program defines
        entries = [n for n in free_names[i]
                   if n in program and n not in clean and n not in namespace]
      for name in entries:
        if name in program:
          value = program[name]
          namespace[name] = launder(value) if _callable(value) \
              else plain_copy(value)
      exec_(codes[i], namespace)
  except BaseException:  # noqa: BLE001 -- SystemExit included: leaving early is failing
    try:
      print_exc(*exc_info())
      sys.stderr.flush()
    finally:
      exit_(1)
  write(result_fd, token)
  try:
    sys.stdout.flush()
  finally:
    exit_(0)


def main():
  cfg = json.loads(sys.argv[1])
  root = os.path.realpath(os.getcwd())
  spec = None
  if cfg["spec_file"]:
    with open(cfg["spec_file"], encoding="utf-8") as f:
      spec = json.load(f)
    os.unlink(cfg["spec_file"])  # the program cannot read the data it is judged by
  if cfg["guards"]:
    install_guards(root)
  sys.argv = ["solution.py"]
  if cfg["mode"] != "stdin":
    # Only the task's modules are imported by name before the program runs, not its files.
    sys.path[:] = [p for p in sys.path if os.path.realpath(p or ".") != root]
    if hasattr(sys, "set_int_max_str_digits"):
      sys.set_int_max_str_digits(0)  # EvalPlus has huge integers
  if cfg["mode"] == "call":
    run_calls(spec, cfg["result_fd"], cfg["max_result_bytes"])
  elif cfg["mode"] == "assert":
    run_assertions(spec, cfg["token_fd"], cfg["result_fd"], cfg["signal_filter"])
  else:
    runpy.run_path("solution.py", run_name="__main__")


if __name__ == "__main__":
  main()
