"""Inference: a batch of images (uint8 (3, H, W) tensors) -> per image, each task's result on the CPU (or the
TaskFailed of a task that failed on it). Each task runs on its own; a batch that fails is retried image by image.

Everything that is tensor math runs on the model's device, where each decoded photo goes once (Inference.on_device):
preprocessing (resize, padding, normalisation, person crops) and post-processing (upsampling back to the photo,
argmax, normalisation, smoothing, heatmap decoding). A result leaves the device at one point, HostCopies
(Inference.to_host), and only as what the files need: a class map as uint8 (not 29 full-size fp32 maps), the alpha
and composite of a matte as uint8, keypoints; it counts the bytes.

Two steps around the model may happen in other threads, so that the model runs batch after batch: each image's model
inputs can be made ahead (prepare_ahead, in the decode thread; pose's crops too when its boxes need no model), and a
dense or pose result is a Pending whose post-processing (back to the photo's size; heatmap decoding) runs where it is
first needed, in the threads that make the files.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import torch

from sapiens2 import processing
from sapiens2_app.predict.boxes import boxes_for, pose_boxes
from sapiens2_app.predict.inputs import InputImage
from sapiens2_app.predict.models import LoadedModel

# How each task's model sees the whole image: plain resize (ignoring the aspect ratio, as the original seg demo and
# HF), or aspect-preserving resize + padding (as the original normal/pointmap/albedo demos). Pose sees person crops.
PADDED = {"seg": False, "normal": True, "pointmap": True, "albedo": True, "matting": False, "features": False}


@dataclass
class HostCopies:
    """The one point where results leave the model's device for the host: tensors (in dicts, lists, tuples) are
    copied to the CPU, and their bytes counted (run.json's `device_to_host`). On a CPU device nothing is copied;
    the bytes are counted all the same (what a GPU run would copy). Called from several threads (the file makers)."""
    bytes: int = 0
    tensors: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __call__(self, value):
        if isinstance(value, dict):
            return {key: self(one) for key, one in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self(one) for one in value)
        if not torch.is_tensor(value):
            return value
        with self.lock:
            self.bytes += value.nbytes
            self.tensors += 1
        return value.cpu()


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
    to_host: HostCopies = field(default_factory=HostCopies)  # where every result leaves the device

    def input_size(self, task: str) -> tuple[int, int]:
        return self.size or tuple(self.models[task].backbone.config.image_size)

    def on_device(self, images: list[torch.Tensor]) -> list[torch.Tensor]:
        """The decoded uint8 images on the model's device, copied there once for all the tasks (non_blocking: from
        pinned memory, as the decode pins them for a GPU, the copy does not wait for the CPU)."""
        return [image.to(self.device, non_blocking=True) for image in images]

    def prepare(self, task: str, images) -> processing.ModelInputs:
        return processing.preprocess(images, self.input_size(task), pad=PADDED[task], resample=self.resample,
                                     device=self.device)

    def prepare_ahead(self, image: torch.Tensor, item: InputImage | None = None) -> dict:
        """One image's input to each whole-image model (or why it cannot be made), before its batch runs; and its
        pose crops (PoseAhead) when its boxes need no model (`item`: its --boxes entry, else the whole image). Under
        "image", the image on the device, which the batch uses too (one copy for everything)."""
        try:
            (image,) = self.on_device([image])
        except Exception:  # noqa: BLE001 (e.g. out of device memory: made when its batch runs, where it is reported)
            return {}
        prepared = {"image": image}
        for task in PADDED:
            if task in self.models:
                try:
                    prepared[task] = self.prepare(task, [image])
                except Exception as error:  # noqa: BLE001 (the task fails on this image only, when it runs)
                    prepared[task] = error
        if item is not None and self.boxes_known_ahead(item):
            try:
                prepared["pose"] = self.pose_ahead(item, image)
            except Exception:  # noqa: BLE001 (made again when its batch runs, where a failure is reported)
                pass
        return prepared

    def boxes_known_ahead(self, item: InputImage) -> bool:
        """Are the item's pose boxes known without a model: a --boxes entry, or the whole image (no detector, no
        segmentation blobs)?"""
        if "pose" not in self.tasks or self.detector is not None:
            return False
        return not self.seg_boxes or (self.boxes is not None and boxes_for(item, self.boxes) is not None)

    def pose_ahead(self, item: InputImage, image: torch.Tensor) -> "PoseAhead":
        boxes, source, scores, warnings = pose_boxes(item, image, self.boxes, None)
        crops = processing.preprocess_crops([image], [boxes], self.input_size("pose"), resample=self.resample,
                                            device=self.device) if boxes else None
        return PoseAhead(boxes, source, scores, warnings, crops)

    def inputs(self, task: str, images, prepared: list | None) -> processing.ModelInputs:
        """A batch's input to the task's model: the images' inputs made ahead, else made now."""
        if prepared is None or any(one is None for one in prepared):
            return self.prepare(task, images)
        for one in prepared:
            if isinstance(one, Exception):
                raise one
        return processing.ModelInputs(torch.cat([one.pixel_values for one in prepared]),
                                      [one.image_sizes[0] for one in prepared],
                                      [one.content_boxes[0] for one in prepared], prepared[0].model_size)

    def forward(self, task: str, pixel_values: torch.Tensor, method=None):
        """The task's model (or `method`, e.g. its flip test) on a batch, timed for the manifest."""
        start = time.perf_counter()
        with torch.no_grad():
            output = (method or self.models[task].model)(pixel_values.to(self.dtype))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.timings[task] = self.timings.get(task, 0.0) + time.perf_counter() - start
        return output


