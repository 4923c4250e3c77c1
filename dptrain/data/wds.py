"""ImageNet-style WebDataset shards (``.tar`` files of ``KEY.jpg`` + ``KEY.cls``) with random access.

Poisson sampling picks an arbitrary subset of example *indices* every step, so the loader must
read example i on demand; WebDataset's own pipeline streams shards sequentially instead. The
simple correct version implemented here:

1. **Index once, in memory.** Every shard is scanned with ``tarfile`` (headers only, the tar is
   never decompressed or copied): for each sample key (WebDataset's convention,
   ``webdataset.tariterators.base_plus_ext``) we keep the shard number, the byte offset and size
   of its image member, and its class label (the tiny ``.cls`` member is read during the scan).
   Example i is the i-th sample in shard order (shards sorted by name). For ImageNet (1.28M
   samples) this index is four int64 arrays, about 40 MB, built by one pass over the headers.
2. **Read by seeking.** ``collate(indices)`` groups the requested indices by shard, seeks to each
   image's offset, reads its bytes and decodes with PIL (resize the shorter side to
   ``image_size / 0.875``, centre crop ``image_size``: the standard evaluation transform, used
   for training too, so that an example is a fixed function of its index).

Shards must be uncompressed ``.tar`` (a ``.tar.gz`` cannot be seeked into). Sampling within
shards (shuffle buffers) would make inclusion depend on the shard layout and break the Poisson
sampler's exact per-example independence, so it is not offered.
"""

from __future__ import annotations

import errno
import glob
import io
import os
import re
import sys
import tarfile
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from dptrain.config import ConfigError, require_file
from dptrain.data import even_subset

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp", "ppm", "bmp")
LABEL_EXTS = ("cls", "cls.txt", "label")
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
CROP_FRACTION = 0.875
COMPRESSED_EXTS = (".gz", ".bz2", ".xz", ".zst")


def _compressed_hint(query: str) -> str:
    """What to say when glob ``query`` matches no shard but compressed ones exist (only
    ``.tar.gz`` shards, with the default ``*train*.tar``): they are read uncompressed."""
    packed = [Path(x) for ext in COMPRESSED_EXTS for x in sorted(glob.glob(query + ext))
              if Path(x).is_file()]
    if not packed:
        return ""
    shown = ", ".join(p.name for p in packed[:2]) + (", ..." if len(packed) > 2 else "")
    return (f"; {len(packed)} compressed shard{'s' if len(packed) > 1 else ''} ({shown}) "
            f"match{'' if len(packed) > 1 else 'es'} it: shards are read as plain .tar files, "
            f"decompress them first (e.g. gunzip)")


def unfollowable_link(path: str | Path) -> str | None:
    """What ``path`` is if it is a symbolic link that cannot be followed ("a link to a missing
    file (target)"; a loop of links, ELOOP, or a target this user may not reach, EACCES, says
    its own reason: neither is a missing file), None otherwise."""
    if not os.path.islink(path):
        return None
    try:
        os.stat(path)
        return None
    except OSError as e:
        target = os.readlink(path)
        if e.errno == errno.ENOENT:
            return f"a link to a missing file ({target})"
        return (f"a link that cannot be followed ({target}: "
                f"{os.strerror(e.errno) if e.errno else e})")


