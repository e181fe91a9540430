"""Files other tools read: OpenPose JSON, COCO keypoint results, PLY point clouds, 16-bit depth PNGs.

Each function turns one result of predict.py (pose people, a pointmap) into what goes in the file;
predict.py writes it (atomically, like its other outputs). The keypoint mappings come from data/openpose.json
(OpenPose) and data/keypoints308.json (COCO), checked against the 308 names when first read.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from PIL import Image

from sapiens2 import processing
from sapiens2.processing import keypoint_metadata, read_data

OPENPOSE_VERSION = 1.3  # the layout below: people[] with person_id and the *_keypoints_2d / *_3d arrays
OPENPOSE_PARTS = ("pose_keypoints_2d", "face_keypoints_2d", "hand_left_keypoints_2d", "hand_right_keypoints_2d")
COCO_FORMATS = ("coco17", "coco_wholebody", "keypoints308", "model")
DEPTH16_SCALE = 1000.0  # depth16 PNGs hold millimetres


# ----------------------------------------------------------------------------------------------------
# People: predict.py's person dicts <-> arrays in the 308-keypoint order
# ----------------------------------------------------------------------------------------------------
def keypoint_arrays(person: dict, key: str = "keypoints", count: int | None = None
                    ) -> tuple[np.ndarray, np.ndarray]:
    """(K, 2) xy and (K,) scores of a person, K = `count` (the model's keypoints; None: the 308); keypoints a
    result lacks (thresholded away) are 0, 0, 0."""
    count = count or keypoint_metadata()["num_keypoints"]
    xy, scores = np.zeros((count, 2), np.float64), np.zeros(count, np.float64)
    labels = person["labels"].cpu().numpy() if "labels" in person else np.arange(count)
    xy[labels] = torch.as_tensor(person[key]).float().cpu().numpy()
    scores[labels] = torch.as_tensor(person["scores"]).float().cpu().numpy()
    return xy, scores


def at_file_precision(person: dict, count: int | None = None) -> dict:
    """A person rounded as pose.json writes it (0.01 px, scores to 4 decimals), so what is computed from a
    fresh result and from its file read back is the same to the last digit."""
    xy, scores = keypoint_arrays(person, count=count)
    return {"keypoints": torch.tensor([[round(x, 2), round(y, 2)] for x, y in xy.tolist()], dtype=torch.float64),
            "scores": torch.tensor([round(s, 4) for s in scores.tolist()], dtype=torch.float64),
            "labels": torch.arange(len(scores)),
            "bbox": torch.tensor([round(v, 2) for v in person["bbox"].tolist()], dtype=torch.float64)}


def read_pose_json(path) -> tuple[dict, list[dict]]:
    """A NAME.pose.json read back: (its image entry, its people as person dicts). ValueError naming the file when
    it is missing, damaged or not a pose.json (the one reader for --skip-existing: COCO results, video tracks)."""
    try:
        data = json.loads(Path(path).read_text())
        return data["image"], people_from_pose_json(data)
    except (OSError, ValueError, KeyError, TypeError, IndexError, RuntimeError) as e:
        raise ValueError(f"{path}: not a readable pose.json ({type(e).__name__}: {e})") from None


def people_from_pose_json(data: dict) -> list[dict]:
    """The people of a NAME.pose.json back as person dicts (to resume a run from its files)."""
    people = []
    for entry in data["people"]:
        table = torch.tensor(entry["keypoints"], dtype=torch.float64)  # (308, 3) x, y, score, as written
        person = {"keypoints": table[:, :2], "scores": table[:, 2], "labels": torch.arange(len(table)),
                  "bbox": torch.tensor(entry["box"], dtype=torch.float64)}
        if "keypoints_raw" in entry:
            person["keypoints_raw"] = torch.tensor(entry["keypoints_raw"], dtype=torch.float64)[:, :2]
        if "track_id" in entry:
            person["track_id"] = entry["track_id"]
        people.append(person)
    return people


# ----------------------------------------------------------------------------------------------------
# OpenPose: NAME_keypoints.json
# ----------------------------------------------------------------------------------------------------
@lru_cache(maxsize=None)
def openpose_table(names: tuple[str, ...] | None = None) -> dict[str, list[list[int]]]:
    """data/openpose.json as indices: per OpenPose part, per point, the keypoint indices it is the mean of
    (empty: Sapiens2 has no such point). An unknown name is an error naming it. `names`: a model's own keypoint
    set (None: the 308), indexed by name; a point whose sources it lacks is empty (written as 0, 0, 0)."""
    table = read_data("openpose.json")
    index = {name: i for i, name in enumerate(keypoint_metadata()["keypoint_names"])}
    own = index if names is None else {name: i for i, name in enumerate(names)}
    parts = {}
    for part in OPENPOSE_PARTS:
        rows = []
        for label, source in table[part]:
            sources = [] if source is None else [source] if isinstance(source, str) else list(source)
            unknown = [name for name in sources if name not in index]
            if unknown:
                raise ValueError(f"data/openpose.json: {part} {label}: {unknown} are not keypoints308 names")
            rows.append([own[name] for name in sources] if all(name in own for name in sources) else [])
        parts[part] = rows
    return parts


def unsupported_keypoints(save: str, keypoint_format: str, names: tuple[str, ...]) -> str | None:
    """Why `--save openpose|coco` cannot be written for a pose model with these keypoint names, or None.
    OpenPose's BODY_25 and COCO's body need COCO's 17 body keypoints (found by name: the 308 set has them, a
    COCO-17 fine-tune is them); --coco-format keypoints308 needs the 308 set; --coco-format model writes any set."""
    names308 = tuple(keypoint_metadata()["keypoint_names"])
    if names == names308 or (save == "coco" and keypoint_format == "model"):
        return None
    what = f"the pose model has its own {len(names)} keypoints ({_first(names, 4)})"
    if save == "coco" and keypoint_format == "keypoints308":
        return f"--save coco --coco-format keypoints308: {what}, not the 308; use --coco-format model"
    missing = [name for name in processing.coco17_names() if name not in names]
    if not missing:
        return None
    fix = "use --coco-format model (its own keypoints)" if save == "coco" else "NAME.pose.json has its keypoints"
    flag = f"--save coco --coco-format {keypoint_format}" if save == "coco" else "--save openpose"
    return f"{flag}: {what}, which lack COCO's body keypoints {_first(missing, 3)}; {fix}"


def _first(names, count: int) -> str:
    return ", ".join(names[:count]) + (", ..." if len(names) > count else "")


def openpose_values(xy: np.ndarray, scores: np.ndarray, rows: list[list[int]]) -> list[float]:
    """[x0, y0, c0, x1, y1, c1, ...]: each point the mean of its sources, its confidence their lowest score."""
    values = []
    for sources in rows:
        if not sources:
            values += [0.0, 0.0, 0.0]
            continue
        x, y = xy[sources].mean(axis=0)
        values += [round(float(x), 2), round(float(y), 2), round(float(scores[sources].min()), 4)]
    return values


def openpose_json(people: list[dict], names: tuple[str, ...] | None = None) -> dict:
    """OpenPose's --write_json layout for one image. person_id is the track id in videos, else -1 (as
    OpenPose writes without tracking). Scores are Sapiens2's heatmap maxima, not thresholded. `names`: the
    model's keypoint names (None: the 308); points it lacks are 0, 0, 0 (`unsupported_keypoints` first)."""
    names = None if names is None else tuple(names)
    table, entries = openpose_table(names), []
    for person in people:
        xy, scores = keypoint_arrays(person, count=None if names is None else len(names))
        entry = {"person_id": [int(person.get("track_id", -1))]}
        for part in OPENPOSE_PARTS:
            entry[part] = openpose_values(xy, scores, table[part])
        for part in OPENPOSE_PARTS:
            entry[part.replace("_2d", "_3d")] = []
        entries.append(entry)
    return {"version": OPENPOSE_VERSION, "people": entries}


