"""E2E text metrics: BLEU/ROUGE-L with multiple references, greedy generation."""

from __future__ import annotations

import math
import re
import types
from collections import Counter

import pytest
import torch

from dptrain.data import DEFAULT_E2E_PATH, REPO_ROOT, DataInfo
from dptrain.data.tokenizers import ByteTokenizer
from _threads import _one_thread  # noqa: F401  (autouse: one torch thread)

from dptrain.eval.text import generate_and_score, greedy_generate, score_texts
from dptrain.models import ModelConfig, build_model

E2E_DIR = (REPO_ROOT / DEFAULT_E2E_PATH).resolve()


SMALL = {
    "name[Aromi], eatType[coffee shop]": ["Aromi is a coffee shop.",
                                          "There is a coffee shop called Aromi.",
                                          "Aromi serves coffee."],
    "name[Zizzi], area[riverside]": ["Zizzi is by the riverside."],
    "name[Wildwood], food[French]": ["Wildwood serves French food.", "French food at Wildwood."],
}


def test_references_against_themselves_score_100():
    refs = list(SMALL.values())
    res = score_texts([r[0] for r in refs], refs)
    assert res["bleu"] == pytest.approx(100.0) and res["rouge_l"] == pytest.approx(100.0)
    # any one of the references counts (multi-reference): the last ones too
    res = score_texts([r[-1] for r in refs], refs)
    assert res["bleu"] == pytest.approx(100.0) and res["rouge_l"] == pytest.approx(100.0)
    bad = score_texts(["completely unrelated words"] * 3, refs)
    assert bad["bleu"] < 5 and bad["rouge_l"] < 20


@pytest.mark.skipif(not (E2E_DIR / "testset_w_refs.csv").is_file(), reason="no E2E data")
def test_real_e2e_references_score_100():
    from dptrain.data.lm import load_e2e_split

    ds = load_e2e_split(E2E_DIR / "testset_w_refs.csv", "f", ByteTokenizer(), None, 10)
    groups = ds.references_by_mr(60)
    refs = list(groups.values())
    res = score_texts([r[0] for r in refs], refs)
    assert res["bleu"] == pytest.approx(100.0) and res["rouge_l"] == pytest.approx(100.0)
    assert res["num_prompts"] == 60


def _spiky_gpt2():
    info = DataInfo(kind="lm", vocab_size=257, pad_id=256, eos_id=256, max_length=64)
    torch.manual_seed(0)
    model = build_model(ModelConfig(n_layer=2, n_embd=32, n_head=2, n_positions=64), info)
    with torch.no_grad():  # larger weights: outputs depend strongly on content and position
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.5)
    return model.eval()


def test_batched_greedy_equals_one_by_one_and_uncached():
    model = _spiky_gpt2()
    prompts = [[10, 20, 30], [5], [7, 8, 9, 10, 11, 12, 13], [4, 4], [99, 98, 97]]
    batched = greedy_generate(model, prompts, 6, eos_id=256, batch_size=5)
    alone = [greedy_generate(model, [p], 6, eos_id=256, batch_size=1)[0] for p in prompts]
    uncached = greedy_generate(model, prompts, 6, eos_id=256, batch_size=3, use_cache=False)
    assert batched == alone == uncached
    assert len({tuple(g) for g in batched}) > 1  # the check is not vacuous
    # greedy = argmax of a plain full forward at every step
    seq = list(prompts[2])
    for _ in range(len(alone[2])):
        with torch.no_grad():
            seq.append(int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
    assert seq[len(prompts[2]):] == alone[2]
    # capped by n_positions (64)
    long = [list(range(1, 61)), [3] * 62]
    assert [len(g) for g in greedy_generate(model, long, 500, eos_id=256, batch_size=1)] == [4, 2]
    # each row has its own cap, whatever it is batched with (short rows beside a long one
    # continue in later rounds), with and without the KV cache
    mixed = [[5], [10, 20, 30], list(range(1, 58)), [3] * 62, [9] * 40, []]
    alone = [greedy_generate(model, [p], 30, eos_id=256, batch_size=1)[0] for p in mixed]
    assert [len(g) for g in alone[2:4]] == [7, 2]
    assert max(len(g) for g in alone) > 7  # short prompts get more than the long one's cap
    for bs, cache in [(6, True), (4, True), (6, False)]:
        assert greedy_generate(model, mixed, 30, eos_id=256, batch_size=bs,
                               use_cache=cache) == alone
    assert [len(g) for g in greedy_generate(model, long, 500, eos_id=256)] == [4, 2]


def _spiky_llama(dropout: float):
    """A tiny Llama (rotary positions, grouped-query attention) with large weights; dropout
    > 0 builds it with eager attention, 0 with sdpa (dptrain's choice, dptrain/models)."""
    info = DataInfo(kind="lm", vocab_size=257, pad_id=256, eos_id=256, max_length=64)
    torch.manual_seed(0)
    model = build_model(ModelConfig(name="causal_lm", dropout=dropout, tie_embeddings=False,
                                    hf_config={"model_type": "llama", "hidden_size": 32,
                                               "intermediate_size": 64, "num_hidden_layers": 2,
                                               "num_attention_heads": 4,
                                               "num_key_value_heads": 2,
                                               "max_position_embeddings": 64}), info)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.5)
    return model.eval()


