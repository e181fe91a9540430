"""The dense tasks' validation metrics: each task's sums over a validation set in one float64 vector (processes add
theirs with one all_reduce), then the original evaluators' metrics, with their names and in their order
(facebookresearch/sapiens2 sapiens/dense/src/evaluators/ and the later upstream matting evaluator,
docs/training.md#metrics-on-val); extra metrics after them. Pose's metrics: pose_metrics.py."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from sapiens2_app.train.dataset_files import IGNORE

# The original NormalEvaluator's and PointmapEvaluator's defaults (what every released config uses).
ANGLE_THRESHOLDS = (5.0, 11.25, 22.5, 30.0)  # degrees: within_5_0_deg ... within_30_0_deg
DISTANCE_THRESHOLDS = (0.05, 0.10, 0.20)  # canonical-camera metres: within_05_cm, within_10_cm, within_20_cm
ANGLE_BIN = 0.5  # degrees: the median angular error is the centre of the 0.5-degree bin holding the middle pixel
ANGLE_BINS = 360  # up to 180 degrees
NORMAL_SUMS = 3 + len(ANGLE_THRESHOLDS) + ANGLE_BINS  # sum angle, sum angle^2, pixels, counts below, histogram
POINTMAP_SUMS = 8 + len(DISTANCE_THRESHOLDS) + len(ANGLE_THRESHOLDS)  # the original's vector


class Metric:
    """A dense task's metrics (pose: pose_metrics.PoseEvaluation): per-batch sums in one float64 vector (so processes
    add theirs with one all_reduce)."""

    def __init__(self, task: str, info: dict):
        self.task, self.info = task, info
        size = {"seg": info["out_channels"] ** 2, "normal": NORMAL_SUMS,
                "pointmap": POINTMAP_SUMS + 3, "matting": 4 + 3, "albedo": 7}[task]
        self.sums = torch.zeros(size, dtype=torch.float64)

    def update(self, output, batch: dict, valid: torch.Tensor):
        """valid: (B,) which rows count (padding rows of an uneven last batch do not)."""
        getattr(self, f"update_{self.task}")(output, batch, valid.bool())

    def update_seg(self, output, batch, valid):
        classes = self.info["out_channels"]
        predicted = output.logits.argmax(1).cpu()
        labels = batch["labels"]
        keep = (labels != IGNORE) & valid[:, None, None]
        pairs = labels[keep] * classes + predicted[keep]
        self.sums += torch.bincount(pairs, minlength=classes * classes).double()

    def update_normal(self, output, batch, valid):
        """The original NormalEvaluator.process: the angle between the unit vectors of every valid pixel (pooled
        over the set), its square, the counts below each threshold and a 0.5-degree histogram (for the median)."""
        angle = angle_degrees(unit_vectors(output.normals.float().cpu()), unit_vectors(batch["labels"].float()))
        angle = angle[(batch["mask"][:, 0] > 0) & valid[:, None, None]]
        self.sums += angle_sums(angle)

    def update_pointmap(self, output, batch, valid):
        """The original PointmapEvaluator.process, on canonical XYZ (the model's output and the canonical target;
        no scale or alignment): per valid pixel the L2 distance, the per-axis errors, and the angle between the
        normals of the two maps (5x5 Sobel, as cv2, over the whole map); then depth AbsRel and delta < 1.25 in
        metric units (Z / scale) as extras."""
        predicted, truth = output.pointmaps.float().cpu(), batch["labels"].float()
        keep = (batch["mask"][:, 0] > 0) & valid[:, None, None]  # (B, H, W)
        error = (predicted - truth).movedim(1, -1)[keep]  # (N, 3)
        angle = angle_degrees(sobel_normals(predicted), sobel_normals(truth))[keep]
        self.sums[:POINTMAP_SUMS] += pointmap_sums(error, angle)
        depth = predicted[:, 2] / output.scales.float().cpu().view(-1, 1, 1)  # metric depth: canonical / scale
        true_depth = truth[:, 2] / batch["scales"].view(-1, 1, 1)
        metric_keep = keep & (true_depth > 0)
        depth, true_depth = depth[metric_keep].double(), true_depth[metric_keep].double()
        ratio = torch.maximum(depth / true_depth, true_depth / depth.clamp(min=1e-9))
        self.sums[POINTMAP_SUMS:] += torch.stack([((depth - true_depth).abs() / true_depth).sum(),
                                                  (ratio < 1.25).sum().double(), count(depth)])

    def update_matting(self, output, batch, valid):
        """The upstream MattingEvaluator.process: alpha L1 over every pixel; foreground L1 (mean over RGB per
        pixel) over every pixel of the samples that have a ground-truth foreground; then SAD (per image, in
        thousands) and MSE of alpha as extras."""
        error = (output.alphas.float().cpu() - batch["labels"].float())[valid].double()  # (n, 1, H, W)
        self.sums[0] += error.abs().sum()
        self.sums[1] += error.numel()
        foreground = batch.get("has_foreground")
        if foreground is not None:
            rows = valid & foreground.bool()
            l1 = (output.foregrounds.float().cpu() - batch["foregrounds"].float())[rows].abs().mean(1)
            self.sums[2] += l1.double().sum()
            self.sums[3] += l1.numel()
        self.sums[4] += error.abs().sum() / 1000
        self.sums[5] += error.square().sum()
        self.sums[6] += valid.sum()

    def update_albedo(self, output, batch, valid):
        """The original AlbedoEvaluator.process on the raw (unclamped) prediction: per valid pixel the absolute and
        squared errors averaged over RGB, the L1 of forward differences over pairs of valid pixels, and the masked
        SSIM (11x11 Gaussian window, sigma 1.5) over windows at least half inside the mask."""
        predicted, truth = output.albedo.float().cpu(), batch["labels"].float()
        mask = (batch["mask"][:, 0] > 0) & valid[:, None, None]  # (B, H, W)
        error = predicted - truth
        grad_sum, grad_count = 0.0, 0.0
        for dim in (-1, -2):  # horizontal, vertical pairs
            n = predicted.shape[dim]
            pair = mask.narrow(dim, 1, n - 1) & mask.narrow(dim, 0, n - 1)
            step = (error.narrow(dim, 1, n - 1) - error.narrow(dim, 0, n - 1)).abs().mean(1)
            grad_sum, grad_count = grad_sum + step[pair].double().sum(), grad_count + pair.sum()
        ssim_sum, ssim_count = masked_ssim_sums(predicted, truth, mask)
        per_pixel = lambda x: x.mean(1)[mask].double().sum()  # noqa: E731  (mean over RGB, summed over pixels)
        self.sums += torch.stack([per_pixel(error.abs()), per_pixel(error.square()), mask.sum().double(),
                                  torch.as_tensor(grad_sum, dtype=torch.float64),
                                  torch.as_tensor(grad_count, dtype=torch.float64), ssim_sum, ssim_count])

    def result(self) -> dict:
        s = self.sums
        if self.task == "seg":
            return seg_metrics(s.view(self.info["out_channels"], -1))
        return {"normal": normal_metrics, "pointmap": pointmap_metrics, "matting": matting_metrics,
                "albedo": albedo_metrics}[self.task](s)


# Which metric says "better", per task (the tests' check that training improves it): name -> +1 higher is better,
# -1 lower.
MAIN_METRIC = {"pose": ("pck@0.05", 1), "seg": ("mIoU", 1), "normal": ("normal_mae", -1),
               "pointmap": ("l2_mean", -1), "matting": ("l1_alpha", -1), "albedo": ("psnr", 1)}


def dense_metric_names(task: str) -> list[str]:
    """The names a dense task's evaluation logs, in order (read off the functions below, on empty sums; matting's
    l1_foreground appears only when some validation matte has a foreground)."""
    metric = Metric(task, {"out_channels": 1})
    if task == "matting":
        metric.sums[3] = 1
    return list(metric.result())


# ----------------------------------------------------------------------------------------------------
# The dense tasks' numbers, as the original evaluators compute them from the same sums
# ----------------------------------------------------------------------------------------------------
def seg_metrics(confusion: torch.Tensor) -> dict:
    """The original SegEvaluator (iou_metrics ["mIoU"], nan_to_num=0 as every seg config sets it): intersection,
    union and label areas summed over the whole set, then per class; a class absent from both the labels and the
    predictions counts as IoU 0 (and one absent from the labels as accuracy 0) in the mean over ALL classes. In
    percent, rounded to 2 decimals as the original reports them. confusion: (C, C), rows = label, columns =
    prediction."""
    intersect, label, predicted = confusion.diag(), confusion.sum(1), confusion.sum(0)
    union = predicted + label - intersect
    ratio = lambda a, b: torch.nan_to_num(a / b, nan=0.0)  # noqa: E731  (0 / 0: an absent class)
    percent = lambda x: round(float(x) * 100, 2)  # noqa: E731
    return {"aAcc": percent(ratio(intersect.sum(), label.sum())), "mIoU": percent(ratio(intersect, union).mean()),
            "mAcc": percent(ratio(intersect, label).mean())}


def unit_vectors(x: torch.Tensor) -> torch.Tensor:
    """(B, 3, H, W) divided by its length (at least 1e-6), as the original NormalEvaluator."""
    return x / x.norm(dim=1, keepdim=True).clamp_min(1e-6)


def angle_degrees(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(B, 3, H, W) x2 unit vectors -> (B, H, W) angle in degrees (the cosine clamped to [-1, 1])."""
    return torch.acos((a * b).sum(1).clamp(-1.0, 1.0)) * (180.0 / math.pi)


