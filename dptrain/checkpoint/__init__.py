"""Atomic, checksummed checkpoints: whole (one process) or sharded (FSDP, DCP).

A checkpoint is a directory ``DIR/checkpoints/step-00000012/``. Unsharded runs write
``state.pt`` (model, optimizer and filter states, the inner-momentum history, the privacy ledger,
the step, RNG states, the resolved config). FSDP-sharded runs write with
torch.distributed.checkpoint, each rank its own shards (``__<rank>_0.distcp``, ``.metadata``) and
rank 0 ``meta.pt`` (everything but the tensors). Either way the files go into a temporary
directory, ``COMPLETE`` (the SHA-256 of every file) last, and the directory is then renamed into
place, so a reader never sees a partial checkpoint; a checkpoint whose marker is missing or
whose checksums do not match is reported and skipped in favour of the previous one. Any world
size loads any checkpoint (DCP re-shards; ``read`` assembles full tensors in one process).

The ledger in a checkpoint counts exactly the releases that produced its parameters. In secure
mode the privacy seed is not stored (resume then draws fresh randomness and says so).

Frozen parameters (``model.lora``, ``model.trainable``) are not written: a run rebuilds them as
it built them (from ``model.pretrained_path``, or the seed), and the checkpoint keeps their
SHA-256 (``frozen``: over each tensor's name, shape and values, so neither the world size
nor a float32/float64 run changes it), which a resume checks before loading the rest. A LoRA run
of a 7B model thus checkpoints its adapters and optimizer state, not 28 GB of base weights.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dptrain.config import ConfigError, said_by_rank_0, shown, to_dict, unused_fields
from dptrain.messages import brief

MARKER = "COMPLETE"
PRIVACY_FIELDS = ("sample_rate", "noise_multiplier", "clip_norm", "dataset_size",
                  "expected_batch_size", "delta", "steps", "adjacency", "epsilon", "accountant")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _root(output_dir: Path) -> Path:
    return Path(output_dir) / "checkpoints"


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _clean_stale(root: Path, *patterns: str) -> None:
    """Temporary directories of writers that died mid-write (``patterns``: ``.tmp-*`` and
    ``.old-*`` unless given). There is one writer per output directory (``dptrain train``
    holds its ``run.lock``) and it calls this before it creates its own, so every one is
    stale, including one named with this process's pid (a restarted container often reuses
    the pid)."""
    for pattern in patterns or (".tmp-*", ".old-*"):
        for p in root.glob(pattern):
            shutil.rmtree(p, ignore_errors=True)


def _test_pause() -> None:
    """Test hook: DPTRAIN_TEST_CHECKPOINT_PAUSE seconds between the data and the marker, so a
    test can SIGKILL the writer in the middle of a checkpoint write."""
    pause = os.environ.get("DPTRAIN_TEST_CHECKPOINT_PAUSE")
    if pause:
        import time

        time.sleep(float(pause))


def frozen_state(model) -> dict[str, Any] | None:
    """The frozen parameters of ``model`` as a checkpoint records them: ``{"keys": their
    state-dict keys (every name of a tied one), "sha256": the digest over (name, shape,
    values) of each, in ``named_parameters`` order}``; None when every parameter trains. The
    values are hashed as float32 when that is exact, so a float32 run and a float64 run of the
    same weights agree. Collective under FSDP (each frozen tensor is gathered in turn: call on
    every rank)."""
    from dptrain.parallel.fsdp import is_sharded

    keys = sorted(n for n, p in model.named_parameters(remove_duplicate=False)
                  if not p.requires_grad)
    if not keys:
        return None
    digest = hashlib.sha256()
    for name, p in model.named_parameters():
        if p.requires_grad:
            continue
        full = (p.full_tensor() if is_sharded(p) else p).detach().to("cpu")
        # the float32 values when they are exact (any float32/bf16/fp16 tensor, and a float64
        # copy of one): the same bytes for a float32 and a float64 run, half of float64's
        values = full.to(torch.float32)
        if full.dtype == torch.float64 and not torch.equal(values.to(torch.float64), full):
            values = full
        values = values.contiguous()
        digest.update(f"{name}:{tuple(values.shape)}:{values.dtype};".encode())
        digest.update(values.numpy().data)
    return {"keys": keys, "sha256": digest.hexdigest()}


def _frozen(trainer) -> dict[str, Any] | None:
    """:func:`frozen_state` of the trainer's model, computed once (frozen tensors never
    change)."""
    if not hasattr(trainer, "_frozen_state"):
        trainer._frozen_state = frozen_state(trainer.model)
    return trainer._frozen_state


def check_frozen(saved: dict[str, Any] | None, mine: dict[str, Any] | None,
                 path: Path) -> None:
    """Refuse to resume onto other frozen tensors than the checkpoint's run trained over (a
    ``model.pretrained_path`` whose files changed): the checkpoint does not hold them."""
    if saved is None:  # every tensor is in the checkpoint
        return
    if mine is None or mine["keys"] != saved["keys"]:
        raise ConfigError("model.trainable", f"checkpoint {path} was written with other frozen "
                                             f"parameters than this model has")
    if mine["sha256"] != saved["sha256"]:
        raise ConfigError("model.pretrained_path",
                          f"the frozen parameters differ from those of the checkpoint's run "
                          f"(SHA-256 {mine['sha256'][:12]}... here, {saved['sha256'][:12]}... "
                          f"in {path}): the checkpoint holds only the trained ones, so a resume "
                          f"needs the same base model (the same pretrained files, or the same "
                          f"seed without them)")


def restore_model(model, state: dict[str, Any], path: Path,
                  frozen: dict[str, Any] | None = None) -> None:
    """Load a whole (unsharded) checkpoint's ``state["model"]`` into ``model``: every key of
    the model except the frozen ones the checkpoint left out (checked to be the same tensors
    first; ``frozen``: :func:`frozen_state` of ``model``, computed when not given)."""
    saved = state.get("frozen")
    if saved is not None:
        check_frozen(saved, frozen_state(model) if frozen is None else frozen, path)
    missing, unexpected = model.load_state_dict(state["model"], strict=False)
    left_out = set(saved["keys"]) if saved is not None else set()
    bad = sorted(set(missing) - left_out) + sorted(unexpected)
    if bad:
        raise ValueError(f"the model's tensors do not match the checkpoint's: "
                         f"{', '.join(bad[:3])}{' ...' if len(bad) > 3 else ''}")


def capture(trainer) -> dict[str, Any]:
    """Everything a run is, as one picklable dict (replicated, unsharded states)."""
    assert trainer.ledger.num_releases == trainer.step, "ledger and step disagree"
    frozen = _frozen(trainer)
    model = trainer.model.state_dict()
    if frozen is not None:
        skip = set(frozen["keys"])
        model = {k: v for k, v in model.items() if k not in skip}
    return {
        "format": 1,
        "model": model,
        "optimizer": trainer.optimizer.state_dict(),
        "rng": {"torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None},
        **_run_state(trainer, frozen),
    }


def _run_state(trainer, frozen: dict[str, Any] | None) -> dict[str, Any]:
    """What both layouts record of the run besides its tensors and RNG states."""
    return {
        "step": trainer.step,
        "frozen": frozen,  # the parameters left out (rebuilt by the run), and their digest
        "ledger": trainer.ledger.to_dict(),
        "plan": vars(trainer.plan),
        "train_size": trainer.train_size,  # N of Poisson sampling (a resume must see the same N)
        "config": to_dict(trainer.cfg),
        "world_size": trainer.world,
        # Secure mode: the seed is never written (exact replay impossible by design).
        "privacy_seed": None if trainer.cfg.privacy.secure_mode else trainer._privacy_seed,
        "held_rows": list(trainer._held_rows),  # (secure mode: rows not yet in metrics.jsonl)
        # the training loop's seconds up to this checkpoint (this process's and those it
        # continues) and the resumes that led to it: summary.json's totals after a resume
        "cost": {"train_seconds": trainer.train_seconds(), "resumes": trainer._resumes},
    }


def write(state: dict[str, Any], output_dir: Path, step: int, keep: int) -> Path:
    """Write ``state`` atomically as ``checkpoints/step-NNNNNNNN`` and prune to ``keep``."""
    root = _root(output_dir)
    root.mkdir(parents=True, exist_ok=True)
    _clean_stale(root)
    name = f"step-{step:08d}"
    tmp = root / f".tmp-{name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    with open(tmp / "state.pt", "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    return _seal(tmp, root, name, step, {}, keep)


def _seal(tmp: Path, root: Path, name: str, step: int, sums: dict[str, str], keep: int) -> Path:
    """Finish a checkpoint written into ``tmp``: the SHA-256 of every file (``sums``: digests
    computed by the ranks that wrote those files), the marker last, rename into place, prune."""
    _test_pause()
    for p in sorted(tmp.iterdir()):
        if p.name not in sums:
            sums[p.name] = _sha256(p)
    with open(tmp / MARKER, "w") as f:  # the marker last: it vouches for every file above
        sizes = {n: (tmp / n).stat().st_size for n in sums}  # a cheap check for truncation
        json.dump({"sha256": sums, "bytes": sizes, "step": step}, f)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    final = root / name
    if final.exists():  # a damaged checkpoint at this step (skipped on resume): move it aside
        old = root / f".old-{name}-{os.getpid()}"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    _fsync_dir(root)
    _prune(root, keep, step)
    return final


def _sharded(trainer) -> bool:
    return trainer.world > 1 and trainer.cfg.performance.sharding == "fsdp"


def _rank_rngs(trainer) -> dict[str, list | None]:
    """Every rank's torch RNG states, gathered (a collective when several ranks): anything in
    the model that still draws from torch's RNG (a random layer outside the counter-based
    masks) draws per rank, so the states differ between ranks, replicated or sharded. CUDA: the
    current device's."""
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
    mine = (torch.get_rng_state(), cuda)
    if trainer.world == 1:
        rngs = [mine]
    else:
        import torch.distributed as dist

        rngs = [None] * trainer.world
        dist.all_gather_object(rngs, mine)
    return {"torch_ranks": [r[0] for r in rngs],
            "cuda_ranks": [r[1] for r in rngs] if cuda is not None else None}


