"""Cost of DP-Muon-IM's inner momentum: a DP step with K past states against the non-private
step, and against a straightforward IM built on per-example gradients (issue 4, Benchmarks).

    python bench/inner_momentum.py [--quick] [--device cpu|cuda] [--batch-size B] [--layers L]
        [--width D] [--heads H] [--vocab V] [--seq-len T] [--ks 0,1,2,4] [--naive both]

Model: transformers GPT2LMHeadModel sized for CPU (4 layers, width 256, 4 heads, vocabulary
8,192, T = 64, microbatch B = 16, tied embeddings, eager attention, dropout 0); every variant
gets a fresh model with the same weights and the same batch. Per-example loss: mean token loss.

Variants (plain SGD updates everywhere; C = 1, sigma = 1):

- nonprivate: ``loss.mean().backward()`` + SGD step;
- k0, k1, k2, k4: one DP-Muon-IM step with K past states, K_M = K_A = K, gamma_M = gamma_A =
  0.5, parameters split by the gpt2 preset (block matrices: the Muon history; wte/wpe, biases
  and norms: the other history). The history is a real ``InnerMomentumHistory``, pre-filled
  with K perturbed copies of the parameters (theta + 1e-3 * N(0, 1)) so that every timed step
  evaluates K + 1 states; each step is ``plan = history.plan(t)`` -> ``engine.accumulate`` over
  the microbatch with that plan -> ``history.push()`` -> Gaussian noise sigma*C*Z on every
  coordinate (dptrain.privacy.noise) -> / B -> SGD step. k0 is DP-Muon's query (plan [(1, None)]);
  the Muon/AdamW update itself is the same for every K and is left out (SGD), so the ratios
  isolate the query's cost;
- k4_split2: K = 4 with the microbatch split in two halves (two ``accumulate`` calls, one
  release): the memory/time trade of a smaller microbatch;
- kK_ghost (``--ghost-ks``): K with every layer's norm in ghost form (performance.ghost=ghost)
  instead of the engine's cost model, which picks per-example instantiation for most layers at
  two or more states (its constant is a CPU measurement);
- kK_memory (``--memory-ks``): K with performance.ghost=memory, per parameter the form that
  holds fewer bytes (its per-example buffer or the states' captured factors);
- naive_k4 (the issue's baseline): the same K = 4 query built the straightforward way on Opacus
  1.6 per-example gradients: ``GradSampleModule`` (hooks mode, loss_reduction "sum") on the copy
  of the model Opacus accepts (Conv1D -> Linear, untied lm_head, explicit position_ids, as
  bench/dp_step.py), one forward + backward per state with that state's values copied in,
  u_b += alpha_j * grad_sample per parameter (the wte and lm_head parts summed: one tied
  parameter), then norms, clip factors, the clipped sum, noise and the step;
- naive_vmap_k4: the same with torch.func ``vmap(grad(functional_call))`` per state on the stock
  model (faster than Opacus here; reported next to it).

All DP variants compute the same update (tests/test_bench_inner_momentum.py checks it).

Noise (``--noise``): by default ("ahead") every variant draws its release's noise once, when it
is built, and its steps reuse it: a step here is one microbatch, while a real release follows a
logical batch of many, during which the trainer draws the noise on a background thread
(performance.noise_prefetch). ``noise_draw_s`` reports the draw's own wall time on this machine.
``--noise in_step`` draws it in every step (the numbers before 2026-11-30).

Times: interleaved rounds (bench/common.py), medians of wall and process-CPU time; ratios are
ratios of medians measured in the same run. At least 3 rounds, then more (up to 9) while the
next fits in the run's budget (330 s with the memory processes, which run first); ``--rounds``
fixes the number. marginal_over_nonprivate[K] = (t_K - t_0) / K over
the non-private step time. On CPU torch runs one thread by default (``--threads 0``: torch's
default): on a shared 2-core machine one thread per process is the steadier measurement.
Peak memory: on CPU each variant in a fresh subprocess (two at a time), on CUDA one after
another in this process (the allocator's peak resets; ``run_memory_inprocess``); the baseline is taken
after the model and batch are built, and the history's K states are created after it, so a
peak counts the history, the captured activations, gradients and per-example buffers, but not
the model's weights (``memory_with_weights_over_k0`` adds them back). CPU: resident set;
CUDA: ``torch.cuda.max_memory_allocated``. The last line printed is one JSON object (keys
documented in ``summarize``).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import re
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    LiveTensorPeak,
    StepFn,
    child_peak,
    emit_child_result,
    first_line,
    git_commit,
    load_average,
    machine_description,
    measure_peak_in_subprocess,
    median,
    now_utc,
    ratio_of_medians,
    time_interleaved,
)
from gpt2_bench import _fmt, _le, build_gpt2, gpt2_batch, opacus_gpt2  # noqa: E402

# Targets of issue 4.
TARGET_MARGINAL = 1.0  # (t_K - t_0) / K over the non-private step
TARGET_MEMORY_K4 = 1.6  # peak at K = 4 over K = 0
TARGET_NAIVE_OVER_DPTRAIN = 2.0

PAPER = {  # Bhusal et al., E2E, GPT-2 small, one H100
    "minutes": {"0": 36.9, "1": 59.0, "4": 123.7},
    "peak_gib": {"without_history": 26.70, "with_history": 49.85},
}


@dataclass
class GPT2Shape:
    num_layers: int = 4
    width: int = 256
    num_heads: int = 4
    vocab_size: int = 8192
    seq_len: int = 64  # T
    batch_size: int = 16  # B (one microbatch)


@dataclass
class BenchConfig:
    gpt2: GPT2Shape = field(default_factory=GPT2Shape)
    ks: list[int] = field(default_factory=lambda: [0, 1, 2, 4])
    gamma: float = 0.5
    naive: list[str] = field(default_factory=lambda: ["opacus", "vmap"])
    naive_k: int = 4
    split: int = 2  # also K = max(ks) with the microbatch split in this many parts (<= 1: no)
    perturb: float = 1e-3  # past states: theta + perturb * N(0, 1)
    rounds: int = 3  # at least this many timed rounds (every variant once per round)
    max_rounds: int = 9  # ... and more while they fit in budget_s
    budget_s: float = 330.0  # the whole run (memory processes first, then rounds): < 6 min
    noise: str = "ahead"  # "ahead" or "in_step" (see NoiseSource)
    ghost_ks: list[int] = field(default_factory=list)  # also these K with performance.ghost=ghost
    memory_ks: list[int] = field(default_factory=list)  # ... and with performance.ghost=memory
    warmup: int = 1
    memory: bool = True
    memory_steps: int = 2
    device: str = "cpu"
    threads: int | None = 1  # torch threads; None: torch's default
    parallel_memory: int = 2  # peak-memory child processes at a time
    clip_norm: float = 1.0
    noise_multiplier: float = 1.0
    lr: float = 1e-3
    seed: int = 0
    lora: int = 0  # > 0: LoRA adapters of this rank on every block matrix, the rest frozen

    @classmethod
    def from_json(cls, text: str) -> "BenchConfig":
        d = json.loads(text)
        return cls(gpt2=GPT2Shape(**d.pop("gpt2")), **d)

    def variants(self) -> list[str]:
        out = ["nonprivate"] + [f"k{k}" for k in self.ks]
        if self.split > 1 and max(self.ks) > 0:
            out.append(f"k{max(self.ks)}_split{self.split}")
        out += [f"k{k}_ghost" for k in self.ghost_ks]
        out += [f"k{k}_memory" for k in self.memory_ks]
        out += [naive_variant(n, self.naive_k) for n in self.naive]
        return out


def build_model(cfg: BenchConfig, device: str | None = None) -> nn.Module:
    """The benchmark's GPT-2; with ``cfg.lora``, ``model.lora``'s adapters (rank cfg.lora,
    alpha 2r) on c_attn, c_proj and c_fc and everything else frozen, so that the query, its
    per-example buffer and the history cover the adapters alone."""
    model = build_gpt2(cfg.gpt2, cfg.seed, device or cfg.device)
    if cfg.lora:
        from dptrain.models.finetune import LoRAConfig, apply_finetuning

        apply_finetuning(model, LoRAConfig(r=cfg.lora, alpha=2 * cfg.lora,
                                           target_modules=["c_attn", "c_proj", "c_fc"]), None)
    return model


def naive_variant(kind: str, K: int) -> str:
    return f"naive_k{K}" if kind == "opacus" else f"naive_{kind}_k{K}"


# ---------------------------------------------------------------------------------------------
# model, batch, loss


def token_losses(logits: Tensor, ids: Tensor) -> Tensor:
    """Per-example mean next-token loss from (B, T, V) logits."""
    logits = logits[:, :-1]
    B, Tm1, V = logits.shape
    tok = F.cross_entropy(logits.reshape(-1, V), ids[:, 1:].reshape(-1), reduction="none")
    return tok.view(B, Tm1).mean(1)


def gpt2_loss(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    return token_losses(model(**batch).logits, batch["input_ids"])


def muon_names(named: list[tuple[str, Tensor]]) -> set[str]:
    """The gpt2 preset's Muon group (dptrain.optim.groups.gpt2_groups): matrices of the blocks."""
    from dptrain.optim.groups import ParamGroupConfig, gpt2_groups

    groups = gpt2_groups(named, ParamGroupConfig(pattern=".", optimizer="muon"),
                         ParamGroupConfig(pattern=".", optimizer="adamw"))
    main = next((g for g in groups if g.name == "matrices"), None)
    return {n for n, _ in named if main is not None and re.search(main.pattern, n)}