def expand_shards(directory: Path | None, pattern: str, field: str) -> list[Path]:
    """Shard paths of ``pattern`` (brace notation ``{000..146}`` and/or glob wildcards),
    relative to ``directory`` unless absolute; sorted; ConfigError(field) if none exist."""
    from braceexpand import braceexpand

    out: list[Path] = []
    for pat in braceexpand(pattern):
        p = Path(pat)
        # the directory is a path, not a pattern (data.path may hold "[" or "*"): escaped
        where = (glob.escape(str(directory)) if directory is not None and not p.is_absolute()
                 else None)
        if not p.is_absolute() and directory is not None:
            p = directory / p
        if any(ch in pat for ch in "*?["):
            # files only: a directory named like a shard is not one
            query = os.path.join(where, pat) if where is not None else pat
            matches = sorted(glob.glob(query))
            # a link to a missing file (a scratch file system not mounted on this node) was
            # skipped in silence: N and the classes of the shards that are left, exit 0
            broken = next(((x, why) for x in matches if (why := unfollowable_link(x))), None)
            if broken is not None:
                raise ConfigError(field, f"{broken[0]} is {broken[1]}: a shard this node "
                                         f"cannot read")
            found = [Path(x) for x in matches if Path(x).is_file()]
            if not found:  # one alternative of a brace list that matches nothing: a typo
                raise ConfigError(field, f"file not found: no shard matches {p}"
                                         f"{_compressed_hint(query)}")
            out.extend(found)
        else:
            require_file(field, p)
            out.append(p)
    if not out:
        where = directory / pattern if directory is not None else pattern
        raise ConfigError(field, f"file not found: no shard matches {where}")
    # one entry per file: a symlink (or a hard link, or two spellings of one path) that the
    # pattern also matches would index the same examples twice, so N would count them twice
    # and one example could be drawn twice in a step (sensitivity 2C)
    seen: set[tuple[int, int]] = set()
    unique = []
    for p in sorted(set(out), key=str):
        if file_id(p) not in seen:
            seen.add(file_id(p))
            unique.append(p)
    return unique


def find_copy(shards: list[Path], layouts: list[bytes]) -> tuple[Path, Path] | None:
    """Two of ``shards`` that are the same file's bytes under two names (a copy, which the
    link check of :func:`expand_shards` cannot see), or None. ``layouts[i]`` digests shard i's
    index (:attr:`WebDatasetImages.layouts`). Only shards with the same size and the same
    non-empty index are read: first their first and last 64 KiB, then, where those agree too,
    byte for byte."""
    import filecmp

    groups: dict[tuple[int, bytes], list[Path]] = {}
    for path, layout in zip(shards, layouts):
        if layout:  # (no samples: a copy adds none)
            groups.setdefault((path.stat().st_size, layout), []).append(path)
    for paths in groups.values():
        if len(paths) < 2:
            continue
        by_ends: dict[bytes, list[Path]] = {}
        for path in paths:  # class-sorted shards of fixed-size images share a layout
            by_ends.setdefault(_ends_digest(path), []).append(path)
        for same in by_ends.values():
            for i, path in enumerate(same):
                for earlier in same[:i]:
                    if filecmp.cmp(earlier, path, shallow=False):
                        return earlier, path
    return None


def _ends_digest(path: Path, span: int = 1 << 16) -> bytes:
    import hashlib

    with open(path, "rb") as fh:
        head = fh.read(span)
        fh.seek(max(0, path.stat().st_size - span))
        return hashlib.blake2b(head + fh.read(span), digest_size=16).digest()


def file_id(path: Path) -> tuple[int, int]:
    """(device, inode): the same for every spelling of, and every link to, one file."""
    st = path.stat()
    return st.st_dev, st.st_ino


def index_shards(shards: list[Path], cache_dir: str | Path | None = None) -> dict[str, np.ndarray]:
    """Scan the shards' tar headers: per sample its shard, image offset, image size, label.
    With ``cache_dir`` (``data.index_cache_dir``), each shard's index is kept there and read
    back while the shard is unchanged (:func:`_cached_shard_index`)."""
    from webdataset.tariterators import base_plus_ext

    columns: dict[str, list[np.ndarray]] = {"shard": [], "offset": [], "size": [], "label": []}
    for s, path in enumerate(shards):
        offsets, sizes, labels = (_cached_shard_index(path, Path(cache_dir), base_plus_ext)
                                  if cache_dir is not None else
                                  _shard_index(path, base_plus_ext))
        for k, v in zip(columns, (np.full(len(labels), s), offsets, sizes, labels)):
            columns[k].append(v)
    return {k: np.concatenate([*v, np.zeros(0, np.int64)]).astype(np.int64)
            for k, v in columns.items()}


def _layouts(index: dict[str, np.ndarray], shards: int) -> list[bytes]:
    """Per shard (the index's rows are in shard order), a digest of its samples' offsets,
    sizes and labels; b"" for a shard without samples."""
    import hashlib

    bounds = np.searchsorted(index["shard"], np.arange(shards + 1))
    columns = np.stack([index[k] for k in ("offset", "size", "label")])
    return [hashlib.blake2b(columns[:, a:b].tobytes(), digest_size=16).digest() if b > a
            else b"" for a, b in zip(bounds[:-1], bounds[1:])]


