"""The config schema (``ba_jax.config.schema``): one place for every key."""
import contextlib
import dataclasses
import io
import pathlib
import runpy

import pytest

from ba_jax import train
from ba_jax.config import common, schema
from ba_jax.policy import model as model_lib
from ba_jax.run import resume, rollout
from ba_jax.tasks import registry
from ba_jax.update import train_step as ts

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Every config file with every variant it documents (a key a config sets
# that the schema lacks fails here).
CONFIGS = {
    "tiny": ["", "smoke", "agg=token", "gap=-6"],
    "chains": ["", "smoke", "quick", "big", "spread=low,gap=neg", "lr=1e-3"],
    "drafts": ["", "smoke", "gap=neg,agg=token", "gap=pos,lr=1e-3,steps=5"],
    "qwen25_math_7b_dapo17k": ["", "runlocal", "agg=sequence", "param_dtype=bfloat16"],
    "qwen3_1p7b_polaris": ["", "runlocal", "agg=dr_grpo"],
    "smollm2_reasoning_gym": ["", "runlocal", "agg=token"],
}


def _load(name, variant):
  module = runpy.run_path(str(ROOT / "configs" / f"{name}.py"))
  return module["get_config"](variant or None)


@pytest.mark.parametrize("name,variant", [(n, v) for n, vs in CONFIGS.items() for v in vs])
def test_every_config_and_variant_parses(name, variant):
  config = _load(name, variant)
  cfg = schema.parse(config)
  assert isinstance(cfg.task, schema.TASK_SECTIONS[config.task.name])
  # Every key the file sets survives, typed.
  for section, values in config.to_dict().items():
    if isinstance(values, dict) and section != "task":
      for key, value in values.items():
        got = getattr(getattr(cfg, section), key)
        if dataclasses.is_dataclass(got):  # a nested section (model.lora)
          got = dataclasses.asdict(got)
        assert got == (tuple(value) if isinstance(value, list) else value), (section, key)


def test_every_config_file_is_covered():
  assert sorted(p.stem for p in (ROOT / "configs").glob("*.py")) == sorted(CONFIGS)


def test_a_key_without_a_schema_entry_is_an_error():
  config = _load("tiny", "smoke")
  with config.unlocked():
    config.rl.new_knob = 3
  with pytest.raises(ValueError, match=r"rl.new_knob: unknown key .*'group_size'"):
    schema.parse(config)
  config = _load("tiny", "smoke")
  with config.unlocked():
    config.task.chain_counts = "1,2"  # a chains key on the synthetic task
  with pytest.raises(ValueError, match=r"task.chain_counts: unknown key"):
    schema.parse(config)
  with pytest.raises(ValueError, match=r"^typo: unknown key"):
    schema.parse({"typo": 1})


@pytest.mark.parametrize("key,value,match", [
    ("rl.group_size", 1, r"rl.group_size=1: expected >= 2 \(with one response"),
    ("rl.temperature", 0.0, r"rl.temperature=0.0: expected > 0"),
    ("rl.temperature", float("nan"), r"rl.temperature=nan: expected > 0"),
    ("rl.top_p", 2, r"rl.top_p=2: expected in \(0, 1\]"),
    ("loss.aggregation", "mean", r"loss.aggregation='mean': expected one of \['token'"),
    ("loss.eps_low", 1.0, r"loss.eps_low=1.0: expected in \[0, 1\)"),
    ("loss.dual_clip", 0.5, r"loss.dual_clip=0.5: expected > 1"),
    ("rl.steps", "ten", r"rl.steps='ten': expected int"),
    ("rl.steps", True, r"rl.steps=True: expected int"),
    ("rl.steps", 2.5, r"rl.steps=2.5: expected int"),
    ("optim.learning_rate", "1e-4", r"optim.learning_rate='1e-4': expected float"),
    ("checkpoint.async_save", 1, r"checkpoint.async_save=1: expected bool"),
])
def test_values_are_checked_by_type_range_and_choices(key, value, match):
  with pytest.raises(ValueError, match=match):
    schema.check(key, value)
  section, name = key.split(".")
  with pytest.raises(ValueError, match=match):
    schema.parse({section: {name: value}})


def test_types_are_coerced_where_lossless():
  assert schema.check("optim.learning_rate", 1) == 1.0
  assert isinstance(schema.check("optim.learning_rate", 1), float)
  assert schema.check("loss.dual_clip", None) is None
  cfg = schema.parse({"sharding_rules": [["batch", ["data", "fsdp"]]]})
  assert cfg.sharding_rules == (("batch", ("data", "fsdp")),)


def test_lower_typed_configs_check_through_the_schema():
  with pytest.raises(ValueError, match=r"rl.group_size=1: expected >= 2"):
    ts.StepConfig(group_size=1)
  with pytest.raises(ValueError, match=r"loss.kl_type='k4': expected one of"):
    ts.StepConfig(group_size=2, kl_type="k4")
  with pytest.raises(ValueError, match=r"rl.oversample=0.5: expected >= 1"):
    rollout.RolloutConfig(prompts_per_step=4, group_size=2, max_new_tokens=4,
                          oversample=0.5)
  rl = schema.parse({}).rl
  assert rollout.RolloutConfig.from_section(rl).group_size == rl.group_size
  assert set(ts.SCHEMA_KEYS) == {f.name for f in dataclasses.fields(ts.StepConfig)}


def test_model_section_is_model_config():
  # Every ModelConfig field, then the nested adapters section (not part of the architecture).
  assert ([f.name for f in dataclasses.fields(schema.Model)]
          == [f.name for f in dataclasses.fields(model_lib.ModelConfig)] + ["lora"])
  assert set(schema.ARCHITECTURE_KEYS) < {f.name for f in dataclasses.fields(schema.Model)}


def test_every_registered_task_has_its_section():
  for name in registry.names():
    assert name in schema.TASK_SECTIONS
    assert schema.TASK_SECTIONS[name]().name == name


def test_common_sections_are_the_schema_defaults():
  c = common.base()
  for name, cls in schema.SECTIONS.items():
    if name != "model":
      assert c[name].to_dict() == schema.defaults(cls), name
  assert schema.parse(c) == dataclasses.replace(schema.RunConfig())
  with pytest.raises(ValueError, match="task.name='nope'"):
    common.task("nope")


def test_resume_rules_come_from_the_schema():
  assert resume.FREE_KEYS == schema.free_keys()
  assert {"mesh.data", "log.progress_bar", "eval.every", "model.remat",
          "checkpoint.every"} <= set(resume.FREE_KEYS)
  assert not {"rl.steps", "loss.aggregation", "seed", "eval.num_problems"} & set(resume.FREE_KEYS)
  base = common.base().to_dict()
  # A key left at its default on one side and absent on the other is no change.
  absent = {k: v for k, v in base.items()}
  absent["eval"] = {k: v for k, v in base["eval"].items() if k != "benchmarks"}
  assert resume.differences(base, absent) == {}
  changed = dict(base, rl=dict(base["rl"], steps=7))
  assert resume.differences(base, changed) == {"rl.steps": (60, 7)}


def test_helpconfig_prints_the_schema():
  out = io.StringIO()
  with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_info:
    raise SystemExit(train.main(["train", "--helpconfig"]))
  assert exit_info.value.code == 0
  text = out.getvalue()
  assert text == schema.help_text() + "\n"
  printed = [line.split(" = ")[0].strip() for line in text.splitlines()
             if line.startswith("  ") and not line.startswith("   ")]
  expected = [row[0] for row in schema.rows(schema.RunConfig)]
  for name, cls in schema.SECTIONS.items():
    expected += [row[0] for row in schema.rows(cls, f"{name}.")]
  for cls in schema.TASK_SECTIONS.values():
    expected += [row[0] for row in schema.rows(cls, "task.")]
  assert printed == expected
  for dotted, default, allowed, doc in schema.rows(schema.Rl, "rl."):
    assert f"  {dotted} = {default}" in text and doc in text
    if allowed:
      assert f"({allowed})" in text
  assert "rl.group_size = 8  (>= 2 (with one response" in text
  assert "[resume may change]" in text


def test_nested_lora_section_parses_checks_and_lists():
  cfg = schema.parse({"model": {"lora": {"rank": 8, "alpha": 32}}})
  assert cfg.model.lora == schema.Lora(rank=8, alpha=32.0)
  assert schema.parse({}).model.lora.rank == 0
  with pytest.raises(ValueError, match=r"model\.lora\.rank=-1: expected >= 0"):
    schema.parse({"model": {"lora": {"rank": -1}}})
  with pytest.raises(ValueError, match=r"model\.lora\.ranks: unknown key"):
    schema.parse({"model": {"lora": {"ranks": 8}}})
  with pytest.raises(ValueError, match=r"model\.lora\.dropout=0\.1: expected 0\.0"):
    schema.parse({"model": {"lora": {"dropout": 0.1}}})
  with pytest.raises(ValueError, match=r"model\.lora=8: expected a section"):
    schema.parse({"model": {"lora": 8}})
  assert schema.check("model.lora.alpha", 4) == 4.0
  assert schema.defaults(schema.Model)["lora"] == {"rank": 0, "alpha": 16.0, "dropout": 0.0,
                                                   "module_path": ".*"}
  assert "model.lora.rank" in [row[0] for row in schema.rows(schema.Model, "model.")]
  assert "model.lora.rank" in schema.help_text()


def test_default_reads_a_key_from_its_section_and_names_an_unknown_key():
  assert schema.default("loss.cispo_cap") == schema.Loss().cispo_cap
  assert schema.default("rl.group_size") == schema.Rl().group_size
  assert schema.default("model.lora.rank") == schema.Lora().rank
  assert schema.default("seed") == schema.RunConfig().seed
  with pytest.raises(KeyError, match="loss.no_such_key"):
    schema.default("loss.no_such_key")


def test_the_update_takes_every_loss_option_with_the_run_configs_default():
  import inspect

  from ba_jax.loss import losses, objectives
  from ba_jax.run import checks
  from ba_jax.update import train_step as ts

  # StepConfig: every field is a schema key with the key's default, except
  # the two its docstring names.
  differ = {f.name for f in dataclasses.fields(ts.StepConfig)
            if f.default is not dataclasses.MISSING
            and f.default != schema.default(ts.SCHEMA_KEYS[f.name])}
  assert differ == {"eps_high", "num_minibatches"}
  # The functions' objective options default as the run config does.
  for fn in (losses.policy_loss, objectives.surrogate_terms):
    for name, p in inspect.signature(fn).parameters.items():
      if name in ts.SCHEMA_KEYS and ts.SCHEMA_KEYS[name] not in (
          "loss.eps_high", "loss.dual_clip") and p.default is not p.empty:
        assert p.default == schema.default(ts.SCHEMA_KEYS[name]), (fn, name)
  # step_config reads every key: a run config with non-default values
  # everywhere comes through whole.
  cfg = schema.parse({"seed": 7, "loss": {"cispo_cap": 3.0, "clip_cov_ub": 4.0,
                                          "surrogate": "cispo"},
                      "rl": {"ppo_epochs": 2}})
  step = checks.step_config(cfg)
  for name, dotted in ts.SCHEMA_KEYS.items():
    if name != "max_response_len":
      section, _, key = dotted.rpartition(".")
      want = getattr(getattr(cfg, section) if section else cfg, key)
      assert getattr(step, name) == want, name
  assert (step.seed, step.cispo_cap, step.clip_cov_ub, step.ppo_epochs) == (7, 3.0, 4.0, 2)
  assert step.max_response_len == (cfg.loss.max_response_len or cfg.rl.max_new_tokens)
