"""What the GPU itself reports while a run trains, from NVML (nvidia-ml-py): utilisation, power
and device memory in use, sampled on a background thread, and the energy the GPU used.

PyTorch sees only its own allocations (``peak_memory_gib``); NVML sees the device: the CUDA
context, NCCL's buffers, the caching allocator's reserve and other processes. Utilisation is
NVML's "fraction of time a kernel was running" over its sampling period, so a rank waiting on
its data or on the other ranks' all-reduce shows as idle.

Everything here is best effort: without CUDA, nvidia-ml-py or a device NVML can find, the
monitor is off and says why (``GpuMonitor.reason``); an NVML call that fails while sampling
ends the sampling for the run, never the run.
"""

from __future__ import annotations

import threading
import time
from typing import Any

__all__ = ["GpuMonitor"]


def _nvml_handle(nvml: Any, device: Any):
    """NVML's handle of ``device`` (a torch CUDA device). Matched by UUID, as NVML numbers the
    physical devices while torch numbers those CUDA_VISIBLE_DEVICES leaves visible (in its
    order); by index only when torch gives no UUID. A UUID that NVML does not know raises
    (the monitor is then off): the same index could be another GPU's."""
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    if uuid is None:
        return nvml.nvmlDeviceGetHandleByIndex(index)
    text = str(uuid)
    # torch prints the bare UUID; NVML's carries a "GPU-" (or "MIG-") prefix
    for name in (text, f"GPU-{text}", f"MIG-{text}"):
        try:
            return nvml.nvmlDeviceGetHandleByUUID(name)
        except nvml.NVMLError:
            continue
    raise LookupError(f"no device with torch's UUID {text}")


class GpuMonitor:
    """Samples one GPU every ``interval`` seconds on a daemon thread.

    ``window()`` returns what was seen since the previous call (or since ``start``) and opens
    the next window: ``gpu_util_pct`` (mean of the samples), ``gpu_power_w`` (mean),
    ``gpu_memory_used_gib`` (highest) and ``samples``; None when the monitor is off or no
    sample fell in the window. ``energy_j()`` is the energy the device used since ``start``:
    NVML's energy counter where the GPU has one (Volta and later), else the power samples
    integrated over time.
    """

    def __init__(self, device: Any, interval: float = 0.1, nvml: Any = None):
        self.interval = float(interval)
        self.reason: str | None = None
        self._nvml = None
        self._handle = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._reset_window()
        self._energy_start_mj: int | None = None
        self._energy_j = 0.0  # integrated from the power samples (no energy counter)
        self._last_sample: tuple[float, float] | None = None  # (time, watts)
        self._closed_energy_j: float | None = None  # what energy_j() says after close()
        if getattr(device, "type", None) != "cuda":
            self.reason = "not a CUDA device"
            return
        try:
            if nvml is None:
                import pynvml as nvml
            nvml.nvmlInit()
        except Exception as e:  # noqa: BLE001 -- nvidia-ml-py missing, or no driver
            self.reason = f"NVML unavailable ({type(e).__name__}: {e})"
            return
        try:
            self._handle = _nvml_handle(nvml, device)
        except Exception as e:  # noqa: BLE001
            self.reason = f"NVML cannot find {device} ({type(e).__name__}: {e})"
            nvml.nvmlShutdown()
            return
        self._nvml = nvml

    @property
    def active(self) -> bool:
        return self._nvml is not None

    def _reset_window(self) -> None:
        self._util_sum = 0.0
        self._power_sum = 0.0
        self._power_n = 0
        self._memory_max = 0
        self._n = 0

    def sample(self) -> None:
        """One reading into the current window (the thread calls this; so may a test)."""
        nvml, h = self._nvml, self._handle
        util = nvml.nvmlDeviceGetUtilizationRates(h).gpu
        memory = nvml.nvmlDeviceGetMemoryInfo(h).used
        try:
            watts = nvml.nvmlDeviceGetPowerUsage(h) / 1000.0  # milliwatts
        except nvml.NVMLError:  # some devices (and MIG slices) do not report power
            watts = None
        now = time.monotonic()
        with self._lock:
            self._util_sum += util
            self._memory_max = max(self._memory_max, int(memory))
            self._n += 1
            if watts is not None:
                self._power_sum += watts
                self._power_n += 1
                if self._last_sample is not None:  # trapezoid between this and the last reading
                    t0, w0 = self._last_sample
                    self._energy_j += 0.5 * (w0 + watts) * (now - t0)
                self._last_sample = (now, watts)

    def _energy_counter_mj(self) -> int | None:
        try:
            return int(self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle))
        except Exception:  # noqa: BLE001 -- pre-Volta GPUs, MIG slices
            return None

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.sample()
            except Exception as e:  # noqa: BLE001 -- a driver hiccup: stop sampling, keep training
                self.reason = f"NVML sampling stopped ({type(e).__name__}: {e})"
                return

    def start(self) -> GpuMonitor:
        """Starts the sampling; never raises: a device whose NVML cannot report utilisation
        or memory (some MIG slices) leaves the monitor off, with its ``reason``."""
        if self.active and self._thread is None:
            try:
                self._energy_start_mj = self._energy_counter_mj()
                self.sample()  # a first reading: a window shorter than the interval is not empty
            except Exception as e:  # noqa: BLE001
                self.reason = f"NVML cannot sample this device ({type(e).__name__}: {e})"
                self.close()
                return self
            self._thread = threading.Thread(target=self._loop, name="dptrain-nvml", daemon=True)
            self._thread.start()
        return self

    def window(self) -> dict[str, float] | None:
        if not self.active:
            return None
        with self._lock:
            n, util, power, power_n, memory = (self._n, self._util_sum, self._power_sum,
                                               self._power_n, self._memory_max)
            self._reset_window()
        if n == 0:
            return None
        out = {"gpu_util_pct": util / n, "gpu_memory_used_gib": memory / 2**30, "samples": n}
        if power_n:
            out["gpu_power_w"] = power / power_n
        return out

    def energy_j(self) -> float | None:
        if not self.active:
            return self._closed_energy_j
        if self._energy_start_mj is not None:
            now = self._energy_counter_mj()
            if now is not None:
                return (now - self._energy_start_mj) / 1000.0
        with self._lock:
            return self._energy_j if self._last_sample is not None else None

    def close(self) -> None:
        """Stops the sampling and NVML; ``energy_j()`` keeps its last value, ``window()`` is
        None from then on."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5 * self.interval + 1.0)
            self._thread = None
        if self._nvml is not None:
            self._closed_energy_j = self.energy_j()
            nvml, self._nvml = self._nvml, None
            try:
                nvml.nvmlShutdown()
            except Exception:  # noqa: BLE001
                pass
