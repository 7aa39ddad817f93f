"""Pre-registered, powered comparisons of aggregation rules (or any static
config axis) on any config: the study spec (``spec``), the git protocol
guard (``protocol``), the result store keyed by config hash (``store``), the
local runner (``runner``, ``summary``), the stages plan/tune/predict/confirm/
report (``stages``, ``planning``), the statistics (``stats``), run stability
(``stability``), the texts and plots (``texts``, ``plots``) and the reader of
the powered study's first result files (``legacy``). Its runs are
``python -m ba_jax.train`` subprocesses, so it imports little of the package.

May import: config, run.
"""
