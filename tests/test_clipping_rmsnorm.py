"""The RMSNorm rule (dptrain/clipping/rules.py) against per-example reference gradients.

- torch's ``nn.RMSNorm`` (one or two normalised dimensions, eps given or the dtype's);
- transformers' RMSNorm classes of the five forms the rule recognises by their code (Llama's,
  copied into Mistral, Qwen2, Qwen3, ...; GPT-OSS's; Helium's; Gemma's ``(1 + w)``; Gemma 3n's
  ``pow(-0.5)``), each class checked to be recognised, not left to the torch.func fallback;
- a class whose forward differs from its form in one operation, or that has another parameter
  or no float epsilon, is not recognised (the fallback, still exact);
- transformers' scaled word embeddings (Gemma's, BART's and BioGPT's), recognised the same way;
- whole tiny Llama, Qwen2 and Gemma language models with right padding, tied and untied heads,
  and a two-state inner-momentum query, against a loop of single-example gradients.

transformers' RMSNorms normalise in float32 whatever the model's dtype, so a float64 model's
gradients carry float32 rounding (about 1e-8 relative, in the reference as in the engine): the
float64 checks through them allow 1e-6, against 1e-9 for torch's nn.RMSNorm. A wrong epsilon,
weight form or cast is off by far more (eps = 0.05 here).
"""

from __future__ import annotations

import importlib
import warnings

import pytest
import torch
from torch import nn

from _reference import reference_grads
from _threads import _one_thread  # noqa: F401  (autouse: one torch thread)
from test_clipping_models import compare, gpt2_batch, gpt2_loss, loop_grads
import test_clipping_rules
from test_clipping_rules import check

from dptrain.clipping import ClippingEngine
from dptrain.clipping.rules import (
    FALLBACK,
    RMSNormRule,
    ScaledEmbeddingRule,
    _scaled_embedding_scale,
    _transformers_rmsnorm_form,
)


def _sandwich(norm: nn.Module, d: int, dtype, seed: int) -> tuple[nn.Module, tuple]:
    """Linear -> norm -> Linear over (B, T, d) tokens, the norm's weight drawn away from its
    initialisation (ones, or Gemma's zeros), and a regression batch."""
    gen = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Linear(d, d), norm, nn.Linear(d, 3)).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(norm.weight.shape, generator=gen) + 0.5)
    x = torch.randn(5, 4, d, generator=gen, dtype=dtype)
    y = torch.randn(5, 4, 3, generator=gen, dtype=dtype)
    return model, (x, y)


@pytest.fixture()
def float32_path(monkeypatch):
    """Float64 tolerance of models whose norms compute in float32 (module docstring)."""
    monkeypatch.setitem(test_clipping_rules.RTOL, torch.float64, 1e-6)


def _rule_of(model: nn.Module, index: int):
    engine = ClippingEngine(model)
    return {h.module: h.rule for h in engine.hooked}[model[index]]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("shape,eps", [((6,), 1e-5), ((6,), None), ((4, 6), 1e-3)])
