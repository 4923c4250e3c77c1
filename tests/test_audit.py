"""The one-run privacy audit (dptrain.privacy.audit, ``dptrain audit``): its p-value against a
direct evaluation of the theorem, its bound valid and near-tight on mechanisms of known epsilon,
canaries that enter the release exactly once as a query of norm C, and a run whose noise is
missing caught while the real mechanism passes."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from scipy.optimize import brentq
from scipy.stats import norm

from dptrain.privacy.audit import (GradientCanaries, audit_scores, canaries_needed,
                                   epsilon_lower_bound, largest_lower_bound, one_run_p_value)

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")
# q = 0.5, 8 steps, sigma 3.4: epsilon 1.99 by RDP at delta 1e-5 (sigma fixed: no calibration)
RUN = ["privacy.sample_rate=0.5", "privacy.steps=8", "privacy.epsilon=null",
       "privacy.noise_multiplier=3.4", "data.synthetic_train_size=64", "train.checkpoint_every=0"]


def _p_value_reference(m, r, v, eps, delta):
    """Theorem 5.2's p-value term by term, in exact binomial coefficients."""
    q = 1 / (1 + math.exp(-eps))
    pmf = [math.comb(r, j) * q ** j * (1 - q) ** (r - j) for j in range(r + 1)]
    beta = sum(pmf[v:])
    alpha = max([sum(pmf[v - i:v]) / i for i in range(1, v + 1)], default=0.0)
    return min(beta + 2 * m * delta * alpha, 1.0)


@pytest.mark.parametrize("m,r,v", [(50, 20, 15), (100, 40, 40), (30, 10, 3), (10, 6, 0)])
@pytest.mark.parametrize("eps,delta", [(0.0, 0.0), (0.7, 0.0), (1.5, 1e-3), (3.0, 1e-5)])
def test_p_value_against_the_theorem_term_by_term(m, r, v, eps, delta):
    assert one_run_p_value(m, r, v, eps, delta) == pytest.approx(
        _p_value_reference(m, r, v, eps, delta), rel=1e-9, abs=1e-15)



@pytest.mark.parametrize("m,r,v", [(10, 11, 5), (10, 20, 20), (4, 6, 0), (10, 5, 6), (10, 5, -1)])
def test_p_value_refuses_guesses_the_theorem_does_not_cover(m, r, v):
    """Theorem 5.2 counts v correct of r <= m guesses: more guesses than canaries (which
    _guess_plans' m // 2 cap exists to avoid) has no p-value, and neither has v > r or v < 0."""
    with pytest.raises(ValueError, match="need 0 <= v <= r <= m"):
        one_run_p_value(m, r, v, 1.0, 1e-5)

