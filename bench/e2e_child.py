"""One job of bench/e2e.py in its own process (`bench/e2e.py --child SPEC`): loading the implementation (ours through
weights.load, transformers' Sapiens2* through from_pretrained; torch.compile or a CUDA graph on top), then the first
call, the timed calls, one call's memory, the reference's fp32 rounding noise, and the subsample of its outputs saved
for the parent to compare. skip_reason: whether an implementation can run here at all (the parent asks before it
starts a child)."""

from __future__ import annotations

import gc
import os
import sys
import time

import torch
from safetensors.torch import save_file

from sapiens2 import weights
from e2e_compare import REFERENCE_IMPLS, relative_error
from e2e_measure import CpuRssPeak, cpu_allocation_peak_mb, summarize_times, time_calls
from e2e_models import DTYPES, SEED, hf_class_name, outputs_of, subsample


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
