"""bench/dist_step.py's comparison of the final parameters of two world sizes."""

from __future__ import annotations

import pytest
import torch

from _bench import load_bench


def test_largest_relative_difference_is_the_worst_tensor_s_and_needs_a_common_one():
    bench = load_bench("dist_step")
    b = {"w": torch.tensor([3.0, 4.0], dtype=torch.float64),
         "b": torch.ones(4, dtype=torch.float64)}
    a = {"w": torch.tensor([3.0, 4.5], dtype=torch.float64),  # |0.5| / 5 = 0.1
         "b": torch.ones(4, dtype=torch.float64) * 1.01,  # 0.02 / 2 = 0.01
         "only_a": torch.zeros(1)}  # (a tied weight listed once in one state: not compared)
    assert bench.largest_relative_difference(a, b) == pytest.approx(0.1)
    assert bench.largest_relative_difference(b, b) == 0.0
    with pytest.raises(ValueError, match="share no tensor"):
        bench.largest_relative_difference({"x": b["w"]}, {"y": b["w"]})
