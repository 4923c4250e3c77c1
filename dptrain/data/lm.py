"""Language-model data: E2E and DART (prompt ``mr || `` + target ``ref``), synthetic Markov text.

Every example is a token sequence ``prompt + target + [EOS]`` and the number of prompt tokens.
A batch (``collate``) is right-padded to its longest example:

- ``input_ids``  ``[B, L]`` int64, padded with ``pad_id``;
- ``attention_mask`` ``[B, L]`` int64, 1 on real tokens;
- ``labels`` ``[B, L]`` int64 = input_ids, with -100 on prompt tokens and padding.

Labels follow transformers' convention (not shifted): position t's logits predict
``labels[t + 1]``. No ``position_ids`` are passed: with right padding the real tokens sit at
positions 0..n-1 as they would alone, and causal attention never looks at the padding after
them, so an example's loss does not depend on the rest of its batch.
"""

from __future__ import annotations

import csv
import io
import math
from collections import OrderedDict
from typing import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from dptrain.config import ConfigError, require_file
from dptrain.data import even_subset
from dptrain.messages import data_note

E2E_SEPARATOR = " || "


def e2e_prompt(mr: str) -> str:
    """The prompt text of an E2E meaning representation: ``mr + " || "``."""
    return mr + E2E_SEPARATOR


class LMDataset:
    """Token sequences with a per-example prompt length (prompt tokens are not targets)."""

    kind = "lm"

    def __init__(self, sequences: list[np.ndarray], prompt_lengths, pad_id: int):
        self.sequences = [np.asarray(s, dtype=np.int64) for s in sequences]
        self.prompt_lengths = np.asarray(prompt_lengths, dtype=np.int64).reshape(-1)
        if len(self.sequences) != len(self.prompt_lengths):
            raise ValueError("one prompt length per sequence")
        self.lengths = np.array([len(s) for s in self.sequences], dtype=np.int64)
        self.pad_id = int(pad_id)
        #: examples cut short at ``data.max_length`` (their EOS and the end of the target
        #: lost), and of those the ones left without any target token (they add nothing)
        self.truncated = self.no_target = 0

    def __len__(self) -> int:
        return len(self.sequences)

    @property
    def max_length(self) -> int:
        return int(self.lengths.max()) if len(self.lengths) else 0

    def num_target_tokens(self) -> int:
        """Predicted target tokens over the whole dataset (public: a function of the data)."""
        starts = np.maximum(self.prompt_lengths, 1)
        return int(np.clip(self.lengths - starts, 0, None).sum())

    def collate(self, indices) -> dict[str, torch.Tensor]:
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        n = len(idx)
        width = int(self.lengths[idx].max()) if n else 0
        ids = np.full((n, width), self.pad_id, dtype=np.int64)
        mask = np.zeros((n, width), dtype=np.int64)
        labels = np.full((n, width), -100, dtype=np.int64)
        for row, i in enumerate(idx):
            seq = self.sequences[i]
            k = len(seq)
            ids[row, :k] = seq
            mask[row, :k] = 1
            p = int(self.prompt_lengths[i])
            labels[row, p:k] = seq[p:]
        return {
            "input_ids": torch.from_numpy(ids),
            "attention_mask": torch.from_numpy(mask),
            "labels": torch.from_numpy(labels),
        }


class E2EDataset(LMDataset):
    """E2E rows ``(mr, ref)``; ``references_by_mr()`` groups the whole file's references."""

    def __init__(self, sequences, prompt_lengths, pad_id, mrs, refs, groups):
        super().__init__(sequences, prompt_lengths, pad_id)
        self.mrs = list(mrs)
        self.refs = list(refs)
        self._groups = groups

    def references_by_mr(self, max_prompts: int | None = None) -> "OrderedDict[str, list[str]]":
        """Every distinct ``mr`` of the file (first-appearance order) -> all its references
        (empty lists for a file without references, e.g. testset.csv). ``max_prompts`` keeps
        the first so many meaning representations, each with all its references."""
        items = list(self._groups.items())
        if max_prompts is not None:
            items = items[:max_prompts]
        return OrderedDict((mr, list(refs)) for mr, refs in items)


