"""Our decoder is `transformers`' function: logits, gradients, KV cache, dtypes, config."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from ba_jax.policy import hf
from ba_jax.policy import model as model_lib
from ba_jax.policy.model import Decoder, ModelConfig, init_cache
from model_utils import KINDS, left_padded_batch, make_hf_model, save_tiny_model, torch_logits

# float32 logits of magnitude ~5 through 2 layers: summation-order differences are ~1e-6.
ATOL = 1e-4


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  return {kind: save_tiny_model(kind, tmp_path_factory.mktemp(kind), with_tokenizer=False) for kind in KINDS}


@pytest.mark.parametrize("kind", KINDS)
def test_logits_match_transformers_on_left_padded_batch(checkpoints, kind):
  ids, mask = left_padded_batch(seed=1, batch=3, length=11)
  ref = torch_logits(make_hf_model(kind), ids, mask)
  model, _ = hf.load_pretrained(checkpoints[kind])
  ours = np.asarray(model(ids, mask))
  assert ours.dtype == np.float32 and ours.shape == ref.shape
  valid = mask.astype(bool)
  assert np.abs(ref[valid]).max() > 1.0  # the comparison is not between near-zero numbers
  np.testing.assert_allclose(ours[valid], ref[valid], atol=ATOL, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "llama"])
def test_gradients_match_transformers(checkpoints, kind):
  """d(sum of log-probs of the next tokens)/d(weights) equals torch's autograd."""
  ids, mask = left_padded_batch(seed=2, batch=2, length=8)
  hf_model = make_hf_model(kind)
  ids_t, mask_t = torch.as_tensor(ids, dtype=torch.long), torch.as_tensor(mask, dtype=torch.long)
  logits_t = hf_model(input_ids=ids_t, attention_mask=mask_t,
                      position_ids=torch.clamp(mask_t.cumsum(-1) - 1, min=0)).logits
  logp_t = torch.log_softmax(logits_t[:, :-1], -1).gather(-1, ids_t[:, 1:, None])[..., 0]
  both = mask[:, 1:] * mask[:, :-1]  # a pad position's logits are junk in both models
  (logp_t * torch.as_tensor(both)).sum().backward()

  model, config = hf.load_pretrained(checkpoints[kind])

  def loss(m):
    logits = m(ids, mask)
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1]), ids[:, 1:, None], -1)[..., 0]
    return jnp.sum(logp * both)

  grads = nnx.to_pure_dict(nnx.grad(loss)(model))
  hf_grads = {n: p.grad.numpy() for n, p in hf_model.named_parameters()}
  for spec in hf.weight_specs(config):
    g = spec.lookup(grads)
    ref = hf_grads[spec.hf_name]
    scale = max(np.abs(ref).max(), 1.0)
    np.testing.assert_allclose(spec.to_hf(np.asarray(g)), ref, atol=1e-4 * scale, rtol=0,
                               err_msg=spec.hf_name)


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_kv_cache_prefill_then_decode_matches_full_forward(checkpoints, kind):
  ids, mask = left_padded_batch(seed=3, batch=3, length=10)
  model, config = hf.load_pretrained(checkpoints[kind])
  full = np.asarray(model(ids, mask))
  prefill = 6
  cache = init_cache(config, batch_size=3, max_len=16)
  logits, cache = model(ids[:, :prefill], mask[:, :prefill], cache=cache)
  pieces = [np.asarray(logits)]
  step = nnx.jit(lambda m, tok, c: m(tok, cache=c))
  for t in range(prefill, ids.shape[1]):
    logits, cache = step(model, ids[:, t:t + 1], cache)
    pieces.append(np.asarray(logits))
  decoded = np.concatenate(pieces, axis=1)
  valid = mask.astype(bool)
  np.testing.assert_allclose(decoded[valid], full[valid], atol=ATOL, rtol=0)
  assert int(cache.index) == ids.shape[1]
  np.testing.assert_array_equal(np.asarray(cache.mask[:, :ids.shape[1]]), mask)
  assert not np.asarray(cache.mask[:, ids.shape[1]:]).any()


@pytest.mark.slow
def test_kv_cache_chunked_prefill_matches_one_prefill(checkpoints):
  ids, mask = left_padded_batch(seed=4, batch=2, length=9)
  model, config = hf.load_pretrained(checkpoints["qwen3"])
  one, _ = model(ids, mask, cache=init_cache(config, 2, 9))
  a, cache = model(ids[:, :4], mask[:, :4], cache=init_cache(config, 2, 9))
  b, cache = model(ids[:, 4:], mask[:, 4:], cache=cache)
  valid = mask.astype(bool)
  np.testing.assert_allclose(np.concatenate([a, b], 1)[valid], np.asarray(one)[valid], atol=ATOL, rtol=0)