def make_history(named: list[tuple[str, nn.Parameter]], K: int, cfg: BenchConfig):
    """An InnerMomentumHistory with K_M = K_A = K, pre-filled with K perturbed past states."""
    from dptrain.optim.inner_momentum import InnerMomentumConfig, InnerMomentumHistory

    im = InnerMomentumConfig(k_muon=K, gamma_muon=cfg.gamma, k_other=K, gamma_other=cfg.gamma)
    hist = InnerMomentumHistory(im, named, muon_names(named), cfg.seed)
    g = torch.Generator().manual_seed(cfg.seed + 2)
    for _ in range(K):
        with torch.no_grad():
            hist.states.appendleft({
                n: p.detach() + cfg.perturb * torch.randn(p.shape, generator=g).to(p)
                for n, p in named})
    return hist


def _draw_noise(cfg: BenchConfig, t: int, name: str, like: Tensor) -> Tensor:
    from dptrain.privacy.noise import gaussian_noise

    z = gaussian_noise(cfg.seed, t, name, like.numel(), device=like.device, dtype=like.dtype)
    return z.view_as(like)


class NoiseSource:
    """Z of a release, per parameter. ``cfg.noise == "in_step"``: drawn in the step (dptrain's
    counter-based CPU draw, then copied to the device), as a release that no microbatch hides;
    ``"ahead"``: drawn once when the variant is built (before the peak-memory baseline) and
    reused. The trainer draws a release's noise on a background thread while the logical
    batch's microbatches run on the GPU (performance.noise_prefetch), so that with "ahead" a
    step here, one microbatch, times the query and the release's arithmetic alone."""

    def __init__(self, cfg: BenchConfig, params: dict[str, Tensor]):
        self.cfg = cfg
        self.cache: dict[str, Tensor] = {}
        if cfg.noise == "ahead":
            for n, p in params.items():
                self.cache[n] = _draw_noise(cfg, 0, n, torch.empty_like(p, dtype=torch.float32))

    def __call__(self, t: int, name: str, like: Tensor) -> Tensor:
        if self.cfg.noise == "in_step":
            return _draw_noise(self.cfg, t, name, like)
        return self.cache[name]


