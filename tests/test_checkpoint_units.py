"""The write side of dptrain/checkpoint in units, without a training run: the order of the
fsyncs and the rename, a rewrite over a damaged checkpoint, retention, the marker's sizes and
shape, the step read from a marker or a name, the frozen parameters' digest, tied tensors kept
once, the optimizer's placeholders filled back, and the HF export replacing an earlier one.
Each pinned by a mutation run of the write side (each test fails under one or more mutants)."""

from __future__ import annotations

import json
import os
import shutil
import types
from pathlib import Path

import pytest
import torch

from dptrain import checkpoint as ckpt

HEX = "0" * 64


def _write(tmp_path: Path, step: int, keep: int = 5) -> Path:
    return ckpt.write({"step": step, "x": torch.arange(64.0)}, tmp_path, step, keep=keep)


def test_the_data_and_the_marker_are_fsynced_before_the_rename_and_the_root_after(
        tmp_path, monkeypatch):
    # a power loss after the rename must find the files and the marker on disk
    events = []
    fsync, replace = os.fsync, os.replace

    def recording_fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return fsync(fd)

    def recording_replace(a, b):
        events.append(("replace", str(a), str(b)))
        return replace(a, b)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    monkeypatch.setattr(os, "replace", recording_replace)
    path = _write(tmp_path, 3)
    root = tmp_path / "checkpoints"
    (rename,) = [i for i, e in enumerate(events) if e[0] == "replace"]
    assert Path(events[rename][2]) == path
    tmp = Path(events[rename][1]).resolve()
    before = [Path(e[1]) for e in events[:rename]]
    after = [Path(e[1]) for e in events[rename + 1:] if e[0] == "fsync"]
    assert before == [tmp / "state.pt", tmp / ckpt.MARKER, tmp]  # data, marker, directory
    assert after == [root.resolve()]


def test_a_checkpoint_written_again_at_its_step_replaces_the_damaged_one(tmp_path):
    path = _write(tmp_path, 2)
    (path / "state.pt").write_bytes(b"damaged")
    assert ckpt.verify(path) is not None
    again = ckpt.write({"step": 2, "y": 1}, tmp_path, 2, keep=5)
    assert again == path and ckpt.verify(path) is None
    assert torch.load(path / "state.pt", weights_only=False) == {"step": 2, "y": 1}
    # nothing left beside it (the moved-aside copy deleted)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-00000002"]


def test_the_marker_records_the_step_and_each_file_s_digest_and_size(tmp_path):
    path = _write(tmp_path, 7)
    marker = json.loads((path / ckpt.MARKER).read_text())
    size = (path / "state.pt").stat().st_size
    assert marker == {"sha256": {"state.pt": ckpt._sha256(path / "state.pt")},
                      "bytes": {"state.pt": size}, "step": 7}
    assert ckpt._marker_step(path) == ckpt.checkpoint_step(path) == 7


@pytest.mark.parametrize("keep, want", [(1, [5]), (2, [4, 5]), (3, [3, 4, 5])])
def test_retention_keeps_the_newest_keep_complete_checkpoints(tmp_path, keep, want):
    for step in (1, 2, 3, 4, 5):
        _write(tmp_path, step, keep=keep)
    assert ckpt.complete_steps(tmp_path) == want


def test_later_checkpoints_go_first_so_the_one_just_written_is_kept(tmp_path):
    # resumed from step 2 past damaged ones at 3 and 4 (here: whole, as a complete later
    # one counted among the newest would make the one just written the first deleted)
    for step in (1, 2, 3, 4):
        _write(tmp_path, step)
    (tmp_path / "checkpoints" / "step-00000004" / ckpt.MARKER).unlink()  # damaged, unmarked
    _write(tmp_path, 3, keep=1)
    assert ckpt.written_steps(tmp_path) == [3]
    for step in (4, 5):
        _write(tmp_path, step, keep=2)
    assert ckpt.written_steps(tmp_path) == [4, 5]


def test_written_steps_count_unmarked_directories_and_complete_steps_do_not(tmp_path):
    for step in (1, 2):
        _write(tmp_path, step)
    (tmp_path / "checkpoints" / "step-00000002" / ckpt.MARKER).unlink()
    (tmp_path / "checkpoints" / "step-00000009-copy").mkdir()
    assert ckpt.written_steps(tmp_path) == [1, 2] and ckpt.complete_steps(tmp_path) == [1]


