"""End-to-end speed and memory: ours against HF transformers and torch.compile, backbone and task models.

    python bench/e2e.py                                  # the default suite of this machine (cuda or cpu)
    python bench/e2e.py --suite cpu                      # the CPU table: small image, small batch, fp32
    python bench/e2e.py --suite gpu                      # the GPU table: 1024x768, batch 1 and 8, bf16
    python bench/e2e.py --presets 0.4b --models backbone,seg --batches 8 --dtype bf16 \
                        --impls ours-triton,hf,hf-compile --out bench/results/x.json --append
    python bench/e2e.py --report bench/results/e2e-....json    # re-render the .md table and .png plot

Implementations (rows), each timed in a fresh subprocess on the same random weights and the same input:
    hf            transformers' Sapiens2* (attn_implementation="sdpa")
    hf-eager      transformers with its eager (materialized softmax) attention; not in the default sets
    hf-compile    torch.compile(hf)
    ours          this repo, eager, PyTorch reference kernels (SAPIENS2_KERNELS=torch)
    ours-triton   this repo, eager, Triton kernels (SAPIENS2_KERNELS=triton); CUDA only
    ours-compile  torch.compile(ours) over the reference kernels
    ours-graph    ours-triton replayed as one CUDA graph (--cuda-graphs adds it for batch 1); CUDA only
    ours-cl, ours-triton-cl
                  ours / ours-triton with the task head in channels-last (model.channels_last_head()):
                  NHWC convs, heads.InstanceNorm normalizing in place; task models only

Weights: for each (preset, model, dtype, image size) the parent builds one random model of ours (seeded;
LayerScale and norm weights randomized too, so that the attention branch matters to the output instead
of being scaled by 1e-4) and writes it with weights.save(format="hf"); every child loads that directory,
ours through weights.load, HF through Sapiens2*.from_pretrained. Ours runs with rope_dtype="float32", the
convention HF implements (bit-identical to HF in fp32), so the outputs are comparable.

Correctness: every child saves a deterministic subsample of its outputs; the parent compares each row with
the reference row of its group (hf when it ran, else ours): rel err = max|x - ref| / max|ref|, bound 1e-3 in
fp32. In bf16/fp16 the bound comes from the measured rounding noise: the reference child also runs its model
once in fp32 (the same bf16-valued weights and input upcast, so only the arithmetic differs) and records
noise_vs_fp32 = max|ref_bf16 - ref_fp32| / max|ref_fp32|; the bound is NOISE_MULTIPLE (3) times that (why 3:
at NOISE_MULTIPLE). A row over the bound is marked MISMATCH and the script exits with status 1.

Timing: warm-up calls (at least 3 for compiled rows: the RoPE table cache fills on the first call and
causes one recompile), then --reps timed calls; median, min, max and the inter-quartile range are
reported. CUDA: torch.cuda.Event around each call. CPU: time.perf_counter. Under torch.inference_mode.
--rounds R (the CPU suite: 2) runs each group's processes R times interleaved (hf, ours, ..., hf, ours, ...)
and pools the timed calls, so that a slow minute of a shared machine does not land on one row only; each
round's median is kept in the JSON (round_medians_ms).

Memory (peak_mb: what one forward call adds on top of the loaded model and its input):
    cuda  torch.cuda.max_memory_allocated() during one call minus memory_allocated() before it
    cpu   the peak of the bytes that one call's own allocations hold at once in PyTorch's CPU allocator:
          the allocation timeline of torch.profiler (profile_memory=True; every tensor allocation and free,
          the temporaries inside ops included), summed in time order. Deterministic, and the CPU twin of
          max_memory_allocated. It does not see memory that libraries allocate outside PyTorch's allocator
          (oneDNN's own scratch), so the process's RSS is recorded beside it: rss_peak_mb = peak RSS during
          one call (VmHWM, reset through /proc/self/clear_refs) minus RSS before (after gc and malloc_trim).
          RSS moves by tens of MB from call to call with the heap's state: use it as a cross-check only.
          The methods used are written into the JSON.

FLOPs and bytes: counted on the meta device by hooks on every nn.Linear, nn.Conv2d and nn.ConvTranspose2d
of our (unfused) model (2 * MACs) plus 4 * N^2 * D per query head in each attention; bytes are each such
op's input + output + weight read/written once (an unfused lower bound on traffic, attention as q, k, v, o).
Achieved TFLOP/s = FLOPs / median time, and on a known GPU the fraction of its dense peak for the dtype
(runtime_info.DEVICE_PEAKS; fp32 rows use the non-tensor-core fp32 peak, since TF32 is left off). On CPU: GFLOP/s only.

Results: bench/results/e2e-<device>-<date>.json (+ .md table, + .png plot drawn with pillow; --no-render: the
JSON only, the rest later with --report). The JSON is rewritten (atomically) as each job finishes, so a run
that is stopped keeps every row it measured. With --append and the same --work-dir, a later run compares its
rows with the reference rows an earlier run measured (their outputs stay in the work dir): bench/gpu_session.sh
runs the slow cold torch.compile job alone, last.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import datetime
import gc
import json
import math
import os
import pathlib
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from safetensors.torch import load_file, save_file

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sapiens2 import heads  # noqa: E402
from sapiens2_app.runtime_info import device_peaks, versions  # noqa: E402
from sapiens2_app import safe_io  # noqa: E402
import sapiens2  # noqa: E402
from sapiens2 import weights  # noqa: E402

IMPLS = ("hf", "hf-eager", "hf-compile", "ours", "ours-cl", "ours-triton", "ours-triton-cl", "ours-compile", "ours-graph")
# heads.TASKS is the one list of tasks; sorted (stably) only to keep the row order the tables have always had:
# backbone, pose, then heads.TASKS's order with matting last.
MODELS = ("backbone", *sorted(heads.TASKS, key=lambda task: (task != "pose", task == "matting")))
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TOLERANCE = {"fp32": 1e-3}
# bf16/fp16: the bound is NOISE_MULTIPLE x the reference's own rounding noise (noise_vs_fp32, measured by its child).
# Why 3: with f the fp32 result, the triangle inequality gives |x - ref| <= |x - f| + |ref - f|, so a row as
# accurate as the reference is within 2x its noise, and 3x passes a row up to twice as noisy (other reduction
# orders, fused kernels). Measured on CPU (256x192, batch 1, bf16; hf's noise 1.6e-2 tiny, 2.9e-2 0.1b, 4.1e-2
# 0.4b): ours vs hf = 0.8, 1.2, 1.7 x hf's noise (ours' own noise 1.0, 0.9, 1.3 x hf's), while --perturb (the last
# block's w3 x 1.5, a mild error) gives 4.8 (tiny) and 3.7 (0.1b) x. A fixed 5e-2 did not work: the depth decides
# the noise (ours vs hf at 0.4b: 5.17e-2 in issue 24, 7.2e-2 here), and it is loose for a shallow model. Without a
# measured noise (the fp32 forward failed) a row is held to REDUCED_PRECISION_FALLBACK and says so.
NOISE_MULTIPLE = 3.0
REDUCED_PRECISION_FALLBACK = 1e-1
REFERENCE_IMPLS = ("hf", "ours", "hf-eager")  # compare_group's choice, in this order
SEED = 0

# A tiny architecture for the smoke test (not a released size): 10 blocks so that GQA blocks exist.
TINY = sapiens2.Sapiens2Config(64, 10, 4, full_attention_first=3, full_attention_last=3)
TINY_HEADS = {
    "pose": heads.HeadConfig("pose", (32, 16), (16,), 308),
    "seg": heads.HeadConfig("seg", (16, 16), (8,), 29),
    "normal": heads.HeadConfig("normal", (16, 8), (8,), 3),
    "pointmap": heads.HeadConfig("pointmap", (16, 8), (8,), 3, scale_conv_channels=(16, 8), scale_hidden=(8,)),
    "albedo": heads.HeadConfig("albedo", (16, 8), (8,), 3),
    "matting": heads.HeadConfig("matting", (16, 8), (8,), 4),
}

# The suites: what `--suite` runs when no explicit --presets/--models/... narrow it. Each entry is
# (presets, models, batches, impls); image size, dtype, reps per suite. Ordered most important first.
SUITES = {
    "gpu": dict(size=(1024, 768), dtype="bf16", warmup=5, reps=20, runs=[
        (("0.4b",), ("backbone",), (8, 1), ("ours-triton", "hf", "hf-compile", "ours-compile", "ours")),
        (("0.4b",), ("seg", "pose", "normal", "pointmap", "albedo"), (8, 1), ("ours-triton", "ours-triton-cl", "hf", "hf-compile", "ours-compile")),
        (("0.1b", "1b"), ("backbone",), (8, 1), ("ours-triton", "hf", "hf-compile", "ours-compile")),
        (("1b",), ("seg", "normal", "pointmap", "matting"), (8,), ("ours-triton", "hf", "hf-compile")),
        (("5b",), ("backbone",), (8, 1), ("ours-triton", "hf", "hf-compile")),
    ]),
    # 2-core CPU: a few minutes in all. 256x192 keeps 201 tokens per image (CLS + 8 registers + 16x12).
    "cpu": dict(size=(256, 192), dtype="fp32", warmup=1, reps=5, rounds=2, runs=[
        (("0.1b", "0.4b"), ("backbone",), (1,), ("hf", "hf-compile", "ours", "ours-triton", "ours-compile")),
        (("0.4b",), ("backbone",), (4,), ("hf", "ours")),
        (("0.4b",), ("seg", "pose", "normal", "pointmap", "albedo"), (1,), ("hf", "ours", "ours-cl")),
        (("1b",), ("backbone",), (1,), ("hf", "ours")),
        (("1b",), ("matting",), (1,), ("hf", "ours", "ours-cl")),
    ]),
    # The smoke test: tiny architecture, tiny image, seconds.
    "smoke": dict(size=(64, 48), dtype="fp32", warmup=1, reps=3, runs=[
        (("tiny",), ("backbone", "seg"), (2,), ("hf", "ours", "ours-triton")),
    ]),
}


# ----------------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------------


def build_ours(preset: str, model: str, size: tuple[int, int]) -> torch.nn.Module:
    """A randomly initialized model of ours (fp32, CPU) for (preset, model) at image size `size`."""
    overrides = dict(image_size=tuple(size), rope_dtype="float32")
    config = dataclasses.replace(TINY, **overrides) if preset == "tiny" else sapiens2.Sapiens2Config.from_preset(preset, **overrides)
    if model == "backbone":
        return sapiens2.Sapiens2(config)
    head = TINY_HEADS[model] if preset == "tiny" else heads.head_preset(model, preset)
    return heads.build_task_model(config, head)


@torch.no_grad()
def randomize(model: torch.nn.Module):
    """Make every parameter matter: LayerScale ~ U(0.5, 1) (init 1e-4 would hide the attention branch),
    norm weights 1 + 0.1 N(0, 1). Linear/conv weights keep their init."""
    g = torch.Generator().manual_seed(SEED + 1)
    for name, p in model.named_parameters():
        if name.endswith("gamma.weight"):
            p.copy_(torch.rand(p.shape, generator=g) * 0.5 + 0.5)
        elif p.dim() == 1 and ("ln" in name or "norm" in name):
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))


def prepare_weights(preset, model, size, dtype, directory: pathlib.Path) -> pathlib.Path:
    """Write one random model in HF format (loads in both ours and transformers). Returns the directory."""
    if (directory / "model.safetensors").exists():
        return directory
    torch.manual_seed(SEED)
    m = build_ours(preset, model, size)
    randomize(m)
    m.to(DTYPES[dtype])
    # HF cannot represent the albedo head (its ChannelRMSNorm has no HF name): ours only, original names.
    weights.save(m, directory, format="original" if model == "albedo" else "hf")
    del m
    gc.collect()
    return directory


def hf_class_name(model: str) -> str | None:
    if model == "backbone":
        return "Sapiens2Model"
    return weights.HF_TASK_CLASS_OF.get(model)


def outputs_of(model_name: str, impl: str, out) -> list[torch.Tensor]:
    """The tensors to compare, in the same order for ours and HF."""
    if impl.startswith("hf"):
        return {"backbone": lambda: [out.last_hidden_state], "pose": lambda: [out.heatmaps],
                "seg": lambda: [out.logits], "normal": lambda: [out.normals],
                "pointmap": lambda: [out.pointmaps, out.scales], "matting": lambda: [out.alphas, out.foregrounds],
                }[model_name]()
    return {"backbone": lambda: [out.tokens], "pose": lambda: [out.heatmaps], "seg": lambda: [out.logits],
            "normal": lambda: [out.normals], "pointmap": lambda: [out.pointmaps, out.scales],
            "albedo": lambda: [out.albedo], "matting": lambda: [out.alphas, out.foregrounds]}[model_name]()


def subsample(t: torch.Tensor, max_elements: int = 1 << 20) -> torch.Tensor:
    """The first batch item (items are independent), strided down to at most max_elements, as fp32 CPU."""
    flat = t[:1].reshape(-1)
    step = max(1, math.ceil(flat.numel() / max_elements))
    return flat[::step].float().cpu().clone()


# ----------------------------------------------------------------------------------------------------
# FLOP and byte counts (on the meta device, from our unfused model)
# ----------------------------------------------------------------------------------------------------


def count_flops(preset: str, model: str, batch: int, size: tuple[int, int], dtype: str) -> dict:
    elt = torch.finfo(DTYPES[dtype]).bits // 8
    totals = {"linear": 0, "conv": 0, "attention": 0, "bytes": 0}

    def linear_hook(mod, inputs, output):
        x = inputs[0]
        totals["linear"] += 2 * x.numel() // mod.in_features * mod.in_features * mod.out_features
        totals["bytes"] += (x.numel() + output.numel() + mod.weight.numel()) * elt

    def conv_hook(mod, inputs, output):
        x = inputs[0]
        k = math.prod(mod.kernel_size)
        if isinstance(mod, torch.nn.ConvTranspose2d):  # every input pixel scatters a k x k x Cout patch
            macs = x.numel() * (mod.out_channels // mod.groups) * k
        else:  # every output pixel gathers a k x k x Cin/groups patch
            macs = output.numel() * (mod.in_channels // mod.groups) * k
        totals["conv"] += 2 * macs
        totals["bytes"] += (x.numel() + output.numel() + mod.weight.numel()) * elt

    def attention_hook(mod, inputs, output):
        B, N, _ = inputs[0].shape
        D = mod.head_dim
        totals["attention"] += 4 * B * mod.num_heads * N * N * D  # q k^T and p v, 2 FLOPs per MAC
        totals["bytes"] += B * N * D * (2 * mod.num_heads + 2 * mod.num_kv_heads) * elt

    with torch.device("meta"):
        m = build_ours(preset, model, size)
        for mod in m.modules():
            if isinstance(mod, torch.nn.Linear):
                mod.register_forward_hook(linear_hook)
            elif isinstance(mod, (torch.nn.Conv2d, torch.nn.ConvTranspose2d)):
                mod.register_forward_hook(conv_hook)
            elif isinstance(mod, sapiens2.Attention):
                mod.register_forward_hook(attention_hook)
        with torch.no_grad():
            m(torch.empty(batch, 3, *size))
    params = sum(p.numel() for p in m.parameters())
    flops = totals["linear"] + totals["conv"] + totals["attention"]
    return dict(flops=flops, flops_linear=totals["linear"], flops_conv=totals["conv"],
                flops_attention=totals["attention"], bytes=totals["bytes"], params=params)


# ----------------------------------------------------------------------------------------------------
# Memory (CPU)
# ----------------------------------------------------------------------------------------------------


def _proc_status_kb(field: str) -> int | None:
    try:
        for line in pathlib.Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def _release_free_memory():
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # glibc: give freed heap pages back, so RSS = live memory


class CpuRssPeak:
    """Peak RSS added by the code run inside the `with` block (a cross-check; see the module docstring)."""

    def __enter__(self):
        _release_free_memory()
        self.before_kb = _proc_status_kb("VmRSS")
        try:
            pathlib.Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
            self.method = "VmHWM (reset via /proc/self/clear_refs) - VmRSS before, after malloc_trim"
        except OSError:
            self.method = "ru_maxrss (process lifetime peak, an upper bound) - VmRSS before"
        return self

    def __exit__(self, *exc):
        if self.method.startswith("VmHWM"):
            peak_kb = _proc_status_kb("VmHWM")
        else:
            import resource

            peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        self.peak_mb = None if peak_kb is None or self.before_kb is None else (peak_kb - self.before_kb) / 1024
        return False


def cpu_allocation_peak_mb(fn) -> float:
    """Run fn once; return the peak of the bytes that fn's own allocations held at once, in MiB. The profiler
    records every allocation and free made while it runs (positive and negative nbytes) but not the free of a
    block allocated before it started, so this is an upper bound on the net growth; a forward call frees
    nothing that existed before it, and there the two agree."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    cpu = torch._C._autograd.DeviceType.CPU
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]" and e.device_type() == cpu]
    held = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        held += e.nbytes()
        peak = max(peak, held)
    return peak / 2**20