def test_torch_rmsnorm(dtype, shape, eps):
    gen = torch.Generator().manual_seed(3)
    norm = nn.RMSNorm(shape, eps=eps)
    model = nn.Sequential(nn.Linear(6, 6), norm, nn.Linear(6, 2)).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(shape, generator=gen) + 0.5)
    x = torch.randn(5, 4, 6, generator=gen, dtype=dtype)
    y = torch.randn(5, 4, 2, generator=gen, dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback
        assert isinstance(_rule_of(model, 1), RMSNormRule)
        check(model, (x, y))


#: (transformers module, class, form, constructor keywords)
TRANSFORMERS_NORMS = [
    ("llama", "LlamaRMSNorm", "llama", {}),
    ("mistral", "MistralRMSNorm", "llama", {}),
    ("qwen2", "Qwen2RMSNorm", "llama", {}),
    ("qwen3", "Qwen3RMSNorm", "llama", {}),
    ("gpt_oss", "GptOssRMSNorm", "gptoss", {}),
    ("helium", "HeliumRMSNorm", "helium", {}),
    ("gemma", "GemmaRMSNorm", "gemma", {}),
    ("gemma3n", "Gemma3nRMSNorm", "gemma3n", {}),
]


def _transformers_class(module: str, name: str):
    mod = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    return getattr(mod, name)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("module,name,form,kwargs", TRANSFORMERS_NORMS,
                         ids=[t[1] for t in TRANSFORMERS_NORMS])
def test_transformers_rmsnorm_forms(module, name, form, kwargs, dtype, float32_path):
    """Each class is recognised as its form (none goes to the fallback: the installed
    transformers still writes them as the rule's copies do), and its per-example norms and
    clipped sums equal the reference, with eps large enough to matter."""
    cls = _transformers_class(module, name)
    norm = cls(6, eps=0.05, **kwargs)
    assert _transformers_rmsnorm_form(norm) == form
    model, batch = _sandwich(norm, 6, dtype, seed=len(name))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback
        assert isinstance(_rule_of(model, 1), RMSNormRule)
        check(model, batch)


def test_half_inputs_follow_each_forms_casts():
    """In bfloat16, Llama's form rounds xhat to the input's dtype before the weight, the
    others multiply in float32: the rule's per-example gradient of a bf16 model equals
    autograd's of one example to bf16 rounding (the engine works on float32 copies)."""
    for module, name, _form, kwargs in TRANSFORMERS_NORMS:
        norm = _transformers_class(module, name)(6, eps=1e-6, **kwargs)
        model, (x, y) = _sandwich(norm, 6, torch.float64, seed=1)
        model = model.to(torch.bfloat16)
        x, y = x.to(torch.bfloat16), y.to(torch.bfloat16)

        def loss_fn(m, batch):
            out = m(batch[0]).float()
            return 0.5 * (out - batch[1].float()).pow(2).flatten(1).sum(1)

        ref = loop_grads(model, loss_fn, (x, y)).float()
        got = ClippingEngine(model).per_example_norms(loss_fn, (x, y))
        rel = ((got.float() - ref.norm(dim=1)).abs() / ref.norm(dim=1)).max()
        assert float(rel) < 2e-2, (name, float(rel))


class _DoubledLlamaNorm(nn.Module):
    """Llama's form with the output doubled: one operation away from it."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.variance_epsilon = 1e-6

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return 2 * self.weight * hidden_states.to(input_dtype)


def test_other_forwards_are_not_recognised(float32_path):
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    class ScaledRMSNorm(LlamaRMSNorm):  # a subclass that changes the output
        def forward(self, hidden_states):
            return super().forward(hidden_states) * 3

    class BiasedRMSNorm(LlamaRMSNorm):  # Llama's forward, and a parameter the rule ignores
        def __init__(self, d):
            super().__init__(d)
            self.bias = nn.Parameter(torch.zeros(d))

    class CentredGemmaRMSNorm(GemmaRMSNorm):  # Gemma's forward, another _norm
        def _norm(self, x):
            x = x - x.mean(-1, keepdim=True)
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    tensor_eps = LlamaRMSNorm(6)
    tensor_eps.variance_epsilon = torch.tensor(1e-6)  # not a number the rule can read
    for norm in (_DoubledLlamaNorm(6), ScaledRMSNorm(6), BiasedRMSNorm(6),
                 CentredGemmaRMSNorm(6), tensor_eps):
        assert _transformers_rmsnorm_form(norm) is None, type(norm).__name__
        model, batch = _sandwich(norm, 6, torch.float64, seed=2)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert _rule_of(model, 1) is FALLBACK
        assert any("fallback" in str(w.message) for w in caught)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            check(model, batch, policies=("auto",), modes=("bookkeeping",))
    # the recognised class itself, for contrast
    assert _transformers_rmsnorm_form(LlamaRMSNorm(6)) == "llama"


class _Pow4GemmaRMSNorm(nn.Module):
    """Gemma's form token for token, but for one constant of its ``_norm`` (x^4, not x^2)."""

    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(d))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(4).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        output = self._norm(x.float())
        output = output * (1.0 + self.weight.float())
        return output.type_as(x)


