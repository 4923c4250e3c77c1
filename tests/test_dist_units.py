"""Fast unit contracts of dptrain/parallel/dist.py that a mutation pass found unpinned: the
launcher environment's every refusal and its wording, the rendezvous checks of init_from_env,
one_verdict's choice of refusal on each rank (over a fake all_gather, no processes), the
accelerate settings as accelerate spells them, LOCAL_RANK's bounds and spawn's rank order."""

from __future__ import annotations

import datetime
import multiprocessing
import signal
import time

import pytest

import dptrain.parallel.dist as d
from dptrain.config import ConfigError

LAUNCH = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _env(monkeypatch, **env):
    for name in LAUNCH:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)


@pytest.mark.parametrize("env, want", [
    ({"RANK": "0"}, (0, 1)), ({"WORLD_SIZE": "1"}, (0, 1)), ({"RANK": "0", "WORLD_SIZE": "1"},
                                                             (0, 1)),
    ({"RANK": "0", "WORLD_SIZE": "2"}, (0, 2)), ({"RANK": "1", "WORLD_SIZE": "2"}, (1, 2)),
    ({"RANK": "3", "WORLD_SIZE": "4"}, (3, 4)),
])
def test_launch_environment_reads_rank_and_world(monkeypatch, env, want):
    _env(monkeypatch, **env)
    assert d.launch_environment() == want


