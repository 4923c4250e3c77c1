"""Every shipped config loads and validates; those whose data is here build a Trainer.

GPT-2-small configs are not built (slow on CPU): they are loaded and validated, and their data
(when present) is checked through ``build_data``. DART is not on these machines: its configs
must fail with a ConfigError naming ``data.path``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import yaml

from dptrain.config import ConfigError, from_dict, load, validate_tree
from dptrain.data import build_data
from dptrain.trainer import RunConfig, Trainer

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))
BIG = 10_000_000  # parameters above which the test does not build the model
#: configs whose files the user names (a pretrained checkpoint and its tokenizer): without them
#: they are refused at load, naming these fields in turn; here they get a tiny Llama's folder
USER_PATHS = {name: ("model.pretrained_path", "data.tokenizer_path")
              for name in ("e2e_llama.yaml", "e2e_lora_llama.yaml")}


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    """A tiny pretrained Llama with its tokenizer, as a user would download one."""
    from _causal_lm import E2E_DIR, save_pretrained_llama

    if not (E2E_DIR / "devset.csv").is_file():
        pytest.skip("shared E2E data not present")
    return save_pretrained_llama(tmp_path_factory.mktemp("llama") / "ckpt")


def _user_paths(name: str, request) -> list[str]:
    """The overrides that supply a USER_PATHS config's files, after checking that without them
    it is refused naming each field in turn."""
    if name not in USER_PATHS:
        return []
    folder = request.getfixturevalue("llama_folder")
    given = []
    for field, value in zip(USER_PATHS[name], (folder, folder)):
        with pytest.raises(ConfigError) as e:
            load(RunConfig, next(p for p in CONFIGS if p.name == name), given)
        assert e.value.field == field
        given.append(f"{field}={value}")
    return given


def _approx_params(cfg: RunConfig) -> int:
    m = cfg.model
    if m.name != "gpt2":
        return 0
    return 12 * m.n_layer * m.n_embd ** 2 + (m.vocab_size or 50257) * m.n_embd


def _data_missing(cfg: RunConfig) -> ConfigError | None:
    try:
        build_data(cfg.data, seed=cfg.seed)
    except ConfigError as e:
        return e
    return None


def test_configs_exist():
    names = {p.name for p in CONFIGS}
    for n in ("e2e_small.yaml", "e2e_paper_gpt2.yaml", "e2e_paper_gpt2_im.yaml",
              "dart_paper_gpt2.yaml", "dart_paper_gpt2_im.yaml"):
        assert n in names


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_config_loads_and_builds(path, tmp_path, request):
    user = _user_paths(path.name, request)
    cfg = load(RunConfig, path, user)
    missing = _data_missing(cfg) if cfg.data.name in ("e2e", "mnist", "webdataset") else None
    if missing is not None:
        if path.name.startswith("dart"):
            assert missing.field == "data.path" or "data.path" in str(missing)
        pytest.skip(f"data not available here: {missing}")
    if _approx_params(cfg) > BIG:
        return  # GPT-2 small: validated and its data loads; building it is too slow here
    # Build everything (data, privacy plan, model, clipping engine, optimizer) at a few steps.
    small = load(RunConfig, path, [*user, "privacy.steps=2", "performance.num_threads=1",
                                   f"optim.warmup_steps={min(cfg.optim.warmup_steps, 2)}"])
    trainer = Trainer(small, output_dir=tmp_path)
    assert trainer.plan.noise_multiplier > 0
    assert trainer.named_params


def test_e2e_llama_fine_tunes_a_local_checkpoint_and_exports_it_with_its_tokenizer(
        tmp_path, llama_folder, capsys):
    """configs/e2e_llama.yaml with a tiny Llama folder (one step, on CPU): the run starts from
    the checkpoint's weights, and final/hf holds the trained model and the tokenizer, which
    transformers loads and which encodes as the run's did (BOS first)."""
    import json

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dptrain.cli import main
    from dptrain.data.tokenizers import build_tokenizer

    out = tmp_path / "run"
    config = next(p for p in CONFIGS if p.name == "e2e_llama.yaml")
    code = main(["train", "--config", str(config), "--output-dir", str(out),
                 f"model.pretrained_path={llama_folder}", f"data.tokenizer_path={llama_folder}",
                 "data.max_train_examples=64", "data.max_test_examples=16",
                 "privacy.sample_rate=0.25", "privacy.steps=1", "performance.dtype=float32",
                 "performance.device=cpu", "performance.microbatch_size=8",
                 "performance.num_threads=1", "train.checkpoint_every=0",
                 "train.progress=false"])
    capsys.readouterr()
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 1 and summary["metrics"]["nll_per_token"] > 0
    hf = out / "final" / "hf"
    model = AutoModelForCausalLM.from_pretrained(str(hf), local_files_only=True)
    start = AutoModelForCausalLM.from_pretrained(str(llama_folder), local_files_only=True)
    moved = [n for n, p in model.named_parameters()
             if not torch.equal(p, start.get_parameter(n))]
    assert moved  # trained from the checkpoint, one step away from it
    assert all(torch.allclose(p, start.get_parameter(n), atol=0.1)
               for n, p in model.named_parameters())
    exported = AutoTokenizer.from_pretrained(str(hf), local_files_only=True)
    ours = build_tokenizer("hf", str(llama_folder))
    text = "name[The Vaults], eatType[pub] || The Vaults is a pub."
    assert list(exported.encode(text)) == list(ours.hf.encode(text))
    assert exported.encode(text)[0] == ours.bos_id


