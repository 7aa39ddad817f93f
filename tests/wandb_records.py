"""Reading an offline W&B run back from its own files (wandb 0.31 ships no
reader of them): its ``.wandb`` file is a LevelDB-style log of protobuf
records, a 7-byte file header, then 32 KiB blocks of chunks; tables and
images lie under ``files/``."""
import glob
import json
import os
import time


def offline_env(monkeypatch, root) -> None:
  """W&B offline, every file it writes under ``root`` (runs under
  ``root/dir/wandb``)."""
  monkeypatch.setenv("WANDB_MODE", "offline")
  monkeypatch.setenv("WANDB_DISABLE_GIT", "true")
  for name in ("DIR", "CACHE_DIR", "CONFIG_DIR", "DATA_DIR", "ARTIFACT_DIR"):
    monkeypatch.setenv(f"WANDB_{name}", os.path.join(str(root), name.lower()))


def runs(root) -> list[str]:
  """The offline run directories under ``root`` (as ``offline_env`` set it)."""
  return sorted(glob.glob(os.path.join(str(root), "dir", "wandb", "offline-run-*")))


def _parse(data: bytes) -> list:
  """The whole records of ``data``, a ``.wandb`` file's bytes (a record
  still being written at its end is left out)."""
  from wandb.proto import wandb_internal_pb2
  block, out = 32 * 1024, []
  assert data[:4] == b":W&B", data[:8]
  pos, pending = 7, b""
  while pos + 7 <= len(data):
    if block - pos % block < 7:  # a block's tail too short for a header
      pos += block - pos % block
      continue
    length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
    chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
    if len(chunk) < length:  # the writer is still writing this chunk
      break
    if kind == 0:  # zero padding
      continue
    pending = chunk if kind in (1, 2) else pending + chunk
    if kind in (1, 4):  # FULL or LAST
      record = wandb_internal_pb2.Record()
      record.ParseFromString(pending)
      out.append(record)
  return out


def records(run_dir, timeout: float = 120.0) -> list:
  """The run's records, read once its file ends with the ``exit`` record:
  ``run.finish()`` can return before W&B's service has written the last
  records (the history among them), so a reader right after it may find the
  file partly written."""
  (path,) = glob.glob(os.path.join(run_dir, "*.wandb"))
  deadline = time.monotonic() + timeout
  while True:
    found = _parse(open(path, "rb").read())
    if found and found[-1].WhichOneof("record_type") == "exit":
      return found
    if time.monotonic() > deadline:
      raise AssertionError(
          f"{path} has no exit record after {timeout:.0f} s: "
          f"{[r.WhichOneof('record_type') for r in found]}")
    time.sleep(0.2)


def of_type(run_dir, kind: str) -> list:
  """The run's records of one type (``run``, ``history``, ``artifact``...)."""
  return [getattr(r, kind) for r in records(run_dir)
          if r.WhichOneof("record_type") == kind]


def history(run_dir) -> dict[int, dict]:
  """``{step: {key: value}}`` of the run's logged history."""
  out = {}
  for h in of_type(run_dir, "history"):
    item = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in h.item}
    out.setdefault(item["_step"], {}).update(item)
  return out


def config(run_dir) -> dict:
  for run in of_type(run_dir, "run"):
    return {i.key: json.loads(i.value_json) for i in run.config.update}
  raise AssertionError(f"no run record in {run_dir}")


def logged(run_dir, step: int = 0) -> dict:
  """``{key: value}`` logged at ``step``, each media value (a table, an
  image) as the dict of its reference (``_type``, ``path`` relative to the
  run's ``files/``, ...)."""
  items = history(run_dir)[step]
  media = {k[:-len("/_type")] for k in items if k.endswith("/_type")}
  out = {}
  for key, value in items.items():
    name = next((m for m in media if key.startswith(m + "/")), None)
    if name is not None:
      out.setdefault(name, {})[key[len(name) + 1:]] = value
    elif not key.startswith("_"):
      out[key] = value
  return out


def table(run_dir, ref: dict) -> list[dict]:
  """A logged ``table-file``'s rows as dicts."""
  assert ref["_type"] == "table-file", ref
  t = json.load(open(os.path.join(run_dir, "files", ref["path"])))
  return [dict(zip(t["columns"], row)) for row in t["data"]]
