"""A training workdir's files: what a run writes besides checkpoints and
metrics, and restoring its policy for export and evaluation."""
from __future__ import annotations

import json

import jax
import ml_collections
from flax import nnx

from ba_jax.policy import model as model_lib
from ba_jax.run import checkpointing, paths
from ba_jax.config import schema
from ba_jax.run.model_setup import runtime_fields
from ba_jax.run.setup import Setup, abstract_saved_state, base_params, full_state, make_setup


def write_run_files(workdir: str, setup: Setup) -> None:
  """What ``restore_policy`` needs besides the arrays: the run's config
  (model section as built), the model config (transformers layout), the
  tokenizer; and the devices the run saw (``devices_record``)."""
  root = paths.path(workdir)
  paths.write_text(root / "config.json", setup.config.to_json())
  paths.write_json(root / "model_config.json", setup.model_config.to_hf_dict())
  paths.write_json(root / "devices.json", devices_record(setup.mesh))
  if setup.tokenizer is not None:
    with paths.output_dir(root / "tokenizer") as tok_dir:
      setup.tokenizer.save_pretrained(tok_dir)


def devices_record(mesh) -> dict:
  """What a run ran on: the platform, the device kind, how many devices
  (all processes') and processes, and its mesh as resolved."""
  return dict(platform=jax.default_backend(), kind=jax.devices()[0].device_kind,
              devices=jax.device_count(), processes=jax.process_count(),
              mesh={name: int(size) for name, size in mesh.shape.items()})


def is_workdir(path) -> bool:
  """True when ``path`` holds a trainer run (its config and checkpoints)."""
  root = paths.path(path)
  return ((root / "model_config.json").is_file()
          and (root / "checkpoints").is_dir())


def load_run_config(workdir: str) -> ml_collections.ConfigDict:
  """The ml_collections config a run in ``workdir`` was started with."""
  path = paths.path(workdir) / "config.json"
  if not path.exists():
    raise FileNotFoundError(f"{path} not found: {workdir} is not a ba_jax "
                            "training workdir")
  return ml_collections.ConfigDict(schema.drop_retired(
      json.loads(path.read_text())))


def restore_policy(workdir: str, step: int | None = None, *, mesh_shape=None,
                   warn=print):
  """The policy saved in ``workdir``: ``(model, model_config, tokenizer)``.

  Restores the newest checkpoint that verifies (its digests, no NaN or inf;
  a damaged newer one is named in a one-line ``warn``), or ``step`` (raises
  ``NoIntactCheckpoint`` when it does not verify), onto a mesh of this
  machine's devices (``mesh_shape``, default the run's own, e.g.
  {"data": -1, ...}), whatever mesh it was saved from. Needs only the
  workdir (not init_from), except for a LoRA run started from init_from
  without a warm-up: its checkpoints hold the adapters, restored onto
  init_from's weights. The model has the adapters (``ba_jax.policy.lora``).
  """
  config = load_run_config(workdir)
  if mesh_shape is not None:
    config.mesh = dict(mesh_shape)
  model_config = model_lib.ModelConfig.from_hf_dict(
      paths.read_json(paths.path(workdir) / "model_config.json"),
      **runtime_fields(schema.parse(config)))
  setup = make_setup(config, abstract=True, model_config=model_config)
  ckpt = checkpointing.Checkpointer(workdir, keep=max(config.checkpoint.keep, 1),
                                    async_save=False)
  try:
    if step is None:
      _, state, _ = ckpt.restore_intact(abstract_saved_state(setup), warn=warn)
    else:
      try:
        state, _ = ckpt.restore(abstract_saved_state(setup), step)
      except checkpointing.DamagedStep as e:
        raise checkpointing.NoIntactCheckpoint(
            f"checkpoint step {step} under {ckpt.directory} is damaged "
            f"({e})") from None
  finally:
    ckpt.close()
  if setup.lora:
    state = full_state(setup, state, base_params(setup, workdir))
  model = nnx.merge(setup.graphdef, state.params)
  tok_dir = paths.path(workdir) / "tokenizer"
  tokenizer = None
  if tok_dir.is_dir():
    from transformers import AutoTokenizer
    with paths.local_dir(tok_dir) as local:
      tokenizer = AutoTokenizer.from_pretrained(local)
  return model, model_config, tokenizer