# ----------------------------------------------------------------------------------------------------
# COCO: one OUT/coco_keypoints.json per run
# ----------------------------------------------------------------------------------------------------
WHOLEBODY_PARTS = {"keypoints": (0, 17), "foot_kpts": (17, 23), "face_kpts": (23, 91),
                   "lefthand_kpts": (91, 112), "righthand_kpts": (112, 133)}  # COCO-WholeBody's 133 keypoints


def pose_to_coco(results: list[list[dict]], image_ids: Sequence[int], keypoint_format: str = "keypoints308",
                 category_id: int = 1, score_threshold: float = 0.2, names: Sequence[str] | None = None
                 ) -> list[dict]:
    """Pose results -> COCO keypoint-detection results (JSON-serialisable list of dicts).

    keypoint_format: "keypoints308" (all 308), "coco17" (COCO body), or "coco_wholebody" (133 keypoints split
    into keypoints / foot_kpts / face_kpts / lefthand_kpts / righthand_kpts as the COCO-WholeBody evaluator
    reads them). Each keypoint is `[x, y, score]`; keypoints the 308 set lacks (most of the 68 WholeBody face
    points) or that were thresholded away are `[0, 0, 0]`. The person score is the mean of the keypoint scores
    above `score_threshold` (mmpose's rescoring without a detector score); bbox is xywh.
    `names`: the model's keypoint names (None: the 308); people's labels index them, and the exported points
    are found by name (a point the model lacks is `[0, 0, 0]`). keypoint_format "model": the model's own
    keypoints in its order (the 308 for the released model).
    """
    if len(image_ids) != len(results):
        raise ValueError(f"{len(results)} images of results but {len(image_ids)} image ids")
    names = tuple(names) if names is not None else tuple(keypoint_metadata()["keypoint_names"])
    source_ids = export_indices(keypoint_format, names)
    entries = []
    for image_id, people in zip(image_ids, results):
        for person in people:
            table = _full_keypoint_table(person, len(names))  # (K, 3)
            picked = [table[i] if i >= 0 else [0.0, 0.0, 0.0] for i in source_ids]
            scores = [s for _, _, s in picked if s > score_threshold]
            x0, y0, x1, y1 = person["bbox"].tolist()
            entry = {"image_id": image_id, "category_id": category_id, "bbox": [x0, y0, x1 - x0, y1 - y0],
                     "score": float(sum(scores) / len(scores)) if scores else 0.0}
            if keypoint_format == "coco_wholebody":
                for name, (start, stop) in WHOLEBODY_PARTS.items():
                    entry[name] = [v for point in picked[start:stop] for v in point]
            else:
                entry["keypoints"] = [v for point in picked for v in point]
            entries.append(entry)
    return entries