# ----------------------------------------------------------------------------------------------------
# The child: one implementation, one config, in its own process
# ----------------------------------------------------------------------------------------------------


def uses_triton(impl: str) -> bool:
    return impl.startswith("ours-triton") or impl == "ours-graph"


def skip_reason(spec: dict) -> str | None:
    impl, device = spec["impl"], spec["device"]
    if impl.endswith("-cl") and spec["model"] == "backbone":
        return "channels-last applies to the task heads (the backbone has no convs after the patch embedding)"
    if uses_triton(impl) and device != "cuda":
        return "Triton kernels run on CUDA only (CPU runs the PyTorch references, the 'ours' row)"
    if impl == "ours-graph" and spec["batch"] != 1:
        return "CUDA graphs are benchmarked at batch 1 only"
    if impl.startswith("hf") and hf_class_name(spec["model"]) is None:
        return f"transformers has no {spec['model']} model"
    if uses_triton(impl):
        import importlib.util

        if importlib.util.find_spec("triton") is None:
            return "triton is not installed"
    if impl.startswith("hf"):
        try:
            import transformers
        except ImportError:
            return "transformers is not installed"
        if not hasattr(transformers, "Sapiens2Model"):
            return f"transformers {transformers.__version__} has no Sapiens2 (needs 5.23.0)"
    return None


