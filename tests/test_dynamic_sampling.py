"""DAPO dynamic sampling in rollout.collect, with a fake task and sampler:
groups are filtered on their final rewards (after the soft overlong penalty)."""
import numpy as np
import pytest

from ba_jax.run import rollout
from ba_jax.generation import sampler

G, T = 4, 12


class FakeTask:
  """Problem i's group: i % 3 == 0 all right (equal rewards), 1 mixed, 2 all
  wrong but one response long enough for the soft penalty."""
  pad_id, eos_id = 0, 1

  def __init__(self, kinds=(0, 1, 2)):
    self.kinds = kinds

  def problems(self, start, n):
    return list(range(start, start + n))

  def kind(self, i):
    return self.kinds[i % len(self.kinds)]

  def encode_prompts(self, problems):
    ids = np.array([[2, self.kind(p)] for p in problems], np.int32)
    return ids, np.ones_like(ids)

  def decode(self, tokens, mask):
    return [str(int(m.sum())) for m in mask]

  def grade(self, texts, problems):
    correct = np.array([self.kind(p) == 0 or (self.kind(p) == 1 and j % 2 == 0)
                        for j, p in enumerate(problems)])
    return correct.astype(np.float32), correct


def fake_sample_groups(model, ids, mask, *, group_size, max_new_tokens, **_):
  n = len(ids) * group_size
  lengths = np.full(n, 3)
  long_rows = [g * group_size for g in range(len(ids)) if ids[g, 1] == 2]
  lengths[long_rows] = max_new_tokens - 1  # inside the penalty's ramp
  token_mask = (np.arange(max_new_tokens)[None] < lengths[:, None]).astype(np.int32)
  return sampler.SampleResult(tokens=token_mask * 5, logprobs=-token_mask * 0.5,
                              mask=token_mask, lengths=lengths,
                              truncated=np.zeros(n, bool))


@pytest.fixture(autouse=True)
def _fake_sampler(monkeypatch):
  monkeypatch.setattr(rollout.sampler_lib, "sample_groups", fake_sample_groups)


def _config(**overrides):
  fields = dict(prompts_per_step=4, group_size=G, max_new_tokens=T,
                dynamic_sampling=True, max_sampling_rounds=3, oversample=1.5,
                overlong="soft", overlong_buffer=4, overlong_penalty=1.0)
  fields.update(overrides)
  return rollout.RolloutConfig(**fields)


def _collect(task, rl):
  import jax
  return rollout.collect(None, task, position=0, key=jax.random.key(0), rl=rl)


def test_keeps_only_groups_whose_final_rewards_differ():
  rl = _config()
  ro = _collect(FakeTask(), rl)
  rewards_GxS = ro.rewards.reshape(-1, G)
  assert rewards_GxS.shape == (4, G)
  # No equal-reward group, and the penalty-only groups were kept: their
  # raw rewards are all 0, their final ones are not.
  assert (rewards_GxS.max(-1) > rewards_GxS.min(-1)).all()
  assert (rewards_GxS.min(-1) < 0).any()
  assert (np.abs(ro.advantages.reshape(-1, G)).sum(-1) > 0).all()
  # 6 prompts per round (4 x 1.5): 4 of the first 6 have a signal.
  assert ro.stats["sampling_rounds"] == 1.0 and ro.prompts_used == 6
  assert ro.stats["dapo_filled_groups"] == 0.0
  assert ro.stats["dapo_dropped_groups"] == 2.0


def test_refills_over_rounds_and_fills_only_with_zero_advantage_groups():
  task = FakeTask(kinds=(0, 0, 0, 0, 0, 1))  # one prompt in six has a signal
  ro = _collect(task, _config(max_sampling_rounds=2))
  rewards_GxS = ro.rewards.reshape(-1, G)
  mixed = rewards_GxS.max(-1) > rewards_GxS.min(-1)
  assert ro.stats["sampling_rounds"] == 3.0 and ro.prompts_used == 18
  assert mixed.sum() == 3 and ro.stats["dapo_filled_groups"] == 1.0
  assert ro.stats["dapo_dropped_groups"] == 18 - 4
  # The filler has equal final rewards, so exactly zero advantage.
  assert (ro.advantages.reshape(-1, G)[~mixed] == 0).all()


def test_without_dynamic_sampling_the_batch_is_the_first_prompts():
  ro = _collect(FakeTask(), _config(dynamic_sampling=False))
  assert ro.prompts_used == 4 and ro.stats["sampling_rounds"] == 1.0
  assert ro.stats["dapo_dropped_groups"] == 0.0
  assert ro.rewards.reshape(-1, G)[0].tolist() == [1.0] * G  # kept as is


def test_oversample_below_one_is_named():
  with pytest.raises(ValueError, match="rl.oversample=0.5"):
    _config(oversample=0.5)
