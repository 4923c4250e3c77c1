"""Parameter groups, presets, schedules, config errors, and the state_dict round trip."""

import io
import math

from pathlib import Path

import pytest
import torch

from dptrain.config import ConfigError, from_dict, validate_tree
from dptrain.optim import OptimConfig, build_optimizer
from dptrain.optim.schedules import lr_factor


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 8)
        self.fc2 = torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def _build(optim: dict, model=None, **kw):
    model = model if model is not None else _Net()
    cfg = from_dict(OptimConfig, optim)
    kw = {"total_steps": 10, "release_noise_std": 0.0, "seed": 0, **kw}
    return build_optimizer(cfg, list(model.named_parameters()), **kw)


def _members(opt):
    return {g.label: (g.config.optimizer, [n for n, _ in g.named_params]) for g in opt.groups}


def test_first_matching_group_wins_and_leftovers_go_to_the_default_when_asked():
    opt = _build({"name": "adamw", "unmatched": "default", "groups": [
        {"pattern": "fc1", "optimizer": "sgd", "lr": 0.1},
        {"pattern": r"weight$", "optimizer": "muon"},
    ]})
    assert _members(opt) == {
        "optim.groups[0]": ("sgd", ["fc1.weight", "fc1.bias"]),
        "optim.groups[1]": ("muon", ["fc2.weight"]),
        "default": ("adamw", ["fc2.bias"]),
    }
    assert opt.lr == {"optim.groups[0]": 0.1, "optim.groups[1]": 0.002, "default": 0.002}


def test_a_pattern_matching_nothing_is_an_error_naming_it():
    with pytest.raises(ConfigError) as e:
        _build({"groups": [{"pattern": ".", "optimizer": "adamw"},
                           {"pattern": "nothing_like_this", "optimizer": "sgd"}]})
    assert e.value.field == "optim.groups[1].pattern"


def test_a_pattern_whose_parameters_an_earlier_group_took_says_so():
    # it does match: "matches no trainable parameter" sent the user looking for a typo
    with pytest.raises(ConfigError) as e:
        _build({"groups": [{"pattern": ".", "optimizer": "adamw"},
                           {"pattern": "weight", "optimizer": "sgd"}]})
    assert e.value.field == "optim.groups[1].pattern"
    assert "the earlier optim.groups[0] takes" in str(e.value)


