"""Checkpoints prove their integrity: damage that orbax reads without an
error (a flipped byte, an edited value, a NaN) is caught by the digests or
the non-finite check, and the newest intact step is used instead."""
import glob
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
import tensorstore as ts

from ba_jax.run import checkpointing
from ba_jax.run import digest
from ba_jax.run import setup as setup_lib
from ba_jax.update import train_step as train_step_lib
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


def _names(state):
  return list(digest.digests(state))


def _moment(state) -> str:
  return next(n for n in _names(state) if ".mu." in n and "up_proj" in n)


PARAM = "params.layers.mlp.gate_proj.value"


def _chunks(step_dir: str) -> list[tuple[str, str, int, int]]:
  """(array name, data file, offset, length) of every array chunk stored
  in a data file of a step (from the OCDBT b-tree; the small ones live in
  the tree's nodes)."""
  out = []
  state_dir = os.path.join(step_dir, "state")
  for manifest in glob.glob(f"{state_dir}/ocdbt.process_*/manifest.ocdbt"):
    base = ts.KvStore.open(f"file://{os.path.dirname(manifest)}/").result()
    version = ts.ocdbt.dump(base).result()["versions"][-1]
    assert version["root_height"] == 0  # one node: a small state
    node = ts.ocdbt.dump(base, version["root"]["location"]).result()
    for entry in node["entries"]:
      if "indirect_value" in entry:
        # "value:ocdbt.process_0/:d/<file>:<offset>:<length>"
        _, _, data_file, offset, length = entry["indirect_value"].split(":")
        out.append((entry["key"].decode().split("/")[0],
                    os.path.join(os.path.dirname(manifest), data_file),
                    int(offset), int(length)))
  return out


def _xor(path: str, start: int, count: int, mask: int) -> None:
  data = bytearray(open(path, "rb").read())
  for i in range(start, start + count):
    data[i] ^= mask
  open(path, "wb").write(bytes(data))


