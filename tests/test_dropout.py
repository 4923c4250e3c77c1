"""Per-example counter-based dropout masks (dptrain/models/dropout.py): the hash equals the
integer SplitMix64, the drop rate is p, an example's mask does not depend on its microbatch, and
a run with dropout is the same with any microbatch size."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dptrain.models.dropout import ExampleDropout, example_dropout, has_dropout, mix64
from dptrain.privacy.sampling import _mix64_int

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"


def test_torch_mix64_equals_the_integer_splitmix64():
    rng = random.Random(0)
    words = [rng.getrandbits(64) for _ in range(2000)] + [0, 1, (1 << 63), (1 << 64) - 1]
    signed = torch.tensor([w - (1 << 64) if w >= 1 << 63 else w for w in words],
                          dtype=torch.int64)
    got = [int(v) & ((1 << 64) - 1) for v in mix64(signed)]
    assert got == [_mix64_int(w) for w in words]


def test_mask_rate_scale_and_independence_of_the_microbatch():
    x = torch.ones(3, 50_000)
    with ExampleDropout(seed=1, step=7, indices=[11, 4, 250]):
        y = F.dropout(x, 0.3, training=True)
    kept = y != 0
    assert abs(float(kept.float().mean()) - 0.7) < 0.01
    assert torch.allclose(y[kept], torch.full_like(y[kept], 1 / 0.7))
    # example 4 alone, or with others in another order: the same mask
    with ExampleDropout(seed=1, step=7, indices=[4]):
        alone = F.dropout(torch.ones(1, 50_000), 0.3, training=True)
    with ExampleDropout(seed=1, step=7, indices=[250, 99, 4]):
        other = F.dropout(torch.ones(3, 50_000), 0.3, training=True)
    assert torch.equal(alone[0], y[1]) and torch.equal(other[2], y[1]) and torch.equal(other[0], y[2])
    # another step, another stream, another call, another seed: other masks
    for kw, stream, calls in (({"seed": 1, "step": 8}, 0, 0), ({"seed": 1, "step": 7}, 1, 0),
                              ({"seed": 2, "step": 7}, 0, 0), ({"seed": 1, "step": 7}, 0, 1)):
        mode = ExampleDropout(indices=[4], **kw)
        with mode:
            mode.set_stream(stream)
            for _ in range(calls):
                F.dropout(torch.ones(1, 8), 0.3, training=True)
            z = F.dropout(torch.ones(1, 50_000), 0.3, training=True)
        assert not torch.equal(z[0], y[1])
    # not training, or p = 0: untouched; nn.Dropout goes through the same path
    with ExampleDropout(seed=1, step=7, indices=[4]):
        assert torch.equal(F.dropout(torch.ones(1, 5), 0.3, training=False), torch.ones(1, 5))
        m = torch.nn.Dropout(0.3)
        assert torch.equal(m(torch.ones(1, 50_000)), alone)


def test_example_dropout_is_inert_without_dropout_layers():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Dropout(0.0))
    with example_dropout(model, 0, 0, [1, 2]) as mode:
        assert mode is None


def test_a_run_with_dropout_does_not_depend_on_the_microbatch_size():
    from dptrain.config import load
    from dptrain.trainer import RunConfig, Trainer

    def params(mb: int, dropout: float = 0.2) -> dict:
        t = Trainer(load(RunConfig, TINY, ["train.progress=false", "train.checkpoint_every=0",
                                           "privacy.accountant=rdp", "privacy.steps=2",
                                           f"model.dropout={dropout}",
                                           "optim.inner_momentum.k_muon=1",
                                           "optim.inner_momentum.gamma_muon=0.5",
                                           f"performance.microbatch_size={mb}"]))
        while t.step < t.plan.steps:
            t.private_step()
        return {n: p.detach().clone() for n, p in t.model.named_parameters()}

    a, b = params(16), params(5)
    for n in a:
        assert torch.allclose(a[n], b[n], rtol=1e-5, atol=1e-7), n
    # and dropout is really on: without it the run differs
    c = params(16, dropout=0.0)
    assert not all(torch.allclose(c[n], a[n], rtol=1e-3) for n in a)


def test_stochastic_depth_masks_are_per_example_and_counter_based():
    """timm's drop_path draws its (B, 1, 1, 1) keep mask with Tensor.bernoulli_: within the
    mode it comes from the per-example hash (rate p), so an example's mask does not depend on
    its microbatch, and another step or stream gives other masks. Other bernoulli_ calls keep
    torch's RNG."""
    import timm

    import dptrain.models.nf_tiny  # noqa: F401  (registers nf_resnet_tiny)

    with ExampleDropout(seed=3, step=5, indices=list(range(40_000))):
        keep = torch.empty(40_000, 1, 1, 1).bernoulli_(0.7)
        torch.manual_seed(0)
        dense = torch.empty(4, 6).bernoulli_(0.5)  # not a per-example scalar mask
    assert set(keep.unique().tolist()) == {0.0, 1.0}
    assert abs(float(keep.mean()) - 0.7) < 0.01
    torch.manual_seed(0)
    assert torch.equal(dense, torch.empty(4, 6).bernoulli_(0.5))

    torch.manual_seed(0)
    model = timm.create_model("nf_resnet_tiny", num_classes=5, drop_path_rate=0.5).train()
    with torch.no_grad():  # zero-initialised residual gains would hide every drop
        for n, p in model.named_parameters():
            if n.endswith("gain"):
                p.fill_(1.0)
    assert has_dropout(model)
    x = torch.randn(4, 3, 16, 16)

    def run(step, indices, rows, stream=0):
        mode = ExampleDropout(seed=1, step=step, indices=indices)
        with mode, torch.no_grad():
            mode.set_stream(stream)
            return model(x[rows])

    a = run(3, [5, 6, 7, 8], [0, 1, 2, 3])
    assert torch.allclose(run(3, [7], [2])[0], a[2], atol=1e-6)
    assert torch.allclose(run(3, [8, 5], [3, 0]), a[[3, 0]], atol=1e-6)
    assert not torch.allclose(run(4, [5, 6, 7, 8], [0, 1, 2, 3]), a, atol=1e-3)
    assert not torch.allclose(run(3, [5, 6, 7, 8], [0, 1, 2, 3], stream=1), a, atol=1e-3)


