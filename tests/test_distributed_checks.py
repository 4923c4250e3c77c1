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
