"""FSDP-sharded checkpoints (issue 6): every rank gathers its shards of the model, optimizer
(Muon momenta, AdamW moments), inner-momentum history to rank 0, which writes a full checkpoint;
loading re-shards onto any world size. Resume 2 ranks -> 1 and 1 -> 2: same parameters to 1e-5."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dptrain.parallel.dist import spawn

pytestmark = pytest.mark.distributed

TINY = str(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml")
ARGS = ["train.progress=false", "privacy.steps=4", "train.checkpoint_every=2",
        "optim.inner_momentum.k_muon=2", "optim.inner_momentum.k_other=2",
        "optim.inner_momentum.gamma_muon=0.9", "performance.sharding=fsdp"]


def _trainer(out: str):
    from dptrain.config import load
    from dptrain.trainer import RunConfig, Trainer

    return Trainer(load(RunConfig, TINY, ARGS), out)


def _first_half(rank: int, world: int, out: str) -> None:
    from dptrain import checkpoint as ckpt

    t = _trainer(out)
    t.private_step()
    t.private_step()
    ckpt.save(t, Path(out))


def _second_half(rank: int, world: int, out: str) -> dict:
    from dptrain import checkpoint as ckpt

    t = _trainer(out)
    ckpt.load(t, ckpt.find_latest(Path(out)))
    assert t.step == 2 and t.ledger.num_releases == 2
    t.private_step()
    t.private_step()
    return {k: v.clone() for k, v in t.full_state_dict().items()}


def _rel(a: dict, b: dict) -> float:
    common = set(a) & set(b)
    assert len(common) >= max(len(a), len(b)) - 1  # tied wte/lm_head may be listed once
    return max(float((a[k].double() - b[k].double()).norm()
                     / b[k].double().norm().clamp_min(1e-12)) for k in common)


def test_resume_across_world_sizes(tmp_path):
    from dptrain import checkpoint as ckpt

    ref = _trainer(str(tmp_path / "ref"))
    for _ in range(4):
        ref.private_step()
    want = {k: v.detach().clone() for k, v in ref.model.state_dict().items()}
    # 2 ranks -> 1 rank
    spawn(_first_half, 2, str(tmp_path / "a"))
    path = ckpt.find_latest(tmp_path / "a")
    assert path is not None and path.name == "step-00000002"
    state = ckpt.read(path)
    assert state["world_size"] == 2
    assert state["optimizer"]["history"]["states"]  # the history travelled, unsharded
    for osd in state["optimizer"]["optimizers"]:
        for st in osd["state"].values():
            for v in st.values():
                assert not hasattr(v, "to_local")  # plain full tensors
    got = _second_half(0, 1, str(tmp_path / "a"))
    assert _rel(got, want) <= 1e-5
    # 1 rank -> 2 ranks
    _first_half(0, 1, str(tmp_path / "b"))
    results = spawn(_second_half, 2, str(tmp_path / "b"))
    got2 = next(r for r in results if r)
    assert _rel(got2, want) <= 1e-5
    assert torch.isfinite(torch.cat([v.flatten() for v in got2.values()])).all()