def test_groups_that_share_a_label_keep_their_own_learning_rates_in_the_metrics():
    # a name given twice, or a preset's own label: one rate used to overwrite the other in
    # the dict that metrics.jsonl logs (refusing such names would refuse resuming old runs)
    from dptrain.config import load
    from dptrain.trainer import RunConfig, Trainer

    tiny = str(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml")
    t = Trainer(load(RunConfig, tiny, [
        "train.progress=false",
        "optim.groups=[{pattern: wte, optimizer: adamw, lr: 0.5, name: a}, "
        "{pattern: ln_f, optimizer: sgd, lr: 0.3, name: others}]"]))
    assert t.optimizer.lr == {"a": 0.5, "others (optim.groups[1])": 0.3, "matrices": 0.02,
                              "others (optim.aux)": 0.01}
    # a name that spells another group's key: every group keyed by its path and position
    t = Trainer(load(RunConfig, tiny, [
        "train.progress=false",
        "optim.groups=[{pattern: wte, optimizer: adamw, lr: 0.5, name: 'a (optim.groups[1])'}, "
        "{pattern: wpe, optimizer: adamw, lr: 0.3, name: a}, "
        "{pattern: ln_f, optimizer: adamw, lr: 0.2, name: a}]"]))
    assert sorted(t.optimizer.lr.values()) == [0.01, 0.02, 0.2, 0.3, 0.5]


def test_a_parameter_in_no_group_is_an_error_listing_it():
    with pytest.raises(ConfigError) as e:
        _build({"groups": [{"pattern": "weight", "optimizer": "muon"}]})
    assert e.value.field == "optim.groups"
    assert "fc1.bias" in e.value.message and "fc2.bias" in e.value.message
    assert "fc1.weight" not in e.value.message


def test_muon_on_a_vector_names_the_group_and_the_parameter():
    with pytest.raises(ConfigError) as e:
        _build({"groups": [{"pattern": "fc1", "optimizer": "muon"},
                           {"pattern": ".", "optimizer": "adamw"}]})
    assert e.value.field == "optim.groups[0].optimizer" and "fc1.bias" in e.value.message
    with pytest.raises(ConfigError) as e:
        _build({"name": "muon"})
    assert e.value.field == "optim.name"


@pytest.mark.parametrize("optim,field", [
    ({"groups": [{"pattern": ".", "optimizer": "adamw", "kwargs": {"momentum": 0.9}}]},
     "optim.groups[0].kwargs.momentum"),
    ({"groups": [{"pattern": "(", "optimizer": "adamw"}]}, "optim.groups[0].pattern"),
    ({"groups": [{"pattern": ".", "optimizer": "lion"}]}, "optim.groups[0].optimizer"),
    ({"name": "muon", "betas": [0.9, 0.99]}, "optim.betas"),
    ({"name": "adamw", "betas": [0.9]}, "optim.betas"),
    ({"name": "sgd", "momentum": 1.5}, "optim.momentum"),
    ({"preset": "gpt2", "aux": {"kwargs": {"ns_steps": 3}}}, "optim.aux.kwargs.ns_steps"),
    ({"lr": -1.0}, "optim.lr"),
    # torch's SGD refuses it at construction, which was blamed on optim.name
    ({"name": "sgd", "momentum": 0.0, "nesterov": True}, "optim.nesterov"),
    ({"preset": "gpt2", "aux": {"optimizer": "sgd", "kwargs": {"momentum": 0.0,
                                                                "nesterov": True}}},
     "optim.aux.kwargs.nesterov"),
    ({"warmup_steps": -1}, "optim.warmup_steps"),
    ({"schedule": "linear", "min_lr_ratio": 1.5}, "optim.min_lr_ratio"),
    ({"schedule": "cosine", "min_lr_ratio": -0.1}, "optim.min_lr_ratio"),
    ({"ema_decay": 0.5, "ema_start_step": -1}, "optim.ema_start_step"),
    ({"min_lr_ratio": 0.1}, "optim.min_lr_ratio"),  # a floor without decay: never read
    ({"ema_decay": 1.0}, "optim.ema_decay"),
    ({"lr": float("inf")}, "optim.lr"),
    ({"lr": float("nan")}, "optim.lr"),
    ({"groups": [{"pattern": ".", "optimizer": "sgd", "lr": float("inf")}]},
     "optim.groups[0].lr"),
    ({"groups": [{"pattern": ".", "optimizer": "sgd", "lr": -0.1}]}, "optim.groups[0].lr"),
    ({"preset": "gpt2", "aux": {"lr": -0.1}}, "optim.aux.lr"),
    ({"preset": "gpt2", "aux": {"kwargs": {"momentum": 0.9}}}, "optim.aux.kwargs.momentum"),
    ({"name": "adamw", "nesterov": True}, "optim.nesterov"),
    ({"name": "adamw", "momentum": 0.9}, "optim.momentum"),
    ({"inner_momentum": {"k_muon": 1}, "filter": {"name": "disk"}}, "optim.inner_momentum"),
])
def test_config_mistakes_name_their_field(optim, field):
    cfg = from_dict(OptimConfig, optim)
    with pytest.raises(ConfigError) as e:
        validate_tree(cfg, "optim")
    assert e.value.field == field


def test_unknown_config_key_is_an_error():
    with pytest.raises(ConfigError) as e:
        from_dict(OptimConfig, {"nesterv": True}, "optim")
    assert e.value.field == "optim.nesterv"


@pytest.mark.parametrize("optim,field,says", [
    # the papers' names for what are settings here
    ({"name": "muon_im"}, "optim.name", "optim.inner_momentum.k_muon"),
    ({"name": "DP-Muon-IM"}, "optim.name", "optim.inner_momentum.k_muon"),
    ({"name": "disk"}, "optim.name", "optim.filter.name=disk"),
    ({"name": "DOPPLER"}, "optim.name", "optim.filter.name=doppler"),
    ({"name": "DP-SGD"}, "optim.name", "write 'sgd' (every optimizer"),
    ({"name": "dp_muon_bc"}, "optim.name", "write 'muon_bc' (every optimizer"),
    ({"name": "muonbc"}, "optim.name", "write 'muon_bc'"),
    ({"name": "adam"}, "optim.name", "write 'adamw'"),
    ({"aux": {"optimizer": "Adam"}}, "optim.aux.optimizer", "write 'adamw'"),
    # aux takes adamw or sgd: not "keep 'muon'"
    ({"aux": {"optimizer": "DP-Muon-IM"}}, "optim.aux.optimizer", "keep 'adamw' or 'sgd'"),
    ({"name": "DPSGD"}, "optim.name", "write 'sgd' (every optimizer"),  # (no separator)
    ({"name": "dpadam"}, "optim.name", "write 'adamw' (every optimizer"),
    ({"groups": [{"pattern": "w", "optimizer": "DP-Muon"}]}, "optim.groups[0].optimizer",
     "write 'muon'"),
])
def test_an_optimizer_named_as_the_papers_name_it_is_refused_with_the_setting_meant(
        optim, field, says):
    with pytest.raises(ConfigError) as e:
        validate_tree(from_dict(OptimConfig, optim, "optim"), "optim")
    assert e.value.field == field
    assert says in e.value.message


def test_a_config_built_in_python_gets_the_hint_too():
    with pytest.raises(ConfigError) as e:
        validate_tree(OptimConfig(name="dp_adamw"), "optim")
    assert e.value.field == "optim.name" and "write 'adamw'" in e.value.message


@pytest.mark.parametrize("optim,field", [
    ({"name": "foo"}, "optim.name"),
    ({"aux": {"optimizer": "muon"}}, "optim.aux.optimizer"),  # a name, but not of aux's
    ({"filter": {"name": "muon_im"}}, "optim.filter.name"),  # not an optimizer's field
])
def test_no_hint_is_given_where_none_fits(optim, field):
    with pytest.raises(ConfigError) as e:
        validate_tree(from_dict(OptimConfig, optim, "optim"), "optim")
    assert e.value.field == field
    assert ";" not in e.value.message


@pytest.mark.parametrize("tie", [True, False])
def test_gpt2_preset_puts_matrices_in_muon_and_embeddings_head_vectors_in_adamw(tie):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=16, vocab_size=64,
                                     n_positions=16, tie_word_embeddings=tie)
    model = transformers.GPT2LMHeadModel(config)
    opt = _build({"name": "muon", "lr": 0.002, "preset": "gpt2", "aux": {"lr": 0.0035}},
                 model=model)
    groups = _members(opt)
    assert set(groups) == {"matrices", "others"}
    muon_opt, muon_names = groups["matrices"]
    adamw_opt, adamw_names = groups["others"]
    assert (muon_opt, adamw_opt) == ("muon", "adamw")
    expected_muon = [f"transformer.h.{i}.{m}.weight" for i in range(2)
                     for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")]
    assert sorted(muon_names) == sorted(expected_muon)
    assert {"transformer.wte.weight", "transformer.wpe.weight"} <= set(adamw_names)
    assert ("lm_head.weight" in adamw_names) == (not tie)
    every = [n for n, p in model.named_parameters()]
    assert sorted(muon_names + adamw_names) == sorted(every)
    assert all(model.get_parameter(n).ndim == 1 for n in adamw_names
               if "wte" not in n and "wpe" not in n and "lm_head" not in n)
    assert opt.lr == {"matrices": 0.002, "others": 0.0035}


@pytest.mark.parametrize("family, tie", [("llama", True), ("llama", False), ("qwen2", False)])
def test_causal_lm_preset_gives_muon_the_decoder_layers_matrices_and_adamw_the_rest(family, tie):
    """Llama (tied and untied head) and Qwen2 (q/k/v biases): Muon for q/k/v/o and the
    gate/up/down projections of every decoder layer; AdamW for the token embedding, the head,
    the norms and the biases."""
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.for_model(
        family, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=64, tie_word_embeddings=tie)
    model = transformers.AutoModelForCausalLM.from_config(config)
    opt = _build({"name": "muon", "lr": 0.002, "preset": "causal_lm", "aux": {"lr": 0.01}},
                 model=model)
    groups = _members(opt)
    assert groups["matrices"][0] == "muon" and groups["others"][0] == "adamw"
    assert sorted(groups["matrices"][1]) == sorted(
        f"model.layers.{i}.{m}.weight" for i in range(2)
        for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                  "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"))
    others = groups["others"][1]
    norms = [f"model.layers.{i}.{n}.weight" for i in range(2)
             for n in ("input_layernorm", "post_attention_layernorm")] + ["model.norm.weight"]
    biases = [f"model.layers.{i}.self_attn.{x}_proj.bias" for i in range(2) for x in "qkv"]
    head = [] if tie else ["lm_head.weight"]  # tied: the embedding's tensor, listed once
    assert sorted(others) == sorted(["model.embed_tokens.weight", *head, *norms,
                                     *(biases if family == "qwen2" else [])])
    assert opt.lr == {"matrices": 0.002, "others": 0.01}