def _release_and_step(params: dict[str, nn.Parameter], acc: dict[str, Tensor], t: int,
                      cfg: BenchConfig, B: int, opt: torch.optim.Optimizer,
                      noise: NoiseSource) -> None:
    """p.grad = (sum + sigma*C*Z) / B on every coordinate, then the optimizer step."""
    std = cfg.noise_multiplier * cfg.clip_norm
    for name, p in params.items():
        s = acc.pop(name, None)
        if s is None:
            s = torch.zeros_like(p, dtype=torch.float32)
        p.grad = s.add_(noise(t, name, s), alpha=std).div_(B).to(p.dtype)
    opt.step()
    for p in params.values():  # as the non-private step's zero_grad(set_to_none=True): the
        p.grad = None          # released gradients do not live on through the next step


def noise_draw_seconds(cfg: BenchConfig, repeats: int = 3) -> float:
    """Median wall time of drawing one release's noise for the model's trainable parameters
    (dptrain.privacy.noise, copied to the device): the per-release cost that ``noise="ahead"``
    leaves out of the steps."""
    with torch.device("meta"):
        model = build_model(cfg, "meta")
    shapes = {n: p.shape for n, p in model.named_parameters() if p.requires_grad}
    times = []
    for r in range(repeats):
        t0 = time.perf_counter()
        for name, shape in shapes.items():
            _draw_noise(cfg, r, name, torch.empty(shape, device=cfg.device))
        if cfg.device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return median(times)


# ---------------------------------------------------------------------------------------------
# step functions


def nonprivate_step(model: nn.Module, batch, cfg: BenchConfig) -> StepFn:
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)

    def step():
        opt.zero_grad(set_to_none=True)
        gpt2_loss(model, batch).mean().backward()
        opt.step()

    step.params = lambda: {n: p.detach() for n, p in model.named_parameters()}
    return step


def _lazy(make, params):
    """A step whose set-up (the history) happens on its first call: the peak-memory child takes
    its baseline after the model is built and before the history exists. ``step.params()``
    returns the trained parameters in the stock model's names and layout (for tests)."""
    box: list = []

    def step():
        if not box:
            box.append(make())
        box[0]()

    step.params = params
    return step


def dptrain_step(model: nn.Module, batch, K: int, cfg: BenchConfig, split: int = 1,
                 ghost: str = "auto") -> StepFn:
    """plan -> accumulate (over ``split`` parts of the microbatch) -> push -> noise -> SGD.
    ``ghost``: the engine's per-layer norm form (performance.ghost; "auto": its cost model)."""
    from dptrain.clipping import ClippingEngine

    engine = ClippingEngine(model, clip_norm=cfg.clip_norm, ghost=ghost)
    noise = NoiseSource(cfg, engine.params)
    params = engine.params
    opt = torch.optim.SGD(list(params.values()), lr=cfg.lr)
    B = cfg.gpt2.batch_size
    parts = [{"input_ids": ids} for ids in batch["input_ids"].chunk(max(split, 1))]

    def make():
        hist = make_history(list(params.items()), K, cfg)
        counter = [K]

        def step():
            t = counter[0]
            counter[0] += 1
            plan = hist.plan(t)
            assert len(plan) == K + 1
            acc: dict[str, Tensor] = {}  # Sensitive: unnoised clipped sum.
            for part in parts:
                engine.accumulate(gpt2_loss, part, acc, plan)
            hist.push()
            _release_and_step(params, acc, t, cfg, B, opt, noise)

        return step

    return _lazy(make, lambda: {n: p.detach() for n, p in params.items()})


def _clip_and_release(u: dict[str, Tensor], params: dict[str, nn.Parameter], t: int,
                      cfg: BenchConfig, B: int, opt, noise: NoiseSource) -> None:
    """Norms of the per-example queries u[name] (B, ...), clip factors, clipped sum, release."""
    sq = None
    for g in u.values():
        s = g.reshape(g.shape[0], -1).pow(2).sum(1)
        sq = s if sq is None else sq + s
    norms = sq.sqrt()
    lam = torch.clamp(cfg.clip_norm / norms.clamp_min(1e-12), max=1.0)
    acc = {n: torch.einsum("b...,b->...", g, lam) for n, g in u.items()}
    u.clear()
    _release_and_step(params, acc, t, cfg, B, opt, noise)


