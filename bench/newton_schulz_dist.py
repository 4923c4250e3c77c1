"""Distributed Newton–Schulz time per rank against world size (issue 5, Benchmarks).

    python bench/newton_schulz_dist.py [--width 256] [--layers 12] [--worlds 1,2,4]
                                       [--rounds 1] [--repeats 2] [--mp-wide]

Matrices: a GPT-2-like set, per layer the four Muon matrices in nn.Linear (out, in) layout,
(3w, w) attention in-projection, (w, w) attention out-projection, (4w, w) MLP up, (w, 4w) MLP
down; w = 768 is GPT-2 small (1.5 TFLOP of NS per step at 12 layers: use it on a real machine),
the default w = 256 (56 GFLOP) keeps a 2-core CPU run near 2 minutes. float32, 5 Muon steps.

Each world size runs in its own process group (gloo, ``dptrain.parallel.dist.spawn``, one torch
thread per rank); ``--repeats`` passes over the world sizes interleave them against outside
load. Every rank holds FSDP2 row shards of every matrix. Per round each variant runs once (order
rotated per round), between barriers; the time of a call is the slowest rank's (an all-reduce
MAX), which is what an optimizer step waits for. Reported: the median over all rounds, and the
ratio to world size 1 on the same matrices (single-process ``newton_schulz`` per matrix, no
communication); the target is about 1/W.

- owner: all 48 matrices; LPT owners, one all-to-all there, NS on whole matrices, one back.
- model_parallel: the 36 tall or square matrices, row-sharded, all-reduced w x w grams.
- mp_tall+owner: all 48, ``strategy="auto", max_owner_numel=0``: model-parallel for the tall or
  square ones, owner-compute for the wide ones (what auto does when nothing fits on one rank).
- model_parallel_all (``--mp-wide``): model-parallel forced on the wide (w, 4w) matrices too;
  their gram is 4w x 4w and A @ A is replicated on every rank, so it cannot scale (the cost
  model never picks it for wide matrices; "auto" picks owner for all 48 here).

On a machine with fewer cores than ranks the ranks share cores (this one has 2: world size 4
is oversubscribed, so its best possible ratio is 0.5, not 0.25); the output says so.
The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

from dptrain.parallel.dist import shard_bounds, spawn  # noqa: E402
from dptrain.parallel.newton_schulz import (  # noqa: E402
    distributed_newton_schulz,
    ns_flops,
    plan_newton_schulz,
)

STEPS = 5

# name -> (which matrices, distributed_newton_schulz options); "all" = the 48 matrices,
# "tall" = the tall or square ones ((3w,w), (w,w), (4w,w) of each layer).
VARIANTS: dict[str, tuple[str, dict]] = {
    "owner": ("all", {"strategy": "owner"}),
    # Pure model-parallel where it is meant to apply (w x w grams); ratio against single-process
    # NS of the same matrices.
    "model_parallel": ("tall", {"strategy": "model_parallel"}),
    # auto with no room on one rank: model-parallel for every tall/square matrix, owner for the
    # wide ones (the cost model never makes a wide matrix model-parallel).
    "mp_tall+owner": ("all", {"strategy": "auto", "max_owner_numel": 0}),
    # Model-parallel forced on the wide (w, 4w) matrices too: 4w x 4w grams replicated on every
    # rank; slow by design (--mp-wide only).
    "model_parallel_all": ("all", {"strategy": "model_parallel"}),
}
BASELINES = {"all": "single_process", "tall": "single_process_tall"}


def gpt2_shapes(width: int, layers: int) -> list[tuple[int, int]]:
    w = width
    return [(3 * w, w), (w, w), (4 * w, w), (w, 4 * w)] * layers


def _rank_bench(rank: int, world: int, width: int, layers: int, rounds: int,
                names: list[str]) -> dict:
    shapes = gpt2_shapes(width, layers)
    local = []
    for i, (m, n) in enumerate(shapes):
        g = torch.Generator().manual_seed(1000 + i)
        start, end = shard_bounds(m, rank, world)
        local.append(torch.randn(m, n, generator=g)[start:end].contiguous())
    subsets = {"all": list(range(len(shapes))),
               "tall": [i for i, (m, n) in enumerate(shapes) if m >= n]}
    if world == 1:  # no communication: single-process newton_schulz per matrix
        runs = {name: (subset, {}) for subset, name in BASELINES.items()}
    else:
        runs = {name: VARIANTS[name] for name in names}

    def call(name: str) -> tuple[float, float]:
        subset, kw = runs[name]
        ids = subsets[subset]
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        distributed_newton_schulz([local[i] for i in ids], [shapes[i] for i in ids],
                                  steps=STEPS, **kw)
        # Wall time, and CPU time of this process (all its threads: compute and gloo's
        # communication threads), both of the slowest rank.
        dt = torch.tensor([time.perf_counter() - t0, time.process_time() - c0],
                          dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        return float(dt[0]), float(dt[1])

    order = list(runs)
    for name in order:  # warm-up
        call(name)
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in order}
    for r in range(rounds):
        for name in order[r % len(order):] + order[:r % len(order)]:
            times[name].append(call(name))
    return times


def _load_average() -> str:
    try:
        return " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--worlds", default="1,2,4")
    ap.add_argument("--rounds", type=int, default=1, help="timed rounds per process group")
    ap.add_argument("--repeats", type=int, default=2,
                    help="passes over the world sizes (interleaves them against outside load)")
    ap.add_argument("--mp-wide", action="store_true",
                    help="also time model-parallel forced on the wide matrices (slow)")
    args = ap.parse_args()
    names = ["owner", "model_parallel", "mp_tall+owner"] + (
        ["model_parallel_all"] if args.mp_wide else [])
    worlds = [int(w) for w in args.worlds.split(",")]
    shapes = gpt2_shapes(args.width, args.layers)
    cores = os.cpu_count() or 1
    gflop = sum(ns_flops(m, n, STEPS) for m, n in shapes) / 1e9

    print(f"# distributed Newton-Schulz: {args.layers} layers x {{(3w,w), (w,w), (4w,w), (w,4w)}},"
          f" w = {args.width}: {len(shapes)} matrices, {gflop:.1f} GFLOP per single-process NS"
          f" ({STEPS} Muon steps, float32)")
    print(f"# machine: {platform.processor() or platform.machine()}, {cores} CPU cores, "
          f"torch {torch.__version__}, gloo, 1 torch thread per rank; load average before: "
          f"{_load_average()}")
    over = [w for w in worlds if w > cores]
    if over:
        print(f"# NOTE: world size(s) {over} exceed the {cores} cores: ranks share cores "
              f"(oversubscribed), so the best possible ratio there is {1 / cores:.2f}, not 1/W")

    samples: dict[int, dict[str, list[tuple[float, float]]]] = {w: {} for w in worlds}
    for rep in range(args.repeats):
        for w in worlds:
            t0 = time.perf_counter()
            res = spawn(_rank_bench, w, args.width, args.layers, args.rounds, names,
                        timeout=600)[0]
            for v, ts in res.items():
                samples[w].setdefault(v, []).extend(ts)
            print(f"# pass {rep + 1}, world {w}: {time.perf_counter() - t0:.1f} s", flush=True)
    wall = {w: {v: statistics.median(t[0] for t in ts) for v, ts in samples[w].items()}
            for w in worlds}
    cpu = {w: {v: statistics.median(t[1] for t in ts) for v, ts in samples[w].items()}
           for w in worlds}

    def base_name(variant: str) -> str:
        if variant in VARIANTS:
            return BASELINES[VARIANTS[variant][0]]
        return variant  # a world-1 baseline itself

    def ratio(table: dict, w: int, v: str) -> float | None:
        base = table.get(1, {}).get(base_name(v))
        return table[w][v] / base if base else None

    def fmt(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}"

    print(f"{'world':>5} {'variant':>19} {'wall_s':>7} {'wall/W1':>7} {'cpu_s':>7} {'cpu/W1':>7}"
          f" {'1/W':>5}  auto plan")
    for w in worlds:
        plan = plan_newton_schulz(shapes, w, steps=STEPS)
        auto = ", ".join(f"{plan.methods.count(k)} {k}" for k in sorted(set(plan.methods)))
        for v in wall[w]:
            print(f"{w:>5} {v:>19} {wall[w][v]:>7.3f} {fmt(ratio(wall, w, v)):>7} "
                  f"{cpu[w][v]:>7.3f} {fmt(ratio(cpu, w, v)):>7} {1 / w:>5.2f}  {auto}")
    print("# wall_s: median wall time of one call, slowest rank; cpu_s: median CPU time of the "
          "busiest rank (compute + gloo threads). On a shared machine the wall ratio depends on "
          "the CPU share the ranks get; cpu/W1 measures how the work divides.")
    if 1 in worlds and "single_process" in wall[1]:
        share = cpu[1]["single_process"] / wall[1]["single_process"]
        note = (": other processes share these cores; if they cap this run's share, more ranks "
                "cannot cut wall time, and cpu/W1 is the scaling to read") if share < 0.9 else ""
        print(f"# world 1 ran at {share:.0%} of one core (CPU time / wall time){note}")
    print(f"# load average after: {_load_average()}")

    def rnd(table: dict, fn) -> dict:
        return {str(w): {v: (None if fn(w, v) is None else round(fn(w, v), 4))
                         for v in table[w]} for w in worlds}

    summary = {
        "bench": "newton_schulz_dist",
        "width": args.width, "layers": args.layers, "matrices": len(shapes),
        "gflop_single_process": round(gflop, 2), "dtype": "float32", "steps": STEPS,
        "rounds": args.rounds, "repeats": args.repeats, "cpu_cores": cores,
        "oversubscribed_worlds": over, "load_average_after": _load_average(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "wall_seconds": rnd(wall, lambda w, v: wall[w][v]),
        "wall_ratio_to_world1": rnd(wall, lambda w, v: ratio(wall, w, v)),
        "cpu_seconds_busiest_rank": rnd(cpu, lambda w, v: cpu[w][v]),
        "cpu_ratio_to_world1": rnd(cpu, lambda w, v: ratio(cpu, w, v)),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
