"""dptrain.telemetry.gpu: NVML's utilisation, power, device memory and energy, sampled while a
run trains, against a scripted stand-in for nvidia-ml-py (these machines have no GPU), and the
rows and summary the trainer makes of them."""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dptrain.telemetry.gpu import GpuMonitor

ROOT = Path(__file__).resolve().parents[1]
CUDA = SimpleNamespace(type="cuda", index=0)
DEVICE_UUID = uuid.UUID("12345678-1234-5678-1234-567812345678")


class FakeNVML:
    """The few nvidia-ml-py calls the monitor makes, reading from scripted lists (the last
    value repeats). Handles are found only by NVML's own UUID form, "GPU-<uuid>"."""

    class NVMLError(Exception):
        pass

    def __init__(self, util, memory, power_mw=None, energy_mj=None, fail_after=None):
        self.util, self.memory, self.power, self.energy = util, memory, power_mw, energy_mj
        self.calls = 0
        self.fail_after = fail_after
        self.inits = self.shutdowns = 0

    def _next(self, seq):
        return seq[min(self.calls - 1, len(seq) - 1)]

    def nvmlInit(self):
        self.inits += 1

    def nvmlShutdown(self):
        self.shutdowns += 1

    def nvmlDeviceGetHandleByUUID(self, name):
        if name != f"GPU-{DEVICE_UUID}":
            raise self.NVMLError(f"no device {name}")
        return "handle"

    def nvmlDeviceGetHandleByIndex(self, index):
        raise AssertionError("the UUID is known: the index must not be used")

    def nvmlDeviceGetUtilizationRates(self, h):
        assert h == "handle"
        self.calls += 1
        if self.fail_after is not None and self.calls > self.fail_after:
            raise self.NVMLError("GPU is lost")
        return SimpleNamespace(gpu=self._next(self.util), memory=0)

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(used=self._next(self.memory), total=2**40, free=0)

    def nvmlDeviceGetPowerUsage(self, h):
        if self.power is None:
            raise self.NVMLError("not supported")
        return self._next(self.power)

    def nvmlDeviceGetTotalEnergyConsumption(self, h):
        if self.energy is None:
            raise self.NVMLError("not supported")
        e = self.energy.pop(0)
        return e


@pytest.fixture
def cuda_props(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: SimpleNamespace(uuid=DEVICE_UUID, name="fake"))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


def test_off_without_cuda_or_nvml(cuda_props):
    cpu = GpuMonitor(torch.device("cpu")).start()
    assert not cpu.active and cpu.reason == "not a CUDA device"
    assert cpu.window() is None and cpu.energy_j() is None
    cpu.close()

    class Broken(FakeNVML):
        def nvmlInit(self):
            raise self.NVMLError("Driver Not Loaded")

    off = GpuMonitor(CUDA, nvml=Broken([0], [0]))
    assert not off.active and "Driver Not Loaded" in off.reason and off.window() is None


def test_windows_average_utilisation_and_power_and_keep_the_memory_peak(cuda_props):
    nvml = FakeNVML(util=[10, 30, 50, 90], memory=[2**30, 3 * 2**30, 2**30, 5 * 2**29],
                    power_mw=[100_000, 200_000, 300_000, 500_000])
    mon = GpuMonitor(CUDA, nvml=nvml)
    assert mon.active and mon.reason is None
    for _ in range(3):
        mon.sample()
    w = mon.window()
    assert w == {"gpu_util_pct": 30.0, "gpu_memory_used_gib": 3.0, "samples": 3,
                 "gpu_power_w": 200.0}
    assert mon.window() is None  # the window was emptied: no sample since
    mon.sample()
    assert mon.window() == {"gpu_util_pct": 90.0, "gpu_memory_used_gib": 2.5, "samples": 1,
                            "gpu_power_w": 500.0}
    mon.close()
    assert nvml.shutdowns == 1 and mon.window() is None


