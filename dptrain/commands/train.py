"""``dptrain train --config PATH [--output-dir DIR] [--resume auto|PATH] [--dry-run]
[key.sub=value ...]``."""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import math
import os
import signal
import stat
import sys
import threading
import types
from pathlib import Path

from dptrain.commands import (FINAL_LAYOUT, LOCK, RUN_LAYOUT, check_can_create, in_run_folder,
                              linked_into_a_run, runs_inside)
from dptrain.config import ConfigError, said_by_rank_0, shown
from dptrain.messages import brief
from dptrain.telemetry import json_rows


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="train a model privately",
                       description="Train privately; writes DIR/summary.json and "
                                   "DIR/final/model.safetensors. On SIGTERM (preemption, a time "
                                   "limit) or SIGUSR1 every rank finishes its step, a checkpoint "
                                   "of it is written and the run exits 128 + the signal's number "
                                   "(143, 138): continue with --resume auto.")
    p.add_argument("--config", required=True, help="YAML run config (see configs/)")
    p.add_argument("--output-dir", default=None,
                   help="where metrics, checkpoints and the final model go (default runs/<config>)")
    p.add_argument("--resume", default=None,
                   help="'auto' (newest complete checkpoint in the output dir) or a checkpoint path")
    p.add_argument("--dry-run", action="store_true",
                   help="make every check a run makes before its first step (config, data, "
                        "model, privacy plan, output directory, the checkpoint to resume), "
                        "print the resolved config and the plan as YAML, and write nothing "
                        "to the output directory")
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides of the config")


def run(args: argparse.Namespace) -> int:
    # a stop signal from here on, also while the data, the model or a checkpoint is loaded,
    # stops the run at its first step boundary (before any step: with nothing to keep)
    from dptrain.parallel.dist import check_accelerate_settings, launch_environment

    rank, _ = launch_environment()  # (RANK, WORLD_SIZE: an incomplete set is refused here)
    check_accelerate_settings()
    stop = types.SimpleNamespace(stop_signal=None, rank=rank, trainer=None, finished=False,
                                 out=None)
    try:
        with _stop_on_signals(stop, keep_ignoring=getattr(args, "process_exits", False)):
            try:
                rc = _run(args, stop)
            except ConfigError:
                stop.refused = True  # (its line is printed next, then the process exits 2)
                raise
            stop.finished = rc == 0
            stop.trainer = None  # freed here, while a stop signal only sets a flag
            return rc
    except KeyboardInterrupt:  # Ctrl-C (SIGINT): at once, not at a step boundary
        if stop.out is None or stop.rank != 0 or args.dry_run:
            raise  # (before the output directory was this run's: "interrupted", dptrain.cli)
        print(f"dptrain train: interrupted; {_interrupted_where(stop.out, args.resume)}",
              file=sys.stderr)
        return 130


def _interrupted_where(out: Path, resume: str | None) -> str:
    """Where a run stopped by Ctrl-C goes on from: its newest complete checkpoint (marker,
    files and sizes; not hashed, which a large checkpoint would make the user wait for), or
    none."""
    from dptrain import checkpoint as ckpt

    try:
        latest = ckpt.find_latest(out, shallow=True, quiet=True)
    except OSError:
        latest = None
    if latest is not None:
        return (f"the last complete checkpoint is {latest} (step {ckpt.checkpoint_step(latest)}): "
                f"continue from it with --resume auto")
    if resume not in (None, "auto"):  # a branch that wrote no checkpoint of its own yet
        return (f"no complete checkpoint in {out / 'checkpoints'} yet: start again from "
                f"{resume} with --resume {resume}")
    return (f"no complete checkpoint in {out / 'checkpoints'}: --resume auto would start "
            f"afresh, from step 0")


def _run(args: argparse.Namespace, stop: types.SimpleNamespace) -> int:
    from dptrain.config import load
    from dptrain.trainer import RunConfig, join_ranks

    cfg = load(RunConfig, args.config, args.overrides)
    if args.output_dir is not None and not args.output_dir.strip():
        raise ConfigError("output-dir", "is empty (leave it out for runs/<config name>)")
    if args.resume is not None and not args.resume.strip():
        raise ConfigError("resume", "is empty: 'auto', or a checkpoint directory")
    out = Path(args.output_dir) if args.output_dir else Path("runs") / Path(args.config).stem
    several = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if several:  # the ranks meet here: one start, and one verdict on each check of the directory
        join_ranks(cfg.performance)
        _check_ranks_agree_on_start(args, out)
    with _one_verdict_on(out, several):
        _check_output_dir(out)  # before the data and the model are built
        _check_outside_the_data(out, cfg)
    with _run_lock(out, rank=stop.rank, dry_run=args.dry_run, shared=several) as started:
        return _run_in(out, cfg, args, stop, several, started)


