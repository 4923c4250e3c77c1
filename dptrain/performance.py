"""Performance settings: how fast and in what memory a step runs, never what it computes.

Nothing here may change the sampled sets, the clip factors or the noise (tests/test_release.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from dptrain.config import ConfigError


@dataclass(kw_only=True)
class PerformanceConfig:
    microbatch_size: int = 32
    """Examples per forward/backward; a logical batch is split into microbatches of this size."""
    dtype: Literal["float32", "bfloat16", "float64"] = "float32"
    """Compute dtype of the forward/backward (norms and sums are accumulated in float32+).
    bfloat16 is autocast. float32 products in the private query are IEEE whatever TF32/bf16
    setting the process chose (dptrain/clipping/precision.py)."""
    num_threads: int | None = None
    """torch intra-op threads; null keeps torch's default."""
    clipping: Literal["auto", "bookkeeping", "two_pass"] = "auto"
    """How the clipped sum is formed: book-keeping (one backward; sum from captured activations
    and output gradients) or a second backward with per-example loss weights. Same result."""
    ghost: Literal["auto", "ghost", "instantiate", "memory"] = "auto"
    """Per-layer norm form: by estimated cost (auto), always ghost, always instantiate, or
    ``memory``: per parameter the form that holds fewer bytes until the clip factors are known
    (its per-example buffer, or every evaluated state's captured factors: with inner momentum's
    K past states, the smaller query, at some cost in time; ``choose_form_memory``)."""
    newton_schulz_dtype: Literal["float32", "bfloat16", "float64"] = "float32"
    """dtype of the optimizer's Newton-Schulz iteration (post-processing)."""
    device: str = "auto"
    """'auto' (cuda if available, else cpu), 'cpu' or 'cuda'."""
    sharding: Literal["none", "fsdp"] = "none"
    """With several ranks: ``fsdp`` shards parameters, releases and optimizer states with
    FSDP2 (per block, then the root); ``none`` replicates the model on every rank."""
    kernels: Literal["torch", "triton"] = "torch"
    """Who computes the ghost norms' products: torch (two batched Gram matrices per pair of
    contributions) or ``triton``, one fused kernel per pair (dptrain/kernels/ghost.py: no Gram
    matrix in memory, half the multiply-adds for a squared norm; CUDA only, or CPU under
    TRITON_INTERPRET=1). The same norms up to float32 rounding (tests/test_kernels.py). On an
    H200 it took 2.1-3.4x torch's time on GPT-2 small's linears (docs/kernels.md), hence off by
    default; it saves the T x T Gram matrices' memory."""
    noise_prefetch: Literal["auto", "background", "inline"] = "auto"
    """When a release's noise is drawn (dptrain.privacy.noise: counter-based, on the CPU, then
    copied to the device): ``background``, on a thread while the logical batch's microbatches
    run, into pinned memory with CUDA; ``inline``, after them; ``auto``: background with CUDA
    (the CPU waits on the GPU there), inline on CPU (where the draw would take cores from the
    step). The same numbers either way (tests/test_release.py); background holds this rank's
    noise of the whole model in host memory until the release."""
    collate_prefetch: Literal["auto", "background", "inline"] = "auto"
    """When a microbatch's examples are assembled (``collate``: image files decoded, token
    ids padded): ``background``, the next microbatch's on a thread while the current one's
    forward and backward run; ``inline``, when it is needed; ``auto``: background with CUDA,
    inline on CPU (where the thread would take cores from the step). The same batches either
    way (a batch is a function of its indices; tests/test_data_folders.py)."""
    decode_threads: int | None = None
    """Threads that decode a microbatch's image files (webdataset, imagefolder; Pillow
    releases the GIL while it decodes and resizes); null: min(8, CPU cores); 1: in the
    calling thread. Each file is decoded on its own into its row: the same images in the same
    order with any number (tests/test_data_folders.py)."""
    collective_timeout_s: float | None = None
    """Seconds a collective (an all-reduce, a barrier) waits for the other ranks before the
    run fails; null keeps torch's default (10 minutes with NCCL, 30 with gloo). Raise it where
    one rank can be busy alone for longer (a shared file system that is slow at start-up or
    at a checkpoint); lower it to fail fast. Several ranks only."""
    fsdp_mixed_precision: bool = False
    """FSDP2 with bf16 parameters in forward/backward (norms, sums and reductions in fp32);
    needs ``sharding: fsdp`` (refused otherwise; on a single rank nothing is sharded and it has
    no effect)."""

    def validate(self) -> None:
        if self.microbatch_size < 1:
            raise ConfigError("microbatch_size", f"must be >= 1, got {self.microbatch_size}")
        for f in ("num_threads", "decode_threads"):
            v = getattr(self, f)
            if v is not None and not 1 <= v <= MAX_THREADS:
                raise ConfigError(f, f"must be between 1 and {MAX_THREADS}, got {v}")
        if self.sharding == "fsdp" and self.clipping == "two_pass":
            raise ConfigError("clipping", "two_pass needs parameter gradients from autograd, "
                                          "which FSDP2 shards; use bookkeeping with sharding")
        if self.dtype == "bfloat16" and self.clipping == "two_pass":
            raise ConfigError("clipping", "two_pass adds the gradients of a second backward, "
                                          "which bfloat16 autocast computes in bf16 while the "
                                          "norms are float32 (a clipped example could add "
                                          "more than C); use bookkeeping with bfloat16")
        if self.fsdp_mixed_precision and self.sharding != "fsdp":
            raise ConfigError("fsdp_mixed_precision", "applies to FSDP2 sharding only; set "
                                                      "performance.sharding=fsdp, or use "
                                                      "performance.dtype=bfloat16 (autocast)")
        if self.collective_timeout_s is not None and not (
                MIN_TIMEOUT_S <= self.collective_timeout_s <= MAX_TIMEOUT_S):
            raise ConfigError("collective_timeout_s",
                              f"must be between {MIN_TIMEOUT_S} and {MAX_TIMEOUT_S:.0e} seconds, "
                              f"got {self.collective_timeout_s}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError("device", f"must be auto, cpu or cuda, got {self.device!r}")


#: num_threads' and decode_threads' upper end: more than any machine's cores (torch's setter
#: takes a C int; OpenMP would try to start that many threads)
MAX_THREADS = 4096

#: collective_timeout_s's range: a millisecond (less rounds to 0, a timeout at once) to about
#: 115 days (gloo's timeout wraps past int64 nanoseconds near 9.2e9 s; timedelta overflows at 1e14)
MIN_TIMEOUT_S, MAX_TIMEOUT_S = 1e-3, 1e7

#: performance settings that do not change the run's arithmetic (a resume that changes them
#: repeats the checkpoint's run bit for bit): when the noise is drawn and the batches are
#: assembled, and by how many threads the images are decoded, give the same numbers (each
#: one's docstring); a timeout none
NOT_ARITHMETIC = frozenset({"collective_timeout_s", "noise_prefetch", "collate_prefetch",
                            "decode_threads"})


def check_kernels(perf: PerformanceConfig, device: torch.device) -> None:
    """ConfigError naming ``performance.kernels`` when the chosen kernels cannot run on
    ``device`` (before anything is built or written)."""
    if perf.kernels == "triton":
        from dptrain.kernels.ghost import available

        why = available(device)
        if why is not None:
            raise ConfigError("performance.kernels", why)
