"""``jit``: ``jax.jit`` whose XLA:CPU compile options a run chooses.

The config key ``xla_cpu_compile`` picks ``CPU_OPTIONS[mode]`` for the
programs a run calls (the train step, the samplers, scoring, the warm-up
step); ``make_setup`` applies it with ``use``. ``"fast"``
compiles with XLA:CPU's older loop emitters instead of its fusion emitters and
LLVM's optimisation level 1 instead of 2. It pays off for tiny models, whose
compile time is many small fusions, and not for larger ones
(``experiments/benchmarks/bench_compile_options.py``, 2-core host, each run a fresh
process): on the default tiny job's 20 RL steps it takes compilation to 0.61x,
the steps after the first to 0.90x and the whole run to 0.80x; on
SmolLM2-135M compilation is 1.30x and the steps 1.05x slower. So
``configs/tiny.py`` sets it and the default is XLA's own (``"default"``;
``configs/chains.py`` and ``drafts.py`` keep it, as their results ran).
Only the CPU backend is affected, and ``lower`` (what the dry run compiles for
an accelerator mesh) always uses XLA's defaults. The two modes round floats
differently, so a run's sampled tokens may differ between them.

``use_cache`` (config key ``compilation_cache_dir``) turns on JAX's persistent
compilation cache: every program a run compiles is written to that directory,
and a later process that compiles the same program (same HLO, options, devices
and JAX version) loads it instead. Seeds of an ablation, a resumed run and a
rerun of the quick start then skip XLA's compilation, though not the tracing
and lowering that find the program: the tiny job's first RL step took 4.8 s
cold and 1.5 s warm on one 2-core host, with results identical to the bit
(``experiments/studies/compare_trl/compare_trl.py`` without and with ``--warm_cache``).
"""
from __future__ import annotations

import contextlib
import functools
import os
from typing import Any, Callable

import jax
from jax.experimental.compilation_cache import compilation_cache as jax_cache

from ba_jax.config import schema

CPU_OPTIONS: dict[str, dict[str, Any] | None] = {
    "default": None,
    "fast": {"xla_cpu_use_fusion_emitters": False, "xla_backend_optimization_level": 1},
}
assert tuple(CPU_OPTIONS) == schema.XLA_CPU_COMPILE

_mode = "default"


def use(mode: str) -> None:
  """Programs that ``jit`` compiles from now on, in this process, use
  ``CPU_OPTIONS[mode]`` on the CPU backend (compiled programs are kept per
  mode)."""
  global _mode  # pylint: disable=global-statement
  if mode not in CPU_OPTIONS:
    raise ValueError(f"xla_cpu_compile={mode!r}: expected one of {sorted(CPU_OPTIONS)}")
  _mode = mode


def mode() -> str:
  return _mode


# Every program goes to the cache: JAX's default keeps only those that took a
# second or more to compile, and most of a small policy's programs take less.
CACHE_MIN_COMPILE_SECONDS = 0.0

_cache_dir = ""  # the directory use_cache set ('': none)
_jax_cache_settings: tuple = ()  # JAX's own settings before use_cache set one


def use_cache(directory: str) -> None:
  """Programs compiled from now on in this process are looked up in, and
  written to, JAX's persistent compilation cache in ``directory`` (created
  if missing). ``''`` undoes an earlier call (JAX's own setting, e.g. the
  ``JAX_COMPILATION_CACHE_DIR`` environment variable, applies again).

  The cache is trusted: whoever can write to ``directory`` can run code in
  this process, so do not share it with users you do not trust.
  """
  global _cache_dir, _jax_cache_settings  # pylint: disable=global-statement
  directory = os.path.abspath(os.path.expanduser(directory)) if directory else ""
  if directory == _cache_dir:
    return
  if not _cache_dir:
    _jax_cache_settings = (jax.config.jax_compilation_cache_dir,
                           jax.config.jax_persistent_cache_min_compile_time_secs)
  if directory:
    os.makedirs(directory, exist_ok=True)
    settings = (directory, CACHE_MIN_COMPILE_SECONDS)
  else:
    settings = _jax_cache_settings
  jax.config.update("jax_compilation_cache_dir", settings[0])
  jax.config.update("jax_persistent_cache_min_compile_time_secs", settings[1])
  # JAX decides once per process whether the cache is used; ask again.
  jax_cache.reset_cache()
  _cache_dir = directory


def cache_dir() -> str:
  """The directory ``use_cache`` set ('': none)."""
  return _cache_dir


@functools.cache
def _default_backend() -> str:
  return jax.default_backend()


_target: str | None = None  # the platform ``targeting`` builds programs for


def backend() -> str:
  """The platform the programs being built are for: the dry run's target
  (``targeting``), else JAX's default backend. Code that picks a kernel or a
  loop form by platform asks this, not ``jax.default_backend()``, so that a
  program compiled for a TPU or GPU on a CPU host is the one that chip runs."""
  return _target or _default_backend()


@contextlib.contextmanager
def targeting(platform: str):
  """Within the block, ``backend()`` is ``platform`` ("tpu", "gpu" or "cpu"):
  programs traced there choose the kernels a run on that platform would.

  JAX's caches key a traced program on its inputs, not on this choice, so
  they are cleared on leaving the block: a later call on this host must not
  reuse a program traced for another chip (a Pallas TPU kernel, say)."""
  global _target  # pylint: disable=global-statement
  if platform not in ("cpu", "gpu", "tpu"):
    raise ValueError(f"targeting({platform!r}): expected 'cpu', 'gpu' or 'tpu'")
  previous, _target = _target, platform
  try:
    yield
  finally:
    _target = previous
    if platform != backend():
      jax.clear_caches()


def compiler_options(platform: str | None = None, cpu_mode: str | None = None
                     ) -> dict[str, Any] | None:
  """The options ``jit`` compiles with on ``platform`` (default:
  ``backend()``) in ``cpu_mode`` (default: the current one); None is XLA's
  defaults."""
  options = CPU_OPTIONS[cpu_mode or _mode]
  if options is None or (platform or backend()) != "cpu":
    return None
  return dict(options)


class jit:  # pylint: disable=invalid-name  (a drop-in for jax.jit)
  """``jax.jit(fun, **kwargs)`` compiled with ``compiler_options()`` of the
  mode current at each call (a module-level ``jit`` picks no backend at
  import); ``lower`` lowers with XLA's defaults."""

  def __init__(self, fun: Callable, **kwargs):
    self._fun, self._kwargs = fun, kwargs
    self._plain = jax.jit(fun, **kwargs)
    self._by_mode: dict[str, Any] = {}  # mode -> jax.jit with its options
    functools.update_wrapper(self, fun)

  def jitted(self):
    """The ``jax.jit`` object a call now goes to."""
    jitted = self._by_mode.get(_mode)
    if jitted is None:
      options = compiler_options()
      jitted = self._plain if options is None else jax.jit(
          self._fun, compiler_options=options, **self._kwargs)
      self._by_mode[_mode] = jitted
    return jitted

  def __call__(self, *args, **kwargs):
    return self.jitted()(*args, **kwargs)

  def lower(self, *args, **kwargs) -> jax.stages.Lowered:
    return self._plain.lower(*args, **kwargs)
