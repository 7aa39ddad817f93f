"""ba_jax.generation.engine: continuous batching through a bounded KV cache gives the static sampler's samples."""
import os
import pathlib
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers import AutoModelForCausalLM

from ba_jax.generation import decoding
from ba_jax.generation import engine
from ba_jax.policy import compiling
from ba_jax.policy import hf
from ba_jax.policy import kv_cache
from ba_jax.generation import sampler
from ba_jax.policy import scoring
from ba_jax.policy import sharding as sharding_lib
from model_utils import EOS_ID, PAD_ID, left_padded_batch, save_tiny_model

# Decode-step and full-forward logits differ by float32 rounding (~1e-6 here);
# 1e-4 is the agreed log-prob bound, as in test_sampler.py.
LOGP_TOL = 1e-4
G, T = 2, 10


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  return save_tiny_model("qwen2", tmp_path_factory.mktemp("qwen2"))


@pytest.fixture(scope="module")
def ours(checkpoint):
  return hf.load_pretrained(checkpoint)[0]


def _sample(model, ids, mask, **kwargs):
  kwargs = {"group_size": G, "max_new_tokens": T, "temperature": 0.0, "eos_id": EOS_ID,
            "pad_id": PAD_ID, "rng": jax.random.key(0), **kwargs}
  return jax.device_get(sampler.sample_groups(model, ids, mask, **kwargs))


@pytest.fixture(scope="module")
def prompts():
  return left_padded_batch(seed=1, batch=4, length=9)


@pytest.fixture(scope="module")
def stop_ids(ours, prompts):
  """Frequent sampled tokens as stop ids: rows stop at many different lengths."""
  free = _sample(ours, *prompts, temperature=1.0, eos_id=127, group_size=4)
  values, counts = np.unique(free.tokens[:, 1:][free.mask[:, 1:] == 1], return_counts=True)
  return tuple(int(v) for v in values[np.argsort(-counts)[:3]])


def _assert_scored(model, ids, mask, got, temperature=1.0):
  """The sampled log-probs are what `score_responses` gives on the returned tokens (G per prompt)."""
  logp, _ = scoring.score_responses(model, np.repeat(ids, G, 0), np.repeat(mask, G, 0), got.tokens,
                                    got.mask, temperature=temperature)
  np.testing.assert_allclose(got.logprobs, np.asarray(logp), atol=LOGP_TOL, rtol=0)


def _assert_same(got, want, tol=LOGP_TOL):
  np.testing.assert_array_equal(got.tokens, want.tokens)
  np.testing.assert_array_equal(got.lengths, want.lengths)
  np.testing.assert_array_equal(got.mask, want.mask)
  np.testing.assert_array_equal(got.truncated, want.truncated)
  np.testing.assert_allclose(got.logprobs, want.logprobs, atol=tol, rtol=0)


@pytest.mark.slow
def test_per_row_cache_index_matches_full_forward(ours):
  """Rows written at different cache offsets decode as if each were alone."""
  ids, mask = left_padded_batch(seed=3, batch=3, length=7)
  full = np.asarray(ours(ids, mask))
  cache = kv_cache.init_cache(ours.config, 3, 16, per_row=True)
  cache = cache.replace(index=jnp.array([0, 5, 2], jnp.int32))
  logits, cache = ours(ids[:, :4], mask[:, :4], cache=cache)
  pieces = [np.asarray(logits)]
  for t in range(4, 7):
    logits, cache = ours(ids[:, t:t + 1], mask[:, t:t + 1], cache=cache)
    pieces.append(np.asarray(logits))
  valid = mask.astype(bool)
  np.testing.assert_allclose(np.concatenate(pieces, 1)[valid], full[valid], atol=1e-5, rtol=0)
  np.testing.assert_array_equal(np.asarray(cache.index), [7, 12, 9])
  np.testing.assert_array_equal(np.asarray(cache.mask)[1, 5:12], mask[1])


