"""Contracts of the diagnose, plot and calibrate commands, their output-file checks and the
geometry diagnostics that a mutation run (stop 50) found unpinned."""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

import pytest
import torch

from dptrain.cli import main
from dptrain.commands import calibrate, check_new_file, run_owned
from dptrain.config import ConfigError
from dptrain.diagnostics import spectral_gap


def _cli(capsys, *args) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main([str(a) for a in args])
    cap = capsys.readouterr()
    return code, cap.out, cap.err


# ---- geometry ---------------------------------------------------------------------------------

def test_relative_gap_of_the_zero_matrix_is_nan():
    gap = spectral_gap(torch.zeros(3, 2))
    assert gap.gap == 0.0 and math.isnan(gap.relative)
    gap = spectral_gap(torch.zeros(1, 4))  # one singular value
    assert gap.gap == 0.0 and math.isnan(gap.relative)


# ---- output files (commands/__init__.py) ------------------------------------------------------

def _run_dir(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    return run


def test_a_runs_lock_file_is_its_own(tmp_path):
    run = _run_dir(tmp_path)
    assert "run.lock is a run's own file" in (run_owned(run / "run.lock") or "")
    assert run_owned(tmp_path / "run.lock") is None  # not in a run
    with pytest.raises(ConfigError, match=r"run\.lock is a run's own file; write elsewhere"):
        check_new_file("--output", run / "run.lock", force=True)


def test_a_runs_summary_is_its_own_without_metrics_too(tmp_path):
    # its final/ was protected, its summary.json was not (diagnose --output DIR/summary.json
    # --force overwrote it): a run is a folder with metrics.jsonl or summary.json
    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    (run / "summary.json").write_text("{}")
    assert run_owned(run / "final" / "x.json") is not None
    with pytest.raises(ConfigError, match=r"summary\.json is a run's own file"):
        check_new_file("--output", run / "summary.json", force=True, suffixes=(".json",))
    # a report written as summary.json, alone in its folder, is no run: --force overwrites it
    (tmp_path / "reports").mkdir()
    (tmp_path / "reports" / "summary.json").write_text("{}")
    assert run_owned(tmp_path / "reports" / "summary.json") is None
    check_new_file("--output", tmp_path / "reports" / "summary.json", force=True,
                   suffixes=(".json",))


def test_a_link_named_like_a_run_file_is_judged_by_its_own_name(tmp_path):
    """The write replaces the link, not its target: a link summary.json in a run is the run's
    file, a link elsewhere to a run's summary.json is not."""
    run = _run_dir(tmp_path)
    (tmp_path / "elsewhere.json").write_text("{}")
    (run / "summary.json").symlink_to(tmp_path / "elsewhere.json")
    assert run_owned(run / "summary.json") is not None
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "report.json").symlink_to(run / "metrics.jsonl")
    assert run_owned(tmp_path / "other" / "report.json") is None


def test_a_folder_that_cannot_be_entered_is_refused(tmp_path, monkeypatch):
    """check_can_create asks for W and X: a folder one may write but not enter (root passes
    os.access anyway, so the refusal is simulated)."""
    import dptrain.commands as commands

    real = os.access
    monkeypatch.setattr(commands.os, "access",
                        lambda p, mode: False if mode & os.X_OK else real(p, mode))
    with pytest.raises(ConfigError, match=r"--output: cannot write .*: .* is not writable"):
        check_new_file("--output", tmp_path / "r.json", force=False, suffixes=(".json",))


def test_an_upper_case_suffix_is_accepted(tmp_path):
    check_new_file("--output", tmp_path / "REPORT.JSON", False, (".json",))
    check_new_file("--plot", tmp_path / "fig.PNG", False, (".png", ".pdf", ".svg"))
    with pytest.raises(ConfigError, match=r"--plot: must end in \.png, \.pdf or \.svg"):
        check_new_file("--plot", tmp_path / "fig.JPG", False, (".png", ".pdf", ".svg"))


# ---- diagnose ----------------------------------------------------------------------------------

def test_diagnose_run_that_is_a_file_names_run(tmp_path, capsys):
    """--run FILE: the mistake is --run's, not the default --output's (FILE/diagnostics.json)."""
    f = tmp_path / "not_a_dir"
    f.write_text("x")
    code, out, err = _cli(capsys, "diagnose", "--run", f)
    assert code == 2 and out == ""
    assert err.strip().splitlines() == [f"dptrain diagnose: error: --run: no run directory at {f}"]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    root = Path(__file__).resolve().parents[1]
    d = tmp_path_factory.mktemp("tiny") / "run"
    code = main(["train", "--config", str(root / "configs" / "tiny.yaml"), "--output-dir", str(d),
                 "privacy.epsilon=null", "privacy.noise_multiplier=1.0", "train.log_every=100",
                 "privacy.steps=1"])
    assert code == 0
    return d


