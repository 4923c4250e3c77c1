"""A short real run through ``dptrain train``, with throughput, peak memory and the DP/non-private
ratio (issue 5, item 8; called by bench/gpu_check.sh on an H200).

    python bench/gpu_check.py --model gpt2_small  [--device cuda] [--steps 5] [--json-out F]
    python bench/gpu_check.py --model nf_resnet50 [--device cuda] ...
    python bench/gpu_check.py --model gpt2_small --tiny --device cpu     # CPU smoke (tests)

Models (random initialisation, synthetic data; configs/tiny.yaml and configs/tiny_images.yaml
with overrides):

- ``gpt2_small``: GPT-2 small (12 layers, width 768, 12 heads, vocabulary 50,257, tied
  embeddings), T = 128 (synthetic Markov text of 64-128 tokens), N = 2,048 at q = 0.125
  (b = 256), microbatches of 64, **DP-Muon-IM with K = 2** (k_muon = k_other = 2, gamma 0.9);
- ``nf_resnet50``: timm nf_resnet50, 224 x 224 synthetic images, 1,000 classes, N = 1,024 at
  q = 0.25 (b = 256), microbatches of 64, DP-Muon + AdamW (preset nfresnet).

``--tiny`` shrinks both to seconds on a CPU (GPT-2 2 x 32, T = 16; nf_resnet_tiny at 16 px).

Two parts, one process:

1. **train**: ``dptrain.cli.main(["train", ...])`` exactly as the command line runs it
   (``--steps`` releases, final evaluation, final model). Throughput = examples of steps
   t = max(1, K)..n-1 (the Poisson sample sizes, recomputed from the public seed) / their wall
   time from metrics.jsonl (step 0 is warm-up: CUDA context, cuDNN/cuBLAS autotuning; with
   inner momentum, a step t < K evaluates t + 1 states per example, not K + 1). Peak memory:
   ``torch.cuda.max_memory_allocated`` and, from nvidia-ml-py (NVML) polled every 20 ms, the
   device's used memory and this process's (what nvidia-smi shows: the caching allocator's
   reserve, the CUDA context included).
2. **compare**: a fresh Trainer of the same config; after one warm-up of each, ``--rounds``
   interleaved rounds of one private step (``Trainer.private_step``: clipped sums over
   microbatches, one Gaussian release, the optimizer) and one non-private step (plain
   ``loss.sum()/b`` backward over the same microbatches, the same optimizer), every variant of
   a round on the same logical batch (``logical_batches``: each variant's sizes). Ratio =
   median private / median non-private step time; peak allocation per variant (peak stats
   reset before each step). For gpt2_small the private step is DP-Muon-IM
   K = 2 (three evaluations per example), the non-private one a plain step: the ratio includes
   inner momentum's cost. A third variant, ``private_inline``, is the same private step with
   the release's noise drawn after the microbatches instead of on the background thread during
   them (performance.noise_prefetch; the same release): ``inline_over_background_noise``.

On CPU the memory columns are the resident set (peak above the resident set before the part).
The last line printed is one JSON object (also written to ``--json-out``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)

CONFIGS = {"gpt2_small": os.path.join(ROOT, "configs", "tiny.yaml"),
           "nf_resnet50": os.path.join(ROOT, "configs", "tiny_images.yaml")}
IM = ["optim.inner_momentum.k_muon=2", "optim.inner_momentum.k_other=2",
      "optim.inner_momentum.gamma_muon=0.9"]
COMMON = ["privacy.noise_multiplier=1.0", "privacy.epsilon=null", "privacy.accountant=rdp",
          "train.checkpoint_every=0", "train.progress=false", "train.log_every=1"]


def model_overrides(model: str, tiny: bool) -> list[str]:
    if model == "gpt2_small":
        if tiny:
            shape = ["model.n_layer=2", "model.n_embd=32", "model.n_head=2",
                     "model.n_positions=16", "data.max_length=16",
                     "data.synthetic_train_size=256", "privacy.sample_rate=0.125",
                     "performance.microbatch_size=8"]
        else:
            shape = ["model.n_layer=12", "model.n_embd=768", "model.n_head=12",
                     "model.n_positions=128", "model.vocab_size=50257", "data.max_length=128",
                     "data.synthetic_train_size=2048", "privacy.sample_rate=0.125",
                     "performance.microbatch_size=64"]
        return shape + ["data.synthetic_test_size=64", "train.eval_batch_size=64", *IM]
    if model == "nf_resnet50":
        common = ["model.name=timm", "data.synthetic_test_size=64", "train.eval_batch_size=64"]
        if tiny:
            return common + ["model.timm_name=nf_resnet_tiny", "data.image_size=16",
                             "data.synthetic_train_size=128", "privacy.sample_rate=0.125",
                             "performance.microbatch_size=8"]
        return common + ["model.timm_name=nf_resnet50", "data.image_size=224",
                         "data.num_classes=1000", "data.synthetic_train_size=1024",
                         "privacy.sample_rate=0.25", "performance.microbatch_size=64"]
    raise SystemExit(f"unknown model {model!r}")


# --------------------------------------------------------------------------------- memory

class NvmlMonitor:
    """Polls NVML every ``period`` s: peak used memory of the device and of this process."""

    def __init__(self, device_index: int, period: float = 0.02):
        self.device_used = 0
        self.process_used: int | None = None
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handle = self._find_handle(device_index)
        except Exception as e:  # no NVML (CPU run, or nvidia-ml-py missing)
            self._nvml, self.error = None, f"{type(e).__name__}: {e}"
            return
        self._period = period
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _find_handle(self, index: int):
        nv = self._nvml
        try:  # NVML numbers devices ignoring CUDA_VISIBLE_DEVICES: match by PCI bus id
            import torch

            props = torch.cuda.get_device_properties(index)
            bus = f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
            return nv.nvmlDeviceGetHandleByPciBusId(bus.encode())
        except Exception:
            return nv.nvmlDeviceGetHandleByIndex(index)

    def _sample(self) -> None:
        nv = self._nvml
        self.device_used = max(self.device_used, int(nv.nvmlDeviceGetMemoryInfo(self._handle).used))
        try:
            for p in nv.nvmlDeviceGetComputeRunningProcesses(self._handle):
                if p.pid == os.getpid() and p.usedGpuMemory is not None:
                    self.process_used = max(self.process_used or 0, int(p.usedGpuMemory))
        except Exception:
            pass

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._sample()
            except Exception as e:
                self.error = f"{type(e).__name__}: {e}"
                return
            time.sleep(self._period)

    def stop(self) -> dict:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=2)
            try:
                self._sample()
            except Exception:
                pass
        mib = lambda b: None if b is None else b / 2**20  # noqa: E731
        return {"nvml_device_used_peak_mib": mib(self.device_used) if self._nvml else None,
                "nvml_process_peak_mib": mib(self.process_used), "nvml_error": self.error}


class PeakMemory:
    """Peak memory of a block: CUDA allocated bytes, or the CPU resident set above its start."""

    def __init__(self, device: str):
        self.device = device

    def __enter__(self):
        import torch

        from common import _reset_peak_rss

        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            self.base = _reset_peak_rss()
        return self

    def __exit__(self, *exc):
        import torch

        from common import _peak_rss_bytes

        if self.device == "cuda":
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated()
        else:
            self.peak = _peak_rss_bytes()
        return False

    @property
    def peak_mib(self) -> float:
        return self.peak / 2**20

    @property
    def above_start_mib(self) -> float:
        return (self.peak - self.base) / 2**20


# --------------------------------------------------------------------------------- parts

def logical_batch_sizes(config: str, overrides: list[str], steps: int) -> list[int]:
    """|S_t| of steps 0..steps-1: a pure function of the public privacy seed (no data needed)."""
    from dptrain.config import load
    from dptrain.privacy.sampling import poisson_sample
    from dptrain.trainer import RunConfig

    cfg = load(RunConfig, config, overrides)
    n = cfg.data.synthetic_train_size
    return [len(poisson_sample(cfg.privacy.seed, t, n, cfg.privacy.sample_rate))
            for t in range(steps)]


def part_train(config: str, overrides: list[str], device: str, out: Path) -> dict:
    import torch

    from dptrain.cli import main as cli_main

    monitor = NvmlMonitor(torch.cuda.current_device()) if device == "cuda" else None
    t0 = time.perf_counter()
    with PeakMemory(device) as mem:
        code = cli_main(["train", "--config", config, "--output-dir", str(out), *overrides])
    wall = time.perf_counter() - t0
    res = {"exit_code": code, "wall_s": wall}
    if monitor is not None:
        res.update(monitor.stop())
    if code != 0:
        return res
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    times = [r["time"] for r in rows]
    sizes = logical_batch_sizes(config, overrides, len(rows))
    summary = json.loads((out / "summary.json").read_text())
    # timed from the first step whose inner-momentum history holds its K past states (before
    # it, fewer evaluations per example: a cheaper step), step 0 (warm-up) excluded anyway
    im = summary["config"]["optim"]["inner_momentum"]
    first = max(1, im["k_muon"], im["k_other"])
    timed = len(rows) - first
    res.update(
        steps=len(rows), logical_batches=sizes, step_times_s=[
            b - a for a, b in zip([0.0, *times[:-1]], times)],
        examples_per_s=(sum(sizes[first:]) / (times[-1] - times[first - 1])
                        if timed > 0 else None), timed_from_step=first,
        peak_allocated_mib=mem.peak_mib if device == "cuda" else None,
        peak_rss_above_start_mib=None if device == "cuda" else mem.above_start_mib,
        train_loss_last=rows[-1]["train_loss"], test_metrics=summary.get("metrics"),
        epsilon=summary.get("epsilon"),
        # the run's own NVML telemetry (dptrain.telemetry.gpu), beside this script's monitor
        run_gpu_telemetry={k: rows[-1].get(k) for k in (
            "gpu_util_pct", "gpu_power_w", "gpu_memory_used_gib")},
        run_gpu_energy_kwh=summary.get("gpu_energy_kwh"))
    return res


def _nonprivate_step(t, step: int) -> int:
    """One non-private step on S_step: sum of the per-example losses / b, backward per
    microbatch (gradients accumulate in .grad), the same optimizer. Returns |S_step|."""
    from dptrain.trainer import to_device

    idx = t.sample(step)
    b = t.plan.denominator
    with t._autocast():
        for chunk in t.microbatches(idx):
            batch = to_device(t.task.train.collate(chunk), t.device)
            (t.task.loss_fn(t.model, batch).sum() / b).backward()
    t.optimizer.step()
    t.optimizer.zero_grad()
    return len(idx)


def part_compare(config: str, overrides: list[str], device: str, rounds: int) -> dict:
    import torch

    from dptrain.config import load
    from dptrain.trainer import RunConfig, Trainer

    steps = 3 * (rounds + 1)
    t = Trainer(load(RunConfig, config, [*overrides, f"privacy.steps={steps}"]))
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    names = ("private", "private_inline", "nonprivate")
    times: dict[str, list[float]] = {k: [] for k in names}
    examples: dict[str, list[int]] = {k: [] for k in names}
    peaks: dict[str, float] = {k: 0.0 for k in names}
    for r in range(rounds + 1):  # round 0: warm-up of all
        order = names[r % 3:] + names[:r % 3]
        s = t.step  # the round's logical batch, S_s, for every variant
        for variant in order:
            n = len(t.sample(s))
            with PeakMemory(device) as mem:
                sync()
                t0 = time.perf_counter()
                if variant.startswith("private"):
                    # the same release either way (tests/test_release.py): noise drawn on the
                    # background thread during the microbatches, or after them; the step
                    # index is put back so that each variant of the round takes S_s (a
                    # private step advances it; here nothing else reads it)
                    t.noise_prefetch = variant == "private"
                    t.step = s
                    t.private_step()
                else:
                    _nonprivate_step(t, s)
                sync()
                dt = time.perf_counter() - t0
            peak = mem.peak_mib if device == "cuda" else mem.above_start_mib
            if r > 0:
                times[variant].append(dt)
                examples[variant].append(n)
                peaks[variant] = max(peaks[variant], peak)
        t.step = s + 1  # the next round: the next logical batch
    med = {k: statistics.median(v) for k, v in times.items()}
    eps = {k: sum(examples[k]) / sum(times[k]) for k in times}
    return {"rounds": rounds, "private_step_s": med["private"],
            "nonprivate_step_s": med["nonprivate"],
            "dp_over_nonprivate": med["private"] / med["nonprivate"],
            "private_inline_noise_step_s": med["private_inline"],
            "inline_over_background_noise": med["private_inline"] / med["private"],
            "private_examples_per_s": eps["private"], "logical_batches": examples,
            "nonprivate_examples_per_s": eps["nonprivate"],
            "private_peak_mib": peaks["private"], "nonprivate_peak_mib": peaks["nonprivate"],
            "peak_kind": "cuda max_memory_allocated" if device == "cuda"
            else "CPU resident set above the step's start"}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, choices=["gpt2_small", "nf_resnet50"])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke test)")
    ap.add_argument("--steps", type=int, default=5, help="releases of the train part")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds of the compare part")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="performance.dtype (autocast) of both parts")
    ap.add_argument("--parts", default="train,compare")
    ap.add_argument("--out", default=None, help="output directory of the train part "
                                                "(default: a fresh temporary one)")
    ap.add_argument("--json-out", default=None)
    a = ap.parse_args(argv)
    import tempfile

    import torch

    from common import git_commit, machine_description, now_utc

    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but torch sees no GPU (use --device cpu --tiny)")
    overrides = [*COMMON, *model_overrides(a.model, a.tiny), f"performance.device={a.device}",
                 f"performance.dtype={a.dtype}", f"privacy.steps={a.steps}"]
    if a.device == "cuda":
        overrides.append("performance.num_threads=null")
    config = CONFIGS[a.model]
    out = Path(a.out) if a.out else Path(tempfile.mkdtemp(prefix=f"gpu_check_{a.model}_"))
    result: dict = {"model": a.model, "tiny": a.tiny, "device": a.device, "dtype": a.dtype,
                    "config": os.path.relpath(config, ROOT), "overrides": overrides,
                    "machine": machine_description(a.device),
                    "date": now_utc(), "commit": git_commit()}
    parts = a.parts.split(",")
    if "train" in parts:
        result["train"] = part_train(config, overrides, a.device, out / "run")
        tr = result["train"]
        print(f"[{a.model}] dptrain train: exit {tr['exit_code']}, {tr.get('steps')} steps, "
              f"{_f(tr.get('examples_per_s'))} examples/s (steps 2..n), peak allocated "
              f"{_f(tr.get('peak_allocated_mib'))} MiB, NVML process "
              f"{_f(tr.get('nvml_process_peak_mib'))} MiB / device "
              f"{_f(tr.get('nvml_device_used_peak_mib'))} MiB, wall {tr['wall_s']:.1f} s",
              flush=True)
    if "compare" in parts:
        result["compare"] = part_compare(config, overrides, a.device, a.rounds)
        c = result["compare"]
        print(f"[{a.model}] private step {c['private_step_s']:.3f} s "
              f"({c['private_examples_per_s']:.1f} ex/s), non-private "
              f"{c['nonprivate_step_s']:.3f} s ({c['nonprivate_examples_per_s']:.1f} ex/s): "
              f"DP/non-private {c['dp_over_nonprivate']:.2f}x; noise drawn inline "
              f"{c['private_inline_noise_step_s']:.3f} s "
              f"({c['inline_over_background_noise']:.2f}x the background draw's step); peak "
              f"{c['private_peak_mib']:.0f} vs {c['nonprivate_peak_mib']:.0f} MiB", flush=True)
    first = ("model", "tiny", "device", "dtype", "train", "compare")  # the numbers first
    result = {**{k: result[k] for k in first if k in result},
              **{k: v for k, v in result.items() if k not in first}}
    line = json.dumps(result, default=str)
    if a.json_out:
        Path(a.json_out).write_text(line + "\n")
    print(line, flush=True)
    return result


def _f(x, fmt: str = ".1f") -> str:
    return "-" if x is None else format(x, fmt)


if __name__ == "__main__":
    main()
