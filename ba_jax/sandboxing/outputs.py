"""Outputs of a call test, read and judged in the caller, where the program cannot reach.

The harness (`sandbox_harness.to_plain`) sends each result as JSON: null, true,
false, strings and small ints as themselves, everything else as a list headed
by a tag ("int", "float", "complex", "bytes", "list", "tuple", "set",
"frozenset", "dict", or "object" with a type name). `decode` rebuilds builtin
values (an "object" becomes an `Opaque`, equal to nothing; a set or a dict
becomes a `PlainSet` or `PlainDict`) and refuses anything malformed; `same`
applies a benchmark's rule:

  * "exact": `==` on the rebuilt values;
  * "lcb": LiveCodeBench's, a top-level tuple read as a list, then `==`;
  * "evalplus": EvalPlus', `==`, else (atol given, or 1e-6 for float
    outputs) the same type, the same length and `numpy.allclose` (rtol 1e-7);
  * "set", "not_none": EvalPlus' oracles for MBPP+ tasks compared as sets or
    only for being None; "find_zero": HumanEval/32's, |poly(xs, out)| <= atol.

Non-finite values compare as those checkers do: an infinity equals only the same
infinity (within any tolerance too), NaN equals nothing. No hash table is ever
keyed by what the program sent (ints that all hash alike would make one
quadratic): sets, dicts and `==` go through `canonical`, an order-independent
encoding compared and sorted without hashing. Decoding and comparing one run's
outputs have a `Budget` (values visited, depth, seconds) whatever the program
sent; going over it raises `OverBudget`, whose `reason` the sample is rejected
with.
"""
from __future__ import annotations

import cmath
import json
import math
import reprlib
import time

RULES = ("exact", "lcb", "evalplus", "set", "not_none", "find_zero")
MAX_DEPTH = 101  # the harness sends up to 100 levels, then an "object"
MAX_INT_HEX_DIGITS = 1 << 20
MAX_NODES = 1 << 24  # values visited: twice as many as 16 MB of JSON holds
JUDGE_TIME_S = 10.0
_CLOCK_EVERY = 1 << 10  # values visited between two looks at the clock


class Malformed(ValueError):
  pass


class OverBudget(Malformed):
  """Decoding or comparing went over its `Budget`; `reason` names which part."""

  def __init__(self, reason: str, message: str):
    super().__init__(message)
    self.reason = reason


class Budget:
  """Values visited, nesting depth and seconds that decoding (or comparing) may take."""

  def __init__(self, nodes: int = MAX_NODES, time_s: float = JUDGE_TIME_S,
               depth: int = MAX_DEPTH):
    self.nodes, self.depth, self.time_s = int(nodes), int(depth), float(time_s)
    self.left = self.nodes
    self.deadline = time.monotonic() + self.time_s

  def visit(self, depth: int) -> None:
    self.left -= 1
    if depth > self.depth:
      raise OverBudget("judge_too_deep", f"the output is nested deeper than {self.depth}")
    if self.left < 0:
      raise OverBudget("judge_too_large", f"the output holds more than {self.nodes} values")
    if self.left % _CLOCK_EVERY == 0 and time.monotonic() > self.deadline:
      raise OverBudget("judge_timeout", f"judging the output took over {self.time_s:g}s")


class Opaque:
  """A value the program returned that is not plain data: equal to nothing but itself."""
  __slots__ = ("type_name",)

  def __init__(self, type_name: str):
    self.type_name = type_name

  def __repr__(self):
    return f"<{self.type_name} object>"


class PlainSet:
  """A set or frozenset the program returned: its distinct items in canonical order. Equal
  (`==`) to a set, frozenset or PlainSet with the same items, as Python's sets are."""
  __slots__ = ("items", "frozen", "key")
  __hash__ = None  # never a hash table key: see the module doc

  def __init__(self, items: list, frozen: bool, budget: Budget, depth: int = 0):
    keyed = sorted(((canonical(item, budget, depth + 1, hashable=True), i)
                    for i, item in enumerate(items)), key=lambda pair: pair[0])
    distinct = [pair for j, pair in enumerate(keyed) if j == 0 or pair[0] != keyed[j - 1][0]]
    self.items = tuple(items[i] for _, i in distinct)
    self.frozen = frozen
    self.key = ("S", tuple(k for k, _ in distinct))

  def __eq__(self, other):
    if not isinstance(other, (PlainSet, set, frozenset)):
      return NotImplemented
    return self.key == canonical(other, Budget())

  def __iter__(self):
    return iter(self.items)

  def __len__(self):
    return len(self.items)

  def __repr__(self):
    inner = ", ".join(map(repr, self.items))
    return f"frozenset({{{inner}}})" if self.frozen else f"{{{inner}}}" if inner else "set()"


