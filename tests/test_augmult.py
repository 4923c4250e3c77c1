"""Augmentation multiplicity: each example's query is the mean of its gradients over K views,
clipped once (De et al. 2022); views are a pure function of (seed, step, view, example)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap

from dptrain.clipping import ClippingEngine
from dptrain.config import ConfigError, load
from dptrain.data import DataConfig, build_data
from dptrain.data.augment import augment_batch, augment_images, view_offsets
from dptrain.trainer import RunConfig, Trainer

ROOT = Path(__file__).resolve().parents[1]
TINY_IMAGES = ROOT / "configs" / "tiny_images.yaml"
IMAGES = ["data.image_size=8", "data.synthetic_train_size=64", "model.channels=[4,8]",
          "privacy.accountant=rdp", "privacy.sample_rate=0.25", "privacy.steps=3",
          "train.progress=false", "train.checkpoint_every=0", "performance.dtype=float64"]


def trainer(*overrides: str) -> Trainer:
    return Trainer(load(RunConfig, TINY_IMAGES, [*IMAGES, *overrides]))


def test_views_crop_the_reflect_padded_image_and_flip():
    torch.manual_seed(0)
    x = torch.randn(5, 2, 6, 7, dtype=torch.float64)
    pad = 3
    dy, dx, flip = view_offsets(1, 2, 0, torch.arange(5), pad)
    out = augment_images(x, dy, dx, flip, pad)
    for b in range(5):  # one example at a time, by slicing
        xp = F.pad(x[b:b + 1], (pad,) * 4, mode="reflect")[0]
        ref = xp[:, int(dy[b]):int(dy[b]) + 6, int(dx[b]):int(dx[b]) + 7]
        if flip[b]:
            ref = ref.flip(-1)
        assert torch.equal(out[b], ref)
    # pad 0 without flips is the identity; with flips only mirrored examples change
    z = torch.zeros(5, dtype=torch.int64)
    assert torch.equal(augment_images(x, z, z, flip, 0, do_flip=False), x)
    mirrored = augment_images(x, z, z, flip, 0)
    for b in range(5):
        assert torch.equal(mirrored[b], x[b].flip(-1) if flip[b] else x[b])


def test_view_draws_are_uniform_and_depend_only_on_seed_step_view_and_example():
    idx = torch.arange(20000)
    dy, dx, flip = view_offsets(7, 3, 1, idx, pad=2)
    for v in (dy, dx):
        counts = torch.bincount(v, minlength=5)
        assert len(counts) == 5 and int(counts.min()) > 3700  # 4000 expected each
    assert 0.48 < float(flip.double().mean()) < 0.52
    # the same example gets the same view in any batch, in any order
    some = torch.tensor([19999, 5, 123])
    got = view_offsets(7, 3, 1, some, pad=2)
    for a, b in zip(got, (dy, dx, flip)):
        assert torch.equal(a, b[some])
    # and other views / steps / seeds differ
    for other in (view_offsets(7, 3, 2, idx, 2), view_offsets(7, 4, 1, idx, 2),
                  view_offsets(8, 3, 1, idx, 2)):
        assert float((other[0] != dy).double().mean()) > 0.7


def test_augmult_query_equals_the_clipped_mean_over_views_of_single_example_gradients():
    """The engine's per-example norms and clipped sum against an explicit reference: every
    example's gradient at every view (torch.func), averaged, clipped at C, summed; with inner
    momentum's per-parameter coefficients too (2 states x 3 views)."""
    import timm

    import dptrain.models.nf_tiny  # noqa: F401

    torch.manual_seed(0)
    model = timm.create_model("nf_resnet_tiny", num_classes=5, in_chans=3).double()
    xs = torch.randn(4, 3, 16, 16, dtype=torch.float64)
    ys = torch.tensor([0, 3, 1, 4])
    batch = {"images": xs, "labels": ys}
    indices = np.array([11, 2, 40, 7])
    K = 3
    views = [augment_batch(batch, seed=0, step=5, indices=indices, view=k, pad=2)
             for k in range(K)]

    def loss_batch(m, b):
        return F.cross_entropy(m(b["images"]), b["labels"], reduction="none")

    def one(p, x, y):
        return F.cross_entropy(functional_call(model, p, (x[None],)), y[None])

    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    past = {n: v + 0.05 * torch.randn_like(v) for n, v in params.items()}
    names = list(params)
    coef_now = {n: (0.6 if i % 2 else 0.7) for i, n in enumerate(names)}
    coef_past = {n: 1 - coef_now[n] for n in names}

    def reference(states_coefs, C):
        total = None
        for state, coef in states_coefs:
            for v in views:
                g = vmap(grad(one), in_dims=(None, 0, 0))(state, v["images"], v["labels"])
                g = {n: t * (coef[n] / K) for n, t in g.items()}
                total = g if total is None else {n: total[n] + g[n] for n in g}
        norms = torch.sqrt(sum(t.flatten(1).pow(2).sum(1) for t in total.values()))
        lam = torch.clamp(C / norms, max=1.0)
        return norms, {n: torch.einsum("b...,b->...", t, lam) for n, t in total.items()}

    for plan, ref_states in (
            ([(1.0, None)], [(params, {n: 1.0 for n in names})]),
            ([(coef_now, None), (coef_past, past)], [(params, coef_now), (past, coef_past)])):
        expanded = []
        for coef, state in plan:
            c = {n: a / K for n, a in coef.items()} if isinstance(coef, dict) else coef / K
            expanded += [(c, state, None, (lambda b, k=k: views[k])) for k in range(K)]
        ref_norms, _ = reference(ref_states, 1.0)
        C = float(ref_norms.median())  # some examples clipped, some not
        ref_norms, ref_sums = reference(ref_states, C)
        for form in ("ghost", "instantiate"):
            eng = ClippingEngine(model, clip_norm=C, ghost=form)
            torch.testing.assert_close(eng.per_example_norms(loss_batch, batch, expanded),
                                       ref_norms, rtol=1e-9, atol=1e-12)
            acc: dict = {}
            eng.accumulate(loss_batch, batch, acc, expanded)
            for n in ref_sums:
                torch.testing.assert_close(acc[n], ref_sums[n], rtol=1e-8, atol=1e-11)
        # the un-augmented query differs: the views are really used
        plain = ClippingEngine(model).per_example_norms(loss_batch, batch, plan)
        assert not torch.allclose(plain, ref_norms)
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), params[n])


