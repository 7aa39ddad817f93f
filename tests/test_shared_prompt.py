"""rl.share_prompt: each group's prompt computed once, packed with its G
responses (`attention.attend_shared_prefix`, `Decoder.hidden_states`'s
shared_prefix, `score_responses`' prompt_group), equal to scoring every row
on its own: log-probs, entropies, gradients and whole train steps."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ba_jax.config import schema
from ba_jax.policy import attention as attention_lib
from ba_jax.policy import model as model_lib
from ba_jax.policy import sharding as sharding_lib
from ba_jax.policy.scoring import score_responses
from ba_jax.run import checks
from ba_jax.update import train_step as ts
import trainer_utils as tu

# Every family and GQA shape the model claims: kv heads 1 (MQA), fewer than
# the query heads (GQA) and equal (MHA); biases (Qwen2), q/k norm and a
# head_dim of its own (Qwen3), llama3 RoPE scaling, tied and untied heads.
SHAPES = {
    "qwen2": dict(model_type="qwen2", num_heads=4, num_kv_heads=2, head_dim=8, attention_bias=True),
    "qwen2_tied_mha": dict(model_type="qwen2", num_heads=4, num_kv_heads=4, head_dim=8,
                           attention_bias=True, tie_word_embeddings=True),
    "qwen3": dict(model_type="qwen3", num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True,
                  tie_word_embeddings=True),
    "llama_mqa": dict(model_type="llama", num_heads=4, num_kv_heads=1, head_dim=8, rope_theta=500000.0,
                      rope_scaling=(("factor", 8.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
                                    ("original_max_position_embeddings", 16), ("rope_type", "llama3"))),
}
VOCAB = 40


def _model(shape: str, dtype="float32", impl="full", seed=0):
  config = model_lib.ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=2,
                                 dtype=dtype, attention_impl=impl, attention_block=4, **SHAPES[shape])
  return model_lib.Decoder(config, rngs=nnx.Rngs(seed))


def _group_batch(seed, *, groups=3, G=4, P=7, T=6):
  """Group-major rows: each group's prompt (left-padded, lengths 1..P) repeated
  G times; responses of ragged lengths 1..T (mask 0 after the stop)."""
  rng = np.random.default_rng(seed)
  lengths = rng.integers(1, P + 1, groups)
  lengths[0] = P  # one unpadded prompt
  pm = (np.arange(P)[None] >= P - lengths[:, None]).astype(np.int32)
  pid = rng.integers(3, VOCAB, (groups, P)) * pm
  rlen = rng.integers(1, T + 1, groups * G)
  rlen[0] = T
  rm = (np.arange(T)[None] < rlen[:, None]).astype(np.int32)
  rid = rng.integers(3, VOCAB, (groups * G, T)) * rm
  return (np.repeat(pid, G, 0).astype(np.int32), np.repeat(pm, G, 0), rid.astype(np.int32), rm)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_grouped_scoring_equals_row_by_row_scoring(shape, dtype):
  model = _model(shape, dtype)
  batch = _group_batch(1)
  per_row = score_responses(model, *batch)
  grouped = score_responses(model, *batch, prompt_group=4)
  mask = batch[3] == 1
  tol = 1e-5 if dtype == "float32" else 0.05  # bfloat16 activations: sums in another order
  for a, b in zip(per_row, grouped):
    assert np.isfinite(np.asarray(b)).all()
    np.testing.assert_allclose(np.asarray(b)[mask], np.asarray(a)[mask], atol=tol, rtol=tol)
    assert (np.asarray(b)[~mask] == 0).all()
  # Not a vacuous check: the log-probs vary from token to token.
  assert np.std(np.asarray(per_row[0])[mask]) > 0.05


@pytest.mark.parametrize("shape", SHAPES)
def test_grouped_scoring_has_the_same_gradient(shape):
  model = _model(shape)
  graphdef, params = nnx.split(model)
  batch = _group_batch(2)
  weights = jnp.asarray(np.random.default_rng(0).normal(size=batch[2].shape), jnp.float32)

  def loss(p, group):
    logp, entropy = score_responses(nnx.merge(graphdef, p), *batch, prompt_group=group)
    return jnp.sum(weights * logp) + 0.1 * jnp.sum(entropy)

  grad_rows, grad_groups = jax.grad(loss)(params, 1), jax.grad(loss)(params, 4)
  for a, b in zip(jax.tree.leaves(grad_rows), jax.tree.leaves(grad_groups)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=2e-5, rtol=1e-4)
  assert max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(grad_rows)) > 1e-3


@pytest.mark.parametrize("impl", ["blockwise", "xla"])
def test_every_prefix_kernel_gives_the_same_scores(impl):
  """The prompt part runs on the configured kernel (tiles of 4 here, so the
  7-token prompts span two), the responses on one score matrix."""
  batch = _group_batch(3)
  reference = score_responses(_model("qwen3"), *batch)
  grouped = score_responses(_model("qwen3", impl=impl), *batch, prompt_group=4)
  mask = batch[3] == 1
  for a, b in zip(reference, grouped):
    np.testing.assert_allclose(np.asarray(b)[mask], np.asarray(a)[mask], atol=1e-5, rtol=1e-5)


def test_packed_hidden_states_equal_each_row_alone():
  """`attend_shared_prefix` through the whole model: each suffix position's
  hidden state equals that of the row [prefix; suffix_g] run alone, and the
  prefix's equal the prompt's (positions counted from its first real token)."""
  model = _model("qwen2")
  pid, pm, rid, rm = _group_batch(4, groups=2, G=3, P=5, T=4)
  rows, _ = model.hidden_states(np.concatenate([pid, rid], 1), np.concatenate([pm, rm], 1))
  packed, _ = model.hidden_states(
      np.concatenate([pid[::3], rid.reshape(2, 12)], 1), np.concatenate([pm[::3], rm.reshape(2, 12)], 1),
      shared_prefix=(5, 3))
  rows = np.asarray(rows)
  packed = np.asarray(packed)
  real_prompt = pm[::3] == 1
  np.testing.assert_allclose(packed[:, :5][real_prompt], rows[::3, :5][real_prompt], atol=1e-5)
  suffix = packed[:, 5:].reshape(6, 4, -1)
  np.testing.assert_allclose(suffix[rm == 1], rows[:, 5:][rm == 1], atol=1e-5)


def test_bad_packing_is_named():
  model = _model("qwen3")
  ids = np.ones((2, 10), np.int32)
  with pytest.raises(ValueError, match=r"shared_prefix=\(4, 4\)"):
    model.hidden_states(ids, shared_prefix=(4, 4))  # 6 positions do not split into 4
  cache = model_lib.init_cache(model.config, 2, 16)
  with pytest.raises(ValueError, match="shared_prefix is for the uncached forward"):
    model.hidden_states(ids, shared_prefix=(2, 4), cache=cache)
  pid, pm, rid, rm = _group_batch(0)
  with pytest.raises(ValueError, match="prompt_group=5"):
    score_responses(model, pid, pm, rid, rm, prompt_group=5)  # 12 rows
  with pytest.raises(ValueError, match="split into a prefix of 3 and 2 suffixes"):
    q = jnp.zeros((1, 8, 2, 4))
    attention_lib.attend_shared_prefix(q, q, q, jnp.ones((1, 8)), prefix_len=3, group=2, impl="full", block=4)


def test_micro_batches_must_hold_whole_groups():
  cfg = ts.StepConfig(group_size=4, num_minibatches=2, num_microbatches=2, share_prompt=True)
  with pytest.raises(ValueError, match=r"rl.share_prompt=True: a micro-batch of 4 rows must hold whole "
                                       r"groups of rl.group_size=4 that split over the 2 devices"):
    cfg.check_batch(16, data_shards=2)
  cfg.check_batch(64, data_shards=2)  # 8 rows: two groups, one per device
  ts.StepConfig(group_size=4, num_minibatches=2, num_microbatches=2).check_batch(16, 2)
  assert cfg.prompt_group == 4 and ts.StepConfig(group_size=4).prompt_group == 1
  with pytest.raises(ValueError, match="rl.share_prompt"):
    schema.check("rl.share_prompt", "yes")


def test_the_config_key_reaches_the_update():
  config = schema.parse(tu.smoke_config(**{"rl.share_prompt": True}))
  assert checks.step_config(config).prompt_group == config.rl.group_size
  assert checks.step_config(schema.parse(tu.smoke_config())).prompt_group == 1


@pytest.mark.slow
@pytest.mark.parametrize("mesh_shape", [{"data": 1, "fsdp": 1, "tensor": 1},
                                        {"data": 2, "fsdp": 2, "tensor": 2}])
def test_a_train_step_with_shared_prompts_equals_the_plain_step(mesh_shape):
  """Whole steps (2 mini-batches x 2 micro-batches, balanced and token
  aggregation) on one device and with rows and weights sharded 2 x 2 x 2."""
  import test_train_step as tts
  devices = jax.devices()[:int(np.prod(list(mesh_shape.values())))]
  mesh = sharding_lib.make_mesh(mesh_shape, devices=devices)
  batch = tu.rollout_batch(5, n=64)  # 4 groups per micro-batch, one per row shard
  G = 4
  for key in ("prompt_ids", "prompt_mask"):  # group-major: one prompt per group
    batch[key] = np.repeat(batch[key][::G], G, 0)
  for aggregation in ("balanced", "token"):
    results = []
    for share in (False, True):
      cfg = ts.StepConfig(group_size=G, aggregation=aggregation, eps_high=0.28, num_minibatches=2,
                          num_microbatches=2, share_prompt=share)
      cfg.check_batch(64, data_shards=mesh_shape["data"] * mesh_shape["fsdp"])
      state, step, place = tts._setup(mesh, cfg=cfg, eps=1e-3)
      start = tu.host_params(state)
      state, metrics = step(state, place(batch))
      results.append((tu.host_params(state), jax.device_get(metrics)))
    (p_rows, m_rows), (p_shared, m_shared) = results
    assert tu.max_abs_diff(p_rows, start) > 1e-4
    assert tu.max_abs_diff(p_rows, p_shared) < 1e-6
    for name in ("loss", "grad_norm", "w_pos", "w_neg", "entropy", "ratio_max"):
      np.testing.assert_allclose(m_shared[name], m_rows[name], rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_a_run_with_shared_prompts_matches_the_plain_run(tmp_path):
  """configs/tiny.py:smoke with recomputed old log-probs and a KL reference
  (both scorers grouped too): the first RL step, sampled from the same
  warmed-up policy, has the same loss, gradient norm, ratios and KL either way."""
  from ba_jax.run import metrics as metrics_lib
  from ba_jax.run import trainer
  records = {}
  for share in (False, True):
    # 2 groups per mini-batch, one on each of 2 row shards (the other devices: tensor).
    config = tu.smoke_config(**{"rl.share_prompt": share, "rl.old_logp": "recompute",
                                "loss.kl_coef": 0.05, "mesh.data": 2, "mesh.tensor": -1})
    workdir = str(tmp_path / f"share_{share}")
    trainer.run(config, workdir)
    records[share] = metrics_lib.read_metrics(workdir)
  assert sorted(records[True]) == [1, 2, 3]
  first_rows, first_shared = records[False][1], records[True][1]
  assert first_rows["reward_mean"] == first_shared["reward_mean"]  # the same samples
  for name in ("loss", "grad_norm", "kl_ref", "approx_kl", "ratio_mean", "entropy"):
    assert np.isfinite(first_shared[name]), name
    np.testing.assert_allclose(first_shared[name], first_rows[name], rtol=1e-4, atol=1e-6, err_msg=name)
  for record in records[True].values():
    assert record["nonfinite"] == 0
