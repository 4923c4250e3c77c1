"""CUDA checks (``pytest -m gpu``; run by bench/gpu_check.sh on an H200), skipped without CUDA,
and CPU smoke tests of the GPU script's Python parts (bench/gpu_check.py --tiny --device cpu).

- per-example norms of the clipping engine on CUDA (float32, TF32 off) equal a CPU float64
  reference: tiny GPT-2 (tied wte/lm_head, padded batch) and nf_resnet_tiny (ScaledStdConv2d);
- the per-example dropout hash on CUDA gives the CPU's masks (int64 wrap-around arithmetic);
- the counter-based noise on CUDA: any split of a parameter's coordinates into shard slices
  gives exactly the numbers of one full draw (what makes a release world-size invariant); CUDA's
  numbers differ from CPU's (different generators), both standard normal;
- a bf16 autocast private step (performance.dtype=bfloat16) runs on CUDA and stays finite;
- in float32 and bf16, a longer example in a microbatch (clip factor 0) leaves the others'
  clipped sum as it was to float32 rounding (the kernels' shape dependence, docs/privacy.md);
- augmentation views on CUDA equal CPU's; an NF-ResNet run with augmult and EMA on CUDA;
- the whole trainer on CUDA in float32 and the same run on CPU agree up to the noise, which
  differs by device: with sigma = 0 the parameters match;
- the audit's canaries on CUDA release exactly C/b at their coordinates when present;
- the engine's row check on CUDA: GPT-2 with dropout passes and keeps the CUDA RNG, a batch mean
  is refused;
- with TF32 on (matmuls and cuDNN's default convolutions) the engine's norms are those without
  it, bit for bit, and one clipped example adds C (its query runs in IEEE float32).
"""

from __future__ import annotations

import copy
import importlib.util
import os
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture()
def no_tf32():
    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def _lm_loss_same_dtype(model, batch):
    """dptrain's LM loss without the float32 cast of the logits (so float64 stays float64)."""
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    logits = out.logits[:, :-1]
    labels = batch["labels"][:, 1:]
    b, t = labels.shape
    nll = F.cross_entropy(logits.reshape(b * t, -1), labels.reshape(-1), ignore_index=-100,
                          reduction="none").view(b, t)
    return nll.sum(1) / (labels != -100).sum(1).clamp(min=1)


def _ce_loss(model, batch):
    return F.cross_entropy(model(batch["images"]), batch["labels"], reduction="none")


def _task_and_model(kind: str):
    from dptrain.data import DataConfig, build_data
    from dptrain.models import ModelConfig, build_model

    if kind == "gpt2":
        task = build_data(DataConfig(name="synthetic_lm", max_length=16, synthetic_train_size=16,
                                     synthetic_test_size=4), seed=0)
        cfg = ModelConfig(name="gpt2", n_layer=2, n_embd=32, n_head=2, n_positions=16)
    else:
        task = build_data(DataConfig(name="synthetic_images", image_size=16,
                                     synthetic_train_size=16, synthetic_test_size=4), seed=0)
        cfg = ModelConfig(name="timm", timm_name="nf_resnet_tiny")
    torch.manual_seed(0)
    return task, build_model(cfg, task.info).train()


def _to(batch, device, dtype=None):
    out = {}
    for k, v in batch.items():
        v = v.to(device)
        out[k] = v.to(dtype) if (dtype is not None and v.is_floating_point()) else v
    return out


