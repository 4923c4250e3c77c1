"""`dptrain train` end to end, and every bad input of CONTRACT.md: exit 2, one clear line."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _opacus import opacus_epsilon

from dptrain.cli import main

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")


def run_cli(capsys, *args) -> tuple[int, str, str]:
    code = main(list(args))
    cap = capsys.readouterr()
    return code, cap.out, cap.err


def test_train_writes_summary_and_full_model(tmp_path, capsys):
    out = tmp_path / "run"
    code, stdout, _ = run_cli(capsys, "train", "--config", TINY, "--output-dir", str(out),
                              "train.checkpoint_every=0")
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    for key in ("epsilon", "delta", "steps", "noise_multiplier", "metrics"):
        assert key in summary
    assert summary["steps"] == 4 and 0 < summary["epsilon"] <= 8.0
    assert summary["metrics"]["nll_per_token"] > 0
    from safetensors.torch import load_file

    state = load_file(str(out / "final" / "model.safetensors"))
    # tied wte/lm_head stored once; together with the rest it is the whole model
    assert any(k.endswith("wte.weight") or k == "lm_head.weight" for k in state)
    assert sum(v.numel() for v in state.values()) > 0
    assert all(torch.isfinite(v).all() for v in state.values())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["epsilon"] <= summary["epsilon"] + 1e-12 for r in rows)
    assert "epsilon" in stdout
    tokens = summary["metrics"]["tokens"]
    assert isinstance(tokens, int) and f", tokens {tokens};" in stdout
    assert f"nll_per_token {summary['metrics']['nll_per_token']:.4g}" in stdout


def test_the_last_line_gives_counts_as_integers():
    from dptrain.commands.train import _done_metrics

    # a token count read 1.322e+04
    assert _done_metrics({"nll_per_token": 2.675912, "tokens": 13220, "bleu": 0.2187,
                          "last_iterate_nll_per_token": 2.7, "last_iterate_tokens": 13220,
                          "last_iterate_examples": 5}) == (
        "nll_per_token 2.676, tokens 13220, bleu 0.2187, last_iterate_nll_per_token 2.7")


def _tiny_run(tmp_path, capsys, *overrides) -> Path:
    out = tmp_path / "run"
    code, _, err = run_cli(capsys, "train", "--config", TINY, "--output-dir", str(out),
                           "train.checkpoint_every=0", *overrides)
    assert code == 0, err
    return out


def test_metrics_rows_log_the_learning_rates_their_step_applied(tmp_path, capsys):
    # cosine over T = 4 with 2 warm-up steps applies factors 0.5, 1, 1, 0.5 (by hand: warm-up
    # (s + 1) / 2, then progress (s - 2) / 2); rows logged the next step's rate before
    out = _tiny_run(tmp_path, capsys, "optim.schedule=cosine", "optim.warmup_steps=2")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["lr"] for r in rows] == [
        {"matrices": 0.02 * f, "others": 0.01 * f} for f in (0.5, 1.0, 1.0, 0.5)]


@pytest.mark.parametrize("override, field", [
    ("privacy.epslion=3", "privacy.epslion"),
    ("privacy.epsilon=0", "privacy.epsilon"),
    ("privacy.epsilon=-1", "privacy.epsilon"),
    ("privacy.delta=1.5", "privacy.delta"),
    ("privacy.delta=0", "privacy.delta"),
    ("privacy.sample_rate=0", "privacy.sample_rate"),
    ("privacy.sample_rate=1.5", "privacy.sample_rate"),
    ("privacy.clip_norm=0", "privacy.clip_norm"),
    ("privacy.clip_norm=-2", "privacy.clip_norm"),
    ("privacy.steps=abc", "privacy.steps"),
    ("privacy.adjacency=replace_one", "privacy.adjacency"),
    # secure mode draws its seed from OS entropy: a fixed one would be a contradiction
    ("privacy.secure_mode=true", "privacy.seed"),
    ("privacy.seed=null", "privacy.seed"),
    ("model.n_embd=33", "model.n_embd"),
    ("data.name=e2e", "data."),  # with a directory that does not exist:
    ("optim.groups=[{pattern: nothing_matches, optimizer: adamw}]", "optim.groups[0].pattern"),
    ("privacy.steps=010", "privacy.steps"),  # YAML 1.1 would read 8
    ("privacy.noise_multiplier=inf", "privacy.noise_multiplier"),
    ("privacy.noise_multiplier=nan", "privacy.noise_multiplier"),
    # over budget: one line, without opacus' notes about its RDP orders before it
    ("privacy.noise_multiplier=0.1", "privacy.noise_multiplier"),
    ("privacy.steps=1000000001", "privacy.steps"),  # more than the accountants can handle
    # sigma^2 overflows in opacus (a traceback); one below 1e-100, where it underflowed or
    # never ended, is none (epsilon inf: test_accounting.py)
    (("privacy.epsilon=null", "privacy.noise_multiplier=1e300", "privacy.accountant=rdp"),
     "privacy.noise_multiplier"),
    # a traceback (a subnormal rate: opacus divides by zero; torch's C int), or a dry run that
    # made a 2^62-long synthetic set in Python, deaf to SIGTERM
    ("privacy.sample_rate=1e-320", "privacy.sample_rate"),
    ("performance.num_threads=2147483648", "performance.num_threads"),
    ("performance.decode_threads=5000", "performance.decode_threads"),
    ("data.max_length=4611686018427387904", "data.max_length"),
    ("data.synthetic_train_size=4611686018427387904", "data.synthetic_train_size"),
    ("data.synthetic_test_size=1000001", "data.synthetic_test_size"),
    # each size within bounds, their product not: hours of Python
    (("data.synthetic_train_size=1000000", "data.max_length=1024"), "data.synthetic_train_size"),
    ("model.pretrained_path=''", "model.pretrained_path"),  # was read as the current directory
    ("privacy.epsilon=1e20", "privacy.epsilon"),  # calibration never ended
    ("privacy.epsilon=1e-9", "privacy.epsilon"),  # calibration: unreachable
    ("optim.groups=[{pattern: wte, pattern: wpe, optimizer: adamw}]",
     "optim.groups[0].pattern"),  # duplicate key
    ("optim.groups=[{optimizer: adamw}]", "optim.groups[0].pattern"),  # was a TypeError
    # a setting of another model, dataset or filter kind was silently ignored (the cnn's own
    # ranges and gpt2-only fields are test_models.py's): tiny.yaml's GPT-2 shape under a cnn,
    # stochastic depth, classes or augmentation for GPT-2 on text, DiSK's gain without DiSK
    (("model.name=cnn", "data.name=synthetic_images", "optim.preset=nfresnet"), "model.n_layer"),
    ("model.drop_path_rate=0.5", "model.drop_path_rate"),
    ("model.num_classes=10", "model.num_classes"),
    ("data.augmult=2", "data.augmult"),
    ("data.image_size=32", "data.image_size"),
    ("optim.filter.kappa=0.5", "optim.filter.kappa"),
    ("optim.filter.b=[0.5]", "optim.filter.b"),
    ("optim.preset=nfresnet", "optim.preset"),  # no 4-D weights in GPT-2: Muon drove nothing
    # optimizer options of the wrong type or out of range name their own field
    ("optim.aux.kwargs.betas=abc", "optim.aux.kwargs.betas"),
    ("optim.aux.kwargs.eps=nan", "optim.aux.kwargs.eps"),
    ("optim.aux.kwargs.weight_decay=-1", "optim.aux.kwargs.weight_decay"),
    ("optim.groups=[{pattern: wte, optimizer: sgd, kwargs: {momentum: abc}}]",
     "optim.groups[0].kwargs.momentum"),
    # non-finite optimizer values (a NaN model otherwise)
    ("optim.lr=inf", "optim.lr"),
    ("optim.lr=1e300", "optim.lr"),  # finite, but a RuntimeError in float32 at the first step
    (("optim.filter.name=doppler", "optim.filter.a=[]", "optim.filter.b=[1e300, 1e300]"),
     "optim.filter.b"),
    ("optim.aux.lr=inf", "optim.aux.lr"),
    ("optim.groups=[{pattern: wte, optimizer: adamw, lr: .inf}]", "optim.groups[0].lr"),
    ("optim.weight_decay=nan", "optim.weight_decay"),
    ("optim.weight_decay=inf", "optim.weight_decay"),
    ("optim.eps=-1", "optim.eps"),
    ("optim.eps=nan", "optim.eps"),
    ("optim.eps=0", "optim.eps"),  # Newton-Schulz's X / (||X|| + 0): NaN on a zero release
    ("optim.aux.kwargs.eps=0", "optim.aux.kwargs.eps"),  # AdamW's m / (sqrt(v) + 0) likewise
    (("optim.name=muon_bc", "optim.bc_lambda=nan"), "optim.bc_lambda"),
    (("optim.name=muon_bc", "optim.bc_gamma_ns=nan"), "optim.bc_gamma_ns"),
    (("optim.name=muon_bc", "optim.bc_gamma_ns=0"), "optim.bc_gamma_ns"),  # Smooth-NS needs > 0
    (("optim.name=muon_bc", "optim.bc_gamma_ns=-1"), "optim.bc_gamma_ns"),  # named optim.name
    # (10^15 bytes: beyond any address space, refused whatever the overcommit setting)
    ("model.vocab_size=10000000000000", "model.vocab_size"),  # the allocator's traceback
    ("optim.warmup_steps=5", "optim.warmup_steps"),  # tiny.yaml: 4 steps; lr never reached
    ("privacy.expected_batch_size=257", "privacy.expected_batch_size"),  # N = 256
    (("optim.name=muon_bc", "optim.bc_kappa=inf"), "optim.bc_kappa"),
    (("optim.filter.name=doppler", "optim.filter.b=[nan]"), "optim.filter.b"),
    (("optim.filter.name=disk", "optim.filter.gamma=inf"), "optim.filter.gamma"),
    ("seed=-1", "seed"),
    ("seed=9223372036854775808", "seed"),  # 2**63: beyond torch.manual_seed
    ("train.eval_batch_size=0", "train.eval_batch_size"),  # crashed after training
    # an FSDP-only setting without FSDP did nothing, silently
    ("performance.fsdp_mixed_precision=true", "performance.fsdp_mixed_precision"),
    # a history length for a part of the query without parameters would do nothing
    (("optim.inner_momentum.k_muon=2", "optim.name=sgd", "optim.preset=null"),
     "optim.inner_momentum.k_muon"),
    ("train.eval_every=-1", "train.eval_every"),
    ("train.checkpoint_every=-1", "train.checkpoint_every"),
    # an integer of 401 digits for a number was an OverflowError in float()
    ("privacy.epsilon=1%s" % ("0" * 400), "privacy.epsilon"),
    ("optim.aux.kwargs={weight_decay: 1%s}" % ("0" * 400), "optim.aux.kwargs.weight_decay"),
    # beyond int64: OverflowErrors in torch.set_num_threads, the schedule, numpy
    ("performance.num_threads=9223372036854775808", "performance.num_threads"),
    ("optim.warmup_steps=1%s" % ("0" * 400), "optim.warmup_steps"),
    ("privacy.expected_batch_size=18446744073709551616", "privacy.expected_batch_size"),
    (("model.lora.r=2", "model.lora.alpha=.inf"), "model.lora.alpha"),  # NaN loss in the run
    # an average that never starts (tiny.yaml: 4 steps): the "average" would be the last iterate
    (("optim.ema_decay=0.9", "optim.ema_start_step=4"), "optim.ema_start_step"),
    # explicit groups' leftovers go to the preset's groups when there is one (tiny.yaml: gpt2)
    ("optim.unmatched=default", "optim.unmatched"),
    ("performance.decode_threads=4", "performance.decode_threads"),  # tiny.yaml: synthetic text
])
def test_bad_input_exits_2_with_one_line_naming_the_field(tmp_path, capsys, override, field):
    overrides = override if isinstance(override, tuple) else (override,)
    extra = ["data.path=" + str(tmp_path / "missing")] if override == "data.name=e2e" else []
    code, stdout, err = run_cli(capsys, "train", "--config", TINY, "--output-dir",
                                str(tmp_path / "out"), *overrides, *extra)
    assert code == 2
    lines = [line for line in err.strip().splitlines() if line]
    assert len(lines) == 1, err
    assert field in lines[0]
    assert not (tmp_path / "out" / "summary.json").exists()


_TINY_TEXT = Path(TINY).read_text()


@pytest.mark.parametrize("content, field, words", [
    (b"\xff\xfe", "config", "UTF-8"),
    (b"seed: 0\nprivacy:\n  epsilon: [1\n", "config", "(line 4, column 1)"),  # 1-based
    # a second epsilon must not silently replace the first privacy target
    (_TINY_TEXT.replace("  epsilon: 8.0\n", "  epsilon: 1.0\n  epsilon: 8.0\n").encode(),
     "privacy.epsilon", "duplicate"),
    (_TINY_TEXT.replace("  steps: 4\n", "  steps: 04\n").encode(), "privacy.steps",
     f"'04' (line {_TINY_TEXT.splitlines().index('  steps: 4') + 1}): YAML reads a leading 0"),
])
def test_a_bad_config_file_exits_2_with_one_line(tmp_path, capsys, content, field, words):
    cfg = tmp_path / "c.yaml"
    cfg.write_bytes(content)
    code, _, err = run_cli(capsys, "train", "--config", str(cfg), "--output-dir",
                           str(tmp_path / "out"))
    assert code == 2
    lines = [line for line in err.strip().splitlines() if line]
    assert len(lines) == 1, err
    assert field in lines[0] and words in lines[0]
    assert not (tmp_path / "out").exists()


_OK_CSV = b'mr,ref\n"name[Aromi], food[Chinese]","Aromi serves Chinese food."\n'


@pytest.mark.parametrize("train_csv, test_csv, extra, field", [
    (b'mr,ref\n"name[A]","A is"\n"name[B]"\n', _OK_CSV, (), "data.train_file"),  # a short row
    (b"mr,ref\n\xff\xfe,x\n", _OK_CSV, (), "data.train_file"),  # not UTF-8
    (b"mr,ref\n", _OK_CSV, (), "data.train_file"),  # only a header: nothing to train on
    # only a header: the test metrics would be NaN after the whole run
    (_OK_CSV, b"mr,ref\n\n", (), "data.test_file"),
    (_OK_CSV, _OK_CSV, ("data.tokenizer=gpt2", "data.tokenizer_path={empty}"),
     "data.tokenizer_path"),
    # a vocab.json that is not JSON: the Rust tokenizers library raises a bare Exception
    (_OK_CSV, _OK_CSV, ("data.tokenizer=gpt2", "data.tokenizer_path={garbage}"),
     "data.tokenizer_path"),
])
def test_bad_e2e_data_exits_2_with_one_line(tmp_path, capsys, train_csv, test_csv, extra,
                                            field):
    (tmp_path / "data").mkdir()
    (tmp_path / "empty").mkdir()
    (tmp_path / "garbage").mkdir()
    (tmp_path / "garbage" / "vocab.json").write_text("{not json")
    (tmp_path / "garbage" / "merges.txt").write_text("#version: 0.2\n")
    (tmp_path / "data" / "train.csv").write_bytes(train_csv)
    (tmp_path / "data" / "test.csv").write_bytes(test_csv)
    overrides = ["data.name=e2e", "data.tokenizer=bytes", f"data.path={tmp_path / 'data'}",
                 "data.train_file=train.csv", "data.test_file=test.csv",
                 "data.max_length=null",  # (tiny.yaml's 16 bytes would leave no target)
                 *(e.format(empty=tmp_path / "empty", garbage=tmp_path / "garbage")
                   for e in extra)]
    code, _, err = run_cli(capsys, "train", "--config", TINY, "--output-dir",
                           str(tmp_path / "out"), *overrides)
    assert code == 2
    lines = [line for line in err.strip().splitlines() if line]
    assert len(lines) == 1, err
    assert field in lines[0]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("args, words", [
    (("train", "--config", TINY, "--bogus"), ["--bogus"]),
    # said by the subcommand (it said "dptrain: error:", and "see dptrain --help")
    (("calibrate", "--epsilon", "1", "--delta", "1e-5", "--sample-rate", "0.1", "--steps", "2",
      "--bogus", "1"), ["dptrain calibrate: error: unrecognized arguments: --bogus 1",
                        "see dptrain calibrate --help"]),
    (("calibrate", "--epsilon", "1"), ["--delta", "--sample-rate", "--steps"]),
    (("frobnicate",), ["frobnicate"]),
    # a misspelt option written with '=' is an unknown option, not a config override
    (("train", "--config", TINY, "--ouput-dir=runs/x"), ["unrecognized", "--ouput-dir=runs/x"]),
    (("train", "--config", TINY, "privacy.steps=1", "-x=1"), ["unrecognized", "-x=1"]),
    # argparse kept the last of two: the run used the second config in silence
    (("train", "--config", TINY, "--config", TINY), ["--config given twice"]),
    (("plot", "--run", "a", "--output", "x.png", "--output", "y.png"), ["--output given twice"]),
])
def test_usage_errors_are_one_line_with_status_2(capsys, args, words):
    with pytest.raises(SystemExit) as e:
        main(list(args))
    assert e.value.code == 2
    err = capsys.readouterr().err
    lines = [line for line in err.strip().splitlines() if line]
    assert len(lines) == 1, err
    assert "error" in lines[0] and all(w in lines[0] for w in words)


@pytest.mark.parametrize("args", [("diagnose", "--run", ""), ("diagnose", "--checkpoint", " "),
                                  ("plot", "--run", "a", "--run", ""),
                                  ("audit", "--config", TINY, "--output", "")])
def test_an_empty_path_is_refused_not_read_as_the_current_directory(tmp_path, capsys,
                                                                    monkeypatch, args):
    # diagnose --run "" looked for ./checkpoints and would write ./diagnostics.json
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli(capsys, *args)
    option = args[-2]
    assert code == 2 and err.strip() == f"dptrain {args[0]}: error: {option}: is empty: give a path"
    assert not list(tmp_path.iterdir())


def test_missing_config_file_exits_2(tmp_path, capsys):
    code, _, err = run_cli(capsys, "train", "--config", str(tmp_path / "nope.yaml"))
    assert code == 2 and "config" in err and "not found" in err
    code, _, err = run_cli(capsys, "train", "--config", "")  # was ". is a directory"
    assert code == 2 and "config: is empty" in err
    # a directory given for the file was reported as "file not found" too
    code, _, err = run_cli(capsys, "train", "--config", str(tmp_path), "--output-dir",
                           str(tmp_path / "o"))
    assert code == 2 and "config" in err and "is a directory, not a file" in err
    assert not (tmp_path / "o").exists()


def test_a_plan_over_budget_is_refused_before_anything_is_written(tmp_path, capsys):
    code, _, err = run_cli(capsys, "train", "--config", TINY, "--output-dir", str(tmp_path / "o"),
                           "privacy.noise_multiplier=0.3", "privacy.epsilon=1.0")
    # sigma was set by the user: the error names it (a calibrated run would name privacy.steps)
    assert code == 2 and "privacy.noise_multiplier" in err and "budget" in err
    assert not (tmp_path / "o").exists()


def test_an_output_dir_that_cannot_be_made_is_refused_before_any_work(tmp_path, capsys,
                                                                       monkeypatch):
    import dptrain.trainer as trainer_module

    def never(*a, **k):
        raise AssertionError("the trainer was built before --output-dir was checked")

    monkeypatch.setattr(trainer_module, "Trainer", never)
    (tmp_path / "afile").write_text("x")
    for out in (str(tmp_path / "afile" / "sub"), ""):  # "" silently meant runs/tiny
        code, _, err = run_cli(capsys, "train", "--config", TINY, "--output-dir", out)
        lines = [line for line in err.strip().splitlines() if line]
        assert code == 2 and len(lines) == 1 and "output-dir" in lines[0], err
    assert (tmp_path / "afile").read_text() == "x"


@pytest.mark.parametrize("name, kind", [("checkpoints", "file"), ("final", "file"),
                                        ("metrics.jsonl", "dir"), ("summary.json", "dir"),
                                        ("secure_resumes.jsonl", "dir"), ("run.lock", "dir")])
@pytest.mark.parametrize("resume", [False, True])
def test_a_path_of_the_wrong_kind_in_the_output_dir_is_refused_before_any_work(
        tmp_path, capsys, monkeypatch, name, kind, resume):
    """A file named checkpoints raised FileExistsError (exit 1) at the first checkpoint, one
    named final after the whole run had trained; a folder named metrics.jsonl IsADirectoryError."""
    import dptrain.trainer as trainer_module

    def never(*a, **k):
        raise AssertionError("the trainer was built before the output dir was checked")

    monkeypatch.setattr(trainer_module, "Trainer", never)
    out = tmp_path / "run"
    out.mkdir()
    if kind == "file":
        (out / name).write_text("mine")
    else:
        (out / name).mkdir()
    before = sorted(p.name for p in out.iterdir())
    code, _, err = run_cli(capsys, "train", "--config", TINY, "--output-dir", str(out),
                           *(["--resume", "auto"] if resume else []))
    lines = [line for line in err.strip().splitlines() if line]
    assert code == 2 and len(lines) == 1 and "output-dir" in lines[0] and name in lines[0], err
    assert sorted(p.name for p in out.iterdir()) == before
    if kind == "file":
        assert (out / name).read_text() == "mine"


def test_an_output_dir_the_file_system_refuses_exits_2_before_any_release(capsys):
    """/proc refuses a new folder even to root, whom os.access lets through: a traceback and
    exit 1 from the trainer's mkdir before."""
    code, _, err = run_cli(capsys, "train", "--config", TINY, "--output-dir",
                           "/proc/dptrain-test-no-such-folder")
    lines = [line for line in err.strip().splitlines() if line]
    assert code == 2 and len(lines) == 1 and "output-dir" in lines[0], err


