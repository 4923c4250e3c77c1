"""More of `dptrain train`'s guards (dptrain/commands/train.py) one at a time, without a run:
the run lock, the output-directory and data-folder checks, the ranks' agreement, the secure
resume record, the stop signals and what a start prints (a stand-in trainer)."""

from __future__ import annotations

import argparse
import errno
import fcntl
import json
import os
import signal
import threading
import time
import types

import pytest

from dptrain import checkpoint as ckpt
from dptrain.commands import train as cmd
from dptrain.config import ConfigError
from dptrain.trainer import RunConfig, StopRequested


def _args(**kw) -> argparse.Namespace:
    base = {"config": "cfg.yaml", "overrides": [], "output_dir": None, "resume": None,
            "dry_run": False}
    return argparse.Namespace(**{**base, **kw})


def _checkpoint(run, step: int):
    d = run / "checkpoints" / f"step-{step:08d}"
    d.mkdir(parents=True)
    (d / "COMPLETE").write_text("{}")
    return d


def _rows(path) -> list:
    return [json.loads(x) for x in path.read_text().splitlines()]


# -- _run: before the lock --------------------------------------------------------------------

@pytest.fixture
def before_lock(monkeypatch):
    """_run with a default config and _run_in replaced: what it reaches before the run."""
    import dptrain.config
    import dptrain.parallel.dist
    import dptrain.trainer

    monkeypatch.setattr(dptrain.config, "load", lambda *a, **k: RunConfig())
    monkeypatch.setattr(cmd, "_run_in", lambda *a, **k: 7)
    joined = []
    monkeypatch.setattr(dptrain.trainer, "join_ranks", lambda perf: joined.append(perf))
    monkeypatch.setattr(cmd, "_check_ranks_agree_on_start", lambda args, out: None)

    def one_verdict(error, several, value=None):
        if error is not None:
            raise error
        return [value]

    monkeypatch.setattr(dptrain.parallel.dist, "one_verdict", one_verdict)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    return joined


def _stop():
    return types.SimpleNamespace(stop_signal=None, rank=0, trainer=None, finished=False,
                                 out=None)


@pytest.mark.parametrize("option", ["output_dir", "resume"])
def test_an_empty_output_dir_or_resume_is_refused(before_lock, tmp_path, option):
    args = _args(**{"output_dir": str(tmp_path / "out"), option: "  "})
    with pytest.raises(ConfigError, match="is empty") as e:
        cmd._run(args, _stop())
    assert e.value.field == option.replace("_", "-")


