"""Private LoRA fine-tuning against private full fine-tuning, and each against its non-private
step, in one run.

    python bench/lora_step.py [--model gpt2|llama] [--rank 8] [--rounds 5] [--threads 1]
                              [--no-memory] [--tiny] [--layers L --width D --heads H --vocab V
                              --seq-len T --batch-size B]

The model, weights and batch are dp_step.py's (GPT-2 or Llama at 4 layers, width 256,
vocabulary 8,192, T = 64, B = 32; the shape options change them). Variants:

- full_nonprivate, full_dp: dp_step.py's non-private step and dptrain's private step (default
  clipping mode, counter-based noise on every coordinate, SGD);
- lora_nonprivate, lora_dp: the same steps after ``model.lora``'s ``apply_finetuning`` (peft
  LoRA of rank r on every matrix of the blocks: GPT-2's c_attn, c_proj, c_fc; Llama's q/k/v/o
  and gate/up/down projections), everything else frozen;
- lora_opacus_ghost: Opacus 1.6 ghost clipping of the same LoRA model (on dp_step.py's
  Opacus-ready GPT-2 copy, Conv1D -> Linear and an untied head, adapters injected after).

Timing and memory as dp_step.py (interleaved rounds, medians; a fresh process per variant for
the peak resident set). The last line printed is one JSON object: per variant median_s and
peak_mib, and ``lora_dp_over_lora_nonprivate``, ``lora_dp_over_full_dp`` (time),
``lora_dp_memory_over_full_dp``, ``opacus_over_lora_dp``, ``trainable_fraction``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from dataclasses import asdict

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    child_peak,
    emit_child_result,
    first_line,
    git_commit,
    load_average,
    machine_description,
    measure_peak_in_subprocess,
    median,
    now_utc,
    ratio_of_medians,
    time_interleaved,
)
from dp_step import (  # noqa: E402
    BenchConfig,
    build_llama,
    dptrain_step,
    gpt2_loss,
    nonprivate_step,
    opacus_step,
    tiny_config,
)
from gpt2_bench import build_gpt2, gpt2_batch, opacus_gpt2  # noqa: E402

VARIANTS = ("full_nonprivate", "full_dp", "lora_nonprivate", "lora_dp", "lora_opacus_ghost")
TARGETS = {"gpt2": ["c_attn", "c_proj", "c_fc"],
           "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                     "down_proj"]}


def _lora(model, kind: str, rank: int):
    from dptrain.models.finetune import LoRAConfig, apply_finetuning

    apply_finetuning(model, LoRAConfig(r=rank, alpha=2 * rank, target_modules=TARGETS[kind]),
                     None)
    return model


def build_variant(kind: str, variant: str, cfg: BenchConfig, rank: int, models=None):
    s = cfg.gpt2 if kind == "gpt2" else cfg.llama
    model = (build_gpt2 if kind == "gpt2" else build_llama)(s, cfg.seed, cfg.device)
    batch = gpt2_batch(s, cfg.seed, cfg.device)
    if variant == "lora_opacus_ghost":
        pos = None
        if kind == "gpt2":  # Opacus's copy first (its c_attn, c_proj, c_fc are nn.Linear)
            model, pos = opacus_gpt2(model, s, untie=True)
        _lora(model, kind, rank)
        ids = batch["input_ids"]
        extra = {} if pos is None else {"position_ids": pos}

        def forward(m):
            logits = m(input_ids=ids, **extra).logits[:, :-1]
            return logits.reshape(-1, logits.shape[-1])

        if models is not None:
            models.append(model)
        return opacus_step(model, (ids,), forward, ids[:, 1:].reshape(-1), cfg, "ghost",
                           (s.batch_size, s.seq_len - 1))
    if variant.startswith("lora_"):
        _lora(model, kind, rank)
    if models is not None:
        models.append(model)
    if variant.endswith("nonprivate"):
        return nonprivate_step(model, gpt2_loss, batch, cfg.lr)
    return dptrain_step(model, gpt2_loss, batch, s.batch_size, cfg, "bookkeeping")


def trainable_fraction(kind: str, cfg: BenchConfig, rank: int) -> float:
    models: list = []
    build_variant(kind, "lora_nonprivate", cfg, rank, models)
    m = models[0]
    total = sum(p.numel() for p in m.parameters())
    return sum(p.numel() for p in m.parameters() if p.requires_grad) / total


def run(kind: str, cfg: BenchConfig, rank: int) -> dict:
    t0 = time.perf_counter()
    load_start = load_average()
    steps, errors = {}, {}
    for v in VARIANTS:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                steps[v] = build_variant(kind, v, cfg, rank)
        except Exception as e:
            errors[v] = first_line(e)
    print(f"[lora_step] timing {kind}: {cfg.rounds} rounds x {len(steps)} variants",
          file=sys.stderr, flush=True)
    times, run_errors = time_interleaved(steps, rounds=cfg.rounds, warmup=cfg.warmup,
                                         device=cfg.device)
    errors.update(run_errors)
    memory = {}
    if cfg.memory:
        for v in VARIANTS:
            if v not in errors:
                memory[v] = measure_peak_in_subprocess(
                    os.path.abspath(__file__), [kind, v, str(rank), json.dumps(asdict(cfg))])
    table = {}
    for v in VARIANTS:
        row = {"median_s": median(times.wall.get(v, [])), "cpu_s": median(times.cpu.get(v, [])),
               "peak_mib": (memory[v]["peak_bytes"] / 2**20
                            if "peak_bytes" in memory.get(v, {}) else None)}
        if v in errors:
            row["error"] = errors[v]
        table[v] = row
    w = times.wall

    def mem_ratio(a, b):
        pa, pb = table[a]["peak_mib"], table[b]["peak_mib"]
        return pa / pb if pa is not None and pb else None

    return {
        "benchmark": "lora_step", "model": kind, "rank": rank,
        "variants": table,
        "lora_dp_over_lora_nonprivate": ratio_of_medians(w.get("lora_dp"),
                                                         w.get("lora_nonprivate")),
        "full_dp_over_full_nonprivate": ratio_of_medians(w.get("full_dp"),
                                                         w.get("full_nonprivate")),
        "lora_dp_over_full_dp": ratio_of_medians(w.get("lora_dp"), w.get("full_dp")),
        "opacus_over_lora_dp": ratio_of_medians(w.get("lora_opacus_ghost"), w.get("lora_dp")),
        "lora_dp_memory_over_full_dp": mem_ratio("lora_dp", "full_dp"),
        "lora_dp_memory_over_opacus": mem_ratio("lora_dp", "lora_opacus_ghost"),
        "trainable_fraction": trainable_fraction(kind, cfg, rank),
        "load_average": {"start": load_start, "end": load_average()},
        "machine": machine_description(cfg.device), "commit": git_commit(), "date": now_utc(),
        "elapsed_s": round(time.perf_counter() - t0, 1),
    }


def main(argv: list[str] | None = None) -> dict | None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--peak-child":
        kind, variant, rank, cfg_json = argv[1:5]
        cfg = BenchConfig.from_json(cfg_json)
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        warnings.simplefilter("ignore")
        emit_child_result(child_peak(lambda: build_variant(kind, variant, cfg, int(rank)),
                                     device=cfg.device, steps=cfg.memory_steps))
        return None
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt2", choices=sorted(TARGETS))
    ap.add_argument("--rank", type=int, default=8, help="LoRA rank r (alpha = 2r)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--tiny", action="store_true", help="tiny models, one round (tests)")
    for flag, help_ in (("--layers", "blocks"), ("--width", "hidden width"),
                        ("--heads", "attention heads"), ("--vocab", "vocabulary"),
                        ("--seq-len", "tokens per example (T)"),
                        ("--batch-size", "examples per step (B)")):
        ap.add_argument(flag, type=int, default=None, help=f"{help_} (default: dp_step.py's)")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    cfg = tiny_config() if args.tiny else BenchConfig()
    for shape in (cfg.gpt2, cfg.llama):
        for arg, name in (("layers", "num_layers"), ("width", "width"), ("heads", "num_heads"),
                          ("vocab", "vocab_size"), ("seq_len", "seq_len"),
                          ("batch_size", "batch_size")):
            if getattr(args, arg) is not None:
                setattr(shape, name, getattr(args, arg))
    if not args.tiny:
        cfg.rounds = args.rounds
    cfg.memory = not args.no_memory and not args.tiny
    cfg.device, cfg.threads = args.device, args.threads
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    summary = run(args.model, cfg, args.rank)
    for v, row in summary["variants"].items():
        print(f"{v:20s} {row['median_s'] if row['median_s'] is not None else float('nan'):8.3f} s"
              f"  {row['peak_mib'] if row['peak_mib'] is not None else float('nan'):8.0f} MiB"
              f"  {row.get('error', '')}")
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
