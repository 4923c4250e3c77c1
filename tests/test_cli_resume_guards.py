"""`dptrain train` never loses or mixes what an earlier run wrote, and secure mode never draws
a release again once something derived from it was written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from _forge import forged, rehash

from dptrain import checkpoint as ckpt
from dptrain import trainer as trainer_mod
from dptrain.cli import main
from dptrain.data import DEFAULT_E2E_PATH, REPO_ROOT

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")
E2E_DIR = (REPO_ROOT / DEFAULT_E2E_PATH).resolve()
needs_e2e = pytest.mark.skipif(not (E2E_DIR / "devset.csv").is_file(),
                               reason="the E2E files of ../shared/data are not here")
SECURE = ("privacy.secure_mode=true", "privacy.seed=null")


def train(capsys, out, *args) -> tuple[int, str]:
    code = main(["train", "--config", TINY, "--output-dir", str(out), *args])
    return code, capsys.readouterr().err


def snapshot(d: Path) -> dict[str, bytes]:
    """Every file's bytes, but run.lock's: a start takes the lock, and names itself there,
    before its checks (tests/test_cli_run_lock.py); the run's outputs are the rest."""
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*"))
            if p.is_file() and p.name != "run.lock"}


def one_line(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if line and not line.startswith("dptrain: privacy.seed")]
    assert len(lines) == 1, err
    return lines[0]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished 4-step run with a checkpoint after every step (kept: the last 2)."""
    out = tmp_path_factory.mktemp("finished") / "run"
    assert main(["train", "--config", TINY, "--output-dir", str(out),
                 "train.checkpoint_every=1", "train.keep_checkpoints=4"]) == 0
    return out


def unfinished_copy(run: Path, out: Path) -> Path:
    """A copy of ``run`` without its summary and final model: as if killed after its last
    checkpoint."""
    shutil.copytree(run, out)
    (out / "summary.json").unlink()
    shutil.rmtree(out / "final")
    return out


def test_output_dir_that_is_a_file(tmp_path, capsys):
    f = tmp_path / "afile"
    f.write_text("mine")
    code, err = train(capsys, f)
    assert code == 2 and "output-dir" in one_line(err) and "not a directory" in err
    assert f.read_text() == "mine"


@pytest.mark.parametrize("earlier", ["unfinished", "only_metrics"])
def test_a_fresh_run_into_an_earlier_run_is_refused(tmp_path, capsys, finished, earlier):
    out = tmp_path / earlier
    if earlier == "unfinished":
        unfinished_copy(finished, out)
        says = "--resume auto"
    else:  # a run killed before its first checkpoint leaves metrics.jsonl and nothing else
        out.mkdir()
        (out / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 3.0}) + "\n")
        says = "metrics.jsonl"
    before = snapshot(out)
    code, err = train(capsys, out, "privacy.steps=2")
    assert code == 2 and "output-dir" in one_line(err) and says in err
    assert snapshot(out) == before


def test_a_fresh_run_drops_a_line_cut_short_before_its_first_row(tmp_path, capsys):
    # a run killed while writing its first row (before any checkpoint) leaves a fragment; the
    # next fresh run appended its first row to it, and that row was unreadable for good
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1, "train_loss": 3.49, "lr": {"matr')
    code, err = train(capsys, out, "privacy.steps=2", "train.checkpoint_every=0")
    assert code == 0, err
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]


def test_eval_every_evaluates_at_its_steps_whatever_log_every(tmp_path, capsys):
    # evaluations ran only at steps that were also logging steps (log_every 3, eval_every 2:
    # at 6 only)
    out = tmp_path / "run"
    code, err = train(capsys, out, "privacy.steps=8", "train.checkpoint_every=0",
                      "train.log_every=3", "train.eval_every=2")
    assert code == 0, err
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 3, 4, 6, 8]
    assert [r["step"] for r in rows if "test_loss" in r or "test_nll_per_token" in r] == [
        2, 4, 6]
    assert all("epsilon" in r for r in rows)


def test_resume_path_into_a_finished_run_is_refused(tmp_path, capsys, finished):
    out = tmp_path / "copy"
    shutil.copytree(finished, out)
    before = snapshot(out)
    code, err = train(capsys, out, "--resume", str(finished / "checkpoints" / "step-00000003"))
    assert code == 2 and "finished run" in one_line(err)
    assert snapshot(out) == before


def test_resume_auto_on_a_finished_run_does_nothing(tmp_path, capsys, finished):
    # a requeued job: it used to load the last checkpoint, evaluate again and rewrite
    # summary.json and final/ (with an EMA, the exported model became the last iterate)
    out = tmp_path / "copy"
    shutil.copytree(finished, out)
    before = snapshot(out)
    # (settings that leave its model and summary as they are may differ, and settings that
    # neither config reads: no EMA, no inner momentum, no generations)
    code, err = train(capsys, out, "--resume", "auto", "train.progress=false",
                      "train.checkpoint_every=2", "train.log_every=3", "optim.ema_start_step=2",
                      "optim.inner_momentum.gamma_muon=0.9", "train.max_new_tokens=3",
                      "optim.lr=2e-2", "optim.momentum=0.95", "optim.aux.kwargs={}")
    assert code == 0 and "finished run" in one_line(err) and "nothing to do" in err
    assert snapshot(out) == before
    # but a changed setting is an error, as it is against a checkpoint; and so is one that a
    # resume may change but this finished run was not trained with (a sweep reusing the
    # directory would read "nothing to do" as its own run done)
    for override, field in (("privacy.clip_norm=2", "privacy.clip_norm"), ("seed=1", "seed"),
                            ("model.n_embd=64", "model.n_embd"),
                            ("optim.ema_decay=0.5", "optim.ema_decay"),
                            ("optim.lr=0.5", "optim.lr"),
                            ("optim.inner_momentum.k_muon=1", "optim.inner_momentum.k_muon"),
                            ("optim.aux.lr=0.5", "optim.aux.lr"),
                            ("optim.schedule=cosine", "optim.schedule")):
        code, err = train(capsys, out, "--resume", "auto", override)
        line = one_line(err)
        assert code == 2 and line.split("error: ")[1].startswith(field + ":"), line
        assert "the finished run (summary.json)" in line, line  # not "the checkpoint"
    assert snapshot(out) == before


def test_a_finished_run_s_generation_length_counts_when_any_prompts_are_generated(tmp_path):
    # generate_prompts null (every test prompt: the shipped E2E configs) reads max_new_tokens
    import copy

    from dptrain.commands.train import _check_same_training
    from dptrain.config import ConfigError, load, to_dict

    cfg = load(trainer_mod.RunConfig, TINY)
    saved = to_dict(cfg)
    for prompts, refused in ((None, True), (8, True), (0, False)):
        now = copy.deepcopy(cfg)
        now.train.generate_prompts = prompts
        now.train.max_new_tokens = 128
        was = copy.deepcopy(saved)
        was["train"]["generate_prompts"] = prompts
        if refused:
            with pytest.raises(ConfigError) as e:
                _check_same_training(was, now, tmp_path)
            assert e.value.field == "train.max_new_tokens"
        else:
            _check_same_training(was, now, tmp_path)


def test_a_finished_run_s_older_summary_and_reordered_group_options_are_its_config(
        tmp_path, capsys):
    # a setting newer than the finished run's summary, nested (optim.filter.correction came
    # later): the run had its default; and a group's options in another order are the same
    group = ("optim.groups=[{pattern: ln_f, optimizer: adamw, lr: 0.01, "
             "kwargs: {betas: [0.9, 0.95], eps: 1.0e-8}}]")
    out = tmp_path / "run"
    assert train(capsys, out, "privacy.steps=1", group)[0] == 0
    summary = json.loads((out / "summary.json").read_text())
    del summary["config"]["optim"]["filter"]["correction"]
    (out / "summary.json").write_text(json.dumps(summary))
    before = snapshot(out)
    reordered = group.replace("betas: [0.9, 0.95], eps: 1.0e-8", "eps: 1.0e-8, betas: [0.9, 0.95]")
    code, err = train(capsys, out, "--resume", "auto", "privacy.steps=1", reordered)
    assert code == 0 and "nothing to do" in one_line(err)
    code, err = train(capsys, out, "--resume", "auto", "privacy.steps=1",
                      reordered.replace("lr: 0.01", "lr: 0.02"))
    assert code == 2 and "optim.groups[0].lr: differs" in one_line(err), err
    code, err = train(capsys, out, "--resume", "auto", "privacy.steps=1")  # the group dropped
    assert code == 2 and "optim.groups[0].lr: differs" in one_line(err), err
    assert snapshot(out) == before


def test_resume_path_over_later_checkpoints_is_refused_but_another_dir_works(tmp_path, capsys,
                                                                             finished):
    out = tmp_path / "copy"
    shutil.copytree(finished, out)
    (out / "summary.json").unlink()
    before = snapshot(out)
    code, err = train(capsys, out, "--resume", str(out / "checkpoints" / "step-00000002"))
    assert code == 2 and "step 4" in one_line(err) and "overwrite" in err
    assert "another --output-dir" in err
    assert snapshot(out) == before
    other = tmp_path / "branch"
    code, _ = train(capsys, other, "--resume", str(finished / "checkpoints" / "step-00000002"))
    assert code == 0
    assert json.loads((other / "summary.json").read_text())["steps"] == 4


def test_auto_resume_of_a_finished_run_ignores_its_checkpoints(tmp_path, capsys, finished):
    out = tmp_path / "copy"
    shutil.copytree(finished, out)
    for marker in (out / "checkpoints").glob("step-*/COMPLETE"):
        marker.unlink()
    before = snapshot(out)
    code, err = train(capsys, out, "--resume", "auto")
    assert code == 0 and "nothing to do" in one_line(err)
    assert snapshot(out) == before


def test_resume_with_another_optimizer_structure_exits_2(tmp_path, capsys, finished):
    out = tmp_path / "copy"
    shutil.copytree(finished, out)
    (out / "summary.json").unlink()
    before = snapshot(out)
    code, err = train(capsys, out, "--resume", "auto", "optim.name=adamw", "optim.preset=null")
    line = one_line(err)  # the groups named (it was "IndexError: list index out of range")
    assert code == 2 and "optim" in line and "different parameter groups" in line, line
    assert snapshot(out) == before


@pytest.mark.parametrize("content, words", [
    ({"foo": 1}, "lacks step, optimizer, ledger, config, rng"),
    ([1, 2], "holds a list"),
    ("drop ledger", "lacks ledger"),
    ("drop privacy_seed", "privacy seed"),  # was an assert: KeyError, exit 1
])
def test_a_checkpoint_with_intact_checksums_but_other_content_exits_2(tmp_path, capsys, finished,
                                                                     content, words):
    # state.pt replaced and the marker rewritten to vouch for it: written by something else
    import torch

    out = unfinished_copy(finished, tmp_path / "copy")
    step_dir = sorted((out / "checkpoints").glob("step-*"))[-1]
    state_pt = step_dir / "state.pt"
    if content in ("drop ledger", "drop privacy_seed"):
        state = torch.load(state_pt, weights_only=False)
        del state[content.split()[1]]
        content = state
    torch.save(content, state_pt)
    rehash(step_dir, "state.pt")
    before = snapshot(out)
    code, err = train(capsys, tmp_path / "other", "--resume", str(step_dir))
    line = one_line(err)
    assert code == 2 and "resume" in line and words in line and "not written by dptrain" in line
    assert snapshot(out) == before


@pytest.mark.parametrize("override, field", [("optim.name=muon_s", "optim.name"),
                                             ("optim.aux.optimizer=sgd", "optim.aux.optimizer")])
def test_resume_with_another_optimizer_in_a_group_names_it(tmp_path, capsys, finished, override,
                                                          field):
    # it used to load, then fail at the first step with a bare KeyError (exit 1)
    code, err = train(capsys, tmp_path / "branch", "--resume",
                      str(finished / "checkpoints" / "step-00000003"), override)
    line = one_line(err)
    assert code == 2 and field in line and "in the checkpoint" in line
    assert not (tmp_path / "branch").exists() or not any((tmp_path / "branch").iterdir())


def test_changed_optimizer_settings_at_a_resume_apply_and_are_named(tmp_path, capsys, finished):
    code, err = train(capsys, tmp_path / "branch", "--resume",
                      str(finished / "checkpoints" / "step-00000003"), "optim.weight_decay=0.1",
                      "optim.aux.kwargs.betas=[0.5,0.9]", "optim.lr=0.01",
                      "optim.schedule=cosine")
    assert code == 0
    line = [x for x in err.splitlines() if "optimizer settings differ" in x]
    # the config keys that changed (the learning rate and schedule too), then what that
    # changes in the parameter groups
    assert len(line) == 1 and line[0].endswith(
        "apply: optim.aux.kwargs.betas: (not set) -> [0.5, 0.9]; optim.lr: 0.02 -> 0.01; "
        "optim.schedule: 'constant' -> 'cosine'; optim.weight_decay: 0.0 -> 0.1 (parameter "
        "groups: matrices.weight_decay: 0.0 -> 0.1; others.betas: (0.9, 0.999) -> (0.5, 0.9))")
    code, err = train(capsys, tmp_path / "same", "--resume",
                      str(finished / "checkpoints" / "step-00000003"))
    assert code == 0 and "optimizer settings differ" not in err


def test_inner_momentum_may_be_turned_on_at_a_resume(tmp_path, capsys, finished):
    # K is an optimizer setting (no privacy cost): the history starts empty at the checkpoint
    out = tmp_path / "branch"
    code, _ = train(capsys, out, "--resume", str(finished / "checkpoints" / "step-00000002"),
                    "optim.inner_momentum.k_muon=2")
    assert code == 0
    assert json.loads((out / "summary.json").read_text())["steps"] == 4


def test_turning_inner_momentum_filter_and_ema_off_at_a_resume_says_what_is_left(tmp_path,
                                                                                capsys):
    on = ["optim.inner_momentum.k_muon=2", "optim.filter.name=doppler", "optim.ema_decay=0.9"]
    first = tmp_path / "on"
    assert train(capsys, first, "train.checkpoint_every=2", *on)[0] == 0
    code, err = train(capsys, tmp_path / "off", "--resume",
                      str(first / "checkpoints" / "step-00000002"))
    assert code == 0
    line = [x for x in err.splitlines() if "not used by this run" in x]
    assert len(line) == 1
    assert all(w in line[0] for w in ("2 past states", "filter state", "parameter EMA"))
    code, err = train(capsys, tmp_path / "still-on", "--resume",
                      str(first / "checkpoints" / "step-00000002"), *on)
    assert code == 0 and "not used" not in err


def test_a_filter_may_be_turned_on_at_a_resume_but_not_swapped(tmp_path, capsys, finished):
    start = str(finished / "checkpoints" / "step-00000003")
    assert train(capsys, tmp_path / "on", "--resume", start, "optim.filter.name=doppler")[0] == 0
    first = tmp_path / "disk"
    assert train(capsys, first, "optim.filter.name=disk", "train.checkpoint_every=2")[0] == 0
    code, err = train(capsys, tmp_path / "swap", "--resume",
                      str(first / "checkpoints" / "step-00000002"), "optim.filter.name=doppler")
    line = one_line(err)
    assert code == 2 and line.endswith("optim.filter.name: doppler here, disk in the checkpoint: "
                                       "a resumed run keeps its filter (turning one on or off is "
                                       "allowed)"), line
    assert not (tmp_path / "swap").exists() or not any((tmp_path / "swap").iterdir())


def _crash_at(monkeypatch, step: int):
    """Make the run die (as a preempted node would) just before release ``step``."""
    real = trainer_mod.Trainer.private_step

    def private_step(self):
        if self.step + 1 == step:
            raise KeyboardInterrupt("preempted")
        return real(self)

    monkeypatch.setattr(trainer_mod.Trainer, "private_step", private_step)


def test_ctrl_c_names_the_checkpoint_that_resume_auto_continues_from(tmp_path, capsys,
                                                                     monkeypatch):
    # it said "dptrain train: interrupted" alone, where SIGTERM's stop names its checkpoint
    out = tmp_path / "run"
    _crash_at(monkeypatch, 4)
    code, err = train(capsys, out, "train.checkpoint_every=2")
    step2 = out / "checkpoints" / "step-00000002"
    assert code == 130 and err.strip().splitlines()[-1] == (
        f"dptrain train: interrupted; the last complete checkpoint is {step2} (step 2): "
        f"continue from it with --resume auto")
    code, err = train(capsys, tmp_path / "none", "train.checkpoint_every=0")
    assert code == 130 and err.strip().splitlines()[-1] == (
        f"dptrain train: interrupted; no complete checkpoint in {tmp_path / 'none'}/checkpoints: "
        f"--resume auto would start afresh, from step 0")
    # a branch that wrote no checkpoint of its own: its --resume PATH again
    code, err = train(capsys, tmp_path / "branch", "train.checkpoint_every=0", "--resume",
                      str(step2))
    assert code == 130 and err.strip().splitlines()[-1].endswith(
        f"yet: start again from {step2} with --resume {step2}")


@pytest.mark.parametrize("secure,every", [(False, 2), (True, 2), (False, 0), (True, 0)])
def test_secure_mode_writes_metrics_only_with_checkpoints(tmp_path, capsys, monkeypatch, secure,
                                                          every):
    out = tmp_path / "run"
    extra = (*SECURE, f"train.checkpoint_every={every}") if secure else (
        f"train.checkpoint_every={every}",)
    _crash_at(monkeypatch, 4)
    code = main(["train", "--config", TINY, "--output-dir", str(out), *extra])
    assert code == 130 and "interrupted" in capsys.readouterr().err
    logged = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    # release 3 was made, but only secure mode keeps its row back until a checkpoint covers it;
    # without checkpoints it keeps every row back until the end, so that the restart from
    # step 0 below draws no release whose test metrics were written
    assert logged == ([1, 2] if secure and every else [] if secure else [1, 2, 3])
    # what an interrupted run keeps: its complete checkpoints, no summary and no final model
    assert ckpt.complete_steps(out) == ([2] if every else [])
    assert not (out / "summary.json").exists() and not (out / "final").exists()
    monkeypatch.undo()
    code, _ = train(capsys, out, "--resume", "auto", *extra)
    assert code == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    # the noiseless training loss of the private batch: not written when the run is for release
    assert all(("train_loss" in r) != secure for r in rows)
    # nor the elapsed time and peak memory at each row, which follow the realised batches
    assert all(("time" in r) != secure for r in rows)
    assert all(("peak_memory_gib" in r) != secure for r in rows)
    peak = json.loads((out / "summary.json").read_text())["peak_memory_gib"]
    # the summary's peak is the highest of the resumed process's rows (3 and 4, and 1 and 2
    # too where it restarted from step 0)
    assert peak is None if secure else (
        peak in {r["peak_memory_gib"] for r in rows}
        and peak >= max(r["peak_memory_gib"] for r in rows[2:]))


@pytest.mark.parametrize("secure", [True, False])
def test_rows_a_kill_after_a_checkpoint_s_seal_lost_are_written_at_its_resume(
        tmp_path, capsys, monkeypatch, secure):
    # secure mode holds its rows until a checkpoint covers them and writes them after its seal:
    # a kill in between lost rows 1 and 2 for good (the resume starts at 3); the checkpoint
    # carries them now
    out = tmp_path / "run"
    extra = (*SECURE, "train.checkpoint_every=2") if secure else ("train.checkpoint_every=2",)
    real = ckpt.save

    def save_then_die(trainer, output_dir):
        real(trainer, output_dir)
        raise KeyboardInterrupt("killed after the seal")

    monkeypatch.setattr(ckpt, "save", save_then_die)
    assert main(["train", "--config", TINY, "--output-dir", str(out), *extra]) == 130
    logged = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert logged == ([] if secure else [1, 2]) and ckpt.complete_steps(out) == [2]
    monkeypatch.undo()
    code, err = train(capsys, out, "--resume", "auto", *extra)
    assert code == 0 and ("wrote 2 metrics row(s) of the checkpoint" in err) == secure, err
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    # a branch of that checkpoint into another directory starts its rows afresh
    other = tmp_path / "branch"
    if not secure:  # (secure mode refuses a branch: test_a_secure_checkpoint_is_resumed_...)
        code, _ = train(capsys, other, "--resume", str(out / "checkpoints" / "step-00000002"),
                        *extra)
        rows = [json.loads(x) for x in (other / "metrics.jsonl").read_text().splitlines()]
        assert code == 0 and [r["step"] for r in rows] == [3, 4]


def test_secure_resume_from_a_checkpoint_with_later_outputs_is_refused(tmp_path, capsys):
    out = tmp_path / "run"
    code, _ = train(capsys, out, "train.checkpoint_every=1", "train.keep_checkpoints=4",
                    "privacy.steps=3", *SECURE)
    assert code == 0
    code, err = train(capsys, tmp_path / "branch", "--resume",
                      str(out / "checkpoints" / "step-00000001"), "privacy.steps=3", *SECURE)
    line = one_line(err)
    assert code == 2 and "secure mode" in line and "step 3" in line
    assert not (tmp_path / "branch").exists()



@pytest.mark.parametrize("later", ["checkpoint", "metrics"])
def test_secure_resume_refuses_an_output_of_the_very_next_release(tmp_path, later):
    # the release right after the checkpoint (step 3 after step 2): a checkpoint of it whose
    # rows a kill after its seal lost, or its row alone; tests of outputs two or more steps
    # later let "after step + 1" through
    from dptrain.commands.train import _check_secure_resume
    from dptrain.config import ConfigError

    checkpoints = tmp_path / "run" / "checkpoints"
    (checkpoints / "step-00000002").mkdir(parents=True)
    rows = [{"step": 1}, {"step": 2}]
    if later == "checkpoint":
        (checkpoints / "step-00000003").mkdir()
    else:
        rows.append({"step": 3})
    (tmp_path / "run" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ConfigError, match=rf"after step 2 \({later}\D* 3\)"):
        _check_secure_resume(checkpoints / "step-00000002")
    shutil.rmtree(checkpoints / "step-00000003", ignore_errors=True)
    (tmp_path / "run" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n"
                                                            for r in rows[:2]))
    _check_secure_resume(checkpoints / "step-00000002")  # nothing after step 2: resumable


def test_secure_resume_of_a_renamed_copy_goes_by_its_marker_s_step(tmp_path):
    # a copy in checkpoints/ under another name (never resumed by --resume auto) is the
    # checkpoint its marker names: the releases after that step were written, not "no step"
    from dptrain.commands.train import _check_secure_resume
    from dptrain.config import ConfigError

    checkpoints = tmp_path / "run" / "checkpoints"
    (checkpoints / "mine").mkdir(parents=True)
    (checkpoints / "mine" / ckpt.MARKER).write_text(json.dumps({"step": 2}))
    (checkpoints / "step-00000003").mkdir()
    with pytest.raises(ConfigError, match=r"after step 2 \(checkpoint step 3\)"):
        _check_secure_resume(checkpoints / "mine")


def _flip_a_byte(path: Path) -> None:
    """Bit rot: the same size, other contents (a shallow check by sizes passes)."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["flipped byte", "lost marker"])