def naive_opacus_step(model: nn.Module, batch, K: int, cfg: BenchConfig) -> StepFn:
    """IM from Opacus per-example gradients (GradSampleModule hooks), one backward per state."""
    from opacus import GradSampleModule

    s = cfg.gpt2
    stock = {n: p for n, p in model.named_parameters()}
    # tied as the stock model is: Opacus' hooks accumulate a shared weight's per-sample
    # gradient over its two uses (untying would add a (B, V, d) gradient per state)
    m, pos = opacus_gpt2(model, s, untie=False)
    del model
    conv = {n for n, mod in _conv1d_params(m)}  # parameter names whose layout was transposed
    cparams = dict(m.named_parameters())  # the copy's parameters, by the stock names
    assert set(cparams) == set(stock)
    gsm = GradSampleModule(m, batch_first=True, loss_reduction="sum")
    names = list(cparams)
    opt = torch.optim.SGD([cparams[n] for n in names], lr=cfg.lr)

    def to_copy_layout(n: str, v: Tensor) -> Tensor:
        return v.T if n in conv else v

    # Z in the stock layout (the coordinates dptrain's draw is a function of), transposed
    # where the copy's layout is: the same update as dptrain's also with noise
    stock_noise = NoiseSource(cfg, stock)

    def noise(t: int, name: str, like: Tensor) -> Tensor:
        return to_copy_layout(name, stock_noise(t, name, stock[name]))

    ids = batch["input_ids"]
    B = s.batch_size

    def make():
        # the history in the stock model's names and layout, as dptrain's history holds it
        hist = make_history([(n, p) for n, p in stock.items()], K, cfg)
        counter = [K]

        @torch.no_grad()
        def load(state: dict[str, Tensor] | None, current: dict[str, Tensor]):
            for n in names:
                v = current[n] if state is None else to_copy_layout(n, state[n])
                cparams[n].copy_(v)

        def step():
            t = counter[0]
            counter[0] += 1
            plan = hist.plan(t)
            current = {n: cparams[n].detach().clone() for n in names}
            u: dict[str, Tensor] = {}  # Sensitive: per-example queries.
            for entry in plan:
                coef, state = entry[0], entry[1]
                load(state, current)
                with _forward_rng(entry, ids.device):
                    out = gsm(input_ids=ids, position_ids=pos).logits
                    token_losses(out, ids).sum().backward()
                for n, p in cparams.items():
                    a = coef.get(n, 0.0) if isinstance(coef, dict) else coef
                    gs = p.grad_sample
                    p.grad_sample = None
                    p.grad = None
                    if a == 0.0 or gs is None:
                        continue
                    if n in u:
                        u[n].add_(gs, alpha=a)
                    else:
                        u[n] = gs.mul_(a)
            load(None, current)
            # push: the pre-update state, in the stock layout (as dptrain's history holds it)
            hist.states.appendleft({n: (current[n].T if n in conv else current[n]).clone()
                                    for n in names})
            _clip_and_release(u, {n: cparams[n] for n in names}, t, cfg, B, opt, noise)

        return step

    return _lazy(make, lambda: {n: to_copy_layout(n, cparams[n].detach()) for n in names})


def naive_vmap_step(model: nn.Module, batch, K: int, cfg: BenchConfig) -> StepFn:
    """IM from torch.func per-example gradients: vmap(grad(functional_call)) per state."""
    from torch.func import functional_call, grad, vmap

    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    opt = torch.optim.SGD(list(params.values()), lr=cfg.lr)
    ids = batch["input_ids"]
    B = cfg.gpt2.batch_size
    noise = NoiseSource(cfg, params)

    def one(p, x):
        out = functional_call(model, p, (), {"input_ids": x[None]})
        return token_losses(out.logits, x[None])[0]

    per_example = vmap(grad(one), in_dims=(None, 0), randomness="different")

    def make():
        hist = make_history(list(params.items()), K, cfg)
        counter = [K]

        def step():
            t = counter[0]
            counter[0] += 1
            plan = hist.plan(t)
            u: dict[str, Tensor] = {}  # Sensitive: per-example queries.
            for entry in plan:
                coef, state = entry[0], entry[1]
                values = {n: (p.detach() if state is None else state[n]) for n, p in params.items()}
                with _forward_rng(entry, ids.device):
                    g = per_example(values, ids)
                for n, gs in g.items():
                    a = coef.get(n, 0.0) if isinstance(coef, dict) else coef
                    if a == 0.0:
                        continue
                    if n in u:
                        u[n].add_(gs, alpha=a)
                    else:
                        u[n] = gs.mul_(a)
                del g
            hist.push()
            _clip_and_release(u, params, t, cfg, B, opt, noise)

        return step

    return _lazy(make, lambda: {n: p.detach() for n, p in params.items()})


@contextlib.contextmanager
def _forward_rng(entry: tuple, device: torch.device):
    """As the engine: a plan entry's dropout seed (third element) gets its own RNG stream."""
    if len(entry) < 3:
        yield
        return
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(entry[2])
        yield


def _conv1d_params(m: nn.Module):
    """(param name, module) of the weights that opacus_gpt2 converted from Conv1D (in, out)."""
    for mname, mod in m.named_modules():
        if getattr(mod, "_from_conv1d", False):
            yield f"{mname}.weight", mod


def build_variant(variant: str, cfg: BenchConfig) -> StepFn:
    """A fresh model (same seed, same weights), the batch, and the step of ``variant``."""
    s = cfg.gpt2
    model = build_model(cfg)
    batch = gpt2_batch(s, cfg.seed, cfg.device)
    if variant == "nonprivate":
        return nonprivate_step(model, batch, cfg)
    if variant.startswith("naive_vmap_k"):
        return naive_vmap_step(model, batch, int(variant.rsplit("k", 1)[1]), cfg)
    if variant.startswith("naive_k"):
        return naive_opacus_step(model, batch, int(variant.rsplit("k", 1)[1]), cfg)
    if variant.startswith("k"):
        m = re.fullmatch(r"k(\d+)(?:_split(\d+))?(?:_(ghost|memory))?", variant)
        if m is None:
            raise ValueError(f"unknown variant {variant!r}")
        return dptrain_step(model, batch, int(m[1]), cfg, int(m[2] or 1), m[3] or "auto")
    raise ValueError(f"unknown variant {variant!r}")


def held_bytes(cfg: BenchConfig) -> dict[str, dict[str, int]]:
    """Per trainable parameter, what one evaluated state leaves to hold until the clip factors
    are known, in each of the engine's two forms (``_Query``):

    - "instantiated": the per-example buffer, B x numel at the accumulation dtype, one for all
      the states;
    - "captured": that state's factors of the parameter's contributions (its layer's captured
      input and output gradient, a one-hot factor's ids, a dense per-example gradient as is),
      kept for every state in ghost form.

    Measured from one forward and backward of the engine at the current state (K = 0's plan)."""
    from dptrain.clipping import ClippingEngine
    from dptrain.clipping.contributions import state_bytes

    model = build_model(cfg)
    batch = gpt2_batch(cfg.gpt2, cfg.seed, cfg.device)
    engine = ClippingEngine(model)
    B = cfg.gpt2.batch_size
    out: dict[str, dict[str, int]] = {}

    class Recorder:  # stands in for the engine's _Query: sizes the contributions, keeps none
        def add(self, per_param):
            for name, contribs in per_param.items():
                ghost, size = state_bytes(contribs)
                inst = B * engine.params[name].numel() * size
                row = out.setdefault(name, {"captured": 0, "instantiated": inst})
                # a layer-specific form is instantiated whenever states are paired
                row["captured"] += inst if ghost is None else ghost
            per_param.clear()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine._forward_backward(gpt2_loss, batch, [(1.0, None)], False, Recorder())
    return out


