#!/usr/bin/env bash
# The wheel bench/gpu_session.sh installs on a GPU machine without network, downloaded where there is network:
# transformers 5.23.0, the first release with Sapiens2 (for a machine with an older one). Alone: its requirements are
# already on the machine (huggingface-hub 1.33, tokenizers 0.23.2, safetensors 0.8, numpy, regex, typer...),
# and a plain `pip download transformers==5.23.0` fetches ~31 wheels for *this* machine's Python, which do not
# install on the machine's Python 3.12. transformers is pure Python: one py3-none-any wheel, ~13 MB.
#
#   bash bench/fetch_wheels.sh            # -> tmp/whl/ (git-ignored); copy it to the GPU machine's checkout
#   bash bench/fetch_wheels.sh DIR
#
# The session installs it with `pip install --no-index --no-deps --target /tmp/site` and prints the versions
# it then imports (runtime_info).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DIR=${1:-tmp/whl}
VERSION=${TRANSFORMERS_VERSION:-5.23.0}
mkdir -p "$DIR"
"$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 -d "$DIR" "transformers==$VERSION"
wheels=("$DIR"/transformers-*.whl)
if (( ${#wheels[@]} != 1 )); then
    echo "error: $DIR holds ${#wheels[@]} transformers wheels; keep one (two stop the install on the machine)" >&2
    exit 2
fi
echo "ok: ${wheels[0]} ($(du -h "${wheels[0]}" | cut -f1)); copy $DIR/ to the GPU machine's checkout"