def test_dart_without_data_names_data_path():
    for name in ("dart_paper_gpt2.yaml", "dart_paper_gpt2_im.yaml"):
        cfg = load(RunConfig, next(p for p in CONFIGS if p.name == name))
        with pytest.raises(ConfigError) as e:
            build_data(cfg.data, seed=cfg.seed)
        assert "data.path" in str(e.value)


def test_dart_configs_read_the_official_release_layout(tmp_path):
    import json

    record = {"tripleset": [["The Vaults", "eatType", "restaurant"]],
              "annotations": [{"source": "e2e", "text": "The Vaults is a restaurant."},
                              {"source": "e2e", "text": "A restaurant: The Vaults."}]}
    for split in ("train", "test"):
        (tmp_path / f"dart-v1.1.1-full-{split}.json").write_text(json.dumps([record] * 3))
    for name in ("dart_paper_gpt2.yaml", "dart_paper_gpt2_im.yaml"):
        cfg = load(RunConfig, next(p for p in CONFIGS if p.name == name),
                   [f"data.path={tmp_path}"])
        task = build_data(cfg.data, seed=cfg.seed)
        assert len(task.train) == 6
        assert list(task.test.references_by_mr()) == ["The Vaults : eattype : restaurant"]


def test_paper_settings():
    by = {p.name: load(RunConfig, p) for p in CONFIGS if p.name not in USER_PATHS}
    e2e, dart = by["e2e_paper_gpt2.yaml"], by["dart_paper_gpt2.yaml"]
    assert e2e.privacy.release_denominator(42061) == 1025
    assert dart.privacy.release_denominator(62659) == 1027
    for c in (e2e, dart, by["e2e_paper_gpt2_im.yaml"], by["dart_paper_gpt2_im.yaml"]):
        assert (c.model.n_layer, c.model.n_embd, c.model.n_head) == (12, 768, 12)
        assert c.optim.name == "muon" and c.optim.lr == 0.002 and c.optim.aux.lr == 0.0035
        assert c.optim.schedule == "linear" and c.optim.warmup_steps == 0
        assert c.privacy.epsilon == 8.0
    im = by["e2e_paper_gpt2_im.yaml"].optim.inner_momentum
    assert (im.k_muon, im.gamma_muon, im.k_other, im.gamma_other) == (4, 0.5, 2, 0.5)
    im = by["dart_paper_gpt2_im.yaml"].optim.inner_momentum
    assert (im.k_muon, im.gamma_muon, im.k_other, im.gamma_other) == (3, 0.7, 3, 0.5)


def test_yaml_refuses_duplicate_keys_and_octal_but_keeps_merges_and_quotes():
    from dptrain.config import parse_override, safe_load

    with pytest.raises(ConfigError) as e:
        safe_load("privacy:\n  epsilon: 1.0\n  epsilon: 8.0\n")
    assert e.value.field == "privacy.epsilon" and "lines 2 and 3" in e.value.message
    for text, field in (("steps: 010", "steps"), ("a: [1, 0_7]", "a[1]"), ("t: 1:30", "t")):
        with pytest.raises(ConfigError) as e:
            safe_load(text)
        assert e.value.field == field
    assert safe_load("a: '010'\nb: 0\nc: 0x10\nd: 0.5") == {"a": "010", "b": 0, "c": 16, "d": 0.5}
    assert safe_load("x: &b {a: 1}\ny:\n  <<: *b\n  a: 2") == {"x": {"a": 1}, "y": {"a": 2}}
    assert parse_override("privacy.steps=10") == (["privacy", "steps"], 10)
    # an override's value is one line of its own: a line number would point nowhere
    for text, field in (("privacy.steps=010", "privacy.steps"),
                        ("optim.groups=[{pattern: wte, pattern: wpe}]", "optim.groups[0].pattern")):
        with pytest.raises(ConfigError) as e:
            parse_override(text)
        assert e.value.field == field and "line" not in e.value.message


