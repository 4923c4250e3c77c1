"""Parameter EMA (optim.ema_decay): bias-corrected average of the iterates, post-processing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dptrain.config import ConfigError, load
from dptrain.optim.ema import ParameterEMA
from dptrain.trainer import RunConfig, Trainer

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"
FAST = ["train.progress=false", "train.checkpoint_every=0", "privacy.steps=5"]


def test_average_is_the_decay_weighted_mean_of_the_iterates_after_the_start():
    p = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    ema = ParameterEMA([("w", p)], decay=0.7, start_step=2)
    thetas = [torch.randn(3, dtype=torch.float64) for _ in range(6)]
    for step, th in enumerate(thetas, start=1):
        with torch.no_grad():
            p.copy_(th)
        ema.update(step)
        if step <= 2:  # before the start it follows the parameters
            assert torch.equal(ema.values["w"], th)
            continue
        used = thetas[2:step]  # iterates after the start step
        w = torch.tensor([0.7 ** (len(used) - 1 - s) for s in range(len(used))],
                         dtype=torch.float64)
        want = sum(wi * t for wi, t in zip(w, used)) / w.sum()
        torch.testing.assert_close(ema.values["w"], want, rtol=1e-12, atol=1e-14)
    # swapped in for a block, restored afterwards
    with ema.swapped_in():
        assert torch.equal(p.detach(), ema.values["w"])
    assert torch.equal(p.detach(), thetas[-1])


def test_a_state_dict_round_trip_continues_the_same_average():
    gen = torch.Generator().manual_seed(2)
    thetas = [torch.randn(3, dtype=torch.float64, generator=gen) for _ in range(6)]
    p, q = (torch.nn.Parameter(torch.zeros(3, dtype=torch.float64)) for _ in range(2))
    a = ParameterEMA([("w", p)], decay=0.7)
    for step, th in enumerate(thetas[:3], start=1):
        with torch.no_grad():
            p.copy_(th)
        a.update(step)
    b = ParameterEMA([("w", q)], decay=0.7)
    b.load_state_dict(a.state_dict())
    for step, th in enumerate(thetas[3:], start=4):
        with torch.no_grad():
            p.copy_(th)
            q.copy_(th)
        a.update(step)
        b.update(step)
    w = torch.tensor([0.7 ** (5 - s) for s in range(6)], dtype=torch.float64)
    want = sum(wi * t for wi, t in zip(w, thetas)) / w.sum()
    torch.testing.assert_close(a.values["w"], want, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(b.values["w"], want, rtol=1e-12, atol=1e-14)


def test_ema_is_post_processing_and_the_run_reports_and_exports_both_models(tmp_path):
    plain = Trainer(load(RunConfig, TINY, FAST), tmp_path / "plain")
    s0 = plain.run()
    t = Trainer(load(RunConfig, TINY, [*FAST, "optim.ema_decay=0.6"]), tmp_path / "ema")
    s1 = t.run()
    # the iterates (and so the privacy mechanism, epsilon, the last iterate's metrics) are
    # those of the run without EMA
    for (n, a), (_, b) in zip(plain.model.named_parameters(), t.model.named_parameters()):
        assert torch.equal(a, b), n
    assert s0["epsilon"] == s1["epsilon"]
    assert s1["test_last_iterate_nll_per_token"] == pytest.approx(s0["test_nll_per_token"],
                                                                  rel=1e-12)
    assert s1["test_nll_per_token"] != s0["test_nll_per_token"]  # the average: another model
    final = tmp_path / "ema" / "final"
    averaged = load_file(str(final / "model.safetensors"))
    last = load_file(str(final / "last_iterate.safetensors"))
    for n, p in t.model.named_parameters():
        assert torch.equal(last[n], p.detach()), n
        assert torch.equal(averaged[n], t.optimizer.ema.values[n]), n
    assert t.optimizer.ema.count == 5
    assert not (tmp_path / "plain" / "final" / "last_iterate.safetensors").exists()


@pytest.mark.parametrize("start", [0, 2, 3])  # (4, the last step: refused, test_cli_train)
def test_a_real_run_averages_exactly_the_iterates_after_the_start_step(start):
    # a 4-step float64 run: the average is the decay-weighted mean of theta_{start+1..4}
    decay, steps = 0.5, 4
    t = Trainer(load(RunConfig, TINY, [*FAST, f"privacy.steps={steps}",
                                       f"optim.ema_decay={decay}", f"optim.ema_start_step={start}",
                                       "performance.dtype=float64"]))
    thetas = []
    while t.step < t.plan.steps:
        t.private_step()
        thetas.append({n: p.detach().clone() for n, p in t.named_params})
    ema, used = t.optimizer.ema, thetas[start:]
    assert ema.count == len(used)
    for n, _ in t.named_params:
        w = [decay ** (len(used) - 1 - s) for s in range(len(used))]
        want = sum(wi * th[n] for wi, th in zip(w, used)) / sum(w)
        torch.testing.assert_close(ema.values[n], want, rtol=1e-10, atol=1e-12)
    if len(used) >= 2:  # the setting acts: not the last iterate
        assert any(not torch.equal(ema.values[n], thetas[-1][n]) for n, _ in t.named_params)


@pytest.mark.parametrize("override, field", [("optim.ema_decay=1.0", "optim.ema_decay"),
                                             ("optim.ema_decay=-0.1", "optim.ema_decay"),
                                             ("optim.ema_start_step=-1", "optim.ema_start_step")])
def test_bad_ema_settings_name_the_field(override, field):
    with pytest.raises(ConfigError) as e:
        Trainer(load(RunConfig, TINY, [*FAST, override]))
    assert e.value.field == field


def test_exported_average_keeps_gpt2_tied_weights_stored_once(tmp_path):
    from safetensors import safe_open

    t = Trainer(load(RunConfig, TINY, [*FAST, "privacy.steps=2", "optim.ema_decay=0.5"]),
                tmp_path)
    t.run()
    for name in ("model.safetensors", "last_iterate.safetensors"):
        with safe_open(str(tmp_path / "final" / name), "pt") as f:
            keys = set(f.keys())
        assert "transformer.wte.weight" in keys and "lm_head.weight" not in keys, name


def test_resume_that_turns_ema_on_starts_the_average_at_the_resumed_parameters(tmp_path):
    from dptrain import checkpoint as ckpt

    first = Trainer(load(RunConfig, TINY, FAST), tmp_path)
    first.private_step()
    first.private_step()
    ckpt.save(first, tmp_path)
    second = Trainer(load(RunConfig, TINY, [*FAST, "optim.ema_decay=0.5"]), tmp_path)
    ckpt.load(second, ckpt.find_latest(tmp_path))
    ema = second.optimizer.ema
    assert ema.count == 0
    for n, p in second.named_params:
        assert torch.equal(ema.values[n], p.detach()), n
    second.private_step()  # the first averaged step: w_1 = 1, the average is the iterate
    assert ema.count == 1
    for n, p in second.named_params:
        assert torch.equal(ema.values[n], p.detach()), n
