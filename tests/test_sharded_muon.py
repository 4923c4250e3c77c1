"""Muon, MuonBC and MuonS on Shard(0) DTensor parameters (FSDP2's layout) take the same steps as
in one process, also when a rank's shard holds no row of a matrix (a (1, 6) matrix on 2 ranks:
rank 1's shard is (0, 6))."""

from __future__ import annotations

import torch

from dptrain.optim.muon import Muon, MuonBC, MuonS
from dptrain.parallel.dist import spawn

SHAPES = [(5, 9), (9, 4), (3, 2, 3, 3), (1, 6)]
KWARGS = {"Muon": {}, "MuonBC": {"release_noise_std": 0.3, "seed": 3}, "MuonS": {"seed": 3}}
CLASSES = {"Muon": Muon, "MuonBC": MuonBC, "MuonS": MuonS}


def _data():
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(s, generator=g, dtype=torch.float64) for s in SHAPES]
    grads = [[torch.randn(s, generator=g, dtype=torch.float64) for s in SHAPES]
             for _ in range(3)]
    return weights, grads


def _build(cls_name, params):
    return CLASSES[cls_name]([{"params": params,
                               "param_names": [f"w{i}" for i in range(len(params))]}],
                             lr=0.05, ns_dtype="float64", **KWARGS[cls_name])


def _steps(cls_name, params, grads, wrap=lambda t: t):
    opt = _build(cls_name, params)
    for gs in grads:
        for p, g in zip(params, gs):
            p.grad = wrap(g.clone())
        opt.step()


def _sharded(rank: int, world: int) -> dict[str, list[torch.Tensor]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for cls_name in CLASSES:
        weights, grads = _data()
        params = [torch.nn.Parameter(distribute_tensor(w.clone(), mesh, [Shard(0)]))
                  for w in weights]
        _steps(cls_name, params, grads, lambda t: distribute_tensor(t, mesh, [Shard(0)]))
        out[cls_name] = [p.detach().full_tensor() for p in params]
    return out


def test_sharded_steps_equal_one_process_with_an_empty_shard():
    ranks = spawn(_sharded, 2)
    for cls_name in CLASSES:
        weights, grads = _data()
        params = [torch.nn.Parameter(w.clone()) for w in weights]
        _steps(cls_name, params, grads)
        for full in ranks:
            for got, want in zip(full[cls_name], params):
                torch.testing.assert_close(got, want.detach(), rtol=1e-12, atol=1e-12,
                                           msg=lambda m: f"{cls_name}: {m}")
