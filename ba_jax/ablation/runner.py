"""How a study's runs run: N local runs at once, each a ``python -m
ba_jax.train`` process on its share of the cores (``LocalRunner``; the other
placements are ``ba_jax.ablation.placement``), one row stored per finished
run, naming where it ran (``placement``) and when it started.

A job is (cell, arm, rate, seed). Its settings (the config argument and the
``--config.`` overrides) hash to its key in the store, so a study that was
killed resumes by running only the jobs whose key has no row; a run cut
short starts again in an empty workdir. With ``warmup="per_seed"`` each
seed's supervised warm-up runs once, is exported, and every RL run of that
seed starts from it (common random numbers); ``shared`` uses seed 0's for
every seed.

Every run is given JAX's persistent compilation cache (by default
``<runs>/xla_cache``, see ``LocalRunner``): the arms of a study compile a
handful of distinct programs, and every later seed, cell and rate of an arm
loads them instead of compiling again. The cache holds compiled programs
only, keyed by their HLO, options, devices and JAX version, so a run's
numbers are the same with it warm, cold or off.

One study process at a time runs a runs folder: ``execute`` locks
``<runs>/.study.lock`` and every process it starts inherits the lock, so
while a study, or any run a killed study left going, is still alive, a
second ``ba_jax.ablate`` on the same folder is refused (``StudyBusy``)
instead of starting runs in workdirs that another process still writes.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import fcntl
import itertools
import os
import pathlib
import queue
import shutil
import subprocess
import sys
import time
from typing import Callable

from ba_jax.ablation import arms, summary
from ba_jax.ablation.store import Store, config_hash


@dataclasses.dataclass(frozen=True, order=True)
class Job:
  seed: int
  cell: str
  arm: str
  lr: float

  @property
  def name(self) -> str:
    """The run's folder name (a grid arm's "/" as "+")."""
    arm = str(self.arm).replace(arms.SEP, "+")
    return f"{self.cell}_{arm}_lr{self.lr:g}_s{self.seed}"


def flag_value(v) -> str:
  return repr(v) if isinstance(v, float) else str(v)


def command(settings: dict, workdir) -> list[str]:
  """The ``python -m ba_jax.train`` command line of ``settings``."""
  return [sys.executable, "-m", "ba_jax.train", f"--config={settings['config']}",
          f"--workdir={workdir}"] + [
              f"--config.{k}={flag_value(v)}" for k, v in settings["overrides"].items()]


def warmup_seed(spec, seed: int) -> int | None:
  """The seed whose warm-up a run of ``seed`` starts from (None: no warm-up)."""
  return {"none": None, "per_seed": seed, "shared": 0}[spec.warmup]


def warmup_settings(spec, seed: int) -> dict:
  return dict(config=arms.config_arg(spec.config, spec.warmup_variant),
              overrides=dict(spec.overrides, seed=seed, **{"rl.steps": 0}))


def run_settings(spec, job: Job) -> dict:
  """The settings of one RL run; ``init`` names what it starts from (the
  warm-up's hash, or ``spec.init_from``) and is filled in as a path by
  ``execute``."""
  cell = spec.cells[job.cell]
  overrides = dict(spec.overrides, **cell.get("overrides", {}))
  overrides.update(spec.arm_settings(job.arm))
  overrides.update({spec.rate_key: job.lr, "seed": job.seed})
  w = warmup_seed(spec, job.seed)
  init = config_hash(warmup_settings(spec, w)) if w is not None else spec.init_from
  if init:
    overrides["sft.steps"] = 0
  return dict(config=arms.config_arg(spec.config, cell.get("variant", "")),
              overrides=overrides, init=init)


class RunFailed(RuntimeError):
  """A run (or its launcher) exited non-zero without a summary: the study
  stops, and resumes from the rows."""


class StudyBusy(RuntimeError):
  """Another process holds the runs folder's lock: a study, or runs one
  started."""


LOCK = ".study.lock"


@contextlib.contextmanager
def study_lock(runs_dir: pathlib.Path):
  """Holds ``runs_dir`` for this process; yields the lock's file descriptor,
  which the runs inherit (``pass_fds``), so the lock lasts while any of
  them does. ``StudyBusy`` names the holder when it is taken."""
  runs_dir = pathlib.Path(runs_dir)
  runs_dir.mkdir(parents=True, exist_ok=True)
  path = runs_dir / LOCK
  fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
  try:
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      holder = path.read_text().strip() or "unknown"
      raise StudyBusy(
          f"{runs_dir} is in use: the study process {holder} holds {path}, or "
          f"runs it started are still going (they hold it too; see `pgrep -f "
          f"{runs_dir}`). Wait for them, or stop them, then run the same "
          f"command again: it resumes from the rows") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"pid {os.getpid()}\n".encode())
    yield fd
  finally:
    os.close(fd)  # the lock goes with the last process that holds it


CACHE_ENV = "JAX_COMPILATION_CACHE_DIR"
# cache every program, however quick to compile (ba_jax.policy.compiling's
# CACHE_MIN_COMPILE_SECONDS; not imported: planning a study imports no JAX)
CACHE_MIN_ENV = ("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")


class LocalRunner:
  """Runs as subprocesses on this machine, ``parallel`` at a time, each on
  ``cores // parallel`` threads. Subclasses (``ba_jax.ablation.placement``)
  change the slots a run takes (``slots``), its environment (``env``) and
  how its training process starts (``_train``).

  ``compilation_cache``: JAX's persistent compilation cache for every run
  (``JAX_COMPILATION_CACHE_DIR`` in its environment): ``auto`` (the default)
  is ``<runs>/xla_cache`` beside the study's runs, unless that variable is
  already set, which is then kept; ``off`` unsets it; anything else is the
  directory. Whoever can write to it can run code in the runs."""

  def __init__(self, parallel: int = 2, compilation_cache: str = "auto"):
    self.parallel = max(1, parallel)
    self.threads = max(1, (os.cpu_count() or 2) // self.parallel)
    if not compilation_cache:
      raise ValueError("compilation_cache='': expected auto, off or a directory")
    self.compilation_cache = compilation_cache
    self.cache_dir = None  # unknown until the runs' folder is (open_study)
    self.hold_fds = ()  # the study lock, held by every process started
    self._free = queue.Queue()
    for slot in self.slots():
      self._free.put(slot)

  def slots(self) -> list:
    """What a run holds while it runs; never two runs at once."""
    return list(range(self.parallel))

  def where(self, slot) -> dict:
    """The row's record of where a run ran."""
    return {"kind": "local"}

  def check(self, settings: list[dict]) -> None:
    """Refuses, before any run starts, settings this placement cannot run."""

  def open_study(self, runs_dir: pathlib.Path, lock_fd=None) -> str:
    """Settles the compilation cache of runs kept in ``runs_dir`` (returns
    the directory, '' for none); ``lock_fd`` (``study_lock``'s) is passed on
    to every process started."""
    self.hold_fds = () if lock_fd is None else (lock_fd,)
    choice = self.compilation_cache
    if choice == "off":
      self.cache_dir = ""
    elif choice == "auto":
      self.cache_dir = os.environ.get(CACHE_ENV) or str(
          (pathlib.Path(runs_dir) / "xla_cache").resolve())
    else:
      self.cache_dir = str(pathlib.Path(choice).expanduser().resolve())
    return self.cache_dir

  def with_cache(self, env: dict) -> dict:
    """``env`` with the compilation cache set (or unset, for ``off``)."""
    env = dict(env)
    if self.cache_dir is None:  # outside a study (no runs folder): as given
      return env
    env.pop(CACHE_ENV, None)
    if self.cache_dir:
      env[CACHE_ENV] = self.cache_dir
      env.setdefault(*CACHE_MIN_ENV)
    return env

  def env(self, slot) -> dict:
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                        " --xla_cpu_multi_thread_eigen=false").strip()
    env["OMP_NUM_THREADS"] = env["OPENBLAS_NUM_THREADS"] = str(self.threads)
    return env

  @contextlib.contextmanager
  def _slot(self):
    slot = self._free.get()
    try:
      yield slot
    finally:
      self._free.put(slot)

  def _run(self, cmd: list[str], log: pathlib.Path, env: dict) -> None:
    with open(log, "w") as f:
      proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT,
                            env=self.with_cache(env), pass_fds=self.hold_fds)
    if proc.returncode:
      raise RunFailed(f"{' '.join(cmd)} exited {proc.returncode}; log {log}:\n"
                      f"{log.read_text()[-3000:]}")

  def _train(self, settings: dict, workdir: pathlib.Path, slot) -> None:
    self._run(command(settings, workdir), workdir / "log.txt", self.env(slot))

  def _export(self, workdir: pathlib.Path, export: pathlib.Path, slot) -> None:
    self._run([sys.executable, "-m", "ba_jax.export", f"--workdir={workdir}",
               f"--output_dir={export}"], workdir / "export_log.txt",
              self.env(slot))

  def warmup(self, settings: dict, workdir: pathlib.Path) -> str:
    """Train the warm-up and export it; the Hugging Face directory."""
    export = workdir / "hf"
    if not (export / "config.json").exists():
      shutil.rmtree(workdir, ignore_errors=True)
      workdir.mkdir(parents=True)
      with self._slot() as slot:
        self._train(settings, workdir, slot)
        self._export(workdir, export, slot)
    return str(export)

  def train(self, settings: dict, workdir: pathlib.Path) -> dict:
    """One RL run; its outcomes (``summary.summarise``) and ``placement``
    (``where``)."""
    with self._slot() as slot:
      try:
        self._train(settings, workdir, slot)
      except RunFailed:
        # A run the non-finite guard stopped still wrote its summary: at a
        # rate too large for a rule that is a result (a poor one), not a crash.
        if not (workdir / "summary.json").exists():
          raise
      return dict(summary.summarise(workdir), placement=self.where(slot))


