"""What distillation buys: a 0.1b student beside its 0.4b and 1b teachers, each measured in a fresh process.

    nice python bench/distill.py                                  # seg, CPU, 512x384 and 1024x768
    python bench/distill.py --device cuda --dtype bf16 --reps 20  # adds images/s on a GPU
    python bench/distill.py --skip 1b@1024x768                    # FLOPs only for that pair (minutes per call on CPU)
    python bench/distill.py --teachers 0.4b --sizes 512x384 --onnx  # adds the student exported to ONNX, fp32 and int8

Every model gets random weights with the released architecture (heads.py's presets; nothing is downloaded); the
0.1b student has the head train.py gives it (heads.default_head: the 0.4b head, its widths scaled by 768 / 1024).
Per model and input size: parameters, FLOPs (bench/e2e_models.py's count_flops: 2 per multiply-add, every linear and
conv plus 4 N^2 d per attention head), the median latency of `--reps` calls after `--warmup` (bench/e2e_measure.py's
time_calls) and, on CPU, the median CPU time of the same calls (time.process_time: what the call consumed, which
other processes on a shared machine do not inflate as they do the wall time). Then each teacher's cost over the
student's, as ratios: of CPU time on CPU (of wall time on CUDA), and of FLOPs.
Memory: each timed row runs in a fresh child process (this file with --child), so that no model's freed memory,
kept by the allocator for reuse, hides the next one's. With the model loaded and the input made, the child reads
its RSS (rss_loaded_mb: the weights and the runtime) and resets its peak RSS; after the calls (warm-up and timed),
peak_mb is how far the peak went above it: the most the calls held at once (activations, workspaces, the runtime's
arenas). On Linux the peak is VmHWM, reset through /proc/self/clear_refs (bench/e2e_measure.py's CpuRssPeak, which
says its method in memory_method; elsewhere it is the lifetime peak, an upper bound). On CUDA: the growth of
torch.cuda.max_memory_allocated over the memory allocated before the calls.
`--onnx`: the student also exported by export.py (a subprocess: commands are not imported), as fp32 ONNX and with
`--quantize int8`, each timed in onnxruntime on CPU (its default threads) in a child process, with its agreement on
one seeded input: largest difference from the eager output and from fp32 ONNX, and for seg the share of pixels of
the same class. export.py's own int8-vs-fp32 line (on its check input) is kept in the JSON.
Results: bench/results/distill-<device>.json and .md (device, versions and the load average beside the numbers: a
shared machine slows every row).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.append(str(ROOT / "bench"))  # after the root, so bench/kernels.py cannot shadow kernels/

from sapiens2 import Sapiens2Config, heads, weights  # noqa: E402
from e2e_measure import CpuRssPeak, device_name, device_slug, time_calls  # noqa: E402
from e2e_models import DTYPES, count_flops  # noqa: E402
from sapiens2_app.common import safe_io  # noqa: E402
from sapiens2_app.common.runtime_info import versions  # noqa: E402
from sapiens2_app.export.formats import onnx_bytes  # noqa: E402

STUDENT = "0.1b"
ONNX_KINDS = ("fp32", "int8")  # the student's ONNX exports: export.py plain, and with --quantize int8


def build(size_name: str, task: str, size: tuple[int, int]) -> torch.nn.Module:
    """The task model of `size_name` at input `size`: the released head, or for the student train.py's default."""
    config = Sapiens2Config.from_preset(size_name, image_size=tuple(size))
    return heads.build_task_model(config, heads.default_head(task, config))


# ----------------------------------------------------------------------------------------------------
# The child process: one model (eager or ONNX) at one size, timed, its peak memory read
# ----------------------------------------------------------------------------------------------------


