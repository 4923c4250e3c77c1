"""BatchNorm in training mode couples the examples of a microbatch through its statistics: no
per-example gradient exists, and one example changes the others' gradients, so no clip bounds
its influence. The engine refuses it naming the layer (before: accepted through the torch.func
fallback with a generic warning, or failing by accident). In eval mode (running statistics,
e.g. a frozen pretrained backbone) it is per-example, and the norms are exact."""

import warnings

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from dptrain.clipping import ClippingEngine


def _model(track: bool, affine: bool = True) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3, affine=affine,
                                                            track_running_stats=track),
                         nn.ReLU(), nn.Flatten(), nn.Linear(27, 2)).double()


def _loss(m, b):
    return 0.5 * m(b[0]).pow(2).sum(1)


X = torch.randn(4, 2, 5, 5, dtype=torch.float64)


@pytest.mark.parametrize("track,affine", [(False, True), (True, True), (True, False)])
def test_batchnorm_in_training_mode_is_refused_naming_the_layer(track, affine):
    m = _model(track, affine).train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the fallback's note for BatchNorm's affine params)
        engine = ClippingEngine(m, clip_norm=1.0)
    with pytest.raises(ValueError, match=r"1 \(BatchNorm2d\) is in training mode"):
        engine.per_example_norms(_loss, (X,))
    acc = {n: torch.zeros_like(p) for n, p in m.named_parameters()}
    with pytest.raises(ValueError, match="BatchNorm2d"):
        engine.accumulate(_loss, (X,), acc)


def test_batchnorm_in_eval_mode_is_per_example_and_exact():
    m = _model(True)
    m(X)  # running statistics that are not the defaults
    m.eval()
    for p in m[1].parameters():
        p.requires_grad_(False)  # a frozen backbone's norm layer
    norms = ClippingEngine(m, clip_norm=1.0).per_example_norms(_loss, (X,))
    params = {n: p.detach() for n, p in m.named_parameters() if p.requires_grad}
    buffers = {n: b for n, b in m.named_buffers()}

    def one(p, x):
        return _loss(lambda inp: functional_call(m, {**p, **buffers}, (inp,)), (x[None],))[0]

    g = vmap(grad(one), in_dims=(None, 0))(params, X)
    want = torch.sqrt(sum(v.reshape(4, -1).pow(2).sum(1) for v in g.values()))
    torch.testing.assert_close(norms, want, rtol=1e-9, atol=1e-12)
