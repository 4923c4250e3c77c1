"""Geometry probes of a checkpoint on the public probe set: what ``dptrain diagnose`` computes.

    run = load_run(resolve_checkpoint(run_dir="runs/x"))          # model, optimizer, IM history
    report, spectra = diagnose(run, probe_examples=64, compare_im=ImQuery(4, 0.9))

For each selected Muon matrix W (default: every >= 2-D parameter of a Muon-family group) and M
examples x_1..x_M of the test split (public data):

- G[i] = grad_W l(theta_t; x_i): example i's gradient of W at the checkpoint's model, one
  example at a time (plain autograd; probe sets are small);
- lam_i = min(1, C / ||u_i||) with u_i example i's COMPLETE query (every trainable parameter),
  from the run's own ``ClippingEngine.per_example_norms`` with the run's C;
- ``summarize(mean_i G[i], {"current": (G, lam)})``: polar and cosine error of the clipped
  mean (1/M) sum_i lam_i G[i] against the unclipped mean (the reference), the clipping residual
  R, sigma_lambda, sigma_G, eta_R, effective rank, spectral gap and the Wedin threshold with the
  run's sigma and C, and the expected SNR against release noise of std sigma*C/b (its expected
  Frobenius norm sigma*C/b*sqrt(r*c): no noise is drawn).

With ``compare_im`` (issue 4, item 4) the inner-momentum query of the same examples at the same
model state, u_i = sum_{j=0..K} alpha_j grad l(theta_{t-j}; x_i) with alpha_j = gamma^j /
sum_l gamma^l, is clipped as one query and judged against the same unclipped current-gradient
reference ("im" next to "current"), before noise and outer momentum. The past states
theta_{t-1}, ..., theta_{t-K} are those stored in the checkpoint's inner-momentum history;
nothing is replayed, so a history shorter than K is an error.

The model is evaluated in eval mode (dropout off) and in float64 whatever the run's dtype (no
autocast): the polar factor depends on the matrices' rank, which float32 rounding would blur.

Privacy: the statistics are computed from the checkpoint (itself post-processing of the run's
noisy releases) and the test split, which dptrain treats as public. Computed on private records
instead, they would be new releases NOT covered by the run's guarantee (``PRIVACY_NOTE``).

User mistakes raise ``ConfigError`` whose field is the ``dptrain diagnose`` option at fault.
"""

from __future__ import annotations

import contextlib
import copy
import math
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import torch
from torch import Tensor, nn

from dptrain.config import (
    ConfigError,
    apply_overrides,
    from_dict,
    load,
    reset_unused,
    to_dict,
    validate_tree,
)
from dptrain.data import even_subset
from dptrain.messages import brief
from dptrain.diagnostics.geometry import (
    PRIVACY_NOTE,
    as_matrix,
    clipped_mean,
    wedin_threshold,
    summarize,
)

__all__ = [
    "PROBE_NOTE",
    "ImQuery",
    "LoadedRun",
    "resolve_checkpoint",
    "load_run",
    "muon_matrices",
    "select_matrices",
    "probe_indices",
    "per_example_grads",
    "clip_factors",
    "im_plan",
    "diagnose",
    "spectra_for_plot",
    "PLOT_MAX_MATRICES",
]

PROBE_NOTE = (
    "The probe set is the public test split (evaluation data, which dptrain treats as public), "
    "not training data: these numbers are computed only from the checkpoint and public records. "
    "Run on private records they would be new releases, not covered by the run's guarantee."
)

METRICS = ("polar_error", "cosine_error", "eta_R")


