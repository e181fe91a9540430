"""A run's files: per input and task, the files ARTEFACTS names, made from the task's result (render) and written
all or nothing per task (write_files), atomically (safe_io); what --skip-existing checks (all_written).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

from sapiens2.processing import keypoint_metadata
from sapiens2_app.predict import formats, pictures, tracking
from sapiens2_app.common.artefacts import ARTEFACTS, MASKED_TASKS
from sapiens2_app.common.cli import UsageError
from sapiens2_app.predict.inference import TaskFailed, resolved
from sapiens2_app.predict.inputs import InputImage
from sapiens2_app.predict.models import LoadedModel, features_model, keypoint_names
from sapiens2_app.common.safe_io import REPEATING_WRITE_ERRORS, atomic_write, check_writable, encode, os_error_text


@dataclass
class Outputs:
    """Where a run's files go and which: OUT, the output name of each input (video frames are added as they are
    decoded, and forgotten when done), the tasks, the --save kinds, the models (a model's own keypoints and
    classes name its files' contents), and the COCO results gathered image by image (--save coco)."""
    out: Path
    tasks: list[str]
    kinds: set[str]
    models: dict[str, LoadedModel]
    names: dict[InputImage, str]
    coco: formats.CocoResults | None = None
    training_data: object | None = None  # --training-data: pseudo_labels.TrainingData, fed by commit()

    def stem(self, item: InputImage) -> Path:
        """OUT/NAME, the output name of `item` (its files add their suffixes)."""
        return self.out / self.names[item]

    def path(self, item: InputImage, suffix: str) -> Path:
        """OUT/NAME.SUFFIX, one of `item`'s files."""
        return self.out / (self.names[item] + suffix)

    def expected(self, item: InputImage) -> list[Path]:
        return [self.path(item, suffix) for task in self.tasks
                for suffix, kinds in ARTEFACTS[task].items() if kinds & self.kinds]

    def all_written(self, item: InputImage) -> bool:
        """--skip-existing: are its files there? Never when it writes none of its own (--save coco alone)."""
        expected = self.expected(item)
        return bool(expected) and all(path.exists() for path in expected)

    def write(self, item: InputImage, image: torch.Tensor, result: dict) -> tuple[dict, list[tuple[str, Exception]]]:
        """Make and write every task's files: commit(make(...))."""
        return self.commit(item, result, self.make(item, image, result))

    def make(self, item: InputImage, image: torch.Tensor, result: dict) -> dict:
        """Every task's files, made but not written: {task: {suffix: (what goes in the file, its bytes)}}, or the
        task's error (its inference failed, or making a file did). No I/O: threads make images side by side. A
        result still pending is post-processed here first (render), beside the model's next batch."""
        made = {}
        for task in self.tasks:
            try:
                makers = render(task, item, image, result, self.models[task])
                made[task] = {}
                for suffix, kinds in ARTEFACTS[task].items():
                    if kinds & self.kinds:
                        value = makers[suffix]()
                        made[task][suffix] = (value, encode(value, suffix))
            except Exception as error:  # noqa: BLE001 (one task's failure keeps the image's other tasks)
                made[task] = error
        return made

    def commit(self, item: InputImage, result: dict, made: dict) -> tuple[dict, list[tuple[str, Exception]]]:
        """Write what make() made; return (what went in the files by suffix: videos encode the pictures, the (task,
        error) of the tasks that failed). A write error that will repeat (disk full, read-only, no permission) is
        raised, for the run to decide what to stop."""
        values, failures = {}, []
        for task, files in made.items():
            try:
                if isinstance(files, Exception):
                    raise files
                self.write_files(item, files)
                values.update({suffix: value for suffix, (value, _) in files.items()})
            except Exception as error:  # noqa: BLE001 (one task's failure keeps the image's other tasks)
                if isinstance(error, OSError) and error.errno in REPEATING_WRITE_ERRORS:
                    raise
                failures.append((task, error))
        pose_ok = isinstance(result.get("pose"), dict) and not any(task == "pose" for task, _ in failures)
        if self.coco is not None and pose_ok:
            self.coco.add(self.names[item], item.relative, result["pose"]["people"])
        if self.training_data is not None:
            self.training_data.add(self.names[item], item, result, {task for task, _ in failures})
        return values, failures

    def write_files(self, item: InputImage, files: dict):
        """One task's files, all or nothing: a failure (or Ctrl-C) removes the ones written, and an older version of
        the file being written, which would not belong with the new ones."""
        written = []
        try:
            for suffix, (_, data) in files.items():
                written.append(self.path(item, suffix))  # before: a signal may land after the rename
                atomic_write(written[-1], data)
        except BaseException:
            for path in written:
                with contextlib.suppress(OSError):  # the write error is what to report, not this
                    path.unlink(missing_ok=True)
            raise


def inference_error(task: str, result: dict):
    """Raise the error of a task whose inference failed (or whose --mask-with-seg segmentation did)."""
    if isinstance(result[task], TaskFailed):
        raise result[task].error
    if task in MASKED_TASKS and isinstance(result["mask"], TaskFailed):
        raise RuntimeError(f"--mask-with-seg: the segmentation failed ({result['mask'].error})")


def prepare_output_folder(out: Path):
    """Fail fast, before any model loads, on an OUT that is a file, under a file, read-only or not ours to write."""
    try:
        if out.exists() and not out.is_dir():
            raise UsageError(f"-o {out}: is a file, not a folder")
        out.mkdir(parents=True, exist_ok=True)
        check_writable(out)
    except OSError as error:
        raise UsageError(f"-o {out}: cannot write there ({os_error_text(error)})") from None


# ----------------------------------------------------------------------------------------------------
# What goes in each file
# ----------------------------------------------------------------------------------------------------
def render(task: str, item: InputImage, image: torch.Tensor, result: dict, loaded: LoadedModel) -> dict:
    result[task] = resolved(result[task])  # post-processed now if it was pending (see make)
    inference_error(task, result)
    value, mask = result[task], result["mask"] if task in MASKED_TASKS else None
    vis = stamp_random if loaded.random else (lambda picture: picture)  # pictures only: raw files stay raw
    if task == "seg":
        classes = loaded.model.head_config.out_channels  # a fine-tune's own count: its own palette
        return {".seg.png": lambda: Image.fromarray(value.to(torch.uint8).numpy()),
                ".seg_overlay.jpg": lambda: vis(pictures.overlay_segmentation(image, value, num_classes=classes))}
    if task == "pose":
        names = keypoint_names(loaded.model)
        return {".pose.json": lambda: pose_json(item, image, value, names),
                ".pose_overlay.jpg": lambda: vis(pictures.draw_pose(image, value["people"], names=names)),
                "_keypoints.json": lambda: formats.openpose_json(value["people"], names)}
    if task == "normal":
        return {".normal.npy": lambda: hwc_array(value, mask),
                ".normal.png": lambda: vis(pictures.normals_to_image(value, mask))}
    if task == "pointmap":
        return {".pointmap.npy": lambda: hwc_array(value, mask),
                ".depth.png": lambda: vis(depth_picture(value[2], mask)),
                ".pointmap.ply": lambda: formats.pointmap_ply(value, image, mask),
                ".depth16.png": lambda: formats.depth16_image(value[2], mask)}
    if task == "matting":
        return {".alpha.png": lambda: Image.fromarray(value["alpha"].numpy()),  # uint8, made on the device
                ".composite.jpg": lambda: vis(pictures.to_pil(value["composite"]))}
    if task == "albedo":
        albedo = value if mask is None else value * mask  # uint8, made on the device: masked after, the same bytes
        return {".albedo.png": lambda: pictures.to_pil(albedo)}  # the raw albedo
    if task == "features":
        about = {"image": item.relative, "height": str(image.shape[-2]), "width": str(image.shape[-1]),
                 "model": features_model(loaded), "random_weights": str(loaded.random).lower()}
        return {".features.safetensors": lambda: (value, about)}
    raise ValueError(f"unknown task {task!r}")


def hwc_array(value: torch.Tensor, mask: torch.Tensor | None) -> np.ndarray:
    """(3, H, W) -> (H, W, 3) float32, NaN outside the mask."""
    array = value.permute(1, 2, 0).float().numpy().copy()
    if mask is not None:
        array[~mask.numpy()] = np.nan
    return array


def depth_picture(depth: torch.Tensor, mask: torch.Tensor | None) -> Image.Image:
    if mask is not None and not mask.any():  # nobody segmented: nothing to colour
        return Image.new("RGB", (depth.shape[-1], depth.shape[-2]))
    return pictures.depth_to_image(depth, mask)


def pose_json(item: InputImage, image: torch.Tensor, value: dict, names=None) -> dict:
    """Boxes xyxy, keypoints [x, y, score] x 308 (or x the model's own `names`) in image pixels; score = mean
    keypoint score above 0.2."""
    names = tuple(names or keypoint_metadata()["keypoint_names"])
    people = []
    for i, (person, entry) in enumerate(zip(value["people"],
                                            formats.pose_to_coco([value["people"]], [0], "model", names=names))):
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
