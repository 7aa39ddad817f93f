"""One process of the engine's multi-process test (tests/test_engine.py).

    python tests/engine_worker.py CHECKPOINT OUT.npz [COORDINATOR NUM_PROCESSES PROCESS_ID]

Samples 8 prompts x G=2 through the engine on a mesh over every device of every
process; each process passes its own prompts and writes back its own rows.
"""
import sys

import jax

if len(sys.argv) > 3:
  jax.distributed.initialize(coordinator_address=sys.argv[3], num_processes=int(sys.argv[4]),
                             process_id=int(sys.argv[5]))

import numpy as np  # pylint: disable=g-import-not-at-top

from ba_jax.policy import hf
from ba_jax.run import rollout
from ba_jax.generation import sampler
from ba_jax.policy import sharding  # pylint: disable=g-import-not-at-top
from model_utils import EOS_ID, PAD_ID, left_padded_batch  # pylint: disable=g-import-not-at-top

SLOTS = 4  # whole mesh


def main():
  mesh = sharding.make_mesh({"data": -1, "fsdp": 1, "tensor": 1})
  model, _ = hf.load_pretrained(sys.argv[1], mesh=mesh)
  ids, mask = left_padded_batch(seed=1, batch=8, length=9)
  local = rollout.process_slice(8)
  res = sampler.sample_groups(model, ids[local], mask[local], group_size=2, max_new_tokens=10,
                              temperature=1.0, eos_id=(EOS_ID, 40, 41, 42, 43), pad_id=PAD_ID,
                              rng=jax.random.key(5), max_slots=SLOTS // jax.process_count())
  np.savez(sys.argv[2], **{k: np.asarray(v) for k, v in vars(jax.device_get(res)).items()})


if __name__ == "__main__":
  main()
