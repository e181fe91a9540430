"""The photos a distillation run trains on (train.py --teacher): any folder of images, or the images of a dataset
folder with its labels ignored. Each photo goes through the task's own augmentation (datasets.py's, pose's
pose_dataset.py's), so the student and the teacher see the crops fine-tuning would.

Where the photos are, for --data ROOT:  ROOT/train/images/, else ROOT/images/, else ROOT itself (searched below).
Validation: ROOT/val/ when it exists; with the task's labels there (masks/, annotations.json, ...) the usual
metrics are computed beside the agreement with the teacher.

Pose needs people: the boxes of each photo come from --boxes, else the person detector (--detector: D-FINE; 'seg'
for the person blobs of the segmentation model --seg-model; 'none'), else the whole image, as predict.py finds them
(boxes.pose_boxes). The main process finds them once and writes them to
OUT/people.json (COCO: images + annotations with boxes and no keypoints), which the other processes and a resumed
run read back: every process, and every resume, trains on the same people.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from sapiens2 import processing, weights
from sapiens2_app.predict import boxes as box_rules
from sapiens2_app.common.cli import UsageError
from sapiens2_app.train.dataset_files import (IMAGE_SUFFIXES, TARGET_FOLDERS, flip_order, list_images)
from sapiens2_app.train.datasets import DenseDataset
from sapiens2_app.predict.inference import PADDED
from sapiens2_app.predict.inputs import InputImage
from sapiens2_app.augment.pose_augmentation import clip_box
from sapiens2_app.train.pose_dataset import PoseDataset, body_halves

PEOPLE_FILE = "people.json"


def photo_folder(root: Path, split: str) -> Path | None:
    """The folder whose images/ (or whose own images) are `split`'s photos; None for a missing val/."""
    root = Path(root)
    if (root / split).is_dir():
        return root / split
    if split == "train":
        return root
    return None


def list_photos(folder: Path) -> dict[str, Path]:
    """{NAME: file} of folder/images/, else of folder itself (any depth)."""
    if (folder / "images").is_dir():
        return list_images(folder)
    found = {}
    for path in sorted(folder.rglob("*")):
        if path.relative_to(folder).parts[0] == "val":  # (photos in the folder itself: its val/ is validation's)
            continue
        if path.suffix.lower() in IMAGE_SUFFIXES and path.is_file():
            found[path.relative_to(folder).with_suffix("").as_posix()] = path
    if not found:
        raise UsageError(f"--data {folder}: no images ({', '.join(sorted(IMAGE_SUFFIXES))}) in it or in images/")
    return found


def labelled(task: str, folder: Path | None) -> bool:
    """Whether a split folder has the task's labels (then its usual metrics are computed too)."""
    if folder is None:
        return False
    if task == "pose":
        return (folder / "annotations.json").is_file()
    return (folder / TARGET_FOLDERS[task]).is_dir()


# ----------------------------------------------------------------------------------------------------
# Dense tasks: the photos with the task's augmentation, without targets
# ----------------------------------------------------------------------------------------------------
class PhotoDataset(DenseDataset):
    """DenseDataset's samples for photos without labels: the same augmentation draws, a target of zeros where
    the labels would be (the loss uses the teacher's outputs, never these)."""

    def __init__(self, task: str, folder: Path, size, augment: bool, class_names=None):
        self.task, self.folder, self.size, self.augment = task, Path(folder), tuple(size), augment
        self.drop_rules = False  # the original's rules read labels; photos have none
        self.images = list_photos(self.folder)
        self.names = list(self.images)
        self.targets, self.masks, self.intrinsics = None, None, None
        self.num_classes = len(class_names) if class_names else None
        self.class_flip = torch.arange(256)
        self.masked, self.backgrounds = set(), []

    def read_target(self, name: str, image_size):
        """Zeros of the target's shape; pointmap: a camera of 60 degrees across the longer side (unused by the
        loss; the augmentation carries it along)."""
        channels = {"seg": 1, "matting": 1}.get(self.task, 3)
        target = torch.zeros(channels, *image_size)
        K = None
        if self.task == "pointmap":
            h, w = image_size
            focal = max(h, w) / (2 * np.tan(np.radians(30)))
            K = torch.tensor([[focal, 0, (w - 1) / 2], [0, focal, (h - 1) / 2], [0, 0, 1]], dtype=torch.float32)
        mask = torch.ones(1, *image_size) if self.task in ("normal", "pointmap") else None
        return target, mask, K


# ----------------------------------------------------------------------------------------------------
# Pose: the people of the photos, found as predict.py finds them
# ----------------------------------------------------------------------------------------------------
def find_people(photos: dict[str, Path], folder: Path, boxes: dict | None, detector, segmenter=None) -> dict:
    """COCO {"images", "annotations", "boxes_from"}: each photo's person boxes (boxes.pose_boxes: --boxes, else
    the detector, else the segmentation's person blobs (segmenter, --detector seg), else the whole image), no
    keypoints."""
    images, annotations, sources = [], [], {}
    for image_id, (name, path) in enumerate(photos.items()):
        image = processing.load_image(path)
        item = InputImage(path, path.relative_to(folder).as_posix())
        detected, segmentation = None, None
        if boxes is None or box_rules.boxes_for(item, boxes) is None:
            if detector is not None:
                detected = detector([image])[0].float().cpu()
            elif segmenter is not None:
                segmentation = segmenter(image)
        found, source, _, _ = box_rules.pose_boxes(item, image, boxes, segmentation, detected)
        sources[source] = sources.get(source, 0) + 1
        images.append({"id": image_id, "file": str(path), "height": int(image.shape[-2]),
                       "width": int(image.shape[-1])})
        for box in found:
            annotations.append({"id": len(annotations), "image_id": image_id, "bbox": [float(v) for v in box]})
    return {"images": images, "annotations": annotations, "boxes_from": sources}


