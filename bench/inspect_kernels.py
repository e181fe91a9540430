"""Compile, with no GPU, every Triton kernel configuration the default dispatch can choose, and read the
machine code: evidence about the kernels on a GPU that is not there.

    python bench/inspect_kernels.py --arch sm_90a --json bench/results/inspect_kernels_sm90a.json
    python bench/inspect_kernels.py --presets 5b --only attn_fwd --first-config     # a quick subset

For presets 0.4b, 0.8b, 1b and 5b at 1024x768, batch 8, bf16 (sapiens2.PRESETS; N = 9 + 64 * 48 = 3081),
forward and backward of attention (full-attention and GQA blocks; kernels/attention_triton.py, then its Hopper
variants, attention_triton_hopper.py: kernel names *_hopper_kernel) and of qk_norm_rope, this runs the real
launchers (kernels/*_triton.py) on meta tensors with the launches intercepted, so that the kernels, the
constexprs, the specialization of the arguments (the JIT's rules: an int equal to 1 becomes a constant,
ints and pointers divisible by 16 get `tt.divisibility = 16`; CUDA allocations are 256-byte aligned) and
every autotune configuration are exactly what a CUDA launch would compile. Each is compiled with the
installed Triton for the target (`triton.compile` with `GPUTarget("cuda", 90, 32)` for sm_90a) and
inspected with the tools that ship inside the triton wheel (triton/backends/nvidia/bin):
    ptxas -v       registers and spill store/load bytes (the PTX triton assembled, the ptxas it used)
    cuobjdump      SASS opcode counts: HGMMA (wgmma), LDL/STL (local memory), LDG 16-bit scalar global
                   loads, LDG 128-bit global loads, LDGSTS (cp.async), UTMALDG (TMA tensor loads); and in the
                   kernel's loops, the exp2s (MUFU.EX2) of the softmax and how many of them are issued while a
                   wgmma is in flight (column ex2@mma; softmax_overlap)
One row per (preset, kernel, configuration); identical compilations are shared between presets (0.4b and 1b
both have head dim 64). It prints a table and, with --json, writes the rows. Nothing here runs a kernel;
none of it is a timing.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # triton 3.9 warns when unset; 1 is its default

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.autotuner import Autotuner  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from sapiens2 import PRESETS  # noqa: E402
from sapiens2.kernels import attention_triton as attention_triton  # noqa: E402
from sapiens2.kernels import attention_triton_hopper as attention_triton_hopper  # noqa: E402
from sapiens2.kernels.grid_triton import config_label  # noqa: E402
from sapiens2.kernels import qk_norm_rope_triton as qk_norm_rope_triton  # noqa: E402
from sapiens2_app.common import safe_io  # noqa: E402

PRESET_NAMES = ("0.4b", "0.8b", "1b", "5b")
IMAGE = (1024, 768)
BATCH = 8
DTYPE = torch.bfloat16

# ----------------------------------------------------------------------------------------------------
# The launches the dispatch makes, captured from the real launchers on meta tensors
# ----------------------------------------------------------------------------------------------------


def preset_cases(name: str, image=IMAGE, batch=BATCH):
    """(label, B, Hq, Hkv, N, D) for each distinct attention block of a preset: full attention and GQA."""
    config = PRESETS[name]
    grid = (image[0] // config.patch_size) * (image[1] // config.patch_size)
    N = config.num_prefix_tokens + grid
    cases = []
    for kv in sorted(set(config.layer_kv_heads), reverse=True):
        label = "mha" if kv == config.num_heads else f"gqa{config.num_heads // kv}"
        cases.append((label, batch, config.num_heads, kv, N, config.head_dim))
    return cases


def bnhd(B, H, N, D, dtype=DTYPE):
    """What the model's projections hand over: (B, N, H, D) memory viewed as (B, H, N, D)."""
    return torch.empty(B, N, H, D, dtype=dtype, device="meta").transpose(1, 2)