def export_indices(keypoint_format: str, names: Sequence[str]) -> list[int]:
    """For each exported keypoint, its index among the model's keypoint `names` (-1: the model has no such
    point)."""
    if keypoint_format == "model":
        return list(range(len(names)))
    position = {name: i for i, name in enumerate(names)}
    names308 = keypoint_metadata()["keypoint_names"]
    return [position.get(names308[k], -1) if k >= 0 else -1 for k in _export_indices(keypoint_format)]


def _export_indices(keypoint_format: str) -> list[int]:
    """For each exported keypoint, its index among the 308 (-1 where the 308 set has no such point)."""
    if keypoint_format == "keypoints308":
        return list(range(keypoint_metadata()["num_keypoints"]))
    if keypoint_format == "coco17":
        return list(processing.coco17_indices())
    if keypoint_format == "coco_wholebody":
        mapping = dict(keypoint_metadata()["coco_wholebody_to_keypoints308"])
        return [mapping.get(i, -1) for i in range(133)]
    raise ValueError(f"keypoint_format must be 'keypoints308', 'coco17', 'coco_wholebody' or 'model', "
                     f"got {keypoint_format!r}")


def _full_keypoint_table(person: dict, count: int) -> list[list[float]]:
    table = [[0.0, 0.0, 0.0] for _ in range(count)]
    for k, (x, y), s in zip(person["labels"].tolist(), person["keypoints"].tolist(), person["scores"].tolist()):
        table[k] = [x, y, s]
    return table


