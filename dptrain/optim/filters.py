"""Filters on the release, applied to ``p.grad`` before the optimizer: identity, DiSK, DOPPLER.

A filter has two faces:

- ``query_plan(named_params)``: what each example's query is, as a list of
  ``(coefficient, parameter values or None)``; None means the current parameters. The clipping
  engine evaluates ``sum_j coefficient_j * grad l(theta_j; x_i)`` and clips it as ONE query.
  The coefficients are public (functions of the config), so they cost no privacy.
- ``apply(named_params)``: after the release is in ``p.grad``, replace it by the filter's output
  and remember what the filter needs (its state, and for DiSK the current parameters x_t).

``noise_gain()`` is the coefficient of the latest release in the output (DP-MuonBC needs it).
Everything is keyed by parameter name, so ``state_dict`` survives resharding (a change of
parameter groups is refused by ``DPOptimizer.check_groups``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterator, Literal

import numpy as np
import torch
from torch import Tensor

from dptrain.config import FLOAT32_TINY, ConfigError, refuse_unused

__all__ = ["FilterConfig", "Filter", "DiSKFilter", "DopplerFilter", "FILTERS", "build_filter",
           "QueryPlan"]

NamedParams = list[tuple[str, torch.nn.Parameter]]
#: a filter's plan: [(coefficient, {name: values} or None = the current ones), ...]; the
#: engine's ``QueryPlan`` (dptrain.clipping.engine) is the general form: per-parameter
#: coefficients, an RNG seed and a view per entry (inner momentum's plans, augmentation)
QueryPlan = list[tuple]


@dataclass(kw_only=True)
class FilterConfig:
    name: Literal["none", "disk", "doppler"] = "none"
    """Filter on the release before the optimizer: none, disk (Kalman) or doppler (low-pass)."""
    kappa: float = 0.7
    """DiSK: filter gain, read in ``convention``. disk_paper: weight of the NEW release,
    g_t = (1-kappa)*g_{t-1} + kappa*g_{t+1/2}. im_paper: weight of the PREVIOUS state,
    g_t = kappa*g_{t-1} + (1-kappa)*g_{t+1/2}. kappa = 1 (disk_paper) switches the filter off."""
    gamma: float = 0.5
    """DiSK: extrapolation length; the query is evaluated at x_t + gamma*(x_t - x_{t-1})."""
    convention: Literal["disk_paper", "im_paper"] = "disk_paper"
    """DiSK: how ``kappa`` is read (docs/optim.md has the mapping to both papers and Opacus)."""
    a: list[float] = field(default_factory=lambda: [-0.9])
    """DOPPLER: feedback coefficients a_1..a_p of m_t = -sum a_tau m_{t-tau} + sum b_tau g_{t-tau}.
    Default [-0.9] with b = [0.1]: the first-order EMA m_t = 0.9 m_{t-1} + 0.1 g_t."""
    b: list[float] = field(default_factory=lambda: [0.1])
    """DOPPLER: feed-forward coefficients b_0..b_q (b_0 multiplies the current release)."""
    correction: Literal["paper", "step_response"] = "paper"
    """DOPPLER: the normaliser c_t = -sum a_tau c_{t-tau} + B_t. paper: B_t = sum of all b (the
    DOPPLER paper's equation; releases before step 0 count as 0, so with q >= 1 the early
    outputs are scaled down: the first q without feedback, decaying with the poles with it;
    a = [-0.9], b = [0.5, 0.5]: 0.5, 0.763, 0.851, ... times a constant input). step_response:
    B_t = b_0 + ... + b_min(q, t), the filter's response to a constant 1 from step 0, so a
    constant gradient passes unchanged from the first step. The two agree for q = 0 (the
    default EMA)."""

    def applicability(self) -> list[tuple[str, str, dict]]:
        """Which fields each filter reads (``dptrain.config.unused_fields``)."""
        return [("optim.filter.name", self.name,
                 {**dict.fromkeys(("kappa", "gamma", "convention"), ("disk",)),
                  **dict.fromkeys(("a", "b", "correction"), ("doppler",))})]

    def validate(self) -> None:
        refuse_unused(self)
        if self.name == "disk":
            if not 0.0 < self.kappa <= 1.0 and self.convention == "disk_paper":
                raise ConfigError("kappa", f"must be in (0, 1] (disk_paper), got {self.kappa}")
            if not 0.0 <= self.kappa < 1.0 and self.convention == "im_paper":
                raise ConfigError("kappa", f"must be in [0, 1) (im_paper), got {self.kappa}")
            if not (self.gamma > 0.0 and math.isfinite(self.gamma)):
                raise ConfigError("gamma", f"must be finite and > 0, got {self.gamma}")
            k = self.disk_gain()
            if k < 1.0:
                # the query's weights c and 1 - c sum to 1; past c = 2^24 float32 cannot hold
                # that sum (5e-324 made c infinite, 1e-300 overflowed float32 at step 2)
                ratio = (1.0 - k) / k  # (float division gives inf, not an error, past the range)
                c = ratio / self.gamma
                if not c < _MAX_DISK_C:
                    field_, value = ("kappa", self.kappa) if ratio >= _MAX_DISK_C else (
                        "gamma", self.gamma)
                    raise ConfigError(field_, f"{value} makes DiSK's query weight "
                                              f"c = (1 - kappa) / (kappa * gamma) = {c:.3g}, "
                                              f"past 2^24: its weights c and 1 - c, which sum "
                                              f"to 1, cancel below float32's precision")
        if self.name == "doppler":
            if not self.b:
                raise ConfigError("b", "needs at least b_0")
            for name in ("a", "b"):
                coefs = getattr(self, name)
                if not all(math.isfinite(c) for c in coefs):
                    raise ConfigError(name, f"must be finite numbers, got {coefs}")
            if sum(self.b) == 0.0:
                raise ConfigError("b", "the coefficients sum to 0: the filter passes no signal")
            if not poles_inside_unit_circle(self.a):
                poles = np.roots([1.0, *self.a])
                raise ConfigError("a", f"unstable filter: poles {poles.tolist()} must lie "
                                       "strictly inside the unit circle")
            # the output is m_t / c_t: c_t (public, from a and b only) must never be 0. A
            # stable filter's c_t converges to sum(b) / (1 + sum(a)) != 0, so a long prefix
            # decides it; RunConfig checks the whole run (check_normaliser) too
            self.check_normaliser(normaliser_horizon(self.a, self.b))

    def check_normaliser(self, steps: int) -> None:
        """DOPPLER: ConfigError naming ``b`` if c_t is 0 (to 1e-9 of sum |b|) at a step t <
        ``steps``: with a pole near 1 it can reach 0 only after thousands of steps."""
        zero = first_zero_normaliser(self.a, self.b, self.correction, [], 0, steps)
        if zero is not None:
            raise ConfigError("b", f"the normaliser c_t is 0 at step {zero[0]} (b_0 = 0, a "
                                   "cancellation, or below float32's range): the filter's "
                                   "output m_t / c_t is undefined there")

    def disk_gain(self) -> float:
        """kappa in the DiSK paper's convention (the weight of the new release)."""
        return self.kappa if self.convention == "disk_paper" else 1.0 - self.kappa