_MAGIC = {b"\x1f\x8b": "gzip", b"BZh": "bzip2", b"\xfd7zXZ\x00": "xz",
          b"\x28\xb5\x2f\xfd": "zstd"}
"""The first bytes of the compressed formats shards come in (``.tar.gz`` and the like)."""


def _compressed(path: Path) -> str | None:
    """The compression ``path``'s first bytes name, if any (None: unreadable, or none; or a
    tar, whose first block is a valid header, ustar or v7: its first bytes are a member's
    name, which may begin as a magic number does)."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(tarfile.BLOCKSIZE)
    except OSError:
        return None
    try:
        tarfile.TarInfo.frombuf(head, "utf-8", "surrogateescape")
        return None  # (its checksum holds)
    except Exception:
        pass
    return next((name for magic, name in _MAGIC.items() if head.startswith(magic)), None)


def _shard_index(path: Path, base_plus_ext) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(image offsets, image sizes, labels) of one shard's samples, in member order."""
    try:
        samples = _scan_shard(path, base_plus_ext)
    except (tarfile.TarError, OSError, EOFError) as e:
        # tarfile reads member headers lazily: a truncated or damaged shard fails while
        # the members are iterated, not when it is opened
        if _compressed(path):
            raise ConfigError("data.path", f"{path} is compressed ({_compressed(path)}): "
                                           "images are read at their byte offsets in the "
                                           "shard, so shards must be uncompressed tar files "
                                           "(decompress it)") from None
        raise ConfigError("data.path", f"{path} is not a readable uncompressed tar shard: "
                                       f"{e}") from None
    offsets, sizes, labels = [], [], []
    for key, rec in samples.items():
        if "img" not in rec or "cls" not in rec:
            missing = "image" if "img" not in rec else "cls label"
            raise ConfigError("data.path", (
                f"{path}: sample {key!r} has no {missing} (it has {rec['member']}; "
                "webdataset's key is a file name up to its first dot, so "
                "'n01.0026.jpg' is the sample 'n01' with the extension '0026.jpg')"))
        offsets.append(rec["img"][0])
        sizes.append(rec["img"][1])
        labels.append(rec["cls"])
    return (np.asarray(offsets, dtype=np.int64), np.asarray(sizes, dtype=np.int64),
            np.asarray(labels, dtype=np.int64))


INDEX_CACHE_FORMAT = 3
"""Bumped when what a shard's index holds changes: 2 (2026-12-03) refuses a key that comes back
after other keys and labels that are not ASCII int64 digits, which format 1 entries accepted;
3 (2026-12-06) refuses a shard with anything but zeros after its end-of-archive marker, or
without one, and indexes keys that start with ``__`` but are not webdataset's metadata names
(format 2 skipped them)."""


def _cached_shard_index(path: Path, cache_dir: Path, base_plus_ext):
    """:func:`_shard_index` through a cache file per shard in ``cache_dir``, named by a digest
    of (format, resolved path, size, modification and change times in ns, inode) and holding
    that key too: a shard written again, or copied over with its timestamps kept, gets a new
    entry. A missing, unreadable or foreign entry is scanned and written afresh (atomically:
    ranks may write the same entry at once); a cache that cannot be written is said once and
    skipped. Reading ImageNet's 1,281,167 headers takes about a minute
    per rank (Python's tarfile; BENCHMARKS.md), and every resume pays it again without this."""
    import hashlib

    from dptrain.telemetry import replace_atomically

    try:
        st = path.stat()
        # ctime too: a copy that keeps the timestamps (cp -p, rsync -t) sets mtime, not ctime
        key = (f"{INDEX_CACHE_FORMAT}\0{path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}"
               f"\0{st.st_ctime_ns}\0{st.st_ino}")
    except OSError:
        return _shard_index(path, base_plus_ext)  # (its own error, naming data.path)
    entry = cache_dir / (hashlib.blake2b(key.encode("utf-8", "surrogateescape"),
                                         digest_size=16).hexdigest() + ".npz")
    try:
        with np.load(entry, allow_pickle=False) as z:
            if str(z["key"]) == key:
                return z["offset"], z["size"], z["label"]
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):
        pass  # not there yet, or damaged: scanned again below
    offsets, sizes, labels = _shard_index(path, base_plus_ext)

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as fh:
            np.savez(fh, key=np.asarray(key), offset=offsets, size=sizes, label=labels)
        # the entry holds the shard's labels: readable by no one the shard is not readable by
        # (the umask alone would give a 0600 shard's labels a 0644 copy)
        os.chmod(tmp, 0o600 | (st.st_mode & 0o044))

    try:
        replace_atomically(entry, write)
    except OSError as e:  # a read-only or full cache: the index was built all the same
        if cache_dir not in _UNWRITABLE:
            _UNWRITABLE.add(cache_dir)
            print(f"dptrain: note: data.index_cache_dir {cache_dir} cannot be written "
                  f"({e.strerror or e}); the shards' index is not cached", file=sys.stderr)
    return offsets, sizes, labels


