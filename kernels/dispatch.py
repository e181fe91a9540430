"""The one dispatch rule shared by every kernel: which implementation runs for given tensors.

NOTE: none of the Triton kernels has run on a GPU yet (only in Triton's CPU interpreter and as ahead-of-time
compiles for sm_90a). The default below is built to be safe until one does.

    SAPIENS2_KERNELS=auto    (default) a fixed table, the same on every run and every rank (nothing is timed):
                             CPU tensors, no triton, ROCm, or a GPU outside SUPPORTED_CAPABILITIES: the reference.
                             On a supported NVIDIA GPU, AUTO_TABLE: qk_norm_rope runs Triton, attention runs
                             the reference (torch SDPA) until a GPU measurement shows Triton faster at a shape.
                             Every Triton op goes through a checked first launch (`checked`): its first call
                             per (op, device, dtypes, head dim, inference/training) runs a small case beside the
                             reference; an error, a NaN or a value beyond the dtype's tolerance sends that
                             family to the reference for the rest of the process, with one WARNING. A later
                             call that raises does the same.
    SAPIENS2_KERNELS=fastest attention times Triton against the reference once per case (shapes, strides, dtype,
                             device, inference/training) and runs the faster; under torch.distributed every rank
                             takes rank 0's choice. The choices are cached in the process (and in the JSON file
                             named by SAPIENS2_KERNELS_CACHE, if set). Otherwise as auto.
    SAPIENS2_KERNELS=torch   always the reference.
    SAPIENS2_KERNELS=triton  always Triton (on CPU tensors only together with TRITON_INTERPRET=1); an error if the
                             op has no Triton version, triton does not import, the GPU is not supported, the
                             checked first launch fails, or the Triton version cannot serve the call (it says why).

While torch.compile traces, every op takes the reference (inductor fuses the norm, the RoPE and SDPA itself).
`backend(choice)` sets the choice for the calls inside it (Sapiens2.kernel_backend uses it for one model); the
environment variable is the process's default. A Triton version that cannot serve a call (qk_norm_rope with
RoPE tables that require gradients) says so through `unsupported`; auto then runs the reference and logs it
once. Every Triton call runs with its tensors' CUDA device current (`on_device_of`): Triton launches, autotunes
and allocates on the current device. This module is the only place that decides between the two sides.
"""

import contextlib
import contextvars
import functools
import importlib.util
import json
import logging
import os
import pathlib
import tempfile

import torch

_CHOICES = ("auto", "fastest", "torch", "triton")
log = logging.getLogger("sapiens2.kernels")

# What auto runs on a supported NVIDIA GPU (everywhere else: the reference). Change a row only with a GPU
# measurement behind it (bench/kernels.py), and say so in kernels/README.md.
AUTO_TABLE = {
    "qk_norm_rope": "triton",  # a fused elementwise op: one read and one write of q and k instead of ~10
    "attention": "torch",  # SDPA (flash/cuDNN): Triton attention has not been measured against it on a GPU
}
# Which Triton attention runs under each choice (module of kernels/): the kernel of attention_triton.py, or under
# fastest the Hopper variants of attention_triton_hopper.py, which autotune beside its plain tiles. The variants
# stay opt-in until a GPU measurement shows one wins.
TRITON_ATTENTION_MODULE = {"auto": "attention_triton", "triton": "attention_triton",
                           "fastest": "attention_triton_hopper"}
# (major, minor) compute capabilities the kernels are written and compiled for: Ampere/Ada (mma) and Hopper
# (wgmma; bench/inspect_kernels.py compiles every configuration for sm_90a). Later architectures take the
# reference until the kernels have been checked there.
SUPPORTED_CAPABILITIES = ((8, 0), (8, 6), (8, 7), (8, 9), (9, 0))
REPORT = "please report it with the line above (GPU, torch and triton versions) at the project's issue tracker"

_OVERRIDE: contextvars.ContextVar[str | None] = contextvars.ContextVar("sapiens2_kernels", default=None)


def _checked_choice(choice: str, where: str) -> str:
    choice = choice.strip().lower() or "auto"
    if choice not in _CHOICES:
        raise ValueError(f"{where}={choice!r}: expected one of {', '.join(_CHOICES)}")
    return choice


