"""The dry run: compile a config's real programs on its own mesh without
weights (``compile``), analytic FLOPs (``flops``) and the report
(``report``); the accelerator check that sets them against a real device
(``accelerator``).

May import: config, generation, policy, run, update.
"""