_UNWRITABLE: set[Path] = set()  # cache folders already said to be unwritable (said once)
_LABEL = re.compile(r"[+-]?[0-9]{1,19}")  # a label in a .cls member: ASCII digits (then int64)
_INT64 = range(-(1 << 63), 1 << 63)


def _scan_shard(path: Path, base_plus_ext) -> dict[str, dict]:
    """``{key: {"img": (offset, size), "cls": label}}`` of one shard, in member order."""
    samples: dict[str, dict] = {}
    last = None  # the key of the previous member
    end = path.stat().st_size
    with tarfile.open(path, mode="r:") as tf:
        for m in tf:
            if not m.isfile():
                continue
            prefix, ext = base_plus_ext(m.name)
            if prefix is None:
                continue
            if _is_metadata(m.name):
                continue  # (webdataset skips it: a key before and after it is not split)
            ext = ext.lower()
            if prefix in samples and prefix != last:
                # webdataset groups adjacent members by key: a key that comes back after
                # another is a second sample (which this index would have merged into one)
                raise ConfigError("data.path", f"{path}: sample key {prefix!r} appears twice "
                                               f"({m.name} after other keys' members)")
            last = prefix
            rec = samples.setdefault(prefix, {"member": m.name})  # (named by errors)
            part = "img" if ext in IMAGE_EXTS else "cls" if ext in LABEL_EXTS else None
            if part is not None and part in rec:
                # one example must be one sample: a key seen twice in a shard would merge
                # two samples' files (webdataset itself would yield both)
                raise ConfigError("data.path", f"{path}: sample key {prefix!r} appears "
                                               f"twice (a second {m.name})")
            if ext in IMAGE_EXTS:
                if m.issparse():  # its stored data is compacted: not readable at an offset
                    raise ConfigError("data.path", f"{path}: {m.name} is a sparse tar member "
                                                   f"(tar --sparse); write the shard without "
                                                   f"--sparse")
                if m.offset_data + m.size > end:  # cut off: the last member's data is short
                    raise tarfile.ReadError(f"{m.name} ends past the end of the file "
                                            f"(truncated shard)")
                rec["img"] = (m.offset_data, m.size)
            elif ext in LABEL_EXTS:
                raw = tf.extractfile(m).read()
                try:  # a non-UTF-8 label is a ValueError too (UnicodeDecodeError)
                    text = raw.decode("utf-8").strip()
                except ValueError:
                    text = None
                # ASCII digits only, within int64: int() also reads "1_0" as 10 and "٣" as 3,
                # and a 23-digit label overflowed later with a traceback
                if text is None or not _LABEL.fullmatch(text) or int(text) not in _INT64:
                    raise ConfigError("data.path",
                                      f"{path}: {m.name} is not an integer label")
                rec["cls"] = int(text)
        # tarfile ends the iteration SILENTLY at a damaged or cut-off header after the first
        # one, and at the first zero block, wherever it is (the rest of the shard would be
        # dropped): the archive must end at its end-of-archive marker, zeros to the end of
        # the file, as every tar writer leaves it
        stop = tf.offset
    _check_ends_in_zeros(path, stop, end)
    return samples


def _is_metadata(name: str) -> bool:
    """A member webdataset's tar reader skips (``__name__``, or in a ``__name__/`` folder):
    not a sample."""
    return ("/" not in name and name.startswith("__") and name.endswith("__")) or bool(
        _METADATA.match(name))


_METADATA = re.compile(r"__[^/]*__($|/)")  # webdataset's default skip_meta