def test_a_finished_run_is_never_overwritten(tmp_path, capsys):
    out = tmp_path / "run"
    assert run_cli(capsys, "train", "--config", TINY, "--output-dir", str(out),
                   "train.checkpoint_every=0")[0] == 0
    before = (out / "summary.json").read_bytes()
    code, _, err = run_cli(capsys, "train", "--config", TINY, "--output-dir", str(out))
    assert code == 2 and "output-dir" in err
    assert (out / "summary.json").read_bytes() == before


def test_a_final_model_in_the_output_dir_is_not_overwritten(tmp_path, capsys):
    # a folder with only final/ (a copied model, or a run whose metrics were moved away)
    out = tmp_path / "run"
    (out / "final").mkdir(parents=True)
    (out / "final" / "model.safetensors").write_bytes(b"mine")
    code, _, err = run_cli(capsys, "train", "--config", TINY, "--output-dir", str(out))
    assert code == 2 and err.count("\n") == 1 and "output-dir" in err and "final/" in err
    assert (out / "final" / "model.safetensors").read_bytes() == b"mine"


@pytest.mark.parametrize("summary", ["{not json", '{"epsilon": 1}', "[1, 2]"])
def test_resume_auto_over_a_summary_without_its_config_exits_2(tmp_path, capsys, summary):
    # "nothing to do" only for a finished run whose config is this one: one that cannot be
    # read cannot be compared, and its folder may hold another run
    out = tmp_path / "run"
    out.mkdir()
    (out / "summary.json").write_text(summary)
    code, _, err = run_cli(capsys, "train", "--config", TINY, "--output-dir", str(out),
                           "--resume", "auto")
    assert code == 2 and err.count("\n") == 1 and "output-dir" in err and "summary.json" in err
    assert (out / "summary.json").read_text() == summary