def read_e2e_csv(path: Path, field: str) -> tuple[list[str], list[str] | None]:
    """Rows of an official E2E CSV: (mrs, refs); refs is None when the file has only MR."""
    require_file(field, path)
    try:
        text = path.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ConfigError(field, f"{path} is not UTF-8 text (byte {e.start}: {e.reason})") from None
    except OSError as e:
        raise ConfigError(field, f"cannot read {path}: {e.strerror or e}") from None
    # strict: an unclosed or stray quote is an error, not a field that swallows the next rows
    reader = csv.reader(io.StringIO(text, newline=""), strict=True)
    try:
        header = [h.strip().lower() for h in next(reader)]
        if "mr" not in header:
            raise ConfigError(field, f"{path} has no 'mr' column (columns: {header})")
        for name in ("mr", "ref"):
            if header.count(name) > 1:
                raise ConfigError(field, f"{path} has {header.count(name)} '{name}' columns "
                                         f"(columns: {header})")
        i_mr = header.index("mr")
        i_ref = header.index("ref") if "ref" in header else None
        mrs, refs = [], []
        for row in reader:
            if not row:
                continue
            # more fields than the header: an unquoted comma, which shifts the columns
            if len(row) > len(header):
                raise ConfigError(field, f"{path}, line {reader.line_num}: {len(row)} "
                                         f"field(s), the header has {len(header)} (a field "
                                         f"with a comma must be quoted)")
            if len(row) <= max(i_mr, i_ref or 0):  # (fewer: the optional columns after them)
                raise ConfigError(field, f"{path}, line {reader.line_num}: {len(row)} "
                                         f"field(s), no '{'ref' if len(row) > i_mr else 'mr'}' "
                                         f"field")
            for name, i in (("mr", i_mr), ("ref", i_ref)):
                if i is not None and not row[i].strip():
                    raise ConfigError(field, f"{path}, line {reader.line_num}: the '{name}' "
                                             f"field is empty")
            mrs.append(row[i_mr].strip())
            if i_ref is not None:
                refs.append(row[i_ref].strip())
    except StopIteration:
        raise ConfigError(field, f"{path} is empty") from None
    except csv.Error as e:
        raise ConfigError(field, f"{path}, line {reader.line_num}: not valid CSV ({e})") from None
    if not mrs:  # a header only: the metrics of an empty split would be NaN
        raise ConfigError(field, f"{path} has a header but no examples")
    return mrs, (refs if i_ref is not None else None)


def dart_mr(tripleset) -> str:
    """DART's triples as one meaning representation, ``s1 : p1 : o1 | s2 : p2 : o2``, relations
    lower-cased: the linearisation of Li et al. (2022, private-transformers), which the DART
    results of the inner-momentum paper follow."""
    return " | ".join(f"{s} : {str(p).lower()} : {o}" for s, p, o in tripleset)


def _is_triple(t) -> bool:
    """A list of three strings or finite numbers: a triple "abc" would pass a length check as
    a, b, c, and null would become the text None (an empty string is kept: the release may
    hold some)."""
    def member(x) -> bool:
        return isinstance(x, str) or (isinstance(x, (int, float)) and not isinstance(x, bool)
                                      and math.isfinite(x))

    return isinstance(t, list) and len(t) == 3 and all(member(x) for x in t)


