"""The clipping engine's query in IEEE float32, whatever TF32/bf16 setting the process chose.

``torch.set_float32_matmul_precision("medium")`` (a common line in training scripts) makes float32
matmuls bf16 on CPUs with AMX/AVX512-BF16; ``"high"`` and cuDNN's default make them TF32 on
NVIDIA GPUs. Either rounds products to ~1e-3. Before the fix, under ``"medium"`` on this project's
Sapphire Rapids VM, one clipped example added up to 1.001 C (the ghost norm and the clipped sum
rounded apart), and a timm ViT's cls_token was refused by the tap check (its rows rounded apart
from autograd's). Now the whole query runs in IEEE products (``dptrain/clipping/precision.py``),
and the process's settings are put back afterwards, legacy and new API alike.

The flag tests run anywhere; the bound and the bit-for-bit tests only tell the old code from the
new on a CPU whose bf16 products differ from IEEE (skipped elsewhere), and on CUDA with TF32
(tests/test_gpu.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from _threads import _one_thread  # noqa: F401  (autouse: one torch thread)

from dptrain.clipping import ClippingEngine, per_example_grad_norms
from dptrain.clipping.precision import _precision_objects, ieee_float32

B = torch.backends


def _state() -> tuple:
    """Every fp32 precision attribute, and the legacy getters (None where they raise)."""
    def read(get):
        try:
            return get()
        except RuntimeError:
            return None

    new = tuple(obj.fp32_precision for obj in _precision_objects())
    legacy = (read(torch.get_float32_matmul_precision), read(lambda: B.cuda.matmul.allow_tf32),
              read(lambda: B.cudnn.allow_tf32))
    return new, legacy


@pytest.fixture()
def restore_precision():
    """Put the process's precision settings back by hand (not through the code under test)."""
    objects = _precision_objects()
    saved = [obj.fp32_precision for obj in objects]
    legacy = torch.get_float32_matmul_precision()
    legacy_cudnn = B.cudnn.allow_tf32
    extra = [(obj, obj.fp32_precision) for obj in (B, B.cudnn, B.mkldnn)]
    yield
    torch.set_float32_matmul_precision(legacy)
    B.cudnn.allow_tf32 = legacy_cudnn
    for obj, value in extra:
        obj.fp32_precision = value
    for obj, value in zip(objects, saved):
        obj.fp32_precision = value


def _set_high():
    torch.set_float32_matmul_precision("high")


def _set_medium():
    torch.set_float32_matmul_precision("medium")


def _set_new_api_tf32():
    B.cuda.matmul.fp32_precision = "tf32"
    B.mkldnn.conv.fp32_precision = "bf16"


def _set_legacy_cudnn_off():
    B.cudnn.allow_tf32 = False


def _set_root_tf32():
    B.fp32_precision = "tf32"


def _set_parent_mkldnn_bf16():
    B.mkldnn.fp32_precision = "bf16"  # (after which the legacy cuDNN getter raises)


SETTINGS = {"default": lambda: None, "high": _set_high, "medium": _set_medium,
            "new_api": _set_new_api_tf32, "legacy_cudnn_off": _set_legacy_cudnn_off,
            "root_tf32": _set_root_tf32, "parent_mkldnn_bf16": _set_parent_mkldnn_bf16}


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_ieee_inside_and_the_process_settings_back_after(setting, restore_precision):
    SETTINGS[setting]()
    before = _state()
    with ieee_float32():
        new, legacy = _state()
        assert set(new) == {"ieee"}, new
        # the legacy getters agree with the new attributes (PyTorch raises on a mix)
        assert legacy == ("highest", False, False), legacy
        with ieee_float32():  # nested: still IEEE, and the outer one's state is kept
            pass
        assert _state() == (new, legacy)
    assert _state() == before


