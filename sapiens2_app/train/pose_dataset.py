"""Pose training data: one sample per annotated person (annotations.json, COCO keypoints; its format in
datasets.py), the people the original's loaders keep, and the keypoint set's body halves for the half-body crop.
A sample is the person's top-down crop (pose_augmentation.py) with UDP heatmap targets (targets.py), fetched as
dataset[(index, seed)] as the dense tasks' (datasets.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from sapiens2 import processing
from sapiens2_app.common.cli import UsageError
from sapiens2_app.train.dataset_files import flip_order, header_size, keypoint_set, read_annotations
from sapiens2_app.augment.pose_augmentation import PoseDraws, clip_box, draw_pose, pose_crop, pose_pixels
from sapiens2_app.train.targets import heatmap_sigma, udp_heatmaps


# ----------------------------------------------------------------------------------------------------
# Pose: one sample per person, a top-down crop with UDP heatmap targets
# ----------------------------------------------------------------------------------------------------
class PoseDataset:
    """One sample per annotated person that the original's loader keeps (see drop_reason)."""

    def __init__(self, folder: Path, size: tuple[int, int], augment: bool, heatmap_downscale: int = 4,
                 min_visible: int = 1):
        """min_visible: the fewest visible keypoints a person needs (training: MIN_VISIBLE_KEYPOINTS)."""
        self.folder, self.size, self.augment, self.min_visible = Path(folder), tuple(size), augment, min_visible
        self.heatmap_size = (size[0] // heatmap_downscale, size[1] // heatmap_downscale)
        coco, path = read_annotations(self.folder)
        self.meta = keypoint_set(coco, path)
        self.flip_order = flip_order(len(self.meta["keypoint_names"]), self.meta["flip_pairs"])
        self.body_ids = body_halves(self.meta["keypoint_names"])
        self.dropped: dict[str, int] = {}  # reason -> people left out
        self.people = self.read_people(coco, path)
        if not self.people:
            raise UsageError(f"{path}: no person to train on ({describe_dropped(self.dropped)})")

    def read_people(self, coco: dict, path: Path) -> list[dict]:
        K = len(self.meta["keypoint_names"])
        files, sizes = {}, {}
        for image in coco.get("images", []):
            file = self.folder / "images" / image["file_name"]
            if not file.is_file():
                raise UsageError(f"{file}: no such file (listed in {path}, image id {image['id']})")
            files[image["id"]] = file
            sizes[image["id"]] = (image["height"], image["width"]) if "height" in image and "width" in image else None
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
            image_id = ann["image_id"]
            if sizes[image_id] is None:
                sizes[image_id] = header_size(files[image_id])
            keypoints = torch.from_numpy(keypoints.reshape(K, 3))
            box = clip_box(bbox, sizes[image_id])
            reason = drop_reason(box, keypoints, sizes[image_id], self.min_visible)
            if reason:
                self.dropped[reason] = self.dropped.get(reason, 0) + 1
                continue
            area = float(ann.get("area") or bbox[2] * bbox[3])
            people.append({"file": files[image_id], "bbox": [float(v) for v in bbox], "box_xyxy": box,
                           "keypoints": keypoints, "area": area})
        return people

    def __len__(self) -> int:
        return len(self.people)

    def __getitem__(self, key) -> dict:
        """Every crop is a sample, even one that leaves no keypoint visible: the original trains on them all (its
        check of the crop's keypoints is never reached in training, docs/training.md 'Samples left out')."""
        index, seed = key
        return {**self.make_sample(index, seed), "dropped": torch.tensor(0)}

    def make_sample(self, index: int, seed: int) -> dict:
        person = self.people[index]
        generator = torch.Generator().manual_seed(int(seed))
        image = processing.load_image(person["file"]).float()
        draws = draw_pose(generator, self.size) if self.augment else PoseDraws()
        crop = pose_crop(person["box_xyxy"], person["keypoints"], image.shape[-1], self.size, draws,
                         self.flip_order, self.body_ids)
        pixels = pose_pixels(image, crop, self.size, draws)
        heatmaps, weights = udp_heatmaps(crop.points, crop.visible, self.size, self.heatmap_size,
                                         heatmap_sigma(self.heatmap_size))
        return {"pixel_values": processing.normalize(pixels), "labels": heatmaps, "label_weights": weights,
                "keypoints": person["keypoints"][crop.order], "to_source": crop.to_source,
                "bbox": torch.tensor(person["bbox"]), "area": torch.tensor(person["area"]),
                "flipped": torch.tensor(draws.flip)}


MIN_VISIBLE_KEYPOINTS = 8  # the released loaders' min_visible_keypoints (pose/configs/_base_/keypoints308.py:790)


def drop_reason(box_xyxy, keypoints, image_size, min_visible: int) -> str | None:
    """Why the original's loaders leave a person out (pose/datasets/pose_base_dataset.py:158-214: a clipped box
    with no area, keypoints all at (0, 0), none labelled; and for training keypoints308_shutterstock_dataset.py:
    111-156: keypoints outside the image do not count, fewer than 8 visible are too few), or None to keep it.
    The only pose rule: the original leaves out no crop (docs/training.md, 'Samples left out'). box_xyxy: clipped
    to the image."""
    if box_xyxy[2] <= box_xyxy[0] or box_xyxy[3] <= box_xyxy[1]:
        return "box outside the image"
    if keypoints[:, :2].max() <= 0:
        return "keypoints all at (0, 0)"
    height, width = image_size
    x, y = keypoints[:, 0], keypoints[:, 1]
    in_image = (x > 0) & (x < width) & (y > 0) & (y < height)
    if not (keypoints[:, 2] > 0).any():
        return "no visible keypoint"
    if min_visible > 1 and int(((keypoints[:, 2] > 0) & in_image).sum()) < min_visible:
        return f"fewer than {min_visible} visible keypoints in the image"
    return None


def describe_dropped(dropped: dict[str, int]) -> str:
    return ", ".join(f"{count} left out: {reason}" for reason, count in sorted(dropped.items())) or "none left out"


LOWER_BODY_WORDS = ("hip", "knee", "ankle", "heel", "toe", "foot", "feet")


def known_halves() -> list[tuple[list[str], set[str], set[str]]]:
    """(official names, upper names, lower names) of the known sets: the original's keypoint types (`type="upper"`
    / `"lower"`): the 308 set's upper_body_ids/lower_body_ids (data/keypoints308.json); COCO-WholeBody 133 and
    COCO 17 (keypoints308.py's coco_wholebody_info): nose to wrists / hips to feet (the 6 foot points: 133 only)."""
    sapiens, wholebody = processing.keypoint_metadata(), processing.read_data("coco_wholebody133.json")
    names308, names133 = sapiens["keypoint_names"], wholebody["keypoint_names"]
    upper308, lower308 = ({names308[i] for i in sapiens[key]} for key in ("upper_body_ids", "lower_body_ids"))
    return [(names308, upper308, lower308), (names133, set(names133[:11]), set(names133[11:23])),
            (names133[:17], set(names133[:11]), set(names133[11:17]))]


def body_halves(names: list[str]) -> tuple[list[int], list[int]]:
    """(upper ids, lower ids) for the half-body crop: a known set's (its names in any order, see known_halves); for
    another set, by name: hips, knees, ankles, heels, toes and feet are the lower half, every other keypoint the
    upper."""
    for official, upper, lower in known_halves():
        if len(names) == len(official) and sorted(names) == sorted(official):
            return [i for i, n in enumerate(names) if n in upper], [i for i, n in enumerate(names) if n in lower]
    lower = [i for i, name in enumerate(names) if any(word in name.lower() for word in LOWER_BODY_WORDS)]
    return [i for i in range(len(names)) if i not in lower], lower