def test_optimizer_kwargs_are_typed_and_checked_like_the_top_level_options():
    cfg = load(RunConfig, None, ["optim.aux.kwargs.eps=1e-8", "optim.aux.kwargs.betas=[0.8, 0.9]",
                                 "optim.groups=[{pattern: wpe, optimizer: sgd, "
                                 "kwargs: {momentum: '0.5', nesterov: true}}]"])
    assert cfg.optim.aux.kwargs == {"eps": 1e-8, "betas": [0.8, 0.9]}  # '1e-8' is a YAML string
    assert cfg.optim.groups[0].kwargs == {"momentum": 0.5, "nesterov": True}
    for override, field in (("optim.aux.kwargs.nesterov=maybe", "optim.aux.kwargs.nesterov"),
                            ("optim.aux.kwargs.betas=[0.9]", "optim.aux.kwargs.betas"),
                            ("optim.momentum=1.0", "optim.momentum"),
                            ("optim.ns_steps=0", "optim.ns_steps"),
                            # round to 0 in a float32/bf16 Newton-Schulz or AdamW (their squares,
                            # for gamma_ns): a zero matrix gave NaN parameters, exit 0
                            ("optim.eps=1e-50", "optim.eps"),
                            ("optim.aux.kwargs.eps=1e-45", "optim.aux.kwargs.eps"),
                            ("optim.name=muon_bc optim.bc_gamma_ns=1e-30", "optim.bc_gamma_ns")):
        with pytest.raises(ConfigError) as e:
            load(RunConfig, None, override.split())
        assert e.value.field == field, override
    assert load(RunConfig, None, ["optim.name=muon_bc", "optim.eps=1.2e-38",
                                  "optim.bc_gamma_ns=1.1e-19"])


@pytest.mark.parametrize("name", ["imagenet_nf_resnet50.yaml",
                                  "imagenet_nf_resnet50_de2022.yaml"])
def test_imagenet_config_trains_on_webdataset_shards(tmp_path, name):
    """The ImageNet configs' data, model, augmult, optimizer and EMA path end to end, on 12
    generated JPEG shards at 32 px (ImageNet itself is not on these machines): one private
    step, then top-1 of the average and of the last iterate."""
    import io
    import json

    import numpy as np
    import webdataset as wds
    from PIL import Image

    from dptrain.cli import main

    rng = np.random.default_rng(0)
    for split, n in (("train", 12), ("val", 4)):
        with wds.TarWriter(str(tmp_path / f"imagenet-{split}-000000.tar")) as w:
            for j in range(n):
                buf = io.BytesIO()
                Image.fromarray(rng.integers(0, 256, (40, 36, 3), dtype=np.uint8)).save(
                    buf, format="JPEG")
                w.write({"__key__": f"{split}{j:04d}", "jpg": buf.getvalue(),
                         "cls": str(int(rng.integers(0, 1000))).encode()})
    out = tmp_path / "run"
    code = main(["train", "--config", str(Path(__file__).resolve().parents[1] / "configs" /
                                          name),
                 "--output-dir", str(out), f"data.path={tmp_path}", "data.image_size=32",
                 "privacy.sample_rate=0.5", "privacy.dataset_size=null", "privacy.steps=1",
                 "performance.dtype=float32",
                 "performance.microbatch_size=4", "performance.num_threads=1",
                 "performance.device=cpu", "optim.warmup_steps=0", "train.eval_every=0",
                 "data.augmult=2",  # the configs' 4 views: 2 here, for time
                 "train.checkpoint_every=0", "train.progress=false"])
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 1 and 0 < summary["epsilon"] <= 8.0
    assert 0.0 <= summary["metrics"]["accuracy"] <= 1.0
    assert 0.0 <= summary["metrics"]["last_iterate_accuracy"] <= 1.0
    assert summary["config"]["data"]["augmult"] == 2
    shipped = load(RunConfig, Path(__file__).resolve().parents[1] / "configs" / name)
    assert shipped.data.augmult == 4 and shipped.optim.ema_decay > 0.99
    # De et al.'s batch, b = 16,384 of ImageNet's public N, whatever count the shards give
    assert shipped.privacy.release_denominator(1_281_000) == 16_384
    assert shipped.privacy.release_denominator(1_281_167) == 16_384
    assert (out / "final" / "last_iterate.safetensors").is_file()


