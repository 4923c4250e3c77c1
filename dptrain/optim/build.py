"""``build_optimizer``: config + named parameters -> one ``DPOptimizer`` the trainer drives.

Per logical batch the trainer does::

    plan = opt.query_plan()          # [(coef, {name: values} | None), ...] for the clipping engine
    ... clipped sum + noise, / b, written into p.grad ...
    opt.step()                       # filter -> per-group optimizers -> schedule
    opt.zero_grad()
"""

from __future__ import annotations

import dataclasses
import re

import torch

from dptrain.config import ConfigError, validate_tree
from dptrain.optim.config import OptimConfig
from dptrain.optim.filters import Filter, QueryPlan, build_filter
from dptrain.optim.groups import (EMBEDDING_NAME, PRESETS, ParamGroupConfig, ResolvedGroup,
                                  resolve_groups)
from dptrain.optim.ema import ParameterEMA
from dptrain.optim.inner_momentum import InnerMomentumHistory
from dptrain.optim.optimizers import Runtime, construct
from dptrain.optim.schedules import lr_factor

# Optimizers whose parameters form the "Muon" part of an inner-momentum query.
MUON_FAMILY = ("muon", "muon_bc", "muon_s")

__all__ = ["DPOptimizer", "build_optimizer", "plan_groups"]

NamedParams = list[tuple[str, torch.nn.Parameter]]