def _flip_in_largest_file(step_dir: str, mask: int) -> str:
  """64 bytes in the middle of the arrays stored in the largest data file,
  as the issue did (the file's middle itself may be a b-tree node, whose
  damage orbax may never read); returns the array hit."""
  chunks = _chunks(step_dir)
  largest = max({c[1] for c in chunks}, key=os.path.getsize)
  mine = sorted((c for c in chunks if c[1] == largest), key=lambda c: c[2])
  name, path, offset, length = mine[len(mine) // 2]
  _xor(path, offset + length // 2 - 32, 64, mask)
  return name


def _flip_in_array(step_dir: str, name: str, mask: int) -> str:
  """16 stored bytes in the middle of array ``name``'s first chunk."""
  _, path, offset, length = next(c for c in _chunks(step_dir)
                                 if c[0] == name)
  _xor(path, offset + length // 2, 16, mask)
  return name


def _edit_value(step_dir: str, name: str, edit) -> None:
  """Rewrites array ``name`` of a saved step in place through tensorstore
  (``edit(numpy array)`` changes it): a consistent, readable checkpoint
  whose digest table is not updated."""
  spec = {"driver": "zarr", "kvstore": {
      "driver": "ocdbt", "base": f"file://{step_dir}/state/",
      "path": f"{name}/"}}
  array = ts.open(spec).result()
  values = array.read().result()
  edit(values)
  array.write(values).result()


def _lowest_bit(values):
  values.reshape(-1).view(np.uint32)[values.size // 2] ^= 1


def _nan(values):
  values.reshape(-1)[values.size // 3] = np.nan


def _nan_saved_with_its_digest(workdir: str, step: int, setup) -> None:
  """The step rewritten by the Checkpointer from its own state with a NaN
  in one parameter: the digests match (the NaN was saved), the values do
  not pass."""
  ckpt = checkpointing.Checkpointer(workdir, keep=5, async_save=False)
  restored = ckpt._manager.restore(step, args=ocp.args.Composite(
      state=ocp.args.StandardRestore(setup_lib.abstract_state(setup)),
      meta=ocp.args.JsonRestore()))
  meta = dict(restored["meta"])
  state = jax.tree_util.tree_map_with_path(
      lambda path, x: x.at[1, 2, 3].set(jnp.nan)
      if digest._name(path) == PARAM else x, restored["state"])
  shutil.rmtree(os.path.join(workdir, "checkpoints", str(step)))
  ckpt._manager.reload()
  assert ckpt.save(step, state, meta)
  ckpt.close()
  return PARAM


def _edited(step_dir: str, name: str, edit) -> str:
  _edit_value(step_dir, name, edit)
  return name


# How a step is damaged: (workdir, step, setup, an AdamW moment's name) ->
# the array hit.
DAMAGE = {
    "data file, high bits": lambda w, s, setup, m: _flip_in_largest_file(
        _dir(w, s), 0xF0),
    "data file, low bits": lambda w, s, setup, m: _flip_in_largest_file(
        _dir(w, s), 0x01),
    "moment stored bytes, high bits": lambda w, s, setup, m: _flip_in_array(
        _dir(w, s), m, 0x80),
    "moment stored bytes, low bits": lambda w, s, setup, m: _flip_in_array(
        _dir(w, s), m, 0x01),
    "moment value, lowest bit": lambda w, s, setup, m: _edited(
        _dir(w, s), m, _lowest_bit),
    "parameter set to NaN": lambda w, s, setup, m: _edited(
        _dir(w, s), PARAM, _nan),
    "parameter saved as NaN": lambda w, s, setup, m: (
        _nan_saved_with_its_digest(w, s, setup)),
}


def _says(damage: str, array: str) -> str:
  """What the warning says after ``checkpoint step S (state: ``."""
  if damage == "parameter saved as NaN":  # the digests agree; NaN does not
    return f"non-finite values (NaN or inf): 1 in {array}"
  return f"digest mismatch: {array} shard ["


# Damage the arrays' own bytes; orbax restores it without an error.
SILENT = [k for k in DAMAGE if k != "parameter saved as NaN"]


def _dir(workdir, step) -> str:
  return os.path.join(workdir, "checkpoints", str(step))


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
  return workdir, setup, states


def _copy(saved, tmp_path) -> str:
  workdir = str(tmp_path / "run")
  shutil.copytree(saved[0], workdir)
  return workdir


@pytest.mark.parametrize("damage", sorted(SILENT))
def test_orbax_alone_reads_the_damage_without_an_error(saved, tmp_path,
                                                        damage):
  """What the digests are for: each of these restores through orbax and
  differs from what was saved."""
  workdir, (_, setup, states) = _copy(saved, tmp_path), saved
  DAMAGE[damage](workdir, 2, setup, _moment(states[2]))
  manager = ocp.CheckpointManager(os.path.join(workdir, "checkpoints"))
  state = manager.restore(2, args=ocp.args.Composite(state=(
      ocp.args.StandardRestore(setup_lib.abstract_state(setup)))))["state"]
  manager.close()
  assert not _equal(state, states[2])


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_step_falls_back_with_one_warning(saved, tmp_path, damage):
  workdir, (_, setup, states) = _copy(saved, tmp_path), saved
  array = DAMAGE[damage](workdir, 2, setup, _moment(states[2]))
  warnings = []
  ckpt = checkpointing.Checkpointer(workdir, keep=5, async_save=False)
  step, state, meta = ckpt.restore_intact(setup_lib.abstract_state(setup),
                                          warn=warnings.append, set_aside=True)
  assert (step, meta) == (1, {"data_position": 10})
  assert _equal(state, states[1])
  assert len(warnings) == 1 and "\n" not in warnings[0], warnings
  assert warnings[0].startswith("WARNING: checkpoint step 2 (state: "
                                + _says(damage, array)), warnings[0]
  assert warnings[0].endswith("is damaged; falling back to step 1")
  assert ckpt.all_steps() == [1]
  assert os.path.isdir(os.path.join(workdir, "damaged_checkpoints", "2"))
  ckpt.close()


def test_another_mesh_verifies_the_whole_arrays(saved, tmp_path):
  """Saved on data 2 x fsdp 2 x tensor 2, restored onto data 8 (each array
  whole on every device): an intact step verifies, a one-bit change in a
  moment is found by the array's digest."""
  workdir, (_, _, states) = _copy(saved, tmp_path), saved
  other = _setup(**{"mesh.data": 8, "mesh.fsdp": 1, "mesh.tensor": 1})
  warnings = []
  ckpt = checkpointing.Checkpointer(workdir, keep=5, async_save=False)
  step, state, _ = ckpt.restore_intact(setup_lib.abstract_state(other),
                                       warn=warnings.append)
  assert step == 2 and not warnings and _equal(state, states[2])
  moment = _moment(states[2])
  _edit_value(_dir(workdir, 2), moment, _lowest_bit)
  step, state, _ = ckpt.restore_intact(setup_lib.abstract_state(other),
                                       warn=warnings.append)
  assert step == 1 and _equal(state, states[1])
  assert warnings == [
      f"WARNING: checkpoint step 2 (state: digest mismatch: {moment} (whole "
      f"array: restored on another mesh)) under {ckpt.directory} is "
      "damaged; falling back to step 1"]
  with pytest.raises(checkpointing.DamagedStep, match="digest mismatch"):
    ckpt.restore(setup_lib.abstract_state(other), 2)
  ckpt.close()


def test_a_deleted_digest_is_damage_and_a_step_saved_without_one_is_not(
    saved, tmp_path):
  workdir, (_, setup, states) = _copy(saved, tmp_path), saved
  os.remove(os.path.join(_dir(workdir, 2), "digest", "metadata"))
  warnings = []
  ckpt = checkpointing.Checkpointer(workdir, keep=5, async_save=False)
  abstract = setup_lib.abstract_state(setup)
  assert ckpt.restore_intact(abstract, warn=warnings.append)[0] == 1
  assert "(digest: digest/metadata is missing)" in warnings[0]
  # A step saved without digests (digest=False, or before they existed)
  # is verified by the non-finite check alone.
  plain = checkpointing.Checkpointer(str(tmp_path / "plain"),
                                     async_save=False, digest=False)
  assert plain.save(3, states[2], {"data_position": 30})
  assert not os.path.exists(os.path.join(plain.directory, "3", "digest"))
  step, state, _ = plain.restore_intact(abstract)
  assert step == 3 and _equal(state, states[2])
  plain.close()
  ckpt.close()