def _run_in(out: Path, cfg, args: argparse.Namespace, stop: types.SimpleNamespace,
            several: bool, started=lambda: None) -> int:
    """:func:`_run` once ``out`` is this run's alone (its lock held); ``several``: ranks;
    ``started()`` once every check before the first step has passed (a start that never gets
    there leaves the lock file as it found it)."""
    from dptrain import checkpoint as ckpt
    from dptrain.trainer import StopRequested, Trainer

    stop.out = out  # (where a Ctrl-C says the run can go on from)
    finished, resume_path, error = False, None, None
    try:
        finished = _look(out, cfg, args)
        if not finished:
            resume_path = _resume_path(out, cfg, args, several)
    except ConfigError as e:
        error = e
    except OSError as e:
        error = _unreadable(out, e)
    if several:  # one verdict: a rank refusing, or done, alone left the others in collectives
        finished = _agree_on_look(out, finished, error)
    elif error is not None:
        raise error
    if finished:
        if stop.rank == 0:
            print(f"dptrain train: {out} holds a finished run (summary.json); nothing to do",
                  file=sys.stderr)
            if args.dry_run:
                print(f"{_DRY_RUN_HEADER}output_dir: {out}\nstart: finished (summary.json), "
                      f"nothing to do\n", end="")
        return 0
    trainer = Trainer(cfg, out)
    # a signal from here on sets the trainer's flag itself; one that lands between reading
    # and storing the flag below is in stop.stop_signal, read again after
    stop.trainer = trainer
    trainer.stop_signal = stop.stop_signal
    if stop.stop_signal is not None:
        trainer.stop_signal = stop.stop_signal
    if args.resume == "auto":
        # the checksums, hashed by the ranks in turn (each file read once in all), of rank 0's
        # list, whatever each rank's first look found: a rank whose view of a shared file
        # system lags must not skip the collectives the others enter. It names the damaged.
        resume_path = ckpt.find_latest(out, collective=True)
    if cfg.privacy.secure_mode and args.resume == "auto":
        # again on what the checksums chose: a damaged newest checkpoint sends the run back to
        # an older one (or to none, step 0), whose later releases have outputs on disk
        with _one_verdict_on(out, several):
            _check_secure_resume(resume_path, run_dir=out)
            if resume_path is not None:  # (the first look may have found none on this rank)
                _check_secure_branch(resume_path, out)
    if args.dry_run:
        if resume_path is not None:  # its settings against these, into memory only
            ckpt.load(trainer, resume_path, verified=args.resume == "auto")
        if trainer.rank == 0:
            trainer.print_start_notes()  # as the run would say
            print(_dry_run_report(trainer, out, resume_path), end="")
        return 0
    if args.resume == "auto" and resume_path is None and trainer.rank == 0:
        damaged = ckpt.has_step_dirs(out)
        print(f"dptrain train: no {'intact' if damaged else 'complete'} checkpoint in {out}"
              f"{' (the damaged ones are named above)' if damaged else ''}; starting afresh",
              file=sys.stderr)
    if resume_path is None and trainer.rank == 0:
        # rows of a run killed before step 1's checkpoint, or (a fresh run: one with readable
        # rows was refused above) a line cut short by a kill, which the first row would join
        _drop_metrics_after(out / "metrics.jsonl", 0)
    if resume_path is not None:
        ckpt.load(trainer, resume_path, verified=args.resume == "auto")
        if cfg.privacy.secure_mode:
            # (after the load, whose refusals must not leave a branch recorded: a later
            # resume into another directory would be refused as a second branch)
            _record_secure_resume(resume_path, out, write=trainer.rank == 0)
        if trainer.rank == 0:
            print(f"dptrain train: resumed from {resume_path} at step {trainer.step}",
                  file=sys.stderr)
            _drop_metrics_after(out / "metrics.jsonl", trainer.step)
    started()
    try:
        summary = trainer.run()
    except StopRequested as e:
        # (a stop another rank saw: this rank exits 128 + signum too, and its launcher's
        # SIGTERM, sent when that rank exits first, must not kill it on the way out)
        stop.stop_signal = stop.stop_signal or e.signum
        if trainer.rank == 0:
            name = signal.Signals(e.signum).name
            where = (f"checkpoint {e.checkpoint}" if e.checkpoint is not None else
                     f"its checkpoint in {out / 'checkpoints'}" if e.step else "nothing to keep")
            print(f"dptrain train: {name}: stopped after step {e.step} of {trainer.plan.steps} "
                  f"({where}); continue with --resume auto", file=sys.stderr)
        return 128 + e.signum
    if trainer.rank == 0:  # only rank 0 writes the files, and says so once
        metrics = _done_metrics(summary["metrics"])
        steps = summary["steps"]
        print(f"done: {steps} step{'' if steps == 1 else 's'}, epsilon {summary['epsilon']:.3f} "
              f"(delta {summary['delta']:.3g}), {metrics}; wrote {out}/summary.json")
    return 0


def _done_metrics(metrics: dict) -> str:
    """The final metrics on the last line: counts as integers (a token count read 1.322e+04),
    the rest to 4 significant digits; the last iterate's counts (the same) left out."""
    return ", ".join(f"{k} {v}" if isinstance(v, int) else f"{k} {v:.4g}"
                     for k, v in metrics.items()
                     if isinstance(v, (int, float)) and not isinstance(v, bool)
                     and not (k.startswith("last_iterate_") and isinstance(v, int)))


STOP_SIGNALS = tuple(getattr(signal, n) for n in ("SIGTERM", "SIGUSR1") if hasattr(signal, n))
"""Signals that ask a run to stop at the next step boundary with a checkpoint: SIGTERM (what
preemption, Slurm's ``--signal=TERM@120`` and torchrun's agent send) and SIGUSR1 (what clusters
set up for PyTorch Lightning send, e.g. ``--signal=USR1@120``; torchrun passes it on to its
ranks only with its ``--signals_to_handle`` / ``PET_SIGNALS_TO_HANDLE`` naming it). The exit
status is 128 + the signal's number (143, 138). While the ranks meet, they end the process
(``dptrain.parallel.dist.init_from_env``)."""


_DRY_RUN_HEADER = ("# dptrain train --dry-run: every check before the first step passed; "
                   "nothing was written to the output directory\n")