#: the largest DiSK query weight c = (1 - kappa) / (kappa * gamma) accepted (float32's 2^24)
_MAX_DISK_C = float(2**24)


def poles_inside_unit_circle(a: list[float]) -> bool:
    """Whether every root of z^p + a_1 z^(p-1) + ... + a_p lies strictly inside the unit
    circle, decided exactly (Schur-Cohn step-down in rational arithmetic on the float
    coefficients' exact values): ``np.roots`` put the poles of z^2 + 0.5 z + 1, which lie on
    the circle, at |p| = 0.9999999999999999."""
    from fractions import Fraction

    c = [Fraction(1), *(Fraction(x) for x in a)]
    while len(c) > 1:
        k = c[-1] / c[0]
        if abs(k) >= 1:
            return False
        c = [(c[i] - k * c[-1 - i]) / (1 - k * k) for i in range(len(c) - 1)]
    return True


def doppler_normaliser(a: list[float], b: list[float], correction: str, c_hist: list[float],
                       t: int) -> float:
    """DOPPLER's c_t at step ``t`` (from 0) from c_{t-1}, c_{t-2}, ... (``c_hist``, newest
    first): -sum a_tau c_{t-tau} plus all of b (``paper``) or b_0..b_t (``step_response``)."""
    fed = b if correction == "paper" else b[: t + 1]
    return sum(fed) - sum(a_tau * c for a_tau, c in zip(a, c_hist))