@pytest.fixture()
def tf32_on():
    """TF32 for float32 matmuls (``set_float32_matmul_precision("high")``) and cuDNN's default
    TF32 convolutions, put back afterwards."""
    before = (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32)
    torch.set_float32_matmul_precision("high")
    torch.backends.cudnn.allow_tf32 = True
    yield
    torch.set_float32_matmul_precision(before[0])
    torch.backends.cudnn.allow_tf32 = before[1]


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("kind", ["gpt2", "nf"])
@pytest.mark.parametrize("mode", ["bookkeeping", "two_pass"])
def test_the_query_ignores_tf32_and_one_example_adds_at_most_c(kind, mode, tf32_on):
    """The engine's query runs in IEEE float32 whatever the process's TF32 settings
    (dptrain/clipping/precision.py): its norms are those without TF32, bit for bit, and one
    clipped example adds C to 1e-5 (TF32 products round norms and sums ~1e-3 apart)."""
    from dptrain.clipping import ClippingEngine, per_example_grad_norms

    task, model = _task_and_model(kind)
    model = model.cuda().eval()  # (dropout off: the two norm calls see the same function)
    loss = _lm_loss_same_dtype if kind == "gpt2" else _ce_loss
    batch = _to(task.train.collate(np.arange(4)), "cuda")
    got = per_example_grad_norms(model, loss, batch)
    assert torch.get_float32_matmul_precision() == "high"  # the process's setting is back
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False
    exact = per_example_grad_norms(model, loss, batch)
    torch.set_float32_matmul_precision("high")
    torch.backends.cudnn.allow_tf32 = True
    assert torch.equal(got, exact)
    one = {k: v[:1] for k, v in batch.items()}
    C = float(exact[0]) / 50
    acc: dict = {}
    ClippingEngine(model, clip_norm=C, ghost="ghost", mode=mode).accumulate(loss, one, acc)
    added = float(torch.cat([v.reshape(-1).double() for v in acc.values()]).norm())
    assert abs(added / C - 1) <= 1e-5, added / C


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("kind, rtol", [("gpt2", 1e-4), ("nf", 1e-3)])
def test_engine_norms_on_cuda_equal_cpu_float64(kind, rtol, no_tf32):
    from dptrain.clipping import per_example_grad_norms

    task, model = _task_and_model(kind)
    loss = _lm_loss_same_dtype if kind == "gpt2" else _ce_loss
    batch = task.train.collate(np.arange(8))
    ref_model = copy.deepcopy(model).double()
    ref = per_example_grad_norms(ref_model, loss, _to(batch, "cpu", torch.float64))
    got = per_example_grad_norms(model.cuda(), loss, _to(batch, "cuda")).double().cpu()
    assert ref.shape == got.shape == (8,) and bool((ref > 0).all())
    assert torch.allclose(got, ref, rtol=rtol, atol=0), (got / ref - 1).abs().max()


@pytest.mark.gpu
@cuda
def test_row_check_on_cuda_passes_gpt2_with_dropout_refuses_mixing_and_keeps_the_rng():
    """The engine's row check (dptrain/clipping/rows.py) on CUDA: a GPT-2 with torch's dropout
    passes without a 'could not check' warning (the CUDA RNG is forked and set back for each
    forward) and leaves the CUDA RNG where it was; a batch mean before a layer is refused."""
    import warnings

    from dptrain.clipping import ClippingEngine

    task, model = _task_and_model("gpt2")
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.1
    model = model.cuda()
    batch = _to(task.train.collate(np.arange(6)), "cuda")
    torch.cuda.manual_seed(5)
    before = torch.cuda.get_rng_state()
    engine = ClippingEngine(model, clip_norm=0.5)
    engine._rows_checked = True
    engine.accumulate(_lm_loss_same_dtype, batch, {})
    after_unchecked = torch.cuda.get_rng_state()
    torch.cuda.set_rng_state(before)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = ClippingEngine(model, clip_norm=0.5)
        engine.accumulate(_lm_loss_same_dtype, batch, {})
    assert engine._rows_checked
    assert not [w for w in caught if "could not check" in str(w.message)]
    assert torch.equal(torch.cuda.get_rng_state(), after_unchecked)

    class Centred(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)

        def forward(self, x):
            h = self.a(x)
            return self.b(h - h.mean(0))

    x = torch.randn(5, 4, device="cuda")
    with pytest.raises(ValueError, match="rows of the input of b"):
        ClippingEngine(Centred().cuda(), clip_norm=1.0).accumulate(
            lambda m, b: m(b[0]).pow(2).sum(1), (x,), {})


@pytest.mark.gpu
@cuda
def test_dropout_masks_on_cuda_equal_cpu():
    """The per-example dropout hash in int64 on CUDA gives the CPU's (and the integer
    SplitMix64's) bits: the same masks on any device, so runs stay comparable across them."""
    import random

    from dptrain.models.dropout import ExampleDropout, mix64
    from dptrain.privacy.sampling import _mix64_int

    rng = random.Random(1)
    words = [rng.getrandbits(64) for _ in range(1000)]
    signed = torch.tensor([w - (1 << 64) if w >= 1 << 63 else w for w in words],
                          dtype=torch.int64, device="cuda")
    assert [int(v) & ((1 << 64) - 1) for v in mix64(signed).cpu()] == [_mix64_int(w)
                                                                        for w in words]
    masks = []
    for dev in ("cpu", "cuda"):
        with ExampleDropout(seed=3, step=5, indices=[7, 1, 40]):
            masks.append(F.dropout(torch.ones(3, 4, 16, 16, device=dev), 0.1,
                                   training=True).cpu())
    assert torch.equal(masks[0], masks[1])