def execute(jobs, spec, runner, store: Store, runs_dir: pathlib.Path, *,
            parallel: int = 1, row_fields: Callable[[], dict] = dict,
            log=print) -> dict:
  """Run every job without a row in ``store``; job -> row. Seed by seed:
  ``parallel`` warm-ups start first; as each is done its seed's runs are
  queued, then the next seed's warm-up behind them, so the seeds' rows
  complete in order and a study stopped part-way holds whole seeds (and a
  resume on a fresh host repeats few warm-ups). ``row_fields()`` is called
  as each run starts (the protocol record) and stored in its row."""
  jobs = sorted(set(jobs))
  settings = {j: run_settings(spec, j) for j in jobs}
  keys = {j: config_hash(s) for j, s in settings.items()}
  todo = [j for j in jobs if not store.has(keys[j])]
  if len(todo) < len(jobs):
    log(f"{len(jobs) - len(todo)} of {len(jobs)} runs already have rows "
        f"in {store.path.name}; not rerun")
  check = getattr(runner, "check", None)
  if check and todo:  # refuse before the first run, not halfway
    seeds = {warmup_seed(spec, j.seed) for j in todo} - {None}
    check([settings[j] for j in todo] +
          [warmup_settings(spec, w) for w in sorted(seeds)])
  if not todo:
    return {j: store.get(keys[j]) for j in jobs}
  with study_lock(runs_dir) as lock_fd:
    opened = getattr(runner, "open_study", None)
    if opened:
      where = opened(runs_dir, lock_fd)
      log(f"compiled programs are cached in {where}" if where else
          "compilation cache off: every run compiles its programs")
    try:
      _execute(todo, spec, runner, store, runs_dir, settings, keys,
               parallel=parallel, row_fields=row_fields, log=log)
    finally:
      if opened:
        runner.hold_fds = ()  # the descriptor closes with the lock
  return {j: store.get(keys[j]) for j in jobs}


