"""E2E text metrics: BLEU/ROUGE-L with multiple references, greedy generation."""

from __future__ import annotations

import pytest
import torch

from dptrain.data import DEFAULT_E2E_PATH, REPO_ROOT, DataInfo
from dptrain.data.tokenizers import ByteTokenizer
from dptrain.eval.text import generate_and_score, greedy_generate, score_texts
from dptrain.models import ModelConfig, build_model

E2E_DIR = (REPO_ROOT / DEFAULT_E2E_PATH).resolve()


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: one intra-op thread is much faster on a shared CPU (restored after)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

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


def test_generate_and_score_runs_on_a_tiny_model():
    model = _spiky_gpt2().train()
    res = generate_and_score(model, ByteTokenizer(), SMALL, max_new_tokens=8, batch_size=2,
                             return_texts=True)
    assert model.training
    assert 0.0 <= res["bleu"] <= 100.0 and 0.0 <= res["rouge_l"] <= 100.0
    assert res["num_prompts"] == 3 and len(res["texts"]) == 3
