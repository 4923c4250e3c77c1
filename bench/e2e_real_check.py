"""Real checks of issues 3 and 4 on E2E-small (train on devset.csv, test on testset_w_refs.csv).

Issue 3: test NLL per target token of DP-SGD, DP-AdamW, DP-Muon, DP-MuonBC, DP-Muon-S, DiSK-Muon
and DOPPLER-Muon, two seeds each. Issue 4: DP-Muon-IM against DP-Muon, three seeds each (the
DP-Muon runs' seeds), test NLL plus BLEU and ROUGE-L of greedy generations on test prompts.

Every method uses the same base config (configs/e2e_small.yaml) and therefore the same release
(q, T, C, sigma calibrated to epsilon 8): methods differ only in ``optim.*`` overrides, i.e. in
post-processing and (DiSK, IM) in the public points the per-example query is evaluated at.
Seed s sets ``seed`` (model init, public post-processing randomness) and ``privacy.seed``
(Poisson sampling and noise), so seed-matched runs of two methods share sampling and noise.

Each run is ``python -m dptrain train`` in a subprocess (at most ``--parallel`` at a time), into
``OUT/<method>/seed<s>``; a run whose ``summary.json`` exists is skipped, so the script resumes.

    python bench/e2e_real_check.py                                   # everything
    python bench/e2e_real_check.py --methods dp_muon,dp_muon_im --seeds 0,1,2
    python bench/e2e_real_check.py --methods dp_adamw@0.003,dp_adamw@0.01 --seeds 0   # lr grid
    python bench/e2e_real_check.py --report-only                     # table + JSON from disk

A method name may carry ``@LR`` to override its main learning rate (the lr grid). Results:
``OUT/results.json`` (every run found under OUT) and a table on stdout.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Learning rates chosen by the seed-0 grid recorded in BENCHMARKS.md (issue-3 section).
ADAMW_LR = 0.03     # DP-AdamW (all parameters)
AUX_LR = 0.03       # the AdamW group (wte/wpe, LayerNorms, biases) of every Muon variant = ADAMW_LR
MUON_LR = 0.03      # the Muon group of DP-Muon and all Muon variants (MuonBC, DiSK, DOPPLER, IM)
SGD_LR = 0.1        # DP-SGD (momentum 0.9, all parameters): not tuned
MUON_S_LR = 0.03    # DP-Muon-S's matrix group: Muon's lr, not tuned separately

IM = ["optim.inner_momentum.k_muon=4", "optim.inner_momentum.gamma_muon=0.5",
      "optim.inner_momentum.k_other=2", "optim.inner_momentum.gamma_other=0.5"]


def method_overrides(method: str, lr: float | None) -> list[str]:
    """The ``optim.*`` overrides of one method (on top of the base config)."""
    aux = f"optim.aux.lr={AUX_LR}"
    muon = ["optim.name=muon", "optim.preset=gpt2", "optim.aux.optimizer=adamw", aux,
            f"optim.lr={lr if lr is not None else MUON_LR}"]
    table = {
        "dp_sgd": ["optim.name=sgd", "optim.preset=null", f"optim.lr={lr or SGD_LR}"],
        "dp_adamw": ["optim.name=adamw", "optim.preset=null", f"optim.lr={lr or ADAMW_LR}"],
        "dp_muon": muon,
        "dp_muon_bc": [*muon, "optim.name=muon_bc"],
        # DP-Muon-S's non-matrix group is AdamW, as for every Muon variant here (its seed paper
        # gives 1-D parameters DP-SGD with momentum: optim.aux.optimizer=sgd)
        "dp_muon_s": ["optim.name=muon_s", "optim.preset=gpt2", "optim.aux.optimizer=adamw", aux,
                      f"optim.lr={lr or MUON_S_LR}"],
        # DiSK as the inner-momentum paper runs its KF: kappa = 0.5 on the previous state,
        # extrapolation 0.8 (= DiSK-paper gain 0.5; docs/optim.md has the mapping).
        "disk_muon": [*muon, "optim.filter.name=disk", "optim.filter.convention=im_paper",
                      "optim.filter.kappa=0.5", "optim.filter.gamma=0.8"],
        # DOPPLER's default first-order low-pass m_t = 0.9 m_{t-1} + 0.1 g_t before Muon.
        "doppler_muon": [*muon, "optim.filter.name=doppler"],
        # The inner-momentum paper's E2E setting at epsilon 8: K_M=4, K_A=2, gamma 0.5/0.5.
        "dp_muon_im": [*muon, *IM],
    }
    if method not in table:
        raise SystemExit(f"unknown method {method!r}; known: {', '.join(table)}")
    return table[method]


ISSUE3 = ["dp_sgd", "dp_adamw", "dp_muon", "dp_muon_bc", "dp_muon_s", "disk_muon", "doppler_muon"]
ISSUE4 = ["dp_muon", "dp_muon_im"]
GEN_METHODS = {"dp_muon", "dp_muon_im"}  # scored with BLEU/ROUGE-L


def parse_method(spec: str) -> tuple[str, float | None, str]:
    """'dp_adamw@0.003' -> ('dp_adamw', 0.003, 'dp_adamw@0.003')."""
    if "@" in spec:
        name, lr = spec.split("@", 1)
        return name, float(lr), spec
    return spec, None, spec


def run_dir(out: Path, label: str, seed: int) -> Path:
    return out / label / f"seed{seed}"


def train(args, label: str, method: str, lr: float | None, seed: int) -> dict:
    d = run_dir(args.out, label, seed)
    summ = d / "summary.json"
    if not summ.exists():
        d.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "dptrain", "train", "--config", str(args.config),
               "--output-dir", str(d), "--resume", "auto",  # continue a killed run
               f"seed={seed}", f"privacy.seed={seed}",
               *method_overrides(method, lr), *args.override]
        (d / "command.txt").write_text(" ".join(cmd) + "\n")
        t0 = time.time()
        with open(d / "train.log", "w") as log:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO).returncode
        if rc != 0:
            tail = (d / "train.log").read_text()[-3000:]
            print(f"[FAILED] {label} seed {seed} (rc {rc}); log {d / 'train.log'}:\n{tail}",
                  flush=True)
            return {"method": label, "seed": seed, "failed": True, "rc": rc}
        print(f"[done] {label} seed {seed} in {time.time() - t0:.0f}s", flush=True)
    if method in GEN_METHODS and args.gen_prompts > 0 and not (d / "generation.json").exists():
        cmd = [sys.executable, str(Path(__file__).resolve()), "--score-generation", str(d),
               "--gen-prompts", str(args.gen_prompts), "--max-new-tokens",
               str(args.max_new_tokens)]
        with open(d / "generation.log", "w") as log:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO).returncode
        if rc != 0:
            print(f"[FAILED generation] {label} seed {seed}: {d / 'generation.log'}", flush=True)
    return collect_one(d, label, seed)


def collect_one(d: Path, label: str, seed: int) -> dict:
    s = json.loads((d / "summary.json").read_text())
    row = {"method": label, "seed": seed, "test_nll": s["test_nll_per_token"],
           "epsilon": s["epsilon"], "delta": s["delta"], "steps": s["steps"],
           "noise_multiplier": s["noise_multiplier"], "sample_rate": s["sample_rate"],
           "clip_norm": s["clip_norm"], "expected_batch_size": s["expected_batch_size"],
           "train_seconds": s["train_seconds"], "dir": str(d)}
    if not math.isfinite(row["test_nll"]):
        row["nonfinite"] = True
    g = d / "generation.json"
    if g.exists():
        gen = json.loads(g.read_text())
        row.update(bleu=gen["bleu"], rouge_l=gen["rouge_l"], gen_prompts=gen["num_prompts"])
        if "bleu_uncased" in gen:  # (generation.json files from before 2026-12-06 lack it)
            row["bleu_uncased"] = gen["bleu_uncased"]
    return row


def score_generation(d: Path, prompts: int, max_new_tokens: int) -> None:
    """Greedy generation on the first ``prompts`` test MRs with the run's final model."""
    import torch
    from safetensors.torch import load_model

    from dptrain.config import from_dict
    from dptrain.data import build_data
    from dptrain.eval.text import generate_and_score
    from dptrain.models import build_model
    from dptrain.trainer import RunConfig

    from dptrain.models.finetune import LoRAConfig

    s = json.loads((d / "summary.json").read_text())
    cfg = from_dict(RunConfig, s["config"])
    torch.set_num_threads(cfg.performance.num_threads or 1)
    task = build_data(cfg.data, seed=cfg.seed)
    # a LoRA run's final model has its adapters merged: the original architecture, no adapters
    cfg.model.lora, cfg.model.trainable = LoRAConfig(), None
    model = build_model(cfg.model, task.info)
    load_model(model, str(d / "final" / "model.safetensors"))
    model.eval()
    refs = task.test.references_by_mr(max_prompts=prompts)
    t0 = time.time()
    res = generate_and_score(model, task.tokenizer, refs, max_new_tokens=max_new_tokens,
                             batch_size=64, return_texts=True)
    res["seconds"] = time.time() - t0
    res["max_new_tokens"] = max_new_tokens
    res["examples"] = list(zip(list(refs)[:3], res["texts"][:3]))
    (d / "generation.json").write_text(json.dumps(res, indent=1))
    print(json.dumps({k: res[k] for k in ("bleu", "bleu_uncased", "rouge_l", "num_prompts",
                                          "seconds")}))


