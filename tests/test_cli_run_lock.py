"""One run at a time in an output directory: rank 0 holds ``run.lock`` (flock) while it runs.

Two runs started into one directory both passed the "holds a run" check (it looks at files the
other had not written yet), and one then crashed when the other removed its temporary
checkpoint; a ``--resume auto`` next to a live run would have continued it as a second writer.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dptrain.cli import main

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")
HOLD = ("import fcntl, json, os, sys, time\n"
        "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX)\n"
        "os.ftruncate(fd, 0)\n"
        "os.write(fd, json.dumps({'host': 'node7', 'pid': os.getpid(), 'since': 'then'})"
        ".encode())\n"
        "print('held', flush=True)\n"
        "time.sleep(120)\n")


def _cli(capsys, out: Path, *args) -> tuple[int, str]:
    code = main(["train", "--config", TINY, "--output-dir", str(out), "train.progress=false",
                 *args])
    return code, capsys.readouterr().err


def _snapshot(directory: Path) -> dict:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*"))
            if p.is_file()}


@pytest.fixture
def held(tmp_path):
    """A directory holding a run's checkpoints whose lock another process holds."""
    out = tmp_path / "run"
    code = main(["train", "--config", TINY, "--output-dir", str(out), "privacy.steps=4"])
    assert code == 0
    (out / "summary.json").unlink()  # an unfinished run, as one in progress looks
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(out / "run.lock")],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    yield out, proc
    proc.kill()
    proc.wait()


@pytest.mark.parametrize("args", [("--resume", "auto"), (), ("--resume", "auto", "--dry-run"),
                                  ("--dry-run",)])
def test_a_directory_another_run_holds_is_refused_before_anything_is_read_or_written(
        held, capsys, args):
    out, proc = held
    capsys.readouterr()
    before = _snapshot(out)
    code, err = _cli(capsys, out, *args)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, err
    assert "output-dir" in lines[0] and "in use by another run" in lines[0]
    assert f"pid {proc.pid} on node7" in lines[0]  # who holds it, from the lock file
    assert _snapshot(out) == before  # the holder's lock file too


def test_a_lock_whose_holder_died_is_no_lock(held, capsys):
    out, proc = held
    proc.send_signal(signal.SIGKILL)  # a preempted node: nothing removes the file
    proc.wait()
    assert (out / "run.lock").exists()
    code, err = _cli(capsys, out, "--resume", "auto")
    assert code == 0, err
    assert "resumed from" in err and (out / "summary.json").exists()
    holder = json.loads((out / "run.lock").read_text())
    assert holder["pid"] == os.getpid() and holder["host"] != "node7"


def test_the_lock_is_held_while_the_run_trains_and_released_after(tmp_path, capsys,
                                                                  monkeypatch):
    import dptrain.trainer as trainer_module

    out = tmp_path / "run"
    seen = []
    real = trainer_module.Trainer.run

    def run(self):
        fd = os.open(out / "run.lock", os.O_RDONLY)  # another open file: another holder
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            seen.append("free")
        except BlockingIOError:
            seen.append("held")
        finally:
            os.close(fd)
        return real(self)

    monkeypatch.setattr(trainer_module.Trainer, "run", run)
    code, err = _cli(capsys, out)
    assert code == 0 and seen == ["held"], err
    fd = os.open(out / "run.lock", os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released when the command returned
    finally:
        os.close(fd)
    code, err = _cli(capsys, out, "--resume", "auto")  # the same process, again
    assert code == 0 and "nothing to do" in err


def test_a_stopped_run_releases_its_lock(tmp_path):
    """SIGTERM mid-run: exit 143 with a checkpoint, and the lock goes with the process."""
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "dptrain", "train", "--config", TINY, "--output-dir", str(out),
           "privacy.steps=400", "train.checkpoint_every=50"]
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (out / "metrics.jsonl").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    fd = os.open(out / "run.lock", os.O_RDONLY)
    try:
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 143, err
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    finally:
        os.close(fd)