@pytest.mark.parametrize("secure", [False, True])
def test_secure_resume_auto_does_not_fall_back_past_written_outputs(tmp_path, capsys, monkeypatch,
                                                                    secure, damage):
    # the newest checkpoint (step 4) is damaged, so --resume auto falls back to step 2; in
    # secure mode that would draw releases 3 and 4 again although their checkpoint and
    # metrics rows were written. A checkpoint whose marker was lost was written too (it is
    # renamed into place after its marker): alone, without its metrics rows, it refuses
    out = tmp_path / "run"
    extra = ("train.checkpoint_every=2", "train.keep_checkpoints=3", "privacy.steps=6",
             *(SECURE if secure else ()))
    _crash_at(monkeypatch, 5)
    code = main(["train", "--config", TINY, "--output-dir", str(out), *extra])
    assert code == 130 and "interrupted" in capsys.readouterr().err
    monkeypatch.undo()
    if damage == "flipped byte":
        _flip_a_byte(out / "checkpoints" / "step-00000004" / "state.pt")
    else:
        (out / "checkpoints" / "step-00000004" / "COMPLETE").unlink()
        rows = (out / "metrics.jsonl").read_text().splitlines()
        (out / "metrics.jsonl").write_text("".join(
            row + "\n" for row in rows if json.loads(row)["step"] <= 2))
    before = snapshot(out)
    code, err = train(capsys, out, "--resume", "auto", *extra)
    if not secure:  # seeded: steps 3 and 4 are drawn exactly as before
        assert code == 0 and "resumed from" in err and "step-00000002" in err
        return
    lines = [x for x in err.strip().splitlines() if not x.startswith("dptrain: skipping damaged")]
    line = one_line("\n".join(lines))
    assert code == 2 and "resume" in line and "secure mode" in line and "step 2" in line
    assert "checkpoint step 4" in line and "damaged" in line
    assert snapshot(out) == before