def normaliser_horizon(a: list[float], b: list[float]) -> int:
    """Steps over which DOPPLER's normaliser is checked for a 0 when the run's length is not
    at hand (a stable filter's c_t converges, so a long prefix decides it)."""
    return max(1000, 10 * (len(a) + len(b)))


def normalisers(a: list[float], b: list[float], correction: str, c_hist: list[float],
                t0: int, steps: int) -> Iterator[tuple[int, float, list[float]]]:
    """(t, c_t, [c_t, c_{t-1}, ...] newest first, at most p) for t in [t0, t0 + steps): DOPPLER's
    normaliser going on from ``c_hist`` (c_{t0-1}, ... newest first)."""
    c_hist = list(c_hist)
    for t in range(t0, t0 + steps):
        c = doppler_normaliser(a, b, correction, c_hist, t)
        c_hist = [c, *c_hist][:len(a)]
        yield t, c, c_hist


def first_zero_normaliser(a: list[float], b: list[float], correction: str, c_hist: list[float],
                          t0: int, steps: int) -> tuple[int, float] | None:
    """(t, c_t) of the first step t in [t0, t0 + steps) where DOPPLER's normaliser is 0 (to
    1e-9 of sum |b|) or not finite, going on from ``c_hist`` (c_{t0-1}, ... newest first);
    None if there is none."""
    # (relative to b; and float32's smallest normal: b = [1e-300] gave c_t = 0 in float32,
    # and 0/0 gradients)
    tol = max(1e-9 * sum(abs(x) for x in b), FLOAT32_TINY)
    for t, c, _ in normalisers(a, b, correction, c_hist, t0, steps):
        if not math.isfinite(c) or abs(c) <= tol:
            return t, c
    return None


def _in_param_dtypes(states: list[dict], named_params: NamedParams) -> None:
    """Cast stored filter tensors (name -> tensor or list of tensors) to their parameter's
    dtype where they differ: a checkpoint of a float32 run resumed with ``performance.dtype``
    float64 (or back) loads them in the dtype they were saved in."""
    dtypes = {n: p.dtype for n, p in named_params}
    for state in states:
        for n, v in state.items():
            want = dtypes.get(n)
            if want is None:
                continue
            if isinstance(v, list):
                state[n] = [t if t.dtype == want else t.to(want) for t in v]
            elif v.dtype != want:
                state[n] = v.to(want)


def filter_kind(state: dict) -> str:
    """The filter a filter state (``state_dict()``) is of, from its keys: "disk", "doppler" or
    "none"."""
    return "doppler" if "c_hist" in state else "disk" if "x_prev" in state else "none"


def _check_kind(state: dict, mine: str) -> None:
    """A ConfigError unless ``state`` is empty or this kind of filter's (another's keys would
    fail with a bare KeyError; turning a filter on is allowed: it starts empty)."""
    saved = filter_kind(state)
    if saved not in ("none", mine):
        raise ConfigError("optim.filter.name", f"{mine} here, {saved} in the checkpoint: its "
                                               f"filter state cannot continue as {mine}'s")


