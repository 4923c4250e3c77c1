"""Shared helpers for dptrain's benchmarks: interleaved timing, peak memory in a fresh process,
and a description of the machine a number came from.

Timing on a shared machine: every variant runs once per *round*, in a rotated order, so that
slow phases (other processes on the same cores) hit all variants alike; an absolute time is the
median over rounds and a ratio is a ratio of such medians. Process CPU time is recorded next to
wall time: on a loaded machine it is the steadier of the two.

Peak memory: ``measure_peak_in_subprocess`` re-runs the calling script with ``--peak-child``
arguments in a fresh interpreter; the child builds one variant, takes a baseline, runs a few
steps and prints one ``PEAK {...}`` line (``child_peak``). On CPU the peak is the process's
high-water resident set (ru_maxrss; read as VmHWM on Linux, reset after the build) minus the
resident set after the build; on CUDA it is ``torch.cuda.max_memory_allocated`` minus the
allocation after the build.
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch

StepFn = Callable[[], object]


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def first_line(err: BaseException, limit: int = 200) -> str:
    """``Type: message`` of an exception on one line (for a JSON field)."""
    msg = str(err).strip().splitlines()
    text = f"{type(err).__name__}: {msg[0] if msg else ''}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass
class Timings:
    """Per-round seconds of each variant: ``wall`` (perf_counter) and ``cpu`` (process CPU
    time, all threads: less sensitive to other processes on a shared machine, but it counts
    the spinning of idle worker threads)."""

    wall: dict[str, list[float]]
    cpu: dict[str, list[float]]


def time_interleaved(steps: dict[str, StepFn], *, rounds: int, warmup: int = 1,
                     device: str = "cpu") -> tuple[Timings, dict[str, str]]:
    """Seconds per call of each step function, interleaved.

    Each variant is warmed up ``warmup`` times (a failure there, or later, is recorded as the
    variant's error and the variant is dropped); then ``rounds`` rounds each call every live
    variant once, the order rotated by one per round. Returns (times, errors): times.wall[name]
    and times.cpu[name] are the per-round seconds (aligned across variants, rounds in order);
    errors[name] is the one-line error of a variant that failed.
    """
    errors: dict[str, str] = {}
    live = list(steps)
    for name in list(live):
        try:
            for _ in range(warmup):
                steps[name]()
            _sync(device)
        except Exception as e:  # a failing variant is a result, not a crash
            errors[name] = first_line(e)
            live.remove(name)
    times: dict[str, list[float]] = {n: [] for n in live}
    cpu: dict[str, list[float]] = {n: [] for n in live}
    for r in range(rounds):
        order = live[r % len(live):] + live[: r % len(live)] if live else []
        for name in order:
            if name in errors:
                continue
            try:
                _sync(device)
                t0, c0 = time.perf_counter(), time.process_time()
                steps[name]()
                _sync(device)
                times[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
            except Exception as e:
                errors[name] = first_line(e)
    for name in errors:
        times.pop(name, None)
        cpu.pop(name, None)
    return Timings(times, cpu), errors


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def ratio_of_medians(num: list[float] | None, den: list[float] | None) -> float | None:
    """median(num) / median(den), both measured in the same interleaved rounds.

    Ratios of medians (not medians of per-round ratios) so that a table's ratios compose
    (a/c = a/b * b/c); interleaving already exposes every variant to the same load."""
    if not num or not den:
        return None
    return statistics.median(num) / statistics.median(den)


def load_average() -> str:
    """'1-min, 5-min, 15-min' load average (the machine may be shared), or '-'."""
    try:
        return ", ".join(f"{x:.1f}" for x in os.getloadavg())
    except (OSError, AttributeError):
        return "-"


def model_variants_bench(doc: str, argv: list[str] | None, variants, summarize, *, make_config,
                    models: str, rounds: int, extra_args=None) -> dict:
    """The main of a benchmark that times a few variants of one step per model (interleaved
    rounds), with the options --rounds, --threads, --device, --models, --tiny (and
    ``extra_args(parser)``'s). For each model, ``variants(kind, cfg, args)`` gives the step
    functions; ``summarize(times, extra)`` (with ``extra`` variants' second return value, if a
    pair) the model's entry and one line for stderr. Prints, and returns, one JSON object as
    the last line: machine, commit, date, options, each model's entry, load averages."""
    import argparse

    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--models", default=models, help="comma-separated: gpt2,nfresnet")
    ap.add_argument("--tiny", action="store_true", help="tiny models, for tests")
    if extra_args is not None:
        extra_args(ap)
    args = ap.parse_args(argv)
    cfg = make_config(args.tiny)
    cfg.device = args.device
    if args.threads:
        torch.set_num_threads(args.threads)
    load_start = load_average()
    t0 = time.perf_counter()
    out: dict = {"machine": machine_description(args.device), "git_commit": git_commit(),
                 "date": now_utc(), "rounds": args.rounds, "threads": torch.get_num_threads(),
                 **{k: v for k, v in vars(args).items()
                    if k not in ("rounds", "threads", "device", "models", "tiny")}}
    name = os.path.splitext(os.path.basename(sys.argv[0]))[0]
    for kind in (m for m in args.models.split(",") if m):
        steps = variants(kind, cfg, args)
        steps, extra = steps if isinstance(steps, tuple) else (steps, None)
        times, errors = time_interleaved(steps, rounds=args.rounds, warmup=1, device=args.device)
        if errors:
            raise SystemExit(f"{name}: {kind}: {errors}")
        out[kind], line = summarize(times, extra)
        print(f"{kind}: {line}", file=sys.stderr)
    out["load_average"] = {"start": load_start, "end": load_average()}
    out["elapsed_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(out), flush=True)
    return out


# ---------------------------------------------------------------------------------------------
# peak memory


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _peak_rss_bytes() -> int:
    """High-water resident set of this process. On Linux VmHWM of /proc/self/status: the same
    counter as ru_maxrss, but ru_maxrss also keeps the PARENT's high-water mark when the child
    was started by vfork/posix_spawn (as subprocess does), which VmHWM does not."""
    hwm = _status_kib("VmHWM")
    if hwm is not None:
        return hwm * 1024
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # macOS: bytes, Linux: KiB


def _reset_peak_rss() -> int:
    """Reset the high-water mark to the current RSS where the kernel allows it (Linux:
    ``echo 5 > /proc/self/clear_refs``) and return the baseline to subtract: the current RSS
    after a reset, else the high-water mark so far."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        rss = _status_kib("VmRSS")
        if rss is not None:
            return rss * 1024
    except OSError:
        pass
    return _peak_rss_bytes()


def child_peak(build: Callable[[], StepFn], *, device: str = "cpu", steps: int = 2) -> dict:
    """In a fresh process: build a variant (model, engine or wrapper, batch), take the baseline,
    run ``steps`` steps; return {"peak_bytes": peak - baseline, "baseline_bytes": baseline} or
    {"error": ...}. CPU: resident set (see ``_peak_rss_bytes``); CUDA: allocated memory."""
    try:
        step = build()
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        else:
            base = _reset_peak_rss()
        for _ in range(steps):
            step()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated()
        else:
            peak = _peak_rss_bytes()
        return {"peak_bytes": peak - base, "baseline_bytes": base}
    except Exception as e:
        return {"error": first_line(e)}


def emit_child_result(result: dict) -> None:
    print("PEAK " + json.dumps(result), flush=True)


def measure_peak_in_subprocess(script: str, child_args: list[str], *,
                               timeout_s: float = 300) -> dict:
    """Run ``python script --peak-child *child_args`` in a fresh interpreter and return the dict
    the child printed with :func:`emit_child_result` (or {"error": ...})."""
    cmd = [sys.executable, script, "--peak-child", *child_args]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"timeout after {timeout_s:.0f} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("PEAK "):
            return json.loads(line[5:])
    tail = (proc.stderr or proc.stdout).strip().splitlines()
    return {"error": f"child exited {proc.returncode}: {tail[-1] if tail else ''}"}


class LiveTensorPeak:
    """Context manager: the high-water mark of bytes held by tensor storages that operators
    create inside it (on CPU, the counterpart of CUDA's allocated-memory peak, without the
    allocator slack a resident set includes). Storages that exist on entry (weights, gradients
    of an earlier step) are the baseline and not counted. Every operator that goes through
    torch's dispatcher is seen, backward included. On exit: ``peak_bytes`` and ``top``, the
    largest storages live at the peak as (bytes, "operator shape")."""

    def __init__(self, top: int = 8):
        self.ntop = top
        self.peak_bytes = 0
        self.top: list[tuple[int, str]] = []

    def __enter__(self):
        import weakref

        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten

        import warnings

        with warnings.catch_warnings():  # isinstance() on some torch objects warns
            warnings.simplefilter("ignore")
            pre = {o.untyped_storage().data_ptr() for o in gc.get_objects()
                   if isinstance(o, torch.Tensor) and o.device.type != "meta"}
        live: dict[int, tuple[int, str]] = {}
        cur = [0]
        tracker = self

        def release(ptr: int, n: int) -> None:
            if live.pop(ptr, None) is not None:
                cur[0] -= n

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in tree_flatten(out)[0]:
                    if not isinstance(t, torch.Tensor):
                        continue
                    st = t.untyped_storage()
                    ptr, n = st.data_ptr(), st.nbytes()
                    if n == 0 or ptr in live or ptr in pre:
                        continue
                    live[ptr] = (n, f"{func.__name__} {tuple(t.shape)}")
                    cur[0] += n
                    weakref.finalize(st, release, ptr, n)
                    if cur[0] > tracker.peak_bytes:
                        tracker.peak_bytes = cur[0]
                        tracker.top = sorted(live.values(), reverse=True)[:tracker.ntop]
                return out

        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        return False


# ---------------------------------------------------------------------------------------------
# provenance


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _mem_gib() -> float | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        return None


def machine_description(device: str = "cpu") -> str:
    """One line: CPU, cores, torch threads, RAM, GPU (if used), torch version."""
    parts = [f"{_cpu_model()}", f"{os.cpu_count()} CPUs", f"torch threads {torch.get_num_threads()}"]
    mem = _mem_gib()
    if mem is not None:
        parts.append(f"{mem:.0f} GiB RAM")
    if device.startswith("cuda") and torch.cuda.is_available():
        parts.append(torch.cuda.get_device_name())
    parts.append(f"torch {torch.__version__}")
    parts.append(f"python {platform.python_version()}")
    return ", ".join(parts)


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, cwd=os.path.dirname(os.path.abspath(__file__)), timeout=10)
        return out.stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        return None


def module_at(revision: str, path: str, name: str, tmp_dir: str):
    """The module ``path`` (relative to the repository) as it was at git ``revision``, loaded
    under ``name`` from a copy in ``tmp_dir``: for A/B benches of a change in one process."""
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    source = subprocess.run(["git", "-C", str(root), "show", f"{revision}:{path}"],
                            check=True, capture_output=True, text=True).stdout
    copy = Path(tmp_dir) / f"{name}.py"
    copy.write_text(source)
    spec = importlib.util.spec_from_file_location(name, copy)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def now_utc() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def fmt_bytes(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.0f} MiB"
