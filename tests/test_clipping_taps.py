"""Parameters of a module whose submodules have parameters of their own, refused at
construction until 2026-12-02, now tapped (dptrain/clipping/taps.py): a ViT's class token,
register tokens and position table (timm, transformers), given ``p.expand(B, ...)``; ConvNeXt's
and CaiT's layer scales, NFNet's skipinit gain and any other shape, followed through the
module's torch calls and given B rows where they meet the examples' tensors. Refused: rows that
reach other examples' losses (``p[0]``, ``p.mean(0)``, a (T, B, d) layout), a tensor made from
the parameter alone that escapes the module (returned, kept), a use that cannot broadcast. A
module whose submodules have no trainable parameters (timm's GroupNormAct) takes the torch.func
fallback, as a leaf does.

Every case compares against the torch.func reference (tests/_reference.py) in float64, for
every norm policy and both clipped-sum modes (``check``), or checks a refusal by its message.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from _reference import reference_grads
from test_clipping_rules import check, mse_loss

from dptrain.clipping import ClippingEngine, ClippingError


def ce_loss(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y, reduction="none")


def _images(B: int, size: int = 16, classes: int = 3, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, 3, size, size, generator=g, dtype=torch.float64)
    return x, torch.randint(0, classes, (B,), generator=g)


def _randomise(model: nn.Module) -> nn.Module:
    """Tokens and position tables away from their zero or tiny initialisation."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def _timm_vit(**kw):
    timm = pytest.importorskip("timm")
    kw = {"img_size": 16, "patch_size": 8, "embed_dim": 16, "depth": 1, "num_heads": 2,
          "num_classes": 3, **kw}
    name = kw.pop("name", "vit_tiny_patch16_224")
    return _randomise(timm.create_model(name, pretrained=False, **kw).double().train())


@pytest.mark.parametrize("kind", ["cls_pos", "registers", "distilled"])
def test_timm_vit_tokens_and_positions_are_exact(kind):
    if kind == "cls_pos":
        model = _timm_vit()
    elif kind == "registers":
        model = _timm_vit(reg_tokens=2)
    else:
        model = _timm_vit(name="deit_tiny_distilled_patch16_224")
    engine = ClippingEngine(model)
    tapped = set(engine._tap_names())
    assert {"cls_token", "pos_embed"} <= tapped
    assert ("reg_token" in tapped) == (kind == "registers")
    assert ("dist_token" in tapped) == (kind == "distilled")
    check(model, _images(5), ce_loss)


def test_transformers_vit_embeddings_are_exact():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.ViTConfig(image_size=16, patch_size=8, hidden_size=8, num_hidden_layers=1,
                                 num_attention_heads=2, intermediate_size=16, num_labels=3,
                                 hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                 attn_implementation="sdpa")  # (eager: a float32 softmax)
    model = _randomise(transformers.ViTForImageClassification(cfg).double().train())

    def loss(m, batch):
        x, y = batch
        return F.cross_entropy(m(pixel_values=x).logits, y, reduction="none")

    assert set(ClippingEngine(model)._tap_names()) == {"vit.embeddings.cls_token",
                                                       "vit.embeddings.position_embeddings"}
    check(model, _images(4), loss)


def test_inner_momentum_plan_over_tapped_parameters_is_exact():
    """Two states and per-parameter coefficients (inner momentum's separate histories): the
    tapped leaves are made from the values each state swapped in."""
    model = _timm_vit()
    batch = _images(4)
    g = torch.Generator().manual_seed(2)
    theta1 = {n: p.detach() + 0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype)
              for n, p in model.named_parameters()}
    a0 = {n: (0.6 if n in ("cls_token", "pos_embed") else 0.7) for n in theta1}
    a1 = {n: 1.0 - a for n, a in a0.items()}
    ref0, ref1 = reference_grads(model, ce_loss, batch), reference_grads(model, ce_loss, batch,
                                                                       theta1)
    names = [n for n, _ in model.named_parameters()]
    cols0 = torch.cat([torch.full((p.numel(),), a0[n], dtype=torch.float64)
                       for n, p in model.named_parameters()])
    assert len(names) == len(a0)
    ref = cols0 * ref0 + (1 - cols0) * ref1
    check(model, batch, ce_loss, plan=[(a0, None), (a1, theta1)], ref=ref)


