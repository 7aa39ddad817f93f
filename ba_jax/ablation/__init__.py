"""Pre-registered, powered comparisons of aggregation rules (or any static
config axis) on any config, run by ``python -m ba_jax.ablate``: the study
spec (``spec``), the git protocol guard (``protocol``, also used by the TRL
comparison), the result store keyed by config hash (``store``), the local
runner and a run's row (``runner``, ``summary``), where runs go besides
local processes (``placement``: sub-meshes of a host's devices, one launch
per slice), the stages
plan/tune/predict/confirm/report (``stages``, ``planning``), the named
comparisons and statistics (``comparisons``, ``stats``), run stability
(``stability``), the texts and plots (``texts``, ``plots``), the report's W&B
run and Report (``wandb_report``) and the reader of the files the older
script wrote (``legacy``). Its runs are
``python -m ba_jax.train`` subprocesses, so it imports little of the package.

May import: config, run.
"""