def _unicode_text(text: str) -> None:
    """ValueError if ``text`` holds a lone surrogate (JSON's ``"\\ud800"`` decodes to one),
    which is not Unicode text: no tokenizer takes it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"a lone surrogate {text[e.start]!r} at character {e.start} of "
                         f"{text[max(0, e.start - 20):e.start + 20]!r} (an escape such as "
                         f"\\ud800 without its pair): not Unicode text") from None


def read_dart_json(path: Path, field: str) -> tuple[list[str], list[str]]:
    """The official DART release (``dart-v1.1.1-full-{train,dev,test}.json``): a JSON list of
    records ``{"tripleset": [[s, p, o], ...], "annotations": [{"source", "text"}, ...]}``, one
    example (mr, ref) per annotation, mr = :func:`dart_mr`."""
    import json

    require_file(field, path)
    try:
        records = json.loads(path.read_bytes().decode("utf-8-sig"))
    except (UnicodeDecodeError, ValueError) as e:
        raise ConfigError(field, f"{path} is not DART JSON ({type(e).__name__}: {e})") from None
    except OSError as e:
        raise ConfigError(field, f"cannot read {path}: {e.strerror or e}") from None
    if not isinstance(records, list):
        raise ConfigError(field, f"{path} is not DART JSON: expected a list of records")
    mrs, refs = [], []
    unannotated = 0
    for i, rec in enumerate(records):
        try:
            triples = rec["tripleset"]
            if not triples or not all(_is_triple(t) for t in triples):
                raise ValueError("every triple needs subject, relation and object (strings or "
                                 "finite numbers)")
            mr = dart_mr(triples)
            _unicode_text(mr)
            annotations = rec["annotations"]
            if isinstance(annotations, dict):
                raise ValueError("'annotations' is a mapping (of lists: the Hugging Face "
                                 "datasets layout?), where the official release has a list of "
                                 "{\"source\", \"text\"} records")
            if not annotations:
                unannotated += 1
            for ann in annotations:
                if not isinstance(ann, dict):
                    raise ValueError(f"an annotation is a {type(ann).__name__}, not a "
                                     f"{{\"source\", \"text\"}} record")
                if not isinstance(ann["text"], str):  # null would become the text "None"
                    raise ValueError(f"an annotation's text is {ann['text']!r}, not a string")
                if not ann["text"].strip():
                    raise ValueError("an annotation's text is empty")
                _unicode_text(ann["text"])
                mrs.append(mr)
                refs.append(ann["text"].strip())
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(field, f"{path}, record {i}: not a DART record "
                                     f"({type(e).__name__}: {e})") from None
    if not mrs:
        raise ConfigError(field, f"{path} holds no annotated examples")
    if unannotated:  # nothing to train on or to score against: said, not dropped in silence
        text = (f"{path.name}: {unannotated} of {len(records)} DART records have no "
                f"annotations and are left out")
        data_note(text, training=field == "data.train_file")
    return mrs, refs


def _encode_examples(tokenizer, prompts: list[str], targets: list[str] | None,
                     max_length: int | None) -> tuple[list[np.ndarray], np.ndarray, dict]:
    """Token sequences ``prompt + target + EOS`` cut to ``max_length``, the prompts' lengths,
    and what the cut did: ``{"truncated": examples cut, "no_target": of those, the ones whose
    prompt alone fills max_length (no target token left), "longest": the longest example's
    length with its EOS}``."""
    eos = tokenizer.eos_id
    seqs, plens = [], []
    if targets is None:
        targets = [None] * len(prompts)
    encoded = tokenizer.encode_pairs(prompts, [t if t is not None else "" for t in targets])
    cut = {"truncated": 0, "no_target": 0, "longest": 0}
    for (pi, ti), t in zip(encoded, targets):
        seq = list(pi) + (list(ti) + [eos] if t is not None else [])
        plen = len(pi)
        cut["longest"] = max(cut["longest"], len(seq))
        if max_length is not None and len(seq) > max_length:
            seq = seq[:max_length]
            plen = min(plen, max_length)
            cut["truncated"] += 1
            cut["no_target"] += t is not None and plen == len(seq)
        seqs.append(np.asarray(seq, dtype=np.int64))
        plens.append(plen)
    return seqs, np.asarray(plens, dtype=np.int64), cut


def load_e2e_split(path: Path, field: str, tokenizer, max_length: int | None,
                   max_examples: int | None, *, references: bool = False) -> E2EDataset:
    """One split of E2E (CSV) or DART (JSON); ``references=True`` (the training split): a file
    without a 'ref' column is refused (every example would be a prompt alone, loss 0, and the
    run a release of noise alone)."""
    reader = read_dart_json if path.suffix.lower() == ".json" else read_e2e_csv
    mrs, refs = reader(path, field)
    if references and refs is None:
        raise ConfigError(field, f"{path} has no 'ref' column: a training file needs a "
                                 f"reference for every example (a file of meaning "
                                 f"representations only, like testset.csv, can be a test file)")
    groups: OrderedDict[str, list[str]] = OrderedDict()
    for j, mr in enumerate(mrs):
        groups.setdefault(mr, [])
        if refs is not None:
            groups[mr].append(refs[j])
    keep = even_subset(len(mrs), max_examples)
    mrs_k = [mrs[j] for j in keep]
    refs_k = [refs[j] for j in keep] if refs is not None else None
    seqs, plens, cut = _encode_examples(tokenizer, [e2e_prompt(m) for m in mrs_k], refs_k,
                                        max_length)
    if refs_k is not None and cut["no_target"] == len(seqs):
        # every loss 0 (a run on noise alone), or a test NLL over no token
        raise ConfigError("data.max_length", f"{max_length} leaves no example of {path.name} a "
                                             f"target token (the prompts alone fill it; the "
                                             f"longest example is {cut['longest']} tokens with "
                                             f"its EOS): raise it")
    data = E2EDataset(seqs, plens, tokenizer.pad_id, mrs_k,
                      refs_k if refs_k is not None else [None] * len(mrs_k), groups)
    data.truncated, data.no_target = cut["truncated"], cut["no_target"]
    return data


def synthetic_lm(n: int, vocab: int, max_length: int, rng: np.random.Generator,
                 transitions: np.ndarray) -> LMDataset:
    """n sequences from a sparse Markov chain over ``vocab`` tokens, then EOS (= ``vocab``)."""
    seqs, plens = [], []
    lo = max(3, max_length // 2)
    for _ in range(n):
        length = int(rng.integers(lo, max_length + 1))  # including EOS
        toks = [int(rng.integers(vocab))]
        for _ in range(length - 2):
            toks.append(int(rng.choice(vocab, p=transitions[toks[-1]])))
        toks.append(vocab)
        seqs.append(np.asarray(toks, dtype=np.int64))
        plens.append(int(rng.integers(1, min(3, length - 1) + 1)))
    return LMDataset(seqs, plens, pad_id=vocab)


def markov_transitions(vocab: int, rng: np.random.Generator) -> np.ndarray:
    """Each token has 3 likely successors (so the chain is learnable) plus a little mass on all."""
    t = np.full((vocab, vocab), 0.05 / vocab)
    for a in range(vocab):
        succ = rng.choice(vocab, size=min(3, vocab), replace=False)
        t[a, succ] += 0.95 / len(succ)
    return t / t.sum(1, keepdims=True)


def _logits(out):
    return out.logits if hasattr(out, "logits") else out


def _empty_loss(model) -> torch.Tensor:
    """A [0]-shaped loss for an empty batch (models such as GPT-2 cannot run a batch of 0).
    It requires grad, so ``.sum().backward()`` works and leaves every parameter's gradient
    untouched; an engine should simply skip empty microbatches (the release still adds noise)."""
    return torch.zeros(0, device=_model_device(model), requires_grad=True)


class _TokenNLL(torch.autograd.Function):
    """Per-row ``-log_softmax(logits)[target]`` (0 where the target is -100) with a backward
    that holds two logit-sized tensors instead of three.

    ``F.cross_entropy`` keeps the log-probabilities for backward, where ``nll_loss_backward``
    writes a dense (N, V) gradient and ``log_softmax_backward`` a second one: with the saved
    log-probabilities that is three (N, V) tensors at once, and with GPT-2's 50,257-token
    vocabulary the logits are the largest activation of the model. Here the backward writes
    ``(softmax - onehot(target)) * grad`` into one new tensor. Values equal F.cross_entropy's
    with ``ignore_index=-100`` bit for bit; gradients agree to float rounding (tests/test_data.py)."""

    generate_vmap_rule = True  # torch.func (grad, vmap) works through it

    @staticmethod
    def forward(logits: torch.Tensor, target: torch.Tensor):
        logp = torch.log_softmax(logits, dim=-1)
        valid = target != -100
        idx = torch.where(valid, target, 0).unsqueeze(-1)
        nll = torch.where(valid, -logp.gather(-1, idx).squeeze(-1), 0.0)
        return nll, logp  # logp: an output only so that backward may keep it (torch.func)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.mark_non_differentiable(output[1])
        ctx.set_materialize_grads(False)  # no zero-filled (N, V) gradient for logp
        ctx.save_for_backward(output[1], inputs[1])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor, _grad_logp):
        logp, target = ctx.saved_tensors
        if grad is None:
            return None, None
        valid = target != -100
        idx = torch.where(valid, target, 0).unsqueeze(-1)
        g = torch.where(valid, grad, 0.0).unsqueeze(-1)  # ignored rows: zero gradient
        out = logp.exp().mul_(g)  # in place: one new logit-sized tensor
        out.scatter_add_(-1, idx, -g)
        return out, None


def token_nll(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``F.cross_entropy(logits, target, ignore_index=-100, reduction="none")`` for (N, V)
    logits, with one logit-sized tensor less at the backward's peak (``_TokenNLL``)."""
    return _TokenNLL.apply(logits, target)[0]


