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
    ({"num_threads": 4097}, "performance.num_threads"),
    ({"decode_threads": 0}, "performance.decode_threads"),
    ({"decode_threads": 4097}, "performance.decode_threads"),
    # below a millisecond a timeout fires at once; past 1e7 s gloo's nanoseconds wrap
    ({"collective_timeout_s": 0.0}, "performance.collective_timeout_s"),
    ({"collective_timeout_s": 1e-4}, "performance.collective_timeout_s"),
    ({"collective_timeout_s": -60.0}, "performance.collective_timeout_s"),
    ({"collective_timeout_s": 1.1e7}, "performance.collective_timeout_s"),
    ({"collective_timeout_s": float("nan")}, "performance.collective_timeout_s"),
])
def test_performance_mistakes_name_their_field(bad, field):
    with pytest.raises(ConfigError) as e:
        validate_tree(from_dict(PerformanceConfig, bad, "performance"), "performance")
    assert e.value.field == field


@pytest.mark.parametrize("ok", [
    {"microbatch_size": 1, "num_threads": 1}, {"sharding": "fsdp", "clipping": "bookkeeping"},
    {"sharding": "fsdp", "fsdp_mixed_precision": True}, {"dtype": "float64", "clipping": "two_pass"},
    {"device": "cpu"}, {"device": "cuda"}, {"device": "auto"},
    {"num_threads": 4096, "decode_threads": 4096}, {"decode_threads": 1},
    {"collective_timeout_s": 1e-3}, {"collective_timeout_s": 60.0},
    {"collective_timeout_s": 1e7}])
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


def test_only_settings_that_change_no_arithmetic_go_unnamed_at_a_resume():
    """A resume names the performance settings that differ from the checkpoint's (the run no
    longer repeats it bit for bit), except when the noise is drawn, when the batches are
    assembled, by how many threads the images are decoded, and a timeout: the same numbers."""
    from types import SimpleNamespace

    from dptrain.checkpoint import section_changes
    from dptrain.config import to_dict
    from dptrain.performance import NOT_ARITHMETIC

    saved = {"performance": to_dict(PerformanceConfig())}

    def named(**changed):
        now = SimpleNamespace(performance=PerformanceConfig(**changed))
        return section_changes(saved, now, "performance", skip=NOT_ARITHMETIC)

    assert named() == []
    for same in ({"noise_prefetch": "background"}, {"collate_prefetch": "inline"},
                 {"decode_threads": 3}, {"collective_timeout_s": 60.0}):
        assert named(**same) == [], same
    for other in ({"microbatch_size": 4}, {"dtype": "float64"}, {"num_threads": 2},
                  {"clipping": "two_pass"}, {"ghost": "instantiate"}, {"kernels": "triton"},
                  {"newton_schulz_dtype": "float64"}, {"device": "cpu"},
                  {"sharding": "fsdp"}, {"fsdp_mixed_precision": True}):
        (line,) = named(**other)
        assert line.startswith(f"performance.{next(iter(other))}: "), line
    # values as a config writes them (repr's None and True before)
    assert named(num_threads=2, fsdp_mixed_precision=True, clipping="two_pass") == [
        "performance.clipping: 'auto' -> 'two_pass'", "performance.fsdp_mixed_precision: "
        "false -> true", "performance.num_threads: null -> 2"]
