"""E2E generation quality: greedy decoding from ``mr || `` prompts, BLEU and ROUGE-L.

- BLEU: ``sacrebleu.corpus_bleu`` with every reference of a prompt (variable counts are padded
  with ``None``, which sacrebleu ignores), default 13a tokenisation, case-sensitive, 0-100.
- ROUGE-L: ``rouge_score`` F-measure of each hypothesis against each of its references, the
  maximum over references, averaged over prompts, times 100 (its tokenizer lower-cases, so
  case does not count here).

- BLEU, uncased: the same with ``lowercase=True``. The official E2E scripts (e2e-metrics) score
  BLEU case-insensitively, as do the DP fine-tuning papers that use them (Li et al. 2022); on
  the E2E test set's human references (each MR's first reference against the others) this gives
  60.46 where the case-sensitive BLEU gives 58.85.

The case-sensitive BLEU and the max-over-references ROUGE-L are the inner-momentum paper's
protocol (sacrebleu, multi-reference ROUGE-L). The official ROUGE-L (pycocoevalcap: the Java
PTB tokenizer, which drops punctuation, then an F-score with beta = 1.2 of the maximum
precision and the maximum recall over references) is not reproduced: on the same human
references it is about 1.1 points above this one (63.9 against 62.8, measured with a simple
tokenizer in place of the Java one). Published E2E numbers are often beam-searched too; this
decoding is greedy.
"""

from __future__ import annotations

import inspect
from typing import Callable, Mapping, Sequence

import numpy as np
import torch

from dptrain.parallel.fsdp import reshard

__all__ = ["greedy_generate", "model_positions", "score_texts", "generate_and_score"]


def _model_device(model) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def model_positions(model) -> int | None:
    """The longest sequence a model takes: its config's ``n_positions`` (GPT-2) or
    ``max_position_embeddings`` (Llama, Qwen2, Mistral, ...); None if it has neither."""
    config = getattr(model, "config", None)
    for name in ("n_positions", "max_position_embeddings"):
        n = getattr(config, name, None)
        if isinstance(n, int):
            return n
    return None


