#!/usr/bin/env bash
# The main job: a private training run on the embedded default (4,000 real MNIST digits), on CPU.
# DP-Muon (conv weights) + AdamW (the rest) at epsilon = 3, delta = 1e-5; prints test accuracy
# and the epsilon spent. Extra arguments go to `dptrain train`: config overrides, e.g.
# privacy.epsilon=8, or --dry-run (the checks and the plan, no training: no accuracy printed).
# DPTRAIN_DEMO_DIR: its output directory (default runs/demo-<date>-<time>; a relative path is
# read from the repository root, the demo's working directory).
set -euo pipefail
ROOT="$(cd -- "$(dirname "${BASH_SOURCE[0]}")/.." >/dev/null && pwd)"  # (quiet with CDPATH)
source "$ROOT/launch/setup.sh"
cd "$ROOT"
OUT="${DPTRAIN_DEMO_DIR:-runs/demo-$(date +%Y%m%d-%H%M%S)}"
"$VENV/bin/dptrain" train --config configs/mnist_demo.yaml --output-dir "$OUT" "$@"
# (a failed run has already ended the script with its status, set -e.) A dry run writes no
# summary.json: nothing to print, and its status (0) is the demo's.
[ -f "$OUT/summary.json" ] || exit 0
"$VENV/bin/python" - "$OUT/summary.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
print(f"MNIST test accuracy {s['metrics']['accuracy']:.3f} at epsilon {s['epsilon']:.2f} "
      f"(delta {s['delta']:.0e}, {s['steps']} steps, noise multiplier {s['noise_multiplier']:.3f})")
PY