def test_an_optional_number_reports_the_number_s_own_problem():
    # "X | None" used to say only "expected float | null" for a number out of float32's range
    from dptrain.config import ConfigError, from_dict
    from dptrain.privacy.config import PrivacyConfig

    with pytest.raises(ConfigError) as e:
        from_dict(PrivacyConfig, {"noise_multiplier": "1e300"}, "privacy")
    assert e.value.field == "privacy.noise_multiplier" and "float32" in e.value.message
    with pytest.raises(ConfigError) as e:
        from_dict(PrivacyConfig, {"noise_multiplier": "abc"}, "privacy")
    assert "expected a number" in e.value.message


@dataclasses.dataclass
class _Leaf:
    x: float = 0.0
    n: int = 0
    s: str = ""

    def validate(self):
        if self.x < -1:
            raise ConfigError("x", f"must be >= -1, got {self.x}")


@dataclasses.dataclass
class _Root:
    leaf: _Leaf = dataclasses.field(default_factory=_Leaf)
    items: list[_Leaf] = dataclasses.field(default_factory=list)


def _field_of(overrides):
    with pytest.raises(ConfigError) as e:
        load(RunConfig, None, overrides)
    return e.value


def test_a_value_outside_a_literal_is_refused_naming_the_field():
    e = _field_of(["privacy.accountant=gdp"])
    assert e.field == "privacy.accountant" and "'prv' | 'rdp'" in e.message
    assert load(RunConfig, None, ["privacy.accountant=rdp"]).privacy.accountant == "rdp"


def test_fractions_are_numerator_over_denominator_and_nothing_else():
    cfg = load(RunConfig, None, ["privacy.delta=1/84122"])
    assert cfg.privacy.delta == 1 / 84122
    for text in ("1/2/3", "1/0", "a/2"):
        e = _field_of([f"privacy.delta={text}"])
        assert e.field == "privacy.delta" and "expected a number" in e.message, text


def test_booleans_and_fractional_numbers_are_not_integers_or_numbers():
    for override, field_ in (("privacy.steps=true", "privacy.steps"),  # True == 1 to Python
                             ("privacy.steps=2.5", "privacy.steps"),  # not int(2.5) == 2
                             ("privacy.epsilon=true", "privacy.epsilon"),  # not 1.0
                             ("privacy.clip_norm=false", "privacy.clip_norm")):
        e = _field_of([override])
        assert e.field == field_, override
    assert load(RunConfig, None, ["privacy.steps=4.0"]).privacy.steps == 4
    assert type(load(RunConfig, None, ["privacy.steps=4.0"]).privacy.steps) is int


def test_float32_range_is_checked_on_both_signs_and_leaves_inf_to_the_field():
    with pytest.raises(ConfigError) as e:
        from_dict(_Leaf, {"x": "-1e300"}, "leaf")
    assert e.value.field == "leaf.x" and "float32" in e.value.message
    assert from_dict(_Leaf, {"x": -3.0e38}).x == -3.0e38  # inside the range
    # inf / nan are not "beyond float32's range": the field's own check answers
    assert from_dict(_Leaf, {"x": "inf"}).x == float("inf")
    assert from_dict(_Leaf, {"x": "-inf"}).x == float("-inf")
    e = _field_of(["privacy.clip_norm=inf"])
    assert e.field == "privacy.clip_norm" and "float32" not in e.message
    # (it said "must be > 0, got inf", which inf is)
    assert e.message == "must be finite and > 0, got inf"
    e = _field_of(["privacy.epsilon=inf"])
    assert e.field == "privacy.epsilon" and e.message == "must be finite and > 0, got inf"


def test_a_string_field_takes_numbers_but_not_booleans():
    assert from_dict(_Leaf, {"s": 5}).s == "5" and from_dict(_Leaf, {"s": 0.5}).s == "0.5"
    with pytest.raises(ConfigError) as e:
        from_dict(_Leaf, {"s": True}, "leaf")
    assert e.value.field == "leaf.s"


