"""What distillation buys: a 0.1b student beside its 0.4b and 1b teachers, side by side in one process.

    nice python bench/distill.py                                  # seg, CPU, 512x384 and 1024x768
    python bench/distill.py --device cuda --dtype bf16 --reps 20  # adds images/s on a GPU
    python bench/distill.py --skip 1b@1024x768                    # FLOPs only for that pair (minutes per call on CPU)
    python bench/distill.py --teachers 0.4b --sizes 512x384 --onnx  # adds the student exported to ONNX (fp32)

Every model gets random weights with the released architecture (heads.py's presets; nothing is downloaded); the
0.1b student has the head train.py gives it (heads.default_head: the 0.4b head, its widths scaled by 768 / 1024).
Per model and input size: parameters, FLOPs (bench/e2e_models.py's count_flops: 2 per multiply-add, every linear and
conv plus 4 N^2 d per attention head), the median latency of `--reps` calls after `--warmup` (bench/e2e_measure.py's
time_calls) and, on CPU, the median CPU time of the same calls (time.process_time: what the call consumed, which
other processes on a shared machine do not inflate as they do the wall time) and the peak of the bytes the call
allocated (cpu_allocation_peak_mb, beside the weights); on CUDA, torch.cuda.max_memory_allocated. Then each
teacher's cost over the student's, as ratios: of CPU time on CPU (of wall time on CUDA), and of FLOPs.
`--onnx`: the student also exported by export.py (fp32 ONNX, a subprocess: commands are not imported) and timed in
onnxruntime on CPU (its default threads), with its largest difference from the eager output. export.py has no
quantized (int8) option yet, so no int8 row.
Results: bench/results/distill-<device>.json and .md (device, versions and the load average beside the numbers: a
shared machine slows every row).
"""

from __future__ import annotations

import argparse
import os
import pathlib
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
from e2e_measure import cpu_allocation_peak_mb, device_name, device_slug, time_calls  # noqa: E402
from e2e_models import DTYPES, count_flops  # noqa: E402
from sapiens2_app.common import safe_io  # noqa: E402
from sapiens2_app.common.runtime_info import versions  # noqa: E402

STUDENT = "0.1b"


def build(size_name: str, task: str, size: tuple[int, int]) -> torch.nn.Module:
    """The task model of `size_name` at input `size`: the released head, or for the student train.py's default."""
    config = Sapiens2Config.from_preset(size_name, image_size=tuple(size))
    return heads.build_task_model(config, heads.default_head(task, config))


def measure(model, size, args) -> dict:
    dtype = DTYPES[args.dtype]
    model = model.to(args.device, dtype).eval()
    pixels = torch.rand(1, 3, *size, device=args.device, dtype=dtype)
    cpu_seconds = []

    def call():
        start = time.process_time()
        model(pixels)
        cpu_seconds.append(time.process_time() - start)
    with torch.inference_mode():
        times = time_calls(call, args.device, args.warmup, args.reps)
        row = {"times_ms": times, "median_ms": statistics.median(times)}
        if args.device != "cuda":
            row["median_cpu_s"] = statistics.median(cpu_seconds[args.warmup:])
        if args.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
            model(pixels)
            row["peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
        elif args.memory:  # one more call, under the profiler
            row["peak_mb"] = cpu_allocation_peak_mb(lambda: model(pixels))
    row["images_per_s"] = 1e3 / row["median_ms"]
    return row


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
    parser.add_argument("--no-memory", dest="memory", action="store_false",
                        help="CPU: no peak-memory call (it costs one more call per row)")
    parser.add_argument("--onnx", action="store_true", help="also the student exported to ONNX, in onnxruntime")
    parser.add_argument("--out", type=pathlib.Path)
    args = parser.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))
    with torch.inference_mode():  # the process's one-time costs (thread pools, first-call dispatch) go to no row
        build(STUDENT, args.task, (64, 48)).to(args.device, DTYPES[args.dtype])(
            torch.rand(1, 3, 64, 48, device=args.device, dtype=DTYPES[args.dtype]))
    rows = []
    for size_text in args.sizes.split(","):
        size = tuple(int(v) for v in size_text.split("x"))
        for name in [STUDENT, *filter(None, args.teachers.split(","))]:
            row = {"model": f"{args.task}-{name}", "size": name, "input": size_text,
                   **count_flops(name, args.task, 1, size, args.dtype, build)}
            model = build(name, args.task, size)
            row["params"] = sum(p.numel() for p in model.parameters())
            row["weights_mb"] = sum(p.numel() for p in model.parameters()) * DTYPES[args.dtype].itemsize / 2**20
            if f"{name}@{size_text}" not in skip:
                row.update(measure(model, size, args))
                print(f"{row['model']} {size_text}: {row['median_ms']:.0f} ms, {row.get('median_cpu_s', 0):.1f} CPU s",
                      file=sys.stderr)
            del model
            rows.append(row)
        if args.onnx:
            rows.append(onnx_row(size, size_text, args))
    add_ratios(rows)
    data = {"device": device_name(args.device), "dtype": args.dtype, "versions": versions(),
            "load_average_at_end": os.getloadavg(), "rows": rows}
    out = args.out or ROOT / "bench" / "results" / f"distill-{device_slug(args.device)}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(safe_io.json_text(data, indent=1))
    out.with_suffix(".md").write_text(markdown(data))
    print(markdown(data))


