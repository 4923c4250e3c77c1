"""Privacy accounting: a ledger of releases, epsilon from it, and calibration of sigma.

Accounting is derived, not re-specified: the trainer records one entry per Gaussian release
``(noise_multiplier, sample_rate)`` as it happens, and epsilon is computed from that record with
opacus' accountants (nothing here reimplements them):

- ``"prv"``: ``opacus.accountants.PRVAccountant`` (Gopi et al. 2021). ``get_epsilon`` reports
  the *upper* end of its error interval, ``eps_upper = eps(delta - delta_error) + eps_error``
  with ``eps_error = 0.01`` and ``delta_error = delta / 1000`` by default, so the reported number
  is an upper bound, not an estimate, up to the accountant's numerics (docs/privacy.md: at
  extreme settings it was measured 0.2% below the ``prv_accountant`` package's interval).
- ``"rdp"``: ``opacus.accountants.RDPAccountant`` (Mironov et al.; opacus' default orders and
  its RDP-to-(epsilon, delta) conversion).

Both assume the Poisson-subsampled Gaussian mechanism under add/remove-one adjacency with
sensitivity C (one example's clipped contribution), which is what the trainer releases.

Two deviations from calling opacus directly, both conservative:

- ``sigma == 0`` (no noise) gives ``epsilon = inf`` instead of a crash.
- When PRV's discretisation would need more than :data:`PRV_MAX_DOMAIN` grid points (this only
  happens for epsilons in the hundreds or more, e.g. sigma=0.001, and for runs of about a
  million steps or more: 1e6 steps at q=0.001 and sigma=0.65, epsilon 18.8 by RDP) or PRV
  fails numerically,
  the RDP bound is returned instead with a :class:`AccountingWarning`; it is a valid, looser
  upper bound. The same holds when PRV returns a non-finite epsilon for releases with sigma > 0
  (it gives inf for very large privacy losses, e.g. sigma=0.05 at q=0.5).
"""

from __future__ import annotations

import copy
import math
import numbers
import sys
import warnings
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from dptrain.config import ConfigError

__all__ = [
    "ACCOUNTANTS",
    "AccountingWarning",
    "CalibratedToRDP",
    "MAX_STEPS",
    "Budget",
    "Ledger",
    "PRV_MAX_DOMAIN",
    "Calibration",
    "calibrate",
    "calibrate_noise_multiplier",
    "check_plan",
    "epsilon",
    "would_exceed",
]

ACCOUNTANTS = ("prv", "rdp")
DEFAULT_EPS_ERROR = 0.01
PRV_MAX_DOMAIN = 1 << 24
"""Largest PRV grid (points) computed; ~5M points already take seconds and ~0.5 GB."""

MAX_TARGET_EPSILON = 1e6
"""The largest target epsilon :func:`calibrate_noise_multiplier` takes."""
PRV_MAX_CALIBRATION_EPSILON = 100.0
"""Above this target, :func:`calibrate_noise_multiplier` with ``prv`` calibrates to RDP's bound
(with an :class:`AccountingWarning`): opacus' PRV search there takes minutes, or never ends."""
EPSILON_ROUNDING = 1e-12
"""How far (relative) a plan's epsilon may be above its target: float rounding only (a sigma
calibrated just under the target, recomputed by another route). It was 1e-9, which let a plan
through 1.4e-9 above its target."""
MAX_STEPS = 10**9
"""Most releases a plan may have. Far beyond any training run; opacus' accountants break down
numerically on larger counts (PRV cannot allocate its grid, RDP's bound turns negative near
1e30 and its calibration then never ends), so larger ``steps`` are refused up front."""
#: the smallest sample rate: the smallest normal float64 (opacus' RDP and the PRV accountant
#: divide by zero at a subnormal one)
MIN_SAMPLE_RATE = sys.float_info.min

_LEDGER_FORMAT = 1

OPACUS_ORDER_NOTE = "Optimal order is the"
"""The start of opacus' note that the best RDP order is at the edge of its list (a bound that
more orders could tighten): not a result, and noise to a dptrain command, which filters it."""


class AccountingWarning(UserWarning):
    """The requested accountant could not be used; a looser valid bound was reported."""


class CalibratedToRDP(AccountingWarning):
    """:func:`calibrate` could not use PRV: the sigma returned meets the target by RDP's
    (looser) bound, and PRV's epsilon of it may be well below the target."""


