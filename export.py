#!/usr/bin/env python3
"""Export a Sapiens2 model as a deployable artifact, and check it against eager PyTorch before keeping it.

    python export.py seg --model seg-0.4b --format onnx -o seg-0.4b.onnx [--size 1024x768] [--dtype fp16]
                     [--dynamic-batch] [--conventions original|transformers] [--quantize int8]
    python export.py features --model 1b --format torch-export -o backbone-1b.pt2

The artifact takes `pixel_values` (B, 3, H, W) float32, normalized RGB as `processing.preprocess` makes it (any
--dtype casts it inside), and returns the task's tensors by name (OUTPUTS). Post-processing stays in Python
(processing.py); docs/export.md shows the lines for an ONNX model.

Formats
  onnx          torch.onnx.export(dynamo=True) at opset 18 (ONNX Runtime >= 1.14; TensorRT 10, untried); needs onnx,
                onnxscript and onnxruntime (export-time dependencies, not runtime ones). Models over 1.5 GB keep
                their weights beside the graph in NAME.onnx.data.
  torch-export  a torch.export program, torch.export.save (load with torch.export.load(path).module()).
  aoti          an AOTInductor package (torch._inductor.aoti_compile_and_package; needs a C++ compiler),
                load with torch._inductor.aoti_load_package(path).

Numerics
  * The graph runs the PyTorch reference kernels (SAPIENS2_KERNELS=torch while tracing), never Triton.
  * The RoPE tables are constants of the graph (computed by eager PyTorch before tracing), so the bf16 tables
    of the default convention are bit-identical to eager's.
  * bf16 RoPE survives ONNX exactly: ONNX Runtime's CPU provider has no bf16 Mul/Add, so each bf16
    elementwise op of the graph becomes cast-to-fp32, the op, cast-to-bf16 (emulate_bf16_arithmetic). That is
    what PyTorch computes for a bf16 op (the op in fp32, rounded to nearest even: products of two bf16 values
    are exact in fp32), so the rounding after every step is kept.
  * After writing, the artifact runs once on a random input (batch 2 with --dynamic-batch, else 1) next to the
    eager model (same dtype, same kernels); the max relative difference max|a - e| / max|e| of each output is
    printed, and above `tolerance(dtype, rope)` (fp32 1e-4, fp16 2e-2, bf16 5e-2; 2e-3 for an fp32 model with
    bf16 RoPE, whose own rounding noise is ~3e-4) the file is removed and the exit status is 1.
  * --quantize int8 (ONNX, fp32): the checked fp32 export goes through onnxruntime's dynamic quantization
    (int8 weights for each MatMul and Conv with constant weights, activations quantized per call; QUANTIZATION);
    -o gets the int8 model. Its agreement with the fp32 export on the same input is printed (int8_agreement);
    it is not held to a tolerance, since what int8 costs depends on the weights, but an output that is not
    finite fails the check.
Files are written to a temporary folder beside the output and moved into place only after the check passes; the
folder of an export killed earlier (kill -9) is removed by the next export to the same -o.
Exit status: 0 written and checked, 1 the check or the write failed (nothing written), 2 bad arguments or missing
packages, 130 / 143 interrupted by Ctrl-C / SIGTERM (nothing written; an earlier file at -o is kept).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import io
import json
import logging
import os
import shutil
import signal
import sys
import warnings
from pathlib import Path

import torch
from torch import nn

from sapiens2 import PRESETS, Sapiens2, heads, weights
from sapiens2_app.common import safe_io
from sapiens2_app.common.artefacts import TASKS
from sapiens2_app.common.cli import (INTERRUPTED, TERMINATED, OneLineErrorParser, StopSignals, Terminated, UsageError,
                              parse_size)
from sapiens2_app.predict.models import CONVENTIONS, RANDOM_INIT, load_or_random, model_source, random_weights_banner

# The outputs of each task, in the order of the artifact's outputs (names of the task model's output fields).
OUTPUTS = {
    "pose": ("heatmaps",), "seg": ("logits",), "normal": ("normals",), "pointmap": ("pointmaps", "scales"),
    "matting": ("alphas", "foregrounds"), "albedo": ("albedo",), "features": ("cls", "features"),
}
FORMATS = {"onnx": ".onnx", "torch-export": ".pt2", "aoti": ".pt2"}
# The dynamo exporter's default and the lowest opset it emits natively. Every op of these models exists there;
# the fused ops of newer opsets (RMSNormalization, Attention: opset 23) stay out, so older runtimes parse it.
ONNX_OPSET = 18
# Max relative difference artifact vs eager (max |a - e| / max |e|, per output), by model dtype.
#   fp32: ONNX Runtime's kernels sum in another order than PyTorch's: 4.3e-6 / 5.7e-6 with fp32 RoPE (random
#     0.1b / 0.4b backbones at 128x96); torch.export is bit-identical.
#   fp16/bf16: the artifact may keep intermediates in fp32 where eager rounds them (ONNX Runtime's CPU provider
#     computes fp16 ops in fp32): fp16 ONNX 7.0e-3 / 7.4e-3 (random 0.1b / 0.4b backbones, 128x96), so 2e-2;
#     torch.export and AOTInductor reproduce eager (0 at 0.1b/0.4b), bf16 is 5e-2 (eps 8e-3).
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 5e-2}
# bf16 RoPE rounds q and k to bf16 in every block, so a last-bit fp32 difference before it becomes a 1-ulp bf16
# flip (4e-3 relative) after it: eager itself moves by 2.9e-4 when a random 0.1b backbone's input moves by 1e-7,
# and ONNX fp32 differs by 2.9e-4 / 2.5e-4 (random 0.1b / 0.4b). No runtime that sums in another order can get
# under 1e-4 there; 2e-3 is the project's bound for bf16 RoPE across implementations (tests/test_heads.py).
# Switching to fp32 RoPE moves those outputs by 1.9e-2, so the bound still tells the conventions apart.
BF16_ROPE_TOLERANCE = 2e-3


def tolerance(dtype: torch.dtype, rope_dtype: str) -> float:
    return max(TOLERANCE[dtype], BF16_ROPE_TOLERANCE) if rope_dtype == "bfloat16" else TOLERANCE[dtype]
ONNX_HINT = "pip install onnx onnxscript onnxruntime  (or: pip install 'sapiens2[export]')"
QUANTIZE_HINT = "pip install onnxruntime  (its quantization tools come with it: onnxruntime.quantization)"


class CheckFailed(Exception):
    """The artifact does not reproduce eager within the tolerance: exit status 1."""


class WriteFailed(Exception):
    """The artifact could not be written (a full disk): exit status 1, nothing left behind."""


# ----------------------------------------------------------------------------------------------------
# The exported module
# ----------------------------------------------------------------------------------------------------


class ExportWrapper(nn.Module):
    """pixel_values -> {name: tensor}, OUTPUTS[task] in order: plain tensors that every format can carry."""

    def __init__(self, model: nn.Module, task: str):
        super().__init__()
        self.model, self.task = model, task

    def forward(self, pixel_values: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.model(pixel_values)
        return {name: getattr(out, name) for name in OUTPUTS[self.task]}


def load_model(task: str, source: str, dtype: torch.dtype, rope: str, random_init: str = "never",
               random_backbone: str | None = None, size: tuple[int, int] | None = None) -> tuple[nn.Module, bool]:
    """(model, whether its weights are random): any source weights.load accepts (see model_source for sizes), or
    as --random-init says heads.random_model's (built at `size`: random weights fit any size). `features` takes
    the backbone of any checkpoint, pretrain or task."""
    def checkpoint():
        return weights.load(source, dtype=dtype, task=None if task == "features" else task, rope_dtype=rope)

    def random_weights():
        overrides = dict(rope_dtype=rope, **({"image_size": tuple(size)} if size else {}))
        return heads.random_model(task, source, random_backbone, **overrides).to(dtype)

    try:
        model, random = load_or_random(source, random_init, checkpoint, random_weights)
    except (FileNotFoundError, ValueError) as error:
        raise UsageError(str(error)) from None
    if task == "features" and isinstance(model, heads.Sapiens2ForTask):
        model = model.backbone
    return model.eval(), random


def backbone_of(model: nn.Module) -> Sapiens2:
    return model if isinstance(model, Sapiens2) else model.backbone


def check_size(model: nn.Module, task: str, size: tuple[int, int]):
    config = backbone_of(model).config
    try:
        backbone_of(model).check_input(torch.empty(1, 3, *size, device="meta"))
    except ValueError as error:
        raise UsageError(f"--size: {error}") from None
    head = getattr(model, "head_config", None)
    if head is not None and (problem := heads.scale_branch_problem(head, size, config.size_multiple)):
        raise UsageError(f"--size {size[0]}x{size[1]}: {problem}")


@contextlib.contextmanager
def reference_kernels():
    """The PyTorch reference kernels, whatever the device: Triton kernels do not trace into ONNX or export."""
    previous = os.environ.get("SAPIENS2_KERNELS")
    os.environ["SAPIENS2_KERNELS"] = "torch"
    try:
        yield
    finally:
        if previous is None:
            del os.environ["SAPIENS2_KERNELS"]
        else:
            os.environ["SAPIENS2_KERNELS"] = previous


def example_input(batch: int, size: tuple[int, int], seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, 3, *size, generator=torch.Generator().manual_seed(seed))


def describe(task: str, source: str, model: nn.Module, size, dtype: torch.dtype, dynamic_batch: bool,
             random: bool = False, quantize: str | None = None) -> dict:
    """What the artifact is, stored inside it (ONNX metadata_props / a file in the .pt2)."""
    config = backbone_of(model).config
    return {
        "task": task, "source": source, "random_weights": random, "outputs": list(OUTPUTS[task]),
        "dtype": str(dtype).replace("torch.", ""),
        "input": f"pixel_values ({'B' if dynamic_batch else 1}, 3, {size[0]}, {size[1]}) float32, normalized RGB",
        "quantization": QUANTIZATION.get(quantize), "rope_dtype": config.rope_dtype,
        "sapiens2_config": config.to_dict(),
        "head_config": model.head_config.to_dict() if isinstance(model, heads.Sapiens2ForTask) else None,
    }


# ----------------------------------------------------------------------------------------------------
# Formats: write (into a temporary folder) and run
# ----------------------------------------------------------------------------------------------------


def batch_dim(dynamic_batch: bool):
    return ({0: torch.export.Dim("batch")},) if dynamic_batch else None


def export_onnx(wrapper: ExportWrapper, example: torch.Tensor, path: Path, dynamic_batch: bool, info: dict):
    with torch.no_grad(), reference_kernels(), quiet_exporter():
        program = torch.onnx.export(
            wrapper, (example,), dynamo=True, opset_version=ONNX_OPSET, input_names=["pixel_values"],
            output_names=list(OUTPUTS[wrapper.task]), dynamic_shapes=batch_dim(dynamic_batch), verbose=False,
        )
    emulate_bf16_arithmetic(program.model)
    program.model.metadata_props.update({"sapiens2": json.dumps(info)})
    program.save(str(path))  # weights go to NAME.onnx.data beside it when they exceed 1.5 GB


@contextlib.contextmanager
def quiet_exporter():
    """The exporter's notes about torchvision ops (this project has none) and deprecations inside torch."""
    exporter_log = logging.getLogger("torch.onnx._internal.exporter._registration")
    level = exporter_log.level
    exporter_log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            yield
    finally:
        exporter_log.setLevel(level)


