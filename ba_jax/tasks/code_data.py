"""Code benchmarks from local files: HumanEval+, MBPP+ (EvalPlus) and LiveCodeBench.

Each record becomes a `CodeExample` whose `tests` are `ba_jax.tasks.rewards.score_code`
test cases, so grading runs in `ba_jax.sandboxing.sandbox`. Published formats read:

* EvalPlus (`HumanEvalPlus-*.jsonl`, `MbppPlus-*.jsonl`, or the Hugging Face
  copies): `task_id`, `prompt`, `entry_point`, `canonical_solution`, and either
  `test` (HumanEval's `def check(candidate)`, called on the entry point, or
  MBPP+'s script calling the function by name) or the release's
  `base_input`/`plus_input`/`atol`. From the latter the expected outputs are
  those of `canonical_solution`, computed in the same sandboxed run, compared
  as EvalPlus does (exact, else within `atol`, 1e-6 for floats) with its
  special oracles (`find_zero`, MBPP+'s set-valued and not-None tasks).
* LiveCodeBench `code_generation_lite`: `question_content`, `starter_code`,
  `public_test_cases`/`private_test_cases` (JSON strings of
  `{input, output, testtype}`; the private ones may be base64 zlib pickles
  of that string), `metadata` (JSON with `func_name`). `stdin` cases run the
  program on the input; `functional` cases call `Solution().<func_name>` on
  the JSON arguments, one per input line.

A response is graded on its last fenced code block (or all of it, when it
has none); for a function task the block is appended to the prompt, so
helpers and imports of the prompt stay defined and a bare body completes it.
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


def _fail(path, row, field, problem):
  raise data_lib.DataError(f"{path}: row {row}: field {field!r}: {problem}")


def _string(path, row, record, field, *, required=True) -> str:
  value = record.get(field)
  if value is None and not required:
    return ""
  if not isinstance(value, str) or (required and not value.strip()):
    _fail(path, row, field, f"expected a non-empty string, got {type(value).__name__}: "
          f"{str(value)[:80]!r} (row has fields {sorted(record)})")
  return value


# ----------------------------------------------------------------------------- EvalPlus

_REFERENCE_HARNESS = '''
import copy as _copy, json as _json, sys as _sys
if hasattr(_sys, "set_int_max_str_digits"):  # EvalPlus has huge integers
    _sys.set_int_max_str_digits(0)

def _floats(x):
    if isinstance(x, float):
        return True
    return isinstance(x, (list, tuple)) and len(x) > 0 and all(isinstance(i, float) for i in x)

def _allclose(out, exp, atol):
    if isinstance(exp, (list, tuple)):
        return (isinstance(out, (list, tuple)) and len(out) == len(exp)
                and all(_allclose(o, e, atol) for o, e in zip(out, exp)))
    try:
        return abs(out - exp) <= atol + 1e-7 * abs(exp)
    except TypeError:
        return False

def _same(out, exp, atol):
    if out == exp:
        return True
    if atol == 0 and _floats(exp):
        atol = 1e-6
    return atol != 0 and _allclose(out, exp, atol)

_namespace = {}
exec(compile(%(reference)r, "<reference>", "exec"), _namespace)
_reference, _candidate = _namespace[%(entry)r], %(entry)s
for _i, _inp in enumerate(_json.loads(%(inputs)r)):
    _out = _candidate(*_copy.deepcopy(_inp))
%(check)s
'''


_CHECKS = {
    # find_zero: any zero of the polynomial will do
    "poly": "    assert abs(sum(c * _out ** k for k, c in enumerate(_inp[0]))) <= {atol!r}, "
            "f'input {{_i}}: {{_out!r}} is no zero'",
    "equal": "    _exp = _reference(*_copy.deepcopy(_inp))\n{same}",
    "set": "    _exp = _reference(*_copy.deepcopy(_inp))\n"
           "    _out, _exp = set(_out), set(_exp)\n{same}",
    "not_none": "    _exp = _reference(*_copy.deepcopy(_inp))\n"
                "    _out, _exp = _out is not None, _exp is not None\n{same}",
}
_SAME = ("    assert _same(_out, _exp, {atol!r}), "
         "f'input {{_i}}: got {{_out!r:.200}}, expected {{_exp!r:.200}}'")


def _check(entry_point: str, atol) -> str:
  """The harness's comparison, with EvalPlus' special oracles by task."""
  if entry_point == "find_zero":
    kind = "poly"
  elif entry_point in MBPP_SET_OUTPUT:
    kind = "set"
  else:
    kind = "not_none" if entry_point in MBPP_NOT_NONE_OUTPUT else "equal"
  return _CHECKS[kind].format(atol=atol, same=_SAME.format(atol=atol))


def _evalplus_tests(path, row, record, entry_point, prompt) -> tuple:
  test = record.get("test")
  if isinstance(test, str) and test.strip():
    if re.search(r"^def check\(", test, re.M):  # HumanEval's convention
      return (f"{test}\n\ncheck({entry_point})\n",)
    return (test,)
  if record.get("base_input") is None:
    _fail(path, row, "test", "missing, and no 'base_input' to test against either "
          f"(row has fields {sorted(record)})")
  solution_field = "canonical_solution" if "canonical_solution" in record else "code"
  reference = build_program(prompt, _string(path, row, record, solution_field), entry_point)
  atol = record.get("atol") or 0
  if not isinstance(atol, (int, float)):
    _fail(path, row, "atol", f"expected a number, got {atol!r}")
  tests = []
  for field in ("base_input", "plus_input"):
    inputs = record.get(field)
    if inputs is None or (field == "plus_input" and not inputs):
      continue
    if not isinstance(inputs, list) or not all(isinstance(i, list) for i in inputs):
      _fail(path, row, field, f"expected a list of argument lists, got {str(inputs)[:80]!r}")
    tests.append(_REFERENCE_HARNESS % dict(reference=reference, entry=entry_point,
                                           inputs=json.dumps(inputs),
                                           check=_check(entry_point, atol)))
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


def decode_test_cases(value, path="", row=0, field="test_cases") -> list[dict]:
  """A JSON list of test cases, from JSON text or LiveCodeBench's base64 zlib pickle of it."""
  if isinstance(value, list):
    return value
  if not isinstance(value, str):
    _fail(path, row, field, f"expected a JSON string or a list, got {type(value).__name__}")
  try:
    return json.loads(value)
  except json.JSONDecodeError:
    pass
  try:
    text = _StringsOnly(io.BytesIO(zlib.decompress(base64.b64decode(value)))).load()
    return json.loads(text)
  except Exception as e:  # noqa: BLE001 -- reported with the row
    _fail(path, row, field, f"neither JSON nor a base64 zlib pickle of JSON ({e})")