def test_energy_from_the_counter_and_otherwise_from_the_power_samples(cuda_props):
    counter = FakeNVML([50], [0], power_mw=[100_000], energy_mj=[1_000_000, 4_500_000])
    mon = GpuMonitor(CUDA, nvml=counter, interval=60).start()  # the first reading, no more
    mon.close()
    assert mon.energy_j() == pytest.approx(3500.0)  # (4.5e6 - 1e6) mJ, kept after close

    integrated = FakeNVML([50], [0], power_mw=[100_000, 300_000])  # no energy counter
    mon = GpuMonitor(CUDA, nvml=integrated)
    mon.sample()
    time.sleep(0.05)
    t0 = mon._last_sample[0]
    mon.sample()
    dt = mon._last_sample[0] - t0
    assert dt > 0.04
    assert mon.energy_j() == pytest.approx(0.5 * (100 + 300) * dt)  # trapezoid, watts x s

    no_power = GpuMonitor(CUDA, nvml=FakeNVML([50], [0]))
    no_power.sample()
    assert "gpu_power_w" not in no_power.window() and no_power.energy_j() is None


def test_the_thread_samples_until_closed_and_a_failing_driver_stops_only_the_sampling(
        cuda_props):
    nvml = FakeNVML([40], [2**30], power_mw=[50_000])
    mon = GpuMonitor(CUDA, nvml=nvml, interval=0.01).start()
    time.sleep(0.3)
    w = mon.window()
    assert w["samples"] >= 5 and w["gpu_util_pct"] == 40.0
    mon.close()
    calls = nvml.calls
    time.sleep(0.05)
    assert nvml.calls == calls  # stopped

    failing = FakeNVML([40], [2**30], fail_after=3)
    mon = GpuMonitor(CUDA, nvml=failing, interval=0.01).start()
    time.sleep(0.3)
    assert mon.reason.startswith("NVML sampling stopped") and "GPU is lost" in mon.reason
    assert mon.window()["samples"] == 3  # what came before the failure is kept
    mon.close()


def test_the_device_is_found_by_uuid_not_by_index(monkeypatch):
    # CUDA_VISIBLE_DEVICES=3: torch's device 0 is NVML's device 3; only the UUID matches
    seen = []
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: seen.append(i) or SimpleNamespace(uuid=DEVICE_UUID))
    mon = GpuMonitor(SimpleNamespace(type="cuda", index=0), nvml=FakeNVML([1], [1]))
    assert mon.active and seen == [0]

    # a UUID NVML does not know: off, not the GPU that NVML numbers 0 (another one, here)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: SimpleNamespace(uuid=uuid.UUID(int=7)))
    class NumbersAnother(FakeNVML):
        def nvmlDeviceGetHandleByIndex(self, index):
            return "another GPU's handle"

    nvml = NumbersAnother([1], [1])
    mon = GpuMonitor(SimpleNamespace(type="cuda", index=0), nvml=nvml)
    assert not mon.active and "cannot find" in mon.reason and nvml.shutdowns == 1
    assert str(uuid.UUID(int=7)) in mon.reason


def _trainer(extra=()):
    from dptrain.config import load
    from dptrain.trainer import RunConfig, Trainer

    return Trainer(load(RunConfig, str(ROOT / "configs" / "tiny.yaml"), [
        "train.progress=false", "privacy.sample_rate=0.5", "privacy.steps=2",
        "privacy.epsilon=null", "privacy.noise_multiplier=1.0", *extra]))


def test_trainer_rows_and_summary_carry_the_gpu_telemetry_only_on_cuda(cuda_props):
    t = _trainer()
    nvml = FakeNVML([20, 60], [2**31, 2**30], power_mw=[150_000, 250_000],
                    energy_mj=[0, 7_200_000])
    mon = GpuMonitor(CUDA, nvml=nvml, interval=60).start()  # one reading at start
    mon.sample()
    # a CPU run asks nothing of the monitor and writes no GPU fields
    assert t._gpu_row(mon) == {} and t._gpu_energy_kwh(mon) is None
    t.device = torch.device("cuda", 0)  # one rank: no collective, so no CUDA tensor is made
    assert t._gpu_row(mon) == {"gpu_util_pct": 40.0, "gpu_memory_used_gib": 2.0,
                               "gpu_power_w": 200.0}
    assert t._gpu_row(mon) == {}  # no sample in this window
    mon.close()
    assert t._gpu_energy_kwh(mon) == pytest.approx(2.0e-3)  # 7,200 J
    assert t._gpu_energy_kwh(GpuMonitor(torch.device("cpu"))) is None


def test_a_cpu_run_writes_no_gpu_fields(tmp_path):
    import json

    t = _trainer()
    t.output_dir = tmp_path
    summary = t.run()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows and not any(k.startswith("gpu_") for row in rows for k in row)
    assert summary["gpu_energy_kwh"] is None
    assert json.loads((tmp_path / "summary.json").read_text())["gpu_energy_kwh"] is None


