"""Cost of one use of the clipping query's IEEE float32 context, this tree against a revision.

    python bench/ieee_context.py [--base 49d6469] [--rounds 7]

``dptrain.clipping.precision.ieee_float32`` runs around every forward/backward of the private
query (3 to 7 uses a step). This loads the module of this tree and the one of ``--base`` (``git
show``) into one process and times ``with ieee_float32(): pass`` of each, interleaved: each
round takes, for each variant, the best of 3 x 2,000 uses; the medians over rounds are printed,
and the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import tempfile
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import git_commit, machine_description, module_at, now_utc  # noqa: E402

MODULE = "dptrain/clipping/precision.py"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="49d6469", help="git revision to compare against")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        variants = {f"base ({args.base})": module_at(args.base, MODULE, "precision_base", tmp),
                    "this tree": importlib.import_module("dptrain.clipping.precision")}
        times: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(args.rounds):
            for label, module in variants.items():
                def use(m=module):
                    with m.ieee_float32():
                        pass
                times[label].append(min(timeit.repeat(use, number=2000, repeat=3)) / 2000 * 1e6)
    print(f"{machine_description()}")
    print("| `ieee_float32()`, one use | us |\n|---|---|")
    medians = {k: statistics.median(v) for k, v in times.items()}
    for label, us in medians.items():
        print(f"| {label} | {us:.2f} |")
    base, tree = medians.values()
    print(json.dumps({"us_per_use": medians, "tree_minus_base_us": tree - base,
                      "commit": git_commit(), "date": now_utc()}))


if __name__ == "__main__":
    main()
