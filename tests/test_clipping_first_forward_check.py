"""The use check (_FirstForwardCheck) used to be marked done before the first forward ran: when that
forward raises (the check's own refusal, an IndexError, an OOM), every later call of the same
engine skipped the check and returned norms without the outside use's gradient."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dptrain.clipping import ClippingEngine


class HeadOutside(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(6, 4)
        self.l = nn.Linear(4, 4)

    def forward(self, ids):
        return F.linear(torch.tanh(self.l(self.emb(ids))), self.emb.weight)


def lm(m, batch):
    return m(batch[0]).logsumexp(-1).sum(1)


@pytest.mark.parametrize("first", ["refused", "index_error"])
def test_the_use_check_still_refuses_after_a_failed_first_forward(first):
    torch.manual_seed(0)
    m = HeadOutside().double()
    eng = ClippingEngine(m, clip_norm=1.0)
    ids = torch.randint(0, 6, (3, 4))
    bad = ids if first == "refused" else torch.full((3, 4), 60)
    with pytest.raises((ValueError, IndexError)):
        eng.per_example_norms(lm, (bad,))
    with pytest.raises(ValueError, match="outside"):
        eng.per_example_norms(lm, (ids,))
