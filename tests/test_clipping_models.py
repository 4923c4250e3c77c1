"""Whole models through the clipping engine, as users build them.

- transformers GPT-2 (tiny config, tied wte/lm_head, eager attention, Conv1D layers, broadcast
  position ids) with an attention mask and right padding;
- timm ``nf_resnet50`` exactly as ``timm.create_model`` returns it (53 ScaledStdConv2d + one
  Linear, in-place ReLUs, train mode) — where Opacus 1.6 fails in both ghost and hooks modes.

Per-example norms and clipped sums are compared with per-example gradients from a loop of
``torch.autograd.grad`` over the examples of one batched forward.
"""

from __future__ import annotations

import collections
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dptrain.clipping import ClippingEngine, per_example_grad_norms


def loop_grads(model: nn.Module, loss_fn, batch) -> torch.Tensor:
    """(B, P) per-example gradients: one batched forward, one backward per example."""
    params = [p for p in model.parameters() if p.requires_grad]
    losses = loss_fn(model, batch)
    rows = []
    for b in range(losses.shape[0]):
        g = torch.autograd.grad(losses[b], params, retain_graph=True, allow_unused=True)
        rows.append(torch.cat([(x if x is not None else torch.zeros_like(p)).reshape(-1)
                               for x, p in zip(g, params)]))
    return torch.stack(rows)


def flat(acc: dict, model: nn.Module) -> torch.Tensor:
    return torch.cat([acc[n].reshape(-1) for n, p in model.named_parameters() if p.requires_grad])


def compare(model, loss_fn, batch, ref: torch.Tensor, rtol: float, policies, modes) -> None:
    """Per-example norms (relative error <= rtol per example) under each norm policy, and
    clipped sums under each (policy, mode) with C = half the smallest norm, so that EVERY
    example is clipped and the sum checks every example's norm too."""
    ref = ref.double()
    rn = ref.norm(dim=1)
    C = 0.5 * float(rn.min())
    lam = (C / rn.clamp_min(1e-30)).clamp(max=1.0)
    ref_sum = (ref * lam[:, None]).sum(0)
    scale = float((lam * rn).sum())
    for policy in policies:
        norms = ClippingEngine(model, ghost=policy).per_example_norms(loss_fn, batch).double()
        assert bool(((norms - rn).abs() <= rtol * rn).all()), (policy, norms, rn)
    for policy, mode in modes:
        acc: dict = {}
        ClippingEngine(model, clip_norm=C, ghost=policy, mode=mode).accumulate(loss_fn, batch, acc)
        err = float((flat(acc, model).double() - ref_sum).norm())
        assert err <= rtol * scale, (policy, mode, err / scale)


# ---------------------------------------------------------------------------------------------
# GPT-2


def tiny_gpt2(dtype):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=61, n_positions=16,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True,
                     bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel._from_config(cfg, attn_implementation="eager").to(dtype)
    model.train()
    assert model.lm_head.weight is model.transformer.wte.weight
    return model


def gpt2_batch(B=4, T=10, V=61):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, V, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    for b, length in enumerate([T, 7, 4, 2][:B]):  # right padding
        mask[b, length:] = 0
        ids[b, length:] = 0
    return ids, mask


def gpt2_loss(model, batch):
    ids, mask = batch
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
    tgt, keep = ids[:, 1:], mask[:, 1:].to(logits.dtype)
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), reduction="none")
    return (ce.view(tgt.shape) * keep).sum(1)


@pytest.fixture()
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("dtype,rtol", [(torch.float64, 1e-10), (torch.float32, 1e-4)])
def test_gpt2_tied_eager_padded(dtype, rtol, one_thread):
    model = tiny_gpt2(dtype)
    batch = gpt2_batch()
    ref = loop_grads(model, gpt2_loss, batch)
    if dtype == torch.float64:  # every form and mode, tightly
        policies = ("ghost", "instantiate")
        modes = [("ghost", "bookkeeping"), ("instantiate", "two_pass"), ("auto", "bookkeeping")]
    else:  # the defaults, at float32 precision
        policies, modes = ("auto",), [("auto", "bookkeeping")]
    compare(model, gpt2_loss, batch, ref, rtol, policies, modes)
    # the public function (CONTRACT.md)
    norms = per_example_grad_norms(model, gpt2_loss, batch).double()
    assert torch.allclose(norms, ref.double().norm(dim=1), rtol=rtol, atol=0)


