"""Model patterns the clipping engine must get exactly right or refuse, never silently wrong:
each case gave wrong per-example norms (or skipped a check) before, found by a fuzz of 2,030
random models against torch.func (tests/_reference.py).

- in-place ops after a layer whose output is a view (nn.Linear on (B, T, d), Conv1D), or after
  an Embedding (refused before);
- a user's forward hook that changes a layer's output;
- token ids changed in place after the forward;
- the parameter-use check after a first forward that raised;
- shared rows: ``wpe(torch.arange(T))`` at T = B, reshaped before the broadcast;
- BatchNorm, in training mode or without running statistics (refused) and eval mode (exact).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from _reference import reference_grads

from dptrain.clipping import ClippingEngine, per_example_grad_norms


def sq_loss(m, batch):
    out = m(batch[0])
    return 0.5 * out.pow(2).reshape(out.shape[0], -1).sum(1)


def ref_norms(m, loss, x):
    return reference_grads(m, loss, (x,)).norm(dim=1)


# ------------------------------------------------------------- in-place ops after a view output

class InPlaceAfter(nn.Module):
    def __init__(self, op, conv1d):
        super().__init__()
        self.op = op
        if conv1d:
            from transformers.pytorch_utils import Conv1D
            self.a = Conv1D(4, 4)
        else:
            self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)

    def forward(self, x):
        h = self.a(x)  # a view of the matmul's result: on (B, T, d) input, and always for Conv1D
        if self.op == "relu_":
            h = F.relu(h, inplace=True)
        elif self.op == "iadd":
            h += 1.0
        else:
            h[..., 0].mul_(2.0)
        return self.b(torch.tanh(h))


@pytest.mark.parametrize("op", ["relu_", "iadd", "slice_mul"])
@pytest.mark.parametrize("conv1d, shape", [(False, (5, 3, 4)), (True, (5, 4)), (True, (5, 3, 4))])
def test_an_in_place_op_after_a_view_output_keeps_the_layer_in_norms_and_sum(op, conv1d, shape):
    # the hook on the view never fired, the layer looked unused and dropped out of both
    torch.manual_seed(0)
    m = InPlaceAfter(op, conv1d).double()
    x = torch.randn(*shape, dtype=torch.float64)
    assert_norms_and_sum(m, x)


def assert_norms_and_sum(m, x):
    """The engine's norms and clipped sum (C: the median norm) equal the reference's."""
    ref = reference_grads(m, sq_loss, (x,))
    rn = ref.norm(dim=1)
    C = float(rn.median())
    norms = ClippingEngine(m, clip_norm=C).per_example_norms(sq_loss, (x,))
    torch.testing.assert_close(norms, rn, rtol=1e-9, atol=1e-12)
    acc = {}
    ClippingEngine(m, clip_norm=C).accumulate(sq_loss, (x,), acc)
    want = (ref * (C / rn).clamp(max=1.0)[:, None]).sum(0)
    got = torch.cat([acc[n].reshape(-1) for n, _ in m.named_parameters()])
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


class EmbeddingInPlace(nn.Module):
    """An in-place op right after an Embedding (the layer whose output is the backward's
    target, its input being ids)."""

    def __init__(self, op):
        super().__init__()
        self.op, self.e, self.h = op, nn.Embedding(7, 3), nn.Linear(3, 2)

    def forward(self, ids):
        h = self.e(ids)
        if self.op == "relu_":
            h = F.relu(h, inplace=True)
        else:
            h.mul_(2.0)
        return self.h(h)


@pytest.mark.parametrize("op", ["relu_", "mul_"])
def test_an_in_place_op_after_an_embedding_gives_exact_norms_and_sum(op):
    # refused before ("the output of Embedding was modified in place"), against the README
    torch.manual_seed(0)
    m = EmbeddingInPlace(op).double()
    assert_norms_and_sum(m, torch.randint(0, 7, (3, 4), generator=torch.Generator().manual_seed(1)))


class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool):
        super().__init__()
        self.reentrant = reentrant
        self.i, self.b, self.o = nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 2)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        h = checkpoint(lambda h: torch.tanh(self.b(h)), self.i(x),
                       use_reentrant=self.reentrant)
        return self.o(h)


def test_activation_checkpointing_is_exact_and_the_reentrant_kind_refused_with_the_fix():
    torch.manual_seed(0)
    x = torch.randn(3, 3, dtype=torch.float64)
    m = Checkpointed(False).double()
    # (torch.func does not run under checkpoint's saved-tensor hooks: a loop of autograd.grad)
    ref = torch.stack([torch.cat([g.reshape(-1) for g in torch.autograd.grad(
        sq_loss(m, (x[b:b + 1],)).sum(), list(m.parameters()))]).norm() for b in range(3)])
    torch.testing.assert_close(ClippingEngine(m, clip_norm=1.0).per_example_norms(sq_loss, (x,)),
                               ref, rtol=1e-9, atol=1e-12)
    m.reentrant = True  # torch's own error before, from autograd.grad
    with pytest.raises(ValueError, match="pass use_reentrant=False"):
        ClippingEngine(m, clip_norm=1.0).per_example_norms(sq_loss, (x,))


# -------------------------------------------------------------- a user's forward hook

def test_a_user_forward_hook_that_changes_the_output_gives_exact_norms():
    # the engine's hook ran after the user's and took the gradient w.r.t. the changed output
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1)).double()
    m[0].register_forward_hook(lambda mod, args, out: out * 2.0)
    x = torch.randn(3, 4, dtype=torch.float64)
    got = ClippingEngine(m, clip_norm=1.0).per_example_norms(sq_loss, (x,))
    torch.testing.assert_close(got, ref_norms(m, sq_loss, x), rtol=1e-9, atol=1e-12)


# -------------------------------------------------------------- ids changed after the forward

class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.e = nn.Embedding(6, 4)
        self.h = nn.Linear(4, 6)

    def forward(self, ids):
        return self.h(torch.tanh(self.e(ids)))


def masked_lm(inplace: bool):
    def loss(m, batch):
        ids = batch[0]
        logits = m(ids)
        labels = ids if inplace else ids.clone()  # labels that alias the ids, masked in place
        labels.masked_fill_(labels == 5, 0)
        return F.cross_entropy(logits.reshape(-1, 6), labels.reshape(-1),
                               reduction="none").view(ids.shape).sum(1)
    return loss


def test_ids_changed_in_place_after_the_forward_are_not_used():
    # the Embedding rule kept the ids without a copy, and its own backward (whose version
    # check would refuse the change) never runs
    torch.manual_seed(0)
    m = TinyLM().double()
    ids = torch.randint(0, 6, (4, 5))
    ids[:, 0] = 5
    want = per_example_grad_norms(m, masked_lm(False), (ids.clone(),))
    got = per_example_grad_norms(m, masked_lm(True), (ids.clone(),))
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


# ------------------------------------------------------- the use check after a failed forward

class HeadOutside(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(6, 4)
        self.l = nn.Linear(4, 4)

    def forward(self, ids):  # the embedding's weight used outside its module: refused
        return F.linear(torch.tanh(self.l(self.emb(ids))), self.emb.weight)


def logsumexp_lm(m, batch):
    return m(batch[0]).logsumexp(-1).sum(1)


@pytest.mark.parametrize("first", ["refused", "index_error"])
def test_the_use_check_still_refuses_after_a_failed_first_forward(first):
    # it counted as done before the first forward had run: after that forward raised, the next
    # call returned norms without the outside use's gradient
    torch.manual_seed(0)
    engine = ClippingEngine(HeadOutside().double(), clip_norm=1.0)
    ids = torch.randint(0, 6, (3, 4))
    bad = ids if first == "refused" else torch.full((3, 4), 60)
    # (the refusal itself; an index the embedding has not: torch's own error)
    error, says = ((ValueError, "outside") if first == "refused" else
                   (IndexError, "index out of range"))
    with pytest.raises(error, match=says):
        engine.per_example_norms(logsumexp_lm, (bad,))
    with pytest.raises(ValueError, match="outside"):
        engine.per_example_norms(logsumexp_lm, (ids,))


# ------------------------------------------------------------------------------ shared rows

class Positions(nn.Module):
    """nanoGPT's positions, ``wpe(torch.arange(T))``, added to the tokens after a reshape."""

    def __init__(self, how):
        super().__init__()
        self.how = how
        self.tok = nn.Embedding(7, 4)
        self.wpe = nn.Embedding(8, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, ids):
        B, T = ids.shape
        positions = {  # made with the batch's dtype, device or shape, not its values
            "type_as": lambda: torch.arange(T).type_as(ids),
            "to": lambda: torch.arange(T).to(ids),
            "new_ones": lambda: ids.new_ones(T).cumsum(0) - 1,
            "zeros_like": lambda: torch.zeros_like(ids[0]) + torch.arange(T),
        }.get(self.how, lambda: torch.arange(T))()
        p = self.wpe(positions)
        if self.how in ("unsqueeze", "type_as", "to", "new_ones", "zeros_like"):
            p = p.unsqueeze(0)
        elif self.how == "index_none":
            p = p[None]
        elif self.how == "view":
            p = p.view(1, T, 4)
        elif self.how == "expand":
            p = p.expand(B, T, 4)
        return self.head(torch.tanh(self.tok(ids) + p)).squeeze(-1)