class DPOptimizer:
    """Filter, then one torch optimizer per parameter group, then the lr schedule.

    Post-processing only: it adds no noise and clips nothing. Its ``step`` must be given
    released gradients (``p.grad`` = the noisy clipped sum over b, the trainer's release, or
    ``examples/own_loop.py``'s); after a plain ``loss.backward()`` it trains without privacy
    (unlike Opacus' optimizer of the same name, which privatises the gradients itself).

    Attributes: ``groups`` (resolved groups, in order), ``optimizers`` (one per group),
    ``filter``, ``num_steps`` (releases applied so far).
    """

    def __init__(self, named_params: NamedParams, groups: list[ResolvedGroup],
                 optimizers: list[torch.optim.Optimizer], filter: Filter, *, schedule: str,
                 total_steps: int, warmup_steps: int = 0, min_lr_ratio: float = 0.0):
        assert len(groups) == len(optimizers)
        self.named_params = list(named_params)
        self.groups = groups
        self.optimizers = optimizers
        self.filter = filter
        self.base_lrs = [float(g.config.lr) for g in groups]
        self._schedule = dict(schedule=schedule, total_steps=total_steps,
                              warmup_steps=warmup_steps, min_lr_ratio=min_lr_ratio)
        self.num_steps = 0
        #: after load_state_dict: group settings where this run's config differs from the
        #: checkpoint's ("label.key: old -> new"); this run's apply
        self.changed_settings: list[str] = []
        self.history: InnerMomentumHistory | None = None
        self.ema: ParameterEMA | None = None
        self._set_lrs()

    def _factor(self) -> float:
        return lr_factor(self._schedule["schedule"], self.num_steps,
                         total_steps=self._schedule["total_steps"],
                         warmup_steps=self._schedule["warmup_steps"],
                         min_lr_ratio=self._schedule["min_lr_ratio"])

    def _set_lrs(self) -> None:
        factor = self._factor()
        for opt, base in zip(self.optimizers, self.base_lrs):
            for group in opt.param_groups:
                group["lr"] = base * factor

    @property
    def lr(self) -> dict[str, float]:
        """Learning rate of each group (by ``keys``) that the next ``step()`` uses."""
        return {k: opt.param_groups[0]["lr"] for k, opt in zip(self.keys, self.optimizers)}

    @property
    def keys(self) -> list[str]:
        """Each group's name in logs: its label, told apart by its config path where several
        groups share one (a name given twice, or a preset's or the default's), so that no
        group's rate is lost (and by its position, should those coincide too)."""
        labels = [g.label for g in self.groups]
        keys = [g.label if labels.count(g.label) == 1 else f"{g.label} ({g.path})"
                for g in self.groups]
        if len(set(keys)) < len(keys):
            keys = [f"{g.label} ({g.path}, group {i})" for i, g in enumerate(self.groups)]
        return keys

    def query_plan(self) -> QueryPlan:
        """Each example's query as [(coefficient, {name: parameter values} or None = current),
        ...]: the filter's (a float coefficient per entry), or inner momentum's (a dict name ->
        coefficient and an RNG seed per entry; ``dptrain.clipping.engine.QueryPlan``).

        Inner momentum's states are views of its history, not copies: use the plan before
        the next :meth:`step`, which overwrites the oldest state of a full history (the
        trainer queries, then steps; a plan kept past a step holds other states)."""
        if self.history is not None:
            return self.history.plan(self.num_steps)
        return self.filter.query_plan(self.named_params)

    @torch.no_grad()
    def step(self) -> None:
        """Post-process the release in ``p.grad``: filter, optimizers, then advance the schedule."""
        if self.history is not None:
            self.history.push()  # theta_t, pre-update: a past state of the next steps' queries
        self.filter.apply(self.named_params)
        gain = self.filter.noise_gain()
        for opt in self.optimizers:
            for group in opt.param_groups:
                group["noise_gain"] = gain
            opt.step()
        self.num_steps += 1
        if self.ema is not None:
            self.ema.update(self.num_steps)
        self._set_lrs()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        """Everything needed to continue bit for bit: step count (schedule position), every
        optimizer's state (momenta, Adam moments, power vectors, MuonBC's probe step), filter,
        inner momentum's history, the parameter EMA."""
        return {
            "num_steps": self.num_steps,
            "groups": [[g.label, [n for n, _ in g.named_params]] for g in self.groups],
            "group_optimizers": [g.config.optimizer for g in self.groups],
            "optimizers": [opt.state_dict() for opt in self.optimizers],
            "filter": self.filter.state_dict(),
            "history": self.history.state_dict() if self.history is not None else None,
            "ema": self.ema.state_dict() if self.ema is not None else None,
        }

    def check_groups(self, state: dict) -> None:
        """ValueError unless ``state`` (a :meth:`state_dict`) has this run's parameter groups:
        the same labels with the same parameters, in order."""
        mine = [[g.label, [n for n, _ in g.named_params]] for g in self.groups]
        if [[label, list(names)] for label, names in state["groups"]] != mine:
            raise ValueError("optimizer state has different parameter groups than this run "
                             f"(saved: {[x[0] for x in state['groups']]}, "
                             f"here: {[x[0] for x in mine]})")

    def load_state_dict(self, state: dict) -> None:
        self.check_groups(state)
        saved_kinds = state.get("group_optimizers")  # absent in checkpoints before 2026-12-01
        for i, g in enumerate(self.groups):
            if saved_kinds is not None and saved_kinds[i] != g.config.optimizer:
                raise ConfigError(_blame(g.path), f"{g.config.optimizer} here, "
                                                  f"{saved_kinds[i]} in the checkpoint (group "
                                                  f"{g.label!r}): a resumed run keeps each "
                                                  "group's optimizer")
        # torch's load_state_dict replaces every group setting with the checkpoint's; this
        # run's config decides them (weight decay, momentum, betas, ns_steps, ns_dtype, ...),
        # as it decides the learning rate
        self.changed_settings = []
        for key, opt, sd in zip(self.keys, self.optimizers, state["optimizers"]):
            mine = [{k: v for k, v in pg.items() if k != "params"} for pg in opt.param_groups]
            opt.load_state_dict(sd)
            for pg, settings in zip(opt.param_groups, mine):
                for k, v in settings.items():
                    if k not in ("lr", "noise_gain") and pg.get(k) != v:
                        self.changed_settings.append(f"{key}.{k}: {pg.get(k)!r} -> {v!r}")
                pg.update(settings)
        if state["filter"]:  # a checkpoint without a filter: this run's starts empty
            self.filter.load_state_dict(state["filter"])
        if self.history is not None:
            self.history.load_state_dict(state["history"])
        if self.ema is not None:  # a checkpoint from before EMA existed or was on: restart
            self.ema.load_state_dict(state.get("ema"))
        self.num_steps = int(state["num_steps"])
        self._set_lrs()


