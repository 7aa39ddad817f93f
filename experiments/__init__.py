"""Our own studies and benchmarks, run from the repository root as modules
(``python -m experiments.benchmarks.bench_engine``): ``benchmarks/`` (speed and
memory measurements, results in ``benchmarks/results/``), ``studies/<study>/``
(a study's spec or scripts, README and ``results/``) and ``launch/`` (pod and
cluster launch scripts). Nothing here is imported by ``ba_jax``."""
