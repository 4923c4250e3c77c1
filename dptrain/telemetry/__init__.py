"""What runs write for people and programs to read: strict JSON for metrics and summaries, and
the peak memory of a process."""

from __future__ import annotations

import json
import math
import os
import secrets
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where memory is measured: the CLI starts without it
    import torch

__all__ = ["jsonable", "strict_json", "write_json", "replace_atomically", "peak_memory_bytes",
           "json_rows"]


def jsonable(obj: Any) -> Any:
    """NaN and infinities as the strings "nan", "inf", "-inf" (strict JSON has no such numbers:
    Python writes a bare ``Infinity`` by default, which JSON.parse and jq reject), inside dicts,
    lists and tuples too; everything else as is."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {k: jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    return obj


def strict_json(obj: Any, **kwargs) -> str:
    """``json.dumps`` of :func:`jsonable` ``(obj)``, refusing any non-finite number left."""
    return json.dumps(jsonable(obj), allow_nan=False, **kwargs)


def replace_atomically(path: str | Path, write) -> Path:
    """``write(tmp)`` into a temporary file beside ``path`` (parents created), then renamed over
    ``path``: a write that fails half-way leaves what was at ``path`` as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # the pid and a random token: ranks on other nodes writing one shared file system may
    # share a pid
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def write_json(path: str | Path, obj: Any) -> Path:
    """:func:`strict_json` of ``obj`` (indented) written at ``path`` atomically."""
    text = strict_json(obj, indent=2) + "\n"  # before anything is written: it may refuse
    return replace_atomically(path, lambda tmp: tmp.write_text(text))


def peak_memory_bytes(device: torch.device, reset: bool = False) -> int:
    """This process's memory high-water mark on ``device``, since the process started or the
    last call with ``reset=True``, which starts a new window.

    - CUDA: ``torch.cuda.max_memory_allocated`` (tensors held by the caching allocator).
    - CPU, Linux: the resident set's high-water mark (``VmHWM``; a reset writes 5 to
      ``/proc/self/clear_refs``). Not ``ru_maxrss``: that one keeps the parent's resident set
      across fork and exec, so a process started by a large one reports the parent's size.
    - CPU elsewhere: ``ru_maxrss``, since the process started (``reset`` does nothing).
    """
    import torch

    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        if reset:
            torch.cuda.reset_peak_memory_stats(device)
        return int(peak)
    if sys.platform.startswith("linux"):
        with open("/proc/self/status") as f:
            peak = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
        if reset:
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
            except OSError:  # a kernel or sandbox without it: the window stays open
                pass
        return peak
    import resource

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # macOS: bytes; else KiB


def json_rows(path: Path) -> list[tuple[str, dict]]:
    """(line, row) of every readable row of a JSON-lines file (``metrics.jsonl``,
    ``secure_resumes.jsonl``; a line cut short by a kill is skipped); [] when there is none.
    (``dptrain plot`` reads strictly instead: ``commands/plot.py``.)"""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append((line, row))
    return rows