@pytest.mark.parametrize("step", [4.0, "4", None])
def test_secure_resume_over_a_row_without_an_integer_step_is_refused(tmp_path, capsys, step):
    # such a row was once read as step int(step) (None: a TypeError), then skipped, which let
    # a secure resume draw the releases it may stand for again: it counts as after every step
    out = tmp_path / "run"
    code, _ = train(capsys, out, "train.checkpoint_every=1", "privacy.steps=2", *SECURE)
    assert code == 0
    unfinished_copy(out, tmp_path / "copy")
    with open(tmp_path / "copy" / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": step}) + "\n")
    before = snapshot(tmp_path / "copy")
    code, err = train(capsys, tmp_path / "copy", "--resume", "auto", "train.checkpoint_every=1",
                      "privacy.steps=2", *SECURE)
    line = one_line(err)
    assert code == 2 and "a metrics row without an integer step" in line
    assert snapshot(tmp_path / "copy") == before


def test_secure_restart_from_no_checkpoint_over_logged_releases_is_refused(tmp_path, capsys):
    # rows of releases without any checkpoint (written by a version before rows were held
    # back): a restart from step 0 would draw those releases again
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text(json.dumps({"step": 1, "test_nll": 3.0}) + "\n")
    before = snapshot(out)
    code, err = train(capsys, out, "--resume", "auto", *SECURE)
    line = one_line(err)
    assert code == 2 and "resume" in line and "metrics of step 1" in line
    assert "starting afresh" in line and "cannot be continued" in line
    assert snapshot(out) == before


def test_a_secure_checkpoint_is_resumed_into_one_directory_only(tmp_path, capsys, monkeypatch):
    # run A dies before release 3; its checkpoint of step 2 may be continued once: branching
    # it into B and then into C (or continuing A itself) would draw releases 3.. twice
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    extra = ("train.checkpoint_every=2", "privacy.steps=4", *SECURE)
    _crash_at(monkeypatch, 3)
    code = main(["train", "--config", TINY, "--output-dir", str(a), *extra])
    assert code == 130 and "interrupted" in capsys.readouterr().err
    step2 = str(a / "checkpoints" / "step-00000002")
    # the branch into B dies before its first checkpoint (its rows held back): B may take it
    # up again, and the record is not repeated
    code = main(["train", "--config", TINY, "--output-dir", str(b), "--resume", step2, *extra])
    assert code == 130 and "interrupted" in capsys.readouterr().err
    monkeypatch.undo()
    code, err = train(capsys, b, "--resume", step2, *extra)
    assert code == 0 and (b / "summary.json").exists(), err
    claims = [json.loads(x) for x in (a / "secure_resumes.jsonl").read_text().splitlines()]
    assert [(r["step"], r["into"]) for r in claims] == [(2, str(b.resolve()))]
    before = snapshot(a)
    code, err = train(capsys, c, "--resume", step2, *extra)
    line = one_line(err)
    assert code == 2 and "resume" in line and "secure mode" in line and str(b.resolve()) in line
    assert not c.exists()
    code, err = train(capsys, a, "--resume", "auto", *extra)
    assert code == 2 and str(b.resolve()) in one_line(err)
    assert snapshot(a) == before


def test_a_secure_resume_the_checkpoint_refuses_records_no_branch(tmp_path, capsys,
                                                                  monkeypatch):
    # the branch was recorded before the checkpoint was loaded: a load that refused (here, a
    # ledger the run cannot have written) left a record that refused every later branch
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    extra = ("train.checkpoint_every=2", "privacy.steps=4", *SECURE)
    _crash_at(monkeypatch, 3)
    assert main(["train", "--config", TINY, "--output-dir", str(a), *extra]) == 130
    capsys.readouterr()
    monkeypatch.undo()
    step2 = a / "checkpoints" / "step-00000002"
    shutil.copytree(step2, tmp_path / "kept")
    forged(a, lambda s: _history(s, lambda e: [e[0] * 100, e[1], e[2]]))
    code, err = train(capsys, b, "--resume", str(step2), *extra)
    assert code == 2 and "which this run's privacy settings cannot give" in one_line(err)
    assert not (a / "secure_resumes.jsonl").exists()
    shutil.rmtree(step2)
    shutil.copytree(tmp_path / "kept", step2)  # the checkpoint as it was written
    code, err = train(capsys, c, "--resume", str(step2), *extra)
    assert code == 0, err
    claims = [json.loads(x) for x in (a / "secure_resumes.jsonl").read_text().splitlines()]
    assert [(r["step"], r["into"]) for r in claims] == [(2, str(c.resolve()))]


def test_two_secure_branches_started_at_once_record_one(tmp_path):
    # both passed the first look before either recorded itself: both trained, and the step
    # after the checkpoint was released twice. The record checks again under a lock.
    from dptrain.commands.train import _record_secure_resume
    from dptrain.config import ConfigError

    step = tmp_path / "a" / "checkpoints" / "step-00000002"
    step.mkdir(parents=True)
    b, c = tmp_path / "b", tmp_path / "c"
    _record_secure_resume(step, b, write=True)
    _record_secure_resume(step, b, write=True)  # (the same branch again: one row)
    with pytest.raises(ConfigError, match=r"resume: secure mode: a checkpoint of .* was "
                                          r"already resumed into .*b"):
        _record_secure_resume(step, c, write=True)
    rows = (tmp_path / "a" / "secure_resumes.jsonl").read_text().splitlines()
    assert [json.loads(r)["into"] for r in rows] == [str(b.resolve())]


def _record_on_ranks(rank: int, world: int, step: str, into: str) -> str:
    from dptrain.commands.train import _record_secure_resume
    from dptrain.config import ConfigError

    try:
        _record_secure_resume(Path(step), Path(into), write=rank == 0)
    except ConfigError as e:
        return str(e)
    return "recorded"


def test_a_branch_rank_0_finds_taken_is_refused_on_every_rank(tmp_path):
    # rank 0 checks under the lock: the other ranks must not go on into the releases alone
    from dptrain.parallel.dist import spawn

    step = tmp_path / "a" / "checkpoints" / "step-00000002"
    step.mkdir(parents=True)
    assert spawn(_record_on_ranks, 2, str(step), str(tmp_path / "b")) == ["recorded"] * 2
    got = spawn(_record_on_ranks, 2, str(step), str(tmp_path / "c"))
    assert got[0] == got[1] and "already resumed into" in got[0]


def test_a_secure_run_on_shards_needs_the_class_count_given():
    # inferred, it is the shards' largest label + 1: the model's head would publish it
    from dptrain.config import ConfigError, from_dict, validate_tree
    from dptrain.trainer import RunConfig

    tree = {"privacy": {"secure_mode": True, "seed": None},
            "data": {"name": "webdataset", "path": "shards"}, "model": {"name": "cnn"},
            "optim": {"preset": None, "name": "sgd"}}
    with pytest.raises(ConfigError) as e:
        validate_tree(from_dict(RunConfig, tree))
    assert e.value.field == "data.num_classes" and "secure mode" in e.value.message
    tree["data"]["num_classes"] = 1000
    validate_tree(from_dict(RunConfig, tree))
    tree["data"]["num_classes"], tree["privacy"] = None, {}
    validate_tree(from_dict(RunConfig, tree))  # (outside secure mode: inferred, with a note)


def test_a_branched_secure_checkpoint_is_refused_when_only_the_checksummed_look_finds_it(
        tmp_path, capsys, monkeypatch):
    # a rank whose first look (no process group yet) saw no checkpoint, as with a lagging
    # shared file system, skipped the branch check; the checksummed look then found one
    from dptrain import checkpoint as ckpt

    a, b = tmp_path / "a", tmp_path / "b"
    extra = ("train.checkpoint_every=2", "privacy.steps=4", *SECURE)
    _crash_at(monkeypatch, 3)
    assert main(["train", "--config", TINY, "--output-dir", str(a), *extra]) == 130
    step2 = str(a / "checkpoints" / "step-00000002")
    assert main(["train", "--config", TINY, "--output-dir", str(b), "--resume", step2,
                 *extra]) == 130  # the branch into B is recorded
    monkeypatch.undo()
    capsys.readouterr()
    real = ckpt.find_latest
    monkeypatch.setattr(ckpt, "find_latest",
                        lambda out, **kw: None if kw.get("shallow") else real(out, **kw))
    before = snapshot(a)
    code, err = train(capsys, a, "--resume", "auto", *extra)
    assert code == 2 and str(b.resolve()) in one_line(err)
    assert snapshot(a) == before


def test_overrides_before_and_after_options_all_apply(tmp_path, capsys):
    out = tmp_path / "run"
    code = main(["train", "privacy.steps=1", "--config", TINY, "--output-dir", str(out),
                 "train.checkpoint_every=0"])
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 1 and summary["config"]["train"]["checkpoint_every"] == 0
    with pytest.raises(SystemExit) as e:
        main(["train", "--config", TINY, "--output-dir", str(tmp_path / "x"), "--bogus"])
    assert e.value.code == 2 and "--bogus" in capsys.readouterr().err


def _e2e_rows(n: int) -> str:
    return "mr,ref\n" + "".join(f'"name[R{i}], food[F{i % 3}]","R{i} serves F{i % 3}."\n'
                                for i in range(n))


def test_a_resume_over_changed_data_files_is_refused(tmp_path, capsys):
    # same config, but rows were added to the training CSV since the checkpoint: Poisson
    # sampling, b and the calibration were for the old N
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.csv").write_text(_e2e_rows(40))
    (data / "test.csv").write_text(_e2e_rows(5))
    args = ["data.name=e2e", "data.tokenizer=bytes", f"data.path={data}", "model.n_positions=64",
            "data.train_file=train.csv", "data.test_file=test.csv", "data.max_length=64",
            "privacy.steps=3", "train.checkpoint_every=1", "train.keep_checkpoints=3"]
    out = tmp_path / "run"
    assert train(capsys, out, *args)[0] == 0
    (out / "summary.json").unlink()
    (data / "train.csv").write_text(_e2e_rows(60))
    before = snapshot(out)
    code, err = train(capsys, out, "--resume", "auto", *args)
    line = one_line(err)
    assert code == 2 and "data" in line and "60" in line and "40" in line
    assert snapshot(out) == before


def test_a_resume_from_moved_data_files_continues_and_says_so(tmp_path, capsys):
    # the same files copied elsewhere (node-local scratch of a new job) and another test split:
    # allowed, named on stderr, and the run ends where the uninterrupted one did
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.csv").write_text(_e2e_rows(40))
    (data / "test.csv").write_text(_e2e_rows(5))
    common = ["data.name=e2e", "data.tokenizer=bytes", "model.n_positions=64",
              "data.train_file=train.csv", "data.test_file=test.csv", "data.max_length=64",
              "privacy.steps=3", "train.checkpoint_every=1", "train.keep_checkpoints=3"]
    out = tmp_path / "run"
    assert train(capsys, out, f"data.path={data}", *common)[0] == 0
    whole = (out / "final" / "model.safetensors").read_bytes()
    # back to step 2, as if the job had been preempted after it
    (out / "summary.json").unlink()
    shutil.rmtree(out / "final")
    latest = max((out / "checkpoints").iterdir())
    shutil.rmtree(latest)
    moved = tmp_path / "scratch"
    shutil.copytree(data, moved)
    shutil.rmtree(data)
    code, err = train(capsys, out, "--resume", "auto", f"data.path={moved}", *common,
                      "data.max_test_examples=3")
    assert code == 0, err
    assert "data.path" in err and "data.max_test_examples" in err and str(moved) in err
    assert (out / "final" / "model.safetensors").read_bytes() == whole
    # the training file itself is still the training set's identity: another one is refused
    (moved / "other.csv").write_text(_e2e_rows(40))
    (out / "summary.json").unlink()
    code, err = train(capsys, out, "--resume", "auto", f"data.path={moved}", *common,
                      "data.train_file=other.csv")
    assert code == 2 and "data.train_file" in one_line(err)


def _start_on_each_rank(rank: int, world: int, overrides: list):
    """A Trainer built with this rank's override(s): None, or its ConfigError's line."""
    from dptrain.config import ConfigError, load
    from dptrain.trainer import RunConfig, Trainer

    mine = overrides[rank] if isinstance(overrides[rank], list) else [overrides[rank]]
    try:
        Trainer(load(RunConfig, TINY, ["train.progress=false", "train.checkpoint_every=0",
                                       *mine]))
        return None
    except ConfigError as e:
        return str(e)


def _train_on_each_rank(rank: int, world: int, per_rank: list) -> tuple[int, list[str]]:
    """``dptrain train`` with this rank's arguments: (exit status, its stderr's error lines)."""
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["train", "--config", TINY, "train.progress=false", *per_rank[rank]])
    return code, [line for line in err.getvalue().splitlines() if "error:" in line]


