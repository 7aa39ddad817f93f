"""What every config shares: the variant parser, and each section's keys with
their documented defaults. A config file starts from ``base()`` and states
only what differs; ``configs/tiny.py`` is the smallest example.

Config files load this one by path (``configs/`` is not a package)::

    common = _load_common()  # see the bottom of any config file

The sharding rules are not copied here: every config uses the one table,
``ba_jax.policy.sharding.DEFAULT_RULES`` (logical axis name -> mesh axes), so a new
logical axis name is added there once.
"""
import ml_collections
from ml_collections import config_dict

from ba_jax.policy import sharding


def parse_variants(arg, allowed: dict[str, str], config_file: str) -> dict:
  """``key=value,flag`` (what follows the colon in ``--config=file.py:...``)
  as a dict; a key not in ``allowed`` (name -> what it sets) is an error."""
  out = {}
  for item in filter(None, (arg or "").split(",")):
    key, _, value = item.partition("=")
    out[key] = value if value else True
  unknown = sorted(set(out) - set(allowed))
  if unknown:
    expected = "; ".join(f"{k}: {v}" for k, v in allowed.items())
    raise ValueError(f"{config_file}: unknown variant(s) {unknown} in {arg!r};"
                     f" expected some of: {expected}")
  return out


def base(aggregation: str = "balanced") -> ml_collections.ConfigDict:
  """Every section but ``model`` and ``task``, at the defaults of the tiny
  CPU job; comments say what each key does."""
  c = ml_collections.ConfigDict()
  c.seed = 0  # parameters, data stream and sampling all derive from it

  # A Hugging Face directory (config.json, safetensors, tokenizer) to start
  # from, read by ba_jax.policy.hf.load_pretrained; "" builds a random model from
  # config.model. With it set, the architecture is the checkpoint's own and
  # config.model supplies only how to run it (dtype, param_dtype, remat,
  # attention_*, logprob_chunk, scan_unroll).
  c.init_from = ""

  # Supervised warm-up before RL; steps=0 skips it.
  c.sft = ml_collections.ConfigDict(dict(
      steps=0,  # optimizer steps
      batch_size=64,  # sequences per step
      learning_rate=3e-3,  # peak, warmup then cosine to 10%
      warmup_steps=20,
  ))

  # GRPO.
  c.rl = ml_collections.ConfigDict(dict(
      steps=60,  # train steps (each: sample, reward, PPO epochs)
      prompts_per_step=16,  # B; the global batch is B * group_size rows
      group_size=8,  # G responses per prompt
      max_new_tokens=32,  # T, response budget (truncated after)
      temperature=1.0,  # sampling temperature; the loss scores at it too
      top_p=1.0,  # nucleus sampling (1.0 = off)
      top_k=0,  # top-k sampling (0 = off)
      max_slots=0,  # decode slots per process (0: all rows at once; fewer: continuous batching, ba_jax/generation/engine.py)
      # KV-cache budget per device, GiB (0: unused): the engine runs the
      # slots it holds (ba_jax.run.rollout.decode_slots); with max_slots also
      # set, max_slots is used and must fit it.
      kv_cache_gib=0.0,
      prefill_chunk=0,  # the engine prefills prompts this many tokens at a time (0: whole)
      # Cache lengths a decode loop runs through, so attention reads ~the
      # written part (0: the backend's default, 8 on CPU for 256+ positions,
      # 1 on accelerators; 1: the whole cache from the first step). Same tokens.
      cache_phases=0,
      ppo_epochs=1,  # passes over the batch per step
      num_minibatches=2,  # optimizer updates per epoch (whole groups each)
      num_microbatches=1,  # gradient accumulation inside a mini-batch
      old_logp="sampler",  # sampler | recompute: the behaviour log-probs
      advantage_std="group",  # group | batch | none (Dr. GRPO)
      dynamic_sampling=False,  # DAPO: drop groups whose final rewards are all equal
      max_sampling_rounds=3,  # extra sampling rounds to refill (DAPO)
      oversample=1.0,  # dynamic sampling: prompts per round / prompts_per_step
      overlong="none",  # none | mask (drop truncated) | soft (DAPO penalty)
      overlong_buffer=8,  # soft: penalty ramps over the last this many tokens
      overlong_penalty=1.0,  # soft: penalty at the budget
      max_nonfinite=5,  # this many non-finite updates in a row stops the run
  ))

  # Loss (ba_jax.loss.losses.policy_loss); every option is static in the step.
  c.loss = ml_collections.ConfigDict(dict(
      aggregation=aggregation,  # token | sequence | dr_grpo | balanced
      eps_low=0.2,  # clip range below 1
      eps_high=0.28,  # clip range above 1 (clip-higher when > eps_low)
      dual_clip=config_dict.placeholder(float),  # c > 1 caps A < 0; None = off
      kl_coef=0.0,  # > 0 loads a frozen reference policy
      kl_type="k3",  # k1 | k2 | k3
      entropy_coef=0.0,  # entropy bonus
      reg_aggregation="token",  # mode aggregating the KL and entropy terms
      max_response_len=config_dict.placeholder(int),  # dr_grpo; None = T
      ba_denominator="group",  # group | signed
      ba_scope="group",  # group | batch
  ))

  # optax AdamW for RL (ba_jax.update.train_step.make_optimizer).
  c.optim = ml_collections.ConfigDict(dict(
      learning_rate=1e-4,  # peak
      warmup_steps=2,  # linear warm-up from 0, in optimizer updates
      schedule="constant",  # constant | cosine (to end_lr_frac * peak)
      end_lr_frac=0.1,  # cosine only
      weight_decay=0.0,
      b1=0.9,
      b2=0.999,
      eps=1e-8,
      grad_clip=1.0,  # clip by global norm; 0 = off
  ))

  # Devices: one mesh; -1 takes the remaining devices. Logical parameter and
  # activation names map to mesh axes through the rules table.
  c.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, tensor=1))
  c.sharding_rules = sharding.DEFAULT_RULES

  c.checkpoint = ml_collections.ConfigDict(dict(
      every=30,  # save every this many RL steps (and at the end); 0 = end only
      keep=2,  # checkpoints kept
      async_save=True,
  ))
  c.eval = ml_collections.ConfigDict(dict(
      num_problems=128,  # held-out problems (per benchmark; 0 = all)
      samples_per_problem=4,  # sampled accuracy: responses per problem
      temperature=1.0,  # sampled accuracy temperature (greedy also reported)
      every=0,  # evaluate every this many RL steps (0: before/after only)
  ))
  c.log = ml_collections.ConfigDict(dict(
      tensorboard=True,
      progress_bar=True,  # off for pod logs: one line per step
  ))
  c.stop_after_steps = 0  # > 0: stop (save and exit) after this many steps
  return c