class _ScaledStdConv(torch.nn.Module):
    """timm's ScaledStdConv2d parameters: weight (o, i, k, k), bias (o,), gain (o, 1, 1, 1)."""

    def __init__(self, i, o, k):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(o, i, k, k))
        self.bias = torch.nn.Parameter(torch.zeros(o))
        self.gain = torch.nn.Parameter(torch.ones(o, 1, 1, 1))


def test_causal_lm_preset_takes_only_numbered_blocks_not_any_name_with_a_digit():
    """A block is a numbered module (``layers.0.``); a matrix outside the blocks whose name has
    a digit (LLaVA's ``multi_modal_projector.linear_1``) goes to aux, as every other one does."""
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4, bias=False)])
    model.linear_1 = torch.nn.Linear(4, 4, bias=False)
    model.v2 = torch.nn.Linear(4, 4, bias=False)
    groups = _members(_build({"name": "muon", "preset": "causal_lm"}, model=model))
    assert groups == {"matrices": ("muon", ["layers.0.weight"]),
                      "others": ("adamw", ["linear_1.weight", "v2.weight"])}


def test_causal_lm_preset_keeps_an_embedding_inside_a_block_for_aux():
    # (a 2-D tensor named like an embedding, in a numbered block: aux, not a refusal)
    block = torch.nn.Module()
    block.q_proj = torch.nn.Linear(4, 4, bias=False)
    block.embed_positions = torch.nn.Embedding(6, 4)
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([block])
    groups = _members(_build({"name": "muon", "preset": "causal_lm"}, model=model))
    assert groups == {"matrices": ("muon", ["layers.0.q_proj.weight"]),
                      "others": ("adamw", ["layers.0.embed_positions.weight"])}


def test_the_vit_preset_keeps_every_kind_of_position_table_and_the_heads_for_aux():
    """Each name of docs/optim.md's list, in a block, as a 2-D tensor, and both of DeiT's heads:
    aux (a position table given to Muon is a refusal of the preset)."""
    attn = torch.nn.Module()
    attn.qkv = torch.nn.Linear(4, 12, bias=False)
    attn.cpb_mlp = torch.nn.Sequential(torch.nn.Linear(2, 4, bias=False))  # Swin V2
    attn.rel_pos = torch.nn.Module()
    attn.rel_pos.mlp = torch.nn.Linear(2, 4, bias=False)  # timm's vit_relpos
    attn.rel_pos_h = torch.nn.Parameter(torch.zeros(7, 4))  # SAM
    attn.relative_position_bias_table = torch.nn.Parameter(torch.zeros(9, 2))  # BEiT, Swin
    block = torch.nn.Module()
    block.attn = attn
    model = torch.nn.Module()
    model.patch_embed = torch.nn.Linear(4, 4, bias=False)
    model.blocks = torch.nn.ModuleList([block])
    model.head = torch.nn.Linear(4, 3, bias=False)
    model.head_dist = torch.nn.Linear(4, 3, bias=False)  # DeiT's distillation head
    groups = _members(_build({"name": "muon", "preset": "vit"}, model=model))
    assert groups["matrices"] == ("muon", ["blocks.0.attn.qkv.weight"])
    assert sorted(groups["others"][1]) == sorted(
        n for n, _ in model.named_parameters() if n != "blocks.0.attn.qkv.weight")


def test_nfresnet_preset_puts_conv_weights_in_muon_and_gains_biases_classifier_elsewhere():
    model = torch.nn.Module()
    model.stem = torch.nn.Module()
    model.stem.conv = _ScaledStdConv(3, 8, 3)
    model.stages = torch.nn.Sequential(torch.nn.Module())
    model.stages[0].conv1 = _ScaledStdConv(8, 8, 1)
    model.stages[0].skipinit_gain = torch.nn.Parameter(torch.zeros(()))
    model.stages[0].proj = torch.nn.Linear(8, 8)  # a hidden Linear (mnist_demo's CNN has one)
    model.head = torch.nn.Module()
    model.head.fc = torch.nn.Linear(8, 10)
    opt = _build({"name": "muon", "preset": "nfresnet", "aux": {"optimizer": "sgd", "lr": 0.1}},
                 model=model)
    groups = _members(opt)
    assert groups["matrices"] == ("muon", ["stem.conv.weight", "stages.0.conv1.weight"])
    assert groups["others"][0] == "sgd"
    assert sorted(groups["others"][1]) == sorted([
        "stem.conv.bias", "stem.conv.gain", "stages.0.conv1.bias", "stages.0.conv1.gain",
        "stages.0.skipinit_gain", "stages.0.proj.weight", "stages.0.proj.bias",
        "head.fc.weight", "head.fc.bias"])
    # a classifier that is a 1x1 convolution (timm's use_conv heads) is no Muon matrix either
    model.head.fc = torch.nn.Conv2d(8, 10, 1)
    groups = _members(_build({"name": "muon", "preset": "nfresnet",
                              "aux": {"optimizer": "sgd", "lr": 0.1}}, model=model))
    assert groups["matrices"][1] == ["stem.conv.weight", "stages.0.conv1.weight"]
    assert "head.fc.weight" in groups["others"][1]


