"""The reference for dptrain's accounting in the tests: opacus' own accountants."""

from __future__ import annotations


def opacus_epsilon(accountant: str, sigma: float, q: float, steps: int, delta: float,
                   **kwargs) -> float:
    """Epsilon after ``steps`` releases at noise multiplier ``sigma`` and sample rate ``q``, by
    opacus' ``PRVAccountant`` ("prv") or ``RDPAccountant`` ("rdp"); ``kwargs`` go to
    ``get_epsilon`` (e.g. ``eps_error``)."""
    from opacus.accountants import PRVAccountant, RDPAccountant

    acc = {"prv": PRVAccountant, "rdp": RDPAccountant}[accountant]()
    acc.history = [(sigma, q, steps)]
    return acc.get_epsilon(delta, **kwargs)
