#!/usr/bin/env python3
"""Export a Sapiens2 model as a deployable artifact, and check it against eager PyTorch before keeping it.

    python export.py seg --model seg-0.4b --format onnx -o seg-0.4b.onnx [--size 1024x768] [--dtype fp16]
                     [--dynamic-batch] [--conventions original|transformers] [--quantize int8]
    python export.py features --model 1b --format torch-export -o backbone-1b.pt2

The artifact takes `pixel_values` (B, 3, H, W) float32, normalized RGB as `processing.preprocess` makes it (any
--dtype casts it inside), and returns the task's tensors by name (formats.OUTPUTS). Post-processing stays in Python
(processing.py); docs/export.md shows the lines for an ONNX model.

This file is the command: its arguments, the flow of an export and its exit statuses. What it leans on is in
sapiens2_app/export/: formats.py (the formats onnx, torch-export and aoti: writers, runners and their numerics),
checks.py (the checks before and after writing, the tolerances), quantize.py (--quantize int8), models.py (the
model to export and its metadata).

After writing, the artifact runs once on a random input (batch 2 with --dynamic-batch, else 1) next to the eager
model (same dtype, same kernels); the max relative difference max|a - e| / max|e| of each output is printed, and
above `tolerance(dtype, rope)` (fp32 1e-4, fp16 2e-2, bf16 5e-2; 2e-3 for an fp32 model with bf16 RoPE, whose own
rounding noise is ~3e-4) the file is removed and the exit status is 1.
Files are written to a temporary folder beside the output and moved into place only after the check passes; the
folder of an export killed earlier (kill -9) is removed by the next export to the same -o.
Exit status: 0 written and checked, 1 the check or the write failed (nothing written), 2 bad arguments or missing
packages, 130 / 143 interrupted by Ctrl-C / SIGTERM (nothing written; an earlier file at -o is kept).
"""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
from pathlib import Path

import torch

from sapiens2 import PRESETS, weights
from sapiens2_app.common import safe_io
from sapiens2_app.common.artefacts import TASKS
from sapiens2_app.common.cli import (INTERRUPTED, TERMINATED, OneLineErrorParser, StopSignals, Terminated, UsageError,
                                     parse_size)
from sapiens2_app.export.checks import (CheckFailed, WriteFailed, check_against_eager, check_output_path,
                                        check_packages, compare, example_input, tolerance, write_error_text)
from sapiens2_app.export.formats import FORMATS, WRITERS, ExportWrapper, reference_kernels
from sapiens2_app.export.models import backbone_of, check_size, describe, load_model, random_banner
from sapiens2_app.export.quantize import QUANTIZATION, quantize_and_compare
from sapiens2_app.predict.models import CONVENTIONS, RANDOM_INIT, model_source


def build_parser(prog: str = "export.py") -> argparse.ArgumentParser:
    parser = OneLineErrorParser(
        prog=prog,
        description="Export a Sapiens2 model (ONNX, torch.export, AOTInductor), checked against eager PyTorch.")
    parser.add_argument("task", choices=TASKS)
    parser.add_argument("--model", metavar="SOURCE",
                        help="a size (0.4b: the task's released checkpoint; the default, 1b for matting), a task "
                             "preset (seg-1b), a .safetensors file, a folder or a hub id")
    parser.add_argument("--format", choices=list(FORMATS), default="onnx")
    parser.add_argument("-o", "--output", required=True, type=Path, metavar="FILE", help="NAME.onnx or NAME.pt2")
    parser.add_argument("--size", type=parse_size, metavar="HxW",
                        help="fixed input size (default: the model's, 1024x768)")
    parser.add_argument("--dtype", choices=["fp32", "float32", "fp16", "float16", "bf16", "bfloat16"], default="fp32",
                        help="weights and compute (the input stays float32); ONNX: fp32 or fp16")
    parser.add_argument("--dynamic-batch", action="store_true", help="a dynamic batch axis (default: batch 1)")
    parser.add_argument("--conventions", choices=list(CONVENTIONS), default="original",
                        help="as predict.py: original = RoPE in bf16 as trained (default); transformers = RoPE in "
                             "fp32 as HF transformers. Preprocessing is outside the artifact: make its input with "
                             "processing.preprocess(..., resample='hf') for the transformers conventions")
    parser.add_argument("--random-init", choices=RANDOM_INIT, default="never",
                        help="random weights instead of --model's checkpoint: 'fallback' when its download fails, "
                             "'always' without trying (offline smoke tests; the artifact's outputs are meaningless "
                             "and its metadata says random_weights)")
    parser.add_argument("--random-backbone", choices=list(PRESETS),
                        help="backbone size of a random model (default: the model's)")
    parser.add_argument("--quantize", choices=list(QUANTIZATION),
                        help="ONNX, fp32: -o gets the checked fp32 export with int8 weights (onnxruntime dynamic "
                             "quantization); its agreement with fp32 is printed")
    return parser


