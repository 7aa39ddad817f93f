"""rl.prompt_pad_multiple: the batch's prompts narrowed to the longest one
(rounded up), every token kept, and the update on them equal to the update on
the full width."""
import jax
import numpy as np
import pytest

from ba_jax.config import schema
from ba_jax.policy import sharding as sharding_lib
from ba_jax.run import rollout
from ba_jax.update import train_step as ts
import test_dynamic_sampling as fake
import trainer_utils as tu

PAD = 0


def _left_padded(lengths, width, seed=0):
  rng = np.random.default_rng(seed)
  mask = (np.arange(width)[None] >= width - np.asarray(lengths)[:, None]).astype(np.int32)
  ids = np.where(mask == 1, rng.integers(3, 30, (len(lengths), width)), PAD).astype(np.int32)
  return ids, mask


def _real_tokens(ids, mask):
  return [row[m != 0].tolist() for row, m in zip(ids, mask)]


@pytest.mark.parametrize("multiple, width", [(4, 8), (1, 5), (8, 8), (16, 16)])
def test_narrows_to_the_longest_prompt_rounded_up_keeping_every_token(multiple, width):
  ids, mask = _left_padded([3, 5, 2, 0], 16)
  out_ids, out_mask = rollout.narrow_prompts(ids, mask, multiple, pad_id=PAD)
  assert out_ids.shape == out_mask.shape == (4, width)
  assert out_ids.dtype == ids.dtype and out_mask.dtype == mask.dtype
  assert _real_tokens(out_ids, out_mask) == _real_tokens(ids, mask)
  # Left-padded: each row's tokens end at the last column, pads carry pad_id.
  np.testing.assert_array_equal(out_mask, (np.arange(width)[None] >= width - np.array(
      [3, 5, 2, 0])[:, None]).astype(np.int32))
  assert (out_ids[out_mask == 0] == PAD).all()


def test_right_padded_prompts_come_out_left_padded():
  ids, mask = _left_padded([3, 5, 2], 12, seed=1)
  right_ids = np.stack([np.roll(r, -(12 - n)) for r, n in zip(ids, [3, 5, 2])])
  right_mask = np.stack([np.roll(m, -(12 - n)) for m, n in zip(mask, [3, 5, 2])])
  out = rollout.narrow_prompts(right_ids, right_mask, 4, pad_id=PAD)
  expected = rollout.narrow_prompts(ids, mask, 4, pad_id=PAD)
  for got, want in zip(out, expected):
    np.testing.assert_array_equal(got, want)


def test_never_wider_than_the_padded_prompts():
  ids, mask = _left_padded([5, 6], 6)
  out_ids, out_mask = rollout.narrow_prompts(ids, mask, 4, pad_id=PAD)  # 8 > 6
  assert out_ids is ids and out_mask is mask


def test_a_bad_multiple_is_named():
  ids, mask = _left_padded([2], 4)
  with pytest.raises(ValueError, match="rl.prompt_pad_multiple=0"):
    rollout.narrow_prompts(ids, mask, 0, pad_id=PAD)
  with pytest.raises(ValueError, match="rl.prompt_pad_multiple"):
    schema.check("rl.prompt_pad_multiple", -1)


class WidePromptTask(fake.FakeTask):
  """The fake task's 2-token prompts left-padded to 16 columns."""

  def encode_prompts(self, problems):
    ids, mask = super().encode_prompts(problems)
    pad = np.zeros((len(ids), 14), np.int32)
    return np.concatenate([pad, ids], 1), np.concatenate([pad, mask], 1)


@pytest.mark.parametrize("multiple, width", [(0, 16), (4, 4), (1, 2)])
def test_collect_hands_the_update_narrowed_prompts(monkeypatch, multiple, width):
  monkeypatch.setattr(rollout.sampler_lib, "sample_groups", fake.fake_sample_groups)
  rl = fake._config(dynamic_sampling=False, prompt_pad_multiple=multiple)
  task = WidePromptTask()
  ro = fake._collect(task, rl)
  wide = fake._collect(task, fake._config(dynamic_sampling=False))
  assert ro.prompt_ids.shape == (4 * fake.G, width)
  assert _real_tokens(ro.prompt_ids, ro.prompt_mask) == _real_tokens(
      wide.prompt_ids, wide.prompt_mask)
  np.testing.assert_array_equal(ro.response_ids, wide.response_ids)
  np.testing.assert_array_equal(ro.advantages, wide.advantages)


@pytest.mark.parametrize("aggregation", ["token", "balanced"])
def test_the_update_on_narrowed_prompts_equals_the_full_width_update(aggregation):
  """Padding is masked out of attention, so dropping padded columns changes
  only the order of float sums: loss, metrics and parameters agree to float32
  rounding."""
  import test_train_step as tts
  mesh = sharding_lib.make_mesh({"data": -1, "fsdp": 1, "tensor": 1},
                                devices=jax.devices()[:1])
  cfg = ts.StepConfig(group_size=4, aggregation=aggregation, eps_high=0.28,
                      num_minibatches=2)
  batch = tu.rollout_batch(7, n=16, prompt_len=16)  # prompts of 2..16 tokens
  lengths = batch["prompt_mask"].sum(1)
  batch["prompt_mask"][lengths > 6] = 0  # now every prompt has at most 6 tokens
  batch["prompt_mask"][lengths > 6, -6:] = 1
  batch["prompt_ids"] = batch["prompt_ids"] * batch["prompt_mask"]
  narrow = dict(batch)
  narrow["prompt_ids"], narrow["prompt_mask"] = rollout.narrow_prompts(
      batch["prompt_ids"], batch["prompt_mask"], 4, pad_id=PAD)
  assert narrow["prompt_ids"].shape == (16, 8)
  results = []
  for b in (batch, narrow):
    state, step, place = tts._setup(mesh, cfg=cfg, eps=1e-3)
    start = tu.host_params(state)
    state, metrics = step(state, place(b))
    results.append((tu.host_params(state), jax.device_get(metrics)))
  (p_wide, m_wide), (p_narrow, m_narrow) = results
  assert tu.max_abs_diff(p_wide, start) > 1e-4  # the update did something
  assert tu.max_abs_diff(p_wide, p_narrow) < 1e-6
  for name in ("loss", "grad_norm", "w_pos", "w_neg", "entropy", "ratio_max"):
    np.testing.assert_allclose(m_narrow[name], m_wide[name], rtol=1e-5, atol=1e-7)
