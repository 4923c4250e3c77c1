"""Dropout masks that are a pure function of (seed, step, query state, call, example, position).

Torch's dropout draws from the process's RNG, so the masks an example gets depend on which rank
processes it, in which microbatch, after how many other forwards: a run on W ranks, or resumed
on another world size, takes different masks than on one rank. During the private forwards the
trainer makes ``torch.nn.functional.dropout`` (GPT-2's ``nn.Dropout`` modules and its eager
attention's dropout, the eager attention of transformers' other causal LMs, which calls
``F.dropout`` with ``config.attention_dropout`` and has no module, timm's ``drop_rate``) draw
its mask from a counter-based hash instead:

    k_step  = mix64(seed_key(seed) + GAMMA * (step + 1))
    k_call  = mix64(mix64(k_step + GAMMA * (stream + 1)) + GAMMA * (call + 1))
    h       = mix64(k_call + GAMMA * (index_b + 1))            # index_b: the example's dataset index
    h       = mix64(h + GAMMA * (c_i + 1))  for each coordinate c_i of the element in the example
    drop    <=> (h >> 40) < ceil(p * 2**24)                     # 24 bits: P(drop) = p up to 6e-8

(SplitMix64, as ``dptrain.privacy.sampling``; ``stream``: the index of the evaluated state in the
query plan — 0 the current model, j the j-th past state of inner momentum or DiSK's
extrapolated point — so historical evaluations have their own masks; ``call``: the dropout call's
rank within that forward). So the same example at the same step gets the same masks on any
number of ranks, in any microbatch (padded to any length: coordinates are hashed one at a
time), after any resume: dropout no longer breaks the 1-vs-N-rank
identity. Dropout is not part of the privacy mechanism (masks are per example, public
randomness); the seed is the run's ``seed``, not the privacy seed.

Only ``F.dropout`` calls on batch-first tensors (first dimension = the microbatch) are replaced,
and ``Tensor.bernoulli_(p)`` on a per-example scalar mask, shape ``(B, 1, ..., 1)``: timm's
stochastic depth (``drop_path``, ``model.drop_path_rate``) draws its per-example keep mask that
way, and gets ``keep <=> (h >> 40) < ceil(p * 2**24)`` with the same hash (no coordinates).
Channel and alpha dropouts (``nn.Dropout1d/2d/3d``, ``nn.AlphaDropout``,
``nn.FeatureAlphaDropout``) keep torch's RNG, with a warning, as does a dropout input that is
not batch-first.
The mode intercepts every torch call of the forward, so it is only entered when the model has
a dropout or a stochastic-depth layer with p > 0.
"""

from __future__ import annotations

import inspect
import math
import re
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from dptrain.privacy.sampling import _GAMMA, _M1, _M2, _mix64_int, _seed_key

__all__ = ["ExampleDropout", "config_dropout_keys", "has_dropout", "hash_uniform_bits", "mix64"]

_MASK64 = (1 << 64) - 1


def _signed(c: int) -> int:
    """A 64-bit word as the int64 with the same bits."""
    c &= _MASK64
    return c - (1 << 64) if c >= 1 << 63 else c


_S_GAMMA, _S_M1, _S_M2 = _signed(_GAMMA), _signed(_M1), _signed(_M2)


