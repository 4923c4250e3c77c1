#!/usr/bin/env bash
# The test suite: bash launch/test.sh [pytest args...] (tests/ unless the arguments name a
# file or directory, e.g. bash launch/test.sh tests/test_models.py -k pretrained)
set -euo pipefail
ROOT="$(cd -- "$(dirname "${BASH_SOURCE[0]}")/.." >/dev/null && pwd)"  # (quiet with CDPATH)
# a test path given from another directory: made absolute before the cd below
ARGS=()
for arg in "$@"; do
  case "$arg" in
    -*) ARGS+=("$arg") ;;
    *) if [ -e "${arg%%::*}" ]; then
         rest="${arg#"${arg%%::*}"}"
         ARGS+=("$(cd -- "$(dirname -- "${arg%%::*}")" >/dev/null && pwd)/$(basename -- "${arg%%::*}")$rest")
       else ARGS+=("$arg"); fi ;;
  esac
done
set -- ${ARGS[@]+"${ARGS[@]}"}
source "$ROOT/launch/setup.sh"
cd "$ROOT"
# Two pytest workers (the CI machine has 2 cores); each torch process single-threaded unless a
# test asks otherwise. DPTRAIN_TEST_WORKERS=0 runs in one process.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
TARGETS=(tests)
for arg in "$@"; do
  case "$arg" in -*) ;; *) [ -e "${arg%%::*}" ] && TARGETS=() ;; esac
done
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider -n "${DPTRAIN_TEST_WORKERS:-2}" \
  --durations=15 "$@" ${TARGETS[@]+"${TARGETS[@]}"}
