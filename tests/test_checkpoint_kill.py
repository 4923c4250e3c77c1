"""SIGKILL a real `dptrain train` process at seeded random moments (one kill lands inside a
checkpoint write), resume with --resume auto until done: the final parameters equal the
uninterrupted run's bit for bit, and after every kill the output directory holds only complete,
loadable checkpoints whose ledgers count exactly the releases behind their parameters. The same
for a 2-rank FSDP run killed inside a sharded (DCP) checkpoint write."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from dptrain import checkpoint as ckpt
from dptrain.cli import main
from dptrain.privacy.accounting import Ledger

pytestmark = pytest.mark.slow  # three process starts (~60-200 s on a loaded 2-core machine)

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")
ARGS = ["train.progress=false", "privacy.steps=4", "model.dropout=0.1",
        "optim.inner_momentum.k_muon=2", "optim.inner_momentum.gamma_muon=0.9"]


def _check_invariants(out: Path) -> int:
    """Every visible checkpoint is complete and loadable, ledger == step; returns newest step."""
    root = out / "checkpoints"
    newest = 0
    for p in sorted(root.glob("step-*")):
        assert ckpt.verify(p) is None, (p, ckpt.verify(p))
        state = ckpt.read(p)
        assert Ledger.from_dict(state["ledger"]).num_releases == state["step"] == int(p.name[5:])
        assert state["optimizer"]["num_steps"] == state["step"]
        newest = state["step"]
    latest = ckpt.find_latest(out)
    assert (latest is None) == (newest == 0)
    return newest


def _assert_same_final_model_and_each_step_logged_once(ref: Path, out: Path) -> None:
    """final/model.safetensors of ``out`` equals ``ref``'s bit for bit; metrics.jsonl of ``out``
    lists steps 1..4 once each."""
    from safetensors.torch import load_file

    want = load_file(str(ref / "final" / "model.safetensors"))
    got = load_file(str(out / "final" / "model.safetensors"))
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k], got[k]), k
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]


def _wait_for(pred, proc, timeout=300.0) -> bool:
    end = time.time() + timeout
    while time.time() < end:
        if pred():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.005)
    raise AssertionError("timed out waiting for the training process")


def test_sigkill_at_random_moments_then_resume_is_bit_for_bit(tmp_path, capsys):
    rng = random.Random(6)
    ref = tmp_path / "ref"
    assert main(["train", "--config", TINY, "--output-dir", str(ref), *ARGS,
                 "train.checkpoint_every=0"]) == 0
    capsys.readouterr()
    out = tmp_path / "run"
    env = {**os.environ, "DPTRAIN_TEST_CHECKPOINT_PAUSE": "0.3"}
    cmd = [sys.executable, "-m", "dptrain", "train", "--config", TINY, "--output-dir", str(out),
           "--resume", "auto", *ARGS, "train.checkpoint_every=1", "train.keep_checkpoints=2"]
    root = out / "checkpoints"
    # kill 1: inside the write of a checkpoint (temp dir present, marker not yet written);
    # kill 2: a random moment after the next checkpoint appeared; then run to the end.
    plans = [("in_write", rng.choice([1, 2])), ("after_step", rng.uniform(0.0, 0.4))]
    kills = 0
    for kind, arg in plans:
        start_step = _check_invariants(out) if root.exists() else 0
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE)
        try:
            if kind == "in_write":
                target = f".tmp-step-{start_step + arg:08d}-"
                hit = _wait_for(lambda: any(p.name.startswith(target) and not
                                            (p / ckpt.MARKER).exists()
                                            for p in root.glob(".tmp-*")), proc)
            else:
                hit = _wait_for(lambda: any(int(p.name[5:]) > start_step
                                            for p in root.glob("step-*")), proc)
                time.sleep(arg)
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                kills += 1
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        _check_invariants(out)
        if kind == "in_write" and hit:
            assert any(p.name.startswith(".tmp-step-") for p in root.glob(".tmp-*"))
    assert kills >= 1
    done = subprocess.run(cmd, cwd=ROOT, env={**env, "DPTRAIN_TEST_CHECKPOINT_PAUSE": "0"},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert _check_invariants(out) == 4
    assert not list(root.glob(".tmp-*"))  # the dead writers' leftovers are cleaned up
    _assert_same_final_model_and_each_step_logged_once(ref, out)
    assert json.loads((out / "summary.json").read_text())["steps"] == 4


def _cli_rank(rank: int, world: int, argv: list[str], pid_dir: str, pause: str) -> int:
    """One rank of `dptrain train` (spawn has joined the process group already)."""
    Path(pid_dir, f"{rank}.pid").write_text(str(os.getpid()))
    os.environ["DPTRAIN_TEST_CHECKPOINT_PAUSE"] = pause
    return main(argv)


@pytest.mark.distributed
def test_two_ranks_killed_inside_a_sharded_checkpoint_write_resume_bit_for_bit(tmp_path):
    from dptrain.parallel.dist import spawn

    args = [*ARGS, "performance.sharding=fsdp"]
    ref = tmp_path / "ref"
    assert spawn(_cli_rank, 2, ["train", "--config", TINY, "--output-dir", str(ref), *args,
                                "train.checkpoint_every=0"], str(tmp_path), "0") == [0, 0]
    out = tmp_path / "run"
    root = out / "checkpoints"
    argv = ["train", "--config", TINY, "--output-dir", str(out), "--resume", "auto", *args,
            "train.checkpoint_every=1", "train.keep_checkpoints=2"]
    errors: list[BaseException] = []

    def run_killed():
        try:
            spawn(_cli_rank, 2, argv, str(tmp_path), "3")
        except BaseException as e:  # the ranks die by SIGKILL: spawn raises
            errors.append(e)

    th = threading.Thread(target=run_killed)
    th.start()
    # rank 0 pauses after every rank wrote its shards and before the marker: kill both there,
    # in the write of the step-2 checkpoint
    end = time.time() + 300
    target = ".tmp-step-00000002-"
    while time.time() < end:
        tmps = [p for p in root.glob(".tmp-*") if p.name.startswith(target)] if root.exists() else []
        if tmps and (tmps[0] / "meta.pt").exists() and not (tmps[0] / ckpt.MARKER).exists():
            break
        time.sleep(0.01)
    else:
        raise AssertionError("the run never reached the step-2 checkpoint write")
    for rank in (0, 1):
        os.kill(int((tmp_path / f"{rank}.pid").read_text()), signal.SIGKILL)
    th.join(timeout=120)
    assert errors and not th.is_alive()
    assert {"__0_0.distcp", "__1_0.distcp"} <= {p.name for p in tmps[0].iterdir()}
    assert _check_invariants(out) == 1  # step 1's checkpoint only; the partial one unseen
    assert spawn(_cli_rank, 2, argv, str(tmp_path), "0") == [0, 0]
    assert _check_invariants(out) == 4
    assert not list(root.glob(".tmp-*"))
    newest = ckpt.find_latest(out)
    assert (newest / "__1_0.distcp").is_file() and not (newest / "state.pt").exists()
    _assert_same_final_model_and_each_step_logged_once(ref, out)
