"""The paper configs load locked, vary by ``agg=``, and describe the real models."""
import pathlib

import jax
import numpy as np
import pytest
from absl import flags
from flax import nnx
from ml_collections import config_flags

from ba_jax.config import schema
from ba_jax.loss import aggregation
from ba_jax.policy import model as model_lib
from ba_jax.run import model_setup
from ba_jax.run import checks
from ba_jax.run import setup as setup_lib
from ba_jax.run import workdir as workdir_lib

ROOT = pathlib.Path(__file__).resolve().parents[1]
# config file -> (parameters the model card states, model_type)
PAPER_CONFIGS = {
    "configs/qwen25_math_7b_dapo17k.py": (7.6e9, "qwen2"),
    "configs/qwen3_1p7b_polaris.py": (1.7e9, "qwen3"),
}
# config file -> (prompt, response, soft overlong buffer) tokens; see each
# config's docstring for where they come from.
PAPER_LENGTHS = {
    "configs/qwen25_math_7b_dapo17k.py": (1024, 3072, 512),
    "configs/qwen3_1p7b_polaris.py": (2048, 20480, 4096),
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
  assert checks.step_config(schema.parse(config)).aggregation == mode


def test_unknown_variant_is_named(path):
  module = _module(path)
  with pytest.raises(ValueError, match="'bogus'"):
    module.get_config("agg=token,bogus=1")


def test_param_dtype_variant(path):
  """Float32 master weights with bfloat16 compute by default."""
  assert load(path).model.param_dtype == "float32"
  config = load(path, "param_dtype=bfloat16")
  assert config.model.param_dtype == "bfloat16"
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
  prompt, response, buffer = PAPER_LENGTHS[path]
  assert (c.task.max_prompt_len, rl.max_new_tokens) == (prompt, response)
  assert (rl.overlong, rl.overlong_buffer) == ("soft", buffer)
  assert prompt + response <= c.model.max_position_embeddings
  assert rl.overlong_penalty == 1.0 and rl.dynamic_sampling
  assert (rl.temperature, rl.top_p) == (1.0, 1.0)
  # verl's 10 warm-up RL steps, each ppo_epochs x num_minibatches updates.
  assert (optim.learning_rate, optim.warmup_steps, optim.schedule) == (1e-6, 160, "constant")
  assert (optim.weight_decay, optim.grad_clip) == (0.1, 1.0)
  assert (loss.eps_low, loss.eps_high, loss.kl_coef) == (0.2, 0.28, 0.0)
  assert c.sft.steps == 0
  assert (c.model.dtype, c.model.param_dtype) == ("bfloat16", "float32")
  assert (c.model.remat, c.model.attention_impl) == ("full", "auto")
  assert dict(c.mesh) == dict(data=-1, fsdp=16, tensor=4)
  assert c.init_from and c.task.path  # placeholders the user replaces
  # 512 prompts x 16 responses split into whole groups, micro-batches and
  # the 16 batch shards of the pod mesh on 64 devices.
  checks.step_config(schema.parse(c)).check_batch(512 * 16, data_shards=16)
  # Rollouts through the engine: a KV-cache budget per device that leaves
  # room on a 16 GiB v5e chip and holds fewer slots than the 512 rows of
  # each of the 16 batch shards (the dry run sizes it; see the config).
  m = c.model
  positions = prompt - 1 + response  # engine.cache_length
  per_slot = 2 * m.num_layers * (m.num_kv_heads // 4) * positions * m.head_dim * 2 + 4 * positions
  assert rl.max_slots == 0 and 0 < rl.kv_cache_gib <= 14
  assert 16 <= rl.kv_cache_gib * 2**30 // per_slot < 512


def test_model_fields_build_the_model_of_the_stated_size(path):
  expected, model_type = PAPER_CONFIGS[path]
  config = model_setup.build_model_config(schema.parse(load(path)))
  assert config.model_type == model_type
  abstract = nnx.eval_shape(lambda: model_lib.Decoder(config, rngs=nnx.Rngs(0)))
  leaves = jax.tree.leaves(nnx.state(abstract, nnx.Param))
  assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
  count = sum(int(np.prod(x.shape)) for x in leaves)
  assert abs(count / expected - 1) < 0.03, (path, count)
  assert {x.dtype for x in leaves} == {jax.numpy.dtype("float32")}


def test_model_fields_match_the_hf_config_json(path):
  """The fields round-trip through transformers' config.json layout, which
  is what ``init_from`` checkpoints carry."""
  config = model_setup.build_model_config(schema.parse(load(path)))
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


FIXTURES = ROOT / "tests" / "fixtures"
# What any CPU test of a paper config must shrink (the paper's batch, budget
# and 64-device mesh); nothing about the model.
CPU_SHRINK = ["--config.rl.steps=1", "--config.rl.prompts_per_step=4",
              "--config.rl.group_size=2", "--config.rl.max_new_tokens=16",
              "--config.rl.num_minibatches=1", "--config.rl.num_microbatches=1",
              "--config.rl.max_sampling_rounds=0",
              "--config.task.max_prompt_len=192", "--config.mesh.fsdp=1",
              "--config.mesh.tensor=1", "--config.eval.num_problems=1",
              "--config.eval.samples_per_problem=1",
              "--config.log.progress_bar=False"]


@pytest.fixture(scope="module")
def llama_checkpoint(tmp_path_factory):
  """A tiny random Llama-family checkpoint in float32, tokenizer included."""
  from model_utils import save_tiny_model
  return save_tiny_model("llama", tmp_path_factory.mktemp("llama"))


def _paper_overrides(checkpoint, *extra):
  return [f"--config.init_from={checkpoint}",
          f"--config.task.path={FIXTURES / 'polaris.jsonl'}",
          f"--config.eval.data_dir={FIXTURES / 'eval'}", *CPU_SHRINK, *extra]


@pytest.mark.slow
def test_paper_config_trains_a_step_from_any_llama_checkpoint(
    llama_checkpoint, tmp_path):
  """configs/qwen3_1p7b_polaris.py on a tiny Llama checkpoint, with only
  init_from, the data paths and CPU_SHRINK set: the architecture comes from
  the checkpoint, the weights in the variant's bfloat16 param_dtype."""
  from ba_jax.run import trainer
  overrides = _paper_overrides(llama_checkpoint)
  config = load("configs/qwen3_1p7b_polaris.py", "param_dtype=bfloat16",
                overrides=overrides)
  assert config.model.model_type == "qwen3"  # the config file's own
  out = trainer.run(config, str(tmp_path), explicit={
      o.split("=")[0][len("--config."):] for o in overrides})
  assert out["step"] == 1 and out["stopped"] is None
  assert set(out["after_rl"]) == {"heldout_acc_sampled", "heldout_acc_greedy"}
  record = out["history"][0]
  assert np.isfinite(record["loss"]) and record["nonfinite"] == 0
  leaves = jax.tree.leaves(out["state"].params)
  assert {x.dtype for x in leaves} == {jax.numpy.dtype("bfloat16")}
  # The run's files describe the model that ran, so export needs only them.
  model, model_config, _ = workdir_lib.restore_policy(str(tmp_path))
  assert (model_config.model_type, model_config.hidden_size,
          model_config.num_kv_heads) == ("llama", 64, 1)
  assert workdir_lib.load_run_config(str(tmp_path)).model.hidden_size == 64
  restored = jax.tree.leaves(nnx.state(model))
  assert all(np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
             for a, b in zip(restored, leaves))


def test_init_from_loads_in_param_dtype(llama_checkpoint):
  """init_from honours model.param_dtype, as a resume does: a float32
  checkpoint becomes bfloat16 parameters, equal after rounding."""
  from safetensors.numpy import load_file
  config = load("configs/qwen3_1p7b_polaris.py", "param_dtype=bfloat16",
                overrides=_paper_overrides(llama_checkpoint,
                                           "--config.model.logprob_chunk=64"))
  setup = setup_lib.make_setup(config)
  assert setup.model_config.param_dtype == "bfloat16"
  assert setup.model_config.logprob_chunk == 64  # a runtime field
  params = setup_lib.init_params(setup)
  from ba_jax.policy import hf
  (spec,) = [w for w in hf.weight_specs(setup.model_config)
             if w.hf_name == "model.embed_tokens.weight"]
  embed = nnx.to_pure_dict(params)
  for key in spec.path:
    embed = embed[key]
  assert embed.dtype == jax.numpy.bfloat16
  stored = load_file(str(llama_checkpoint / "model.safetensors"))[
      "model.embed_tokens.weight"]
  assert stored.dtype == np.float32
  np.testing.assert_array_equal(
      np.asarray(embed), stored.astype(jax.numpy.bfloat16))
  assert jax.tree.structure(params) == jax.tree.structure(
      setup.abstract_params)


def test_an_explicit_architecture_override_must_match_the_checkpoint(
    llama_checkpoint):
  """The config file's architecture gives way to the checkpoint's; the same
  field set on the command line to another value is an error naming both."""
  overrides = _paper_overrides(llama_checkpoint,
                               "--config.model.hidden_size=2048")
  config = load("configs/qwen3_1p7b_polaris.py", overrides=overrides)
  with pytest.raises(ValueError, match=r"model.hidden_size=2048 .* "
                     r"hidden_size=64"):
    setup_lib.make_setup(config, explicit={"model.hidden_size"})
  # Set to the checkpoint's own value, it is no conflict.
  config = load("configs/qwen3_1p7b_polaris.py", overrides=_paper_overrides(
      llama_checkpoint, "--config.model.hidden_size=64"))
  setup = setup_lib.make_setup(config, explicit={"model.hidden_size"})
  assert setup.model_config.model_type == "llama"
  assert setup.config.model.num_layers == 2  # the model section as built


@pytest.mark.slow
def test_command_line_names_a_conflicting_override(llama_checkpoint,
                                                   tmp_path):
  import subprocess
  import sys
  proc = subprocess.run(
      [sys.executable, "-m", "ba_jax.train",
       "--config=configs/qwen3_1p7b_polaris.py", f"--workdir={tmp_path}",
       *_paper_overrides(llama_checkpoint, "--config.model.num_layers=28")],
      cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert proc.returncode != 0
  assert "model.num_layers=28" in proc.stderr
  assert "num_layers=2" in proc.stderr
  assert not list(tmp_path.iterdir())  # nothing ran


@pytest.mark.slow
@pytest.mark.parametrize("config_file", sorted(PAPER_CONFIGS))
def test_runlocal_variant_trains_on_this_cpu(config_file, tmp_path):
  """``:runlocal``: a tiny random model of the config's own family, no
  init_from, the bundled synthetic task; two RL steps (warm-up shortened
  here only to keep the test fast) with the recipe's loss and shaping."""
  from ba_jax.run import trainer
  config = load(config_file, "runlocal", overrides=["--config.sft.steps=2"])
  family = load(config_file).model
  assert config.model.model_type == family.model_type
  assert config.model.qk_norm == family.qk_norm
  assert config.model.attention_bias == family.attention_bias
  assert config.init_from == "" and config.task.name == "synthetic_sum"
  assert config.rl.overlong == "soft" and config.rl.dynamic_sampling
  out = trainer.run(config, str(tmp_path))
  assert out["step"] == config.rl.steps == 2 and out["stopped"] is None
  assert all(np.isfinite(r["loss"]) and r["nonfinite"] == 0
             for r in out["history"])