def _dry_run_report(trainer, out: Path, resume_path: Path | None) -> str:
    """What ``--dry-run`` prints: one YAML document (the ranks, the plan, the parameter groups,
    the resolved config), printed by rank 0, with a comment line saying that nothing was
    written."""
    import yaml

    from dptrain.config import to_dict
    from dptrain.models.finetune import describe

    plan, cfg = trainer.plan, trainer.cfg
    # as the optimizer was built; "label" as metrics.jsonl's lr keys name the group
    groups = [{"label": key, "optimizer": g.config.optimizer, "lr": g.config.lr,
               "tensors": len(g.named_params),
               "parameters": sum(p.numel() for _, p in g.named_params)}
              for key, g in zip(trainer.optimizer.keys, trainer.optimizer.groups)]
    report = {
        "output_dir": str(out),
        "start": (f"resume from {resume_path} at step {trainer.step}" if resume_path is not None
                  else "from step 0"),
        # this launch's ranks, and whether FSDP2 shards the model over them (one rank never)
        "ranks": {"world_size": trainer.world,
                  "sharded": cfg.performance.sharding == "fsdp" and trainer.world > 1,
                  "device": str(trainer.device)},
        "privacy": {"planned_epsilon": plan.planned_epsilon, "delta": plan.delta,
                    "noise_multiplier": plan.noise_multiplier,
                    "noise_multiplier_calibrated": cfg.privacy.noise_multiplier is None,
                    "calibrated_with": plan.calibrated_with,
                    "sample_rate": plan.sample_rate, "steps": plan.steps,
                    "clip_norm": plan.clip_norm, "expected_batch_size": plan.denominator,
                    "dataset_size": plan.dataset_size, "train_size": trainer.train_size,
                    "accountant": plan.accountant},
        # trainable_parameters, total_parameters (frozen ones too), lora_layers
        **describe(trainer.model),
        "groups": groups,
        "config": to_dict(cfg),
    }
    return _DRY_RUN_HEADER + yaml.safe_dump(report, sort_keys=False, width=100)