def _check_sigma(sigma) -> float:
    if isinstance(sigma, bool) or not isinstance(sigma, numbers.Real):
        raise TypeError(f"noise_multiplier must be a number, got {sigma!r}")
    sigma = float(sigma)
    if not (sigma >= 0 and math.isfinite(sigma)):
        raise ValueError(f"noise_multiplier must be finite and >= 0, got {sigma}")
    return sigma


def _check_q(q) -> float:
    if isinstance(q, bool) or not isinstance(q, numbers.Real):
        raise TypeError(f"sample_rate must be a number, got {q!r}")
    q = float(q)
    if not (0.0 < q <= 1.0):
        raise ValueError(f"sample_rate must be in (0, 1], got {q}")
    if q < MIN_SAMPLE_RATE:
        raise ValueError(f"sample_rate {q} is below {MIN_SAMPLE_RATE:.4g}, the smallest the "
                         f"accountants can take")
    return q


def _check_count(count) -> int:
    if isinstance(count, bool) or not isinstance(count, numbers.Integral):
        raise TypeError(f"count must be an integer, got {count!r}")
    count = int(count)
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    return count


def _check_delta(delta) -> float:
    delta = float(delta)
    if not (0.0 < delta < 1.0):
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    return delta


def _check_accountant(accountant: str) -> str:
    if accountant not in ACCOUNTANTS:
        raise ValueError(f"accountant must be one of {', '.join(ACCOUNTANTS)}, got {accountant!r}")
    return accountant


@dataclass
class Ledger:
    """The releases made so far, as opacus history entries ``(sigma, q, num_steps)``.

    ``record`` merges a release into the last entry when ``(sigma, q)`` are equal (exactly as
    opacus' ``step`` does), so T equal releases are one entry ``(sigma, q, T)``.
    """

    history: list[tuple[float, float, int]] = field(default_factory=list)

    def __post_init__(self):
        entries, self.history = list(self.history), []
        for entry in entries:
            if len(entry) != 3:
                raise ValueError(f"a ledger entry is (noise_multiplier, sample_rate, "
                                 f"num_steps), got {entry!r}")
            self.record(*entry)

    def record(self, sigma: float, q: float, count: int = 1) -> None:
        """Append ``count`` releases with noise multiplier ``sigma`` at sample rate ``q``."""
        sigma, q, count = _check_sigma(sigma), _check_q(q), _check_count(count)
        if self.history and self.history[-1][0] == sigma and self.history[-1][1] == q:
            self.history[-1] = (sigma, q, self.history[-1][2] + count)
        else:
            self.history.append((sigma, q, count))

    @property
    def num_releases(self) -> int:
        return sum(n for _, _, n in self.history)

    def copy(self) -> "Ledger":
        return Ledger(copy.deepcopy(self.history))

    def epsilon(self, delta: float, accountant: str = "prv", **kwargs) -> float:
        return epsilon(self, delta, accountant, **kwargs)

    def to_dict(self) -> dict:
        """JSON-safe form (for checkpoints); floats round-trip exactly through JSON."""
        return {"format": _LEDGER_FORMAT,
                "history": [[float(s), float(q), int(n)] for s, q, n in self.history]}

    @classmethod
    def from_dict(cls, data: dict) -> "Ledger":
        if not isinstance(data, dict) or "history" not in data:
            raise ValueError("not a ledger: expected a mapping with a 'history' list")
        fmt = data.get("format", _LEDGER_FORMAT)
        if fmt != _LEDGER_FORMAT:
            raise ValueError(f"unsupported ledger format {fmt!r} (this version reads "
                             f"{_LEDGER_FORMAT})")
        return cls([tuple(e) for e in data["history"]])


def _rdp_epsilon(history, delta: float) -> float:
    from opacus.accountants import RDPAccountant

    acc = RDPAccountant()
    acc.history = list(history)
    return float(acc.get_epsilon(delta=delta))


