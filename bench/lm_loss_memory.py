"""Peak memory and time of the language-model loss's forward + backward: dptrain's
``lm_loss`` against the usual sliced-logits ``F.cross_entropy``, in one run.

The usual form slices the logits to (B, L-1, V) and flattens them (a copy), and
``F.cross_entropy``'s backward writes two dense (N, V) gradients next to the saved
log-probabilities: three logit-sized tensors at the peak. ``dptrain.data.lm`` shifts the
labels instead and uses its own cross-entropy (``_TokenNLL``), whose backward writes one:
two at the peak. With GPT-2's 50,257-token vocabulary the logits are the largest activation.

- CPU: the high-water mark of tensor storages created during one forward + backward
  (``common.LiveTensorPeak``: live tensors, no allocator slack); the weights and the
  gradients of a warm-up step are the baseline.
- CUDA: ``torch.cuda.max_memory_allocated`` minus the allocation before the step.
- Time: both forms interleaved, medians (``common.time_interleaved``).

    python bench/lm_loss_memory.py                  # CPU shapes
    python bench/lm_loss_memory.py --device cuda    # adds GPT-2 small, B 16, L 128

The last line is one JSON object with, per shape, both peaks and times and the ratios
``memory_dptrain_over_sliced`` and ``time_dptrain_over_sliced``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    LiveTensorPeak,
    fmt_bytes,
    git_commit,
    machine_description,
    median,
    now_utc,
    ratio_of_medians,
    time_interleaved,
)
from gpt2_bench import build_gpt2  # noqa: E402


@dataclass
class Shape:
    name: str
    num_layers: int
    width: int
    num_heads: int
    vocab_size: int
    seq_len: int  # L
    batch_size: int  # B
    prompt: int = 8  # leading positions without a label (-100), as E2E's prompts


CPU_SHAPES = [
    Shape("bench GPT-2 4x256, V 8192", 4, 256, 4, 8192, 64, 16),
    Shape("GPT-2 vocabulary, 2x128", 2, 128, 2, 50257, 64, 8),
]
CUDA_SHAPES = CPU_SHAPES + [Shape("GPT-2 small 12x768", 12, 768, 12, 50257, 128, 16)]


def batch_for(s: Shape, device: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, s.vocab_size, (s.batch_size, s.seq_len), generator=g).to(device)
    labels = ids.clone()
    labels[:, : s.prompt] = -100
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def sliced_loss(model, batch) -> torch.Tensor:
    """The usual form (and dptrain's before): slice the logits, flatten, F.cross_entropy."""
    logits = model(input_ids=batch["input_ids"],
                   attention_mask=batch["attention_mask"]).logits[:, :-1].float()
    labels = batch["labels"][:, 1:]
    b, t = labels.shape
    nll = F.cross_entropy(logits.reshape(b * t, -1), labels.reshape(-1), ignore_index=-100,
                          reduction="none").view(b, t)
    return nll.sum(1) / (labels != -100).sum(1).clamp(min=1)


def dptrain_loss(model, batch) -> torch.Tensor:
    from dptrain.data.lm import lm_loss

    return lm_loss(model, batch)


LOSSES = {"sliced": sliced_loss, "dptrain": dptrain_loss}


def setup(s: Shape, loss_fn, device: str):
    model = build_gpt2(s, 0, device)
    batch = batch_for(s, device)

    def step():
        loss_fn(model, batch).sum().backward()

    step()  # warm-up: the gradients exist from here on
    return step


def peak_of_step(step, device: str) -> int:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    with LiveTensorPeak() as tracker:
        step()
    return tracker.peak_bytes


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--shapes", default=None,
                    help="comma-separated indices into the shape list (default: all)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    shapes = CUDA_SHAPES if args.device.startswith("cuda") else CPU_SHAPES
    if args.shapes:
        shapes = [shapes[int(i)] for i in args.shapes.split(",")]
    print(f"# {now_utc()}  commit {git_commit()}  {machine_description(args.device)}")
    print(f"{'shape':<28} {'B x L x V':<18} {'logits':>8} {'peak sliced':>12} "
          f"{'peak dptrain':>13} {'memory ratio':>13} {'time ratio':>11}")
    rows = []
    for s in shapes:
        steps = {k: setup(s, fn, args.device) for k, fn in LOSSES.items()}
        peaks = {k: peak_of_step(st, args.device) for k, st in steps.items()}
        times, errors = time_interleaved(steps, rounds=args.rounds, warmup=0, device=args.device)
        if errors:
            raise SystemExit(f"{s.name}: {errors}")
        mem = peaks["dptrain"] / peaks["sliced"]
        tim = ratio_of_medians(times.wall["dptrain"], times.wall["sliced"])
        logit_bytes = s.batch_size * s.seq_len * s.vocab_size * 4
        rows.append({"shape": asdict(s), "logits_bytes": logit_bytes, "peak_bytes": peaks,
                     "seconds": {k: median(v) for k, v in times.wall.items()},
                     "memory_dptrain_over_sliced": round(mem, 4),
                     "time_dptrain_over_sliced": round(tim, 4)})
        print(f"{s.name:<28} {f'{s.batch_size} x {s.seq_len} x {s.vocab_size}':<18} "
              f"{fmt_bytes(logit_bytes):>8} {fmt_bytes(peaks['sliced']):>12} "
              f"{fmt_bytes(peaks['dptrain']):>13} {mem:>13.3f} {tim:>11.3f}")
    result = {"device": args.device, "rounds": args.rounds, "rows": rows}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
