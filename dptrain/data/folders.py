"""Image classification from plain folders: ``imagefolder`` (torchvision's ImageFolder layout,
e.g. medical images sorted by diagnosis) and ``cifar10`` (the CIFAR-10 "python version").

imagefolder: ``data.path`` holds one folder per split (``data.train_file``, default ``train``;
``data.test_file``, default ``val``), each with one sub-folder per class::

    path/train/<class>/<image>.png     path/val/<class>/<image>.jpg

torchvision's ``ImageFolder`` lists the images (its extensions, class folders in sorted order;
files of other types are left out, with a count on stderr);
the class index is the class folder's rank among the TRAINING split's classes, and a test class
the training split lacks is refused (its label would mean another class). Example i is the
i-th file in ImageFolder's order; ``collate`` decodes exactly the requested files with the
shorter side to ``image_size / 0.875`` and a centre crop (the webdataset transform), so an
example is a fixed function of its index, as Poisson sampling needs. A file listed twice (a
symbolic or hard link to another listed image) is refused: it would be two examples of one
record; so is a test image that is a training one. 16-bit grey images are scaled to 8 bits
(``wds._eight_bit``).

cifar10: ``data.path`` is the extracted ``cifar-10-batches-py`` folder: ``data_batch_1`` ..
``data_batch_5`` (50,000 training images) and ``test_batch`` (10,000), each a pickled dict with
``data`` (uint8, N x 3072, channel-major 32 x 32) and ``labels``. They are read here with
``pickle`` (no code objects: a restricted unpickler refuses anything but builtins and numpy
arrays) rather than torchvision's ``CIFAR10``, whose loader refuses any file whose MD5 differs
from the official archive's: a re-packed or sub-sampled copy, or a test's own files.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import numpy as np
import torch

from dptrain.config import ConfigError
from dptrain.data import even_subset
from dptrain.data.wds import ImageDecoding, file_id, image_stats, unfollowable_link
from dptrain.messages import brief, data_note

CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
CIFAR10_TRAIN = tuple(f"data_batch_{i}" for i in range(1, 6))
CIFAR10_TEST = "test_batch"


class ImageFolderImages(ImageDecoding):
    """Random-access view of one split of an ImageFolder tree; see the module docstring."""

    kind = "classification"

    def __init__(self, samples: list[tuple[str, int]], image_size: int, in_chans: int,
                 max_examples: int | None = None, sizes: list[int] | None = None):
        keep = even_subset(len(samples), max_examples)
        self.paths = [samples[i][0] for i in keep]
        self.labels = torch.tensor([samples[i][1] for i in keep], dtype=torch.int64)
        #: each file's size in bytes, for the ranks' index digest (None: not known)
        self.sizes = None if sizes is None else np.asarray([sizes[i] for i in keep], np.int64)
        self.image_size, self.in_chans = int(image_size), int(in_chans)
        self.mean, self.std = image_stats(self.in_chans)
        self.decode_threads = 1  # (performance.decode_threads, set by the trainer)

    def __len__(self) -> int:
        return len(self.paths)

    def collate(self, indices) -> dict[str, torch.Tensor]:
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        files = [self.paths[i] for i in idx]
        return self._decode(files, lambda row: files[row], idx)


def split_path(root: Path | None, name: str) -> Path | None:
    """The split folder ``name`` (absolute, or in ``root``); None: relative without a root."""
    folder = Path(name).expanduser()
    if folder.is_absolute():
        return folder
    return root / folder if root is not None else None


def _split_folder(root: Path | None, name: str, field: str) -> Path:
    folder = split_path(root, name)
    if folder is None:
        raise ConfigError("data.path", "imagefolder needs data.path (the folder holding "
                                       "the split folders)")
    if not folder.is_dir():
        raise ConfigError(field, f"no directory {folder} (data.path/<split>/<class>/<image>)")
    return folder


def _list(folder: Path, field: str):
    """torchvision's listing of ``folder``; files of a type it does not list (``.gif``, DICOM's
    ``.dcm``, ...) are left out, and said on stderr with their count (they were dropped in
    silence: a folder of 8 files gave 2 examples)."""
    from collections import Counter

    from torchvision.datasets import ImageFolder
    from torchvision.datasets.folder import IMG_EXTENSIONS, has_file_allowed_extension

    skipped: Counter = Counter()

    def listed(path: str) -> bool:
        ok = has_file_allowed_extension(path, IMG_EXTENSIONS)
        if not ok:
            skipped[os.path.splitext(path)[1].lower() or "(no extension)"] += 1
        return ok

    try:
        images = ImageFolder(str(folder), is_valid_file=listed, allow_empty=False)
    except (FileNotFoundError, RuntimeError) as e:  # no class folders, a class without images
        raise ConfigError(field, f"{folder}: {e}") from None
    if skipped:
        kinds = ", ".join(f"{n} {ext}" for ext, n in
                          sorted(skipped.items(), key=lambda kv: (-kv[1], kv[0]))[:5])
        text = (f"{folder}: {sum(skipped.values())} file(s) of a type torchvision does not list "
                f"are left out ({kinds}); convert them (e.g. DICOM to PNG) to use them")
        data_note(text, training=field == "data.train_file")
    return images


def load_imagefolder(root: Path | None, train_name: str, test_name: str, image_size: int,
                     in_chans: int, max_train: int | None, max_test: int | None):
    """(train, test, class names) of an ImageFolder tree; see the module docstring."""
    train_dir = _split_folder(root, train_name, "data.train_file")
    test_dir = _split_folder(root, test_name, "data.test_file")
    if file_id(train_dir) == file_id(test_dir):
        raise ConfigError("data.test_file", f"{test_dir} is the training folder: the test "
                                            f"split would hold training examples")
    train, test = _list(train_dir, "data.train_file"), _list(test_dir, "data.test_file")
    unknown = sorted(set(test.classes) - set(train.classes))
    if unknown:
        raise ConfigError("data.test_file", f"{test_dir} has classes the training split "
                                            f"{train_dir} lacks: {', '.join(unknown[:5])}")
    # one example per file: a link (symbolic or hard) to an image already listed would count
    # it twice in N and let it be drawn twice in a step (sensitivity 2C), as for shards
    # (expand_shards); and no test image may be a training one
    owner: dict[tuple[int, int], str] = {}
    sizes: list[int] = []  # (one stat per file for both)
    for path, _ in train.samples:
        st = _stat(path, "data.train_file")
        sizes.append(st.st_size)
        first = owner.setdefault((st.st_dev, st.st_ino), path)
        if first != path:
            raise ConfigError("data.train_file", f"{path} and {first} are the same file (a "
                                                 f"link): one example would be counted twice; "
                                                 f"remove one")
    for path, _ in test.samples:
        st = _stat(path, "data.test_file")
        first = owner.get((st.st_dev, st.st_ino))
        if first is not None:
            raise ConfigError("data.test_file", f"{path} is the training image {first} (a "
                                                f"link): the test split would hold training "
                                                f"examples")
    test_samples = [(p, train.class_to_idx[test.classes[y]]) for p, y in test.samples]
    return (ImageFolderImages(train.samples, image_size, in_chans, max_train, sizes),
            ImageFolderImages(test_samples, image_size, in_chans, max_test), train.classes)


def _stat(path: str, field: str) -> os.stat_result:
    """``os.stat(path)`` of a listed image; one that cannot be read (a link to a missing file,
    on a file system this node has not mounted; a loop of links) is an error naming ``field``
    (a traceback before)."""
    try:
        return os.stat(path)
    except OSError as e:
        what = unfollowable_link(path) or brief(e)
        raise ConfigError(field, f"{path} cannot be read: {what}") from None


class _ArraysOnly(pickle.Unpickler):
    """Unpickles dicts, lists, strings, numbers and numpy arrays; any other global (code an
    untrusted file could run) is refused. ``_codecs.encode`` is how protocol 2 spells bytes."""

    def find_class(self, module: str, name: str):
        if ((module.split(".")[0] == "numpy" and name in ("ndarray", "dtype", "_reconstruct",
                                                          "scalar", "_frombuffer"))
                or (module, name) == ("_codecs", "encode")):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a CIFAR-10 batch")


def _cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    if not path.is_file():
        raise ConfigError("data.path", f"file not found: {path} (data.path: the extracted "
                                       f"cifar-10-batches-py folder)")
    try:
        with open(path, "rb") as fh:
            batch = _ArraysOnly(fh, encoding="bytes").load()
        # (a copy re-pickled by Python 3 may have str keys)
        raw_data = np.asarray(batch[b"data"] if b"data" in batch else batch["data"])
        raw_labels = np.asarray(batch[b"labels"] if b"labels" in batch else batch["labels"])
    except (pickle.UnpicklingError, EOFError, KeyError, TypeError, ValueError) as e:
        raise ConfigError("data.path", f"{path} is not a CIFAR-10 batch: "
                                       f"{type(e).__name__}: {e}") from None
    # a cast would wrap or truncate without a word: float [0, 1] pixels became black images,
    # 300 became 44, a label 1.9 became 1
    if not np.issubdtype(raw_data.dtype, np.integer) or (
            raw_data.size and (raw_data.min() < 0 or raw_data.max() > 255)):
        raise ConfigError("data.path", f"{path}: the pixels must be integers in 0..255 (uint8), "
                                       f"got {raw_data.dtype}")
    if raw_labels.ndim != 1 or (raw_labels.size and not np.issubdtype(raw_labels.dtype,
                                                                      np.integer)):
        raise ConfigError("data.path", f"{path}: the labels must be a list of integers, got "
                                       f"{raw_labels.dtype} of shape {raw_labels.shape}")
    data, labels = raw_data.astype(np.uint8), raw_labels.astype(np.int64)
    if data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or len(labels) != len(data):
        raise ConfigError("data.path", f"{path} is not a CIFAR-10 batch: data {data.shape}, "
                                       f"{len(labels)} labels (want N x 3072 and N labels)")
    if len(labels) and (labels.min() < 0 or labels.max() > 9):
        raise ConfigError("data.path", f"{path} has labels outside 0..9")
    return data.reshape(-1, 3, 32, 32), labels


def load_cifar10(root: Path | None):
    """((train images, labels), (test images, labels)): uint8 ``[N, 3, 32, 32]``."""
    if root is None:
        raise ConfigError("data.path", "cifar10 needs data.path (the extracted "
                                       "cifar-10-batches-py folder)")
    # six distinct files: a link (or a copy) of one batch file as another holds its examples
    # twice, each counted in N and drawn on its own (sensitivity 2C), or as test examples
    import hashlib

    seen: dict[object, str] = {}
    for name in (*CIFAR10_TRAIN, CIFAR10_TEST):
        path = root / name
        if not path.is_file():
            continue  # (_cifar_batch says which is missing)
        for key in (file_id(path), hashlib.sha256(path.read_bytes()).hexdigest()):
            if key in seen:
                raise ConfigError("data.test_file" if name == CIFAR10_TEST else "data.path",
                                  f"{path} and {root / seen[key]} are the same batch (a link "
                                  f"or a copy): its examples would be in the data twice")
            seen[key] = name
    parts = [_cifar_batch(root / name) for name in CIFAR10_TRAIN]
    train = (np.concatenate([x for x, _ in parts]), np.concatenate([y for _, y in parts]))
    return train, _cifar_batch(root / CIFAR10_TEST)
