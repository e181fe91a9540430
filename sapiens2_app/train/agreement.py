"""Validation of a distillation run: how well the student agrees with its teacher on val/, per task, under names
that say so (agree_*), beside the usual metrics when val/ has labels (dense_metrics.py, pose_metrics.py).

  seg       agree_mIoU (%), agree_pixels (%): the student's argmax against the teacher's, over every pixel; the
            mean IoU over the classes that either of them predicts
  pose      agree_distance_px: mean distance of the keypoints the teacher sees (its score >= VISIBLE_SCORE, the
            threshold at which predict.py's pseudo-labels call a keypoint visible), each person's in its image,
            pixels; agree_AP: COCO's OKS AP of the student's keypoints against the teacher's, the keypoints it does
            not see marked invisible (v = 0), as in its pseudo-labels
  normal    agree_angle_deg: mean angle between the unit normals
  pointmap  agree_depth_rel: mean |z_s - z_t| / z_t of the metric depths (Z / scale), where the teacher's z > 0
  matting   agree_alpha_L1: mean |alpha_s - alpha_t|
  albedo    agree_PSNR (dB): 10 log10(1 / MSE) of the albedo clamped to [0, 1], MSE pooled over the set

Sums go in one float64 tensor (processes add theirs with one all_reduce), as the other metrics.
"""

from __future__ import annotations

import math

import torch

from sapiens2 import processing
from sapiens2_app.train.dense_metrics import angle_degrees, unit_vectors
from sapiens2_app.train.pose_metrics import coco_keypoint_stats
from sapiens2_app.train.pseudo_labels import VISIBLE_SCORE

NAMES = {"seg": ("agree_mIoU", "agree_pixels"), "pose": ("agree_distance_px", "agree_AP"),
         "normal": ("agree_angle_deg",), "pointmap": ("agree_depth_rel",), "matting": ("agree_alpha_L1",),
         "albedo": ("agree_PSNR",)}


class Agreement:
    """update(student output, teacher output, batch, valid[, indices]) per batch; result() -> {name: value}."""

    def __init__(self, task: str, info: dict, people: list[dict] | None = None):
        self.task, self.info, self.people = task, info, people
        if task == "seg":
            self.sums = torch.zeros(info["out_channels"] ** 2, dtype=torch.float64)
        elif task == "pose":  # per person and keypoint: student x, y, teacher x, y, teacher score
            self.sums = torch.zeros(len(people), info["out_channels"], 5, dtype=torch.float64)
        else:
            self.sums = torch.zeros(2, dtype=torch.float64)  # sum of the per-pixel quantity, count

    def update(self, student, teacher, batch: dict, valid: torch.Tensor, indices=None):
        valid = valid.bool()
        if self.task == "seg":
            classes = self.info["out_channels"]
            pairs = teacher.logits.argmax(1).cpu()[valid] * classes + student.logits.argmax(1).cpu()[valid]
            self.sums += torch.bincount(pairs.flatten(), minlength=classes * classes).double()
        elif self.task == "pose":
            (student_xy, _), (teacher_xy, scores) = image_keypoints(student, batch), image_keypoints(teacher, batch)
            rows = torch.cat([student_xy, teacher_xy, scores[..., None]], -1)
            for row, index in zip(rows[valid], torch.as_tensor(indices)[valid]):
                self.sums[index] = row
        else:
            values = per_pixel(self.task, student, teacher)[valid]
            keep = torch.isfinite(values)
            self.sums += torch.stack([values[keep].sum(), keep.sum().double()])

    def result(self) -> dict:
        return {"seg": seg_agreement, "pose": self.pose_result}.get(self.task, self.mean_result)(self.sums)

    def mean_result(self, sums) -> dict:
        mean = (sums[0] / sums[1]).item() if sums[1] > 0 else float("nan")
        if self.task == "albedo":  # per_pixel gave the squared error
            mean = 10 * math.log10(1 / mean) if mean > 0 else float("inf")
        return {NAMES[self.task][0]: mean}

    def pose_result(self, sums) -> dict:
        # NOTE: a keypoint the teacher does not see has a flat heatmap, where the argmax is noise and DARK's Newton
        # step is ill-conditioned (processing.decode_heatmaps): its location can land tens of pixels off the map,
        # and a few such keypoints would decide the mean. They are left out, as the teacher's pseudo-labels leave
        # them out (v = 0).
        student, teacher, seen = sums[..., :2], sums[..., 2:4], sums[..., 4] >= VISIBLE_SCORE
        distance = (student - teacher).norm(dim=-1)[seen].mean().item() if seen.any() else float("nan")
        out = {"agree_distance_px": distance}
        if self.info.get("sigmas") is not None:
            out["agree_AP"] = pose_ap(student, teacher, seen, self.people, self.info["sigmas"])
        return out


