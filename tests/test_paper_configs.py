"""The paper configs load locked, vary by ``agg=``, and describe the real models."""
import pathlib

import jax
import numpy as np
import pytest
from absl import flags
from flax import nnx
from ml_collections import config_flags

from ba_jax import aggregation
from ba_jax import model as model_lib
from ba_jax import run_setup

ROOT = pathlib.Path(__file__).resolve().parents[1]
# config file -> (parameters the model card states, model_type)
PAPER_CONFIGS = {
    "configs/qwen25_math_7b_dapo17k.py": (7.6e9, "qwen2"),
    "configs/qwen3_1p7b_polaris.py": (1.7e9, "qwen3"),
}


def load(path: str, arg: str = "", overrides=()):
  """Parses the config exactly as ``python -m ba_jax.train`` does."""
  spec = str(ROOT / path) + (f":{arg}" if arg else "")
  argv = ["prog", f"--config={spec}", *overrides]
  values = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, "", flag_values=values,
                                  lock_config=True, sys_argv=argv)
  values(argv)
  return values.config


@pytest.fixture(params=sorted(PAPER_CONFIGS), ids=lambda p: pathlib.Path(p).stem)
def path(request):
  return request.param


def test_loads_locked_and_rejects_a_typo(path):
  config = load(path, overrides=["--config.rl.steps=3"])
  assert config.rl.steps == 3
  assert config.is_locked
  with pytest.raises(AttributeError, match="trian"):
    config.trian = 1
  with pytest.raises(Exception, match="trian"):
    load(path, overrides=["--config.optim.trian=1"])


@pytest.mark.parametrize("mode", aggregation.MODES)
def test_every_aggregation_variant(path, mode):
  config = load(path, f"agg={mode}")
  assert config.loss.aggregation == mode
  assert run_setup.step_config(config).aggregation == mode


def test_unknown_variant_is_named(path):
  module = _module(path)
  with pytest.raises(ValueError, match="'bogus'"):
    module.get_config("agg=token,bogus=1")


def test_param_dtype_variant(path):
  config = load(path, "param_dtype=float32")
  assert config.model.param_dtype == "float32"
  assert config.model.dtype == "bfloat16"


def test_same_keys_as_the_tiny_config(path):
  """Every key of configs/tiny.py (what the trainer reads) exists, except
  the synthetic task's own; sections keep their meaning."""
  tiny = _flatten(load("configs/tiny.py"))
  paper = _flatten(load(path))
  synthetic_only = {k for k in tiny if k.startswith("task.")} - {
      "task.name", "task.max_prompt_len", "task.grader"}
  missing = set(tiny) - set(paper) - synthetic_only
  assert not missing, f"{path} lacks {sorted(missing)}"


def test_recipe(path):
  c = load(path)
  rl, optim, loss = c.rl, c.optim, c.loss
  assert (rl.prompts_per_step, rl.group_size, rl.num_minibatches) == (512, 16, 16)
  assert rl.prompts_per_step // rl.num_minibatches == 32
  assert (rl.max_new_tokens, rl.overlong, rl.overlong_buffer) == (20480, "soft", 4096)
  assert rl.overlong_penalty == 1.0 and rl.dynamic_sampling
  assert (rl.temperature, rl.top_p) == (1.0, 1.0)
  assert (optim.learning_rate, optim.warmup_steps, optim.schedule) == (1e-6, 10, "constant")
  assert (optim.weight_decay, optim.grad_clip) == (0.1, 1.0)
  assert (loss.eps_low, loss.eps_high, loss.kl_coef) == (0.2, 0.28, 0.0)
  assert c.sft.steps == 0
  assert c.model.dtype == c.model.param_dtype == "bfloat16"
  assert c.init_from and c.task.path  # placeholders the user replaces
  # 512 prompts x 16 responses split into whole groups, micro-batches and
  # the 16 batch shards of the pod mesh on 64 devices.
  run_setup.step_config(c).check_batch(512 * 16, data_shards=16)


def test_model_fields_build_the_model_of_the_stated_size(path):
  expected, model_type = PAPER_CONFIGS[path]
  config = model_lib.ModelConfig(**load(path).model)
  assert config.model_type == model_type
  abstract = nnx.eval_shape(lambda: model_lib.Decoder(config, rngs=nnx.Rngs(0)))
  leaves = jax.tree.leaves(nnx.state(abstract, nnx.Param))
  assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
  count = sum(int(np.prod(x.shape)) for x in leaves)
  assert abs(count / expected - 1) < 0.03, (path, count)
  assert {x.dtype for x in leaves} == {jax.numpy.dtype("bfloat16")}


def test_model_fields_match_the_hf_config_json(path):
  """The fields round-trip through transformers' config.json layout, which
  is what ``init_from`` checkpoints carry."""
  config = model_lib.ModelConfig(**load(path).model)
  again = model_lib.ModelConfig.from_hf_dict(
      config.to_hf_dict(), dtype=config.dtype, param_dtype=config.param_dtype,
      remat=config.remat)
  assert again == config


def _module(path):
  import importlib.util
  spec = importlib.util.spec_from_file_location("paper_config", ROOT / path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _flatten(config, prefix=""):
  out = {}
  for key, value in config.items():
    if hasattr(value, "items"):
      out.update(_flatten(value, f"{prefix}{key}."))
    else:
      out[f"{prefix}{key}"] = value
  return out