def _check_preset_fits(cfg: OptimConfig, named_params: NamedParams,
                       preset_groups: list[ParamGroupConfig]) -> None:
    """Every preset gives embeddings, position tables and LM heads to ``optim.aux``: one that
    would give such a parameter to ``optim.name`` was written for another model's layout (the
    gpt2 preset, reusing a GPT-2 config, takes a Llama's ``model.embed_tokens`` for a block
    matrix, and a ViT's position table and patch embedding): refused, naming the parameters."""
    matrices = next((g for g in preset_groups if g.name == "matrices"), None)
    if matrices is None:
        return
    pattern = re.compile(matrices.pattern)
    explicit = [re.compile(g.pattern) for g in cfg.groups]  # (they take theirs first)
    embeddings = [n for n, _ in named_params if pattern.search(n) and EMBEDDING_NAME.search(n)
                  and not any(g.search(n) for g in explicit)]
    if embeddings:
        shown = ", ".join(embeddings[:3]) + (", ..." if len(embeddings) > 3 else "")
        raise ConfigError("optim.preset", f"{cfg.preset!r} gives {shown} to {cfg.name} "
                                          f"(optim.name), which the presets keep for "
                                          f"optim.aux (embeddings, position tables, LM heads): "
                                          f"the preset is for another model's layout; use this "
                                          f"model's (gpt2: GPT-2; causal_lm: transformers' "
                                          f"other causal LMs; vit, convnext, nfresnet: timm's) "
                                          f"or explicit optim.groups")


def plan_groups(cfg: OptimConfig, named_params: NamedParams) -> list[ResolvedGroup]:
    """Resolve ``cfg``'s explicit groups, preset and default group over ``named_params``."""
    main = cfg.main_group()
    specs: list[tuple[str, ParamGroupConfig, bool]] = []
    for i, g in enumerate(cfg.groups):
        kwargs = {**cfg.main_options(), **g.kwargs} if g.optimizer == cfg.name else dict(g.kwargs)
        lr = g.lr if g.lr is not None else cfg.lr
        specs.append((f"optim.groups[{i}]", dataclasses.replace(g, lr=lr, kwargs=kwargs), True))
    default = None
    if cfg.preset is not None:
        aux = ParamGroupConfig(pattern="", optimizer=cfg.aux.optimizer,
                               lr=cfg.aux.lr if cfg.aux.lr is not None else cfg.lr,
                               kwargs=dict(cfg.aux.kwargs))
        preset_groups = PRESETS[cfg.preset](named_params, main, aux)
        if not any(g.name == "matrices" for g in preset_groups):
            # e.g. preset nfresnet on GPT-2 (no 4-D weights): optim.name and optim.lr would
            # drive nothing, every parameter going to optim.aux
            adapters = [n for n, _ in named_params if ".lora_A." in n or ".lora_B." in n]
            if adapters and all(EMBEDDING_NAME.search(n) for n in adapters):
                # the model's own preset, LoRA only outside the blocks (an LM head's adapters)
                raise ConfigError("optim.preset", f"{cfg.preset!r}: model.lora adapts no "
                                                  f"layer of the blocks; the adapters outside "
                                                  f"them (an LM head's) go to optim.aux, so "
                                                  f"nothing is left for {cfg.name} "
                                                  f"(optim.name): use optim.preset null and "
                                                  f"optim.name adamw, or target the blocks' "
                                                  f"layers (model.lora.target_modules)")
            raise ConfigError("optim.preset", f"{cfg.preset!r} gives no parameter of this "
                                              f"model to {cfg.name} (optim.name); use the "
                                              f"model's preset or explicit optim.groups (if "
                                              f"model.trainable leaves no matrix of the "
                                              f"preset to train: optim.preset null and "
                                              f"optim.name adamw)")
        _check_preset_fits(cfg, named_params, preset_groups)
        for g in preset_groups:
            specs.append(("optim" if g.name == "matrices" else "optim.aux", g, False))
    elif not cfg.groups or cfg.unmatched == "default":
        default = ("optim", main)
    return resolve_groups(named_params, specs, default)


def _blame(path: str) -> str:
    return "optim.name" if path == "optim" else f"{path}.optimizer"