def test_a_summary_that_is_not_a_regular_file_is_refused_not_read(tmp_path):
    # a FIFO named summary.json blocked --resume auto's read forever (red team)
    import os

    out = tmp_path / "run"
    out.mkdir()
    os.mkfifo(out / "summary.json")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "dptrain", "train", "--config", TINY,
                        "--output-dir", str(out), "--resume", "auto"], env=env,
                       capture_output=True, text=True, timeout=120)
    lines = [line for line in r.stderr.splitlines() if "error:" in line]
    assert r.returncode == 2 and len(lines) == 1 and "summary.json exists and is not a file" \
        in lines[0], r.stderr


@pytest.mark.parametrize("section, value", [("optim", [1]), ("data", "x"), ("model", [1])])
def test_resume_auto_over_a_summary_config_of_another_shape_exits_2(tmp_path, capsys, section,
                                                                   value):
    # its privacy settings this run's, a section of another shape: an AttributeError traceback
    out = tmp_path / "run"
    assert run_cli(capsys, "train", "--config", TINY, "--output-dir", str(out),
                   "train.checkpoint_every=0")[0] == 0
    summary = json.loads((out / "summary.json").read_text())
    summary["config"][section] = value
    (out / "summary.json").write_text(json.dumps(summary))
    before = (out / "summary.json").read_bytes()
    code, _, err = run_cli(capsys, "train", "--config", TINY, "--output-dir", str(out),
                           "--resume", "auto")
    assert code == 2 and err.count("\n") == 1 and "summary.json" in err, err
    assert (out / "summary.json").read_bytes() == before


