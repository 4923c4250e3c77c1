"""DiSK and DOPPLER on the release: recursions, query plans, and reduction to no filter."""

import io
import math

import numpy as np
import pytest
import scipy.signal
import torch

from dptrain.config import ConfigError, from_dict, validate_tree
from dptrain.optim import OptimConfig, build_optimizer
from dptrain.optim.filters import DiSKFilter, DopplerFilter, FilterConfig


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 8)
        self.fc2 = torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def _data(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(16, 6, generator=gen), torch.randn(16, 3, generator=gen)


def _train(optim: dict, num_steps=5, seed=0):
    """A miniature trainer: follows the query plan exactly (no clipping, no noise)."""
    torch.manual_seed(seed)
    net = _Net().double()
    x, y = _data()
    x, y = x.double(), y.double()
    named = list(net.named_parameters())
    cfg = from_dict(OptimConfig, optim)
    opt = build_optimizer(cfg, named, total_steps=num_steps, release_noise_std=0.0, seed=0)
    for _ in range(num_steps):
        plan = opt.query_plan()
        total = {n: torch.zeros_like(p) for n, p in named}
        for coef, values in plan:
            point = {n: (p.detach() if values is None else values[n]).clone().requires_grad_()
                     for n, p in named}
            out = torch.func.functional_call(net, point, (x,))
            grads = torch.autograd.grad(((out - y) ** 2).mean(), list(point.values()))
            for (n, _), g in zip(named, grads):
                total[n] += coef * g
        for n, p in named:
            p.grad = total[n]
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in named}, opt


@pytest.mark.parametrize("name", ["sgd", "adamw", "muon_s"])
@pytest.mark.parametrize("filt", [
    {"name": "disk", "kappa": 1.0, "gamma": 0.5},
    {"name": "disk", "kappa": 0.0, "gamma": 0.8, "convention": "im_paper"},
    {"name": "doppler", "a": [], "b": [1.0]},
])
def test_disk_kappa_1_and_doppler_b0_1_reduce_to_the_unfiltered_optimizer(name, filt):
    base = {"name": name, "lr": 0.05}
    plain, _ = _train(base)
    filtered, _ = _train({**base, "filter": filt})
    for n in plain:
        assert torch.equal(plain[n], filtered[n]), n


def test_disk_query_plan_coefficients_sum_to_one_and_extrapolate():
    # at step 3 the query point is x_3 + gamma (x_3 - x_2); x_2 is recorded by a run of two
    # steps, independently of the filter's own state
    cfg = {"name": "sgd", "lr": 0.05, "filter": {"name": "disk", "kappa": 0.7, "gamma": 0.5}}
    x2, _ = _train(cfg, num_steps=2)
    _, opt = _train(cfg, num_steps=3)
    plan = opt.query_plan()
    assert sum(c for c, _ in plan) == pytest.approx(1.0, abs=1e-15)
    c = (1 - 0.7) / (0.7 * 0.5)
    assert plan[0][0] == pytest.approx(c) and plan[1] == (pytest.approx(1 - c), None)
    for n, p in opt.named_params:
        assert not torch.equal(p.detach(), x2[n])
        expected = p.detach() + 0.5 * (p.detach() - x2[n])
        torch.testing.assert_close(plan[0][1][n], expected, rtol=0, atol=1e-15)


def test_disk_plan_at_the_first_step_is_the_plain_gradient():
    f = DiSKFilter(kappa=0.5, gamma=0.8)
    p = torch.nn.Parameter(torch.ones(3))
    assert f.query_plan([("p", p)]) == [(1.0, None)]
    # c = 1 (gamma = (1 - kappa)/kappa): only the extrapolated gradient
    f = DiSKFilter(kappa=0.5, gamma=1.0)
    p.grad = torch.zeros(3)
    f.apply([("p", p)])
    plan = f.query_plan([("p", p)])
    assert len(plan) == 1 and plan[0][0] == 1.0 and plan[0][1] is not None


