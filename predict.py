"""Run Sapiens2 on your images: every task, one command, files you can open.

    python predict.py seg photos/ -o out/                      # a folder (recursive)
    python predict.py seg,normal,pose "shots/**/*.jpg" -o out/ # several tasks; globs; a .txt list of paths
    python predict.py pose photos/ --boxes boxes.json          # your own person boxes (COCO xywh)
    python predict.py normal photos/ --model 1b --mask-with-seg
    torchrun --nproc-per-node 8 predict.py seg,pose photos/ -o out/   # each GPU takes its share
    python predict.py pose clip.mp4 -o out/ --smooth           # videos (video.py): frames, overlays, track ids

Tasks: seg, pose, normal, pointmap, matting, albedo, features. Outputs are mirrored under OUT by input path
(`photos/a/b.jpg` -> `out/a/b.seg.png`, ...; see ARTEFACTS), plus a `run.json` manifest. A bad image is
reported and skipped; the run goes on. Exit status: 0 all good, 1 some images failed (single process only)
or the run stopped (disk full, OUT read-only), 2 nothing could run (bad arguments, inputs, OUT or checkpoints).

Pose is top-down: person boxes come from `--boxes`, else from a person detector (detect.py, D-FINE; or
`--detector seg`: the segmentation's foreground blobs), else the whole image. The flip test is on by default,
as in the original demo.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import glob
import json
import math
import os
import posixpath
import re
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path, PurePosixPath

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageDraw, ImageFont

import detect
import formats
import heads
import metadata
import processing
import tracking
import video
import weights
from safe_io import (FOLDER_WRITE_ERRORS, REPEATING_WRITE_ERRORS, atomic_write, check_writable, json_text,
                     os_error_text, probe_error, remove_stale_temporaries)
from metadata import keypoint_metadata
from runtime_info import versions
from sapiens2 import PRESETS, Sapiens2

TASKS = (*heads.TASKS, "features")
# --conventions: how the weights were trained (the original demos' OpenCV preprocessing, RoPE in bf16), or
# exactly what HF transformers computes (its image processor, RoPE in fp32). Measured difference: README.
CONVENTIONS = {"original": dict(resample="original", rope="bfloat16"), "transformers": dict(resample="hf", rope="float32")}
KINDS = ("raw", "json", "vis", "openpose", "coco", "ply", "depth16")
DEFAULT_KINDS = ("raw", "json", "vis")  # the others are other tools' formats (formats.py), written when asked
# What each task writes: file suffix -> the --save kinds that ask for it.
ARTEFACTS = {
    "seg": {".seg.png": {"raw"}, ".seg_overlay.jpg": {"vis"}},
    "pose": {".pose.json": {"json"}, ".pose_overlay.jpg": {"vis"}, "_keypoints.json": {"openpose"}},
    "normal": {".normal.npy": {"raw"}, ".normal.png": {"vis"}},
    "pointmap": {".pointmap.npy": {"raw"}, ".depth.png": {"vis"}, ".pointmap.ply": {"ply"},
                 ".depth16.png": {"depth16"}},
    "matting": {".alpha.png": {"raw"}, ".composite.jpg": {"vis"}},
    "albedo": {".albedo.png": {"raw", "vis"}},
    "features": {".features.safetensors": {"raw"}},
}
PICTURE_SUFFIXES = tuple(s for files in ARTEFACTS.values() for s, kinds in files.items() if "vis" in kinds)
OUTPUT_SUFFIXES = (tuple(suffix for files in ARTEFACTS.values() for suffix in files)
                   + tuple(video.overlay_suffix(s) for s in PICTURE_SUFFIXES))  # + a video's overlay videos
MASKED_TASKS = ("normal", "pointmap", "albedo")  # what --mask-with-seg masks
IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff", ".gif", ".ppm", ".pgm"}
LIST_SUFFIXES = {".txt", ".lst", ".list"}
DEFAULT_SIZE = "0.4b"
SIZE_RANGE = (32, 4096)  # --size sides, pixels: a 2x2 patch grid at least (the heads' norms need >1 cell); 4K at most
MAX_BATCH_SIZE = 1024
MAX_WORLD_SIZE = 65536
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
    """All images of the inputs, deduplicated, sorted by relative path (the order sharding splits).
    An existing path is taken literally, even with glob characters in its name (`shot [1].jpg`)."""
    files = [s for s in specs if Path(s).is_file() and not is_list_file(s)]
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
    path = Path(spec)
    if path.is_dir():  # rglob does not follow symlinked folders: a symlink loop cannot trap it
        paths = [p for p in sorted(path.rglob("*")) if wanted(p, exclude)
                 and not any(part.startswith(".") for part in p.relative_to(path).parts)]
        return [InputImage(p, p.relative_to(path).as_posix()) for p in paths]
    if path.is_file() and is_list_file(spec):
        return read_list_file(path, exclude)
    if path.is_file():
        return relative_to_common([path])
    if glob.has_magic(spec):
        return expand_glob(spec, exclude)
    raise UsageError(f"{spec}: no such file or folder")


def expand_glob(spec: str, exclude: Path | None) -> list[InputImage]:
    """A glob's images, named below its static part. pathlib's `**` does not follow symlinked folders (glob.glob's
    does, forever in a symlink loop). A name that would climb out of the static part (`photos/*/../../img/a.jpg`)
    is replaced by the names below the matches' common folder, so outputs always stay under OUT."""
    base, pattern = glob_base(spec)
    if Path(pattern).name == "**":  # pathlib's trailing `**` gives folders only; glob's gave everything below
        pattern = str(Path(pattern) / "*")
    hidden = lambda part: part.startswith(".") and part not in (".", "..")  # noqa: E731
    hidden_ok = any(hidden(part) for part in Path(pattern).parts)  # asked for: `photos/.cache/*.jpg`
    paths = [p for p in sorted(base.glob(pattern)) if wanted(p, exclude)
             and (hidden_ok or not any(hidden(part) for part in p.relative_to(base).parts))]
    names = [posixpath.normpath(p.relative_to(base).as_posix()) for p in paths]
    if any(climbs_out(name) for name in names):
        return relative_to_common(paths)
    return [InputImage(p, name) for p, name in zip(paths, names)]


def climbs_out(name: str) -> bool:
    """Would OUT/name land outside OUT?"""
    name = posixpath.normpath(name)
    return posixpath.isabs(name) or name == ".." or name.startswith("../")


def wanted(path: Path, exclude: Path | None) -> bool:
    """An image file by its name, and not one of our pictures in the output folder `exclude` (with -o inside
    the input folder, a second run would otherwise take the first one's overlays for photos)."""
    if not path.is_file() or not (path.suffix.lower() in IMAGE_SUFFIXES or video.is_video(path)):  # is_file: False for a symlink loop
        return False
    return not (path.name.endswith(OUTPUT_SUFFIXES) and exclude is not None and path.resolve().is_relative_to(exclude))


def glob_base(pattern: str) -> tuple[Path, str]:
    """(the folder part of a glob before its first wildcard, the rest): outputs mirror the paths below it."""
    parts = Path(pattern).parts
    first = next(i for i, p in enumerate(parts) if glob.has_magic(p))
    return Path(*parts[:first]) if first else Path("."), str(Path(*parts[first:]))