@pytest.mark.parametrize("dropout", [0.0, 0.1], ids=["sdpa", "eager"])
def test_llama_greedy_is_the_same_with_kv_cache_left_padding_and_without(dropout):
    """The KV cache, left padding with explicit position_ids (rotary positions from 0 in every
    row) and the no-cache path give the same tokens as each prompt alone, and as the argmax of
    plain forwards; max_position_embeddings caps each row as n_positions caps GPT-2's."""
    model = _spiky_llama(dropout)
    assert model.config._attn_implementation == ("eager" if dropout else "sdpa")
    prompts = [[10, 20, 30], [5], [7, 8, 9, 10, 11, 12, 13], [4, 4], [99, 98, 97]]
    batched = greedy_generate(model, prompts, 6, eos_id=256, batch_size=5)
    alone = [greedy_generate(model, [p], 6, eos_id=256, batch_size=1)[0] for p in prompts]
    uncached = greedy_generate(model, prompts, 6, eos_id=256, batch_size=3, use_cache=False)
    assert batched == alone == uncached
    assert len({tuple(g) for g in batched}) > 1 and all(len(g) == 6 for g in batched)
    seq = list(prompts[2])
    for _ in range(len(alone[2])):
        with torch.no_grad():
            seq.append(int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
    assert seq[len(prompts[2]):] == alone[2]
    mixed = [[5], list(range(1, 58)), [3] * 62, [9] * 40, []]
    alone = [greedy_generate(model, [p], 30, eos_id=256, batch_size=1)[0] for p in mixed]
    assert [len(g) for g in alone[1:4]] == [7, 2, 24]
    for bs, cache in [(5, True), (3, True), (5, False)]:
        assert greedy_generate(model, mixed, 30, eos_id=256, batch_size=bs,
                               use_cache=cache) == alone


def test_greedy_stops_at_eos():
    model = _spiky_gpt2()
    with torch.no_grad():  # make EOS the argmax everywhere
        model.lm_head.weight[256].add_(0.0)
        model.transformer.ln_f.weight.zero_()
        model.transformer.ln_f.bias.zero_()
        model.transformer.ln_f.bias[0] = 1.0
        model.transformer.wte.weight[:, 0] = 0.0
        model.transformer.wte.weight[256, 0] = 1.0
    assert greedy_generate(model, [[1, 2], [3]], 10, eos_id=256) == [[], []]


def test_generation_runs_without_dropout_and_restores_the_mode():
    """A model in training mode with dropout (GPT-2's usual 0.1, here 0.5) generates as in
    eval mode, the same twice (the scores are reproducible), and trains again after."""
    info = DataInfo(kind="lm", vocab_size=257, pad_id=256, eos_id=256, max_length=64)
    torch.manual_seed(0)
    model = build_model(ModelConfig(n_layer=2, n_embd=32, n_head=2, n_positions=64,
                                    dropout=0.5), info)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.5)
    prompts = [[10, 20, 30], [5], [7, 8, 9, 10]]
    expected = greedy_generate(model.eval(), prompts, 8, eos_id=256)
    model.train()
    assert greedy_generate(model, prompts, 8, eos_id=256) == expected
    assert greedy_generate(model, prompts, 8, eos_id=256) == expected and model.training


