"""Loaders on hand-written fixtures in the real schemas, prompt templates, the prompt iterator."""
import json
import pathlib

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ba_jax.tasks import data

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
EVAL_DIR = FIXTURES / "eval"


def dapo_rows():
  return json.loads((FIXTURES / "dapo_math_rows.json").read_text())


def write_parquet(rows, path):
  pq.write_table(pa.Table.from_pylist(rows), path)
  return str(path)


@pytest.fixture
def dapo_parquet(tmp_path):
  rows = dapo_rows()
  # The public copy repeats prompts (with fresh extra_info indices): 4, 2 and 1 copies here.
  repeated = []
  for copies, row in zip((4, 2, 1), rows):
    for k in range(copies):
      repeated.append(dict(row, extra_info={"index": f"{row['extra_info']['index']}-{k}"}))
  repeated = [repeated[i] for i in (0, 4, 1, 6, 2, 5, 3)]  # interleaved like the real file
  return write_parquet(repeated, tmp_path / "dapo-math-17k.parquet")


def test_dapo_dedup_counts(dapo_parquet):
  examples = data.load_dapo_math(dapo_parquet)
  assert len(examples) == 3
  assert examples.stats == {"rows": 7, "examples": 3, "duplicates_dropped": 4}
  rows = dapo_rows()
  assert [e.answer for e in examples] == [r["reward_model"]["ground_truth"] for r in rows]
  # The bare problem is recovered from DAPO's instruction wrapper; the original prompt is kept.
  assert examples[0].problem == "What is the sum of the first 10 positive integers?"
  assert examples[0].prompt == rows[0]["prompt"]
  assert examples[0].source == "math_dapo" and examples[0].meta["ability"] == "MATH"
  everything = data.load_dapo_math(dapo_parquet, dedup=False)
  assert len(everything) == 7 and everything.stats["duplicates_dropped"] == 0


def test_dapo_answer_template_reproduces_the_dataset_prompt(dapo_parquet):
  for example in data.load_dapo_math(dapo_parquet):
    assert data.format_prompt(example, "answer") == example.prompt[0]["content"]
    assert data.format_prompt(example, "raw") == example.prompt[0]["content"]


@pytest.mark.parametrize("field, bad_value, named", [
    ("reward_model", {"style": "rule"}, "reward_model.ground_truth"),
    ("prompt", None, "'prompt'"),
    ("prompt", [{"role": "user"}], "prompt[0]"),
])
def test_dapo_malformed_row_is_named(tmp_path, field, bad_value, named):
  rows = dapo_rows()
  rows[2] = dict(rows[2], **{field: bad_value})
  path = write_parquet(rows, tmp_path / "bad.parquet")
  with pytest.raises(data.DataError) as info:
    data.load_dapo_math(path)
  message = str(info.value)
  assert path in message and "row 2" in message and named in message


def test_polaris_difficulty_filter():
  path = str(FIXTURES / "polaris.jsonl")
  everything = data.load_polaris(path)
  assert len(everything) == 6 and everything.stats["filtered_out"] == 0
  assert [e.meta["difficulty"] for e in everything] == [1.0, 0.75, 0.875, 0.375, 0.125, 0.0]
  assert everything[4].answer == "(-2, 2)" and everything[0].problem == "Compute $\\binom{6}{2}$."
  # Keep the informative ones: neither always solved nor never solved.
  middle = data.load_polaris(path, min_difficulty=0.1, max_difficulty=0.9)
  assert [e.answer for e in middle] == ["24", "6", "2", "(-2, 2)"]
  assert middle.stats == {"rows": 6, "examples": 4, "filtered_out": 2}


def test_polaris_malformed_rows_are_named(tmp_path):
  lines = (FIXTURES / "polaris.jsonl").read_text().splitlines()
  bad_json = tmp_path / "bad_json.jsonl"
  bad_json.write_text("\n".join(lines[:3] + ['{"problem": "x", "answer": '] + lines[3:]))
  with pytest.raises(data.DataError, match=r"bad_json.jsonl: row 3 \(line 4\): not valid JSON"):
    data.load_polaris(str(bad_json))
  missing = tmp_path / "missing.jsonl"
  missing.write_text("\n".join(lines[:1] + ['{"problem": "x", "difficulty": "1/8"}']))
  with pytest.raises(data.DataError, match=r"missing.jsonl: row 1: field 'answer': missing"):
    data.load_polaris(str(missing))
  bad_difficulty = tmp_path / "bad_difficulty.jsonl"
  bad_difficulty.write_text('{"problem": "x", "answer": "1", "difficulty": "hard"}\n')
  with pytest.raises(data.DataError, match=r"row 0: field 'difficulty'.*'hard'"):
    data.load_polaris(str(bad_difficulty), min_difficulty=0.5)