def child(spec: dict) -> dict:
    """Load what `spec` names, then time its calls and measure the memory they take (the module docstring)."""
    if spec["kind"] == "eager":
        warm_up_process(spec)
    call, saves_output = eager_call(spec) if spec["kind"] == "eager" else onnx_call(spec)
    cpu_seconds = []

    def timed():
        start = time.process_time()
        call()
        cpu_seconds.append(time.process_time() - start)
    with torch.inference_mode():
        if spec["device"] == "cuda":
            row = cuda_measure(timed, spec)
        else:
            with CpuRssPeak() as rss:
                times = time_calls(timed, "cpu", spec["warmup"], spec["reps"])
            loaded_mb = None if rss.before_kb is None else rss.before_kb / 1024  # None: no /proc (not Linux)
            row = {"times_ms": times, "rss_loaded_mb": loaded_mb, "peak_mb": rss.peak_mb,
                   "memory_method": f"peak RSS above the RSS with the model loaded, one process per row: {rss.method}",
                   "median_cpu_s": statistics.median(cpu_seconds[spec["warmup"]:])}
        if saves_output:  # the output of the seeded input, for the agreement (ONNX rows)
            import numpy as np

            np.save(spec["output"], call())
    row.update(median_ms=statistics.median(row["times_ms"]), warmup=spec["warmup"], reps=spec["reps"])
    row["images_per_s"] = 1e3 / row["median_ms"]
    return row


def warm_up_process(spec: dict):
    """The process's one-time costs (thread pools, first-call dispatch) go to no row: a tiny student call first."""
    dtype = DTYPES[spec["dtype"]]
    with torch.inference_mode():
        build(STUDENT, spec["task"], (64, 48)).to(spec["device"], dtype)(
            torch.rand(1, 3, 64, 48, device=spec["device"], dtype=dtype))


def eager_call(spec: dict):
    dtype = DTYPES[spec["dtype"]]
    model = build(spec["name"], spec["task"], spec["size"]).to(spec["device"], dtype).eval()
    pixels = torch.rand(1, 3, *spec["size"], device=spec["device"], dtype=dtype)
    return (lambda: model(pixels)), False


def onnx_call(spec: dict):
    import numpy as np
    import onnxruntime

    session = onnxruntime.InferenceSession(spec["path"], providers=["CPUExecutionProvider"])
    feed = {session.get_inputs()[0].name: np.load(spec["pixels"])}
    return (lambda: session.run(None, feed)[0]), True  # the first output (seg: logits)


def cuda_measure(timed, spec: dict) -> dict:
    torch.cuda.synchronize()
    loaded = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = time_calls(timed, "cuda", spec["warmup"], spec["reps"])
    return {"times_ms": times, "rss_loaded_mb": None, "cuda_loaded_mb": loaded / 2**20,
            "peak_mb": (torch.cuda.max_memory_allocated() - loaded) / 2**20,
            "memory_method": "torch.cuda.max_memory_allocated over the calls - memory_allocated before them"}


def in_child(spec: dict) -> dict:
    """child(spec) in a fresh Python process; its row comes back as the last line of its stdout."""
    done = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], check=True, stdout=subprocess.PIPE,
                          text=True)
    return json.loads(done.stdout.splitlines()[-1])


# ----------------------------------------------------------------------------------------------------
# The rows
# ----------------------------------------------------------------------------------------------------


def eager_row(name: str, size, size_text: str, skip: set, args) -> dict:
    row = {"model": f"{args.task}-{name}", "size": name, "input": size_text,
           **count_flops(name, args.task, 1, size, args.dtype, build)}  # and params: built on the meta device
    row["weights_mb"] = row["params"] * DTYPES[args.dtype].itemsize / 2**20
    if f"{name}@{size_text}" not in skip:
        row.update(in_child({"kind": "eager", "name": name, "task": args.task, "size": size, "device": args.device,
                             "dtype": args.dtype, "warmup": args.warmup, "reps": args.reps}))
        print(f"{row['model']} {size_text}: {row['median_ms']:.0f} ms, {number(row.get('median_cpu_s'), '.1f')} CPU "
              f"s, peak {number(row['peak_mb'], '.0f')} MiB above the loaded model", file=sys.stderr)
    return row