def onnx_row(size, size_text: str, args) -> dict:
    """The student (random weights, seed 0) through export.py --format onnx, timed in onnxruntime on CPU."""
    import numpy as np
    import onnxruntime

    torch.manual_seed(0)
    model = build(STUDENT, args.task, size).eval()
    with tempfile.TemporaryDirectory() as folder:
        source, path = pathlib.Path(folder) / "student", pathlib.Path(folder) / "student.onnx"
        weights.save(model, source)
        subprocess.run([sys.executable, str(ROOT / "export.py"), args.task, "--model", str(source), "--format", "onnx",
                        "-o", str(path), "--size", size_text], check=True)
        session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        pixels = torch.rand(1, 3, *size)
        feed = {session.get_inputs()[0].name: pixels.numpy()}
        cpu_seconds = []

        def call():
            start = time.process_time()
            session.run(None, feed)
            cpu_seconds.append(time.process_time() - start)
        times = time_calls(call, "cpu", args.warmup, args.reps)
        with torch.inference_mode():
            eager = next(iter(vars(model(pixels)).values())).numpy()  # the first output (seg: logits)
        difference = float(np.abs(session.run(None, feed)[0] - eager).max())
    print(f"{args.task}-{STUDENT} ONNX {size_text}: {statistics.median(times):.0f} ms", file=sys.stderr)
    return {"model": f"{args.task}-{STUDENT} ONNX fp32 (onnxruntime)", "size": "onnx", "input": size_text,
            "params": sum(p.numel() for p in model.parameters()), "flops": None, "times_ms": times,
            "median_ms": statistics.median(times), "images_per_s": 1e3 / statistics.median(times),
            "median_cpu_s": statistics.median(cpu_seconds[args.warmup:]),
            "max_abs_difference_from_eager": difference}


def add_ratios(rows: list[dict]):
    """Each row's cost over the student's at the same input: FLOPs, and time where both were timed."""
    students = {row["input"]: row for row in rows if row["size"] == STUDENT}
    for row in rows:
        student = students[row["input"]]
        row["flops_ratio"] = row["flops"] / student["flops"] if row["flops"] else None
        key = "median_cpu_s" if "median_cpu_s" in student else "median_ms"
        if key in row and key in student:
            row["time_ratio"] = row[key] / student[key]


def markdown(data: dict) -> str:
    lines = [f"{data['device']}, {data['dtype']}, torch {data['versions']['torch']}, load average at the end "
             f"{data['load_average_at_end'][0]:.1f}", "",
             "| model | input | params | GFLOPs | ms (median) | CPU s (median) | images/s | peak MiB (allocated by the "
             "call) | x student (CPU time, or time on GPU) | x student (FLOPs) |", "|---" * 10 + "|"]
    for row in data["rows"]:
        timed = "median_ms" in row
        lines.append(
            f"| {row['model']} | {row['input']} | {row['params'] / 1e6:.1f} M | {number(row['flops'], '.0f', 1e9)} | "
            f"{row['median_ms']:.0f} | {number(row.get('median_cpu_s'), '.1f')} | {row['images_per_s']:.2f} | "
            f"{number(row.get('peak_mb'), '.0f')} | " if timed
            else f"| {row['model']} | {row['input']} | {row['params'] / 1e6:.1f} M | "
                 f"{number(row['flops'], '.0f', 1e9)} | - | - | - | - | ")
        lines[-1] += f"{number(row.get('time_ratio'), '.2f')} | {number(row['flops_ratio'], '.2f')} |"
    onnx = [row for row in data["rows"] if "max_abs_difference_from_eager" in row]
    lines += [f"\n{row['model']} at {row['input']}: largest difference from eager "
              f"{row['max_abs_difference_from_eager']:.1e}" for row in onnx]
    return "\n".join(lines) + "\n"


def number(value, spec: str, unit: float = 1.0) -> str:
    return "-" if value is None else format(value / unit, spec)


if __name__ == "__main__":
    main()
