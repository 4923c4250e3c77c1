"""The engine's perturbation check that row b of every hooked input, and loss b, belong to
example b alone (dptrain/clipping/rows.py). Each refused model below passed every earlier check
and got per-example norms that bound no example's influence (shown against the true influence
for the batch mean); the models that keep examples apart are still accepted, with results,
randomness and buffers as without the check."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from _reference import reference_grads
from test_clipping_models import gpt2_batch, gpt2_loss

from dptrain.clipping import ClippingEngine
from dptrain.clipping.rows import REL_TOL


def sq_loss(m, batch):
    out = m(batch[0])
    return 0.5 * out.pow(2).reshape(out.shape[0], -1).sum(1)


class BatchCentred(nn.Module):
    """h - h.mean(0): every example's hidden state depends on the whole microbatch."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.b(h - h.mean(0, keepdim=True))


class SequenceFirst(nn.Module):
    """nn.MultiheadAttention's default (T, B, d) layout: the Linear inside sees position t as
    its row; with T = B every shape check passes."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):  # x: (B, T, 4)
        h = torch.tanh(self.a(x.transpose(0, 1)))  # (T, B, 4)
        return self.b(h).transpose(0, 1)


class Reversed(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)).flip(0))


def _x(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("model, shape, layer", [
    (BatchCentred, (5, 4), "b"),
    (SequenceFirst, (3, 3, 4), "a"),  # T = B = 3
    (Reversed, (5, 4), "b"),  # odd B: the flip keeps each example's parity, not its half
    (Reversed, (4, 4), "b"),
])
def test_a_model_that_mixes_or_transposes_examples_is_refused_naming_the_layer(model, shape,
                                                                                layer):
    torch.manual_seed(0)
    m = model().double()
    with pytest.raises(ValueError, match=rf"the rows of the input of {layer} \(Linear"):
        ClippingEngine(m, clip_norm=1.0).accumulate(sq_loss, (_x(*shape),), {})


class Between(nn.Module):
    """Linear -> tanh -> f -> Linear, f an op across the batch dimension."""

    def __init__(self, f):
        super().__init__()
        self.f, self.a, self.b = f, nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        return self.b(self.f(torch.tanh(self.a(x))))


def _add_row(i, j):
    def f(h):
        h = h.clone()
        h[i] = h[i] + h[j]
        return h

    return f


@pytest.mark.parametrize("f, B, seed", [
    # flows a single replaced example (example 0) never shows: into example 0, between two
    # others, a permutation that fixes example 0, a reversed cumulative sum
    (_add_row(1, 2), 4, 0),
    (_add_row(0, 1), 4, 0),
    (lambda h: h[torch.tensor([0, 2, 1, 3])], 4, 0),
    (lambda h: h.flip(0).cumsum(0).flip(0), 4, 0),
    (lambda h: h.roll(1, 0), 5, 0),
    (lambda h: h.cumsum(0), 6, 0),
    # a batch statistic that replacing example 0 by a copy of example 1 leaves unchanged (here
    # example 0 is never the maximum)
    (lambda h: h - h.amax(0, keepdim=True), 5, 3),
])
def test_flows_between_examples_of_either_parity_or_half_are_refused(f, B, seed):
    torch.manual_seed(0)
    with pytest.raises(ValueError, match=r"the rows of the input of b \(Linear"):
        ClippingEngine(Between(f).double(), clip_norm=1.0).accumulate(
            sq_loss, (_x(B, 4, seed=seed),), {})


class _Flipped(nn.Module):
    def forward(self, h):
        return h.flip(0)


def test_rows_reordered_with_equal_norms_and_sums_are_refused_by_their_projection():
    # rows of a LayerNorm without affine parameters all have norm sqrt(d) and sum 0: reversed,
    # no row's norm moves and neither does its sum; only the projection on a random direction
    # shows the other example's row (refused here, at the layer, not later by the losses)
    torch.manual_seed(0)
    m = nn.Sequential(nn.LayerNorm(16, elementwise_affine=False), _Flipped(),
                      nn.Linear(16, 2)).double()
    with pytest.raises(ValueError, match=r"the rows of the input of 2 \(Linear"):
        ClippingEngine(m, clip_norm=1.0).accumulate(sq_loss, (_x(4, 16),), {})


def test_an_example_is_replaced_by_a_different_one_not_by_its_duplicate():
    # batch [a, a, b, c] and a flow from example 0 into example 2: only the first half's copy
    # (0 and 1 replaced, 2 kept) can show it. Were example 0 replaced by its duplicate
    # (example 1), nothing would flow, yet example 1's replacement reached the layer: the
    # check would count as done and the model would be accepted
    torch.manual_seed(0)
    x = _x(4, 4)
    x[1] = x[0]
    engine = ClippingEngine(Between(_add_row(2, 0)).double(), clip_norm=1.0)
    with pytest.raises(ValueError, match=r"the rows of the input of b \(Linear.*\(0, 1\) by"):
        engine.accumulate(sq_loss, (x,), {})


def test_a_loss_that_counts_labels_over_the_microbatch_is_refused():
    # class-balanced weights from the microbatch's own label counts; y[0] == y[1], so replacing
    # example 0 alone by a copy of example 1 would leave every count as it was
    m = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 3)).double()

    def balanced(model, batch):
        x, y = batch
        counts = torch.bincount(y, minlength=3).to(x.dtype)
        return F.cross_entropy(model(x), y, reduction="none") / counts[y]

    with pytest.raises(ValueError, match="loss_fn's per-example losses are not one example"):
        ClippingEngine(m, clip_norm=1.0).accumulate(
            balanced, (_x(4, 4), torch.tensor([1, 1, 0, 2])), {})


def test_a_view_that_mixes_examples_is_refused():
    # the check replaces examples of the batch and applies the plan entry's view to each copy
    mixup = lambda b: (0.7 * b[0] + 0.3 * b[0].flip(0),)  # noqa: E731
    m = Between(lambda h: h).double()
    with pytest.raises(ValueError, match=r"the rows of the input of a \(Linear"):
        ClippingEngine(m, clip_norm=1.0).accumulate(sq_loss, (_x(4, 4),), {},
                                                    plan=[(1.0, None, None, mixup)])


def test_a_microbatch_whose_replacements_reach_no_layer_leaves_the_check_due():
    # equal inputs, labels alone differ: a batch mean of the hidden states cannot show, so the
    # check waits for a microbatch whose inputs differ, and refuses there
    m = BatchCentred().double()

    def labelled(model, batch):
        x, y = batch
        return (model(x) - y).pow(2).sum(1)

    engine = ClippingEngine(m, clip_norm=1.0)
    engine.accumulate(labelled, (_x(1, 4).expand(3, 4).clone(), _x(3, 2, seed=1)), {})
    assert not engine._rows_checked
    with pytest.raises(ValueError, match="rows of the input of b"):
        engine.accumulate(labelled, (_x(3, 4, seed=2), _x(3, 2, seed=4)), {})


def test_after_max_attempts_without_reaching_a_layer_the_check_warns_and_stops():
    from dptrain.clipping.rows import MAX_ATTEMPTS

    calls = []

    def labelled(model, batch):
        calls.append(1)
        x, y = batch
        return (model(x) - y).pow(2).sum(1)

    engine = ClippingEngine(nn.Linear(4, 2).double(), clip_norm=1.0)
    batch = (_x(1, 4).expand(3, 4).clone(), _x(3, 2, seed=1))
    for _ in range(MAX_ATTEMPTS - 1):
        engine.accumulate(labelled, batch, {})
    assert not engine._rows_checked
    with pytest.warns(UserWarning, match=f"in {MAX_ATTEMPTS} microbatches no example"):
        engine.accumulate(labelled, batch, {})
    assert engine._rows_checked
    calls.clear()
    engine.accumulate(labelled, batch, {})
    assert len(calls) == 1  # no more check forwards


def test_batch_centring_breaks_the_per_example_bound_it_is_refused_for():
    # why the refusal matters: with h - h.mean(0), removing one example moves the sum of the
    # others' gradients, so an example's influence exceeds its clipped gradient. The engine
    # (checks off) credits each row's gradient to one example as if rows were independent.
    torch.manual_seed(0)
    m = BatchCentred().double()
    x = _x(6, 4)
    engine = ClippingEngine(m)
    engine._rows_checked = True  # the check off: what the engine computed before it
    norms = engine.per_example_norms(sq_loss, (x,))
    # the true per-example gradients (each example's loss alone, the batch mean as a function of
    # all inputs) are not what the rows give: the engine's norms are wrong for this model
    full = torch.autograd.functional.jacobian(
        lambda *ps: _losses_with(m, ps, x), tuple(m.parameters()))
    true = torch.cat([j.reshape(6, -1) for j in full], 1)
    assert not torch.allclose(norms, true.norm(dim=1), rtol=1e-3)
    with pytest.raises(ValueError, match="not one example each"):
        ClippingEngine(m).per_example_norms(sq_loss, (x,))


def _losses_with(m, params, x):
    names = [n for n, _ in m.named_parameters()]
    return torch.func.functional_call(m, dict(zip(names, params)), (x,)).pow(2).sum(1) * 0.5


def test_a_loss_normalised_over_the_microbatch_is_refused_naming_loss_fn():
    # a common LM loss: summed token NLL over the microbatch's total token count
    m = nn.Sequential(nn.Embedding(7, 4), nn.Linear(4, 7)).double()
    ids = torch.randint(0, 7, (4, 5), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(4, 5)
    mask[1, 3:] = 0
    mask[2, 1:] = 0

    def batch_normalised(model, batch):
        ids, mask = batch
        nll = F.cross_entropy(model(ids).flatten(0, 1), ids.flatten(), reduction="none")
        return (nll.view(ids.shape) * mask).sum(1) / mask.sum()

    def per_example(model, batch):
        ids, mask = batch
        nll = F.cross_entropy(model(ids).flatten(0, 1), ids.flatten(), reduction="none")
        return (nll.view(ids.shape) * mask).sum(1) / mask.sum(1)

    with pytest.raises(ValueError, match=r"loss_fn's per-example losses are not one example "
                                         r"each: replacing 2 of the microbatch's 4 examples "
                                         r"\(0, 2\) by copies of others changed the losses of 2 "
                                         r"of the other 2 examples \(1, 3\)"):
        ClippingEngine(m, clip_norm=1.0).accumulate(batch_normalised, (ids, mask), {})
    ref = reference_grads(m, per_example, (ids, mask)).norm(dim=1)
    torch.testing.assert_close(ClippingEngine(m).per_example_norms(per_example, (ids, mask)),
                               ref, rtol=1e-9, atol=1e-12)


def test_a_refusal_leaves_the_check_due_and_a_fixed_forward_passes():
    m = BatchCentred().double()
    engine = ClippingEngine(m, clip_norm=1.0)
    x = _x(5, 4)
    for _ in range(2):  # caught and called again: refused again, not skipped
        with pytest.raises(ValueError, match="not one example each"):
            engine.accumulate(sq_loss, (x,), {})


def test_nothing_to_compare_leaves_the_check_for_the_next_microbatch():
    # one example, then identical examples: no perturbation possible, so not yet checked
    m = BatchCentred().double()
    engine = ClippingEngine(m, clip_norm=1.0)
    engine.accumulate(sq_loss, (_x(1, 4),), {})
    engine.accumulate(sq_loss, (_x(1, 4).expand(3, 4).clone(),), {})
    assert not engine._rows_checked
    with pytest.raises(ValueError, match="not one example each"):
        engine.accumulate(sq_loss, (_x(3, 4),), {})


def _gpt2(dropout: float):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=61, n_positions=16,
                     resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
                     tie_word_embeddings=True, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel._from_config(cfg, attn_implementation="eager")
    return model.train()


@pytest.mark.parametrize("example_masks", [False, True])
def test_gpt2_with_dropout_passes_and_the_check_changes_nothing(example_masks, recwarn):
    # torch's RNG dropout and dptrain's per-example masks: the check's forwards start from the
    # real forward's randomness, and leave the RNG, the sums and the buffers as they were
    from dptrain.models.dropout import example_dropout

    batch = gpt2_batch()  # 4 examples, right-padded
    results = []
    for checked in (False, True):
        model = _gpt2(0.1)
        engine = ClippingEngine(model, clip_norm=0.5)
        engine._rows_checked = not checked
        acc = {}
        torch.manual_seed(7)
        ctx = (example_dropout(model, 3, 1, torch.arange(4)) if example_masks
               else contextlib.nullcontext())
        with ctx:
            for _ in range(2):
                engine.accumulate(gpt2_loss, batch, acc, plan=[(0.5, None), (0.5, None, 11)])
        assert engine._rows_checked
        results.append((acc, torch.get_rng_state(), torch.rand(3)))
    # checked, not skipped: the check's forwards drew the real forward's dropout masks
    assert not [w for w in recwarn if "could not check" in str(w.message)]
    (a0, s0, r0), (a1, s1, r1) = results
    assert a0.keys() == a1.keys()
    for n in a0:
        assert torch.equal(a0[n], a1[n]), n
    assert torch.equal(s0, s1) and torch.equal(r0, r1)


def test_a_forward_that_changes_a_buffer_gets_it_back():
    class Counting(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 2)
            self.register_buffer("calls", torch.zeros(()))

        def forward(self, x):
            self.calls += 1
            return self.lin(x)

    m = Counting().double()
    ClippingEngine(m, clip_norm=1.0).accumulate(sq_loss, (_x(4, 4),), {})
    assert float(m.calls) == 1  # the real forward's; the check's were undone


class _Stores(nn.Module):
    """A Linear whose forward writes a buffer: ``how`` says what it stores."""

    def __init__(self, how):
        super().__init__()
        self.lin, self.how = nn.Linear(4, 2), how
        self.register_buffer("stat", torch.zeros(4))
        self.register_buffer("tokens", torch.zeros((), dtype=torch.int64))
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        d = x.detach()
        if self.how == "running mean in place":
            self.stat.mul_(0.9).add_(0.1 * d.mean(0))
        elif self.how == "running mean assigned":
            self.stat = 0.9 * self.stat + 0.1 * d.mean(0)
        elif self.how == "token count":  # an integer buffer: how many non-zero inputs
            self.tokens += (d != 0).sum()
        elif self.how == "last batch":  # assigned with another shape
            self.stat = d.clone()
        elif self.how == "calls assigned":  # data-independent, by assignment
            self.calls = self.calls + 1
        elif self.how == "weight norm":  # a cache of the weights: the same in every forward
            self.stat.copy_(self.lin.weight.detach().norm(dim=0))
        return self.lin(x)


class _Jitter(nn.Module):
    """Writes draws of its own generator: not the data, not repeatable (warned about)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.g = torch.Generator().manual_seed(0)
        self.register_buffer("jitter", torch.zeros(3))

    def forward(self, x):
        self.jitter.copy_(torch.randn(3, generator=self.g))
        return self.lin(x)


