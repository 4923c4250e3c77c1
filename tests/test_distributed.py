"""The same run on 1, 2 and 4 ranks (gloo, CPU), sharded with FSDP2 or replicated.

Sampling and noise are pure functions of (seed, step, example / coordinate), every rank sums
the clipped queries of its share of the sample, the sums are reduced across ranks, and each rank
draws the noise of its own shard: so the parameters after several steps, and the release itself,
do not depend on the world size (up to float summation order).
"""

from __future__ import annotations

import datetime
import shutil
from pathlib import Path

import pytest
import torch

from dptrain.parallel.dist import shard_bounds, spawn

pytestmark = pytest.mark.distributed

TINY = str(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml")
TINY_IMAGES = str(Path(__file__).resolve().parents[1] / "configs" / "tiny_images.yaml")
TINY_LLAMA = str(Path(__file__).resolve().parents[1] / "configs" / "tiny_llama.yaml")
NF = ["model.name=timm", "model.timm_name=nf_resnet_tiny", "data.synthetic_train_size=96",
      "data.synthetic_test_size=16", "privacy.sample_rate=0.1", "privacy.steps=3",
      "performance.microbatch_size=8"]
SGD = ["optim.name=sgd", "optim.preset=null", "optim.lr=0.5"]
IM = ["optim.inner_momentum.k_muon=2", "optim.inner_momentum.k_other=2",
      "optim.inner_momentum.gamma_muon=0.9"]


def _train(rank: int, world: int, overrides: list[str], config: str = TINY) -> dict:
    from dptrain.config import load
    from dptrain.trainer import RunConfig, Trainer

    t = Trainer(load(RunConfig, config, ["train.progress=false", "train.checkpoint_every=0",
                                       "privacy.accountant=rdp", "privacy.steps=3", *overrides]))
    first, stats = t.release(0)
    first = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone()
             for k, v in first.items()}
    while t.step < t.plan.steps:
        t.private_step()
    metrics = t.evaluate() if t.optimizer.ema is not None else {}
    from torch.distributed.fsdp import FSDPModule

    from dptrain.parallel.fsdp import block_modules

    state = t.full_state_dict()
    # a tied wte/lm_head (GPT-2's, a causal_lm's embed_tokens): one tensor in the gathered
    # state too (exported once)
    emb = next((k for k in state if k.endswith(("wte.weight", "embed_tokens.weight"))), None)
    tied = (state["lm_head.weight"].data_ptr() == state[emb].data_ptr()
            if "lm_head.weight" in state else None)
    return {"params": {k: v.clone() for k, v in state.items()}, "tied": tied,
            "units": [isinstance(m, FSDPModule) for m in (*block_modules(t.model), t.model)],
            "release0": first, "sizes": [len(t.local_sample(s)) for s in range(t.plan.steps)],
            "metrics": metrics, "loss0": stats["train_loss"]}


def _rel(a: dict, b: dict) -> float:
    # a gathered FSDP state lists GPT-2's tied wte/lm_head weight once
    common = set(a) & set(b)
    assert len(common) >= max(len(a), len(b)) - 1
    return max(float((a[k].double() - b[k].double()).norm()
                     / b[k].double().norm().clamp_min(1e-12)) for k in common)


def _check(overrides: list[str], worlds: list[tuple[int, str]], config: str = TINY) -> list[dict]:
    ref = spawn(_train, 1, overrides, config)[0]
    outs = []
    for world, sharding in worlds:
        results = spawn(_train, world, overrides + [f"performance.sharding={sharding}"], config)
        for r in results:  # a gathered FSDP state lands on rank 0 only (cpu_offload)
            if r["params"]:
                assert _rel(r["params"], ref["params"]) <= 1e-5, (world, sharding)
                assert r["tied"] == ref["tied"], (world, sharding)
            # FSDP2 shards every block as its own unit (one block gathered at a time), and
            # the root; replicated ranks shard nothing
            assert len(r["units"]) >= 3 and all(u == (sharding == "fsdp") for u in r["units"])
        assert results[0]["params"]
        assert _rel(results[0]["release0"], ref["release0"]) <= 1e-5
        for r in results:  # the batch's mean loss (every rank's examples), on every rank
            assert r["loss0"] == pytest.approx(ref["loss0"], rel=1e-5), (world, sharding)
        for r in results:  # test metrics (with an EMA: of the average and the last iterate)
            assert r["metrics"].keys() == ref["metrics"].keys()
            for k, v in ref["metrics"].items():
                assert r["metrics"][k] == pytest.approx(v, rel=1e-5), (world, sharding, k)
        assert [sum(s) for s in zip(*(r["sizes"] for r in results))] == ref["sizes"]
        outs.append(results)
    return outs


def test_dp_muon_gpt2_with_dropout_same_on_1_2_4_ranks_and_any_microbatch():
    # 4 ranks also with another microbatch size: the release depends on neither, dropout
    # included (per-example counter-based masks, dptrain/models/dropout.py)
    drop = ["model.dropout=0.1"]
    ref = spawn(_train, 1, drop)[0]
    for world, extra in ((2, []), (4, ["performance.microbatch_size=3"])):
        results = spawn(_train, world, ["performance.sharding=fsdp", *drop, *extra])
        assert _rel(results[0]["params"], ref["params"]) <= 1e-5
        assert _rel(results[0]["release0"], ref["release0"]) <= 1e-5
        for r in results:  # the batch's mean loss (every rank's examples), on every rank
            assert r["loss0"] == pytest.approx(ref["loss0"], rel=1e-5), (world, extra)
        assert [sum(s) for s in zip(*(r["sizes"] for r in results))] == ref["sizes"]