def test_a_legacy_flag_that_cannot_be_read_is_left_as_it_was():
    """With a parent attribute set, the legacy cuDNN getter raises; the context used to set
    the hidden legacy flag to False and leave it so: the process's later getter then raised
    where it returned True before. (In a fresh process: restoring any attribute by hand makes
    PyTorch's per-family defaults explicit, which changes how a parent setting propagates.)"""
    import subprocess
    import sys

    script = """
import torch
from dptrain.clipping.precision import ieee_float32
B = torch.backends
B.mkldnn.fp32_precision = "bf16"
if CALL:
    with ieee_float32():
        pass
B.cudnn.conv.fp32_precision = "tf32"
B.cudnn.rnn.fp32_precision = "tf32"
try:
    print(B.cudnn.allow_tf32)
except RuntimeError:
    print("raises")
"""
    outputs = [subprocess.run([sys.executable, "-c", f"CALL = {call}\n" + script], check=True,
                              capture_output=True, text=True).stdout.strip()
               for call in (False, True)]
    assert outputs == ["True", "True"], outputs


def test_the_settings_are_back_after_an_error(restore_precision):
    _set_medium()
    before = _state()
    with pytest.raises(ZeroDivisionError):
        with ieee_float32():
            1 / 0
    assert _state() == before