def test_a_file_system_that_cannot_lock_is_warned_about_and_the_run_goes_on(
        tmp_path, capsys, monkeypatch):
    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    out = tmp_path / "run"
    code, err = _cli(capsys, out)
    assert code == 0, err
    assert "cannot lock files" in err and "would not be refused" in err
    assert (out / "summary.json").exists()


def test_another_lock_error_is_one_line_naming_the_output_dir(tmp_path, capsys, monkeypatch):
    def denied(fd, op):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(fcntl, "flock", denied)
    out = tmp_path / "run"
    code, err = _cli(capsys, out)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "output-dir" in lines[0], err
    assert "cannot lock" in lines[0] and not (out / "metrics.jsonl").exists()


def test_a_dry_run_of_a_new_directory_creates_nothing(tmp_path, capsys):
    out = tmp_path / "new"
    code, err = _cli(capsys, out, "--dry-run")
    assert code == 0, err
    assert not out.exists()


def test_only_rank_0_locks(tmp_path):
    from dptrain.commands.train import _run_lock

    out = tmp_path / "run"
    with _run_lock(out, rank=1):
        assert not out.exists()
    with _run_lock(out, rank=0):
        with pytest.raises(Exception, match="in use by another run"):
            with _run_lock(out, rank=0):
                pass
    with _run_lock(out, rank=0):  # released on the way out
        pass


def test_a_lock_file_that_is_a_link_or_not_a_file_is_refused_and_nothing_is_overwritten(
        tmp_path, capsys):
    # os.open followed the link: the holder's line replaced the target's contents (red team)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious data")
    for make in ("link", "link to /dev/null", "fifo"):
        out = tmp_path / make.replace(" ", "_").replace("/", "")
        out.mkdir()
        if make == "link":
            (out / "run.lock").symlink_to(victim)
        elif make == "fifo":
            os.mkfifo(out / "run.lock")
        else:
            (out / "run.lock").symlink_to("/dev/null")
        for args in ((), ("--dry-run",)):
            code, err = _cli(capsys, out, *args)
            lines = [line for line in err.splitlines() if line.strip()]
            assert code == 2 and len(lines) == 1 and "output-dir" in lines[0], err
            # (a link to a file: the lock's own check; to a device, a FIFO: the layout's)
            assert ("symbolic link" if make == "link" else "exists and is not a file") \
                in lines[0]
    assert victim.read_text() == "precious data"


def test_a_lock_held_for_a_moment_is_waited_for(tmp_path):
    # a dry run's shared probe made a real start that met it fail as "in use" (red team)
    import threading

    from dptrain.commands.train import LOCK_WAIT_S, _run_lock

    out = tmp_path / "run"
    out.mkdir()
    (out / "run.lock").write_text("")
    fd = os.open(out / "run.lock", os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH)
    threading.Timer(LOCK_WAIT_S / 4, os.close, (fd,)).start()  # the probe ends
    with _run_lock(out, rank=0):
        holder = json.loads((out / "run.lock").read_text())
    assert holder["pid"] == os.getpid()
    assert not (out / "run.lock").exists()  # a start that never began: it named no one


def _start_where_another_holds(rank: int, world: int, out: str) -> tuple[int, list[str]]:
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["train", "--config", TINY, "--output-dir", out, "train.progress=false"])
    return code, [line for line in err.getvalue().splitlines() if "error:" in line]


def test_every_rank_of_a_refused_run_is_refused(held):
    # only rank 0 took the lock, so only rank 0 was refused: without torchrun's agent the
    # others waited for it until the collective timeout (red team)
    from dptrain.parallel.dist import spawn

    out, proc = held
    got = spawn(_start_where_another_holds, 2, str(out), timeout=240)
    assert [code for code, _ in got] == [2, 2] and not got[1][1], got  # (said once, by rank 0)
    (line,) = got[0][1]
    assert "output-dir" in line and "in use by another run" in line
    assert f"pid {proc.pid} on node7" in line