def test_an_empty_prompt_starts_from_eos_whatever_the_pad():
    model = _spiky_gpt2()
    # 256 is EOS; 255 pads: an empty prompt is [EOS], not [pad]
    got = greedy_generate(model, [[]], 8, eos_id=256, pad_id=255)
    assert got == greedy_generate(model, [[256]], 8, eos_id=256, pad_id=255)
    assert got != greedy_generate(model, [[255]], 8, eos_id=256, pad_id=255)


# ------------------------------------------------------------------ independent references

def _tok13a(s: str) -> list[str]:
    """sacrebleu's 13a tokenisation for plain lower-case words with '.' or ',' (the only
    punctuation the cases below use): the mark becomes its own token."""
    return re.sub(r"([^0-9])([\.,])", r"\1 \2 ", s).split()


def _ngrams(toks, n):
    return Counter(tuple(toks[i:i + n]) for i in range(len(toks) - n + 1))


def _bleu_by_hand(hyps, refs_per_hyp):
    """Corpus BLEU (Papineni et al.), multi-reference: n-gram counts clipped by the maximum
    count over that hypothesis' references, reference length = the closest one (the shorter
    on a tie), brevity penalty on the corpus sums, 0-100. (No smoothing: every precision of
    the cases below is non-zero.)"""
    match, total = [0] * 4, [0] * 4
    c = r = 0
    for h, refs in zip(hyps, refs_per_hyp):
        ht = _tok13a(h)
        rts = [_tok13a(x) for x in refs]
        c += len(ht)
        r += min((abs(len(t) - len(ht)), len(t)) for t in rts)[1]
        for n in range(1, 5):
            hc = _ngrams(ht, n)
            mx = Counter()
            for t in rts:
                mx |= _ngrams(t, n)
            match[n - 1] += sum(min(v, mx[g]) for g, v in hc.items())
            total[n - 1] += max(len(ht) - n + 1, 0)
    assert all(match), "the case must have a match at every order (no smoothing here)"
    bp = 1.0 if c > r else math.exp(1 - r / c)
    return 100.0 * bp * math.exp(sum(math.log(m / t) for m, t in zip(match, total)) / 4)


def _rouge_tokens(s: str) -> list[str]:
    """rouge_score's default tokenizer without stemming: lower case, non-alphanumerics split."""
    return re.sub(r"[^a-z0-9]+", " ", s.lower()).split()


def _lcs(a, b) -> int:
    dp = [[0] * (len(b) + 1) for _ in range(len(a) + 1)]
    for i, x in enumerate(a):
        for j, y in enumerate(b):
            dp[i + 1][j + 1] = dp[i][j] + 1 if x == y else max(dp[i][j + 1], dp[i + 1][j])
    return dp[-1][-1]


def _rouge_l_f1(hyp: str, ref: str) -> float:
    h, r = _rouge_tokens(hyp), _rouge_tokens(ref)
    lcs = _lcs(h, r)
    if lcs == 0:
        return 0.0
    p, rec = lcs / len(h), lcs / len(r)
    return 2 * p * rec / (p + rec)


# Three prompts with 3, 2 and 1 references; the hypotheses match partly, so that every choice
# the metric makes shows: which reference length counts (a short hypothesis whose prompt has
# fewer references than another), clipping over references, 13a punctuation, F1 (not recall),
# no stemming (dogs/dog, run/runs), the mean (not the median) over prompts.
HYPS = ["the cat sat on the mat.", "dogs run in the park", "it is"]
REFS = [["the cat sat on a mat.", "there is a cat on the mat.", "a cat is sitting on the mat."],
        ["the dog runs in a park", "a dog is running in the park"],
        ["it is good here now"]]


