"""Inference: a batch of images (uint8 (3, H, W) tensors) -> per image, each task's result on the CPU (or the
TaskFailed of a task that failed on it). Each task runs on its own; a batch that fails is retried image by image.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

import processing
from sapiens2_app.boxes import pose_boxes
from sapiens2_app.inputs import InputImage
from sapiens2_app.models import LoadedModel


@dataclass
class Inference:
    """How to run the models on a batch: the tasks asked for, one model per task (+ seg when pose boxes or
    --mask-with-seg need it), the device, the batch size, the input size and the options; timings per model."""
    tasks: list[str]
    models: dict[str, LoadedModel]
    device: torch.device
    dtype: torch.dtype
    batch_size: int
    size: tuple[int, int] | None = None  # --size; None: each model's own
    flip: bool = True  # pose: the flip test
    mask_with_seg: bool = False
    boxes: dict | None = None  # --boxes: input name -> COCO xywh boxes
    detector: Callable | None = None  # any callable: images -> per image (K, 5) xywh + score
    seg_boxes: bool = True  # pose boxes from the seg blobs when there is no detector (--detector seg)
    resample: str = "original"  # processing's resample= (from --conventions)
    timings: dict[str, float] = field(default_factory=dict)  # seconds per model, for run.json

    def input_size(self, task: str) -> tuple[int, int]:
        return self.size or tuple(self.models[task].backbone.config.image_size)

    def prepare(self, task: str, images, pad: bool) -> processing.ModelInputs:
        return processing.preprocess(images, self.input_size(task), pad=pad, resample=self.resample, device=self.device)

    def forward(self, task: str, pixel_values: torch.Tensor, method=None):
        """The task's model (or `method`, e.g. its flip test) on a batch, timed for the manifest."""
        start = time.perf_counter()
        with torch.no_grad():
            output = (method or self.models[task].model)(pixel_values.to(self.dtype))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.timings[task] = self.timings.get(task, 0.0) + time.perf_counter() - start
        return output


def rows(inputs: processing.ModelInputs) -> list[processing.ModelInputs]:
    """Per-image bookkeeping, to post-process one image at a time (full-size maps of a batch can be GBs)."""
    return [processing.ModelInputs(None, [s], [c], inputs.model_size)
            for s, c in zip(inputs.image_sizes, inputs.content_boxes)]


def run_seg(ctx: Inference, images) -> list[torch.Tensor]:
    inputs = ctx.prepare("seg", images, pad=False)  # plain resize, as the original seg demo and HF
    logits = ctx.forward("seg", inputs.pixel_values).logits.float()
    return [processing.postprocess_segmentation(logits[i : i + 1], row)[0].cpu()
            for i, row in enumerate(rows(inputs))]


def run_normal(ctx: Inference, images) -> list[torch.Tensor]:
    inputs = ctx.prepare("normal", images, pad=True)  # aspect-preserving resize + padding, as the original
    normals = ctx.forward("normal", inputs.pixel_values).normals.float()
    return [processing.postprocess_normals(normals[i : i + 1], row)[0].cpu() for i, row in enumerate(rows(inputs))]


def run_pointmap(ctx: Inference, images) -> list[torch.Tensor]:
    inputs = ctx.prepare("pointmap", images, pad=True)
    out = ctx.forward("pointmap", inputs.pixel_values)
    pointmaps, scales = out.pointmaps.float(), out.scales.float()
    # smooth: the original demo's Gaussian pre-smoothing before upsampling (HF skips it)
    return [processing.postprocess_pointmap(pointmaps[i : i + 1], scales[i : i + 1], row, smooth=True)[0]["pointmap"]
            .cpu() for i, row in enumerate(rows(inputs))]


def run_albedo(ctx: Inference, images) -> list[torch.Tensor]:
    inputs = ctx.prepare("albedo", images, pad=True)
    albedo = ctx.forward("albedo", inputs.pixel_values).albedo.float()
    return [processing.postprocess_albedo(albedo[i : i + 1], row)[0].cpu() for i, row in enumerate(rows(inputs))]


def run_matting(ctx: Inference, images) -> list[dict]:
    inputs = ctx.prepare("matting", images, pad=False)
    out = ctx.forward("matting", inputs.pixel_values)
    return [{k: v.cpu() for k, v in processing.postprocess_matting(
                out.foregrounds[i : i + 1].float(), out.alphas[i : i + 1].float(), target_sizes=[size],
                background=(255, 255, 255))[0].items()}
            for i, size in enumerate(inputs.image_sizes)]


