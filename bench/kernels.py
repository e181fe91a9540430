"""Benchmark the fused kernels against what users have today.

    python bench/kernels.py                      # CUDA if available, else the CPU smoke run
    python bench/kernels.py --device cpu         # reference vs torch.compile(reference), small shapes
    python bench/kernels.py --device cuda [--quick] [--out bench/results/kernels_h200.json]

CUDA: at the real shapes (1024 x 768 image -> N = 9 + 64 * 48 = 3081 tokens; 0.4b, 0.8b, 1b, 5b; batch 1
and 8; bf16) it times
    attention     Triton | reference (SDPA after repeat_interleave) | torch.compile(reference) |
                  SDPA (enable_gqa) on each backend: flash, efficient, cudnn (and math at batch 1)
                  forward, and forward + backward
    qk_norm_rope  Triton | reference | torch.compile(reference), for fp32 q/k with bf16 tables (the original
                  model) and bf16 q/k with bf16 tables
and reports the median time (triton.testing.do_bench), TFLOP/s (attention: 4 B Hq N^2 D for the forward,
3.5x that for forward + backward, the FlashAttention-2 convention) or GB/s (qk_norm_rope: bytes read and
written once), and the fraction of the device's peak: the datasheet dense bf16 TFLOP/s for attention, and
for qk_norm_rope the measured device-to-device copy bandwidth (a torch copy_ of 1 GiB). A JSON with the
device, versions, shapes and medians goes to bench/results/.
CPU: the same ops at small shapes, reference vs torch.compile(reference), so that this script keeps running
in CI; its numbers say nothing about the GPU.
"""

import argparse
import datetime
import json
import math
import os
import pathlib
import platform
import statistics
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import kernels  # noqa: E402
from kernels import attention_reference, qk_norm_rope_reference  # noqa: E402

# name: (embed dim, query heads, kv heads in the GQA blocks); D = embed / heads. The first and last blocks
# of each model are full multi-head attention (kv heads = query heads), the others GQA with half the heads.
MODELS = {"0.4b": (1024, 16, 8), "0.8b": (1280, 16, 8), "1b": (1536, 24, 12), "5b": (2432, 32, 16)}
N_TOKENS = 9 + 64 * 48  # CLS + 8 registers + the patches of a 1024 x 768 image at patch size 16

# Dense (no sparsity) bf16 tensor-core peak, TFLOP/s, and HBM bandwidth, GB/s, from the datasheets.
PEAKS = {"H200": (989.4, 4800.0), "H100": (989.4, 3350.0), "A100": (312.0, 2039.0), "L40S": (362.0, 864.0)}


def device_peaks(name: str):
    for key, peaks in PEAKS.items():
        if key in name:
            return peaks
    return None, None


# ----------------------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------------------


def time_ms(fn, device: str, reps: int) -> float:
    """Median milliseconds of fn()."""
    if device == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=max(50, reps * 10), return_mode="median"))
    fn()  # warm-up (and compilation)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def copy_bandwidth_gbs(device: str) -> float:
    n = (1 << 30) // 4 if device == "cuda" else (64 << 20) // 4
    x = torch.empty(n, dtype=torch.float32, device=device)
    y = torch.empty_like(x)
    ms = time_ms(lambda: y.copy_(x), device, 10)
    return 2 * x.numel() * 4 / (ms * 1e-3) / 1e9


def try_time(fn, device, reps):
    try:
        return time_ms(fn, device, reps), None
    except Exception as e:  # a backend that does not support the shape: reported, not fatal
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"


# ----------------------------------------------------------------------------------------------------
# Cases
# ----------------------------------------------------------------------------------------------------


def make_qkv(B, HQ, HKV, N, D, dtype, device, grad=False):
    """q, k, v as the model makes them: (B, N, H, D) projections viewed as (B, H, N, D)."""
    q = torch.randn(B, N, HQ, D, dtype=dtype, device=device).transpose(1, 2)
    k = torch.randn(B, N, HKV, D, dtype=dtype, device=device).transpose(1, 2)
    v = torch.randn(B, N, HKV, D, dtype=dtype, device=device).transpose(1, 2)
    return [t.requires_grad_(grad) for t in (q, k, v)]


