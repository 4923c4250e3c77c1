"""Multi-state query plans (inner momentum, issue 4) through the engine's streamed query:
reused per-example buffers across calls, and the per-layer form chosen by the multi-state cost
model ('auto').

The engine keeps one (B, numel) buffer per instantiated parameter across calls of
``accumulate``/``per_example_norms`` with a multi-state plan. These checks run one engine
through a sequence of calls with different plans (float and per-parameter coefficients, a
parameter absent from the oldest state as with K_M != K_A) and batch sizes (growing and
shrinking, B = 1), and require every result to equal a fresh engine's and the float64
reference that materialises each example's gradient at every state, and every result already
handed back (norms, clipped sums) to be unchanged by the later calls (no aliasing of a reused
buffer). Under 'auto' the model is shaped so that the cost model picks the ghost form for one
layer and instantiation for others in the same query, both checked against the reference.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from dptrain.clipping import ClippingEngine
from dptrain.clipping import engine as engine_mod

T = 12  # sequence length: with these widths 'auto' picks ghost for mid and instantiate elsewhere


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 8)
        self.up = nn.Linear(8, 256)
        self.mid = nn.Linear(256, 256)
        self.down = nn.Linear(256, 3)

    def forward(self, ids):
        h = torch.tanh(self.up(self.emb(ids)))
        return self.down(torch.tanh(self.mid(h)))


def loss_fn(model, batch):
    ids, y = batch
    return 0.5 * (model(ids) - y).pow(2).sum((1, 2))


def make_batch(B: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 50, (B, T), generator=g),
            torch.randn(B, T, 3, generator=g, dtype=torch.float64))


def reference(model, batch, plan, C):
    """Norms and clipped sums from per-example gradients materialised at every state."""
    current = {n: p.detach() for n, p in model.named_parameters()}
    ids, y = batch

    def one(p, i, t):
        return loss_fn(lambda x: functional_call(model, p, (x,)), (i[None], t[None]))[0]

    total = None
    for entry in plan:
        coef, state = entry[0], entry[1]
        g = vmap(grad(one), in_dims=(None, 0, 0))(state or current, ids, y)
        g = {n: v * (coef.get(n, 0.0) if isinstance(coef, dict) else coef) for n, v in g.items()}
        total = g if total is None else {n: total[n] + g[n] for n in g}
    norms = torch.sqrt(sum(v.flatten(1).pow(2).sum(1) for v in total.values()))
    lam = torch.clamp(C / norms, max=1.0)
    return norms, {n: torch.einsum("b...,b->...", v, lam) for n, v in total.items()}


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    model = Net().double()
    gen = torch.Generator().manual_seed(1)
    s1, s2 = ({n: p.detach() + 0.05 * torch.randn(p.shape, generator=gen, dtype=p.dtype)
               for n, p in model.named_parameters()} for _ in range(2))
    plan_a = [(0.5, None), (0.3, s1), (0.2, s2)]
    # per-parameter coefficients; "down.*" and "emb.weight" have no third state (K_A = 1)
    other = {"down.weight", "down.bias", "emb.weight"}
    names = [n for n, _ in model.named_parameters()]
    plan_b = [({n: (0.6 if n in other else 0.5) for n in names}, None),
              ({n: (0.4 if n in other else 0.3) for n in names}, s1),
              ({n: 0.2 for n in names if n not in other}, s2)]
    return model, plan_a, plan_b


def _forms(monkeypatch) -> list[dict[str, str]]:
    """Record the per-parameter forms of every query the engine builds."""
    seen: list[dict[str, str]] = []
    orig = engine_mod.ClippingEngine._query

    def spy(self, plan):
        q = orig(self, plan)
        seen.append(q.forms)
        return q

    monkeypatch.setattr(engine_mod.ClippingEngine, "_query", spy)
    return seen


@pytest.mark.parametrize("policy", ["ghost", "instantiate", "auto"])
def test_reused_buffers_across_calls_match_fresh_engines_and_reference(setup, policy,
                                                                        monkeypatch):
    model, plan_a, plan_b = setup
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    C = float(reference(model, make_batch(4, 0), plan_a, 1.0)[0].median())
    calls = [(plan_a, 4), (plan_b, 2), (plan_a, 5), (plan_b, 1), (plan_a, 3)]
    forms = _forms(monkeypatch)
    engine = ClippingEngine(model, clip_norm=C, ghost=policy)
    kept = []  # (results handed back, their values at the time)
    for i, (plan, B) in enumerate(calls):
        batch = make_batch(B, 10 + i)
        ref_norms, ref_sums = reference(model, batch, plan, C)
        norms = engine.per_example_norms(loss_fn, batch, plan)
        acc: dict = {}
        engine.accumulate(loss_fn, batch, acc, plan)
        torch.testing.assert_close(norms, ref_norms, rtol=1e-9, atol=1e-12)
        assert set(acc) == set(ref_sums)
        for n in ref_sums:
            torch.testing.assert_close(acc[n], ref_sums[n], rtol=1e-8, atol=1e-11)
        fresh: dict = {}
        ClippingEngine(model, clip_norm=C, ghost=policy).accumulate(loss_fn, batch, fresh, plan)
        for n in fresh:
            torch.testing.assert_close(acc[n], fresh[n], rtol=1e-12, atol=1e-14)
        kept.append((norms, acc, norms.clone(), {n: v.clone() for n, v in acc.items()}))
    for norms, acc, norms0, acc0 in kept:  # nothing handed back was overwritten later
        assert torch.equal(norms, norms0)
        for n in acc0:
            assert torch.equal(acc[n], acc0[n]), n
    for n, p in model.named_parameters():  # the current state is restored
        assert torch.equal(p.detach(), before[n])
    if policy == "auto":  # both forms inside one multi-state query
        used = {f for q in forms for f in q.values()}
        assert used == {"ghost", "instantiate"}, forms
        assert forms[0]["mid.weight"] == "ghost" and forms[0]["up.weight"] == "instantiate"
    engine.release_workspace()
    assert not engine._workspace


def test_workspace_is_not_used_by_single_state_plans(setup):
    model, _, _ = setup
    engine = ClippingEngine(model, clip_norm=1.0, ghost="instantiate")
    acc: dict = {}
    engine.accumulate(loss_fn, make_batch(3, 0), acc)
    assert not engine._workspace
