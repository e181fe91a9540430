"""The one dispatch rule shared by every kernel: which implementation runs for given tensors.

    SAPIENS2_KERNELS=auto   (default) the PyTorch reference on CPU or when triton is missing. On CUDA:
                            qk_norm_rope runs Triton; attention runs whichever of Triton and the reference
                            (torch SDPA, its fastest backend) was faster when timed once on this
                            (op, shapes, strides, dtype, device, inference/training) case - never slower
                            than SDPA. The choice is cached in the process (and in the JSON file named by
                            SAPIENS2_KERNELS_CACHE, if set) and logged once (logger "sapiens2.kernels").
                            Under torch.compile tracing attention takes the reference (inductor compiles it).
    SAPIENS2_KERNELS=torch  always the reference.
    SAPIENS2_KERNELS=triton always Triton (on CPU tensors only together with TRITON_INTERPRET=1); an error
                            if the op has no Triton version, triton does not import, or the Triton version
                            cannot serve the call (it says why).

A Triton version that cannot serve a call (qk_norm_rope with RoPE tables that require gradients: the kernel
gives the tables none) says so through `unsupported`; auto then runs the reference and logs it once. This
module is the only place that decides between the two sides.
"""

import importlib.util
import json
import logging
import os
import pathlib
import tempfile

import torch

_CHOICES = ("auto", "torch", "triton")
log = logging.getLogger("sapiens2.kernels")


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


def on_cuda(tensors) -> bool:
    return all(t.is_cuda for t in tensors)


def use_triton(op_name: str, has_triton_version: bool, *tensors: torch.Tensor, unsupported: str | None = None,
               race=None) -> bool:
    """True when `op_name` should run its Triton implementation on these tensors.

    unsupported: why the Triton version cannot serve this call (None: it can).
    race: for an op whose Triton version may lose to PyTorch's own, a function returning
          (key, run_triton, run_torch); auto times the two once per key (see `faster`)."""
    choice = requested_backend()
    if choice == "torch":
        return False
    if choice == "triton":
        if not has_triton_version:
            raise RuntimeError(f"SAPIENS2_KERNELS=triton, but {op_name} has no Triton implementation yet")
        if not TRITON_FOUND:
            raise RuntimeError(f"SAPIENS2_KERNELS=triton, but triton does not import (needed for {op_name})")
        if not on_cuda(tensors) and not interpreting():
            raise RuntimeError(f"SAPIENS2_KERNELS=triton with CPU tensors ({op_name}) needs TRITON_INTERPRET=1 "
                               "in the environment before triton is first imported")
        if unsupported:
            raise RuntimeError(f"SAPIENS2_KERNELS=triton, but {op_name}'s Triton version {unsupported}; unset "
                               "SAPIENS2_KERNELS (auto runs the reference for such calls) or set it to torch")
        return True
    if not (has_triton_version and TRITON_FOUND and on_cuda(tensors)):
        return False
    if unsupported:
        _log_once(("unsupported", op_name, unsupported),
                  f"{op_name}: the Triton version {unsupported}; running the PyTorch reference")
        return False
    if race is None:
        return True
    if getattr(torch.compiler, "is_compiling", lambda: False)():
        return False  # traced by torch.compile: the reference, which inductor compiles natively
    return faster(*race()) == "triton"


_LOGGED: set = set()


def _log_once(key, message: str):
    if key not in _LOGGED:
        _LOGGED.add(key)
        log.info(message)


# ----------------------------------------------------------------------------------------------------
# auto: time Triton against the reference once per case
# ----------------------------------------------------------------------------------------------------

_DECIDED: dict[str, dict] = {}  # case key -> {"choice": "triton"|"torch", "ms": {...}}


def case_key(op_name: str, *tensors: torch.Tensor) -> str:
    """What the speed of a call depends on: op, shapes, strides, dtype, device, and whether it trains."""
    first = tensors[0]
    device = _device_name(first.device)
    training = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    shapes = ";".join(f"{tuple(t.shape)}@{t.stride()}" for t in tensors)
    return f"{op_name}|{shapes}|{first.dtype}|{device}|{'train' if training else 'infer'}"


_DEVICE_NAMES: dict[str, str] = {}


def _device_name(device: torch.device) -> str:
    if str(device) not in _DEVICE_NAMES:
        _DEVICE_NAMES[str(device)] = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
    return _DEVICE_NAMES[str(device)]


def time_ms(fn) -> float:
    """Median milliseconds of fn() on the GPU (CUDA events, after a warm-up that includes autotuning)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=5, rep=25, return_mode="median"))


def _cache_path() -> pathlib.Path | None:
    path = os.environ.get("SAPIENS2_KERNELS_CACHE", "").strip()
    return pathlib.Path(path) if path else None


def _versioned(key: str) -> str:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return f"{key}|torch {torch.__version__}|triton {triton_version}"


def _read_disk_cache(path: pathlib.Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        log.warning("SAPIENS2_KERNELS_CACHE=%s is unreadable (%s); timing again", path, e)
        return {}


def _write_disk_cache(path: pathlib.Path, entries: dict):
    """Atomic replace, so that concurrent processes never read half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(entries, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def _undecidable() -> bool:
    """Inside CUDA graph capture nothing can be timed."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def faster(key: str, run_triton, run_torch, timer=None) -> str:
    """"triton" or "torch": the faster on this case, timed on first sight and remembered (ties: torch).

    When the case cannot be timed (CUDA graph capture) and was never timed before, the reference is used
    and nothing is remembered. `timer` (tests) replaces `time_ms`."""
    if key in _DECIDED:
        return _DECIDED[key]["choice"]
    path = _cache_path()
    disk_key = _versioned(key)
    if path is not None:
        entry = _read_disk_cache(path).get(disk_key)
        if isinstance(entry, dict) and entry.get("choice") in ("triton", "torch"):
            _DECIDED[key] = entry
            log.info("%s: %s (from %s)", key, entry["choice"], path)
            return entry["choice"]
    if _undecidable():
        return "torch"
    timer = timer or time_ms
    try:
        triton_ms = timer(run_triton)
    except Exception as e:  # noqa: BLE001 - any failure of the Triton side: auto runs the reference instead
        # A Triton configuration that fails on this GPU (compile error, resources, a launch refused) must not
        # take the default path down: auto falls back to the reference, says why once, and remembers it for the
        # process (not on disk: a fixed Triton or driver should be tried again). A device fault is not
        # recoverable here (the CUDA context is lost), and wrong outputs are not detected: times are compared.
        _DECIDED[key] = {"choice": "torch", "triton_error": f"{type(e).__name__}: {str(e)[:300]}"}
        log.warning("%s: torch (the Triton kernels failed: %s; SAPIENS2_KERNELS=triton shows the full error)",
                    key, _DECIDED[key]["triton_error"])
        return "torch"
    ms = {"triton": triton_ms, "torch": timer(run_torch)}
    choice = "triton" if ms["triton"] < ms["torch"] else "torch"
    _DECIDED[key] = {"choice": choice, "ms": ms}
    log.info("%s: %s (triton %.3f ms, torch %.3f ms)", key, choice, ms["triton"], ms["torch"])
    if path is not None:
        entries = _read_disk_cache(path)
        entries[disk_key] = _DECIDED[key]
        _write_disk_cache(path, entries)
    return choice


def decisions() -> dict[str, dict]:
    """What auto chose so far in this process (case key -> choice and timings), e.g. for a benchmark log."""
    return dict(_DECIDED)
