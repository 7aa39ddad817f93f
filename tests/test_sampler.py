"""ba_jax.generation.sampler: greedy parity with transformers, sampling statistics, stopping, sharding."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats
import torch
from transformers import AutoModelForCausalLM

from ba_jax.policy import hf
from ba_jax.generation import sampler
from ba_jax.policy import scoring
from ba_jax.policy import sharding as sharding_lib
from model_utils import EOS_ID, PAD_ID, left_padded_batch, save_tiny_model

# Test-wide false-alarm rate of each chi-square test: a correct sampler fails it
# with this probability over random seeds (the seed here is fixed).
CHI2_ALPHA = 1e-3
# Decode-step logits (KV cache) and full-forward logits differ by float32
# rounding, ~1e-6 on these tiny models; 1e-4 is the agreed log-prob bound.
LOGP_TOL = 1e-4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  return save_tiny_model("qwen2", tmp_path_factory.mktemp("qwen2"))


@pytest.fixture(scope="module")
def ours(checkpoint):
  return hf.load_pretrained(checkpoint)[0]


@pytest.fixture(scope="module")
def theirs(checkpoint):
  return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


def _prompts(batch=4, length=9, seed=0):
  ids, mask = left_padded_batch(seed=seed, batch=batch, length=length)
  return ids, mask


def _hf_greedy(model, ids, mask, max_new_tokens, eos_ids):
  with torch.no_grad():
    out = model.generate(input_ids=torch.as_tensor(ids, dtype=torch.long),
                         attention_mask=torch.as_tensor(mask, dtype=torch.long),
                         do_sample=False, max_new_tokens=max_new_tokens,
                         eos_token_id=list(eos_ids), pad_token_id=PAD_ID)
  return out[:, ids.shape[1]:].numpy()


def _sample(model, ids, mask, **kwargs):
  kwargs = {"group_size": 1, "max_new_tokens": 12, "temperature": 0.0, "eos_id": EOS_ID,
            "pad_id": PAD_ID, "rng": jax.random.key(0), **kwargs}
  return jax.device_get(sampler.sample_groups(model, ids, mask, **kwargs))


def _check_stop_invariants(res, eos_ids, max_new_tokens):
  """mask/lengths/truncated/padding are consistent with where a stop token fell."""
  tokens, T = res.tokens, max_new_tokens
  for n in range(tokens.shape[0]):
    stops = np.flatnonzero(np.isin(tokens[n], eos_ids))
    length = stops[0] + 1 if stops.size else T
    assert res.lengths[n] == length
    np.testing.assert_array_equal(res.mask[n], (np.arange(T) < length).astype(np.int32))
    assert res.truncated[n] == (not stops.size)
    assert np.all(tokens[n, length:] == PAD_ID)
    assert np.all(res.logprobs[n, length:] == 0.0)
    assert np.all(res.logprobs[n, :length] < 0.0)


@pytest.mark.slow
def test_greedy_equals_transformers_generate_mixed_lengths(ours, theirs):
  ids, mask = _prompts()  # rows have 0, 2, 4, 6 pad tokens on the left
  T = 12
  res = _sample(ours, ids, mask, max_new_tokens=T)
  expected = _hf_greedy(theirs, ids, mask, T, [EOS_ID])
  np.testing.assert_array_equal(res.tokens[:, :expected.shape[1]], expected)
  # Now stop on a token greedy emits mid-way in row 0, plus EOS_ID: rows stop
  # early, in both, and transformers pads them as we do.
  stop = int(res.tokens[0, 5])
  res = _sample(ours, ids, mask, max_new_tokens=T, eos_id=(EOS_ID, stop))
  expected = _hf_greedy(theirs, ids, mask, T, [EOS_ID, stop])
  assert res.lengths[0] <= 6 and not res.truncated[0]
  np.testing.assert_array_equal(res.tokens[:, :expected.shape[1]], expected)
  assert np.all(res.tokens[:, expected.shape[1]:] == PAD_ID)
  _check_stop_invariants(res, [EOS_ID, stop], T)


def test_any_prompt_padding_gives_the_same_output(ours):
  ids, mask = _prompts()
  left = _sample(ours, ids, mask)
  # The same prompts right-padded: the sampler left-justifies them itself.
  right_ids, right_mask = np.zeros_like(ids), np.zeros_like(mask)
  for i in range(ids.shape[0]):
    real = ids[i][mask[i] == 1]
    right_ids[i, :real.size], right_mask[i, :real.size] = real, 1
  right = _sample(ours, right_ids, right_mask)
  np.testing.assert_array_equal(left.tokens, right.tokens)
  np.testing.assert_allclose(left.logprobs, right.logprobs, atol=1e-6)


def _first_token_probs(model, ids, mask, temperature):
  logits = model(jnp.asarray(ids), jnp.asarray(mask))[:, -1]
  return np.asarray(jax.nn.softmax(logits / temperature, axis=-1), np.float64)


def _chi2_pvalue(counts, probs):
  """Pearson chi-square p-value; bins expecting fewer than 5 draws are pooled."""
  expected = probs * counts.sum()
  small = expected < 5
  obs = np.append(counts[~small], counts[small].sum())
  exp = np.append(expected[~small], expected[small].sum())
  if exp[-1] == 0:
    obs, exp = obs[:-1], exp[:-1]
  return scipy.stats.chisquare(obs, exp).pvalue


@pytest.fixture(scope="module")
def small_vocab_model(tmp_path_factory):
  path = save_tiny_model("qwen3", tmp_path_factory.mktemp("qwen3v16"), vocab_size=16,
                         with_tokenizer=False)
  return hf.load_pretrained(path)[0]


@pytest.mark.slow
@pytest.mark.parametrize("temperature,top_k,top_p", [
    (1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.7), (1.0, 6, 0.8)])
def test_first_token_frequencies_match_softmax(small_vocab_model, temperature, top_k, top_p):
  model = small_vocab_model
  ids = np.array([[5, 9, 3, 12, 7]], np.int32)
  mask = np.ones_like(ids)
  probs = _first_token_probs(model, ids, mask, temperature)[0]
  # The truncated, renormalised distribution transformers samples from.
  order = np.argsort(-probs, kind="stable")
  keep = np.zeros(probs.size, bool)
  kept = order[:top_k] if top_k else order
  kept_probs = probs[kept] / probs[kept].sum()
  mass_before = np.cumsum(kept_probs) - kept_probs
  keep[kept[mass_before < top_p]] = True
  target = np.where(keep, probs, 0.0)
  target /= target.sum()
  counts = np.zeros(probs.size, np.int64)
  draws = 0
  for seed in range(4):
    res = _sample(model, ids, mask, group_size=1024, max_new_tokens=1, temperature=temperature,
                  top_k=top_k, top_p=top_p, eos_id=0, rng=jax.random.key(seed))
    counts += np.bincount(res.tokens[:, 0], minlength=probs.size)
    draws += res.tokens.shape[0]
    # Log-probs are full-vocabulary at the temperature, whatever was kept.
    np.testing.assert_allclose(res.logprobs[:, 0], np.log(probs[res.tokens[:, 0]]), atol=LOGP_TOL)
  assert counts.sum() == draws == 4096
  assert counts[~keep].sum() == 0, f"excluded tokens emitted: {np.flatnonzero(counts * ~keep)}"
  assert _chi2_pvalue(counts[keep], target[keep]) > CHI2_ALPHA


@pytest.mark.slow
@pytest.mark.parametrize("temperature,top_k,top_p", [(0.0, 0, 1.0), (0.8, 0, 1.0), (1.0, 3, 1.0),
                                                   (1.2, 0, 0.5)])
def test_logprobs_equal_scoring_and_truncation_holds(ours, temperature, top_k, top_p):
  """Over whole responses: logprobs equal score_responses, and every sampled
  token is inside the top-k / top-p set of the full forward's logits."""
  ids, mask = _prompts()
  G, T = 4, 8
  res = _sample(ours, ids, mask, group_size=G, max_new_tokens=T, temperature=temperature,
                top_k=top_k, top_p=top_p, rng=jax.random.key(3))
  prompt_ids, prompt_mask = np.repeat(ids, G, 0), np.repeat(mask, G, 0)
  logp, _ = scoring.score_responses(ours, prompt_ids, prompt_mask, res.tokens, res.mask,
                                    temperature=temperature or 1.0)
  np.testing.assert_allclose(res.logprobs, np.asarray(logp), atol=LOGP_TOL, rtol=0)
  full = jnp.concatenate([prompt_ids, res.tokens], axis=1)
  full_mask = jnp.concatenate([prompt_mask, res.mask], axis=1)
  P = ids.shape[1]
  logits = np.asarray(ours(full, full_mask)[:, P - 1:P - 1 + T]) / (temperature or 1.0)
  picked = np.take_along_axis(logits, res.tokens[..., None], -1)[..., 0]
  valid = res.mask == 1
  if temperature == 0:
    assert np.all(picked[valid] >= logits.max(-1)[valid] - 1e-4)
  if top_k:
    kth = np.sort(logits, axis=-1)[..., -top_k]
    assert np.all(picked[valid] >= kth[valid] - 1e-4)
  if top_p < 1:
    probs = np.asarray(jax.nn.softmax(logits, axis=-1))
    picked_p = np.take_along_axis(probs, res.tokens[..., None], -1)
    mass_before = np.sum(np.where(probs > picked_p, probs, 0.0), axis=-1)
    assert np.all(mass_before[valid] < top_p + 1e-5)