# ---------------------------------------------------------------------------------------------
# nf_resnet50


@pytest.fixture(scope="module")
def nf_resnet50():
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("nf_resnet50", num_classes=10)
    model.train()
    g = torch.Generator().manual_seed(2)
    batch = (torch.randn(3, 3, 32, 32, generator=g), torch.tensor([1, 7, 3]))
    # reference in float64 on a copy: float32 autograd through timm's weight standardisation
    # (batch_norm over each filter) is itself ~3e-5 off in the norms at this depth
    ref_model = timm.create_model("nf_resnet50", num_classes=10)
    ref_model.load_state_dict(model.state_dict())
    ref_model.double().train()
    ref = loop_grads(ref_model, ce_loss, (batch[0].double(), batch[1]))
    return model, batch, ref


def ce_loss(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y, reduction="none")


def test_nf_resnet50_contents_all_handled_by_rules(nf_resnet50):
    """What the model holds: 53 ScaledStdConv2d (weight, bias, gain) + 1 Linear own every
    parameter; 16 in-place ReLUs; no BatchNorm, no SE/attention, no bare parameters. Every
    parameter-owning module has a rule: no torch.func fallback."""
    from timm.layers import ScaledStdConv2d

    model, _, _ = nf_resnet50
    owners = collections.Counter()
    for m in model.modules():
        if any(p is not None for p in m._parameters.values()):
            owners[type(m)] += 1
    assert owners == {ScaledStdConv2d: 53, nn.Linear: 1}
    assert sum(1 for m in model.modules() if getattr(m, "inplace", False)) == 16
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback would warn
        ClippingEngine(model)


def test_nf_resnet50_as_is_norms_and_clipped_sums(nf_resnet50):
    model, batch, ref = nf_resnet50
    # one small case: ghost norms of every layer, and the default (auto: the stem and early
    # stages instantiated through the vmapped VJP, the rest ghost) clipped sum by book-keeping,
    # every example clipped. Every (policy, mode) pair is covered per layer in
    # test_clipping_rules.py.
    compare(model, ce_loss, batch, ref, 1e-4, ("ghost",), [("auto", "bookkeeping")])


@pytest.mark.parametrize("policy", ["ghost", "instantiate"])
@pytest.mark.parametrize("states", [1, 2])
def test_bf16_autocast_clips_what_it_adds_to_exactly_c(policy, states, one_thread):
    """Under ``performance.dtype=bfloat16`` the forward runs in bf16, but the norms and the
    clipped sum must be computed from the same float32 factors: a clipped example then adds a
    vector of norm exactly C (to float32 rounding). Norms from Gram products that autocast
    rounds to bf16 miss by ~1e-3 relative, and a clipped example would add more than C."""
    from dptrain.clipping import ClippingEngine

    model = tiny_gpt2(torch.float32)
    ids, mask = gpt2_batch(B=4)
    theta1 = {n: p.detach() + 0.02 * torch.randn_like(p) for n, p in model.named_parameters()}
    plan = [(1.0, None)] if states == 1 else [(0.5, None), (0.5, theta1, 7)]
    C = 1e-3  # far below every example's norm: every example is clipped
    for b in range(4):
        one = (ids[b:b + 1], mask[b:b + 1])
        engine = ClippingEngine(model, clip_norm=C, ghost=policy)
        acc: dict = {}
        with torch.autocast("cpu", dtype=torch.bfloat16):
            engine.accumulate(gpt2_loss, one, acc, plan)
        added = torch.cat([v.reshape(-1).double() for v in acc.values()]).norm()
        assert abs(float(added) / C - 1) < 1e-5, (b, float(added) / C)


