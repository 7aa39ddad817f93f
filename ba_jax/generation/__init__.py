"""Group sampling: the static jitted sampler (``sampler``), the
continuous-batching engine (``engine``), and the token draw and stop rules
they share (``draw``, ``decoding``).

May import: config, policy.
"""
