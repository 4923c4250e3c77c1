"""Seconds per PRV epsilon and per calibration: dptrain's against opacus' own, same run.

    python bench/accounting.py [--rounds 5]

``dptrain.privacy.accounting.epsilon`` (PRV) first computes the size of the grid opacus' PRV
accountant would build, to fall back to RDP's bound where the grid would be too large. That
size comes from the grid's domain, whose bound is the costly part of an epsilon (an RDP
computation over opacus' orders); opacus' ``get_epsilon`` computed it again. Since stop 50 the
domain is computed once and handed to the accountant (``_prv_accountant``). This times, in
interleaved rounds (bench/common.py), on the settings below:

- ``epsilon``: dptrain's ``epsilon(ledger, delta, "prv")`` and ``PRVAccountant.get_epsilon``;
- ``calibrate``: dptrain's ``calibrate_noise_multiplier`` and opacus' ``get_noise_multiplier``
  (the same probes, where no grid is too large: tests/test_accounting.py checks the sigma is
  the same bit for bit).

The results are checked equal before timing (a mismatch is an error, not a row). The last line
printed is one JSON object with the medians and ``dptrain_over_opacus`` per row.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import (git_commit, load_average, machine_description, median,  # noqa: E402
                    now_utc, time_interleaved)

from dptrain.privacy.accounting import Ledger, calibrate_noise_multiplier, epsilon  # noqa: E402

# (label, sigma, q, steps, delta): a typical fine-tuning run, ImageNet's setting (stop 22's
# configs), and a large-sigma one where the domain's RDP bound is slow
EPSILON_SETTINGS = [("q=0.01 T=1000", 0.59, 0.01, 1000, 1e-5),
                    ("q=0.0256 T=18000", 14.8, 0.0256, 18000, 8e-7),
                    ("q=0.5 T=10 sigma=5120", 5120.0, 0.5, 10, 1e-5)]
# (label, epsilon, q, steps, delta)
CALIBRATE_SETTINGS = [("eps 8, q=0.01 T=1000", 8.0, 0.01, 1000, 1e-5)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)

    from opacus.accountants import PRVAccountant
    from opacus.accountants.utils import get_noise_multiplier

    def opacus_epsilon(sigma, q, steps, delta):
        acc = PRVAccountant()
        acc.history = [(sigma, q, steps)]
        return acc.get_epsilon(delta=delta)

    steps, expected = {}, {}
    for label, sigma, q, t, delta in EPSILON_SETTINGS:
        def ours(sigma=sigma, q=q, t=t, delta=delta):
            return epsilon(Ledger([(sigma, q, t)]), delta, "prv")

        def theirs(sigma=sigma, q=q, t=t, delta=delta):
            return opacus_epsilon(sigma, q, t, delta)

        steps[f"epsilon {label} | dptrain"], steps[f"epsilon {label} | opacus"] = ours, theirs
    for label, eps, q, t, delta in CALIBRATE_SETTINGS:
        def ours(eps=eps, q=q, t=t, delta=delta):
            return calibrate_noise_multiplier(eps, delta, q, t)

        def theirs(eps=eps, q=q, t=t, delta=delta):
            return get_noise_multiplier(target_epsilon=eps, target_delta=delta, sample_rate=q,
                                        steps=t, accountant="prv", epsilon_tolerance=0.01)

        steps[f"calibrate {label} | dptrain"] = ours
        steps[f"calibrate {label} | opacus"] = theirs
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, fn in steps.items():
            expected.setdefault(name.split(" | ")[0], set()).add(fn())
        wrong = {row: values for row, values in expected.items() if len(values) != 1}
        if wrong:
            print(f"results differ between dptrain and opacus: {wrong}", file=sys.stderr)
            return 1
        times, errors = time_interleaved(steps, rounds=args.rounds, warmup=0)
    print(f"{now_utc()} · {machine_description()} · commit {git_commit()} · "
          f"load {load_average()} · {args.rounds} rounds")
    print("\n| row | dptrain s | opacus s | dptrain / opacus |")
    print("|---|---|---|---|")
    result = {"rows": {}, "errors": errors}
    for row in expected:
        ours, theirs = median(times.wall.get(f"{row} | dptrain")), \
            median(times.wall.get(f"{row} | opacus"))
        if ours is None or theirs is None:
            continue
        print(f"| {row} | {ours:.3f} | {theirs:.3f} | {ours / theirs:.2f} |")
        result["rows"][row] = {"dptrain_s": ours, "opacus_s": theirs,
                               "dptrain_over_opacus": ours / theirs}
    print(json.dumps(result))
    return 0 if not errors else 1


if __name__ == "__main__":
    sys.exit(main())
