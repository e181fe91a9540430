"""Fine-tuning data for train.py: the six tasks' datasets, their samples and what the head needs from them.

One dataset folder per task, with `train/` and an optional `val/` (formats in docs/training.md):
  pose      annotations.json (COCO keypoints) + images/
  seg       images/NAME.* + masks/NAME.png (uint8 class ids, 255 = ignore) + classes.json (class names)
  normal    images/ + normals/NAME.npy (H, W, 3 unit vectors) + optional masks/NAME.png (nonzero = valid)
  pointmap  images/ + pointmaps/NAME.npy (H, W, 3 metric XYZ) + optional masks/ + optional intrinsics.json
  matting   images/ + alphas/NAME.png (alpha; or RGBA: the foreground's colours + alpha)
  albedo    images/ + albedo/NAME.png (RGB; an alpha channel, if any, is the valid mask)

A sample is fetched as dataset[(index, seed)]: every random choice of its augmentation comes from a generator
seeded with `seed`, so a sample is the same whichever process or worker loads it (what makes 1 and N processes,
and a resumed run, see the same batches).

Every sample is a dict of tensors at the network input size: `pixel_values` and the task model's loss
arguments (see LOSS_KEYS), plus what the metrics need. The files are read by dataset_files.py, the crops and
warps are augmentation.py's, the targets targets.py's.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image

import processing
from heads import CANONICAL_FOCAL
from losses import matting_foreground_target
from sapiens2_app.augmentation import (HALF_BODY_MIN_KEYPOINTS, HALF_BODY_PROB, POSE_ROTATION, POSE_ROTATION_PROB,
                                       POSE_SCALE, POSE_SHIFT, POSE_SHIFT_PROB, apply_affine, box_intrinsics, chance,
                                       color_jitter, crop_affine, invert_affine, random_box, resample_box, uniform,
                                       warp, whole_image_box)
from sapiens2_app.cli import UsageError
from sapiens2_app.dataset_files import (IGNORE, TARGET_FOLDERS, TARGET_SUFFIX, check_size, fit_intrinsics,
                                        flip_order, flip_pairs_from_names, header_size, keypoint_set, list_images,
                                        paired_files, read_annotations, read_class_ids, read_classes,
                                        read_intrinsics, read_npy, read_png, split_folder)
from sapiens2_app.targets import heatmap_sigma, udp_heatmaps

# The task models' forward() arguments that a sample provides (besides pixel_values).
LOSS_KEYS = {
    "pose": ("labels", "label_weights"),
    "seg": ("labels",),
    "normal": ("labels", "mask"),
    "pointmap": ("labels", "mask", "scales", "intrinsics"),
    "albedo": ("labels", "mask"),
    "matting": ("labels", "foregrounds", "mask"),
}


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
                    raise UsageError(f"{path}: shape {found}, expected {(*size, 3)} ((H, W, 3) for {image_path}, "
                                     f"{size[0]}x{size[1]})")
                if path.suffix != ".npy" and found != size:
                    raise UsageError(f"{path}: size {found[0]}x{found[1]}, but {image_path} is {size[0]}x{size[1]}")

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
                raise UsageError(f"{path}: class id {int(labels[bad].max())} but classes.json lists "
                                 f"{self.num_classes} classes (ids 0..{self.num_classes - 1}, 255 = ignore)")
            return torch.from_numpy(labels.astype(np.float32))[None], None, None
        if self.task == "matting":
            return matting_target(path, image_size, self.images[name]), None, None
        if self.task == "albedo":
            array = read_png(path, "RGBA").astype(np.float32) / 255
            check_size(path, array, image_size, self.images[name])
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
        elif self.task == "matting":  # target: alpha, or the premultiplied foreground + alpha
            alpha = target[-1:]
            image = unnormalized(sample["pixel_values"]) / 255  # (3, H, W) RGB in [0, 1], as augmented
            foreground, mask, known = matting_foreground_target(alpha, image, target[:3] if len(target) == 4 else None)
            sample.update(labels=alpha, foregrounds=foreground, mask=mask, has_foreground=torch.tensor(known))
        elif self.task in ("normal", "albedo"):
            sample["labels"], sample["mask"] = target, (mask if mask is not None else torch.ones_like(target[:1]))
        else:  # pointmap: canonical camera (focal 768 in network pixels), docs/losses.md 4
            K = box_intrinsics(K, box, self.size)
            if flip:
                K[0, 2] = self.size[1] - 1 - K[0, 2]
            scale = CANONICAL_FOCAL / K[0, 0]
            sample["labels"], sample["mask"] = target * scale * mask, mask
            sample["scales"], sample["intrinsics"] = scale.view(1), K


def unnormalized(pixel_values: torch.Tensor) -> torch.Tensor:
    """processing.normalize undone: (3, H, W) on the 0..255 scale (to ~1e-5)."""
    mean, std = (torch.tensor(v).view(3, 1, 1) * 255 for v in (processing.IMAGENET_MEAN, processing.IMAGENET_STD))
    return pixel_values * std + mean


def matting_target(path: Path, image_size, image_path) -> torch.Tensor:
    """alphas/NAME.png as (1, H, W) alpha in [0, 1]; an RGBA one as (4, H, W): the foreground premultiplied by
    alpha and rounded down to 8 bits, as the upstream's MattingBaseDataset stores it, then alpha."""
    try:
        with Image.open(path) as image:
            rgba = image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info
    except (OSError, ValueError) as error:
        raise UsageError(f"{path}: cannot read it as a PNG ({error})") from None
    if not rgba:
        alpha = read_png(path, "L").astype(np.float32) / 255
        check_size(path, alpha, image_size, image_path)
        return torch.from_numpy(alpha)[None]
    array = read_png(path, "RGBA")
    check_size(path, array, image_size, image_path)
    alpha = array[..., 3].astype(np.float32) / 255
    foreground = np.floor(array[..., :3].astype(np.float32) * alpha[..., None]) / 255  # the upstream's uint8 cast
    return torch.from_numpy(np.concatenate([foreground, alpha[..., None]], -1)).permute(2, 0, 1)


