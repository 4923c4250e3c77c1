"""Distributed feature combinations that tests/test_distributed.py does not put together (picked
from a sweep of 41 random combinations on 1 to 4 ranks and 15 resumes across world sizes, all
of which agreed): DP-Muon-S with the DiSK
filter resumed from a 2-rank FSDP checkpoint on 3 ranks (uneven shards), and parameters with
fewer rows than ranks (a 2-class head on 3 FSDP ranks: the last rank holds no rows) with inner
momentum, DOPPLER and an EMA. Tolerance: docs/distributed.md's relative 1e-5.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dptrain.parallel.dist import spawn

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")
TINY_IMAGES = str(ROOT / "configs" / "tiny_images.yaml")
BASE = ["train.progress=false", "train.checkpoint_every=0", "privacy.accountant=rdp",
        "performance.num_threads=1"]


def _trainer(config, overrides, out=None):
    from dptrain.config import load
    from dptrain.trainer import RunConfig, Trainer

    return Trainer(load(RunConfig, config, BASE + overrides), out)


def _full(t) -> dict:
    out = {k: v.clone() for k, v in t.full_state_dict().items()}
    if t.optimizer.ema is not None:
        with t.optimizer.ema.swapped_in():
            out.update({f"ema/{k}": v.clone() for k, v in t.full_state_dict().items()})
    return out


def _run(rank, world, config, overrides, out, save_at, resume):
    from dptrain import checkpoint as ckpt

    t = _trainer(config, overrides, out)
    if resume:
        ckpt.load(t, ckpt.find_latest(Path(out)))
        assert t.step == save_at and t.ledger.num_releases == save_at
    while t.step < t.plan.steps:
        t.private_step()
        if save_at is not None and not resume and t.step == save_at:
            ckpt.save(t, Path(out))
    return _full(t), t.epsilon()


def _rel(a: dict, b: dict) -> float:
    common = set(a) & set(b)
    assert len(common) >= max(len(a), len(b)) - 1
    return max(float((a[k].double() - b[k].double()).norm()
                     / b[k].double().norm().clamp_min(1e-12)) for k in common)


MUON_S_DISK = ["optim.name=muon_s", "optim.filter.name=disk", "optim.filter.kappa=0.6",
               "optim.ema_decay=0.8", "model.dropout=0.1", "privacy.steps=4"]


def test_muon_s_disk_ema_resumed_from_2_fsdp_ranks_on_3_equals_one_process(tmp_path):
    ref, eps_ref = spawn(_run, 1, TINY, MUON_S_DISK, None, None, False)[0]
    out = str(tmp_path / "run")
    two = spawn(_run, 2, TINY, MUON_S_DISK + ["performance.sharding=fsdp"], out, 2, False)[0]
    assert _rel(two[0], ref) <= 1e-5
    three = spawn(_run, 3, TINY, MUON_S_DISK + ["performance.sharding=fsdp"], out, 2, True)[0]
    assert _rel(three[0], ref) <= 1e-5
    assert three[1] == eps_ref
    # the EMA really is compared (it differs from the last iterate)
    ema = {k[len("ema/"):]: v for k, v in three[0].items() if k.startswith("ema/")}
    assert ema and _rel(ema, {k: three[0][k] for k in ema}) > 1e-3


FEW_ROWS = ["data.num_classes=2", "model.hidden=0", "optim.inner_momentum.k_muon=1",
            "optim.inner_momentum.k_other=1", "optim.filter.name=doppler",
            "optim.ema_decay=0.5", "privacy.steps=3", "performance.microbatch_size=7"]


def test_parameters_with_fewer_rows_than_ranks_same_on_3_fsdp_ranks(tmp_path):
    ref = spawn(_run, 1, TINY_IMAGES, FEW_ROWS, None, None, False)[0][0]
    got = spawn(_run, 3, TINY_IMAGES, FEW_ROWS + ["performance.sharding=fsdp"], None, None,
                False)[0][0]
    head = [k for k in ref if not k.startswith("ema/") and ref[k].dim() and ref[k].shape[0] == 2]
    assert head  # the case is what it claims: a parameter of 2 rows over 3 ranks
    assert _rel(got, ref) <= 1e-5
