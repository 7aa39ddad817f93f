"""The policy: the Flax decoder (``model``) with its attention kernels and KV
cache, logical-axis sharding (``sharding``), chunked log-prob scoring
(``scoring``) and Hugging Face weights in and out (``hf``).

May import: config.
"""