def load_impl(spec: dict):
    """The module to call, already on the device and in eval mode, and how long loading took."""
    impl, device, dtype = spec["impl"], spec["device"], DTYPES[spec["dtype"]]
    if impl.startswith("hf"):
        import transformers

        cls = getattr(transformers, hf_class_name(spec["model"]))
        attn = "eager" if impl == "hf-eager" else "sdpa"
        model = cls.from_pretrained(spec["weights"], dtype=dtype, attn_implementation=attn).to(device).eval()
    else:
        model = weights.load(spec["weights"], dtype=dtype, device=device, rope_dtype="float32")
        if impl.endswith("-cl"):
            model.channels_last_head()
        if spec.get("perturb"):  # the smoke test's deliberately wrong model: must be caught as MISMATCH
            backbone = model.backbone if hasattr(model, "backbone") else model
            with torch.no_grad():
                backbone.blocks[-1].ffn.w3.weight.mul_(1.5)
    return model


def time_calls(fn, device: str, warmup: int, reps: int) -> list[float]:
    for _ in range(warmup):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return [start.elapsed_time(end) for start, end in events]
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return times


def run_child(spec: dict) -> dict:
    os.environ["SAPIENS2_KERNELS"] = "triton" if uses_triton(spec["impl"]) else "torch"
    device = spec["device"]
    result = {"status": "ok"}
    t0 = time.perf_counter()
    model = load_impl(spec)
    result["load_s"] = time.perf_counter() - t0
    g = torch.Generator().manual_seed(SEED)
    H, W = spec["size"]
    x = torch.randn(spec["batch"], 3, H, W, generator=g).to(device=device, dtype=DTYPES[spec["dtype"]])
    name, impl = spec["model"], spec["impl"]

    call = model
    warmup = spec["warmup"]
    if impl.endswith("-compile"):
        call = torch.compile(model)
        warmup = max(warmup, 3)

    def forward():
        return outputs_of(name, impl, call(x))

    with torch.inference_mode():
        t0 = time.perf_counter()
        first = forward()  # compilation happens here for compiled rows
        if device == "cuda":
            torch.cuda.synchronize()
        result["first_call_s"] = time.perf_counter() - t0
        if impl == "ours-graph":
            for _ in range(2):  # warm up (Triton autotuning, RoPE cache) outside the capture
                forward()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_out = forward()
            graph.replay()
            first = static_out

            def forward():  # noqa: F811  replays the captured kernels on the same input buffer
                graph.replay()
                return static_out

        saved = [subsample(t) for t in first]
        del first
        times = time_calls(forward, device, warmup, spec["reps"])

        # Peak memory of one call, measured after timing (so that compilation is not counted).
        if device == "cuda":
            torch.cuda.synchronize()
            gc.collect()
            torch.cuda.empty_cache()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            out = forward()
            torch.cuda.synchronize()
            result["peak_mb"] = (torch.cuda.max_memory_allocated() - before) / 2**20
            result["total_peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
            result["memory_method"] = "cuda: max_memory_allocated during one call - memory_allocated before"
            del out
        else:
            result["peak_mb"] = cpu_allocation_peak_mb(forward)  # allocator events: no gc/trim needed first
            result["memory_method"] = "cpu: torch.profiler allocation timeline, peak held by one call's allocations"
            with CpuRssPeak() as rss:
                forward()
            result["rss_peak_mb"], result["rss_method"] = rss.peak_mb, rss.method

        if spec["dtype"] != "fp32" and impl in REFERENCE_IMPLS:
            result["noise_vs_fp32"] = fp32_noise(model, x, name, impl, saved)

    save_file({str(i): t.contiguous() for i, t in enumerate(saved)}, spec["outputs"])  # safetensors: nothing unpickled
    result.update(summarize_times(times, spec["batch"]), warmup=warmup, reps=spec["reps"])
    return result


def relative_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """max over the outputs of max|got - want| / max|want| (fp64)."""
    return max(((g.double() - e.double()).abs().max() / e.double().abs().max().clamp(min=1e-30)).item()
               for g, e in zip(got, want, strict=True))


def fp32_noise(model, x, name: str, impl: str, saved: list[torch.Tensor]) -> float | None:
    """The reference's own rounding noise: its reduced-precision outputs (`saved`) against the same model run in
    fp32 (weights and input upcast exactly, TF32 off), or None when the fp32 forward does not fit or fails."""
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        full = [subsample(t) for t in outputs_of(name, impl, model.float()(x.float()))]
        return relative_error(saved, full)
    except RuntimeError as e:  # out of memory, mostly: the row then says its bound was not measured
        print(f"fp32 noise run failed: {str(e).splitlines()[0][:200]}", file=sys.stderr)
        return None
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32


def summarize_times(times: list[float], batch: int) -> dict:
    """Median, spread and throughput of the timed calls (milliseconds)."""
    q1, _, q3 = statistics.quantiles(times, n=4, method="inclusive") if len(times) >= 2 else (times[0],) * 3
    median = statistics.median(times)
    return dict(times_ms=times, median_ms=median, min_ms=min(times), max_ms=max(times), iqr_ms=q3 - q1,
                images_per_s=batch / (median / 1e3))


# ----------------------------------------------------------------------------------------------------
# The parent: plan, run children, compare, report
# ----------------------------------------------------------------------------------------------------


def device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    model = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return f"{model} ({torch.get_num_threads()} threads)"


def device_slug(device: str) -> str:
    if device == "cuda":
        return re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name().lower().replace("nvidia", "")).strip("-")
    return f"cpu{torch.get_num_threads()}t"