@pytest.mark.slow
@pytest.mark.parametrize("max_slots", [1, 3])
def test_greedy_equals_static_and_transformers(checkpoint, ours, prompts, stop_ids, max_slots):
  ids, mask = prompts
  eos = (EOS_ID,) + stop_ids
  static = _sample(ours, ids, mask, eos_id=eos)
  got = _sample(ours, ids, mask, eos_id=eos, max_slots=max_slots)
  assert got.lengths.min() < T and got.truncated.any(), "rows should stop at different lengths"
  _assert_same(got, static)
  theirs = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
  with torch.no_grad():
    out = theirs.generate(input_ids=torch.as_tensor(np.repeat(ids, G, 0), dtype=torch.long),
                          attention_mask=torch.as_tensor(np.repeat(mask, G, 0), dtype=torch.long),
                          do_sample=False, max_new_tokens=T, eos_token_id=list(eos),
                          pad_token_id=PAD_ID)[:, ids.shape[1]:].numpy()
  np.testing.assert_array_equal(got.tokens[:, :out.shape[1]], out)


@pytest.mark.slow
@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 5, 0.9)])
def test_sampled_rows_equal_static_and_logprobs_equal_scoring(ours, prompts, stop_ids,
                                                               temperature, top_k, top_p):
  """Per-row keys: the engine (3 slots, refilled) draws what the static program draws."""
  ids, mask = prompts
  kw = dict(temperature=temperature, top_k=top_k, top_p=top_p, eos_id=(EOS_ID,) + stop_ids,
            rng=jax.random.key(7))
  static = _sample(ours, ids, mask, **kw)
  got = _sample(ours, ids, mask, **kw, max_slots=3)
  assert 0 < got.truncated.sum() < len(got.truncated)
  _assert_same(got, static)
  _assert_scored(ours, ids, mask, got, temperature)
  again = _sample(ours, ids, mask, **kw, max_slots=3)
  np.testing.assert_array_equal(again.tokens, got.tokens)
  np.testing.assert_array_equal(again.logprobs, got.logprobs)
  other = _sample(ours, ids, mask, **{**kw, "rng": jax.random.key(8)}, max_slots=3)
  assert not np.array_equal(other.tokens, got.tokens)


@pytest.mark.slow
def test_refilled_row_is_what_it_would_be_alone(ours, prompts, stop_ids):
  """A row's response depends on its prompt, its row index and the key only: not on which
  slot it got, when a finished row freed it, nor on the other prompts (other lengths)."""
  ids, mask = prompts
  kw = dict(temperature=1.0, eos_id=(EOS_ID,) + stop_ids, rng=jax.random.key(3))
  base = _sample(ours, ids, mask, **kw, max_slots=2)
  assert base.lengths.min() <= T // 2, "need an early finisher to free a slot"
  alone = _sample(ours, ids, mask, **kw, max_slots=1)  # every row alone in the one slot
  _assert_same(alone, base)
  # Other prompts (other lengths and stop times) around prompt 2.
  other_ids, other_mask = left_padded_batch(seed=9, batch=4, length=9)
  other_ids[2], other_mask[2] = ids[2], mask[2]
  mixed = _sample(ours, other_ids, other_mask, **kw, max_slots=2)
  rows = slice(2 * G, 3 * G)
  np.testing.assert_array_equal(mixed.tokens[rows], base.tokens[rows])
  np.testing.assert_allclose(mixed.logprobs[rows], base.logprobs[rows], atol=LOGP_TOL, rtol=0)
  assert not np.array_equal(mixed.tokens[:G], base.tokens[:G])