class _Wrapped(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.inner = _Stores(how)

    def forward(self, x):
        return self.inner(x)


@pytest.mark.parametrize("mb", [6, 1])
@pytest.mark.parametrize("how, buffer", [
    ("running mean in place", "inner.stat"),
    ("running mean assigned", "inner.stat"),
    ("token count", "inner.tokens"),
    ("last batch", "inner.stat"),
])
def test_a_forward_that_stores_the_examples_data_in_a_buffer_is_refused_naming_it(how, buffer,
                                                                                 mb):
    # rows and losses are each example's own here: only the stored value leaks (into every
    # later forward and every checkpoint, with no clip or noise). performance.microbatch_size
    # = 1: nothing to replace within a microbatch, so the second one-example microbatch's
    # forward is compared with the first's; refused as with larger ones, not in silence
    m = _Wrapped(how).double()
    x = _x(6, 4)
    x[1, 0] = 0.0  # so that replacing examples changes the token count
    engine = ClippingEngine(m, clip_norm=1.0)
    if mb == 1:
        engine.accumulate(sq_loss, (x[:1],), {})
        assert not engine._rows_checked and engine._rows_other is not None
    what = "replacing" if mb > 1 else "the forward of another microbatch's example"
    with pytest.raises(ValueError, match=rf"writes the buffer {buffer} of _Stores from the "
                                         rf"examples' data: {what}"):
        engine.accumulate(sq_loss, (x if mb > 1 else x[1:2],), {})


@pytest.mark.parametrize("how, calls", [("calls assigned", 1.0), ("weight norm", 0.0)])
def test_data_independent_buffer_writes_pass_and_are_put_back(how, calls):
    m = _Wrapped(how).double()
    acc: dict = {}
    engine = ClippingEngine(m, clip_norm=1.0)
    engine.accumulate(sq_loss, (_x(6, 4),), acc)
    assert engine._rows_checked
    # the real forward's write stays, the check's five are undone (also when the forward
    # assigned another tensor rather than writing in place)
    assert float(m.inner.calls) == calls
    assert m.inner._buffers["stat"].shape == (4,)
    if how == "weight norm":
        torch.testing.assert_close(m.inner.stat, m.inner.lin.weight.detach().norm(dim=0))


@pytest.mark.parametrize("how", ["calls assigned", "weight norm", "none"])
def test_microbatches_of_one_example_without_stored_data_pass_with_the_same_sums(how):
    torch.manual_seed(0)
    m = _Wrapped(how).double()
    from dptrain.clipping.rows import MAX_ATTEMPTS

    x = _x(MAX_ATTEMPTS, 4)
    engine, acc = ClippingEngine(m, clip_norm=1.0), {}
    engine.accumulate(sq_loss, (x[:1],), acc)
    engine.accumulate(sq_loss, (x[:1].clone(),), acc)  # alike: nothing compared yet
    assert not engine._rows_checked
    # all of one shape: compared at each, done (silently) after MAX_ATTEMPTS, since two
    # shapes would be needed to see a buffer of the length
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for i in range(1, MAX_ATTEMPTS - 1):
            engine.accumulate(sq_loss, (x[i:i + 1],), acc)
            assert engine._rows_checked == (i == MAX_ATTEMPTS - 2)
    assert engine._rows_other is None
    # the check's forwards changed neither the sums nor the buffers' real writes
    torch.manual_seed(0)
    ref, ref_acc = ClippingEngine(_Wrapped(how).double(), clip_norm=1.0), {}
    ref._rows_checked = True  # no check: the sums as they would be without it
    for i in [0, 0, *range(1, MAX_ATTEMPTS - 1)]:
        ref.accumulate(sq_loss, (x[i:i + 1],), ref_acc)
    for name in acc:
        torch.testing.assert_close(acc[name], ref_acc[name], rtol=0, atol=0)
    assert float(m.inner.calls) == float(ref.model.inner.calls)


def test_microbatches_of_one_example_all_alike_warn_after_max_attempts():
    from dptrain.clipping.rows import MAX_ATTEMPTS

    engine = ClippingEngine(_Wrapped("running mean in place").double(), clip_norm=1.0)
    batch = (_x(1, 4),)
    for _ in range(MAX_ATTEMPTS - 1):
        engine.accumulate(sq_loss, batch, {})
    with pytest.warns(UserWarning, match=f"in {MAX_ATTEMPTS} microbatches no example"):
        engine.accumulate(sq_loss, batch, {})
    assert engine._rows_checked and engine._rows_other is None


def test_one_example_microbatches_differing_in_labels_alone_leave_the_check_due():
    # as with larger microbatches: done once the other example reached a layer; labels alone
    # would have closed it before any data-writing forward could be seen
    m = _Wrapped("running mean in place").double()

    def labelled(model, batch):
        x, y = batch
        return (model(x) - y).pow(2).sum(1)

    engine = ClippingEngine(m, clip_norm=1.0)
    x = _x(1, 4)
    engine.accumulate(labelled, (x, _x(1, 2, seed=1)), {})
    engine.accumulate(labelled, (x.clone(), _x(1, 2, seed=2)), {})
    assert not engine._rows_checked
    with pytest.raises(ValueError, match="writes the buffer inner.stat"):
        engine.accumulate(labelled, (_x(1, 4, seed=3), _x(1, 2, seed=4)), {})


class _PositionCache(nn.Module):
    """A table rebuilt for the current sequence length: a function of the microbatch's shape,
    which at one example per microbatch is that example's length (refused there)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 2)
        self.register_buffer("pos", torch.zeros(0, 8, dtype=torch.float64))

    def forward(self, x):  # (B, T, 8)
        T = x.shape[1]
        if self.pos.shape[0] != T:
            self.pos = torch.sin(torch.arange(T, dtype=torch.float64)[:, None]
                                 * torch.arange(8, dtype=torch.float64))
        return self.lin(x + self.pos)


class _TokenCount(nn.Module):
    """Counts the non-zero inputs it has seen: at one example per microbatch, its length."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 2)
        self.register_buffer("seen", torch.zeros((), dtype=torch.int64))

    def forward(self, x):
        self.seen += (x != 0).any(-1).sum()
        return self.lin(x)


@pytest.mark.parametrize("model", [_PositionCache, _TokenCount])
def test_at_one_example_a_buffer_of_the_sequence_length_is_refused(model):
    # the microbatch's length is the example's own: a table cached per length and a token
    # count both store it (a larger microbatch's table stores its longest example's, which
    # its replacements cannot change: rows.py says what is not seen)
    engine = ClippingEngine(model().double(), clip_norm=1.0)
    engine.accumulate(sq_loss, (_x(1, 3, 8),), {})
    # two of one length first (a red team's case: tiny.yaml's first two examples): compared,
    # and nothing told them apart, but the check goes on until two lengths were compared
    engine.accumulate(sq_loss, (_x(1, 3, 8, seed=2),), {})
    assert not engine._rows_checked
    with pytest.raises(ValueError, match="writes the buffer"):
        engine.accumulate(sq_loss, (_x(1, 5, 8, seed=1),), {})


def test_at_one_example_a_buffer_of_the_data_is_refused_though_no_layer_input_changed():
    # prompt tuning's shape: the trainable layer sees constant ids, a frozen one the data,
    # which a buffer stores; refused at size 4 by its replacements, and at size 1 too (it
    # used to go through with a warning that blamed alike inputs)
    class Prompt(nn.Module):
        def __init__(self):
            super().__init__()
            self.prompt = nn.Embedding(1, 4)
            self.frozen = nn.Linear(4, 2).requires_grad_(False)
            self.register_buffer("stat", torch.zeros(4, dtype=torch.float64))

        def forward(self, x):
            self.stat.mul_(0.9).add_(0.1 * x.detach().mean(0))
            ids = torch.zeros(x.shape[0], dtype=torch.int64)
            return self.frozen(x * self.prompt(ids))

    for mb in (4, 1):
        engine = ClippingEngine(Prompt().double(), clip_norm=1.0)
        with pytest.raises(ValueError, match="writes the buffer stat"):
            for i in range(3):
                engine.accumulate(sq_loss, (_x(mb, 4, seed=i),), {})


def test_mixed_microbatch_sizes_one_example_comparisons_do_not_end_a_larger_check():
    # comparisons made at size 1 (of one shape) end the check silently only while the
    # microbatches are of one example: a larger one whose examples are alike still warns
    from dptrain.clipping.rows import MAX_ATTEMPTS

    engine = ClippingEngine(BatchCentred().double(), clip_norm=1.0)
    engine.accumulate(sq_loss, (_x(1, 4),), {})
    engine.accumulate(sq_loss, (_x(1, 4, seed=1),), {})
    alike = (_x(1, 4, seed=2).expand(2, 4).clone(),)
    for _ in range(MAX_ATTEMPTS - 3):
        engine.accumulate(sq_loss, alike, {})
    with pytest.warns(UserWarning, match=f"in {MAX_ATTEMPTS} microbatches no example"):
        engine.accumulate(sq_loss, alike, {})


def test_at_one_example_a_nondeterministic_buffer_write_is_warned_about_once():
    engine = ClippingEngine(_Jitter().double(), clip_norm=1.0)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for i in range(6):
            engine.accumulate(sq_loss, (_x(1, 4, seed=i),), {})
    assert sum("gave different values" in str(w.message) for w in seen) == 1
    assert engine._rows_checked


def test_a_buffer_cached_per_sequence_length_passes_in_larger_microbatches():
    engine = ClippingEngine(_PositionCache().double(), clip_norm=1.0)
    engine.accumulate(sq_loss, (_x(2, 3, 8),), {})
    assert engine._rows_checked


def test_the_kept_one_example_microbatches_go_with_release_workspace():
    engine = ClippingEngine(_Wrapped("none").double(), clip_norm=1.0)
    engine.accumulate(sq_loss, (_x(1, 4),), {})
    assert engine._rows_other is not None  # a private example, until the check is done ...
    engine.release_workspace()  # ... or the run ends (Trainer.run's finally)
    assert engine._rows_other is None


@pytest.mark.parametrize("case", ["rows", "one example", "alike"])
def test_secure_mode_says_nothing_of_a_check_it_could_not_make(case):
    # whether, and at which query, the check gives up depends on the examples: in secure mode
    # (the trainer sets warn_at_queries False) that warning was an output outside the guarantee
    from dptrain.clipping.rows import MAX_ATTEMPTS

    model = BatchCentred() if case == "alike" else _Jitter()
    batches = {"rows": [(_x(4, 4),)], "one example": [(_x(1, 4, seed=i),) for i in range(6)],
               "alike": [(_x(1, 4, seed=2).expand(2, 4).clone(),)] * MAX_ATTEMPTS}[case]
    for warn in (True, False):
        engine = ClippingEngine(model.double(), clip_norm=1.0)
        engine.warn_at_queries = warn
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for batch in batches:
                engine.accumulate(sq_loss, batch, {})
        said = [w for w in seen if "could not check" in str(w.message)]
        assert len(said) == (1 if warn else 0), [str(w.message) for w in seen]
        assert engine._rows_checked  # given up alike, warned of or not


def test_a_nondeterministic_buffer_write_is_warned_about_not_refused():
    with pytest.warns(UserWarning, match="gave different values"):
        ClippingEngine(_Jitter().double(), clip_norm=1.0).accumulate(sq_loss, (_x(4, 4),), {})


@pytest.mark.parametrize("mb", [1, 4])
def test_a_buffer_of_the_data_is_refused_though_the_outputs_are_not_deterministic(mb):
    # the buffer's writes repeat for the same microbatch and differ between examples: the data,
    # whatever noise the outputs carry (that noise once made it "uncheckable", and accepted)
    class Noisy(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 2)
            self.g = torch.Generator().manual_seed(0)
            self.register_buffer("stat", torch.zeros(4, dtype=torch.float64))

        def forward(self, x):
            self.stat.copy_(x.detach().mean(0))
            return self.lin(x) + 1e-3 * torch.randn(2, generator=self.g, dtype=x.dtype)

    engine = ClippingEngine(Noisy().double(), clip_norm=1.0)
    with pytest.raises(ValueError, match="writes the buffer stat"):
        for i in range(4):
            engine.accumulate(sq_loss, (_x(mb, 4, seed=i),), {})


def test_a_nondeterministic_forward_is_warned_about_not_refused():
    class Noisy(nn.Module):  # randomness outside torch's RNG: not reproducible by the check
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 2)
            self.g = torch.Generator().manual_seed(0)

        def forward(self, x):
            return self.lin(x + torch.randn(x.shape, generator=self.g, dtype=x.dtype))

    engine = ClippingEngine(Noisy().double(), clip_norm=1.0)
    with pytest.warns(UserWarning, match="gave different values"):
        engine.accumulate(sq_loss, (_x(4, 4),), {})
    assert engine._rows_checked  # warned once, not at every microbatch


