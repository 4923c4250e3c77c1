"""Distributed Newton–Schulz for row-sharded (FSDP2 ``Shard(0)``) matrices.

Every rank holds rows ``shard_bounds(m, rank, W)`` of every (m, n) matrix (a conv weight
(out, in, kh, kw) is viewed as (out, in*kh*kw)). ``distributed_newton_schulz`` takes each
rank's local row shards and returns its rows of ``newton_schulz(full_matrix)`` (same steps,
coefficient schedule and normalisation as :func:`dptrain.optim.newton_schulz.newton_schulz`), by
one of two strategies chosen per matrix:

**owner-compute** (``"owner"``): whole matrices are assigned to ranks by longest-processing-time
(LPT) load balancing (:func:`assign_owners`); ONE ``all_to_all_single`` (split sizes, flattened
concatenated buffers; gloo supports it on CPU, NCCL on GPU) sends every matrix's row shards to
its owner, the owner runs the single-process ``newton_schulz`` on the full matrix, and ONE more
all-to-all returns every rank its rows of the result. Communication: each matrix crosses the
network twice (m*n elements each way, (W-1)/W of it off-rank); compute: the full NS of the
matrix, on its owner only. Results are those of ``newton_schulz`` on the same matrix (the same
code runs on the same full matrix).

**model-parallel** (``"model_parallel"``): X stays row-sharded. ``||X||_F`` comes from one
all-reduce of the local squared norms, then every iteration is
``A = all_reduce(X_r^T X_r)`` (n x n), ``X_r <- a X_r + X_r (b A + c A^2)`` locally, which is
the polynomial a X + b X X^T X + c (X X^T)^2 X written with X^T X (``(X X^T) X = X (X^T X)``).
Per iteration and rank: 4 * ceil(m/W) * n^2 + 2 n^3 flops (the n^3 of A^2 is replicated on
every rank) and one all-reduce of n^2 elements; all model-parallel matrices share one
all-reduce per iteration (grams concatenated). For a tall or square matrix (m >= n) the gram is
the small side, so the scheme scales; for a WIDE matrix (m < n) it still computes the right
thing but A is n x n, bigger than the matrix itself: the replicated 2 n^3 dominates and every
rank holds an n x n buffer, so the cost model never picks it for wide matrices (owner-compute is
used even above ``max_owner_numel``: model-parallel would need more memory per rank, not less).
A column-resharded variant (all-to-all to column shards, then the m x m gram) would fix that;
it is not implemented.

**auto** (default): matrices with m >= n and m*n > ``max_owner_numel`` (too big for one rank)
are model-parallel; for the rest, the cost model estimates the per-rank makespan
(LPT makespan of the owner matrices + the per-rank cost of the model-parallel ones, flops plus a
weighted count of communicated elements) and moves the k most expensive tall/square matrices
to model-parallel for the k (0 included) that gives the lowest makespan, e.g. one dominant
matrix that LPT cannot balance. With
many similar matrices (GPT-2, ResNet) everything stays owner-compute, as in Dion, torchtitan's
DistMuon and DMuon. The plan depends only on the shapes, the world size and the options, so
every rank computes the same plan without communication.

World size 1 (or no process group) runs ``newton_schulz`` per matrix, without communication.
"""

from __future__ import annotations

import functools
import heapq
import math
from dataclasses import dataclass
from typing import Callable, Literal, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from dptrain.optim.newton_schulz import (
    _POLAR_EXPRESS_EPS,
    _POLAR_EXPRESS_SAFETY,
    Coefficients,
    _schedule,
    newton_schulz,
)
from dptrain.parallel.dist import get_rank, get_world_size, shard_bounds

__all__ = [
    "DEFAULT_MAX_OWNER_NUMEL",
    "NSPlan",
    "assign_owners",
    "distributed_newton_schulz",
    "model_parallel_cost",
    "ns_flops",
    "owner_cost",
    "plan_newton_schulz",
]

Strategy = Literal["auto", "owner", "model_parallel"]

