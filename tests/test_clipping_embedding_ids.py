"""Token ids mutated in place after the forward (labels aliasing the input ids, masked in place
inside loss_fn): plain autograd refuses this (the embedding saved the ids), but the engine's
Embedding rule captured ``ids.detach()`` without a copy (EmbeddingRule.capture) and, the
embedding's own backward never running, silently used the mutated ids; it now copies them."""

import torch
import torch.nn.functional as F
from torch import nn

from dptrain.clipping import per_example_grad_norms


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.e = nn.Embedding(6, 4)
        self.h = nn.Linear(4, 6)

    def forward(self, ids):
        return self.h(torch.tanh(self.e(ids)))


def _loss(inplace):
    def lf(m, batch):
        ids = batch[0]
        logits = m(ids)
        labels = ids if inplace else ids.clone()
        labels.masked_fill_(labels == 5, 0)
        return F.cross_entropy(logits.reshape(-1, 6), labels.reshape(-1),
                               reduction="none").view(ids.shape).sum(1)
    return lf


def test_ids_mutated_after_the_forward_are_refused_or_harmless():
    torch.manual_seed(0)
    m = LM().double()
    ids = torch.randint(0, 6, (4, 5))
    ids[:, 0] = 5
    want = per_example_grad_norms(m, _loss(False), (ids.clone(),))  # the forward's own ids
    try:
        got = per_example_grad_norms(m, _loss(True), (ids.clone(),))
    except (ValueError, RuntimeError):
        return
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