def row_sum_sq(m, batch):
    return m(batch[0]).pow(2).sum(1)


@pytest.mark.parametrize("how", ["direct", "unsqueeze", "index_none", "view", "expand",
                                 "type_as", "to", "new_ones", "zeros_like"])
def test_shared_positions_at_t_equal_b_are_refused_naming_the_layer(how):
    # the broadcast check saw only the direct case; each reshape gave norms 0.6-4% off. Made
    # with ids' dtype (type_as, to, new_ones, zeros_like), the positions counted as derived from
    # the batch and passed: norms 1-3% off, and one example moved a clipped sum by 2.05 C
    torch.manual_seed(0)
    with pytest.raises(ValueError, match=r"the input of wpe \(Embedding, shape \(4,\)\) does "
                                         r"not come from the batch"):
        ClippingEngine(Positions(how).double(), clip_norm=1.0).per_example_norms(
            row_sum_sq, (torch.randint(0, 7, (4, 4)),))


class SlicedTable(nn.Module):
    """No rule (the torch.func fallback): a table of positions sliced to the sequence length,
    called with the ids (and the mask: the fallback's exact path, or a second positional)."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(8, 4))

    def forward(self, ids, mask=None):
        return self.table[:ids.shape[1]]


class SlicedPositions(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.how = how
        self.tok, self.pos, self.head = nn.Embedding(7, 4), SlicedTable(), nn.Linear(4, 1)

    def forward(self, ids, mask):
        p = {"ids": lambda: self.pos(ids), "keyword": lambda: self.pos(ids, mask=mask),
             "positional": lambda: self.pos(ids, mask)}[self.how]()
        return self.head(torch.tanh(self.tok(ids) + p.unsqueeze(0))).squeeze(-1)


@pytest.mark.parametrize("how", ["ids", "keyword", "positional"])
def test_a_layer_output_of_shared_rows_at_t_equal_b_is_refused_naming_the_layer(how):
    # with the mask as a keyword (the fallback's whole-microbatch VJPs) the norms came out
    # 1-7% off without an error; with the ids alone, a shape error from torch.func; with the
    # mask positional, a refusal that blamed parameters-only inputs
    ids = torch.randint(0, 7, (3, 3), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(3, 3, dtype=torch.float64)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback's warning
        m = SlicedPositions(how).double()
        with pytest.raises(ValueError, match=r"the output of pos \(SlicedTable, shape \(3, 4\)\) "
                                             r"does not come from the batch's values"):
            ClippingEngine(m, clip_norm=1.0).per_example_norms(
                lambda model, b: model(*b).pow(2).sum(1), (ids, mask))


class Queries(nn.Module):
    """Learned query tokens: an Embedding of arange(K) expanded to every example (K = B)."""

    def __init__(self):
        super().__init__()
        self.q = nn.Embedding(4, 4)
        self.a = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        q = self.q(torch.arange(4).expand(x.shape[0], 4))  # (B, K, d): the same for every example
        return self.head(torch.tanh(self.a(x) + q)).squeeze(-1)


def test_an_input_the_same_for_every_example_is_accepted_and_exact():
    torch.manual_seed(0)
    m = Queries().double()
    x = torch.randn(4, 4, 4, dtype=torch.float64)
    norms = ClippingEngine(m, clip_norm=1.0).per_example_norms(row_sum_sq, (x,))
    torch.testing.assert_close(norms, ref_norms(m, row_sum_sq, x), rtol=1e-9, atol=1e-12)


# -------------------------------------------------------------------------------- BatchNorm

def conv_bn(track: bool, affine: bool = True) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3, affine=affine,
                                                            track_running_stats=track),
                         nn.ReLU(), nn.Flatten(), nn.Linear(27, 2)).double()


IMAGES = torch.randn(4, 2, 5, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("track,affine", [(False, True), (True, True), (True, False)])
def test_batchnorm_in_training_mode_is_refused_naming_the_layer(track, affine):
    # its batch statistics couple the examples: no clip bounds one example's influence (before:
    # the torch.func fallback with a generic warning, or an error by accident)
    m = conv_bn(track, affine).train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the fallback's note for BatchNorm's affine params)
        engine = ClippingEngine(m, clip_norm=1.0)
    with pytest.raises(ValueError, match=r"1 \(BatchNorm2d\) is in training mode"):
        engine.per_example_norms(sq_loss, (IMAGES,))
    with pytest.raises(ValueError, match="BatchNorm2d"):
        engine.accumulate(sq_loss, (IMAGES,), {})


@pytest.mark.parametrize("affine", [True, False])
def test_batchnorm_without_running_statistics_is_refused_in_eval_mode_too(affine):
    # track_running_stats=False: torch normalises by the batch's statistics in eval mode as
    # well (the refusal looked at .training only, and a rows check blamed loss_fn instead)
    m = conv_bn(False, affine).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = ClippingEngine(m, clip_norm=1.0)
    with pytest.raises(ValueError, match=r"1 \(BatchNorm2d\) keeps no running statistics"):
        engine.per_example_norms(sq_loss, (IMAGES,))


def test_batchnorm_in_eval_mode_is_per_example_and_exact():
    m = conv_bn(True)
    m(IMAGES)  # running statistics other than the defaults
    m.eval()
    for p in m[1].parameters():
        p.requires_grad_(False)  # a frozen backbone's norm layer
    norms = ClippingEngine(m, clip_norm=1.0).per_example_norms(sq_loss, (IMAGES,))
    torch.testing.assert_close(norms, ref_norms(m, sq_loss, IMAGES), rtol=1e-9, atol=1e-12)


# ------------------------------------------------------------------- parameters a rule ignores

def test_a_layer_with_parameters_its_rule_does_not_compute_is_refused():
    # the legacy torch.nn.utils.weight_norm: weight_g and weight_v next to a computed weight;
    # it failed with a bare KeyError('weight') after the backward
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch's deprecation of the legacy weight_norm)
        m = nn.Sequential(torch.nn.utils.weight_norm(nn.Linear(4, 4)), nn.Tanh(),
                          nn.Linear(4, 1)).double()
    x = torch.randn(3, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"0 \(Linear\) has a torch.nn.utils.weight_norm hook, "
                                         r"which computes its weight from \['weight_g', "
                                         r"'weight_v'\]"):
        ClippingEngine(m, clip_norm=1.0).per_example_norms(sq_loss, (x,))
    s = nn.Sequential(torch.nn.utils.spectral_norm(nn.Linear(4, 4)), nn.Tanh(), nn.Linear(4, 1))
    with pytest.raises(ValueError, match=r"0 \(Linear\) has a torch.nn.utils.spectral_norm hook, "
                                         r"which computes its weight from \['weight_orig'\]"):
        ClippingEngine(s.double(), clip_norm=1.0)
    # frozen, they still make the weight the rule takes for a parameter (it named the bias
    # as what the weight is computed from)
    m[0].weight_g.requires_grad_(False)
    m[0].weight_v.requires_grad_(False)
    with pytest.raises(ValueError, match=r"computes its weight from \['weight_g', 'weight_v'\]"):
        ClippingEngine(m, clip_norm=1.0)


@pytest.mark.parametrize("build, words", [
    (lambda: nn.MultiheadAttention(8, 2), r"0 \(MultiheadAttention\) has the trainable "
                                          r"parameters \['in_proj_bias', 'in_proj_weight', "
                                          r"'out_proj.bias', 'out_proj.weight'\]"),
    (lambda: nn.MultiheadAttention(8, 2, kdim=3, vdim=3), r"0 \(MultiheadAttention\)"),
    (lambda: nn.utils.parametrizations.weight_norm(nn.Linear(8, 8)),
     r"0.parametrizations.weight \(ParametrizationList\) has the trainable parameters "
     r"\['original0', 'original1'\]: parametrizations"),
    (lambda: nn.utils.parametrizations.orthogonal(nn.Linear(8, 8)),
     r"0.parametrizations.weight \(ParametrizationList\) has the trainable parameters "
     r"\['original'\]: parametrizations"),
])
def test_multihead_attention_and_parametrizations_are_refused_by_name_at_construction(build,
                                                                                      words):
    # they failed in the first forward with torch's own error (MHA with kdim: "not enough
    # values to unpack"), or were refused by a rows check that named something else
    with pytest.raises(ValueError, match=words):
        ClippingEngine(nn.Sequential(build(), nn.Linear(8, 1)), clip_norm=1.0)


class _LowRank(nn.Module):
    """A parametrization with trainable parameters of its own (LoRA-like)."""

    def __init__(self, n: int):
        super().__init__()
        self.a, self.b = nn.Parameter(torch.zeros(n, 1)), nn.Parameter(torch.zeros(1, n))

    def forward(self, w):
        return w + self.a @ self.b


def test_frozen_projections_and_parametrizations_trainable_elsewhere_are_refused_by_name():
    # MHA's out_proj is used inside F.multi_head_attention_forward too (another check refused
    # it, saying it was used outside its module); a parametrization whose own parameters train
    # over a frozen original was refused by a rows check naming "LoRAParam"
    frozen = nn.MultiheadAttention(8, 2)
    frozen.in_proj_weight.requires_grad_(False)
    frozen.in_proj_bias.requires_grad_(False)
    with pytest.raises(ValueError, match=r"0 \(MultiheadAttention\) has the trainable "
                                         r"parameters \['out_proj.bias', 'out_proj.weight'\]"):
        ClippingEngine(nn.Sequential(frozen), clip_norm=1.0)
    lin = nn.Linear(8, 8)
    nn.utils.parametrize.register_parametrization(lin, "weight", _LowRank(8))
    lin.parametrizations.weight.original.requires_grad_(False)
    with pytest.raises(ValueError, match=r"ParametrizationList\) has the trainable parameters "
                                         r"\['0.a', '0.b'\]: parametrizations"):
        ClippingEngine(nn.Sequential(lin, nn.Linear(8, 1)), clip_norm=1.0)


def test_a_plan_state_with_a_frozen_parameter_is_refused_naming_it():
    # (it failed with a bare KeyError)
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1)).double()
    m[0].bias.requires_grad_(False)
    state = {n: p.detach() + 0.1 for n, p in m.named_parameters()}
    x = torch.randn(3, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"gives \['0.bias'\], which are not trainable"):
        ClippingEngine(m, clip_norm=1.0).per_example_norms(sq_loss, (x,),
                                                           plan=[(0.5, state), (0.5, None)])


# ------------------------------------------------------- recurrent layers, calls, grad hooks

class _Recurrent(nn.Module):
    """A loop over a cell (or torch's fused layer), the last state through a Linear head."""

    def __init__(self, kind: str, h0: bool = True):
        super().__init__()
        cls = {"RNNCell": nn.RNNCell, "GRUCell": nn.GRUCell, "LSTMCell": nn.LSTMCell,
               "RNN": nn.RNN, "GRU": nn.GRU, "LSTM": nn.LSTM}[kind]
        self.cell = cls(3, 6, batch_first=True) if not kind.endswith("Cell") else cls(3, 6)
        self.head, self.kind, self.h0 = nn.Linear(6, 2), kind, h0

    def forward(self, x):
        if not self.kind.endswith("Cell"):
            return self.head(self.cell(x)[0][:, -1])
        h = x.new_zeros(x.shape[0], 6) if self.h0 else None
        for t in range(x.shape[1]):
            h = self.cell(x[:, t], h)
        return self.head(h)


SEQS = torch.randn(4, 5, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize("kind", ["RNN", "GRU", "LSTM", "LSTMCell"])
def test_torchs_recurrent_layers_are_refused_by_name(kind):
    # (they failed in the first forward: "cell (LSTM) returned tuple, expected a Tensor")
    torch.manual_seed(0)
    with pytest.raises(ValueError, match=rf"cell \({kind}\) has the trainable parameters.*"
                                         r"Loop over an nn.RNNCell or nn.GRUCell"):
        ClippingEngine(_Recurrent(kind).double())


@pytest.mark.parametrize("kind", ["RNNCell", "GRUCell"])
def test_a_loop_over_a_cell_given_its_state_is_exact(kind):
    # the cell advised above: the torch.func fallback, one row per example at every step
    torch.manual_seed(0)
    m = _Recurrent(kind).double()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the fallback's note)
        norms = per_example_grad_norms(m, sq_loss, (SEQS,))
    torch.testing.assert_close(norms, ref_norms(m, sq_loss, SEQS), rtol=1e-9, atol=1e-12)
    # without the state, the cell writes into a zero state of its own making, which vmap
    # cannot: one error naming the layer and the cure (it was torch's broadcast error)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = ClippingEngine(_Recurrent(kind, h0=False).double())
    with pytest.raises(ValueError, match=rf"fallback for {kind}.*pass such a state as an input"):
        engine.per_example_norms(sq_loss, (SEQS,))


@pytest.mark.parametrize("layer", [nn.Linear(4, 3), nn.LayerNorm(4), nn.Embedding(5, 4),
                                   nn.Conv1d(4, 3, 1)])
def test_a_layer_called_with_a_keyword_input_is_refused_by_name(layer):
    # its rule reads the input from args[0] (an IndexError from inside the rule before)
    class Keyword(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = layer

        def forward(self, x):
            return self.layer(input=x)

    x = (torch.tensor([[1, 2], [3, 4]]) if isinstance(layer, nn.Embedding)
         else torch.randn(2, 4, 3) if isinstance(layer, nn.Conv1d) else torch.randn(2, 4))
    with pytest.raises(ValueError, match=r"layer \(\w+\) was called without a tensor as its "
                                         r"first positional argument"):
        per_example_grad_norms(Keyword(), sq_loss, (x,))


def test_gradient_hooks_on_parameters_are_warned_of():
    # the engine's gradients never pass through them: a mask meant to freeze rows is ignored
    m = nn.Sequential(nn.Embedding(5, 4), nn.Flatten(), nn.Linear(8, 2))
    m[0].weight.register_hook(lambda g: g * 0)
    m[2].bias.register_post_accumulate_grad_hook(lambda p: None)
    with pytest.warns(UserWarning, match=r"\['0.weight', '2.bias'\] have gradient hooks"):
        ClippingEngine(m)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # none without hooks
        ClippingEngine(nn.Sequential(nn.Embedding(5, 4), nn.Flatten(), nn.Linear(8, 2)))


@pytest.mark.parametrize("entry", [torch.zeros(3), torch.zeros(2, 4, dtype=torch.int64),
                                   torch.zeros(2, 4, dtype=torch.float16),
                                   torch.zeros(2, 4, requires_grad=True),
                                   torch.zeros(1, 4).expand(2, 4)])
def test_an_accumulator_entry_of_another_shape_or_an_integer_one_is_refused_by_name(entry):
    # (torch's broadcast or cast error from inside the engine before)
    m = nn.Sequential(nn.Linear(4, 2))
    acc = {"0.weight": entry}
    with pytest.raises(ValueError, match=r"acc\['0.weight'\] is .*the clipped sum of 0.weight "
                                         r"torch.float32 \(2, 4\) \(a tensor of its own\)"):
        ClippingEngine(m, clip_norm=1.0).accumulate(sq_loss, (torch.randn(3, 4),), acc)
    assert acc.keys() == {"0.weight"} and acc["0.weight"] is entry and not entry.any()
    good: dict = {}
    ClippingEngine(m, clip_norm=1.0).accumulate(sq_loss, (torch.randn(3, 4),), good)
    twice = {k: v.clone() for k, v in good.items()}
    ClippingEngine(m, clip_norm=1.0).accumulate(sq_loss, (torch.randn(3, 4),), twice)
    assert set(twice) == {"0.weight", "0.bias"} and not torch.equal(twice["0.bias"],
                                                                     good["0.bias"])


def test_a_loss_of_the_inputs_gradient_is_refused_by_name():
    # a gradient penalty inside loss_fn: torch's "appears to not have been used in the
    # graph" from the engine's own leaf before
    m = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 1))
    x = torch.randn(5, 4, requires_grad=True)

    def penalised(model, batch):
        (inp,) = batch
        out = model(inp).sum(1)
        (g,) = torch.autograd.grad(out.sum(), inp, create_graph=True)
        return out + g.pow(2).sum(1)

    with pytest.raises(ValueError, match=r"loss_fn differentiates with respect to a tensor of "
                                         r"the batch .*gradient penalty.*\(RuntimeError: "):
        per_example_grad_norms(m, penalised, (x,))


def test_a_global_forward_hook_that_changes_a_layers_output_is_refused():
    # global hooks run before the layers' own, the engine's included: it took the changed output
    # for the layer's (norms 6-33% off, two red teams). A hook that changes nothing (a
    # profiler's) passes, exactly; one registered during the query is refused
    from torch.nn.modules.module import register_module_forward_hook
    from torch.utils.module_tracker import ModuleTracker

    m = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)).double()
    x = torch.randn(3, 4, dtype=torch.float64)
    handle = register_module_forward_hook(lambda mod, a, o: o * 2 if mod is m[0] else None)
    try:
        with pytest.raises(ValueError, match=r"a global forward hook .* changed the output of "
                                             r"0 \(Linear\)"):
            per_example_grad_norms(m, sq_loss, (x,))
    finally:
        handle.remove()
    seen = []
    handle = register_module_forward_hook(lambda mod, a, o: seen.append(type(mod).__name__))
    try:
        norms = per_example_grad_norms(m, sq_loss, (x,))
        with ModuleTracker():
            again = per_example_grad_norms(m, sq_loss, (x,))
    finally:
        handle.remove()
    assert "Linear" in seen
    torch.testing.assert_close(norms, ref_norms(m, sq_loss, x), rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(again, norms, rtol=0, atol=0)
    assert not torch.nn.modules.module._global_forward_hooks  # (the originals, then none)

    def registering(model, batch):
        h = register_module_forward_hook(lambda mod, a, o: o * 1.5)
        try:
            return sq_loss(model, batch)
        finally:
            h.remove()

    with pytest.raises(ValueError, match="registered during the query"):
        per_example_grad_norms(m, registering, (x,))
    # in place, returning None (or the output itself): the layer's output changed all the same
    # (31% off, a third red team); so did one using the layer's own bias in place (10%)
    for hook in (lambda mod, a, o: o.mul_(2) if mod is m[0] else None,
                 lambda mod, a, o: o.add_(mod.bias) if mod is m[0] else None):
        handle = register_module_forward_hook(hook)
        try:
            with pytest.raises(ValueError, match=r"changed the output of 0 \(Linear\): "):
                per_example_grad_norms(m, sq_loss, (x,))
        finally:
            handle.remove()
    # with a global hook there before the query, one registered in it that changes nothing (a
    # profiler inside loss_fn) passes, and one that removes itself after changing the output
    # is still seen
    handle = register_module_forward_hook(lambda mod, a, o: None)

    def profiled(model, batch):
        with ModuleTracker():
            return sq_loss(model, batch)

    def vanishing(model, batch):
        def once(mod, a, o):
            h.remove()
            return o * 2
        h = register_module_forward_hook(once)
        return sq_loss(model, batch)

    def jumping(model, batch):  # before the engine's own (a fourth red team)
        h = register_module_forward_hook(lambda mod, a, o: o.mul_(2) if mod is m[2] else None)
        torch.nn.modules.module._global_forward_hooks.move_to_end(h.id, last=False)
        try:
            return sq_loss(model, batch)
        finally:
            h.remove()

    try:
        torch.testing.assert_close(per_example_grad_norms(m, profiled, (x,)), norms, rtol=0,
                                   atol=0)
        with pytest.raises(ValueError, match=r"changed the output of 0 \(Linear\) \(returned"):
            per_example_grad_norms(m, vanishing, (x,))
        with pytest.raises(ValueError, match=r"moved before the engine's during the query"):
            per_example_grad_norms(m, jumping, (x,))
    finally:
        handle.remove()

    def midway(model, batch):  # registered after the first layer, gone before the last's hook
        h = model[1](model[0](batch[0]))
        handles = []

        def once(mod, a, o):
            if mod is model[2]:
                handles[0].remove()
                o.mul_(2)

        handles.append(register_module_forward_hook(once))
        try:
            out = model[2](h)
        finally:
            handles[0].remove()  # (the refusal comes first)
        return 0.5 * out.pow(2).sum(1)

    with pytest.raises(ValueError, match=r"registered during the query, and runs on 2 \(Linear\)"):
        per_example_grad_norms(m, midway, (x,))
    assert not torch.nn.modules.module._global_forward_hooks  # (the engine's own removed)


class _NoRule(nn.Module):
    """A layer no rule knows: the torch.func fallback."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, dtype=torch.float64))

    def forward(self, x):
        return torch.sin(x * self.w)


def test_the_fallback_does_not_run_a_layers_hooks_again():
    # it re-ran the call through module(...): the captured input, which has the pre-hook's
    # change already, changed again, and the output gradient met the forward hook twice
    # (norms 6-23% off); and a hook calling .item() failed under vmap
    torch.manual_seed(0)
    m = nn.Sequential(_NoRule(), nn.Linear(4, 3)).double()
    m[0].register_forward_pre_hook(lambda mod, a: (a[0] * 2,))
    m[0].register_forward_hook(lambda mod, a, o: o * 3)
    x = torch.randn(5, 4, dtype=torch.float64)
    ref = ref_norms(m, sq_loss, x)  # (vmapped through the hooks: before the .item() one)
    seen = []
    m[0].register_forward_hook(lambda mod, a, o: seen.append(float(o.sum().item())))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the fallback's note)
        norms = per_example_grad_norms(m, sq_loss, (x,))
    torch.testing.assert_close(norms, ref, rtol=1e-9, atol=1e-12)  # (.item(): not vmapped)
    assert seen  # (the engine's forwards ran it)