def test_lower_bound_is_where_the_p_value_reaches_the_significance():
    m, r, v, delta, sig = 1000, 200, 170, 1e-5, 0.05
    eps = epsilon_lower_bound(m, r, v, delta, sig)
    assert eps > 1
    assert one_run_p_value(m, r, v, eps, delta) == pytest.approx(sig, abs=1e-6)
    assert one_run_p_value(m, r, v, eps * 1.01, delta) > sig
    assert one_run_p_value(m, r, v, eps * 0.99, delta) < sig
    assert epsilon_lower_bound(m, r, r // 2, delta, sig) == 0.0  # chance level proves nothing


def test_bound_on_randomized_response_is_valid_and_nearly_tight():
    # eps-DP randomized response per canary: every canary guessed right w.p. e^eps/(1+e^eps)
    eps, m = 1.0, 20000
    rng = np.random.default_rng(1)
    included = rng.random(m) < 0.5
    right = rng.random(m) < math.exp(eps) / (1 + math.exp(eps))
    result = audit_scores(np.where(right, included, ~included).astype(float), included, 0.0)
    assert 0.85 * eps < result.epsilon_lower_bound <= eps


def test_guessing_the_top_alone_finds_canaries_that_were_mostly_never_sampled():
    # a quarter of the included canaries show a spike (sampled); the rest look excluded
    m = 2000
    rng = np.random.default_rng(0)
    included = rng.random(m) < 0.5
    spiked = included & (rng.random(m) < 0.25)
    result = audit_scores(10.0 * spiked + rng.standard_normal(m), included, 1e-5)
    best = max(result.tried, key=lambda t: t["epsilon_lower_bound"])
    both = max(t["epsilon_lower_bound"] for t in result.tried if t["guessed_excluded"])
    assert best["guessed_excluded"] == 0 and result.epsilon_lower_bound > both + 1


def test_largest_lower_bound_is_the_bound_of_a_perfect_audit():
    m, delta = 1000, 1e-5
    rng = np.random.default_rng(0)
    included = rng.permutation(np.arange(m) < m // 2)  # exactly half: every plan can be right
    perfect = audit_scores(included + 0.01 * rng.standard_normal(m), included, delta)
    assert perfect.epsilon_lower_bound == pytest.approx(largest_lower_bound(m, delta))
    assert 4.5 < largest_lower_bound(m, delta) < largest_lower_bound(8 * m, delta) < 6
    assert canaries_needed(3.0, delta) == 1000 and canaries_needed(5.3, delta) > 1000
    assert canaries_needed(8.0, delta) is None  # the delta term grows with m
    assert canaries_needed(float("inf"), 0.0) is None
    # the ceiling peaks between doublings (5.603 at 2,000, 5.733 near 3,300, 5.718 at 4,000):
    # a claim of 5.72 was "no number of canaries can"
    m = canaries_needed(5.72, delta)
    assert m is not None and 2000 < m < 4000 and largest_lower_bound(m, delta) > 5.72
    assert canaries_needed(5.74, delta) is None
    # at most the limit (a model's trainable coordinates): the suggestion must be one the
    # model can hold; 1,500 canaries give 5.41, 1,200 only 5.24
    assert canaries_needed(5.3, delta, limit=1500) == 1500
    assert canaries_needed(5.3, delta, limit=1200) is None
    assert canaries_needed(3.0, delta, limit=1) is None
    # a peak between the last doubling and the limit, or below a limit under 1,000: 5.72 needs
    # ~3,300 canaries (5.718 at 4,000), and delta 1e-4 peaks at 3.40 near 300 canaries
    m = canaries_needed(5.72, delta, limit=4000)
    assert m is not None and 2000 < m < 4000 and largest_lower_bound(m, delta) > 5.72
    m = canaries_needed(3.35, 1e-4, limit=1000)
    assert m is not None and m < 1000 and largest_lower_bound(m, 1e-4) > 3.35


@pytest.mark.parametrize("m, r, v, delta, significance", [
    (50, 5, 5, 0.0, 0.05), (50, 5, 5, 1e-5, 0.05), (200, 20, 16, 0.0, 0.05),
    (200, 20, 16, 1e-6, 0.05)])
def test_the_reported_bound_is_itself_rejected(m, r, v, delta, significance):
    """brentq's point lies within its xtol of the root on either side: it used to be reported
    as is, with p-values up to 0.0500000216 at significance 0.05 (not quite a rejection)."""
    eps = epsilon_lower_bound(m, r, v, delta, significance)
    assert eps > 0 and one_run_p_value(m, r, v, eps, delta) <= significance
    assert one_run_p_value(m, r, v, eps + 1e-5, delta) > significance  # and still tight


def _gdp_epsilon(mu: float, delta: float) -> float:
    """epsilon of mu-GDP at delta (Dong, Roth & Su 2019, Corollary 2.13)."""
    return brentq(lambda e: norm.cdf(-e / mu + mu / 2) - math.exp(e) * norm.cdf(-e / mu - mu / 2)
                  - delta, 0, 100)


@pytest.mark.parametrize("mu", [1.0, 2.0])
def test_bound_on_the_gaussian_mechanism_stays_below_its_epsilon(mu):
    delta, m = 1e-5, 5000
    bounds = []
    for seed in range(8):
        rng = np.random.default_rng(seed)
        included = rng.random(m) < 0.5
        bounds.append(audit_scores(mu * included + rng.standard_normal(m), included,
                                   delta).epsilon_lower_bound)
    assert max(bounds) <= _gdp_epsilon(mu, delta)
    assert min(bounds) > 0.3 * _gdp_epsilon(mu, delta)  # and it has power


def test_the_score_is_the_likelihood_ratio_of_the_subsampled_gaussian():
    can = GradientCanaries([("w", (10,))], 2, clip_norm=1.5, sample_rate=0.2, seed=0,
                           noise_multiplier=0.8)
    s, C, q = 0.8 * 1.5, 1.5, 0.2
    x = np.linspace(-4, 6, 41)
    ratio = ((1 - q) * norm.pdf(x, 0, s) + q * norm.pdf(x, C, s)) / norm.pdf(x, 0, s)
    np.testing.assert_allclose(can.log_likelihood_ratio(x), np.log(ratio), rtol=1e-10)
    assert np.all(np.diff(can.log_likelihood_ratio(x)) > 0)  # larger sums: more likely in
    no_noise = GradientCanaries([("w", (10,))], 2, 1.5, 0.2, seed=0, noise_multiplier=0.0)
    np.testing.assert_array_equal(no_noise.log_likelihood_ratio(x), x)


def test_bound_on_the_subsampled_gaussian_stays_below_the_accountants_epsilon():
    # the mechanism itself, simulated: T steps, a canary in the sum w.p. q when included
    from dptrain.privacy.accounting import Ledger

    q, T, sigma, m, delta = 0.064, 80, 1.174, 2000, 1e-5
    claimed = Ledger([(sigma, q, T)]).epsilon(delta, "prv")
    bounds = []
    for seed in range(4):
        rng = np.random.default_rng(seed)
        can = GradientCanaries([("w", (m,))], m, 1.0, q, seed=seed, noise_multiplier=sigma)
        x = (rng.random((m, T)) < q) * can.included[:, None] + sigma * rng.standard_normal((m, T))
        bounds.append(audit_scores(can.log_likelihood_ratio(x).sum(1), can.included,
                                   delta).epsilon_lower_bound)
    assert claimed == pytest.approx(2.99, abs=0.01)
    assert max(bounds) <= claimed and min(bounds) > 0.1 * claimed


def test_canaries_are_distinct_coordinates_half_included_sampled_at_q():
    shapes = [("a", (7, 5)), ("b", (3,)), ("c", (40, 20))]
    can = GradientCanaries(shapes, 600, 1.0, 0.25, seed=3)
    flat = {(n, int(i)) for n, i in zip(can.names, can.index)}
    assert len(flat) == 600  # distinct
    sizes = dict((n, math.prod(s)) for n, s in shapes)
    assert all(0 <= i < sizes[n] for n, i in flat)
    assert 0.4 < can.included.mean() < 0.6
    rate = np.mean([can.sampled(t).mean() for t in range(20)])
    assert abs(rate - 0.25) < 0.02
    same = GradientCanaries(shapes, 600, 1.0, 0.25, seed=3)
    other = GradientCanaries(shapes, 600, 1.0, 0.25, seed=4)
    assert np.array_equal(same.index, can.index) and np.array_equal(same.sampled(5), can.sampled(5))
    assert not np.array_equal(other.included, can.included)
    with pytest.raises(ValueError, match="canaries"):
        GradientCanaries(shapes, 1000, 1.0, 0.25, seed=0)


def _trainer(extra=()):
    from dptrain.config import load
    from dptrain.trainer import RunConfig, Trainer

    return Trainer(load(RunConfig, TINY, ["train.progress=false", *RUN, *extra]))


def test_canaries_see_the_same_release_with_the_noise_drawn_in_the_background():
    """The canaries are inserted before the noise and observe the noisy release: where the
    noise is drawn (performance.noise_prefetch) changes neither the release nor the scores."""
    releases, scores = [], []
    for where in ("inline", "background"):
        t = _trainer([f"performance.noise_prefetch={where}"])
        shapes = [(n, tuple(p.shape)) for n, p in t.named_params]
        t.audit = GradientCanaries(shapes, 300, t.plan.clip_norm, t.plan.sample_rate, seed=0)
        releases.append(t.release(0)[0])
        scores.append(np.array(t.audit.scores))
    for n in releases[0]:
        assert torch.equal(releases[0][n], releases[1][n]), n
    assert len(scores[0]) == 300 and np.array_equal(scores[0], scores[1])


@pytest.mark.parametrize("noise", [0.0, 1.0])
def test_a_canary_coordinate_releases_exactly_C_when_present_plus_the_noise(monkeypatch, noise):
    from dptrain.trainer import Trainer

    real = Trainer._noise_flat
    monkeypatch.setattr(Trainer, "_noise_flat", lambda self, *a, **k: noise * real(self, *a, **k))
    t = _trainer()
    shapes = [(n, tuple(p.shape)) for n, p in t.named_params]
    plain, _ = t.release(0)
    t.audit = can = GradientCanaries(shapes, 300, t.plan.clip_norm, t.plan.sample_rate, seed=0)
    audited, _ = t.release(0)
    b, C = t.plan.denominator, t.plan.clip_norm
    present = can.included & can.sampled(0)
    assert 0 < present.sum() < 300
    # everywhere else the release is the plain one; at a canary's coordinate it is the canary
    # (C when present) plus the noise, the model's own gradient removed
    expected = {n: v.clone() for n, v in plain.items()}
    t.audit = None
    monkeypatch.setattr(Trainer, "_noise_flat", lambda self, *a, **k: 0 * real(self, *a, **k))
    noiseless, _ = t.release(0)  # the model's gradient alone, divided by b
    for i in range(300):
        expected[can.names[i]].view(-1)[can.index[i]] += (C * present[i] / b
                                                          - noiseless[can.names[i]].view(-1)[can.index[i]])
    moved = sum(float(noiseless[n].view(-1)[k].abs()) for n, k in zip(can.names, can.index))
    assert moved > 0.01  # the removed gradient was there to remove
    for n in plain:
        torch.testing.assert_close(audited[n], expected[n], atol=1e-6, rtol=0)
    # scores: the noisy sum at each canary's coordinate (sigma = 0 in the canaries' model:
    # the score is the sum itself, not the likelihood ratio)
    read = np.array([float(audited[n].reshape(-1)[k]) * b for n, k in zip(can.names, can.index)])
    np.testing.assert_allclose(can.scores, read, rtol=1e-6, atol=1e-6)


def _audit(capsys, tmp_path, *extra):
    from dptrain.cli import main

    out = tmp_path / "audit.json"
    code = main(["audit", "--config", TINY, "--canaries", "400", "--output", str(out),
                 "--plot", str(tmp_path / "scores.png"), *RUN, *extra])
    return code, json.loads(out.read_text()), capsys.readouterr()


def test_the_real_mechanism_passes_and_a_run_without_noise_is_caught(tmp_path, capsys,
                                                                      monkeypatch):
    from dptrain.trainer import Trainer

    code, report, out = _audit(capsys, tmp_path / "ok")
    assert code == 0 and report["consistent"] and "consistent" in out.out
    assert report["claimed_epsilon"] == pytest.approx(1.99, abs=0.02)
    assert report["epsilon_lower_bound"] <= report["claimed_epsilon"]
    assert (tmp_path / "ok" / "scores.png").stat().st_size > 0

    real = Trainer._noise_flat
    monkeypatch.setattr(Trainer, "_noise_flat", lambda self, *a, **k: 0 * real(self, *a, **k))
    code, report, out = _audit(capsys, tmp_path / "broken")
    assert code == 1 and not report["consistent"] and "EXCEEDS" in out.err
    assert report["epsilon_lower_bound"] > report["claimed_epsilon"] + 0.5


def test_an_audit_that_cannot_refute_its_claim_says_so(capsys):
    from dptrain.cli import main

    # tiny as shipped: epsilon 8, q = 0.125; 2 steps: a canary is in a release w.p. 0.23
    code = main(["audit", "--config", TINY, "--canaries", "100", "privacy.steps=2",
                 "train.checkpoint_every=0", "train.progress=false"])
    err = capsys.readouterr().err
    assert code == 0
    assert "cannot refute the claim" in err and "no number of canaries up to" in err
    assert "probability 0.23" in err
    # at delta 1e-6 the ceiling rises further: the suggestion was 32,000 canaries, more than
    # the model's 27,552 trainable coordinates (refused with exit 2 when tried)
    code = main(["audit", "--config", TINY, "--canaries", "100", "privacy.steps=2",
                 "privacy.delta=1e-6", "train.checkpoint_every=0", "train.progress=false"])
    err = capsys.readouterr().err
    assert code == 0 and "cannot refute the claim" in err
    suggested = re.search(r"\((\d+) canaries could\)", err)
    assert (int(suggested.group(1)) <= 27552 if suggested else
            "up to 27552, the model's trainable coordinates" in err), err


@pytest.mark.parametrize("args,field", [(["--canaries", "1"], "canaries"),
                                        (["--canaries", "many"], "canaries"),
                                        (["--canaries", "10000000"], "canaries"),
                                        (["--confidence", "1.5"], "confidence"),
                                        (["--audit-seed", "-1"], "audit-seed")])
def test_bad_audit_arguments_exit_2_naming_the_field(tmp_path, capsys, args, field):
    from dptrain.cli import main

    code = main(["audit", "--config", TINY, *args, *RUN])
    err = capsys.readouterr().err.strip().splitlines()
    lines = [x for x in err if not x.startswith("dptrain: privacy.seed")]
    assert code == 2 and len(lines) == 1 and field in lines[0]


def test_an_existing_output_is_kept_without_force(tmp_path, capsys):
    from dptrain.cli import main

    out = tmp_path / "audit.json"
    out.write_text("earlier")
    code = main(["audit", "--config", TINY, "--output", str(out), *RUN])
    assert code == 2 and "output" in capsys.readouterr().err
    assert out.read_text() == "earlier"


def test_the_config_is_never_the_output_even_with_force(tmp_path, capsys):
    # --output over the --config (JSON is YAML) replaced the config with the report, exit 0
    from dptrain.cli import main

    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(yaml.safe_load(Path(TINY).read_text())))
    before = config.read_bytes()
    code = main(["audit", "--config", str(config), "--output", str(config), "--force", *RUN])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == [f"dptrain audit: error: --output: {config} is also the "
                                 f"--config (input) file"]
    assert config.read_bytes() == before
    code = main(["audit", "--config", "", *RUN])  # was named "config", the YAML's field
    assert code == 2 and "error: --config: is empty" in capsys.readouterr().err


def test_a_write_that_fails_after_the_run_names_the_option_after_the_verdict(
        tmp_path, capsys, monkeypatch):
    # a full disk after the run: a traceback and exit 1 (the "EXCEEDS" code) before, and the
    # verdict line, printed after the writes, was lost with the run
    import errno

    import dptrain.commands.audit as audit_command
    from dptrain.cli import main

    def full(path, obj):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(audit_command, "write_json", full)
    out = tmp_path / "audit.json"
    code = main(["audit", "--config", TINY, "--canaries", "100", "--output", str(out), *RUN,
                 "privacy.steps=2"])
    captured = capsys.readouterr()
    assert code == 2 and not out.exists()
    assert "guesses correct: epsilon >= " in captured.out + captured.err  # the verdict
    assert f"--output: cannot write {out}: No space left on device" in captured.err
    # a failed audit keeps its status 1 (a job looking for it read the write's 2 as a bad
    # argument), the write's error said after the verdict
    from dptrain.trainer import Trainer

    real = Trainer._noise_flat
    monkeypatch.setattr(Trainer, "_noise_flat", lambda self, *a, **k: 0 * real(self, *a, **k))
    code = main(["audit", "--config", TINY, "--canaries", "100", "--output", str(out), *RUN,
                 "privacy.steps=2"])
    err = capsys.readouterr().err
    assert code == 1 and not out.exists() and "the noise is missing" in err
    assert err.rstrip().endswith(f"--output: cannot write {out}: No space left on device "
                                 "(the results were printed above)")


def _cli_audit(rank: int, world: int, out: str, overrides: list[str]) -> int:
    from dptrain.cli import main

    return main(["audit", "--config", TINY, "--canaries", "300", "--audit-seed", "1",
                 "--output", out, *RUN, "privacy.steps=2", *overrides])


def _cli_audit_rank1_without_noise(rank: int, world: int, out: str) -> int:
    from dptrain.trainer import Trainer

    real = Trainer._noise_flat
    Trainer._noise_flat = lambda self, *a, **k: (0 if self.rank == 1 else 1) * real(self, *a,
                                                                                     **k)
    return _cli_audit(rank, world, out, ["performance.sharding=fsdp"])


@pytest.mark.distributed
def test_noise_missing_on_one_ranks_shard_is_caught_by_the_noise_check(tmp_path):
    """Half the coordinates without noise (one rank's shard) gave those canaries a small fixed
    score in the middle of the ranking: the bound (0.907 against a claim of 1.99, an audit)
    passed. The noise check reads the release less the canaries at their coordinates."""
    from dptrain.parallel.dist import spawn

    out = tmp_path / "half.json"
    assert spawn(_cli_audit_rank1_without_noise, 2, str(out)) == [1, 1]
    report = json.loads(out.read_text())
    check = report["noise_check"]
    assert not report["consistent"] and check["ok"] is False
    assert check["smallest_variance_ratio"] == 0.0
    # the coordinates of rank 1's shards: some, not all, of the 300
    assert 30 < check["coordinates_below"] < 270
    assert report["epsilon_lower_bound"] <= report["claimed_epsilon"]  # what let it through
    # (the ranks' stderr goes where the fork server's went: not to this test's capture)


@pytest.mark.distributed
def test_canaries_enter_once_and_are_read_once_on_2_ranks(tmp_path, capsys):
    # the release does not depend on the world size, so neither may the scores: a canary
    # inserted on every rank, or a replicated release read on every rank, would double them
    from dptrain.parallel.dist import spawn

    assert _cli_audit(0, 1, str(tmp_path / "one.json"), []) == 0
    ref = json.loads((tmp_path / "one.json").read_text())
    assert len(ref["scores"]) == 300 and np.abs(ref["scores"]).max() > 0.1
    for sharding in ("fsdp", "none"):
        out = tmp_path / f"{sharding}.json"
        assert spawn(_cli_audit, 2, str(out), [f"performance.sharding={sharding}"]) == [0, 0]
        two = json.loads(out.read_text())
        assert two["world_size"] == 2 and two["canary_included"] == ref["canary_included"]
        np.testing.assert_allclose(two["scores"], ref["scores"], rtol=1e-4, atol=1e-4,
                                   err_msg=sharding)
        assert two["noise_check"]["ok"] is ref["noise_check"]["ok"] is True
        assert two["noise_check"]["smallest_variance_ratio"] == pytest.approx(
            ref["noise_check"]["smallest_variance_ratio"], rel=1e-4)


def test_an_odd_number_of_canaries_never_guesses_more_than_there_are():
    """m = 7: the plans guess at most m // 2 = 3 at each end (round(0.5 * 7) = 4 would make
    8 guesses of 7 canaries, which the theorem does not cover and the p-value refuses)."""
    rng = np.random.default_rng(0)
    for m in (7, 2003):
        included = rng.random(m) < 0.5
        res = audit_scores(included + 0.1 * rng.standard_normal(m), included, 1e-5)
        assert max(t["guessed_included"] for t in res.tried) == m // 2
        assert all(t["guessed_included"] + t["guessed_excluded"] <= m for t in res.tried)
    assert largest_lower_bound(7, 1e-5) >= 0.0


def test_bound_of_one_plan_by_hand_with_bonferroni():
    """The reported bound against a direct root of Theorem 5.2's p-value: m = 100 canaries,
    perfectly separated, the 12 plans of GUESS_FRACTIONS (1, 2, 5, 10, 20, 50 at both ends and
    at the top alone) each at 0.05 / 12; the best is the (50, 50) plan, all 100 right."""
    from scipy.optimize import brentq

    m, delta, sig = 100, 1e-5, 0.05
    included = np.arange(m) % 2 == 0
    res = audit_scores(included.astype(float), included, delta, sig)
    assert len(res.tried) == 12 and (res.guesses, res.correct) == (100, 100)
    ref = brentq(lambda e: one_run_p_value(m, 100, 100, e, delta) - sig / 12, 0.0, 50.0,
                 xtol=1e-9)
    assert res.epsilon_lower_bound == pytest.approx(ref, abs=1e-5)
    # without the correction (0.05 for each plan) the bound would be larger
    loose = brentq(lambda e: one_run_p_value(m, 100, 100, e, delta) - sig, 0.0, 50.0)
    assert loose > ref + 0.05


def test_canaries_are_included_with_probability_one_half():
    # Theorem 5.2 needs inclusion probability exactly 1/2
    for seed in (0, 1):
        can = GradientCanaries([("w", (20000,))], 20000, 1.0, 0.1, seed=seed)
        assert abs(float(can.included.mean()) - 0.5) < 0.015


def _cli(tmp_path, name, *extra):
    from dptrain.cli import main

    out = tmp_path / f"{name}.json"
    code = main(["audit", "--config", TINY, "--canaries", "400", "--output", str(out),
                 *RUN, *extra])
    return code, json.loads(out.read_text())


def test_audit_report_is_the_bound_of_its_own_scores_at_the_confidence(tmp_path, capsys):
    """The report's bound, ceiling and inclusion bits: recomputed from the report's scores and
    bits with audit_scores (checked against the theorem above) at significance 1 - confidence;
    the bits are the canaries' (half included), not another mask."""
    code, rep = _cli(tmp_path, "a", "--confidence", "0.9", "--audit-seed", "5")
    assert code == 0
    # the run's plan, as RUN sets it, and the flags
    assert (rep["config"], rep["audit_seed"], rep["world_size"]) == (TINY, 5, 1)
    assert (rep["sample_rate"], rep["steps"], rep["noise_multiplier"]) == (0.5, 8, 3.4)
    assert (rep["clip_norm"], rep["delta"]) == (1.0, 1e-5)
    assert rep["canaries_ever_sampled"] == pytest.approx(1 - 0.5 ** 8)
    assert rep["significance"] == pytest.approx(0.1) and rep["confidence"] == 0.9
    again = audit_scores(rep["scores"], rep["canary_included"], rep["delta"], 0.1)
    assert rep["epsilon_lower_bound"] == pytest.approx(again.epsilon_lower_bound, abs=1e-9)
    assert (rep["guesses"], rep["correct"]) == (again.guesses, again.correct)
    assert rep["largest_possible_bound"] == pytest.approx(largest_lower_bound(400, 1e-5, 0.1))
    from dptrain.config import load
    from dptrain.trainer import RunConfig, Trainer

    t = Trainer(load(RunConfig, TINY, ["train.progress=false", *RUN]))
    shapes = [(n, tuple(p.shape)) for n, p in t.named_params]
    can = GradientCanaries(shapes, 400, 1.0, 0.5, seed=5)  # audit seed 5: the run's canaries
    assert rep["canary_included"] == can.included.tolist()
    assert rep["included"] == int(can.included.sum()) == again.included  # the count
    capsys.readouterr()


def test_consistency_is_the_bound_against_the_claim(tmp_path, capsys, monkeypatch):
    """Without noise the bound is large and deterministic (the scores are C times the number
    of releases a canary was in); a claim just above it passes, just below it fails."""
    from dptrain.trainer import Trainer

    real = Trainer._noise_flat
    monkeypatch.setattr(Trainer, "_noise_flat", lambda self, *a, **k: 0 * real(self, *a, **k))
    code, rep = _cli(tmp_path, "measure")
    bound = rep["epsilon_lower_bound"]
    assert code == 1 and bound > 1 and rep["noise_check"]["ok"] is False
    err = capsys.readouterr().err
    assert ("the noise is missing or too small at 400 of 400 canary coordinates; at 18 "
            "parameter(s) (" in err and "; at all canary coordinates together (variance "
            "ratio 0)" in err), err
    # the bound's verdict alone (the noise check, which a run without noise fails, aside)
    monkeypatch.setattr(GradientCanaries, "noise_check", lambda self, *a: {"ok": None})
    # (a bound equal to the claim is at most the claim: consistent)
    for claim, want in ((bound + 0.2, 0), (bound, 0), (bound - 0.2, 1)):
        monkeypatch.setattr(Trainer, "epsilon", lambda self, c=claim: c)
        code, rep = _cli(tmp_path, f"claim{want}", "--force")
        assert rep["epsilon_lower_bound"] == pytest.approx(bound)
        assert code == want and rep["consistent"] is (want == 0)
    # the noise check alone: a bound below the claim does not pass noise that is too small
    # (up to 4 parameters named, then "...")
    monkeypatch.setattr(Trainer, "epsilon", lambda self: bound + 0.2)
    for names, shown in ((["a"], "a"), (list("abcd"), "a, b, c, d"),
                         (list("abcde"), "a, b, c, d, ...")):
        small = {"ok": False, "parameters_below": names, "coordinates_below": 0,
                 "coordinates_checked": 400, "smallest_variance_ratio": 0.5,
                 "pool_below": False, "variance_ratio": 0.9, "significance": 1e-6}
        monkeypatch.setattr(GradientCanaries, "noise_check", lambda self, *a, c=small: c)
        capsys.readouterr()
        code, rep = _cli(tmp_path, "small", "--force")
        err = capsys.readouterr().err
        assert code == 1 and rep["consistent"] is False and rep["noise_check"] == small
        assert rep["epsilon_lower_bound"] < rep["claimed_epsilon"]
        assert (f"the noise is missing or too small at {len(names)} parameter(s) ({shown}; "
                "variance ratio to (sigma C)^2 down to 0.5) (chi-square tests at 1e-06 "
                "together)" in err), err
        assert "EXCEEDS" not in err


@pytest.mark.parametrize("confidence", ["0", "1"])
def test_confidence_0_or_1_is_refused(capsys, confidence):
    from dptrain.cli import main

    code = main(["audit", "--config", TINY, "--confidence", confidence, *RUN])
    err = capsys.readouterr().err
    assert code == 2 and "confidence" in err


def test_insert_adds_C_at_present_canaries_and_removes_the_gradient_there():
    """Unit check of GradientCanaries.insert with C != 1 (tiny's C = 1 hides a missing C):
    at every canary coordinate the sum becomes C if the canary is included and sampled at
    that step, else 0; everywhere else it is untouched; add=False only removes."""
    import torch

    shapes = [("a", (6, 5)), ("b", (40,))]
    can = GradientCanaries(shapes, 30, clip_norm=2.5, sample_rate=0.5, seed=2)
    torch.manual_seed(0)
    base = {"a": torch.randn(6, 5, dtype=torch.float64), "b": torch.randn(40, dtype=torch.float64)}
    for add in (True, False):
        acc = {n: v.clone() for n, v in base.items()}
        can.insert(acc, 3, dtype=torch.float64, device="cpu", add=add)
        present = can.included & can.sampled(3)
        assert 0 < present.sum() < 30
        want = {n: v.clone().view(-1) for n, v in base.items()}
        for i, (n, k) in enumerate(zip(can.names, can.index)):
            want[n][k] = 2.5 if (add and present[i]) else 0.0
        for n in base:
            assert torch.equal(acc[n].view(-1), want[n]), (add, n)


def test_observe_reads_each_canary_once_across_shards_split_at_a_canary():
    """Two shards [0, 5) and [5, 10) of a 10-coordinate parameter, every coordinate a canary
    (sigma = 0: the score is the released value): coordinate 5 belongs to the second shard
    only, and each canary's score is its coordinate's value."""
    import torch

    can = GradientCanaries([("w", (10,))], 10, clip_norm=1.0, sample_rate=0.5, seed=0)
    full = torch.arange(10, dtype=torch.float64) + 0.5
    can.observe("w", full[:5], 0, 5)
    can.observe("w", full[5:], 5, 10)
    np.testing.assert_array_equal(can.scores, can.index + 0.5)


def test_more_canaries_than_coordinates_exit_2(capsys):
    from dptrain.cli import main
    from dptrain.config import load
    from dptrain.trainer import RunConfig, Trainer

    t = Trainer(load(RunConfig, TINY, ["train.progress=false", *RUN]))
    total = sum(p.numel() for _, p in t.named_params)
    code = main(["audit", "--config", TINY, "--canaries", str(total + 1), *RUN])
    err = capsys.readouterr().err
    assert code == 2 and "--canaries" in err and str(total) in err
    # every coordinate a canary is still an audit (one release of it)
    code = main(["audit", "--config", TINY, "--canaries", str(total), *RUN, "privacy.steps=1",
                 "train.progress=false"])
    assert code in (0, 1) and "--canaries" not in capsys.readouterr().err


def _noise_check_of(noise_std: float, per_coordinate, steps: int = 20, m: int = 400,
                    shapes=(("a", (1000,)), ("b", (30, 20)))):
    """The noise check of m canaries over ``steps`` releases, with noise of std
    ``per_coordinate`` (one number, or one per canary) at the coordinates."""
    can = GradientCanaries(list(shapes), m, 1.0, 0.3, seed=2, noise_multiplier=noise_std)
    rng = np.random.default_rng(0)
    for step in range(steps):
        present = can.included & can.sampled(step)
        for name, size in ((n, math.prod(shape)) for n, shape in shapes):
            release = rng.normal(size=size)
            ix = can.by_name[name]
            release[can.index[ix]] = (present[ix] * 1.0
                                      + np.broadcast_to(per_coordinate, (m,))[ix]
                                      * rng.normal(size=ix.size))
            can.observe(name, torch.as_tensor(release), 0, size, step)
    return can, can.noise_check(can.noise_squares, can.noise_count)


def test_the_noise_check_passes_the_calibrated_noise_and_finds_it_missing_or_small():
    s = 2.0
    can, check = _noise_check_of(s, s)
    assert check["ok"] is True and check["coordinates_below"] == 0
    assert np.all(can.noise_count == 20)
    # the release less the canaries is the noise: its pooled variance is (sigma C)^2
    assert can.noise_squares.sum() / can.noise_count.sum() / s**2 == pytest.approx(1, abs=0.05)
    # missing at 10 coordinates: each is found, and nothing else
    std = np.full(400, s)
    std[:10] = 0
    _, check = _noise_check_of(s, std)
    assert check["ok"] is False and check["coordinates_below"] == 10
    # 0.6 sigma C everywhere: too small for no single coordinate of 20 releases to show, but
    # the parameters' pooled variance (0.36) does
    _, check = _noise_check_of(s, 0.6 * s)
    assert check["ok"] is False and set(check["parameters_below"]) == {"a", "b"}
    assert check["smallest_variance_ratio"] == pytest.approx(0.36, abs=0.06)
    # 0.75 of its scale over 40 parameters of 5 canaries and 4 releases each: no coordinate's
    # or parameter's test has the power, the pool of all has (a red team: 0.7 passed)
    many = [(f"p{i}", (20,)) for i in range(40)]
    _, check = _noise_check_of(s, 0.75 * s, steps=4, m=200, shapes=many)
    assert check["ok"] is False and check["pool_below"]
    assert check["coordinates_below"] == 0 and check["parameters_below"] == []
    assert check["coordinates_checked"] == 200
    assert check["variance_ratio"] == pytest.approx(0.5625, abs=0.08)
    assert _noise_check_of(s, s, steps=4, m=200, shapes=many)[1]["ok"] is True
    # without noise in the claim (sigma = 0) there is nothing to check
    assert _noise_check_of(0.0, 0.0)[1]["ok"] is None


def test_the_noise_check_corrects_each_coordinate_s_test_for_their_number():
    """A coordinate whose chi-square lower tail is 5e-7 fails a lone 1e-6 test but not the
    Bonferroni-corrected one (1e-6 over 10 coordinates, 1 parameter and the pool); one at 1e-9
    fails both."""
    from scipy.stats import chi2

    c = GradientCanaries([("w", (10, 10))], m=10, clip_norm=1.0, sample_rate=0.5, seed=0,
                         noise_multiplier=1.0)
    squares, count = np.ones(10), np.ones(10)
    squares[3] = chi2.ppf(5e-7, 1)
    out = c.noise_check(squares, count, significance=1e-6)
    assert out["coordinates_below"] == 0 and out["ok"] is True
    squares[3] = chi2.ppf(1e-9, 1)
    out = c.noise_check(squares, count, significance=1e-6)
    assert out["coordinates_below"] == 1 and out["ok"] is False


def test_two_canaries_are_the_fewest_accepted_and_parse_returns_the_flags():
    import argparse

    from dptrain.commands.audit import _parse

    args = argparse.Namespace(canaries="2", confidence="0.9", audit_seed="3", config=TINY,
                              output=None, plot=None, force=False)
    assert _parse(args) == (2, 0.9, 3)


def test_a_missing_config_is_named_before_an_existing_output(tmp_path, capsys):
    from dptrain.cli import main

    out = tmp_path / "audit.json"
    out.write_text("earlier")
    missing = tmp_path / "missing.yaml"
    code = main(["audit", "--config", str(missing), "--output", str(out), *RUN])
    err = capsys.readouterr().err
    assert code == 2 and f"--config: file not found: {missing}" in err and "--output" not in err


def test_a_plot_without_matplotlib_is_refused_before_the_run(tmp_path, capsys, monkeypatch):
    import sys

    import dptrain.trainer as trainer_mod
    from dptrain.cli import main

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # (an import of it raises)
    monkeypatch.setattr(trainer_mod.Trainer, "__init__",
                        lambda *a, **k: pytest.fail("the run started"))
    code = main(["audit", "--config", TINY, "--plot", str(tmp_path / "s.png"), *RUN])
    err = capsys.readouterr().err
    assert code == 2 and "--plot: needs matplotlib" in err
