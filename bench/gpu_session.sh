#!/usr/bin/env bash
# The whole GPU check in ONE command, on any machine with an NVIDIA GPU (written for an H200): torch with CUDA,
# triton 3.6 to 3.9, and transformers 5.23.0 for the HF rows (installed from tmp/whl/ when the machine has an older
# one and no network; see bench/fetch_wheels.sh). By design it is bounded: under 10 minutes in all, no network
# needed, and at most 8 result files in OUT_DIR, few enough to copy back from a remote machine.
#
#   bash bench/fetch_wheels.sh                             # once, on a machine with network: tmp/whl/
#   bash bench/gpu_session.sh OUT_DIR                      # on the GPU machine (or OUT=OUT_DIR bash ...)
#   STEPS="sdpa forced" bash bench/gpu_session.sh OUT_DIR  # some steps only
#
# Steps, in this order, each in its own process(es) under its own time limit (LIMIT below: with the setup they
# sum to under DEADLINE, 540 s). Every row is written to $OUT as it is measured (an atomic rewrite of the JSON),
# so a step that is killed keeps the rows it wrote, and the next step still runs.
#   tests     first, before any benchmark: tests/test_cuda_only.py (every configuration the autotuner may pick at
#             head dims 64/80/76, forward and backward; the checked first launch; a model on cuda:1 if there is
#             one), then a dozen CUDA tests of tests/test_kernels.py; -v, so the log names each test that passed
#             even if a later one faults the GPU, and the bounds on the GPU's post-processing; the summary counts them
#   sdpa      attention 0.4b, batch 8, N = 3081, bf16, full-attention and GQA blocks, forward and forward +
#             backward: the SDPA reference and SDPA's flash / cuDNN / efficient backends (no Triton: these rows
#             exist even if a Triton kernel later faults the GPU)
#   forced    each forced Triton forward variant (bench/kernels.py --list-forced) in its own process: one that
#             faults loses only its own row and is named in the log; every variant without a timed row is then
#             excluded from autotuning (SAPIENS2_TRITON_EXCLUDE) in all later steps
#   autotune  attention 0.4b: Triton autotuned (its choice in the row's config) and `auto` (the default
#             dispatch), forward and forward + backward -> >= 450 TFLOP/s forward at D = 64, >= 300 fwd + bwd,
#             auto never below SDPA. No Triton row from forced, or none from autotune, with a process that
#             crashed or failed (not one stopped at its limit): the session stops there (the later steps run the
#             same kernels) and says so.
#   qk        the copy ceiling (1 GiB device copy), qk_norm_rope 0.4b and 5b (bf16 and fp32 q/k, bf16 tables)
#             -> >= 80% of the copy bandwidth
#   5b, 0.8b  attention forward only (5b: the aligned D = 76 layout; 0.8b: D = 80): Triton autotuned, auto, SDPA
#             flash, reference -> >= 400 TFLOP/s
#   e2e       the 0.4b backbone, batch 8, 1024x768, bf16: hf (SDPA) then ours-triton -> >= 1.5x hf (1b: not in the
#             first run)
#   pipeline  predict.py seg on 32 photos of 1080x1440, batch 8, the real-size 0.4b model (random weights), against
#             the model alone (issue 24, item 4) -> >= 80% of the model-only rate
#   predict   predict.py seg, pose and normal on 16 photos each, against the model alone, with the host's ms per
#             photo by stage and the bytes that left the GPU per photo (issue 37)
#   compile   the 0.4b backbone under a cold torch.compile(hf), compared with the e2e step's hf outputs: the
#             slowest job, alone and last, with whatever time is left -> ours-triton >= 1.15x compile(hf)
# Outputs in OUT_DIR (at most 8 files by design; this writes 6): gpu-session.log, kernels.json, e2e.json,
# pipeline.json, predict.json, auto-choices.json. The .md/.png reports are made later from the JSON
# (`python bench/e2e.py --report e2e.json`). Without OUT_DIR they go to /tmp/sapiens2-gpu-<time>/, never into
# the repository. Rehearsed on CPU, with a stand-in python3 and nvidia-smi,
# by tests/test_gpu_session.py.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DEADLINE=${DEADLINE:-540}
MIN_STEP=${MIN_STEP:-8}                 # a step starts only with at least this many seconds left
KILL_AFTER=5                            # seconds between a step's INT at its limit and its KILL
LIMIT_DIVISOR=${LIMIT_DIVISOR:-1}       # the CPU rehearsal shrinks every step's limit by this factor
ALL_STEPS="tests sdpa forced autotune qk 5b 0.8b e2e pipeline predict compile"
STEPS=${STEPS:-$ALL_STEPS}
WHEELS=${WHEELS:-tmp/whl}
# Seconds per step (forced: per variant). With SETUP_LIMIT and 6 forced variants: 540 s (the log prints the sum).
declare -A LIMIT=([tests]=80 [sdpa]=25 [forced]=15 [autotune]=45 [qk]=20 [5b]=35 [0.8b]=35 [e2e]=40 [pipeline]=30
                  [predict]=56 [compile]=20)