def test_dp_muon_causal_lm_same_on_1_and_2_fsdp_ranks():
    # a Llama's decoder layers (model.layers.N) are FSDP2 units of their own; its RMSNorms,
    # rotary positions and tied embed_tokens/lm_head under sharding
    outs = _check(["model.tie_embeddings=true"], [(2, "fsdp")], TINY_LLAMA)
    assert outs[0][0]["tied"] is True and len(outs[0][0]["units"]) == 3  # 2 layers + root


def test_lora_same_on_1_and_2_fsdp_ranks_with_a_frozen_block():
    # adapters in block 1 only: block 0 is a unit without a trainable parameter, block 1 holds
    # frozen base weights beside the adapters, the root the trainable final norm
    outs = _check(["model.lora.r=2", "model.lora.target_modules=[h.1.attn.c_attn,h.1.mlp.c_fc]",
                   "model.trainable=[ln_f]"], [(2, "fsdp")])
    assert len(outs[0][0]["units"]) == 3  # 2 blocks + root


def test_dp_muon_original_scale_same_on_1_and_2_fsdp_ranks():
    # GPT-2's Conv1D weights are stored (in, out): only Muon's shape scale reads them as
    # (out, in); the distributed Newton-Schulz works on the stored (sharded) matrix
    # (and the noise drawn on the background thread: each rank its own rows, during the
    # microbatches). With a parameter EMA, whose test metrics are compared too: the average is
    # evaluated after the last iterate, and under FSDP2 that forward must not reuse the root's
    # unsharded copies of the last iterate (it gave the last iterate's metrics before 0de42b8)
    outs = _check(["optim.scale=original", "performance.noise_prefetch=background",
                   "optim.ema_decay=0.5"], [(2, "fsdp")])
    m = outs[0][0]["metrics"]
    assert m["nll_per_token"] != pytest.approx(m["last_iterate_nll_per_token"], rel=1e-5)


def test_fsdp_mixed_precision_gathers_bf16_and_stays_near_the_float32_run():
    # bf16 parameters in forward/backward (norms, sums, reductions and the masters in fp32):
    # the release is the float32 run's to bf16 accuracy, and not equal to it (the setting acts)
    ref = spawn(_train, 1, [])[0]
    results = spawn(_train, 2, ["performance.sharding=fsdp",
                                "performance.fsdp_mixed_precision=true"])
    rel = _rel(results[0]["release0"], ref["release0"])
    assert 1e-5 < rel < 1e-2
    assert all(v.dtype == torch.float32 for v in results[0]["params"].values())


def _write_after_generation(rank: int, world: int) -> float:
    from transformers import GPT2Config, GPT2LMHeadModel

    from dptrain.eval.text import greedy_generate
    from dptrain.parallel.fsdp import apply_fsdp

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=40, n_positions=24,
                     bos_token_id=0, eos_token_id=0, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)
    model, other = GPT2LMHeadModel(cfg), GPT2LMHeadModel(cfg)
    full = dict(other.state_dict())
    apply_fsdp(model)
    greedy_generate(model, [[1, 2, 3], [4, 5]], 4, eos_id=0)
    with torch.no_grad():  # other weights into this rank's shards (an EMA swapped in, a load)
        for n, p in model.named_parameters():
            p.to_local().copy_(full[n].chunk(world)[rank])
        ids = torch.arange(1, 9).view(1, 8)
        return float((model(input_ids=ids).logits - other(input_ids=ids).logits).abs().max())


def test_a_forward_after_generation_sees_weights_written_into_the_shards():
    # generation's no_grad forwards left FSDP2's root (wte, wpe, ln_f) unsharded, and the next
    # forward mixed the new blocks with the root's old copies
    assert max(spawn(_write_after_generation, 2)) < 1e-5


def test_dp_sgd_gpt2_same_on_1_and_2_replicated_ranks():
    _check(SGD, [(2, "none")])


def test_dp_muon_im_k2_gpt2_with_dropout_same_on_1_and_2_ranks():
    # the historical states' dropout comes from their own streams, also per example
    _check(IM + ["model.dropout=0.1"], [(2, "fsdp")])


def test_dp_muon_nf_resnet_with_augmult_same_on_1_and_2_ranks():
    # augmentation multiplicity: each example's views are a function of (seed, step, view,
    # example), not of the rank that processes it
    _check(NF + ["data.augmult=2"], [(2, "fsdp")], TINY_IMAGES)


def test_ranks_with_an_empty_share_neither_hang_nor_skip_the_release():
    # 256 examples at q = 0.006: about 1.5 sampled per step, so a rank often gets none
    outs = _check(["privacy.sample_rate=0.006", "privacy.noise_multiplier=1.0",
                   "privacy.epsilon=null", "privacy.steps=6"], [(2, "fsdp")])
    sizes = [r["sizes"] for r in outs[0]]
    assert any(0 in s for s in sizes)


def test_zero_gradient_release_std_is_sigma_C_over_b_on_2_ranks():
    out = spawn(_train, 2, ["privacy.noise_multiplier=2.0", "privacy.epsilon=null",
                            "privacy.clip_norm=1e-12", "performance.sharding=fsdp"])[0]
    # clip norm ~0: the clipped sum is ~0, the release is the noise alone
    z = torch.cat([v.flatten().double() for v in out["release0"].values()])
    b = 32  # floor(0.125 * 256)
    expected = 2.0 * 1e-12 / b
    assert abs(float(z.std()) / expected - 1) < 6 / (2 * z.numel()) ** 0.5


