"""A 62-bit digest of a training set's index, for the ranks to compare at start-up.

Every rank draws the same Poisson sample of indices and takes its share by position, so index
i must be the same example on every rank. Node-local copies of the data that differ (another
extraction order, another version) with the same N would put one person's example at index i
on one rank and at index j on another: it could be in two ranks' shares (sensitivity 2C) while
others are dropped. The trainer refuses to start when the digests differ.

What is hashed is what fixes the examples' identity and order, cheaply: the tensors of
in-memory sets (images, labels, token ids, prompt lengths); an image folder's file paths below
their common folder, labels and the training files' sizes (not their bytes: 1.28M reads; the
loader stats every file anyway); webdataset shards' names
and their index (each member's offset and size, and the label). A dataset of another kind
gives None and only its length is compared.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import numpy as np

__all__ = ["index_fingerprint"]


def _update(h, array) -> None:
    a = np.ascontiguousarray(np.asarray(array))
    h.update(f"{a.dtype.str}{a.shape}".encode())
    h.update(memoryview(a).cast("B"))


def index_fingerprint(dataset: Any) -> int | None:
    """blake2b-64 of the dataset's index, as a non-negative int below 2**62; None for a kind
    it does not know."""
    from dptrain.data.folders import ImageFolderImages
    from dptrain.data.images import ImageDataset
    from dptrain.data.lm import LMDataset
    from dptrain.data.wds import WebDatasetImages

    h = hashlib.blake2b(digest_size=8, person=b"dptrain-index")
    h.update(type(dataset).__name__.encode())
    if isinstance(dataset, ImageDataset):
        _update(h, dataset.images.numpy())
        _update(h, dataset.labels.numpy())
    elif isinstance(dataset, LMDataset):
        _update(h, dataset.prompt_lengths)
        _update(h, dataset.lengths)
        _update(h, np.concatenate(dataset.sequences) if dataset.sequences
                else np.zeros(0, np.int64))
        refs = getattr(dataset, "references_by_mr", None)
        if refs is not None:  # E2E/DART: the generation prompts and every reference too
            h.update(repr(list(refs().items())).encode("utf-8", "surrogateescape"))
    elif isinstance(dataset, ImageFolderImages):
        # each path below the files' common folder (class/file, or class/sub/file: torchvision
        # lists nested folders too): the roots of node-local copies may differ. String
        # operations: 1.28M Path objects take seconds. The common prefix of all the paths is
        # that of the first and the last in sorted order.
        paths = [str(p).replace(os.sep, "/") for p in dataset.paths]
        if paths:
            lo, hi = min(paths), max(paths)
            common = next((i for i, (a, b) in enumerate(zip(lo, hi)) if a != b), len(lo))
            # (the last "/" before the first difference: one at it would cut class "a" off
            # "a/x" when the other path is "ab/y")
            cut = lo.rfind("/", 0, common) + 1
            for p in paths:
                h.update(f"{p[cut:]}\0".encode("utf-8", "surrogateescape"))
        _update(h, dataset.labels.numpy())
        if dataset.sizes is not None:  # another version of a file (same name) differs here
            _update(h, dataset.sizes)
    elif isinstance(dataset, WebDatasetImages):
        for s in dataset.shards:
            h.update(f"{s.name}\0".encode("utf-8", "surrogateescape"))
        for key in ("shard", "offset", "size", "label"):
            _update(h, dataset.index[key])
    else:
        return None
    return int.from_bytes(h.digest(), "little") >> 2
