"""``train.generate_prompts``: BLEU and ROUGE-L of greedy generations at a run's final
evaluation (E2E and DART), on E2E-format files written here (the suite must not need
../shared/data)."""

from __future__ import annotations

import csv
import json
import math

from pathlib import Path

import pytest
from _threads import _one_thread  # noqa: F401  (autouse: one torch thread)

from dptrain.cli import main

CONFIGS = Path(__file__).resolve().parents[1] / "configs"

MRS = ["name[Aromi], eatType[coffee shop]", "name[Zizzi], food[Italian]",
       "name[Wildwood], area[riverside]", "name[Cotto], priceRange[cheap]"]
REFS = {mr: [f"{mr.split('[')[1].split(']')[0]} is a nice place number {k}." for k in range(2)]
        for mr in MRS}


def _write_e2e(folder) -> None:
    folder.mkdir()
    for name, rows in (("devset.csv", [(mr, ref) for mr in MRS for ref in REFS[mr]] * 8),
                       ("testset_w_refs.csv", [(mr, ref) for mr in MRS for ref in REFS[mr]])):
        with open(folder / name, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["mr", "ref"])
            w.writerows(rows)


def _args(tmp_path, *extra: str) -> list[str]:
    return ["train", "--config", str(CONFIGS / "e2e_small.yaml"), "--output-dir", str(tmp_path / "out"),
            f"data.path={tmp_path / 'e2e'}", "privacy.steps=2", "privacy.sample_rate=0.5",
            "privacy.noise_multiplier=1.0", "privacy.accountant=rdp", "data.max_length=64",
            "model.n_positions=64", *extra]