def save(trainer, output_dir: Path) -> Path | None:
    """Checkpoint ``trainer``; call on every rank. Unsharded (one rank, or replicated states):
    rank 0 writes ``state.pt``. FSDP-sharded: torch.distributed.checkpoint, every rank writing
    its own shards (see ``_save_dcp``). Returns the path on rank 0, None elsewhere."""
    if not _sharded(trainer):
        rngs = _rank_rngs(trainer) if trainer.world > 1 else None  # every rank takes part

        def write_whole() -> Path:
            state = capture(trainer)
            if rngs is not None:
                state["rng"].update(rngs)
            return write(state, output_dir, trainer.step, trainer.cfg.train.keep_checkpoints)

        return _on_rank0_for_all(trainer, write_whole)
    return _save_dcp(trainer, Path(output_dir))


def _on_rank0_for_all(trainer, fn) -> Any:
    """``fn()`` on rank 0 (its result there, None elsewhere), every rank returning once it is
    done: after a stop (SIGTERM) the others would otherwise exit while rank 0 writes, and the
    launcher would kill it. Its failure (a full disk) is every rank's: the others raise too,
    rather than wait for a rank that has left (a launcher without torchrun's teardown)."""
    result, error = None, None
    if trainer.rank == 0:
        try:
            result = fn()
        except Exception as e:
            error = e
    if trainer.world > 1:
        from dptrain.parallel.fsdp import all_reduce_scalars

        (failed,) = all_reduce_scalars(float(error is not None), device=trainer.device,
                                       op="max")
        if failed:  # rank 0's refusal (a ConfigError) is every rank's, said by rank 0
            from dptrain.parallel.dist import one_verdict

            one_verdict(error if isinstance(error, ConfigError) else None, True)
        if failed and error is None:
            raise RuntimeError("dptrain: rank 0 could not write the checkpoint (its error is "
                               "on rank 0's stderr)")
    if error is not None:
        raise error
    return result


# ------------------------------------------------------------------ FSDP: re-shard full states

def _param_maps(trainer):
    by_name = dict(trainer.named_params)
    opt_params = [[p for g in opt.param_groups for p in g["params"]]
                  for opt in trainer.optimizer.optimizers]
    return by_name, opt_params


def _is_local_rows(v, p) -> bool:
    """A plain tensor holding this rank's rows of sharded parameter ``p`` (Muon's buffers)."""
    from dptrain.parallel.fsdp import is_sharded

    return (is_sharded(p) and isinstance(v, torch.Tensor) and not is_sharded(v) and v.dim() >= 1
            and tuple(v.shape[1:]) == tuple(p.shape[1:]))


def _to_shard(v, p, local: bool):
    """This rank's part of full state tensor ``v`` of ``p``: a DTensor like ``p`` or (``local``,
    Muon's buffers) plain rows."""
    from torch.distributed.tensor import DTensor

    from dptrain.parallel.dist import shard_bounds
    from dptrain.parallel.fsdp import is_sharded

    if not (isinstance(v, torch.Tensor) and p is not None and is_sharded(p)
            and tuple(v.shape) == tuple(p.shape) and v.dim() >= 1):
        return v
    import torch.distributed as dist

    start, end = shard_bounds(p.shape[0], dist.get_rank(), dist.get_world_size())
    rows = v[start:end].to(device=p.to_local().device).contiguous()
    if local:
        return rows
    return DTensor.from_local(rows, p.device_mesh, p.placements, run_check=False,
                              shape=p.shape, stride=p.stride())


def _walk(obj, p, fn, by_name):
    if isinstance(obj, dict):
        return {k: _walk(v, by_name.get(k, p) if isinstance(k, str) else p, fn, by_name)
                for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_walk(v, p, fn, by_name) for v in obj)
    if isinstance(obj, (torch.Tensor, _Ref)):
        return fn(obj, p)
    return obj


def _map_optimizer(trainer, sd: dict, fn_opt, fn_other) -> dict:
    """Apply ``fn_opt(i_opt, v, p)`` to torch-optimizer state tensors and ``fn_other(v, p)`` to
    filter, history and EMA tensors (p: the parameter the tensor belongs to, found by name or
    index)."""
    trainer.optimizer.check_groups(sd)  # before indexing this run's optimizers by the saved
    by_name, opt_params = _param_maps(trainer)
    out = dict(sd)
    out["optimizers"] = []
    for i, osd in enumerate(sd["optimizers"]):
        params = opt_params[i]
        state = {idx: {k: (fn_opt(i, v, params[idx]) if isinstance(v, (torch.Tensor, _Ref))
                           else v)
                       for k, v in sorted(st.items())}
                 for idx, st in sorted(osd["state"].items())}
        out["optimizers"].append({**osd, "state": state})
    for key in ("filter", "history", "ema"):
        if sd.get(key) is not None:
            out[key] = _walk(sd[key], None, fn_other, by_name)
    return out


