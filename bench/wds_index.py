"""Start-up index of webdataset shards, with and without ``data.index_cache_dir``.

    python bench/wds_index.py [--samples 128000] [--shards 128] [--rounds 3] [--base REV]

A run on webdataset shards reads every tar header at start-up to learn where each image is
(``dptrain/data/wds.py``, ``index_shards``): Python's tarfile, about 50 us per sample, so a
minute per rank for ImageNet's 1,281,167 images, paid again at every resume. This writes
``--samples`` tiny JPEG samples (8 x 8, ~160 bytes, plus a label) into ``--shards`` shards in a
temporary folder (the header count is what matters, not the image sizes), then times
``index_shards`` without a cache, with an empty cache (the scan plus writing the entries) and
with a filled one, interleaved (warm page cache throughout: a cold or network file system only
widens the gap). Every variant must give the same index. The last line printed is one JSON
object with the median seconds of each and ``speedup`` (no cache over a filled one).

``--base REV`` instead times the scan (no cache) of ``dptrain/data/wds.py`` at git revision REV
against this tree's, interleaved in one process, this tree's with the start-up work that
``build_data`` adds to it (the shards' layouts and the copy check, ``find_copy``): the last line
then holds ``tree_over_base``.
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import statistics
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def write_shards(root: Path, samples: int, shards: int) -> list[Path]:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.full((8, 8), 128, np.uint8)).save(buf, format="JPEG")
    jpeg = buf.getvalue()
    paths, per = [], -(-samples // shards)
    for s in range(shards):
        path = root / f"train-{s:06d}.tar"
        with tarfile.open(path, "w") as tf:
            for j in range(s * per, min(samples, (s + 1) * per)):
                for ext, data in (("jpg", jpeg), ("cls", str(j % 1000).encode())):
                    info = tarfile.TarInfo(f"n{j:08d}.{ext}")
                    info.size = len(data)
                    tf.addfile(info, io.BytesIO(data))
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=128_000)
    ap.add_argument("--shards", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--base", default=None, help="git revision to compare the scan against")
    a = ap.parse_args(argv)
    if a.base is not None:
        return compare(a)
    from dptrain.data.wds import index_shards

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        t0 = time.perf_counter()
        shards = write_shards(root, a.samples, a.shards)
        print(f"wrote {a.samples} samples in {a.shards} shards in "
              f"{time.perf_counter() - t0:.1f} s", flush=True)
        cache = root / "cache"
        reference = index_shards(shards)
        times: dict[str, list[float]] = {"no cache": [], "empty cache": [], "filled cache": []}
        for r in range(a.rounds):
            for name in times:
                if name == "empty cache":
                    shutil.rmtree(cache, ignore_errors=True)
                t = time.perf_counter()
                index = index_shards(shards, None if name == "no cache" else cache)
                times[name].append(time.perf_counter() - t)
                assert all(np.array_equal(index[k], reference[k]) for k in reference), name
            print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items()),
                  flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(json.dumps({"samples": a.samples, "shards": a.shards, "rounds": a.rounds,
                      "seconds": {k: round(v, 4) for k, v in med.items()},
                      "us_per_sample": {k: round(1e6 * v / a.samples, 2) for k, v in med.items()},
                      "speedup": round(med["no cache"] / med["filled cache"], 1)}))


def compare(a) -> None:
    from common import module_at

    from dptrain.data import wds

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        shards = write_shards(root, a.samples, a.shards)
        base = module_at(a.base, "dptrain/data/wds.py", "wds_base", tmp)

        def tree_start_up():
            index = wds.index_shards(shards)
            assert wds.find_copy(shards, wds._layouts(index, len(shards))) is None
            return index

        variants = {f"base ({a.base})": lambda: base.index_shards(shards),
                    "this tree": tree_start_up}
        times: dict[str, list[float]] = {k: [] for k in variants}
        indices = {}
        for r in range(a.rounds):
            for name, run in variants.items():
                t = time.perf_counter()
                indices[name] = run()
                times[name].append(time.perf_counter() - t)
            print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items()),
                  flush=True)
    first, second = indices.values()
    same = all(np.array_equal(first[k], second[k]) for k in first)
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = med["this tree"] / med[f"base ({a.base})"]
    print(f"this tree / base: {ratio:.3f}; the same index: {same}")
    print(json.dumps({"samples": a.samples, "shards": a.shards, "rounds": a.rounds,
                      "seconds": {k: round(v, 4) for k, v in med.items()},
                      "tree_over_base": round(ratio, 3), "same_index": same}))


if __name__ == "__main__":
    main()