def test_drop_path_rate_config():
    import pytest

    from dptrain.config import ConfigError, from_dict, validate_tree
    from dptrain.models import ModelConfig

    for bad in ({"name": "timm", "drop_path_rate": 1.0}, {"name": "cnn", "drop_path_rate": 0.1}):
        with pytest.raises(ConfigError) as e:
            validate_tree(from_dict(ModelConfig, bad, "model"), "model")
        assert e.value.field == "model.drop_path_rate"


def test_per_example_norms_with_stochastic_depth_equal_one_example_at_a_time():
    """The clipping engine's norms under the per-example drop_path masks equal each example's
    gradient norm computed alone with the same mask (its dataset index)."""
    import timm

    import dptrain.models.nf_tiny  # noqa: F401
    from dptrain.clipping import per_example_grad_norms

    torch.manual_seed(0)
    model = timm.create_model("nf_resnet_tiny", num_classes=5, drop_path_rate=0.5).train()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("gain"):
                p.fill_(1.0)
    x, y = torch.randn(4, 3, 16, 16), torch.tensor([0, 1, 2, 3])
    indices = [10, 11, 12, 13]

    def loss_fn(m, batch):
        return F.cross_entropy(m(batch[0]), batch[1], reduction="none")

    with ExampleDropout(seed=2, step=1, indices=indices):
        norms = per_example_grad_norms(model, loss_fn, (x, y))
    ref = []
    for i in range(4):
        model.zero_grad()
        with ExampleDropout(seed=2, step=1, indices=[indices[i]]):
            loss_fn(model, (x[i:i + 1], y[i:i + 1])).sum().backward()
        ref.append(torch.cat([p.grad.flatten() for p in model.parameters()]).norm())
    assert torch.allclose(norms, torch.stack(ref), rtol=1e-4)
    # the masks matter: without them (another step) the norms differ
    with ExampleDropout(seed=2, step=2, indices=indices):
        assert not torch.allclose(per_example_grad_norms(model, loss_fn, (x, y)), norms,
                                  rtol=1e-3)


