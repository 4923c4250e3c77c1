"""`dptrain diagnose`: geometry probes of a checkpoint on the public test split (issue 3 item 8,
issue 4 item 4), checked against an independent torch.func computation."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from dptrain.cli import main
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
    same = tmp_path / "same.out"
    for extra, option in [(["--output", tmp_path / "afile" / "r.json"], "--output"),
                          (["--output", tmp_path / "ok.json",  # not the run's default file
                            "--plot", tmp_path / "afile" / "sub" / "p.png"], "--plot"),
                          (["--output", same, "--plot", same], "--plot"),  # PNG over the JSON
                          (["--output", same, "--plot", tmp_path / "." / "same.out"], "--plot")]:
        code, _, err = run_cli(capsys, "diagnose", "--run", plain_run, "--probe-examples", "2",
                               *extra)
        lines = [line for line in err.strip().splitlines() if line]
        assert code == 2 and len(lines) == 1 and option in lines[0], err
    assert not same.exists() and (tmp_path / "afile").read_text() == "x"


def test_relocated_settings_are_reported(plain_run, tmp_path, capsys):
    js = tmp_path / "r.json"
    code, _, err = run_cli(capsys, "diagnose", "--run", plain_run, "--probe-examples", "2",
                           "--params", r"h\.0\.attn\.c_attn", "--output", js,
                           "data.max_test_examples=7", "performance.device=cpu")
    assert code == 0, err
    assert "data.max_test_examples: None -> 7" in err and "held out" in err
    report = json.loads(js.read_text())
    assert report["relocated"] == ["data.max_test_examples: None -> 7"]
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
    ("plain", ["--run", "{run}", "privacy.clip_norm=2"], "privacy.clip_norm"),
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
    assert not out.exists()
