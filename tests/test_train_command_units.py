"""The guards of `dptrain train` (dptrain/commands/train.py) one at a time, without a run:
the boundaries and refusals that the end-to-end tests reach only on one side."""

from __future__ import annotations

import argparse
import json
import os

import pytest

from dptrain.commands import train as cmd
from dptrain.config import ConfigError, to_dict
from dptrain.trainer import RunConfig


def test_a_ctrl_c_before_a_branch_s_first_checkpoint_names_the_checkpoint_it_branched_from(
        tmp_path):
    where = cmd._interrupted_where(tmp_path, "/runs/a/checkpoints/step-00000002")
    assert "start again from /runs/a/checkpoints/step-00000002" in where, where
    assert "--resume /runs/a/checkpoints/step-00000002" in where, where
    assert "from step 0" in cmd._interrupted_where(tmp_path, "auto")


def test_a_boolean_step_is_no_step():
    assert cmd._row_step({"step": True}) == float("inf")
    assert cmd._row_step({"step": 3}) == 3


def test_a_resume_keeps_the_checkpoint_s_own_row_and_rows_without_a_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": 1}, {"step": 2}, {"step": 3}, {"note": "mine"}, {"step": "x"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cmd._drop_metrics_after(path, 2)
    assert [json.loads(x) for x in path.read_text().splitlines()] == [
        {"step": 1}, {"step": 2}, {"note": "mine"}, {"step": "x"}]


def _saved(**changes) -> dict:
    saved = to_dict(RunConfig())
    for dotted, value in changes.items():
        *parents, leaf = dotted.split("__")
        d = saved
        for p in parents:
            d = d[p]
        d[leaf] = value
    return saved


def _refusal(saved: dict, cfg=None) -> str | None:
    try:
        cmd._check_same_training(saved, cfg or RunConfig(), "out")
    except ConfigError as e:
        return e.field
    return None


def test_a_finished_run_s_settings_compare_as_numbers_and_name_what_differs():
    # (the default lr, 0.002, has no integer spelling: set one that has)
    cfg = RunConfig()
    cfg.optim.lr = 2.0
    saved = _saved(optim__lr=2)  # summary.json's JSON can hold an int where the run had 2.0
    assert isinstance(saved["optim"]["lr"], int) and _refusal(saved, cfg) is None
    assert _refusal(_saved(optim__lr=3), cfg) == "optim.lr"
    assert _refusal(_saved(optim__lr=RunConfig().optim.lr * 2)) == "optim.lr"
    assert _refusal(_saved(data__max_test_examples=7)) == "data.max_test_examples"
    assert _refusal(_saved(optim__filter__name="elsewhere")) == "optim.filter.name"


def test_a_setting_read_only_under_a_switch_is_compared_when_the_switch_is_on_in_either_run():
    cfg = RunConfig()
    assert not cfg.optim.ema_decay  # (the default: no EMA)
    # off in both: ema_start_step is never read, a difference is no refusal
    assert _refusal(_saved(optim__ema_start_step=cfg.optim.ema_start_step + 5)) is None
    # on in the finished run only: the switch itself is named, not the setting it guards
    assert _refusal(_saved(optim__ema_decay=0.9,
                           optim__ema_start_step=cfg.optim.ema_start_step + 5)) == "optim.ema_decay"
    # the switch sorts after what it guards ("gamma_muon" < "k_muon"): still the switch is named
    assert _refusal(_saved(optim__inner_momentum__k_muon=2,
                           optim__inner_momentum__gamma_muon=0.9)) == "optim.inner_momentum.k_muon"
    # generate_prompts null means all prompts: max_new_tokens is read
    cfg.train.generate_prompts = None
    assert _refusal(_saved(train__generate_prompts=None, train__max_new_tokens=3),
                    cfg) == "train.max_new_tokens"


def test_a_finished_run_with_another_group_is_refused():
    saved = _saved()
    saved["optim"]["groups"] = [{"pattern": "head", "optimizer": "adam", "lr": 0.1}]
    assert _refusal(saved) is not None and _refusal(saved).startswith("optim.groups[0].")


def test_a_dangling_link_or_a_fifo_where_a_run_writes_is_refused(tmp_path):
    (tmp_path / "checkpoints").symlink_to(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match="is not a directory"):
        cmd._check_layout(tmp_path)
    (tmp_path / "checkpoints").unlink()
    os.mkfifo(tmp_path / "metrics.jsonl")
    with pytest.raises(ConfigError, match="metrics.jsonl exists and is not a file"):
        cmd._check_layout(tmp_path)


def test_the_lock_file_is_opened_only_as_a_regular_file(tmp_path):
    (tmp_path / "target").write_text("keep")
    (tmp_path / "run.lock").symlink_to(tmp_path / "target")
    with pytest.raises(ConfigError, match="is a symbolic link"):
        cmd._open_lock_file(tmp_path / "run.lock", os.O_RDWR)
    assert (tmp_path / "target").read_text() == "keep"
    os.mkfifo(tmp_path / "fifo.lock")
    with pytest.raises(ConfigError, match="is not a regular file"):
        cmd._open_lock_file(tmp_path / "fifo.lock", os.O_RDONLY)