def requested_backend() -> str:
    """The choice in force: `backend(...)`'s if inside one, else SAPIENS2_KERNELS (default auto)."""
    override = _OVERRIDE.get()
    if override is not None:
        return override
    return _checked_choice(os.environ.get("SAPIENS2_KERNELS", "auto"), "SAPIENS2_KERNELS")


@contextlib.contextmanager
def backend(choice: str | None):
    """Within this context every op dispatches as under SAPIENS2_KERNELS=choice (None: the environment's).
    Per thread and per asyncio task (a context variable), so two models in one process can differ."""
    if choice is None:
        yield
        return
    token = _OVERRIDE.set(_checked_choice(choice, "kernel backend"))
    try:
        yield
    finally:
        _OVERRIDE.reset(token)


# Looked up once at import (find_spec locates the package without importing it). A plain constant rather
# than a cached function: torch.compile traces straight through it, with no warning about the cache.
TRITON_FOUND = importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def on_cuda(tensors) -> bool:
    return all(t.is_cuda for t in tensors)


def launch_device(t: torch.Tensor) -> torch.device:
    """The device whose kernels compute on t (a seam for tests, which pretend that CPU tensors live on cuda:1)."""
    return t.device


def on_device_of(t: torch.Tensor):
    """A context in which t's CUDA device is the current one: Triton launches its kernels, runs its autotuner and
    asks its allocator for scratch on the *current* device, which is cuda:0 unless someone set it (torchrun
    ranks, --device cuda:1)."""
    device = launch_device(t)
    if device.type != "cuda":
        return contextlib.nullcontext()
    return torch.cuda.device(device)


def launched_on_device(launcher):
    """Decorates a launcher whose first argument is a tensor: it runs with that tensor's CUDA device current."""
    @functools.wraps(launcher)
    def wrapper(first, *args, **kwargs):
        with on_device_of(first):
            return launcher(first, *args, **kwargs)
    return wrapper


_PLATFORM: dict[str, str | None] = {}  # device -> why the kernels do not run there (None: they do)


def platform_problem(device: torch.device) -> str | None:
    """Why the Triton kernels must not run on this CUDA device (None: they may): ROCm, or a compute capability
    outside SUPPORTED_CAPABILITIES. Asked once per device."""
    if str(device) not in _PLATFORM:
        if torch.version.hip is not None:
            why = f"ROCm (HIP {torch.version.hip}): the kernels are written and checked for NVIDIA GPUs only"
        else:
            major, minor = torch.cuda.get_device_capability(device)
            supported = ", ".join(f"sm_{a}{b}" for a, b in SUPPORTED_CAPABILITIES)
            why = (None if (major, minor) in SUPPORTED_CAPABILITIES else
                   f"compute capability {major}.{minor}: the kernels are built for {supported}")
        _PLATFORM[str(device)] = why
    return _PLATFORM[str(device)]


def _compiling() -> bool:
    return getattr(torch.compiler, "is_compiling", lambda: False)()


# ----------------------------------------------------------------------------------------------------
# The rule
# ----------------------------------------------------------------------------------------------------


def run(op_name: str, tensors, triton_impl, reference_impl, probe=None, unsupported: str | None = None,
        race=None):
    """Compute `op_name` on the implementation the rule picks, and return its result.

    triton_impl, reference_impl: functions of no arguments computing the op on the call's inputs (triton_impl
        None: the op has no Triton version).
    probe: a function returning (family, run_triton, run_reference, tolerance): the call's family key (op,
        device, dtypes, head dim, inference/training), and both implementations on a small case of that family
        (built only when run), for the checked first launch.
    unsupported: why the Triton version cannot serve this call (None: it can).
    race: under `fastest`, a function returning (case key, run_triton, run_torch); timed once per key."""
    if _compiling() or not use_triton(op_name, triton_impl is not None, *tensors, unsupported=unsupported,
                                      race=race, probe=probe):
        return reference_impl()  # traced by torch.compile: the reference, which inductor compiles and fuses
    choice = requested_backend()
    if choice == "triton":
        with on_device_of(tensors[0]):
            return triton_impl()
    try:
        with on_device_of(tensors[0]):
            return triton_impl()
    except Exception as e:  # noqa: BLE001 - in auto no Triton failure may take the call down
        family = probe()[0] if probe is not None else op_name
        _fail(op_name, family, f"raised {type(e).__name__}: {str(e)[:300]}")
        return reference_impl()