def attention_impls(device: str, with_backends: bool, batch: int):
    impls = {"reference": attention_reference, "compiled_reference": torch.compile(attention_reference)}
    if device == "cuda":
        from kernels.attention_triton import attention_triton

        impls = {"triton": attention_triton, **impls}
    if with_backends:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backends = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION,
                    "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}
        if batch == 1:
            backends["sdpa_math"] = SDPBackend.MATH

        def sdpa_on(backend):
            def run(q, k, v):
                with sdpa_kernel(backend):
                    return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
            return run

        impls.update({name: sdpa_on(b) for name, b in backends.items()})
    return impls


def bench_attention(rows, device, shapes, dtype, reps, peak_tflops, with_backward, with_backends):
    for model, B, HQ, HKV, N, D in shapes:
        fwd_flops = 4 * B * HQ * N * N * D
        for impl, fn in attention_impls(device, with_backends, B).items():
            q, k, v = make_qkv(B, HQ, HKV, N, D, dtype, device)
            ms, err = try_time(lambda: fn(q, k, v), device, reps)
            rows.append(row("attention", "fwd", impl, model, B, N, HQ, HKV, D, dtype, ms, err,
                            tflops=fwd_flops, peak_tflops=peak_tflops))
            if with_backward:
                q, k, v = make_qkv(B, HQ, HKV, N, D, dtype, device, grad=True)
                do = torch.randn_like(q)

                def fwd_bwd():
                    torch.autograd.grad(fn(q, k, v), (q, k, v), do)
                ms, err = try_time(fwd_bwd, device, reps)
                rows.append(row("attention", "fwd+bwd", impl, model, B, N, HQ, HKV, D, dtype, ms, err,
                                tflops=3.5 * fwd_flops, peak_tflops=peak_tflops))
            del q, k, v


def bench_qk_norm_rope(rows, device, shapes, dtypes, reps, copy_gbs):
    impls = {"reference": qk_norm_rope_reference, "compiled_reference": torch.compile(qk_norm_rope_reference)}
    if device == "cuda":
        from kernels.qk_norm_rope_triton import qk_norm_rope_triton

        impls = {"triton": qk_norm_rope_triton, **impls}
    for model, B, HQ, HKV, N, D in shapes:
        P = N - 9
        for dtype, rope_dtype in dtypes:
            q, k, _ = make_qkv(B, HQ, HKV, N, D, dtype, device)
            w = torch.ones(D, device=device)
            angles = torch.rand(P, D, device=device) * 6.3
            cos, sin = angles.cos().to(rope_dtype), angles.sin().to(rope_dtype)
            nbytes = 2 * (q.numel() + k.numel()) * q.element_size() + 2 * cos.numel() * cos.element_size()
            for impl, fn in impls.items():
                ms, err = try_time(lambda: fn(q, k, w, w, cos, sin, 1e-6), device, reps)
                r = row("qk_norm_rope", "fwd", impl, model, B, N, HQ, HKV, D, dtype, ms, err)
                r["rope_dtype"] = str(rope_dtype).replace("torch.", "")
                if ms is not None:
                    r["GB/s"] = nbytes / (ms * 1e-3) / 1e9
                    r["frac_copy_bw"] = r["GB/s"] / copy_gbs
                rows.append(r)


def row(op, pas, impl, model, B, N, HQ, HKV, D, dtype, ms, err, tflops=None, peak_tflops=None):
    r = {"op": op, "pass": pas, "impl": impl, "model": model, "B": B, "N": N, "Hq": HQ, "Hkv": HKV, "D": D,
         "dtype": str(dtype).replace("torch.", ""), "ms_median": ms}
    if err:
        r["error"] = err
    if tflops is not None and ms is not None:
        r["TFLOP/s"] = tflops / (ms * 1e-3) / 1e12
        if peak_tflops:
            r["frac_peak"] = r["TFLOP/s"] / peak_tflops
    return r


