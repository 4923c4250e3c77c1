#!/usr/bin/env bash
# The main job: a private training run on the embedded default (4,000 real MNIST digits), on CPU.
# DP-Muon (conv weights) + AdamW (the rest) at epsilon = 3, delta = 1e-5; prints test accuracy
# and the epsilon spent. Extra arguments are config overrides, e.g. privacy.epsilon=8.
set -euo pipefail
ROOT="$(cd -- "$(dirname "${BASH_SOURCE[0]}")/.." >/dev/null && pwd)"  # (quiet with CDPATH)
source "$ROOT/launch/setup.sh"
cd "$ROOT"
OUT="${DPTRAIN_DEMO_DIR:-runs/demo-$(date +%Y%m%d-%H%M%S)}"
"$VENV/bin/dptrain" train --config configs/mnist_demo.yaml --output-dir "$OUT" "$@"
"$VENV/bin/python" - "$OUT/summary.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
print(f"MNIST test accuracy {s['metrics']['accuracy']:.3f} at epsilon {s['epsilon']:.2f} "
      f"(delta {s['delta']:.0e}, {s['steps']} steps, noise multiplier {s['noise_multiplier']:.3f})")
PY