def use_triton(op_name: str, has_triton_version: bool, *tensors: torch.Tensor, unsupported: str | None = None,
               race=None, probe=None) -> bool:
    """True when `op_name` should run its Triton implementation on these tensors (see `run`)."""
    if _compiling():
        return False  # (first: dynamo cannot trace the context variable that requested_backend reads)
    choice = requested_backend()
    if choice == "torch":
        return False
    device = launch_device(tensors[0])
    if choice == "triton":
        _require_triton(op_name, has_triton_version, tensors, unsupported, device)
        if probe is not None:
            with on_device_of(tensors[0]):
                checked(op_name, *probe(), fatal=True)
        return True
    if not (has_triton_version and TRITON_FOUND and on_cuda(tensors)):
        return False
    problem = platform_problem(device) if device.type == "cuda" else None
    if problem:
        _log_once(("platform", str(device)), f"the Triton kernels do not run on {device}, {problem}; running the "
                  "PyTorch reference kernels")
        return False
    if unsupported:
        _log_once(("unsupported", op_name, unsupported),
                  f"{op_name}: the Triton version {unsupported}; running the PyTorch reference")
        return False
    if choice == "auto" and AUTO_TABLE.get(op_name) != "triton":
        return False
    if probe is not None:
        with on_device_of(tensors[0]):
            if not checked(op_name, *probe(), fatal=False):
                return False
    if choice == "fastest" and race is not None:
        with on_device_of(tensors[0]):
            return faster(*race()) == "triton"
    return True


def _require_triton(op_name, has_triton_version, tensors, unsupported, device):
    """SAPIENS2_KERNELS=triton: an error that says why, when Triton cannot run this call."""
    if not has_triton_version:
        raise RuntimeError(f"SAPIENS2_KERNELS=triton, but {op_name} has no Triton implementation yet")
    if not TRITON_FOUND:
        raise RuntimeError(f"SAPIENS2_KERNELS=triton, but triton does not import (needed for {op_name})")
    if not on_cuda(tensors) and not interpreting():
        raise RuntimeError(f"SAPIENS2_KERNELS=triton with CPU tensors ({op_name}) needs TRITON_INTERPRET=1 "
                           "in the environment before triton is first imported")
    problem = platform_problem(device) if device.type == "cuda" else None
    if problem:
        raise RuntimeError(f"SAPIENS2_KERNELS=triton, but the Triton kernels do not run on {device}, {problem}; "
                           "unset SAPIENS2_KERNELS (auto runs the reference there) or set it to torch")
    if unsupported:
        raise RuntimeError(f"SAPIENS2_KERNELS=triton, but {op_name}'s Triton version {unsupported}; unset "
                           "SAPIENS2_KERNELS (auto runs the reference for such calls) or set it to torch")


_LOGGED: set = set()


def _log_once(key, message: str, level: int = logging.INFO):
    if key not in _LOGGED:
        _LOGGED.add(key)
        log.log(level, message)


# ----------------------------------------------------------------------------------------------------
# The checked first launch
# ----------------------------------------------------------------------------------------------------

_CHECKED: dict[str, str | None] = {}  # family key -> None (Triton passed) or what failed


def family_key(op_name: str, device: torch.device, dtypes, head_dim: int, training: bool) -> str:
    """What a kernel's compiled code depends on beyond sizes: op, device, dtypes, head dim, inference/training."""
    names = ",".join(str(d).removeprefix("torch.") for d in dtypes)
    return f"{op_name}|{device}|{names}|D={head_dim}|{'train' if training else 'infer'}"


def tolerance(*dtypes: torch.dtype) -> float:
    """How far a correct kernel may be from the reference, relative to the reference's largest magnitude:
    8 machine epsilons of the coarsest dtype of the computation (fp32 counted as tf32, 2^-10, which fp32 dots
    may use). Differences in rounding and summation order stay within a few epsilons; a broken kernel (a wrong
    tile, a garbled layout, unwritten rows) is off by O(1)."""
    return 8 * max(2.0 ** -10 if d == torch.float32 else torch.finfo(d).eps for d in dtypes)


