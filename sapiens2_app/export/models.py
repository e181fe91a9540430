"""The model to export: loaded as predict.py loads it (a checkpoint, or random weights with --random-init), its
input size checked, and what the artifact says about it (describe: its metadata).
"""

from __future__ import annotations

import torch
from torch import nn

from sapiens2 import Sapiens2, heads, weights
from sapiens2_app.common.cli import UsageError
from sapiens2_app.export.formats import OUTPUTS
from sapiens2_app.export.quantize import QUANTIZATION
from sapiens2_app.predict.models import load_or_random, random_weights_banner


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


def random_banner(task: str, random_init: str) -> str:
    return random_weights_banner(task, random_init, "The artifact runs end to end, but its outputs are "
                                         "MEANINGLESS (its metadata says random_weights).")
