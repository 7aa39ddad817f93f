"""Where a run's records go: the backends behind ``metrics.MetricsLogger``.

Every backend takes the same four things: a step's metrics (``write``), a
held-out evaluation (``write_eval``), a table of sampled completions
(``write_samples``, kept by the backends that have tables) and, once, the
run's config (at construction). The workdir's jsonl files (metrics.jsonl,
eval.jsonl, samples.jsonl) are always written: they are the run's own
record, which resume repairs (``resume.drop_replayed_rows``) and the
experiments read. ``log.backends`` adds TensorBoard (tensorboardX) and
Weights & Biases (``wandb``, offline when there is no API key or no
network; ``wandb sync`` uploads the run directory later). Only process 0
builds a logger. ``start_wandb`` (mode, offline fallback) also starts the
ablation report's run (``ba_jax.ablation.wandb_report``).
"""
from __future__ import annotations

import importlib.util
import io
import json
import math
import netrc
import os
import secrets
import urllib.parse
from typing import Any, Callable, Protocol

from ba_jax.config import schema
from ba_jax.run import paths

EXTRA = 'pip install -e ".[tracking]"'
# backend -> (the module it imports, what installs it)
PACKAGES = {"tensorboard": ("tensorboardX", "pip install -e ."),
            "wandb": ("wandb", EXTRA)}
WANDB_RUN_ID = "wandb_run_id"  # the workdir's W&B run id (a resume continues it)


class Backend(Protocol):
  """What ``MetricsLogger`` writes to."""
  has_tables: bool

  def write(self, step: int, record: dict) -> None:
    """One RL step's metrics (``record["step"] == step``)."""

  def write_eval(self, step: int, accuracy: dict) -> None:
    """Held-out accuracy at ``step`` (0: before RL)."""

  def write_samples(self, step: int, rows: list[dict]) -> None:
    """A table of sampled completions (one dict per response)."""

  def close(self) -> None:
    ...


def backend_names(log: schema.Log) -> tuple[str, ...]:
  return tuple(n.strip() for n in log.backends.split(",") if n.strip())


def check_backends(log: schema.Log) -> None:
  """Raises a one-line ValueError naming the install command when a backend
  in ``log.backends`` lacks its package."""
  for name in backend_names(log):
    module, install = PACKAGES[name]
    if importlib.util.find_spec(module) is None:
      raise ValueError(f"log.backends={log.backends!r}: {name} needs the "
                       f"{module} package, which is not installed: {install}")


def _finite_scalars(values: dict, prefix: str = "") -> dict[str, float]:
  return {prefix + k: float(v) for k, v in values.items()
          if k != "step" and isinstance(v, (int, float))
          and not isinstance(v, bool) and math.isfinite(v)}


def jsonable(value: Any) -> Any:
  """A float as JSON has it (NaN and infinities as null)."""
  if isinstance(value, float) and not math.isfinite(value):
    return None
  return value


class JsonlFiles:
  """metrics.jsonl (one record per step), eval.jsonl (one per evaluation)
  and samples.jsonl (one row per sampled response in a table)."""
  has_tables = True

  def __init__(self, root):
    root = paths.path(root)
    self._metrics = paths.JsonlFile(root / "metrics.jsonl")
    self._eval = paths.JsonlFile(root / "eval.jsonl")
    self._samples = paths.JsonlFile(root / "samples.jsonl")

  def write(self, step: int, record: dict) -> None:
    self._metrics.add({k: jsonable(v) for k, v in record.items()})

  def write_eval(self, step: int, accuracy: dict) -> None:
    self._eval.add({"step": step, **accuracy})

  def write_samples(self, step: int, rows: list[dict]) -> None:
    for row in rows:
      self._samples.add({k: jsonable(v) for k, v in row.items()})

  def close(self) -> None:
    pass


class _EventFile:
  """A TensorBoard event file at a URL, through ``ba_jax.run.paths``: object
  stores cannot append, so the buffered file is rewritten whole at each
  flush (tensorboardX flushes every couple of minutes)."""

  def __init__(self, url: str):
    self.path, self.buffer = paths.path(url), io.BytesIO()

  def write(self, data: bytes) -> None:
    self.buffer.write(data)

  def flush(self) -> None:
    self.path.write_bytes(self.buffer.getvalue())

  def close(self) -> None:
    self.flush()


class _EventFiles:
  """tensorboardX's writer factory for a URL scheme (its own gs:// one
  needs google-cloud-storage and credentials of its own)."""

  def open(self, url: str) -> _EventFile:
    return _EventFile(url)

  def directory_check(self, url: str) -> None:
    paths.path(url).mkdir(parents=True, exist_ok=True)


class TensorBoard:
  """Event files under ``workdir/tb``: scalars, and the config as text at a
  fresh start. No tables (samples.jsonl has them)."""
  has_tables = False

  def __init__(self, root, *, first_step: int, config: dict | None):
    import tensorboardX
    root = paths.path(root)
    if paths.is_remote(root):  # through epath, like every other file
      from tensorboardX import record_writer
      record_writer.register_writer_factory(str(root).split(":")[0],
                                            _EventFiles())
    # purge_step: TensorBoard drops the events a resumed run replays after
    # its checkpoint.
    self._writer = tensorboardX.SummaryWriter(
        str(root / "tb"), purge_step=first_step + 1 if first_step else None)
    if config is not None and not first_step:
      text = json.dumps(config, indent=1, default=str)
      self._writer.add_text("config", "    " + text.replace("\n", "\n    "), 0)

  def write(self, step: int, record: dict) -> None:
    for name, value in _finite_scalars(record).items():
      self._writer.add_scalar(name, value, step)

  def write_eval(self, step: int, accuracy: dict) -> None:
    for name, value in _finite_scalars(accuracy, "eval/").items():
      self._writer.add_scalar(name, value, step)

  def write_samples(self, step: int, rows: list[dict]) -> None:
    pass

  def close(self) -> None:
    self._writer.close()