class PlainDict:
  """A dict the program returned: (key, value) pairs in canonical key order, the last value
  kept for equal keys (as `dict(pairs)` does). Equal to a dict or PlainDict like a dict."""
  __slots__ = ("items", "key")
  __hash__ = None

  def __init__(self, pairs: list, budget: Budget, depth: int = 0):
    keyed = sorted(((canonical(k, budget, depth + 1, hashable=True), i)
                    for i, (k, _) in enumerate(pairs)), key=lambda pair: pair[0])
    items, keys, start = [], [], 0
    while start < len(keyed):  # a run of equal keys, in the order they came (a stable sort)
      end = start
      while end + 1 < len(keyed) and keyed[end + 1][0] == keyed[start][0]:
        end += 1
      value = pairs[keyed[end][1]][1]
      items.append((pairs[keyed[start][1]][0], value))
      keys.append((keyed[start][0], canonical(value, budget, depth + 1)))
      start = end + 1
    self.items, self.key = tuple(items), ("d", tuple(keys))

  def __eq__(self, other):
    if not isinstance(other, (PlainDict, dict)):
      return NotImplemented
    return self.key == canonical(other, Budget())

  def __len__(self):
    return len(self.items)

  def __repr__(self):
    return "{" + ", ".join(f"{k!r}: {v!r}" for k, v in self.items) + "}"


class Unhashable(TypeError):
  pass


def _number(value):
  """The canonical key of a real or complex number: equal exactly when Python's `==` is."""
  if isinstance(value, complex):
    if cmath.isnan(value):
      return ("nan", id(value))
    if value.imag == 0:
      return ("n", value.real)
    return ("c", value.real, value.imag)
  if isinstance(value, float) and math.isnan(value):
    return ("nan", id(value))  # equal to nothing (but itself, as in a container's `==`)
  return ("n", value)  # ints, bools, floats: 1 == 1.0 == True, and these tuples agree


def canonical(value, budget: Budget, depth: int = 0, hashable: bool = False):
  """A tuple encoding `value` such that two encodings are equal exactly when the values are
  `==` (sets and dicts by their sorted items), and any two can be ordered. With `hashable`,
  raises Unhashable where Python could not hash the value (a set item, a dict key)."""
  budget.visit(depth)
  kind = type(value)
  if value is None:
    return ("None",)
  if kind in (bool, int, float, complex):
    return _number(value)
  if kind is str:
    return ("s", value)
  if kind is bytes:
    return ("b", value)
  if kind is tuple or kind is list:
    if hashable and kind is list:
      raise Unhashable("unhashable type: 'list'")
    return ("t" if kind is tuple else "l",
            tuple(canonical(item, budget, depth + 1, hashable) for item in value))
  if kind is PlainSet or kind is PlainDict:
    if hashable and not (kind is PlainSet and value.frozen):
      raise Unhashable(f"unhashable type: '{'set' if kind is PlainSet else 'dict'}'")
    return value.key
  if kind in (set, frozenset):  # a trusted expected value
    if hashable and kind is set:
      raise Unhashable("unhashable type: 'set'")
    return PlainSet(list(value), kind is frozenset, budget, depth).key
  if kind is dict:
    if hashable:
      raise Unhashable("unhashable type: 'dict'")
    return PlainDict(list(value.items()), budget, depth).key
  return ("o", id(value))  # Opaque, or anything else: equal only to itself


def _value(node, budget, depth):
  budget.visit(depth)
  if node is None or type(node) in (bool, str, int):
    return node
  if type(node) is not list or not node or type(node[0]) is not str:
    raise Malformed(f"unexpected {type(node).__name__}")
  tag, items = node[0], node[1:]
  if tag in ("list", "tuple"):
    values = [_value(item, budget, depth + 1) for item in items]
    return values if tag == "list" else tuple(values)
  if tag in ("set", "frozenset"):
    return PlainSet([_value(item, budget, depth + 1) for item in items], tag == "frozenset",
                    budget, depth)
  if tag == "dict":
    if not all(type(item) is list and len(item) == 2 for item in items):
      raise Malformed("dict items must be [key, value] pairs")
    return PlainDict([(_value(k, budget, depth + 1), _value(v, budget, depth + 1))
                      for k, v in items], budget, depth)
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


def _small_object(pairs):
  """The harness writes two JSON objects only, of one key each: no table of program keys."""
  if len(pairs) != 1:
    raise Malformed("not the harness's JSON (an object without exactly one key)")
  return dict(pairs)


def decode(data: bytes, count: int, budget: Budget | None = None) -> list:
  """The harness's result file -> `count` items, each ("value", v) or ("raised", name).

  Fewer items than `count` means the program stopped (an exception ends the run);
  raises Malformed on anything the harness would not have written, OverBudget past
  `budget` (default: `Budget()`)."""
  budget = budget or Budget()
  try:
    document = json.loads(data.decode("utf-8"), object_pairs_hook=_small_object)
  except (UnicodeDecodeError, ValueError, RecursionError) as e:
    if isinstance(e, Malformed):
      raise
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
      if type(item) is dict and "value" in item:
        items.append(("value", _value(item["value"], budget, 0)))
      elif type(item) is dict and type(item.get("raised")) is str:
        items.append(("raised", item["raised"][:100]))
      else:
        raise Malformed("an output is neither a value nor an exception")
  except OverBudget:
    raise
  except (TypeError, ValueError, OverflowError, RecursionError) as e:  # e.g. a set of lists
    raise Malformed(f"{type(e).__name__}: {e}"[:200]) from None
  return items