def export(args) -> dict[str, float]:
    """Write the artifact and check it against eager; returns the check's differences (with --quantize, the fp32
    export's, before quantization)."""
    dtype = weights.parse_dtype(args.dtype)
    check_packages(args.format, dtype, args.quantize)
    path = args.output
    check_output_path(path, args.format)
    source = model_source(args.task, args.model, {})  # a size (0.4b) means the task's released checkpoint
    rope = CONVENTIONS[args.conventions]["rope"]
    model, random = load_model(args.task, source, dtype, rope, args.random_init, args.random_backbone, args.size)
    if random:
        print(random_banner(args.task, args.random_init), file=sys.stderr)
    size = tuple(args.size or backbone_of(model).config.image_size)
    check_size(model, args.task, size)
    wrapper = ExportWrapper(model, args.task).eval()
    example = example_input(2 if args.dynamic_batch else 1, size)
    with torch.no_grad(), reference_kernels():
        expected = wrapper(example)  # also fills the RoPE table cache: the tables become graph constants
    write, run = WRITERS[args.format]
    info = describe(args.task, source, model, size, dtype, args.dynamic_batch, random, args.quantize)
    print(f"exporting {args.task} ({info['source']}, {info['dtype']}, {size[0]}x{size[1]}, "
          f"{'dynamic batch' if args.dynamic_batch else 'batch 1'}, RoPE {rope}) to {args.format} ...",
          file=sys.stderr)
    prefix = f".{path.name}."
    if removed := safe_io.remove_abandoned_staging(path.parent, prefix):
        print(f"note: removed {removed} staging folder{'s' if removed > 1 else ''} ({prefix}XXXXXXXX.tmp) that an "
              f"export killed earlier left in {path.parent}", file=sys.stderr)
    try:
        with safe_io.staging_folder(path.parent, prefix=prefix) as staging:
            # with --quantize the fp32 export is checked in a folder of its own, quantized, then removed
            artifact = staging / "fp32" / path.name if args.quantize else staging / path.name
            artifact.parent.mkdir(exist_ok=True)
            write(wrapper, example, artifact, args.dynamic_batch, info)
            differences = compare(run(artifact, example), expected)
            check_against_eager(differences, tolerance(dtype, rope), info, rope, args.format, path)
            if args.quantize:
                quantize_and_compare(args.task, artifact, staging / path.name, example, path)
                shutil.rmtree(artifact.parent)
            written = {item.name for item in staging.iterdir()}
    except OSError as error:  # the staged files are removed; an earlier file at -o stays as it was
        raise WriteFailed(write_error_text(path, error)) from None
    stale = path.with_name(path.name + ".data")  # the weights of an earlier, bigger export of that name
    if path.suffix == ".onnx" and stale.name not in written and stale.exists():
        stale.unlink()
    print(f"wrote {path}", file=sys.stderr)
    if random:
        print(random_banner(args.task, args.random_init), file=sys.stderr)
    return differences


class RecordedStopSignals(StopSignals):
    """StopSignals that remember the signal: the ONNX exporter can turn the KeyboardInterrupt raised inside it
    into an error of its own (a Ctrl-C while it imports torch._dynamo fails its `except torch._dynamo.exc...`
    clause), and after a stop any error is that stop."""

    received: int | None = None

    def handle(self, signum, frame):
        self.received = signum
        super().handle(signum, frame)


def main(argv: list[str] | None = None, prog: str = "export.py") -> int:
    args = build_parser(prog).parse_args(argv)
    stops = RecordedStopSignals()
    try:
        with stops:  # SIGTERM as Ctrl-C: the staging folder is removed either way
            export(args)
    except KeyboardInterrupt as stop:
        return stopped(signal.SIGTERM if isinstance(stop, Terminated) else signal.SIGINT)
    except Exception as error:
        if stops.received is not None:  # the exporter made our KeyboardInterrupt an error of its own
            return stopped(stops.received)
        if not isinstance(error, (UsageError, CheckFailed, WriteFailed)):
            raise
        print(f"error: {error}", file=sys.stderr)
        return 2 if isinstance(error, UsageError) else 1
    return 0


def stopped(signum: int) -> int:
    terminated = signum == signal.SIGTERM
    print(f"\n{'terminated' if terminated else 'interrupted'}: the export did not finish; nothing half-written is "
          f"left", file=sys.stderr)
    return TERMINATED if terminated else INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