def _cache_kwarg(model) -> str:
    """transformers >= 5.x calls the KV cache argument ``cache`` (``past_key_values`` before)."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


def _out_cache(out):
    for name in ("cache", "past_key_values"):
        c = getattr(out, name, None)
        if c is not None:
            return c
    return None


def _logits(out):
    return out.logits if hasattr(out, "logits") else out


@torch.no_grad()
def greedy_generate(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, eos_id: int,
                    pad_id: int | None = None, batch_size: int = 16,
                    use_cache: bool = True, progress: bool = False,
                    poll: Callable[[], None] | None = None) -> list[list[int]]:
    """Greedy continuation of each prompt (token ids), up to ``max_new_tokens`` or EOS (not
    included), and up to the model's positions (:func:`model_positions`) minus that prompt's
    length.

    Prompts are batched with LEFT padding and explicit ``position_ids`` (= position within the
    prompt), so every prompt is decoded exactly as it would be alone, whatever the batch. A
    batch's sequence never exceeds ``n_positions``: rows that reach that length before their own
    limit (shorter prompts batched with a longer one) are continued in later rounds from their
    prompt plus what they generated, which greedy decoding continues identically.
    ``progress``: a progress bar of the prompts done (tqdm, on stderr, on a terminal). ``poll``: called before
    each batch; it may raise to stop the generation (the trainer's stop signal: collective with
    several ranks, which generate the same batches)."""
    from dptrain.telemetry.progress import progress_bar

    pad = eos_id if pad_id is None else pad_id
    n_pos = model_positions(model)
    # an empty prompt starts from EOS
    seqs = [list(p) or [eos_id] for p in prompts]
    out: list[list[int]] = [[] for _ in prompts]
    left = [max(0, max_new_tokens if n_pos is None else min(max_new_tokens, n_pos - len(q)))
            for q in seqs]
    pending = [i for i in range(len(seqs)) if left[i] > 0]
    # (drawn on a terminal only: a log file would get one line of carriage returns)
    bar = progress_bar(progress, total=len(seqs), initial=len(seqs) - len(pending),
                       desc="generating", unit="prompt", leave=False)
    was_training = model.training
    model.eval()
    try:
        while pending:
            new, finished = _greedy_batches(model, [seqs[i] for i in pending],
                                            [left[i] for i in pending], eos_id, pad, n_pos,
                                            batch_size, use_cache, bar.update, poll)
            still = []
            for i, toks, fin in zip(pending, new, finished):
                out[i] += toks
                seqs[i] = seqs[i] + toks
                left[i] -= len(toks)
                if not fin and left[i] > 0:
                    # a pending row is shorter than n_positions, so each round gives it a
                    # token; one that gave none would repeat for ever
                    if not toks:
                        raise RuntimeError(f"greedy_generate: no progress on prompt {i}")
                    still.append(i)
            pending = still
    finally:
        bar.close()
        model.train(was_training)
        reshard(model)  # FSDP2: see dptrain.parallel.fsdp.reshard (a no-op without it)
    return out


def _greedy_batches(model, prompts: list[list[int]], limits: list[int], eos_id: int, pad: int,
                    n_pos: int | None, batch_size: int, use_cache: bool,
                    done_rows=lambda n: None,
                    poll: Callable[[], None] | None = None,
                    ) -> tuple[list[list[int]], list[bool]]:
    """One round of batched greedy decoding: row r generates at most ``limits[r]`` tokens and
    stops at EOS; a batch stops when its sequence reaches ``n_positions``. Returns the tokens
    and, per row, whether it finished (EOS or its limit) rather than being stopped by the
    batch's length; ``done_rows(n)`` after each batch, with the number of its rows that
    finished or ran out of positions for good; ``poll()`` before each batch."""
    device = _model_device(model)
    cache_kw = _cache_kwarg(model)
    tokens: list[list[int]] = [[] for _ in prompts]
    finished = [False] * len(prompts)
    order = np.argsort([len(p) for p in prompts], kind="stable")
    for s in range(0, len(order), batch_size):
        if poll is not None:
            poll()
        chunk = order[s:s + batch_size]
        width = max(len(prompts[i]) for i in chunk)
        lim = torch.tensor([limits[i] for i in chunk], device=device)
        steps = int(lim.max())
        if n_pos is not None:
            steps = min(steps, n_pos - width)
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for r, i in enumerate(chunk):
            ids[r, width - len(prompts[i]):] = torch.tensor(prompts[i], dtype=torch.long)
            mask[r, width - len(prompts[i]):] = 1
        ids, mask = ids.to(device), mask.to(device)
        out_tokens = [[] for _ in chunk]
        done = torch.zeros(len(chunk), dtype=torch.bool, device=device)
        cache = None
        cur_ids, cur_pos = ids, (mask.cumsum(-1) - 1).clamp(min=0)
        for step in range(max(0, steps)):
            kw = {"input_ids": cur_ids, "attention_mask": mask, "position_ids": cur_pos}
            if use_cache:
                kw["use_cache"] = True
                if cache is not None:
                    kw[cache_kw] = cache
            out = model(**kw)
            nxt = _logits(out)[:, -1].float().argmax(-1)
            nxt = torch.where(done, torch.full_like(nxt, pad), nxt)
            for r, t in enumerate(nxt.tolist()):
                if not done[r] and t != eos_id:
                    out_tokens[r].append(t)
            done |= (nxt == eos_id) | (step + 1 >= lim)
            if bool(done.all()):
                break
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            new_pos = cur_pos[:, -1:] + 1
            cache = _out_cache(out) if use_cache else None
            if cache is not None:
                cur_ids, cur_pos = nxt[:, None], new_pos
            else:  # no cache: run the whole sequence again
                cur_ids = torch.cat([cur_ids, nxt[:, None]], dim=1)
                cur_pos = torch.cat([cur_pos, new_pos], dim=1)
        for r, i in enumerate(chunk):
            tokens[i] = out_tokens[r]
            finished[i] = bool(done[r])
        # (a row stopped by its batch's length goes on in a later round unless out of positions)
        done_rows(sum(finished[i] or (n_pos is not None
                                      and len(prompts[i]) + len(tokens[i]) >= n_pos)
                      for i in chunk))
    return tokens, finished


def score_texts(hypotheses: Sequence[str], references: Sequence[Sequence[str]]) -> dict:
    """Corpus BLEU (sacrebleu, multi-reference; case-sensitive and uncased) and mean
    max-over-references ROUGE-L F1, all 0-100 (see the module's docstring). ``references[i]``
    holds all references of ``hypotheses[i]`` (at least one)."""
    import sacrebleu
    from rouge_score import rouge_scorer

    if len(hypotheses) != len(references):
        raise ValueError("one list of references per hypothesis")
    if not hypotheses:
        return {"bleu": float("nan"), "bleu_uncased": float("nan"), "rouge_l": float("nan"),
                "num_prompts": 0}
    if any(len(r) == 0 for r in references):
        raise ValueError("every hypothesis needs at least one reference")
    k = max(len(r) for r in references)
    streams = [[r[j] if j < len(r) else None for r in references] for j in range(k)]
    bleu = sacrebleu.corpus_bleu(list(hypotheses), streams).score
    bleu_uncased = sacrebleu.corpus_bleu(list(hypotheses), streams, lowercase=True).score
    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False)
    rouge = [max(scorer.score(ref, hyp)["rougeL"].fmeasure for ref in refs)
             for hyp, refs in zip(hypotheses, references)]
    return {"bleu": float(bleu), "bleu_uncased": float(bleu_uncased),
            "rouge_l": 100.0 * float(np.mean(rouge)), "num_prompts": len(hypotheses)}


def generate_and_score(model, tokenizer, mr_to_refs: Mapping[str, Sequence[str]],
                       max_new_tokens: int = 64, batch_size: int = 16,
                       return_texts: bool = False, progress: bool = False,
                       poll: Callable[[], None] | None = None) -> dict:
    """Greedy generation for every E2E meaning representation (prompt ``mr || ``), scored
    against all its references: ``{"bleu", "bleu_uncased", "rouge_l", "num_prompts"}`` (+
    ``"texts"``, the generations in ``mr_to_refs`` order, when ``return_texts``), and
    ``"no_room"``, the number of scored prompts that fill the model's positions
    (:func:`model_positions`), which generate nothing and score as empty texts.
    ``tokenizer`` is a dptrain tokenizer (``dptrain.data.tokenizers``); ``mr_to_refs`` e.g.
    ``task.test.references_by_mr()``. Prompts without references are generated, not scored.
    ``poll``: see :func:`greedy_generate`."""
    from dptrain.data.lm import e2e_prompt

    mrs = list(mr_to_refs)
    prompt_ids = [tokenizer.encode_pair(e2e_prompt(mr), "")[0] for mr in mrs]
    gen = greedy_generate(model, prompt_ids, max_new_tokens, tokenizer.eos_id, tokenizer.pad_id,
                          batch_size, progress=progress, poll=poll)
    texts = [tokenizer.decode(g).strip() for g in gen]
    scored = [(t, list(mr_to_refs[m])) for t, m in zip(texts, mrs) if len(mr_to_refs[m])]
    result = score_texts([t for t, _ in scored], [r for _, r in scored])
    n_pos = model_positions(model)
    result["no_room"] = 0 if n_pos is None else sum(
        len(q) >= n_pos for q, m in zip(prompt_ids, mrs) if len(mr_to_refs[m]))
    if return_texts:
        result["texts"] = texts
    return result