def test_disk_filter_recursion_and_noise_gain():
    f = DiSKFilter(kappa=0.3, gamma=0.5)
    p = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))
    gen = torch.Generator().manual_seed(0)
    g_ref = None
    for t in range(4):
        release = torch.randn(4, dtype=torch.float64, generator=gen)
        p.grad = release.clone()
        f.apply([("p", p)])
        g_ref = release if g_ref is None else 0.7 * g_ref + 0.3 * release
        torch.testing.assert_close(p.grad, g_ref, rtol=1e-14, atol=1e-14)
        assert f.noise_gain() == (1.0 if t == 0 else 0.3)


def test_im_paper_convention_reads_kappa_as_the_weight_of_the_previous_state():
    im = FilterConfig(name="disk", kappa=0.5, gamma=0.8, convention="im_paper")
    assert im.disk_gain() == 0.5
    assert FilterConfig(name="disk", kappa=0.2, convention="im_paper").disk_gain() == 0.8
    assert FilterConfig(name="disk", kappa=0.2).disk_gain() == 0.2


@pytest.mark.parametrize("make", [
    lambda: DopplerFilter([-0.6, 0.1], [0.3, 0.2, 0.1]),
    lambda: DopplerFilter([-0.6, 0.1], [0.3, 0.2, 0.1], "step_response"),
    lambda: DopplerFilter([], [0.5, 0.5]),
    lambda: DopplerFilter([-0.9], [0.1]),
    lambda: DiSKFilter(0.3, 0.5),
], ids=["doppler_p2_q2", "doppler_p2_q2_step_response", "doppler_fir", "doppler_ema", "disk"])
@pytest.mark.parametrize("cut", [1, 2, 3])
def test_a_filter_restored_from_its_state_dict_continues_bit_for_bit(make, cut):
    # through torch.save/load, as a checkpoint stores it; the resume tests use DOPPLER's
    # default (one b tap), which has no feed-forward history and a step-independent normaliser
    gen = torch.Generator().manual_seed(0)
    gs = [torch.randn(2, 3, dtype=torch.float64, generator=gen) for _ in range(6)]
    xs = [torch.randn(2, 3, dtype=torch.float64, generator=gen) for _ in range(6)]
    p = torch.nn.Parameter(torch.zeros(2, 3, dtype=torch.float64))

    def run(f, steps):
        out = []
        for t in steps:
            with torch.no_grad():
                p.copy_(xs[t])
            plan = f.query_plan([("w", p)])
            p.grad = gs[t].clone()
            f.apply([("w", p)])
            out.append((p.grad.clone(), f.noise_gain(),
                        [(c, None if v is None else v["w"].clone()) for c, v in plan]))
        return out

    def same(a, b):
        return (torch.equal(a[0], b[0]) and a[1] == b[1] and len(a[2]) == len(b[2]) and all(
            c1 == c2 and (v1 is None) == (v2 is None) and (v1 is None or torch.equal(v1, v2))
            for (c1, v1), (c2, v2) in zip(a[2], b[2])))

    want = run(make(), range(6))
    first = make()
    got = run(first, range(cut))
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    buf.seek(0)
    second = make()
    second.load_state_dict(torch.load(buf, weights_only=False))
    got += run(second, range(cut, 6))
    assert all(same(a, b) for a, b in zip(want, got))


@pytest.mark.parametrize("correction", ["paper", "step_response"])
@pytest.mark.parametrize("a,b", [([-0.9], [0.1]), ([-1.2, 0.5], [0.2, 0.1]), ([], [0.5, 0.5]),
                                 ([-0.6, 0.08], [0.2, 0.1, 0.1])])
def test_doppler_is_the_bias_corrected_iir_filter(a, b, correction):
    """m = lfilter(b, [1, *a], g); output m_t / c_t with c the same recursion fed sum(b) at
    every step (the DOPPLER paper's c_t = -sum a_tau c_{t-tau} + sum_tau b_tau, c = 0 before
    step 0) or, for step_response, the filter's response to a constant 1: lfilter(b, [1, *a],
    ones)."""
    T = 7
    gen = np.random.default_rng(0)
    g = gen.standard_normal((T, 3))
    m = scipy.signal.lfilter(b, [1.0, *a], g, axis=0)
    if correction == "paper":
        c = scipy.signal.lfilter([sum(b)], [1.0, *a], np.ones(T))
    else:
        c = scipy.signal.lfilter(b, [1.0, *a], np.ones(T))
    f = DopplerFilter(a, b, correction)
    p = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    for t in range(T):
        p.grad = torch.tensor(g[t])
        f.apply([("p", p)])
        np.testing.assert_allclose(p.grad.numpy(), m[t] / c[t], rtol=1e-12, atol=1e-12)
        assert f.noise_gain() == pytest.approx(b[0] / c[t])


