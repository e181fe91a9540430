"""Benchmark the fused kernels against what users have today.

    python3 bench/kernels.py                      # CUDA if available, else the CPU smoke run
    python3 bench/kernels.py --device cpu         # reference vs torch.compile(reference), small shapes
    python3 bench/kernels.py --device cuda [--presets 0.4b,5b] [--batches 8] [--ops attention,qk_norm_rope,copy]
                                           [--impls sdpa,triton,auto,forced,triton[LABEL]] [--with-compile]
                                           [--out FILE [--append]]
    python3 bench/kernels.py --list-forced        # the forced variants' labels, one a line

CUDA: at the real shapes (a 1024 x 768 image: N = 9 + 64 * 48 = 3081 tokens; the presets' heads, from
sapiens2.PRESETS; bf16) it times
    attention     Triton | reference (SDPA with enable_gqa: K/V are never repeated) | SDPA on each backend
                  (flash, efficient, cudnn; math at batch 1) | torch.compile(reference) with --with-compile;
                  forward, and forward + backward; full-attention and GQA blocks
    qk_norm_rope  Triton | reference (| torch.compile(reference)), fp32 q/k with bf16 tables (the original
                  model) and bf16 q/k with bf16 tables
    copy          a device-to-device copy of 1 GiB: the memory ceiling qk_norm_rope is measured against
and reports the median time (triton.testing.do_bench), TFLOP/s (attention: 4 B Hq N^2 D for the forward,
3.5x that for forward + backward, the FlashAttention-2 convention) or GB/s (qk_norm_rope: bytes read and
written once), and the fraction of the device's peak (runtime_info.DEVICE_PEAKS: datasheet dense bf16) or of
the measured copy bandwidth. Rows are printed and written to the JSON as they are measured (a run cut short
keeps what it measured), in the order of --ops. --impls keeps some rows only (sdpa: the reference and SDPA's
backends; triton: autotuned; auto; forced: every triton[LABEL]; or one impl by name), and --append merges them
into an existing --out (a row of the same case replaces the old one): bench/gpu_session.sh runs the SDPA rows,
then each forced variant in its own process (one that faults on the GPU loses only its own rows, and is named),
then autotuning, all into one JSON. SAPIENS2_TRITON_EXCLUDE=LABEL,... (kernels/grid_triton.py) removes
configurations from autotuning and skips those forced rows.
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

from sapiens2 import PRESETS  # noqa: E402
from sapiens2.kernels import attention_reference, qk_norm_rope_reference  # noqa: E402
from sapiens2_app.common import safe_io  # noqa: E402
from sapiens2_app.common.runtime_info import device_peaks, versions  # noqa: E402

IMAGE = (1024, 768)


def preset_shapes(preset: str, batch: int, image=IMAGE):
    """[(label, B, Hq, Hkv, N, D)] for the preset's attention blocks (full attention, then GQA), from
    sapiens2.PRESETS: the one home of the architectures and of the prefix-token count."""
    config = PRESETS[preset]
    N = config.num_prefix_tokens + (image[0] // config.patch_size) * (image[1] // config.patch_size)
    kv_heads = sorted(set(config.layer_kv_heads), reverse=True)
    return [(preset, batch, config.num_heads, kv, N, config.head_dim) for kv in kv_heads]


def num_patches(model: str, N: int) -> int:
    return N - PRESETS[model.split("@")[0]].num_prefix_tokens


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


KNOWN_IMPLS = ("all", "sdpa", "forced", "triton", "auto", "reference", "compiled_reference", "sdpa_flash",
               "sdpa_cudnn", "sdpa_efficient", "sdpa_math")


def impl_filter(spec: str):
    """--impls: a predicate on row names. 'all'; groups sdpa (reference, compiled_reference, sdpa_*), forced
    (every triton[LABEL]); or exact names (triton, auto, triton[128x64w8s3], ...)."""
    names = {name.strip() for name in spec.split(",") if name.strip()}

    def wanted(impl: str) -> bool:
        return ("all" in names or impl in names
                or ("sdpa" in names and (impl in ("reference", "compiled_reference") or impl.startswith("sdpa_")))
                or ("forced" in names and impl.startswith("triton[")))
    return wanted


def attention_impls(device: str, with_backends: bool, batch: int, with_compile: bool):
    impls = {"reference": attention_reference}
    if with_compile:
        impls["compiled_reference"] = torch.compile(attention_reference)
    if device == "cuda":
        from sapiens2 import kernels
        from sapiens2.kernels import attention_triton, attention_triton_hopper

        # triton: attention_triton.py autotuned; triton_hopper: the Hopper variants autotuned beside its tiles
        # (what SAPIENS2_KERNELS=fastest runs); auto: what the default dispatch runs
        impls = {"triton": attention_triton.attention_triton, "triton_hopper": attention_triton_hopper.attention_triton,
                 "auto": kernels.attention, **impls}
    if with_backends:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backends = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
                    "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION}
        if batch == 1:
            backends["sdpa_math"] = SDPBackend.MATH

        def sdpa_on(backend):
            def run(q, k, v):
                with sdpa_kernel(backend):
                    return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
            return run

        impls.update({name: sdpa_on(b) for name, b in backends.items()})
    return impls


# CUDA: forward rows with the Triton tiles forced, beside the autotuned "triton" row, so that one run says what
# each Hopper variant (kernels/attention_triton_hopper.py) is worth against attention_triton.py's kernel at the
# same tile (the first label, no variant letter): the same capped at 128 registers (r128: two programs per SM),
# the overlapped order (o: the next Q K^T issued before P V, the softmax under the MMA), K/V through TMA
# descriptors (t), and a persistent grid (g). Labels as bench/inspect_kernels.py.
FORCED_FORWARD = {
    "128x64w8s3": dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3),
    "128x64w8s3r128": dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3, OVERLAP=False, maxnreg=128),
    "128x64w8s3o": dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3, OVERLAP=True),
    "128x64w8s3to": dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3, OVERLAP=True, TMA=True),
    "128x128w8s2to": dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=2, OVERLAP=True, TMA=True),
    "128x64w8s3tog": dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3, OVERLAP=True, TMA=True, PERSISTENT=True),
}


def forced_forward_impls():
    """{triton[LABEL]: launcher}; None for a label SAPIENS2_TRITON_EXCLUDE names (its row says so). A label without
    variant letters runs attention_triton.py, the others its Hopper variants (plain order unless `o`)."""
    from sapiens2.kernels import attention_triton, attention_triton_hopper
    from sapiens2.kernels.grid_triton import VARIANT_LETTERS, excluded_configs

    def forced(blocks):
        variants = any(blocks.get(flag) for _, flag in VARIANT_LETTERS) or blocks.get("maxnreg")
        if not variants:
            return lambda q, k, v: attention_triton.attention_fwd(q, k, v, blocks=blocks)[0]
        blocks = {"OVERLAP": False, **blocks}
        return lambda q, k, v: attention_triton_hopper.attention_fwd(q, k, v, blocks=blocks)[0]
    excluded = excluded_configs()
    return {f"triton[{label}]": None if label in excluded else forced(blocks) for label, blocks in FORCED_FORWARD.items()}


def tuned_forward_config(impl: str, q, k, v) -> str | None:
    """The label of the forward configuration the autotuner chose for this impl's last launch."""
    from sapiens2.kernels import attention_triton, attention_triton_hopper
    from sapiens2.kernels.grid_triton import tuned_label

    if impl == "triton":
        return tuned_label(attention_triton._TUNED["fwd", q.dtype == torch.float32])
    hopper = attention_triton_hopper
    tma = hopper.tma_usable(*(attention_triton.aligned_heads(t) for t in (k, v)))
    return tuned_label(hopper._TUNED["fwd", q.dtype == torch.float32, tma])


