"""Where a study's runs go besides ``--parallel=N`` local processes
(``runner.LocalRunner``):

- ``DeviceRunner`` (``--placement=devices --devices_per_run=K``): sub-meshes
  of this host's D devices, D/K runs at a time, each ``python -m
  ba_jax.train`` process shown only its own K devices by the platform's
  visibility variables (``run_env``); a group of devices is held by one run
  at a time.
- ``LauncherRunner`` (``--placement=launcher --launcher=TEMPLATE
  --slices=a,b``): each run handed to a launch command (``launch_line``),
  one run per slice at a time; the run's workdir must be on a filesystem
  that this machine and the slice both see.

The parent never initialises a JAX backend (on a TPU host that would hold
the chips): the platform and the devices come from ``--platform`` and
``--devices``, else from the environment (``JAX_PLATFORMS``,
``CUDA_VISIBLE_DEVICES``, ``XLA_FLAGS``), else from a child process that
lists them and exits before any run starts (``probe``).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import re
import shlex
import subprocess
import sys

from ba_jax.ablation import runner

PLATFORMS = {"cpu": "cpu", "gpu": "gpu", "cuda": "gpu", "tpu": "tpu"}
# TPU_CHIPS_PER_PROCESS_BOUNDS of a process holding K chips of one host, as
# JAX's own multi-process test launcher sets them (jax/_src/test_multiprocess.py).
TPU_CHIP_BOUNDS = {1: "1,1,1", 2: "1,2,1", 4: "2,2,1", 8: "2,4,1"}
TPU_BASE_PORT = 8476  # libtpu's default TPU_PROCESS_PORT; group i takes +i
# Older spellings of the TPU variables, which would contradict ours.
TPU_LEGACY = ("TPU_CHIPS_PER_HOST_BOUNDS", "TPU_HOST_BOUNDS", "TPU_VISIBLE_DEVICES",
              "TPU_MESH_CONTROLLER_ADDRESS", "TPU_MESH_CONTROLLER_PORT")
_DEVICE_COUNT = re.compile(r"--xla_force_host_platform_device_count=(\d+)")


@dataclasses.dataclass(frozen=True)
class Devices:
  """One host's devices as the visibility variables name them: GPU indices
  (or UUIDs), TPU chip indices, or CPU devices (XLA's fake host devices)."""
  platform: str
  ids: tuple[str, ...]
  found: str  # how they were found, for the log


def probe(env=None) -> dict:
  """The platform, kind and count of this host's devices, listed by a child
  process that exits before any run starts (so this one never holds them)."""
  code = ("import json, jax; d = jax.local_devices(); print(json.dumps(dict("
          "platform=d[0].platform, kind=d[0].device_kind, count=len(d))))")
  env = {k: v for k, v in (env or os.environ).items() if k != "BA_JAX_DISTRIBUTED"}
  out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                       text=True, timeout=600, env=env)
  if out.returncode:
    raise ValueError("could not list this host's devices (set --platform and "
                     f"--devices): {out.stderr.strip()[-1000:]}")
  return json.loads(out.stdout.strip().splitlines()[-1])


def parse_ids(text: str) -> tuple[str, ...]:
  """``--devices``: a count (``8``: 0..7) or the ids (``0,1,4,5``)."""
  text = str(text).strip()
  if text.isdigit() and "," not in text:
    return tuple(str(i) for i in range(int(text)))
  ids = tuple(x.strip() for x in text.split(",") if x.strip())
  if not ids or len(set(ids)) != len(ids):
    raise ValueError(f"--devices={text!r}: expected a count (8) or distinct "
                     "ids (0,1,4,5)")
  return ids