EXPECTED_EVAL = {
    "aime24": (2, ["204", "025"]),
    "aime25": (2, ["70", "588"]),
    "amc23": (3, ["27", "36", "45"]),  # stored as floats 27.0 in math-ai/amc23
    "math500": (3, ["\\left( 3, \\frac{\\pi}{2} \\right)", "\\frac{14}{3}", "27"]),
    "minerva": (2, ["1.6", "9.6"]),
    "olympiadbench": (2, ["\\sqrt{2}", "(1,2), (2,1)"]),  # final_answer lists, $ stripped
}


@pytest.mark.parametrize("name", sorted(EXPECTED_EVAL))
def test_eval_sets_in_their_layouts(name):
  count, answers = EXPECTED_EVAL[name]
  from_file = data.load_eval_set(name, str(EVAL_DIR / f"{name}.jsonl"))
  from_dir = data.load_eval_set(name, str(EVAL_DIR))
  assert len(from_file) == count and [e.answer for e in from_file] == answers
  assert [e.problem for e in from_dir] == [e.problem for e in from_file]
  assert all(e.source == name and e.problem.strip() for e in from_file)


def test_eval_aliases_and_solution_fallback(tmp_path):
  assert len(data.load_eval_set("AIME_2024", str(EVAL_DIR / "aime24.jsonl"))) == 2
  with pytest.raises(ValueError, match="unknown evaluation set 'gsm9k'"):
    data.load_eval_set("gsm9k", str(EVAL_DIR))
  # Qwen2.5-Math's minerva copy has only a solution; the answer is its last \boxed{}.
  path = tmp_path / "minerva.jsonl"
  path.write_text(json.dumps({"problem": "p", "solution": "so $\\boxed{\\frac{1}{2}}$."}) + "\n")
  assert data.load_eval_set("minerva", str(path))[0].answer == "\\frac{1}{2}"
  path.write_text(json.dumps({"problem": "p", "solution": "no box"}) + "\n")
  with pytest.raises(data.DataError, match="row 0: field 'answer/final_answer': no answer"):
    data.load_eval_set("minerva", str(path))


def test_prompt_templates():
  import model_utils
  example = data.Example(problem="What is 1+1?", answer="2", source="t")
  assert data.format_prompt(example, "answer").startswith("Solve the following math problem")
  assert data.format_prompt(example, "answer").endswith('after "Answer:".')
  assert data.format_prompt(example, "boxed") == (
      "What is 1+1?\nPlease reason step by step, and put your final answer within \\boxed{}.")
  chat = data.format_prompt(example, "chat", model_utils.make_tokenizer())
  assert chat == ("<|im_start|>user\n" + data.format_prompt(example, "boxed") +
                  "<|im_end|>\n<|im_start|>assistant\n")
  with pytest.raises(ValueError, match="template must be one of"):
    data.format_prompt(example, "fancy")
  with pytest.raises(ValueError, match="needs a tokenizer"):
    data.format_prompt(example, "chat")


def test_a_dataset_directory_goes_through_hf_datasets(tmp_path):
  # A directory that is not an eval-set layout is handed to `datasets.load_dataset`, as is a
  # dataset name found in the local Hugging Face cache.
  directory = tmp_path / "polaris_dir"
  directory.mkdir()
  (directory / "train.jsonl").write_text((FIXTURES / "polaris.jsonl").read_text())
  via_datasets = data.load_polaris(str(directory), min_difficulty=0.1, max_difficulty=0.9)
  direct = data.load_polaris(str(FIXTURES / "polaris.jsonl"), min_difficulty=0.1,
                             max_difficulty=0.9)
  assert [(e.problem, e.answer) for e in via_datasets] == [(e.problem, e.answer) for e in direct]
  with pytest.raises(data.DataError, match="no-such-dataset: not a file, and datasets.load_dataset"):
    data.load_polaris("no-such-dataset")


def _polaris_line(problem="p", answer="1"):
  return json.dumps({"problem": problem, "answer": answer, "difficulty": "1/2"})


