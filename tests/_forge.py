"""A checkpoint edited by hand (or written by something else) with its marker made to match:
what the checks after the checksums (``dptrain train --resume``, ``dptrain diagnose``) face."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from dptrain import checkpoint as ckpt


def forged(run: Path, edit) -> Path:
    """``run``'s newest checkpoint with ``edit(state)`` applied to its state.pt and the
    marker's checksum, size and step rewritten to match (the checksums prove the files whole,
    not who wrote them)."""
    step_dir = sorted((run / "checkpoints").glob("step-*"))[-1]
    state_pt = step_dir / "state.pt"
    state = torch.load(state_pt, weights_only=False)
    edit(state)
    torch.save(state, state_pt)
    marker = json.loads((step_dir / ckpt.MARKER).read_text())
    marker["sha256"]["state.pt"] = hashlib.sha256(state_pt.read_bytes()).hexdigest()
    marker["bytes"]["state.pt"] = state_pt.stat().st_size
    marker["step"] = state["step"] if type(state["step"]) is int else marker["step"]
    (step_dir / ckpt.MARKER).write_text(json.dumps(marker))
    return step_dir
