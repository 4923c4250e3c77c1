"""Whole, atomic checkpoints (single process).

A checkpoint is a directory ``DIR/checkpoints/step-00000012/`` holding ``state.pt`` (model,
optimizer and filter states, the privacy ledger, the step, RNG states, the resolved config) and,
written last, ``COMPLETE`` with the SHA-256 of every file. It is written under a temporary name
and renamed into place, so a reader never sees a partial checkpoint; a checkpoint whose marker is
missing or whose checksums do not match is reported and skipped in favour of the previous one.

The ledger in a checkpoint counts exactly the releases that produced its parameters. In secure
mode the privacy seed is not stored (resume then draws fresh randomness and says so).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

from dptrain.config import ConfigError, to_dict

MARKER = "COMPLETE"
PRIVACY_FIELDS = ("sample_rate", "noise_multiplier", "clip_norm", "dataset_size",
                  "expected_batch_size", "delta", "steps", "adjacency", "epsilon", "accountant")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _root(output_dir: Path) -> Path:
    return Path(output_dir) / "checkpoints"


def save(trainer, output_dir: Path) -> Path:
    root = _root(output_dir)
    root.mkdir(parents=True, exist_ok=True)
    name = f"step-{trainer.step:08d}"
    final = root / name
    tmp = root / f".tmp-{name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    state = {
        "step": trainer.step,
        "model": trainer.model.state_dict(),
        "optimizer": trainer.optimizer.state_dict(),
        "ledger": trainer.ledger.to_dict(),
        "plan": vars(trainer.plan),
        "config": to_dict(trainer.cfg),
        "rng": {"torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None},
        # Secure mode: the seed is never written (exact replay impossible by design).
        "privacy_seed": None if trainer.cfg.privacy.secure_mode else trainer._privacy_seed,
    }
    torch.save(state, tmp / "state.pt")
    sums = {p.name: _sha256(p) for p in tmp.iterdir()}
    with open(tmp / MARKER, "w") as f:
        json.dump({"sha256": sums, "step": trainer.step}, f)
        f.flush()
        os.fsync(f.fileno())
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _prune(root, trainer.cfg.train.keep_checkpoints)
    return final


def _prune(root: Path, keep: int) -> None:
    complete = [p for p in sorted(root.glob("step-*")) if (p / MARKER).exists()]
    for old in complete[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def verify(path: Path) -> str | None:
    """None if the checkpoint at ``path`` is complete and intact, else the reason."""
    marker = path / MARKER
    if not marker.is_file():
        return "incomplete (no COMPLETE marker)"
    try:
        sums = json.loads(marker.read_text())["sha256"]
    except Exception:
        return "corrupt COMPLETE marker"
    for fname, digest in sums.items():
        f = path / fname
        if not f.is_file():
            return f"missing file {fname}"
        if _sha256(f) != digest:
            return f"checksum mismatch in {fname}"
    return None


def find_latest(output_dir: Path) -> Path | None:
    """Newest complete, intact checkpoint; damaged ones are reported on stderr and skipped."""
    root = _root(output_dir)
    for path in sorted(root.glob("step-*"), reverse=True):
        problem = verify(path)
        if problem is None:
            return path
        print(f"dptrain: skipping checkpoint {path}: {problem}", file=sys.stderr)
    return None


def check_compatible(saved_cfg: dict, cfg) -> None:
    saved = saved_cfg.get("privacy", {})
    current = to_dict(cfg.privacy)
    for key in PRIVACY_FIELDS:
        if saved.get(key) != current.get(key):
            raise ConfigError(f"privacy.{key}",
                              f"differs from the checkpoint ({saved.get(key)!r} there, "
                              f"{current.get(key)!r} now): a resumed run must keep the privacy "
                              f"settings")
    if saved.get("secure_mode") != current.get("secure_mode"):
        raise ConfigError("privacy.secure_mode", "differs from the checkpoint")
    if not cfg.privacy.secure_mode and saved.get("seed") != current.get("seed"):
        raise ConfigError("privacy.seed", "differs from the checkpoint")
    for section in ("model", "data"):
        if saved_cfg.get(section) != to_dict(getattr(cfg, section)):
            raise ConfigError(section, "differs from the checkpoint's; resume needs the same "
                                       f"{section} settings")


def load(trainer, path: Path) -> None:
    from dptrain.privacy.accounting import Ledger

    problem = verify(path)
    if problem is not None:
        raise ConfigError("resume", f"checkpoint {path} is unusable: {problem}")
    state: dict[str, Any] = torch.load(path / "state.pt", map_location="cpu", weights_only=False)
    check_compatible(state["config"], trainer.cfg)
    trainer.model.load_state_dict(state["model"])
    trainer.optimizer.load_state_dict(state["optimizer"])
    trainer.ledger = Ledger.from_dict(state["ledger"])
    trainer.step = state["step"]
    torch.set_rng_state(state["rng"]["torch"])
    if state["rng"].get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["rng"]["cuda"])
    if trainer.cfg.privacy.secure_mode:
        print("dptrain: secure mode: resuming with fresh randomness (exact replay is impossible "
              "by design)", file=sys.stderr)
    else:
        assert state["privacy_seed"] == trainer._privacy_seed
