#!/usr/bin/env bash
# Train on a multi-host TPU VM pod: every worker runs the same command, and
# ba_jax.train calls jax.distributed.initialize() from the TPU environment
# (BA_JAX_DISTRIBUTED=1), so no coordinator address is passed.
#
#   TPU_NAME=<pod name> ZONE=<zone> TARGET=v5e:8x8 \
#   CONFIG=configs/qwen25_math_7b_dapo17k.py:agg=balanced \
#   WORKDIR=gs://<bucket>/runs/qwen25_7b_balanced \
#   INIT_FROM=/mnt/models/Qwen2.5-Math-7B TASK_PATH=/mnt/data/dapo-math-17k \
#   experiments/launch/tpu_pod.sh [--config.key=value ...]
#
# Required: TPU_NAME, CONFIG, WORKDIR (shared by all workers: a gs:// path or
# a shared mount; checkpoints and metrics go there). CONFIG and WORKDIR may
# come as --config=... and --workdir=... arguments instead, as an ablation
# hands a run to this script (docs/ablations.md, "Where runs go"):
#
#   python -m ba_jax.ablate --spec=... --placement=launcher --slices=pod-a,pod-b \
#     --launcher='TPU_NAME={slice} TARGET=v5e:8x8 experiments/launch/tpu_pod.sh {args}'
# Optional: ZONE and PROJECT (else gcloud's defaults), REPO_DIR (the ba_jax
# checkout on every worker, default ba_jax), INIT_FROM and TASK_PATH (set
# config.init_from and config.task.path; the files must exist on every
# worker), PYTHON (default python3), DRY=1 (print the command, run nothing).
# Extra arguments are passed to ba_jax.train.
#
# Before launching, the config is compiled for the pod's slice by the TPU
# compiler on this machine (fit_check.sh: TARGET=v5e:8x8 or the pod's own
# topology, NUM_SLICES for several; needs pip install -e ".[aot]") and
# refused, with the program named, if it does not fit.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/fit_check.sh"

rest=()
for arg in "$@"; do
  case "${arg}" in
    --config=*) CONFIG="${arg#--config=}" ;;
    --workdir=*) WORKDIR="${arg#--workdir=}" ;;
    *) rest+=("${arg}") ;;
  esac
done
set -- ${rest[@]+"${rest[@]}"}

: "${TPU_NAME:?set TPU_NAME to the TPU VM pod name}"
: "${CONFIG:?set CONFIG, e.g. configs/qwen25_math_7b_dapo17k.py:agg=balanced}"
: "${WORKDIR:?set WORKDIR to a directory every worker can write (gs://...)}"
REPO_DIR="${REPO_DIR:-ba_jax}"
PYTHON="${PYTHON:-python3}"

train_args=("--config=${CONFIG}" "--workdir=${WORKDIR}")
if [[ -n "${INIT_FROM:-}" ]]; then
  train_args+=("--config.init_from=${INIT_FROM}")
fi
if [[ -n "${TASK_PATH:-}" ]]; then
  train_args+=("--config.task.path=${TASK_PATH}")
fi
train_args+=("$@")
fit_check "$@"

# The command each worker runs, quoted for its shell.
remote="cd $(printf '%q' "${REPO_DIR}") && BA_JAX_DISTRIBUTED=1 $(printf '%q' "${PYTHON}") -m ba_jax.train"
for arg in "${train_args[@]}"; do
  remote+=" $(printf '%q' "${arg}")"
done

gcloud_args=(compute tpus tpu-vm ssh "${TPU_NAME}" --worker=all)
if [[ -n "${ZONE:-}" ]]; then
  gcloud_args+=("--zone=${ZONE}")
fi
if [[ -n "${PROJECT:-}" ]]; then
  gcloud_args+=("--project=${PROJECT}")
fi
gcloud_args+=(--command "${remote}")

if [[ "${DRY:-0}" == "1" ]]; then
  printf 'gcloud'
  printf ' %q' "${gcloud_args[@]}"
  printf '\n'
  exit 0
fi
exec gcloud "${gcloud_args[@]}"
