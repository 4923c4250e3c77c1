"""A layer whose output is a view (nn.Linear on a (B, T, d) input, transformers' Conv1D on any
input) followed by an in-place op (ReLU(inplace=True), ``h += c``, ``h[..., 0].mul_(c)``):
the engine's tensor hook on the view never fires and ``_check_reached`` takes the layer for
unused, so its gradient was silently missing from the norms and the clipped sum. Either the
exact torch.func result or a refusal (ValueError) is acceptable; a wrong norm is not."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

from dptrain.clipping import ClippingEngine


class Net(nn.Module):
    def __init__(self, op, conv1d):
        super().__init__()
        self.op = op
        if conv1d:
            from transformers.pytorch_utils import Conv1D
            self.a = Conv1D(4, 4)
        else:
            self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)

    def forward(self, x):
        h = self.a(x)
        if self.op == "relu_":
            h = F.relu(h, inplace=True)
        elif self.op == "iadd":
            h += 1.0
        else:
            h[..., 0].mul_(2.0)
        return self.b(torch.tanh(h))


def loss_fn(m, batch):
    out = m(batch[0])
    return 0.5 * out.pow(2).reshape(out.shape[0], -1).sum(1)


def reference(m, x):
    params = {n: p.detach() for n, p in m.named_parameters()}

    def one(p, xb):
        return loss_fn(lambda *a: functional_call(m, p, a), (xb[None],))[0]

    g = vmap(grad(one), in_dims=(None, 0))(params, x)
    return torch.cat([g[n].reshape(x.shape[0], -1) for n in params], 1)


@pytest.mark.parametrize("op", ["relu_", "iadd", "slice_mul"])
@pytest.mark.parametrize("conv1d, shape", [(False, (5, 3, 4)), (True, (5, 4)), (True, (5, 3, 4))])
def test_in_place_op_on_a_view_output_is_exact_or_refused(op, conv1d, shape):
    torch.manual_seed(0)
    m = Net(op, conv1d).double()
    x = torch.randn(*shape, dtype=torch.float64)
    ref = reference(m, x)
    rn = ref.norm(dim=1)
    C = float(rn.median())
    eng = ClippingEngine(m, clip_norm=C)
    try:
        norms = eng.per_example_norms(loss_fn, (x,))
        acc = {}
        ClippingEngine(m, clip_norm=C).accumulate(loss_fn, (x,), acc)
    except ValueError:
        return  # refused: acceptable
    torch.testing.assert_close(norms, rn, rtol=1e-9, atol=1e-12)
    lam = (C / rn).clamp(max=1.0)
    want = (ref * lam[:, None]).sum(0)
    got = torch.cat([acc[n].reshape(-1) for n, _ in m.named_parameters()])
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