@contextlib.contextmanager
def intercepted(launches: list):
    """Record launches instead of running them; the launchers take their CUDA branches."""
    def autotuned_run(self, *args, **kwargs):
        self.nargs = dict(zip(self.arg_names, args))  # what Autotuner.run sets before pruning
        kept = self.early_config_prune(self.configs, self.nargs, **kwargs) if self.early_config_prune else self.configs
        configs = [(dict(c.kwargs), c.num_warps, c.num_stages, c.maxnreg) for c in kept]
        launches.append((self.fn, args, kwargs, configs))

    def jit_run(self, *args, grid, warmup, **kwargs):
        kwargs = dict(kwargs, grid=grid)
        config = ({}, kwargs.pop("num_warps", 4), kwargs.pop("num_stages", 3), kwargs.pop("maxnreg", None))
        launches.append((self, args, kwargs, [config]))

    hopper = attention_triton_hopper
    saved = (Autotuner.run, JITFunction.run, attention_triton.compiled_for_gpu, hopper._has_tma_engine, hopper.num_sms)
    Autotuner.run, JITFunction.run = autotuned_run, jit_run
    attention_triton.compiled_for_gpu = lambda t: True  # both attention files ask this one
    hopper._has_tma_engine = lambda t: True  # sm_90a
    hopper.num_sms = lambda t: 132  # H100 / H200
    try:
        yield launches
    finally:
        (Autotuner.run, JITFunction.run, attention_triton.compiled_for_gpu, hopper._has_tma_engine,
         hopper.num_sms) = saved


def capture_launches(B, HQ, HKV, N, D, ops=("attention", "qk_norm_rope")):
    """[(pass, fn, args, kwargs, configs)] for one attention block's shapes."""
    rows = []
    q, k, v = bnhd(B, HQ, N, D), bnhd(B, HKV, N, D), bnhd(B, HKV, N, D)
    for module in (attention_triton, attention_triton_hopper) if "attention" in ops else ():
        launches = []
        with intercepted(launches):
            o, lse = module.attention_fwd(q, k, v)
        rows += [("fwd", *launch) for launch in launches]
        launches = []
        with intercepted(launches):
            module.attention_bwd(q, k, v, o, lse, bnhd(B, HQ, N, D))
        seen = {row[1] for row in rows}  # the delta kernel is shared: once
        rows += [("bwd", *launch) for launch in launches if launch[0] not in seen]
    if "qk_norm_rope" in ops:
        P = N - 9
        w = torch.empty(D, dtype=DTYPE, device="meta")
        cos = sin = torch.empty(P, D, dtype=DTYPE, device="meta")
        launches = []
        with intercepted(launches):
            qk_norm_rope_triton.qk_norm_rope_fwd(q, k, w, w, cos, sin)
        rows += [("fwd", *launch) for launch in launches]
        launches = []
        with intercepted(launches):
            qk_norm_rope_triton.qk_norm_rope_bwd(q, k, w, w, cos, sin, bnhd(B, HQ, N, D), bnhd(B, HKV, N, D))
        rows += [("bwd", *launch) for launch in launches]
    return rows


# ----------------------------------------------------------------------------------------------------
# Ahead-of-time compilation with the JIT's specialization
# ----------------------------------------------------------------------------------------------------

_TORCH_TO_TRITON = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int32: "i32",
                    torch.int64: "i64"}


def specialize(value):
    """(type, divisible by 16) of one non-constexpr argument, as the JIT specializes it."""
    if isinstance(value, torch.Tensor):
        aligned = value.device.type == "meta" or value.data_ptr() % 16 == 0  # CUDA allocations: 256-aligned
        return "*" + _TORCH_TO_TRITON[value.dtype], aligned
    if isinstance(value, bool):
        return "u1", False
    if isinstance(value, int):
        if value == 1:
            return "constexpr", False
        return ("i32" if -2**31 <= value < 2**31 else "i64"), value % 16 == 0
    if isinstance(value, float):
        return "fp32", False
    if value is None:
        return "constexpr", False
    raise TypeError(f"cannot specialize {type(value).__name__}")