# ----------------------------------------------------------------------------- rules
def _is_floats(x) -> bool:
  if isinstance(x, float):
    return True
  return isinstance(x, (list, tuple)) and len(x) > 0 and all(isinstance(i, float) for i in x)


def _finite(x) -> bool:
  return cmath.isfinite(x) if isinstance(x, complex) else math.isfinite(x)


def _allclose(out, exp, atol, budget, rtol=1e-7, depth=0) -> bool:
  """numpy.allclose(out, exp, rtol, atol) for numbers and equally shaped lists/tuples of them
  (numpy would also broadcast unequal shapes; EvalPlus checks the outer length only)."""
  budget.visit(depth)
  if isinstance(exp, (list, tuple)):
    return (isinstance(out, (list, tuple)) and len(out) == len(exp)
            and all(_allclose(o, e, atol, budget, rtol, depth + 1) for o, e in zip(out, exp)))
  numbers = (int, float, complex)
  if not isinstance(out, numbers) or not isinstance(exp, numbers):
    return False
  if not (_finite(out) and _finite(exp)):
    return out == exp  # numpy.isclose: an infinity only equals itself; NaN nothing
  return abs(out - exp) <= atol + rtol * abs(exp)


def _equal(out, exp, budget) -> bool:
  return canonical(out, budget) == canonical(exp, budget)


def _tolerance(out, exp, atol, budget) -> bool:
  """EvalPlus' check after `==` failed: the same type and length, then allclose."""
  if atol == 0 and _is_floats(exp):
    atol = 1e-6
  if atol == 0 or type(out) is not type(exp):
    return False
  if isinstance(exp, (list, tuple)) and len(out) != len(exp):
    return False
  return _allclose(out, exp, atol, budget)


def _as_set(value, budget):
  """`set(value)`'s canonical key (iterating as Python would), or None where it raises."""
  if isinstance(value, (PlainSet, set, frozenset, list, tuple, str, bytes)):
    items = list(value)
  elif isinstance(value, (PlainDict, dict)):
    items = [k for k, _ in value.items] if isinstance(value, PlainDict) else list(value)
  else:
    return None
  try:
    return PlainSet(items, False, budget).key
  except Unhashable:
    return None


def same(out, exp, rule: str, *, atol: float = 0.0, arguments=None,
         budget: Budget | None = None) -> bool:
  """Whether output `out` passes against expected `exp` under `rule` (see the module doc).
  Raises OverBudget past `budget` (default: `Budget()`)."""
  budget = budget or Budget()
  try:
    if rule == "exact":
      return _equal(out, exp, budget)
    if rule == "lcb":
      return _equal(list(out) if type(out) is tuple else out, exp, budget)
    if rule == "evalplus":
      return _equal(out, exp, budget) or _tolerance(out, exp, atol, budget)
    if rule == "set":
      mine = _as_set(out, budget)
      return (mine is not None and mine == _as_set(exp, budget)) or \
          _tolerance(out, exp, atol, budget)
    if rule == "not_none":
      return out is not None if exp is not None else out is None
    if rule == "find_zero":
      if type(out) not in (int, float, bool):  # EvalPlus' math.pow takes numbers only
        return False
      x = float(out)
      return abs(sum(c * x ** k for k, c in enumerate(arguments[0]))) <= atol
  except (TypeError, ValueError, OverflowError, ZeroDivisionError, RecursionError) as e:
    if isinstance(e, OverBudget):
      raise
    return False
  raise ValueError(f"unknown comparison rule {rule!r}; expected one of {RULES}")


class _Preview(reprlib.Repr):
  def _items(self, shown, total, limit):
    return ", ".join(shown) + (", ..." if total > limit else "")

  def repr_PlainSet(self, value, level):  # noqa: N802 -- reprlib's naming
    if not len(value):
      return "frozenset()" if value.frozen else "set()"
    inner = self._items([self.repr1(v, level - 1) for v in value.items[:self.maxset]],
                        len(value), self.maxset)
    return f"frozenset({{{inner}}})" if value.frozen else f"{{{inner}}}"

  def repr_PlainDict(self, value, level):  # noqa: N802
    return "{" + self._items([f"{self.repr1(k, level - 1)}: {self.repr1(v, level - 1)}"
                              for k, v in value.items[:self.maxdict]],
                             len(value), self.maxdict) + "}"


_PREVIEW = _Preview()
_PREVIEW.maxstring = _PREVIEW.maxother = _PREVIEW.maxlong = 60


def preview(value, limit: int = 120) -> str:
  """A short repr of a decoded value, for messages (bounded work whatever its size)."""
  try:
    text = _PREVIEW.repr(value)
  except (RecursionError, ValueError):  # ValueError: an int too long for repr
    text = f"<{type(value).__name__}>"
  return text if len(text) <= limit else text[:limit] + "..."
