"""Fine-tuning data for train.py: the six tasks' folder formats, augmentations with their target transforms,
training targets and the evaluation metrics.

One dataset folder per task, with `train/` and an optional `val/` (formats in README.md, "Fine-tune"):
  pose      annotations.json (COCO keypoints) + images/
  seg       images/NAME.* + masks/NAME.png (uint8 class ids, 255 = ignore) + classes.json (class names)
  normal    images/ + normals/NAME.npy (H, W, 3 unit vectors) + optional masks/NAME.png (nonzero = valid)
  pointmap  images/ + pointmaps/NAME.npy (H, W, 3 metric XYZ) + optional masks/ + optional intrinsics.json
  matting   images/ + alphas/NAME.png
  albedo    images/ + albedo/NAME.png (RGB; an alpha channel, if any, is the valid mask)

A sample is fetched as dataset[(index, seed)]: every random choice of its augmentation comes from a generator
seeded with `seed`, so a sample is the same whichever process or worker loads it (what makes 1 and N processes,
and a resumed run, see the same batches).

Every sample is a dict of tensors at the network input size: `pixel_values` and the task model's loss
arguments (see LOSS_KEYS), plus what the metrics need.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

import processing
from heads import CANONICAL_FOCAL

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff"}
IGNORE = 255
# The task models' forward() arguments that a sample provides (besides pixel_values).
LOSS_KEYS = {
    "pose": ("labels", "label_weights"),
    "seg": ("labels",),
    "normal": ("labels", "mask"),
    "pointmap": ("labels", "mask", "scales", "intrinsics"),
    "albedo": ("labels", "mask"),
    "matting": ("labels",),
}
TARGET_FOLDERS = {"normal": "normals", "pointmap": "pointmaps", "matting": "alphas", "albedo": "albedo", "seg": "masks"}
TARGET_SUFFIX = {"normal": ".npy", "pointmap": ".npy", "matting": ".png", "albedo": ".png", "seg": ".png"}


class DataError(ValueError):
    """Bad training data; the message names the file and what is wrong with it."""


# ----------------------------------------------------------------------------------------------------
# Augmentation settings (the original's kinds, in torch; every random choice from the sample's generator)
# ----------------------------------------------------------------------------------------------------
DENSE_SCALE = (0.6, 1.2)  # crop box size relative to the whole-image box: < 1 zooms in
DENSE_SHIFT = 0.2  # crop centre shift, as a share of the crop size
COLOR_JITTER = 0.2  # brightness, contrast and saturation factors in [1 - j, 1 + j]
POSE_SCALE = (0.75, 1.25)  # box size factor (mmpose RandomBBoxTransform-like)
POSE_SHIFT, POSE_SHIFT_PROB = 0.16, 0.3
POSE_ROTATION, POSE_ROTATION_PROB = 40.0, 0.6  # degrees
HALF_BODY_PROB, HALF_BODY_MIN_KEYPOINTS = 0.3, 8


def uniform(generator: torch.Generator, low: float, high: float) -> float:
    return low + (high - low) * torch.rand((), generator=generator).item()


def chance(generator: torch.Generator, p: float) -> bool:
    return torch.rand((), generator=generator).item() < p


def color_jitter(image: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """(3, H, W) float 0..255: random brightness, contrast and saturation."""
    j = COLOR_JITTER
    image = image * uniform(generator, 1 - j, 1 + j)
    mean = image.mean()
    image = (image - mean) * uniform(generator, 1 - j, 1 + j) + mean
    gray = (0.299 * image[0] + 0.587 * image[1] + 0.114 * image[2])[None]
    image = (image - gray) * uniform(generator, 1 - j, 1 + j) + gray
    return image.clamp(0, 255)


# ----------------------------------------------------------------------------------------------------
# Listing files
# ----------------------------------------------------------------------------------------------------
def split_folder(root: Path, split: str, required: bool = True) -> Path | None:
    folder = Path(root) / split
    if folder.is_dir():
        return folder
    if required:
        raise DataError(f"{folder}: no such folder (a dataset folder holds train/ and optionally val/)")
    return None


def list_images(folder: Path) -> dict[str, Path]:
    """images/ -> {NAME (path below images/ without suffix): file}."""
    images_dir = folder / "images"
    if not images_dir.is_dir():
        raise DataError(f"{images_dir}: no such folder (put the input images there)")
    found = {}
    for path in sorted(images_dir.rglob("*")):
        if path.suffix.lower() in IMAGE_SUFFIXES and path.is_file():
            name = path.relative_to(images_dir).with_suffix("").as_posix()
            if name in found:
                raise DataError(f"{path} and {found[name]}: two images named {name!r}; names must be unique")
            found[name] = path
    if not found:
        raise DataError(f"{images_dir}: no images ({', '.join(sorted(IMAGE_SUFFIXES))})")
    return found


def paired_files(folder: Path, kind: str, suffix: str, names, required: bool = True) -> dict[str, Path] | None:
    """{NAME: folder/kind/NAME+suffix}; every image needs one when `required` (else the folder is optional,
    but when present, complete)."""
    target_dir = folder / kind
    if not target_dir.is_dir():
        if required:
            raise DataError(f"{target_dir}: no such folder (one {kind}/NAME{suffix} per images/NAME.*)")
        return None
    files = {name: target_dir / f"{name}{suffix}" for name in names}
    missing = [str(path) for path in files.values() if not path.is_file()]
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise DataError(f"missing {kind} file {', '.join(missing[:3])}{more}: each images/NAME.* needs "
                        f"{kind}/NAME{suffix}")
    return files


def header_size(path: Path) -> tuple[int, ...]:
    """(H, W) of an image, or the shape of a .npy array, without reading the data."""
    try:
        if path.suffix == ".npy":
            return tuple(np.load(path, mmap_mode="r", allow_pickle=False).shape)
        with Image.open(path) as image:
            image = processing.ImageOps.exif_transpose(image) if path.parent.name == "images" else image
            return (image.height, image.width)
    except (OSError, ValueError) as error:
        raise DataError(f"{path}: cannot read it ({error})") from None


def read_png(path: Path, mode: str) -> np.ndarray:
    try:
        with Image.open(path) as image:
            return np.array(image.convert(mode) if image.mode != mode else image)
    except (OSError, ValueError) as error:
        raise DataError(f"{path}: cannot read it as a PNG ({error})") from None


def read_class_ids(path: Path) -> np.ndarray:
    try:
        with Image.open(path) as image:
            if image.mode not in ("L", "P"):
                raise DataError(f"{path}: a {image.mode} image; masks are single-channel uint8 PNGs of class ids "
                                f"(mode L or P), 255 = ignore")
            return np.array(image)
    except OSError as error:
        raise DataError(f"{path}: cannot read it as a PNG ({error})") from None


def read_npy(path: Path, image_size: tuple[int, int], what: str) -> np.ndarray:
    try:
        array = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as error:
        raise DataError(f"{path}: cannot read it as a .npy array ({error})") from None
    if array.shape != (*image_size, 3):
        raise DataError(f"{path}: shape {array.shape}, expected {(*image_size, 3)} ({what} for an image of "
                        f"{image_size[0]}x{image_size[1]})")
    return array.astype(np.float32)


def check_size(path: Path, array: np.ndarray, image_size: tuple[int, int], image_path: Path):
    if tuple(array.shape[:2]) != tuple(image_size):
        raise DataError(f"{path}: size {array.shape[0]}x{array.shape[1]}, but {image_path} is "
                        f"{image_size[0]}x{image_size[1]}")


# ----------------------------------------------------------------------------------------------------
# Geometry: one crop box (x0, y0, width, height) in source pixels with the network's aspect, resampled
# ----------------------------------------------------------------------------------------------------
STRETCHED = ("seg", "matting")  # predict.py resizes these to the network size as they are (no padding)


def whole_image_box(task: str, image_size, out_size) -> tuple[float, float, float, float]:
    """The box predict.py's preprocessing shows the network: the image itself (seg, matting: a plain resize),
    or the smallest box with the network's aspect that holds it, centred (normal, pointmap, albedo: resize
    and pad)."""
    if task in STRETCHED:
        return (0.0, 0.0, float(image_size[1]), float(image_size[0]))
    return letterbox_box(image_size, out_size)


def letterbox_box(image_size, out_size) -> tuple[float, float, float, float]:
    h, w = image_size
    aspect = out_size[1] / out_size[0]
    bw, bh = (w, w / aspect) if w / h > aspect else (h * aspect, h)
    return ((w - bw) / 2, (h - bh) / 2, bw, bh)


def random_box(task: str, image_size, out_size, generator) -> tuple[float, float, float, float]:
    """The whole-image box, scaled and shifted at random."""
    x0, y0, bw, bh = whole_image_box(task, image_size, out_size)
    scale = uniform(generator, *DENSE_SCALE)
    cx = x0 + bw / 2 + uniform(generator, -DENSE_SHIFT, DENSE_SHIFT) * bw * scale
    cy = y0 + bh / 2 + uniform(generator, -DENSE_SHIFT, DENSE_SHIFT) * bh * scale
    return (cx - bw * scale / 2, cy - bh * scale / 2, bw * scale, bh * scale)


def resample_box(maps: torch.Tensor, box, out_size, mode: str, fill: float = 0.0) -> torch.Tensor:
    """(C, H, W) float -> (C, *out_size): the box's content (pixel centres at +0.5, as a resize), `fill`
    outside the source. mode: "bilinear" (images) or "nearest" (labels, normals, points, as the original)."""
    shrink_y, shrink_x = min(1.0, out_size[0] / box[3]), min(1.0, out_size[1] / box[2])
    if mode == "bilinear" and min(shrink_x, shrink_y) < 1:  # an antialiased resize first, as predict.py's
        h, w = maps.shape[-2:]
        small = (max(1, round(h * shrink_y)), max(1, round(w * shrink_x)))
        maps = processing.resize(maps.float(), small, "bilinear_antialias")
        sy, sx = small[0] / h, small[1] / w
        box = (box[0] * sx, box[1] * sy, box[2] * sx, box[3] * sy)  # edge coordinates scale exactly
    _, h, w = maps.shape
    x0, y0, bw, bh = box
    xs = x0 + (torch.arange(out_size[1], dtype=torch.float64) + 0.5) * bw / out_size[1]
    ys = y0 + (torch.arange(out_size[0], dtype=torch.float64) + 0.5) * bh / out_size[0]
    gy, gx = torch.meshgrid(ys / h * 2 - 1, xs / w * 2 - 1, indexing="ij")
    grid = torch.stack([gx, gy], dim=-1).float()[None]
    inside = (gx.abs() <= 1) & (gy.abs() <= 1)
    out = F.grid_sample(maps[None].float(), grid, mode=mode, padding_mode="border", align_corners=False)[0]
    return torch.where(inside, out, torch.full_like(out, fill))


def box_intrinsics(K: torch.Tensor, box, out_size) -> torch.Tensor:
    """Camera matrix of the resampled box: u_out = (u + 0.5 - x0) * s - 0.5."""
    x0, y0, bw, bh = box
    sx, sy = out_size[1] / bw, out_size[0] / bh
    K = K.clone()
    K[0, 0], K[1, 1] = K[0, 0] * sx, K[1, 1] * sy
    K[0, 2], K[1, 2] = (K[0, 2] + 0.5 - x0) * sx - 0.5, (K[1, 2] + 0.5 - y0) * sy - 0.5
    return K


def fit_intrinsics(points: np.ndarray, valid: np.ndarray, path: Path) -> torch.Tensor:
    """A pinhole K fitted to a pointmap (least squares of u = fx X/Z + cx, v = fy Y/Z + cy), when
    intrinsics.json does not give it."""
    v, u = np.nonzero(valid & (points[..., 2] > 1e-6))
    if len(u) < 3:
        raise DataError(f"{path}: fewer than 3 valid points with Z > 0; cannot fit the intrinsics "
                        f"(give them in intrinsics.json)")
    z = points[v, u, 2]
    fx, cx = np.linalg.lstsq(np.stack([points[v, u, 0] / z, np.ones_like(z)], 1), u, rcond=None)[0]
    fy, cy = np.linalg.lstsq(np.stack([points[v, u, 1] / z, np.ones_like(z)], 1), v, rcond=None)[0]
    return torch.tensor([[fx, 0, cx], [0, fy, cy], [0, 0, 1]], dtype=torch.float32)


# ----------------------------------------------------------------------------------------------------
# Dense tasks
# ----------------------------------------------------------------------------------------------------
class DenseDataset:
    """seg, normal, pointmap, matting, albedo: one sample per image."""

    def __init__(self, task: str, folder: Path, size: tuple[int, int], augment: bool, class_names=None):
        self.task, self.folder, self.size, self.augment = task, Path(folder), tuple(size), augment
        self.images = list_images(self.folder)
        self.names = list(self.images)
        self.targets = paired_files(self.folder, TARGET_FOLDERS[task], TARGET_SUFFIX[task], self.names)
        self.masks = None
        if task in ("normal", "pointmap"):
            self.masks = paired_files(self.folder, "masks", ".png", self.names, required=False)
        self.num_classes = len(class_names) if class_names else None
        if class_names:  # a flip swaps left and right classes (L_Hand <-> R_Hand), as the original
            self.class_flip = torch.arange(256)
            self.class_flip[:len(class_names)] = flip_order(len(class_names), flip_pairs_from_names(class_names))
        self.intrinsics = read_intrinsics(self.folder, self.names) if task == "pointmap" else None
        self.check_sizes()

    def check_sizes(self):
        """Every target (and mask) has its image's size: read from the file headers, so a mismatch is found
        before training starts and not at step 5000 (class ids and values are checked when read)."""
        for name, image_path in self.images.items():
            size = header_size(image_path)
            for path in (self.targets[name], self.masks[name] if self.masks else None):
                if path is None:
                    continue
                found = header_size(path)
                if path.suffix == ".npy" and found != (*size, 3):
                    raise DataError(f"{path}: shape {found}, expected {(*size, 3)} ((H, W, 3) for {image_path}, "
                                    f"{size[0]}x{size[1]})")
                if path.suffix != ".npy" and found != size:
                    raise DataError(f"{path}: size {found[0]}x{found[1]}, but {image_path} is {size[0]}x{size[1]}")

    def __len__(self) -> int:
        return len(self.names)

    def __getitem__(self, key) -> dict:
        index, seed = key
        name = self.names[index]
        generator = torch.Generator().manual_seed(int(seed))
        image = processing.load_image(self.images[name]).float()
        image_size = tuple(image.shape[-2:])
        target, mask, K = self.read_target(name, image_size)
        box = whole_image_box(self.task, image_size, self.size)
        flip = False
        if self.augment:
            box = random_box(self.task, image_size, self.size, generator)
            flip = chance(generator, 0.5)
            image = color_jitter(image, generator)
        sample = {"pixel_values": processing.normalize(resample_box(image, box, self.size, "bilinear"))}
        label_mode = "bilinear" if self.task in ("matting", "albedo") else "nearest"
        fill = float(IGNORE) if self.task == "seg" else 0.0
        target = resample_box(target, box, self.size, label_mode, fill)
        if mask is not None:
            mask = resample_box(mask, box, self.size, "nearest")
        if flip:
            sample["pixel_values"] = sample["pixel_values"].flip(-1)
            target = target.flip(-1)
            mask = mask.flip(-1) if mask is not None else None
            if self.task in ("normal", "pointmap"):
                target[0] = -target[0]  # mirrored camera frame: x points the other way
            if self.task == "seg":
                target = self.class_flip[target.long()].float()
        self.finish(sample, target, mask, K, box, flip)
        sample["flipped"] = torch.tensor(flip)
        return sample

    def read_target(self, name: str, image_size):
        """(target (C, H, W) float, valid mask (1, H, W) or None, intrinsics or None) at the image's size."""
        path = self.targets[name]
        if self.task == "seg":
            labels = read_class_ids(path)
            check_size(path, labels, image_size, self.images[name])
            bad = (labels >= self.num_classes) & (labels != IGNORE)
            if bad.any():
                raise DataError(f"{path}: class id {int(labels[bad].max())} but classes.json lists "
                                f"{self.num_classes} classes (ids 0..{self.num_classes - 1}, 255 = ignore)")
            return torch.from_numpy(labels.astype(np.float32))[None], None, None
        if self.task in ("matting", "albedo"):
            mode = "L" if self.task == "matting" else "RGBA"
            array = read_png(path, mode).astype(np.float32) / 255
            check_size(path, array, image_size, self.images[name])
            if self.task == "matting":
                return torch.from_numpy(array)[None], None, None
            array = torch.from_numpy(array).permute(2, 0, 1)
            return array[:3], (array[3:] > 0).float(), None
        what = "unit normals" if self.task == "normal" else "metric XYZ"
        array = read_npy(path, image_size, what)
        valid = np.isfinite(array).all(-1)
        if self.masks is not None:
            mask_png = read_png(self.masks[name], "L")
            check_size(self.masks[name], mask_png, image_size, self.images[name])
            valid &= mask_png > 0
        K = None
        if self.task == "pointmap":
            K = self.intrinsics.get(name) if self.intrinsics else None
            K = fit_intrinsics(array, valid, path) if K is None else K
        array = np.where(valid[..., None], array, 0.0)
        if self.task == "normal":
            array = array / (np.linalg.norm(array, axis=-1, keepdims=True) + 1e-6)
        return (torch.from_numpy(array.astype(np.float32)).permute(2, 0, 1),
                torch.from_numpy(valid.astype(np.float32))[None], K)

    def finish(self, sample, target, mask, K, box, flip):
        """The task's loss arguments from the resampled target."""
        if self.task == "seg":
            sample["labels"] = target[0].round().long()
        elif self.task == "matting":
            sample["labels"] = target
        elif self.task in ("normal", "albedo"):
            sample["labels"], sample["mask"] = target, (mask if mask is not None else torch.ones_like(target[:1]))
        else:  # pointmap: canonical camera (focal 768 in network pixels), spec losses.md 4
            K = box_intrinsics(K, box, self.size)
            if flip:
                K[0, 2] = self.size[1] - 1 - K[0, 2]
            scale = CANONICAL_FOCAL / K[0, 0]
            sample["labels"], sample["mask"] = target * scale * mask, mask
            sample["scales"], sample["intrinsics"] = scale.view(1), K


