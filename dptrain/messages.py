"""Exceptions as one line, for dptrain's own error messages (which name a field or a layer and
then say what torch, safetensors or a file reader said); notes about the training data, which a
secure-mode run does not print."""

from __future__ import annotations

import contextlib
import contextvars
import sys
import warnings


def brief(e: BaseException) -> str:
    """``e`` as one line for an error message: its type and the first line of its message
    (200 characters at most). DCP's CheckpointException, whose message is every rank's
    traceback: the first failing rank's own exception."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        e = first[0] if isinstance(first, tuple) else first
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:200]}" if lines else type(e).__name__


_SECURE = contextvars.ContextVar("dptrain_secure_notes", default=False)


@contextlib.contextmanager
def secure_notes(on: bool = True):
    """While ``on`` (a secure-mode run building its data), :func:`data_note` says nothing about
    the training split: in secure mode whatever the run prints is an output the guarantee must
    cover, and a count of training examples (cut short, left out) is an exact statistic of the
    private data, without noise."""
    token = _SECURE.set(bool(on))
    try:
        yield
    finally:
        _SECURE.reset(token)


def data_note(text: str, training: bool) -> None:
    """``dptrain: note: text`` on stderr, about the data; ``training``: about the training
    split's examples, which :func:`secure_notes` silences (docs/privacy.md, "Secure mode")."""
    if not (training and _SECURE.get()):
        print(f"dptrain: note: {text}", file=sys.stderr)


@contextlib.contextmanager
def command_warnings(rank: int = 0):
    """While a ``dptrain`` command runs: dptrain's own warnings (a warning class of dptrain,
    such as the accountants' ``AccountingWarning``, or a message that starts with ``dptrain``)
    are lines like the command's other warnings, ``dptrain: warning: ...``, without Python's
    file, line number and source line; opacus' note on its RDP orders is left out
    (``OPACUS_ORDER_NOTE``), and on a ``rank`` other than 0 the accountants' notes (every
    rank's: rank 0 says them). Other libraries' warnings are shown as Python shows them. What
    this adds is taken away afterwards (the command may run inside a test or a notebook)."""
    from dptrain.privacy.accounting import OPACUS_ORDER_NOTE

    before = warnings.formatwarning

    def formatted(message, category, filename, lineno, line=None):
        text = str(message)
        if category.__module__.split(".")[0] == "dptrain" or text.startswith("dptrain"):
            return as_warning_line(text) + "\n"
        return before(message, category, filename, lineno, line)

    # (not catch_warnings(), which puts the whole filter list back: the filters a library
    # installs when the command first imports it, torch's and scipy's, were lost)
    added = [("ignore", OPACUS_ORDER_NOTE, UserWarning)]
    if rank != 0:  # (the accountants' notes are every rank's: said once, by rank 0)
        from dptrain.privacy.accounting import AccountingWarning

        added.append(("ignore", "", AccountingWarning))
    ours = []
    for action, message, category in added:
        before_filters = list(warnings.filters)
        warnings.filterwarnings(action, message=message, category=category)
        if warnings.filters[0] not in before_filters:  # (one the user has stays theirs)
            ours.append(warnings.filters[0])
    show = warnings.showwarning
    warnings.formatwarning = formatted
    try:
        yield
    finally:
        warnings.formatwarning, warnings.showwarning = before, show
        for f in ours:
            if f in warnings.filters:
                warnings.filters.remove(f)


def as_warning_line(text: str) -> str:
    """``text`` as a warning line: ``dptrain.clipping: X`` -> ``dptrain.clipping: warning: X``,
    anything else -> ``dptrain: warning: text``."""
    head, sep, rest = text.partition(": ")
    if sep and head.startswith("dptrain") and " " not in head:
        return f"{head}: warning: {rest}"
    return f"dptrain: warning: {text}"