class Tokens(nn.Module):
    """A root that owns a (1, d) token used in ``mode``'s way, next to a Linear."""

    def __init__(self, mode: str = "broadcast", d: int = 4):
        super().__init__()
        self.mode = mode
        self.tok = nn.Parameter(torch.randn(1, d))
        self.lin = nn.Linear(d, 2)

    def forward(self, x):
        t = self.tok
        B = x.shape[0]
        if self.mode == "index":  # the parameter's own row 0 (it has one)
            t = t[0]
        elif self.mode == "mean":
            t = t.mean(0, keepdim=True)
        elif self.mode == "flip":
            t = t.flip(0)
        elif self.mode == "squeeze":
            t = t.squeeze(0)
        elif self.mode == "flat":
            t = t.view(-1)
        elif self.mode == "stats":  # its size and a statistic, read as a whole
            with torch.no_grad():
                s = t.sum() * t.numel() / len(t)
            return self.lin(torch.tanh(x + t)) * s
        elif self.mode == "twice":  # two uses
            return self.lin(x + t) + self.lin(x * t)
        elif self.mode == "queries":  # expanded to the examples, then a layer's input
            return self.lin(t.expand(B, -1)) * x[:, :2]
        elif self.mode == "expanded_index":  # expanded, then example 0's row for all
            t = t.expand(B, -1)[0]
        elif self.mode == "expanded_mean":
            t = t.expand(B, -1).mean(0)
        elif self.mode == "expanded_flip":
            t = t.expand(B, -1).flip(0)
        elif self.mode == "layer_norm":  # as a LayerNorm's weight: cannot take B rows
            return self.lin(F.layer_norm(x, (x.shape[-1],), weight=t.view(-1)))
        return self.lin(torch.tanh(x + t))


def _x(B: int, d: int = 4, seed: int = 0) -> torch.Tensor:
    return torch.randn(B, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _sq(m, batch):
    return 0.5 * m(batch[0]).pow(2).sum(1)


@pytest.mark.parametrize("mode", ["broadcast", "squeeze", "twice", "index", "mean", "flip",
                                  "flat", "stats", "queries"])
def test_a_token_used_by_broadcasting_is_exact(mode):
    # the parameter keeps its own shape and values (reads of its size or of a statistic are the
    # model's): it gets B rows only where it meets the examples, or where it is expanded to them
    # (until the fuzz of 2026-12-02, (1, ...) parameters became p.expand(B, ...) for the whole
    # call, and "stats" got B times the statistic, silently)
    torch.manual_seed(0)
    model = Tokens(mode).double()
    x = _x(5)
    check(model, (x, torch.zeros(5, 2, dtype=torch.float64)), mse_loss)


@pytest.mark.parametrize("mode", ["expanded_index", "expanded_mean", "expanded_flip"])
def test_a_token_whose_rows_reach_other_examples_is_refused(mode):
    # the forward's values are those of the model (the rows are equal): only the gradients
    # show that row b is not example b's; accepted, example 0 (expanded_index) would carry
    # every example's gradient of the token
    torch.manual_seed(0)
    model = Tokens(mode).double()
    engine = ClippingEngine(model, clip_norm=1.0)
    acc: dict = {}
    with pytest.raises(ValueError, match=r"parameter tok, given one row per example .* reach "
                                         r"other examples' losses"):
        engine.accumulate(_sq, (_x(5),), acc)
    assert not acc


def test_a_use_that_cannot_take_b_rows_is_refused_naming_the_parameter():
    model = Tokens("layer_norm").double()
    with pytest.raises(ValueError, match=r"tapped parameters \['tok'\] given one row per "
                                         r"example"):
        ClippingEngine(model).per_example_norms(_sq, (_x(3),))


@pytest.mark.parametrize("B", [2, 3])
def test_a_torch_check_that_raises_on_the_rows_is_wrapped_naming_the_parameters(B, monkeypatch):
    # torch's own checks raise ValueError / AssertionError too: nn.MultiheadAttention with kdim
    # (now refused at construction, let through here) failed with a bare "not enough values to
    # unpack" (B = 2) or "expecting query weights shape of (8, 8)" (B = 3)
    import dptrain.clipping.engine as engine_module

    monkeypatch.setattr(engine_module, "_refuse_unsupported", lambda name, m: None)

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.mha = nn.MultiheadAttention(8, 2, kdim=3, vdim=3, batch_first=True)

        def forward(self, q, kv):
            return self.mha(q, kv, kv, need_weights=False)[0].sum(1)

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    q, kv = torch.randn(B, 4, 8, generator=g), torch.randn(B, 5, 3, generator=g)
    def loss(m, batch):
        return 0.5 * m(*batch).pow(2).sum(1)

    with pytest.raises(ValueError, match=r"the forward failed with the tapped parameters "
                                         r"\['mha.q_proj_weight', 'mha.k_proj_weight', "
                                         r"'mha.v_proj_weight', 'mha.in_proj_bias'\] given one "
                                         r"row per example"):
        ClippingEngine(Attention()).per_example_norms(loss, (q, kv))


def test_the_rows_check_waits_for_a_microbatch_of_two_and_draws_from_no_global_stream():
    torch.manual_seed(0)
    model = Tokens("expanded_index").double()
    engine = ClippingEngine(model)
    engine._rows_checked = True  # (the perturbation check of rows.py is not the subject here)
    engine.per_example_norms(_sq, (_x(1),))  # one example: nothing to keep apart
    assert not engine._taps_checked
    with pytest.raises(ValueError, match="reach other examples"):
        engine.per_example_norms(_sq, (_x(4),))
    model = Tokens("broadcast").double()
    engine = ClippingEngine(model)
    engine._rows_checked = True
    state = torch.get_rng_state()
    engine.per_example_norms(_sq, (_x(4),))
    assert engine._taps_checked
    assert torch.equal(torch.get_rng_state(), state)


def test_the_rows_check_passes_float32_and_bfloat16_autocast():
    torch.manual_seed(0)
    for autocast in (False, True):
        model = _timm_vit().float()
        x, y = _images(6)
        engine = ClippingEngine(model, clip_norm=1.0)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            engine.accumulate(ce_loss, (x.float(), y), {})
        assert engine._taps_checked


def test_the_rows_check_passes_float32_rounding_of_rows_far_below_the_largest():
    """A float32 ViT whose class-token rows span 100x: the two backwards' rounding reached
    1.1e-4 of the small rows, and the check (then at 1e-4 of a row) refused it (a fuzz's
    case). The norms are float64's to float32 accuracy."""
    timm = pytest.importorskip("timm")
    torch.manual_seed(1533)
    model = timm.create_model("vit_tiny_patch16_224", img_size=16, patch_size=4, depth=1,
                              num_classes=3).train()
    g = torch.Generator().manual_seed(1533)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    g = torch.Generator().manual_seed(1533)
    batch = (torch.randn(5, 3, 16, 16, generator=g), torch.randint(0, 3, (5,), generator=g))
    got = ClippingEngine(model, clip_norm=1.0).per_example_norms(ce_loss, batch)
    want = reference_grads(model.double(), ce_loss, (batch[0].double(), batch[1])).norm(dim=1)
    assert float(want.max() / want.min()) > 50
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=0)


