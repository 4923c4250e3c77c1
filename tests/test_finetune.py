"""Parameter-efficient private fine-tuning (dptrain/models/finetune.py): LoRA adapters (peft)
and ``model.trainable``.

- the engine's per-example norms and clipped sums over the trainable coordinates only (adapter
  factors, a tied head, norms' and biases' vectors) equal a loop of single-example gradients,
  on GPT-2 (Conv1D targets) and a Llama (Linear targets), and for an inner-momentum query;
- the merged final model equals peft's own merge and computes the adapted model's logits;
- a run trains nothing but the trainable parameters, writes a plain model that transformers
  loads and, when only adapters were trained, an adapter folder that peft loads over the base;
- the refusals (a regex matching nothing, a target that is not a linear layer, LoRA settings
  without a rank), exit status 2 from the CLI.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from _reference import reference_grads
from _threads import _one_thread  # noqa: F401  (autouse: one torch thread)
from test_clipping_models import compare, gpt2_batch, gpt2_loss, loop_grads, tiny_gpt2
from test_clipping_rules import check

from dptrain.config import ConfigError, load
from dptrain.models.finetune import (LoRAConfig, apply_finetuning, lora_layers, merged_state,
                                     validate_trainable)

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")


def _trainable(model) -> list[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad]


def _randomise_b(model, seed: int = 1) -> None:
    """peft initialises lora_B to zero (the adapted model starts as the base): draw it, so
    that the gradients through the adapters and the merged weights are not trivial."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen, dtype=p.dtype))


def _tiny_llama(tied: bool, dtype=torch.float64):
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=48,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=32,
                                   tie_word_embeddings=tied)
    return transformers.LlamaForCausalLM._from_config(
        cfg, attn_implementation="eager").to(dtype).train()


# ---------------------------------------------------------------------------------------------
# which parameters train


def test_lora_freezes_all_but_the_adapters_and_the_trainable_matches():
    model = tiny_gpt2(torch.float64)
    apply_finetuning(model, LoRAConfig(r=2, target_modules=["c_attn", "c_fc"]),
                     ["ln_f", "^lm_head"])
    names = _trainable(model)
    # 2 blocks x 2 targets x (A, B), the final norm's weight and bias, and the tied
    # embedding (matched by its second name, lm_head.weight; listed under its first)
    assert sum("lora_" in n for n in names) == 8
    assert {n for n in names if "lora_" not in n} == {
        "transformer.ln_f.weight", "transformer.ln_f.bias", "transformer.wte.weight"}
    assert set(lora_layers(model)) == {f"transformer.h.{i}.{m}" for i in range(2)
                                       for m in ("attn.c_attn", "mlp.c_fc")}
    assert all(m.fan_in_fan_out for m in lora_layers(model).values())  # Conv1D: (in, out)


@pytest.mark.parametrize("alpha, rslora, scale", [(None, False, 1.0), (8.0, False, 2.0),
                                                  (8.0, True, 4.0), (None, True, 2.0)])
def test_lora_scale_is_alpha_over_r_or_over_its_root(alpha, rslora, scale):
    """alpha null is alpha = r (scale 1); rslora divides by sqrt(r) (r = 4)."""
    from dptrain.models.finetune import describe

    model = tiny_gpt2(torch.float64)
    total = sum(p.numel() for p in model.parameters())  # (tied wte/lm_head counted once)
    apply_finetuning(model, LoRAConfig(r=4, alpha=alpha, rslora=rslora,
                                       target_modules=["c_attn"]), None)
    layers = lora_layers(model)
    assert layers and all(m.scaling["default"] == pytest.approx(scale) for m in layers.values())
    counts = describe(model)
    adapters = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    assert counts["trainable_parameters"] == adapters
    assert counts["total_parameters"] == total + adapters
    assert counts["total_parameters"] < total + adapters + model.lm_head.weight.numel()


def test_trainable_alone_trains_the_matches_only():
    model = tiny_gpt2(torch.float64)
    apply_finetuning(model, LoRAConfig(), [r"\.bias$"])  # DP-BiTFiT
    names = _trainable(model)
    assert names and all(n.endswith(".bias") for n in names)
    assert len(names) == sum(n.endswith(".bias") for n, _ in model.named_parameters())
    untouched = tiny_gpt2(torch.float64)
    apply_finetuning(untouched, LoRAConfig(), None)  # both off: nothing changes
    assert all(p.requires_grad for p in untouched.parameters()) and not lora_layers(untouched)


