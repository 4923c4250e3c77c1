"""``dptrain calibrate``: parsing, validation (one line, status 2), plain and JSON output."""

import argparse
import json

import pytest
from _opacus import opacus_epsilon

from dptrain.commands import calibrate
from dptrain.privacy.accounting import Ledger, calibrate_noise_multiplier, epsilon


def _parser():
    parser = argparse.ArgumentParser(prog="dptrain")
    sub = parser.add_subparsers(dest="command", required=True)
    calibrate.add_parser(sub)
    return parser


def _run(argv, capsys):
    args = _parser().parse_args(["calibrate", *argv])
    assert args.func is calibrate.run
    rc = calibrate.run(args)
    out = capsys.readouterr()
    return rc, out.out, out.err


BASE = ["--epsilon", "2", "--sample-rate", "0.05", "--steps", "100", "--accountant", "rdp"]


def test_json_output_fields_and_values(capsys):
    rc, out, err = _run([*BASE, "--delta", "1/84122", "--json"], capsys)
    assert rc == 0 and err == ""
    lines = out.strip().splitlines()
    assert len(lines) == 1
    obj = json.loads(lines[0])
    for key in ("noise_multiplier", "epsilon", "delta", "sample_rate", "steps", "accountant"):
        assert key in obj
    assert obj["delta"] == 1 / 84122
    assert obj["sample_rate"] == 0.05 and obj["steps"] == 100 and obj["accountant"] == "rdp"
    sigma = calibrate_noise_multiplier(2.0, 1 / 84122, 0.05, 100, accountant="rdp")
    assert obj["noise_multiplier"] == sigma
    achieved = epsilon(Ledger([(sigma, 0.05, 100)]), 1 / 84122, "rdp")
    assert obj["epsilon"] == achieved
    assert 2.0 - 0.01 - 1e-12 <= obj["epsilon"] <= 2.0


def test_delta_forms_agree(capsys):
    rc1, out1, _ = _run([*BASE, "--delta", "1.19e-5", "--json"], capsys)
    rc2, out2, _ = _run([*BASE, "--delta", "119/10000000", "--json"], capsys)
    assert rc1 == rc2 == 0
    a, b = json.loads(out1), json.loads(out2)
    assert a["delta"] == pytest.approx(1.19e-5, rel=1e-12)
    assert a["noise_multiplier"] == b["noise_multiplier"]


def test_plain_output_and_prv_default(capsys):
    # full-batch (q = 1) keeps the PRV calls cheap
    rc, out, err = _run(["--epsilon", "5", "--delta", "1e-5", "--sample-rate", "1",
                         "--steps", "10", "--epsilon-tolerance", "0.05"], capsys)
    assert rc == 0 and err == ""
    assert len(out.strip().splitlines()) == 1
    sigma = calibrate_noise_multiplier(5.0, 1e-5, 1.0, 10, accountant="prv",
                                       epsilon_tolerance=0.05)
    assert f"{sigma:.6g}" in out and "prv" in out
    achieved = epsilon(Ledger([(sigma, 1.0, 10)]), 1e-5, "prv")
    assert f"{achieved:.4f}" in out and 5.0 - 0.05 <= achieved <= 5.0