@pytest.mark.parametrize("dry", [True, False])
def test_a_delta_at_or_above_one_over_n_is_warned_about(tmp_path, capsys, dry):
    # tiny.yaml trains on 256 examples: delta 1/256 allows publishing one in the clear
    args = ["train", "--config", TINY, "privacy.steps=1", *(["--dry-run"] if dry else [])]
    for delta, warned in (("0.00390625", True), ("0.0039", False), ("1e-5", False)):
        code, _, err = run_cli(capsys, *args, f"privacy.delta={delta}", "train.checkpoint_every=0",
                               f"--output-dir={tmp_path / delta}")
        assert code == 0, err
        lines = [x for x in err.splitlines() if "warning: privacy.delta" in x]
        assert len(lines) == int(warned), err
        if warned:
            assert "1/N = 1/256" in lines[0]
    # a smaller public N (privacy.dataset_size) does not hide it: the run samples from 256
    # examples; a larger one is the N checked
    for n, warned in (("100", "1/256"), ("1000", "1/1000")):
        code, _, err = run_cli(capsys, *args, "privacy.delta=0.005", "train.checkpoint_every=0",
                               f"privacy.dataset_size={n}", f"--output-dir={tmp_path / n}")
        lines = [x for x in err.splitlines() if "warning: privacy.delta" in x]
        assert code == 0 and len(lines) == 1 and f"1/N = {warned}" in lines[0], err


