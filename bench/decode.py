"""Image decoding per microbatch on threads (``performance.decode_threads``).

    python bench/decode.py [--images 128] [--size 224] [--threads 1,2,4,8] [--rounds 5]

The image datasets that read files (``webdataset``, ``imagefolder``) decode every sampled
image at the step that draws it: PIL decode, resize of the shorter side to size / 0.875,
centre crop. ImageNet's JPEGs average about 400 x 350 pixels; at 224 pixels one takes a few
milliseconds on one core, so a logical batch of 16,384 images is minutes of decoding on one
thread, more than the GPU's step. This writes ``--images`` random JPEGs of ImageNet's typical
sizes into an ImageFolder tree in a temporary folder, then times ``collate`` of all of them
with each thread count, interleaved (bench/common.py), and checks every count decodes the same
tensor. The last line printed is one JSON object with the median seconds per image for each
count and ``speedup`` (one thread's time over each count's).

With ``--prefetch``, it also times ``dptrain train``'s private step on that folder (the tiny
GroupNorm CNN of configs/tiny_images.yaml at 64 pixels, microbatches of 16, one torch thread,
one decoding thread) with ``performance.collate_prefetch`` inline and background, interleaved:
``prefetch_speedup`` is inline's time over background's (the next microbatch decoded on a
second core while the current one computes; on a GPU machine the device computes instead).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import git_commit, load_average, machine_description, median, now_utc, time_interleaved  # noqa: E402

from dptrain.data import DataConfig, build_data  # noqa: E402


def write_tree(root: Path, n: int, seed: int = 0) -> None:
    """``n`` JPEGs of 300-500 x 250-450 pixels (smooth random fields: they compress like
    photographs, not like noise) in two classes, plus a one-image test split."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    for split, count in (("train", n), ("val", 1)):
        for k in range(count):
            folder = root / split / f"class{k % 2}"
            folder.mkdir(parents=True, exist_ok=True)
            h, w = int(rng.integers(250, 450)), int(rng.integers(300, 500))
            coarse = rng.integers(0, 256, size=(h // 16 + 1, w // 16 + 1, 3), dtype=np.uint8)
            img = Image.fromarray(coarse).resize((w, h), Image.BICUBIC)
            img.save(folder / f"{k:05d}.jpg", quality=90)


def time_prefetch(folder: str, rounds: int) -> dict:
    """Seconds per private step with the next microbatch collated inline and in the
    background (see the module docstring), and their ratio."""
    from dptrain.config import load
    from dptrain.trainer import RunConfig, Trainer

    config = Path(__file__).resolve().parents[1] / "configs" / "tiny_images.yaml"
    trainers = {}
    for where in ("inline", "background"):
        cfg = load(RunConfig, config, [
            "data.name=imagefolder", f"data.path={folder}", "data.image_size=64",
            "privacy.sample_rate=0.5", "privacy.steps=1000", "performance.microbatch_size=16",
            "performance.num_threads=1", "performance.decode_threads=1",
            f"performance.collate_prefetch={where}", "privacy.noise_multiplier=1.0",
            "privacy.epsilon=null"])
        trainers[where] = Trainer(cfg, None)
    times, errors = time_interleaved({w: t.private_step for w, t in trainers.items()},
                                     rounds=rounds)
    inline, background = median(times.wall.get("inline", [])), median(
        times.wall.get("background", []))
    print(f"private step: inline {inline:.3f} s, background {background:.3f} s"
          if inline and background else f"private step: {errors}")
    return {"step_seconds": {"inline": inline, "background": background},
            "prefetch_speedup": inline / background if inline and background else None,
            "prefetch_errors": errors}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--images", type=int, default=128)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--threads", default="1,2,4,8")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prefetch", action="store_true",
                    help="also time the private step with collate_prefetch inline/background")
    args = ap.parse_args(argv)
    counts = sorted({int(t) for t in args.threads.split(",")} | {1})
    with tempfile.TemporaryDirectory() as tmp:
        write_tree(Path(tmp), args.images)
        ds = build_data(DataConfig(name="imagefolder", path=tmp, image_size=args.size)).train
        idx = np.arange(len(ds))
        results: dict[int, torch.Tensor] = {}

        def step(threads: int):
            def run():
                ds.decode_threads = threads
                results[threads] = ds.collate(idx)["images"]
            return run

        times, errors = time_interleaved({f"threads={t}": step(t) for t in counts},
                                         rounds=args.rounds)
        same = all(torch.equal(results[t], results[1]) for t in results)
        prefetch = time_prefetch(tmp, args.rounds) if args.prefetch else None
    per_image = {t: median(times.wall.get(f"threads={t}", [])) for t in counts}
    base = per_image[1]
    print(f"{'threads':>8} {'ms / image':>11} {'speedup':>8}")
    for t in counts:
        s = per_image[t]
        if s is None:
            print(f"{t:>8} {'error: ' + errors.get(f'threads={t}', '?')}")
            continue
        print(f"{t:>8} {1e3 * s / len(idx):>11.2f} {base / s:>8.2f}")
    summary = {
        "images": len(idx), "size": args.size, "rounds": args.rounds,
        "seconds_per_image": {str(t): (s / len(idx) if s else None) for t, s in per_image.items()},
        "speedup": {str(t): (base / s if s and base else None) for t, s in per_image.items()},
        "same_tensor": same, "errors": errors, **(prefetch or {}),
        "machine": machine_description(),
        "load": load_average(), "commit": git_commit(), "date": now_utc(),
    }
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