def run_features(ctx: Inference, images) -> list[dict]:
    inputs = ctx.prepare("features", images, pad=False)
    out = ctx.forward("features", inputs.pixel_values)
    return [{"cls": out.cls[i].cpu(), "features": out.features[i].cpu()} for i in range(len(images))]


def run_pose(ctx: Inference, images, boxes: list[list]) -> list[list[dict]]:
    """Top-down: crop each person box, heatmaps (with the flip test), decode to image pixels."""
    if not any(boxes):
        return [[] for _ in images]
    with_people = [i for i, image_boxes in enumerate(boxes) if image_boxes]
    if len(with_people) < len(images):  # preprocess_crops wants boxes for every image it is given
        people = run_pose(ctx, [images[i] for i in with_people], [boxes[i] for i in with_people])
        found = dict(zip(with_people, people))
        return [found.get(i, []) for i in range(len(images))]
    inputs = processing.preprocess_crops(images, boxes, ctx.input_size("pose"), resample=ctx.resample,
                                         device=ctx.device)
    flip_test = ctx.models["pose"].model.flip_test
    heatmaps = [ctx.forward("pose", chunk, flip_test) if ctx.flip else ctx.forward("pose", chunk).heatmaps
                for chunk in inputs.pixel_values.split(ctx.batch_size)]  # people, not images: a photo may hold many
    people = processing.postprocess_pose(torch.cat(heatmaps).float(), inputs)
    return [[{k: v.cpu() for k, v in person.items()} for person in image_people] for image_people in people]


DENSE_RUNNERS = {"normal": run_normal, "pointmap": run_pointmap, "albedo": run_albedo, "matting": run_matting,
                 "features": run_features}


def run_detector(ctx: Inference, images) -> list[torch.Tensor | None]:
    if ctx.detector is None:
        return [None] * len(images)
    start = time.perf_counter()
    detected = [boxes.cpu() for boxes in ctx.detector(images)]
    ctx.timings["detector"] = ctx.timings.get("detector", 0.0) + time.perf_counter() - start
    return detected


@dataclass
class TaskFailed:
    """One task's failure on one image: its outputs are not written, the image's other tasks' are."""
    error: Exception


def run_each(ctx: Inference, runner, images: list, *per_image: list) -> list:
    """`runner` on the batch; if that fails, image by image, so a failure (an odd image, out of memory) costs
    only its own image: that image gets a TaskFailed."""
    try:
        return runner(ctx, images, *per_image)
    except Exception as error:  # noqa: BLE001 (any failure of one image must not end the run)
        if len(images) == 1:
            return [TaskFailed(error)]
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()
    return [run_each(ctx, runner, [image], *([values[i]] for values in per_image))[0]
            for i, image in enumerate(images)]


def infer(ctx: Inference, items: list[InputImage], images: list[torch.Tensor]) -> list[dict]:
    """All requested tasks on one batch -> per image {task: result or TaskFailed, "mask": foreground, None
    or TaskFailed, "warnings": [...]}. Each task runs on its own: one failing (e.g. on a 3x2000 image) keeps the
    others."""
    results = [{"mask": None, "warnings": []} for _ in images]
    segmentations = run_each(ctx, run_seg, images) if "seg" in ctx.models else [None] * len(images)
    for result, seg in zip(results, segmentations):
        if "seg" in ctx.tasks:
            result["seg"] = seg
        if ctx.mask_with_seg:
            result["mask"] = seg if isinstance(seg, TaskFailed) else processing.foreground_mask(seg)
    for task, runner in DENSE_RUNNERS.items():
        if task in ctx.tasks:
            for result, value in zip(results, run_each(ctx, runner, images)):
                result[task] = value
    if "pose" in ctx.tasks:
        detected = run_each(ctx, run_detector, images)  # a detector failure fails the image's pose only
        segs = segmentations if ctx.seg_boxes else [None] * len(images)
        boxes, sources, scores, warnings = zip(*(
            ([], None, None, []) if isinstance(found, TaskFailed) else
            pose_boxes(item, image, ctx.boxes, None if isinstance(seg, TaskFailed) else seg, found)
            for item, image, seg, found in zip(items, images, segs, detected)))
        for result, people, source, score, found, said in zip(results, run_each(ctx, run_pose, images, list(boxes)),
                                                              sources, scores, detected, warnings):
            failed = found if isinstance(found, TaskFailed) else people if isinstance(people, TaskFailed) else None
            result["pose"] = failed or {"people": people, "box_source": source, "detector_scores": score}
            result["warnings"] += said
    return results