@dataclass
class PoseAhead:
    """One image's pose boxes (as pose_boxes gives them) and their crops (None: no boxes), made before its batch."""
    boxes: list
    source: str | None
    scores: list | None
    warnings: list[str]
    crops: processing.ModelInputs | None


def merged_crops(crops: list[processing.ModelInputs]) -> processing.ModelInputs:
    """Images' crops made one image at a time (PoseAhead) as one batch, as preprocess_crops makes it."""
    indices = [image for image, one in enumerate(crops) for _ in one.image_indices]
    return processing.ModelInputs(torch.cat([one.pixel_values for one in crops]),
                                  [size for one in crops for size in one.image_sizes],
                                  [box for one in crops for box in one.content_boxes], crops[0].model_size,
                                  torch.cat([one.boxes for one in crops]), indices, len(crops))


class Pending:
    """One image's result of a task, still to be post-processed from the model's output (resized back to the photo,
    to the CPU): computed once, where it is first needed (the threads that make the files, while the model runs the
    next batch; pose's boxes or --mask-with-seg need the segmentation at once)."""

    def __init__(self, compute: Callable):
        self.compute, self.value = compute, None

    def result(self):
        if self.compute is not None:
            self.value, self.compute = self.compute(), None
        return self.value


def resolved(value):
    """A result, post-processed if it was pending; a failure of that becomes the task's TaskFailed."""
    if not isinstance(value, Pending):
        return value
    try:
        return value.result()
    except Exception as error:  # noqa: BLE001 (this image's task fails, the rest of the run goes on)
        return TaskFailed(error)


def rows(inputs: processing.ModelInputs) -> list[processing.ModelInputs]:
    """Per-image bookkeeping, to post-process one image at a time (full-size maps of a batch can be GBs)."""
    return [processing.ModelInputs(None, [s], [c], inputs.model_size)
            for s, c in zip(inputs.image_sizes, inputs.content_boxes)]


def run_seg(ctx: Inference, images, prepared=None) -> list[Pending]:
    inputs = ctx.inputs("seg", images, prepared)
    logits = ctx.forward("seg", inputs.pixel_values).logits
    return [Pending(partial(_seg_back, logits[i : i + 1], row, ctx.to_host)) for i, row in enumerate(rows(inputs))]


def _seg_back(logits, row, to_host) -> torch.Tensor:
    """(1, C, h, w) logits -> the photo's (H, W) class map, upsampled and argmaxed on the device; to the host in
    the smallest integer type that holds C classes (uint8 for 29: 1/8 of the int64 argmax, 1/116 of the logits)."""
    classes = processing.postprocess_segmentation(logits.float(), row)[0]
    return to_host(classes.to(class_map_dtype(logits.shape[1])))


def class_map_dtype(num_classes: int) -> torch.dtype:
    """The smallest integer type holding the class ids 0..num_classes - 1 (the .seg.png stores their low byte)."""
    return torch.uint8 if num_classes <= 256 else torch.int16 if num_classes <= 2**15 else torch.int64


def run_normal(ctx: Inference, images, prepared=None) -> list[Pending]:
    inputs = ctx.inputs("normal", images, prepared)
    normals = ctx.forward("normal", inputs.pixel_values).normals
    return [Pending(partial(_normal_back, normals[i : i + 1], row, ctx.to_host)) for i, row in enumerate(rows(inputs))]


