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

from dptrain.telemetry import jsonable, peak_memory_bytes, strict_json


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


def test_cpu_peak_memory_is_the_resident_high_water_mark():
    # in a fresh process: a 1 GiB tensor, written so that its pages are resident, lifts the
    # peak above its size, and freeing it does not lower the peak (a high-water mark)
    code = (
        "import torch\n"
        "from dptrain.telemetry import peak_memory_bytes\n"
        "cpu = torch.device('cpu')\n"
        "before = peak_memory_bytes(cpu)\n"
        "x = torch.ones(256 * 2**20)\n"
        "during = peak_memory_bytes(cpu)\n"
        "del x\n"
        "print(before, during, peak_memory_bytes(cpu, reset=True))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    before, during, after = map(int, out.stdout.split())
    assert 0 < before < 1 << 30 <= during  # (start-up's freed pages may be reused, so the
    assert after == during                   # increase can be less than the tensor's size)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_cpu_peak_memory_equals_the_kernels_high_water_mark():
    def vm_hwm() -> int:  # the kernel's peak resident set of this process, in bytes
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmHWM")

    # (the two read the kernel's counters at different moments, which lag by a few pages)
    assert abs(peak_memory_bytes(torch.device("cpu")) - vm_hwm()) <= 4 * 2**20