def test_an_output_dir_that_is_a_link_to_nothing_is_one_line(tmp_path, capsys):
    # the lock's folder could not be made: "cannot lock ...: it keeps being removed or
    # replaced" after eight tries (red team); the dry run passed
    out = tmp_path / "out"
    out.symlink_to(tmp_path / "nowhere" / "x")
    for args in ((), ("--dry-run",)):
        code, err = _cli(capsys, out, *args)
        lines = [line for line in err.splitlines() if line.strip()]
        assert code == 2 and len(lines) == 1 and "symbolic link to nothing" in lines[0], err
    assert out.is_symlink() and not (tmp_path / "nowhere").exists()


@pytest.mark.parametrize("finished, args, rc", [
    (True, (), 2), (True, ("--resume", "auto", "privacy.epsilon=1"), 2),
    (False, ("--resume", "auto", "privacy.epsilon=1"), 2), (True, ("--resume", "auto"), 0)],
    ids=["finished run, no --resume", "changed setting, finished",
         "changed setting against a checkpoint", "nothing to do"])
def test_a_start_that_does_not_begin_leaves_the_lock_file_as_it_was(tmp_path, capsys, finished,
                                                                    args, rc):
    """A start refused by its checks (on the directory, or on the checkpoint it loads) took
    the lock and wrote its own name over the last run's in run.lock: it puts the line back,
    and every file of the run stays as it was."""
    out = tmp_path / "run"
    assert _cli(capsys, out, "privacy.steps=2")[0] == 0
    assert json.loads((out / "run.lock").read_text())["pid"] == os.getpid()
    if not finished:
        (out / "summary.json").unlink()
    (out / "run.lock").write_text('{"host": "node7", "pid": 1, "since": "then"}\n')
    before = _snapshot(out)
    code, err = _cli(capsys, out, "privacy.steps=2", *args)
    assert code == rc and len(err.strip().splitlines()) == 1, err
    assert _snapshot(out) == before


def _unfinished_run(capsys, run: Path) -> dict:
    assert _cli(capsys, run, "privacy.steps=2")[0] == 0
    (run / "summary.json").unlink()  # unfinished: its pruning is still to come
    return _snapshot(run)


def _refused(capsys, out: Path, *words: str) -> None:
    code, err = _cli(capsys, out, "privacy.steps=1")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith("dptrain train: error: output-dir") and all(
        w in lines[0] for w in words), lines[0]


@pytest.mark.parametrize("inside", ["checkpoints/step-00000001", "checkpoints", "final",
                                    "final/sub"])
def test_an_output_dir_inside_another_runs_folders_is_refused(tmp_path, capsys, inside):
    """A run started in another run's checkpoint, checkpoints/ or final/ was accepted, and
    that run's pruning (or its final model's replacement) deleted the new run's outputs."""
    run = tmp_path / "run"
    before = _unfinished_run(capsys, run)
    for link in (False, True)[:1 + (inside != "final/sub")]:  # the folder, or a link to it
        target = run / inside
        out = target
        if link:
            out = tmp_path / f"link-{inside.replace('/', '-')}"
            out.symlink_to(target, target_is_directory=True)
        _refused(capsys, out, f"{run}'s {inside.split('/')[0]}/")
        assert _snapshot(run) == before
        assert not target.exists() or target.is_dir() and inside != "final/sub"


def test_an_output_dir_in_a_run_s_linked_checkpoints_or_a_starting_run_is_refused(tmp_path,
                                                                                  capsys):
    # checkpoints/ a link to scratch storage: the run prunes the link's target
    run, store = tmp_path / "run", tmp_path / "store"
    store.mkdir()
    run.mkdir()
    (run / "checkpoints").symlink_to(store, target_is_directory=True)
    _unfinished_run(capsys, run)
    _refused(capsys, run / "checkpoints" / "new", "checkpoints/")
    # a run that holds its lock and has written nothing else yet (building its model)
    starting = tmp_path / "starting"
    starting.mkdir()
    (starting / "run.lock").write_text('{"host": "node7", "pid": 1, "since": "then"}\n')
    _refused(capsys, starting / "final" / "sub", f"{starting}'s final/")
    assert sorted(p.name for p in starting.iterdir()) == ["run.lock"]
    # an empty one names no one (left where the file system cannot lock): no run
    (starting / "run.lock").write_text("")
    code, err = _cli(capsys, starting / "final" / "sub", "privacy.steps=1", "--dry-run")
    assert code == 0, err