def angle_sums(angle: torch.Tensor) -> torch.Tensor:
    """The NormalEvaluator's vector for the angles of some pixels: sum, sum of squares, count, the counts below
    each threshold, the histogram of 0.5-degree bins (the last bin takes 180)."""
    bins = torch.floor(angle / ANGLE_BIN).long().clamp(0, ANGLE_BINS - 1)
    angle = angle.double()
    return torch.cat([torch.stack([angle.sum(), angle.square().sum(), count(angle)]),
                      torch.stack([(angle < t).sum() for t in ANGLE_THRESHOLDS]).double(),
                      torch.bincount(bins, minlength=ANGLE_BINS).double()])


def count(x: torch.Tensor) -> torch.Tensor:
    return torch.tensor(float(x.numel()), dtype=torch.float64)


def pointmap_sums(error: torch.Tensor, angle: torch.Tensor) -> torch.Tensor:
    """The PointmapEvaluator's vector for some pixels: error (N, 3) predicted - true XYZ, angle (N,) between their
    normals -> sums of the distance, |x|, |y|, |z|, distance^2, angle, angle^2, the count, the counts under each
    distance and each angle threshold."""
    distance = error.norm(dim=-1)
    distance64, angle64 = distance.double(), angle.double()
    return torch.cat([torch.stack([distance64.sum(), *error.abs().double().sum(0), distance64.square().sum(),
                                   angle64.sum(), angle64.square().sum(), count(distance)]),
                      torch.stack([(distance < t).sum() for t in DISTANCE_THRESHOLDS]).double(),
                      torch.stack([(angle < t).sum() for t in ANGLE_THRESHOLDS]).double()])


