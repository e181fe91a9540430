"""Person boxes for top-down pose: the --boxes file (COCO xywh per input), the segmentation's person blobs, the
whole image; which one an image gets (pose_boxes), and every box clipped to its image.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from sapiens2 import processing
from sapiens2_app.common.cli import UsageError
from sapiens2_app.predict.inputs import FRAME_KEY, InputImage, clip_of_frame_key, is_video

MIN_BLOB_FRACTION = 0.1  # person blobs smaller than this fraction of the largest one are dropped
MIN_BLOB_AREA = 0.002  # ... and blobs under this fraction of the image
BLOB_GRID = 512  # connected components are found on the mask max-pooled to at most this many pixels a side
# People of one image, from any source. All of an image's crops and heatmaps are held at once: ~40 MB a person at
# 1024x768 (a crop, its mirror for the flip test, a 308 x 256 x 192 heatmap), so 64 people take ~2.6 GB; 1,000 boxes
# (a 15 KB --boxes file) would take ~40 GB. A --boxes entry with more is refused; a detector's or the segmentation's
# extra boxes (the lowest-scoring, the smallest) are dropped with a warning.
MAX_PEOPLE = 64
MAX_COORDINATE = 1e7  # pixels: a --boxes number beyond this is no image's (and a JSON integer may exceed a float)


# ----------------------------------------------------------------------------------------------------
# --boxes
# ----------------------------------------------------------------------------------------------------
def read_boxes_file(path: str) -> dict[str, list[list[float]]]:
    """--boxes: a JSON object, image file name -> list of at most MAX_PEOPLE COCO [x, y, w, h] boxes in image pixels.
    Every value a finite number within MAX_COORDINATE (NaN/Infinity are refused, not JSON anyway), width and height
    above 0. Boxes reaching outside an image are clipped to it when the image is read; those wholly outside are
    dropped, with a warning."""
    def refuse_constant(name):
        raise ValueError(f"{name} is not a number JSON allows")

    try:
        boxes = json.loads(Path(path).read_text(), parse_constant=refuse_constant)
    except Exception as error:  # noqa: BLE001 (whatever reading the user's file raises, a RecursionError of deep
        # nesting too, is one line naming it; Exception, not BaseException, as in processing.decoding)
        raise UsageError(f"--boxes {path}: cannot read it as JSON ({error})") from None
    if not isinstance(boxes, dict):
        raise UsageError(f"--boxes {path}: expected an object {{\"image.jpg\": [[x, y, w, h], ...]}}")
    for name, entry in boxes.items():
        ok = isinstance(entry, list) and all(
            isinstance(b, list) and len(b) == 4 and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                        for v in b) for b in entry)
        if not ok:
            raise UsageError(f"--boxes {path}: {name!r} must map to a list of [x, y, w, h] boxes, got "
                             f"{shortened(entry)}")
        if len(entry) > MAX_PEOPLE:
            raise UsageError(f"--boxes {path}: {name!r} has {len(entry)} boxes; at most {MAX_PEOPLE} people per image "
                             f"(each takes ~40 MB at 1024x768)")
        for box in entry:
            # abs() before isfinite: a JSON integer too large for a float overflows math.isfinite
            if not all(abs(v) <= MAX_COORDINATE and math.isfinite(v) for v in box) or box[2] <= 0 or box[3] <= 0:
                raise UsageError(f"--boxes {path}: {name!r} has the box {shortened(box)}: x, y, w, h must be finite "
                                 f"numbers within {MAX_COORDINATE:g}, the width and height above 0 (COCO [x, y, w, h], "
                                 f"image pixels)")
    return boxes


def shortened(value, limit: int = 200) -> str:
    """A value of the user's file for a message: its repr cut to `limit` characters (an integer of more than 4300
    digits, which repr refuses, as its digit count)."""
    try:
        text = repr(value)
    except ValueError:
        text = "a number of more than 4300 digits"
    return text if len(text) <= limit else text[:limit] + "..."


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


def unmatched_boxes_warnings(path: str | None, boxes: dict | None, items: list[InputImage]) -> list[str]:
    """A --boxes key that names no input is most likely a typo or a different relative path: say so."""
    if not boxes:
        return []
    keys = {key for item in items for key in box_keys(item)}
    clips = {key for item in items if is_video(item.path) for key in box_keys(item)}
    unmatched = [key for key in boxes if key not in keys and clip_of_frame_key(key) not in clips]
    if not unmatched:
        return []
    return [f"--boxes {path}: {len(unmatched)} entries match no input image ({', '.join(map(repr, unmatched[:3]))}"
            f"{', ...' if len(unmatched) > 3 else ''}); keys are the path relative to the input folder or the "
            f"file name"]


def frame_keys_past_the_end(boxes: dict | None, clip: InputImage, frames: int) -> list[str]:
    """The --boxes keys of `clip`'s frames (`clip.mp4#N`, by any of its box_keys) that name no frame of its
    `frames` (the frame count is known only once the video is decoded: unmatched_boxes_warnings cannot tell)."""
    names = set(box_keys(clip))
    return [key for key in boxes or () if (match := FRAME_KEY.fullmatch(key)) and match[1] in names
            and int(match[2]) >= frames]




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
# The boxes of an image
# ----------------------------------------------------------------------------------------------------
def pose_boxes(item: InputImage, image, boxes: dict | None, segmentation,
               detected: torch.Tensor | None = None) -> tuple[list, str, list | None, list[str]]:
    """(COCO xywh person boxes inside the image, where they came from, the detector's score of each, warnings): the
    --boxes entry (`boxes`), else the detector's person boxes, else the segmentation's person blobs, else the whole
    image."""
    height, width = image.shape[-2:]
    entry = boxes_for(item, boxes) if boxes is not None else None
    if entry is not None:
        inside = fit_boxes(entry, width, height)
        dropped = [box for box, fitted in zip(entry, inside) if fitted is None]
        warnings = [f"{item.path}: --boxes {dropped} lie outside the {width}x{height} image; dropped"] if dropped else []
        return [box for box in inside if box is not None], "boxes-file", None, warnings
    if detected is not None:  # an empty box has nothing to crop; a non-finite one (fp16 overflow) means nothing
        detected = detected[(detected[:, 2] > 0) & (detected[:, 3] > 0) & torch.isfinite(detected).all(dim=1)]
    if detected is not None and len(detected):
        inside = fit_boxes(detected[:, :4].tolist(), width, height)  # kept as detected, unless wholly outside
        kept = [(box, score) for box, fitted, score in zip(detected[:, :4].tolist(), inside, detected[:, 4].tolist())
                if fitted is not None]
        if kept:
            if len(kept) > MAX_PEOPLE:  # the highest scores are kept (the order otherwise stays the detector's)
                kept = sorted(kept, key=lambda pair: -pair[1])
            kept, warnings = at_most_max_people(kept, item, "detected people, the lowest-scoring")
            return [box for box, _ in kept], "detector", [score for _, score in kept], warnings
    found = person_boxes(segmentation) if segmentation is not None else []
    found, source = (found, "segmentation") if found else (whole_image_box(image), "whole-image")
    found, warnings = at_most_max_people(found, item, "person blobs of the segmentation, the smallest")
    return [fit_boxes([box], width, height)[0] for box in found], source, None, warnings


def at_most_max_people(boxes: list, item: InputImage, what: str) -> tuple[list, list[str]]:
    """The first MAX_PEOPLE of `boxes` (ordered best first), and a warning when there were more."""
    if len(boxes) <= MAX_PEOPLE:
        return boxes, []
    return boxes[:MAX_PEOPLE], [f"{item.path}: {len(boxes)} {what} {len(boxes) - MAX_PEOPLE} dropped (at most "
                                f"{MAX_PEOPLE} people per image)"]


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