def test_an_override_splits_at_its_first_equals_sign():
    from dptrain.config import parse_override

    assert parse_override("data.path=/tmp/a=b") == (["data", "path"], "/tmp/a=b")
    assert parse_override("optim.groups=[{pattern: 'h.0=x', optimizer: sgd}]") == (
        ["optim", "groups"], [{"pattern": "h.0=x", "optimizer": "sgd"}])


def test_what_a_merge_key_brings_in_is_checked_too():
    from dptrain.config import safe_load

    # an anchor first defined inside a merge, and an inline mapping merged in
    for text, field_ in (("y:\n  <<: &base {a: 010}\nz:\n  <<: *base\n", "y.a"),
                         ("y:\n  <<: {a: 1, a: 2}\n  b: 3\n", "y.a"),
                         ("y:\n  <<: [{t: 1:30}]\n", "y[0].t")):
        with pytest.raises(ConfigError) as e:
            safe_load(text)
        assert e.value.field == field_, text
    assert safe_load("y:\n  <<: {a: 1}\n  a: 2\n") == {"y": {"a": 2}}  # an override, not a dup


def test_an_override_value_that_is_not_yaml_is_kept_as_text():
    from dptrain.config import parse_override

    assert parse_override("privacy.epsilon=[1") == (["privacy", "epsilon"], "[1")
    e = _field_of(["privacy.epsilon=[1"])  # then the field's type check names it
    assert e.field == "privacy.epsilon" and "expected a number" in e.message


@pytest.mark.parametrize("text", ["- seed: 1\n", "3\n", "just words\n"])
def test_a_config_file_that_is_not_a_mapping_is_one_config_error(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError) as e:
        load(RunConfig, p)
    assert e.value.field == "config" and "mapping at the top level" in e.value.message


def test_validate_tree_prefixes_nested_and_listed_fields():
    with pytest.raises(ConfigError) as e:
        validate_tree(_Root(items=[_Leaf(), _Leaf(x=-5)]))
    assert e.value.field == "items[1].x"
    with pytest.raises(ConfigError) as e:
        validate_tree(_Root(leaf=_Leaf(x=-5)))
    assert e.value.field == "leaf.x"


def test_docs_config_md_is_the_generated_key_reference_and_every_key_is_documented():
    from dptrain.config_reference import reference_markdown, sections

    root = Path(__file__).resolve().parents[1]
    assert (root / "docs" / "config.md").read_text() == reference_markdown(), (
        "docs/config.md is stale: python -m dptrain.config_reference > docs/config.md")
    rows = [row for _, rs in sections(RunConfig) for row in rs]
    assert not [key for key, _, _, doc in rows if not doc]
    keys = {key for key, *_ in rows}
    # one row per leaf key, nested configs and lists of them included
    assert {"seed", "privacy.delta", "optim.filter.kappa", "optim.groups[].pattern",
            "optim.inner_momentum.k_muon", "train.keep_checkpoints"} <= keys
    assert "optim.filter" not in keys and len(keys) == len(rows)


# ------------------------------------------------------------- a config fuzz's findings (exit 2)

TINY = str(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml")
TINY_IMAGES = str(Path(__file__).resolve().parents[1] / "configs" / "tiny_images.yaml")


def _dry_run(capsys, *argv) -> tuple[int, str]:
    from dptrain.cli import main

    code = main(["train", "--dry-run", *argv])
    return code, capsys.readouterr().err.strip()


LONG = "x" * 300  # a file name of 300 bytes: Path.is_file raised OSError "File name too long"


@pytest.mark.parametrize("argv, field", [
    (["--config", LONG], "config"),
    (["--config", TINY, "--output-dir", f"/tmp/{LONG}"], "output-dir"),
    (["--config", TINY, "--output-dir", "{out}", "--resume", f"/tmp/{LONG}"], "resume"),
    (["--config", TINY, "--output-dir", "{out}", f"model.pretrained_path={LONG}"],
     "model.pretrained_path"),
    (["--config", TINY_IMAGES, "--output-dir", "{out}", "model.name=timm",
      "model.timm_name=nf_resnet_tiny", f"model.pretrained_path={LONG}"], "model.pretrained_path"),
    (["--config", TINY, "--output-dir", "{out}", "data.name=e2e", f"data.path={LONG}"],
     "data.path"),
    (["--config", TINY, "--output-dir", "{out}", "data.name=e2e", f"data.train_file=a/{LONG}"],
     "data.train_file"),
    (["--config", TINY, "--output-dir", "{out}", "data.name=e2e", "data.path=" + "/a" * 2100],
     "data.path"),  # every name short, the path over 4,095 bytes
])
def test_paths_too_long_for_the_os_are_one_line_naming_the_field(tmp_path, capsys, argv, field):
    argv = [a.format(out=tmp_path / "out") for a in argv]
    code, err = _dry_run(capsys, *argv, "privacy.noise_multiplier=1")
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"dptrain train: error: {field}: is not a usable path"), err
    assert not (tmp_path / "out").exists()


