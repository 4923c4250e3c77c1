"""Inner momentum (DP-Muon-IM, Bhusal et al., Algorithm 1): average each example's gradient over
the current model and a short history of past private models BEFORE clipping.

Example i's query at step t is

    u_i = [ sum_{j=0..K_M,t} alpha^M_j grad_M l(theta_{t-j}; x_i),
            sum_{j=0..K_A,t} alpha^A_j grad_A l(theta_{t-j}; x_i) ]

with K_t = min(t, K) and alpha_j = gamma^j / sum_{l=0..K_t} gamma^l (normalised to sum 1, so C
keeps its meaning), clipped as ONE query. Muon parameters and the others (AdamW/SGD) have
separate histories (K_M, gamma_M) and (K_A, gamma_A). K = 0 or gamma = 0 is exactly DP-Muon.

The history holds the pre-update states theta_{t-1}, ..., theta_{t-K}: states computed only from
earlier releases, so evaluating at them is free of extra privacy cost; accounting is unchanged
(one query per example, clipped at C, one release per step). The history holds max(K_M, K_A)
states, each one copy of all the trainable parameters and nothing more; under sharding each rank
keeps its own shards only (the values copied here are whatever ``p.detach()`` holds: the local
shard of an FSDP2 parameter).

Historical evaluations take their own dropout masks: the engine selects the counter-based
dropout stream of plan entry j (``dptrain.models.dropout``: a function of (seed, step, j,
example)). The plan's third element, a seed of (seed, step, j), only seeds torch's global RNG
for that evaluation inside ``fork_rng`` (randomness a model draws outside those dropout
streams), so the current state's forward consumes the global RNG exactly as plain DP-Muon does.
"""

from __future__ import annotations

import hashlib
from collections import deque
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from dptrain.config import ConfigError


@dataclass(kw_only=True)
class InnerMomentumConfig:
    k_muon: int = 0
    """K_M: past states averaged into the Muon parameters' part of the query (0: off)."""
    gamma_muon: float = 0.5
    """gamma_M: geometric weight of the Muon parameters' history."""
    k_other: int = 0
    """K_A: past states for the non-Muon (AdamW/SGD) parameters' part of the query."""
    gamma_other: float = 0.5
    """gamma_A: geometric weight of the non-Muon parameters' history."""

    def validate(self) -> None:
        for f in ("k_muon", "k_other"):
            if getattr(self, f) < 0:
                raise ConfigError(f, f"must be >= 0, got {getattr(self, f)}")
        for f in ("gamma_muon", "gamma_other"):
            if not (0.0 <= getattr(self, f) <= 1.0):
                raise ConfigError(f, f"must be in [0, 1], got {getattr(self, f)}")

    @property
    def enabled(self) -> bool:
        return (self.k_muon > 0 and self.gamma_muon > 0) or (self.k_other > 0 and self.gamma_other > 0)


def im_weights(k: int, gamma: float) -> list[float]:
    """alpha_j = gamma^j / sum_{l=0..k} gamma^l, j = 0..k (gamma = 0: [1, 0, ..., 0])."""
    raw = [gamma ** j if j > 0 else 1.0 for j in range(k + 1)]
    total = sum(raw)
    return [r / total for r in raw]


def _stream_seed(seed: int, step: int, j: int) -> int:
    # (the label is older than the counter-based dropout streams; kept, so that the global RNG
    # of past-state forwards is seeded as before)
    h = hashlib.blake2b(f"dptrain-im-dropout:{seed}:{step}:{j}".encode(), digest_size=8)
    return int.from_bytes(h.digest(), "little") & ((1 << 63) - 1)


class InnerMomentumHistory:
    """The K past states and the query plan they give (see the module docstring)."""

    def __init__(self, cfg: InnerMomentumConfig, named_params: list[tuple[str, nn.Parameter]],
                 muon_names: set[str], seed: int):
        self.cfg = cfg
        self.names = [n for n, _ in named_params]
        self.params = dict(named_params)
        self.muon = set(muon_names)
        self.seed = seed
        depth = max(cfg.k_muon if cfg.gamma_muon > 0 else 0,
                    cfg.k_other if cfg.gamma_other > 0 else 0)
        self.states: deque[dict[str, Tensor]] = deque(maxlen=depth or 1)
        self.depth = depth

    def plan(self, step: int) -> list[tuple]:
        """[(coef dict or 1.0, state or None, RNG seed or absent), ...] for ``step`` (the seed:
        torch's global RNG during entry j's forward; its dropout masks follow j itself)."""
        have = len(self.states) if self.depth else 0
        km = min(have, self.cfg.k_muon) if self.cfg.gamma_muon > 0 else 0
        ka = min(have, self.cfg.k_other) if self.cfg.gamma_other > 0 else 0
        if km == 0 and ka == 0:
            return [(1.0, None)]
        am, aa = im_weights(km, self.cfg.gamma_muon), im_weights(ka, self.cfg.gamma_other)

        def coef(j: int) -> dict[str, float]:
            return {n: ((am[j] if j <= km else 0.0) if n in self.muon
                        else (aa[j] if j <= ka else 0.0)) for n in self.names}

        plan: list[tuple] = [(coef(0), None)]
        for j in range(1, max(km, ka) + 1):
            plan.append((coef(j), self.states[j - 1], _stream_seed(self.seed, step, j)))
        return plan

    @torch.no_grad()
    def push(self) -> None:
        """Record the current (pre-update) parameters as theta_{t}; call before the update."""
        if self.depth == 0:
            return
        if len(self.states) == self.depth:  # full: theta_{t-K} leaves; reuse its storage
            state = self.states.pop()
            for n in self.names:
                state[n].copy_(self.params[n].detach())
        else:
            state = {n: self.params[n].detach().clone() for n in self.names}
        self.states.appendleft(state)

    def state_dict(self) -> dict:
        return {"states": [dict(s) for s in self.states]}

    def load_state_dict(self, state: dict | None) -> None:
        """Restore the saved states, newest first. A resume may change K (an optimizer setting,
        free of privacy cost): the newest ``depth`` states are kept, so theta_{t-j} stays the
        j-th; a checkpoint without a history (inner momentum off) gives an empty one, and K_t
        grows from 0 again. A state must hold exactly this run's trainable parameters, in their shapes."""
        self.states.clear()
        saved = [] if state is None else list(state["states"])
        for s in saved[:self.depth]:
            if set(s) != set(self.names):
                raise ValueError("inner-momentum history of other parameters than this run's "
                                 f"(saved {len(s)}, here {len(self.names)})")
            wrong = [n for n in self.names if tuple(s[n].shape) != tuple(self.params[n].shape)]
            if wrong:  # copy_ would broadcast a (1, d) state into (n, d) without a word
                n = wrong[0]
                raise ValueError(f"inner-momentum history: {n} has shape {tuple(s[n].shape)}, "
                                 f"the parameter {tuple(self.params[n].shape)}")
            # copies: push() reuses a state's storage, which must not be the caller's tensors
            self.states.append({n: v.to(device=self.params[n].device,
                                        dtype=self.params[n].dtype, copy=True)
                                for n, v in s.items()})
