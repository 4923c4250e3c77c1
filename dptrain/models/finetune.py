"""Parameter-efficient private fine-tuning: LoRA adapters (peft) and frozen parameters.

``model.lora`` injects peft's LoRA adapters into the chosen linear layers of any model family
(``peft.inject_adapter_in_model``: the model keeps its class and its forward, each target
``X`` becomes ``X.base_layer`` plus ``X.lora_A.default``/``X.lora_B.default``, two
``nn.Linear``). ``model.trainable`` lists regexes of the parameters to train besides the
adapters (DP-BiTFiT's biases, a head, the last blocks); without LoRA it selects every trained
parameter. Everything else is frozen: ``requires_grad=False``.

What freezing means for privacy: the engine clips each example's gradient over the trainable
coordinates only (that is the whole query: frozen coordinates never change, so they release
nothing), the release adds noise to those coordinates, and the accountant is unchanged. The
adapters' factors are plain ``nn.Linear`` layers to the clipping engine, so their per-example
norms are exact ghost norms; the frozen base layers only pass gradients through.

Only ``nn.Linear`` and transformers' ``Conv1D`` (GPT-2) may be LoRA targets. The final model is
written with the adapters merged (``W + scaling * B A``; for Conv1D, whose weight is stored
(in, out), its transpose), a plain model of the original architecture; peft's own merge is the
reference in the tests. A weight-standardised convolution (timm's ScaledStdConv2d) is refused:
its forward standardises the weight, so an adapter added to its output cannot be merged into it.
So is a layer whose weight is tied to another (GPT-2's lm_head): the merged weight would no
longer be the one tied tensor.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from dptrain.config import ConfigError, shown

__all__ = ["LoRAConfig", "apply_finetuning", "validate_trainable", "lora_layers", "merged_state",
           "adapter_state", "write_adapter", "describe"]

#: the name peft gives the one adapter dptrain injects
ADAPTER = "default"


@dataclass(kw_only=True)
class LoRAConfig:
    r: int = 0
    """Rank of the LoRA adapters (0: no adapters). With r > 0, every parameter of the model is
    frozen except the adapters' factors (and ``model.trainable``'s matches)."""
    alpha: float | None = None
    """LoRA's alpha: the adapter's output is scaled by alpha / r (alpha / sqrt(r) with
    ``rslora``). Null: alpha = r (scale 1)."""
    dropout: float = 0.0
    """Dropout on the adapters' input (peft's ``lora_dropout``); per-example masks like every
    dropout of dptrain."""
    target_modules: list[str] | None = None
    """Names of the layers that get adapters, each a module name or its last components
    (``c_attn`` matches ``transformer.h.0.attn.c_attn``; peft's matching). Null: peft's default
    for the transformers model type (GPT-2: ``c_attn``; Llama, Qwen2, Mistral: ``q_proj``,
    ``v_proj``); timm and cnn models need the list. Every target must be ``nn.Linear`` or
    transformers' ``Conv1D``."""
    rslora: bool = False
    """Rank-stabilised LoRA: scale alpha / sqrt(r) instead of alpha / r (peft's
    ``use_rslora``)."""

    @property
    def enabled(self) -> bool:
        return self.r > 0

    def validate(self) -> None:
        if self.r < 0:
            raise ConfigError("r", f"must be >= 0 (0: no adapters), got {self.r}")
        if not self.enabled:
            for name, default in (("alpha", None), ("dropout", 0.0), ("target_modules", None),
                                  ("rslora", False)):
                if getattr(self, name) != default:
                    raise ConfigError(name, "applies only with model.lora.r > 0 (r is 0: no "
                                            "adapters), so it would be ignored; remove it or "
                                            "set model.lora.r")
            return
        if self.alpha is not None and not (self.alpha > 0 and math.isfinite(self.alpha)):
            raise ConfigError("alpha", f"must be finite and > 0 (null: r), got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError("dropout", f"must be in [0, 1), got {self.dropout}")
        if self.target_modules is not None:
            if not self.target_modules or not all(isinstance(t, str) and t.strip(".")
                                                  for t in self.target_modules):
                raise ConfigError("target_modules", f"must be a non-empty list of module "
                                                    f"names, got {self.target_modules!r}")


def validate_trainable(patterns: list[str] | None) -> None:
    """``model.trainable``: a list of valid regexes, or null."""
    if patterns is None:
        return
    if not isinstance(patterns, list) or not patterns:
        raise ConfigError("trainable", f"must be a non-empty list of regexes over parameter "
                                       f"names (null: every parameter), got {patterns!r}")
    for i, p in enumerate(patterns):
        try:
            re.compile(p)
        except (re.error, TypeError) as e:
            raise ConfigError(f"trainable[{i}]", f"not a valid regex: {e}") from None


def _lora_types() -> tuple[type, ...]:
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # pragma: no cover
        return (nn.Linear,)
    return (nn.Linear, Conv1D)


def _targets(model: nn.Module, names: list[str]) -> dict[str, nn.Module]:
    """The modules peft would give adapters: a name equal to a target or ending in
    ``.target``. Each target must name at least one module, and each module must be exactly
    ``nn.Linear`` or ``Conv1D``; otherwise ConfigError naming ``model.lora.target_modules``."""
    found: dict[str, nn.Module] = {}
    for t in names:
        hits = {n: m for n, m in model.named_modules()
                if n and (n == t or n.endswith("." + t))}
        if not hits:
            raise ConfigError("model.lora.target_modules",
                              f"{t!r} names no module of this model")
        found.update(hits)
    bad = {n: type(m).__name__ for n, m in found.items() if type(m) not in _lora_types()}
    if bad:
        n, kind = next(iter(bad.items()))
        raise ConfigError("model.lora.target_modules",
                          f"{n} is a {kind}; LoRA targets must be nn.Linear or transformers' "
                          f"Conv1D layers ({len(bad)} such module(s))")
    names: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    for n, m in found.items():
        shared = [x for x in names[id(m.weight)] if x != f"{n}.weight"]
        if shared:  # the merged weight would no longer be the tied one
            raise ConfigError("model.lora.target_modules",
                              f"{n}'s weight is tied to {shared[0]}: an adapter on it could "
                              f"not be merged into one tied tensor (untie the embeddings, "
                              f"model.tie_embeddings: false, or leave {n} out)")
    return found


def _default_targets(model: nn.Module) -> list[str]:
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING

    model_type = getattr(getattr(model, "config", None), "model_type", None)
    targets = TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING.get(model_type)
    if not targets:
        raise ConfigError("model.lora.target_modules",
                          f"peft has no default target modules for "
                          f"{model_type or type(model).__name__}; list the linear layers "
                          f"to adapt")
    return list(targets)


def apply_finetuning(model: nn.Module, lora: LoRAConfig, trainable: list[str] | None) -> None:
    """Inject ``lora``'s adapters (when enabled) and freeze every parameter that is neither an
    adapter's nor matched by a ``trainable`` regex (``re.search`` on every name of a parameter,
    tied names included). Nothing to do when both are off. Raises ConfigError naming the
    field: a regex that matches no parameter, a target that names no module or one that is not
    a linear layer."""
    if not lora.enabled and trainable is None:
        return
    if lora.enabled:
        from peft import inject_adapter_in_model

        targets = lora.target_modules or _default_targets(model)
        found = _targets(model, targets)
        conv1d = any(type(m) is not nn.Linear for m in found.values())
        _note_rank(lora.r, found)
        with warnings.catch_warnings():  # fan_in_fan_out, set per layer by peft when mixed
            warnings.filterwarnings("ignore", message=".*fan_in_fan_out.*")
            inject_adapter_in_model(_peft_config(lora, targets, conv1d), model,
                                    adapter_name=ADAPTER)
    for p in model.parameters():
        p.requires_grad_(False)
    for p in _adapter_parameters(lora_layers(model)):
        p.requires_grad_(True)
    named = list(model.named_parameters(remove_duplicate=False))
    for i, pattern in enumerate(trainable or []):
        rx = re.compile(pattern)
        hits = [p for n, p in named if rx.search(n)]
        if not hits:
            raise ConfigError(f"model.trainable[{i}]", _no_match(pattern, named, lora))
        for p in hits:
            p.requires_grad_(True)


def _note_rank(r: int, found: dict[str, nn.Module]) -> None:
    """A note on stderr when ``r`` exceeds a target's smaller dimension: its update ``B A``
    cannot have rank above that, so the surplus only adds factor coordinates (each clipped
    and noised) and memory. Allowed, as peft allows it."""
    over = {n: min(m.weight.shape) for n, m in found.items() if min(m.weight.shape) < r}
    if not over:
        return
    name, rank = next(iter(over.items()))
    more = f" (and {len(over) - 1} more target layer(s))" if len(over) > 1 else ""
    print(f"dptrain: note: model.lora.r = {r} exceeds the rank of {name} ({rank}){more}: its "
          f"adapter's update has rank at most {rank}, as the full layer's would; the surplus "
          f"only adds noised coordinates and memory (model.lora.r <= {min(over.values())} "
          f"loses nothing)", file=sys.stderr)


def _no_match(pattern: str, named: list[tuple[str, nn.Parameter]], lora: LoRAConfig) -> str:
    """Why ``pattern`` of ``model.trainable`` is refused: the parameters it would match under
    the base model's names (peft renamed its targets' own ones ``<layer>.base_layer.<name>``),
    else the names closest to it (difflib), else the first ones."""
    import difflib

    names = list(dict.fromkeys(n for n, _ in named))
    rx = re.compile(pattern)
    close = [n for n in names
             if ".base_layer." in n and rx.search(n.replace(".base_layer.", "."))]
    if not close:
        # a name's runs of components (``c_attn.bias``, ``ln_f`` of ``transformer.ln_f.bias``)
        # are compared with the regex's text (``c_attn\.bias$`` as ``c_attn.bias``)
        tails: dict[str, str] = {}
        for n in names[:5000]:  # (a bound on an error path's work: seconds on MoE models)
            parts = n.split(".")
            for i in range(len(parts)):
                for j in range(i + 1, len(parts) + 1):
                    tails.setdefault(".".join(parts[i:j]), n)
        plain = re.sub(r"\\(.)", r"\1", pattern).strip("^$")
        close = list(dict.fromkeys(tails[t] for t in difflib.get_close_matches(
            plain, list(tails), n=10, cutoff=0.6)))
    text = (f"{shown(pattern)} matches no parameter of this model "
            f"({'closest: ' if close else 'e.g. '}{', '.join((close or names)[:3])})")
    renamed = next((n for n in names if ".base_layer." in n), None)
    if lora.enabled and renamed is not None:
        text += (f"; with LoRA an adapted layer's own parameters are named "
                 f"<layer>.base_layer.<name>, e.g. {renamed}")
    return text


def _peft_config(lora: LoRAConfig, targets: list[str], fan_in_fan_out: bool):
    """peft's ``LoraConfig`` of ``lora`` (what is injected, and what ``final/adapter`` says)."""
    from peft import LoraConfig

    return LoraConfig(r=lora.r, lora_alpha=lora.alpha if lora.alpha is not None else lora.r,
                      lora_dropout=lora.dropout, target_modules=list(targets),
                      fan_in_fan_out=fan_in_fan_out, use_rslora=lora.rslora, bias="none")


def lora_layers(model: nn.Module) -> dict[str, nn.Module]:
    """{module name: peft LoRA layer} of ``model`` (empty without adapters)."""
    if "peft" not in sys.modules:  # never imported: no adapters anywhere (and no import cost)
        return {}
    from peft.tuners.lora import LoraLayer

    return {n: m for n, m in model.named_modules() if isinstance(m, LoraLayer)}


def _adapter_parameters(layers: dict[str, nn.Module]) -> list[nn.Parameter]:
    """The LoRA factors' weights of ``layers`` (:func:`lora_layers`)."""
    return [p for m in layers.values() for part in (m.lora_A[ADAPTER], m.lora_B[ADAPTER])
            for p in part.parameters()]


def merged_state(state: dict[str, Tensor], model: nn.Module) -> dict[str, Tensor]:
    """``state`` (a full state dict of ``model``, adapters in it) as the state dict of the
    original architecture: every LoRA layer ``X`` becomes ``X.weight = W + scaling * B A``
    (transposed for a fan-in-fan-out Conv1D) and ``X.bias``, in the order of ``state``. The
    state itself when the model has no adapters."""
    layers = lora_layers(model)
    if not layers:
        return state
    out: dict[str, Tensor] = {}
    for key, value in state.items():
        prefix, sep, rest = key.partition(".base_layer.")
        if sep and prefix in layers:
            if rest == "weight":
                m = layers[prefix]
                a = state[f"{prefix}.lora_A.{ADAPTER}.weight"]
                b = state[f"{prefix}.lora_B.{ADAPTER}.weight"]
                delta = (b.to(torch.float64) @ a.to(torch.float64)) * m.scaling[ADAPTER]
                if m.fan_in_fan_out:
                    delta = delta.T
                value = (value.to(torch.float64) + delta).to(value.dtype)
            out[f"{prefix}.{rest}"] = value
        elif ".lora_" in key and key.split(".lora_")[0] in layers:
            continue  # the factors, merged above
        else:
            out[key] = value
    return out


def adapter_state(state: dict[str, Tensor], model: nn.Module) -> dict[str, Tensor]:
    """The adapters' tensors of ``state`` under the names peft's ``PeftModel`` saves:
    ``base_model.model.X.lora_A.weight``."""
    out = {}
    for name in lora_layers(model):
        for part in ("lora_A", "lora_B"):
            out[f"base_model.model.{name}.{part}.weight"] = state[f"{name}.{part}.{ADAPTER}.weight"]
    return out


def write_adapter(state: dict[str, Tensor], model: nn.Module, lora: LoRAConfig,
                  directory, base_model: str | None = None) -> bool:
    """Write peft's adapter folder (``adapter_config.json``, ``adapter_model.safetensors``)
    for ``PeftModel.from_pretrained(base, directory)``; ``base_model`` (model.pretrained_path,
    written absolute) is its ``base_model_name_or_path``. Only when the adapters are all that
    was trained (a parameter of ``model.trainable`` is not part of a LoRA adapter, so only the
    merged model holds it) and the targets are all Linear or all Conv1D (peft's config has one
    ``fan_in_fan_out``): returns whether it was written. Mixed targets say on stderr why the
    folder is not written (a user who listed them expects it)."""
    layers = lora_layers(model)
    if not lora.enabled or not layers:
        return False
    adapter_params = {id(p) for p in _adapter_parameters(layers)}
    if any(p.requires_grad and id(p) not in adapter_params for p in model.parameters()):
        return False
    fan_in_fan_out = {m.fan_in_fan_out for m in layers.values()}
    if len(fan_in_fan_out) > 1:  # Conv1D and Linear targets: one adapter_config cannot
        # describe both (peft would reload the adapter to other logits)
        conv1d = next(n for n, m in layers.items() if m.fan_in_fan_out)
        linear = next(n for n, m in layers.items() if not m.fan_in_fan_out)
        print(f"dptrain: note: {directory} is not written: the LoRA targets mix transformers' "
              f"Conv1D ({conv1d}) and nn.Linear ({linear}) layers, which one peft adapter "
              f"config (one fan_in_fan_out) cannot describe; the merged model in "
              f"{Path(directory).parent} holds the adapters", file=sys.stderr)
        return False
    config = _peft_config(lora, lora.target_modules or _default_targets(model),
                          fan_in_fan_out.pop())
    if base_model is not None:
        config.base_model_name_or_path = str(Path(base_model).expanduser().absolute())
    from safetensors.torch import save_file

    directory = Path(directory)
    tmp = directory.parent / f".tmp-{directory.name}-{os.getpid()}"
    # (any left by a write killed before its rename, whatever its pid: one writer per output
    # directory, as for the checkpoints' and the Hugging Face export's .tmp-*)
    for stale in directory.parent.glob(f".tmp-{directory.name}-*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp.mkdir(parents=True)
    config.save_pretrained(str(tmp))
    # peft keeps target_modules as a set, written in the order of this process's string
    # hashing: sorted, so that two runs of one config write the same bytes
    path = tmp / "adapter_config.json"
    written = json.loads(path.read_text())
    if isinstance(written.get("target_modules"), list):
        written["target_modules"] = sorted(written["target_modules"])
        path.write_text(json.dumps(written, indent=2, sort_keys=True) + "\n")
    save_file({k: v.contiguous() for k, v in adapter_state(state, model).items()},
              str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
    if directory.exists():
        shutil.rmtree(directory)
    os.replace(tmp, directory)
    return True


def describe(model: nn.Module) -> dict[str, Any]:
    """Counts for the run's log: trainable and total parameters, adapters."""
    seen: set[int] = set()
    total = trainable = 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel()
        trainable += p.numel() if p.requires_grad else 0
    return {"trainable_parameters": trainable, "total_parameters": total,
            "lora_layers": len(lora_layers(model))}