def _load_sharded(trainer, state: dict, path: Path) -> None:
    """Load a whole checkpoint (``state`` from :func:`_whole`) into a sharded run: each rank
    takes its rows of every tensor."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                         get_model_state_dict,
                                                         set_model_state_dict)

    _check_model_fits(get_model_state_dict(trainer.model),
                      {k: tuple(v.shape) for k, v in state["model"].items()},
                      _left_out(state), path)
    set_model_state_dict(trainer.model, state["model"],
                         options=StateDictOptions(full_state_dict=True, strict=False))
    local = [getattr(opt, "local_state_rows", False) for opt in trainer.optimizer.optimizers]
    optim = _map_optimizer(trainer, state["optimizer"],
                           lambda i, v, p: _to_shard(v, p, local[i]),
                           lambda v, p: _to_shard(v, p, False))
    trainer.optimizer.load_state_dict(optim)


# ------------------------------------------------------------------ FSDP: DCP, one part per rank

@dataclass(frozen=True)
class _Ref:
    """Stands in ``meta.pt`` for an optimizer/filter/history tensor stored by DCP under ``key``
    (``shape``: the global shape)."""
    key: str
    shape: tuple
    dtype: torch.dtype


def _dcp_tensor(v, p):
    """What DCP stores for state tensor ``v`` of parameter ``p``: DTensors as they are; Muon's
    local row shards wrapped as the DTensor they are a shard of; anything else (replicated:
    scalars, states of unsharded parameters) as it is (DCP writes one copy)."""
    from torch.distributed.tensor import DTensor

    from dptrain.parallel.fsdp import is_sharded

    if is_sharded(v):
        return v
    if p is not None and _is_local_rows(v, p):
        return DTensor.from_local(v, p.device_mesh, p.placements, run_check=False,
                                  shape=p.shape, stride=p.stride())
    return v


def _save_dcp(trainer, output_dir: Path) -> Path | None:
    """Sharded checkpoint with torch.distributed.checkpoint: every rank writes its own shards
    (``__<rank>_0.distcp``; DCP's planner writes replicated tensors once), rank 0 the rest of the
    run (``meta.pt``: step, ledger, plan, config, per-rank RNG states, the optimizer's structure
    with ``_Ref`` placeholders). Same atomicity as ``write``: a temporary directory, each rank's
    SHA-256 of its own files gathered to rank 0, which writes ``COMPLETE`` last and renames."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    assert trainer.ledger.num_releases == trainer.step, "ledger and step disagree"
    rank, step = trainer.rank, trainer.step
    root = _root(output_dir)
    name = f"step-{step:08d}"
    tag = [os.getpid()]
    dist.broadcast_object_list(tag, src=0)  # the temporary name: rank 0's pid (as ``write``)
    tmp = root / f".tmp-{name}-{tag[0]}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        _clean_stale(root)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    dist.barrier()

    tensors: dict[str, Any] = {}

    def put(v, p):
        key = f"t{len(tensors):05d}"  # same traversal order on every rank
        tensors[key] = _dcp_tensor(v, p)
        return _Ref(key, tuple(tensors[key].shape), v.dtype)  # a DTensor's shape is global

    optim = _map_optimizer(trainer, trainer.optimizer.state_dict(),
                           lambda i, v, p: put(v, p), put)
    model, aliases = _dedup(trainer.model)
    frozen = _frozen(trainer)  # collective: every rank
    if frozen is not None:  # not written: the run rebuilds them (tied names: both frozen)
        skip = set(frozen["keys"])
        model = {k: v for k, v in model.items() if k not in skip}
        aliases = {k: v for k, v in aliases.items() if k not in skip}
    dcp.save({"model": model, "optim": tensors}, checkpoint_id=str(tmp))
    rngs = _rank_rngs(trainer)
    mine = {f.name: _sha256(f) for f in sorted(tmp.glob(f"__{rank}_*.distcp"))}
    sums = [None] * trainer.world
    dist.all_gather_object(sums, mine)

    def seal() -> Path:
        # every rank writes its shards into output_dir: one the nodes do not share (a
        # node-local path, or a relative one from other working directories) lacks the others'
        # here (was a FileNotFoundError's traceback)
        missing = [(r, n) for r, files in enumerate(sums) if r != rank for n in files
                   if not (tmp / n).exists()]
        if missing:
            r, n = missing[0]
            raise ConfigError("output-dir", f"rank {r}'s shard {n} of the checkpoint is not in "
                                            f"{tmp} as rank 0 sees it: with "
                                            "performance.sharding=fsdp every rank writes its "
                                            "shards there, so --output-dir must be one "
                                            "directory that every node shares (a node-local "
                                            "path, or a relative one from other working "
                                            "directories?)")
        meta = {
            "format": 2,
            "optimizer": optim,
            "model_keys": list(model),
            "model_aliases": aliases,  # tied names (GPT-2's lm_head.weight -> wte's), stored once
            "rng": {"torch": rngs["torch_ranks"][0], "cuda": None, **rngs},
            **_run_state(trainer, frozen),
        }
        with open(tmp / "meta.pt", "wb") as f:
            torch.save(meta, f)
            f.flush()
            os.fsync(f.fileno())
        return _seal(tmp, root, name, step, {k: v for s in sums for k, v in s.items()},
                     trainer.cfg.train.keep_checkpoints)

    return _on_rank0_for_all(trainer, seal)


def _dedup(model) -> tuple[dict, dict[str, str]]:
    """``model``'s state dict with each tied parameter once (under its first name) and
    {dropped name: kept name} (GPT-2: lm_head.weight -> transformer.wte.weight)."""
    sd = model.state_dict()
    first: dict[int, str] = {}
    aliases = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first and n in sd:
            aliases[n] = first[id(p)]
        first.setdefault(id(p), n)
    return {k: v for k, v in sd.items() if k not in aliases}, aliases


def _dcp_full(path: Path) -> dict[str, Any]:
    """Every tensor of a DCP checkpoint as a full (unsharded) CPU tensor, in this process only
    (no collectives): ``{"model": {...}, "optim": {...}}``."""
    # As DCP's own converter (format_utils.dcp_to_torch_save) does it, without the file.
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    out: dict[str, Any] = {}
    _load_state_dict(out, storage_reader=FileSystemReader(str(path)),
                     planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    return out


def _fill_refs(obj, tensors: dict):
    if isinstance(obj, _Ref):
        return tensors[obj.key]
    if isinstance(obj, dict):
        return {k: _fill_refs(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_fill_refs(v, tensors) for v in obj)
    return obj


def _misfit(path: Path, detail: str) -> ConfigError:
    """The error of a checkpoint whose model is not this run's (either layout)."""
    return ConfigError("resume", f"checkpoint {path}: its model does not fit this run's "
                                 f"({detail}); resume needs the same model and data settings "
                                 f"(a classifier's head: data.num_classes)")


def _check_model_fits(model: dict, saved: dict, left_out: set, path: Path) -> None:
    """Refuse a checkpoint whose model tensors (``saved``: name -> global shape) are not
    ``model``'s (name -> tensor, global shapes): a key this model lacks, one it has that the
    checkpoint neither holds nor left out (``left_out``: tied aliases, frozen tensors), or
    another shape. For the sharded loads, which read the model and the optimizer together:
    without this, a misfit came out as the optimizer's, or (a whole checkpoint missing a
    tensor) loaded without it."""
    bad = [f"{k}: not in this model" for k in sorted(set(saved) - set(model))]
    bad += [f"{k}: not in the checkpoint" for k in sorted(set(model) - set(saved) - left_out)]
    for k in sorted(set(saved) & set(model)):
        if saved[k] is not None and tuple(saved[k]) != tuple(model[k].shape):
            bad.append(f"{k}: {tuple(saved[k])} in the checkpoint, {tuple(model[k].shape)} here")
    if bad:
        raise _misfit(path, "; ".join(bad[:3]) + (" ..." if len(bad) > 3 else ""))


def _left_out(state: dict) -> set:
    """The model tensors a checkpoint does not hold: its frozen ones (rebuilt by the run)."""
    return set((state.get("frozen") or {}).get("keys", ()))


def _check_dcp_model(model: dict, meta: dict, path: Path) -> None:
    """:func:`_check_model_fits` of a DCP checkpoint, its shapes read from its metadata
    (before any collective load); its tied aliases are stored once."""
    from torch.distributed.checkpoint import FileSystemReader

    stored = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    saved = {k: getattr(stored.get(f"model.{k}"), "size", None) for k in meta["model_keys"]}
    _check_model_fits(model, saved, set(meta.get("model_aliases") or {}) | _left_out(meta),
                      path)


def _load_dcp_sharded(trainer, meta: dict, path: Path) -> None:
    """Load a DCP checkpoint into a sharded run of any world size: DCP reads each rank's rows
    of every tensor from whichever files hold them (re-sharding)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                         get_model_state_dict,
                                                         set_model_state_dict)
    from torch.distributed.tensor import DTensor

    from dptrain.parallel.dist import shard_bounds
    from dptrain.parallel.fsdp import is_sharded

    model = get_model_state_dict(trainer.model)
    _check_dcp_model(model, meta, path)
    saved = set(meta["model_keys"])  # without the frozen tensors, when it left them out
    model = {k: v for k, v in model.items() if k in saved}
    targets: dict[str, Any] = {}
    rank, world = dist.get_rank(), dist.get_world_size()

    def target(ref, p):
        if p is not None and is_sharded(p) and tuple(ref.shape) == tuple(p.shape):
            start, end = shard_bounds(p.shape[0], rank, world)
            local = torch.empty((end - start, *p.shape[1:]), dtype=ref.dtype,
                                device=p.to_local().device)
            t = DTensor.from_local(local, p.device_mesh, p.placements, run_check=False,
                                   shape=p.shape, stride=p.stride())
        else:
            dev = p.to_local().device if p is not None and is_sharded(p) else (
                p.device if p is not None else "cpu")
            t = torch.empty(ref.shape, dtype=ref.dtype, device=dev)
        targets[ref.key] = t
        return ref

    _map_optimizer(trainer, meta["optimizer"], lambda i, v, p: target(v, p), target)
    try:
        dcp.load({"model": model, "optim": targets}, checkpoint_id=str(path))
    except CheckpointException as e:  # (the model's names and shapes are checked above)
        raise ConfigError("resume", f"checkpoint {path} is unusable: cannot read its shards "
                                    f"({brief(e)})") from None
    set_model_state_dict(trainer.model, model, options=StateDictOptions(strict=False))
    local = [getattr(opt, "local_state_rows", False) for opt in trainer.optimizer.optimizers]

    def fill(i, ref, p):
        t = targets[ref.key]
        return t.to_local() if local[i] and is_sharded(t) else t

    optim = _map_optimizer(trainer, meta["optimizer"], fill, lambda ref, p: targets[ref.key])
    trainer.optimizer.load_state_dict(optim)


def has_step_dirs(output_dir: Path) -> bool:
    """Whether ``output_dir`` holds any ``step-*`` checkpoint directory, intact or not."""
    return bool(_step_dirs(_root(output_dir)))


def _marked(root: Path) -> list[Path]:
    """``root``'s checkpoint directories that carry a COMPLETE marker, oldest first."""
    return [p for p in _step_dirs(root) if (p / MARKER).exists()]


def _step_dirs(root: Path) -> list[Path]:
    """``root``'s ``step-NNNNNNNN`` directories by step number, oldest first (the 8-digit names
    sort as text only below 10^8 steps). Other names (``step-00000100-backup``, a person's copy)
    are not this writer's: never resumed from, counted or pruned."""
    return sorted((p for p in Path(root).glob("step-*") if step_of(p) is not None),
                  key=lambda p: (step_of(p), p.name))


def step_of(path: Path) -> int | None:
    """The step of a checkpoint directory named ``step-NNNNNNNN`` (None for another name)."""
    m = re.fullmatch(r"step-(\d+)", Path(path).name)
    return int(m.group(1)) if m else None


def _marker_step(path: Path) -> int | None:
    """The step that a checkpoint's marker records (None: no marker, or none recorded)."""
    try:
        step = json.loads((Path(path) / MARKER).read_text()).get("step")
    except (OSError, ValueError, AttributeError):
        return None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def checkpoint_step(path: Path) -> int | None:
    """The step a checkpoint holds: its marker's (which a renamed or copied directory keeps),
    else its name's (``step-NNNNNNNN``); None when neither says."""
    step = _marker_step(path)
    return step if step is not None else step_of(path)


def complete_steps(run_dir: Path) -> list[int]:
    """Steps of the run's checkpoints that carry a COMPLETE marker (checksums not verified)."""
    return sorted(s for s in map(step_of, _marked(Path(run_dir) / "checkpoints")) if s is not None)


def written_steps(run_dir: Path) -> list[int]:
    """Steps of all the run's ``step-NNNNNNNN`` checkpoint directories, with a marker or not: a
    directory gets its name only once its marker is written (the rename comes last), so even
    one whose marker was lost since was written, and its step's release with it."""
    return sorted(s for s in map(step_of, _step_dirs(Path(run_dir) / "checkpoints"))
                  if s is not None)


def _prune(root: Path, keep: int, newest: int) -> None:
    """After writing the checkpoint of step ``newest``: keep it and the ``keep`` - 1 before it.
    Checkpoints of later steps go first: they belong to steps this run is drawing again (it
    resumed from an earlier checkpoint because ``--resume auto`` found them damaged; a later
    complete one refuses the resume), and counted among the newest they would make the one just
    written the first deleted."""
    for d in _step_dirs(root):
        if (step_of(d) or 0) > newest:
            shutil.rmtree(d, ignore_errors=True)
    for old in _marked(root)[:-max(keep, 1)]:
        shutil.rmtree(old, ignore_errors=True)


def _well_formed(sums, sizes) -> bool:
    """A marker's checksums: plain file names (one of them ``state.pt`` or ``meta.pt``) to
    64-digit hex digests; its sizes: names to non-negative integers."""
    def plain(name) -> bool:
        return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name \
            and "\\" not in name

    return (isinstance(sums, dict) and isinstance(sizes, dict)
            and ("state.pt" in sums or "meta.pt" in sums)
            and all(plain(k) and isinstance(v, str) and re.fullmatch(r"[0-9a-f]{64}", v)
                    for k, v in sums.items())
            and all(plain(k) and type(v) is int and v >= 0 for k, v in sizes.items()))


def _quick_check(path: Path) -> tuple[str | None, dict[str, str]]:
    """(problem or None, the marker's checksums): the marker, and each file's presence and
    size, without hashing."""
    marker = path / MARKER
    if not marker.is_file():
        return "incomplete (no COMPLETE marker)", {}
    try:
        info = json.loads(marker.read_text())
        sums, sizes = info["sha256"], info.get("bytes", {})
    except Exception:
        return "corrupt COMPLETE marker", {}
    if not _well_formed(sums, sizes):
        # valid JSON of another shape (or vouching for no state): never indexed as if it were
        return "corrupt COMPLETE marker", {}
    for fname in sorted(sums):
        f = path / fname
        if not f.is_file():
            return f"missing file {fname}", sums
        if fname in sizes and f.stat().st_size != sizes[fname]:
            return (f"{fname} has {f.stat().st_size} bytes, the marker says {sizes[fname]}: "
                    "the file is truncated or was overwritten"), sums
    return None, sums


def verify(path: Path, *, shallow: bool = False, collective: bool = False) -> str | None:
    """None if the checkpoint at ``path`` is complete and intact, else the reason.

    ``shallow``: only the marker, the files' presence and sizes (no hashing). ``collective``
    (every rank of the default process group calls it): the files are hashed by the ranks in
    turn, file i by rank i mod W, and the verdict is shared, so N ranks read the checkpoint
    once between them instead of N times; every rank takes part in the exchange whatever it
    sees (a rank whose view of a shared file system lags must not leave the others waiting).
    Without a process group, the same as the default."""
    from dptrain.parallel.dist import get_rank, get_world_size

    path = Path(path)
    rank, world = (get_rank(), get_world_size()) if collective else (0, 1)
    problem, sums = _quick_check(path)
    if problem is None and not shallow:
        for fname in sorted(sums)[rank::world]:
            f = path / fname
            if _sha256(f) != sums[fname]:
                problem = (f"checksum mismatch in {fname} ({f.stat().st_size} bytes): the file "
                           "is truncated or corrupted")
                break
    if world > 1:
        import torch.distributed as dist

        problems = [None] * world
        dist.all_gather_object(problems, problem)
        problem = next((p for p in problems if p is not None), None)
    return problem


def find_latest(output_dir: Path, *, shallow: bool = False, collective: bool = False,
                quiet: bool = False) -> Path | None:
    """Newest complete, intact checkpoint; damaged ones are reported on stderr (unless
    ``quiet``; by rank 0 only when ``collective``) and skipped. ``shallow``, ``collective``:
    see ``verify``; collectively, every rank tries rank 0's list of checkpoints."""
    from dptrain.parallel.dist import get_rank, get_world_size

    root = _root(output_dir)
    dirs = [str(d) for d in _step_dirs(root)]
    if collective and get_world_size() > 1:
        import torch.distributed as dist

        shared = [dirs]
        dist.broadcast_object_list(shared, src=0)
        dirs = shared[0]
    for path in map(Path, reversed(dirs)):
        problem = verify(path, shallow=shallow, collective=collective)
        if problem is None:
            return path
        if not quiet and (not collective or get_rank() == 0):
            print(f"dptrain: skipping damaged checkpoint {path}: {problem}; trying the "
                  "previous one", file=sys.stderr)
    return None


#: model/data settings a resume may change: where the files are (a copy staged to another
#: disk, a node-local scratch directory of a new job), and what the test split is. They change
#: neither the training set that is sampled nor the model: its size N is checked
#: (``check_same_data``), the weights come from the checkpoint. The training set's contents are
#: not compared: a checksum of the private data written into every checkpoint would be a function
#: of that data outside the guarantee (it would confirm a guessed record).
RELOCATABLE = frozenset({("data", "path"), ("data", "test_file"), ("data", "max_test_examples"),
                         ("data", "index_cache_dir"), ("model", "pretrained_path")})


def check_compatible(saved_cfg: dict, cfg, source: str = "the checkpoint",
                     needs: str = "a resumed run keeps its {}") -> list[str]:
    """ConfigError naming the first setting that a resume may not change; else the
    :data:`RELOCATABLE` settings that differ, as ``section.key: old -> new`` lines. ``source``
    names where ``saved_cfg`` was read, and ``needs`` (formatted with what is kept) why the
    setting must be the same, in the messages."""
    # both sides as JSON would give them: summary.json's config (a finished run) has lists
    # where a checkpoint's has tuples
    saved_cfg = _plain(saved_cfg)
    saved = saved_cfg.get("privacy", {})
    current = _plain(to_dict(cfg.privacy))
    for key in PRIVACY_FIELDS:
        if saved.get(key) != current.get(key):
            raise ConfigError(f"privacy.{key}",
                              f"differs from {source} ({shown(saved.get(key))} there, "
                              f"{shown(current.get(key))} now): "
                              + needs.format("privacy settings"))
    if saved.get("secure_mode") != current.get("secure_mode"):
        raise ConfigError("privacy.secure_mode", f"differs from {source}")
    if not cfg.privacy.secure_mode and saved.get("seed") != current.get("seed"):
        raise ConfigError("privacy.seed", f"differs from {source}")
    if saved_cfg.get("seed") != cfg.seed:
        # the run's seed: synthetic data, dropout, augmentation and probe streams
        raise ConfigError("seed", f"differs from {source} ({shown(saved_cfg.get('seed'))} "
                                  f"there, {shown(cfg.seed)} now): " + needs.format("seed"))
    saved_filter = ((saved_cfg.get("optim") or {}).get("filter") or {}).get("name", "none")
    filt = cfg.optim.filter.name
    # turning a filter on or off is allowed (its state starts empty, or is left unused)
    if "none" not in (saved_filter, filt) and saved_filter != filt:
        raise ConfigError("optim.filter.name", f"{filt} here, {saved_filter} in {source}: "
                                               + needs.format("filter") + " (turning one on or "
                                               "off is allowed)")
    moved = []
    for section in ("model", "data"):
        was, now = saved_cfg.get(section) or {}, _plain(to_dict(getattr(cfg, section)))
        # a field added after the checkpoint was written (model.lora, model.trainable): its
        # run had the field's default behaviour
        defaults = _plain(to_dict(type(getattr(cfg, section))()))
        was = {**{k: v for k, v in defaults.items() if k not in was}, **was}
        # fields the run's kind does not read (the same kind on both sides, or "name" differs):
        # ignored then and now, e.g. the gpt2 shape a cnn run was configured with before such
        # settings were refused
        unused = unused_fields(getattr(cfg, section))
        keys = sorted(k for k in set(was) | set(now) if was.get(k) != now.get(k)
                      and k not in unused)
        moved += [f"{section}.{k}: {shown(was.get(k))} -> {shown(now.get(k))}" for k in keys
                  if (section, k) in RELOCATABLE]
        keys = [k for k in keys if (section, k) not in RELOCATABLE]
        if keys:
            key = keys[0]
            raise ConfigError(f"{section}.{key}", f"differs from {source} ({shown(was.get(key))} "
                                                  f"there, {shown(now.get(key))} now): "
                                                  + needs.format(f"{section} settings"))
    return moved


def section_changes(saved_cfg: dict, cfg, section: str = "optim",
                    skip: frozenset[str] = frozenset()) -> list[str]:
    """The settings of ``section`` (``optim`` or ``performance``: a resume may change them) that
    differ from the checkpoint's config, as ``section.key.sub: old -> new`` lines; ``(not set)``
    stands for a key that one side lacks (an entry of a group's kwargs, or a setting newer than
    the checkpoint). Top-level keys in ``skip`` are left out."""
    def flat(d: dict, prefix: str = f"{section}.") -> dict:
        out = {}
        for k, v in d.items():
            if isinstance(v, dict):  # (an empty mapping sets nothing)
                out.update(flat(v, f"{prefix}{k}."))
            elif isinstance(v, list) and (not v or any(isinstance(x, dict) for x in v)):
                # (a group's entries by name: their order in its mapping is not a setting;
                # an empty list, like an empty mapping, sets nothing)
                for i, x in enumerate(v):
                    if isinstance(x, dict):
                        out.update(flat(x, f"{prefix}{k}[{i}]."))
                    else:
                        out[f"{prefix}{k}[{i}]"] = shown(x)
            else:
                out[f"{prefix}{k}"] = shown(v)
        return out

    def kept(d: dict) -> dict:
        return {k: v for k, v in d.items() if k not in skip}

    was = flat(kept(_plain(saved_cfg.get(section) or {})))
    now = flat(kept(_plain(to_dict(getattr(cfg, section)))))
    return [f"{k}: {was.get(k, '(not set)')} -> {now.get(k, '(not set)')}"
            for k in sorted(set(was) | set(now)) if was.get(k) != now.get(k)]


def _plain(d):
    """``d`` through a JSON round trip (tuples become lists, other objects strings)."""
    return json.loads(json.dumps(d, default=str))


def check_same_data(state: dict, trainer) -> None:
    """The same data settings can name files whose contents changed (rows added to a CSV, a
    shard added to a folder). Poisson sampling is over N = the training set's size, and b and
    the calibration were derived from it: a resume over another N would sample another
    population with another mechanism."""
    saved_n = state.get("train_size")  # absent in checkpoints written before 2026-11-30
    plan = state.get("plan") or {}
    for what, was, now in (("training set size", saved_n, trainer.train_size),
                           ("release denominator b", plan.get("denominator"),
                            trainer.plan.denominator),
                           ("dataset size N", plan.get("dataset_size"),
                            trainer.plan.dataset_size)):
        if was is not None and was != now:
            raise ConfigError("data", f"the {what} is {now} now but {was} in the checkpoint "
                                      "(the data files changed since): a resume must sample "
                                      "the same training set")


def read_meta(path: Path, verified: bool = False) -> dict[str, Any]:
    """The verified checkpoint at ``path`` without the tensors DCP holds: ``state.pt`` (whole
    checkpoints) or ``meta.pt`` (sharded ones, ``format`` 2, optimizer tensors as ``_Ref``).
    ConfigError("resume") if unusable. ``verified``: the caller has just verified the
    checksums (``find_latest``); skip the second pass."""
    path = Path(path)
    problem = None if verified else verify(path)
    if problem is not None:
        raise ConfigError("resume", f"checkpoint {path} is unusable: {problem}")
    name = "meta.pt" if (path / "meta.pt").is_file() else "state.pt"
    try:
        state = torch.load(path / name, map_location="cpu", weights_only=False)
    except Exception as e:  # intact checksums but unreadable: written by something else
        raise ConfigError("resume", f"checkpoint {path} is unusable: cannot read {name} "
                                    f"({brief(e)})") from None
    if not isinstance(state, dict):
        what = f"holds a {type(state).__name__}"
    elif missing := [k for k in _REQUIRED if k not in state]:
        what = f"lacks {', '.join(missing)}"
    elif not isinstance(state["config"], dict):
        what = "has no config mapping"
    elif type(state["step"]) is not int or state["step"] < 0:
        what = f"has step {state['step']!r}, not a non-negative integer"
    elif (marked := _marker_step(path)) is not None and marked != state["step"]:
        # the marker's step is what --resume auto, the output-directory and the secure-mode
        # guards go by
        what = f"holds step {state['step']}, but its {MARKER} says step {marked}"
    else:
        return state
    raise ConfigError("resume", f"checkpoint {path} is unusable: its {name} {what}; it was not "
                                "written by dptrain train")


_REQUIRED = ("step", "optimizer", "ledger", "config", "rng")
"""What :func:`read_meta` requires of a state.pt / meta.pt before anything reads it (``save``
writes more, which :func:`load` checks as it reads it)."""


def read(path: Path, verified: bool = False) -> dict[str, Any]:
    """The verified checkpoint at ``path`` as one dict of full (unsharded) CPU tensors, whatever
    its format: a sharded checkpoint is assembled in this process (no collectives)."""
    return _whole(Path(path), read_meta(path, verified))


def _whole(path: Path, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` (from ``read_meta``) with the tensors of a sharded checkpoint filled in."""
    if state.get("format") != 2:
        return state
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        tensors = _dcp_full(path)
    except (Exception, CheckpointException) as e:  # (DCP's is a BaseException)
        raise ConfigError("resume", f"checkpoint {path} is unusable: cannot read its "
                                    f"shards ({brief(e)})") from None
    model = {k: tensors["model"][k] for k in state.pop("model_keys")}
    for dropped, kept in state.pop("model_aliases", {}).items():
        model[dropped] = model[kept]
    state["model"] = model
    state["optimizer"] = _fill_refs(state["optimizer"], tensors["optim"])
    state["format"] = 1
    return state


def _check_ledger(ledger, trainer, path: Path) -> None:
    """Refuse a ledger whose releases the run cannot have made, by bounds from this run's
    config alone (the checkpoint's own plan is no bound: it can be edited with the ledger).
    Each release's sampling rate must be the plan's; its sigma at most the plan's when
    ``privacy.noise_multiplier`` is given, else at most :data:`SIGMA_DRIFT` above the sigma
    calibrated here (another dptrain or opacus version calibrates the same target to a
    slightly different sigma). A larger sigma or a smaller rate would have the accountant
    report less than was spent."""
    plan = trainer.plan
    given = trainer.cfg.privacy.noise_multiplier is not None
    top = plan.noise_multiplier * (1.0 if given else 1.0 + SIGMA_DRIFT)
    for sigma, q, n in ledger.history:
        if q != plan.sample_rate or sigma > top:
            raise ConfigError("resume", f"checkpoint {path} is inconsistent: its ledger records "
                                        f"{n} release(s) at noise multiplier {sigma!r} and "
                                        f"sampling rate {q!r}, which this run's privacy "
                                        f"settings cannot give (at most {top!r}, and "
                                        f"{plan.sample_rate!r}): it was edited, or written "
                                        f"by a version that calibrates sigma otherwise "
                                        f"(resume with that version)")


SIGMA_DRIFT = 0.01
"""How far above the sigma calibrated here a checkpoint's ledger may record a release (1%:
versions calibrate the same target to 0.01 in epsilon, which moves sigma by far less). An
edited ledger within it under-reports epsilon by about 2% at most."""


def load(trainer, path: Path, verified: bool = False) -> None:
    """Continue ``trainer`` from the checkpoint at ``path`` (any format, any world size);
    ``verified``: ``path`` comes from ``find_latest`` just now (checksums not hashed again)."""
    path = Path(path)
    if not verified:  # the ranks hash the files in turn
        problem = verify(path, collective=trainer.world > 1)
        if problem is not None:
            raise ConfigError("resume", f"checkpoint {path} is unusable: {problem}")
    if trainer.world > 1:  # (before the first collective whose shape the checkpoint sets)
        try:
            state, problem = read_meta(path, verified=True), None
        except ConfigError as e:  # (refused on every rank: one alone left the others waiting)
            state, problem = {}, e
        _check_ranks_resume_alike(state, path, problem)
    else:
        state = read_meta(path, verified=True)
    from dptrain.parallel.dist import one_verdict

    try:
        moved, problem = check_compatible(state["config"], trainer.cfg), None
        check_same_data(state, trainer)
    except ConfigError as e:
        moved, problem = [], e
    # one verdict, said once by rank 0 (every rank compares the same config and checkpoint;
    # each printed the same line before)
    one_verdict(problem, trainer.world > 1)
    if moved and trainer.rank == 0:
        print(f"dptrain train: resuming with other files or test settings than the checkpoint's "
              f"({'; '.join(moved)}); the training set must be the same (its size is checked, "
              f"its contents are not)", file=sys.stderr)
    ledger = _checked_ledger(trainer, state, path)
    # the tensors a checkpoint left out (frozen) must be the ones rebuilt here (collective
    # under FSDP: every rank)
    check_frozen(state.get("frozen"), _frozen(trainer), path)
    cost = _checked_cost(state.get("cost", {}), path)
    if not trainer.cfg.privacy.secure_mode and state.get("privacy_seed") != trainer._privacy_seed:
        # (privacy.seed is compared with the config above: a checkpoint written by something
        # else; never an assert, which python -O removes)
        raise ConfigError("resume", f"checkpoint {path} is unusable: its privacy seed is not "
                                    f"this run's (privacy.seed); it was not written by "
                                    f"dptrain train for this config")
    # every check made: from here on the trainer is changed (a refusal above leaves it whole)
    state = _load_tensors(trainer, state, path)
    if trainer.rank == 0:
        _report_changes(trainer, state)
    trainer.ledger = ledger
    trainer.step = state["step"]
    out = trainer.output_dir
    if out is not None and path.resolve().parent == _root(out).resolve():
        # this run's own checkpoint: its held rows go where a kill after its seal lost them
        # (a branch into another directory starts its rows afresh)
        trainer._resumed_rows = list(state.get("held_rows") or [])
    _restore_rngs(trainer, state)
    trainer._trained_before = cost.get("train_seconds")  # (None: an older dptrain's checkpoint)
    trainer._resumes = cost.get("resumes", 0) + 1
    if "train_seconds" not in cost and trainer.rank == 0:
        print(f"dptrain: {path} does not record the training time before it (an older "
              f"dptrain wrote it): metrics rows' time and summary.json's train_seconds will "
              f"be null", file=sys.stderr)
    if trainer.cfg.privacy.secure_mode and trainer.rank == 0:  # (said once, as "resumed from")
        print("dptrain: secure mode: resuming with fresh randomness (a new privacy seed "
              "from OS entropy; exact replay is impossible by design)", file=sys.stderr)


def _checked_cost(cost, path: Path) -> dict:
    """A checkpoint's ``cost`` entry (absent in older versions: ``{}``), refused unless it is
    what ``_run_state`` writes: seconds a finite float >= 0 (or None, after resuming an older
    checkpoint), resumes an int >= 0."""
    def number(v, kind) -> bool:
        return isinstance(v, kind) and not isinstance(v, bool) and math.isfinite(v) and v >= 0

    if cost == {}:
        return cost
    if not (isinstance(cost, dict) and set(cost) == {"train_seconds", "resumes"}
            and (cost["train_seconds"] is None or number(cost["train_seconds"], (int, float)))
            and number(cost["resumes"], int)):
        raise ConfigError("resume", f"checkpoint {path} is unusable: its cost entry {cost!r} "
                                    "is not a run's (train_seconds a finite number >= 0, "
                                    "resumes an integer >= 0); it was not written by dptrain "
                                    "train")
    return cost


def _check_ranks_resume_alike(state: dict, path: Path, problem: ConfigError | None) -> None:
    """Every rank continues from one checkpoint: one step, one ledger, the same files (the
    checksums its marker lists). The ranks agree on ``--resume`` (``commands.train``), but the
    same path can name node-local copies: at different steps, ranks take their shares of
    different samples (an example in two shares of one release: sensitivity 2C) and count
    different releases; at one step with other contents (a copy of another run, a resume that
    changed the learning rate), the replicas train apart and the checks of the checkpoint
    against the config could refuse on one rank alone. Refused on every rank, naming
    ``resume``; so is ``problem``, a rank's refusal to read the checkpoint."""
    from dptrain.parallel.dist import one_verdict

    contents = json.dumps([state.get("ledger"), _quick_check(path)[1]], sort_keys=True,
                          default=repr).encode()
    every = one_verdict(problem, True, (state.get("step"), hashlib.sha256(contents).hexdigest(),
                                        str(path)))
    for rank, (step, digest, where) in enumerate(every):
        if (step, digest) != every[0][:2]:
            another = " with other contents" if step == every[0][0] else ""
            raise said_by_rank_0(ConfigError(
                "resume", f"rank {rank} resumes {where} at step {step}{another}, rank 0 "
                          f"{every[0][2]} at step {every[0][0]}: every rank must resume one "
                          "checkpoint (node-local copies that differ?)"))


def _checked_ledger(trainer, state: dict, path: Path):
    """The checkpoint's privacy ledger, once it is one this run can have written: it counts
    ``step`` releases, ``step`` is within ``privacy.steps``, and each release is at the plan's
    rate and sigma (:func:`_check_ledger`). A sigma calibrated by another version is checked
    against the target with the releases still to come, and said."""
    from dptrain.privacy.accounting import Ledger, check_plan

    try:
        ledger = Ledger.from_dict(state["ledger"])
    except (TypeError, ValueError) as e:
        raise ConfigError("resume", f"checkpoint {path} is unusable: its ledger: {e}") from None
    if ledger.num_releases != state["step"]:
        raise ConfigError("resume", f"checkpoint {path} is inconsistent: its ledger counts "
                                    f"{ledger.num_releases} releases at step {state['step']}")
    if state["step"] > trainer.plan.steps:  # (privacy.steps is compared by check_compatible)
        raise ConfigError("resume", f"checkpoint {path} is inconsistent: it is at step "
                                    f"{state['step']}, beyond privacy.steps "
                                    f"({trainer.plan.steps}) of its own config")
    _check_ledger(ledger, trainer, path)
    sigma = trainer.plan.noise_multiplier
    saved_sigma = (state.get("plan") or {}).get("noise_multiplier")
    if (saved_sigma is not None and saved_sigma != sigma) or \
            any(s != sigma for s, _, _ in ledger.history):
        # releases at another sigma than this run's (the same target calibrated by another
        # dptrain or opacus version; or an edit): the releases made and the remaining ones at
        # this sigma must stay within the target together
        try:
            check_plan(trainer.cfg.privacy, sigma, ledger=ledger,
                       advice="it was edited, or written by a version that calibrates sigma "
                              "otherwise (resume with that version)")
        except ConfigError as e:
            raise ConfigError("resume", f"checkpoint {path}: its ledger records releases at "
                                        f"another noise multiplier than {sigma!r}, and with "
                                        f"them {e.message}") from None
    if saved_sigma is not None and saved_sigma != sigma:
        if trainer.rank == 0:
            print(f"dptrain train: note: sigma is calibrated to "
                  f"{trainer.plan.noise_multiplier!r} now, {saved_sigma!r} in the checkpoint's "
                  "run (another dptrain or opacus version); the ledger records each release's "
                  "sigma, and the planned releases stay within the target, but the run will not "
                  "repeat the checkpoint's bit for bit", file=sys.stderr)
    return ledger


def _load_tensors(trainer, state: dict, path: Path) -> dict:
    """Load the checkpoint's model and optimizer state into ``trainer`` (each rank its own rows
    when it is sharded, from either layout); the state with its tensors (a whole one's are
    read here). A misfit is one ConfigError: the model's names ``resume``, the optimizer's
    ``optim``."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        if _sharded(trainer) and state.get("format") == 2:
            _load_dcp_sharded(trainer, state, path)  # each rank reads its own rows
            return state
        state = _whole(path, state)
        if _sharded(trainer):
            _load_sharded(trainer, state, path)
            return state
        try:
            restore_model(trainer.model, state, path, frozen=_frozen(trainer))
        except (KeyError, ValueError, RuntimeError) as e:  # (not the optimizer's)
            raise _misfit(path, brief(e)) from None
        # filter/history states onto their parameters' device (torch optimizers do it)
        trainer.optimizer.load_state_dict(_map_optimizer(
            trainer, state["optimizer"], lambda i, v, p: v,
            lambda v, p: v.to(p.device) if p is not None else v))
        return state
    except ConfigError:
        raise  # names its field (a group's optimizer changed; a model's misfit)
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError,
            CheckpointException) as e:  # (DCP's is a BaseException)
        # model and data settings are compared before, the model's tensors checked and DCP's
        # reads refused as such, so this is the optimizer's structure (another optimizer,
        # other groups, inner momentum or a filter on or off)
        raise ConfigError("optim", f"the checkpoint's optimizer state does "
                                   f"not fit this config ({brief(e)}); resume needs the same "
                                   "optim settings") from None


def _report_changes(trainer, state: dict) -> None:
    """Say on stderr what of the checkpoint this run does not use, and which of its optimizer
    and performance settings differ from the checkpoint's (a resume may change them)."""
    from dptrain.performance import NOT_ARITHMETIC

    unused = unused_state(state["optimizer"], trainer.optimizer)
    if unused:
        print(f"dptrain train: the checkpoint's {'; '.join(unused)}: not used by this run",
              file=sys.stderr)
    # what the user changed (in config keys), then what that changes in the optimizer's
    # parameter groups (and what a performance setting does: ns_dtype)
    changed = "; ".join(section_changes(state["config"], trainer.cfg, "optim"))
    groups = "; ".join(trainer.optimizer.changed_settings)
    if groups:
        groups = f"parameter groups: {groups}"
        changed = f"{changed} ({groups})" if changed else groups
    if changed:
        print(f"dptrain train: optimizer settings differ from the checkpoint's, this config's "
              f"apply: {changed}", file=sys.stderr)
    note = getattr(trainer.optimizer.filter, "restart_note", None)
    if note:
        print(f"dptrain train: {note}", file=sys.stderr)
    perf = section_changes(state["config"], trainer.cfg, "performance", skip=NOT_ARITHMETIC)
    world = state.get("world_size")
    if world is not None and world != trainer.world:  # the sums' order (the noise is the same)
        perf.append(f"ranks: {world} -> {trainer.world}")
    if perf:
        print(f"dptrain train: performance settings differ from the checkpoint's "
              f"({'; '.join(perf)}): the privacy mechanism is the same, but the arithmetic "
              f"is not, so the run will not repeat the checkpoint's run bit for bit",
              file=sys.stderr)


def _restore_rngs(trainer, state: dict) -> None:
    """torch's global generators as they were: this rank's own on the same world size, rank
    0's (CPU) and the saved devices' otherwise."""
    ranks = state["rng"].get("torch_ranks")
    same_world = ranks is not None and len(ranks) == trainer.world
    torch.set_rng_state(ranks[trainer.rank] if same_world else state["rng"]["torch"])
    cuda_ranks = state["rng"].get("cuda_ranks")
    if torch.cuda.is_available():
        if same_world and cuda_ranks is not None:  # this rank's device, as it was
            torch.cuda.set_rng_state(cuda_ranks[trainer.rank])
        elif state["rng"].get("cuda") is not None:
            torch.cuda.set_rng_state_all(state["rng"]["cuda"])


def unused_state(saved: dict, optimizer) -> list[str]:
    """What of a checkpoint's optimizer state a resume that turned a feature off leaves
    behind (allowed: these are optimizer settings, free of privacy cost), said once so that it
    is not dropped silently."""
    from dptrain.optim.filters import Filter

    out = []
    past = len((saved.get("history") or {}).get("states") or [])
    if past and optimizer.history is None:
        out.append(f"inner-momentum history ({past} past states; optim.inner_momentum is off)")
    if saved.get("filter") and type(optimizer.filter) is Filter:
        out.append("filter state (optim.filter.name is none)")
    if saved.get("ema") is not None and optimizer.ema is None:
        out.append("parameter EMA (optim.ema_decay is 0)")
    return out


def export_hf(trainer, directory: Path) -> Path | None:
    """For GPT-2 and causal_lm models: ``DIR/hf/`` (config.json + model.safetensors) loadable
    by transformers' ``from_pretrained`` (``AutoModelForCausalLM``, or ``model.pretrained_path``
    of another run), copied from ``DIR/model.safetensors``; with a transformers tokenizer
    (``data.tokenizer: hf`` or ``gpt2``) the tokenizer too, so that the folder is a complete
    checkpoint. None for other models."""
    model = trainer.model
    config = getattr(model, "config", None)
    if (trainer.cfg.model.name not in ("gpt2", "causal_lm") or config is None
            or not (directory / "model.safetensors").exists()):
        return None
    hf = Path(directory) / "hf"
    tmp = Path(directory) / f".tmp-hf-{os.getpid()}"
    # any left by an export killed before a rename, whatever its pid: a copy of the model that
    # nothing reads (and os.replace below needs .old-hf-*'s path free)
    _clean_stale(Path(directory), ".tmp-hf-*", ".old-hf-*")
    tmp.mkdir(parents=True)
    try:
        if not getattr(config, "architectures", None):  # built from a config: name the class
            import copy

            config = copy.deepcopy(config)
            # (FSDP2 subclasses the model's class as FSDP<name>)
            config.architectures = [next(c.__name__ for c in type(model).__mro__
                                         if not c.__name__.startswith("FSDP"))]
        config.save_pretrained(str(tmp))
        shutil.copyfile(directory / "model.safetensors", tmp / "model.safetensors")
        tokenizer = getattr(trainer.task, "tokenizer", None)
        if getattr(tokenizer, "name", None) in ("hf", "gpt2"):
            tokenizer.hf.save_pretrained(str(tmp))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    # an earlier hf/ (a resumed export) is moved aside, not deleted, until the new one is in
    # place: a kill between the two leaves one of them
    old = Path(directory) / f".old-hf-{os.getpid()}"
    if hf.exists():
        os.replace(hf, old)
    os.replace(tmp, hf)
    shutil.rmtree(old, ignore_errors=True)
    return hf