def read_list_file(path: Path, exclude: Path | None) -> list[InputImage]:
    """One image path (or folder) per line, relative to the list file's folder; blank lines and # comments skipped."""
    try:
        lines = [line.strip() for line in path.read_text().splitlines()]
    except (OSError, UnicodeDecodeError) as error:
        why = (error.strerror or str(error)) if isinstance(error, OSError) else "not a text file"
        raise UsageError(f"{path}: cannot read this list of inputs ({why})") from None
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
    """Output name of each image, distinct for every input (compared case-blind, for macOS and Windows
    disks): its relative path without the suffix; where two clash, with it (`x.jpg`, `x.png` -> `x.jpg.*`,
    `x.png.*`); where that still clashes (`x.jpg.png` -> `x.jpg`), the relative path + `~2`, `~3`, ..."""
    names = {item: item.stem for item in items}
    clashing = set().union(*clashes(names).values())
    names.update({item: item.relative for item in clashing})
    for group in clashes(names).values():
        taken = {name.casefold() for name in names.values()}
        for item in sorted(group, key=lambda item: item.relative)[1:]:
            candidates = [item.relative] + [f"{item.relative}~{n}" for n in range(2, len(items) + 2)]
            names[item] = next(name for name in candidates if name.casefold() not in taken)
            taken.add(names[item].casefold())
    for clip in sorted((item for item in items if video.is_video(item.path)), key=lambda item: item.relative):
        if claims_folder_of_others(names, clip):  # OUT/clip/000000.* of clip.mp4 and of an image clip/000000.png
            taken = {name.casefold() for name in names.values()}
            candidates = [clip.relative] + [f"{clip.relative}~{n}" for n in range(2, len(items) + 2)]
            names[clip] = next(name for name in candidates if name.casefold() not in taken
                               and not claims_folder_of_others({**names, clip: name}, clip))
    escaping = [name for name in names.values() if climbs_out(name)]
    if escaping:  # collect_inputs never makes such names: a last guard that nothing is written outside OUT
        raise UsageError(f"output name {escaping[0]!r} would be outside the output folder")
    return names


def claims_folder_of_others(names: dict[InputImage, str], clip: InputImage) -> bool:
    """A video writes its frames into the folder OUT/NAME/: does another input's output name lie in it?"""
    folder = names[clip].casefold() + "/"
    return any(name.casefold().startswith(folder) for item, name in names.items() if item != clip)


def clashes(names: dict[InputImage, str]) -> dict[str, list[InputImage]]:
    """Groups of inputs whose output names are equal, ignoring case."""
    groups: dict[str, list[InputImage]] = {}
    for item, name in names.items():
        groups.setdefault(name.casefold(), []).append(item)
    return {key: group for key, group in groups.items() if len(group) > 1}


def shard(items: list, rank: int, world_size: int) -> list:
    """Rank r of N takes items r, r + N, r + 2N, ... of the sorted list: disjoint, together complete."""
    return items[rank::world_size]


def rank_and_world() -> tuple[int, int]:
    """From torchrun's (or any launcher's) RANK / WORLD_SIZE environment variables; 0, 1 when absent.
    LOCAL_RANK (the GPU of this process) is checked here too, so a bad launch fails before any model loads."""
    world = env_int("WORLD_SIZE", 1, 1, MAX_WORLD_SIZE)
    rank = env_int("RANK", 0, 0, world - 1)
    env_int("LOCAL_RANK", 0, 0, world - 1)
    return rank, world