def _has_wandb_api_key(wandb) -> bool:
  """Whether W&B would find an API key, without asking the network: the
  environment, or a netrc entry for the host wandb is configured for."""
  if os.environ.get("WANDB_API_KEY"):
    return True
  try:
    host = urllib.parse.urlparse(wandb.Settings().base_url).hostname
    return netrc.netrc().authenticators(host) is not None
  except (OSError, netrc.NetrcParseError, ValueError, TypeError):
    return False


def wandb_mode(log: schema.Log, wandb) -> str:
  """``log.wandb_mode``, with ``auto`` resolved: WANDB_MODE if set, else
  online when an API key is found, else offline."""
  if log.wandb_mode != "auto":
    return log.wandb_mode
  env = os.environ.get("WANDB_MODE", "")
  if env in ("online", "offline", "disabled", "run", "dryrun"):
    return {"run": "online", "dryrun": "offline"}.get(env, env)
  return "online" if _has_wandb_api_key(wandb) else "offline"


def start_wandb(log: schema.Log, *, note: Callable[[str], None] = print,
                **init_kwargs):
  """A started W&B run in ``project``/``entity`` of ``log``, its mode as
  ``wandb_mode`` resolves it; an online start that fails (no network) is
  noted and retried offline. Returns ``(run, mode)``; ``init_kwargs`` go to
  ``wandb.init`` (name, id, dir, config, job_type, ...)."""
  import wandb
  mode = wandb_mode(log, wandb)
  kwargs = dict(project=log.wandb_project, entity=log.wandb_entity or None,
                **init_kwargs)
  # The caller prints its own lines; W&B's console capture is off.
  settings = lambda: wandb.Settings(console="off", silent=True)
  try:
    run = wandb.init(mode=mode, settings=settings(), **kwargs)
  except Exception as e:  # wandb raises many kinds when the network is away
    if mode != "online":
      raise
    first = (str(e).splitlines() or [type(e).__name__])[0][:200]
    note(f"W&B: online start failed ({first}); logging offline")
    mode = "offline"
    run = wandb.init(mode=mode, settings=settings(), **kwargs)
  where = getattr(run, "dir", None) or kwargs.get("dir")
  if mode == "offline":
    run_dir = os.path.dirname(where) if where else "the wandb directory"
    note(f"W&B run {run.id} logged offline to {run_dir}; upload it with "
         f"`wandb sync {run_dir}`")
  else:
    note(f"W&B run {run.id}: {getattr(run, 'url', '') or 'online'}")
  return run, mode


class WandB:
  """A Weights & Biases run: scalars, evaluations as ``eval/*``, samples as a
  ``wandb.Table`` named ``samples``, the config at init. The run id is
  kept in the workdir, so a resumed run continues the same W&B run; steps
  up to ``skip_until`` (what the run logged before it stopped, replayed now)
  are not sent again, since W&B keeps a step's first record. Its files go
  to ``$WANDB_DIR``, else the (local) workdir."""
  has_tables = True

  def __init__(self, workdir, log: schema.Log, *, config: dict | None,
               skip_until: int | None = None, note: Callable[[str], None] = print):
    import wandb
    self._wandb, self._skip_until = wandb, skip_until
    root = paths.path(workdir)
    id_file = root / WANDB_RUN_ID
    if id_file.exists():
      run_id = id_file.read_text().strip()
    else:
      run_id = secrets.token_hex(4)
      paths.write_text(id_file, run_id + "\n")
    directory = os.environ.get("WANDB_DIR") or (
        None if paths.is_remote(root) else str(root))
    self._run, _ = start_wandb(
        log, note=note, name=os.path.basename(str(workdir).rstrip("/")),
        id=run_id, resume="allow", dir=directory, config=config)

  def _skip(self, step: int) -> bool:
    return self._skip_until is not None and step <= self._skip_until

  def write(self, step: int, record: dict) -> None:
    if not self._skip(step):
      self._run.log(_finite_scalars(record), step=step)

  def write_eval(self, step: int, accuracy: dict) -> None:
    if not self._skip(step):
      self._run.log(_finite_scalars(accuracy, "eval/"), step=step)

  def write_samples(self, step: int, rows: list[dict]) -> None:
    if self._skip(step) or not rows:
      return
    columns = list(rows[0])
    table = self._wandb.Table(columns=columns, data=[
        [jsonable(row[c]) for c in columns] for row in rows])
    self._run.log({"samples": table}, step=step)

  def close(self) -> None:
    self._run.finish()


def make_backends(workdir, log: schema.Log, *, first_step: int,
                  config: dict | None, skip_until: int | None = None,
                  note: Callable[[str], None] = print) -> list[Backend]:
  """The jsonl files and the backends ``log.backends`` names.
  ``first_step``: the checkpoint a resumed run starts from (0: fresh);
  ``skip_until``: the last step the run logged before it stopped."""
  check_backends(log)
  out: list[Backend] = [JsonlFiles(workdir)]
  for name in backend_names(log):
    if name == "tensorboard":
      out.append(TensorBoard(workdir, first_step=first_step, config=config))
    elif name == "wandb":
      out.append(WandB(workdir, log, config=config, skip_until=skip_until,
                       note=note))
  return out
