"""``model.name: causal_lm`` (transformers' decoder-only LMs: Llama, Qwen2, Mistral): building
from hf_config and from a checkpoint, every refusal naming its field, exact per-example norms
with the chosen attention, right padding, and per-example dropout masks in Llama's module-less
attention dropout. The hf tokenizer: tests/test_hf_tokenizer.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from _causal_lm import E2E_DIR, FAMILIES, TINY_LLAMA, save_pretrained_llama
from _threads import _one_thread  # noqa: F401  (autouse: one torch thread)
from torch import nn

from dptrain.config import ConfigError, from_dict, load, validate_tree
from dptrain.data import DataInfo
from dptrain.data.lm import lm_loss
from dptrain.data.tokenizers import build_tokenizer
from dptrain.models import ModelConfig, build_model
from dptrain.models.dropout import ExampleDropout, example_dropout, has_dropout

LM = DataInfo(kind="lm", vocab_size=257, pad_id=256, eos_id=256, max_length=40)


def causal_cfg(family: str = "llama", hf: dict | None = None, **kw) -> ModelConfig:
    """A validated ModelConfig of a tiny ``family`` model; ``hf`` overrides hf_config keys."""
    data = {"name": "causal_lm", "hf_config": {**FAMILIES[family], **(hf or {})}, **kw}
    if kw.get("pretrained_path"):
        data["hf_config"] = {}
    cfg = from_dict(ModelConfig, data, "model")
    validate_tree(cfg, "model")
    return cfg


def test_families_are_built_from_hf_config_with_dptrain_s_fields_applied():
    torch.manual_seed(0)
    tied = build_model(causal_cfg(), LM)
    assert type(tied).__name__ == "LlamaForCausalLM"
    assert tied.lm_head.weight is tied.model.embed_tokens.weight  # model.tie_embeddings (true)
    c = tied.config
    assert (c.vocab_size, c.eos_token_id, c.pad_token_id) == (257, 256, 256)  # the data's
    assert c._attn_implementation == "sdpa" and c.attention_dropout == 0.0
    assert tied.model.layers[0].self_attn.k_proj.weight.shape == (16, 32)  # 2 kv heads of 8
    assert not has_dropout(tied)
    untied = build_model(causal_cfg(tie_embeddings=False, dropout=0.1, vocab_size=300), LM)
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight
    assert untied.config.vocab_size == 300
    # dropout: Llama's attention dropout (a call in its forward, no nn.Dropout module), and the
    # eager attention, whose F.dropout dptrain's per-example masks replace
    assert untied.config.attention_dropout == 0.1
    assert untied.config._attn_implementation == "eager"
    assert not any(isinstance(m, nn.Dropout) for m in untied.modules())
    assert has_dropout(untied)
    qwen = build_model(causal_cfg("qwen2", tie_embeddings=False), LM)
    assert type(qwen).__name__ == "Qwen2ForCausalLM"
    assert qwen.model.layers[1].self_attn.q_proj.bias is not None  # Qwen2's q/k/v biases
    mistral = build_model(causal_cfg("mistral"), LM)
    ids = torch.randint(0, 257, (3, 11))
    assert mistral(input_ids=ids).logits.shape == (3, 11, 257)


def test_hf_config_s_own_special_tokens_win_over_the_data_s():
    """The data's EOS, pad and BOS ids fill the token ids hf_config leaves unset; one it sets is
    kept (it is what the exported config.json says to generation)."""
    info = DataInfo(kind="lm", vocab_size=257, pad_id=256, eos_id=256, bos_id=255, max_length=40)
    c = build_model(causal_cfg(hf={"eos_token_id": 3, "bos_token_id": 4}), info).config
    assert (c.eos_token_id, c.bos_token_id, c.pad_token_id) == (3, 4, 256)
    c = build_model(causal_cfg(), info).config
    assert (c.eos_token_id, c.bos_token_id, c.pad_token_id) == (256, 255, 256)


def test_a_causal_lm_s_positions_may_equal_the_longest_example():
    model = build_model(causal_cfg(hf={"max_position_embeddings": 40}), LM)  # LM.max_length
    assert model.config.max_position_embeddings == 40
    with pytest.raises(ConfigError) as e:
        build_model(causal_cfg(hf={"max_position_embeddings": 39}), LM)
    assert e.value.field == "model.hf_config.max_position_embeddings" and "39" in e.value.message


def _right_padded_batch(lengths, vocab=257, pad=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), pad)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    labels = torch.full((len(lengths), width), -100)
    for r, n in enumerate(lengths):
        ids[r, :n] = torch.randint(0, vocab - 1, (n,), generator=g)
        mask[r, :n] = 1
        labels[r, 2:n] = ids[r, 2:n]  # a 2-token prompt
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _grad(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad])


@pytest.mark.parametrize("family, tie, dropout", [
    ("llama", True, 0.0), ("llama", False, 0.0), ("qwen2", False, 0.0), ("llama", False, 0.2)],
    ids=["llama_tied_sdpa", "llama_untied_sdpa", "qwen2_sdpa", "llama_dropout_eager"])
def test_each_example_s_loss_gradient_and_norm_equal_the_example_alone_right_padded(
        family, tie, dropout):
    """With the attention dptrain chooses (sdpa; eager with dropout, under the per-example
    masks): the clipping engine's norms, and each example's loss and gradient taken from the
    right-padded batch, equal the example's own computed alone, unpadded (lm_loss passes no
    position_ids: the real tokens sit at 0..n-1 and causal attention never reads the padding)."""
    from dptrain.clipping import per_example_grad_norms

    torch.manual_seed(1)
    model = build_model(causal_cfg(family, tie_embeddings=tie, dropout=dropout), LM).train()
    lengths, indices = [9, 5, 7, 3], [10, 11, 12, 13]
    batch = _right_padded_batch(lengths)

    def masks(rows):  # a fresh mode per forward: its masks restart (the trainer's form)
        return example_dropout(model, seed=4, step=2, indices=rows)

    with masks(indices):
        norms = per_example_grad_norms(model, lm_loss, batch)
    with masks(indices):
        losses = lm_loss(model, batch)
    alone_norms = []
    for i, n in enumerate(lengths):
        model.zero_grad()
        with masks(indices):  # example i's gradient from the batch's loss
            lm_loss(model, batch)[i].backward()
        in_batch = _grad(model)
        model.zero_grad()
        one = {k: v[i:i + 1, :n] for k, v in batch.items()}
        with masks([indices[i]]):
            loss = lm_loss(model, one)
            loss.sum().backward()
        assert torch.allclose(losses[i], loss[0], rtol=1e-5, atol=1e-6), i
        assert torch.allclose(in_batch, _grad(model), rtol=1e-4, atol=1e-6), i
        alone_norms.append(_grad(model).norm())
    assert torch.allclose(norms, torch.stack(alone_norms), rtol=1e-4)
    assert len({round(float(x), 3) for x in norms}) == 4  # distinct examples, not a constant


def test_llama_attention_dropout_gets_counter_based_per_example_masks():
    """Llama's attention dropout is ``F.dropout(p=config.attention_dropout)`` in its forward,
    with no nn.Dropout module: within the trainer's mode it takes dptrain's masks, so an example
    gets the same masks alone or in any microbatch, and another step other masks."""
    torch.manual_seed(0)
    model = build_model(causal_cfg(dropout=0.5), LM).train()
    with torch.no_grad():  # larger attention logits: dropping attention weights shows
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0.0, 0.3)
    x = torch.randint(0, 256, (4, 8))

    def run(step, indices, rows):
        with ExampleDropout(seed=1, step=step, indices=indices), torch.no_grad():
            return model(input_ids=x[rows]).logits

    a = run(3, [5, 6, 7, 8], [0, 1, 2, 3])
    assert torch.allclose(run(3, [7], [2])[0], a[2], atol=1e-5)
    assert torch.allclose(run(3, [8, 5], [3, 0]), a[[3, 0]], atol=1e-5)
    assert not torch.allclose(run(4, [5, 6, 7, 8], [0, 1, 2, 3]), a, atol=1e-3)
    model.eval()  # the masks act: without dropout the logits differ
    with torch.no_grad():
        assert not torch.allclose(model(input_ids=x).logits, a, atol=1e-3)


def test_a_causal_lm_run_with_dropout_does_not_depend_on_the_microbatch_size():
    from dptrain.trainer import RunConfig, Trainer

    def params(mb: int, dropout: float = 0.2) -> dict:
        t = Trainer(load(RunConfig, TINY_LLAMA, [
            "train.progress=false", "train.checkpoint_every=0", "privacy.steps=2",
            f"model.dropout={dropout}", f"performance.microbatch_size={mb}"]))
        while t.step < t.plan.steps:
            t.private_step()
        return {n: p.detach().clone() for n, p in t.model.named_parameters()}

    a, b = params(16), params(5)
    for n in a:
        assert torch.allclose(a[n], b[n], rtol=1e-5, atol=1e-7), n
    c = params(16, dropout=0.0)  # and dropout is on: without it the run differs
    assert not all(torch.allclose(c[n], a[n], rtol=1e-3) for n in a)


def _others_moved_by_a_longer_example(t) -> float:
    """||the clipped sum of the 8 shortest examples, alone - with the longest in their
    microbatch at clip factor 0 (it adds nothing itself; only the padded length changes)|| / C."""
    data = t.task.train
    short = np.argsort(data.lengths, kind="stable")[:8]
    longest = int(np.argmax(data.lengths))
    assert data.lengths[longest] > data.lengths[short].max()

    def clipped(idx, active=None):
        acc: dict = {}
        with t._autocast():
            t.engine.accumulate(t.task.loss_fn, data.collate(idx), acc, None, active)
        return acc

    alone = clipped(short)
    active = torch.ones(9, dtype=torch.bool)
    active[-1] = False
    joined = clipped(np.concatenate([short, [longest]]), active)
    return float(sum((alone[n].double() - joined[n].double()).square().sum()
                     for n in alone)) ** 0.5 / t.plan.clip_norm


@pytest.mark.parametrize("overrides", [[], ["performance.dtype=bfloat16"]])
def test_an_example_s_padded_length_leaves_the_others_clipped_sum_in_bfloat16_too(overrides):
    # every example clipped (C tiny), so each of the 8 adds exactly C: a longer example in
    # their microbatch must not move their sum by more than float32 rounding, or one example
    # moves the release by more than C. sdpa in bfloat16 moved it by 5.5e-3 C (against 4e-7
    # in float32): the trainer builds eager attention in bfloat16 (models._attention)
    from dptrain.trainer import RunConfig, Trainer

    t = Trainer(load(RunConfig, TINY_LLAMA, ["train.progress=false", "train.checkpoint_every=0",
                                             "privacy.clip_norm=1e-4", *overrides]))
    assert t.model.config._attn_implementation == ("eager" if overrides else "sdpa")
    assert _others_moved_by_a_longer_example(t) < 1e-5


@pytest.mark.parametrize("hf, kw, field, words", [
    ({"vocab_size": 300}, {}, "model.hf_config.vocab_size", "model.vocab_size"),
    ({"tie_word_embeddings": True}, {}, "model.hf_config.tie_word_embeddings",
     "model.tie_embeddings"),
    ({"attention_dropout": 0.1}, {}, "model.hf_config.attention_dropout", "model.dropout"),
    ({"attn_implementation": "eager"}, {}, "model.hf_config.attn_implementation", "sdpa"),
    ({"hidden_sizes": 64}, {}, "model.hf_config.hidden_sizes", "not a setting of LlamaConfig"),
    ({"hidden_size": "wide"}, {}, "model.hf_config.hidden_size", "must be an integer >= 1"),
    # a message naming two keys in words names both; a KeyError of a value names its key
    ({"num_attention_heads": 3}, {}, "model.hf_config",
     "LlamaConfig refused it (hidden_size = 32, num_attention_heads = 3): "),
    ({"hidden_act": "foo"}, {}, "model.hf_config.hidden_act",
     "'foo': transformers cannot build it: KeyError: 'foo'"),
    ({"num_key_value_heads": 3}, {}, "model.hf_config.num_key_value_heads",
     "must divide num_attention_heads (4)"),
    ({"model_type": "bert"}, {}, "model.hf_config.model_type", "not a decoder-only"),
    ({"model_type": "bart"}, {}, "model.hf_config.model_type", "not a decoder-only"),
    ({"model_type": "gemma3"}, {}, "model.hf_config.model_type", "vision_config"),
    ({"model_type": "no_such_model"}, {}, "model.hf_config.model_type", "unknown"),
    ({"model_type": None}, {}, "model.hf_config.model_type", "required"),
    ({"max_position_embeddings": 16}, {}, "model.hf_config.max_position_embeddings", "40"),
    ({}, {"vocab_size": 100}, "model.vocab_size", "smaller"),
    ({}, {"n_layer": 4}, "model.n_layer", "model.name gpt2"),
    ({"model_type": "mamba", "hidden_size": 16, "num_hidden_layers": 1}, {"dropout": 0.1},
     "model.dropout", "no dropout setting"),
])
def test_causal_lm_mistakes_name_their_field(hf, kw, field, words):
    base = {} if hf.get("model_type") == "mamba" else dict(FAMILIES["llama"])
    hf_config = {k: v for k, v in {**base, **hf}.items() if v is not None}
    with pytest.raises(ConfigError) as e:
        cfg = from_dict(ModelConfig, {"name": "causal_lm", "hf_config": hf_config, **kw},
                        "model")
        validate_tree(cfg, "model")
        build_model(cfg, LM)
    assert e.value.field == field
    assert words in e.value.message and "\n" not in e.value.message, e.value.message


def test_without_hf_config_or_checkpoint_the_checkpoint_is_asked_for_and_gpt2_refuses_it():
    for data, field in (({"name": "causal_lm"}, "model.pretrained_path"),
                        ({"name": "gpt2", "hf_config": {"model_type": "llama"}},
                         "model.hf_config"),
                        ({"name": "causal_lm", "hf_config": {"model_type": "llama"}},
                         "model.hf_config.max_position_embeddings")):
        with pytest.raises(ConfigError) as e:
            cfg = from_dict(ModelConfig, data, "model")
            validate_tree(cfg, "model")
            build_model(cfg, DataInfo(kind="lm", vocab_size=9, pad_id=8, eos_id=8,
                                      max_length=4096))
        assert e.value.field == field, data
    with pytest.raises(ConfigError) as e:
        build_model(causal_cfg(), DataInfo(kind="classification", num_classes=3, in_chans=1,
                                           image_size=8))
    assert e.value.field == "model.name"


def test_a_causal_lm_with_batchnorm_is_refused(monkeypatch):
    import transformers

    real = transformers.AutoModelForCausalLM.from_config

    def with_batchnorm(config, **kw):
        model = real(config, **kw)
        model.model.layers[0].bn = nn.BatchNorm1d(4)
        return model

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_config", with_batchnorm)
    with pytest.raises(ConfigError) as e:
        build_model(causal_cfg(), LM)
    assert e.value.field == "model.hf_config" and "model.layers.0.bn" in e.value.message


@pytest.mark.parametrize("override, field", [
    ("model.hf_config.hidden_sizes=64", "model.hf_config.hidden_sizes"),
    ("model.hf_config.model_type=bert", "model.hf_config.model_type"),
    ("model.hf_config.vocab_size=64", "model.hf_config.vocab_size"),
    ("model.hf_config.num_key_value_heads=3", "model.hf_config"),  # when the model is built
    ("model.hf_config.num_key_value_heads=0", "model.hf_config.num_key_value_heads"),
    # each trained on NaN, with exit 0; the last named optim.preset
    ("model.hf_config.rope_theta=-1", "model.hf_config.rope_theta"),
    ("model.hf_config.rms_norm_eps=.nan", "model.hf_config.rms_norm_eps"),
    ("model.hf_config.rms_norm_eps=0", "model.hf_config.rms_norm_eps"),
    ("model.hf_config.initializer_range=.inf", "model.hf_config.initializer_range"),
    ("model.hf_config.rope_scaling={rope_type: linear, factor: .nan}",
     "model.hf_config.rope_scaling.factor"),
    ("model.hf_config.num_hidden_layers=0", "model.hf_config.num_hidden_layers"),
    ("model.hf_config.hidden_size=2.5", "model.hf_config.hidden_size"),
    ("model.hf_config.max_position_embeddings=8", "model.hf_config.max_position_embeddings"),
    ("model.hf_config=[1]", "model.hf_config"),
    ("model.n_head=4", "model.n_head"),
])
def test_causal_lm_config_errors_exit_2_with_one_line(tmp_path, capsys, override, field):
    from dptrain.cli import main

    code = main(["train", "--config", TINY_LLAMA, "--output-dir", str(tmp_path / "out"),
                 override])
    lines = [line for line in capsys.readouterr().err.strip().splitlines() if line]
    assert code == 2 and len(lines) == 1 and field in lines[0], lines
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------ pretrained checkpoints

@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    """A tiny Llama checkpoint (untied head, bf16 on disk) with its Llama-style tokenizer."""
    import transformers

    if not (E2E_DIR / "devset.csv").is_file():
        pytest.skip("shared E2E data not present")
    folder = save_pretrained_llama(tmp_path_factory.mktemp("llama") / "ckpt")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True)
    model.to(torch.bfloat16).save_pretrained(str(folder))
    return folder


def _info(folder: Path, max_length: int = 40) -> DataInfo:
    tok = build_tokenizer("hf", str(folder))
    return DataInfo(kind="lm", vocab_size=tok.vocab_size, pad_id=tok.pad_id, eos_id=tok.eos_id,
                    bos_id=tok.bos_id, max_length=max_length)


def test_pretrained_causal_lm_loads_every_tensor_in_float32_with_model_dropout(llama_folder):
    from safetensors.torch import load_file

    saved = load_file(str(llama_folder / "model.safetensors"))
    model = build_model(causal_cfg(pretrained_path=str(llama_folder), tie_embeddings=False,
                                   dropout=0.1), _info(llama_folder))
    assert type(model).__name__ == "LlamaForCausalLM"
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert model.config.attention_dropout == 0.1 and model.config._attn_implementation == "eager"
    state = model.state_dict()
    assert saved.keys() == state.keys()
    for k, v in saved.items():
        assert v.dtype == torch.bfloat16 and torch.equal(v.float(), state[k]), k
    plain = build_model(causal_cfg(pretrained_path=str(llama_folder), tie_embeddings=False),
                        _info(llama_folder))
    assert plain.config._attn_implementation == "sdpa" and plain.config.attention_dropout == 0.0


def test_a_checkpoint_whose_own_tokenizer_has_tokens_beyond_its_embeddings_is_not_told_to_use_it(
        tmp_path):
    # the data already used the checkpoint's own tokenizer (data.tokenizer_path is its folder),
    # which has a token added after saving (a pad token, the embeddings not resized): the
    # refusal told to "tokenize with the checkpoint's own tokenizer", what the run already did
    from transformers import AutoTokenizer

    from dptrain.data import DataConfig, build_data

    if not (E2E_DIR / "devset.csv").is_file():
        pytest.skip("shared E2E data not present")
    folder = save_pretrained_llama(tmp_path / "ckpt")
    tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    tok.add_special_tokens({"pad_token": "<pad>"})
    tok.save_pretrained(str(folder))
    info = build_data(DataConfig(name="e2e", tokenizer="hf", tokenizer_path=str(folder),
                                 max_train_examples=4, max_test_examples=4)).info
    with pytest.raises(ConfigError) as e:
        build_model(causal_cfg(pretrained_path=str(folder), tie_embeddings=False), info)
    assert e.value.field == "model.pretrained_path", e.value
    assert "own tokenizer (data.tokenizer: hf" not in e.value.message, e.value
    assert "the data's tokenizer is the checkpoint's own (data.tokenizer_path), with 1 token " \
           "more than its embeddings" in e.value.message, e.value


def test_pretrained_causal_lm_refusals_name_their_field(llama_folder, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import BertConfig, BertForMaskedLM

    def variant(name, config=None, weights=None):
        d = tmp_path / name
        shutil.copytree(llama_folder, d)
        if config is not None:
            (d / "config.json").write_text(json.dumps(config))
        if isinstance(weights, bytes):
            (d / "model.safetensors").write_bytes(weights)
        elif weights is not None:
            save_file(weights, str(d / "model.safetensors"), metadata={"format": "pt"})
        return d

    tensors = load_file(str(llama_folder / "model.safetensors"))
    wider = {**json.loads((llama_folder / "config.json").read_text()), "intermediate_size": 96}
    bert = tmp_path / "bert"
    BertForMaskedLM(BertConfig(vocab_size=400, hidden_size=32, num_hidden_layers=1,
                               num_attention_heads=2, intermediate_size=64)).save_pretrained(bert)
    info = _info(llama_folder)
    untied = {"tie_embeddings": False}
    cases = [
        (variant("missing", weights={k: v for k, v in tensors.items() if ".layers.1." not in k}),
         untied, info, "model.pretrained_path", "lacks"),
        (variant("shape", config=wider), untied, info, "model.pretrained_path",
         "other shapes for 6 of the model's tensors"),
        (variant("corrupt", weights=b"garbage" * 10), untied, info, "model.pretrained_path",
         "cannot load"),
        (bert, untied, info, "model.pretrained_path", "not a decoder-only"),
        (llama_folder, {}, info, "model.tie_embeddings", "tie_word_embeddings=False"),
        (llama_folder, {**untied, "vocab_size": 500}, info, "model.vocab_size", "vocab_size=400"),
        (llama_folder, untied, DataInfo(kind="lm", vocab_size=401, pad_id=2, eos_id=2,
                                        max_length=40, vocab_from="data.tokenizer: hf"),
         "model.pretrained_path", "401 (data.tokenizer: hf): tokenize with the checkpoint's"),
        (llama_folder, untied, _info(llama_folder, max_length=300), "data.max_length", "256"),
    ]
    for folder, kw, data_info, field, words in cases:
        with pytest.raises(ConfigError) as e:
            build_model(causal_cfg(pretrained_path=str(folder), **kw), data_info)
        assert e.value.field == field, (folder, kw)
        assert words in e.value.message and "\n" not in e.value.message, e.value.message
    (tmp_path / "empty").mkdir()
    (tmp_path / "weights.safetensors").write_bytes((llama_folder / "model.safetensors")
                                                   .read_bytes())
    for data, field, words in (
            ({"hf_config": {"model_type": "llama"}}, "model.hf_config", "hf_config"),
            ({"pretrained_path": str(tmp_path / "none")}, "model.pretrained_path", "not found"),
            # (a file or an empty folder: "directory not found", or transformers' words on a
            # missing model_type)
            ({"pretrained_path": str(tmp_path / "weights.safetensors")}, "model.pretrained_path",
             "is a file, not a folder"),
            ({"pretrained_path": str(tmp_path / "empty")}, "model.pretrained_path",
             "holds no config.json")):
        with pytest.raises(ConfigError) as e:
            validate_tree(from_dict(ModelConfig, {"name": "causal_lm", "pretrained_path":
                                                  str(llama_folder), **data}, "model"), "model")
        assert e.value.field == field and words in e.value.message, e.value.message


def test_a_partial_checkpoint_exits_2_with_one_line_and_no_loading_report(llama_folder,
                                                                        tmp_path, capsys):
    """transformers prints a progress bar and a table of the missing tensors while loading;
    the refusal is the one line naming model.pretrained_path."""
    import shutil

    from safetensors.torch import load_file, save_file

    from dptrain.cli import main

    partial = tmp_path / "partial"
    shutil.copytree(llama_folder, partial)
    tensors = load_file(str(partial / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if "layers.1.mlp" not in k},
              str(partial / "model.safetensors"), metadata={"format": "pt"})
    code = main(["train", "--config", TINY_LLAMA, "--output-dir", str(tmp_path / "out"),
                 "model.hf_config={}", f"model.pretrained_path={partial}",
                 "model.tie_embeddings=false"])
    lines = [line for line in capsys.readouterr().err.strip().splitlines() if line]
    assert code == 2 and len(lines) == 1, lines
    assert "model.pretrained_path" in lines[0] and "lacks 3" in lines[0]
