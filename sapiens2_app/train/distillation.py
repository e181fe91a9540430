"""Distillation (train.py --teacher): a student task model learns a frozen teacher's outputs on photos without
labels. The teacher (anything weights.load takes) sees the student's augmented input of the same step, under
torch.no_grad, in eval mode; on CUDA its weights are bf16. It is held here, never by the student, so no checkpoint
holds any of it. Targets and losses per task, with their sources, in docs/training.md#distillation.

Where the teacher's input size differs from the student's (--size): the student's pixels are resized to the
teacher's size (bilinear, antialiased when shrinking), and the teacher's outputs are resized to the student's output
size (bilinear; normals made unit again, a seg argmax taken after resizing the logits). A pointmap's canonical XYZ and
scale are tied to the input width (focal 768 network pixels): both are multiplied by teacher width / student width, so
that the metric points (XYZ / scale) stay the same.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from sapiens2 import heads, processing, weights
from sapiens2.losses import MATTING_LOSSES, gradient_l2, keypoint_mse_loss, masked_pixel_mean
from sapiens2_app.detector import detector
from sapiens2_app.common.cli import UsageError
from sapiens2_app.train.dataset_files import known_keypoint_set



# The loss terms of each task and their default weights (--distill-weights changes them; one source of truth,
# docs/training.md#distillation prints the sources).
DEFAULT_WEIGHTS = {
    # Hinton et al. 2015 (KL between softened distributions, x T^2), per pixel as Liu et al. 2019 (SKD);
    # "ce": cross-entropy on the teacher's argmax (hard pseudo-labels), off by default
    "seg": {"kl": 1.0, "temperature": 1.0, "ce": 0.0},
    # Zhang et al. 2019 (Fast Pose Distillation): the task's heatmap MSE against the teacher's flip-tested heatmaps
    "pose": {"mse": 10.0},
    # the task's loss (cosine x10 + L1) against the teacher's unit normals; its gradient term (x10) off by default
    "normal": {"cosine": 10.0, "l1": 1.0, "gradient": 0.0},
    # the task's scale-normalized XYZ L1 (x2) and scale L1 (x4) against the teacher's
    "pointmap": {"l1": 2.0, "scale": 4.0},
    # the task's L1 + Sobel-gradient + Laplacian terms, on alpha and on the foreground
    "matting": {"alpha": 1.0, "foreground": 1.0},
    # the task's L1 (x2), gradient (x1 on E_x + E_y) and chromaticity (x1) terms
    "albedo": {"l1": 2.0, "gradient": 1.0, "chroma": 1.0},
}


def parse_weights(task: str, text: str | None) -> dict[str, float]:
    """--distill-weights NAME=VALUE,...: the task's DEFAULT_WEIGHTS with these changed."""
    chosen = dict(DEFAULT_WEIGHTS[task])
    for item in filter(None, (text or "").split(",")):
        name, _, value = item.partition("=")
        name = name.strip()
        if name not in chosen:
            raise UsageError(f"--distill-weights {text}: {task} has no term {name!r}; its terms: "
                             + ", ".join(f"{k}={v:g}" for k, v in DEFAULT_WEIGHTS[task].items()))
        try:
            chosen[name] = float(value)
        except ValueError:
            raise UsageError(f"--distill-weights {text}: {name}={value!r} is not a number") from None
        if not math.isfinite(chosen[name]) or chosen[name] < 0 or (name == "temperature" and chosen[name] == 0):
            raise UsageError(f"--distill-weights {text}: {name} must be a finite number >= 0"
                             + (" (temperature > 0)" if name == "temperature" else ""))
    return chosen


def add_arguments(parser):
    """train.py's distillation options."""
    group = parser.add_argument_group("distillation (docs/training.md#distillation)")
    group.add_argument("--teacher", metavar="MODEL", help="distill this task model (anything --model of predict.py "
                       "takes) into --model: --data is then any folder of photos (labels, if any, are ignored); "
                       "the teacher stays frozen and is never saved")
    group.add_argument("--distill-weights", metavar="NAME=VALUE,...", help="change the loss terms' weights, e.g. "
                       "seg: kl=1,temperature=2,ce=0.5 (defaults: " + "; ".join(
                           f"{task}: " + ",".join(f"{k}={v:g}" for k, v in terms.items())
                           for task, terms in DEFAULT_WEIGHTS.items()) + ")")
    group.add_argument("--boxes", metavar="FILE", help="pose: person boxes, JSON {\"image.jpg\": [[x, y, w, h], "
                       "...]} (as predict.py); photos without an entry use the detector")
    group.add_argument("--detector", default=detector.DEFAULT_DETECTOR, metavar="SOURCE",
                       help="pose: person boxes from this D-FINE detector (default %(default)s), 'seg' for the "
                       "segmentation's person blobs (of --seg-model), 'none' for the whole image; --boxes wins "
                       "(as predict.py)")
    group.add_argument("--seg-model", metavar="MODEL", help="pose with --detector seg: the segmentation model "
                       "(anything --teacher takes, e.g. seg-1b) whose person blobs are the boxes")