@pytest.mark.parametrize("name", ["convnext_atto", "convnext_tiny"])
def test_convnext_preset_gives_muon_the_mlp_and_downsampling_matrices(name):
    """Both MLP forms (atto's 1x1 convolutions, tiny's Linears) and the downsampling
    convolutions are Muon's; the stem, depth-wise filters, layer scales, norms and head AdamW's."""
    timm = pytest.importorskip("timm")
    model = timm.create_model(name, num_classes=10, depths=(1, 1, 1, 1))
    opt = _build({"name": "muon", "preset": "convnext"}, model=model)
    groups = _members(opt)
    mlp_ndim = 4 if name == "convnext_atto" else 2
    want = [n for n, p in model.named_parameters()
            if (".mlp.fc" in n and n.endswith("weight") and p.ndim == mlp_ndim)
            or (".downsample.1.weight" in n and p.ndim == 4)]
    assert groups["matrices"] == ("muon", want) and len(want) == 4 * 2 + 3
    others = set(groups["others"][1])
    assert {"stem.0.weight", "stages.0.blocks.0.conv_dw.weight", "stages.0.blocks.0.gamma",
            "head.fc.weight", "head.norm.weight"} <= others
    assert others.isdisjoint(want) and len(others) + len(want) == len(list(model.parameters()))


def test_convnext_preset_gives_muon_the_lora_factors_of_the_mlp():
    """docs/optim.md: with LoRA every preset gives the blocks' 2-D factors to Muon. The convnext
    preset matched only ``.mlp.fc1.weight``, so all of ConvNeXt's factors went to AdamW and the
    run was refused ("gives no parameter of this model to muon")."""
    timm = pytest.importorskip("timm")
    pytest.importorskip("peft")
    from dptrain.models.finetune import LoRAConfig, apply_finetuning

    model = timm.create_model("convnext_tiny", num_classes=10, depths=(1, 1, 1, 1),
                              dims=(8, 16, 24, 32))
    apply_finetuning(model, LoRAConfig(r=2, target_modules=["fc1", "fc2"]), None)
    opt = _build({"name": "muon", "preset": "convnext"}, model=model)
    groups = _members(opt)
    factors = [n for n, p in model.named_parameters() if p.requires_grad]
    assert len(factors) == 4 * 2 * 2 and all(".lora_" in n for n in factors)
    assert groups["matrices"] == ("muon", factors) and "others" not in groups


def test_lora_only_on_the_lm_head_says_the_adapters_go_to_optim_aux():
    """LoRA only on an untied lm_head: the causal_lm preset (the model's own) gives its factors
    to optim.aux; the refusal said "use the model's preset" although it was."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("peft")
    from dptrain.models.finetune import LoRAConfig, apply_finetuning

    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=64, tie_word_embeddings=False))
    apply_finetuning(llama, LoRAConfig(r=2, target_modules=["lm_head"]), None)
    with pytest.raises(ConfigError) as e:
        _build({"name": "muon", "preset": "causal_lm"}, model=llama)
    assert e.value.field == "optim.preset"
    assert ("'causal_lm': model.lora adapts no layer of the blocks; the adapters outside them "
            "(an LM head's) go to optim.aux, so nothing is left for muon (optim.name): use "
            "optim.preset null and optim.name adamw, or target the blocks' layers"
            in e.value.message)
    assert "use the model's preset" not in e.value.message


def test_another_models_preset_on_lora_in_the_blocks_and_the_head_says_use_the_models_preset():
    # some adapters are in the blocks: the preset (nfresnet, for 4-D weights) is the mistake,
    # not the LoRA targets ("adapts no layer of the blocks" was for LM-head-only adapters)
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("peft")
    from dptrain.models.finetune import LoRAConfig, apply_finetuning

    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=64, tie_word_embeddings=False))
    apply_finetuning(llama, LoRAConfig(r=2, target_modules=["q_proj", "lm_head"]), None)
    with pytest.raises(ConfigError) as e:
        _build({"name": "muon", "preset": "nfresnet"}, model=llama)
    assert e.value.field == "optim.preset"
    assert "use the model's preset" in e.value.message
    assert "adapts no layer of the blocks" not in e.value.message


def test_a_preset_for_another_layout_is_refused_not_given_the_embeddings():
    """A GPT-2 config's ``preset: gpt2`` reused for a Llama gave ``model.embed_tokens`` to
    Muon (the gpt2 preset keeps only wte/wpe/lm_head for AdamW), and reused for a ViT its
    position table and patch embedding, in silence: every preset keeps embeddings, position
    tables and heads for optim.aux, so such a split is refused naming them. The fitting
    presets pass."""
    transformers = pytest.importorskip("transformers")
    timm = pytest.importorskip("timm")
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=64, tie_word_embeddings=False))
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=16))
    vit = timm.create_model("vit_tiny_patch16_224", img_size=16, patch_size=8, depth=1,
                            embed_dim=16, num_heads=2, num_classes=3)
    for preset, model, named in (("gpt2", llama, "model.embed_tokens.weight"),
                                 ("gpt2", vit, "pos_embed, patch_embed.proj.weight")):
        with pytest.raises(ConfigError, match="preset") as e:
            _build({"name": "muon", "preset": preset}, model=model)
        assert f"gives {named} to muon" in str(e.value)
        assert "causal_lm: transformers' other causal LMs" in str(e.value)
    for preset, model in (("causal_lm", llama), ("gpt2", gpt2), ("causal_lm", gpt2),
                          ("vit", vit), ("vit", llama)):
        muon = _members(_build({"name": "muon", "preset": preset}, model=model))["matrices"][1]
        assert muon and not any("embed" in n or "wte" in n or "wpe" in n or "lm_head" in n
                                for n in muon)
    # explicit groups take their parameters before the preset: nothing left to refuse
    groups = _members(_build({"name": "muon", "preset": "gpt2", "groups": [
        {"pattern": "embed_tokens", "optimizer": "adamw", "name": "emb"}]}, model=llama))
    assert groups["emb"] == ("adamw", ["model.embed_tokens.weight"])


def test_a_preset_s_names_match_whole_names_only():
    """A preset's groups list exact names: a top-level matrix named ``weight`` is not a part of
    ``norm.weight`` (a search for the bare name took every ``*.weight``)."""
    model = torch.nn.Module()
    model.weight = torch.nn.Parameter(torch.randn(4, 4))
    model.norm = torch.nn.LayerNorm(4)
    groups = _members(_build({"name": "muon", "preset": "gpt2"}, model=model))
    assert groups["matrices"][1] == ["weight"]
    assert sorted(groups["others"][1]) == ["norm.bias", "norm.weight"]


def test_a_preset_s_names_are_literal_not_regexes():
    """The dot of ``fc.weight`` is a dot: the matrices' pattern does not take ``fc_weight``, a
    vector of the same name but for one character (unescaped, it gave Muon the vector)."""
    model = torch.nn.Module()
    model.fc = torch.nn.Linear(4, 4, bias=False)
    model.fc_weight = torch.nn.Parameter(torch.ones(4))
    groups = _members(_build({"name": "muon", "preset": "gpt2"}, model=model))
    assert groups == {"matrices": ("muon", ["fc.weight"]), "others": ("adamw", ["fc_weight"])}


@pytest.mark.parametrize("name", ["muon_bc", "muon_s"])
def test_inner_momentum_s_muon_states_are_the_muon_variant_s_matrices(name):
    """The Muon variants' groups keep Muon states (k_muon), the others' the other states."""
    opt = _build({"name": name, "unmatched": "default", "inner_momentum": {"k_muon": 1},
                  "groups": [{"pattern": "bias$", "optimizer": "adamw"}]})
    assert opt.history is not None
    assert opt.history.muon == {"fc1.weight", "fc2.weight"}


def test_the_vit_preset_keeps_relative_position_tables_for_aux():
    """BEiT's and Swin's attention hold a 2-D relative_position_bias_table: a position table,
    which the vit preset gave to Muon with the blocks' matrices (a red team)."""
    timm = pytest.importorskip("timm")
    for model in (
            timm.create_model("beit_base_patch16_224", img_size=16, patch_size=8, depth=1,
                              embed_dim=16, num_heads=2, num_classes=3),
            timm.create_model("swin_tiny_patch4_window7_224", img_size=16, patch_size=2,
                              window_size=4, depths=(1, 1), num_heads=(1, 2), embed_dim=8,
                              num_classes=3)):
        groups = _members(_build({"name": "muon", "preset": "vit"}, model=model))
        tables = [n for n, _ in model.named_parameters() if "relative_position" in n]
        assert tables and set(tables) <= set(groups["others"][1])
        assert any(n.endswith("attn.qkv.weight") for n in groups["matrices"][1])