def test_uncased_bleu_is_bleu_of_the_lower_cased_texts():
    # the official E2E script's BLEU ignores case: a hypothesis that differs from a reference
    # only in case scores 100 uncased and less with case; on mixed-case texts the uncased
    # score is the hand computation on lower-cased hypotheses and references
    refs = list(SMALL.values())
    shouted = score_texts([r[0].upper() for r in refs], refs)
    assert shouted["bleu_uncased"] == pytest.approx(100.0)
    assert shouted["bleu"] < 5
    hyps = [h.replace("dog", "Dog").replace("it", "It") for h in HYPS]
    res = score_texts(hyps, REFS)
    want = _bleu_by_hand([h.lower() for h in hyps], [[r.lower() for r in rs] for rs in REFS])
    assert res["bleu_uncased"] == pytest.approx(want, rel=1e-9, abs=1e-9)
    assert res["bleu"] < res["bleu_uncased"]


def test_bleu_and_rouge_equal_hand_computed_multi_reference_values():
    res = score_texts(HYPS, REFS)
    bleu = _bleu_by_hand(HYPS, REFS)
    rouge = 100.0 * sum(max(_rouge_l_f1(h, r) for r in refs)
                        for h, refs in zip(HYPS, REFS)) / len(HYPS)
    assert res["num_prompts"] == 3
    assert res["bleu"] == pytest.approx(bleu, rel=1e-9, abs=1e-9)
    assert res["rouge_l"] == pytest.approx(rouge, rel=1e-9, abs=1e-9)
    # the case is not degenerate: a brevity penalty applies, and the scores are far from 0/100
    assert 20 < res["bleu"] < 90 and 40 < res["rouge_l"] < 90
    # the well-kept libraries agree with the hand computation
    import sacrebleu
    from rouge_score import rouge_scorer

    streams = [[r[j] if j < len(r) else None for r in REFS] for j in range(3)]
    assert sacrebleu.corpus_bleu(HYPS, streams).score == pytest.approx(bleu, rel=1e-9)
    sc = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False)
    assert sc.score(REFS[1][1], HYPS[1])["rougeL"].fmeasure == pytest.approx(
        _rouge_l_f1(HYPS[1], REFS[1][1]))


def test_rouge_l_is_sentence_level_also_for_a_hypothesis_with_a_newline():
    # generated text may hold a newline: ROUGE-L (one LCS), not ROUGE-Lsum (union over lines)
    hyp, ref = "in the park\nthe dog", "the dog in the park"
    res = score_texts([hyp], [[ref]])
    assert res["rouge_l"] == pytest.approx(100.0 * _rouge_l_f1(hyp, ref)) == pytest.approx(60.0)


# ------------------------------------------------------------------ generate_and_score wiring

class _ScriptedByteLM(torch.nn.Module):
    """A byte-level "model" whose greedy continuation of ``mr + " || " + partial`` is the next
    byte of ``answers[mr]``, then EOS (256); any other sequence gets EOS at once. It has no KV
    cache, so greedy_generate feeds it the whole (left-padded) sequence every step."""

    def __init__(self, answers: dict[str, str], n_positions: int = 256):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.config = types.SimpleNamespace(n_positions=n_positions)
        self.answers = answers
        self.seen: list[str] = []

    def forward(self, input_ids, attention_mask=None, position_ids=None, **kw):
        b, length = input_ids.shape
        logits = torch.zeros(b, length, 257)
        for r in range(b):
            row = input_ids[r] if attention_mask is None else input_ids[r][attention_mask[r] == 1]
            text = bytes(int(t) for t in row if int(t) < 256).decode("utf-8")
            nxt = 256
            if " || " in text:
                mr, partial = text.split(" || ", 1)
                if partial == "":
                    self.seen.append(text)
                ans = self.answers.get(mr)
                if ans is not None and ans.startswith(partial) and len(partial) < len(ans):
                    nxt = ans.encode()[len(partial)]
            logits[r, -1, nxt] = 1.0
        return types.SimpleNamespace(logits=logits)