def memory_floor_bytes(held: dict[str, dict[str, int]], history_bytes: int, K: int) -> int:
    """About what a K-state query must hold beyond K = 0's peak with the engine's two forms and
    the states evaluated one after another: the K past states, and for every parameter the
    smaller of its per-example buffer and K earlier states' captured factors. Whichever form
    holds them, they are live during the last state's forward and backward, whose own peak is
    taken to be K = 0's (an approximation: on the tests' tiny GPT-2 the measured K = 1 peak adds
    1.8% less than this). Going lower takes fewer examples at a time (the split microbatch: the
    same work in parts, each holding its own examples' share) or recomputation."""
    if K == 0:
        return 0
    return K * history_bytes + sum(min(r["instantiated"], K * r["captured"])
                                   for r in held.values())


def weight_bytes(cfg: BenchConfig) -> int:
    """Bytes of the model's (unique) parameters."""
    with torch.device("meta"):
        model = build_gpt2(cfg.gpt2, cfg.seed, "meta")
    seen = {id(p): p for p in model.parameters()}
    return sum(p.numel() * p.element_size() for p in seen.values())


# ---------------------------------------------------------------------------------------------
# running and reporting


def run_timing(cfg: BenchConfig, variants: list[str], log, deadline: float | None = None) -> dict:
    """At least ``cfg.rounds`` interleaved rounds, more (up to ``cfg.max_rounds``) while the
    next one fits before ``deadline`` (perf_counter seconds)."""
    steps: dict[str, StepFn] = {}
    errors: dict[str, str] = {}
    for v in variants:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                steps[v] = build_variant(v, cfg)
        except Exception as e:
            errors[v] = first_line(e)
    log(f"timing: {cfg.rounds} to {max(cfg.rounds, cfg.max_rounds)} rounds (until "
        f"{cfg.budget_s:.0f} s) x {len(steps)} variants ({', '.join(steps)})")
    wall: dict[str, list[float]] = {v: [] for v in steps}
    cpu: dict[str, list[float]] = {v: [] for v in steps}
    names = list(steps)
    r, last = 0, 0.0
    while True:
        # one interleaved round at a time (bench/common.py), the order rotated by one per round
        live = [v for v in names if v not in errors]
        if not live:
            break
        order = live[r % len(live):] + live[: r % len(live)]
        start = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            times, run_errors = time_interleaved({v: steps[v] for v in order}, rounds=1,
                                                 warmup=cfg.warmup if r == 0 else 0,
                                                 device=cfg.device)
        errors.update(run_errors)
        for v in times.wall:
            wall[v] += times.wall[v]
            cpu[v] += times.cpu[v]
        r += 1
        last = time.perf_counter() - start if r > 1 else last
        if r >= max(cfg.rounds, cfg.max_rounds):
            break
        if r >= cfg.rounds and deadline is not None and time.perf_counter() + max(
                last, 1.0) > deadline:
            break
    log(f"timing: {r} rounds done")
    for v in errors:
        wall.pop(v, None)
        cpu.pop(v, None)
    return {"times": wall, "cpu_times": cpu, "errors": errors, "rounds": r}


def run_memory(cfg: BenchConfig, variants: list[str], errors: dict[str, str], log) -> dict:
    """Peak memory of each variant in its own fresh process, ``cfg.parallel_memory`` at a time
    (a resident-set or allocator peak does not depend on the other processes)."""
    from concurrent.futures import ThreadPoolExecutor

    out = {v: {"error": errors[v]} for v in variants if v in errors}
    todo = [v for v in variants if v not in errors]
    log(f"peak memory: {len(todo)} fresh processes, {cfg.parallel_memory} at a time")

    def one(v):
        return v, measure_peak_in_subprocess(os.path.abspath(__file__),
                                             [v, json.dumps(asdict(cfg))])

    workers = max(1, cfg.parallel_memory if cfg.device == "cpu" else 1)
    with ThreadPoolExecutor(workers) as pool:
        for v, r in pool.map(one, todo):
            out[v] = r
    return out


def run_memory_inprocess(cfg: BenchConfig, variants: list[str], log) -> dict:
    """Peak memory of each variant, one after another in this process. CUDA: the caching
    allocator's peak is reset before each and counts only bytes allocated after its baseline,
    so the earlier variants, freed or not, do not enter it. That saves a fresh interpreter
    (torch + transformers imports) per variant. cuBLAS's workspaces are freed before each
    variant so that every one pays for its own, as in a fresh process. CPU (tests): the
    storages its steps create (``common.LiveTensorPeak``; no ``baseline_bytes``), because a
    resident set in a process that already ran a variant mostly reuses freed memory."""
    out = {}
    log(f"peak memory: {len(variants)} variants in this process")
    for v in variants:
        gc.collect()
        if cfg.device == "cuda":
            clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
            if clear is not None:
                clear()
            torch.cuda.empty_cache()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if cfg.device == "cuda":
                out[v] = child_peak(lambda: build_variant(v, cfg), device=cfg.device,
                                    steps=cfg.memory_steps)
            else:
                out[v] = live_peak(lambda: build_variant(v, cfg), cfg.memory_steps)
    gc.collect()
    return out


