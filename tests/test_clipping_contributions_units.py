"""dptrain/clipping/contributions.py one function at a time, against explicit per-example
gradients: every contribution instantiated (a loop over the tokens for the Outer forms), summed
with its coefficient, then normed and weighted directly in float64."""

from __future__ import annotations

import pytest
import torch

from dptrain.clipping.contributions import (
    Dense,
    Factored,
    OneHot,
    Outer,
    Rows,
    add_instantiated,
    clipped_sum,
    drop_examples,
    first_write_order,
    refine_cancelled,
    rounding_scale,
    sq_rows,
    squared_norms,
    squared_norms_scaled,
)

B, OUT, IN = 3, 5, 4  # OUT > IN: the clipped sum and the first write weight R, not L


def _explicit(c) -> torch.Tensor:
    """(B, OUT * IN) per-example gradient of ``c`` WITHOUT its coefficient: a loop over the
    examples and tokens (one-hot rows placed by hand), independent of the module's algebra."""
    if isinstance(c, Dense):
        return c.g.reshape(c.g.shape[0], -1).clone()
    rows = []
    for b in range(c.R.shape[0]):
        g = torch.zeros(OUT, IN, dtype=c.R.dtype)
        for t in range(c.R.shape[1]):
            if isinstance(c.L, OneHot):
                g[int(c.L.ids[b, t])] += c.R[b, t]
            else:
                g += torch.outer(c.L[b, t], c.R[b, t])
        rows.append(g.reshape(-1))
    return torch.stack(rows)


def _contribs(seed: int) -> list:
    """One parameter used five times: two dense outer forms of different T (a module called
    twice), a one-hot one (a tied embedding) and two dense per-example gradients, each with its
    own coefficient (a query plan's state weights)."""
    gen = torch.Generator().manual_seed(seed)
    f64 = dict(generator=gen, dtype=torch.float64)
    return [
        Outer(torch.randn(B, 3, OUT, **f64), torch.randn(B, 3, IN, **f64), 0.5),
        Outer(torch.randn(B, 2, OUT, **f64), torch.randn(B, 2, IN, **f64), -1.5),
        Outer(OneHot(torch.randint(0, OUT, (B, 4), generator=gen), OUT),
              torch.randn(B, 4, IN, **f64), 2.0),
        Dense(torch.randn(B, OUT, IN, **f64), 0.75),
        Dense(torch.randn(B, OUT, IN, **f64), -0.25),  # a bias used twice: Dense with Dense
    ]


def _total(contribs) -> torch.Tensor:
    return sum(c.coef * _explicit(c) for c in contribs)


@pytest.mark.parametrize("seed", [0, 1])
def test_ghost_squared_norms_include_every_cross_term_with_its_coefficients(seed):
    contribs = _contribs(seed)
    want = _total(contribs).pow(2).sum(1)
    for k in range(1, len(contribs) + 1):  # every prefix: pairs of every kind of form
        part = contribs[:k]
        sq, used = squared_norms(part)
        torch.testing.assert_close(sq, _total(part).pow(2).sum(1), rtol=1e-12, atol=1e-12)
        assert len(used) == len(part) and all(a is b for a, b in zip(used, part))
    # the pairs are not symmetric in the engine's order: the reverse gives the same norms
    torch.testing.assert_close(squared_norms(contribs[::-1])[0], want, rtol=1e-12, atol=1e-12)


def test_the_torch_paths_rounding_scale_is_rounding_scale_with_every_coefficient():
    # the diagonals read off the Gram matrices, weighted by coef^2 and summed over the
    # contributions, one-hot and dense ones included, are the documented scale
    contribs = _contribs(2)
    _, scale, _ = squared_norms_scaled(contribs)
    want = rounding_scale(contribs)
    torch.testing.assert_close(scale, want, rtol=1e-12, atol=0)
    # the documented formula itself: sum_u coef_u^2 sum_t |L_t|^2 |R_t|^2, |g|^2 for a Dense one
    by_hand = sum(c.coef ** 2 * ((c.L.norm(dim=-1) ** 2 if isinstance(c.L, torch.Tensor) else 1)
                                 * c.R.norm(dim=-1) ** 2).sum(1)
                  for c in contribs[:3]) + sum(c.coef ** 2 * c.g.flatten(1).pow(2).sum(1)
                                               for c in contribs[3:])
    torch.testing.assert_close(want, by_hand, rtol=1e-12, atol=0)


@pytest.mark.parametrize("order", ["first_write", "as_given", "reversed"])
@pytest.mark.parametrize("into_out", [False, True])
def test_add_instantiated_sums_every_form_with_its_coefficient(order, into_out):
    contribs = _contribs(3)
    # a dense outer form with OUT <= IN too, so that the first write scales L (and R above)
    narrow = Outer(torch.randn(B, 2, OUT, dtype=torch.float64),
                   torch.randn(B, 2, OUT + 1, dtype=torch.float64), 3.0)
    for is_narrow, cs in ((False, contribs), (True, [narrow])):
        cs = {"first_write": first_write_order(cs), "as_given": cs, "reversed": cs[::-1]}[order]
        width = cs[0].R.shape[-1] if isinstance(cs[0], Outer) else IN
        out = torch.full((B, OUT * width), float("nan"), dtype=torch.float64) if into_out else None
        buf = None
        for c in cs:
            buf = add_instantiated(buf, c, c.coef, out if buf is None else None)
        if into_out:
            assert buf is out  # written into the buffer given, never read
        if is_narrow:
            want = narrow.coef * torch.stack([
                sum(torch.outer(narrow.L[b, t], narrow.R[b, t]) for t in range(2)).reshape(-1)
                for b in range(B)])
        else:
            want = _total(cs)
        torch.testing.assert_close(buf, want, rtol=1e-12, atol=1e-12)