def per_pixel(task: str, student, teacher) -> torch.Tensor:
    """(B, H, W) float64: the per-pixel quantity whose mean the task reports."""
    if task == "normal":
        return angle_degrees(unit_vectors(student.normals.float().cpu()), unit_vectors(teacher.normals.float().cpu()))
    if task == "pointmap":
        depth = student.pointmaps[:, 2].float().cpu() / student.scales.float().cpu().view(-1, 1, 1)
        true = teacher.pointmaps[:, 2].float().cpu() / teacher.scales.float().cpu().view(-1, 1, 1)
        return torch.where(true > 0, (depth - true).abs() / true, float("nan")).double()
    if task == "matting":
        return (student.alphas.float().cpu() - teacher.alphas.float().cpu())[:, 0].abs().double()
    # albedo: the squared error per pixel, mean over RGB (PSNR of the pooled MSE)
    error = student.albedo.float().cpu().clamp(0, 1) - teacher.albedo.float().cpu().clamp(0, 1)
    return error.double().square().mean(1)


def seg_agreement(confusion: torch.Tensor) -> dict:
    """confusion: flattened (C, C), rows = the teacher's class, columns = the student's."""
    classes = int(round(math.sqrt(len(confusion))))
    confusion = confusion.view(classes, classes)
    intersect, union = confusion.diag(), confusion.sum(0) + confusion.sum(1) - confusion.diag()
    seen = union > 0
    iou = (intersect[seen] / union[seen]).mean().item() if seen.any() else float("nan")
    return {"agree_mIoU": 100 * iou, "agree_pixels": 100 * (intersect.sum() / confusion.sum().clamp(min=1)).item()}


def image_keypoints(heatmaps: torch.Tensor, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, K, 2) the heatmaps' keypoints in each person's image (as pose_metrics.PoseEvaluation places them), and
    their (B, K) scores; float64."""
    heatmaps = heatmaps.float().cpu()
    locations, scores = processing.decode_heatmaps(heatmaps)
    size = batch["pixel_values"].shape[-2:]
    scale = torch.tensor([(size[1] - 1) / (heatmaps.shape[-1] - 1), (size[0] - 1) / (heatmaps.shape[-2] - 1)])
    to_photo = [processing.apply_affine(m, p * scale) for m, p in zip(batch["to_source"], locations)]
    return torch.stack(to_photo).double(), scores.double()


def pose_ap(student: torch.Tensor, teacher: torch.Tensor, seen: torch.Tensor, people: list[dict], sigmas) -> float:
    """COCO's keypoint AP (OKS .50:.95) of the student's people against the teacher's as ground truth (the keypoints
    it sees visible, v = 2, the others v = 0; the person's box and its area), one prediction per person, score 1."""
    count = len(people)
    files = {file: i for i, file in enumerate(sorted({str(person["file"]) for person in people}))}
    image = torch.tensor([files[str(person["file"])] for person in people])
    truth = torch.cat([teacher, 2 * seen[..., None].to(teacher.dtype)], -1)
    boxes = torch.tensor([person["bbox"] for person in people], dtype=torch.float64)
    areas = boxes[:, 2] * boxes[:, 3]
    stats = coco_keypoint_stats(image, truth, boxes, areas, image, student, torch.ones(count, dtype=torch.float64),
                                torch.tensor(sigmas, dtype=torch.float64))
    return stats["AP"]