def test_doppler_paper_and_step_response_differ_only_in_the_first_q_steps_of_an_fir():
    # b = [0.5, 0.5], a = []: a constant input g gives m = 0.5 g at step 0 (the release before
    # step 0 counts as 0), then g. paper divides by sum(b) = 1 at every step, so its first
    # output is g / 2; step_response divides by b_0 = 0.5 there and passes g unchanged
    outs = {}
    for correction in ("paper", "step_response"):
        f = DopplerFilter([], [0.5, 0.5], correction)
        p = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
        outs[correction] = []
        for _ in range(3):
            p.grad = torch.tensor([1.5, -2.0], dtype=torch.float64)
            f.apply([("p", p)])
            outs[correction].append(p.grad.clone())
    g = torch.tensor([1.5, -2.0], dtype=torch.float64)
    assert [o.tolist() for o in outs["paper"]] == [(g / 2).tolist(), g.tolist(), g.tolist()]
    assert [o.tolist() for o in outs["step_response"]] == [g.tolist()] * 3


def test_doppler_paper_correction_with_feedback_approaches_a_constant_slowly():
    # docs/optim.md: with feedback the first output's deficit decays with the pole: a = [-0.9],
    # b = [0.5, 0.5] gives 0.5, 0.763, 0.851, 0.894 times a constant g (m_t / c_t with
    # m = 0.5, 1.45, 2.305, 3.0745 and c = 1, 1.9, 2.71, 3.439); step_response passes g
    for correction, want in (("paper", [0.5, 1.45 / 1.9, 2.305 / 2.71, 3.0745 / 3.439]),
                             ("step_response", [1.0] * 4)):
        f = DopplerFilter([-0.9], [0.5, 0.5], correction)
        p = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))
        got = []
        for _ in range(4):
            p.grad = torch.ones(1, dtype=torch.float64)
            f.apply([("p", p)])
            got.append(float(p.grad))
        assert got == pytest.approx(want, rel=1e-12), correction


def test_doppler_constant_input_passes_unchanged():
    f = DopplerFilter([-0.9], [0.1])
    p = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    for _ in range(5):
        p.grad = torch.tensor([1.5, -2.0], dtype=torch.float64)
        f.apply([("p", p)])
        torch.testing.assert_close(p.grad, torch.tensor([1.5, -2.0], dtype=torch.float64))