def bind(fn, args, kwargs, config_kwargs):
    names = fn.arg_names
    bound = dict(zip(names, args))
    bound.update({k: v for k, v in kwargs.items() if k in names})
    bound.update(config_kwargs)
    missing = [n for n in names if n not in bound]
    if missing:
        raise ValueError(f"{fn.__name__}: no value for {missing}")
    return bound


def aot_source(fn, bound):
    signature, constexprs, attrs = {}, {}, {}
    for i, param in enumerate(fn.params):
        value = bound[param.name]
        kind, divisible = ("constexpr", False) if param.is_constexpr else specialize(value)
        signature[param.name] = kind
        if kind == "constexpr":
            constexprs[(i,)] = value
        elif divisible:
            attrs[(i,)] = [["tt.divisibility", 16]]
    return ASTSource(fn, signature, constexprs=constexprs, attrs=attrs), signature, constexprs, attrs


def nvidia_tool(name: str) -> str:
    """A tool from the triton wheel (triton/backends/nvidia/bin), else from PATH."""
    candidate = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    if candidate.exists():
        return str(candidate)
    found = shutil.which(name)
    if found:
        return found
    raise FileNotFoundError(f"{name} is neither in {candidate.parent} nor on PATH (it ships with the triton wheel)")


def ptxas_for(arch: str) -> str:
    """The ptxas Triton itself assembles with for this target (triton 3.9 uses `ptxas-blackwell` from sm_90
    on; its PTX version is too new for the older `ptxas` beside it)."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        return get_ptxas(parse_arch(arch)).path
    except (ImportError, TypeError, AttributeError):
        return nvidia_tool("ptxas")


def parse_arch(arch: str) -> int:
    match = re.fullmatch(r"sm_(\d+)a?", arch)
    if not match:
        raise ValueError(f"--arch {arch!r}: expected e.g. sm_90a")
    return int(match[1])


# ----------------------------------------------------------------------------------------------------
# Reading the machine code
# ----------------------------------------------------------------------------------------------------

_SASS_OP = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)")


def sass_counts(sass: str) -> dict:
    counts = dict.fromkeys(("hgmma", "ldl", "stl", "ldg_16bit", "ldg_128bit", "ldgsts", "utmaldg", "stg_16bit"), 0)
    for opcode in _SASS_OP.findall(sass):
        parts = opcode.split(".")
        head = parts[0]
        if head == "HGMMA":
            counts["hgmma"] += 1
        elif head in ("LDL", "STL"):
            counts[head.lower()] += 1
        elif head == "LDG":
            counts["ldg_16bit"] += ("U16" in parts or "S16" in parts)
            counts["ldg_128bit"] += "128" in parts
        elif head == "STG":
            counts["stg_16bit"] += ("U16" in parts or "S16" in parts)
        elif head == "LDGSTS":
            counts["ldgsts"] += 1
        elif head == "UTMALDG":
            counts["utmaldg"] += 1
    return counts


_SASS_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")


def _instructions(sass: str) -> list[tuple[int, str, str]]:
    return [(int(a, 16), op, args.strip()) for a, op, args in _SASS_INSTRUCTION.findall(sass)]


def _loop_bodies(instructions) -> list[list[tuple[str, str]]]:
    """The (opcode, operands) of each loop: a backward branch's target up to the branch, excluding bodies with an
    EXIT (the retry stubs of barrier waits, placed after the exit, branch back into the code)."""
    bodies = []
    for address, op, args in instructions:
        target = re.match(r"(0x[0-9a-f]+)", args) if op == "BRA" else None
        if target and int(target[1], 16) < address:
            body = [(o, a) for at, o, a in instructions if int(target[1], 16) <= at <= address]
            if all(o != "EXIT" for o, _ in body):
                bodies.append(body)
    return bodies


def softmax_overlap(sass: str) -> dict:
    """How much of the softmax runs while a wgmma is in flight, read from the SASS of the kernel's loops.

    Loops with both HGMMA and MUFU.EX2 (the exp2 of the softmax) count. A wgmma group is in flight from its last
    HGMMA (the one marked gsb0) until a WARPGROUP.DEPBAR.LE lowers the outstanding count below it. The body is
    scanned twice and the second pass counted, so that a wgmma issued at the end of an iteration counts as in
    flight at the start of the next one. `loop_ex2_under_wgmma == loop_ex2` means every exp2 of the loop overlaps a
    tensor-core MMA (FlashAttention-3's intra-warpgroup overlap); 0 means the MMAs and the softmax alternate.
    `loop_local_memory`: LDL/STL inside any loop (local memory outside the loops costs once per program)."""
    total = overlapped = 0
    bodies = _loop_bodies(_instructions(sass))
    for body in bodies:
        ops = [op for op, _ in body]
        if "MUFU.EX2" not in ops or not any(op.startswith("HGMMA") for op in ops):
            continue
        in_flight = 0
        for counting in (False, True):
            for op, args in body:
                if op.startswith("HGMMA") and "gsb0" in args:
                    in_flight += 1
                elif op == "WARPGROUP.DEPBAR.LE":
                    in_flight = min(in_flight, int(args.rsplit(",", 1)[-1], 16))
                elif op == "MUFU.EX2" and counting:
                    total += 1
                    overlapped += in_flight > 0
    local = sum(op.split(".")[0] in ("LDL", "STL") for body in bodies for op, _ in body)
    return {"loop_ex2": total, "loop_ex2_under_wgmma": overlapped, "loop_local_memory": local}


def ptxas_report(ptx: str, arch: str, workdir: pathlib.Path) -> dict:
    """registers, spill bytes and shared memory from `ptxas -v` on the PTX Triton produced."""
    path = workdir / "kernel.ptx"
    path.write_text(ptx)
    proc = subprocess.run([ptxas_for(arch), "-v", f"--gpu-name={arch}", str(path), "-o", str(workdir / "k.o")],
                          capture_output=True, text=True, timeout=600)
    if proc.returncode:
        raise RuntimeError(f"ptxas failed: {proc.stderr[-2000:]}")
    log = proc.stderr + proc.stdout
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    regs = re.search(r"Used (\d+) registers", log)
    return {"registers": int(regs[1]) if regs else None,
            "spill_store_bytes": int(spills[1]) if spills else None,
            "spill_load_bytes": int(spills[2]) if spills else None}


def inspect_compiled(kernel, arch: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        workdir = pathlib.Path(tmp)
        cubin = workdir / "kernel.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        sass = subprocess.run([nvidia_tool("cuobjdump"), "--dump-sass", str(cubin)], capture_output=True,
                              text=True, check=True, timeout=600).stdout
        report = ptxas_report(kernel.asm["ptx"], arch, workdir)
    return {**report, "shared_bytes": kernel.metadata.shared, **sass_counts(sass), **softmax_overlap(sass)}


# ----------------------------------------------------------------------------------------------------
# Driver
# ----------------------------------------------------------------------------------------------------


def constexpr_summary(fn, constexprs):
    """The constexprs by name, JSON-friendly (strings for dtypes and other objects)."""
    out = {}
    for (i,), value in constexprs.items():
        out[fn.arg_names[i]] = value if isinstance(value, (int, float, str, bool, type(None))) else str(value)
    return out


def constexprs_by_name(fn, constexprs):
    return {fn.arg_names[i]: value for (i,), value in constexprs.items()}


def kv_traffic(name, consts, B, HQ, N, D) -> dict:
    """Attention forward: query rows and heads per tile, and the K/V bytes each tile loads (every tile streams
    all N keys and values of its K/V head, D columns of bf16 each) and all tiles together (a persistent program
    walks several tiles: the total is the same). This is what GQA packing (PACK) changes: a packed tile holds the
    GROUP heads of one K/V head, so a K/V tile serves GROUP heads per load."""
    if name not in ("_attn_fwd_kernel", "_attn_fwd_hopper_kernel"):
        return {}
    heads = consts["GROUP"] if consts.get("PACK") else 1
    tokens = consts["BLOCK_M"] // heads
    per_tile = 2 * N * D * DTYPE.itemsize
    tiles = -(-N // tokens) * B * HQ // heads
    return {"query_heads_per_program": heads, "tokens_per_program": tokens,
            "kv_bytes_per_program": per_tile, "kv_bytes_total": per_tile * tiles}


def inspect(presets, arch, only=None, first_config=False, ops=("attention", "qk_norm_rope"), blocks=None, log=print,
            cfg=None):
    """The rows for these presets; `only` (regex on kernel names), `first_config`, `ops`, `blocks` ("mha",
    "gqa2", ...) and `cfg` (regex on config_label, e.g. "256x64w8s2p") select a subset."""
    target = GPUTarget("cuda", parse_arch(arch), 32)
    compiled: dict[str, dict] = {}  # identical compilations are shared
    rows = []
    for preset in presets:
        for label, B, HQ, HKV, N, D in preset_cases(preset):
            if blocks and label not in blocks:
                continue
            for pas, fn, args, kwargs, configs in capture_launches(B, HQ, HKV, N, D, ops):
                name = fn.__name__
                if only and not re.search(only, name):
                    continue
                for config_kwargs, num_warps, num_stages, maxnreg in configs[:1] if first_config else configs:
                    cfg_label = config_label({**kwargs, **config_kwargs}, num_warps, num_stages, maxnreg)
                    if cfg and not re.search(cfg, cfg_label):
                        continue
                    bound = bind(fn, args, kwargs, config_kwargs)
                    src, signature, constexprs, attrs = aot_source(fn, bound)
                    key = json.dumps([name, signature, sorted(map(str, constexprs.items())), sorted(map(str, attrs)),
                                      num_warps, num_stages, maxnreg])
                    if key not in compiled:
                        t = time.time()
                        options = {"num_warps": num_warps, "num_stages": num_stages}
                        if maxnreg:
                            options["maxnreg"] = maxnreg
                        kernel = triton.compile(src, target=target, options=options)
                        report = inspect_compiled(kernel, arch)
                        compiled[key] = {**report, "ctas_per_sm": ctas_per_sm(report, num_warps),
                                         "compile_s": round(time.time() - t, 1)}
                    grid = kwargs["grid"]
                    grid = grid(bound) if callable(grid) else grid
                    row = {"name": name, "preset": preset, "block": label, "pass": pas, "B": B, "Hq": HQ, "Hkv": HKV,
                           "N": N, "D": D, "dtype": str(DTYPE).replace("torch.", ""),
                           "constexprs": constexpr_summary(fn, constexprs), "num_warps": num_warps,
                           "num_stages": num_stages, "maxnreg": maxnreg, "grid": list(grid),
                           "divisible_by_16": [fn.arg_names[i] for (i,) in attrs],
                           **kv_traffic(name, constexprs_by_name(fn, constexprs), B, HQ, N, D),
                           **compiled[key]}
                    rows.append(row)
                    log(format_row(row))
    return rows


# Hopper (sm_90) per SM: 65,536 registers, allocated per warp in units of 256 (8 per thread); 228 KiB of shared
# memory of which 227 KiB per block, 1 KiB reserved per resident block; 64 warps.
SM_REGISTERS, SM_SHARED_BYTES, BLOCK_RESERVED_SHARED, SM_WARPS = 65536, 228 * 1024, 1024, 64


def ctas_per_sm(report: dict, num_warps: int) -> int:
    """How many programs of this kernel fit one Hopper SM at once (registers, shared memory, warps): 1 means
    the SM's latency hiding is all inside one program."""
    regs = -(-report["registers"] // 8) * 8
    by_registers = SM_REGISTERS // (regs * 32 * num_warps)
    by_shared = SM_SHARED_BYTES // (report["shared_bytes"] + BLOCK_RESERVED_SHARED)
    return min(by_registers, by_shared, SM_WARPS // num_warps)


COLUMNS = [("preset", 5), ("block", 5), ("name", 29), ("cfg", 18), ("regs", 4), ("spill", 5), ("smem", 6),
           ("cta/sm", 6), ("hgmma", 5), ("ldl/stl", 7), ("ldg16", 5), ("ldg128", 6), ("ldgsts", 6), ("utmaldg", 7),
           ("ex2@mma", 7), ("kvGB", 5)]


def format_row(r) -> str:
    cfg = config_label(r["constexprs"], r["num_warps"], r["num_stages"], r.get("maxnreg"))
    kv = f"{r['kv_bytes_total'] / 1e9:.2f}" if "kv_bytes_total" in r else ""
    spill = (r["spill_store_bytes"] or 0) + (r["spill_load_bytes"] or 0)
    cells = [r["preset"], r["block"], r["name"], cfg, r["registers"], spill, r["shared_bytes"], r["ctas_per_sm"],
             r["hgmma"], f"{r['ldl']}/{r['stl']}", r["ldg_16bit"], r["ldg_128bit"], r["ldgsts"], r["utmaldg"],
             f"{r['loop_ex2_under_wgmma']}/{r['loop_ex2']}" if r["loop_ex2"] else "", kv]
    return "  ".join(str(v).ljust(w) for v, (_, w) in zip(cells, COLUMNS))


def header() -> str:
    return "  ".join(name.ljust(w) for name, w in COLUMNS)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="sm_90a", help="target, e.g. sm_90a (Hopper: H100/H200)")
    ap.add_argument("--json", type=pathlib.Path, default=None, help="write the rows here")
    ap.add_argument("--presets", default=",".join(PRESET_NAMES), help="comma-separated (default: %(default)s)")
    ap.add_argument("--ops", default="attention,qk_norm_rope")
    ap.add_argument("--only", default=None, help="regex on the kernel name, e.g. attn_fwd")
    ap.add_argument("--first-config", action="store_true", help="only the first autotune configuration")
    ap.add_argument("--blocks", default=None, help="comma-separated block kinds: mha, gqa2 (default: all)")
    ap.add_argument("--cfg", default=None, help="regex on the configuration label, e.g. '256x64w8s2p$' (p: packed)")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        ap.error("TRITON_INTERPRET is set: interpreted kernels cannot be compiled; unset it")
    presets = [p for p in args.presets.split(",") if p]
    unknown = [p for p in presets if p not in PRESETS]
    if unknown:
        ap.error(f"unknown presets {unknown}; choose from {', '.join(PRESETS)}")
    t0 = time.time()
    print(header())
    blocks = tuple(args.blocks.split(",")) if args.blocks else None
    rows = inspect(presets, args.arch, args.only, args.first_config, tuple(args.ops.split(",")), blocks, cfg=args.cfg)
    print(f"{len(rows)} rows in {time.time() - t0:.0f} s (triton {triton.__version__}, {args.arch}, no GPU)")
    if args.json:
        info = {"arch": args.arch, "triton": triton.__version__, "torch": torch.__version__,
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "image": list(IMAGE), "batch": BATCH, "dtype": str(DTYPE).replace("torch.", ""),
                "note": "ahead-of-time compilation without a GPU: register/spill/SASS evidence, no timings"}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(safe_io.json_text({**info, "rows": rows}, indent=1) + "\n")
        print(f"wrote {args.json}")
    return rows


if __name__ == "__main__":
    main()