@contextlib.contextmanager
def _stop_on_signals(stop, keep_ignoring: bool = False):
    """A stop signal (``STOP_SIGNALS``; torchrun forwards SIGTERM to every rank) sets
    ``stop.stop_signal``, and that of ``stop.trainer`` once there is one: the trainer stops at
    the next step boundary with a checkpoint instead of dying mid-step. The step in progress
    finishes, all ranks agree on the step, and ``--resume auto`` continues exactly. Further
    stop signals are ignored: under Slurm a rank can get the same one twice, from slurmstepd
    (which signals every process of the step) and from torchrun's agent, so "twice means now"
    would kill it mid-step; SIGINT (Ctrl-C) or SIGKILL stop at once. Only the main thread can
    install handlers; elsewhere (a test calling ``main`` from a thread) nothing changes.

    On the way out the stop signals are ignored after a stop (the process exits 128 + signum,
    its checkpoint written) and, with ``keep_ignoring`` (the process exits next:
    :func:`dptrain.cli.entry`), after a finished run (``stop.finished``: its summary.json
    written, status 0) or a refusal (``stop.refused``: its one line printed next, status 2;
    under torchrun the agent sends SIGTERM to the other ranks as soon as one has exited 2,
    and a rank 0 killed then died -15 before printing the line the ranks share); otherwise
    the previous handlers come back."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        if stop.stop_signal is not None or getattr(stop, "finished", False):  # stopping, done
            return
        stop.stop_signal = signum
        if getattr(stop, "trainer", None) is not None:  # (any holder: a trainer itself too)
            stop.trainer.stop_signal = signum
        if stop.rank == 0:
            print(f"dptrain train: {signal.Signals(signum).name} received: stopping when the "
                  f"step (or evaluation batch) in progress ends, with a checkpoint (Ctrl-C or "
                  f"SIGKILL stop at once)",
                  file=sys.stderr)

    before = {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        # after a stop the process exits 128 + signum with its checkpoint written, and after a
        # finished run it exits 0: a signal arriving in those last milliseconds must not turn
        # that exit into a kill (143)
        finished = getattr(stop, "finished", False) or getattr(stop, "refused", False)
        done = stop.stop_signal is not None or (keep_ignoring and finished)
        for sig, previous in before.items():
            signal.signal(sig, signal.SIG_IGN if done else previous)


def _row_step(row: dict) -> int | float:
    """A row's ``step`` (rows dptrain writes have an integer one); a row without a readable
    one counts as after every step (inf): the guards that read these refuse rather than
    overlook it, and a resume keeps it."""
    step = row.get("step")
    if isinstance(step, int) and not isinstance(step, bool):
        return step
    return math.inf


def _metrics_steps(path: Path) -> list[int | float]:
    return [_row_step(row) for _, row in json_rows(path)]


_MISSING = object()

#: the settings :func:`_finished_settings` reads, as paths into a run config
_FINISHED_PATHS = (
    *(("optim", k) for k in ("name", "lr", "preset", "weight_decay", "schedule",
                             "warmup_steps", "ema_decay", "ema_start_step")),
    *(("optim", "inner_momentum", k) for k in ("k_muon", "k_other", "gamma_muon",
                                               "gamma_other")),
    ("optim", "filter", "name"), ("optim", "aux", "optimizer"), ("optim", "aux", "lr"),
    ("train", "generate_prompts"), ("train", "max_new_tokens"),
    ("data", "test_file"), ("data", "max_test_examples"))


def _finished_settings(config: dict) -> dict[str, object]:
    """The settings of a run config (as summary.json holds it) that decide a finished run's
    model or summary metrics and that a resume may change: the axes a sweep varies (the
    optimizer, its learning rates and schedule, the EMA, inner momentum, the filter, the
    groups' optimizers and rates, what the final evaluation scores). Numbers as floats; a
    setting missing from an older summary as its default. Those read only when another is on
    are compared as :data:`_SWITCHED` says; left out are the optimizers' own options, whose
    "default" may be spelt out as its value (momentum None or 0.95)."""
    from dptrain.trainer import RunConfig

    def number_as_float(value):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        return value

    def get(path):
        value = config
        for part in path:
            value = value.get(part, _MISSING) if isinstance(value, dict) else _MISSING
        if value is _MISSING:  # (a setting newer than the summary: the run had its default)
            value = defaults
            for part in path:
                value = getattr(value, part)
        return number_as_float(value)

    defaults = RunConfig()
    out = {".".join(path): get(path) for path in _FINISHED_PATHS}
    for i, group in enumerate((config.get("optim") or {}).get("groups") or []):
        group = group if isinstance(group, dict) else {}
        for k in ("pattern", "optimizer", "lr"):
            out[f"optim.groups[{i}].{k}"] = number_as_float(group.get(k))
    return out


#: settings read only when another is on, with the test of that one: compared unless off in
#: both runs, and after the other settings (so that a switch turned on is what is named)
_SWITCHED = {
    "optim.ema_start_step": ("optim.ema_decay", bool),
    "optim.inner_momentum.gamma_muon": ("optim.inner_momentum.k_muon", bool),
    "optim.inner_momentum.gamma_other": ("optim.inner_momentum.k_other", bool),
    "optim.aux.optimizer": ("optim.preset", lambda v: v is not None),
    "optim.aux.lr": ("optim.preset", lambda v: v is not None),
    "train.max_new_tokens": ("train.generate_prompts", lambda v: v != 0),  # (null: all)
}


def _check_same_training(saved: dict, cfg, out: Path) -> None:
    """The settings of :func:`_finished_settings` must be the finished run's: a sweep that
    reused an output directory would otherwise read the earlier run's "nothing to do" (exit
    0) as its own run done. (A resume may change them; a finished run is never rewritten.)"""
    from dptrain.config import to_dict

    def show(value) -> str:
        return "(not set)" if value is _MISSING else shown(value)

    was, now = _finished_settings(saved), _finished_settings(to_dict(cfg))
    for key in sorted(set(was) | set(now), key=lambda k: (k in _SWITCHED, k)):
        if key in _SWITCHED:
            switch, on = _SWITCHED[key]
            if not (on(was[switch]) or on(now[switch])):
                continue
        if was.get(key, _MISSING) != now.get(key, _MISSING):
            raise ConfigError(key, f"differs from the finished run (summary.json) in {out} "
                                   f"({show(was.get(key, _MISSING))} there, "
                                   f"{show(now.get(key, _MISSING))} now): it was trained or "
                                   f"evaluated with the other value, and a finished run is "
                                   f"never rewritten; choose another output directory")


def _check_layout(out: Path) -> None:
    """Each path a run writes in ``out`` is absent, or of the kind it writes (a directory, a
    file) and writable: a file named ``checkpoints`` raised FileExistsError at the first
    checkpoint, and one named ``final`` after the whole run had trained (as did a directory
    named ``final/generations.jsonl``)."""
    layout = {**RUN_LAYOUT, **{f"final/{name}": d for name, d in FINAL_LAYOUT.items()}}
    for name, is_dir in layout.items():
        path = out / name
        if not path.exists() and not path.is_symlink():
            continue
        if path.is_dir() != is_dir or not (is_dir or path.is_file()):  # (a FIFO blocked reads)
            kind = "a directory" if is_dir else "a file"
            raise ConfigError("output-dir", f"{path} exists and is not {kind}, which a run "
                                            f"writes there; move it away, or choose another "
                                            f"directory")
        if not os.access(path, os.W_OK | (os.X_OK if is_dir else 0)):
            raise ConfigError("output-dir", f"cannot write {path}: it is not writable")


_NO_LOCKS = frozenset(getattr(errno, n) for n in ("ENOLCK", "ENOSYS", "EOPNOTSUPP", "ENOTSUP")
                      if hasattr(errno, n))
"""What ``flock`` says on a file system that cannot lock (Lustre mounted without ``-o flock``,
some FUSE and SMB mounts)."""


LOCK_WAIT_S = 1.0
"""How long a start retries a held lock before it calls it another run's: a dry run's probe,
or the cleanup of a start refused at the same moment, holds it for microseconds."""


@contextlib.contextmanager
def _run_lock(out: Path, rank: int, dry_run: bool = False, shared: bool = False):
    """One run at a time in ``out``: rank 0 holds an exclusive ``flock`` on ``out/run.lock``
    (created, and ``out`` with it) from before it reads anything a run wrote there until it
    returns; a second run is refused (ConfigError naming output-dir, exit 2) before it reads
    or writes anything there. ``shared`` (the ranks are in a process group): rank 0's verdict
    is every rank's, so every rank exits (ranks started without torchrun's agent waited for
    the others until the collective timeout). The lock is the open file's, so the kernel drops
    it when the process dies however it dies (a preempted run leaves nothing stale; on NFS the
    server drops it when the client's lease lapses, about 90 s after a node is lost). The file
    names its holder; it yields ``started()``, to be called once the start's checks have
    passed: a start that does not get there (refused, or a finished run: nothing to do) puts
    back what the file said (the last run that started; an empty or new file goes), and one
    refused before it wrote anything removes the folders it created. A file system that cannot
    lock gets a warning and the run goes on unguarded. ``dry_run`` writes nothing: it only asks
    whether another run holds the lock."""
    try:
        import fcntl
    except ImportError:  # (not a POSIX system)
        fcntl = None
    path = out / LOCK
    held, error = None, None
    if rank == 0 and fcntl is not None:
        try:
            if dry_run:
                _probe(fcntl, path, out)
            else:
                held = _open_locked(fcntl, path, out)
        except ConfigError as e:
            error = e
        except OSError as e:  # (rank 0 alone would leave the others in the broadcast)
            error = ConfigError("output-dir", f"cannot lock {path}: {e.strerror or e}")
    if shared:
        from dptrain.parallel.dist import one_verdict

        try:
            one_verdict(error, True)  # (rank 0's, the only one that looks)
        except BaseException:  # (another rank lost, a timeout, Ctrl-C: let go, as it was)
            if held is not None:
                _release(path, out, *held, started=False)
            raise
    elif error is not None:
        raise error
    began = []

    try:
        yield lambda: began.append(True)
    finally:
        if held is not None:
            _release(path, out, *held, started=bool(began))


def _release(path: Path, out: Path, fd: int, locked: bool, made: list[Path],
             before: bytes | None, started: bool) -> None:
    try:
        if locked and (not started or made and [p.name for p in out.iterdir()] == [LOCK]):
            _put_back(path, out, fd, made, before)
    except OSError:
        pass
    finally:
        os.close(fd)  # (the lock goes with the descriptor)


def _put_back(path: Path, out: Path, fd: int, made: list[Path], before: bytes | None) -> None:
    """The lock file (still held) and the folders this start made as they were: a start that
    wrote nothing else leaves no folder behind; a file it made, or found empty, goes (while
    held, so a run that opened it sees it gone and opens anew); else the last run's line."""
    if made and [p.name for p in out.iterdir()] == [LOCK]:
        os.unlink(path)
        for folder in made:
            folder.rmdir()
    elif before is None:
        os.unlink(path)
    else:
        os.ftruncate(fd, 0)
        os.pwrite(fd, before, 0)


def _open_lock_file(path: Path, flags: int) -> int:
    """``os.open`` of the lock file, never through a link (its target would be overwritten
    with the holder's line), and only a regular file; ConfigError naming output-dir."""
    if path.is_symlink():
        raise ConfigError("output-dir", f"{path} is a symbolic link; a run writes its lock "
                                        "there: remove the link")
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o644)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ConfigError("output-dir", f"{path} is not a regular file; a run writes its lock "
                                        "there: move it away")
    return fd


