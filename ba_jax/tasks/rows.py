"""Rows of a data file (.jsonl, .json, .parquet, or a dataset through `datasets`), with
every failure a `DataError` naming the file, the row and, where one is to blame, the field:
bytes that are not UTF-8, malformed JSON, a value nested deeper than Python's parser goes
(the field found by a linear scan) or an integer over Python's digit limit.
"""
from __future__ import annotations

import json
import os
import reprlib
import sys
from typing import Iterator


class DataError(ValueError):
  """A malformed row: the message names the file, the row and the field."""


def fail(path, row, field, problem):
  raise DataError(f"{path}: row {row}: field {field!r}: {problem}")


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 3, 80, 80


def preview(value) -> str:
  """A short repr of a data value for messages, whatever its size or depth."""
  try:
    return _REPR.repr(value)
  except (ValueError, RecursionError):  # ValueError: an int over the digit limit
    return f"<{type(value).__name__}>"


class _LongInt(str):
  """An integer literal over Python's digit limit, kept as text so the row can be blamed."""


def _parse_int(text: str):
  try:
    return int(text)
  except ValueError:
    return _LongInt(text)


def _find(value, kind, path=()):
  """The path (keys/indices) to the first instance of `kind` in a parsed JSON value."""
  stack = [(value, path)]
  while stack:
    node, where = stack.pop()
    if isinstance(node, kind):
      return where
    if isinstance(node, dict):
      stack.extend((v, where + (k,)) for k, v in reversed(node.items()))
    elif isinstance(node, list):
      stack.extend((v, where + (i,)) for i, v in reversed(list(enumerate(node))))
  return None


def _deepest(text: str, row_level: int) -> tuple[int, str | None]:
  """(row, field) where JSON `text` nests deepest, in one pass: rows are the values opened at
  depth `row_level` + 1 (0: the text is one row), fields their keys."""
  depth, best, where = 0, -1, (0, None)
  row, key, last_string, in_string, escaped, start = -1, None, None, False, False, 0
  for i, char in enumerate(text):
    if in_string:
      if escaped:
        escaped = False
      elif char == "\\":
        escaped = True
      elif char == '"':
        in_string = False
        if depth == row_level + 1:
          last_string = text[start:i]
    elif char == '"':
      in_string, start = True, i + 1
    elif char in "[{":
      depth += 1
      if depth == row_level + 1:
        row, key = row + 1, None
      if depth > best:
        best, where = depth, (max(row, 0), key)
    elif char in "]}":
      depth -= 1
    elif char == ":" and depth == row_level + 1:
      key = last_string
  return where


def _loads(text: str, path, row_label: str, row_level: int):
  """json.loads with every failure a DataError naming the file, the row and the field."""
  try:
    value = json.loads(text, parse_int=_parse_int)
  except RecursionError:
    row, field = _deepest(text, row_level)
    label = row_label if row_level == 0 else f"row {row}"
    raise DataError(f"{path}: {label}: field {field!r}: nested too deeply to read "
                    "(Python's recursion limit)") from None
  except json.JSONDecodeError as e:
    if row_level == 0:
      raise DataError(f"{path}: {row_label}: not valid JSON: {e}") from None
    raise DataError(f"{path}: line {e.lineno} column {e.colno}: not valid JSON: {e.msg}") from None
  where = _find(value, _LongInt)
  if where is not None:
    label = row_label if row_level == 0 else f"row {where[0]}"
    field = ".".join(map(str, where[row_level:])) or None
    digits = len(_find_value(value, where).lstrip("-"))
    raise DataError(f"{path}: {label}: field {field!r}: an integer with {digits} digits, over "
                    f"Python's limit of {getattr(sys, 'get_int_max_str_digits', lambda: 4300)()} "
                    "for reading integers")
  return value


def _find_value(value, where):
  for step in where:
    value = value[step]
  return value


def _decode_line(path, i, raw: bytes) -> str:
  try:
    return raw.decode("utf-8-sig" if i == 0 else "utf-8")
  except UnicodeDecodeError as e:
    bad = raw[e.start:e.start + 4]
    raise DataError(f"{path}: row {i} (line {i + 1}): not valid UTF-8 at byte {e.start} of the "
                    f"line ({bad!r}); the file must be UTF-8 encoded") from None


def _read_jsonl(path) -> Iterator[tuple[int, dict]]:
  with open(path, "rb") as f:  # bytes, so that a bad byte is reported with its line
    for i, raw in enumerate(f):
      line = _decode_line(path, i, raw)
      if not line.strip():
        continue
      record = _loads(line, path, f"row {i} (line {i + 1})", 0)
      if not isinstance(record, dict):
        raise DataError(f"{path}: row {i}: expected a JSON object, got {type(record).__name__}")
      yield i, record


def _read_json(path):
  with open(path, "rb") as f:
    raw = f.read()
  if not raw.strip():
    raise DataError(f"{path}: the file is empty ({len(raw)} bytes); expected a JSON list of "
                    "records")
  try:
    text = raw.decode("utf-8-sig")
  except UnicodeDecodeError as e:
    line = raw.count(b"\n", 0, e.start) + 1
    raise DataError(f"{path}: line {line}: not valid UTF-8 at byte {e.start} "
                    f"({raw[e.start:e.start + 4]!r}); the file must be UTF-8 encoded") from None
  return _loads(text, path, "", 1)


def read_rows(path: str) -> Iterator[tuple[int, dict]]:
  """Yields (row number, record) from a .jsonl/.json/.parquet file or a dataset dir/name.

  A jsonl row number is its 0-based line index; errors also give the 1-based line.
  """
  path = os.fspath(path)
  if os.path.isfile(path):
    lower = path.lower()
    if lower.endswith((".jsonl", ".ndjson")):
      yield from _read_jsonl(path)
      return
    if lower.endswith(".json"):
      data = _read_json(path)
      if isinstance(data, dict):  # {"data": [...]} or column-oriented {"col": [...]}
        lists = [v for v in data.values() if isinstance(v, list)]
        if len(data) == 1 and lists:
          data = lists[0]
        elif lists and all(isinstance(v, list) and len(v) == len(lists[0]) for v in data.values()):
          data = [dict(zip(data, values)) for values in zip(*data.values())]
      if not isinstance(data, list):
        raise DataError(f"{path}: expected a JSON list of records, got {type(data).__name__}")
      for i, record in enumerate(data):
        if not isinstance(record, dict):
          raise DataError(f"{path}: row {i}: expected a JSON object, got {type(record).__name__}")
        yield i, record
      return
    if lower.endswith(".parquet"):
      import pyarrow.parquet as pq
      try:
        rows = pq.read_table(path).to_pylist()
      except Exception as e:  # pyarrow raises its own error types, without the file name
        raise DataError(f"{path}: not a readable parquet file ({type(e).__name__}: {e})") from None
      for i, record in enumerate(rows):
        yield i, record
      return
    raise DataError(f"{path}: unsupported file type; expected .jsonl, .json or .parquet")
  # A directory of data files or a dataset name in the local Hugging Face cache.
  import datasets
  try:
    dataset = datasets.load_dataset(path)
  except Exception as e:
    raise DataError(
        f"{path}: not a file, and datasets.load_dataset could not load it from a local "
        f"directory or the Hugging Face cache ({type(e).__name__}: {e})") from e
  splits = list(dataset.keys())
  split = next((s for s in ("test", "train", "validation") if s in splits), splits[0])
  for i, record in enumerate(dataset[split]):
    yield i, record
