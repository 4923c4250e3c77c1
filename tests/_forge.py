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
    rehash(step_dir, "state.pt", step=state["step"] if type(state["step"]) is int else None)
    return step_dir


def rehash(step_dir: Path, name: str, step: int | None = None) -> None:
    """The marker of ``step_dir`` made to vouch for its file ``name`` as it is now (and for
    ``step``, when given)."""
    marker = json.loads((step_dir / ckpt.MARKER).read_text())
    marker["sha256"][name] = hashlib.sha256((step_dir / name).read_bytes()).hexdigest()
    marker["bytes"][name] = (step_dir / name).stat().st_size
    if step is not None:
        marker["step"] = step
    (step_dir / ckpt.MARKER).write_text(json.dumps(marker))
