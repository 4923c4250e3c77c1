"""FSDP2 sharding applied by dptrain itself, and the distributed release.

Sharding (``performance.sharding: fsdp``): ``fully_shard`` on every transformer block / ResNet
stage, then on the root — the same code on CPU/gloo and GPU/NCCL. The model code knows nothing
of it. FSDP2's own gradient reduction is never used: the clipping engine forms each rank's
clipped sums from captured activations and output gradients (book-keeping), and
:func:`reduce_release` reduces them, adds the noise of the rank's own shard and divides by the
public denominator b — the only division.

The release under W ranks: every rank sums the clipped queries of its share of the Poisson
sample (possibly empty: then zeros, and the rank still takes part in every collective), the sums
are reduced across ranks (reduce-scatter to the parameter's row shards, or all-reduce for
replicated parameters), and each coordinate gets exactly one Gaussian draw: the noise of global
coordinates [start, end) is a pure function of (seed, step, parameter, coordinate), so a rank
draws only its own slice and the numbers are the same whatever the world size.
"""

from __future__ import annotations

import math
import re

import torch
import torch.distributed as dist
from torch import Tensor, nn

from dptrain.parallel.dist import shard_bounds

try:
    from torch.distributed.tensor import DTensor
except Exception:  # pragma: no cover
    DTensor = None  # type: ignore[assignment]


def is_sharded(t: Tensor) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def block_modules(model: nn.Module) -> list[nn.Module]:
    """The units to shard: GPT-2 blocks (``transformer.h.N``), the decoder layers of
    transformers' other causal LMs (``model.layers.N``: Llama, Qwen2, Mistral), timm stages
    (``stages.N``), ``layers.N``, ``blocks.N`` (ViTs) or ``features.N``, the first of these
    patterns that names modules with parameters (frozen ones too: a LoRA run's frozen blocks
    are sharded like any others); none of them: no block units (the root is one)."""
    named = dict(model.named_modules())
    for pattern in (r"^(transformer\.)?h\.\d+$", r"^stages\.\d+$", r"^(model\.)?layers\.\d+$",
                    r"^blocks\.\d+$", r"^features\.\d+$"):
        found = [m for n, m in named.items() if re.match(pattern, n)
                 and next(m.parameters(), None) is not None]
        if found:
            return found
    return []


def apply_fsdp(model: nn.Module, *, mixed_precision: bool = False) -> nn.Module:
    """``fully_shard`` each block, then the root, over all ranks of the default group."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    device = next(model.parameters()).device
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    kwargs = {"mesh": mesh}
    if mixed_precision:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                   reduce_dtype=torch.float32)
    for block in block_modules(model):
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def reshard(model: nn.Module) -> None:
    """Reshard every FSDP2 module of ``model`` (no-op without FSDP). A forward under
    ``no_grad`` (evaluation) has no backward to reshard after, and FSDP2 keeps the root's
    parameters unsharded after its forward: a later write into the sharded parameters (the
    EMA swapped in for evaluation) would then not be seen by the next forward, which reuses the
    stale unsharded copies. Call it after such a forward."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover
        return
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def local_rows(p: Tensor) -> tuple[int, int]:
    """Global rows [start, end) of ``p``'s dim 0 held by this rank (all rows if not sharded)."""
    if not is_sharded(p) or not dist.is_initialized():
        return 0, p.shape[0] if p.dim() else 1
    return shard_bounds(p.shape[0], dist.get_rank(), dist.get_world_size())


def _unsupported(e: BaseException) -> bool:
    """Whether a collective's error says the backend does not implement it."""
    text = str(e).lower()
    return any(w in text for w in ("not supported", "does not support", "unsupported",
                                   "not implemented", "unimplemented"))


def reduce_sum(full: Tensor, p: Tensor) -> Tensor:
    """Sum ``full`` (this rank's clipped sum, shaped like the whole parameter) over ranks and
    return the part this rank keeps: its row shard for a sharded parameter, else everything."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return full
    world, rank = dist.get_world_size(), dist.get_rank()
    if not is_sharded(p):
        dist.all_reduce(full)
        return full
    rows = full.shape[0]
    chunk = -(-rows // world)
    padded = full.new_zeros(chunk * world, *full.shape[1:])
    padded[:rows] = full
    out = full.new_empty(chunk, *full.shape[1:])
    try:
        # torch >= 2.14 names it reduce_scatter_single; 2.11 has reduce_scatter_tensor
        getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)(out, padded)
    except (RuntimeError, NotImplementedError) as e:  # backends without it (old gloo)
        # only for a backend that lacks the collective, which every rank lacks alike: another
        # failure on one rank (out of memory) must not send it to all_reduce while the others'
        # reduce_scatter went ahead (mismatched collectives hang)
        if not (isinstance(e, NotImplementedError) or _unsupported(e)):
            raise
        dist.all_reduce(padded)
        out = padded[rank * chunk:(rank + 1) * chunk]
    start, end = shard_bounds(rows, rank, world)
    return out[: end - start]


def as_grad(local: Tensor, p: Tensor) -> Tensor:
    """Wrap a local gradient shard like the parameter (a DTensor with the same placements)."""
    if is_sharded(p):
        return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False,
                                  shape=p.shape, stride=p.stride())
    return local


def flat_range(p: Tensor) -> tuple[int, int, int]:
    """(numel, start, end): the global flat coordinates of this rank's part of ``p``."""
    numel = math.prod(p.shape)
    start, end = local_rows(p)
    row = numel // p.shape[0] if p.dim() else 1
    return numel, start * row, end * row


def all_reduce_scalars(*values: float, device=None, op: str = "sum") -> list[float]:
    """The sum (``op="max"``: the maximum) of each value over the ranks, in float64; the values
    themselves without a process group."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op])
    return t.tolist()