def _lshr(z: Tensor, k: int) -> Tensor:
    """Logical right shift of int64 words (torch's ``>>`` is arithmetic)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def mix64(z: Tensor) -> Tensor:
    """SplitMix64's finaliser on int64 tensors (wrap-around multiplication: the bits of the
    uint64 computation; ``tests/test_dropout.py`` checks it against the integer version)."""
    z = (z ^ _lshr(z, 30)) * _S_M1
    z = (z ^ _lshr(z, 27)) * _S_M2
    return z ^ _lshr(z, 31)


def hash_uniform_bits(k_call: int, indices: Tensor, shape: tuple[int, ...]) -> Tensor:
    """(B, *shape) int64 in [0, 2**24): the top 24 bits of h(k_call, index_b, coordinates),
    hashed one coordinate at a time (h <- mix64(h + GAMMA * (c_i + 1))), so an element's bits
    depend on its coordinates, not on the sizes of the dimensions: padding a sequence to
    another length leaves the masks of the real positions unchanged."""
    dev = indices.device
    h = mix64(indices.to(torch.int64).add(1).mul(_S_GAMMA).add(_signed(k_call)))
    for n in shape:
        c = torch.arange(1, n + 1, device=dev, dtype=torch.int64).mul_(_S_GAMMA)
        h = mix64(h.unsqueeze(-1) + c)
    return _lshr(h, 40)


#: a transformers config's dropout probabilities: ``dropout``, ``attention_dropout``,
#: ``attn_pdrop``, ``hidden_dropout_prob``, ``dropout_rate``, ...
_DROPOUT_KEY = re.compile(r"(^|_)(dropout|pdrop)(_prob|_rate)?$")


def config_dropout_keys(config: Any) -> list[str]:
    """The dropout probabilities of a transformers config (``attention_dropout`` for Llama,
    Qwen2 and Mistral; ``attn_pdrop``, ``embd_pdrop``, ``resid_pdrop`` for GPT-2 and Phi), the
    classification heads' excepted (``classifier_dropout``, ``summary_first_dropout``: a causal
    LM does not run them). Some are read by ``nn.Dropout`` modules, others only by the forward
    (Llama's attention calls ``F.dropout(p=config.attention_dropout)``), hence this list."""
    if config is None or not hasattr(config, "to_dict"):  # a transformers config
        return []
    return sorted(k for k, v in vars(config).items()
                  if _DROPOUT_KEY.search(k) and not k.startswith(("classifier", "summary"))
                  and isinstance(v, (int, float)) and not isinstance(v, bool))


def has_dropout(model: nn.Module) -> bool:
    """A dropout with p > 0, or timm's stochastic depth (``DropPath``) with drop_prob > 0, or a
    transformers model whose config sets a dropout probability > 0 (``config_dropout_keys``:
    Llama's attention dropout is a call in its forward, not a module)."""
    config = getattr(model, "config", None)
    if any(getattr(config, k, 0) > 0 for k in config_dropout_keys(config)):
        return True
    return any((isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0)
               or (type(m).__name__ == "DropPath" and getattr(m, "drop_prob", 0) > 0)
               for m in model.modules())


class ExampleDropout(TorchFunctionMode):
    """Within this mode, ``F.dropout(x, p, training=True)`` on a tensor whose first dimension
    is the microbatch uses the per-example counter-based masks above. ``indices``: the dataset
    indices of the microbatch's examples, in order. ``set_stream(j)`` before evaluating the
    j-th state of a query plan."""

    def __init__(self, seed: int, step: int, indices):
        super().__init__()
        self.k_step = _mix64_int(_seed_key(int(seed)) + _GAMMA * (int(step) + 1))
        self.indices = torch.as_tensor(indices, dtype=torch.int64)
        self.stream = 0
        self.calls = 0
        self._warned = self._warned_rng = False

    def set_stream(self, stream: int) -> None:
        self.stream, self.calls = int(stream), 0

    def _bits(self, x: Tensor, shape: tuple[int, ...]) -> Tensor:
        k = _mix64_int(_mix64_int(self.k_step + _GAMMA * (self.stream + 1))
                       + _GAMMA * (self.calls + 1))
        self.calls += 1
        return hash_uniform_bits(k, self.indices.to(x.device), shape)

    def _mask(self, x: Tensor, p: float) -> Tensor:
        bits = self._bits(x, tuple(x.shape[1:]))
        threshold = min(math.ceil(p * (1 << 24)), 1 << 24)  # P(drop) = threshold / 2**24
        return (bits >= threshold).view(x.shape)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.dropout:
            return self._dropout(*args, **kwargs)
        if func is Tensor.bernoulli_ and self._per_example_scalar(args, kwargs):
            return self._bernoulli_(*args, **kwargs)
        if func in _TORCH_RNG_DROPOUTS and not self._warned_rng:
            self._warn_torch_rng(func, args, kwargs)
        return func(*args, **kwargs)

    def _warn_torch_rng(self, func, args, kwargs) -> None:
        """Channel and alpha dropouts (``nn.Dropout1d/2d/3d``, ``nn.AlphaDropout``, ...) keep
        torch's RNG: said once, as a dropout input that is not batch-first is."""
        try:
            bound = inspect.signature(func).bind(*args, **kwargs)
        except TypeError:
            return  # (torch's own call will say what is wrong)
        bound.apply_defaults()
        p, training = bound.arguments.get("p", 0.0), bound.arguments.get("training", False)
        if training and isinstance(p, (int, float)) and p > 0:
            warnings.warn(f"dptrain: {func.__name__} (p = {p:g}) draws its mask from torch's "
                          f"RNG: only F.dropout and stochastic depth get the per-example "
                          f"masks, so this layer's depend on the rank and the microbatch",
                          stacklevel=3)
            self._warned_rng = True

    def _per_example_scalar(self, args, kwargs) -> bool:
        """``mask.bernoulli_(p)`` with a float p on a (B, 1, ..., 1) tensor (timm's drop_path)."""
        if not args or not isinstance(args[0], Tensor) or kwargs.get("generator") is not None:
            return False
        t = args[0]
        p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
        return (isinstance(p, float) and t.dim() >= 1 and t.shape[0] == len(self.indices)
                and t.numel() == t.shape[0])

    def _bernoulli_(self, t: Tensor, p: float = 0.5, **_) -> Tensor:
        with torch._C.DisableTorchFunction():
            bits = self._bits(t, ())
            threshold = min(math.ceil(p * (1 << 24)), 1 << 24)  # P(1) = threshold / 2**24
            return t.copy_((bits < threshold).view(t.shape))

    def _dropout(self, input: Tensor, p: float = 0.5, training: bool = True,
                 inplace: bool = False) -> Tensor:
        with torch._C.DisableTorchFunction():
            if not 0.0 <= p <= 1.0:  # (torch's own check, which this call replaces)
                raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
            if not training or p == 0.0:
                return input
            if input.dim() == 0 or input.shape[0] != len(self.indices):
                if not self._warned:
                    warnings.warn(f"dptrain: a dropout input of shape {tuple(input.shape)} is not "
                                  f"batch-first (microbatch {len(self.indices)}): its mask comes "
                                  f"from torch's RNG", stacklevel=3)
                    self._warned = True
                return F.dropout(input, p, training, inplace)
            if p >= 1.0:
                return input.mul_(0) if inplace else input * 0
            keep = self._mask(input, p).to(input.dtype).mul_(1.0 / (1.0 - p))
            return input.mul_(keep) if inplace else input * keep


#: dropouts whose masks stay torch's (per channel, or alpha dropout's affine noise): warned of
_TORCH_RNG_DROPOUTS = frozenset({F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout,
                                 F.feature_alpha_dropout})

_ACTIVE: list[ExampleDropout] = []


def set_stream(stream: int) -> None:
    """Tell the active ExampleDropout (if any) that the j-th state of a plan is evaluated."""
    if _ACTIVE:
        _ACTIVE[-1].set_stream(stream)


class example_dropout:
    """``with example_dropout(model, seed, step, indices):`` the per-example masks, entered only
    when ``model`` has a dropout with p > 0 (else nothing is intercepted)."""

    def __init__(self, model: nn.Module, seed: int, step: int, indices: Any):
        self.mode = ExampleDropout(seed, step, indices) if has_dropout(model) else None

    def __enter__(self):
        if self.mode is not None:
            self.mode.__enter__()
            _ACTIVE.append(self.mode)
        return self.mode

    def __exit__(self, *exc):
        if self.mode is not None:
            _ACTIVE.pop()
            return self.mode.__exit__(*exc)
        return False