def model(**fields) -> ml_collections.ConfigDict:
  """A ``model`` section: ``fields`` (ba_jax.policy.model.ModelConfig's) over the
  defaults of how to run it."""
  return ml_collections.ConfigDict(dict(dict(
      dtype="float32",  # compute dtype
      param_dtype="float32",  # parameters and optimizer moments
      # What the backward pass of each (scanned) layer keeps: "none" keeps
      # every activation; "full" recomputes the layer; a jax.checkpoint
      # policy such as "dots_with_no_batch_dims_saveable" keeps the matmul
      # outputs (ba_jax.policy.model.REMAT_POLICIES).
      remat="none",
      # Uncached attention: "full" builds the [L, L] score matrix; "blockwise"
      # runs over attention_block x attention_block tiles (flash-style);
      # "auto" picks the backend's kernel (splash on TPU, cuDNN on GPU,
      # blockwise on CPU; ba_jax/policy/attention.py).
      attention_impl="full",
      attention_block=512,
      # Scoring runs the LM head and log-softmax over this many tokens at a
      # time: peak memory O(rows x chunk x vocab), never [rows, L, vocab].
      logprob_chunk=512,
      # Layers per iteration of the layer scan (1 = one compiled body; 0 =
      # auto: every layer on CPU, where the scan's loop costs ~10% of a step,
      # 1 on TPU/GPU; the dry run compiles the accelerator's program, 1).
      scan_unroll=0,
  ), **fields))


