"""Command line: ``python -m ba_jax.export --workdir=DIR --output_dir=DIR``.

Writes the newest (or ``--step``) policy of a training workdir as a Hugging
Face directory (config.json, safetensors, tokenizer) that ``transformers``
loads. A checkpoint is verified before it is written out (its files, the
digests of its arrays, no NaN or inf in them): a damaged newest step is named
in a one-line warning and the newest intact one is exported; with none intact
(or a damaged ``--step``) the command exits 2 with one line. Both
directories may be URLs (``gs://...``, through ``etils.epath``).

A LoRA run (``model.lora.rank > 0``) is written with its adapters merged into
the weights (``W + alpha / rank * A @ B``); ``--peft_dir=DIR`` also writes the
adapters alone in PEFT's format (``adapter_config.json`` and
``adapter_model.safetensors``, which ``peft.PeftModel.from_pretrained``
loads onto the base). The base is ``init_from`` when the run trained on it
directly; otherwise (a random model or a warm-up) it is written to
``DIR/base`` and the adapter config points there.
"""
import sys

from absl import app, flags, logging

_WORKDIR = flags.DEFINE_string("workdir", None, "training workdir",
                               required=True)
_OUTPUT = flags.DEFINE_string("output_dir", None, "Hugging Face directory to "
                              "write", required=True)
_STEP = flags.DEFINE_integer("step", None, "checkpoint step (default newest)")
_PEFT = flags.DEFINE_string("peft_dir", None, "LoRA runs: also write the "
                            "adapters alone here, in PEFT's format")


def export(workdir: str, output_dir: str, step: int | None = None,
           peft_dir: str | None = None) -> str:
  """Exports the policy in ``workdir`` to ``output_dir`` (LoRA: merged) and,
  with ``peft_dir``, a LoRA run's adapters in PEFT's format; returns
  ``output_dir``."""
  from ba_jax.config import schema
  from ba_jax.policy import hf
  from ba_jax.policy import lora as lora_lib
  from ba_jax.run import paths
  from ba_jax.run import workdir as workdir_lib
  cfg = schema.parse(workdir_lib.load_run_config(workdir))
  lora = cfg.model.lora
  if peft_dir and not lora_lib.enabled(lora):
    raise ValueError(f"--peft_dir={peft_dir}: the run in {workdir} trains "
                     "every parameter (model.lora.rank=0); it has no adapters")
  model, model_config, tokenizer = workdir_lib.restore_policy(workdir, step)
  adapted = model
  if lora_lib.enabled(lora):
    model = lora_lib.merged(adapted, lora)
  with paths.output_dir(output_dir) as local:
    hf.save_pretrained(model, model_config, local, tokenizer=tokenizer)
  if peft_dir:
    base_dir = cfg.init_from if (cfg.init_from and not cfg.sft.steps) else ""
    with paths.output_dir(peft_dir) as local:
      if not base_dir:
        base_dir = f"{local}/base"
        hf.save_pretrained(lora_lib.merged(adapted, lora, adapters=False),
                           model_config, base_dir, tokenizer=tokenizer)
      lora_lib.save_peft(adapted, lora, local, base_model=base_dir)
  return output_dir


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  logging.set_verbosity(logging.WARNING)
  from ba_jax.run import checkpointing
  try:
    path = export(_WORKDIR.value, _OUTPUT.value, _STEP.value, _PEFT.value)
  except (checkpointing.NoIntactCheckpoint, FileNotFoundError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr, flush=True)
    sys.exit(2)
  print(f"exported {_WORKDIR.value} to {path}")


if __name__ == "__main__":
  app.run(main)
