"""One private training run: the loop of README.md's "What one private step is".

    for t in steps:
        S_t  = Poisson sample (seed, t)                     privacy.sampling
        plan = optimizer.query_plan()                        states to evaluate the query at
        sum  = sum over microbatches of sum_i lam_i u_i      clipping.ClippingEngine
        p.grad = (sum + sigma*C*Z_t) / b  for every p        ONE Gaussian release, even if S_t = {}
        ledger.record(sigma, q)                              privacy.accounting
        optimizer.step()                                     post-processing (filters, Muon, ...)

Everything before the release touches private data; everything after it is post-processing.
"""

from __future__ import annotations

import datetime
import functools
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from dptrain.clipping import ClippingEngine, ClippingError
from dptrain.config import ConfigError, said_by_rank_0, to_dict
from dptrain.data import DataConfig, build_data
from dptrain.data.fingerprint import index_fingerprint
from dptrain.data.wds import default_decode_threads
from dptrain.models import ModelConfig, build_model
from dptrain.models.finetune import merged_state, write_adapter
from dptrain.models.dropout import example_dropout
from dptrain.messages import secure_notes
from dptrain.optim import OptimConfig, build_optimizer
from dptrain.optim.build import transposed_weights
from dptrain.performance import PerformanceConfig, check_kernels
from dptrain.privacy.accounting import (NEGLIGIBLE_SIGMA, Ledger, calibrate,
                                        check_plan, epsilon as ledger_epsilon)
from dptrain.privacy.config import NOISE_TAIL, PrivacyConfig, noise_fits
from dptrain.privacy.noise import block_share, chacha20, gaussian_noise, secure_seed
from dptrain.privacy.sampling import poisson_sample, shard_indices
from dptrain.telemetry import json_rows, peak_memory_bytes, strict_json
from dptrain.telemetry.gpu import GpuMonitor
from dptrain.telemetry.progress import LogLines, WarningsUnderBar, progress_bar, tqdm_write
from dptrain.tree import map_tensors
from dptrain.parallel.dist import init_from_env, local_rank, one_verdict
from dptrain.parallel.fsdp import (all_reduce_scalars, apply_fsdp, as_grad, flat_range,
                                   is_sharded, reduce_sum)