def test_trainer_plan_has_k_views_per_state_with_coefficients_over_k():
    t = trainer("data.augmult=3")
    plan = t.with_views([(1.0, None), ({"a": 0.3}, {"a": torch.zeros(1)}, 17)], 4, np.arange(2))
    assert len(plan) == 6
    assert [e[0] for e in plan[:3]] == [1 / 3] * 3 and plan[3][0] == {"a": 0.3 / 3}
    assert [e[2] for e in plan] == [None] * 3 + [17] * 3
    batch = t.task.train.collate(np.arange(2))
    imgs = [e[3](batch)["images"] for e in plan[:3]]
    assert not torch.equal(imgs[0], imgs[1])
    assert torch.equal(plan[3][3](batch)["images"], imgs[0])  # same views at every state
    assert trainer().with_views([(1.0, None)], 0, np.arange(2)) == [(1.0, None)]


def test_augmult_release_is_the_same_in_any_microbatching_and_has_sensitivity_c():
    a, b = trainer("data.augmult=2", "performance.microbatch_size=64"), \
        trainer("data.augmult=2", "performance.microbatch_size=5")
    ra, _ = a.release(0)
    rb, _ = b.release(0)
    for n in ra:
        torch.testing.assert_close(ra[n], rb[n], rtol=1e-10, atol=1e-12)
    # adding one example changes the clipped sum of the augmult query by at most C
    t = trainer("data.augmult=4", "privacy.clip_norm=0.01")
    plan = t.optimizer.query_plan()
    s0, s1 = {}, {}
    for n, acc in ((8, s0), (9, s1)):
        idx = np.arange(n)
        t.engine.accumulate(t.task.loss_fn, t.task.train.collate(idx), acc,
                            t.with_views(plan, 0, idx))
    diff = torch.sqrt(sum((s1[n] - s0[n]).pow(2).sum() for n in s1))
    assert 0.01 * 0.5 < float(diff) <= 0.01 * (1 + 1e-9)


def test_augmult_run_trains_and_epsilon_does_not_depend_on_k(tmp_path):
    runs = {}
    for k in (0, 2):
        t = Trainer(load(RunConfig, TINY_IMAGES,
                         [*IMAGES, f"data.augmult={k}"]), tmp_path / str(k))
        runs[k] = t.run()
    assert runs[0]["epsilon"] == runs[2]["epsilon"]
    assert runs[0]["noise_multiplier"] == runs[2]["noise_multiplier"]
    assert runs[0]["test_loss"] != runs[2]["test_loss"]


@pytest.mark.parametrize("overrides, field", [
    (["data.augmult=-1"], "data.augmult"),
    (["data.augmult=2", "data.augment_pad=-2"], "data.augment_pad"),
    (["data.augmult=2", "data.augment_pad=8"], "data.augment_pad"),
])
def test_bad_augmult_settings_name_the_field(overrides, field):
    with pytest.raises(ConfigError) as e:
        trainer(*overrides)
    assert e.value.field == field


def test_augmult_on_text_is_refused():
    with pytest.raises(ConfigError) as e:
        build_data(DataConfig(name="synthetic_lm", augmult=2))
    assert e.value.field == "data.augmult"


def test_reported_training_loss_is_the_mean_over_views():
    t = trainer("data.augmult=3")
    idx = np.arange(5)
    batch = t.task.train.collate(idx)
    plan = t.with_views(t.optimizer.query_plan(), 2, idx)
    stats = t.engine.accumulate(t.task.loss_fn, batch, {}, plan)
    with torch.no_grad():
        want = sum(float(t.task.loss_fn(t.model, e[3](batch)).sum()) for e in plan) / 3
    assert stats.loss_sum == pytest.approx(want, rel=1e-6)  # float32 losses


