"""Small process-group helpers shared by dptrain's distributed code and its tests.

- ``init_from_env()``: join the process group described by the environment variables that
  ``accelerate launch`` / ``torchrun`` set (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
  LOCAL_RANK); backend NCCL when CUDA is available, gloo otherwise.
- ``get_rank`` / ``get_world_size`` / ``is_distributed``: 0 / 1 / False without a process group,
  so single-process code paths need no special casing.
- ``shard_bounds(dim0, rank, world)``: the rows of a dim-0 sharded tensor that ``rank`` holds,
  with FSDP2's ``Shard(0)`` (``torch.chunk``) semantics.
- ``find_free_port()`` and ``spawn(fn, world_size, *args)``: start ``world_size`` CPU processes
  on gloo (tests and benchmarks), collecting each rank's return value.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import queue as queue_mod
import signal
import socket
import threading
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

__all__ = [
    "default_backend",
    "find_free_port",
    "get_rank",
    "get_world_size",
    "init_from_env",
    "is_distributed",
    "launch_environment",
    "shard_bounds",
    "spawn",
]


def default_backend() -> str:
    """``"nccl"`` when CUDA is available, else ``"gloo"``."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def is_distributed() -> bool:
    """Whether a default process group exists (and so collectives are needed)."""
    return dist.is_available() and dist.is_initialized()


def get_rank(group: dist.ProcessGroup | None = None) -> int:
    """Rank in ``group`` (default group when None); 0 without a process group."""
    return dist.get_rank(group) if is_distributed() else 0


def get_world_size(group: dist.ProcessGroup | None = None) -> int:
    """Size of ``group`` (default group when None); 1 without a process group."""
    return dist.get_world_size(group) if is_distributed() else 1


def init_from_env(backend: str | None = None, *,
                  timeout: datetime.timedelta | None = None) -> tuple[int, int]:
    """Initialise the default process group from the launcher's environment; returns (rank, world).

    Reads RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (as ``accelerate launch`` and ``torchrun``
    set them). Without WORLD_SIZE (a plain ``python`` run), or with WORLD_SIZE 1 and no
    MASTER_ADDR, nothing is initialised and (0, 1) is returned. Idempotent: an existing group
    is reused. With NCCL the CUDA device is set from LOCAL_RANK first, so each rank gets its
    own GPU.
    """
    if is_distributed():
        return dist.get_rank(), dist.get_world_size()
    rank, world = launch_environment()
    if world == 1 and not os.environ.get("MASTER_ADDR", "").strip():
        # (one process needs no rendezvous: some platforms export RANK=0 WORLD_SIZE=1 alone)
        return 0, 1
    from dptrain.config import ConfigError

    for name in ("MASTER_ADDR", "MASTER_PORT"):  # (torch's env:// raised a bare ValueError)
        if not os.environ.get(name, "").strip():
            raise ConfigError(name, f"is not set, but WORLD_SIZE is ({world}): the ranks "
                                    f"cannot meet; torchrun and accelerate launch set it")
    if not os.environ["MASTER_PORT"].strip().isdigit():
        raise ConfigError("MASTER_PORT", f"must be a port number, got "
                                         f"{os.environ['MASTER_PORT']!r} (environment)")
    backend = backend or default_backend()
    if backend == "nccl":
        torch.cuda.set_device(local_rank())
    kwargs: dict[str, Any] = {}
    if timeout is not None:
        kwargs["timeout"] = timeout
    with _stop_signals_terminate():
        dist.init_process_group(backend=backend, init_method="env://", rank=rank,
                                world_size=world, **kwargs)
    return rank, world