@pytest.mark.parametrize("option,value,message", [
    ("--delta", "1.5", "--delta: must be in (0, 1), got 1.5"),
    ("--delta", "0", "--delta: must be in (0, 1), got 0"),
    ("--delta", "1/0", "--delta: expected a number"),
    ("--delta", "abc", "--delta: expected a number"),
    ("--epsilon", "0", "--epsilon: must be > 0"),
    ("--epsilon", "-1", "--epsilon: must be > 0"),
    ("--epsilon", "inf", "--epsilon: must be > 0"),
    ("--epsilon", "nan", "--epsilon: expected a number"),
    ("--sample-rate", "0", "--sample-rate: must be in (0, 1], got 0"),
    ("--sample-rate", "1.01", "--sample-rate: must be in (0, 1], got 1.01"),
    # subnormal: opacus' accountants divided by zero (a traceback)
    ("--sample-rate", "1e-320", "--sample-rate: 1e-320 is below 2.225e-308"),
    ("--steps", "0", "--steps: must be >= 1, got 0"),
    ("--steps", "2.5", "--steps: expected an integer"),
    ("--accountant", "gdp", "--accountant: must be prv or rdp"),
    # negative-looking values reach the range check (not argparse's "expected one argument")
    ("--delta", "-1/84122", "--delta: must be in (0, 1), got -1/84122"),
    ("--delta", "-1e-5", "--delta: must be in (0, 1), got -1e-5"),
    ("--sample-rate", "-0.5e-1", "--sample-rate: must be in (0, 1], got -0.5e-1"),
    # more releases than the accountants can handle: one line, not opacus' ValueError
    ("--steps", "1e30", "--steps: must be <= 1e+09"),
    ("--steps", "1000000001", "--steps: must be <= 1e+09"),
])
def test_bad_values_give_one_line_and_status_2(capsys, option, value, message):
    argv = {"--epsilon": "2", "--delta": "1e-5", "--sample-rate": "0.01", "--steps": "10",
            "--accountant": "rdp"}
    argv[option] = value
    flat = [x for kv in argv.items() for x in kv]
    rc, out, err = _run([*flat, "--json"], capsys)
    assert rc == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("dptrain calibrate: error: " + message)


def test_exact_error_line(capsys):
    rc, out, err = _run(["--epsilon", "2", "--delta", "1.5", "--sample-rate", "0.01",
                         "--steps", "10"], capsys)
    assert rc == 2 and out == ""
    assert err == "dptrain calibrate: error: --delta: must be in (0, 1), got 1.5\n"


def test_sample_rate_one_and_integral_float_steps_accepted(capsys):
    rc, out, _ = _run(["--epsilon", "8", "--delta", "1e-5", "--sample-rate", "1",
                       "--steps", "1e1", "--accountant", "rdp", "--json"], capsys)
    assert rc == 0
    obj = json.loads(out)
    assert obj["steps"] == 10 and obj["sample_rate"] == 1.0 and obj["epsilon"] <= 8.0


def test_missing_argument_is_argparse_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        _parser().parse_args(["calibrate", "--epsilon", "1", "--delta", "1e-5"])
    assert e.value.code == 2


def _opacus_sigma(eps, delta, q, steps, tol=0.01):
    from opacus.accountants.utils import get_noise_multiplier

    return get_noise_multiplier(target_epsilon=eps, target_delta=delta, sample_rate=q,
                                steps=steps, accountant="rdp", epsilon_tolerance=tol)


def test_json_matches_opacus_called_directly(capsys):
    rc, out, err = _run(["--epsilon", "3", "--delta", "1/50000", "--sample-rate", "0.02",
                         "--steps", "300", "--accountant", "rdp", "--json"], capsys)
    assert rc == 0
    obj = json.loads(out)
    sigma = _opacus_sigma(3.0, 1 / 50000, 0.02, 300)
    assert obj["noise_multiplier"] == pytest.approx(sigma, rel=1e-9)
    assert obj["epsilon"] == pytest.approx(opacus_epsilon("rdp", sigma, 0.02, 300, 1 / 50000),
                                           rel=1e-9)
    assert obj["target_epsilon"] == 3.0 and obj["epsilon_tolerance"] == 0.01


def test_steps_at_the_accountants_limit_are_accepted(capsys):
    # MAX_STEPS (1e9) itself is allowed ("must be <= 1e+09"); RDP's cost does not grow with steps
    rc, out, err = _run(["--epsilon", "2", "--delta", "1e-5", "--sample-rate", "1e-6",
                         "--steps", "1000000000", "--accountant", "rdp", "--json"], capsys)
    assert rc == 0, err
    obj = json.loads(out)
    assert obj["steps"] == 10**9
    assert obj["noise_multiplier"] == pytest.approx(_opacus_sigma(2.0, 1e-5, 1e-6, 10**9),
                                                    rel=1e-9)


