"""Progress on stderr (dptrain/telemetry/progress.py): a bar on a terminal, with every
message on a line of its own; plain lines, without carriage returns, in a log file."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import dptrain.telemetry.progress as progress

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny.yaml")


def _starts_lines(err: str, text: str) -> bool:
    """Every occurrence of ``text`` in ``err`` begins a line (not after a bar's text)."""
    at = [i for i in range(len(err)) if err.startswith(text, i)]
    return bool(at) and all(i == 0 or err[i - 1] in "\n\r" for i in at)


def test_the_non_finite_loss_note_does_not_land_mid_bar_on_a_terminal(capsys, monkeypatch):
    # _public_row prints with print() while the bar is drawn: on a terminal the note is
    # glued to the bar's text ("...loss=3.4911]dptrain: note: the training loss is nan ...")
    from dptrain.config import load
    from dptrain.trainer import RunConfig, Trainer

    monkeypatch.setattr(progress, "is_terminal", lambda stream: True)
    t = Trainer(load(RunConfig, TINY, ["train.progress=true", "privacy.steps=3",
                                       "train.checkpoint_every=0", "optim.lr=1e30",
                                       "optim.aux.lr=1e30"]))
    t.run()
    err = capsys.readouterr().err
    assert "dptrain: note: the training loss is" in err
    assert _starts_lines(err, "dptrain: note: the training loss is"), err[-600:]


def test_a_test_image_warning_of_an_evaluation_during_training_is_not_mid_bar(capsys,
                                                                              monkeypatch):
    # Trainer._evaluate's undecodable-test-images warning (eval_every) uses print() too
    from dptrain.config import load
    from dptrain.trainer import RunConfig, Trainer

    monkeypatch.setattr(progress, "is_terminal", lambda stream: True)
    t = Trainer(load(RunConfig, TINY, ["train.progress=true", "privacy.steps=3",
                                       "train.checkpoint_every=0", "train.eval_every=1"]))
    t.task.test.undecodable = []
    real = t.task.evaluate

    def evaluate(*args, **kwargs):
        t.task.test.undecodable.append("s.tar: x.jpg: PIL identifies no image format in it")
        return real(*args, **kwargs)

    monkeypatch.setattr(t.task, "evaluate", evaluate)
    t.run()
    err = capsys.readouterr().err
    assert _starts_lines(err, "dptrain: warning: 1 test image(s)"), err[-600:]


def test_the_lost_rows_note_of_a_resume_is_not_written_after_the_bar_is_drawn(
        tmp_path, capsys, monkeypatch):
    # Trainer.run creates the bar (which draws "0/T" at once on a terminal) before
    # _write_lost_rows and the "no GPU telemetry" note print(): both land on the bar's line
    from dptrain.config import load
    from dptrain.trainer import RunConfig, Trainer

    monkeypatch.setattr(progress, "is_terminal", lambda stream: True)
    t = Trainer(load(RunConfig, TINY, ["train.progress=true", "privacy.steps=1",
                                       "train.checkpoint_every=0"]),
                output_dir=tmp_path / "run")
    t._resumed_rows = ['{"step": 0, "lr": 0.0}\n']  # a checkpoint's row metrics.jsonl lacks
    t.run()
    err = capsys.readouterr().err
    assert _starts_lines(err, "dptrain: wrote 1 metrics row(s)"), err[-600:]


def test_the_generation_progress_into_a_log_file_has_no_carriage_returns(capsys):
    # the final evaluation's generation bar (train.generate_prompts) is still a tqdm bar in
    # a log file, where the training progress is plain lines now
    import torch

    from dptrain.data import DataInfo
    from dptrain.eval.text import greedy_generate
    from dptrain.models import ModelConfig, build_model

    info = DataInfo(kind="lm", vocab_size=257, pad_id=256, eos_id=256, max_length=16)
    torch.manual_seed(0)
    model = build_model(ModelConfig(n_layer=1, n_embd=16, n_head=2, n_positions=16), info)
    greedy_generate(model, [[1, 2], [3]], max_new_tokens=2, eos_id=256, progress=True)
    assert "\r" not in capsys.readouterr().err


def test_audit_progress_into_a_log_file_has_no_carriage_returns(tmp_path):
    # dptrain audit trains the whole run with a tqdm bar: into a log file, \r-joined updates
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-m", "dptrain", "audit", "--config", TINY,
                           "--canaries", "10", "train.progress=true", "privacy.steps=2"],
                          cwd=tmp_path, env=env, capture_output=True, timeout=300)
    # (bytes: text mode's universal newlines would turn the \r into \n)
    assert proc.returncode in (0, 1), proc.stderr[-800:]
    assert b"\r" not in proc.stderr, proc.stderr[:300]



