"""The engine's one-time model checks under a process group (gloo, CPU): a rank whose share of a
query is one example compares nothing, so the checks stay due on every rank until some rank's
query of two or more examples was checked, and a refusal on one rank is one on every rank.

They used to be marked done after the first query under any process group: a model that mixes
the examples of a microbatch was accepted when every rank's first share held one example (a
small first Poisson sample, or a phantom microbatch), and its clip factors then bound nothing."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dptrain.parallel.dist import spawn

sys.path.insert(0, str(Path(__file__).parent))


class Mix(nn.Module):
    """Subtracts the microbatch's mean from a hidden layer: example i's loss depends on all."""

    def __init__(self, mix: bool, d: int = 6, k: int = 3):
        super().__init__()
        self.mix, self.a, self.b = mix, nn.Linear(d, d), nn.Linear(d, k)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.b(h - h.mean(0, keepdim=True) if self.mix else h)


def _ce(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y, reduction="none")


def _rows(rank, world, sizes, mix, fsdp):
    """Each query's per-rank sizes in ``sizes`` (a list of tuples); returns per query what this
    rank saw: 'accepted' or the refusal's first words, and whether the check is done."""
    from dptrain.clipping import ClippingEngine
    from dptrain.parallel.fsdp import apply_fsdp

    torch.manual_seed(0)
    model = Mix(mix)
    if fsdp:
        apply_fsdp(model)
    engine = ClippingEngine(model, clip_norm=1.0)
    g = torch.Generator().manual_seed(1 + rank)
    seen = []
    for per_rank in sizes:
        B = per_rank[rank]
        batch = (torch.randn(B, 6, generator=g), torch.randint(0, 3, (B,), generator=g))
        try:
            engine.accumulate(_ce, batch, {})
        except ValueError as e:
            seen.append(("refused", str(e)[:90], engine._rows_checked))
            break
        seen.append(("accepted", "", engine._rows_checked))
    return seen


@pytest.mark.parametrize("fsdp", [False, True])
def test_a_mixing_model_is_refused_after_first_shares_of_one_example(fsdp):
    out = spawn(_rows, 2, [(1, 1), (4, 4)], True, fsdp, timeout=200)
    for seen in out:
        # the first query compared nothing on either rank: still due, checked at the second
        assert seen[0] == ("accepted", "", False)
        assert seen[1][0] == "refused" and "rows of the input of b" in seen[1][1]


def test_a_refusal_on_one_rank_is_a_refusal_on_every_rank():
    # rank 0's share is one example (nothing to compare), rank 1's four (mixing found)
    out = spawn(_rows, 2, [(1, 4)], True, False, timeout=200)
    assert out[1][0][0] == "refused" and "rows of the input of b" in out[1][0][1]
    assert out[0][0][0] == "refused" and "another rank" in out[0][0][1]


def test_the_check_is_done_everywhere_once_any_rank_compared():
    # a model that keeps examples apart: rank 0's share of one example compares nothing, rank
    # 1's two do; both ranks are then done (and run no more check forwards)
    out = spawn(_rows, 2, [(1, 1), (1, 2), (3, 3)], False, True, timeout=200)
    for seen in out:
        assert [s[0] for s in seen] == ["accepted"] * 3
        assert [s[2] for s in seen] == [False, True, True]


def _taps(rank, world, sizes):
    from test_clipping_taps import Tokens, _sq, _x

    from dptrain.clipping import ClippingEngine

    torch.manual_seed(0)
    model = Tokens("expanded_index").double()  # example 0 gets every example's token gradient
    engine = ClippingEngine(model, clip_norm=1.0)
    seen = []
    for per_rank in sizes:
        B = per_rank[rank]
        try:
            engine.accumulate(_sq, (_x(B, seed=B + rank),), {})
        except ValueError as e:
            seen.append(("refused", str(e)[:120]))
            break
        seen.append(("accepted", engine._taps_checked))
    return seen


def test_tapped_rows_are_checked_after_first_shares_of_one_example():
    out = spawn(_taps, 2, [(1, 1), (4, 4)], timeout=200)
    for seen in out:
        assert seen[0] == ("accepted", False)
        assert seen[1][0] == "refused" and "parameter tok" in seen[1][1]


class OutsideUse(nn.Module):
    """A tied head written as ``F.linear(h, self.emb.weight)`` in the root's forward: a use of
    the embedding's weight that its module's hooks do not see (its gradient would be missing
    from the norms)."""

    def __init__(self, V: int = 11, d: int = 8):
        super().__init__()
        self.emb = nn.Embedding(V, d)
        self.fc = nn.ModuleList([nn.Linear(d, d), nn.Linear(d, d)])

    def forward(self, x):
        h = self.emb(x)
        for fc in self.fc:
            h = h + torch.tanh(fc(h))
        return F.linear(h, self.emb.weight)


def _lm(model, batch):
    x, y = batch
    logits = model(x)
    return F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none").view(
        x.shape[0], -1).sum(1)


def _outside(rank, world):
    from dptrain.clipping import ClippingEngine
    from dptrain.parallel.fsdp import apply_fsdp

    torch.manual_seed(0)
    model = OutsideUse()
    if world > 1:
        apply_fsdp(model)  # the forward uses gathered copies, other objects than the shards
    g = torch.Generator().manual_seed(1)
    batch = (torch.randint(0, 11, (4, 5), generator=g), torch.randint(0, 11, (4, 5), generator=g))
    try:
        ClippingEngine(model, clip_norm=1.0).accumulate(_lm, batch, {})
    except ValueError as e:
        return str(e)
    return "accepted"


@pytest.mark.parametrize("world", [1, 2])
def test_a_parameter_used_outside_its_module_is_refused_under_fsdp_too(world):
    # it was accepted on 2 FSDP ranks (the check knew the sharded parameters only), and that
    # use's share of the gradient was dropped from the norms and the sum
    for r in spawn(_outside, world, timeout=200):
        assert "emb.weight is used outside the forward of the module that owns it" in r
