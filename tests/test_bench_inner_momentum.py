"""Smoke test of bench/inner_momentum.py (issue 4) on a tiny GPT-2: one round, no timing claims.

Checks that every variant (non-private, DP-IM at K = 0 and 1, the split microbatch, the Opacus
and torch.func naive IMs) builds and steps, that the last printed line is one JSON object with
the keys BENCHMARKS.md and issue 4 rely on, and that the naive IMs and dptrain compute the same
update (same query, same clipping: the speed comparison is between equal computations).
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("opacus")
pytest.importorskip("transformers")

from _bench import load_bench as _load  # noqa: E402


@pytest.fixture(scope="module")
def bench():
    return _load("inner_momentum")


def test_last_line_is_json_with_required_keys(bench, capsys):
    bench.main(["--tiny", "--ks", "0,1", "--naive-k", "1", "--rounds", "1", "--no-memory"])
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("time_over_nonprivate", "memory_over_k0", "marginal_over_nonprivate",
                "naive_over_dptrain", "naive_over_dptrain_vmap", "naive_baseline", "split",
                "targets_met", "machine", "config", "date", "variants"):
        assert key in summary, key
    assert set(summary["time_over_nonprivate"]) == {"0", "1"}
    assert set(summary["memory_over_k0"]) == {"0", "1"}
    assert all(summary["time_over_nonprivate"][k] > 0 for k in ("0", "1"))
    assert "1" in summary["marginal_over_nonprivate"]
    assert summary["naive_over_dptrain"]["1"] > 0
    assert summary["naive_over_dptrain_vmap"]["1"] > 0
    for row in summary["variants"].values():
        assert "error" not in row, row
        assert row["median_s"] > 0


@pytest.mark.parametrize("sigma", [0.0, 1.0])
def test_naive_ims_and_dptrain_take_the_same_step(bench, sigma):
    # with noise too: every variant adds the same Z at the same coordinates (the Opacus copy
    # holds Conv1D weights transposed; its noise drawn in that layout differed by 6.9e-2)
    cfg = bench.tiny_config()
    cfg.noise_multiplier, cfg.lr, cfg.clip_norm, cfg.perturb = sigma, 1.0, 0.05, 0.05
    updates = {}
    for v in ("k2", "k2_split2", "k2_memory", "naive_k2", "naive_vmap_k2"):
        step = bench.build_variant(v, cfg)
        before = {n: x.clone() for n, x in step.params().items()}
        step()
        updates[v] = {n: before[n] - x for n, x in step.params().items()}
    ref = updates["k2"]
    scale = max(float(d.abs().max()) for d in ref.values())
    assert scale > 0
    for v, upd in updates.items():
        assert set(upd) == set(ref), v
        for n in ref:
            torch.testing.assert_close(upd[n], ref[n], rtol=0, atol=1e-5 * scale, msg=v)


def test_peak_child_measures_history_and_step(bench):
    common = _load("common")
    cfg = bench.tiny_config()
    out = common.child_peak(lambda: bench.build_variant("k1", cfg), steps=1)
    assert "error" not in out, out
    assert out["peak_bytes"] >= 0 and out["baseline_bytes"] > 0


def test_inprocess_memory_gives_every_variant_its_own_peak(bench):
    """The path bench/gpu_check.sh takes on CUDA, here on CPU (live tensor storages; the
    resident set of a process that already ran a variant mostly reuses freed memory and once
    came out 12 KiB below its baseline): every variant is measured alone, none fails, and what
    K = 1 adds to K = 0's peak is about the floor estimate of the engine's forms."""
    cfg = bench.tiny_config()
    cfg.gpt2.batch_size, cfg.gpt2.width, cfg.gpt2.vocab_size = 8, 64, 4096
    cfg.ks, cfg.naive, cfg.split, cfg.memory_steps = [0, 1], [], 1, 1
    out = bench.run_memory_inprocess(cfg, ["k1", "k0"], lambda msg: None)
    assert set(out) == {"k0", "k1"}
    for v, r in out.items():
        assert "error" not in r, (v, r)
    assert out["k0"]["peak_bytes"] > 0
    # the floor of the engine's forms (held_bytes, memory_floor_bytes) is what K = 1 adds, to
    # within its approximation (K = 0's peak stands for the last state's own; 1.8% here)
    floor = bench.memory_floor_bytes(bench.held_bytes(cfg), bench.weight_bytes(cfg), 1)
    extra = out["k1"]["peak_bytes"] - out["k0"]["peak_bytes"]
    assert 0.9 * floor <= extra <= 1.5 * floor, (extra, floor)


def test_ghost_variant_and_noise_modes_take_the_same_step(bench):
    """Without noise, k1_ghost (every norm in ghost form, noise drawn in the step) takes k1's
    update; with noise, "ahead" adds the noise drawn when the variant was built and "in_step"
    the step's own."""
    cfg = bench.tiny_config()
    cfg.lr, cfg.clip_norm, cfg.perturb = 1.0, 0.05, 0.05
    updates = {}
    for noise, sigma, v in (("ahead", 0.0, "k1"), ("in_step", 0.0, "k1_ghost"),
                            ("ahead", 1.0, "k1"), ("in_step", 1.0, "k1")):
        cfg.noise, cfg.noise_multiplier = noise, sigma
        step = bench.build_variant(v, cfg)
        before = {n: x.clone() for n, x in step.params().items()}
        step()
        updates[noise, sigma, v] = {n: before[n] - x for n, x in step.params().items()}
    ref = updates["ahead", 0.0, "k1"]
    for n in ref:
        torch.testing.assert_close(updates["in_step", 0.0, "k1_ghost"][n], ref[n], rtol=1e-4,
                                   atol=1e-7)
    # "ahead": the noise in the update is sigma*C*Z_0/B (the draw made when the variant was
    # built), whatever the step; "in_step" draws the step's own Z_K instead
    B = cfg.gpt2.batch_size
    for n, r in ref.items():
        z0 = bench._draw_noise(cfg, 0, n, torch.empty_like(r))
        zk = bench._draw_noise(cfg, 1, n, torch.empty_like(r))
        for mode, z in (("ahead", z0), ("in_step", zk)):
            torch.testing.assert_close(updates[mode, 1.0, "k1"][n] - r,
                                       cfg.lr * cfg.clip_norm * z / B, rtol=1e-3, atol=1e-6)


