"""One private step against one non-private step, and against Opacus 1.6 (issue 2, Benchmarks).

    python bench/dp_step.py [--quick] [--device cpu|cuda]

Models (same weights, same batch for every variant of a model):

- gpt2: transformers GPT2LMHeadModel, 4 layers, width 256, 4 heads, vocabulary 8,192, T = 64,
  B = 32, tied embeddings, eager attention, dropout 0 (ANCHORS.md's CPU setting);
- nfresnet: timm nf_resnet26 at 64 px, B = 16, 10 classes (nf_resnet50's shape family at half
  the depth, to keep the run within minutes on 2 CPU cores);
- vit: timm vit_small_patch16_224 built for 32 px images in 4 px patches (64 tokens and the
  class token), depth 6, B = 16, 10 classes: its class token and position table are the
  engine's tapped parameters (given one row per example);
- convnext: timm convnext_atto at 32 px, B = 16, 10 classes: its blocks' layer scales are
  tapped parameters followed through the blocks' torch calls (dptrain/clipping/taps.py);
- llama: transformers LlamaForCausalLM at gpt2's sizes (4 layers, width 256, 4 heads with 2
  key/value heads, SwiGLU MLP of 688, vocabulary 8,192, T = 64, B = 32, untied head, eager
  attention): RMSNorm, rotary positions, grouped-query attention. Opacus runs it as it is.

Variants (plain SGD everywhere; C = 1, sigma = 1; per-example loss = mean token loss for gpt2):

- nonprivate: ``loss.mean().backward()`` + SGD step;
- dptrain_bookkeeping / dptrain_two_pass: ``ClippingEngine.accumulate`` over the batch (one
  microbatch), Gaussian noise sigma*C*Z on every coordinate (dptrain.privacy.noise, as the
  trainer draws it), divide by b = B, SGD step;
- opacus_ghost: ``PrivacyEngine().make_private(..., grad_sample_mode="ghost")`` with its criterion
  wrapper (two backward passes); opacus_hooks: grad_sample_mode="hooks" (per-sample gradients).
  Poisson sampling off so the batch is the same. For gpt2 Opacus runs on a copy with the three
  changes it needs (ANCHORS.md): Conv1D -> Linear, untied embeddings, explicit contiguous
  position_ids of batch size B. dptrain runs the stock model.

Same computation: before timing a model, each private variant makes one step with no noise,
C = 1e-4 (every example clipped) and lr = 1e8 on a fresh float64 copy, and its update of each
parameter is compared with -lr/B sum_i min(1, C/|g_i|) g_i from single-example backward passes
(``update_errors``: column ``upd err``, the worst parameter's relative error); a variant further
than 2% from it on some parameter is marked "NOT the same update".

Times: interleaved rounds (bench/common.py), medians of wall time and of process CPU time;
ratios are ratios of medians. The load average at start and end is recorded (shared machines).
Peak memory: each variant in a fresh subprocess, 2 steps after the build (bench/common.py).
The last line printed is one JSON object (keys documented in ``summarize``).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import math
import os
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
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

VARIANTS = ("nonprivate", "dptrain_bookkeeping", "dptrain_two_pass", "opacus_ghost",
            "opacus_hooks")
MODELS = ("gpt2", "nfresnet", "vit", "convnext", "llama")

# Targets of issue 2 (GPT-2): DP step <= 1.2x non-private; >= 1.5x faster than Opacus ghost at
# no more peak memory.
TARGET_DP_OVER_NONPRIVATE = 1.2
TARGET_OPACUS_OVER_DPTRAIN = 1.5


@dataclass
class GPT2Shape:
    num_layers: int = 4
    width: int = 256
    num_heads: int = 4
    vocab_size: int = 8192
    seq_len: int = 64  # T
    batch_size: int = 32  # B


@dataclass
class ResNetShape:
    name: str = "nf_resnet26"
    image_size: int = 64
    batch_size: int = 16
    num_classes: int = 10
    timm_kwargs: dict = field(default_factory=dict)  # further timm.create_model arguments


def _vit_shape() -> ResNetShape:
    return ResNetShape(name="vit_small_patch16_224", image_size=32, batch_size=16,
                       timm_kwargs={"img_size": 32, "patch_size": 4, "depth": 6})


def _convnext_shape() -> ResNetShape:
    return ResNetShape(name="convnext_atto", image_size=32, batch_size=16)


@dataclass
class BenchConfig:
    gpt2: GPT2Shape = field(default_factory=GPT2Shape)
    llama: GPT2Shape = field(default_factory=GPT2Shape)  # the same sizes, a Llama's layers
    resnet: ResNetShape = field(default_factory=ResNetShape)
    vit: ResNetShape = field(default_factory=_vit_shape)
    convnext: ResNetShape = field(default_factory=_convnext_shape)
    rounds: int = 5  # timed GPT-2 rounds (every variant once per round)
    resnet_rounds: int = 3  # timed NF-ResNet rounds (a DP step there is ~10x a GPT-2 one)
    warmup: int = 1  # untimed steps per variant before the rounds
    memory: bool = True  # peak memory, one fresh subprocess per variant
    memory_steps: int = 2
    device: str = "cpu"
    threads: int | None = None  # torch.set_num_threads; None keeps torch's default
    clip_norm: float = 1.0
    noise_multiplier: float = 1.0
    lr: float = 1e-3
    seed: int = 0
    dtype: str = "float32"  # the models' and images' (update_errors: float64)

    @classmethod
    def from_json(cls, text: str) -> "BenchConfig":
        d = json.loads(text)
        return cls(gpt2=GPT2Shape(**d.pop("gpt2")), llama=GPT2Shape(**d.pop("llama")),
                   resnet=ResNetShape(**d.pop("resnet")),
                   vit=ResNetShape(**d.pop("vit")), convnext=ResNetShape(**d.pop("convnext")),
                   **d)


def default_dptrain_mode() -> str:
    from dptrain.clipping import ClippingEngine

    return inspect.signature(ClippingEngine.__init__).parameters["mode"].default


# ---------------------------------------------------------------------------------------------
# models, batches, per-example losses


def gpt2_logits(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    return model(**batch).logits[:, :-1]  # (B, T-1, V): position t predicts token t+1


def gpt2_loss(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    """Per-example mean next-token loss, shape (B,)."""
    logits = gpt2_logits(model, batch)
    B, Tm1, V = logits.shape
    tok = F.cross_entropy(logits.reshape(-1, V), batch["input_ids"][:, 1:].reshape(-1),
                          reduction="none")
    return tok.view(B, Tm1).mean(1)


def build_llama(s: GPT2Shape, seed: int, device: str) -> nn.Module:
    """transformers LlamaForCausalLM of shape ``s``: half as many key/value heads as heads, a
    SwiGLU MLP of 8/3 the width (rounded up to 16), untied head, eager attention, train mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=s.vocab_size, hidden_size=s.width,
                      intermediate_size=-(-8 * s.width // 3 // 16) * 16,
                      num_hidden_layers=s.num_layers, num_attention_heads=s.num_heads,
                      num_key_value_heads=max(1, s.num_heads // 2),
                      max_position_embeddings=s.seq_len, tie_word_embeddings=False,
                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return LlamaForCausalLM._from_config(cfg, attn_implementation="eager").to(device).train()


def build_resnet(s: ResNetShape, seed: int, device: str) -> nn.Module:
    import timm

    torch.manual_seed(seed)
    return timm.create_model(s.name, num_classes=s.num_classes,
                             **s.timm_kwargs).to(device).train()


def resnet_batch(s: ResNetShape, seed: int, device: str) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(s.batch_size, 3, s.image_size, s.image_size, generator=g)
    y = torch.randint(0, s.num_classes, (s.batch_size,), generator=g)
    return x.to(device), y.to(device)


def resnet_loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y, reduction="none")


# ---------------------------------------------------------------------------------------------
# step functions


def nonprivate_step(model: nn.Module, loss_fn, batch, lr: float) -> StepFn:
    opt = torch.optim.SGD(model.parameters(), lr=lr)

    def step():
        opt.zero_grad(set_to_none=True)
        loss_fn(model, batch).mean().backward()
        opt.step()

    return step


def gpt2_or_resnet(kind: str, cfg: BenchConfig):
    """(sizes, build, batch, loss_fn) of the gpt2 or the nfresnet model, on cfg.device."""
    if kind == "gpt2":
        return cfg.gpt2, build_gpt2, gpt2_batch(cfg.gpt2, cfg.seed, cfg.device), gpt2_loss
    s = cfg.resnet
    return s, build_resnet, resnet_batch(s, cfg.seed, cfg.device), resnet_loss


def dptrain_step(model: nn.Module, loss_fn, batch, batch_size: int, cfg: BenchConfig,
                 mode: str, ghost: str = "auto") -> StepFn:
    """accumulate -> + sigma*C*Z (every coordinate, dptrain's counter-based noise) -> / b -> SGD."""
    from dptrain.clipping import ClippingEngine
    from dptrain.privacy.noise import gaussian_noise

    engine = ClippingEngine(model, clip_norm=cfg.clip_norm, mode=mode, ghost=ghost)
    opt = torch.optim.SGD(list(engine.params.values()), lr=cfg.lr)
    std = cfg.noise_multiplier * cfg.clip_norm
    b = batch_size  # public release denominator
    counter = [0]

    def step():
        acc: dict[str, Tensor] = {}  # Sensitive: unnoised clipped sum.
        engine.accumulate(loss_fn, batch, acc)
        t = counter[0]
        counter[0] += 1
        for name, p in engine.params.items():
            s = acc.pop(name, None)
            if s is None:
                s = torch.zeros_like(p, dtype=torch.float32)
            z = gaussian_noise(cfg.seed, t, name, p.numel(), device=p.device, dtype=s.dtype)
            p.grad = s.add_(z.view_as(s), alpha=std).div_(b).to(p.dtype)
        opt.step()
        opt.zero_grad(set_to_none=True)  # as the other variants: no gradients live on

    return step


def opacus_step(model: nn.Module, batch_tensors: tuple[Tensor, ...], forward: Callable,
                targets: Tensor, cfg: BenchConfig, mode: str,
                criterion_shape: tuple[int, int] | None) -> StepFn:
    """Opacus as its docs intend: make_private(...) then criterion(out, y).backward(); step().

    ``forward(model)`` returns the logits, flattened to (N, classes); ``criterion_shape`` is
    (B, T) for a sequence model (the ghost criterion's ``shape=`` argument)."""
    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader, TensorDataset

    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    loader = DataLoader(TensorDataset(*batch_tensors), batch_size=batch_tensors[0].shape[0])
    crit = nn.CrossEntropyLoss()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pe = PrivacyEngine()
        kwargs = dict(module=model, optimizer=opt, data_loader=loader,
                      noise_multiplier=cfg.noise_multiplier, max_grad_norm=cfg.clip_norm,
                      poisson_sampling=False, grad_sample_mode=mode)
        if mode == "ghost":
            model, opt, crit, _ = pe.make_private(criterion=crit, **kwargs)
        else:
            model, opt, _ = pe.make_private(**kwargs)
    B = batch_tensors[0].shape[0]

    def step():
        opt.zero_grad(set_to_none=True)
        logits = forward(model)
        if mode == "ghost":
            extra = {"shape": criterion_shape} if criterion_shape else {}
            loss = crit(logits, targets, **extra)
        elif criterion_shape:  # per-example mean over tokens, mean over the batch
            loss = F.cross_entropy(logits, targets, reduction="none").view(B, -1).mean(1).mean()
        else:
            loss = crit(logits, targets)
        loss.backward()
        opt.step()

    return step


def model_and_batch(kind: str, cfg: BenchConfig):
    """(shape, a fresh model (same seed, same weights), its batch, per-example loss_fn, B), in
    ``cfg.dtype``."""
    dev, dtype = cfg.device, getattr(torch, cfg.dtype)
    if kind in ("gpt2", "llama"):
        s = cfg.gpt2 if kind == "gpt2" else cfg.llama
        model = (build_gpt2 if kind == "gpt2" else build_llama)(s, cfg.seed, dev).to(dtype)
        return s, model, gpt2_batch(s, cfg.seed, dev), gpt2_loss, s.batch_size
    s = {"vit": cfg.vit, "convnext": cfg.convnext}.get(kind, cfg.resnet)
    x, y = resnet_batch(s, cfg.seed, dev)
    return (s, build_resnet(s, cfg.seed, dev).to(dtype), (x.to(dtype), y), resnet_loss,
            s.batch_size)


def build_variant(kind: str, variant: str, cfg: BenchConfig,
                  models: list | None = None) -> StepFn:
    """A fresh model (same seed, same weights) and the step of ``variant`` on it; the model
    the step updates is appended to ``models`` when given (``update_errors`` compares the
    variants' updates; for gpt2's Opacus variants, the copy Opacus trains)."""
    s, model, batch, loss_fn, B = model_and_batch(kind, cfg)
    if models is not None and not (kind == "gpt2" and variant.startswith("opacus_")):
        models.append(model)
    if variant == "nonprivate":
        return nonprivate_step(model, loss_fn, batch, cfg.lr)
    if variant.startswith("dptrain_"):
        return dptrain_step(model, loss_fn, batch, B, cfg, variant[len("dptrain_"):])
    mode = variant[len("opacus_"):]
    if kind == "llama":  # untied already, and no Conv1D
        ids = batch["input_ids"]

        def forward(m):
            logits = m(input_ids=ids).logits[:, :-1]
            return logits.reshape(-1, logits.shape[-1])

        return opacus_step(model, (ids,), forward, ids[:, 1:].reshape(-1), cfg, mode,
                           (B, s.seq_len - 1))
    if kind == "gpt2":
        # tied for hooks (they accumulate a shared weight over both uses); ghost needs it untied
        model, pos = opacus_gpt2(model, s, untie=(mode == "ghost"))
        if models is not None:
            models.append(model)
        ids = batch["input_ids"]

        def forward(m):
            logits = m(input_ids=ids, position_ids=pos).logits[:, :-1]
            return logits.reshape(-1, logits.shape[-1])

        return opacus_step(model, (ids,), forward, ids[:, 1:].reshape(-1), cfg, mode,
                           (B, s.seq_len - 1))
    x, y = batch
    return opacus_step(model, (x, y), lambda m: m(x), y, cfg, mode, None)


# ---------------------------------------------------------------------------------------------
# are the variants computing the same thing?

#: a private variant whose update of some parameter (no noise, every example clipped) is
#: further than this from the reference's, relative, is not a like-for-like baseline: its time
#: is for another computation (Opacus 1.6's hooks on timm's ConvNeXt: its convolution grad
#: sampler is wrong on the channels-last tensors ConvNeXt's LayerNorm2d hands the
#: downsampling convolutions). Per parameter: a wrong update of small parameters (norms, a
#: ConvNeXt block's, scaled by its layer scale's 1e-6) is lost in a norm over all of them
#: (It catches wrong gradients, not small differences of clipping geometry: Opacus ghost on
#: GPT-2, whose untied copy clips the embedding's two uses apart, is 0.06-1% off; with every
#: example clipped, clipping and normalising agree)
SAME_UPDATE_TOLERANCE = 0.02
#: the check's clip norm (far below every per-example gradient norm: each example is clipped)
#: and learning rate (SGD's step is linear in it); the models run in float64 and the steps are
#: large, so that updates read back from the weights keep their digits (a ConvNeXt block's
#: norm, behind a layer scale of 1e-6, moved 1e-12 of its weight at lr 1e3: 7e-5 off)
CHECK_CLIP_NORM = 1e-4
CHECK_LR = 1e8


def _named_update(model: nn.Module, before: dict[str, Tensor]) -> dict[str, Tensor]:
    """Each parameter's move, float64, in the stock model's layout: a Linear that was GPT-2's
    Conv1D (``opacus_gpt2``) transposed back, an untied lm_head's move added to the embedding's
    (the stock model's one tied weight)."""
    moves = {}
    for mname, mod in model.named_modules():
        for pname, p in mod.named_parameters(recurse=False):
            name = f"{mname}.{pname}" if mname else pname
            if name in before and name not in moves:
                d = (p.detach() - before[name]).double()
                moves[name] = d.T if getattr(mod, "_from_conv1d", False) and d.ndim == 2 else d
    if "lm_head.weight" in moves and "transformer.wte.weight" in moves:
        moves["transformer.wte.weight"] = moves["transformer.wte.weight"] + moves.pop(
            "lm_head.weight")
    return moves


def reference_update(kind: str, cfg: BenchConfig) -> dict[str, Tensor]:
    """The update every private variant should make with no noise (``cfg``'s clip norm and
    learning rate): -lr/B sum_i min(1, C/|g_i|) g_i over single-example backward passes of the
    stock model (gradients in ``cfg.dtype``, summed in float64)."""
    _, model, batch, loss_fn, B = model_and_batch(kind, cfg)
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    total = {n: torch.zeros(p.shape, dtype=torch.float64, device=p.device) for n, p in params}
    for i in range(B):
        one = ({k: v[i:i + 1] for k, v in batch.items()} if isinstance(batch, dict)
               else tuple(v[i:i + 1] for v in batch))
        grads = torch.autograd.grad(loss_fn(model, one).sum(), [p for _, p in params],
                                    allow_unused=True)
        g = {n: (torch.zeros_like(p) if gi is None else gi).double()
             for (n, p), gi in zip(params, grads)}
        norm = float(torch.sqrt(sum(v.pow(2).sum() for v in g.values())))
        factor = min(1.0, cfg.clip_norm / norm) if norm > 0 else 0.0
        for n in total:
            total[n].add_(g[n], alpha=factor)
    return {n: -cfg.lr / B * v for n, v in total.items()}


def update_errors(kind: str, cfg: BenchConfig, variants=VARIANTS) -> dict[str, dict | str]:
    """Per private variant, for one step with no noise, C = CHECK_CLIP_NORM and lr = CHECK_LR
    on the timed steps' model and batch in float64: ``worst``, the largest over the parameters
    of |its update - the reference's| / |the reference's| (parameters the reference moves),
    ``worst_param`` its name, and ``overall``, the same over all parameters at once; a variant
    that fails: its error line."""
    c = dataclasses.replace(cfg, noise_multiplier=0.0, clip_norm=CHECK_CLIP_NORM, lr=CHECK_LR,
                            dtype="float64")
    ref = reference_update(kind, c)
    scale = math.sqrt(sum(float(v.pow(2).sum()) for v in ref.values()))
    norms = {n: float(v.norm()) for n, v in ref.items()}
    out: dict[str, dict | str] = {}
    for v in variants:
        if v == "nonprivate":
            continue
        try:
            models: list = []
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                step = build_variant(kind, v, c, models)
                model = models[0]
                before = {n: p.detach().clone() for n, p in model.named_parameters()}
                step()
            moved = _named_update(model, before)
            missing = sorted(set(ref) ^ set(moved))
            if missing:
                raise RuntimeError(f"parameters not compared: {missing[:3]}")
            diffs = {n: float((moved[n] - ref[n]).norm()) for n in ref}
            # (a parameter the reference leaves where it is but the variant moves, or a NaN,
            # is infinitely off: a NaN compared with max() was passed over)
            rel = {n: (d / norms[n] if norms[n] > 0 else 0.0 if d == 0 else math.inf)
                   for n, d in diffs.items()}
            rel = {n: r if not math.isnan(r) else math.inf for n, r in rel.items()}
            name = max(rel, key=rel.get)
            overall = math.sqrt(sum(d * d for d in diffs.values())) / scale
            out[v] = {"worst": rel[name], "worst_param": name,
                      "overall": overall if not math.isnan(overall) else math.inf}
        except Exception as e:  # (reported beside the timings, as their failures are)
            out[v] = first_line(e)
    return out


# ---------------------------------------------------------------------------------------------
# running and reporting


def run_model(kind: str, cfg: BenchConfig, variants=VARIANTS) -> dict:
    steps: dict[str, StepFn] = {}
    errors: dict[str, str] = {}
    for v in variants:
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                steps[v] = build_variant(kind, v, cfg)
            fallbacks = [str(w.message) for w in caught if "fallback" in str(w.message)]
            if fallbacks:
                print(f"[{kind}/{v}] {len(fallbacks)} torch.func fallback warning(s), e.g. "
                      f"{fallbacks[0]}", file=sys.stderr)
        except Exception as e:
            errors[v] = first_line(e)
    rounds = cfg.rounds if kind in ("gpt2", "llama") else cfg.resnet_rounds
    times, run_errors = time_interleaved(steps, rounds=rounds, warmup=cfg.warmup,
                                         device=cfg.device)
    errors.update(run_errors)
    return {"times": times.wall, "cpu_times": times.cpu, "errors": errors}


def memory_of(kind: str, variants, cfg: BenchConfig, errors: dict[str, str]) -> dict[str, dict]:
    out = {}
    for v in variants:
        if v in errors:  # already known to fail
            out[v] = {"error": errors[v]}
            continue
        out[v] = measure_peak_in_subprocess(os.path.abspath(__file__),
                                            [kind, v, json.dumps(asdict(cfg))])
    return out


def summarize(results: dict, cfg: BenchConfig) -> dict:
    """The JSON summary. Keys:

    dp_over_nonprivate      dptrain (default mode) GPT-2 step time / non-private
    opacus_over_dptrain     Opacus ghost GPT-2 step time / dptrain (default mode)
    peak_memory_ratio       dptrain (default mode) GPT-2 peak / Opacus ghost peak
    *_cpu                   the same ratios from process CPU time instead of wall time
    targets_met(_cpu)       issue 2's GPT-2 targets, from wall (CPU) time
    faster_mode             the faster dptrain mode on GPT-2 (and nfresnet_faster_mode)
    gpt2 / nfresnet / vit   per variant: median_s, over_nonprivate, peak_mib, error, and for the
                            private ones update_error (``update_errors``' worst parameter's;
                            update_error_param, update_error_overall) and same_update
                            (update_error <= SAME_UPDATE_TOLERANCE)
    not_like_for_like       the GPT-2 variants whose update is not the reference's (their
                            times are for another computation; nfresnet_not_like_for_like, ...)
    (the other models' ratios with their name as prefix: nfresnet_dp_over_nonprivate, ...)
    """
    default = default_dptrain_mode()
    out: dict[str, Any] = {"benchmark": "dp_step", "default_mode": default}
    for kind, res in results.items():
        t, errs, mem = res["times"], res["errors"], res.get("memory", {})
        c, checked = res["cpu_times"], res.get("update_error", {})
        base = t.get("nonprivate")
        table = {}
        for v in VARIANTS:
            row: dict[str, Any] = {
                "median_s": median(t.get(v, [])),
                "over_nonprivate": ratio_of_medians(t.get(v), base),
                "cpu_s": median(c.get(v, [])),
                "cpu_over_nonprivate": ratio_of_medians(c.get(v), c.get("nonprivate")),
                "peak_mib": (mem[v]["peak_bytes"] / 2**20
                             if "peak_bytes" in mem.get(v, {}) else None),
            }
            if v in checked:
                err = checked[v]
                if isinstance(err, dict):  # (a failed check says nothing of the computation)
                    row["update_error"] = err["worst"]
                    row["update_error_param"] = err["worst_param"]
                    row["update_error_overall"] = err["overall"]
                    row["same_update"] = err["worst"] <= SAME_UPDATE_TOLERANCE
                else:
                    row["update_check_error"] = err
            if v in errs:
                row["error"] = errs[v]
            elif "error" in mem.get(v, {}):
                row["memory_error"] = mem[v]["error"]
            table[v] = row
        out[kind] = table
        bk = ratio_of_medians(t.get("dptrain_bookkeeping"), t.get("dptrain_two_pass"))
        faster = None if bk is None else ("bookkeeping" if bk <= 1.0 else "two_pass")
        dflt = t.get(f"dptrain_{default}")
        dp_np = ratio_of_medians(dflt, base)
        op_dp = ratio_of_medians(t.get("opacus_ghost"), dflt)
        peak_d = table[f"dptrain_{default}"]["peak_mib"]
        peak_o = table["opacus_ghost"]["peak_mib"]
        mem_ratio = peak_d / peak_o if peak_d is not None and peak_o else None
        prefix = "" if kind == "gpt2" else f"{kind}_"
        out[f"{prefix}not_like_for_like"] = [v for v, row in table.items()
                                             if row.get("same_update") is False]
        out[f"{prefix}dp_over_nonprivate"] = dp_np
        out[f"{prefix}dp_over_nonprivate_cpu"] = table[f"dptrain_{default}"]["cpu_over_nonprivate"]
        out[f"{prefix}opacus_over_dptrain"] = op_dp
        out[f"{prefix}opacus_over_dptrain_cpu"] = ratio_of_medians(
            c.get("opacus_ghost"), c.get(f"dptrain_{default}"))
        out[f"{prefix}peak_memory_ratio"] = mem_ratio
        out[f"{prefix}faster_mode"] = faster
        out[f"{prefix}bookkeeping_over_two_pass"] = bk
        for mode in ("bookkeeping", "two_pass"):
            out[f"{prefix}dp_over_nonprivate_{mode}"] = table[f"dptrain_{mode}"]["over_nonprivate"]
    g = out.get("gpt2", {})
    if "gpt2" in results:
        out["targets_met"] = {
            "dp_over_nonprivate<=1.2": _le(out["dp_over_nonprivate"], TARGET_DP_OVER_NONPRIVATE),
            "opacus_over_dptrain>=1.5": _le(TARGET_OPACUS_OVER_DPTRAIN, out["opacus_over_dptrain"]),
            "peak_memory_ratio<=1": _le(out["peak_memory_ratio"], 1.0),
        }
        out["targets_met_cpu"] = {
            "dp_over_nonprivate<=1.2": _le(out["dp_over_nonprivate_cpu"],
                                           TARGET_DP_OVER_NONPRIVATE),
            "opacus_over_dptrain>=1.5": _le(TARGET_OPACUS_OVER_DPTRAIN,
                                            out["opacus_over_dptrain_cpu"]),
        }
    out["opacus_ghost_s"] = g.get("opacus_ghost", {}).get("median_s")
    out["config"] = asdict(cfg)
    out["machine"] = machine_description(cfg.device)
    out["load_average"] = {"start": None, "end": load_average()}
    out["git_commit"] = git_commit()
    out["date"] = now_utc()
    return out


def print_table(summary: dict) -> None:
    titles = {"gpt2": "GPT-2 (transformers, stock for dptrain)", "nfresnet": "NF-ResNet (timm)",
              "vit": "ViT (timm)", "convnext": "ConvNeXt (timm)",
              "llama": "Llama (transformers, stock)"}
    cfg = summary["config"]
    for kind in MODELS:
        if kind not in summary:
            continue
        shape = cfg[kind if kind in ("gpt2", "vit", "convnext", "llama") else "resnet"]
        print(f"\n{titles[kind]}: {shape}")
        print(f"{'variant':<22}{'s/step':>9}{'x non-priv':>12}{'cpu s':>9}{'x (cpu)':>9}"
              f"{'peak MiB':>10}{'upd err':>9}  note")
        for v, row in summary[kind].items():
            note = (row.get("error") or row.get("memory_error")
                    or row.get("update_check_error") or "")
            if row.get("same_update") is False:
                note = (f"NOT the same update ({row['update_error_param']} "
                        f"{row['update_error']:.2g} off > {SAME_UPDATE_TOLERANCE:g}): not a "
                        f"like-for-like baseline. {note}").strip()
            print(f"{v:<22}{_fmt(row['median_s']):>9}{_fmt(row['over_nonprivate'], '.2f', 'x'):>12}"
                  f"{_fmt(row['cpu_s']):>9}{_fmt(row['cpu_over_nonprivate'], '.2f', 'x'):>9}"
                  f"{_fmt(row['peak_mib'], '.0f'):>10}{_fmt(row.get('update_error'), '.0e'):>9}"
                  f"  {note}")
    print(f"\ndptrain default mode: {summary['default_mode']}; faster mode on GPT-2: "
          f"{summary.get('faster_mode')} (bookkeeping / two_pass = "
          f"{_fmt(summary.get('bookkeeping_over_two_pass'), '.2f')})")
    print(f"GPT-2: dp/non-private {_fmt(summary.get('dp_over_nonprivate'), '.2f')} "
          f"(target <= {TARGET_DP_OVER_NONPRIVATE}); Opacus ghost/dptrain "
          f"{_fmt(summary.get('opacus_over_dptrain'), '.2f')} (target >= "
          f"{TARGET_OPACUS_OVER_DPTRAIN}); peak memory dptrain/Opacus ghost "
          f"{_fmt(summary.get('peak_memory_ratio'), '.2f')} (target <= 1)")
    print(f"machine: {summary['machine']}; load average (1, 5, 15 min) at start "
          f"{summary['load_average']['start']}, at end {summary['load_average']['end']}; "
          f"commit {summary['git_commit']}; {summary['date']}")


def tiny_config() -> BenchConfig:
    """A seconds-long smoke configuration (tests): tiny models, one round, no memory runs."""
    return BenchConfig(gpt2=GPT2Shape(num_layers=1, width=32, num_heads=2, vocab_size=64,
                                      seq_len=8, batch_size=4),
                       llama=GPT2Shape(num_layers=1, width=32, num_heads=2, vocab_size=64,
                                       seq_len=8, batch_size=4),
                       resnet=ResNetShape(name="nf_resnet26", image_size=32, batch_size=2),
                       vit=ResNetShape(name="vit_tiny_patch16_224", image_size=16, batch_size=2,
                                       timm_kwargs={"img_size": 16, "patch_size": 8,
                                                    "depth": 1}),
                       convnext=ResNetShape(name="convnext_atto", image_size=32, batch_size=2,
                                            timm_kwargs={"dims": (8, 16, 24, 32),
                                                         "depths": (1, 1, 1, 1)}),
                       rounds=1, resnet_rounds=1, warmup=1, memory=False)


def apply_threads(cfg: BenchConfig) -> None:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)