def max_rel_err(got, want) -> float | None:
    """max |got - want| / max |want| over the tensors of a result, or None when there is none."""
    if got is None:
        return None
    pairs = zip(got, want) if isinstance(got, (tuple, list)) else [(got, want)]
    return max(((g.float() - w).abs().max() / w.abs().max()).item() for g, w in pairs)


def run_or_none(fn):
    try:
        return fn()
    except Exception:  # a backend that does not support the shape: its timing row says why
        return None


def bench_attention(rec, device, shapes, dtype, reps, peak_tflops, with_backward, with_backends, with_compile,
                    wanted=impl_filter("all")):
    """Every row also carries max_rel_err against the fp32 reference on the same inputs (the output for fwd, the
    worst of dq/dk/dv for fwd+bwd), so that a fast row that computes something else is seen at once."""
    for model, B, HQ, HKV, N, D in shapes:
        fwd_flops = 4 * B * HQ * N * N * D
        impls = attention_impls(device, with_backends, B, with_compile)
        if "triton" in impls:  # the forced variants right after the autotuned row
            at = list(impls).index("triton") + 1
            items = list(impls.items())
            impls = dict(items[:at] + list(forced_forward_impls().items()) + items[at:])
        impls = {impl: fn for impl, fn in impls.items() if wanted(impl)}
        bwd_impls = {impl: fn for impl, fn in attention_impls(device, with_backends, B, with_compile).items()
                     if wanted(impl)} if with_backward else {}
        if not impls and not bwd_impls:
            continue
        q, k, v = make_qkv(B, HQ, HKV, N, D, dtype, device)
        want = attention_reference(q.float(), k.float(), v.float())
        for impl, fn in impls.items():
            if fn is None:
                rec.add(row("attention", "fwd", impl, model, B, N, HQ, HKV, D, dtype, None,
                            "excluded by SAPIENS2_TRITON_EXCLUDE"))
                continue
            ms, err = try_time(lambda: fn(q, k, v), device, reps)
            r = row("attention", "fwd", impl, model, B, N, HQ, HKV, D, dtype, ms, err,
                    tflops=fwd_flops, peak_tflops=peak_tflops)
            if ms is not None:
                r["max_rel_err"] = max_rel_err(run_or_none(lambda: fn(q, k, v)), want)
            if impl in ("triton", "triton_hopper") and ms is not None:
                r["config"] = tuned_forward_config(impl, q, k, v)
            rec.add(r)
        del want
        if bwd_impls:
            leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
            do = torch.randn_like(q)
            ref_leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
            want_grads = torch.autograd.grad(attention_reference(*ref_leaves), ref_leaves, do.float())
            for impl, fn in bwd_impls.items():
                def fwd_bwd():
                    return torch.autograd.grad(fn(*leaves), leaves, do)
                ms, err = try_time(fwd_bwd, device, reps)
                r = row("attention", "fwd+bwd", impl, model, B, N, HQ, HKV, D, dtype, ms, err,
                        tflops=3.5 * fwd_flops, peak_tflops=peak_tflops)
                if ms is not None:
                    r["max_rel_err"] = max_rel_err(run_or_none(fwd_bwd), want_grads)
                rec.add(r)
            del leaves, do, ref_leaves, want_grads
        del q, k, v