def onnx_rows(size, size_text: str, args) -> list[dict]:
    """The student (random weights, seed 0) through export.py, fp32 and --quantize int8, each timed in
    onnxruntime on CPU in a child process, with its agreement with eager (and int8's with fp32) on a seeded input."""
    import numpy as np

    torch.manual_seed(0)
    model = build(STUDENT, args.task, size).eval()
    pixels = torch.rand(1, 3, *size, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        eager = next(iter(vars(model(pixels)).values())).numpy()  # the first output (seg: logits)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        folder = pathlib.Path(folder)
        weights.save(model, folder / "student")
        np.save(folder / "pixels.npy", pixels.numpy())
        for kind in ONNX_KINDS:
            rows.append(onnx_row(kind, size, size_text, folder, args))
        outputs = {kind: np.load(folder / f"{kind}.out.npy") for kind in ONNX_KINDS}
    for row, kind in zip(rows, ONNX_KINDS):
        row.update(params=sum(p.numel() for p in model.parameters()), flops=None,
                   agreement_with_eager=agreement(args.task, outputs[kind], eager))
        if kind != "fp32":
            row["agreement_with_fp32_onnx"] = agreement(args.task, outputs[kind], outputs["fp32"])
    return rows


def onnx_row(kind: str, size, size_text: str, folder: pathlib.Path, args) -> dict:
    path = folder / f"student-{kind}.onnx"
    quantize = [] if kind == "fp32" else ["--quantize", kind]
    done = subprocess.run([sys.executable, str(ROOT / "export.py"), args.task, "--model", str(folder / "student"),
                           "--format", "onnx", "-o", str(path), "--size", size_text, *quantize],
                          check=True, stdout=subprocess.PIPE, text=True)
    row = {"model": f"{args.task}-{STUDENT} ONNX {kind} (onnxruntime)", "size": f"onnx-{kind}", "input": size_text,
           "onnx_mb": onnx_bytes(path) / 2**20,
           "export_check": done.stdout.strip().splitlines()}
    row.update(in_child({"kind": "onnx", "path": str(path), "pixels": str(folder / "pixels.npy"),
                         "output": str(folder / f"{kind}.out.npy"), "task": args.task, "device": "cpu",
                         "dtype": "fp32", "warmup": args.warmup, "reps": args.reps}))
    print(f"{row['model']} {size_text}: {row['median_ms']:.0f} ms, peak {number(row['peak_mb'], '.0f')} MiB above "
          f"the loaded model", file=sys.stderr)
    return row


def agreement(task: str, got, want) -> dict:
    """Largest and mean absolute difference of two first outputs; seg: the share of pixels of the same class."""
    import numpy as np

    difference = np.abs(got.astype(np.float64) - want)
    numbers = {"max_abs_difference": float(difference.max()), "mean_abs_difference": float(difference.mean())}
    if task == "seg":
        numbers["same_class_pixels"] = float((got.argmax(1) == want.argmax(1)).mean())
    return numbers


def add_ratios(rows: list[dict]):
    """Each row's cost over the student's at the same input: FLOPs, and time where both were timed."""
    students = {row["input"]: row for row in rows if row["size"] == STUDENT}
    for row in rows:
        student = students[row["input"]]
        row["flops_ratio"] = row["flops"] / student["flops"] if row["flops"] else None
        key = "median_cpu_s" if "median_cpu_s" in student else "median_ms"
        if key in row and key in student:
            row["time_ratio"] = row[key] / student[key]


# ----------------------------------------------------------------------------------------------------
# Command line and report
# ----------------------------------------------------------------------------------------------------


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--task", default="seg", choices=heads.TASKS)
    parser.add_argument("--teachers", default="0.4b,1b", help="comma-separated sizes ('' for none)")
    parser.add_argument("--sizes", default="512x384,1024x768", help="input sizes HxW")
    parser.add_argument("--skip", default="", help="MODEL@HxW pairs to count but not time, comma-separated")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    parser.add_argument("--warmup", type=int, default=0, help="untimed calls first (CPU: none needed)")
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--onnx", action="store_true", help="also the student exported to ONNX (fp32, int8), in "
                                                            "onnxruntime")
    parser.add_argument("--out", type=pathlib.Path)
    parser.add_argument("--child", help=argparse.SUPPRESS)  # JSON: one row, measured in this process
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    skip = set(filter(None, args.skip.split(",")))
    rows = []
    for size_text in args.sizes.split(","):
        size = tuple(int(v) for v in size_text.split("x"))
        rows += [eager_row(name, size, size_text, skip, args)
                 for name in [STUDENT, *filter(None, args.teachers.split(","))]]
        if args.onnx:
            rows += onnx_rows(size, size_text, args)
    add_ratios(rows)
    data = {"device": device_name(args.device), "dtype": args.dtype, "versions": versions() | onnx_versions(args),
            "command": shlex.join(["bench/distill.py", *(argv if argv is not None else sys.argv[1:])]),
            "load_average_at_end": os.getloadavg(), "rows": rows}
    out = args.out or ROOT / "bench" / "results" / f"distill-{device_slug(args.device)}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(safe_io.json_text(data, indent=1))
    out.with_suffix(".md").write_text(markdown(data))
    print(markdown(data))