def _said_by_rank_0(got: list[tuple[int, list[str]]]) -> str:
    """A refusal every rank shares: exit 2 everywhere, one line, on rank 0 only (not once per
    rank); that line."""
    assert [code for code, _ in got] == [2] * len(got), got
    assert len(got[0][1]) == 1 and not any(lines for _, lines in got[1:]), got
    return got[0][1][0]


@pytest.mark.parametrize("differ", ["resume", "output-dir", "dry-run"])
def test_ranks_that_start_another_run_are_refused_on_every_rank(tmp_path, differ):
    from dptrain.parallel.dist import spawn

    # one node's launcher line with --resume auto, the other's without: rank 0 would load a
    # checkpoint (its collectives) while rank 1 starts afresh; other --resume paths would put
    # the ranks at different steps (an example in two shares of a release)
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    per_rank = {"resume": [["--output-dir", a, "--resume", "auto"], ["--output-dir", a]],
                "output-dir": [["--output-dir", a], ["--output-dir", b]],
                "dry-run": [["--output-dir", a], ["--output-dir", a, "--dry-run"]]}[differ]
    got = spawn(_train_on_each_rank, 2, per_rank, timeout=240)
    assert f"error: {differ}: rank 1 starts with" in _said_by_rank_0(got)
    assert not (tmp_path / "a" / "checkpoints").exists() and not (tmp_path / "b").exists()


@pytest.mark.parametrize("change", ["privacy.clip_norm=2", "seed=1"])
def test_a_resume_with_changed_privacy_settings_is_said_once_on_ranks(tmp_path, finished,
                                                                        change):
    # every rank compares the same config with the same checkpoint: one line, by rank 0
    # (each rank printed it before)
    from dptrain.parallel.dist import spawn

    step = str(finished / "checkpoints" / "step-00000003")
    args = ["--output-dir", str(tmp_path / "b"), "--resume", step, change]
    got = spawn(_train_on_each_rank, 2, [args, args], timeout=240)
    assert f"error: {change.split('=')[0]}: differs from the checkpoint" in _said_by_rank_0(got)
    assert not (tmp_path / "b" / "checkpoints").exists()


def _train_from(rank: int, world: int, cwds: list[str], args: list[str]):
    """``dptrain train --output-dir run`` from this rank's working directory (a node's own
    folder under one relative path): (exit status, its stderr's error lines)."""
    import os

    os.chdir(cwds[rank])
    return _train_on_each_rank(0, 1, [["--output-dir", "run", *args]])


@pytest.mark.parametrize("sharding", ["fsdp", "none"])
def test_a_sharded_run_whose_ranks_see_other_directories_is_refused(tmp_path, sharding):
    # the same relative --output-dir from each node's own folder (or a node-local path): with
    # FSDP every rank writes its shards there, and the run failed at its first checkpoint
    # with a traceback (FileNotFoundError on rank 0, "rank 0 could not write" on rank 1): now
    # one line naming output-dir, exit 2 on every rank, no checkpoint sealed. A replicated
    # run has only rank 0 write, and trains. (Not checked at the start: on NFS, another node
    # may not see a file rank 0 has just written, which would refuse shared directories.)
    from dptrain.parallel.dist import spawn

    nodes = [tmp_path / "n0", tmp_path / "n1"]
    for n in nodes:
        n.mkdir()
    got = spawn(_train_from, 2, [str(n) for n in nodes],
                [f"performance.sharding={sharding}", "privacy.steps=2",
                 "train.checkpoint_every=1"], timeout=240)
    if sharding == "none":
        assert [code for code, _ in got] == [0, 0], got
        assert (nodes[0] / "run" / "summary.json").exists()
        return
    line = _said_by_rank_0(got)
    assert "error: output-dir: rank 1's shard __1_0.distcp of the checkpoint is not in " in line
    assert "one directory that every node shares" in line
    assert not list((nodes[0] / "run" / "checkpoints").glob("step-*"))


@pytest.mark.parametrize("case", ["finished on rank 0 only", "unfinished on rank 1 only",
                                  "a link to nothing on rank 1 only"])
def test_ranks_that_see_another_directory_are_refused_on_every_rank(tmp_path, capsys, case):
    # the ranks meet before the output directory's checks; one rank done or refused alone
    # left the other in the trainer's collectives (a gloo traceback; NCCL: a hang)
    from dptrain.parallel.dist import spawn

    run = tmp_path / "finished" / "run"
    assert train(capsys, run, "privacy.steps=2", "train.checkpoint_every=1")[0] == 0
    nodes = [tmp_path / "n0", tmp_path / "n1"]
    for n in nodes:
        n.mkdir()
    if case == "finished on rank 0 only":
        shutil.copytree(run, nodes[0] / "run")
        shutil.copytree(run, nodes[1] / "run", ignore=shutil.ignore_patterns("summary.json"))
        args, words = ["--resume", "auto"], "rank 0 sees a finished run in run (summary.json), " \
                                             "rank 1 does not"
    elif case == "a link to nothing on rank 1 only":  # (checked before the lock is taken)
        (nodes[1] / "run").symlink_to(tmp_path / "nowhere")
        args, words = [], "run is a symbolic link to nothing"
    else:
        shutil.copytree(run, nodes[1] / "run", ignore=shutil.ignore_patterns("summary.json"))
        args, words = [], "run holds an unfinished run"
    got = spawn(_train_from, 2, [str(n) for n in nodes], [*args, "privacy.steps=2"],
                timeout=240)
    line = _said_by_rank_0(got)
    assert "error: output-dir: " in line and words in line, line
    if case != "finished on rank 0 only":  # (rank 1's refusal, said by rank 0)
        assert line.endswith("(on rank 1)") and not (nodes[0] / "run").exists()