@pytest.mark.gpu
@cuda
def test_augmult_views_on_cuda_equal_cpu_and_an_image_run_with_views_and_ema_trains():
    """The views' hash and crop/flip indexing on CUDA give the CPU's images; an NF-ResNet run
    with augmult 2 and a parameter EMA takes its steps on CUDA and evaluates both models."""
    from dptrain.data.augment import augment_images, view_offsets

    x = torch.randn(6, 3, 16, 16)
    views = []
    for dev in ("cpu", "cuda"):
        dy, dx, flip = view_offsets(3, 9, 1, torch.arange(10, 16), 2, device=dev)
        views.append(augment_images(x.to(dev), dy, dx, flip, 2).cpu())
    assert torch.equal(views[0], views[1])
    t = _trainer("performance.device=cuda", "privacy.steps=2", "model.name=timm",
                 "model.timm_name=nf_resnet_tiny", "data.name=synthetic_images",
                 "data.image_size=16", "optim.preset=nfresnet", "data.augmult=2",
                 "optim.ema_decay=0.9")
    while t.step < t.plan.steps:
        t.private_step()
    metrics = t.evaluate()
    assert np.isfinite(metrics["loss"]) and np.isfinite(metrics["last_iterate_loss"])
    assert t.optimizer.ema.count == 2


@pytest.mark.gpu
@cuda
def test_noise_on_cuda_is_the_same_numbers_for_any_shard_split():
    from dptrain.parallel.dist import shard_bounds
    from dptrain.privacy.noise import BLOCK, gaussian_noise

    rows, cols = 3 * BLOCK // 64 + 7, 64  # crosses block boundaries mid-row
    numel = rows * cols
    full = gaussian_noise(11, 3, "transformer.h.0.attn.c_attn.weight", numel, device="cuda")
    assert full.device.type == "cuda" and full.shape == (numel,)
    for world in (2, 3, 4, 8):
        parts = []
        for r in range(world):
            a, b = shard_bounds(rows, r, world)
            parts.append(gaussian_noise(11, 3, "transformer.h.0.attn.c_attn.weight", numel,
                                        a * cols, b * cols, device="cuda"))
        assert torch.equal(torch.cat(parts), full), world
    # drawn on the CPU and copied: the CPU's numbers exactly
    assert torch.equal(full.cpu(), gaussian_noise(11, 3, "transformer.h.0.attn.c_attn.weight",
                                                  numel))
    # another step / key / seed: other numbers; every draw standard normal
    other = gaussian_noise(11, 4, "transformer.h.0.attn.c_attn.weight", numel, device="cuda")
    assert not torch.equal(other, full)
    for z in (full, other):
        assert abs(float(z.mean())) < 5 / numel ** 0.5
        assert abs(float(z.std()) - 1) < 5 / (2 * numel) ** 0.5
    # float64 is drawn in float64; repeated draws are bit-identical
    z64 = gaussian_noise(11, 3, "k", 1000, device="cuda", dtype=torch.float64)
    assert z64.dtype == torch.float64
    assert torch.equal(z64, gaussian_noise(11, 3, "k", 1000, device="cuda", dtype=torch.float64))


def _trainer(*overrides: str):
    from dptrain.config import load
    from dptrain.trainer import RunConfig, Trainer

    return Trainer(load(RunConfig, TINY, ["train.checkpoint_every=0", "train.progress=false",
                                          *overrides]))


