"""Triton kernels against their PyTorch references (dptrain/kernels/).

On a CUDA machine the kernels run compiled on the GPU. On a CPU-only machine the same tests run
in a child pytest under Triton's interpreter (TRITON_INTERPRET=1 must be set before Triton's
kernels are defined, and it would interpret every Triton kernel of the process, so it is not
set in the suite's own process): ``test_kernels_under_the_interpreter``.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dptrain.config import ConfigError, load
from dptrain.trainer import RunConfig, Trainer, to_device

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.yaml"

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRETED else "cpu"
runs_kernels = pytest.mark.skipif(
    not (INTERPRETED or torch.cuda.is_available()),
    reason="kernels run on CUDA, or on CPU in the interpreted child run")

HAVE_TRITON = importlib.util.find_spec("triton") is not None


def _interpreter_breaks() -> str | None:
    """Triton 3.6's interpreter (torch 2.11's) fails on numpy >= 2.4 ("only 0-dimensional
    arrays can be converted to Python scalars", in its own argument handling); 3.8 does not,
    nor does 3.6 with numpy 2.3 (checked 2026-12-01). Compiled kernels on CUDA are unaffected."""
    if not HAVE_TRITON:
        return None
    import numpy
    import triton

    def version(v: str) -> tuple:
        return tuple(int(x) for x in v.split(".")[:2] if x.isdigit())

    if version(triton.__version__) < (3, 7) and version(numpy.__version__) >= (2, 4):
        return f"triton {triton.__version__}'s interpreter fails on numpy {numpy.__version__}"
    return None


def make(*overrides: str) -> Trainer:
    return Trainer(load(RunConfig, TINY, ["train.progress=false", *overrides]))


@pytest.mark.skipif(INTERPRETED or torch.cuda.is_available() or not HAVE_TRITON,
                    reason="the parent run on a CPU-only machine with Triton")
@pytest.mark.skipif(_interpreter_breaks() is not None, reason=str(_interpreter_breaks()))
def test_kernels_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        str(Path(__file__)), "-k", "not under_the_interpreter and not refused"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    tail = (r.stdout + r.stderr)[-4000:]
    assert r.returncode == 0, tail
    assert " passed" in tail and "skipped" not in tail.splitlines()[-1], tail  # all of them ran


@pytest.mark.skipif(INTERPRETED or not HAVE_TRITON, reason="Triton without its interpreter")
def test_triton_kernels_on_a_cpu_are_refused_naming_the_field():
    with pytest.raises(ConfigError) as e:
        make("performance.device=cpu", "performance.kernels=triton")
    assert e.value.field == "performance.kernels"
    assert "CUDA" in e.value.message


# ---------------------------------------------------------------------------------------------
# the fused ghost product, dptrain/kernels/ghost.py


def _factors(B, Tu, Tv, O, I, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    def r(*s):
        return torch.randn(*s, generator=g, dtype=torch.float64).to(dtype).to(DEVICE)
    return r(B, Tu, O), r(B, Tu, I), r(B, Tv, O), r(B, Tv, I)


def _exact(Lu, Ru, Lv=None, Rv=None):
    from dptrain.kernels.ghost import outer_inner_reference

    d = [x.double().cpu() if x is not None else None for x in (Lu, Ru, Lv, Rv)]
    return outer_inner_reference(*d)


# (B, Tu, Tv, O, I): T not a multiple of the tile, one token, narrow layers (< 16 features,
# tl.dot's minimum), an unequal pair, wider than a tile of features, several tiles of tokens
SHAPES = [(3, 5, 5, 7, 9), (2, 1, 1, 3, 2), (2, 70, 70, 40, 33), (4, 16, 16, 64, 16),
          (2, 17, 90, 48, 20), (1, 130, 130, 24, 40)]


@runs_kernels
@pytest.mark.parametrize("shape", SHAPES)
def test_ghost_product_equals_the_float64_reference(shape):
    from dptrain.kernels.ghost import outer_inner

    B, Tu, Tv, O, I = shape
    Lu, Ru, Lv, Rv = _factors(*shape)
    got = outer_inner(Lu, Ru, Lv, Rv)
    assert got.dtype == torch.float32 and got.shape == (B,)
    ref = _exact(Lu, Ru, Lv, Rv)
    scale = _exact(Lu, Ru).sqrt() * _exact(Lv, Rv).sqrt()  # Cauchy–Schwarz: |<u,v>| <= |u||v|
    assert ((got.double().cpu() - ref).abs() <= 1e-5 * scale).all()
    if Tu == Tv:
        sym = outer_inner(Lu, Ru)  # the upper triangle of tiles, off-diagonal ones twice
        torch.testing.assert_close(sym.double().cpu(), _exact(Lu, Ru), rtol=1e-5, atol=0)
        # the same product asked for as a general pair (every tile)
        torch.testing.assert_close(outer_inner(Lu, Ru, Lu, Ru).double().cpu(),
                                   _exact(Lu, Ru), rtol=1e-5, atol=0)


@runs_kernels
def test_ghost_squared_norm_of_alike_tokens_is_as_exact_as_the_reference():
    # half the tokens near one vector, half near it with opposite output gradients: the terms
    # cancel to ~0.09 of their scale. Each tile's sum in float32 left the squared norm 5.6e-5
    # low (a clipped example added 1 + 2.5e-5 C); the torch path's is 1e-5
    g = torch.Generator().manual_seed(7)
    T, O, I = 256, 128, 128
    c = torch.randn(I, generator=g, dtype=torch.float64)
    a = torch.randn(O, generator=g, dtype=torch.float64)
    sign = torch.tensor([1.0] * (T // 2) + [-1.0] * (T // 2), dtype=torch.float64)
    R = (c / c.norm() + 3e-2 * torch.randn(2, T, I, generator=g, dtype=torch.float64)).float()
    L = (sign[None, :, None] * a / a.norm()
         + 1e-3 * torch.randn(2, T, O, generator=g, dtype=torch.float64)).float()
    from dptrain.kernels.ghost import outer_inner

    got = outer_inner(L.to(DEVICE), R.to(DEVICE)).double().cpu()
    exact = _exact(L, R)
    assert float(((got - exact) / exact).abs().max()) < 2e-6


@runs_kernels
def test_ghost_product_of_integer_factors_is_exact():
    # small integers: every Gram entry is an integer below 2^24 (exact in float32, any order),
    # their products (~1e8) are not all float32 numbers but are float64 ones, and so are
    # the sums: the result is the exact value rounded once to float32, though the terms cancel
    # (half the tokens with opposite output gradients, as in a squared norm of alike tokens)
    from dptrain.kernels.ghost import outer_inner

    g = torch.Generator().manual_seed(11)
    B, T, O, I = 2, 64, 16, 24
    a, c = torch.randint(-40, 41, (O,), generator=g), torch.randint(-40, 41, (I,), generator=g)
    sign = torch.tensor([1] * (T // 2) + [-1] * (T // 2))[None, :, None]
    L = (sign * a + torch.randint(-2, 3, (B, T, O), generator=g)).float()
    R = (c + torch.randint(-2, 3, (B, T, I), generator=g)).float()
    exact = _exact(L, R)
    assert (exact.abs() < 1e-3 * _exact(L.abs(), R.abs())).all()  # the terms cancel
    assert torch.equal(outer_inner(L.to(DEVICE), R.to(DEVICE)).cpu(), exact.float())
    Lv, Rv = L[:, :40].flip(1), R[:, :40].flip(1)
    got = outer_inner(L.to(DEVICE), R.to(DEVICE), Lv.to(DEVICE), Rv.to(DEVICE))
    assert torch.equal(got.cpu(), _exact(L, R, Lv, Rv).float())


@runs_kernels
def test_ghost_product_in_float64_is_float64_exact():
    from dptrain.kernels.ghost import outer_inner

    Lu, Ru, Lv, Rv = _factors(3, 40, 23, 20, 36, dtype=torch.float64, seed=1)
    got = outer_inner(Lu, Ru, Lv, Rv)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got.cpu(), _exact(Lu, Ru, Lv, Rv), rtol=1e-12, atol=1e-10)
    torch.testing.assert_close(outer_inner(Lu, Ru).cpu(), _exact(Lu, Ru), rtol=1e-12, atol=0)
    # one float64 factor is enough: the others are widened, not it rounded to float32
    Lf = Lu.float()
    got = outer_inner(Lf, Ru, Lv.float(), Rv)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got.cpu(), _exact(Lf, Ru, Lv.float(), Rv), rtol=1e-12, atol=1e-10)


@runs_kernels
def test_ghost_product_reads_strided_and_half_precision_factors():
    from dptrain.kernels.ghost import outer_inner

    g = torch.Generator().manual_seed(2)
    L = torch.randn(2, 40, 30, generator=g).to(DEVICE).transpose(1, 2)  # (2, 30, 40), strided
    R = torch.randn(2, 8, 30, generator=g).to(DEVICE).transpose(1, 2)[:, :, :5]  # (2, 30, 5)
    assert not L.is_contiguous() and not R.is_contiguous()
    torch.testing.assert_close(outer_inner(L, R).double().cpu(), _exact(L, R), rtol=1e-5, atol=0)
    Lh = L.to(torch.bfloat16)  # bf16 captures are multiplied in float32, not in bf16
    got = outer_inner(Lh, R)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double().cpu(), _exact(Lh, R), rtol=1e-5, atol=0)


@runs_kernels
def test_ghost_product_of_an_empty_batch_or_sequence_is_zero():
    from dptrain.kernels.ghost import outer_inner

    Lu, Ru, _, _ = _factors(0, 4, 4, 3, 3)
    assert outer_inner(Lu, Ru).shape == (0,)
    Lu, Ru, _, _ = _factors(2, 0, 0, 3, 3)
    assert torch.equal(outer_inner(Lu, Ru).cpu(), torch.zeros(2))
    Lu, Ru, Lv, Rv = _factors(2, 4, 0, 3, 3)  # a pair with one empty sequence
    assert torch.equal(outer_inner(Lu, Ru, Lv, Rv).cpu(), torch.zeros(2))
    # float64 factors give float64 zeros, like any other float64 product
    Lu, Ru, _, _ = _factors(2, 0, 0, 3, 3, dtype=torch.float64)
    got = outer_inner(Lu, Ru)
    assert got.dtype == torch.float64 and torch.equal(got.cpu(), torch.zeros(2).double())


@runs_kernels
def test_ghost_product_refuses_factors_that_do_not_pair():
    from dptrain.kernels.ghost import outer_inner

    Lu, Ru, Lv, Rv = _factors(2, 5, 6, 4, 3)
    with pytest.raises(ValueError, match="do not pair"):
        outer_inner(Lu, Ru, Lv, Rv[:, :, :2])
    # Lv of other features or of another length than Rv; Rv of another batch
    for lv, rv in ((Lv[:, :, :3], Rv), (Lv[:, :5], Rv), (Lv, Rv[:1]), (Lv[:1], Rv[:1])):
        with pytest.raises(ValueError, match="do not pair"):
            outer_inner(Lu, Ru, lv, rv)
    # one of the pair alone: Rv was ignored (the squared norm returned), Lv an AttributeError
    for lv, rv in ((None, Rv), (Lv, None)):
        with pytest.raises(ValueError, match="both Lv and Rv, or neither"):
            outer_inner(Lu, Ru, lv, rv)


@runs_kernels
def test_ghost_squared_norm_computes_each_pair_of_tiles_once(monkeypatch):
    # u = v: tile (t, s) of both Grams is tile (s, t) transposed, so each unordered pair of
    # tiles is computed once (the kernel counts the off-diagonal ones twice), nu (nu + 1) / 2
    # programs; a general pair computes all nu x nv tiles
    import dptrain.kernels.ghost as ghost

    seen = []
    tiles = ghost._tiles

    def spy(nu, nv, symmetric, device):
        r, c = tiles(nu, nv, symmetric, device)
        seen.append((nu, nv, symmetric, list(zip(r.tolist(), c.tolist()))))
        return r, c

    monkeypatch.setattr(ghost, "_tiles", spy)
    Lu, Ru, Lv, Rv = _factors(2, 150, 150, 8, 8)
    ghost.outer_inner(Lu, Ru)
    ghost.outer_inner(Lu, Ru, Lv, Rv)
    (nu, nv, sym, pairs), (nu2, nv2, sym2, pairs2) = seen
    assert sym and not sym2 and nu == nv == nu2 == nv2 >= 3
    assert len(pairs) == nu * (nu + 1) // 2
    assert {tuple(sorted(p)) for p in pairs} == {(i, j) for i in range(nu) for j in range(i, nu)}
    assert sorted(pairs2) == [(i, j) for i in range(nu) for j in range(nu)]


@runs_kernels
def test_ghost_tile_side_is_a_power_of_two_from_16_to_64():
    # 16 is tl.dot's minimum; 64 keeps two float32 tiles in registers. Under the interpreter
    # (programs one after another) the smallest power of two covering the longer sequence; on
    # a GPU halved while fewer than 256 programs would leave multiprocessors idle
    from dptrain.kernels.ghost import _INTERPRETED, _block

    for B, Tu, Tv in [(1, 1, 1), (3, 5, 5), (2, 16, 16), (2, 17, 90), (1, 33, 2), (2, 64, 64),
                      (1, 65, 3), (1, 130, 130), (64, 200, 200)]:
        bt = _block(B, Tu, Tv)
        cover = min(64, max(16, 1 << (max(Tu, Tv) - 1).bit_length()))
        assert bt in (16, 32, 64) and bt <= cover, (B, Tu, Tv, bt)
        if _INTERPRETED:
            assert bt == cover, (B, Tu, Tv, bt)
        else:
            def programs(side):
                return B * -(-Tu // side) * -(-Tv // side)

            assert bt == 16 or programs(bt) >= 256, (B, Tu, Tv, bt)  # halved far enough
            assert bt == cover or programs(2 * bt) < 256, (B, Tu, Tv, bt)  # and no further


# ---------------------------------------------------------------------------------------------
# the kernel inside the clipping engine and the trainer: the same norms, clip factors, release


def _tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(
        n_layer=1, n_embd=16, n_head=2, vocab_size=23, n_positions=24,
        attn_implementation="eager", resid_pdrop=0, embd_pdrop=0, attn_pdrop=0))
    return model.double().to(DEVICE)


def _nll(m, batch):
    ids = batch["input_ids"]
    lp = torch.log_softmax(m(input_ids=ids).logits[:, :-1], -1)
    return -lp.gather(-1, ids[:, 1:, None]).squeeze(-1).mean(-1)


@runs_kernels
def test_engine_norms_and_clipped_sum_with_the_kernel_equal_torch_over_several_states(
        monkeypatch):
    """GPT-2 with tied wte/lm_head (a dense head contribution and a one-hot embedding one, the
    latter left to torch) at 3 model states (inner momentum): every pair of dense ghost
    contributions, across states too, goes through the kernel."""
    import dptrain.kernels.ghost as ghost
    from dptrain.clipping import ClippingEngine

    calls = {"self": 0, "cross": 0}
    kernel = ghost.outer_inner

    def counted(Lu, Ru, Lv=None, Rv=None):
        calls["self" if Lv is None else "cross"] += 1
        return kernel(Lu, Ru, Lv, Rv)

    monkeypatch.setattr(ghost, "outer_inner", counted)

    model = _tiny_gpt2()
    ids = torch.randint(0, 23, (3, 12), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    batch = {"input_ids": ids}
    g = torch.Generator().manual_seed(4)
    past = [{n: (p.detach().cpu() + 0.05 * torch.randn(p.shape, generator=g,
                                                       dtype=p.dtype)).to(DEVICE)
             for n, p in model.named_parameters()} for _ in range(2)]
    plan = [(0.5, None), (0.3, past[0]), (0.2, past[1])]
    out = {}
    for kernels in ("torch", "triton"):
        eng = ClippingEngine(model, clip_norm=None, ghost="ghost", kernels=kernels)
        norms = eng.per_example_norms(_nll, batch, plan)
        eng = ClippingEngine(model, clip_norm=float(norms.median()), ghost="ghost",
                             kernels=kernels)
        acc: dict = {}
        eng.accumulate(_nll, batch, acc, plan)
        out[kernels] = (norms, acc)
        if kernels == "torch":
            assert calls == {"self": 0, "cross": 0}
    # 2 calls (norms, then clipped sum) x 3 states x the dense 2-D weights of the model (4 block
    # linears and the head); pairs of states: 3 per weight and call
    n_dense = 5
    assert calls == {"self": 2 * 3 * n_dense, "cross": 2 * 3 * n_dense}, calls
    (n_t, a_t), (n_k, a_k) = out["torch"], out["triton"]
    torch.testing.assert_close(n_k, n_t, rtol=1e-12, atol=0)
    for name in a_t:
        torch.testing.assert_close(a_k[name], a_t[name], rtol=1e-10, atol=1e-14)


@runs_kernels
def test_engine_recomputes_cancelled_ghost_sums_of_large_inputs_with_the_kernel():
    # with the kernel, the threshold for a cancelled ghost sum is rounding_scale's
    # sum_t |L_t|^2 |R_t|^2. Tokens 1e4 v + jitter with opposite output gradients (|R_t| ~ 8e4,
    # the terms ~1e3 times their sum): from |R_t| unsquared the threshold was 8e4 times too
    # low, the float32 ghost sum (6-20% off) was kept and a clipped example added above C
    from dptrain.clipping import ClippingEngine

    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64, bias=False).to(DEVICE)
    gen = torch.Generator().manual_seed(7)
    B, T = 3, 32
    v, w = torch.randn(64, generator=gen), torch.randn(64, generator=gen)
    sign = torch.cat([torch.ones(T // 2), -torch.ones(T // 2)])
    x = 1e4 * v.expand(B, T, 64) + 20 * torch.randn(B, T, 64, generator=gen)

    def loss_fn(m, batch):
        t = batch[0]
        return ((m(t) @ w.to(t)) * sign.to(t)).sum(1)

    ref = []  # a loop over single examples, float64
    for b in range(B):
        m64 = torch.nn.Linear(64, 64, bias=False).double()
        m64.weight.data.copy_(model.weight.detach().cpu())
        ref.append(torch.autograd.grad(loss_fn(m64, (x[b:b + 1].double(),)), m64.weight)[0])
    ref = torch.stack(ref).flatten(1).norm(dim=1)
    x = x.to(DEVICE)
    C = float(ref.min()) / 10  # every example is to be clipped
    engine = ClippingEngine(model, ghost="ghost", kernels="triton")
    got = engine.per_example_norms(loss_fn, (x,)).double().cpu()
    assert float(((got - ref).abs() / ref).max()) < 1e-3, (got, ref)
    for b in range(B):
        acc: dict = {}
        ClippingEngine(model, clip_norm=C, ghost="ghost", kernels="triton").accumulate(
            loss_fn, (x[b:b + 1],), acc)
        assert float(acc["weight"].norm()) <= C * (1 + 1e-6), b


@runs_kernels
def test_kernels_setting_leaves_clip_factors_and_the_release_unchanged():
    small = ["performance.dtype=float64", f"performance.device={DEVICE}",
             "performance.ghost=ghost", "model.n_layer=1", "privacy.sample_rate=0.04"]
    ref = make(*small)
    other = make(*small, "performance.kernels=triton")
    assert other.engine.kernels == "triton"
    idx = ref.sample(0)
    batch = ref.task.train.collate(idx)
    batch = to_device(batch, ref.device)
    lam_ref = ref.engine.clip_factors(ref.engine.per_example_norms(ref.task.loss_fn, batch))
    lam_k = other.engine.clip_factors(other.engine.per_example_norms(other.task.loss_fn, batch))
    assert (lam_ref < 1).any()  # clipping is active
    torch.testing.assert_close(lam_k, lam_ref, rtol=1e-12, atol=0)
    r_ref, _ = ref.release(0)
    r_k, _ = other.release(0)
    for n in r_ref:
        torch.testing.assert_close(r_k[n], r_ref[n], rtol=1e-10, atol=1e-14)


@runs_kernels
def test_engine_conv_ghost_norms_with_the_kernel_equal_torch():
    """A convolution's ghost form is an outer product too (L = output gradients as (B, T, out),
    R = the unfolded input, a strided view): it goes through the kernel, with T = positions."""
    import dptrain.kernels.ghost as ghost
    from dptrain.clipping import ClippingEngine

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(),
                                torch.nn.Conv2d(8, 4, 3, stride=2), torch.nn.Flatten(),
                                torch.nn.Linear(4 * 3 * 3, 5)).double().to(DEVICE)
    g = torch.Generator().manual_seed(5)
    batch = (torch.randn(3, 3, 8, 8, generator=g, dtype=torch.float64).to(DEVICE),
             torch.randint(0, 5, (3,), generator=g).to(DEVICE))

    def loss(m, b):
        return torch.nn.functional.cross_entropy(m(b[0]), b[1], reduction="none")

    calls = []
    kernel = ghost.outer_inner
    ghost.outer_inner = lambda *a: calls.append(a[1].shape) or kernel(*a)
    try:
        got = ClippingEngine(model, ghost="ghost", kernels="triton").per_example_norms(loss, batch)
    finally:
        ghost.outer_inner = kernel
    want = ClippingEngine(model, ghost="ghost", kernels="torch").per_example_norms(loss, batch)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    # both convolutions (T = 64 and 9 positions, in = 27 and 72) and the linear
    assert sorted(calls) == sorted([(3, 64, 27), (3, 9, 72), (3, 1, 36)])
