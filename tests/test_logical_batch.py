"""Logical batches far larger than the microbatch (issue 5, item 7).

configs/batch32k.yaml releases logical batches of 32,768 expected examples in microbatches of
1,024. The same machinery at a size a test can afford: N = 4,096 synthetic images at q = 0.5
(about 2,048 examples per logical batch) in microbatches of 64 (32 of them) must give the same
release, and the same parameters after the optimizer, as ONE microbatch of 2,048 (and one of
4,096: the whole sample at once): microbatching changes memory, never the result.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "configs" / "batch32k.yaml")
SMALL = ["data.synthetic_train_size=4096", "data.synthetic_test_size=16",
         "train.progress=false", "train.checkpoint_every=0"]


def _trainer(*overrides: str):
    from dptrain.config import load
    from dptrain.trainer import RunConfig, Trainer

    return Trainer(load(RunConfig, CONFIG, [*SMALL, *overrides]))


def _rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).norm()
                     / b[k].double().norm().clamp_min(1e-30)) for k in b)


def test_batch32k_config_is_a_logical_batch_of_32768():
    from dptrain.config import load
    from dptrain.trainer import RunConfig

    cfg = load(RunConfig, CONFIG, [])
    n = cfg.data.synthetic_train_size
    assert cfg.privacy.release_denominator(n) == 32768
    assert cfg.performance.microbatch_size * 16 <= 32768  # many microbatches per release


@pytest.mark.parametrize("sigma", ["0.0", "1.5"])
def test_microbatch_64_equals_one_microbatch_of_2048(sigma):
    # sigma 0: the clipped sum alone (the part microbatching could change); 1.5 (about what
    # the config calibrates): the whole release with its noise.
    noise = [f"privacy.noise_multiplier={sigma}", "privacy.epsilon=null"]
    small = _trainer("performance.microbatch_size=64", *noise)
    n0 = len(small.sample(0))
    assert 1900 < n0 < 2200 and small.plan.denominator == 2048
    assert len(small.microbatches(small.local_sample(0))) >= 30
    releases = {}
    params = {}
    for mb in (64, 2048, 4096):
        t = small if mb == 64 else _trainer(f"performance.microbatch_size={mb}", *noise)
        released, _ = t.release(0)
        releases[mb] = {k: v.detach().clone() for k, v in released.items()}
        t.private_step()  # the release of step 0 again, then the optimizer
        params[mb] = {n: p.detach().clone() for n, p in t.named_params}
    assert max(abs(v).max() for v in releases[64].values()) > 0
    for mb in (2048, 4096):
        assert _rel(releases[64], releases[mb]) <= 1e-6, mb
        assert _rel(params[64], params[mb]) <= 1e-6, mb
