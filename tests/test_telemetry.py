"""Strict JSON of metrics and summaries (dptrain.telemetry): no bare NaN or Infinity."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from dptrain.telemetry import jsonable, strict_json


def _refuse(name):
    raise ValueError(f"non-standard JSON constant {name}")


def test_non_finite_numbers_become_strings_everywhere():
    obj = {"nan": math.nan, "inf": math.inf, "neg": -math.inf, "ok": 1.5, "n": 3, "s": "x",
           "nested": {"list": [math.nan, -math.inf, 2.0], "tuple": (math.inf, -math.inf, 0.0)},
           "np": np.float64("-inf")}
    text = strict_json(obj)
    got = json.loads(text, parse_constant=_refuse)
    assert got == {"nan": "nan", "inf": "inf", "neg": "-inf", "ok": 1.5, "n": 3, "s": "x",
                   "nested": {"list": ["nan", "-inf", 2.0], "tuple": ["inf", "-inf", 0.0]},
                   "np": "-inf"}
    assert jsonable((math.nan,)) == ["nan"]
    assert jsonable(-math.inf) == "-inf" and jsonable(math.inf) == "inf"


def test_strict_json_passes_keyword_arguments_and_keeps_finite_values():
    obj = {"b": [1, 2.25], "a": None}
    assert strict_json(obj, indent=2) == json.dumps(obj, indent=2)
    assert json.loads(strict_json({"x": object()}, default=lambda o: "obj")) == {"x": "obj"}


def test_strict_json_refuses_a_non_finite_number_that_jsonable_did_not_see():
    # a number made by `default` (numpy float32 is no Python float) or a float dict key:
    # "refusing any non-finite number left", never a bare NaN / Infinity in the output
    with pytest.raises(ValueError):
        strict_json({"x": np.float32("nan")}, default=float)
    with pytest.raises(ValueError):
        strict_json({math.inf: 1})
    assert json.loads(strict_json({"x": np.float32(0.5)}, default=float)) == {"x": 0.5}
