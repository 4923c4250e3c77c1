"""bench/accounting.py on small settings: rows for every setting, and a result that differs
from opacus' refused before any timing."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("opacus")

from _bench import load_bench as _load  # noqa: E402

SMALL_EPSILON = [("small", 1.0, 0.1, 10, 1e-5)]
SMALL_CALIBRATE = [("small", 1.0, 0.05, 20, 1e-5)]


def test_rows_for_every_setting(monkeypatch, capsys):
    bench = _load("accounting")
    monkeypatch.setattr(bench, "EPSILON_SETTINGS", SMALL_EPSILON)
    monkeypatch.setattr(bench, "CALIBRATE_SETTINGS", SMALL_CALIBRATE)
    assert bench.main(["--rounds", "1"]) == 0
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"]
    assert set(rows) == {"epsilon small", "calibrate small"}
    assert all(r["dptrain_over_opacus"] > 0 for r in rows.values())


def test_a_result_unlike_opacus_is_refused(monkeypatch, capsys):
    bench = _load("accounting")
    monkeypatch.setattr(bench, "EPSILON_SETTINGS", SMALL_EPSILON)
    monkeypatch.setattr(bench, "CALIBRATE_SETTINGS", [])
    real = bench.epsilon
    monkeypatch.setattr(bench, "epsilon", lambda *a, **k: real(*a, **k) * (1 + 1e-12))
    assert bench.main(["--rounds", "1"]) == 1
    out, err = capsys.readouterr()
    assert "results differ" in err and "epsilon small" in err and out == ""