def job_key(job: dict) -> str:
    return f"{job['preset']}|{job['model']}|b{job['batch']}|{job['dtype']}|{job['size'][0]}x{job['size'][1]}|{job['impl']}"


def group_key(job: dict) -> str:
    return job_key(job).rsplit("|", 1)[0]


def plan(args) -> list[dict]:
    suite = SUITES[args.suite]
    size = tuple(args.size) if args.size else suite["size"]
    dtype = args.dtype or suite["dtype"]
    runs = suite["runs"]
    if any(v is not None for v in (args.presets, args.models, args.batches, args.impls)):
        # An explicit selection: the cross product, in the order given.
        runs = [(args.presets or ("0.4b",), args.models or ("backbone",), args.batches or (1,),
                 args.impls or ("hf", "hf-compile", "ours", "ours-triton", "ours-compile"))]
    jobs = []
    for presets, models, batches, impls in runs:
        for preset in presets:
            for model in models:
                if model != "backbone" and preset != "tiny" and preset not in heads.HEAD_TABLE[model]:
                    continue  # e.g. no 0.1b heads, matting only at 1b
                for batch in batches:
                    row_impls = list(impls)
                    if args.cuda_graphs and batch == 1 and "ours-graph" not in row_impls:
                        row_impls.append("ours-graph")
                    for impl in row_impls:
                        jobs.append(dict(preset=preset, model=model, batch=batch, size=size, dtype=dtype, impl=impl,
                                         device=args.device, warmup=args.warmup or suite["warmup"],
                                         reps=args.reps or suite["reps"],
                                         perturb=args.perturb and impl.startswith("ours")))
    return jobs


