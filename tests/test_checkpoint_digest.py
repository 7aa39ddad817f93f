"""Checkpoints prove their integrity: damage that orbax reads without an
error (a flipped byte, an edited value, a NaN) is caught by the digests or
the non-finite check, and the newest intact step is used instead."""
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from ba_jax.run import checkpointing
from ba_jax.run import digest
from ba_jax.run import setup as setup_lib
import checkpoint_damage as cd
import trainer_utils as tu

MESH = {"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2}


# ---------------------------------------------------------------- the digest


def _on(mesh_shape, x, spec):
  mesh = jax.make_mesh(mesh_shape, ("data", "fsdp", "tensor"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 3)
  return jax.device_put(x, jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec(*spec)))


def test_the_digest_is_the_array_s_on_any_mesh_and_sees_one_bit():
  rng = np.random.default_rng(0)
  tree = {"w": rng.normal(size=(16, 8)).astype(np.float32),
          "h": jnp.asarray(rng.normal(size=(8, 16)), jnp.bfloat16),
          "n": np.arange(8, dtype=np.int32), "flag": np.array([True, False]),
          "step": np.int32(7)}
  one_device = digest.digests(jax.tree.map(jnp.asarray, tree))
  sharded = digest.digests({
      "w": _on((2, 2, 2), tree["w"], ("fsdp", "tensor")),
      "h": _on((2, 2, 2), tree["h"], (None, ("fsdp", "tensor"))),
      "n": _on((1, 8, 1), tree["n"], ("fsdp",)),
      "flag": _on((2, 2, 2), tree["flag"], ("data",)),
      "step": _on((2, 2, 2), tree["step"], ())})
  assert {k: d.digest for k, d in sharded.items()} == {
      k: d.digest for k, d in one_device.items()}
  # Each shard is keyed by its place in the global array, as jax has it.
  w = _on((2, 2, 2), tree["w"], ("fsdp", "tensor"))
  assert set(sharded["w"].shards) == {
      ",".join(f"{s.start}:{s.stop}" for s in index)
      for index in w.sharding.devices_indices_map(w.shape).values()} == {
          "0:8,0:4", "0:8,4:8", "8:16,0:4", "8:16,4:8"}
  assert set(sharded["h"].shards) == {f"0:8,{4 * i}:{4 * i + 4}"
                                      for i in (0, 1, 2, 3)}
  assert list(sharded["step"].shards) == [""]
  # The lowest bit of one float: one shard and the array's digest change.
  flipped = tree["w"].copy()
  flipped.view(np.uint32)[9, 5] ^= 1
  after = digest.digests({"w": _on((2, 2, 2), flipped, ("fsdp", "tensor"))})
  assert after["w"].digest != sharded["w"].digest
  assert [k for k in after["w"].shards
          if after["w"].shards[k] != sharded["w"].shards[k]] == ["8:16,4:8"]
  assert digest.mismatch({"w": after["w"]}, digest.to_json(
      {"w": sharded["w"]})) == "digest mismatch: w shard [8:16,4:8]"
  # The same change seen on another mesh: the whole array's digest.
  other = digest.digests({"w": jnp.asarray(flipped)})
  assert digest.mismatch(other, digest.to_json({"w": sharded["w"]})) == (
      "digest mismatch: w (whole array: restored on another mesh)")
  # Swapping two elements changes it too (the index is hashed in).
  swapped = tree["w"].copy()
  swapped[0, 0], swapped[0, 1] = tree["w"][0, 1], tree["w"][0, 0]
  assert digest.digests({"w": jnp.asarray(swapped)})["w"].digest != (
      one_device["w"].digest)
  nan = tree["w"].copy()
  nan[3, 3], nan[4, 4] = np.nan, np.inf
  assert digest.nonfinite(digest.digests({"w": jnp.asarray(nan)})) == (
      "non-finite values (NaN or inf): 2 in w")


# ------------------------------------------------- damaged checkpoint steps


def _setup(**overrides):
  return setup_lib.make_setup(tu.smoke_config(**{**MESH, **overrides}),
                              abstract=True)


def _state(setup, seed: int):
  """A TrainState of the smoke model on ``setup``'s mesh, every parameter
  and AdamW moment non-zero and positive (made by a cheap formula: random
  draws for ~45 sharded arrays take the CPU half a minute to compile)."""
  leaves, tree = jax.tree.flatten(setup_lib.abstract_state(setup))

  def fill(x):
    if not jnp.issubdtype(x.dtype, jnp.floating):
      return jnp.full(x.shape, seed, x.dtype)
    phase = jnp.arange(np.prod(x.shape), dtype=x.dtype).reshape(x.shape)
    return 1e-3 * (1.5 + jnp.cos(phase * (0.37 + seed)))

  return jax.jit(lambda: tree.unflatten([fill(x) for x in leaves]),
                 out_shardings=setup.state_sharding)()


def _host(tree):
  return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]


