"""dptrain.data.fingerprint: the index digest the ranks compare at start-up. Equal for the same
examples in the same order (wherever the copy lives), different when an example, a label or
the order differs."""

from __future__ import annotations

import io

import numpy as np

from dptrain.data.fingerprint import index_fingerprint


def test_in_memory_images_and_token_sequences():
    from dptrain.data.images import ImageDataset
    from dptrain.data.lm import LMDataset

    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (6, 1, 4, 4), dtype=np.uint8)
    labels = np.arange(6) % 3

    def imgs(x, y):
        return index_fingerprint(ImageDataset(x, y, 0.5, 0.5))

    base = imgs(images, labels)
    assert 0 <= base < 2**62 and base == imgs(images.copy(), labels.copy())
    assert imgs(images[[1, 0, 2, 3, 4, 5]], labels[[1, 0, 2, 3, 4, 5]]) != base  # order
    other = images.copy()
    other[5, 0, 3, 3] ^= 1  # one pixel
    assert imgs(other, labels) != base
    assert imgs(images, (labels + 1) % 3) != base

    seqs = [np.array([1, 2, 3]), np.array([4, 5]), np.array([6])]

    def lm(s, p):
        return index_fingerprint(LMDataset(s, p, pad_id=0))

    base = lm(seqs, [1, 1, 0])
    assert base == lm([s.copy() for s in seqs], [1, 1, 0])
    assert lm(seqs, [1, 2, 0]) != base  # where the target starts
    assert lm([np.array([1, 2]), np.array([3, 4, 5]), np.array([6])], [1, 1, 0]) != base
    assert index_fingerprint(object()) is None  # another kind: only N is compared


def _image_folder(root, names, rng):
    from PIL import Image

    for split, items in (("train", names), ("val", [("cat", "v.png"), ("dog", "w.png")])):
        for cls, name in items:
            (root / split / cls).mkdir(parents=True, exist_ok=True)
            arr = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
            Image.fromarray(arr).save(root / split / cls / name)


def test_image_folders_by_class_and_file_name_wherever_the_copy_lives(tmp_path):
    from dptrain.data.folders import load_imagefolder

    import shutil

    from PIL import Image

    rng = np.random.default_rng(1)
    names = [("cat", "a.png"), ("cat", "b.png"), ("dog", "c.png")]
    _image_folder(tmp_path / "node0", names, rng)
    shutil.copytree(tmp_path / "node0", tmp_path / "node1")
    _image_folder(tmp_path / "node2", [("cat", "a.png"), ("cat", "b2.png"), ("dog", "c.png")],
                  rng)
    # another version of one file, same name (its size differs; the bytes are not read)
    shutil.copytree(tmp_path / "node0", tmp_path / "node3")
    Image.fromarray(np.zeros((16, 16, 3), np.uint8)).save(tmp_path / "node3/train/cat/b.png")
    def fp(root):
        train, _, _ = load_imagefolder(root, "train", "val", 8, 3, None, None)
        return index_fingerprint(train)

    assert fp(tmp_path / "node0") == fp(tmp_path / "node1")
    assert fp(tmp_path / "node2") != fp(tmp_path / "node0")
    assert fp(tmp_path / "node3") != fp(tmp_path / "node0")


def test_image_folder_classes_whose_names_share_a_prefix_keep_their_folder():
    # the paths were cut at the last "/" up to and including the first difference of the
    # first and last path: with classes "a" and "ab" that "/" ends "a", so "a/x" hashed as "x"
    from dptrain.data.folders import ImageFolderImages

    def fp(paths):
        return index_fingerprint(ImageFolderImages([(p, i) for i, p in enumerate(paths)], 8, 3))

    assert fp(["/r/a/x.png", "/r/ab/y.png"]) != fp(["/r/c/x.png", "/r/cb/y.png"])
    assert fp(["/r/a/x.png", "/r/ab/y.png"]) == fp(["/elsewhere/a/x.png", "/elsewhere/ab/y.png"])


def test_image_folder_labels_count_as_well_as_paths():
    # a class folder outside one rank's subset shifts the labels of the same files: the ranks
    # would train one index on different labels
    from dptrain.data.folders import ImageFolderImages

    paths = ["/r/a/x.png", "/r/b/y.png"]
    assert (index_fingerprint(ImageFolderImages([(paths[0], 0), (paths[1], 1)], 8, 3))
            != index_fingerprint(ImageFolderImages([(paths[0], 0), (paths[1], 2)], 8, 3)))