def test_a_shard_pattern_is_checked_name_by_name():
    # 40 shards listed in braces are one 291-byte text, but every name is 16 bytes
    shards = "{" + ",".join(f"train-{i:06d}" for i in range(40)) + "}.tar"
    cfg = load(RunConfig, TINY_IMAGES, ["data.name=webdataset", f"data.train_file={shards}",
                                        "data.path=/data"])
    assert cfg.data.train_file == shards
    with pytest.raises(ConfigError) as e:  # a name it stands for is too long: refused
        load(RunConfig, TINY_IMAGES, ["data.name=webdataset", "data.path=/data",
                                      "data.train_file={a,%s}.tar" % ("x" * 300)])
    assert e.value.field == "data.train_file" and "a name of 304 bytes" in e.value.message


def test_a_mapping_given_to_a_section_sets_its_keys_and_keeps_the_others():
    base = load(RunConfig, TINY)
    cfg = load(RunConfig, TINY, ["privacy={epsilon: 3, clip_norm: 0.5}"])
    # it replaced the whole section: steps 4 -> 100, sample rate 0.125 -> 0.01, rdp -> prv
    assert (cfg.privacy.epsilon, cfg.privacy.clip_norm) == (3.0, 0.5)
    assert (cfg.privacy.steps, cfg.privacy.sample_rate, cfg.privacy.accountant) == (
        base.privacy.steps, base.privacy.sample_rate, base.privacy.accountant)
    # nested sections merge too; a free mapping (timm_kwargs) is one value, replaced whole
    cfg = load(RunConfig, TINY, ["optim={inner_momentum: {k_muon: 2}}"])
    assert cfg.optim.inner_momentum.k_muon == 2 and cfg.optim.name == base.optim.name
    cfg = load(RunConfig, TINY_IMAGES, ["model.name=timm", "model.timm_name=vit_tiny_patch16_224",
                                        "model.timm_kwargs={img_size: 16, patch_size: 4}",
                                        "model.timm_kwargs={patch_size: 8}"])
    assert cfg.model.timm_kwargs == {"patch_size": 8}
    assert load(RunConfig, TINY, ["privacy={}"]) == base  # it reset the section to defaults
    with pytest.raises(ConfigError) as e:  # an unknown key inside still names itself
        load(RunConfig, TINY, ["privacy={epsilom: 3}"])
    assert e.value.field == "privacy.epsilom"


def test_an_override_without_a_value_and_a_config_without_settings_are_refused(tmp_path):
    # `key=` silently meant null: train.generate_prompts= was "every test MR", not 0
    with pytest.raises(ConfigError) as e:
        load(RunConfig, TINY, ["privacy.epsilon="])
    assert e.value.field == "privacy.epsilon" and "key=null" in e.value.message
    assert load(RunConfig, TINY, ["privacy.epsilon=null",
                                  "privacy.noise_multiplier=1"]).privacy.epsilon is None
    for text in ("", "# only a comment\n", "null\n"):  # was the whole default run
        (tmp_path / "c.yaml").write_text(text)
        with pytest.raises(ConfigError) as e:
            load(RunConfig, tmp_path / "c.yaml")
        assert e.value.field == "config" and "holds no settings" in e.value.message
    (tmp_path / "c.yaml").write_text("{}\n")  # every default, said so
    assert load(RunConfig, tmp_path / "c.yaml") == load(RunConfig, None)


@pytest.mark.parametrize("name", ["foo/bar", "hf-hub:timm/resnet18", "local-dir:/tmp"])
def test_timm_names_that_timm_would_fetch_or_read_from_a_folder_are_refused(name):
    with pytest.raises(ConfigError) as e:  # a ValueError, a Hub download, a FileNotFoundError
        load(RunConfig, TINY_IMAGES, ["model.name=timm", f"model.timm_name={name}"])
    assert e.value.field == "model.timm_name" and "registered" in e.value.message


