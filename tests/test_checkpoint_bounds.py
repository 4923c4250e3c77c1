"""The boundaries of the checks a resume makes of a checkpoint (its step against
privacy.steps, its ledger's count and rates, its plan's denominator, its frozen parameters'
names), and a failed write in a one-process run: each unpinned until a mutation run of
dptrain/checkpoint (stop 50)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dptrain import checkpoint as ckpt
from dptrain.config import ConfigError, load
from dptrain.trainer import RunConfig, Trainer

TINY = str(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml")
FAST = ["train.progress=false", "privacy.steps=2", "train.checkpoint_every=0"]


def _trainer(out: Path) -> Trainer:
    return Trainer(load(RunConfig, TINY, FAST), out)


@pytest.fixture(scope="module")
def at_the_end(tmp_path_factory):
    """The captured state of a run at its last step (privacy.steps=2)."""
    t = _trainer(tmp_path_factory.mktemp("end") / "run")
    t.private_step()
    t.private_step()
    return ckpt.capture(t)


def _forge(state: dict, tmp_path: Path, step: int, releases: int) -> Path:
    state = {**state, "step": step,
             "ledger": {**state["ledger"],
                        "history": [[s, q, releases] for s, q, _ in state["ledger"]["history"]]}}
    return ckpt.write(state, tmp_path / "forged", step, keep=1)


def test_a_checkpoint_one_step_beyond_privacy_steps_is_refused(tmp_path, at_the_end):
    # step and ledger agree at privacy.steps + 1: one release more than the plan spends (tests of
    # step 99 alone let an off-by-one bound through)
    path = _forge(at_the_end, tmp_path, 3, 3)
    with pytest.raises(ConfigError, match=r"at step 3, beyond privacy.steps \(2\)"):
        ckpt.load(_trainer(tmp_path / "other"), path)


def test_a_ledger_counting_more_releases_than_its_step_is_refused(tmp_path, at_the_end):
    # more releases than the step is as inconsistent as fewer
    path = _forge(at_the_end, tmp_path, 1, 2)
    with pytest.raises(ConfigError, match="ledger counts 2 releases at step 1"):
        ckpt.load(_trainer(tmp_path / "other"), path)


def test_a_checkpoint_write_that_fails_raises_in_a_one_process_run(tmp_path, monkeypatch):
    # a full disk: the run must not go on as if its step were saved (secure mode then writes
    # the rows the checkpoint was to cover)
    t = _trainer(tmp_path / "run")
    t.private_step()

    def full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckpt, "write", full)
    with pytest.raises(OSError, match="No space left"):
        ckpt.save(t, tmp_path / "run")


def test_a_checkpoint_whose_plan_has_another_release_denominator_is_refused(tmp_path,
                                                                             at_the_end):
    # b = expected_batch_size or floor(q N): another version's rounding (or an edit) would
    # change the mechanism's denominator mid-run
    state = {**at_the_end, "plan": {**at_the_end["plan"],
                                    "denominator": at_the_end["plan"]["denominator"] + 1}}
    path = ckpt.write(state, tmp_path / "forged", state["step"], keep=1)
    with pytest.raises(ConfigError, match="release denominator b"):
        ckpt.load(_trainer(tmp_path / "other"), path)


def test_other_frozen_parameters_are_named_as_such_not_as_another_base():
    # keys differ -> model.trainable (the digests differ too, but that message blames the
    # pretrained files)
    import torch

    def model(frozen: tuple[str, ...]):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
        for n, p in m.named_parameters():
            p.requires_grad_(n not in frozen)
        return m

    saved = ckpt.frozen_state(model(("0.weight",)))
    mine = ckpt.frozen_state(model(("0.weight", "1.weight")))
    with pytest.raises(ConfigError) as e:
        ckpt.check_frozen(saved, mine, Path("ck"))
    assert e.value.field == "model.trainable"
    ckpt.check_frozen(saved, ckpt.frozen_state(model(("0.weight",))), Path("ck"))  # the same


def test_a_ledger_at_a_larger_sampling_rate_is_refused(tmp_path, at_the_end):
    # every release's rate must be the plan's, a larger one too
    history = [[s, q * 2, n] for s, q, n in at_the_end["ledger"]["history"]]
    state = {**at_the_end, "ledger": {**at_the_end["ledger"], "history": history}}
    path = ckpt.write(state, tmp_path / "forged", state["step"], keep=1)
    with pytest.raises(ConfigError, match="sampling rate"):
        ckpt.load(_trainer(tmp_path / "other"), path)


def _rdp_epsilon(history, delta: float) -> float:
    """Epsilon of ``history`` by opacus' own RDP accountant (tiny.yaml's), not dptrain's."""
    from opacus.accountants import RDPAccountant

    acc = RDPAccountant()
    acc.history = [tuple(e) for e in history]
    return acc.get_epsilon(delta=delta)


def _with_history(state: dict, tmp_path: Path, history) -> Path:
    state = {**state, "ledger": {**state["ledger"], "history": history}}
    return ckpt.write(state, tmp_path / "forged", state["step"], keep=1)


