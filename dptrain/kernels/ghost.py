"""Fused ghost inner products of two outer-product contributions (Triton), with its reference.

For per-example gradients in outer-product form, ``g_b = sum_t L[b, t] ⊗ R[b, t]`` (a linear
layer: L = output gradients, R = inputs), the per-example inner product of two contributions is

    <g_u, g_v>_b = sum_{t, s} (Lu[b, t] · Lv[b, s]) (Ru[b, t] · Rv[b, s])

(the ghost identity; ``u = v`` gives the squared norm). :func:`outer_inner_reference` computes
it as the engine always has: two batched Gram matrices of shape (B, Tu, Tv) and their
elementwise product. :func:`outer_inner` is one Triton kernel that never writes the Gram
matrices: each program computes one (BT x BT) tile of both Grams in registers, multiplies them
and reduces the tile to one number, and for a squared norm (``u = v``, both Grams symmetric)
only the tiles on and above the diagonal are computed, the off-diagonal ones counted twice:
about half the multiply-adds and none of the 3 x B x T^2 floats of memory traffic.

Exactness: the products use ``input_precision="ieee"`` (float32 FMA, no TF32) and float32
accumulation of the Gram tiles for half and float32 inputs (float64 for float64 ones), because
these norms decide the clip factors: a norm rounded short would let a clipped example add more
than C. Each tile's elementwise product is summed in float64 (summed in float32 it rounded far
more than the reference for alike tokens, whose terms cancel) into its own slot, and the slots
are summed by torch in float64 in a fixed order (no atomics), so the result is deterministic.

The kernel is opt-in (``performance.kernels=triton``): it runs on CUDA tensors, and on CPU
tensors only under Triton's interpreter (``TRITON_INTERPRET=1``, how the tests run it here).
``bench/ghost_kernel.py --device cuda`` (part of ``bench/gpu_check.sh``) checks and times it
against the reference; the H200 timings are in docs/kernels.md and BENCHMARKS.md.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:  # Triton ships with CUDA builds of torch; CPU-only installs may lack it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the installation
    triton = None


def available(device: torch.device | str) -> str | None:
    """None if the kernel can run on ``device``, else the reason it cannot."""
    if triton is None:
        return "Triton is not installed"
    kind = torch.device(device).type
    if _INTERPRETED:
        return None if kind == "cpu" else (
            f"Triton's interpreter (TRITON_INTERPRET=1 when dptrain.kernels.ghost was "
            f"imported) runs on CPU, not {kind}")
    if kind == "cuda":
        return None
    return (f"Triton kernels run on CUDA (or on CPU with TRITON_INTERPRET=1 set before "
            f"start), not on {kind}")


def outer_inner_reference(Lu: Tensor, Ru: Tensor, Lv: Tensor | None = None,
                          Rv: Tensor | None = None) -> Tensor:
    """(B,) ``sum_{t,s} (Lu_t·Lv_s)(Ru_t·Rv_s)`` per example by two Gram matrices (what the CPU
    runs). ``Lv``/``Rv`` None: ``u = v`` (the squared norm)."""
    if Lv is None:
        Lv, Rv = Lu, Ru
    rr = torch.bmm(Ru, Rv.transpose(1, 2))  # (B, Tu, Tv)
    ll = torch.bmm(Lu, Lv.transpose(1, 2))
    return (ll.to(rr.dtype) * rr).sum(dim=(1, 2))


if triton is not None:

    @triton.jit
    def _gram_tile(x, y, s_xt, s_xk, s_yt, s_yk, t, s, mt, ms, K,
                   BT: tl.constexpr, BK: tl.constexpr, ACC: tl.constexpr):
        """(BT, BT) tile X[t] Y[s]^T of one example's Gram matrix, over its K features in
        chunks of BK (x, y: that example's first element)."""
        k = tl.arange(0, BK)
        acc = tl.zeros((BT, BT), dtype=ACC)
        for k0 in range(0, K, BK):
            mk = (k0 + k) < K
            a = tl.load(x + t[:, None] * s_xt + (k0 + k)[None, :] * s_xk,
                        mask=mt[:, None] & mk[None, :], other=0.0).to(ACC)
            c = tl.load(y + s[:, None] * s_yt + (k0 + k)[None, :] * s_yk,
                        mask=ms[:, None] & mk[None, :], other=0.0).to(ACC)
            acc += tl.dot(a, tl.trans(c), input_precision="ieee")
        return acc

    @triton.jit
    def _outer_inner_kernel(
        lu, ru, lv, rv, rows, cols, out,
        Tu, Tv, O, I, n_tiles,
        s_lub, s_lut, s_luo, s_rub, s_rut, s_rui,
        s_lvb, s_lvt, s_lvo, s_rvb, s_rvt, s_rvi,
        SYMMETRIC: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, ACC: tl.constexpr,
    ):
        b = tl.program_id(0).to(tl.int64)
        p = tl.program_id(1)
        ti = tl.load(rows + p)
        si = tl.load(cols + p)
        t = ti * BT + tl.arange(0, BT)
        s = si * BT + tl.arange(0, BT)
        mt = t < Tu
        ms = s < Tv
        # the left Gram tile Lu[t] Lv[s]^T (over the out-features) and the right one
        # Ru[t] Rv[s]^T (over the in-features), both in registers
        ll = _gram_tile(lu + b * s_lub, lv + b * s_lvb, s_lut, s_luo, s_lvt, s_lvo,
                        t, s, mt, ms, O, BT, BK, ACC)
        rr = _gram_tile(ru + b * s_rub, rv + b * s_rvb, s_rut, s_rui, s_rvt, s_rvi,
                        t, s, mt, ms, I, BT, BK, ACC)
        # the tile's sum in float64 (exact products of the float32 Gram entries): in float32
        # it rounded ~280x the cancelled result for alike tokens, and a clipped example added
        # 1 + 2.5e-5 C (the torch path: 3e-6)
        part = tl.sum(tl.sum(ll.to(tl.float64) * rr.to(tl.float64), axis=1), axis=0)
        if SYMMETRIC:
            part = part * tl.where(ti == si, 1.0, 2.0)
        tl.store(out + b * n_tiles + p, part)


#: Whether the kernels were defined under Triton's interpreter (decided when this module is
#: imported, as ``triton.jit`` decides it).
_INTERPRETED = triton is not None and type(_outer_inner_kernel).__name__ == "InterpretedFunction"


def _block(B: int, Tu: int, Tv: int) -> int:
    """Tile side, 16 (tl.dot's minimum) to 64: the smallest power of two covering the longer
    sequence, then, on a GPU, halved while B x tiles would leave its multiprocessors idle (fewer
    than 256 programs). A first guess, not yet tuned on a GPU. (Under the interpreter, which runs
    programs one after another, fewer and larger tiles are simply faster.)"""
    bt = 16
    while bt < min(max(Tu, Tv), 64):
        bt *= 2
    while not _INTERPRETED and bt > 16 and B * -(-Tu // bt) * -(-Tv // bt) < 256:
        bt //= 2
    return bt


_TILES: dict[tuple, tuple[Tensor, Tensor]] = {}


def _tiles(nu: int, nv: int, symmetric: bool, device: torch.device) -> tuple[Tensor, Tensor]:
    """Row and column indices of the tiles to compute (upper triangle when symmetric)."""
    key = (nu, nv, symmetric, str(device))
    if key not in _TILES:
        if symmetric:
            r, c = torch.triu_indices(nu, nv)
        else:
            r = torch.arange(nu).repeat_interleave(nv)
            c = torch.arange(nv).repeat(nu)
        _TILES[key] = (r.to(device=device, dtype=torch.int32),
                       c.to(device=device, dtype=torch.int32))
    return _TILES[key]


def outer_inner(Lu: Tensor, Ru: Tensor, Lv: Tensor | None = None,
                Rv: Tensor | None = None) -> Tensor:
    """(B,) ``sum_{t,s} (Lu_t·Lv_s)(Ru_t·Rv_s)`` by the fused kernel; ``Lv``/``Rv`` None
    means ``u = v`` (the squared norm, computed from the upper triangle of tiles).

    Lu (B, Tu, O), Ru (B, Tu, I), Lv (B, Tv, O), Rv (B, Tv, I): any strides, any float dtype.
    Products and sums in float64 when any input is float64, else in float32 (IEEE, no TF32);
    the result has that dtype.
    """
    why = available(Lu.device)
    if why is not None:
        raise RuntimeError(f"kernels.ghost.outer_inner: {why}")
    if (Lv is None) != (Rv is None):
        raise ValueError("kernels.ghost.outer_inner: give both Lv and Rv, or neither (the "
                         "squared norm)")
    symmetric = Lv is None
    if symmetric:
        Lv, Rv = Lu, Ru
    B, Tu, O = Lu.shape
    Tv, I = Rv.shape[1], Rv.shape[2]
    if Ru.shape != (B, Tu, I) or Lv.shape != (B, Tv, O) or Rv.shape[0] != B:
        raise ValueError(f"kernels.ghost.outer_inner: shapes do not pair: Lu {tuple(Lu.shape)}, "
                         f"Ru {tuple(Ru.shape)}, Lv {tuple(Lv.shape)}, Rv {tuple(Rv.shape)}")
    if B == 0 or Tu == 0 or Tv == 0:
        wide = torch.float64 in (Lu.dtype, Ru.dtype, Lv.dtype, Rv.dtype)
        return torch.zeros(B, device=Lu.device, dtype=torch.float64 if wide else torch.float32)
    bt = _block(B, Tu, Tv)
    rows, cols = _tiles(triton.cdiv(Tu, bt), triton.cdiv(Tv, bt), symmetric, Lu.device)
    n = rows.numel()
    wide = torch.float64 in (Lu.dtype, Ru.dtype, Lv.dtype, Rv.dtype)
    parts = torch.empty(B, n, device=Lu.device, dtype=torch.float64)
    _outer_inner_kernel[(B, n)](
        Lu, Ru, Lv, Rv, rows, cols, parts,
        Tu, Tv, O, I, n,
        *Lu.stride(), *Ru.stride(), *Lv.stride(), *Rv.stride(),
        SYMMETRIC=symmetric, BT=bt, BK=32, ACC=tl.float64 if wide else tl.float32,
    )
    return parts.sum(dim=1).to(torch.float64 if wide else torch.float32)