SETUP_LIMIT=64                          # nvidia-smi 8, wheel install 25, versions 16, forced labels 15

START=$(date +%s)
DEST=${1:-${OUT:-/tmp/sapiens2-gpu-$(date +%Y%m%d-%H%M%S)}}
mkdir -p "$DEST"
LOG=$DEST/gpu-session.log
KERNELS=$DEST/kernels.json
E2E_JSON=$DEST/e2e.json
PIPELINE_JSON=$DEST/pipeline.json
WORK=/tmp/sapiens2-e2e-work             # e2e weights and outputs, shared by the e2e and compile steps
export PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error HF_HUB_OFFLINE=1
# In every step: FP fusion stated (it is part of Triton's cache key: a step that differed would compile again)
# and the autotuner's results cached on disk, so later steps reuse the autotune step's choices.
export TRITON_DEFAULT_FP_FUSION=1 TRITON_CACHE_AUTOTUNING=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/sapiens2-triton-cache}
export SAPIENS2_KERNELS_CACHE=$DEST/auto-choices.json   # the dispatch's timing choices
export SAPIENS2_TRITON_EXCLUDE=${SAPIENS2_TRITON_EXCLUDE:-}
CUDA_TESTS=(  # attention_triton.py's forward/backward at D = 80 (0.8b), 76 (5b) and fp32, GQA packing, the
              # Hopper variants forward and backward, qk_norm_rope at D = 76, the model on the Triton kernels, NaN bits
    "tests/test_kernels.py::test_attention_forward_backward[dtype5-80-3-4-2-44]"
    "tests/test_kernels.py::test_attention_forward_backward[dtype7-76-1-4-4-44]"
    "tests/test_kernels.py::test_attention_forward_backward[dtype3-76-1-4-2-44]"
    "tests/test_kernels.py::test_attention_forward_gqa_packed[dtype4-80-3-4-2-44]"
    "tests/test_kernels.py::test_attention_forward_variants[dtype2-80-3-4-2-44-tma]"
    "tests/test_kernels.py::test_attention_forward_variants[dtype2-80-3-4-2-44-plain-order-r128]"
    "tests/test_kernels.py::test_attention_forward_variants[dtype2-80-3-4-2-44-tma-persistent]"
    "tests/test_kernels.py::test_attention_forward_variants[dtype2-80-3-4-2-44-poly-exp2-tma-packed]"
    "tests/test_kernels.py::test_attention_backward_variants[dtype2-80-3-4-2-44-overlap]"
    "tests/test_kernels.py::test_attention_backward_variants[dtype2-80-3-4-2-44-tma]"
    "tests/test_kernels.py::test_qk_norm_rope_forward[dtype6-rope_dtype6-76-1-2-2]"
    "tests/test_kernels.py::test_model_forward_on_triton_kernels_matches_reference[dtype1-bfloat16]"
    "tests/test_kernels.py::test_round_to_bf16_keeps_nan_and_matches_torch"
    # how far the GPU's post-processing may differ from the CPU's (docs/predict.md)
    "tests/test_device_boundary.py::test_on_cuda_outputs_differ_from_the_cpu_only_in_their_last_bits"
)