def normal_metrics(s: torch.Tensor) -> dict:
    """The original NormalEvaluator.evaluate: mean, median (centre of the histogram bin where the cumulative count
    reaches half the pixels) and RMS angular error in degrees, and the % of pixels under each threshold."""
    n = s[2].clamp(min=1)
    thresholds = len(ANGLE_THRESHOLDS)
    cumulative = s[3 + thresholds:].cumsum(0)
    median_bin = min(int(torch.searchsorted(cumulative, 0.5 * s[2])), ANGLE_BINS - 1)
    out = {"normal_mae": (s[0] / n).item(), "normal_median_deg": (median_bin + 0.5) * ANGLE_BIN,
           "normal_rmse": (s[1] / n).sqrt().item()}
    out.update({f"within_{str(t).replace('.', '_')}_deg": (s[3 + i] / n * 100).item()
                for i, t in enumerate(ANGLE_THRESHOLDS)})
    return out


def sobel_normals(points: torch.Tensor) -> torch.Tensor:
    """(B, 3, H, W) pointmap -> (B, 3, H, W) normals as the original PointmapEvaluator computes them: the cross
    product of cv2.Sobel(ksize=5)'s derivatives along x and y, divided by its length + 1e-6. cv2's default border
    (BORDER_REFLECT_101) mirrors without repeating the edge: F.pad "reflect".
    NOTE: separable, the derivative as differences (2 (p[+1] - p[-1]) + p[+2] - p[-2]), as cv2 computes it: on the
    border rows and columns the mirrored differences are then exactly 0, so is the normal there (a 5x5 convolution
    leaves rounding noise that the division by |n| + 1e-6 blows up into an arbitrary direction)."""
    padded = F.pad(points, (2, 2, 2, 2), mode="reflect")  # (B, 3, H + 4, W + 4)

    def taps(x, dim):  # the 5 shifted views along dim, each of the output's length there
        return [x.narrow(dim, offset, x.shape[dim] - 4) for offset in range(5)]

    def derivative(x, dim):  # [-1, -2, 0, 2, 1]
        a = taps(x, dim)
        return 2 * (a[3] - a[1]) + (a[4] - a[0])

    def smooth(x, dim):  # [1, 4, 6, 4, 1]
        a = taps(x, dim)
        return a[0] + 4 * a[1] + 6 * a[2] + 4 * a[3] + a[4]

    along_x, along_y = smooth(derivative(padded, -1), -2), smooth(derivative(padded, -2), -1)  # (B, 3, H, W)
    normal = torch.cross(along_x, along_y, dim=1)
    return normal / (normal.norm(dim=1, keepdim=True) + 1e-6)


