"""What runs write for people and programs to read: strict JSON for metrics and summaries."""

from __future__ import annotations

import json
import math
from typing import Any

__all__ = ["jsonable", "strict_json"]


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
