"""Image folders (torchvision's ImageFolder layout) and the CIFAR-10 python batches
(dptrain/data/folders.py): what each example is, against torchvision's listing and the
webdataset transform, and one clear error naming the field for every bad tree or file."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dptrain.config import ConfigError
from dptrain.data import DataConfig, build_data
from dptrain.data.wds import center_crop_transform, image_stats

PIL = pytest.importorskip("PIL")


def _tree(root: Path, split: str, classes: dict[str, int], rng, ext: str = "png") -> list:
    """``root/split/<class>/<k>.<ext>`` random RGB images of random sizes; returns the paths."""
    from PIL import Image

    paths = []
    for name, n in classes.items():
        (root / split / name).mkdir(parents=True)
        for k in range(n):
            h, w = int(rng.integers(12, 40)), int(rng.integers(12, 40))
            arr = rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)
            path = root / split / name / f"{k:03d}.{ext}"
            Image.fromarray(arr).save(path)
            paths.append(path)
    return paths


def _want(path: Path, size: int, chans: int) -> torch.Tensor:
    from PIL import Image

    with Image.open(path) as img:
        x = torch.tensor(center_crop_transform(img, size, chans)).float().div(255)[None]
    mean, std = image_stats(chans)
    return ((x - mean) / std)[0]


def test_imagefolder_examples_are_torchvisions_files_labelled_by_the_training_classes(tmp_path):
    """Classes in sorted order of the training folder; a test split with fewer classes keeps
    the training split's indices (malignant is 1 in both), not its own ranks (0)."""
    from torchvision.datasets import ImageFolder

    rng = np.random.default_rng(0)
    _tree(tmp_path, "train", {"normal": 3, "benign": 2, "malignant": 4}, rng)
    _tree(tmp_path, "val", {"malignant": 2, "normal": 1}, rng, ext="jpg")
    task = build_data(DataConfig(name="imagefolder", path=str(tmp_path), image_size=16))
    assert task.info.num_classes == 3 and task.info.in_chans == 3
    listing = ImageFolder(str(tmp_path / "train"))
    assert listing.classes == ["benign", "malignant", "normal"]
    assert task.train.labels.tolist() == [y for _, y in listing.samples] == [0] * 2 + [1] * 4 + [2] * 3
    assert task.test.labels.tolist() == [1, 1, 2]
    idx = np.array([8, 0, 5, 5])
    batch = task.train.collate(idx)
    assert batch["images"].shape == (4, 3, 16, 16) and batch["labels"].tolist() == [2, 0, 1, 1]
    for row, i in enumerate(idx):
        torch.testing.assert_close(batch["images"][row],
                                   _want(Path(listing.samples[i][0]), 16, 3), rtol=0, atol=0)
    empty = task.train.collate(np.array([], dtype=np.int64))
    assert empty["images"].shape == (0, 3, 16, 16) and empty["labels"].shape == (0,)
    grey = build_data(DataConfig(name="imagefolder", path=str(tmp_path), image_size=8,
                                 in_chans=1, max_train_examples=3))
    assert len(grey.train) == 3 and grey.train.labels.tolist() == [0, 1, 2]  # even subset
    torch.testing.assert_close(grey.test.collate([2])["images"][0],
                               _want(tmp_path / "val" / "normal" / "000.jpg", 8, 1))


def test_imagefolder_files_it_does_not_list_are_counted_on_stderr(tmp_path, capsys):
    # torchvision's listing drops .gif, DICOM's .dcm and the like: they were left out in silence
    from torchvision.datasets import ImageFolder

    rng = np.random.default_rng(1)
    _tree(tmp_path, "train", {"a": 2, "b": 1}, rng)
    _tree(tmp_path, "val", {"a": 1}, rng)
    for name in ("a/x.dcm", "a/y.dcm", "b/z.gif", "b/notes"):
        (tmp_path / "train" / name).write_bytes(b"not listed")
    task = build_data(DataConfig(name="imagefolder", path=str(tmp_path), image_size=8))
    assert len(task.train) == 3 == len(ImageFolder(str(tmp_path / "train")).samples)
    err = capsys.readouterr().err
    assert err.count("dptrain: note:") == 1  # the val split lost nothing
    assert ("4 file(s) of a type torchvision does not list are left out (2 .dcm, "
            "1 (no extension), 1 .gif)") in err
    from dptrain.messages import secure_notes

    with secure_notes():  # a count of the private (training) files: not in secure mode
        build_data(DataConfig(name="imagefolder", path=str(tmp_path), image_size=8))
    assert "dptrain: note:" not in capsys.readouterr().err


