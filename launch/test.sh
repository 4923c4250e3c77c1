#!/usr/bin/env bash
# The test suite: bash launch/test.sh [pytest args...]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/launch/setup.sh"
cd "$ROOT"
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider "$@" tests