def describe(distiller: "Distiller", source: str, people: dict | None) -> str:
    """The run's note on its teacher."""
    teacher = distiller.teacher
    text = (f"distilling {source} ({teacher.task}, input {teacher.size[0]}x{teacher.size[1]}, frozen, "
            f"{next(teacher.model.parameters()).dtype}) with "
            + ", ".join(f"{k}={v:g}" for k, v in distiller.weights.items()))
    if people is not None:
        found = people["train"]
        text += (f"; {len(found['annotations'])} people in {len(found['images'])} training photos (boxes from "
                 + ", ".join(f"{source}: {n} photos" for source, n in found["boxes_from"].items()) + ")")
    return text


# ----------------------------------------------------------------------------------------------------
# The teacher
# ----------------------------------------------------------------------------------------------------
def setup_teacher(args, device: torch.device) -> heads.Sapiens2ForTask:
    """--teacher with its options checked first (a bad --distill-weights costs no model load)."""
    parse_weights(args.task, args.distill_weights)
    if args.task != "pose" and args.boxes:
        raise UsageError("--boxes: only pose finds people in the photos")
    if args.detector == "seg" and args.task == "pose" and not args.boxes and not args.seg_model:
        raise UsageError("--detector seg: give the segmentation model whose person blobs are the boxes with "
                         "--seg-model MODEL (e.g. seg-1b)")
    if args.seg_model and (args.detector != "seg" or args.task != "pose"):
        raise UsageError(f"--seg-model {args.seg_model}: only pose with --detector seg uses it")
    return load_teacher(args.teacher, args.task, device)


def load_teacher(source: str, task: str, device: torch.device) -> heads.Sapiens2ForTask:
    """--teacher: a task model of `task`, frozen, in eval mode; bf16 weights on CUDA, fp32 elsewhere."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        teacher = weights.load(source, dtype=dtype, device=device, task=task)
    except (ValueError, OSError) as error:
        raise UsageError(f"--teacher {source}: {error}") from None
    return teacher.requires_grad_(False).eval()


def teacher_info(task: str, teacher: heads.Sapiens2ForTask) -> dict:
    """What the student's head needs, from the teacher (train.py's dataset_info for unlabeled photos)."""
    count = teacher.head_config.out_channels
    info = {"out_channels": count}
    if task == "seg":
        names = teacher.labels or segmentation_names(count)
        info["class_names"] = list(names)
    elif task == "pose":
        names = list(teacher.labels or processing.keypoint_metadata()["keypoint_names"][:count])
        known = known_keypoint_set(names)
        info.update(keypoint_names=names, flip_pairs=teacher.flip_pairs().tolist(), flip_pairs_from="teacher",
                    skeleton=[], sigmas=known["sigmas"] if known else None)
    return info


def segmentation_names(count: int) -> list[str]:
    names = processing.segmentation_metadata()["class_names"]
    return list(names) if len(names) == count else [f"class_{i}" for i in range(count)]


class Teacher:
    """The frozen teacher and how its outputs become the student's targets."""

    def __init__(self, model: heads.Sapiens2ForTask, task: str, student_size: tuple[int, int]):
        self.model, self.task = model, task
        self.size, self.student_size = tuple(model.config.image_size), tuple(student_size)
        # canonical pointmaps scale with the network width (focal 768 network pixels): module docstring
        self.width_ratio = self.size[1] / self.student_size[1]

    @torch.no_grad()
    def outputs(self, pixel_values: torch.Tensor, output_size: tuple[int, int]):
        """The teacher's output for the student's input, at the student's output size `output_size` (pose: the
        flip test's mean heatmaps, as predict.py and the validation use). fp32, detached."""
        parameter = next(self.model.parameters())
        pixels = pixel_values.to(parameter.device, parameter.dtype)
        if self.size != self.student_size:
            shrink = self.size[0] < self.student_size[0]
            pixels = F.interpolate(pixels, self.size, mode="bilinear", align_corners=False, antialias=shrink)
        if self.task == "pose":
            return resized(self.model.flip_test(pixels).float(), output_size)
        out = self.model(pixels)
        if self.task == "seg":
            return heads.SegOutput(resized(out.logits.float(), output_size))
        if self.task == "normal":
            return heads.NormalOutput(processing.unit_length(resized(out.normals.float(), output_size), 1))
        if self.task == "pointmap":
            ratio = self.width_ratio
            return heads.PointmapOutput(resized(out.pointmaps.float(), output_size) * ratio, out.scales.float() * ratio)
        if self.task == "matting":
            return heads.MattingOutput(resized(out.alphas.float(), output_size),
                                       resized(out.foregrounds.float(), output_size))
        return heads.AlbedoOutput(resized(out.albedo.float(), output_size).clamp(0, 1))