def _run_dir(tmp_path, finished: bool):
    run = tmp_path / "run"
    (run / "checkpoints" / "step-00000002").mkdir(parents=True)
    if finished:
        (run / "summary.json").write_text("{}")
    return run


@pytest.mark.parametrize("finished", [False, True])
def test_resume_of_a_run_directory_or_its_checkpoints_says_what_to_pass(tmp_path, finished):
    run = _run_dir(tmp_path, finished)
    for path, where in ((run, "a run directory"),
                        (run / "checkpoints", "a run's checkpoints/ directory")):
        with pytest.raises(ConfigError) as e:
            cmd._refuse_a_run_directory(path)
        assert e.value.field == "resume" and f"{path} is {where}" in e.value.message
        if finished:
            assert "(of a finished run)" in e.value.message and "branch" in e.value.message
        else:
            assert f"--resume auto --output-dir {run}" in e.value.message
    (run / "checkpoints" / "step-00000002" / "COMPLETE").write_text("{}")
    cmd._refuse_a_run_directory(run / "checkpoints" / "step-00000002")  # a checkpoint: passes


def test_secure_mode_refuses_a_checkpoint_moved_out_of_its_run(tmp_path):
    moved = tmp_path / "step-00000002"
    moved.mkdir()
    with pytest.raises(ConfigError, match="not in a run's checkpoints/ directory"):
        cmd._check_secure_resume(moved)


@pytest.mark.parametrize("config", ["a string", ["a", "list"], None])
def test_a_summary_whose_config_is_no_mapping_is_refused_as_unreadable(tmp_path, config):
    (tmp_path / "summary.json").write_text(json.dumps({"config": config}))
    args = argparse.Namespace(resume="auto")
    with pytest.raises(ConfigError, match="unreadable or holds no config"):
        cmd._look(tmp_path, RunConfig(), args)


def _checkpoints(run, *steps, marked=True):
    for step in steps:
        d = run / "checkpoints" / f"step-{step:08d}"
        d.mkdir(parents=True)
        if marked:
            (d / "COMPLETE").write_text("{}")
    return run / "checkpoints"


def test_resume_path_into_its_run_is_refused_only_over_later_checkpoints_or_a_summary(tmp_path):
    out = tmp_path / "run"
    ckpts = _checkpoints(out, 2, 3)
    with pytest.raises(ConfigError, match=r"holds checkpoints after step 2 \(step 3\)"):
        cmd._check_explicit_resume(out, ckpts / "step-00000002")
    cmd._check_explicit_resume(out, ckpts / "step-00000003")  # its own latest: continues
    (out / "summary.json").write_text("{}")
    with pytest.raises(ConfigError, match="already holds a finished run"):
        cmd._check_explicit_resume(out, ckpts / "step-00000003")


def test_what_counts_as_an_earlier_run_in_an_output_directory(tmp_path):
    assert not cmd._holds_a_run(tmp_path)
    (tmp_path / "final").mkdir()
    (tmp_path / "final" / "model.safetensors").write_text("")
    assert cmd._holds_a_run(tmp_path)
    (tmp_path / "final" / "model.safetensors").unlink()
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    assert cmd._holds_a_run(tmp_path)


def test_secure_resume_is_refused_after_any_later_output_of_its_run(tmp_path):
    run = tmp_path / "run"
    step2 = _checkpoints(run, 2) / "step-00000002"
    cmd._check_secure_resume(step2)  # nothing after step 2: free
    _checkpoints(run, 3, marked=False)  # written, its marker lost since: still a release
    with pytest.raises(ConfigError, match=r"after step 2 \(checkpoint step 3\)"):
        cmd._check_secure_resume(step2)
    (run / "checkpoints" / "step-00000003").rmdir()
    (run / "metrics.jsonl").write_text('{"step": 2}\n{"step": 3}\n')
    with pytest.raises(ConfigError, match=r"after step 2 \(metrics of step 3\)"):
        cmd._check_secure_resume(step2)
    (run / "metrics.jsonl").write_text('{"step": 2}\n')
    cmd._check_secure_resume(step2)
    (run / "summary.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"after step 2 \(summary.json\)"):
        cmd._check_secure_resume(step2)


@pytest.mark.parametrize("dry_run", [False, True])
def test_ctrl_c_says_where_to_go_on_from_only_in_a_run_that_writes(tmp_path, monkeypatch,
                                                                     capsys, dry_run):
    def interrupted(args, stop):
        stop.out = tmp_path  # (the output directory is this run's)
        raise KeyboardInterrupt

    monkeypatch.setattr(cmd, "_run", interrupted)
    args = argparse.Namespace(dry_run=dry_run, resume=None)
    if dry_run:  # a dry run wrote nothing: the plain "interrupted" of dptrain.cli
        with pytest.raises(KeyboardInterrupt):
            cmd.run(args)
        assert "interrupted" not in capsys.readouterr().err
    else:
        assert cmd.run(args) == 130
        assert "dptrain train: interrupted; no complete checkpoint" in capsys.readouterr().err
