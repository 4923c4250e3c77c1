"""GPT-2 building blocks shared by bench/dp_step.py and bench/inner_momentum.py: the stock
transformers model at a given shape, a fixed random batch, the copy Opacus accepts, and two
table helpers."""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn


def build_gpt2(s, seed: int, device: str) -> nn.Module:
    """transformers GPT2LMHeadModel of shape ``s`` (num_layers, width, num_heads, vocab_size,
    seq_len), tied wte/lm_head, eager attention, dropout 0, in train mode."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=s.vocab_size, n_positions=s.seq_len, n_embd=s.width,
                     n_layer=s.num_layers, n_head=s.num_heads, resid_pdrop=0.0, embd_pdrop=0.0,
                     attn_pdrop=0.0, tie_word_embeddings=True, bos_token_id=None,
                     eos_token_id=None, attn_implementation="eager")
    model = GPT2LMHeadModel(cfg).to(device)
    model.tie_weights()
    assert model.lm_head.weight is model.transformer.wte.weight
    return model.train()


def gpt2_batch(s, seed: int, device: str) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, s.vocab_size, (s.batch_size, s.seq_len), generator=g)
    return {"input_ids": ids.to(device)}


def opacus_gpt2(model: nn.Module, s, untie: bool = True) -> tuple[nn.Module, Tensor]:
    """A copy Opacus accepts (ANCHORS.md): Conv1D -> Linear (marked ``_from_conv1d``), an
    untied lm_head (``untie``; its ghost mode needs it, its hooks accumulate a tied weight's
    per-sample gradient over both uses), and the contiguous position_ids of batch size
    ``s.batch_size`` to pass."""
    from transformers.pytorch_utils import Conv1D

    m = copy.deepcopy(model)
    for parent in list(m.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Conv1D):
                lin = nn.Linear(child.weight.shape[0], child.weight.shape[1],
                                device=child.weight.device, dtype=child.weight.dtype)
                with torch.no_grad():
                    lin.weight.copy_(child.weight.T)  # Conv1D stores (in, out)
                    lin.bias.copy_(child.bias)
                lin._from_conv1d = True
                setattr(parent, name, lin)
    if untie:
        m.config.tie_word_embeddings = False
        m.lm_head.weight = nn.Parameter(m.transformer.wte.weight.detach().clone())
    else:
        assert m.lm_head.weight is m.transformer.wte.weight  # deepcopy keeps the tie
    dev = m.lm_head.weight.device
    pos = torch.arange(s.seq_len, device=dev).expand(s.batch_size, s.seq_len).contiguous()
    return m, pos


def _le(a, b):
    return None if a is None or b is None else bool(a <= b)


def _fmt(x, spec=".3f", suffix=""):
    return "-" if x is None else f"{x:{spec}}{suffix}"
