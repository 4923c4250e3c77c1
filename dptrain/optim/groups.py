"""Parameter groups by name pattern, and the GPT-2 / causal LM / NF-ResNet / ViT / ConvNeXt presets.

Rules:
- a pattern is a Python regex matched with ``re.search`` against the parameter's name
  (``bias`` matches every bias; anchor with ``^...$`` for an exact name);
- the first group whose pattern matches a parameter takes it;
- a configured pattern that matches no parameter is an error naming ``optim.groups[i].pattern``;
- every trainable parameter lands in exactly one group; leftovers are an error listing them,
  unless a default group is given (the top-level optimizer of ``OptimConfig``).
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from dptrain.config import ConfigError
from dptrain.optim.optimizers import (OPTIMIZERS, check_options, optimizer_name_hint,
                                      optimizer_options)

__all__ = ["ParamGroupConfig", "ResolvedGroup", "resolve_groups", "PRESETS", "gpt2_groups",
           "causal_lm_groups", "nfresnet_groups", "vit_groups", "convnext_groups"]

NamedParams = list[tuple[str, torch.nn.Parameter]]


@dataclass(kw_only=True)
class ParamGroupConfig:
    pattern: str
    """Regex, matched with ``re.search`` against parameter names; first matching group wins."""
    optimizer: str
    """Optimizer of this group: one of sgd, adamw, muon, muon_bc, muon_s."""
    lr: float | None = None
    """Base learning rate of this group (the schedule multiplies it). Null: ``optim.lr``."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Options of the optimizer (e.g. momentum, betas, ns_steps); unknown names are errors.
    A group whose optimizer is ``optim.name`` also inherits the top-level options."""
    name: str | None = None
    """Label in logs (``DPOptimizer.lr``). Null: the config path, e.g. ``optim.groups[0]``."""

    def validate(self) -> None:
        try:
            re.compile(self.pattern)
        except re.error as e:
            raise ConfigError("pattern", f"not a valid regex: {e}") from None
        if self.optimizer not in OPTIMIZERS:
            hint = optimizer_name_hint("optimizer", self.optimizer)
            raise ConfigError("optimizer", f"must be one of {', '.join(OPTIMIZERS)}, "
                                           f"got {self.optimizer!r}"
                                           + (f"; {hint}" if hint else ""))
        if self.lr is not None and not (self.lr >= 0 and math.isfinite(self.lr)):
            raise ConfigError("lr", f"must be finite and >= 0, got {self.lr}")
        known = optimizer_options(self.optimizer)
        for key in self.kwargs:
            if key not in known:
                raise ConfigError(f"kwargs.{key}", f"not an option of {self.optimizer} "
                                                   f"(options: {', '.join(sorted(known))})")
        self.kwargs = check_options(self.kwargs, "kwargs.")


@dataclass
class ResolvedGroup:
    """A group with its parameters: what ``build_optimizer`` instantiates."""

    label: str  # for logs: config.name, else its config path ("optim.groups[0]")
    path: str  # config path to blame in errors ("optim.groups[0]", "optim", "optim.aux")
    config: ParamGroupConfig
    named_params: NamedParams


def resolve_groups(
    named_params: NamedParams,
    groups: list[tuple[str, ParamGroupConfig, bool]],
    default: tuple[str, ParamGroupConfig] | None = None,
) -> list[ResolvedGroup]:
    """Assign every parameter to the first matching group.

    ``groups``: (config path, config, required) in priority order; a required group that matches
    nothing raises ConfigError(f"{path}.pattern"). Unmatched parameters go to ``default``
    ((path, config)) or raise a ConfigError listing them. Empty groups are dropped.
    """
    compiled = [(path, cfg, required, re.compile(cfg.pattern))
                for path, cfg, required in groups]
    members: list[NamedParams] = [[] for _ in compiled]
    leftover: NamedParams = []
    for name, p in named_params:
        for k, (_, _, _, rx) in enumerate(compiled):
            if rx.search(name):
                members[k].append((name, p))
                break
        else:
            leftover.append((name, p))
    for k, ((path, cfg, required, rx), mem) in enumerate(zip(compiled, members)):
        if required and not mem:
            # the first matching group takes a parameter: say so when an earlier one took all
            first = next((compiled[j][0] for name, _ in named_params if rx.search(name)
                          for j in range(k) if compiled[j][3].search(name)), None)
            raise ConfigError(f"{path}.pattern",
                              f"{cfg.pattern!r} matches no trainable parameter" if first is None
                              else f"{cfg.pattern!r} matches only parameters that the earlier "
                                   f"{first} takes (the first group that matches a parameter "
                                   f"takes it)")
    resolved = [ResolvedGroup(cfg.name or path, path, cfg, mem)
                for (path, cfg, _, _), mem in zip(compiled, members) if mem]
    if leftover:
        if default is None:
            names = ", ".join(n for n, _ in leftover)
            raise ConfigError("optim.groups", f"parameters in no group: {names} (add a group, "
                                              "a preset, or set optim.unmatched: default)")
        path, cfg = default
        resolved.append(ResolvedGroup(cfg.name or "default", path, cfg, leftover))
    return resolved


def _exact(names: list[str]) -> str:
    """A regex matching exactly these names."""
    return "^(?:" + "|".join(re.escape(n) for n in names) + ")$"


def _split(named_params: NamedParams, is_matrix: Callable[[str, torch.Tensor], bool],
           main: ParamGroupConfig, aux: ParamGroupConfig) -> list[ParamGroupConfig]:
    matrices = [n for n, p in named_params if is_matrix(n, p)]
    others = [n for n, p in named_params if not is_matrix(n, p)]
    out = []
    if matrices:
        out.append(dataclasses.replace(main, pattern=_exact(matrices), name="matrices"))
    if others:
        out.append(dataclasses.replace(aux, pattern=_exact(others), name="others"))
    return out


_GPT2_AUX = re.compile(r"(^|\.)(wte|wpe|lm_head)(\.|$)")


def gpt2_groups(named_params: NamedParams, main: ParamGroupConfig,
                aux: ParamGroupConfig) -> list[ParamGroupConfig]:
    """GPT-2: ``main`` (Muon) for tensors with >= 2 dims except the token and position
    embeddings (wte, wpe) and the LM head; ``aux`` (AdamW) for those and all vectors/biases."""
    return _split(named_params, lambda n, p: p.ndim >= 2 and not _GPT2_AUX.search(n), main, aux)


#: a numbered block of a ModuleList (``model.layers.3.``, ``transformer.h.0.``)
_IN_BLOCK = re.compile(r"(^|\.)\d+\.")
#: an embedding, position table or LM head by its name (``model.embed_tokens``, ``wte``, a
#: ViT's ``patch_embed``/``pos_embed``, the relative position tables of BEiT, Swin and SAM's
#: attention, ``relative_position_bias_table`` and ``rel_pos_h``/``rel_pos_w``, and the small
#: MLPs that make such tables: vit_relpos' ``rel_pos.mlp``, Swin V2's ``cpb_mlp``)
EMBEDDING_NAME = re.compile(r"(^|\.)(\w*embed\w*|wte|wpe|lm_head|relative_position_bias_table"
                            r"|rel_pos\w*|cpb_mlp)(\.|$)")


def causal_lm_groups(named_params: NamedParams, main: ParamGroupConfig,
                     aux: ParamGroupConfig) -> list[ParamGroupConfig]:
    """transformers' decoder-only LMs (Llama, Qwen2, Mistral, ...): ``main`` (Muon) for the 2-D
    weights inside the repeated decoder blocks (``model.layers.N``: q/k/v/o, gate/up/down
    projections); ``aux`` (AdamW) for the token embedding, the LM head (tied or not), the
    norms' weights and every bias (Qwen2's q/k/v biases)."""
    return _split(named_params, lambda n, p: (p.ndim == 2 and bool(_IN_BLOCK.search(n))
                                              and not EMBEDDING_NAME.search(n)), main, aux)


_CLASSIFIER = re.compile(r"(^|\.)(head|fc|classifier)(\.|$)")


def nfresnet_groups(named_params: NamedParams, main: ParamGroupConfig,
                    aux: ParamGroupConfig) -> list[ParamGroupConfig]:
    """NF-ResNet: ``main`` (Muon) for conv weights (4-D ``*.weight``); ``aux`` (AdamW or SGD)
    for gains (timm's ScaledStdConv2d ``gain`` is (out, 1, 1, 1)), biases and the classifier."""
    return _split(
        named_params,
        lambda n, p: p.ndim == 4 and n.endswith("weight") and not _CLASSIFIER.search(n),
        main, aux)


_VIT_HEADS = re.compile(r"(^|\.)(head|head_dist|classifier)(\.|$)")


def vit_groups(named_params: NamedParams, main: ParamGroupConfig,
               aux: ParamGroupConfig) -> list[ParamGroupConfig]:
    """Vision transformers (timm's ViT and DeiT, transformers' ViT): ``main`` (Muon) for the 2-D
    weights of the blocks (attention and MLP projections); ``aux`` (AdamW) for the patch
    embedding (a 4-D convolution, or a Linear), the class, register and distillation tokens and
    the position tables (absolute, 3-D; relative, 2-D), norms, biases and the classifier."""
    return _split(named_params, lambda n, p: (p.ndim == 2 and not _VIT_HEADS.search(n)
                                              and not EMBEDDING_NAME.search(n)), main, aux)


#: (and the LoRA factors of those Linears: ``...mlp.fc1.lora_A.default.weight``)
_CONVNEXT_MATRICES = re.compile(r"(\.mlp\.fc[12]|\.downsample\.\d+)(\.lora_[AB]\.[^.]+)?\.weight$")


def convnext_groups(named_params: NamedParams, main: ParamGroupConfig,
                    aux: ParamGroupConfig) -> list[ParamGroupConfig]:
    """timm's ConvNeXt: ``main`` (Muon) for the blocks' pointwise MLP weights (2-D Linear, or
    4-D 1x1 convolutions in the ``conv_mlp`` variants: atto, femto, pico, nano) and the
    stages' downsampling convolutions; ``aux`` (AdamW) for the stem (as a ViT's patch
    embedding), the depth-wise 7x7 convolutions (one filter per channel: no matrix to
    orthogonalise), the layer scales, norms, biases and the classifier."""
    return _split(named_params,
                  lambda n, p: p.ndim >= 2 and bool(_CONVNEXT_MATRICES.search(n)), main, aux)


PRESETS: dict[str, Callable[[NamedParams, ParamGroupConfig, ParamGroupConfig],
                            list[ParamGroupConfig]]] = {
    "gpt2": gpt2_groups,
    "causal_lm": causal_lm_groups,
    "nfresnet": nfresnet_groups,
    "vit": vit_groups,
    "convnext": convnext_groups,
}