def outputs_file(work: pathlib.Path, job: dict) -> pathlib.Path:
    """Where a job's child saves its outputs: kept in the work dir, so that a later --append run can compare."""
    return work / f"{re.sub(r'[^A-Za-z0-9]+', '_', job_key(job))}.out.safetensors"


def run_job(job: dict, work: pathlib.Path, timeout: float) -> dict:
    spec = dict(job)
    reason = skip_reason(spec)
    if reason:
        return {"status": "skipped", "reason": reason}
    key = re.sub(r"[^A-Za-z0-9]+", "_", job_key(job))
    wdir = work / re.sub(r"[^A-Za-z0-9]+", "_", f"{job['preset']}_{job['model']}_{job['dtype']}_{job['size'][0]}x{job['size'][1]}")
    t0 = time.perf_counter()
    prepare_weights(job["preset"], job["model"], job["size"], job["dtype"], wdir)
    spec.update(weights=str(wdir), outputs=str(outputs_file(work, job)), result=str(work / f"{key}.json"))
    env = dict(os.environ)
    if job["device"] == "cpu":  # inductor's compile-worker pool would fight the timed process for the cores
        env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    env.setdefault("TRANSFORMERS_VERBOSITY", "error")
    env.setdefault("HF_HUB_OFFLINE", "1")
    cmd = [sys.executable, str(pathlib.Path(__file__).resolve()), "--child", json.dumps(spec)]
    try:
        proc = subprocess.run(cmd, env=env, cwd=str(ROOT), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "reason": f"over {timeout:.0f} s"}
    wall = time.perf_counter() - t0
    if proc.returncode != 0 or not pathlib.Path(spec["result"]).exists():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-6:]
        oom = any("out of memory" in line.lower() for line in tail) or proc.returncode in (-9, 137)
        return {"status": "oom" if oom else "error", "reason": " | ".join(tail)[-600:], "wall_s": wall}
    result = json.loads(pathlib.Path(spec["result"]).read_text())
    result["wall_s"] = wall
    result["outputs_path"] = spec["outputs"]
    return result


