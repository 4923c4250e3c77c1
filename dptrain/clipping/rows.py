"""Row b of every hooked layer's input, and the b-th per-example loss, must depend on example b
alone: the engine credits each row's gradient to one example. A forward that mixes examples
(``h - h.mean(0)``, a loss normalised by the microbatch's total token count, rows reordered) or
lays them along another dimension (a (T, B, d) layout whose T happens to equal B) passes every
shape check, and the per-example norms are then silently wrong: a clipped example could move the
release by more than C.

``check_example_rows`` tests this by perturbation, once per engine (after its first query):
forwards without gradients, from the same randomness (torch's RNG state and the per-example
dropout stream set back before each), on the microbatch and on a copy in which example 0 is replaced by the first example that differs from it. Every other row
of every hooked layer's input, and every other loss, must come out the same (to 1e-5 of the
row's norm: reductions in another order are not mixing). When rows moved, a third forward, of
the microbatch again, tells mixing from a forward that is not deterministic. A row is compared through its
norm and a fixed random projection (float64), so nothing of the size of the activations is
kept; the cost is two forwards without gradients, once (three under a process group, where
every rank runs the same forwards).

What it cannot see: mixing in the backward only (a custom autograd function, a
``x + (f(x) - f(x).detach())`` trick), mixing weaker than 1e-5 of a row, and mixing that depends
on data the first microbatch does not have. A forward that is not deterministic for the same
inputs, or whose layer calls change with one example, cannot be checked: a warning says so and
the run goes on (the other checks still apply).
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree
from torch import Tensor, nn

from dptrain.models.dropout import set_stream as set_dropout_stream
from dptrain.parallel.fsdp import reshard

#: a row counts as changed when it moved by more than this fraction of its norm
REL_TOL = 1e-5
#: elements of a block of rows converted to float64 at a time (128 MiB)
BLOCK = 2**24


def _rows(t: Any, B: int) -> bool:
    return isinstance(t, Tensor) and t.dim() > 0 and t.shape[0] == B and t.numel() > 0


def _differing_row(inputs: Any, B: int) -> int | None:
    """The first example after example 0 whose data differs from example 0's (None: all equal)."""
    differs = None
    for t in pytree.tree_leaves(inputs):
        if _rows(t, B):
            flat = t.reshape(B, -1)
            d = (flat != flat[:1]).any(1)
            differs = d if differs is None else differs | d.to(differs.device)
    if differs is None or not bool(differs.any()):
        return None
    return int(differs.nonzero()[0, 0])


def _replace_first(inputs: Any, B: int, source: int) -> Any:
    """``inputs`` with example 0's rows replaced by example ``source``'s, in every leaf that has
    one row per example (others, such as shared position ids, unchanged)."""
    def swap(t):
        if not _rows(t, B):
            return t
        t = t.clone()
        t[0] = t[source]
        return t

    return pytree.tree_map(swap, inputs)


