"""The dry run's report as text: per program and device, memory against each
TPU slice's HBM, FLOPs against the analytic estimate; and the accelerator
check's lines (``ba_jax.scaling.accelerator``)."""
from __future__ import annotations

from ba_jax.scaling import targets as targets_lib
from ba_jax.scaling.compile import ESTIMATE_NOTE, MEMORY_FIELDS, TPU_HBM_GIB


PROGRAMS = ("train_step", "sample", "engine", "score")


def _bytes(n: float) -> str:
  for unit in ("B", "KiB", "MiB", "GiB"):
    if abs(n) < 1024:
      return f"{n:.4g} {unit}"
    n /= 1024
  return f"{n:,.1f} TiB"


def _count(n: float) -> str:
  for unit in ("", "K", "M"):
    if n < 1000:
      return f"{n:.4g}{unit}"
    n /= 1000
  return f"{n:.4g}B"


def format_report(report: dict) -> str:
  """The report as a readable table."""
  s, m = report["shapes"], report["model"]
  mesh = " x ".join(f"{k} {v}" for k, v in report["mesh"].items())
  lines = [
      f"mesh: {mesh} = {report['devices']} {report['platform']} devices; "
      f"batch split over {report['batch_shards']}",
      f"model: {m['model_type']}, {_count(m['params'])} parameters "
      f"({_count(m['matmul_params'])} in matmuls), params "
      f"{m['param_dtype']}, compute {m['dtype']}, remat {m['remat']}",
      f"shapes: {s['prompts']} prompts x {s['group_size']} = {s['rows']} "
      f"rows; prompt {s['prompt_len']} + response {s['response_len']} "
      f"tokens; {s['ppo_epochs']} epoch(s) x {s['num_minibatches']} "
      f"mini-batches x {s['num_microbatches']} micro-batches of "
      f"{s['micro_batch_rows']} rows",
  ]
  if m.get("lora_rank"):
    lines.append(f"LoRA: rank {m['lora_rank']} adapters, {_count(m['trainable'])} trainable "
                 f"parameters ({100 * m['trainable'] / m['params']:.2f}% of all); the "
                 "optimizer state holds only them")
  lines += [f"note: {n}" for n in report["notes"]]
  programs = [p for p in PROGRAMS if p in report]
  lines.append("")
  lines.append(f"{'per device':<26}" + "".join(f"{p:>16}" for p in programs))
  for field in MEMORY_FIELDS + ("peak",):
    lines.append(f"{field:<26}" + "".join(
        f"{_bytes(report[p]['memory'][field]) if 'memory' in report[p] else 'refused':>16}"
        for p in programs))
  lines.append(f"{'FLOPs (XLA)':<26}" + "".join(
      f"{report[p].get('flops_per_device', float('nan')):>16.3e}" for p in programs))
  lines.append(f"{'compile (s)':<26}" + "".join(
      f"{report[p]['compile_s']:>16}" for p in programs))
  if "target" in report:
    lines.append(f"{'kernels':<26}" + "".join(
        f"{_kernels(report[p]):>16}" for p in programs))
  n = report["devices"]
  a = {k: v / n for k, v in report["analytic_flops"].items()}
  lines += [
      "",
      "analytic FLOPs per device (whole mesh / devices):",
      f"  train step {a['train_step']:.3e} (6ND {a['train_6ND']:.3e}); "
      f"as XLA counts (each loop body once: one micro-batch of one update "
      f"through one layer, one attention tile and one LM-head chunk) "
      f"{a['train_step_xla_counts']:.3e}",
      f"  sampling   {a['sample']:.3e} (2ND {a['sample_2ND']:.3e}); "
      f"as XLA counts the static sampler (prefill + one decode step) "
      f"{a['sample_xla_counts']:.3e}",
  ]
  if "engine" in report:
    lines.append("  (the engine's XLA count is one decode step of its slots "
                 "plus one prefill per refill width, so not comparable)")
  lines.append("")
  if "target" in report:
    lines += target_lines(report)
    if "engine" in report and "memory" in report["engine"]:
      lines += ["", *_engine_lines(report)]
    if "roofline" in report:
      lines += ["", *roofline_lines(report)]
    return "\n".join(lines)
  lines.append(f"fits per chip ({report['devices']} chips; "
               "peak per device vs HBM per chip):")
  for chip, gib in TPU_HBM_GIB.items():
    verdicts = []
    for p in programs:
      peak, name = report[p]["memory"]["peak"] / 2**30, p
      if p == "engine":  # see _engine_lines
        e = report[p]
        peak = e["rollout_peak"] / 2**30
        name = "engine + optimizer state"
      verdicts.append(f"{name} {'fits' if peak <= gib else 'does NOT fit'}"
                      f" ({peak:.3g} of {gib} GiB)")
    lines.append(f"  {chip}-{report['devices']}: " + "; ".join(verdicts))
  if report["platform"] == "cpu":
    lines.append(f"note: {ESTIMATE_NOTE}")
  if "engine" in report:
    lines += ["", *_engine_lines(report)]
  train = report.get("train_step", {})
  if "one_update_memory" in train:
    lines.append(f"train_step: compiled {train['updates_compiled']} of "
                 f"{s['ppo_epochs'] * s['num_minibatches']} updates; "
                 "full batch added to the arguments")
  return "\n".join(lines)