@pytest.mark.slow
@pytest.mark.parametrize("max_slots", [0, 3])
def test_growing_cache_gives_the_same_samples(ours, prompts, stop_ids, max_slots, monkeypatch):
  """A decode loop that starts on a short cache and grows it (cache_phases) samples what the
  full-length cache does, with refills crossing the phases (engine) or not (static)."""
  ids, mask = prompts
  kw = dict(temperature=1.0, eos_id=(EOS_ID,) + stop_ids, rng=jax.random.key(5), max_new_tokens=24,
            max_slots=max_slots)
  lengths = []
  name = "grow" if max_slots == 0 else "prefix"  # the static cache grows; the engine's is sliced
  real = getattr(kv_cache, name)
  monkeypatch.setattr(kv_cache, name, lambda cache, n: lengths.append(n) or real(cache, n))
  grown = _sample(ours, ids, mask, **kw, cache_phases=4)
  # Bucket 16, 24 new tokens: both caches end at 39 positions (static: 16 + 23; the engine:
  # 15 + 24, its prompt's last token being fed by the first decode step). The lengths before it
  # are multiples of decoding.PHASE_ALIGN: the static cache starts at 32 (>= 17) and grows once;
  # the engine slices 16, 32 and 39 positions.
  assert lengths == ([39] if max_slots == 0 else [16, 32, 39]), lengths
  full = _sample(ours, ids, mask, **kw, cache_phases=1)
  assert len(set(full.lengths.tolist())) > 2 and full.lengths.max() > 20, "rows must cross phases"
  _assert_same(grown, full)
  for bad in (-1, 2.0):
    with pytest.raises(ValueError, match=f"cache_phases must be None or 0 .auto. or an int >= 1, got {bad}"):
      _sample(ours, ids, mask, cache_phases=bad)


@pytest.mark.slow
def test_refills_on_a_cache_prefix_keep_their_positions(ours, prompts, stop_ids):
  """A slot refilled while the engine decodes on a short cache prefix keeps its last row's mask
  past that prefix; once the new row reaches those positions, its RoPE offsets must still count
  only its own tokens (it drew other tokens, with log-probs 3 nats off `score_responses`, when
  they counted the stale mask too)."""
  ids, mask = prompts
  kw = dict(temperature=1.0, eos_id=(EOS_ID,) + stop_ids, rng=jax.random.key(5), max_new_tokens=56,
            max_slots=3)
  grown = _sample(ours, ids, mask, **kw, cache_phases=4)
  full = _sample(ours, ids, mask, **kw, cache_phases=1)
  assert full.lengths.max() == 56 and full.lengths.min() < 8, "rows must stop early and refill"
  _assert_same(grown, full)
  _assert_scored(ours, ids, mask, grown)


def test_cache_phase_lengths_and_the_cpu_default(ours):
  assert decoding.cache_phase_lengths(287, 8, 33) == (48, 80, 112, 144, 192, 224, 256, 287)
  assert decoding.cache_phase_lengths(50, 4, 40) == (48, 50)  # none shorter than the start
  assert decoding.cache_phase_lengths(50, 1, 40) == (50,)
  assert decoding.auto_cache_phases(287, "cpu") == decoding.AUTO_PHASES > 1
  assert decoding.auto_cache_phases(287, "tpu") == decoding.auto_cache_phases(100, "cpu") == 1
  assert decoding.cache_phase_lengths(287, 0, 33) == decoding.cache_phase_lengths(  # 0: auto
      287, decoding.auto_cache_phases(287), 33)
  cache = kv_cache.init_cache(ours.config, 2, 5, per_row=True)
  grown = kv_cache.grow(cache.replace(mask=cache.mask.at[:, :3].set(1)), 9)
  assert grown.k[0].shape[-1] == grown.v[0].shape[-2] == grown.mask.shape[1] == 9
  assert grown.mask.sum() == 6 and grown.index.shape == (2,)
  with pytest.raises(ValueError, match="cannot grow a cache of 9 positions to 5"):
    kv_cache.grow(grown, 5)


@pytest.mark.slow
def test_chunked_prefill_and_group_major_order(ours, stop_ids):
  ids, mask = left_padded_batch(seed=4, batch=3, length=21)
  kw = dict(group_size=3, eos_id=(EOS_ID,) + stop_ids)
  static = _sample(ours, ids, mask, **kw)
  got = _sample(ours, ids, mask, **kw, max_slots=4, prefill_chunk=8)
  _assert_same(got, static)
  for b in range(3):  # greedy: a group's rows are its prompt's one answer
    assert (got.tokens[3 * b:3 * b + 3] == got.tokens[3 * b]).all()
  assert not np.array_equal(got.tokens[0], got.tokens[3])


