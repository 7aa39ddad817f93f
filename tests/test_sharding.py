"""Rules table, meshes, and sharded == single-device on 8 fake CPU devices."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from ba_jax.policy import hf
from ba_jax.policy import sharding as sh
from ba_jax.policy.model import Decoder, ModelConfig
from model_utils import left_padded_batch, save_tiny_model


def test_eight_fake_devices():
  assert jax.device_count() == 8


def test_make_mesh_fills_the_minus_one_axis():
  mesh = sh.make_mesh({"data": -1, "fsdp": 2, "tensor": 2})
  assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
  assert dict(sh.make_mesh({"data": 1, "fsdp": -1, "tensor": 1}).shape) == {"data": 1, "fsdp": 8, "tensor": 1}


@pytest.mark.parametrize("shape, message", [
    ({"data": 3, "fsdp": -1}, "3 does not divide the 8 devices"),
    ({"data": -1, "fsdp": -1}, "at most one axis"),
    ({"data": 2, "fsdp": 2}, "uses 4 devices; 8 are available"),
    ({"data": 0, "fsdp": -1}, "positive int or -1"),
])
def test_make_mesh_errors(shape, message):
  with pytest.raises(ValueError, match=message):
    sh.make_mesh(shape)


def test_logical_to_spec_follows_rules_and_replicates_what_does_not_divide():
  mesh = sh.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  rules = sh.DEFAULT_RULES
  assert sh.logical_to_spec(mesh, rules, ("embed", "mlp"), (64, 128)) == P("fsdp", "tensor")
  assert sh.logical_to_spec(mesh, rules, ("batch", None)) == P(("data", "fsdp"), None)
  # 1 kv head cannot be split over a 2-way tensor axis: replicated, not an error.
  assert sh.logical_to_spec(mesh, rules, ("embed", "kv_heads", "head_dim"), (64, 1, 16)) == P("fsdp", None, None)
  # one mesh axis is used at most once per array
  assert sh.logical_to_spec(mesh, rules, ("heads", "mlp"), (4, 8)) == P("tensor", None)
  with pytest.raises(ValueError, match="logical axis 'experts' has no sharding rule"):
    sh.logical_to_spec(mesh, rules, ("experts",))
  with pytest.raises(ValueError, match="mesh axis 'model' not in mesh axes"):
    sh.logical_to_spec(mesh, (("embed", "model"),), ("embed",))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  return save_tiny_model("qwen2", tmp_path_factory.mktemp("qwen2"), with_tokenizer=False)


def _loss(model, ids, mask):
  logits = model(ids, mask)
  logp = jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1]), ids[:, 1:, None], -1)[..., 0]
  return jnp.sum(logp * mask[:, 1:] * mask[:, :-1])


@pytest.mark.slow
@pytest.mark.parametrize("mesh_shape", [{"data": 2, "fsdp": 2, "tensor": 2}, {"data": 1, "fsdp": 8, "tensor": 1}])
def test_sharded_load_gives_same_logits_and_gradients(checkpoint, mesh_shape):
  mesh = sh.make_mesh(mesh_shape)
  ids, mask = left_padded_batch(seed=21, batch=8, length=8)
  single, config = hf.load_pretrained(checkpoint)
  sharded, _ = hf.load_pretrained(checkpoint, mesh=mesh, rules=sh.DEFAULT_RULES)

  q = sharded.layers.self_attn.q_proj[...]  # stacked: [layers, embed, heads, head_dim]
  expected = sh.logical_to_spec(mesh, sh.DEFAULT_RULES, ("layers", "embed", "heads", "head_dim"), q.shape)
  assert q.sharding.spec == expected and len(q.sharding.device_set) == 8
  if mesh_shape["fsdp"] == 8:  # every device holds 1/8 of the embedding matrix, none the whole
    emb = sharded.embed_tokens[...]
    assert {s.data.shape for s in emb.addressable_shards} == {(emb.shape[0], emb.shape[1] // 8)}

  batch_sharding = sh.data_sharding(mesh)
  ids_s, mask_s = jax.device_put(ids, batch_sharding), jax.device_put(mask, batch_sharding)
  logits_s = nnx.jit(lambda m, i, k: m(i, k))(sharded, ids_s, mask_s)
  logits_1 = single(ids, mask)
  np.testing.assert_allclose(np.asarray(logits_s), np.asarray(logits_1), atol=1e-5, rtol=0)

  loss_s, grads_s = nnx.jit(nnx.value_and_grad(_loss))(sharded, ids_s, mask_s)
  loss_1, grads_1 = nnx.value_and_grad(_loss)(single, ids, mask)
  np.testing.assert_allclose(loss_s, loss_1, rtol=1e-5)
  g_s, g_1 = nnx.to_pure_dict(grads_s), nnx.to_pure_dict(grads_1)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4, rtol=0), g_s, g_1)


def test_export_from_sharded_model_is_bit_exact(checkpoint, tmp_path):
  mesh = sh.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  sharded, config = hf.load_pretrained(checkpoint, mesh=mesh)
  hf.save_pretrained(sharded, config, tmp_path)
  from safetensors import safe_open
  with safe_open(checkpoint / hf.SAFETENSORS, framework="np") as a, \
       safe_open(tmp_path / hf.SAFETENSORS, framework="np") as b:
    assert sorted(a.keys()) == sorted(b.keys())
    for k in a.keys():
      assert a.get_tensor(k).tobytes() == b.get_tensor(k).tobytes(), k


@pytest.mark.slow
def test_create_sharded_and_shard_model():
  config = ModelConfig("llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=8)
  mesh = sh.make_mesh({"data": 1, "fsdp": 4, "tensor": 2})
  made = sh.create_sharded(lambda: Decoder(config, rngs=nnx.Rngs(3)), mesh)
  moved = sh.shard_model(Decoder(config, rngs=nnx.Rngs(3)), mesh)
  for model in (made, moved):
    up = model.layers.mlp.up_proj[...]  # [layers, embed, mlp]; the layer axis is never split
    assert up.sharding.spec == P(None, "fsdp", "tensor")
    assert {s.data.shape for s in up.addressable_shards} == {(2, 8, 32)}
  # same random draws; jit may fuse the 0.02 scaling differently (1 ulp)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=0),
               nnx.to_pure_dict(nnx.state(made)), nnx.to_pure_dict(nnx.state(moved)))
  shardings = sh.state_shardings(made, mesh)
  flat = dict(nnx.to_flat_state(shardings))
  assert flat[("embed_tokens",)].get_value().spec == P("tensor", "fsdp")