class Filter:
    """The identity: the query is the gradient at the current parameters, the output the release."""

    def query_plan(self, named_params: NamedParams) -> QueryPlan:
        return [(1.0, None)]

    def apply(self, named_params: NamedParams) -> None:
        pass

    def noise_gain(self) -> float:
        return 1.0

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class DiSKFilter(Filter):
    """DiSK (Zhang et al. 2025), DiSK-paper convention: ``kappa`` is the weight of the new release.

    Query of example i at step t >= 1 (one query, clipped once):
        c*grad l(x_t + gamma*(x_t - x_{t-1}); x_i) + (1 - c)*grad l(x_t; x_i),
        c = (1 - kappa)/(kappa*gamma)   (public; may exceed 1, making 1 - c negative);
    at t = 0 (no x_{-1}) the plain gradient. Filter: g_0 = release,
    g_t = (1 - kappa)*g_{t-1} + kappa*release_t.
    """

    def __init__(self, kappa: float, gamma: float):
        # (built directly, as in a loop of one's own: the config's checks, naming the field)
        FilterConfig(name="disk", kappa=kappa, gamma=gamma).validate()
        self.kappa = float(kappa)
        self.gamma = float(gamma)
        self.c = (1.0 - self.kappa) / (self.kappa * self.gamma)
        self.num_steps = 0
        self.g: dict[str, Tensor] = {}  # g_{t-1}, the filter state
        self.x_prev: dict[str, Tensor] = {}  # x_{t-1}, parameters before the last step

    def query_plan(self, named_params: NamedParams) -> QueryPlan:
        if not self.x_prev or self.c == 0.0:
            return [(1.0, None)]
        _in_param_dtypes([self.x_prev, self.g], named_params)
        with torch.no_grad():
            # (a parameter new since the last step has no x_{t-1}: d = 0)
            ahead = {n: p.detach() + self.gamma * (p.detach() - self.x_prev.get(n, p.detach()))
                     for n, p in named_params}
        plan: QueryPlan = [(self.c, ahead)]
        if self.c != 1.0:
            plan.append((1.0 - self.c, None))
        return plan

    @torch.no_grad()
    def apply(self, named_params: NamedParams) -> None:
        _in_param_dtypes([self.x_prev, self.g], named_params)
        for n, p in named_params:
            # x_t of every parameter, one without a gradient too (a stale x_{t-1} would
            # extrapolate a move it made steps ago)
            if n in self.x_prev:
                self.x_prev[n].copy_(p.detach())
            else:
                self.x_prev[n] = p.detach().clone()
            if p.grad is None:
                continue
            if n in self.g:
                self.g[n].lerp_(p.grad, self.kappa)  # exact at kappa = 1
                p.grad.copy_(self.g[n])
            else:
                self.g[n] = p.grad.detach().clone()
        self.num_steps += 1

    def noise_gain(self) -> float:
        return 1.0 if self.num_steps <= 1 else self.kappa

    def state_dict(self) -> dict:
        return {"num_steps": self.num_steps, "g": dict(self.g), "x_prev": dict(self.x_prev)}

    def load_state_dict(self, state: dict) -> None:
        _check_kind(state, "disk")
        self.num_steps = int(state["num_steps"])
        self.g = {n: t.clone() for n, t in state["g"].items()}
        self.x_prev = {n: t.clone() for n, t in state["x_prev"].items()}


