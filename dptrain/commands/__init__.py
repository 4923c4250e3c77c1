"""The ``dptrain`` subcommands (one module each) and what they share."""

import contextlib
import os


JSON = (".json",)
FIGURES = (".png", ".pdf", ".svg")
"""The suffixes of the files the commands write: a report, a figure (its format)."""
RUN_LAYOUT = {"checkpoints": True, "final": True, "metrics.jsonl": False, "summary.json": False,
              "secure_resumes.jsonl": False, "run.lock": False}  # (run.lock: LOCK)
"""What ``dptrain train`` writes in a run directory: name -> whether it is a directory
(``run.lock``: the lock its rank 0 holds while it runs, ``commands.train._run_lock``)."""
FINAL_LAYOUT = {"model.safetensors": False, "last_iterate.safetensors": False,
                "generations.jsonl": False, "last_iterate_generations.jsonl": False,
                "hf": True, "adapter": True}
"""What it writes (or removes, an earlier attempt's) in its ``final/``: name -> is a directory."""
RUN_FILES = tuple(name for name, is_dir in RUN_LAYOUT.items() if not is_dir)
"""A run's own files: never another command's output."""
LOCK = "run.lock"  # in a run directory: held (flock) by the run's rank 0 while it runs
RUN_FOLDERS = tuple(name for name, is_dir in RUN_LAYOUT.items() if is_dir)
"""A run's folders (the checkpoints, which it prunes; the exported model): no other command's
output goes inside them."""


def _holds_run_files(directory) -> bool:
    """``directory``'s RUN_FILES are a run's: it has ``metrics.jsonl``, or a ``summary.json``
    beside a run's folders (a report a command wrote as summary.json, alone, is not a run:
    ``--force`` overwrites it)."""
    return (directory / "metrics.jsonl").is_file() or (
        (directory / "summary.json").is_file()
        and any((directory / folder).is_dir() for folder in RUN_FOLDERS))


def run_owned(path) -> str | None:
    """Why ``path`` belongs to a run that ``dptrain train`` wrote (None if it does not): one of
    its ``RUN_FILES``, or anything inside its ``RUN_FOLDERS``."""
    from pathlib import Path

    # where the file lands: its folder with links and '..' resolved (a link to a run's final/
    # wrote into it; run/checkpoints/.. is the run itself), its own name as it is (a link there
    # is replaced by the write, not written through)
    written = Path(os.path.abspath(path))
    path = Path(path).absolute()
    path = path.parent.resolve() / path.name
    if path.name in RUN_FILES and _is_run_or_starting(path.parent):
        # (a run still building its model has only its lock: it writes the rest later)
        return f"{path} is a run's own file"
    # (and as written: a run's checkpoints/ may be a link to scratch storage)
    return _in_run_folder(path, path.parents) or _in_run_folder(path, written.parents)


def in_run_folder(directory) -> str | None:
    """Why ``directory`` is, or is inside, a run's ``RUN_FOLDERS`` (None if it is not): its
    checkpoints, which the run prunes, or its final/, which it replaces. Both as written (a
    run's ``checkpoints`` may be a link to scratch storage) and with links and '..' resolved
    as the file system does, a link before its '..' (a link to a run's final/; LINK/.. is the
    parent of LINK's target, not the folder holding LINK)."""
    from pathlib import Path

    written = Path(os.path.abspath(directory))
    try:
        resolved = Path(directory).absolute().resolve()
    except (OSError, RuntimeError):  # (a loop of links: refused as such by the caller)
        resolved = written
    return (_in_run_folder(directory, (written, *written.parents))
            or _in_run_folder(directory, (resolved, *resolved.parents)))


def _in_run_folder(path, folders) -> str | None:
    for folder in folders:
        if folder.name in RUN_FOLDERS and _is_run_or_starting(folder.parent):
            return f"{path} is inside the run {folder.parent}'s {folder.name}/ folder"
    return None


def _is_run_or_starting(directory) -> bool:
    """``directory`` holds a run's files, or its lock naming a run (a run building its model
    has written nothing else yet)."""
    return _holds_run_files(directory) or _names_a_run(os.path.join(directory, LOCK))


def _names_a_run(lock) -> bool:
    """A run's lock file names its holder; an empty one (left where the file system cannot
    lock) names no one."""
    return os.path.isfile(lock) and os.path.getsize(lock) > 0


def linked_into_a_run(directory) -> str | None:
    """Why ``directory``'s own ``RUN_FOLDERS`` are another run's (None if they are not): its
    ``checkpoints`` or ``final`` a link into another run's folders, whose checkpoints this run
    would resume and prune, or whose final model it would replace."""
    from pathlib import Path

    try:
        home = Path(directory).resolve()
        for name in RUN_FOLDERS:
            real = (Path(directory) / name).resolve()
            for folder in (real, *real.parents):
                if (folder.name in RUN_FOLDERS and folder.parent != home
                        and _is_run_or_starting(folder.parent)):
                    return (f"{Path(directory) / name} leads into the run {folder.parent}'s "
                            f"{folder.name}/ folder ({real})")
    except (OSError, RuntimeError):  # (a loop of links: refused as such by the caller)
        return None
    return None