BF16_ELEMENTWISE = ("Add", "Sub", "Mul", "Div", "Neg")


def emulate_bf16_arithmetic(model) -> int:
    """Rewrite each bf16 elementwise op (the RoPE rotation of an fp32/fp16 model) as
    Cast(fp32) -> op -> Cast(bf16). Exact: PyTorch computes a bf16 op in fp32 and rounds the result to nearest
    even, which is what ONNX's Cast does (round to nearest even in ONNX Runtime; tests/test_export.py).
    Returns the number of ops rewritten."""
    import onnx_ir as ir

    bf16, fp32 = ir.DataType.BFLOAT16, ir.DataType.FLOAT
    rewritten = 0
    for node in list(model.graph):
        if node.op_type not in BF16_ELEMENTWISE or node.domain not in ("", "ai.onnx"):
            continue
        if not all(v.dtype == bf16 for v in (*node.inputs, *node.outputs)):
            continue
        widened = [ir.node("Cast", [v], {"to": fp32}) for v in node.inputs]
        for cast, value in zip(widened, node.inputs):
            cast.outputs[0].dtype, cast.outputs[0].shape = fp32, value.shape
        op = ir.node(node.op_type, [c.outputs[0] for c in widened])
        op.outputs[0].dtype = fp32
        rounded = ir.node("Cast", op.outputs, {"to": bf16})
        ir.convenience.replace_nodes_and_values(model.graph, node, [node], [*widened, op, rounded],
                                                list(node.outputs), list(rounded.outputs))
        rewritten += 1
    return rewritten