# ----------------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------------


def print_table(rows):
    cols = ["op", "pass", "model", "B", "Hq", "Hkv", "D", "dtype", "rope_dtype", "impl", "ms_median", "TFLOP/s", "GB/s",
            "frac_peak", "frac_copy_bw"]
    cols = [c for c in cols if any(c in r for r in rows)]

    def fmt(v):
        if v is None:
            return "-"
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    table = [[fmt(r.get(c)) if not (c == "ms_median" and r.get("error")) else "n/a" for c in cols] for r in rows]
    widths = [max(len(c), *(len(t[i]) for t in table)) for i, c in enumerate(cols)]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for t in table:
        print("  ".join(v.ljust(w) for v, w in zip(t, widths)))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="CUDA: 0.4b and 5b, batch 8 only (forward + backward)")
    ap.add_argument("--no-backward", action="store_true")
    ap.add_argument("--out", type=pathlib.Path, default=None, help="JSON path (default: bench/results/...)")
    args = ap.parse_args()
    device = args.device
    torch.manual_seed(0)

    info = {"device": torch.cuda.get_device_name() if device == "cuda" else f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} threads)",
            "torch": torch.__version__, "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if device == "cuda":
        info["cuda"] = torch.version.cuda
        peak_tflops, hbm_gbs = device_peaks(info["device"])
        info["peak_bf16_dense_TFLOP/s"], info["datasheet_hbm_GB/s"] = peak_tflops, hbm_gbs
        models = ["0.4b", "5b"] if args.quick else list(MODELS)
        batches = [8] if args.quick else [1, 8]
        attn_shapes, qk_shapes = [], []
        for m in models:
            C, HQ, HKV = MODELS[m]
            for B in batches:
                attn_shapes += [(m, B, HQ, HQ, N_TOKENS, C // HQ), (m, B, HQ, HKV, N_TOKENS, C // HQ)]
                qk_shapes += [(m, B, HQ, HKV, N_TOKENS, C // HQ)]
        dtype, reps = torch.bfloat16, 20
        qk_dtypes = [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16)]
        with_backends = True
    else:
        # One intra-op thread: on a small shared CI box a multi-threaded pool stalls whenever another process
        # holds a core, which turns 0.1 ms ops into 100 ms medians.
        torch.set_num_threads(1)
        peak_tflops = None
        # Small shapes: 0.4b's heads at a 128 x 96 image (N = 9 + 8 * 6 = 57) and 0.8b's head dim 80.
        attn_shapes = [("0.4b@128x96", 1, 16, 8, 57, 64), ("0.8b@128x96", 1, 16, 8, 57, 80)]
        qk_shapes = attn_shapes
        dtype, reps = torch.float32, 15
        qk_dtypes = [(torch.float32, torch.bfloat16), (torch.float32, torch.float32)]
        with_backends = False
    info["copy_GB/s_measured"] = copy_gbs = copy_bandwidth_gbs(device)

    rows = []
    t0 = time.time()
    bench_qk_norm_rope(rows, device, qk_shapes, qk_dtypes, reps, copy_gbs)
    bench_attention(rows, device, attn_shapes, dtype, reps, peak_tflops, not args.no_backward, with_backends)
    info["bench_seconds"] = round(time.time() - t0, 1)

    print(json.dumps(info))
    print_table(rows)
    tag = "cpu" if device == "cpu" else "".join(ch for ch in info["device"].split()[-1].lower() if ch.isalnum())
    out = args.out or ROOT / "bench" / "results" / f"kernels_{tag}{'_quick' if args.quick else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**info, "rows": rows}, indent=1) + "\n")
    print(f"wrote {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")


if __name__ == "__main__":
    main()