@pytest.mark.parametrize("secure", [False, True])
def test_secure_mode_rows_hold_no_gpu_telemetry(tmp_path, monkeypatch, secure):
    import json

    from dptrain.trainer import Trainer

    # what a CUDA rank would add to each row; secure mode must not ask for it
    monkeypatch.setattr(Trainer, "_gpu_row", lambda self, gpu: {"gpu_util_pct": 55.0})
    t = _trainer(["privacy.secure_mode=true", "privacy.seed=null"] if secure else [])
    t.output_dir = tmp_path
    t.run()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    assert all(("gpu_util_pct" in row) != secure for row in rows)


def test_a_device_nvml_cannot_sample_leaves_the_monitor_off_not_the_run_down(cuda_props):
    class NoUtilisation(FakeNVML):  # some MIG slices: "Not Supported"
        def nvmlDeviceGetUtilizationRates(self, h):
            raise self.NVMLError("Not Supported")

    nvml = NoUtilisation([0], [0])
    mon = GpuMonitor(CUDA, nvml=nvml).start()  # it raised, before the run's first step
    assert not mon.active and "Not Supported" in mon.reason and nvml.shutdowns == 1
    assert mon.window() is None and mon.energy_j() is None
    mon.close()
    assert nvml.shutdowns == 1


class _PowerSometimes(FakeNVML):
    """Every other sample has no power reading (NVML's "not available now")."""

    def nvmlDeviceGetPowerUsage(self, h):
        if self.calls % 2 == 0:
            raise self.NVMLError("not available now")
        return 200_000  # mW


def test_power_is_the_mean_of_the_samples_that_read_it(cuda_props):
    monitor = GpuMonitor(CUDA, nvml=_PowerSometimes(util=[50], memory=[2**30]))
    assert monitor.active
    for _ in range(4):
        monitor.sample()
    w = monitor.window()
    assert w["samples"] == 4 and w["gpu_util_pct"] == 50.0
    assert w["gpu_power_w"] == pytest.approx(200.0)  # 2 readings of 200 W, not 400 W / 4
    monitor.close()


def test_a_mig_slice_is_found_by_its_uuid_and_a_device_without_one_by_index(monkeypatch):
    class Mig(FakeNVML):
        def nvmlDeviceGetHandleByUUID(self, name):
            if name != f"MIG-{DEVICE_UUID}":
                raise self.NVMLError(f"no device {name}")
            return "handle"

    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: SimpleNamespace(uuid=DEVICE_UUID))
    assert GpuMonitor(SimpleNamespace(type="cuda", index=0), nvml=Mig([1], [1])).active

    # no UUID from torch (older builds): NVML's index, torch's current device for cuda
    class ByIndex(FakeNVML):
        def nvmlDeviceGetHandleByUUID(self, name):
            raise AssertionError("no UUID to look up")

        def nvmlDeviceGetHandleByIndex(self, index):
            self.index = index
            return "handle"

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    nvml = ByIndex([1], [1])
    mon = GpuMonitor(SimpleNamespace(type="cuda", index=None), nvml=nvml)
    assert mon.active and nvml.index == 2


def test_an_energy_counter_that_stops_answering_falls_back_to_the_power_samples(cuda_props):
    nvml = FakeNVML([50], [0], power_mw=[100_000], energy_mj=[1_000_000])  # one reading only
    mon = GpuMonitor(CUDA, nvml=nvml, interval=60).start()
    mon.sample()
    assert mon._energy_start_mj == 1_000_000
    assert mon.energy_j() == pytest.approx(mon._energy_j)  # (not the counter's None)
    mon.close()


def test_close_waits_for_a_sample_in_progress_before_shutting_nvml_down(cuda_props):
    log = []

    class Slow(FakeNVML):
        def nvmlDeviceGetUtilizationRates(self, h):
            log.append("sample")
            time.sleep(0.2)
            log.append("sampled")
            return super().nvmlDeviceGetUtilizationRates(h)

        def nvmlShutdown(self):
            log.append("shutdown")
            super().nvmlShutdown()

    mon = GpuMonitor(CUDA, nvml=Slow([40], [2**30]), interval=0.01).start()
    time.sleep(0.1)  # the thread's first sample is under way
    mon.close()
    assert log[-1] == "shutdown" and log.count("shutdown") == 1
    time.sleep(0.3)
    assert log[-1] == "shutdown"  # no NVML call after its shutdown