def test_default_targets_are_peft_s_for_the_model_type():
    model = _tiny_llama(tied=False)
    apply_finetuning(model, LoRAConfig(r=2), None)
    assert sorted(lora_layers(model)) == sorted(f"model.layers.{i}.self_attn.{p}"
                                                for i in range(2) for p in ("q_proj", "v_proj"))
    assert not any(m.fan_in_fan_out for m in lora_layers(model).values())  # nn.Linear


@pytest.mark.parametrize("lora, trainable, field, words", [
    (LoRAConfig(r=2, target_modules=["wte"]), None, "model.lora.target_modules", "Embedding"),
    (LoRAConfig(r=2, target_modules=["ln_1"]), None, "model.lora.target_modules", "LayerNorm"),
    (LoRAConfig(r=2, target_modules=["q_proj"]), None, "model.lora.target_modules",
     "names no module"),
    (LoRAConfig(r=2, target_modules=["lm_head"]), None, "model.lora.target_modules",
     "tied to transformer.wte.weight"),
    # peft's matching: a whole last component ("proj" is not "c_proj"), else peft's own error
    (LoRAConfig(r=2, target_modules=["proj"]), None, "model.lora.target_modules",
     "names no module"),
    (LoRAConfig(), ["ln_f", "nothing_like_this"], "model.trainable[1]", "matches no parameter"),
])
def test_refusals_name_the_field(lora, trainable, field, words):
    model = tiny_gpt2(torch.float32)
    with pytest.raises(ConfigError) as e:
        apply_finetuning(model, lora, trainable)
    assert e.value.field == field and words in e.value.message


def test_a_subclass_of_linear_is_refused_as_a_target():
    """Targets must be exactly nn.Linear or Conv1D: nn.MultiheadAttention's out_proj is a
    subclass of nn.Linear whose weight the attention reads itself (its forward is never
    called), so an adapter on it would never act."""
    model = torch.nn.Sequential()
    model.add_module("attn", torch.nn.MultiheadAttention(8, 2, batch_first=True))
    assert isinstance(model.attn.out_proj, torch.nn.Linear)
    with pytest.raises(ConfigError) as e:
        apply_finetuning(model, LoRAConfig(r=2, target_modules=["out_proj"]), None)
    assert e.value.field == "model.lora.target_modules"
    assert "attn.out_proj is a NonDynamicallyQuantizableLinear" in e.value.message


def test_lora_dropout_is_a_dropout_of_the_model_with_per_example_masks():
    """model.lora.dropout reaches peft's lora_dropout on each adapter's input, so the model has
    a dropout (the trainer's per-example mode is entered) and an example's adapted output under
    the mode does not depend on the other examples of its microbatch."""
    from dptrain.models.dropout import ExampleDropout, has_dropout

    model = tiny_gpt2(torch.float64)
    apply_finetuning(model, LoRAConfig(r=2, dropout=0.25, target_modules=["c_attn"]), None)
    drops = [m.lora_dropout["default"] for m in lora_layers(model).values()]
    assert len(drops) == 2 and all(isinstance(d, torch.nn.Dropout) and d.p == 0.25
                                   for d in drops)
    assert has_dropout(model)
    _randomise_b(model)
    ids = gpt2_batch()[0][:3]
    with torch.no_grad():
        with ExampleDropout(seed=0, step=1, indices=[4, 5, 6]):
            together = model(input_ids=ids).logits
        with ExampleDropout(seed=0, step=1, indices=[5]):
            alone = model(input_ids=ids[1:2]).logits
        with ExampleDropout(seed=0, step=2, indices=[4, 5, 6]):
            other_step = model(input_ids=ids).logits
    torch.testing.assert_close(alone[0], together[1], rtol=1e-10, atol=1e-10)
    assert not torch.allclose(other_step, together, atol=1e-6)  # the masks act