def lm_token_nll(model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token NLL ``[B, L-1]`` (0 where not a target) and the target mask ``[B, L-1]``."""
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    logits = _logits(out)  # (B, L, V)
    if logits.dtype in (torch.float16, torch.bfloat16):  # autocast: the loss in float32
        logits = logits.float()  # (no copy in float32; float64 runs stay float64)
    b, length, v = logits.shape
    # Position l predicts token l + 1. The labels are shifted, not the logits: flattening a
    # (B, L-1, V) slice would copy the logits (a third logit-sized tensor in the forward). The
    # last position gets label -100: no loss and a zero gradient, as if it were cut off.
    labels = batch["labels"][:, 1:]
    nxt = F.pad(labels, (0, 1), value=-100)
    nll = token_nll(logits.reshape(b * length, v), nxt.reshape(-1))
    return nll.view(b, length)[:, :-1], labels != -100


def lm_loss(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per-example loss ``[B]``: mean NLL over that example's target tokens (0 for an example
    without target tokens). Float32 for half-precision logits (autocast), else their dtype
    (float64 runs: float64; until 2026-12-01 their logits were rounded to float32 here)."""
    if batch["input_ids"].shape[0] == 0:
        return _empty_loss(model)
    nll, mask = lm_token_nll(model, batch)
    return nll.sum(1) / mask.sum(1).clamp(min=1)


def _model_device(model) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


@torch.no_grad()
def lm_evaluate(model, dataset: LMDataset, batch_size: int = 32,
                poll: Callable[[], None] | None = None) -> dict:
    """``nll_per_token`` (summed NLL / number of target tokens), ``perplexity``, ``tokens``.
    ``poll``: called before each batch; it may raise to stop the evaluation."""
    was_training = model.training
    model.eval()
    device = _model_device(model)
    total, count = 0.0, 0
    try:
        order = np.argsort(dataset.lengths, kind="stable")  # similar lengths -> less padding
        for s in range(0, len(dataset), batch_size):
            if poll is not None:
                poll()
            batch = {k: v.to(device) for k, v in dataset.collate(order[s:s + batch_size]).items()}
            nll, mask = lm_token_nll(model, batch)
            total += float(nll.sum().double())
            count += int(mask.sum())
    finally:
        model.train(was_training)
    if count == 0:
        return {"nll_per_token": math.nan, "perplexity": math.nan, "tokens": 0}
    nll = total / count
    return {"nll_per_token": nll, "perplexity": math.exp(min(nll, 700.0)), "tokens": count}