def live_peak(build, steps: int) -> dict:
    """{"peak_bytes": the most bytes of tensor storage that ``steps`` steps of the built
    variant held at once, the history's states included} or {"error": ...}."""
    try:
        step = build()
        gc.collect()
        with LiveTensorPeak() as tracker:
            for _ in range(steps):
                step()
        return {"peak_bytes": tracker.peak_bytes}
    except Exception as e:
        return {"error": first_line(e)}


def summarize(res: dict, cfg: BenchConfig) -> dict:
    """The JSON summary. Keys (K as a string; ratios of medians measured in the same run):

    time_over_nonprivate        {K: DP-IM step time / non-private step time}
    memory_over_k0              {K: peak memory of the step (history included, weights not) /
                                 K = 0's}
    memory_floor_over_k0        {K: about the least that peak can be with the engine's forms
                                 (``memory_floor_bytes``: K = 0's peak + the K states + per
                                 parameter min(per-example buffer, K states' captured
                                 factors)) / K = 0's}; with the memory runs only
    memory_over_floor           {K: the measured peak / that floor}
    held_mib                    {"captured": one state's captured factors, "instantiated": the
                                 per-example buffers, summed over the parameters}
    marginal_over_nonprivate    {K: (t_K - t_0) / K / t_nonprivate}, K > 0
    marginal_over_k0            {K: (t_K - t_0) / K / t_0} (the paper's 0.59 is this ratio)
    naive_over_dptrain          {naive_k: naive IM step time / dptrain's at the same K}: the
                                issue's baseline, Opacus hooks at every state (``naive_baseline``)
    naive_over_dptrain_vmap     the same against torch.func vmap(grad) per state
    split                       K = max(ks) with the microbatch in ``parts`` parts:
                                time_over_nonprivate, memory_over_k0
    ghost_form                  {K: time_over_nonprivate, memory_over_k0, marginal_over_nonprivate
                                 with performance.ghost=ghost (every layer in ghost form) instead
                                 of the engine's cost model}, for ``--ghost-ks``
    memory_form                 the same with performance.ghost=memory (per parameter the form
                                 that holds fewer bytes), for ``--memory-ks``
    noise, noise_draw_s         "ahead" (the steps reuse one draw) or "in_step"; the wall time of
                                drawing one release's noise, and that over the non-private step
    *_cpu                       the same time ratios from process CPU time
    memory_with_weights_over_k0, memory_over_nonprivate, time_over_k0
    variants                    per variant: median_s, cpu_s, over_nonprivate, peak_mib, error
    targets_met, paper, weight_mib, machine, config, load_average, git_commit, date
    """
    t, c, errs, mem = res["times"], res["cpu_times"], res["errors"], res.get("memory", {})
    base, base_c = t.get("nonprivate"), c.get("nonprivate")

    def peak(v):
        return mem.get(v, {}).get("peak_bytes")

    def over(num, den):
        return num / den if num is not None and den else None

    rows: dict[str, dict] = {}
    for v in cfg.variants():
        row: dict[str, Any] = {
            "median_s": median(t.get(v, [])),
            "cpu_s": median(c.get(v, [])),
            "over_nonprivate": ratio_of_medians(t.get(v), base),
            "cpu_over_nonprivate": ratio_of_medians(c.get(v), base_c),
            "peak_mib": None if peak(v) is None else peak(v) / 2**20,
            "memory_over_k0": over(peak(v), peak("k0")),
            "rounds_s": [round(x, 4) for x in t.get(v, [])],
        }
        if v in errs:
            row["error"] = errs[v]
        elif "error" in mem.get(v, {}):
            row["memory_error"] = mem[v]["error"]
        rows[v] = row
    wb = weight_bytes(cfg)
    p0 = peak("k0")
    out: dict[str, Any] = {"benchmark": "inner_momentum"}
    tk, tk_cpu, mk, mkw, marg, marg_cpu, marg_k0 = {}, {}, {}, {}, {}, {}, {}
    for K in cfg.ks:
        v, k = f"k{K}", str(K)
        tk[k] = rows[v]["over_nonprivate"]
        tk_cpu[k] = rows[v]["cpu_over_nonprivate"]
        mk[k] = rows[v]["memory_over_k0"]
        mkw[k] = over(None if peak(v) is None else peak(v) + wb, None if p0 is None else p0 + wb)
        if K > 0:
            for d, series, den in ((marg, t, "nonprivate"), (marg_cpu, c, "nonprivate"),
                                   (marg_k0, t, "k0")):
                tK, t0, tn = (median(series.get(x, [])) for x in (v, "k0", den))
                d[k] = None if None in (tK, t0, tn) else (tK - t0) / K / tn
    out["time_over_nonprivate"] = tk
    out["memory_over_k0"] = mk
    held = res.get("held")
    if held and p0:
        extra = {K: memory_floor_bytes(held, wb, K) for K in cfg.ks}
        out["memory_floor_over_k0"] = {str(K): (p0 + e) / p0 for K, e in extra.items()}
        out["memory_over_floor"] = {str(K): over(peak(f"k{K}"), p0 + e)
                                    for K, e in extra.items()}
        out["held_mib"] = {
            form: sum(r[form] for r in held.values()) / 2**20
            for form in ("captured", "instantiated")}
    out["marginal_over_nonprivate"] = marg
    nk = str(cfg.naive_k)
    naive = {n: {"wall": ratio_of_medians(t.get(naive_variant(n, cfg.naive_k)), t.get(f"k{nk}")),
                 "cpu": ratio_of_medians(c.get(naive_variant(n, cfg.naive_k)), c.get(f"k{nk}"))}
             for n in cfg.naive}
    headline = "opacus" if "opacus" in naive else (cfg.naive[0] if cfg.naive else None)
    out["naive_over_dptrain"] = {nk: naive[headline]["wall"] if headline else None}
    out["naive_baseline"] = NAIVE_DESCRIPTION.get(headline)
    if "vmap" in naive:
        out["naive_over_dptrain_vmap"] = {nk: naive["vmap"]["wall"]}
    out["marginal_over_k0"] = marg_k0
    kmax = max(cfg.ks)
    sv = f"k{kmax}_split{cfg.split}"
    if sv in rows:
        out["split"] = {"k": kmax, "parts": cfg.split,
                        "microbatch": -(-cfg.gpt2.batch_size // cfg.split),
                        "time_over_nonprivate": rows[sv]["over_nonprivate"],
                        "memory_over_k0": rows[sv]["memory_over_k0"]}
    for key, form, ks in (("ghost_form", "ghost", cfg.ghost_ks),
                          ("memory_form", "memory", cfg.memory_ks)):
        gf = {}
        for K in ks:
            v = f"k{K}_{form}"
            tK, t0, tn = (median(t.get(x, [])) for x in (v, "k0", "nonprivate"))
            gf[str(K)] = {"time_over_nonprivate": rows[v]["over_nonprivate"],
                          "memory_over_k0": rows[v]["memory_over_k0"],
                          "marginal_over_nonprivate": None if None in (tK, t0, tn) or K == 0
                          else (tK - t0) / K / tn}
        if gf:
            out[key] = gf
    out["noise"] = cfg.noise
    out["noise_draw_s"] = res.get("noise_draw_s")
    out["noise_draw_over_nonprivate"] = over(res.get("noise_draw_s"), median(base or []))
    out["time_over_nonprivate_cpu"] = tk_cpu
    out["marginal_over_nonprivate_cpu"] = marg_cpu
    out["naive_over_dptrain_cpu"] = {f"{n}": naive[n]["cpu"] for n in naive}
    out["memory_with_weights_over_k0"] = mkw
    out["memory_over_nonprivate"] = {str(K): over(peak(f"k{K}"), peak("nonprivate"))
                                     for K in cfg.ks}
    out["time_over_k0"] = {str(K): ratio_of_medians(t.get(f"k{K}"), t.get("k0")) for K in cfg.ks}
    out["variants"] = rows
    targets = {
        f"marginal_over_nonprivate<={TARGET_MARGINAL}": _all_le(marg.values(), TARGET_MARGINAL),
        f"memory_over_k0[{kmax}]<={TARGET_MEMORY_K4}": _le(mk.get(str(kmax)), TARGET_MEMORY_K4),
    }
    for n in naive:
        targets[f"naive_{n}_over_dptrain>={TARGET_NAIVE_OVER_DPTRAIN}"] = _le(
            TARGET_NAIVE_OVER_DPTRAIN, naive[n]["wall"])
    out["targets_met"] = targets
    m = PAPER["minutes"]
    out["paper"] = {
        "time_over_k0": {k: v / m["0"] for k, v in m.items()},
        "marginal_over_k0": {"1": (m["1"] - m["0"]) / m["0"],
                             "4": (m["4"] - m["0"]) / 4 / m["0"]},
        "memory_with_history_over_without": PAPER["peak_gib"]["with_history"]
        / PAPER["peak_gib"]["without_history"],
    }
    out["weight_mib"] = wb / 2**20
    out["config"] = asdict(cfg)
    out["machine"] = machine_description(cfg.device)
    out["load_average"] = {"start": None, "end": load_average()}
    out["git_commit"] = git_commit()
    out["date"] = now_utc()
    return out


NAIVE_DESCRIPTION = {
    "opacus": "Opacus 1.6 GradSampleModule hooks, one forward+backward per state (converted copy)",
    "vmap": "torch.func vmap(grad(functional_call)) per state (stock model)",
}


def _all_le(xs, b):
    xs = [x for x in xs if x is not None]
    return None if not xs else all(x <= b for x in xs)


def print_table(summary: dict) -> None:
    cfg = summary["config"]
    print(f"\nGPT-2 (transformers, stock for dptrain): {cfg['gpt2']}; gamma {cfg['gamma']}; "
          f"torch threads {cfg['threads'] or 'default'}")
    print(f"{'variant':<16}{'s/step':>9}{'x non-priv':>12}{'cpu s':>9}{'x (cpu)':>9}"
          f"{'marginal/np':>13}{'peak MiB':>10}{'x K=0':>8}  note")
    for v, row in summary["variants"].items():
        K = v[1:] if v.startswith("k") and "_" not in v else None
        marg = summary["marginal_over_nonprivate"].get(K) if K else None
        note = row.get("error") or row.get("memory_error") or ""
        print(f"{v:<16}{_fmt(row['median_s']):>9}{_fmt(row['over_nonprivate'], '.2f', 'x'):>12}"
              f"{_fmt(row['cpu_s']):>9}{_fmt(row['cpu_over_nonprivate'], '.2f', 'x'):>9}"
              f"{_fmt(marg, '.2f', 'x'):>13}{_fmt(row['peak_mib'], '.0f'):>10}"
              f"{_fmt(row['memory_over_k0'], '.2f', 'x'):>8}  {note}")
    nk = str(cfg["naive_k"])
    print(f"naive / dptrain at K = {nk}: {_fmt(summary['naive_over_dptrain'][nk], '.2f')} "
          f"({summary['naive_baseline']}); vmap: "
          f"{_fmt(summary.get('naive_over_dptrain_vmap', {}).get(nk), '.2f')}")
    floor = summary.get("memory_floor_over_k0")
    if floor:
        print("memory floor of the engine's forms, x K=0: " + ", ".join(
            f"K={k} {_fmt(x, '.2f')} (measured/floor {_fmt(summary['memory_over_floor'][k], '.2f')})"
            for k, x in floor.items()))
    print(f"targets met: {summary['targets_met']}")
    print(f"machine: {summary['machine']}; load average at start "
          f"{summary['load_average']['start']}, at end {summary['load_average']['end']}; "
          f"commit {summary['git_commit']}; {summary['date']}")


def tiny_config() -> BenchConfig:
    """A seconds-long smoke configuration (tests): tiny model, one round, no memory runs."""
    return BenchConfig(gpt2=GPT2Shape(num_layers=1, width=32, num_heads=2, vocab_size=64,
                                      seq_len=8, batch_size=4),
                       rounds=1, max_rounds=1, warmup=0, memory=False)


def run(cfg: BenchConfig) -> dict:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    load_start = load_average()
    t0 = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[inner_momentum {time.perf_counter() - t0:6.0f} s] {msg}", file=sys.stderr,
              flush=True)

    variants = cfg.variants()
    memory = None
    if cfg.memory:  # first: its duration is predictable, the timing rounds fill the rest
        if cfg.device == "cuda":
            memory = run_memory_inprocess(cfg, variants, log)
        else:
            memory = run_memory(cfg, variants, {}, log)
    res = run_timing(cfg, variants, log, deadline=t0 + cfg.budget_s)
    res["noise_draw_s"] = noise_draw_seconds(cfg)
    if memory is not None:
        res["memory"] = memory
        res["held"] = held_bytes(cfg)
    summary = summarize(res, cfg)
    summary["rounds"] = res["rounds"]
    summary["load_average"]["start"] = load_start
    summary["elapsed_s"] = round(time.perf_counter() - t0, 1)
    log("done")
    return summary