def test_a_run_whose_folders_hold_another_run_is_refused(tmp_path, capsys):
    """The other order: a run in X/final/sub first, then one in X, whose final model would
    replace X/final (and the run in it)."""
    inner = tmp_path / "X" / "final" / "sub"
    assert _cli(capsys, inner, "privacy.steps=1")[0] == 0
    before = _snapshot(tmp_path / "X")
    for args in ((), ("--resume", "auto")):
        code, err = _cli(capsys, tmp_path / "X", "privacy.steps=1", *args)
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and "output-dir" in lines[0], err
        assert "final/ folder holds another run's files" in lines[0]
        assert _snapshot(tmp_path / "X") == before


def test_a_start_that_fails_before_its_checks_lets_go_of_the_lock_as_it_was(tmp_path,
                                                                           monkeypatch):
    """Rank 0 named itself in run.lock, then the ranks' shared verdict failed (another rank
    lost, a timeout), or naming itself failed (a full disk): the lock was kept, the file named
    a dead start, and a new folder stayed behind as "a starting run"."""
    import dptrain.commands.train as train_module
    import dptrain.parallel.dist as dist_module
    from dptrain.commands.train import _run_lock

    line = '{"host": "node7", "pid": 1, "since": "then"}\n'

    from dptrain.config import ConfigError

    def lost(*args, **kwargs):
        raise RuntimeError("Connection reset by peer")

    def full(fd, path):
        os.ftruncate(fd, 0)
        raise ConfigError("output-dir", f"cannot write {path}: No space left on device")

    for where, fail, error in ((dist_module, "one_verdict", RuntimeError),
                               (train_module, "_claim", ConfigError)):
        with monkeypatch.context() as m:
            m.setattr(where, fail, lost if fail == "one_verdict" else full)
            old = tmp_path / f"old-{fail}"
            old.mkdir()
            (old / "run.lock").write_text(line)
            new = tmp_path / f"new-{fail}" / "run"
            for out in (old, new):
                with pytest.raises(error):
                    with _run_lock(out, rank=0, shared=fail == "one_verdict"):
                        pass
        assert (old / "run.lock").read_text() == line
        assert not (tmp_path / f"new-{fail}").exists()
        fd = os.open(old / "run.lock", os.O_RDONLY)  # let go of
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)


def test_output_dir_checks_that_must_not_refuse_or_crash(tmp_path, capsys):
    # a report named summary.json, alone, is no run: its folder's final/ is the user's
    res = tmp_path / "res"
    res.mkdir()
    (res / "summary.json").write_text('{"x": 1}')
    code, err = _cli(capsys, res / "final", "privacy.steps=1", "--dry-run")
    assert code == 0, err
    # an empty run.lock below a folder's checkpoints/ names no run
    (tmp_path / "X" / "checkpoints" / "sub").mkdir(parents=True)
    (tmp_path / "X" / "checkpoints" / "sub" / "run.lock").write_text("")
    code, err = _cli(capsys, tmp_path / "X", "privacy.steps=1", "--dry-run")
    assert code == 0, err
    # a loop of links: one line naming output-dir, no traceback
    (tmp_path / "loop1").symlink_to(tmp_path / "loop2")
    (tmp_path / "loop2").symlink_to(tmp_path / "loop1")
    for out in (tmp_path / "loop1", tmp_path / "loop1" / "sub"):
        code, err = _cli(capsys, out, "privacy.steps=1")
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and "output-dir" in lines[0], err


