"""Run Sapiens2 on your images: every task, one command, files you can open.

    python predict.py seg photos/ -o out/                      # a folder (recursive)
    python predict.py seg,normal,pose "shots/**/*.jpg" -o out/ # several tasks; globs; a .txt list of paths
    python predict.py pose photos/ --boxes boxes.json          # your own person boxes (COCO xywh)
    python predict.py normal photos/ --model 1b --mask-with-seg
    torchrun --nproc-per-node 8 predict.py seg,pose photos/ -o out/   # each GPU takes its share

Tasks: seg, pose, normal, pointmap, matting, albedo, features. Outputs are mirrored under OUT by input path
(`photos/a/b.jpg` -> `out/a/b.seg.png`, ...; see ARTEFACTS), plus a `run.json` manifest. A bad image is
reported and skipped; the run goes on. Exit status: 0 all good, 1 some images failed (single process only),
2 nothing could run.

Pose is top-down: person boxes come from `--boxes`, else from the segmentation's foreground (connected
blobs, small ones dropped), else the whole image. The flip test is on by default, as in the original demo.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path, PurePosixPath

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageDraw, ImageFont
from safetensors.torch import save_file

import heads
import processing
import weights
from metadata import keypoint_metadata
from runtime_info import versions
from sapiens2 import PRESETS, Sapiens2, Sapiens2Config

TASKS = ("seg", "pose", "normal", "pointmap", "matting", "albedo", "features")
KINDS = ("raw", "json", "vis")
# What each task writes: file suffix -> the --save kinds that ask for it.
ARTEFACTS = {
    "seg": {".seg.png": {"raw"}, ".seg_overlay.jpg": {"vis"}},
    "pose": {".pose.json": {"json"}, ".pose_overlay.jpg": {"vis"}},
    "normal": {".normal.npy": {"raw"}, ".normal.png": {"vis"}},
    "pointmap": {".pointmap.npy": {"raw"}, ".depth.png": {"vis"}},
    "matting": {".alpha.png": {"raw"}, ".composite.jpg": {"vis"}},
    "albedo": {".albedo.png": {"raw", "vis"}},
    "features": {".features.safetensors": {"raw"}},
}
OUTPUT_SUFFIXES = tuple(suffix for files in ARTEFACTS.values() for suffix in files)
MASKED_TASKS = ("normal", "pointmap", "albedo")  # what --mask-with-seg masks
IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff", ".gif", ".ppm", ".pgm"}
LIST_SUFFIXES = {".txt", ".lst", ".list"}
DEFAULT_SIZE = "0.4b"
RELEASED_SIZE = {"matting": "1b"}  # the only matting checkpoint is 1b
MIN_BLOB_FRACTION = 0.1  # person blobs smaller than this fraction of the largest one are dropped
MIN_BLOB_AREA = 0.002  # ... and blobs under this fraction of the image
BLOB_GRID = 512  # connected components are found on the mask max-pooled to at most this many pixels a side


class UsageError(Exception):
    """Bad arguments or inputs: reported without a traceback, exit status 2."""


# ----------------------------------------------------------------------------------------------------
# Inputs: files, folders, globs, list files -> (path, output name)
# ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class InputImage:
    path: Path
    relative: str  # the path relative to its input root, e.g. "a/b.jpg"; outputs go to OUT/a/b.<suffix>

    @property
    def stem(self) -> str:
        return PurePosixPath(self.relative).with_suffix("").as_posix()


def collect_inputs(specs: list[str], exclude: Path | None = None) -> list[InputImage]:
    """All images of the inputs, deduplicated, sorted by relative path (the order sharding splits)."""
    files = [s for s in specs if not glob.has_magic(s) and Path(s).is_file() and not is_list_file(s)]
    items = relative_to_common([Path(f) for f in files])
    for spec in specs:
        if spec in files:
            continue
        found = expand_input(spec, exclude)
        if not found:
            print(f"warning: {spec}: no images found", file=sys.stderr)
        items += found
    unique = {item.path.resolve(): item for item in reversed(items)}  # the first mention wins
    items = sorted(unique.values(), key=lambda item: item.relative)
    clashes = [a.relative for a, b in zip(items, items[1:]) if a.relative == b.relative]
    if clashes:
        raise UsageError(f"different inputs would write the same outputs ({', '.join(clashes[:3])}); "
                         f"run them separately or with different -o folders")
    if not items:
        raise UsageError(f"no images found in {' '.join(specs)}")
    return items


def is_list_file(spec: str) -> bool:
    return Path(spec).suffix.lower() in LIST_SUFFIXES


def expand_input(spec: str, exclude: Path | None = None) -> list[InputImage]:
    if glob.has_magic(spec):
        base = glob_base(spec)
        paths = [Path(p) for p in sorted(glob.glob(spec, recursive=True))]
        return [InputImage(p, p.relative_to(base).as_posix()) for p in paths if wanted(p, exclude)]
    path = Path(spec)
    if path.is_dir():
        paths = [p for p in sorted(path.rglob("*")) if wanted(p, exclude)
                 and not any(part.startswith(".") for part in p.relative_to(path).parts)]
        return [InputImage(p, p.relative_to(path).as_posix()) for p in paths]
    if path.is_file() and is_list_file(spec):
        return read_list_file(path, exclude)
    if path.is_file():
        return relative_to_common([path])
    raise UsageError(f"{spec}: no such file or folder")


def wanted(path: Path, exclude: Path | None) -> bool:
    """An image file by its name, and not one of our pictures in the output folder `exclude` (with -o inside
    the input folder, a second run would otherwise take the first one's overlays for photos)."""
    ours = path.name.endswith(OUTPUT_SUFFIXES) and exclude is not None and path.resolve().is_relative_to(exclude)
    return path.is_file() and path.suffix.lower() in IMAGE_SUFFIXES and not ours


def glob_base(pattern: str) -> Path:
    """The folder part of a glob before its first wildcard: outputs mirror the paths below it."""
    parts = Path(pattern).parts
    static = parts[: next(i for i, p in enumerate(parts) if glob.has_magic(p))]
    return Path(*static) if static else Path(".")


def read_list_file(path: Path, exclude: Path | None) -> list[InputImage]:
    """One image path (or folder) per line, relative to the list file's folder; blank lines and # comments skipped."""
    lines = [line.strip() for line in path.read_text().splitlines()]
    entries = [path.parent / line for line in lines if line and not line.startswith("#")]
    missing = [str(e) for e in entries if not e.exists()]
    if missing:
        raise UsageError(f"{path}: {len(missing)} listed paths do not exist, e.g. {missing[:3]}")
    items = relative_to_common([e for e in entries if e.is_file()])
    for folder in (e for e in entries if e.is_dir()):
        items += expand_input(str(folder), exclude)
    return items


def relative_to_common(paths: list[Path]) -> list[InputImage]:
    """Files named relative to their common folder, so `a/x.jpg b/x.jpg` -> `a/x`, `b/x` (no clash)."""
    if not paths:
        return []
    base = Path(os.path.commonpath([str(p.resolve().parent) for p in paths]))
    return [InputImage(p, p.resolve().relative_to(base).as_posix()) for p in paths]


def output_names(items: list[InputImage]) -> dict[InputImage, str]:
    """Output name of each image: its relative path without the suffix, or with it where two would clash
    (`x.jpg` and `x.png` in one folder -> `x.jpg.*` and `x.png.*`)."""
    counts: dict[str, int] = {}
    for item in items:
        counts[item.stem] = counts.get(item.stem, 0) + 1
    return {item: item.stem if counts[item.stem] == 1 else item.relative for item in items}


def shard(items: list, rank: int, world_size: int) -> list:
    """Rank r of N takes items r, r + N, r + 2N, ... of the sorted list: disjoint, together complete."""
    return items[rank::world_size]


def rank_and_world() -> tuple[int, int]:
    """From torchrun's (or any launcher's) RANK / WORLD_SIZE environment variables; 0, 1 when absent."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if not 0 <= rank < world:
        raise UsageError(f"RANK={rank} is not in [0, WORLD_SIZE={world})")
    return rank, world


def read_boxes_file(path: str) -> dict[str, list[list[float]]]:
    """--boxes: a JSON object, image file name -> list of COCO [x, y, w, h] boxes in image pixels."""
    try:
        boxes = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise UsageError(f"--boxes {path}: cannot read it as JSON ({error})") from None
    if not isinstance(boxes, dict):
        raise UsageError(f"--boxes {path}: expected an object {{\"image.jpg\": [[x, y, w, h], ...]}}")
    for name, entry in boxes.items():
        ok = isinstance(entry, list) and all(
            isinstance(b, list) and len(b) == 4 and all(isinstance(v, (int, float)) for v in b) for b in entry)
        if not ok:
            raise UsageError(f"--boxes {path}: {name!r} must map to a list of [x, y, w, h] boxes, got {entry!r}")
    return boxes


def boxes_for(item: InputImage, boxes: dict) -> list | None:
    """The --boxes entry of an image, looked up by relative path, file name, path as given, absolute path."""
    for key in (item.relative, item.path.name, str(item.path), str(item.path.resolve())):
        if key in boxes:
            return boxes[key]
    return None


# ----------------------------------------------------------------------------------------------------
# Person boxes from segmentation: connected foreground blobs
# ----------------------------------------------------------------------------------------------------
def connected_components(mask: np.ndarray) -> list[tuple[int, int, int, int, int]]:
    """8-connected blobs of a (H, W) bool mask -> [(area, x0, y0, x1, y1)] (inclusive pixel bounds).

    Run-length labelling: every row's horizontal runs are found at once with numpy, then runs of
    neighbouring rows that touch (overlap or meet diagonally) are joined with union-find.
    """
    height = mask.shape[0]
    edges = np.diff(np.pad(mask.astype(np.int8), ((0, 0), (1, 1))), axis=1)  # (H, W+1): +1 run start, -1 run end
    rows, starts = np.nonzero(edges == 1)
    _, ends = np.nonzero(edges == -1)  # exclusive ends, in the same row-major order as the starts
    parent = np.arange(len(rows))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    first = np.searchsorted(rows, np.arange(height + 1))  # runs of row r: first[r] .. first[r + 1] - 1
    for r in range(1, height):
        i, j = first[r - 1], first[r]
        while i < first[r] and j < first[r + 1]:
            if starts[i] <= ends[j] and starts[j] <= ends[i]:  # 8-connected: touching diagonally counts
                parent[find(i)] = find(j)
            if ends[i] < ends[j]:
                i += 1
            else:
                j += 1
    _, blob = np.unique([find(i) for i in range(len(rows))], return_inverse=True)  # blob id of each run
    count = int(blob.max()) + 1 if len(blob) else 0
    area = np.bincount(blob, weights=ends - starts, minlength=count)
    x0, y0 = np.full(count, mask.shape[1]), np.full(count, height)
    x1, y1 = np.full(count, -1), np.full(count, -1)
    np.minimum.at(x0, blob, starts), np.minimum.at(y0, blob, rows)
    np.maximum.at(x1, blob, ends - 1), np.maximum.at(y1, blob, rows)
    return [tuple(int(v) for v in b) for b in zip(area, x0, y0, x1, y1)]


def person_boxes(segmentation: torch.Tensor) -> list[list[float]]:
    """COCO xywh boxes around the foreground blobs of a (H, W) class map, largest first; small blobs (a
    stray hand, noise) are dropped. Empty when there is no foreground."""
    height, width = segmentation.shape
    factor = max(1, -(-max(height, width) // BLOB_GRID))  # ceil: work on a grid of at most BLOB_GRID a side
    mask = processing.foreground_mask(segmentation.cpu())[None, None].float()
    grid = (F.max_pool2d(mask, factor, ceil_mode=True) if factor > 1 else mask)[0, 0].bool().numpy()
    blobs = sorted(connected_components(grid), reverse=True)
    if not blobs:
        return []
    keep = [b for b in blobs if b[0] >= MIN_BLOB_FRACTION * blobs[0][0] and b[0] >= MIN_BLOB_AREA * grid.size]
    boxes = []
    for _, x0, y0, x1, y1 in keep:  # grid cells -> image pixels (inclusive bounds, as the whole-image box)
        x0, y0 = x0 * factor, y0 * factor
        x1, y1 = min((x1 + 1) * factor, width) - 1, min((y1 + 1) * factor, height) - 1
        boxes.append([float(x0), float(y0), float(x1 - x0), float(y1 - y0)])
    return boxes


def whole_image_box(image: torch.Tensor) -> list[list[float]]:
    """The original demo's fallback: one box xyxy [0, 0, W - 1, H - 1]."""
    height, width = image.shape[-2:]
    return [[0.0, 0.0, float(width - 1), float(height - 1)]]


# ----------------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------------
@dataclass
class LoadedModel:
    model: torch.nn.Module
    source: str
    random: bool = False

    @property
    def backbone(self) -> Sapiens2:
        return self.model.backbone if isinstance(self.model, heads.Sapiens2ForTask) else self.model


def parse_model_specs(specs: list[str]) -> tuple[str | None, dict[str, str]]:
    """--model values -> (the source for every task, per-task sources). `TASK=SOURCE` picks one task; a
    task preset (`seg-1b`) names its own task; anything else (a size, a path, a hub id) is for all."""
    default, per_task = None, {}
    for spec in specs:
        task, sep, source = spec.partition("=")
        if sep and task in TASKS:
            per_task[task] = source
        elif spec in heads.TASK_PRESETS:
            per_task[spec.split("-", 1)[0]] = spec
        elif default is None:
            default = spec
        else:
            raise UsageError(f"--model {default} and --model {spec} both apply to every task; "
                             f"give one per task as TASK=SOURCE, e.g. --model seg={spec}")
    return default, per_task


def model_source(task: str, default: str | None, per_task: dict[str, str]) -> str:
    """The checkpoint a task loads: a preset name (-> its hub id), a hub id, a file or a folder."""
    if task in per_task:
        source = per_task[task]
    elif default is None or default in PRESETS:
        source = default or RELEASED_SIZE.get(task, DEFAULT_SIZE)
    else:
        return default
    if source in PRESETS:  # a size: the released checkpoint of this task at this size
        return source if task == "features" else f"{task}-{source}"
    return source


def needs_seg_model(args, tasks: list[str]) -> bool:
    return "seg" in tasks or args.mask_with_seg or ("pose" in tasks and not args.boxes)


def load_models(args, tasks: list[str], device, dtype) -> dict[str, LoadedModel]:
    """One model per task, + seg when pose boxes or --mask-with-seg need it; a checkpoint is loaded once."""
    default, per_task = parse_model_specs(args.model)
    models, cache = {}, {}
    for task in tasks:
        models[task] = cached_load(cache, task, model_source(task, default, per_task), args, device, dtype)
    if needs_seg_model(args, tasks) and "seg" not in tasks:
        models.update(helper_seg_model(cache, default, per_task, args, device, dtype))
    return models


def helper_seg_model(cache, default, per_task, args, device, dtype) -> dict[str, LoadedModel]:
    """The seg model that pose boxes / --mask-with-seg use when seg itself was not asked for. Without one,
    pose falls back to whole-image boxes (--mask-with-seg cannot do without)."""
    try:
        if default not in (None, *PRESETS) and "seg" not in per_task:
            raise UsageError("no segmentation model given (add --model seg=SOURCE)")
        return {"seg": cached_load(cache, "seg", model_source("seg", default, per_task), args, device, dtype)}
    except UsageError as error:
        if args.mask_with_seg:
            raise UsageError(f"--mask-with-seg needs a segmentation model: {error}") from None
        print(f"note: pose runs on the whole image, as there are no person boxes from segmentation ({error}); "
              f"--boxes gives your own", file=sys.stderr)
        return {}


def cached_load(cache: dict, task: str, source: str, args, device, dtype) -> LoadedModel:
    """Features reuse the backbone of any model loaded from the same source; a task model serves its task."""
    loaded = cache.get(source)
    fits = loaded is not None and (task == "features" or getattr(loaded.model, "task", None) == task)
    if not fits:
        loaded = cache[source] = load_one(task, source, args, device, dtype)
    if task == "features":
        return LoadedModel(loaded.backbone, source, loaded.random)
    return loaded


def load_one(task: str, source: str, args, device, dtype) -> LoadedModel:
    if args.random_init == "always":
        return LoadedModel(random_model(task, source, args).to(device, dtype).eval(), source, random=True)
    try:
        if source in heads.TASK_PRESETS and source not in weights.HUB_IDS:
            raise FileNotFoundError(f"{source}: no released checkpoint; pass a file with --model {task}=PATH")
        model = weights.load(source, dtype=dtype, device=device, task=None if task == "features" else task,
                             rope_dtype=args.rope)
        return LoadedModel(model, source)
    except FileNotFoundError as error:
        if args.random_init != "fallback" or not looks_like_preset_or_hub_id(source):
            raise UsageError(str(error)) from None
        print(f"cannot load {source}: {error}", file=sys.stderr)
        return LoadedModel(random_model(task, source, args).to(device, dtype).eval(), source, random=True)


def looks_like_preset_or_hub_id(source: str) -> bool:
    """Only downloads fall back to random weights; a mistyped local path stays an error."""
    return source in PRESETS or source in heads.TASK_PRESETS or (
        bool(weights.HUB_ID.match(source)) and not Path(source).exists() and not source.endswith(".safetensors"))


def random_model(task: str, source: str, args) -> torch.nn.Module:
    """Random weights with the real architecture: the heads of the source's size (0.4b when it names none;
    the nearest released size where that size has no head) on the --random-backbone (default: same size)."""
    size = source.split("-", 1)[1] if source in heads.TASK_PRESETS else source if source in PRESETS else DEFAULT_SIZE
    torch.manual_seed(TASKS.index(task))  # the same weights in every process (sharded runs agree)
    config = Sapiens2Config.from_preset(args.random_backbone or size, rope_dtype=args.rope)
    if task == "features":
        return Sapiens2(config)
    head_sizes = heads.HEAD_TABLE[task]
    head_size = size if size in head_sizes else RELEASED_SIZE.get(task, DEFAULT_SIZE)
    return heads.build_task_model(config, heads.head_preset(task, head_size))


# ----------------------------------------------------------------------------------------------------
# Inference: images (uint8 (3, H, W) tensors) -> per image results on the CPU
# ----------------------------------------------------------------------------------------------------
@dataclass
class Context:
    tasks: list[str]
    models: dict[str, LoadedModel]
    out: Path
    device: torch.device
    dtype: torch.dtype
    batch_size: int
    size: tuple[int, int] | None
    flip: bool
    kinds: set[str]
    mask_with_seg: bool
    boxes: dict | None
    names: dict[InputImage, str] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    errors: list[dict] = field(default_factory=list)
    done: int = 0

    def input_size(self, task: str) -> tuple[int, int]:
        return self.size or tuple(self.models[task].backbone.config.image_size)

    def prepare(self, task: str, images, pad: bool) -> processing.ModelInputs:
        return processing.preprocess(images, self.input_size(task), pad=pad, device=self.device)

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


def run_seg(ctx: Context, images) -> list[torch.Tensor]:
    inputs = ctx.prepare("seg", images, pad=False)  # plain resize, as the original seg demo and HF
    logits = ctx.forward("seg", inputs.pixel_values).logits.float()
    return [processing.postprocess_segmentation(logits[i : i + 1], row)[0].cpu()
            for i, row in enumerate(rows(inputs))]


def run_normal(ctx: Context, images) -> list[torch.Tensor]:
    inputs = ctx.prepare("normal", images, pad=True)  # aspect-preserving resize + padding, as the original
    normals = ctx.forward("normal", inputs.pixel_values).normals.float()
    return [processing.postprocess_normals(normals[i : i + 1], row)[0].cpu() for i, row in enumerate(rows(inputs))]


def run_pointmap(ctx: Context, images) -> list[torch.Tensor]:
    inputs = ctx.prepare("pointmap", images, pad=True)
    out = ctx.forward("pointmap", inputs.pixel_values)
    pointmaps, scales = out.pointmaps.float(), out.scales.float()
    # smooth: the original demo's Gaussian pre-smoothing before upsampling (HF skips it)
    return [processing.postprocess_pointmap(pointmaps[i : i + 1], scales[i : i + 1], row, smooth=True)[0]["pointmap"]
            .cpu() for i, row in enumerate(rows(inputs))]


def run_albedo(ctx: Context, images) -> list[torch.Tensor]:
    inputs = ctx.prepare("albedo", images, pad=True)
    albedo = ctx.forward("albedo", inputs.pixel_values).albedo.float()
    return [processing.postprocess_albedo(albedo[i : i + 1], row)[0].cpu() for i, row in enumerate(rows(inputs))]


def run_matting(ctx: Context, images) -> list[dict]:
    inputs = ctx.prepare("matting", images, pad=False)
    out = ctx.forward("matting", inputs.pixel_values)
    return [{k: v.cpu() for k, v in processing.postprocess_matting(
                out.foregrounds[i : i + 1].float(), out.alphas[i : i + 1].float(), target_sizes=[size],
                background=(255, 255, 255))[0].items()}
            for i, size in enumerate(inputs.image_sizes)]


def run_features(ctx: Context, images) -> list[dict]:
    inputs = ctx.prepare("features", images, pad=False)
    out = ctx.forward("features", inputs.pixel_values)
    return [{"cls": out.cls[i].cpu(), "features": out.features[i].cpu()} for i in range(len(images))]


def run_pose(ctx: Context, images, boxes: list[list]) -> list[list[dict]]:
    """Top-down: crop each person box, heatmaps (with the flip test), decode to image pixels."""
    if not any(boxes):
        return [[] for _ in images]
    inputs = processing.preprocess_crops(images, boxes, ctx.input_size("pose"), device=ctx.device)
    flip_test = ctx.models["pose"].model.flip_test
    heatmaps = [ctx.forward("pose", chunk, flip_test) if ctx.flip else ctx.forward("pose", chunk).heatmaps
                for chunk in inputs.pixel_values.split(ctx.batch_size)]  # people, not images: a photo may hold many
    people = processing.postprocess_pose(torch.cat(heatmaps).float(), inputs)
    return [[{k: v.cpu() for k, v in person.items()} for person in image_people] for image_people in people]


DENSE_RUNNERS = {"normal": run_normal, "pointmap": run_pointmap, "albedo": run_albedo, "matting": run_matting,
                 "features": run_features}


def pose_boxes(item: InputImage, image, segmentation, given: dict | None) -> tuple[list, str]:
    """(COCO xywh person boxes, where they came from): the --boxes entry, else the segmentation's person
    blobs, else the whole image. (A person detector would slot in here.)"""
    entry = boxes_for(item, given) if given is not None else None
    if entry is not None:
        return entry, "boxes-file"
    found = person_boxes(segmentation) if segmentation is not None else []
    if found:
        return found, "segmentation"
    return whole_image_box(image), "whole-image"


def infer(ctx: Context, items: list[InputImage], images: list[torch.Tensor]) -> list[dict]:
    """All requested tasks on one batch -> per image {task: result, "mask": foreground or None}."""
    results = [{} for _ in images]
    segmentations = run_seg(ctx, images) if "seg" in ctx.models else None
    for i, result in enumerate(results):
        if "seg" in ctx.tasks:
            result["seg"] = segmentations[i]
        result["mask"] = processing.foreground_mask(segmentations[i]) if ctx.mask_with_seg else None
    for task, runner in DENSE_RUNNERS.items():
        if task in ctx.tasks:
            for result, value in zip(results, runner(ctx, images)):
                result[task] = value
    if "pose" in ctx.tasks:
        boxes, sources = zip(*(pose_boxes(item, image, segmentations[i] if segmentations else None, ctx.boxes)
                               for i, (item, image) in enumerate(zip(items, images))))
        for result, people, source in zip(results, run_pose(ctx, images, list(boxes)), sources):
            result["pose"] = {"people": people, "box_source": source}
    return results


# ----------------------------------------------------------------------------------------------------
# Rendering and saving: per task, file suffix -> a function making what goes in the file
# ----------------------------------------------------------------------------------------------------
def render(task: str, item: InputImage, image: torch.Tensor, result: dict, loaded: LoadedModel) -> dict:
    value, mask = result[task], result["mask"] if task in MASKED_TASKS else None
    vis = stamp_random if loaded.random else (lambda picture: picture)
    if task == "seg":
        return {".seg.png": lambda: Image.fromarray(value.to(torch.uint8).numpy()),
                ".seg_overlay.jpg": lambda: vis(processing.overlay_segmentation(image, value))}
    if task == "pose":
        return {".pose.json": lambda: pose_json(item, image, value),
                ".pose_overlay.jpg": lambda: vis(processing.draw_pose(image, value["people"]))}
    if task == "normal":
        return {".normal.npy": lambda: hwc_array(value, mask),
                ".normal.png": lambda: vis(processing.normals_to_image(value, mask))}
    if task == "pointmap":
        return {".pointmap.npy": lambda: hwc_array(value, mask),
                ".depth.png": lambda: vis(depth_picture(value[2], mask))}
    if task == "matting":
        return {".alpha.png": lambda: Image.fromarray(processing.float_to_uint8(value["alpha"][0]).numpy()),
                ".composite.jpg": lambda: vis(processing.to_pil(value["composite"]))}
    if task == "albedo":
        albedo = value if mask is None else value * mask
        return {".albedo.png": lambda: vis(processing.to_pil(processing.float_to_uint8(albedo)))}
    if task == "features":
        about = {"image": item.relative, "height": str(image.shape[-2]), "width": str(image.shape[-1]),
                 "model": loaded.source}
        return {".features.safetensors": lambda: (value, about)}
    raise ValueError(f"unknown task {task!r}")


def hwc_array(value: torch.Tensor, mask: torch.Tensor | None) -> np.ndarray:
    """(3, H, W) -> (H, W, 3) float32, NaN outside the mask."""
    array = value.permute(1, 2, 0).float().numpy().copy()
    if mask is not None:
        array[~mask.numpy()] = np.nan
    return array


def depth_picture(depth: torch.Tensor, mask: torch.Tensor | None) -> Image.Image:
    if mask is not None and not mask.any():  # nobody segmented: nothing to colour
        return Image.new("RGB", (depth.shape[-1], depth.shape[-2]))
    return processing.depth_to_image(depth, mask)


def pose_json(item: InputImage, image: torch.Tensor, value: dict) -> dict:
    """Boxes xyxy, keypoints [x, y, score] x 308 in image pixels; score = mean keypoint score above 0.2."""
    people = []
    for person, entry in zip(value["people"], processing.pose_to_coco([value["people"]], [0])):
        flat = entry["keypoints"]  # [x0, y0, s0, x1, y1, s1, ...]
        keypoints = [[round(x, 2), round(y, 2), round(s, 4)] for x, y, s in zip(flat[0::3], flat[1::3], flat[2::3])]
        people.append({"box": [round(v, 2) for v in person["bbox"].tolist()], "score": round(entry["score"], 4),
                       "keypoints": keypoints})
    return {"image": item.relative, "width": int(image.shape[-1]), "height": int(image.shape[-2]),
            "box_source": value["box_source"], "people": people,
            "keypoint_names": keypoint_metadata()["keypoint_names"]}


def stamp_random(picture: Image.Image) -> Image.Image:
    """Write RANDOM WEIGHTS across the top of a picture, so nobody mistakes it for a result."""
    draw = ImageDraw.Draw(picture)
    try:
        font = ImageFont.load_default(size=max(12, picture.width // 28))
    except TypeError:  # Pillow < 10.1: one small bitmap font
        font = ImageFont.load_default()
    text = "RANDOM WEIGHTS - MEANINGLESS PICTURE"
    _, _, right, bottom = draw.textbbox((6, 6), text, font=font)
    draw.rectangle((0, 0, right + 6, bottom + 6), fill=(255, 255, 255))
    draw.text((6, 6), text, fill=(220, 0, 0), font=font)
    return picture


def save_artefact(path: Path, value):
    """Write to a temporary file and rename it, so an interrupted run never leaves a half-written output.
    value: a dict (.json), an array (.npy), (tensors, metadata) (.safetensors), a PIL image (.png, .jpg)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    if path.suffix == ".json":
        partial.write_text(json.dumps(value))
    elif path.suffix == ".npy":
        with open(partial, "wb") as f:
            np.save(f, value)
    elif path.suffix == ".safetensors":
        tensors, metadata = value
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(partial), metadata=metadata)
    elif path.suffix == ".jpg":
        value.save(partial, format="JPEG", quality=90)
    else:
        value.save(partial, format="PNG")
    os.replace(partial, path)


def expected_outputs(ctx: Context, item: InputImage) -> list[Path]:
    return [ctx.out / (ctx.names[item] + suffix) for task in ctx.tasks
            for suffix, kinds in ARTEFACTS[task].items() if kinds & ctx.kinds]


def all_written(ctx: Context, item: InputImage) -> bool:
    return all(path.exists() for path in expected_outputs(ctx, item))


def write_outputs(ctx: Context, item: InputImage, image: torch.Tensor, result: dict):
    for task in ctx.tasks:
        makers = render(task, item, image, result, ctx.models[task])
        for suffix, kinds in ARTEFACTS[task].items():
            if kinds & ctx.kinds:
                save_artefact(ctx.out / (ctx.names[item] + suffix), makers[suffix]())


# ----------------------------------------------------------------------------------------------------
# The run: batches, per-image errors, progress
# ----------------------------------------------------------------------------------------------------
def process(ctx: Context, pairs: list[tuple[InputImage, torch.Tensor]], progress: "Progress"):
    """Infer and write a batch; if the batch fails, retry image by image so only the bad one is lost."""
    if not pairs:
        return
    try:
        results = infer(ctx, [item for item, _ in pairs], [image for _, image in pairs])
    except Exception as error:  # noqa: BLE001 (any failure of one image must not end the run)
        if len(pairs) > 1:
            if ctx.device.type == "cuda":
                torch.cuda.empty_cache()
            for pair in pairs:
                process(ctx, [pair], progress)
            return
        return fail(ctx, pairs[0][0], error, progress)
    for (item, image), result in zip(pairs, results):
        try:
            write_outputs(ctx, item, image, result)
        except Exception as error:  # noqa: BLE001
            fail(ctx, item, error, progress)
        else:
            ctx.done += 1
            progress.advance()


def fail(ctx: Context, item: InputImage, error: Exception, progress: "Progress"):
    message = f"{type(error).__name__}: {error}"
    ctx.errors.append({"image": str(item.path), "error": message})
    where = "" if str(item.path) in str(error) else f"{item.path}: "
    progress.note(f"error: {where}{message} (skipped)")
    progress.advance(failed=True)


def load_batch(ctx: Context, batch: list[InputImage], progress: "Progress") -> list[tuple[InputImage, torch.Tensor]]:
    pairs = []
    for item in batch:
        try:
            pairs.append((item, processing.load_image(item.path)))
        except Exception as error:  # noqa: BLE001
            fail(ctx, item, error, progress)
    return pairs


class Progress:
    """`[#####-----] 120/1000 images  3.4 img/s  ETA 4m20s  1 failed` on a terminal; a line every
    30 s otherwise (logs)."""

    def __init__(self, total: int, prefix: str = "", enabled: bool = True, stream=None):
        self.total, self.prefix, self.enabled, self.stream = total, prefix, enabled, stream or sys.stderr
        self.count = self.failed = 0
        self.start = self.last = time.perf_counter()
        self.tty = self.stream.isatty()

    def advance(self, failed: bool = False):
        self.count += 1
        self.failed += failed
        now = time.perf_counter()
        if self.enabled and (now - self.last > (0.2 if self.tty else 30) or self.count == self.total):
            self.last = now
            self.draw()

    def rate(self) -> float:
        return self.count / max(time.perf_counter() - self.start, 1e-9)

    def draw(self):
        filled = int(20 * self.count / max(self.total, 1))
        eta = (self.total - self.count) / max(self.rate(), 1e-9)
        line = (f"{self.prefix}[{'#' * filled}{'-' * (20 - filled)}] {self.count}/{self.total} images  "
                f"{self.rate():.2f} img/s  ETA {int(eta // 60)}m{int(eta % 60):02d}s"
                + (f"  {self.failed} failed" if self.failed else ""))
        if self.tty:
            print("\r" + line + "\033[K", end="", file=self.stream, flush=True)
        else:
            print(line, file=self.stream, flush=True)

    def note(self, message: str):
        print(("\r\033[K" if self.tty and self.enabled else "") + self.prefix + message, file=self.stream, flush=True)

    def close(self):
        if self.enabled and self.tty and self.count:
            print(file=self.stream)


# ----------------------------------------------------------------------------------------------------
# Manifest
# ----------------------------------------------------------------------------------------------------
def describe_model(loaded: LoadedModel, dtype: str) -> dict:
    model = loaded.model
    head = model.head_config.to_dict() if isinstance(model, heads.Sapiens2ForTask) else None
    return {"source": loaded.source, "random_weights": loaded.random, "dtype": dtype,
            "backbone": loaded.backbone.config.to_dict(), "head": head,
            "parameters": sum(p.numel() for p in model.parameters())}


def manifest_path(out: Path, rank: int, world: int) -> Path:
    return out / ("run.json" if world == 1 else f"run.rank{rank}-of-{world}.json")


def write_manifest(path: Path, manifest: dict):
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(manifest, indent=2))
    os.replace(partial, path)


# ----------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------
def parse_size(text: str) -> tuple[int, int]:
    match = re.fullmatch(r"(\d+)[x,](\d+)", text)
    if not match:
        raise argparse.ArgumentTypeError(f"size must be HEIGHTxWIDTH, e.g. 1024x768, got {text!r}")
    return int(match[1]), int(match[2])


def parse_tasks(text: str) -> list[str]:
    tasks = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [t for t in tasks if t not in TASKS]
    if unknown or not tasks:
        raise UsageError(f"unknown task {', '.join(unknown) or text!r}; choose from {', '.join(TASKS)} "
                         f"(several: seg,normal,pose)")
    return [t for t in TASKS if t in tasks]  # seg first: pose boxes and masks use it


def parse_kinds(text: str) -> set[str]:
    kinds = {k.strip() for k in text.split(",") if k.strip()}
    if not kinds or kinds - set(KINDS):
        raise UsageError(f"--save takes a comma list of {', '.join(KINDS)}, got {text!r}")
    return kinds


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="predict.py", description="Run Sapiens2 on images: " + ", ".join(TASKS) + ".",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="outputs per image (under OUT, mirroring the inputs' paths):\n" + "\n".join(
            f"  {task:9s} " + "  ".join(f"NAME{s} ({'/'.join(sorted(k))})" for s, k in ARTEFACTS[task].items())
            for task in TASKS))
    parser.add_argument("task", help="one task or several: seg,normal,pose")
    parser.add_argument("inputs", nargs="+", metavar="INPUT",
                        help="image files, folders (recursive), globs ('a/**/*.jpg'), .txt files listing paths")
    parser.add_argument("-o", "--output", default="predictions", metavar="OUT",
                        help="output folder (default: %(default)s)")
    parser.add_argument("--model", action="append", default=[], metavar="SOURCE",
                        help="a size (0.4b: the released checkpoint of each task; default, 1b for matting), a task "
                             "preset (seg-1b), a .safetensors file, a folder or a hub id; TASK=SOURCE for one task "
                             "(repeat the option)")
    parser.add_argument("--device", help="cuda, cuda:1, cpu (default: cuda:LOCAL_RANK when there is a GPU)")
    parser.add_argument("--dtype", choices=["float32", "fp32", "bfloat16", "bf16", "float16", "fp16"],
                        help="default: bfloat16 on GPUs that support it, else float32")
    parser.add_argument("--batch-size", type=int,
                        help="images per forward pass, people for pose (default: 4 on GPU, 1 on CPU)")
    parser.add_argument("--size", type=parse_size, metavar="HxW",
                        help="model input size (default: the model's, 1024x768)")
    parser.add_argument("--no-flip", dest="flip", action="store_false", help="pose: skip the flip test (2x faster)")
    parser.add_argument("--boxes", metavar="FILE",
                        help="pose: person boxes, JSON {\"image.jpg\": [[x, y, w, h], ...]}")
    parser.add_argument("--rope", choices=["bfloat16", "float32"], default="bfloat16",
                        help="RoPE precision: bfloat16 as trained (default); float32 matches HF transformers")
    parser.add_argument("--mask-with-seg", action="store_true",
                        help="mask normal, pointmap and albedo outside the segmented people (NaN in .npy, black "
                             "in pictures)")
    parser.add_argument("--skip-existing", action="store_true",
                        help="skip images whose outputs all exist (resumes a run)")
    parser.add_argument("--save", type=parse_kinds_arg, default=set(KINDS), metavar="KINDS",
                        help="which outputs: raw (npy, class-id/alpha PNGs, features), json (pose), vis (pictures); "
                             "default: raw,json,vis")
    parser.add_argument("--random-init", choices=["never", "fallback", "always"], default="never",
                        help="random weights instead of checkpoints: 'fallback' when a download fails (for demos "
                             "and smoke tests; outputs are meaningless)")
    parser.add_argument("--random-backbone", choices=list(PRESETS),
                        help="backbone size of random models (default: the model's)")
    return parser


def parse_kinds_arg(text: str) -> set[str]:
    try:
        return parse_kinds(text)
    except UsageError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def pick_device(name: str | None) -> torch.device:
    if name:
        return torch.device(name)
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def pick_dtype(name: str | None, device: torch.device) -> torch.dtype:
    if name:
        return weights.parse_dtype(name)
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


def random_banner(models: dict[str, LoadedModel]) -> str:
    tasks = ", ".join(t for t, m in models.items() if m.random)
    bar = "!" * 78
    return (f"\n{bar}\n!!  RANDOM WEIGHTS for {tasks}: no checkpoint could be loaded.\n"
            f"!!  The outputs show that the pipeline runs end to end; the pictures are MEANINGLESS.\n"
            f"!!  For real results download the weights (see the message above) and run again.\n{bar}\n")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args, argv if argv is not None else sys.argv[1:])
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted: the outputs written so far are complete; --skip-existing resumes", file=sys.stderr)
        return 130


def run(args, argv: list[str]) -> int:
    start = time.perf_counter()
    tasks, out = parse_tasks(args.task), Path(args.output)
    if not any(kinds & args.save for task in tasks for kinds in ARTEFACTS[task].values()):
        raise UsageError(f"--save {','.join(sorted(args.save))} writes nothing for {','.join(tasks)}")
    boxes = read_boxes_file(args.boxes) if args.boxes else None
    items = collect_inputs(args.inputs, exclude=out.resolve())
    rank, world = rank_and_world()
    device = pick_device(args.device)
    dtype = pick_dtype(args.dtype, device)
    batch_size = args.batch_size or (4 if device.type == "cuda" else 1)
    if batch_size < 1:
        raise UsageError("--batch-size must be at least 1")
    models = load_models(args, tasks, device, dtype)
    if any(m.random for m in models.values()):
        print(random_banner(models), file=sys.stderr)
    ctx = Context(tasks, models, out, device, dtype, batch_size, args.size, args.flip, args.save,
                  args.mask_with_seg, boxes, names=output_names(items))
    mine = shard(items, rank, world)
    todo = [item for item in mine if not (args.skip_existing and all_written(ctx, item))]
    manifest = new_manifest(args, argv, ctx, dict(rank=rank, world_size=world, images=len(mine), of=len(items)))
    manifest["timings_s"] = {"load_models": round(time.perf_counter() - start, 3)}
    write_manifest(manifest_path(out, rank, world), manifest)
    prefix = f"[rank {rank}/{world}] " if world > 1 else ""
    progress = Progress(len(todo), prefix, enabled=rank == 0 or not sys.stderr.isatty())
    try:
        for i in range(0, len(todo), batch_size):
            process(ctx, load_batch(ctx, todo[i : i + batch_size], progress), progress)
    finally:
        progress.close()
        finish_manifest(manifest, ctx, progress, skipped=len(mine) - len(todo), elapsed=time.perf_counter() - start)
        write_manifest(manifest_path(out, rank, world), manifest)
    print(f"{prefix}{ctx.done} images written to {out}/, {len(ctx.errors)} failed, {len(mine) - len(todo)} skipped "
          f"(already done); {progress.rate():.2f} img/s; manifest {manifest_path(out, rank, world)}", file=sys.stderr)
    if any(m.random for m in models.values()):
        print(random_banner(models), file=sys.stderr)
    # NOTE: under torchrun a rank with failed images still exits 0: torchrun stops every rank as soon as one
    # exits non-zero, which would end the whole run. The failures are in each rank's manifest.
    return 1 if ctx.errors and world == 1 else 0


def new_manifest(args, argv: list[str], ctx: Context, shard_info: dict) -> dict:
    dtype = str(ctx.dtype).replace("torch.", "")
    return {
        "command": ["predict.py", *argv], "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "status": "running", "tasks": ctx.tasks,
        "models": {task: describe_model(m, dtype) for task, m in ctx.models.items()},
        "settings": {"device": str(ctx.device), "dtype": dtype, "batch_size": ctx.batch_size,
                     "size": list(args.size) if args.size else None, "flip_test": args.flip, "rope": args.rope,
                     "mask_with_seg": args.mask_with_seg, "boxes": args.boxes, "save": sorted(args.save),
                     "skip_existing": args.skip_existing, "output": str(ctx.out)},
        "versions": versions(), "shard": shard_info,
    }


def finish_manifest(manifest: dict, ctx: Context, progress: Progress, skipped: int, elapsed: float):
    manifest.update(status="finished" if progress.count == progress.total else "interrupted",
                    finished=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                    counts={"images": manifest["shard"]["images"], "written": ctx.done, "failed": len(ctx.errors),
                            "skipped_existing": skipped},
                    errors=ctx.errors, images_per_s=round(progress.rate(), 3))
    manifest["timings_s"].update(total=round(elapsed, 3), model={t: round(s, 3) for t, s in ctx.timings.items()})


if __name__ == "__main__":
    sys.exit(main())
