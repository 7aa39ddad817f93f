"""The default CPU job: a tiny Qwen3-style policy on the bundled addition task.

    python -m ba_jax.train --config=configs/tiny.py --workdir=/tmp/tiny

Supervised warm-up on the synthetic task (ba_jax/synthetic.py), then GRPO with
balanced aggregation; held-out accuracy is printed before and after RL.
Variants (comma separated ``key=value`` after the colon):

    --config=configs/tiny.py:smoke          a few-second run for tests and CI
    --config=configs/tiny.py:agg=token      another aggregation rule
    --config=configs/tiny.py:gap=-6         wrong answers 6 tokens shorter
"""
import ml_collections
from ml_collections import config_dict

# Logical axis name -> mesh axis (or axes, or None = replicated).
SHARDING_RULES = (
    ("batch", ("data", "fsdp")),
    ("activation_batch", ("data", "fsdp")),  # rows of the residual stream
    ("length", None),  # sequence positions of activations
    ("activation_embed", None),  # hidden features of the residual stream
    ("layers", None),  # the stacked decoder layers' leading axis
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("norm", None),
)


def _parse(arg):
  out = {}
  for item in filter(None, (arg or "").split(",")):
    key, _, value = item.partition("=")
    out[key] = value if value else True
  return out


def get_config(arg=None):
  args = _parse(arg)
  unknown = set(args) - {"smoke", "agg", "gap"}
  if unknown:
    raise ValueError(f"configs/tiny.py: unknown variant(s) {sorted(unknown)} in "
                     f"{arg!r}; expected smoke, agg=<mode>, gap=<int>")
  c = ml_collections.ConfigDict()
  c.seed = 0  # parameters, data stream and sampling all derive from it

  # Policy: random init from ba_jax.model.ModelConfig (vocab_size is checked
  # against the task tokenizer). init_from: a Hugging Face directory to load
  # instead (ba_jax.hf.load_pretrained); "" builds a random model.
  c.init_from = ""
  c.model = ml_collections.ConfigDict(dict(
      model_type="qwen3",  # qwen2 | qwen3 | llama
      vocab_size=32,  # >= the task tokenizer's 26, padded to shard evenly
      hidden_size=64,
      intermediate_size=192,
      num_layers=2,
      num_heads=4,
      num_kv_heads=2,
      head_dim=16,
      rope_theta=10000.0,
      rms_norm_eps=1e-6,
      tie_word_embeddings=True,
      qk_norm=True,
      max_position_embeddings=128,
      dtype="float32",  # compute dtype
      param_dtype="float32",
      remat=False,  # rematerialise each layer in the backward pass
      # Uncached attention: "full" builds the [L, L] score matrix; "blockwise"
      # runs over attention_block x attention_block tiles (flash-style).
      attention_impl="full",
      attention_block=512,
  ))

  # The bundled synthetic task (ba_jax/synthetic.py).
  c.task = ml_collections.ConfigDict(dict(
      name="synthetic_sum",  # the only task this config knows
      min_terms=2,  # fewest numbers to add (response length grows with it)
      max_terms=4,  # most numbers to add: the length-variation setting
      max_value=9,  # each number is drawn from 1..max_value
      length_gap=int(args.get("gap", 6)),  # wrong minus right length, tokens
      sft_correct_frac=0.5,  # share of correct traces in the warm-up data
      # rewards: ba_jax.rewards.score_math(rule="answer"), the math reward
      # path; builtin: ba_jax.synthetic.grade, the same rule without it.
      grader="rewards",
      max_prompt_len=16,  # prompt tokens, padded (static shape)
  ))

  # Supervised warm-up before RL; steps=0 skips it.
  c.sft = ml_collections.ConfigDict(dict(
      steps=600,  # optimizer steps
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
      ppo_epochs=1,  # passes over the batch per step
      num_minibatches=2,  # optimizer updates per epoch (whole groups each)
      num_microbatches=1,  # gradient accumulation inside a mini-batch
      old_logp="sampler",  # sampler | recompute: the behaviour log-probs
      advantage_std="group",  # group | batch | none (Dr. GRPO)
      dynamic_sampling=False,  # DAPO: drop groups whose rewards are all equal
      max_sampling_rounds=3,  # extra sampling rounds to refill (DAPO)
      overlong="none",  # none | mask (drop truncated) | soft (DAPO penalty)
      overlong_buffer=8,  # soft: penalty ramps over the last this many tokens
      overlong_penalty=1.0,  # soft: penalty at the budget
      max_nonfinite=5,  # this many non-finite updates in a row stops the run
  ))

  # Loss (ba_jax.losses.policy_loss); every option is static in the step.
  c.loss = ml_collections.ConfigDict(dict(
      aggregation=args.get("agg", "balanced"),  # token|sequence|dr_grpo|balanced
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

  # optax AdamW for RL.
  c.optim = ml_collections.ConfigDict(dict(
      learning_rate=1e-4,  # peak (1e-3 drifts the tiny policy off the task)
      warmup_steps=2,  # linear warm-up from 0
      schedule="constant",  # constant | cosine (to end_lr_frac * peak)
      end_lr_frac=0.1,
      weight_decay=0.0,
      b1=0.9,
      b2=0.999,
      eps=1e-8,
      grad_clip=1.0,  # clip by global norm; 0 = off
  ))

  # Devices: one mesh; -1 takes the remaining devices. Logical parameter and
  # activation names map to mesh axes through the rules table.
  c.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, tensor=1))
  c.sharding_rules = SHARDING_RULES

  c.checkpoint = ml_collections.ConfigDict(dict(
      every=30,  # save every this many RL steps (and at the end); 0 = end only
      keep=2,  # checkpoints kept
      async_save=True,
  ))
  c.eval = ml_collections.ConfigDict(dict(
      num_problems=128,  # held-out problems
      samples_per_problem=4,  # sampled accuracy: responses per problem
      temperature=1.0,  # sampled accuracy temperature (greedy also reported)
      every=0,  # evaluate every this many RL steps (0: before/after only)
  ))
  c.log = ml_collections.ConfigDict(dict(
      tensorboard=True,
      progress_bar=True,
  ))
  c.stop_after_steps = 0  # > 0: stop (save and exit) after this many steps

  if args.get("smoke"):
    c.model.hidden_size = 32
    c.model.intermediate_size = 64
    c.model.num_heads = 2
    c.model.num_kv_heads = 1
    c.sft.steps = 20
    c.sft.batch_size = 16
    c.rl.steps = 3
    c.rl.prompts_per_step = 4
    c.rl.group_size = 4
    c.task.max_terms = 3
    c.rl.max_new_tokens = 28
    c.eval.num_problems = 8
    c.eval.samples_per_problem = 2
    c.checkpoint.every = 2
    c.log.progress_bar = False
  return c