def host_devices(platform: str | None = None, devices: str | None = None,
                 env=None, probe=probe) -> Devices:
  """This host's devices: ``platform`` and ``devices`` when given, else read
  from ``env`` (JAX_PLATFORMS; CUDA_VISIBLE_DEVICES on GPU; XLA_FLAGS'
  device count on CPU), else from ``probe``."""
  env = os.environ if env is None else env
  found = []
  listed = None
  if platform is None and env.get("JAX_PLATFORMS"):
    platform = env["JAX_PLATFORMS"].split(",")[0].strip()
    found.append(f"JAX_PLATFORMS={env['JAX_PLATFORMS']}")
  if platform is None:
    listed = probe(env)
    platform = listed["platform"]
    found.append(f"a child process saw {listed['count']} {listed['kind']}")
  if platform not in PLATFORMS:
    raise ValueError(f"platform {platform!r}: expected one of cpu, gpu (NVIDIA, "
                     "CUDA_VISIBLE_DEVICES) or tpu")
  platform = PLATFORMS[platform]
  if devices is not None:
    ids = parse_ids(devices)
    found.append(f"--devices={devices}")
  elif platform == "gpu" and env.get("CUDA_VISIBLE_DEVICES"):
    ids = parse_ids(env["CUDA_VISIBLE_DEVICES"])
    found.append(f"CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']}")
  elif platform == "cpu":
    counts = _DEVICE_COUNT.findall(env.get("XLA_FLAGS", ""))
    ids = parse_ids(counts[-1] if counts else "1")
    found.append(f"XLA_FLAGS device count {len(ids)}" if counts else
                 "no --xla_force_host_platform_device_count in XLA_FLAGS: 1")
  else:
    if listed is None:
      listed = probe(env)
      found.append(f"a child process saw {listed['count']} {listed['kind']}")
    if PLATFORMS.get(listed["platform"]) != platform:
      raise ValueError(f"platform {platform}, but a child process found "
                       f"{listed['count']} {listed['platform']} devices; set --devices")
    ids = parse_ids(str(listed["count"]))
  if platform == "tpu" and listed and re.search(r"v[23]\b", listed["kind"]):
    raise ValueError(f"{listed['kind']}: two JAX devices per chip; --placement="
                     "devices counts chips (TPU v4 and later)")
  return Devices(platform, ids, "; ".join(found))


def device_groups(devices: Devices, per_run: int) -> list[tuple[str, ...]]:
  """``devices`` in groups of ``per_run``, in order."""
  n = len(devices.ids)
  if per_run < 1 or n % per_run:
    divisors = [k for k in range(1, n + 1) if n % k == 0]
    raise ValueError(f"--devices_per_run={per_run} does not divide this host's "
                     f"{n} {devices.platform} devices ({devices.found}); use one "
                     f"of {divisors}")
  if devices.platform == "tpu" and per_run < n and per_run not in TPU_CHIP_BOUNDS:
    raise ValueError(f"--devices_per_run={per_run} on TPU: a process can hold "
                     f"{sorted(TPU_CHIP_BOUNDS)} chips of a host (or all {n})")
  return [devices.ids[i:i + per_run] for i in range(0, n, per_run)]


def run_env(base: dict, platform: str, group, index: int, host_count: int,
            threads: int) -> dict:
  """The environment of a run on ``group`` (the ``index``-th group of a host
  of ``host_count`` devices): ``base`` shown only those devices."""
  env = {k: v for k, v in base.items() if k != "BA_JAX_DISTRIBUTED"}
  ids = ",".join(group)
  if platform == "gpu":
    env["CUDA_VISIBLE_DEVICES"] = ids
    env["JAX_PLATFORMS"] = "cuda"
  elif platform == "tpu":
    env["JAX_PLATFORMS"] = "tpu"
    if len(group) < host_count:
      for k in TPU_LEGACY:
        env.pop(k, None)
      port = TPU_BASE_PORT + index
      env.update(TPU_VISIBLE_CHIPS=ids,
                 TPU_CHIPS_PER_PROCESS_BOUNDS=TPU_CHIP_BOUNDS[len(group)],
                 TPU_PROCESS_BOUNDS="1,1,1", TPU_PROCESS_PORT=str(port),
                 TPU_PROCESS_ADDRESSES=f"localhost:{port}", CLOUD_TPU_TASK_ID="0",
                 ALLOW_MULTIPLE_LIBTPU_LOAD="1")
  else:
    flags = [f for f in env.get("XLA_FLAGS", "").split()
             if not f.startswith(("--xla_force_host_platform_device_count",
                                  "--xla_cpu_multi_thread_eigen"))]
    env["XLA_FLAGS"] = " ".join(flags + [
        f"--xla_force_host_platform_device_count={len(group)}",
        "--xla_cpu_multi_thread_eigen=false"])
    env["OMP_NUM_THREADS"] = env["OPENBLAS_NUM_THREADS"] = str(threads)
    env["JAX_PLATFORMS"] = "cpu"
  return env