def run(cfg: BenchConfig, models=MODELS) -> dict:
    apply_threads(cfg)
    results: dict[str, Any] = {}
    load_start = load_average()
    t0 = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[dp_step {time.perf_counter() - t0:6.0f} s] {msg}", file=sys.stderr, flush=True)

    for kind in models:
        rounds = cfg.rounds if kind in ("gpt2", "llama") else cfg.resnet_rounds
        log(f"checking {kind}: each private variant's update against single-example backwards")
        checked = update_errors(kind, cfg)
        log(f"timing {kind}: {rounds} rounds x {len(VARIANTS)} variants")
        results[kind] = run_model(kind, cfg)
        results[kind]["update_error"] = checked
    if cfg.memory:
        for kind in models:
            log(f"peak memory {kind}: one fresh process per variant")
            results[kind]["memory"] = memory_of(kind, VARIANTS, cfg, results[kind]["errors"])
    summary = summarize(results, cfg)
    summary["load_average"]["start"] = load_start
    summary["elapsed_s"] = round(time.perf_counter() - t0, 1)
    log("done")
    return summary


def main(argv: list[str] | None = None) -> dict | None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--peak-child":
        kind, variant, cfg_json = argv[1:4]
        cfg = BenchConfig.from_json(cfg_json)
        apply_threads(cfg)
        warnings.simplefilter("ignore")
        emit_child_result(child_peak(lambda: build_variant(kind, variant, cfg),
                                     device=cfg.device, steps=cfg.memory_steps))
        return None
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds (smoke run)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--tiny", action="store_true", help="tiny models, for tests")
    ap.add_argument("--rounds", type=int, default=None, help="override the number of rounds")
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated: gpt2,nfresnet,vit,convnext,llama")
    ap.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args(argv)
    # Opacus's hooks on a model whose first layer takes integer ids
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    cfg = tiny_config() if args.tiny else BenchConfig()
    if args.quick:
        cfg.rounds, cfg.resnet_rounds, cfg.warmup = 2, 1, 1
    if args.rounds is not None:
        cfg.rounds = cfg.resnet_rounds = args.rounds
    if args.no_memory:
        cfg.memory = False
    cfg.device = args.device
    cfg.threads = args.threads
    models = tuple(m for m in args.models.split(",") if m)
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        ap.error(f"unknown model(s) {unknown}; choose from {MODELS}")
    summary = run(cfg, models)
    print_table(summary)
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
