"""Models: GPT-2 and other decoder-only causal LMs (transformers: Llama, Qwen2, Mistral, ...),
timm image models (NF-ResNet, ViT), a tiny GroupNorm CNN.

``build_model(cfg, info)`` returns a plain ``nn.Module``; the clipping engine computes
per-example norms from its layers (transformers' ``Conv1D`` and tied embeddings included), so
models are built exactly as their libraries define them. BatchNorm is refused everywhere: it
mixes the examples of a batch, so one example's gradient would depend on the others and
per-example clipping would no longer bound its influence.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from dptrain.config import ConfigError, refuse_unused, require_file
from dptrain.data.info import DataInfo
from dptrain.messages import brief

__all__ = [
    "ModelConfig",
    "build_model",
    "trainable_named_parameters",
    "check_no_batchnorm",
    "TinyCNN",
]

from dptrain.models.cnn import TinyCNN
from dptrain.models.finetune import LoRAConfig, apply_finetuning, validate_trainable


@dataclass(kw_only=True)
class ModelConfig:
    name: Literal["gpt2", "timm", "cnn", "causal_lm"] = "gpt2"
    """Model family: ``gpt2`` (transformers' GPT2LMHeadModel, for LM data), ``causal_lm`` (any
    decoder-only ``AutoModelForCausalLM`` of transformers: Llama, Qwen2, Mistral, ..., built from
    ``hf_config`` or loaded from ``pretrained_path``), ``timm`` (any timm image model without
    BatchNorm, e.g. nf_resnet50) or ``cnn`` (tiny GroupNorm CNN, MNIST)."""

    # --- gpt2 ---
    n_layer: int = 12
    """gpt2: number of transformer blocks (GPT-2 small: 12)."""
    n_embd: int = 768
    """gpt2: hidden width (GPT-2 small: 768); must be divisible by n_head."""
    n_head: int = 12
    """gpt2: attention heads (GPT-2 small: 12)."""
    n_positions: int = 1024
    """gpt2: longest sequence the position embedding covers; must be >= the data's longest
    example (prompt + target + EOS)."""
    vocab_size: int | None = None
    """gpt2, causal_lm: token vocabulary. Null: the data's vocabulary (50,257 for the GPT-2
    tokenizer, 257 for bytes, ``len(tokenizer)`` for ``data.tokenizer: hf``). If set, it must
    be >= the data's vocabulary (extra rows are unused); with a checkpoint, the checkpoint's."""
    tie_embeddings: bool = True
    """gpt2, causal_lm: share the input embedding and the LM head weight (GPT-2's default;
    transformers' ``tie_word_embeddings``). A checkpoint must have the same setting: Llama and
    Mistral checkpoints have an untied head (set false), Qwen2-0.5B a tied one. A tied
    checkpoint whose weights hold a head that differs from its embedding is refused."""
    dropout: float = 0.0
    """gpt2: dropout probability for embeddings, attention and residuals (GPT-2 used 0.1).
    causal_lm: every dropout probability of the model's config (Llama, Qwen2, Mistral: their
    ``attention_dropout``; a family without one refuses a non-zero value). 0 by default so that
    a forward is deterministic; dropout is per example and allowed (with dropout a causal_lm
    runs eager attention, whose dropout dptrain's per-example masks replace; without, sdpa,
    except in bfloat16 or for a family without it: ``_attention``)."""
    pretrained_path: str | None = None
    """gpt2, causal_lm: directory of a HF-format checkpoint (config.json + weights; ``~``
    expanded), loaded with ``from_pretrained(local_files_only=True)``. Null: random
    initialisation from the fields above (gpt2) or from ``hf_config`` (causal_lm). With a
    checkpoint, the architecture comes from it; only dropout is overridden. Every tensor of the
    model must be in it (a partial or foreign folder is refused, not completed at random), and
    it is loaded in float32 whatever its saved dtype. A run's ``final/hf`` folder is such a
    checkpoint (training continues). timm: a weights file (``.safetensors``, or a torch
    ``.pth``/``.bin`` state dict, also nested under ``state_dict`` or ``model``) for the model
    ``timm_name`` and ``timm_kwargs`` build. A file that does not fit as it is gets what timm's
    own loading does, without the hub: the model family's ``checkpoint_filter_fn`` (a ViT's
    position table and patch embedding resampled to ``img_size``/``patch_size``; other
    repositories' layouts converted), and the first convolution adapted to ``in_chans``
    (grey-scale sums the RGB filters); each change is logged. Then every tensor must be in it
    with the model's shape, except the classifier's, which is initialised afresh when
    ``num_classes`` differs from the file's (fine-tuning on other classes); a tensor the model
    lacks is refused too."""

    # --- causal_lm ---
    hf_config: dict[str, Any] = field(default_factory=dict)
    """causal_lm without ``pretrained_path``: the transformers config of a model built from
    scratch, ``AutoConfig.for_model(**hf_config)`` then ``AutoModelForCausalLM.from_config``,
    e.g. ``{model_type: llama, hidden_size: 64, intermediate_size: 128, num_hidden_layers: 2,
    num_attention_heads: 4, num_key_value_heads: 2, max_position_embeddings: 128}``. Needs a
    decoder-only ``model_type`` (llama, qwen2, mistral, ...); a key the config class does not
    know is refused. ``vocab_size``, ``tie_word_embeddings`` and the dropout probabilities are
    set by model.vocab_size, model.tie_embeddings and model.dropout; the attention
    implementation by dptrain (sdpa; eager with dropout, in bfloat16, or for a family without
    sdpa). With ``pretrained_path``: empty (the
    checkpoint's config.json decides)."""

    # --- timm ---
    timm_name: str = "nf_resnet50"
    """timm: model name for ``timm.create_model(name, pretrained=False)``. Models with
    BatchNorm (resnet50, ...) are refused; the NF-ResNets have none, nor do the ViTs,
    ConvNeXts and NFNets (their tokens, position tables, layer scales and gains are tapped:
    README, "What the engine needs of a model")."""
    num_classes: int | None = None
    """timm/cnn: output classes. Null: the data's number of classes."""
    in_chans: int | None = None
    """timm/cnn: input channels. Null: the data's channels."""
    drop_path_rate: float = 0.0
    """timm: stochastic depth (timm's ``drop_path_rate``; per-example masks from the counter-based
    stream of dptrain/models/dropout.py, like dropout). 0: off."""
    timm_kwargs: dict[str, Any] = field(default_factory=dict)
    """timm: further keyword arguments of ``timm.create_model``, e.g. ``{img_size: 32,
    patch_size: 4}`` for a ViT on small images (a ViT is built for one image size). An argument
    the model does not take is refused; ``num_classes``, ``in_chans``, ``drop_path_rate`` and
    ``pretrained`` have fields of their own (``pretrained_path`` for weights)."""

    # --- cnn ---
    channels: list[int] = field(default_factory=lambda: [16, 32])
    """cnn: output channels of each conv3x3 -> GroupNorm -> ReLU -> maxpool2 stage."""
    groups: int = 4
    """cnn: GroupNorm groups per stage (reduced to a divisor of the stage's channels)."""
    pool: int = 4
    """cnn: the features are average-pooled to pool x pool cells before the head."""
    hidden: int = 32
    """cnn: width of the hidden linear layer before the head (0: none)."""

    # --- every family: parameter-efficient fine-tuning (dptrain/models/finetune.py) ---
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """LoRA adapters (peft) on the model's linear layers: ``r > 0`` freezes every other
    parameter (``model.trainable`` adds some back). The final model is written with the
    adapters merged (a plain model of the same architecture), and, when the adapters are all
    that was trained, ``final/adapter/`` for peft's ``PeftModel.from_pretrained`` (not when the
    targets mix transformers' Conv1D and nn.Linear layers: a note on stderr says so)."""
    trainable: list[str] | None = None
    """Regexes (``re.search``) over parameter names: the parameters to train; every other one
    is frozen. Null: every parameter (or, with ``lora.r > 0``, only the adapters). E.g.
    ``['bias$']`` trains the biases alone (DP-BiTFiT), ``['^transformer\\.h\\.11\\.',
    'ln_f']`` the last GPT-2 block and the final norm. With LoRA the names are peft's
    (``...c_attn.base_layer.bias``). Each regex must match a parameter. The privacy guarantee
    is the same: the query is the clipped gradient of the trainable parameters."""

    def applicability(self) -> list[tuple[str, str, dict]]:
        """Which fields each model family reads (``dptrain.config.unused_fields``)."""
        return [("model.name", self.name, _MODEL_FIELDS)]

    def validate(self) -> None:
        refuse_unused(self)
        validate_trainable(self.trainable)
        if self.name in ("gpt2", "causal_lm"):  # the language models' shared fields
            if self.vocab_size is not None and self.vocab_size < 2:
                raise ConfigError("vocab_size", f"must be >= 2, got {self.vocab_size}")
            if not (0.0 <= self.dropout < 1.0):
                raise ConfigError("dropout", f"must be in [0, 1), got {self.dropout}")
            if self.pretrained_path is not None and not self.pretrained_path.strip():
                raise ConfigError("pretrained_path", "must not be empty (null: no "
                                                     "checkpoint)")
            if self.pretrained_path is not None:
                check_checkpoint_folder("pretrained_path", weights_path(self))
        if self.name == "gpt2":
            for f in ("n_layer", "n_embd", "n_head", "n_positions"):
                if getattr(self, f) < 1:
                    raise ConfigError(f, f"must be >= 1, got {getattr(self, f)}")
            if self.n_embd % self.n_head:
                raise ConfigError("n_embd", f"must be divisible by n_head={self.n_head}, "
                                            f"got {self.n_embd}")
        elif self.name == "causal_lm":
            if not isinstance(self.hf_config, dict):
                raise ConfigError("hf_config", f"must be a mapping of transformers config "
                                               f"settings, got {self.hf_config!r}")
            if self.pretrained_path is not None:
                if self.hf_config:
                    raise ConfigError("model.hf_config",
                                      "the checkpoint in model.pretrained_path has its own "
                                      "config.json, which decides the architecture: remove "
                                      "model.hf_config (model.dropout sets its dropout)")
            elif not self.hf_config:
                raise ConfigError("model.pretrained_path",
                                  "causal_lm needs a local checkpoint folder (config.json + "
                                  "weights) in model.pretrained_path, or model.hf_config with "
                                  "a model_type to build a model from scratch")
            else:
                scratch_config(self)  # the keys and values, before any data is read
        else:
            if self.num_classes is not None and self.num_classes < 1:
                raise ConfigError("num_classes", f"must be >= 1, got {self.num_classes}")
            if self.in_chans is not None and self.in_chans < 1:
                raise ConfigError("in_chans", f"must be >= 1, got {self.in_chans}")
            if not (0.0 <= self.drop_path_rate < 1.0):
                raise ConfigError("drop_path_rate", f"must be in [0, 1), got {self.drop_path_rate}")
            if not isinstance(self.timm_kwargs, dict):
                raise ConfigError("timm_kwargs", f"must be a mapping of keyword arguments, got "
                                                 f"{self.timm_kwargs!r}")
            for key in self.timm_kwargs:
                own = _TIMM_OWN_FIELDS.get(key)
                if own is not None:
                    raise ConfigError(f"timm_kwargs.{key}", f"set it with {own} instead")
            if self.pretrained_path is not None:
                require_file("pretrained_path", weights_path(self))
        if self.name == "timm" and not self.timm_name:
            raise ConfigError("timm_name", "must name a timm model, e.g. nf_resnet50")
        if self.name == "timm" and any(c in self.timm_name for c in ":/"):
            # timm reads "org/name", "hf-hub:..." and "local-dir:..." from the Hub or a folder
            raise ConfigError("timm_name", f"{self.timm_name!r} is not a timm model name: "
                                           "dptrain builds timm models by their registered "
                                           "names (e.g. nf_resnet50), offline; their weights "
                                           "come from model.pretrained_path")
        if self.name == "cnn":
            if not self.channels or any(c < 1 for c in self.channels):
                raise ConfigError("channels", f"must be a non-empty list of positive integers, "
                                              f"got {self.channels}")
            if self.groups < 1:
                raise ConfigError("groups", f"must be >= 1, got {self.groups}")
            if self.pool < 1:
                raise ConfigError("pool", f"must be >= 1, got {self.pool}")
            if self.hidden < 0:
                raise ConfigError("hidden", f"must be >= 0 (0: no hidden layer), got "
                                            f"{self.hidden}")


_MODEL_FIELDS = {
    **dict.fromkeys(("n_layer", "n_embd", "n_head", "n_positions"), ("gpt2",)),
    **dict.fromkeys(("vocab_size", "tie_embeddings", "dropout"), ("gpt2", "causal_lm")),
    "hf_config": ("causal_lm",),
    "pretrained_path": ("gpt2", "timm", "causal_lm"),
    **dict.fromkeys(("timm_name", "drop_path_rate", "timm_kwargs"), ("timm",)),
    **dict.fromkeys(("num_classes", "in_chans"), ("timm", "cnn")),
    **dict.fromkeys(("channels", "groups", "pool", "hidden"), ("cnn",)),
}
"""Which model.name reads each family-specific field (the rest apply to every family)."""


#: create_model's arguments that fields set: in timm_kwargs they are refused, naming the field
_TIMM_OWN_FIELDS = {"num_classes": "model.num_classes", "in_chans": "model.in_chans",
                    "drop_path_rate": "model.drop_path_rate",
                    "pretrained": "model.pretrained_path", "pretrained_cfg": "model.pretrained_path",
                    "pretrained_cfg_overlay": "model.pretrained_path",
                    "checkpoint_path": "model.pretrained_path"}


def weights_path(cfg: "ModelConfig") -> Path:
    """``model.pretrained_path`` as a path, ``~`` expanded (as the data paths are: a YAML value
    or a ``key=~/...`` override reaches dptrain unexpanded by the shell)."""
    return Path(cfg.pretrained_path).expanduser()


def check_checkpoint_folder(field: str, path: Path) -> None:
    """gpt2's and causal_lm's ``pretrained_path``: a Hugging Face checkpoint folder
    (``save_pretrained``'s output, with its ``config.json``), said plainly when it is not."""
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError(field, f"{path} holds no config.json: give a Hugging Face "
                                     f"checkpoint folder (save_pretrained's output: config.json "
                                     f"and the weights)")
        return
    if path.exists():
        raise ConfigError(field, f"{path} is a file, not a folder: gpt2 and causal_lm load a "
                                 f"Hugging Face checkpoint folder (save_pretrained's output: "
                                 f"config.json and the weights); a weights file is for timm "
                                 f"models")
    raise ConfigError(field, f"directory not found: {path}")


def _first_few(names: list[str]) -> str:
    """``a, b, c and 4 more``: the first three of ``names`` for a one-line message."""
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def check_no_batchnorm(model: nn.Module, field: str = "model.name") -> None:
    """Raise ConfigError(field) if ``model`` holds any BatchNorm layer (incl. SyncBatchNorm and
    timm's BatchNormAct2d, which subclass ``_BatchNorm``)."""
    bad = [name or "<root>" for name, m in model.named_modules()
           if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if bad:
        raise ConfigError(
            field,
            f"the model has BatchNorm layers ({_first_few(bad)}); BatchNorm mixes the examples "
            "of a batch, which breaks per-example clipping and the privacy guarantee. Use a "
            "model without BatchNorm (e.g. timm's nf_resnet50, or GroupNorm/LayerNorm)")


def _check_fits_images(model: nn.Module, cfg: ModelConfig, in_chans: int,
                       image_size: int | None) -> None:
    """One forward of a blank image of the data's size, in eval mode without gradients and
    without drawing random numbers: a timm model built for other images (a ViT for 224 pixels
    given 32, a ConvNeXt whose downsamplings leave nothing of 16 pixels) is a config error here,
    not a traceback, or a misleading refusal of the clipping engine, at the first step."""
    if image_size is None:
        return
    was_training = model.training
    model.eval()
    first: list[nn.Conv2d] = []  # the first convolution the image itself goes through

    def on_image(module, args):
        x = args[0] if args else None
        if (not first and isinstance(x, torch.Tensor) and x.dim() == 4
                and tuple(x.shape[1:]) == (in_chans, image_size, image_size)):
            first.append(module)

    hooks = [m.register_forward_pre_hook(on_image) for m in model.modules()
             if isinstance(m, nn.Conv2d)]
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            model(torch.zeros(1, in_chans, image_size, image_size))
    except (RuntimeError, AssertionError, ValueError, IndexError) as e:
        field_ = "model.timm_kwargs" if cfg.timm_kwargs else "model.timm_name"
        hint = ("; a ViT is built for one image size: set model.timm_kwargs.img_size"
                if hasattr(model, "patch_embed") else "")
        built = f" with timm_kwargs {cfg.timm_kwargs}" if cfg.timm_kwargs else ""
        raise ConfigError(field_, f"{cfg.timm_name}{built} cannot take the data's {in_chans} x "
                                  f"{image_size} x {image_size} images: {type(e).__name__}: "
                                  f"{str(e).rstrip('.')}{hint}") from None
    finally:
        for h in hooks:
            h.remove()
        model.train(was_training)
    left = _rows_left_out(first[0], image_size) if first else 0
    if left > 0:
        # a ViT's patch embedding (kernel = stride = the patch size, no padding), a ConvNeXt's
        # stem (4, 4): the pixels past the last whole window are left out of every image in
        # silence (16 px in patches of 5: the last row and column); overlapping ones (PVT-v2's
        # kernel 7, stride 4, padding 3) cover more sizes
        conv = first[0]
        field_ = next((f"model.timm_kwargs.{k}" for k in ("patch_size", "img_size")
                       if k in cfg.timm_kwargs), "model.timm_name")
        raise ConfigError(field_, f"{cfg.timm_name}'s first convolution (kernel "
                                  f"{tuple(conv.kernel_size)}, stride {tuple(conv.stride)}) does "
                                  f"not cover the data's {image_size} x {image_size} images: it "
                                  f"would leave out the last {left} of every image's "
                                  f"{image_size} rows or columns; choose a patch size (or "
                                  f"data.image_size) that tiles them")


def _rows_left_out(conv: nn.Conv2d, size: int) -> int:
    """How many of an image's last rows or columns (of ``size``) a convolution's windows never
    reach: 0 for timm's ``*Same`` convolutions, which pad at call time to cover them."""
    if type(conv).__name__.endswith("Same") or conv.padding == "same":
        return 0
    pad = (0,) * len(conv.kernel_size) if conv.padding == "valid" else conv.padding
    return max((size + 2 * p - (d * (k - 1) + 1)) % s - p for k, s, p, d in
               zip(conv.kernel_size, conv.stride, pad, conv.dilation))


def _load_timm_weights(model: nn.Module, path: Path) -> None:
    """Load a timm model's weights from a local file (no hub): every tensor with the model's
    shape, except the classifier's when its shape differs (kept as initialised: fine-tuning on
    other classes); missing, extra or other-shaped tensors are a ConfigError."""
    field_ = "model.pretrained_path"
    require_file(field_, path)
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(path), device="cpu")
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file is the field's error
        # the first line: torch's weights-only refusal explains itself over several paragraphs
        raise ConfigError(field_, f"cannot read {path}: {brief(e)}") from None
    for key in ("state_dict", "model"):
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor)
                                              for v in state.values()):
        raise ConfigError(field_, f"{path} holds no state dict of tensors")
    state = {k.removeprefix("module."): v for k, v in state.items()}
    own = model.state_dict()
    state, adapted = _adapt_timm_state(model, state, own, field_, path)
    heads = getattr(model, "pretrained_cfg", {}).get("classifier") or ()
    heads = (heads,) if isinstance(heads, str) else tuple(heads)
    fresh = sorted(k for k, v in state.items() if k in own and v.shape != own[k].shape
                   and any(k.startswith(h + ".") for h in heads))
    for k in fresh:
        del state[k]
    missing = sorted(k for k in own if k not in state and k not in fresh)
    extra = sorted(k for k in state if k not in own)
    shapes = sorted(f"{k} {tuple(state[k].shape)} vs {tuple(own[k].shape)}" for k in state
                    if k in own and state[k].shape != own[k].shape)
    for what, bad in (("lacks", missing), ("has tensors the model does not", extra),
                      ("has other shapes for", shapes)):
        if bad:
            raise ConfigError(field_, f"{path} {what} ({len(bad)}: {_first_few(bad)}): it is "
                                      f"not a checkpoint of this model (model.timm_name, "
                                      f"model.timm_kwargs)")
    model.load_state_dict(state, strict=False)  # (every other key checked above)
    import logging

    log = logging.getLogger(__name__)
    if adapted:
        log.info("%s: adapted to the model (%s)", path, ", ".join(adapted))
    if fresh:
        log.info("%s: classifier initialised afresh (%s)", path, ", ".join(fresh))


