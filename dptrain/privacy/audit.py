"""Empirical privacy auditing in one training run, with gradient canaries.

A lower bound on the epsilon a run actually has, measured, to set against the accountant's
upper bound: if the measured lower bound exceeds the claim, the mechanism or the accounting is
wrong. The method is Steinke, Nasr & Jagielski, "Privacy Auditing with One (1) Training Run"
(NeurIPS 2023), in its white-box gradient-space form:

- m canaries are added to the training set, each included independently with probability 1/2
  (``S_i``). Canary i is a Dirac gradient: C at one coordinate ``k_i`` of the trainable
  parameters (distinct coordinates), i.e. a clipped query of the largest norm the mechanism
  admits. An included canary is Poisson-sampled at every step with the run's rate q, like any
  example, and when sampled its query joins the clipped sum before the noise. The model's own
  clipped gradients are zeroed at the canaries' coordinates (a contraction after the clipping,
  which the guarantee covers), so a canary's coordinate carries only the canary and the noise.
- The auditor sees every release (what the accountant covers). At each step the noisy sum at
  ``k_i`` is x ~ N(0, s^2) (s = sigma C) without the canary and (1-q) N(0, s^2) + q N(C, s^2)
  with it; canary i's score is the sum over steps of the log-likelihood ratio of the two,
  log(1 - q + q exp((2 x C - C^2) / (2 s^2))), the most powerful test for one canary
  (Neyman-Pearson; with sigma = 0, the sum of x). The auditor guesses "included" for the k
  highest scores and "excluded" for the k lowest, and counts its correct guesses v of r = 2k.
  Any score gives a valid bound; this one gives a higher bound than the plain sum of x when q
  is small (the paper's gradient canaries use the sum).
- If the run is (eps, delta)-DP, v is stochastically dominated as in the paper's Theorem 5.2:
  P[v correct] <= P[Binomial(r, e^eps / (1 + e^eps)) >= v] + 2 m delta alpha
  (:func:`one_run_p_value`), so the largest eps that this p-value rejects at the chosen
  significance is a lower bound on the run's epsilon, with that confidence.

Several guess counts are tried, at both ends of the ranking and at the top alone, with a
Bonferroni correction over them (the bound stays valid). m canaries can refute no claim above
:func:`largest_lower_bound` (every guess right): about 5.1 for 1,000 canaries at delta 1e-5,
and never more than about 5.73 at that delta (reached near 3,300 canaries), since the
theorem's delta term grows with m. A one-run audit of a subsampled mechanism is loose: it
finds a gross fault (all noise missing, a sigma far below the calibrated one) rather than a
small miscalibration. Noise missing on some coordinates only (one rank's shard) leaves those
canaries a small fixed score in the middle of the ranking, which no guess plan reads: the
noise check (:meth:`GradientCanaries.noise_check`) finds it instead. The auditor knows which
canaries each release holds, so the release minus them is the noise alone, whose variance at
every canary coordinate, over each parameter's and over all, must be (sigma C)^2 (chi-square
tests).
jax_privacy ships the same p-value (``jax_privacy.auditing``), but only for JAX; the formula
is a few lines, written here from the paper on scipy's binomial.

The canaries' inclusion bits and sampling come from an audit seed, never from the privacy seed.
A model trained with canaries is a test artefact, not a model to publish.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

#: numbers of "included" guesses tried, as fractions of m (and the same number of "excluded"
#: guesses): from confident extremes to guessing every canary.
GUESS_FRACTIONS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5)


def one_run_p_value(m: int, r: int, v: int, eps: float, delta: float) -> float:
    """P[at least v of r guesses correct] for an (eps, delta)-DP run with m canaries, each
    included with probability 1/2 (Steinke, Nasr & Jagielski 2023, Theorem 5.2 and its
    Algorithm 2's p-value): beta + 2 m delta alpha with q = e^eps / (1 + e^eps),
    beta = P[Binomial(r, q) >= v], alpha = max_{1<=i<=v} P[v - i <= Binomial(r, q) < v] / i."""
    from scipy.stats import binom

    if not (0 <= v <= r <= m):
        raise ValueError(f"need 0 <= v <= r <= m, got m={m}, r={r}, v={v}")
    if eps < 0 or not (0 <= delta <= 1):
        raise ValueError(f"need eps >= 0 and 0 <= delta <= 1, got eps={eps}, delta={delta}")
    q = 1.0 / (1.0 + math.exp(-eps))
    beta = float(binom.sf(v - 1, r, q))
    if delta == 0 or v == 0:
        return min(beta, 1.0)
    i = np.arange(1, v + 1)
    below = binom.sf(v - i - 1, r, q) - beta  # P[v - i <= Binomial(r, q) < v]
    alpha = float(np.max(below / i))
    return min(beta + alpha * delta * 2 * m, 1.0)


def epsilon_lower_bound(m: int, r: int, v: int, delta: float, significance: float) -> float:
    """The largest eps whose (eps, delta) claim v correct guesses of r reject at
    ``significance`` (0 if even eps = 0 is not rejected): a lower bound on the run's epsilon
    with confidence 1 - significance."""
    from scipy.optimize import brentq

    def excess(eps: float) -> float:  # > 0: the claim is rejected
        return significance - one_run_p_value(m, r, v, eps, delta)

    if r == 0 or excess(0.0) <= 0:
        return 0.0
    lo, hi = 0.0, 1.0
    while excess(hi) > 0:  # p grows with eps (its limit is 1: the loop ends)
        lo, hi = hi, 2 * hi
    eps = float(brentq(excess, lo, hi, xtol=1e-6))
    # brentq's point lies within xtol of the root, on either side: report one that is rejected
    while eps > lo and excess(eps) <= 0:
        eps = max(lo, eps - 1e-6)
    return eps


@dataclass
class AuditResult:
    """What one audit found. ``epsilon_lower_bound``: with confidence ``1 - significance`` the
    run's epsilon is at least this; ``guesses``/``correct``: of the guess plan that gave it;
    ``tried``: every plan's counts and bound."""

    canaries: int
    included: int
    delta: float
    significance: float
    epsilon_lower_bound: float
    guesses: int
    correct: int
    tried: list[dict] = field(default_factory=list)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def _guess_plans(m: int, fractions) -> list[tuple[int, int]]:
    """(k_in, k_out) pairs tried: the top k_in guessed included, the bottom k_out excluded. For
    each k in ``fractions`` * m: both ends (k, k), and the top end alone (k, 0), which is what
    finds a canary that appears as a spike when most included canaries were never sampled
    (small q * T: their scores look excluded)."""
    ks = sorted({max(1, min(m // 2, int(round(f * m)))) for f in fractions})
    return [(k, k) for k in ks] + [(k, 0) for k in ks]


def audit_scores(scores, included, delta: float, significance: float = 0.05,
                 fractions=GUESS_FRACTIONS) -> AuditResult:
    """Epsilon lower bound from canary ``scores`` (higher: more likely included) and the
    truth ``included`` (bool). Every plan of :func:`_guess_plans` is tested at significance /
    (number of plans) (Bonferroni), and the largest bound is reported."""
    scores = np.asarray(scores, dtype=np.float64)
    included = np.asarray(included, dtype=bool)
    m = scores.size
    if included.shape != scores.shape or m < 2:
        raise ValueError("need one inclusion bit per score and at least 2 canaries")
    if not np.all(np.isfinite(scores)):
        raise ValueError("canary scores must be finite")
    # ties broken in a fixed random order that does not depend on the inclusion bits
    tiebreak = np.random.default_rng(0).permutation(m)
    order = np.lexsort((tiebreak, scores))  # ascending
    plans = _guess_plans(m, fractions)
    each = significance / len(plans)
    best = AuditResult(m, int(included.sum()), delta, significance, 0.0, 0, 0)
    for k_in, k_out in plans:
        v = int(included[order[m - k_in:]].sum() + (~included[order[:k_out]]).sum())
        r = k_in + k_out
        eps = epsilon_lower_bound(m, r, v, delta, each)
        best.tried.append({"guessed_included": k_in, "guessed_excluded": k_out, "correct": v,
                           "epsilon_lower_bound": eps})
        if eps > best.epsilon_lower_bound or best.guesses == 0:
            best.epsilon_lower_bound, best.guesses, best.correct = eps, r, v
    return best


def largest_lower_bound(m: int, delta: float, significance: float = 0.05,
                        fractions=GUESS_FRACTIONS) -> float:
    """The bound ``audit_scores`` gives when every guess is right: no run audited with m
    canaries can be shown to have a larger epsilon, whatever its mechanism."""
    plans = _guess_plans(m, fractions)
    r = max(k_in + k_out for k_in, k_out in plans)
    return epsilon_lower_bound(m, r, r, delta, significance / len(plans))


#: the most canaries :func:`canaries_needed` suggests (one ceiling there takes about 2 s; at
#: 2^26, with a small delta, the search ran for minutes and one ceiling took 2.8 GB)
MAX_SUGGESTED_CANARIES = 1 << 20


def canaries_needed(epsilon: float, delta: float, significance: float = 0.05,
                    fractions=GUESS_FRACTIONS,
                    limit: int = MAX_SUGGESTED_CANARIES) -> int | None:
    """A number of canaries, at most ``limit`` (e.g. a model's trainable coordinates) and
    :data:`MAX_SUGGESTED_CANARIES`, whose :func:`largest_lower_bound` exceeds ``epsilon``: the
    smallest power-of-two multiple of 1,000 (or the limit) that does, or, once the ceiling has
    passed its peak (it falls again, from the delta term) or the limit is reached, the smallest
    in 48 steps over the last doubling's range (delta 1e-5: 5.603 at 2,000, 5.733 at 3,300,
    5.718 at 4,000 canaries); None when none does."""
    limit = min(int(limit), MAX_SUGGESTED_CANARIES)
    if not math.isfinite(epsilon) or limit < 2:
        return None

    def first_above(lo: int, hi: int) -> int | None:  # in 48 steps over (lo, hi)
        step = max(1, (hi - lo) // 48)
        return next((k for k in range(lo + step, hi, step)
                     if largest_lower_bound(k, delta, significance, fractions) > epsilon), None)

    tried: list[tuple[int, float]] = []  # (m, ceiling)
    m = 1000
    while True:
        m = min(m, limit)
        ceiling = largest_lower_bound(m, delta, significance, fractions)
        if ceiling > epsilon:
            return m
        if tried and ceiling <= tried[-1][1]:  # the peak lies between the size before and m
            return first_above(tried[-2][0] if len(tried) > 1 else 2, m)
        if m >= limit:  # still rising at the limit: the peak may lie between the last and it
            return first_above(tried[-1][0] if tried else 2, m)
        tried.append((m, ceiling))
        m *= 2


#: the noise check's false alarm rate: far below the bound's (noise missing somewhere leaves
#: a sum of squares near 0, noise a third of its scale a pooled variance ratio near 0.1; either
#: is rejected at any level), so that it adds nothing measurable to an honest run's failures
NOISE_SIGNIFICANCE = 1e-6


def _derived_seed(seed: int, domain: int) -> int:
    return int(np.random.SeedSequence([int(seed), domain]).generate_state(1, np.uint64)[0] >> 1)


class GradientCanaries:
    """m Dirac gradient canaries over a model's trainable coordinates, for one run.

    ``shapes``: (name, global shape) of every trainable parameter, in a fixed order (the same
    on every rank). Coordinates, inclusion bits and the per-step sampling are functions of
    ``seed`` alone, so every rank agrees on them without communication."""

    _COORDS, _SAMPLING = 0xA0D1, 0xA0D2

    def __init__(self, shapes: list[tuple[str, tuple]], m: int, clip_norm: float,
                 sample_rate: float, seed: int, noise_multiplier: float = 0.0):
        self.shapes = {n: tuple(s) for n, s in shapes}
        sizes = [math.prod(s) for _, s in shapes]
        total = sum(sizes)
        if not (2 <= m <= total):
            raise ValueError(f"the number of canaries must be between 2 and the model's "
                             f"{total} trainable coordinates, got {m}")
        rng = np.random.default_rng(_derived_seed(seed, self._COORDS))
        flat = rng.choice(total, size=m, replace=False)  # distinct, in random order
        self.included = rng.random(m) < 0.5
        offsets = np.cumsum([0] + sizes)
        which = np.searchsorted(offsets, flat, side="right") - 1
        self.names = [shapes[j][0] for j in which]
        self.index = (flat - offsets[which]).astype(np.int64)  # flat index in the parameter
        self.by_name: dict[str, np.ndarray] = {}
        for i, n in enumerate(self.names):
            self.by_name.setdefault(n, []).append(i)  # type: ignore[arg-type]
        self.by_name = {n: np.asarray(ix, dtype=np.int64) for n, ix in self.by_name.items()}
        self.m = m
        self.clip_norm = float(clip_norm)
        self.sample_rate = float(sample_rate)
        self.noise_std = float(noise_multiplier) * self.clip_norm  # s = sigma C of each sum
        self._sampling_seed = _derived_seed(seed, self._SAMPLING)
        self.scores = np.zeros(m, dtype=np.float64)  # this rank's part of each score
        #: this rank's part of each canary coordinate's noise: the sum of the squares of the
        #: releases less the canary's query, and the number of releases read
        self.noise_squares = np.zeros(m, dtype=np.float64)
        self.noise_count = np.zeros(m, dtype=np.float64)
        self._present: tuple[int, np.ndarray] | None = None  # (step, canaries in its release)

    def sampled(self, step: int) -> np.ndarray:
        """Bool [m]: the canaries Poisson-sampled at ``step`` (included or not)."""
        from dptrain.privacy.sampling import poisson_sample

        mask = np.zeros(self.m, dtype=bool)
        mask[poisson_sample(self._sampling_seed, step, self.m, self.sample_rate)] = True
        return mask

    def insert(self, acc: dict, step: int, *, dtype, device, add: bool = True) -> None:
        """Prepare this rank's clipped sums ``acc`` (name -> tensor shaped like the whole
        parameter) for step ``step``'s reduction and noise: the model's own gradient is removed
        at the canaries' coordinates (so that a canary's coordinate carries only the canary and
        the noise), and, with ``add`` (on ONE rank: the sums are reduced across ranks
        afterwards), the queries of the included canaries sampled at ``step`` are added.

        Removing coordinates after the clipping is a contraction (no example's query grows),
        so the accountant's guarantee still holds for the audited run; the audit's power no
        longer depends on how large the model's gradients are at those coordinates."""
        import torch

        present = self._in_release(step)
        if not add:
            present = np.zeros(self.m, dtype=bool)
        for name, ix in self.by_name.items():
            if name in acc:
                flat = acc[name].view(-1)
                flat.index_fill_(0, torch.as_tensor(self.index[ix], device=flat.device), 0.0)
            ix = ix[present[ix]]
            if ix.size == 0:
                continue
            if name not in acc:
                acc[name] = torch.zeros(self.shapes[name], dtype=dtype, device=device)
            flat = acc[name].view(-1)
            at = torch.as_tensor(self.index[ix], device=flat.device)
            flat.index_add_(0, at, torch.full((ix.size,), self.clip_norm, dtype=flat.dtype,
                                              device=flat.device))

    def _in_release(self, step: int) -> np.ndarray:
        """Bool [m]: the canaries whose query step ``step``'s release holds (included and
        sampled), kept for the step's observations."""
        if self._present is None or self._present[0] != step:
            self._present = (step, self.included & self.sampled(step))
        return self._present[1]

    def observe(self, name: str, noisy, start: int, end: int, step: int | None = None) -> None:
        """Add to the scores the released noisy sum of parameter ``name``, of which ``noisy``
        holds global flat coordinates ``[start, end)`` (a shard, or all of it); with ``step``,
        also the release less the canaries it holds to the noise check's sums."""
        ix = self.by_name.get(name)
        if ix is None:
            return
        k = self.index[ix]
        mine = (k >= start) & (k < end)
        if not mine.any():
            return
        import torch

        flat = noisy.reshape(-1)
        at = torch.as_tensor(k[mine] - start, device=flat.device)
        x = flat.index_select(0, at).double().cpu().numpy()
        self.scores[ix[mine]] += self.log_likelihood_ratio(x)
        if step is not None:
            noise = x - self.clip_norm * self._in_release(step)[ix[mine]]
            self.noise_squares[ix[mine]] += noise * noise
            self.noise_count[ix[mine]] += 1

    def noise_check(self, squares: np.ndarray, count: np.ndarray,
                    significance: float = NOISE_SIGNIFICANCE) -> dict:
        """Whether the releases carried noise of the calibrated scale at the canaries'
        coordinates: ``squares``/``count`` are :attr:`noise_squares`/:attr:`noise_count`
        summed over the ranks. Each canary coordinate's sum of squares over (sigma C)^2 is
        chi-square with ``count`` degrees of freedom, and so is each parameter's (its
        canaries' pooled) and all of them pooled; one that low (lower tail, Bonferroni over
        the coordinates, the parameters and the pool at ``significance``) means noise missing
        (a shard without it: 0) or too small there. ``ok`` is None without noise to check
        (sigma = 0). Also: ``coordinates_checked`` (read at least once),
        ``variance_ratio`` (all of them: measured variance over (sigma C)^2), and
        ``smallest_variance_ratio``, the lowest parameter's among those that failed (all
        parameters' when none did)."""
        from scipy.stats import chi2

        seen = count > 0
        result = {"ok": None, "significance": significance, "coordinates_checked": 0,
                  "coordinates_below": 0, "parameters_below": [], "pool_below": False,
                  "smallest_variance_ratio": None, "variance_ratio": None}
        if self.noise_std == 0 or not seen.any():
            return result
        s2 = self.noise_std ** 2
        each = significance / (int(seen.sum()) + len(self.by_name) + 1)
        low = chi2.cdf(squares[seen] / s2, count[seen]) < each
        ratios = {}
        for name, ix in self.by_name.items():
            ix = ix[seen[ix]]
            if ix.size == 0:
                continue
            dof, total = float(count[ix].sum()), float(squares[ix].sum()) / s2
            ratios[name] = total / dof
            if chi2.cdf(total, dof) < each:
                result["parameters_below"].append(name)
        # (noise too small everywhere by a moderate factor: 0.7 of its scale over 200
        # canaries of 4 steps failed no coordinate's or parameter's test, only the pool's)
        dof, total = float(count[seen].sum()), float(squares[seen].sum()) / s2
        pool_below = bool(chi2.cdf(total, dof) < each)
        below = [ratios[n] for n in result["parameters_below"]] or list(ratios.values())
        result.update(ok=not (low.any() or result["parameters_below"] or pool_below),
                      coordinates_checked=int(seen.sum()), coordinates_below=int(low.sum()),
                      pool_below=pool_below, smallest_variance_ratio=min(below),
                      variance_ratio=total / dof)
        return result

    def log_likelihood_ratio(self, x: np.ndarray) -> np.ndarray:
        """log of p(x | canary in) / p(x | canary out) for one step's noisy sum x at a
        canary's coordinate (x itself without noise: sigma = 0)."""
        s, C, q = self.noise_std, self.clip_norm, self.sample_rate
        if s == 0:
            return x
        with np.errstate(divide="ignore"):  # q = 1: log(1 - q) = -inf, logaddexp copes
            return np.logaddexp(np.log1p(-q), math.log(q) + (2 * x * C - C * C) / (2 * s * s))
