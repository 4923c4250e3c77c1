"""The ``dptrain`` command line: ``train``, ``calibrate``, ``diagnose``, ``audit``, ``plot``.

A user-facing mistake (``ConfigError``) becomes one line on stderr naming the field, and exit
status 2; nothing written before is touched.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import sys

from dptrain.config import ConfigError, check_path_name
from dptrain.messages import command_warnings

_PATH_OPTIONS = ("config", "output_dir", "resume", "run", "checkpoint", "output", "plot")


def _rank() -> int:
    """This process's RANK as the launcher environment is read (``int``: "00" is rank 0)."""
    try:
        return int(os.environ.get("RANK", "0").strip() or 0)
    except ValueError:
        return 0


def _commands():
    import importlib

    names = ("train", "calibrate", "diagnose", "audit", "plot")
    return {n: importlib.import_module(f"dptrain.commands.{n}") for n in names
            if importlib.util.find_spec(f"dptrain.commands.{n}") is not None}


class _StoreOnce(argparse.Action):
    """argparse's ``store``, refusing an option given twice (argparse keeps the last: a
    ``--config A --config B`` ran B in silence)."""

    def __call__(self, parser, namespace, values, option_string=None):
        given = vars(namespace).setdefault("_options_given", set())
        if self.dest in given:
            parser.error(f"{option_string} given twice")
        given.add(self.dest)
        setattr(namespace, self.dest, values)


class _Parser(argparse.ArgumentParser):
    """argparse's usage errors as one line (argparse prints the usage block first), exit 2;
    an option given twice is one too; subcommand parsers inherit the class."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register("action", None, _StoreOnce)
        self.register("action", "store", _StoreOnce)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> tuple[argparse.ArgumentParser, dict]:
    parser = _Parser(
        prog="dptrain",
        description="Differentially private training with the Muon family of optimizers.")
    sub = parser.add_subparsers(dest="command", required=True)
    commands = _commands()
    for module in commands.values():
        module.add_parser(sub)
    return parser, commands


def main(argv: list[str] | None = None, *, process_exits: bool = False) -> int:
    """Run one command; its exit status. ``process_exits``: the process exits right after
    (:func:`entry`), so a finished command may leave stop signals ignored."""
    parser, commands = build_parser()
    given = sys.argv[1:] if argv is None else list(argv)
    if given[:1] == ["calibrate"] and any(a.split("=")[0] == "--config" for a in given):
        # (argparse would say that --epsilon ... are required, as if they were the mistake)
        print("dptrain calibrate: error: --config: calibrate takes the numbers as options "
              "(--epsilon, --delta, --sample-rate, --steps); the privacy plan of a config is "
              "what dptrain train --config FILE --dry-run prints", file=sys.stderr)
        return 2
    args, rest = parser.parse_known_args(argv)
    args.process_exits = process_exits
    # ``key=value`` overrides may come before and after options (``train a=1 --config X b=2``):
    # argparse stops collecting a positional list at the first option
    if rest and hasattr(args, "overrides") and all("=" in r and not r.startswith("-") for r in rest):
        args.overrides = list(args.overrides or []) + rest
    elif rest:  # (said by the subcommand's parser: its name and its --help)
        command = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        command.choices[args.command].error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        for attr in _PATH_OPTIONS:  # a name too long for the OS: one line, not an OSError
            value = getattr(args, attr, None)
            values = value if isinstance(value, list) else [value]  # (plot's --run is a list)
            for value in values:
                if not isinstance(value, str) or (attr == "resume" and value == "auto"):
                    continue
                name = attr.replace("_", "-")  # (train names its options without dashes)
                name = name if args.command == "train" else f"--{name}"
                if args.command != "train" and not value.strip():  # (train says more)
                    raise ConfigError(name, "is empty: give a path")  # (Path("") is ".")
                check_path_name(name, value)
        with command_warnings(_rank()):
            return int(commands[args.command].run(args) or 0)
    except ConfigError as e:
        if process_exits:
            # the process exits 2 next: a stop signal must not kill it before its line (also
            # a refusal met before dptrain train's own handlers: the launch environment's)
            _ignore_stop_signals()
        # (a refusal every rank shares is said once, by rank 0: not W identical lines)
        if not (e.every_rank and _rank() != 0):
            print(f"dptrain {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if _rank() == 0:  # (rank 0 speaks for the run, as dptrain train's own line does)
            print(f"dptrain {args.command}: interrupted", file=sys.stderr)
        return 130


def entry() -> None:
    """The process's entry point (the ``dptrain`` script, ``python -m dptrain``): ``main``, then
    exit with its status. A command that returned 0 has done its work (a run's ``summary.json``
    and ``final/`` are written), so a stop signal arriving while the interpreter shuts down
    (the trainer's teardown, the process group's, atexit handlers) is ignored: a scheduler
    must not read a complete run as preempted (status 143); nor a refused one (status 2: its
    error printed), which would be started again to be refused again. Any other status keeps
    the default action."""
    rc = main(process_exits=True)
    if rc in (0, 2):
        _ignore_stop_signals()
    raise SystemExit(rc)


def _ignore_stop_signals() -> None:
    """SIG_IGN for dptrain train's stop signals (SIGTERM, SIGUSR1), in the main thread."""
    from dptrain.commands.train import STOP_SIGNALS

    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


if __name__ == "__main__":
    entry()
