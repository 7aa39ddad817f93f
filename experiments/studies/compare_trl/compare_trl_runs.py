"""The two trainers of experiments/studies/compare_trl/compare_trl.py, each from one Hugging
Face directory: ba_jax through ``ba_jax.run.trainer.run`` and TRL through
``GRPOTrainer`` with arguments mirroring the ba_jax config (``trl_args``);
the warm-up both start from, and the one evaluator of both final policies.
Each ``run_*`` returns per-RL-step times (generation, scoring, update,
other), the whole run's time less held-out evaluations, the training reward
per step and the held-out curve.
"""
import contextlib
import copy
import importlib.util
import json
import os
import pathlib
import re
import shutil
import time

REPO = pathlib.Path(__file__).resolve().parents[3]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from ba_jax.config import schema  # noqa: E402
from ba_jax import export
from ba_jax.policy import hf
from ba_jax.run import model_setup
from ba_jax.run import setup as setup_lib
from ba_jax.tasks import registry as tasks
from ba_jax.run import trainer  # noqa: E402

# ours -> TRL's loss_type, and our rl.advantage_std -> TRL's scale_rewards.
LOSS_TYPES = {"token": "dapo", "sequence": "grpo", "dr_grpo": "dr_grpo"}
SCALE_REWARDS = {"group": "group", "batch": "batch", "none": "none"}
SCHEDULES = {"constant": "constant_with_warmup", "cosine": "cosine_with_min_lr"}


def load_config(spec: str, overrides=()):
  """``path[:arg]`` -> the config file's ``get_config(arg)``, with each
  ``dotted.key=value`` of ``overrides`` set (typed as the key's value)."""
  path, _, arg = spec.partition(":")
  file = pathlib.Path(path)
  file = file if file.is_absolute() else REPO / file
  if not file.is_file():
    raise FileNotFoundError(f"config file {file} not found")
  module_spec = importlib.util.spec_from_file_location("_compare_cfg", file)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  config = module.get_config(arg or None)
  for item in overrides:
    key, sep, text = item.partition("=")
    *parents, leaf = key.split(".")
    node = config
    for name in parents:
      node = node[name]
    if not sep or leaf not in node:
      raise ValueError(f"--set {item!r}: expected key=value with a key of "
                       f"{spec}")
    old = node[leaf]
    node[leaf] = (text.lower() in ("1", "true") if isinstance(old, bool)
                  else type(old)(text) if old is not None else text)
  return config


def _best_seconds(fn, repeats: int) -> float:
  fn()
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    best = min(best, time.perf_counter() - start)
  return best


def schedulable_cores() -> int:
  """The CPUs this process may run on (``taskset`` narrows them)."""
  return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
      os.cpu_count() or 1)


def xla_threads() -> int:
  """XLA:CPU's intra-op threads in this process: 1 with
  ``--xla_cpu_multi_thread_eigen=false`` in ``XLA_FLAGS``, the value of
  ``intra_op_parallelism_threads=N`` when given, else its default, one
  Eigen thread per schedulable CPU."""
  flags = os.environ.get("XLA_FLAGS", "")
  if "--xla_cpu_multi_thread_eigen=false" in flags:
    return 1
  found = re.search(r"intra_op_parallelism_threads=(\d+)", flags)
  return int(found.group(1)) if found else schedulable_cores()


def torch_thread_counts(requested: int) -> list[int]:
  """The torch intra-op thread counts each TRL run of a pair is timed at:
  ``[requested]``, or (0) 1 and every schedulable CPU (XLA's count); the
  faster whole run is the pair's TRL run."""
  if requested < 0:
    raise ValueError(f"--torch_threads={requested}: expected >= 0 (0: 1 and all cores)")
  return [requested] if requested else sorted({1, schedulable_cores()})