@pytest.mark.parametrize("overrides, field, words", [
    (["privacy.epsilon=5e-324"], "privacy.epsilon", "too small"),  # named epsilon_tolerance
    (["privacy.epsilon=null", "privacy.noise_multiplier=1e30", "privacy.clip_norm=1e30"],
     "privacy.noise_multiplier", "overflow float32"),  # trained to a NaN model, exit 0
    (["privacy.epsilon=null", "privacy.noise_multiplier=1", "privacy.clip_norm=1e-45"],
     "privacy.clip_norm", "smallest normal"),
])
def test_privacy_values_float32_cannot_carry_are_refused(tmp_path, capsys, overrides, field,
                                                         words):
    code, err = _dry_run(capsys, "--config", TINY, "--output-dir", str(tmp_path / "o"),
                         *overrides)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"dptrain train: error: {field}: ") and words in err, err


@pytest.mark.parametrize("overrides, field", [
    (["privacy.seed=-1"], "privacy.seed"),  # (accepted: the top-level seed refused -1)
    (["seed=-1"], "seed"),
])
def test_a_negative_seed_is_refused_naming_it(overrides, field):
    with pytest.raises(ConfigError) as e:
        load(RunConfig, next(p for p in CONFIGS if p.name == "tiny.yaml"), overrides)
    assert e.value.field == field


# ------------------------------------------------- boundaries a mutation run found untested

def test_a_bool_in_a_list_of_integers_is_refused_naming_its_element():
    # the tree check after loading sees fields, not list elements: [16, true] was [16, True]
    e = _field_of(["model.name=cnn", "model.channels=[16,true]"])
    assert e.field == "model.channels[1]" and "expected an integer" in e.message
    with pytest.raises(ConfigError):
        from_dict(_Leaf, {"n": True})


def test_a_list_of_sections_names_the_element_and_a_missing_required_field():
    e = _field_of(["optim.groups=[{optimizer: sgd}]"])
    assert e.field == "optim.groups[0].pattern" and "required" in e.message


def test_an_unknown_top_level_key_is_one_error_naming_it():
    e = _field_of(["seeed=1"])
    assert e.field == "seeed" and "unknown key" in e.message


def test_integer_and_float_ranges_end_where_int64_and_float32_end():
    from dptrain.config import FLOAT32_MAX

    for n in (2**63 - 1, -2**63):
        assert from_dict(_Leaf, {"n": n}).n == n
    for n in (2**63, -2**63 - 1):
        with pytest.raises(ConfigError, match="int64"):
            from_dict(_Leaf, {"n": n})
    assert from_dict(_Leaf, {"x": FLOAT32_MAX}).x == FLOAT32_MAX
    with pytest.raises(ConfigError):
        from_dict(_Leaf, {"x": "3.5e38"})


def test_blank_values_and_float_base_60_are_refused():
    from dptrain.config import parse_override, safe_load

    for text in ("privacy.epsilon=", "privacy.epsilon= ", "privacy.epsilon=\t"):
        with pytest.raises(ConfigError, match="key=null") as e:
            parse_override(text)  # (a shell variable that expanded to blanks: not null)
        assert e.value.field == "privacy.epsilon"
    for text in ("t: 1:30", "t: 1:30.5"):  # YAML 1.1 reads 90 and 90.5
        with pytest.raises(ConfigError) as e:
            safe_load(text)
        assert e.value.field == "t"


def test_an_override_below_a_scalar_that_is_zero_is_refused():
    from dptrain.config import apply_override

    for scalar in (0, "", False):
        with pytest.raises(ConfigError, match="'seed' is not a section"):
            apply_override({"seed": scalar}, ["seed", "x"], 1)


def test_path_names_end_at_the_file_system_s_limits():
    from dptrain.config import NAME_MAX, PATH_MAX, check_path_name

    check_path_name("f", "a" * NAME_MAX)
    long = "/".join(["a" * 200] * 21)  # (4,220 characters)
    check_path_name("f", long[:PATH_MAX])
    for bad in ("a" * (NAME_MAX + 1), long[:PATH_MAX + 1]):
        with pytest.raises(ConfigError) as e:
            check_path_name("f", bad)
        assert e.value.field == "f"


def test_brief_keeps_the_first_200_characters_of_the_first_line():
    from dptrain.messages import brief

    assert brief(ValueError("x" * 300 + "\nmore")) == "ValueError: " + "x" * 200
    assert brief(ValueError("")) == "ValueError"


