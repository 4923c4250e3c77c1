"""``map_tensors``: a function applied to every tensor inside a batch or a state, keeping its
containers."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

from torch import Tensor


def map_tensors(fn: Callable[[Tensor], Any], obj: Any) -> Any:
    """``obj`` with ``fn(t)`` for every tensor ``t`` in it, through dicts, lists, tuples and
    namedtuples, their subclasses too (torch's pytree takes an unregistered subclass, e.g. a
    ``dict`` subclass of a library's, for one leaf and would skip its tensors). A container is
    rebuilt as its own type where its constructor takes the new contents, else as the plain
    one (``dict``, ``list``, ``tuple``); anything else is returned as it is."""
    if isinstance(obj, Tensor):
        return fn(obj)
    if isinstance(obj, Mapping):
        items = {k: map_tensors(fn, v) for k, v in obj.items()}
        return _rebuilt(type(obj), items, dict)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple: positional fields
        return type(obj)(*(map_tensors(fn, v) for v in obj))
    if isinstance(obj, (list, tuple)):
        items = [map_tensors(fn, v) for v in obj]
        return _rebuilt(type(obj), items, list if isinstance(obj, list) else tuple)
    return obj


def _rebuilt(kind: type, contents, plain: type):
    if kind is plain:
        return plain(contents)
    try:
        return kind(contents)
    except Exception:  # a constructor with other arguments
        return plain(contents)