def pointmap_metrics(s: torch.Tensor) -> dict:
    """The original PointmapEvaluator.evaluate (canonical units: metres in the canonical camera; shares in [0, 1]),
    then depth AbsRel and delta < 1.25 (metric depth, Z / scale) as extras."""
    n = s[7].clamp(min=1)
    out = {"l2_mean": s[0] / n, "x_mae": s[1] / n, "y_mae": s[2] / n, "z_mae": s[3] / n, "rmse": (s[4] / n).sqrt(),
           "normal_mae": s[5] / n, "normal_rmse": (s[6] / n).sqrt()}
    out.update({f"within_{int(t * 100):02d}_cm": s[8 + i] / n for i, t in enumerate(DISTANCE_THRESHOLDS)})
    first = 8 + len(DISTANCE_THRESHOLDS)
    out.update({f"within_{str(t).replace('.', '_')}_deg": s[first + i] / n for i, t in enumerate(ANGLE_THRESHOLDS)})
    depth_pixels = s[POINTMAP_SUMS + 2].clamp(min=1)
    out.update({"abs_rel": s[POINTMAP_SUMS] / depth_pixels, "delta1.25": s[POINTMAP_SUMS + 1] / depth_pixels})
    return {k: v.item() for k, v in out.items()}


def masked_ssim_sums(x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor, data_range: float = 1.0):
    """The original AlbedoEvaluator._masked_ssim_sum over a batch: SSIM with an 11x11 Gaussian window (sigma 1.5)
    whose statistics are weighted by the mask, averaged over RGB; (its sum over the windows at least half inside
    the mask, their count). x, y: (B, 3, H, W); mask: (B, H, W) bool. data_range 1: train.py's albedo targets are
    PNG / 255 (the original picks 255 only for targets above 1.5)."""
    eps, c1, c2 = 1e-8, (0.01 * data_range) ** 2, (0.03 * data_range) ** 2
    axis = torch.arange(11, dtype=x.dtype) - 5.0
    kernel = torch.exp(-(axis[None, :] ** 2 + axis[:, None] ** 2) / (2 * 1.5**2))
    kernel = (kernel / kernel.sum()).view(1, 1, 11, 11)
    channels = x.shape[1]
    m = mask[:, None].to(x.dtype)  # (B, 1, H, W)
    weight = F.conv2d(m, kernel, padding=5).clamp(min=eps)
    window = kernel.repeat(channels, 1, 1, 1)  # one per channel (grouped)
    local = lambda z: F.conv2d(z * m, window, padding=5, groups=channels) / weight  # noqa: E731  (masked mean)
    mu_x, mu_y = local(x), local(y)
    var_x, var_y, cov = local(x * x) - mu_x * mu_x, local(y * y) - mu_y * mu_y, local(x * y) - mu_x * mu_y
    ssim = ((2 * mu_x * mu_y + c1) * (2 * cov + c2) / ((mu_x * mu_x + mu_y * mu_y + c1) * (var_x + var_y + c2) + eps))
    windows = weight[:, 0] > 0.5  # (B, H, W)
    return ssim.mean(1)[windows].double().sum(), windows.sum().double()


def albedo_metrics(s: torch.Tensor) -> dict:
    """The original AlbedoEvaluator.evaluate: MAE and RMSE over the valid pixels of the whole set, PSNR of that
    pooled MSE (data range 1), SSIM and gradient L1 averaged over their windows and pixel pairs."""
    mse = (s[1] / s[2].clamp(min=1)).clamp_min(1e-12)
    return {"mae": (s[0] / s[2].clamp(min=1)).item(), "rmse": mse.sqrt().item(),
            "psnr": (10 * torch.log10(1 / mse)).item(),
            "ssim": (s[5] / s[6].clamp(min=1)).item(), "grad_l1": (s[3] / s[4].clamp(min=1)).item()}


def matting_metrics(s: torch.Tensor) -> dict:
    """The upstream MattingEvaluator.evaluate (l1_foreground only when some sample has a ground-truth foreground),
    then SAD (per image, in thousands) and alpha MSE as extras."""
    out = {"l1_alpha": (s[0] / s[1].clamp(min=1)).item()}
    if s[3] > 0:
        out["l1_foreground"] = (s[2] / s[3]).item()
    return {**out, "sad": (s[4] / s[6].clamp(min=1)).item(), "mse": (s[5] / s[1].clamp(min=1)).item()}
