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


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _clean_stale(root: Path) -> None:
    """Temporary directories of writers that died mid-write (one writer per output dir)."""
    mine = f"-{os.getpid()}"
    for p in root.glob(".tmp-*"):
        if not p.name.endswith(mine):
            shutil.rmtree(p, ignore_errors=True)
    for p in root.glob(".old-*"):
        shutil.rmtree(p, ignore_errors=True)


def _test_pause() -> None:
    """Test hook: DPTRAIN_TEST_CHECKPOINT_PAUSE seconds between the data and the marker, so a
    test can SIGKILL the writer in the middle of a checkpoint write."""
    pause = os.environ.get("DPTRAIN_TEST_CHECKPOINT_PAUSE")
    if pause:
        import time

        time.sleep(float(pause))


def capture(trainer) -> dict[str, Any]:
    """Everything a run is, as one picklable dict (replicated, unsharded states)."""
    assert trainer.ledger.num_releases == trainer.step, "ledger and step disagree"
    return {
        "format": 1,
        "step": trainer.step,
        "model": trainer.model.state_dict(),
        "optimizer": trainer.optimizer.state_dict(),
        "ledger": trainer.ledger.to_dict(),
        "plan": vars(trainer.plan),
        "config": to_dict(trainer.cfg),
        "world_size": trainer.world,
        "rng": {"torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None},
        # Secure mode: the seed is never written (exact replay impossible by design).
        "privacy_seed": None if trainer.cfg.privacy.secure_mode else trainer._privacy_seed,
    }


def write(state: dict[str, Any], output_dir: Path, step: int, keep: int) -> Path:
    """Write ``state`` atomically as ``checkpoints/step-NNNNNNNN`` and prune to ``keep``."""
    root = _root(output_dir)
    root.mkdir(parents=True, exist_ok=True)
    _clean_stale(root)
    name = f"step-{step:08d}"
    final = root / name
    tmp = root / f".tmp-{name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    with open(tmp / "state.pt", "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    _test_pause()
    sums = {p.name: _sha256(p) for p in tmp.iterdir()}
    with open(tmp / MARKER, "w") as f:  # the marker last: it vouches for every file above
        json.dump({"sha256": sums, "step": step}, f)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    if final.exists():  # a damaged checkpoint at this step (skipped on resume): move it aside
        old = root / f".old-{name}-{os.getpid()}"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    _fsync_dir(root)
    _prune(root, keep)
    return final


def save(trainer, output_dir: Path) -> Path:
    return write(capture(trainer), output_dir, trainer.step, trainer.cfg.train.keep_checkpoints)


def _prune(root: Path, keep: int) -> None:
    """Keep the newest ``keep`` intact checkpoints; the newest intact one is never deleted.
    Damaged ones older than the newest intact one are removed too."""
    complete = [p for p in sorted(root.glob("step-*")) if (p / MARKER).exists()]
    for old in complete[:-max(keep, 1)]:
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
            return (f"checksum mismatch in {fname} ({f.stat().st_size} bytes): the file is "
                    "truncated or corrupted")
    return None


def find_latest(output_dir: Path) -> Path | None:
    """Newest complete, intact checkpoint; damaged ones are reported on stderr and skipped."""
    root = _root(output_dir)
    for path in sorted(root.glob("step-*"), reverse=True):
        problem = verify(path)
        if problem is None:
            return path
        print(f"dptrain: skipping damaged checkpoint {path}: {problem}; trying the previous "
              "one", file=sys.stderr)
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


def read(path: Path) -> dict[str, Any]:
    """The verified state of the checkpoint at ``path``; ConfigError("resume") if unusable."""
    path = Path(path)
    problem = verify(path)
    if problem is not None:
        raise ConfigError("resume", f"checkpoint {path} is unusable: {problem}")
    try:
        return torch.load(path / "state.pt", map_location="cpu", weights_only=False)
    except Exception as e:  # intact checksums but unreadable: written by something else
        raise ConfigError("resume", f"checkpoint {path} is unusable: cannot read state.pt "
                                    f"({type(e).__name__}: {e})") from None


def load(trainer, path: Path) -> None:
    from dptrain.privacy.accounting import Ledger

    state = read(path)
    check_compatible(state["config"], trainer.cfg)
    ledger = Ledger.from_dict(state["ledger"])
    if ledger.num_releases != state["step"]:
        raise ConfigError("resume", f"checkpoint {path} is inconsistent: its ledger counts "
                                    f"{ledger.num_releases} releases at step {state['step']}")
    trainer.model.load_state_dict(state["model"])
    trainer.optimizer.load_state_dict(state["optimizer"])
    trainer.ledger = ledger
    trainer.step = state["step"]
    torch.set_rng_state(state["rng"]["torch"])
    if state["rng"].get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["rng"]["cuda"])
    if trainer.cfg.privacy.secure_mode:
        print("dptrain: secure mode: resuming with fresh randomness (a new privacy seed from OS "
              "entropy; exact replay is impossible by design)", file=sys.stderr)
    else:
        assert state["privacy_seed"] == trainer._privacy_seed


def export_hf(trainer, directory: Path) -> Path | None:
    """For GPT-2: ``DIR/hf/`` (config.json + model.safetensors) loadable by transformers'
    ``GPT2LMHeadModel.from_pretrained``; copied from ``DIR/model.safetensors``. None otherwise."""
    model = trainer.model
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) != "gpt2" or not (directory / "model.safetensors").exists():
        return None
    hf = Path(directory) / "hf"
    tmp = Path(directory) / f".tmp-hf-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config.save_pretrained(str(tmp))
    shutil.copyfile(directory / "model.safetensors", tmp / "model.safetensors")
    if hf.exists():
        shutil.rmtree(hf)
    os.replace(tmp, hf)
    return hf