def test_layer_calls_that_depend_on_the_data_are_warned_about():
    class Trimmed(nn.Module):  # drops the positions no example uses: shapes follow the data
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(1, 2)

        def forward(self, x):  # x: (B, T), zeros are padding
            used = int((x != 0).any(0).nonzero().max()) + 1
            return self.lin(x[:, :used, None])

    # example 0 alone reaches position 3: replacing it by example 1 drops that position
    x = torch.tensor([[1.0, 2.0, 6.0], [3.0, 0.0, 0.0]], dtype=torch.float64)
    with pytest.warns(UserWarning, match="change when some examples change"):
        ClippingEngine(Trimmed().double(), clip_norm=1.0).accumulate(sq_loss, (x,), {})


@pytest.mark.parametrize("weight, refused", [(1e-9, False), (1e-4, True)])
def test_mixing_above_the_tolerance_is_refused_and_rounding_level_is_not(weight, refused):
    # rows that move by rounding only (another summation order) are not mixing: a batch sum
    # added at 1e-9 is accepted; at 1e-4, ten times the tolerance, it is refused
    class Leaky(nn.Module):
        def __init__(self, w):
            super().__init__()
            self.w = w
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

        def forward(self, x):
            h = self.a(x)
            return self.b(h + self.w * h.sum(0, keepdim=True))

    assert REL_TOL == 1e-5
    torch.manual_seed(0)
    engine = ClippingEngine(Leaky(weight).double(), clip_norm=1.0)
    check = pytest.raises(ValueError, match="rows of the input of b") if refused else (
        contextlib.nullcontext())
    with check:
        engine.accumulate(sq_loss, (_x(5, 4),), {})
    assert engine._rows_checked != refused