def bench_qk_norm_rope(rec, device, shapes, dtypes, reps, copy_gbs, with_compile, wanted=impl_filter("all")):
    impls = {"reference": qk_norm_rope_reference}
    if with_compile:
        impls["compiled_reference"] = torch.compile(qk_norm_rope_reference)
    if device == "cuda":
        from sapiens2.kernels.qk_norm_rope_triton import qk_norm_rope_triton

        impls = {"triton": qk_norm_rope_triton, **impls}
    impls = {impl: fn for impl, fn in impls.items() if wanted(impl)}
    if not impls:
        return
    for model, B, HQ, HKV, N, D in shapes:
        P = num_patches(model, N)
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
                    r["frac_copy_bw"] = r["GB/s"] / copy_gbs if copy_gbs else None
                rec.add(r)


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

COLUMNS = ["op", "pass", "model", "B", "Hq", "Hkv", "D", "dtype", "rope_dtype", "impl", "config", "ms_median",
           "TFLOP/s", "GB/s", "frac_peak", "frac_copy_bw", "max_rel_err"]


def fmt(v):
    if v is None:
        return "-"
    return f"{v:.4g}" if isinstance(v, float) else str(v)


CASE_FIELDS = ("op", "pass", "impl", "model", "B", "N", "Hq", "Hkv", "D", "dtype", "rope_dtype")


