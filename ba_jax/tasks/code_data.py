"""Code benchmarks from local files: HumanEval+, MBPP+ (EvalPlus) and LiveCodeBench.

Each record becomes a `CodeExample` whose `tests` are `ba_jax.tasks.rewards.score_code`
test cases, so grading runs in `ba_jax.sandboxing.sandbox`. Published formats read:

* EvalPlus (`HumanEvalPlus-*.jsonl`, `MbppPlus-*.jsonl`, or the Hugging Face
  copies): `task_id`, `prompt`, `entry_point`, `canonical_solution`, and the
  release's `base_input`/`plus_input`/`atol` or else `test` (HumanEval's
  `def check(candidate)`, called on the entry point, or MBPP+'s script
  calling the function by name). The release layout gives call tests: the
  candidate's outputs come back as plain data and are compared outside its
  process with those of `canonical_solution` (computed in a sandbox run of
  their own), as EvalPlus does (exact, else the same type within `atol`,
  1e-6 for floats) with its special oracles (`find_zero`, MBPP+'s set-valued
  and not-None tasks). A `test` runs as assertion code, in a fresh namespace
  holding the prompt's definitions and the candidate's entry point.
* LiveCodeBench `code_generation_lite`: `question_content`, `starter_code`,
  `public_test_cases`/`private_test_cases` (JSON strings of
  `{input, output, testtype}`; the private ones may be base64 zlib pickles
  of that string, decompressed up to `MAX_DECOMPRESSED_BYTES`), `metadata`
  (JSON with `func_name`). `stdin` cases run the program on the input;
  `functional` cases call `Solution().<func_name>` on the JSON arguments,
  one per input line, and compare the result with the JSON output outside
  the program's process (a tuple read as a list, as LiveCodeBench does).

A response is graded on its last fenced code block (or all of it, when it
has none), found in time linear in its length; for a function task the block
is appended to the prompt, so helpers and imports of the prompt stay defined
and a bare body completes it.
"""
from __future__ import annotations

import base64
import dataclasses
import functools
import glob
import io
import json
import os
import pickle
import re
import zlib

from ba_jax.tasks import data as data_lib

KINDS = ("function", "stdin", "leetcode")
CODE_SETS = ("humanevalplus", "mbppplus", "livecodebench")
_ALIASES = {"humaneval+": "humanevalplus", "humaneval_plus": "humanevalplus",
            "mbpp+": "mbppplus", "mbpp_plus": "mbppplus", "lcb": "livecodebench",
            "code_generation_lite": "livecodebench"}
_PUBLISHED_NAMES = {"humanevalplus": ("HumanEvalPlus",), "mbppplus": ("MbppPlus",),
                    "livecodebench": ("code_generation_lite",)}
# MBPP+ tasks whose outputs EvalPlus compares as sets / only for being None.
MBPP_SET_OUTPUT = ("similar_elements", "find_char_long", "common_in_nested_lists",
                   "extract_singly", "larg_nnum", "intersection_array",
                   "find_dissimilar", "Diff")
MBPP_NOT_NONE_OUTPUT = ("check_str", "text_match_three", "text_starta_endb")
MAX_DECOMPRESSED_BYTES = 256 << 20  # one LiveCodeBench test-case field, decompressed
LEETCODE_IMPORTS = ("from typing import *\nfrom collections import *\nfrom functools import *\n"
                    "from itertools import *\nfrom heapq import *\nfrom bisect import *\n"
                    "import math\nimport string\nimport re\n\n")


@dataclasses.dataclass(frozen=True)
class CodeExample:
  task_id: str
  prompt: str  # HumanEval+/MBPP+: the code prompt; LiveCodeBench: the question
  tests: tuple  # score_code test cases
  kind: str  # one of KINDS: how a response becomes a program
  source: str
  entry_point: str = ""  # the function (or Solution method) the tests call
  starter_code: str = ""
  meta: dict = dataclasses.field(default_factory=dict, hash=False, compare=False)


def is_code_benchmark(name: str) -> bool:
  key = name.strip().lower()
  return _ALIASES.get(key, key) in CODE_SETS


def canonical_code_name(name: str) -> str:
  return data_lib.canonical_name(name, _ALIASES, CODE_SETS, "code benchmark")


_fail, _preview = data_lib.fail, data_lib.preview


