"""`dptrain diagnose`: geometry probes of a checkpoint on the public test split (issue 3 item 8,
issue 4 item 4), checked against an independent torch.func computation."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from _forge import forged

from dptrain.cli import main
from dptrain.commands import check_new_files
from dptrain.config import ConfigError
from dptrain.diagnostics import (
    PRIVACY_NOTE,
    clipped_mean,
    cosine_error,
    normalized_residual,
    polar_error,
)

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")
# A fixed sigma (no calibration) keeps the runs to a few seconds.
PRIVACY = ["privacy.epsilon=null", "privacy.noise_multiplier=1.0"]
FAST = ["train.log_every=100"]  # epsilon only at the end
IM = ["optim.inner_momentum.k_muon=2", "optim.inner_momentum.gamma_muon=0.9"]
M = "12"


def run_cli(capsys, *args) -> tuple[int, str, str]:
    capsys.readouterr()  # drop what a module fixture's training run printed (its seed note)
    code = main([str(a) for a in args])
    cap = capsys.readouterr()
    return code, cap.out, cap.err


def _train(directory: Path, *overrides: str) -> Path:
    code = main(["train", "--config", TINY, "--output-dir", str(directory), *PRIVACY, *FAST,
                 *overrides])
    assert code == 0
    return directory


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory) -> Path:
    """DP-Muon, 2 steps, a checkpoint after each: no inner-momentum history."""
    return _train(tmp_path_factory.mktemp("plain") / "run", "privacy.steps=2")


@pytest.fixture(scope="module")
def im_run(tmp_path_factory) -> Path:
    """DP-Muon-IM with K_M = 2: after 3 steps the checkpoint holds theta_{t-1}, theta_{t-2}."""
    return _train(tmp_path_factory.mktemp("im") / "run", "privacy.steps=3", *IM)


# -------------------------------------------------------------------------- independent reference

class _LossOf(nn.Module):
    def __init__(self, model, loss_fn):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, batch):
        return self.loss_fn(self.model, batch)


def _reference(run_dir: Path, *overrides: str):
    """The run rebuilt by the Trainer (not by the probes' loader), its checkpoint, and a
    function giving example i's full-model gradient at any parameter values via torch.func."""
    from dptrain import checkpoint as ckpt
    from dptrain.config import load
    from dptrain.trainer import RunConfig, Trainer

    cfg = load(RunConfig, TINY, [*PRIVACY, *overrides])
    trainer = Trainer(cfg, None)
    path = ckpt.find_latest(run_dir)
    ckpt.load(trainer, path)
    # float64: the polar factor needs the matrices' exact rank (a c_proj gradient's null
    # direction, computed in float32, is rounding noise that polar() counts as a direction)
    trainer.model.double().eval()
    state = torch.load(path / "state.pt", map_location="cpu", weights_only=False)
    wrap = _LossOf(trainer.model, trainer.task.loss_fn)
    current = {n: p.detach() for n, p in trainer.named_params}

    def grad(index: int, values: dict | None = None) -> dict[str, torch.Tensor]:
        batch = trainer.task.test.collate(np.asarray([index]))
        params = {"model." + n: v.double() for n, v in (values or current).items()}
        g = torch.func.grad(lambda ps: torch.func.functional_call(wrap, ps, (batch,)).sum())(params)
        return {n[len("model."):]: v for n, v in g.items()}

    return trainer, state, grad


def _norm(g: dict[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float(v.double().square().sum()) for v in g.values()))


def _close(a, b, rel=1e-4, abs=1e-7) -> bool:
    return a == pytest.approx(b, rel=rel, abs=abs)


# -------------------------------------------------------------------------- the report

def test_diagnose_run_report_matches_independent_computation(plain_run, capsys):
    code, out, err = run_cli(capsys, "diagnose", "--run", plain_run, "--probe-examples", M)
    assert code == 0, err
    assert PRIVACY_NOTE in out and "PUBLIC test split" in out
    report = json.loads((plain_run / "diagnostics.json").read_text())
    assert report["privacy_note"] == PRIVACY_NOTE
    assert "public test split" in report["probe_note"]
    assert report["probe"]["split"] == "test" and report["probe"]["public"] is True
    assert report["probe"]["num_examples"] == int(M) and report["step"] == 2
    assert report["compare_im"] is None
    rel = report["release"]
    assert (rel["noise_multiplier"], rel["clip_norm"], rel["denominator"]) == (1.0, 1.0, 32)
    assert rel["noise_std"] == pytest.approx(1.0 / 32)

    trainer, _, grad = _reference(plain_run, "privacy.steps=2")
    muon = [n for g in trainer.optimizer.groups if g.config.optimizer == "muon"
            for n, p in g.named_params if p.dim() >= 2]
    assert list(report["matrices"]) == muon  # default: every Muon matrix, in model order
    for name, entry in report["matrices"].items():
        assert entry["optimizer"] == "muon"
        ref = entry["reference"]
        for key in ("frobenius_norm", "effective_rank", "spectral_gap", "wedin_threshold",
                    "expected_snr", "noise_op_norm"):
            assert key in ref
        cur = entry["candidates"]["current"]
        for key in ("polar_error", "cosine_error", "residual_norm", "sigma_lambda", "sigma_G",
                    "eta_R", "expected_snr", "effective_rank", "spectral_gap",
                    "wedin_threshold", "residual_bound"):
            assert key in cur, key
        assert cur["residual_norm"] <= cur["residual_bound"] * (1 + 1e-9)  # Proposition 1
        r, c = entry["matrix_shape"]
        noise_fro = 1.0 / 32 * math.sqrt(r * c)
        assert entry["expected_noise_frobenius"] == pytest.approx(noise_fro)
        assert cur["expected_snr"] == pytest.approx(cur["frobenius_norm"] / noise_fro)
        assert ref["expected_snr"] == pytest.approx(ref["frobenius_norm"] / noise_fro)

    # Independently: full-model per-example gradients by torch.func, lam from their norms.
    indices = report["probe"]["indices"]
    grads = [grad(i) for i in indices]
    lam = torch.tensor([min(1.0, 1.0 / _norm(g)) for g in grads], dtype=torch.float64)
    got = torch.tensor(report["clip_factors"]["current"]["lam"], dtype=torch.float64)
    assert torch.allclose(got, lam, rtol=1e-4), (got, lam)
    assert report["clip_factors"]["current"]["norms"][0] == pytest.approx(_norm(grads[0]), rel=1e-4)
    assert "transformer.h.0.attn.c_proj.weight" in muon  # rank-deficient (LayerNorm backward)
    for name in (muon[0], "transformer.h.0.attn.c_proj.weight", muon[-1]):
        G = torch.stack([g[name] for g in grads]).double()
        cur = report["matrices"][name]["candidates"]["current"]
        X = clipped_mean(G, lam)
        assert _close(cur["polar_error"], polar_error(X, G.mean(0)), rel=1e-3)
        assert _close(cur["cosine_error"], cosine_error(X, G.mean(0)), rel=1e-3)
        assert _close(cur["eta_R"], normalized_residual(G, lam), rel=1e-3)
        assert _close(report["matrices"][name]["reference"]["frobenius_norm"],
                      float(G.mean(0).norm()))


def test_clip_norm_probes_the_same_checkpoint_clipped_at_another_c(plain_run, tmp_path,
                                                                    capsys):
    # (the run's C = 1 clipped nothing of E2E's current-only query in BENCHMARKS' real check:
    # the geometry of clipping needs a smaller C, on the same checkpoint)
    out = tmp_path / "c.json"
    code, text, err = run_cli(capsys, "diagnose", "--run", plain_run, "--probe-examples", M,
                              "--clip-norm", " 1/20 ", "--output", out)
    assert code == 0, err
    assert "C 0.05 (--clip-norm; the run's C is 1), b 32" in text
    report = json.loads(out.read_text())
    rel = report["release"]
    assert (rel["clip_norm"], rel["run_clip_norm"]) == (0.05, 1.0)
    assert rel["noise_std"] == pytest.approx(1.0 * 0.05 / 32)
    _, _, grad = _reference(plain_run, "privacy.steps=2")
    grads = [grad(i) for i in report["probe"]["indices"]]
    lam = torch.tensor([min(1.0, 0.05 / _norm(g)) for g in grads], dtype=torch.float64)
    assert float(lam.max()) < 1  # every example clipped at this C
    got = torch.tensor(report["clip_factors"]["current"]["lam"], dtype=torch.float64)
    assert torch.allclose(got, lam, rtol=1e-4), (got, lam)
    name = next(iter(report["matrices"]))
    entry = report["matrices"][name]
    G = torch.stack([g[name] for g in grads]).double()
    X = clipped_mean(G, lam)
    assert _close(entry["candidates"]["current"]["polar_error"], polar_error(X, G.mean(0)),
                  rel=1e-3)
    r, c = entry["matrix_shape"]
    assert entry["expected_noise_frobenius"] == pytest.approx(0.05 / 32 * math.sqrt(r * c))
    # the run's own C, given as --clip-norm, is the plain report
    code, text, _ = run_cli(capsys, "diagnose", "--run", plain_run, "--probe-examples", M,
                            "--clip-norm", "1", "--output", tmp_path / "one.json")
    assert code == 0 and "--clip-norm" not in text
    assert json.loads((tmp_path / "one.json").read_text())["release"]["clip_norm"] == 1.0


def test_checkpoint_and_config_give_the_same_report(plain_run, tmp_path, capsys):
    from dptrain import checkpoint as ckpt

    out1 = tmp_path / "a.json"
    code, _, err = run_cli(capsys, "diagnose", "--run", plain_run, "--probe-examples", "4",
                           "--params", r"h\.1\.mlp", "--output", out1)
    assert code == 0, err
    out2 = tmp_path / "b.json"
    code, _, err = run_cli(capsys, "diagnose", "--checkpoint", ckpt.find_latest(plain_run),
                           "--config", TINY, *PRIVACY, "privacy.steps=2", "--probe-examples", "4",
                           "--params", r"h\.1\.mlp", "--output", out2)
    assert code == 0, err
    a, b = json.loads(out1.read_text()), json.loads(out2.read_text())
    assert b["config_source"] == TINY and a["config_source"] == "checkpoint"
    assert list(a["matrices"]) == ["transformer.h.1.mlp.c_fc.weight",
                                   "transformer.h.1.mlp.c_proj.weight"]
    assert a["matrices"] == b["matrices"] and a["clip_factors"] == b["clip_factors"]


def test_a_finished_run_diagnosed_at_an_older_checkpoint_says_so(plain_run, tmp_path, capsys):
    import shutil

    code, _, err = run_cli(capsys, "diagnose", "--run", plain_run, "--probe-examples", "2",
                           "--params", r"h\.1\.mlp\.c_fc", "--output", tmp_path / "a.json")
    assert code == 0 and "finished at step" not in err, err
    run = tmp_path / "run"  # its newest checkpoint is step 1 (one written on a stop signal)
    shutil.copytree(plain_run, run)
    shutil.rmtree(run / "checkpoints" / "step-00000002")
    code, _, err = run_cli(capsys, "diagnose", "--run", run, "--probe-examples", "2",
                           "--params", r"h\.1\.mlp\.c_fc", "--output", tmp_path / "b.json")
    assert code == 0, err
    assert "the run finished at step 2; its newest checkpoint, diagnosed here, is step 1" in err
    assert json.loads((tmp_path / "b.json").read_text())["step"] == 1


@pytest.mark.parametrize("spec", ["0,0.9", "2,0"])
def test_compare_im_with_k0_or_gamma0_equals_current(im_run, tmp_path, capsys, spec):
    out = tmp_path / "d.json"
    code, stdout, err = run_cli(capsys, "diagnose", "--run", im_run, "--probe-examples", "6",
                                "--compare-im", spec, "--output", out)
    assert code == 0, err
    report = json.loads(out.read_text())
    cf = report["clip_factors"]
    assert cf["im"]["lam"] == cf["current"]["lam"]
    for entry in report["matrices"].values():
        assert entry["candidates"]["im"] == entry["candidates"]["current"]
        assert entry["relative_difference"] == {"polar_error": 0.0, "cosine_error": 0.0,
                                                "eta_R": 0.0}
    assert "im/cur-1" in stdout
    assert "undef" not in stdout  # every difference is defined here


def test_relative_difference_against_a_rounding_level_zero_is_undefined():
    import math

    from dptrain.diagnostics.probes import _ratio_minus_one

    assert _ratio_minus_one(0.5, 0.25) == pytest.approx(1.0)
    assert _ratio_minus_one(0.2, 0.25) == pytest.approx(-0.2)
    assert _ratio_minus_one(0.44, 1.1e-8) == math.inf  # nothing clipped: cosine error ~1e-8
    assert _ratio_minus_one(3e-9, 1e-8) == 0.0
    assert math.isnan(_ratio_minus_one(math.nan, 0.3))


def test_undefined_relative_differences_are_named_not_printed_as_inf(im_run, tmp_path, capsys):
    """When the current-only value is 0 (nothing clipped: eta_R = 0) the IM/current ratio is
    undefined: the table says so instead of printing inf or nan."""
    import math

    from dptrain.commands.diagnose import UNDEFINED_NOTE, render

    out = tmp_path / "d.json"
    code, _, err = run_cli(capsys, "diagnose", "--run", im_run, "--probe-examples", "6",
                           "--compare-im", "2,0.9", "--output", out)
    assert code == 0, err
    report = json.loads(out.read_text())
    assert UNDEFINED_NOTE not in render(report)
    first = next(iter(report["matrices"].values()))
    first["relative_difference"]["eta_R"] = math.inf
    report["compare_im"]["relative_difference"]["eta_R"]["mean"] = math.nan
    text = render(report)
    assert UNDEFINED_NOTE in text
    rows = [line for line in text.splitlines() if "im/cur-1" in line or "IM vs current" in line]
    assert rows and not any(" inf" in r or "nan" in r for r in rows)
    assert any("undef" in r for r in rows)


def test_compare_im_matches_explicit_inner_momentum_query(im_run, tmp_path, capsys):
    """K_M = 2, gamma_M = 0.9 for the Muon matrices and K_A = 1, gamma_A = 0.5 for the rest:
    the IM query of each example at theta_t, theta_{t-1}, theta_{t-2} from the checkpoint's
    history, clipped as one query, against an explicit torch.func computation."""
    out = tmp_path / "im.json"
    # c_proj's gradients are rank-deficient (the next LayerNorm's backward), c_fc's are not
    names = ["transformer.h.0.mlp.c_fc.weight", "transformer.h.0.mlp.c_proj.weight"]
    code, stdout, err = run_cli(capsys, "diagnose", "--run", im_run, "--probe-examples", "8",
                                "--compare-im", "2,0.9,1,0.5", "--params", r"h\.0\.mlp\.c_",
                                "--output", out)
    assert code == 0, err
    report = json.loads(out.read_text())
    im = report["compare_im"]
    assert (im["k_muon"], im["gamma_muon"], im["k_other"], im["gamma_other"]) == (2, 0.9, 1, 0.5)
    assert im["history_states"] == 2
    am = [1 / 2.71, 0.9 / 2.71, 0.81 / 2.71]
    aa = [1 / 1.5, 0.5 / 1.5]
    assert im["alpha_muon"] == pytest.approx(am) and im["alpha_other"] == pytest.approx(aa)

    trainer, state, grad = _reference(im_run, "privacy.steps=3", *IM)
    history = state["optimizer"]["history"]["states"]
    assert len(history) == 2
    muon = {n for g in trainer.optimizer.groups if g.config.optimizer == "muon"
            for n, _ in g.named_params}
    assert im["other_parameters"] == sum(1 for n, _ in trainer.named_params if n not in muon)
    assert im["other_parameters"] > 0
    indices = report["probe"]["indices"]
    G_cur, G_im, lam_cur, lam_im = {n: [] for n in names}, {n: [] for n in names}, [], []
    for i in indices:
        per_state = [grad(i)] + [grad(i, h) for h in history]
        u = {n: sum((am[j] if n in muon else (aa[j] if j < len(aa) else 0.0)) * per_state[j][n]
                    for j in range(3)) for n in per_state[0]}
        for name in names:
            G_cur[name].append(per_state[0][name])
            G_im[name].append(u[name])
        lam_cur.append(min(1.0, 1.0 / _norm(per_state[0])))
        lam_im.append(min(1.0, 1.0 / _norm(u)))
    lam_cur = torch.tensor(lam_cur, dtype=torch.float64)
    lam_im = torch.tensor(lam_im, dtype=torch.float64)
    got = torch.tensor(report["clip_factors"]["im"]["lam"], dtype=torch.float64)
    assert torch.allclose(got, lam_im, rtol=1e-4), (got, lam_im)
    assert not torch.allclose(lam_im, lam_cur, rtol=1e-3)  # the history matters here

    assert list(report["matrices"]) == names
    for name in names:
        entry = report["matrices"][name]
        Gc, Gi = torch.stack(G_cur[name]), torch.stack(G_im[name])
        reference = Gc.mean(0)  # the unclipped CURRENT-gradient mean, for both queries
        for q, G, lam in (("current", Gc, lam_cur), ("im", Gi, lam_im)):
            c = entry["candidates"][q]
            X = clipped_mean(G, lam)
            assert _close(c["polar_error"], polar_error(X, reference), rel=1e-3), (name, q)
            assert _close(c["cosine_error"], cosine_error(X, reference), rel=1e-3), (name, q)
            assert _close(c["eta_R"], normalized_residual(G, lam), rel=1e-3), (name, q)
        for k in ("polar_error", "cosine_error", "eta_R"):
            c = entry["candidates"]
            assert entry["relative_difference"][k] == pytest.approx(
                c["im"][k] / c["current"][k] - 1)
    for k in ("polar_error", "cosine_error", "eta_R"):
        per_matrix = [report["matrices"][n]["relative_difference"][k] for n in names]
        assert im["relative_difference"][k]["mean"] == pytest.approx(sum(per_matrix) / 2)


def test_library_chunking_gives_the_same_report(im_run):
    """The probes as a library; a memory budget of one byte processes one matrix at a time."""
    from dptrain import checkpoint as ckpt
    from dptrain.diagnostics.probes import ImQuery, diagnose, load_run

    rng = torch.get_rng_state()
    run = load_run(ckpt.find_latest(im_run))
    assert torch.equal(torch.get_rng_state(), rng)  # loading leaves the global RNG alone
    assert run.step == 3 and len(run.history) == 2 and not run.model.training
    kwargs = dict(probe_examples=3, params=r"h\.1\.attn", compare_im=ImQuery(1, 0.9))
    whole, spectra = diagnose(run, **kwargs)
    one_by_one, _ = diagnose(run, max_bytes=1, **kwargs)
    assert whole["matrices"] == one_by_one["matrices"]
    kinds = ("reference", "current", "im")
    assert set(spectra) == {(n, k) for n in whole["matrices"] for k in kinds}


def test_plot_and_overwrite_protection(plain_run, tmp_path, capsys):
    png = tmp_path / "spectra.png"
    js = tmp_path / "r.json"
    args = ["diagnose", "--run", plain_run, "--probe-examples", "3", "--params", r"h\.0\.attn",
            "--output", js, "--plot", png]
    code, out, err = run_cli(capsys, *args)
    assert code == 0, err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    before = js.read_text()
    code, _, err = run_cli(capsys, *args)
    assert code == 2 and "--output" in err and "--force" in err  # refuses, names the option
    assert js.read_text() == before
    code, _, err = run_cli(capsys, *args, "--force")
    assert code == 0, err
    js.unlink()
    code, _, err = run_cli(capsys, *args)
    assert code == 2 and "--plot" in err and not js.exists()


def test_output_paths_are_checked_before_the_work(plain_run, tmp_path, capsys, monkeypatch):
    import dptrain.diagnostics.probes as probes

    def never(*a, **k):
        raise AssertionError("the run was loaded before the output paths were checked")

    monkeypatch.setattr(probes, "load_run", never)
    (tmp_path / "afile").write_text("x")
    same = tmp_path / "same.json"
    summary = Path(plain_run) / "summary.json"
    before = summary.read_bytes()
    exported = (Path(plain_run) / "final" / "hf" / "config.json").read_bytes()
    config = tmp_path / "config.json"  # (JSON is YAML: a config the report could replace)
    config.write_text(json.dumps({"optim": {"preset": "gpt2"}}))
    for extra, option in [(["--output", tmp_path / "afile" / "r.json"], "--output"),
                          (["--output", tmp_path / "ok.json",  # not the run's default file
                            "--plot", tmp_path / "afile" / "sub" / "p.png"], "--plot"),
                          (["--output", same, "--plot", same], "--plot"),  # PNG over the JSON
                          # each file named for what it holds: JSON in a .png, a PNG in a .txt
                          (["--output", tmp_path / "r.png"], "--output"),
                          (["--output", same, "--plot", tmp_path / "p.txt"], "--plot"),
                          # never the run's own summary, even with --force
                          (["--output", summary, "--force"], "--output"),
                          # nor a file of its exported model, nor its --config input
                          (["--output", Path(plain_run) / "final" / "hf" / "config.json",
                            "--force"], "--output"),
                          (["--output", config, "--force", "--config", config], "--output")]:
        code, _, err = run_cli(capsys, "diagnose", "--run", plain_run, "--probe-examples", "2",
                               *extra)
        lines = [line for line in err.strip().splitlines() if line]
        assert code == 2 and len(lines) == 1 and option in lines[0], err
    assert not same.exists() and (tmp_path / "afile").read_text() == "x"
    assert summary.read_bytes() == before
    assert (Path(plain_run) / "final" / "hf" / "config.json").read_bytes() == exported
    assert json.loads(config.read_text()) == {"optim": {"preset": "gpt2"}}


def test_a_mapping_override_of_a_checkpoints_section_keeps_its_other_keys():
    """As on the command line of train: ``data={max_test_examples: 7}`` sets that key. Here,
    without --config, it used to replace the checkpoint's whole data section (data.name fell
    back to its default, e2e)."""
    from dptrain.config import load
    from dptrain.diagnostics.probes import _build_config
    from dptrain.trainer import RunConfig, to_dict

    saved = to_dict(load(RunConfig, TINY))
    cfg = _build_config(saved, None, ["data={max_test_examples: 7}"])
    assert cfg.data.max_test_examples == 7 and cfg.data.name == saved["data"]["name"]
    assert cfg.data.name != to_dict(RunConfig())["data"]["name"]


def test_relocated_settings_are_reported(plain_run, tmp_path, capsys):
    js = tmp_path / "r.json"
    code, _, err = run_cli(capsys, "diagnose", "--run", plain_run, "--probe-examples", "2",
                           "--params", r"h\.0\.attn\.c_attn", "--output", js,
                           "data.max_test_examples=7", "performance.device=cpu")
    assert code == 0, err
    assert "data.max_test_examples: null -> 7" in err and "held out" in err
    report = json.loads(js.read_text())
    assert report["relocated"] == ["data.max_test_examples: null -> 7"]
    assert report["overrides"] == ["data.max_test_examples=7", "performance.device=cpu"]
    code, _, err = run_cli(capsys, "diagnose", "--run", plain_run, "--probe-examples", "2",
                           "--params", r"h\.0\.attn\.c_attn", "--output", js, "--force")
    assert code == 0 and "held out" not in err
    assert json.loads(js.read_text())["relocated"] == []


# -------------------------------------------------------------------------- mistakes: exit 2

@pytest.mark.parametrize("which, args, option", [
    ("none", ["--run", "{missing}"], "--run"),
    ("none", ["--checkpoint", "{missing}"], "--checkpoint"),
    ("empty", ["--run", "{empty}"], "--run"),
    ("plain", ["--checkpoint", "{run}"], "--checkpoint"),  # a run dir, not a checkpoint
    ("plain", ["--run", "{run}", "--params", "no_such_matrix"], "--params"),
    ("plain", ["--run", "{run}", "--params", "(unclosed"], "--params"),
    ("plain", ["--run", "{run}", "--params", "wte"], "--params"),  # AdamW, not Muon
    ("plain", ["--run", "{run}", "--compare-im", "4"], "--compare-im"),
    ("plain", ["--run", "{run}", "--compare-im", "a,0.9"], "--compare-im"),
    ("plain", ["--run", "{run}", "--compare-im", "2,1.5"], "--compare-im"),
    ("plain", ["--run", "{run}", "--compare-im=-1,0.5"], "--compare-im"),
    ("plain", ["--run", "{run}", "--compare-im", "-1,0.5"], "--compare-im"),
    ("plain", ["--run", "{run}", "--compare-im", "2,0.9,1"], "--compare-im"),
    ("plain", ["--run", "{run}", "--compare-im", "1,0.9"], "--compare-im"),  # no history
    ("im", ["--run", "{run}", "--compare-im", "3,0.9"], "--compare-im"),  # 2 states < 3
    ("im", ["--run", "{run}", "--compare-im", "1,0.5,3,0.5"], "--compare-im"),
    ("im", ["--run", "{run}", "--compare-im", "1,0.5,3,0.5"], "k_other"),  # K_A is short
    ("plain", ["--run", "{run}", "--probe-examples", "0"], "--probe-examples"),
    ("plain", ["--run", "{run}", "--probe-examples", "many"], "--probe-examples"),
    ("plain", ["--run", "{run}", "--config", "{missing}"], "--config"),
    ("plain", ["--run", "{run}", "--config", "{empty}"], "is a directory, not a file"),
    ("plain", ["--run", "{run}", "privacy.clip_norm=2"], "privacy.clip_norm"),
    ("plain", ["--run", "{run}", "privacy.clip_norm=2"], "give --clip-norm"),
    ("plain", ["--run", "{run}", "--clip-norm", "0"], "--clip-norm: must be finite and > 0"),
    ("plain", ["--run", "{run}", "--clip-norm", "-1"], "--clip-norm"),
    ("plain", ["--run", "{run}", "--clip-norm", "nan"], "--clip-norm"),
    ("plain", ["--run", "{run}", "--clip-norm", "inf"], "--clip-norm"),
    ("plain", ["--run", "{run}", "--clip-norm", "small"], "--clip-norm: expected a number"),
    ("plain", ["--run", "{run}", "--clip-norm", "1e-300"], "float32's smallest normal"),
    ("plain", ["--run", "{run}", "--clip-norm", "1e300"], "--clip-norm: sigma * C = 1 * 1e+300"),
    ("plain", ["--run", "{run}", "--clip-norm", "1/0"], "--clip-norm: expected a number"),
    ("plain", ["--run", "{run}", "--clip-norm", "0.5", "privacy.clip_norm=0.5"],
     "leave it as the checkpoint's: --clip-norm sets the probes' C"),
    ("plain", ["--run", "{run}", "seed=-1"], "seed"),
])
def test_mistakes_exit_2_with_one_line_naming_the_option(request, tmp_path, capsys, which, args,
                                                         option):
    run_dir = {"plain": "plain_run", "im": "im_run"}.get(which)
    run_dir = request.getfixturevalue(run_dir) if run_dir else None
    (tmp_path / "empty").mkdir()
    subs = {"missing": tmp_path / "missing", "empty": tmp_path / "empty", "run": run_dir}
    argv = [a.format(**subs) for a in args]
    out = tmp_path / "never.json"
    if "--probe-examples" not in argv:
        argv += ["--probe-examples", "2"]
    code, _, err = run_cli(capsys, "diagnose", *argv, "--output", out)
    assert code == 2
    lines = [line for line in err.strip().splitlines() if line]
    assert len(lines) == 1, err
    assert option in lines[0], lines[0]
    assert "resume" not in lines[0], lines[0]  # (the config checks are a resume's too)
    assert not out.exists()


@pytest.mark.parametrize("which, k", [("plain", "1,0.9"), ("im", "3,0.9")])
def test_a_history_too_short_is_refused_before_any_forward(request, tmp_path, capsys,
                                                           monkeypatch, which, k):
    """docs/diagnostics.md: a history shorter than K is checked before any work. It used to be
    refused after a forward and backward of every probe example."""
    from dptrain.diagnostics import probes

    def computed(*a, **kw):
        raise AssertionError("clip factors computed before the history was checked")

    monkeypatch.setattr(probes, "clip_factors", computed)
    run_dir = request.getfixturevalue(f"{which}_run")
    code, _, err = run_cli(capsys, "diagnose", "--run", run_dir, "--compare-im", k,
                           "--probe-examples", "2", "--output", tmp_path / "never.json")
    assert code == 2 and "--compare-im" in err and "past states" in err
    assert not (tmp_path / "never.json").exists()


# -------------------------------------------------------------------------- pure helpers

def test_probe_indices_are_evenly_spaced_over_the_whole_split():
    from dptrain.diagnostics.probes import probe_indices

    assert probe_indices(10, 4).tolist() == [0, 3, 6, 9]
    # 0, 63/11, 2*63/11, ... rounded: first and last example always included
    assert probe_indices(64, 12).tolist() == [0, 6, 11, 17, 23, 29, 34, 40, 46, 52, 57, 63]
    assert probe_indices(5, 12).tolist() == [0, 1, 2, 3, 4]  # at most the split, no repeats
    assert probe_indices(7, 1).tolist() == [0]


def test_lam_stats_by_hand():
    """lam = 1 is not clipped; min, mean and fraction of the clip factors."""
    from dptrain.diagnostics.probes import _lam_stats

    norms = torch.tensor([0.5, 2.0, 1.0, 4.0], dtype=torch.float64)
    lam = torch.tensor([1.0, 0.5, 1.0, 0.25], dtype=torch.float64)
    st = _lam_stats(norms, lam)
    assert st["min_lambda"] == 0.25
    assert st["mean_lambda"] == pytest.approx(2.75 / 4)
    assert st["fraction_clipped"] == 0.5
    assert st["lam"] == [1.0, 0.5, 1.0, 0.25] and st["norms"] == [0.5, 2.0, 1.0, 4.0]


def test_spectra_for_plot_keeps_three_matrices_and_the_last_shared_segment():
    from dptrain.diagnostics.probes import spectra_for_plot

    names = ["transformer.h.0.attn.c_attn.weight", "transformer.h.0.mlp.c_fc.weight",
             "transformer.h.1.mlp.c_fc.weight", "transformer.h.1.mlp.c_proj.weight"]
    spectra = {(n, k): torch.eye(2) for n in names for k in ("reference", "current", "im")}
    curves, left_out = spectra_for_plot(spectra)
    assert left_out == 1
    expected = [f"{short}: {label}"
                for short in ("h.0.attn.c_attn.weight", "h.0.mlp.c_fc.weight", "h.1.mlp.c_fc.weight")
                for label in ("unclipped mean", "current clipped mean", "im clipped mean")]
    assert list(curves) == expected
    one, left = spectra_for_plot({(names[0], "reference"): torch.eye(2)})
    assert list(one) == [f"{names[0]}: unclipped mean"] and left == 0


def test_muon_matrices_are_in_model_order_with_their_group_optimizer():
    """Model order, not name order (h.10 after h.2) nor group order; 1-D parameters left out."""
    from dptrain.diagnostics.probes import muon_matrices

    P = {n: torch.zeros(shape) for n, shape in [("h.2.w", (2, 2)), ("h.10.w", (2, 2)),
                                                 ("h.2.b", (2,)), ("wte", (3, 2)), ("a.w", (2, 3))]}
    model_order = ["h.2.w", "h.10.w", "h.2.b", "wte", "a.w"]
    groups = [SimpleNamespace(config=SimpleNamespace(optimizer="muon_bc"),
                              named_params=[("a.w", P["a.w"])]),
              SimpleNamespace(config=SimpleNamespace(optimizer="adamw"),
                              named_params=[("wte", P["wte"])]),
              SimpleNamespace(config=SimpleNamespace(optimizer="muon"),
                              named_params=[(n, P[n]) for n in ("h.10.w", "h.2.w", "h.2.b")])]
    run = SimpleNamespace(optimizer=SimpleNamespace(groups=groups,
                                                    named_params=[(n, P[n]) for n in model_order]))
    got = muon_matrices(run)
    assert list(got.items()) == [("h.2.w", "muon"), ("h.10.w", "muon"), ("a.w", "muon_bc")]


def test_pct_is_a_percentage():
    from dptrain.commands.diagnose import _pct

    assert _pct(0.5).strip() == "+50.0%"
    assert _pct(-0.2).strip() == "-20.0%"
    assert _pct(math.inf).strip() == "undef" and _pct(math.nan).strip() == "undef"


def test_a_batch_size_past_the_column_s_width_is_written_as_a_float_is():
    # (B* of a tiny gap: a 38-digit integer pushed every later column out of line)
    from dptrain.commands.diagnose import _fmt

    assert _fmt(123456789) == "123456789" and _fmt(17) == "       17"
    assert _fmt(10 ** 37 + 3) == "    1e+37" and _fmt(1234567890) == "1.235e+09"


def test_render_puts_each_value_under_its_column():
    """The table's header names the metric of its column (spelled out here, not read from
    COLUMNS): e_pol is the polar error, e_cos the cosine error, and so on."""
    from dptrain.commands.diagnose import render

    columns = [("e_pol", "polar_error"), ("e_cos", "cosine_error"), ("eta_R", "eta_R"),
               ("|R|", "residual_norm"), ("sig_lam", "sigma_lambda"), ("sig_G", "sigma_G"),
               ("SNR", "expected_snr"), ("r_eff", "effective_rank"),
               ("rel_gap", "relative_gap"), ("B*", "wedin_threshold")]
    keys = [k for _, k in columns]
    cur = {k: float(i + 1) / 8 for i, k in enumerate(keys)}
    cur["wedin_threshold"] = 17
    im = {k: float(i + 1) / 16 for i, k in enumerate(keys)}
    im["wedin_threshold"] = None
    report = {
        "checkpoint": "ck", "step": 3, "config_source": "checkpoint",
        "release": {"noise_multiplier": 1.0, "clip_norm": 1.0, "denominator": 32,
                    "noise_std": 1 / 32},
        "probe": {"num_examples": 2, "test_size": 64, "selection": "evenly spaced",
                  "model_mode": "eval"},
        "clip_factors": {"current": {"mean_lambda": 0.5, "min_lambda": 0.25,
                                     "fraction_clipped": 1.0}},
        "compare_im": None,
        "matrices": {"layer.w": {"candidates": {"current": cur, "im": im}}},
        "privacy_note": "P", "probe_note": "Q",
    }
    lines = render(report).splitlines()
    head = next(line for line in lines if line.startswith("matrix"))
    assert head.split() == ["matrix", "query"] + [h for h, _ in columns]
    row_cur = next(line for line in lines if line.startswith("layer.w"))
    row_im = lines[lines.index(row_cur) + 1]
    assert row_cur.split()[:2] == ["layer.w", "current"]
    assert row_im.split()[0] == "im"  # the matrix is named once, on its first row
    for (h, k), cell in zip(columns, row_cur.split()[2:]):
        assert cell == ("17" if k == "wedin_threshold" else f"{cur[k]:.4g}"), h
    for (h, k), cell in zip(columns, row_im.split()[1:]):
        assert cell == ("-" if k == "wedin_threshold" else f"{im[k]:.4g}"), h
    # every column is explained below the table (the legend named 4 of the 10)
    legend = "\n".join(lines[lines.index(row_im) + 1:])
    for h, _ in columns:
        assert any(f"{h}{end}" in legend for end in (":", ", ", "/")), h
    assert "im/cur-1" not in legend  # (no inner-momentum comparison in this report)


def test_render_header_lines_spell_out_the_release_the_clipping_and_the_im_query():
    """The lines above and below the table, against values written out by hand: the noise std
    (not C), the clipped fraction as a percentage, each K with its own parameters, and the IM
    summary's count as lower-in/of-matrices."""
    from dptrain.commands.diagnose import UNDEFINED_NOTE, render

    cur = {"polar_error": 0.5, "cosine_error": 0.25, "eta_R": 0.125}
    im_c = {"polar_error": 0.25, "cosine_error": 0.5, "eta_R": 0.125}
    report = {
        "checkpoint": "ck", "step": 7, "config_source": "checkpoint",
        "release": {"noise_multiplier": 1.5, "clip_norm": 2.0, "denominator": 32,
                    "noise_std": 0.09375},
        "probe": {"num_examples": 4, "test_size": 64, "selection": "evenly spaced",
                  "model_mode": "eval"},
        "clip_factors": {"current": {"mean_lambda": 0.5, "min_lambda": 0.25,
                                     "fraction_clipped": 0.375},
                         "im": {"mean_lambda": 0.75, "min_lambda": 0.5,
                                "fraction_clipped": 0.25}},
        "compare_im": {"k_muon": 3, "gamma_muon": 0.9, "k_other": 1, "gamma_other": 0.5,
                       "history_states": 4,
                       "relative_difference": {"polar_error": {"mean": -0.5, "im_lower": 1,
                                                               "matrices": 3}}},
        "matrices": {"layer.w": {"candidates": {"current": cur, "im": im_c},
                                 "relative_difference": {"polar_error": -0.5,
                                                         "cosine_error": 1.0, "eta_R": 0.0}}},
        "privacy_note": "P", "probe_note": "Q",
    }
    lines = render(report).splitlines()
    assert lines[0] == "dptrain diagnose: ck (step 7, config from checkpoint)"
    assert lines[1] == ("probe set: 4 of 64 examples of the PUBLIC test split (evenly spaced; "
                        "eval)")
    assert lines[2] == "release: sigma 1.5, C 2, b 32, noise std sigma*C/b 0.09375"
    assert lines[3] == "clip factors (current query): mean 0.5, min 0.25, clipped 37.5%"
    assert lines[4] == "clip factors (im query): mean 0.75, min 0.5, clipped 25.0%"
    assert lines[5] == ("inner-momentum query: K 3, gamma 0.9 (Muon matrices), K 1, gamma 0.5 "
                        "(other parameters); 4 past states in the checkpoint")
    diff = next(line for line in lines if line.strip().startswith("im/cur-1"))
    assert diff.split()[1:4] == ["-50.0%", "+100.0%", "+0.0%"]
    assert ("IM vs current-only (before noise and outer momentum): polar_error -50.0% (mean), "
            "IM lower in 1/3") in lines
    assert UNDEFINED_NOTE not in lines
    assert lines[-2:] == ["privacy: P", "probe set: Q"]


def test_an_im_query_of_a_run_without_other_parameters_leaves_k_other_out():
    """A LoRA run's trainable parameters are all Muon matrices: K_A weights nothing, so it
    needs no past state, and the report says there are no other parameters (it showed
    "K 2, gamma 0.5 (other parameters)" for a run trained with k_other 0)."""
    from dptrain.commands.diagnose import render
    from dptrain.diagnostics import probes

    muon_group = SimpleNamespace(config=SimpleNamespace(optimizer="muon"),
                                 named_params=[("a.lora_A", None), ("a.lora_B", None)])
    run = SimpleNamespace(history=[object()], optimizer=SimpleNamespace(
        groups=[muon_group], named_params=muon_group.named_params))
    # K_M = 1 within the one past state; K_A = 2 asked for, with no parameter to weight
    plan, am, aa = probes.im_plan(run, probes.ImQuery(1, 0.5, 2, 0.5))
    assert len(plan) == 2 and am == pytest.approx([2 / 3, 1 / 3]) and aa == [1.0]
    assert plan[1][1] is run.history[0] and plan[1][0] == {"a.lora_A": am[1], "a.lora_B": am[1]}
    other = SimpleNamespace(config=SimpleNamespace(optimizer="adamw"), named_params=[("b", None)])
    run.optimizer = SimpleNamespace(groups=[muon_group, other],
                                    named_params=muon_group.named_params + [("b", None)])
    with pytest.raises(ConfigError, match="k_other >= 2"):  # with one: 2 states needed
        probes.im_plan(run, probes.ImQuery(1, 0.5, 2, 0.5))

    report = {"checkpoint": "ck", "step": 3, "config_source": "checkpoint",
              "release": {"noise_multiplier": 1.0, "clip_norm": 1.0, "denominator": 8,
                          "noise_std": 0.125},
              "probe": {"num_examples": 2, "test_size": 8, "selection": "s", "model_mode": "m"},
              "clip_factors": {}, "matrices": {}, "privacy_note": "P", "probe_note": "Q",
              "compare_im": {"k_muon": 1, "gamma_muon": 0.5, "k_other": 2, "gamma_other": 0.5,
                             "other_parameters": 0, "history_states": 1,
                             "relative_difference": {}}}
    assert ("inner-momentum query: K 1, gamma 0.5 (Muon matrices), no other parameters; 1 past "
            "states in the checkpoint") in render(report).splitlines()


def test_plot_of_more_than_three_matrices_says_which_it_shows(plain_run, tmp_path, capsys):
    png = tmp_path / "spectra.png"
    code, _, err = run_cli(capsys, "diagnose", "--run", plain_run, "--probe-examples", "2",
                           "--params", r"h\.0\.", "--output", tmp_path / "r.json", "--plot", png)
    assert code == 0, err
    report = json.loads((tmp_path / "r.json").read_text())
    assert len(report["matrices"]) == 4
    assert ("dptrain diagnose: note: --plot shows the first 3 of 4 matrices; choose others "
            "with --params") in err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    code, _, err = run_cli(capsys, "diagnose", "--run", plain_run, "--probe-examples", "2",
                           "--params", r"h\.0\.attn", "--output", tmp_path / "r.json", "--plot",
                           png, "--force")
    assert code == 0 and "--plot shows" not in err, err


def test_a_bad_params_regex_is_refused_before_the_run_is_loaded(plain_run, tmp_path, capsys,
                                                                monkeypatch):
    import dptrain.diagnostics.probes as probes

    def never(*a, **k):
        raise AssertionError("the run was loaded before --params was checked")

    monkeypatch.setattr(probes, "load_run", never)
    code, _, err = run_cli(capsys, "diagnose", "--run", plain_run, "--probe-examples", "2",
                           "--params", "(unclosed", "--output", tmp_path / "r.json")
    lines = [line for line in err.strip().splitlines() if line]
    assert code == 2 and len(lines) == 1 and "--params: not a valid regex" in lines[0], err
    assert not (tmp_path / "r.json").exists()


# -------------------------------------------------------------------------- the CLI

def test_probe_examples_is_checked_before_the_run_is_loaded(plain_run, tmp_path, capsys,
                                                             monkeypatch):
    import dptrain.diagnostics.probes as probes

    def never(*a, **k):
        raise AssertionError("the run was loaded before --probe-examples was checked")

    monkeypatch.setattr(probes, "load_run", never)
    for value in ("0", "-3"):
        code, _, err = run_cli(capsys, "diagnose", "--run", plain_run, "--probe-examples", value,
                               "--output", tmp_path / "r.json")
        lines = [line for line in err.strip().splitlines() if line]
        assert code == 2 and len(lines) == 1 and "--probe-examples" in lines[0], err


def test_short_history_error_names_k_muon_when_both_ks_are_short(im_run, tmp_path, capsys):
    code, _, err = run_cli(capsys, "diagnose", "--run", im_run, "--probe-examples", "2",
                           "--compare-im", "3,0.9", "--output", tmp_path / "never.json")
    assert code == 2 and "optim.inner_momentum.k_muon >= 3" in err, err


def test_candidate_wedin_threshold_and_clip_factor_stats_match_independent(plain_run, tmp_path,
                                                                          capsys):
    """B* of the clipped mean (not of the reference) and the clip-factor summary, against
    torch.func gradients and a by-hand smallest-B search."""
    out = tmp_path / "w.json"
    name = "transformer.h.0.mlp.c_fc.weight"
    code, _, err = run_cli(capsys, "diagnose", "--run", plain_run, "--probe-examples", "6",
                           "--params", r"h\.0\.mlp\.c_fc", "--output", out)
    assert code == 0, err
    report = json.loads(out.read_text())
    _, _, grad = _reference(plain_run, "privacy.steps=2")
    grads = [grad(i) for i in report["probe"]["indices"]]
    lam = np.array([min(1.0, 1.0 / _norm(g)) for g in grads])
    cf = report["clip_factors"]["current"]
    assert cf["min_lambda"] == pytest.approx(lam.min(), rel=1e-4)
    assert cf["mean_lambda"] == pytest.approx(lam.mean(), rel=1e-4)
    assert cf["fraction_clipped"] == pytest.approx(float((lam < 1.0).mean()))

    G = np.stack([g[name].double().numpy() for g in grads])
    X = (lam[:, None, None] * G).mean(0)
    r, c = X.shape
    scale = 1.0 * 1.0 * (math.sqrt(r) + math.sqrt(c))  # sigma = C = 1

    def smallest_b(A):
        s = np.linalg.svd(A, compute_uv=False)
        gap = s[0] - s[1]
        B = 1
        while not scale / B < gap:
            B += 1
        return B

    entry = report["matrices"][name]
    b_cur, b_ref = smallest_b(X), smallest_b(G.mean(0))
    assert b_cur != b_ref  # clipping shrinks the gap here, so the two differ
    assert entry["candidates"]["current"]["wedin_threshold"] == b_cur
    assert entry["reference"]["wedin_threshold"] == b_ref


def test_compare_im_summary_is_mean_median_and_count_of_the_matrices(im_run, tmp_path, capsys):
    out = tmp_path / "s.json"
    code, _, err = run_cli(capsys, "diagnose", "--run", im_run, "--probe-examples", "4",
                           "--compare-im", "2,0.9", "--output", out)
    assert code == 0, err
    report = json.loads(out.read_text())
    names = list(report["matrices"])
    assert len(names) >= 3  # a median that is not the mean of two
    for k in ("polar_error", "cosine_error", "eta_R"):
        vals = [report["matrices"][n]["relative_difference"][k] for n in names]
        finite = [v for v in vals if math.isfinite(v)]
        s = report["compare_im"]["relative_difference"][k]
        assert s["matrices"] == len(names)
        assert s["mean"] == pytest.approx(statistics.fmean(finite))
        assert s["median"] == pytest.approx(statistics.median(finite))
        cands = [report["matrices"][n]["candidates"] for n in names]
        assert s["im_lower"] == sum(c["im"][k] < c["current"][k] for c in cands)
    # the same query (K = 0): IM is lower for no matrix
    code, _, err = run_cli(capsys, "diagnose", "--run", im_run, "--probe-examples", "2",
                           "--compare-im", "0,0.9", "--params", r"h\.0\.attn", "--output", out,
                           "--force")
    assert code == 0, err
    summary = json.loads(out.read_text())["compare_im"]["relative_difference"]
    assert all(s["im_lower"] == 0 and s["matrices"] == 2 for s in summary.values())


def test_clip_factors_span_several_microbatches(plain_run, tmp_path, capsys):
    """More probe examples than performance.microbatch_size (16 in tiny.yaml): the clip
    factors are computed microbatch by microbatch and must cover every example, in order."""
    out = tmp_path / "mb.json"
    code, _, err = run_cli(capsys, "diagnose", "--run", plain_run, "--probe-examples", "20",
                           "--params", r"h\.1\.mlp\.c_proj", "--output", out)
    assert code == 0, err
    report = json.loads(out.read_text())
    indices = report["probe"]["indices"]
    assert len(indices) == 20
    _, _, grad = _reference(plain_run, "privacy.steps=2")
    norms = [_norm(grad(i)) for i in indices]
    got = report["clip_factors"]["current"]
    assert got["norms"] == pytest.approx(norms, rel=1e-4)
    assert got["lam"] == pytest.approx([min(1.0, 1.0 / x) for x in norms], rel=1e-4)


def test_gamma_zero_needs_no_history(plain_run, tmp_path, capsys):
    """gamma = 0 makes the IM query current-only whatever K (ImQuery.effective): it needs no
    past state, so it works on a checkpoint without inner-momentum history."""
    out = tmp_path / "g0.json"
    code, _, err = run_cli(capsys, "diagnose", "--run", plain_run, "--probe-examples", "2",
                           "--params", r"h\.0\.attn\.c_attn", "--compare-im", "3,0",
                           "--output", out)
    assert code == 0, err
    report = json.loads(out.read_text())
    im = report["compare_im"]
    assert im["history_states"] == 0 and im["k_muon"] == 3
    assert im["alpha_muon"] == [1.0] and im["alpha_other"] == [1.0]
    assert report["clip_factors"]["im"]["lam"] == report["clip_factors"]["current"]["lam"]


def _chunks_of_the_probes(im_run, monkeypatch):
    """(the IM run loaded, two matrices of one size, the bytes of one copy of either at m = 2
    float64 examples, the list that records each chunk of matrices probed together)."""
    from dptrain import checkpoint as ckpt
    import dptrain.diagnostics.probes as probes

    run = probes.load_run(ckpt.find_latest(im_run))
    names = ["transformer.h.0.mlp.c_fc.weight", "transformer.h.0.mlp.c_proj.weight"]
    one = 2 * run.params[names[0]].numel() * 8  # m = 2 examples, float64
    assert run.params[names[1]].numel() * 16 == one
    calls = []
    real = probes.per_example_grads

    def recording(run_, indices, chunk, state=None):
        if state is None:
            calls.append(list(chunk))
        return real(run_, indices, chunk, state)

    monkeypatch.setattr(probes, "per_example_grads", recording)
    return run, names, one, calls


def test_memory_budget_counts_the_three_copies_of_an_im_probe(im_run, monkeypatch):
    """With a Muon history the probes hold G_cur, G_im and one past state's G_j at once, so a
    matrix costs 3 * m * numel * 8 bytes of the max_bytes budget (1x without IM)."""
    import dptrain.diagnostics.probes as probes

    run, names, one, calls = _chunks_of_the_probes(im_run, monkeypatch)
    kw = dict(probe_examples=2, params=r"h\.0\.mlp\.c_")
    probes.diagnose(run, compare_im=probes.ImQuery(1, 0.9), max_bytes=3 * one, **kw)
    assert calls == [[names[0]], [names[1]]]  # 2 x 3 copies would exceed the budget
    calls.clear()
    probes.diagnose(run, max_bytes=2 * one, **kw)
    assert calls == [names]  # current only: one copy each, both fit


def _first_weight_cut(state):
    name = next(k for k, v in state["model"].items() if v.dim() == 2)
    state["model"][name] = state["model"][name][:-1]


@pytest.mark.parametrize("edit, says", [
    (lambda s: s.pop("plan"), "it has no privacy plan"),  # was KeyError: 'plan'
    (lambda s: s["plan"].update(denominator=0), "its plan's denominator is 0"),  # ZeroDivision
    # (a ValueError after all the probing)
    (lambda s: s["plan"].update(noise_multiplier=float("nan")),
     "its plan's noise_multiplier is nan"),
    (_first_weight_cut, "its model does not fit its own config (RuntimeError: "),
    (lambda s: s["plan"].update(clip_norm=float("inf")), "its plan's clip_norm is inf"),
    (lambda s: s["plan"].update(steps=2.5), "its plan's steps is 2.5"),
    (lambda s: s["plan"].update(clip_norm=True), "its plan's clip_norm is True"),
])
def test_a_checkpoint_with_whole_files_but_foreign_contents_is_one_error(plain_run, tmp_path,
                                                                           capsys, edit, says):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(plain_run, run)
    step_dir = forged(run, edit)
    code, _, err = run_cli(capsys, "diagnose", "--checkpoint", step_dir, "--probe-examples", "2",
                           "--output", tmp_path / "d.json")
    lines = [line for line in err.strip().splitlines() if line]
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith(f"dptrain diagnose: error: --checkpoint: checkpoint {step_dir}")
    assert says in lines[0]
    assert not (tmp_path / "d.json").exists()


def test_a_plan_of_any_real_run_is_accepted():
    # sigma 0 is a run's (privacy.noise_multiplier: 0, epsilon infinite); integer values too
    from dptrain.diagnostics.probes import _checked_plan

    plan = {"noise_multiplier": 0, "clip_norm": 1, "denominator": 32, "steps": 4}
    assert _checked_plan({"plan": plan}, Path("c")) is plan
    plan = {"noise_multiplier": 0.9, "clip_norm": 0.1, "denominator": 32.0, "steps": 4.0}
    assert _checked_plan({"plan": plan}, Path("c")) is plan


def test_a_runs_own_files_and_folders_are_never_an_output(tmp_path):
    from dptrain.commands import run_owned

    run = tmp_path / "run"
    (run / "final" / "hf").mkdir(parents=True)
    (run / "checkpoints" / "step-00000001").mkdir(parents=True)
    assert run_owned(run / "final" / "hf" / "config.json") is None  # not a run yet
    (run / "metrics.jsonl").write_text("")
    for owned in (run / "metrics.jsonl", run / "summary.json", run / "final" / "new.json",
                  run / "final" / "hf" / "config.json",
                  run / "checkpoints" / "step-00000001" / "x.png"):
        assert run_owned(owned) is not None, owned
    for free in (run / "diagnostics.json", run / "metrics.png", run / "plots" / "final.png",
                 tmp_path / "final" / "x.json", tmp_path / "summary.json"):
        assert run_owned(free) is None, free
    finished = tmp_path / "finished"  # a finished run's summary marks it too
    (finished / "final").mkdir(parents=True)
    (finished / "summary.json").write_text("{}")
    assert run_owned(finished / "final" / "x.json") is not None
    with pytest.raises(ConfigError, match=r"inside the run .*'s final/ folder; write elsewhere"):
        check_new_files((("--output", run / "final" / "r.json", ()),), force=True)
    # where the file lands: through a link to final/ (written into it), and run/checkpoints/..
    # (the run's own folder, free)
    (tmp_path / "link").symlink_to(run / "final")
    assert run_owned(tmp_path / "link" / "hf" / "config.json") is not None
    assert run_owned(run / "checkpoints" / ".." / "metrics.png") is None
    assert run_owned(run / "final" / "hf" / ".." / ".." / "summary.json") is not None
    # an output naming an input: refused even with force
    (tmp_path / "c.yaml").write_text("{}")
    with pytest.raises(ConfigError, match=r"--output: .*c\.yaml is also the --config \(input\)"):
        check_new_files((("--output", tmp_path / "c.yaml", ()),), force=True,
                        inputs=(("--config", tmp_path / "c.yaml"),))


def test_two_outputs_naming_one_file_are_refused(tmp_path):
    a = tmp_path / "report.json"
    (tmp_path / "sub").mkdir()
    for second in (a, tmp_path / "sub" / ".." / "report.json"):
        with pytest.raises(ConfigError) as e:
            check_new_files((("--output", a, ()), ("--plot", second, ())), force=False)
        assert e.value.field == "--plot" and "also the --output file" in e.value.message
    check_new_files((("--output", a, ()), ("--plot", None, ()), ("--x", tmp_path / "b.png", ())),
                    False)
    assert not a.exists()


def test_a_stored_config_drops_the_settings_its_run_ignored_but_an_override_is_refused():
    # a checkpoint written before such settings were refused: a cnn run that kept tiny.yaml's
    # gpt2 shape and DiSK's gain without DiSK (all ignored by that run)
    from dptrain.config import load, to_dict
    from dptrain.diagnostics import probes
    from dptrain.trainer import RunConfig

    saved = to_dict(load(RunConfig, ROOT / "configs" / "tiny_images.yaml"))
    saved["model"].update(n_layer=2, n_positions=32)
    saved["optim"]["filter"]["kappa"] = 0.5
    cfg = probes._build_config(saved, None, ["model.channels=[4]"])
    assert (cfg.model.name, cfg.model.n_layer, cfg.model.n_positions) == ("cnn", 12, 1024)
    assert cfg.model.channels == [4] and cfg.optim.filter.kappa == 0.7
    with pytest.raises(ConfigError) as e:
        probes._build_config(saved, None, ["model.n_layer=3"])
    assert e.value.field == "model.n_layer"


# -------------------------------------------------------------------------- mutation pass 2

def test_spectra_and_im_candidate_are_the_clipped_means_of_each_query(im_run):
    """The matrices handed to the plot are the unclipped current mean and each query's clipped
    mean (1/m) sum_i lam_i G_i; the IM candidate's B* and Frobenius norm are its own clipped
    mean's, not the current one's. Against torch.func gradients at theta_t and the history."""
    from dptrain import checkpoint as ckpt
    from dptrain.diagnostics import wedin_threshold
    from dptrain.diagnostics.probes import ImQuery, diagnose, load_run

    run = load_run(ckpt.find_latest(im_run))
    name = "transformer.h.0.mlp.c_fc.weight"
    report, spectra = diagnose(run, probe_examples=5, params=r"h\.0\.mlp\.c_fc",
                               compare_im=ImQuery(2, 0.9))
    _, state, grad = _reference(im_run, "privacy.steps=3", *IM)
    history = state["optimizer"]["history"]["states"]
    am = [1 / 2.71, 0.9 / 2.71, 0.81 / 2.71]
    Gc, Gi, lam_c, lam_i = [], [], [], []
    for i in report["probe"]["indices"]:
        per_state = [grad(i)] + [grad(i, h) for h in history]
        u = {n: sum(am[j] * per_state[j][n] for j in range(3)) for n in per_state[0]}
        Gc.append(per_state[0][name])
        Gi.append(u[name])
        lam_c.append(min(1.0, 1.0 / _norm(per_state[0])))
        lam_i.append(min(1.0, 1.0 / _norm(u)))
    Gc, Gi = torch.stack(Gc), torch.stack(Gi)
    Xc = clipped_mean(Gc, torch.tensor(lam_c, dtype=torch.float64))
    Xi = clipped_mean(Gi, torch.tensor(lam_i, dtype=torch.float64))
    assert not torch.allclose(Xc, Xi, rtol=1e-2)  # the two queries differ here
    assert torch.allclose(spectra[(name, "reference")], Gc.mean(0), rtol=1e-6, atol=1e-12)
    assert torch.allclose(spectra[(name, "current")], Xc, rtol=1e-6, atol=1e-12)
    assert torch.allclose(spectra[(name, "im")], Xi, rtol=1e-6, atol=1e-12)
    cands = report["matrices"][name]["candidates"]
    assert cands["im"]["frobenius_norm"] == pytest.approx(float(Xi.norm()), rel=1e-6)
    assert cands["im"]["wedin_threshold"] == wedin_threshold(Xi, 1.0, 1.0)
    assert cands["current"]["wedin_threshold"] == wedin_threshold(Xc, 1.0, 1.0)
    assert cands["im"]["wedin_threshold"] != cands["current"]["wedin_threshold"]


def test_probe_counts_say_how_many_examples_were_used(plain_run):
    """num_examples is the probes actually run (the split's size when more were asked for);
    test_size is the split's size; the model is probed in eval mode."""
    from dptrain import checkpoint as ckpt
    from dptrain.diagnostics.probes import diagnose, load_run

    run = load_run(ckpt.find_latest(plain_run))
    kw = dict(params=r"h\.1\.mlp\.c_proj")
    report, _ = diagnose(run, probe_examples=1000, **kw)
    probe = report["probe"]
    assert probe["test_size"] == len(run.task.test) == 64
    assert probe["num_examples"] == len(probe["indices"]) == 64
    assert report["matrices"]["transformer.h.1.mlp.c_proj.weight"]["candidates"]["current"][
        "num_examples"] == 64
    report, _ = diagnose(run, probe_examples=3, **kw)
    assert (report["probe"]["num_examples"], report["probe"]["test_size"]) == (3, 64)
    assert report["probe"]["model_mode"].startswith("eval")


def test_compare_im_summary_leaves_out_undefined_differences(im_run, monkeypatch):
    """A matrix whose IM/current ratio is undefined (inf or nan) is counted in ``matrices`` but
    left out of the mean and the median, which stay finite."""
    from dptrain import checkpoint as ckpt
    import dptrain.diagnostics.probes as probes

    real = probes._ratio_minus_one
    calls = []

    def first_undefined(new, old):
        calls.append(1)
        return math.inf if len(calls) <= len(probes.METRICS) else real(new, old)

    monkeypatch.setattr(probes, "_ratio_minus_one", first_undefined)
    run = probes.load_run(ckpt.find_latest(im_run))
    report, _ = probes.diagnose(run, probe_examples=3, params=r"h\.0\.",
                                compare_im=probes.ImQuery(1, 0.9))
    names = list(report["matrices"])
    assert len(names) >= 3
    for k in probes.METRICS:
        vals = [report["matrices"][n]["relative_difference"][k] for n in names]
        assert vals[0] == math.inf and all(math.isfinite(v) for v in vals[1:])
        s = report["compare_im"]["relative_difference"][k]
        assert s["matrices"] == len(names)
        assert s["mean"] == pytest.approx(statistics.fmean(vals[1:]))
        assert s["median"] == pytest.approx(statistics.median(vals[1:]))


def test_probes_of_a_run_with_dropout_are_its_eval_mode_gradients(tmp_path):
    """A run trained with dropout: the probes (current query, IM query over the history, and
    the per-example matrices) are the deterministic eval-mode gradients, at each stored state,
    whatever dropout stream a past-state evaluation has in training."""
    from dptrain import checkpoint as ckpt
    from dptrain.diagnostics.probes import ImQuery, diagnose, load_run

    extra = ["privacy.steps=2", "model.dropout=0.5", "optim.inner_momentum.k_muon=1",
             "optim.inner_momentum.gamma_muon=0.9"]
    run_dir = _train(tmp_path / "drop", *extra)
    run = load_run(ckpt.find_latest(run_dir))
    name = "transformer.h.1.attn.c_attn.weight"
    report, spectra = diagnose(run, probe_examples=4, params=r"h\.1\.attn\.c_attn",
                               compare_im=ImQuery(1, 0.5))
    again, _ = diagnose(run, probe_examples=4, params=r"h\.1\.attn\.c_attn",
                        compare_im=ImQuery(1, 0.5))
    assert again["matrices"] == report["matrices"]  # no dropout mask drawn
    _, state, grad = _reference(run_dir, *extra)
    (past,) = state["optimizer"]["history"]["states"]
    a = [1 / 1.5, 0.5 / 1.5]
    lam_c, lam_i, Gi = [], [], []
    for i in report["probe"]["indices"]:
        g0, g1 = grad(i), grad(i, past)
        u = {n: a[0] * g0[n] + a[1] * g1[n] for n in g0}
        lam_c.append(min(1.0, 1.0 / _norm(g0)))
        lam_i.append(min(1.0, 1.0 / _norm(u)))
        Gi.append(u[name])
    assert report["clip_factors"]["current"]["lam"] == pytest.approx(lam_c, rel=1e-6)
    assert report["clip_factors"]["im"]["lam"] == pytest.approx(lam_i, rel=1e-6)
    Xi = clipped_mean(torch.stack(Gi), torch.tensor(lam_i, dtype=torch.float64))
    assert torch.allclose(spectra[(name, "im")], Xi, rtol=1e-6, atol=1e-12)


def test_history_is_the_pre_update_states_newest_first(im_run):
    """load_run's history is theta_{t-1}, theta_{t-2}: the step-2 checkpoint's model is the
    step-3 checkpoint's history[0], and the step-2 checkpoint's newest past state (theta_1) is
    its history[1]; neither is the current model theta_t."""
    from dptrain.diagnostics.probes import load_run

    steps = sorted(p for p in (im_run / "checkpoints").iterdir() if p.name.startswith("step-"))
    assert [p.name for p in steps[-2:]] == ["step-00000002", "step-00000003"]
    run = load_run(steps[-1])
    earlier = load_run(steps[-2])
    assert run.step == 3 and len(run.history) == 2 and len(earlier.history) == 2
    names = list(run.params)
    assert set(run.history[0]) == set(names)
    for n in names:
        assert torch.equal(run.history[0][n], earlier.params[n].detach()), n
        assert torch.equal(run.history[1][n], earlier.history[0][n]), n
    moved = [n for n in names if not torch.equal(run.history[0][n], run.params[n].detach())]
    assert len(moved) == len(names)  # every trainable parameter moved at step 3
    assert any(not torch.equal(run.history[0][n], run.history[1][n]) for n in names)


def test_memory_budget_of_an_im_probe_is_exactly_three_copies(im_run, monkeypatch):
    """Two matrices of one (m * numel * 8 bytes) each: with a Muon history they cost 3 + 3
    copies, so they share a chunk at a budget of 6 copies and not at one byte less."""
    import dptrain.diagnostics.probes as probes

    run, names, one, calls = _chunks_of_the_probes(im_run, monkeypatch)
    kw = dict(probe_examples=2, params=r"h\.0\.mlp\.c_", compare_im=probes.ImQuery(1, 0.9))
    probes.diagnose(run, max_bytes=6 * one, **kw)
    assert calls == [names]
    calls.clear()
    probes.diagnose(run, max_bytes=6 * one - 1, **kw)
    assert calls == [[names[0]], [names[1]]]


def test_im_plan_weights_every_parameter_of_a_muon_group_by_alpha_muon():
    """im_plan by hand: a Muon group's 1-D parameter (not a probed matrix) takes the Muon weights
    alpha^M like its matrices, the other groups alpha^A, zero beyond their own K; entry j
    evaluates at history[j - 1] (theta_{t-j})."""
    from dptrain.diagnostics.probes import ImQuery, im_plan

    P = {n: torch.zeros(shape) for n, shape in [("h.w", (2, 2)), ("h.b", (2,)), ("wte", (3, 2))]}
    groups = [SimpleNamespace(config=SimpleNamespace(optimizer="muon"),
                              named_params=[("h.w", P["h.w"]), ("h.b", P["h.b"])]),
              SimpleNamespace(config=SimpleNamespace(optimizer="adamw"),
                              named_params=[("wte", P["wte"])])]
    history = [{"tag": torch.tensor(1.0)}, {"tag": torch.tensor(2.0)}, {"tag": torch.tensor(3.0)}]
    run = SimpleNamespace(history=history, optimizer=SimpleNamespace(
        groups=groups, named_params=[(n, P[n]) for n in ("h.w", "h.b", "wte")]))
    plan, am, aa = im_plan(run, ImQuery(2, 0.5, 1, 0.25))
    assert am == pytest.approx([1 / 1.75, 0.5 / 1.75, 0.25 / 1.75])
    assert aa == pytest.approx([1 / 1.25, 0.25 / 1.25])
    assert len(plan) == 3
    for j, (coef, state) in enumerate(plan):
        assert state is (None if j == 0 else history[j - 1])
        assert coef["h.w"] == coef["h.b"] == pytest.approx(am[j])
        assert coef["wte"] == pytest.approx(aa[j] if j <= 1 else 0.0)
    assert im_plan(run, ImQuery(0, 0.5)) == ([(1.0, None)], [1.0], [1.0])