def test_clipped_sum_weights_each_example_once_by_its_factor_and_each_form_by_its_coef():
    contribs = _contribs(4)
    lam = torch.tensor([0.25, -2.0, 0.0], dtype=torch.float64)
    got = clipped_sum(contribs, lam, torch.Size([OUT, IN]), torch.float64)
    want = (lam[:, None] * _total(contribs)).sum(0).reshape(OUT, IN)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    # each form alone, so that one form's error is not hidden by another's
    for c in contribs:
        got = clipped_sum([c], lam, torch.Size([OUT, IN]), torch.float64)
        torch.testing.assert_close(got, c.coef * (lam[:, None] * _explicit(c)).sum(0).reshape(OUT, IN),
                                   rtol=1e-12, atol=1e-12)


def test_a_cancelled_example_is_taken_out_of_the_ghost_form_with_its_coefficients():
    # example 1 (not a prefix of the batch) is refined: its norm and the clipped sum's row come
    # from its instantiated gradient, the others' from the ghost form, each example once
    contribs = _contribs(5)
    sq, _ = squared_norms(contribs)
    doubt = torch.tensor([False, True, False])
    wrong = sq.clone()
    wrong[1] = 123.0  # what the ghost sum said: replaced by the instantiated row's norm
    out, used = refine_cancelled(contribs, wrong, doubt)
    torch.testing.assert_close(out, sq, rtol=1e-12, atol=1e-12)
    rows = [c for c in used if isinstance(c, Rows)]
    assert len(rows) == 1 and rows[0].idx.tolist() == [1]
    torch.testing.assert_close(rows[0].g, _total(contribs)[1:2], rtol=1e-12, atol=1e-12)
    lam = torch.tensor([0.5, 3.0, -1.0], dtype=torch.float64)
    got = clipped_sum(used, lam, torch.Size([OUT, IN]), torch.float64)
    want = (lam[:, None] * _total(contribs)).sum(0).reshape(OUT, IN)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_dropped_examples_add_exactly_nothing_whatever_their_factors_hold():
    contribs = _contribs(6)
    for c in contribs:  # example 1's captured tensors are not finite, in every factor
        if isinstance(c, Dense):
            c.g[1] = float("nan")
        else:
            c.R[1, 0] = float("inf")
            if isinstance(c.L, torch.Tensor):
                c.L[1, -1] = float("nan")
    keep = torch.tensor([True, False, True])
    rows = Rows(torch.tensor([1, 2]), torch.randn(2, OUT * IN, dtype=torch.float64), 2.0)
    dropped = [drop_examples(c, keep) for c in [*contribs, rows]]
    lam = torch.tensor([1.0, 0.0, 0.5], dtype=torch.float64)
    got = clipped_sum(dropped, lam, torch.Size([OUT, IN]), torch.float64)
    clean = [drop_examples(c, keep) for c in contribs]
    assert torch.isfinite(got).all()
    # Rows replace their examples' share of the other forms: example 2 comes from its row only
    want = (lam[0] * _total(clean)[0] + lam[2] * 2.0 * rows.g[1]).reshape(OUT, IN)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert dropped[-1].g[0].abs().sum() == 0 and torch.equal(dropped[-1].g[1], rows.g[1])


@pytest.mark.parametrize("n", [512, 1025, 1536, 2047])
def test_sq_rows_of_any_length_and_layout_is_the_float64_squared_norm(n):
    # block tails of 0, 1, 0 and 511 elements; a transposed (non-contiguous) view too
    gen = torch.Generator().manual_seed(n)
    g = torch.randn(3, n, generator=gen)
    want = g.double().pow(2).sum(1)
    torch.testing.assert_close(sq_rows(g).double(), want, rtol=1e-6, atol=0)
    t = torch.randn(n, 3, generator=gen).t()  # (3, n) with stride (1, 3)
    assert t.stride(1) != 1
    torch.testing.assert_close(sq_rows(t).double(), t.double().pow(2).sum(1), rtol=1e-6, atol=0)


class _Toy(Factored):
    """A layer-specific form with a ghost form (a stand-in for the weight-standardised conv):
    its per-example gradient is ``g``, and its ghost formula says example 1 cancelled."""

    supports_ghost = True

    def __init__(self, g: torch.Tensor, coef: float):
        self.g, self.coef = g, coef

    def instantiate(self) -> torch.Tensor:
        return self.g

    def weighted_sum(self, w: torch.Tensor) -> torch.Tensor:
        return torch.einsum("b...,b->...", self.g, w)

    def ghost_sq_norms(self):
        return self.g.flatten(1).pow(2).sum(1), (torch.tensor([1]), self.g[1:2].flatten(1))


def test_a_lone_factored_forms_recomputed_rows_keep_its_coefficient():
    g = torch.randn(B, OUT, IN, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    c = _Toy(g, -3.0)
    sq, used = squared_norms([c])
    torch.testing.assert_close(sq, 9.0 * g.flatten(1).pow(2).sum(1), rtol=1e-12, atol=0)
    lam = torch.tensor([0.5, 2.0, 1.0], dtype=torch.float64)
    got = clipped_sum(used, lam, torch.Size([OUT, IN]), torch.float64)
    torch.testing.assert_close(got, -3.0 * torch.einsum("b...,b->...", g, lam), rtol=1e-12,
                               atol=1e-12)