@pytest.mark.parametrize("env, field, words", [
    ({"RANK": "1"}, "WORLD_SIZE", "is not set, but RANK is (1): this process would train alone"),
    ({"WORLD_SIZE": "2"}, "RANK", "is not set, but WORLD_SIZE is (2): every process would be "
                                  "rank 0"),
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE", "must be >= 1, got 0"),
    ({"RANK": "0", "WORLD_SIZE": "-1"}, "WORLD_SIZE", "must be >= 1, got -1"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK", "is 2, outside 0..1 (WORLD_SIZE 2"),
    ({"RANK": "-1", "WORLD_SIZE": "2"}, "RANK", "is -1, outside 0..1"),
    ({"RANK": "1", "WORLD_SIZE": "1"}, "RANK", "is 1, outside 0..0"),
    ({"RANK": "1.0", "WORLD_SIZE": "2"}, "RANK", "must be an integer, got '1.0'"),
    ({"RANK": "0", "WORLD_SIZE": "two"}, "WORLD_SIZE", "must be an integer, got 'two'"),
])
def test_launch_environment_refusals_name_the_variable(monkeypatch, env, field, words):
    _env(monkeypatch, **env)
    with pytest.raises(ConfigError) as e:
        d.launch_environment()
    assert e.value.field == field and words in e.value.message, e.value.message


def _fake_group(monkeypatch):
    seen = []
    monkeypatch.setattr(d.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(d.dist, "init_process_group", lambda **kw: seen.append(kw))
    return seen


def test_one_rank_with_a_rendezvous_joins_it(monkeypatch):
    # WORLD_SIZE 1 with MASTER_ADDR is a launch (torchrun --nproc-per-node 1): it joins
    seen = _fake_group(monkeypatch)
    _env(monkeypatch, RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    assert d.init_from_env() == (0, 1)
    assert seen == [{"backend": d.default_backend(), "init_method": "env://", "rank": 0,
                     "world_size": 1}]  # (no timeout given: torch's default, no key)


@pytest.mark.parametrize("env, field", [
    ({"MASTER_ADDR": " ", "MASTER_PORT": "29500"}, "MASTER_ADDR"),
    ({"MASTER_ADDR": "node0", "MASTER_PORT": " "}, "MASTER_PORT"),
    ({"MASTER_ADDR": "node0"}, "MASTER_PORT"),
    ({"MASTER_ADDR": "node0", "MASTER_PORT": "29500x"}, "MASTER_PORT"),
])
def test_a_blank_or_bad_rendezvous_is_refused_before_joining(monkeypatch, env, field):
    seen = _fake_group(monkeypatch)
    _env(monkeypatch, RANK="1", WORLD_SIZE="2", **env)
    with pytest.raises(ConfigError) as e:
        d.init_from_env("gloo")
    assert e.value.field == field and not seen


def test_one_rank_with_a_blank_master_addr_runs_alone(monkeypatch):
    seen = _fake_group(monkeypatch)
    _env(monkeypatch, RANK="0", WORLD_SIZE="1", MASTER_ADDR="  ")
    assert d.init_from_env("gloo") == (0, 1) and not seen


def test_an_existing_group_is_reused(monkeypatch):
    monkeypatch.setattr(d.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(d.dist, "get_rank", lambda group=None: 2)
    monkeypatch.setattr(d.dist, "get_world_size", lambda group=None: 3)
    monkeypatch.setattr(d.dist, "init_process_group", lambda **kw: pytest.fail("joined twice"))
    _env(monkeypatch)
    assert d.init_from_env("gloo") == (2, 3)


def test_the_stop_signals_end_the_process_while_it_waits_for_its_peers(monkeypatch):
    # a Python handler is set aside during the rendezvous and put back after; SIG_IGN is kept
    def handler(signum, frame):
        pass

    during = {}

    def init(**kw):
        during.update({s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)})

    monkeypatch.setattr(d.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(d.dist, "init_process_group", init)
    _env(monkeypatch, RANK="0", WORLD_SIZE="2", MASTER_ADDR="node0", MASTER_PORT="29500")
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        d.init_from_env("gloo")
        assert during == {signal.SIGTERM: signal.SIG_DFL, signal.SIGUSR1: signal.SIG_IGN}
        assert signal.getsignal(signal.SIGTERM) is handler
        assert signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN
    finally:
        for s, h in before.items():
            signal.signal(s, h)


def _verdicts(monkeypatch, errors, values=None):
    """What one_verdict does on each rank of ``len(errors)`` over a fake all_gather_object:
    ("ok", values) or ("raised", field, message, every_rank, raised its own error object)."""
    world = len(errors)
    values = values or [None] * world
    sent = [(v, None if e is None else (e.field, e.message)) for v, e in zip(values, errors)]
    monkeypatch.setattr(d.dist, "get_world_size", lambda group=None: world)
    monkeypatch.setattr(d.dist, "all_gather_object", lambda out, obj: out.__setitem__(
        slice(None), sent))
    got = []
    for rank in range(world):
        monkeypatch.setattr(d.dist, "get_rank", lambda group=None, r=rank: r)
        mine = errors[rank] and ConfigError(errors[rank].field, errors[rank].message)
        try:
            got.append(("ok", d.one_verdict(mine, True, values[rank])))
        except ConfigError as e:
            got.append(("raised", e.field, e.message, e.every_rank, e is mine))
    return got


def test_one_verdict_without_a_refusal_gives_every_rank_s_value_in_rank_order(monkeypatch):
    assert _verdicts(monkeypatch, [None] * 3, ["a", "b", "c"]) == [("ok", ["a", "b", "c"])] * 3


def test_one_verdict_in_one_process_raises_or_wraps_the_value():
    assert d.one_verdict(None, False, 7) == [7]
    error = ConfigError("f", "no")
    with pytest.raises(ConfigError) as e:
        d.one_verdict(error, False, 7)
    assert e.value is error and not e.value.every_rank  # (one process: it says it itself)


def test_one_verdict_raises_the_first_refusal_everywhere_with_its_rank(monkeypatch):
    no = ConfigError("f", "no")
    assert _verdicts(monkeypatch, [None, None, no]) == [
        ("raised", "f", "no (on rank 2)", True, False),  # rank 0 says it, naming the rank
        ("raised", "f", "no (on rank 2)", True, False),
        ("raised", "f", "no", True, True)]  # (its own: rank 0 says it)
    assert _verdicts(monkeypatch, [no, None]) == [("raised", "f", "no", True, True),
                                                  ("raised", "f", "no", True, False)]


def test_one_verdict_a_rank_with_another_refusal_says_its_own(monkeypatch):
    first, other, same = ConfigError("f", "no"), ConfigError("f", "other"), ConfigError("f", "no")
    assert _verdicts(monkeypatch, [None, first, other, same]) == [
        ("raised", "f", "no (on rank 1)", True, False),
        ("raised", "f", "no", True, True),
        ("raised", "f", "other", False, True),  # (same field, another message: its own, said)
        ("raised", "f", "no (on rank 1)", True, False)]  # (the same refusal: rank 0 says it)
    assert _verdicts(monkeypatch, [first, ConfigError("g", "no")]) == [
        ("raised", "f", "no", True, True), ("raised", "g", "no", False, True)]


@pytest.mark.parametrize("name", ["ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED",
                                  "ACCELERATE_USE_MEGATRON_LM",
                                  "ACCELERATE_USE_PARALLELISM_CONFIG"])
def test_every_accelerate_use_flag_that_is_true_is_refused(monkeypatch, name):
    for other in ("ACCELERATE_MIXED_PRECISION", "ACCELERATE_DYNAMO_BACKEND", *d._ACCELERATE_USE):
        monkeypatch.delenv(other, raising=False)
    for off in ("false", "False", ""):
        monkeypatch.setenv(name, off)
        d.check_accelerate_settings()
    for on in ("true", " True\n"):
        monkeypatch.setenv(name, on)
        with pytest.raises(ConfigError) as e:
            d.check_accelerate_settings()
        assert e.value.field == name


@pytest.mark.parametrize("name", ["ACCELERATE_MIXED_PRECISION", "ACCELERATE_DYNAMO_BACKEND"])
def test_accelerate_precision_and_dynamo_pass_only_when_off(monkeypatch, name):
    for other in ("ACCELERATE_MIXED_PRECISION", "ACCELERATE_DYNAMO_BACKEND", *d._ACCELERATE_USE):
        monkeypatch.delenv(other, raising=False)
    for off in ("no", "NO", " no\n", ""):
        monkeypatch.setenv(name, off)
        d.check_accelerate_settings()
    for on in ("fp16", "bf16", "fp8", "eager", "INDUCTOR"):
        monkeypatch.setenv(name, on)
        with pytest.raises(ConfigError) as e:
            d.check_accelerate_settings()
        assert e.value.field == name and repr(on) in e.value.message


def test_local_rank_must_be_one_of_this_node_s_gpus(monkeypatch):
    monkeypatch.setattr(d.torch.cuda, "device_count", lambda: 2)
    for value in ("0", "1"):
        _env(monkeypatch, RANK="1", WORLD_SIZE="4", LOCAL_RANK=value)
        assert d.local_rank() == int(value)
    for value in ("2", "-1"):
        _env(monkeypatch, RANK="1", WORLD_SIZE="4", LOCAL_RANK=value)
        with pytest.raises(ConfigError) as e:
            d.local_rank()
        assert e.value.field == "LOCAL_RANK" and "this node has 2 GPU(s)" in e.value.message
    _env(monkeypatch, RANK="0", WORLD_SIZE="1")  # (one rank: cuda:0 is its own)
    assert d.local_rank() == 0


def test_shard_bounds_give_every_row_to_exactly_one_rank_balanced_within_a_chunk():
    for world in range(1, 9):
        for dim0 in range(0, 40):
            rows = [i for r in range(world) for i in range(*d.shard_bounds(dim0, r, world))]
            assert rows == list(range(dim0)), (dim0, world)
            sizes = [e - s for s, e in (d.shard_bounds(dim0, r, world) for r in range(world))]
            assert sizes == sorted(sizes, reverse=True) and max(sizes) == -(-dim0 // world)


def _slow_first(rank: int, world: int) -> tuple[int, int]:
    import torch

    time.sleep(0.5 * (world - 1 - rank))  # rank 0 finishes last
    return rank, torch.get_num_threads()


@pytest.mark.distributed
def test_spawn_orders_results_by_rank_not_arrival_and_sets_the_threads():
    assert d.spawn(_slow_first, 3, num_threads=2, timeout=120) == [(0, 2), (1, 2), (2, 2)]


def _sleep(rank: int, world: int) -> None:
    time.sleep(60)


@pytest.mark.distributed
def test_spawn_timeout_ends_the_ranks_it_started():
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="within 2"):
        d.spawn(_sleep, 2, timeout=2)
    assert time.monotonic() - t0 >= 2
    assert not [p for p in multiprocessing.active_children() if p.is_alive()]


def test_collective_timeout_is_handed_to_the_process_group(monkeypatch):
    seen = _fake_group(monkeypatch)
    _env(monkeypatch, RANK="1", WORLD_SIZE="2", MASTER_ADDR="node0", MASTER_PORT="29500")
    d.init_from_env("gloo", timeout=datetime.timedelta(seconds=5))
    assert seen[0]["timeout"] == datetime.timedelta(seconds=5) and seen[0]["rank"] == 1


def test_an_nccl_rank_takes_its_local_rank_s_gpu_before_joining(monkeypatch):
    seen = _fake_group(monkeypatch)
    devices = []
    monkeypatch.setattr(d.torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(d.torch.cuda, "set_device", lambda i: devices.append((i, len(seen))))
    _env(monkeypatch, RANK="3", WORLD_SIZE="4", LOCAL_RANK="1", MASTER_ADDR="node0",
         MASTER_PORT="29500")
    assert d.init_from_env("nccl") == (3, 4)
    assert devices == [(1, 0)] and seen[0]["backend"] == "nccl"  # (set before the group)
    d.init_from_env("gloo")
    assert devices == [(1, 0)]  # (gloo: no device)


def _rank_1_exits_without_a_result(rank: int, world: int) -> int:
    import os

    if rank == 1:
        os._exit(0)  # (exit status 0, nothing queued)
    return rank


@pytest.mark.distributed
def test_spawn_names_a_rank_that_returned_nothing():
    with pytest.raises(RuntimeError, match=r"no result from ranks \[1\]"):
        d.spawn(_rank_1_exits_without_a_result, 2, timeout=120)