def matmul_gflops(n: int = 2048, repeats: int = 5) -> dict:
  """Best float32 ``n x n`` matmul rate of each library on this host at
  its run's thread count (JAX jitted, XLA's threads; torch at every
  schedulable CPU): each library's own floor (CPU hosts of one kind differ
  several-fold, and torch's MKL and XLA's Eigen differ on some CPUs)."""
  import torch
  a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
  f = jax.jit(lambda x: x @ x)
  ta = torch.randn(n, n)
  before = torch.get_num_threads()
  torch.set_num_threads(schedulable_cores())
  flop = 2 * n**3 / 1e9
  try:
    return {
        "jax": flop / _best_seconds(lambda: f(a).block_until_ready(), repeats),
        "torch": flop / _best_seconds(lambda: torch.mm(ta, ta), repeats),
        "torch_threads": torch.get_num_threads(), "jax_threads": xla_threads(),
        "n": n}
  finally:
    torch.set_num_threads(before)


# --------------------------------------------------------------------------
# The shared pieces: warm-up, the cell's config, the evaluator.


def warm_up(config, out_dir: pathlib.Path, log) -> dict:
  """The policy both trainers start from, as a Hugging Face directory: the
  config's warm-up (RL steps 0) exported with its tokenizer, or the config's
  ``init_from`` when it has no warm-up. Reused when ``out_dir`` has it."""
  if not config.sft.steps:
    if not config.init_from:
      raise ValueError("the config has neither a warm-up (sft.steps) nor "
                       "init_from: nothing to start both trainers from")
    return {"dir": config.init_from, "seconds": 0.0, "reused": True}
  stamp = out_dir / "compare_trl_warmup.json"
  if stamp.is_file():
    return dict(json.loads(stamp.read_text()), reused=True)
  c = copy.deepcopy(config)
  c.rl.steps = 0
  c.checkpoint.every = 0
  c.log.update(progress_bar=False, backends="")
  workdir = out_dir.parent / (out_dir.name + "_workdir")
  shutil.rmtree(workdir, ignore_errors=True)
  log(f"warm-up: {c.sft.steps} supervised steps -> {out_dir}")
  start = time.perf_counter()
  with _timed_evaluate(skip=True):  # the shared evaluator scores it per seed
    trainer.run(c, str(workdir))
  seconds = time.perf_counter() - start
  export.export(str(workdir), str(out_dir))
  shutil.rmtree(workdir, ignore_errors=True)
  info = {"dir": str(out_dir), "seconds": seconds}
  stamp.write_text(json.dumps(info, indent=1))
  return dict(info, reused=False)


def cell_config(base, *, seed: int, loss: str, steps: int, init_from: str,
                eval_every: int):
  """The ba_jax config of one run: ``base`` from ``init_from``, no warm-up,
  checkpoints only at the start and the end."""
  c = copy.deepcopy(base)
  c.seed = seed
  c.loss.aggregation = loss
  c.rl.steps = steps
  c.init_from = init_from
  c.sft.steps = 0
  c.eval.every = eval_every if 0 < eval_every < steps else 0
  c.checkpoint.every = 0
  c.log.update(progress_bar=False, backends="")
  return c


class Evaluator:
  """``ba_jax.run.trainer.evaluate`` on a Hugging Face directory's weights: the
  one evaluator of both trainers' policies (same held-out problems, same
  sampler, same PRNG key for the same ``key_index``)."""

  def __init__(self, config):
    self.config = config
    self.setup = setup_lib.make_setup(config)

  def __call__(self, hf_dir, key_index: int = trainer.EVAL_KEY) -> dict:
    s = self.setup
    model, loaded = hf.load_pretrained(
        str(hf_dir), mesh=s.mesh, rules=s.rules,
        **{k: getattr(s.model_config, k)
           for k in model_setup.runtime_fields(s.cfg)})
    if loaded != s.model_config:
      raise ValueError(f"{hf_dir}: architecture {loaded} differs from the "
                       f"run's {s.model_config}")
    from flax import nnx
    key = jax.random.fold_in(jax.random.key(self.config.seed), key_index)
    return trainer.evaluate(s, nnx.state(model), key)


@contextlib.contextmanager
def _timed_evaluate(skip: bool, skip_first: bool = False):
  """Times every held-out evaluation the trainer runs, so it can be taken
  out of its wall time; ``skip`` replaces them all by a no-op, and
  ``skip_first`` the first (a fresh run's before-RL evaluation, which the
  shared evaluator does for both trainers)."""
  original, spent, calls = trainer.evaluate, [0.0], [0]

  def timed(*args, **kwargs):
    calls[0] += 1
    if skip or (skip_first and calls[0] == 1):
      return {}
    start = time.perf_counter()
    try:
      return original(*args, **kwargs)
    finally:
      spent[0] += time.perf_counter() - start

  trainer.evaluate = timed
  try:
    yield spent
  finally:
    trainer.evaluate = original