def _execute(todo, spec, runner, store, runs_dir, settings, keys, *, parallel,
             row_fields, log) -> None:
  """``execute``'s schedule of the jobs ``todo``, under the study lock."""

  def warm(seed):
    if seed is None:
      return spec.init_from
    s = warmup_settings(spec, seed)
    return runner.warmup(s, runs_dir / f"warmup_s{seed}_{config_hash(s)[:8]}")

  def run(job, init):
    fields = row_fields()
    workdir = runs_dir / job.name
    shutil.rmtree(workdir, ignore_errors=True)  # a run cut short starts again
    workdir.mkdir(parents=True)
    s = dict(settings[job])
    if s["init"]:
      s["overrides"] = dict(s["overrides"], init_from=init)
    started, t0 = time.time(), time.perf_counter()
    outcomes = runner.train(s, workdir)
    row = dict(cell=job.cell, arm=job.arm, lr=job.lr, seed=job.seed,
               config_hash=keys[job], config=s["config"],
               overrides={k: v for k, v in s["overrides"].items() if k != "init_from"},
               init=s["init"], started_at=round(started, 2),
               wall_s=round(time.perf_counter() - t0, 1),
               **fields, **outcomes)
    store.append(row)
    log(f"[{time.strftime('%H:%M:%S')}] done {job.name}")
    return row

  by_seed = {}
  for j in todo:
    by_seed.setdefault(warmup_seed(spec, j.seed), []).append(j)
  order = iter(sorted(by_seed, key=lambda x: (x is None, x)))
  with concurrent.futures.ThreadPoolExecutor(max(1, parallel)) as pool:
    try:
      # The pool runs its queue first in, first out: a warm-up submitted
      # after a seed's runs starts once a slot is free of them.
      warmups = {pool.submit(warm, w): w
                 for w in itertools.islice(order, max(1, parallel))}
      futures = []
      while warmups:
        done = next(concurrent.futures.as_completed(warmups))
        seed = warmups.pop(done)
        init = done.result()
        futures += [pool.submit(run, j, init) for j in by_seed[seed]]
        for w in itertools.islice(order, 1):
          warmups[pool.submit(warm, w)] = w
      for f in concurrent.futures.as_completed(futures):
        f.result()
    except BaseException:
      # one failed run stops the study (the runs going on finish, queued
      # ones do not start); the next call resumes from the rows
      pool.shutdown(wait=True, cancel_futures=True)
      raise