def test_the_final_evaluation_scores_the_final_models_generations(tmp_path):
    """summary.json's test_bleu and test_rouge_l are generate_and_score's on the model written
    to final/ (the trained one, not an earlier state), over the first generate_prompts MRs."""
    from safetensors.torch import load_model

    from dptrain.config import from_dict
    from dptrain.data import build_data
    from dptrain.eval.text import generate_and_score
    from dptrain.models import build_model
    from dptrain.trainer import RunConfig

    _write_e2e(tmp_path / "e2e")
    assert main(_args(tmp_path, "train.generate_prompts=3", "train.max_new_tokens=12")) == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["test_generated_prompts"] == 3
    assert summary["metrics"]["generated_prompts"] == 3

    cfg = from_dict(RunConfig, summary["config"])
    task = build_data(cfg.data, seed=cfg.seed)
    model = build_model(cfg.model, task.info)
    initial = generate_and_score(model.eval(), task.tokenizer,
                                 task.test.references_by_mr(max_prompts=3), max_new_tokens=12,
                                 return_texts=True)
    load_model(model, str(tmp_path / "out" / "final" / "model.safetensors"))
    want = generate_and_score(model.eval(), task.tokenizer,
                              task.test.references_by_mr(max_prompts=3), max_new_tokens=12,
                              return_texts=True)
    assert want["texts"] != initial["texts"]  # training changed the generations
    for k in ("bleu", "bleu_uncased", "rouge_l"):
        assert math.isfinite(summary[f"test_{k}"])
        assert summary[f"test_{k}"] == pytest.approx(want[k], abs=1e-9), k
    # the scored texts are in final/generations.jsonl, with their MRs and references
    lines = (tmp_path / "out" / "final" / "generations.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    refs = task.test.references_by_mr(max_prompts=3)
    assert [r["mr"] for r in rows] == list(refs)
    assert [r["generation"] for r in rows] == want["texts"]
    assert [r["references"] for r in rows] == [list(v) for v in refs.values()]
    assert not (tmp_path / "out" / "final" / "last_iterate_generations.jsonl").exists()


def test_with_a_parameter_ema_both_models_generations_are_written(tmp_path):
    from dptrain.eval.text import score_texts

    _write_e2e(tmp_path / "e2e")
    assert main(_args(tmp_path, "train.generate_prompts=2", "train.max_new_tokens=8",
                      "optim.ema_decay=0.5")) == 0
    out = tmp_path / "out"
    summary = json.loads((out / "summary.json").read_text())
    for name, prefix in (("generations.jsonl", "test_"),
                         ("last_iterate_generations.jsonl", "test_last_iterate_")):
        rows = [json.loads(line) for line in (out / "final" / name).read_text().splitlines()]
        assert len(rows) == 2
        scores = score_texts([r["generation"] for r in rows], [r["references"] for r in rows])
        assert summary[f"{prefix}rouge_l"] == pytest.approx(scores["rouge_l"], abs=1e-9)
        assert summary[f"{prefix}bleu"] == pytest.approx(scores["bleu"], abs=1e-9)


def test_an_earlier_attempt_s_generations_do_not_outlive_its_settings(tmp_path):
    """A run killed after its generations were written, before summary.json, and resumed
    without generations (or without an EMA) left texts that its summary does not score."""
    _write_e2e(tmp_path / "e2e")
    assert main(_args(tmp_path, "train.generate_prompts=2", "train.max_new_tokens=4",
                      "optim.ema_decay=0.5")) == 0
    final = tmp_path / "out" / "final"
    assert (final / "generations.jsonl").exists()
    assert (final / "last_iterate_generations.jsonl").exists()
    assert (final / "last_iterate.safetensors").exists()
    (tmp_path / "out" / "summary.json").unlink()  # the attempt that was killed
    assert main(_args(tmp_path, "--resume", "auto")) == 0  # no generations, no EMA
    assert sorted(p.name for p in final.iterdir() if "generations" in p.name) == []
    assert not (final / "last_iterate.safetensors").exists()


def test_null_generates_every_test_mr_and_zero_none(tmp_path):
    _write_e2e(tmp_path / "e2e")
    assert main(_args(tmp_path, "train.generate_prompts=null", "train.max_new_tokens=4")) == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["test_generated_prompts"] == len(MRS)
    (tmp_path / "out2").mkdir()
    args = _args(tmp_path)
    args[args.index("--output-dir") + 1] = str(tmp_path / "out2")
    assert main(args) == 0
    summary = json.loads((tmp_path / "out2" / "summary.json").read_text())
    assert "test_bleu" not in summary and "generated_prompts" not in summary["metrics"]
    assert not (tmp_path / "out2" / "final" / "generations.jsonl").exists()


@pytest.mark.parametrize("override,field", [
    ("train.generate_prompts=-1", "train.generate_prompts"),
    ("train.max_new_tokens=0", "train.max_new_tokens"),
])
def test_bad_settings_exit_2_naming_the_field(tmp_path, capsys, override, field):
    _write_e2e(tmp_path / "e2e")
    assert main(_args(tmp_path, override)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and field in err[0], err
    assert not (tmp_path / "out").exists()


def test_data_without_references_is_refused(tmp_path, capsys):
    code = main(["train", "--config", str(CONFIGS / "tiny.yaml"), "--output-dir", str(tmp_path / "o"),
                 "train.generate_prompts=2"])
    err = capsys.readouterr().err
    assert code == 2 and "train.generate_prompts" in err and "synthetic_lm" in err
    assert not (tmp_path / "o").exists()


def _run_to_summary(rank: int, world: int, folder: str, extra: tuple) -> dict:
    """A whole run (``Trainer.run``: training, the final evaluation with generation) on this
    rank; its summary."""
    from dptrain.config import load
    from dptrain.trainer import RunConfig, Trainer

    args = _args(Path(folder), "train.generate_prompts=null", "train.max_new_tokens=12",
                 "train.progress=false", "train.checkpoint_every=0", *extra)
    overrides = args[args.index("--output-dir") + 2:]
    t = Trainer(load(RunConfig, CONFIGS / "e2e_small.yaml", overrides),
                Path(folder) / f"out{world}" if rank == 0 else None)
    return t.run()


@pytest.mark.distributed
def test_two_fsdp_ranks_score_the_generations_of_the_one_rank_run(tmp_path):
    """Every rank generates (FSDP2's forwards are collective): 2 sharded ranks finish with the
    1-rank run's test NLL, BLEU and ROUGE-L over every test MR. Trained without noise for 40
    steps, so that the greedy generations score well above 0."""
    from dptrain.parallel.dist import spawn

    _write_e2e(tmp_path / "e2e")
    learn = ("privacy.noise_multiplier=0", "privacy.epsilon=null", "privacy.steps=40",
             "optim.lr=0.05", "optim.aux.lr=0.05")
    one = spawn(_run_to_summary, 1, str(tmp_path), learn)[0]
    two = spawn(_run_to_summary, 2, str(tmp_path), (*learn, "performance.sharding=fsdp"))
    assert one["test_generated_prompts"] == len(MRS)
    assert one["test_bleu"] > 5 and one["test_rouge_l"] > 20
    for s in two:  # every rank reports the same scores
        assert s["test_generated_prompts"] == len(MRS)
        for k in ("nll_per_token", "bleu", "rouge_l"):
            assert s[f"test_{k}"] == pytest.approx(one[f"test_{k}"], rel=1e-5, abs=1e-9), k
