"""Test material for ``model.name: causal_lm`` and ``data.tokenizer: hf``, built here (no
tokenizer or checkpoint can be downloaded): small tokenizers trained on E2E text with the
``tokenizers`` library and saved as transformers folders, tiny Llama / Qwen2 configs, and a tiny
pretrained checkpoint folder (model + tokenizer) as a user would point ``model.pretrained_path``
and ``data.tokenizer_path`` at."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from dptrain.data import DEFAULT_E2E_PATH, REPO_ROOT

E2E_DIR = (REPO_ROOT / DEFAULT_E2E_PATH).resolve()
ROOT = Path(__file__).resolve().parents[1]
TINY_LLAMA = str(ROOT / "configs" / "tiny_llama.yaml")

#: tiny hf_config of each family: hidden 32, 2 layers, 4 query heads over 2 key/value heads
FAMILIES = {
    family: {"model_type": family, "hidden_size": 32, "intermediate_size": 64,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "max_position_embeddings": 64}
    for family in ("llama", "qwen2", "mistral")
}

#: the tokenizer kinds: a byte-level BPE (GPT-2, Qwen2); a sentencepiece-style BPE with Llama 2's
#: legacy pipeline (normalizer: a dummy-prefix "▁" and spaces as "▁", BOS added by default),
#: loaded as it is saved; the same files declared as a LlamaTokenizer (what a Llama 2 folder
#: loads as: transformers 5 rebuilds it with a Metaspace pre-tokenizer, prepend_scheme first)
TOKENIZER_KINDS = ("byte_level", "metaspace", "llama")


def e2e_texts(n: int = 1500) -> list[str]:
    """``mr || ref`` of the first ``n`` rows of E2E's devset.csv."""
    with open(E2E_DIR / "devset.csv", newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))[:n]
    return [r["mr"] + " || " + r["ref"] for r in rows]


def save_tokenizer(kind: str, folder: Path, vocab_size: int = 400) -> Path:
    """Train a ``kind`` tokenizer (TOKENIZER_KINDS) on E2E text and save it as a transformers
    folder (``PreTrainedTokenizerFast(tokenizer_object=...).save_pretrained``)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from tokenizers import trainers
    from transformers import PreTrainedTokenizerFast

    texts = e2e_texts()
    if kind == "byte_level":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.train_from_iterator(texts, trainers.BpeTrainer(
            vocab_size=vocab_size, special_tokens=["<|endoftext|>"], show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    else:
        tok = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=True))
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                               normalizers.Replace(" ", "▁")])
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never",
                                                     split=True)
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(" ", 1, 0)])
        tok.train_from_iterator(texts, trainers.BpeTrainer(
            vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False))
        bos = tok.token_to_id("<s>")
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)])
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                       unk_token="<unk>")
    fast.save_pretrained(str(folder))
    if kind == "llama":
        path = folder / "tokenizer_config.json"
        config = json.loads(path.read_text())
        config["tokenizer_class"] = "LlamaTokenizer"
        path.write_text(json.dumps(config))
    return folder


def save_pretrained_llama(folder: Path, tokenizer_kind: str = "llama", tie: bool = False,
                          seed: int = 0, **hf) -> Path:
    """A tiny Llama checkpoint folder with its tokenizer (config.json, model.safetensors,
    tokenizer files), as ``save_pretrained`` writes them: what a user downloads."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    save_tokenizer(tokenizer_kind, folder)
    tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    config = AutoConfig.for_model(**{**FAMILIES["llama"], "max_position_embeddings": 256, **hf},
                                  vocab_size=len(tok), tie_word_embeddings=tie,
                                  bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(folder))
    return folder