@pytest.mark.parametrize("name, content, expected", [
    ("bad_byte.jsonl", _polaris_line().encode() + b'\n{"problem": "caf\xe9", "answer": "1"}\n',
     r"bad_byte.jsonl: row 1 \(line 2\): not valid UTF-8 at byte 16 of the line \(b'\\xe9\"."),
    ("empty.json", b"", r"empty.json: the file is empty \(0 bytes\)"),
    ("latin1.json", b'[{"problem": "p", "answer": "1"},\n {"problem": "caf\xe9", "answer": "2"}]',
     r"latin1.json: line 2: not valid UTF-8 at byte 51 \(b'\\xe9\","),
    ("broken.json", b'[{"problem": "p", "answer": "1"},\n {"problem": "q" "answer": "2"}]',
     r"broken.json: line 2 column 18: not valid JSON: Expecting ',' delimiter"),
    ("no_answer.json", b'[{"problem": "p", "answer": "1"}, {"problem": "q"}]',
     r"no_answer.json: row 1: field 'answer': missing"),
    ("truncated.parquet", b"PAR1\x00\x01", r"truncated.parquet: not a readable parquet file"),
])
def test_decode_failures_name_file_row_and_field(tmp_path, name, content, expected):
  path = tmp_path / name
  path.write_bytes(content)
  with pytest.raises(data.DataError, match=expected):
    data.load_polaris(str(path))


def test_a_byte_order_mark_is_not_an_error(tmp_path):
  path = tmp_path / "bom.jsonl"
  path.write_bytes(b"\xef\xbb\xbf" + _polaris_line().encode() + b"\n")
  assert [e.problem for e in data.load_polaris(str(path))] == ["p"]


def test_an_empty_training_set_is_an_error_naming_the_file(tmp_path):
  empty = tmp_path / "empty.jsonl"
  empty.write_text("\n\n")
  with pytest.raises(data.DataError, match=r"empty.jsonl: no training examples \(the file has no"):
    data.load_polaris(str(empty))
  with pytest.raises(data.DataError, match=r"empty.jsonl: no training examples"):
    data.load_dapo_math(str(empty))
  path = str(FIXTURES / "polaris.jsonl")
  with pytest.raises(data.DataError,
                     match=r"polaris.jsonl: no training examples \(all 6 rows are outside "
                           r"difficulty \[0.9, 0.95\]\)"):
    data.load_polaris(path, min_difficulty=0.9, max_difficulty=0.95)


@pytest.mark.parametrize("name, content, expected", [
    ("deep.jsonl", _polaris_line().encode() + b'\n{"problem": "p", "answer": ' + b"[" * 100_000
     + b"]" * 100_000 + b"}\n",
     r"deep.jsonl: row 1 \(line 2\): field 'answer': nested too deeply to read"),
    ("deep.json", b'[{"problem": "p", "answer": "1"}, {"problem": "q", "meta": ' + b"[" * 100_000
     + b"]" * 100_000 + b', "answer": "2"}]',
     r"deep.json: row 1: field 'meta': nested too deeply to read"),
    ("long_int.jsonl", b'{"problem": "p", "answer": "1", "extra": {"n": ' + b"7" * 5000 + b"}}\n",
     r"long_int.jsonl: row 0 \(line 1\): field 'extra.n': an integer with 5000 digits, over "
     r"Python's limit of 4300"),
    ("long_int.json", b'[{"problem": "p", "answer": ' + b"7" * 5000 + b"}]",
     r"long_int.json: row 0: field 'answer': an integer with 5000 digits"),
])
def test_values_python_cannot_read_name_the_row_and_field(tmp_path, name, content, expected):
  path = tmp_path / name
  path.write_bytes(content)
  with pytest.raises(data.DataError, match=expected):
    data.load_polaris(str(path))


@pytest.mark.parametrize("content", ["", "   \n", data.DAPO_PREFIX + "\n" + data.DAPO_SUFFIX])
def test_dapo_row_without_a_problem_is_an_error(tmp_path, content):
  rows = dapo_rows()
  rows[1] = dict(rows[1], prompt=[{"role": "user", "content": content}])
  path = write_parquet(rows, tmp_path / "empty_prompt.parquet")
  with pytest.raises(data.DataError, match=r"empty_prompt.parquet: row 1: field "
                                           r"'prompt\[0\].content': no problem text"):
    data.load_dapo_math(path)