def test_progress_into_a_log_file_is_plain_lines_not_a_bar(tmp_path, capsys):
    # stderr redirected to a file (a cluster job's log): a bar's carriage returns made one
    # unreadable line of every update there; now plain lines, at least the last step's
    from dptrain.config import load
    from dptrain.trainer import RunConfig, Trainer

    t = Trainer(load(RunConfig, TINY, ["train.progress=true", "privacy.steps=3",
                                       "train.checkpoint_every=0", "privacy.accountant=rdp"]))
    t.run()
    err = capsys.readouterr().err
    assert "\r" not in err
    steps = [line for line in err.splitlines() if line.startswith("dptrain: step ")]
    assert steps and steps[-1].startswith("dptrain: step 3/3, loss ") and " s/step" in steps[-1]
    assert f"eps {t.epsilon():.3f}" in steps[-1]


@pytest.mark.parametrize("secure", [False, True])
def test_log_lines_come_at_most_every_interval_and_at_the_last_step(capsys, monkeypatch,
                                                                    secure):
    clock = [100.0]
    monkeypatch.setattr(progress.time, "time", lambda: clock[0])
    lines = progress.LogLines(10, 2, rate=not secure, enabled=True, every_s=30.0)
    for step, dt in ((3, 10.0), (4, 25.0), (5, 1.0), (10, 1.0)):
        clock[0] += dt
        lines.update(step, None if secure else 0.5, "1.000")
    got = capsys.readouterr().err.splitlines()
    # 35 s after the start at step 4 (2 steps: 17.5 s/step), then the last step (6 in 2 s)
    rate = ["17.5 s/step", "0.333 s/step"] if not secure else ["", ""]
    assert got == [f"dptrain: step 4/10{'' if secure else ', loss 0.5000'}, eps 1.000"
                   + (f", {rate[0]}" if rate[0] else ""),
                   f"dptrain: step 10/10{'' if secure else ', loss 0.5000'}, eps 1.000"
                   + (f", {rate[1]}" if rate[1] else "")]
    off = progress.LogLines(10, 2, rate=True, enabled=False)
    off.update(10, 0.5, "1.000")
    assert capsys.readouterr().err == ""


def test_a_python_warning_during_a_run_goes_under_the_bar_and_the_old_way_comes_back(
        capsys, monkeypatch):
    # warnings.warn (the accountants', a model's) wrote into the middle of a drawn bar
    import warnings

    from dptrain.config import load
    from dptrain.trainer import RunConfig, Trainer

    monkeypatch.setattr(progress, "is_terminal", lambda stream: True)
    t = Trainer(load(RunConfig, TINY, ["train.progress=true", "privacy.steps=2",
                                       "train.checkpoint_every=0"]))
    step = t.private_step

    def warning_step():
        warnings.warn("a model's warning mid-run", UserWarning)
        return step()

    monkeypatch.setattr(t, "private_step", warning_step)
    before = warnings.showwarning
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = before  # (pytest's own recorder off: shown as a user sees it)
        t.run()
        assert warnings.showwarning is before
    err = capsys.readouterr().err
    # (formatwarning's line begins with the file that warned: here, this one)
    assert err.count("UserWarning: a model's warning mid-run") == 2
    assert _starts_lines(err, f"{__file__}:"), err[-600:]


def _shown_on_stderr(message, category, filename, lineno, file=None, line=None):
    """Python's own way of showing a warning (pytest records them instead)."""
    import warnings

    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


