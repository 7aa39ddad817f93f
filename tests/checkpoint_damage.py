"""Ways to damage a saved checkpoint step that orbax still reads without an
error: bytes flipped in its data files, values edited in place through
tensorstore, a NaN saved with digests that agree."""
import glob
import json
import os
import shutil
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts

from ba_jax.run import checkpointing
from ba_jax.run import digest

PARAM = "params.layers.mlp.gate_proj.value"


def step_dir(workdir, step) -> str:
  return os.path.join(str(workdir), "checkpoints", str(step))


def moment(workdir, step) -> str:
  """The name of an AdamW first moment saved in the step."""
  metadata = json.load(open(os.path.join(step_dir(workdir, step),
                                         "_CHECKPOINT_METADATA")))
  names = metadata["custom_metadata"]["digest"]["arrays"]
  return next(n for n in names if ".mu." in n and "up_proj" in n)


def chunks(directory: str) -> list[tuple[str, str, int, int]]:
  """(array name, data file, offset, length) of every array chunk stored
  in a data file of a step (from the OCDBT b-tree; the small ones live in
  the tree's nodes)."""
  out = []
  state_dir = os.path.join(directory, "state")
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


def flip_in_largest_file(directory: str, mask: int) -> str:
  """64 bytes in the middle of the arrays stored in the largest data file,
  as the issue did (the file's own middle may be a b-tree node that orbax
  never reads back); returns the array hit."""
  found = chunks(directory)
  largest = max({c[1] for c in found}, key=os.path.getsize)
  mine = sorted((c for c in found if c[1] == largest), key=lambda c: c[2])
  name, path, offset, length = mine[len(mine) // 2]
  _xor(path, offset + length // 2 - 32, 64, mask)
  return name


def flip_in_array(directory: str, name: str, mask: int) -> str:
  """16 stored bytes in the middle of array ``name``'s first chunk."""
  _, path, offset, length = next(c for c in chunks(directory)
                                 if c[0] == name)
  _xor(path, offset + length // 2, 16, mask)
  return name


def edit_value(directory: str, name: str, edit) -> str:
  """Rewrites array ``name`` of a saved step in place through tensorstore
  (``edit(numpy array)`` changes it): a consistent checkpoint that orbax
  reads, whose digest table is not updated."""
  spec = {"driver": "zarr", "kvstore": {
      "driver": "ocdbt", "base": f"file://{directory}/state/",
      "path": f"{name}/"}}
  array = ts.open(spec).result()
  values = array.read().result()
  edit(values)
  array.write(values).result()
  return name


def lowest_bit(values):
  values.reshape(-1).view(np.uint32)[values.size // 2] ^= 1


def nan(values):
  values.reshape(-1)[values.size // 3] = np.nan


def nan_saved_with_its_digest(workdir, step: int, abstract_state) -> str:
  """The step saved again by the Checkpointer from its own state with a
  NaN in one parameter: its digests agree (the NaN was saved)."""
  manager = ocp.CheckpointManager(os.path.join(str(workdir), "checkpoints"))
  restored = manager.restore(step, args=ocp.args.Composite(
      state=ocp.args.StandardRestore(abstract_state),
      meta=ocp.args.JsonRestore()))
  manager.close()
  state = jax.tree_util.tree_map_with_path(
      lambda path, x: x.at[1, 2, 3].set(jnp.nan)
      if digest._name(path) == PARAM else x, restored["state"])
  # Saved apart (orbax saves no step older than the newest) and moved in.
  with tempfile.TemporaryDirectory() as apart:
    ckpt = checkpointing.Checkpointer(apart, async_save=False)
    assert ckpt.save(step, state, dict(restored["meta"]))
    ckpt.close()
    shutil.rmtree(step_dir(workdir, step))
    shutil.move(step_dir(apart, step), step_dir(workdir, step))
  return PARAM


# kind -> (workdir, step, abstract state) -> the array hit.
DAMAGE = {
    "data file, high bits": lambda w, s, a: flip_in_largest_file(
        step_dir(w, s), 0xF0),
    "data file, low bits": lambda w, s, a: flip_in_largest_file(
        step_dir(w, s), 0x01),
    "moment stored bytes, high bits": lambda w, s, a: flip_in_array(
        step_dir(w, s), moment(w, s), 0x80),
    "moment stored bytes, low bits": lambda w, s, a: flip_in_array(
        step_dir(w, s), moment(w, s), 0x01),
    "moment value, lowest bit": lambda w, s, a: edit_value(
        step_dir(w, s), moment(w, s), lowest_bit),
    "parameter set to NaN": lambda w, s, a: edit_value(
        step_dir(w, s), PARAM, nan),
    "parameter saved as NaN": lambda w, s, a: nan_saved_with_its_digest(
        w, s, a),
}
# Those that change the arrays' own bytes (the last one saves new ones).
IN_PLACE = [k for k in DAMAGE if k != "parameter saved as NaN"]


def says(kind: str, array: str) -> str:
  """What the warning says after ``checkpoint step S (state: ``."""
  if kind == "parameter saved as NaN":  # the digests agree; NaN does not
    return f"non-finite values (NaN or inf): 1 in {array}"
  return f"digest mismatch: {array} shard ["