def test_a_dataset_size_sample_rate_or_noise_that_does_not_fit_is_warned_about(tmp_path, capsys):
    # tiny.yaml: 256 examples, q = 0.125; a public N within 10% of them is a public estimate
    for extra, warned in ((("privacy.dataset_size=240",), None),
                          (("privacy.dataset_size=1",), "divided by b = 1"),
                          (("privacy.dataset_size=1000",), "divided by b = 125, while q * "
                           "256 = 32 examples are expected in a batch (privacy.dataset_size=null "
                           "takes the training set's length)"),
                          (("privacy.sample_rate=0.001",), "expects 0.256 of the 256"),
                          (("privacy.sample_rate=0.004",), None),
                          (("privacy.epsilon=null", "privacy.noise_multiplier=0",
                            "privacy.accountant=rdp"), "epsilon is infinite"),
                          (("optim.lr=0", "optim.aux.lr=0"), "the model will not move"),
                          (("optim.lr=0",), None)):  # (the aux group still trains)
        code, _, err = run_cli(capsys, "train", "--config", TINY, "--dry-run", *extra,
                               f"--output-dir={tmp_path / 'out'}")
        lines = [x for x in err.splitlines() if any(
            f"warning: {k}" in x for k in ("privacy.dataset_size", "privacy.sample_rate",
                                             "privacy.noise_multiplier", "every parameter"))]
        assert code == 0 and len(lines) == (warned is not None), err
        assert warned is None or warned in lines[0], lines
    assert not (tmp_path / "out").exists()