def checked(op_name: str, family: str, run_triton, run_reference, tol: float, fatal: bool) -> bool:
    """True when the Triton version of this family passed its first-launch check, which runs once per process:
    run_triton() beside run_reference() (each a tuple of tensors) on a small case. A raise, a NaN or inf, or a
    difference above `tol` fails the family for the process (one WARNING); with `fatal`, it is an error."""
    if family not in _CHECKED and _undecidable():
        # Inside CUDA graph capture nothing can be compared (no host sync): unchecked, auto keeps the reference
        # for this call and checks at the first call outside a capture; a forced `triton` runs it unchecked.
        return fatal
    if family not in _CHECKED:
        problem = first_launch_problem(run_triton, run_reference, tol)
        if problem:
            _fail(op_name, family, problem)
        else:
            _CHECKED[family] = None
    problem = _CHECKED[family]
    if problem and fatal:
        raise RuntimeError(f"SAPIENS2_KERNELS=triton: {failure_message(op_name, family, problem)}; unset "
                           "SAPIENS2_KERNELS (auto then runs the reference) or set it to torch")
    return problem is None


def first_launch_problem(run_triton, run_reference, tol: float) -> str | None:
    """What is wrong with run_triton()'s tensors against run_reference()'s (None: nothing)."""
    try:
        got = run_triton()
    except Exception as e:  # noqa: BLE001 - a compile error, an unsupported PTX or arch, a launch failure
        return f"raised {type(e).__name__}: {str(e)[:300]}"
    want = run_reference()
    for i, (g, w) in enumerate(zip(got, want)):
        if g.shape != w.shape:
            return f"output {i} has shape {tuple(g.shape)}, the reference {tuple(w.shape)}"
        g, w = g.detach().double(), w.detach().double()
        if not torch.isfinite(g).all() and torch.isfinite(w).all():
            return f"output {i} has NaN or inf where the reference has none"
        err = ((g - w).abs().max() / w.abs().max().clamp_min(1e-30)).item()
        if not err <= tol:
            return f"output {i} is {err:.2e} from the reference (relative; the dtype allows {tol:.1e})"
    return None


def failure_message(op_name: str, family: str, problem: str) -> str:
    return (f"{op_name}: the Triton kernel failed its first-launch check ({family}): {problem}. "
            f"The PyTorch reference runs instead for the rest of this process; {REPORT}")


def _fail(op_name: str, family: str, problem: str):
    """The family goes to the reference for the rest of the process, said once."""
    _CHECKED[family] = problem
    _log_once(("failed", family), failure_message(op_name, family, problem), logging.WARNING)


def seeded(shape, dtype: torch.dtype, device, seed: int) -> torch.Tensor:
    """Standard-normal values from their own generator (the caller's random stream is left as it was)."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(device=device, dtype=dtype)


def bnhd(B: int, H: int, N: int, D: int, dtype, device, seed: int) -> torch.Tensor:
    """A (B, H, N, D) view of (B, N, H, D) memory, the layout the model's projections hand over."""
    return seeded((B, N, H, D), dtype, device, seed).transpose(1, 2)


def probe_runner(fn, make_inputs, leaves: int, training: bool):
    """A function of no arguments for the checked first launch: fn(*make_inputs()) as a tuple of outputs and,
    when training, the gradients of the first `leaves` inputs for fixed, non-uniform output gradients."""
    def run():
        inputs = make_inputs()
        if not training:
            with torch.no_grad():
                return _as_tuple(fn(*inputs))
        xs = [t.detach().requires_grad_() for t in inputs[:leaves]]
        with torch.enable_grad():
            outs = _as_tuple(fn(*xs, *inputs[leaves:]))
            grads = torch.autograd.grad(outs, xs, [_ramp(o) for o in outs])
        return (*outs, *grads)
    return run


def _as_tuple(x):
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _ramp(t: torch.Tensor) -> torch.Tensor:
    return torch.linspace(-1, 1, t.numel(), device=t.device).reshape(t.shape).to(t.dtype)


def guarded_backward() -> bool:
    """Asked by a Triton op's forward, for its backward: True when a failure there may fall back to the reference
    (every choice but a forced `triton`, under which a failure is an error)."""
    return requested_backend() != "triton"