def split_groups(jobs: list[dict]) -> list[list[dict]]:
    """Consecutive jobs of one (preset, model, batch, size, dtype): the rows that are compared together."""
    groups: list[list[dict]] = []
    for job in jobs:
        if groups and group_key(groups[-1][0]) == group_key(job):
            groups[-1].append(job)
        else:
            groups.append([job])
    return groups


def merge_rounds(results: list[dict], batch: int) -> dict:
    """One row from the rounds of one job: the timed calls of all rounds pooled (median, IQR, min, max over
    all of them) and each round's median kept; memory, outputs and load times from the first round."""
    bad = next((r for r in results if r["status"] != "ok"), None)
    if bad is not None or len(results) == 1:
        return bad or results[0]
    row = dict(results[0])
    row.update(summarize_times([t for r in results for t in r["times_ms"]], batch),
               round_medians_ms=[r["median_ms"] for r in results], rounds=len(results))
    return row


def load_outputs(path: str) -> list[torch.Tensor]:
    """A child's saved outputs, in order (saved as tensors "0", "1", ...)."""
    tensors = load_file(path)
    return [tensors[str(i)] for i in range(len(tensors))]


def tolerance_of(reference: dict) -> tuple[float, str]:
    """The bound on rel err against `reference` (a row) and where it comes from (see NOISE_MULTIPLE)."""
    if reference["dtype"] == "fp32":
        return TOLERANCE["fp32"], "fp32"
    noise = reference.get("noise_vs_fp32")
    if noise is None or not math.isfinite(noise):
        return REDUCED_PRECISION_FALLBACK, "fixed (the reference's fp32 noise run failed)"
    return max(NOISE_MULTIPLE * noise, TOLERANCE["fp32"]), f"{NOISE_MULTIPLE:g} x {reference['impl']} noise_vs_fp32"


def compare_group(rows: list[dict], earlier: list[dict] = ()):
    """Compare every ok row of one group with the group's reference (hf, else ours), taken from `rows` or, when
    this run did not measure it, from `earlier` (rows of an earlier run whose outputs are in the work dir)."""
    ok = {r["impl"]: r for r in rows if r["status"] == "ok"}
    candidates = {**{r["impl"]: r for r in earlier if r["status"] == "ok"}, **ok}
    ref_impl = next((i for i in REFERENCE_IMPLS if i in candidates), None)
    if ref_impl is None:
        return
    reference = load_outputs(candidates[ref_impl]["outputs_path"])
    tolerance, source = tolerance_of(candidates[ref_impl])
    for impl, r in ok.items():
        r["reference"] = ref_impl
        r["rel_err"] = relative_error(load_outputs(r["outputs_path"]), reference)
        r["tolerance"], r["tolerance_from"] = tolerance, source
        if not math.isfinite(r["rel_err"]) or r["rel_err"] > r["tolerance"]:
            r["status"] = "MISMATCH"
            r["reason"] = f"rel err {r['rel_err']:.2e} vs {ref_impl} > {r['tolerance']:.1e}"


def add_derived(rows: list[dict], dev_name: str):
    by_group: dict[str, dict[str, dict]] = {}
    for r in rows:
        by_group.setdefault(group_key(r), {})[r["impl"]] = r
    for r in rows:
        if r.get("median_ms") is None:
            continue
        s = r["median_ms"] / 1e3
        r["achieved_tflops"] = r["flops"] / s / 1e12
        r["achieved_gbs"] = r["bytes"] / s / 1e9
        peak, _ = device_peaks(dev_name, r["dtype"]) if r["device"] == "cuda" else (None, None)
        r["peak_tflops"] = peak
        r["peak_fraction"] = r["achieved_tflops"] / peak if peak else None
        r["flop_floor_ms"] = r["flops"] / (peak * 1e12) * 1e3 if peak else None
        group = by_group[group_key(r)]
        for base in ("hf", "hf-compile"):
            b = group.get(base)
            ok = b is not None and b.get("median_ms") and b["status"] == "ok"
            r[f"speedup_vs_{base.replace('-', '_')}"] = b["median_ms"] / r["median_ms"] if ok else None
        hf = group.get("hf")
        ok = hf is not None and hf["status"] == "ok" and hf.get("peak_mb") and r.get("peak_mb") is not None
        r["memory_vs_hf"] = r["peak_mb"] / hf["peak_mb"] if ok else None


def sort_rows(rows):
    order = {i: n for n, i in enumerate(IMPLS)}
    return sorted(rows, key=lambda r: (r["preset"], MODELS.index(r["model"]), r["batch"], r["dtype"], order[r["impl"]]))


