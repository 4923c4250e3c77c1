"""SIGKILL a real `dptrain train` process at seeded random moments (one kill lands inside a
checkpoint write), resume with --resume auto until done: the final parameters equal the
uninterrupted run's bit for bit, and after every kill the output directory holds only complete,
loadable checkpoints whose ledgers count exactly the releases behind their parameters."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
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
    from safetensors.torch import load_file

    want = load_file(str(ref / "final" / "model.safetensors"))
    got = load_file(str(out / "final" / "model.safetensors"))
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k], got[k]), k
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert json.loads((out / "summary.json").read_text())["steps"] == 4
