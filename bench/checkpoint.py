"""Checkpoint save/load time and size (issue 6).

    python bench/checkpoint.py [--gpt2 small|tiny] [--repeats 3]
    python bench/checkpoint.py --sharded [--repeats 3]


For a GPT-2-shaped model (DP-Muon matrices + AdamW aux, the `gpt2` preset) and an NF-ResNet-shaped
one (`nf_resnet26`, `nfresnet` preset), with and without the inner-momentum history (K = 4):
fill every optimizer state with one fake release, then time `checkpoint.write` (torch.save,
fsync, SHA-256, marker, rename) and `checkpoint.read` (checksum verification + torch.load), and
report the size of state.pt. Prints a Markdown table (medians).

``--sharded``: real ``Trainer`` runs (GPT-2 4 x 512, vocabulary 8,192 (the synthetic Markov text keeps a V x V table), DP-Muon + AdamW aux,
K = 0 and 4, states filled by K + 1 private steps) on 1 process (whole ``state.pt``) and on 2
gloo ranks under FSDP (torch.distributed.checkpoint, each rank writing its own shards): time of
``checkpoint.save`` (all ranks, to the rename) and ``checkpoint.load`` into the running trainer
(verification + each rank reading its rows), and the largest file any one rank wrote.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dptrain import checkpoint as ckpt  # noqa: E402
from dptrain.data.info import DataInfo  # noqa: E402
from dptrain.models import ModelConfig, build_model  # noqa: E402
from dptrain.optim import OptimConfig, build_optimizer  # noqa: E402


def _optim_cfg(preset: str, k: int) -> OptimConfig:
    from dptrain.optim.config import AuxGroupConfig
    from dptrain.optim.inner_momentum import InnerMomentumConfig

    cfg = OptimConfig(name="muon", lr=0.02, preset=preset,
                      aux=AuxGroupConfig(optimizer="adamw", lr=0.01))
    if k:
        cfg.inner_momentum = InnerMomentumConfig(k_muon=k, k_other=k, gamma_muon=0.9)
    return cfg


def build(kind: str, gpt2: str, k: int):
    if kind == "gpt2":
        shape = dict(n_layer=12, n_embd=768, n_head=12) if gpt2 == "small" else \
            dict(n_layer=4, n_embd=256, n_head=4)
        model = build_model(ModelConfig(name="gpt2", n_positions=128, **shape),
                            DataInfo(kind="lm", vocab_size=50257, pad_id=0, max_length=128))
        preset = "gpt2"
    else:
        model = build_model(ModelConfig(name="timm", timm_name="nf_resnet26"),
                            DataInfo(kind="classification", num_classes=10, in_chans=3,
                                     image_size=32))
        preset = "nfresnet"
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    opt = build_optimizer(_optim_cfg(preset, k), named, total_steps=100, release_noise_std=1e-3,
                          seed=0)
    for _ in range(max(k, 1)):  # fill momenta / moments / the whole history
        for _, p in named:
            p.grad = torch.randn_like(p) * 1e-3
        opt.step()
        opt.zero_grad()
    n_params = sum(p.numel() for _, p in named)
    # (what checkpoint.read requires of any state: a config and the RNG states, here this
    # process's; not a run's, which the table does not need)
    return {"step": max(k, 1), "model": model.state_dict(), "optimizer": opt.state_dict(),
            "ledger": {}, "config": {}, "rng": {"torch": torch.get_rng_state()}}, n_params


TINY = str(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml")


def _sharded_case(rank: int, world: int, out: str, k: int, repeats: int) -> dict | None:
    import torch.distributed as dist

    from dptrain.config import load
    from dptrain.trainer import RunConfig, Trainer

    args = ["train.progress=false", f"privacy.steps={k + 1}", "privacy.sample_rate=0.03",
            "model.n_layer=4", "model.n_embd=512", "model.n_head=8",
            "data.synthetic_vocab_size=8192", "train.keep_checkpoints=1",
            "performance.sharding=" + ("fsdp" if world > 1 else "none")]
    if k:
        args += [f"optim.inner_momentum.k_muon={k}", f"optim.inner_momentum.k_other={k}",
                 "optim.inner_momentum.gamma_muon=0.9"]
    t = Trainer(load(RunConfig, TINY, args), out)
    for _ in range(k + 1):
        t.private_step()
    saves, loads = [], []
    for _ in range(repeats):
        if world > 1:
            dist.barrier()
        t0 = time.perf_counter()
        path = ckpt.save(t, Path(out))
        saves.append(time.perf_counter() - t0)
        if world > 1:
            dist.barrier()
        t0 = time.perf_counter()
        ckpt.load(t, ckpt.find_latest(Path(out)))
        loads.append(time.perf_counter() - t0)
    if rank != 0:
        return None
    files = {p.name: p.stat().st_size for p in path.iterdir()}
    biggest = max(v for n, v in files.items() if n.endswith((".pt", ".distcp")))
    n = sum(p.numel() for _, p in t.named_params) if world == 1 else None
    return {"save": statistics.median(saves), "load": statistics.median(loads),
            "total_mib": sum(files.values()) / 2**20, "biggest_mib": biggest / 2**20,
            "files": sorted(files), "params": n}


def main_sharded(repeats: int, base: Path) -> None:
    from dptrain.parallel.dist import spawn

    print("| model | K | ranks | written as | checkpoint MiB | largest file MiB | save s | "
          "load s |")
    print("|---|---:|---:|---|---:|---:|---:|---:|")
    for k in (0, 4):
        for world in (1, 2):
            out = str(base / f"sharded-{k}-{world}")
            if world == 1:
                r = _sharded_case(0, 1, out, k, repeats)
            else:
                r = spawn(_sharded_case, world, out, k, repeats)[0]
            how = "state.pt (rank 0)" if world == 1 else "DCP, a file per rank"
            print(f"| GPT-2 4x512, vocab 8192 | {k} | {world} | {how} | {r['total_mib']:.0f} | "
                  f"{r['biggest_mib']:.0f} | {r['save']:.2f} | {r['load']:.2f} |", flush=True)
            shutil.rmtree(out, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sharded", action="store_true",
                    help="1 process vs 2 FSDP ranks (DCP), real trainer states")
    ap.add_argument("--gpt2", choices=["small", "tiny"], default="small")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    base = Path(args.dir or tempfile.mkdtemp(prefix="ckpt-bench-"))
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.1f}, writing to {base}")
    if args.sharded:
        main_sharded(args.repeats, base)
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
        return
    print("| model | params | K | state.pt MiB | save s | load s |")
    print("|---|---:|---:|---:|---:|---:|")
    for kind in ("gpt2", "nf_resnet26"):
        for k in (0, 4):
            state, n = build(kind, args.gpt2, k)
            saves, loads = [], []
            for r in range(args.repeats):
                out = base / f"{kind}-{k}-{r}"
                t0 = time.perf_counter()
                path = ckpt.write(state, out, state["step"], keep=1)
                saves.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                ckpt.read(path)
                loads.append(time.perf_counter() - t0)
                size = (path / "state.pt").stat().st_size / 2**20
                shutil.rmtree(out)
            name = f"GPT-2 {args.gpt2}" if kind == "gpt2" else kind
            print(f"| {name} | {n / 1e6:.1f}M | {k} | {size:.0f} | "
                  f"{statistics.median(saves):.2f} | {statistics.median(loads):.2f} |", flush=True)
    if args.dir is None:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
