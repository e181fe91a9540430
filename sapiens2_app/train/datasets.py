"""Fine-tuning data for train.py: the six tasks' datasets, their samples and what the head needs from them; here
the dense tasks' dataset and the building of any task's, pose's dataset in pose_dataset.py.

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
warps are dense_augmentation.py's (pose: pose_augmentation.py's), the targets targets.py's.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image

from sapiens2 import processing
from sapiens2.heads import CANONICAL_FOCAL
from sapiens2.losses import matting_foreground_target
from sapiens2_app.common.cli import UsageError
from sapiens2_app.train.dataset_files import (IGNORE, IMAGE_SUFFIXES, TARGET_FOLDERS, TARGET_SUFFIX, check_size,
                                        fit_intrinsics, flip_order, flip_pairs_from_names, header_size, keypoint_set,
                                        list_images, paired_files, read_annotations, read_class_ids, read_classes,
                                        read_intrinsics, read_npy, read_png, split_folder)
from sapiens2_app.augment.dense_augmentation import (box_intrinsics, continuous_crop, dense_pixels, dense_source_pixels,
                                             draw_dense, inside, resample_affine, resample_box, seg_geometry,
                                             source_points, whole_image_box)
from sapiens2_app.augment.pixel_augmentation import random_background
from sapiens2_app.train.pose_dataset import MIN_VISIBLE_KEYPOINTS, PoseDataset

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

    def __init__(self, task: str, folder: Path, size: tuple[int, int], augment: bool, class_names=None,
                 drop_rules: bool = False):
        """drop_rules: refetch the samples the original's training leaves out (dense_drop_reason)."""
        self.task, self.folder, self.size, self.augment = task, Path(folder), tuple(size), augment
        self.drop_rules = drop_rules
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
        self.masked = self.names_with_masks()
        backgrounds = self.folder.parent / "backgrounds"  # seg: photos to paste the people on (optional)
        self.backgrounds = sorted(path for path in backgrounds.rglob("*") if path.suffix.lower() in IMAGE_SUFFIXES
                                  ) if task == "seg" and backgrounds.is_dir() else []

    def names_with_masks(self) -> set[str]:
        """The images whose valid pixels a file gives (masks/, or albedo's alpha channel); the others are valid
        wherever their target is finite."""
        if self.masks is not None:
            return set(self.names)
        if self.task != "albedo":
            return set()
        masked = set()
        for name, path in self.targets.items():
            with Image.open(path) as image:
                if image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info:
                    masked.add(name)
        return masked

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
        return refetching(self.make_sample, key, len(self), self.drop_rules)

    def make_sample(self, index: int, seed: int) -> tuple[dict, str | None]:
        """(the sample, why the original's training would leave it out or None)."""
        name = self.names[index]
        generator = torch.Generator().manual_seed(int(seed))
        image = processing.load_image(self.images[name]).float()
        image_size = tuple(image.shape[-2:])
        target, mask, K = self.read_target(name, image_size)
        if not self.augment:
            box, flip = whole_image_box(self.task, image_size, self.size), False
            pixels, target, mask = self.resampled(image, target, mask, box, box)
        elif self.task == "seg":
            draws = draw_dense(self.task, generator)
            pixels, target = self.seg_augmented(image, target, draws)
            box, flip = None, draws.flip
        else:
            draws = draw_dense(self.task, generator)
            image = dense_source_pixels(self.task, image, draws)
            box, image_box, window, image_window, image = self.augmented_boxes(image, draws)
            pixels, target, mask = self.resampled(image, target, mask, box, image_box, window, image_window)
            pixels = pixels.clamp(0, 255).round()
            flip = draws.flip
            if flip:
                pixels, target = pixels.flip(-1), target.flip(-1)
                mask = mask.flip(-1) if mask is not None else None
                if self.task in ("normal", "pointmap"):
                    target[0] = -target[0]  # mirrored camera frame: x points the other way
            pixels = dense_pixels(self.task, pixels, draws)
        sample = {"pixel_values": processing.normalize(pixels)}
        self.finish(sample, target, mask, K, box, flip)
        sample["flipped"] = torch.tensor(flip)
        return sample, dense_drop_reason(self.task, sample, name in self.masked)

    def resampled(self, image, target, mask, box, image_box, window=None, image_window=None):
        """The box's pixels (image_box: the same in the image's own pixels, which a random scale resized), target
        and mask at the network size; outside the window (a crop), 0 as the original's padding."""
        label_mode = "bilinear" if self.task in ("matting", "albedo") else "nearest"
        fill = float(IGNORE) if self.task == "seg" else 0.0
        pixels = resample_box(image, image_box, self.size, "bilinear", window=image_window)
        target = resample_box(target, box, self.size, label_mode, fill, window=window)
        if mask is not None:
            mask = resample_box(mask, box, self.size, "nearest", window=window)
        return pixels, target, mask

    def augmented_boxes(self, image, draws):
        """normal, pointmap, albedo (and matting): {Normal,...}RandomScale of the image, RandomCropContinuous, and
        the resize and pad to the network size (Resize): the box, in source pixels and in the (scaled) image's,
        and the crop window in both."""
        h, w = image.shape[-2:]
        scaled = (int(round(h * draws.scale)), int(round(w * draws.scale))) if draws.scale else (h, w)
        crop = continuous_crop(scaled, draws.crop) if draws.crop else None
        x0, y0, cw, ch = crop or (0, 0, scaled[1], scaled[0])
        bx, by, bw, bh = whole_image_box(self.task, (ch, cw), self.size)
        image_box, image_window = (x0 + bx, y0 + by, bw, bh), (x0, y0, cw, ch)
        fx, fy = w / scaled[1], h / scaled[0]  # edge coordinates scale exactly

        def to_source(b):
            return (b[0] * fx, b[1] * fy, b[2] * fx, b[3] * fy)
        if draws.scale:
            image = processing.resize(image, scaled, "bilinear").clamp(0, 255).round()  # cv2.INTER_LINEAR
        return to_source(image_box), image_box, to_source(image_window), image_window, image

    def seg_augmented(self, image, target, draws):
        """The seg train_pipeline's geometry in one resampling: its crop's padding is 255 (ignored), what its
        rotation brings in is background (seg_pad_val=0) and black; then blur, noise, photometric distortion."""
        if draws.background is not None and self.backgrounds:  # SegRandomBackground, first in the pipeline
            pick = min(int(draws.background * len(self.backgrounds)), len(self.backgrounds) - 1)
            image = random_background(image, target[0], processing.load_image(self.backgrounds[pick]))
        geometry = seg_geometry(tuple(image.shape[-2:]), self.size, draws, target[0])
        pixels = resample_affine(image, geometry.to_source, self.size, "bilinear")
        labels = resample_affine(target, geometry.to_source, self.size, "nearest")
        in_source = inside(source_points(geometry.to_source, self.size), image.shape[-2:])
        in_window = inside(source_points(geometry.to_window, self.size), geometry.window_size)
        pixels = torch.where(in_source & in_window, pixels, 0.0).clamp(0, 255).round()
        labels = torch.where(in_window, torch.where(in_source, labels, float(IGNORE)), 0.0)
        if draws.flip:
            labels = self.class_flip[labels.long()].float()
        return dense_pixels("seg", pixels, draws), labels

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
# Samples the original's training leaves out, refetched
# ----------------------------------------------------------------------------------------------------
MIN_FOREGROUND = 0.01  # seg: dense/datasets/transforms/seg_transforms.py:136-141 (class > 0 and != 255)
MIN_VALID_PIXELS = 16  # normal, albedo, pointmap: normal_transforms.py:413, albedo_transforms.py:379, pointmap 573
MAX_VALID_SHARE = 0.96  # normal_transforms.py:416, albedo_transforms.py:382, pointmap_transforms.py:576
MIN_CANONICAL_DEPTH = 0.04  # pointmap_transforms.py:580: a point (nearly) inside the canonical camera
MAX_REFETCH = 1000  # engine/datasets/base_dataset.py:45


