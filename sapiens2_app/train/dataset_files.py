"""Reading a fine-tuning dataset folder (its formats: datasets.py): its images and their paired target files, each
kind of file, classes.json, intrinsics.json and the COCO keypoint set. A file that is missing or wrong is a
UsageError that names it and says what is wrong with it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from sapiens2 import processing
from sapiens2_app.common.cli import UsageError

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff"}
IGNORE = 255  # the seg class id that the loss and the metrics skip
TARGET_FOLDERS = {"normal": "normals", "pointmap": "pointmaps", "matting": "alphas", "albedo": "albedo", "seg": "masks"}
TARGET_SUFFIX = {"normal": ".npy", "pointmap": ".npy", "matting": ".png", "albedo": ".png", "seg": ".png"}


# ----------------------------------------------------------------------------------------------------
# Listing files
# ----------------------------------------------------------------------------------------------------
def split_folder(root: Path, split: str, required: bool = True) -> Path | None:
    folder = Path(root) / split
    if folder.is_dir():
        return folder
    if required:
        raise UsageError(f"{folder}: no such folder (a dataset folder holds train/ and optionally val/)")
    return None


def list_images(folder: Path) -> dict[str, Path]:
    """images/ -> {NAME (path below images/ without suffix): file}."""
    images_dir = folder / "images"
    if not images_dir.is_dir():
        raise UsageError(f"{images_dir}: no such folder (put the input images there)")
    found = {}
    for path in sorted(images_dir.rglob("*")):
        if path.suffix.lower() in IMAGE_SUFFIXES and path.is_file():
            name = path.relative_to(images_dir).with_suffix("").as_posix()
            if name in found:
                raise UsageError(f"{path} and {found[name]}: two images named {name!r}; names must be unique")
            found[name] = path
    if not found:
        raise UsageError(f"{images_dir}: no images ({', '.join(sorted(IMAGE_SUFFIXES))})")
    return found


def paired_files(folder: Path, kind: str, suffix: str, names, required: bool = True) -> dict[str, Path] | None:
    """{NAME: folder/kind/NAME+suffix}; every image needs one when `required` (else the folder is optional,
    but when present, complete)."""
    target_dir = folder / kind
    if not target_dir.is_dir():
        if required:
            raise UsageError(f"{target_dir}: no such folder (one {kind}/NAME{suffix} per images/NAME.*)")
        return None
    files = {name: target_dir / f"{name}{suffix}" for name in names}
    missing = [str(path) for path in files.values() if not path.is_file()]
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise UsageError(f"missing {kind} file {', '.join(missing[:3])}{more}: each images/NAME.* needs "
                         f"{kind}/NAME{suffix}")
    return files


def header_size(path: Path) -> tuple[int, ...]:
    """(H, W) of an image, or the shape of a .npy array, without reading the data. An image that cannot be read
    is an ImageLoadError naming it (processing.decoding: whatever Pillow raises, a decompression bomb too)."""
    if path.suffix != ".npy":
        with processing.decoding(path), Image.open(path) as image:
            image = processing.ImageOps.exif_transpose(image) if path.parent.name == "images" else image
            return (image.height, image.width)
    try:
        return tuple(np.load(path, mmap_mode="r", allow_pickle=False).shape)
    except (OSError, ValueError) as error:
        raise UsageError(f"{path}: cannot read it ({error})") from None


def read_png(path: Path, mode: str) -> np.ndarray:
    with processing.decoding(path), Image.open(path) as image:
        return np.array(image.convert(mode) if image.mode != mode else image)


def read_class_ids(path: Path) -> np.ndarray:
    with processing.decoding(path), Image.open(path) as image:
        mode = image.mode
        ids = np.array(image) if mode in ("L", "P") else None
    if ids is None:
        raise UsageError(f"{path}: a {mode} image; masks are single-channel uint8 PNGs of class ids (mode L or P), "
                         f"255 = ignore")
    return ids


def read_npy(path: Path, image_size: tuple[int, int], what: str) -> np.ndarray:
    try:
        array = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as error:
        raise UsageError(f"{path}: cannot read it as a .npy array ({error})") from None
    if array.shape != (*image_size, 3):
        raise UsageError(f"{path}: shape {array.shape}, expected {(*image_size, 3)} ({what} for an image of "
                         f"{image_size[0]}x{image_size[1]})")
    return array.astype(np.float32)


def check_size(path: Path, array: np.ndarray, image_size: tuple[int, int], image_path: Path):
    if tuple(array.shape[:2]) != tuple(image_size):
        raise UsageError(f"{path}: size {array.shape[0]}x{array.shape[1]}, but {image_path} is "
                         f"{image_size[0]}x{image_size[1]}")


# ----------------------------------------------------------------------------------------------------
# Side files: classes.json, intrinsics.json (or intrinsics fitted to a pointmap)
# ----------------------------------------------------------------------------------------------------
def read_classes(root: Path) -> list[str]:
    """classes.json: a list of class names, in the dataset folder (or in train/)."""
    for path in (Path(root) / "classes.json", Path(root) / "train" / "classes.json"):
        if path.exists():
            try:
                names = json.loads(path.read_text())
            except ValueError as error:
                raise UsageError(f"{path}: not valid JSON ({error})") from None
            if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
                raise UsageError(f"{path}: expected a list of class names, e.g. [\"background\", \"person\"]")
            if len(names) > IGNORE:
                raise UsageError(f"{path}: {len(names)} classes; at most 255 fit in uint8 masks (255 = ignore)")
            return names
    raise UsageError(f"{Path(root) / 'classes.json'}: no such file (a JSON list of the class names)")


def read_intrinsics(folder: Path, names) -> dict[str, torch.Tensor] | None:
    path = folder / "intrinsics.json"
    if not path.exists():
        return None
    try:
        table = json.loads(path.read_text())
        return {name: torch.tensor([[float(v["fx"]), 0, float(v["cx"])], [0, float(v["fy"]), float(v["cy"])],
                                    [0, 0, 1]]) for name, v in table.items()}
    except (ValueError, KeyError, TypeError) as error:
        raise UsageError(f"{path}: expected {{NAME: {{fx, fy, cx, cy}}}} ({error!r})") from None


def fit_intrinsics(points: np.ndarray, valid: np.ndarray, path: Path) -> torch.Tensor:
    """A pinhole K fitted to a pointmap (least squares of u = fx X/Z + cx, v = fy Y/Z + cy), when
    intrinsics.json does not give it."""
    v, u = np.nonzero(valid & (points[..., 2] > 1e-6))
    if len(u) < 3:
        raise UsageError(f"{path}: fewer than 3 valid points with Z > 0; cannot fit the intrinsics "
                         f"(give them in intrinsics.json)")
    z = points[v, u, 2]
    fx, cx = np.linalg.lstsq(np.stack([points[v, u, 0] / z, np.ones_like(z)], 1), u, rcond=None)[0]
    fy, cy = np.linalg.lstsq(np.stack([points[v, u, 1] / z, np.ones_like(z)], 1), v, rcond=None)[0]
    return torch.tensor([[fx, 0, cx], [0, fy, cy], [0, 0, 1]], dtype=torch.float32)


# ----------------------------------------------------------------------------------------------------
# Pose: annotations.json (COCO keypoints) and its keypoint set
# ----------------------------------------------------------------------------------------------------
def read_annotations(folder: Path) -> tuple[dict, Path]:
    """folder/annotations.json, read (COCO keypoints: images, annotations, categories), and its path."""
    path = Path(folder) / "annotations.json"
    if not path.is_file():
        raise UsageError(f"{path}: no such file (COCO keypoints annotations for images/)")
    try:
        return json.loads(path.read_text(), parse_constant=not_a_number, parse_float=finite_float), path
    except NonFiniteNumber as error:
        raise UsageError(f"{path}: {error} is not a finite number (keypoints and boxes must be; an unlabelled "
                         "keypoint is 0, 0, 0)") from None
    except ValueError as error:
        raise UsageError(f"{path}: not valid JSON ({error})") from None


# The keypoint sets whose official tables sapiens2 ships (data/, written from the original's config by
# tests/fixtures/make_keypoint_tables.py): name -> (data file, how many of its first keypoints). COCO's 17 body
# keypoints are the first 17 of COCO-WholeBody, with their swaps and sigmas.
KNOWN_KEYPOINT_SETS = {"sapiens 308": ("keypoints308.json", 308), "COCO-WholeBody 133": ("coco_wholebody133.json", 133),
                       "COCO 17": ("coco_wholebody133.json", 17)}


def keypoint_set(coco: dict, path: Path) -> dict:
    """Names, flip pairs, skeleton and (optional) OKS sigmas of categories[0]. Flip pairs and sigmas: the category's
    own when given, else the official table of a known set (the same names, in any order), else (flip pairs only)
    paired by their names; `flip_pairs_from` says which (inferred_pairs_warning tells the user)."""
    categories = coco.get("categories") or []
    if not categories or not categories[0].get("keypoints"):
        raise UsageError(f"{path}: categories[0].keypoints (the keypoint names) is missing")
    category = categories[0]
    names = [str(n) for n in category["keypoints"]]
    known = known_keypoint_set(names)
    pairs, sigmas = category.get("flip_pairs"), category.get("sigmas")
    if pairs is not None:
        pairs, source = [[int(a), int(b)] for a, b in pairs], "annotations"
    elif known is not None:
        pairs, source = known["flip_pairs"], known["name"]
    else:
        pairs, source = flip_pairs_from_names(names), "names"
    if any(not (0 <= i < len(names)) for pair in pairs for i in pair):
        raise UsageError(f"{path}: flip_pairs index a keypoint outside 0..{len(names) - 1}")
    if sigmas is None and known is not None:
        sigmas = known["sigmas"]
    if sigmas is not None and len(sigmas) != len(names):
        raise UsageError(f"{path}: {len(sigmas)} sigmas for {len(names)} keypoints")
    return {"keypoint_names": names, "flip_pairs": pairs, "flip_pairs_from": source,
            "skeleton": category.get("skeleton", []), "sigmas": sigmas}


def known_keypoint_set(names: list[str]) -> dict | None:
    """The official table of the known set with exactly these names (in any order), in the order of `names`:
    {name, flip_pairs (a < b), sigmas}; None for another set."""
    for set_name, (file, count) in KNOWN_KEYPOINT_SETS.items():
        table = processing.read_data(file)
        official = table["keypoint_names"][:count]
        if len(names) != count or sorted(names) != sorted(official):
            continue
        position = {name: i for i, name in enumerate(names)}  # official index -> index in `names`
        mirror = [position[official[j]] for j in table["flip_indices"][:count]]
        order = [position[name] for name in official]
        pairs = sorted([order[i], mirror[i]] for i in range(count) if order[i] < mirror[i])
        sigmas = [0.0] * count
        for i, sigma in zip(order, table["sigmas"]):
            sigmas[i] = float(sigma)
        return {"name": set_name, "flip_pairs": pairs, "sigmas": sigmas}
    return None


def inferred_pairs_warning(meta: dict) -> str | None:
    """For a keypoint set that is neither known nor gives flip_pairs: what the name rule paired and left alone."""
    if meta.get("flip_pairs_from") != "names":
        return None
    names = meta["keypoint_names"]
    paired = {i for pair in meta["flip_pairs"] for i in pair}
    inferred = ", ".join(f"{names[a]}<->{names[b]}" for a, b in meta["flip_pairs"]) or "none"
    alone = ", ".join(name for i, name in enumerate(names) if i not in paired) or "none"
    known = ", ".join(KNOWN_KEYPOINT_SETS)
    return (f"warning: the {len(names)} keypoint names are not a known set ({known}) and annotations.json gives no "
            f"flip_pairs, so the mirror pairs come from the names (left_/right_, l_/r_): {len(meta['flip_pairs'])} "
            f"pairs: {inferred}; their own mirror (unpaired): {alone}. If a flipped person should map other "
            f"keypoints, give categories[0].flip_pairs")


def flip_order(count: int, pairs) -> torch.Tensor:
    order = torch.arange(count)
    for a, b in pairs:
        order[a], order[b] = b, a
    return order


def flip_pairs_from_names(names: list[str]) -> list[list[int]]:
    """Left/right pairs from `left_*`/`right_*` (or `l_*`/`r_*`) names, any case (keypoints and classes)."""
    index = {n.lower(): i for i, n in enumerate(names)}
    pairs = []
    for name, i in index.items():
        for left, right in (("left_", "right_"), ("l_", "r_")):
            if name.startswith(left) and right + name[len(left):] in index:
                pairs.append([i, index[right + name[len(left):]]])
    return sorted(pairs)


# Strict numbers in annotations.json (read_annotations): a NaN keypoint would train a NaN model
class NonFiniteNumber(ValueError):
    """NaN or Infinity (Python's json reads them; they are not JSON) or a number too large for a float."""


def not_a_number(text: str):
    raise NonFiniteNumber(text)


def finite_float(text: str) -> float:
    if not math.isfinite(value := float(text)):
        raise NonFiniteNumber(text)
    return value
