"""The sampler-trainer mismatch metrics: their values, where the train step
takes the trainer's log-probs from, the exact zero when the two log-probs
are the same numbers, and the rounding-level gap of the real sampler and
scorer in float32 on CPU (docs/aggregation.md)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ba_jax.generation import sampler as sampler_lib
from ba_jax.loss import mismatch
from ba_jax.loss import objectives
from ba_jax.policy import compiling
from ba_jax.policy import model as model_lib
from ba_jax.policy.scoring import score_responses
from ba_jax.update import train_step as ts
import trainer_utils as tu


def test_metrics_equal_numpy_by_length_bucket():
  rng = np.random.default_rng(0)
  T = 8
  lengths = np.array([1, 2, 3, 8, 8, 5, 0, 7])
  mask = (np.arange(T)[None] < lengths[:, None]).astype(np.float32)
  behaviour = rng.normal(size=(8, T)).astype(np.float32) - 2
  trainer = behaviour + rng.normal(size=(8, T)).astype(np.float32) * 0.5
  out = jax.device_get(mismatch.mismatch_metrics(
      trainer, behaviour, mask, correction="tis_token", cap=2.0, floor=0.5))
  on = mask > 0
  d = (trainer - behaviour).astype(np.float64)
  k3 = np.exp(d) - 1 - d
  np.testing.assert_allclose(out["mismatch_k3"], k3[on].mean(), rtol=1e-5)
  for q in mismatch.QUANTILES:
    np.testing.assert_allclose(out[f"mismatch_ratio_p{round(q * 100):02d}"],
                               np.quantile(np.exp(d[on]), q), rtol=1e-5)
  outside = (np.exp(d) > 2.0) | (np.exp(d) < 0.5)
  np.testing.assert_allclose(out["mismatch_corrected_frac"], outside[on].mean(), rtol=1e-6)
  # Quarters of T = 8: (0, 2], (2, 4], (4, 6], (6, 8]; the empty row goes to 1.
  buckets = {1: [0, 1, 6], 2: [2], 3: [5], 4: [3, 4, 7]}
  for b, rows in buckets.items():
    sel = on[rows]
    assert out[f"mismatch_tokens_len{b}"] == sel.sum()
    np.testing.assert_allclose(out[f"mismatch_k3_len{b}"], k3[rows][sel].mean(), rtol=1e-5)
    for q in (1, 99):
      np.testing.assert_allclose(out[f"mismatch_ratio_p{q:02d}_len{b}"],
                                 np.quantile(np.exp(d[rows][sel]), q / 100), rtol=1e-5)
    np.testing.assert_allclose(out[f"mismatch_corrected_frac_len{b}"],
                               outside[rows][sel].mean(), rtol=1e-6)
  empty = jax.device_get(mismatch.mismatch_metrics(trainer, behaviour, mask * 0))
  assert np.isnan(empty["mismatch_k3"]) and np.isnan(empty["mismatch_ratio_p50"])


def _step(cfg, batch, params, graphdef):
  tx = ts.make_optimizer(learning_rate=1e-3, warmup_steps=0, total_steps=2)
  # XLA:CPU's fast compile options (what configs/tiny.py runs with): about
  # half the compile time of these tiny programs.
  fn = jax.jit(lambda s, b: ts.train_step(s, b, graphdef=graphdef, tx=tx, cfg=cfg)).lower(
      ts.create_state(params, tx), batch).compile(compiling.CPU_OPTIONS["fast"])
  return jax.device_get(fn(ts.create_state(params, tx), batch)[1])


@pytest.fixture(scope="module")
def policy():
  graphdef, params = nnx.split(model_lib.Decoder(tu.tiny_model_config(), rngs=nnx.Rngs(0)))
  batch = {k: jnp.asarray(v) for k, v in tu.rollout_batch(0, n=16).items()}
  score = jax.jit(lambda p, b: score_responses(
      nnx.merge(graphdef, p), b["prompt_ids"], b["prompt_mask"], b["response_ids"],
      b["response_mask"])[0])
  return graphdef, params, batch, score


@pytest.mark.slow
def test_gap_is_exactly_zero_when_the_sampler_numbers_are_the_trainers(policy):
  """rl.old_logp=recompute with the sampler's log-probs equal to the
  trainer's own: the step logs k3 = 0, every ratio quantile 1, no token
  corrected, over the whole batch."""
  graphdef, params, batch, score = policy
  own = score(params, batch)
  cfg = ts.StepConfig(group_size=4, old_logp="recompute", correction="tis_token",
                      correction_floor=0.999, correction_cap=1.001)
  m = _step(cfg, dict(batch, old_logp=own, behaviour_logp=own), params, graphdef)
  assert m["mismatch_k3"] == 0.0 and m["mismatch_corrected_frac"] == 0.0
  for q in mismatch.QUANTILES:
    assert m[f"mismatch_ratio_p{round(q * 100):02d}"] == 1.0
  assert m["mismatch_tokens"] == float(batch["response_mask"].sum())
  assert m["correction_mean"] == 1.0


@pytest.mark.slow
def test_sampler_mode_compares_the_first_update_before_it_moves(policy):
  """rl.old_logp=sampler: the trainer's log-probs at the step's start are
  the first mini-batch's own forward pass (micro-batches put back together),
  compared with the sampler's on those rows."""
  graphdef, params, batch, score = policy
  cfg = ts.StepConfig(group_size=4, num_minibatches=2, num_microbatches=2, ppo_epochs=2)
  m = _step(cfg, batch, params, graphdef)
  rows = slice(0, 8)
  first = {k: v[rows] for k, v in batch.items()}
  expected = jax.device_get(mismatch.mismatch_metrics(
      score(params, first), first["old_logp"], first["response_mask"]))
  assert m["mismatch_tokens"] == expected["mismatch_tokens"] == float(first["response_mask"].sum())
  for name, value in expected.items():
    # Two programs of the same scorer: equal to float32 rounding.
    np.testing.assert_allclose(m[name], value, rtol=1e-5, err_msg=name)
  assert m["mismatch_k3"] > 1e-3  # rollout_batch's made-up log-probs are far off