def test_explicit_groups_come_before_the_preset():
    transformers = pytest.importorskip("transformers")
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=16))
    opt = _build({"name": "muon", "preset": "gpt2", "groups": [
        {"pattern": r"mlp\.c_fc\.weight$", "optimizer": "muon_s", "name": "fc"}]}, model=model)
    groups = _members(opt)
    assert groups["fc"] == ("muon_s", ["transformer.h.0.mlp.c_fc.weight"])
    assert "transformer.h.0.mlp.c_fc.weight" not in groups["matrices"][1]


def test_a_preset_group_that_explicit_groups_emptied_is_dropped_not_refused():
    # a configured pattern that matches nothing is an error; a preset's group left empty
    # because optim.groups took all of it is not, and no optimizer is built over no parameters
    transformers = pytest.importorskip("transformers")
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=16))
    opt = _build({"name": "muon", "preset": "gpt2", "groups": [
        {"pattern": r"\.(c_attn|c_proj|c_fc)\.weight$", "optimizer": "muon_s",
         "name": "blocks"}]}, model=model)
    groups = _members(opt)
    assert set(groups) == {"blocks", "others"} and len(opt.optimizers) == 2
    assert groups["blocks"][0] == "muon_s" and len(groups["blocks"][1]) == 4
    assert groups["others"][0] == "adamw"
    assert sorted(groups["blocks"][1] + groups["others"][1]) == sorted(
        n for n, _ in model.named_parameters())


def test_schedules():
    T = 10
    assert [lr_factor("constant", t, total_steps=T) for t in (0, 9)] == [1.0, 1.0]
    assert [lr_factor("linear", t, total_steps=T) for t in (0, 5, 9)] == pytest.approx(
        [1.0, 0.5, 0.1])
    cos = [lr_factor("cosine", t, total_steps=T, warmup_steps=2, min_lr_ratio=0.1)
           for t in range(T)]
    assert cos[:2] == pytest.approx([0.5, 1.0])
    assert cos[2] == pytest.approx(1.0) and cos[-1] > 0.1 and cos[-1] < 0.2
    assert all(a >= b for a, b in zip(cos[1:], cos[2:]))
    assert lr_factor("cosine", 6, total_steps=T, warmup_steps=2, min_lr_ratio=0.1) == \
        pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))


@pytest.mark.parametrize("warmup", [0, 3])
@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_schedules_decay_to_the_floor_by_the_documented_formula(schedule, warmup):
    T, floor = 10, 0.2
    for t in range(T):
        warm = min(1.0, (t + 1) / warmup) if warmup else 1.0
        p = max(0.0, (t - warmup) / (T - warmup))
        f = (1 - (1 - floor) * p if schedule == "linear"
             else floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * p)))
        assert lr_factor(schedule, t, total_steps=T, warmup_steps=warmup,
                         min_lr_ratio=floor) == pytest.approx(warm * f, rel=1e-12)


def _one_parameter(optim: dict, W0: torch.Tensor):
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(W0.clone())
    return model.w, _build(optim, model=model)