def test_a_tapped_parameter_used_outside_its_module_is_refused():
    class Outside(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = Tokens()

        def forward(self, x):
            return self.inner(x) + self.inner.tok.sum()  # the parameter itself, not the rows

    model = Outside().double()
    with pytest.raises(ValueError, match="inner.tok is used outside the forward"):
        ClippingEngine(model).per_example_norms(_sq, (_x(3),))


@pytest.mark.parametrize("name, kw", [
    ("convnext_atto", {"dims": (8, 16, 24, 32), "depths": (1, 1, 1, 1)}),  # gamma (C,)
    ("cait_xxs24_224", {"img_size": 16, "patch_size": 8, "depth": 1, "embed_dim": 16,
                        "num_heads": 2}),  # gamma_1, gamma_2 (D,) next to rows taps
    ("dm_nfnet_f0", {"channels": (16, 32, 32, 64), "depths": (1, 1, 1, 1)}),  # gain ()
])
def test_timm_layer_scales_and_skipinit_gains_are_exact(name, kw):
    timm = pytest.importorskip("timm")
    kw = dict(kw)
    if name == "dm_nfnet_f0":  # (a narrower NFNet-F0: the config's stage widths and depths)
        from timm.models.nfnet import NfCfg, NormFreeNet

        base = timm.models.nfnet.model_cfgs["dm_nfnet_f0"]
        cfg = NfCfg(**{**base.__dict__, "channels": kw["channels"], "depths": kw["depths"],
                       "stem_chs": 8, "num_features": 64, "group_size": 8})
        model = NormFreeNet(cfg, num_classes=3)
    else:
        model = timm.create_model(name, pretrained=False, num_classes=3, **kw)
    model = _randomise(model.double().train())
    engine = ClippingEngine(model)
    scales = {n for n in engine._tap_names() if n.rsplit(".", 1)[-1] in (
        "gamma", "gamma_1", "gamma_2", "skipinit_gain")}
    assert scales and set(engine._tap_names()) - scales <= {"cls_token", "pos_embed"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        check(model, _images(4, size=32 if name != "cait_xxs24_224" else 16), ce_loss)


class Scaled(nn.Module):
    """A block that owns parameters of other shapes than (1, ...), used in ``mode``'s way."""

    def __init__(self, mode: str = "gamma", d: int = 4):
        super().__init__()
        self.mode = mode
        self.lin = nn.Linear(d, d)
        self.gamma = nn.Parameter(torch.rand(d) + 0.5)
        if mode in ("gain_inplace", "table"):
            self.gain = nn.Parameter(torch.tensor(1.5))
        if mode == "table":
            self.table = nn.Parameter(torch.randn(5, 2))
            self.register_buffer("index", torch.tensor([[0, 3], [4, 1]]))

    def forward(self, x):  # x: (B, 2, d)
        h = self.lin(x)
        if self.mode == "gamma":  # ConvNeXt's x.mul(gamma.reshape(...)), twice
            return h.mul(self.gamma.reshape(1, 1, -1)) + torch.tanh(h) * self.gamma
        if self.mode == "gain_inplace":  # NFNet's out.mul_(skipinit_gain)
            h = h * 2.0
            h.mul_(self.gain)
            return torch.tanh(h) * self.gamma
        if self.mode == "table":  # a gathered table (Swin's relative positions)
            bias = self.table[self.index].sum(-1).sum(-1, keepdim=True)  # (2, 1): per position
            return torch.tanh(h + bias * self.gain) * self.gamma
        if self.mode == "expanded":  # expanded to the examples before it meets them
            return h * self.gamma.unsqueeze(0).unsqueeze(0).expand(x.shape[0], 2, -1)
        if self.mode == "returned":
            return self.gamma * 2.0
        if self.mode == "kept":  # made from the parameter alone, used after the module
            self.kept = self.gamma * 2.0
            return h
        if self.mode == "mean":  # the rows mixed after the meeting: h * gamma then a batch mean
            y = h * self.gamma
            return y - y.mean(0, keepdim=True).detach() * 0 + (self.gamma * h).mean(0)
        if self.mode == "layout":  # a (2, B, d) layout: the rows meet positions, not examples
            return (h.transpose(0, 1) * self.gamma).transpose(0, 1)
        raise AssertionError(self.mode)


class Holder(nn.Module):
    def __init__(self, mode):
        super().__init__()
        self.block = Scaled(mode)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        h = self.block(x)
        if self.block.mode == "kept":
            h = h + self.block.kept
        return self.head(h).sum(1)


def _xy(B: int = 5):
    return (torch.randn(B, 2, 4, generator=torch.Generator().manual_seed(3), dtype=torch.float64),
            torch.zeros(B, 2, dtype=torch.float64))


@pytest.mark.parametrize("mode", ["gamma", "gain_inplace", "table", "expanded"])
def test_parameters_of_any_shape_used_with_the_examples_are_exact(mode):
    torch.manual_seed(0)
    model = Holder(mode).double()
    engine = ClippingEngine(model)
    assert {a for t in engine.taps for a in t.params} == {
        "gamma": {"gamma"}, "gain_inplace": {"gamma", "gain"}, "table": {"gamma", "gain", "table"},
        "expanded": {"gamma"}}[mode]
    check(model, _xy(), mse_loss)


def test_inner_momentum_plan_over_ops_tapped_parameters_is_exact():
    torch.manual_seed(0)
    model = Holder("table").double()
    batch = _xy(4)
    g = torch.Generator().manual_seed(2)
    theta1 = {n: p.detach() + 0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype)
              for n, p in model.named_parameters()}
    ref = 0.7 * reference_grads(model, mse_loss, batch) + 0.3 * reference_grads(
        model, mse_loss, batch, theta1)
    check(model, batch, mse_loss, plan=[(0.7, None), (0.3, theta1)], ref=ref)


class NormedToken(nn.Module):
    """A token added before a LayerNorm, which saves its weight itself for the backward."""

    def __init__(self):
        super().__init__()
        self.tok = nn.Parameter(torch.randn(1, 4))
        self.norm = nn.LayerNorm(4)
        self.lin = nn.Linear(4, 2)

    def forward(self, x):
        return self.lin(self.norm(x + self.tok))


@pytest.mark.parametrize("first", ["other", "only"])
def test_a_plan_led_by_another_state_than_the_current_one_is_exact(first):
    """DiSK's plan puts its look-ahead state first; the rows check's backward runs while that
    state is in place (run after it, it read the current values through the retained graph
    and refused a separable model: found by a fuzz of query plans)."""
    torch.manual_seed(0)
    model = NormedToken().double()
    with torch.no_grad():
        model.norm.weight.add_(torch.rand(4, dtype=torch.float64))
    batch = (_x(3),)
    g = torch.Generator().manual_seed(2)
    theta1 = {n: p.detach() + torch.randn(p.shape, generator=g, dtype=p.dtype)
              for n, p in model.named_parameters()}
    ref1 = reference_grads(model, _sq, batch, theta1)
    if first == "only":
        check(model, batch, _sq, plan=[(1.0, theta1)], ref=ref1)
    else:
        ref = 0.4 * ref1 + 0.6 * reference_grads(model, _sq, batch)
        check(model, batch, _sq, plan=[(0.4, theta1), (0.6, None)], ref=ref)


@pytest.mark.parametrize("mode, words", [
    ("returned", r"block.gamma is a tapped parameter .* the module's forward returns a tensor "
                 r"computed from it"),
    ("kept", r"parameter block.gamma \(tapped: .*\) reaches the loss other than"),
    ("mean", r"parameter block.gamma, given one row per example .* reach other examples"),
    ("layout", r"parameter block.gamma, given one row per example .* reach other examples"),
])
def test_ops_tapped_parameters_that_escape_or_mix_are_refused(mode, words):
    torch.manual_seed(0)
    model = Holder(mode).double()
    gamma = model.block.gamma
    acc: dict = {}
    with pytest.raises(ValueError, match=words):
        engine = ClippingEngine(model, clip_norm=1.0)
        engine._rows_checked = True  # (rows.py would refuse the layout too: not the subject)
        engine.accumulate(mse_loss, _xy(2 if mode == "layout" else 5), acc)
    assert not acc
    assert model.block._parameters["gamma"] is gamma  # put back, whatever refused


def test_a_module_whose_submodules_have_no_trainable_parameters_takes_the_fallback():
    timm = pytest.importorskip("timm")
    model = nn.Sequential(nn.Conv2d(3, 8, 3), timm.layers.GroupNormAct(8, 2, act_layer=nn.GELU),
                          nn.Flatten(), nn.LazyLinear(3)).double()
    x, y = _images(4, size=6)
    model(x)  # materialise the lazy layer
    _randomise(model)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        engine = ClippingEngine(model)
    assert not engine.taps
    assert any("GroupNormAct" in str(w.message) and "fallback" in str(w.message) for w in seen)
    check(model, (x, y), ce_loss)

    # timm's BiT ResNetV2 (GroupNormAct after weight-standardised convolutions), small
    from functools import partial

    from timm.models.resnetv2 import ResNetV2

    model = ResNetV2(layers=(1, 1), channels=(8, 16), num_classes=3, stem_chs=8,
                     conv_layer=partial(timm.layers.StdConv2d, eps=1e-8),
                     norm_layer=partial(timm.layers.GroupNormAct, num_groups=4)).double()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        check(_randomise(model), _images(4), ce_loss)

    class Frozen(nn.Module):  # a submodule's parameters frozen: they are constants
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4))
            self.fixed = nn.Linear(4, 4).requires_grad_(False)

        def forward(self, x):
            return torch.tanh(self.fixed(x)) * self.w

    model = nn.Sequential(Frozen(), nn.Linear(4, 2)).double()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        check(model, (_x(5), torch.zeros(5, 2, dtype=torch.float64)), mse_loss)