def test_two_ranks_meet_before_the_checks(before_lock, tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert cmd._run(_args(output_dir=str(tmp_path / "out")), _stop()) == 7
    assert len(before_lock) == 1


def test_an_output_dir_inside_an_image_folder_is_refused_before_the_run(before_lock, tmp_path,
                                                                        monkeypatch):
    import dptrain.data

    data = tmp_path / "train"
    monkeypatch.setattr(dptrain.data, "example_folders", lambda cfg: [("data.train_file", data)])
    with pytest.raises(ConfigError, match="is inside"):
        cmd._run(_args(output_dir=str(data / "run")), _stop())


# -- _run_in with a stand-in trainer ------------------------------------------------------------

class _Trainer:
    outcome: object = None

    def __init__(self, cfg, out):
        self.cfg, self.out, self.rank, self.step = cfg, out, 0, 0
        self.stop_signal = None
        self.plan = types.SimpleNamespace(steps=5)

    def print_start_notes(self):
        pass

    def run(self):
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        return self.outcome


@pytest.fixture
def trainer(monkeypatch):
    """A stand-in Trainer; ``loaded``: the (path, verified) of each checkpoint load."""
    import dptrain.trainer

    loaded = []

    def load(t, path, verified):
        loaded.append((path, verified))
        t.step = ckpt.checkpoint_step(path)

    monkeypatch.setattr(dptrain.trainer, "Trainer", _Trainer)
    monkeypatch.setattr(ckpt, "load", load)
    monkeypatch.setattr(cmd, "_dry_run_report", lambda t, out, path: f"REPORT {path}\n")
    monkeypatch.setattr(_Trainer, "outcome", {"metrics": {}, "steps": 5, "epsilon": 1.0,
                                              "delta": 1e-5})
    return loaded


def test_a_refusal_of_the_first_look_is_raised_in_one_process(trainer, tmp_path):
    (tmp_path / "summary.json").write_text("{}")
    with pytest.raises(ConfigError, match="already holds a finished run"):
        cmd._run_in(tmp_path, RunConfig(), _args(), _stop(), several=False)


@pytest.mark.parametrize("dry_run", [False, True])
def test_a_finished_run_is_nothing_to_do_and_a_dry_run_says_so_on_stdout(
        trainer, tmp_path, monkeypatch, capsys, dry_run):
    monkeypatch.setattr(cmd, "_look", lambda out, cfg, args: True)
    assert cmd._run_in(tmp_path, RunConfig(), _args(resume="auto", dry_run=dry_run), _stop(),
                       several=False) == 0
    said = capsys.readouterr()
    assert "nothing to do" in said.err
    assert ("start: finished (summary.json)" in said.out) == dry_run


def test_resume_auto_loads_what_the_verified_look_chose(trainer, tmp_path, monkeypatch):
    chosen = _checkpoint(tmp_path, 2)

    def find_latest(out, *, shallow=False, collective=False, quiet=False):
        return chosen if collective else None  # (the first look saw none)

    monkeypatch.setattr(ckpt, "find_latest", find_latest)
    assert cmd._run_in(tmp_path, RunConfig(), _args(resume="auto"), _stop(), False) == 0
    assert trainer == [(chosen, True)]


def test_a_dry_run_loads_its_checkpoint_into_memory_and_reports(trainer, tmp_path, capsys):
    step2 = _checkpoint(tmp_path / "src", 2)
    out = tmp_path / "out"
    ran = []
    assert cmd._run_in(out, RunConfig(), _args(resume=str(step2), dry_run=True), _stop(),
                       False, started=lambda: ran.append(1)) == 0
    assert trainer == [(step2, False)] and not ran
    assert f"REPORT {step2}" in capsys.readouterr().out


@pytest.mark.parametrize("damaged", [False, True])
def test_resume_auto_that_finds_nothing_says_intact_only_over_damaged_ones(
        trainer, tmp_path, capsys, damaged):
    if damaged:
        (tmp_path / "checkpoints" / "step-00000002").mkdir(parents=True)  # (no marker)
    assert cmd._run_in(tmp_path, RunConfig(), _args(resume="auto"), _stop(), False) == 0
    word = "intact" if damaged else "complete"
    assert f"no {word} checkpoint in {tmp_path}" in capsys.readouterr().err


def test_a_fresh_run_drops_a_line_cut_short_by_a_kill(trainer, tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "lo')
    assert cmd._run_in(tmp_path, RunConfig(), _args(), _stop(), False) == 0
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def test_a_resume_drops_the_rows_after_its_checkpoint(trainer, tmp_path):
    step2 = _checkpoint(tmp_path, 2)
    (tmp_path / "metrics.jsonl").write_text("".join(f'{{"step": {s}}}\n' for s in (1, 2, 3)))
    assert cmd._run_in(tmp_path, RunConfig(), _args(resume=str(step2)), _stop(), False) == 0
    assert _rows(tmp_path / "metrics.jsonl") == [{"step": 1}, {"step": 2}]


def test_a_secure_branch_is_recorded_in_its_source_run(trainer, tmp_path):
    step2 = _checkpoint(tmp_path / "src", 2)
    cfg = RunConfig()
    cfg.privacy.secure_mode = True
    out = tmp_path / "branch"
    assert cmd._run_in(out, cfg, _args(resume=str(step2)), _stop(), False) == 0
    rows = _rows(tmp_path / "src" / cmd.SECURE_RESUMES)
    assert [r["into"] for r in rows] == [str(out.resolve())]


@pytest.mark.parametrize("step,where", [(0, "nothing to keep"), (3, "its checkpoint in")])
def test_a_stop_exits_128_plus_the_signal_and_says_what_it_kept(trainer, tmp_path, monkeypatch,
                                                                capsys, step, where):
    monkeypatch.setattr(_Trainer, "outcome", StopRequested(signal.SIGTERM, step, None))
    assert cmd._run_in(tmp_path, RunConfig(), _args(), _stop(), False) == 143
    assert f"SIGTERM: stopped after step {step} of 5 ({where}" in capsys.readouterr().err


def test_done_says_one_step_in_the_singular(trainer, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(_Trainer, "outcome", {"metrics": {"loss": 0.5}, "steps": 1,
                                              "epsilon": 1.0, "delta": 1e-5})
    assert cmd._run_in(tmp_path, RunConfig(), _args(), _stop(), False) == 0
    assert "done: 1 step, epsilon 1.000" in capsys.readouterr().out


def test_done_metrics_counts_as_integers_without_booleans_or_last_iterate_counts():
    metrics = {"flag": True, "last_iterate_tokens": 5, "last_iterate_loss": 0.25,
               "tokens": 13220, "loss": 0.123456}
    assert cmd._done_metrics(metrics) == "last_iterate_loss 0.25, tokens 13220, loss 0.1235"


# -- stop signals -----------------------------------------------------------------------------

@pytest.fixture
def handlers():
    before = {s: signal.getsignal(s) for s in cmd.STOP_SIGNALS}
    yield
    for s, h in before.items():
        signal.signal(s, h)


def _deliver(sig):
    os.kill(os.getpid(), sig)
    time.sleep(0.01)  # (the handler runs between bytecodes of the main thread)


@pytest.mark.parametrize("rank", [0, 1])
def test_the_first_stop_signal_counts_and_only_rank_0_says_so(handlers, capsys, rank):
    stop = _stop()
    stop.rank = rank
    with cmd._stop_on_signals(stop):
        _deliver(signal.SIGUSR1)
        _deliver(signal.SIGTERM)  # (a second one: ignored)
    assert stop.stop_signal == signal.SIGUSR1
    err = capsys.readouterr().err
    assert err.count("received") == (1 if rank == 0 else 0)
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN  # (stopping: exits 143 next)


@pytest.mark.parametrize("keep_ignoring", [False, True])
def test_after_a_finished_run_the_handlers_come_back_unless_the_process_exits(
        handlers, keep_ignoring):
    previous = signal.getsignal(signal.SIGTERM)
    stop = _stop()
    with cmd._stop_on_signals(stop, keep_ignoring=keep_ignoring):
        stop.finished = True
        _deliver(signal.SIGTERM)  # (done: ignored)
    assert stop.stop_signal is None
    assert signal.getsignal(signal.SIGTERM) == (signal.SIG_IGN if keep_ignoring else previous)


# -- the run lock -----------------------------------------------------------------------------

def test_a_folder_a_run_writes_must_be_searchable_too(tmp_path, monkeypatch):
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "metrics.jsonl").write_text("")
    asked = {}

    def access(path, mode):  # (root searches any folder: the question asked is checked)
        asked[os.path.basename(path)] = mode
        return not mode & os.X_OK

    monkeypatch.setattr(os, "access", access)
    with pytest.raises(ConfigError, match="checkpoints: it is not writable"):
        cmd._check_layout(tmp_path)
    (tmp_path / "checkpoints").rmdir()
    cmd._check_layout(tmp_path)  # a file needs no search permission
    assert asked == {"checkpoints": os.W_OK | os.X_OK, "metrics.jsonl": os.W_OK}


def test_a_dry_run_s_lock_check_creates_nothing(tmp_path):
    out = tmp_path / "new"
    with cmd._run_lock(out, rank=0, dry_run=True) as started:
        assert not out.exists()  # (not even while it "runs")
        started()
    assert not out.exists()
    out.mkdir()
    with cmd._run_lock(out, rank=0, dry_run=True):
        assert not (out / "run.lock").exists()


def test_a_start_that_wrote_nothing_but_its_lock_leaves_no_folder(tmp_path):
    out = tmp_path / "new"
    with cmd._run_lock(out, rank=0) as started:
        assert (out / "run.lock").read_text()  # (names this process)
        started()
    assert not out.exists()


@pytest.mark.parametrize("before", [None, "", '{"pid": 1}\n'])
def test_a_refused_start_puts_back_what_the_lock_file_said(tmp_path, before):
    if before is not None:
        (tmp_path / "run.lock").write_text(before)
    with cmd._run_lock(tmp_path, rank=0):
        assert json.loads((tmp_path / "run.lock").read_text())["pid"] == os.getpid()
    if before:
        assert (tmp_path / "run.lock").read_text() == before
    else:  # (none, or an empty one: it goes)
        assert not (tmp_path / "run.lock").exists()


def test_a_dry_run_that_cannot_read_the_lock_is_refused(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="cannot read"):
        cmd._probe(fcntl, tmp_path / "file" / "run.lock", tmp_path / "file")


def _held(path, kind):
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, kind | fcntl.LOCK_NB)
    return fd


def test_a_dry_run_probes_beside_another_dry_run(tmp_path, monkeypatch):
    monkeypatch.setattr(cmd, "LOCK_WAIT_S", 0.05)
    fd = _held(tmp_path / "run.lock", fcntl.LOCK_SH)
    try:
        cmd._probe(fcntl, tmp_path / "run.lock", tmp_path)  # (shared with the other: passes)
    finally:
        os.close(fd)


def test_a_lock_let_go_within_the_wait_is_taken(tmp_path):
    path = tmp_path / "run.lock"
    fd = _held(path, fcntl.LOCK_EX)
    threading.Timer(0.2, os.close, (fd,)).start()
    mine = os.open(path, os.O_RDWR)
    try:
        assert cmd._take(fcntl, mine, fcntl.LOCK_EX, path, tmp_path)
    finally:
        os.close(mine)


def test_a_held_lock_names_its_holder(tmp_path, monkeypatch):
    monkeypatch.setattr(cmd, "LOCK_WAIT_S", 0.05)
    path = tmp_path / "run.lock"
    path.write_text(json.dumps({"pid": 4242, "host": "node7", "since": "today"}))
    fd = _held(path, fcntl.LOCK_EX)
    mine = os.open(path, os.O_RDWR)
    try:
        with pytest.raises(ConfigError, match="pid 4242 on node7, since today"):
            cmd._take(fcntl, mine, fcntl.LOCK_EX, path, tmp_path)
    finally:
        os.close(mine)
        os.close(fd)


@pytest.mark.parametrize("code", [errno.ENOLCK, errno.EIO])
def test_a_file_system_that_cannot_lock_warns_and_another_error_refuses(tmp_path, capsys, code):
    def flock(fd, kind):
        raise OSError(code, os.strerror(code))

    fake = types.SimpleNamespace(flock=flock, LOCK_NB=fcntl.LOCK_NB, LOCK_EX=fcntl.LOCK_EX)
    path = tmp_path / "run.lock"
    if code == errno.ENOLCK:
        assert cmd._take(fake, 0, fake.LOCK_EX, path, tmp_path) is False
        assert "cannot lock files" in capsys.readouterr().err
    else:
        with pytest.raises(ConfigError, match="cannot lock"):
            cmd._take(fake, 0, fake.LOCK_EX, path, tmp_path)


# -- the output directory and the data ------------------------------------------------------

def test_an_output_dir_that_is_a_file_or_a_dangling_link_is_refused(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="exists and is not a directory"):
        cmd._check_output_dir(tmp_path / "file")
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match="is a symbolic link to nothing"):
        cmd._check_output_dir(tmp_path / "link")