def test_generate_and_score_prompts_strips_and_scores_every_mr_against_its_own_references():
    refs = {
        "name[Aromi], eatType[coffee shop]": ["Aromi is a coffee shop.",
                                              "There is a coffee shop called Aromi.",
                                              "Aromi serves coffee."],
        "name[Cotto]": [],  # no references: generated, not scored
        "name[Zizzi], area[riverside]": ["Zizzi is by the riverside."],
        "name[Wildwood], food[French]": ["Wildwood serves French food.",
                                         "French food at Wildwood."],
    }
    answers = {  # leading and trailing white space: the generations are stripped
        "name[Aromi], eatType[coffee shop]": "  There is a coffee shop called Aromi. ",
        "name[Cotto]": " Cotto is a place.",
        "name[Zizzi], area[riverside]": " Zizzi is near the river. ",
        "name[Wildwood], food[French]": "Wildwood serves French food.",
    }
    model = _ScriptedByteLM(answers).train()
    res = generate_and_score(model, ByteTokenizer(), refs, max_new_tokens=64, batch_size=3,
                             return_texts=True)
    assert model.training  # generation runs in eval mode and restores the caller's mode
    # the prompt of every mr is exactly ``mr + " || "``
    assert sorted(model.seen) == sorted(mr + " || " for mr in refs)
    assert res["texts"] == [answers[m].strip() for m in refs]  # in mr_to_refs order
    assert res["num_prompts"] == 3
    scored = [m for m in refs if refs[m]]
    expected = score_texts([answers[m].strip() for m in scored], [refs[m] for m in scored])
    assert res["bleu"] == pytest.approx(expected["bleu"])
    assert res["rouge_l"] == pytest.approx(expected["rouge_l"])
    # two of the three generations are references, the third is close: a high, non-100 score
    assert 50 < res["rouge_l"] < 100
    assert res["no_room"] == 0
    # a scored prompt that fills the positions generates nothing and scores as empty: counted
    # (the trainer says so on stderr); an unscored one (Cotto) is not
    model = _ScriptedByteLM(answers, n_positions=len("name[Cotto] || ") + 2)  # " C"
    res = generate_and_score(model, ByteTokenizer(), refs, max_new_tokens=64, batch_size=3,
                             return_texts=True)
    assert res["texts"] == ["", "C", "", ""] and res["no_room"] == 3
    # at the boundary: a prompt exactly n_positions tokens long has no room (Zizzi's and
    # Wildwood's, 32 tokens; a mutant counting only longer ones said 1), one token shorter has
    # room for one
    lengths = {m: len(ByteTokenizer().encode_pair(m + " || ", "")[0]) for m in refs}
    assert lengths["name[Zizzi], area[riverside]"] == lengths["name[Wildwood], food[French]"] == 32
    for n_pos, no_room in ((32, 3), (33, 1)):
        model = _ScriptedByteLM(answers, n_positions=n_pos)
        res = generate_and_score(model, ByteTokenizer(), refs, max_new_tokens=64, batch_size=3,
                                 return_texts=True)
        # (each generates what room is left of its answer: at 33, one byte for Zizzi, " ")
        assert res["texts"] == [answers[m][:max(0, n_pos - lengths[m])].strip() for m in refs]
        assert res["no_room"] == no_room and (n_pos == 33) == (res["texts"][3] == "W")


class _NeverEOS(torch.nn.Module):
    """Always predicts byte 120 ("x"), never EOS: every row runs to its own limit."""

    def __init__(self, n_positions):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.config = types.SimpleNamespace(n_positions=n_positions)

    def forward(self, input_ids, **kw):
        logits = torch.zeros(*input_ids.shape, 257)
        logits[..., 120] = 1.0
        return types.SimpleNamespace(logits=logits)


def test_greedy_generate_length_is_min_of_max_new_tokens_and_room_left():
    # rows of different lengths batched together are stopped by the batch's length and
    # continued in later rounds, where rows with different remaining limits share a batch:
    # each row still gets exactly min(max_new_tokens, n_positions - len(prompt)) tokens
    model = _NeverEOS(n_positions=15)
    prompts = [[1] * 14, [2] * 10, [3] * 2, [4] * 12, [5] * 15, [6] * 16]
    for bs in (1, 2, 3, 4, 6):
        out = greedy_generate(model, prompts, 6, eos_id=256, batch_size=bs)
        assert [len(g) for g in out] == [1, 5, 6, 3, 0, 0], bs
        assert all(t == 120 for g in out for t in g)


