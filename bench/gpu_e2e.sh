#!/usr/bin/env bash
# One-shot GPU run of bench/e2e.py: the end-to-end table (issue 7), most important rows first, each part under
# its own timeout and all of them under one deadline, so that a short run on a GPU still returns the key ratios.
#
#   bash bench/gpu_e2e.sh                 # results -> $OUT if set, else bench/results/
#   DEADLINE=540 PARTS="1 2 3" bash bench/gpu_e2e.sh
#
# Needs: torch with CUDA (2.11 was tried on an H200), triton (3.6), safetensors, pillow, numpy, and
# transformers 5.23.0 for the HF rows (the first release with Sapiens2). On a GPU machine without network, bring
# the wheel: where there is network,
#     bash bench/fetch_wheels.sh                   # tmp/whl/ (git-ignored); copy it to the GPU machine
# and this script installs it with --no-index into /tmp/site. (With network access instead:
#     pip install transformers==5.23.0 safetensors .)
# Without transformers 5.23 the HF rows are reported as skipped, with the reason, and ours still run.
#
# Order (a part starts only while DEADLINE seconds have not passed; the rest is reported as not run):
#   1  0.4b backbone, batch 8, bf16: ours-triton | hf (SDPA) | compile(hf) | compile(ours) | ours (reference kernels)
#      -> the issue's targets: >= 1.5x hf, >= 1.15x compile(hf), within 1.3x of the FLOP floor
#   2  0.4b backbone, batch 1, bf16: ours-triton | ours-graph (CUDA graph) | hf | compile(hf)
#   3  0.4b task models (seg, pose, normal, pointmap, albedo), batch 8, bf16: ours-triton | ours-triton-cl
#      (channels-last head) | hf
#   4  0.1b and 1b backbone, batch 8 and 1, bf16: ours-triton | hf | compile(hf)
#   5  1b task models (seg, normal, pointmap, matting), batch 8: ours-triton | hf
#   6  5b backbone, batch 8 and 1: ours-triton | hf
#   7  0.4b task models, batch 8: compile(hf) | compile(ours);  0.4b backbone fp32 batch 8: ours-triton | hf
set -uo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
DEADLINE=${DEADLINE:-560}          # seconds for the whole script: bounded by design, under 10 minutes
PARTS=${PARTS:-"1 2 3 4 5 6 7"}
DEST=${OUT:-bench/results}
mkdir -p "$DEST"
START=$(date +%s)
export PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error HF_HUB_OFFLINE=1
export TRITON_DEFAULT_FP_FUSION=1 TRITON_CACHE_AUTOTUNING=1   # as bench/gpu_session.sh: one cache key, tuning reused

WHEELS=${WHEELS:-tmp/whl}
if ! $PY -c "import transformers; transformers.Sapiens2Model" 2>/dev/null; then
    if ls "$WHEELS"/transformers-5.23.0-*.whl >/dev/null 2>&1; then
        $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            "$WHEELS"/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    else
        echo "transformers 5.23.0 not found (and no wheel in $WHEELS): HF rows will be skipped" >&2
    fi
fi
$PY - <<'EOF'
import torch, importlib
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else "NO GPU")
for m in ("triton", "transformers"):
    try: print(m, importlib.import_module(m).__version__)
    except Exception as e: print(m, "missing:", e)
EOF
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv 2>/dev/null || true

RESULT="$DEST/e2e-gpu-$(date +%F).json"
WORK=/tmp/sapiens2-e2e-work        # weights are shared between parts (one random model per preset/model/dtype)
mkdir -p "$WORK"

part() {  # part N TIMEOUT args...: run bench/e2e.py if the deadline allows, appending to one JSON
    local n=$1 limit=$2; shift 2
    case " $PARTS " in *" $n "*) ;; *) return ;; esac
    local left=$(( DEADLINE - ($(date +%s) - START) ))
    if (( left < 45 )); then echo "== part $n not run: ${left}s left before the deadline" | tee -a "$DEST/e2e-gpu.log"; return; fi
    (( limit > left )) && limit=$left
    echo "== part $n (${limit}s): $*" | tee -a "$DEST/e2e-gpu.log"
    timeout --signal=INT --kill-after=15 "$limit" $PY bench/e2e.py --device cuda --dtype bf16 --size 1024 768 \
        --work-dir "$WORK" --out "$RESULT" --append --timeout 300 "$@" 2>&1 | tee -a "$DEST/e2e-gpu.log"
    echo "== part $n exit ${PIPESTATUS[0]} after $(( $(date +%s) - START ))s" | tee -a "$DEST/e2e-gpu.log"
}

part 1 260 --presets 0.4b --models backbone --batches 8 --impls ours-triton,hf,hf-compile,ours-compile,ours
part 2 200 --presets 0.4b --models backbone --batches 1 --impls ours-triton,hf,hf-compile --cuda-graphs
part 3 200 --presets 0.4b --models seg,pose,normal,pointmap,albedo --batches 8 --impls ours-triton,ours-triton-cl,hf
part 4 200 --presets 0.1b,1b --models backbone --batches 8,1 --impls ours-triton,hf,hf-compile
part 5 150 --presets 1b --models seg,normal,pointmap,matting --batches 8 --impls ours-triton,hf
part 6 200 --presets 5b --models backbone --batches 8,1 --impls ours-triton,hf --reps 10
part 7 240 --presets 0.4b --models seg,normal,pointmap --batches 8 --impls hf-compile,ours-compile
part 7 120 --presets 0.4b --models backbone --batches 8 --impls ours-triton,hf --dtype fp32

if [ -f "$RESULT" ]; then
    $PY bench/e2e.py --report "$RESULT"
    cat "${RESULT%.json}.md"
fi
echo "done in $(( $(date +%s) - START ))s; results in $DEST"
