"""Outputs of a call test, read and judged in the caller, where the program cannot reach.

The harness (`sandbox_harness.to_plain`) sends each result as JSON: null, true,
false, strings and small ints as themselves, everything else as a list headed
by a tag ("int", "float", "complex", "bytes", "list", "tuple", "set",
"frozenset", "dict", or "object" with a type name). `decode` rebuilds builtin
values (an "object" becomes an `Opaque`, equal to nothing) and refuses
anything malformed, too deep or too large; `same` applies a benchmark's rule:

  * "exact": `==` on the rebuilt values;
  * "lcb": LiveCodeBench's, a top-level tuple read as a list, then `==`;
  * "evalplus": EvalPlus', `==`, else (atol given, or 1e-6 for float
    outputs) the same type, the same length and allclose (rtol 1e-7);
  * "set", "not_none": EvalPlus' oracles for MBPP+ tasks compared as sets or
    only for being None; "find_zero": HumanEval/32's, |poly(xs, out)| <= atol.
"""
from __future__ import annotations

import json
import math

RULES = ("exact", "lcb", "evalplus", "set", "not_none", "find_zero")
MAX_DEPTH = 101  # the harness sends up to 100 levels, then an "object"
MAX_INT_HEX_DIGITS = 1 << 20


class Opaque:
  """A value the program returned that is not plain data: equal to nothing but itself."""
  __slots__ = ("type_name",)

  def __init__(self, type_name: str):
    self.type_name = type_name

  def __repr__(self):
    return f"<{self.type_name} object>"


class Malformed(ValueError):
  pass


_SEQUENCES = {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset}


def _value(node, depth):
  if depth > MAX_DEPTH:
    raise Malformed(f"nested deeper than {MAX_DEPTH}")
  if node is None or type(node) in (bool, str, int):
    return node
  if type(node) is not list or not node or type(node[0]) is not str:
    raise Malformed(f"unexpected {type(node).__name__}")
  tag, items = node[0], node[1:]
  if tag in _SEQUENCES:
    return _SEQUENCES[tag](_value(item, depth + 1) for item in items)
  if tag == "dict":
    if not all(type(item) is list and len(item) == 2 for item in items):
      raise Malformed("dict items must be [key, value] pairs")
    return {_value(k, depth + 1): _value(v, depth + 1) for k, v in items}
  if len(items) not in (1, 2) or not all(type(item) is str for item in items):
    raise Malformed(f"bad {tag!r} value")
  if tag == "int" and len(items) == 1 and len(items[0]) <= MAX_INT_HEX_DIGITS:
    return int(items[0], 16)  # a power-of-two base: linear, and no digit limit
  if tag == "float" and len(items) == 1:
    return float.fromhex(items[0])
  if tag == "complex" and len(items) == 2:
    return complex(float.fromhex(items[0]), float.fromhex(items[1]))
  if tag == "bytes" and len(items) == 1:
    return bytes.fromhex(items[0])
  if tag == "object" and len(items) == 1:
    return Opaque(items[0][:100])
  raise Malformed(f"unknown tag {tag!r}")


def decode(data: bytes, count: int) -> list:
  """The harness's result file -> `count` items, each ("value", v) or ("raised", name).

  Fewer items than `count` means the program stopped (an exception ends the run);
  raises Malformed on anything the harness would not have written."""
  try:
    document = json.loads(data.decode("utf-8"))
  except (UnicodeDecodeError, ValueError, RecursionError) as e:
    raise Malformed(f"not the harness's JSON ({type(e).__name__})") from None
  if type(document) is not dict:
    raise Malformed("not the harness's JSON")
  if "error" in document:
    raise Malformed(str(document["error"])[:200])
  outputs = document.get("outputs")
  if type(outputs) is not list or len(outputs) > count:
    raise Malformed(f"expected up to {count} outputs")
  items = []
  try:
    for item in outputs:
      if type(item) is dict and set(item) == {"value"}:
        items.append(("value", _value(item["value"], 0)))
      elif type(item) is dict and set(item) == {"raised"} and type(item["raised"]) is str:
        items.append(("raised", item["raised"][:100]))
      else:
        raise Malformed("an output is neither a value nor an exception")
  except (TypeError, ValueError, OverflowError, RecursionError) as e:  # e.g. a set of lists
    raise Malformed(f"{type(e).__name__}: {e}"[:200]) from None
  return items


def _is_floats(x) -> bool:
  if isinstance(x, float):
    return True
  return isinstance(x, (list, tuple)) and len(x) > 0 and all(isinstance(i, float) for i in x)


def _allclose(out, exp, atol, rtol=1e-7) -> bool:
  if isinstance(exp, (list, tuple)):
    return (isinstance(out, (list, tuple)) and len(out) == len(exp)
            and all(_allclose(o, e, atol, rtol) for o, e in zip(out, exp)))
  if isinstance(out, (list, tuple, dict, set, frozenset, str, bytes, Opaque)):
    return False
  if isinstance(out, (int, float)) and isinstance(exp, (int, float)) and \
      math.isinf(out) and math.isinf(exp):
    return out == exp
  return abs(out - exp) <= atol + rtol * abs(exp)


def _evalplus_same(out, exp, atol) -> bool:
  if out == exp:
    return True
  if atol == 0 and _is_floats(exp):
    atol = 1e-6
  if atol == 0 or type(out) is not type(exp):
    return False
  if isinstance(exp, (list, tuple)) and len(out) != len(exp):
    return False
  return _allclose(out, exp, atol)


def same(out, exp, rule: str, *, atol: float = 0.0, arguments=None) -> bool:
  """Whether output `out` passes against expected `exp` under `rule` (see the module doc)."""
  try:
    if rule == "exact":
      return out == exp
    if rule == "lcb":
      return (list(out) if type(out) is tuple else out) == exp
    if rule == "evalplus":
      return _evalplus_same(out, exp, atol)
    if rule == "set":
      return _evalplus_same(set(out), set(exp), atol)
    if rule == "not_none":
      return _evalplus_same(out is not None, exp is not None, atol)
    if rule == "find_zero":
      x = float(out)  # bounded work whatever the program sent
      return abs(sum(c * x ** k for k, c in enumerate(arguments[0]))) <= atol
  except (TypeError, ValueError, OverflowError, ZeroDivisionError, RecursionError):
    return False
  raise ValueError(f"unknown comparison rule {rule!r}; expected one of {RULES}")


def preview(value, limit: int = 120) -> str:
  """A short repr of a decoded value, for messages."""
  try:
    text = repr(value)
  except (RecursionError, ValueError):  # ValueError: an int too long for repr
    text = f"<{type(value).__name__}>"
  return text if len(text) <= limit else text[:limit] + "..."