def _adapt_timm_state(model: nn.Module, state: dict, own: dict, field_: str,
                      path: Path) -> tuple[dict, list[str]]:
    """What timm's own pretrained loading does to a file that does not fit the model as built,
    without the hub: the model family's ``checkpoint_filter_fn`` (a ViT's position table and
    patch embedding resampled to ``img_size``/``patch_size``, other repositories' key layouts
    converted), then the first convolution's input channels adapted to ``in_chans``
    (``timm.models.adapt_input_conv``: a grey-scale model sums the RGB filters). A file that
    already fits is returned unchanged. Returns the state and a description of each change."""
    def fits(st):
        return st.keys() == own.keys() and all(v.shape == own[k].shape for k, v in st.items())

    if fits(state):
        return state, []
    before = {k: tuple(v.shape) for k, v in state.items()}
    module = sys.modules.get(type(model).__module__)
    filter_fn = getattr(module, "checkpoint_filter_fn", None)
    if callable(filter_fn):
        try:
            state = filter_fn(dict(state), model)
        except Exception as e:  # noqa: BLE001 - a file the family's converter cannot read
            raise ConfigError(field_, f"{path} does not fit {type(model).__name__} and timm's "
                                      f"checkpoint_filter_fn refused it: {type(e).__name__}: "
                                      f"{e}") from None
    first = getattr(model, "pretrained_cfg", {}).get("first_conv") or ()
    for name in (first,) if isinstance(first, str) else tuple(first):
        key = name + ".weight"
        conv = model.get_submodule(name) if key in own else None
        w = state.get(key)
        if (isinstance(conv, nn.Conv2d) and conv.groups == 1 and w is not None and w.ndim == 4
                and w.shape[1] != own[key].shape[1] and w.shape[0] == own[key].shape[0]
                and w.shape[2:] == own[key].shape[2:]):
            from timm.models import adapt_input_conv

            state[key] = adapt_input_conv(conv.in_channels, w)
    changed = [f"{k} {before[k]} -> {tuple(v.shape)}" for k, v in state.items()
               if k in before and before[k] != tuple(v.shape)]
    renamed = len(set(state) - set(before))
    if renamed:
        changed.append(f"{renamed} tensors renamed to the model's keys")
    return state, changed


