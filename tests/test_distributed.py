"""Two processes joined by jax.distributed on 127.0.0.1 train like one."""
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from flax import nnx

from ba_jax.run import metrics as metrics_lib
from ba_jax.run import workdir as workdir_lib
import trainer_utils as tu

TIMING = ("time_sampling", "time_rewards", "time_training", "time_step",
          "tokens_per_s")
# optim.eps=1e-3 keeps AdamW's update Lipschitz in the gradient (lr / eps):
# with the default 1e-8 an update is ~lr * sign(g), and a gradient entry that
# cancels to ~0 flips sign on float32 summation-order noise (another
# all-reduce order across processes), moving that parameter by ~2 lr.
ARGS = ["--config=configs/tiny.py:smoke", "--config.sft.steps=0",
        "--config.rl.prompts_per_step=8", "--config.optim.eps=1e-3",
        "--config.rl.steps=2", "--config.rl.overlong=soft",
        "--config.rl.overlong_buffer=20",
        "--config.log.backends=", "--config.log.samples_every=1",
        "--config.checkpoint.every=0",
        "--config.eval.num_problems=8", "--config.eval.samples_per_problem=1"]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _train_in_two_processes(workdir, args) -> list[tuple[str, str]]:
  """``python -m ba_jax.train`` as 2 processes x 4 CPU devices; both must
  exit 0. Returns their (stdout, stderr)."""
  port = _free_port()
  env = dict(os.environ,
             XLA_FLAGS="--xla_force_host_platform_device_count=4")
  procs = [subprocess.Popen(
      [sys.executable, "-m", "ba_jax.train", f"--workdir={workdir}", *args,
       f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2",
       f"--process_id={i}"], cwd=tu.REPO, env=env, stdout=subprocess.PIPE,
      stderr=subprocess.PIPE, text=True) for i in range(2)]
  deadline = time.time() + 600
  while time.time() < deadline and any(p.poll() is None for p in procs):
    if any(p.poll() not in (None, 0) for p in procs):
      break  # one failed: the other would wait for it forever
    time.sleep(0.5)
  for p in procs:
    if p.poll() is None:
      p.kill()
  outputs = [p.communicate() for p in procs]
  for p, (out, err) in zip(procs, outputs):
    assert p.returncode == 0, out[-2000:] + err[-4000:]
  return outputs


@pytest.mark.slow
def test_two_processes_agree_with_one(tmp_path):
  """2 processes x 4 CPU devices vs 1 process x 8 devices, same mesh
  (data 8): the same samples, metrics and parameters. No warm-up: the
  random policy's rewards vary through the soft overlong penalty, so the
  advantages and the updates are not zero."""
  single = tmp_path / "single"
  one = tu.run_module(["ba_jax.train", f"--workdir={single}", *ARGS])
  assert one.returncode == 0, one.stderr[-3000:]

  multi = tmp_path / "multi"
  outputs = _train_in_two_processes(multi, ARGS)
  assert "held-out accuracy, before -> after RL" in outputs[0][0]
  assert "held-out accuracy" not in outputs[1][0]  # only process 0 logs

  a, b = metrics_lib.read_metrics(str(single)), metrics_lib.read_metrics(
      str(multi))
  assert sorted(a) == sorted(b) == [1, 2]
  for step in a:
    for name, value in a[step].items():
      if name in TIMING or value is None:
        continue
      # rollouts are identical; loss terms are sums in another order.
      np.testing.assert_allclose(b[step][name], value, rtol=1e-5, atol=1e-6,
                                 err_msg=f"step {step} {name}")
    for exact in ("accuracy", "reward_mean", "length_mean", "sampled_tokens"):
      assert b[step][exact] == a[step][exact]
  # The samples tables: process 0's first groups, their aggregation weights
  # from the gathered batch, as one process gives them.
  samples = [(workdir / "samples.jsonl").read_text() for workdir in (single, multi)]
  assert samples[0] == samples[1] and samples[0].count("\n") == 2 * 2 * 4
  assert a[1]["reward_std"] > 0 and a[2]["update_norm"] > 0
  m1, _, _ = workdir_lib.restore_policy(str(single))
  m2, _, _ = workdir_lib.restore_policy(str(multi))
  assert tu.max_abs_diff(tu.host_params(nnx.state(m1)),
                         tu.host_params(nnx.state(m2))) < 1e-6


@pytest.mark.slow
def test_two_processes_fall_back_to_the_same_step(tmp_path):
  """On an fsdp 8 mesh each process holds, restores and verifies half of
  every array. Bytes flipped in a moment's chunk that only process 1 wrote
  and reads: on rerun both processes set step 2 aside and resume from step
  1 (one warning, from process 0), and replay step 2 to the parameters of
  the undamaged run."""
  import checkpoint_damage as cd
  args = [*ARGS, "--config.checkpoint.every=1", "--config.checkpoint.keep=5",
          "--config.mesh.data=1", "--config.mesh.fsdp=8"]
  workdir = tmp_path / "run"
  _train_in_two_processes(workdir, args)
  m, _, _ = workdir_lib.restore_policy(str(workdir))
  undamaged = tu.host_params(nnx.state(m))
  moment = cd.moment(workdir, 2)
  _, path, offset, length = next(
      c for c in cd.chunks(cd.step_dir(workdir, 2))
      if c[0] == moment and "ocdbt.process_1" in c[1])
  cd._xor(path, offset + length // 2, 16, 0x80)

  outputs = _train_in_two_processes(workdir, args)
  ckpt_dir = workdir / "checkpoints"
  warnings = [l for l in outputs[0][0].split("\n") if "WARNING" in l]
  assert len(warnings) == 1 and warnings[0].startswith(
      f"WARNING: checkpoint step 2 (state: digest mismatch: {moment} shard [")
  assert warnings[0].endswith("is damaged; falling back to step 1")
  assert f"resumed from {ckpt_dir} at step 1" in outputs[0][0]
  assert "WARNING" not in outputs[1][0]  # only process 0 logs
  assert sorted(os.listdir(tmp_path / "run" / "damaged_checkpoints")) == ["2"]
  m, _, _ = workdir_lib.restore_policy(str(workdir))
  assert tu.max_abs_diff(tu.host_params(nnx.state(m)), undamaged) == 0.0