def test_ranks_refused_for_different_reasons_each_say_theirs(tmp_path):
    # rank 1's own refusal was silenced behind rank 0's: fixed, the run met it only next time
    from dptrain.parallel.dist import spawn

    nodes = [tmp_path / "n0", tmp_path / "n1"]
    for n in nodes:
        n.mkdir()
    (nodes[0] / "run").write_text("a file")
    (nodes[1] / "run").mkdir()
    (nodes[1] / "run" / "checkpoints").write_text("a file")
    got = spawn(_train_from, 2, [str(n) for n in nodes], [], timeout=240)
    assert [code for code, _ in got] == [2, 2], got
    assert len(got[0][1]) == 1 and "run exists and is not a directory" in got[0][1][0]
    assert len(got[1][1]) == 1 and "checkpoints exists and is not a directory" in got[1][1][0]


def test_a_shared_refusal_is_said_by_rank_0_however_its_rank_is_spelt(monkeypatch, capsys):
    # RANK=00 is rank 0 to the launcher's reading (int), and was not to the CLI's: no rank
    # printed the refusal (red team)
    import dptrain.commands.train as train_command
    from dptrain.config import ConfigError, said_by_rank_0

    def refuse(args):
        raise said_by_rank_0(ConfigError("output-dir", "shared refusal"))

    monkeypatch.setattr(train_command, "run", refuse)
    for rank, said in (("00", True), ("+0", True), (" 0", True), ("1", False), ("x", True)):
        monkeypatch.setenv("RANK", rank)
        assert main(["train", "--config", TINY]) == 2
        assert ("error: output-dir: shared refusal" in capsys.readouterr().err) == said, rank


def _resume_on_each_rank(rank: int, world: int, paths: list[str]) -> str | None:
    """A Trainer that resumes ``paths[rank]``: None, or its ConfigError's line."""
    from dptrain.config import ConfigError, load
    from dptrain.trainer import RunConfig, Trainer

    t = Trainer(load(RunConfig, TINY, ["train.progress=false"]))
    try:
        ckpt.load(t, Path(paths[rank]))
        return None
    except ConfigError as e:
        return str(e)


def test_ranks_that_resume_other_checkpoints_are_refused_on_every_rank(tmp_path, capsys):
    from dptrain.parallel.dist import spawn

    # one path, two node-local copies of it at other steps: the ranks agree on --resume, and
    # each took its share of another step's sample (red team: rank 0 at step 3, rank 1 at 2)
    out = tmp_path / "run"
    code, err = train(capsys, out, "train.checkpoint_every=1", "train.keep_checkpoints=2")
    assert code == 0, err
    older, newer = (str(out / "checkpoints" / f"step-0000000{s}") for s in (3, 4))
    got = spawn(_resume_on_each_rank, 2, [newer, older], timeout=240)
    assert all(e is not None and e.startswith(f"resume: rank 1 resumes {older} at step 3, "
                                              f"rank 0 {newer} at step 4") for e in got), got
    assert spawn(_resume_on_each_rank, 2, [older, older], timeout=240) == [None, None]
    # one step, other contents (another run's copy, at another learning rate): the replicas
    # trained apart, each from its own node's weights, exit 0 (red team)
    other = tmp_path / "other"
    code, err = train(capsys, other, "train.checkpoint_every=1", "optim.lr=0.05")
    assert code == 0, err
    elsewhere = str(other / "checkpoints" / "step-00000004")
    got = spawn(_resume_on_each_rank, 2, [newer, elsewhere], timeout=240)
    assert all(e is not None and "at step 4 with other contents" in e for e in got), got


def _node_local_e2e(tmp_path, rows: dict[str, list[int]],
                    test_rows: dict[str, int] | None = None) -> dict[str, list[str]]:
    """For each name, an E2E folder holding the devset rows ``rows[name]`` and the first
    ``test_rows[name]`` (default 5) test rows (a node's local copy: data.path may differ
    between ranks), and the overrides that train on it."""
    lines = (E2E_DIR / "devset.csv").read_text(encoding="utf-8").splitlines()
    all_test = (E2E_DIR / "testset_w_refs.csv").read_text(encoding="utf-8").splitlines()
    out = {}
    for name, keep in rows.items():
        test = all_test[:1 + (test_rows or {}).get(name, 5)]
        d = tmp_path / name
        d.mkdir()
        (d / "devset.csv").write_text("\n".join([lines[0], *(lines[1 + i] for i in keep)]) + "\n",
                                      encoding="utf-8")
        (d / "testset_w_refs.csv").write_text("\n".join(test) + "\n", encoding="utf-8")
        out[name] = ["data.name=e2e", "data.tokenizer=bytes", f"data.path={d}",
                     "data.max_length=200", "model.n_positions=256", "privacy.sample_rate=0.1"]
    return out


@needs_e2e
def test_ranks_that_see_different_training_set_sizes_refuse_to_start(tmp_path):
    from dptrain.parallel.dist import spawn

    # node-local copies of 21 and 20 examples (one configuration, data.path differs):
    # sharding S_t by position would process some examples on both ranks (sensitivity 2C) and
    # drop others
    copies = _node_local_e2e(tmp_path, {"a": list(range(21)), "b": list(range(20))})
    errors = spawn(_start_on_each_rank, 2, [copies["a"], copies["b"]])
    assert all(e is not None and e.startswith("data:") and "20" in e and "21" in e
               for e in errors), errors
    assert spawn(_start_on_each_rank, 2, [copies["a"], copies["a"]]) == [None, None]


@needs_e2e
def test_ranks_that_see_the_same_number_of_other_examples_refuse_to_start(tmp_path):
    from dptrain.parallel.dist import spawn

    # node-local copies that differ with the same N: index i would be one example on rank 0
    # and another on rank 1, so an example could be in both ranks' shares; only N was compared
    copies = _node_local_e2e(tmp_path, {"a": list(range(20)), "b": list(range(1, 21))})
    errors = spawn(_start_on_each_rank, 2, [copies["a"], copies["b"]])
    assert all(e is not None and e.startswith("data:") and "index digests differ" in e
               for e in errors), errors


@needs_e2e
def test_ranks_that_see_other_test_sets_refuse_to_start(tmp_path):
    from dptrain.parallel.dist import spawn

    # the same training copy, test copies of 5 and 4 rows: under FSDP the final evaluation's
    # forwards crashed in a collective, after the whole budget was spent (command audit)
    copies = _node_local_e2e(tmp_path, {"a": list(range(20)), "b": list(range(20))},
                             {"a": 5, "b": 4})
    errors = spawn(_start_on_each_rank, 2, [copies["a"], copies["b"]])
    assert all(e is not None and e.startswith("data: the ranks see test sets of different "
                                              "sizes") for e in errors), errors


def _node_local_shards(root: Path, per_shard: list[int]) -> str:
    """``root`` holding webdataset shards of these sizes (8x8 images, labels 0 and 1) and one
    of 2 test images: a node's copy; the ``data.path`` override that reads it."""
    import io

    import webdataset as wds
    from PIL import Image

    root.mkdir()
    buf = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buf, format="PNG")
    for name, sizes in (("train", per_shard), ("val", [2])):
        for s, n in enumerate(sizes):
            with wds.TarWriter(str(root / f"imagenet-{name}-{s:06d}.tar")) as w:
                for j in range(n):
                    w.write({"__key__": f"{name}{s}_{j}", "png": buf.getvalue(),
                             "cls": str(j % 2).encode()})
    return f"data.path={root}"


def _images_on_each_rank(rank: int, world: int, per_rank: list) -> tuple[int, list[str]]:
    """``dptrain train --dry-run`` of configs/tiny_images.yaml on webdataset shards with this
    rank's ``data.path`` override into ``out``: (exit status, its stderr's error lines)."""
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["train", "--config", str(ROOT / "configs" / "tiny_images.yaml"),
                     "--dry-run", "--output-dir", per_rank[rank][0], "train.progress=false",
                     "data.name=webdataset", "data.image_size=8", per_rank[rank][1]])
    return code, [line for line in err.getvalue().splitlines() if "error:" in line]


def test_ranks_that_see_other_shards_are_refused_once_naming_each_ranks_size(tmp_path):
    from dptrain.parallel.dist import spawn

    # one node misses a shard: every rank printed its own line ("this rank 4", naming no rank)
    out = str(tmp_path / "run")
    full = out, _node_local_shards(tmp_path / "a", [3, 4])
    short = out, _node_local_shards(tmp_path / "b", [4])
    got = spawn(_images_on_each_rank, 2, [full, short], timeout=240)
    assert _said_by_rank_0(got).endswith(
        "data: the ranks see training sets of different sizes (from 4 to 7 examples; rank 0: "
        "7, rank 1: 4): every rank must read the same data"), got
    swapped = out, _node_local_shards(tmp_path / "c", [4, 3])  # the same 7, another order
    got = spawn(_images_on_each_rank, 2, [full, swapped], timeout=240)
    assert "(their index digests differ, rank 1's from rank 0's" in _said_by_rank_0(got), got
    assert spawn(_images_on_each_rank, 2, [full, full], timeout=240) == [(0, [])] * 2


def test_the_sizes_of_many_ranks_are_cut_to_those_that_differ_from_rank_0():
    from dptrain.trainer import _each_ranks

    assert _each_ranks([7, 4]) == "rank 0: 7, rank 1: 4"
    # 512 ranks, one node short: one line per rank was a 9 KB message naming 511 equal sizes
    assert _each_ranks([7] * 511 + [4]) == "rank 0: 7, other sizes on 1 of 512 ranks: rank 511: 4"
    many = _each_ranks([7] + [4] * 511)
    assert many.endswith("rank 8: 4 and 503 more") and len(many) < 200, many


def test_ranks_with_another_seed_are_refused_by_the_configuration_check():
    from dptrain.parallel.dist import spawn

    # (the top-level seed draws the synthetic data: that was this test's case of other examples
    # with the same N; the ranks' configurations are compared first now)
    errors = spawn(_start_on_each_rank, 2, ["seed=0", "seed=1"])
    assert all(e is not None and e.startswith("seed: rank 1 runs with 1, rank 0 with 0")
               for e in errors), errors
    assert spawn(_start_on_each_rank, 2, ["seed=3"] * 2) == [None, None]