DEFAULT_MAX_OWNER_NUMEL = 1 << 26
"""Largest matrix (elements) that ``"auto"`` gathers on one rank: 64 Mi elements (256 MiB in
fp32; the owner also needs about twice that in NS workspace). GPT-2 XL's largest Muon matrix is
1600 x 6400 = 10 Mi elements; only very large models exceed it."""

COMM_FLOPS_PER_ELEMENT = 100.0
"""Cost-model weight of one communicated element, in flops. Order of magnitude only (CPU + gloo
~ 1e2, GPU + NCCL ~ 1e3-1e4); it matters only when owner-compute and model-parallel are close,
and both are exact, so a wrong guess costs time, never correctness."""

_LOW_PRECISION = (torch.bfloat16, torch.float16)


# --------------------------------------------------------------------------------------------
# Cost model and planning (pure functions of shapes; identical on every rank)
# --------------------------------------------------------------------------------------------

def ns_flops(m: int, n: int, steps: int) -> float:
    """Flops of single-process ``newton_schulz`` on an (m, n) matrix: per step the s x s gram
    (s = min(m, n), l = max(m, n)) 2 s^2 l, A @ A 2 s^3, B @ X 2 s^2 l."""
    s, l = min(m, n), max(m, n)
    return float(steps) * (4.0 * s * s * l + 2.0 * s ** 3)


def owner_cost(m: int, n: int, steps: int, world: int) -> float:
    """Owner-compute load of one matrix on its owner: the full NS plus the matrix crossing the
    network twice (the owner receives (W-1)/W of it and sends as much back)."""
    comm = 2.0 * m * n * (world - 1) / world if world > 1 else 0.0
    return ns_flops(m, n, steps) + COMM_FLOPS_PER_ELEMENT * comm