def _read_jsonl(path: pathlib.Path) -> list[dict]:
  if not path.is_file():
    return []
  return [json.loads(line) for line in path.read_text().splitlines() if line]


# --------------------------------------------------------------------------
# One run of each trainer.


def run_ours(config, workdir: pathlib.Path, *, evaluate: bool,
             cache: str = "cold") -> dict:
  """ba_jax's GRPO through ``trainer.run`` (compile included: the JAX caches
  are cleared first, as in a fresh process). ``cache``: the persistent
  compilation cache's state, recorded ("cold", or "warm" when the caller
  filled ``compilation_cache_dir`` first)."""
  shutil.rmtree(workdir, ignore_errors=True)
  jax.clear_caches()
  with _timed_evaluate(skip=not evaluate, skip_first=True) as eval_seconds:
    start = time.perf_counter()
    summary = trainer.run(config, str(workdir))
    wall = time.perf_counter() - start
  rows = [r for r in _read_jsonl(workdir / "metrics.jsonl") if "time_step" in r]
  steps = []
  for r in rows:
    other = r["time_step"] - r["time_sampling"] - r["time_rewards"] - r[
        "time_training"]
    steps.append(dict(step=r["step"], generation=r["time_sampling"],
                      scoring=r["time_rewards"], update=r["time_training"],
                      other=other, total=r["time_step"],
                      reward=r["reward_mean"], accuracy=r["accuracy"],
                      length=r["length_mean"]))
  xla = xla_threads()
  out = dict(trainer="ba_jax", steps=steps, wall=wall,
             threads={"generation": xla, "update": xla}, cores=schedulable_cores(),
             cache=cache,
             eval_seconds=eval_seconds[0], run_seconds=wall - eval_seconds[0],
             rl_seconds=sum(s["total"] for s in steps),
             curve=[{k: v for k, v in r.items()}
                    for r in _read_jsonl(workdir / "eval.jsonl")],
             own_after_rl=summary.get("after_rl", {}))
  if evaluate:
    final = workdir / "final_hf"
    export.export(str(workdir), str(final))
    out["final_dir"] = str(final)
  shutil.rmtree(workdir / "checkpoints", ignore_errors=True)
  return out


def _prompt_texts(task, problems, tokenizer) -> tuple[list[str], list[list]]:
  """Our encoded prompts as text for TRL's dataset, and their ids; asserts
  that TRL's tokenisation of the text (``processing_class(text=...)``)
  gives back exactly our ids."""
  ids, mask = task.encode_prompts(problems)
  rows = [[int(t) for t, m in zip(r, mr) if m] for r, mr in zip(ids, mask)]
  texts = [tokenizer.decode(r, skip_special_tokens=False) for r in rows]
  again = tokenizer(text=texts)["input_ids"]
  bad = [i for i, (a, b) in enumerate(zip(again, rows)) if list(a) != b]
  if bad:
    i = bad[0]
    raise ValueError(f"{len(bad)} prompts retokenise differently, e.g. "
                     f"{texts[i]!r}: ours {rows[i]}, TRL's {list(again[i])}")
  return texts, rows


