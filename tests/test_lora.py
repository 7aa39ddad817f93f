"""LoRA through qwix (``ba_jax.policy.lora``): adapters on every family and
GQA shape, only adapters train, the KL reference is the base with the
adapters off, the sampler and engine run the adapted model, merged and PEFT
exports load in ``transformers`` / ``peft`` with our logits, and a LoRA run
checkpoints only its adapters and resumes onto its base."""
import dataclasses
import json
import pathlib
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ba_jax.generation import sampler as sampler_lib
from ba_jax.loss import losses
from ba_jax.policy import hf
from ba_jax.policy import lora as lora_lib
from ba_jax.policy import model as model_lib
from ba_jax.run import trainer
from ba_jax.update import train_step as ts
import model_utils as mu
import trainer_utils as tu

LORA = types.SimpleNamespace(rank=4, alpha=8.0, dropout=0.0, module_path=".*")


def _perturbed(model, seed=1, scale=0.2):
  """``model`` with random adapters (a fresh one has B = 0: equal to its base)."""
  graphdef, params = nnx.split(model)
  adapters, base = lora_lib.split(params)
  leaves, tree = jax.tree.flatten(adapters)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  leaves = [x + scale * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
  return nnx.merge(graphdef, lora_lib.join(jax.tree.unflatten(tree, leaves), base))


def _close(theirs, ours, mask):
  """Equal logits at the real tokens (left padding's positions are not compared)."""
  valid = mask.astype(bool)
  np.testing.assert_allclose(theirs[valid], ours[valid], atol=2e-4, rtol=2e-4)


def _logits(model, ids, mask):
  graphdef, params = nnx.split(model)
  return np.asarray(jax.jit(lambda p: nnx.merge(graphdef, p)(ids, mask))(params))


@pytest.mark.parametrize("kind", mu.KINDS)
def test_exports_load_in_transformers_and_peft_with_our_logits(kind, tmp_path):
  """Per family and GQA shape (qwen2: 4 q / 2 kv heads with bias; qwen3: q/k
  norm, head_dim 32; llama: one kv head): fresh adapters leave the logits
  alone; trained ones change them; the merged weights reproduce them in
  ``transformers`` and the PEFT adapters on the base reproduce them in
  ``peft``."""
  import peft
  import torch
  from transformers import AutoModelForCausalLM
  base_dir = mu.save_tiny_model(kind, tmp_path / "base")
  base, config = hf.load_pretrained(base_dir)
  ids, mask = mu.left_padded_batch(seed=1)
  base_logits = _logits(base, ids, mask)
  adapted = lora_lib.apply(hf.load_pretrained(base_dir)[0], LORA, seed=0)
  np.testing.assert_array_equal(_logits(adapted, ids, mask), base_logits)
  adapted = _perturbed(adapted)
  ours = _logits(adapted, ids, mask)
  assert np.abs(ours - base_logits).max() > 0.1
  # Adapters on all seven projections of every layer, stacked on the layer axis.
  tensors = lora_lib.peft_tensors(adapted)
  assert len(tensors) == 2 * 7 * config.num_layers
  q_a = tensors["base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"]
  k_b = tensors["base_model.model.model.layers.1.self_attn.k_proj.lora_B.weight"]
  assert q_a.shape == (LORA.rank, config.hidden_size)
  assert k_b.shape == (config.num_kv_heads * config.head_dim, LORA.rank)

  merged_dir = tmp_path / "merged"
  hf.save_pretrained(lora_lib.merged(adapted, LORA), config, merged_dir)
  hf_merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
  _close(mu.torch_logits(hf_merged, ids, mask), ours, mask)

  lora_lib.save_peft(adapted, LORA, tmp_path / "peft", base_model=str(base_dir))
  saved = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
  assert saved["r"] == 4 and saved["lora_alpha"] == 8.0
  assert sorted(saved["target_modules"]) == sorted(
      ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
  hf_base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
  with_adapters = peft.PeftModel.from_pretrained(hf_base, tmp_path / "peft").eval()
  _close(mu.torch_logits(with_adapters, ids, mask), ours, mask)


def test_module_path_chooses_the_adapted_projections():
  config = tu.tiny_model_config(model_type="qwen2", attention_bias=True, qk_norm=False)
  only_attention = types.SimpleNamespace(**{**vars(LORA), "module_path": "self_attn"})
  model = lora_lib.apply(model_lib.Decoder(config, rngs=nnx.Rngs(0)), only_attention)
  names = {name.split(".")[-3] for name in lora_lib.peft_tensors(model)}
  assert names == {"q_proj", "k_proj", "v_proj", "o_proj"}
  for bad, match in (("attention", r"matches none of a decoder layer's modules \['self_attn', 'mlp'\]"),
                     ("(", "is not a regular expression")):
    with pytest.raises(ValueError, match=match):
      lora_lib.apply(model_lib.Decoder(config, rngs=nnx.Rngs(0)),
                     types.SimpleNamespace(**{**vars(LORA), "module_path": bad}))


def _adapted_state(lr=1e-2):
  model = _perturbed(lora_lib.apply(model_lib.Decoder(tu.tiny_model_config(), rngs=nnx.Rngs(0)), LORA),
                     scale=0.05)
  graphdef, params = nnx.split(model)
  tx = ts.make_optimizer(learning_rate=lr, warmup_steps=0, total_steps=4)
  return graphdef, params, tx, ts.create_state(params, tx)


def test_a_train_step_changes_only_the_adapters_and_adam_holds_only_them():
  graphdef, params, tx, state = _adapted_state()
  adapters, base = jax.device_get(lora_lib.split(params))  # host copies: the step donates the state
  n_adapters = len(jax.tree.leaves(adapters))
  adapter_shapes = sorted(x.shape for x in jax.tree.leaves(adapters))
  # AdamW's two moments, of the adapters only.
  moments = [x for x in jax.tree.leaves(state.opt_state) if np.ndim(x) > 0]
  assert sorted(x.shape for x in moments) == sorted(adapter_shapes * 2)
  assert len(moments) == 2 * n_adapters
  cfg = ts.StepConfig(group_size=4, aggregation="balanced", num_minibatches=2)
  step = ts.jit_train_step(graphdef=graphdef, tx=tx, cfg=cfg)
  new, metrics = step(state, tu.rollout_batch(0, n=16))
  new_adapters, new_base = lora_lib.split(new.params)
  for before, after in zip(jax.tree.leaves(base), jax.tree.leaves(new_base)):
    np.testing.assert_array_equal(np.asarray(before), np.asarray(after))
  moved = [float(np.abs(np.asarray(a) - np.asarray(b)).max())
           for a, b in zip(jax.tree.leaves(adapters), jax.tree.leaves(new_adapters))]
  assert min(moved) > 0 and int(metrics["nonfinite"]) == 0


def test_kl_against_the_adapters_off_equals_kl_against_a_copy_of_the_base():
  graphdef, params, _, _ = _adapted_state()
  batch = tu.rollout_batch(1, n=8)
  base_model = model_lib.Decoder(tu.tiny_model_config(), rngs=nnx.Rngs(0))  # the same base weights
  base_graphdef, base_params = nnx.split(base_model)
  score = lambda g, p: np.asarray(jax.jit(lambda p: trainer.score_logp(
      p, batch, graphdef=g, temperature=1.0))(p))
  ref_off = score(graphdef, lora_lib.adapters_off(params))
  ref_copy = score(base_graphdef, base_params)
  np.testing.assert_allclose(ref_off, ref_copy, atol=1e-6)
  logp = score(graphdef, params)
  assert np.abs(logp - ref_copy).max() > 1e-3  # the adapters do move the policy
  kl = lambda ref: float(losses.policy_loss(
      jnp.asarray(logp), jnp.asarray(batch["old_logp"]), jnp.asarray(batch["advantages"]),
      jnp.asarray(batch["response_mask"]), group_size=4, aggregation="token",
      ref_logp=jnp.asarray(ref), kl_coef=0.1, kl_type="k3")[1]["kl_ref"])
  assert kl(ref_off) > 0
  np.testing.assert_allclose(kl(ref_off), kl(ref_copy), rtol=1e-5)


@pytest.mark.parametrize("slots", [0, 3], ids=["sampler", "engine"])
def test_sampler_and_engine_run_the_adapted_model(slots):
  """Greedy tokens of the adapted model equal its merged twin's, through the
  static sampler and the continuous-batching engine."""
  config = tu.tiny_model_config(model_type="llama", num_kv_heads=1, qk_norm=False)
  adapted = _perturbed(lora_lib.apply(model_lib.Decoder(config, rngs=nnx.Rngs(0)), LORA), scale=0.3)
  merged = lora_lib.merged(adapted, LORA)
  base = model_lib.Decoder(config, rngs=nnx.Rngs(0))
  ids, mask = mu.left_padded_batch(seed=2, batch=3, length=6, vocab=32)
  run = lambda m: np.asarray(sampler_lib.sample_groups(
      m, ids, mask, rng=jax.random.key(0), group_size=2, max_new_tokens=6, temperature=0.0,
      eos_id=31, pad_id=0, max_slots=slots).tokens)
  tokens = run(adapted)
  np.testing.assert_array_equal(tokens, run(merged))
  assert (tokens != run(base)).any()


@pytest.mark.slow
def test_lora_run_checkpoints_adapters_resumes_and_exports(tmp_path, capsys, monkeypatch):
  """configs/tiny.py:smoke,lora stopped after 2 steps and resumed: the
  checkpoints hold the adapters (the warmed-up base is saved once), the
  resumed run ends where an uninterrupted one does, and the export is the
  merged policy (equal logits in transformers) plus PEFT adapters on a base
  written beside them."""
  import peft
  import torch
  from transformers import AutoModelForCausalLM
  from ba_jax import export
  from ba_jax.run import workdir as workdir_lib
  args = ["--config=configs/tiny.py:smoke,lora", "--config.rl.steps=3",
          "--config.loss.kl_coef=0.05"]
  whole, part = str(tmp_path / "whole"), str(tmp_path / "part")
  assert tu.train_cli(args + [f"--workdir={whole}"], capsys, monkeypatch)[0] == 0
  assert tu.train_cli(args + [f"--workdir={part}", "--config.stop_after_steps=2"],
                      capsys, monkeypatch)[0] == 0
  saved = json.loads((pathlib.Path(part) / "checkpoints" / "2" / "state" / "_METADATA").read_text())
  saved_names = " ".join(saved["tree_metadata"])
  assert "lora_a" in saved_names and "embed_tokens" not in saved_names and "'q_proj'" not in saved_names
  assert (pathlib.Path(part) / "lora_base").is_dir()
  assert tu.train_cli(args + [f"--workdir={part}"], capsys, monkeypatch)[0] == 0
  model_whole = workdir_lib.restore_policy(whole)[0]
  model_part = workdir_lib.restore_policy(part)[0]
  for a, b in zip(tu.host_params(nnx.state(model_whole)), tu.host_params(nnx.state(model_part))):
    np.testing.assert_allclose(a, b, atol=1e-5)

  out, peft_dir = tmp_path / "hf", tmp_path / "peft"
  export.export(part, str(out), peft_dir=str(peft_dir))
  ids, mask = mu.left_padded_batch(seed=3, batch=2, length=7, vocab=26)
  ours = _logits(model_part, ids, mask)
  hf_model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
  _close(mu.torch_logits(hf_model, ids, mask), ours, mask)
  base = AutoModelForCausalLM.from_pretrained(peft_dir / "base", dtype=torch.float32)
  with_adapters = peft.PeftModel.from_pretrained(base, peft_dir).eval()
  _close(mu.torch_logits(with_adapters, ids, mask), ours, mask)
  # A run without adapters has none to write (refused before anything is restored).
  plain = tmp_path / "plain"
  plain.mkdir()
  (plain / "config.json").write_text(tu.load_config("smoke").to_json())
  with pytest.raises(ValueError, match=r"model\.lora\.rank=0\); it has no adapters"):
    export.export(str(plain), str(tmp_path / "plain_hf"), peft_dir=str(tmp_path / "plain_peft"))
