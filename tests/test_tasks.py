"""The task registry and protocol: what the trainer may ask of any task."""
import numpy as np
import pytest

from ba_jax.config import common, schema
from ba_jax.tasks import dataset_task
from ba_jax.run import setup as setup_lib
from ba_jax.update import sft
from ba_jax.tasks import synthetic
from ba_jax.tasks import registry as tasks
import trainer_utils as tu

PROTOCOL = ("problems", "warmup_examples", "encode_prompts",
            "encode_responses", "decode", "grade", "from_section",
            "build_tokenizer", "max_warmup_response_tokens", "has_warmup")


def test_registry_holds_the_bundled_tasks():
  assert tasks.names() == ["dapo_math17k", "polaris", "reasoning_gym",
                          "synthetic_chains", "synthetic_drafts", "synthetic_sum"]
  assert tasks.task_class("synthetic_sum") is synthetic.SyntheticTask
  assert tasks.task_class("polaris") is dataset_task.DatasetTask
  for name in tasks.names():
    cls = tasks.task_class(name)
    assert all(hasattr(cls, attr) for attr in PROTOCOL), name
  with pytest.raises(ValueError, match=r"task.name='sums'.*synthetic_sum"):
    tasks.task_class("sums")


def test_synthetic_task_from_the_tiny_config():
  config = tu.smoke_config()
  cfg = schema.parse(config)
  task = tasks.make_task(cfg.task, cfg.eval, seed=cfg.seed,
                         tokenizer=tasks.make_tokenizer(cfg.task))
  assert task.name == "synthetic_sum" and task.has_warmup
  assert len(task.heldout) == config.eval.num_problems
  problems, texts = task.warmup_examples(step=2, batch_size=5)
  # The warm-up stream is its own, fixed by the seed and the step.
  assert problems == synthetic.train_problems(
      task.cfg, config.seed + 7919, 10, 5, frozenset(task.heldout))
  assert (problems, texts) == task.warmup_examples(step=2, batch_size=5)
  batch = sft.warmup_batch(task, 2, 5, config.rl.max_new_tokens,
                           slice(1, 3))
  assert batch["prompt_ids"].shape == (2, config.task.max_prompt_len)
  ids, mask = task.encode_responses(texts[1:3], config.rl.max_new_tokens)
  np.testing.assert_array_equal(batch["response_ids"], ids)
  assert task.decode(ids, mask) == texts[1:3]
  rewards, correct = task.grade(
      [synthetic.correct_response(p) for p in problems], problems)
  assert correct.all() and (rewards == 1.0).all()


def test_a_new_task_is_a_class_and_a_register_call():
  class Shorter(synthetic.SyntheticTask):
    name = "synthetic_sum_no_gap"

    @staticmethod
    def max_warmup_response_tokens(task_cfg):
      return synthetic.SyntheticTask.max_warmup_response_tokens(task_cfg) - 2

  tasks.register(Shorter)
  try:
    config = tu.smoke_config(**{"task.name": "synthetic_sum_no_gap"})
    setup = setup_lib.make_setup(config)
    assert isinstance(setup.task, Shorter)
    with pytest.raises(ValueError, match="already registered"):
      tasks.register(synthetic.SyntheticTask, "synthetic_sum_no_gap")
  finally:
    del tasks._REGISTRY["synthetic_sum_no_gap"]  # pylint: disable=protected-access
    del schema.TASK_SECTIONS["synthetic_sum_no_gap"]


def test_task_specific_checks_come_from_the_task():
  need = synthetic.SyntheticTask.max_warmup_response_tokens(
      tu.smoke_config().task)
  with pytest.raises(ValueError, match=f"below the {need} tokens"):
    setup_lib.make_setup(tu.smoke_config(**{"rl.max_new_tokens": need - 1}))
  config = tu.smoke_config()
  config.task = common.task("polaris", path="polaris.jsonl")
  with pytest.raises(ValueError, match="has no warm-up data"):
    setup_lib.make_setup(config)
  config.sft.steps = 0
  with pytest.raises(ValueError, match="needs init_from"):
    setup_lib.make_setup(config)