def _prv_accountant(history, delta: float, eps_error: float):
    """``(accountant, size)``: a PRVAccountant on ``history`` and the points of the grid its
    ``get_epsilon(delta, eps_error=eps_error)`` will build (size None where this opacus has no
    ``_get_domain``). The grid's domain is computed here, once: its bound is the costly part
    of an epsilon (an RDP computation over opacus' orders, half of calibrate's time and
    seconds at large sigma), and opacus computed it again in ``get_epsilon``; that call
    takes the same domain (for the same arguments, opacus' default ``delta_error``)."""
    from opacus.accountants import PRVAccountant
    from opacus.accountants.analysis.prv import PoissonSubsampledGaussianPRV

    acc = PRVAccountant()
    acc.history = list(history)
    get_domain = getattr(acc, "_get_domain", None)
    if get_domain is None:
        return acc, None
    key = ([(s, q) for s, q, _ in history], [n for _, _, n in history], eps_error,
           delta / 1000)  # opacus' default delta_error
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        domain = get_domain(prvs=[PoissonSubsampledGaussianPRV(q, s) for s, q, _ in history],
                            num_self_compositions=key[1], eps_error=eps_error,
                            delta_error=key[3])

    def same_domain(*, prvs, num_self_compositions, eps_error, delta_error):
        asked = ([(p.noise_multiplier, p.sample_rate) for p in prvs],
                 list(num_self_compositions), eps_error, delta_error)
        if asked == key:
            return domain
        return get_domain(prvs=prvs, num_self_compositions=num_self_compositions,
                          eps_error=eps_error, delta_error=delta_error)

    acc._get_domain = same_domain  # (an instance attribute: this accountant only)
    return acc, domain.size


def _prv_epsilon(history, delta: float, eps_error: float) -> float:
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        try:
            acc, size = _prv_accountant(history, delta, eps_error)
            if size is not None and size > PRV_MAX_DOMAIN:
                reason = f"its grid would need {size} points (> {PRV_MAX_DOMAIN})"
            else:
                eps = float(acc.get_epsilon(delta=delta, eps_error=eps_error))
                if math.isfinite(eps):
                    return eps
                # opacus' PRV gives inf (not an error) when the privacy loss is too large for
                # its grid, e.g. sigma 0.05 at q 0.5, where RDP still has a finite bound
                reason = f"it returned {eps}"
        except (MemoryError, ValueError, RuntimeError, OverflowError) as e:
            reason = f"it failed ({type(e).__name__}: {e})"
    warnings.warn(f"PRV accountant not used because {reason}; reporting the (looser, valid) "
                  f"RDP bound instead", AccountingWarning, stacklevel=3)
    return _rdp_epsilon(history, delta)


NEGLIGIBLE_SIGMA = 1e-100
"""A noise multiplier below this counts as none (:func:`epsilon` gives inf)."""


def epsilon(ledger: Ledger, delta: float, accountant: str = "prv", *,
            eps_error: float = DEFAULT_EPS_ERROR) -> float:
    """Epsilon spent by the releases in ``ledger`` at ``delta``, with opacus' semantics.

    Equals ``PRVAccountant.get_epsilon(delta, eps_error=eps_error)`` (upper end of the error
    interval) or ``RDPAccountant.get_epsilon(delta)`` on ``ledger.history``, except that a
    negative value (opacus' PRV and RDP give one when delta exceeds what the releases can
    spend, e.g. delta = 0.1 with every example's chance of ever being sampled 0.05) is reported
    as 0.0: (0, delta)-DP is the weaker, valid statement, and epsilon < 0 is no DP guarantee
    anyone states. An empty ledger gives 0.0; any release with sigma = 0, or below
    ``NEGLIGIBLE_SIGMA`` (1e-100: epsilon would be above 1e200, and opacus' series for
    fractional RDP orders never end below about 1e-153), gives inf.
    """
    delta = _check_delta(delta)
    _check_accountant(accountant)
    if not isinstance(ledger, Ledger):
        raise TypeError(f"ledger must be a dptrain Ledger, got {type(ledger).__name__}")
    if (isinstance(eps_error, bool) or not isinstance(eps_error, numbers.Real)
            or not (math.isfinite(eps_error) and eps_error > 0)):
        # (0, -1 and NaN fell back to RDP behind a note about opacus' internals; a string was
        # a TypeError from opacus)
        raise ConfigError("eps_error", f"must be a finite number > 0, got {eps_error!r}")
    # (Ledger refuses counts below 1; a history appended to by hand may still hold them)
    history = [(s, q, n) for s, q, n in ledger.history if n > 0]
    if not history:
        return 0.0
    if any(s < NEGLIGIBLE_SIGMA for s, _, _ in history):
        return math.inf
    if accountant == "rdp":
        return max(0.0, _rdp_epsilon(history, delta))
    return max(0.0, _prv_epsilon(history, delta, eps_error))


