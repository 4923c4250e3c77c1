"""Progress on stderr: a bar on a terminal; plain lines where stderr is a file (a cluster
job's log), in which a bar's carriage returns make one unreadable line of every update."""

from __future__ import annotations

import sys
import time
import warnings

__all__ = ["is_terminal", "progress_bar", "tqdm_write", "WarningsUnderBar", "LogLines"]


def is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # (a closed or stand-in stream)
        return False


def progress_bar(shown: bool, **kwargs):
    """A tqdm bar on stderr, drawn only if ``shown`` and stderr is a terminal (``.disable``
    says whether it is drawn: where it is not, a caller may print ``LogLines`` instead)."""
    from tqdm import tqdm

    return tqdm(disable=not (shown and is_terminal(sys.stderr)), dynamic_ncols=True, **kwargs)


def tqdm_write(message: str) -> None:
    """``message`` on stderr, on a line of its own under a progress bar (not mid-bar)."""
    from tqdm import tqdm

    tqdm.write(message, file=sys.stderr)


class WarningsUnderBar:
    """While ``bar`` is drawn, Python warnings (the accountants', a model's) go on lines of
    their own under it, as ``tqdm_write`` does, not into the middle of the bar; ``close()``
    puts back the way they were shown before. Nothing changes where the bar is not drawn."""

    def __init__(self, bar):
        self._before = warnings.showwarning if not bar.disable else None
        if self._before is not None:
            def show(message, category, filename, lineno, file=None, line=None):
                text = warnings.formatwarning(message, category, filename, lineno, line)
                tqdm_write(text.rstrip("\n"))
            warnings.showwarning = show

    def close(self) -> None:
        if self._before is not None:
            warnings.showwarning = self._before
            self._before = None


class LogLines:
    """Progress as plain lines: ``PREFIX: step S/T, ...`` at most every ``every_s`` seconds
    and at the last step; with ``rate``, the seconds per step since the previous line."""

    def __init__(self, total: int, step: int, *, rate: bool, enabled: bool,
                 every_s: float = 30.0, prefix: str = "dptrain"):
        self.total, self.rate, self.enabled, self.every_s = total, rate, enabled, every_s
        self.prefix = prefix
        self.last_t, self.last_step = time.time(), step

    def update(self, step: int, loss: float | None = None, eps: str | None = None) -> None:
        now = time.time()
        if not self.enabled or (now - self.last_t < self.every_s and step < self.total):
            return
        parts = [f"{self.prefix}: step {step}/{self.total}"]
        if loss is not None:
            parts.append(f"loss {loss:.4f}")
        if eps is not None:
            parts.append(f"eps {eps}")
        if self.rate and step > self.last_step:
            parts.append(f"{(now - self.last_t) / (step - self.last_step):.3g} s/step")
        print(", ".join(parts), file=sys.stderr, flush=True)
        self.last_t, self.last_step = now, step
