"""Models: shapes, tied embeddings, dropout and eager attention, BatchNorm refused, configs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from _threads import _one_thread  # noqa: F401  (autouse: one torch thread)

from dptrain.config import ConfigError, from_dict, validate_tree
from dptrain.data import DataInfo
from dptrain.models import (ModelConfig, TinyCNN, build_model, check_no_batchnorm,
                            trainable_named_parameters)

LM = DataInfo(kind="lm", vocab_size=257, pad_id=256, eos_id=256, max_length=40)
IMG = DataInfo(kind="classification", num_classes=7, in_chans=1, image_size=28)


def gpt2_cfg(**kw):
    base = dict(name="gpt2", n_layer=2, n_embd=32, n_head=4, n_positions=64)
    base.update(kw)
    return ModelConfig(**base)


def test_gpt2_shapes_eager_dropout_conv1d():
    from transformers.pytorch_utils import Conv1D

    model = build_model(gpt2_cfg(dropout=0.25), LM)
    assert model.config._attn_implementation == "eager"
    assert model.config.vocab_size == 257
    drops = [m.p for m in model.modules() if isinstance(m, nn.Dropout)]
    assert drops and all(p == 0.25 for p in drops)
    assert any(isinstance(m, Conv1D) for m in model.modules())  # kept as transformers has it
    ids = torch.randint(0, 257, (3, 11))
    out = model(input_ids=ids, attention_mask=torch.ones_like(ids))
    assert out.logits.shape == (3, 11, 257)
    assert build_model(gpt2_cfg(vocab_size=300), LM).config.vocab_size == 300


def test_gpt2_tied_embeddings_really_tied():
    model = build_model(gpt2_cfg(), LM)
    wte, head = model.transformer.wte.weight, model.lm_head.weight
    assert head is wte
    names = [n for n, _ in trainable_named_parameters(model)]
    assert "transformer.wte.weight" in names and "lm_head.weight" not in names
    assert len(names) == len(set(id(p) for _, p in trainable_named_parameters(model)))
    # a gradient through the head lands on the embedding
    ids = torch.randint(0, 257, (2, 5))
    model(input_ids=ids).logits.sum().backward()
    assert wte.grad is not None and wte.grad.abs().sum() > 0
    untied = build_model(gpt2_cfg(tie_embeddings=False), LM)
    assert untied.lm_head.weight is not untied.transformer.wte.weight
    assert "lm_head.weight" in [n for n, _ in trainable_named_parameters(untied)]


def test_trainable_named_parameters_skips_frozen():
    model = build_model(ModelConfig(name="cnn", channels=[4]), IMG)
    model.head.bias.requires_grad_(False)
    names = [n for n, _ in trainable_named_parameters(model)]
    assert "head.bias" not in names and "head.weight" in names


def test_gpt2_pretrained_path_round_trip(tmp_path, monkeypatch):
    torch.manual_seed(1)
    src = build_model(gpt2_cfg(), LM)
    src.save_pretrained(tmp_path / "ckpt")
    monkeypatch.setenv("HOME", str(tmp_path))  # "~/ckpt": expanded, as the data paths are
    validate_tree(from_dict(ModelConfig, {"pretrained_path": "~/ckpt"}, "model"), "model")
    loaded = build_model(gpt2_cfg(pretrained_path="~/ckpt", dropout=0.1), LM)
    assert loaded.config._attn_implementation == "eager"
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    assert all(m.p == 0.1 for m in loaded.modules() if isinstance(m, nn.Dropout))
    for (n, a), (_, b) in zip(src.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), n
    missing = from_dict(ModelConfig, {"pretrained_path": str(tmp_path / "none")}, "model")
    with pytest.raises(ConfigError) as e:
        validate_tree(missing, "model")
    assert e.value.field == "model.pretrained_path"
    with pytest.raises(ConfigError) as e:
        build_model(missing, LM)
    assert e.value.field == "model.pretrained_path"


def test_gpt2_pretrained_path_refuses_partial_or_foreign_checkpoints(tmp_path):
    # transformers fills what a folder lacks with a fresh initialisation and only logs it; these
    # trained silently from random weights (missing, bert) or were tracebacks (corrupt, shape;
    # then transformers' own line for a shape, which points at a report it logs: the tensors are
    # named now)
    import json
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(1)
    good = tmp_path / "good"
    build_model(gpt2_cfg(), LM).save_pretrained(good)

    def variant(name, config=None, weights=None):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps(config or json.loads(
            (good / "config.json").read_text())))
        if isinstance(weights, bytes):
            (d / "model.safetensors").write_bytes(weights)
        elif weights is not None:
            save_file(weights, d / "model.safetensors", metadata={"format": "pt"})
        else:
            shutil.copy(good / "model.safetensors", d)
        return d

    tensors = load_file(good / "model.safetensors")
    wider = json.loads((good / "config.json").read_text())
    wider["n_embd"] = 64
    # a tied config with a separate head in the weights: transformers left them untied
    # (a logged warning only), and the run trained an untied head while tie_embeddings said tied
    head = {**tensors, "lm_head.weight": torch.randn_like(tensors["transformer.wte.weight"])}
    cases = {"lacks": variant("missing", weights={k: v for k, v in tensors.items()
                                                   if ".h.1." not in k}),
             "ties the head": variant("tied_with_head", weights=head),
             "cannot load": variant("corrupt", weights=b"garbage" * 10),
             "other shapes": variant("shape", config=wider)}
    bert = tmp_path / "bert"
    BertForMaskedLM(BertConfig(vocab_size=300, hidden_size=32, num_hidden_layers=1,
                               num_attention_heads=2, intermediate_size=64)).save_pretrained(bert)
    cases["'bert'"] = bert
    for words, folder in cases.items():
        with pytest.raises(ConfigError) as e:
            build_model(gpt2_cfg(pretrained_path=str(folder)), LM)
        assert e.value.field == "model.pretrained_path", words
        assert "\n" not in e.value.message
        assert words in e.value.message, e.value.message


def test_gpt2_pretrained_path_loads_half_precision_checkpoints_as_float32(tmp_path):
    torch.manual_seed(1)
    src = build_model(gpt2_cfg(), LM).to(torch.bfloat16)
    src.save_pretrained(tmp_path / "bf16")
    loaded = build_model(gpt2_cfg(pretrained_path=str(tmp_path / "bf16")), LM)
    assert {p.dtype for p in loaded.parameters()} == {torch.float32}  # performance.dtype's
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    for (n, a), (_, b) in zip(src.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a.float(), b), n  # bf16 values are exact in float32


def test_gpt2_size_mismatches_name_the_field():
    with pytest.raises(ConfigError) as e:
        build_model(gpt2_cfg(n_positions=16), LM)
    assert e.value.field == "model.n_positions"
    with pytest.raises(ConfigError) as e:
        build_model(gpt2_cfg(vocab_size=100), LM)
    assert e.value.field == "model.vocab_size"
    with pytest.raises(ConfigError) as e:
        build_model(gpt2_cfg(), IMG)
    assert e.value.field == "model.name"


def test_image_model_mismatches_with_the_data_name_the_field():
    mnist = DataInfo(kind="classification", num_classes=10, in_chans=1, image_size=28)
    for kw, field in [(dict(name="cnn", num_classes=5), "model.num_classes"),
                      (dict(name="cnn", in_chans=3), "model.in_chans"),
                      (dict(name="cnn", channels=[8, 8, 8, 8, 8]), "model.channels"),
                      (dict(name="timm", timm_name="nf_resnet_tiny", num_classes=9),
                       "model.num_classes")]:
        with pytest.raises(ConfigError) as e:
            build_model(from_dict(ModelConfig, kw, "model"), mnist)
        assert e.value.field == field, kw
    with pytest.raises(ConfigError) as e:
        build_model(from_dict(ModelConfig, dict(name="cnn", in_chans=3), "model"), mnist)
    assert e.value.message == ("3, but the data's images have 1 channels; or set "
                               "data.in_chans=3 (webdataset and imagefolder decode the images "
                               "as RGB)")
    rgb = DataInfo(kind="classification", num_classes=12, in_chans=3, image_size=28)
    with pytest.raises(ConfigError) as e:
        build_model(from_dict(ModelConfig, dict(name="cnn", in_chans=1), "model"), rgb)
    assert e.value.message.endswith("; or set data.in_chans=1 (webdataset and imagefolder "
                                    "decode the images as grey)")
    with pytest.raises(ConfigError) as e:  # data.num_classes 12, labels seen maybe 0..9
        build_model(from_dict(ModelConfig, dict(name="cnn", num_classes=10), "model"), rgb)
    assert e.value.message == "10 is fewer than the data's classes (data.num_classes = 12)"
    # what fits is built: more classes than labels, 4 stages on 28 px
    m = build_model(from_dict(ModelConfig, dict(name="cnn", num_classes=12,
                                                channels=[4, 4, 4, 4]), "model"), mnist)
    assert m(torch.zeros(2, 1, 28, 28)).shape == (2, 12)


def test_model_config_names_and_defaults():
    with pytest.raises(ConfigError) as e:
        from_dict(ModelConfig, {"name": "bert"}, "model")
    assert e.value.field == "model.name"
    assert ModelConfig().timm_name == "nf_resnet50"


def test_cnn_groupnorm_shapes():
    model = build_model(ModelConfig(name="cnn", channels=[6, 12]), IMG)
    assert isinstance(model, TinyCNN)
    norms = [m for m in model.modules() if isinstance(m, nn.GroupNorm)]
    # learnable scale and shift per channel, in the largest divisor of the channels <= 4 groups
    assert [(m.num_groups, m.affine) for m in norms] == [(3, True), (4, True)]
    assert model(torch.randn(5, 1, 28, 28)).shape == (5, 7)
    rgb = DataInfo(kind="classification", num_classes=3, in_chans=3, image_size=16)
    m3 = build_model(ModelConfig(name="cnn", in_chans=3, num_classes=4), rgb)
    assert m3(torch.randn(2, 3, 16, 16)).shape == (2, 4)


def test_timm_nf_resnet50_has_no_batchnorm():
    info = DataInfo(kind="classification", num_classes=5, in_chans=3, image_size=32)
    model = build_model(ModelConfig(name="timm"), info)  # nf_resnet50 by default
    check_no_batchnorm(model)
    model.eval()
    with torch.no_grad():
        assert model(torch.randn(2, 3, 32, 32)).shape == (2, 5)


def test_batchnorm_refused():
    info = DataInfo(kind="classification", num_classes=5, in_chans=3, image_size=32)
    with pytest.raises(ConfigError) as e:
        build_model(ModelConfig(name="timm", timm_name="resnet18"), info)
    assert e.value.field == "model.timm_name" and "BatchNorm" in str(e.value)
    for bn in (nn.BatchNorm1d(3), nn.BatchNorm2d(3), nn.SyncBatchNorm(3)):
        with pytest.raises(ConfigError, match="BatchNorm"):
            check_no_batchnorm(nn.Sequential(nn.Conv2d(3, 3, 1), bn))
    with pytest.raises(ConfigError) as e:
        build_model(ModelConfig(name="timm", timm_name="no_such_model_xyz"), info)
    assert e.value.field == "model.timm_name"


def test_a_model_the_engine_refuses_is_a_config_error_naming_the_model(monkeypatch, tmp_path,
                                                                       capsys):
    """A model whose layer takes two rows per example (Swin's windows) is refused by the
    clipping engine at its first query; the trainer said so with a ValueError traceback (before
    2026-12-02 such models, and those owning parameters next to submodules, were refused when
    the engine was built: those parameters are tapped now, dm_nfnet's ``skipinit_gain``)."""
    import dptrain.trainer as trainer_mod
    from dptrain.cli import main
    from dptrain.config import load
    from dptrain.trainer import RunConfig, Trainer

    class Windows(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3 * 8 * 4, 10)
            self.skipinit_gain = nn.Parameter(torch.ones(()))

        def forward(self, x):
            h = self.lin(x.reshape(2 * x.shape[0], -1))  # two windows per example
            return h.view(x.shape[0], 2, 10).sum(1) * self.skipinit_gain

    monkeypatch.setattr(trainer_mod, "build_model", lambda cfg, info, **kw: Windows())
    config = Path(__file__).resolve().parents[1] / "configs" / "tiny_images.yaml"
    for name, field in (("timm", "model.timm_name"), ("cnn", "model.name")):
        overrides = ["data.image_size=8", f"model.name={name}", "optim.preset=vit",
                     "privacy.noise_multiplier=1.0", "privacy.epsilon=null",
                     "train.progress=false"]
        trainer = Trainer(load(RunConfig, config, overrides), tmp_path / name)
        with pytest.raises(ConfigError) as e:
            trainer.private_step()
        assert e.value.field == field and "lin (Linear) produced a leading dimension" in str(e.value)
        assert "one row per example, made from the batch" in str(e.value)
    out = tmp_path / "cli"
    assert main(["train", "--config", str(config), "--output-dir", str(out), *overrides]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("dptrain train: error")]
    assert "Traceback" not in err and len(errors) == 1, err
    assert errors[0].startswith("dptrain train: error: model.name: dptrain.clipping: lin"), err
    assert not (out / "summary.json").exists()
    # any other ValueError during the step is no verdict on the model: it stays what it is
    trainer = Trainer(load(RunConfig, config, overrides), tmp_path / "other")

    def other(*args, **kwargs):
        raise ValueError("not the engine's")

    monkeypatch.setattr(trainer.engine, "accumulate", other)
    with pytest.raises(ValueError, match="not the engine's"):
        trainer.private_step()


def test_data_info_without_channels_leaves_them_to_the_model_config():
    info = DataInfo(kind="classification", num_classes=3, image_size=8)
    assert info.in_chans is None and info.num_classes == 3
    model = build_model(ModelConfig(name="cnn", channels=[4], in_chans=1), info)
    assert next(model.parameters()).shape[1] == 1
    with pytest.raises(ConfigError) as e:
        build_model(ModelConfig(name="cnn", channels=[4]), info)
    assert e.value.field == "model.in_chans"


@pytest.mark.parametrize("bad, field", [
    ({"n_embd": 30, "n_head": 4}, "model.n_embd"),
    ({"dropout": 1.0}, "model.dropout"),
    ({"n_layer": 0}, "model.n_layer"),
    ({"n_positions": 0}, "model.n_positions"),
    ({"n_head": 0}, "model.n_head"),                              # (before n_embd % n_head)
    ({"name": "cnn", "channels": []}, "model.channels"),
    ({"vocab_size": 1}, "model.vocab_size"),                      # a one-token vocabulary
    ({"name": "cnn", "num_classes": 0}, "model.num_classes"),
    ({"name": "timm", "in_chans": 0}, "model.in_chans"),
    ({"name": "cnn", "channels": [8, 0]}, "model.channels"),      # a zero-width stage
    ({"name": "cnn", "groups": 0}, "model.groups"),
    ({"name": "cnn", "pool": 0}, "model.pool"),
    ({"name": "cnn", "hidden": -1}, "model.hidden"),
    ({"name": "gpt2", "drop_path_rate": 0.1}, "model.drop_path_rate"),
    ({"name": "timm", "dropout": 0.1}, "model.dropout"),
    ({"name": "cnn", "pretrained_path": "/tmp"}, "model.pretrained_path"),
    # a field of another model family, set away from its default, would be ignored
    ({"name": "timm", "n_layer": 6}, "model.n_layer"),
    ({"name": "cnn", "tie_embeddings": False}, "model.tie_embeddings"),
    ({"name": "cnn", "vocab_size": 300}, "model.vocab_size"),
    ({"name": "cnn", "timm_name": "nf_resnet26"}, "model.timm_name"),
    ({"name": "gpt2", "num_classes": 10}, "model.num_classes"),
    ({"name": "gpt2", "in_chans": 1}, "model.in_chans"),
    ({"name": "timm", "channels": [8]}, "model.channels"),
    ({"name": "timm", "hidden": 0}, "model.hidden"),
])
def test_model_config_validate_refuses_each_bad_value(bad, field):
    with pytest.raises(ConfigError) as e:
        validate_tree(from_dict(ModelConfig, bad, "model"), "model")
    assert e.value.field == field


def test_model_config_validate_accepts_the_boundaries():
    for ok in ({"vocab_size": 2}, {"name": "cnn", "num_classes": 1, "in_chans": 1,
                                   "channels": [1], "groups": 1, "pool": 1, "hidden": 0},
               {"name": "timm", "drop_path_rate": 0.0},
               # another family's field at its default is not ignored: nothing differs
               {"name": "timm", "n_layer": 12, "channels": [16, 32], "dropout": 0.0}):
        validate_tree(from_dict(ModelConfig, ok, "model"), "model")


def _reference_tiny_cnn(m: TinyCNN, x, groups_per_stage, pool):
    """conv3x3 (padding 1) -> GroupNorm(g) -> ReLU -> maxpool2 per stage, adaptive *average*
    pooling to pool x pool, Linear -> ReLU, Linear: written out with torch.nn.functional."""
    convs = [l for l in m.features if isinstance(l, nn.Conv2d)]
    norms = [l for l in m.features if isinstance(l, nn.GroupNorm)]
    assert len(convs) == len(norms) == len(groups_per_stage)
    for conv, gn, g in zip(convs, norms, groups_per_stage):
        x = F.conv2d(x, conv.weight, conv.bias, padding=1)
        x = F.group_norm(x, g, gn.weight, gn.bias, gn.eps)
        x = F.max_pool2d(F.relu(x), 2)
    x = F.adaptive_avg_pool2d(x, pool).flatten(1)
    lin1, lin2 = m.hidden[0], m.head
    return F.linear(F.relu(F.linear(x, lin1.weight, lin1.bias)), lin2.weight, lin2.bias)


def test_tiny_cnn_forward_equals_its_documented_architecture():
    torch.manual_seed(0)
    m = build_model(ModelConfig(name="cnn", channels=[6, 8], groups=4, pool=2, hidden=5), IMG)
    # GroupNorm groups: the largest divisor of the channels that is <= groups (6 -> 3, 8 -> 4)
    assert [l.num_groups for l in m.features if isinstance(l, nn.GroupNorm)] == [3, 4]
    with torch.no_grad():  # non-trivial affine parameters so that every op shows
        for p in m.parameters():
            p.add_(0.3 * torch.randn_like(p))
    x = torch.randn(3, 1, 28, 28, dtype=torch.float64)
    m = m.double()
    # spatial size: two maxpool2 stages on 28 px leave 7 x 7
    assert m.features(x).shape == (3, 8, 7, 7)
    torch.testing.assert_close(m(x), _reference_tiny_cnn(m, x, [3, 4], 2), rtol=1e-10,
                               atol=1e-10)


def test_cnn_stages_may_halve_the_image_down_to_exactly_one_pixel():
    # 4 stages on 16 px: 16 -> 8 -> 4 -> 2 -> 1 is allowed; 15 px would go below one pixel
    info16 = DataInfo(kind="classification", num_classes=3, in_chans=1, image_size=16)
    m = build_model(ModelConfig(name="cnn", channels=[2, 2, 2, 2], pool=1, hidden=0), info16)
    assert m(torch.zeros(2, 1, 16, 16)).shape == (2, 3)
    info15 = DataInfo(kind="classification", num_classes=3, in_chans=1, image_size=15)
    with pytest.raises(ConfigError) as e:
        build_model(ModelConfig(name="cnn", channels=[2, 2, 2, 2], pool=1, hidden=0), info15)
    assert e.value.field == "model.channels"


def test_fewer_input_channels_than_the_data_has_are_refused():
    rgb = DataInfo(kind="classification", num_classes=3, in_chans=3, image_size=16)
    with pytest.raises(ConfigError) as e:
        build_model(ModelConfig(name="cnn", channels=[4], in_chans=1), rgb)
    assert e.value.field == "model.in_chans"


def test_nf_resnet_tiny_takes_timms_nf_resnet_keywords_and_refuses_others():
    # its entrypoint used to drop keywords it did not list; timm's NF-ResNets overlay them on
    # their NfCfg, so an unknown one is an error naming model.timm_kwargs
    rgb = DataInfo(kind="classification", num_classes=3, in_chans=3, image_size=16)
    model = build_model(ModelConfig(name="timm", timm_name="nf_resnet_tiny",
                                    timm_kwargs={"stem_chs": 8}), rgb)
    assert model.stem.conv.out_channels == 8
    with pytest.raises(ConfigError) as e:
        build_model(ModelConfig(name="timm", timm_name="nf_resnet_tiny",
                                timm_kwargs={"foo": 1}), rgb)
    assert e.value.field == "model.timm_kwargs" and "foo" in e.value.message


def test_gpt2_positions_may_equal_the_longest_example():
    model = build_model(gpt2_cfg(n_positions=40), LM)  # LM.max_length == 40
    assert model.config.n_positions == 40
    with pytest.raises(ConfigError) as e:
        build_model(gpt2_cfg(n_positions=39), LM)
    assert e.value.field == "model.n_positions"


def test_gpt2_config_records_the_data_special_tokens_only_when_in_the_vocabulary():
    # these land in the exported config.json that HF generation reads
    m = build_model(gpt2_cfg(), LM)
    assert (m.config.eos_token_id, m.config.bos_token_id, m.config.pad_token_id) == (256, 256, 256)
    # no data vocabulary: an EOS id at (or beyond) the model's vocabulary is not recorded
    info = DataInfo(kind="lm", vocab_size=None, eos_id=50, max_length=10)
    m = build_model(gpt2_cfg(vocab_size=50), info)
    assert m.config.eos_token_id is None and m.config.bos_token_id is None
    m = build_model(gpt2_cfg(vocab_size=51), info)
    assert m.config.eos_token_id == 50


def test_gpt2_pretrained_checkpoint_that_does_not_fit_the_data_is_refused(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    def save(name, **kw):
        base = dict(vocab_size=257, n_positions=64, n_embd=32, n_layer=1, n_head=4)
        base.update(kw)
        GPT2LMHeadModel(GPT2Config(**base)).save_pretrained(tmp_path / name)
        return str(tmp_path / name)

    torch.manual_seed(0)
    cases = [(save("small_vocab", vocab_size=200), {}, "model.pretrained_path"),
             (save("short", n_positions=32), {}, "data.max_length"),
             (save("untied", tie_word_embeddings=False), {"tie_embeddings": True},
              "model.tie_embeddings"),
             (save("tied"), {"tie_embeddings": False}, "model.tie_embeddings"),
             # a shape set away from its default that is not the checkpoint's was ignored
             (str(tmp_path / "tied"), {"n_layer": 2}, "model.n_layer"),
             (str(tmp_path / "tied"), {"n_embd": 64, "n_head": 4}, "model.n_embd"),
             (str(tmp_path / "tied"), {"vocab_size": 300}, "model.vocab_size")]
    for path, kw, field in cases:
        with pytest.raises(ConfigError) as e:
            build_model(ModelConfig(name="gpt2", pretrained_path=path, **kw), LM)
        assert e.value.field == field, path
    # what fits loads: a larger vocabulary, positions == the longest example, untied as saved,
    # the checkpoint's own shape written out
    ok = build_model(ModelConfig(pretrained_path=save("fits", vocab_size=300, n_positions=40)),
                     LM)
    assert ok.config.vocab_size == 300
    untied = build_model(ModelConfig(pretrained_path=str(tmp_path / "untied"),
                                     tie_embeddings=False), LM)
    assert untied.lm_head.weight is not untied.transformer.wte.weight
    same = build_model(gpt2_cfg(n_layer=1, pretrained_path=str(tmp_path / "tied")), LM)
    assert same.config.n_layer == 1


def test_gpt2_dropout_reaches_attention_too():
    from transformers.models.gpt2.modeling_gpt2 import GPT2Attention

    model = build_model(gpt2_cfg(dropout=0.25), LM)
    attn = [m for m in model.modules() if isinstance(m, GPT2Attention)]
    assert attn and all(a.attn_dropout.p == 0.25 and a.resid_dropout.p == 0.25 for a in attn)
    assert model.transformer.drop.p == 0.25


def test_timm_model_gets_drop_path_rate_and_input_channels_from_the_config():
    from timm.layers import DropPath

    info = DataInfo(kind="classification", num_classes=5, in_chans=1, image_size=16)
    model = build_model(ModelConfig(name="timm", timm_name="nf_resnet_tiny",
                                    drop_path_rate=0.4), info)
    rates = [m.drop_prob for m in model.modules() if isinstance(m, DropPath)]
    assert rates and max(rates) == pytest.approx(0.4)  # timm's linear per-block ramp ends at it
    first = next(m for m in model.modules() if isinstance(m, nn.Conv2d))
    assert first.in_channels == 1
    model.eval()
    with torch.no_grad():
        assert model(torch.randn(2, 1, 16, 16)).shape == (2, 5)
    # built in training mode (its input check runs it in eval mode, and puts it back)
    assert model.training is False  # (set above)
    assert build_model(ModelConfig(name="timm", timm_name="nf_resnet_tiny",
                                   drop_path_rate=0.4), info).training
    plain = build_model(ModelConfig(name="timm", timm_name="nf_resnet_tiny"), info)
    assert not any(isinstance(m, DropPath) for m in plain.modules())
    # a timm model without stochastic depth: one error naming the field (was a bare TypeError)
    with pytest.raises(ConfigError) as e:
        build_model(ModelConfig(name="timm", timm_name="vgg11", drop_path_rate=0.1), info)
    assert e.value.field == "model.drop_path_rate" and "drop_path_rate" in e.value.message


def test_a_head_too_large_for_memory_names_where_its_class_count_came_from():
    # the count inferred from the data (one mistyped label of 10^13) was blamed on
    # model.channels; the model's own num_classes, when set, is named itself
    huge = DataInfo(kind="classification", num_classes=10 ** 13, in_chans=3, image_size=8)
    with pytest.raises(ConfigError) as e:
        build_model(ModelConfig(name="cnn", channels=[4]), huge)
    assert e.value.field == "data.num_classes" and "does not fit in memory" in e.value.message
    small = DataInfo(kind="classification", num_classes=10, in_chans=3, image_size=8)
    with pytest.raises(ConfigError) as e:
        build_model(ModelConfig(name="cnn", channels=[4], num_classes=10 ** 13), small)
    assert e.value.field == "model.num_classes"


@pytest.mark.parametrize("data, words", [
    # the data's ids come from its tokenizer: the fix is the checkpoint's own
    ({"name": "e2e", "tokenizer": "bytes"},
     "data vocabulary 257 (data.tokenizer: bytes): tokenize with the checkpoint's own "
     "tokenizer (data.tokenizer: hf and data.tokenizer_path: its folder)"),
    # no tokenizer at all: the hint named data.tokenizer_path, a setting synthetic data lacks
    ({"name": "synthetic_lm", "synthetic_vocab_size": 300},
     "data vocabulary 301: set data.synthetic_vocab_size to at most 199"),
])
def test_a_checkpoint_vocabulary_too_small_names_the_fix_for_the_data_s_vocabulary(
        tmp_path, data, words):
    from transformers import GPT2Config, GPT2LMHeadModel

    from dptrain.data import DataConfig, build_data

    for name, text in (("train.csv", "mr,ref\nname[A],A is good.\nname[B],B is bad.\n"),
                       ("test.csv", "mr,ref\nname[C],C is fine.\n")):
        (tmp_path / name).write_text(text, encoding="utf-8")
    files = (dict(path=str(tmp_path), train_file="train.csv", test_file="test.csv")
             if data["name"] == "e2e" else {})
    info = build_data(DataConfig(**data, **files)).info
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=200, n_positions=64, n_embd=16, n_layer=1,
                               n_head=2)).save_pretrained(tmp_path / "ckpt")
    with pytest.raises(ConfigError) as e:
        build_model(ModelConfig(name="gpt2", pretrained_path=str(tmp_path / "ckpt")), info)
    assert e.value.field == "model.pretrained_path" and words in e.value.message, e.value