def test_two_threads_queries_overlapping_keep_ieee_until_the_last_leaves(restore_precision):
    """Thread A enters, thread B enters, A leaves while B's query runs: B must still see IEEE
    (before the count, A put "medium" back under B), and the process gets "medium" back when B
    leaves (before, B had saved "ieee" and left it so)."""
    import threading

    _set_medium()
    before = _state()
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, tuple] = {}

    def thread_a():
        with ieee_float32():
            a_in.set()
            b_in.wait(10)
        a_out.set()

    def thread_b():
        a_in.wait(10)
        with ieee_float32():
            b_in.set()
            a_out.wait(10)
            seen["b after a left"] = _state()

    threads = [threading.Thread(target=thread_a), threading.Thread(target=thread_b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    new, legacy = seen["b after a left"]
    assert set(new) == {"ieee"} and legacy == ("highest", False, False), seen
    assert _state() == before


def _bf16_products_differ() -> bool:
    """Whether this CPU's bf16 products (AMX/AVX512-BF16) make a float32 matmul inexact."""
    a = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    exact = a @ a.T
    before = B.mkldnn.matmul.fp32_precision
    B.mkldnn.matmul.fp32_precision = "bf16"
    try:
        rounded = a @ a.T
    finally:
        B.mkldnn.matmul.fp32_precision = before
    return not torch.equal(exact, rounded)


bf16_cpu = pytest.mark.skipif(not _bf16_products_differ(),
                              reason="this CPU's float32 products are IEEE under 'medium' too")


class _Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(64, 256)
        self.b = nn.Linear(256, 10)

    def forward(self, x):  # (B, T, 64): per-token products, ghost norms over 32 tokens
        return self.b(torch.tanh(self.a(x))).mean(1)


class _StdConvNet(nn.Module):
    def __init__(self):
        from timm.layers import ScaledStdConv2d

        super().__init__()
        self.conv = ScaledStdConv2d(3, 8, 3, stride=2)
        self.gn = nn.GroupNorm(2, 8)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(F.relu(self.gn(F.relu(self.conv(x), inplace=True))).mean((2, 3)))


def _ce(model, batch):
    return F.cross_entropy(model(batch[0]), batch[1], reduction="none")


def _cases():
    torch.manual_seed(0)
    yield _Mlp(), (torch.randn(1, 32, 64) * 30, torch.tensor([2]))
    torch.manual_seed(1)
    yield _StdConvNet(), (torch.randn(1, 3, 8, 8) * 30, torch.tensor([1]))


@bf16_cpu
@pytest.mark.parametrize("mode", ["bookkeeping", "two_pass"])
def test_one_clipped_example_adds_at_most_c_under_bf16_products(mode, restore_precision):
    _set_medium()
    B.mkldnn.conv.fp32_precision = "bf16"
    C = 1e-3
    worst = 0.0
    for model, batch in _cases():
        for seed in range(4):
            torch.manual_seed(seed)
            x = batch[0] * (1 + seed)
            acc: dict = {}
            ClippingEngine(model, clip_norm=C, ghost="ghost", mode=mode).accumulate(
                _ce, (x, batch[1]), acc)
            added = float(torch.cat([v.reshape(-1).double() for v in acc.values()]).norm())
            worst = max(worst, abs(added / C - 1))
    assert worst <= 1e-5, worst  # before the fix: up to 1e-3


@bf16_cpu
def test_norms_under_bf16_products_are_the_ieee_norms_bit_for_bit(restore_precision):
    for model, batch in _cases():
        exact = per_example_grad_norms(model, _ce, batch)
        _set_medium()
        B.mkldnn.conv.fp32_precision = "bf16"
        assert torch.equal(per_example_grad_norms(model, _ce, batch), exact)
        torch.set_float32_matmul_precision("highest")
        B.mkldnn.conv.fp32_precision = "none"


@bf16_cpu
def test_a_vit_cls_token_is_not_refused_under_bf16_products(restore_precision):
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", img_size=16, patch_size=8, depth=2,
                              embed_dim=32, num_heads=2, num_classes=4)
    batch = (torch.randn(4, 3, 16, 16), torch.tensor([0, 1, 2, 3]))
    exact = per_example_grad_norms(model, _ce, batch)
    _set_medium()
    # before the fix: ValueError "the parameter cls_token ... has rows that reach other
    # examples' losses"
    assert torch.equal(per_example_grad_norms(model, _ce, batch), exact)


def test_sq_rows_is_float64_accurate_where_float32_reduction_rounds_low():
    # float32 vector_norm on CPU lost 5.7e-5 relative over 590k alike elements: the clip
    # factor of an instantiated weight-standardised conv's example followed that norm, and its
    # clipped gradient came out at 1.000027 C
    from dptrain.clipping import contributions

    torch.manual_seed(0)
    g = (1.0 + 1e-3 * torch.randn(3, 590_000)) * 0.57
    exact = g.double().square().sum(1)
    rounded = torch.linalg.vector_norm(g, dim=1).square().double()
    assert float(((rounded - exact) / exact).abs().max()) > 1e-5  # the failure is real here
    for block in (contributions.SQ_ROWS_BLOCK, 1000, 7919):  # tails of 176, 0 and 3,994 at 512
        # (and identical values below)
        contributions.SQ_ROWS_BLOCK, saved = block, contributions.SQ_ROWS_BLOCK
        try:
            got = contributions.sq_rows(g.view(3, 590, 1000))
        finally:
            contributions.SQ_ROWS_BLOCK = saved
        assert got.dtype == torch.float32
        assert float(((got.double() - exact) / exact).abs().max()) < 1e-7
    same = torch.full((2, 2_400_000), 0.5731)
    exact = same.double().square().sum(1)
    assert float(((contributions.sq_rows(same).double() - exact) / exact).abs().max()) < 2e-7


def test_an_instantiated_example_of_alike_values_adds_at_most_c():
    # the clipped gradient of one example is lam * rows, lam = C / ||rows||: a norm that rounds
    # low lets it out above C (a wide layer whose per-example gradient is alike everywhere)
    torch.manual_seed(0)
    lin = nn.Linear(768, 768, bias=False)
    with torch.no_grad():
        lin.weight.fill_(1e-3)
    x = 100.0 + 1e-6 * torch.randn(2, 4, 768)  # alike positions: alike gradient entries

    def loss_fn(m, batch):
        return m(batch).sum((1, 2))

    added = []
    for b in range(2):
        acc = {}
        ClippingEngine(lin, clip_norm=1.0, ghost="instantiate").accumulate(loss_fn, x[b:b + 1],
                                                                           acc)
        added.append(float(torch.cat([v.double().reshape(-1) for v in acc.values()]).norm()))
    # C, to float32's rounding, and never above it (each gradient's norm is ~3e5 C)
    assert max(added) <= 1.0 + 1e-6 and min(added) >= 1.0 - 1e-5, added


def test_a_fallback_layer_taking_a_list_runs_under_bf16_autocast():
    # the torch.func fallback's captured inputs were made float32 inside dicts and tuples only:
    # a list argument kept its bf16 tensor, and the norms failed with a bare dtype error
    class Mix(nn.Module):  # no rule: the torch.func fallback
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 4) * 0.1)

        def forward(self, x, extra):
            return F.linear(extra[0], self.w) * x

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.mix = nn.Linear(4, 4), nn.Linear(4, 4), Mix()

        def forward(self, x):
            return self.mix(self.a(x), [self.b(x)])

    torch.manual_seed(0)
    model, x = Model(), torch.randn(3, 4)

    def loss_fn(m, batch):
        return m(batch).float().pow(2).sum(1)

    engine = ClippingEngine(model, clip_norm=1.0)
    exact = engine.per_example_norms(loss_fn, x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        half = engine.per_example_norms(loss_fn, x)
    assert half.dtype == torch.float32
    torch.testing.assert_close(half, exact, rtol=3e-2, atol=0)


@pytest.mark.parametrize("mode", ["bookkeeping", "two_pass"])
def test_a_weight_standardised_conv_of_alike_positions_adds_at_most_c(mode):
    # half the positions one vector, half one 0.55% away, output gradients of opposite signs:
    # the standardised conv's ghost row (2^16 ulps, no factor for many positions) was 0.6%
    # short, and the example added 1.0059 C
    from timm.layers import StdConv2d

    torch.manual_seed(0)
    n, side = 2048, 32
    conv = StdConv2d(n, 2, 1)
    u = torch.randn(n) * 10 + 3.0
    d = torch.randn(n)
    d = d / d.norm() * 0.0055 * u.norm()
    x = torch.empty(1, n, side * side)
    x[..., : side * side // 2] = u[:, None]
    x[..., side * side // 2:] = (u + d)[:, None]
    x = x.view(1, n, side, side)
    g = torch.ones(1, 2, side * side)
    g[..., side * side // 2:] = -1
    g = (g * (1 + 1e-3 * torch.randn_like(g))).view(1, 2, side, side)

    def loss_fn(m, batch):
        return (m(batch[0]) * batch[1]).flatten(1).sum(1)

    conv64 = StdConv2d(n, 2, 1).double()
    conv64.load_state_dict(conv.state_dict())
    exact = torch.autograd.grad(loss_fn(conv64, (x.double(), g.double())).sum(),
                                conv64.weight)[0].norm()
    C = float(exact) / 2  # clipped: the added gradient is scaled to C
    acc = {}
    ClippingEngine(conv, clip_norm=C, ghost="ghost", mode=mode).accumulate(loss_fn, (x, g), acc)
    added = float(acc["weight"].double().norm())
    assert C * (1 - 1e-3) <= added <= C * (1 + 1e-6), added / C  # clipped to C, not above


class _ManyScalars(nn.Module):
    """n + 1 weights 1 x 1: example x's squared norm per weight is x_k^2."""

    def __init__(self, n: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(1, 1, bias=False) for _ in range(n + 1))

    def forward(self, x):
        return sum(m(x[:, k:k + 1]) for k, m in enumerate(self.layers)).squeeze(1)


def test_many_parameters_squared_norms_are_added_without_float32_loss():
    # one weight's squared norm 1, then 256 of 2^-24 each: a float32 running total rounds every
    # one of those away (half an ulp of 1, ties to even), 1 + 2^-16 -> 1, and with C between
    # the two the example would be added unclipped, above C
    n = 256
    model = _ManyScalars(n)
    with torch.no_grad():
        for m in model.layers:
            m.weight.fill_(1.0)
    x = torch.full((2, n + 1), 2.0 ** -12)
    x[:, 0] = 1.0
    true = (1 + n * 2.0 ** -24) ** 0.5
    norms = ClippingEngine(model).per_example_norms(lambda m, b: m(b[0]), (x,))
    assert torch.allclose(norms.double(), torch.full((2,), true, dtype=torch.float64),
                          rtol=1e-7, atol=0), norms
    C = 1 + 2.0 ** -18
    acc = {}
    ClippingEngine(model, clip_norm=C).accumulate(lambda m, b: m(b[0]), (x[:1],), acc)
    added = sum(float(v.double().square().sum()) for v in acc.values()) ** 0.5
    assert C * (1 - 1e-6) <= added <= C * (1 + 1e-7), (added, C)  # clipped to C, not above