def test_the_progress_bar_counts_each_prompt_once_when_it_is_done(monkeypatch):
    # rows continued in later rounds are counted when they finish, those without room at once
    import tqdm

    bars = []

    class Bar(tqdm.tqdm):
        def __init__(self, *a, **kw):
            super().__init__(*a, **{**kw, "disable": False})
            self.counts = [self.n]
            bars.append(self)

        def update(self, n=1):
            super().update(n)
            self.counts.append(self.n)

    monkeypatch.setattr(tqdm, "tqdm", Bar)
    model = _NeverEOS(n_positions=15)
    prompts = [[1] * 14, [2] * 10, [3] * 2, [4] * 12, [5] * 15, [6] * 16]
    for bs in (1, 2, 4):
        greedy_generate(model, prompts, 6, eos_id=256, batch_size=bs, progress=True)
        counts = bars[-1].counts
        assert counts[0] == 2 and counts[-1] == 6 and counts == sorted(counts), (bs, counts)


def test_greedy_generate_polls_before_each_batch_and_stops_when_the_poll_raises():
    # the trainer's stop signal: a poll that raises ends the generation before the next batch
    model = _spiky_gpt2().train()
    prompts = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10], [11, 12], [13]]
    polls = []

    def poll():
        polls.append(len(polls))
        if len(polls) == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        greedy_generate(model, prompts, 4, eos_id=256, batch_size=2, poll=poll)
    assert polls == [0, 1, 2]
    assert model.training  # the model is put back as it was
    polls.clear()
    assert greedy_generate(model, prompts, 4, eos_id=256, batch_size=4,
                           poll=lambda: polls.append(1)) == greedy_generate(
        model, prompts, 4, eos_id=256, batch_size=4)
    assert polls == [1, 1]


# ------------------------------------------------------------------ mutation-run additions

def test_score_texts_refuses_mismatched_or_missing_references_and_gives_nan_for_none():
    refs = list(SMALL.values())
    with pytest.raises(ValueError, match="one list of references per hypothesis"):
        score_texts([r[0] for r in refs][:2], refs)
    with pytest.raises(ValueError, match="at least one reference"):
        score_texts(["Aromi is a coffee shop.", "Zizzi"], [refs[0], []])
    empty = score_texts([], [])
    assert empty["num_prompts"] == 0
    assert all(math.isnan(empty[k]) for k in ("bleu", "bleu_uncased", "rouge_l"))


def test_bleu_tokenises_e2e_prices_as_sacrebleu_13a_does():
    # E2E references spell prices "£20-25": 13a splits the hyphen between digits (not the one
    # of "family-friendly") and keeps "£20" whole, so "£20-25" and "£20 - 25" are the same
    # tokens (100); the international tokenizer would split "£" and keep "20-25" (44.8)
    import sacrebleu

    hyp, ref = "The Vaults costs £20-25.", "The Vaults costs £20 - 25."
    assert score_texts([hyp], [[ref]])["bleu"] == pytest.approx(100.0)
    hyps = ["The Vaults is a family-friendly pub costing £20-25."]
    refs = [["The Vaults is a family friendly pub costing £ 20-25."]]
    want = sacrebleu.corpus_bleu(hyps, [[r[0] for r in refs]], tokenize="13a").score
    assert score_texts(hyps, refs)["bleu"] == pytest.approx(want, rel=1e-9)
    assert want < 50  # (the international tokenizer gives 70.2 here)


