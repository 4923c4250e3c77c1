"""Noise draw per release and per rank for replicated ranks (``performance.sharding=none``).

    python bench/noise_draw.py [--model gpt2|gpt2-medium] [--worlds 1,2,4,8] [--rounds 3]
                               [--threads 1] [--secure]

Every release draws sigma*C*Z for every trainable coordinate (dptrain.privacy.noise: numpy
Philox blocks of 65,536 values, drawn on the CPU). With replicated ranks, each rank used to draw
all of Z; since ed004a3 the ranks split it (``block_share``: whole blocks, rotated by parameter)
and the all-reduce of the clipped sums adds the shares. This measures, on the parameter shapes of
GPT-2 small (124 M) or medium (355 M), the seconds one rank spends drawing noise per release:

- ``all``: the whole of Z (every rank, before);
- ``share W``: the slowest rank's share for W ranks (after), each rank's share drawn in turn.

The ranks of one node share its cores, so the node's CPU seconds per release are W x ``all``
before and about ``all`` after. Interleaved rounds (bench/common.py); the last line printed is
one JSON object with the medians and ``all_over_share`` per W.

``--secure`` adds secure mode's streams to the same rounds: ``all, secure`` (the whole of Z from
ChaCha20, four normals per value) and the Poisson sample of an ImageNet-sized training set
(1,281,167 examples, q = 1024/N) with the default and the secure function; the JSON gets
``secure_over_default`` for both.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import git_commit, load_average, machine_description, median, now_utc, time_interleaved  # noqa: E402

from dptrain.privacy.noise import block_share, gaussian_noise  # noqa: E402

SHAPES = {"gpt2": (12, 768, 50257, 1024), "gpt2-medium": (24, 1024, 50257, 1024)}


def gpt2_numels(layers: int, d: int, vocab: int, positions: int) -> list[tuple[str, int]]:
    """(name, numel) of GPT-2's trainable tensors (tied head), in named_parameters order."""
    out = [("transformer.wte.weight", vocab * d), ("transformer.wpe.weight", positions * d)]
    for i in range(layers):
        h = f"transformer.h.{i}."
        out += [(h + "ln_1.weight", d), (h + "ln_1.bias", d),
                (h + "attn.c_attn.weight", d * 3 * d), (h + "attn.c_attn.bias", 3 * d),
                (h + "attn.c_proj.weight", d * d), (h + "attn.c_proj.bias", d),
                (h + "ln_2.weight", d), (h + "ln_2.bias", d),
                (h + "mlp.c_fc.weight", d * 4 * d), (h + "mlp.c_fc.bias", 4 * d),
                (h + "mlp.c_proj.weight", 4 * d * d), (h + "mlp.c_proj.bias", d)]
    return out + [("transformer.ln_f.weight", d), ("transformer.ln_f.bias", d)]


def shares(params: list[tuple[str, int]], rank: int, world: int):
    """(name, numel, lo, hi) of each tensor's noise that ``rank`` draws, as the trainer splits it."""
    for index, (name, numel) in enumerate(params):
        lo, hi = block_share(numel, index, rank, world) if world > 1 else (0, numel)
        yield name, numel, lo, hi


def draw(params: list[tuple[str, int]], rank: int, world: int, secure: bool = False) -> int:
    return sum(gaussian_noise(1234, 7, name, numel, lo, hi, secure=secure).numel()
               for name, numel, lo, hi in shares(params, rank, world))


IMAGENET = 1_281_167


def slowest_rank(params, world: int) -> float:
    import time

    times = []
    for rank in range(world):
        t0 = time.perf_counter()
        draw(params, rank, world)
        times.append(time.perf_counter() - t0)
    return max(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(SHAPES), default="gpt2")
    ap.add_argument("--worlds", default="2,4,8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--secure", action="store_true",
                    help="also time secure mode's ChaCha20 noise and sampling")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    params = gpt2_numels(*SHAPES[args.model])
    total = sum(n for _, n in params)
    worlds = [int(w) for w in args.worlds.split(",")]
    # each rank's shares, and every coordinate once in all (what the trainer relies on)
    for w in worlds:
        assert sum(hi - lo for r in range(w) for _, _, lo, hi in shares(params, r, w)) == total
    share_times: dict[int, list[float]] = {w: [] for w in worlds}

    def share_step(w):
        def run():
            share_times[w].append(slowest_rank(params, w))
        return run

    steps = {"all": lambda: draw(params, 0, 1), **{f"share {w}": share_step(w) for w in worlds}}
    if args.secure:
        from dptrain.privacy.sampling import poisson_sample

        q = 1024 / IMAGENET
        steps.update({"all, secure": lambda: draw(params, 0, 1, secure=True),
                      "sample": lambda: poisson_sample(1234, 7, IMAGENET, q),
                      "sample, secure": lambda: poisson_sample(1234, 7, IMAGENET, q,
                                                               secure=True)})
    print(f"{args.model}: {total / 1e6:.1f} M coordinates, {len(params)} tensors; "
          f"{args.threads} thread(s); {machine_description()}; load {load_average()}", flush=True)
    times, errors = time_interleaved(steps, rounds=args.rounds, warmup=1)
    if errors:
        raise SystemExit(f"failed: {errors}")
    t_all = median(times.wall["all"])
    result = {"model": args.model, "coordinates": total, "threads": args.threads,
              "all_s": t_all, "commit": git_commit(), "date": now_utc(), "share_s": {},
              "all_over_share": {}}
    print("| W | s per release per rank, before (all) | after (slowest share) | before / after |")
    print("|---|---|---|---|")
    for w in worlds:
        t_share = median(share_times[w][-args.rounds:])
        result["share_s"][w] = t_share
        result["all_over_share"][w] = t_all / t_share
        print(f"| {w} | {t_all:.3f} | {t_share:.3f} | {t_all / t_share:.2f} |")
    if args.secure:
        result["secure_over_default"] = {}
        print("\n| draw | default s | secure s | secure / default |")
        print("|---|---|---|---|")
        for label, key in (("all of Z", "all"), (f"Poisson sample, N = {IMAGENET:,}", "sample")):
            t0, t1 = median(times.wall[key]), median(times.wall[f"{key}, secure"])
            result["secure_over_default"][key] = t1 / t0
            print(f"| {label} | {t0:.4f} | {t1:.4f} | {t1 / t0:.2f} |")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