def test_a_command_shows_dptrain_s_warnings_as_lines_and_others_as_python_does(capsys):
    # the accountants' fallback note came with trainer.py's file, line and source line, and
    # opacus' note on its RDP orders after it
    import warnings

    from dptrain.messages import command_warnings
    from dptrain.privacy.accounting import OPACUS_ORDER_NOTE, AccountingWarning

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = _shown_on_stderr
        before = warnings.formatwarning, list(warnings.filters)
        with command_warnings():
            warnings.warn("PRV not used; the RDP bound instead", AccountingWarning)
            warnings.warn("dptrain.clipping: no rule for X; the fallback", UserWarning)
            warnings.warn("dptrain: a mask from torch's RNG", UserWarning)
            warnings.warn(f"{OPACUS_ORDER_NOTE} smallest alpha.", UserWarning)
            warnings.warn("a library's own", FutureWarning)
        assert (warnings.formatwarning, list(warnings.filters)) == before
        warnings.warn(f"{OPACUS_ORDER_NOTE} smallest alpha, outside a command", UserWarning)
    lines = capsys.readouterr().err.splitlines()
    assert lines[:3] == ["dptrain: warning: PRV not used; the RDP bound instead",
                         "dptrain.clipping: warning: no rule for X; the fallback",
                         "dptrain: warning: a mask from torch's RNG"]
    assert lines[3].startswith(f"{__file__}:") and "FutureWarning: a library's own" in lines[3]
    assert sum(OPACUS_ORDER_NOTE in x for x in lines) == 1 and "outside" in lines[-2] + lines[-1]


def test_train_s_accounting_fallback_is_one_warning_line(tmp_path, capsys):
    import warnings

    from dptrain.cli import main

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = _shown_on_stderr
        assert main(["train", "--config", str(TINY), "--output-dir", str(tmp_path / "r"),
                     "--dry-run", "privacy.epsilon=200", "privacy.accountant=prv"]) == 0
    out, err = capsys.readouterr()
    assert ("dptrain: warning: opacus' PRV search is impractical above epsilon 100; "
            "calibrating to the RDP bound instead\n") in err
    assert "AccountingWarning" not in err and ".py:" not in err, err
    # the plan says so too (a -W ignore run prints no warning at all)
    assert "  accountant: prv\n" in out and "  calibrated_with: rdp\n" in out


def test_a_command_takes_away_only_the_filters_it_added(capsys):
    # catch_warnings() put the whole list back: filters that a library imported during the
    # command installs (torch's TracerWarning, scipy's) were lost
    import warnings

    from dptrain.messages import command_warnings
    from dptrain.privacy.accounting import OPACUS_ORDER_NOTE, AccountingWarning

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=OPACUS_ORDER_NOTE, category=UserWarning)
        users = list(warnings.filters)
        with command_warnings(rank=1):
            warnings.filterwarnings("ignore", message="a library's own filter")
            library = warnings.filters[0]
            assert any(f[2] is AccountingWarning for f in warnings.filters)
        assert warnings.filters == [library, *users]  # (the user's identical one kept)


def test_on_other_ranks_the_accountants_notes_are_left_to_rank_0(capsys):
    import warnings

    from dptrain.messages import command_warnings
    from dptrain.privacy.accounting import AccountingWarning

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = _shown_on_stderr
        for rank in (0, 1):
            with command_warnings(rank):
                warnings.warn("PRV not used", AccountingWarning)
                warnings.warn("dptrain.clipping: no rule for X", UserWarning)
    assert capsys.readouterr().err.splitlines() == [
        "dptrain: warning: PRV not used", "dptrain.clipping: warning: no rule for X",
        "dptrain.clipping: warning: no rule for X"]


def test_a_line_at_the_step_of_the_previous_one_has_no_rate(capsys, monkeypatch):
    # a run resumed at its last step logs that step again: no steps since, so no s/step (and
    # no division by zero)
    monkeypatch.setattr(progress.time, "time", lambda: 100.0)
    lines = progress.LogLines(10, 10, rate=True, enabled=True, prefix="dptrain audit")
    lines.update(10)
    assert capsys.readouterr().err == "dptrain audit: step 10/10\n"


def test_warnings_are_left_alone_where_the_bar_is_not_drawn():
    import io
    import warnings
    from types import SimpleNamespace

    before = warnings.showwarning
    hidden = progress.WarningsUnderBar(SimpleNamespace(disable=True))
    assert warnings.showwarning is before
    hidden.close()
    assert warnings.showwarning is before
    drawn = progress.WarningsUnderBar(SimpleNamespace(disable=False))
    try:
        assert warnings.showwarning is not before
    finally:
        drawn.close()
    assert warnings.showwarning is before
    closed = io.StringIO()
    closed.close()  # isatty() raises ValueError on a closed stream
    assert progress.is_terminal(closed) is False and progress.is_terminal(object()) is False