@pytest.mark.parametrize("edit, says", [
    # one of the two releases at a larger sigma, or at a larger rate, the other the plan's:
    # every entry is bounded, not only the first
    (lambda s, q: [[s, q, 1], [s * 100, q, 1]], "at noise multiplier"),
    (lambda s, q: [[s, q, 1], [s, q * 2, 1]], "sampling rate"),
    # one release at half the sigma, one at the plan's: the plan untouched, so only the
    # ledger's mixed entries say that more was spent than the target allows
    (lambda s, q: [[s / 2, q, 1], [s, q, 1]], "and with them the plan spends"),
], ids=["sigma-large", "rate-large", "sigma-small"])
def test_a_ledger_with_one_release_the_run_cannot_have_made_among_others_is_refused(
        tmp_path, at_the_end, edit, says):
    t = _trainer(tmp_path / "other")
    sigma, q = t.plan.noise_multiplier, t.plan.sample_rate
    history = edit(sigma, q)
    assert at_the_end["ledger"]["history"] == [[sigma, q, 2]]
    if "spends" in says:  # the mixed ledger is over the target by opacus' own accountant
        assert _rdp_epsilon(history, 1e-5) > 8.0 * 1.05
    with pytest.raises(ConfigError, match=says):
        ckpt.load(t, _with_history(at_the_end, tmp_path, history))


@pytest.mark.parametrize("ratio, accepted", [(1.0099, True), (1.0101, False)])
def test_another_versions_sigma_is_accepted_up_to_1_percent_above_this_run_s(
        tmp_path, at_the_end, ratio, accepted):
    # SIGMA_DRIFT is 1%: a release just inside is another version's calibration, one just
    # outside is refused (tests at 0.5% and 2% alone let a drift of 0.6% or 1.5% through)
    t = _trainer(tmp_path / "other")
    sigma, q = t.plan.noise_multiplier, t.plan.sample_rate
    history = [[sigma * ratio, q, 2]]
    # within the drift, the target holds by opacus' accountant (a larger sigma spends less)
    assert _rdp_epsilon(history, 1e-5) <= _rdp_epsilon([[sigma, q, 2]], 1e-5) <= 8.0
    path = _with_history(at_the_end, tmp_path, history)
    if accepted:
        ckpt.load(t, path)
        assert t.ledger.history == [(sigma * ratio, q, 2)] and t.step == 2
    else:
        with pytest.raises(ConfigError, match="cannot give"):
            ckpt.load(t, path)


def test_a_checkpoint_s_frozen_tensors_are_checked_by_keys_then_by_values():
    # a model that freezes nothing, onto a checkpoint that left tensors out: those are
    # missing (model.trainable); the same names with other values: another base model
    import torch

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    m[0].weight.requires_grad_(False)
    saved = ckpt.frozen_state(m)
    with pytest.raises(ConfigError) as e:
        ckpt.check_frozen(saved, None, Path("ck"))
    assert e.value.field == "model.trainable"
    with torch.no_grad():
        m[0].weight[0, 0] += 1e-3
    other = ckpt.frozen_state(m)
    assert other["keys"] == saved["keys"] and other["sha256"] != saved["sha256"]
    with pytest.raises(ConfigError) as e:
        ckpt.check_frozen(saved, other, Path("ck"))
    assert e.value.field == "model.pretrained_path" and saved["sha256"][:12] in str(e.value)
    ckpt.check_frozen(None, other, Path("ck"))  # every tensor in the checkpoint


def test_a_checkpoint_whose_privacy_seed_is_not_this_run_s_is_refused(tmp_path, at_the_end):
    # privacy.seed is compared with the config; the seed a checkpoint stores is what its
    # samples and noise were drawn with: another one (something else wrote it) is refused
    state = {**at_the_end, "privacy_seed": at_the_end["privacy_seed"] + 1}
    path = ckpt.write(state, tmp_path / "forged", state["step"], keep=1)
    with pytest.raises(ConfigError, match="privacy seed is not this run's"):
        ckpt.load(_trainer(tmp_path / "other"), path)


@pytest.mark.parametrize("edit", [{"privacy_seed": None}, {"cost": {"resumes": -1}}])
def test_a_checkpoint_refused_by_its_last_checks_leaves_the_trainer_as_it_was(
        tmp_path, at_the_end, edit):
    # the privacy seed's and the cost's checks came after the model, optimizer, ledger and
    # RNG were loaded: a caller that caught the refusal kept a half-resumed trainer
    import torch

    state = {**at_the_end, **edit}
    path = ckpt.write(state, tmp_path / "forged", state["step"], keep=1)
    t = _trainer(tmp_path / "other")
    params = {n: p.detach().clone() for n, p in t.model.named_parameters()}
    rng = torch.get_rng_state()
    with pytest.raises(ConfigError, match="is unusable"):
        ckpt.load(t, path)
    assert t.step == 0 and t.ledger.num_releases == 0
    assert all(torch.equal(p, params[n]) for n, p in t.model.named_parameters())
    assert torch.equal(torch.get_rng_state(), rng)