def test_resume_with_a_changed_privacy_setting_exits_2(tmp_path, capsys):
    out = tmp_path / "run"
    assert run_cli(capsys, "train", "--config", TINY, "--output-dir", str(out),
                   "privacy.steps=2", "train.checkpoint_every=1")[0] == 0
    (out / "summary.json").unlink()
    code, _, err = run_cli(capsys, "train", "--config", TINY, "--output-dir", str(out),
                           "--resume", "auto", "privacy.steps=2", "privacy.clip_norm=2.0")
    assert code == 2 and "privacy.clip_norm" in err


def test_module_entry_point_runs_calibrate():
    out = subprocess.run([sys.executable, "-m", "dptrain", "calibrate", "--epsilon", "8",
                          "--delta", "1/84122", "--sample-rate", "0.01", "--steps", "100",
                          "--accountant", "rdp", "--json"],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    obj = json.loads(out.stdout.strip().splitlines()[-1])
    assert obj["epsilon"] <= 8.0 and obj["noise_multiplier"] > 0
    assert abs(obj["delta"] - 1 / 84122) < 1e-15


def test_the_summary_says_what_epsilon_means_for_the_seed(tmp_path, capsys):
    # A recorded seed determines the samples and the noise: epsilon is then an experiment's
    # number, not a guarantee against whoever holds the files. The run says so, once.
    code, _, err = run_cli(capsys, "train", "--config", TINY, "--output-dir", str(tmp_path / "a"),
                           "privacy.steps=1", "train.checkpoint_every=0")
    assert code == 0
    assert err.count("privacy.seed is set") == 1 and "secure_mode=true" in err
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert summary["guarantee"].startswith("experiment")
    assert summary["config"]["privacy"]["seed"] == 0
    code, _, err = run_cli(capsys, "train", "--config", TINY, "--output-dir", str(tmp_path / "b"),
                           "privacy.steps=1", "train.checkpoint_every=0",
                           "privacy.secure_mode=true", "privacy.seed=null")
    assert code == 0 and "privacy.seed is set" not in err
    summary = json.loads((tmp_path / "b" / "summary.json").read_text())
    assert "never written" in summary["guarantee"]
    assert summary["config"]["privacy"]["seed"] is None


def test_a_run_without_noise_writes_strict_json(tmp_path, capsys):
    # sigma 0: epsilon is infinite, which Python's json writes as a bare Infinity (rejected by
    # JSON.parse, jq, and json.loads with parse_constant); written as the string "inf"
    out = _tiny_run(tmp_path, capsys, "privacy.noise_multiplier=0", "privacy.epsilon=null")

    def refuse(name):
        raise ValueError(f"non-standard JSON constant {name}")

    summary = json.loads((out / "summary.json").read_text(), parse_constant=refuse)
    assert summary["epsilon"] == "inf"
    assert summary["calibrated_with"] is None  # (sigma given, not calibrated)
    rows = [json.loads(line, parse_constant=refuse)
            for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["epsilon"] for r in rows] == ["inf"] * 4


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_summary_reports_the_plan_of_the_run_and_its_public_seed(tmp_path, capsys):
    # every number a different value: the run seed (5) is not privacy.seed (0), C = 0.5 is not
    # q = 0.125, N = 300 given for b (floor(0.125 * 300) = 37) is not the 256 examples loaded
    from dptrain.privacy.accounting import calibrate_noise_multiplier

    out = _tiny_run(tmp_path, capsys, "seed=5", "privacy.clip_norm=0.5",
                    "privacy.dataset_size=300")
    s = json.loads((out / "summary.json").read_text())
    sigma = calibrate_noise_multiplier(8.0, 1e-5, 0.125, 4, accountant="rdp")
    assert s["noise_multiplier"] == pytest.approx(sigma, rel=1e-12)
    assert s["sample_rate"] == 0.125 and s["clip_norm"] == 0.5 and s["delta"] == 1e-5
    assert s["dataset_size"] == 300 and s["expected_batch_size"] == 37
    assert s["accountant"] == s["calibrated_with"] == "rdp" and s["steps"] == 4
    assert s["seed"] == 5 and s["config"]["seed"] == 5 and s["config"]["privacy"]["seed"] == 0
    assert s["epsilon"] == pytest.approx(opacus_epsilon("rdp", sigma, 0.125, 4, 1e-5), rel=1e-9)
    assert s["epsilon"] <= 8.0


def test_every_metrics_row_has_the_epsilon_spent_by_its_step(tmp_path, capsys):
    out = _tiny_run(tmp_path, capsys, "privacy.epsilon=null", "privacy.noise_multiplier=1.1")
    rows = _rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert r["epsilon"] == pytest.approx(
            opacus_epsilon("rdp", 1.1, 0.125, r["step"], 1e-5), rel=1e-9), r["step"]
    assert all(r["epsilon"] > 0 and math.isfinite(r["train_loss"]) for r in rows)


def test_log_every_writes_every_kth_step_and_always_the_last(tmp_path, capsys):
    # 4 steps, a row every 3: steps 3 and 4 (the last, even though 4 % 3 != 0)
    out = _tiny_run(tmp_path, capsys, "privacy.epsilon=null", "privacy.noise_multiplier=1.1",
                    "train.log_every=3")
    rows = _rows(out)
    assert [r["step"] for r in rows] == [3, 4]
    assert rows[-1]["epsilon"] == pytest.approx(opacus_epsilon("rdp", 1.1, 0.125, 4, 1e-5),
                                                rel=1e-9)


def test_eval_every_adds_test_metrics_to_its_rows_and_the_last_to_the_summary(tmp_path, capsys):
    # eval_every 2 over 4 steps: test metrics in row 2 (prefixed test_); the last step's are the
    # summary's final metrics, not repeated in row 4; rows 1 and 3 have none
    out = _tiny_run(tmp_path, capsys, "privacy.epsilon=null", "privacy.noise_multiplier=1.1",
                    "train.eval_every=2")
    rows = _rows(out)
    tested = [r["step"] for r in rows if any(k.startswith("test_") for k in r)]
    assert tested == [2]
    assert rows[1]["test_nll_per_token"] > 0
    assert "nll_per_token" not in rows[1]
    s = json.loads((out / "summary.json").read_text())
    assert s["test_nll_per_token"] == s["metrics"]["nll_per_token"] > 0


def test_checkpoint_every_also_checkpoints_the_last_step(tmp_path, capsys):
    from dptrain import checkpoint as ckpt

    out = tmp_path / "run"
    code, _, err = run_cli(capsys, "train", "--config", TINY, "--output-dir", str(out),
                           "privacy.epsilon=null", "privacy.noise_multiplier=1.1",
                           "train.checkpoint_every=3", "train.keep_checkpoints=5")
    assert code == 0, err
    assert ckpt.complete_steps(out) == [3, 4]


def test_summary_records_the_git_commit(monkeypatch):
    import subprocess

    import dptrain.trainer as trainer_mod

    calls = []

    def fake_run(args, **kw):
        calls.append((args, kw.get("cwd")))
        return subprocess.CompletedProcess(args, 0, stdout="0123abcd\n", stderr="")

    monkeypatch.setattr(trainer_mod.subprocess, "run", fake_run)
    assert trainer_mod.git_commit() == "0123abcd"
    assert calls[0][0] == ["git", "rev-parse", "HEAD"]
    assert Path(calls[0][1]) == Path(trainer_mod.__file__).resolve().parent

    def no_git(args, **kw):
        raise FileNotFoundError("git")

    monkeypatch.setattr(trainer_mod.subprocess, "run", no_git)
    assert trainer_mod.git_commit() is None



def test_a_diverged_run_says_once_that_its_releases_may_be_noise_alone(tmp_path, capsys):
    """lr 1e30 (accepted: finite in float32) sends the loss to NaN at step 2; every example's
    clip factor is then 0 and the releases are noise alone. The run said nothing (exit 0, NaN
    metrics); now one note on stderr, once, and none in secure mode (where the loss is not
    shown) or in a run whose loss stays finite."""
    code, _, err = run_cli(capsys, "train", "--config", TINY, "--output-dir",
                           str(tmp_path / "nan"), "privacy.steps=3", "optim.lr=1e30")
    notes = [x for x in err.splitlines() if "training loss is nan" in x]
    assert code == 0 and len(notes) == 1 and "clip factor 0" in notes[0]
    code, _, err = run_cli(capsys, "train", "--config", TINY, "--output-dir",
                           str(tmp_path / "secure"), "privacy.steps=3", "optim.lr=1e30",
                           "privacy.secure_mode=true", "privacy.seed=null")
    assert code == 0 and "training loss is" not in err
    code, _, err = run_cli(capsys, "train", "--config", TINY, "--output-dir",
                           str(tmp_path / "fine"), "privacy.steps=3")
    assert code == 0 and "training loss is" not in err


@pytest.mark.parametrize("name", ["model.safetensors", "generations.jsonl",
                                  "last_iterate_generations.jsonl", "last_iterate.safetensors"])
def test_a_path_of_the_wrong_kind_in_final_is_refused_before_any_work(tmp_path, capsys, name):
    """Red-team: _check_layout checks the output dir's own names only. A folder under final/
    where the run writes (or removes) a file, e.g. final/generations.jsonl, was found only by
    _write_final after the whole run and its final evaluation: IsADirectoryError traceback,
    exit 1, no summary.json, and final/<name>.tmp left behind. (A fresh start refuses a
    non-empty final/; --resume auto, whose checkpoint may be the last step, goes on.)"""
    out = tmp_path / "run"
    (out / "final" / name).mkdir(parents=True)
    code, _, err = run_cli(capsys, "train", "--config", TINY, "--output-dir", str(out),
                           "privacy.steps=1", "--resume", "auto")
    lines = [line for line in err.strip().splitlines() if "error" in line or "Error" in line]
    assert code == 2 and len(lines) == 1 and "output-dir" in lines[0] and name in lines[0], err
    assert sorted(p.name for p in (out / "final").iterdir()) == [name]


def test_resume_auto_without_a_checkpoint_does_not_overwrite_a_final_model(tmp_path, capsys):
    """Red-team: test_a_final_model_in_the_output_dir_is_not_overwritten, with --resume auto
    (what a requeue script always passes): no checkpoint, "starting afresh", and the folder's
    final/model.safetensors (a copied model) was replaced. (Judgment call: a checkpoint_every=0
    run of its own killed between its export and summary.json looks the same.)"""
    out = tmp_path / "run"
    (out / "final").mkdir(parents=True)
    (out / "final" / "model.safetensors").write_bytes(b"mine")
    code, _, err = run_cli(capsys, "train", "--config", TINY, "--output-dir", str(out),
                           "privacy.steps=1", "--resume", "auto")
    assert code == 2 and "output-dir" in err and "final/" in err, err
    assert (out / "final" / "model.safetensors").read_bytes() == b"mine"


def test_sharding_asked_of_one_rank_is_said_to_shard_nothing(tmp_path, capsys):
    code, _, err = run_cli(capsys, "train", "--config", TINY, "--output-dir",
                           str(tmp_path / "run"), "--dry-run", "performance.sharding=fsdp")
    assert code == 0 and "performance.sharding=fsdp with one rank: nothing is sharded" in err
    code, _, err = run_cli(capsys, "train", "--config", TINY, "--output-dir",
                           str(tmp_path / "run"), "--dry-run")
    assert code == 0 and "nothing is sharded" not in err


@pytest.mark.parametrize("steps, said", [(1, "done: 1 step, epsilon "),
                                         (2, "done: 2 steps, epsilon ")])
def test_the_last_line_counts_its_steps_in_english(tmp_path, capsys, steps, said):
    code, out, err = run_cli(capsys, "train", "--config", TINY, "--output-dir",
                             str(tmp_path / "run"), "train.checkpoint_every=0",
                             f"privacy.steps={steps}")
    assert code == 0, err
    assert out.splitlines()[-1].startswith(said), out