class _FrozenChild(nn.Module):
    """A parameter of its own next to a frozen child Linear, used as a layer norm's weight."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.rand(4) + 0.5)
        self.fixed = nn.Linear(4, 4).requires_grad_(False)

    def forward(self, x):
        return F.layer_norm(torch.tanh(self.fixed(x)), (4,), weight=self.w)


def test_a_module_whose_only_parameterised_child_is_frozen_takes_the_fallback_not_a_tap():
    # only a child's TRAINABLE parameters make a module's own ones tapped: a frozen child's are
    # constants, and the module is a leaf for the torch.func fallback. Tapped instead, w gets B
    # rows as the layer norm's weight, which that call refuses (the model would not train)
    from dptrain.clipping.rules import FALLBACK

    torch.manual_seed(0)
    model = nn.Sequential(_FrozenChild(), nn.Linear(4, 2)).double()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        engine = ClippingEngine(model)
    assert not engine.taps
    fallbacks = [(h.name, list(h.params)) for h in engine.hooked if h.rule is FALLBACK]
    assert fallbacks == [("0", ["w"])]
    assert any("(0); using the torch.func fallback" in str(w.message) for w in seen)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        check(model, (_x(5), torch.zeros(5, 2, dtype=torch.float64)), mse_loss)


class _Remade(nn.Module):
    """A parameter used through a tensor made from it with its size but not its elements in
    their order (not a reshape): 2 * gamma (ConvNeXt's form), pos.flip(1), W.t()."""

    def __init__(self, mode: str):
        super().__init__()
        self.mode = mode
        self.lin = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)
        shape = {"double": (4,), "flip": (1, 4), "transpose": (4, 4)}[mode]
        self.p = nn.Parameter(torch.rand(shape) + 0.5)

    def forward(self, x):  # x: (B, 4, 4)
        h = self.lin(x)
        if self.mode == "double":
            h = (h.unsqueeze(-1) * (2 * self.p).reshape(1, -1, 1, 1)).sum(-1)
        elif self.mode == "flip":
            h = h + self.p.flip(1)
        else:
            h = h + self.p.t()
        return self.head(torch.tanh(h)).sum(1)


