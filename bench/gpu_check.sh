#!/usr/bin/env bash
# ONE prepared GPU check for an H200 session (issue 5, item 8). Finishes in under 8 minutes:
# every part has its own `timeout`, capped by what is left of a budget of 470 s from the start
# (GPU_CHECK_BUDGET; a part with under 30 s left is skipped and said so), and a failing part
# does not stop the others. The H200 took 267 and 331 s (2026-11-30) before parts 4b, 5b, 9-12
# were added; their timeouts add up to 830 s, so the budget, not the sum, bounds the run, and
# the parts are in order of what matters most. Run it from the repository root on the GPU
# machine:
#
#   here:            bash bench/fetch_gpu_wheels.sh        # bench/wheels/ (gitignored)
#   on the machine:  bash bench/gpu_check.sh                # carry: bench/wheels
#   (device tool:    run(command="bash bench/gpu_check.sh", carry=["bench/wheels"],
#                        timeout_s=560))
#
# Parts (seconds of timeout):
#   0. install (45): `pip install --no-deps --no-build-isolation -e .` (the machine has no
#      registry: its image already holds torch, transformers, timm, accelerate, numpy, scipy,
#      nvidia-ml-py, ...) plus the wheels it lacks from bench/wheels with --no-index --no-deps
#      (opacus, prv-accountant, webdataset, braceexpand, peft); falls back to PYTHONPATH=. if the
#      editable install fails. Prints the GPU (nvidia-smi) and torch/CUDA versions.
#   1. `pytest -m gpu` (60): tests/test_gpu.py's CUDA checks (engine norms vs CPU float64,
#      the others' clipped sum when a longer example joins their microbatch, in bf16 too,
#      counter-based noise across shard slices, bf16 autocast steps, CUDA == CPU without noise,
#      the release's noise drawn in the background equal to the inline draw, the peak memory
#      that metrics rows report, the engine's row check with CUDA dropout).
#   2. GPT-2 small, random init, T = 128, DP-Muon-IM K = 2 (90): `dptrain train` for 5
#      releases of b = 256, then private vs non-private steps: bench/gpu_check.py.
#   3. NF-ResNet-50 at 224 px, DP-Muon + AdamW (90): the same for nf_resnet50, b = 256.
#   4. bench/dp_step.py --device cuda --quick --no-memory --models gpt2,nfresnet (65): DP step
#      vs non-private vs Opacus (issue 2); its per-variant memory subprocesses are skipped to fit
#      the budget.
#   4b. the same for the ViT, the ConvNeXt and a Llama (50): the engine's tapped parameters
#      and its RMSNorm rule on the GPU (added 2026-12-02, not run on a GPU yet).
#   5. bench/inner_momentum.py --device cuda --quick at GPT-2 small's shape (12 x 768, 12 heads,
#      vocabulary 50,257), T = 128, B = 16 (130): DP-Muon-IM at K = 0, 1, 2, 4 (also 1, 2, 4
#      with performance.ghost=memory, and 4 in two microbatches of 8) vs the non-private step
#      and the naive (Opacus, torch.func) IMs, peak memory of each variant measured in the same
#      process (the CUDA allocator's peak resets) (issue 4).
#   5b. the same at B = 64 for K = 0, 1, 4 and the Opacus naive IM (100): whether the marginal
#      cost above the floor at B = 16 is launch overhead that a larger microbatch amortises.
#   6. bench/per_example_products.py --device cuda --rounds 5 (20): per-example products vs
#      the non-private weight gradients, i.e. the floor of IM's marginal cost on the GPU.
#   7. bench/profile_step.py --device cuda at the same shape (40): torch.profiler over the
#      non-private, K = 0 and K = 4 steps: top operators, the GPU's busy fraction and where
#      the host waits for the device (synchronisations by Python stack).
#   8. kernels (45): tests/test_kernels.py compiled on the GPU (the Triton ghost-product
#      kernel against its reference, in the engine and the trainer), then
#      bench/ghost_kernel.py --device cuda: kernel vs torch reference on GPT-2 small's linears.
#   9. bench/decode.py (20): 64 ImageNet-sized JPEGs decoded at 224 px on 1, 4, 8 and 16
#      threads (performance.decode_threads) on the machine's CPU cores (added 2026-12-02).
#   10. bench/lora_step.py --device cuda --model llama --no-memory (20): private LoRA (peft
#      adapters, rank 8, every block matrix) vs private full fine-tuning vs their non-private
#      steps, and Opacus ghost on the same adapters (added 2026-12-02, not run on a GPU yet).
#   11. bench/muon_s_sigma.py --device cuda --layers 4 (30): DP-Muon-S's step with sigma_1 by
#      Lanczos (three device reads per product) vs the 3 power iterations it replaced, on 4 of
#      GPT-2 small's 12 blocks (16 matrices; added 2026-12-02, not run on a GPU yet).
#   12. bench/cancellation_guard.py --device cuda (25): the ghost norms' cancellation check,
#      its one device sync per query (added 2026-12-03, not run on a GPU yet).
# Each part prints examples/s, peak memory (torch.cuda.max_memory_allocated and NVML) and the
# DP/non-private ratio where it has one; each part's log (its last line one JSON object) lands
# in bench/gpu_out/ (on the device machine: packed into $OUT/gpu_check_logs.tar.gz after every
# part). The dry run's tiny shapes take 110-260 s on 2 CPU cores, with the machine's load.
#
# `bash bench/gpu_check.sh --dry-run` runs the same parts on CPU with tiny shapes (no install;
# CUDA tests skip): it checks the plumbing on a machine without a GPU. Any other argument is
# refused (exit 2): a misspelt --dry-run would run the GPU path.
set -uo pipefail
DRY=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY=1 ;;
    *) echo "gpu_check.sh: unknown argument '$arg' (the only one is --dry-run)" >&2; exit 2 ;;
  esac