@contextlib.contextmanager
def _stop_signals_terminate():
    """While the ranks meet, the stop signals (SIGTERM, SIGUSR1) take their default action (the
    process ends) instead of a Python handler's (``dptrain train``'s stop request): the
    rendezvous waits in C++, where no Python handler runs, so a rank whose peers never came
    ignored every SIGTERM until the timeout (30 minutes with gloo; an audit). Nothing is there
    to checkpoint yet."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    from dptrain.commands.train import STOP_SIGNALS  # (that module stays free of torch)

    handlers = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    handlers = {s: h for s, h in handlers.items() if callable(h)}  # (not SIG_IGN, SIG_DFL)
    for s in handlers:
        signal.signal(s, signal.SIG_DFL)
    try:
        yield
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)


def one_verdict(error, several: bool, value=None) -> list:
    """Each rank's ``value`` (``[value]`` in one process), once every rank has said whether a
    check refused (``error``, a ConfigError or None): a refusal on any rank is raised on every
    rank, the first rank's that refused, which rank 0 prints ("(on rank R)"; the others stay
    silent), except that a rank whose own refusal differs raises, and prints, its own. A rank refusing alone would
    leave the others in a collective (gloo: a traceback; NCCL: a hang until the timeout)."""
    if not several:
        if error is not None:
            raise error
        return [value]
    from dptrain.config import ConfigError, said_by_rank_0

    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, (value, None if error is None else (error.field,
                                                                       error.message)))
    for rank, (_, theirs) in enumerate(every):
        if theirs is None:
            continue
        # the first refusal is said by rank 0 (its own, or another's with the rank); a rank
        # whose own refusal is another says it itself
        if error is not None and rank != dist.get_rank() and (error.field,
                                                             error.message) != theirs:
            raise error
        raise said_by_rank_0(error if rank == dist.get_rank() and error is not None else
                             ConfigError(theirs[0], theirs[1] + (f" (on rank {rank})"
                                                                 if rank else "")))
    return [v for v, _ in every]


def launch_environment() -> tuple[int, int]:
    """(RANK, WORLD_SIZE) as a launcher set them, (0, 1) for a plain process; a ConfigError
    naming the variable where they are incomplete or inconsistent (a rank that silently ran
    alone, or waited for a peer that never came, named neither)."""
    from dptrain.config import ConfigError

    def integer(name: str) -> int | None:
        raw = os.environ.get(name)
        if raw is None:
            return None
        try:
            return int(raw)
        except ValueError:
            raise ConfigError(name, f"must be an integer, got {raw!r} (environment)") from None

    rank, world = integer("RANK"), integer("WORLD_SIZE")
    launcher = "torchrun and accelerate launch set both"
    if world is None:
        if rank not in (None, 0):
            raise ConfigError("WORLD_SIZE", f"is not set, but RANK is ({rank}): this process "
                                            f"would train alone; {launcher}")
        return 0, 1
    if world < 1:
        raise ConfigError("WORLD_SIZE", f"must be >= 1, got {world} (environment)")
    if rank is None:
        if world > 1:
            raise ConfigError("RANK", f"is not set, but WORLD_SIZE is ({world}): every process "
                                      f"would be rank 0; {launcher}")
        rank = 0
    if not 0 <= rank < world:
        raise ConfigError("RANK", f"is {rank}, outside 0..{world - 1} (WORLD_SIZE {world}, "
                                  f"environment)")
    return rank, world


# accelerate launch exports its config's settings for an Accelerator to read (accelerate's
# utils/launch.py); dptrain builds none, so these were dropped without a word
_ACCELERATE_USE = {
    "ACCELERATE_USE_FSDP": "accelerate's FSDP",
    "ACCELERATE_USE_DEEPSPEED": "DeepSpeed",
    "ACCELERATE_USE_MEGATRON_LM": "Megatron-LM",
    "ACCELERATE_USE_PARALLELISM_CONFIG": "accelerate's parallelism config",
}


def check_accelerate_settings() -> None:
    """Refuse the accelerate settings that dptrain does not apply (it uses accelerate as a
    launcher only, and builds no ``Accelerator``): a mixed precision, FSDP (a replicated run,
    a whole model per GPU, where sharding was asked for), DeepSpeed, Megatron-LM, a
    parallelism config or a dynamo backend. A ConfigError naming the variable; "no" and
    "false", what accelerate exports when they are off, pass."""
    from dptrain.config import ConfigError

    precision = os.environ.get("ACCELERATE_MIXED_PRECISION", "no").strip()
    if precision.lower() not in ("", "no"):
        raise ConfigError("ACCELERATE_MIXED_PRECISION", (
            f"is {precision!r} (accelerate's mixed_precision, from accelerate launch or the "
            "environment), which dptrain does not apply: unset it, or launch with "
            "--mixed_precision no (mixed_precision: 'no' in the accelerate config), and set "
            "performance.dtype or performance.fsdp_mixed_precision"))
    for name, what in _ACCELERATE_USE.items():
        if os.environ.get(name, "").strip().lower() == "true":
            raise ConfigError(name, (
                f"is true ({what}), which dptrain does not apply: launch with distributed_type: "
                "MULTI_GPU (or --multi_gpu) and shard with performance.sharding=fsdp (dptrain "
                "applies FSDP2 itself)"))
    backend = os.environ.get("ACCELERATE_DYNAMO_BACKEND", "no").strip()
    if backend.lower() not in ("", "no"):
        raise ConfigError("ACCELERATE_DYNAMO_BACKEND", (
            f"is {backend!r} (accelerate's dynamo_backend), which dptrain does not apply (it "
            "does not compile the model): launch with --dynamo_backend no"))


def local_rank() -> int:
    """This process's GPU on its node (LOCAL_RANK, as torchrun and accelerate launch set it; 0
    for a plain process), for CUDA runs; a ConfigError naming LOCAL_RANK where it is not an
    integer, is not this node's GPU, or is missing with several ranks (each would take cuda:0:
    a launcher that sets only RANK and WORLD_SIZE, e.g. ``srun`` without it)."""
    from dptrain.config import ConfigError

    raw = os.environ.get("LOCAL_RANK")
    if raw is None:
        _, world = launch_environment()
        if world > 1:
            raise ConfigError("LOCAL_RANK", f"is not set, but WORLD_SIZE is ({world}): every "
                                            f"rank would use cuda:0; torchrun and accelerate "
                                            f"launch set it (under srun: "
                                            f"LOCAL_RANK=$SLURM_LOCALID)")
        return 0
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError("LOCAL_RANK", f"must be an integer, got {raw!r} (environment)") from None
    count = torch.cuda.device_count()
    if not 0 <= value < count:
        raise ConfigError("LOCAL_RANK", f"is {value}, but this node has {count} GPU(s) "
                                        f"(environment)")
    return value


def shard_bounds(dim0: int, rank: int, world: int) -> tuple[int, int]:
    """Rows ``[start, end)`` of a length-``dim0`` dimension held by ``rank`` of ``world``.

    ``torch.chunk`` semantics, as FSDP2's ``Shard(0)`` uses: every rank gets ceil(dim0 / world)
    rows except at the end, where the last non-empty rank may get fewer and trailing ranks get
    none (e.g. dim0 = 5, world = 4: 2, 2, 1, 0 rows).
    """
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} out of range for world size {world}")
    if dim0 < 0:
        raise ValueError(f"dim0 must be >= 0, got {dim0}")
    chunk = -(-dim0 // world)  # ceil
    start = min(rank * chunk, dim0)
    return start, min(start + chunk, dim0)


def find_free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bind to port 0, read it, close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        return int(s.getsockname()[1])


def _spawn_entry(rank: int, fn: Callable[..., Any], world_size: int, port: int, backend: str,
                 num_threads: int | None, results: Any, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    init_from_env(backend, timeout=datetime.timedelta(seconds=120))
    try:
        out = fn(rank, world_size, *args)
        # Plain pickle copies tensors by value (no shared-memory handles that would die with
        # this process before the parent reads them).
        results.put((rank, pickle.dumps(out)))
    finally:
        dist.destroy_process_group()


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo",
          num_threads: int | None = 1, timeout: float = 300.0,
          start_method: str | None = None) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` fresh processes; return their results.

    Each process joins a process group (gloo by default, on a free local port) before ``fn``
    and leaves it after; ``torch.set_num_threads(num_threads)`` keeps a shared CPU from being
    oversubscribed. ``fn`` and its arguments must be picklable (a module-level function); its
    return value is pickled back, and the list is ordered by rank. An exception in any rank is
    re-raised here (``torch.multiprocessing.ProcessRaisedException``); a run longer than
    ``timeout`` seconds is terminated and raises ``TimeoutError``.

    ``start_method``: "forkserver" by default where available (the fork server imports torch
    once and forks every rank from it, so W ranks cost one torch import instead of W: seconds
    per test on a shared 2-core machine), else "spawn". Neither forks the calling process itself
    (which may have running threads); ranks inherit none of its state.
    """
    import multiprocessing

    import torch.multiprocessing as mp

    if start_method is None:
        start_method = ("forkserver" if "forkserver" in multiprocessing.get_all_start_methods()
                        else "spawn")
    if start_method == "forkserver":
        # Only takes effect when this process starts its fork server (the first time).
        multiprocessing.set_forkserver_preload(["torch", "torch.distributed", __name__])
    port = find_free_port()
    results = mp.get_context(start_method).Queue()
    ctx = mp.start_processes(
        _spawn_entry, args=(fn, world_size, port, backend, num_threads, results, args),
        nprocs=world_size, join=False, start_method=start_method)
    got: dict[int, Any] = {}

    def drain() -> None:
        while True:
            try:
                rank, payload = results.get_nowait()
            except queue_mod.Empty:
                return
            got[rank] = pickle.loads(payload)

    deadline = time.monotonic() + timeout
    try:
        while True:
            drain()  # before join: a child blocks on exit until its queued result is read
            if ctx.join(timeout=0.05):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"spawned ranks did not finish within {timeout} s")
    finally:
        for p in ctx.processes:  # only the processes started here
            if p.is_alive():
                p.terminate()
        for p in ctx.processes:
            p.join(timeout=5)
    drain()
    # The queue's feeder thread may deliver the last items just after the process exits.
    end = time.monotonic() + 10
    while len(got) < world_size and time.monotonic() < end:
        try:
            rank, payload = results.get(timeout=0.1)
            got[rank] = pickle.loads(payload)
        except queue_mod.Empty:
            pass
    missing = [r for r in range(world_size) if r not in got]
    if missing:
        raise RuntimeError(f"no result from ranks {missing}")
    return [got[r] for r in range(world_size)]