def test_greedy_generate_feeds_the_kv_cache_under_the_models_own_argument_name():
    # transformers 5.x calls it ``cache``; the older ``past_key_values`` still works there but
    # warns (and goes away in 5.40): each step after the first feeds one token, no warning
    import warnings

    model = _spiky_gpt2()
    widths = []
    model.register_forward_pre_hook(
        lambda mod, args, kw: widths.append(kw["input_ids"].shape[1]), with_kwargs=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = greedy_generate(model, [[10, 20, 30], [5]], 4, eos_id=256)
    assert widths == [3, 1, 1, 1]
    assert [len(g) for g in got] == [4, 4]


class _Scripted(torch.nn.Module):
    """Predicts ``script[n]`` after ``n`` real (unmasked) tokens past the first: a row's
    continuation does not depend on what it is batched with. No KV cache."""

    def __init__(self, script, n_positions=64):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.config = types.SimpleNamespace(n_positions=n_positions)
        self.script = script

    def forward(self, input_ids, attention_mask=None, **kw):
        logits = torch.zeros(*input_ids.shape, 257)
        for r in range(input_ids.shape[0]):
            n = int(attention_mask[r].sum()) - 1
            logits[r, -1, self.script[n % len(self.script)]] = 1.0
        return types.SimpleNamespace(logits=logits)


def test_a_row_stops_for_good_at_its_first_eos():
    # after an EOS a row adds nothing, whatever the model predicts next and however long its
    # batch goes on; rows that finish (EOS or their limit) do not get pad tokens either
    model = _Scripted([120, 121, 256, 122, 123, 124, 125, 126])
    prompts = [[1], [1, 2], [1, 2, 3, 4]]
    out = greedy_generate(model, prompts, 6, eos_id=256, pad_id=255, batch_size=3)
    assert out == [[120, 121], [121], [122, 123, 124, 125, 126, 120]]
    assert greedy_generate(model, prompts, 6, eos_id=256, pad_id=255, batch_size=1) == out


def test_rows_that_reach_their_limit_get_no_pad_tokens():
    # the length test's rows with a pad that is not EOS: a row done early is fed the pad while
    # its batch goes on, which must not be counted as generated
    model = _NeverEOS(n_positions=15)
    prompts = [[1] * 14, [2] * 10, [3] * 2, [4] * 12, [5] * 15, [6] * 16]
    for bs in (2, 6):
        out = greedy_generate(model, prompts, 6, eos_id=256, pad_id=255, batch_size=bs)
        assert out == [[120] * n for n in (1, 5, 6, 3, 0, 0)], bs


def test_generate_and_score_passes_its_settings_to_the_generation(monkeypatch):
    refs = {"name[Aromi]": ["Aromi is a pub."], "name[Zizzi]": ["Zizzi is a pub."]}
    answers = {"name[Aromi]": "Aromi is a coffee shop.", "name[Zizzi]": "Zizzi is a pub."}
    # max_new_tokens: at most that many bytes of each answer
    res = generate_and_score(_ScriptedByteLM(answers), ByteTokenizer(), refs, max_new_tokens=5,
                             return_texts=True)
    assert res["texts"] == ["Aromi", "Zizzi"]
    assert res["bleu"] == pytest.approx(score_texts(["Aromi", "Zizzi"],
                                                    list(refs.values()))["bleu"])
    # poll: the trainer's stop signal reaches the generation
    polls = []

    def stop():
        polls.append(1)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        generate_and_score(_ScriptedByteLM(answers), ByteTokenizer(), refs, poll=stop)
    assert polls == [1]
    # progress: a bar of the prompts (drawn when asked)
    import dptrain.telemetry.progress as progress

    asked = []
    real = progress.progress_bar
    monkeypatch.setattr(progress, "progress_bar",
                        lambda on, **kw: asked.append(on) or real(False, **kw))
    for on in (True, False):
        generate_and_score(_ScriptedByteLM(answers), ByteTokenizer(), refs, progress=on)
    assert asked == [True, False]


def test_no_room_counts_only_the_scored_prompts_that_fill_the_positions():
    # every prompt here fills the positions: the one without references is generated, not
    # scored, and not counted
    refs = {"name[Aromi]": ["Aromi is a pub."], "name[Cotto]": [], "name[Zizzi]": ["Zizzi."]}
    shortest = min(len(ByteTokenizer().encode_pair(m + " || ", "")[0]) for m in refs)
    model = _ScriptedByteLM({m: "x" for m in refs}, n_positions=shortest)
    res = generate_and_score(model, ByteTokenizer(), refs, return_texts=True)
    assert res["texts"] == ["", "", ""] and res["num_prompts"] == 2
    assert res["no_room"] == 2