def read_intrinsics(folder: Path, names) -> dict[str, torch.Tensor] | None:
    path = folder / "intrinsics.json"
    if not path.exists():
        return None
    try:
        table = json.loads(path.read_text())
        return {name: torch.tensor([[float(v["fx"]), 0, float(v["cx"])], [0, float(v["fy"]), float(v["cy"])],
                                    [0, 0, 1]]) for name, v in table.items()}
    except (ValueError, KeyError, TypeError) as error:
        raise DataError(f"{path}: expected {{NAME: {{fx, fy, cx, cy}}}} ({error!r})") from None


def read_classes(root: Path) -> list[str]:
    """classes.json: a list of class names, in the dataset folder (or in train/)."""
    for path in (Path(root) / "classes.json", Path(root) / "train" / "classes.json"):
        if path.exists():
            try:
                names = json.loads(path.read_text())
            except ValueError as error:
                raise DataError(f"{path}: not valid JSON ({error})") from None
            if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
                raise DataError(f"{path}: expected a list of class names, e.g. [\"background\", \"person\"]")
            if len(names) > IGNORE:
                raise DataError(f"{path}: {len(names)} classes; at most 255 fit in uint8 masks (255 = ignore)")
            return names
    raise DataError(f"{Path(root) / 'classes.json'}: no such file (a JSON list of the class names)")