def default_epsilon_tolerance(epsilon: float) -> float:
    """The calibration's tolerance when none is given: 0.01, or 1% of a target below 1 (a fixed
    0.01 would be refused at targets of 0.01 and below, and be loose just above them)."""
    return min(0.01, 0.01 * epsilon)


class Calibration(NamedTuple):
    """What :func:`calibrate` found: sigma, and the accountant whose bound it meets the target
    by (``rdp`` where ``prv`` was asked for and could not be used)."""

    noise_multiplier: float
    calibrated_with: str


def calibrate_noise_multiplier(epsilon: float, delta: float, sample_rate: float, steps: int,
                               accountant: str = "prv",
                               epsilon_tolerance: float | None = None) -> float:
    """The noise multiplier of :func:`calibrate` (which also says which accountant's bound it
    meets the target by)."""
    return calibrate(epsilon, delta, sample_rate, steps, accountant,
                     epsilon_tolerance).noise_multiplier


def calibrate(epsilon: float, delta: float, sample_rate: float, steps: int,
              accountant: str = "prv", epsilon_tolerance: float | None = None) -> Calibration:
    """Smallest sigma (to ``epsilon_tolerance``; None: :func:`default_epsilon_tolerance`) with
    ``steps`` releases at rate ``sample_rate`` spending at most ``epsilon`` at ``delta``
    (where epsilon is flat in sigma, near PRV's 0.01 floor, the first sigma within the
    tolerance: docs/privacy.md, "Calibration").

    Runs ``opacus.accountants.utils.get_noise_multiplier``'s doubling then bisection search on
    opacus' accountants (:func:`_search_sigma`: the same probes, with PRV grids bounded in
    size); the returned sigma's epsilon, computed by :func:`epsilon`, is <= the target and
    within ``epsilon_tolerance`` of it. Where PRV cannot be used (a target above
    ``PRV_MAX_CALIBRATION_EPSILON``, or a PRV failure at the sigma found), the search is redone
    with the RDP accountant, with a :class:`CalibratedToRDP` warning: RDP's bound is then within
    the tolerance of the target (``calibrated_with`` is ``rdp``), and PRV's epsilon of that
    sigma, where it can be computed, may be further below. Raises ConfigError (a ValueError)
    naming the bad argument.
    """
    # (bool is a Real: epsilon=True calibrated for 1.0; a string said "must be > 0, got 4")
    for name, value in (("epsilon", epsilon), ("delta", delta), ("sample_rate", sample_rate)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ConfigError(name, f"must be a number, got {value!r}")
    if not (epsilon > 0 and math.isfinite(epsilon)):
        raise ConfigError("epsilon", f"must be > 0 and finite, got {epsilon}")
    if not 0.0 < delta < 1.0:
        raise ConfigError("delta", f"must be in (0, 1), got {delta}")
    if not 0.0 < sample_rate <= 1.0:
        raise ConfigError("sample_rate", f"must be in (0, 1], got {sample_rate}")
    if sample_rate < MIN_SAMPLE_RATE:
        raise ConfigError("sample_rate", f"{sample_rate} is below {MIN_SAMPLE_RATE:.4g}, the "
                                         f"smallest the accountants can take")
    if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 1:
        raise ConfigError("steps", f"must be an integer >= 1, got {steps}")
    if steps > MAX_STEPS:
        raise ConfigError("steps", f"must be <= {MAX_STEPS:.0e} (the accountants cannot "
                                   f"handle more releases), got {steps}")
    if accountant not in ACCOUNTANTS:
        raise ConfigError("accountant", f"must be one of {', '.join(ACCOUNTANTS)}, "
                                        f"got {accountant!r}")
    if epsilon > MAX_TARGET_EPSILON:
        # opacus' bisection never ends there (1e15: no result after minutes)
        raise ConfigError("epsilon", f"must be <= {MAX_TARGET_EPSILON:.0e} to calibrate sigma "
                                     f"(no privacy guarantee is left above it; set the noise "
                                     f"multiplier itself), got {epsilon:g}")
    if epsilon_tolerance is None:
        epsilon_tolerance = default_epsilon_tolerance(epsilon)
        if not 0 < epsilon_tolerance < epsilon:
            # (epsilon 5e-324: 1% of it is 0) the caller named no tolerance: name epsilon
            raise ConfigError("epsilon", f"{epsilon:g} is too small to calibrate sigma for "
                                         "(its default tolerance, 1% of it, underflows)")
    if not (epsilon_tolerance > 0) or not math.isfinite(epsilon_tolerance):
        raise ConfigError("epsilon_tolerance", f"must be > 0, got {epsilon_tolerance}")
    # below ~1e-9 relative the search's float rounding cannot meet it (it looped forever), and a
    # tolerance >= epsilon would accept any sigma up to the doubling's first bracket
    # (with a relative slack: 1e-9 * 1000 is 1.0000000000000002e-06 in floats, and the printed
    # lower end, 1e-06, was refused)
    if not (1e-9 * epsilon * (1 - 1e-12) <= epsilon_tolerance < epsilon):
        raise ConfigError("epsilon_tolerance", f"must be in [1e-9 x epsilon, epsilon) = "
                                               f"[{1e-9 * epsilon:.3g}, {epsilon:g}), got "
                                               f"{epsilon_tolerance:g}")

    def with_rdp(why: str) -> Calibration:
        warnings.warn(f"{why}; calibrating to the RDP bound instead", CalibratedToRDP,
                      stacklevel=3)
        return calibrate(epsilon, delta, sample_rate, steps, "rdp", epsilon_tolerance)

    if accountant == "prv" and epsilon > PRV_MAX_CALIBRATION_EPSILON:
        # opacus' PRV search at such targets takes minutes and GBs per call (epsilon 1e3: over
        # 100 s for 2 steps), and never ends near 1e15; RDP's search takes a second
        return with_rdp(f"opacus' PRV search is impractical above epsilon "
                        f"{PRV_MAX_CALIBRATION_EPSILON:g}")
    try:
        # the bisection's probes are not results: silence opacus' notes about its RDP orders
        with np.errstate(divide="ignore", over="ignore", invalid="ignore"), \
                warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=OPACUS_ORDER_NOTE, category=UserWarning)
            sigma, judged_by_rdp = _search_sigma(float(epsilon), float(delta),
                                                 float(sample_rate), int(steps), accountant,
                                                 float(epsilon_tolerance))
    except ValueError as e:
        if "budget is too low" in str(e):
            from opacus.accountants.utils import MAX_SIGMA

            # (PRV's bound never goes below its error margin: no hint to use it down there)
            hint = ("; the prv accountant certifies smaller epsilons" if accountant == "rdp"
                    and epsilon > DEFAULT_EPS_ERROR
                    else f"; PRV's bound includes its error margin of {DEFAULT_EPS_ERROR:g}, "
                         f"so it never goes below that" if accountant == "prv"
                         and epsilon <= 2 * DEFAULT_EPS_ERROR
                    else "")
            raise ConfigError("epsilon", f"{epsilon} at delta={delta} is unreachable with "
                                         f"{steps} steps at sample rate {sample_rate}: no "
                                         f"sigma up to {MAX_SIGMA:.0e} gets the {accountant} "
                                         f"accountant's bound below it{hint}") from None
        if "small values of delta" in str(e):  # opacus' PRV: float error would dominate
            hint = "; use accountant rdp or a larger delta" if accountant == "prv" else ""
            raise ConfigError("delta", f"{delta} is too small for the {accountant} accountant "
                                       f"(floating-point errors would dominate){hint}") from None
        raise ConfigError("steps", _accountant_failed(accountant, steps, e)) from None
    except (MemoryError, OverflowError) as e:
        raise ConfigError("steps", _accountant_failed(accountant, steps, e)) from None
    except RuntimeError as e:
        # opacus' PRV raises "Cannot compute epsilon" at a bisection probe whose privacy loss
        # its grid cannot hold, e.g. when q * steps is far below delta and every probe meets the
        # target until sigma is tiny; epsilon() reports RDP's bound there, so calibrate to it
        if accountant != "prv":
            raise ConfigError("steps", _accountant_failed(accountant, steps, e)) from None
        return with_rdp(f"the PRV accountant failed during calibration ({e})")
    if accountant == "prv":
        # epsilon() reports RDP's looser bound where PRV cannot be used (see the module
        # docstring); the calibrated sigma must meet the target as epsilon() reports it
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=AccountingWarning)
            warnings.filterwarnings("ignore", message=OPACUS_ORDER_NOTE, category=UserWarning)
            achieved = _epsilon_of(sigma, sample_rate, steps, delta, "prv")
        if achieved > epsilon * (1 + EPSILON_ROUNDING):
            return with_rdp(f"the PRV accountant cannot be used at the calibrated sigma "
                            f"{float(sigma):.6g}")
    return Calibration(float(sigma), "rdp" if judged_by_rdp else accountant)


