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