done
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
PY="${PYTHON:-python3}"
# logs: bench/gpu_out/NAME.log here (a dry run: bench/gpu_out/dry/); on the device machine,
# whose $OUT returns at most 8 files, /tmp/gpu_check_logs/NAME.log packed after every part into
# $OUT/gpu_check_logs.tar.gz
BUDGET=${GPU_CHECK_BUDGET:-470}  # seconds from START for all parts (timeouts are capped by it)
if ! [[ $BUDGET =~ ^[0-9]{1,7}$ ]]; then
  echo "gpu_check.sh: GPU_CHECK_BUDGET must be whole seconds, got '$BUDGET'" >&2
  exit 2
fi
BUDGET=$(( 10#$BUDGET ))  # (a leading zero is not octal)
if [ -n "${OUT:-}" ]; then
  RES=/tmp/gpu_check_logs
  rm -rf "$RES"  # a warm machine keeps /tmp: no earlier call's logs in this one's archive
elif [ $DRY = 1 ]; then RES=bench/gpu_out/dry  # a dry run leaves a GPU run's logs alone
else RES=bench/gpu_out; fi
mkdir -p "$RES"
START=$(date +%s)
declare -A STATUS
SCALE=1
if [ $DRY = 1 ]; then
  PY="${PYTHON:-.venv/bin/python}"
  SCALE=4  # a shared CPU is slower to start Python than the H200 machine
  BUDGET=$(( BUDGET * SCALE ))
  CHECK_ARGS=(--device cpu --tiny --steps 3 --rounds 1)
  BENCH_ARGS=(--device cpu --tiny --quick --no-memory)
  IM_ARGS=("${BENCH_ARGS[@]}")
  IM_B64_ARGS=("${BENCH_ARGS[@]}" --ks 0,1 --naive opacus --naive-k 1)
else
  CHECK_ARGS=(--device cuda --steps 5 --rounds 3)
  BENCH_ARGS=(--device cuda --quick --no-memory)
  GPT2_SMALL=(--layers 12 --width 768 --heads 12 --vocab 50257 --seq-len 128 --batch-size 16)
  IM_ARGS=(--device cuda --quick "${GPT2_SMALL[@]}" --memory-ks 1,2,4 --split 2)
  IM_B64_ARGS=(--device cuda --quick "${GPT2_SMALL[@]}" --batch-size 64 --ks 0,1,4
               --naive opacus)
fi

part() {  # part NAME SECONDS COMMAND...: run with a timeout, log to $RES/NAME.log, keep going
  local name="$1" secs=$(( $2 * SCALE )); shift 2
  local t0=$(date +%s)
  local left=$(( START + BUDGET - t0 - 10 ))  # (10 s: timeout's --kill-after)
  if [ "$left" -lt 20 ]; then  # (under 30 s of the budget left)
    STATUS[$name]="skipped (under 30 s of the ${BUDGET} s budget left)"
    echo "=== [$name] skipped: $(( t0 - START )) s of the ${BUDGET} s budget spent"
    return
  fi
  [ "$secs" -gt "$left" ] && secs=$left
  echo "=== [$name] (timeout ${secs}s): $*"
  timeout --signal=TERM --kill-after=10 "$secs" "$@" 2>&1 | tee "$RES/$name.log"
  local rc=${PIPESTATUS[0]}
  STATUS[$name]="rc=$rc $(( $(date +%s) - t0 ))s"
  if [ -n "${OUT:-}" ]; then tar -czf "$OUT/gpu_check_logs.tar.gz" -C "$RES" .; fi
  echo "=== [$name] rc=$rc in $(( $(date +%s) - t0 )) s (total $(( $(date +%s) - START )) s)"
}

install_deps() {
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'available', torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else '')"
  if ls bench/wheels/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile \
      bench/wheels/*.whl || echo "warning: wheel install failed"
  else
    echo "warning: no bench/wheels (run bench/fetch_gpu_wheels.sh here and carry bench/wheels)"
  fi
  "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps \
    --no-build-isolation -e . || echo "warning: editable install failed; using PYTHONPATH"
  "$PY" - <<'EOF'
import importlib
missing = [m for m in ("dptrain.trainer", "opacus", "prv_accountant", "webdataset", "timm",
                       "transformers", "pynvml", "safetensors", "yaml", "peft") if
           importlib.util.find_spec(m.split(".")[0]) is None]
print("missing modules:", missing or "none")
# dependencies that no GPU part uses, not carried: randomgen (compiled; privacy.secure_mode)
# and rouge-score (with nltk; the E2E metrics)
print("not carried, unused here:", [m for m in ("randomgen", "rouge_score")
                                    if importlib.util.find_spec(m) is None] or "none")
import dptrain.trainer  # noqa: F401  (fails loudly here rather than in every part)
print("dptrain imports")
EOF
}

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PY
export -f install_deps
if [ $DRY = 1 ]; then STATUS[install]="skipped (dry run)"; else part install 45 bash -c install_deps; fi
part pytest_gpu 60 "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py
# the train parts' run directories: this call's own (two dry runs at once kept apart)
RUNS=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check_runs.XXXXXX")
trap 'rm -rf "$RUNS"' EXIT
part gpt2_small 90 "$PY" bench/gpu_check.py --model gpt2_small "${CHECK_ARGS[@]}" \
  --out "$RUNS/gpt2"
part nf_resnet50 90 "$PY" bench/gpu_check.py --model nf_resnet50 "${CHECK_ARGS[@]}" \
  --out "$RUNS/nf"
# (the option checks read the source: a --help would import torch, seconds each)
if grep -q -- '"--device"' bench/dp_step.py; then
  part dp_step 65 "$PY" bench/dp_step.py "${BENCH_ARGS[@]}" --models gpt2,nfresnet
  part dp_step_vision 50 "$PY" bench/dp_step.py "${BENCH_ARGS[@]}" --models vit,convnext,llama
else
  STATUS[dp_step]="skipped (no --device)"
fi
if [ -f bench/inner_momentum.py ] && grep -q -- '"--device"' bench/inner_momentum.py; then
  part inner_momentum 130 "$PY" bench/inner_momentum.py "${IM_ARGS[@]}"
  # a microbatch that fills the GPU better: is the marginal launch overhead (B = 16) or not?
  part inner_momentum_b64 100 "$PY" bench/inner_momentum.py "${IM_B64_ARGS[@]}"
else
  STATUS[inner_momentum]="skipped (missing or no --device)"
fi
if [ $DRY = 1 ]; then PRODUCTS_ARGS=(--device cpu --tiny --rounds 1)
else PRODUCTS_ARGS=(--device cuda --rounds 5); fi
part products 20 "$PY" bench/per_example_products.py "${PRODUCTS_ARGS[@]}"
if [ $DRY = 1 ]; then PROFILE_ARGS=(--device cpu --tiny --steps 1)
else PROFILE_ARGS=(--device cuda --steps 3 "${GPT2_SMALL[@]}"); fi
part profile 40 "$PY" bench/profile_step.py --variants nonprivate,k0,k4 "${PROFILE_ARGS[@]}"
if [ $DRY = 1 ]; then
  part kernels 45 env TRITON_INTERPRET=1 "$PY" bench/ghost_kernel.py --device cpu --tiny --rounds 1
else
  part kernels 45 bash -c '"$PY" -m pytest -q -p no:cacheprovider tests/test_kernels.py &&
    "$PY" bench/ghost_kernel.py --device cuda --rounds 5'
fi
if [ $DRY = 1 ]; then DECODE_ARGS=(--images 8 --size 32 --threads 1,2 --rounds 1)
else DECODE_ARGS=(--images 64 --threads 1,4,8,16 --rounds 3); fi
if [ -f bench/decode.py ]; then part decode 20 "$PY" bench/decode.py "${DECODE_ARGS[@]}"; fi
if [ $DRY = 1 ]; then LORA_ARGS=(--device cpu --tiny)
else LORA_ARGS=(--device cuda --rounds 5 --no-memory); fi
part lora 20 "$PY" bench/lora_step.py --model llama "${LORA_ARGS[@]}"
if [ $DRY = 1 ]; then MUON_S_ARGS=(--device cpu --width 32 --steps 2 --rounds 1)
else MUON_S_ARGS=(--device cuda --layers 4 --rounds 3); fi
part muon_s 30 "$PY" bench/muon_s_sigma.py "${MUON_S_ARGS[@]}"
# the ghost norms' cancellation check: its one device sync per query, on the GPU
if [ $DRY = 1 ]; then GUARD_ARGS=(--device cpu --tiny --rounds 1)
else GUARD_ARGS=(--device cuda --rounds 7); fi
part guard 25 "$PY" bench/cancellation_guard.py "${GUARD_ARGS[@]}"
nvidia-smi --query-gpu=memory.used,memory.total --format=csv,noheader 2>/dev/null || true

echo
echo "=== summary (total $(( $(date +%s) - START )) s)"
for k in install pytest_gpu gpt2_small nf_resnet50 dp_step dp_step_vision inner_momentum \
    inner_momentum_b64 products profile kernels decode lora muon_s guard; do
  printf '%-16s %s\n' "$k" "${STATUS[$k]:-not run}"
done
# the last JSON line of each benchmark part (its start: the device returns the last 12,000
# characters of output, and the logs in full): throughput, peak memory, DP/non-private
for k in gpt2_small nf_resnet50 dp_step dp_step_vision inner_momentum inner_momentum_b64 \
    products profile kernels decode lora muon_s guard; do
  # (only parts that ran in this call)
  if [[ "${STATUS[$k]:-}" == rc=* ]] && [ -f "$RES/$k.log" ]; then
    printf '%s: ' "$k"; grep '^{' "$RES/$k.log" | tail -n 1 | cut -c1-1000
  fi
done
exit 0
