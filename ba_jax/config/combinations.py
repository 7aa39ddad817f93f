"""The loss settings that have no meaning together: ``check_combination``
raises a one-line ``ValueError`` saying why. The train step checks its
config with it (``ba_jax.loss.objectives.check_combination`` is this
function), and an ablation spec checks every arm with it when it loads, so a
study never starts a run that the trainer would refuse (docs/aggregation.md,
Refused combinations). Pure Python, like the schema.
"""
from __future__ import annotations

from ba_jax.config.schema import CORRECTIONS, SURROGATES

# The dotted config keys the rule reads, by its argument names.
KEYS = {"surrogate": "loss.surrogate", "correction": "loss.correction",
        "aggregation": "loss.aggregation", "dual_clip": "loss.dual_clip",
        "old_logp": "rl.old_logp", "correction_cap": "loss.correction_cap",
        "correction_floor": "loss.correction_floor",
        "icepop_low": "loss.icepop_low", "icepop_high": "loss.icepop_high",
        "dro_beta": "loss.dro_beta", "clip_cov_lb": "loss.clip_cov_lb",
        "clip_cov_ub": "loss.clip_cov_ub"}


def check_combination(*, surrogate: str, correction: str, aggregation: str,
                      dual_clip: float | None = None, old_logp: str | None = None,
                      correction_cap: float = 2.0,
                      correction_floor: float | None = None,
                      icepop_low: float = 0.5, icepop_high: float = 5.0,
                      dro_beta: float | None = None, clip_cov_lb: float = 1.0,
                      clip_cov_ub: float = 5.0) -> None:
  """Raises a one-line ValueError for a combination without a meaning
  (``old_logp``: ``rl.old_logp``; None skips the rule that needs it)."""
  if surrogate not in SURROGATES:
    raise ValueError(f"Unknown loss.surrogate {surrogate!r}; expected one of "
                     f"{list(SURROGATES)}.")
  if correction not in CORRECTIONS:
    raise ValueError(f"Unknown loss.correction {correction!r}; expected one "
                     f"of {list(CORRECTIONS)}.")
  if surrogate == "luspo" and aggregation != "sequence":
    raise ValueError(
        f"loss.surrogate='luspo' with loss.aggregation={aggregation!r}: LUSPO's "
        "length factor L[n] is defined against the sequence rule's 1/L[n] "
        "(together: weight 1/N per token); for GSPO terms under another rule "
        "use loss.surrogate='gspo'")
  if surrogate == "dro" and (dro_beta is None or not dro_beta > 0):
    raise ValueError(
        f"loss.surrogate='dro' with loss.dro_beta={dro_beta!r}: DRO's quadratic "
        "penalty beta (logp - old)^2 / 2 needs a weight beta > 0 (it has no "
        "default); set loss.dro_beta")
  if dual_clip is not None and surrogate != "ppo_clip":
    raise ValueError(
        f"loss.dual_clip={dual_clip} with loss.surrogate={surrogate!r}: the "
        "dual clip caps ppo_clip's token ratios only; set it to None")
  if correction != "none" and old_logp == "sampler":
    raise ValueError(
        f"loss.correction={correction!r} with rl.old_logp='sampler': its weight "
        "exp(old - sampler) is then 1 on every token; set rl.old_logp='recompute'")
  if correction in ("tis_token", "tis_sequence", "mis_token", "mis_sequence") and (
      correction_floor is not None and correction_floor >= correction_cap):
    raise ValueError(
        f"loss.correction_floor={correction_floor} must be below "
        f"loss.correction_cap={correction_cap}")
  if correction == "icepop" and icepop_low >= icepop_high:
    raise ValueError(f"loss.icepop_low={icepop_low} must be below "
                     f"loss.icepop_high={icepop_high}")
  if surrogate == "clip_cov" and not clip_cov_lb < clip_cov_ub:
    raise ValueError(f"loss.clip_cov_lb={clip_cov_lb} must be below "
                     f"loss.clip_cov_ub={clip_cov_ub}: Clip-Cov's candidates "
                     "have a covariance between the two")
