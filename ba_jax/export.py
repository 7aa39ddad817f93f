"""Command line: ``python -m ba_jax.export --workdir=DIR --output_dir=DIR``.

Writes the newest (or ``--step``) policy of a training workdir as a Hugging
Face directory (config.json, safetensors, tokenizer) that ``transformers``
loads.
"""
from absl import app, flags, logging

_WORKDIR = flags.DEFINE_string("workdir", None, "training workdir",
                               required=True)
_OUTPUT = flags.DEFINE_string("output_dir", None, "Hugging Face directory to "
                              "write", required=True)
_STEP = flags.DEFINE_integer("step", None, "checkpoint step (default newest)")


def export(workdir: str, output_dir: str, step: int | None = None) -> str:
  """Exports the policy in ``workdir`` to ``output_dir``; returns the path."""
  from ba_jax import hf, run_setup
  model, model_config, tokenizer = run_setup.restore_policy(workdir, step)
  hf.save_pretrained(model, model_config, output_dir, tokenizer=tokenizer)
  return output_dir


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  logging.set_verbosity(logging.WARNING)
  path = export(_WORKDIR.value, _OUTPUT.value, _STEP.value)
  print(f"exported {_WORKDIR.value} to {path}")


if __name__ == "__main__":
  app.run(main)
