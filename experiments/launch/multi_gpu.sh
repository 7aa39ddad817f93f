#!/usr/bin/env bash
# Train on one host with several GPUs.
#
#   CONFIG=configs/qwen3_1p7b_polaris.py:agg=balanced WORKDIR=/runs/qwen3_ba TARGET=h100:1x8 \
#   INIT_FROM=/models/Qwen3-1.7B TASK_PATH=/data/polaris-53k.jsonl \
#   experiments/launch/multi_gpu.sh [--config.key=value ...]
#
# MODE=single (default): one process sees every local GPU; jax.devices()
#   lists them all and the config's mesh spans them.
# MODE=multi: NUM_PROCESSES processes (default: one per GPU), each seeing
#   GPUS_PER_PROCESS GPUs (default 1) through CUDA_VISIBLE_DEVICES, joined by
#   jax.distributed through a coordinator on 127.0.0.1:PORT (default 29500).
#   Logs go to LOG_DIR (default WORKDIR/logs) as process_<i>.log; if one
#   process fails the others are stopped.
#
# Required: CONFIG, WORKDIR. Optional: INIT_FROM, TASK_PATH (set
# config.init_from and config.task.path), NUM_GPUS (default: counted with
# nvidia-smi), PYTHON (default python3), DRY=1 (print the commands, run
# nothing). Extra arguments are passed to ba_jax.train. Before launching,
# the config is compiled for the GPUs by XLA:GPU on this machine
# (fit_check.sh: TARGET=h100:1x8 for one host of 8 H100s; needs
# pip install -e ".[aot]") and refused if it does not fit.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/fit_check.sh"

: "${CONFIG:?set CONFIG, e.g. configs/qwen3_1p7b_polaris.py:agg=balanced}"
: "${WORKDIR:?set WORKDIR to the run directory}"
MODE="${MODE:-single}"
PYTHON="${PYTHON:-python3}"
PORT="${PORT:-29500}"
DRY="${DRY:-0}"

train_args=("--config=${CONFIG}" "--workdir=${WORKDIR}")
if [[ -n "${INIT_FROM:-}" ]]; then
  train_args+=("--config.init_from=${INIT_FROM}")
fi
if [[ -n "${TASK_PATH:-}" ]]; then
  train_args+=("--config.task.path=${TASK_PATH}")
fi
train_args+=("$@")

show() {  # prints a command, shell-quoted
  printf '%q' "$1"
  shift
  printf ' %q' "$@"
  printf '\n'
}

case "${MODE}" in
  single|multi) ;;
  *)
    echo "MODE=${MODE}: expected 'single' (one process, all GPUs) or 'multi'" \
      "(one process per GPU group)" >&2
    exit 2
    ;;
esac
fit_check "$@"

if [[ "${MODE}" == "single" ]]; then
  cmd=("${PYTHON}" -m ba_jax.train "${train_args[@]}")
  if [[ "${DRY}" == "1" ]]; then
    show "${cmd[@]}"
    exit 0
  fi
  exec "${cmd[@]}"
fi

if [[ -z "${NUM_GPUS:-}" ]]; then
  if ! command -v nvidia-smi >/dev/null; then
    echo "NUM_GPUS is unset and nvidia-smi is not available to count the GPUs;" \
      "set NUM_GPUS" >&2
    exit 2
  fi
  NUM_GPUS="$(nvidia-smi -L | grep -c '^GPU ')"
fi
GPUS_PER_PROCESS="${GPUS_PER_PROCESS:-1}"
NUM_PROCESSES="${NUM_PROCESSES:-$((NUM_GPUS / GPUS_PER_PROCESS))}"
if (( NUM_PROCESSES < 1 || NUM_PROCESSES * GPUS_PER_PROCESS > NUM_GPUS )); then
  echo "NUM_PROCESSES=${NUM_PROCESSES} x GPUS_PER_PROCESS=${GPUS_PER_PROCESS}" \
    "does not fit the ${NUM_GPUS} GPUs (NUM_GPUS)" >&2
  exit 2
fi
LOG_DIR="${LOG_DIR:-${WORKDIR}/logs}"

pids=()
stop_all() {  # each process leads its own group (setsid): stop its children too
  for pid in "${pids[@]}"; do
    kill -- "-${pid}" 2>/dev/null || true
  done
}
trap 'stop_all; exit 130' INT TERM

if [[ "${DRY}" != "1" ]]; then
  mkdir -p "${LOG_DIR}"
fi
for ((i = 0; i < NUM_PROCESSES; i++)); do
  first=$((i * GPUS_PER_PROCESS))
  gpus="$(seq -s, "${first}" "$((first + GPUS_PER_PROCESS - 1))")"
  cmd=(env "CUDA_VISIBLE_DEVICES=${gpus}" "${PYTHON}" -m ba_jax.train
       "${train_args[@]}" "--coordinator_address=127.0.0.1:${PORT}"
       "--num_processes=${NUM_PROCESSES}" "--process_id=${i}")
  if [[ "${DRY}" == "1" ]]; then
    show "${cmd[@]}"
    continue
  fi
  setsid "${cmd[@]}" >"${LOG_DIR}/process_${i}.log" 2>&1 &
  pids+=("$!")
done
if [[ "${DRY}" == "1" ]]; then
  exit 0
fi
echo "started ${NUM_PROCESSES} processes; logs in ${LOG_DIR}/process_<i>.log"

status=0
# wait -n returns as soon as any process ends: stop the rest on a failure.
for ((n = 0; n < NUM_PROCESSES; n++)); do
  if ! wait -n; then
    status=1
    echo "a process failed; stopping the others (see ${LOG_DIR})" >&2
    stop_all
    wait || true
    break
  fi
done
exit "${status}"