def _search_sigma(epsilon: float, delta: float, q: float, steps: int, accountant: str,
                  tolerance: float) -> tuple[float, bool]:
    """opacus' ``get_noise_multiplier`` search, probe for probe (sigma doubled from 20 until
    the target is met, then bisection until within ``tolerance`` below it; the bracket's upper
    end is returned), except that a PRV probe whose grid would exceed ``PRV_MAX_DOMAIN`` points
    takes RDP's epsilon, an upper bound of PRV's: opacus builds every probe's grid, and a probe
    far below the answer needed GBs (1e6 steps at q = 0.001: over 8 GB and minutes). A probe
    judged by the looser bound moves the bracket's upper end only where PRV's epsilon would
    move it too (RDP's within the target means PRV's is), and otherwise raises its lower end,
    perhaps where PRV would not: the sigma found is the same or slightly larger (more noise),
    never below the target's. Returns sigma, and whether RDP judged it. Raises opacus' errors
    (ValueError "The privacy budget is too low." past sigma 1e6)."""
    from opacus.accountants import RDPAccountant
    from opacus.accountants.utils import MAX_SIGMA

    by_rdp: dict[float, int] = {}  # PRV probes judged by RDP: sigma -> PRV's grid size

    def probe(sigma: float) -> float:
        history = [(sigma, q, steps)]
        if accountant == "prv":
            acc, size = _prv_accountant(history, delta, DEFAULT_EPS_ERROR)
            if size is None or size <= PRV_MAX_DOMAIN:
                return acc.get_epsilon(delta=delta, eps_error=DEFAULT_EPS_ERROR)
            by_rdp[sigma] = size
        acc = RDPAccountant()
        acc.history = history
        return acc.get_epsilon(delta=delta)

    eps_high, sigma_low, sigma_high = math.inf, 0.0, 10.0
    while eps_high > epsilon:
        sigma_high = 2 * sigma_high
        eps_high = probe(sigma_high)
        if sigma_high > MAX_SIGMA:
            raise ValueError("The privacy budget is too low.")
    while epsilon - eps_high > tolerance:
        sigma = (sigma_low + sigma_high) / 2
        eps = probe(sigma)
        if eps < epsilon:
            sigma_high, eps_high = sigma, eps
        else:
            sigma_low = sigma
    if sigma_high in by_rdp:
        warnings.warn(f"PRV's grid at sigma {sigma_high:.6g} would need {by_rdp[sigma_high]} "
                      f"points (> {PRV_MAX_DOMAIN}); calibrated to the RDP bound there",
                      CalibratedToRDP, stacklevel=3)
    return sigma_high, sigma_high in by_rdp