def test_webdataset_shards_by_name_layout_and_label(tmp_path):
    import webdataset as wds

    from dptrain.data.wds import WebDatasetImages

    def shard(path, samples):
        with wds.TarWriter(str(path)) as w:
            for key, img, cls in samples:
                w.write({"__key__": key, "jpg": img, "cls": str(cls).encode()})

    from PIL import Image

    def jpeg(v):
        buf = io.BytesIO()
        Image.fromarray(np.full((8, 8, 3), v, np.uint8)).save(buf, format="JPEG")
        return buf.getvalue()

    samples = [("a", jpeg(10), 0), ("b", jpeg(200), 1)]
    for d, s in (("x", samples), ("y", samples), ("z", samples[::-1]),
                 ("w", [("a", jpeg(10), 1), ("b", jpeg(200), 1)])):
        (tmp_path / d).mkdir()
        shard(tmp_path / d / "train-000000.tar", s)
    fp = {d: index_fingerprint(WebDatasetImages([tmp_path / d / "train-000000.tar"], 8))
          for d in "xyzw"}
    assert fp["x"] == fp["y"] and fp["z"] != fp["x"] and fp["w"] != fp["x"]
    # the same shard under another name (another extraction, another shard order)
    (tmp_path / "x" / "train-000000.tar").rename(tmp_path / "x" / "train-000001.tar")
    assert index_fingerprint(WebDatasetImages([tmp_path / "x" / "train-000001.tar"], 8)) != fp["x"]


def test_e2e_splits_by_their_references_too(tmp_path):
    # a test split keeps all references for generation, beyond the rows it scores NLL on:
    # two copies whose first rows agree but whose references differ must differ
    from dptrain.data import DataConfig, build_data

    rows = ['"name[A]","A is good."', '"name[B]","B is fine."', '"name[B]","B is ok."']

    def digest(test_rows, folder):
        d = tmp_path / folder
        d.mkdir()
        # (a training file of its own: one equal to the test file is refused)
        (d / "train.csv").write_text("mr,ref\n" + '"name[C]","C."' + "\n")
        (d / "test.csv").write_text("mr,ref\n" + "\n".join(test_rows) + "\n")
        task = build_data(DataConfig(name="e2e", tokenizer="bytes", path=str(d),
                                     train_file="train.csv", test_file="test.csv",
                                     max_test_examples=1))
        return index_fingerprint(task.test)

    same = digest(rows, "a")
    assert digest(rows, "b") == same
    assert digest(rows[:2] + ['"name[B]","B is other."'], "c") != same


def test_image_folder_paths_are_kept_apart_and_one_file_keeps_its_name():
    from dptrain.data.folders import ImageFolderImages

    def fp(paths):
        return index_fingerprint(ImageFolderImages([(p, i) for i, p in enumerate(paths)], 8, 3))

    # "a/b" + "c/de/f" and "a/bc/d" + "e/f" are the same characters run together
    assert fp(["/r/a/b", "/r/c/de/f"]) != fp(["/r/a/bc/d", "/r/e/f"])
    # a one-file set on two nodes (the first and last path are one: no difference to cut at)
    assert fp(["/node0/a/x.png"]) == fp(["/node1/data/a/x.png"])
    assert fp(["/node0/a/x.png"]) != fp(["/node0/a/y.png"])


def test_in_memory_images_of_another_shape_with_the_same_bytes_differ():
    from dptrain.data.images import ImageDataset

    x = np.arange(2 * 16, dtype=np.uint8).reshape(2, 1, 4, 4)
    assert (index_fingerprint(ImageDataset(x, [0, 1], 0.5, 0.5))
            != index_fingerprint(ImageDataset(x.reshape(2, 1, 2, 8), [0, 1], 0.5, 0.5)))


def test_digests_are_non_negative_and_below_2_to_the_62():
    # (the ranks compare them as int64 sums: 32 digests all below 2**62, not only one)
    from dptrain.data.images import ImageDataset

    x = np.zeros((4, 1, 2, 2), np.uint8)
    digests = {index_fingerprint(ImageDataset(x, [k % 3, k // 3 % 3, k // 9 % 3, k // 27], 0.5,
                                              0.5)) for k in range(32)}
    assert len(digests) == 32 and all(0 <= d < 2**62 for d in digests)