class _Signatures:
    """Per-row fingerprints of every hooked layer's inputs over one forward: (name, shape, norms,
    projections) per tensor argument with one row per example, in call order."""

    def __init__(self, hooked: list[tuple[str, nn.Module]], B: int):
        self.hooked, self.B = hooked, B
        self.rows: list[tuple[str, tuple, Tensor, Tensor]] = []
        self._directions: dict[tuple, Tensor] = {}
        self._handles: list = []

    def direction(self, n: int, device) -> Tensor:
        """A fixed random direction per (size, device), the same in every forward of the check."""
        key = (n, str(device))
        if key not in self._directions:
            g = torch.Generator(device="cpu").manual_seed(n)
            self._directions[key] = torch.randn(n, generator=g, dtype=torch.float64).to(device)
        return self._directions[key]

    def sign(self, name: str, t: Tensor) -> None:
        flat = t.detach().reshape(self.B, -1)
        r = self.direction(flat.shape[1], flat.device)
        norms, projections = [], []
        for block in flat.split(max(1, BLOCK // flat.shape[1])):  # float64, a block at a time
            block = block.to(torch.float64)
            norms.append(block.norm(dim=1))
            projections.append(block @ r)
        self.rows.append((name, tuple(t.shape), torch.cat(norms), torch.cat(projections)))

    def __enter__(self):
        for name, module in self.hooked:
            def pre(mod, args, kwargs, name=name):
                for t in pytree.tree_leaves((args, kwargs)):
                    if _rows(t, self.B):
                        self.sign(name, t)

            self._handles.append(module.register_forward_pre_hook(pre, with_kwargs=True,
                                                                  prepend=True))
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        return False


def _changed(a_norm: Tensor, a_proj: Tensor, b_norm: Tensor, b_proj: Tensor) -> Tensor:
    """Rows whose norm or projection moved by more than REL_TOL of the row's norm (non-finite
    values count as equal when both forwards give them at the same place)."""
    scale = torch.maximum(a_norm, b_norm).nan_to_num(0.0, 0.0, 0.0)
    floor = 1e-12 * float(scale.max()) if scale.numel() else 0.0
    tol = REL_TOL * scale + floor

    def moved(a, b):
        same = (a == b) | (a.isnan() & b.isnan())
        return ~same & ~((a - b).abs() <= tol)

    return moved(a_norm, b_norm) | moved(a_proj, b_proj)


def _forward(model, loss_fn, inputs, hooked, B, stream, buffers):
    """One forward without gradients, from the dropout stream's start; model buffers it
    changes are put back. Returns (per-row fingerprints of the hooked inputs, per-example
    losses)."""
    set_dropout_stream(stream)
    versions = {n: b._version for n, b in model.named_buffers()}
    try:
        with torch.no_grad(), _Signatures(hooked, B) as sig:
            losses = loss_fn(model, inputs).detach().to(torch.float64)
    finally:
        with torch.no_grad():
            for n, b in model.named_buffers():
                if n in buffers and b._version != versions.get(n):
                    b.copy_(buffers[n])
    return sig.rows, losses


def check_example_rows(model: nn.Module, hooked: list[tuple[str, nn.Module]],
                       loss_fn: Callable, inputs: Any, B: int, stream: int, *,
                       collective: bool) -> bool:
    """Refuse a forward whose hooked-layer inputs or per-example losses are not one example per
    row (see the module docstring). ``stream``: the plan entry's dropout stream. Each forward
    starts from the same torch RNG state, the one it found, and leaves it there.
    ``collective``: ranks run the forwards together (a process group: FSDP gathers
    the parameters in each), so all three run whatever this rank's microbatch; otherwise a
    microbatch with nothing to compare runs none, and the third runs only when rows moved. Returns whether the check is done: False when
    there was nothing to compare (one example, or all alike); True when rows were compared, or
    when the forward cannot be checked (a warning says so)."""
    source = _differing_row(inputs, B) if B > 1 else None
    if source is None and not collective:
        return False
    perturbed = inputs if source is None else _replace_first(inputs, B, source)
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    # (only the current CUDA device's RNG: reading another's would create a context there)
    devices = ([torch.cuda.current_device()]
               if torch.cuda.is_available() and torch.cuda.is_initialized() else [])

    def run(x):
        # a copy per forward: a loss_fn that edits the batch in place (labels masked) must
        # neither see its own edits again nor change the caller's batch
        x = pytree.tree_map(lambda t: t.clone() if isinstance(t, Tensor) else t, x)
        with torch.random.fork_rng(devices=devices):
            return _forward(model, loss_fn, x, hooked, B, stream, buffers)

    def forwards(*xs):
        try:
            return [run(x) for x in xs]
        finally:
            # FSDP2 keeps the root's parameters gathered after a forward without a backward: the
            # next forward would reuse those copies, stale once the optimizer writes the shards
            reshard(model)

    # under a process group every rank runs all three forwards, even with nothing to compare,
    # so that the gathers pair up; in one process the third (the microbatch again, to tell
    # mixing from a forward that is not deterministic) only when rows moved
    (control, control_losses), (test, test_losses), *again = forwards(
        inputs, perturbed, *([inputs] if collective else []))
    if source is None:
        return False  # one example, or all alike: nothing to compare
    problem = _mixing(control, control_losses, test, test_losses, hooked, B, source)
    if problem is None:
        return True
    again_rows, again_losses = again[0] if again else forwards(inputs)[0]
    if _differ(control, control_losses, again_rows, again_losses):
        warnings.warn("dptrain.clipping: could not check that the model keeps the examples of "
                      "a microbatch apart: two forwards of the same microbatch from the same "
                      "randomness gave different values", stacklevel=3)
        return True
    if problem == _CALLS:
        warnings.warn("dptrain.clipping: could not check that the model keeps the examples of "
                      "a microbatch apart: its layer calls or their shapes change when one "
                      "example changes", stacklevel=3)
        return True
    raise ValueError(problem)


_CALLS = "layer calls differ"


def _mixing(control, control_losses, test, test_losses, hooked, B: int, source: int) -> str | None:
    """What changed outside example 0's rows between the two forwards, as the refusal's text
    (``_CALLS`` when the layer calls themselves differ); None when nothing did."""
    if _calls(control) != _calls(test):
        return _CALLS
    others = torch.ones(B, dtype=torch.bool)
    others[0] = False
    for (name, shape, cn, cp), (_, _, tn, tp) in zip(control, test):
        bad = _changed(cn, cp, tn, tp).cpu() & others
        if bool(bad.any()):
            module = next(m for n, m in hooked if n == name)
            return (
                f"dptrain.clipping: the rows of the input of {name} ({type(module).__name__}, "
                f"shape {shape}) are not one example each: replacing example 0 of the "
                f"microbatch (by a copy of example {source}) changed {int(bad.sum())} of the "
                f"other {B - 1} rows. The examples are mixed before this layer (an op across "
                f"the batch dimension, such as h - h.mean(0), or rows reordered) or laid out "
                f"along another dimension (a (T, B, d) layout with T = B): each example's clip "
                f"would not bound its influence. Keep the batch dimension first and each "
                f"example's computation to its own row")
    bad = _changed_losses(control_losses, test_losses).cpu() & others
    if bool(bad.any()):
        return (
            f"dptrain.clipping: loss_fn's per-example losses are not one example each: replacing "
            f"example 0 of the microbatch (by a copy of example {source}) changed the losses of "
            f"{int(bad.sum())} of the other {B - 1} examples (a loss normalised over the "
            f"microbatch, such as by its total token count, or examples mixed after the last "
            f"layer with parameters): each example's clip would not bound its influence. "
            f"Return each example's loss computed from that example alone")
    return None


def _calls(rows) -> list[tuple[str, tuple]]:
    return [(name, shape) for name, shape, *_ in rows]


def _changed_losses(a: Tensor, b: Tensor) -> Tensor:
    return _changed(a.abs(), a, b.abs(), b)


def _differ(rows_a, losses_a, rows_b, losses_b) -> bool:
    """Whether two forwards differ anywhere: layer calls, shapes, any row or any loss."""
    if _calls(rows_a) != _calls(rows_b):
        return True
    return any(bool(_changed(an, ap, bn, bp).any())
               for (_, _, an, ap), (_, _, bn, bp) in zip(rows_a, rows_b)) or bool(
        _changed_losses(losses_a, losses_b).any())