class _QuarterGemma3nRMSNorm(nn.Module):
    """Gemma 3n's form, but for its float constant (mean_squared^-0.25, not ^-0.5)."""

    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.with_scale = True
        self.weight = nn.Parameter(torch.ones(d))

    def _norm(self, hidden_states):
        mean_squared = hidden_states.pow(2).mean(-1, keepdim=True) + self.eps
        return hidden_states * torch.pow(mean_squared, -0.25)

    def forward(self, hidden_states):
        normed_output = self._norm(hidden_states.float())
        if self.with_scale:
            normed_output = normed_output * self.weight.float()
        return normed_output.type_as(hidden_states)


@pytest.mark.parametrize("cls", [_Pow4GemmaRMSNorm, _QuarterGemma3nRMSNorm])
def test_a_form_with_another_constant_is_not_recognised(cls, float32_path):
    # the same operations on the same names, one constant changed: only the code's constants
    # tell it from its form. (Gemma's forward's 1.0 would not do: (c + w) has the same weight
    # gradient for every c.)
    norm = cls(6)
    assert _transformers_rmsnorm_form(norm) is None
    model, batch = _sandwich(norm, 6, torch.float64, seed=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert _rule_of(model, 1) is FALLBACK
        check(model, batch, policies=("auto",), modes=("bookkeeping",))


def test_llama_form_gradient_in_bfloat16_is_exact():
    """Llama's form rounds xhat to the input's dtype before the weight: with one token per
    example and output gradients that are powers of two, the per-example weight gradient of a
    bf16 model is exact (every product exact) in the reference and in the engine, and equal;
    without the rounding it was off by bf16's 2^-9 (the looser test above allows 2e-2)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    gen = torch.Generator().manual_seed(8)
    norm = LlamaRMSNorm(6, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(6, generator=gen) + 0.5)
    norm = norm.to(torch.bfloat16)
    x = torch.randn(5, 1, 6, generator=gen).to(torch.bfloat16)
    sign = torch.randint(0, 2, (5, 1, 6), generator=gen) * 2 - 1
    S = sign * 2.0 ** torch.randint(-2, 3, (5, 1, 6), generator=gen)

    def linear_loss(m, b):  # its output gradient is b[1], exactly (a power of two: in bf16)
        return (m(b[0]).float() * b[1]).flatten(1).sum(1)

    ref = reference_grads(norm, linear_loss, (x, S))  # torch.func, in bf16
    assert ref.dtype == torch.bfloat16
    ref = ref.float()
    got = ClippingEngine(norm).per_example_norms(linear_loss, (x, S))
    torch.testing.assert_close(got.float(), ref.norm(dim=1), rtol=1e-6, atol=0)
    for b in range(5):  # one example, unclipped: its gradient itself
        acc = {}
        ClippingEngine(norm, clip_norm=1e9, mode="bookkeeping").accumulate(
            linear_loss, (x[b:b + 1], S[b:b + 1]), acc)
        torch.testing.assert_close(acc["weight"].float(), ref[b], rtol=0, atol=0)


class _EmbedHead(nn.Module):
    """A scaled word embedding, then a linear head over each token."""

    def __init__(self, emb: nn.Embedding, classes: int = 3):
        super().__init__()
        self.emb, self.head = emb, nn.Linear(emb.embedding_dim, classes)

    def forward(self, ids):
        return self.head(torch.tanh(self.emb(ids)))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("module,name,scale", [
    ("gemma", "GemmaTextScaledWordEmbedding", 2.5),
    ("bart", "BartScaledWordEmbedding", 2.5),
    ("biogpt", "BioGptScaledWordEmbedding", 0.75),
])
def test_transformers_scaled_word_embeddings(module, name, scale, dtype):
    emb = _transformers_class(module, name)(9, 4, 0, embed_scale=scale)  # padding id 0
    model = _EmbedHead(emb).to(dtype)
    assert float(_scaled_embedding_scale(model.emb)) == scale
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 9, (5, 6), generator=gen)
    ids[0, :2] = 0  # padding rows get no gradient
    y = torch.randn(5, 6, 3, generator=gen, dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback
        assert isinstance({h.module: h.rule for h in ClippingEngine(model).hooked}[model.emb],
                          ScaledEmbeddingRule)
        check(model, (ids, y))


def test_other_embedding_forwards_are_not_recognised():
    from transformers.models.bart.modeling_bart import BartScaledWordEmbedding

    class ShiftedScaledWordEmbedding(BartScaledWordEmbedding):  # one operation more
        def forward(self, input_ids):
            return super().forward(input_ids) * self.embed_scale + 1

    class DeeperScaledWordEmbedding(BartScaledWordEmbedding):  # its super() is Bart's class
        def forward(self, input_ids):
            return super().forward(input_ids) * self.embed_scale

    unset = BartScaledWordEmbedding(9, 4, 0, embed_scale=None)
    for emb in (ShiftedScaledWordEmbedding(9, 4, 0, 2.0), DeeperScaledWordEmbedding(9, 4, 0, 2.0),
                unset):
        assert _scaled_embedding_scale(emb) is None, type(emb).__name__
    emb = DeeperScaledWordEmbedding(9, 4, 0, 2.0)  # the scale applied twice: fallback, exact
    model = _EmbedHead(emb).double()
    ids = torch.randint(0, 9, (4, 5), generator=torch.Generator().manual_seed(6))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check(model, (ids, torch.randn(4, 5, 3, dtype=torch.float64)), policies=("auto",),
              modes=("bookkeeping",))
    assert any("fallback" in str(w.message) for w in caught)


# ---------------------------------------------------------------------------------------------
# whole decoder language models


def _tiny_lm(kind: str, tied: bool, dtype):
    import transformers

    torch.manual_seed(0)
    common = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                  tie_word_embeddings=tied, rms_norm_eps=1e-3)
    if kind == "llama":
        cfg = transformers.LlamaConfig(**common)
        cls = transformers.LlamaForCausalLM
    elif kind == "qwen2":
        cfg = transformers.Qwen2Config(**common)
        cls = transformers.Qwen2ForCausalLM
    else:
        cfg = transformers.GemmaConfig(**common, head_dim=8)
        cls = transformers.GemmaForCausalLM
    model = cls._from_config(cfg, attn_implementation="eager").to(dtype).train()
    with torch.no_grad():  # norms' weights away from their initialisation
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(0.3 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("kind,tied", [("llama", False), ("llama", True), ("qwen2", False),
                                       ("gemma", True)])
def test_decoder_lms(kind, tied):
    model = _tiny_lm(kind, tied, torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every layer has a rule: no fallback
        engine = ClippingEngine(model)
    norms = [h for h in engine.hooked if "norm" in h.name]
    assert len(norms) == 5 and all(isinstance(h.rule, RMSNormRule) for h in norms)
    if kind == "gemma":  # its embedding is scaled by sqrt(hidden_size)
        assert isinstance(engine.hooked[0].rule, ScaledEmbeddingRule)
    batch = gpt2_batch()
    ref = loop_grads(model, gpt2_loss, batch)
    compare(model, gpt2_loss, batch, ref, 1e-6, ("ghost", "instantiate"),
            [("ghost", "bookkeeping"), ("instantiate", "two_pass"), ("auto", "bookkeeping")])


def test_llama_inner_momentum_query(float32_path):
    """u_b = 0.6 g_b(theta1) + 0.4 g_b(theta0) over a Llama with a tied head: norms and the
    clipped sum equal the reference built from each state's per-example gradients."""
    model = _tiny_lm("llama", True, torch.float64)
    batch = gpt2_batch()
    gen = torch.Generator().manual_seed(5)
    theta1 = {n: p.detach() + 0.05 * torch.randn(p.shape, generator=gen, dtype=p.dtype)
              for n, p in model.named_parameters()}
    plan = [(0.6, theta1), (0.4, None)]
    ref = 0.6 * reference_grads(model, gpt2_loss, batch, theta1) \
        + 0.4 * reference_grads(model, gpt2_loss, batch)
    check(model, batch, loss_fn=gpt2_loss, plan=plan, ref=ref)
