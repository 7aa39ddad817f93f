"""The pure update: sharded equals single-device, no retrace, exact
micro-batching, non-finite updates skipped, bad options rejected."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ba_jax.policy import model as model_lib
from ba_jax.policy import sharding as sharding_lib
from ba_jax.update import train_step as ts
import trainer_utils as tu

RULES = sharding_lib.DEFAULT_RULES


def _setup(mesh, *, cfg, lr=1e-3, eps=1e-8):
  """State materialised on ``mesh``, the jitted step, batch placement."""
  model_cfg = tu.tiny_model_config()
  model = sharding_lib.create_sharded(
      lambda: model_lib.Decoder(model_cfg, rngs=nnx.Rngs(0)), mesh, RULES)
  graphdef, params = nnx.split(model)
  tx = ts.make_optimizer(learning_rate=lr, warmup_steps=0, total_steps=4,
                         eps=eps)
  shapes = jax.eval_shape(lambda p: ts.create_state(p, tx), params)
  state_sharding = ts.tree_shardings(shapes, mesh, RULES)
  state = jax.jit(lambda p: ts.create_state(p, tx),
                  out_shardings=state_sharding)(params)
  step = ts.jit_train_step(graphdef=graphdef, tx=tx, cfg=cfg,
                           state_sharding=state_sharding)
  place = lambda b: {k: jax.device_put(
      v, sharding_lib.data_sharding(mesh, RULES, np.ndim(v)))
                     for k, v in b.items()}
  return state, step, place


@pytest.mark.slow
def test_sharded_step_equals_single_device_step():
  cfg = ts.StepConfig(group_size=4, aggregation="balanced", eps_high=0.28,
                      num_minibatches=2, num_microbatches=1)
  batch = tu.rollout_batch(0, n=16)
  mesh8 = sharding_lib.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  mesh1 = sharding_lib.make_mesh({"data": 1, "fsdp": 1, "tensor": 1},
                                 devices=jax.devices()[:1])
  results = []
  for mesh in (mesh8, mesh1):
    # eps=1e-3 keeps Adam's update Lipschitz in the gradient (lr/eps = 1): with eps=1e-8 a
    # gradient element near 0 turns summation-order noise into an update of up to lr.
    state, step, place = _setup(mesh, cfg=cfg, eps=1e-3)
    state, metrics = step(state, place(batch))
    results.append((tu.host_params(state), jax.device_get(metrics), state))
  (p8, m8, s8), (p1, m1, _) = results
  # The parameters really are split over the 8 devices.
  embed = s8.params["embed_tokens"].get_value()
  assert len({d.id for d in embed.sharding.device_set}) == 8
  assert embed.addressable_shards[0].data.shape == (16, 16)
  # Two AdamW updates of lr 1e-3: a parameter moves by up to 2e-3; sums in
  # another order change the gradient by ~1e-7 relative, which the update
  # carries through at most lr * (relative change) = 1e-6 in each step.
  assert tu.max_abs_diff(p8, p1) < 1e-5
  assert tu.max_abs_diff(tu.host_params(results[1][2]), p1) == 0.0
  moved = tu.max_abs_diff(p1, tu.host_params(_setup(mesh1, cfg=cfg, eps=1e-3)[0]))
  assert moved > 1e-4  # the step did something to compare
  for name in ("loss", "grad_norm", "w_pos", "w_neg", "entropy"):
    np.testing.assert_allclose(m8[name], m1[name], rtol=1e-5, atol=1e-6)


# Clip-Cov with bounds every unclipped token lies in: its draw decides the update.
CLIP_COV = dict(surrogate="clip_cov", clip_cov_ratio=0.2, clip_cov_lb=-100.0,
                clip_cov_ub=100.0)


@pytest.mark.slow
@pytest.mark.parametrize("surrogate", ["kl_cov", "clip_cov"])
def test_cov_sharded_step_equals_single_device_step(surrogate):
  """KL-Cov picks its tokens among the whole micro-batch's, all devices
  together (a sort over the sharded rows), and Clip-Cov draws them there
  (its random scores do not depend on the sharding): the step on 8 devices
  equals the step on one, as for the other terms."""
  options = (dict(surrogate="kl_cov", kl_cov_ratio=0.1, kl_cov_coef=1.0)
             if surrogate == "kl_cov" else CLIP_COV)
  cfg = ts.StepConfig(group_size=4, aggregation="balanced", num_minibatches=2,
                      **options)
  batch = tu.rollout_batch(1, n=16)
  results = []
  for mesh in (sharding_lib.make_mesh({"data": 4, "fsdp": 2, "tensor": 1}),
               sharding_lib.make_mesh({"data": 1, "fsdp": 1, "tensor": 1},
                                      devices=jax.devices()[:1])):
    state, step, place = _setup(mesh, cfg=cfg, eps=1e-3)
    state, metrics = step(state, place(batch))
    results.append((tu.host_params(state), jax.device_get(metrics)))
  (p8, m8), (p1, m1) = results
  assert tu.max_abs_diff(p8, p1) < 1e-5  # as in the ppo_clip test above
  for name in ("loss", "grad_norm", "pg_loss_sum"):
    np.testing.assert_allclose(m8[name], m1[name], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_clip_cov_draws_from_the_seed_and_the_step_counter():
  """Clip-Cov's key comes from cfg.seed and state.step alone (the state
  holds no key): the same state and batch give the same update, bit for
  bit; another step counter or seed draws other tokens, so another update;
  and the key is the one update_key gives. Resuming restores state.step,
  so a resumed run draws what an uninterrupted one would."""
  graphdef, params = nnx.split(model_lib.Decoder(tu.tiny_model_config(), rngs=nnx.Rngs(0)))
  tx = ts.make_optimizer(learning_rate=1e-3, warmup_steps=0, total_steps=4, eps=1e-3)
  batch = tu.rollout_batch(6, n=16)

  def run(state, **overrides):
    cfg = ts.StepConfig(group_size=4, num_minibatches=2, num_microbatches=2,
                        ppo_epochs=2, **dict(CLIP_COV, **overrides))
    fn = jax.jit(lambda s, b: ts.train_step(s, b, graphdef=graphdef, tx=tx, cfg=cfg))
    new, metrics = fn(state, batch)
    return tu.host_params(new), jax.device_get(metrics)

  state = ts.create_state(params, tx)
  first, metrics = run(state)
  again, _ = run(state)
  assert tu.max_abs_diff(first, again) == 0.0
  assert float(metrics["clip_frac_dual"]) > 0.1  # the drawn tokens
  later, _ = run(state.replace(step=jnp.asarray(5, jnp.int32)))
  other_seed, _ = run(state, seed=1)
  assert tu.max_abs_diff(first, later) > 1e-6 and tu.max_abs_diff(first, other_seed) > 1e-6
  ppo, _ = run(state, surrogate="ppo_clip")
  assert tu.max_abs_diff(first, ppo) > 1e-6
  keys = [jax.random.key_data(ts.update_key(seed, step)) for seed, step in
          [(0, 5), (0, jnp.asarray(5, jnp.int32)), (0, 6), (1, 5)]]
  assert np.array_equal(keys[0], keys[1])
  assert not np.array_equal(keys[0], keys[2]) and not np.array_equal(keys[0], keys[3])


@pytest.mark.slow
def test_step_compiles_once_across_batches():
  mesh = sharding_lib.make_mesh({"data": -1, "fsdp": 1, "tensor": 1})
  model_cfg = tu.tiny_model_config()
  graphdef, params = nnx.split(model_lib.Decoder(model_cfg, rngs=nnx.Rngs(0)))
  tx = ts.make_optimizer(learning_rate=1e-3, warmup_steps=1, total_steps=3)
  cfg = ts.StepConfig(group_size=4)

  @chex.assert_max_traces(n=1)
  def step_fn(state, batch):
    return ts.train_step(state, batch, graphdef=graphdef, tx=tx, cfg=cfg)

  step = jax.jit(step_fn, donate_argnums=0)
  state = ts.create_state(params, tx)
  for seed in range(3):
    state, _ = step(state, tu.rollout_batch(seed, n=16))
  assert int(state.step) == 3
  chex.clear_trace_counter()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["token"])  # every mode: test_microbatch.py
def test_micro_batches_give_the_same_update(mode):
  mesh = sharding_lib.make_mesh({"data": -1, "fsdp": 1, "tensor": 1},
                                devices=jax.devices()[:1])
  batch = tu.rollout_batch(3, n=16)
  params = []
  for k in (1, 4):
    cfg = ts.StepConfig(group_size=4, aggregation=mode, num_microbatches=k)
    state, step, place = _setup(mesh, cfg=cfg, eps=1e-3)
    state, metrics = step(state, place(batch))
    params.append(tu.host_params(state))
    assert int(metrics["nonfinite"]) == 0
  # eps=1e-3 keeps Adam's first update Lipschitz in the gradient (lr/eps = 1),
  # so float32 summation-order noise (~1e-7) stays ~1e-7 in the parameters.
  assert tu.max_abs_diff(*params) < 1e-6


@pytest.mark.slow
def test_non_finite_update_is_skipped_and_counted():
  mesh = sharding_lib.make_mesh({"data": -1, "fsdp": 1, "tensor": 1},
                                devices=jax.devices()[:1])
  cfg = ts.StepConfig(group_size=4, num_minibatches=2)
  state, step, place = _setup(mesh, cfg=cfg)
  before = tu.host_params(state)
  batch = tu.rollout_batch(4, n=16)
  batch["advantages"][:8] = np.nan  # first mini-batch only
  state, metrics = step(state, place(batch))
  assert int(metrics["nonfinite"]) == 1 and int(state.nonfinite) == 1
  after = tu.host_params(state)
  assert all(np.isfinite(p).all() for p in after)
  assert tu.max_abs_diff(before, after) > 0  # the second update applied


def test_bad_options_fail_with_clear_messages():
  with pytest.raises(ValueError, match="'tokne'"):
    ts.StepConfig(group_size=4, aggregation="tokne")
  with pytest.raises(ValueError, match="num_minibatches=3"):
    ts.StepConfig(group_size=4, num_minibatches=3).check_batch(16)
  with pytest.raises(ValueError, match="num_microbatches=3"):
    ts.StepConfig(group_size=4, num_microbatches=3).check_batch(16)
  with pytest.raises(ValueError, match="8 devices"):
    ts.StepConfig(group_size=4, num_minibatches=2).check_batch(8, 8)
  with pytest.raises(ValueError, match="temperature"):
    ts.StepConfig(group_size=4, temperature=0.0)
  with pytest.raises(ValueError, match="cosin"):
    ts.make_optimizer(learning_rate=1e-3, warmup_steps=0, total_steps=4,
                      schedule="cosin")


@pytest.mark.slow
def test_epochs_and_mini_batches_trace_one_update(monkeypatch):
  """PPO epochs x mini-batches are scans: the update body is traced once, not 2 x 2 times."""
  traces = []
  update = ts._update

  def counted(*args, **kwargs):
    traces.append(1)
    return update(*args, **kwargs)

  monkeypatch.setattr(ts, "_update", counted)
  graphdef, params = nnx.split(model_lib.Decoder(tu.tiny_model_config(), rngs=nnx.Rngs(0)))
  tx = ts.make_optimizer(learning_rate=1e-3, warmup_steps=0, total_steps=4)
  cfg = ts.StepConfig(group_size=4, ppo_epochs=2, num_minibatches=2, num_microbatches=2)
  batch = tu.rollout_batch(5, n=16)
  batch["advantages"][8:] = np.nan  # the second mini-batch, in both epochs
  before = tu.host_params(params)
  state, metrics = jax.jit(lambda s, b: ts.train_step(s, b, graphdef=graphdef, tx=tx, cfg=cfg))(
      ts.create_state(params, tx), batch)
  assert len(traces) == 1
  # The skip is per mini-batch: 2 of the 4 updates were not finite, the other 2 applied.
  assert int(metrics["nonfinite"]) == 2 and int(state.nonfinite) == 2
  assert tu.max_abs_diff(tu.host_params(state), before) > 0