@pytest.mark.parametrize("mode", ["double", "flip", "transpose"])
def test_a_parameter_made_tensor_of_the_same_size_is_not_read_as_a_reshape(mode):
    # only the parameter itself or a reshape of it (same storage, order and dtype) takes the
    # gradient rows reshaped; any other tensor of its size goes through the VJP of P -> q (read
    # as a reshape, 2 * gamma's rows would be half the gradient, flip's and t()'s permuted, and
    # "nothing is missing" refuses them)
    torch.manual_seed(0)
    model = _Remade(mode).double()
    assert [list(t.params) for t in ClippingEngine(model).taps] == [["p"]]
    x = torch.randn(5, 4, 4, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    check(model, (x, torch.zeros(5, 2, dtype=torch.float64)), mse_loss)


class _RowPerExample(nn.Module):
    """A (4, d) parameter added to a (B, d) input: at B = 4 it has a row per example."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.p = nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        return self.lin(torch.tanh(x + self.p))


@pytest.mark.parametrize("B", [4, 3])
def test_a_parameter_with_as_many_rows_as_the_microbatch_is_refused(B):
    # its rows are not the examples' (row b is one parameter row, the same for every
    # microbatch): credited to example b, each example's norm would miss the other rows'
    # gradients; it cannot be broadcast over the examples, at B = 4 either
    model = _RowPerExample().double()
    with pytest.raises(ClippingError, match=r"p is a tapped parameter .* takes it with shape "
                                            r"\(4, 4\) next to the examples' 2-dimensional"):
        ClippingEngine(model).per_example_norms(_sq, (_x(B),))
    assert model._parameters["p"] is model.p


class _ReducedOverExamples(nn.Module):
    """A call that takes the examples' tensor and a parameter and sums over the examples."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.gamma = nn.Parameter(torch.rand(4) + 0.5)

    def forward(self, x):
        h = self.lin(x)
        s = torch.linalg.vecdot(h, self.gamma, dim=0)  # (4,): sum_b h_b * gamma
        return torch.tanh(h + s)


@pytest.mark.parametrize("B", [1, 3])
def test_a_call_whose_result_has_no_row_per_example_is_refused_at_the_call(B):
    # the rows of gamma's (B, 4) expansion reach every example's loss through the sum: refused
    # at the call that gives a result without B rows, at any B (the rows check would see it
    # only at a query of two or more examples)
    torch.manual_seed(0)
    model = _ReducedOverExamples().double()
    with pytest.raises(ClippingError, match=r"<root>.gamma is a tapped parameter .* "
                                            r"linalg_vecdot gave a result of shape \(4,\)"):
        ClippingEngine(model).per_example_norms(_sq, (_x(B),))


# --------------------------------------------------------------------------------- under FSDP2

class _GammaBlock(nn.Module):
    """An FSDP unit that owns a layer scale (4,) next to its Linear (an ops tap)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.gamma = nn.Parameter(torch.rand(4) + 0.5)

    def forward(self, x):
        return x + torch.tanh(self.lin(x)) * self.gamma


class _TokenBlocks(nn.Module):
    """A root-owned (1, 4) token, two FSDP units (``layers.N``, with their layer scales) and a
    root-owned head; ``index``: the token used as one row (refused)."""

    def __init__(self, index: bool = False):
        super().__init__()
        self.index = index
        self.tok = nn.Parameter(torch.randn(1, 4))
        self.layers = nn.ModuleList([_GammaBlock(), _GammaBlock()])
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        x = x + (self.tok.expand(x.shape[0], -1)[0] if self.index else self.tok)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _sharded_token_query(rank: int, world: int, sizes: tuple = (3, 4),
                         index: bool = False) -> dict:
    from dptrain.parallel.fsdp import apply_fsdp

    x = _x(sizes[rank], seed=rank)
    if index:
        torch.manual_seed(0)
        model = apply_fsdp(_TokenBlocks(index=True).double())
        try:
            ClippingEngine(model, clip_norm=0.5).accumulate(_sq, (x,), {})
        except ValueError as e:
            return {"error": str(e)}
        return {"error": None}
    torch.manual_seed(0)
    plain = _TokenBlocks().double()
    ref = reference_grads(plain, _sq, (x,))
    torch.manual_seed(0)
    model = apply_fsdp(_TokenBlocks().double())
    acc: dict = {}
    ClippingEngine(model, clip_norm=0.5).accumulate(_sq, (x,), acc)
    lam = (0.5 / ref.norm(dim=1)).clamp(max=1.0)
    want = (ref * lam[:, None]).sum(0)
    got = torch.cat([acc[n].reshape(-1) for n, _ in plain.named_parameters()])
    sharded = {type(p).__name__ for p in model.parameters()}
    return {"err": float((got - want).norm() / want.norm()), "sharded": sharded}


def test_under_fsdp_a_root_token_and_the_blocks_layer_scales_are_exact_on_each_rank():
    from dptrain.parallel.dist import spawn

    # rank 1 with one example: nothing to compare there, but its check's backward must pair up
    # with rank 0's (FSDP2 gathers the blocks again), or rank 0 would wait for ever
    for sizes in ((3, 4), (3, 1)):
        for r in spawn(_sharded_token_query, 2, sizes, timeout=120):
            assert r["sharded"] == {"DTensor"}
            assert r["err"] < 1e-12


def test_under_fsdp_every_rank_refuses_a_token_used_as_one_row():
    from dptrain.parallel.dist import spawn

    errors = [r["error"] for r in spawn(_sharded_token_query, 2, (3, 1), True, timeout=120)]
    # row 0 carries every example's gradient of the token (rows 1 and 2: none)
    assert "parameter tok" in errors[0] and "(rows [0] of the microbatch)" in errors[0]
    assert "parameter tok" in errors[1] and "(on another rank)" in errors[1]


def test_a_forward_that_raises_leaves_the_parameter_in_its_module():
    class Raises(Tokens):
        def forward(self, x):
            super().forward(x)
            raise KeyError("the user's own error")

    model = Raises().double()
    tok = model.tok
    with pytest.raises(KeyError, match="the user's own error"):
        ClippingEngine(model).per_example_norms(_sq, (_x(3),))
    assert model._parameters["tok"] is tok and model.tok is tok


def test_a_token_expanded_to_the_examples_and_a_layer_scale_combine_exactly():
    class Both(nn.Module):  # a class token scaled by a layer scale, both the root's
        def __init__(self):
            super().__init__()
            self.tok = nn.Parameter(torch.randn(1, 1, 4))
            self.gamma = nn.Parameter(torch.rand(4) + 0.5)
            self.lin = nn.Linear(4, 4)
            self.head = nn.Linear(4, 2)

        def forward(self, x):  # x: (B, 2, 4)
            h = torch.cat([self.tok.expand(x.shape[0], -1, -1) * self.gamma, self.lin(x)], 1)
            return self.head(torch.tanh(h) * self.gamma).sum(1)

    torch.manual_seed(0)
    model = Both().double()
    engine = ClippingEngine(model)
    assert [list(t.params) for t in engine.taps] == [["tok", "gamma"]]
    check(model, _xy(), mse_loss)


class _Lookup(nn.Module):
    """A tapped vector looked up with the examples' ids (fuzz, 2026-12-02: at B = 1 its expansion
    indexed the rows instead, accepted and 18x off; with an id >= B, an IndexError)."""

    def __init__(self, detached: bool = False):
        super().__init__()
        self.detached = detached
        self.lin = nn.Linear(4, 4)
        self.vec = nn.Parameter(torch.randn(5))

    def forward(self, x):  # x: (B, 4 + 3), the last 3 columns token ids
        if self.detached:  # a detached use and a comparison: no gradient, no rows to take
            h = torch.tanh(self.lin(x[:, :4]))
            return h * self.vec[:4].detach() + h.masked_fill(self.vec[:4] > 0, 0.0) * self.vec[:4]
        ids = x[:, 4:].long()
        return torch.tanh(self.lin(x[:, :4])) + self.vec[ids].sum(1, keepdim=True)


@pytest.mark.parametrize("B, id_", [(1, 0), (3, 1), (3, 4)])
def test_a_parameter_looked_up_with_the_examples_values_is_refused(B, id_):
    torch.manual_seed(0)
    model = _Lookup().double()
    x = torch.cat([torch.randn(B, 4, dtype=torch.float64),
                   torch.full((B, 3), float(id_), dtype=torch.float64)], 1)
    with pytest.raises(ValueError, match=r"vec is a tapped parameter .* __getitem__ looks it "
                                         r"up with the examples' values"):
        ClippingEngine(model).per_example_norms(_sq, (x,))


def test_a_detached_use_of_a_tapped_parameter_is_exact():
    torch.manual_seed(0)
    model = _Lookup(detached=True).double()
    x = torch.cat([torch.randn(5, 4, dtype=torch.float64), torch.zeros(5, 3)], 1)
    check(model, (x, torch.zeros(5, 4, dtype=torch.float64)), mse_loss)


def test_the_engine_tells_its_refusals_from_the_forwards_errors_by_class_not_text():
    """An error of the user's own forward that happens to start with "dptrain." (a package of
    their own) is wrapped with the tapped parameters' hint, as any other; before, the engine took
    every message with that prefix for one of its own refusals and let it through unexplained.
    The engine's refusals are ClippingErrors, still ValueErrors for callers that catch those."""
    from dptrain.clipping import ClippingError

    class Scaled(nn.Module):  # a parameter of a module with submodules: tapped
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 2)
            self.scale = nn.Parameter(torch.ones(2))

        def forward(self, x):
            if x.shape[0] > 0:
                raise ValueError("dptrain.userlib: a check of the user's own package")
            return self.lin(x) * self.scale

    with pytest.raises(ClippingError, match=r"the forward failed with the tapped parameters "
                                            r"\['scale'\].*dptrain.userlib: a check"):
        ClippingEngine(Scaled()).per_example_norms(_sq, (torch.randn(3, 4),))
    # a bare assert of the forward (no message): named by its class; its empty text made the
    # handler itself fail with an IndexError
    def bare_assert(self, x):
        raise AssertionError  # (an assert here would get pytest's message)

    Scaled.forward = bare_assert
    with pytest.raises(ClippingError, match=r"the forward failed with the tapped parameters "
                                            r"\['scale'\].*: AssertionError\. If that is a"):
        ClippingEngine(Scaled()).per_example_norms(_sq, (torch.randn(3, 4),))
    with pytest.raises(ClippingError) as refusal:  # one of the engine's own
        ClippingEngine(nn.Embedding(5, 3, max_norm=1.0))
    assert isinstance(refusal.value, ValueError)
    assert str(refusal.value).startswith("dptrain.clipping: Embedding (Embedding) has max_norm")


@pytest.mark.parametrize("frozen", [False, True])
def test_an_embedding_with_max_norm_is_refused_before_its_forward_writes_the_batch(frozen):
    # its forward renormalises the looked-up rows in place: a frozen one was accepted, and
    # the model then held which rows the private batch used (a trainable one was refused
    # only after the forward had written them)
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(5, 3, max_norm=0.1)
            self.emb.weight.requires_grad_(not frozen)
            self.head = nn.Linear(3, 1)

        def forward(self, ids):
            return self.head(self.emb(ids)).sum((1, 2))

    model = Model()
    before = model.emb.weight.detach().clone()
    with pytest.raises(ClippingError, match="emb \\(Embedding\\) has max_norm 0.1"):
        ClippingEngine(model)
    assert torch.equal(model.emb.weight, before)