def _kernels(program: dict) -> str:
  kernels = program.get("kernels", {})
  return ", ".join(f"{k} {v}" for k, v in sorted(kernels.items())) or "none"


def program_verdicts(report: dict) -> dict:
  """Per compiled program, its fit on the target with headroom
  (``targets.verdict``); the engine counts the trainer's resident state."""
  out = {}
  for p in PROGRAMS:
    if p in report:
      resident = report[p].get("resident_bytes_per_device", 0) if p == "engine" else 0
      out[p] = targets_lib.verdict(report[p], resident)
  return out


def target_lines(report: dict) -> list[str]:
  t = report["target"]
  lines = [f"target {t['name']}: {report['devices']} x {t['device_kind']}"
           + (f" in {t['num_slices']} slices" if t["num_slices"] > 1 else "")
           + f", compiled by {t['compiler']}; a program may use "
           f"{_bytes(t['capacity_bytes'])} per chip (the compiler's figure); "
           f"a fit leaves {100 * t['headroom']:.0f}% of it free"]
  for p, v in program_verdicts(report).items():
    program = report[p]
    name = "engine + resident optimizer state" if p == "engine" else p
    if program["compiler_refused"]:
      lines.append(f"  {name}: does NOT fit: the compiler refused it ({program['refusal']})")
      continue
    state = "fits" if v["fits"] else "does NOT fit"
    lines.append(f"  {name}: {state}: {_bytes(v['needed_bytes'])} of "
                 f"{_bytes(v['capacity_bytes'])} ({100 * (1 - v['headroom']):.1f}% used), "
                 f"compile {program['compile_s']} s, kernels: {_kernels(program)}")
  return lines


def roofline_lines(report: dict) -> list[str]:
  r = report["roofline"]
  lines = [f"roofline per {r['chip']} chip (an upper bound on speed: peak "
           f"{r['peak_bf16_flops'] / 1e12:g} TFLOP/s bf16, {r['hbm_bytes_per_s'] / 1e9:g} GB/s HBM; "
           "ba_jax.scaling.roofline):"]
  for name in ("train_step", "decode_step"):
    if name in r:
      x = r[name]
      lines.append(f"  {name}: {x['flops']:.3e} FLOPs, {_bytes(x['bytes'])} -> "
                   f"{x['seconds'] * 1e3:.4g} ms ({x['bound']}-bound), "
                   f"{x['tokens_per_s']:,.0f} tokens/s per chip, MFU at most {100 * x['mfu']:.0f}%")
  return lines


def misfit_line(report: dict) -> str | None:
  """One line naming the first program that does not fit the target, or None."""
  if "target" not in report:
    return None
  for p, v in program_verdicts(report).items():
    if not v["fits"]:
      return (f"dry run: {p} does not fit {report['target']['name']}: it needs "
              f"{_bytes(v['needed_bytes'])} per chip, the chip has {_bytes(v['capacity_bytes'])} "
              f"(and {100 * targets_lib.HEADROOM:.0f}% is kept free)")
  return None


def _engine_lines(report: dict) -> list[str]:
  e, n = report["engine"], report["devices"]
  source = (f"rl.kv_cache_gib={e['kv_cache_gib']:g} per device"
            if e["kv_cache_gib"] else "rl.max_slots per process")
  lines = [
      f"engine: {e['slots']} decode slots ({e['slots_per_device']} per "
      f"device on {e['slot_shards']} batch shards), {e['cache_len']} cache "
      f"positions each (prompt bucket {e['prompt_bucket']} - 1 + response); "
      f"KV cache {_bytes(e['cache_bytes_per_device'])} per device, "
      f"{_bytes(e['slot_bytes_per_device'])} per slot per device "
      f"(slots from {source})",
      f"engine peak {_bytes(e['memory']['peak'])} as compiled"
      + (f" with a {e['compiled_cache_dtype']} cache, "
         f"{_bytes(e['accelerator_peak'])} with the {e['cache_dtype']} one "
         "(XLA:CPU would write a bfloat16 cache through float32 copies "
         "that an accelerator does not make)"
         if e["compiled_cache_dtype"] != e["cache_dtype"] else "")
      + f"; + the trainer's resident optimizer state "
      f"({_bytes(e['resident_bytes_per_device'])}): "
      f"{_bytes(e['rollout_peak'])} "
      "per device",
      "slots per device that fit (estimate: that peak less its cache, plus "
      "the cache's bytes per slot):"]
  for chip, fit in e["slots_that_fit"].items():
    budget = fit * e["slot_bytes_per_device"] / 2**30
    lines.append(f"  {chip}-{n} ({_bytes(e['chip_bytes'][chip])}): {fit} per device "
                 f"= {fit * e['slot_shards']} slots on the mesh "
                 f"(KV cache {budget:.3g} GiB per device)")
  if not e["kv_cache_gib"]:
    lines.append("note: rl.max_slots counts slots per process and this dry "
                 "run is one process, so a pod of n processes holds n times "
                 "these slots; rl.kv_cache_gib (per device) gives the same "
                 "slots per device whatever the process count")
  return lines


