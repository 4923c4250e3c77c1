"""What a model needs to know about its data (shapes, vocabulary), and nothing private."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass
class DataInfo:
    kind: Literal["lm", "classification"]
    """``lm``: batches of token ids for a causal language model; ``classification``: images."""
    vocab_size: int | None = None
    """LM: number of token ids (ids are 0..vocab_size-1, pad and EOS included)."""
    vocab_from: str | None = None
    """LM: the setting that chose the vocabulary, as messages name it (``data.tokenizer: hf``,
    ``data.synthetic_vocab_size``)."""
    tokenizer_path: str | None = None
    """LM: ``data.tokenizer_path`` as set (the folder of the data's tokenizer), for messages."""
    pad_id: int | None = None
    """LM: id used for right padding (masked out of attention and labels)."""
    eos_id: int | None = None
    """LM: end-of-sequence id appended to every target."""
    bos_id: int | None = None
    """LM: the beginning-of-sequence id every example (and generation prompt) starts with,
    for a tokenizer that adds one (Llama's); None: none."""
    max_length: int | None = None
    """LM: longest sequence (prompt + target + EOS) in train or test, after truncation."""
    num_classes: int | None = None
    """Classification: number of classes (labels are 0..num_classes-1)."""
    in_chans: int | None = None
    """Classification: image channels."""
    image_size: int | None = None
    """Classification: images are ``[in_chans, image_size, image_size]``."""
