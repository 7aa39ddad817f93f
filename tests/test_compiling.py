"""``compiling.jit`` and ``xla_cpu_compile``: XLA:CPU's faster-compiling options
change how a program is compiled, not what it computes, and a run selects them
from its config."""
import functools

import jax
import numpy as np
import pytest
from flax import nnx

from ba_jax.policy import compiling
from ba_jax.config import schema
from ba_jax.policy import model as model_lib
from ba_jax.run import setup as setup_lib
from ba_jax.update import train_step as ts
import trainer_utils as tu


@pytest.fixture
def restore_mode():
  before = compiling.mode()
  yield
  compiling.use(before)


def test_options_only_on_cpu_in_fast_mode(restore_mode):
  fast = compiling.CPU_OPTIONS["fast"]
  assert compiling.compiler_options("cpu", "fast") == fast
  assert compiling.compiler_options("cpu", "default") is None
  assert compiling.compiler_options("gpu", "fast") is None
  assert compiling.compiler_options("tpu", "fast") is None
  compiling.use("fast")
  assert compiling.compiler_options() == fast  # these tests run on CPU
  with pytest.raises(ValueError, match="xla_cpu_compile='quick': expected one of"):
    compiling.use("quick")


def test_config_selects_the_mode(restore_mode):
  """make_setup applies xla_cpu_compile (configs/tiny.py sets 'fast'); a bad
  value is the schema's error naming the key."""
  compiling.use("default")
  setup_lib.make_setup(tu.smoke_config())
  assert compiling.mode() == "fast"
  setup_lib.make_setup(tu.smoke_config(xla_cpu_compile="default"))
  assert compiling.mode() == "default"
  with pytest.raises(ValueError, match="xla_cpu_compile"):
    schema.parse(tu.smoke_config(xla_cpu_compile="quick"))


def test_train_step_with_options_equals_xla_defaults(restore_mode):
  """Two updates (two mini-batches) of the tiny policy: the step that the
  trainer jits (with the options) and a plain ``jax.jit`` of the same function
  give the same parameters and metrics, to float32 rounding."""
  model_cfg = tu.tiny_model_config()
  graphdef, params = nnx.split(model_lib.Decoder(model_cfg, rngs=nnx.Rngs(0)))
  tx = ts.make_optimizer(learning_rate=1e-3, warmup_steps=0, total_steps=4, eps=1e-3)
  cfg = ts.StepConfig(group_size=4, aggregation="balanced", num_minibatches=2)
  batch = tu.rollout_batch(0, n=16)
  compiling.use("fast")
  fast = ts.jit_train_step(graphdef=graphdef, tx=tx, cfg=cfg)
  plain = jax.jit(functools.partial(ts.train_step, graphdef=graphdef, tx=tx, cfg=cfg),
                  donate_argnums=0)
  out = {}
  for name, step in (("fast", fast), ("plain", plain)):
    state = jax.jit(lambda p: ts.create_state(p, tx))(params)
    state, metrics = step(state, batch)
    out[name] = (tu.host_params(state), jax.device_get(metrics))
  assert fast.jitted() is not fast._plain  # the options were used on this CPU backend
  start = tu.host_params(params)
  assert tu.max_abs_diff(out["plain"][0], start) > 1e-4  # the step moved the policy
  # Adam's eps=1e-3 bounds how far a gradient's rounding moves a parameter.
  assert tu.max_abs_diff(out["fast"][0], out["plain"][0]) < 1e-6
  for key in ("loss", "grad_norm", "w_pos", "w_neg", "entropy"):
    np.testing.assert_allclose(out["fast"][1][key], out["plain"][1][key], rtol=1e-5, atol=1e-6)
  # ``lower`` is what the dry run compiles: no options, where a call's program has them.
  state = jax.jit(lambda p: ts.create_state(p, tx))(params)
  kvs = lambda lowered: dict(lowered._lowering._compiler_options_kvs)  # pylint: disable=protected-access
  assert kvs(fast.jitted().lower(state, batch)) == compiling.CPU_OPTIONS["fast"]
  assert kvs(fast.lower(state, batch)) == {}
  assert fast.lower(state, batch).as_text() == plain.lower(state, batch).as_text()


@pytest.fixture
def cache_hits():
  """The persistent cache's hits recorded while the test runs; afterwards
  JAX's own cache setting applies again (the suite's, tests/conftest.py)."""
  hits = []

  def listener(event, **kwargs):
    if event == "/jax/compilation_cache/cache_hits":
      hits.append(event)

  jax.monitoring.register_event_listener(listener)
  yield hits
  jax.monitoring.unregister_event_listener(listener)
  compiling.use_cache("")


def test_use_cache_writes_programs_and_a_later_compile_loads_them(tmp_path, cache_hits):
  before = jax.config.jax_compilation_cache_dir
  cache = tmp_path / "cache"
  compiling.use_cache(str(cache))
  assert compiling.cache_dir() == str(cache)
  assert jax.config.jax_compilation_cache_dir == str(cache)
  # A program no other test compiles (its constant), so the first call misses.
  f = lambda x: jax.numpy.tanh(x @ x.T + 0.8125)
  x = np.linspace(-1.0, 1.0, 24, dtype=np.float32).reshape(4, 6)
  first = np.asarray(jax.jit(f)(x))
  written = sorted(p.name for p in cache.iterdir())
  assert written and not cache_hits
  jax.clear_caches()  # as a new process: nothing compiled in memory
  again = np.asarray(jax.jit(f)(x))
  assert len(cache_hits) == 1
  np.testing.assert_array_equal(again, first)
  assert sorted(p.name for p in cache.iterdir()) == written  # loaded, not rewritten
  # '' gives JAX's own setting back: a new program is not written there.
  compiling.use_cache("")
  assert compiling.cache_dir() == "" and jax.config.jax_compilation_cache_dir == before
  jax.jit(lambda x: x * 3.0625)(x)
  assert sorted(p.name for p in cache.iterdir()) == written


@pytest.mark.slow
def test_a_run_from_the_cache_trains_exactly_as_the_compiling_run(tmp_path, cache_hits, restore_mode):
  """configs/tiny.py:smoke twice with ``compilation_cache_dir``, the second
  after the in-memory caches are cleared: it loads its programs (the sampler
  and the train step among them) and its parameters and metrics are the
  first run's, bit for bit."""
  from ba_jax.run import trainer  # pylint: disable=import-outside-toplevel
  config = tu.smoke_config(compilation_cache_dir=str(tmp_path / "cache"))
  runs = []
  for name in ("compiles", "loads"):
    jax.clear_caches()
    hits = len(cache_hits)
    out = trainer.run(config, str(tmp_path / name))
    runs.append((len(cache_hits) - hits, out))
  (hits_first, first), (hits_second, second) = runs
  assert hits_first == 0 and hits_second >= 2
  assert tu.max_abs_diff(tu.host_params(second["state"]), tu.host_params(first["state"])) == 0.0
  for a, b in zip(first["history"], second["history"]):
    for key in ("loss", "reward_mean", "grad_norm", "length_mean"):
      assert a[key] == b[key], key
  assert second["after_rl"] == first["after_rl"]
