"""One private step of DP-Muon on 1, 2 and 4 CPU ranks, FSDP2-sharded (issue 5, Benchmarks).

    python bench/dist_step.py [--worlds 1,2,4] [--layers 4] [--width 64] [--train-size 4096]
                              [--sample-rate 0.125] [--microbatch 32] [--steps 3] [--repeats 2]
                              [--quick]

The run: configs/tiny.yaml's GPT-2 (synthetic Markov text, T = 16, vocabulary 33) made a little
bigger (default 4 layers, width 64, 2 heads) with a bigger logical batch (default N = 4,096 at
q = 0.125: about 512 examples per release), microbatches of 32, DP-Muon on the matrices + AdamW
on the rest, ``performance.sharding=fsdp``. The Poisson samples are the same on every world size
(the same seed), so every world size does the same total work on the same logical batches; each
rank takes its share (about 512 / W examples, in microbatches of 32).

Each world size runs in its own gloo process group (``dptrain.parallel.dist.spawn``, one torch
thread per rank); ``--repeats`` passes over the world sizes interleave them against outside
load. Per step, between barriers, every rank measures

- the whole ``Trainer.private_step()`` (Poisson share, microbatches, clipping, reduce-scatter
  of the clipped sums, per-shard noise, optimizer);
- ``optimizer.step()`` alone (DP-Muon with distributed Newton–Schulz on the row shards, plus
  AdamW on the non-matrix parameters);
- the Newton–Schulz calls inside it (``distributed_newton_schulz`` under sharding, including
  its two all-to-alls; ``newton_schulz`` per matrix on one rank);
- the process CPU time of the step;
- after the steps, the stop agreement ``Trainer.run()`` adds before every step (one scalar
  all-reduce with several ranks: a SIGTERM seen by any rank stops all after the same step).

After the steps, the final parameters of each world size are compared with world size 1's: the
largest relative difference ``|a - b| / |b|`` over the parameter tensors (the same run, up to
float summation order; ``tests/test_distributed.py`` asserts it is at most 1e-5).

Reported per world size: medians over all timed steps of the slowest rank's times (an
all-reduce MAX: what a step waits for), speed-up T1/TW and scaling efficiency T1/(W*TW), the
optimizer's share of the step, and NS seconds per rank. Isolated NS scaling on bigger matrices:
bench/newton_schulz_dist.py (BENCHMARKS.md, "Distributed Newton–Schulz").

On a machine with fewer cores than ranks the ranks share cores: on a 2-core machine W = 4 is
oversubscribed (its best possible speed-up is 2, not 4), and other jobs on the same cores make
wall times noisy; the CPU-time columns are the steadier ones there. The last line printed is one
JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)

TINY = os.path.join(ROOT, "configs", "tiny.yaml")


def overrides(a: argparse.Namespace) -> list[str]:
    return [
        f"model.n_layer={a.layers}", f"model.n_embd={a.width}", f"model.n_head={a.heads}",
        f"data.synthetic_train_size={a.train_size}", "data.synthetic_test_size=16",
        f"privacy.sample_rate={a.sample_rate}", f"privacy.steps={a.steps + 1}",
        "privacy.noise_multiplier=1.0", "privacy.epsilon=null", "privacy.accountant=rdp",
        f"performance.microbatch_size={a.microbatch}", "performance.sharding=fsdp",
        "performance.num_threads=1", "train.checkpoint_every=0", "train.progress=false",
    ]


def _rank(rank: int, world: int, overrides_: list[str]) -> dict:
    import torch
    import torch.distributed as dist

    import dptrain.optim.muon as muon_mod
    import dptrain.parallel.newton_schulz as pns
    from dptrain.config import load
    from dptrain.trainer import RunConfig, Trainer

    acc = {"opt": 0.0, "ns": 0.0}

    def timed(fn, key):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                acc[key] += time.perf_counter() - t0
        return wrapper

    # NS: distributed (sharded parameters) or single-process per matrix (world size 1). Muon
    # looks both names up at call time, so wrapping the module attributes times every call.
    pns.distributed_newton_schulz = timed(pns.distributed_newton_schulz, "ns")
    muon_mod.newton_schulz = timed(muon_mod.newton_schulz, "ns")

    t = Trainer(load(RunConfig, TINY, overrides_))
    t.optimizer.step = timed(t.optimizer.step, "opt")  # this instance only
    rows = []
    while t.step < t.plan.steps:
        n = len(t.sample(t.step))
        dist.barrier()
        acc.update(opt=0.0, ns=0.0)
        t0, c0 = time.perf_counter(), time.process_time()
        t.private_step()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        mx = torch.tensor([wall, cpu, acc["opt"], acc["ns"]], dtype=torch.float64)
        dist.all_reduce(mx, op=dist.ReduceOp.MAX)
        sm = torch.tensor([acc["ns"], acc["opt"]], dtype=torch.float64)
        dist.all_reduce(sm)
        rows.append({"examples": n, "wall": float(mx[0]), "cpu": float(mx[1]),
                     "opt": float(mx[2]), "ns_max": float(mx[3]),
                     "ns_mean": float(sm[0]) / world, "opt_mean": float(sm[1]) / world})
    # the stop agreement Trainer.run() adds before every step (SIGTERM handling): one scalar
    # all-reduce with several ranks; slowest rank's median over 50 calls
    checks = []
    for _ in range(50):
        dist.barrier()
        t0 = time.perf_counter()
        t._stop_agreed()
        mx = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(mx, op=dist.ReduceOp.MAX)
        checks.append(float(mx[0]))
    params = sum(p.numel() for _, p in t.named_params)  # a DTensor's numel is the global one
    state = t.full_state_dict()  # (collective: every rank; the gathered state is rank 0's)
    final = {k: v.detach().double().clone() for k, v in state.items()} if rank == 0 else {}
    return {"steps": rows[1:], "params": int(params), "warmup": rows[:1],  # step 0: warm-up
            "stop_check": statistics.median(checks), "final": final}


def largest_relative_difference(a: dict, b: dict) -> float:
    """max over the tensors both states hold of ``|a - b| / |b|`` (Frobenius norms)."""
    common = sorted(set(a) & set(b))
    if not common:
        raise ValueError("the two states share no tensor")
    return max(float((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-12)) for k in common)


def summarize(samples: dict[int, list[dict]]) -> dict:
    med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    out = {}
    for w, rows in sorted(samples.items()):
        out[w] = {k: med([r[k] for r in rows])
                  for k in ("wall", "cpu", "opt", "ns_max", "ns_mean", "opt_mean")}
        out[w]["examples_per_step"] = med([r["examples"] for r in rows])
        out[w]["samples"] = len(rows)
    if 1 in out:
        base = out[1]
        for w, row in out.items():
            row["speedup_wall"] = base["wall"] / row["wall"]
            row["efficiency_wall"] = base["wall"] / (w * row["wall"])
            row["cpu_busiest_over_w1"] = row["cpu"] / base["cpu"]
            row["ns_over_w1"] = row["ns_max"] / base["ns_max"] if base["ns_max"] else None
    for row in out.values():
        row["opt_fraction"] = row["opt"] / row["wall"]
        row["ns_fraction"] = row["ns_max"] / row["wall"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="1,2,4")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--train-size", type=int, default=4096)
    ap.add_argument("--sample-rate", type=float, default=0.125)
    ap.add_argument("--microbatch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per process group "
                                                          "(after one warm-up step)")
    ap.add_argument("--repeats", type=int, default=2, help="passes over the world sizes")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 2 layers, width 32, N = 512, worlds 1,2, 1 step, 1 pass")
    a = ap.parse_args()
    if a.quick:
        a.layers, a.width, a.train_size, a.steps, a.repeats = 2, 32, 512, 1, 1
        a.worlds = "1,2"
    from common import git_commit, load_average, machine_description, now_utc
    from dptrain.parallel.dist import spawn

    worlds = [int(w) for w in a.worlds.split(",")]
    ov = overrides(a)
    load_start, t_start = load_average(), time.time()
    samples: dict[int, list[dict]] = {w: [] for w in worlds}
    checks: dict[int, list[float]] = {w: [] for w in worlds}
    params, finals = None, {}
    for rep in range(a.repeats):
        order = worlds if rep % 2 == 0 else worlds[::-1]
        for w in order:
            res = spawn(_rank, w, ov, num_threads=1, timeout=1800)[0]
            samples[w] += res["steps"]
            checks[w].append(res["stop_check"])
            params, finals[w] = res["params"], res["final"]
            print(f"pass {rep + 1}, world {w}: step "
                  + ", ".join(f"{r['wall']:.2f}" for r in res["steps"]) + " s", flush=True)
    summary = summarize(samples)
    for w, row in summary.items():
        row["stop_check_s"] = statistics.median(checks[w])
        row["stop_check_over_step"] = row["stop_check_s"] / row["wall"]
        if 1 in finals:
            row["final_rel_diff_vs_w1"] = largest_relative_difference(finals[w], finals[1])
    cores = os.cpu_count() or 1
    print(f"\nGPT-2 {a.layers} layers, width {a.width}, {params} parameters; logical batch "
          f"~{a.sample_rate * a.train_size:.0f} (N = {a.train_size}, q = {a.sample_rate}), "
          f"microbatch {a.microbatch}; DP-Muon + AdamW, sharding fsdp; gloo, 1 thread per rank")
    print("| world | step s | speed-up | efficiency | CPU s busiest | CPU / W1 | opt.step s "
          "| opt / step | NS s per rank (max / mean) | NS / W1 |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for w, r in summary.items():
        over = " (oversubscribed)" if w > cores else ""
        print(f"| {w}{over} | {r['wall']:.3f} | {r.get('speedup_wall', 1):.2f} | "
              f"{r.get('efficiency_wall', 1):.2f} | {r['cpu']:.3f} | "
              f"{r.get('cpu_busiest_over_w1', 1):.2f} | {r['opt']:.3f} | "
              f"{100 * r['opt_fraction']:.1f}% | {r['ns_max']:.3f} / {r['ns_mean']:.3f} | "
              f"{(r.get('ns_over_w1') or 0):.2f} |")
    print("stop agreement before each step (Trainer.run, SIGTERM handling), slowest rank: "
          + ", ".join(f"world {w}: {r['stop_check_s'] * 1e6:.0f} us = "
                      f"{100 * r['stop_check_over_step']:.3f}% of the step"
                      for w, r in summary.items()))
    if 1 in finals:
        print("final parameters against world 1's, largest relative difference over the "
              "tensors: " + ", ".join(f"world {w}: {r['final_rel_diff_vs_w1']:.2g}"
                                     for w, r in summary.items() if w != 1))
    if max(worlds) > cores:
        print(f"note: {cores} CPU cores; world sizes above {cores} share cores (oversubscribed)")
    print(json.dumps({"config": vars(a), "params": params, "summary": summary,
                      "machine": machine_description(), "cores": cores,
                      "load_start": load_start, "load_end": load_average(),
                      "elapsed_s": time.time() - t_start, "date": now_utc(),
                      "commit": git_commit()}))


if __name__ == "__main__":
    main()