def write_markdown(data: dict, path: pathlib.Path):
    cuda = data["device_kind"] == "cuda"
    unit = "TFLOP/s" if cuda else "GFLOP/s"
    scale = 1 if cuda else 1e3
    lines = [
        f"# End-to-end forward: {data['device']}",
        "",
        f"{data['date']} · torch {data['versions']['torch']} · transformers {data['versions'].get('transformers')} · "
        f"triton {data['versions'].get('triton')} · `{data['command']}`",
        "",
        "Median of the timed calls (after warm-up), spread = IQR; img/s = batch / median; peak MB = memory one call "
        f"adds on top of the loaded model ({data['memory_method']}); mem/HF = peak MB / the hf row's"
        + ("" if cuda else "; RSS MB = the process's peak RSS during one call - RSS before (a noisy cross-check)")
        + "; rel err = max|x - ref| / max|ref| against the "
        "group's reference row (hf, else ours) on the same random weights and input; ×HF, ×compile(HF) = speedup "
        "over those rows (>1: faster). FLOPs: linear + conv + attention (4·N²·D per head), counted in code.",
        "",
        f"| preset | model | batch | dtype | impl | median ms | IQR ms | img/s | peak MB | mem/HF | "
        + ("" if cuda else "RSS MB | ") + f"{unit} | "
        + ("% peak | floor ms | " if cuda else "") + "×HF | ×compile(HF) | rel err | status |",
        "|" + "---|" * (17 if cuda else 16),
    ]

    def f(v, spec):
        return "" if v is None else format(v, spec)

    for r in sort_rows(data["rows"]):
        status = r["status"] if r["status"] != "ok" else "ok"
        if r.get("reason") and r["status"] != "ok":
            status += f": {r['reason'][:90]}"
        cells = [r["preset"], r["model"], str(r["batch"]), r["dtype"], r["impl"], f(r.get("median_ms"), ".1f"),
                 f(r.get("iqr_ms"), ".1f"), f(r.get("images_per_s"), ".2f"), f(r.get("peak_mb"), ".1f"),
                 f(r.get("memory_vs_hf"), ".2f")]
        if not cuda:
            cells.append(f(r.get("rss_peak_mb"), ".0f"))
        cells.append(f(r["achieved_tflops"] * scale if r.get("achieved_tflops") else None, ".1f"))
        if cuda:
            cells += [f(r["peak_fraction"] * 100 if r.get("peak_fraction") else None, ".1f"), f(r.get("flop_floor_ms"), ".1f")]
        cells += [f(r.get("speedup_vs_hf"), ".2f"), f(r.get("speedup_vs_hf_compile"), ".2f"), f(r.get("rel_err"), ".1e"),
                  status.replace("|", "/")]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    path.write_text("\n".join(lines))