def _string(path, row, record, field, *, required=True) -> str:
  value = record.get(field)
  if value is None and not required:
    return ""
  if not isinstance(value, str) or (required and not value.strip()):
    _fail(path, row, field, f"expected a non-empty string, got {type(value).__name__}: "
          f"{_preview(value)} (row has fields {sorted(record)})")
  return value


# ----------------------------------------------------------------------------- EvalPlus

def _compare_rule(entry_point: str) -> str:
  """EvalPlus' comparison for a task, with its special oracles (`ba_jax.sandboxing.outputs`)."""
  if entry_point == "find_zero":
    return "find_zero"
  if entry_point in MBPP_SET_OUTPUT:
    return "set"
  return "not_none" if entry_point in MBPP_NOT_NONE_OUTPUT else "evalplus"


def _evalplus_tests(path, row, record, entry_point, prompt) -> tuple:
  if record.get("base_input") is None:
    test = record.get("test")
    if not isinstance(test, str) or not test.strip():
      _fail(path, row, "test", "missing, and no 'base_input' to test against either "
            f"(row has fields {sorted(record)})")
    if re.search(r"^def check\(", test, re.M):  # HumanEval's convention
      test = f"{test}\n\ncheck({entry_point})\n"
    return ({"assert": test, "entry_point": entry_point, "context": prompt},)
  solution_field = "canonical_solution" if "canonical_solution" in record else "code"
  reference = build_program(prompt, _string(path, row, record, solution_field), entry_point)
  atol = record.get("atol") or 0
  if not isinstance(atol, (int, float)) or isinstance(atol, bool):
    _fail(path, row, "atol", f"expected a number, got {_preview(atol)}")
  tests = []
  for field in ("base_input", "plus_input"):
    inputs = record.get(field)
    if inputs is None or (field == "plus_input" and not inputs):
      continue
    if not isinstance(inputs, list) or not all(isinstance(i, list) for i in inputs):
      _fail(path, row, field, f"expected a list of argument lists, got {_preview(inputs)}")
    tests.append({"call": entry_point, "inputs": inputs, "reference": reference,
                  "compare": _compare_rule(entry_point), "atol": atol})
  return tuple(tests)


def load_evalplus(path: str, source: str) -> list[CodeExample]:
  """HumanEval+ or MBPP+ rows (either published layout; see the module doc)."""
  examples = []
  for row, record in data_lib.read_rows(path):
    task_id = str(record.get("task_id", row))
    prompt = _string(path, row, record, "prompt")
    entry_point = _string(path, row, record, "entry_point")
    if not entry_point.isidentifier():
      _fail(path, row, "entry_point", f"expected a function name, got {entry_point!r}")
    examples.append(CodeExample(
        task_id=task_id, prompt=prompt, tests=_evalplus_tests(path, row, record, entry_point,
                                                              prompt),
        kind="function", source=source, entry_point=entry_point, meta={"row": row}))
  return examples


# ----------------------------------------------------------------------------- LiveCodeBench


class _StringsOnly(pickle.Unpickler):
  """LiveCodeBench pickles a plain string: refuse anything that names a class."""

  def find_class(self, module, name):
    raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a test-case pickle")


def _json(path, row, field, text: str, what: str = "JSON"):
  try:
    return json.loads(text)
  except RecursionError:
    _fail(path, row, field, f"{what} nested too deeply to read")
  except ValueError as e:  # JSONDecodeError, or an integer over Python's digit limit
    _fail(path, row, field, f"not valid {what}: {e}")


def _inflate(data: bytes, path, row, field) -> bytes:
  inflater = zlib.decompressobj()
  out = inflater.decompress(data, MAX_DECOMPRESSED_BYTES + 1)
  if len(out) > MAX_DECOMPRESSED_BYTES or inflater.unconsumed_tail:
    _fail(path, row, field, f"decompresses to more than {MAX_DECOMPRESSED_BYTES} bytes "
          "(code_data.MAX_DECOMPRESSED_BYTES)")
  return out


