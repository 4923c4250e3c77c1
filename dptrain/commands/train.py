"""``dptrain train --config PATH [--output-dir DIR] [--resume auto|PATH] [key.sub=value ...]``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dptrain.config import ConfigError


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="train a model privately",
                       description="Train privately; writes DIR/summary.json and "
                                   "DIR/final/model.safetensors.")
    p.add_argument("--config", required=True, help="YAML run config (see configs/)")
    p.add_argument("--output-dir", default=None,
                   help="where metrics, checkpoints and the final model go (default runs/<config>)")
    p.add_argument("--resume", default=None,
                   help="'auto' (newest complete checkpoint in the output dir) or a checkpoint path")
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides of the config")


def run(args: argparse.Namespace) -> int:
    from dptrain import checkpoint as ckpt
    from dptrain.config import load
    from dptrain.trainer import RunConfig, Trainer

    cfg = load(RunConfig, args.config, args.overrides)
    out = Path(args.output_dir) if args.output_dir else Path("runs") / Path(args.config).stem
    resume_path = None
    if args.resume == "auto":
        # before the process group exists: marker, files and sizes only (no hashing)
        resume_path = ckpt.find_latest(out, shallow=True, quiet=True)
    elif args.resume is not None:
        resume_path = Path(args.resume)
        if not resume_path.is_dir():
            raise ConfigError("resume", f"no checkpoint directory at {resume_path}")
    if resume_path is None and (out / "summary.json").exists():
        raise ConfigError("output-dir", f"{out} already holds a finished run; choose another "
                                        f"directory or pass --resume auto")
    trainer = Trainer(cfg, out)
    if args.resume == "auto" and resume_path is not None:
        # the checksums, hashed by the ranks in turn (each file read once in all)
        resume_path = ckpt.find_latest(out, collective=True)
        if resume_path is None and (out / "summary.json").exists():
            raise ConfigError("output-dir", f"{out} holds a finished run whose checkpoints "
                                            "are all damaged; choose another directory")
    if args.resume == "auto" and resume_path is None and trainer.rank == 0:
        print(f"dptrain train: no complete checkpoint in {out}; starting afresh",
              file=sys.stderr)
    if args.resume is not None and resume_path is None and trainer.rank == 0:
        _drop_metrics_after(out / "metrics.jsonl", 0)  # rows of a run killed before step 1's checkpoint
    if resume_path is not None:
        ckpt.load(trainer, resume_path, verified=args.resume == "auto")
        print(f"dptrain train: resumed from {resume_path} at step {trainer.step}",
              file=sys.stderr)
        if trainer.rank == 0:
            _drop_metrics_after(out / "metrics.jsonl", trainer.step)
    summary = trainer.run()
    if trainer.rank == 0:
        ckpt.export_hf(trainer, out / "final")
    metrics = ", ".join(f"{k} {v:.4g}" for k, v in summary["metrics"].items()
                        if isinstance(v, (int, float)))
    print(f"done: {summary['steps']} steps, epsilon {summary['epsilon']:.3f} "
          f"(delta {summary['delta']:.3g}), {metrics}; wrote {out}/summary.json")
    return 0


def _drop_metrics_after(path: Path, step: int) -> None:
    """Rows logged after the checkpoint belong to releases that were lost with the crash (and
    are recomputed now): drop them, so metrics.jsonl holds each step once."""
    if not path.exists():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:  # a line cut short by the kill
            continue
        if row.get("step", 0) <= step:
            keep.append(line)
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(line + "\n" for line in keep))
    tmp.replace(path)