def _replicated_zero_sum(rank: int, world: int) -> dict:
    """Replicated ranks, clipped sums exactly 0: the release's worst relative distance from
    sigma*C*Z/b (Z recomputed here), then the ledger and epsilon after the run's two steps."""
    from dptrain.config import load
    from dptrain.privacy.noise import gaussian_noise
    from dptrain.trainer import RunConfig, Trainer

    t = Trainer(load(RunConfig, TINY, [
        "train.progress=false", "train.checkpoint_every=0", "privacy.accountant=rdp",
        "privacy.steps=2", "privacy.epsilon=null", "privacy.noise_multiplier=1.7",
        "privacy.clip_norm=0.3", "performance.sharding=none"]))
    real = t.task.loss_fn
    t.task.loss_fn = lambda model, batch: real(model, batch) * 0.0
    release, _ = t.release(0)
    sigma, C, b = t.plan.noise_multiplier, t.plan.clip_norm, t.plan.denominator
    worst = 0.0
    for name, p in t.named_params:
        z = gaussian_noise(t.cfg.privacy.seed, 0, name, p.numel()).view(p.shape).double()
        want = sigma * C * z / b
        worst = max(worst, float((release[name].double() - want).abs().max() / want.abs().max()))
    while t.step < t.plan.steps:
        t.private_step()
    return {"worst": worst, "history": t.ledger.history, "epsilon": t.epsilon(),
            "q": t.cfg.privacy.sample_rate, "delta": t.plan.delta}


def test_replicated_ranks_release_sigma_C_Z_over_b_and_account_the_configured_rate():
    # C != 1 (sigma*C and sigma differ); each rank records the run's q, not its share of it
    from dptrain.privacy.accounting import Ledger, epsilon

    for r in spawn(_replicated_zero_sum, 2):
        assert r["worst"] < 1e-6  # float32 rounding of the release
        assert r["history"] == [(1.7, r["q"], 2)]
        assert r["epsilon"] == epsilon(Ledger([(1.7, r["q"], 2)]), r["delta"], "rdp")


def _noise_draws(rank: int, world: int, overrides: list[str]) -> dict:
    """The flat noise coordinates this rank draws in one release, and the release."""
    import dptrain.trainer as trainer_mod
    from dptrain.config import load
    from dptrain.trainer import RunConfig, Trainer

    drawn: dict[str, list] = {}
    original = trainer_mod.gaussian_noise

    def spy(seed, step, key, numel, start, end, **kw):
        drawn.setdefault(key, []).append((start, end, numel))
        return original(seed, step, key, numel, start, end, **kw)

    trainer_mod.gaussian_noise = spy
    t = Trainer(load(RunConfig, TINY, ["train.progress=false", "train.checkpoint_every=0",
                                       "privacy.accountant=rdp", "privacy.steps=1", *overrides]))
    release, _ = t.release(0)
    return {"drawn": drawn, "release": {k: v.clone() for k, v in release.items()}}


def test_replicated_ranks_draw_each_noise_coordinate_once_in_all():
    """sharding=none: every rank holds every parameter, but the ranks split the noise draw
    (whole blocks, each added to one rank's sum before the all-reduce) instead of each drawing
    all of it: W times less CPU per release, the same release (here drawn on the background
    thread by the ranks, inline by the reference)."""
    big = ["model.n_embd=64", "model.n_head=2", "data.synthetic_vocab_size=1200"]
    ref = spawn(_noise_draws, 1, big)[0]
    for world in (3,):  # uneven: 2 blocks of the largest parameter over 3 ranks
        outs = spawn(_noise_draws, world, big + ["performance.sharding=none",
                                                 "performance.noise_prefetch=background"])
        for name, draws in ref["drawn"].items():
            (_, _, numel), = draws
            spans = sorted(span for r in outs for span in r["drawn"].get(name, []))
            covered = [(a, b) for a, b, _ in spans]
            # the ranks' shares partition [0, numel): every coordinate drawn exactly once
            assert covered[0][0] == 0 and covered[-1][1] == numel, (name, covered)
            assert all(b0 == a1 for (_, b0), (a1, _) in zip(covered, covered[1:])), covered
        multi_block = [n for n, ((_, _, numel),) in ref["drawn"].items() if numel > 2 ** 16]
        assert multi_block  # the split is exercised inside a parameter, not only across them
        for r in outs:
            assert _rel(r["release"], ref["release"]) <= 1e-5, world


def _train_secure(rank: int, world: int) -> list[dict]:
    import hashlib

    from dptrain.config import load
    from dptrain.trainer import RunConfig, Trainer

    runs = []
    for _ in range(2):  # two runs, one after the other
        t = Trainer(load(RunConfig, TINY, ["train.progress=false", "train.checkpoint_every=0",
                                           "privacy.accountant=rdp", "privacy.steps=2",
                                           "privacy.secure_mode=true", "privacy.seed=null"]))
        shares = [sorted(int(i) for i in t.local_sample(s)) for s in range(t.plan.steps)]
        while t.step < t.plan.steps:
            t.private_step()
        runs.append({"seed": hashlib.sha256(str(t._privacy_seed).encode()).hexdigest(),
                     "shares": shares,
                     "params": {k: v.clone() for k, v in t.full_state_dict().items()}})
    return runs


def test_secure_mode_ranks_share_one_seed_from_os_entropy():
    """Secure mode on 2 replicated ranks: rank 0's OS-entropy seed reaches every rank (never
    written), so the ranks split one Poisson sample (disjoint shares) and add the same noise
    (identical replicas); the next run draws a different seed."""
    (a0, b0), (a1, b1) = spawn(_train_secure, 2)
    assert a0["seed"] == a1["seed"] and b0["seed"] == b1["seed"]
    assert a0["seed"] != b0["seed"]
    for s0, s1 in zip(a0["shares"], a1["shares"]):
        assert not set(s0) & set(s1)
    for k in a0["params"]:
        assert torch.equal(a0["params"][k], a1["params"][k]), k


