"""A user's forward hook that changes a Linear's output: the engine's hook used to run after it,
see the changed output and take the gradient w.r.t. that, giving silently wrong norms. The
engine's hook now runs first (prepend)."""


import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from dptrain.clipping import ClippingEngine


def mse(m, b):
    out = m(b[0])
    return 0.5 * out.pow(2).reshape(out.shape[0], -1).sum(1)


def reference_norms(m, x):
    params = {n: p.detach() for n, p in m.named_parameters()}

    def one(p, xb):
        return mse(lambda *a: functional_call(m, p, a), (xb[None],))[0]

    g = vmap(grad(one), in_dims=(None, 0))(params, x)
    return torch.cat([g[n].reshape(x.shape[0], -1) for n in params], 1).norm(dim=1)


class Hooked(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 1)
        self.a.register_forward_hook(lambda m, args, out: out * 2.0)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def test_a_user_forward_hook_that_changes_the_output_is_exact_or_refused():
    torch.manual_seed(0)
    m = Hooked().double()
    x = torch.randn(3, 4, dtype=torch.float64)
    ref = reference_norms(m, x)
    try:
        got = ClippingEngine(m, clip_norm=1.0).per_example_norms(mse, (x,))
    except ValueError:
        return
    torch.testing.assert_close(got, ref, rtol=1e-9, atol=1e-12)


class Pool(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = nn.Linear(4, 4)
        self.k = nn.Linear(4, 4)
        self.h = nn.Linear(4, 1)

    def forward(self, x):  # (B, T, 4): attention pooling with a per-example query
        q, k = self.q(x.mean(1)), self.k(x)
        a = torch.einsum("bd,btd->bt", q, k).softmax(-1)
        return self.h(torch.einsum("bt,btd->bd", a, k))
