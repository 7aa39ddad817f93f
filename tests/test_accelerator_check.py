"""python -m ba_jax.accelerator_check: its CPU path (the GPU and TPU paths
need the device), the chip table, and the test selection it runs there."""
import json
import pathlib
import re

import pytest

from ba_jax import accelerator_check
from ba_jax.scaling import accelerator
from ba_jax.scaling import report as report_lib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_cpu_path_prints_its_lines_and_writes_the_report(tmp_path, capsys):
  out = tmp_path / "report.json"
  assert accelerator_check.main(["accelerator_check", f"--json_out={out}"]) == 0
  lines = capsys.readouterr().out.strip().split("\n")
  assert [l.split(":")[0] for l in lines] == [
      "devices", "tests", "decode step", "train step", "memory", "report"]
  assert lines[0].startswith("devices: 8 x cpu (cpu; ")  # conftest's 8 devices
  assert lines[1] == ("tests: skipped on cpu (the whole suite runs there: "
                      "python -m pytest)")
  report = json.loads(out.read_text())
  assert report["backend"] == "cpu" and report["model"]["name"] == "tiny"
  assert report["peak_bf16_flops"] is None
  train, decode = report["train_step"], report["decode"]
  assert train["rows"] == 16 and train["tokens_per_row"] == 32
  assert train["nonfinite"] == 0 and train["mfu"] is None
  assert train["tokens_per_s"] == pytest.approx(16 * 32 / train["step_s"])
  assert 0 < decode["prefill_s"] < decode["sample_s"]
  assert decode["tokens_per_s"] == pytest.approx(16 / decode["decode_step_s"])
  memory = report["memory"]
  assert memory["compiled"]["train_step"]["peak_bytes"] > 4 * report["model"]["params"]
  assert memory["device_bytes"] is None and memory["fits"] is None
  assert "cpu_estimate" not in memory  # it is the compiled figure here


def test_mfu_uses_the_chips_published_peak():
  assert accelerator.chip("NVIDIA H200") == ("NVIDIA H200", 989e12)
  assert accelerator.chip("NVIDIA H100 80GB HBM3") == ("NVIDIA H100 SXM", 989e12)
  assert accelerator.chip("NVIDIA H100 PCIe")[1] == 756e12
  assert accelerator.chip("NVIDIA A100-SXM4-80GB")[1] == 312e12
  assert accelerator.chip("NVIDIA L40S")[1] == 362e12
  assert accelerator.chip("NVIDIA L4")[1] == 121e12
  assert accelerator.chip("TPU v5 lite") == ("TPU v5e", 197e12)
  assert accelerator.chip("TPU v5p")[1] == 459e12
  assert accelerator.chip("TPU v6 lite")[1] == 918e12
  assert accelerator.chip("TPU v4")[1] == 275e12
  assert accelerator.chip("cpu") == ("cpu", None)
  assert accelerator._mfu(989e12 * 0.25, 1.0, 989e12, 2) == pytest.approx(0.125)


def test_the_tests_it_runs_and_leaves_out_exist():
  for name in accelerator.TEST_FILES:
    assert (ROOT / name).is_file(), name
  for node in accelerator.MULTI_DEVICE_TESTS:
    path, test = node.split("::")
    assert path in accelerator.TEST_FILES
    assert re.search(rf"^def {test}\(", (ROOT / path).read_text(), re.M), node


def test_run_tests_counts_from_pytests_report(tmp_path):
  """A stand-in suite: one pass, one failure, one skip, one multi-device
  test left out on a single device."""
  (tmp_path / "tests").mkdir()
  (tmp_path / "tests" / "test_attention_kernels.py").write_text(
      "import pytest\n"
      "def test_ok(): pass\n"
      "def test_bad(): assert 1 == 2\n"
      "@pytest.mark.skip(reason='no')\n"
      "def test_skipped(): pass\n"
      "def test_splash_kernel_in_interpret_mode_equals_blockwise(): assert 0\n")
  result = accelerator.run_tests(1, timeout=120, root=tmp_path)
  assert result["ok"] is False and result["status"] == "FAILED"
  assert (result["passed"], result["failed"], result["skipped"]) == (1, 1, 1)
  assert result["failures"] == ["tests.test_attention_kernels::test_bad"]
  assert result["files"] == ["tests/test_attention_kernels.py"]
  assert report_lib.tests_line(result).startswith(
      "tests: FAILED: 1 passed, 1 failed, 0 errors, 1 skipped, 4 deselected")