def test_one_program_per_shape_and_bounded_cache(ours, monkeypatch):
  """Refills are data: new prompts reuse the program. The cache is [slots, ...] for any B."""
  kw = dict(temperature=1.0, max_slots=3)
  _sample(ours, *left_padded_batch(seed=5, batch=4, length=9), **kw)
  traces = engine.trace_count()
  _sample(ours, *left_padded_batch(seed=6, batch=4, length=12), **kw, rng=jax.random.key(4))
  assert engine.trace_count() == traces
  shapes = []
  real_init = kv_cache.init_cache

  def spy(config, batch_size, max_len, *args, **kwargs):
    cache = real_init(config, batch_size, max_len, *args, **kwargs)
    if kwargs.get("per_row"):
      shapes.append((cache.k[0].shape, len(cache.k)))
    return cache
  monkeypatch.setattr(kv_cache, "init_cache", spy)
  graphdef, state = nnx.split(ours)
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
  for prompts in (4, 64):
    engine.lower(graphdef, abstract, prompts=prompts, prompt_len=16, group_size=8,
                 max_new_tokens=T, slots=3)
  c = ours.config
  assert shapes == [((3, c.num_kv_heads, c.head_dim, 15 + T), c.num_layers)] * 2  # keys [M,K,D,S]


@pytest.mark.slow
def test_sharded_on_8_devices_equals_one_device(checkpoint, ours, prompts, stop_ids):
  mesh = sharding_lib.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  sharded, _ = hf.load_pretrained(checkpoint, mesh=mesh)
  kw = dict(temperature=1.0, eos_id=(EOS_ID,) + stop_ids, rng=jax.random.key(2), max_slots=4)
  want = _sample(ours, *prompts, **kw)
  res = sampler.sample_groups(sharded, *prompts, group_size=G, max_new_tokens=T, pad_id=PAD_ID, **kw)
  assert res.tokens.sharding.spec[0] == ("data", "fsdp")
  _assert_same(jax.device_get(res), want)
  # A cache sliced (engine) or grown (static) through phases keeps its sharding and its samples.
  for slots in (4, 0):
    phased = sampler.sample_groups(sharded, *prompts, group_size=G, max_new_tokens=T, pad_id=PAD_ID,
                                   **dict(kw, max_slots=slots), cache_phases=3)
    _assert_same(jax.device_get(phased), want)
  # The dry run's entry: lower on abstract sharded inputs.
  graphdef, state = nnx.split(sharded)
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
  lowered = engine.lower(graphdef, abstract, prompts=8, prompt_len=16, group_size=4,
                         max_new_tokens=T, slots=8, mesh=mesh)
  assert lowered.compile().memory_analysis() is not None
  # What an accelerator runs, here on CPU: keys laid out [M,K,S,D] like the values
  # (kv_cache.key_axes), each device filling only its own slots (kv_cache.fill_slots).
  with compiling.targeting("gpu"):  # float32: no cuDNN, so every kernel runs on CPU
    for slots, phases in ((4, None), (4, 3), (0, 3)):
      res = sampler.sample_groups(sharded, *prompts, group_size=G, max_new_tokens=T, pad_id=PAD_ID,
                                  **dict(kw, max_slots=slots), cache_phases=phases)
      _assert_same(jax.device_get(res), want)


def test_bad_max_slots_is_named(ours, prompts):
  with pytest.raises(ValueError, match="max_slots"):
    _sample(ours, *prompts, max_slots=-1)
  with pytest.raises(ValueError, match="prefill_chunk"):
    _sample(ours, *prompts, max_slots=2, prefill_chunk=-3)
  with pytest.raises(ValueError, match="budget"):
    kv_cache.slots_for_budget(ours.config, 10, 64)
  per_slot = kv_cache.cache_bytes(ours.config, 1, 64)
  assert kv_cache.slots_for_budget(ours.config, 5 * per_slot + 1, 64) == 5