def test_a_refused_start_into_an_existing_folder_removes_the_lock_file_it_made(tmp_path, capsys):
    """An empty run.lock left behind made a user's folder "a starting run" for good: other
    runs and plots inside its checkpoints/ or final/ were refused."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("mine")
    code, err = _cli(capsys, work, "--resume", str(tmp_path / "nothing"))
    assert code == 2 and "resume" in err
    assert sorted(p.name for p in work.iterdir()) == ["notes.txt"]
    assert _cli(capsys, work / "checkpoints" / "run1", "privacy.steps=1")[0] == 0


def test_a_plot_into_a_run_s_linked_checkpoints_is_refused(tmp_path, capsys):
    run, store = tmp_path / "run", tmp_path / "store"
    store.mkdir()
    run.mkdir()
    (run / "checkpoints").symlink_to(store, target_is_directory=True)
    assert _cli(capsys, run, "privacy.steps=1")[0] == 0
    code = main(["plot", "--run", str(run), "--output", str(run / "checkpoints" / "m.png")])
    err = capsys.readouterr().err
    assert code == 2 and "--output" in err and "checkpoints/ folder" in err, err
    assert not (store / "m.png").exists()


@pytest.mark.parametrize("folder", ["checkpoints", "final"])
def test_an_output_dir_reaching_another_runs_folders_through_a_link_and_dotdot_is_refused(
        tmp_path, capsys, folder):
    """Red-team: ``in_run_folder`` collapses '..' lexically (``os.path.abspath``) before it
    resolves links, so LINK/../checkpoints/step-N, with LINK a link to a run's checkpoints/
    (LINK/.. is the run itself), looked like CWD/checkpoints/step-N: the start was accepted,
    the new run was made inside the other run's checkpoints/ (or final/), and that run's
    pruning of "later" step directories deleted the new run whole."""
    run = tmp_path / "run"
    before = _unfinished_run(capsys, run)
    link = tmp_path / "link"
    link.symlink_to(run / "checkpoints", target_is_directory=True)
    out = Path(f"{link}/../{folder}/step-00000099")
    _refused(capsys, out, f"{folder}/")
    assert not (run / folder / "step-00000099").exists()
    assert _snapshot(run) == before


def test_resume_auto_through_a_checkpoints_link_into_another_run_is_refused(tmp_path, capsys):
    """Red-team: run/checkpoints a link to ANOTHER run's checkpoints/ (two runs' links copied
    to one folder). A fresh start is refused as "holds an unfinished run; pass --resume auto",
    and --resume auto then resumed the other run's checkpoint, wrote its own checkpoints into
    that run's folder and pruned the other run's checkpoints (keep_checkpoints)."""
    other = tmp_path / "other"
    assert _cli(capsys, other, "privacy.steps=2", "train.keep_checkpoints=5")[0] == 0
    (other / "summary.json").unlink()  # an unfinished run (stopped, to be resumed)
    before = _snapshot(other)
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoints").symlink_to(other / "checkpoints", target_is_directory=True)
    code, err = _cli(capsys, run, "privacy.steps=2", "train.keep_checkpoints=1",
                     "--resume", "auto")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "output-dir" in lines[0], err
    assert _snapshot(other) == before


def test_resume_auto_through_a_final_link_into_another_run_is_refused(tmp_path, capsys):
    """Red-team: run/final a link to a finished run's final/. Without --resume the start is
    refused (final/ holds files); with --resume auto (a requeue script's line) it found no
    checkpoint, "started afresh" and replaced the finished run's final/model.safetensors,
    which that run's summary.json describes."""
    other = tmp_path / "other"
    assert _cli(capsys, other, "privacy.steps=1", "train.checkpoint_every=0")[0] == 0
    before = _snapshot(other)
    run = tmp_path / "run"
    run.mkdir()
    (run / "final").symlink_to(other / "final", target_is_directory=True)
    code, err = _cli(capsys, run, "privacy.steps=1", "seed=5", "--resume", "auto")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "output-dir" in lines[0], err
    assert _snapshot(other) == before


def test_a_run_still_building_its_model_owns_its_file_names(tmp_path):
    # only its lock so far (it writes the rest later): another command's --output
    # DIR/summary.json --force was let in, and the run then overwrote the report
    from dptrain.commands import LOCK, run_owned

    run = tmp_path / "run"
    run.mkdir()
    (run / LOCK).write_text("")  # an empty lock names no run (a file system without locks)
    assert run_owned(run / "summary.json") is None
    (run / LOCK).write_text("pid 123 on host since 2026-12-07T10:00:00Z\n")
    assert "run's own file" in run_owned(run / "summary.json")
    assert run_owned(run / "report.json") is None