def test_two_pass_clipping_gives_the_bookkeeping_release_with_views():
    """The second backward of ``two_pass`` runs through each view's retained graph: the same
    release as book-keeping, with inner momentum's two states x 2 views."""
    releases = []
    for mode in ("bookkeeping", "two_pass"):
        t = trainer("data.augmult=2", f"performance.clipping={mode}",
                    "optim.inner_momentum.k_muon=1", "optim.inner_momentum.k_other=1")
        t.private_step()  # a past state for the next query
        assert len(t.with_views(t.optimizer.query_plan(), 1, np.arange(2))) == 4
        releases.append(t.release(1)[0])
    for n in releases[0]:  # the losses are float32 (classification_loss): ~6e-9 either way
        rel = (releases[1][n] - releases[0][n]).norm() / releases[0][n].norm()
        assert float(rel) < 1e-7, n


def test_default_pad_is_an_eighth_of_the_side_at_least_1_and_is_used():
    from dptrain.data.augment import default_pad

    assert [default_pad(s) for s in (4, 7, 8, 16, 28, 32, 224)] == [1, 1, 1, 2, 3, 4, 28]
    # data.augment_pad null: the task's views use image_size // 8 (16 px -> pad 2)
    task = build_data(DataConfig(name="synthetic_images", synthetic_train_size=64,
                                 image_size=16, augmult=2))
    idx = np.arange(64)
    batch = task.train.collate(idx)
    got = task.augment(batch, seed=3, step=1, indices=idx, view=1)["images"]
    torch.testing.assert_close(got, augment_batch(batch, seed=3, step=1, indices=idx, view=1,
                                                  pad=2)["images"], rtol=0, atol=0)
    # and not pad 1 or 4 (the crops differ somewhere in 64 examples)
    for other in (1, 4):
        assert not torch.equal(got, augment_batch(batch, seed=3, step=1, indices=idx, view=1,
                                                  pad=other)["images"])


def test_vertical_and_horizontal_offsets_are_independent():
    dy, dx, flip = view_offsets(7, 3, 1, torch.arange(20000), pad=2)
    same = float((dy == dx).double().mean())
    assert abs(same - 0.2) < 0.015  # independent uniform on 5 values: 1/5 equal
    joint = torch.bincount(dy * 5 + dx, minlength=25)
    assert int(joint.min()) > 650  # 800 expected in each of the 25 cells
    assert abs(float((flip & (dy == 0)).double().mean()) - 0.1) < 0.01
    # the mirror is drawn apart from the horizontal offset too (a flip drawn from dx's bits
    # came with dx <= pad only: half of the (dx, flip) pairs never occurred)
    pairs = torch.bincount(dx * 2 + flip.long(), minlength=10)
    assert int(pairs.min()) > 1800  # 2000 expected in each of the 10 cells


def test_augment_flip_false_never_mirrors_and_true_does():
    idx = np.arange(32)
    for flip in (False, True):
        task = build_data(DataConfig(name="synthetic_images", synthetic_train_size=32,
                                     image_size=8, augmult=2, augment_pad=0,
                                     augment_flip=flip))
        batch = task.train.collate(idx)
        views = [task.augment(batch, seed=0, step=s, indices=idx, view=v)["images"]
                 for s in range(3) for v in range(2)]
        unchanged = all(torch.equal(v, batch["images"]) for v in views)
        assert unchanged is (not flip)
        if flip:  # every example is itself or its mirror image
            for v in views:
                for b in range(32):
                    assert (torch.equal(v[b], batch["images"][b])
                            or torch.equal(v[b], batch["images"][b].flip(-1)))


def test_augmult_1_is_one_random_view():
    task = build_data(DataConfig(name="synthetic_images", synthetic_train_size=16,
                                 image_size=8, augmult=1))
    assert task.augmult == 1 and task.augment is not None
    assert build_data(DataConfig(name="synthetic_images", synthetic_train_size=16,
                                 image_size=8)).augment is None


def test_a_pad_of_one_pixel_crops_too():
    # (the crop for every pad >= 1, not only the larger pads of the other tests)
    torch.manual_seed(1)
    x = torch.randn(64, 1, 4, 4, dtype=torch.float64)
    dy, dx, flip = view_offsets(2, 5, 0, torch.arange(64), 1)
    out = augment_images(x, dy, dx, flip, 1, do_flip=False)
    xp = F.pad(x, (1, 1, 1, 1), mode="reflect")
    for b in range(64):
        assert torch.equal(out[b], xp[b, :, int(dy[b]):int(dy[b]) + 4, int(dx[b]):int(dx[b]) + 4])
    assert bool(((dy != 1) | (dx != 1)).any())  # some views are shifted