# ----------------------------------------------------------------------------------------------------
# Pose: COCO keypoints, top-down crops, UDP heatmaps
# ----------------------------------------------------------------------------------------------------
def flip_pairs_from_names(names: list[str]) -> list[list[int]]:
    """Left/right pairs from `left_*`/`right_*` (or `l_*`/`r_*`) names, any case (keypoints and classes)."""
    index = {n.lower(): i for i, n in enumerate(names)}
    pairs = []
    for name, i in index.items():
        for left, right in (("left_", "right_"), ("l_", "r_")):
            if name.startswith(left) and right + name[len(left):] in index:
                pairs.append([i, index[right + name[len(left):]]])
    return sorted(pairs)


class PoseDataset:
    """One sample per annotated person (with at least one visible keypoint)."""

    def __init__(self, folder: Path, size: tuple[int, int], augment: bool, heatmap_downscale: int = 4):
        self.folder, self.size, self.augment = Path(folder), tuple(size), augment
        self.heatmap_size = (size[0] // heatmap_downscale, size[1] // heatmap_downscale)
        path = self.folder / "annotations.json"
        if not path.is_file():
            raise DataError(f"{path}: no such file (COCO keypoints annotations for images/)")
        try:
            coco = json.loads(path.read_text())
        except ValueError as error:
            raise DataError(f"{path}: not valid JSON ({error})") from None
        self.meta = keypoint_set(coco, path)
        self.people = self.read_people(coco, path)
        if not self.people:
            raise DataError(f"{path}: no annotation with a visible keypoint")

    def read_people(self, coco: dict, path: Path) -> list[dict]:
        K = len(self.meta["keypoint_names"])
        files = {}
        for image in coco.get("images", []):
            file = self.folder / "images" / image["file_name"]
            if not file.is_file():
                raise DataError(f"{file}: no such file (listed in {path}, image id {image['id']})")
            files[image["id"]] = file
        people = []
        for ann in coco.get("annotations", []):
            if ann.get("iscrowd"):
                continue
            where = f"{path}: annotation id {ann.get('id')}"
            if ann.get("image_id") not in files:
                raise DataError(f"{where}: image_id {ann.get('image_id')} is not in 'images'")
            keypoints = np.asarray(ann.get("keypoints", []), dtype=np.float32)
            if keypoints.size != 3 * K:
                raise DataError(f"{where}: {keypoints.size // 3} keypoints ({keypoints.size} values), but "
                                f"categories[0] lists {K} keypoint names ({3 * K} values expected)")
            bbox = ann.get("bbox")
            if bbox is None or len(bbox) != 4 or bbox[2] <= 0 or bbox[3] <= 0:
                raise DataError(f"{where}: bbox must be [x, y, width, height] with width, height > 0, got {bbox}")
            keypoints = keypoints.reshape(K, 3)
            if (keypoints[:, 2] > 0).any():
                area = float(ann.get("area") or bbox[2] * bbox[3])
                people.append({"file": files[ann["image_id"]], "bbox": [float(v) for v in bbox],
                               "keypoints": torch.from_numpy(keypoints), "area": area})
        return people

    def __len__(self) -> int:
        return len(self.people)

    def __getitem__(self, key) -> dict:
        index, seed = key
        person = self.people[index]
        generator = torch.Generator().manual_seed(int(seed))
        image = processing.load_image(person["file"]).float()
        keypoints = person["keypoints"].clone()  # (K, 3) image pixels + visibility
        center, crop, angle, flip = self.crop_parameters(torch.tensor(person["bbox"]), keypoints, generator)
        if self.augment:
            image = color_jitter(image, generator)
        to_source = crop_affine(center, crop, angle, self.size)  # (3, 3): network pixel -> source pixel
        pixels = warp(image, to_source, self.size, upscale=bool((crop <= torch.tensor(self.size[::-1]) - 1).all()))
        points = apply_affine(invert_affine(to_source), keypoints[:, :2])  # network pixels
        visible = keypoints[:, 2] > 0
        truth = person["keypoints"]
        if flip:  # mirror the crop; left and right keypoints swap names
            order = flip_order(len(points), self.meta["flip_pairs"])
            pixels = pixels.flip(-1)
            points[:, 0] = self.size[1] - 1 - points[:, 0]
            points, visible, truth = points[order], visible[order], truth[order]
            to_source = to_source @ torch.tensor([[-1.0, 0, self.size[1] - 1], [0, 1, 0], [0, 0, 1]])
        heatmaps, weights = udp_heatmaps(points, visible, self.size, self.heatmap_size, heatmap_sigma(self.heatmap_size))
        return {"pixel_values": processing.normalize(pixels), "labels": heatmaps, "label_weights": weights,
                "keypoints": truth, "to_source": to_source, "bbox": torch.tensor(person["bbox"]),
                "area": torch.tensor(person["area"]), "flipped": torch.tensor(flip)}

    def crop_parameters(self, box, keypoints, generator):
        """(centre, crop size (w, h), rotation in degrees, flip) of the person's crop; augmented when training."""
        if not self.augment:
            center, crop = processing.crop_geometry(box[None], self.size)
            return center[0], crop[0], 0.0, False
        center, crop = processing.crop_geometry(self.half_body(box, keypoints, generator)[None], self.size)
        center, crop = center[0], crop[0]
        if chance(generator, POSE_SHIFT_PROB):
            center = center + crop * torch.tensor([uniform(generator, -1, 1), uniform(generator, -1, 1)]) * POSE_SHIFT
        crop = crop * uniform(generator, *POSE_SCALE)
        angle = uniform(generator, -POSE_ROTATION, POSE_ROTATION) if chance(generator, POSE_ROTATION_PROB) else 0.0
        return center, crop, angle, chance(generator, 0.5)

    def half_body(self, box, keypoints, generator):
        """The original's half-body augmentation, for any keypoint set: with probability 0.3 and enough
        visible keypoints, the box of the upper or lower half of them (by height), enlarged 1.5x."""
        visible = keypoints[keypoints[:, 2] > 0, :2]
        if len(visible) < HALF_BODY_MIN_KEYPOINTS or not chance(generator, HALF_BODY_PROB):
            return box
        order = visible[:, 1].argsort()
        half = order[: len(order) // 2] if chance(generator, 0.5) else order[len(order) // 2:]
        low, high = visible[half].amin(0), visible[half].amax(0)
        size = (high - low).clamp(min=1) * 1.5
        center = (low + high) / 2
        return torch.cat([center - size / 2, size])


def keypoint_set(coco: dict, path: Path) -> dict:
    """Names, flip pairs, skeleton and (optional) OKS sigmas of categories[0]."""
    categories = coco.get("categories") or []
    if not categories or not categories[0].get("keypoints"):
        raise DataError(f"{path}: categories[0].keypoints (the keypoint names) is missing")
    category = categories[0]
    names = [str(n) for n in category["keypoints"]]
    pairs = category.get("flip_pairs")
    pairs = flip_pairs_from_names(names) if pairs is None else [[int(a), int(b)] for a, b in pairs]
    if any(not (0 <= i < len(names)) for pair in pairs for i in pair):
        raise DataError(f"{path}: flip_pairs index a keypoint outside 0..{len(names) - 1}")
    sigmas = category.get("sigmas")
    if sigmas is not None and len(sigmas) != len(names):
        raise DataError(f"{path}: {len(sigmas)} sigmas for {len(names)} keypoints")
    return {"keypoint_names": names, "flip_pairs": pairs, "skeleton": category.get("skeleton", []),
            "sigmas": sigmas}


def flip_order(count: int, pairs) -> torch.Tensor:
    order = torch.arange(count)
    for a, b in pairs:
        order[a], order[b] = b, a
    return order


def crop_affine(center, crop, angle_degrees: float, size) -> torch.Tensor:
    """(3, 3) network pixel -> source pixel: the UDP crop of processing.crop_people, rotated about the
    centre: p = c + R^T S^-1 (o - (size - 1) / 2), S = (size - 1) / crop."""
    theta = math.radians(angle_degrees)
    rotation_t = torch.tensor([[math.cos(theta), math.sin(theta)], [-math.sin(theta), math.cos(theta)]])
    scale = torch.tensor([(size[1] - 1) / crop[0], (size[0] - 1) / crop[1]])
    linear = rotation_t @ torch.diag(1 / scale)
    offset = center - linear @ torch.tensor([(size[1] - 1) / 2, (size[0] - 1) / 2])
    return torch.cat([torch.cat([linear, offset[:, None]], 1), torch.tensor([[0.0, 0.0, 1.0]])])


def invert_affine(matrix: torch.Tensor) -> torch.Tensor:
    return torch.linalg.inv(matrix.double()).float()


def apply_affine(matrix: torch.Tensor, points: torch.Tensor) -> torch.Tensor:
    return points @ matrix[:2, :2].T + matrix[:2, 2]


def warp(image: torch.Tensor, to_source: torch.Tensor, size, upscale: bool) -> torch.Tensor:
    """(3, H, W) float -> (3, *size): grid_sample(align_corners=True) as processing.crop_people (bicubic when
    the crop is enlarged, else bilinear; zeros outside)."""
    h, w = image.shape[-2:]
    gy, gx = torch.meshgrid(torch.arange(size[0], dtype=torch.float32), torch.arange(size[1], dtype=torch.float32),
                            indexing="ij")
    source = apply_affine(to_source, torch.stack([gx, gy], -1).reshape(-1, 2)).reshape(*size, 2)
    grid = torch.stack([2 * source[..., 0] / (w - 1) - 1, 2 * source[..., 1] / (h - 1) - 1], -1)[None]
    mode = "bicubic" if upscale else "bilinear"
    return F.grid_sample(image[None], grid, mode=mode, padding_mode="zeros", align_corners=True)[0]


def heatmap_sigma(heatmap_size) -> float:
    """The original's sigma (6 heatmap pixels at 256x192) scaled with the heatmap width, at least 1."""
    return max(1.0, processing.HEATMAP_SIGMA * heatmap_size[1] / 192)


def udp_heatmaps(points, visible, size, heatmap_size, sigma: float = processing.HEATMAP_SIGMA):
    """Keypoints in network pixels -> UDP Gaussian heatmaps (K, h, w) and weights (K,), the same rule as
    processing.pose_heatmap_targets (3-sigma window, weight 0 when invisible, outside the network input or
    the window misses the map)."""
    height, width = heatmap_size
    extent = torch.tensor([(width - 1) / (size[1] - 1), (height - 1) / (size[0] - 1)])
    mu = points * extent
    grid_y = torch.arange(height, dtype=torch.float32).view(1, -1, 1)
    grid_x = torch.arange(width, dtype=torch.float32).view(1, 1, -1)
    mu_x, mu_y = mu[:, 0, None, None], mu[:, 1, None, None]
    heatmaps = torch.exp(-((grid_x - mu_x) ** 2 + (grid_y - mu_y) ** 2) / (2 * sigma**2))
    radius = int(sigma * 3)
    center = (mu + 0.5).to(torch.int64)
    left, top = center[:, 0] - radius, center[:, 1] - radius
    right, bottom = center[:, 0] + radius + 1, center[:, 1] + radius + 1
    touches = ~((left >= width) | (top >= height) | (right < 0) | (bottom < 0))
    inside = (points[:, 0] >= 0) & (points[:, 0] < size[1]) & (points[:, 1] >= 0) & (points[:, 1] < size[0])
    weights = (visible & touches & inside).float()
    window = ((grid_x >= left[:, None, None]) & (grid_x < right[:, None, None])
              & (grid_y >= top[:, None, None]) & (grid_y < bottom[:, None, None]))
    return heatmaps * weights[:, None, None] * window, weights


# ----------------------------------------------------------------------------------------------------
# Building a task's dataset
# ----------------------------------------------------------------------------------------------------
def dataset_info(task: str, root: Path) -> dict:
    """What the head needs from the data: its output count, and the metadata saved with the model."""
    root = Path(root)
    if not root.is_dir():
        raise DataError(f"{root}: no such folder (--data takes a dataset folder with train/ and optional val/)")
    if task == "pose":
        train = split_folder(root, "train")
        path = train / "annotations.json"
        if not path.is_file():
            raise DataError(f"{path}: no such file (COCO keypoints annotations for images/)")
        try:
            meta = keypoint_set(json.loads(path.read_text()), path)
        except ValueError as error:
            raise DataError(f"{path}: not valid JSON ({error})") from None
        return {"out_channels": len(meta["keypoint_names"]), **meta}
    if task == "seg":
        names = read_classes(root)
        return {"out_channels": len(names), "class_names": names}
    return {"out_channels": {"normal": 3, "pointmap": 3, "albedo": 3, "matting": 4}[task]}


def build_dataset(task: str, root: Path, split: str, size, augment: bool, info: dict):
    folder = split_folder(root, split, required=split == "train")
    if folder is None:
        return None
    if task == "pose":
        dataset = PoseDataset(folder, size, augment)
        if dataset.meta["keypoint_names"] != info["keypoint_names"]:
            raise DataError(f"{folder / 'annotations.json'}: its keypoint names differ from train/'s")
        return dataset
    return DenseDataset(task, folder, size, augment, class_names=info.get("class_names"))


def collate(samples: list[dict]) -> dict:
    return {key: torch.stack([s[key] for s in samples]) for key in samples[0]}


# ----------------------------------------------------------------------------------------------------
# Metrics: each task's sums over a validation set (summable across processes), then the numbers
# ----------------------------------------------------------------------------------------------------
ANGLE_BINS = 1800  # 0.1 degree bins for the median angular error


class Metric:
    """Accumulates per-batch sums in one float64 vector (so processes add theirs with one all_reduce)."""

    def __init__(self, task: str, info: dict):
        self.task, self.info = task, info
        size = {"pose": 5, "seg": info["out_channels"] ** 2, "normal": 5 + ANGLE_BINS, "pointmap": 3,
                "matting": 4, "albedo": 2}[task]
        self.sums = torch.zeros(size, dtype=torch.float64)

    def update(self, output, batch: dict, valid: torch.Tensor):
        """valid: (B,) which rows count (padding rows of an uneven last batch do not)."""
        getattr(self, f"update_{self.task}")(output, batch, valid.bool())

    def update_pose(self, output, batch, valid):
        heatmaps = output.heatmaps.float()
        locations, _ = processing.decode_heatmaps(heatmaps)
        size = batch["pixel_values"].shape[-2:]
        scale = torch.tensor([(size[1] - 1) / (heatmaps.shape[-1] - 1), (size[0] - 1) / (heatmaps.shape[-2] - 1)])
        predicted = torch.stack([apply_affine(m, p * scale) for m, p in zip(batch["to_source"], locations.cpu())])
        truth, box = batch["keypoints"], batch["bbox"]
        visible = (truth[..., 2] > 0) & valid[:, None]
        distance = ((predicted - truth[..., :2]) / box[:, None, 2:]).norm(dim=-1)  # per axis by box w, h (mmpose)
        self.sums[0] += ((distance < 0.05) & visible).sum()
        self.sums[1] += visible.sum()
        sigmas = self.info.get("sigmas")
        if sigmas is not None:
            squared = ((predicted - truth[..., :2]) ** 2).sum(-1)
            variance = (2 * torch.tensor(sigmas)) ** 2
            oks_terms = torch.exp(-squared / (2 * batch["area"][:, None] * variance + 1e-12))
            oks = (oks_terms * visible).sum(-1) / visible.sum(-1).clamp(min=1)
            thresholds = torch.arange(0.5, 0.951, 0.05)
            has = valid & (visible.sum(-1) > 0)
            self.sums[2] += ((oks[has, None] >= thresholds).double().mean(-1)).sum()
            self.sums[3] += has.sum()

    def update_seg(self, output, batch, valid):
        classes = self.info["out_channels"]
        predicted = output.logits.argmax(1).cpu()
        labels = batch["labels"]
        keep = (labels != IGNORE) & valid[:, None, None]
        pairs = labels[keep] * classes + predicted[keep]
        self.sums += torch.bincount(pairs, minlength=classes * classes).double()

    def update_normal(self, output, batch, valid):
        cosine = F.cosine_similarity(output.normals.float().cpu(), batch["labels"], dim=1, eps=1e-6)
        angle = torch.rad2deg(torch.acos(cosine.clamp(-1, 1)))
        keep = (batch["mask"][:, 0] > 0) & valid[:, None, None]
        angle = angle[keep].double()
        self.sums[0] += angle.sum()
        self.sums[1] += angle.numel()
        for i, limit in enumerate((11.25, 22.5, 30.0)):
            self.sums[2 + i] += (angle < limit).sum()
        self.sums[5:] += torch.histc(angle, ANGLE_BINS, 0, 180)

    def update_pointmap(self, output, batch, valid):
        depth = (output.pointmaps[:, 2].float().cpu() / output.scales.float().cpu().view(-1, 1, 1))
        truth = batch["labels"][:, 2] / batch["scales"].view(-1, 1, 1)
        keep = (batch["mask"][:, 0] > 0) & (truth > 0) & valid[:, None, None]
        depth, truth = depth[keep].double(), truth[keep].double()
        self.sums[0] += ((depth - truth).abs() / truth).sum()
        ratio = torch.maximum(depth / truth, truth / depth.clamp(min=1e-9))
        self.sums[1] += (ratio < 1.25).sum()
        self.sums[2] += keep.sum()

    def update_matting(self, output, batch, valid):
        error = (output.alphas.float().cpu() - batch["labels"])[valid].double()
        self.sums[0] += error.abs().sum() / 1000  # SAD is reported in thousands, per image
        self.sums[1] += error.square().sum()
        self.sums[2] += error.numel()
        self.sums[3] += valid.sum()

    def update_albedo(self, output, batch, valid):
        error = (output.albedo.float().cpu().clamp(0, 1) - batch["labels"]) ** 2 * batch["mask"]
        for i in range(len(valid)):
            if valid[i] and batch["mask"][i].sum() > 0:
                mse = error[i].sum() / (3 * batch["mask"][i].sum())
                self.sums[0] += 10 * torch.log10(1 / mse.double().clamp(min=1e-10))
                self.sums[1] += 1

    def result(self) -> dict:
        s = self.sums
        if self.task == "pose":
            out = {"pck@0.05": (s[0] / s[1].clamp(min=1)).item()}
            if self.info.get("sigmas") is not None:
                out["oks_ap"] = (s[2] / s[3].clamp(min=1)).item()
            return out
        if self.task == "seg":
            confusion = s.view(self.info["out_channels"], -1)
            union = confusion.sum(0) + confusion.sum(1) - confusion.diag()
            present = union > 0
            iou = confusion.diag()[present] / union[present]
            return {"miou": iou.mean().item() if present.any() else 0.0,
                    "pixel_accuracy": (confusion.diag().sum() / confusion.sum().clamp(min=1)).item()}
        if self.task == "normal":
            n = s[1].clamp(min=1)
            cumulative = s[5:].cumsum(0)
            median_bin = int((cumulative < s[1] / 2).sum())
            return {"mean_angle": (s[0] / n).item(), "median_angle": (median_bin + 0.5) * 180 / ANGLE_BINS,
                    "within_11.25": (s[2] / n).item(), "within_22.5": (s[3] / n).item(), "within_30": (s[4] / n).item()}
        if self.task == "pointmap":
            n = s[2].clamp(min=1)
            return {"abs_rel": (s[0] / n).item(), "delta1.25": (s[1] / n).item()}
        if self.task == "matting":
            return {"sad": (s[0] / s[3].clamp(min=1)).item(), "mse": (s[1] / s[2].clamp(min=1)).item()}
        return {"psnr": (s[0] / s[1].clamp(min=1)).item()}


# Which metric says "better" for the log summary (and the tests): name -> +1 higher is better, -1 lower.
MAIN_METRIC = {"pose": ("pck@0.05", 1), "seg": ("miou", 1), "normal": ("mean_angle", -1),
               "pointmap": ("abs_rel", -1), "matting": ("mse", -1), "albedo": ("psnr", 1)}
