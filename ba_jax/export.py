"""Command line: ``python -m ba_jax.export --workdir=DIR --output_dir=DIR``.

Writes the newest (or ``--step``) policy of a training workdir as a Hugging
Face directory (config.json, safetensors, tokenizer) that ``transformers``
loads. A checkpoint is verified before it is written out (its files, the
digests of its arrays, no NaN or inf in them): a damaged newest step is named
in a one-line warning and the newest intact one is exported; with none intact
(or a damaged ``--step``) the command exits 2 with one line. Both
directories may be URLs (``gs://...``, through ``etils.epath``).
"""
import sys

from absl import app, flags, logging

_WORKDIR = flags.DEFINE_string("workdir", None, "training workdir",
                               required=True)
_OUTPUT = flags.DEFINE_string("output_dir", None, "Hugging Face directory to "
                              "write", required=True)
_STEP = flags.DEFINE_integer("step", None, "checkpoint step (default newest)")


def export(workdir: str, output_dir: str, step: int | None = None) -> str:
  """Exports the policy in ``workdir`` to ``output_dir``; returns the path."""
  from ba_jax.policy import hf
  from ba_jax.run import paths
  from ba_jax.run import workdir as workdir_lib
  model, model_config, tokenizer = workdir_lib.restore_policy(workdir, step)
  with paths.output_dir(output_dir) as local:
    hf.save_pretrained(model, model_config, local, tokenizer=tokenizer)
  return output_dir


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  logging.set_verbosity(logging.WARNING)
  from ba_jax.run import checkpointing
  try:
    path = export(_WORKDIR.value, _OUTPUT.value, _STEP.value)
  except (checkpointing.NoIntactCheckpoint, FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr, flush=True)
    sys.exit(2)
  print(f"exported {_WORKDIR.value} to {path}")


if __name__ == "__main__":
  app.run(main)
