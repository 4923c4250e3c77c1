"""Where a step of bench/inner_momentum.py spends its time: torch.profiler over a few steps of
one or more of its variants (same model, batch and step functions), and how busy the device
was: the summed time of its kernels over the wall time of the steps.

    python bench/profile_step.py [--device cuda] [--variants nonprivate,k0,k4] [--steps 3]
        [--top 12] [--layers L --width D --heads H --vocab V --seq-len T --batch-size B]

Per variant it prints the operators with the most self CPU time and, on CUDA, the most self
device time, then one summary line; the last line printed is one JSON object:
{variant: {"wall_s_per_step", "device_busy_s_per_step", "device_busy_fraction",
"cpu_ops_s_per_step", "cpu_op_calls_per_step", "top_cpu": [[op, s/step, calls/step]...], "top_device": [...], "syncs":
[[calls/step, s/step, frames]...]}} (device entries on CUDA only; ``syncs``: where the host
waited for the device, by call stack).
A device_busy_fraction far below 1 means the GPU waits on the Python side (launch-bound); the
profiler's own overhead lengthens the wall time (about 2x for the K = 0 step on the H200), so
read the fraction as a lower bound.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import inner_momentum as im  # noqa: E402
from common import first_line  # noqa: E402


def profile_variant(variant: str, cfg, steps: int, top: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step = im.build_variant(variant, cfg)
        for _ in range(2):  # warm-up (and the history's set-up)
            step()
    cuda = cfg.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync()
    with stack_profile(acts) if cuda else profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        wall = (time.perf_counter() - t0) / steps
    ev = prof.key_averages()

    def dev_time(e) -> float:  # microseconds; the attribute's name changed across versions
        return float(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0)))

    cpu_rows = sorted(ev, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    out = {"wall_s_per_step": wall,
           "cpu_ops_s_per_step": sum(e.self_cpu_time_total for e in ev) / 1e6 / steps,
           "cpu_op_calls_per_step": sum(e.count for e in ev) / steps,
           "top_cpu": [[e.key, e.self_cpu_time_total / 1e6 / steps, e.count // steps]
                       for e in cpu_rows]}
    if cuda:
        # device-side events only (kernels, copies, memsets): an operator's self device time
        # is its kernels' time again (counted twice in the first H200 run, 2026-11-30)
        from torch.autograd import DeviceType

        on_device = [e for e in ev if e.device_type == DeviceType.CUDA]
        busy = sum(dev_time(e) for e in on_device) / 1e6 / steps
        dev_rows = sorted(on_device, key=dev_time, reverse=True)[:top]
        out.update(device_busy_s_per_step=busy, device_busy_fraction=busy / wall,
                   top_device=[[e.key, dev_time(e) / 1e6 / steps, e.count // steps]
                               for e in dev_rows],
                   syncs=sync_sites(prof, steps))
    return out


SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize")


def stack_profile(activities):
    """torch.profiler.profile recording Python stacks. ``with_stack`` alone records empty
    stacks in some releases (pytorch/pytorch#100253, #117515): the verbose experimental config
    makes them recorded."""
    from torch.profiler import profile

    config = getattr(getattr(torch._C, "_profiler", None), "_ExperimentalConfig", None)
    extra = {"experimental_config": config(verbose=True)} if config is not None else {}
    return profile(activities=activities, with_stack=True, **extra)


def sync_sites(prof, steps: int, depth: int = 6, keys: tuple[str, ...] = SYNCS) -> list:
    """Where the host waited for the device: [calls per step, CPU s per step, innermost dptrain
    or bench frames] per distinct call stack of the events named ``keys`` (by default the CUDA
    synchronisations; the harness's own synchronize after the steps is one of them). Needs a
    profile taken with ``with_stack=True``."""
    try:
        groups = prof.key_averages(group_by_stack_n=depth)
    except Exception as e:  # noqa: BLE001 - a profiler without stacks: report, don't fail
        return [["unavailable", 0, first_line(e)]]
    rows = []
    for e in groups:
        if e.key not in keys:
            continue
        frames = [f for f in (e.stack or []) if "dptrain" in f or "bench" in f] or e.stack
        rows.append([e.count / steps, e.self_cpu_time_total / 1e6 / steps, frames[:depth]])
    return sorted(rows, key=lambda r: -r[1])


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--variants", default="nonprivate,k0,k4")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--tiny", action="store_true", help="tiny model, for tests")
    for name in ("layers", "width", "heads", "vocab", "seq_len", "batch_size"):
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, default=None)
    a = ap.parse_args(argv)
    cfg = im.tiny_config() if a.tiny else im.BenchConfig()
    cfg.device = a.device
    for attr, field in (("layers", "num_layers"), ("width", "width"), ("heads", "num_heads"),
                        ("vocab", "vocab_size"), ("seq_len", "seq_len"),
                        ("batch_size", "batch_size")):
        if getattr(a, attr) is not None:
            setattr(cfg.gpt2, field, getattr(a, attr))
    variants = a.variants.split(",")
    cfg.ks = sorted({0} | {int(v[1:].split("_")[0]) for v in variants if v.startswith("k")})
    res = {}
    for v in variants:
        r = res[v] = profile_variant(v, cfg, a.steps, a.top)
        print(f"\n== {v}: {r['wall_s_per_step'] * 1e3:.1f} ms/step wall, CPU ops "
              f"{r['cpu_ops_s_per_step'] * 1e3:.1f} ms/step" + (
                  f", device busy {r['device_busy_s_per_step'] * 1e3:.1f} ms/step "
                  f"({r['device_busy_fraction']:.0%})" if "device_busy_s_per_step" in r else ""))
        for title, key in (("self CPU", "top_cpu"), ("self device", "top_device")):
            if key in r:
                print(f"  top {title} (ms/step, calls/step):")
                for op, s, n in r[key]:
                    print(f"    {s * 1e3:9.2f}  {n:6d}  {op[:70]}")
        for calls, s, frames in r.get("syncs", []):
            print(f"  sync: {calls:g}/step, {s * 1e3:.2f} ms/step waiting, at "
                  + " <- ".join(str(f) for f in frames))
        if a.device == "cuda":
            torch.cuda.empty_cache()
    res["config"] = {"gpt2": vars(cfg.gpt2), "device": cfg.device, "steps": a.steps}
    print(json.dumps(res), flush=True)
    return res


if __name__ == "__main__":
    main()