def case_key(r: dict) -> tuple:
    """What a row measures: a later row with the same key replaces it (--append)."""
    return tuple(r.get(field) for field in CASE_FIELDS)


class Recorder:
    """Rows as they are measured: printed at once and the JSON rewritten (atomically), so a run that is cut short
    keeps everything it measured. With `previous` (--append: the JSON already at `out`), its rows stay, except those
    of a case measured again; the runs' info is kept under "runs"."""

    def __init__(self, info: dict, out: pathlib.Path, previous: dict | None = None):
        self.info, self.out, self.rows = info, out, []
        self.kept = list(previous["rows"]) if previous else []
        self.info["runs"] = [*(previous.get("runs", []) if previous else []), dict(info)]
        out.parent.mkdir(parents=True, exist_ok=True)

    def add(self, r: dict):
        self.rows.append(r)
        self.kept = [old for old in self.kept if case_key(old) != case_key(r)]
        cells = [f"{c}={'n/a' if c == 'ms_median' and r.get('error') else fmt(r.get(c))}" for c in COLUMNS if c in r]
        print("row " + " ".join(cells) + (f" error={r['error']}" if r.get("error") else ""), flush=True)
        self.save()

    def save(self):
        self.info["runs"][-1] = {k: v for k, v in self.info.items() if k != "runs"}
        data = {**self.info, "rows": self.kept + self.rows}
        safe_io.atomic_write(self.out, safe_io.json_text(data, indent=1) + "\n")


def read_previous(out: pathlib.Path) -> dict | None:
    """The JSON --append merges into; None when there is none yet. A file that does not parse is an error (its
    rows would be lost by overwriting it)."""
    if not out.exists():
        return None
    try:
        data = json.loads(out.read_text())
    except (OSError, ValueError) as e:
        print(f"error: --out {out}: cannot --append to it ({e}); move it away or drop --append", file=sys.stderr)
        raise SystemExit(2)
    return data if isinstance(data, dict) and isinstance(data.get("rows"), list) else None