def test_a_fallback_past_damaged_checkpoints_keeps_the_checkpoints_it_writes(tmp_path, capsys,
                                                                            monkeypatch):
    # keep_checkpoints=1: the run's only checkpoint (step 3) is damaged, so --resume auto
    # starts again from step 0; pruning counted the damaged step 3 as the newest and deleted
    # every checkpoint the restarted run wrote, leaving a crash nothing to resume from
    out = tmp_path / "run"
    extra = ("train.checkpoint_every=1", "train.keep_checkpoints=1")
    _crash_at(monkeypatch, 4)
    assert main(["train", "--config", TINY, "--output-dir", str(out), *extra]) != 0
    _flip_a_byte(out / "checkpoints" / "step-00000003" / "state.pt")
    monkeypatch.undo()
    _crash_at(monkeypatch, 3)
    assert main(["train", "--config", TINY, "--output-dir", str(out), "--resume", "auto",
                 *extra]) != 0
    capsys.readouterr()
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000002"]


def test_resume_with_another_seed_is_refused(tmp_path, capsys, finished):
    # the run's seed makes the synthetic training set (same N) and every dropout stream
    code, err = train(capsys, tmp_path / "branch", "--resume",
                      str(finished / "checkpoints" / "step-00000003"), "seed=1")
    line = one_line(err)
    assert code == 2 and line.split("error: ")[1].startswith("seed:") and "checkpoint" in line


def test_secure_resume_path_naming_a_finished_run_advises_no_branch(tmp_path, capsys):
    out = tmp_path / "run"
    assert train(capsys, out, "privacy.steps=2", *SECURE)[0] == 0
    code, err = train(capsys, tmp_path / "new", "--resume", str(out), "privacy.steps=2",
                      *SECURE)
    line = one_line(err)
    assert code == 2 and "of a finished run" in line and "secure mode cannot branch" in line
    assert "step-N" not in line and not (tmp_path / "new").exists()


def test_secure_resume_path_over_later_checkpoints_advises_no_branch(tmp_path, capsys):
    # "resume into another --output-dir" was the advice, which secure mode refuses too (a
    # branch draws the later releases again with fresh noise)
    out = tmp_path / "run"
    code, _ = train(capsys, out, "train.checkpoint_every=1", "train.keep_checkpoints=3",
                    "privacy.steps=3", *SECURE)
    assert code == 0
    unfinished_copy(out, tmp_path / "copy")
    before = snapshot(tmp_path / "copy")
    code, err = train(capsys, tmp_path / "copy", "--resume",
                      str(tmp_path / "copy" / "checkpoints" / "step-00000001"), "privacy.steps=3",
                      *SECURE)
    line = one_line(err)
    assert code == 2 and "step 3" in line and "overwrite" in line
    assert "secure mode" in line and "--resume auto" in line
    assert "another --output-dir" not in line
    assert snapshot(tmp_path / "copy") == before


@pytest.mark.parametrize("named", ["run", "checkpoints"])
def test_resume_path_naming_a_run_directory_says_what_to_pass(tmp_path, capsys, finished,
                                                               named):
    # it was "checkpoint ... is unusable: incomplete (no COMPLETE marker)"
    run = unfinished_copy(finished, tmp_path / "copy")
    path = run if named == "run" else run / "checkpoints"
    before = snapshot(run)
    code, err = train(capsys, run, "--resume", str(path))
    line = one_line(err)
    assert code == 2 and line.split("error: ")[1].startswith("resume:")
    assert f"{path} is a run" in line and f"--resume auto --output-dir {run} " in line
    assert "COMPLETE" not in line
    assert snapshot(run) == before
    # a finished run's: its checkpoints, named, into another directory (--resume auto there
    # only says there is nothing to do)
    code, err = train(capsys, tmp_path / "branch", "--resume", str(finished if named == "run"
                                                                   else finished / "checkpoints"))
    line = one_line(err)
    assert code == 2 and "of a finished run" in line and "--resume auto" not in line
    assert f"--resume {finished / 'checkpoints'}/step-N" in line
    # a directory that is neither still reads as a checkpoint without its marker
    (tmp_path / "empty").mkdir()
    code, err = train(capsys, tmp_path / "other", "--resume", str(tmp_path / "empty"))
    assert code == 2 and "no COMPLETE marker" in one_line(err)


def test_a_renamed_checkpoint_keeps_its_step_for_the_guards(tmp_path, capsys, finished):
    out = tmp_path / "copy"
    shutil.copytree(finished, out)
    (out / "summary.json").unlink()
    best = tmp_path / "best"  # step 2, copied out of its run under another name
    shutil.copytree(out / "checkpoints" / "step-00000002", best)
    before = snapshot(out)
    code, err = train(capsys, out, "--resume", str(best))
    assert code == 2 and "step 4" in one_line(err) and "overwrite" in err
    assert snapshot(out) == before
    # secure mode cannot see the outputs of the run such a copy came from: refused
    code, err = train(capsys, tmp_path / "secure", "--resume", str(best), *SECURE)
    line = one_line(err)
    assert code == 2 and "resume" in line and "checkpoints/" in line


def test_resume_path_of_the_run_s_own_latest_checkpoint_continues_it(tmp_path, capsys, finished):
    # --resume PATH into its own run: allowed when no checkpoint after PATH's step exists;
    # the metrics rows logged after step 2 are dropped and logged again, each step once
    out = tmp_path / "copy"
    unfinished_copy(finished, out)
    for s in (3, 4):
        shutil.rmtree(out / "checkpoints" / f"step-{s:08d}")
    rows_before = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows_before] == [1, 2, 3, 4]
    code, err = train(capsys, out, "--resume", str(out / "checkpoints" / "step-00000002"))
    assert code == 0, err
    assert json.loads((out / "summary.json").read_text())["steps"] == 4
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[:2] == rows_before[:2]  # the rows up to the checkpoint are kept as written


def _secure_finished_run(capsys, out):
    code, err = train(capsys, out, "train.checkpoint_every=2", "train.keep_checkpoints=4",
                      *SECURE)
    assert code == 0, err
    return SECURE


def test_secure_branch_of_a_finished_run_is_refused_even_without_later_files(tmp_path, capsys):
    # summary.json alone is an output of every release (its metrics): a secure branch from an
    # earlier checkpoint would draw releases 3 and 4 again, uncounted, though the later
    # checkpoint and the metrics rows were removed
    src = tmp_path / "src"
    secure = _secure_finished_run(capsys, src)
    shutil.rmtree(src / "checkpoints" / "step-00000004")
    (src / "metrics.jsonl").unlink()
    before = snapshot(src)
    code, err = train(capsys, tmp_path / "branch", "--resume",
                      str(src / "checkpoints" / "step-00000002"), *secure)
    line = one_line(err)
    assert code == 2 and "secure mode" in line and "summary.json" in line
    assert not (tmp_path / "branch").exists() and snapshot(src) == before


def test_secure_resume_of_a_checkpoint_moved_out_of_its_run_is_refused(tmp_path, capsys):
    src = tmp_path / "src"
    secure = _secure_finished_run(capsys, src)
    moved = tmp_path / "elsewhere" / "step-00000002"
    shutil.copytree(src / "checkpoints" / "step-00000002", moved)
    code, err = train(capsys, tmp_path / "branch", "--resume", str(moved), *secure)
    line = one_line(err)
    assert code == 2 and "secure mode" in line and "checkpoints/ directory" in line
    assert not (tmp_path / "branch").exists()
    assert not (tmp_path / "secure_resumes.jsonl").exists()



def test_an_unreadable_line_does_not_hide_the_rows_after_it(tmp_path, capsys):
    # a line cut short (a kill mid-write) is skipped, not the end of the file: the rows after
    # it still count as an earlier run's
    out = tmp_path / "killed"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1, "lo\n' + json.dumps({"step": 2}) + "\n")
    before = snapshot(out)
    code, err = train(capsys, out, "privacy.steps=2")
    assert code == 2 and "output-dir" in one_line(err)
    assert snapshot(out) == before


def test_dry_run_prints_the_plan_and_the_resolved_config_and_writes_nothing(tmp_path, capsys):
    import yaml

    from dptrain.config import load, to_dict
    from dptrain.trainer import RunConfig, Trainer

    out = tmp_path / "run"
    code = main(["train", "--config", TINY, "--output-dir", str(out), "--dry-run",
                 "privacy.epsilon=3"])
    cap = capsys.readouterr()
    assert code == 0, cap.err
    assert not out.exists()
    report = yaml.safe_load(cap.out)
    ref = Trainer(load(RunConfig, TINY, ["privacy.epsilon=3"]))
    assert report["config"] == json.loads(json.dumps(to_dict(ref.cfg)))
    assert report["start"] == "from step 0" and report["output_dir"] == str(out)
    assert report["ranks"] == {"world_size": 1, "sharded": False, "device": "cpu"}
    priv = report["privacy"]
    assert priv["noise_multiplier"] == ref.plan.noise_multiplier
    assert priv["noise_multiplier_calibrated"]
    assert priv["planned_epsilon"] == ref.plan.planned_epsilon <= 3.0
    assert (priv["expected_batch_size"], priv["steps"], priv["train_size"]) == (32, 4, 256)
    total = sum(p.numel() for _, p in ref.named_params)
    assert report["trainable_parameters"] == total
    groups = {g["label"]: g for g in report["groups"]}
    assert groups["matrices"]["optimizer"] == "muon" and groups["others"]["optimizer"] == "adamw"
    assert sum(g["parameters"] for g in report["groups"]) == total


def _dry_run_on_each_rank(rank: int, world: int, args: list[str]) -> tuple[int, str]:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["train", "--config", TINY, "train.progress=false", "--dry-run", *args])
    return code, out.getvalue()


@pytest.mark.parametrize("sharding", ["fsdp", "none"])
def test_a_dry_run_on_ranks_says_how_many_and_whether_the_model_is_sharded(tmp_path, sharding):
    # (a cluster's pre-flight check: what the launch will be; printed once, by rank 0)
    import yaml

    from dptrain.parallel.dist import spawn

    args = ["--output-dir", str(tmp_path / "run"), f"performance.sharding={sharding}"]
    got = spawn(_dry_run_on_each_rank, 2, args, timeout=240)
    assert [code for code, _ in got] == [0, 0] and got[1][1] == ""
    report = yaml.safe_load(got[0][1])
    assert report["ranks"] == {"world_size": 2, "sharded": sharding == "fsdp", "device": "cpu"}
    assert not (tmp_path / "run").exists()