def test_mixed_conv1d_and_linear_targets_merge_each_its_way_and_write_no_adapter(tmp_path,
                                                                                capsys):
    """A Conv1D (weight stored (in, out)) and an nn.Linear target in one model: peft's layers
    get fan_in_fan_out True and False, the merged weights equal the adapted forward layer by
    layer, and no adapter folder is written (one adapter_config has one fan_in_fan_out), with
    one line on stderr saying why (a run said nothing of it)."""
    from transformers.pytorch_utils import Conv1D

    from dptrain.models.finetune import write_adapter

    torch.manual_seed(0)
    model = torch.nn.Sequential()
    model.add_module("conv", Conv1D(6, 4))  # 4 -> 6, weight (4, 6)
    model.add_module("lin", torch.nn.Linear(6, 5))
    model.double()
    lora = LoRAConfig(r=2, alpha=3, target_modules=["conv", "lin"])
    apply_finetuning(model, lora, None)
    assert {n: m.fan_in_fan_out for n, m in lora_layers(model).items()} == {"conv": True,
                                                                            "lin": False}
    _randomise_b(model)
    x = torch.randn(3, 4, dtype=torch.float64)
    with torch.no_grad():
        want = model(x)
        merged = merged_state(model.state_dict(), model)
        plain = torch.nn.Sequential()
        plain.add_module("conv", Conv1D(6, 4))
        plain.add_module("lin", torch.nn.Linear(6, 5))
        plain.double().load_state_dict(merged)
        torch.testing.assert_close(plain(x), want, rtol=1e-12, atol=1e-12)
    capsys.readouterr()
    assert not write_adapter(model.state_dict(), model, lora, tmp_path / "adapter")
    assert not (tmp_path / "adapter").exists()
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"dptrain: note: {tmp_path / 'adapter'} is not written: the LoRA "
                           f"targets mix transformers' Conv1D (conv) and nn.Linear (lin) "
                           f"layers"), line


def test_a_regex_of_an_adapted_layer_s_base_name_is_refused_naming_peft_s_name():
    # c_attn's bias is ...c_attn.base_layer.bias once peft wraps c_attn: the message named the
    # first three parameters (wte, wpe, ln_1), none of them near it
    model = tiny_gpt2(torch.float32)
    with pytest.raises(ConfigError) as e:
        apply_finetuning(model, LoRAConfig(r=2, target_modules=["c_attn"]), [r"c_attn\.bias$"])
    message = e.value.message
    assert e.value.field == "model.trainable[0]"
    assert message.startswith(r"'c_attn\.bias$' matches no parameter of this model (closest: "
                              "transformer.h.0.attn.c_attn.base_layer.bias, "
                              "transformer.h.1.attn.c_attn.base_layer.bias)"), message
    assert "adapted layer's own parameters are named <layer>.base_layer.<name>" in message
    # without LoRA: the names closest to a typo, else the first ones (no word of peft)
    with pytest.raises(ConfigError) as e:
        apply_finetuning(tiny_gpt2(torch.float32), LoRAConfig(), ["ln_F"])
    assert "(closest: transformer.ln_f.weight, " in e.value.message, e.value.message
    assert "base_layer" not in e.value.message
    with pytest.raises(ConfigError) as e:
        apply_finetuning(tiny_gpt2(torch.float32), LoRAConfig(), ["nothing_like_this"])
    assert e.value.message.endswith("(e.g. transformer.wte.weight, transformer.wpe.weight, "
                                     "transformer.h.0.ln_1.weight)"), e.value.message


def test_a_timm_model_needs_target_modules():
    import timm

    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=16,
                              patch_size=8, num_classes=3, depth=1)
    with pytest.raises(ConfigError, match="no default target modules"):
        apply_finetuning(model, LoRAConfig(r=2), None)
    apply_finetuning(model, LoRAConfig(r=2, target_modules=["qkv", "fc1"]), ["^head\\."])
    assert len(lora_layers(model)) == 2 and "head.weight" in _trainable(model)


@pytest.mark.parametrize("lora, field", [
    (LoRAConfig(alpha=16), "alpha"), (LoRAConfig(target_modules=["c_attn"]), "target_modules"),
    (LoRAConfig(r=-1), "r"), (LoRAConfig(r=4, dropout=1.0), "dropout"),
    (LoRAConfig(r=4, alpha=0), "alpha"), (LoRAConfig(r=4, target_modules=[]), "target_modules"),
    # each LoRA setting without a rank would be ignored
    (LoRAConfig(dropout=0.1), "dropout"), (LoRAConfig(rslora=True), "rslora"),
    (LoRAConfig(r=4, alpha=float("inf")), "alpha"),
    (LoRAConfig(r=4, target_modules=["c_attn", "."]), "target_modules"),
    (LoRAConfig(r=4, target_modules=[""]), "target_modules"),
])
def test_lora_config_refusals(lora, field):
    with pytest.raises(ConfigError) as e:
        lora.validate()
    assert e.value.field == field


