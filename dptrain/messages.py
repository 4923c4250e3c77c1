"""Exceptions as one line, for dptrain's own error messages (which name a field or a layer and
then say what torch, safetensors or a file reader said)."""

from __future__ import annotations


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
