"""ba_jax: GRPO-style RL of LLMs in JAX, built around Balanced Aggregation.

Commands: ``python -m ba_jax.train``, ``.evaluate``, ``.export``,
``.dry_run``, ``.convert_gguf``, ``.accelerator_check``; the packages are
described in README.md's Layout section.
"""
import os

# ba_jax takes only tokenizers and configs from transformers (its models are
# JAX), so transformers' "PyTorch was not found" advice does not apply.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

# The dry run's target compilers (libtpu, the CUDA plugin: the `aot` extra)
# make JAX try to open a TPU or GPU at start-up on any host where they are
# installed, which on a CPU-only host costs time, a lockfile and pages of
# warnings. Where Linux shows no accelerator device, JAX is told to use the
# CPU, as it would end up doing; JAX_PLATFORMS, if set, is left as it is.
_ACCELERATOR_DEVICES = ("/dev/accel*", "/dev/vfio/[0-9]*", "/dev/nvidia[0-9]*",
                        "/dev/nvidiactl", "/dev/kfd")


def _cpu_only_host() -> bool:
  import glob
  import sys
  return sys.platform.startswith("linux") and not any(
      glob.glob(pattern) for pattern in _ACCELERATOR_DEVICES)


if "JAX_PLATFORMS" not in os.environ and _cpu_only_host():
  os.environ["JAX_PLATFORMS"] = "cpu"
  import sys as _sys
  if "jax" in _sys.modules:  # imported before ba_jax: its flag has read the environment
    import jax as _jax
    if not _jax.config.jax_platforms:
      _jax.config.update("jax_platforms", "cpu")