@pytest.mark.slow
def test_row_budgets_truncate_each_row(ours, prompts, stop_ids):
  """Per-row budgets (data, not shapes): the same rows in both programs, cut at their budget."""
  ids, mask = prompts
  budgets = np.array([1, 3, 10, 5, 2, 10, 7, 4], np.int32)
  kw = dict(temperature=1.0, eos_id=(EOS_ID,) + stop_ids, rng=jax.random.key(11))
  free = _sample(ours, ids, mask, **kw)
  static = _sample(ours, ids, mask, **kw, row_budgets=budgets)
  got = _sample(ours, ids, mask, **kw, row_budgets=budgets, max_slots=3)
  _assert_same(got, static)
  np.testing.assert_array_equal(got.lengths, np.minimum(free.lengths, budgets))
  np.testing.assert_array_equal(got.truncated, free.truncated | (free.lengths > budgets))
  np.testing.assert_array_equal(got.tokens * got.mask, free.tokens * got.mask)
  with pytest.raises(ValueError, match="row_budgets"):
    _sample(ours, ids, mask, row_budgets=np.zeros(8, np.int32))


@pytest.mark.slow
def test_no_stop_token_runs_every_row_to_its_budget(ours, prompts, stop_ids):
  """`eos_id=sampler.NO_STOP`: the tokens that stopped rows before are drawn and kept."""
  ids, mask = prompts
  budgets = np.array([1, 3, 10, 5, 2, 10, 7, 4], np.int32)
  kw = dict(temperature=1.0, rng=jax.random.key(11), max_new_tokens=10)
  stopping = _sample(ours, ids, mask, **kw, eos_id=(EOS_ID,) + stop_ids)
  assert not stopping.truncated.all(), "some row must stop for this test to mean anything"
  for extra in (dict(), dict(max_slots=3), dict(row_budgets=budgets, max_slots=3)):
    got = _sample(ours, ids, mask, **kw, **extra, eos_id=sampler.NO_STOP)
    want = budgets if "row_budgets" in extra else np.full(8, 10)
    np.testing.assert_array_equal(got.lengths, want)
    assert got.truncated.all() and (got.mask.sum(1) == want).all()
    # Up to each row's stop, the same draws as with the stop tokens on.
    np.testing.assert_array_equal(got.tokens * stopping.mask * got.mask,
                                  stopping.tokens * stopping.mask * got.mask)
  assert repr(sampler.NO_STOP) == "sampler.NO_STOP"


def _worker(checkpoint, out, devices, *dist):
  tests = pathlib.Path(__file__).parent
  env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
             PYTHONPATH=os.pathsep.join([str(tests.parent), str(tests)]))
  return subprocess.Popen([sys.executable, str(tests / "engine_worker.py"), str(checkpoint),
                           str(out), *map(str, dist)], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_two_processes_equal_one(checkpoint, tmp_path):
  """2 processes x 4 devices, each driving its own prompts, give one 8-device process's rows."""
  with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
  procs = [_worker(checkpoint, tmp_path / "one.npz", 8)]
  procs += [_worker(checkpoint, tmp_path / f"p{i}.npz", 4, f"127.0.0.1:{port}", 2, i)
            for i in range(2)]
  for p in procs:
    try:
      out, err = p.communicate(timeout=600)
    except subprocess.TimeoutExpired:
      for q in procs:
        q.kill()
      raise
    assert p.returncode == 0, out[-2000:] + err[-4000:]
  one = np.load(tmp_path / "one.npz")
  parts = [np.load(tmp_path / f"p{i}.npz") for i in range(2)]
  assert one["tokens"].shape == (16, T) and parts[0]["tokens"].shape == (8, T)
  assert 0 < one["truncated"].sum() < 16
  for name in ("tokens", "lengths", "mask", "truncated"):
    np.testing.assert_array_equal(np.concatenate([p[name] for p in parts]), one[name], err_msg=name)
  np.testing.assert_allclose(np.concatenate([p["logprobs"] for p in parts]), one["logprobs"],
                             atol=LOGP_TOL, rtol=0)
