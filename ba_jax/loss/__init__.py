"""The loss: per-token weights of every aggregation rule (``aggregation``),
group advantages (``advantages``), the policy objective's surrogates and
sampler-trainer corrections (``objectives``), the clipped policy-gradient,
KL and entropy terms (``losses``) and the sampler-trainer gap metrics
(``mismatch``). Pure functions of arrays.

May import: config.
"""