def _variant_train_save_load(rank: int, world: int, out: str, name: str) -> dict:
    """Train with DP-Muon-S or DP-MuonBC on the block matrices (AdamW aux), write a checkpoint,
    load it into a fresh trainer: the optimizer state comes back the same (sharded momenta;
    MuonS's replicated power vectors and sigma; MuonBC's step counters)."""
    from pathlib import Path

    from dptrain import checkpoint as ckpt
    from dptrain.config import load
    from dptrain.trainer import RunConfig, Trainer

    args = ["train.progress=false", "train.checkpoint_every=0", "privacy.accountant=rdp",
            "privacy.steps=2", f"optim.name={name}",
            f"performance.sharding={'fsdp' if world > 1 else 'none'}"]
    t = Trainer(load(RunConfig, TINY, args))
    while t.step < t.plan.steps:
        t.private_step()
    sigmas = {}
    matrices = t.optimizer.optimizers[0]
    assert type(matrices).__name__ == {"muon_s": "MuonS", "muon_bc": "MuonBC"}[name]
    for g in matrices.param_groups:
        for p in g["params"]:
            st = matrices.state[p]
            if "sigma" in st:
                sigmas[len(sigmas)] = float(st["sigma"])
    ckpt.save(t, Path(out))
    fresh = Trainer(load(RunConfig, TINY, args))
    ckpt.load(fresh, ckpt.find_latest(Path(out)))
    same = True
    for a, b in zip(t.optimizer.optimizers, fresh.optimizer.optimizers):
        for pa, pb in zip([p for g in a.param_groups for p in g["params"]],
                          [p for g in b.param_groups for p in g["params"]]):
            for k, v in a.state[pa].items():
                w = b.state[pb][k]
                if isinstance(v, torch.Tensor):
                    same &= type(v) is type(w) and torch.equal(v, w)
    return {"params": {k: v.clone() for k, v in t.full_state_dict().items()},
            "sigmas": sigmas, "state_round_trip": same}


@pytest.mark.parametrize("name", ["muon_s", "muon_bc"])
def test_muon_s_and_bc_same_on_1_and_2_fsdp_ranks_and_their_checkpoints_round_trip(tmp_path, name):
    """DP-Muon-S under FSDP: the sharded power iteration gives sigma_1 of the whole momentum
    matrix (as on one rank, 1e-5); DP-MuonBC: its bias-corrected Smooth-NS runs at each
    matrix's owner rank. Both: the same parameters as one rank (1e-5), and the sharded
    checkpoint loads back."""
    ref = _variant_train_save_load(0, 1, str(tmp_path / "one"), name)
    two = spawn(_variant_train_save_load, 2, str(tmp_path / "two"), name)
    assert all(r["sigmas"].keys() == ref["sigmas"].keys() for r in two)
    assert bool(ref["sigmas"]) == (name == "muon_s")
    for r in two:
        for i, s in ref["sigmas"].items():
            assert r["sigmas"][i] == pytest.approx(s, rel=1e-5)
        assert r["state_round_trip"]
    assert ref["state_round_trip"]
    assert _rel(two[0]["params"], ref["params"]) <= 1e-5


def _save_replicated(rank: int, world: int, out: str) -> bool:
    import os

    from dptrain import checkpoint as ckpt
    from dptrain.config import load
    from dptrain.trainer import RunConfig, Trainer

    t = Trainer(load(RunConfig, TINY, ["train.progress=false", "performance.sharding=none"]),
                Path(out))
    if rank == 0:  # a slow write on the rank that writes
        os.environ["DPTRAIN_TEST_CHECKPOINT_PAUSE"] = "1.5"
    ckpt.save(t, Path(out))
    return (Path(out) / "checkpoints" / "step-00000000" / "COMPLETE").exists()


def test_replicated_save_returns_on_every_rank_only_once_the_checkpoint_is_sealed(tmp_path):
    # after a SIGTERM stop the ranks exit right after save(): rank 1 used to exit while rank 0
    # was still writing, and the launcher then killed rank 0 with the checkpoint half written
    assert spawn(_save_replicated, 2, str(tmp_path / "run")) == [True, True]


def _verify_views(rank: int, world: int, paths: list[str]) -> tuple:
    from dptrain import checkpoint as ckpt

    # each rank sees its own copy: rank 1's lags (no marker yet, as on a lagging NFS client)
    return (ckpt.verify(Path(paths[rank]), collective=True),
            ckpt.verify(Path(paths[rank]), shallow=True, collective=True))


def test_collective_verify_agrees_when_the_ranks_see_different_files(tmp_path):
    # a rank that returned early (no marker) used to leave the others waiting in the exchange
    import shutil

    from dptrain import checkpoint as ckpt

    good = ckpt.write({"x": torch.arange(4.0)}, tmp_path / "run", 1, 2)
    lagging = tmp_path / "lagging" / good.name
    shutil.copytree(good, lagging)
    (lagging / ckpt.MARKER).unlink()
    got = spawn(_verify_views, 2, [str(good), str(lagging)], timeout=90)
    assert got[0] == got[1] and got[0][0] is not None and "marker" in got[0][0]
    assert got[0][1] == got[0][0]


def test_shard_bounds_refuses_a_rank_outside_the_world():
    for dim0, rank, world in [(5, 4, 4), (5, -1, 4), (5, 0, 0)]:
        with pytest.raises(ValueError):
            shard_bounds(dim0, rank, world)
    with pytest.raises(ValueError):
        shard_bounds(-1, 0, 2)
    assert shard_bounds(5, 3, 4) == (5, 5)