elapsed() { echo $(( $(date +%s) - START )); }
now_ms() { echo $(( $(date +%s%N) / 1000000 )); }
left() { echo $(( DEADLINE - $(elapsed) )); }
say() { echo "$*" | tee -a "$LOG"; }
wanted() { [[ " $STEPS " == *" $1 "* ]]; }
limit_of() { local l=$(( $1 / LIMIT_DIVISOR )); echo $(( l < 1 ? 1 : l )); }
ABORT=""                                # set when the later steps would only repeat a failure
SUMMARY=()                              # one line per step, printed at the end
run() {  # run NAME LIMIT command...: under LIMIT s, never past DEADLINE, its output in the log; RC = its exit status
    local name=$1 limit; limit=$(limit_of "$2"); shift 2
    local l; l=$(left)
    RC=skipped STOPPED=0
    if [[ -n $ABORT ]]; then say "== $name: not run ($ABORT)"; SUMMARY+=("$name: not run"); return; fi
    if (( l < MIN_STEP )); then say "== $name: not run, ${l}s left"; SUMMARY+=("$name: not run (deadline)"); return; fi
    (( limit > l )) && limit=$l
    say "== $name (limit ${limit}s) at $(elapsed)s"
    local began; began=$(now_ms)
    timeout --signal=INT --kill-after="$KILL_AFTER" "$limit" "$@" 2>&1 | tee -a "$LOG"
    RC=${PIPESTATUS[0]}
    local ran=$(( $(now_ms) - began )) what="exit $RC"
    (( RC > 128 )) && what="killed by signal $(( RC - 128 )) (exit $RC)"
    # timeout exits 124 when INT stopped the command at its limit, and 137 when the command outlived INT and was
    # killed KILL_AFTER s later, so a 137 that came sooner is a kill from outside (the OOM killer, a fault). In
    # milliseconds: whole seconds of `date +%s` can count a 0.1 s run as a 1 s one, i.e. as one at its limit.
    if (( RC == 124 || (RC == 137 && ran >= (limit + KILL_AFTER) * 1000) )); then
        STOPPED=1 what="stopped at its ${limit}s limit (exit $RC)"
    fi
    say "== $name: $what at $(elapsed)s"
    SUMMARY+=("$name: $what")
}
kernels() { run "$1" "$2" "$PY" bench/kernels.py --device cuda --batches 8 --out "$KERNELS" --append "${@:3}"; }

say "== sapiens2 GPU session, deadline ${DEADLINE}s, results in $DEST, steps: $STEPS"
timeout 8 nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,driver_version --format=csv \
    2>&1 | tee -a "$LOG"
# transformers 5.23.0 for the HF rows, carried as a wheel (bench/fetch_wheels.sh); installed without its
# requirements, which the machine has.
if ls "$WHEELS"/transformers-*.whl >/dev/null 2>&1; then
    timeout 25 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site "$WHEELS"/transformers-*.whl 2>&1 | tee -a "$LOG" \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
else
    say "no transformers wheel in $WHEELS (bash bench/fetch_wheels.sh): the hf rows need transformers with Sapiens2"
fi
# The versions every later step imports (after the wheel install; transformers has Sapiens2 from 5.23.0).
timeout 16 "$PY" -c "import json, sys; sys.path.insert(0, '.')
from sapiens2_app.common import runtime_info
print('versions', json.dumps(runtime_info.versions()))" 2>&1 | tee -a "$LOG"
FORCED=$(timeout 15 "$PY" bench/kernels.py --list-forced 2>>"$LOG" | tr '\n' ' ')
n_forced=$(wc -w <<<"$FORCED")
total=$SETUP_LIMIT
for s in $ALL_STEPS; do
    times=1; [[ $s == forced ]] && times=$n_forced
    total=$(( total + ${LIMIT[$s]} * times ))
done
say "== plan: limits ${total}s in all (setup ${SETUP_LIMIT}s, forced ${n_forced} x ${LIMIT[forced]}s) of the ${DEADLINE}s deadline; forced: ${FORCED:-none listed}"
(( total > DEADLINE )) && say "warning: the step limits sum past the deadline: the last steps may not run"

if wanted tests; then
    run tests "${LIMIT[tests]}" "$PY" -m pytest -p no:cacheprovider -v -rfE tests/test_cuda_only.py "${CUDA_TESTS[@]}"
    CUDA_TESTS_LINE="CUDA tests: $(grep -cE '^tests/.* PASSED' "$LOG") passed; failed or errors: $(grep -E \
        '^tests/.* (FAILED|ERROR)' "$LOG" | cut -d' ' -f1 | tr '\n' ' ')"
    say "== $CUDA_TESTS_LINE"
fi
if wanted sdpa; then
    kernels sdpa "${LIMIT[sdpa]}" --presets 0.4b --ops attention --impls sdpa