def _normal_back(normals, row, to_host) -> torch.Tensor:
    return to_host(processing.postprocess_normals(normals.float(), row)[0])


def run_pointmap(ctx: Inference, images, prepared=None) -> list[Pending]:
    inputs = ctx.inputs("pointmap", images, prepared)
    out = ctx.forward("pointmap", inputs.pixel_values)
    return [Pending(partial(_pointmap_back, out.pointmaps[i : i + 1], out.scales[i : i + 1], row, ctx.to_host))
            for i, row in enumerate(rows(inputs))]


def _pointmap_back(pointmaps, scales, row, to_host) -> torch.Tensor:
    # smooth: the original demo's Gaussian pre-smoothing before upsampling (HF skips it)
    return to_host(processing.postprocess_pointmap(pointmaps.float(), scales.float(), row, smooth=True)[0]["pointmap"])


def run_albedo(ctx: Inference, images, prepared=None) -> list[Pending]:
    inputs = ctx.inputs("albedo", images, prepared)
    albedo = ctx.forward("albedo", inputs.pixel_values).albedo
    return [Pending(partial(_albedo_back, albedo[i : i + 1], row, ctx.to_host)) for i, row in enumerate(rows(inputs))]


def _albedo_back(albedo, row, to_host) -> torch.Tensor:
    """The photo's (3, H, W) albedo as the .albedo.png stores it, uint8, made on the device."""
    return to_host(processing.albedo_to_uint8(processing.postprocess_albedo(albedo.float(), row)[0]))


def run_matting(ctx: Inference, images, prepared=None) -> list[Pending]:
    inputs = ctx.inputs("matting", images, prepared)
    out = ctx.forward("matting", inputs.pixel_values)
    return [Pending(partial(_matting_back, out.foregrounds[i : i + 1], out.alphas[i : i + 1], size, ctx.to_host))
            for i, size in enumerate(inputs.image_sizes)]


def _matting_back(foregrounds, alphas, size, to_host) -> dict:
    """The files' matte: {"alpha": (H, W) uint8, "composite": (3, H, W) uint8 over white}, made on the device (the
    premultiplied foreground, which no file stores, stays there)."""
    matte = processing.postprocess_matting(foregrounds.float(), alphas.float(), target_sizes=[size],
                                           background=(255, 255, 255))[0]
    return to_host({"alpha": processing.float_to_uint8(matte["alpha"][0]), "composite": matte["composite"]})


def run_features(ctx: Inference, images, prepared=None) -> list[dict]:
    inputs = ctx.inputs("features", images, prepared)
    out = ctx.forward("features", inputs.pixel_values)
    return [ctx.to_host({"cls": out.cls[i], "features": out.features[i]}) for i in range(len(images))]


def run_pose(ctx: Inference, images, boxes: list[list], crops: list | None = None) -> list[list[dict] | Pending]:
    """Top-down: crop each person box, heatmaps (with the flip test); per image its people, decoded to image
    pixels where they are first needed (a Pending; [] for an image without boxes). `crops`: per image, its crops
    made ahead (PoseAhead.crops), else made here."""
    if not any(boxes):
        return [[] for _ in images]
    with_people = [i for i, image_boxes in enumerate(boxes) if image_boxes]
    if len(with_people) < len(images):  # preprocess_crops wants boxes for every image it is given
        people = run_pose(ctx, [images[i] for i in with_people], [boxes[i] for i in with_people],
                          crops and [crops[i] for i in with_people])
        found = dict(zip(with_people, people))
        return [found.get(i, []) for i in range(len(images))]
    inputs = merged_crops(crops) if crops else processing.preprocess_crops(
        images, boxes, ctx.input_size("pose"), resample=ctx.resample, device=ctx.device)
    flip_test = ctx.models["pose"].model.flip_test
    heatmaps = [ctx.forward("pose", chunk, flip_test) if ctx.flip else ctx.forward("pose", chunk).heatmaps
                for chunk in inputs.pixel_values.split(ctx.batch_size)]  # people, not images: a photo may hold many
    heatmaps = heatmaps[0] if len(heatmaps) == 1 else torch.cat(heatmaps)  # cat copies (60 MB a person)
    return [Pending(partial(_pose_back, heatmaps[rows], one, ctx.to_host)) for rows, one in crops_by_image(inputs)]