def _probe(fcntl, path: Path, out: Path) -> None:
    """A dry run's question, on a read-only descriptor (nothing is written): is the lock held?"""
    try:
        fd = _open_lock_file(path, os.O_RDONLY)
    except FileNotFoundError:
        return
    except OSError as e:
        raise ConfigError("output-dir", f"cannot read {path}: {e.strerror or e}") from None
    try:
        _take(fcntl, fd, fcntl.LOCK_SH, path, out)
    finally:
        os.close(fd)


def _open_locked(fcntl, path: Path, out: Path) -> tuple[int, bool, list[Path], bytes | None]:
    """Create ``out`` and ``path`` in it, take its lock and name this process there: (the
    descriptor, whether locked (False: the file system cannot lock), the folders created,
    deepest first, what the file said before (None: nothing, there was no file or an empty
    one))."""
    for _ in range(8):
        made = [d for d in (out, *out.absolute().parents) if not d.exists()]
        try:
            out.mkdir(parents=True, exist_ok=True)
            fd = _open_lock_file(path, os.O_RDWR | os.O_CREAT)
        except (FileNotFoundError, FileExistsError):
            continue  # (a refused start's cleanup removed the folder meanwhile: again)
        except OSError as e:  # (/proc: os.access says yes to root, mkdir says no)
            raise ConfigError("output-dir", f"cannot write {path}: {e.strerror or e}") from None
        try:
            if not _take(fcntl, fd, fcntl.LOCK_EX, path, out):
                return fd, False, made, None
            held = os.fstat(fd)
            try:
                now = os.stat(path, follow_symlinks=False)
            except FileNotFoundError:
                now = None
            if now is not None and (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino):
                # (read under the lock: a file made a moment ago and named by a run that has
                # ended since is that run's; an empty one names no one, and goes with us)
                size = os.fstat(fd).st_size
                before = os.pread(fd, size, 0) if size else None
                try:
                    _claim(fd, path)
                except ConfigError:  # (a full disk)
                    with contextlib.suppress(OSError):
                        _put_back(path, out, fd, made, before)
                    raise
                return fd, True, made, before
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # its holder removed the file after this process opened it: again
    raise ConfigError("output-dir", f"cannot lock {path}: it keeps being removed or replaced")