fi
if wanted forced; then
    [[ -z $FORCED ]] && say "== forced: bench/kernels.py --list-forced listed nothing (see the log)"
    slow=0                              # variants stopped at their limit: slow compiles, or a hang
    for label in $FORCED; do
        kernels "forced $label" "${LIMIT[forced]}" --presets 0.4b --ops attention --no-backward --impls "triton[$label]"
        slow=$(( slow + STOPPED ))
    done
    missing=$(timeout 15 "$PY" bench/session_report.py missing-forced "$KERNELS" $FORCED)
    if [[ -n $missing ]]; then
        SAPIENS2_TRITON_EXCLUDE=$(tr ' ' ',' <<<"$SAPIENS2_TRITON_EXCLUDE $missing" | sed 's/^,*//')
        say "== forced variants without a timed row: $missing -> SAPIENS2_TRITON_EXCLUDE=$SAPIENS2_TRITON_EXCLUDE"
    fi
    if [[ -n $FORCED ]] && ! timeout 15 "$PY" bench/session_report.py has-triton "$KERNELS" forced; then
        if (( slow < n_forced )); then  # some crashed or failed: the kernels themselves do not run here
            ABORT="no forced Triton variant came back: the Triton kernels do not run here"
            say "== stopping: $ABORT"
        else
            say "== no forced variant finished within ${LIMIT[forced]}s (slow compiles?): autotuning goes on"
        fi
    fi
fi
if wanted autotune; then
    kernels autotune "${LIMIT[autotune]}" --presets 0.4b --ops attention --impls triton,auto
    if [[ $RC != skipped ]] && (( ! STOPPED )) \
            && ! timeout 15 "$PY" bench/session_report.py has-triton "$KERNELS" autotuned; then
        ABORT="no autotuned Triton row came back (exit $RC): autotuning faults here"
        say "== stopping: $ABORT"
    fi
fi
wanted qk && kernels qk "${LIMIT[qk]}" --presets 0.4b,5b --ops copy,qk_norm_rope --impls triton,reference
wanted 5b && kernels 5b "${LIMIT[5b]}" --presets 5b --ops attention --no-backward \
    --impls triton,auto,sdpa_flash,reference
wanted 0.8b && kernels 0.8b "${LIMIT[0.8b]}" --presets 0.8b --ops attention --no-backward \
    --impls triton,auto,sdpa_flash,reference
E2E=(bench/e2e.py --device cuda --dtype bf16 --size 1024 768 --models backbone --batches 8 --presets 0.4b
     --work-dir "$WORK" --out "$E2E_JSON" --append --no-render)
wanted e2e && run e2e "${LIMIT[e2e]}" "$PY" "${E2E[@]}" --impls hf,ours-triton --timeout "${LIMIT[e2e]}"
wanted pipeline && run pipeline "${LIMIT[pipeline]}" "$PY" bench/pipeline.py --device cuda --real 0.4b --only-real \
    --tasks seg --photos 1080x1440 --images 32 --workers 8 --batch-size 8 --out "$PIPELINE_JSON"
# predict: predict.py's photos/s against the model-only rate for seg, pose and normal (16 photos of 1080x1440 each,
#          batch 8, --workers 8, the real-size 0.4b model with random weights, pre- and post-processing on the GPU);
#          each row has the host's ms per photo by stage and the bytes that left the GPU per photo. Rows are saved as
#          they come, so a step stopped at its limit keeps the tasks done.
wanted predict && run predict "${LIMIT[predict]}" "$PY" bench/pipeline.py --device cuda --real 0.4b --only-real \
    --tasks seg pose normal --photos 1080x1440 --images 16 --workers 8 --batch-size 8 --out "$DEST/predict.json"
# The last step takes what is left (at least its own limit): a cold compile of the 0.4b model may need minutes.
wanted compile && run compile "$(( $(left) > ${LIMIT[compile]} ? $(left) : ${LIMIT[compile]} ))" "$PY" "${E2E[@]}" \
    --impls hf-compile --timeout "$DEADLINE"

rm -f "$DEST"/.*.partial "$DEST"/*.tmp 2>/dev/null   # temporary files of a writer killed mid-write
say "== summary after $(elapsed)s"
for line in "${SUMMARY[@]}"; do say "  $line"; done
[[ -n ${CUDA_TESTS_LINE:-} ]] && say "  $CUDA_TESTS_LINE"
[[ -n $ABORT ]] && say "  stopped early: $ABORT"
[[ -n $SAPIENS2_TRITON_EXCLUDE ]] && say "  SAPIENS2_TRITON_EXCLUDE=$SAPIENS2_TRITON_EXCLUDE"
timeout 20 "$PY" bench/session_report.py summary "$DEST" 2>&1 | sed 's/^/  /' | tee -a "$LOG"
exit 0
