"""ba_jax: GRPO-style RL of LLMs in JAX, built around Balanced Aggregation.

Commands: ``python -m ba_jax.train``, ``.evaluate``, ``.export``,
``.dry_run``, ``.convert_gguf``, ``.accelerator_check``; the packages are
described in README.md's Layout section.
"""
import os

# ba_jax takes only tokenizers and configs from transformers (its models are
# JAX), so transformers' "PyTorch was not found" advice does not apply.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
