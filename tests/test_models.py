"""Models: shapes, tied embeddings, dropout and eager attention, BatchNorm refused, configs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from dptrain.config import ConfigError, from_dict, validate_tree
from dptrain.data import DataInfo
from dptrain.models import (ModelConfig, TinyCNN, build_model, check_no_batchnorm,
                            trainable_named_parameters)

LM = DataInfo(kind="lm", vocab_size=257, pad_id=256, eos_id=256, max_length=40)
IMG = DataInfo(kind="classification", num_classes=7, in_chans=1, image_size=28)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: one intra-op thread is much faster on a shared CPU (restored after)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


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


def test_gpt2_pretrained_path_round_trip(tmp_path):
    torch.manual_seed(1)
    src = build_model(gpt2_cfg(), LM)
    src.save_pretrained(tmp_path / "ckpt")
    loaded = build_model(gpt2_cfg(pretrained_path=str(tmp_path / "ckpt"), dropout=0.1), LM)
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
    # trained silently from random weights (missing, bert) or were tracebacks (corrupt, shape)
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
    cases = {"lacks": variant("missing", weights={k: v for k, v in tensors.items()
                                                   if ".h.1." not in k}),
             "cannot load": variant("corrupt", weights=b"garbage" * 10),
             "shape": variant("shape", config=wider)}
    bert = tmp_path / "bert"
    BertForMaskedLM(BertConfig(vocab_size=300, hidden_size=32, num_hidden_layers=1,
                               num_attention_heads=2, intermediate_size=64)).save_pretrained(bert)
    cases["'bert'"] = bert
    for words, folder in cases.items():
        with pytest.raises(ConfigError) as e:
            build_model(gpt2_cfg(pretrained_path=str(folder)), LM)
        assert e.value.field == "model.pretrained_path", words
        assert "\n" not in e.value.message
        if words != "shape":
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
    # what fits is built: more classes than labels, 4 stages on 28 px
    m = build_model(from_dict(ModelConfig, dict(name="cnn", num_classes=12,
                                                channels=[4, 4, 4, 4]), "model"), mnist)
    assert m(torch.zeros(2, 1, 28, 28)).shape == (2, 12)


def test_model_config_validate():
    for bad, field in [({"n_embd": 30, "n_head": 4}, "model.n_embd"),
                       ({"dropout": 1.0}, "model.dropout"),
                       ({"n_layer": 0}, "model.n_layer"),
                       ({"name": "cnn", "channels": []}, "model.channels")]:
        with pytest.raises(ConfigError) as e:
            validate_tree(from_dict(ModelConfig, bad, "model"), "model")
        assert e.value.field == field
    with pytest.raises(ConfigError) as e:
        from_dict(ModelConfig, {"name": "bert"}, "model")
    assert e.value.field == "model.name"
    assert ModelConfig().timm_name == "nf_resnet50"


def test_cnn_groupnorm_shapes():
    model = build_model(ModelConfig(name="cnn", channels=[6, 12]), IMG)
    assert isinstance(model, TinyCNN)
    assert any(isinstance(m, nn.GroupNorm) for m in model.modules())
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


def test_a_model_no_rule_can_clip_is_a_config_error_naming_the_model(monkeypatch, tmp_path):
    """dm_nfnet's NormFreeBlock owns ``skipinit_gain`` and has submodules: no layer rule can
    give its per-example gradient. The trainer said so with a ValueError traceback."""
    import dptrain.trainer as trainer_mod
    from dptrain.config import load
    from dptrain.trainer import RunConfig, Trainer

    class GainedBlock(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3 * 8 * 8, 10)
            self.skipinit_gain = nn.Parameter(torch.ones(()))

        def forward(self, x):
            return self.lin(x.flatten(1)) * self.skipinit_gain

    monkeypatch.setattr(trainer_mod, "build_model", lambda cfg, info: GainedBlock())
    for name, field in (("timm", "model.timm_name"), ("cnn", "model.name")):
        cfg = load(RunConfig, Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml",
                   ["data.name=synthetic_images", "data.image_size=8", f"model.name={name}",
                    "optim.preset=null", "privacy.noise_multiplier=1.0", "privacy.epsilon=null",
                    "privacy.accountant=rdp"])
        with pytest.raises(ConfigError) as e:
            Trainer(cfg, tmp_path / name)
        assert e.value.field == field and "skipinit_gain" in e.value.message


def test_data_info_without_channels_leaves_them_to_the_model_config():
    info = DataInfo(kind="classification", num_classes=3, image_size=8)
    assert info.in_chans is None and info.num_classes == 3
    model = build_model(ModelConfig(name="cnn", channels=[4], in_chans=1), info)
    assert next(model.parameters()).shape[1] == 1
    with pytest.raises(ConfigError) as e:
        build_model(ModelConfig(name="cnn", channels=[4]), info)
    assert e.value.field == "model.in_chans"