class _quiet_loading:
    """transformers' loading progress bar and its LOAD REPORT (missing, mismatched, unexpected
    tensors as a table on stderr) switched off for one ``from_pretrained``: the missing and
    mismatched tensors are refused as one line naming model.pretrained_path
    (:func:`_check_complete`), and a refusal prints nothing else; unexpected ones are logged
    there at INFO (older Llama checkpoints hold their rotary ``inv_freq`` buffers: harmless)."""

    def __enter__(self):
        from transformers.utils import logging as hf_logging

        self.hf_logging = hf_logging
        self.verbosity = hf_logging.get_verbosity()
        self.bar = hf_logging.is_progress_bar_enabled()
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        return self

    def __exit__(self, *exc):
        self.hf_logging.set_verbosity(self.verbosity)
        if self.bar:
            self.hf_logging.enable_progress_bar()
        return False


def _load_pretrained_gpt2(cls, path: Path, dropout: float) -> nn.Module:
    """``cls.from_pretrained`` of a local folder, all of whose weights must be there: transformers
    fills missing or reshaped tensors with a fresh initialisation and only logs it, which would
    fine-tune a partly random model. Float32 whatever dtype the checkpoint was saved in (the run's
    dtype is ``performance.dtype``'s; bf16 autocast needs float32 weights underneath)."""
    import json

    import safetensors

    SafetensorError = getattr(safetensors, "SafetensorError", OSError)  # older: not exported
    field = "model.pretrained_path"
    try:
        model_type = json.loads((path / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        model_type = None  # no or bad config.json: from_pretrained says what is wrong
    if model_type is not None and model_type != "gpt2":
        raise ConfigError(field, f"{path} holds a {model_type!r} checkpoint, not GPT-2")
    try:
        with _quiet_loading():
            model, loading = cls.from_pretrained(
                str(path), local_files_only=True, attn_implementation="eager",
                resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
                output_loading_info=True,
                ignore_mismatched_sizes=True)  # listed in `loading`, refused by _check_complete
    except (OSError, ValueError, KeyError, RuntimeError, SafetensorError) as e:  # shapes: Runtime
        reason = " ".join(str(e).split())[:300] or type(e).__name__
        raise ConfigError(field, f"cannot load a GPT-2 checkpoint from {path}: {reason}") from None
    _check_complete(loading, path)
    _check_tied(model, path)
    return model.float()


def _check_tied(model: nn.Module, path: Path) -> None:
    """Refuse a checkpoint whose config ties the head to the embedding but whose files store a
    head that differs from it: transformers then leaves the two untied (a logged warning only),
    and the run would train an untied head while model.tie_embeddings says tied."""
    if not getattr(model.config, "tie_word_embeddings", False):
        return
    head, emb = model.get_output_embeddings(), model.get_input_embeddings()
    if head is not None and emb is not None and head.weight is not emb.weight:
        raise ConfigError("model.pretrained_path",
                          f"{path}'s config.json ties the head to the input embedding "
                          f"(tie_word_embeddings: true), but its weights hold a separate head "
                          f"that differs from the embedding: drop the head's tensor from the "
                          f"weights, or set tie_word_embeddings: false there and "
                          f"model.tie_embeddings=false")


def _check_complete(loading: dict, path: Path) -> None:
    """Refuse a checkpoint that lacks tensors of the model or has them in other shapes
    (``from_pretrained(output_loading_info=True)``'s lists): transformers initialises those at
    random and only logs it."""
    import logging

    extra = sorted(str(k) for k in loading.get("unexpected_keys") or ())
    if extra:
        logging.getLogger(__name__).info("%s: %d tensors the model does not use (%s)", path,
                                         len(extra), _first_few(extra))
    for kind in ("missing_keys", "mismatched_keys"):
        bad = sorted(str(k if isinstance(k, str) else k[0]) for k in loading.get(kind) or ())
        if bad:
            what = "lacks" if kind == "missing_keys" else "has other shapes for"
            raise ConfigError("model.pretrained_path",
                              f"the checkpoint in {path} {what} {len(bad)} of the model's "
                              f"tensors ({_first_few(bad)}); they would be trained from a "
                              f"random initialisation")


def _vocab_too_small(vocab: int, info: DataInfo, path: Path) -> str:
    """The refusal of a pretrained checkpoint (the folder ``path``) whose vocabulary lacks some
    of the data's ids, with the fix for the setting that chose the data's vocabulary."""
    text = f"checkpoint vocabulary {vocab} < data vocabulary {info.vocab_size}"
    if (info.tokenizer_path is not None
            and Path(info.tokenizer_path).expanduser().resolve() == path.resolve()):
        # already the checkpoint's own tokenizer: telling to use it was no fix
        extra = info.vocab_size - vocab
        return (f"{text}: the data's tokenizer is the checkpoint's own (data.tokenizer_path), "
                f"with {extra} token{'s' if extra > 1 else ''} more than its embeddings (added "
                f"to the tokenizer, the embeddings not resized): remove them from the "
                f"tokenizer, or save the checkpoint with embeddings resized to "
                f"{info.vocab_size}")
    if info.vocab_from == "data.synthetic_vocab_size":  # (its ids plus one for EOS)
        return f"{text}: set data.synthetic_vocab_size to at most {vocab - 1}"
    if info.vocab_from is not None:
        return (f"{text} ({info.vocab_from}): tokenize with the checkpoint's own tokenizer "
                f"(data.tokenizer: hf and data.tokenizer_path: its folder)")
    return text


def _build_gpt2(cfg: ModelConfig, info: DataInfo) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    if info.kind != "lm":
        raise ConfigError("model.name", f"gpt2 needs language-model data, got {info.kind} data")
    data_vocab = info.vocab_size
    if cfg.pretrained_path is not None:
        path = weights_path(cfg)
        check_checkpoint_folder("model.pretrained_path", path)
        model = _load_pretrained_gpt2(GPT2LMHeadModel, path, cfg.dropout)
        vocab = model.config.vocab_size
        if data_vocab is not None and vocab < data_vocab:
            raise ConfigError("model.pretrained_path", _vocab_too_small(vocab, info, path))
        if info.max_length is not None and model.config.n_positions < info.max_length:
            raise ConfigError("data.max_length",
                              f"longest example has {info.max_length} tokens but the checkpoint "
                              f"covers {model.config.n_positions} positions; set data.max_length")
        if model.config.tie_word_embeddings != cfg.tie_embeddings:
            # The checkpoint decides; say so rather than silently ignoring the field.
            raise ConfigError("model.tie_embeddings",
                              f"the checkpoint has tie_word_embeddings="
                              f"{model.config.tie_word_embeddings}")
        defaults = ModelConfig()
        for f in ("n_layer", "n_embd", "n_head", "n_positions", "vocab_size"):
            # the shape too: one set away from its default must be the checkpoint's
            mine, theirs = getattr(cfg, f), getattr(model.config, f)
            if mine != getattr(defaults, f) and mine != theirs:
                raise ConfigError(f"model.{f}", f"is {mine}, but the checkpoint in "
                                                f"model.pretrained_path has {f}={theirs}: its "
                                                f"architecture is used; remove the setting or "
                                                f"make it {theirs}")
        return model

    vocab = cfg.vocab_size if cfg.vocab_size is not None else data_vocab
    if vocab is None:
        raise ConfigError("model.vocab_size", "the data has no vocabulary; set model.vocab_size")
    if data_vocab is not None and vocab < data_vocab:
        raise ConfigError("model.vocab_size",
                          f"{vocab} is smaller than the data's vocabulary ({data_vocab})")
    if info.max_length is not None and cfg.n_positions < info.max_length:
        raise ConfigError("model.n_positions",
                          f"{cfg.n_positions} < longest example ({info.max_length} tokens); "
                          "raise model.n_positions or set data.max_length")
    special = info.eos_id if info.eos_id is not None and info.eos_id < vocab else None
    config = GPT2Config(
        vocab_size=vocab, n_positions=cfg.n_positions, n_embd=cfg.n_embd,
        n_layer=cfg.n_layer, n_head=cfg.n_head,
        resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout, attn_pdrop=cfg.dropout,
        tie_word_embeddings=cfg.tie_embeddings,
        bos_token_id=special, eos_token_id=special, pad_token_id=info.pad_id,
        attn_implementation="eager",
    )
    model = GPT2LMHeadModel(config)
    if cfg.tie_embeddings:
        model.tie_weights()
    return model


# ------------------------------------------------------------------------------ causal_lm

#: hf_config keys that a field of dptrain sets (refused in hf_config, naming the field)
_HF_OWN_KEYS = {"vocab_size": "model.vocab_size", "tie_word_embeddings": "model.tie_embeddings",
                "dtype": "performance.dtype", "torch_dtype": "performance.dtype"}
#: hf_config keys dptrain chooses itself (attention implementation: see _attention)
_HF_CHOSEN_KEYS = ("attn_implementation", "_attn_implementation")


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def _hf_keys(e: BaseException, hf: dict) -> list[str]:
    """The hf_config keys a transformers error is about: a KeyError of one of their values
    (``hidden_act: foo`` gives ``KeyError: 'foo'``), a validator's ``field 'x'``, or the keys
    its message names, as written or in words (``hidden size``, ``number of attention
    heads`` for num_attention_heads)."""
    import re

    if isinstance(e, KeyError) and e.args:
        keys = [k for k, v in hf.items() if isinstance(v, str) and v == e.args[0]]
        if keys:
            return keys
    text = str(e)
    named = re.search(r"field '(\w+)'", text)
    if named and named.group(1) in hf:
        return [named.group(1)]
    words = " ".join(text.lower().split())
    return [k for k in hf if k in text or k.replace("_", " ") in words
            or (k.startswith("num_") and k[4:].replace("_", " ") in words)]


def _hf_refusal(e: BaseException, hf: dict, what: str, detail: str) -> ConfigError:
    """``what: detail``, at the one hf_config key ``e`` names; several are named in the text."""
    keys = _hf_keys(e, hf)
    if len(keys) == 1:
        return ConfigError(f"model.hf_config.{keys[0]}", f"{hf[keys[0]]!r}: {what}: {detail}")
    shown = f" ({', '.join(f'{k} = {hf[k]!r}' for k in keys)})" if keys else ""
    return ConfigError("model.hf_config", f"{what}{shown}: {detail}")


def _decoder_only(config, model_type: str, field: str) -> None:
    """Refuse what is not a decoder-only causal LM of text: an encoder (BERT's LM head is in
    AutoModelForCausalLM's mapping too), an encoder-decoder or the decoder half of one (BART,
    Marian), a model with sub-configs (Gemma 3's or LLaVA's vision tower: use their text-only
    model type, e.g. gemma3_text)."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_MASKED_LM_MAPPING_NAMES,
        MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES)

    why = None
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        why = "transformers has no causal LM for it"
    elif (model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES
          or model_type in MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES
          or getattr(config, "is_encoder_decoder", False)):
        why = "an encoder or encoder-decoder family"
    elif getattr(type(config), "sub_configs", None):
        why = f"a composite model ({', '.join(type(config).sub_configs)})"
    if why is not None:
        raise ConfigError(field, f"model_type {model_type!r} is not a decoder-only causal "
                                 f"language model ({why}); causal_lm takes llama, qwen2, "
                                 f"mistral and the like")


def _config_keys(cls) -> set[str]:
    """The settings a transformers config class knows: its fields (5.x configs are
    dataclasses), constructor arguments, attribute aliases and what its default writes out."""
    import dataclasses
    import inspect

    known = set(getattr(cls, "attribute_map", {}) or {})
    if dataclasses.is_dataclass(cls):
        known |= {f.name for f in dataclasses.fields(cls)}
    try:
        known |= {n for n, p in inspect.signature(cls.__init__).parameters.items()
                  if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    except (TypeError, ValueError):
        pass
    try:
        known |= set(cls().to_dict())
    except Exception:  # noqa: BLE001 - a class without usable defaults: the rest still counts
        pass
    return known


#: hf_config sizes that must be whole numbers >= 1 (0 builds a model without that part; the
#: error came later, from elsewhere, naming another field)
_HF_POSITIVE_INTS = ("hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
                     "head_dim")
#: hf_config numbers that must be > 0 (a negative RoPE base or norm epsilon trains on NaN)
_HF_POSITIVE_FLOATS = ("rope_theta", "rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon",
                       "norm_eps")
#: hf_config numbers that must be finite (NaN is refused everywhere)
_HF_FINITE = (*_HF_POSITIVE_FLOATS, *_HF_POSITIVE_INTS, "initializer_range", "factor",
              "partial_rotary_factor", "attention_multiplier", "embedding_multiplier",
              "logits_scaling", "residual_multiplier")


def _check_hf_values(hf: dict) -> None:
    """ConfigError naming ``model.hf_config.<key>`` for a NaN anywhere in it (also inside a
    nested setting such as ``rope_scaling``), an infinite value of the settings above, and
    the sizes and positive constants above out of range; transformers' configs accept them,
    and the model then trains on NaN."""
    def settings(value, where, key):  # (where, the innermost key, value) of every leaf
        if isinstance(value, dict):
            for k, v in value.items():
                yield from settings(v, f"{where}.{k}", k)
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                yield from settings(v, f"{where}[{i}]", key)
        else:
            yield where, key, value

    for top, value in hf.items():
        # (nested too: transformers 5 keeps RoPE's base in rope_parameters.rope_theta)
        for where, key, x in settings(value, f"model.hf_config.{top}", top):
            number = isinstance(x, (int, float)) and not isinstance(x, bool)
            # (NaN anywhere; inf where a finite value is needed: some families' defaults hold
            # an infinite limit, Mamba-2's time_step_limit (0, inf))
            if number and (math.isnan(x) or (math.isinf(x) and key in _HF_FINITE)):
                raise ConfigError(where, f"must be a finite number, got {x}")
            if key in _HF_POSITIVE_INTS and x is not None and (
                    not number or not isinstance(x, int) or x < 1):
                raise ConfigError(where, f"must be an integer >= 1, got {x!r}")
            if key in _HF_POSITIVE_FLOATS and x is not None and (not number or x <= 0):
                raise ConfigError(where, f"must be a number > 0, got {x!r}")


def scratch_config(cfg: ModelConfig, vocab_size: int | None = None,
                   special: dict[str, int | None] | None = None):
    """The transformers config of a causal_lm built from ``cfg.hf_config``: checked key by key
    (ConfigError naming ``model.hf_config.<key>``), with model.vocab_size (or ``vocab_size``),
    model.tie_embeddings and model.dropout applied. ``special``: token ids (bos/eos/pad) to
    set where hf_config does not. Used by validate() too, so a dry run refuses a bad key
    before any data is read."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from dptrain.models.dropout import config_dropout_keys

    hf = dict(cfg.hf_config)
    model_type = hf.pop("model_type", None)
    if not model_type or not isinstance(model_type, str):
        raise ConfigError("model.hf_config.model_type",
                          "required to build a causal_lm from scratch (llama, qwen2, mistral, "
                          "...), or set model.pretrained_path")
    for key in hf:
        if key in _HF_OWN_KEYS:
            raise ConfigError(f"model.hf_config.{key}", f"set it with {_HF_OWN_KEYS[key]} "
                                                        f"instead")
        if key in _HF_CHOSEN_KEYS:
            raise ConfigError(f"model.hf_config.{key}",
                              "dptrain chooses the attention implementation (sdpa; eager with "
                              "model.dropout > 0, so that its dropout is per example, and in "
                              "bfloat16)")
    _check_hf_values(hf)
    try:
        cls = CONFIG_MAPPING[model_type]
    except KeyError:
        raise ConfigError("model.hf_config.model_type",
                          f"unknown transformers model type {model_type!r}") from None
    try:
        config = AutoConfig.for_model(model_type, **hf)
    except Exception as e:  # noqa: BLE001 - transformers' validators raise many kinds
        raise _hf_refusal(e, hf, f"{cls.__name__} refused it", _one_line(e)) from None
    _decoder_only(config, model_type, "model.hf_config.model_type")
    heads = getattr(config, "num_attention_heads", None)
    groups = getattr(config, "num_key_value_heads", None)
    if isinstance(heads, int) and isinstance(groups, int) and groups >= 1 and heads % groups:
        # (grouped-query attention repeats each key/value head heads/groups times; the build
        # check would say "the size of tensor a (4) must match ... (3)")
        key = ("num_key_value_heads" if "num_key_value_heads" in hf
               or "num_attention_heads" not in hf else "num_attention_heads")
        raise ConfigError(f"model.hf_config.{key}",
                          f"num_key_value_heads ({groups}) must divide num_attention_heads "
                          f"({heads}): each key/value head serves a whole group of heads")
    known = _config_keys(cls)
    stored = vars(config)
    for key in hf:  # an unknown key is kept as an attribute; a legacy one is converted
        if key not in known and key in stored:
            raise ConfigError(f"model.hf_config.{key}",
                              f"not a setting of {cls.__name__} (a typo?)")
    drops = config_dropout_keys(config)
    for key in hf:
        if key in drops:
            raise ConfigError(f"model.hf_config.{key}", "set it with model.dropout instead")
    _apply_dropout(config, cfg.dropout, "model.dropout")
    config.tie_word_embeddings = cfg.tie_embeddings
    if vocab_size is not None:
        config.vocab_size = vocab_size
    for name, value in (special or {}).items():
        if f"{name}_token_id" not in hf:
            setattr(config, f"{name}_token_id", value)
    return config


def _apply_dropout(config, p: float, field: str) -> None:
    """model.dropout into every dropout probability of ``config`` (a family without any
    refuses p > 0: it would be silently ignored)."""
    from dptrain.models.dropout import config_dropout_keys

    keys = config_dropout_keys(config)
    if p > 0 and not keys:
        raise ConfigError(field, f"{type(config).__name__} has no dropout setting; set "
                                 f"model.dropout to 0")
    for key in keys:
        setattr(config, key, p)


def _attention(config, dropout: float, low_precision: bool) -> str:
    """The attention implementation: sdpa (fused kernels, much faster on GPUs; exact per-example
    norms: tests/test_causal_lm.py) unless the model has dropout, since sdpa draws its dropout
    inside the kernel, where dptrain's per-example masks (``F.dropout``, dptrain/models/dropout.py)
    cannot reach it: then eager, as GPT-2 here. Eager too for a family without sdpa, and in
    bfloat16 (``low_precision``): there sdpa's fused kernel rounds an example's attention
    differently with the microbatch's padded length (the other examples' longest), by 5e-3 of
    C in the clipped sum of a tiny Llama's 8 examples when a longer one joins them with clip
    factor 0; the other examples then move the release by more than rounding. Eager attention's
    masked keys add exact zeros (the same sum to float32 rounding, 2e-7 of C; tests/
    test_causal_lm.py)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    model_cls = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    if dropout > 0 or low_precision or not getattr(model_cls, "_supports_sdpa", False):
        return "eager"
    return "sdpa"


def _positions(config) -> int | None:
    """The longest sequence the model's positions cover (``max_position_embeddings``; GPT-2's
    ``n_positions`` answers to that name too), or None if the config has no such limit."""
    n = getattr(config, "max_position_embeddings", None)
    return n if isinstance(n, int) else None


def _check_runs(model: nn.Module) -> None:
    """One forward of two tokens in eval mode without gradients or random numbers: a config
    whose shapes do not fit together (heads that do not divide the width, grouped-query heads
    that do not divide the heads, an odd rotary dimension) is a config error here, not a
    traceback at the first step."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            model(input_ids=torch.zeros(1, 2, dtype=torch.long))
    except (RuntimeError, ValueError, IndexError, AssertionError, TypeError,
            NotImplementedError, ArithmeticError) as e:
        raise ConfigError("model.hf_config", f"the model it builds cannot run: "
                                             f"{type(e).__name__}: {_one_line(e)}") from None
    finally:
        model.train(was_training)


def _from_pretrained_kwargs() -> dict:
    """float32 weights whatever the checkpoint's dtype (transformers 5: ``dtype``; 4.x:
    ``torch_dtype``)."""
    import transformers

    major = int(transformers.__version__.split(".")[0])
    return {"dtype" if major >= 5 else "torch_dtype": torch.float32}


def _load_pretrained_causal_lm(cfg: ModelConfig, path: Path, info: DataInfo,
                               low_precision: bool) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    field_ = "model.pretrained_path"
    try:
        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - no/bad config.json, unknown model type
        raise ConfigError(field_, f"cannot read a transformers config from {path}: "
                                  f"{_one_line(e)}") from None
    model_type = getattr(config, "model_type", None) or ""
    _decoder_only(config, model_type, field_)
    vocab = config.vocab_size
    if cfg.vocab_size is not None and cfg.vocab_size != vocab:
        raise ConfigError("model.vocab_size", f"is {cfg.vocab_size}, but the checkpoint in "
                                              f"model.pretrained_path has vocab_size={vocab}: "
                                              f"remove the setting or make it {vocab}")
    if info.vocab_size is not None and vocab < info.vocab_size:
        raise ConfigError(field_, _vocab_too_small(vocab, info, path))
    if bool(config.tie_word_embeddings) != cfg.tie_embeddings:
        # the checkpoint decides; say so rather than silently ignoring the field
        raise ConfigError("model.tie_embeddings", f"the checkpoint has tie_word_embeddings="
                                                  f"{config.tie_word_embeddings}: set "
                                                  f"model.tie_embeddings to match")
    n_pos = _positions(config)
    if info.max_length is not None and n_pos is not None and n_pos < info.max_length:
        raise ConfigError("data.max_length", f"longest example has {info.max_length} tokens but "
                                             f"the checkpoint covers {n_pos} positions "
                                             f"(max_position_embeddings); set data.max_length")
    _apply_dropout(config, cfg.dropout, "model.dropout")
    import safetensors

    SafetensorError = getattr(safetensors, "SafetensorError", OSError)
    try:
        with _quiet_loading():
            model, loading = AutoModelForCausalLM.from_pretrained(
                str(path), config=config, local_files_only=True,
                attn_implementation=_attention(config, cfg.dropout, low_precision),
                output_loading_info=True,
                ignore_mismatched_sizes=True,  # listed in `loading`, refused by _check_complete
                **_from_pretrained_kwargs())
    except (OSError, ValueError, KeyError, RuntimeError, TypeError, ImportError,
            SafetensorError) as e:
        raise ConfigError(field_, f"cannot load a {model_type} checkpoint from {path}: "
                                  f"{_one_line(e)}") from None
    _check_complete(loading, path)
    _check_tied(model, path)
    return model.float()


def _build_causal_lm(cfg: ModelConfig, info: DataInfo, low_precision: bool) -> nn.Module:
    """transformers' decoder-only LMs (Llama, Qwen2, Mistral, ...), from ``hf_config`` or a
    local checkpoint. The clipping engine takes them as they are: Linear and Embedding rules,
    RMSNorm by its rule or torch.func, rotary positions (no parameters), a tied or untied head."""
    if info.kind != "lm":
        raise ConfigError("model.name", f"causal_lm needs language-model data, got {info.kind} "
                                        f"data")
    if cfg.pretrained_path is not None:
        path = weights_path(cfg)
        check_checkpoint_folder("model.pretrained_path", path)
        model = _load_pretrained_causal_lm(cfg, path, info, low_precision)
        check_no_batchnorm(model, "model.pretrained_path")
        return model
    from transformers import AutoModelForCausalLM

    vocab = cfg.vocab_size if cfg.vocab_size is not None else info.vocab_size
    if vocab is None:
        raise ConfigError("model.vocab_size", "the data has no vocabulary; set model.vocab_size")
    if info.vocab_size is not None and vocab < info.vocab_size:
        raise ConfigError("model.vocab_size",
                          f"{vocab} is smaller than the data's vocabulary ({info.vocab_size})")
    special = {"eos": info.eos_id, "pad": info.pad_id, "bos": info.bos_id}
    config = scratch_config(cfg, vocab, special)
    n_pos = _positions(config)
    if info.max_length is not None and n_pos is not None and n_pos < info.max_length:
        raise ConfigError("model.hf_config.max_position_embeddings",
                          f"{n_pos} < longest example ({info.max_length} tokens); raise "
                          f"model.hf_config.max_position_embeddings or set data.max_length")
    try:
        model = AutoModelForCausalLM.from_config(
            config, attn_implementation=_attention(config, cfg.dropout, low_precision))
    except (ValueError, TypeError, RuntimeError, AssertionError, KeyError, IndexError,
            AttributeError, ImportError, ArithmeticError) as e:
        # (ImportError: a family's extra package; ArithmeticError: num_key_value_heads 0)
        if _allocation_failure(e):
            raise  # build_model names the size setting
        raise _hf_refusal(e, dict(cfg.hf_config), "transformers cannot build it",
                          f"{type(e).__name__}: {_one_line(e)}") from None
    check_no_batchnorm(model, "model.hf_config")
    _check_runs(model)
    return model


def build_model(cfg: ModelConfig, info: DataInfo, *, low_precision: bool = False) -> nn.Module:
    """Build the model of ``cfg`` for data described by ``info`` (random init unless
    ``pretrained_path``). ``low_precision``: the forward will run in bfloat16 (autocast or
    FSDP's mixed precision), which rules out sdpa attention (``_attention``). Raises
    ConfigError naming the field on any mismatch, and on a model too large for the memory
    (``model.vocab_size: 10^11`` was a traceback from the allocator)."""
    try:
        return _build_model(cfg, info, low_precision)
    except (MemoryError, RuntimeError) as e:
        if not (isinstance(e, MemoryError) or _allocation_failure(e)):
            raise
        raise ConfigError(_largest_size_field(cfg, info), f"the model does not fit in memory: "
                                                          f"{_one_line(e)}") from None


def _allocation_failure(e: BaseException) -> bool:
    """Whether ``e`` is torch's failure to allocate a tensor (CPU or CUDA)."""
    oom = getattr(torch, "OutOfMemoryError", None)
    text = str(e)
    return ((oom is not None and isinstance(e, oom)) or "can't allocate memory" in text
            or "out of memory" in text.lower())


def _largest_size_field(cfg: ModelConfig, info: DataInfo | None = None) -> str:
    """The size setting furthest above its default (the likely cause of a model too large to
    build); else where the family's other sizes are set. A classifier's head: the model's
    ``num_classes``, else the data's (``data.num_classes``, or inferred from the labels)."""
    # (vocabularies: GPT-2's 50,257; causal_lm's, the largest of common families, Gemma's)
    sizes = {"model.vocab_size": (cfg.vocab_size, 50257 if cfg.name == "gpt2" else 262144)}
    if cfg.name == "gpt2":
        sizes.update({"model.n_embd": (cfg.n_embd, 768), "model.n_layer": (cfg.n_layer, 12),
                      "model.n_positions": (cfg.n_positions, 1024)})
        rest = "model"
    elif cfg.name == "causal_lm":
        rest = "model.pretrained_path" if cfg.pretrained_path else "model.hf_config"
    else:
        sizes = ({"model.num_classes": (cfg.num_classes, 1000)} if cfg.num_classes is not None
                 else {"data.num_classes": (getattr(info, "num_classes", None), 1000)})
        if cfg.name == "cnn":
            sizes.update({"model.channels": (max(cfg.channels, default=1), 32),
                          "model.hidden": (cfg.hidden, 32), "model.pool": (cfg.pool, 4)})
            rest = "model.channels"
        else:
            rest = "model.timm_kwargs" if cfg.timm_kwargs else "model.timm_name"
    ratios = {name: value / default for name, (value, default) in sizes.items()
              if value is not None and value > default}
    return max(ratios, key=ratios.get) if ratios else rest


def _build_model(cfg: ModelConfig, info: DataInfo, low_precision: bool) -> nn.Module:
    if cfg.name == "gpt2":
        model = _build_gpt2(cfg, info)
    elif cfg.name == "causal_lm":
        model = _build_causal_lm(cfg, info, low_precision)
    else:
        if info.kind != "classification":
            raise ConfigError("model.name",
                              f"{cfg.name} needs image classification data, got {info.kind} data")
        num_classes = cfg.num_classes if cfg.num_classes is not None else info.num_classes
        in_chans = cfg.in_chans if cfg.in_chans is not None else info.in_chans
        if num_classes is None:
            raise ConfigError("model.num_classes", "unknown; set model.num_classes")
        if in_chans is None:
            raise ConfigError("model.in_chans", "unknown; set model.in_chans")
        # a smaller head or other input channels would fail mid-training with a traceback
        if info.num_classes is not None and num_classes < info.num_classes:
            # (data.num_classes as set, or inferred; labels seen may stop lower)
            raise ConfigError("model.num_classes",
                              f"{num_classes} is fewer than the data's classes "
                              f"(data.num_classes = {info.num_classes})")
        if info.in_chans is not None and in_chans != info.in_chans:
            hint = (f"; or set data.in_chans={in_chans} (webdataset and imagefolder decode "
                    f"the images as {'grey' if in_chans == 1 else 'RGB'})"
                    if in_chans in (1, 3) else "")
            raise ConfigError("model.in_chans", f"{in_chans}, but the data's images have "
                                                f"{info.in_chans} channels{hint}")
        if (cfg.name == "cnn" and info.image_size is not None
                and info.image_size < 2 ** len(cfg.channels)):
            raise ConfigError("model.channels",
                              f"{len(cfg.channels)} stages halve {info.image_size}-pixel images "
                              f"below 1 pixel (at most {info.image_size.bit_length() - 1} "
                              f"stages for this image size)")
        if cfg.name == "timm":
            import timm

            import dptrain.models.nf_tiny  # noqa: F401  (registers nf_resnet_tiny)

            extra = {"drop_path_rate": cfg.drop_path_rate} if cfg.drop_path_rate else {}
            try:
                model = timm.create_model(cfg.timm_name, pretrained=False,
                                          num_classes=num_classes, in_chans=in_chans,
                                          **cfg.timm_kwargs, **extra)
            except RuntimeError as e:  # timm: "Unknown model (...)"
                raise ConfigError("model.timm_name", str(e)) from None
            except (TypeError, ValueError, AssertionError, IndexError, KeyError) as e:
                # an argument it does not take, or a value its constructor cannot use
                given = {**cfg.timm_kwargs, **extra}
                field = ("model.timm_kwargs" if cfg.timm_kwargs else
                         "model.drop_path_rate" if extra else "model.timm_name")
                raise ConfigError(field, f"timm.create_model({cfg.timm_name!r}, ...) refused "
                                         f"{given or 'its defaults'}: {type(e).__name__}: "
                                         f"{_one_line(e)}") from None
            check_no_batchnorm(model, "model.timm_name")
            _check_fits_images(model, cfg, in_chans, info.image_size)
            if cfg.pretrained_path is not None:
                _load_timm_weights(model, weights_path(cfg))
        elif cfg.name == "cnn":
            model = TinyCNN(in_chans, num_classes, list(cfg.channels), cfg.groups, cfg.pool,
                            cfg.hidden)
        else:  # pragma: no cover - Literal checked by from_dict
            raise ConfigError("model.name", f"unknown model {cfg.name!r}")
    check_no_batchnorm(model)
    apply_finetuning(model, cfg.lora, cfg.trainable)
    return model


def trainable_named_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``(name, parameter)`` for every parameter with ``requires_grad``, each tensor once
    (a tied embedding appears once, under its first name: ``transformer.wte.weight``)."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]