@dataclass(frozen=True)
class ImQuery:
    """The inner-momentum query of the probe: (K, gamma) for the Muon-family parameters and
    (k_other, gamma_other) for the others (default: the same K and gamma)."""

    k_muon: int
    gamma_muon: float
    k_other: int | None = None
    gamma_other: float | None = None

    @property
    def ko(self) -> int:
        return self.k_muon if self.k_other is None else self.k_other

    @property
    def go(self) -> float:
        return self.gamma_muon if self.gamma_other is None else self.gamma_other

    def effective(self) -> tuple[int, int]:
        """(K_M, K_A) with gamma = 0 counting as K = 0 (the query is then current-only)."""
        return (self.k_muon if self.gamma_muon > 0 else 0, self.ko if self.go > 0 else 0)

    @classmethod
    def parse(cls, text: str, option: str = "--compare-im") -> "ImQuery":
        """``K,GAMMA`` or ``K,GAMMA,K_OTHER,GAMMA_OTHER`` (K integers >= 0, gamma in [0, 1])."""
        parts = [p.strip() for p in str(text).split(",")]
        if len(parts) not in (2, 4):
            raise ConfigError(option, f"expected K,GAMMA (e.g. 4,0.9) or K,GAMMA,K_OTHER,"
                                      f"GAMMA_OTHER, got {text!r}")
        ks, gs = [], []
        for k_text, g_text in (parts[0:2], parts[2:4]) if len(parts) == 4 else (parts[0:2],):
            try:
                k = int(k_text)
            except ValueError:
                raise ConfigError(option, f"K must be an integer >= 0, got {k_text!r} "
                                          f"in {text!r}") from None
            try:
                g = float(g_text)
            except ValueError:
                g = math.nan
            if k < 0:
                raise ConfigError(option, f"K must be >= 0, got {k} in {text!r}")
            if not (0.0 <= g <= 1.0):
                raise ConfigError(option, f"GAMMA must be a number in [0, 1], got {g_text!r} "
                                          f"in {text!r}")
            ks.append(k)
            gs.append(g)
        if len(ks) == 1:
            return cls(ks[0], gs[0])
        return cls(ks[0], gs[0], ks[1], gs[1])


@dataclass
class LoadedRun:
    """A run rebuilt from a checkpoint: its components, the release settings, the IM history."""

    cfg: Any  # RunConfig
    checkpoint: Path
    step: int
    task: Any
    model: nn.Module
    engine: Any  # ClippingEngine
    optimizer: Any  # DPOptimizer
    device: torch.device
    noise_multiplier: float
    clip_norm: float
    """C of the probes: the run's, or the one ``load_run`` was given."""
    denominator: int
    history: list[dict[str, Tensor]] = field(default_factory=list)
    """theta_{t-1}, theta_{t-2}, ...: the checkpoint's inner-momentum history (may be empty)."""
    run_clip_norm: float | None = None
    """The run's own C (its plan's); None: ``clip_norm``."""
    config_source: str = "checkpoint"
    overrides: list[str] = field(default_factory=list)
    """The ``key.sub=value`` overrides applied on top of ``config_source``."""
    relocated: list[str] = field(default_factory=list)
    """Settings that may differ from the checkpoint's and do (``section.key: old -> new``;
    :data:`dptrain.checkpoint.RELOCATABLE`): moved data or weights, another test file."""

    @property
    def params(self) -> dict[str, nn.Parameter]:
        return dict(self.optimizer.named_params)

    @property
    def noise_std(self) -> float:
        """sigma*C/b: the release noise's standard deviation per coordinate."""
        return self.noise_multiplier * self.clip_norm / self.denominator


# ------------------------------------------------------------------------------------ loading

def resolve_checkpoint(run_dir: str | Path | None = None,
                       checkpoint: str | Path | None = None) -> Path:
    """The checkpoint directory to diagnose: the newest complete one of ``run_dir``, or
    ``checkpoint`` itself (verified: complete marker and checksums)."""
    from dptrain import checkpoint as ckpt

    if run_dir is not None:
        d = Path(run_dir)
        if not d.is_dir():
            raise ConfigError("--run", f"no run directory at {d}")
        path = ckpt.find_latest(d)
        if path is None:
            raise ConfigError("--run", f"no complete checkpoint in {d}/checkpoints (train with "
                                       f"train.checkpoint_every > 0 to write checkpoints)")
        return path
    if checkpoint is None:
        raise ConfigError("--run", "give --run DIR or --checkpoint PATH")
    path = Path(checkpoint)
    if not path.is_dir():
        raise ConfigError("--checkpoint", f"no checkpoint directory at {path}")
    if not (path / ckpt.MARKER).is_file() and (path / "checkpoints").is_dir():
        raise ConfigError("--checkpoint", f"{path} is a run directory, not a checkpoint; use "
                                          f"--run {path}, or --checkpoint {path}/checkpoints/"
                                          f"step-...")
    problem = ckpt.verify(path)
    if problem is not None:
        raise ConfigError("--checkpoint", f"checkpoint {path} is unusable: {problem}")
    return path


