"""performance.ghost=memory: per parameter the norm form that holds fewer bytes until the clip
factors are known (``choose_form_memory``). A performance setting: the same norms and clipped
sums as the other forms (tests/test_inner_momentum.py and tests/test_clipping_rules.py run it
against their references); here, that it picks what it says and holds less than ``auto``."""

from __future__ import annotations

import pytest
import torch

from dptrain.clipping import ClippingEngine
from dptrain.clipping.contributions import (
    Dense,
    OneHot,
    Outer,
    choose_form,
    choose_form_memory,
    choose_form_states,
    state_bytes,
)


def test_picks_the_form_holding_fewer_bytes():
    B, T, d = 2, 4, 64
    c = Outer(torch.randn(B, T, d), torch.randn(B, T, d))
    buffer = B * d * d * 4  # 32 KiB
    per_state = B * T * (d + d) * 4  # 4 KiB
    gram = 2 * B * T * T * 4
    assert c.ghost_bytes() == per_state
    for n in (1, 2, 7):  # n x 4 KiB + the Grams < 32 KiB
        assert n * per_state + gram < buffer
        assert choose_form_memory([c], n) == "ghost"
        assert choose_form_states([c], n, "memory") == "ghost"
    assert 8 * per_state + gram > buffer
    assert choose_form_memory([c], 8) == "instantiate"
    # a one-hot factor counts as its ids; dense rows are the buffer's in either form
    e = Outer(OneHot(torch.zeros(B, T, dtype=torch.int64), 50), torch.randn(B, T, d))
    assert e.ghost_bytes() == B * T * 8 + B * T * d * 4
    assert choose_form_memory([c, Dense(torch.randn(B, d, d))], 2) == "ghost"


def test_convolution_counts_its_unfolded_input():
    from dptrain.clipping.rules_conv import ConvOuter, _Geom

    B, C, O, H = 2, 3, 4, 6
    x, G = torch.randn(B, C, H, H), torch.randn(B, O, H, H)
    c = ConvOuter(G, x, (O, C, 3, 3), _Geom((3, 3), (1, 1), (1, 1), (1, 1), 1))
    assert c._R is None
    assert c.ghost_bytes() == (G.numel() + x.numel() + B * H * H * C * 9) * 4
    assert c._R is None  # sized without building it


def test_the_flops_cost_model_picks_ghost_for_short_wide_and_instantiate_for_long_narrow():
    # choose_form (auto, one state): ghost costs T^2 (out + in), instantiation T out in; a
    # comparison turned around is as exact but takes the slower form for every layer
    short_wide = Outer(torch.randn(2, 4, 512), torch.randn(2, 4, 512))  # 16 K vs 1 M
    long_narrow = Outer(torch.randn(2, 512, 8), torch.randn(2, 512, 8))  # 4 M vs 32 K
    assert choose_form([short_wide]) == "ghost"
    assert choose_form([long_narrow]) == "instantiate"
    # the policies other than auto decide alone
    assert choose_form([long_narrow], "ghost") == "ghost"
    assert choose_form([short_wide], "instantiate") == "instantiate"


def _gpt2(width: int, T: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(
        n_layer=1, n_embd=width, n_head=2, vocab_size=64, n_positions=T,
        attn_implementation="eager", resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)).double()
    ids = torch.randint(0, 64, (2, T), generator=torch.Generator().manual_seed(1))

    def loss(m, batch):
        lp = torch.log_softmax(m(input_ids=batch["input_ids"]).logits[:, :-1], -1)
        return -lp.gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1).mean(-1)

    return model, {"input_ids": ids}, loss


