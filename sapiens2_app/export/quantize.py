"""int8: onnxruntime's dynamic quantization of the checked fp32 ONNX export, and its agreement with fp32.

--quantize int8 (ONNX, fp32): the checked fp32 export goes through onnxruntime's dynamic quantization (int8 weights
for each MatMul and Conv with constant weights, activations quantized per call; QUANTIZATION); -o gets the int8
model. Its agreement with the fp32 export on the same input is printed (int8_agreement); it is not held to a
tolerance, since what int8 costs depends on the weights, but an output that is not finite fails the check.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import torch

from sapiens2_app.export.checks import CheckFailed, compare
from sapiens2_app.export.formats import onnx_bytes, run_onnx

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
