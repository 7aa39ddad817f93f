"""Length statistics of a warm-up policy's own samples on the drafts task.

    python -m experiments.studies.powered_drafts.drafts_warmup_probe --out=experiments/studies/powered_drafts/results/drafts_warmup_probe.json
    python -m experiments.studies.powered_drafts.drafts_warmup_probe --init_from=DIR   # an exported warm-up

Warms up the policy of ``configs/drafts.py`` (``python -m ba_jax.train ...
--config.rl.steps=0`` then ``ba_jax.export``: what experiments/
the powered study shares between rules), unless ``--init_from`` names an
exported one; then samples ``--group_size`` responses for each of the
config's held-out problems at temperature 1 and grades the same samples under
each gap's rule (the warm-up does not depend on the rule). Reports per rule
the accuracy, the share of groups holding both signs, the within-group length
CV and the within-group relative gap (correct minus incorrect mean length
over the group's mean, groups holding both signs); and, rule-free, the share
of well-formed responses, the draft-count histogram, and the mean negative
log-probability of the sampled tokens (an estimate of the policy's entropy
per token) at the stop choices (the token after each draft: a space goes on,
EOS stops) and elsewhere.
Writes a JSON file.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import runpy
import sys
import tempfile
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[3]
CONFIG = "configs/drafts.py"
GAPS = ("neg", "none", "pos")


def warmup(workdir: pathlib.Path, seed: int, variant: str, overrides) -> pathlib.Path:
  from experiments.studies.aggregation_ablation import ablate_aggregation as ablation
  export = workdir / "hf"
  if not (export / "config.json").exists():
    workdir.mkdir(parents=True, exist_ok=True)
    ablation._run(ablation._train_cmd(CONFIG, variant, workdir, [
        f"--config.seed={seed}", "--config.rl.steps=0", *overrides]),
        workdir / "log.txt", os.cpu_count() or 1)
    ablation._run([sys.executable, "-m", "ba_jax.export", f"--workdir={workdir}",
                   f"--output_dir={export}"], workdir / "export_log.txt", 1)
  return export


def group_stats(lengths_GxS: np.ndarray, correct_GxS: np.ndarray) -> dict:
  """Accuracy, mixed-group share, mean within-group CV and relative gap."""
  cv = lengths_GxS.std(-1) / lengths_GxS.mean(-1)
  rel = [(L[c].mean() - L[~c].mean()) / L.mean()
         for L, c in zip(lengths_GxS, correct_GxS) if c.any() and (~c).any()]
  return dict(accuracy=float(correct_GxS.mean()),
              groups_mixed_frac=len(rel) / len(lengths_GxS),
              length_cv_in_group=float(cv.mean()),
              length_gap_in_group_rel=float(np.mean(rel)) if rel else float("nan"))


def probe(init_from: pathlib.Path, *, variant: str, group_size: int, seed: int) -> dict:
  import jax
  from ba_jax.config import schema
  from ba_jax.generation import sampler
  from ba_jax.policy import hf
  from ba_jax.tasks import drafts
  from ba_jax.tasks import registry as tasks

  get_config = runpy.run_path(str(ROOT / CONFIG))["get_config"]
  results, samples = {}, None
  for gap in GAPS:
    cfg = schema.parse(get_config(",".join(filter(None, [f"gap={gap}", variant]))))
    task = tasks.make_task(cfg.task, cfg.eval, seed=seed,
                           tokenizer=tasks.make_tokenizer(cfg.task))
    if samples is None:  # one set of samples, graded under every rule
      policy, _ = hf.load_pretrained(init_from)
      ids, mask = task.encode_prompts(task.heldout)
      out = sampler.sample_groups(policy, ids, mask, group_size=group_size,
                                  max_new_tokens=cfg.rl.max_new_tokens,
                                  temperature=1.0, eos_id=task.eos_id,
                                  pad_id=task.pad_id, rng=jax.random.key(seed + 1))
      samples = jax.tree.map(np.asarray, out)
      texts = task.decode(samples.tokens, samples.mask)
      problems = [p for p in task.heldout for _ in range(group_size)]
    _, correct = task.grade(texts, problems)
    lengths = samples.mask.sum(-1).reshape(-1, group_size).astype(float)
    results[gap] = dict(rule=cfg.task.rule, **group_stats(
        lengths, correct.reshape(-1, group_size)))

  nll = -samples.logprobs
  # The token after each draft, a space (another check) or EOS (stop): where
  # the length is chosen. One token per character, so text index = position.
  choices = np.zeros_like(samples.mask, bool)
  for i, text in enumerate(texts):
    marks = [j for j, ch in enumerate(text) if ch == " "] + [len(text)]
    choices[i, [j for j in marks if j < choices.shape[1]]] = True
  real = samples.mask.astype(bool)
  counts = [drafts.draft_count(t) for t in texts]
  return dict(
      rules=results, responses=len(texts), problems=len(task.heldout),
      group_size=group_size,
      well_formed=float(np.mean([c > 0 for c in counts])),
      truncated=float(samples.truncated.mean()),
      length_mean=float(samples.mask.sum(-1).mean()),
      draft_count_histogram=dict(sorted(collections.Counter(counts).items())),
      nll_per_token=float(nll[real].mean()),
      nll_at_stop_choices=float(nll[choices & real].mean()),
      nll_elsewhere=float(nll[real & ~choices].mean()),
      stop_choice_token_frac=float((choices & real).sum() / real.sum()),
      examples=texts[:6])


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--init_from", default="",
                      help="an exported warm-up (Hugging Face directory); '': warm one up")
  parser.add_argument("--workdir", default="",
                      help="where to warm up ('': a temporary folder)")
  parser.add_argument("--variant", default="", help="extra configs/drafts.py variants")
  parser.add_argument("--override", action="append", default=[],
                      help="extra --config.key=value for the warm-up")
  parser.add_argument("--group_size", type=int, default=8)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--out", default="experiments/studies/powered_drafts/results/drafts_warmup_probe.json")
  args = parser.parse_args(argv)
  t0 = time.perf_counter()
  with tempfile.TemporaryDirectory() as tmp:
    init = pathlib.Path(args.init_from) if args.init_from else warmup(
        pathlib.Path(args.workdir or tmp) / f"warmup_s{args.seed}", args.seed,
        args.variant, args.override)
    warm_s = time.perf_counter() - t0
    result = probe(init, variant=args.variant, group_size=args.group_size, seed=args.seed)
  command = " ".join(["python", "experiments/studies/powered_drafts/drafts_warmup_probe.py",
                      *(argv if argv is not None else sys.argv[1:])])
  result = dict(command=command, args=vars(args), warmup_seconds=round(warm_s, 1),
                seconds=round(time.perf_counter() - t0, 1), **result)
  path = pathlib.Path(args.out)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(result, indent=1) + "\n")
  print(json.dumps({k: v for k, v in result.items() if k != "examples"}, indent=1))
  return result


if __name__ == "__main__":
  main()