@pytest.mark.parametrize("filt,field", [
    ({"name": "doppler", "a": [-1.1], "b": [0.1]}, "optim.filter.a"),
    ({"name": "doppler", "b": []}, "optim.filter.b"),
    # step_response: c_0 = b_0 = 0; c_1 = b_0 + b_1 = 0
    ({"name": "doppler", "a": [], "b": [0.0, 1.0], "correction": "step_response"},
     "optim.filter.b"),
    ({"name": "doppler", "a": [], "b": [1.0, -1.0, 0.5], "correction": "step_response"},
     "optim.filter.b"),
    ({"name": "doppler", "a": [], "b": [1.0, -1.0]}, "optim.filter.b"),  # paper: sum(b) = 0
    ({"name": "disk", "correction": "step_response"}, "optim.filter.correction"),
    ({"name": "disk", "kappa": 0.0}, "optim.filter.kappa"),
    ({"name": "disk", "gamma": -1.0}, "optim.filter.gamma"),
    ({"name": "disk", "gamma": 0.0}, "optim.filter.gamma"),  # (c = ratio / 0)
    ({"name": "disk", "kappa": 1.0, "convention": "im_paper"}, "optim.filter.kappa"),
    # another filter's settings would be ignored (DiSK's gain without DiSK: no filter at all)
    ({"kappa": 0.5}, "optim.filter.kappa"),
    ({"name": "doppler", "gamma": 2.0}, "optim.filter.gamma"),
    ({"name": "doppler", "convention": "im_paper"}, "optim.filter.convention"),
    ({"a": [-0.5]}, "optim.filter.a"),
    ({"name": "disk", "b": [0.2]}, "optim.filter.b"),
    # DiSK's query weight c = (1 - kappa)/(kappa gamma) past 2^24: kappa 5e-324 divided by
    # zero, gamma 5e-324 made c infinite (a NaN model, exit 0), 1e-300 overflowed at step 2
    ({"name": "disk", "kappa": 5e-324}, "optim.filter.kappa"),
    ({"name": "disk", "kappa": 1e-300}, "optim.filter.kappa"),
    ({"name": "disk", "gamma": 5e-324}, "optim.filter.gamma"),
    ({"name": "disk", "gamma": 1e-8}, "optim.filter.gamma"),
    ({"name": "disk", "convention": "im_paper", "kappa": 0.99999999}, "optim.filter.kappa"),
    # poles exactly on the unit circle, which np.roots put at 0.9999999999999999 (and
    # 0.9999999999999998): the noise grew without bound
    ({"name": "doppler", "a": [0.5, 1.0]}, "optim.filter.a"),
    ({"name": "doppler", "a": [-1.9, 1.0]}, "optim.filter.a"),
    ({"name": "doppler", "a": [-2.0, 1.0]}, "optim.filter.a"),  # a double pole at 1
])
def test_bad_filter_settings_name_their_field(filt, field):
    cfg = from_dict(OptimConfig, {"filter": filt})
    with pytest.raises(ConfigError) as e:
        validate_tree(cfg, "optim")
    assert e.value.field == field


@pytest.mark.parametrize("kappa, gamma", [(0.01, 0.001), (1.0, 1e-300), (0.7, 1e-6)])
def test_disk_weights_below_2_24_are_accepted(kappa, gamma):
    cfg = from_dict(OptimConfig, {"filter": {"name": "disk", "kappa": kappa, "gamma": gamma}})
    validate_tree(cfg, "optim")  # (kappa = 1: c = 0, the filter off, whatever gamma)


def test_poles_inside_the_unit_circle_agree_with_their_moduli():
    from dptrain.optim.filters import poles_inside_unit_circle

    rng = np.random.default_rng(0)
    for _ in range(2000):
        a = rng.uniform(-2.5, 2.5, size=rng.integers(1, 5)).tolist()
        r = float(np.abs(np.roots([1.0, *a])).max())
        if abs(r - 1.0) > 1e-6:
            assert poles_inside_unit_circle(a) == (r < 1.0), (a, r)
    assert poles_inside_unit_circle([]) and poles_inside_unit_circle([-0.9])
    assert not poles_inside_unit_circle([-1.0]) and not poles_inside_unit_circle([1.0])


def test_a_normaliser_that_reaches_0_after_the_checked_prefix_is_refused_for_the_run():
    """c_t of a = [-0.999], b = [-1, 1.0001563366255024] (step_response) reaches 8.5e-14 at step
    2,000, past the 1,000 steps FilterConfig checks alone: the run's config checks every step."""
    from dptrain.trainer import RunConfig

    filt = {"name": "doppler", "a": [-0.999], "b": [-1.0, 1.0001563366255024],
            "correction": "step_response"}
    validate_tree(from_dict(OptimConfig, {"filter": filt}), "optim")  # the prefix: fine
    short = from_dict(RunConfig, {"optim": {"filter": filt}, "privacy": {"steps": 1500}})
    validate_tree(short)
    long = from_dict(RunConfig, {"optim": {"filter": filt}, "privacy": {"steps": 3000}})
    with pytest.raises(ConfigError) as e:
        validate_tree(long)
    assert e.value.field == "optim.filter.b" and "step 2000" in e.value.message


