"""PerformanceConfig's checks: each mistake names its field, settings that fit are accepted, and
the Triton kernels are refused where they cannot run."""

from __future__ import annotations

import pytest
import torch

from dptrain.config import ConfigError, from_dict, validate_tree
from dptrain.performance import PerformanceConfig, check_kernels


@pytest.mark.parametrize("bad, field", [
    ({"microbatch_size": 0}, "performance.microbatch_size"),
    ({"num_threads": 0}, "performance.num_threads"),
    ({"sharding": "fsdp", "clipping": "two_pass"}, "performance.clipping"),
    ({"dtype": "bfloat16", "clipping": "two_pass"}, "performance.clipping"),
    ({"fsdp_mixed_precision": True}, "performance.fsdp_mixed_precision"),
    ({"device": "gpu"}, "performance.device"),
    ({"device": "cuda:0"}, "performance.device"),
])
def test_performance_mistakes_name_their_field(bad, field):
    with pytest.raises(ConfigError) as e:
        validate_tree(from_dict(PerformanceConfig, bad, "performance"), "performance")
    assert e.value.field == field


@pytest.mark.parametrize("ok", [
    {"microbatch_size": 1, "num_threads": 1}, {"sharding": "fsdp", "clipping": "bookkeeping"},
    {"sharding": "fsdp", "fsdp_mixed_precision": True}, {"dtype": "float64", "clipping": "two_pass"},
    {"device": "cpu"}, {"device": "cuda"}, {"device": "auto"}])
def test_performance_settings_that_fit_are_accepted(ok):
    validate_tree(from_dict(PerformanceConfig, ok, "performance"), "performance")


def test_torch_kernels_run_anywhere_triton_needs_what_it_needs(monkeypatch):
    import dptrain.kernels.ghost as ghost

    calls = []
    monkeypatch.setattr(ghost, "available", lambda d: calls.append(d) or "needs CUDA (test)")
    check_kernels(PerformanceConfig(kernels="torch"), torch.device("cpu"))
    assert calls == []  # the torch kernels are not gated
    with pytest.raises(ConfigError) as e:
        check_kernels(PerformanceConfig(kernels="triton"), torch.device("cpu"))
    assert e.value.field == "performance.kernels" and "needs CUDA (test)" in e.value.message
    monkeypatch.setattr(ghost, "available", lambda d: None)
    check_kernels(PerformanceConfig(kernels="triton"), torch.device("cpu"))