def _check_ends_in_zeros(path: Path, stop: int, end: int) -> None:
    """Refuse a shard whose member iteration stopped at byte ``stop`` of ``end`` anywhere but
    at its end-of-archive marker with only zeros after it: cut off at a member's boundary (no
    marker), a damaged header, or a zero block in the middle (a page lost in an unclean
    shutdown, two tars concatenated), after which tar readers drop the members."""
    if stop == end:
        raise tarfile.ReadError(f"no end-of-archive marker: the shard ends at byte {end} after "
                                f"a complete member (truncated shard?)")
    with open(path, "rb") as fh:
        fh.seek(stop)
        first = fh.read(tarfile.BLOCKSIZE)
        if len(first) < tarfile.BLOCKSIZE or first.count(0) != tarfile.BLOCKSIZE:
            raise tarfile.ReadError(f"damaged or truncated tar header at byte {stop} "
                                    f"(truncated shard?)")
        at = stop + tarfile.BLOCKSIZE
        while chunk := fh.read(1 << 20):
            zeros = len(chunk) - len(chunk.lstrip(b"\0"))  # leading
            if zeros < len(chunk):
                raise tarfile.ReadError(
                    f"data after the end-of-archive marker at byte {stop} (byte {at + zeros} "
                    f"is not 0): a block of zeros in the middle of the shard (a page lost in "
                    f"an unclean shutdown?) or two tars concatenated; tar readers drop the "
                    f"members after it")
            at += len(chunk)


