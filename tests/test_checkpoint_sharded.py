"""FSDP-sharded checkpoints (issue 6): written with torch.distributed.checkpoint, every rank its
own shards of the model, the optimizer (Muon momenta as DTensors, AdamW moments) and the
inner-momentum history; rank 0 the rest (meta.pt). Resume on 2 ranks is bit for bit; 2 ranks -> 1
and 1 -> 2 give the same parameters to 1e-5; the ranks verify the checksums in turn and a damaged
shard file is detected by all of them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dptrain.parallel.dist import spawn

pytestmark = pytest.mark.distributed

TINY = str(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml")
ARGS = ["train.progress=false", "privacy.steps=4", "train.checkpoint_every=2",
        "optim.inner_momentum.k_muon=2", "optim.inner_momentum.k_other=2",
        "optim.inner_momentum.gamma_muon=0.9", "performance.sharding=fsdp",
        "model.dropout=0.1",  # per-example dropout masks: world-size invariant
        "optim.ema_decay=0.8"]


def _trainer(out: str, extra: tuple = ()):
    from dptrain.config import load
    from dptrain.trainer import RunConfig, Trainer

    return Trainer(load(RunConfig, TINY, [*ARGS, *extra]), out)


def _full(t) -> dict:
    """The whole model, and the parameter EMA (gathered the same way) under ``ema/``."""
    out = {k: v.clone() for k, v in t.full_state_dict().items()}
    with t.optimizer.ema.swapped_in():
        out.update({f"ema/{k}": v.clone() for k, v in t.full_state_dict().items()})
    return out


def _save_at_2_then_finish(rank: int, world: int, out: str, extra: tuple = ()) -> dict:
    """Two steps, a checkpoint, two more steps: the parameters of the run that never stopped."""
    from dptrain import checkpoint as ckpt

    t = _trainer(out, extra)
    t.private_step()
    t.private_step()
    ckpt.save(t, Path(out))
    t.private_step()
    t.private_step()
    return _full(t)


def _resume_and_finish(rank: int, world: int, out: str, extra: tuple = ()) -> dict:
    from dptrain import checkpoint as ckpt

    t = _trainer(out, extra)
    ckpt.load(t, ckpt.find_latest(Path(out)))
    assert t.step == 2 and t.ledger.num_releases == 2
    t.private_step()
    t.private_step()
    return _full(t)


def _verify_collectively(rank: int, world: int, path: str):
    """Verify; then, for each shard file in turn, a bit flipped in its middle (same size),
    verified again; the first flip is undone, the second left in place."""
    import torch.distributed as dist

    from dptrain import checkpoint as ckpt

    hashed: list[str] = []
    plain = ckpt._sha256

    def recording(f):
        hashed.append(Path(f).name)
        return plain(f)

    def flip(name):
        if rank == 0:
            shard = Path(path) / name
            data = bytearray(shard.read_bytes())
            data[len(data) // 2] ^= 0x10
            shard.write_bytes(bytes(data))
        dist.barrier()

    ckpt._sha256 = recording
    ok = ckpt.verify(Path(path), collective=True)
    seen = list(hashed)
    dist.barrier()
    bad = []
    for name, undo in (("__0_0.distcp", True), ("__1_0.distcp", False)):
        flip(name)
        bad.append(ckpt.verify(Path(path), collective=True))
        if undo:
            flip(name)
    return ok, seen, bad


def _rel(a: dict, b: dict) -> float:
    common = set(a) & set(b)
    assert len(common) >= max(len(a), len(b)) - 1  # tied wte/lm_head may be listed once
    return max(float((a[k].double() - b[k].double()).norm()
                     / b[k].double().norm().clamp_min(1e-12)) for k in common)


def test_dcp_checkpoint_each_rank_writes_its_part_and_reshards(tmp_path):
    from dptrain import checkpoint as ckpt

    ref = _trainer(str(tmp_path / "ref"))
    for _ in range(4):
        ref.private_step()
    want = _full(ref)

    # 2 ranks write a DCP checkpoint at step 2 and run on to step 4
    two = spawn(_save_at_2_then_finish, 2, str(tmp_path / "a"))[0]
    path = ckpt.find_latest(tmp_path / "a")
    assert path is not None and path.name == "step-00000002"
    files = {p.name: p.stat().st_size for p in path.iterdir()}
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "meta.pt", ckpt.MARKER} <= set(files)
    assert "state.pt" not in files  # no rank gathered the whole state
    # each rank wrote its own rows: the two shard files are of comparable size
    assert 0.5 < files["__0_0.distcp"] / files["__1_0.distcp"] < 2.0
    meta = ckpt.read_meta(path)
    assert meta["format"] == 2 and meta["world_size"] == 2 and meta["step"] == 2
    assert len(meta["rng"]["torch_ranks"]) == 2
    # GPT-2's tied lm_head is written once, under wte's name, and restored by read()
    assert meta["model_aliases"] == {"lm_head.weight": "transformer.wte.weight"}
    assert "lm_head.weight" not in meta["model_keys"]
    # assembled in one process: full, plain tensors, the history included
    state = ckpt.read(path)
    assert state["optimizer"]["history"]["states"]
    assert state["optimizer"]["ema"]["count"] == 2
    assert state["optimizer"]["ema"]["values"].keys() == {n for n, _ in ref.named_params}
    n_muon = 0
    for osd in state["optimizer"]["optimizers"]:
        for idx, st in osd["state"].items():
            for k, v in st.items():
                if isinstance(v, torch.Tensor):
                    assert not hasattr(v, "to_local")
                if k == "momentum_buffer" and v.dim() == 2:
                    n_muon += 1
    assert n_muon > 0
    assert state["model"].keys() == {k for k in want if not k.startswith("ema/")}
    for k, v in state["model"].items():
        assert tuple(v.shape) == tuple(want[k].shape), k
    assert torch.equal(state["model"]["lm_head.weight"], state["model"]["transformer.wte.weight"])

    # 2 -> 2: bit for bit; 2 -> 1: to 1e-5 of the one-process run (and of the 2-rank one)
    again = spawn(_resume_and_finish, 2, str(tmp_path / "a"))[0]
    assert two.keys() == again.keys()
    for k in two:
        assert torch.equal(two[k], again[k]), k
    one = _resume_and_finish(0, 1, str(tmp_path / "a"))
    assert _rel(one, want) <= 1e-5 and _rel(two, want) <= 1e-5

    # 1 rank -> 2 ranks (a whole checkpoint re-sharded on load)
    _save_at_2_then_finish(0, 1, str(tmp_path / "b"))
    assert (ckpt.find_latest(tmp_path / "b") / "state.pt").is_file()
    got2 = spawn(_resume_and_finish, 2, str(tmp_path / "b"))[0]
    assert _rel(got2, want) <= 1e-5
    assert torch.isfinite(torch.cat([v.flatten() for v in got2.values()])).all()

    # 2 ranks -> 3 ranks, sharded on load by torch.distributed.checkpoint
    got3 = spawn(_resume_and_finish, 3, str(tmp_path / "a"))[0]
    assert _rel(got3, want) <= 1e-5

    # collective verification: the 2 ranks hash the files in turn (each file once in all);
    # then a bit flipped in a file that only rank 1 hashes, and in one that only rank 0
    # hashes: both ranks reject each
    (ok0, hashed0, bad0), (ok1, hashed1, bad1) = spawn(_verify_collectively, 2, str(path))
    assert ok0 is None and ok1 is None
    names = sorted(p.name for p in path.iterdir() if p.name != ckpt.MARKER)
    assert sorted(hashed0 + hashed1) == names and not set(hashed0) & set(hashed1)
    assert "__0_0.distcp" in hashed1 and "__1_0.distcp" in hashed0
    for name, a, b in zip(("__0_0.distcp", "__1_0.distcp"), bad0, bad1):
        assert a == b and name in a and "checksum mismatch" in a
    problem = ckpt.verify(path)
    assert problem is not None and "__1_0.distcp" in problem
    assert ckpt.find_latest(tmp_path / "a") is None  # the only checkpoint is damaged
    from dptrain.config import ConfigError

    with pytest.raises(ConfigError, match="__1_0.distcp"):
        ckpt.read(path)


def test_a_lora_dcp_checkpoint_leaves_the_frozen_tensors_out_and_resumes(tmp_path):
    """LoRA on 2 FSDP ranks: the checkpoint holds the adapters, the trainable final norm and
    the optimizer state, not the frozen base (its digest instead); 2 -> 2 ranks resumes bit for
    bit, 2 -> 1 to 1e-5, the frozen tensors rebuilt by the run."""
    from dptrain import checkpoint as ckpt

    lora = ("model.lora.r=2", "model.trainable=[ln_f]")
    two = spawn(_save_at_2_then_finish, 2, str(tmp_path / "a"), lora)[0]
    path = ckpt.find_latest(tmp_path / "a")
    meta = ckpt.read_meta(path)
    frozen = set(meta["frozen"]["keys"])
    assert "transformer.wte.weight" in frozen and "lm_head.weight" in frozen
    assert not frozen & set(meta["model_keys"]) and not meta["model_aliases"]
    assert {k for k in meta["model_keys"] if k.endswith(("weight", "bias"))} == {
        k for k in two if not k.startswith("ema/") and (".lora_" in k or "ln_f" in k)}
    again = spawn(_resume_and_finish, 2, str(tmp_path / "a"), lora)[0]
    for k in two:
        assert torch.equal(two[k], again[k]), k
    one = _resume_and_finish(0, 1, str(tmp_path / "a"), lora)
    assert _rel(one, two) <= 1e-5


def _rng_args(sharding: str) -> list[str]:
    secure = ["privacy.secure_mode=true", "privacy.seed=null"] if sharding == "secure" else []
    return ["train.progress=false", "privacy.steps=2",
            f"performance.sharding={'none' if sharding == 'none' else 'fsdp'}", *secure]


def _rng_round_trip(rank: int, world: int, out: str, sharding: str):
    """Ranks whose torch RNGs differ (anything in the model that still draws from it, e.g.
    timm's stochastic depth, draws per rank): a checkpoint and a resume on the same world size
    give every rank its own RNG state back. Returns (that, the state saved)."""
    from dptrain import checkpoint as ckpt
    from dptrain.config import load
    from dptrain.trainer import RunConfig, Trainer

    t = Trainer(load(RunConfig, TINY, _rng_args(sharding)), out)
    torch.manual_seed(1000 + rank)
    t.private_step()
    ckpt.save(t, Path(out))
    want = torch.get_rng_state()
    fresh = Trainer(load(RunConfig, TINY, _rng_args(sharding)), out)
    ckpt.load(fresh, ckpt.find_latest(Path(out)))
    return torch.equal(torch.get_rng_state(), want), want


@pytest.mark.parametrize("sharding", ["none", "fsdp", "secure"])
def test_each_rank_gets_its_own_rng_state_back(tmp_path, sharding):
    from dptrain import checkpoint as ckpt
    from dptrain.config import load
    from dptrain.trainer import RunConfig, Trainer

    out = tmp_path / "run"
    results = spawn(_rng_round_trip, 2, str(out), sharding)
    assert [same for same, _ in results] == [True, True]
    if sharding == "none":
        return
    path = ckpt.find_latest(out)
    meta = ckpt.read_meta(path)
    assert meta["format"] == 2  # sharded
    if sharding == "secure":
        assert meta["privacy_seed"] is None  # secure mode's seed is never written
    # another world size: one process continues rank 0's torch stream
    one = Trainer(load(RunConfig, TINY, _rng_args(sharding)), str(out))
    ckpt.load(one, path)
    assert torch.equal(torch.get_rng_state(), results[0][1])
    assert not torch.equal(results[0][1], results[1][1])


def _rank0_cannot_write(rank: int, world: int, out: str, sharding: str) -> str:
    """Rank 0's checkpoint write fails (a full disk): what each rank's save raises."""
    from dptrain import checkpoint as ckpt
    from dptrain.config import load
    from dptrain.trainer import RunConfig, Trainer

    t = Trainer(load(RunConfig, TINY, _rng_args(sharding)), out)
    t.private_step()

    def full(*a, **k):
        raise OSError(28, "No space left on device")

    if rank == 0:
        ckpt.write = ckpt._seal = full
    try:
        ckpt.save(t, Path(out))
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "returned"


@pytest.mark.parametrize("sharding", ["none", "fsdp"])
def test_a_checkpoint_rank_0_cannot_write_fails_on_every_rank(tmp_path, sharding):
    # the other ranks waited at a barrier for a rank 0 that had left (without torchrun to tear
    # the group down, for ever)
    got = spawn(_rank0_cannot_write, 2, str(tmp_path / "run"), sharding, timeout=120)
    assert got[0] == "OSError: [Errno 28] No space left on device"
    assert got[1].startswith("RuntimeError: dptrain: rank 0 could not write the checkpoint")


def _load_other_width(rank: int, world: int, out: str) -> str:
    """A sharded checkpoint at width 32 loaded into a width-48 model (the config comparison
    bypassed, as for a checkpoint written by something else): what ``load`` raises."""
    from dptrain import checkpoint as ckpt
    from dptrain.config import ConfigError, load
    from dptrain.trainer import RunConfig, Trainer

    t = Trainer(load(RunConfig, TINY, _rng_args("fsdp")), out)
    t.private_step()
    ckpt.save(t, Path(out))
    wide = Trainer(load(RunConfig, TINY, [*_rng_args("fsdp"), "model.n_embd=48"]), out)
    ckpt.check_compatible = lambda *a, **k: []
    try:
        ckpt.load(wide, ckpt.find_latest(Path(out)))
    except ConfigError as e:
        return str(e)
    return "loaded"


def test_a_sharded_checkpoint_whose_model_does_not_fit_names_resume_not_optim(tmp_path):
    # DCP's own shape error came out as "optim: the checkpoint's optimizer (or, sharded,
    # model) state does not fit"; the model's tensors are now checked from its metadata first
    got = spawn(_load_other_width, 2, str(tmp_path / "run"))
    assert got[0] == got[1]
    assert got[0].startswith("resume: checkpoint") and "its model does not fit" in got[0]
    # the first three misfits by name, each with both shapes
    assert "transformer.h.0.attn.c_attn.bias: (96,) in the checkpoint, (144,) here" in got[0]
    assert got[0].count("in the checkpoint, (") == 3


def test_the_dcp_model_check_names_missing_extra_and_reshaped_tensors(tmp_path):
    import torch.distributed.checkpoint as dcp

    from dptrain import checkpoint as ckpt
    from dptrain.config import ConfigError

    path = tmp_path / "c"
    stored = {"a.weight": torch.zeros(3, 4), "b.weight": torch.zeros(2), "gone": torch.zeros(1)}
    dcp.save({"model": stored, "optim": {}}, checkpoint_id=str(path), no_dist=True)
    meta = {"model_keys": list(stored), "model_aliases": {"tied.weight": "a.weight"},
            "frozen": {"keys": ["base.weight"]}}
    mine = {"a.weight": torch.zeros(3, 4), "b.weight": torch.zeros(2),
            "tied.weight": torch.zeros(3, 4), "base.weight": torch.zeros(5)}
    with pytest.raises(ConfigError, match=r"gone: not in this model\)") as e:
        ckpt._check_dcp_model(mine, meta, path)
    assert e.value.field == "resume"
    meta["model_keys"].remove("gone")
    ckpt._check_dcp_model(mine, meta, path)  # the alias and the frozen tensor are left out
    with pytest.raises(ConfigError, match=r"new\.bias: not in the checkpoint\)"):
        ckpt._check_dcp_model({**mine, "new.bias": torch.zeros(1)}, meta, path)
    with pytest.raises(ConfigError, match=r"b\.weight: \(2,\) in the checkpoint, \(3,\) here"):
        ckpt._check_dcp_model({**mine, "b.weight": torch.zeros(3)}, meta, path)
    del meta["frozen"]  # every tensor written: a missing one does not fit
    with pytest.raises(ConfigError, match=r"base\.weight: not in the checkpoint"):
        ckpt._check_dcp_model(mine, meta, path)


def test_shards_dcp_cannot_read_are_one_resume_error_not_a_traceback(tmp_path):
    # DCP's CheckpointException is a BaseException: it went past `except Exception` as a
    # traceback of every rank's traceback, exit 1 (here: one checkpoint's .metadata over
    # another's shard file, which has no bytes where it points)
    import shutil

    import torch.distributed.checkpoint as dcp

    from dptrain import checkpoint as ckpt
    from dptrain.config import ConfigError

    a, b = tmp_path / "a", tmp_path / "b"
    dcp.save({"model": {"w": torch.ones(1000)}, "optim": {}}, checkpoint_id=str(a), no_dist=True)
    dcp.save({"model": {"v": torch.ones(3)}, "optim": {}}, checkpoint_id=str(b), no_dist=True)
    shutil.copy(a / ".metadata", b / ".metadata")
    with pytest.raises(ConfigError) as e:
        ckpt._whole(b, {"format": 2, "model_keys": ["w"]})
    assert e.value.field == "resume" and "cannot read its shards" in str(e.value)
    assert len(str(e.value).splitlines()) == 1 and "CheckpointException" not in str(e.value)
    assert len(str(e.value)) < 500


def test_an_exception_without_a_message_is_named_not_an_index_error():
    from dptrain.messages import brief

    assert brief(KeyError()) == "KeyError"
    assert brief(ValueError("first\nsecond")) == "ValueError: first"


def _save_one_step(rank: int, world: int, out: str, sharding: str) -> None:
    from dptrain import checkpoint as ckpt
    from dptrain.config import load
    from dptrain.trainer import RunConfig, Trainer

    t = Trainer(load(RunConfig, TINY, _rng_args(sharding)), out)
    t.private_step()
    ckpt.save(t, Path(out))


def _load_on_fsdp_ranks(rank: int, world: int, path: str) -> str:
    from dptrain import checkpoint as ckpt
    from dptrain.config import ConfigError, load
    from dptrain.trainer import RunConfig, Trainer

    t = Trainer(load(RunConfig, TINY, _rng_args("fsdp")), str(Path(path).parents[1]))
    try:
        ckpt.load(t, Path(path))
    except ConfigError as e:
        return str(e)
    return "loaded"


def test_sharded_resumes_of_a_foreign_checkpoint_name_what_is_wrong(tmp_path):
    from _forge import forged, rehash

    from dptrain import checkpoint as ckpt

    # a whole checkpoint without one of the model's tensors, resumed on 2 FSDP ranks: that
    # tensor trained on from its initialisation, exit 0 (one rank refused it)
    _save_one_step(0, 1, str(tmp_path / "whole"), "none")
    step_dir = forged(tmp_path / "whole",
                      lambda s: s["model"].pop("transformer.h.1.mlp.c_fc.weight"))
    got = spawn(_load_on_fsdp_ranks, 2, str(step_dir))
    assert got[0] == got[1] and "its model does not fit" in got[0]
    assert "transformer.h.1.mlp.c_fc.weight: not in the checkpoint" in got[0]
    # a DCP shard file DCP cannot read: was "optim: the checkpoint's optimizer state does not
    # fit" on 2 ranks
    spawn(_save_one_step, 2, str(tmp_path / "dcp"), "fsdp")
    step_dir = ckpt.find_latest(tmp_path / "dcp")
    shard = step_dir / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    rehash(step_dir, shard.name)
    got = spawn(_load_on_fsdp_ranks, 2, str(step_dir))
    assert got[0] == got[1] and got[0].startswith(f"resume: checkpoint {step_dir} is unusable: "
                                                  f"cannot read its shards ("), got


def _who_writes_and_says(rank: int, world: int, out: str) -> tuple[int, str]:
    """A 2-step sharded run to its end, then a resume of its checkpoint with another learning
    rate: (the exports this rank made, what this rank's resume said on stderr)."""
    import contextlib
    import io

    from dptrain import checkpoint as ckpt
    from dptrain.config import load
    from dptrain.trainer import RunConfig, Trainer

    t = Trainer(load(RunConfig, TINY, [*_rng_args("fsdp"), "train.checkpoint_every=1"]), out)
    exports, export = [], t.export
    t.export = lambda *a, **k: exports.append(a[0]) or export(*a, **k)
    t.run()
    other = Trainer(load(RunConfig, TINY, [*_rng_args("fsdp"), "optim.lr=0.03"]), out)
    said = io.StringIO()
    with contextlib.redirect_stderr(said):
        ckpt.load(other, ckpt.find_latest(Path(out)))
    return len(exports), said.getvalue()


def test_only_rank_0_writes_the_final_model_and_says_what_a_resume_changes(tmp_path):
    # (every rank takes part in gathering the full state; the files and the notes are one)
    (n0, said0), (n1, said1) = spawn(_who_writes_and_says, 2, str(tmp_path / "run"))
    assert n0 == 1 and n1 == 0
    assert (tmp_path / "run" / "summary.json").is_file()
    assert "optimizer settings differ from the checkpoint's" in said0 and "optim.lr" in said0
    assert said1 == "" and "ranks:" not in said0  # (the same world size)
    # resumed on one process: the sums' order changes with the world size, and the note says
    # so (a red team saw 2 -> 1 and 1 -> 2 differ by 3e-8, unmentioned)
    import contextlib
    import io

    from dptrain import checkpoint as ckpt
    from dptrain.config import load
    from dptrain.trainer import RunConfig, Trainer

    one = Trainer(load(RunConfig, TINY, _rng_args("fsdp")), tmp_path / "run")
    said = io.StringIO()
    with contextlib.redirect_stderr(said):
        ckpt.load(one, ckpt.find_latest(tmp_path / "run"))
    line = [x for x in said.getvalue().splitlines() if "performance settings differ" in x]
    assert len(line) == 1 and "(ranks: 2 -> 1)" in line[0]