def test_trainable_must_be_valid_regexes():
    with pytest.raises(ConfigError) as e:
        validate_trainable(["ok", "(unclosed"])
    assert e.value.field == "trainable[1]"
    with pytest.raises(ConfigError):
        validate_trainable([])


# ---------------------------------------------------------------------------------------------
# the clipping engine over the trainable coordinates


MODES = [("ghost", "bookkeeping"), ("instantiate", "two_pass"), ("auto", "bookkeeping")]


def test_gpt2_lora_norms_and_clipped_sums_equal_the_single_example_loop():
    model = tiny_gpt2(torch.float64)
    apply_finetuning(model, LoRAConfig(r=3, target_modules=["c_attn", "c_proj", "c_fc"]),
                     [r"ln_2\.bias", "^lm_head"])  # tied head: wte's rows and the head's
    _randomise_b(model)
    batch = gpt2_batch()
    ref = loop_grads(model, gpt2_loss, batch)
    assert ref.shape[1] == sum(p.numel() for _, p in model.named_parameters() if p.requires_grad)
    compare(model, gpt2_loss, batch, ref, 1e-10, ("ghost", "instantiate"), MODES)


@pytest.mark.parametrize("lora, trainable", [
    (LoRAConfig(), [r"\.bias$"]),  # DP-BiTFiT: every weight frozen, every bias trained
    # an adapter beside its own base layer's trained bias, and the position table
    (LoRAConfig(r=2, target_modules=["c_attn"]), [r"c_attn\.base_layer\.bias", "wpe"]),
], ids=["bitfit", "lora+base_bias+wpe"])
def test_frozen_weights_with_trained_biases_equal_the_single_example_loop(lora, trainable):
    model = tiny_gpt2(torch.float64)
    apply_finetuning(model, lora, trainable)
    _randomise_b(model)
    batch = gpt2_batch()
    compare(model, gpt2_loss, batch, loop_grads(model, gpt2_loss, batch), 1e-10,
            ("ghost", "instantiate"), MODES)


def test_llama_lora_with_trained_norm_weights_equals_the_single_example_loop():
    model = _tiny_llama(tied=False)
    apply_finetuning(model, LoRAConfig(r=2, alpha=4,
                                       target_modules=["q_proj", "v_proj", "down_proj"]),
                     [r"norm\.weight$"])  # and the RMSNorms' weights (their ghost rule)
    _randomise_b(model)
    batch = gpt2_batch()
    # transformers' RMSNorm normalises in float32: the float64 path carries its rounding
    compare(model, gpt2_loss, batch, loop_grads(model, gpt2_loss, batch), 1e-6,
            ("ghost", "instantiate"), MODES)


@pytest.mark.parametrize("trainable", [None, [r"^head\.", "cls_token", "pos_embed"]],
                         ids=["adapters", "adapters+head+tapped_tokens"])
def test_vit_lora_norms_equal_the_reference(trainable):
    """timm's ViT with adapters on the attention and MLP matrices; its class token and position
    table (tapped parameters of the engine) frozen, or trained beside the adapters."""
    import timm
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=16,
                              patch_size=8, num_classes=3, depth=2).double()
    apply_finetuning(model, LoRAConfig(r=2, target_modules=["qkv", "fc1", "attn.proj"]),
                     trainable)
    _randomise_b(model)
    gen = torch.Generator().manual_seed(2)
    batch = (torch.randn(4, 3, 16, 16, generator=gen, dtype=torch.float64),
             torch.tensor([0, 1, 2, 1]))
    check(model, batch, loss_fn=lambda m, b: F.cross_entropy(m(b[0]), b[1], reduction="none"))


def test_inner_momentum_query_over_the_adapters():
    """u_b = 0.7 g_b(theta1) + 0.3 g_b(theta0), theta1 differing in the trainable tensors only
    (the history holds nothing else)."""
    model = tiny_gpt2(torch.float64)
    apply_finetuning(model, LoRAConfig(r=2, target_modules=["c_attn", "c_fc"]), ["ln_f"])
    _randomise_b(model)
    gen = torch.Generator().manual_seed(4)
    theta1 = {n: p.detach() + 0.05 * torch.randn(p.shape, generator=gen, dtype=p.dtype)
              for n, p in model.named_parameters() if p.requires_grad}
    batch = gpt2_batch()
    ref = 0.7 * reference_grads(model, gpt2_loss, batch, theta1) \
        + 0.3 * reference_grads(model, gpt2_loss, batch)
    check(model, batch, loss_fn=gpt2_loss, plan=[(0.7, theta1), (0.3, None)], ref=ref)