def test_an_output_dir_in_or_over_or_linked_into_another_run_is_refused(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(ConfigError, match="is inside the run"):
        cmd._check_output_dir(run / "checkpoints" / "mine")
    over = tmp_path / "over"
    (over / "final" / "inner").mkdir(parents=True)
    (over / "final" / "inner" / "metrics.jsonl").write_text("")
    with pytest.raises(ConfigError, match="holds another run's files"):
        cmd._check_output_dir(over)
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "checkpoints").symlink_to(run / "checkpoints")
    with pytest.raises(ConfigError, match="leads into the run"):
        cmd._check_output_dir(linked)


@pytest.mark.parametrize("below,why", [
    ("", "this run's checkpoints/ and final/ would be read as classes"),
    ("x", "x would be read as a class"),
    ("x/y", "would be read as examples of class x")])
def test_an_output_dir_in_an_image_folder_says_what_would_be_read(tmp_path, monkeypatch,
                                                                  below, why):
    import dptrain.data

    data = tmp_path / "train"
    monkeypatch.setattr(dptrain.data, "example_folders", lambda cfg: [("data.train_file", data)])
    with pytest.raises(ConfigError) as e:
        cmd._check_outside_the_data(data / below if below else data, RunConfig())
    assert why in e.value.message


# -- the first look and the checkpoint to resume ------------------------------------------------