def _equal(a, b) -> bool:
  return all(np.array_equal(x, y) for x, y in zip(_host(a), _host(b)))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """Steps 1 and 2 of a smoke-model TrainState on a 2x2x2 mesh."""
  workdir = str(tmp_path_factory.mktemp("saved"))
  setup = _setup()
  states = {step: _state(setup, step) for step in (1, 2)}
  ckpt = checkpointing.Checkpointer(workdir, keep=5, async_save=False)
  for step, state in states.items():
    assert ckpt.save(step, state, {"data_position": 10 * step})
  ckpt.close()
  return workdir, setup_lib.abstract_state(setup), states


def _copy(saved, tmp_path) -> str:
  workdir = str(tmp_path / "run")
  shutil.copytree(saved[0], workdir)
  return workdir


@pytest.mark.parametrize("damage", sorted(cd.IN_PLACE))
def test_orbax_alone_reads_the_damage_without_an_error(saved, tmp_path,
                                                        damage):
  """What the digests are for: each of these restores through orbax and
  differs from what was saved."""
  workdir, (_, abstract, states) = _copy(saved, tmp_path), saved
  cd.DAMAGE[damage](workdir, 2, abstract)
  manager = ocp.CheckpointManager(os.path.join(workdir, "checkpoints"))
  state = manager.restore(2, args=ocp.args.Composite(
      state=ocp.args.StandardRestore(abstract)))["state"]
  manager.close()
  assert not _equal(state, states[2])


@pytest.mark.parametrize("damage", sorted(cd.DAMAGE))
def test_a_damaged_step_falls_back_with_one_warning(saved, tmp_path, damage):
  workdir, (_, abstract, states) = _copy(saved, tmp_path), saved
  array = cd.DAMAGE[damage](workdir, 2, abstract)
  warnings = []
  ckpt = checkpointing.Checkpointer(workdir, keep=5, async_save=False)
  step, state, meta = ckpt.restore_intact(abstract, warn=warnings.append,
                                          set_aside=True)
  assert (step, meta) == (1, {"data_position": 10})
  assert _equal(state, states[1])
  assert len(warnings) == 1 and "\n" not in warnings[0], warnings
  assert warnings[0].startswith("WARNING: checkpoint step 2 (state: "
                                + cd.says(damage, array)), warnings[0]
  assert warnings[0].endswith("is damaged; falling back to step 1")
  assert ckpt.all_steps() == [1]
  assert os.path.isdir(os.path.join(workdir, "damaged_checkpoints", "2"))
  ckpt.close()


def test_another_mesh_verifies_the_whole_arrays(saved, tmp_path):
  """Saved on data 2 x fsdp 2 x tensor 2, restored onto data 8 (each array
  whole on every device): an intact step verifies, a one-bit change in a
  moment is found by the array's digest."""
  workdir, (_, _, states) = _copy(saved, tmp_path), saved
  other = setup_lib.abstract_state(
      _setup(**{"mesh.data": 8, "mesh.fsdp": 1, "mesh.tensor": 1}))
  warnings = []
  ckpt = checkpointing.Checkpointer(workdir, keep=5, async_save=False)
  step, state, _ = ckpt.restore_intact(other, warn=warnings.append)
  assert step == 2 and not warnings and _equal(state, states[2])
  moment = cd.edit_value(cd.step_dir(workdir, 2), cd.moment(workdir, 2),
                         cd.lowest_bit)
  step, state, _ = ckpt.restore_intact(other, warn=warnings.append)
  assert step == 1 and _equal(state, states[1])
  assert warnings == [
      f"WARNING: checkpoint step 2 (state: digest mismatch: {moment} (whole "
      f"array: restored on another mesh)) under {ckpt.directory} is "
      "damaged; falling back to step 1"]
  with pytest.raises(checkpointing.DamagedStep, match="digest mismatch"):
    ckpt.restore(other, 2)
  ckpt.close()


def test_a_step_saved_without_digests_is_checked_for_non_finite_values(
    saved, tmp_path):
  """``digest=False`` (and a step saved before digests existed)."""
  _, abstract, states = saved
  plain = checkpointing.Checkpointer(str(tmp_path), async_save=False,
                                     digest=False)
  assert plain.save(3, states[2], {"data_position": 30})
  nan = jax.tree_util.tree_map_with_path(
      lambda path, x: x.at[0, 0, 0].set(jnp.inf)
      if digest._name(path) == cd.PARAM else x, states[2])
  assert plain.save(4, nan, {"data_position": 40})
  metadata = json.load(open(os.path.join(plain.directory, "4",
                                         "_CHECKPOINT_METADATA")))
  assert "digest" not in (metadata.get("custom_metadata") or {})
  warnings = []
  step, state, _ = plain.restore_intact(abstract, warn=warnings.append)
  assert step == 3 and _equal(state, states[2])
  assert f"(state: non-finite values (NaN or inf): 1 in {cd.PARAM})" in (
      warnings[0])
  plain.close()