def build_optimizer(
    cfg: OptimConfig,
    named_params: NamedParams,
    *,
    total_steps: int,
    release_noise_std: float,
    seed: int,
    ns_dtype: str = "float32",
    transposed: frozenset[str] | set[str] = frozenset(),
) -> DPOptimizer:
    """Build the post-processing pipeline for the trainable ``named_params``.

    ``total_steps``: T (for the schedule). ``release_noise_std``: sigma*C/b, the release's noise
    std per coordinate (DP-MuonBC). ``seed``: seed of public post-processing randomness (MuonBC
    probes, MuonS power vectors); derived streams never overlap the release noise. ``ns_dtype``:
    ``performance.newton_schulz_dtype``. ``transposed``: names of weights stored (in, out)
    (transformers' Conv1D; see :func:`transposed_weights`). Raises ConfigError naming the
    offending field.
    """
    validate_tree(cfg, "optim")
    named_params = [(n, p) for n, p in named_params if p.requires_grad]
    runtime = Runtime(seed=int(seed), release_noise_std=float(release_noise_std),
                      ns_dtype=ns_dtype, transposed=frozenset(transposed))
    groups = plan_groups(cfg, named_params)
    optimizers = []
    for g in groups:
        try:
            optimizers.append(construct(g.config.optimizer, g.named_params, lr=g.config.lr,
                                        options=g.config.kwargs, runtime=runtime))
        except (ValueError, TypeError) as e:
            hint = ""
            if (g.config.optimizer in MUON_FAMILY and cfg.preset is None and not cfg.groups
                    and any(p.dim() < 2 for _, p in g.named_params)):
                hint = (f"; set optim.preset ({', '.join(PRESETS)}) to give the vectors and "
                        "embeddings to optim.aux (AdamW), or optim.groups")
            raise ConfigError(_blame(g.path), f"{e}{hint}") from None
        _check_decay(g.path, optimizers[-1])
    opt = DPOptimizer(named_params, groups, optimizers, build_filter(cfg.filter),
                      schedule=cfg.schedule, total_steps=total_steps,
                      warmup_steps=cfg.warmup_steps, min_lr_ratio=cfg.min_lr_ratio)
    if cfg.inner_momentum.enabled:
        muon = {n for g in groups if g.config.optimizer in MUON_FAMILY for n, _ in g.named_params}
        _check_im_has_parameters(cfg, muon, len(named_params) - len(muon))
        opt.history = InnerMomentumHistory(cfg.inner_momentum, named_params, muon, seed)
    if cfg.ema_decay > 0:
        opt.ema = ParameterEMA(named_params, cfg.ema_decay, cfg.ema_start_step)
    return opt


def _check_decay(path: str, optimizer: torch.optim.Optimizer) -> None:
    """lr x weight_decay >= 1 multiplies the weights by 1 - lr wd <= 0 at every step (AdamW's
    and Muon's decoupled decay exactly; SGD's coupled L2 term too without momentum, and with
    it the check is a heuristic: the decay goes through the momentum buffer): their sign
    flips at every step, and past 2 they grow until the run is NaN, without an error. The
    schedule's factor is at most 1, so the base lr is the largest."""
    for pg in optimizer.param_groups:
        lr, wd = float(pg["lr"]), float(pg.get("weight_decay", 0.0))
        if lr * wd >= 1:
            field = "optim.weight_decay" if path == "optim" else f"{path}.kwargs.weight_decay"
            raise ConfigError(field, f"lr x weight_decay = {lr:g} x {wd:g} = {lr * wd:g} >= 1 "
                                     f"multiplies the weights by 1 - lr wd <= 0 at every step; "
                                     f"lower the weight decay (or the learning rate)")


def _check_im_has_parameters(cfg: OptimConfig, muon: set[str], num_other: int) -> None:
    """A history length for a part of the query that has no parameters does nothing: refuse it
    rather than let the user believe DP-Muon-IM is on."""
    im = cfg.inner_momentum
    if im.k_muon > 0 and im.gamma_muon > 0 and not muon:
        raise ConfigError("optim.inner_momentum.k_muon",
                          f"is {im.k_muon} but no parameter uses a Muon-family optimizer "
                          f"({', '.join(MUON_FAMILY)}), so it would do nothing; set it to 0 "
                          f"(k_other averages the other parameters)")
    if im.k_other > 0 and im.gamma_other > 0 and num_other == 0:
        raise ConfigError("optim.inner_momentum.k_other",
                          f"is {im.k_other} but every parameter uses a Muon-family optimizer, "
                          f"so it would do nothing; set it to 0 (k_muon averages those)")


def transposed_weights(model: torch.nn.Module) -> frozenset[str]:
    """Names of the weights that ``model`` stores as (in, out): transformers' ``Conv1D`` (GPT-2's
    attention and MLP matrices). Muon's ``scale: original`` uses fan_out/fan_in, which for these
    is shape[1]/shape[0]."""
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # no transformers: no Conv1D
        return frozenset()
    return frozenset(f"{prefix}.weight" if prefix else "weight"
                     for prefix, m in model.named_modules() if isinstance(m, Conv1D))
