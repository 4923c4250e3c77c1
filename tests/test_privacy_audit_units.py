"""dptrain.privacy.audit piece by piece: argument checks, the guess plans' sizes, the reported
plan when no plan refutes anything, canaries_needed's search against a brute-force scan, and
the noise check's Bonferroni count and reported ratios."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import chi2

from dptrain.privacy.audit import (GradientCanaries, audit_scores, canaries_needed,
                                   largest_lower_bound, one_run_p_value)


@pytest.mark.parametrize("eps,delta", [(-0.5, 1e-5), (1.0, -1e-9), (1.0, 1.5)])
def test_p_value_refuses_a_negative_epsilon_or_a_delta_outside_0_1(eps, delta):
    with pytest.raises(ValueError, match="need eps >= 0 and 0 <= delta <= 1"):
        one_run_p_value(100, 10, 8, eps, delta)


def test_p_value_is_capped_at_1_when_the_delta_term_is_large():
    """A probability: beta + 2 m delta alpha can exceed 1 (here 0.62 + 20 * 0.21), the
    p-value cannot, at v = 0 (beta = 1 exactly) or not."""
    from scipy.stats import binom

    beta, alpha = binom.sf(4, 10, 0.5), binom.pmf(4, 10, 0.5)
    assert beta + 2 * 1000 * 1e-2 * alpha > 1
    assert one_run_p_value(1000, 10, 5, 0.0, 1e-2) == 1.0
    assert one_run_p_value(1000, 10, 0, 0.0, 1e-2) == 1.0


def test_audit_scores_refuses_fewer_than_2_canaries_and_non_finite_scores():
    with pytest.raises(ValueError, match="at least 2 canaries"):
        audit_scores([1.0], [True], 1e-5)
    with pytest.raises(ValueError, match="at least 2 canaries"):
        audit_scores([1.0, 2.0, 3.0], [True, False], 1e-5)
    with pytest.raises(ValueError, match="finite"):
        audit_scores([1.0, np.nan, 0.0, 2.0], [True, False, True, False], 1e-5)
    with pytest.raises(ValueError, match="finite"):
        audit_scores([1.0, np.inf, 0.0, 2.0], [True, False, True, False], 1e-5)


def test_plan_sizes_round_the_fractions_of_m_to_the_nearest():
    """m = 150: 1.5, 3, 7.5, 15, 30, 75 guesses at each end round to 2, 3, 8, 15, 30, 75 (a
    floor would give 1 and 7), each at both ends and at the top alone."""
    m = 150
    included = np.arange(m) % 2 == 0
    res = audit_scores(included.astype(float), included, 1e-5)
    plans = [(t["guessed_included"], t["guessed_excluded"]) for t in res.tried]
    ks = [2, 3, 8, 15, 30, 75]
    assert plans == [(k, k) for k in ks] + [(k, 0) for k in ks]
    # m = 20: 0.2, 0.4 and 1 guesses all become 1 (at least one guess, never an empty plan,
    # which would only weaken the Bonferroni correction), the rest 2, 4 and 10
    included = np.arange(20) % 2 == 0
    res = audit_scores(included.astype(float), included, 1e-5)
    plans = [(t["guessed_included"], t["guessed_excluded"]) for t in res.tried]
    assert plans == [(k, k) for k in (1, 2, 4, 10)] + [(k, 0) for k in (1, 2, 4, 10)]


def test_with_no_bound_the_report_names_a_plan_it_tried():
    """Scores that carry nothing (constant): every plan's bound is 0, and the reported
    guesses/correct are still those of a plan in ``tried`` (the first), not 0 of 0."""
    m = 200
    included = np.arange(m) % 2 == 0
    res = audit_scores(np.zeros(m), included, 1e-5)
    assert res.epsilon_lower_bound == 0.0
    first = res.tried[0]
    assert res.guesses == first["guessed_included"] + first["guessed_excluded"] > 0
    assert res.correct == first["correct"]


def _scan(epsilon, delta, lo, hi):
    """The smallest m of the 48-step grid over (lo, hi) whose ceiling exceeds epsilon."""
    step = max(1, (hi - lo) // 48)
    return next((k for k in range(lo + step, hi, step)
                 if largest_lower_bound(k, delta) > epsilon), None)


def test_canaries_needed_is_the_first_doubling_that_exceeds_the_claim():
    delta = 1e-5
    c1000, c2000 = largest_lower_bound(1000, delta), largest_lower_bound(2000, delta)
    assert c1000 < 5.5 < c2000
    assert canaries_needed(5.5, delta) == 2000  # not 3,000 (a tripling) nor an in-between
    # a claim equal to the ceiling is not exceeded by it
    assert canaries_needed(c1000, delta) == 2000
    assert canaries_needed(c1000 - 1e-9, delta) == 1000


def test_canaries_needed_past_the_peak_is_the_first_of_the_fine_scan():
    """5.72 at delta 1e-5: 2,000 and 4,000 fall short, 8,000 too and lower than 4,000, so the
    peak lies in (2,000, 8,000): the answer is the first of that range's 48-step grid."""
    delta = 1e-5
    assert canaries_needed(5.72, delta) == _scan(5.72, delta, 2000, 8000)


