"""What the one-run audit (``dptrain audit``) measures on a config's real run, and what it
catches: the same run with the noise scaled by a factor (a fault injected into the trainer's
noise draw, in this process only), the real mechanism under several audit seeds.

    python bench/audit.py [--config configs/mnist_demo.yaml] [--canaries 1000]
                          [--scales 1,0.5,0.25,0] [--seeds 0,1,2]

Prints a table; the last line is one JSON object: for each (scale, seed) the measured lower
bound, the accountant's epsilon, and whether the audit passed.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "mnist_demo.yaml"))
    ap.add_argument("--canaries", default="1000")
    ap.add_argument("--scales", default="1,0.5,0.25,0",
                    help="noise scales; the audit seeds are run at scale 1 only")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()

    from dptrain.cli import main as cli
    from dptrain.trainer import Trainer

    real = Trainer._noise_flat
    runs = [(float(s), 0) for s in args.scales.split(",")]
    runs += [(1.0, int(k)) for k in args.seeds.split(",") if int(k) != 0]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for scale, seed in runs:
            Trainer._noise_flat = (lambda self, *a, _s=scale, **k: real(self, *a, **k) * _s)
            out = Path(tmp) / f"{scale}-{seed}.json"
            t0 = time.time()
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                code = cli(["audit", "--config", args.config, "--canaries", args.canaries,
                            "--audit-seed", str(seed), "--output", str(out),
                            "train.progress=false", *args.overrides])
            r = json.loads(out.read_text())
            rows.append({"noise_scale": scale, "audit_seed": seed, "exit": code,
                         "epsilon_lower_bound": round(r["epsilon_lower_bound"], 3),
                         "claimed_epsilon": round(r["claimed_epsilon"], 3),
                         "guesses": r["guesses"], "correct": r["correct"],
                         "noise_check": r["noise_check"]["ok"],
                         "variance_ratio": round(r["noise_check"]["variance_ratio"], 3),
                         "seconds": round(time.time() - t0, 1)})
            print(f"noise x {scale:<5} audit seed {seed}: epsilon >= "
                  f"{r['epsilon_lower_bound']:.3f} ({r['correct']}/{r['guesses']} correct), "
                  f"accountant {r['claimed_epsilon']:.3f}, noise variance "
                  f"{r['noise_check']['variance_ratio']:.3f} of (sigma C)^2 "
                  f"({'passes' if r['noise_check']['ok'] else 'fails'} its check): "
                  f"{'passes' if code == 0 else 'FAILS'} ({time.time() - t0:.0f} s)", flush=True)
    Trainer._noise_flat = real
    print(json.dumps({"config": args.config, "canaries": int(args.canaries), "runs": rows}))


if __name__ == "__main__":
    main()