def test_eos_stops_rows_and_masks_the_rest(ours):
  ids, mask = _prompts()
  T = 8
  # Several frequent tokens as stop ids, so some rows stop and some run out.
  free = _sample(ours, ids, mask, group_size=4, max_new_tokens=T, temperature=1.0, eos_id=127)
  values, counts = np.unique(free.tokens[:, 2:], return_counts=True)
  eos_ids = [int(v) for v in values[np.argsort(-counts)[:3]]]
  res = _sample(ours, ids, mask, group_size=4, max_new_tokens=T, temperature=1.0, eos_id=eos_ids)
  _check_stop_invariants(res, eos_ids, T)
  assert res.truncated.any() and not res.truncated.all()
  assert res.tokens.dtype == np.int32 and res.mask.dtype == np.int32
  assert res.logprobs.dtype == np.float32 and res.truncated.dtype == bool
  # A row whose last allowed token is a stop token stopped, it was not truncated.
  res = _sample(ours, ids, mask)
  row = next(n for n, toks in enumerate(res.tokens) if toks[-1] not in toks[:-1])
  res = _sample(ours, ids, mask, eos_id=int(res.tokens[row, -1]))
  assert res.lengths[row] == 12 and not res.truncated[row]


@pytest.mark.slow
def test_sharded_on_8_devices_equals_one_device(checkpoint, ours):
  assert len(jax.devices()) == 8
  mesh = sharding_lib.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  sharded, _ = hf.load_pretrained(checkpoint, mesh=mesh)
  ids, mask = _prompts(batch=4, length=11, seed=2)
  one = _sample(ours, ids, mask, group_size=2, max_new_tokens=12)
  res = sampler.sample_groups(sharded, ids, mask, group_size=2, max_new_tokens=12,
                              temperature=0.0, eos_id=EOS_ID, pad_id=PAD_ID, rng=jax.random.key(0))
  assert res.tokens.sharding.spec[0] == ("data", "fsdp")
  assert len(res.tokens.sharding.device_set) == 8
  np.testing.assert_array_equal(np.asarray(res.tokens), one.tokens)
  np.testing.assert_allclose(np.asarray(res.logprobs), one.logprobs, atol=LOGP_TOL)
  np.testing.assert_array_equal(np.asarray(res.lengths), one.lengths)


