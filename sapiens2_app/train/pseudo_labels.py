"""predict.py --training-data DIR: the predictions as training sets in train.py's layout (datasets.py), to inspect,
correct, and fine-tune any model on with plain train.py (`train.py seg --data DIR/seg ...`). One dataset folder per
task, DIR/TASK/ (apart: normal's optional masks/ would otherwise meet seg's class maps), everything in its train/
(move some photos to val/ to validate on them):

  train/images/NAME.EXT      the photo, its bytes copied
  train/masks/NAME.png       seg: the class ids (uint8); DIR/seg/classes.json: the model's class names
  train/normals/NAME.npy     normal: (H, W, 3) unit normals, float32; NaN where --mask-with-seg left a pixel out
  train/pointmaps/NAME.npy   pointmap: (H, W, 3) metric XYZ, float32; NaN as normals
  train/alphas/NAME.png      matting: alpha (8 bits, as NAME.alpha.png)
  train/albedo/NAME.png      albedo: RGB (as NAME.albedo.png); RGBA with the mask as alpha under --mask-with-seg
  train/annotations.json     pose: COCO keypoints; each person's box (xywh) and keypoints [x, y, v], v = 2 where the
                             keypoint's score is at least VISIBLE_SCORE, else 0; categories[0] names the model's
                             keypoints and their flip pairs

NAME is the photo's output name (predict.py's). The files are written from the per-photo results predict.py's
outputs get (outputs.Outputs.commit hands them over); annotations.json once all photos are done (finish).
"""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from sapiens2_app.predict import formats
from sapiens2_app.common.cli import UsageError
from sapiens2_app.train.dataset_files import IMAGE_SUFFIXES
from sapiens2_app.train.distillation import segmentation_names
from sapiens2_app.predict.inputs import InputImage
from sapiens2_app.predict.models import keypoint_names
from sapiens2_app.common.safe_io import atomic_write, encode

VISIBLE_SCORE = 0.3  # the original demo's keypoint threshold (kpt_thr): a keypoint below it is not labelled
TASK_FOLDERS = {"seg": "masks", "normal": "normals", "pointmap": "pointmaps", "matting": "alphas", "albedo": "albedo"}
SPLIT = "train"


class TrainingData:
    """DIR's files, added photo by photo (from any of the pipeline's threads), annotations.json at the end."""

    def __init__(self, root: Path, tasks: list[str], models: dict):
        self.root, self.tasks, self.models = Path(root), [t for t in tasks if t != "features"], models
        self.lock = threading.Lock()
        self.coco_images, self.coco_people = [], []  # pose: gathered for annotations.json
        try:
            for task in self.tasks:
                (self.split(task) / "images").mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise UsageError(f"--training-data {self.root}: cannot write there ({error})") from None
        if "seg" in self.tasks:
            names = models["seg"].model.labels or segmentation_names(models["seg"].model.head_config.out_channels)
            atomic_write(self.root / "seg" / "classes.json", json.dumps(list(names), indent=1).encode())

    def split(self, task: str) -> Path:
        return self.root / task / SPLIT

    def add(self, name: str, item: InputImage, result: dict, failed: set[str]):
        """One photo's results (the tasks in `failed` left out; a video frame has no photo file: skipped)."""
        if item.path.suffix.lower() not in IMAGE_SUFFIXES or not item.path.is_file():
            return
        done = [task for task in self.tasks if task not in failed and not isinstance(result.get(task), Exception)]
        if not done:
            return
        for task in done:
            image_file = self.split(task) / "images" / (name + item.path.suffix.lower())
            image_file.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(item.path, image_file)
            if task == "pose":
                self.add_people(image_file, result["pose"])
            else:
                suffix = ".npy" if task in ("normal", "pointmap") else ".png"
                path = self.split(task) / TASK_FOLDERS[task] / (name + suffix)
                path.parent.mkdir(parents=True, exist_ok=True)
                value = target_file(task, result[task], result.get("mask"))
                atomic_write(path, encode(value, path.suffix))

    def add_people(self, image_file: Path, value: dict):
        names = keypoint_names(self.models["pose"].model)
        size = Image.open(image_file).size  # (width, height)
        entries = formats.pose_to_coco([value["people"]], [0], "model", names=names)
        with self.lock:
            image_id = len(self.coco_images)
            self.coco_images.append({"id": image_id, "file_name": image_file.relative_to(self.split("pose") / "images")
                                     .as_posix(), "width": size[0], "height": size[1]})
            for entry in entries:
                flat = entry["keypoints"]
                keypoints = [v for x, y, s in zip(flat[0::3], flat[1::3], flat[2::3])
                             for v in (x, y, 2 if s >= VISIBLE_SCORE else 0)]
                x, y, w, h = entry["bbox"]
                self.coco_people.append({"id": len(self.coco_people), "image_id": image_id, "bbox": [x, y, w, h],
                                         "keypoints": keypoints, "iscrowd": 0, "area": w * h,
                                         "num_keypoints": sum(1 for v in keypoints[2::3] if v > 0)})

    def finish(self):
        """annotations.json (pose), with the photos done so far."""
        if "pose" not in self.tasks:
            return
        model = self.models["pose"].model
        names = list(keypoint_names(model))
        category = {"id": 1, "name": "person", "keypoints": names, "flip_pairs": model.flip_pairs().tolist(),
                    "skeleton": []}
        coco = {"images": self.coco_images, "annotations": self.coco_people, "categories": [category]}
        atomic_write(self.split("pose") / "annotations.json", json.dumps(coco).encode())


def target_file(task: str, value, mask: torch.Tensor | None):
    """What goes in the task's target file (encoded by safe_io.encode from its suffix)."""
    if task == "seg":
        return Image.fromarray(value.to(torch.uint8).numpy())
    if task in ("normal", "pointmap"):
        array = value.permute(1, 2, 0).float().numpy().copy()  # (H, W, 3)
        if mask is not None:
            array[~mask.numpy()] = np.nan  # the loader's rule: a non-finite target is not valid
        return array
    if task == "matting":  # uint8 alpha, made on the device (as NAME.alpha.png)
        return Image.fromarray(value["alpha"].numpy())
    # albedo: uint8, made on the device (as NAME.albedo.png); zero outside the mask, which becomes the alpha channel
    if mask is None:
        return Image.fromarray(value.permute(1, 2, 0).numpy())
    rgb = (value * mask).permute(1, 2, 0).numpy()
    return Image.fromarray(np.concatenate([rgb, mask.numpy()[..., None].astype(np.uint8) * 255], -1), "RGBA")