PAPER_VARIANTS = {"agg": "<aggregation mode>", "param_dtype": "<dtype>",
                  "runlocal": "a few steps on this CPU: tiny random model of "
                              "the same family on the bundled synthetic task"}


def paper_config(arg, config_file: str, **architecture
                 ) -> tuple[ml_collections.ConfigDict, dict]:
  """A paper setting: ``base()``, the model ``architecture`` (ModelConfig
  fields) and ``dapo_recipe``, and the parsed variants (``PAPER_VARIANTS``);
  the caller adds ``init_from``, the lengths and the task, then applies
  ``runlocal`` when asked."""
  args = parse_variants(arg, PAPER_VARIANTS, config_file)
  c = base(aggregation=args.get("agg", "balanced"))
  c.model = model(**architecture)
  dapo_recipe(c, param_dtype=args.get("param_dtype", "float32"))
  return c, args


def runlocal(c: ml_collections.ConfigDict) -> None:
  """Shrinks a paper config ``c`` (task already set) in place to a
  seconds-scale CPU run: a random model of the same family (model_type,
  qk_norm, attention bias and tied embeddings kept; every size tiny), no
  ``init_from``, and the bundled synthetic task instead of the dataset,
  whose prompts would need the checkpoint's tokenizer. The recipe's keys
  (loss, overlong shaping, dynamic sampling, optimizer) stay as they are
  at toy sizes, so what is exercised is the paper config's own path."""
  c.init_from = ""
  c.model.update(vocab_size=32, hidden_size=32, intermediate_size=64,
                 num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16,
                 max_position_embeddings=128, dtype="float32",
                 param_dtype="float32", attention_impl="full",
                 attention_block=16, logprob_chunk=16)
  c.task = synthetic_task()
  c.task.max_terms = 3
  c.sft.update(steps=20, batch_size=16, learning_rate=3e-3, warmup_steps=2)
  c.rl.update(steps=2, prompts_per_step=4, group_size=4, max_new_tokens=28,
              num_minibatches=2, num_microbatches=1, overlong_buffer=4,
              max_sampling_rounds=1)
  c.optim.update(learning_rate=1e-4, warmup_steps=2)
  c.mesh.update(data=-1, fsdp=1, tensor=1)
  c.checkpoint.update(every=0, keep=1)
  c.eval = base().eval
  c.eval.update(num_problems=8, samples_per_problem=2)


def synthetic_task(**fields) -> ml_collections.ConfigDict:
  """The bundled synthetic addition task (ba_jax/tasks/synthetic.py)."""
  return ml_collections.ConfigDict(dict(dict(
      name="synthetic_sum",  # a name registered in ba_jax/tasks/registry.py
      min_terms=2,  # fewest numbers to add (response length grows with it)
      max_terms=4,  # most numbers to add: the length-variation setting
      max_value=9,  # each number is drawn from 1..max_value
      length_gap=6,  # wrong minus right length, tokens
      sft_correct_frac=0.5,  # share of correct traces in the warm-up data
      # rewards: ba_jax.tasks.rewards.score_math(rule="answer"), the math reward
      # path; builtin: ba_jax.tasks.synthetic.grade, the same rule without it.
      grader="rewards",
      max_prompt_len=16,  # prompt tokens, padded (static shape)
  ), **fields))