def test_accountant_name_is_case_and_space_insensitive(capsys):
    rc, out, err = _run(["--epsilon", "2", "--delta", "1e-5", "--sample-rate", "0.05",
                         "--steps", "100", "--accountant", " RDP ", "--json"], capsys)
    assert rc == 0, err
    assert json.loads(out)["accountant"] == "rdp"


@pytest.mark.parametrize("argv,line", [
    # the CLI's own checks, with the value as typed (not the accountant's re-check of a float)
    (["--delta", "1"], "--delta: must be in (0, 1), got 1"),
    (["--epsilon-tolerance", "0"], "--epsilon-tolerance: must be finite and > 0, got 0"),
    (["--epsilon-tolerance", "inf"], "--epsilon-tolerance: must be finite and > 0, got inf"),
    # a ConfigError of the accountant names the option as typed on the command line
    (["--epsilon-tolerance", "5"], "--epsilon-tolerance: must be in [1e-9 x epsilon, epsilon)"),
    # the default tolerance (1% of the target) underflows: it named --epsilon-tolerance, which
    # no one passed (accounting audit)
    (["--epsilon", "5e-324"], "--epsilon: 4.94066e-324 is too small to calibrate"),
    # '-.5e-5' is not a negative number to argparse's default matcher: the range check still
    # answers (one line), not argparse's "expected one argument"
    (["--delta", "-.5e-5"], "--delta: must be in (0, 1), got -.5e-5"),
])
def test_more_bad_values_give_one_exact_line(capsys, argv, line):
    base = {"--epsilon": "2", "--delta": "1e-5", "--sample-rate": "0.05", "--steps": "100",
            "--accountant": "rdp"}
    base[argv[0]] = argv[1]
    flat = [x for kv in base.items() for x in kv]
    rc, out, err = _run(flat, capsys)
    assert rc == 2 and out == ""
    lines = err.splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("dptrain calibrate: error: " + line)
    if line.endswith(("got 1", "got 0")):
        assert lines[0] == "dptrain calibrate: error: " + line


@pytest.mark.parametrize("eps, hint", [(0.005, False), (0.015, True), (0.1, True)])
def test_an_rdp_target_out_of_reach_points_to_prv_only_where_prv_reaches_it(capsys, eps, hint):
    # RDP's floor here is ~0.18, PRV's its 0.01 error margin: below that the hint was false
    argv = ["--epsilon", str(eps), "--delta", "1e-5", "--sample-rate", "0.01", "--steps", "10"]
    rc, _, err = _run([*argv, "--accountant", "rdp"], capsys)
    assert rc == 2 and err.count("\n") == 1 and "unreachable" in err, err
    assert ("the prv accountant certifies smaller epsilons" in err) == hint
    rc, _, err = _run(argv, capsys)
    assert (rc == 0) == hint, err  # (what the hint says, prv does)