# ---------------------------------------------------------------------------------------------
# the merged model


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_merged_state_is_peft_s_merge_and_computes_the_adapted_logits(kind):
    from peft import LoraConfig, get_peft_model

    base = tiny_gpt2(torch.float64) if kind == "gpt2" else _tiny_llama(tied=True)
    targets = ["c_attn", "c_proj"] if kind == "gpt2" else ["q_proj", "o_proj", "up_proj"]
    plain = {k: v.clone() for k, v in base.state_dict().items()}
    apply_finetuning(base, LoRAConfig(r=2, alpha=6, target_modules=targets), None)
    _randomise_b(base, seed=7)
    ids = gpt2_batch()[0]
    base.eval()
    with torch.no_grad():
        want = base(input_ids=ids).logits
    merged = merged_state(base.state_dict(), base)
    assert merged.keys() == plain.keys()  # the original architecture's names
    fresh = tiny_gpt2(torch.float64) if kind == "gpt2" else _tiny_llama(tied=True)
    fresh.load_state_dict(merged)
    fresh.eval()
    with torch.no_grad():
        torch.testing.assert_close(fresh(input_ids=ids).logits, want, rtol=1e-10, atol=1e-10)
    # peft's own merge of the same adapters
    ref = tiny_gpt2(torch.float64) if kind == "gpt2" else _tiny_llama(tied=True)
    peft_model = get_peft_model(ref, LoraConfig(r=2, lora_alpha=6, target_modules=targets,
                                                fan_in_fan_out=kind == "gpt2"))
    adapters = {k: v for k, v in base.state_dict().items() if "lora_" in k}
    peft_model.base_model.model.load_state_dict(adapters, strict=False)
    ref_sd = peft_model.merge_and_unload().state_dict()
    for k, v in merged.items():
        torch.testing.assert_close(v, ref_sd[k], rtol=1e-12, atol=1e-12, msg=k)
    changed = [k for k in merged if not torch.equal(merged[k], plain[k])]
    assert changed and all(k.endswith(".weight") and any(t in k for t in targets)
                           for k in changed)


# ---------------------------------------------------------------------------------------------
# runs


def _pretrained_gpt2(folder: Path, seed: int = 3) -> Path:
    """A tiny GPT-2 checkpoint for configs/tiny.yaml's data (32 symbols and EOS)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=32, vocab_size=33,
                               bos_token_id=32, eos_token_id=32)).save_pretrained(folder)
    return folder


def _reloaded(final, base_dir):
    """A run's final/hf, and the base model with final/adapter, as transformers and peft load
    them (eval mode), and token ids to compare their logits on."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(final / "hf", local_files_only=True).eval()
    peft_model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base_dir, local_files_only=True),
        final / "adapter").eval()
    return hf, peft_model, torch.randint(0, 32, (2, 12),
                                         generator=torch.Generator().manual_seed(0))