def test_pad_tokens_do_not_change_valid_logits(checkpoints):
  ids, mask = left_padded_batch(seed=5, batch=3, length=8)
  model, _ = hf.load_pretrained(checkpoints["llama"])
  other = np.where(mask == 1, ids, 77)
  valid = mask.astype(bool)
  np.testing.assert_allclose(np.asarray(model(other, mask))[valid], np.asarray(model(ids, mask))[valid],
                             atol=1e-6, rtol=0)


def test_cache_overflow_is_an_error(checkpoints):
  model, config = hf.load_pretrained(checkpoints["qwen2"])
  with pytest.raises(ValueError, match="cache overflow"):
    model(np.ones((1, 5), np.int32), cache=init_cache(config, 1, 4))


@pytest.mark.slow
@pytest.mark.parametrize("remat", [True, "dots_with_no_batch_dims_saveable"])
def test_remat_gives_same_logits_and_gradients(checkpoints, remat):
  ids, mask = left_padded_batch(seed=6, batch=2, length=8)
  plain, _ = hf.load_pretrained(checkpoints["qwen2"])
  rematted, config = hf.load_pretrained(checkpoints["qwen2"], remat=remat)
  assert config.remat == ("full" if remat is True else remat)

  def loss(m):
    return jnp.sum(jax.nn.log_softmax(m(ids, mask))[..., 5] * mask)

  g_plain = nnx.grad(loss)(plain)
  g_remat = nnx.jit(nnx.grad(loss))(rematted)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5), nnx.to_pure_dict(g_plain),
               nnx.to_pure_dict(g_remat))


@pytest.mark.slow
def test_remat_policy_sets_what_the_scanned_backward_keeps():
  """Under the layer scan the saved residuals are explicit, so XLA's temporaries follow the policy."""
  base = ModelConfig("qwen3", vocab_size=64, hidden_size=64, intermediate_size=256, num_layers=4, num_heads=4,
                     num_kv_heads=2, head_dim=16, qk_norm=True, scan_unroll=1)  # the scan, not auto's unroll
  ids = jnp.ones((4, 128), jnp.int32)
  temp = {}
  for policy in ("none", "dots_with_no_batch_dims_saveable", "full"):
    graphdef, params = nnx.split(Decoder(dataclasses.replace(base, remat=policy), rngs=nnx.Rngs(0)))
    grad = jax.jit(jax.grad(lambda p: jnp.sum(nnx.merge(graphdef, p)(ids)[..., 0])))
    temp[policy] = grad.lower(params).compile().memory_analysis().temp_size_in_bytes
  assert temp["full"] < temp["dots_with_no_batch_dims_saveable"] < temp["none"], temp
  with pytest.raises(ValueError, match="remat='some'"):
    dataclasses.replace(base, remat="some")


def test_bfloat16_params_and_compute(checkpoints):
  ids, mask = left_padded_batch(seed=7, batch=2, length=8)
  ref, _ = hf.load_pretrained(checkpoints["qwen3"])
  model, config = hf.load_pretrained(checkpoints["qwen3"], dtype="bfloat16", param_dtype="bfloat16")
  params = jax.tree.leaves(nnx.state(model, nnx.Param))
  assert all(p.dtype == jnp.bfloat16 for p in params)
  logits = model(ids, mask)
  assert logits.dtype == jnp.float32
  valid = mask.astype(bool)
  ref_logits = np.asarray(ref(ids, mask))[valid]
  # bf16 keeps 8 mantissa bits (rel. error 2^-8 per rounding); a few dozen roundings per logit.
  err = np.abs(np.asarray(logits)[valid] - ref_logits).max()
  assert err < 0.1 * np.abs(ref_logits).max(), err