def main(argv: list[str] | None = None) -> dict | None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--peak-child":
        variant, cfg_json = argv[1:3]
        cfg = BenchConfig.from_json(cfg_json)
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        warnings.simplefilter("ignore")
        emit_child_result(child_peak(lambda: build_variant(variant, cfg), device=cfg.device,
                                     steps=cfg.memory_steps))
        return None
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds (smoke run)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--tiny", action="store_true", help="tiny model, for tests")
    ap.add_argument("--rounds", type=int, default=None,
                    help="exactly this many timed rounds (default: 3 to 9, as many as fit in "
                         "--budget-s)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="wall-clock budget of the whole run in seconds (default 330)")
    ap.add_argument("--ks", default=None, help="comma-separated K values (default 0,1,2,4)")
    ap.add_argument("--naive", default="both", choices=["opacus", "vmap", "both", "none"],
                    help="naive IM baseline(s) at K = naive_k (default both)")
    ap.add_argument("--split", type=int, default=None,
                    help="also run K = max(ks) with the microbatch split in this many parts "
                         "(default 2; 1: no)")
    ap.add_argument("--memory-steps", type=int, default=None)
    ap.add_argument("--noise", default=None, choices=["ahead", "in_step"],
                    help="ahead (default): the steps reuse one release's noise, drawn at the "
                         "first; in_step: each step draws its own (see NoiseSource)")
    ap.add_argument("--ghost-ks", default=None,
                    help="comma-separated K also run with performance.ghost=ghost")
    ap.add_argument("--memory-ks", default=None,
                    help="comma-separated K also run with performance.ghost=memory")
    ap.add_argument("--naive-k", type=int, default=4)
    ap.add_argument("--no-memory", action="store_true", help="skip the peak-memory runs")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default 1: steadier on a shared machine; 0: torch's)")
    ap.add_argument("--batch-size", type=int, default=None)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--width", type=int, default=None)
    ap.add_argument("--heads", type=int, default=None)
    ap.add_argument("--vocab", type=int, default=None)
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--lora", type=int, default=0,
                    help="LoRA rank: adapters on every block matrix, the rest frozen "
                         "(model.lora); needs --naive none")
    args = ap.parse_args(argv)
    if args.lora and args.naive != "none":
        ap.error("--lora needs --naive none (the naive IMs run the whole model)")
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    cfg = tiny_config() if args.tiny else BenchConfig()
    if args.quick:
        cfg.rounds, cfg.max_rounds, cfg.warmup, cfg.memory_steps, cfg.split = 2, 2, 1, 1, 1
    if args.rounds is not None:
        cfg.rounds = cfg.max_rounds = args.rounds
    if args.ks:
        cfg.ks = sorted({int(k) for k in args.ks.split(",")} | {0})
    cfg.naive = {"both": ["opacus", "vmap"], "none": []}.get(args.naive, [args.naive])
    cfg.naive_k = args.naive_k
    if cfg.naive and cfg.naive_k not in cfg.ks:
        cfg.ks = sorted(set(cfg.ks) | {cfg.naive_k})
    if args.no_memory:
        cfg.memory = False
    cfg.lora = args.lora
    for attr, name in (("batch_size", "batch_size"), ("layers", "num_layers"),
                       ("width", "width"), ("heads", "num_heads"), ("vocab", "vocab_size"),
                       ("seq_len", "seq_len")):
        if getattr(args, attr) is not None:
            setattr(cfg.gpt2, name, getattr(args, attr))
    if args.budget_s is not None:
        cfg.budget_s = args.budget_s
    if args.split is not None:
        cfg.split = args.split
    if args.memory_steps is not None:
        cfg.memory_steps = args.memory_steps
    if args.noise:
        cfg.noise = args.noise
    if args.ghost_ks:
        cfg.ghost_ks = sorted({int(k) for k in args.ghost_ks.split(",")})
    if args.memory_ks:
        cfg.memory_ks = sorted({int(k) for k in args.memory_ks.split(",")})
    cfg.device = args.device
    if args.threads is not None:
        cfg.threads = args.threads or None
    if cfg.device == "cuda":
        cfg.threads = args.threads or None
    summary = run(cfg)
    print_table(summary)
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
