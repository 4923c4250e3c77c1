"""Layers whose input rows are not the microbatch's examples although the leading size equals
the microbatch's (README: "row b of every layer's input is example b's ... A shared (T, ...)
input whose T happens to equal the microbatch size is refused when the first forward
broadcasts that layer's output over the examples, as nanoGPT's wpe(torch.arange(T)) is").
Adding a leading axis first (``unsqueeze(0)``, ``[None]``, ``view(1, T, d)``, ``expand``) gave
silently wrong norms at T == B; the positions' layer is now refused because its input does not
come from the batch. Learned queries (one row for every example) are still accepted."""

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from dptrain.clipping import ClippingEngine


class Wpe(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.how = how
        self.tok = nn.Embedding(7, 4)
        self.wpe = nn.Embedding(8, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, ids):
        B, T = ids.shape
        p = self.wpe(torch.arange(T))
        if self.how == "unsqueeze":
            p = p.unsqueeze(0)
        elif self.how == "index_none":
            p = p[None]
        elif self.how == "view":
            p = p.view(1, T, 4)
        elif self.how == "expand":
            p = p.expand(B, T, 4)
        return self.head(torch.tanh(self.tok(ids) + p)).squeeze(-1)


def loss_fn(m, batch):
    return m(batch[0]).pow(2).sum(1)


def reference_norms(m, x):
    params = {n: p.detach() for n, p in m.named_parameters()}

    def one(p, xb):
        return loss_fn(lambda *a: functional_call(m, p, a), (xb[None],))[0]

    g = vmap(grad(one), in_dims=(None, 0))(params, x)
    return torch.cat([g[n].reshape(x.shape[0], -1) for n in params], 1).norm(dim=1)


def _check(m, x):
    ref = reference_norms(m, x)
    try:
        norms = ClippingEngine(m, clip_norm=1.0).per_example_norms(loss_fn, (x,))
    except ValueError:
        return  # refused: acceptable
    torch.testing.assert_close(norms, ref, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("how", ["unsqueeze", "index_none", "view", "expand"])
def test_shared_positions_with_a_leading_axis_at_t_equal_b(how):
    torch.manual_seed(0)
    _check(Wpe(how).double(), torch.randint(0, 7, (4, 4)))


class Queries(nn.Module):
    """Learned query tokens: an Embedding of arange(K) expanded to every example (K == B)."""

    def __init__(self):
        super().__init__()
        self.q = nn.Embedding(4, 4)
        self.a = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        B = x.shape[0]
        q = self.q(torch.arange(4).expand(B, 4))  # (B, K, d), the same for every example
        return self.head(torch.tanh(self.a(x) + q)).squeeze(-1)


@pytest.mark.parametrize("how", ["direct", "unsqueeze", "view"])
def test_shared_positions_are_refused_naming_the_layer(how):
    torch.manual_seed(0)
    with pytest.raises(ValueError, match=r"the input of wpe \(Embedding, shape \(4,\)\)"):
        ClippingEngine(Wpe(how).double(), clip_norm=1.0).per_example_norms(
            loss_fn, (torch.randint(0, 7, (4, 4)),))


def test_queries_the_same_for_every_example_are_exact():
    torch.manual_seed(0)
    m = Queries().double()
    x = torch.randn(4, 4, 4, dtype=torch.float64)
    norms = ClippingEngine(m, clip_norm=1.0).per_example_norms(loss_fn, (x,))
    torch.testing.assert_close(norms, reference_norms(m, x), rtol=1e-9, atol=1e-12)