def test_diagnose_says_when_the_test_split_is_smaller_than_asked(tiny_run, tmp_path, capsys,
                                                                 monkeypatch):
    from dptrain.diagnostics import probes

    seen = {}

    def stop(run, **kw):  # the note is said before the probes: skip their work
        seen["n_test"] = len(run.task.test)
        raise ConfigError("--probe-examples", "stop")

    monkeypatch.setattr(probes, "diagnose", stop)
    code, _, err = _cli(capsys, "diagnose", "--run", tiny_run, "--probe-examples", "1000000",
                        "--output", tmp_path / "d.json")
    assert code == 2
    assert (f"dptrain diagnose: note: the test split has {seen['n_test']} examples; "
            f"probing all of them") in err
    code, _, err = _cli(capsys, "diagnose", "--run", tiny_run, "--probe-examples",
                        str(seen["n_test"]), "--output", tmp_path / "d.json")
    assert code == 2 and "probing all of them" not in err


# ---- plot --------------------------------------------------------------------------------------

def _fake_run(tmp_path, lines, summary=None) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(x + "\n" for x in lines))
    if summary is not None:
        (run / "summary.json").write_text(json.dumps(summary))
    return run


def test_plot_refuses_a_boolean_step(tmp_path, capsys):
    run = _fake_run(tmp_path, ['{"step": 1, "train_loss": 2.0}', '{"step": true, "train_loss": 1}'])
    code, _, err = _cli(capsys, "plot", "--run", run)
    assert code == 2 and "--run" in err and "metrics.jsonl:2 is not a metrics row" in err
    assert not (run / "metrics.png").exists()


def test_plot_title_takes_steps_and_epsilon_from_the_summary(tmp_path, capsys, monkeypatch):
    import dptrain.diagnostics.plotting as plotting

    seen = {}
    monkeypatch.setattr(plotting, "plot_metrics",
                        lambda series, path, *, title=None, runs=None: seen.update(title=title))
    run = _fake_run(tmp_path, ['{"step": 1, "train_loss": 2.0, "epsilon": 0.5}'],
                    summary={"steps": 4, "epsilon": 1.23456, "metrics": {}})
    code, _, _ = _cli(capsys, "plot", "--run", run)
    assert code == 0 and seen["title"] == "run: step 4, epsilon 1.235"


# ---- calibrate ---------------------------------------------------------------------------------

def _calibrate(argv, capsys):
    parser = argparse.ArgumentParser(prog="dptrain")
    calibrate.add_parser(parser.add_subparsers(dest="command", required=True))
    rc = calibrate.run(parser.parse_args(["calibrate", *argv]))
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("option,value,line", [
    ("--steps", "1e30", "--steps: must be <= 1e+09 (the accountants cannot handle more "
                        "releases), got 1e30"),
    ("--sample-rate", "0.5e-320", "--sample-rate: 0.5e-320 is below 2.225e-308, the smallest "
                                  "the accountants can take"),
])
def test_calibrate_range_errors_echo_the_value_as_given(capsys, option, value, line):
    argv = {"--epsilon": "2", "--delta": "1e-5", "--sample-rate": "0.01", "--steps": "10",
            "--accountant": "rdp", option: value}
    rc, out, err = _calibrate([x for kv in argv.items() for x in kv], capsys)
    assert rc == 2 and out == ""
    assert err == f"dptrain calibrate: error: {line}\n"


@pytest.mark.parametrize("rank, said", [("0", "dptrain calibrate: interrupted\n"), ("1", "")])
def test_an_interrupted_command_is_said_once_by_rank_0(monkeypatch, capsys, rank, said):
    # (under torchrun every rank got the SIGINT, and rank 1 printed its own line)
    import dptrain.commands.calibrate as calibrate
    from dptrain.cli import main

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(calibrate, "run", interrupted)
    monkeypatch.setenv("RANK", rank)
    assert main(["calibrate", "--epsilon", "1", "--delta", "1e-5", "--sample-rate", "0.1",
                 "--steps", "1"]) == 130
    assert capsys.readouterr().err == said