def test_a_truncated_file_is_found_by_its_size_without_hashing(tmp_path, monkeypatch):
    path = _write(tmp_path, 1)
    size = (path / "state.pt").stat().st_size
    (path / "state.pt").write_bytes((path / "state.pt").read_bytes()[:-1])

    def no_hashing(f):
        raise AssertionError(f"hashed {f}")

    monkeypatch.setattr(ckpt, "_sha256", no_hashing)
    want = f"state.pt has {size - 1} bytes, the marker says {size}"
    assert want in (ckpt.verify(path, shallow=True) or "")
    assert want in (ckpt.verify(path) or "")


def test_a_shallow_check_hashes_nothing_and_a_full_one_every_file(tmp_path):
    # (the first pass of --resume auto is shallow; the checksums then read every file once)
    root = tmp_path / "checkpoints"
    tmp = root / ".tmp-step-00000001-1"
    tmp.mkdir(parents=True)
    names = ("__0_0.distcp", "__1_0.distcp", ".metadata", "meta.pt")
    for name in names:
        (tmp / name).write_bytes(name.encode() * 10)
    path = ckpt._seal(tmp, root, "step-00000001", 1, {}, keep=2)
    for name in names:
        data = bytearray((path / name).read_bytes())
        data[3] ^= 0x01  # same size
        (path / name).write_bytes(bytes(data))
        assert ckpt.verify(path, shallow=True) is None
        assert name in (ckpt.verify(path) or ""), name
        data[3] ^= 0x01
        (path / name).write_bytes(bytes(data))
    assert ckpt.verify(path) is None


def test_a_marker_without_sizes_an_older_version_s_is_still_checked_by_its_digests(tmp_path):
    path = _write(tmp_path, 1)
    marker = json.loads((path / ckpt.MARKER).read_text())
    del marker["bytes"]
    (path / ckpt.MARKER).write_text(json.dumps(marker))
    assert ckpt.verify(path) is None
    (path / "state.pt").write_bytes((path / "state.pt").read_bytes()[:-1])
    assert "checksum mismatch in state.pt" in (ckpt.verify(path) or "")


@pytest.mark.parametrize("sums, sizes, ok", [
    ({"state.pt": HEX}, {"state.pt": 0}, True),
    ({"meta.pt": HEX, ".metadata": HEX}, {}, True),
    ({"state.pt": HEX}, {"state.pt": True}, False),
    ({"state.pt": HEX}, {"state.pt": -1}, False),
    ({"state.pt": HEX}, {"state.pt": 1.0}, False),
    ({"state.pt": "0" * 63}, {}, False),
    ({"state.pt": "0" * 65}, {}, False),
    ({"state.pt": "A" * 64}, {}, False),
    ({"state.pt": HEX, "..": HEX}, {}, False),
    ({"state.pt": HEX, "a\\b": HEX}, {}, False),
    ({"state.pt": HEX}, {"../x": 1}, False),
    ({"other.pt": HEX}, {}, False),
])
def test_a_marker_s_shape(sums, sizes, ok):
    assert bool(ckpt._well_formed(sums, sizes)) is ok


@pytest.mark.parametrize("marker, step", [
    ({"step": 4}, 4), ({"step": True}, None), ({"step": 4.0}, None), ({"step": "4"}, None),
    ([4], None), ({}, None)])
def test_the_marker_s_step(tmp_path, marker, step):
    path = tmp_path / "step-00000009"
    path.mkdir()
    (path / ckpt.MARKER).write_text(json.dumps(marker))
    assert ckpt._marker_step(path) == step
    assert ckpt.checkpoint_step(path) == (9 if step is None else step)


def test_a_renamed_checkpoint_keeps_its_marker_s_step(tmp_path):
    path = _write(tmp_path, 3)
    copy = tmp_path / "elsewhere" / "my-copy"
    shutil.copytree(path, copy)
    assert ckpt.checkpoint_step(copy) == 3 and ckpt.step_of(copy) is None
    assert ckpt.checkpoint_step(tmp_path / "step-00000012") == 12  # no marker: the name's
    assert ckpt.checkpoint_step(tmp_path / "nothing") is None