def _eight_bit(img):
    """A 16-bit grey image (PNG, TIFF: Pillow's modes ``I;16*``, and ``I``, as which 16-bit
    files open too) scaled to 8 bits, 0..65535 onto 0..255: ``convert`` clips at 255, and a
    medical scan came out almost all white. 32-bit float images (``F``) have no fixed range:
    refused (ValueError: undecodable) rather than guessed. Other modes as they are."""
    from PIL import Image

    if img.mode.startswith("I;16") or img.mode == "I":
        a = np.asarray(img).astype(np.int64)
        if a.min() < 0 or a.max() > 65535:
            raise ValueError(f"a {img.mode} image with values outside 0..65535 (32-bit "
                             f"integers): convert it to 8 or 16 bits")
        return Image.fromarray(((a * 255 + 32767) // 65535).astype(np.uint8), mode="L")
    if img.mode == "F":
        raise ValueError("a 32-bit float image (mode F) has no fixed range: convert it to 8 "
                         "or 16 bits")
    return img


def center_crop_transform(img, image_size: int, in_chans: int) -> np.ndarray:
    """PIL image -> uint8 ``[C, S, S]``: shorter side to ``S / 0.875``, centre crop S."""
    from PIL import Image

    img = _eight_bit(img).convert("L" if in_chans == 1 else "RGB")
    w, h = img.size
    short = max(image_size, int(round(image_size / CROP_FRACTION)))
    scale = short / min(w, h)
    nw, nh = max(image_size, int(round(w * scale))), max(image_size, int(round(h * scale)))
    img = img.resize((nw, nh), Image.BILINEAR)
    left, top = (nw - image_size) // 2, (nh - image_size) // 2
    img = img.crop((left, top, left + image_size, top + image_size))
    arr = np.asarray(img, dtype=np.uint8)
    if arr.ndim == 2:
        arr = arr[:, :, None]
    check_in_chans(in_chans)
    return np.ascontiguousarray(arr.transpose(2, 0, 1))


class ImageDecoding:
    """For image datasets that decode files per step: when the trainer turns
    ``skip_undecodable`` on (the training split), a file that cannot be decoded does not stop
    the run at the step that sampled it (which would tell when that example was sampled): the
    batch's ``decoded`` mask marks it, the trainer gives it clip factor 0 (it adds nothing to
    the release, as a fixed function of the example), and its message is kept in
    ``undecodable`` for the trainer to show (not in secure mode)."""

    skip_undecodable = False
    decode_threads = 1  # (performance.decode_threads, set by the trainer)
    image_size: int
    in_chans: int
    mean: torch.Tensor
    std: torch.Tensor
    labels: torch.Tensor

    @property
    def undecodable(self) -> list[str]:
        if "_undecodable" not in self.__dict__:
            self._undecodable: list[str] = []
        return self._undecodable

    def _decode(self, files, where, idx) -> dict[str, torch.Tensor]:
        failed: list[tuple[int, str]] | None = [] if self.skip_undecodable else None
        x = decode_images(files, where, self.image_size, self.in_chans, self.mean, self.std,
                          self.decode_threads, failed)
        batch = {"images": x, "labels": self.labels[torch.from_numpy(idx)].clone()}
        if failed is not None:
            decoded = torch.ones(len(idx), dtype=torch.bool)
            for row, message in failed:
                decoded[row] = False
                self.undecodable.append(message)
            batch["decoded"] = decoded
        return batch


class WebDatasetImages(ImageDecoding):
    """Random-access view of WebDataset shards; see the module docstring."""

    kind = "classification"

    def __init__(self, shards: list[Path], image_size: int, in_chans: int = 3,
                 max_examples: int | None = None, index_cache_dir: str | Path | None = None):
        self.shards = [Path(s) for s in shards]
        self.image_size = int(image_size)
        self.in_chans = int(in_chans)
        self.index = index_shards(self.shards, index_cache_dir)
        #: per shard, a digest of its samples' offsets, sizes and labels (b"" for none), for
        #: :func:`find_copy`
        self.layouts = _layouts(self.index, len(self.shards))
        #: (lowest, highest) label of all the shards' examples, before ``max_examples`` (the
        #: classes are the data's, not a subset's); None without examples
        labels = self.index["label"]
        self.label_range = (int(labels.min()), int(labels.max())) if len(labels) else None
        # (shard, offset) of a sample with the lowest and one with the highest label, for an
        # error that refuses one (``label_place``)
        self._label_places = [(int(self.index["shard"][i]), int(self.index["offset"][i]))
                              for i in ((labels.argmin(), labels.argmax()) if len(labels)
                                        else ())]
        #: how many distinct labels they hold (the classes a head inferred from the range has)
        self.label_count = len(np.unique(labels))
        if max_examples is not None and max_examples < len(self.index["label"]):
            keep = even_subset(len(self.index["label"]), max_examples)
            self.index = {k: v[keep] for k, v in self.index.items()}
        self.labels = torch.from_numpy(self.index["label"])
        self._member_names: dict[int, dict[int, str]] = {}  # (``_member_at``: shard's names)
        self.mean, self.std = image_stats(in_chans)
        self.decode_threads = 1  # (performance.decode_threads, set by the trainer)

    def __len__(self) -> int:
        return len(self.labels)

    def read_bytes(self, indices) -> list[bytes]:
        """Raw image bytes of the given examples, in order."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        out: list[bytes | None] = [None] * len(idx)
        shard = self.index["shard"][idx]
        for s in np.unique(shard):
            path = self.shards[int(s)]
            try:
                with open(path, "rb") as fh:
                    for pos in np.flatnonzero(shard == s):
                        i = idx[pos]
                        fh.seek(int(self.index["offset"][i]))
                        out[pos] = fh.read(int(self.index["size"][i]))
                        if len(out[pos]) != int(self.index["size"][i]):
                            raise ConfigError("data.path", f"cannot read {self._where(int(i))}: "
                                                           f"it is cut off (the shard changed "
                                                           f"after it was indexed)")
            except OSError as e:  # a shard removed, replaced or unreadable since indexing
                raise ConfigError("data.path", f"cannot read {path}: {e}") from None
        return out  # type: ignore[return-value]

    def label_place(self, highest: bool) -> str:
        """'SHARD: MEMBER' of a sample with the highest (or lowest) label of ``label_range``."""
        return self._member_at(*self._label_places[int(highest)])

    def _where(self, i: int) -> str:
        """'SHARD: MEMBER' of example i's image, for error messages."""
        return self._member_at(int(self.index["shard"][i]), int(self.index["offset"][i]))

    def _member_at(self, shard: int, offset: int) -> str:
        """'SHARD: MEMBER' of the member whose data begins at ``offset`` of shard ``shard``,
        for messages. Its name as tarfile reads it, from the GNU or PAX header before its own
        where there is one (a name over 100 bytes, or not ASCII: the own block holds a cut or
        replaced copy); the shard's member names are listed once, when first asked for. A
        shard that cannot be listed (changed since it was indexed) gives the own block's."""
        path = self.shards[shard]
        names = self._member_names.get(shard)
        if names is None:
            names = {}  # (kept once whole: another thread asking meanwhile lists them too)
            try:
                with tarfile.open(path, "r:") as tar:
                    for member in tar:
                        names[member.offset_data] = member.name
            except Exception:  # (ValueError too: a PAX header's number; this never raises)
                pass  # (the members listed until the damage)
            self._member_names[shard] = names
        name = names.get(offset)
        if name is None:
            name = f"the image at byte {offset}"
            try:
                with open(path, "rb") as fh:
                    fh.seek(offset - tarfile.BLOCKSIZE)
                    block = fh.read(tarfile.BLOCKSIZE)
                name = tarfile.TarInfo.frombuf(block, "utf-8", "surrogateescape").name
            except Exception:
                pass
        return f"{path}: {name}"

    def collate(self, indices) -> dict[str, torch.Tensor]:
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        raws = [io.BytesIO(raw) for raw in self.read_bytes(idx)]
        return self._decode(raws, lambda row: self._where(int(idx[row])), idx)


def check_in_chans(in_chans: int) -> None:
    """Decoded images have 1 (grey) or 3 (RGB) channels: anything else is a ConfigError, before
    any image is decoded (inside the decoding it would mark every image undecodable)."""
    if in_chans not in (1, 3):
        raise ConfigError("data.in_chans", f"decoded images have 1 or 3 channels, got "
                                           f"{in_chans}")


def image_stats(in_chans: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalisation of decoded images: ImageNet's mean and std for RGB, 0.5 for grey."""
    check_in_chans(in_chans)
    mean, std = (IMAGENET_MEAN, IMAGENET_STD) if in_chans == 3 else ((0.5,), (0.5,))
    return (torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1),
            torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1))


def default_decode_threads() -> int:
    """``performance.decode_threads`` null: min(8, CPU cores)."""
    return max(1, min(8, os.cpu_count() or 1))


_DECODE_POOLS: dict[int, ThreadPoolExecutor] = {}


def _decode_pool(threads: int) -> ThreadPoolExecutor:
    if threads not in _DECODE_POOLS:
        _DECODE_POOLS[threads] = ThreadPoolExecutor(threads, thread_name_prefix="dptrain-decode")
    return _DECODE_POOLS[threads]


def decode_images(files, where, image_size: int, in_chans: int, mean: torch.Tensor,
                  std: torch.Tensor, threads: int = 1,
                  failed: list[tuple[int, str]] | None = None) -> torch.Tensor:
    """Decode ``files`` (paths or binary file objects) with PIL through
    ``center_crop_transform`` into normalised float32 ``[B, C, S, S]``, on ``threads``
    threads (each file into its own row: the same result with any number); a file that is no
    image is a ConfigError naming ``where(row)`` (the first such row), not a traceback mid-run.
    With ``failed`` (a list), such a file is not an error: its row is all zeros and
    (row, message) is appended to ``failed``."""
    from PIL import Image

    check_in_chans(in_chans)
    s = image_size
    arr = np.zeros((len(files), in_chans, s, s), dtype=np.uint8)

    def one(row: int) -> str | None:
        try:
            with Image.open(files[row]) as img:
                arr[row] = center_crop_transform(img, s, in_chans)
        except Image.UnidentifiedImageError:  # (its message names a BytesIO's address)
            return "PIL identifies no image format in it"
        except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
            # PIL: "image file is truncated" (OSError), a broken PNG (SyntaxError), ...
            return str(e)
        return None

    rows = range(len(files))
    if threads > 1 and len(files) > 1:
        errors = list(_decode_pool(threads).map(one, rows))
    else:
        errors = [one(row) for row in rows]
    bad = [(row, f"{where(row)} cannot be decoded as an image: {e}")
           for row, e in enumerate(errors) if e is not None]
    if bad and failed is None:
        raise ConfigError("data.path", bad[0][1])
    # in place: the out-of-place form held 3.3x the batch in temporaries (+1.3 GiB for 33k
    # images at 32 pixels)
    x = torch.from_numpy(arr).float().div_(255.0).sub_(mean).div_(std)
    for row, message in bad:
        x[row] = 0.0
        failed.append((row, message))
    return x