def decode_test_cases(value, path="", row=0, field="test_cases") -> list[dict]:
  """A JSON list of test cases, from JSON text or LiveCodeBench's base64 zlib pickle of it."""
  if isinstance(value, list):
    return value
  if not isinstance(value, str):
    _fail(path, row, field, f"expected a JSON string or a list, got {type(value).__name__}")
  if value.lstrip().startswith(("[", "{")):
    return _json(path, row, field, value)
  try:
    packed = base64.b64decode(value, validate=True)
  except ValueError as e:
    _fail(path, row, field, f"neither JSON nor base64 ({e})")
  try:
    text = _StringsOnly(io.BytesIO(_inflate(packed, path, row, field))).load()
  except data_lib.DataError:
    raise
  except Exception as e:  # noqa: BLE001 -- zlib/pickle errors, reported with the row
    _fail(path, row, field, f"neither JSON nor a base64 zlib pickle of JSON ({e})")
  if not isinstance(text, str):
    _fail(path, row, field, f"the pickle holds a {type(text).__name__}, not JSON text")
  return _json(path, row, field, text, "JSON (in the zlib pickle)")


def _functional_test(path, row, func_name: str, cases: list[dict]) -> dict:
  inputs, expected = [], []
  for i, case in enumerate(cases):
    where = f"test_cases[{i}]"
    lines = [line for line in str(case["input"]).split("\n") if line.strip()]
    inputs.append([_json(path, row, f"{where}.input", line) for line in lines])
    expected.append(_json(path, row, f"{where}.output", str(case["output"])))
  return {"call": func_name, "class": "Solution", "inputs": inputs, "expected": expected,
          "compare": "lcb"}


def load_livecodebench(path: str) -> list[CodeExample]:
  examples = []
  for row, record in data_lib.read_rows(path):
    question = _string(path, row, record, "question_content")
    cases = []
    for field in ("public_test_cases", "private_test_cases"):
      if record.get(field) not in (None, ""):
        cases += decode_test_cases(record[field], path, row, field)
    if not cases:
      _fail(path, row, "public_test_cases", "no test cases (private ones are empty too)")
    for i, case in enumerate(cases):
      if not isinstance(case, dict) or "input" not in case or "output" not in case:
        _fail(path, row, "test_cases", f"case {i}: expected {{input, output, testtype}}, "
              f"got {_preview(case)}")
    types = {c.get("testtype", "stdin") for c in cases}
    if not types <= {"stdin", "functional"} or len(types) > 1:
      _fail(path, row, "test_cases", f"testtype {sorted(types)}: expected all 'stdin' or "
            "all 'functional'")
    metadata = record.get("metadata") or {}
    if isinstance(metadata, str):
      metadata = _json(path, row, "metadata", metadata) if metadata.strip() else {}
    if types == {"functional"}:
      func_name = metadata.get("func_name")
      if not isinstance(func_name, str) or not func_name.isidentifier():
        _fail(path, row, "metadata", f"functional tests need metadata.func_name, got "
              f"{_preview(metadata)}")
      kind, tests, entry = "leetcode", (_functional_test(path, row, func_name, cases),), func_name
    else:
      kind, entry = "stdin", ""
      tests = tuple({"input": c["input"], "output": c["output"]} for c in cases)
    examples.append(CodeExample(
        task_id=str(record.get("question_id") or record.get("question_title") or row),
        prompt=question, tests=tests, kind=kind, source="livecodebench", entry_point=entry,
        starter_code=_string(path, row, record, "starter_code", required=False),
        meta={k: record[k] for k in ("question_title", "platform", "contest_date", "difficulty")
              if k in record} | {"row": row}))
  return examples


_IMPORT = re.compile(r"^[ \t]*(?:import|from)[ \t]+([A-Za-z_]\w*)", re.M)


def check_test_imports(examples: list[CodeExample]) -> None:
  """Raises when tests (or reference solutions) import a module the sandbox's interpreter
  lacks (EvalPlus' `test` strings import numpy): every sample would fail, so say so instead."""
  import sys
  from ba_jax.sandboxing import sandbox
  wanted = {}
  for e in examples:
    for case in e.tests:
      if isinstance(case, str):
        code = case
      elif isinstance(case, dict):  # assertion code and its context, or a reference solution
        code = "\n".join(case.get(k, "") for k in ("assert", "context", "reference"))
      else:
        continue
      for module in _IMPORT.findall(code):
        if module not in sys.stdlib_module_names:
          wanted.setdefault(module, e.task_id)
  for module, task_id in sorted(wanted.items()):
    if not _sandbox_can_import(module):
      raise ValueError(
          f"{task_id}: its tests import {module!r}, which the sandbox interpreter "
          f"{sandbox.sandbox_python()} cannot import; install it there or use the "
          "benchmark's release layout (base_input/plus_input), which needs no extra modules")


@functools.lru_cache(maxsize=None)
def _sandbox_can_import(module: str) -> bool:
  from ba_jax.sandboxing import sandbox
  return sandbox.run_program(f"import {module}\n").returncode == 0