def test_imagefolder_trees_that_cannot_be_trained_on_are_refused_naming_the_field(tmp_path):
    rng = np.random.default_rng(1)
    _tree(tmp_path, "train", {"a": 2, "b": 2}, rng)
    _tree(tmp_path, "val", {"a": 1, "c": 1}, rng)
    (tmp_path / "train_empty" / "a").mkdir(parents=True)
    cases = [
        ({}, "data.test_file", "classes the training split"),  # val has class c
        ({"test_file": "train"}, "data.test_file", "is the training folder"),
        ({"train_file": "nope"}, "data.train_file", "no directory"),
        ({"train_file": "train_empty"}, "data.train_file", "train_empty"),
        ({"path": None}, "data.path", "needs data.path"),
    ]
    for kw, field, words in cases:
        cfg = {"name": "imagefolder", "path": str(tmp_path), "image_size": 8, **kw}
        with pytest.raises(ConfigError) as e:
            build_data(DataConfig(**cfg))
        assert e.value.field == field and words in e.value.message, (kw, e.value)
    (tmp_path / "val" / "c" / "000.png").rename(tmp_path / "val" / "a" / "009.png")
    os.rmdir(tmp_path / "val" / "c")
    (tmp_path / "train" / "b" / "001.png").write_bytes(b"not an image")
    task = build_data(DataConfig(name="imagefolder", path=str(tmp_path), image_size=8))
    assert task.test.labels.tolist() == [0, 0]
    task.train.collate([0, 2])  # the readable files decode
    with pytest.raises(ConfigError) as e:  # at the step that draws it, naming the file
        task.train.collate([3])
    assert e.value.field == "data.path" and "b/001.png" in e.value.message


@pytest.mark.parametrize("link", ["symlink", "hardlink"])
def test_a_linked_image_is_refused_twice_in_training_or_as_a_test_image(tmp_path, link):
    # torchvision lists a link as another file: a training image linked under a second name
    # was two examples (N inflated, sensitivity 2C when both are drawn), and a test image
    # linking to a training one was scored as held out
    rng = np.random.default_rng(2)
    _tree(tmp_path, "train", {"a": 2, "b": 2}, rng)
    _tree(tmp_path, "val", {"a": 1, "b": 1}, rng)
    make = os.symlink if link == "symlink" else os.link
    cfg = {"name": "imagefolder", "path": str(tmp_path), "image_size": 8}
    assert len(build_data(DataConfig(**cfg)).train) == 4
    make(tmp_path / "train" / "a" / "000.png", tmp_path / "val" / "b" / "leak.png")
    with pytest.raises(ConfigError) as e:
        build_data(DataConfig(**cfg))
    assert e.value.field == "data.test_file" and "leak.png" in e.value.message
    assert "training image" in e.value.message and "a/000.png" in e.value.message
    (tmp_path / "val" / "b" / "leak.png").unlink()
    make(tmp_path / "train" / "a" / "000.png", tmp_path / "train" / "b" / "copy.png")
    with pytest.raises(ConfigError) as e:
        build_data(DataConfig(**cfg))
    assert e.value.field == "data.train_file" and "same file" in e.value.message
    assert "copy.png" in e.value.message and "a/000.png" in e.value.message


@pytest.mark.parametrize("split, field", [("train", "data.train_file"),
                                          ("val", "data.test_file")])
def test_an_image_linked_to_a_missing_file_is_one_error_naming_the_split(tmp_path, split, field):
    # (an image on a file system this node has not mounted: a FileNotFoundError traceback)
    rng = np.random.default_rng(3)
    _tree(tmp_path, "train", {"a": 2, "b": 2}, rng)
    _tree(tmp_path, "val", {"a": 1, "b": 1}, rng)
    (tmp_path / split / "b" / "gone.png").symlink_to(tmp_path / "scratch" / "gone.png")
    with pytest.raises(ConfigError) as e:
        build_data(DataConfig(name="imagefolder", path=str(tmp_path), image_size=8))
    assert e.value.field == field, e.value
    assert e.value.message == (f"{tmp_path / split / 'b' / 'gone.png'} cannot be read: a link to "
                               f"a missing file ({tmp_path / 'scratch' / 'gone.png'})")


