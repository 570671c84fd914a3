#!/usr/bin/env bash
# The GPU check (docs/gpu.md): one command on an NVIDIA GPU machine, under 10 minutes on an H200.
#   1. the kernel tests at full size on the device (compiled, not interpreted)
#   2. engine greedy equality on a tiny model: triton vs torch backend, CUDA graphs (decode + piecewise) vs eager,
#      fp8 KV, async scheduling vs plain; fp8 weights' teacher-forced next-token agreement with bf16 (goal >= 97%)
#   3. the weights' load time: a bf16 safetensors checkpoint (8 layers of the 7B shape) read onto the GPU
#   4. engine throughput on a Llama-2-7B-shaped model with random bf16 weights, auto backend (VARIANTS:
#      BACKEND-MODE[-fp8w][-fp8kv][-async], MODE eager, graphs (decode + piecewise) or decodegraphs (piecewise off),
#      async: --async-scheduling; e.g. "torch-eager", "auto-graphs-fp8kv" add the torch backend, fp8 KV alone)
#   5. the same shapes through transformers generate, the baseline
#   6. speculative decoding on the 7B shape (issue 13): off / ngram and suffix adaptive / ngram fixed k=5 side by side
#      at batch 1, 16 and 64 streams and a mixed batch; each engine's step-time model (run right after the kernel tests)
# Full results go to $OUT when set (else a temp dir): log.txt, results.jsonl, table.md. The table is printed last.
# BATCHES=1,16, VARIANTS="triton-graphs" or PYTHON=... override the defaults; BENCH_ARGS="--device cpu --tiny --input-len 16
# --output-len 8" smoke-tests the script on a CPU machine (the kernel tests then run interpreted).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
RES=${OUT:-$(mktemp -d)}
mkdir -p "$RES"
LOG=$RES/log.txt JSONL=$RES/results.jsonl
BATCHES=${BATCHES:-1,16,64,256}
VARIANTS=${VARIANTS:-auto-graphs auto-graphs-async auto-graphs-fp8w-fp8kv}  # auto-eager: what the graphs bring
read -r -a BENCH <<<"${BENCH_ARGS:-}"
: >"$LOG"
: >"$JSONL"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
[ -z "${BENCH_ARGS:-}" ] && unset TRITON_INTERPRET

# step NAME SECONDS CMD...: run with a time limit, output to the log; a failure does not stop the rest
step() {
    local name=$1 limit=$2
    shift 2
    echo "== $name ($(date +%T), limit ${limit}s): $*" | tee -a "$LOG"
    timeout "$limit" "$@" 2>&1 | tee -a "$LOG"
    local rc=${PIPESTATUS[0]}
    printf "\n== %s: rc %d\n" "$name" "$rc" | tee -a "$LOG"
    return "$rc"
}

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $PY -c "import torch, triton, transformers as t; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', t.__version__)"
} 2>&1 | tee -a "$LOG"

step kernels 110 $PY -m pytest tests/kernels -m "gpu or not gpu" -p no:cacheprovider -W ignore::DeprecationWarning
rc=$?
summary=$(grep -E "(passed|failed|error)" "$LOG" | tail -1 | tr -d '"=' | sed 's/^ *//')
printf '{"check": "kernel_tests", "rc": %d, "summary": "%s"}\n' "$rc" "$summary" >>"$JSONL"

step speculative 200 $PY scripts/gpu_bench.py speculative "${BENCH[@]}" --json "$JSONL"
step equality 90 $PY scripts/gpu_bench.py equality "${BENCH[@]}" --json "$JSONL"
step load 45 $PY scripts/gpu_bench.py load "${BENCH[@]}" --json "$JSONL"
for variant in $VARIANTS; do  # backend-mode[-fp8w][-fp8kv][-async]
    IFS=- read -r -a parts <<<"$variant"
    flags=(--backend "${parts[0]}")
    case ${parts[1]} in
        eager) flags+=(--enforce-eager) ;;
        decodegraphs) flags+=(--no-piecewise) ;;
    esac
    for option in "${parts[@]:2}"; do
        case $option in
            fp8kv | fp8) flags+=(--kv-cache-dtype fp8) ;;
            fp8w) flags+=(--quantization fp8) ;;
            async) flags+=(--async-scheduling) ;;
        esac
    done
    step "throughput-$variant" 85 $PY scripts/gpu_bench.py throughput "${flags[@]}" --batch-sizes "$BATCHES" \
        "${BENCH[@]}" --json "$JSONL"
done
step transformers 120 $PY scripts/gpu_bench.py hf --batch-sizes "$BATCHES" "${BENCH[@]}" --json "$JSONL"

$PY scripts/gpu_bench.py table "$JSONL" | tee "$RES/table.md"