def write_plot(data: dict, path: pathlib.Path):
    """Horizontal bars of images/s per row, grouped by (preset, model, batch), one colour per impl."""
    from PIL import Image, ImageDraw, ImageFont

    rows = [r for r in sort_rows(data["rows"]) if r.get("images_per_s")]
    if not rows:
        return
    colours = {"hf": (120, 120, 120), "hf-eager": (180, 180, 180), "hf-compile": (60, 60, 60),
               "ours": (90, 150, 220), "ours-cl": (150, 190, 235), "ours-triton": (220, 90, 40),
               "ours-triton-cl": (240, 140, 100), "ours-compile": (40, 90, 170),
               "ours-graph": (240, 170, 40)}
    try:
        font = ImageFont.load_default(size=14)
    except TypeError:
        font = ImageFont.load_default()
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(f"{r['preset']} {r['model']} b{r['batch']} {r['dtype']}", []).append(r)
    bar, gap, left, right, top = 16, 14, 250, 140, 60
    height = top + sum(len(g) * bar + gap for g in groups.values()) + 40
    width = 1100
    img = Image.new("RGB", (width, height), "white")
    d = ImageDraw.Draw(img)
    d.text((10, 10), f"Sapiens2 forward, images/s (longer is better), bars scaled per group: {data['device']}", fill="black", font=font)
    d.text((10, 30), f"{data['date']}, torch {data['versions']['torch']}, image {rows[0]['size'][0]}x{rows[0]['size'][1]}",
           fill=(80, 80, 80), font=font)
    y = top
    span = width - left - right
    for label, group in groups.items():
        best = max(r["images_per_s"] for r in group)
        d.text((10, y + (len(group) * bar) // 2 - 8), label, fill="black", font=font)
        for r in group:
            w = max(1, int(span * r["images_per_s"] / best))
            d.rectangle([left, y + 1, left + w, y + bar - 2], fill=colours.get(r["impl"], (0, 160, 0)))
            mark = "" if r["status"] == "ok" else f"  {r['status']}"
            d.text((left + w + 6, y), f"{r['impl']}  {r['images_per_s']:.2f}{mark}", fill="black", font=font)
            y += bar
        y += gap
    img.save(path)


def render(json_path: pathlib.Path):
    data = json.loads(json_path.read_text())
    write_markdown(data, json_path.with_suffix(".md"))
    write_plot(data, json_path.with_suffix(".png"))


def print_row(r: dict):
    med = f"{r['median_ms']:9.1f} ms" if r.get("median_ms") is not None else " " * 12
    extra = ""
    if r.get("rel_err") is not None:
        extra += f"  err {r['rel_err']:.1e}"
    if r.get("peak_mb") is not None:
        extra += f"  peak {r['peak_mb']:.0f} MB"
    why = f"  ({r['reason']})" if r.get("reason") and r["status"] != "ok" else ""
    print(f"{r['preset']:>5} {r['model']:>9} b{r['batch']:<2} {r['dtype']} {r['impl']:<13}{med}{extra}  {r['status']}{why}",
          flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--report", type=pathlib.Path, help="re-render the .md and .png of a results JSON and exit")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--suite", choices=sorted(SUITES), help="default: gpu on CUDA, cpu otherwise")
    split = lambda s: tuple(x for x in s.split(",") if x)  # noqa: E731
    ap.add_argument("--presets", type=split)
    ap.add_argument("--models", type=split, help=",".join(MODELS))
    ap.add_argument("--batches", type=lambda s: tuple(int(b) for b in s.split(",")))
    ap.add_argument("--impls", type=split, help=",".join(IMPLS))
    ap.add_argument("--size", type=int, nargs=2, metavar=("H", "W"))
    ap.add_argument("--dtype", choices=sorted(DTYPES))
    ap.add_argument("--warmup", type=int)
    ap.add_argument("--reps", type=int)
    ap.add_argument("--rounds", type=int, help="run each group this many times, interleaved (default: the suite's)")
    ap.add_argument("--cuda-graphs", action="store_true", help="add an ours-graph row (CUDA graph replay) at batch 1")
    ap.add_argument("--perturb", action="store_true", help=argparse.SUPPRESS)  # the smoke test's wrong model
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per child process")
    ap.add_argument("--out", type=pathlib.Path, help="results JSON (default bench/results/e2e-<device>-<date>.json)")
    ap.add_argument("--append", action="store_true", help="merge into an existing --out, replacing rows of the same key")
    ap.add_argument("--work-dir", type=pathlib.Path, help="where weights and outputs go (default: a temp dir, removed)")
    ap.add_argument("--no-render", action="store_true", help="write the JSON only (the .md and .png: --report later)")
    args = ap.parse_args(argv)

    if args.child:
        spec = json.loads(args.child)
        result = run_child(spec)
        pathlib.Path(spec["result"]).write_text(json.dumps(result))
        return 0
    if args.report:
        render(args.report)
        print(f"wrote {args.report.with_suffix('.md')} and {args.report.with_suffix('.png')}")
        return 0

    args.suite = args.suite or ("gpu" if args.device == "cuda" else "cpu")
    for impl in args.impls or ():
        if impl not in IMPLS:
            ap.error(f"unknown impl {impl!r}; choose from {', '.join(IMPLS)}")
    jobs = plan(args)
    dev_name = device_name(args.device)
    date = datetime.date.today().isoformat()
    out = args.out or ROOT / "bench" / "results" / f"e2e-{device_slug(args.device)}-{date}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    command = "python bench/e2e.py " + " ".join(argv if argv is not None else sys.argv[1:])
    print(f"{len(jobs)} runs on {dev_name}; results -> {out}", flush=True)

    def save(pending: list[dict] = ()):
        """Write the JSON with every row so far (atomically): a run cut short keeps what it measured. `pending`:
        the rows of the group in progress, compared on copies with the reference measured so far."""
        pending = [dict(r) for r in pending]
        if pending:
            compare_group(pending, earlier_rows(pending[0]))
        done = [{k: v for k, v in r.items() if k != "outputs_path"} for r in rows + pending]
        data = {"device": dev_name, "device_kind": args.device, "date": date, "versions": versions(),
                "command": command, "threads": torch.get_num_threads(),
                "memory_method": next((r["memory_method"] for r in done if r.get("memory_method")), None), "rows": done}
        if previous is not None:
            keep = {job_key(r): r for r in previous["rows"]}
            keep.update({job_key(r): r for r in done})
            data["rows"] = list(keep.values())
            data["command"] = previous.get("command", "") + " ; " + command
            data["memory_method"] = data["memory_method"] or previous.get("memory_method")
        add_derived(data["rows"], dev_name)
        safe_io.atomic_write(out, safe_io.json_text(data, indent=1))
        if not args.no_render:
            render(out)
        return pending

    def earlier_rows(like: dict) -> list[dict]:
        """The earlier run's rows of this group whose outputs are still in the work dir (--append)."""
        found = []
        for r in previous["rows"] if previous is not None else ():
            path = outputs_file(work, r)
            if group_key(r) == group_key(like) and r.get("status") == "ok" and path.exists():
                found.append({**r, "outputs_path": str(path)})
        return found

    previous = json.loads(out.read_text()) if args.append and out.exists() else None
    work = args.work_dir or pathlib.Path(tempfile.mkdtemp(prefix="sapiens2-e2e-"))
    work.mkdir(parents=True, exist_ok=True)
    flops_cache: dict = {}
    rows: list[dict] = []
    printed: dict[str, tuple] = {}  # job key -> (status, rel err) as printed when the job finished
    rounds = args.rounds or SUITES[args.suite].get("rounds", 1)

    def finished_row(job: dict, results: list[dict]) -> dict:
        fkey = (job["preset"], job["model"], job["batch"], tuple(job["size"]), job["dtype"])
        if fkey not in flops_cache:
            flops_cache[fkey] = count_flops(*fkey)
        row = {k: job[k] for k in ("preset", "model", "batch", "size", "dtype", "impl", "device")}
        row.update(flops_cache[fkey])
        row.update(merge_rounds(results, job["batch"]))
        return row

    try:
        for group_jobs in split_groups(jobs):
            results = {job_key(job): [] for job in group_jobs}
            group: list[dict] = []
            for round_index in range(rounds):  # interleaved: hf, ours, ..., hf, ours, ... so slow drift hits all alike
                for job in group_jobs:
                    results[job_key(job)].append(run_job(job, work, args.timeout))
                    if round_index == rounds - 1:  # the job's last round: its row is final, saved at once
                        group.append(finished_row(job, results[job_key(job)]))
                        shown = save(group)[-1]
                        print_row(shown)
                        printed[job_key(job)] = (shown["status"], shown.get("rel_err"))
            # The group complete: compared with its reference for good (rows measured before it was are now too).
            compare_group(group, earlier_rows(group[0]))
            for r in group:
                if printed.get(job_key(r)) != (r["status"], r.get("rel_err")):
                    print_row(r)
            rows.extend(group)
            save()
    finally:
        if args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    bad = [r for r in rows if r["status"] in ("MISMATCH", "error")]
    for r in bad:
        print(f"FAILED {job_key(r)}: {r['status']}: {r.get('reason')}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
