"""Test setup, before JAX is first imported: eight fake CPU devices, offline
Hugging Face libraries, and one persistent XLA compilation cache shared by
every test and the processes the tests start (their environment inherits
these variables), so a program compiled once is loaded after that."""
import os
import pathlib

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
# The target compilers (libtpu, the CUDA plugin) are installed for the dry run's
# tests; the suite itself runs on the CPU, and never opens a TPU or GPU.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(
    pathlib.Path(__file__).resolve().parents[1] / ".jax_cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")


import pytest  # pylint: disable=wrong-import-position


@pytest.fixture
def git_repo(tmp_path, monkeypatch):
  """``tmp_path`` as the working directory and an empty git repository, with
  a committer identity (the protocol guard's tests commit there)."""
  from ba_jax.ablation import protocol  # pylint: disable=import-outside-toplevel
  for k in ("GIT_AUTHOR_NAME", "GIT_COMMITTER_NAME"):
    monkeypatch.setenv(k, "t")
  for k in ("GIT_AUTHOR_EMAIL", "GIT_COMMITTER_EMAIL"):
    monkeypatch.setenv(k, "t@example.invalid")
  monkeypatch.chdir(tmp_path)
  protocol.git(["init", "-q"], tmp_path)
  return tmp_path
