"""Row b of every hooked layer's input, and the b-th per-example loss, must depend on example b
alone: the engine credits each row's gradient to one example. A forward that mixes examples
(``h - h.mean(0)``, a loss normalised by the microbatch's total token count, rows reordered) or
lays them along another dimension (a (T, B, d) layout whose T happens to equal B) passes every
shape check, and the per-example norms are then silently wrong: a clipped example could move the
release by more than C.

``check_example_rows`` tests this by perturbation, after the engine's first query: forwards
without gradients, each from the same randomness (torch's RNG state and the per-example dropout
stream set back), of the microbatch and of four copies, in which the even-numbered, the
odd-numbered, the first half's and the second half's examples are replaced by copies of other
examples. In each copy, every row of an example that was not replaced, in every hooked layer's
input and in the losses, must come out as in the microbatch (to 1e-5 of the row's norm:
reductions in another order are not mixing). Replacing half the examples changes batch
statistics (means, maxima, token counts) that replacing one could leave as they were, and the
four sets see, in both directions, a flow between any two examples that differ in parity or in
half (``h[1] += h[2]``, a reversed cumulative sum, rows flipped or permuted). When rows moved,
one more forward of the microbatch tells mixing from a forward that is not deterministic. Rows
are compared through their norms and a fixed random projection (float64), so nothing of the
size of the activations is kept; the cost is five forwards without gradients, once. A plan
entry's view (augmentation) is applied to each copy, so a view that mixes examples is seen too.

The same forwards show a forward that stores private data in the model: a buffer it writes
(in place or by assignment: a running statistic, a cache of the last batch) must hold the same
value after every forward, whichever examples were replaced, or the model is refused, since
that value reaches later forwards and checkpoints without clipping or noise. Writes that do not
depend on the data (a call counter, a cache built from the weights or the shapes) pass, and
every buffer is put back after each of the check's forwards.

The check counts as done once a replacement reached some hooked layer's input: a microbatch
whose examples differ only in what no layer sees (labels, with equal inputs) leaves it for the
next one, up to ``MAX_ATTEMPTS`` microbatches (then a warning says it could not check). A
microbatch of one example (``performance.microbatch_size`` 1) has nothing to replace and no
rows to mix: in one process its forward is compared with an earlier one-example microbatch's
(``check_stored_across``), which shows a buffer written from the data; under a process group a
rank's one example compares nothing (another rank's larger share may). For text, a
one-example microbatch's length is that example's own, so there a buffer that is a function of
the sequence length (a token count, a table rebuilt whenever the length changes) is refused
too: it stores the example's length. To see it, the check goes on until it has compared two
examples of different shapes (lengths), up to ``MAX_ATTEMPTS`` one-example microbatches (data
of one shape, such as images, ends there, silently). In a larger microbatch the same buffer
stores the longest example's length, which the replacements (made within the microbatch's
shape) cannot change: that is not seen.

What it cannot see: mixing in the backward only (a custom autograd function, a
``x + (f(x) - f(x).detach())`` trick), mixing weaker than 1e-5 of a row or a loss (a loss
moves by little against its own size: cross-entropy's log K), flows only between examples of
the same parity and the same half (``h[0] += h[2]`` when B >= 6), batch statistics that every
replacement leaves as they were, and mixing that depends on data the first microbatch does not
have; of stored data: parameters written in the forward, buffers written outside the forward
(its backward hooks, the optimizer) or registered during it, writes at plan entries after the
first (the states of an inner-momentum history), in microbatches of more than one example a
buffer that is a function of the microbatch's shapes (its padded length: the longest
example's), and at any size a buffer that only grows (a table grown to the longest length seen,
a running maximum): the check's forwards start from the value the real forward left, which
already holds both examples compared. A forward that is not
deterministic for the same inputs, or whose layer calls change with the data, cannot be
checked: a warning says so and the run goes on (the other checks still apply).
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree
from torch import Tensor, nn

from dptrain.clipping.errors import ClippingError
from dptrain.models.dropout import set_stream as set_dropout_stream
from dptrain.parallel.fsdp import all_reduce_scalars, reshard

#: a row counts as changed when it moved by more than this fraction of its norm
REL_TOL = 1e-5
#: elements of a block of rows converted to float64 at a time (128 MiB)
BLOCK = 2**24
#: first queries with nothing that reached a layer before the check gives up (with a warning)
MAX_ATTEMPTS = 8


def cannot_check(why: str, stacklevel: int = 3, warn: bool = True) -> None:
    """The warning of a check that could not be made (the run goes on); none when not ``warn``
    (secure mode: whether, and when, it appears depends on the examples)."""
    if not warn:
        return
    warnings.warn(f"dptrain.clipping: could not check that the model keeps the examples of a "
                  f"microbatch apart: {why}", stacklevel=stacklevel + 1)


def _rows(t: Any, B: int) -> bool:
    return isinstance(t, Tensor) and t.dim() > 0 and t.shape[0] == B and t.numel() > 0


def _same_example(leaves: list[Tensor], i: int, j: int) -> bool:
    return all(torch.equal(t[i], t[j]) for t in leaves)


def _halves(B: int) -> list[Tensor]:
    """The examples to replace, one set per copy: the even- and the odd-numbered ones, then the
    first and the second half (both directions of any flow between two examples that differ in
    parity or in half; duplicates dropped)."""
    idx = torch.arange(B)
    sets = [idx % 2 == 0, idx % 2 == 1, idx < B // 2, idx >= B // 2]
    out: list[Tensor] = []
    for s in sets:
        if bool(s.any()) and not bool(s.all()) and not any(torch.equal(s, o) for o in out):
            out.append(s)
    return out


def _replacements(batch: Any, B: int) -> list[Tensor]:
    """For each set of ``_halves``: (B,) int64, for each example of the set the example whose
    data replaces it (the next one, cyclically, whose data differs) and -1 elsewhere. Sets in
    which no example can be replaced are left out."""
    leaves = [t for t in pytree.tree_leaves(batch) if _rows(t, B)]
    out = []
    for chosen in _halves(B):
        src = torch.full((B,), -1, dtype=torch.int64)
        for i in chosen.nonzero().flatten().tolist():
            for step in range(1, B):
                j = (i + step) % B
                if not _same_example(leaves, i, j):
                    src[i] = j
                    break
        if bool((src >= 0).any()):
            out.append(src)
    return out


def _replace(batch: Any, B: int, src: Tensor) -> Any:
    """``batch`` with example i's rows replaced by example ``src[i]``'s where ``src[i] >= 0``, in
    every leaf that has one row per example (others, such as shared position ids, unchanged)."""
    rows = (src >= 0).nonzero().flatten()

    def swap(t):
        if not _rows(t, B):
            return t
        t = t.clone()
        t[rows.to(t.device)] = t[src[rows].to(t.device)]
        return t

    return pytree.tree_map(swap, batch)


def _direction(directions: dict[tuple, Tensor], n: int, device) -> Tensor:
    """A fixed random direction per (size, device), the same in every forward of the check."""
    key = (n, str(device))
    if key not in directions:
        g = torch.Generator(device="cpu").manual_seed(n)
        directions[key] = torch.randn(n, generator=g, dtype=torch.float64).to(device)
    return directions[key]


class _Signatures:
    """Per-row fingerprints of every hooked layer's inputs over one forward: (name, shape, norms,
    projections) per tensor argument with one row per example, in call order."""

    def __init__(self, hooked: list[tuple[str, nn.Module]], B: int,
                 directions: dict[tuple, Tensor]):
        self.hooked, self.B = hooked, B
        self.rows: list[tuple[str, tuple, Tensor, Tensor]] = []
        self._directions = directions  # shared by the check's forwards
        self._handles: list = []

    def sign(self, name: str, t: Tensor) -> None:
        flat = t.detach().reshape(self.B, -1)
        r = _direction(self._directions, flat.shape[1], flat.device)
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


class _Slot:
    """One registered buffer of the model, as the check found it: the tensor object, a copy of
    its value (put back after every forward) and its fingerprint (computed when first asked)."""

    def __init__(self, name: str, module: nn.Module, key: str):
        self.name, self.module, self.key = name, module, key
        self.tensor = module._buffers[key]
        self.value = self.tensor.detach().clone()
        self._fingerprint: tuple | None = None

    def fingerprint(self, directions) -> tuple:
        if self._fingerprint is None:
            self._fingerprint = _fingerprint(self.value, directions)
        return self._fingerprint


def _slots(model: nn.Module) -> list[_Slot]:
    return [_Slot(f"{mname}.{key}" if mname else key, m, key)
            for mname, m in model.named_modules() for key, b in m._buffers.items()
            if b is not None]


def _fingerprint(t: Tensor, directions: dict[tuple, Tensor]) -> tuple:
    """(shape, dtype, the float64 norm and projection on a fixed random direction) of a whole
    tensor, a block of elements at a time: two values with equal fingerprints are equal but for
    a measure-zero coincidence."""
    flat = (torch.view_as_real(t.detach()) if t.is_complex() else t.detach()).reshape(-1)
    r = _direction(directions, flat.numel(), flat.device)
    sq = torch.zeros((), dtype=torch.float64, device=flat.device)
    proj = torch.zeros((), dtype=torch.float64, device=flat.device)
    for start in range(0, flat.numel(), BLOCK):
        block = flat[start:start + BLOCK].to(torch.float64)
        sq += block.square().sum()
        proj += block @ r[start:start + BLOCK]
    return tuple(t.shape), t.dtype, float(sq), float(proj)


def _same_fingerprint(a: tuple, b: tuple) -> bool:
    """Exact: a data-independent write gives the same bits in every forward of the check (a
    forward that is not deterministic is told apart by the forward run again)."""
    return a[:2] == b[:2] and all(x == y or (x != x and y != y) for x, y in zip(a[2:], b[2:]))


def _forward(model, loss_fn, batch, view, hooked, B, stream, slots, directions):
    """One forward without gradients of ``view(batch)``, from the dropout stream's start;
    buffers it writes (in place, or by assigning another tensor) are put back. Returns
    (per-row fingerprints of the hooked inputs, per-example losses, {name: fingerprint of the
    value the forward left} for every buffer it wrote)."""
    set_dropout_stream(stream)
    versions = [s.tensor._version for s in slots]
    written: dict[str, tuple] = {}
    try:
        with torch.no_grad(), _Signatures(hooked, B, directions) as sig:
            inputs = view(batch) if view is not None else batch
            losses = loss_fn(model, inputs).detach().to(torch.float64)
    finally:
        with torch.no_grad():
            for s, version in zip(slots, versions):
                now = s.module._buffers.get(s.key)
                if now is s.tensor and now._version == version:
                    continue
                written[s.name] = (_fingerprint(now, directions) if isinstance(now, Tensor)
                                   else ("removed",))
                s.module._buffers[s.key] = s.tensor
                if s.tensor._version != version:
                    s.tensor.copy_(s.value)
    return sig.rows, losses, written


def check_example_rows(model: nn.Module, hooked: list[tuple[str, nn.Module]],
                       loss_fn: Callable, batch: Any, B: int, stream: int, *,
                       view: Callable | None = None, collective: bool,
                       warn: bool = True) -> bool:
    """Refuse a forward whose hooked-layer inputs or per-example losses are not one example per
    row (see the module docstring). ``view``: the plan entry's view of the batch (None: the
    batch itself); ``stream``: its dropout stream. Each forward starts from the torch RNG state
    the check found, and leaves it there. ``collective``: ranks run the forwards together (a
    process group: FSDP gathers the parameters in each), so every rank runs five whatever its
    microbatch, and a sixth (the microbatch again) if rows moved on any rank; otherwise a
    microbatch with nothing to replace runs none, and the sixth runs only when rows moved.
    Returns whether the check is done: False when no replacement reached a layer's input; True
    when one did, or when the forward cannot be checked (a warning says so). ``collective``:
    the same answer on every rank (done when done on any), and a refusal on every rank.
    ``warn``: False silences the warning (:func:`cannot_check`)."""
    sources = _replacements(batch, B) if B > 1 else []
    if not sources and not collective:
        return False
    slots = _slots(model)
    directions: dict[tuple, Tensor] = {}
    forwards = _runner(model, hooked, loss_fn, view, B, stream, slots, directions)
    copies = [_replace(batch, B, src) for src in sources]
    if collective:  # the same forwards on every rank: pad to four copies
        copies += [batch] * (4 - len(copies))
    results = forwards(batch, *copies)
    control, tests = results[0], results[1:1 + len(sources)]
    problem, stored, reached = None, None, False
    for src, test in zip(sources, tests):
        found, hit = _mixing(control, test, hooked, src >= 0)
        problem, reached = problem or found, reached or hit
        stored = stored or _stored(control, test, slots, directions, _what(src >= 0))
    # one more forward of the microbatch, to tell mixing from a forward that is not
    # deterministic, where rows or written buffers moved: under a process group on every rank
    # if on any
    moved = problem is not None or stored is not None
    device = next(iter(model.parameters()), torch.empty(0)).device
    again_needed = (all_reduce_scalars(float(moved), device=device, op="max")[0] > 0
                    if collective else moved)
    again = forwards(batch)[0] if again_needed else None
    done, refusal = reached, None
    if moved:
        # a buffer that the same microbatch's forwards write alike, and replaced examples'
        # otherwise, holds their data, whatever else in the forward is not deterministic
        if stored is not None and not _stored_values(control, again, slots, directions):
            refusal = stored
        elif _differ(control, again, slots, directions):
            cannot_check("two forwards of the same microbatch from the same randomness gave "
                         "different values", warn=warn)
            done = True
        elif stored is not None:
            refusal = stored
        elif problem == _CALLS:
            cannot_check("its layer calls or their shapes change when some examples change",
                         warn=warn)
            done = True
        else:
            refusal = problem
    if collective:
        # one outcome for every rank: done once any rank compared examples (a rank whose share
        # was one example compared nothing; it is not done because another's check ran); a
        # refusal anywhere is a refusal everywhere (a rank that went on would wait for the
        # refusing one at its next collective)
        any_done, any_refusal = all_reduce_scalars(float(done), float(refusal is not None),
                                                   device=device, op="max")
        done = any_done > 0
        if any_refusal > 0 and refusal is None:
            refusal = ("dptrain.clipping: another rank found that the model does not keep the "
                       "examples of a microbatch apart (its message names the layer)")
    if refusal is not None:
        raise ClippingError(refusal)
    return done


def _runner(model, hooked, loss_fn, view, B: int, stream: int, slots: list[_Slot],
            directions: dict[tuple, Tensor]) -> Callable:
    """``forwards(*batches)``: the check's forwards (``_forward``) of each batch, each from the
    torch RNG state found (and left there) on a copy of the batch."""
    # (only the current CUDA device's RNG: reading another's would create a context there)
    devices = ([torch.cuda.current_device()]
               if torch.cuda.is_available() and torch.cuda.is_initialized() else [])

    def run(x):
        # a copy per forward: a loss_fn that edits the batch in place (labels masked) must
        # neither see its own edits again nor change the caller's batch
        x = pytree.tree_map(lambda t: t.clone() if isinstance(t, Tensor) else t, x)
        with torch.random.fork_rng(devices=devices):
            return _forward(model, loss_fn, x, view, hooked, B, stream, slots, directions)

    def forwards(*xs):
        try:
            return [run(x) for x in xs]
        finally:
            # FSDP2 keeps the root's parameters gathered after a forward without a backward: the
            # next forward would reuse those copies, stale once the optimizer writes the shards
            reshard(model)

    return forwards


def check_stored_across(model: nn.Module, hooked: list[tuple[str, nn.Module]],
                        loss_fn: Callable, batch: Any, other: Any, stream: int, *,
                        view: Callable | None = None, other_shapes: bool = False,
                        warn: bool = True) -> int:
    """The check of a microbatch of one example (one process): it has no other example to
    replace, so its forward is compared with that of ``other``, an earlier microbatch of one
    example (the engine keeps it; ``other_shapes``: its shapes differ, which for text are its
    length, private data), from the same buffers and randomness. Rows cannot mix within one
    example; what is left to see is a buffer that the forward writes from the data, refused
    as in ``check_example_rows`` (whether or not the data reached a layer). Returns
    ``NOTHING_COMPARED`` when the other example reached no layer differently (inputs alike,
    only labels differing: the engine tries a later one), ``COMPARED``, or ``UNCHECKABLE``
    (a forward that is not deterministic: warned unless not ``warn``, and the check is
    over)."""
    slots = _slots(model)
    directions: dict[tuple, Tensor] = {}
    forwards = _runner(model, hooked, loss_fn, view, 1, stream, slots, directions)
    control, test = forwards(batch, other)
    reached = _calls(control[0]) != _calls(test[0]) or any(
        bool(_changed(cn, cp, tn, tp).any())
        for (_, _, cn, cp), (_, _, tn, tp) in zip(control[0], test[0]))
    refusal = _stored(control, test, slots, directions, (
        "the forward of another one-example microbatch, of other shapes (at one example per "
        "microbatch the shapes, such as a text's length, are the example's own: a buffer "
        "cached per shape stores them; build it for data.max_length, or use a "
        "microbatch_size above 1), instead of this one" if other_shapes else
        "the forward of another microbatch's example instead of this one"))
    if refusal is None:
        return COMPARED if reached else NOTHING_COMPARED
    # (as in check_example_rows: only the buffers' own repeatability is asked)
    if _stored_values(control, forwards(batch)[0], slots, directions):
        cannot_check("two forwards of the same microbatch from the same randomness gave "
                     "different values", warn=warn)
        return UNCHECKABLE
    raise ClippingError(refusal)


#: what ``check_stored_across`` found
NOTHING_COMPARED, COMPARED, UNCHECKABLE = 0, 1, 2


_CALLS = "layer calls differ"

_HINT = ("(Two other causes: a tensor in the batch shared by all examples whose first "
         "dimension happens to equal the microbatch size, such as class weights: pass it to the "
         "loss another way, since every batch tensor with that first dimension is taken as one "
         "row per example; or random draws whose number depends on the data, such as dropout "
         "drawn for some examples only, which shifts the others' draws.)")


def _mixing(control, test, hooked, replaced: Tensor) -> tuple[str | None, bool]:
    """(the refusal's text if a row of an example not ``replaced`` changed between the two
    forwards, ``_CALLS`` if the layer calls themselves differ, else None; whether a replaced
    example's row changed in some hooked layer's input, i.e. the replacement reached a layer)."""
    (rows_c, losses_c, _), (rows_t, losses_t, _) = control, test
    if _calls(rows_c) != _calls(rows_t):
        return _CALLS, True
    kept = ~replaced
    B, k = len(replaced), int(replaced.sum())
    what = _what(replaced)
    reached = False
    for (name, shape, cn, cp), (_, _, tn, tp) in zip(rows_c, rows_t):
        changed = _changed(cn, cp, tn, tp).cpu()
        reached = reached or bool((changed & replaced).any())
        bad = changed & kept
        if bool(bad.any()):
            module = next(m for n, m in hooked if n == name)
            return (
                f"dptrain.clipping: the rows of the input of {name} ({type(module).__name__}, "
                f"shape {shape}) are not one example each: {what} changed the rows of "
                f"{int(bad.sum())} of the other {B - k} ({_indices(bad)}). The examples are "
                f"mixed before this layer (an op across the batch dimension, such as "
                f"h - h.mean(0), or rows reordered) or laid out along another dimension (a "
                f"(T, B, d) layout with T = B): each example's clip would not bound its "
                f"influence. Keep the batch dimension first and each example's computation to "
                f"its own row. {_HINT}"), reached
    bad = _changed_losses(losses_c, losses_t).cpu() & kept
    if bool(bad.any()):
        return (
            f"dptrain.clipping: loss_fn's per-example losses are not one example each: {what} "
            f"changed the losses of {int(bad.sum())} of the other {B - k} examples "
            f"({_indices(bad)}): a loss normalised over the microbatch (such as by its total "
            f"token count), or examples mixed after the last layer with parameters; each "
            f"example's clip would not bound its influence. Return each example's loss "
            f"computed from that example alone. {_HINT}"), reached
    return None, reached


def _what(replaced: Tensor) -> str:
    return (f"replacing {int(replaced.sum())} of the microbatch's {len(replaced)} examples "
            f"({_indices(replaced)}) by copies of others")


def _stored_values(a, b, slots: list[_Slot], directions) -> list[str]:
    """Buffers whose value after forward ``a`` differs from that after forward ``b`` (a buffer a
    forward did not write keeps the check's starting value)."""
    wa, wb = a[2], b[2]
    start = {s.name: s for s in slots}
    differ = []
    for name in sorted(wa.keys() | wb.keys()):
        fa = wa[name] if name in wa else start[name].fingerprint(directions)
        fb = wb[name] if name in wb else start[name].fingerprint(directions)
        if not _same_fingerprint(fa, fb):
            differ.append(name)
    return differ


def _stored(control, test, slots: list[_Slot], directions, what: str) -> str | None:
    """The refusal's text if a buffer the forward writes took another value when the examples
    changed (``what`` says how): the forward stores something of the private data in the
    model's state."""
    names = _stored_values(control, test, slots, directions)
    if not names:
        return None
    slot = next(s for s in slots if s.name == names[0])
    more = f" (and {len(names) - 1} more: {', '.join(names[1:4])})" if len(names) > 1 else ""
    return (
        f"dptrain.clipping: the forward writes the buffer {names[0]} of "
        f"{type(slot.module).__name__}{more} from the examples' data: {what} "
        f"changed the value it holds after a forward. A buffer updated from private examples "
        f"(a running statistic, a cache of the last batch) is a function of them that no clip "
        f"bounds and no noise covers: it reaches every later forward and every checkpoint, "
        f"outside the (epsilon, delta) guarantee. Compute it without writing a buffer, keep "
        f"that module in eval mode, or make it a parameter trained through the private "
        f"release. (Writes that do not depend on the data, such as a call counter or a cache "
        f"built from the weights or the shapes, are fine.)")


def _indices(mask: Tensor, limit: int = 6) -> str:
    idx = mask.nonzero().flatten().tolist()
    return ", ".join(map(str, idx[:limit])) + (", ..." if len(idx) > limit else "")


def _calls(rows) -> list[tuple[str, tuple]]:
    return [(name, shape) for name, shape, *_ in rows]


def _changed_losses(a: Tensor, b: Tensor) -> Tensor:
    return _changed(a.abs(), a, b.abs(), b)


def _differ(a, b, slots: list[_Slot], directions) -> bool:
    """Whether two forwards differ anywhere: layer calls, shapes, any row, any loss or any
    buffer they wrote."""
    (rows_a, losses_a, _), (rows_b, losses_b, _) = a, b
    if _calls(rows_a) != _calls(rows_b) or _stored_values(a, b, slots, directions):
        return True
    return any(bool(_changed(an, ap, bn, bp).any())
               for (_, _, an, ap), (_, _, bn, bp) in zip(rows_a, rows_b)) or bool(
        _changed_losses(losses_a, losses_b).any())