def trl_args(config, workdir: pathlib.Path) -> dict:
  """GRPOConfig's arguments mirroring ``config`` (see UNMATCHED for what
  cannot be mirrored exactly). An RL step of ours (one rollout of B*G rows,
  ``ppo_epochs`` x ``num_minibatches`` updates of ``num_microbatches``
  accumulated parts) is ``steps_per_generation`` = updates-per-epoch x
  micro-batches, ``gradient_accumulation_steps`` = micro-batches,
  ``num_iterations`` = epochs."""
  rl, loss, optim = config.rl, config.loss, config.optim
  unsupported = {
      "loss.kl_coef": loss.kl_coef != 0, "loss.entropy_coef": loss.entropy_coef,
      "loss.dual_clip": loss.dual_clip is not None,
      "rl.dynamic_sampling": rl.dynamic_sampling,
      "rl.overlong=soft": rl.overlong == "soft",
      "rl.old_logp=recompute": rl.old_logp != "sampler"}
  if any(unsupported.values()):
    raise ValueError("compare_trl mirrors plain GRPO only; unsupported: "
                     f"{[k for k, v in unsupported.items() if v]}")
  if loss.aggregation not in LOSS_TYPES:
    raise ValueError(f"loss.aggregation={loss.aggregation!r} has no TRL "
                     f"loss type; expected one of {list(LOSS_TYPES)}")
  if loss.max_response_len not in (None, rl.max_new_tokens):
    raise ValueError("loss.max_response_len must be rl.max_new_tokens (TRL's "
                     "dr_grpo divides by max_completion_length)")
  rows = rl.prompts_per_step * rl.group_size
  parts = rl.num_minibatches * rl.num_microbatches
  return dict(
      output_dir=str(workdir), use_cpu=True, report_to=[], seed=config.seed,
      data_seed=config.seed, loss_type=LOSS_TYPES[loss.aggregation],
      beta=0.0, num_generations=rl.group_size,
      per_device_train_batch_size=rows // parts,
      gradient_accumulation_steps=rl.num_microbatches,
      steps_per_generation=parts, num_iterations=rl.ppo_epochs,
      max_steps=rl.steps * rl.ppo_epochs * rl.num_minibatches,
      max_completion_length=rl.max_new_tokens,
      temperature=rl.temperature, top_p=rl.top_p, top_k=rl.top_k,
      epsilon=loss.eps_low, epsilon_high=loss.eps_high,
      scale_rewards=SCALE_REWARDS[rl.advantage_std],
      mask_truncated_completions=rl.overlong == "mask",
      learning_rate=optim.learning_rate,
      lr_scheduler_type=SCHEDULES[optim.schedule],
      lr_scheduler_kwargs=({"min_lr_rate": optim.end_lr_frac}
                           if optim.schedule == "cosine" else None),
      warmup_steps=optim.warmup_steps, weight_decay=optim.weight_decay,
      adam_beta1=optim.b1, adam_beta2=optim.b2, adam_epsilon=optim.eps,
      max_grad_norm=optim.grad_clip if optim.grad_clip > 0 else 1e9,
      optim="adamw_torch", shuffle_dataset=False, save_strategy="no",
      logging_steps=1, bf16=False, gradient_checkpointing=False,
      disable_tqdm=True, model_init_kwargs={"dtype": "float32"})


def _one_or_all(seen: set) -> int | list[int]:
  return next(iter(seen)) if len(seen) == 1 else sorted(seen)


