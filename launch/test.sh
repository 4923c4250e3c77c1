#!/usr/bin/env bash
# The test suite: bash launch/test.sh [pytest args...]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/launch/setup.sh"
cd "$ROOT"
# Two pytest workers (the CI machine has 2 cores); each torch process single-threaded unless a
# test asks otherwise. DPTRAIN_TEST_WORKERS=0 runs in one process.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider -n "${DPTRAIN_TEST_WORKERS:-2}" \
  --durations=15 "$@" tests