def test_a_loss_fn_that_edits_the_batch_in_place_is_checked_on_copies():
    # labels masked in place inside loss_fn (idempotent here): the check's forwards run on
    # copies, so the caller's batch is edited once, by the real forward only
    edits = []

    def masking(model, batch):
        x, y = batch
        edits.append(1)
        y.mul_(2.0)
        return (model(x) - y).pow(2).sum(1)

    m = nn.Linear(4, 2).double()
    y = _x(5, 2, seed=1)
    before = y.clone()
    ClippingEngine(m, clip_norm=1.0).accumulate(masking, (_x(5, 4), y), {})
    assert len(edits) == 6  # the real forward and the check's five (one process, no mixing)
    torch.testing.assert_close(y, 2 * before, rtol=0, atol=0)


class _Blocks(nn.Module):
    """Two FSDP units (``layers.N``) and a root-owned head; ``centre``: h - h.mean(0)."""

    def __init__(self, centre: bool):
        super().__init__()
        self.centre = centre
        self.layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        if self.centre:
            x = x - x.mean(0, keepdim=True)
        return self.head(x)


def _sharded_queries(rank: int, world: int, centre: bool, sizes: tuple) -> dict:
    from dptrain.parallel.fsdp import apply_fsdp

    x = _x(sizes[rank], 4, seed=rank)
    out = {}
    for checked in (True, False):
        torch.manual_seed(0)
        model = apply_fsdp(_Blocks(centre).double())
        engine = ClippingEngine(model, clip_norm=0.5)
        engine._rows_checked = not checked
        sums = []
        try:
            for _ in range(2):
                acc: dict = {}
                engine.accumulate(sq_loss, (x,), acc)
                sums.append(acc)
                with torch.no_grad():  # a step: new values written into the shards
                    for p in model.parameters():
                        p.to_local().mul_(1.5)
        except ValueError as e:
            return {"error": str(e)}
        out[checked] = sums
        out["done"] = engine._rows_checked
    return out


