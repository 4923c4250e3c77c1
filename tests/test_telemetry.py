"""dptrain.telemetry: strict JSON of metrics and summaries (no bare NaN or Infinity) and the
peak memory that metrics rows report."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch

from dptrain.telemetry import jsonable, strict_json, write_json


def _refuse(name):
    raise ValueError(f"non-standard JSON constant {name}")


def test_non_finite_numbers_become_strings_everywhere():
    obj = {"nan": math.nan, "inf": math.inf, "neg": -math.inf, "ok": 1.5, "n": 3, "s": "x",
           "nested": {"list": [math.nan, -math.inf, 2.0], "tuple": (math.inf, -math.inf, 0.0)},
           "np": np.float64("-inf")}
    text = strict_json(obj)
    got = json.loads(text, parse_constant=_refuse)
    assert got == {"nan": "nan", "inf": "inf", "neg": "-inf", "ok": 1.5, "n": 3, "s": "x",
                   "nested": {"list": ["nan", "-inf", 2.0], "tuple": ["inf", "-inf", 0.0]},
                   "np": "-inf"}
    assert jsonable((math.nan,)) == ["nan"]
    assert jsonable(-math.inf) == "-inf" and jsonable(math.inf) == "inf"


def test_strict_json_passes_keyword_arguments_and_keeps_finite_values():
    obj = {"b": [1, 2.25], "a": None}
    assert strict_json(obj, indent=2) == json.dumps(obj, indent=2)
    assert json.loads(strict_json({"x": object()}, default=lambda o: "obj")) == {"x": "obj"}


def test_strict_json_refuses_a_non_finite_number_that_jsonable_did_not_see():
    # a number made by `default` (numpy float32 is no Python float) or a float dict key:
    # "refusing any non-finite number left", never a bare NaN / Infinity in the output
    with pytest.raises(ValueError):
        strict_json({"x": np.float32("nan")}, default=float)
    with pytest.raises(ValueError):
        strict_json({math.inf: 1})
    assert json.loads(strict_json({"x": np.float32(0.5)}, default=float)) == {"x": 0.5}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the window needs Linux")
def test_a_report_or_figure_that_fails_half_way_leaves_the_old_file(tmp_path, monkeypatch):
    # --force over an existing report or figure wrote into it directly: a failure part-way
    # (a full disk, an interrupt) left a cut file where the old one was
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    from dptrain.diagnostics import plotting

    report = tmp_path / "out" / "report.json"
    write_json(report, {"a": 1.0})
    assert report.read_text() == '{\n  "a": 1.0\n}\n'  # indented, a last newline
    with pytest.raises(TypeError):
        write_json(report, {"a": 2.0, "b": object()})  # refused before anything is written
    assert json.loads(report.read_text()) == {"a": 1.0}
    write_json(report, {"a": math.inf})
    assert json.loads(report.read_text()) == {"a": "inf"}

    fig_path = tmp_path / "fig.png"
    fig = Figure()
    fig.add_subplot().plot([1, 2], [3, 4])
    plotting._save(fig, fig_path)
    before = fig_path.read_bytes()
    assert before[:8] == b"\x89PNG\r\n\x1a\n"

    def cut(self, fname, **kwargs):
        with open(fname, "wb") as f:
            f.write(b"\x89PN")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", cut)
    with pytest.raises(OSError):
        plotting._save(fig, fig_path)
    assert fig_path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fig.png", "out"]  # no temporary left


def test_cpu_peak_memory_is_the_resident_high_water_mark_of_its_window():
    # in a fresh process (started by this large test process: its own peak must not show): a
    # 1 GiB tensor, written so that its pages are resident, lifts the peak above its size;
    # freeing it does not lower the peak, and a reset starts a new window without it
    code = (
        "import torch\n"
        "from dptrain.telemetry import peak_memory_bytes\n"
        "cpu = torch.device('cpu')\n"
        "before = peak_memory_bytes(cpu)\n"
        "x = torch.ones(256 * 2**20)\n"
        "during = peak_memory_bytes(cpu)\n"
        "del x\n"
        "after = peak_memory_bytes(cpu, reset=True)\n"
        "print(before, during, after, peak_memory_bytes(cpu))\n")
    ballast = torch.ones(384 * 2**20)  # 1.5 GiB resident in the parent while it starts
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             check=True, timeout=120)
    finally:
        del ballast
    before, during, after, new = map(int, out.stdout.split())
    assert 0 < before < 1 << 30 <= during  # (start-up's freed pages may be reused, so the
    assert after >= during - (4 << 20)       # increase can be less than the tensor's size;
    # the kernel's counters lag by a few pages)
    assert new < during - (1 << 29)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM is Linux's")
def test_cpu_peak_memory_is_vmhwm_in_bytes():
    from dptrain.telemetry import peak_memory_bytes

    def vmhwm_kib() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))

    before = vmhwm_kib()
    peak = peak_memory_bytes(torch.device("cpu"))
    assert before * 1024 <= peak <= vmhwm_kib() * 1024  # KiB, not kB


def test_the_command_line_starts_without_importing_torch():
    # every command's module is imported to build the parser: none of them, nor telemetry
    # (which they import for strict_json), may import torch at module level
    code = ("import sys\nfrom dptrain.cli import build_parser\nbuild_parser()\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip() == "False"


def test_the_summary_s_peak_memory_is_the_highest_row_not_the_last(tmp_path, monkeypatch):
    from pathlib import Path

    from dptrain.config import load
    from dptrain.trainer import RunConfig, Trainer

    tiny = str(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml")
    peaks = iter([3.0, 1.0, 2.0, 0.5, 0.5, 0.5])
    monkeypatch.setattr(Trainer, "_peak_memory_gib", lambda self: next(peaks))
    over = ["train.progress=false", "privacy.epsilon=null", "privacy.noise_multiplier=1.1",
            "privacy.steps=3", "train.checkpoint_every=0", "train.log_every=1"]
    summary = Trainer(load(RunConfig, tiny, over), tmp_path / "run").run()
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["peak_memory_gib"] for r in rows] == [3.0, 1.0, 2.0]
    assert summary["peak_memory_gib"] == 3.0


def test_an_evaluation_rows_readings_start_a_new_window_for_the_next_row(monkeypatch):
    # a row at an evaluation step measures the steps before it; the evaluation's own memory
    # and GPU samples must not go into the next row's (its peak memory would be the
    # evaluation's batch, not training's)
    import time
    from pathlib import Path

    import dptrain.trainer as trainer_mod
    from dptrain.config import load
    from dptrain.trainer import RunConfig, Trainer

    tiny = str(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml")
    t = Trainer(load(RunConfig, tiny, ["train.checkpoint_every=0", "privacy.accountant=rdp"]))
    resets, windows = [], []
    monkeypatch.setattr(trainer_mod, "peak_memory_bytes",
                        lambda device, reset=False: resets.append(reset) or 2 ** 30)
    monkeypatch.setattr(t, "evaluate", lambda stoppable=False: {"loss": 1.5})

    class Gpu:
        def window(self):
            windows.append(1)
            return None

    monkeypatch.setattr(t, "_gpu_row", lambda gpu: {})
    row: dict = {}
    t._loop = (time.time() - 2.0, None)  # (the training loop began 2 s ago)
    assert t._measure_row(row, Gpu(), False, 3.0) == 3.0  # the run's peak so far, kept
    assert row["peak_memory_gib"] == 1.0 and 2.0 <= row["time"] < 60 and "test_loss" not in row
    assert resets == [True] and windows == []  # (the row's own reading starts a window)
    row = {}
    assert t._measure_row(row, Gpu(), True, None) == 1.0
    assert row["test_loss"] == 1.5
    assert resets == [True, True, True] and windows == [1]  # the reading, then the evaluation's


def test_the_temporary_file_is_hidden_beside_the_target_and_unique_per_write(tmp_path):
    # ranks of one job (one pid on other nodes) writing one shared file system must not
    # share a temporary: the pid and a random token
    import os

    from dptrain.telemetry import replace_atomically

    seen = []

    def write(tmp):
        seen.append(tmp)
        tmp.write_text(str(len(seen)))

    target = tmp_path / "sub" / "summary.json"
    assert replace_atomically(target, write) == target
    replace_atomically(target, write)
    assert target.read_text() == "2" and len(set(seen)) == 2
    assert all(t.parent == target.parent and not t.exists() for t in seen)
    assert all(t.name.startswith(f".summary.json.tmp-{os.getpid()}-") for t in seen)


def test_cuda_peak_memory_is_the_allocator_s_and_a_reset_starts_a_new_window(monkeypatch):
    from dptrain.telemetry import peak_memory_bytes

    calls = []
    monkeypatch.setattr(torch.cuda, "max_memory_allocated",
                        lambda device: calls.append(("peak", device)) or 5 * 2**30)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats",
                        lambda device: calls.append(("reset", device)))
    cuda = torch.device("cuda", 1)
    assert peak_memory_bytes(cuda) == 5 * 2**30 and calls == [("peak", cuda)]
    assert peak_memory_bytes(cuda, reset=True) == 5 * 2**30  # the window's, read before
    assert calls == [("peak", cuda), ("peak", cuda), ("reset", cuda)]


def test_json_rows_skip_a_cut_line_anywhere_and_rows_that_are_not_objects(tmp_path):
    from dptrain.telemetry import json_rows

    path = tmp_path / "metrics.jsonl"
    assert json_rows(path) == []
    path.write_text('{"step": 1}\n{"step": 2, "lo\n[1, 2]\n3\n{"step": 3}\n')
    assert json_rows(path) == [('{"step": 1}', {"step": 1}), ('{"step": 3}', {"step": 3})]