def _find_file(key: str, path: str) -> str:
  if not os.path.isdir(path):
    return path
  names = [key] + [alias for alias, target in _ALIASES.items() if target == key]
  for name in names:
    for ext in (".jsonl", ".json", ".parquet"):
      if os.path.isfile(os.path.join(path, name + ext)):
        return os.path.join(path, name + ext)
  for prefix in _PUBLISHED_NAMES[key]:  # e.g. HumanEvalPlus-v0.1.10.jsonl
    found = sorted(glob.glob(os.path.join(path, prefix + "*.jsonl")))
    if found:
      return found[-1]
  return path


def load_code_set(name: str, path: str) -> list[CodeExample]:
  """A code benchmark (humanevalplus, mbppplus, livecodebench) from a file or directory."""
  key = canonical_code_name(name)
  path = _find_file(key, os.fspath(path))
  examples = load_livecodebench(path) if key == "livecodebench" else load_evalplus(path, key)
  if not examples:
    raise data_lib.DataError(f"{path}: code benchmark {name!r} has no rows")
  return examples


# ----------------------------------------------------------------------------- prompts, programs

_LANGUAGE_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_+-")
_CODE_INSTRUCTION = {
    "function": "Complete the following Python function. Write the whole function in a "
                "```python code block.\n\n```python\n{prompt}\n```",
    "stdin": "{prompt}\n\nRead the input from stdin, solve the problem and write the answer to "
             "stdout. Write your whole program in a ```python code block.",
    "leetcode": "{prompt}\n\nUse this starter code and write your solution in a ```python code "
                "block:\n```python\n{starter_code}\n```",
}


def format_code_prompt(example: CodeExample, template: str, tokenizer=None) -> str:
  """"chat": the instruction in the tokenizer's chat template; otherwise a
  completion prompt (the function prompt itself, or the instruction followed
  by an opened code fence)."""
  instruction = _CODE_INSTRUCTION[example.kind].format(prompt=example.prompt.rstrip(),
                                                       starter_code=example.starter_code)
  if template == "chat":
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
      raise ValueError("template='chat' needs a tokenizer with a chat_template")
    return tokenizer.apply_chat_template([{"role": "user", "content": instruction}],
                                         tokenize=False, add_generation_prompt=True)
  if example.kind == "function":
    return example.prompt
  return instruction + "\n\n```python\n"


def _skip(text: str, i: int, chars) -> int:
  while i < len(text) and text[i] in chars:
    i += 1
  return i


def _fenced_blocks(text: str) -> list[str]:
  """What the regex "```[ \\t]*[lang]*[ \\t]*\\n(.*?)```" (re.S) finds, in one left-to-right pass:
  each position is scanned once, so the time is linear in len(text) whatever it holds."""
  blocks, i = [], text.find("```")
  while i != -1:
    j = _skip(text, _skip(text, _skip(text, i + 3, " \t"), _LANGUAGE_CHARS), " \t")
    if j < len(text) and text[j] == "\n":
      end = text.find("```", j + 1)
      if end == -1:
        break  # no later opening can close either
      blocks.append(text[j + 1:end])
      i = text.find("```", end + 3)
    else:
      i = text.find("```", i + 1)
  return blocks


def extract_code(response: str) -> str:
  """The last complete fenced block; else the text before a closing fence (a
  prompt that opened it); else everything."""
  blocks = _fenced_blocks(response)
  if blocks:
    return blocks[-1]
  if "```" in response:
    head, _, tail = response.partition("```")
    if head.strip():
      return head
    return tail.partition("\n")[2]  # an opened fence the budget cut short
  return response


def build_program(prompt: str, code: str, entry_point: str) -> str:
  """A whole function is appended to the prompt (its stub is redefined); a
  bare body continues it."""
  # [ \t], not \s: with re.M, \s* at each line start would run on over every blank
  # line that follows (quadratic in their number).
  if re.search(rf"^[ \t]*def[ \t]+{re.escape(entry_point)}[ \t]*\(", code, re.M):
    return prompt.rstrip() + "\n\n\n" + code
  return prompt + code


def program_for(example: CodeExample, response: str) -> str:
  code = extract_code(response)
  if example.kind == "function":
    return build_program(example.prompt, code, example.entry_point)
  if example.kind == "leetcode":
    return LEETCODE_IMPORTS + code
  return code
