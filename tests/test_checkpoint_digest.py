"""Checkpoints prove their integrity: damage that orbax reads without an
error (a flipped byte, an edited value, a NaN) is caught by the digests or
the non-finite check, and the newest intact step is used instead."""
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


def test_a_deleted_digest_is_damage_and_a_step_saved_without_one_is_not(
    saved, tmp_path):
  workdir, (_, abstract, states) = _copy(saved, tmp_path), saved
  os.remove(os.path.join(cd.step_dir(workdir, 2), "digest", "metadata"))
  warnings = []
  ckpt = checkpointing.Checkpointer(workdir, keep=5, async_save=False)
  assert ckpt.restore_intact(abstract, warn=warnings.append)[0] == 1
  assert "(digest: digest/metadata is missing)" in warnings[0]
  ckpt.close()
  # A step saved without digests (digest=False, or before they existed)
  # is verified by the non-finite check alone.
  plain = checkpointing.Checkpointer(str(tmp_path / "plain"),
                                     async_save=False, digest=False)
  assert plain.save(3, states[2], {"data_position": 30})
  assert not os.path.exists(os.path.join(plain.directory, "3", "digest"))
  step, state, _ = plain.restore_intact(abstract)
  assert step == 3 and _equal(state, states[2])
  plain.close()
