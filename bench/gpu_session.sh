#!/usr/bin/env bash
# The whole GPU check in ONE command, for a device lease of 15 minutes in all (machine start included): the
# most important measurements first, each step under its own timeout, everything under one deadline.
#
#   bash bench/gpu_session.sh              # through the device tool: run(command=..., carry=["tmp/whl"],
#                                          #   timeout_s=600); results come back under $OUT
#   DEADLINE=540 bash bench/gpu_session.sh
#
# Steps (a step starts only if the deadline leaves it room; what is skipped is said in the log):
#   1  e2e part 1: 0.4b backbone, batch 8, 1024x768, bf16: ours-triton | hf (SDPA) | compile(hf) |
#      compile(ours) | ours -> issue 7's targets (>= 1.5x hf, >= 1.15x compile(hf), <= 1.3x the FLOP floor)
#   2  bench/kernels.py --quick: attention vs SDPA at N = 3081 (target >= 450 TFLOP/s, >= the fastest SDPA),
#      qk_norm_rope vs a copy (target >= 80% of copy bandwidth)
#   3  the kernel tests, compiled on CUDA (tests/test_kernels.py)
#   4  e2e parts 2 and 3: 0.4b batch 1 (+ CUDA graph), the 0.4b task models (+ channels-last heads)
# Needs the transformers 5.23.0 wheel in tmp/whl for the HF rows (see bench/gpu_e2e.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DEADLINE=${DEADLINE:-560}
START=$(date +%s)
DEST=${OUT:-bench/results}
mkdir -p "$DEST"
LOG="$DEST/gpu-session.log"
left() { echo $(( DEADLINE - ($(date +%s) - START) )); }
step() {  # step NAME LIMIT command...: run it if at least 40 s are left, never past the deadline
    local name=$1 limit=$2; shift 2
    local l; l=$(left)
    if (( l < 40 )); then echo "== $name not run: ${l}s left" | tee -a "$LOG"; return; fi
    (( limit > l )) && limit=$l
    echo "== $name (${limit}s) at $(( $(date +%s) - START ))s" | tee -a "$LOG"
    timeout --signal=INT --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$LOG"
    echo "== $name exit ${PIPESTATUS[0]} at $(( $(date +%s) - START ))s" | tee -a "$LOG"
}

budget=$(( $(left) < 250 ? $(left) : 250 ))  # gpu_e2e.sh gets the same deadline as its step
step "e2e part 1" "$budget" env DEADLINE="$budget" PARTS="1" bash bench/gpu_e2e.sh
step "kernel benchmark" 110 $PY bench/kernels.py --device cuda --quick --out "$DEST/kernels-gpu-$(date +%F).json"
step "kernel tests on CUDA" 100 $PY -m pytest tests/test_kernels.py -q -x -p no:cacheprovider
step "e2e parts 2 3" "$(left)" env DEADLINE="$(( $(left) - 5 ))" PARTS="2 3" bash bench/gpu_e2e.sh
echo "gpu session done in $(( $(date +%s) - START ))s; results in $DEST"