def _functional_test(func_name: str, cases: list[dict]) -> str:
  lines = ["import json as _json", "_solution = Solution()"]
  for case in cases:
    args = [line for line in str(case["input"]).split("\n") if line.strip()]
    lines += [f"_out = _solution.{func_name}(*[_json.loads(a) for a in {args!r}])",
              "_out = list(_out) if isinstance(_out, tuple) else _out",
              f"assert _out == _json.loads({str(case['output'])!r}), "
              f"'input ' + {str(case['input'])[:200]!r}"]
  return "\n".join(lines) + "\n"


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
              f"got {str(case)[:80]!r}")
    types = {c.get("testtype", "stdin") for c in cases}
    if not types <= {"stdin", "functional"} or len(types) > 1:
      _fail(path, row, "test_cases", f"testtype {sorted(types)}: expected all 'stdin' or "
            "all 'functional'")
    metadata = record.get("metadata") or {}
    if isinstance(metadata, str):
      try:
        metadata = json.loads(metadata) if metadata.strip() else {}
      except json.JSONDecodeError as e:
        _fail(path, row, "metadata", f"not valid JSON ({e}): {metadata[:80]!r}")
    if types == {"functional"}:
      func_name = metadata.get("func_name")
      if not isinstance(func_name, str) or not func_name.isidentifier():
        _fail(path, row, "metadata", f"functional tests need metadata.func_name, got {metadata!r}")
      kind, tests, entry = "leetcode", (_functional_test(func_name, cases),), func_name
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


_IMPORT = re.compile(r"^\s*(?:import|from)\s+([A-Za-z_]\w*)", re.M)


def check_test_imports(examples: list[CodeExample]) -> None:
  """Raises when tests import a module the sandbox's interpreter lacks (EvalPlus'
  `test` strings import numpy): every sample would fail, so say so instead."""
  import sys
  from ba_jax.sandboxing import sandbox
  wanted = {}
  for e in examples:
    for case in e.tests:
      if isinstance(case, str):
        for module in _IMPORT.findall(case):
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

_FENCE = re.compile(r"```[ \t]*[A-Za-z0-9_+-]*[ \t]*\n(.*?)```", re.S)
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


def extract_code(response: str) -> str:
  """The last complete fenced block; else the text before a closing fence (a
  prompt that opened it); else everything."""
  blocks = _FENCE.findall(response)
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
  if re.search(rf"^\s*def\s+{re.escape(entry_point)}\s*\(", code, re.M):
    return prompt.rstrip() + "\n\n\n" + code
  return prompt + code


def program_for(example: CodeExample, response: str) -> str:
  code = extract_code(response)
  if example.kind == "function":
    return build_program(example.prompt, code, example.entry_point)
  if example.kind == "leetcode":
    return LEETCODE_IMPORTS + code
  return code
