#!/usr/bin/env bash
# One prepared GPU session (docs/bench/report-gpu.md): the CUDA tests, then the benchmark pair's
# shapes with random weights through `specbatch bench` (per prompt + throughput) and `bench --job`
# in bf16 and fp32, and the static-cache backend's CUDA graphs per step (scripts/static_backend_bench.py).
# Each stage has its own time cap inside DEADLINE seconds in all, so a slow or failing stage costs only
# itself; everything is logged to OUT/gpu.log, reports copied to OUT.
#
#   OUT=/tmp/gpu-out DEADLINE=520 bash scripts/gpu_check.sh
#
# Needs: a CUDA torch, transformers 5.x, the project's other dependencies importable (on a machine
# without an index: wheels under .whl/, installed to /tmp/site first), the Qwen tokenizer saved
# under .gpu/qwen-tok (scripts/gpu_models.py says how) and a job file .gpu/job12.jsonl
# (`head -12 examples/job-mixed-48.jsonl`).
set -u
OUT=${OUT:-/tmp/gpu-out}; DEADLINE=${DEADLINE:-520}; MODELS=${MODELS:-/tmp/gpu-models}
DEVICE=${DEVICE:-cuda}; SCALE=${SCALE:-1.0}   # (DEVICE=cpu SCALE=0.1: a dry run of this script on a CPU)
mkdir -p "$OUT"; LOG="$OUT/gpu.log"; START=$(date +%s)
export PYTHONUNBUFFERED=1 SPECBATCH_CACHE_DIR=/tmp/specbatch-cache HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
SB=(python3 -c 'import sys; from specbatch.cli.main import main; sys.argv[0] = "specbatch"; main()')   # no install needed

stage() {   # stage NAME CAP_SECONDS COMMAND...: runs within what is left of DEADLINE
    local name=$1 cap=$2; shift 2
    local left=$(( DEADLINE - ($(date +%s) - START) ))
    (( cap > left )) && cap=$left
    if (( cap < 20 )); then echo "=== $name: skipped (${left}s left)" | tee -a "$LOG"; return; fi
    echo "=== $name (cap ${cap}s, $(( $(date +%s) - START ))s in)" | tee -a "$LOG"
    local t0=$(date +%s)
    timeout --kill-after=5 "$cap" "$@" >>"$LOG" 2>&1
    echo "=== $name: rc=$? in $(( $(date +%s) - t0 ))s" | tee -a "$LOG"
}

{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__, torch.cuda.get_device_name(0))'
  nproc; } >>"$LOG" 2>&1

if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >>"$LOG" 2>&1
    export PYTHONPATH=/tmp/site:$PWD:$PWD/scripts
else
    export PYTHONPATH=$PWD:$PWD/scripts
fi

stage models 120 python3 scripts/gpu_models.py --tokenizer .gpu/qwen-tok --out "$MODELS" --dtype bfloat16 --scale "$SCALE" --device "$DEVICE"
T="$MODELS/qwen2.5-coder-1.5b-shape"; D="$MODELS/qwen2.5-coder-0.5b-shape"

stage cuda-tests 120 python3 -m pytest -p no:cacheprovider -q -rs -n 0 tests/engine/test_cuda.py tests/engine/test_errors.py

# (the classes serve every row of up to compile.static.FIXED_COLUMNS on CUDA: report-gpu.md)
stage static-bf16 180 python3 scripts/static_backend_bench.py --device "$DEVICE" --dtype bfloat16 --target "$T" --no-lock \
    --skip job --batch-sizes 1,8 --positions 1,2,4 --prompt-len 200 --rounds 3 --steps 5 --cache-dir /tmp/static-bf16 \
    --json "$OUT/static-bf16.json"

# (12 lines: on an H200 the 1.5B shape's eager step is ~21 ms of launches, and random weights never stop early,
# so stop 47's 24 lines at B 8 and 24 outran 120 s in the unbatched reference)
stage job-bf16 150 "${SB[@]}" bench --job .gpu/job12.jsonl --device "$DEVICE" --dtype bfloat16 --target "$T" --draft "$D" \
    --no-llama-cpp --batch-sizes 12 --repeats 1 --no-breakdown --out /tmp/job-bf16
cp /tmp/job-bf16/job-report.md "$OUT/job-bf16.md" 2>/dev/null

stage bench-bf16 150 "${SB[@]}" bench --device "$DEVICE" --dtype bfloat16 --target "$T" --draft "$D" --random-weights --no-ngram \
    --no-llama-cpp --num-prompts 2 --max-new-tokens 32 --repeats 1 --hf-settings const5 --gamma-grid 2,4 \
    --batch-sizes 1,8 --throughput-prompts 8 --out /tmp/bench-bf16
cp /tmp/bench-bf16/report.md "$OUT/bench-bf16.md" 2>/dev/null

stage job-fp32 100 "${SB[@]}" bench --job .gpu/job12.jsonl --device "$DEVICE" --dtype float32 --target "$T" --draft "$D" \
    --no-llama-cpp --batch-sizes 8 --repeats 1 --no-breakdown --out /tmp/job-fp32
cp /tmp/job-fp32/job-report.md "$OUT/job-fp32.md" 2>/dev/null

echo "=== all done in $(( $(date +%s) - START ))s" | tee -a "$LOG"
