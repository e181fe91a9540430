"""Validation metrics of the six tasks: each task's sums over a validation set in one float64 vector (processes add
theirs with one all_reduce), then the numbers (PCK and OKS AP, mIoU and pixel accuracy, angular errors, AbsRel and
delta, SAD and MSE, PSNR)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import processing
from sapiens2_app.augmentation import apply_affine
from sapiens2_app.dataset_files import IGNORE

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