def env_int(name: str, default: int, low: int, high: int) -> int:
    """A whole number from the environment in [low, high], else a UsageError that gives the range."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    if not re.fullmatch(r"\d+", text) or not low <= int(text) <= high:
        raise UsageError(f"environment variable {name}={os.environ[name]!r}: expected a whole number from "
                         f"{low} to {high}" + (" (WORLD_SIZE - 1)" if name != "WORLD_SIZE" else ""))
    return int(text)


def read_boxes_file(path: str) -> dict[str, list[list[float]]]:
    """--boxes: a JSON object, image file name -> list of COCO [x, y, w, h] boxes in image pixels. Every value
    a finite number (NaN/Infinity are refused, not JSON anyway), width and height above 0. Boxes reaching
    outside an image are clipped to it when the image is read; those wholly outside are dropped, with a warning."""
    def refuse_constant(name):
        raise ValueError(f"{name} is not a number JSON allows")

    try:
        boxes = json.loads(Path(path).read_text(), parse_constant=refuse_constant)
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise UsageError(f"--boxes {path}: cannot read it as JSON ({error})") from None
    if not isinstance(boxes, dict):
        raise UsageError(f"--boxes {path}: expected an object {{\"image.jpg\": [[x, y, w, h], ...]}}")
    for name, entry in boxes.items():
        ok = isinstance(entry, list) and all(
            isinstance(b, list) and len(b) == 4 and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                        for v in b) for b in entry)
        if not ok:
            raise UsageError(f"--boxes {path}: {name!r} must map to a list of [x, y, w, h] boxes, got {entry!r}")
        for box in entry:
            if not all(math.isfinite(v) for v in box) or box[2] <= 0 or box[3] <= 0:
                raise UsageError(f"--boxes {path}: {name!r} has the box {box}: x, y must be finite numbers and "
                                 f"the width and height above 0 (COCO [x, y, w, h], image pixels)")
    return boxes


def box_keys(item: InputImage) -> tuple[str, ...]:
    """The --boxes keys that name an input, in the order they are tried: relative path, file name, path as
    given, absolute path (a video's frames add `#N` to them)."""
    return item.relative, item.path.name, str(item.path), str(item.path.resolve())


def boxes_for(item: InputImage, boxes: dict) -> list | None:
    """The --boxes entry of an image (box_keys)."""
    for key in box_keys(item):
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


def check_model_sources(specs: list[str]):
    """A --model name that names nothing (`sgm-0.4b`: a bare word that is no preset, hub id or file here) is refused
    before any model loads, with the names that would do. A missing path (`x/m.safetensors`) is left to the
    loader, which names it."""
    default, per_task = parse_model_specs(specs)
    named = ([] if default is None else [(default, default)]) + [(f"{t}={s}", s) for t, s in per_task.items()]
    task_presets = ", ".join(f"{task}-{'/'.join(sizes)}" for task, sizes in heads.HEAD_TABLE.items())  # seg-0.4b/1b
    for spec, source in named:
        bare_word = Path(source).name == source and not source.endswith(".safetensors")
        if bare_word and not Path(source).exists() and not weights.looks_like_preset_or_hub_id(source):
            raise UsageError(f"--model {spec}: no such file or folder, and not a model name; give a size "
                             f"({', '.join(PRESETS)}), a task preset ({task_presets}), a "
                             f".safetensors file, a checkpoint folder or a hub id (owner/name)")


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
    return "seg" in tasks or args.mask_with_seg or ("pose" in tasks and not args.boxes and args.detector == "seg")


def load_models(args, tasks: list[str], device, dtype) -> dict[str, LoadedModel]:
    """One model per task, + seg when pose boxes or --mask-with-seg need it; a checkpoint is loaded once."""
    default, per_task = parse_model_specs(args.model)
    models, cache = {}, {}
    for task in tasks:
        models[task] = cached_load(cache, task, model_source(task, default, per_task), args, device, dtype)
    if needs_seg_model(args, tasks) and "seg" not in tasks:
        models.update(helper_seg_model(cache, default, per_task, args, device, dtype))
    return models


def load_detector(args, tasks: list[str], device, dtype) -> detect.PersonDetector | None:
    """The person detector for pose boxes (None with --boxes or --detector seg|none). When its weights cannot be
    downloaded, say so and use the segmentation's blobs instead; a missing local file stays an error. With
    --random-init always nothing is loaded or downloaded: pose runs on the whole image (the banner says so)."""
    if "pose" not in tasks or args.boxes or args.detector in ("seg", "none"):
        return None
    if args.random_init == "always":
        args.detector = "none"  # from here on, and in the manifest
        return None
    try:
        return detect.load(args.detector, dtype=dtype, device=device)
    except FileNotFoundError as error:
        if not detect.is_hub_id(args.detector):
            raise UsageError(f"--detector: {error}") from None
        print(f"note: no person detector ({error}); pose boxes come from the segmentation's person blobs "
              f"instead (--detector seg)", file=sys.stderr)
        args.detector = "seg"  # from here on seg is loaded for the boxes, and the manifest says so
    except ValueError as error:
        raise UsageError(f"--detector: {error}") from None
    return None


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
    def checkpoint():
        if source in heads.TASK_PRESETS and source not in weights.HUB_IDS:
            raise FileNotFoundError(f"{source}: no released checkpoint; pass a file with --model {task}=PATH")
        return weights.load(source, dtype=dtype, device=device, task=None if task == "features" else task,
                            rope_dtype=args.rope)

    def random_weights():
        """The real architecture (heads.random_model), the same weights in every process (sharded runs agree)."""
        model = heads.random_model(task, source, args.random_backbone, seed=TASKS.index(task), rope_dtype=args.rope)
        return model.to(device, dtype).eval()

    try:
        model, random = weights.load_or_random(source, args.random_init, checkpoint, random_weights)
    except weights.CheckpointError as error:  # present but unusable: never a random fallback
        raise UsageError(f"--model {task}={source}: cannot use it: {one_line(str(error))}") from None
    except FileNotFoundError as error:
        raise UsageError(str(error)) from None
    return LoadedModel(model, source, random)


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
    detector: detect.PersonDetector | None = None  # any callable: images -> per image (K, 5) xywh + score
    seg_boxes: bool = True  # pose boxes from the seg blobs when there is no detector (--detector seg)
    coco: formats.CocoResults | None = None  # --save coco: gathered image by image, written at the end
    timings: dict[str, float] = field(default_factory=dict)
    errors: list[dict] = field(default_factory=list)  # {"image", "task" (absent: the whole image), "error"}
    warnings: list[str] = field(default_factory=list)
    outcomes: dict[InputImage, str] = field(default_factory=dict)  # "written" or "failed"
    blocked: dict[Path, str] = field(default_factory=dict)  # output folders found unwritable -> why
    note: Callable[[str], None] | None = None  # where warnings go (the progress bar's note); default stderr

    @property
    def done(self) -> int:
        return sum(outcome == "written" for outcome in self.outcomes.values())

    def warn(self, message: str):
        self.warnings.append(message)
        (self.note or (lambda text: print(text, file=sys.stderr)))(f"warning: {message}")
    resample: str = "original"  # processing's resample= (from --conventions)

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


def pose_boxes(ctx: Context, item: InputImage, image, segmentation,
               detected: torch.Tensor | None = None) -> tuple[list, str, list | None]:
    """(COCO xywh person boxes inside the image, where they came from, the detector's score of each): the
    --boxes entry, else the detector's person boxes, else the segmentation's person blobs, else the whole image."""
    height, width = image.shape[-2:]
    entry = boxes_for(item, ctx.boxes) if ctx.boxes is not None else None
    if entry is not None:
        inside = fit_boxes(entry, width, height)
        dropped = [box for box, fitted in zip(entry, inside) if fitted is None]
        if dropped:
            ctx.warn(f"{item.path}: --boxes {dropped} lie outside the {width}x{height} image; dropped")
        return [box for box in inside if box is not None], "boxes-file", None
    if detected is not None:  # an empty box has nothing to crop; a non-finite one (fp16 overflow) means nothing
        detected = detected[(detected[:, 2] > 0) & (detected[:, 3] > 0) & torch.isfinite(detected).all(dim=1)]
    if detected is not None and len(detected):
        inside = fit_boxes(detected[:, :4].tolist(), width, height)  # kept as detected, unless wholly outside
        kept = [(box, score) for box, fitted, score in zip(detected[:, :4].tolist(), inside, detected[:, 4].tolist())
                if fitted is not None]
        if kept:
            return [box for box, _ in kept], "detector", [score for _, score in kept]
    found = person_boxes(segmentation) if segmentation is not None else []
    boxes, source = (found, "segmentation") if found else (whole_image_box(image), "whole-image")
    return [fit_boxes([box], width, height)[0] for box in boxes], source, None


def run_detector(ctx: Context, images) -> list[torch.Tensor | None]:
    if ctx.detector is None:
        return [None] * len(images)
    start = time.perf_counter()
    detected = [boxes.cpu() for boxes in ctx.detector(images)]
    ctx.timings["detector"] = ctx.timings.get("detector", 0.0) + time.perf_counter() - start
    return detected

def fit_boxes(boxes: list[list[float]], width: int, height: int) -> list[list[float] | None]:
    """Each xywh box clipped to the image, at least 1 pixel a side (a 1x1 image's whole-image box has a zero
    side, which gives NaN keypoints); None for a box that lies wholly outside the image."""
    fitted = []
    for x, y, w, h in boxes:
        w, h = max(w, 1.0), max(h, 1.0)
        if x >= width or y >= height or x + w <= 0 or y + h <= 0:
            fitted.append(None)
            continue
        x0, y0 = max(x, 0.0), max(y, 0.0)
        x1, y1 = min(x + w, float(width)), min(y + h, float(height))
        fitted.append([float(x0), float(y0), max(x1 - x0, 1.0), max(y1 - y0, 1.0)])
    return fitted


@dataclass
class TaskFailed:
    """One task's failure on one image: its outputs are not written, the image's other tasks' are."""
    error: Exception


def run_each(ctx: Context, runner, images: list, *per_image: list) -> list:
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


def infer(ctx: Context, items: list[InputImage], images: list[torch.Tensor]) -> list[dict]:
    """All requested tasks on one batch -> per image {task: result or TaskFailed, "mask": foreground, None
    or TaskFailed}. Each task runs on its own: one failing (e.g. on a 3x2000 image) keeps the others."""
    results = [{"mask": None} for _ in images]
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
        boxes, sources, scores = zip(*(([], None, None) if isinstance(found, TaskFailed) else
                                       pose_boxes(ctx, item, image, None if isinstance(seg, TaskFailed) else seg, found)
                                       for item, image, seg, found in zip(items, images, segs, detected)))
        for result, people, source, score, found in zip(results, run_each(ctx, run_pose, images, list(boxes)),
                                                        sources, scores, detected):
            failed = found if isinstance(found, TaskFailed) else people if isinstance(people, TaskFailed) else None
            result["pose"] = failed or {"people": people, "box_source": source, "detector_scores": score}
    return results


# ----------------------------------------------------------------------------------------------------
# Rendering and saving: per task, file suffix -> a function making what goes in the file
# ----------------------------------------------------------------------------------------------------
def render(task: str, item: InputImage, image: torch.Tensor, result: dict, loaded: LoadedModel) -> dict:
    value, mask = result[task], result["mask"] if task in MASKED_TASKS else None
    vis = stamp_random if loaded.random else (lambda picture: picture)  # pictures only: raw files stay raw
    if task == "seg":
        classes = loaded.model.head_config.out_channels  # a fine-tune's own count: its own palette
        return {".seg.png": lambda: Image.fromarray(value.to(torch.uint8).numpy()),
                ".seg_overlay.jpg": lambda: vis(processing.overlay_segmentation(image, value, num_classes=classes))}
    if task == "pose":
        names = keypoint_names(loaded.model)
        return {".pose.json": lambda: pose_json(item, image, value, names),
                ".pose_overlay.jpg": lambda: vis(processing.draw_pose(image, value["people"], names=names)),
                "_keypoints.json": lambda: formats.openpose_json(value["people"], names)}
    if task == "normal":
        return {".normal.npy": lambda: hwc_array(value, mask),
                ".normal.png": lambda: vis(processing.normals_to_image(value, mask))}
    if task == "pointmap":
        return {".pointmap.npy": lambda: hwc_array(value, mask),
                ".depth.png": lambda: vis(depth_picture(value[2], mask)),
                ".pointmap.ply": lambda: formats.pointmap_ply(value, image, mask),
                ".depth16.png": lambda: formats.depth16_image(value[2], mask)}
    if task == "matting":
        return {".alpha.png": lambda: Image.fromarray(processing.float_to_uint8(value["alpha"][0]).numpy()),
                ".composite.jpg": lambda: vis(processing.to_pil(value["composite"]))}
    if task == "albedo":
        albedo = value if mask is None else value * mask
        return {".albedo.png": lambda: processing.to_pil(processing.albedo_to_uint8(albedo))}  # the raw albedo
    if task == "features":
        about = {"image": item.relative, "height": str(image.shape[-2]), "width": str(image.shape[-1]),
                 "model": features_model(loaded), "random_weights": str(loaded.random).lower()}
        return {".features.safetensors": lambda: (value, about)}
    raise ValueError(f"unknown task {task!r}")


def features_model(loaded: LoadedModel) -> str:
    """What made a features file: the checkpoint, or the random backbone that stood in for it (--random-init)."""
    if not loaded.random:
        return loaded.source
    config = loaded.backbone.config
    shape = lambda c: (c.embed_dim, c.depth, c.use_tokenizer)  # noqa: E731
    size = next((name for name, preset in PRESETS.items() if shape(preset) == shape(config)),
                f"{config.embed_dim}-wide {config.depth}-block")  # random models come from a preset: by its name
    return f"random weights, {size} backbone (--random-init, in place of {loaded.source})"


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


def keypoint_names(model) -> tuple[str, ...]:
    """A pose model's keypoint names: its own (train.py, id2label), else the 308's (a 308-channel model),
    else keypoint_0, keypoint_1, ... (a checkpoint without names)."""
    config = model.head_config
    if config.labels is not None:
        return tuple(config.labels)
    names308 = keypoint_metadata()["keypoint_names"]
    return tuple(names308) if config.out_channels == len(names308) else tuple(
        f"keypoint_{k}" for k in range(config.out_channels))


def pose_json(item: InputImage, image: torch.Tensor, value: dict, names=None) -> dict:
    """Boxes xyxy, keypoints [x, y, score] x 308 (or x the model's own `names`) in image pixels; score = mean
    keypoint score above 0.2."""
    names = tuple(names or keypoint_metadata()["keypoint_names"])
    people = []
    for i, (person, entry) in enumerate(zip(value["people"],
                                            processing.pose_to_coco([value["people"]], [0], "model", names=names))):
        flat = entry["keypoints"]  # [x0, y0, s0, x1, ...] in the model's order
        keypoints = [[round(x, 2), round(y, 2), round(s, 4)] for x, y, s in zip(flat[0::3], flat[1::3], flat[2::3])]
        people.append({"box": [round(v, 2) for v in person["bbox"].tolist()], "score": round(entry["score"], 4),
                       "keypoints": keypoints, **tracking.json_fields(person)})  # video: track_id, keypoints_raw
        if value.get("detector_scores") is not None:
            people[-1]["detector_score"] = round(value["detector_scores"][i], 4)
    return {"image": item.relative, "width": int(image.shape[-1]), "height": int(image.shape[-2]),
            "box_source": value["box_source"], "people": people,
            "keypoint_names": list(names)}


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


def prepare_output_folder(out: Path):
    """Fail fast, before any model loads, on an OUT that is a file, under a file, read-only or not ours to write."""
    try:
        if out.exists() and not out.is_dir():
            raise UsageError(f"-o {out}: is a file, not a folder")
        out.mkdir(parents=True, exist_ok=True)
        check_writable(out)
    except OSError as error:
        raise UsageError(f"-o {out}: cannot write there ({os_error_text(error)})") from None


def expected_outputs(ctx: Context, item: InputImage) -> list[Path]:
    return [ctx.out / (ctx.names[item] + suffix) for task in ctx.tasks
            for suffix, kinds in ARTEFACTS[task].items() if kinds & ctx.kinds]


def all_written(ctx: Context, item: InputImage) -> bool:
    """--skip-existing: are its files there? Never when it writes none of its own (--save coco alone)."""
    expected = expected_outputs(ctx, item)
    return bool(expected) and all(path.exists() for path in expected)


def write_outputs(ctx: Context, item: InputImage, image: torch.Tensor,
                  result: dict) -> tuple[dict, list[tuple[str, Exception]]]:
    """Write every task's files; return (what went in them by suffix: videos encode the pictures, the (task,
    error) of the tasks that failed). A write error that will repeat (disk full, read-only, no permission) is
    raised, for the run to decide what to stop."""
    values, failures = {}, []
    for task in ctx.tasks:
        try:
            inference_error(ctx, task, result)
            values.update(write_task(ctx, task, item, image, result))
        except Exception as error:  # noqa: BLE001 (one task's failure keeps the image's other tasks)
            if isinstance(error, OSError) and error.errno in REPEATING_WRITE_ERRORS:
                raise
            failures.append((task, error))
    pose_ok = isinstance(result.get("pose"), dict) and not any(task == "pose" for task, _ in failures)
    if ctx.coco is not None and pose_ok:
        ctx.coco.add(ctx.names[item], item.relative, result["pose"]["people"])
    return values, failures


def inference_error(ctx: Context, task: str, result: dict):
    """Raise the error of a task whose inference failed (or whose --mask-with-seg segmentation did)."""
    if isinstance(result[task], TaskFailed):
        raise result[task].error
    if task in MASKED_TASKS and isinstance(result["mask"], TaskFailed):
        raise RuntimeError(f"--mask-with-seg: the segmentation failed ({result['mask'].error})")


def write_task(ctx: Context, task: str, item: InputImage, image: torch.Tensor, result: dict) -> dict:
    """A task's files, all or nothing: a failure (or Ctrl-C) removes the ones written, and an older version of
    the file being written, which would not belong with the new ones. Returns what went in them by suffix."""
    written, values = [], {}
    try:
        makers = render(task, item, image, result, ctx.models[task])
        for suffix, kinds in ARTEFACTS[task].items():
            if kinds & ctx.kinds:
                written.append(ctx.out / (ctx.names[item] + suffix))  # before: a signal may land after the rename
                values[suffix] = makers[suffix]()
                atomic_write(written[-1], values[suffix])
        return values
    except BaseException:
        for path in written:
            with contextlib.suppress(OSError):  # the write error is what to report, not this
                path.unlink(missing_ok=True)
        raise


# ----------------------------------------------------------------------------------------------------
# The run: batches, per-image errors, write errors, progress
# ----------------------------------------------------------------------------------------------------


class StopRun(Exception):
    """A write error that every further image would hit (disk full, OUT no longer writable): stop cleanly."""


def process_all(ctx: Context, todo: list[InputImage], progress: "Progress"):
    """Every image, a batch at a time. Images whose output folder turned out unwritable fail without being
    computed; a StopRun ends the loop (the caller finalises the manifest)."""
    for i in range(0, len(todo), ctx.batch_size):
        batch = [item for item in todo[i : i + ctx.batch_size] if not skip_blocked(ctx, item, progress)]
        process(ctx, load_batch(ctx, batch, progress), progress)


def process(ctx: Context, pairs: list[tuple[InputImage, torch.Tensor]], progress: "Progress", write=None):
    """Infer and write a batch (with `write`, default write_outputs; videos track people first); each task on
    its own, failing images retried one by one inside."""
    write = write or write_outputs
    if not pairs:
        return
    try:
        results = infer(ctx, [item for item, _ in pairs], [image for _, image in pairs])
    except Exception as error:  # noqa: BLE001 (a failure outside the tasks, e.g. finding boxes)
        if len(pairs) > 1:
            for pair in pairs:
                process(ctx, [pair], progress, write)
            return
        return fail(ctx, pairs[0][0], [(None, error)], progress)
    for (item, image), result in zip(pairs, results):
        if skip_blocked(ctx, item, progress):  # its folder failed for an earlier image of this batch
            continue
        try:
            _, failures = write(ctx, item, image, result)
        except OSError as error:
            fail(ctx, item, [(None, error)], progress)
            stop_or_block(ctx, item, error)
            continue
        if failures:
            fail(ctx, item, failures, progress)
        else:
            ctx.outcomes[item] = "written"
            progress.advance()


def stop_or_block(ctx: Context, item: InputImage, error: OSError):
    """After a repeating write error: stop the run when OUT itself cannot take more (disk full, OUT read-only).
    A permission error may be narrower: the image's output folder alone (later images bound there then fail
    without running), or one file alone (an immutable old output: only this image fails)."""
    reason = f"{os_error_text(error)} (while writing the outputs of {item.path})"
    if error.errno in FOLDER_WRITE_ERRORS:
        folder = (ctx.out / ctx.names[item]).parent
        if probe_error(folder) is None:
            return
        out_error = probe_error(ctx.out)
        if out_error is None:
            ctx.blocked[folder] = os_error_text(error)
            return
        reason = f"{os_error_text(out_error)} (OUT itself; after {reason})"
    raise StopRun(reason)



def skip_blocked(ctx: Context, item: InputImage, progress: "Progress") -> bool:
    folder = (ctx.out / ctx.names[item]).parent
    reason = next((why for blocked, why in ctx.blocked.items() if folder.is_relative_to(blocked)), None)
    if reason is not None:
        fail(ctx, item, [(None, PermissionError(f"skipped: its output folder is not writable ({reason})"))], progress)
    return reason is not None


def fail(ctx: Context, item: InputImage, failures: list[tuple[str | None, Exception]], progress: "Progress"):
    """Report an image's failures (task None: the whole image) on stderr and in the manifest."""
    for task, error in failures:
        entry, line = failure_report(item, task, error)
        ctx.errors.append(entry)
        progress.note(line)
    ctx.outcomes[item] = "failed"
    progress.advance(failed=True)


def failure_report(item: InputImage, task: str | None, error: Exception) -> tuple[dict, str]:
    """A failure as its run.json entry and its `error: ... (skipped)` line."""
    message = os_error_text(error) if isinstance(error, OSError) and error.errno else str(error)
    message = f"{type(error).__name__}: {one_line(message)}"
    where = "" if str(item.path) in message else f"{item.path}: "
    return ({"image": str(item.path), **({"task": task} if task else {}), "error": message},
            f"error: {where}{f'{task}: ' if task else ''}{message} (skipped)")


def one_line(message: str, limit: int = 600) -> str:
    """A multi-line message (a checkpoint's key listing) as one line, shortened."""
    text = ""
    for line in (line.strip() for line in str(message).splitlines() if line.strip()):
        text += ("" if not text else " " if text.endswith(":") else "; ") + line
    return text if len(text) <= limit else text[: limit - 3] + "..."


def load_batch(ctx: Context, batch: list[InputImage], progress: "Progress") -> list[tuple[InputImage, torch.Tensor]]:
    pairs = []
    for item in batch:
        try:
            pairs.append((item, processing.load_image(item.path)))
        except Exception as error:  # noqa: BLE001
            fail(ctx, item, [(None, error)], progress)
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


def write_manifest(path: Path, manifest: dict, reserve: int = 0):
    """Atomically. `reserve`: pad the file with trailing blanks (valid JSON) to that many bytes, so the final
    manifest can still be written over it when the disk is full (write_final_manifest)."""
    text = json_text(manifest, indent=2)
    atomic_write(path, text + " " * (reserve - len(text) - 1) + "\n" if reserve > len(text) + 1 else text)


def manifest_reserve(images: int) -> int:
    """Bytes to set aside for the final manifest: its errors and not-attempted lists grow with the images."""
    return min(64 * 1024 + 512 * images, 16 * 2**20)


def write_final_manifest(path: Path, manifest: dict):
    """The final manifest; on a full disk, written over the space the first one reserved (in place, not atomic),
    shortened (lists cut, `"truncated": true`) if it does not fit."""
    try:
        return write_manifest(path, manifest)
    except OSError as error:
        if error.errno not in (errno.ENOSPC, errno.EDQUOT) or not path.is_file():
            raise
        room = path.stat().st_size
    text = json_text(manifest, indent=2)
    for keep in (100, 10, 0):
        if len(text.encode()) <= room:
            break
        text = json_text({**manifest, "truncated": True, "errors": manifest["errors"][:keep],
                          "not_attempted": manifest["not_attempted"][:keep]}, indent=2)
    with open(path, "r+b") as f:  # the blocks are already allocated: overwriting them needs no space
        f.write(text.encode())
        f.truncate()


# ----------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------
def parse_size(text: str) -> tuple[int, int]:
    """--size of predict.py, train.py and export.py: HxW (or H,W), each side a multiple of the patch size within
    SIZE_RANGE."""
    match = re.fullmatch(r"(\d+)[xX,](\d+)", text.strip())
    low, high = SIZE_RANGE
    if not match:
        raise argparse.ArgumentTypeError(f"size must be HEIGHTxWIDTH, e.g. 1024x768, got {text!r}")
    size = int(match[1]), int(match[2])
    if any(not low <= side <= high or side % processing.PATCH_SIZE for side in size):
        raise argparse.ArgumentTypeError(f"{text}: each side must be a multiple of {processing.PATCH_SIZE} from "
                                         f"{low} to {high}, e.g. 1024x768")
    return size


def parse_batch_size(text: str) -> int:
    if not re.fullmatch(r"\d+", text.strip()) or not 1 <= int(text) <= MAX_BATCH_SIZE:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number from 1 to {MAX_BATCH_SIZE}")
    return int(text)


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


class OneLineErrorParser(argparse.ArgumentParser):
    """Usage errors as one line, like every other error here (the usage text is one --help away)."""

    def error(self, message: str):
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(
        prog="predict.py", description="Run Sapiens2 on images: " + ", ".join(TASKS) + ".",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="outputs per image (under OUT, mirroring the inputs' paths):\n" + "\n".join(
            f"  {task:9s} " + "  ".join(f"NAME{s} ({'/'.join(sorted(k))})" for s, k in ARTEFACTS[task].items())
            for task in TASKS))
    parser.add_argument("task", help="one task or several: seg,normal,pose")
    parser.add_argument("inputs", nargs="+", metavar="INPUT",
                        help="image files, videos, folders (recursive), globs ('a/**/*.jpg'), .txt files listing "
                             "paths (one a line, relative to the list file's folder; # comments)")
    parser.add_argument("-o", "--output", default="predictions", metavar="OUT",
                        help="output folder (default: %(default)s)")
    parser.add_argument("--model", action="append", default=[], metavar="SOURCE",
                        help="a size (0.4b: the released checkpoint of each task; default, 1b for matting), a task "
                             "preset (seg-1b), a .safetensors file, a folder or a hub id; TASK=SOURCE for one task "
                             "(repeat the option)")
    parser.add_argument("--device", help="cuda, cuda:1, cpu (default: cuda:LOCAL_RANK when there is a GPU)")
    parser.add_argument("--dtype", choices=["float32", "fp32", "bfloat16", "bf16", "float16", "fp16"],
                        help="default: bfloat16 on GPUs that support it, else float32")
    parser.add_argument("--batch-size", type=parse_batch_size,
                        help="images per forward pass, people for pose (default: 4 on GPU, 1 on CPU)")
    parser.add_argument("--size", type=parse_size, metavar="HxW",
                        help="model input size (default: the model's, 1024x768)")
    parser.add_argument("--no-flip", dest="flip", action="store_false", help="pose: skip the flip test (2x faster)")
    parser.add_argument("--boxes", metavar="FILE",
                        help="pose: person boxes, JSON {\"image.jpg\": [[x, y, w, h], ...]}")
    parser.add_argument("--detector", default=detect.DEFAULT_DETECTOR, metavar="SOURCE",
                        help="pose: person boxes from this D-FINE detector (hub id, folder or file; default "
                             "%(default)s), 'seg' for the segmentation's blobs, 'none' for the whole image; "
                             "--boxes wins")
    parser.add_argument("--conventions", choices=list(CONVENTIONS), default="original",
                        help="original: as the weights were trained (the original demos' OpenCV preprocessing, RoPE "
                             "in bf16; default); transformers: exactly what HF transformers computes (its "
                             "preprocessing, RoPE in fp32)")
    parser.add_argument("--mask-with-seg", action="store_true",
                        help="mask normal, pointmap and albedo outside the segmented people (NaN in .npy, black "
                             "in pictures)")
    parser.add_argument("--skip-existing", action="store_true",
                        help="skip images whose outputs all exist (resumes a run)")
    parser.add_argument("--save", type=parse_kinds_arg, default=set(DEFAULT_KINDS), metavar="KINDS",
                        help="which outputs: raw (npy, class-id/alpha PNGs, features), json (pose), vis (pictures), "
                             "openpose (NAME_keypoints.json), coco (OUT/coco_keypoints.json), ply (NAME.pointmap.ply), "
                             "depth16 (NAME.depth16.png, mm); default: raw,json,vis")
    parser.add_argument("--coco-format", choices=formats.COCO_FORMATS, default="coco17",
                        help="keypoints of --save coco: coco17 (COCO body, default), coco_wholebody (133), "
                             "keypoints308, model (the pose model's own keypoints, for a fine-tune with its own set)")
    clips = parser.add_argument_group("videos (.mp4 .mov .avi .mkv .webm .m4v inputs; needs PyAV: pip install av)")
    clips.add_argument("--every", type=int, default=1, metavar="N", help="every Nth frame (default: all)")
    clips.add_argument("--start", type=int, default=0, metavar="S", help="first frame index (zero-based)")
    clips.add_argument("--end", type=int, metavar="E", help="stop before frame index E (default: the end)")
    clips.add_argument("--track-patience", type=int, default=tracking.DEFAULT_PATIENCE, metavar="N",
                       help="pose: processed frames a person may be missed and keep their track id (default: "
                            "%(default)s)")
    clips.add_argument("--smooth", action="store_true",
                       help="pose: One-Euro filter the keypoints of each track (pose.json keeps keypoints_raw)")
    clips.add_argument("--smooth-min-cutoff", type=float, default=tracking.OneEuroSettings.min_cutoff,
                       metavar="HZ", help="One-Euro cutoff when still; lower = smoother (default: %(default)s)")
    clips.add_argument("--smooth-beta", type=float, metavar="BETA", default=tracking.OneEuroSettings.beta,
                       help="One-Euro speed coefficient, per person height per second; higher = less lag when "
                            "moving (default: %(default)s)")
    parser.add_argument("--random-init", choices=weights.RANDOM_INIT, default="never",
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
    try:
        device = torch.device(name) if name else None
    except RuntimeError:
        raise UsageError(f"--device {name!r}: expected cpu, cuda or cuda:N") from None
    if device is None:
        if not torch.cuda.is_available():
            return torch.device("cpu")
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0").strip() or 0))
    if device.type == "cuda":
        count = torch.cuda.device_count()
        if count == 0:
            raise UsageError(f"--device {device}: no CUDA GPU is visible; use --device cpu")
        if (device.index or 0) >= count:
            raise UsageError(f"device {device} (--device or LOCAL_RANK): only GPUs 0 to {count - 1} are visible")
    return device


def pick_dtype(name: str | None, device: torch.device) -> torch.dtype:
    if name:
        return weights.parse_dtype(name)
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


def random_banner(models: dict[str, LoadedModel], args) -> str:
    tasks = ", ".join(t for t, m in models.items() if m.random)
    pose_boxes = []
    if args.random_init == "always" and "pose" in models and not args.boxes:
        pose_boxes = ["Pose boxes: " + ("the random segmentation's blobs (--detector seg)." if args.detector == "seg"
                                        else "the whole image (no person detector was loaded).")]
    return weights.random_weights_banner(
        tasks, args.random_init, "The outputs show that the pipeline runs end to end; the pictures are MEANINGLESS.",
        *pose_boxes)


class Terminated(KeyboardInterrupt):
    """SIGTERM (torchrun stopping the other ranks, a job scheduler, `kill`): handled like Ctrl-C, so temporaries
    are removed and the manifest says "interrupted" with the images not attempted."""


def on_sigterm(signum, frame):
    raise Terminated()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.rope, args.resample = CONVENTIONS[args.conventions]["rope"], CONVENTIONS[args.conventions]["resample"]
    in_main_thread = threading.current_thread() is threading.main_thread()  # signal handlers live there only
    previous = signal.signal(signal.SIGTERM, on_sigterm) if in_main_thread else None
    try:
        return run(args, argv if argv is not None else sys.argv[1:])
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as stop:
        print(f"\n{'terminated' if isinstance(stop, Terminated) else 'interrupted'}: the outputs written so far are "
              f"complete; --skip-existing resumes", file=sys.stderr)
        return 143 if isinstance(stop, Terminated) else 130
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, previous)


def run(args, argv: list[str]) -> int:
    """Check everything that can be checked (arguments, environment, inputs, OUT) before loading a model."""
    start = time.perf_counter()
    tasks, out = parse_tasks(args.task), Path(args.output)
    try:
        metadata.check_data_files()  # an incomplete installation stops here, not on every image after the models load
    except metadata.MissingDataError as error:
        raise UsageError(str(error)) from None
    check_model_sources(args.model)
    coco = "coco" in args.save and "pose" in tasks
    if not coco and not any(kinds & args.save for task in tasks for kinds in ARTEFACTS[task].values()):
        raise UsageError(f"--save {','.join(sorted(args.save))} writes nothing for {','.join(tasks)}")
    rank, world = rank_and_world()
    device = pick_device(args.device)
    dtype = pick_dtype(args.dtype, device)
    batch_size = args.batch_size or (4 if device.type == "cuda" else 1)
    check_video_options(args)
    boxes = read_boxes_file(args.boxes) if args.boxes else None
    items = collect_inputs(args.inputs, exclude=out.resolve())
    names = output_names(items)
    require_av_for(items)
    mine, prefix = shard(items, rank, world), f"[rank {rank}/{world}] " if world > 1 else ""
    unreadable = unreadable_inputs(mine, world)
    warnings = unmatched_boxes_warnings(args.boxes, boxes, items) + renamed_notes(names)
    for message in warnings:
        print(f"warning: {message}", file=sys.stderr)
    for item, error in unreadable.items():  # reported before the models load; skipped as an image failing later is
        print(prefix + failure_report(item, None, error)[1], file=sys.stderr)
    prepare_output_folder(out)
    detector = load_detector(args, tasks, device, dtype)  # before the models: its fallback needs seg
    models = load_models(args, tasks, device, dtype)
    check_size_fits(args.size, models)
    check_flip_pairs(args.flip, models)
    check_keypoint_formats(args, models)
    if any(m.random for m in models.values()):
        print(random_banner(models, args), file=sys.stderr)
    ctx = Context(tasks, models, out, device, dtype, batch_size, args.size, args.flip, args.save,
                  args.mask_with_seg, boxes, names=names, warnings=warnings, detector=detector,
                  seg_boxes=detector is None and args.detector != "none",
                  coco=formats.CocoResults(args.coco_format, keypoint_names(models["pose"].model)) if coco else None,
                  resample=args.resample)
    readable = [item for item in mine if item not in unreadable]
    clips, settings = [item for item in readable if video.is_video(item.path)], video_settings(args, ctx)
    if args.skip_existing and (removed := remove_stale_temporaries(out)):
        print(f"note: removed {removed} temporary files left in {out} by an earlier run that was killed",
              file=sys.stderr)
    images = [item for item in readable if not video.is_video(item.path)]
    todo = [item for item in images if not (args.skip_existing and all_written(ctx, item))]
    manifest = new_manifest(args, argv, ctx, dict(rank=rank, world_size=world, images=len(mine), of=len(items)))
    record_unreadable(ctx, manifest, unreadable)
    manifest["timings_s"] = {"load_models": round(time.perf_counter() - start, 3)}
    path = manifest_path(out, rank, world)
    try:
        write_manifest(path, manifest, reserve=manifest_reserve(len(todo)))
    except OSError as error:
        raise UsageError(f"cannot write the manifest {path} ({os_error_text(error)})") from None
    frames = sum(video.expected_frames(clip.path, settings.selection) for clip in clips)
    progress = Progress(len(todo) + frames, prefix, enabled=rank == 0 or not sys.stderr.isatty())
    ctx.note = progress.note
    stopped = None
    try:
        process_all(ctx, todo, progress)
        for clip in clips:
            manifest.setdefault("videos", {})[clip.relative] = process_video(ctx, clip, settings, progress)
    except StopRun as stop:
        stopped = str(stop)
    finally:
        progress.close()
        skipped = len(images) - len(todo) + sum(v.get("frames_skipped_existing", 0) for v in
                                                manifest.get("videos", {}).values())  # frames count as images
        unfinished = [clip for clip in clips if clip.relative not in manifest.get("videos", {})]
        finish_manifest(manifest, ctx, todo + unfinished, skipped=skipped, elapsed=time.perf_counter() - start,
                        rate=progress.rate(), stopped=stopped)
        if ctx.coco is not None:
            pending = set(todo)
            try:
                write_coco_results(ctx, [item for item in images if item not in pending], rank, world)
            except OSError as error:
                print(f"error: cannot write the COCO results ({os_error_text(error)})", file=sys.stderr)
        try:
            write_final_manifest(path, manifest)
        except OSError as error:
            print(f"error: cannot write the manifest {path} ({os_error_text(error)})", file=sys.stderr)
    counts = manifest["counts"]
    print(f"{prefix}{counts['written']} images written to {out}/, {counts['failed']} failed, "
          f"{counts['skipped_existing']} skipped (already done); {progress.rate():.2f} img/s; manifest {path}",
          file=sys.stderr)
    if stopped:
        print(f"{prefix}error: stopped: {stopped}; {counts['not_attempted']} images not attempted. Fix that and "
              f"rerun the same command with --skip-existing to finish", file=sys.stderr)
    if any(m.random for m in models.values()):
        print(random_banner(models, args), file=sys.stderr)
    # NOTE: under torchrun a rank with failed images still exits 0: torchrun stops every rank as soon as one
    # exits non-zero, which would end the whole run. The failures are in each rank's manifest. A stopped run
    # (disk full, OUT read-only) exits 1 everywhere: the other ranks would hit the same wall.
    return 1 if stopped or (ctx.errors and world == 1) else 0


def unmatched_boxes_warnings(path: str | None, boxes: dict | None, items: list[InputImage]) -> list[str]:
    """A --boxes key that names no input is most likely a typo or a different relative path: say so."""
    if not boxes:
        return []
    keys = {key for item in items for key in box_keys(item)}
    clips = {key for item in items if video.is_video(item.path) for key in box_keys(item)}
    frame_key = re.compile(r"(.+)#\d+")  # a video frame: `REL#N`
    unmatched = [key for key in boxes if key not in keys
                 and not ((match := frame_key.fullmatch(key)) and match[1] in clips)]
    if not unmatched:
        return []
    return [f"--boxes {path}: {len(unmatched)} entries match no input image ({', '.join(map(repr, unmatched[:3]))}"
            f"{', ...' if len(unmatched) > 3 else ''}); keys are the path relative to the input folder or the "
            f"file name"]


def renamed_notes(names: dict[InputImage, str]) -> list[str]:
    """Inputs whose output names had to differ from their stem (x.jpg + x.png in one folder)."""
    renamed = sorted((item.relative, name) for item, name in names.items() if name != item.stem)
    if not renamed:
        return []
    shown = ", ".join(f"{relative} -> {name}.*" for relative, name in renamed[:4])
    return [f"{len(renamed)} inputs would write the same outputs as another; named apart: {shown}"
            + (", ..." if len(renamed) > 4 else "")]


def check_keypoint_formats(args, models: dict[str, LoadedModel]):
    """--save openpose / coco against the pose model's own keypoint set, before any image (formats.py)."""
    if "pose" not in models:
        return
    names = keypoint_names(models["pose"].model)
    for save in ("openpose", "coco"):
        if save in args.save and (problem := formats.unsupported_keypoints(save, args.coco_format, names)):
            raise UsageError(problem)


def check_flip_pairs(flip: bool, models: dict[str, LoadedModel]):
    """The flip test needs the pose model's left/right pairs: say so once, before any image, not per image."""
    if flip and "pose" in models:
        try:
            models["pose"].model.flip_pairs()
        except ValueError as error:
            raise UsageError(f"--model pose: {error}; or run without the flip test (--no-flip)") from None


def check_size_fits(size: tuple[int, int] | None, models: dict[str, LoadedModel]):
    """--size against the loaded models, before any image: the patch grid, the pointmap scale branch."""
    if size is None:
        return
    for task, loaded in models.items():
        config = loaded.backbone.config
        if any(side % config.size_multiple for side in size):
            raise UsageError(f"--size {size[0]}x{size[1]}: the {task} model needs sides that are multiples of "
                             f"{config.size_multiple}")
        head = getattr(loaded.model, "head_config", None)
        if task == "pointmap" and head is not None and head.scale_conv_channels and tuple(size) != config.image_size:
            h, w = config.image_size
            raise UsageError(f"--size {size[0]}x{size[1]}: the pointmap model's scale branch only works at the size "
                             f"it was built for, {h}x{w}; leave --size out or give that")


def unreadable_inputs(items: list[InputImage], world: int) -> dict[InputImage, Exception]:
    """This process's inputs that cannot be read, by their header (not an image, empty, not ours to read, not a
    video), found before any model loads. When none of a single process's inputs can be read, nothing can run."""
    unreadable = {}
    for item in items:
        try:
            (video.check_video_file if video.is_video(item.path) else processing.check_image_file)(item.path)
        except (OSError, ValueError) as error:
            unreadable[item] = error
    if unreadable and len(unreadable) == len(items) and world == 1:
        reasons = [one_line(str(error)) for error in unreadable.values()]
        what = reasons[0] if len(reasons) == 1 else (f"none of the {len(reasons)} inputs can be read: "
                                                      + "; ".join(reasons[:3]) + ("; ..." if len(reasons) > 3 else ""))
        raise UsageError(f"{what}; inputs are images ({' '.join(sorted(IMAGE_SUFFIXES))}), videos, folders, globs "
                         f"or .txt lists of them")
    return unreadable


def record_unreadable(ctx: Context, manifest: dict, unreadable: dict[InputImage, Exception]):
    """The inputs unreadable_inputs found (reported then) in run.json, as failed images (a video: as failed videos)."""
    for item, error in unreadable.items():
        entry, _ = failure_report(item, None, error)
        ctx.errors.append(entry)
        ctx.outcomes[item] = "failed"
        if video.is_video(item.path):
            manifest.setdefault("videos", {})[item.relative] = {"error": entry["error"]}


def require_av_for(items: list[InputImage]):
    """Videos need PyAV: say so before anything is loaded or written."""
    clip = next((item for item in items if video.is_video(item.path)), None)
    if clip is not None:
        try:
            video.require_av()
        except ImportError as error:
            raise UsageError(f"{clip.path}: {error}") from None


def check_video_options(args):
    """--every/--start/--end, --track-patience, --smooth*: checked with the other arguments, before any model
    loads (argparse's float takes nan and inf, which would fill pose.json with nulls)."""
    if args.every < 1 or args.start < 0 or (args.end is not None and args.end <= args.start):
        raise UsageError(f"frames are selected by --every N >= 1, --start S >= 0, --end E > S; got --every "
                         f"{args.every} --start {args.start} --end {args.end}")
    if args.track_patience < 0:
        raise UsageError(f"--track-patience {args.track_patience}: expected a whole number >= 0")
    if not (math.isfinite(args.smooth_min_cutoff) and args.smooth_min_cutoff > 0):
        raise UsageError(f"--smooth-min-cutoff {args.smooth_min_cutoff}: expected a number of Hz above 0")
    if not (math.isfinite(args.smooth_beta) and args.smooth_beta >= 0):
        raise UsageError(f"--smooth-beta {args.smooth_beta}: expected a finite number >= 0")


def video_settings(args, ctx: Context) -> video.VideoSettings:
    """--every/--start/--end, --track-patience, --smooth* (checked by check_video_options), and which pictures
    become overlay videos."""
    smoothing = tracking.OneEuroSettings(args.smooth_min_cutoff, args.smooth_beta) if args.smooth else None
    pictures = [s for task in ctx.tasks for s, kinds in ARTEFACTS[task].items() if "vis" in (kinds & ctx.kinds)]
    return video.VideoSettings(video.FrameSelection(args.every, args.start, args.end), args.skip_existing,
                               args.track_patience, smoothing, tuple(pictures))


VIDEO_PIPELINE = video.Pipeline(process, write_outputs, all_written)


def process_video(ctx: Context, clip: InputImage, settings: video.VideoSettings, progress: Progress) -> dict:
    """A video's frames through the pipeline (video.py); one that cannot be read, or is damaged partway, is
    reported like a bad image (its frames before the damage are kept). Returns its summary for run.json."""
    try:
        summary = video.VideoRun(ctx, clip, settings, progress, VIDEO_PIPELINE).run()
    except StopRun:  # disk full, OUT read-only: the whole run stops (not this video alone)
        raise
    except Exception as error:  # noqa: BLE001 (as for images: one bad input must not end the run)
        summary = {"error": error}
    if "error" in summary:
        progress.total += 1  # the failure counts as one item done
        fail(ctx, clip, [(None, summary["error"])], progress)
        summary["error"] = f"{type(summary['error']).__name__}: {summary['error']}"
    return summary


def write_coco_results(ctx: Context, skipped: list[InputImage], rank: int, world: int):
    """OUT/coco_keypoints.json (one per rank, like run.json): this run's people, and those of the images
    --skip-existing skipped, read back from their pose.json."""
    for item in skipped:
        if not ctx.coco.add_from_pose_json(ctx.names[item], ctx.out / (ctx.names[item] + ".pose.json")):
            print(f"warning: {item.path}: skipped as done, but without a pose.json it is missing from the COCO "
                  f"results (rerun it without --skip-existing)", file=sys.stderr)
    name = "coco_keypoints.json" if world == 1 else f"coco_keypoints.rank{rank}-of-{world}.json"
    atomic_write(ctx.out / name, ctx.coco.results())


def new_manifest(args, argv: list[str], ctx: Context, shard_info: dict) -> dict:
    dtype = str(ctx.dtype).replace("torch.", "")
    return {
        "command": ["predict.py", *argv], "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "status": "running", "tasks": ctx.tasks,
        "models": {task: describe_model(m, dtype) for task, m in ctx.models.items()},
        "settings": {"device": str(ctx.device), "dtype": dtype, "batch_size": ctx.batch_size,
                     "size": list(args.size) if args.size else None, "flip_test": args.flip,
                     "conventions": args.conventions, "rope": args.rope, "resample": args.resample,
                     "mask_with_seg": args.mask_with_seg, "boxes": args.boxes,
                     "detector": None if args.boxes or "pose" not in ctx.tasks else args.detector,
                     "save": sorted(args.save),
                     "coco_format": args.coco_format if "coco" in args.save else None,
                     "skip_existing": args.skip_existing, "output": str(ctx.out),
                     "video": {"every": args.every, "start": args.start, "end": args.end,
                               "track_patience": args.track_patience, "smooth": args.smooth and {
                                   "min_cutoff": args.smooth_min_cutoff, "beta": args.smooth_beta,
                                   "d_cutoff": tracking.OneEuroSettings.d_cutoff}}},
        "versions": versions(), "shard": shard_info,
    }


def finish_manifest(manifest: dict, ctx: Context, todo: list[InputImage], skipped: int, elapsed: float,
                    rate: float, stopped: str | None = None):
    """Final status (finished, stopped: why, interrupted), counts, every error, and the images not attempted."""
    not_attempted = [str(item.path) for item in todo if item not in ctx.outcomes]
    status = "stopped" if stopped else "interrupted" if not_attempted else "finished"
    failed = sum(outcome == "failed" for outcome in ctx.outcomes.values())
    manifest.update(status=status, **({"stop_reason": stopped} if stopped else {}),
                    finished=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                    counts={"images": manifest["shard"]["images"], "written": ctx.done, "failed": failed,
                            "skipped_existing": skipped, "not_attempted": len(not_attempted)},
                    errors=ctx.errors, not_attempted=not_attempted, warnings=ctx.warnings,
                    images_per_s=round(rate, 3))
    manifest["timings_s"].update(total=round(elapsed, 3), model={t: round(s, 3) for t, s in ctx.timings.items()})


if __name__ == "__main__":
    sys.exit(main())
