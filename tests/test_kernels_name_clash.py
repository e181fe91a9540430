"""Our `kernels/` package against the Hugging Face hub package of the same name.

transformers probes for the hub's `kernels` with importlib.util.find_spec("kernels"); when no package
metadata answers, it IMPORTS the first `kernels` on sys.path and reads its `__version__`. With this repository
root on sys.path that is ours, so `kernels/__init__.py` must be import-light (no triton), side-effect free
and without `__version__`; then transformers concludes the hub package is absent. Each check runs in a fresh
interpreter, because both the probe and the import are cached per process.
"""

import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run_fresh(code: str) -> dict:
    """Run `code` in a new interpreter with the repository root first on sys.path; it prints one JSON line."""
    prelude = f"import json, sys\nsys.path.insert(0, {str(ROOT)!r})\n"
    proc = subprocess.run([sys.executable, "-c", prelude + code], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_import_kernels_is_light():
    out = run_fresh(
        "import kernels\n"
        "print(json.dumps({'triton': 'triton' in sys.modules, 'version': hasattr(kernels, '__version__'),\n"
        "                  'file': kernels.__file__, 'api': sorted(kernels.__all__)}))\n"
    )
    assert out["file"].startswith(str(ROOT)), out["file"]
    assert not out["triton"], "import kernels imported triton"
    assert not out["version"], "kernels/__init__.py must not define __version__"
    assert {"attention", "qk_norm_rope", "attention_reference", "qk_norm_rope_reference"} <= set(out["api"])


def test_transformers_does_not_mistake_ours_for_the_hub_package():
    pytest.importorskip("transformers")
    out = run_fresh(
        "import importlib.util\n"
        "spec = importlib.util.find_spec('kernels')\n"
        "import transformers\n"
        "from transformers.utils import import_utils\n"
        "available = import_utils.is_kernels_available()\n"
        "fa2_fallback = import_utils.is_flash_attn_2_available(kernels_fallback_ok=True)\n"
        "mod = sys.modules.get('kernels')\n"
        "print(json.dumps({'origin': spec.origin, 'available': bool(available), 'fa2': bool(fa2_fallback),\n"
        "                  'imported_file': getattr(mod, '__file__', None), 'triton': 'triton' in sys.modules,\n"
        "                  'version': getattr(mod, '__version__', None) if mod else None}))\n"
    )
    # The probe does see our package (the clash is real in this setup) ...
    assert out["origin"].startswith(str(ROOT)), out["origin"]
    # ... and, ours having neither metadata nor __version__, transformers reports the hub package absent.
    assert out["available"] is False
    assert out["fa2"] is False
    assert out["version"] is None
    if out["imported_file"] is not None:  # transformers imported ours to look for __version__
        assert out["imported_file"].startswith(str(ROOT))
        assert not out["triton"], "transformers' probe of our kernels imported triton"