def mean_spread(xs: list[float]) -> str:
    xs = [x for x in xs if x is not None]
    if not xs:
        return "-"
    m = sum(xs) / len(xs)
    if len(xs) == 1:
        return f"{m:.4f}"
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))
    return f"{m:.4f} ± {sd:.4f}"


def report(out: Path) -> list[dict]:
    rows = []
    for summ in sorted(out.glob("*/seed*/summary.json")):
        d = summ.parent
        rows.append(collect_one(d, d.parent.name, int(d.name[4:])))
    by = {}
    for r in rows:
        by.setdefault(r["method"], []).append(r)
    print(f"\n{'method':<22} {'seeds':<8} {'test NLL/token (mean ± sd)':<28} {'per seed':<30} "
          f"{'BLEU':<16} {'BLEU uncased':<16} {'ROUGE-L':<16}")
    for m, rs in by.items():
        rs.sort(key=lambda r: r["seed"])
        seeds = ",".join(str(r["seed"]) for r in rs)
        per = " ".join(f"{r['test_nll']:.4f}" for r in rs)
        bleu = mean_spread([r.get("bleu") for r in rs]) if any("bleu" in r for r in rs) else "-"
        unc = (mean_spread([r.get("bleu_uncased") for r in rs])
               if any("bleu_uncased" in r for r in rs) else "-")
        rl = mean_spread([r.get("rouge_l") for r in rs]) if any("rouge_l" in r for r in rs) else "-"
        print(f"{m:<22} {seeds:<8} {mean_spread([r['test_nll'] for r in rs]):<28} {per:<30} "
              f"{bleu:<16} {unc:<16} {rl:<16}")
    if "dp_muon" in by and "dp_muon_im" in by:
        base = {r["seed"]: r for r in by["dp_muon"]}
        print("\nseed-matched DP-Muon-IM vs DP-Muon (IM better = lower NLL, higher BLEU/ROUGE-L):")
        for r in sorted(by["dp_muon_im"], key=lambda r: r["seed"]):
            b = base.get(r["seed"])
            if b is None:
                continue
            parts = [f"seed {r['seed']}: NLL {r['test_nll']:.4f} vs {b['test_nll']:.4f}"]
            for k in ("bleu", "rouge_l"):
                if k in r and k in b:
                    parts.append(f"{k} {r[k]:.2f} vs {b[k]:.2f}")
            print("  " + "; ".join(parts))
    if rows:
        r0 = rows[0]
        print(f"\nrelease: q={r0['sample_rate']} T={r0['steps']} C={r0['clip_norm']} "
              f"sigma={r0['noise_multiplier']:.4f} b={r0['expected_batch_size']} "
              f"epsilon={r0['epsilon']:.3f} delta={r0['delta']}")
        same = {(r["sample_rate"], r["steps"], r["clip_norm"], r["noise_multiplier"]) for r in rows}
        if len(same) > 1:
            print(f"WARNING: runs differ in release settings: {same}")
    (out / "results.json").write_text(json.dumps(rows, indent=1))
    print(f"wrote {out / 'results.json'}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--config", type=Path, default=REPO / "configs" / "e2e_small.yaml")
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "e2e_real_check")
    ap.add_argument("--methods", default=None,
                    help="comma-separated (default: issue 3's seven methods, then dp_muon_im); "
                         "NAME@LR overrides the main lr")
    ap.add_argument("--seeds", default=None,
                    help="comma-separated (default: 0,1 for issue 3; 0,1,2 for dp_muon/dp_muon_im)")
    ap.add_argument("--parallel", type=int, default=2)
    ap.add_argument("--gen-prompts", type=int, default=100,
                    help="test MRs generated and scored (BLEU, ROUGE-L) for dp_muon/dp_muon_im")
    ap.add_argument("--max-new-tokens", type=int, default=200)
    ap.add_argument("--override", action="append", default=[],
                    help="extra key=value override for every run (e.g. data.path=...)")
    ap.add_argument("--report-only", action="store_true")
    ap.add_argument("--score-generation", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.score_generation is not None:
        score_generation(args.score_generation, args.gen_prompts, args.max_new_tokens)
        return
    args.out = args.out.resolve()
    args.config = args.config.resolve()
    if not args.report_only:
        jobs = []
        methods = args.methods.split(",") if args.methods else ISSUE3 + ["dp_muon_im"]
        for spec in methods:
            method, lr, label = parse_method(spec)
            method_overrides(method, lr)  # unknown names fail early
            if args.seeds:
                seeds = [int(s) for s in args.seeds.split(",")]
            else:
                seeds = [0, 1, 2] if method in ISSUE4 and lr is None else [0, 1]
            jobs += [(label, method, lr, s) for s in seeds]
        with cf.ThreadPoolExecutor(max_workers=args.parallel) as pool:
            futs = [pool.submit(train, args, *j) for j in jobs]
            for f in futs:
                f.result()
    elif not args.out.is_dir():
        print(f"e2e_real_check: --out {args.out}: no such folder (--report-only reads the "
              f"runs a previous call wrote there)", file=sys.stderr)
        sys.exit(2)
    report(args.out)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