def run_onnx(path: Path, pixel_values: torch.Tensor) -> dict[str, torch.Tensor]:
    import onnxruntime

    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, (torch.from_numpy(a) for a in session.run(None, {"pixel_values": pixel_values.numpy()}))))


def export_program(wrapper: ExportWrapper, example: torch.Tensor, dynamic_batch: bool):
    with torch.no_grad(), reference_kernels():
        return torch.export.export(wrapper, (example,), dynamic_shapes=batch_dim(dynamic_batch))


def export_torch(wrapper, example, path: Path, dynamic_batch: bool, info: dict):
    program = export_program(wrapper, example, dynamic_batch)
    through_python_file(path, lambda file: torch.export.save(program, file,
                                                            extra_files={"sapiens2.json": json.dumps(info)}))


def through_python_file(path: Path, write):
    """write(file) into `path` through a WriteErrorKept, whose kept error is raised once the writer is done.
    Ctrl-C and SIGTERM wait for the writer (as they do for one that writes from C++ alone): raised in the Python
    callback, they would abort the process as an error does."""
    with open(path, "wb") as file, safe_io.signals_deferred():
        kept = WriteErrorKept(file)
        write(kept)
    if kept.error is not None:
        raise kept.error


class WriteErrorKept(io.RawIOBase):
    """A file for torch's C++ archive writer that keeps the first write error (a full disk) for the caller to
    raise once the writer is done. Thrown into the writer, the error aborts the process: the writer's destructor
    writes the archive's end again, and C++ terminates on a second exception ("terminate called after throwing
    an instance of c10::Error", exit -6, whether torch opened the file or was handed a Python one)."""

    def __init__(self, file):
        super().__init__()
        self.file, self.error = file, None

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        return self.file.seek(offset, whence)

    def tell(self) -> int:
        return self.file.tell()

    def write(self, data) -> int:
        if self.error is None:  # after an error the archive is lost anyway: the rest is not written
            try:
                self.file.write(data)
            except OSError as error:
                self.error = error
        return len(data)