def mesh_of(settings: dict) -> dict:
  """The mesh of a run's settings, from its config file and ``mesh.``
  overrides (read as ``ba_jax.train`` reads them; no JAX backend)."""
  from absl import flags
  from ml_collections import config_flags
  argv = ["ablate", f"--config={settings['config']}"] + [
      f"--config.{k}={runner.flag_value(v)}"
      for k, v in settings["overrides"].items() if k.startswith("mesh.")]
  fv = flags.FlagValues()
  holder = config_flags.DEFINE_config_file(
      "config", settings["config"], "the run's config", lock_config=True,
      flag_values=fv, sys_argv=argv)
  fv(argv)
  return holder.value.mesh.to_dict()


def mesh_problem(mesh: dict, n: int) -> str | None:
  """Why ``mesh`` (sizes, one may be -1) does not fit ``n`` devices, or None."""
  sizes = list(mesh.values())
  fixed = math.prod(s for s in sizes if s != -1)
  if -1 in sizes:
    return None if n % fixed == 0 else f"a multiple of {fixed} devices"
  return None if fixed == n else f"exactly {fixed} devices"


class DeviceRunner(runner.LocalRunner):
  """Runs on sub-meshes of this host: ``len(devices.ids) // per_run`` at a
  time, each a process shown its own ``per_run`` devices."""

  def __init__(self, devices: Devices, per_run: int, base_env=None,
               compilation_cache: str = "auto"):
    self.devices = devices
    self.groups = device_groups(devices, per_run)
    self.base_env = dict(os.environ if base_env is None else base_env)
    super().__init__(parallel=len(self.groups), compilation_cache=compilation_cache)

  def slots(self) -> list:
    return list(range(len(self.groups)))

  def where(self, slot) -> dict:
    return dict(kind="devices", platform=self.devices.platform,
                devices=[int(i) if i.isdigit() else i for i in self.groups[slot]])

  def env(self, slot) -> dict:
    return run_env(self.base_env, self.devices.platform, self.groups[slot], slot,
                   len(self.devices.ids), self.threads)

  def check(self, settings: list[dict]) -> None:
    """Refuses a run whose config's mesh the groups cannot hold."""
    n, seen = len(self.groups[0]), {}
    for s in settings:
      key = (s["config"], tuple(sorted((k, repr(v)) for k, v in s["overrides"].items()
                                       if k.startswith("mesh."))))
      if key in seen:
        continue
      seen[key] = mesh = mesh_of(s)
      problem = mesh_problem(mesh, n)
      if problem:
        raise ValueError(f"--devices_per_run={n}: the mesh {mesh} of "
                         f"{s['config']} needs {problem}; pick a devices_per_run "
                         "it fits or set mesh.* in the spec's overrides")


def launch_line(template: str, args: list[str], python: str, slot: str,
                workdir) -> str:
  """``template`` with ``{cmd}`` (``python -m ba_jax.train ARGS``), ``{args}``
  (ARGS alone), ``{slice}`` and ``{workdir}`` filled in, shell-quoted."""
  values = {"cmd": shlex.join([python, "-m", "ba_jax.train", *args]),
            "args": shlex.join(args), "slice": shlex.quote(slot),
            "workdir": shlex.quote(str(workdir))}
  return re.sub(r"\{(cmd|args|slice|workdir)\}", lambda m: values[m[1]], template)


