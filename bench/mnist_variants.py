"""Real-data check of the image-side options: `configs/mnist_demo.yaml` (4,000 real MNIST digits,
DP-Muon + AdamW, epsilon 3, 80 steps) with and without augmentation multiplicity and a
parameter EMA, several seeds each, the same release settings (sigma, C, q, steps) in every run.

    python bench/mnist_variants.py                      # the default variants, seeds 0,1,2
    python bench/mnist_variants.py --variants base,aug4 --seeds 0 --jobs 1

A variant is a name and `key=value` overrides of the config (`VARIANTS`; `--set NAME=k=v,k=v`
adds one). Each run is `dptrain train` in its own process (1 torch thread), `--jobs` at a time;
the seed sets both the public `seed` and `privacy.seed`. Prints one table (test accuracy and loss
of the evaluated model, last-iterate accuracy with EMA, train seconds) and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "mnist_demo.yaml"

# digits: no flips; pad 2 px on 28 (jax_privacy's 4 on 32 is 1/8: 3.5 here, rounded down)
AUG = ["data.augment_pad=2", "data.augment_flip=false"]
VARIANTS: dict[str, list[str]] = {
    "base": [],
    "aug4": ["data.augmult=4", *AUG],
    "ema": ["optim.ema_decay=0.95"],
    "aug4+ema": ["data.augmult=4", *AUG, "optim.ema_decay=0.95"],
}


def run_one(name: str, overrides: list[str], seed: int, out: Path) -> dict:
    d = out / f"{name}_seed{seed}"
    summary = d / "summary.json"
    if not summary.exists():
        cmd = [sys.executable, "-m", "dptrain", "train", "--config", str(CONFIG),
               "--output-dir", str(d), f"seed={seed}", f"privacy.seed={seed}",
               "train.progress=false", "performance.num_threads=1", *overrides]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        if proc.returncode != 0:
            raise SystemExit(f"{name} seed {seed} failed ({proc.returncode}):\n{proc.stderr}")
    s = json.loads(summary.read_text())
    m = s["metrics"]
    return {"variant": name, "seed": seed, "accuracy": m["accuracy"], "loss": m["loss"],
            "last_iterate_accuracy": m.get("last_iterate_accuracy"),
            "epsilon": s["epsilon"], "noise_multiplier": s["noise_multiplier"],
            "train_seconds": s["train_seconds"]}


def _mean_sd(xs: list[float]) -> str:
    if len(xs) == 1:
        return f"{xs[0]:.4f}"
    return f"{statistics.mean(xs):.4f} ± {statistics.stdev(xs):.4f}"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--set", action="append", default=[], metavar="NAME=k=v,k=v",
                    help="define another variant")
    ap.add_argument("--out", default=str(ROOT / "runs" / "mnist_variants"))
    a = ap.parse_args(argv)
    variants = dict(VARIANTS)
    for spec in a.set:
        name, _, rest = spec.partition("=")
        variants[name] = [kv for kv in rest.split(",") if kv]
    names = [v for v in a.variants.split(",") if v]
    unknown = [v for v in names if v not in variants]
    if unknown:
        ap.error(f"--variants: unknown {unknown}; known: {sorted(variants)}")
    seeds = [int(s) for s in a.seeds.split(",")]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    jobs = [(n, variants[n], s) for n in names for s in seeds]
    with ThreadPoolExecutor(max_workers=a.jobs) as pool:
        rows = list(pool.map(lambda j: run_one(*j, out), jobs))
    print("| variant | seeds | test accuracy | per seed | last iterate | test loss | "
          "train s/run |")
    print("|---|---|---|---|---|---|---|")
    for n in names:
        rs = [r for r in rows if r["variant"] == n]
        acc = [r["accuracy"] for r in rs]
        last = [r["last_iterate_accuracy"] for r in rs if r["last_iterate_accuracy"] is not None]
        print(f"| {n} | {','.join(str(r['seed']) for r in rs)} | {_mean_sd(acc)} | "
              f"{' / '.join(f'{x:.3f}' for x in acc)} | {_mean_sd(last) if last else ''} | "
              f"{_mean_sd([r['loss'] for r in rs])} | "
              f"{statistics.mean(r['train_seconds'] for r in rs):.0f} |")
    sigmas = {r["noise_multiplier"] for r in rows}
    assert len(sigmas) == 1, f"the runs do not share one release: sigma {sigmas}"
    result = {"rows": rows, "sigma": sigmas.pop(),
              "epsilon": max(r["epsilon"] for r in rows)}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
