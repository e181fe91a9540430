#!/usr/bin/env bash
# The whole GPU check in ONE command for a short device lease (15 minutes in all, machine start included):
# most important rows first, each step under its own timeout, everything under one deadline (DEADLINE, default
# 510 s, well inside the device tool's 600 s per command), every row written to $OUT as it is measured.
#
#   run(command="bash bench/gpu_session.sh", carry=["tmp/whl"], timeout_s=600)     # the device tool
#   DEADLINE=300 STEPS="1 2" bash bench/gpu_session.sh                              # a subset
#
# Steps (a step starts only if at least MIN_STEP seconds are left; what is skipped is said in the log):
#   1  attention, 0.4b, batch 8, N = 3081, bf16, full-attention and GQA blocks, forward and forward +
#      backward: Triton (autotuned; its choice in the row's config) and the forward variants forced
#      (triton[128x64w8s3], ...r128 two programs per SM, ...o overlapped softmax, ...to + TMA, ...tog + persistent,
#      128x128w8s2to) | auto (the default dispatch) | SDPA reference | SDPA flash | cuDNN | efficient
#      -> targets: >= 450 TFLOP/s forward at D = 64, >= 300 forward + backward, auto never below SDPA
#      (about 60 compiles: the forward autotunes over 10 (MHA) or 13 (GQA) configurations, dK/dV 7, dQ 6).
#      Every row carries max_rel_err against the fp32 reference on the same inputs: a fast variant that computes
#      something else shows.
#   2  the copy ceiling (1 GiB device copy), then qk_norm_rope 0.4b and 5b (bf16 and fp32 q/k, bf16 tables)
#      -> >= 80% of the copy bandwidth
#   3  attention, 5b (the aligned D = 76 layout) and 0.8b (D = 80), batch 8 -> >= 400 TFLOP/s forward
#   4  end to end, backbone, batch 8, 1024x768, bf16: 0.4b ours-triton | hf (SDPA) | hf-compile, then 1b
#      ours-triton | hf -> >= 1.5x hf and >= 1.15x compile(hf) at 0.4b (needs the transformers 5.23.0 wheel
#      in tmp/whl: python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#      --implementation cp -d tmp/whl transformers==5.23.0)
#   5  the kernel tests compiled on CUDA (tiles pinned in the tests: a few compiles, not ~100)
# Outputs in $OUT (at most 8 files come back): gpu-session.log, kernels-{1,2,3}.json, auto-choices.json,
# e2e.json (+ .md, .png). Without $OUT (a plain GPU machine) they go to /tmp/sapiens2-gpu-<time>/, never
# into the repository. Dry run without a GPU: PYTHON=<stub> bash bench/gpu_session.sh (see kernels/README.md).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DEADLINE=${DEADLINE:-510}
MIN_STEP=${MIN_STEP:-30}
STEPS=${STEPS:-"1 2 3 4 5"}
START=$(date +%s)
DEST=${OUT:-/tmp/sapiens2-gpu-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$DEST"
LOG="$DEST/gpu-session.log"
export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=${TRITON_DEFAULT_FP_FUSION:-1} TRANSFORMERS_VERBOSITY=error \
    HF_HUB_OFFLINE=1
# One autotuning cache for the whole session (and kept with the machine), so later steps reuse compiles.
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/sapiens2-triton-cache}
# The dispatch's timing choices, recorded for the log.
export SAPIENS2_KERNELS_CACHE=${SAPIENS2_KERNELS_CACHE:-$DEST/auto-choices.json}

elapsed() { echo $(( $(date +%s) - START )); }
left() { echo $(( DEADLINE - $(elapsed) )); }
say() { echo "$*" | tee -a "$LOG"; }
step() {  # step N NAME LIMIT command...: run it if wanted and the deadline leaves MIN_STEP s, never past it
    local n=$1 name=$2 limit=$3; shift 3
    case " $STEPS " in *" $n "*) ;; *) return ;; esac
    local l; l=$(left)
    if (( l < MIN_STEP )); then say "== step $n $name: not run, ${l}s left"; return; fi
    (( limit > l )) && limit=$l
    say "== step $n $name (limit ${limit}s) at $(elapsed)s"
    timeout --signal=INT --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$LOG"
    say "== step $n $name: exit ${PIPESTATUS[0]} at $(elapsed)s"
}

say "== sapiens2 GPU session, deadline ${DEADLINE}s, results in $DEST"
timeout 30 nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv 2>&1 | tee -a "$LOG"
timeout 60 $PY -c "import sys; sys.path.insert(0, '.'); import json, runtime_info; print(json.dumps(runtime_info.versions()))" 2>&1 | tee -a "$LOG"

# transformers 5.23.0 for the HF rows: carried as a wheel (nothing can be downloaded on the device machine).
WHEELS=${WHEELS:-tmp/whl}
if [[ " $STEPS " == *" 4 "* ]] && ! timeout 60 $PY -c "import transformers; transformers.Sapiens2Model" 2>/dev/null; then
    if ls "$WHEELS"/transformers-5.23.0-*.whl >/dev/null 2>&1; then
        timeout 60 $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            "$WHEELS"/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    else
        say "transformers 5.23.0 not found (and no wheel in $WHEELS): the HF rows of step 4 will be skipped"
    fi
fi

step 1 "attention 0.4b" 200 $PY bench/kernels.py --device cuda --presets 0.4b --batches 8 --ops attention \
    --out "$DEST/kernels-1.json"
step 2 "copy ceiling + qk_norm_rope" 45 $PY bench/kernels.py --device cuda --presets 0.4b,5b --batches 8 \
    --ops copy,qk_norm_rope --out "$DEST/kernels-2.json"
step 3 "attention 5b, 0.8b" 100 $PY bench/kernels.py --device cuda --presets 5b,0.8b --batches 8 --ops attention \
    --out "$DEST/kernels-3.json"
E2E=(bench/e2e.py --device cuda --dtype bf16 --size 1024 768 --models backbone --batches 8
     --work-dir /tmp/sapiens2-e2e-work --out "$DEST/e2e.json" --append --timeout 100)
step 4 "e2e backbone 0.4b" 90 $PY "${E2E[@]}" --presets 0.4b --impls ours-triton,hf,hf-compile
step 4 "e2e backbone 1b" 60 $PY "${E2E[@]}" --presets 1b --impls ours-triton,hf
step 5 "kernel tests on CUDA" 50 $PY -m pytest tests/test_kernels.py -q -x -p no:cacheprovider
say "== gpu session done in $(elapsed)s; results in $DEST"