def test_a_fresh_run_over_a_finished_one_is_refused(tmp_path):
    (tmp_path / "summary.json").write_text("{}")
    with pytest.raises(ConfigError, match="already holds a finished run"):
        cmd._look(tmp_path, RunConfig(), _args())


def test_resume_auto_over_a_final_folder_of_no_run_is_refused(tmp_path):
    (tmp_path / "final").mkdir()
    (tmp_path / "final" / "model.safetensors").write_text("")
    with pytest.raises(ConfigError, match="final/ holds files"):
        cmd._resume_path(tmp_path, RunConfig(), _args(resume="auto"), False)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')  # (its own run's export: on)
    assert cmd._resume_path(tmp_path, RunConfig(), _args(resume="auto"), False) is None


def test_resume_path_must_be_a_checkpoint_directory(tmp_path):
    with pytest.raises(ConfigError, match="no checkpoint directory at"):
        cmd._resume_path(tmp_path / "out", RunConfig(), _args(resume=str(tmp_path / "no")), False)
    run = tmp_path / "run"
    _checkpoint(run, 2)
    with pytest.raises(ConfigError, match="is a run directory"):
        cmd._resume_path(tmp_path / "out", RunConfig(), _args(resume=str(run)), False)


def test_a_checkpoint_is_never_taken_for_a_run_directory(tmp_path):
    step2 = _checkpoint(tmp_path / "run", 2)
    (step2 / "checkpoints" / "step-00000001").mkdir(parents=True)  # (a stray copy inside)
    cmd._refuse_a_run_directory(step2)