def test_adamw_settings_follow_the_adamw_equations():
    # decoupled decay; m, v with betas (beta1, beta2) in that order; bias corrections
    gen = torch.Generator().manual_seed(0)
    W0 = torch.randn(4, 3, dtype=torch.float64, generator=gen)
    lr, (b1, b2), eps, wd = 0.01, (0.5, 0.9), 1e-8, 0.1
    W, opt = _one_parameter({"name": "adamw", "lr": lr, "betas": [b1, b2], "eps": eps,
                             "weight_decay": wd}, W0)
    ref, m, v = W0.clone(), torch.zeros_like(W0), torch.zeros_like(W0)
    for t in range(1, 4):
        G = torch.randn(4, 3, dtype=torch.float64, generator=gen)
        W.grad = G.clone()
        opt.step()
        m, v = b1 * m + (1 - b1) * G, b2 * v + (1 - b2) * G * G
        ref = ref * (1 - lr * wd) - lr * (m / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt() + eps)
        torch.testing.assert_close(W.detach(), ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("nesterov", [False, True])
def test_sgd_heavy_ball_and_nesterov(nesterov):
    gen = torch.Generator().manual_seed(1)
    W0 = torch.randn(5, dtype=torch.float64, generator=gen)
    lr, mu = 0.1, 0.9
    W, opt = _one_parameter({"name": "sgd", "lr": lr, "momentum": mu, "nesterov": nesterov}, W0)
    ref, M = W0.clone(), torch.zeros_like(W0)
    for _ in range(3):
        G = torch.randn(5, dtype=torch.float64, generator=gen)
        W.grad = G.clone()
        opt.step()
        M = mu * M + G
        ref = ref - lr * (G + mu * M if nesterov else M)
        torch.testing.assert_close(W.detach(), ref, rtol=1e-12, atol=1e-12)


def test_per_group_learning_rates_follow_the_schedule():
    opt = _build({"name": "adamw", "lr": 0.01, "schedule": "linear", "groups": [
        {"pattern": "fc1", "optimizer": "sgd", "lr": 0.1}, {"pattern": ".", "optimizer": "adamw"}]},
        total_steps=4)
    net_params = opt.named_params
    seen = []
    for _ in range(4):
        seen.append(opt.lr)
        for _, p in net_params:
            p.grad = torch.ones_like(p)
        opt.step()
    assert [s["optim.groups[0]"] for s in seen] == pytest.approx([0.1, 0.075, 0.05, 0.025])
    assert [s["optim.groups[1]"] for s in seen] == pytest.approx([0.01, 0.0075, 0.005, 0.0025])


# --- state_dict round trip ------------------------------------------------------------------

_ROUND_TRIP = {
    "name": "muon_bc", "lr": 0.01, "schedule": "cosine", "warmup_steps": 2, "groups": [
        {"pattern": r"^fc1\.weight$", "optimizer": "muon_bc"},
        {"pattern": r"^fc2\.weight$", "optimizer": "muon_s", "lr": 0.02},
        {"pattern": r"bias$", "optimizer": "adamw", "lr": 0.003},
    ],
}


def _steps(opt, model, start, num, noise_std):
    """Gradient of a fixed loss at the plan's points, plus seeded 'release noise'."""
    gen = torch.Generator().manual_seed(1000 + start)
    x = torch.randn(8, 6, generator=gen)
    for _ in range(num):
        plan = opt.query_plan()
        named = opt.named_params
        total = {n: torch.zeros_like(p) for n, p in named}
        for coef, values in plan:
            point = {n: (p.detach() if values is None else values[n]).clone().requires_grad_()
                     for n, p in named}
            loss = torch.func.functional_call(model, point, (x,)).square().mean()
            for (n, _), g in zip(named, torch.autograd.grad(loss, list(point.values()))):
                total[n] += coef * g
        for n, p in named:
            p.grad = total[n] + noise_std * torch.randn(p.shape, generator=gen)
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("filt", [{"name": "disk", "kappa": 0.6, "gamma": 0.8},
                                  {"name": "doppler", "a": [-1.0, 0.3], "b": [0.2, 0.1]},
                                  {"name": "none"}])
def test_state_dict_round_trip_continues_bit_for_bit(filt):
    noise = 0.05
    torch.manual_seed(0)
    model = _Net()
    cfg = {**_ROUND_TRIP, "filter": filt}
    opt = _build(cfg, model=model, total_steps=8, release_noise_std=noise, seed=3)
    _steps(opt, model, 0, 3, noise)

    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)

    model2 = _Net()
    model2.load_state_dict(saved["model"])
    opt2 = _build(cfg, model=model2, total_steps=8, release_noise_std=noise, seed=3)
    opt2.load_state_dict(saved["optim"])
    assert opt2.lr == opt.lr and opt2.num_steps == 3

    _steps(opt, model, 3, 4, noise)
    _steps(opt2, model2, 3, 4, noise)
    for (n, p), (_, q) in zip(model.named_parameters(), model2.named_parameters()):
        assert torch.equal(p, q), n
    sd, sd2 = opt.state_dict(), opt2.state_dict()
    for o, o2 in zip(sd["optimizers"], sd2["optimizers"]):
        for k, st in o["state"].items():
            for key, v in st.items():
                assert torch.equal(torch.as_tensor(v), torch.as_tensor(o2["state"][k][key])), key


def test_loading_state_from_other_groups_is_refused():
    opt = _build({"name": "adamw"})
    other = _build({"name": "sgd", "groups": [{"pattern": ".", "optimizer": "sgd", "name": "all"}]})
    with pytest.raises(ValueError, match="different parameter groups"):
        opt.load_state_dict(other.state_dict())


