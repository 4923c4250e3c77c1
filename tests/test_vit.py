"""Vision transformers in `dptrain train`: timm's ViT built for small images through
``model.timm_kwargs``, the ``vit`` optimizer preset, weights from a local file
(``model.pretrained_path`` for timm), and an exact resume of a ViT run with inner momentum and
stochastic depth (its class token and position table are the engine's tapped parameters)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dptrain import checkpoint as ckpt
from dptrain.cli import main
from dptrain.config import ConfigError, load
from dptrain.data import DataInfo
from dptrain.models import ModelConfig, build_model
from dptrain.trainer import RunConfig, Trainer

timm = pytest.importorskip("timm")

ROOT = Path(__file__).resolve().parents[1]
IMAGES = str(ROOT / "configs" / "tiny_images.yaml")
VIT = ["model.name=timm", "model.timm_name=vit_tiny_patch16_224", "model.timm_kwargs.img_size=16",
       "model.timm_kwargs.patch_size=8", "model.timm_kwargs.depth=2",
       "model.timm_kwargs.embed_dim=32", "model.timm_kwargs.num_heads=2", "optim.preset=vit",
       "train.progress=false"]
IMG = DataInfo(kind="classification", num_classes=10, in_chans=3, image_size=16)


def _img(size: int) -> DataInfo:
    return DataInfo(kind="classification", num_classes=10, in_chans=3, image_size=size)


def _vit_cfg(**kwargs) -> ModelConfig:
    base = {"img_size": 16, "patch_size": 8, "depth": 2, "embed_dim": 32, "num_heads": 2}
    return ModelConfig(name="timm", timm_name="vit_tiny_patch16_224",
                       timm_kwargs={**base, **kwargs.pop("timm_kwargs", {})}, **kwargs)


def test_timm_kwargs_build_a_vit_for_small_images_and_the_preset_gives_muon_its_matrices(tmp_path):
    trainer = Trainer(load(RunConfig, IMAGES, VIT), tmp_path / "run")
    model = trainer.model
    assert model.patch_embed.img_size == (16, 16) and len(model.blocks) == 2
    groups = {g.label: {n for n, _ in g.named_params} for g in trainer.optimizer.groups}
    assert groups["matrices"] == {n for n, p in model.named_parameters()
                                  if p.ndim == 2 and n.startswith("blocks.")}
    assert {"cls_token", "pos_embed", "patch_embed.proj.weight", "head.weight",
            "head.bias"} <= groups["others"]


@pytest.mark.parametrize("method", [
    ["optim.inner_momentum.k_muon=2", "optim.inner_momentum.k_other=1"],
    # DiSK's query leads with its look-ahead state: at the resumed engine's first query the
    # tapped rows check ran after that state was swapped out, and refused the ViT
    ["optim.filter.name=disk"],
], ids=["inner_momentum", "disk"])
def test_resume_of_a_vit_run_with_stochastic_depth_is_bit_for_bit(tmp_path, method):
    extra = [*VIT, "privacy.steps=4", "model.drop_path_rate=0.2", *method]
    ref = Trainer(load(RunConfig, IMAGES, [*extra, "train.checkpoint_every=0"]), tmp_path / "ref")
    for _ in range(4):
        ref.private_step()
    cfg = load(RunConfig, IMAGES, [*extra, "train.checkpoint_every=2"])
    first = Trainer(cfg, tmp_path / "run")
    for _ in range(2):
        first.private_step()
    ckpt.save(first, tmp_path / "run")
    torch.manual_seed(999)
    second = Trainer(cfg, tmp_path / "run")
    ckpt.load(second, ckpt.find_latest(tmp_path / "run"))
    for _ in range(2):
        second.private_step()
    want, got = ref.model.state_dict(), second.model.state_dict()
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k
    assert not torch.equal(want["cls_token"], first.model.state_dict()["cls_token"])


@pytest.mark.parametrize("override, field", [
    ("model.timm_kwargs.num_classes=3", "model.timm_kwargs.num_classes"),
    ("model.timm_kwargs.pretrained=true", "model.timm_kwargs.pretrained"),
    ("model.timm_kwargs.no_such_argument=1", "model.timm_kwargs"),
    ("model.timm_kwargs=5", "model.timm_kwargs"),
    ("model.pretrained_path=/no/such/file.safetensors", "model.pretrained_path"),
    ("model.timm_kwargs.img_size=32", "model.timm_kwargs"),  # 16-pixel images
])
def test_bad_timm_settings_exit_2_with_one_line_naming_the_field(tmp_path, capsys, override,
                                                                   field):
    code = main(["train", "--config", IMAGES, "--output-dir", str(tmp_path / "out"), *VIT,
                 override])
    err = capsys.readouterr().err
    lines = [line for line in err.strip().splitlines() if line]
    assert code == 2 and len(lines) == 1 and field in lines[0], err
    assert not (tmp_path / "out" / "summary.json").exists()


def test_timm_kwargs_for_another_model_family_are_refused():
    with pytest.raises(ConfigError) as e:
        load(RunConfig, IMAGES, ["model.timm_kwargs.img_size=16"])  # model.name: cnn
    assert e.value.field == "model.timm_kwargs"


@pytest.mark.parametrize("kind", ["safetensors", "nested_pth"])
def test_timm_weights_load_from_a_local_file_with_a_fresh_head_for_other_classes(tmp_path, kind):
    torch.manual_seed(0)
    source = build_model(_vit_cfg(num_classes=12), IMG)
    state = source.state_dict()
    if kind == "safetensors":
        from safetensors.torch import save_file

        path = tmp_path / "vit.safetensors"
        save_file(state, str(path))
    else:  # a training script's checkpoint: under "state_dict", with DDP's "module." prefix
        path = tmp_path / "vit.pth"
        torch.save({"epoch": 3, "state_dict": {"module." + k: v for k, v in state.items()}}, path)
    torch.manual_seed(1)
    model = build_model(_vit_cfg(pretrained_path=str(path)), IMG)  # 10 classes: a new head
    got = model.state_dict()
    for k, v in state.items():
        if k.startswith("head."):
            assert got[k].shape[0] == 10
        else:
            assert torch.equal(got[k], v), k
    torch.manual_seed(1)
    again = build_model(_vit_cfg(pretrained_path=str(path), num_classes=12), IMG)
    for k, v in state.items():  # the same classes: the head is loaded too
        assert torch.equal(again.state_dict()[k], v), k


def test_timm_weights_of_another_model_are_refused_naming_what_differs(tmp_path):
    from safetensors.torch import save_file

    state = build_model(_vit_cfg(), IMG).state_dict()
    cases = {
        "lacks": {k: v for k, v in state.items() if k != "pos_embed"},
        "has tensors the model does not": {**state, "extra.weight": torch.zeros(2)},
        "has other shapes for": {**state, "pos_embed": torch.zeros(1, 9, 16)},
    }
    for words, bad in cases.items():
        path = tmp_path / "w.safetensors"
        save_file(bad, str(path))
        with pytest.raises(ConfigError) as e:
            build_model(_vit_cfg(pretrained_path=str(path)), IMG)
        assert e.value.field == "model.pretrained_path" and words in e.value.message, words
    path = tmp_path / "junk.pth"
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(ConfigError, match="cannot read"):
        build_model(_vit_cfg(pretrained_path=str(path)), IMG)
    # a pickle that the weights-only loader refuses: torch explains over several paragraphs,
    # the error keeps its first line (the CLI's error is one line)
    torch.save({"w": torch.zeros(2), "other": object.__new__(_Opaque)}, path)
    with pytest.raises(ConfigError, match="cannot read") as e:
        build_model(_vit_cfg(pretrained_path=str(path)), IMG)
    assert "\n" not in e.value.message and "Weights only load failed" in e.value.message
    # a directory (a Hub snapshot's folder) instead of the weights file inside it
    with pytest.raises(ConfigError, match="is a directory, not a file") as e:
        build_model(_vit_cfg(pretrained_path=str(tmp_path)), IMG)
    assert e.value.field == "model.pretrained_path"


class _Opaque:
    pass


def _save(state: dict, path: Path) -> str:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    return str(path)


def test_a_vit_file_for_other_image_and_patch_sizes_is_resampled_as_timm_does(tmp_path):
    """timm's own loading without the hub: the position table is resampled to the model's
    grid and the patch embedding to its patch size (the family's checkpoint_filter_fn); every
    other tensor is loaded as it is, and the changes are logged."""
    from timm.layers import resample_abs_pos_embed, resample_patch_embed

    torch.manual_seed(0)
    source = build_model(_vit_cfg(timm_kwargs={"img_size": 32, "patch_size": 8}), _img(32))
    state = {k: v + 0.1 * torch.randn_like(v) for k, v in source.state_dict().items()}
    path = _save(state, tmp_path / "vit32.safetensors")
    for img, patch in ((16, 8), (16, 4), (48, 8)):  # grids 2, 4 (the file's), 6
        grid = img // patch
        model = build_model(_vit_cfg(pretrained_path=path,
                                     timm_kwargs={"img_size": img, "patch_size": patch}),
                            _img(img))
        got = model.state_dict()
        assert got["pos_embed"].shape == (1, 1 + grid * grid, 32)
        want_pos = resample_abs_pos_embed(state["pos_embed"], (grid, grid), (4, 4),
                                          num_prefix_tokens=1)
        torch.testing.assert_close(got["pos_embed"], want_pos, rtol=0, atol=0)
        assert torch.equal(got["pos_embed"], state["pos_embed"]) == (grid == 4)
        torch.testing.assert_close(got["pos_embed"][:, :1], state["pos_embed"][:, :1])
        want_patch = (state["patch_embed.proj.weight"] if patch == 8 else
                      resample_patch_embed(state["patch_embed.proj.weight"], [patch, patch]))
        torch.testing.assert_close(got["patch_embed.proj.weight"], want_patch, rtol=0, atol=0)
        for k, v in state.items():
            if k not in ("pos_embed", "patch_embed.proj.weight"):
                assert torch.equal(got[k], v), k


def test_a_colour_file_loads_into_a_grey_scale_model_by_summing_the_first_filters(tmp_path):
    """in_chans = 1 (X-rays, MNIST) from RGB weights: timm's adapt_input_conv sums the first
    convolution's input channels, so a grey image gives the features its RGB copy gave."""
    torch.manual_seed(0)
    source = build_model(_vit_cfg(), IMG)
    path = _save(source.state_dict(), tmp_path / "rgb.safetensors")
    grey = DataInfo(kind="classification", num_classes=10, in_chans=1, image_size=16)
    model = build_model(_vit_cfg(pretrained_path=path), grey)
    w = model.patch_embed.proj.weight
    assert w.shape[1] == 1
    torch.testing.assert_close(w, source.patch_embed.proj.weight.sum(1, keepdim=True))
    x = torch.randn(2, 1, 16, 16)
    source.eval(), model.eval()
    torch.testing.assert_close(model(x), source(x.expand(-1, 3, -1, -1)), rtol=1e-5, atol=1e-5)


def test_a_file_that_resampling_cannot_fit_is_still_refused_naming_the_field(tmp_path):
    """Only sizes timm's loader adapts are adapted: another width or depth is refused."""
    wide = build_model(_vit_cfg(timm_kwargs={"embed_dim": 48, "num_heads": 2}), IMG)
    deep = build_model(_vit_cfg(timm_kwargs={"depth": 3}), IMG)
    for name, src in (("wide", wide), ("deep", deep)):
        path = _save(src.state_dict(), tmp_path / f"{name}.safetensors")
        with pytest.raises(ConfigError) as e:
            build_model(_vit_cfg(pretrained_path=path), IMG)
        assert e.value.field == "model.pretrained_path", name


def test_a_convnext_trains_with_its_preset_and_inner_momentum(tmp_path):
    """ConvNeXt (1x1-convolution MLPs, layer scales the engine taps) under `dptrain train`:
    Muon has the MLP and downsampling weights; a step with inner momentum moves every group."""
    overrides = ["model.name=timm", "model.timm_name=convnext_atto",
                 "model.timm_kwargs.depths=[1, 1, 1, 1]", "model.timm_kwargs.dims=[4, 8, 8, 8]",
                 "model.timm_kwargs.patch_size=1",  # 16-pixel images: 16, 8, 4, 2
                 "optim.preset=convnext", "optim.inner_momentum.k_muon=1",
                 "optim.inner_momentum.k_other=1", "train.progress=false", "privacy.steps=2"]
    trainer = Trainer(load(RunConfig, IMAGES, overrides), tmp_path / "run")
    model = trainer.model
    groups = {g.label: {n for n, _ in g.named_params} for g in trainer.optimizer.groups}
    assert groups["matrices"] == {f"stages.{i}.{w}.weight" for i in range(4)
                                  for w in ("blocks.0.mlp.fc1", "blocks.0.mlp.fc2",
                                            "downsample.1") if i or w != "downsample.1"}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for _ in range(2):
        trainer.private_step()
    for label, names in groups.items():
        moved = [n for n in names if not torch.equal(before[n], model.get_parameter(n))]
        assert set(moved) == names, label


@pytest.mark.parametrize("overrides, field, words", [
    (["model.timm_name=vit_tiny_patch16_224"], "model.timm_name", "model.timm_kwargs.img_size"),
    (["model.timm_name=convnext_atto"], "model.timm_name", "3 x 16 x 16 images"),
    (["model.timm_name=convnext_atto", "model.timm_kwargs.depths=[1, 1]"], "model.timm_kwargs",
     "IndexError"),
    # patches that do not tile the 16-pixel images: timm's patch embedding built and ran, in
    # silence without the last row and column of every image
    (["model.timm_name=vit_tiny_patch16_224", "model.timm_kwargs.img_size=16",
      "model.timm_kwargs.patch_size=5"], "model.timm_kwargs.patch_size",
     "leave out the last 1 of every image's 16 rows or columns"),
])
def test_a_timm_model_that_cannot_take_the_images_is_refused_when_built(tmp_path, capsys,
                                                                         overrides, field, words):
    """A ViT built for 224 pixels, a ConvNeXt whose downsamplings leave nothing of 16 pixels, a
    constructor argument timm fails on: one line naming the field before anything is written,
    not a traceback (or the clipping engine's refusal of tapped parameters) at the first step."""
    out = tmp_path / "out"
    code = main(["train", "--config", IMAGES, "--output-dir", str(out), "model.name=timm",
                 "train.progress=false", *overrides])
    err = capsys.readouterr().err
    lines = [line for line in err.strip().splitlines() if line.startswith("dptrain train:")]
    assert code == 2 and "Traceback" not in err and len(lines) == 1, err
    assert lines[0].startswith(f"dptrain train: error: {field}: ") and words in lines[0], err
    assert not out.exists() or not any(out.iterdir())


@pytest.mark.parametrize("timm_name, kwargs, size, left_out", [
    ("vit_tiny_patch16_224", {"img_size": 16, "patch_size": 8}, 16, 0),
    ("vit_tiny_patch16_224", {"img_size": 18, "patch_size": 4}, 18, 2),
    # overlapping patch embeddings cover sizes no kernel divides: PVT-v2's (kernel 7, stride
    # 4, padding 3) at 32 and 36 pixels (a check of image_size % patch_size refused them)
    ("pvt_v2_b0", {"depths": (1, 1, 1, 1)}, 32, 0),
    ("pvt_v2_b0", {"depths": (1, 1, 1, 1)}, 36, 0),
    # PiT's is patch_embed.conv (kernel 16, stride 8): the image's first convolution is read,
    # whatever its name (a check of patch_embed.proj alone let 36 px drop 4 rows in silence)
    ("pit_ti_224", {"img_size": 36, "depth": (1, 1, 1)}, 36, 4),
    ("pit_ti_224", {"img_size": 40, "depth": (1, 1, 1)}, 40, 0),
])
def test_a_patch_embedding_that_leaves_pixels_out_is_refused_and_one_that_covers_them_is_not(
        timm_name, kwargs, size, left_out):
    cfg = ModelConfig(name="timm", timm_name=timm_name, timm_kwargs=kwargs)
    if not left_out:
        assert build_model(cfg, _img(size)) is not None
        return
    with pytest.raises(ConfigError) as e:
        build_model(cfg, _img(size))
    assert e.value.field == ("model.timm_kwargs.patch_size" if "patch_size" in kwargs
                             else "model.timm_kwargs.img_size")
    assert f"leave out the last {left_out} of every image's {size} rows" in e.value.message


def test_nf_resnet_tiny_weights_load_with_a_fresh_head_and_grey_scale_filters(tmp_path):
    # dptrain's registered test model had no pretrained_cfg (timm's NF-ResNets do): a file for
    # other classes or channels was refused ("other shapes for head.fc") instead of adapted
    def cfg(**kw):
        return ModelConfig(name="timm", timm_name="nf_resnet_tiny", **kw)

    torch.manual_seed(0)
    source = build_model(cfg(num_classes=12), IMG)
    path = _save(source.state_dict(), tmp_path / "nf.safetensors")
    grey = DataInfo(kind="classification", num_classes=10, in_chans=1, image_size=16)
    model = build_model(cfg(pretrained_path=path), grey)
    got, want = model.state_dict(), source.state_dict()
    assert got["head.fc.weight"].shape == (10, want["head.fc.weight"].shape[1])
    torch.testing.assert_close(got["stem.conv.weight"],
                               want["stem.conv.weight"].sum(1, keepdim=True))
    for k, v in want.items():
        if not k.startswith(("head.fc.", "stem.conv.weight")):
            assert torch.equal(got[k], v), k