@pytest.mark.parametrize("name, step", [
    ("step-00000012", 12), ("step-123456789", 123456789), ("step-", None),
    ("step-00000012-backup", None), ("xstep-00000012", None), ("step-12a", None)])
def test_step_of(name, step):
    assert ckpt.step_of(Path("/x") / name) == step


def test_find_latest_takes_the_newest_intact_and_quiet_says_nothing(tmp_path, capsys):
    for step in (1, 2, 3):
        _write(tmp_path, step)
    newest = tmp_path / "checkpoints" / "step-00000003"
    (newest / "state.pt").write_bytes(b"x")
    assert ckpt.find_latest(tmp_path, quiet=True).name == "step-00000002"
    assert capsys.readouterr().err == ""
    assert ckpt.find_latest(tmp_path).name == "step-00000002"
    err = capsys.readouterr().err
    assert f"skipping damaged checkpoint {newest}" in err and "trying the previous one" in err
    assert ckpt.find_latest(tmp_path / "none") is None


class _Frozen(torch.nn.Module):
    def __init__(self, a, b, dtype=torch.float32, names=("a", "b")):
        super().__init__()
        for name, values in zip(names, (a, b)):
            self.register_parameter(name, torch.nn.Parameter(torch.tensor(values, dtype=dtype),
                                                             requires_grad=False))
        self.w = torch.nn.Parameter(torch.zeros(2, dtype=dtype))


def test_the_frozen_digest_covers_names_and_values_only_of_frozen_tensors():
    base = ckpt.frozen_state(_Frozen([1.0, 2.0], [3.0, 4.0]))
    assert base["keys"] == ["a", "b"]
    swapped = ckpt.frozen_state(_Frozen([3.0, 4.0], [1.0, 2.0]))
    assert swapped["sha256"] != base["sha256"]  # the same bytes under other names
    renamed = ckpt.frozen_state(_Frozen([1.0, 2.0], [3.0, 4.0], names=("a", "c")))
    assert renamed["keys"] == ["a", "c"]
    assert renamed["sha256"] != base["sha256"]  # the same values in order under other names
    other = ckpt.frozen_state(_Frozen([1.0, 2.0], [3.0, 5.0]))
    assert other["sha256"] != base["sha256"]
    trained = _Frozen([1.0, 2.0], [3.0, 4.0])
    with torch.no_grad():
        trained.w.add_(1.0)  # a trainable parameter's values are not part of it
    assert ckpt.frozen_state(trained) == base
    m = _Frozen([1.0], [2.0])
    m.a.requires_grad_(True), m.b.requires_grad_(True)
    assert ckpt.frozen_state(m) is None


def test_the_frozen_digest_is_the_same_for_a_float64_copy_unless_float32_loses_bits():
    f32 = ckpt.frozen_state(_Frozen([0.1, 2.0], [3.0, 4.0]))
    f64 = ckpt.frozen_state(_Frozen([0.1, 2.0], [3.0, 4.0]).double())
    assert f64 == f32
    exact64 = ckpt.frozen_state(_Frozen([0.1, 2.0], [3.0, 4.0], dtype=torch.float64))
    assert exact64["sha256"] != f32["sha256"]  # 0.1 in float64 is not a float32 value
    nudged = _Frozen([0.1, 2.0], [3.0, 4.0], dtype=torch.float64)
    with torch.no_grad():
        nudged.a[0] = torch.tensor(0.1, dtype=torch.float32).double() + 1e-12
    assert ckpt.frozen_state(nudged)["sha256"] != f32["sha256"]


class _Tied(torch.nn.Module):
    def __init__(self, frozen: bool = False):
        super().__init__()
        self.emb = torch.nn.Embedding(5, 3)
        self.mid = torch.nn.Linear(3, 3)
        self.head = torch.nn.Linear(3, 5, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.ones(1))
        if frozen:
            self.emb.weight.requires_grad_(False)


def test_a_tied_parameter_is_stored_once_under_its_first_name():
    model = _Tied()
    sd, aliases = ckpt._dedup(model)
    assert aliases == {"head.weight": "emb.weight"}
    assert set(sd) == {"emb.weight", "mid.weight", "mid.bias", "scale"}
    assert ckpt.frozen_state(_Tied(frozen=True))["keys"] == ["emb.weight", "head.weight"]


