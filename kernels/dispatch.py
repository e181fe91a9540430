"""The one dispatch rule shared by every kernel: which implementation runs for given tensors.

    SAPIENS2_KERNELS=auto   (default) Triton for CUDA tensors when triton imports and the op has a Triton
                            version; the PyTorch reference otherwise.
    SAPIENS2_KERNELS=torch  always the reference.
    SAPIENS2_KERNELS=triton always Triton (on CPU tensors only together with TRITON_INTERPRET=1); an error
                            if the op has no Triton version or triton does not import.
"""

import importlib.util
import os

import torch

_CHOICES = ("auto", "torch", "triton")


def requested_backend() -> str:
    choice = os.environ.get("SAPIENS2_KERNELS", "auto").strip().lower() or "auto"
    if choice not in _CHOICES:
        raise ValueError(f"SAPIENS2_KERNELS={choice!r}: expected one of {', '.join(_CHOICES)}")
    return choice


# Looked up once at import (find_spec locates the package without importing it). A plain constant rather
# than a cached function: torch.compile traces straight through it, with no warning about the cache.
TRITON_FOUND = importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def use_triton(op_name: str, has_triton_version: bool, *tensors: torch.Tensor) -> bool:
    """True when `op_name` should run its Triton implementation on these tensors."""
    choice = requested_backend()
    if choice == "torch":
        return False
    if choice == "triton":
        if not has_triton_version:
            raise RuntimeError(f"SAPIENS2_KERNELS=triton, but {op_name} has no Triton implementation yet")
        if not TRITON_FOUND:
            raise RuntimeError(f"SAPIENS2_KERNELS=triton, but triton does not import (needed for {op_name})")
        if not all(t.is_cuda for t in tensors) and not interpreting():
            raise RuntimeError(f"SAPIENS2_KERNELS=triton with CPU tensors ({op_name}) needs TRITON_INTERPRET=1 "
                               "in the environment before triton is first imported")
        return True
    return has_triton_version and TRITON_FOUND and all(t.is_cuda for t in tensors)