def _epsilon_of(sigma: float, q: float, steps: int, delta: float, accountant: str) -> float:
    """:func:`epsilon` of ``steps`` releases (sigma, q) (calibrate_noise_multiplier's own
    ``epsilon`` argument hides the function there)."""
    return epsilon(Ledger([(float(sigma), float(q), int(steps))]), delta, accountant)


def _accountant_failed(accountant: str, steps: int, e: BaseException) -> str:
    hint = "; try accountant rdp or fewer steps" if accountant == "prv" else "; use fewer steps"
    reason = " ".join(str(e).split()) or type(e).__name__
    return f"the {accountant} accountant failed on {steps} releases ({reason}){hint}"


def would_exceed(ledger: Ledger, sigma: float, q: float, delta: float,
                 target_epsilon: float | None, accountant: str = "prv", count: int = 1,
                 *, eps_error: float = DEFAULT_EPS_ERROR) -> bool:
    """Whether ``count`` more releases ``(sigma, q)`` after ``ledger`` would spend more than
    ``target_epsilon``, judged as :func:`check_plan` judges a plan (up to
    ``EPSILON_ROUNDING``, the float rounding of another route to the same epsilon: a run
    :func:`check_plan` accepted is not stopped at its last release). ``None`` (no budget) never
    exceeds. Costs one accountant call."""
    if target_epsilon is None:
        return False
    if (isinstance(target_epsilon, bool) or not isinstance(target_epsilon, numbers.Real)
            or not (math.isfinite(target_epsilon) and target_epsilon > 0)):
        # (a NaN budget never tripped: every comparison with NaN is False)
        raise ConfigError("epsilon", f"the budget must be a finite number > 0 or None, got "
                                     f"{target_epsilon!r}")
    after = ledger.copy()
    after.record(sigma, q, count)
    return (epsilon(after, delta, accountant, eps_error=eps_error)
            > float(target_epsilon) * (1 + EPSILON_ROUNDING))