class CocoResults:
    """COCO keypoint-detection results gathered image by image (pose_to_coco), written once at the
    end: a list of {image_id, category_id, keypoints (or the five WholeBody parts), score, bbox} plus
    "image_file" (the input's relative path, `clip.mp4#12` for a video frame).

    image_id: the number in the file name when every image has one (COCO's own `000000397133.jpg`, video
    frames `000012`) and they are distinct, else the position of the image in the sorted file names."""

    def __init__(self, keypoint_format: str = "coco17", names: tuple[str, ...] | None = None):
        if keypoint_format not in COCO_FORMATS:
            raise ValueError(f"COCO keypoint format must be one of {', '.join(COCO_FORMATS)}, got {keypoint_format!r}")
        self.keypoint_format = keypoint_format
        self.names = tuple(names) if names is not None else tuple(keypoint_metadata()["keypoint_names"])
        self.images: dict[str, tuple[str, list[dict]]] = {}  # output name -> (image file, entries without id)

    def add(self, name: str, image_file: str, people: list[dict]):
        entries = pose_to_coco([[at_file_precision(p, len(self.names)) for p in people]], [0],
                                          self.keypoint_format, names=self.names)
        for entry in entries:
            del entry["image_id"]
            entry["bbox"] = [round(v, 2) for v in entry["bbox"]]
            entry["score"] = round(entry["score"], 4)
        self.images[name] = (image_file, entries)

    def add_from_pose_json(self, name: str, path) -> bool:
        """An image skipped by --skip-existing: its people from its pose.json. False when it cannot be read."""
        try:
            image, people = read_pose_json(path)
        except ValueError:
            return False
        self.add(name, image, people)
        return True

    def results(self) -> list[dict]:
        names = sorted(self.images)
        numbers = [re.fullmatch(r"\d+", name.rsplit("/", 1)[-1]) for name in names]
        numbered = all(numbers) and len({int(n[0]) for n in numbers}) == len(names)
        ids = [int(n[0]) for n in numbers] if numbered else list(range(len(names)))
        return [{"image_id": image_id, **entry, "image_file": self.images[name][0]}
                for image_id, name in zip(ids, names) for entry in self.images[name][1]]


# ----------------------------------------------------------------------------------------------------
# Point clouds and depth
# ----------------------------------------------------------------------------------------------------
PLY_VERTEX = np.dtype([("x", "<f4"), ("y", "<f4"), ("z", "<f4"), ("red", "u1"), ("green", "u1"), ("blue", "u1")])


def pointmap_ply(pointmap: torch.Tensor, image: torch.Tensor, mask: torch.Tensor | None = None) -> bytes:
    """A (3, H, W) pointmap coloured by the (3, H, W) photo -> binary little-endian PLY: x y z float32 (the
    pointmap's metric camera-frame XYZ, as in NAME.pointmap.npy) + red green blue uchar, one vertex per valid
    pixel (finite, and inside `mask` when given), in row-major pixel order."""
    points = pointmap.float().permute(1, 2, 0).reshape(-1, 3).cpu().numpy()  # (H*W, 3)
    colors = image.float().round().clamp(0, 255).to(torch.uint8).permute(1, 2, 0).reshape(-1, 3).cpu().numpy()
    valid = np.isfinite(points).all(axis=1)
    if mask is not None:
        valid &= mask.bool().reshape(-1).cpu().numpy()
    vertices = np.empty(int(valid.sum()), PLY_VERTEX)
    for axis, name in enumerate("xyz"):
        vertices[name] = points[valid, axis]
    for channel, name in enumerate(("red", "green", "blue")):
        vertices[name] = colors[valid, channel]
    header = ("ply\nformat binary_little_endian 1.0\ncomment sapiens2 pointmap: metric XYZ in the camera frame\n"
              f"element vertex {len(vertices)}\nproperty float x\nproperty float y\nproperty float z\n"
              "property uchar red\nproperty uchar green\nproperty uchar blue\nend_header\n")
    return header.encode("ascii") + vertices.tobytes()


def depth16_image(depth: torch.Tensor, mask: torch.Tensor | None = None) -> Image.Image:
    """(H, W) metric depth -> 16-bit PNG of millimetres, rounded. 0 = invalid: not finite, <= 0, outside the
    mask, or beyond 65.535 m (what 16 bits hold; written as invalid rather than clipped to a wrong depth)."""
    millimetres = depth.double().cpu().numpy() * DEPTH16_SCALE
    with np.errstate(invalid="ignore"):
        valid = np.isfinite(millimetres) & (millimetres >= 0.5) & (millimetres < 65535.5)
    if mask is not None:
        valid &= mask.bool().cpu().numpy()
    values = np.where(valid, np.round(np.nan_to_num(millimetres)), 0).astype(np.uint16)
    return Image.fromarray(values)  # mode I;16: PNG stores it as 16-bit greyscale