def reference_gradients(op_name: str, error: Exception, reference, inputs, leaves: int, grad_outputs):
    """A Triton backward that raised, in auto or fastest: the gradients of reference(*inputs) with respect to its
    first `leaves` inputs instead, said once (the forward's values stand: they passed their check)."""
    _log_once(("backward failed", op_name, type(error).__name__),
              f"{op_name}: the Triton backward raised {type(error).__name__}: {str(error)[:300]}. The PyTorch "
              f"reference computes its gradients instead; {REPORT}", logging.WARNING)
    xs = [t.detach().requires_grad_() for t in inputs[:leaves]]
    with torch.enable_grad():
        outs = _as_tuple(reference(*xs, *inputs[leaves:]))
        used = [(o, g) for o, g in zip(outs, grad_outputs) if g is not None]
        return torch.autograd.grad([o for o, _ in used], xs, [g for _, g in used], allow_unused=True)


def first_launch_results() -> dict[str, str | None]:
    """The families checked so far in this process: None (Triton passed) or what failed."""
    return dict(_CHECKED)


# ----------------------------------------------------------------------------------------------------
# fastest: time Triton against the reference once per case
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
    """"triton" or "torch": the faster on this case, timed on first sight and remembered (ties: torch). Under
    torch.distributed every rank takes rank 0's choice (each rank decides each new case once, in the same order:
    the same model on batches of one size).

    When the case cannot be timed (CUDA graph capture) and was never timed before, the reference is used
    and nothing is remembered. `timer` (tests) replaces `time_ms`."""
    if key in _DECIDED:
        return _DECIDED[key]["choice"]
    path = _cache_path()
    disk_key = _versioned(key)
    entry = _read_disk_cache(path).get(disk_key) if path is not None else None
    if isinstance(entry, dict) and entry.get("choice") in ("triton", "torch"):
        log.info("%s: %s (from %s)", key, entry["choice"], path)
    elif _undecidable():
        return "torch"
    else:
        entry = _timed(key, run_triton, run_torch, timer or time_ms)
        if path is not None and "ms" in entry:
            entries = _read_disk_cache(path)
            entries[disk_key] = entry
            _write_disk_cache(path, entries)
    entry = rank0_choice(entry)
    _DECIDED[key] = entry
    return entry["choice"]


def _timed(key: str, run_triton, run_torch, timer) -> dict:
    try:
        triton_ms = timer(run_triton)
    except Exception as e:  # noqa: BLE001 - any failure of the Triton side: the reference instead
        # A Triton configuration that fails on this GPU (compile error, resources, a launch refused) must not
        # take the call down: the reference runs, the error is said once and remembered for the process (not
        # on disk: a fixed Triton or driver should be tried again). A device fault is not recoverable here (the
        # CUDA context is lost); wrong outputs are the checked first launch's to catch.
        entry = {"choice": "torch", "triton_error": f"{type(e).__name__}: {str(e)[:300]}"}
        log.warning("%s: torch (the Triton kernels failed: %s; SAPIENS2_KERNELS=triton shows the full error)",
                    key, entry["triton_error"])
        return entry
    ms = {"triton": triton_ms, "torch": timer(run_torch)}
    choice = "triton" if ms["triton"] < ms["torch"] else "torch"
    log.info("%s: %s (triton %.3f ms, torch %.3f ms)", key, choice, ms["triton"], ms["torch"])
    return {"choice": choice, "ms": ms}


def rank0_choice(entry: dict) -> dict:
    """Rank 0's decision on every rank of an initialized torch.distributed group (DDP, FSDP, torchrun): timings
    differ between GPUs, and ranks that ran different kernels would differ in the last bits."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return entry
    box = [entry]
    dist.broadcast_object_list(box, src=0)
    if box[0]["choice"] != entry["choice"]:
        log.info("rank %d takes rank 0's choice: %s (its own timing said %s)", dist.get_rank(), box[0]["choice"],
                 entry["choice"])
    return box[0]


def decisions() -> dict[str, dict]:
    """What `fastest` chose so far in this process (case key -> choice and timings), e.g. for a benchmark log."""
    return dict(_DECIDED)