def test_dry_run_makes_the_resume_checks_and_leaves_the_run_as_it_was(finished, tmp_path,
                                                                      capsys):
    import yaml

    out = unfinished_copy(finished, tmp_path / "run")
    with open(out / "metrics.jsonl", "a") as f:  # a row past the checkpoint: a resume drops it
        f.write(json.dumps({"step": 5}) + "\n")
    before = snapshot(out)
    code = main(["train", "--config", TINY, "--output-dir", str(out), "--resume", "auto",
                 "--dry-run"])
    assert code == 0
    start = yaml.safe_load(capsys.readouterr().out)["start"]
    assert start == f"resume from {out / 'checkpoints' / 'step-00000004'} at step 4"
    # a changed privacy setting is refused as the resume itself would refuse it
    code, err = train(capsys, out, "--resume", "auto", "--dry-run", "privacy.clip_norm=2")
    assert code == 2 and "privacy.clip_norm" in one_line(err)
    # and a finished run's directory as a new run's; resumed, a finished run is done
    code, err = train(capsys, finished, "--dry-run")
    assert code == 2 and "already holds a finished run" in one_line(err)
    assert main(["train", "--config", TINY, "--output-dir", str(finished), "--resume", "auto",
                 "--dry-run"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["start"].startswith("finished")
    assert snapshot(out) == before


def test_a_resume_whose_sigma_calibrates_differently_says_so_and_counts_both(
        tmp_path, capsys, monkeypatch, finished):
    # another dptrain or opacus version can calibrate another sigma for the same target
    real = trainer_mod.calibrate
    monkeypatch.setattr(trainer_mod, "calibrate",
                        lambda *a, **k: real(*a, **k)._replace(
                            noise_multiplier=real(*a, **k).noise_multiplier * 1.001))
    saved = json.loads((finished / "summary.json").read_text())
    out = tmp_path / "branch"
    code, err = train(capsys, out, "--resume", str(finished / "checkpoints" / "step-00000002"))
    assert code == 0 and "sigma is calibrated to" in err and repr(saved["noise_multiplier"]) in err
    summary = json.loads((out / "summary.json").read_text())
    sigma = summary["noise_multiplier"]
    assert sigma == pytest.approx(saved["noise_multiplier"] * 1.001, rel=1e-12)
    # the ledger holds 2 releases at each sigma
    from dptrain.privacy.accounting import Ledger, epsilon as ledger_epsilon

    mixed = Ledger([(saved["noise_multiplier"], saved["sample_rate"], 2),
                    (sigma, saved["sample_rate"], 2)])
    assert summary["epsilon"] == pytest.approx(
        ledger_epsilon(mixed, saved["delta"], saved["accountant"]), rel=1e-12)


def test_a_resume_is_refused_when_the_releases_made_and_the_rest_exceed_the_target(
        tmp_path, capsys, monkeypatch):
    # a checkpoint whose sigma is too small under this version's accountant (here: made so
    # by calibrating 0.8x and skipping the plan check): the new sigma alone would fit the
    # target, but not the 2 releases already made plus the 2 left
    real = trainer_mod.calibrate
    monkeypatch.setattr(trainer_mod, "calibrate",
                        lambda *a, **k: real(*a, **k)._replace(
                            noise_multiplier=real(*a, **k).noise_multiplier * 0.8))
    monkeypatch.setattr(trainer_mod, "check_plan", lambda cfg, sigma: 0.0)
    first = tmp_path / "first"
    assert train(capsys, first, "train.checkpoint_every=2")[0] == 0
    monkeypatch.undo()
    (first / "summary.json").unlink()
    shutil.rmtree(first / "final")
    shutil.rmtree(first / "checkpoints" / "step-00000004")
    before = snapshot(first)
    code, err = train(capsys, first, "--resume", "auto")
    line = one_line(err)
    assert code == 2 and line.startswith("dptrain train: error: resume: checkpoint "), line
    assert "another noise multiplier than" in line and "the plan spends" in line
    assert snapshot(first) == before


@pytest.mark.parametrize("filt", [["optim.filter.name=disk"],
                                  ["optim.filter.name=doppler", "optim.filter.a=[-0.5]",
                                   "optim.filter.b=[0.3,0.2]"]], ids=["disk", "doppler"])
@pytest.mark.parametrize("dtypes", [("float32", "float64"), ("float64", "float32")])
def test_a_filter_resumes_under_another_dtype(tmp_path, capsys, filt, dtypes):
    # the filter's saved tensors come back in the checkpoint's dtype; mixing them with the
    # parameters' was a RuntimeError at the first resumed step (lerp_ of float and double)
    first, then = dtypes
    a = tmp_path / "a"
    code, err = train(capsys, a, *filt, "privacy.steps=3", "train.checkpoint_every=1",
                      f"performance.dtype={first}")
    assert code == 0, err
    code, err = train(capsys, tmp_path / "b", "--resume", str(a / "checkpoints" / "step-00000002"),
                      *filt, "privacy.steps=3", f"performance.dtype={then}")
    assert code == 0, err
    from safetensors.torch import load_file

    got, want = (load_file(str(d / "final" / "model.safetensors")) for d in (tmp_path / "b", a))
    assert {str(t.dtype) for t in got.values()} == {f"torch.{then}"}
    # one step in the other precision: the same run up to that precision's rounding
    for k in want:
        torch.testing.assert_close(got[k].double(), want[k].double(), rtol=1e-4, atol=1e-5)


def test_resume_path_into_another_unfinished_run_is_refused(tmp_path, capsys, finished):
    # a seed=1 run killed after step 2; resuming the finished (seed 0) run's step 3 into its
    # directory pruned its step-1 checkpoint and continued its metrics with the other run's
    other = tmp_path / "other"
    code, err = train(capsys, other, "seed=1", "privacy.steps=2", "train.checkpoint_every=1",
                      "train.keep_checkpoints=4")
    assert code == 0, err
    (other / "summary.json").unlink()
    shutil.rmtree(other / "final")
    before = snapshot(other)
    code, err = train(capsys, other, "--resume", str(finished / "checkpoints" / "step-00000003"))
    line = one_line(err)
    assert code == 2 and "output-dir" in line and "holds another run" in line
    assert snapshot(other) == before
    # its own checkpoint resumes into it
    code, err = train(capsys, other, "--resume", str(other / "checkpoints" / "step-00000002"),
                      "seed=1", "privacy.steps=2", "train.checkpoint_every=1",
                      "train.keep_checkpoints=4")
    assert code == 0, err


def test_changed_performance_settings_at_a_resume_are_named(tmp_path, capsys, finished):
    # they do not change the mechanism (allowed), but they change the arithmetic: the resumed
    # run no longer repeats the checkpoint's run bit for bit, and stderr says why
    step = str(finished / "checkpoints" / "step-00000003")
    code, err = train(capsys, tmp_path / "branch", "--resume", step,
                      "performance.microbatch_size=1", "performance.clipping=two_pass")
    assert code == 0
    line = [x for x in err.splitlines() if "performance settings differ" in x]
    assert len(line) == 1 and ("(performance.clipping: 'auto' -> 'two_pass'; "
                               "performance.microbatch_size: 16 -> 1)") in line[0]
    code, err = train(capsys, tmp_path / "same", "--resume", step)
    assert code == 0 and "performance settings differ" not in err
    # a timeout changes no arithmetic: not named (nor, as "(not set) -> None", for
    # checkpoints written before the setting existed)
    code, err = train(capsys, tmp_path / "timeout", "--resume", step,
                      "performance.collective_timeout_s=60")
    assert code == 0 and "performance settings differ" not in err
    # nor when the noise is drawn or the batches assembled: the same numbers (a red team saw
    # the line for runs that matched bit for bit)
    code, err = train(capsys, tmp_path / "prefetch", "--resume", step,
                      "performance.noise_prefetch=background",
                      "performance.collate_prefetch=background")
    assert code == 0 and "performance settings differ" not in err


def test_doppler_with_other_coefficients_at_a_resume_restarts_its_state_and_says_so(
        tmp_path, capsys):
    """A resume may change the filter's coefficients (optimizer settings); DOPPLER's state,
    built with the old ones, restarts empty instead of mixing into the new normaliser (which
    could reach c_t = 0: a NaN update). The same coefficients continue without the line."""
    run = tmp_path / "doppler"
    args = ("train.checkpoint_every=1", "privacy.steps=3", "optim.filter.name=doppler")
    assert train(capsys, run, *args)[0] == 0
    step = str(run / "checkpoints" / "step-00000002")
    code, err = train(capsys, tmp_path / "branch", "--resume", step, *args,
                      "optim.filter.a=[-0.5]", "optim.filter.b=[0.5]")
    assert code == 0
    assert [x for x in err.splitlines() if "DOPPLER's filter state restarts empty" in x]
    code, err = train(capsys, tmp_path / "same", "--resume", step, *args)
    assert code == 0 and "restarts empty" not in err


def test_train_seconds_is_the_loop_and_the_final_evaluation_is_timed_apart(tmp_path,
                                                                            monkeypatch):
    # train_seconds once ended after the final evaluation (E2E generation can be longer than
    # the training), which benchmarks reported as training time
    import time

    from dptrain.config import load
    from dptrain.trainer import RunConfig, Trainer

    t = Trainer(load(RunConfig, TINY, ["privacy.steps=2", "train.checkpoint_every=0"]),
                tmp_path)
    real, began = t.evaluate, []

    def slow(generate=False, stoppable=False):
        if generate:
            began.append(time.time())
            time.sleep(1.0)
        return real(generate, stoppable)

    step = t.private_step

    def slow_step():
        time.sleep(0.5)
        return step()

    monkeypatch.setattr(t, "evaluate", slow)
    monkeypatch.setattr(t, "private_step", slow_step)
    before = time.time()
    summary = t.run()
    after = time.time()
    assert 1.0 <= summary["train_seconds"] <= began[0] - before
    # from the loop's end (just before the evaluation began), not from the run's start
    assert 1.0 <= summary["final_eval_seconds"] <= after - began[0] + 0.25


def test_train_seconds_and_rows_time_count_the_processes_a_resumed_run_continues(
        tmp_path, monkeypatch, capsys):
    # a run preempted twice reported only its last process's time: GPU-hours of a preemptible
    # ImageNet run were undercounted. Its time is the loops' up to each checkpoint continued
    # (the steps redone after a kill are counted once), and it says how many resumes it took.
    import signal
    import time

    from dptrain.config import load
    from dptrain.trainer import RunConfig, StopRequested, Trainer

    args = ["privacy.steps=4", "train.checkpoint_every=1", "train.log_every=1",
            "train.progress=false"]

    def trainer(stop_after=None):
        t = Trainer(load(RunConfig, TINY, args), tmp_path / "run")
        step = t.private_step

        def slow_step():
            time.sleep(0.4)
            row = step()
            if t.step == stop_after:
                t.stop_signal = signal.SIGTERM
            return row
        monkeypatch.setattr(t, "private_step", slow_step)
        return t

    def cost():
        return ckpt.read_meta(ckpt.find_latest(tmp_path / "run"))["cost"]

    began = time.time()
    first = trainer(stop_after=2)
    with pytest.raises(StopRequested):
        first.run()
    after_first = cost()
    assert after_first["resumes"] == 0 and 0.8 <= after_first["train_seconds"]
    second = trainer(stop_after=3)
    ckpt.load(second, ckpt.find_latest(tmp_path / "run"))
    with pytest.raises(StopRequested):
        second.run()
    after_second = cost()
    assert after_second["resumes"] == 1
    assert after_second["train_seconds"] >= after_first["train_seconds"] + 0.4
    third = trainer()
    ckpt.load(third, ckpt.find_latest(tmp_path / "run"))
    summary = third.run()
    wall = time.time() - began
    own = third._loop[1] - third._loop[0]
    assert summary["resumes"] == 2
    assert summary["train_seconds"] == pytest.approx(after_second["train_seconds"] + own)
    assert 1.6 <= summary["train_seconds"] < wall
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    times = [r["time"] for r in rows]
    assert times == sorted(times) and times[-1] <= summary["train_seconds"]
    assert all(b - a >= 0.4 for a, b in zip(times, times[1:]))  # no restart from 0


def test_a_checkpoint_that_does_not_record_the_time_before_it_says_so(tmp_path, finished,
                                                                       capsys):
    # an older dptrain's checkpoint: the time before it is unknown, and said to be
    older = tmp_path / "older" / "checkpoints" / "step-00000003"
    shutil.copytree(finished / "checkpoints" / older.name, older)
    forged(tmp_path / "older", lambda state: state.pop("cost"))
    code, err = train(capsys, tmp_path / "older", "--resume", "auto",
                      "train.checkpoint_every=1", "train.keep_checkpoints=4")
    assert code == 0, err
    assert "does not record the training time before it" in err
    summary = json.loads((tmp_path / "older" / "summary.json").read_text())
    assert summary["train_seconds"] is None and summary["resumes"] == 1


def _unfinished_copy(run: Path, out: Path) -> Path:
    shutil.copytree(run, out)
    (out / "summary.json").unlink()
    shutil.rmtree(out / "final")
    return out


@pytest.mark.parametrize("cost", [
    {"train_seconds": 1.0, "resumes": "2"}, {"train_seconds": 1.0, "resumes": None},
    [3.0, 1], {"train_seconds": "12.5", "resumes": 0}, {"train_seconds": float("nan"),
                                                        "resumes": 0},
    {"train_seconds": float("inf"), "resumes": 0}, {"train_seconds": -1e9, "resumes": 0},
    {"train_seconds": 1.0, "resumes": -5}, {"train_seconds": 1.0, "resumes": 2.5},
    {"train_seconds": 1.0, "resumes": True}, {"train_seconds": 1.0}, {"resumes": 0},
    {"train_seconds": 1.0, "resumes": 0, "seconds": 2.0},
], ids=["resumes-str", "resumes-none", "list", "seconds-str", "nan", "inf", "negative",
        "resumes-negative", "resumes-float", "resumes-bool", "resumes-missing",
        "seconds-missing", "another-key"])
def test_a_checkpoint_whose_cost_is_not_a_run_s_is_refused_naming_it(tmp_path, capsys,
                                                                      finished, cost):
    # (a red team: tracebacks in ckpt.load or at the first row, "nan" or a negative time in
    # summary.json and every row)
    out = _unfinished_copy(finished, tmp_path / "run")
    forged(out, lambda state: state.__setitem__("cost", cost))
    code, err = train(capsys, out, "--resume", "auto", "train.checkpoint_every=1",
                      "train.keep_checkpoints=4")
    assert code == 2 and "cost entry" in one_line(err) and "resume:" in err, err
    assert not (out / "summary.json").exists()


def test_an_empty_resume_is_refused_before_anything_is_built(tmp_path, capsys):
    code, err = train(capsys, tmp_path / "run", "--resume", " ")
    assert code == 2 and "resume: is empty" in one_line(err)
    assert not (tmp_path / "run").exists()


def test_a_metrics_row_without_an_integer_step_is_kept_not_a_traceback(tmp_path, capsys,
                                                                       finished):
    # {"step": null} made --resume auto fail with a TypeError when it dropped the rows after
    # its checkpoint
    out = unfinished_copy(finished, tmp_path / "copy")
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": null, "note": "mine"}\n')
    code, err = train(capsys, out, "--resume", "auto", "train.checkpoint_every=1",
                      "train.keep_checkpoints=4")
    assert code == 0, err
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert '{"step": null, "note": "mine"}' in lines
    assert [json.loads(x)["step"] for x in lines if '"note"' not in x] == [1, 2, 3, 4]


def test_a_checkpoint_whose_model_does_not_fit_names_resume_not_optim(tmp_path, capsys,
                                                                      finished):
    # a model tensor missing (or of another shape: a head of another class count) was
    # reported as "optim: the checkpoint's optimizer state does not fit"
    out = unfinished_copy(finished, tmp_path / "copy")
    step_dir = forged(out, lambda state: state["model"].pop(next(iter(state["model"]))))
    code, err = train(capsys, tmp_path / "other", "--resume", str(step_dir))
    line = one_line(err)
    assert code == 2 and "resume: checkpoint" in line and "its model does not fit" in line


def _history(state, fn) -> None:
    state["ledger"]["history"] = [fn(list(e)) for e in state["ledger"]["history"]]


@pytest.mark.parametrize("edit, says", [
    # a larger sigma or a smaller sampling rate: the accountant would report less than spent
    (lambda s: _history(s, lambda e: [e[0] * 100, e[1], e[2]]), "at noise multiplier"),
    # (even with the checkpoint's plan edited to match: no bound, it can be edited too)
    (lambda s: (s["plan"].update(noise_multiplier=s["plan"]["noise_multiplier"] * 1.02),
                _history(s, lambda e: [e[0] * 1.02, e[1], e[2]])), "cannot give"),
    (lambda s: _history(s, lambda e: [e[0], e[1] / 1000, e[2]]), "sampling rate 0.000125"),
    # a smaller sigma (more spent than the plan's, with the plan untouched): was accepted, and
    # the run ended at epsilon 28 against its target of 8, saying nothing
    (lambda s: _history(s, lambda e: [e[0] / 2, e[1], e[2]]), "and with them the plan spends"),
    # a ledger of the wrong types: was a TypeError's traceback, exit 1
    (lambda s: _history(s, lambda e: [str(e[0]), e[1], e[2]]), "its ledger: "),
    (lambda s: _history(s, lambda e: [e[0], e[1], -1]), "its ledger: "),
    # beyond privacy.steps with a matching ledger: trained on past the target (epsilon 26
    # against 8), exit 0
    (lambda s: (s.update(step=99), _history(s, lambda e: [e[0], e[1], 99])),
     "at step 99, beyond privacy.steps (4)"),
    (lambda s: s.update(step="2"), "has step '2', not a non-negative integer"),
    (lambda s: s.update(step=-1), "has step -1, not a non-negative integer"),
])
def test_a_ledger_the_run_cannot_have_written_is_refused(tmp_path, capsys, finished, edit,
                                                         says):
    out = unfinished_copy(finished, tmp_path / "copy")
    step_dir = forged(out, edit)
    before = snapshot(out)
    code, err = train(capsys, tmp_path / "other", "--resume", str(step_dir))
    line = one_line(err)
    assert code == 2 and line.startswith(f"dptrain train: error: resume: checkpoint {step_dir}")
    assert says in line
    assert snapshot(out) == before and not (tmp_path / "other").exists()


@pytest.mark.parametrize("where", ["plan", "ledger"])
def test_a_ledger_of_another_versions_calibration_is_accepted(tmp_path, capsys, finished,
                                                               where):
    # releases at a sigma another version calibrated for the same target, 0.5% larger than
    # this run's: in the checkpoint's plan too (its run was that version), or only in its
    # ledger (that version's run was resumed by this version, which checkpointed with its own
    # plan)
    def older_calibration(state):
        sigma = state["plan"]["noise_multiplier"] * 1.005
        if where == "plan":
            state["plan"]["noise_multiplier"] = sigma
        _history(state, lambda e: [sigma, e[1], e[2]])

    out = unfinished_copy(finished, tmp_path / "copy")
    shutil.rmtree(sorted((out / "checkpoints").glob("step-*"))[-1])  # step 3: one to go
    step_dir = forged(out, older_calibration)
    code, err = train(capsys, tmp_path / "other", "--resume", str(step_dir))
    assert code == 0, err
    assert ("sigma is calibrated to" in err) == (where == "plan")
    assert json.loads((tmp_path / "other" / "summary.json").read_text())["steps"] == 4
    # a sigma given in the config is every release's: no drift is another version's
    def given(state):
        state["config"]["privacy"].update(noise_multiplier=0.6, epsilon=None)
        state["plan"]["noise_multiplier"] = 0.6
        _history(state, lambda e: [0.6 * 1.005, e[1], e[2]])

    step_dir = forged(out, given)
    code, err = train(capsys, tmp_path / "given", "--resume", str(step_dir),
                      "privacy.noise_multiplier=0.6", "privacy.epsilon=null")
    assert code == 2 and "which this run's privacy settings cannot give" in one_line(err)


def test_a_fresh_run_into_a_directory_holding_only_a_final_model_is_refused(tmp_path, capsys):
    # final/ alone (no checkpoints, no rows: a run without checkpoints killed before its
    # summary) is an earlier run's: a fresh run would overwrite its model
    out = tmp_path / "run"
    (out / "final").mkdir(parents=True)
    (out / "final" / "model.safetensors").write_bytes(b"earlier model")
    before = snapshot(out)
    code, err = train(capsys, out, "privacy.steps=2", "train.checkpoint_every=0")
    assert code == 2 and "output-dir" in one_line(err) and "final/" in err
    assert snapshot(out) == before


def test_resume_path_under_a_checkpoint_one_step_later_is_refused(tmp_path, capsys):
    # the later checkpoint is the very next step (step 3 after step 2): still overwritten
    done = tmp_path / "done"
    code, _ = train(capsys, done, "privacy.steps=3", "train.checkpoint_every=1",
                    "train.keep_checkpoints=3")
    assert code == 0
    out = unfinished_copy(done, tmp_path / "run")
    before = snapshot(out)
    code, err = train(capsys, out, "--resume", str(out / "checkpoints" / "step-00000002"),
                      "privacy.steps=3", "train.checkpoint_every=1", "train.keep_checkpoints=3")
    assert code == 2 and "step 3" in one_line(err) and "overwrite" in err
    assert snapshot(out) == before


def test_secure_resume_path_on_several_ranks_is_checked_for_later_outputs(tmp_path, capsys):
    # with several ranks only --resume auto defers the secure check (to rank 0's checksummed
    # list); --resume PATH is checked before the model is built, as in one process: a branch
    # off step 1 of a run that logged steps 2 and 3 would draw them again with fresh noise
    from dptrain.parallel.dist import spawn

    out = tmp_path / "run"
    code, _ = train(capsys, out, "train.checkpoint_every=1", "train.keep_checkpoints=3",
                    "privacy.steps=3", *SECURE)
    assert code == 0
    branch = str(tmp_path / "branch")
    args = ["--output-dir", branch, "--resume", str(out / "checkpoints" / "step-00000001"),
            "privacy.steps=3", *SECURE]
    got = spawn(_train_on_each_rank, 2, [args, args], timeout=240)
    line = _said_by_rank_0(got)
    assert "error: resume: secure mode" in line and "after step 1" in line, line
    assert not (tmp_path / "branch").exists()