def test_capture_leaves_out_every_name_of_a_frozen_tensor_and_keeps_the_rest(monkeypatch):
    monkeypatch.setattr(ckpt, "to_dict", lambda cfg: {})  # (no RunConfig here)
    trainer = types.SimpleNamespace(
        step=0, ledger=types.SimpleNamespace(num_releases=0, to_dict=lambda: {"history": []}),
        model=_Tied(frozen=True), optimizer=types.SimpleNamespace(state_dict=lambda: {}),
        plan=types.SimpleNamespace(), train_size=10, world=1, _privacy_seed=5,
        cfg=types.SimpleNamespace(privacy=types.SimpleNamespace(secure_mode=False)),
        _held_rows=[{"step": 0}], train_seconds=lambda: 1.5, _resumes=2)
    state = ckpt.capture(trainer)
    assert set(state["model"]) == {"mid.weight", "mid.bias", "scale"}
    assert state["frozen"]["keys"] == ["emb.weight", "head.weight"]
    assert state["privacy_seed"] == 5 and state["held_rows"] == [{"step": 0}]
    assert state["cost"] == {"train_seconds": 1.5, "resumes": 2}
    assert state["format"] == 1 and state["world_size"] == 1 and state["train_size"] == 10


def test_placeholders_are_filled_back_in_lists_tuples_and_mappings():
    a, b = torch.ones(2), torch.zeros(3)
    ra, rb = ckpt._Ref("t00000", (2,), a.dtype), ckpt._Ref("t00001", (3,), b.dtype)
    got = ckpt._fill_refs({"x": [ra, (rb, 4)], "y": {"z": ra}, "n": None},
                          {"t00000": a, "t00001": b})
    assert got["x"][0] is a and isinstance(got["x"][1], tuple) and got["x"][1][0] is b
    assert got["x"][1][1] == 4 and got["y"]["z"] is a and got["n"] is None


def test_a_state_tensor_is_walked_with_the_parameter_of_its_name():
    p, q = torch.nn.Parameter(torch.ones(1)), torch.nn.Parameter(torch.ones(2))
    seen = []
    ckpt._walk({"states": [{"p": torch.zeros(1), "q": (torch.zeros(2),)}], "count": 3},
               None, lambda v, owner: seen.append(owner) or v, {"p": p, "q": q})
    assert seen[0] is p and seen[1] is q and len(seen) == 2


def _export_trainer(tmp_path):
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import save_file

    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=1, n_head=2, n_embd=8, n_positions=16, vocab_size=11))
    final = tmp_path / "final"
    final.mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()
               if k != "lm_head.weight"}, str(final / "model.safetensors"))
    return types.SimpleNamespace(model=model, cfg=types.SimpleNamespace(
        model=types.SimpleNamespace(name="gpt2")), task=types.SimpleNamespace()), final


def test_an_hf_export_replaces_an_earlier_one_and_leaves_nothing_beside_it(tmp_path):
    trainer, final = _export_trainer(tmp_path)
    (final / "hf").mkdir()
    (final / "hf" / "earlier.txt").write_text("an earlier export")
    stale = final / f".old-hf-{os.getpid()}"  # left by a kill between the renames
    stale.mkdir()
    (stale / "x").write_text("x")
    hf = ckpt.export_hf(trainer, final)
    assert hf == final / "hf"
    assert sorted(p.name for p in hf.iterdir()) == ["config.json", "model.safetensors"]
    assert sorted(p.name for p in final.iterdir()) == ["hf", "model.safetensors"]
    assert (hf / "model.safetensors").read_bytes() == (final / "model.safetensors").read_bytes()
    assert json.loads((hf / "config.json").read_text())["architectures"] == ["GPT2LMHeadModel"]
    (final / "model.safetensors").unlink()
    assert ckpt.export_hf(trainer, final) is None



def test_an_hf_export_deletes_what_an_export_killed_before_its_rename_left(tmp_path):
    # a SIGKILL between the copy and the rename left final/.tmp-hf-PID (a whole copy of the
    # model) for ever: the next export, with another pid, cleaned only its own name
    trainer, final = _export_trainer(tmp_path)
    killed = final / ".tmp-hf-1"
    killed.mkdir()
    (killed / "model.safetensors").write_bytes(b"a copy")
    ckpt.export_hf(trainer, final)
    assert sorted(p.name for p in final.iterdir()) == ["hf", "model.safetensors"]