def check_plan(cfg, sigma: float, *, ledger: Ledger | None = None,
               advice: str | None = None) -> float:
    """Epsilon of the planned run; raise ConfigError if it exceeds ``cfg.epsilon``.

    The plan is ``cfg.steps`` releases in total at ``(sigma, cfg.sample_rate)``; with ``ledger``
    (a resumed run) the releases already made count and only the remaining
    ``cfg.steps - ledger.num_releases`` are added. The error names ``privacy.noise_multiplier``
    when sigma was set by the user and ``privacy.steps`` otherwise; ``advice`` replaces what it
    says to change.
    """
    plan = ledger.copy() if ledger is not None else Ledger()
    remaining = cfg.steps - plan.num_releases
    if remaining > 0:
        plan.record(sigma, cfg.sample_rate, remaining)
    try:
        # a refused plan is one line: opacus' notes on its RDP orders, and our own note that
        # PRV fell back to RDP, would come before it (the latter is re-issued if the plan is
        # accepted, and is part of the error otherwise)
        with warnings.catch_warnings(record=True) as notes:
            warnings.simplefilter("always", AccountingWarning)
            warnings.filterwarnings("ignore", message=OPACUS_ORDER_NOTE, category=UserWarning)
            eps = epsilon(plan, cfg.delta, cfg.accountant)
    except (MemoryError, OverflowError, ValueError, ZeroDivisionError) as e:
        # (sigma 1e300: opacus' sigma^2 overflows; below NEGLIGIBLE_SIGMA epsilon is inf)
        if cfg.noise_multiplier is not None and cfg.noise_multiplier > 1e100:
            raise ConfigError("privacy.noise_multiplier",
                              f"{cfg.noise_multiplier:g} is beyond what the {cfg.accountant} "
                              f"accountant can handle ({type(e).__name__})") from None
        raise ConfigError("privacy.steps",
                          _accountant_failed(cfg.accountant, cfg.steps, e)) from None
    # a calibrated sigma meets the target, up to the float rounding of another route to it
    if cfg.epsilon is not None and eps > cfg.epsilon * (1 + EPSILON_ROUNDING):
        field_name = ("privacy.noise_multiplier" if cfg.noise_multiplier is not None
                      else "privacy.steps")
        advice = advice or ("raise noise_multiplier, lower steps or sample_rate, or leave "
                            "noise_multiplier null to calibrate it")
        shown, target = _apart(eps, cfg.epsilon)
        raise ConfigError(
            field_name,
            f"the plan spends epsilon={shown} > the budget (target epsilon) {target} "
            f"({cfg.steps} steps, noise_multiplier={sigma:g}, sample_rate={cfg.sample_rate:g}, "
            f"delta={cfg.delta:g}, {cfg.accountant}); {advice}"
            + "".join(f" ({n.message})" for n in notes
                      if issubclass(n.category, AccountingWarning)))
    for n in notes:  # the plan stands: say what its epsilon rests on
        warnings.warn_explicit(n.message, n.category, n.filename, n.lineno)
    return eps


def _apart(value: float, other: float) -> tuple[str, str]:
    """``value`` and ``other`` with 4 significant digits, or as many more as make them read
    apart (an epsilon just above its target read "epsilon=8 > the budget 8"; ``other`` at
    least as ``:g`` writes it)."""
    for digits in range(4, 18):
        a, b = f"{value:.{digits}g}", f"{other:.{max(digits, 6)}g}"
        if float(a) > float(b):  # (value > other: read so, at enough digits)
            return a, b
    return repr(value), repr(other)


class Budget:
    """Budget checks, grouped: ``Budget.check_plan(cfg, sigma)`` before training (what the
    trainer does); ``Budget.would_exceed(ledger, sigma, q, delta, target_epsilon)``, whether
    further releases after a ledger would exceed a target, for a loop of one's own (the
    trainer does not call it)."""

    check_plan = staticmethod(check_plan)
    would_exceed = staticmethod(would_exceed)