class LauncherRunner(runner.LocalRunner):
  """Runs handed to a launch command, one per slice at a time; a slice that
  comes free takes the next run (round-robin while runs take equal time).
  A warm-up's export runs here, on CPU, from the shared workdir."""

  def __init__(self, template: str, slices, python: str = "python3",
               compilation_cache: str = "auto"):
    if not re.search(r"\{(cmd|args)\}", template):
      raise ValueError(f"--launcher={template!r}: the template must hold {{cmd}} "
                       "(the whole python -m ba_jax.train command) or {args} (its "
                       "arguments); {slice} and {workdir} are filled in too")
    self.slices = [s.strip() for s in slices if s.strip()]
    if not self.slices or len(set(self.slices)) != len(self.slices):
      raise ValueError(f"--slices={','.join(slices)}: expected distinct slice "
                       "names, one run at a time on each")
    self.template, self.python = template, python
    super().__init__(parallel=len(self.slices), compilation_cache=compilation_cache)

  def slots(self) -> list:
    return list(self.slices)

  def where(self, slot) -> dict:
    return dict(kind="launcher", slice=slot)

  def _train(self, settings: dict, workdir: pathlib.Path, slot) -> None:
    args = runner.command(settings, workdir)[3:]
    line = launch_line(self.template, args, self.python, slot, workdir)
    log = workdir / "log.txt"
    with open(log, "w") as f:
      f.write(f"# slice {slot}: {line}\n")
      f.flush()
      proc = subprocess.run(line, shell=True, stdout=f, stderr=subprocess.STDOUT,
                            env=self.with_cache(os.environ),
                            pass_fds=self.hold_fds)
    if proc.returncode:
      raise runner.RunFailed(
          f"run {workdir.name} on slice {slot}: the launcher exited "
          f"{proc.returncode} ({line}); log {log}:\n{log.read_text()[-3000:]}")
    if not (workdir / "config.json").exists():
      raise runner.RunFailed(
          f"run {workdir.name} on slice {slot}: the launcher exited 0 but "
          f"{workdir} holds no config.json: the workdir must be on a "
          f"filesystem that this machine and the slice both see (log {log})")

  def _export(self, workdir, export, slot) -> None:
    env = dict(self.env(slot), JAX_PLATFORMS="cpu")
    env.pop("BA_JAX_DISTRIBUTED", None)
    self._run([sys.executable, "-m", "ba_jax.export", f"--workdir={workdir}",
               f"--output_dir={export}"], workdir / "export_log.txt", env)

  def warmup(self, settings: dict, workdir: pathlib.Path) -> str:
    return super().warmup(settings, workdir.resolve())

  def train(self, settings: dict, workdir: pathlib.Path) -> dict:
    return super().train(settings, workdir.resolve())


def make_runner(placement: str, *, parallel: int = 2, devices_per_run=None,
                devices=None, platform=None, launcher=None, slices=None,
                python: str = "python3", compilation_cache: str = "auto",
                log=print) -> runner.LocalRunner:
  """The runner of ``--placement`` and its flags; an error naming a flag that
  does not belong to the placement or is missing."""
  given = {"--devices_per_run": devices_per_run, "--devices": devices,
           "--platform": platform, "--launcher": launcher, "--slices": slices}
  mine = {"local": (), "devices": ("--devices_per_run", "--devices", "--platform"),
          "launcher": ("--launcher", "--slices")}
  if placement not in mine:
    raise ValueError(f"--placement={placement!r}: expected local, devices or launcher")
  stray = [k for k, v in given.items() if v is not None and k not in mine[placement]]
  if stray:
    raise ValueError(f"{', '.join(stray)} given with --placement={placement}; "
                     f"they belong to " + " / ".join(
                         f"--placement={p}" for p, ks in mine.items() if set(stray) & set(ks)))
  if placement == "local":
    return runner.LocalRunner(parallel, compilation_cache)
  if placement == "devices":
    if devices_per_run is None:
      raise ValueError("--placement=devices needs --devices_per_run=K")
    host = host_devices(platform, devices)
    r = DeviceRunner(host, int(devices_per_run), compilation_cache=compilation_cache)
    log(f"placement: {len(r.groups)} runs at a time on {host.platform} devices "
        + " | ".join(",".join(g) for g in r.groups) + f" ({host.found})")
    return r
  if not launcher or not slices:
    raise ValueError("--placement=launcher needs --launcher=TEMPLATE and "
                     "--slices=a,b,...")
  r = LauncherRunner(launcher, slices.split(","), python, compilation_cache)
  log(f"placement: one run at a time on each of the slices {', '.join(r.slices)}; "
      "their workdirs must be on a filesystem every slice and this machine see")
  return r