def _one_sharded_query(rank: int, world: int, sizes: tuple) -> str:
    from dptrain.parallel.fsdp import apply_fsdp

    torch.manual_seed(0)
    model = apply_fsdp(_Blocks(True).double())
    try:
        ClippingEngine(model, clip_norm=0.5).accumulate(sq_loss, (_x(sizes[rank], 4),), {})
    except ValueError as e:
        return str(e)
    return "accepted"


def test_under_fsdp_every_rank_runs_the_check_and_the_sums_are_unchanged():
    from dptrain.parallel.dist import spawn

    # rank 0 has a microbatch to compare, rank 1 a single example (nothing to compare): both
    # run the check's forwards, whose gathers must pair up; after them the parameters must be
    # resharded, or the next query would use the root's gathered copies from before the step
    for r in spawn(_sharded_queries, 2, False, (3, 1)):
        assert r["done"]
        for with_check, without in zip(r[True], r[False]):
            assert with_check.keys() == without.keys()
            for n in with_check:
                assert torch.equal(with_check[n], without[n]), n
    for r in spawn(_sharded_queries, 2, True, (3, 2)):
        assert "rows of the input of head" in r["error"]
    # rows moved on rank 0 only: rank 1 (one example) runs the extra forward of the
    # microbatch with it (unpaired, rank 0's gathers would wait for ever), and refuses too (it
    # used to go on, to wait at its next collective for the rank that had stopped)
    r0, r1 = spawn(_one_sharded_query, 2, (3, 1), timeout=120)
    assert "rows of the input of head" in r0 and "another rank" in r1