def run_trl(config, workdir: pathlib.Path, *, start_dir: str,
            evaluator: Evaluator | None, eval_every: int, threads: int) -> dict:
  """TRL's GRPOTrainer from ``start_dir`` on the config's prompts and
  reward, torch on ``threads`` intra-op threads (recorded per phase as
  torch reports them during the run). Its held-out curve (every
  ``eval_every`` RL steps, by ``evaluator``) is taken out of the timings."""
  import torch
  from datasets import Dataset
  from transformers import AutoTokenizer, TrainerCallback
  from trl import GRPOConfig, GRPOTrainer

  shutil.rmtree(workdir, ignore_errors=True)
  torch.set_num_threads(threads)
  seen = {"generation": set(), "update": set()}
  torch.manual_seed(config.seed)
  rl = config.rl
  cfg = schema.parse(config)
  task = tasks.make_task(cfg.task, cfg.eval, seed=cfg.seed,
                         tokenizer=tasks.make_tokenizer(cfg.task, str(start_dir)))
  problems = task.problems(0, rl.steps * rl.prompts_per_step)
  processing = AutoTokenizer.from_pretrained(start_dir)
  texts, _ = _prompt_texts(task, problems, processing)
  dataset = Dataset.from_dict({"prompt": texts, "idx": list(range(len(texts)))})
  rewards_log, clock = [], {"generation": 0.0, "scoring": 0.0, "prep": 0.0}

  def task_reward(prompts, completions, idx, **_):
    rewards, correct = task.grade(completions, [problems[i] for i in idx])
    rewards_log.append(dict(reward=float(np.mean(rewards)),
                            accuracy=float(np.mean(correct)),
                            first_problem=int(idx[0])))
    return [float(r) for r in rewards]

  def timed(name, fn):
    def wrapper(*args, **kwargs):
      if name in seen:
        seen[name].add(torch.get_num_threads())
      start = time.perf_counter()
      try:
        return fn(*args, **kwargs)
      finally:
        clock[name] += time.perf_counter() - start
    return wrapper

  per_rl_step = rl.ppo_epochs * rl.num_minibatches
  steps, curve, eval_seconds = [], [], [0.0]

  class StepClock(TrainerCallback):
    """One record per RL step (``per_rl_step`` optimizer steps): its wall
    time from the previous RL step's end, less held-out evaluation."""

    def on_train_begin(self, args, state, control, **kwargs):
      self.t0, self.c0 = time.perf_counter(), dict(clock)

    def on_step_begin(self, args, state, control, **kwargs):
      seen["update"].add(torch.get_num_threads())

    def on_step_end(self, args, state, control, model=None, **kwargs):
      seen["update"].add(torch.get_num_threads())
      if state.global_step % per_rl_step:
        return
      now = time.perf_counter()
      d = {k: clock[k] - self.c0[k] for k in clock}
      total = now - self.t0
      step = state.global_step // per_rl_step
      rec = rewards_log[step - 1] if len(rewards_log) >= step else {}
      steps.append(dict(
          step=step, generation=d["generation"], scoring=d["scoring"],
          # "other" is the rest of TRL's rollout: the old log-probs' forward
          # pass (ours takes the sampler's), advantages, its logging.
          update=total - d["generation"] - d["scoring"] - d["prep"],
          other=d["prep"], total=total, reward=rec.get("reward"),
          accuracy=rec.get("accuracy")))
      if evaluator is not None and eval_every and step % eval_every == 0 \
          and step < rl.steps:
        start = time.perf_counter()
        tmp = workdir / f"eval_step_{step}"
        model.save_pretrained(tmp)
        curve.append(dict(step=step, **evaluator(tmp, trainer.EVAL_KEY + 1)))
        shutil.rmtree(tmp)
        eval_seconds[0] += time.perf_counter() - start
      self.t0, self.c0 = time.perf_counter(), dict(clock)

  start = time.perf_counter()
  grpo = GRPOTrainer(model=start_dir, reward_funcs=[task_reward],
                     args=GRPOConfig(**trl_args(config, workdir)),
                     train_dataset=dataset, processing_class=processing,
                     callbacks=[StepClock()])
  # Instance attributes shadow the methods: generation (prompt tokenisation,
  # generate, EOS masking, decoding), rewards, and the rest of the rollout
  # (old log-probs forward, advantages, logging).
  inner = grpo._generate_and_score_completions
  grpo._generate = timed("generation", grpo._generate)
  grpo._calculate_rewards = timed("scoring", grpo._calculate_rewards)

  def generate_and_score(*args, **kwargs):
    before = clock["generation"] + clock["scoring"]
    t = time.perf_counter()
    out = inner(*args, **kwargs)
    clock["prep"] += (time.perf_counter() - t) - (
        clock["generation"] + clock["scoring"] - before)
    return out

  grpo._generate_and_score_completions = generate_and_score
  grpo.train()
  wall = time.perf_counter() - start
  out = dict(trainer="trl", steps=steps, wall=wall,
             threads={k: _one_or_all(v) for k, v in seen.items()},
             cores=schedulable_cores(),
             cache="none (eager PyTorch: nothing compiled, no warm start)",
             eval_seconds=eval_seconds[0], run_seconds=wall - eval_seconds[0],
             rl_seconds=sum(s["total"] for s in steps), curve=curve,
             prompts_checked=len(texts),
             # TRL's RL step k graded problems k*B .. (k+1)*B - 1, as ours.
             prompt_order_ok=[r["first_problem"] for r in rewards_log] == [
                 k * rl.prompts_per_step for k in range(len(rewards_log))])
  if evaluator is not None:
    final = workdir / "final_hf"
    grpo.save_model(str(final))
    out["final_dir"] = str(final)
  for extra in workdir.glob("checkpoint-*"):
    shutil.rmtree(extra)
  return out