def test_the_digest_is_the_documented_formula():
  """A plain numpy evaluation of ``digest``'s formula: a new compiler or
  JAX version cannot change the digests of saved checkpoints unnoticed."""

  def fmix32(h):
    for shift, mult in ((16, 0x85EBCA6B), (13, 0xC2B2AE35)):
      h = (h ^ (h >> np.uint32(shift))) * np.uint32(mult)
    return h ^ (h >> np.uint32(16))

  x = np.random.default_rng(3).normal(size=(3, 40, 7)).astype(np.float32)
  with np.errstate(over="ignore"):
    key = (np.arange(x.size, dtype=np.uint32) * np.uint32(0x9E3779B1)
           + np.uint32(0x243F6A88))
    h1 = fmix32(x.reshape(-1).view(np.uint32) ^ key)
    h2 = h1 * (key | np.uint32(1))
  want = f"{int(h1.sum(dtype=np.uint32)):08x}{int(h2.sum(dtype=np.uint32)):08x}"
  assert digest.digests({"x": jnp.asarray(x)})["x"].digest == want
  assert digest.ALGORITHM == "adhash-fmix32x2-v2"


def test_a_damaged_kl_reference_is_refused_in_one_line(tmp_path):
  """The frozen KL reference (saved once, read on every resume) carries
  digests too; no older copy exists, so damage is refused, not skipped."""
  params = {"w": jnp.arange(64.0).reshape(8, 8), "b": jnp.ones(4)}
  abstract = checkpointing.abstract_like(params)
  checkpointing.reference_params(str(tmp_path), params, abstract)
  again = checkpointing.reference_params(str(tmp_path), None, abstract)
  assert _equal(again, params)
  spec = {"driver": "zarr", "kvstore": {
      "driver": "ocdbt", "base": f"file://{tmp_path}/reference/",
      "path": "w/"}}
  array = cd.ts.open(spec).result()
  values = array.read().result()
  cd.lowest_bit(values)
  array.write(values).result()
  with pytest.raises(checkpointing.NoIntactCheckpoint) as info:
    checkpointing.reference_params(str(tmp_path), None, abstract)
  message = str(info.value)
  assert "\n" not in message and message.startswith(
      f"the KL reference policy under {tmp_path}/reference is damaged "
      "(digest mismatch: w shard [0:8,0:8])")


def test_small_arrays_hashed_together_get_their_own_digests(monkeypatch):
  """Uncut arrays of at most ``GROUP_MAX_ELEMENTS`` are hashed in one
  concatenated pass: each gets exactly the digest and non-finite count that
  hashing it alone gives (mixed dtypes, a scalar, an empty array, arrays
  replicated over a mesh, one over an Explicit mesh axis, one cut)."""
  rng = np.random.default_rng(5)
  nan = rng.normal(size=(6, 5)).astype(np.float32)
  nan[2, 1], nan[4, 0] = np.nan, -np.inf
  auto = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 3)
  explicit = jax.make_mesh((1, 1, 8), ("data", "fsdp", "tensor"),
                           axis_types=(jax.sharding.AxisType.Explicit,) * 3)
  P, NS = jax.sharding.PartitionSpec, jax.sharding.NamedSharding
  tree = {
      "w": jax.device_put(rng.normal(size=(4, 16, 8)).astype(np.float32),
                          NS(auto, P())),
      "cut": jax.device_put(rng.normal(size=(16, 8)).astype(np.float32),
                            NS(auto, P("fsdp", "tensor"))),
      "h": jax.device_put(jnp.asarray(rng.normal(size=(8, 3)), jnp.bfloat16),
                          NS(auto, P(None, None))),
      "nan": jax.device_put(nan, NS(auto, P())),
      "n": jax.device_put(np.arange(7, dtype=np.int32), NS(auto, P())),
      "u8": jax.device_put(np.arange(300, dtype=np.uint8), NS(auto, P())),
      "flag": jax.device_put(np.array([True, False, True]), NS(auto, P())),
      "step": jax.device_put(np.int32(11), NS(auto, P())),
      "empty": jax.device_put(np.zeros((0, 4), np.float32), NS(auto, P())),
  }
  together = digest.digests(tree)
  # The grouping is decided when the program is traced: a fresh one.
  monkeypatch.setattr(digest, "GROUP_MAX_ELEMENTS", -1)
  digest._jitted.cache_clear()
  alone = digest.digests(tree)
  digest._jitted.cache_clear()
  assert together == alone
  assert together["nan"].nonfinite == 2 and together["w"].nonfinite == 0
  assert together["empty"].digest == "0" * 16
  assert set(together["cut"].shards) == {"0:8,0:4", "0:8,4:8", "8:16,0:4",
                                         "8:16,4:8"}
  # An array laid out over an Explicit axis keeps its own pass (reshaping it
  # would need the output's layout); the same digest as on one device.
  x = rng.normal(size=(8, 8)).astype(np.float32)
  on_explicit = digest.digests(
      {"x": jax.device_put(x, NS(explicit, P(None, "data")))})
  assert on_explicit["x"].digest == digest.digests(
      {"x": jnp.asarray(x)})["x"].digest
  assert digest._groups([jnp.zeros((3,))], [P(None, "data")], explicit) == []