def test_doppler_with_other_coefficients_restarts_its_state_instead_of_dividing_by_zero():
    """A resume may change optim.filter.a/b (optimizer settings); the config checks c_t != 0
    from step 0, but the loaded filter went on from the old filter's c history, where c_t can
    be 0: the update was NaN. Now another filter's state restarts empty (and says so); the same
    coefficients still continue bit for bit (the test above); a checkpoint without stored
    coefficients restarts only where its history leads to c_t = 0."""
    p = torch.nn.Parameter(torch.zeros(3))
    old = DopplerFilter([-0.9], [0.1])
    for _ in range(10):
        p.grad = torch.ones(3)
        old.apply([("w", p)])
    b_new = 0.5 * old.c_hist[0]  # c_10 = b - a c_9 = 0 with a = [0.5]
    FilterConfig(name="doppler", a=[0.5], b=[b_new]).validate()  # from step 0: fine
    for saved in (old.state_dict(), {k: v for k, v in old.state_dict().items()
                                     if k != "coefficients"}):
        new = DopplerFilter([0.5], [b_new])
        new.load_state_dict(saved)
        assert new.restart_note and "restarts empty" in new.restart_note
        assert new.num_steps == 0 and not new.c_hist and not new.m_hist
        p.grad = torch.ones(3)
        new.apply([("w", p)])
        assert torch.isfinite(p.grad).all()
        assert torch.allclose(p.grad, torch.ones(3))  # step 0: m_0 / c_0 = g
    same = DopplerFilter([-0.9], [0.1])
    same.load_state_dict(old.state_dict())
    assert same.restart_note is None and same.num_steps == 10


@pytest.mark.parametrize("old, new", [("paper", "step_response"), ("step_response", "paper")])
def test_doppler_resumed_with_another_correction_keeps_its_history(old, new):
    """m and g do not depend on the correction, only c_t does: a resume that changes only
    optim.filter.correction keeps the history (it restarted it empty) and goes on exactly as a
    filter that had the new correction from step 0, on the same gradients."""
    a, b = [-0.6, 0.1], [0.2, 0.1, 0.05]
    g = torch.Generator().manual_seed(2)
    grads = [torch.randn(4, generator=g, dtype=torch.float64) for _ in range(14)]
    p = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))

    def run(f, gs):
        outs = []
        for x in gs:
            p.grad = x.clone()
            f.apply([("w", p)])
            outs.append(p.grad.clone())
        return outs

    first = DopplerFilter(a, b, old)
    run(first, grads[:9])
    resumed = DopplerFilter(a, b, new)
    resumed.load_state_dict(first.state_dict())
    assert resumed.num_steps == 9 and resumed.restart_note and "continues" in resumed.restart_note
    ref = DopplerFilter(a, b, new)
    want = run(ref, grads)[9:]
    got = run(resumed, grads[9:])
    assert all(torch.equal(x, y) for x, y in zip(got, want))
    assert resumed.noise_gain() == ref.noise_gain() and resumed.c_hist == ref.c_hist


def test_doppler_correction_change_whose_recomputed_normaliser_reaches_0_restarts():
    """c_t under the new correction is 0 at step 1,200, past the config check's 1,000 steps
    from 0 but within its horizon from the resume's step 300: the state restarts empty, and
    the note says where c_t is 0 (it said only that the coefficients differ)."""
    from dptrain.optim.filters import doppler_normaliser, first_zero_normaliser

    a = [-0.999]

    def c_at(b0, t_end=1200):
        c_hist = []
        for t in range(t_end + 1):
            c = doppler_normaliser(a, [b0, 1.0 - b0], "step_response", c_hist, t)
            c_hist = [c]
        return c

    lo, hi = -3000.0, -2000.0  # c_1200 changes sign in between: bisect for its zero
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if c_at(mid) < 0 else (lo, mid)
    b = [lo, 1.0 - lo]
    assert first_zero_normaliser(a, b, "step_response", [], 0, 5000)[0] == 1200
    p = torch.nn.Parameter(torch.zeros(3))
    old = DopplerFilter(a, b, "paper")
    for _ in range(300):
        p.grad = torch.ones(3)
        old.apply([("w", p)])
    new = DopplerFilter(a, b, "step_response")
    new.load_state_dict(old.state_dict())
    assert new.num_steps == 0 and not new.m_hist
    assert "restarts empty" in new.restart_note and "at step 1200" in new.restart_note


