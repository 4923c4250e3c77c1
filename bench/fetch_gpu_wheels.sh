#!/usr/bin/env bash
# Download, HERE (a machine with registry access), the wheels that the H200 machine lacks, into
# bench/wheels/ (gitignored). The H200 machine cannot reach any registry; bench/gpu_check.sh
# installs these with `pip install --no-index --no-deps` from the carried folder.
#
#   bash bench/fetch_gpu_wheels.sh            # then carry bench/wheels to the GPU machine
#
# What its image already has (Python 3.12, torch, transformers, timm, accelerate, numpy, scipy,
# safetensors, pyyaml, tqdm, nvidia-ml-py, sacrebleu, pytest) is not fetched. Missing there and
# needed by dptrain's train path and tests: opacus (accountants), prv-accountant, webdataset and
# its braceexpand. The image has a peft of its own; this one is carried so that the LoRA part
# runs the version the tests here ran. All five are pure-Python wheels (py3-none-any), so the
# Python version here does not matter. Their versions are pinned below: those that setup.sh's
# install resolved within pyproject.toml's ranges (launch/constraints.txt pins none of the five);
# where this checkout's .venv holds another version of one, a warning says so (update the pin to
# run on the GPU what the tests here ran). Not carried, since no GPU part uses them: randomgen
# (compiled; secure mode) and rouge-score (it needs nltk; the E2E metrics).
set -euo pipefail
ROOT="$(cd -- "$(dirname "${BASH_SOURCE[0]}")/.." >/dev/null && pwd)"  # (quiet with CDPATH)
PY="${PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$PY" ] || PY=python3
DEST="$ROOT/bench/wheels"
PINS=(opacus==1.6.0 prv-accountant==0.2.0 webdataset==1.0.2 braceexpand==0.1.7 peft==0.21.2)
if [ -x "$ROOT/.venv/bin/python" ]; then  # (-I: the venv's own metadata)
  "$ROOT/.venv/bin/python" -I - "${PINS[@]}" <<'EOF' >&2 || true
import importlib.metadata as md, sys
for pin in sys.argv[1:]:
    name, version = pin.split("==")
    try:
        here = md.version(name)
    except md.PackageNotFoundError:
        continue
    if here != version:
        print(f"fetch_gpu_wheels.sh: warning: .venv holds {name} {here}, fetching {version}")
EOF
fi
mkdir -p "$DEST"
"$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp --platform manylinux2014_x86_64 \
  --platform any -d "$DEST" "${PINS[@]}"
ls -l "$DEST"
