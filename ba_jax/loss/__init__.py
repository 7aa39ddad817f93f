"""The loss: per-token weights of every aggregation rule (``aggregation``),
group advantages (``advantages``) and the clipped policy-gradient, KL and
entropy terms (``losses``). Pure functions of arrays.

May import: config.
"""