def test_a_lora_run_trains_the_adapters_only_and_writes_merged_and_adapter_models(tmp_path):
    from safetensors.torch import load_file

    from dptrain.trainer import RunConfig, Trainer

    base_dir = _pretrained_gpt2(tmp_path / "base")
    cfg = load(RunConfig, TINY, ["train.progress=false", "train.checkpoint_every=0",
                                 "privacy.steps=3", f"model.pretrained_path={base_dir}",
                                 "model.lora.r=4", "model.lora.alpha=8"])
    t = Trainer(cfg, tmp_path / "run")
    before = {k: v.clone() for k, v in t.model.state_dict().items()}
    summary = t.run()
    after = t.model.state_dict()
    moved = {k for k in after if not torch.equal(after[k], before[k])}
    # noise reaches every trainable coordinate, and nothing else
    assert moved == {k for k in after if ".lora_" in k} and len(moved) == 4
    assert summary["epsilon"] <= 8.0

    final = tmp_path / "run" / "final"
    exported = load_file(final / "model.safetensors")
    assert not any("lora" in k or "base_layer" in k for k in exported)
    hf, peft_model, ids = _reloaded(final, base_dir)
    t.model.eval()
    with torch.no_grad():
        want = t.model(input_ids=ids).logits
        torch.testing.assert_close(hf(input_ids=ids).logits, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(peft_model(input_ids=ids).logits, want, rtol=1e-5, atol=1e-5)
    config = json.loads((final / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["base_model_name_or_path"] == str(base_dir.absolute())


def test_with_ema_the_adapter_is_the_average_like_the_merged_and_hf_models(tmp_path):
    # on CPU the EMA's state dict held the parameters themselves, set back to the last iterate
    # when the average was swapped out, before final/adapter was written from it
    from safetensors.torch import load_file

    from dptrain.trainer import RunConfig, Trainer

    base_dir = _pretrained_gpt2(tmp_path / "base")
    cfg = load(RunConfig, TINY, ["train.progress=false", "train.checkpoint_every=0",
                                 "privacy.steps=3", f"model.pretrained_path={base_dir}",
                                 "model.lora.r=4", "model.lora.alpha=8", "optim.ema_decay=0.5"])
    t = Trainer(cfg, tmp_path / "run")
    t.run()
    final = tmp_path / "run" / "final"
    hf, peft_model, ids = _reloaded(final, base_dir)
    t.model.eval()
    with torch.no_grad():
        average = hf(input_ids=ids).logits
        last = t.model(input_ids=ids).logits  # the last iterate, left in the model
        assert (average - last).abs().max() > 1e-4  # the two differ: the check can fail
        torch.testing.assert_close(peft_model(input_ids=ids).logits, average, rtol=1e-5,
                                   atol=1e-5)
    with t.optimizer.ema.swapped_in():
        for k, v in load_file(final / "adapter" / "adapter_model.safetensors").items():
            name = k.replace("base_model.model.", "").replace(".weight", ".default.weight")
            assert torch.equal(v, t.model.state_dict()[name]), k


def test_a_run_with_trainable_parameters_beside_the_adapters_writes_no_adapter(tmp_path):
    from dptrain.trainer import RunConfig, Trainer

    cfg = load(RunConfig, TINY, ["train.progress=false", "train.checkpoint_every=0",
                                 "privacy.steps=2", "model.lora.r=2", "model.trainable=[ln_f]"])
    t = Trainer(cfg, tmp_path / "run")
    before = {k: v.clone() for k, v in t.model.state_dict().items()}
    t.run()
    after = t.model.state_dict()
    assert {k for k in after if not torch.equal(after[k], before[k])} == {
        k for k in after if ".lora_" in k or "ln_f" in k}
    assert (tmp_path / "run" / "final" / "model.safetensors").exists()
    assert not (tmp_path / "run" / "final" / "adapter").exists()


def test_cli_refuses_a_trainable_regex_that_matches_nothing_with_exit_2(tmp_path, capsys):
    from dptrain.cli import main

    code = main(["train", "--config", TINY, "--output-dir", str(tmp_path / "run"),
                 "train.progress=false", "model.trainable=[no_such_parameter]"])
    assert code == 2
    err = capsys.readouterr().err
    assert "model.trainable[0]" in err and "matches no parameter" in err
    assert not (tmp_path / "run" / "summary.json").exists()


def test_a_checkpoint_written_before_the_fields_existed_resumes():
    from dptrain.checkpoint import check_compatible
    from dptrain.config import to_dict
    from dptrain.trainer import RunConfig

    cfg = load(RunConfig, TINY, [])
    saved = to_dict(cfg)
    saved["model"] = {k: v for k, v in saved["model"].items() if k not in ("lora", "trainable")}
    assert check_compatible(saved, cfg) == []
    lora = load(RunConfig, TINY, ["model.lora.r=2"])
    with pytest.raises(ConfigError) as e:
        check_compatible(saved, lora)
    assert e.value.field == "model.lora"


def test_a_checkpoint_leaves_the_frozen_base_out_and_refuses_another_base(tmp_path, capsys):
    """A LoRA run's checkpoint holds the trained tensors (and buffers) and the frozen ones'
    digest; a resume onto a changed base checkpoint exits 2 naming model.pretrained_path, and
    resumes once the base is back."""
    from dptrain import checkpoint as ckpt
    from dptrain.cli import main
    from dptrain.trainer import RunConfig, Trainer

    base_dir = _pretrained_gpt2(tmp_path / "base")
    overrides = ["train.progress=false", "privacy.steps=3", f"model.pretrained_path={base_dir}",
                 "model.lora.r=2"]
    t = Trainer(load(RunConfig, TINY, overrides), tmp_path / "run")
    t.private_step()
    t.private_step()
    ckpt.save(t, tmp_path / "run")  # as a preempted run leaves it
    state = ckpt.read(ckpt.find_latest(tmp_path / "run"))
    params = {n for n, _ in t.model.named_parameters(remove_duplicate=False)}
    assert {k for k in state["model"] if k in params} == {n for n, _ in t.named_params}
    assert "transformer.h.0.attn.c_attn.base_layer.weight" in state["frozen"]["keys"]
    assert state["frozen"] == ckpt.frozen_state(t.model)

    args = ["train", "--config", TINY, "--output-dir", str(tmp_path / "run"), "--resume",
            "auto", *overrides]
    original = (base_dir / "model.safetensors").read_bytes()
    _pretrained_gpt2(base_dir, seed=4)  # another base model in the same folder
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "model.pretrained_path" in err and "frozen parameters differ" in err
    (base_dir / "model.safetensors").write_bytes(original)
    assert main(args) == 0
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 3


def test_the_frozen_digest_is_the_same_in_float32_and_float64_and_sees_one_changed_value():
    from dptrain.checkpoint import frozen_state

    model = tiny_gpt2(torch.float32)
    apply_finetuning(model, LoRAConfig(r=2), None)
    digest = frozen_state(model)
    assert frozen_state(model.double()) == digest  # a float64 run of the same weights
    with torch.no_grad():
        model.transformer.h[1].mlp.c_fc.weight[3, 5] += 1e-12  # not a float32 value now
    changed = frozen_state(model)
    assert changed["keys"] == digest["keys"] and changed["sha256"] != digest["sha256"]
    full = tiny_gpt2(torch.float32)
    assert frozen_state(full) is None  # nothing frozen: the checkpoint holds everything



def test_the_adapter_config_lists_its_targets_sorted(tmp_path):
    """peft keeps target_modules as a set: its order in adapter_config.json followed each
    process's string hashing (PYTHONHASHSEED), so two runs of one config wrote different
    bytes. Sorted now (with 7 targets the old order was sorted in 1 process of 5,040)."""
    from dptrain.models.finetune import write_adapter

    model = _tiny_llama(False, torch.float32)
    names = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    lora = LoRAConfig(r=2, target_modules=names)
    apply_finetuning(model, lora, None)
    assert write_adapter(model.state_dict(), model, lora, tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["target_modules"] == sorted(names) and config["r"] == 2
    assert config["base_model_name_or_path"] is None  # no model.pretrained_path
    assert write_adapter(model.state_dict(), model, lora, tmp_path / "adapter", "~/llama")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(Path.home() / "llama")
    # what a write killed before its rename left (another pid) goes; another folder's stays
    for stale in (".tmp-adapter-1", ".tmp-adapter-99999", ".tmp-adapters-1"):
        (tmp_path / stale).mkdir()
        (tmp_path / stale / "adapter_model.safetensors").write_bytes(b"x" * 64)
    assert write_adapter(model.state_dict(), model, lora, tmp_path / "adapter")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp-adapters-1", "adapter"]


def test_a_lora_rank_above_a_target_s_smaller_dimension_is_noted(capsys):
    model = _tiny_llama(False, torch.float32)
    apply_finetuning(model, LoRAConfig(r=2, target_modules=["q_proj"]), None)
    assert "model.lora.r" not in capsys.readouterr().err
    model = _tiny_llama(False, torch.float32)
    shapes = {n: min(m.weight.shape) for n, m in model.named_modules()
              if n.endswith(("q_proj", "k_proj"))}
    apply_finetuning(model, LoRAConfig(r=1000, target_modules=["q_proj", "k_proj"]), None)
    err = capsys.readouterr().err
    first, rank = next(iter(shapes.items()))
    assert err.startswith(f"dptrain: note: model.lora.r = 1000 exceeds the rank of {first} "
                          f"({rank}) (and {len(shapes) - 1} more target layer(s)): its adapter's "
                          f"update has rank at most {rank}")
    assert err.count("\n") == 1