@pytest.mark.slow
def test_same_bucket_does_not_recompile(ours):
  assert sampler.bucket_length(9) == sampler.bucket_length(16) == 16
  assert sampler.bucket_length(17) == 32
  assert sampler.bucket_length(40, (24, 48, 96)) == 48
  kwargs = dict(group_size=2, max_new_tokens=5, temperature=1.0, top_k=7)
  _sample(ours, *_prompts(batch=3, length=9, seed=0), **kwargs)
  traces = sampler.trace_count()
  _sample(ours, *_prompts(batch=3, length=13, seed=1), **kwargs, rng=jax.random.key(9))
  _sample(ours, *_prompts(batch=3, length=16, seed=2), **kwargs)
  # Temperature (above 0) and the stop ids are arguments, not compile-time constants.
  _sample(ours, *_prompts(batch=3, length=16, seed=2), **{**kwargs, "temperature": 0.6},
          eos_id=(5, 6))
  assert sampler.trace_count() == traces
  _sample(ours, *_prompts(batch=3, length=17, seed=3), **kwargs)  # the next bucket
  assert sampler.trace_count() == traces + 1


def test_same_rng_same_output_and_groups_differ(ours):
  ids, mask = _prompts()
  G, T = 4, 8
  kwargs = dict(group_size=G, max_new_tokens=T, temperature=1.0)
  a = _sample(ours, ids, mask, **kwargs, rng=jax.random.key(5))
  b = _sample(ours, ids, mask, **kwargs, rng=jax.random.key(5))
  c = _sample(ours, ids, mask, **kwargs, rng=jax.random.key(6))
  np.testing.assert_array_equal(a.tokens, b.tokens)
  np.testing.assert_array_equal(a.logprobs, b.logprobs)
  assert not np.array_equal(a.tokens, c.tokens)
  assert a.tokens.shape == (ids.shape[0] * G, T)
  for g in range(ids.shape[0]):
    group = {tuple(row) for row in a.tokens[g * G:(g + 1) * G]}
    assert len(group) == G, f"group {g} has repeated responses"


@pytest.mark.parametrize("kwargs,match", [
    (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(eos_id=1000), "eos_id"),
    (dict(eos_id=()), "eos_id"),
    (dict(pad_id=-1), "pad_id"),
    (dict(group_size=0), "group_size"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(prompt_buckets=(4, 8)), "largest prompt bucket"),
])
def test_bad_arguments_are_named(ours, kwargs, match):
  ids, mask = _prompts()
  with pytest.raises(ValueError, match=match):
    _sample(ours, ids, mask, **kwargs)


def test_empty_prompt_row_is_an_error(ours):
  ids, mask = _prompts()
  mask[2] = 0
  with pytest.raises(ValueError, match=r"prompt rows \[2\]"):
    _sample(ours, ids, mask)


def test_remat_model_samples_like_the_plain_one(checkpoint, ours):
  """The paper configs set remat; sampling must still run and agree."""
  remat = hf.load_pretrained(checkpoint, remat=True)[0]
  ids, mask = _prompts()
  want = _sample(ours, ids, mask)
  got = _sample(remat, ids, mask)
  np.testing.assert_array_equal(got.tokens, want.tokens)
  np.testing.assert_allclose(got.logprobs, want.logprobs, atol=LOGP_TOL)
