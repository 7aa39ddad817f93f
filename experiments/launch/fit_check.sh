# Sourced by tpu_pod.sh and multi_gpu.sh: before a launch, compile the run's
# config for the slice it launches on with that chip's own compiler
# (python -m ba_jax.dry_run --target=TARGET; needs pip install -e ".[aot]"
# on the machine that launches) and refuse to launch unless every program
# fits with 5% of HBM free.
#
# TARGET names the slice as the dry run does (v5e:8x8, v5p:4x4x4, h100:1x8);
# NUM_SLICES (default 1) its slices. SKIP_FIT_CHECK=1 launches without it
# (for a chip the dry run has no target for); it says so on stderr.

# fit_check ARG...: ARG are the train arguments; their --config.* overrides
# (but the local paths init_from and task.path) go to the dry run too.
fit_check() {
  if [[ "${SKIP_FIT_CHECK:-0}" == "1" ]]; then
    echo "fit check skipped (SKIP_FIT_CHECK=1): nothing checked that this config fits" >&2
    return 0
  fi
  if [[ -z "${TARGET:-}" ]]; then
    echo "set TARGET to the slice this launch runs on (e.g. TARGET=v5e:8x8, h100:1x8): the" \
      "config is compiled for it first and refused if it does not fit; SKIP_FIT_CHECK=1" \
      "launches unchecked" >&2
    exit 2
  fi
  local overrides=() arg
  for arg in "$@"; do
    case "${arg}" in
      --config.init_from=*|--config.task.path=*) ;;
      --config.*) overrides+=("${arg}") ;;
    esac
  done
  local report="${FIT_REPORT:-$(mktemp -t ba_jax_fit.XXXXXX)}"
  local check=("${PYTHON}" -m ba_jax.dry_run "--config=${CONFIG}" "--target=${TARGET}"
               "--num_slices=${NUM_SLICES:-1}" "--json_out=${report}.json" "${overrides[@]}")
  if [[ "${DRY:-0}" == "1" ]]; then
    printf 'fit check:'
    printf ' %q' "${check[@]}"
    printf '\n'
    return 0
  fi
  echo "fit check: compiling ${CONFIG} for ${TARGET} (report in ${report}.txt)" >&2
  local status=0
  "${check[@]}" >"${report}.txt" 2>"${report}.err" || status=$?
  if (( status == 3 )); then
    echo "refusing to launch: $(grep '^dry run:' "${report}.err" | tail -n 1)" >&2
    exit 3
  elif (( status != 0 )); then
    echo "refusing to launch: the fit check failed (exit ${status}; see ${report}.err):" \
      "$(tail -n 1 "${report}.err")" >&2
    exit 3
  fi
  echo "fit check: every program fits ${TARGET}" >&2
}