@pytest.mark.parametrize("kwargs, field", [
    ({"epsilon": 0.0}, "epsilon"), ({"delta": 0.0}, "delta"), ({"delta": 1.0}, "delta"),
    ({"sample_rate": 0.0}, "sample_rate"), ({"sample_rate": 1.0000000000000002}, "sample_rate"),
    ({"steps": 0}, "steps"), ({"steps": 10**9 + 1}, "steps"),
    ({"noise_multiplier": -1e-300}, "noise_multiplier"),
    ({"epsilon": None, "noise_multiplier": None}, "noise_multiplier"),
    ({"dataset_size": 0}, "dataset_size"), ({"expected_batch_size": 0}, "expected_batch_size"),
    ({"secure_mode": True, "seed": 0}, "seed"), ({"seed": None}, "seed"),
])
def test_privacy_settings_just_outside_their_documented_ranges_are_refused(kwargs, field):
    """The ranges of docs/config.md: epsilon > 0, delta in (0, 1), q in (0, 1], 1 <= steps <=
    1e9, sigma >= 0, N and b >= 1, a seed unless secure_mode (and none with it)."""
    from dptrain.privacy.config import PrivacyConfig

    with pytest.raises(ConfigError) as e:
        PrivacyConfig(**kwargs).validate()
    assert e.value.field == field


@pytest.mark.parametrize("kwargs", [
    {"epsilon": 1e-300}, {"delta": 0.9999999999999999}, {"sample_rate": 1.0}, {"steps": 1},
    {"steps": 10**9}, {"epsilon": None, "noise_multiplier": 0.0},
    {"dataset_size": 1, "expected_batch_size": 1}, {"secure_mode": True, "seed": None}])
def test_privacy_settings_at_the_ends_of_their_documented_ranges_are_accepted(kwargs):
    from dptrain.privacy.config import PrivacyConfig

    PrivacyConfig(**kwargs).validate()


def test_noise_fits_float32_only_when_its_largest_draw_does():
    """No float64 normal draw exceeds ~38.5 standard deviations: sigma C at FLOAT32_MAX / 38
    can draw a value float32 holds as inf, at FLOAT32_MAX / 1000 it cannot."""
    from dptrain.config import FLOAT32_MAX
    from dptrain.privacy.config import noise_fits

    for scale, fits in ((FLOAT32_MAX / 38, False), (FLOAT32_MAX / 1000, True)):
        assert torch.isinf(torch.tensor(38.5 * scale, dtype=torch.float32)).item() is not fits
        assert noise_fits(scale, 1.0) is fits and noise_fits(1.0, scale) is fits


@pytest.mark.parametrize("q, n", [(0.001, 100), (0.25, 3), (0.5, 1), (0.3, 10), (0.07, 1000)])
def test_the_release_denominator_is_max_1_floor_qn_never_0(q, n):
    """b = max(1, floor(q N)) (docs/config.md): a q N below 1 still divides by one example,
    never by 0."""
    import math

    from dptrain.privacy.config import PrivacyConfig, expected_batch_size

    want = max(1, math.floor(q * n + 1e-9))
    assert expected_batch_size(q, n) == want >= 1
    assert PrivacyConfig(sample_rate=q).release_denominator(n) == want


def test_values_in_messages_are_written_as_a_config_writes_them():
    # a resume refusal said "(None there, 'x' now)": YAML's words are null, true and false
    from dptrain.config import shown

    assert [shown(v) for v in (None, True, False, 3, 0.5, "x")] == [
        "null", "true", "false", "3", "0.5", "'x'"]
    assert shown([None, {"a": False}]) == "[null, {a: false}]"
    # a regex's backslashes as written (repr doubled them: ['\\.bias$']); YAML's quote
    assert shown([r"\.bias$", "it's"]) == r"['\.bias$', 'it''s']"
    # a control character: JSON's escapes, YAML's double quotes (repr read "a\\tb" the same)
    assert shown("a\tb") == '"a\\tb"' and shown("a\\tb") == "'a\\tb'"
    assert yaml.safe_load(shown("a\tb")) == "a\tb" and yaml.safe_load(shown("a\nb")) == "a\nb"


def test_a_resume_refusal_shows_a_changed_regex_as_written():
    from dptrain.checkpoint import check_compatible
    from dptrain.config import to_dict

    saved = to_dict(load(RunConfig, None, ["model.trainable=[bias$]"]))
    with pytest.raises(ConfigError) as e:
        check_compatible(saved, load(RunConfig, None, [r"model.trainable=['\.bias$']"]))
    assert e.value.field == "model.trainable"
    assert r"(['bias$'] there, ['\.bias$'] now)" in e.value.message, e.value.message