class DopplerFilter(Filter):
    """DOPPLER low-pass filter with its bias correction, on every coordinate:

        m_t = -sum_{tau=1..p} a_tau m_{t-tau} + sum_{tau=0..q} b_tau g_{t-tau}
        c_t = -sum_{tau=1..p} a_tau c_{t-tau} + sum_{tau=0..q} b_tau      (``paper``)
              (or sum_{tau=0..min(q,t)} b_tau: ``step_response``)
        output m_t / c_t                 (terms before t = 0 are 0)
    """

    def __init__(self, a: list[float], b: list[float], correction: str = "paper"):
        if correction not in ("paper", "step_response"):
            raise ConfigError("correction", f"must be paper or step_response, got "
                                            f"{correction!r}")
        # (built directly: the config's checks, stability and c_t != 0 included)
        FilterConfig(name="doppler", a=list(a), b=list(b), correction=correction).validate()
        self.a = [float(x) for x in a]
        self.b = [float(x) for x in b]
        self.correction = correction
        self.restart_note: str | None = None  # set by load_state_dict when the state restarts
        self.num_steps = 0
        self.c_hist: list[float] = []  # c_{t-1}, c_{t-2}, ... (newest first, len <= p)
        self.m_hist: dict[str, list[Tensor]] = {}  # m_{t-1}, ... (newest first, len <= p)
        self.g_hist: dict[str, list[Tensor]] = {}  # g_{t-1}, ... (newest first, len <= q)

    def _restart(self) -> None:
        """The state of step 0."""
        self.num_steps = 0
        self.c_hist, self.m_hist, self.g_hist = [], {}, {}

    def _next_c(self) -> float:
        return doppler_normaliser(self.a, self.b, self.correction, self.c_hist, self.num_steps)

    @torch.no_grad()
    def apply(self, named_params: NamedParams) -> None:
        _in_param_dtypes([self.m_hist, self.g_hist], named_params)
        c_t = self._next_c()
        p_len, q_len = len(self.a), len(self.b) - 1
        for n, p in named_params:
            if p.grad is None:
                continue
            g_prev = self.g_hist.setdefault(n, [])
            m_prev = self.m_hist.setdefault(n, [])
            m = p.grad.mul(self.b[0])
            for b_tau, g in zip(self.b[1:], g_prev):
                m.add_(g, alpha=b_tau)
            for a_tau, mp in zip(self.a, m_prev):
                m.add_(mp, alpha=-a_tau)
            if q_len:
                g_prev.insert(0, p.grad.detach().clone())
                del g_prev[q_len:]
            if p_len:
                m_prev.insert(0, m)
                del m_prev[p_len:]
            p.grad.copy_(m / c_t)
        if p_len:
            self.c_hist.insert(0, c_t)
            del self.c_hist[p_len:]
        self._last_c: float | None = c_t
        self.num_steps += 1

    def noise_gain(self) -> float:
        return self.b[0] / self._last_c if self.num_steps else 1.0

    def _coefficients(self) -> dict:
        return {"a": list(self.a), "b": list(self.b), "correction": self.correction}

    def state_dict(self) -> dict:
        return {"num_steps": self.num_steps, "c_hist": list(self.c_hist),
                "last_c": self._last_c if self.num_steps else None,
                "m_hist": {n: list(v) for n, v in self.m_hist.items()},
                "g_hist": {n: list(v) for n, v in self.g_hist.items()},
                "coefficients": self._coefficients()}

    def load_state_dict(self, state: dict) -> None:
        """The checkpoint's filter state, unless its coefficients are not this filter's: then
        the state starts empty, as at step 0 (``restart_note`` says why). The normaliser c_t
        continues from c_{t-1}, ... and mixing another filter's history with these
        coefficients gives a wrong bias correction, or c_t = 0 and a NaN update, which the
        config's check (from step 0) cannot see. Where only ``correction`` differs, the history
        goes on (m and g do not depend on it) with c_t recomputed from step 0. A checkpoint from
        before the coefficients were stored (2026-12-03) restarts only where its history would
        lead to c_t = 0 within the config check's horizon."""
        _check_kind(state, "doppler")
        self.restart_note = None
        self._restart()  # (a filter that has stepped: nothing of its own state stays)
        saved, now = state.get("coefficients"), self._coefficients()
        steps = int(state["num_steps"])
        c_hist, last_c = [float(c) for c in state["c_hist"]], state["last_c"]
        # only the correction differs: m and g do not depend on it, c_t alone does (a function
        # of a, b, the correction and t): recomputed from step 0 for this one
        same_ab = saved is not None and (saved["a"], saved["b"]) == (self.a, self.b)
        recompute = saved is not None and saved != now and steps and same_ab
        if recompute:
            for _, last_c, c_hist in normalisers(self.a, self.b, self.correction, [], 0, steps):
                pass
        elif saved is not None and saved != now and not same_ab:
            self.restart_note = (f"DOPPLER's filter state restarts empty: its coefficients "
                                 f"{saved} differ from this run's {now}")
            return
        if steps and (recompute or saved is None):
            # the config's check, from the (recomputed or stored) history on, not from step 0
            zero = first_zero_normaliser(self.a, self.b, self.correction, c_hist, steps,
                                         normaliser_horizon(self.a, self.b))
            if zero is not None:
                which = (f"with correction {self.correction!r} (the checkpoint's: "
                         f"{saved['correction']!r}) its normaliser" if recompute
                         else "with this run's coefficients its history")
                self.restart_note = (f"DOPPLER's filter state restarts empty: {which} gives "
                                     f"c_t = {zero[1]!r} at step {zero[0]}")
                return
        if recompute:
            self.restart_note = (f"DOPPLER's filter history continues with correction "
                                 f"{self.correction!r} (the checkpoint's: "
                                 f"{saved['correction']!r}), its normaliser c_t recomputed "
                                 f"from step 0")
        self.num_steps = steps
        self.c_hist = c_hist
        self.m_hist = {n: [t.clone() for t in v] for n, v in state["m_hist"].items()}
        self.g_hist = {n: [t.clone() for t in v] for n, v in state["g_hist"].items()}
        if self.num_steps:
            self._last_c = float(last_c)


FILTERS = {
    "none": lambda cfg: Filter(),
    "disk": lambda cfg: DiSKFilter(cfg.disk_gain(), cfg.gamma),
    "doppler": lambda cfg: DopplerFilter(cfg.a, cfg.b, cfg.correction),
}


def build_filter(cfg: FilterConfig) -> Filter:
    return FILTERS[cfg.name](cfg)