def _checked_plan(state: dict, path: Path) -> dict:
    """The checkpoint's privacy plan, whose sigma, C and b the probes use: one line naming
    ``--checkpoint`` when it lacks one or holds values no run has (not a traceback after the
    model is built, or a ValueError after all the probing)."""
    plan = state.get("plan")
    if not isinstance(plan, dict):
        raise ConfigError("--checkpoint", f"checkpoint {path} is unusable: it has no privacy "
                                          f"plan; it was not written by dptrain train")
    wants = {"noise_multiplier": "a number >= 0", "clip_norm": "a number > 0",
             "denominator": "a number > 0", "steps": "an integer >= 1"}
    for key, want in wants.items():
        value = plan.get(key)
        ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
              and math.isfinite(value) and (value >= 0 if key == "noise_multiplier" else value > 0)
              and (key != "steps" or value == int(value)))
        if not ok:
            raise ConfigError("--checkpoint", f"checkpoint {path} is unusable: its plan's {key} "
                                              f"is {value!r}, not {want}")
    return plan


def _build_config(saved: dict, config_path: str | Path | None, overrides: Sequence[str]):
    from dptrain.trainer import RunConfig

    if config_path is not None:
        return load(RunConfig, config_path, list(overrides))
    # the checkpoint's settings that its run ignored (written before they were refused) are
    # dropped; an override that sets one is refused as on the command line
    stored = from_dict(RunConfig, copy.deepcopy(saved))
    reset_unused(stored)
    data = to_dict(stored)
    apply_overrides(RunConfig, data, overrides)
    cfg = from_dict(RunConfig, data)
    validate_tree(cfg)
    return cfg


def check_clip_norm(value, option: str = "--clip-norm") -> float:
    """A clip norm given for the probes (``0.1``, ``1/8``), read and checked as
    ``privacy.clip_norm`` is (one line naming ``option``)."""
    from dptrain.config import parse_number
    from dptrain.privacy.config import check_clip_norm as checked

    c = parse_number(str(value).strip())
    if c is None:
        raise ConfigError(option, f"expected a number > 0, got {value!r}")
    checked(c, option)
    return c