def crops_by_image(inputs: processing.ModelInputs) -> list[tuple[slice, processing.ModelInputs]]:
    """Per image, its rows of a crop batch and their bookkeeping (every image has people here, in order)."""
    split, start = [], 0
    for image in range(inputs.num_images):
        count = inputs.image_indices.count(image)
        rows = slice(start, start + count)
        split.append((rows, processing.ModelInputs(None, inputs.image_sizes[rows], inputs.content_boxes[rows],
                                                   inputs.model_size, inputs.boxes[rows], [0] * count, 1)))
        start += count
    return split


def _pose_back(heatmaps, crops, to_host) -> list[dict]:
    """An image's heatmaps -> its people (keypoints, scores, labels, box), decoded (DARK-UDP) on the device."""
    return to_host(processing.postprocess_pose(heatmaps.float(), crops)[0])


DENSE_RUNNERS = {"normal": run_normal, "pointmap": run_pointmap, "albedo": run_albedo, "matting": run_matting,
                 "features": run_features}


def run_detector(ctx: Inference, images) -> list[torch.Tensor | None]:
    if ctx.detector is None:
        return [None] * len(images)
    start = time.perf_counter()
    detected = [ctx.to_host(boxes) for boxes in ctx.detector(images)]
    ctx.timings["detector"] = ctx.timings.get("detector", 0.0) + time.perf_counter() - start
    return detected


def pose_result(people: list | Pending, source: str | None, scores: list | None) -> dict | Pending:
    """An image's pose result, {"people", "box_source", "detector_scores"}: pending while its people are."""
    if isinstance(people, Pending):
        return Pending(lambda: pose_result(people.result(), source, scores))
    return {"people": people, "box_source": source, "detector_scores": scores}


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


def infer(ctx: Inference, items: list[InputImage], images: list[torch.Tensor], prepared: list | None = None) -> list[dict]:
    """All requested tasks on one batch -> per image {task: result, Pending result or TaskFailed, "mask":
    foreground, None or TaskFailed, "warnings": [...]}. Each task runs on its own: one failing (e.g. on a 3x2000
    image) keeps the others. `prepared`: per image, prepare_ahead's inputs (None: made here)."""
    results = [{"mask": None, "warnings": []} for _ in images]
    prepared = prepared or [{} for _ in images]
    # every model's input is made from these, on the device (the copies made ahead, else copied now)
    images = ctx.on_device([one.get("image", image) for one, image in zip(prepared, images)])

    def ahead(task):
        return [one.get(task) for one in prepared]

    segmentations = run_each(ctx, run_seg, images, ahead("seg")) if "seg" in ctx.models else [None] * len(images)
    if ctx.mask_with_seg or ("pose" in ctx.tasks and ctx.seg_boxes):  # needed now, not only in the files
        segmentations = [resolved(seg) for seg in segmentations]
    for result, seg in zip(results, segmentations):
        if "seg" in ctx.tasks:
            result["seg"] = seg
        if ctx.mask_with_seg:
            result["mask"] = seg if isinstance(seg, TaskFailed) else processing.foreground_mask(seg)
    for task, runner in DENSE_RUNNERS.items():
        if task in ctx.tasks:
            for result, value in zip(results, run_each(ctx, runner, images, ahead(task))):
                result[task] = value
    if "pose" in ctx.tasks:
        made = ahead("pose")
        if all(isinstance(one, PoseAhead) for one in made):  # boxes and crops made in the decode thread
            detected = [None] * len(images)
            boxes, sources, scores, warnings = zip(*((one.boxes, one.source, one.scores, one.warnings)
                                                     for one in made))
            everyone = run_each(ctx, run_pose, images, list(boxes), [one.crops for one in made])
        else:
            detected = run_each(ctx, run_detector, images)  # a detector failure fails the image's pose only
            segs = segmentations if ctx.seg_boxes else [None] * len(images)
            boxes, sources, scores, warnings = zip(*(
                ([], None, None, []) if isinstance(found, TaskFailed) else
                pose_boxes(item, image, ctx.boxes, None if isinstance(seg, TaskFailed) else seg, found)
                for item, image, seg, found in zip(items, images, segs, detected)))
            everyone = run_each(ctx, run_pose, images, list(boxes))
        for result, people, source, score, found, said in zip(results, everyone, sources, scores, detected, warnings):
            failed = found if isinstance(found, TaskFailed) else people if isinstance(people, TaskFailed) else None
            result["pose"] = failed or pose_result(people, source, score)
            result["warnings"] += said
    return results