def print_table(rows):
    cols = [c for c in COLUMNS if any(c in r for r in rows)]
    table = [[fmt(r.get(c)) if not (c == "ms_median" and r.get("error")) else "n/a" for c in cols] for r in rows]
    widths = [max(len(c), *(len(t[i]) for t in table)) for i, c in enumerate(cols)]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for t in table:
        print("  ".join(v.ljust(w) for v, w in zip(t, widths)))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--presets", default="0.4b,0.8b,1b,5b", help="CUDA: comma-separated (default: %(default)s)")
    ap.add_argument("--batches", default="8,1", help="CUDA: comma-separated (default: %(default)s)")
    ap.add_argument("--ops", default="attention,qk_norm_rope",
                    help="in this order; 'copy' adds a row for the copy ceiling (always measured on CUDA)")
    ap.add_argument("--quick", action="store_true", help="CUDA: --presets 0.4b,5b --batches 8")
    ap.add_argument("--no-backward", action="store_true")
    ap.add_argument("--with-compile", action="store_true", help="also torch.compile(reference) (slow cold compiles)")
    ap.add_argument("--impls", default="all", help="rows to run: all (default), sdpa, triton, auto, forced, "
                    "triton[LABEL] (comma-separated)")
    ap.add_argument("--list-forced", action="store_true", help="print the forced variants' labels and exit")
    ap.add_argument("--out", type=pathlib.Path, default=None, help="JSON path (default: bench/results/...)")
    ap.add_argument("--append", action="store_true", help="merge into an existing --out (same case: replaced)")
    args = ap.parse_args()
    if args.list_forced:
        print("\n".join(FORCED_FORWARD))
        return
    for name in args.impls.split(","):
        if name.strip() not in KNOWN_IMPLS and name.strip() not in (f"triton[{label}]" for label in FORCED_FORWARD):
            ap.error(f"--impls: unknown {name!r}; choose from {', '.join(KNOWN_IMPLS)}, triton[LABEL] (--list-forced)")
    wanted = impl_filter(args.impls)
    device = args.device
    torch.manual_seed(0)
    if args.quick:
        args.presets, args.batches = "0.4b,5b", "8"

    info = {"device": torch.cuda.get_device_name() if device == "cuda" else f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} threads)",
            "versions": versions(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    if device == "cuda":
        peak_tflops, hbm_gbs = device_peaks(info["device"], "bf16")
        info["peak_bf16_dense_TFLOP/s"], info["datasheet_hbm_GB/s"] = peak_tflops, hbm_gbs
        attn_shapes, qk_shapes = [], []
        for B in map(int, args.batches.split(",")):
            for preset in args.presets.split(","):
                shapes = preset_shapes(preset, B)
                attn_shapes += shapes
                qk_shapes += shapes[-1:]  # the GQA block's heads
        dtype, reps = torch.bfloat16, 20
        qk_dtypes = [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)]
        with_backends = True
    else:
        # One intra-op thread: on a small shared CI box a multi-threaded pool stalls whenever another process
        # holds a core, which turns 0.1 ms ops into 100 ms medians.
        torch.set_num_threads(1)
        peak_tflops = None
        # Small shapes: 0.4b's heads at a 128 x 96 image (N = 9 + 8 * 6 = 57) and 0.8b's head dim 80.
        attn_shapes = [(f"{m}@128x96", *shape[1:]) for m in ("0.4b", "0.8b")
                       for shape in preset_shapes(m, 1, (128, 96))[-1:]]
        qk_shapes = attn_shapes
        dtype, reps = torch.float32, 15
        qk_dtypes = [(torch.float32, torch.bfloat16), (torch.float32, torch.float32)]
        with_backends = False
        args.with_compile = True  # the CPU comparison is reference vs compiled

    tag = "cpu" if device == "cpu" else "".join(ch for ch in info["device"].split()[-1].lower() if ch.isalnum())
    out = args.out or ROOT / "bench" / "results" / f"kernels_{tag}{'_quick' if args.quick else ''}.json"
    rec = Recorder(info, out, read_previous(out) if args.append else None)
    print(json.dumps({k: v for k, v in info.items() if k != "runs"}), flush=True)
    t0 = time.time()
    info["copy_GB/s_measured"] = copy_gbs = copy_bandwidth_gbs(device)
    for op in args.ops.split(","):
        if op == "copy":
            rec.add({"op": "copy", "pass": "-", "impl": "torch copy_ 1 GiB" if device == "cuda" else "torch copy_",
                     "GB/s": copy_gbs})
        elif op == "attention":
            bench_attention(rec, device, attn_shapes, dtype, reps, peak_tflops, not args.no_backward,
                            with_backends, args.with_compile, wanted)
        elif op == "qk_norm_rope":
            bench_qk_norm_rope(rec, device, qk_shapes, qk_dtypes, reps, copy_gbs, args.with_compile, wanted)
        else:
            ap.error(f"--ops: unknown op {op!r}")
    info["bench_seconds"] = round(time.time() - t0, 1)
    if device == "cuda":
        from sapiens2.kernels import dispatch

        info["auto_decisions"] = dispatch.decisions()
    rec.save()
    if rec.rows:
        print_table(rec.rows)
    print(f"wrote {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")


if __name__ == "__main__":
    main()
