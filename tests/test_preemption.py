"""SIGTERM (preemption) stops `dptrain train` at a step boundary with a checkpoint, on every rank
at the same step (a repeated SIGTERM does not cut it short); `--resume auto` then continues to
the same final model as an uninterrupted run, bit for bit."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch

from dptrain import checkpoint as ckpt
from dptrain.cli import main
from dptrain.commands.train import STOP_SIGNALS, _stop_on_signals
from dptrain.config import load
from dptrain.privacy.accounting import Ledger
from dptrain.trainer import RunConfig, StopRequested, Trainer

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")
# dropout and inner momentum: the RNG streams and the history must survive the stop too
ARGS = ["train.progress=false", "privacy.steps=8", "train.log_every=1", "model.dropout=0.1",
        "optim.inner_momentum.k_muon=2", "optim.inner_momentum.gamma_muon=0.9",
        "train.checkpoint_every=0"]


@pytest.fixture
def stop_handlers():
    """This process's handlers of the stop signals, put back afterwards (a stopped run leaves
    them ignored, which would outlive the test in the worker)."""
    before = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    yield
    for s, handler in before.items():
        signal.signal(s, handler)


def _steps_logged(out: Path) -> list[int]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(x)["step"] for x in path.read_text().splitlines() if x.strip()]


@pytest.mark.slow
def test_sigterm_checkpoints_the_last_step_and_resume_is_bit_for_bit(tmp_path, capsys):
    from safetensors.torch import load_file

    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "dptrain", "train", "--config", TINY, "--output-dir", str(out),
           *ARGS]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    try:
        end = time.time() + 300
        while not _steps_logged(out) and proc.poll() is None and time.time() < end:
            time.sleep(0.01)
        assert proc.poll() is None, proc.stderr.read()
        # twice, as a rank under Slurm may get it (slurmstepd and torchrun's agent): the second
        # must not cut the stop short
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.05)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, err
    # checkpoint_every=0: the one checkpoint is the stop's, of the last finished step
    (only,) = sorted((out / "checkpoints").glob("step-*"))
    k = int(only.name[5:])
    assert 1 <= k < 8
    assert ckpt.verify(only) is None
    state = ckpt.read(only)
    assert state["step"] == Ledger.from_dict(state["ledger"]).num_releases == k
    assert f"stopped after step {k} of 8" in err and "--resume auto" in err
    assert _steps_logged(out) == list(range(1, k + 1))
    assert not (out / "summary.json").exists() and not (out / "final").exists()

    assert main(["train", "--config", TINY, "--output-dir", str(out), "--resume", "auto",
                 *ARGS]) == 0
    ref = tmp_path / "ref"
    assert main(["train", "--config", TINY, "--output-dir", str(ref), *ARGS]) == 0
    capsys.readouterr()
    want = load_file(str(ref / "final" / "model.safetensors"))
    got = load_file(str(out / "final" / "model.safetensors"))
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(want[name], got[name]), name
    assert _steps_logged(out) == list(range(1, 9))


def _stop_on_one_rank(rank: int, world: int, out: str, stop_rank: int) -> tuple:
    """Rank ``stop_rank`` alone (-1: every rank, as a scheduler sends it) gets the stop request,
    during step 2."""
    from dptrain.config import load
    from dptrain.trainer import RunConfig, StopRequested, Trainer

    t = Trainer(load(RunConfig, TINY, ["train.progress=false", "privacy.accountant=rdp",
                                       "performance.sharding=fsdp", *ARGS]), out)
    step = t.private_step

    def private_step():
        if stop_rank in (rank, -1) and t.step == 1:
            t.stop_signal = signal.SIGTERM
        return step()

    t.private_step = private_step
    try:
        t.run()
    except StopRequested as e:
        return e.step, e.signum, None if e.checkpoint is None else str(e.checkpoint)
    return t.step, None, None


def _stop_in_final_evaluation_on_one_rank(rank: int, world: int, out: str) -> tuple:
    """Rank 1 alone gets the stop request, during the second test batch of the final
    evaluation of a 2-rank FSDP run."""
    from dptrain.config import load
    from dptrain.trainer import RunConfig, StopRequested, Trainer

    t = Trainer(load(RunConfig, TINY, ["train.progress=false", "privacy.accountant=rdp",
                                       "performance.sharding=fsdp", "train.eval_batch_size=8",
                                       *ARGS[:2], "privacy.steps=2", "train.checkpoint_every=0"]),
                out)
    collated = _stop_in_evaluation(t, 2, 1) if rank == 1 else _stop_in_evaluation(t, 2, 99)
    try:
        t.run()
    except StopRequested as e:
        return e.step, e.signum, None if e.checkpoint is None else str(e.checkpoint), collated
    return t.step, None, None, collated


def _stop_after_step(t: Trainer, k: int) -> None:
    """A SIGTERM request arrives while step ``k`` runs (seen at the boundary after it)."""
    real_step = t.private_step

    def private_step():
        row = real_step()
        if t.step == k:
            t.stop_signal = signal.SIGTERM
        return row

    t.private_step = private_step


@pytest.mark.distributed
@pytest.mark.parametrize("stop_rank", [1, -1])  # not rank 0 alone, which writes the checkpoint
# metadata; -1: every rank, whose agreed signal is SIGTERM itself (a SUM of the ranks' signal
# numbers, 2 x 15, read as SIGUSR1)
def test_a_stop_seen_by_one_rank_stops_every_rank_at_the_same_step(tmp_path, stop_rank):
    from dptrain.parallel.dist import spawn

    out = tmp_path / "run"
    got = spawn(_stop_on_one_rank, 2, str(out), stop_rank, timeout=180)
    assert [g[:2] for g in got] == [(2, signal.SIGTERM), (2, signal.SIGTERM)]
    assert got[0][2] == str(out / "checkpoints" / "step-00000002")  # the path, on rank 0
    (only,) = sorted((out / "checkpoints").glob("step-*"))
    assert only.name == "step-00000002" and ckpt.verify(only) is None
    assert ckpt.read(only)["step"] == 2
    assert _steps_logged(out) == [1, 2]


def _cli_stop_on_rank_1(rank: int, world: int, out: str) -> tuple:
    """``dptrain train`` on each rank, rank 1 alone asked to stop during step 2: the exit
    status and whether a stop signal would still kill this rank as it exits."""
    real_step = Trainer.private_step

    def private_step(self):
        if rank == 1 and self.step == 1:
            self.stop_signal = signal.SIGTERM
        return real_step(self)

    Trainer.private_step = private_step
    code = main(["train", "--config", TINY, "--output-dir", out, "privacy.accountant=rdp",
                 "performance.sharding=fsdp", *ARGS])
    return code, [signal.getsignal(s) == signal.SIG_IGN for s in STOP_SIGNALS]


@pytest.mark.distributed
def test_a_rank_stopped_by_another_s_signal_ignores_the_launcher_s_sigterm(tmp_path):
    # rank 1 alone gets the SIGTERM, exits 143 after the checkpoint, and torchrun then sends
    # SIGTERM to rank 0: rank 0 (which saw no signal itself) must keep ignoring it, or it died
    # of it (-15) instead of exiting 143
    from dptrain.parallel.dist import spawn

    out = tmp_path / "run"
    got = spawn(_cli_stop_on_rank_1, 2, str(out), timeout=240)
    assert got == [(143, [True, True]), (143, [True, True])]
    assert [p.name for p in (out / "checkpoints").glob("step-*")] == ["step-00000002"]


@pytest.mark.distributed
def test_a_stop_seen_by_one_rank_in_the_final_evaluation_stops_every_rank_there(tmp_path):
    # the ranks agree before each test batch (FSDP2's forwards are collective): both stop
    # before the third, and write one sharded checkpoint of the last step
    from dptrain.parallel.dist import spawn

    out = tmp_path / "run"
    got = spawn(_stop_in_final_evaluation_on_one_rank, 2, str(out), timeout=180)
    assert [g[:2] for g in got] == [(2, signal.SIGTERM), (2, signal.SIGTERM)]
    assert [g[3] for g in got] == [[2, 2], [2, 2]]
    (only,) = sorted((out / "checkpoints").glob("step-*"))
    assert got[0][2] == str(only) and only.name == "step-00000002"
    assert ckpt.verify(only) is None and not (out / "summary.json").exists()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
@pytest.mark.parametrize("stopped", [False, True])
def test_a_stop_signal_after_the_stop_cannot_kill_the_exit(stopped, sig, stop_handlers):
    # the stop's checkpoint is written and the process is about to exit 143: a repeated SIGTERM
    # (Slurm's slurmstepd and torchrun's agent both send one), or any stop signal, arriving then
    # is ignored; a run that did not stop gets its previous handlers back
    from types import SimpleNamespace

    assert set(STOP_SIGNALS) == {signal.SIGTERM, signal.SIGUSR1}
    mine = lambda signum, frame: None  # noqa: E731
    for s in STOP_SIGNALS:
        signal.signal(s, mine)
    trainer = SimpleNamespace(stop_signal=None, rank=1)
    with _stop_on_signals(trainer):
        assert all(signal.getsignal(s) not in (mine, signal.SIG_IGN) for s in STOP_SIGNALS)
        if stopped:
            os.kill(os.getpid(), sig)  # the handler records the stop
            time.sleep(0.01)
    assert trainer.stop_signal == (sig if stopped else None)
    for s in STOP_SIGNALS:
        assert signal.getsignal(s) is (signal.SIG_IGN if stopped else mine), s


def test_sigusr1_stops_a_run_with_a_checkpoint_and_exit_138(tmp_path, capsys, monkeypatch,
                                                            stop_handlers):
    # clusters set up for PyTorch Lightning send SIGUSR1 before the time limit
    out = tmp_path / "run"
    real = Trainer.private_step

    def private_step(self):
        if self.step == 1:  # during step 2: it finishes, then the run stops
            os.kill(os.getpid(), signal.SIGUSR1)
        return real(self)

    monkeypatch.setattr(Trainer, "private_step", private_step)
    code = main(["train", "--config", TINY, "--output-dir", str(out), "privacy.steps=4",
                 "train.progress=false", "train.checkpoint_every=0"])
    err = capsys.readouterr().err
    assert code == 128 + signal.SIGUSR1 == 138, err
    assert "SIGUSR1 received" in err and "SIGUSR1: stopped after step 2 of 4" in err
    assert ckpt.complete_steps(out) == [2] and _steps_logged(out) == [1, 2]
    assert not (out / "summary.json").exists()


@pytest.mark.parametrize("resume", [False, True])
def test_a_stop_signal_during_start_up_stops_at_the_first_boundary(tmp_path, capsys, monkeypatch,
                                                                   resume, stop_handlers):
    # while the data and the model are built (or a checkpoint is loaded): before this, the
    # default action killed the process with the same exit status and no word
    out = tmp_path / "run"
    args = ["train", "--config", TINY, "--output-dir", str(out), "privacy.steps=4",
            "train.progress=false"]
    if resume:  # a run killed after step 3: its newest checkpoint is step 2's
        assert main([*args, "train.checkpoint_every=2"]) == 0
        (out / "summary.json").unlink()
        shutil.rmtree(out / "checkpoints" / "step-00000004")
        shutil.rmtree(out / "final")
    real_init = Trainer.__init__

    def init(self, *a, **k):
        os.kill(os.getpid(), signal.SIGUSR1)
        real_init(self, *a, **k)

    monkeypatch.setattr(Trainer, "__init__", init)
    capsys.readouterr()
    code = main([*args, *(["--resume", "auto", "train.checkpoint_every=2"] if resume else [])])
    err = capsys.readouterr().err
    assert code == 128 + signal.SIGUSR1, err
    # after the stop, a late stop signal cannot kill the exit
    assert all(signal.getsignal(s) == signal.SIG_IGN for s in STOP_SIGNALS)
    assert "SIGUSR1 received" in err
    if resume:  # at the run's own newest checkpoint: no second one, no step drawn again
        assert "stopped after step 2 of 4 (its checkpoint in" in err
        assert ckpt.complete_steps(out) == [2] and _steps_logged(out) == [1, 2]
    else:
        assert "stopped after step 0 of 4 (nothing to keep)" in err
        assert not (out / "checkpoints").exists() and _steps_logged(out) == []


def test_a_branch_stopped_before_its_first_step_writes_the_checkpoint_it_resumed(tmp_path):
    # resumed from another run's checkpoint into a new directory and stopped at once: "continue
    # with --resume auto" needs a checkpoint there, or the branch would start from step 0
    from dptrain.config import load
    from dptrain.trainer import RunConfig, StopRequested, Trainer

    args = ["train.progress=false", "privacy.accountant=rdp", "privacy.steps=4",
            "train.checkpoint_every=2"]
    first = Trainer(load(RunConfig, TINY, args), tmp_path / "a")
    first.private_step()
    first.private_step()
    source = ckpt.save(first, tmp_path / "a")
    branch = Trainer(load(RunConfig, TINY, args), tmp_path / "b")
    ckpt.load(branch, source)
    branch.stop_signal = signal.SIGTERM
    with pytest.raises(StopRequested) as e:
        branch.run()
    assert e.value.step == 2 and e.value.checkpoint is not None
    assert ckpt.find_latest(tmp_path / "b") == tmp_path / "b" / "checkpoints" / "step-00000002"


def test_repeated_sigterms_are_one_stop_request_said_once(capsys, stop_handlers):
    # under Slurm a rank gets the same SIGTERM twice (slurmstepd and torchrun's agent): the
    # second one neither repeats the notice nor changes the request
    trainer = types.SimpleNamespace(stop_signal=None, rank=0)
    with _stop_on_signals(trainer):
        for _ in range(2):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)  # the handler runs in the main thread between bytecodes
        assert trainer.stop_signal == signal.SIGTERM
    # after a stop, a late SIGTERM is ignored (it must not kill the 143 exit)
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
    err = capsys.readouterr().err
    assert err.count("SIGTERM received") == 1, err


def test_a_stop_right_after_a_checkpoint_writes_no_second_one(tmp_path, monkeypatch):
    # checkpoint_every 1: step 2's checkpoint is written in the loop; a stop requested during
    # step 2 stops at the next boundary with that checkpoint, without writing step 2 again
    t = Trainer(load(RunConfig, TINY, ["train.progress=false", "privacy.epsilon=null",
                                       "privacy.noise_multiplier=1.1",
                                       "train.checkpoint_every=1"]), tmp_path)
    saves = []
    real_save = ckpt.save

    def save(trainer, out):
        saves.append(trainer.step)
        return real_save(trainer, out)

    monkeypatch.setattr(ckpt, "save", save)
    _stop_after_step(t, 2)
    with pytest.raises(StopRequested) as e:
        t.run()
    assert e.value.step == 2 and saves == [1, 2]
    assert ckpt.step_of(e.value.checkpoint) == 2


def test_a_stop_during_the_last_step_checkpoints_it_before_the_final_evaluation(tmp_path,
                                                                                capsys):
    # checkpoint_every 0: the stop was once seen only at the top of a step, so one during the
    # last step went on into the final evaluation and export with no checkpoint at all (a
    # scheduler's SIGKILL there lost every step)
    over = ["train.progress=false", "privacy.epsilon=null", "privacy.noise_multiplier=1.1",
            "privacy.steps=3", "train.checkpoint_every=0"]
    t = Trainer(load(RunConfig, TINY, over), tmp_path)
    _stop_after_step(t, 3)
    with pytest.raises(StopRequested) as e:
        t.run()
    assert e.value.step == 3 and ckpt.step_of(e.value.checkpoint) == 3
    assert not (tmp_path / "summary.json").exists() and _steps_logged(tmp_path) == [1, 2, 3]
    # the resume has no step left: the final evaluation and export only
    assert main(["train", "--config", TINY, "--output-dir", str(tmp_path), "--resume", "auto",
                 *over]) == 0
    capsys.readouterr()
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 3
    assert _steps_logged(tmp_path) == [1, 2, 3]


def test_secure_mode_without_checkpoints_writes_the_last_step_s_before_its_rows(tmp_path,
                                                                              monkeypatch):
    # its rows are held until a checkpoint covers them; with checkpoint_every 0 they were
    # written before the final evaluation with none, so a kill during it left a run that
    # every resume refuses (rows of releases after step 0)
    over = ["train.progress=false", "privacy.epsilon=null", "privacy.noise_multiplier=1.1",
            "privacy.steps=3", "train.checkpoint_every=0", "privacy.secure_mode=true",
            "privacy.seed=null"]
    t = Trainer(load(RunConfig, TINY, over), tmp_path)
    seen = []

    def evaluate(generate=False, stoppable=False):
        seen.append((ckpt.complete_steps(tmp_path), _steps_logged(tmp_path)))
        raise KeyboardInterrupt  # killed during the final evaluation

    monkeypatch.setattr(t, "evaluate", evaluate)
    with pytest.raises(KeyboardInterrupt):
        t.run()
    (steps, rows), = seen
    assert list(steps) == [3] and rows == [1, 2, 3]


def _stop_in_evaluation(t: Trainer, at_step: int, batch: int) -> list[int]:
    """A SIGTERM request arrives while the test batch ``batch`` (0-based) of the evaluation at
    step ``at_step`` is scored; returns the steps at which test batches were collated."""
    collated = []
    real = t.task.test.collate
    count = {"n": 0}

    def collate(indices):
        if collated and collated[-1] != t.step:
            count["n"] = 0
        collated.append(t.step)
        if t.step == at_step and count["n"] == batch:
            t.stop_signal = signal.SIGTERM
        count["n"] += 1
        return real(indices)

    t.task.test.collate = collate
    return collated


def test_a_stop_during_the_final_evaluation_checkpoints_and_resume_evaluates(tmp_path, capsys):
    # the final evaluation (E2E generation over a test set) can outlast a grace period: a stop
    # there was not acted on, so with checkpoint_every 0 a SIGKILL after it lost every step
    over = ["train.progress=false", "privacy.epsilon=null", "privacy.noise_multiplier=1.1",
            "privacy.steps=3", "train.checkpoint_every=0", "train.eval_batch_size=8"]
    whole = Trainer(load(RunConfig, TINY, over), tmp_path / "whole").run()
    out = tmp_path / "run"
    t = Trainer(load(RunConfig, TINY, over), out)
    collated = _stop_in_evaluation(t, 3, 1)
    with pytest.raises(StopRequested) as e:
        t.run()
    # stopped before the third of 8 test batches, with the last step checkpointed
    assert collated == [3, 3] and e.value.step == 3 and ckpt.step_of(e.value.checkpoint) == 3
    assert not (out / "summary.json").exists() and not (out / "final").exists()
    assert _steps_logged(out) == [1, 2, 3]
    assert main(["train", "--config", TINY, "--output-dir", str(out), "--resume", "auto",
                 *over]) == 0
    capsys.readouterr()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["metrics"] == whole["metrics"]
    # the resume ran no step: its peak is the rows' of the process that ran them (was null)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert summary["peak_memory_gib"] == max(r["peak_memory_gib"] for r in rows) > 0


def test_a_stop_during_an_eval_every_evaluation_drops_it_and_stops_at_its_step(tmp_path):
    over = ["train.progress=false", "privacy.epsilon=null", "privacy.noise_multiplier=1.1",
            "privacy.steps=6", "train.checkpoint_every=0", "train.eval_every=2",
            "train.log_every=1", "train.eval_batch_size=8", "optim.ema_decay=0.5"]
    t = Trainer(load(RunConfig, TINY, over), tmp_path)
    # 8 test batches per evaluation, two per step with the EMA: the stop arrives in the third
    # batch of step 4's second evaluation
    collated = _stop_in_evaluation(t, 4, 10)
    with pytest.raises(StopRequested) as e:
        t.run()
    assert collated == [2] * 16 + [4] * 11
    assert e.value.step == 4 and ckpt.step_of(e.value.checkpoint) == 4
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["step"] for r in rows if any(k.startswith("test_") for k in r)] == [2]


@pytest.mark.parametrize("status", [0, 1, 2])
def test_a_stop_signal_while_a_finished_process_exits_keeps_its_status(status):
    # the process entry point (`dptrain`, `python -m dptrain`): after a command returned 0 (a
    # finished run) or 2 (a refusal), a SIGTERM during the interpreter's shutdown is ignored,
    # so the status stays 0 or 2, not 143; after a failure the default action still applies
    code = ("import atexit, os, signal\n"
            "from dptrain import cli\n"
            "atexit.register(lambda: os.kill(os.getpid(), signal.SIGTERM))\n"
            f"cli.main = lambda argv=None, process_exits=False: {status}\n"
            "cli.entry()\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          timeout=120)
    assert proc.returncode == (status if status != 1 else -signal.SIGTERM), proc.stderr


#: a subprocess's stderr that sends the process SIGTERM as the error line is written
SIGTERM_AS_THE_ERROR_IS_WRITTEN = (
    "import os, signal, sys\n"
    "class Err:\n"
    "    def __init__(self, f): self.f = f\n"
    "    def write(self, t):\n"
    "        if 'error:' in t: os.kill(os.getpid(), signal.SIGTERM)\n"
    "        return self.f.write(t)\n"
    "    def flush(self): self.f.flush()\n"
    "sys.stderr = Err(sys.stderr)\n")


def test_a_refused_rank_killed_by_the_launcher_while_it_prints_still_exits_2(tmp_path):
    # under torchrun a refusal every rank shares is printed by rank 0 alone; the other ranks
    # exit 2 at once, and the agent's SIGTERM to rank 0 killed it (-15) before the line, so
    # nobody said why the job stopped. Here the SIGTERM lands as the line is written.
    code = ("from dptrain import cli\n"
            "from dptrain.commands import train\n"
            "from dptrain.config import ConfigError\n"
            "def refuse(args, stop):\n"
            "    raise ConfigError('model.trainable[0]', \"'x' matches no parameter\")\n"
            "train._run = refuse\n"
            f"{SIGTERM_AS_THE_ERROR_IS_WRITTEN}"
            f"sys.argv = ['dptrain', 'train', '--config', {TINY!r}, '--output-dir', "
            f"{str(tmp_path / 'out')!r}]\n"
            "cli.entry()\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.decode().strip().splitlines() == [
        "dptrain train: error: model.trainable[0]: 'x' matches no parameter"], proc.stderr


@pytest.mark.parametrize("env", [{"RANK": "0", "WORLD_SIZE": "x"},
                                 {"RANK": "0", "WORLD_SIZE": "2",
                                  "ACCELERATE_DYNAMO_BACKEND": "inductor"}])
def test_a_refusal_of_the_launch_environment_killed_while_it_prints_still_exits_2(tmp_path, env):
    # refusals raised before dptrain train's signal handlers (the launch environment's, every
    # rank's alike under accelerate launch) ignore stop signals from the refusal on too
    code = ("from dptrain import cli\n"
            f"{SIGTERM_AS_THE_ERROR_IS_WRITTEN}"
            f"sys.argv = ['dptrain', 'train', '--config', {TINY!r}, '--output-dir', "
            f"{str(tmp_path / 'out')!r}]\n"
            "cli.entry()\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          timeout=120, env={**os.environ, **env})
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.decode().strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dptrain train: error: "), proc.stderr
    assert not (tmp_path / "out").exists()


def test_a_stop_signal_while_a_finished_run_is_torn_down_keeps_status_0(tmp_path):
    # summary.json is written, then the trainer is freed (seconds for a large model) before
    # main returns: a SIGTERM then, here sent by the trainer's own finaliser, killed the
    # finished run with 143
    out = tmp_path / "out"
    code = ("import os, signal, sys\n"
            "from dptrain import cli\n"
            "from dptrain.trainer import Trainer\n"
            "Trainer.__del__ = lambda self: os.kill(os.getpid(), signal.SIGTERM)\n"
            f"sys.argv = ['dptrain', 'train', '--config', {TINY!r}, '--output-dir', "
            f"{str(out)!r}, 'train.progress=false', 'privacy.steps=2']\n"
            "cli.entry()\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    assert (out / "summary.json").is_file()
    assert b"received" not in proc.stderr  # a finished run says nothing of stopping


def test_stop_signals_stay_ignored_after_a_finished_run_when_the_process_exits_next():
    # between the command's return and cli.entry's own SIG_IGN a SIGTERM would kill a
    # finished run with 143: with keep_ignoring the handlers are not restored
    before = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    try:
        for keep, want in ((True, signal.SIG_IGN), (False, None)):
            stop = types.SimpleNamespace(stop_signal=None, rank=0, trainer=None, finished=False)
            with _stop_on_signals(stop, keep_ignoring=keep):
                stop.finished = True
            for sig in STOP_SIGNALS:
                assert signal.getsignal(sig) == (want if want is not None else before[sig])
            for sig in STOP_SIGNALS:
                signal.signal(sig, before[sig])
    finally:
        for sig, h in before.items():
            signal.signal(sig, h)