# ----------------------------------------------------------------------------------------------------
# Pose: one sample per person, a top-down crop with UDP heatmap targets
# ----------------------------------------------------------------------------------------------------
class PoseDataset:
    """One sample per annotated person (with at least one visible keypoint)."""

    def __init__(self, folder: Path, size: tuple[int, int], augment: bool, heatmap_downscale: int = 4):
        self.folder, self.size, self.augment = Path(folder), tuple(size), augment
        self.heatmap_size = (size[0] // heatmap_downscale, size[1] // heatmap_downscale)
        coco, path = read_annotations(self.folder)
        self.meta = keypoint_set(coco, path)
        self.people = self.read_people(coco, path)
        if not self.people:
            raise UsageError(f"{path}: no annotation with a visible keypoint")

    def read_people(self, coco: dict, path: Path) -> list[dict]:
        K = len(self.meta["keypoint_names"])
        files = {}
        for image in coco.get("images", []):
            file = self.folder / "images" / image["file_name"]
            if not file.is_file():
                raise UsageError(f"{file}: no such file (listed in {path}, image id {image['id']})")
            files[image["id"]] = file
        people = []
        for ann in coco.get("annotations", []):
            if ann.get("iscrowd"):
                continue
            where = f"{path}: annotation id {ann.get('id')}"
            if ann.get("image_id") not in files:
                raise UsageError(f"{where}: image_id {ann.get('image_id')} is not in 'images'")
            keypoints = np.asarray(ann.get("keypoints", []), dtype=np.float32)
            if keypoints.size != 3 * K:
                raise UsageError(f"{where}: {keypoints.size // 3} keypoints ({keypoints.size} values), but "
                                 f"categories[0] lists {K} keypoint names ({3 * K} values expected)")
            bbox = ann.get("bbox")
            if bbox is None or len(bbox) != 4 or bbox[2] <= 0 or bbox[3] <= 0:
                raise UsageError(f"{where}: bbox must be [x, y, width, height] with width, height > 0, got {bbox}")
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


# ----------------------------------------------------------------------------------------------------
# Building a task's dataset
# ----------------------------------------------------------------------------------------------------
def dataset_info(task: str, root: Path) -> dict:
    """What the head needs from the data: its output count, and the metadata saved with the model."""
    root = Path(root)
    if not root.is_dir():
        raise UsageError(f"{root}: no such folder (--data takes a dataset folder with train/ and optional val/)")
    if task == "pose":
        meta = keypoint_set(*read_annotations(split_folder(root, "train")))
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
            raise UsageError(f"{folder / 'annotations.json'}: its keypoint names differ from train/'s")
        return dataset
    return DenseDataset(task, folder, size, augment, class_names=info.get("class_names"))


def collate(samples: list[dict]) -> dict:
    return {key: torch.stack([s[key] for s in samples]) for key in samples[0]}

