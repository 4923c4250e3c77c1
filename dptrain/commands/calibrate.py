"""``dptrain calibrate``: the noise multiplier for a target (epsilon, delta).

    dptrain calibrate --epsilon 8 --delta 1/84122 --sample-rate 0.01 --steps 1000 [--json]

Numbers are taken as strings and validated here, so a bad value gives one line on stderr
(``dptrain calibrate: error: --delta: must be in (0, 1), got 1.5``) and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import warnings

PROG = "dptrain calibrate"


class _ArgError(Exception):
    def __init__(self, option: str, message: str):
        super().__init__(f"{option}: {message}")


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "calibrate",
        help="noise multiplier for a target (epsilon, delta)",
        description="Print the noise multiplier sigma such that STEPS Poisson-subsampled "
                    "Gaussian releases at SAMPLE_RATE spend at most EPSILON at DELTA "
                    "(opacus' accountants; the achieved epsilon is printed too).")
    p.add_argument("--epsilon", required=True, metavar="E", help="target epsilon (> 0)")
    p.add_argument("--delta", required=True, metavar="D",
                   help="target delta in (0, 1); 1/84122 and 1.19e-5 are both accepted")
    p.add_argument("--sample-rate", required=True, metavar="Q",
                   help="Poisson sampling rate in (0, 1]")
    p.add_argument("--steps", required=True, metavar="T", help="number of releases (>= 1)")
    p.add_argument("--accountant", default="prv", metavar="prv|rdp",
                   help="accountant (default: prv)")
    p.add_argument("--epsilon-tolerance", default=None, metavar="TOL",
                   help="bisection tolerance on epsilon (default: 0.01, or 1%% of a target "
                        "below 1)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)
    accept_negative_values(p)
    return p


def accept_negative_values(parser: argparse.ArgumentParser) -> None:
    """Let ``--delta -1/84122`` reach the range check (one line, exit 2) instead of argparse's
    usage and "expected one argument": argparse takes an argument starting with '-' for an
    option unless it looks like a plain negative number (``-1``, ``-.5``). Widened here to
    anything starting with '-' and a digit or '.digit' (no option of these commands does)."""
    import re

    parser._negative_number_matcher = re.compile(r"^-\.?\d")


def _number(option: str, text) -> float:
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        s = str(text).strip()
        try:
            if s.count("/") == 1:
                num, den = s.split("/")
                value = float(num) / float(den)
            else:
                value = float(s)
        except (ValueError, ZeroDivisionError):
            raise _ArgError(option, f"expected a number (like 1e-5 or 1/84122), "
                                    f"got {text!r}") from None
    if math.isnan(value):
        raise _ArgError(option, f"expected a number, got {text!r}")
    return value


def _integer(option: str, text) -> int:
    s = str(text).strip()
    try:
        return int(s)
    except ValueError:
        pass
    try:
        value = float(s)
    except ValueError:
        value = math.nan
    if math.isfinite(value) and value.is_integer():
        return int(value)
    raise _ArgError(option, f"expected an integer, got {text!r}")


def _validate(args) -> dict:
    eps = _number("--epsilon", args.epsilon)
    if not (eps > 0 and math.isfinite(eps)):
        raise _ArgError("--epsilon", f"must be > 0 and finite, got {args.epsilon}")
    delta = _number("--delta", args.delta)
    if not (0.0 < delta < 1.0):
        raise _ArgError("--delta", f"must be in (0, 1), got {args.delta}")
    q = _number("--sample-rate", args.sample_rate)
    from dptrain.privacy.accounting import MIN_SAMPLE_RATE

    if not (0.0 < q <= 1.0):
        raise _ArgError("--sample-rate", f"must be in (0, 1], got {args.sample_rate}")
    if q < MIN_SAMPLE_RATE:
        raise _ArgError("--sample-rate", f"{args.sample_rate} is below {MIN_SAMPLE_RATE:.4g}, "
                                         f"the smallest the accountants can take")
    steps = _integer("--steps", args.steps)
    if steps < 1:
        raise _ArgError("--steps", f"must be >= 1, got {args.steps}")
    from dptrain.privacy.accounting import MAX_STEPS

    if steps > MAX_STEPS:
        raise _ArgError("--steps", f"must be <= {MAX_STEPS:.0e} (the accountants cannot "
                                   f"handle more releases), got {args.steps}")
    accountant = str(args.accountant).strip().lower()
    if accountant not in ("prv", "rdp"):
        raise _ArgError("--accountant", f"must be prv or rdp, got {args.accountant!r}")
    tol = given = getattr(args, "epsilon_tolerance", None)
    if tol is None:
        from dptrain.privacy.accounting import default_epsilon_tolerance

        tol = default_epsilon_tolerance(eps)
    else:
        tol = _number("--epsilon-tolerance", tol)
        if not (tol > 0 and math.isfinite(tol)):
            raise _ArgError("--epsilon-tolerance",
                            f"must be finite and > 0, got {args.epsilon_tolerance}")
        given = tol
    return dict(epsilon=eps, delta=delta, sample_rate=q, steps=steps, accountant=accountant,
                epsilon_tolerance=tol, tolerance_given=given)


def _error(message: str) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return 2


def run(args) -> int:
    try:
        v = _validate(args)
    except _ArgError as e:
        return _error(str(e))

    from dptrain.config import ConfigError
    from dptrain.privacy.accounting import AccountingWarning, Ledger, calibrate, epsilon

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            # (a tolerance not given goes as None: the library's default, and an epsilon too
            # small for it is refused naming --epsilon, not a tolerance no one passed)
            sigma, calibrated_with = calibrate(v["epsilon"], v["delta"], v["sample_rate"],
                                               v["steps"], accountant=v["accountant"],
                                               epsilon_tolerance=v["tolerance_given"])
        except ConfigError as e:
            option = "--" + e.field.replace("_", "-") if e.field else ""
            return _error(f"{option}: {e.message}" if option else e.message)
        achieved = epsilon(Ledger([(sigma, v["sample_rate"], v["steps"])]), v["delta"],
                           v["accountant"])
    # opacus' notes about its RDP orders are noise here; our own fallback notice is not
    for w in caught:
        if issubclass(w.category, AccountingWarning):
            print(f"{PROG}: warning: {w.message}", file=sys.stderr)

    if args.json:
        print(json.dumps({
            "noise_multiplier": sigma,
            "epsilon": achieved,
            "target_epsilon": v["epsilon"],
            "delta": v["delta"],
            "sample_rate": v["sample_rate"],
            "steps": v["steps"],
            "accountant": v["accountant"],
            "calibrated_with": calibrated_with,
            "epsilon_tolerance": v["epsilon_tolerance"],
        }))
    else:
        # (sigma meets the target by RDP's bound where PRV could not be used: PRV's epsilon of
        # it, the one printed, may then be well below the target)
        print(f"noise_multiplier {sigma:.6g}: epsilon {achieved:.4f} (target {v['epsilon']:g}) "
              f"at delta {v['delta']:.4g} over {v['steps']} steps at sample rate "
              f"{v['sample_rate']:g} ({v['accountant']} accountant"
              + (f"; sigma calibrated to the RDP bound, which it meets within "
                 f"{v['epsilon_tolerance']:g} of the target)"
                 if calibrated_with != v["accountant"] else ")"))
    return 0