def test_disk_does_not_extrapolate_a_parameter_new_since_the_last_step():
    """A parameter the last step did not hold (a loop of one's own that adds one, an old
    checkpoint's x_prev without it) has no x_{t-1}: its query point is the parameter itself
    (a mutant extrapolating from 0 queried (1 + gamma) b)."""
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.full((3,), 2.0))
    f = DiSKFilter(0.5, 0.5)
    a.grad = torch.ones(3)
    f.apply([("a", a)])
    (c, ahead), _ = f.query_plan([("a", a), ("b", b)])
    assert torch.equal(ahead["b"], b.detach()) and torch.equal(ahead["a"], a.detach())


def test_disk_plans_a_parameter_that_had_no_gradient_at_the_last_step():
    # x_{t-1} was recorded only for parameters with a gradient: the next plan raised KeyError
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.full((3,), 2.0))
    named = [("a", a), ("b", b)]
    f = DiSKFilter(0.5, 0.5)
    a.grad, b.grad = torch.ones(3), None
    f.apply(named)
    with torch.no_grad():
        a.add_(1.0)  # the step moves a only
    (c, ahead), _ = f.query_plan(named)
    assert torch.equal(ahead["b"], b.detach())  # not moved: no extrapolation
    assert torch.equal(ahead["a"], a.detach() + 0.5 * torch.ones(3))
    # b had a gradient once and moved then, but not at the last step: still no extrapolation
    # (its x_{t-1} was left at the step before, so the query extrapolated that old move)
    a.grad, b.grad = torch.ones(3), torch.ones(3)
    f.apply(named)
    with torch.no_grad():
        a.add_(1.0), b.add_(1.0)
    a.grad, b.grad = torch.ones(3), None
    f.apply(named)
    with torch.no_grad():
        a.add_(1.0)
    (c, ahead), _ = f.query_plan(named)
    assert torch.equal(ahead["b"], b.detach())


@pytest.mark.parametrize("saved, loader", [("disk", "doppler"), ("doppler", "disk")])
def test_another_filter_s_state_is_refused_naming_the_field(saved, loader):
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    make = {"disk": lambda: DiSKFilter(0.5, 0.5), "doppler": lambda: DopplerFilter([-0.9], [0.1])}
    source = make[saved]()
    source.apply([("p", p)])
    with pytest.raises(ConfigError, match="optim.filter.name"):
        make[loader]().load_state_dict(source.state_dict())


def test_doppler_restarting_empty_drops_its_own_state_too():
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    f = DopplerFilter([-0.9], [0.1])
    for _ in range(3):
        f.apply([("p", p)])
    other = DopplerFilter([-0.5], [0.5])
    other.apply([("p", p)])
    f.load_state_dict(other.state_dict())  # other coefficients: restarts empty
    assert f.restart_note and f.num_steps == 0 and f.c_hist == [] and f.m_hist == {}
    assert f.state_dict() == DopplerFilter([-0.9], [0.1]).state_dict()


def test_doppler_step0_checkpoint_with_another_correction_is_not_called_a_coefficient_change():
    """Only ``correction`` differs (a and b equal): the history may go on (docs/optim.md). At
    step 0 the note said the coefficients differ and the state restarts, which is not so."""
    saved = DopplerFilter([-0.9], [0.5, 0.5], "step_response")
    f = DopplerFilter([-0.9], [0.5, 0.5], "paper")
    f.load_state_dict(saved.state_dict())
    assert f.restart_note is None or "differ from this run" not in f.restart_note, f.restart_note


# --- settings, histories and dtypes one at a time ---------------------------------------

def test_first_zero_normaliser_is_relative_to_b_and_catches_infinity():
    from dptrain.optim.filters import first_zero_normaliser

    # step_response: c_0 = 1, c_1 = b_0 + b_1 = 1e-12, below 1e-9 of sum |b| (c_1 ~ 0)
    zero = first_zero_normaliser([], [1.0, -1.0 + 1e-12], "step_response", [], 0, 5)
    assert zero is not None and zero[0] == 1
    assert first_zero_normaliser([], [1.0, -1.0 + 1e-6], "step_response", [], 0, 5) is None
    # a history that overflowed: c_0 = 1 + 0.5 inf is not a normaliser either
    assert first_zero_normaliser([-0.5], [1.0], "paper", [math.inf], 0, 3) == (0, math.inf)