def test_a_fresh_run_over_an_unfinished_one_is_refused(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(ConfigError, match="holds an unfinished run"):
        cmd._resume_path(tmp_path, RunConfig(), _args(), False)


def test_secure_resume_auto_is_checked_early_only_in_one_process(tmp_path, monkeypatch):
    step2 = _checkpoint(tmp_path, 2)
    (tmp_path / "metrics.jsonl").write_text('{"step": 3}\n')
    monkeypatch.setattr(ckpt, "find_latest", lambda out, **kw: step2)
    cfg = RunConfig()
    cfg.privacy.secure_mode = True
    with pytest.raises(ConfigError, match="metrics of step 3"):
        cmd._resume_path(tmp_path, cfg, _args(resume="auto"), False)
    # several ranks: each rank's own first look; checked later, on rank 0's list
    assert cmd._resume_path(tmp_path, cfg, _args(resume="auto"), True) == step2


# -- ranks that disagree ----------------------------------------------------------------------

@pytest.mark.parametrize("every", [[True, False], [True, True], [False, False]])
def test_ranks_that_disagree_on_a_finished_run_are_refused(tmp_path, monkeypatch, every):
    import dptrain.parallel.dist

    monkeypatch.setattr(dptrain.parallel.dist, "one_verdict", lambda e, s, v=None: every)
    if len(set(every)) > 1:
        with pytest.raises(ConfigError, match="rank 0 sees a finished run"):
            cmd._agree_on_look(tmp_path, True, None)
    else:
        assert cmd._agree_on_look(tmp_path, every[0], None) is every[0]


@pytest.mark.parametrize("key", ["resume", "output-dir", "dry-run"])
def test_ranks_that_start_differently_are_refused_naming_the_option(tmp_path, monkeypatch, key):
    import torch.distributed as dist

    def all_gather_object(every, mine):
        every[:] = [mine, {**mine, key: "other"}]

    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
    with pytest.raises(ConfigError, match="rank 1 starts with 'other'") as e:
        cmd._check_ranks_agree_on_start(_args(), tmp_path)
    assert e.value.field == key


# -- the secure-resume record -----------------------------------------------------------------

def test_a_second_secure_branch_is_refused_and_a_resume_is_recorded_once(tmp_path):
    step2 = _checkpoint(tmp_path / "src", 2)
    into = tmp_path / "branch"
    cmd._record_secure_resume(step2, into, write=True)
    cmd._record_secure_resume(step2, into, write=True)  # (the same branch again: one row)
    assert len(_rows(tmp_path / "src" / cmd.SECURE_RESUMES)) == 1
    cmd._check_secure_branch(step2, into)  # its own branch continues
    with pytest.raises(ConfigError, match=f"already resumed into {into.resolve()}"):
        cmd._check_secure_branch(step2, tmp_path / "another")
