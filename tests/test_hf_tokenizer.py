"""``data.tokenizer: hf``: any transformers tokenizer folder. Tested on tokenizers trained here
on E2E text (nothing can be downloaded): a byte-level BPE (GPT-2, Qwen2), a sentencepiece-style
BPE with Llama 2's legacy pipeline and the same declared as a LlamaTokenizer. Prompt/target
pairs spell the text exactly as the tokenizer's own tokens of it, the prompt as generation
encodes it, BOS first; EOS, padding and the refusals."""

from __future__ import annotations

import pytest
from _causal_lm import E2E_DIR, TOKENIZER_KINDS, save_tokenizer

from dptrain.config import ConfigError, from_dict, validate_tree
from dptrain.data import DataConfig, build_data
from dptrain.data.lm import e2e_prompt
from dptrain.data.tokenizers import build_tokenizer


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    if not (E2E_DIR / "devset.csv").is_file():
        pytest.skip("shared E2E data not present")
    root = tmp_path_factory.mktemp("tokenizers")
    return {kind: save_tokenizer(kind, root / kind) for kind in TOKENIZER_KINDS}


@pytest.mark.parametrize("kind", TOKENIZER_KINDS)
def test_hf_pairs_spell_prompt_plus_target_as_the_whole_text_s_tokens(tokenizers, kind):
    """For 300 E2E rows: the prompt's ids are what generation encodes for the prompt alone
    (BOS first, once, for the sentencepiece-style tokenizers), and prompt + target ids are the
    tokenizer's own tokens of the whole text (so they decode to it exactly)."""
    from dptrain.data.lm import read_e2e_csv

    tok = build_tokenizer("hf", str(tokenizers[kind]))
    mrs, refs = read_e2e_csv(E2E_DIR / "devset.csv", "f")
    prompts, targets = [e2e_prompt(m) for m in mrs[:300]], refs[:300]
    bos = tok.hf.bos_token_id if kind != "byte_level" else None
    assert tok.bos_id == bos and tok.prefix == ([bos] if bos is not None else [])
    for (p, t), prompt, target in zip(tok.encode_pairs(prompts, targets), prompts, targets):
        assert (p, t) == tok.encode_pair(prompt, target)
        assert p == tok.encode_pair(prompt, "")[0]  # generation's prompt
        assert p + t == list(tok.hf.encode(prompt + target))  # the whole text, specials included
        assert tok.decode(p + t) == prompt + target
        if bos is not None:
            assert p[0] == bos and bos not in p[1:] + t
            # a prompt with no trailing space and no target: BOS first all the same
            assert tok.encode_pair(prompt.rstrip(), "")[0][0] == bos
    if kind == "metaspace":
        # what the pairs avoid: the target encoded alone gets the dummy prefix's extra space
        prompt, target = prompts[0], targets[0]
        naive = tok.encode(prompt.rstrip()) + tok.encode(prompt[len(prompt.rstrip()):] + target)
        assert tok.decode(naive) != prompt + target


def test_hf_special_ids_and_refusals(tokenizers, tmp_path):
    from transformers import AutoTokenizer

    byte_level = build_tokenizer("hf", str(tokenizers["byte_level"]))
    assert byte_level.eos_id == byte_level.hf.convert_tokens_to_ids("<|endoftext|>")
    assert byte_level.pad_id == byte_level.eos_id  # no pad token: EOS pads
    assert byte_level.vocab_size == len(byte_level.hf) == 400
    padded = tmp_path / "padded"
    hf = AutoTokenizer.from_pretrained(str(tokenizers["metaspace"]))
    hf.add_special_tokens({"pad_token": "<pad>"})
    hf.save_pretrained(str(padded))
    tok = build_tokenizer("hf", str(padded))
    assert tok.pad_id == hf.convert_tokens_to_ids("<pad>") != tok.eos_id
    assert tok.vocab_size == 401  # len(tokenizer): the added token counts
    no_eos = tmp_path / "no_eos"
    hf = AutoTokenizer.from_pretrained(str(tokenizers["byte_level"]))
    hf.eos_token = None
    hf.save_pretrained(str(no_eos))
    (tmp_path / "empty").mkdir()
    for path, words in ((None, "required"), (tmp_path / "none", "not found"),
                        (tmp_path / "empty", "holds no tokenizer files"), (no_eos, "no EOS")):
        with pytest.raises(ConfigError) as e:
            build_tokenizer("hf", None if path is None else str(path))
        assert e.value.field == "data.tokenizer_path" and words in e.value.message
    with pytest.raises(ConfigError) as e:  # at load, before any data is read
        validate_tree(from_dict(DataConfig, {"tokenizer": "hf"}, "data"), "data")
    assert e.value.field == "data.tokenizer_path"


def test_e2e_with_an_hf_tokenizer_starts_every_example_with_bos_as_generation_does(
        tokenizers, monkeypatch):
    import dptrain.eval.text as text

    task = build_data(DataConfig(name="e2e", tokenizer="hf",
                                 tokenizer_path=str(tokenizers["llama"]), max_train_examples=40,
                                 max_test_examples=30))
    tok = task.tokenizer
    assert task.info.vocab_size == len(tok.hf) and task.info.bos_id == tok.hf.bos_token_id
    for seq, plen in zip(task.train.sequences, task.train.prompt_lengths):
        assert seq[0] == tok.bos_id and seq[-1] == tok.eos_id and 1 < plen < len(seq)
    batch = task.train.collate([0, 1])
    assert int(batch["labels"][0, :task.train.prompt_lengths[0]].max()) == -100
    # generation feeds the model each test prompt as the training examples hold it
    seen = []
    monkeypatch.setattr(text, "greedy_generate",
                        lambda model, prompts, *a, **k: seen.extend(prompts) or [[]] * len(prompts))
    kept = set(task.test.mrs)
    refs = {mr: r for mr, r in task.test.references_by_mr().items() if mr in kept}
    text.generate_and_score(None, tok, refs)
    first = {}
    for mr, seq, plen in zip(task.test.mrs, task.test.sequences, task.test.prompt_lengths):
        first.setdefault(mr, list(seq[:plen]))
    assert seen == [first[mr] for mr in refs] and all(p[0] == tok.bos_id for p in seen)
