"""How the clipping engine is called: autograd disabled, and batches without examples along a
first dimension, are one clear error each (they gave zero norms, and bare IndexErrors)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from _threads import _one_thread  # noqa: F401  (autouse: one torch thread)

from dptrain.clipping import ClippingEngine, per_example_grad_norms


class _HeadOutsideItsModule(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 6)

    def forward(self, x):
        return F.linear(torch.tanh(self.emb(x)).mean(1), self.emb.weight)


def _lm(model, x):
    return F.cross_entropy(model(x), x[:, 0], reduction="none")


@pytest.mark.parametrize("context", [torch.no_grad, torch.inference_mode])
def test_autograd_disabled_is_an_error_not_zero_norms(context):
    """Under no_grad the engine returned all-zero norms and added nothing (the release was pure
    noise); an engine whose first call ran so then skipped its model checks for good."""
    torch.manual_seed(0)
    model = _HeadOutsideItsModule()
    x = torch.randint(0, 10, (4, 3))
    engine = ClippingEngine(model, clip_norm=1.0)
    with context(), pytest.raises(RuntimeError, match="autograd disabled"):
        engine.per_example_norms(_lm, x)
    with context(), pytest.raises(RuntimeError, match="autograd disabled"):
        engine.accumulate(_lm, x, {})
    # the first call with autograd still checks the model (the weight used outside its module)
    with pytest.raises(ValueError, match="outside the forward of the module"):
        engine.per_example_norms(_lm, x)


@pytest.mark.parametrize("batch, error, words", [
    ((), ValueError, "empty tuple"), ({}, ValueError, "empty dict"),
    ([1.0, 2.0], TypeError, "batch size of a float"), (torch.tensor(3.0), ValueError, "scalar")])
def test_a_batch_without_examples_along_a_first_dimension_is_one_clear_error(batch, error, words):
    """An empty tuple raised a bare IndexError; a scalar tensor an IndexError from shape[0]."""
    model = nn.Linear(3, 2)
    with pytest.raises(error, match=words):
        per_example_grad_norms(model, lambda m, b: m(b).sum(1), batch)


def test_two_pass_under_autocast_is_refused():
    """Its second backward ran in bf16 while the norms were float32: one clipped example added
    up to 1.0019 C (a timm StdConv net). The trainer refused the combination; the engine did not."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    batch = (torch.randn(4, 6), torch.tensor([0, 1, 2, 0]))

    def ce(m, b):
        return F.cross_entropy(m(b[0]), b[1], reduction="none")

    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(ValueError, match="two_pass"):
            ClippingEngine(model, clip_norm=1.0, mode="two_pass").accumulate(ce, batch, {})
        acc: dict = {}
        ClippingEngine(model, clip_norm=1.0, mode="bookkeeping").accumulate(ce, batch, acc)
    assert set(acc) == {n for n, _ in model.named_parameters()}
