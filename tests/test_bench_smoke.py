"""Smoke test of bench/dp_step.py's building blocks on tiny models: one round, no timing claims.

Checks that every variant builds and steps (Opacus ghost and hooks on the converted GPT-2 copy,
dptrain on the stock one), that the peak-memory child measurement returns a number, and that the
last printed line is one JSON object with the keys BENCHMARKS.md and issue 2 rely on.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

pytest.importorskip("opacus")
pytest.importorskip("transformers")

from _bench import load_bench as _load  # noqa: E402


def test_dp_step_last_line_is_json_with_required_keys(capsys):
    dp_step = _load("dp_step")
    dp_step.main(["--tiny", "--models", "gpt2", "--rounds", "1", "--no-memory"])
    lines = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(lines[-1])
    for key in ("dp_over_nonprivate", "opacus_over_dptrain", "peak_memory_ratio", "faster_mode",
                "machine", "default_mode", "gpt2", "config", "date"):
        assert key in summary, key
    assert summary["faster_mode"] in ("bookkeeping", "two_pass")
    assert summary["dp_over_nonprivate"] > 0
    assert summary["opacus_over_dptrain"] > 0  # Opacus ran on the converted copy
    rows = summary["gpt2"]
    assert set(rows) == set(dp_step.VARIANTS)
    for variant in ("nonprivate", "dptrain_bookkeeping", "dptrain_two_pass", "opacus_ghost"):
        assert "error" not in rows[variant], rows[variant]
        assert rows[variant]["median_s"] > 0


def test_dp_step_times_the_vit_with_its_tapped_tokens(capsys):
    dp_step = _load("dp_step")
    dp_step.main(["--tiny", "--models", "vit", "--rounds", "1", "--no-memory"])
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["config"]["vit"]["timm_kwargs"]["img_size"] == 16  # built for its images
    rows = summary["vit"]
    assert set(rows) == set(dp_step.VARIANTS)
    for variant in ("nonprivate", "dptrain_bookkeeping", "dptrain_two_pass"):
        assert "error" not in rows[variant], rows[variant]
    assert summary["vit_dp_over_nonprivate"] > 0


def test_child_peak_measures_a_step():
    common = _load("common")
    dp_step = _load("dp_step")
    cfg = dp_step.tiny_config()
    out = common.child_peak(lambda: dp_step.build_variant("gpt2", "dptrain_bookkeeping", cfg),
                            steps=1)
    assert "error" not in out, out
    assert out["peak_bytes"] >= 0 and out["baseline_bytes"] > 0


def test_failing_variant_is_recorded_not_raised():
    common = _load("common")

    def boom():
        raise RuntimeError("in-place view\nsecond line")

    times, errors = common.time_interleaved({"ok": lambda: None, "bad": boom}, rounds=2)
    assert errors == {"bad": "RuntimeError: in-place view"}
    assert len(times.wall["ok"]) == 2 and "bad" not in times.wall


def test_rows_check_bench_times_a_passing_check_on_both_models(capsys):
    # the check it times must pass on dp_step's models (an assertion inside the timed call), and
    # the last line is one JSON object with each model's ratio against the private step
    rows_check = _load("rows_check")
    rows_check.main(["--tiny", "--rounds", "1"])
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for kind in ("gpt2", "nfresnet"):
        r = summary[kind]
        assert r["check_s"] > 0 and r["private_step_s"] > 0
        assert r["check_over_step"] == pytest.approx(r["check_s"] / r["private_step_s"])


def test_cancellation_guard_bench_restores_the_check_and_sees_it_run(capsys):
    # the variant without the check must not leave it off, and the check must have run (no
    # example flagged in these batches)
    from dptrain.clipping import engine

    real = engine.cancelled
    bench = _load("cancellation_guard")
    bench.main(["--tiny", "--rounds", "1", "--ghost", "ghost"])
    assert engine.cancelled is real
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for kind in ("gpt2", "nfresnet"):
        r = summary[kind]
        assert r["flagged_examples"] == 0 and r["parameter_checks"] > 0 and r["guarded_s"] > 0
        assert r["guard_over_unguarded"] == pytest.approx(r["guarded_s"] / r["unguarded_s"])


def test_decode_bench_decodes_the_same_tensor_on_every_thread_count(capsys):
    decode = _load("decode")
    summary = decode.main(["--images", "6", "--size", "16", "--threads", "1,3", "--rounds", "1",
                           "--prefetch"])
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["same_tensor"] is True and last["errors"] == {}
    assert set(last["speedup"]) == {"1", "3"} and last["speedup"]["1"] == 1.0
    assert last["images"] == 6 and summary["seconds_per_image"]["3"] > 0
    assert last["prefetch_errors"] == {} and last["prefetch_speedup"] > 0


def test_muon_s_sigma_bench_restores_lanczos_and_measures_both_methods(capsys):
    import dptrain.optim.muon as muon

    before = muon.top_singular_value
    out = _load("muon_s_sigma").main(["--width", "16", "--steps", "3", "--rounds", "1",
                                      "--noise", "5"])
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last == out and muon.top_singular_value is before  # the variant's patch undone
    # the old method's error on noise-dominated momentum, and Lanczos' float32 rounding
    assert out["max_sigma_error"]["power3"] > 1e-2 > 1e-5 > out["max_sigma_error"]["lanczos"]
    assert 2 <= out["lanczos_products_per_matrix"]["min"] <= out["lanczos_products_per_matrix"][
        "max"] <= 50 and out["seconds_per_step"]["lanczos"] > 0
    # 6 Newton-Schulz steps bring the update to lr * sigma_1 within 1%; 5 left it 10% off
    ratio = out["update_over_lr_sigma1"]
    assert 0.99 < ratio["lanczos"]["min"] <= ratio["lanczos"]["max"] < 1.01
    assert ratio["lanczos_ns5"]["max"] > 1.1


def test_trainer_step_bench_times_both_tiny_configs(capsys):
    out = _load("trainer_step").main(["--steps", "1"])
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last == out and out["tiny.yaml"] > 0 and out["tiny_images.yaml"] > 0


@pytest.mark.parametrize("kind", ["gpt2", "nfresnet", "vit", "convnext", "llama"])
def test_dp_step_checks_each_variant_update_against_single_example_backwards(kind,
                                                                             monkeypatch):
    """bench/dp_step.py's check that its variants compute the same thing: dptrain's two modes
    agree with the single-example reference on every model, and a step that computes
    something else (here: the non-private one, no clipping) is told apart."""
    dp_step = _load("dp_step")
    cfg = dp_step.tiny_config()
    errors = dp_step.update_errors(kind, cfg, ("dptrain_bookkeeping", "dptrain_two_pass"))
    # (float64 models; two_pass weights its second backward by the clip factors in the losses'
    # dtype, float32 where the model computes them so: Llama's logits)
    assert all(e["worst"] < 1e-6 and e["overall"] < 1e-6 for e in errors.values()), errors
    real = dp_step.build_variant
    monkeypatch.setattr(dp_step, "build_variant",
                        lambda k, v, c, models=None: real(k, "nonprivate", c, models))
    wrong = dp_step.update_errors(kind, cfg, ("dptrain_bookkeeping",))["dptrain_bookkeeping"]
    assert wrong["worst"] > dp_step.SAME_UPDATE_TOLERANCE

    def vectors_left_unmoved(k, v, c, models=None):  # right but for biases, gains, norms
        models = [] if models is None else models
        step = real(k, v, c, models)
        vectors = [p for p in models[-1].parameters() if p.ndim == 1]

        def wrong_step():
            saved = [p.detach().clone() for p in vectors]
            step()
            for p, before in zip(vectors, saved):
                p.data.copy_(before)
        return wrong_step

    monkeypatch.setattr(dp_step, "build_variant", vectors_left_unmoved)
    wrong = dp_step.update_errors(kind, cfg, ("dptrain_bookkeeping",))["dptrain_bookkeeping"]
    assert wrong["worst"] == pytest.approx(1.0)

    def one_nan(k, v, c, models=None):  # right but for one parameter's NaN update
        models = [] if models is None else models
        step = real(k, v, c, models)
        last = list(models[-1].parameters())[-1]

        def wrong_step():
            step()
            last.data.fill_(float("nan"))
        return wrong_step

    monkeypatch.setattr(dp_step, "build_variant", one_nan)
    wrong = dp_step.update_errors(kind, cfg, ("dptrain_bookkeeping",))["dptrain_bookkeeping"]
    assert wrong["worst"] == math.inf  # (max() over tuples passed the NaN over)


def test_dp_step_llama_variants_make_the_same_update():
    """The Llama rows compare like with like: with every example clipped (C far below the
    norms) and no noise, one step of dptrain (both modes) and of Opacus (hooks, ghost) on the
    stock LlamaForCausalLM moves every parameter the same way; a larger C moves them otherwise."""
    import torch

    dp_step = _load("dp_step")
    cfg = dp_step.tiny_config()
    cfg.noise_multiplier, cfg.lr = 0.0, 1.0

    def updated(variant, clip_norm):
        cfg.clip_norm = clip_norm
        models: list = []
        step = dp_step.build_variant("llama", variant, cfg, models)
        before = [p.detach().clone() for p in models[0].parameters()]
        step()
        return torch.cat([(p.detach() - b).reshape(-1)
                          for p, b in zip(models[0].parameters(), before)])

    ref = updated("dptrain_bookkeeping", 1e-3)
    assert float(ref.norm()) > 0
    for variant in ("dptrain_two_pass", "opacus_hooks", "opacus_ghost"):
        got = updated(variant, 1e-3)
        assert float((got - ref).norm()) <= 1e-4 * float(ref.norm()), variant
    other = updated("dptrain_bookkeeping", 1e-2)
    assert float((other - ref).norm()) > 0.5 * float(ref.norm())


def test_lora_step_variants_make_the_same_update_and_report_json(capsys):
    """bench/lora_step.py compares like with like: with every example clipped and no noise,
    dptrain's LoRA step and Opacus ghost clipping on the same adapters (lora_B drawn away from
    peft's zeros, so both factors have gradients) move the same parameters the same way, and
    nothing frozen. Its last line is the JSON summary."""
    import torch

    lora_step = _load("lora_step")
    cfg = lora_step.tiny_config()
    cfg.noise_multiplier, cfg.lr = 0.0, 1.0

    def updated(variant):
        cfg.clip_norm = 1e-3
        models: list = []
        step = lora_step.build_variant("llama", variant, cfg, 4, models)
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for n, p in models[0].named_parameters():
                if "lora_B" in n:
                    p.copy_(0.1 * torch.randn(p.shape, generator=gen))
        before = {n: p.detach().clone() for n, p in models[0].named_parameters()}
        step()
        return {n: (p.detach() - before[n]) for n, p in models[0].named_parameters()}

    ref, got = updated("lora_dp"), updated("lora_opacus_ghost")
    moved = {n for n, d in ref.items() if d.abs().max() > 0}
    assert moved and all(".lora_" in n for n in moved)
    assert any("lora_A" in n for n in moved) and any("lora_B" in n for n in moved)
    flat = lambda d: torch.cat([d[n].reshape(-1) for n in sorted(d)])  # noqa: E731
    assert float((flat(got) - flat(ref)).norm()) <= 1e-4 * float(flat(ref).norm())

    summary = lora_step.main(["--tiny", "--model", "gpt2"])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last) == json.loads(json.dumps(summary))
    assert not any("error" in row for row in summary["variants"].values())
    assert 0 < summary["trainable_fraction"] < 1 and summary["lora_dp_over_full_dp"] > 0


def test_wds_index_bench_gives_the_same_index_three_ways(capsys):
    bench = _load("wds_index")
    bench.main(["--samples", "300", "--shards", "3", "--rounds", "1"])
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(summary["seconds"]) == {"no cache", "empty cache", "filled cache"}
    assert summary["samples"] == 300 and summary["speedup"] > 0


def test_wds_index_bench_against_a_base_revision_gives_the_same_index(capsys):
    # HEAD: a revision every clone has (a shallow one too)
    if not (Path(__file__).resolve().parents[1] / ".git").exists():
        pytest.skip("not a git checkout")
    bench = _load("wds_index")
    bench.main(["--samples", "60", "--shards", "3", "--rounds", "1", "--base", "HEAD"])
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["same_index"] is True and summary["tree_over_base"] > 0
    assert set(summary["seconds"]) == {"base (HEAD)", "this tree"}


def test_checkpoint_bench_writes_states_the_reader_accepts(tmp_path, monkeypatch):
    # bench/checkpoint.py times checkpoint.write and checkpoint.read on states it builds; the
    # reader came to require a config and RNG states, and the bench failed after its header
    import torch

    from dptrain import checkpoint as ckpt
    from dptrain.data.info import DataInfo

    bench = _load("checkpoint")
    # (a vocabulary of 512, not GPT-2's 50,257: the same state, 5x smaller)
    monkeypatch.setattr(bench, "DataInfo", lambda **kw: DataInfo(**{**kw, "vocab_size": 512}))
    state, n = bench.build("gpt2", "tiny", 0)
    path = ckpt.write(state, tmp_path / "out", state["step"], keep=1)
    back = ckpt.read(path)
    assert back["step"] == state["step"] == 1 and 3 * 10**6 < n < 4 * 10**6
    name = "transformer.h.0.attn.c_attn.weight"
    assert torch.equal(back["model"][name], state["model"][name])
