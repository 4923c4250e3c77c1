#!/usr/bin/env bash
# The test suite: bash launch/test.sh [pytest args...] (tests/ unless the arguments name a
# file or directory, e.g. bash launch/test.sh tests/test_models.py -k pretrained)
set -euo pipefail
ROOT="$(cd -- "$(dirname "${BASH_SOURCE[0]}")/.." >/dev/null && pwd)"  # (quiet with CDPATH)
# Paths are made absolute before the cd below: a test path given from another directory (an
# existing one: tests/ is dropped then), and the value of an option that names a file, existing
# or not (--junitxml, --basetemp: pytest empties an existing basetemp), or a pattern of paths
# (--ignore-glob, which pytest, as --ignore, reads from its working directory). The value of an
# option that takes an expression (-k EXPR, -m MARK, ...) is passed as it is, even where a file
# of that name exists (-k launch is an expression, not the launch/ folder); so is --deselect's
# node id, which pytest matches against ids relative to the repository root.
absolute() {  # an existing path (test ids' ::parts kept) from the caller's directory
  if [ -e "${1%%::*}" ]; then
    local rest="${1#"${1%%::*}"}"
    echo "$(cd -- "$(dirname -- "${1%%::*}")" >/dev/null && pwd)/$(basename -- "${1%%::*}")$rest"
  else echo "$1"; fi
}
anchored() {  # any path, existing or not, from the caller's directory
  case "$1" in /*) echo "$1" ;; *) echo "$PWD/$1" ;; esac
}
PATH_OPTIONS="--ignore --rootdir --basetemp --junitxml --junit-xml --confcutdir -c --log-file"
PATH_OPTIONS="$PATH_OPTIONS --config-file --ignore-glob"
ARGS=()
TARGETS=(tests)  # unless the arguments name a test file or directory
value=""  # the kind of value the previous option takes: expr or path
for arg in "$@"; do
  case "$value" in
    expr) ARGS+=("$arg"); value=""; continue ;;
    path) ARGS+=("$(anchored "$arg")"); value=""; continue ;;
  esac
  case "$arg" in
    -k|-m|-p|-o|-W|-n|--maxfail|--durations|--tb|--log-level|--deselect)
       ARGS+=("$arg"); value=expr ;;
    --*=*) name="${arg%%=*}"
       if [[ " $PATH_OPTIONS " == *" $name "* ]]; then
         ARGS+=("$name=$(anchored "${arg#*=}")")
       else ARGS+=("$arg"); fi ;;
    -*) ARGS+=("$arg")
       [[ " $PATH_OPTIONS " == *" $arg "* ]] && value=path ;;
    *) ARGS+=("$(absolute "$arg")")  # (a path from ROOT, tests/x.py, also names a target)
       if [ -e "${arg%%::*}" ] || [ -e "$ROOT/${arg%%::*}" ]; then TARGETS=(); fi ;;
  esac
done
set -- ${ARGS[@]+"${ARGS[@]}"}
source "$ROOT/launch/setup.sh"
cd "$ROOT"
# Two pytest workers (the CI machine has 2 cores); each torch process single-threaded unless a
# test asks otherwise. DPTRAIN_TEST_WORKERS=0 runs in one process.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider -n "${DPTRAIN_TEST_WORKERS:-2}" \
  --durations=15 "$@" ${TARGETS[@]+"${TARGETS[@]}"}