def _two_parameter_canaries():
    return GradientCanaries([("a", (10, 10)), ("b", (10, 10))], m=10, clip_norm=1.0,
                            sample_rate=0.5, seed=0, noise_multiplier=1.0)


def test_the_noise_check_counts_the_parameters_and_the_pool_in_its_bonferroni():
    """m coordinates, P parameters and the pool: each test at significance / (m + P + 1).
    A coordinate whose lower tail lies between significance / (m + P + 1) and
    significance / (m + 1) passes (it would fail were the parameters not counted)."""
    c = _two_parameter_canaries()
    P = len(c.by_name)
    tests = c.m + P + 1
    sig = 1e-6
    squares, count = np.full(c.m, 4.0), np.full(c.m, 4.0)
    squares[3] = chi2.ppf(sig / (tests - 0.5), 4)  # between sig / tests and sig / (m + 1)
    assert sig / tests < chi2.cdf(squares[3], 4) < sig / (c.m + 1)
    out = c.noise_check(squares, count, significance=sig)
    assert out["ok"] is True and out["coordinates_below"] == 0
    squares[3] = chi2.ppf(sig / (tests + 0.5), 4)
    out = c.noise_check(squares, count, significance=sig)
    assert out["ok"] is False and out["coordinates_below"] == 1


def test_the_noise_check_reports_each_ratio_over_the_calibrated_variance():
    """No test fails: ``smallest_variance_ratio`` is the lowest parameter's measured variance
    over (sigma C)^2 (sums of squares over releases), ``variance_ratio`` the pool's; a
    coordinate never read is not checked."""
    c = GradientCanaries([("a", (10, 10)), ("b", (10, 10))], m=10, clip_norm=2.0,
                         sample_rate=0.5, seed=0, noise_multiplier=1.5)
    s2 = (1.5 * 2.0) ** 2
    ratio = np.where(np.array(c.names) == "a", 0.9, 1.2)
    count = np.full(c.m, 50.0)
    never = 0
    count[never] = 0
    squares = ratio * s2 * count
    out = c.noise_check(squares, count)
    assert out["ok"] is True and out["coordinates_checked"] == c.m - 1
    assert out["smallest_variance_ratio"] == pytest.approx(min(ratio[1:]))
    seen = count > 0
    pooled = squares[seen].sum() / s2 / count[seen].sum()
    assert out["variance_ratio"] == pytest.approx(pooled)
    # nothing read anywhere: nothing to check
    assert c.noise_check(np.zeros(c.m), np.zeros(c.m))["ok"] is None


def test_canaries_needed_below_a_limit_under_1000_scans_from_2():
    """delta 1e-4 peaks at 3.40 near 300 canaries: with a limit of 1,000 (1,000 fall short)
    the answer is the first of the 48-step grid over (2, 1,000), not of a narrower range."""
    assert canaries_needed(3.35, 1e-4, limit=1000) == _scan(3.35, 1e-4, 2, 1000)


def test_canaries_needed_never_exceeds_the_module_ceiling(monkeypatch):
    """MAX_SUGGESTED_CANARIES caps the limit (1,500 here, where the ceiling is 5.41; 2,000 would
    be the next doubling), whatever limit the caller passes."""
    import dptrain.privacy.audit as audit

    monkeypatch.setattr(audit, "MAX_SUGGESTED_CANARIES", 1500)
    assert canaries_needed(5.3, 1e-5, limit=10**9) == 1500
    assert canaries_needed(5.5, 1e-5, limit=10**9) is None


@pytest.mark.parametrize("m", [0, 1, 201])
def test_gradient_canaries_need_2_to_all_coordinates(m):
    with pytest.raises(ValueError, match="between 2 and the model's 200 trainable"):
        GradientCanaries([("a", (10, 10)), ("b", (100,))], m, 1.0, 0.5, seed=0)