def load_run(checkpoint: str | Path, *, config_path: str | Path | None = None,
             overrides: Sequence[str] = (), clip_norm: float | None = None) -> LoadedRun:
    """Rebuild the run of ``checkpoint`` (its stored config, or ``config_path``; then
    ``key.sub=value`` overrides) and load its model and optimizer state (inner-momentum history
    included). Mirrors ``Trainer.__init__`` without privacy planning: sigma, C and b are the
    checkpoint's own, except that ``clip_norm`` replaces C for the probes (clipping at another
    C on the public probe set; the noise they compare with is then sigma * clip_norm / b, what
    a run at that C would add). Leaves the global RNG untouched."""
    from dptrain import checkpoint as ckpt
    from dptrain.clipping import ClippingEngine
    from dptrain.data import build_data
    from dptrain.models import build_model
    from dptrain.optim import build_optimizer
    from dptrain.optim.build import transposed_weights
    from dptrain.performance import check_kernels
    from dptrain.privacy.config import noise_fits
    from dptrain.trainer import resolve_device

    path = Path(checkpoint)
    problem = ckpt.verify(path)
    if problem is not None:
        raise ConfigError("--checkpoint", f"checkpoint {path} is unusable: {problem}")
    try:
        state = ckpt.read(path)  # full tensors, also of a sharded (DCP) checkpoint
    except ConfigError as e:
        raise ConfigError("--checkpoint", e.message) from None
    cfg = _build_config(state["config"], config_path, overrides)
    try:
        relocated = ckpt.check_compatible(
            state["config"], cfg, needs="diagnose measures the checkpoint's run: keep its {}")
    except ConfigError as e:
        if e.field == "privacy.clip_norm":  # (the probes' own C is an option of its own)
            hint = ("leave it as the checkpoint's: --clip-norm sets the probes' C"
                    if clip_norm is not None else "to probe at another clip norm, give "
                                                  "--clip-norm")
            raise ConfigError(e.field, f"{e.message}; {hint}") from None
        raise
    plan = _checked_plan(state, path)
    sigma, C = float(plan["noise_multiplier"]), float(plan["clip_norm"])
    probe_C = C if clip_norm is None else check_clip_norm(clip_norm, "--clip-norm")
    if not noise_fits(sigma, probe_C):  # (sigma * C: the noise a run at that C would add)
        raise ConfigError("--clip-norm", f"sigma * C = {sigma:g} * {probe_C:g} is too large: a "
                                         f"run's noise at that C would overflow float32")
    perf = cfg.performance
    if perf.num_threads is not None:
        torch.set_num_threads(perf.num_threads)
    device = resolve_device(perf)
    check_kernels(perf, device)
    task = build_data(cfg.data, seed=cfg.seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = build_model(cfg.model, task.info).to(device)
    # float64 whatever the run's dtype (a checkpoint's values convert exactly): polar() decides
    # a matrix's rank at float64 precision, and float32 gradients would give the exact null
    # directions (every GPT-2 c_proj gradient is orthogonal to the ones vector, by the next
    # LayerNorm's backward) a rounding-level singular value that it counts as a direction
    frozen = ckpt.frozen_state(model)  # (model.lora, model.trainable) as the run built them
    model = model.double()
    b = int(plan["denominator"])
    engine = ClippingEngine(model, clip_norm=probe_C, ghost=perf.ghost,
                            mode="two_pass" if perf.clipping == "two_pass" else "bookkeeping",
                            kernels=perf.kernels)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    optimizer = build_optimizer(cfg.optim, named, total_steps=int(plan["steps"]),
                                release_noise_std=sigma * C / b, seed=cfg.seed,
                                ns_dtype=perf.newton_schulz_dtype,
                                transposed=transposed_weights(model))
    try:
        ckpt.restore_model(model, state, path, frozen=frozen)
    except (KeyError, ValueError, RuntimeError) as e:
        raise ConfigError("--checkpoint", f"checkpoint {path}: its model does not fit its own "
                                          f"config ({brief(e)})") from None
    try:
        optimizer.load_state_dict(state["optimizer"])
    except ConfigError:
        raise
    except (ValueError, KeyError) as e:
        raise ConfigError("optim", f"does not match the checkpoint's optimizer: {e}") from None
    hist_state = (state["optimizer"].get("history") or {}).get("states", [])
    params = dict(named)
    history = [{n: v.to(device=params[n].device, dtype=params[n].dtype) for n, v in s.items()
                if n in params} for s in hist_state]
    model.eval()
    return LoadedRun(cfg=cfg, checkpoint=path, step=int(state["step"]), task=task, model=model,
                     engine=engine, optimizer=optimizer, device=device, noise_multiplier=sigma,
                     clip_norm=probe_C, denominator=b, history=history, run_clip_norm=C,
                     config_source=str(config_path) if config_path is not None else "checkpoint",
                     overrides=list(overrides), relocated=relocated)


# ------------------------------------------------------------------------------------ selection

def muon_matrices(run: LoadedRun) -> dict[str, str]:
    """name -> optimizer, for every >= 2-D parameter of a Muon-family group, in model order."""
    from dptrain.optim.build import MUON_FAMILY

    owner = {}
    for g in run.optimizer.groups:
        if g.config.optimizer in MUON_FAMILY:
            for n, p in g.named_params:
                if p.dim() >= 2:
                    owner[n] = g.config.optimizer
    return {n: owner[n] for n, _ in run.optimizer.named_params if n in owner}


def _muon_family_names(run: LoadedRun) -> set[str]:
    """Every parameter of a Muon-family group (the "Muon" part of an IM query, as in training)."""
    from dptrain.optim.build import MUON_FAMILY

    return {n for g in run.optimizer.groups if g.config.optimizer in MUON_FAMILY
            for n, _ in g.named_params}


def select_matrices(run: LoadedRun, pattern: str | None = None) -> list[str]:
    """The Muon matrices to probe: all of them, or those whose name ``re.search``-es
    ``pattern``."""
    candidates = muon_matrices(run)
    if not candidates:
        # (named by the run's setting, not --params, which may not have been given)
        raise ConfigError("optim.name", f"the run has no Muon-family matrix (optimizer "
                                        f"{run.cfg.optim.name!r}, no muon/muon_bc/muon_s group): "
                                        f"nothing to probe")
    if pattern is None:
        return list(candidates)
    try:
        rx = re.compile(pattern)
    except re.error as e:
        raise ConfigError("--params", f"not a valid regex: {e}") from None
    chosen = [n for n in candidates if rx.search(n)]
    if not chosen:
        shown = ", ".join(list(candidates)[:8]) + (", ..." if len(candidates) > 8 else "")
        raise ConfigError("--params", f"{pattern!r} matches no Muon matrix (they are: {shown})")
    return chosen


def probe_indices(n: int, m: int) -> np.ndarray:
    """``min(m, n)`` indices spread evenly over ``range(n)`` (deterministic, sorted)."""
    if n < 1:
        raise ConfigError("--probe-examples", "the test split is empty: no probe examples")
    m = int(m)
    if m < 1:
        raise ConfigError("--probe-examples", f"must be >= 1, got {m}")
    return even_subset(n, m)


# ------------------------------------------------------------------------------------ computation

@contextlib.contextmanager
def _at_state(run: LoadedRun, state: dict[str, Tensor] | None) -> Iterator[None]:
    """Evaluate with the parameter values of ``state`` (name -> values); restore afterwards."""
    if not state:
        yield
        return
    params = run.params
    saved = {}
    try:
        with torch.no_grad():
            for n, v in state.items():
                saved[n] = params[n].data.clone()
                params[n].data.copy_(v)
        yield
    finally:
        with torch.no_grad():
            for n, v in saved.items():
                params[n].data.copy_(v)


def per_example_grads(run: LoadedRun, indices: np.ndarray, names: Sequence[str],
                      state: dict[str, Tensor] | None = None) -> dict[str, Tensor]:
    """name -> G[m, *shape]: each probe example's gradient of those parameters at ``state``
    (None: the current model), from a forward and backward of that example alone."""
    from dptrain.trainer import to_device

    params = run.params
    targets = [params[n] for n in names]
    out = {n: torch.empty((len(indices), *params[n].shape), dtype=params[n].dtype,
                          device=params[n].device) for n in names}
    with _at_state(run, state):
        for row, idx in enumerate(indices):
            batch = to_device(run.task.test.collate(np.asarray([idx])), run.device)
            loss = run.task.loss_fn(run.model, batch).sum()
            grads = torch.autograd.grad(loss, targets, allow_unused=True)
            for n, g in zip(names, grads):
                if g is None:
                    out[n][row].zero_()
                else:
                    out[n][row].copy_(g)
    return out


def clip_factors(run: LoadedRun, indices: np.ndarray, plan: list | None = None
                 ) -> tuple[Tensor, Tensor]:
    """(||u_i||, lam_i = min(1, C/||u_i||)) of the probe examples' complete queries under the
    query ``plan`` (None: the current gradient), from the run's clipping engine and its C."""
    from dptrain.trainer import to_device

    mb = run.cfg.performance.microbatch_size
    norms = []
    for s in range(0, len(indices), mb):
        batch = to_device(run.task.test.collate(indices[s:s + mb]), run.device)
        norms.append(run.engine.per_example_norms(run.task.loss_fn, batch, plan))
    n = torch.cat(norms)
    return n, run.engine.clip_factors(n)


def im_plan(run: LoadedRun, query: ImQuery) -> tuple[list, list[float], list[float]]:
    """The clipping engine's query plan of the IM query, and the weights (alpha^M, alpha^A).

    Muon-family parameters are weighted by alpha^M (K, gamma), the others by alpha^A; K = 0 or
    gamma = 0 gives exactly the current-only plan ``[(1.0, None)]``.
    """
    from dptrain.optim.inner_momentum import im_weights

    km, ka = query.effective()
    muon = _muon_family_names(run)
    names = [n for n, _ in run.optimizer.named_params]
    if all(n in muon for n in names):  # no other parameters (a LoRA run): K_A weights nothing
        ka = 0
    need = max(km, ka)
    if need > len(run.history):
        raise ConfigError(
            "--compare-im",
            f"needs {need} past states but the checkpoint's inner-momentum history holds "
            f"{len(run.history)} (diagnose never replays training; train with "
            f"optim.inner_momentum.{'k_muon' if km >= ka else 'k_other'} >= {need} and diagnose "
            f"a checkpoint after at least {need} steps, or lower K)")
    am, aa = im_weights(km, query.gamma_muon), im_weights(ka, query.go)
    if need == 0:
        return [(1.0, None)], am, aa

    def coef(j: int) -> dict[str, float]:
        return {n: ((am[j] if j <= km else 0.0) if n in muon else (aa[j] if j <= ka else 0.0))
                for n in names}

    plan: list = [(coef(0), None)]
    for j in range(1, need + 1):
        plan.append((coef(j), run.history[j - 1]))
    return plan, am, aa


def _chunks(names: Sequence[str], sizes: dict[str, int], budget: int) -> list[list[str]]:
    out: list[list[str]] = []
    cur: list[str] = []
    used = 0
    for n in names:
        if cur and used + sizes[n] > budget:
            out.append(cur)
            cur, used = [], 0
        cur.append(n)
        used += sizes[n]
    if cur:
        out.append(cur)
    return out


ZERO_ERROR = 1e-6
"""Polar/cosine errors and eta_R (dimensionless, O(1) scale) at or below this are zero up to
float rounding (e.g. 1e-8 when nothing is clipped): a ratio against them is undefined."""


def _ratio_minus_one(new: float, old: float) -> float:
    """new / old - 1; 0 when both are (rounding-level) zero, inf when only ``old`` is, nan when
    either is not finite."""
    if not (math.isfinite(new) and math.isfinite(old)):
        return math.nan
    if abs(old) <= ZERO_ERROR:
        return 0.0 if abs(new) <= ZERO_ERROR else math.inf
    return new / old - 1.0


def _lam_stats(norms: Tensor, lam: Tensor) -> dict:
    lam64 = lam.detach().double().cpu()
    return {
        "mean_lambda": float(lam64.mean()),
        "min_lambda": float(lam64.min()),
        "fraction_clipped": float((lam64 < 1.0).double().mean()),
        "norms": [float(x) for x in norms.detach().double().cpu()],
        "lam": [float(x) for x in lam64],
    }


def diagnose(run: LoadedRun, *, probe_examples: int = 64, params: str | None = None,
             compare_im: ImQuery | None = None, max_bytes: int = 1 << 30
             ) -> tuple[dict, dict[tuple[str, str], Tensor]]:
    """Run the probes; returns (the JSON-serialisable report, the matrices whose spectra
    ``spectra_for_plot`` draws: (name, "reference" | "current" | "im") -> float64 matrix, the
    unclipped mean and the clipped means).

    ``max_bytes`` bounds the per-example gradients held at once: the selected matrices are
    processed in groups that fit (each group costs one forward and backward per probe example
    and state).
    """
    names = select_matrices(run, params)
    owners = muon_matrices(run)
    n_test = len(run.task.test)
    indices = probe_indices(n_test, probe_examples)
    m = len(indices)

    plan_cur: list = [(1.0, None)]
    # the IM plan first: a history too short for it is refused before any forward or backward
    plan, am, aa = im_plan(run, compare_im) if compare_im is not None else (None, None, None)
    norms_cur, lam_cur = clip_factors(run, indices, plan_cur)
    im = None
    if compare_im is not None:
        if len(plan) == 1 and plan[0][1] is None:  # K = 0 or gamma = 0: the same query
            norms_im, lam_im = norms_cur, lam_cur
        else:
            norms_im, lam_im = clip_factors(run, indices, plan)
        km, ka = compare_im.effective()
        muon = _muon_family_names(run)
        im = dict(plan=plan, am=am, km=km, norms=norms_im, lam=lam_im,
                  info={"k_muon": compare_im.k_muon, "gamma_muon": compare_im.gamma_muon,
                        "k_other": compare_im.ko, "gamma_other": compare_im.go,
                        "alpha_muon": am, "alpha_other": aa,
                        "other_parameters": sum(1 for n, _ in run.optimizer.named_params
                                                if n not in muon),
                        "history_states": len(run.history)})

    sigma, C, b = run.noise_multiplier, run.clip_norm, run.denominator
    p = run.params
    # G_cur, and with a Muon history G_im plus one past state's G_j while it is summed in.
    per_copy = 3 if im is not None and im["km"] > 0 else 1
    sizes = {n: m * p[n].numel() * p[n].element_size() * per_copy for n in names}
    matrices: dict[str, dict] = {}
    spectra: dict[tuple[str, str], Tensor] = {}
    for chunk in _chunks(names, sizes, max_bytes):
        G_cur = per_example_grads(run, indices, chunk)
        G_im: dict[str, Tensor] = {}
        if im is not None:
            if im["km"] == 0:
                G_im = G_cur  # alpha^M = [1]: the Muon part of the query is the current gradient
            else:
                am = im["am"]
                G_im = {n: G_cur[n] * am[0] for n in chunk}
                for j in range(1, im["km"] + 1):
                    if am[j] == 0.0:
                        continue
                    G_j = per_example_grads(run, indices, chunk, run.history[j - 1])
                    for n in chunk:
                        G_im[n].add_(G_j[n], alpha=am[j])
                    del G_j
        for n in chunk:
            G = G_cur[n]
            reference = G.double().mean(0)
            cands = {"current": (G, lam_cur)}
            if im is not None:
                cands["im"] = (G_im[n], im["lam"])
            s = summarize(reference, cands, noise_multiplier=sigma, clip_norm=C, batch_size=b)
            s.pop("privacy_note", None)
            rows, cols = as_matrix(reference).shape
            noise_fro = sigma * C / b * math.sqrt(rows * cols)
            spectra[(n, "reference")] = reference
            for cname, (Gc, lamc) in cands.items():
                X = clipped_mean(Gc, lamc)
                entry = s["candidates"][cname]
                entry["expected_snr"] = (entry["frobenius_norm"] / noise_fro if noise_fro > 0
                                         else math.inf)
                entry["wedin_threshold"] = wedin_threshold(X, sigma, C)
                spectra[(n, cname)] = X
            entry = {"optimizer": owners[n], "shape": list(G.shape[1:]),
                     "matrix_shape": [rows, cols],
                     "expected_noise_frobenius": noise_fro, **s}
            if im is not None:
                cur, imc = s["candidates"]["current"], s["candidates"]["im"]
                entry["relative_difference"] = {k: _ratio_minus_one(imc[k], cur[k])
                                                for k in METRICS}
            matrices[n] = entry
        del G_cur, G_im

    report: dict = {
        "privacy_note": PRIVACY_NOTE,
        "probe_note": PROBE_NOTE,
        "checkpoint": str(run.checkpoint),
        "step": run.step,
        "config_source": run.config_source,
        "overrides": list(run.overrides),
        "relocated": list(run.relocated),
        "probe": {"split": "test", "public": True, "test_size": n_test, "num_examples": m,
                  "indices": [int(i) for i in indices],
                  "selection": "evenly spaced over the test split",
                  "model_mode": "eval (dropout off), full precision"},
        "release": {"noise_multiplier": sigma, "clip_norm": C, "denominator": b,
                    "noise_std": run.noise_std,
                    "run_clip_norm": C if run.run_clip_norm is None else run.run_clip_norm},
        "clip_factors": {"current": _lam_stats(norms_cur, lam_cur)},
        "compare_im": None,
        "matrices": {n: matrices[n] for n in names},
    }
    if im is not None:
        report["clip_factors"]["im"] = _lam_stats(im["norms"], im["lam"])
        summary = {}
        for k in METRICS:
            vals = [matrices[n]["relative_difference"][k] for n in names]
            finite = [v for v in vals if math.isfinite(v)]
            summary[k] = {
                "mean": statistics.fmean(finite) if finite else math.nan,
                "median": statistics.median(finite) if finite else math.nan,
                "im_lower": sum(1 for n in names if matrices[n]["candidates"]["im"][k]
                                < matrices[n]["candidates"]["current"][k]),
                "matrices": len(names),
            }
        report["compare_im"] = {**im["info"], "relative_difference": summary,
                                "note": "relative_difference = im / current - 1 per matrix "
                                        "(negative: lower for the IM query); both judged "
                                        "against the unclipped current-gradient reference, "
                                        "before noise and outer momentum"}
    return report, spectra


PLOT_MAX_MATRICES = 3
"""``--plot`` draws at most this many matrices (3 curves each), so that the figure stays legible."""


def spectra_for_plot(spectra: dict[tuple[str, str], Tensor], max_matrices: int = PLOT_MAX_MATRICES
                     ) -> tuple[dict[str, Tensor], int]:
    """Label -> matrix for ``plot_spectra``: the first ``max_matrices`` matrices (model order),
    labelled by their names without the common prefix. Returns (curves, matrices left out)."""
    names = list(dict.fromkeys(n for n, _ in spectra))
    shown = names[:max_matrices]
    prefix = ""
    if len(shown) > 1:
        parts = [n.split(".") for n in shown]
        common = 0
        while all(len(p) > common + 1 and p[common] == parts[0][common] for p in parts):
            common += 1
        prefix = ".".join(parts[0][:max(common - 1, 0)])  # keep the last shared segment
    curves = {}
    for (n, kind), X in spectra.items():
        if n in shown:
            short = n[len(prefix) + 1:] if prefix else n
            label = "unclipped mean" if kind == "reference" else f"{kind} clipped mean"
            curves[f"{short}: {label}"] = X
    return curves, len(names) - len(shown)
