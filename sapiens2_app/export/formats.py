"""The exported module and its formats: each format's writer (into a folder staged beside -o) and runner.

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
Torch's C++ archive writer writes through WriteErrorKept, so that a full disk is one error, not an abort.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import shutil
import warnings
from pathlib import Path

import torch
from torch import nn

from sapiens2_app.common import safe_io

# The outputs of each task, in the order of the artifact's outputs (names of the task model's output fields).
OUTPUTS = {
    "pose": ("heatmaps",), "seg": ("logits",), "normal": ("normals",), "pointmap": ("pointmaps", "scales"),
    "matting": ("alphas", "foregrounds"), "albedo": ("albedo",), "features": ("cls", "features"),
}
FORMATS = {"onnx": ".onnx", "torch-export": ".pt2", "aoti": ".pt2"}
# The dynamo exporter's default and the lowest opset it emits natively. Every op of these models exists there;
# the fused ops of newer opsets (RMSNormalization, Attention: opset 23) stay out, so older runtimes parse it.
ONNX_OPSET = 18


class ExportWrapper(nn.Module):
    """pixel_values -> {name: tensor}, OUTPUTS[task] in order: plain tensors that every format can carry."""

    def __init__(self, model: nn.Module, task: str):
        super().__init__()
        self.model, self.task = model, task

    def forward(self, pixel_values: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.model(pixel_values)
        return {name: getattr(out, name) for name in OUTPUTS[self.task]}


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


def onnx_bytes(path: Path) -> int:
    """The size of an ONNX model: the graph file and its NAME.onnx.data weights, if any."""
    data = path.with_name(path.name + ".data")
    return path.stat().st_size + (data.stat().st_size if data.exists() else 0)