def test_each_entry_of_a_query_plan_draws_its_own_streams_masks():
    """Entry j of a plan (inner momentum's or DiSK's states, augmult's views) is evaluated with
    dropout stream j: its norms equal those of each example alone, state j's gradient under
    stream j's masks. Every entry on stream 0 would give the past states the current state's
    masks (wrong norms; the module docstring's hash promises otherwise)."""
    import copy

    from dptrain.clipping import ClippingEngine
    from dptrain.models.dropout import example_dropout

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Dropout(0.5),
                                torch.nn.Linear(16, 2)).double()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 4, generator=gen, dtype=torch.float64)
    y = torch.randn(3, 2, generator=gen, dtype=torch.float64)
    theta1 = {n: p.detach() + 0.3 * torch.randn(p.shape, generator=gen, dtype=p.dtype)
              for n, p in model.named_parameters()}
    past = copy.deepcopy(model)
    with torch.no_grad():
        for n, p in past.named_parameters():
            p.copy_(theta1[n])
    indices = [7, 2, 11]

    def loss_fn(m, batch):
        return 0.5 * (m(batch[0]) - batch[1]).pow(2).sum(1)

    def alone(m, i, stream):
        m.zero_grad()
        with example_dropout(m, seed=3, step=5, indices=[indices[i]]) as mode:
            mode.set_stream(stream)
            loss_fn(m, (x[i:i + 1], y[i:i + 1])).sum().backward()
        return torch.cat([p.grad.flatten() for p in m.parameters()])

    def ref_norms(streams):
        return torch.stack([(0.6 * alone(past, i, streams[0]) + 0.4 * alone(model, i, streams[1]))
                            .norm() for i in range(3)])

    engine = ClippingEngine(model, clip_norm=1.0)
    with example_dropout(model, seed=3, step=5, indices=indices):
        norms = engine.per_example_norms(loss_fn, (x, y), [(0.6, theta1), (0.4, None)])
    torch.testing.assert_close(norms, ref_norms((0, 1)), rtol=1e-9, atol=0)
    assert not torch.allclose(ref_norms((0, 0)), ref_norms((0, 1)), rtol=1e-3)  # streams matter


_MASK = (1 << 64) - 1


def _reference_bits(seed, step, stream, call, index, coords):
    """The module docstring's hash, in Python integers: the 24-bit word of one element."""
    from dptrain.privacy.sampling import _GAMMA, _seed_key

    k_step = _mix64_int((_seed_key(seed) + _GAMMA * (step + 1)) & _MASK)
    k_call = _mix64_int((_mix64_int((k_step + _GAMMA * (stream + 1)) & _MASK)
                         + _GAMMA * (call + 1)) & _MASK)
    h = _mix64_int((k_call + _GAMMA * (index + 1)) & _MASK)
    for c in coords:
        h = _mix64_int((h + _GAMMA * (c + 1)) & _MASK)
    return h >> 40


def test_masks_are_the_documented_hash_element_by_element():
    """Every element's keep/drop against the docstring's formula computed with the integer
    SplitMix64: drop <=> bits < ceil(p * 2**24), for each (stream, call), example index and
    coordinate; and at p = bits / 2**24 an element whose bits equal the threshold is kept
    (the comparison's boundary)."""
    seed, step, indices = 5, 3, [9, 0, 4]
    shape = (3, 2, 5)
    p = 0.4
    thr = math.ceil(p * (1 << 24))
    mode = ExampleDropout(seed=seed, step=step, indices=indices)
    with mode:
        got = {}
        for stream in (0, 2):
            mode.set_stream(stream)
            for call in range(2):
                got[stream, call] = F.dropout(torch.ones(shape), p, training=True)
    for (stream, call), y in got.items():
        for b, index in enumerate(indices):
            for i in range(shape[1]):
                for j in range(shape[2]):
                    bits = _reference_bits(seed, step, stream, call, index, (i, j))
                    want = 0.0 if bits < thr else 1 / (1 - p)
                    assert float(y[b, i, j]) == float(torch.tensor(want)), (stream, call, b, i, j)
    # the boundary: choose p so that element (b=0, 0, 0) of stream 0, call 0 sits on it
    bits = _reference_bits(seed, step, 0, 0, indices[0], (0, 0))
    p_edge = bits / (1 << 24)  # exact: ceil(p_edge * 2**24) == bits
    with ExampleDropout(seed=seed, step=step, indices=indices):
        y = F.dropout(torch.ones(shape), p_edge, training=True)
    assert float(y[0, 0, 0]) != 0.0  # bits == threshold: not < threshold, so kept
    # stochastic depth's keep mask: the same hash without coordinates, keep <=> bits < thr
    with ExampleDropout(seed=seed, step=step, indices=indices):
        keep = torch.empty(3, 1, 1).bernoulli_(p)
    for b, index in enumerate(indices):
        assert float(keep[b, 0, 0]) == float(_reference_bits(seed, step, 0, 0, index, ()) < thr)