def test_init_from_env_joins_with_the_launcher_s_rank_and_world(monkeypatch):
    # a second node's rank: RANK 3 of 4, LOCAL_RANK 1 (its second process): the group's rank
    # is RANK, not LOCAL_RANK, and the timeout is handed on
    import dptrain.parallel.dist as d

    seen = {}
    monkeypatch.setattr(d.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(d.dist, "init_process_group", lambda **kw: seen.update(kw))
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("MASTER_ADDR", "node0")  # (the rendezvous a launcher sets)
    monkeypatch.setenv("MASTER_PORT", "29500")
    timeout = datetime.timedelta(seconds=7)
    assert d.init_from_env("gloo", timeout=timeout) == (3, 4)
    assert seen == {"backend": "gloo", "init_method": "env://", "rank": 3, "world_size": 4,
                    "timeout": timeout}
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.delenv("RANK")  # (RANK alone is refused: the next test)
    assert d.init_from_env("gloo") == (0, 1)


def test_block_modules_finds_blocks_frozen_or_not():
    from torch import nn

    from dptrain.parallel.fsdp import block_modules

    class Base(nn.Module):  # a GPT-2 body without the LM head: blocks named h.N
        def __init__(self):
            super().__init__()
            self.h = nn.ModuleList(nn.Linear(2, 2) for _ in range(3))

    m = Base()
    assert block_modules(m) == list(m.h)
    for p in m.h[1].parameters():  # frozen (fine-tuning): still a unit of its own
        p.requires_grad_(False)
    assert block_modules(m) == list(m.h)
    m.h[1] = nn.ReLU()  # no parameters: nothing to shard
    assert block_modules(m) == [m.h[0], m.h[2]]

    class Decoder(nn.Module):  # transformers' Llama/Qwen2/Mistral: model.layers.N
        def __init__(self):
            super().__init__()
            self.model = nn.Module()
            self.model.embed_tokens = nn.Embedding(4, 2)
            self.model.layers = nn.ModuleList(nn.Linear(2, 2) for _ in range(2))
            self.lm_head = nn.Linear(2, 4)

    d = Decoder()
    assert block_modules(d) == list(d.model.layers)


def _scalars_and_rows(rank: int, world: int) -> dict:
    """all_reduce_scalars sums over ranks (or takes the maximum); reduce_sum returns this rank's rows of the summed
    gradient of a 5-row sharded weight (uneven: 3 + 2 rows); flat_range gives its global flat
    coordinates."""
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    import dptrain.trainer as trainer_mod
    from dptrain.parallel.fsdp import all_reduce_scalars, flat_range, local_rows, reduce_sum

    sums = all_reduce_scalars(float(rank + 1), 10.0 * (rank + 1))
    # float64: a byte count above 2^24 and a fraction below float32's resolution stay exact
    exact = all_reduce_scalars(2.0 ** 40 + rank, 1.0 + 2.0 ** -40 * (rank + 1))
    maxima = all_reduce_scalars(float(rank + 1), -10.0 * (rank + 1), op="max")
    torch.manual_seed(0)
    lin = nn.Linear(4, 5)
    fully_shard(lin)
    w = lin.weight
    full = torch.arange(20, dtype=torch.float32).view(5, 4) * (rank + 1)
    calls, all_reduce = [], dist.all_reduce
    dist.all_reduce = lambda *a, **k: calls.append(1) or all_reduce(*a, **k)
    rows = reduce_sum(full.clone(), w).clone()
    all_reduces = len(calls)
    # a backend without reduce-scatter (old gloo): the fallback all-reduces, then slices
    names = [n for n in ("reduce_scatter_single", "reduce_scatter_tensor") if hasattr(dist, n)]
    saved = {n: getattr(dist, n) for n in names}

    def unsupported(*a, **k):
        raise RuntimeError("reduce_scatter: not supported by this backend")

    def out_of_memory(*a, **k):
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

    try:
        for n in names:
            setattr(dist, n, unsupported)
        rows_fallback = reduce_sum(full.clone(), w).clone()
        # another failure (on one rank, typically) is raised, not sent to the all-reduce
        # while the other ranks' reduce-scatter went ahead
        for n in names:
            setattr(dist, n, out_of_memory)
        before = len(calls)
        try:
            reduce_sum(full.clone(), w)
            other_error = None
        except RuntimeError as e:
            other_error = (str(e), len(calls) - before)
    finally:
        for n, f in saved.items():
            setattr(dist, n, f)
        dist.all_reduce = all_reduce
    # secure mode: rank 0's OS-entropy seed is every rank's
    trainer_mod.secure_seed = lambda: 1000 + rank
    return {"sums": sums, "maxima": maxima, "rows": rows, "rows_fallback": rows_fallback,
            "other_error": other_error,
            "all_reduces": all_reduces, "fallback_all_reduces": len(calls) - all_reduces,
            "flat": flat_range(w), "local_rows": local_rows(w), "exact": exact,
            # a replicated tensor (not sharded) under a process group: every rank holds it all
            "plain": (flat_range(torch.zeros(5, 4)), local_rows(torch.zeros(5, 4))),
            "secure_seed": trainer_mod._shared_secure_seed(world)}


def test_scalars_and_sharded_rows_are_reduced_over_the_ranks():
    a, b = spawn(_scalars_and_rows, 2)
    assert a["sums"] == b["sums"] == [3.0, 30.0]
    assert a["maxima"] == b["maxima"] == [2.0, -10.0]
    want = torch.arange(20, dtype=torch.float32).view(5, 4) * 3  # (1 + 2) times
    for key in ("rows", "rows_fallback"):
        assert torch.equal(a[key], want[:3]) and torch.equal(b[key], want[3:]), key
    # with reduce-scatter, no rank all-reduces (receives) the whole gradient
    assert a["all_reduces"] == b["all_reduces"] == 0
    assert a["fallback_all_reduces"] == b["fallback_all_reduces"] == 1
    assert a["other_error"] == b["other_error"] == (
        "CUDA out of memory. Tried to allocate 2.00 GiB", 0)
    assert a["secure_seed"] == b["secure_seed"] == 1000
    assert a["local_rows"] == (0, 3) and b["local_rows"] == (3, 5)
    assert a["flat"] == (20, 0, 12) and b["flat"] == (20, 12, 20)
    assert a["exact"] == b["exact"] == [2.0 ** 41 + 1, 2.0 + 3 * 2.0 ** -40]
    assert a["plain"] == b["plain"] == ((20, 0, 20), (0, 5))


def _sleep(rank: int, world: int) -> None:
    import time

    time.sleep(60)


def test_spawn_gives_up_after_its_timeout():
    import time

    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        spawn(_sleep, 1, timeout=3)
    assert time.monotonic() - t0 < 45


def _rank_id(rank: int, world: int) -> tuple[int, int]:
    return rank, world


def test_spawn_returns_results_in_rank_order():
    assert spawn(_rank_id, 3) == [(0, 3), (1, 3), (2, 3)]


def test_flat_range_of_an_unsharded_tensor_is_all_of_it():
    # without a process group: every coordinate, a 0-dim parameter (a scalar gain) included
    from dptrain.parallel.fsdp import flat_range, local_rows

    assert flat_range(torch.zeros(5, 3)) == (15, 0, 15) and local_rows(torch.zeros(5, 3)) == (0, 5)
    assert flat_range(torch.zeros(4)) == (4, 0, 4)
    assert flat_range(torch.zeros(())) == (1, 0, 1) and local_rows(torch.zeros(())) == (0, 1)


def test_a_scalar_parameter_gets_one_noise_draw():
    from pathlib import Path

    from dptrain.config import load
    from dptrain.privacy.noise import gaussian_noise
    from dptrain.trainer import RunConfig, Trainer

    root = Path(__file__).resolve().parent
    root = root.parent if root.name == "tests" else root
    t = Trainer(load(RunConfig, root / "configs" / "tiny.yaml", ["train.progress=false"]))
    z = t.noise(3, "gain", torch.zeros(()))
    assert z.shape == () and float(z) == float(gaussian_noise(0, 3, "gain", 1)[0])


def test_dp_muon_im_vit_same_on_1_and_2_fsdp_ranks():
    # a ViT's class token and position table, owned by the root next to sharded blocks, are
    # the engine's tapped parameters (one row per example), gathered by FSDP2 for the root's
    # forward; with inner momentum, at each historical state
    vit = ["model.name=timm", "model.timm_name=vit_tiny_patch16_224",
           "model.timm_kwargs={img_size: 16, patch_size: 8, depth: 2, embed_dim: 32, "
           "num_heads: 2}", "optim.preset=vit", "data.synthetic_train_size=96",
           "data.synthetic_test_size=16", "privacy.sample_rate=0.1",
           "performance.microbatch_size=8"]
    _check(vit + IM, [(2, "fsdp")], TINY_IMAGES)


def _build_with(rank: int, world: int, per_rank: list[list[str]], config: str = TINY):
    from dptrain.config import ConfigError, load
    from dptrain.trainer import RunConfig, Trainer

    try:
        Trainer(load(RunConfig, config, ["train.progress=false", *per_rank[rank]]))
    except ConfigError as e:
        return e.field, e.message
    return "built"


@pytest.mark.parametrize("per_rank, field, words", [
    # rank 1 clipped at 5 and rank 0 noised for 1: the summary said epsilon 7.992 (audit)
    ([[], ["privacy.clip_norm=5.0"]], "privacy.clip_norm", "rank 1 runs with 5.0, rank 0 with 1.0"),
    # another S_t on rank 1: an example in two ranks' shares, then a hang in a collective
    ([["privacy.seed=3"], ["privacy.seed=4"]], "privacy.seed", "rank 1 runs with 4, rank 0 with 3"),
    ([[], [], ["optim.lr=0.5"]], "optim.lr", "rank 2 runs with 0.5"),
])
def test_ranks_with_another_configuration_are_refused_on_every_rank(per_rank, field, words):
    out = spawn(_build_with, len(per_rank), per_rank, timeout=240)
    assert all(r[0] == field and words in r[1] for r in out), out


def test_data_missing_on_one_rank_is_refused_on_every_rank(tmp_path):
    # a data.path that exists on node 0 only: node 1 said so and exited 2, while rank 0 (the
    # log people read) showed gloo's "Connection closed by peer" traceback (NCCL: a wait until
    # the collective timeout)
    from PIL import Image

    for split, n in (("train", 4), ("val", 2)):
        for label in ("a", "b"):
            (tmp_path / "data" / split / label).mkdir(parents=True)
            for k in range(n):
                Image.new("RGB", (8, 8), (40 * k, 0, 0)).save(
                    tmp_path / "data" / split / label / f"{k}.png")
    base = ["data.name=imagefolder", "data.image_size=8"]
    per_rank = [[*base, f"data.path={tmp_path / 'data'}"],
                [*base, f"data.path={tmp_path / 'elsewhere'}"]]
    out = spawn(_build_with, 2, per_rank, TINY_IMAGES, timeout=240)
    assert [r[0] for r in out] == ["data.train_file", "data.train_file"], out
    assert out[0][1] == out[1][1] + " (on rank 1)" and "elsewhere" in out[1][1], out


def _refusal_with_speaker(rank: int, world: int, overrides: list[str]):
    from dptrain.config import ConfigError, load
    from dptrain.trainer import RunConfig, Trainer

    try:
        Trainer(load(RunConfig, TINY, ["train.progress=false", *overrides]))
    except ConfigError as e:
        return e.field, e.message, getattr(e, "every_rank", False)
    return "built"


@pytest.mark.parametrize("override, field", [
    ("model.trainable=[nomatch]", "model.trainable[0]"),  # build_model's refusal
    ("optim.weight_decay=60", "optim.weight_decay"),  # build_optimizer's (lr x wd >= 1)
])
def test_a_refusal_every_rank_makes_when_building_is_said_once_by_rank_0(override, field):
    # each rank printed its own copy of the same line (a LoRA target that matches no module:
    # one line per rank, 64 at 64 ranks); now rank 0 says it, the others raise it silently
    out = spawn(_refusal_with_speaker, 2, [override], timeout=240)
    assert [r[0] for r in out] == [field, field] and out[0][1] == out[1][1], out
    assert [r[2] for r in out] == [True, True], out


def test_ranks_may_differ_in_where_they_keep_files_and_how_many_threads_they_use(tmp_path):
    per_rank = [["performance.num_threads=1"],
                ["performance.num_threads=2", "performance.noise_prefetch=background",
                 "performance.collate_prefetch=inline", "train.progress=true"]]
    assert spawn(_build_with, 2, per_rank, timeout=240) == ["built", "built"]


def _build_llama(rank: int, world: int, folders: list[str]):
    from dptrain.config import ConfigError, load
    from dptrain.trainer import RunConfig, Trainer

    try:
        Trainer(load(RunConfig, TINY_LLAMA, [
            "train.progress=false", "model.hf_config={}", f"model.pretrained_path={folders[rank]}",
            "model.tie_embeddings=false", "performance.sharding=fsdp"]))
    except ConfigError as e:
        return e.field, e.message
    return "built"


def test_ranks_that_load_other_pretrained_weights_are_refused(tmp_path):
    # model.pretrained_path may name each node's copy (rank-local): another version of the
    # file trained from other weights on that rank, to the end, exit 0 (red team)
    from _causal_lm import E2E_DIR, save_pretrained_llama

    if not (E2E_DIR / "devset.csv").is_file():  # (its tokenizer is trained on E2E text)
        pytest.skip("the E2E files of ../shared/data are not here")

    a = save_pretrained_llama(tmp_path / "a", seed=0)
    b = save_pretrained_llama(tmp_path / "b", seed=1)
    a_copy = tmp_path / "a_copy"
    shutil.copytree(a, a_copy)
    assert spawn(_build_llama, 2, [str(a), str(a_copy)], timeout=240) == ["built", "built"]
    out = spawn(_build_llama, 2, [str(a), str(b)], timeout=240)
    assert all(r[0] == "model.pretrained_path" and f"rank 0 from {a}; rank 1 from {b}" in r[1]
               for r in out), out


@pytest.mark.parametrize("env, field", [
    ({"RANK": "1"}, "WORLD_SIZE"),  # trained alone, as if it were the only rank
    ({"WORLD_SIZE": "2"}, "RANK"),  # every process rank 0 (EADDRINUSE, or a store timeout)
    ({"RANK": "5", "WORLD_SIZE": "2"}, "RANK"),  # a connect timeout naming neither
    ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK"),  # (ranks are 0 .. WORLD_SIZE - 1)
    ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE"),
])
def test_an_incomplete_launcher_environment_exits_2_naming_the_variable(
        monkeypatch, capsys, tmp_path, env, field):
    from dptrain.cli import main

    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    out = tmp_path / "out"
    code = main(["train", "--config", str(Path(__file__).resolve().parents[1] / "configs" /
                                         "tiny.yaml"), "--output-dir", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith(f"dptrain train: error: {field}: "), err
    assert not out.exists()


ACCELERATE_VARIABLES = ("ACCELERATE_MIXED_PRECISION", "ACCELERATE_USE_FSDP",
                        "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_MEGATRON_LM",
                        "ACCELERATE_USE_PARALLELISM_CONFIG", "ACCELERATE_DYNAMO_BACKEND")


@pytest.mark.parametrize("command", ["train", "audit"])
@pytest.mark.parametrize("name, value, says", [
    # accelerate launch exports its config's settings for an Accelerator, which dptrain never
    # builds: a bf16 launch trained in float32, an FSDP one replicated, exit 0 and no word
    ("ACCELERATE_MIXED_PRECISION", "bf16", "performance.dtype"),
    ("ACCELERATE_USE_FSDP", "true", "performance.sharding=fsdp"),
    ("ACCELERATE_USE_DEEPSPEED", "TRUE", "DeepSpeed"),
    ("ACCELERATE_DYNAMO_BACKEND", "INDUCTOR", "--dynamo_backend no"),
])
def test_accelerate_settings_dptrain_does_not_apply_exit_2_naming_the_variable(
        monkeypatch, capsys, tmp_path, command, name, value, says):
    from dptrain.cli import main

    for other in ACCELERATE_VARIABLES:
        monkeypatch.delenv(other, raising=False)
    monkeypatch.setenv(name, value)
    out = tmp_path / ("out" if command == "train" else "audit.json")
    where = ["--output-dir", str(out)] if command == "train" else ["--output", str(out)]
    code = main([command, "--config", TINY, *where])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"dptrain {command}: error: {name}: ") and says in err[0], err
    assert not out.exists()


def test_accelerate_settings_that_are_off_pass(monkeypatch, capsys, tmp_path):
    # what accelerate launch exports by default (mixed_precision no, dynamo NO, no FSDP)
    from dptrain.cli import main

    for name, value in (("ACCELERATE_MIXED_PRECISION", "no"), ("ACCELERATE_USE_FSDP", "false"),
                        ("ACCELERATE_USE_DEEPSPEED", "false"),
                        ("ACCELERATE_DYNAMO_BACKEND", "NO")):
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("ACCELERATE_USE_MEGATRON_LM", raising=False)
    monkeypatch.delenv("ACCELERATE_USE_PARALLELISM_CONFIG", raising=False)
    assert main(["train", "--config", TINY, "--output-dir", str(tmp_path / "out"),
                 "--dry-run"]) == 0


@pytest.mark.parametrize("env, want", [({}, (0, 1)), ({"RANK": "0"}, (0, 1)),
                                       ({"WORLD_SIZE": "1"}, (0, 1)),
                                       ({"RANK": "1", "WORLD_SIZE": "3"}, (1, 3))])
def test_a_complete_or_absent_launcher_environment_is_read(monkeypatch, env, want):
    from dptrain.parallel.dist import launch_environment

    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert launch_environment() == want


@pytest.mark.parametrize("env, words", [
    ({"LOCAL_RANK": "a"}, "must be an integer, got 'a'"),
    ({"RANK": "1", "WORLD_SIZE": "2"}, "is not set, but WORLD_SIZE is (2): every rank would "
                                       "use cuda:0"),
    ({"LOCAL_RANK": "99"}, "is 99, but this node has"),
])
def test_local_rank_of_a_cuda_run_is_one_error_naming_it(monkeypatch, env, words):
    # read with int() and a default of 0: a bare ValueError, or every rank on cuda:0
    from dptrain.config import ConfigError
    from dptrain.parallel.dist import local_rank

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as e:
        local_rank()
    assert e.value.field == "LOCAL_RANK" and words in e.value.message


@pytest.mark.parametrize("env, field", [({"MASTER_PORT": "29500"}, "MASTER_ADDR"),
                                        ({"MASTER_ADDR": "localhost"}, "MASTER_PORT"),
                                        ({"MASTER_ADDR": "localhost", "MASTER_PORT": "x"},
                                         "MASTER_PORT")])
def test_a_launch_without_its_rendezvous_is_one_error_naming_it(monkeypatch, env, field):
    from dptrain.config import ConfigError
    from dptrain.parallel.dist import init_from_env

    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as e:
        init_from_env("gloo")
    assert e.value.field == field


def test_one_rank_without_a_rendezvous_runs_as_a_plain_process(monkeypatch):
    # some platforms export RANK=0 WORLD_SIZE=1 and nothing else: it was refused, naming
    # MASTER_ADDR ("the ranks cannot meet"), though there is no other rank to meet
    import torch.distributed as dist

    from dptrain.parallel.dist import init_from_env

    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert init_from_env("gloo") == (0, 1) and not dist.is_initialized()


def test_a_rank_waiting_for_its_peers_ends_on_sigterm(tmp_path):
    # the rendezvous waits in C++, where dptrain train's Python stop handler never runs: a rank
    # whose peers never came ignored every SIGTERM until gloo's 30-minute timeout (an audit)
    import os
    import signal
    import socket
    import subprocess
    import sys
    import time

    from dptrain.parallel.dist import find_free_port

    port = find_free_port()
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0",
           "WORLD_SIZE": "2", "LOCAL_RANK": "0", "OMP_NUM_THREADS": "1"}
    tiny = str(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml")
    proc = subprocess.Popen([sys.executable, "-m", "dptrain", "train", "--config", tiny,
                             "--output-dir", str(tmp_path / "out"), "train.progress=false"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 120
        while time.time() < deadline:  # rank 0 hosts the store: listening = in the rendezvous
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert proc.poll() is None, proc.stderr.read()
            time.sleep(0.2)
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == -signal.SIGTERM
    finally:
        proc.kill()
        proc.wait()
    assert not (tmp_path / "out").exists()


def test_local_rank_of_a_plain_process_is_0(monkeypatch):
    from dptrain.parallel.dist import local_rank

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert local_rank() == 0


def test_collective_timeout_reaches_the_process_group_and_bad_values_exit_2(
        monkeypatch, capsys, tmp_path):
    import dptrain.trainer as trainer_mod
    from dptrain.cli import main

    config = str(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml")
    seen = []

    def init(backend, *, timeout=None):
        seen.append(timeout)
        return 0, 1

    monkeypatch.setattr(trainer_mod, "init_from_env", init)
    args = ["train", "--config", config, "--output-dir", str(tmp_path / "a"), "--dry-run"]
    assert main(args + ["performance.collective_timeout_s=90"]) == 0
    assert main(args) == 0
    assert seen == [datetime.timedelta(seconds=90), None]  # null: torch's default
    for bad in ("0", "-5", "nan", "inf", "1e-9", "1e14"):  # (0 ms: at once; timedelta overflow)
        capsys.readouterr()
        assert main(args + [f"performance.collective_timeout_s={bad}"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert "performance.collective_timeout_s" in err[-1], err
    assert len(seen) == 2 and not (tmp_path / "a").exists()


def test_shard_bounds_are_torch_chunk_s_rows():
    # FSDP2 shards dim 0 as torch.chunk does; a mutant with dim0 // world + 1 rows per rank
    # passed the cheap tests (uneven splits only)
    from dptrain.parallel.dist import shard_bounds

    for world in range(1, 6):
        for dim0 in range(0, 13):
            sizes = [c.shape[0] for c in torch.arange(dim0).chunk(world)] if dim0 else []
            sizes += [0] * (world - len(sizes))
            got = [shard_bounds(dim0, r, world) for r in range(world)]
            assert [e - s for s, e in got] == sizes, (dim0, world, got)
            assert got[0][0] == 0 and got[-1][1] == dim0
            assert all(got[r][1] == got[r + 1][0] for r in range(world - 1))