def test_disk_with_kappa_1_keeps_a_single_evaluation():
    # kappa = 1: c = 0, the filter is off; a plan [(0, ahead), (1, None)] gave the same sum at
    # twice the cost
    f = DiSKFilter(kappa=1.0, gamma=0.5)
    p = torch.nn.Parameter(torch.ones(3))
    for _ in range(3):
        p.grad = torch.ones(3)
        f.apply([("p", p)])
        with torch.no_grad():
            p.add_(1.0)
        assert f.query_plan([("p", p)]) == [(1.0, None)]


def test_doppler_keeps_only_the_histories_its_coefficients_read():
    # m_{t-1..t-p} and g_{t-1..t-q}: the state (and each checkpoint) does not grow with t
    f = DopplerFilter([-0.6, 0.1], [0.3, 0.2, 0.1])
    p = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    for _ in range(6):
        p.grad = torch.ones(3, dtype=torch.float64)
        f.apply([("w", p)])
    state = f.state_dict()
    assert len(state["m_hist"]["w"]) == 2 and len(state["g_hist"]["w"]) == 2
    assert len(state["c_hist"]) == 2


@pytest.mark.parametrize("make", [lambda: DiSKFilter(0.3, 0.5),
                                  lambda: DopplerFilter([-0.6, 0.1], [0.3, 0.2, 0.1])],
                         ids=["disk", "doppler"])
def test_a_float32_filter_state_continues_in_the_parameters_float64(make):
    # a float32 run's checkpoint resumed with performance.dtype float64: the history is cast to
    # the parameter's dtype and the filter goes on as the float64 run (to float32's rounding)
    gen = torch.Generator().manual_seed(0)
    gs = [torch.randn(4, generator=gen, dtype=torch.float64) for _ in range(5)]
    p32 = torch.nn.Parameter(torch.zeros(4))
    p64 = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))
    f32, ref = make(), make()
    for g in gs[:3]:
        for f, p in ((f32, p32), (ref, p64)):
            f.query_plan([("w", p)])
            p.grad = g.to(p.dtype).clone()
            f.apply([("w", p)])
    f64 = make()
    f64.load_state_dict(f32.state_dict())
    for g in gs[3:]:
        outs = []
        for f in (f64, ref):
            f.query_plan([("w", p64)])
            p64.grad = g.clone()
            f.apply([("w", p64)])
            outs.append(p64.grad.clone())
        assert outs[0].dtype == torch.float64
        torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-6)
        hists = [f64.g] if isinstance(f64, DiSKFilter) else [f64.m_hist, f64.g_hist]
        for v in (t for h in hists for v in h.values() for t in (v if isinstance(v, list) else [v])):
            assert v.dtype == torch.float64


def test_doppler_with_the_same_a_but_another_b_restarts_empty():
    # only a and b both equal let the history go on; b alone changed is another filter
    p = torch.nn.Parameter(torch.zeros(3))
    old = DopplerFilter([-0.9], [0.1])
    for _ in range(4):
        p.grad = torch.ones(3)
        old.apply([("w", p)])
    new = DopplerFilter([-0.9], [0.2])
    new.load_state_dict(old.state_dict())
    assert new.num_steps == 0 and new.restart_note and "restarts empty" in new.restart_note


def test_built_filters_take_the_configured_settings_and_documented_defaults():
    from dptrain.optim.filters import build_filter

    f = build_filter(FilterConfig(name="doppler", b=[0.5, 0.5], correction="step_response"))
    assert (f.a, f.b, f.correction) == ([-0.9], [0.5, 0.5], "step_response")
    d = build_filter(FilterConfig(name="doppler"))  # the EMA m = 0.9 m + 0.1 g
    assert (d.a, d.b, d.correction) == ([-0.9], [0.1], "paper")
    disk = build_filter(FilterConfig(name="disk"))
    assert (disk.kappa, disk.gamma) == (0.7, 0.5)
    im = build_filter(FilterConfig(name="disk", kappa=0.2, convention="im_paper"))
    assert im.kappa == pytest.approx(0.8)