@pytest.mark.slow
def test_real_sampler_and_trainer_differ_by_rounding_only_in_float32():
  """The tiny policy in float32 on CPU: the sampler's log-probs of its own
  tokens and the trainer's are equal up to a few ulps (not bit for bit: the
  sampler decodes from a KV cache and takes logits from a matmul, the
  scorer runs one forward pass and a per-token dot), so the k3 gap is
  ~1e-14 and no token leaves a correction's [0.999, 1.001]."""
  graphdef, params = nnx.split(model_lib.Decoder(tu.tiny_model_config(), rngs=nnx.Rngs(1)))
  model = nnx.merge(graphdef, params)
  rng = np.random.default_rng(0)
  prompt_mask = (np.arange(8)[None] >= np.array([0, 2, 4, 5])[:, None]).astype(np.int32)
  prompt_ids = (rng.integers(3, 30, (4, 8)) * prompt_mask).astype(np.int32)
  out = sampler_lib.sample_groups(model, prompt_ids, prompt_mask, group_size=2,
                                  max_new_tokens=12, temperature=1.0, top_p=1.0, top_k=0,
                                  eos_id=1, pad_id=0, rng=jax.random.key(1))
  ids, mask = np.repeat(prompt_ids, 2, 0), np.repeat(prompt_mask, 2, 0)
  trainer, _ = score_responses(model, jnp.asarray(ids), jnp.asarray(mask), out.tokens, out.mask)
  m = jax.device_get(mismatch.mismatch_metrics(trainer, out.logprobs, out.mask,
                                               correction="mis_token", cap=1.001, floor=0.999))
  gap = np.abs(np.asarray(trainer - out.logprobs))[np.asarray(out.mask) > 0]
  assert m["mismatch_tokens"] > 40
  assert gap.max() <= 2e-6  # a few float32 ulps of log-probs of magnitude ~3
  assert m["mismatch_k3"] <= 1e-11 and m["mismatch_corrected_frac"] == 0.0
  weights, _ = objectives.correction_weights(trainer, out.logprobs, out.mask,
                                             correction="tis_token")
  np.testing.assert_allclose(np.asarray(weights), 1.0, atol=2e-6)
