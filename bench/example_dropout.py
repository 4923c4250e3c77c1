"""Cost of the per-example dropout masks (dptrain/models/dropout.py), this tree against a
revision and against torch's own dropout.

    python bench/example_dropout.py [--base 2277c0a] [--rounds 15]

A forward (no grad) of GPT-2 with 4 layers, width 256, 4 heads, vocabulary 8,192, B = 32,
T = 64, eager attention, every dropout at 0.1, in train mode: ``torch`` (torch's RNG, no
mode), ``this`` (``ExampleDropout`` of this tree: every torch call of the forward goes through
its ``__torch_function__``) and ``base`` (``ExampleDropout`` of ``--base``), interleaved
(order rotated per round), medians of the rounds. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import (git_commit, load_average, machine_description, module_at,  # noqa: E402
                    now_utc, ratio_of_medians, time_interleaved)

MODULE = "dptrain/models/dropout.py"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="2277c0a", help="git revision to compare against")
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    from transformers import GPT2Config, GPT2LMHeadModel

    import dptrain.models.dropout as this

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(
        n_layer=4, n_embd=256, n_head=4, vocab_size=8192, n_positions=64, resid_pdrop=0.1,
        embd_pdrop=0.1, attn_pdrop=0.1, attn_implementation="eager")).train()
    x = torch.randint(0, 8192, (32, 64))
    indices = list(range(32))

    def forward(module=None):
        def run():
            with torch.no_grad():
                if module is None:
                    return model(x)
                with module.ExampleDropout(0, 0, indices):
                    return model(x)
        return run

    with tempfile.TemporaryDirectory() as tmp:
        base = module_at(args.base, MODULE, "dropout_base", tmp)
        steps = {"torch": forward(), "this": forward(this), "base": forward(base)}
        times, errors = time_interleaved(steps, rounds=args.rounds, warmup=2)
    if errors:
        raise SystemExit(f"bench/example_dropout.py: {errors}")
    med = {k: statistics.median(v) for k, v in times.wall.items()}
    result = {
        "bench": "example_dropout", "date": now_utc(), "commit": git_commit(),
        "base": args.base, "machine": machine_description(), "load": load_average(),
        "rounds": args.rounds, "ms": {k: round(v * 1e3, 2) for k, v in med.items()},
        "this_over_base": ratio_of_medians(times.wall["this"], times.wall["base"]),
        "this_over_torch": ratio_of_medians(times.wall["this"], times.wall["torch"]),
        "this_over_base_cpu": ratio_of_medians(times.cpu["this"], times.cpu["base"]),
    }
    for k, v in result["ms"].items():
        print(f"{k:>6}: {v:8.2f} ms per forward")
    print(f"this/base {result['this_over_base']:.3f} (CPU time "
          f"{result['this_over_base_cpu']:.3f}), this/torch {result['this_over_torch']:.3f}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
