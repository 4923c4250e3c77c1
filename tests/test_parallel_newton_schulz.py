"""Distributed Newton–Schulz (issue 5): both strategies equal single-process ``newton_schulz``.

Spawned gloo process groups of 2 and 4 ranks on free ports (one spawn per world size runs every
dtype x strategy x coefficient case, to keep process start-up off the clock), plus in-process
checks of the LPT assignment, the planner and ``shard_bounds``.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch
import torch.distributed as dist

from dptrain.optim.newton_schulz import newton_schulz
from dptrain.parallel.dist import shard_bounds, spawn
from dptrain.parallel.newton_schulz import (
    assign_owners,
    distributed_newton_schulz,
    plan_newton_schulz,
)

# (full shape of the shard as FSDP2 holds it, 2-D view (m, n)): tall, wide, square, a conv
# weight, rows not divisible by 2 or 4, and matrices with fewer rows than ranks (empty shards).
SHAPES: list[tuple[tuple[int, ...], tuple[int, int]]] = [
    ((48, 16), (48, 16)),
    ((16, 40), (16, 40)),
    ((24, 24), (24, 24)),
    ((8, 3, 3, 3), (8, 27)),
    ((37, 11), (37, 11)),
    ((3, 10), (3, 10)),
    ((1, 6), (1, 6)),
    ((64, 12), (64, 12)),
]
STRATEGIES = ("owner", "model_parallel", "auto")
COEFFICIENTS = ("muon", "polar_express")
DTYPES = (torch.float64, torch.float32)
TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 5e-3, torch.float16: 5e-3}


def _full_matrices(dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    return [torch.randn(full, generator=g, dtype=torch.float64).to(dtype) for full, _ in SHAPES]


def _sq(t: torch.Tensor) -> float:
    return float(t.double().square().sum())


def _worker(rank: int, world: int) -> dict:
    """On each rank, per case and matrix: (sum of squared differences to the single-process
    result on this rank's rows, sum of squares of that result there, tolerance)."""
    shapes = [mn for _, mn in SHAPES]
    sums: dict[tuple, tuple[float, float, float]] = {}

    def record(case: str, full: list[torch.Tensor], out: list[torch.Tensor], steps: int,
               coeff: str, r: int = rank, w: int = world, exact: bool = False) -> None:
        for i, (x, o) in enumerate(zip(full, out)):
            rows = slice(*shard_bounds(x.shape[0], r, w))
            assert o.dtype == x.dtype and o.shape == x[rows].shape, (o.dtype, o.shape)
            # (exact: against float64's result on the same values, not against x's dtype)
            ref = newton_schulz((x.double() if exact else x).reshape(x.shape[0], -1), steps,
                                coefficients=coeff)
            ref = ref.reshape(x.shape)[rows]
            sums[(case, i)] = (_sq(o - ref), _sq(ref), TOL[x.dtype])

    for dtype, strategy, coeff in itertools.product(DTYPES, STRATEGIES, COEFFICIENTS):
        full = _full_matrices(dtype)
        local = [x[slice(*shard_bounds(x.shape[0], rank, world))] for x in full]
        # "auto" with a small limit: the big tall matrices become model-parallel, the rest owner.
        kw = {"max_owner_numel": 500} if strategy == "auto" else {}
        out = distributed_newton_schulz(local, shapes, steps=5, coefficients=coeff,
                                        strategy=strategy, **kw)
        record(f"{dtype}/{strategy}/{coeff}", full, out, 5, coeff)

    # bf16: model-parallel sums the grams and norms in float32 and rounds once, as the
    # single-process bf16 product does (bf16 partial sums would cost ~2e-2). On the tall
    # matrices, the only ones "auto" makes model-parallel: on a wide one its (n, n) Gram is
    # another computation than the single-process (m, m) one, 1.7e-2 apart in bf16.
    tall = [i for i, (m, n) in enumerate(shapes) if m > n]
    full = [x for i, x in enumerate(_full_matrices(torch.bfloat16)) if i in tall]
    local = [x[slice(*shard_bounds(x.shape[0], rank, world))] for x in full]
    for strategy in ("owner", "model_parallel"):
        out = distributed_newton_schulz(local, [shapes[i] for i in tall], strategy=strategy)
        record(f"bf16/{strategy}", full, out, 5, "muon")

    # float16: model-parallel divides by the float64 norm in float32 and rounds once to float16
    # (float16's exponent range is too narrow for bf16's ldexp). Entries ~1e4, whose Frobenius
    # norm (~1e5 to 3e5) is past float16's largest, 65,504. Against float64 on the same values:
    # single-process float16 takes the norm in float16 (here inf, rescued by max|X|), so the two
    # float16 results start an ulp apart, 2.8e-3 after 5 quintics, each ~2e-3 from float64.
    full = [(1e4 * x.double()).half() for i, x in enumerate(_full_matrices(torch.float64))
            if i in tall]
    local = [x[slice(*shard_bounds(x.shape[0], rank, world))] for x in full]
    for strategy in ("owner", "model_parallel"):
        out = distributed_newton_schulz(local, [shapes[i] for i in tall], strategy=strategy)
        record(f"fp16/{strategy}", full, out, 5, "muon", exact=True)

    # another whole-matrix map (MuonBC's) runs on every matrix, also on those that "auto"
    # would make model-parallel: exactly fn of the full matrix, on this rank's rows
    full = _full_matrices(torch.float64)
    local = [x[slice(*shard_bounds(x.shape[0], rank, world))] for x in full]
    out = distributed_newton_schulz(local, shapes, fn=lambda i, X: 2.0 * X + i,
                                    max_owner_numel=100)
    for i, (x, o) in enumerate(zip(local, out)):
        sums[("fn", i)] = (_sq(o - (2.0 * x + i)), _sq(2.0 * x + i), 0.0)

    # float32 matrices whose Frobenius norm overflows float32 (entries ~1e25): each strategy
    # equals the single-process result, which equals that of the unscaled matrix (a test of
    # tests/test_newton_schulz.py); before, model-parallel divided by inf and returned zeros.
    full = [1e25 * x for x in _full_matrices(torch.float32)]
    local = [x[slice(*shard_bounds(x.shape[0], rank, world))] for x in full]
    for strategy in ("owner", "model_parallel"):
        out = distributed_newton_schulz(local, shapes, strategy=strategy)
        record(f"overflow/{strategy}", full, out, 5, "muon")

    # zero matrices with eps = 0 (this rank's rows of them, some empty): zeros, not 0/0 = NaN
    zeros = [torch.zeros_like(x[slice(*shard_bounds(x.shape[0], rank, world))])
             for x in _full_matrices(torch.float32)]
    for strategy in ("owner", "model_parallel"):
        out = distributed_newton_schulz(zeros, shapes, strategy=strategy, eps=0.0)
        assert all(torch.equal(o, z) for o, z in zip(out, zeros)), strategy

    # Mixed dtypes in one call (one buffer per dtype), non-default steps.
    full = _full_matrices(torch.float64)
    full[1] = full[1].float()
    local = [x[slice(*shard_bounds(x.shape[0], rank, world))] for x in full]
    for strategy in ("owner", "model_parallel"):
        out = distributed_newton_schulz(local, shapes, steps=3, strategy=strategy)
        record(f"mixed/{strategy}", full, out, 3, "muon")

    if world == 4:
        # A 2-rank subgroup of global ranks {3, 1} (group ranks 0, 1): shards and all-to-all
        # splits follow the group's ranks, not the global ones.
        sub = dist.new_group([3, 1])
        if rank in (1, 3):
            r, w = dist.get_rank(sub), dist.get_world_size(sub)
            full = _full_matrices(torch.float64)
            local = [x[slice(*shard_bounds(x.shape[0], r, w))] for x in full]
            for strategy in ("owner", "model_parallel"):
                out = distributed_newton_schulz(local, shapes, strategy=strategy, group=sub)
                record(f"subgroup/{strategy}", full, out, 5, "muon", r, w)
    return sums


@pytest.mark.parametrize("world", [2, 4])
def test_distributed_equals_single_process(world):
    """Relative Frobenius error of each whole matrix (summed over ranks) within tolerance.

    Owner-compute runs the same code on the same matrix (0 difference here). Model-parallel
    forms X^T X from partial sums, so in float32 it differs by float32's own rounding noise as
    the quintics amplify it: 1-2e-6 with Muon's coefficients, up to 7e-6 with Polar Express
    (first slope 8.2) on the tiny wide matrices, the size of single-process float32 against
    float64 on the same matrices (up to 5e-6). float64: < 1e-14.
    """
    results = spawn(_worker, world, timeout=240)
    keys = {k for r in results for k in r}
    tall = sum(m > n for _, (m, n) in SHAPES)
    assert len(keys) == len(SHAPES) * (len(DTYPES) * len(STRATEGIES) * len(COEFFICIENTS) + 5
                                       + (2 if world == 4 else 0)) + 4 * tall
    for key in sorted(keys):
        held = [r[key] for r in results if key in r]
        diff = sum(h[0] for h in held)
        ref = sum(h[1] for h in held)
        tol = held[0][2]
        rel = (diff / ref) ** 0.5
        assert rel <= tol, f"world {world} {key}: relative Frobenius error {rel:.3g} > {tol}"


def test_world_size_one_without_process_group():
    full = _full_matrices(torch.float32)
    shapes = [mn for _, mn in SHAPES]
    for strategy in STRATEGIES:
        out = distributed_newton_schulz(full, shapes, strategy=strategy,
                                        coefficients="polar_express")
        for x, o in zip(full, out):
            ref = newton_schulz(x.reshape(x.shape[0], -1), coefficients="polar_express")
            assert torch.equal(o, ref.reshape(x.shape))


def test_bad_inputs_rejected_before_any_collective():
    x = torch.randn(4, 3)
    with pytest.raises(ValueError, match="coefficients"):
        distributed_newton_schulz([x], [(4, 3)], coefficients="nope")
    with pytest.raises(ValueError, match="columns"):
        distributed_newton_schulz([x], [(4, 5)])
    with pytest.raises(ValueError, match="rows"):
        distributed_newton_schulz([x], [(5, 3)])
    with pytest.raises(ValueError, match="strategy"):
        plan_newton_schulz([(4, 3)], 2, strategy="nope")


def test_shard_bounds_matches_torch_chunk():
    for dim0 in range(0, 23):
        for world in range(1, 9):
            chunks = list(torch.arange(dim0).chunk(world)) if dim0 else []
            chunks += [torch.empty(0, dtype=torch.long)] * (world - len(chunks))
            for r in range(world):
                start, end = shard_bounds(dim0, r, world)
                assert torch.equal(torch.arange(start, end), chunks[r]), (dim0, world, r)


def _loads(costs, owners, world):
    loads = [0.0] * world
    for c, r in zip(costs, owners):
        loads[r] += c
    return loads


def test_assign_owners_vs_brute_force_optimum():
    g = torch.Generator().manual_seed(0)
    for trial in range(40):
        world = 2 + trial % 2
        n = 3 + trial % 5  # up to 7 jobs: 3^7 assignments
        costs = (torch.rand(n, generator=g) * 100).round().add(1).tolist()
        owners = assign_owners(costs, world)
        assert all(0 <= r < world for r in owners)
        lpt = max(_loads(costs, owners, world))
        opt = min(max(_loads(costs, a, world))
                  for a in itertools.product(range(world), repeat=n))
        assert lpt <= (4 / 3 - 1 / (3 * world)) * opt + 1e-9, (costs, lpt, opt)


def test_assign_owners_balances_gpt2_like_set():
    # 12 layers of GPT-2-small-like matrices: the makespan is within 4/3 of the lower bound
    # max(total / W, largest job), and deterministic.
    shapes = [(2304, 768), (768, 768), (3072, 768), (768, 3072)] * 12
    costs = [float(m * n * min(m, n)) for m, n in shapes]
    for world in (2, 3, 4, 8):
        owners = assign_owners(costs, world)
        assert owners == assign_owners(costs, world)
        bound = max(sum(costs) / world, max(costs))
        assert max(_loads(costs, owners, world)) <= 4 / 3 * bound
    assert assign_owners([], 4) == []
    assert assign_owners([5.0, 1.0], 1) == [0, 0]


def test_plan_auto():
    gpt2 = [(2304, 768), (768, 768), (3072, 768), (768, 3072)] * 12
    for world in (2, 4):
        plan = plan_newton_schulz(gpt2, world)
        assert set(plan.methods) == {"owner"}  # many similar matrices: owner-compute
    # One dominant tall matrix among small ones: model-parallel for it, owner for the rest.
    plan = plan_newton_schulz([(8192, 512)] + [(64, 64)] * 6, 4)
    assert plan.methods[0] == "model_parallel" and set(plan.methods[1:]) == {"owner"}
    assert plan.owners[0] == -1
    # Too big for one rank: tall -> model-parallel; wide stays owner (its n x n gram is bigger).
    plan = plan_newton_schulz([(4096, 1024), (1024, 4096), (64, 64)], 2,
                              max_owner_numel=1 << 20)
    assert plan.methods == ("model_parallel", "owner", "owner")
    assert plan_newton_schulz([(5, 3)], 1).methods == ("local",)


@pytest.mark.parametrize("strategy", ["auto", "owner", "model_parallel"])
def test_a_plan_is_consistent_with_its_costs(strategy):
    # an owner for exactly the owner-computed matrices, and the makespan it reports: a matrix
    # left out of the assignment kept owner -1 and ran on the last rank unbalanced
    from dptrain.parallel.newton_schulz import model_parallel_cost, owner_cost

    rng = random.Random(7)
    for world in (2, 3, 4):
        for _ in range(5):
            shapes = [(rng.choice((16, 64, 256, 1024)), rng.choice((16, 64, 256)))
                      for _ in range(rng.randint(1, 9))]
            plan = plan_newton_schulz(shapes, world, strategy=strategy, max_owner_numel=1 << 14)
            loads = [0.0] * world
            spread = 0.0
            for (m, n), how, r in zip(shapes, plan.methods, plan.owners):
                assert (0 <= r < world) == (how == "owner"), (shapes, plan)
                if how == "owner":
                    loads[r] += owner_cost(m, n, 5, world)
                else:
                    spread += model_parallel_cost(m, n, 5, world)
            assert plan.est_makespan == pytest.approx(max(loads) + spread, rel=1e-12)


def test_the_cost_model_boundaries():
    from dptrain.parallel.newton_schulz import model_parallel_cost

    # each rank's rows: the ceiling of m / W (5 rows on 4 ranks: 2 on the busiest, as 8)
    assert model_parallel_cost(5, 4, 1, 4) == model_parallel_cost(8, 4, 1, 4)
    assert model_parallel_cost(4, 4, 1, 4) < model_parallel_cost(5, 4, 1, 4)
    # a matrix of exactly max_owner_numel elements may still be owned by one rank (only a
    # larger one is forced model-parallel): four equal squares balance best as owners
    square = [(256, 256)] * 4
    assert set(plan_newton_schulz(square, 2, max_owner_numel=256 * 256).methods) == {"owner"}
    assert set(plan_newton_schulz(square, 2, max_owner_numel=256 * 256 - 1).methods) == {
        "model_parallel"}
