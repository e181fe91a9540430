"""Facts about the machine a run happens on, recorded beside results: package versions and device peaks.

One definition for predict.py's manifest and the benchmarks (bench/e2e.py, bench/kernels.py).
"""

from __future__ import annotations

import importlib.metadata
import platform

import torch

import sapiens2

# Versions are read from package metadata, so that recording them never imports a heavy package.
_PACKAGES = {"torch": "torch", "numpy": "numpy", "pillow": "pillow", "safetensors": "safetensors",
             "triton": "triton", "transformers": "transformers"}


def _package_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions() -> dict:
    """sapiens2, python, the packages (None when not installed), CUDA and the device name."""
    v = {"sapiens2": sapiens2.__version__, "python": platform.python_version()}
    v.update({name: _package_version(dist) for name, dist in _PACKAGES.items()})
    v["torch"] = torch.__version__  # the imported build (e.g. "2.13.0+cpu"), not only the distribution's
    v["cuda"] = torch.version.cuda
    v["device_name"] = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor()
    return v


# Dense (no sparsity) peak TFLOP/s per dtype from the vendors' datasheets, and HBM GB/s. Matched by
# substring of torch.cuda.get_device_name(), first match wins (so "H100 PCIe" before "H100").
DEVICE_PEAKS = [
    ("H200", {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9}, 4800.0),
    ("H100 PCIe", {"bf16": 756.0, "fp16": 756.0, "fp32": 51.2}, 2000.0),
    ("H100", {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9}, 3350.0),
    ("A100", {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5}, 2039.0),
    ("L40S", {"bf16": 362.1, "fp16": 362.1, "fp32": 91.6}, 864.0),
    ("RTX 4090", {"bf16": 165.2, "fp16": 165.2, "fp32": 82.6}, 1008.0),
]


def device_peaks(name: str, dtype: str = "bf16") -> tuple[float | None, float | None]:
    """(datasheet dense TFLOP/s for dtype, HBM GB/s) of a device name, or (None, None) when unknown."""
    for key, tflops, gbs in DEVICE_PEAKS:
        if key in name:
            return tflops.get(dtype), gbs
    return None, None