def _forms(engine, loss, batch, plan):
    query = engine._query(plan)
    engine._forward_backward(loss, batch, plan, False, query)
    engine.release_workspace()
    return query.forms


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_at_two_states_it_keeps_factors_where_auto_instantiates_and_sums_the_same():
    """GPT-2 width 128, T = 28, two states: the time model instantiates the attention's
    matrices (T is long for ghost products), while two states' factors (2 x 28 x (in + out)
    per example) are smaller than their buffers (in x out): ``memory`` keeps the factors, holds
    less, and gives the same norms and clipped sums."""
    from _bench import load_bench

    LiveTensorPeak = load_bench("common").LiveTensorPeak

    model, batch, loss = _gpt2(128, 28)
    past = {n: p.detach() + 0.05 * torch.randn_like(p) for n, p in model.named_parameters()}
    plan = [(0.6, None), (0.4, past, 7)]
    auto = _forms(ClippingEngine(model, ghost="auto"), loss, batch, plan)
    mem = _forms(ClippingEngine(model, ghost="memory"), loss, batch, plan)
    attn = ["transformer.h.0.attn.c_attn.weight", "transformer.h.0.attn.c_proj.weight"]
    assert all(auto[n] == "instantiate" for n in attn), auto
    assert all(mem[n] == "ghost" for n in attn), mem

    C = 0.5
    sums, peaks = {}, {}
    for policy in ("auto", "memory"):
        engine = ClippingEngine(model, clip_norm=C, ghost=policy)
        acc: dict = {}
        with LiveTensorPeak() as tracker:
            engine.accumulate(loss, batch, acc, plan)
        sums[policy], peaks[policy] = acc, tracker.peak_bytes
        norms = engine.per_example_norms(loss, batch, plan)
        assert bool((norms > C).any())  # the clip is active
    for n in sums["auto"]:
        torch.testing.assert_close(sums["memory"][n], sums["auto"][n], rtol=1e-10, atol=1e-13)
    assert peaks["memory"] < peaks["auto"], peaks


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_the_query_reports_what_its_forms_hold():
    """StepStats' sizes (the trainer's memory report): the smallest-form total does not depend
    on the policy and equals the per-parameter minimum of B x size and the states' factors
    (``Outer.ghost_bytes``); ``memory`` holds exactly that, ``auto`` more here."""
    model, batch, loss = _gpt2(128, 28)
    past = {n: p.detach() + 0.05 * torch.randn_like(p) for n, p in model.named_parameters()}
    plan = [(0.6, None), (0.4, past, 7)]
    engine = ClippingEngine(model, clip_norm=0.5)
    per_state: dict = {}

    class Recorder:
        def add(self, per_param):
            for name, contribs in per_param.items():
                per_state.setdefault(name, state_bytes(contribs)[0])
            per_param.clear()

    engine._forward_backward(loss, batch, plan[:1], False, Recorder())
    B = batch["input_ids"].shape[0]
    least = sum(min(B * p.numel() * 8, 2 * per_state[n])
                for n, p in engine.params.items())
    stats = {}
    for policy in ("auto", "memory"):
        stats[policy] = ClippingEngine(model, clip_norm=0.5, ghost=policy).accumulate(
            loss, batch, {}, plan)
        assert stats[policy].states == 2
        assert stats[policy].least_query_bytes == least
    assert stats["memory"].query_bytes == least
    assert stats["auto"].query_bytes > least
    one = ClippingEngine(model, clip_norm=0.5).accumulate(loss, batch, {})
    assert one.states == 1


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_the_first_forward_check_does_not_raise_the_first_steps_peak():
    """The engine's first forward runs under _FirstForwardCheck, which tracks each hooked
    layer's output and same-shaped results of it: by weak references, closed before the
    backward, so the first accumulate peaks no higher than the next (it kept them through the
    backward: 1.71x here, 1.54x at K = 0 on the IM bench's GPT-2, the peak of a whole run; 1.17x
    here while it held them during the forward only)."""
    from _bench import load_bench

    LiveTensorPeak = load_bench("common").LiveTensorPeak

    model, batch, loss = _gpt2(64, 32)
    engine = ClippingEngine(model, clip_norm=0.5)
    peaks = []
    for _ in range(2):
        acc: dict = {}
        with LiveTensorPeak() as tracker:
            engine.accumulate(loss, batch, acc)
        peaks.append(tracker.peak_bytes)
    assert engine._uses_checked
    assert peaks[0] <= 1.02 * peaks[1], peaks