def onnx_versions(args) -> dict:
    if not args.onnx:
        return {}
    import onnx
    import onnxruntime

    return {"onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__}


def markdown(data: dict) -> str:
    runtime = f", onnxruntime {data['versions']['onnxruntime']}" if "onnxruntime" in data["versions"] else ""
    lines = [f"{data['device']}, {data['dtype']}, torch {data['versions']['torch']}{runtime}, load average at the end "
             f"{data['load_average_at_end'][0]:.1f}; `{data.get('command', 'bench/distill.py')}`", "",
             "| model | input | params | GFLOPs | ms (median) | CPU s (median) | images/s | RSS loaded MiB | peak MiB "
             "above loaded | x student (CPU time, or time on GPU) | x student (FLOPs) |", "|---" * 11 + "|"]
    for row in data["rows"]:
        timed = "median_ms" in row
        lines.append(
            f"| {row['model']} | {row['input']} | {row['params'] / 1e6:.1f} M | {number(row['flops'], '.0f', 1e9)} | "
            f"{row['median_ms']:.0f} | {number(row.get('median_cpu_s'), '.1f')} | {row['images_per_s']:.2f} | "
            f"{number(row.get('rss_loaded_mb'), '.0f')} | {number(row.get('peak_mb'), '.0f')} | " if timed
            else f"| {row['model']} | {row['input']} | {row['params'] / 1e6:.1f} M | "
                 f"{number(row['flops'], '.0f', 1e9)} | - | - | - | - | - | ")
        lines[-1] += f"{number(row.get('time_ratio'), '.2f')} | {number(row['flops_ratio'], '.2f')} |"
    timed = [row for row in data["rows"] if "median_ms" in row]
    if timed:
        reps = sorted({(row["warmup"], row["reps"]) for row in timed})
        lines += ["", "Calls per timed row (warm-up, timed): " + ", ".join(f"{w}, {r}" for w, r in reps) +
                  f". Memory: {timed[0]['memory_method']}."]
    lines += ["", *(onnx_text(row) for row in data["rows"] if "agreement_with_eager" in row)]
    return "\n".join(lines) + "\n"


def onnx_text(row: dict) -> str:
    def agreement_text(numbers: dict) -> str:
        text = f"max |difference| {numbers['max_abs_difference']:.1e}, mean {numbers['mean_abs_difference']:.1e}"
        if "same_class_pixels" in numbers:
            text += f", {100 * numbers['same_class_pixels']:.2f}% of pixels of the same class"
        return text
    text = (f"- {row['model']} at {row['input']} ({row['onnx_mb']:.0f} MiB file): vs eager "
            f"{agreement_text(row['agreement_with_eager'])}")
    if "agreement_with_fp32_onnx" in row:
        text += f"; vs fp32 ONNX {agreement_text(row['agreement_with_fp32_onnx'])}"
    return text


def number(value, spec: str, unit: float = 1.0) -> str:
    return "-" if value is None else format(value / unit, spec)


if __name__ == "__main__":
    main()