@pytest.mark.parametrize("eps", [0.01, 0.03])
def test_small_targets_calibrate_with_a_relative_default_tolerance(capsys, eps, tmp_path):
    # a fixed default of 0.01 refused these targets, naming a tolerance the user never set
    # (in dptrain train: "privacy.epsilon_tolerance", a key that does not exist), and allowed
    # the calibrated epsilon a third below one of 0.03. PRV: RDP's bound cannot go below
    # log(1/delta) / (largest order - 1) ~ 0.18 here (and PRV's not below its 0.01 error).
    from opacus.accountants.utils import get_noise_multiplier

    argv = ["--epsilon", str(eps), "--delta", "1e-5", "--sample-rate", "0.01", "--steps", "10"]
    rc, out, err = _run([*argv, "--json"], capsys)
    assert rc == 0, err
    obj = json.loads(out)
    assert obj["epsilon_tolerance"] == pytest.approx(eps / 100)
    assert obj["noise_multiplier"] == pytest.approx(get_noise_multiplier(
        target_epsilon=eps, target_delta=1e-5, sample_rate=0.01, steps=10, accountant="prv",
        epsilon_tolerance=eps / 100), rel=1e-9)
    assert eps - eps / 100 - 1e-12 <= obj["epsilon"] <= eps
    # an explicit tolerance is still the user's, and still checked against the target
    rc, _, err = _run([*argv, "--epsilon-tolerance", str(eps)], capsys)
    assert rc == 2 and err.count("\n") == 1 and "--epsilon-tolerance" in err
    # dptrain train calibrates the same sigma for the same target
    from pathlib import Path

    from dptrain.cli import main

    config = str(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml")
    code = main(["train", "--config", config, "--dry-run", "--output-dir", str(tmp_path / "r"),
                 f"privacy.epsilon={eps}", "privacy.sample_rate=0.01", "privacy.steps=10",
                 "privacy.accountant=prv"])
    plan = capsys.readouterr().out
    assert code == 0 and f"noise_multiplier: {obj['noise_multiplier']!r}" in plan, plan[:400]


@pytest.mark.parametrize("args", [["--config", "configs/tiny.yaml"],
                                  ["--config=configs/tiny.yaml", "--steps", "3"]])
def test_a_config_given_to_calibrate_is_pointed_to_the_dry_run(capsys, args):
    # argparse said "the following arguments are required: --epsilon, ...", as if those were
    # the mistake
    from dptrain.cli import main

    assert main(["calibrate", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dptrain calibrate: error: --config: ")
    assert "dptrain train --config FILE --dry-run" in err[0]


def test_a_target_prv_cannot_calibrate_says_sigma_was_calibrated_to_rdp(capsys):
    # above epsilon 100 sigma meets the target by RDP's bound, and the printed PRV epsilon is
    # far below the target: the output said "prv accountant", as if PRV had calibrated it
    argv = ["--epsilon", "200", "--delta", "1e-5", "--sample-rate", "0.01", "--steps", "10"]
    rc, out, err = _run([*argv, "--json"], capsys)
    obj = json.loads(out)
    assert rc == 0 and obj["accountant"] == "prv" and obj["calibrated_with"] == "rdp"
    sigma = _opacus_sigma(200.0, 1e-5, 0.01, 10)  # opacus' own RDP search
    assert obj["noise_multiplier"] == pytest.approx(sigma, rel=1e-9)
    rdp = opacus_epsilon("rdp", obj["noise_multiplier"], 0.01, 10, 1e-5)
    assert 200 - 0.01 <= rdp <= 200 and obj["epsilon"] < 190  # (PRV's, well below)
    assert err.count("calibrating to the RDP bound instead") == 1
    rc, out, _ = _run(argv, capsys)
    assert rc == 0 and out.rstrip().endswith(
        "(prv accountant; sigma calibrated to the RDP bound, which it meets within 0.01 of the "
        "target)")
    rc, out, _ = _run(["--epsilon", "8", *argv[2:], "--json"], capsys)
    assert json.loads(out)["calibrated_with"] == "prv"


def test_only_dptrain_s_accounting_warnings_reach_stderr(capsys, monkeypatch):
    # opacus' own notes (its RDP orders) are noise to the command; the fallback notice is not
    import warnings

    import dptrain.privacy.accounting as accounting

    real = accounting.calibrate

    def noisy(*args, **kwargs):
        warnings.warn("a library's note on its orders", UserWarning)
        warnings.warn("PRV not used; the RDP bound instead", accounting.AccountingWarning)
        return real(*args, **kwargs)

    monkeypatch.setattr(accounting, "calibrate", noisy)
    rc, out, err = _run([*BASE, "--delta", "1e-5", "--json"], capsys)
    assert rc == 0 and json.loads(out)["accountant"] == "rdp"
    assert err == "dptrain calibrate: warning: PRV not used; the RDP bound instead\n"
