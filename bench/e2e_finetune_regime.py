"""Issue 4's real check in a fine-tuning regime: public pretraining, then private fine-tuning.

The inner-momentum paper fine-tunes a pretrained GPT-2, where successive private states are
close; the from-scratch runs of ``bench/e2e_real_check.py`` move far between steps. With no GPT-2
weights on these machines, this script builds the regime on E2E-small itself:

1. Split ``devset.csv`` by meaning representation (MR): the distinct MRs, sorted, alternate
   between a **public** half (even positions) and a **private** half (odd positions), so no MR
   is in both. Written to ``OUT/data/{public,private}.csv``. The public half keeps only the
   references, each under the same placeholder MR ``PUBLIC_MR`` (the loader refuses an empty
   one): pretraining learns restaurant English, not the data-to-text task, as GPT-2's WebText
   pretraining does not (``--public-mr`` keeps the MRs; then the public model already does the
   private task and fine-tuning has nothing left to learn).
2. **Public pretraining**, not private: ``dptrain train`` on the public half with
   ``noise_multiplier: 0`` and a clip norm no gradient reaches (epsilon is infinite, and only
   public data is touched). The model goes to ``OUT/pretrain/final/hf`` (transformers format).
3. **Private fine-tuning** of that model on the private half, through ``bench/e2e_real_check.py``
   (same methods, seeds and scoring), with ``model.pretrained_path`` pointing at step 2's model
   and the sample rate set so that the expected batch is the same 32 examples as E2E-small's.

    python bench/e2e_finetune_regime.py --methods dp_muon,dp_muon_im --seeds 0,1,2
    python bench/e2e_finetune_regime.py --methods dp_muon@0.01,dp_muon_im@0.01 --seeds 0
    python bench/e2e_finetune_regime.py --report-only

Every step is skipped when its output exists, so the script resumes. Test data: the E2E-small
test split (``testset_w_refs.csv``), untouched by both halves.
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BASE = REPO / "configs" / "e2e_small.yaml"
# the public half's one MR: it says nothing of any example's MR (the runs recorded before the
# E2E loader refused empty MRs, in November 2026, had the prompt " || " of an empty one)
PUBLIC_MR = "text"


def split_by_mr(devset: Path, out_dir: Path, public_mr: bool = False) -> dict[str, int]:
    """Write ``public.csv`` and ``private.csv`` (columns mr, ref) into ``out_dir``: the sorted
    distinct MRs alternate between the halves. The public half keeps only the references
    (under ``PUBLIC_MR``) unless ``public_mr``. Returns the number of rows of each."""
    with open(devset, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    if not rows or not {"mr", "ref"} <= set(rows[0]):
        raise SystemExit(f"{devset}: expected the columns mr, ref")
    public = {m for i, m in enumerate(sorted({r["mr"] for r in rows})) if i % 2 == 0}
    out_dir.mkdir(parents=True, exist_ok=True)
    counts = {}
    for name, keep in (("public", True), ("private", False)):
        tmp = out_dir / f"{name}.csv.tmp"
        with open(tmp, "w", newline="", encoding="utf-8") as f:
            w = csv.DictWriter(f, fieldnames=["mr", "ref"])
            w.writeheader()
            kept = [r for r in rows if (r["mr"] in public) == keep]
            w.writerows({"mr": r["mr"] if public_mr or not keep else PUBLIC_MR, "ref": r["ref"]}
                        for r in kept)
        tmp.replace(out_dir / f"{name}.csv")
        counts[name] = len(kept)
    return counts


def sample_rate_for(rows: int, batch: int) -> float:
    """The Poisson rate whose expected batch is ``batch`` examples of ``rows``."""
    return round(batch / rows, 6)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "e2e_finetune")
    ap.add_argument("--e2e-dir", type=Path, default=REPO.parent / "shared" / "data" / "e2e",
                    help="folder of devset.csv and testset_w_refs.csv")
    ap.add_argument("--public-mr", action="store_true",
                    help="keep the MRs in the public half (in-domain pretraining on the task)")
    ap.add_argument("--pretrain-steps", type=int, default=400)
    ap.add_argument("--pretrain-lr", type=float, default=0.03)
    ap.add_argument("--batch", type=int, default=32,
                    help="expected examples per logical batch, public and private")
    ap.add_argument("--steps", type=int, default=160, help="private fine-tuning steps")
    ap.add_argument("--override", action="append", default=[],
                    help="extra key=value for the private runs (e.g. privacy.clip_norm=0.1)")
    ap.add_argument("--report-only", action="store_true")
    args, rest = ap.parse_known_args()  # the rest goes to e2e_real_check.py (--methods, ...)
    out = args.out.resolve()
    e2e = args.e2e_dir.resolve()
    if not (e2e / "devset.csv").exists():
        raise SystemExit(f"--e2e-dir: {e2e / 'devset.csv'} not found")

    counts = split_by_mr(e2e / "devset.csv", out / "data", args.public_mr)
    print(f"split {e2e / 'devset.csv'}: {counts['public']} public rows, "
          f"{counts['private']} private rows (disjoint MRs)", flush=True)
    common = [f"data.path={e2e}", "performance.num_threads=1"]

    pre = out / "pretrain"
    if not args.report_only and not (pre / "summary.json").exists():
        cmd = [sys.executable, "-m", "dptrain", "train", "--config", str(BASE),
               "--output-dir", str(pre), "--resume", "auto", *common,
               f"data.train_file={out / 'data' / 'public.csv'}",
               "privacy.noise_multiplier=0", "privacy.epsilon=null", "privacy.clip_norm=1e6",
               f"privacy.sample_rate={sample_rate_for(counts['public'], args.batch)}",
               f"privacy.steps={args.pretrain_steps}", f"optim.lr={args.pretrain_lr}",
               f"optim.aux.lr={args.pretrain_lr}", "train.log_every=50"]
        print("public pretraining:", " ".join(cmd), flush=True)
        pre.mkdir(parents=True, exist_ok=True)
        with open(out / "pretrain.log", "w") as log:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO).returncode
        if rc != 0:
            raise SystemExit(f"public pretraining failed (rc {rc}); see {out / 'pretrain.log'}")
    if not args.report_only and not (pre / "generation.json").exists():
        # the starting point's BLEU/ROUGE-L, scored like the fine-tuned models
        subprocess.run([sys.executable, str(REPO / "bench" / "e2e_real_check.py"),
                        "--score-generation", str(pre)], cwd=REPO, check=True)
    if (pre / "summary.json").exists():
        s = json.loads((pre / "summary.json").read_text())
        g = json.loads((pre / "generation.json").read_text()) if (
            pre / "generation.json").exists() else {}
        print(f"public model: test NLL {s['test_nll_per_token']:.4f}, BLEU "
              f"{g.get('bleu', float('nan')):.2f}, ROUGE-L {g.get('rouge_l', float('nan')):.2f}",
              flush=True)

    private = [*common, f"model.pretrained_path={pre / 'final' / 'hf'}",
               f"data.train_file={out / 'data' / 'private.csv'}",
               f"privacy.sample_rate={sample_rate_for(counts['private'], args.batch)}",
               f"privacy.steps={args.steps}", *args.override]
    cmd = [sys.executable, str(REPO / "bench" / "e2e_real_check.py"), "--out",
           str(out / "private"), *rest, *[a for o in private for a in ("--override", o)]]
    if args.report_only:
        cmd.append("--report-only")
    sys.exit(subprocess.run(cmd, cwd=REPO).returncode)


if __name__ == "__main__":
    main()