@pytest.mark.slow
def test_random_init_and_every_param_has_logical_axes():
  config = ModelConfig("qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=16, qk_norm=True)
  model = Decoder(config, rngs=nnx.Rngs(1))
  known = {"vocab", "embed", "mlp", "heads", "kv_heads", "head_dim", "norm"}
  for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    axes = var.get_metadata()["out_sharding"]
    assert len(axes) == var[...].ndim and set(axes) <= known | {"layers"}, (path, axes)
    # The decoder layers are one stack: a leading "layers" axis of num_layers, and only there.
    stacked = path[0] == "layers"
    assert (axes[0] == "layers") == stacked and axes.count("layers") == int(stacked), (path, axes)
    assert not stacked or var[...].shape[0] == config.num_layers, (path, var[...].shape)
  logits = model(np.zeros((2, 3), np.int32))
  assert logits.shape == (2, 3, 64) and np.isfinite(np.asarray(logits)).all()


@pytest.mark.parametrize("kind", KINDS)
def test_config_round_trips_through_hf_dict(kind):
  from model_utils import tiny_hf_config
  d = tiny_hf_config(kind).to_dict()
  config = ModelConfig.from_hf_dict(d)
  assert ModelConfig.from_hf_dict(config.to_hf_dict()) == config
  hash(config)  # usable as a static jit argument
  assert config.head_dim == (32 if kind == "qwen3" else 16)
  assert config.qk_norm == (kind == "qwen3") and config.attention_bias == kind.startswith("qwen2")
  if kind == "llama":
    assert dict(config.rope_scaling)["rope_type"] == "llama3" and config.rope_theta == 500000.0


def test_config_errors_name_the_bad_value():
  with pytest.raises(ValueError, match=r"'mistral'.*qwen2.*qwen3.*llama"):
    ModelConfig.from_hf_dict({"model_type": "mistral", "architectures": ["MistralForCausalLM"]})
  d = ModelConfig("llama", 8, 8, 8, 1, 2, 1, 4).to_hf_dict()
  d["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}
  with pytest.raises(ValueError, match="'yarn'"):
    ModelConfig.from_hf_dict(d)
  with pytest.raises(ValueError, match="num_kv_heads=3"):
    ModelConfig("llama", 8, 8, 8, 1, 4, 3, 4)
  with pytest.raises(ValueError, match="dtype='float31'"):
    ModelConfig("llama", 8, 8, 8, 1, 2, 1, 4, dtype="float31")


@pytest.mark.slow
@pytest.mark.parametrize("unroll", [0, 2, 3, "loop"])
def test_scan_unroll_changes_neither_logits_nor_gradients(unroll):
  """model.scan_unroll only changes how the layer scan is compiled (3 does
  not divide the 4 layers: lax.scan handles the remainder; 0 is auto, every
  layer here on CPU); "loop": per-layer modules passed as `layers=` run in a
  Python loop (the pre-scan program that bench_model times the scan against)."""
  base = ModelConfig(model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=4,
                     num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True, remat="full", scan_unroll=1)
  ids = jax.random.randint(jax.random.key(1), (2, 12), 0, 64)

  def logits_and_grads(config):
    graphdef, params = nnx.split(Decoder(config, rngs=nnx.Rngs(0)), nnx.Param)
    loss = lambda p: jnp.mean(nnx.merge(graphdef, p)(ids) ** 2)
    return nnx.merge(graphdef, params)(ids), jax.grad(loss)(params)

  def loop_logits_and_grads(config):
    model = Decoder(config, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    layer_def = nnx.split(model.layer_slices()[0], nnx.Param)[0]
    per_layer = tuple(nnx.split(layer, nnx.Param)[1] for layer in model.layer_slices())

    def logits(params, per_layer):
      layers = tuple(nnx.merge(layer_def, s) for s in per_layer)
      return nnx.merge(graphdef, params)(ids, layers=layers)
    grads = jax.grad(lambda pl: jnp.mean(logits(params, pl) ** 2))(per_layer)
    stacked = jax.tree.map(lambda *g: jnp.stack(g), *grads)  # per-layer grads, as the stack's
    return logits(params, per_layer), stacked

  want_logits, want_grads = logits_and_grads(base)
  if unroll == "loop":
    got_logits, got_grads = loop_logits_and_grads(base)
    want_grads = want_grads["layers"]
  else:
    got_logits, got_grads = logits_and_grads(dataclasses.replace(base, scan_unroll=unroll))
  np.testing.assert_allclose(got_logits, want_logits, rtol=1e-5, atol=1e-5)
  for got, want in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
  assert len(jax.tree.leaves(got_grads)) == len(jax.tree.leaves(want_grads))
  with pytest.raises(ValueError, match="scan_unroll=-1"):
    dataclasses.replace(base, scan_unroll=-1)
  auto = dataclasses.replace(base, scan_unroll=0)
  assert (model_lib.layer_unroll(auto, "cpu"), model_lib.layer_unroll(auto, "tpu"),
          model_lib.layer_unroll(base, "cpu")) == (4, 1, 1)
