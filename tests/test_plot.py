"""`dptrain plot`: a run's metrics.jsonl as curves (metric_series) and a PNG."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dptrain.cli import main
from dptrain.diagnostics.plotting import metric_series

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")
PNG = b"\x89PNG\r\n\x1a\n"


def test_series_group_the_row_keys_into_panels():
    rows = [
        {"step": 2, "train_loss": 2.5, "lr": {"matrices": 0.02, "others": 0.01}, "epsilon": 2.0,
         "time": 1.0, "peak_memory_gib": 0.5, "test_accuracy": 0.4, "test_loss": 1.5,
         "test_examples": 64},
        {"step": 1, "train_loss": 3.0, "lr": {"matrices": 0.01, "others": 0.005},
         "epsilon": 1.0, "time": 0.5, "peak_memory_gib": 0.25},
        # a repeated step: the later row counts; "nan" (strict JSON) and flags are not drawn
        {"step": 2, "train_loss": "nan", "lr": {"matrices": 0.02, "others": 0.01},
         "epsilon": 2.5, "time": 1.1, "peak_memory_gib": 0.5, "test_accuracy": 0.45,
         "test_loss": 1.4, "test_examples": 64, "flag": True},
    ]
    s = metric_series(rows)
    assert list(s) == ["loss", "learning rate", "epsilon spent", "peak memory (GiB)",
                       "test accuracy"]
    assert s["loss"] == {"train_loss": ([1], [3.0]), "test_loss": ([2], [1.4])}
    assert s["learning rate"] == {"matrices": ([1, 2], [0.01, 0.02]),
                                  "others": ([1, 2], [0.005, 0.01])}
    assert s["epsilon spent"] == {"epsilon": ([1, 2], [1.0, 2.5])}
    assert s["test accuracy"] == {"test_accuracy": ([2], [0.45])}
    # the final evaluation of summary.json joins the test curves at the last step
    final = {"steps": 3, "metrics": {"accuracy": 0.5, "loss": 1.3, "examples": 64}}
    s = metric_series(rows, final)
    assert s["test accuracy"] == {"test_accuracy": ([2, 3], [0.45, 0.5])}
    assert s["loss"]["test_loss"] == ([2, 3], [1.4, 1.3])
    assert s["epsilon spent"] == {"epsilon": ([1, 2], [1.0, 2.5])}
    # with a parameter EMA the final metrics hold the last iterate's too: its loss joins the
    # losses, its test-set size gets no panel
    s = metric_series(rows, {"steps": 3, "metrics": {"loss": 1.3, "examples": 64,
                                                     "last_iterate_loss": 1.35,
                                                     "last_iterate_examples": 64}})
    assert s["loss"]["test_last_iterate_loss"] == ([3], [1.35])
    assert not any("examples" in panel for panel in s)
    # E2E/DART: both BLEUs share a panel, also the last iterate's; the number of generated
    # prompts (the trainer's key) is a count, not a curve
    s = metric_series(rows, {"steps": 3, "metrics": {
        "bleu": 58.9, "bleu_uncased": 60.5, "rouge_l": 62.8, "generated_prompts": 630,
        "last_iterate_bleu": 57.0, "last_iterate_generated_prompts": 630}})
    assert s["test BLEU"] == {"test_bleu": ([3], [58.9]), "test_bleu_uncased": ([3], [60.5]),
                              "test_last_iterate_bleu": ([3], [57.0])}
    assert s["test rouge_l"] == {"test_rouge_l": ([3], [62.8])}
    assert not any("prompts" in panel for panel in s)
    # one learning rate (not a mapping) is one curve
    assert metric_series([{"step": 1, "lr": 0.1}]) == {"learning rate": {"lr": ([1], [0.1])}}


def test_gpu_telemetry_is_drawn_beside_the_memory_peak_and_in_panels_of_its_own():
    rows = [{"step": s, "peak_memory_gib": 1.0 * s, "gpu_memory_used_gib": 1.5 * s,
             "gpu_util_pct": 80.0 + s, "gpu_power_w": 300.0 + s} for s in (1, 2)]
    s = metric_series(rows)
    assert list(s) == ["peak memory (GiB)", "GPU utilisation (%)", "GPU power (W)"]
    assert s["peak memory (GiB)"] == {"peak_memory_gib": ([1, 2], [1.0, 2.0]),
                                      "gpu_memory_used_gib": ([1, 2], [1.5, 3.0])}
    assert s["GPU utilisation (%)"] == {"gpu_util_pct": ([1, 2], [81.0, 82.0])}
    assert s["GPU power (W)"] == {"gpu_power_w": ([1, 2], [301.0, 302.0])}


def _run(capsys, *args) -> tuple[int, str, str]:
    code = main(list(args))
    cap = capsys.readouterr()
    return code, cap.out, cap.err


def test_plot_draws_a_real_run_and_keeps_an_existing_figure(tmp_path, capsys):
    out = tmp_path / "run"
    code, _, err = _run(capsys, "train", "--config", TINY, "--output-dir", str(out),
                        "train.eval_every=2", "train.checkpoint_every=0")
    assert code == 0, err
    code, stdout, _ = _run(capsys, "plot", "--run", str(out))
    assert code == 0 and (out / "metrics.png").read_bytes().startswith(PNG)
    assert "5 panels: loss, learning rate, epsilon spent, peak memory (GiB), test perplexity" \
        in stdout
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    s = metric_series(rows, summary)
    assert s["loss"]["train_loss"] == ([1, 2, 3, 4], [r["train_loss"] for r in rows])
    # evaluations at step 2 (eval_every) and the final one at step 4
    assert s["loss"]["test_nll_per_token"] == (
        [2, 4], [rows[1]["test_nll_per_token"], summary["metrics"]["nll_per_token"]])
    # nothing written before is lost: an existing figure needs --force
    before = (out / "metrics.png").stat().st_mtime_ns
    code, _, err = _run(capsys, "plot", "--run", str(out))
    assert code == 2 and err.count("\n") == 1 and "--output" in err and "--force" in err
    assert (out / "metrics.png").stat().st_mtime_ns == before
    other = tmp_path / "figs" / "m.png"
    code, _, _ = _run(capsys, "plot", "--run", str(out), "--output", str(other))
    assert code == 0 and other.read_bytes().startswith(PNG)
    pdf = tmp_path / "figs" / "m.pdf"  # the format follows the suffix
    assert _run(capsys, "plot", "--run", str(out), "--output", str(pdf))[0] == 0
    assert pdf.read_bytes().startswith(b"%PDF")
    # never the run's own files, even with --force
    for name in ("metrics.jsonl", "summary.json"):
        before = (out / name).read_bytes()
        code, _, err = _run(capsys, "plot", "--run", str(out), "--output", str(out / name),
                            "--force")
        assert code == 2 and "--output: must end in .png, .pdf or .svg" in err
        assert (out / name).read_bytes() == before


def test_a_figure_the_file_system_refuses_exits_2_naming_output(tmp_path, capsys, monkeypatch):
    import errno

    import dptrain.diagnostics.plotting as plotting

    def refused(series, path, **kw):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(plotting, "plot_metrics", refused)
    run = _fake_run(tmp_path, [ROW % 1, ROW % 2])
    code, _, err = _run(capsys, "plot", "--run", str(run))
    assert code == 2 and err.count("\n") == 1
    assert f"--output: cannot write {run / 'metrics.png'}: Read-only file system" in err
    assert "printed above" not in err  # (diagnose's message: plot prints nothing before)


def _fake_run(tmp_path, lines: list[str], name: str = "run") -> Path:
    run = tmp_path / name
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(x + "\n" for x in lines))
    return run


ROW = '{"step": %d, "train_loss": 2.0, "epsilon": 1.0}'


def test_a_line_being_written_is_left_out(tmp_path, capsys):
    run = _fake_run(tmp_path, [ROW % 1, ROW % 2, '{"step": 3, "train_lo'])
    code, stdout, err = _run(capsys, "plot", "--run", str(run))
    assert code == 0 and "metrics.jsonl:3 is incomplete" in err
    assert "2 panels: loss, epsilon spent" in stdout


def test_a_last_line_cut_inside_a_character_is_left_out(tmp_path, capsys):
    run = _fake_run(tmp_path, [ROW % 1, ROW % 2])
    with open(run / "metrics.jsonl", "ab") as f:  # "é" is 2 bytes: the first one written
        f.write('{"step": 3, "note": "é'.encode()[:-1])
    code, stdout, err = _run(capsys, "plot", "--run", str(run))
    assert code == 0 and "metrics.jsonl:3 is incomplete" in err


def test_metrics_that_are_not_text_exit_2_naming_run(tmp_path, capsys):
    # it was a UnicodeDecodeError traceback
    run = _fake_run(tmp_path, [])
    (run / "metrics.jsonl").write_bytes(b"\xff\xfe\x00garbage\n" + (ROW % 2).encode() + b"\n")
    code, _, err = _run(capsys, "plot", "--run", str(run))
    assert code == 2 and err.count("\n") == 1 and "--run" in err
    assert "metrics.jsonl:1 is not a JSON line" in err
    assert not (run / "metrics.png").exists()


@pytest.mark.parametrize("lines,what", [
    ([ROW % 1, "not json", ROW % 3], "metrics.jsonl:2 is not a JSON line"),
    ([ROW % 1, '{"epsilon": 1.0}'], "metrics.jsonl:2 is not a metrics row"),
    ([], "has no numbers to draw"),
])
def test_bad_metrics_exit_2_naming_run(tmp_path, capsys, lines, what):
    run = _fake_run(tmp_path, lines)
    code, _, err = _run(capsys, "plot", "--run", str(run))
    assert code == 2 and err.count("\n") == 1 and "--run" in err and what in err, err
    assert not (run / "metrics.png").exists()


@pytest.mark.parametrize("lines,summary,what", [
    ([ROW % 1, '{"step": "x", "epsilon": 1.0}'], None, "metrics.jsonl:2 is not a metrics row"),
    ([ROW % 1, '{"step": null}'], None, "metrics.jsonl:2 is not a metrics row"),
    ([ROW % 1, '"a string"'], None, "metrics.jsonl:2 is not a metrics row"),
    ([ROW % 1], "{not json", "summary.json is unreadable"),
    ([ROW % 1], "[1, 2]", "summary.json is not a run summary"),
    ([ROW % 1], '{"epsilon": 1.0}', "summary.json is not a run summary"),
    ([ROW % 1], '{"steps": 1, "metrics": "x"}', "summary.json is not a run summary"),
])
def test_malformed_run_files_exit_2_naming_run(tmp_path, capsys, lines, summary, what):
    run = _fake_run(tmp_path, lines)
    if summary is not None:
        (run / "summary.json").write_text(summary)
    code, _, err = _run(capsys, "plot", "--run", str(run))
    assert code == 2 and err.count("\n") == 1 and "--run" in err and what in err, err
    assert not (run / "metrics.png").exists()


def test_a_directory_without_metrics_exits_2(tmp_path, capsys):
    code, _, err = _run(capsys, "plot", "--run", str(tmp_path / "nothing"))
    assert code == 2 and "--run: no metrics.jsonl" in err


def test_values_that_are_not_finite_are_named_on_stderr_not_dropped_silently(tmp_path, capsys):
    # a run that diverged plotted as a single point, with no word of why
    rows = [ROW % 1] + ['{"step": %d, "train_loss": "nan", "epsilon": 1.0}' % s
                        for s in range(2, 9)] + ['{"step": 9, "train_loss": "inf"}']
    run = _fake_run(tmp_path, rows)
    (run / "summary.json").write_text('{"steps": 9, "epsilon": 1.0, "metrics": {"loss": "nan"}}')
    code, _, err = _run(capsys, "plot", "--run", str(run))
    assert code == 0
    assert "run: train_loss is not a finite number at steps 2-9 (8 rows); not drawn" in err
    assert "run: test_loss is not a finite number at step 9; not drawn" in err
    left_out: dict = {}
    metric_series([json.loads(r) for r in rows], None, left_out)
    assert left_out == {"train_loss": list(range(2, 10))}


def test_a_run_without_noise_is_not_asked_whether_it_diverged(tmp_path, capsys):
    # (epsilon is infinite by design there; "did the run diverge?" sent users looking)
    run = _fake_run(tmp_path, ['{"step": %d, "train_loss": 3.0, "epsilon": "inf"}' % s
                               for s in (1, 2, 3)])
    code, _, err = _run(capsys, "plot", "--run", str(run))
    assert code == 0
    assert ("run: epsilon is infinite at steps 1-3 (3 rows): the run adds no noise "
            "(privacy.noise_multiplier 0, or below 1e-100); not drawn") in err
    assert "diverge" not in err


def test_several_runs_share_the_panels_each_curve_named_by_its_run(tmp_path, capsys):
    a = _fake_run(tmp_path, [ROW % 1, ROW % 2], "muon")
    b = _fake_run(tmp_path, ['{"step": 1, "train_loss": 3.0, "epsilon": 0.5}'], "sgd")
    out = tmp_path / "both.svg"
    code, stdout, err = _run(capsys, "plot", "--run", str(a), "--run", str(b), "--output",
                             str(out))
    assert code == 0, err
    assert "2 panels: loss, epsilon spent" in stdout
    svg = out.read_text()
    for label in ("muon: train_loss", "sgd: train_loss", "muon: epsilon", "sgd: epsilon"):
        assert label in svg
    # the curves are each run's own
    import dptrain.diagnostics.plotting as plotting

    drawn = {}
    real = plotting.plot_metrics
    try:
        plotting.plot_metrics = lambda series, path, **kw: drawn.update(series)
        assert _run(capsys, "plot", "--run", str(a), str(b), "--output", str(out),
                    "--force")[0] == 0
    finally:
        plotting.plot_metrics = real
    assert drawn["loss"] == {"muon: train_loss": ([1, 2], [2.0, 2.0]),
                             "sgd: train_loss": ([1], [3.0])}
    # several runs need --output (the first run's folder is not theirs); one run twice is
    # refused, not drawn as two
    code, _, err = _run(capsys, "plot", "--run", str(a), str(b))
    assert code == 2 and "--output: needed with several runs" in err
    code, _, err = _run(capsys, "plot", "--run", str(a), str(a / ".." / "muon"), "--output",
                        str(tmp_path / "x.png"))
    assert code == 2 and "is given twice" in err and not (tmp_path / "x.png").exists()



def test_runs_that_share_a_name_keep_their_own_curves(tmp_path, capsys, monkeypatch):
    # c/foo, a symlink foo -> a/run and b/run: labels by the path as typed made "foo" twice,
    # and one run's curves replaced the other's (a red team)
    import dptrain.diagnostics.plotting as plotting

    runs = []
    for parent, step_loss in (("a", 1.0), ("b", 2.0), ("c", 3.0)):
        (tmp_path / parent).mkdir()
        name = "foo" if parent == "c" else "run"
        runs.append(_fake_run(tmp_path / parent, ['{"step": 1, "train_loss": %s}' % step_loss],
                              name))
    (tmp_path / "foo").symlink_to(tmp_path / "a" / "run")
    drawn = {}
    monkeypatch.setattr(plotting, "plot_metrics",
                        lambda series, path, **kw: drawn.update(series, kw=kw))
    monkeypatch.chdir(tmp_path)
    code, _, err = _run(capsys, "plot", "--run", "c/foo", "foo", "b/run", "--output", "x.png")
    assert code == 0, err
    assert sorted(vs[0] for _, vs in drawn["loss"].values()) == [1.0, 2.0, 3.0]
    assert len(drawn["kw"]["runs"]) == len(set(drawn["kw"]["runs"])) == 3


def test_a_run_without_rows_yet_is_left_out_of_several_with_a_note(tmp_path, capsys):
    a = _fake_run(tmp_path, [ROW % 1], "a")
    empty = _fake_run(tmp_path, [], "starting")  # metrics.jsonl opened, no row written yet
    code, _, err = _run(capsys, "plot", "--run", str(a), str(empty), "--output",
                        str(tmp_path / "x.png"))
    assert code == 0 and "starting: " in err and "left out" in err
    other = _fake_run(tmp_path, [], "starting2")
    code, _, err = _run(capsys, "plot", "--run", str(empty), str(other), "--output",
                        str(tmp_path / "y.png"))
    assert code == 2 and "--run: none of the runs has numbers to draw yet" in err


def test_twelve_runs_each_get_a_colour_and_the_title_its_room(tmp_path, capsys, recwarn):
    runs = [str(_fake_run(tmp_path, [ROW % 1, ROW % 2], f"seed{i}")) for i in range(12)]
    out = tmp_path / "many.svg"
    code, _, err = _run(capsys, "plot", "--run", *runs, "--output", str(out))
    assert code == 0, err
    assert not [w for w in recwarn if "ight layout" in str(w.message)]
    svg = out.read_text()
    assert "seed11: train_loss" in svg


def test_a_matplotlib_that_refuses_its_settings_is_one_line_naming_the_option(tmp_path):
    # MPLBACKEND=bogus was a ValueError traceback, in diagnose and audit too (after the work)
    import os
    import subprocess
    import sys

    run = _fake_run(tmp_path, [ROW % 1])
    env = {**os.environ, "MPLBACKEND": "bogus"}
    p = subprocess.run([sys.executable, "-m", "dptrain", "plot", "--run", str(run)],
                       capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
    assert "--output: matplotlib refuses its settings" in p.stderr


def test_the_step_axis_has_whole_steps_only(tmp_path, monkeypatch):
    # four steps drew ticks at 1.5, 2.5, ...; one evaluated step an axis from 3.8 to 4.2
    import dptrain.diagnostics.plotting as plotting

    seen = {}
    real_save = plotting._save

    def save(fig, path):
        fig.canvas.draw()  # (the ticks are placed at drawing time)
        seen["ticks"] = [[t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
                         for ax in fig.axes if ax.get_visible()]
        return real_save(fig, path)

    monkeypatch.setattr(plotting, "_save", save)
    plotting.plot_metrics({"loss": {"train_loss": ([1, 2, 3, 4], [3.0, 2.9, 2.8, 2.7])},
                           "test": {"test_nll": ([4], [2.5])}}, tmp_path / "m.png")
    assert all(seen["ticks"]) and len(seen["ticks"]) == 2
    assert all(float(t).is_integer() for ticks in seen["ticks"] for t in ticks), seen


def test_blank_lines_in_the_metrics_are_skipped(tmp_path, capsys):
    run = _fake_run(tmp_path, [ROW % 1, "", "  ", ROW % 2])
    code, stdout, err = _run(capsys, "plot", "--run", str(run))
    assert code == 0, err
    assert "2 panels: loss, epsilon spent" in stdout and err == ""


def test_one_run_is_drawn_with_its_metric_names_and_no_run_legend(tmp_path, capsys, monkeypatch):
    # the run's name prefixes the curves and the legend only when several runs share panels;
    # a summary without final metrics (an integer epsilon too) gives the title
    import dptrain.diagnostics.plotting as plotting

    drawn = {}
    monkeypatch.setattr(plotting, "plot_metrics",
                        lambda series, path, **kw: drawn.update(series=series, path=path, **kw))
    run = _fake_run(tmp_path, [ROW % 1, '{"step": 2, "train_loss": 1.5, "epsilon": 1.5}'])
    (run / "summary.json").write_text('{"steps": 3, "epsilon": 2}')
    code, _, err = _run(capsys, "plot", "--run", str(run))
    assert code == 0, err
    assert drawn["series"] == {"loss": {"train_loss": ([1, 2], [2.0, 1.5])},
                               "epsilon spent": {"epsilon": ([1, 2], [1.0, 1.5])}}
    assert drawn["runs"] is None and drawn["path"] == run / "metrics.png"
    assert drawn["title"] == "run: step 3, epsilon 2.000"
    # a run given as "." is named by its folder, not by the empty name of "."
    monkeypatch.chdir(run)
    code, _, err = _run(capsys, "plot", "--run", ".", "--force")
    assert code == 0, err
    assert drawn["title"] == "run: step 3, epsilon 2.000"