@dataclass(kw_only=True)
class TrainConfig:
    log_every: int = 1
    """Steps between metric lines (and epsilon evaluations) in metrics.jsonl (and a line at
    every evaluation, the last step's too)."""
    eval_every: int = 0
    """Steps between test-set evaluations, each in a metrics line of its own step whatever
    log_every; 0 evaluates only at the end."""
    eval_batch_size: int = 128
    """Batch size of evaluation (public test data; no privacy cost)."""
    checkpoint_every: int = 0
    """Steps between checkpoints; 0 writes none but a stop's (SIGTERM: docs/checkpoint.md) and,
    in secure mode, the last step's (its held metrics rows need one); the final model is always
    written."""
    keep_checkpoints: int = 2
    """How many complete checkpoints to keep (the newest complete one is never deleted)."""
    progress: bool = True
    """Show progress on stderr: a bar on a terminal; elsewhere (a cluster job's log file) a
    plain line at most every 30 s and at the last step (``step S/T``, loss, epsilon, seconds
    per step; no rate in secure mode)."""
    generate_prompts: int | None = 0
    """E2E and DART (``data.name: e2e``): at the final evaluation, greedy generations for the
    first this many test meaning representations, scored against all their references: BLEU
    (sacrebleu, multi-reference, case-sensitive as in the inner-momentum paper; uncased as in
    the official E2E script) and ROUGE-L (best over references; rouge_score lower-cases) in
    summary.json as ``test_bleu``, ``test_bleu_uncased``, ``test_rouge_l``,
    ``test_generated_prompts`` (dptrain/eval/text.py says how they differ from the official
    scripts' numbers), the texts in ``final/generations.jsonl`` (``mr``, ``generation``,
    ``references`` per line; with a parameter EMA, ``last_iterate_generations.jsonl`` too).
    Null: every test MR (the papers' protocol), of the whole test file
    (``data.max_test_examples`` limits the NLL's examples, not these); 0: none. The evaluations
    during training (``eval_every``) give NLL only. Public test data: no privacy cost."""
    max_new_tokens: int = 64
    """generate_prompts: the longest generation in tokens (EOS ends one earlier; also capped by
    the model's positions). Byte-level tokenizers need about 4x more."""

    def validate(self) -> None:
        if self.generate_prompts is not None and self.generate_prompts < 0:
            raise ConfigError("generate_prompts", f"must be >= 0 or null (every test MR), got "
                                                  f"{self.generate_prompts}")
        for name in ("log_every", "keep_checkpoints", "eval_batch_size", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(name, f"must be >= 1, got {getattr(self, name)}")
        for name in ("eval_every", "checkpoint_every"):
            if getattr(self, name) < 0:
                raise ConfigError(name, f"must be >= 0, got {getattr(self, name)}")


@dataclass(kw_only=True)
class RunConfig:
    seed: int = 0
    """Seed of the public randomness: model initialisation, synthetic data, augmentation views,
    dropout masks and the optimizers' probes. Not the batches: they come from
    ``privacy.seed``."""
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    performance: PerformanceConfig = field(default_factory=PerformanceConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def validate(self) -> None:
        if not 0 <= self.seed < 2**63:  # torch.manual_seed and numpy take these
            raise ConfigError("seed", f"must be in [0, 2**63), got {self.seed}")
        if (self.performance.decode_threads is not None
                and self.data.name not in ("webdataset", "imagefolder")):
            raise ConfigError("performance.decode_threads",
                              f"applies only to data that decodes image files (webdataset, "
                              f"imagefolder), not {self.data.name}, so it would be ignored; "
                              f"remove it")
        o = self.optim
        if o.filter.name == "doppler":  # c_t != 0 at every step of this run, not a prefix only
            try:
                o.filter.check_normaliser(self.privacy.steps)
            except ConfigError as e:
                raise ConfigError(f"optim.filter.{e.field}", e.message) from None
        if o.ema_decay > 0 and o.ema_start_step >= self.privacy.steps:
            raise ConfigError("optim.ema_start_step",
                              f"{o.ema_start_step} is not before the run's last step "
                              f"(privacy.steps = {self.privacy.steps}): the average would "
                              f"never start, and the exported model would be the last iterate")
        if o.warmup_steps > self.privacy.steps:
            raise ConfigError("optim.warmup_steps",
                              f"{o.warmup_steps} is more than the run's steps (privacy.steps = "
                              f"{self.privacy.steps}): the learning rate would never reach "
                              f"optim.lr")
        if (self.privacy.secure_mode and self.data.name == "webdataset"
                and self.data.num_classes is None):
            raise ConfigError("data.num_classes",
                              "must be given in secure mode: inferred, it is the shards' largest "
                              "label + 1, a function of the private data that the model's head "
                              "would publish outside the guarantee (model.num_classes alone "
                              "does not stop the inference)")
        if self.train.generate_prompts != 0 and self.data.name != "e2e":
            raise ConfigError("train.generate_prompts",
                              f"scores generations against E2E/DART references: it applies only "
                              f"with data.name e2e, not {self.data.name}; set it to 0")


class StopRequested(Exception):
    """Raised by :meth:`Trainer.run` after a requested stop (``Trainer.stop_signal``, set by
    ``dptrain train`` on SIGTERM): every rank finished the same step (or, in an evaluation, the
    same batch: the evaluation is dropped) and, with an output directory, a checkpoint covers
    that step (``checkpoint``: the newest this run wrote, the stop's or a scheduled one; None
    without an output directory, or when the run resumed at that step and wrote none)."""

    def __init__(self, signum: int, step: int, checkpoint: Path | None):
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        super().__init__(f"stopped by signal {signum} after step {step}")


class _EvaluationStopped(Exception):
    """Raised inside an evaluation run by :meth:`Trainer.run` when a stop is agreed (before a
    batch, the same one on every rank)."""

    def __init__(self, signum: int):
        self.signum = signum


def join_ranks(perf: PerformanceConfig) -> tuple[int, int]:
    """(rank, world) of this process in the launcher's process group, which it joins (NCCL on
    CUDA, else gloo; ``performance.collective_timeout_s``) unless it is in it already: the
    trainer calls it, and ``dptrain train`` first, so that the ranks share the output
    directory's lock verdict."""
    backend = "nccl" if resolve_device(perf).type == "cuda" else "gloo"
    timeout = (None if perf.collective_timeout_s is None else
               datetime.timedelta(seconds=perf.collective_timeout_s))
    return init_from_env(backend, timeout=timeout)


def resolve_device(perf: PerformanceConfig) -> torch.device:
    if perf.device == "cpu" or (perf.device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError("performance.device", "cuda requested but no GPU is available")
    return torch.device("cuda", local_rank())


def to_device(batch: Any, device: torch.device) -> Any:
    """The batch's tensors on ``device``, in the same containers (``dptrain.tree``)."""
    return map_tensors(lambda t: t.to(device, non_blocking=True), batch)


def _rows_peak(path: Path) -> float:
    """The highest ``peak_memory_gib`` of the readable rows of a ``metrics.jsonl``; 0 if none
    (no file, secure mode's rows)."""
    values = [row.get("peak_memory_gib") for _, row in json_rows(path)]
    return max((float(v) for v in values if isinstance(v, (int, float))
                and not isinstance(v, bool) and math.isfinite(v)), default=0.0)


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).resolve().parent, timeout=5)
        return out.stdout.strip() or None
    except Exception:
        return None


@dataclass
class PrivacyPlan:
    """The mechanism of the run, derived from PrivacyConfig and the data (all public)."""

    sample_rate: float
    noise_multiplier: float
    clip_norm: float
    denominator: int  # b
    steps: int
    delta: float
    accountant: str
    planned_epsilon: float
    dataset_size: int  # N used for b and calibration
    calibrated_with: str | None = None
    """The accountant whose bound the calibrated sigma meets the target by: ``accountant``, or
    ``rdp`` where ``prv`` could not be used (a target above 100); None: sigma was given."""


def plan_privacy(cfg: PrivacyConfig, train_size: int) -> PrivacyPlan:
    """Calibrate or check sigma; refuse a plan that would exceed the target epsilon."""
    n = cfg.public_dataset_size(train_size)
    b = cfg.release_denominator(train_size)
    if b > n:
        # (an explicit b: a batch of Poisson samples from N examples holds at most N)
        raise ConfigError("privacy.expected_batch_size",
                          f"{b} is more than the dataset size N = {n}, the most a batch can "
                          f"hold")
    if cfg.noise_multiplier is None:
        try:
            sigma, calibrated_with = calibrate(cfg.epsilon, cfg.delta, cfg.sample_rate,
                                               cfg.steps, accountant=cfg.accountant)
        except ConfigError as e:  # calibration names its own arguments (steps, epsilon)
            if e.field.startswith("privacy."):
                raise
            raise ConfigError(f"privacy.{e.field}", e.message) from None
    else:
        sigma, calibrated_with = cfg.noise_multiplier, None
    if not noise_fits(sigma, cfg.clip_norm):
        raise ConfigError(
            "privacy.noise_multiplier" if cfg.noise_multiplier is not None else "privacy.clip_norm",
            f"noise std sigma * C = {sigma:g} * {cfg.clip_norm:g} is too large: the noise "
            f"(up to {NOISE_TAIL:g} times it) would overflow float32 and the model would be NaN")
    eps = check_plan(cfg, sigma)  # ConfigError naming the field if over the budget
    return PrivacyPlan(cfg.sample_rate, sigma, cfg.clip_norm, b, cfg.steps, cfg.delta,
                       cfg.accountant, eps, n, calibrated_with)


GENERATIONS = ("generations.jsonl", "last_iterate_generations.jsonl")
"""The final evaluation's generations under final/: the exported model's, the last iterate's
(with a parameter EMA)."""


PUBLIC_SEED_WARNING = (
    "privacy.seed is set, and it determines the Poisson samples and the noise: anyone who knows "
    "it (it is in the config, summary.json and the checkpoints) can remove the noise, so epsilon "
    "holds only against an adversary without it, and runs that share it share their noise (the "
    "difference of two such models has none). For a release, train with "
    "privacy.secure_mode=true privacy.seed=null (see docs/privacy.md).")


def delta_warning(delta: float, n: int) -> str | None:
    """A line for a delta at or above 1/N (N: the examples the accounting assumes), at which
    (epsilon, delta)-DP allows publishing one example in the clear; None otherwise."""
    if delta * n < 1.0:
        return None
    return (f"privacy.delta = {delta:g} is at least 1/N = 1/{n}: (epsilon, delta)-DP then allows "
            f"a mechanism that publishes one example in the clear; choose delta well below "
            f"1/N (e.g. {1 / (10 * n):.1g})")


def sampling_note(cfg: PrivacyConfig, train_size: int, plan: PrivacyPlan) -> str | None:
    """A line for a plan whose public numbers do not describe the data it samples: a
    ``privacy.dataset_size`` N off the training set's length by more than 10% (b = floor(qN)
    then scales every release by the wrong amount), or an expected batch q * (examples) below
    one example (most releases are then noise alone); None otherwise."""
    expected = cfg.sample_rate * train_size
    if cfg.dataset_size is not None and abs(cfg.dataset_size - train_size) > 0.1 * train_size:
        return (f"privacy.dataset_size N = {cfg.dataset_size} is far from the training set's "
                f"{train_size} examples: each release is divided by b = {plan.denominator}, "
                f"while q * {train_size} = {expected:.4g} examples are expected in a batch "
                f"(privacy.dataset_size=null takes the training set's length)")
    if expected < 1:
        return (f"privacy.sample_rate = {cfg.sample_rate:g} expects {expected:.3g} of the "
                f"{train_size} training examples in a batch: most releases will be noise alone")
    return None


def truncation_note(task, max_length, secure: bool = False) -> str | None:
    """A line for examples cut short at ``data.max_length`` (their EOS and the end of their
    target lost: a model trained on them is not taught to stop; a cut test target changes the
    test NLL's tokens; an example left without a target token adds nothing, while it still
    counts in N and b), ``note: ...``, or ``warning: ...`` when more than half of a split's
    examples keep no target token (a run mostly on noise, a test NLL of a few examples); None
    when none was cut. ``secure``: of the test split only (a count of training examples is an
    exact statistic of the private data: ``messages.secure_notes``; so is whether most of
    them keep no target)."""
    parts, most_empty = [], False
    for name in ("test",) if secure else ("train", "test"):
        split = getattr(task, name)
        cut, empty = getattr(split, "truncated", 0), getattr(split, "no_target", 0)
        if cut:
            parts.append(f"{cut} of {len(split)} {name} examples"
                         + (f" ({empty} of them left without a target token)" if empty else ""))
            most_empty = most_empty or 2 * empty > len(split)
    if not parts:
        return None
    return (f"{'warning' if most_empty else 'note'}: data.max_length = {max_length} cuts "
            f"{' and '.join(parts)} short: their EOS and the end of their target are lost")


def mib_text(mib: float) -> str:
    """A size in MiB for a message: whole MiB from 1 MiB up, 2 significant digits below (a
    tiny model's 0.067 MiB, not "0 MiB"), KiB below 0.01 MiB."""
    if mib >= 1 or mib == 0:
        return f"{mib:.0f} MiB"
    return f"{mib:.2g} MiB" if mib >= 0.01 else f"{mib * 1024:.2g} KiB"


def guarantee(cfg) -> str:
    """What the reported epsilon means for this run's seed handling (written to summary.json)."""
    if cfg.secure_mode:
        return ("(epsilon, delta)-DP of every release against an adversary who sees everything "
                "the run writes: the noise seed came from OS entropy and was never written")
    return ("experiment: privacy.seed (in this summary's config and in the checkpoints) "
            "determines the sampling and the noise; epsilon holds only against an adversary "
            "who does not know it, and for this run alone: runs with the same seed share their "
            "noise (secure_mode: false)")


RANK_LOCAL_SETTINGS = frozenset({
    "data.path", "data.train_file", "data.test_file", "data.tokenizer_path",
    "data.index_cache_dir", "model.pretrained_path", "performance.num_threads",
    "performance.decode_threads", "performance.noise_prefetch", "performance.collate_prefetch",
    "train.progress"})
"""Settings that may differ between ranks: where a node keeps its copy of the files (the data's
content is compared by its digest, ``_check_ranks_agree_on_data``, and the loaded pretrained
weights by theirs, ``_check_ranks_agree_on_weights``) and how fast a rank works on its own.
Every other setting must be the same on every rank."""


def _flat_settings(cfg, prefix: str = "") -> dict:
    """``{"privacy.clip_norm": 1.0, ...}``: one entry per setting (a dict-valued setting, such
    as ``model.timm_kwargs``, is one entry)."""
    import dataclasses

    out = {}
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if dataclasses.is_dataclass(v):
            out.update(_flat_settings(v, f"{prefix}{f.name}."))
        else:
            out[prefix + f.name] = to_dict(v)
    return out


def _check_ranks_agree_on_config(cfg) -> None:
    """Every rank must run one configuration: a rank with another clip norm, noise multiplier
    or epsilon adds its examples at another sensitivity or noise than the accountant assumes
    (the summary still reports the others' epsilon), one with another privacy.seed samples
    another S_t (an example in two ranks' shares), and others hang in a collective. A
    node-local config file or launcher line that differs is refused on every rank, naming the
    first setting that differs, before any data is read."""
    import torch.distributed as dist

    mine = {k: v for k, v in _flat_settings(cfg).items()
            if k not in RANK_LOCAL_SETTINGS}
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    for rank, theirs in enumerate(every):
        if theirs != every[0]:
            key = next(k for k in sorted(set(theirs) | set(every[0]))
                       if theirs.get(k) != every[0].get(k))
            raise said_by_rank_0(ConfigError(
                key, f"rank {rank} runs with {theirs.get(key)!r}, rank 0 with "
                     f"{every[0].get(key)!r}: every rank must run the same configuration (a "
                     f"node-local config file or launcher line that differs?)"))


def _check_ranks_agree_on_data(task, device: torch.device) -> None:
    """Every rank samples S_t over its own copy of the training set and takes its share by
    position: ranks that see different N, or the same N in another order or content
    (node-local copies of the data that differ; ``dptrain.data.fingerprint``), would process
    some sampled examples twice (sensitivity 2C) and drop others. The test split is compared
    too: under FSDP every evaluation forward needs every rank, and test splits of other sizes
    crashed the run in a collective at its final evaluation, after the budget was spent.
    Refuse to start."""
    import torch.distributed as dist

    splits = ("training", "test")
    sizes = [len(task.train), len(task.test)]
    fps = [index_fingerprint(task.train), index_fingerprint(task.test)]
    mine = torch.tensor(sizes + [-1 if fp is None else fp for fp in fps], dtype=torch.int64,
                        device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    every = [t.tolist() for t in every]
    # every rank raises the same refusal: rank 0 prints it once (it was once per rank, and
    # "this rank 23" named no rank)
    for k, split in enumerate(splits):
        seen = [row[k] for row in every]
        if len(set(seen)) > 1:
            raise said_by_rank_0(ConfigError("data", f"the ranks see {split} sets of different "
                                 f"sizes (from {min(seen)} to {max(seen)} examples; "
                                 f"{_each_ranks(seen)}): every rank must read the same data"))
    for k, (split, n) in enumerate(zip(splits, sizes)):
        other = next((r for r, row in enumerate(every) if row[2 + k] != every[0][2 + k]), None)
        if other is not None:
            raise said_by_rank_0(ConfigError("data", f"the ranks see different {split} sets of "
                                 f"{n} examples (their index digests differ, rank {other}'s "
                                 "from rank 0's: other files, labels or order; "
                                 "dptrain/data/fingerprint.py): every rank must read the same "
                                 "data"))


def _each_ranks(seen: list[int], shown: int = 8) -> str:
    """"rank 0: 7, rank 1: 4" for a few ranks; with more, the first ``shown`` ranks whose value
    differs from rank 0's and how many more do (one line per rank of 512 ranks was a 9 KB
    message)."""
    if len(seen) <= shown:
        return ", ".join(f"rank {r}: {n}" for r, n in enumerate(seen))
    other = [r for r, n in enumerate(seen) if n != seen[0]]
    more = len(other) - shown
    return (f"rank 0: {seen[0]}, other sizes on {len(other)} of {len(seen)} ranks: "
            + ", ".join(f"rank {r}: {seen[r]}" for r in other[:shown])
            + (f" and {more} more" if more > 0 else ""))


def _check_ranks_agree_on_weights(model: torch.nn.Module, path: str) -> None:
    """``model.pretrained_path`` may name each node's own copy of the checkpoint: the ranks
    compare a digest of the weights they loaded (every parameter's and buffer's name, shape,
    dtype and bytes) and refuse to start when one differs. Another version of the file trained
    every rank's replica or shards from other weights (exit 0, the ranks' models never met);
    another architecture crashed in a collective."""
    import hashlib

    import torch.distributed as dist

    h = hashlib.blake2b(digest_size=16)
    for name, t in model.state_dict().items():
        t = t.detach()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
        h.update(t.reshape(-1).cpu().contiguous().view(torch.uint8).numpy())  # (no copy)
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, (h.hexdigest(), str(path)))
    if len({d for d, _ in every}) > 1:
        groups: dict[str, list[int]] = {}
        for r, (d, _) in enumerate(every):
            groups.setdefault(d, []).append(r)
        said = "; ".join(
            f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} from "
            f"{', '.join(sorted({every[r][1] for r in ranks}))}" for ranks in groups.values())
        raise said_by_rank_0(ConfigError(
            "model.pretrained_path", f"the ranks loaded {len(groups)} different sets of weights "
                                     f"({said}): every rank must load the same checkpoint"))


