"""IEEE float32 products for the clipping engine's query.

PyTorch lets a process trade float32 accuracy for speed: TF32 on NVIDIA GPUs (on by default for
cuDNN convolutions; ``torch.set_float32_matmul_precision("high")`` for matmuls) and bf16 on CPUs
with AMX or AVX512-BF16 (``set_float32_matmul_precision("medium")``, or
``torch.backends.mkldnn.*.fp32_precision``). Such products round to about 1e-3. The engine takes
a clipped example's norm and its clipped sum from two different products of the same factors
(ghost norms: Gram matrices; the sum: one weighted product), so under TF32 or bf16 they differ
by about that much, and one example could add about C(1 + 1e-3) instead of at most C; the
cancellation check's float32 threshold (``refine_cancelled``) would not hold either. So the
engine's whole query (every state's forward and backward, the contributions, norms and clipped
sums, two_pass's second backward, the rows check) runs inside :func:`ieee_float32`, whatever
the process chose: two_pass's second backward and the engine's checks must see the same output
gradients as the first backward. Everything outside the query keeps the process's setting.

PyTorch raises when its legacy flags (``allow_tf32``, ``set_float32_matmul_precision``) and the
``fp32_precision`` attributes of ``torch.backends`` disagree, so both are set together and both
are put back as they were. One thing cannot be put back: cuDNN's conv and rnn start at an
implicit default that reads ``"tf32"``; written back, ``"tf32"`` is explicit, so a parent
attribute the process sets later (``torch.backends.cudnn.fp32_precision``) no longer reaches them.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch

_BACKENDS = torch.backends


def _precision_objects() -> list:
    """The ``fp32_precision`` holders of one operator family each (PyTorch >= 2.9)."""
    objects = []
    for path in ("cuda.matmul", "cudnn.conv", "cudnn.rnn", "mkldnn.matmul", "mkldnn.conv",
                 "mkldnn.rnn"):
        obj = _BACKENDS
        for part in path.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if obj is not None and hasattr(obj, "fp32_precision"):
            objects.append(obj)
    return objects


# Process-wide flags, shared by every thread: the first query to enter sets IEEE and saves the
# process's settings, the last to leave puts them back. Without the count, a second engine's
# query in another thread would save "ieee" as the process's setting, and the first to leave
# would restore TF32/bf16 under the other's running query.
_lock = threading.Lock()
_depth = 0
_saved: tuple | None = None


def _save_and_set_ieee() -> tuple:
    objects = _precision_objects()
    saved = [obj.fp32_precision for obj in objects]
    # the legacy values; None where the getter raises (the process mixed the two APIs itself)
    try:
        legacy_matmul = torch.get_float32_matmul_precision()
    except RuntimeError:
        legacy_matmul = None
    try:
        legacy_cudnn = torch.backends.cudnn.allow_tf32
    except RuntimeError:
        legacy_cudnn = None
    state = (objects, saved, legacy_matmul, legacy_cudnn)
    try:
        # the legacy setters set the new attributes too, so that the two agree; a legacy flag
        # that cannot be read is left alone (it could not be put back: the operators follow
        # the new attributes, and its getter raises inside as it did outside)
        if legacy_matmul is not None:
            torch.set_float32_matmul_precision("highest")
        if legacy_cudnn is not None:
            torch.backends.cudnn.allow_tf32 = False
        for obj in objects:
            obj.fp32_precision = "ieee"
    except BaseException:
        _restore(state)
        raise
    return state


def _restore(state: tuple) -> None:
    objects, saved, legacy_matmul, legacy_cudnn = state
    if legacy_matmul is not None:
        torch.set_float32_matmul_precision(legacy_matmul)
    if legacy_cudnn is not None:
        torch.backends.cudnn.allow_tf32 = legacy_cudnn
    for obj, value in zip(objects, saved):
        obj.fp32_precision = value


@contextlib.contextmanager
def ieee_float32() -> Iterator[None]:
    """float32 matmuls and convolutions in IEEE float32 (no TF32, no bf16) on every backend,
    the process's settings restored when the last query (of any thread) leaves. About 30 us
    per use."""
    global _depth, _saved
    with _lock:
        if _depth == 0:
            _saved = _save_and_set_ieee()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                state, _saved = _saved, None
                _restore(state)