def test_two_pass_with_bf16_autocast_is_refused():
    from dptrain.config import ConfigError
    from dptrain.performance import PerformanceConfig

    with pytest.raises(ConfigError, match="bookkeeping"):
        PerformanceConfig(dtype="bfloat16", clipping="two_pass").validate()
    PerformanceConfig(dtype="bfloat16", clipping="bookkeeping").validate()


@pytest.mark.parametrize("policy", ["ghost", "instantiate"])
@pytest.mark.parametrize("states", [1, 2])
def test_nf_resnet_bf16_autocast_clips_what_it_adds_to_exactly_c(policy, states, one_thread):
    """NF-ResNet under ``performance.dtype=bfloat16``: its convs' inputs are bf16 tensors made
    by timm's in-place ReLU, and the engine hands the rules float32 copies of half tensors (a
    copy has a fresh version counter). The rules must neither refuse them as 'modified in
    place' (they did: every bottleneck's conv2) nor read P off a bf16 output (bf16 rounding in
    the norm only: a clipped example added C * (1 + 1e-5))."""
    import timm

    import dptrain.models.nf_tiny  # noqa: F401  (registers nf_resnet_tiny)

    torch.manual_seed(0)
    model = timm.create_model("nf_resnet_tiny", num_classes=5).train()
    x, y = torch.randn(3, 3, 32, 32), torch.tensor([0, 3, 4])
    theta1 = {n: p.detach() + 0.02 * torch.randn_like(p) for n, p in model.named_parameters()}
    plan = [(1.0, None)] if states == 1 else [(0.5, None), (0.5, theta1)]
    C = 1e-4  # far below every example's norm: every example is clipped
    for b in range(3):
        engine = ClippingEngine(model, clip_norm=C, ghost=policy)
        acc: dict = {}
        with torch.autocast("cpu", dtype=torch.bfloat16):
            engine.accumulate(ce_loss, (x[b:b + 1], y[b:b + 1]), acc, plan)
        added = torch.cat([v.reshape(-1).double() for v in acc.values()]).norm()
        assert abs(float(added) / C - 1) < 1e-6, (b, float(added) / C)


class _DoubledConv(nn.Conv2d):
    """A Conv2d subclass whose forward the conv rule does not recognise: torch.func fallback."""

    def forward(self, x):
        return super().forward(x) * 2


@pytest.mark.parametrize("states", [1, 2])
def test_func_fallback_under_bf16_autocast_clips_to_exactly_c(states, one_thread):
    """The torch.func fallback gets bf16 inputs under autocast and float32 parameters; it
    failed with a dtype mismatch. A clipped example must add exactly C, as for every rule."""
    torch.manual_seed(0)
    # the fallback layer's input is the first conv's output: bf16 under autocast
    model = nn.Sequential(nn.Conv2d(3, 4, 3), _DoubledConv(4, 4, 3), nn.ReLU(), nn.Flatten(),
                          nn.Linear(4 * 4 * 4, 5))
    x, y = torch.randn(3, 3, 8, 8), torch.tensor([0, 3, 4])
    theta1 = {n: p.detach() + 0.02 * torch.randn_like(p) for n, p in model.named_parameters()}
    plan = [(1.0, None)] if states == 1 else [(0.5, None), (0.5, theta1)]
    C = 1e-4
    for b in range(3):
        with pytest.warns(UserWarning, match="fallback"):  # (said when the engine is built)
            engine = ClippingEngine(model, clip_norm=C, ghost="instantiate")
        acc: dict = {}
        with torch.autocast("cpu", dtype=torch.bfloat16):
            engine.accumulate(ce_loss, (x[b:b + 1], y[b:b + 1]), acc, plan)
        added = torch.cat([v.reshape(-1).double() for v in acc.values()]).norm()
        assert abs(float(added) / C - 1) < 1e-6, (b, float(added) / C)