def test_row_fingerprints_in_blocks_equal_the_whole_at_once(monkeypatch):
    # a large activation is converted to float64 a block of rows at a time: same fingerprints
    from dptrain.clipping import rows

    x = torch.randn(7, 3, 5, generator=torch.Generator().manual_seed(2))
    whole = rows._Signatures([], 7, {})
    whole.sign("x", x)
    monkeypatch.setattr(rows, "BLOCK", 15 * 2)  # two rows of 15 elements per block
    blocks = rows._Signatures([], 7, {})
    blocks.sign("x", x)
    flat = x.reshape(7, -1).double()
    (_, _, n1, p1), (_, _, n2, p2) = whole.rows[0], blocks.rows[0]
    torch.testing.assert_close(n1, flat.norm(dim=1), rtol=1e-15, atol=0)
    torch.testing.assert_close(n2, n1, rtol=0, atol=0)
    torch.testing.assert_close(p2, p1, rtol=1e-15, atol=1e-15)


def test_a_shared_tensor_of_b_rows_in_the_batch_is_refused_with_the_way_out():
    # class weights of 3 classes in a microbatch of 3 look like one row per example: the
    # refusal says so (and the same loss with the weights outside the batch passes)
    m = nn.Linear(4, 3).double()
    w = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    y = torch.tensor([0, 0, 1])

    def weighted(model, batch):
        return F.cross_entropy(model(batch[0]), batch[1], weight=batch[2], reduction="none")

    with pytest.raises(ValueError, match="such as class weights: pass it to the loss another"):
        ClippingEngine(m, clip_norm=1.0).accumulate(weighted, (_x(3, 4), y, w), {})
    ClippingEngine(m, clip_norm=1.0).accumulate(
        lambda model, b: weighted(model, (*b, w)), (_x(3, 4), y), {})