@pytest.mark.gpu
@cuda
def test_bf16_autocast_private_steps_run_on_cuda():
    t = _trainer("performance.device=cuda", "performance.dtype=bfloat16", "privacy.steps=3")
    before = {n: p.detach().clone() for n, p in t.named_params}
    rows = [t.private_step() for _ in range(3)]
    assert all(np.isfinite(r["train_loss"]) for r in rows)
    for n, p in t.named_params:
        assert p.device.type == "cuda" and p.dtype == torch.float32  # autocast: fp32 master
        assert torch.isfinite(p).all(), n
    assert any(not torch.equal(p, before[n]) for n, p in t.named_params)
    assert np.isfinite(t.evaluate()["nll_per_token"])


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("config", ["tiny.yaml", "tiny_llama.yaml"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_on_cuda_a_longer_example_leaves_the_others_clipped_sum(config, dtype, no_tf32):
    # docs/privacy.md: in bfloat16, kernels chosen by shape can round the other examples'
    # values apart when a longer example changes the microbatch's padded length (on CPU eager
    # attention keeps them to float32 rounding: tests/test_causal_lm.py)
    from dptrain.config import load
    from dptrain.trainer import RunConfig, Trainer
    from test_causal_lm import _others_moved_by_a_longer_example

    t = Trainer(load(RunConfig, str(ROOT / "configs" / config), [
        "train.progress=false", "train.checkpoint_every=0", "privacy.clip_norm=1e-4",
        "performance.device=cuda", f"performance.dtype={dtype}"]))
    moved = _others_moved_by_a_longer_example(t)
    print(f"{config} {dtype}: the others' clipped sum moved by {moved:.3g} C")
    assert moved < 1e-5


@pytest.mark.gpu
@cuda
def test_noise_drawn_in_the_background_on_cuda_gives_the_same_release(no_tf32):
    """auto is background with CUDA (pinned host memory, asynchronous copies): the same noise,
    bit for bit, as drawn after the microbatches, and the CPU's numbers. Bit for bit only where
    the clipped sum is exactly zero: CUDA's float32 index_add_ (the embedding's clipped sum)
    adds in a different order on each call (seen on the H200, 2026-11-30)."""
    from dptrain.privacy.noise import gaussian_noise

    auto, inline = (_trainer("performance.device=cuda", f"performance.noise_prefetch={w}")
                    for w in ("auto", "inline"))
    assert auto.noise_prefetch and not inline.noise_prefetch
    assert auto.collate_prefetch and inline.collate_prefetch  # (auto: background with CUDA)
    for step in range(2):
        a, _ = auto.release(step)
        b, _ = inline.release(step)
        for name in b:  # a noise mismatch would be of the order of the noise itself
            assert a[name].device.type == "cuda"
            rel = float((a[name] - b[name]).norm() / b[name].norm())
            assert rel < 1e-5, (name, rel)
    for t in (auto, inline):  # no dependence on the parameters: every clipped sum is exactly 0
        t.task.loss_fn = lambda model, batch: sum(p.sum() for p in model.parameters()) * 0.0 \
            + torch.zeros(batch["input_ids"].shape[0], device="cuda")
    a, _ = auto.release(2)
    b, _ = inline.release(2)
    for name, p in auto.named_params:
        assert torch.equal(a[name], b[name]), name
    name, p = auto.named_params[0]
    assert torch.equal(auto.noise(1, name, p).cpu(), gaussian_noise(
        auto._privacy_seed, 1, name, p.numel(), dtype=torch.float32).view_as(p.cpu()))


@pytest.mark.gpu
@cuda
def test_cuda_peak_memory_counts_allocations_in_its_window():
    from dptrain.telemetry import peak_memory_bytes

    dev = torch.device("cuda")
    torch.cuda.synchronize()
    peak_memory_bytes(dev, reset=True)
    x = torch.empty(256 * 2**20, device=dev)  # 1 GiB
    assert peak_memory_bytes(dev, reset=True) >= 2**30  # and a new window starts
    del x
    assert peak_memory_bytes(dev) < 2**30


@pytest.mark.gpu
@cuda
def test_trainer_on_cuda_equals_cpu_without_noise(no_tf32):
    common = ("privacy.noise_multiplier=0.0", "privacy.epsilon=null", "privacy.steps=3")
    runs = {}
    for device in ("cpu", "cuda"):
        t = _trainer(f"performance.device={device}", *common)
        while t.step < t.plan.steps:
            t.private_step()
        runs[device] = {n: p.detach().double().cpu() for n, p in t.named_params}
    for n, ref in runs["cpu"].items():
        rel = float((runs["cuda"][n] - ref).norm() / ref.norm().clamp_min(1e-12))
        assert rel < 1e-3, (n, rel)


@pytest.mark.gpu
@cuda
def test_audit_canaries_on_cuda_release_exactly_C_at_their_coordinates(no_tf32):
    # sigma = 0: a canary's coordinate releases C/b when the canary is present, 0 otherwise
    # (the model's gradient is removed there); the scores are those releases times b
    from dptrain.privacy.audit import GradientCanaries

    t = _trainer("performance.device=cuda", "privacy.noise_multiplier=0.0",
                 "privacy.epsilon=null", "privacy.steps=2", "privacy.sample_rate=0.5")
    shapes = [(n, tuple(p.shape)) for n, p in t.named_params]
    t.audit = can = GradientCanaries(shapes, 200, t.plan.clip_norm, t.plan.sample_rate, seed=0)
    released, _ = t.release(0)
    present = can.included & can.sampled(0)
    got = np.array([float(released[n].reshape(-1)[k]) for n, k in zip(can.names, can.index)])
    np.testing.assert_allclose(got * t.plan.denominator, present * t.plan.clip_norm, atol=1e-5)
    np.testing.assert_allclose(can.scores, present * t.plan.clip_norm, atol=1e-5)


# ------------------------------------------------------------------------------------------
# CPU: the GPU script's Python parts in their tiny mode, and the script's syntax


def _gpu_check_module():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("model", ["gpt2_small", "nf_resnet50"])
def test_gpu_check_tiny_on_cpu(model, tmp_path):
    gc = _gpu_check_module()
    before = torch.get_num_threads()
    try:
        res = gc.main(["--model", model, "--tiny", "--device", "cpu", "--steps", "3",
                       "--rounds", "2", "--out", str(tmp_path), "--json-out",
                       str(tmp_path / "r.json")])
    finally:
        torch.set_num_threads(before)
    tr, c = res["train"], res["compare"]
    assert tr["exit_code"] == 0 and tr["steps"] == 3
    assert tr["examples_per_s"] > 0 and len(tr["logical_batches"]) == 3
    assert (tmp_path / "run" / "final" / "model.safetensors").exists()
    assert c["dp_over_nonprivate"] > 0 and c["private_examples_per_s"] > 0
    # every variant of a round times the same logical batch (a private step advances the
    # step: the non-private one took the next step's batch), one per timed round
    sizes = c["logical_batches"]
    assert sizes["private"] == sizes["private_inline"] == sizes["nonprivate"]
    assert len(sizes["private"]) == 2 and min(sizes["private"]) > 0
    assert (tmp_path / "r.json").read_text().startswith("{")
    if model == "gpt2_small":  # DP-Muon-IM K = 2: timed from the first step with 2 past states
        assert "optim.inner_momentum.k_muon=2" in res["overrides"]
    assert tr["timed_from_step"] == (2 if model == "gpt2_small" else 1)


def test_gpu_check_skips_the_parts_its_budget_has_no_room_for(tmp_path):
    # the device tool kills a command at its limit, and the summary with it: the script's
    # budget, not the sum of its timeouts (830 s), bounds the run
    out = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--dry-run"],
                         env={**os.environ, "GPU_CHECK_BUDGET": "1",
                              "OUT": str(tmp_path)},
                         capture_output=True, text=True, timeout=120, check=True).stdout
    statuses = re.findall(r"^(\w+)\s+(.*)$", out.split("=== summary")[1], flags=re.M)
    ran = {k: v for k, v in statuses if not v.startswith("skipped") and v != "not run"}
    assert not ran, ran
    assert sum("skipped (under 30 s of the 4 s budget left)" in v for _, v in statuses) >= 10
    # and no earlier run's numbers: its logs are gone, and only parts that ran are summed up
    assert not list(Path("/tmp/gpu_check_logs").glob("*.log"))
    assert not re.search(r"^\w+: \{", out.split("=== summary")[1], flags=re.M)


def test_gpu_check_script_is_valid_bash_with_a_timeout_per_part():
    script = ROOT / "bench" / "gpu_check.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    for part in ("pytest", "gpu_check.py --model gpt2_small", "gpu_check.py --model nf_resnet50",
                 "dp_step.py", "inner_momentum.py"):
        assert part in text, part
    # every part runs through part(), which wraps it in `timeout`
    assert "timeout --signal=TERM" in text
    assert sum(line.lstrip().startswith("part ") for line in text.splitlines()) >= 5
    # every part named in the status summary; every benchmark part's JSON line in the last one
    names = {line.split()[1] for line in text.splitlines() if line.lstrip().startswith("part ")}
    summary, results = re.findall(r"^for k in ([^;]*); do", text, flags=re.M)
    assert names <= set(summary.split()) - {"\\"}
    assert names - {"install", "pytest_gpu"} <= set(results.split()) - {"\\"}
    assert "--no-deps" in text and "bench/wheels" in text