def run_torch(path: Path, pixel_values: torch.Tensor) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        return torch.export.load(str(path)).module()(pixel_values)


def export_aoti(wrapper, example, path: Path, dynamic_batch: bool, info: dict):
    program = export_program(wrapper, example, dynamic_batch)
    # Inductor fuses elementwise chains and by default rounds a bf16 chain once at its end; the bf16 RoPE
    # convention is the rounding after every op, which emulate_precision_casts keeps.
    # NOTE: packaged by torch's C++ writer where Inductor compiles (its cache folder), then copied into place by
    # Python, whose write errors are plain OSErrors: through_python_file would hold Ctrl-C back for the whole
    # compile (minutes).
    with torch.no_grad():
        built = Path(torch._inductor.aoti_compile_and_package(program, inductor_configs={"emulate_precision_casts":
                                                                                           True}))
    try:
        shutil.copyfile(built, path)
    finally:
        built.unlink(missing_ok=True)


def run_aoti(path: Path, pixel_values: torch.Tensor) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        return torch._inductor.aoti_load_package(str(path))(pixel_values)


WRITERS = {"onnx": (export_onnx, run_onnx), "torch-export": (export_torch, run_torch), "aoti": (export_aoti, run_aoti)}


# ----------------------------------------------------------------------------------------------------
# Check against eager
# ----------------------------------------------------------------------------------------------------


def relative_difference(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|, in float64 (the project's parity measure)."""
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).abs().max() / expected.abs().max().clamp(min=1e-30)).item()