def _claim(fd: int, path: Path) -> None:
    """Name this process in the lock file it holds (what a refused second start prints)."""
    import socket
    import time

    holder = {"host": socket.gethostname(), "pid": os.getpid(),
              "since": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
    except OSError as e:  # (a full disk, a quota)
        raise ConfigError("output-dir", f"cannot write {path}: {e.strerror or e}") from None


def _take(fcntl, fd: int, kind: int, path: Path, out: Path) -> bool:
    """``flock(fd, kind)``, retried for ``LOCK_WAIT_S``: True when taken, False (with a
    warning) when the file system cannot lock; another run holding it is a ConfigError
    naming it."""
    import time

    deadline = time.monotonic() + LOCK_WAIT_S
    while True:
        try:
            fcntl.flock(fd, kind | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() < deadline:
                time.sleep(0.02)
                continue
        except OSError as e:
            if e.errno not in _NO_LOCKS:
                raise ConfigError("output-dir", f"cannot lock {path}: "
                                                f"{e.strerror or e}") from None
            print(f"dptrain train: warning: {path}: the file system cannot lock files "
                  f"({e.strerror or e}); a second run started into {out} would not be "
                  f"refused", file=sys.stderr)
            return False
        try:
            held = json.loads(path.read_text())
            who = f"pid {held['pid']} on {held['host']}, since {held['since']}"
        except (OSError, ValueError, TypeError, KeyError):
            who = "its holder did not say who"
        raise ConfigError("output-dir", f"{out} is in use by another run ({who}; {path} is "
                                        "locked): one run writes a directory at a time. Wait "
                                        "for it, stop it, or choose another directory")


@contextlib.contextmanager
def _one_verdict_on(out: Path, several: bool):
    """The checks in the block give one verdict (``parallel.dist.one_verdict``): a refusal on
    any rank, or an OSError reading ``out`` (EACCES on a parent: pathlib's ``exists()`` raises
    it), is every rank's. In one process, the refusal as it is."""
    from dptrain.parallel.dist import one_verdict

    try:
        yield
        error = None
    except ConfigError as e:
        error = e
    except OSError as e:
        error = _unreadable(out, e)
    one_verdict(error, several)


def _unreadable(out: Path, e: OSError) -> ConfigError:
    """An OSError of a check reading ``out`` (EACCES on a parent: pathlib's ``exists()``
    raises it), as the refusal the ranks share."""
    return ConfigError("output-dir", f"cannot read {out}: {e.strerror or e}")


def _check_output_dir(out: Path) -> None:
    """``out`` is a directory, or can be made, outside another run's folders (its pruning, or
    its final model's replacement, would delete this run); what a run writes there is absent
    or of its kind."""
    if out.exists() and not out.is_dir():
        raise ConfigError("output-dir", f"{out} exists and is not a directory")
    if out.is_symlink() and not out.exists():
        raise ConfigError("output-dir", f"{out} is a symbolic link to nothing "
                                        f"({os.readlink(out)}); make its target, or remove it")
    check_can_create("output-dir", out)
    if (inside := in_run_folder(out)) is not None:
        raise ConfigError("output-dir", f"{inside}, which that run prunes or replaces; choose "
                                        "another directory")
    if (inside := runs_inside(out)) is not None:
        raise ConfigError("output-dir", f"{inside}: this run would prune or replace it; move "
                                        "it away, or choose another directory")
    if (linked := linked_into_a_run(out)) is not None:
        raise ConfigError("output-dir", f"{linked}: this run would take over, prune or "
                                        "replace that run's files; choose another directory")
    _check_layout(out)


def _check_outside_the_data(out: Path, cfg) -> None:
    """``out`` is not an imagefolder's split folder, nor inside one: the run's checkpoints/
    and final/ would be read as classes of the data by the next run (which then fails, or
    trains on them)."""
    from dptrain.data import example_folders

    folders = example_folders(cfg.data)
    if not folders:
        return
    try:
        where = out.resolve()
        folders = [(field, folder.resolve()) for field, folder in folders]
    except (OSError, RuntimeError):  # (a loop of links: refused at the lock, naming output-dir)
        return
    for field, folder in folders:
        if folder == where or folder in where.parents:
            below = where.relative_to(folder).parts
            why = ("this run's checkpoints/ and final/ would be read as classes" if not below
                   else f"{below[0]} would be read as a class" if len(below) == 1
                   else f"this run's files would be read as examples of class {below[0]} "
                        f"(its images trained on)")
            raise ConfigError("output-dir", f"{out} is inside {folder} ({field}), whose every "
                                            f"folder is a class: {why}; choose another "
                                            f"directory (a run already there: move it out "
                                            f"whole and continue it with --resume auto)")


def _look(out: Path, cfg, args: argparse.Namespace) -> bool:
    """Whether ``--resume auto`` finds a finished run in ``out`` with this config (nothing to
    do); ConfigError if a finished run is there that this one may not continue or rewrite."""
    from dptrain import checkpoint as ckpt

    if (out / "summary.json").exists() and args.resume is None:
        raise ConfigError("output-dir", f"{out} already holds a finished run; choose another "
                                        "directory")
    if args.resume != "auto" or not (out / "summary.json").exists():
        return False
    # summary.json is written last: the run is finished (a requeued job lands here), and a
    # finished run is never rewritten. Its config must be this one, as a checkpoint's must (a
    # changed setting is not "nothing to do").
    try:
        saved = json.loads((out / "summary.json").read_text()).get("config")
    except (OSError, ValueError, AttributeError):
        saved = None
    if not isinstance(saved, dict):
        raise ConfigError("output-dir", f"{out / 'summary.json'} is unreadable or holds no "
                                        "config, so whether it is this run's cannot be "
                                        "checked; move it away, or choose another directory")
    try:
        ckpt.check_compatible(saved, cfg, source="the finished run (summary.json)")
        _check_same_training(saved, cfg, out)
    except (AttributeError, TypeError, KeyError, IndexError) as e:  # (sections of another shape)
        raise ConfigError("output-dir", f"{out / 'summary.json'} holds a config of another "
                                        f"shape ({brief(e)}), so whether it is this run's "
                                        "cannot be checked; move it away, or choose another "
                                        "directory") from None
    return True


def _resume_path(out: Path, cfg, args: argparse.Namespace, several: bool) -> Path | None:
    """This rank's checkpoint to resume (None: start afresh), after the checks that need no
    model: ``--resume PATH`` exists and may write into ``out``, a fresh run finds no earlier
    one there, and (one process, or ``--resume PATH``) secure mode's resume guards."""
    from dptrain import checkpoint as ckpt

    resume_path = None
    if args.resume == "auto":
        # each rank's own first look: marker, files and sizes only (no hashing)
        resume_path = ckpt.find_latest(out, shallow=True, quiet=True)
        if (resume_path is None and any((out / "final").glob("*"))
                and not (out / "metrics.jsonl").is_file()):
            # (a run of its own that reached its export wrote metrics.jsonl first: this final/
            # is something else's, which "starting afresh" would replace)
            raise ConfigError("output-dir", f"{out}'s final/ holds files, but no checkpoint "
                                            "and no metrics.jsonl of a run that wrote them "
                                            "are there: --resume auto would replace them; "
                                            "move them away, or choose another directory")
    elif args.resume is not None:
        resume_path = Path(args.resume)
        if not resume_path.is_dir():
            raise ConfigError("resume", f"no checkpoint directory at {resume_path}")
        _refuse_a_run_directory(resume_path, secure=cfg.privacy.secure_mode)
        _check_explicit_resume(out, resume_path, secure=cfg.privacy.secure_mode)
    if args.resume is None and _holds_a_run(out):
        raise ConfigError("output-dir", f"{out} holds an unfinished run (checkpoints, "
                                        "metrics.jsonl or final/); pass --resume auto to "
                                        "continue it, or choose another directory")
    if cfg.privacy.secure_mode and resume_path is not None and not (several
                                                                    and args.resume == "auto"):
        # (early, before the model is built; with several ranks, --resume auto's first look is
        # each rank's own: the checks after the trainer is built, on rank 0's list, do it)
        _check_secure_resume(resume_path)
        _check_secure_branch(resume_path, out)
    return resume_path


def _agree_on_look(out: Path, finished: bool, error: ConfigError | None) -> bool:
    """``one_verdict`` on the look before the trainer is built; ranks that disagree on
    whether the run is finished are refused too (node-local copies that differ, or a shared
    file system that lags). Else whether it is finished."""
    from dptrain.parallel.dist import one_verdict

    every = one_verdict(error, True, finished)
    done = [rank for rank, f in enumerate(every) if f]
    if done and len(done) < len(every):
        other = next(r for r in range(len(every)) if r not in done)
        raise said_by_rank_0(ConfigError(
            "output-dir", f"rank {done[0]} sees a finished run in {out} (summary.json), rank "
                          f"{other} does not: every rank must see one directory (node-local "
                          "copies that differ, or a shared file system that lags?)"))
    return bool(done)


def _check_ranks_agree_on_start(args: argparse.Namespace, out: Path) -> None:
    """Every rank starts one run: the same ``--resume`` (none, auto, one checkpoint),
    ``--output-dir`` and ``--dry-run``. A rank resuming from another checkpoint than its peers
    would take its share of another step's sample (an example in two shares of one release:
    sensitivity 2C), with another ledger; one resuming while the others start afresh, or
    writing elsewhere, would wait in collectives the others never enter. A node's launcher
    line that differs is refused on every rank, naming the option."""
    import torch.distributed as dist

    mine = {"resume": args.resume, "output-dir": str(out), "dry-run": bool(args.dry_run)}
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    for rank, theirs in enumerate(every):
        for key in mine:
            if theirs[key] != every[0][key]:
                raise said_by_rank_0(ConfigError(
                    key, f"rank {rank} starts with {theirs[key]!r}, rank 0 with "
                         f"{every[0][key]!r}: every rank must start the same run (a launcher "
                         "line that differs between nodes?)"))


def _holds_a_run(out: Path) -> bool:
    """``out`` has a checkpoint, logged steps or a final model of an earlier run (a fresh run
    would mix in, or overwrite it)."""
    return (any((out / "checkpoints").glob("step-*")) or bool(json_rows(out / "metrics.jsonl"))
            or any((out / "final").glob("*")))


def _refuse_a_run_directory(path: Path, secure: bool = False) -> None:
    """``--resume PATH`` names one checkpoint; a run directory, or its ``checkpoints/``, was
    refused as a checkpoint with no COMPLETE marker: say what PATH is and what to pass
    (``secure``: no branch off a finished run, which secure mode refuses)."""
    from dptrain import checkpoint as ckpt

    if (path / ckpt.MARKER).exists():
        return
    if ckpt.has_step_dirs(path):  # (its checkpoints/ holds step-N directories)
        run, where = path, "a run directory"
    elif path.name == "checkpoints" and ckpt.has_step_dirs(path.parent):
        run, where = path.parent, "a run's checkpoints/ directory"
    else:
        return
    if (run / "summary.json").exists():
        raise ConfigError("resume", f"{path} is {where} (of a finished run), not a checkpoint" + (
            ": the run is complete, and secure mode cannot branch off its checkpoints (their "
            "later releases would be drawn again with fresh noise)" if secure else
            f": name one of its checkpoints, --resume {run / 'checkpoints'}/step-N, to branch "
            "off it into another --output-dir"))
    raise ConfigError("resume", f"{path} is {where}, not a checkpoint: pass --resume auto "
                                f"--output-dir {run} to continue the run from its latest "
                                f"checkpoint, or --resume {run / 'checkpoints'}/step-N for one")


def _check_explicit_resume(out: Path, path: Path, secure: bool = False) -> None:
    """``--resume PATH`` continues from PATH and writes into ``out``: never over a finished run,
    over checkpoints of later steps, or into a directory holding another run's outputs
    (nothing written before is lost). ``secure``: the advice leaves out branching into another
    directory, which secure mode refuses too (``_check_secure_resume``)."""
    from dptrain import checkpoint as ckpt

    if (out / "summary.json").exists():
        raise ConfigError("output-dir", f"{out} already holds a finished run; resume into "
                                        "another --output-dir")
    step = ckpt.checkpoint_step(path)  # the marker's: a renamed copy is still that step
    later = [s for s in ckpt.complete_steps(out) if step is not None and s > step]
    if later:
        advice = ("in secure mode a run cannot branch off an earlier checkpoint (its later "
                  "releases would be drawn again with fresh noise): resume the latest one "
                  "(--resume auto)" if secure else "resume into another --output-dir")
        raise ConfigError("output-dir", f"{out} holds checkpoints after step {step} (step "
                                        f"{later[-1]}), which resuming from {path} would "
                                        f"overwrite; {advice}")
    own = Path(path).resolve().parent == (out / "checkpoints").resolve()
    if not own and _holds_a_run(out):  # its checkpoints would be pruned as this run's, its
        # metrics rows continued by another run's
        raise ConfigError("output-dir", f"{out} holds another run (checkpoints, metrics.jsonl "
                                        f"or final/); resume {path} into its own run "
                                        "directory or an empty one")


def _check_secure_resume(path: Path | None, run_dir: Path | None = None) -> None:
    """Secure mode resumes with fresh noise (the old seed was never written), so the releases
    after the checkpoint ``path`` (None: no checkpoint, step 0) are drawn again. That is free
    only if nothing derived from the lost ones was written: a later checkpoint (damaged or
    not: it was written), a summary or logged metrics of the run the checkpoint belongs to
    (``run_dir``, by default the checkpoint's) would count as releases that no ledger covers.
    (Metrics rows are written only with checkpoints in secure mode, so a crash leaves none
    behind; rows found here come from a version before that rule.)"""
    from dptrain import checkpoint as ckpt

    if path is not None and run_dir is None and Path(path).resolve().parent.name != "checkpoints":
        # copied or moved out of its run: that run's later outputs cannot be checked here
        raise ConfigError("resume", f"secure mode: {path} is not in a run's checkpoints/ "
                                    "directory, so the outputs of its run cannot be checked "
                                    "for later releases; resume it from its run directory "
                                    "(copy the whole run to move it)")
    step = 0 if path is None else ckpt.checkpoint_step(path)
    if step is None:
        return
    run_dir = Path(run_dir) if run_dir is not None else Path(path).resolve().parent.parent
    later = [s for s in ckpt.written_steps(run_dir) if s > step]
    logged = [s for s in _metrics_steps(run_dir / "metrics.jsonl") if s > step]
    finished = (run_dir / "summary.json").exists()
    if later or logged or finished:
        what = (f"checkpoint step {later[-1]}" if later else
                f"metrics of step {max(logged)}" if logged and max(logged) < math.inf else
                "a metrics row without an integer step" if logged else "summary.json")
        start = f"resuming from {path}" if path is not None else "starting afresh"
        advice = ("Resume from the run's latest checkpoint (restore it if it was reported "
                  "damaged)" if later else
                  "This run cannot be continued in secure mode" if path is None else
                  "Resume from the run's latest checkpoint")
        raise ConfigError("resume", f"secure mode: {run_dir} already holds outputs of releases "
                                    f"after step {step} ({what}); {start} would draw those "
                                    "releases again with fresh noise, uncounted by the ledger. "
                                    f"{advice}")


SECURE_RESUMES = "secure_resumes.jsonl"  # in a run directory: secure resumes of its checkpoints


def _check_secure_branch(path: Path, out: Path) -> None:
    """Secure mode: the releases after checkpoint ``path`` are drawn again with fresh noise by
    whichever run resumes it, so only one output directory may: a second branch (``--resume
    PATH`` into another directory, or the source run's own ``--resume auto`` after such a
    branch) would release those steps twice, once uncounted. Each resume is recorded in the
    checkpoint's run directory (``secure_resumes.jsonl``) before any release
    (:func:`_record_secure_resume`); a resume into any other output directory is refused. The
    file lives in the run directory, so the answer is the same for every checkpoint of it."""
    src = Path(path).resolve().parent.parent  # in checkpoints/ (_check_secure_resume)
    claims = src / SECURE_RESUMES
    into = str(Path(out).resolve())
    others = sorted({str(row.get("into")) for _, row in json_rows(claims)} - {into})
    if others:
        raise ConfigError("resume", f"secure mode: a checkpoint of {src} was already resumed "
                                    f"into {others[0]} ({claims}); resuming {path} into {out} "
                                    "would draw the same releases again with fresh noise, "
                                    "uncounted by the ledger. Continue that run instead (if it "
                                    "failed before its first step, delete the file's row)")


def _record_secure_resume(path: Path, out: Path, *, write: bool) -> None:
    """Record (rank 0, ``write``) that the run in ``out`` resumes checkpoint ``path``, after
    every rank has checked the file (:func:`_check_secure_branch`) and before any release.
    Rank 0 checks the file again under an exclusive lock, so of two branches started at once
    only the first records itself, and the other is refused (every rank raises)."""
    import fcntl

    from dptrain import checkpoint as ckpt
    from dptrain.parallel.dist import is_distributed

    if is_distributed():
        import torch.distributed as dist

        dist.barrier()  # every rank read the file before it changes
    claims = Path(path).resolve().parent.parent / SECURE_RESUMES
    row = {"step": ckpt.checkpoint_step(path), "checkpoint": str(Path(path).resolve()),
           "into": str(Path(out).resolve())}
    refused = None
    if write:
        try:
            with open(claims, "a+") as f:
                fcntl.flock(f, fcntl.LOCK_EX)  # (released when the file closes)
                try:
                    _check_secure_branch(path, out)  # again: another branch since the first look
                except ConfigError as e:
                    refused = e.message
                else:
                    if row not in [r for _, r in json_rows(claims)]:
                        f.write(json.dumps(row) + "\n")
                        f.flush()
                        os.fsync(f.fileno())
        except OSError as e:
            refused = (f"secure mode: cannot record this resume in {claims} ({e}); that record "
                       "is how a second branch from the same checkpoint is refused. Copy the "
                       "run to a writable directory and resume from there")
    if is_distributed():  # rank 0's verdict, on every rank, before any release
        verdict = [refused]
        dist.broadcast_object_list(verdict, src=0)
        refused = verdict[0]
    if refused is not None:
        raise ConfigError("resume", refused)


def _drop_metrics_after(path: Path, step: int) -> None:
    """Rows logged after the checkpoint belong to releases that were lost with the crash (and
    are recomputed now): drop them, so metrics.jsonl holds each step once."""
    if not path.exists():
        return
    # (a row without an integer step is not one of dptrain's: kept as it is)
    keep = [line for line, row in json_rows(path)
            if (s := _row_step(row)) == math.inf or s <= step]
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(line + "\n" for line in keep))
    tmp.replace(path)