def dense_drop_reason(task: str, sample: dict, masked: bool) -> str | None:
    """Why the original's training would leave out this (augmented, resized) sample, or None to keep it; checked
    where its PackInputs checks, on the network-size targets. The > 96% valid rule only applies where a file gives
    the valid pixels (`masked`): without one, every pixel of a finite target is valid, and the rule would leave
    out every sample."""
    if task == "seg":
        labels = sample["labels"]
        return "under 1% foreground" if ((labels > 0) & (labels != IGNORE)).float().mean() < MIN_FOREGROUND else None
    if task not in ("normal", "albedo", "pointmap"):
        return None
    valid = sample["mask"] > 0
    if int(valid.sum()) < MIN_VALID_PIXELS:
        return f"fewer than {MIN_VALID_PIXELS} valid pixels"
    if masked and valid.float().mean() > MAX_VALID_SHARE:
        return "over 96% of the pixels valid"
    if task == "pointmap" and sample["labels"][2][valid[0]].min() < MIN_CANONICAL_DEPTH:
        return f"canonical depth under {MIN_CANONICAL_DEPTH}"
    return None


def refetching(make_sample, key, count: int, drop_rules: bool) -> dict:
    """make_sample(index, seed) -> (sample, reason to leave it out); with drop_rules, a sample left out is replaced
    by another index at random (the original's BaseDataset.__getitem__), the choice seeded by the sample's seed so
    that any process fetches the same. sample["dropped"]: how many were left out for it (train.py logs the sum)."""
    index, seed = key
    generator = None
    for attempt in range(MAX_REFETCH + 1):
        sample, reason = make_sample(index, seed)
        if not drop_rules or reason is None:
            sample["dropped"] = torch.tensor(attempt)
            return sample
        generator = generator or torch.Generator().manual_seed(int(seed) + 0x5DEECE66D)
        index = int(torch.randint(count, (), generator=generator))
        seed = int(torch.randint(2**62, (), generator=generator))
    raise UsageError(f"no training sample kept after {MAX_REFETCH} tries (the last left out: {reason}); see "
                     f"docs/training.md, 'Samples left out'")


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
        dataset = PoseDataset(folder, size, augment, min_visible=MIN_VISIBLE_KEYPOINTS if split == "train" else 1)
        if dataset.meta["keypoint_names"] != info["keypoint_names"]:
            raise UsageError(f"{folder / 'annotations.json'}: its keypoint names differ from train/'s")
        return dataset
    return DenseDataset(task, folder, size, augment, class_names=info.get("class_names"), drop_rules=split == "train")


def collate(samples: list[dict]) -> dict:
    return {key: torch.stack([s[key] for s in samples]) for key in samples[0]}