def people_file(out: Path, root: Path, args, dist_info) -> dict:
    """OUT/people.json, {split: find_people's} for train and (when present) val: found by the main process when a
    run starts (a resumed run reads them back), read by all. --boxes (args.boxes) wins; without it the detector
    (args.detector: D-FINE, 'seg' for the blobs of --seg-model's segmentation, 'none' for the whole image) finds
    them."""
    path = Path(out) / PEOPLE_FILE
    if dist_info.main and not args.resume:
        boxes = box_rules.read_boxes_file(args.boxes) if args.boxes else None
        person_detector = segmenter = None
        if args.boxes is None and args.detector == "seg":
            segmenter = Segmenter(load_seg_model(args.seg_model, dist_info.device))
        elif args.boxes is None and args.detector != "none":
            person_detector = load_detector(args.detector, dist_info.device)
        found = {}
        for split in ("train", "val"):
            folder = photo_folder(root, split)
            if folder is not None:
                found[split] = find_people(list_photos(folder), folder, boxes, person_detector, segmenter)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(found))
    dist_info.barrier()
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise UsageError(f"{path}: cannot read the people found in the photos ({error}); delete it to find "
                         f"them again") from None


def load_detector(source: str, device):
    from sapiens2_app.detector import detector  # D-FINE: loaded only for a pose run without --boxes
    try:
        return detector.load(source, device=device)
    except (ValueError, OSError) as error:
        raise UsageError(f"--detector {source}: {error}") from None


def load_seg_model(source: str, device):
    """--seg-model: the segmentation model whose person blobs are the boxes (--detector seg); fp32 on CPU, bf16 on
    CUDA, as the teacher."""
    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    try:
        return weights.load(source, dtype=dtype, device=device, task="seg").requires_grad_(False).eval()
    except (ValueError, OSError) as error:
        raise UsageError(f"--seg-model {source}: {error}") from None


class Segmenter:
    """A photo's (H, W) class map from a seg model, as predict.py makes it (inference.run_seg: its preprocessing,
    unpadded, at the model's input size; the logits resized to the photo, then the argmax)."""

    def __init__(self, model):
        self.model = model

    @torch.no_grad()
    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        parameter = next(self.model.parameters())
        inputs = processing.preprocess([image], tuple(self.model.config.image_size), pad=PADDED["seg"],
                                       device=parameter.device)
        logits = self.model(inputs.pixel_values.to(parameter.dtype)).logits
        return processing.postprocess_segmentation(logits.float(), inputs)[0].cpu()


class PhotoPeople(PoseDataset):
    """PoseDataset's samples for people without keypoints (people.json): the crops of the task's augmentation
    (the half-body crop needs visible keypoints: none here, so it never applies), targets of zeros."""

    def __init__(self, found: dict, info: dict, size, augment: bool, heatmap_downscale: int = 4):
        self.size, self.augment, self.min_visible = tuple(size), augment, 0
        self.heatmap_size = (size[0] // heatmap_downscale, size[1] // heatmap_downscale)
        self.meta = {key: info[key] for key in ("keypoint_names", "flip_pairs", "skeleton", "sigmas")}
        count = len(info["keypoint_names"])
        self.flip_order = flip_order(count, info["flip_pairs"])
        self.body_ids = body_halves(info["keypoint_names"])
        self.dropped = {}
        files = {image["id"]: (Path(image["file"]), image["height"], image["width"]) for image in found["images"]}
        self.people = []
        for ann in found["annotations"]:
            file, height, width = files[ann["image_id"]]
            x, y, w, h = ann["bbox"]
            self.people.append({"file": file, "bbox": [x, y, w, h],
                                "box_xyxy": clip_box(ann["bbox"], (height, width)),
                                "keypoints": torch.zeros(count, 3), "area": float(w * h)})
        if not self.people:
            raise UsageError("no person found in the photos (--boxes, the detector and the whole image gave none)")


# ----------------------------------------------------------------------------------------------------
# Building the datasets
# ----------------------------------------------------------------------------------------------------
def build_datasets(task: str, root: Path, size, augment: bool, info: dict, people: dict | None):
    """(train, val, val is labelled): train/'s photos (or the folder's); val/ when present. people: pose's
    people_file."""
    from sapiens2_app.train import datasets  # the labelled val set, as fine-tuning builds it

    train_folder, val_folder = photo_folder(root, "train"), photo_folder(root, "val")
    if task == "pose":
        train = PhotoPeople(people["train"], info, size, augment)
    else:
        train = PhotoDataset(task, train_folder, size, augment, info.get("class_names"))
    val, with_labels = None, labelled(task, val_folder)
    if with_labels:
        val = datasets.build_dataset(task, Path(root), "val", size, False, info)
    elif val_folder is not None:
        val = (PhotoPeople(people["val"], info, size, False) if task == "pose" else
               PhotoDataset(task, val_folder, size, False, info.get("class_names")))
    return train, val, with_labels