def test_a_loaded_state_keeps_this_configs_settings_and_says_which_changed():
    # torch's load_state_dict would put the checkpoint's group settings back: weight decay,
    # momentum, betas, ns_steps, ns_dtype would silently be the old run's
    torch.manual_seed(0)
    model = _Net()
    old = {"name": "muon", "groups": [
        {"pattern": r"fc1\.weight", "optimizer": "muon", "name": "matrix"},
        {"pattern": ".", "optimizer": "adamw", "name": "rest"}]}
    opt = _build(old, model=model)
    _steps(opt, model, 0, 2, 0.0)
    new = {"name": "muon", "weight_decay": 0.1, "momentum": 0.5, "ns_steps": 3,
           "groups": [{**old["groups"][0]},
                      {**old["groups"][1], "kwargs": {"betas": [0.5, 0.9]}}]}
    opt2 = _build(new, model=model)
    fresh = [{k: v for k, v in g.items() if k not in ("params", "lr", "noise_gain")}
             for o in opt2.optimizers for g in o.param_groups]
    opt2.load_state_dict(opt.state_dict())
    loaded = [{k: v for k, v in g.items() if k not in ("params", "lr", "noise_gain")}
              for o in opt2.optimizers for g in o.param_groups]
    assert loaded == fresh
    assert opt2.optimizers[0].param_groups[0]["weight_decay"] == 0.1
    assert opt2.optimizers[0].param_groups[0]["ns_steps"] == 3
    assert tuple(opt2.optimizers[1].param_groups[0]["betas"]) == (0.5, 0.9)
    assert opt2.num_steps == 2 and opt2.optimizers[0].state  # the state itself did load
    changed = "; ".join(opt2.changed_settings)
    for what in ("matrix.weight_decay", "matrix.momentum", "matrix.ns_steps", "rest.betas"):
        assert what in changed, changed


@pytest.mark.parametrize("group, field", [(0, "groups[0].optimizer"), (1, "groups[1].optimizer")])
def test_loading_state_of_another_optimizer_names_the_group(group, field):
    groups = [{"pattern": r"fc1\.weight", "optimizer": "muon", "name": "matrix"},
              {"pattern": ".", "optimizer": "adamw", "name": "rest"}]
    opt = _build({"name": "muon", "groups": groups})
    swapped = [dict(g) for g in groups]
    swapped[group]["optimizer"] = ("muon_s", "sgd")[group]
    other = _build({"name": "muon", "groups": swapped})
    with pytest.raises(ConfigError) as e:
        other.load_state_dict(opt.state_dict())
    assert e.value.field.endswith(field) and "in the checkpoint" in str(e.value)


def _tiny_gpt2():
    transformers = pytest.importorskip("transformers")
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=16))


def test_a_group_of_the_main_optimizer_inherits_top_level_options_and_its_own_win():
    opt = _build({"name": "sgd", "momentum": 0.9, "weight_decay": 0.01, "groups": [
        {"pattern": "fc1", "optimizer": "sgd", "kwargs": {"momentum": 0.5}},
        {"pattern": "weight", "optimizer": "sgd"},
        {"pattern": ".", "optimizer": "adamw"}]})
    pg = [o.param_groups[0] for o in opt.optimizers]
    assert (pg[0]["momentum"], pg[0]["weight_decay"]) == (0.5, 0.01)  # own kwarg beats optim.*
    assert (pg[1]["momentum"], pg[1]["weight_decay"]) == (0.9, 0.01)  # inherited
    assert pg[2]["weight_decay"] == 0.0 and "momentum" not in pg[2]  # another optimizer: not


def test_preset_aux_kwargs_reach_the_aux_optimizer():
    opt = _build({"name": "muon", "preset": "gpt2",
                  "aux": {"kwargs": {"weight_decay": 0.25, "betas": [0.5, 0.75]}}},
                 model=_tiny_gpt2())
    by_label = {g.label: o.param_groups[0] for g, o in zip(opt.groups, opt.optimizers)}
    assert by_label["others"]["weight_decay"] == 0.25
    assert tuple(by_label["others"]["betas"]) == (0.5, 0.75)
    assert by_label["matrices"]["weight_decay"] == 0.0


def test_a_preset_that_gives_nothing_to_the_main_optimizer_is_refused():
    with pytest.raises(ConfigError) as e:
        _build({"name": "muon", "preset": "nfresnet"})  # _Net has no 4-D weight
    assert e.value.field == "optim.preset"


def test_resuming_with_another_aux_optimizer_blames_optim_aux():
    model = _tiny_gpt2()
    saved = _build({"name": "muon", "preset": "gpt2"}, model=model).state_dict()
    other = _build({"name": "muon", "preset": "gpt2", "aux": {"optimizer": "sgd"}}, model=model)
    with pytest.raises(ConfigError) as e:
        other.load_state_dict(saved)
    assert e.value.field == "optim.aux.optimizer"


def test_frozen_parameters_are_left_out_of_every_group():
    model = _Net()
    model.fc1.bias.requires_grad_(False)
    opt = _build({"name": "adamw"}, model=model)
    names = [n for n, _ in opt.named_params]
    assert "fc1.bias" not in names and len(names) == 3
    assert _members(opt) == {"default": ("adamw", ["fc1.weight", "fc2.weight", "fc2.bias"])}
    # and a frozen parameter is not "in no group"
    _build({"groups": [{"pattern": "weight", "optimizer": "adamw"},
                       {"pattern": "fc2.bias", "optimizer": "sgd"}]}, model=model)


def test_warmup_and_floor_of_the_config_drive_the_learning_rate():
    # linear, T=6, warm-up 2, floor 0.5, base 0.1: factor = min(1, (t+1)/2) *
    # (1 - 0.5 * max(0, (t-2)/4)), by the documented formula (test_schedules_decay_...)
    opt = _build({"name": "adamw", "lr": 0.1, "schedule": "linear", "warmup_steps": 2,
                  "min_lr_ratio": 0.5}, total_steps=6)
    seen = []
    for _ in range(6):
        seen.append(opt.lr["default"])
        for _, p in opt.named_params:
            p.grad = torch.zeros_like(p)
        opt.step()
    assert seen == pytest.approx([0.05, 0.1, 0.1, 0.0875, 0.075, 0.0625])


def test_inner_momentum_k_other_without_other_parameters_is_refused():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False), torch.nn.Linear(4, 2, bias=False))
    with pytest.raises(ConfigError) as e:
        _build({"name": "muon", "inner_momentum": {"k_other": 2}}, model=model)
    assert e.value.field == "optim.inner_momentum.k_other"
    _build({"name": "muon", "inner_momentum": {"k_muon": 2}}, model=model)  # fine
    # gamma_other = 0: the other history is off, so no other parameter is needed for it
    _build({"name": "muon", "inner_momentum": {"k_muon": 2, "k_other": 2, "gamma_other": 0.0}},
           model=model)


