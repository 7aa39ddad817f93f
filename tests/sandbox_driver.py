"""Runs sandbox jobs given as JSON on stdin and prints their results as JSON (stdlib only).

The attack tests start it as an unprivileged user (`setpriv`) from a world-
readable copy of ba_jax's sandbox files, so that the sandbox runs in its
non-root mode; as root it runs in-process.
"""
import dataclasses
import json
import sys


def run_jobs(jobs):
  from ba_jax.sandboxing import judge
  from ba_jax.sandboxing import sandbox
  try:
    sandbox.check_available()
  except sandbox.SandboxUnavailable as e:
    return {"refused": str(e)}
  out = []
  for job in jobs:
    limits = sandbox.SandboxLimits(**job.get("limits", {}))
    if job["kind"] == "tests":
      outcome = judge.run_tests(job["program"], job["tests"], limits)
      out.append(dataclasses.asdict(outcome))
    else:
      result = sandbox.run_program(job["program"], job.get("stdin", ""), limits)
      out.append(dataclasses.asdict(result))
  return out


if __name__ == "__main__":
  sys.path.insert(0, sys.argv[1])
  print(json.dumps(run_jobs(json.load(sys.stdin))))
