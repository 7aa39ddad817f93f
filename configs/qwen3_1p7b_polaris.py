"""The paper's second setting: Qwen3-1.7B trained on Polaris-53K.

    python -m ba_jax.train --config=configs/qwen3_1p7b_polaris.py:agg=balanced \\
        --config.init_from=/path/to/Qwen3-1.7B \\
        --config.task.path=/path/to/polaris-53k.jsonl --workdir=DIR

On a TPU pod every worker runs that command (experiments/launch/tpu_pod.sh).
Check memory and FLOPs first, without weights or accelerators:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m ba_jax.dry_run \\
        --config=configs/qwen3_1p7b_polaris.py \\
        --config.mesh.data=1 --config.mesh.fsdp=4 --config.mesh.tensor=2

Variants (comma separated after the colon):
    agg=<mode>             token | sequence | dr_grpo | balanced (default)
    param_dtype=<dtype>    e.g. float32: keep float32 master weights (see below)

Hyperparameters the paper does not state follow DAPO's published recipe
(Yu et al., 2025): AdamW lr 1e-6 after 10 warm-up steps then constant,
weight decay 0.1, gradient clipping 1.0; 512 prompts x 16 responses per step
in 16 mini-batches of 32 prompts; 20480 response tokens with a 4096-token
soft overlong penalty; clip 0.2 / 0.28 (clip-higher); no KL; temperature 1,
top-p 1; dynamic sampling. The number of RL steps is our choice.

Polaris-specific: prompts end in the \\boxed{} instruction and answers
are read from the last \\boxed{}; problems are filtered by their difficulty
field (a pass rate such as "3/8"), dropping those solved every time.

Caution:
- bfloat16 parameters (this setting's default) keep 8 significant bits: an
  AdamW step of ~1e-6 on a weight of magnitude 1e-2 is below half an ulp
  there (~3e-5) and is rounded away. ``param_dtype=float32`` keeps float32
  master weights and optimizer moments with bfloat16 compute (~16
  bytes/parameter, ~28 GB for the whole model before sharding).
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
VARIANTS = ("agg", "param_dtype")


def _parse(arg):
  out = {}
  for item in filter(None, (arg or "").split(",")):
    key, _, value = item.partition("=")
    out[key] = value if value else True
  return out


def get_config(arg=None):
  args = _parse(arg)
  unknown = set(args) - set(VARIANTS)
  if unknown:
    raise ValueError(f"configs/qwen3_1p7b_polaris.py: unknown variant(s) "
                     f"{sorted(unknown)} in {arg!r}; expected agg=<mode>, "
                     "param_dtype=<dtype>")
  c = ml_collections.ConfigDict()
  c.seed = 0  # data order and sampling derive from it

  # Policy. init_from: the local Hugging Face directory of Qwen3-1.7B
  # (config.json, *.safetensors, tokenizer files), loaded with
  # ba_jax.hf.load_pretrained. SET IT: the placeholder below does not exist.
  # The model fields must match that checkpoint's config.json.
  c.init_from = "/path/to/Qwen3-1.7B"
  c.model = ml_collections.ConfigDict(dict(
      model_type="qwen3",  # qwen2 | qwen3 | llama
      vocab_size=151936,
      hidden_size=2048,
      intermediate_size=6144,
      num_layers=28,
      num_heads=16,
      num_kv_heads=8,
      head_dim=128,
      rope_theta=1000000.0,
      rms_norm_eps=1e-6,
      tie_word_embeddings=True,
      attention_bias=False,
      qk_norm=True,  # RMSNorm on q and k per head (Qwen3)
      max_position_embeddings=40960,
      dtype="bfloat16",  # compute
      param_dtype=args.get("param_dtype", "bfloat16"),  # weights, moments
      remat=True,  # rematerialise each layer in the backward pass
      # Flash-style attention over 1024 x 1024 tiles: the full [L, L] float32
      # scores at L = 22528 would be ~2 GB per row, head and layer.
      attention_impl="blockwise",
      attention_block=1024,
  ))

  # Training data. Read by the dataset task (ba_jax.data.load_polaris),
  # graded by ba_jax.rewards.score_math.
  c.task = ml_collections.ConfigDict(dict(
      name="polaris",
      path="/path/to/polaris-53k.jsonl",  # SET IT: the Polaris-53K jsonl
      # Keep problems whose difficulty (pass rate of a reference model,
      # e.g. "3/8") is within [min, max]; None = no bound. 7/8 drops the
      # problems solved every time, which give all-equal groups.
      min_difficulty=config_dict.placeholder(float),
      max_difficulty=0.875,
      # ba_jax.data.format_prompt: the problem and the \\boxed{} request;
      # "chat" wraps the same text in the tokenizer's chat template.
      template="boxed",
      rule="boxed",  # ba_jax.rewards rule: the last \\boxed{...}
      grader="rewards",  # ba_jax.rewards.score_math (math-verify)
      correct_score=1.0,  # reward of a correct response
      incorrect_score=-1.0,  # reward of a wrong or unparsable one
      max_prompt_len=2048,  # prompt tokens, left-padded (static shape)
  ))

  # Supervised warm-up: none, RL starts from the checkpoint.
  c.sft = ml_collections.ConfigDict(dict(
      steps=0,  # optimizer steps; 0 skips the warm-up
      batch_size=512,  # sequences per step (unused when steps=0)
      learning_rate=1e-6,
      warmup_steps=0,
  ))

  # GRPO (DAPO's recipe).
  c.rl = ml_collections.ConfigDict(dict(
      steps=400,  # train steps (each: sample, reward, PPO epochs); ours
      prompts_per_step=512,  # B; the global batch is B * group_size rows
      group_size=16,  # G responses per prompt
      max_new_tokens=20480,  # T, response budget (truncated after)
      temperature=1.0,  # sampling temperature; the loss scores at it too
      top_p=1.0,  # nucleus sampling (1.0 = off)
      top_k=0,  # top-k sampling (0 = off)
      ppo_epochs=1,  # passes over the batch per step
      num_minibatches=16,  # optimizer updates per epoch: 32 prompts each
      # Gradient accumulation inside a mini-batch of 512 rows: 16-row
      # micro-batches, one row per batch shard with data x fsdp = 16. The
      # micro-batch must split over data x fsdp devices: raise this on a
      # larger pod.
      num_microbatches=32,
      # sampler | recompute. The trainer recomputes in one forward over the
      # whole batch, far too large at this scale, so the sampler's are used.
      old_logp="sampler",
      advantage_std="group",  # group | batch | none (Dr. GRPO)
      dynamic_sampling=True,  # DAPO: drop groups whose rewards are all equal
      max_sampling_rounds=3,  # extra sampling rounds to refill (DAPO)
      overlong="soft",  # none | mask (drop truncated) | soft (DAPO penalty)
      overlong_buffer=4096,  # soft: penalty ramps over the last this many
      overlong_penalty=1.0,  # soft: penalty at the budget
      max_nonfinite=5,  # this many non-finite updates in a row stops the run
  ))

  # Loss (ba_jax.losses.policy_loss); every option is static in the step.
  c.loss = ml_collections.ConfigDict(dict(
      aggregation=args.get("agg", "balanced"),  # token|sequence|dr_grpo|balanced
      eps_low=0.2,  # clip range below 1
      eps_high=0.28,  # clip range above 1 (clip-higher)
      dual_clip=config_dict.placeholder(float),  # c > 1 caps A < 0; None = off
      kl_coef=0.0,  # no KL (DAPO); > 0 loads a frozen reference policy
      kl_type="k3",  # k1 | k2 | k3
      entropy_coef=0.0,  # entropy bonus
      reg_aggregation="token",  # mode aggregating the KL and entropy terms
      max_response_len=config_dict.placeholder(int),  # dr_grpo; None = T
      ba_denominator="group",  # group | signed
      ba_scope="group",  # group | batch
  ))

  # optax AdamW for RL (DAPO's).
  c.optim = ml_collections.ConfigDict(dict(
      learning_rate=1e-6,  # peak
      warmup_steps=10,  # linear warm-up from 0, in optimizer updates
      schedule="constant",  # constant | cosine (to end_lr_frac * peak)
      end_lr_frac=0.1,  # cosine only
      weight_decay=0.1,
      b1=0.9,
      b2=0.999,
      eps=1e-8,
      grad_clip=1.0,  # clip by global norm; 0 = off
  ))

  # Devices: one mesh; -1 takes the remaining devices (a multiple of 64
  # here: fsdp 16 x tensor 4). 16 heads and 8 kv heads split 4 ways.
  c.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=16, tensor=4))
  c.sharding_rules = SHARDING_RULES

  c.checkpoint = ml_collections.ConfigDict(dict(
      every=20,  # save every this many RL steps (and at the end); 0 = end only
      keep=3,  # checkpoints kept
      async_save=True,
  ))
  # Held-out evaluation on the six math benchmarks (ba_jax.eval_lib).
  c.eval = ml_collections.ConfigDict(dict(
      benchmarks="aime24,aime25,amc23,math500,minerva,olympiadbench",
      data_dir="/path/to/eval",  # SET IT: <benchmark>.jsonl files
      num_problems=0,  # problems per benchmark; 0 = all
      samples_per_problem=16,  # avg@k / pass@k
      temperature=1.0,  # sampling temperature (greedy also reported)
      every=50,  # evaluate every this many RL steps (0: before/after only)
  ))
  c.log = ml_collections.ConfigDict(dict(
      tensorboard=True,
      progress_bar=False,  # pod logs are files: one line per step
  ))
  c.stop_after_steps = 0  # > 0: stop (save and exit) after this many steps
  return c