def test_inner_momentum_k_muon_with_zero_weight_is_not_refused_without_muon():
    # gamma_muon = 0: the Muon history is off, so no Muon parameter is needed for it
    _build({"name": "adamw", "inner_momentum": {"k_muon": 2, "gamma_muon": 0.0, "k_other": 1}})
    with pytest.raises(ConfigError) as e:
        _build({"name": "adamw", "inner_momentum": {"k_muon": 2, "k_other": 1}})
    assert e.value.field == "optim.inner_momentum.k_muon"


def test_transposed_weights_names_a_root_conv1d_weight():
    from transformers.pytorch_utils import Conv1D

    from dptrain.optim.build import transposed_weights

    assert transposed_weights(Conv1D(3, 4)) == frozenset({"weight"})
    assert transposed_weights(torch.nn.Sequential(Conv1D(3, 4))) == frozenset({"0.weight"})
    assert transposed_weights(torch.nn.Linear(3, 4)) == frozenset()


@pytest.mark.parametrize("optim", [
    {"lr": 0.0}, {"preset": "gpt2", "aux": {"lr": 0.0}},
    {"groups": [{"pattern": ".", "optimizer": "sgd", "lr": 0.0}]},
    {"schedule": "linear", "min_lr_ratio": 1.0},
    {"schedule": "cosine", "min_lr_ratio": 0.0}, {"warmup_steps": 0}, {"ema_decay": 0.0},
    {"ema_decay": 0.5, "ema_start_step": 0},
    # with the feature switched off, as in a sweep that includes the off point
    {"ema_start_step": 10}, {"inner_momentum": {"k_muon": 0, "gamma_muon": 0.9}}])
def test_config_boundaries_are_accepted(optim):
    validate_tree(from_dict(OptimConfig, optim), "optim")


def test_filter_noise_gain_reaches_muon_bc_groups():
    # DiSK's output holds the latest release with coefficient kappa from its second step on;
    # DP-MuonBC's bias correction reads that gain from its param group
    gen = torch.Generator().manual_seed(0)
    opt = _build({"name": "muon_bc", "groups": [{"pattern": "weight", "optimizer": "muon_bc"},
                                               {"pattern": ".", "optimizer": "adamw"}],
                  "filter": {"name": "disk", "kappa": 0.6, "gamma": 0.8}},
                 release_noise_std=0.1)
    gains = []
    for _ in range(3):
        for _, p in opt.named_params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
        gains.append([o.param_groups[0]["noise_gain"] for o in opt.optimizers])
    assert gains == [[1.0, 1.0], [0.6, 0.6], [0.6, 0.6]]


def test_transposed_weights_use_fan_out_over_fan_in_for_muons_original_scale():
    # w stored (in=3, out=6) like Conv1D: s = sqrt(max(1, fan_out / fan_in)) = sqrt(2), while
    # read as (out=3, in=6) it would be sqrt(max(1, 1/2)) = 1
    gen = torch.Generator().manual_seed(0)
    W0, G = torch.randn(3, 6, generator=gen), torch.randn(3, 6, generator=gen)
    deltas = []
    for transposed in (frozenset({"w"}), frozenset()):
        model = torch.nn.Module()
        model.w = torch.nn.Parameter(W0.clone())
        opt = _build({"name": "muon", "scale": "original", "lr": 0.1}, model=model,
                     transposed=transposed)
        model.w.grad = G.clone()
        opt.step()
        deltas.append((model.w.detach() - W0).norm())
    assert float(deltas[0] / deltas[1]) == pytest.approx(2 ** 0.5, rel=1e-5)


@pytest.mark.parametrize("optim, field", [
    ({"name": "muon", "preset": "nfresnet", "lr": 0.02, "weight_decay": 1e6},
     "optim.weight_decay"),
    ({"name": "adamw", "lr": 1e30, "weight_decay": 0.1}, "optim.weight_decay"),
    ({"name": "sgd", "lr": 0.5, "weight_decay": 2.0}, "optim.weight_decay"),  # coupled L2: same
    ({"name": "muon", "preset": "nfresnet", "aux": {"optimizer": "adamw", "lr": 0.01,
                                                  "kwargs": {"weight_decay": 200}}},
     "optim.aux.kwargs.weight_decay"),
])
def test_a_decay_that_flips_the_weights_sign_every_step_is_refused(optim, field):
    """lr x weight_decay >= 1 multiplies the weights by 1 - lr wd <= 0 at every step: the run
    went to NaN with exit 0. Now a ConfigError names the group's weight decay."""
    model = (torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(),
                                 torch.nn.Linear(4, 2)) if optim.get("preset") else None)
    with pytest.raises(ConfigError) as e:
        _build(optim, model=model)
    assert e.value.field == field and "lr x weight_decay" in e.value.message
    ok = ({**optim, "weight_decay": 0.5 / optim.get("lr", 0.02)} if "weight_decay" in optim
          else {**optim, "aux": {**optim["aux"], "kwargs": {"weight_decay": 0.5}}})
    _build(ok, model=model)  # lr x wd = 0.5: decays, does not flip


@pytest.mark.parametrize("decay", [0.0, 0.25])
def test_any_positive_ema_decay_turns_the_average_on(decay):
    # the bias-corrected mean of the iterates weighted by d^(t-s) (docs/optim.md); 0: off
    opt = _build({"name": "sgd", "lr": 1.0, "ema_decay": decay})
    if decay == 0:
        assert opt.ema is None
        return
    thetas = []
    for _ in range(2):
        for _, p in opt.named_params:
            p.grad = torch.ones_like(p)
        opt.step()
        thetas.append({n: p.detach().clone() for n, p in opt.named_params})
    for n, _ in opt.named_params:
        expected = (thetas[1][n] + decay * thetas[0][n]) / (1 + decay)
        torch.testing.assert_close(opt.ema.values[n], expected)