def resized(maps: torch.Tensor, size) -> torch.Tensor:
    if tuple(maps.shape[-2:]) == tuple(size):
        return maps
    return F.interpolate(maps, tuple(size), mode="bilinear", align_corners=False)


def output_size(task: str, size: tuple[int, int]) -> tuple[int, int]:
    """The student's output size for input `size` (pose heatmaps: 1/4)."""
    if task == "pose":
        return size[0] // processing.HEATMAP_DOWNSCALE, size[1] // processing.HEATMAP_DOWNSCALE
    return tuple(size)


# ----------------------------------------------------------------------------------------------------
# Losses: the student's output against the teacher's (both fp32 here)
# ----------------------------------------------------------------------------------------------------
def distill_loss(task: str, student, teacher, w: dict[str, float]) -> torch.Tensor:
    """The weighted sum of the task's terms (DEFAULT_WEIGHTS); a term of weight 0 is not computed."""
    return TASK_LOSSES[task](student, teacher, w)


def seg_distill_loss(student, teacher, w):
    logits, target = student.logits.float(), teacher.logits
    loss = logits.new_zeros(())
    if w["kl"]:
        t = w["temperature"]
        log_student = F.log_softmax(logits / t, 1)
        log_teacher = F.log_softmax(target / t, 1)
        # KL(teacher || student) summed over classes, mean over pixels, x T^2 (gradients of the same size at any T)
        kl = (log_teacher.exp() * (log_teacher - log_student)).sum(1).mean()
        loss = loss + w["kl"] * t * t * kl
    if w["ce"]:
        loss = loss + w["ce"] * F.cross_entropy(logits, target.argmax(1))
    return loss


def pose_distill_loss(student, teacher, w):
    return keypoint_mse_loss(student.heatmaps, teacher, loss_weight=w["mse"])


def normal_distill_loss(student, teacher, w):
    pred, target = student.normals.float(), teacher.normals
    every = torch.ones_like(pred[:, :1])
    cosine = (F.normalize(pred, dim=1, eps=1e-6) * target).sum(1, keepdim=True)
    loss = (w["cosine"] * masked_pixel_mean(1 - cosine, every)
            + w["l1"] * masked_pixel_mean((pred - target).abs(), every))
    if w["gradient"]:
        loss = loss + w["gradient"] * sum(gradient_l2(pred, target, every))
    return loss


def pointmap_distill_loss(student, teacher, w):
    pred, target = student.pointmaps.float(), teacher.pointmaps
    # the task's L1 on XYZ / the mean depth of the target (here the teacher's), per image
    depth = target[:, 2:3].abs().mean((2, 3), keepdim=True).clamp(min=1e-3)
    xyz = ((pred - target).abs() / depth).sum(1).mean()
    return w["l1"] * xyz + w["scale"] * (student.scales.float() - teacher.scales).abs().mean()


def matting_distill_loss(student, teacher, w):
    alpha = sum(term(student.alphas.float(), teacher.alphas) for term in MATTING_LOSSES)
    every = torch.ones_like(teacher.alphas)
    foreground = sum(term(student.foregrounds.float(), teacher.foregrounds, every) for term in MATTING_LOSSES)
    return w["alpha"] * alpha + w["foreground"] * foreground


def albedo_distill_loss(student, teacher, w):
    pred, target = student.albedo.float(), teacher.albedo
    every = torch.ones_like(pred[:, :1])
    chroma = lambda x: x / (x.sum(1, keepdim=True) + 1e-6)  # noqa: E731  (losses.albedo_loss's)
    return (w["l1"] * masked_pixel_mean((pred - target).abs(), every)
            + w["gradient"] * sum(gradient_l2(pred, target, every))
            + w["chroma"] * masked_pixel_mean((chroma(pred.clamp(0, 1)) - chroma(target)).abs(), every))


TASK_LOSSES = {"seg": seg_distill_loss, "pose": pose_distill_loss, "normal": normal_distill_loss,
               "pointmap": pointmap_distill_loss, "matting": matting_distill_loss, "albedo": albedo_distill_loss}


class Distiller:
    """What train.py holds for a --teacher run: the teacher, the loss weights, and the student's loss of a batch."""

    def __init__(self, teacher: Teacher, task: str, loss_weights: dict[str, float]):
        self.teacher, self.task, self.weights = teacher, task, loss_weights

    def teacher_outputs(self, pixel_values: torch.Tensor):
        return self.teacher.outputs(pixel_values, output_size(self.task, tuple(pixel_values.shape[-2:])))

    def loss(self, model, pixel_values: torch.Tensor) -> torch.Tensor:
        """The student's distillation loss on these (augmented) pixels: the teacher runs first, on the same ones."""
        target = self.teacher_outputs(pixel_values)
        student = model(pixel_values)
        return distill_loss(self.task, student, target, self.weights)