# --- the accelerator check's lines (ba_jax.scaling.accelerator) -------------

def _gib(n) -> str:
  return "n/a" if n is None else f"{n / 2**30:.2f} GiB"


def _pct(x) -> str:
  return "n/a (no published peak for this chip)" if x is None else f"{100 * x:.1f}%"


def device_line(r: dict) -> str:
  peak = ("no published bf16 peak in ba_jax.scaling.accelerator.CHIPS"
          if r["peak_bf16_flops"] is None
          else f"peak {r['peak_bf16_flops'] / 1e12:g} TFLOP/s bf16 each")
  return (f"devices: {r['devices']} x {r['device_kind']} ({r['backend']}; "
          f"{r['chip']}, {peak}); jax {r['jax']}")


def tests_line(t: dict) -> str:
  if "passed" not in t:
    return f"tests: {t['status']}"
  line = (f"tests: {t['status']}: {t['passed']} passed, {t['failed']} failed, "
          f"{t['errors']} errors, {t['skipped']} skipped, {t['deselected']} "
          f"deselected (multi-device) in {t['seconds']:g} s")
  return line + ("; failing: " + ", ".join(t["failures"]) if t["failures"] else "")


def train_line(t: dict, m: dict, peak) -> str:
  return (f"train step: {m['name']} ({m['params'] / 1e6:.3g}M params, "
          f"{m['dtype']}), {t['rows']} rows x {t['tokens_per_row']} tokens in "
          f"{t['microbatches']} micro-batches: {t['step_s'] * 1e3:.1f} ms, "
          f"{t['tokens_per_s']:,.0f} tokens/s, MFU {_pct(t['mfu'])} "
          f"(first call {t['first_call_s']:g} s)")


def decode_line(d: dict, peak) -> str:
  return (f"decode step: {d['rows']} rows, prompt {d['prompt_len']} + "
          f"{d['response_len']} tokens: {d['decode_step_s'] * 1e3:.2f} ms, "
          f"{d['tokens_per_s']:,.0f} tokens/s, MFU {_pct(d['mfu'])} "
          f"(prefill {d['prefill_s'] * 1e3:.1f} ms)")


def predicted_line(report: dict) -> str:
  """The roofline bound of the timed steps beside what was measured."""
  r, parts = report["roofline"], []
  for name, key in (("train step", "train_step"), ("decode step", "decode")):
    bound = r["train_step" if key == "train_step" else "decode_step"]
    measured = report.get(key)
    seconds = measured and (measured["step_s"] if key == "train_step" else measured["decode_step_s"])
    part = f"{name} {bound['seconds'] * 1e3:.3g} ms ({bound['bound']}-bound)"
    if seconds:
      part += f", measured {seconds * 1e3:.3g} ms = {100 * bound['seconds'] / seconds:.0f}% of the bound's speed"
    parts.append(part)
  return f"roofline bound on {r['chip']} (ba_jax.scaling.roofline, an estimate): " + "; ".join(parts)


def memory_line(m: dict) -> str:
  parts = [f"{p} {_gib(v['peak_bytes'])}" for p, v in m["compiled"].items()]
  line = "memory: dry run peak per device " + ", ".join(parts)
  if "cpu_estimate" in m:
    line += " (XLA:CPU estimate " + ", ".join(
        f"{p} {_gib(v['peak_bytes'])}" for p, v in m["cpu_estimate"].items()) + ")"
  measured = m["measured_peak_bytes"]
  if any(v is not None for v in measured.values()):
    line += "; measured peak " + ", ".join(
        f"after {k} {_gib(v)}" for k, v in measured.items())
  if m["device_bytes"] is None:
    return line + "; the device reports no memory limit"
  return (line + f"; device {_gib(m['device_bytes'])}: "
          + ("fits" if m["fits"] else "does NOT fit"))