def _shared_secure_seed(world: int) -> int:
    """Secure mode: rank 0's seed from OS entropy, sent to every rank over the process group
    (never written). All ranks must draw the same Poisson sample (each takes its share of it:
    with per-rank seeds an example could be in two ranks' shares, doubling its sensitivity) and,
    when replicated, the same noise."""
    try:
        chacha20(0)  # secure mode's generator, found now rather than at the first release
    except ImportError as e:
        raise ConfigError("privacy.secure_mode", str(e)) from None
    seed = secure_seed()
    if world > 1:
        import torch.distributed as dist

        box = [seed]
        dist.broadcast_object_list(box, src=0)
        seed = box[0]
    return seed


def _rows_of(z: Tensor, p: Tensor) -> Tensor:
    """This rank's flat slice of a parameter's noise, shaped as its rows of ``p``."""
    return z.view(-1, *p.shape[1:]) if p.dim() else z.view(())


def busiest_microbatches(n_sampled: int, world: int, microbatch_size: int) -> int:
    """Microbatches of the rank with the largest share of ``n_sampled`` examples: the first
    ranks of :func:`shard_indices` hold ceil(n / W) each (from |S_t| alone, which every rank
    knows, so the count needs neither communication nor the other ranks' shares)."""
    largest = -(-n_sampled // world)  # integer ceilings
    return -(-largest // microbatch_size)


class Trainer:
    """Builds everything from a RunConfig and runs the private loop on one process."""

    def __init__(self, cfg: RunConfig, output_dir: str | Path | None = None):
        self.cfg = cfg
        self.output_dir = Path(output_dir) if output_dir is not None else None
        # secure mode's metrics rows held until a checkpoint covers them (:meth:`run`), which
        # that checkpoint carries; and those of the checkpoint this run resumed in its own
        # directory, for rank 0 to write where a kill after the seal lost them
        self._held_rows: list[str] = []
        self._resumed_rows: list[str] = []
        # the training loop's seconds in the processes before this one (from the checkpoint
        # resumed; None: it did not record them) and how many resumes led here; this
        # process's loop began at _loop[0] and ended at _loop[1] (:meth:`train_seconds`)
        self._trained_before: float | None = 0.0
        self._resumes = 0
        self._loop: tuple[float, float | None] | None = None
        perf = cfg.performance
        if perf.num_threads is not None:
            torch.set_num_threads(perf.num_threads)
        self.device = resolve_device(perf)
        check_kernels(perf, self.device)
        self.rank, self.world = join_ranks(perf)
        if self.world > 1:
            _check_ranks_agree_on_config(cfg)
        # a rank whose data is missing or unreadable (a path that exists on one node only)
        # refuses with the others: alone, it left them in the next collective (gloo: a
        # traceback on rank 0, the log people read; NCCL: a wait until the timeout)
        self.task = self._together(self._data)
        self.train_size = len(self.task.train)
        if self.world > 1:
            _check_ranks_agree_on_data(self.task, self.device)
        self.plan = self._together(plan_privacy, cfg.privacy, self.train_size)
        # Sensitive in secure mode: the seed is never written anywhere.
        self._privacy_seed = (_shared_secure_seed(self.world) if cfg.privacy.secure_mode
                              else cfg.privacy.seed)
        torch.manual_seed(cfg.seed)
        self.model = self._together(build_model, cfg.model, self.task.info, low_precision=(
            perf.dtype == "bfloat16" or perf.fsdp_mixed_precision)).to(self.device)
        if self.world > 1 and cfg.model.pretrained_path is not None:
            _check_ranks_agree_on_weights(self.model, cfg.model.pretrained_path)
        if perf.dtype == "float64":
            self.model = self.model.double()
        self.model.train()
        if perf.sharding == "fsdp" and self.world > 1:
            apply_fsdp(self.model, mixed_precision=perf.fsdp_mixed_precision)
        # (most of its checks run over the first queries, release(); a few layers it refuses
        # when built: nn.MultiheadAttention with trainable weights, parametrizations)
        self.engine = self._together(self._engine)
        # (two_pass's fallback warnings: a step that tells something of the sampled examples)
        self.engine.warn_at_queries = not cfg.privacy.secure_mode
        self.named_params = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        self.optimizer = self._together(
            build_optimizer, cfg.optim, self.named_params, total_steps=self.plan.steps,
            release_noise_std=(self.plan.noise_multiplier * self.plan.clip_norm
                               / self.plan.denominator),
            seed=cfg.seed, ns_dtype=perf.newton_schulz_dtype,
            transposed=transposed_weights(self.model))
        self.ledger = Ledger()
        self.step = 0
        #: gradient canaries of an empirical audit (``dptrain audit``); None in a normal run
        self.audit = None
        #: noise drawn on a background thread during the microbatches (performance.noise_prefetch)
        self.noise_prefetch = (perf.noise_prefetch == "background" or (
            perf.noise_prefetch == "auto" and self.device.type == "cuda"))
        self._noise_thread = None
        #: the next microbatch assembled on a background thread (performance.collate_prefetch)
        self.collate_prefetch = (perf.collate_prefetch == "background" or (
            perf.collate_prefetch == "auto" and self.device.type == "cuda"))
        self._collate_thread = None
        #: set (to a signal number) to stop :meth:`run` at the next step boundary, checkpointed;
        #: ``dptrain train`` sets it on SIGTERM (preemption)
        self.stop_signal: int | None = None
        #: inner momentum's memory, reported once its history is full (not in secure mode)
        self.query_memory: dict | None = None
        #: the generations of the last evaluation that generated (train.generate_prompts), by
        #: the file under final/ that holds them: {"mr", "generation", "references"} per test MR
        self.generations: dict[str, list[dict]] = {}

    # ---------------------------------------------------------------------------------- mechanism

    def sample(self, step: int) -> np.ndarray:
        """S_t: sorted indices of the examples Poisson-sampled at ``step``. Sensitive."""
        return poisson_sample(self._privacy_seed, step, self.train_size, self.plan.sample_rate,
                              secure=self.cfg.privacy.secure_mode)

    def local_sample(self, step: int) -> np.ndarray:
        """This rank's share of S_t (contiguous, balanced; may be empty). Sensitive."""
        return shard_indices(self.sample(step), self.rank, self.world)

    def microbatches(self, indices: np.ndarray) -> list[np.ndarray]:
        mb = self.cfg.performance.microbatch_size
        return [indices[i:i + mb] for i in range(0, len(indices), mb)]

    def with_views(self, plan: list, step: int, indices: np.ndarray) -> list:
        """Augmentation multiplicity: every entry of the query plan evaluated at each of the
        microbatch's K views, with its coefficient divided by K, so that example b's query is
        the mean over views of what it was (``dptrain.data.augment``). Without augmult, the plan
        itself."""
        K = self.task.augmult
        if not K:
            return plan
        views = [functools.partial(self.task.augment, seed=self.cfg.seed, step=step,
                                   indices=indices, view=k) for k in range(K)]
        out = []
        for entry in plan:
            coef = entry[0]
            coef = ({n: a / K for n, a in coef.items()} if isinstance(coef, dict) else coef / K)
            seed = entry[2] if len(entry) > 2 else None
            out.extend((coef, entry[1], seed, view) for view in views)
        return out

    def noise(self, step: int, name: str, p: Tensor) -> Tensor:
        """Z_t for parameter ``name`` (this rank's rows of it when sharded): a pure function of
        (seed, step, name, global coordinate), so the same numbers on any number of ranks."""
        numel, start, end = flat_range(p)  # this rank's coordinates (all of them unsharded)
        return _rows_of(self._noise_flat(step, name, p, numel, start, end), p)

    def _noise_flat(self, step: int, name: str, p: Tensor, numel: int, start: int,
                    end: int, device: torch.device | str | None = None) -> Tensor:
        """Global flat coordinates ``[start, end)`` of Z_t for parameter ``name``, on
        ``device`` (default: the run's). Every draw of the trainer goes through here."""
        return gaussian_noise(self._privacy_seed, step, name, numel, start, end,
                              device=self.device if device is None else device,
                              dtype=self._noise_dtype(p),
                              secure=self.cfg.privacy.secure_mode)

    def _noise_slices(self) -> list[tuple[str, Tensor, int, int, int]]:
        """(name, parameter, numel, start, end) of the noise this rank adds, per trainable
        parameter: its rows when sharded, its block share of a replicated parameter with
        several ranks (summed by the all-reduce), else all of it."""
        out = []
        for index, (name, p) in enumerate(self.named_params):
            if self.world > 1 and not is_sharded(p):
                numel = p.numel()
                lo, hi = block_share(numel, index, self.rank, self.world)
            else:
                numel, lo, hi = flat_range(p)
            out.append((name, p, numel, lo, hi))
        return out

    def _report_undecodable(self, step: int) -> None:
        """The training images of this step that could not be decoded (each added nothing to
        the release), as warnings on this rank's stderr; never in secure mode, where the
        step would tell that the example was sampled then."""
        failed = getattr(self.task.train, "undecodable", None)
        if not failed:
            return
        if not self.cfg.privacy.secure_mode:
            for message in failed:
                # (step + 1: the release this step makes is metrics.jsonl's row step + 1)
                tqdm_write(f"dptrain: warning: step {step + 1}: data.path: {message}; the "
                           "example adds nothing to the releases (clip factor 0)")
        failed.clear()

    def _collated(self, chunks: list) -> Iterator[Any]:
        """``collate`` of each chunk in order; with ``collate_prefetch`` the next chunk's is
        assembled on a background thread while the caller works on the current one (a batch
        is a function of its indices alone: the same batches either way)."""
        collate = self.task.train.collate
        if not self.collate_prefetch or len(chunks) < 2:
            for chunk in chunks:
                yield collate(chunk)
            return
        if self._collate_thread is None:
            from concurrent.futures import ThreadPoolExecutor

            self._collate_thread = ThreadPoolExecutor(1, thread_name_prefix="dptrain-collate")
        pending = self._collate_thread.submit(collate, chunks[0])
        for i in range(len(chunks)):
            batch = pending.result()
            pending = (self._collate_thread.submit(collate, chunks[i + 1])
                       if i + 1 < len(chunks) else None)
            yield batch

    def _start_noise(self, step: int, slices: list):
        """Z_t of ``slices`` (:meth:`_noise_slices`), drawn on a background thread into host
        memory (pinned with CUDA): a future of name -> 1-D tensor. None when inline."""
        if not self.noise_prefetch:
            return None
        if self._noise_thread is None:
            from concurrent.futures import ThreadPoolExecutor

            self._noise_thread = ThreadPoolExecutor(1, thread_name_prefix="dptrain-release")
        pin = self.device.type == "cuda"

        def draw() -> dict[str, Tensor]:
            out = {}
            for name, p, numel, lo, hi in slices:
                z = self._noise_flat(step, name, p, numel, lo, hi, device="cpu")
                out[name] = z.pin_memory() if pin else z
            return out

        return self._noise_thread.submit(draw)

    def _autocast(self):
        if self.cfg.performance.dtype == "bfloat16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        import contextlib

        return contextlib.nullcontext()

    def _together(self, build, *args, **kwargs):
        """``build(*args, **kwargs)``, its refusal (a ConfigError) raised on every rank together
        and said once, by rank 0: a setting every rank refuses alike (a LoRA target that matches
        no module) was printed once per rank, and a rank refusing alone (a file on one node)
        left the others in the next collective. Call it on every rank; ``build`` runs no
        collective."""
        refusal, built = None, None
        try:
            built = build(*args, **kwargs)
        except ConfigError as e:
            refusal = e
        one_verdict(refusal, self.world > 1)
        return built

    def _data(self):
        """The run's data, its decoding threads set and the first examples of each split that
        decodes files decoded."""
        cfg, perf = self.cfg, self.cfg.performance
        with secure_notes(cfg.privacy.secure_mode):  # (no counts of training examples)
            task = build_data(cfg.data, seed=cfg.seed)
        threads = perf.decode_threads or default_decode_threads()
        for split in (task.train, task.test):
            if hasattr(split, "decode_threads"):  # datasets that decode files per step
                split.decode_threads = threads
        for split in (task.train, task.test):
            if hasattr(split, "skip_undecodable") and len(split):
                # a file that no format can read (a wrong data.path, another format) fails
                # here, on a fixed prefix of the split, before any release; one damaged file
                # met later is, in training, an example with clip factor 0 (release()), not an
                # error at the step that sampled it, which would say when it was sampled; in
                # an evaluation, left out of its metrics (said on stderr), rather than
                # stopping the run at its end
                split.collate(np.arange(min(8, len(split))))
                split.skip_undecodable = True
        return task

    def _engine(self) -> ClippingEngine:
        perf = self.cfg.performance
        try:
            return ClippingEngine(
                self.model, clip_norm=self.plan.clip_norm, ghost=perf.ghost,
                mode="two_pass" if perf.clipping == "two_pass" else "bookkeeping",
                kernels=perf.kernels)
        except ClippingError as e:
            raise ConfigError(self._model_field(), str(e)) from None

    def _model_field(self) -> str:
        """The config field that chose the model, for the clipping engine's refusals (over the
        first queries: its checks run on the model's forwards)."""
        return "model.timm_name" if self.cfg.model.name == "timm" else "model.name"

    def release(self, step: int) -> tuple[dict[str, Tensor], dict]:
        """The Gaussian release of logical batch ``step``: (sum_i lam_i u_i + sigma*C*Z) / b
        for every trainable parameter, noise drawn once per coordinate even if the sample is
        empty. Returns (name -> released tensor, aggregate stats for display)."""
        slices = self._noise_slices()
        noise_future = self._start_noise(step, slices)  # drawn while the microbatches run
        sample = self.sample(step)  # S_t, drawn once per release (an O(N) hash)
        indices = shard_indices(sample, self.rank, self.world)
        plan = self.optimizer.query_plan()
        acc: dict[str, Tensor] = {}  # Sensitive: unnoised clipped sum; discarded after release.
        loss_sum, count = 0.0, 0
        sizes = (1, 0, 0)  # the largest microbatch query: (states, bytes held, smallest form's)
        chunks = self.microbatches(indices)
        # Under FSDP every rank must run as many forwards as the busiest one (collectives in
        # forward/backward). Every rank knows S_t, so the count needs no communication; the
        # extra microbatches hold one phantom example whose clip factor is 0.
        num_micro = (busiest_microbatches(len(sample), self.world,
                                          self.cfg.performance.microbatch_size)
                     if self.world > 1 else len(chunks))
        todo = [chunks[i] if i < len(chunks) else np.zeros(1, dtype=np.int64)
                for i in range(num_micro)]
        batches = self._collated(todo)
        with self._autocast():
            for i in range(num_micro):
                phantom = i >= len(chunks)
                chunk = todo[i]
                batch = to_device(next(batches), self.device)
                # False: a phantom example, or an image that could not be decoded
                decoded = batch.pop("decoded", None) if isinstance(batch, dict) else None
                active = torch.zeros(1, dtype=torch.bool) if phantom else decoded
                # dropout masks: a function of (seed, step, state, example), not of the rank
                with example_dropout(self.model, self.cfg.seed, step, chunk):
                    try:
                        stats = self.engine.accumulate(self.task.loss_fn, batch, acc,
                                                       self.with_views(plan, step, chunk),
                                                       active)
                    except ClippingError as e:  # the engine's checks refused the model
                        raise ConfigError(self._model_field(), str(e)) from None
                loss_sum += stats.loss_sum
                count += stats.num_examples
                sizes = max(sizes, (stats.states, stats.query_bytes, stats.least_query_bytes))
        del indices, chunks, todo, batches
        self._report_query_memory(sizes)
        self._report_undecodable(step)
        if self.audit is not None:  # canaries added on one rank: the sums are reduced below
            self.audit.insert(acc, step, dtype=self.engine.acc_dtype(), device=self.device,
                              add=self.rank == 0)
        sigma, C, b = self.plan.noise_multiplier, self.plan.clip_norm, self.plan.denominator
        drawn = noise_future.result() if noise_future is not None else {}
        out = {}
        with torch.no_grad():
            for name, p, numel, lo, hi in slices:
                z = (drawn.pop(name).to(self.device, non_blocking=True) if noise_future is not None
                     else self._noise_flat(step, name, p, numel, lo, hi))
                s = acc.pop(name, None)
                if self.world > 1 and s is None:  # every rank joins every reduction
                    s = torch.zeros(p.shape, device=self.device, dtype=self.engine.acc_dtype())
                if self.world > 1 and not is_sharded(p):
                    # replicated: each rank adds its share of Z before the all-reduce, which
                    # sums the shares into sigma*C*Z once (not drawn W times)
                    s = s.contiguous()
                    s.view(-1)[lo:hi] += (sigma * C * z).to(s.dtype)
                    noisy = reduce_sum(s, p)
                else:
                    if self.world > 1:
                        s = reduce_sum(s, p)
                    noisy = sigma * C * _rows_of(z, p)
                    if s is not None:
                        noisy = noisy + s
                if self.audit is not None and (self.rank == 0 or is_sharded(p)):
                    # (this rank's part of the flat parameter: its rows of a sharded one; a
                    # replicated release, whole, is read on rank 0 only)
                    _, part_lo, part_hi = flat_range(p)
                    self.audit.observe(name, noisy, part_lo, part_hi, step)
                out[name] = as_grad((noisy / b).to(p.dtype), p)
        del acc
        loss_sum, count = all_reduce_scalars(loss_sum, count, device=self.device)
        # Not covered by the guarantee: the training loss is computed without noise.
        return out, {"train_loss": loss_sum / max(count, 1)}

    def _report_query_memory(self, sizes: tuple[int, int, int]) -> None:
        """Once inner momentum's history is full: how much memory its query takes, in
        ``self.query_memory`` (summary.json) and one line on stderr (rank 0). Sizes only, but
        those of this step's microbatches, whose number of examples and padded length come from
        the sample: outside the guarantee, like the training loss, so a secure-mode run neither
        writes nor shows them."""
        hist = self.optimizer.history
        if (self.query_memory is not None or hist is None or sizes[0] < 2
                or len(hist.states) < hist.depth or self.cfg.privacy.secure_mode):
            return
        mib = 2 ** 20

        def local(v: Tensor) -> Tensor:  # an FSDP2 shard's own storage, not the global size
            return v.to_local() if hasattr(v, "to_local") else v

        history = sum(local(v).numel() * v.element_size()
                      for st in hist.states for v in st.values())
        self.query_memory = {
            "evaluations": sizes[0], "microbatch_size": self.cfg.performance.microbatch_size,
            "query_mib": sizes[1] / mib, "least_query_mib": sizes[2] / mib,
            "history_mib": history / mib, "ghost": self.cfg.performance.ghost}
        if self.rank == 0:
            q = self.query_memory
            tqdm_write(
                f"dptrain: inner momentum makes {q['evaluations']} evaluations (model states x "
                f"augmentation views) per microbatch of up to {q['microbatch_size']}; until the "
                f"clip factors are known its query holds "
                f"{mib_text(q['query_mib'])} (performance.ghost={q['ghost']}; the smaller form "
                f"of every parameter, performance.ghost=memory: "
                f"{mib_text(q['least_query_mib'])}), and the history "
                f"{mib_text(q['history_mib'])}"
                + (" on this rank" if self.world > 1 else "")
                + "; activations not counted (sizes of this step's microbatches, outside the "
                "guarantee)")

    @staticmethod
    def _noise_dtype(p: Tensor) -> torch.dtype:
        return torch.float64 if p.dtype == torch.float64 else torch.float32

    def private_step(self) -> dict:
        """One logical batch: one release, recorded in the ledger, then the optimizer."""
        t = self.step
        if self.ledger.num_releases >= self.plan.steps:
            raise ConfigError("privacy.steps", f"the planned {self.plan.steps} releases are spent; "
                                               "another would exceed the privacy budget")
        released, stats = self.release(t)
        for name, p in self.named_params:
            p.grad = released.pop(name)
        self.ledger.record(self.plan.noise_multiplier, self.plan.sample_rate)
        lr = self.optimizer.lr  # the rates this step applies (the property gives the next's after)
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.step += 1
        return {"step": self.step, **stats, "lr": lr}

    def _stop_agreed(self) -> int:
        """The signal number of a requested stop if any rank has one, else 0; the same on every
        rank (one scalar all-reduce per step with several ranks), so that all stop after the
        same step and take part in the same checkpoint."""
        (agreed,) = all_reduce_scalars(self.stop_signal or 0, device=self.device, op="max")
        return int(agreed)

    def _peak_memory_gib(self) -> float:
        """The highest of the ranks' memory peaks since the last call
        (``dptrain.telemetry.peak_memory_bytes``: CUDA, allocated; CPU, resident), in GiB.
        Collective with several ranks."""
        (peak,) = all_reduce_scalars(peak_memory_bytes(self.device, reset=True),
                                     device=self.device, op="max")
        return peak / 2**30

    def _gpu_row(self, gpu: GpuMonitor) -> dict[str, float]:
        """NVML's view of the GPUs since the last row (``dptrain.telemetry.gpu``): utilisation
        and power, means over the ranks that report them, and device memory in use, the highest
        rank's; nothing for ranks without CUDA. Collective with several CUDA ranks."""
        if self.device.type != "cuda":  # the same on every rank: no collective on CPU runs
            return {}
        w = gpu.window() or {}
        has_power = "gpu_power_w" in w
        n, util, n_power, power = all_reduce_scalars(
            float(bool(w)), w.get("gpu_util_pct", 0.0), float(has_power),
            w.get("gpu_power_w", 0.0), device=self.device)
        (memory,) = all_reduce_scalars(w.get("gpu_memory_used_gib", 0.0), device=self.device,
                                       op="max")
        row = {}
        if n:
            row.update(gpu_util_pct=util / n, gpu_memory_used_gib=memory)
        if n_power:
            row["gpu_power_w"] = power / n_power
        return row

    def _gpu_energy_kwh(self, gpu: GpuMonitor) -> float | None:
        """The energy every rank's GPU used during training, summed, in kWh (NVML's counter);
        None without it. Collective with several CUDA ranks."""
        if self.device.type != "cuda":
            return None
        joules = gpu.energy_j()
        n, total = all_reduce_scalars(float(joules is not None), joules or 0.0,
                                      device=self.device)
        return total / 3.6e6 if n == self.world else None

    def epsilon(self) -> float:
        if self.ledger.num_releases == 0:
            return 0.0
        return ledger_epsilon(self.ledger, self.plan.delta, self.plan.accountant)

    def print_start_notes(self) -> None:
        """What a run says on stderr before its first step (the dry run says it too): the
        seed's meaning without secure mode, a delta at or above 1/N, a dataset size or sample
        rate that does not fit the data, no noise at all, no learning rate at all, examples
        cut at ``data.max_length``, sharding asked of one rank."""
        lines = [] if self.cfg.privacy.secure_mode else [PUBLIC_SEED_WARNING]
        # (the examples sampled from, or a larger public N: privacy.dataset_size need not be
        # the training set's length)
        small_delta = delta_warning(self.cfg.privacy.delta,
                                    max(self.train_size, self.plan.dataset_size))
        if small_delta is not None:
            lines.append(f"warning: {small_delta}")
        sampling = sampling_note(self.cfg.privacy, self.train_size, self.plan)
        if sampling is not None:
            lines.append(f"warning: {sampling}")
        if self.plan.noise_multiplier < NEGLIGIBLE_SIGMA:
            lines.append(f"warning: privacy.noise_multiplier = {self.plan.noise_multiplier:g}: "
                         f"the releases hold no noise to speak of and epsilon is infinite (a "
                         f"clipped, non-private baseline)")
        if not any(self.optimizer.base_lrs):
            lines.append("warning: every parameter group's learning rate is 0 (optim.lr, and "
                         "optim.aux.lr or the groups' lr): the model will not move, while each "
                         "step still spends its share of the privacy budget")
        cut = truncation_note(self.task, self.cfg.data.max_length,
                              secure=self.cfg.privacy.secure_mode)
        if cut is not None:
            lines.append(cut)
        if self.world == 1 and self.cfg.performance.sharding == "fsdp":
            lines.append("note: performance.sharding=fsdp with one rank: nothing is sharded "
                         "(the same run as sharding=none; launch several ranks to shard)")
        for line in lines:
            print(f"dptrain: {line}", file=sys.stderr)

    def evaluate(self, generate: bool = False, stoppable: bool = False) -> dict:
        """Test metrics of the model; with a parameter EMA (``optim.ema_decay``), of the average,
        and of the last iterate as ``last_iterate_*``. ``generate``: also BLEU and ROUGE-L of
        greedy generations (``train.generate_prompts``; the final evaluation). ``stoppable``
        (:meth:`run`'s evaluations): a stop signal ends it before the next batch, raising
        ``_EvaluationStopped`` (a collective per batch with several ranks)."""
        ema = self.optimizer.ema
        poll = self._poll_stop if stoppable else None
        metrics, texts = self._evaluate(generate, poll)
        if ema is None:
            if texts is not None:
                self.generations = {"generations.jsonl": texts}
            return metrics
        with ema.swapped_in():
            averaged, averaged_texts = self._evaluate(generate, poll)
        if averaged_texts is not None:
            self.generations = {"generations.jsonl": averaged_texts,
                                "last_iterate_generations.jsonl": texts}
        return {**averaged, **{f"last_iterate_{k}": v for k, v in metrics.items()}}

    def _poll_stop(self) -> None:
        if signum := self._stop_agreed():
            raise _EvaluationStopped(signum)

    def _evaluate(self, generate: bool = False, poll=None) -> tuple[dict, list[dict] | None]:
        """(the test metrics, the generations when it generated)."""
        tc = self.cfg.train
        texts = None
        self.model.eval()
        try:
            metrics = self.task.evaluate(self.model, self.task.test, tc.eval_batch_size,
                                         poll=poll)
            if generate and tc.generate_prompts != 0:
                # every rank generates the same prompts (FSDP2's forwards are collective)
                from dptrain.eval.text import generate_and_score

                refs = self.task.test.references_by_mr(max_prompts=tc.generate_prompts)
                scores = generate_and_score(self.model, self.task.tokenizer, refs,
                                            max_new_tokens=tc.max_new_tokens,
                                            batch_size=tc.eval_batch_size,
                                            progress=tc.progress and self.rank == 0,
                                            poll=poll, return_texts=True)
                texts = [{"mr": mr, "generation": text, "references": list(refs[mr])}
                         for mr, text in zip(refs, scores["texts"])]
                metrics.update(bleu=scores["bleu"], bleu_uncased=scores["bleu_uncased"],
                               rouge_l=scores["rouge_l"],
                               generated_prompts=scores["num_prompts"])
                if scores["no_room"] and self.rank == 0:
                    tqdm_write(f"dptrain: note: {scores['no_room']} of {scores['num_prompts']} "
                               f"test prompts fill the model's positions: nothing is generated "
                               f"for them, and they score as empty texts in BLEU and ROUGE-L "
                               f"(model.n_positions, or shorter prompts)")
        except _EvaluationStopped:
            # its undecodable images are not reported: the next evaluation finds its own
            getattr(self.task.test, "undecodable", []).clear()
            raise
        finally:
            self.model.train()  # (Task.evaluate reshards FSDP2's root after its forwards)
        failed = getattr(self.task.test, "undecodable", None)
        if failed:
            if self.rank == 0:
                tqdm_write(f"dptrain: warning: {len(failed)} test image(s) could not be decoded "
                           f"and are left out of the test metrics ({metrics.get('examples')} "
                           f"examples scored): {'; '.join(failed[:3])}")
            failed.clear()
        return metrics, texts

    # ---------------------------------------------------------------------------------- the run

    def run(self) -> dict:
        from dptrain import checkpoint as ckpt

        tc = self.cfg.train
        out = self.output_dir
        main = self.rank == 0  # only rank 0 writes files and shows progress
        metrics_file = self._open_metrics() if out is not None and main else None
        if main:
            self.print_start_notes()
        # a bar on a terminal; into a log file, where a bar's carriage returns make one line of
        # every update, plain lines
        bar = progress_bar(tc.progress and main, total=self.plan.steps, initial=self.step,
                           desc="dptrain", unit="step")
        lines = LogLines(self.plan.steps, self.step, rate=not self.cfg.privacy.secure_mode,
                         enabled=tc.progress and main and bar.disable)
        # Secure mode: metrics rows are written only once a checkpoint covers their step (with
        # checkpoint_every 0: the last step's, written for them, or the one a stop writes). A
        # resume there draws the releases after the checkpoint again with fresh noise, which is
        # free only if nothing derived from the lost ones was written (a crash drops the held
        # rows with them; a restart from no checkpoint draws every release again).
        held = self.cfg.privacy.secure_mode
        pending = self._held_rows  # (a checkpoint carries those it covers: ckpt.save)
        pending.clear()
        if metrics_file and self._resumed_rows:
            self._write_lost_rows(out / "metrics.jsonl", metrics_file)

        def flush() -> None:
            if metrics_file and pending:
                metrics_file.write("".join(pending))
                metrics_file.flush()
            pending.clear()

        eps, eps_step = self.epsilon(), self.step  # shown with its step: computed every log_every
        start = time.time()
        self._loop = (start, None)
        peak_gib = self._peak_so_far()
        peak_memory_bytes(self.device, reset=True)  # rows measure the steps, not the build
        gpu = GpuMonitor(self.device).start()  # off (and silent) without CUDA
        if main and gpu.reason and self.device.type == "cuda":
            tqdm_write(f"dptrain: no GPU telemetry in metrics.jsonl: {gpu.reason}")
        warnings_shown = WarningsUnderBar(bar)
        try:
            # the step of the newest checkpoint in this run's directory and its path, once
            # this run has written it
            saved_step, saved_path = (self.step if self._has_own_checkpoint() else -1), None
            diverged = False
            while True:
                # (also after the last step: a stop there checkpoints it rather than going on
                # into the final evaluation, which a scheduler's SIGKILL could cut short)
                if signum := self._stop_agreed():
                    # every rank at the same step boundary: checkpoint it unless that is done,
                    # then stop
                    if out is not None and saved_step != self.step:
                        saved_step, saved_path = self.step, ckpt.save(self, out)
                        flush()
                    raise StopRequested(signum, self.step, saved_path)
                if self.step >= self.plan.steps:
                    break
                row = self.private_step()
                diverged = self._public_row(row, diverged)
                last = self.step == self.plan.steps
                # (the final evaluation follows the loop)
                evaluate = bool(tc.eval_every) and self.step % tc.eval_every == 0 and not last
                # a row at every log_every-th step, the last, and every evaluation (whose
                # metrics it holds, unless a stop signal dropped it: then it has none)
                if self.step % tc.log_every == 0 or last or evaluate:
                    eps, eps_step = self.epsilon(), self.step
                    row["epsilon"] = eps
                    peak_gib = self._measure_row(row, gpu, evaluate, peak_gib)
                    if metrics_file:
                        pending.append(strict_json(row) + "\n")
                        if not held:
                            flush()
                shown = f"{eps:.3f}" if eps_step == self.step else f"{eps:.3f} at step {eps_step}"
                bar.set_postfix(**({"loss": f"{row['train_loss']:.4f}"} if "train_loss" in row
                                   else {}), eps=shown)
                bar.update(1)
                lines.update(self.step, row.get("train_loss"), shown)
                if out is not None and tc.checkpoint_every and (
                        self.step % tc.checkpoint_every == 0 or last):
                    # every rank calls: sharded runs write their shards (DCP)
                    saved_step, saved_path = self.step, ckpt.save(self, out)
                    flush()
            if held and out is not None and saved_step != self.step:
                # secure mode holds its rows until a checkpoint covers them: with
                # checkpoint_every 0 that is one of the last step, before the final evaluation
                # (rows on disk without one would refuse every resume after a kill there);
                # on every rank (a sharded save is collective)
                saved_step, saved_path = self.step, ckpt.save(self, out)
            flush()
        finally:
            trained = time.time() - start  # the loop: steps, its evaluations and checkpoints
            self._loop = (start, start + trained)
            warnings_shown.close()
            bar.close()
            gpu.close()
            if main and gpu.reason and gpu.reason.startswith("NVML sampling stopped"):
                tqdm_write(f"dptrain: GPU telemetry ended early: {gpu.reason}")
            # the per-example buffers of multi-state queries (private data): not needed now
            self.engine.release_workspace()
            if metrics_file:
                metrics_file.close()
        final = self._final_evaluation(saved_step, saved_path)
        summary = self._summary(final, start, trained, peak_gib, gpu)
        self._write_final(summary)  # collective under sharding: every rank
        return summary

    def _open_metrics(self):
        """``metrics.jsonl``, opened to append (rank 0, with an output directory), before the
        first release: the CLI checked the folder, but root passes every access check, and a
        file system can refuse anyway. ConfigError naming output-dir."""
        out = self.output_dir
        try:
            out.mkdir(parents=True, exist_ok=True)
            return open(out / "metrics.jsonl", "a")
        except OSError as e:
            raise ConfigError("output-dir", f"cannot write {out}: {e.strerror or e}") from None

    def train_seconds(self) -> float | None:
        """The training loop's wall time so far, over this process and those whose checkpoints
        it continues (their time after their last checkpoint, redone here, is not counted);
        None after resuming a checkpoint that did not record it."""
        now = 0.0
        if self._loop is not None:
            start, end = self._loop
            now = (time.time() if end is None else end) - start
        return None if self._trained_before is None else self._trained_before + now

    def _peak_so_far(self) -> float | None:
        """The highest ``peak_memory_gib`` of the run's rows, those before a resume included
        (None: secure mode, or no row yet); the same on every rank (collective)."""
        out = self.output_dir
        earlier = (_rows_peak(out / "metrics.jsonl") if self.rank == 0 and out
                   and not self.cfg.privacy.secure_mode else 0.0)
        (peak,) = all_reduce_scalars(earlier, device=self.device, op="max")
        return peak or None

    def _has_own_checkpoint(self) -> bool:
        """Whether this run's directory holds a checkpoint of the current step (a run resumed
        there starts at one; step 0 needs none; a branch resumed from another run's checkpoint
        has none yet); the same answer on every rank (a stop's save is collective)."""
        from dptrain import checkpoint as ckpt

        out = self.output_dir
        has_own = self.step == 0 or out is None or self.step in ckpt.complete_steps(out)
        (owners,) = all_reduce_scalars(float(has_own), device=self.device)
        return owners == self.world

    def _public_row(self, row: dict, diverged: bool) -> bool:
        """Drop what secure mode must not write from a step's ``row`` (its training loss,
        computed from the private batch without noise: outside the guarantee), and otherwise
        say once that the loss went non-finite; returns whether it has."""
        if self.cfg.privacy.secure_mode:
            row.pop("train_loss", None)
        elif not diverged and "train_loss" in row and not math.isfinite(row["train_loss"]):
            diverged = True  # said once (the loss is in metrics.jsonl anyway)
            if self.rank == 0:
                tqdm_write(f"dptrain: note: the training loss is {row['train_loss']} at step "
                           f"{self.step}: every example with a non-finite loss or gradient gets "
                           f"clip factor 0, so the releases from here may be noise alone (a "
                           f"learning rate or weight decay too large?)")
        return diverged

    def _final_evaluation(self, saved_step: int, saved_path: Path | None) -> dict:
        """The final evaluation (with generations). A stop there (it can outlast a scheduler's
        grace period) checkpoints the last step unless ``saved_step`` is it, and raises
        StopRequested; ``--resume auto`` then evaluates."""
        from dptrain import checkpoint as ckpt

        try:
            return self.evaluate(generate=True, stoppable=True)
        except _EvaluationStopped as e:
            if self.output_dir is not None and saved_step != self.step:
                saved_path = ckpt.save(self, self.output_dir)
            raise StopRequested(e.signum, self.step, saved_path) from None

    def _measure_row(self, row: dict, gpu, evaluate: bool,
                     peak_gib: float | None) -> float | None:
        """Add a logged row's time, memory and GPU readings (not in secure mode) and, at an
        evaluation step, the test metrics; return the run's peak memory so far."""
        if not self.cfg.privacy.secure_mode:
            # a step's time and memory follow its realised batch (the number of examples and,
            # for text, the padded length: side channels on the sample): a run meant for
            # release does not write them per row
            row["time"] = self.train_seconds()
            row["peak_memory_gib"] = self._peak_memory_gib()
            peak_gib = max(peak_gib or 0.0, row["peak_memory_gib"])
            row.update(self._gpu_row(gpu))
        if evaluate:
            try:
                row.update({f"test_{k}": v for k, v in self.evaluate(stoppable=True).items()})
            except _EvaluationStopped:
                pass  # the row goes without it; the stop follows at this step's end
            peak_memory_bytes(self.device, reset=True)  # the next row: training
            gpu.window()  # likewise
        return peak_gib

    def _summary(self, final: dict, start: float, trained: float, peak_gib: float | None,
                 gpu) -> dict:
        """summary.json's contents: the guarantee spent, the final metrics, the run's cost."""
        return {
            "epsilon": self.epsilon(),
            "delta": self.plan.delta,
            "steps": self.step,
            "noise_multiplier": self.plan.noise_multiplier,
            "sample_rate": self.plan.sample_rate,
            "clip_norm": self.plan.clip_norm,
            "expected_batch_size": self.plan.denominator,
            "dataset_size": self.plan.dataset_size,
            "accountant": self.plan.accountant,
            "calibrated_with": self.plan.calibrated_with,
            "metrics": final,
            **{f"test_{k}": v for k, v in final.items()},
            "seed": self.cfg.seed,
            "secure_mode": self.cfg.privacy.secure_mode,
            "guarantee": guarantee(self.cfg.privacy),
            "git_commit": git_commit(),
            "train_seconds": self.train_seconds(),
            "resumes": self._resumes,
            "world_size": self.world,  # (this process's ranks; a resume may change it)
            "final_eval_seconds": time.time() - start - trained,
            "peak_memory_gib": peak_gib,
            "gpu_energy_kwh": self._gpu_energy_kwh(gpu),
            "inner_momentum_memory": self.query_memory,
            "config": to_dict(self.cfg),
        }

    def _write_final(self, summary: dict) -> None:
        """Export the final model under ``final/`` (the EMA, which was evaluated, when there is
        one, and the last iterate), its transformers folder and LoRA adapter, the final
        evaluation's generations (``generations.jsonl``), then ``summary.json``, which marks
        the run finished. Collective under sharding (the full
        state dicts): every rank calls it, rank 0 writes."""
        from dptrain import checkpoint as ckpt

        out = self.output_dir
        write = out is not None and self.rank == 0
        ema = self.optimizer.ema
        # LoRA: the adapters alone, for peft (only when they are all that was trained), of the
        # evaluated model
        adapter = (lambda sd: write_adapter(sd, self.model, self.cfg.model.lora,
                                            out / "final" / "adapter",
                                            self.cfg.model.pretrained_path))
        if ema is not None:  # the evaluated model, the average, is the exported one
            # written inside: on CPU the state dict holds the parameters themselves, which
            # leaving the block sets back to the last iterate (final/adapter held that one)
            with ema.swapped_in():
                evaluated = self.full_state_dict()  # collective under sharding
                if write:
                    self.export(out / "final", evaluated)
                    adapter(evaluated)
        state = self.full_state_dict()  # collective under sharding: every rank takes part
        if write:
            self.export(out / "final", state,
                        "model.safetensors" if ema is None else "last_iterate.safetensors")
            ckpt.export_hf(self, out / "final")  # GPT-2, causal_lm: final/hf/ for transformers
            if ema is None:
                adapter(state)
                # (an earlier attempt's, with an EMA: this run's final model is the iterate)
                (out / "final" / "last_iterate.safetensors").unlink(missing_ok=True)
            for name in GENERATIONS:  # (train.generate_prompts)
                path = out / "final" / name
                if name not in self.generations:  # (an earlier attempt's, with other settings)
                    path.unlink(missing_ok=True)
                    continue
                tmp = out / "final" / f"{name}.tmp"
                tmp.unlink(missing_ok=True)  # (a link there: written through, not replaced)
                tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n"
                                       for r in self.generations[name]), encoding="utf-8")
                os.replace(tmp, path)
            # last: summary.json marks the run finished (--resume auto then does nothing)
            tmp = out / "summary.json.tmp"
            tmp.unlink(missing_ok=True)
            tmp.write_text(strict_json(summary, indent=2, default=str))
            os.replace(tmp, out / "summary.json")

    def _write_lost_rows(self, path: Path, metrics_file) -> None:
        """The rows the resumed checkpoint covers that ``metrics.jsonl`` lacks (secure mode: a
        kill between the checkpoint's seal and the rows' write lost them for good before)."""
        logged = {row.get("step") for _, row in json_rows(path)}
        lost = [r for r in self._resumed_rows if json.loads(r).get("step") not in logged]
        if lost:
            metrics_file.write("".join(lost))
            metrics_file.flush()
            tqdm_write(f"dptrain: wrote {len(lost)} metrics row(s) of the checkpoint that "
                       f"metrics.jsonl lacked (a stop after the checkpoint, before the rows)")
        self._resumed_rows = []

    def full_state_dict(self) -> dict[str, Tensor]:
        """The whole model's state on CPU (gathered from all ranks when sharded). Unsharded on
        CPU its tensors are the parameters' own storage, not copies: use it before the
        parameters change (an EMA swapped out)."""
        if self.world > 1 and self.cfg.performance.sharding == "fsdp":
            from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                                 get_model_state_dict)

            state = get_model_state_dict(self.model, options=StateDictOptions(
                full_state_dict=True, cpu_offload=True))
            # The gathered tensors are views of FSDP's padded all-gather buffers (a 33-row
            # weight on 2 ranks lives in a 34-row storage), which safetensors refuses: compact
            # them, and give tied names (GPT-2's wte/lm_head) one tensor again.
            state = {k: v.clone() for k, v in state.items()}
            first: dict[int, str] = {}
            for n, p in self.model.named_parameters(remove_duplicate=False):
                if n in state and id(p) in first and first[id(p)] in state:
                    state[n] = state[first[id(p)]]
                first.setdefault(id(p), n)
            return state
        return {k: v.detach().cpu() for k, v in self.model.state_dict().items()}

    def export(self, directory: Path, state: dict[str, Tensor] | None = None,
               filename: str = "model.safetensors") -> None:
        """The full, unsharded model: ``model.safetensors`` (tied tensors stored once; LoRA
        adapters merged into their layers, so that the file is the original architecture's)."""
        from safetensors.torch import _remove_duplicate_names, save_file

        state = self.full_state_dict() if state is None else state
        state = merged_state(state, self.model)
        # _remove_duplicate_names maps a kept name to the names sharing its storage; of each
        # such group only the first name in state order is written (GPT-2: transformer.wte,
        # the name transformers' from_pretrained expects), every other tensor as it is.
        order = {k: i for i, k in enumerate(state)}
        drop: set[str] = set()
        for kept, removed in _remove_duplicate_names(state).items():
            drop.update(sorted([kept, *removed], key=order.__getitem__)[1:])
        tensors = {k: v.contiguous() for k, v in state.items() if k not in drop}
        directory.mkdir(parents=True, exist_ok=True)
        tmp = directory / f"{filename}.tmp"
        save_file(tensors, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, directory / filename)