def test_profile_step_counts_more_operator_calls_for_two_states_than_none():
    """bench/profile_step.py (part of bench/gpu_check.sh): per variant, the profiled operators;
    a K = 1 step (two states' forward/backward, norms, clipped sum) runs more of them than the
    non-private step on the same model and batch (counted, not timed)."""
    prof = _load("profile_step")
    res = prof.main(["--tiny", "--variants", "nonprivate,k1", "--steps", "2", "--top", "5"])
    for v in ("nonprivate", "k1"):
        assert res[v]["wall_s_per_step"] > 0
        assert len(res[v]["top_cpu"]) == 5
        assert all(op and n >= 0 for op, _, n in res[v]["top_cpu"])
        assert res[v]["cpu_ops_s_per_step"] > 0
    # operator calls, not their times: on a tiny model a timing comparison is noise (a full
    # suite run measured the non-private step's operators at 2x a K = 1 step's)
    assert res["k1"]["cpu_op_calls_per_step"] > 1.5 * res["nonprivate"]["cpu_op_calls_per_step"]


def test_profile_sync_sites_name_the_python_frames_of_an_operator():
    """The stack report bench/profile_step.py gives for CUDA synchronisations, exercised on CPU
    with a CPU operator: the frames are the bench's own, and the calls per step are counted."""
    from torch.profiler import ProfilerActivity

    prof_mod = _load("profile_step")
    cfg = prof_mod.im.tiny_config()
    step = prof_mod.im.build_variant("nonprivate", cfg)
    step()
    with prof_mod.stack_profile([ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            step()
    rows = prof_mod.sync_sites(prof, 2, keys=("aten::mean",))  # the step's loss.mean()
    assert rows and all(calls > 0 for calls, _, _ in rows)
    frames = [f for _, _, fr in rows for f in fr]
    assert any("inner_momentum.py" in f or "gpt2_bench.py" in f for f in frames), frames
    assert prof_mod.sync_sites(prof, 2) == []  # no CUDA synchronisation on CPU


def test_held_bytes_are_the_contributions_factors_and_buffers(bench):
    """The floor's inputs, from one engine forward and backward of the tiny GPT-2: a Conv1D
    weight holds its layer's input and output gradient per state, or a B x in x out buffer; the
    tied wte holds the embedding's ids and output gradient and the head's input and logits'
    gradient."""
    cfg = bench.tiny_config()
    s = cfg.gpt2
    B, T, d, V = s.batch_size, s.seq_len, s.width, s.vocab_size
    held = bench.held_bytes(cfg)
    assert held["transformer.h.0.mlp.c_fc.weight"] == {
        "captured": B * T * (d + 4 * d) * 4, "instantiated": B * d * 4 * d * 4}
    assert held["transformer.h.0.mlp.c_fc.bias"] == {
        "captured": B * 4 * d * 4, "instantiated": B * 4 * d * 4}
    assert held["transformer.wte.weight"] == {
        "captured": B * T * 8 + B * T * d * 4 + B * T * V * 4 + B * T * d * 4,
        "instantiated": B * V * d * 4}
    model = bench.build_gpt2(s, cfg.seed, "cpu")
    assert set(held) == {n for n, p in model.named_parameters() if p.requires_grad}


def test_memory_floor_takes_the_smaller_form_per_parameter(bench):
    held = {"a": {"captured": 10, "instantiated": 25}, "b": {"captured": 3, "instantiated": 2}}
    assert bench.memory_floor_bytes(held, 100, 0) == 0
    assert bench.memory_floor_bytes(held, 100, 1) == 100 + 10 + 2
    assert bench.memory_floor_bytes(held, 100, 2) == 200 + 20 + 2
    assert bench.memory_floor_bytes(held, 100, 4) == 400 + 25 + 2
    cfg = bench.tiny_config()
    cfg.ks, cfg.naive, cfg.split = [0, 1], [], 1
    wb = bench.weight_bytes(cfg)
    res = {"times": {}, "cpu_times": {}, "errors": {}, "held": held,
           "memory": {"k0": {"peak_bytes": 1000}, "k1": {"peak_bytes": 1000 + 3 * wb}}}
    out = bench.summarize(res, cfg)
    floor1 = 1000 + wb + 12
    assert out["memory_floor_over_k0"] == {"0": 1.0, "1": floor1 / 1000}
    assert out["memory_over_floor"]["1"] == (1000 + 3 * wb) / floor1
    assert out["held_mib"] == {"captured": 13 / 2**20, "instantiated": 27 / 2**20}
