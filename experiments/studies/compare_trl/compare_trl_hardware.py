"""What hardware each side of a compare_trl part had: both sides' threads per
phase in every run pair, each library's own matmul floor, and the
compilation caches. The report prints these lines beside its ratios; a
difference between the two sides is always stated (tests/test_compare_trl_hardware.py)."""

# Above this ratio of the two libraries' float32 matmul rates on the host,
# a trainer ratio partly measures the libraries' kernels on that CPU.
FLOOR_TOLERANCE = 1.3
PHASES = ("generation", "update")


def _host(part: dict) -> dict:
  return part.get("meta", {}).get("host", {})


def run_threads(part: dict, name: str, run: dict) -> tuple[dict, bool]:
  """``run``'s threads per phase and whether the run recorded them. A file
  from before per-run records: ba_jax had XLA's default (one thread per CPU
  of the host) and TRL the part's single ``torch_threads`` in every phase."""
  if "threads" in run:
    return dict(run["threads"]), True
  if name == "ba_jax":
    n = _host(part).get("schedulable", _host(part).get("cores"))
  else:
    n = (part.get("torch_threads") or {}).get("threads")
  return {phase: n for phase in PHASES}, False


def pairs(part: dict) -> list[tuple[str, dict, dict]]:
  """(label, ba_jax run, TRL run) for every run pair of a part (part 1's
  cells, or part 2's one pair)."""
  if "cells" in part:
    return [(key, c["runs"]["ba_jax"], c["runs"]["trl"])
            for key, c in part["cells"].items()]
  return [("real", part["runs"]["ba_jax"], part["runs"]["trl"])]


def _tried(part: dict, label: str) -> list[dict]:
  cell = part["cells"].get(label, {}) if "cells" in part else part
  return cell.get("trl_tried") or []


def thread_differences(part: dict) -> list[dict]:
  """The pairs whose two sides ran some phase on different thread counts:
  label, both sides' threads, whether recorded per run, and whether TRL
  was also timed at ba_jax's count (then the budget was equal and TRL's
  faster run used fewer threads)."""
  out = []
  for label, ours, theirs in pairs(part):
    a, rec_a = run_threads(part, "ba_jax", ours)
    b, rec_b = run_threads(part, "trl", theirs)
    if any(a.get(p) != b.get(p) for p in PHASES):
      tried = {t["threads"].get("update") for t in _tried(part, label)}
      out.append(dict(label=label, ba_jax=a, trl=b, recorded=rec_a and rec_b,
                      budget_equal=all(a.get(p) in tried for p in PHASES)))
  return out


def _phases(threads: dict) -> str:
  return "/".join(str(threads.get(p)) for p in PHASES)


def thread_lines(part: dict) -> list[str]:
  """The part's thread statement: equal in every pair, or which pairs
  differ and whether TRL had the same budget."""
  all_pairs = pairs(part)
  if not all_pairs:
    return []
  diffs = thread_differences(part)
  host = _host(part)
  cpus = host.get("schedulable", host.get("cores"))
  tried = sorted({t["threads"].get("update") for label, _, _ in all_pairs
                  for t in _tried(part, label)})
  how = (f" TRL was timed at {' and '.join(map(str, tried))} torch thread(s) in every "
         "pair and its faster whole run taken." if len(tried) > 1 else "")
  if not diffs:
    a, _ = run_threads(part, "ba_jax", all_pairs[0][1])
    recorded = all(run_threads(part, "trl", t)[1] for _, _, t in all_pairs)
    return [f"**Threads equal** in all {len(all_pairs)} pair(s): generation/update on "
            f"{_phases(a)} thread(s) each side (XLA and torch), {cpus} schedulable "
            f"CPU(s)." + ("" if recorded else " Taken from the part's settings (this "
                          "file predates per-run thread records).") + how]
  unequal = [d for d in diffs if not d["budget_equal"]]
  shown = "; ".join(sorted({f"ba_jax (XLA) {_phases(d['ba_jax'])} vs TRL (torch) "
                            f"{_phases(d['trl'])}" for d in diffs}))
  line = (f"**Threads differ** between the two sides in {len(diffs)} of "
          f"{len(all_pairs)} pair(s) (generation/update: {shown}).")
  if any(not d["recorded"] for d in diffs):
    line += (" Taken from the part's settings (this file predates per-run thread "
             "records): XLA used every core while TRL's torch threads were picked "
             "from a `generate` probe.")
  if unequal:
    line += (f" In {len(unequal)} of them TRL was not timed at ba_jax's thread count: "
             "**not a same-hardware comparison**; the ratio below is partly the "
             "thread counts'.")
  else:
    line += (" TRL was also timed at ba_jax's count in each of them (the budget was "
             "equal); its faster run used the count shown.")
  return [line + how]


def floor_ratio(gflops: dict) -> float | None:
  """The larger over the smaller of the two libraries' matmul rates
  (``matmul_gflops``'s record); None when one is missing."""
  if not gflops.get("jax") or not gflops.get("torch"):
    return None
  return max(gflops["jax"], gflops["torch"]) / min(gflops["jax"], gflops["torch"])


def check_floor_match(gflops: dict, limit: float) -> None:
  """``floor_match=limit`` (a protocol key): refuse to start unless the two
  libraries' matmul floors, just measured, are within ``limit`` of each
  other, so that a headline ratio is not the kernels' (0: no check)."""
  if not limit:
    return
  ratio = floor_ratio(gflops)
  if ratio is None or ratio > limit:
    raise ValueError(
        f"floor_match={limit:g}: this host's float32 matmul floors are JAX "
        f"{gflops.get('jax', 0):.0f} and torch {gflops.get('torch', 0):.0f} GFLOP/s "
        f"({gflops.get('n')}x{gflops.get('n')}), a ratio of "
        f"{'unknown' if ratio is None else f'{ratio:.2f}'}; expected at most {limit:g}: "
        "run this protocol on a host where they match")


def floor_note(part: dict) -> str:
  """A sentence when the two libraries' float32 matmul rates measured at
  the part's start differ by more than FLOOR_TOLERANCE (empty otherwise)."""
  g = _host(part).get("matmul_gflops") or {}
  ratio = floor_ratio(g)
  if ratio is None or ratio <= FLOOR_TOLERANCE:
    return ""
  faster = "JAX" if g["jax"] > g["torch"] else "torch"
  return (f" **Matmul floors differ {ratio:.2f}x** on this host ({g['n']}x{g['n']} "
          f"float32: JAX {g['jax']:.0f}, torch {g['torch']:.0f} GFLOP/s; {faster} "
          "faster): part of this ratio is the two libraries' kernels on this CPU, "
          "not the trainers.")


def cache_line(part: dict) -> str:
  """Both sides' compilation-cache state (per run when recorded)."""
  all_pairs = pairs(part)
  ours = sorted({o.get("cache", "warm" if part.get("warm_cache") else "cold")
                 for _, o, _ in all_pairs})
  if "warm" in ours:
    return (f"Caches: ba_jax {'/'.join(ours)} (JAX's persistent compilation cache, "
            "filled by an untimed run); TRL none: eager PyTorch compiles nothing and "
            "**has no warm start** to give it, so the ratio is ba_jax warm against "
            "TRL as always. This file has no cold-vs-cold ratio (a run without "
            "`--warm_cache` gives it).")
  return ("Caches: ba_jax cold (every run compiles, JAX caches cleared); TRL "
          "compiles nothing: cold against cold.")
