#!/usr/bin/env bash
# The GPU check (docs/gpu.md): one command on an NVIDIA GPU machine, under 8 minutes on an H200.
#   1. the kernel tests at full size on the device (compiled, not interpreted)
#   2. engine greedy equality on a tiny model: triton vs torch backend, CUDA graphs vs eager, fp8 KV
#   3. engine throughput on a Llama-2-7B-shaped model with random bf16 weights, triton backend: eager, CUDA
#      graphs, CUDA graphs + fp8 KV cache (VARIANTS; "torch-eager" adds the torch backend)
#   4. the same shapes through transformers generate, the baseline
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
VARIANTS=${VARIANTS:-triton-eager triton-graphs triton-graphs-fp8}
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

step equality 50 $PY scripts/gpu_bench.py equality "${BENCH[@]}" --json "$JSONL"
for variant in $VARIANTS; do  # backend-mode[-fp8]
    IFS=- read -r backend mode kv <<<"$variant"
    flags=(--backend "$backend")
    [ "$mode" = eager ] && flags+=(--enforce-eager)
    [ "$kv" = fp8 ] && flags+=(--kv-cache-dtype fp8)
    step "throughput-$variant" 85 $PY scripts/gpu_bench.py throughput "${flags[@]}" --batch-sizes "$BATCHES" \
        "${BENCH[@]}" --json "$JSONL"
done
step transformers 60 $PY scripts/gpu_bench.py hf --batch-sizes "$BATCHES" "${BENCH[@]}" --json "$JSONL"

$PY scripts/gpu_bench.py table "$JSONL" | tee "$RES/table.md"