def runs_inside(directory) -> str | None:
    """Why a run in ``directory`` would delete another run (None if it would not): one that
    was started inside its ``RUN_FOLDERS`` (its files, or its lock, are there)."""
    from pathlib import Path

    for folder in RUN_FOLDERS:
        for top, dirs, files in os.walk(Path(directory) / folder):
            if "metrics.jsonl" in files or (LOCK in files
                                            and _names_a_run(os.path.join(top, LOCK))):
                return f"{directory}'s {folder}/ folder holds another run's files ({top})"
            # (not into this run's own checkpoints: a sharded one holds many files)
            dirs[:] = [d for d in dirs if not (d.startswith("step-")
                                               and os.path.exists(os.path.join(top, d,
                                                                               "COMPLETE")))]
    return None


def check_new_file(option: str, path, force: bool, suffixes: tuple[str, ...] = ()) -> None:
    """An output file a command is about to write: never a directory, never a run's own file
    (summary.json, metrics.jsonl, anything in its final/ or checkpoints/: :func:`run_owned`,
    even with ``force``), never another existing file unless ``force`` (nothing written before
    is lost), and, with ``suffixes``, named for what it holds (a report's JSON under a .png
    name). ConfigError naming ``option``."""
    from pathlib import Path

    from dptrain.config import ConfigError

    path = Path(path)
    if suffixes and path.suffix.lower() not in suffixes:
        names = ", ".join(suffixes[:-1]) + (" or " if len(suffixes) > 1 else "") + suffixes[-1]
        raise ConfigError(option, f"must end in {names}, got {path.name}")
    if (owned := run_owned(path)) is not None:
        raise ConfigError(option, f"{owned}; write elsewhere")
    if path.is_dir():
        raise ConfigError(option, f"{path} is a directory")
    if path.exists() and not force:
        raise ConfigError(option, f"{path} exists; pass --force to overwrite it")
    check_can_create(option, path.absolute().parent, path)


def check_can_create(option: str, directory, target=None) -> None:
    """``directory`` exists and can be written, or can be created: its nearest existing
    ancestor is a writable directory. Checked before the work, not after it. ConfigError
    naming ``option`` (about ``target``, default ``directory``)."""
    from pathlib import Path

    from dptrain.config import ConfigError

    target = directory if target is None else target
    parent = Path(directory).absolute()
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError(option, f"cannot create {target}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(option, f"cannot write {target}: {parent} is not writable")


def check_new_files(files, force: bool, inputs=()) -> None:
    """:func:`check_new_file` of each ``(option, path, suffixes)`` (path None: not asked for),
    no two options naming one file (the later write would replace the earlier output), and no
    output naming one of the ``inputs``, ``(option, path)`` pairs of the files the command
    reads (even with ``force``: ``--output`` over ``--config``)."""
    from pathlib import Path

    from dptrain.config import ConfigError

    seen: dict = {Path(path).resolve(): f"{option} (input)" for option, path in inputs
                  if path is not None}
    for option, path, suffixes in files:
        if path is None:
            continue
        key = Path(path).resolve()
        if key in seen:
            raise ConfigError(option, f"{path} is also the {seen[key]} file")
        check_new_file(option, path, force, suffixes)
        seen[key] = option


@contextlib.contextmanager
def writing(option: str, path, printed: bool = True):
    """Around the write of a command's output file, after its work: a file system that refuses
    it (``check_can_create`` asks ``os.access``, which says yes to root and to /proc) is one
    line naming ``option`` and exit 2, not a traceback. ``printed``: the command printed its
    results before (the message says so)."""
    from dptrain.config import ConfigError

    try:
        yield
    except OSError as e:
        said = " (the results were printed above)" if printed else ""
        raise ConfigError(option, f"cannot write {path}: {e.strerror or e}{said}") from None


def require_matplotlib(option: str) -> None:
    """matplotlib importable with its backend settings (``MPLBACKEND``, matplotlibrc) valid,
    before the work: else one line naming ``option``, exit 2 (an installed matplotlib that
    fails to import, or a bad backend name, was a traceback, after an audit's whole run)."""
    from dptrain.config import ConfigError
    from dptrain.messages import brief

    try:
        import matplotlib  # noqa: F401
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: F401
        from matplotlib.figure import Figure  # noqa: F401
    except ImportError as e:
        raise ConfigError(option, f"needs matplotlib (pip install 'dptrain[plot]'): "
                                  f"{brief(e)}") from None
    except ValueError as e:  # (rcParams' validation: MPLBACKEND=bogus)
        raise ConfigError(option, f"matplotlib refuses its settings: "
                                  f"{brief(e)}") from None