def compare(outputs: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> dict[str, float]:
    if list(outputs) != list(expected):
        raise CheckFailed(f"the artifact returns {list(outputs)}, expected {list(expected)}")
    differences = {}
    for name, want in expected.items():
        got = outputs[name]
        if tuple(got.shape) != tuple(want.shape):
            raise CheckFailed(f"{name}: the artifact gives shape {tuple(got.shape)}, eager {tuple(want.shape)}")
        differences[name] = relative_difference(got, want)
    return differences


# ----------------------------------------------------------------------------------------------------
# int8: dynamic quantization of the checked fp32 ONNX export
# ----------------------------------------------------------------------------------------------------

# What --quantize does, as the artifact's metadata says it.
QUANTIZATION = {"int8": "onnxruntime dynamic quantization of the fp32 export: int8 weights (one scale per tensor) "
                        "for each MatMul and Conv with a constant weight, uint8 activations quantized at each call; "
                        "the rest (attention's products, ConvTranspose, norms) stays fp32"}


def quantize_int8(fp32_path: Path, path: Path):
    """The ONNX file at fp32_path with its weights quantized to int8, written to `path` (its weights beside it in
    NAME.onnx.data when the fp32 export keeps them there)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    external = fp32_path.with_name(fp32_path.name + ".data").exists()
    root = logging.getLogger()  # quantize_dynamic advises its optional pre-processing pass on the root logger
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        quantize_dynamic(fp32_path, path, weight_type=QuantType.QInt8, use_external_data_format=external)
    finally:
        root.setLevel(level)


def int8_agreement(task: str, int8: dict[str, torch.Tensor], fp32: dict[str, torch.Tensor]) -> dict[str, float]:
    """The int8 model's outputs against the fp32 export's on the same input: per output the max relative difference
    (the check's measure) and the mean absolute difference; seg: the share of pixels whose class (argmax) is the
    same; pose: the mean distance between the heatmaps' peaks, in heatmap pixels; normal: the mean angle between
    the normals, in degrees."""
    numbers = {}
    for name, difference in compare(int8, fp32).items():
        if not torch.isfinite(int8[name]).all():
            raise CheckFailed(f"the int8 model's {name} has values that are not finite")
        numbers[f"{name} max relative"] = difference
        numbers[f"{name} mean abs"] = (int8[name].double() - fp32[name].double()).abs().mean().item()
    if task == "seg":
        same = int8["logits"].argmax(1) == fp32["logits"].argmax(1)  # (B, h, w)
        numbers["pixels of the same class"] = same.double().mean().item()
    elif task == "pose":
        distance = (heatmap_peaks(int8["heatmaps"]) - heatmap_peaks(fp32["heatmaps"])).norm(dim=-1)
        numbers["keypoint distance px"] = distance.mean().item()
    elif task == "normal":
        cosine = torch.nn.functional.cosine_similarity(int8["normals"].double(), fp32["normals"].double(), dim=1)
        numbers["normal angle deg"] = torch.rad2deg(torch.acos(cosine.clamp(-1, 1))).mean().item()
    return numbers


def heatmap_peaks(heatmaps: torch.Tensor) -> torch.Tensor:
    """(B, K, h, w) -> (B, K, 2): x, y of each heatmap's maximum, in heatmap pixels."""
    width = heatmaps.shape[-1]
    peak = heatmaps.flatten(2).argmax(-1)  # (B, K), index into h * w
    return torch.stack([peak % width, peak // width], -1).double()


def agreement_text(numbers: dict[str, float]) -> str:
    def value(name, number):
        return f"{100 * number:.2f}%" if name == "pixels of the same class" else f"{number:.2e}"
    return ", ".join(f"{name} {value(name, number)}" for name, number in numbers.items())


def onnx_bytes(path: Path) -> int:
    """The size of an ONNX model: the graph file and its NAME.onnx.data weights, if any."""
    data = path.with_name(path.name + ".data")
    return path.stat().st_size + (data.stat().st_size if data.exists() else 0)


# ----------------------------------------------------------------------------------------------------
# Writing safely
# ----------------------------------------------------------------------------------------------------


def check_output_path(path: Path, fmt: str):
    if path.suffix != FORMATS[fmt]:
        suffix = FORMATS[fmt]
        raise UsageError(f"-o {path}: a {fmt} file should end in {suffix}, e.g. -o {path.with_suffix(suffix)}")
    if path.is_dir():
        raise UsageError(f"-o {path} is a folder; give a file name, e.g. -o {path / ('model' + FORMATS[fmt])}")
    existing = next(p for p in (path.parent.absolute(), *path.parent.absolute().parents) if p.exists())
    if not existing.is_dir():
        raise UsageError(f"-o {path}: cannot create its folder, {existing} is a file")
    if not os.access(existing, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise UsageError(f"-o {path}: not writable ({existing}); choose another location")


# ----------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------


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


def check_packages(fmt: str, dtype: torch.dtype, quantize: str | None = None):
    if quantize:
        check_quantize(fmt, dtype)
    if fmt == "onnx":
        for name in ("onnx", "onnxscript", "onnxruntime"):
            try:
                __import__(name)
            except ImportError:
                raise UsageError(f"--format onnx needs {name}: {ONNX_HINT}") from None
        if dtype == torch.bfloat16:
            raise UsageError("--format onnx --dtype bf16: ONNX Runtime has no bf16 kernels to check it with (and "
                             f"opset {ONNX_OPSET} has no bf16 Conv); export fp32 and let TensorRT build bf16 "
                             "(trtexec --bf16), or use --format torch-export")
    if quantize:
        try:
            import onnxruntime.quantization  # noqa: F401
        except ImportError:
            raise UsageError(f"--quantize {quantize} needs onnxruntime.quantization: {QUANTIZE_HINT}") from None
    if fmt == "aoti" and not hasattr(torch._inductor, "aoti_compile_and_package"):
        raise UsageError(f"--format aoti needs torch >= 2.6 (this is {torch.__version__}); use --format torch-export")


def check_quantize(fmt: str, dtype: torch.dtype):
    if fmt != "onnx":
        raise UsageError(f"--quantize int8 is for --format onnx (onnxruntime's quantization); --format {fmt} has "
                         "none: drop --quantize, or use --format onnx")
    if dtype != torch.float32:
        raise UsageError(f"--quantize int8 quantizes an fp32 export; drop --dtype {str(dtype).replace('torch.', '')}")


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


def check_against_eager(differences: dict[str, float], bound: float, info: dict, rope: str, fmt: str, path: Path):
    summary = ", ".join(f"{name} {d:.2e}" for name, d in differences.items())
    print(f"max relative difference vs eager ({info['dtype']}, RoPE {rope}, tolerance {bound:.0e}): {summary}")
    if not all(d <= bound for d in differences.values()):  # (NaN fails too)
        raise CheckFailed(f"the {fmt} artifact differs from eager by more than {bound:.0e}: {path} not written")


def quantize_and_compare(task: str, fp32_path: Path, int8_path: Path, example: torch.Tensor, path: Path):
    """int8_path <- fp32_path quantized; prints the int8 model's agreement with fp32 on the check input and the
    two sizes. Only an output that is not finite fails (CheckFailed): int8 is not held to fp32's tolerance."""
    print("quantizing the fp32 export to int8 (onnxruntime dynamic quantization) ...", file=sys.stderr)
    quantize_int8(fp32_path, int8_path)
    try:
        numbers = int8_agreement(task, run_onnx(int8_path, example), run_onnx(fp32_path, example))
    except CheckFailed as error:
        raise CheckFailed(f"{error}: {path} not written") from None
    print(f"int8 vs fp32 export (the same input): {agreement_text(numbers)}")
    int8_mb, fp32_mb = onnx_bytes(int8_path) / 2**20, onnx_bytes(fp32_path) / 2**20
    print(f"int8 model {int8_mb:.1f} MiB, fp32 {fp32_mb:.1f} MiB ({int8_mb / fp32_mb:.2f}x)")


def write_error_text(path: Path, error: OSError) -> str:
    code = f" ({errno.errorcode[error.errno]})" if error.errno in errno.errorcode else ""
    kept = "; the earlier file there is unchanged" if path.exists() else ""
    return (f"-o {path}: writing the artifact failed: {error.strerror or error}{code}; nothing was written{kept}; "
            f"free some space or choose another location")


def random_banner(task: str, random_init: str) -> str:
    return random_weights_banner(task, random_init, "The artifact runs end to end, but its outputs are "
                                         "MEANINGLESS (its metadata says random_weights).")


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