def model_parallel_cost(m: int, n: int, steps: int, world: int) -> float:
    """Model-parallel load of one matrix on EVERY rank: per step the local gram and X_r @ B
    (4 * ceil(m/W) * n^2), the replicated A @ A (2 n^3), and a ring all-reduce of the n x n gram
    (2 n^2 (W-1)/W elements). For wide matrices n is the long side: this is large by design."""
    rows = -(-m // world)
    comm = 2.0 * n * n * (world - 1) / world if world > 1 else 0.0
    return float(steps) * (4.0 * rows * n * n + 2.0 * n ** 3 + COMM_FLOPS_PER_ELEMENT * comm)


def assign_owners(costs: Sequence[float], world_size: int) -> list[int]:
    """Longest-processing-time assignment: owner rank of each job, in input order.

    Jobs are taken in decreasing cost (ties: lower index first) and each goes to the currently
    least-loaded rank (ties: lower rank). Deterministic, so every rank computes the same owners.
    Graham's bound: the largest load is at most (4/3 - 1/(3W)) times the optimum.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    owners = [0] * len(costs)
    heap = [(0.0, r) for r in range(world_size)]  # (load, rank): min-heap, ties by rank
    for i in sorted(range(len(costs)), key=lambda i: (-float(costs[i]), i)):
        load, r = heapq.heappop(heap)
        owners[i] = r
        heapq.heappush(heap, (load + float(costs[i]), r))
    return owners


def _lpt_makespan(costs: Sequence[float], world: int) -> float:
    owners = assign_owners(costs, world)
    loads = [0.0] * world
    for c, r in zip(costs, owners):
        loads[r] += c
    return max(loads)


@dataclass(frozen=True)
class NSPlan:
    """Per-matrix method ("local", "owner" or "model_parallel") and owner rank (-1 if none)."""

    world_size: int
    methods: tuple[str, ...]
    owners: tuple[int, ...]
    est_makespan: float  # estimated flop-equivalents on the busiest rank


@functools.lru_cache(maxsize=64)
def _plan_cached(shapes: tuple[tuple[int, int], ...], world: int, steps: int, strategy: str,
                 max_owner_numel: int | None) -> NSPlan:
    n_mat = len(shapes)
    if world == 1:
        est = sum(ns_flops(m, n, steps) for m, n in shapes)
        return NSPlan(1, ("local",) * n_mat, (0,) * n_mat, est)
    own = [owner_cost(m, n, steps, world) for m, n in shapes]
    mp = [model_parallel_cost(m, n, steps, world) for m, n in shapes]

    if strategy == "owner":
        mp_set: set[int] = set()
    elif strategy == "model_parallel":
        mp_set = set(range(n_mat))
    elif strategy == "auto":
        limit = math.inf if max_owner_numel is None else max_owner_numel
        # Too big for one rank and model-parallel actually smaller per rank (m >= n).
        forced = {i for i, (m, n) in enumerate(shapes) if m >= n and m * n > limit}
        candidates = sorted(
            (i for i, (m, n) in enumerate(shapes) if i not in forced and m >= n and mp[i] < own[i]),
            key=lambda i: (-own[i], i))
        best_k, best = 0, math.inf
        for k in range(len(candidates) + 1):
            chosen = forced | set(candidates[:k])
            rest = [own[i] for i in range(n_mat) if i not in chosen]
            span = (_lpt_makespan(rest, world) if rest else 0.0) + sum(mp[i] for i in chosen)
            if span < best * (1 - 1e-9):  # strictly better: prefer owner-compute on ties
                best_k, best = k, span
        mp_set = forced | set(candidates[:best_k])
    else:
        raise ValueError(f"strategy must be 'auto', 'owner' or 'model_parallel', got {strategy!r}")

    owner_ids = [i for i in range(n_mat) if i not in mp_set]
    sub_owners = assign_owners([own[i] for i in owner_ids], world)
    owners = [-1] * n_mat
    loads = [0.0] * world
    for i, r in zip(owner_ids, sub_owners):
        owners[i] = r
        loads[r] += own[i]
    est = max(loads) + sum(mp[i] for i in mp_set)
    methods = tuple("model_parallel" if i in mp_set else "owner" for i in range(n_mat))
    return NSPlan(world, methods, tuple(owners), est)


def plan_newton_schulz(shapes: Sequence[tuple[int, int]], world_size: int, *, steps: int = 5,
                       strategy: Strategy = "auto",
                       max_owner_numel: int | None = DEFAULT_MAX_OWNER_NUMEL) -> NSPlan:
    """The plan ``distributed_newton_schulz`` follows for these (m, n) shapes (cached)."""
    key = tuple((int(m), int(n)) for m, n in shapes)
    return _plan_cached(key, int(world_size), int(steps), strategy, max_owner_numel)


# --------------------------------------------------------------------------------------------
# Execution
# --------------------------------------------------------------------------------------------

def _rows(m: int, rank: int, world: int) -> int:
    start, end = shard_bounds(m, rank, world)
    return end - start


def _by_dtype(idx: Sequence[int], mats: Sequence[Tensor]) -> list[list[int]]:
    """Split matrix indices by dtype, groups in a rank-independent order (one buffer each)."""
    groups: dict[str, list[int]] = {}
    for i in idx:
        groups.setdefault(str(mats[i].dtype), []).append(i)
    return [groups[k] for k in sorted(groups)]


def _owner_compute(mats: list[Tensor], idx: list[int], shapes: Sequence[tuple[int, int]],
                   owners: Sequence[int], out: list[Tensor | None], *, rank: int, world: int,
                   group: dist.ProcessGroup | None, steps: int, coefficients: Coefficients,
                   eps: float, fn: Callable[[int, Tensor], Tensor] | None = None) -> None:
    for ids in _by_dtype(idx, mats):
        dtype, device = mats[ids[0]].dtype, mats[ids[0]].device
        by_owner: list[list[int]] = [[] for _ in range(world)]
        for i in ids:  # ascending matrix index within each owner
            by_owner[owners[i]].append(i)
        mine = by_owner[rank]

        # Phase 1: my rows of every matrix -> its owner. Send layout: by destination, then
        # matrix index; receive layout: by source rank, then my matrices in index order.
        send_split = [sum(mats[i].numel() for i in by_owner[d]) for d in range(world)]
        recv_split = [sum(_rows(shapes[i][0], s, world) * shapes[i][1] for i in mine)
                      for s in range(world)]
        send_parts = [mats[i].reshape(-1) for d in range(world) for i in by_owner[d]]
        send = torch.cat(send_parts) if send_parts else torch.empty(0, dtype=dtype, device=device)
        recv = torch.empty(sum(recv_split), dtype=dtype, device=device)
        dist.all_to_all_single(recv, send, recv_split, send_split, group=group)

        pieces: dict[int, list[Tensor]] = {i: [] for i in mine}
        off = 0
        for s in range(world):
            for i in mine:
                k = _rows(shapes[i][0], s, world) * shapes[i][1]
                pieces[i].append(recv[off:off + k].view(-1, shapes[i][1]))
                off += k
        results = {i: (fn(i, torch.cat(pieces[i])).to(dtype) if fn is not None
                       else newton_schulz(torch.cat(pieces[i]), steps, coefficients=coefficients,
                                          eps=eps)) for i in mine}
        del recv, pieces

        # Phase 2: rows of each result -> the rank that holds them. Split sizes are phase 1's,
        # swapped.
        back_parts = []
        for d in range(world):
            for i in mine:
                start, end = shard_bounds(shapes[i][0], d, world)
                back_parts.append(results[i][start:end].reshape(-1))
        back = torch.cat(back_parts) if back_parts else torch.empty(0, dtype=dtype, device=device)
        mine_back = torch.empty(sum(send_split), dtype=dtype, device=device)
        dist.all_to_all_single(mine_back, back, send_split, recv_split, group=group)
        off = 0
        for d in range(world):
            for i in by_owner[d]:
                k = mats[i].numel()
                out[i] = mine_back[off:off + k].view(mats[i].shape)
                off += k


def _model_parallel(mats: list[Tensor], idx: list[int], shapes: Sequence[tuple[int, int]],
                    out: list[Tensor | None], *, group: dist.ProcessGroup | None, steps: int,
                    coefficients: Coefficients, eps: float) -> None:
    schedule = _schedule(coefficients, steps)
    for ids in _by_dtype(idx, mats):
        dtype = mats[ids[0]].dtype
        # Grams are reduced in fp32 for bf16/fp16 inputs (one rounding to the input dtype after
        # the sum, as the single-process product rounds once), else in the dtype.
        red = torch.float32 if dtype in _LOW_PRECISION else dtype

        # Frobenius norms: one all-reduce of all local squared norms, in float64, where no
        # float32 or bf16 square overflows (in float32 a norm over ~1.8e19 was inf, and X / inf
        # = 0). denom = m 2^e with m in [0.5, 1): in float32 and bf16, X 2^-e / m rounds as
        # X / denom does, also where denom itself is past their range (barring entries that
        # 2^-e makes subnormal). float16's normal range is too narrow for that (X 2^-e is often
        # subnormal there): X / denom in float32, rounded once to float16. float64: X / denom.
        sq = torch.stack([mats[i].to(torch.float64).square().sum() for i in ids])
        dist.all_reduce(sq, group=group)
        norm = sq.sqrt()
        if coefficients == "polar_express":
            denom = norm * _POLAR_EXPRESS_SAFETY + _POLAR_EXPRESS_EPS
        else:
            denom = norm + eps
        denom = torch.where(denom > 0, denom, 1.0)  # (a zero matrix with eps = 0: 0 / 1, not NaN)
        if dtype == torch.float64:
            xs = [mats[i] / denom[k] for k, i in enumerate(ids)]
        elif dtype == torch.float16:
            xs = [(mats[i].float() / denom[k].float()).half() for k, i in enumerate(ids)]
        else:
            mant, expo = torch.frexp(denom)
            xs = [torch.ldexp(mats[i], -expo[k]) / mant[k].to(dtype) for k, i in enumerate(ids)]

        for a, b, c in schedule:
            # One all-reduce per iteration for every model-parallel matrix: X_r^T X_r, (n, n).
            grams = [(x.to(red).mT @ x.to(red)).reshape(-1) for x in xs]
            flat = torch.cat(grams)
            dist.all_reduce(flat, group=group)
            off = 0
            for k, i in enumerate(ids):
                n = shapes[i][1]
                A = flat[off:off + n * n].view(n, n).to(dtype)
                off += n * n
                B = torch.addmm(A, A, A, beta=b, alpha=c)  # b*A + c*A@A
                xs[k] = torch.addmm(xs[k], xs[k], B, beta=a)  # a*X_r + X_r@B
        for k, i in enumerate(ids):
            out[i] = xs[k]


def distributed_newton_schulz(
    shards: Sequence[Tensor],
    shapes: Sequence[tuple[int, int]],
    *,
    steps: int = 5,
    coefficients: Coefficients = "muon",
    strategy: Strategy = "auto",
    group: dist.ProcessGroup | None = None,
    max_owner_numel: int | None = DEFAULT_MAX_OWNER_NUMEL,
    eps: float = 1e-7,
    fn: Callable[[int, Tensor], Tensor] | None = None,
) -> list[Tensor]:
    """This rank's rows of ``newton_schulz(X_i)`` for every row-sharded matrix X_i.

    ``fn(i, X_i)``: another whole-matrix map instead of ``newton_schulz`` (MuonBC's
    bias-corrected Smooth-NS), run by each matrix's owner; it forces ``strategy="owner"``.

    ``shards[i]``: this rank's rows ``shard_bounds(m_i, rank, W)`` of matrix i (possibly 0
    rows), of shape (rows, n_i) or (rows, *rest) with prod(rest) = n_i (conv weights);
    ``shapes[i] = (m_i, n_i)``: the full 2-D shape, the same on every rank. Returns tensors of
    the shards' shapes and dtypes. ``strategy``: "owner", "model_parallel" or "auto" (per
    matrix by the cost model, see the module docstring); ``max_owner_numel`` only affects
    "auto". ``group``: the process group (default group when None); without a process group,
    or with one rank, this is ``newton_schulz`` per matrix.

    Collective: every rank of ``group`` must call it with the same shapes, dtypes and options.
    """
    if len(shards) != len(shapes):
        raise ValueError(f"{len(shards)} shards but {len(shapes)} shapes")
    _schedule(coefficients, steps)  # validate on every rank before any collective
    world = get_world_size(group)
    rank = get_rank(group)
    mats: list[Tensor] = []
    for i, (x, (m, n)) in enumerate(zip(shards, shapes)):
        if x.ndim < 1 or math.prod(x.shape[1:]) != n:
            raise ValueError(f"shard {i} of shape {tuple(x.shape)} does not have {n} columns")
        rows = _rows(m, rank, world)
        if x.shape[0] != rows:
            raise ValueError(f"shard {i}: rank {rank} of {world} should hold {rows} of {m} rows "
                             f"(shard_bounds), got {x.shape[0]}")
        mats.append(x.reshape(rows, n))

    if fn is not None:
        strategy, max_owner_numel = "owner", None
    plan = plan_newton_schulz(shapes, world, steps=steps, strategy=strategy,
                              max_owner_numel=max_owner_numel)
    out: list[Tensor | None] = [None] * len(mats)
    if world == 1:
        for i, x in enumerate(mats):
            out[i] = (fn(i, x).to(x.dtype) if fn is not None  # (as _owner_compute casts)
                      else newton_schulz(x, steps, coefficients=coefficients, eps=eps))
    else:
        owner_idx = [i for i, k in enumerate(plan.methods) if k == "owner"]
        mp_idx = [i for i, k in enumerate(plan.methods) if k == "model_parallel"]
        if owner_idx:
            _owner_compute(mats, owner_idx, shapes, plan.owners, out, rank=rank, world=world,
                           group=group, steps=steps, coefficients=coefficients, eps=eps, fn=fn)
        if mp_idx:
            _model_parallel(mats, mp_idx, shapes, out, group=group, steps=steps,
                            coefficients=coefficients, eps=eps)
    return [o.reshape(x.shape) for o, x in zip(out, shards)]  # type: ignore[union-attr]
