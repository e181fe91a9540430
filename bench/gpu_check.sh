#!/usr/bin/env bash
# One-shot GPU check of kernels/ (about 5-8 minutes on an H200, most of it autotuning and torch.compile):
#   1. the kernel tests, compiled on CUDA (the same tests CI runs in the Triton interpreter);
#   2. bench/kernels.py --quick (0.4b and 5b, batch 8, N = 3081), then the full table if time allows.
# Usage, from the repository root:  bash bench/gpu_check.sh [--full]
# Needs torch with CUDA, triton (3.6 to 3.9) and pytest. JSON results land in bench/results/.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
export TRITON_DEFAULT_FP_FUSION=${TRITON_DEFAULT_FP_FUSION:-1}
$PY - <<'PY'
import torch, triton
print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)
print("device", torch.cuda.get_device_name() if torch.cuda.is_available() else "NO CUDA")
PY
status=0
if $PY -c "import pytest" 2>/dev/null; then
    $PY -m pytest tests/test_kernels.py tests/test_kernels_name_clash.py -q -s -p no:cacheprovider || status=1
else
    echo "pytest is not installed: skipping the correctness tests (pip install pytest)"; status=1
fi
$PY bench/kernels.py --device cuda --quick || status=1
if [ "${1:-}" = "--full" ]; then
    $PY bench/kernels.py --device cuda || status=1
fi
exit $status