def test_returning_to_a_stream_gives_its_masks_again():
    """set_stream(j) restarts the call counter: evaluating state j again (a second forward of
    the same query, e.g. norms then sums) draws the same masks, whatever ran in between."""
    mode = ExampleDropout(seed=1, step=2, indices=[3, 8])
    with mode:
        mode.set_stream(0)
        first = [F.dropout(torch.ones(2, 1000), 0.5, training=True) for _ in range(2)]
        mode.set_stream(1)
        for _ in range(3):
            F.dropout(torch.ones(2, 1000), 0.5, training=True)
        mode.set_stream(0)
        again = [F.dropout(torch.ones(2, 1000), 0.5, training=True) for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not torch.equal(first[0], first[1])


def test_a_dense_bernoulli_with_the_batch_as_first_dimension_keeps_torchs_rng():
    # only a per-example scalar mask (B, 1, ..., 1) is replaced; (B, 6) is not one
    with ExampleDropout(seed=0, step=0, indices=[0, 1, 2, 3]):
        torch.manual_seed(0)
        dense = torch.empty(4, 6).bernoulli_(0.5)
    torch.manual_seed(0)
    assert torch.equal(dense, torch.empty(4, 6).bernoulli_(0.5))


def test_dropout_with_p_1_drops_everything():
    with ExampleDropout(seed=0, step=0, indices=[0, 1]):
        y = F.dropout(torch.ones(2, 7), 1.0, training=True)
        z = torch.ones(2, 7)
        F.dropout(z, 1.0, training=True, inplace=True)
    assert torch.equal(y, torch.zeros(2, 7)) and torch.equal(z, torch.zeros(2, 7))


def test_the_threshold_rounds_p_up_to_the_next_24_bit_step():
    """drop <=> bits < ceil(p * 2**24): at p = (bits + 0.5) / 2**24 an element with those bits
    is dropped (the threshold is bits + 1); rounding down would keep it. The same threshold for
    stochastic depth's keep mask (keep <=> bits < threshold)."""
    seed, step, indices = 5, 3, [9, 0, 4]
    bits = _reference_bits(seed, step, 0, 0, indices[1], (0, 0))
    p = (bits + 0.5) / (1 << 24)
    assert math.ceil(p * (1 << 24)) == bits + 1 and int(p * (1 << 24)) == bits
    with ExampleDropout(seed=seed, step=step, indices=indices):
        y = F.dropout(torch.ones(3, 2, 5), p, training=True)
    assert float(y[1, 0, 0]) == 0.0
    keep_bits = _reference_bits(seed, step, 0, 0, indices[2], ())
    p_keep = (keep_bits + 0.5) / (1 << 24)
    with ExampleDropout(seed=seed, step=step, indices=indices):
        keep = torch.empty(3, 1).bernoulli_(p_keep)
    assert float(keep[2, 0]) == 1.0  # keep_bits < keep_bits + 1


def test_a_dropout_input_that_is_not_batch_first_keeps_torchs_rng_and_warns_once():
    """A (5, 8) input with a microbatch of 2 is not batch-first: its mask is torch's own
    (the same as F.dropout outside the mode from the same RNG state), with one warning for
    the mode however many such calls it sees."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ExampleDropout(seed=0, step=0, indices=[3, 8]):
            torch.manual_seed(0)
            got = [F.dropout(torch.ones(5, 8), 0.5, training=True) for _ in range(2)]
    torch.manual_seed(0)
    want = [F.dropout(torch.ones(5, 8), 0.5, training=True) for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    mine = [w for w in caught if "not batch-first" in str(w.message)]
    assert len(mine) == 1, [str(w.message) for w in caught]


@pytest.mark.parametrize("layer", [torch.nn.Dropout2d(0.5), torch.nn.AlphaDropout(0.2)],
                         ids=["dropout2d", "alpha_dropout"])
def test_a_channel_or_alpha_dropout_keeps_torchs_rng_and_says_so_once(layer):
    # only F.dropout is replaced: these layers' masks silently depended on rank and microbatch
    import warnings

    x = torch.ones(2, 3, 4, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ExampleDropout(seed=0, step=0, indices=[3, 8]):
            torch.manual_seed(0)
            got = [layer.train()(x) for _ in range(2)]
            layer.eval()(x)
    torch.manual_seed(0)
    want = [layer.train()(x) for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(got, want))  # torch's own masks
    mine = [str(w.message) for w in caught if "torch's RNG" in str(w.message)]
    name = "dropout2d" if isinstance(layer, torch.nn.Dropout2d) else "alpha_dropout"
    assert mine == [f"dptrain: {name} (p = {layer.p:g}) draws its mask from torch's RNG: only "
                    f"F.dropout and stochastic depth get the per-example masks, so this "
                    f"layer's depend on the rank and the microbatch"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ExampleDropout(seed=0, step=0, indices=[3, 8]):
            layer.eval()(x)
            torch.nn.Dropout2d(0.0).train()(x)
    assert not caught  # (no mask drawn: nothing to say)


@pytest.mark.parametrize("p", [-0.1, 1.5])
def test_a_dropout_probability_out_of_range_is_refused_as_torch_refuses_it(p):
    with pytest.raises(ValueError, match="between 0 and 1") as outside:
        F.dropout(torch.ones(2, 3), p, training=True)
    with ExampleDropout(seed=0, step=0, indices=[3, 8]):
        with pytest.raises(ValueError) as inside:
            F.dropout(torch.ones(2, 3), p, training=True)
    assert str(inside.value) == str(outside.value)


def test_inplace_dropout_writes_the_per_example_mask_into_its_input():
    """F.dropout(x, inplace=True), as nn.Dropout(inplace=True) calls it: x itself is scaled by
    the same per-example mask the out-of-place call gives, and returned, as torch does."""
    with ExampleDropout(seed=1, step=2, indices=[3, 8]):
        want = F.dropout(torch.ones(2, 1000), 0.5, training=True)
    x = torch.ones(2, 1000)
    with ExampleDropout(seed=1, step=2, indices=[3, 8]):
        out = torch.nn.Dropout(0.5, inplace=True)(x)
    assert torch.equal(x, want) and out.data_ptr() == x.data_ptr()
    assert (want == 0).any() and (want != 0).any()


def test_a_bernoulli_with_its_own_generator_keeps_that_generator():
    """Only the process RNG's draws are replaced: a per-example scalar mask drawn with an
    explicit generator is that generator's."""
    with ExampleDropout(seed=0, step=0, indices=list(range(64))):
        got = torch.empty(64, 1, 1, 1).bernoulli_(0.5, generator=torch.Generator().manual_seed(7))
    want = torch.empty(64, 1, 1, 1).bernoulli_(0.5, generator=torch.Generator().manual_seed(7))
    assert torch.equal(got, want)
    with ExampleDropout(seed=0, step=0, indices=list(range(64))):
        hashed = torch.empty(64, 1, 1, 1).bernoulli_(0.5)
    assert not torch.equal(hashed, want)  # without the generator: the hash (the check can fail)


def test_a_gpt2_without_dropout_has_none_and_its_head_dropouts_are_not_counted():
    """GPT-2's config carries summary_first_dropout = 0.1 for a classification head a causal
    LM never runs: it is not one of the model's dropouts, so with dropout 0 the mode is not
    entered (it would intercept every torch call of every forward)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from dptrain.models.dropout import config_dropout_keys

    config = GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=11, n_positions=8,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    assert config.summary_first_dropout > 0
    assert config_dropout_keys(config) == ["attn_pdrop", "embd_pdrop", "resid_pdrop"]
    model = GPT2LMHeadModel(config)
    assert not has_dropout(model)
    with example_dropout(model, 0, 0, [1, 2]) as mode:
        assert mode is None


def test_set_stream_reaches_the_innermost_active_mode_and_the_outer_one_after_it_exits():
    """dptrain.models.dropout.set_stream (what the clipping engine calls per plan entry) goes to
    the mode entered last; once that one has exited, to the one around it."""
    from dptrain.models.dropout import set_stream

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.5))
    with example_dropout(model, 1, 2, [3, 8]) as outer:
        with example_dropout(model, 1, 2, [3, 8]) as inner:
            set_stream(2)
            assert (inner.stream, outer.stream) == (2, 0)
        set_stream(1)
        assert (inner.stream, outer.stream) == (2, 1)
        y = F.dropout(torch.ones(2, 1000), 0.5, training=True)
    mode = ExampleDropout(seed=1, step=2, indices=[3, 8])
    with mode:
        mode.set_stream(1)
        assert torch.equal(y, F.dropout(torch.ones(2, 1000), 0.5, training=True))
    set_stream(3)  # no active mode: nothing to tell
    assert outer.stream == 1