@pytest.mark.parametrize("mode", ["I;16", "I"])
def test_sixteen_bit_grey_images_are_scaled_to_eight_bits_not_clipped(tmp_path, mode):
    # convert("L") clips 16-bit values at 255: a mid-grey scan came out white
    from PIL import Image

    a = (np.arange(32 * 32).reshape(32, 32) * 64).astype(np.uint16)  # 0 .. 65472
    img = Image.fromarray(a) if mode == "I;16" else Image.fromarray(a.astype(np.int32))
    assert img.mode == mode
    # the same as the 8-bit image with 0..65535 mapped onto 0..255
    eight = Image.fromarray(((a.astype(np.int64) * 255 + 32767) // 65535).astype(np.uint8))
    for chans in (1, 3):
        got = center_crop_transform(img, 16, chans)
        assert np.array_equal(got, center_crop_transform(eight, 16, chans))
        assert 100 < got.mean() < 155  # mid-grey on average, not clipped to 255
    with pytest.raises(ValueError, match="float"):
        center_crop_transform(Image.fromarray(a.astype(np.float32)), 8, 1)


def _cifar(root: Path, per_batch: int, rng, *, labels=None) -> dict:
    """The CIFAR-10 python layout: five training batches and a test batch, each a pickled
    dict of bytes keys with ``data`` uint8 N x 3072 and ``labels``."""
    root.mkdir(parents=True, exist_ok=True)
    batches = {}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        data = rng.integers(0, 256, size=(per_batch, 3072), dtype=np.uint8)
        ys = labels if labels is not None else [int(v) for v in rng.integers(0, 10, per_batch)]
        batch = {b"batch_label": name.encode(), b"labels": ys, b"data": data,
                 b"filenames": [f"{name}_{k}.png".encode() for k in range(per_batch)]}
        with open(root / name, "wb") as fh:
            pickle.dump(batch, fh, protocol=2)
        batches[name] = batch
    return batches


def test_cifar10_batches_are_read_channel_major_and_resized_on_request(tmp_path):
    from dptrain.data.folders import CIFAR10_MEAN, CIFAR10_STD

    batches = _cifar(tmp_path / "cifar-10-batches-py", 4, np.random.default_rng(2))
    task = build_data(DataConfig(name="cifar10", path=str(tmp_path / "cifar-10-batches-py")))
    assert len(task.train) == 20 and len(task.test) == 4 and task.info.image_size == 32
    order = [f"data_batch_{i}" for i in range(1, 6)]
    want_labels = sum((batches[n][b"labels"] for n in order), [])
    assert task.train.labels.tolist() == want_labels
    raw = batches["data_batch_3"][b"data"][1]  # example 9
    pixel = raw.reshape(3, 32, 32)[:, 5, 7].astype(np.float64) / 255  # channel-major
    got = task.train.collate([9])["images"][0, :, 5, 7].double()
    want = (torch.tensor(pixel) - torch.tensor(CIFAR10_MEAN)) / torch.tensor(CIFAR10_STD)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    big = build_data(DataConfig(name="cifar10", path=str(tmp_path / "cifar-10-batches-py"),
                                image_size=64, max_test_examples=2))
    x = big.test.collate([1])["images"]
    ref = F.interpolate(torch.from_numpy(batches["test_batch"][b"data"][3].reshape(1, 3, 32, 32))
                        .float().div(255), size=(64, 64), mode="bilinear", antialias=True,
                        align_corners=False)
    ref = (ref - torch.tensor(CIFAR10_MEAN).view(1, 3, 1, 1)) / torch.tensor(CIFAR10_STD).view(
        1, 3, 1, 1)
    assert x.shape == (1, 3, 64, 64) and len(big.test) == 2  # rows 0 and 3: spread evenly
    torch.testing.assert_close(x, ref)


@pytest.mark.parametrize("how, name, field", [
    ("link", "data_batch_4", "data.path"), ("copy", "data_batch_2", "data.path"),
    ("link", "test_batch", "data.test_file"), ("copy", "test_batch", "data.test_file")])
def test_cifar10_a_batch_file_that_is_another_is_refused(tmp_path, how, name, field):
    # linked batch files gave 50 rows of which 10 distinct (each drawn on its own: sensitivity
    # 5C) and a test split of training rows
    import shutil

    root = tmp_path / "c"
    _cifar(root, 2, np.random.default_rng(4))
    (root / name).unlink()
    if how == "link":
        (root / name).symlink_to(root / "data_batch_1")
    else:
        shutil.copyfile(root / "data_batch_1", root / name)
    with pytest.raises(ConfigError) as e:
        build_data(DataConfig(name="cifar10", path=str(root)))
    assert e.value.field == field and "the same batch" in e.value.message


@pytest.mark.parametrize("data, labels, words", [
    (np.random.default_rng(0).random((2, 3072)).astype(np.float32), [0, 1],
     "pixels must be integers in 0..255"),  # [0, 1] floats were cast to black images
    (np.full((2, 3072), 300, np.int64), [0, 1], "pixels must be integers in 0..255"),  # 44
    (np.full((2, 3072), 256, np.int64), [0, 1], "pixels must be integers in 0..255"),  # 0
    (np.full((2, 3072), -1, np.int16), [0, 1], "pixels must be integers in 0..255"),  # 255
    (np.zeros((2, 3072), np.uint8), [1.9, 2.5], "labels must be a list of integers"),  # 1, 2
    (np.zeros((2, 3072), np.uint8), [[1], [2]], "labels must be a list of integers"),
])
def test_cifar10_batches_that_a_cast_would_change_are_refused(tmp_path, data, labels, words):
    root = tmp_path / "c"
    _cifar(root, 2, np.random.default_rng(3))
    with open(root / "data_batch_1", "wb") as fh:
        pickle.dump({b"data": data, b"labels": labels}, fh, protocol=2)
    with pytest.raises(ConfigError, match=words) as e:
        build_data(DataConfig(name="cifar10", path=str(root)))
    assert e.value.field == "data.path"


def test_cifar10_batches_re_pickled_with_str_keys_are_read(tmp_path):
    root = tmp_path / "c"
    batches = _cifar(root, 2, np.random.default_rng(3))
    with open(root / "data_batch_1", "wb") as fh:  # (a copy written by Python 3)
        pickle.dump({"data": batches["data_batch_1"][b"data"],
                     "labels": batches["data_batch_1"][b"labels"]}, fh)
    task = build_data(DataConfig(name="cifar10", path=str(root)))
    assert task.train.labels[:2].tolist() == batches["data_batch_1"][b"labels"]


class _Payload:
    def __reduce__(self):
        return (os.system, ("touch /tmp/dptrain-cifar-pwned",))


def test_cifar10_files_that_are_not_cifar_batches_are_refused_without_running_them(tmp_path):
    root = tmp_path / "c"
    _cifar(root, 2, np.random.default_rng(3))
    marker = Path("/tmp/dptrain-cifar-pwned")
    marker.unlink(missing_ok=True)
    with open(root / "data_batch_2", "wb") as fh:
        pickle.dump({b"data": _Payload(), b"labels": [0]}, fh)
    with pytest.raises(ConfigError) as e:
        build_data(DataConfig(name="cifar10", path=str(root)))
    assert e.value.field == "data.path" and "system is not allowed" in e.value.message
    assert not marker.exists()
    bad = {
        "labels outside 0..9": dict(labels=[3, 10]),
        "want N x 3072": None,
    }
    _cifar(root, 2, np.random.default_rng(3), **bad["labels outside 0..9"])
    with pytest.raises(ConfigError, match="labels outside 0..9"):
        build_data(DataConfig(name="cifar10", path=str(root)))
    _cifar(root, 2, np.random.default_rng(3))
    with open(root / "test_batch", "wb") as fh:
        pickle.dump({b"data": np.zeros((2, 100), np.uint8), b"labels": [0, 1]}, fh)
    with pytest.raises(ConfigError, match="want N x 3072"):
        build_data(DataConfig(name="cifar10", path=str(root)))
    (root / "data_batch_5").unlink()
    with pytest.raises(ConfigError) as e:
        build_data(DataConfig(name="cifar10", path=str(root)))
    assert e.value.field == "data.path" and "data_batch_5" in e.value.message
    with pytest.raises(ConfigError) as e:
        DataConfig(name="cifar10", path=str(root), in_chans=1).validate()
    assert e.value.field == "in_chans"


def test_a_run_on_an_image_folder_trains_and_scores_its_test_split(tmp_path):
    from dptrain.config import load
    from dptrain.trainer import RunConfig, Trainer

    rng = np.random.default_rng(4)
    _tree(tmp_path / "data", "train", {"x": 6, "y": 6}, rng)
    _tree(tmp_path / "data", "val", {"y": 3}, rng)
    root = Path(__file__).resolve().parents[1]
    cfg = load(RunConfig, root / "configs" / "tiny_images.yaml", [
        "data.name=imagefolder", f"data.path={tmp_path / 'data'}", "data.image_size=16",
        "privacy.sample_rate=0.5", "privacy.steps=1"])
    trainer = Trainer(cfg, tmp_path / "run")
    assert trainer.task.info.num_classes == 2
    trainer.private_step()
    scores = trainer.task.evaluate(trainer.model)
    assert scores["examples"] == 3


def test_decoding_on_threads_gives_the_same_images_in_the_same_order(tmp_path):
    """performance.decode_threads is a performance setting: any number of threads decodes
    the same tensor (each file into its own row), and a bad file is named as with one."""
    rng = np.random.default_rng(5)
    _tree(tmp_path, "train", {"a": 5, "b": 6}, rng, ext="jpg")
    _tree(tmp_path, "val", {"a": 2}, rng)
    ds = build_data(DataConfig(name="imagefolder", path=str(tmp_path), image_size=12)).train
    idx = np.array([10, 3, 3, 0, 7, 1, 9])
    ds.decode_threads = 1
    one = ds.collate(idx)
    for threads in (2, 5):
        ds.decode_threads = threads
        many = ds.collate(idx)
        assert torch.equal(many["images"], one["images"])
        assert torch.equal(many["labels"], one["labels"])
    (tmp_path / "train" / "b" / "002.jpg").write_bytes(b"broken")
    (tmp_path / "train" / "b" / "004.jpg").write_bytes(b"broken too")
    with pytest.raises(ConfigError) as e:  # rows 1 and 2 of the request are bad: row 1 named
        ds.collate([0, 9, 7])
    assert "b/004.jpg" in e.value.message


def test_the_trainer_gives_image_file_datasets_their_decode_threads(tmp_path):
    from dptrain.config import load
    from dptrain.data.wds import default_decode_threads
    from dptrain.trainer import RunConfig, Trainer

    rng = np.random.default_rng(6)
    _tree(tmp_path / "data", "train", {"x": 2, "y": 2}, rng)
    _tree(tmp_path / "data", "val", {"y": 1}, rng)
    root = Path(__file__).resolve().parents[1]
    base = ["data.name=imagefolder", f"data.path={tmp_path / 'data'}", "data.image_size=8"]
    for extra, want in (([], default_decode_threads()), (["performance.decode_threads=3"], 3)):
        cfg = load(RunConfig, root / "configs" / "tiny_images.yaml", [*base, *extra])
        trainer = Trainer(cfg, None)
        assert trainer.task.train.decode_threads == trainer.task.test.decode_threads == want
    with pytest.raises(ConfigError) as e:
        load(RunConfig, root / "configs" / "tiny_images.yaml", [*base,
                                                                "performance.decode_threads=0"])
    assert e.value.field == "performance.decode_threads"


def test_prefetching_the_next_microbatch_leaves_the_run_unchanged(tmp_path, monkeypatch):
    """performance.collate_prefetch=background assembles microbatch i + 1 on a thread while
    i runs: every microbatch is still collated once, from the same indices in the same order,
    and two steps give the same parameters as inline."""
    from dptrain.config import load
    from dptrain.trainer import RunConfig, Trainer

    rng = np.random.default_rng(7)
    _tree(tmp_path / "data", "train", {"x": 10, "y": 10}, rng)
    _tree(tmp_path / "data", "val", {"y": 1}, rng)
    root = Path(__file__).resolve().parents[1]
    base = ["data.name=imagefolder", f"data.path={tmp_path / 'data'}", "data.image_size=8",
            "privacy.sample_rate=0.5", "performance.microbatch_size=3"]
    runs = {}
    for where in ("inline", "background"):
        cfg = load(RunConfig, root / "configs" / "tiny_images.yaml",
                   [*base, f"performance.collate_prefetch={where}"])
        trainer = Trainer(cfg, None)
        assert trainer.collate_prefetch == (where == "background")
        seen = []
        original = trainer.task.train.collate

        def recording(indices, original=original, seen=seen):
            seen.append(np.asarray(indices).tolist())
            return original(indices)

        monkeypatch.setattr(trainer.task.train, "collate", recording)
        for _ in range(2):
            trainer.private_step()
        want = [c.tolist() for s in range(2)
                for c in trainer.microbatches(trainer.local_sample(s))]
        assert seen == want and len(want) > 2
        runs[where] = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    for name, value in runs["inline"].items():
        assert torch.equal(runs["background"][name], value), name


def _folder_trainer(tmp_path, *extra):
    from dptrain.config import load
    from dptrain.trainer import RunConfig, Trainer

    root = Path(__file__).resolve().parents[1]
    cfg = load(RunConfig, root / "configs" / "tiny_images.yaml", [
        "data.name=imagefolder", f"data.path={tmp_path / 'data'}", "data.image_size=8",
        "privacy.sample_rate=0.5", "performance.microbatch_size=3", "performance.dtype=float64",
        *extra])
    return Trainer(cfg, None)


@pytest.mark.parametrize("secure", [False, True])
def test_a_damaged_training_image_adds_nothing_and_does_not_say_when_it_was_sampled(
        tmp_path, monkeypatch, capsys, secure):
    # An error at the step that samples a damaged file would tell when that example was
    # sampled. It is an example with clip factor 0 instead: the release equals the one of the
    # same step with the file's example left out of the sample (same noise: same seed, step).
    rng = np.random.default_rng(8)
    _tree(tmp_path / "data", "train", {"x": 8, "y": 8}, rng)
    _tree(tmp_path / "data", "val", {"y": 1}, rng)
    (tmp_path / "data" / "train" / "y" / "005.png").write_bytes(b"not an image")  # index 13
    extra = ["privacy.secure_mode=true", "privacy.seed=null"] if secure else []
    trainer = _folder_trainer(tmp_path, *extra)
    capsys.readouterr()
    sample = np.array([1, 4, 9, 13, 15])

    def release_of(indices):
        monkeypatch.setattr(trainer, "sample", lambda step: indices)
        released, stats = trainer.release(0)
        return released, stats

    with_bad, stats = release_of(sample)
    err = capsys.readouterr().err
    without, stats_without = release_of(sample[sample != 13])
    for name in with_bad:
        torch.testing.assert_close(with_bad[name], without[name], rtol=1e-12, atol=1e-15)
    named = [line for line in err.splitlines() if "y/005.png" in line]
    if secure:
        assert named == []
    else:
        # the step as metrics.jsonl and the checkpoints number it (its release is the first)
        assert len(named) == 1 and "step 1:" in named[0] and "adds nothing" in named[0]
        assert "PIL identifies no image format in it" in named[0] and "0x" not in named[0]
    assert trainer.task.train.undecodable == []  # reported (or not), then forgotten


def test_an_unreadable_training_set_is_refused_before_the_first_release(tmp_path):
    # a fixed prefix of the training set (not a sample) is decoded when the trainer is built:
    # a wrong format or a damaged first file is one error naming data.path, as before
    rng = np.random.default_rng(9)
    _tree(tmp_path / "data", "train", {"x": 3, "y": 3}, rng)
    _tree(tmp_path / "data", "val", {"y": 1}, rng)
    (tmp_path / "data" / "train" / "x" / "001.png").write_bytes(b"not an image")
    with pytest.raises(ConfigError) as e:
        _folder_trainer(tmp_path)
    assert e.value.field == "data.path" and "x/001.png" in e.value.message


def test_a_damaged_test_image_is_left_out_of_the_metrics_not_the_end_of_the_run(tmp_path,
                                                                               capsys):
    # it was a ConfigError at the evaluation, at the end of the run after training; now the
    # metrics are those of the other test images, and stderr names the file
    rng = np.random.default_rng(10)
    _tree(tmp_path / "data", "train", {"x": 4, "y": 4}, rng)
    _tree(tmp_path / "data", "val", {"x": 12, "y": 2}, rng)
    trainer = _folder_trainer(tmp_path)
    whole = trainer.evaluate()
    assert whole["examples"] == 14
    # the image at index 11 of the test split, damaged after the start-up check of the first 8
    (tmp_path / "data" / "val" / "x" / "011.png").write_bytes(b"not an image")
    capsys.readouterr()
    metrics = trainer.evaluate()
    err = capsys.readouterr().err
    assert metrics["examples"] == 13
    named = [line for line in err.splitlines() if "x/011.png" in line]
    assert len(named) == 1 and "left out of the test metrics" in named[0]
    # the metrics of the other 13, by hand: the model's loss on the decodable images
    keep = np.array([i for i in range(14) if i != 11])
    batch = trainer.task.test.collate(keep)
    trainer.model.eval()
    with torch.no_grad():
        logits = trainer.model(batch["images"].to(torch.float64))
    trainer.model.train()
    want = F.cross_entropy(logits, batch["labels"], reduction="mean")
    assert metrics["loss"] == pytest.approx(float(want), rel=1e-9)
    assert trainer.task.test.undecodable == []
    # a damaged file among the first 8 fails when the trainer is built, naming data.path
    (tmp_path / "data" / "val" / "x" / "002.png").write_bytes(b"not an image")
    with pytest.raises(ConfigError) as e:
        _folder_trainer(tmp_path)
    assert e.value.field == "data.path" and "x/002.png" in e.value.message


@pytest.mark.parametrize("where", ["data/train", "data/train/runs/a", "data/val/x",
                                   "link/train"])
def test_an_output_directory_inside_a_split_folder_is_refused(tmp_path, capsys, where):
    # the run's checkpoints/ and final/ became classes of the training split: the next run
    # failed ("Found no valid file for the classes checkpoints, final"), or trained on them
    from dptrain.cli import main

    rng = np.random.default_rng(3)
    _tree(tmp_path / "data", "train", {"x": 4, "y": 4}, rng)
    _tree(tmp_path / "data", "val", {"x": 1}, rng)
    (tmp_path / "link").symlink_to(tmp_path / "data")
    before = sorted(p.relative_to(tmp_path) for p in (tmp_path / "data").rglob("*"))
    root = Path(__file__).resolve().parents[1]
    code = main(["train", "--config", str(root / "configs" / "tiny_images.yaml"),
                 "--output-dir", str(tmp_path / where), "data.name=imagefolder",
                 f"data.path={tmp_path / 'data'}", "data.image_size=8"])
    err = capsys.readouterr().err
    split = "val" if "val" in where else "train"
    field = "data.test_file" if split == "val" else "data.train_file"
    assert code == 2 and err.count("\n") == 1, err
    assert (f"dptrain train: error: output-dir: {tmp_path / where} is inside "
            f"{(tmp_path / 'data' / split).resolve()} ({field}), whose every folder is a "
            f"class: ") in err
    below = {"data/train": "this run's checkpoints/ and final/ would be read as classes",
             "data/train/runs/a": "this run's files would be read as examples of class runs",
             "data/val/x": "x would be read as a class", "link/train": "this run's "}[where]
    assert f"class: {below}" in err and "move it out whole" in err
    assert sorted(p.relative_to(tmp_path) for p in (tmp_path / "data").rglob("*")) == before
    # a loop of links: one line naming output-dir (not a RuntimeError of Path.resolve)
    (tmp_path / "loop1").symlink_to(tmp_path / "loop2")
    (tmp_path / "loop2").symlink_to(tmp_path / "loop1")
    code = main(["train", "--config", str(root / "configs" / "tiny_images.yaml"),
                 "--output-dir", str(tmp_path / "loop1" / "sub"), "data.name=imagefolder",
                 f"data.path={tmp_path / 'data'}", "data.image_size=8"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "output-dir" in err, err
    # beside the splits, in data.path itself, is no class
    code = main(["train", "--config", str(root / "configs" / "tiny_images.yaml"),
                 "--output-dir", str(tmp_path / "data" / "run"), "data.name=imagefolder",
                 f"data.path={tmp_path / 'data'}", "data.image_size=8", "--dry-run"])
    assert code == 0, capsys.readouterr().err


def test_an_image_that_is_a_loop_of_links_is_not_called_missing(tmp_path):
    rng = np.random.default_rng(3)
    _tree(tmp_path, "train", {"a": 2, "b": 2}, rng)
    _tree(tmp_path, "val", {"a": 1, "b": 1}, rng)
    loop = tmp_path / "train" / "b" / "loop.png"
    loop.symlink_to(loop)
    with pytest.raises(ConfigError) as e:
        build_data(DataConfig(name="imagefolder", path=str(tmp_path), image_size=8))
    assert e.value.field == "data.train_file", e.value
    assert e.value.message.startswith(f"{loop} cannot be read: a link that cannot be followed "
                                      f"({loop}: Too many levels of symbolic links)"), e.value


def test_cifar10_is_normalised_with_the_published_statistics_in_channel_order(tmp_path):
    # (the reading test takes CIFAR10_MEAN/STD from the module: a swapped or reordered
    # constant passed it)
    root = tmp_path / "c"
    batches = _cifar(root, 2, np.random.default_rng(5))
    task = build_data(DataConfig(name="cifar10", path=str(root)))
    raw = batches["test_batch"][b"data"][1].reshape(3, 32, 32)[:, 4, 9].astype(np.float64)
    mean, std = np.array([0.4914, 0.4822, 0.4465]), np.array([0.2470, 0.2435, 0.2616])
    got = task.test.collate([1])["images"][0, :, 4, 9].double().numpy()
    np.testing.assert_allclose(got, (raw / 255 - mean) / std, rtol=0, atol=1e-5)


def test_imagefolder_caps_sizes_copies_and_a_missing_test_folder_are_per_split(tmp_path):
    import shutil

    rng = np.random.default_rng(6)
    _tree(tmp_path, "train", {"a": 3, "b": 2}, rng)
    with pytest.raises(ConfigError) as e:  # the test folder is the one named
        build_data(DataConfig(name="imagefolder", path=str(tmp_path), image_size=8))
    assert e.value.field == "data.test_file" and "no directory" in e.value.message
    (tmp_path / "val" / "a").mkdir(parents=True)
    with pytest.raises(ConfigError) as e:  # a class without images in the test folder
        build_data(DataConfig(name="imagefolder", path=str(tmp_path), image_size=8))
    assert e.value.field == "data.test_file" and "val" in e.value.message
    shutil.rmtree(tmp_path / "val")
    _tree(tmp_path, "val", {"a": 2, "b": 2}, rng)
    task = build_data(DataConfig(name="imagefolder", path=str(tmp_path), image_size=8,
                                 max_train_examples=2, max_test_examples=3))
    assert len(task.train) == 2 and len(task.test) == 3  # each split its own cap
    assert task.train.labels.tolist() == [0, 1]  # rows 0 and 4
    # the kept files' sizes (the ranks' digest), not the first two files'
    assert task.train.sizes.tolist() == [os.path.getsize(p) for p in task.train.paths]
    assert task.test.sizes is None
    # a copy (another file with the same bytes) is another example, not a link: accepted
    shutil.copyfile(tmp_path / "train" / "a" / "000.png", tmp_path / "train" / "b" / "dup.png")
    assert len(build_data(DataConfig(name="imagefolder", path=str(tmp_path),
                                     image_size=8)).train) == 6


class _Eval:
    def __reduce__(self):
        return (eval, ("__import__('os').system('touch /tmp/dptrain-cifar-pwned')",))


class _NumpyLoad:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (np.load, (self.path,))


def test_cifar10_batches_with_other_globals_or_mismatched_labels_are_refused(tmp_path):
    # the restricted unpickler lets numpy's array reconstruction through, not any numpy or
    # builtins callable; and a batch without labels, with one label too few, or a negative
    # label is not read as one
    root = tmp_path / "c"
    _cifar(root, 2, np.random.default_rng(7))
    marker = Path("/tmp/dptrain-cifar-pwned")
    marker.unlink(missing_ok=True)
    np.save(tmp_path / "x.npy", np.zeros((2, 3072), np.uint8))
    cases = [
        ({b"data": _Eval(), b"labels": [0, 1]}, "builtins.eval is not allowed"),
        ({b"data": _NumpyLoad(str(tmp_path / "x.npy")), b"labels": [0, 1]}, "is not allowed"),
        ({b"data": np.zeros((2, 3072), np.uint8)}, "is not a CIFAR-10 batch: KeyError"),
        ({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0]}, "want N x 3072 and N labels"),
        ({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, -1]}, "labels outside 0..9"),
    ]
    for batch, words in cases:
        with open(root / "data_batch_3", "wb") as fh:
            pickle.dump(batch, fh)  # (protocol 2 spells builtins __builtin__)
        with pytest.raises(ConfigError) as e:
            build_data(DataConfig(name="cifar10", path=str(root)))
        assert e.value.field == "data.path" and words in e.value.message, (words, e.value)
    assert not marker.exists()


def test_imagefolder_unlisted_extensions_are_counted_whatever_their_case(tmp_path, capsys):
    rng = np.random.default_rng(8)
    _tree(tmp_path, "train", {"a": 1}, rng)
    _tree(tmp_path, "val", {"a": 1}, rng)
    for name in ("x.DCM", "y.dcm", "z.Dcm"):
        (tmp_path / "train" / "a" / name).write_bytes(b"not listed")
    build_data(DataConfig(name="imagefolder", path=str(tmp_path), image_size=8))
    assert "3 file(s) of a type torchvision does not list are left out (3 .dcm)" in (
        capsys.readouterr().err)