def dapo_recipe(c: ml_collections.ConfigDict, param_dtype: str) -> None:
  """The paper settings' shared recipe (DAPO's published one, Yu et al.
  2025, where the paper is silent), applied to ``c`` in place; lengths are
  set by each config file.

  AdamW lr 1e-6 after 10 warm-up RL steps then constant, weight decay 0.1,
  gradient clipping 1.0; 512 prompts x 16 responses per step in 16
  mini-batches of 32 prompts; soft overlong penalty; clip 0.2 / 0.28
  (clip-higher); no KL; temperature 1, top-p 1; dynamic sampling (as in
  verl's recipe/dapo/test_dapo_7b_math.sh, the DAPO recipe for
  Qwen2.5-Math-7B: lr 1e-6, lr_warmup_steps=10, weight_decay 0.1,
  grad_clip 1.0, train_prompt_bsz 512, n 16, mini-batch 32 prompts, clip
  0.2/0.28). RL steps are our choice.

  Warm-up: verl steps its LR scheduler once per RL step (after all of the
  step's mini-batches); ours counts optimizer updates, ppo_epochs x
  num_minibatches = 1 x 16 per RL step, so 10 RL steps = 160 updates.

  Float32 master weights and AdamW moments with bfloat16 compute by default
  (~16 bytes per parameter before sharding): bfloat16 parameters keep 8
  significant bits, and an AdamW step of ~1e-6 on a weight of magnitude
  1e-2 is below half an ulp there (~3e-5), so it is rounded away.
  ``:param_dtype=bfloat16`` halves the weights' memory at that cost.

  Remat "full" (each scanned layer recomputed in the backward pass) and the
  backend's attention kernel ("auto": splash on TPU, blockwise on CPU).
  """
  c.init_from = "/path/to/checkpoint"  # SET IT (a local HF directory)
  c.model.update(dtype="bfloat16", param_dtype=param_dtype, remat="full",
                 attention_impl="auto", attention_block=1024)
  c.sft.update(steps=0, batch_size=512, learning_rate=1e-6, warmup_steps=0)
  c.rl.update(
      steps=400, prompts_per_step=512, group_size=16,
      num_minibatches=16,
      # 512-row mini-batches in 16-row micro-batches: one row per batch
      # shard with data x fsdp = 16; raise this on a larger pod.
      num_microbatches=32,
      # The trainer would recompute in one forward over the whole batch,
      # far too large at this scale: the sampler's log-probs are used.
      old_logp="sampler", dynamic_sampling=True, overlong="soft")
  # verl's lr_warmup_steps=10 counts RL steps; ours counts updates.
  c.optim.update(learning_rate=1e-6,
                 warmup_steps=10 * c.rl.ppo_epochs * c.rl.num_minibatches,
                 weight_decay=0.1)
  # The configs' own 64-device pod mesh (v5e-64, v4-128's 64 chips, ...);
  # data=-1 takes any further devices (a multiple of 64).
  c.mesh.update(data=-1, fsdp=16, tensor=4)
  c.checkpoint.update(every=20, keep=3)
  c.eval = ml_collections.ConfigDict(dict(
      benchmarks="aime24,aime25,amc23,math500,minerva,olympiadbench",
      data_dir="/path/to/eval",  # SET IT: <benchmark>.jsonl files
      num_problems=0,  # problems per benchmark; 0 = all
      samples_per_problem=16,  # avg@k / pass@k
      temperature=1.0,  # sampling temperature (greedy also reported)
      every=50,  # evaluate every this many RL steps (0: before/after only)
  ))
  c.log.progress_bar = False


def math_task(**fields) -> ml_collections.ConfigDict:
  """A dataset task section (ba_jax.tasks.dataset_task): ``fields`` (name, path,
  the loader's filters, template and rule) over the shared grading."""
  return ml_collections.ConfigDict(dict(dict(
      grader="rewards",  # ba_jax.tasks.rewards.score_math (math-verify)
      correct_score=1.0,  # reward of a correct response
      incorrect_score=-1.0,  # reward of a wrong or unparsable one
      max_prompt_len=2048,  # prompt tokens, left-padded (static shape)
  ), **fields))
