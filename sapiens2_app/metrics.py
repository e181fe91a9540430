"""Validation metrics of the six tasks: each task's sums over a validation set in one float64 vector (processes add
theirs with one all_reduce), then the numbers (PCK and OKS AP for pose; for the dense tasks the original evaluators'
metrics, with their names and in their order: facebookresearch/sapiens2 sapiens/dense/src/evaluators/ and the later
upstream matting evaluator, docs/training.md#metrics-on-val; extra metrics after them)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

import processing
from sapiens2_app.pose_augmentation import apply_affine
from sapiens2_app.dataset_files import IGNORE

# The original NormalEvaluator's and PointmapEvaluator's defaults (what every released config uses).
ANGLE_THRESHOLDS = (5.0, 11.25, 22.5, 30.0)  # degrees: within_5_0_deg ... within_30_0_deg
DISTANCE_THRESHOLDS = (0.05, 0.10, 0.20)  # canonical-camera metres: within_05_cm, within_10_cm, within_20_cm
ANGLE_BIN = 0.5  # degrees: the median angular error is the centre of the 0.5-degree bin holding the middle pixel
ANGLE_BINS = 360  # up to 180 degrees
NORMAL_SUMS = 3 + len(ANGLE_THRESHOLDS) + ANGLE_BINS  # sum angle, sum angle^2, pixels, counts below, histogram
POINTMAP_SUMS = 8 + len(DISTANCE_THRESHOLDS) + len(ANGLE_THRESHOLDS)  # the original's vector


# ----------------------------------------------------------------------------------------------------
# Pose: the original's evaluation (Keypoints308Evaluator, facebookresearch/sapiens2
# sapiens/pose/src/evaluators/keypoints308_evaluator.py, with the defaults every released config keeps) on the
# heatmaps of the flip test: each person's keypoints in its image, its score, OKS NMS per image, then COCO's
# keypoint AP/AR (pycocotools' COCOeval, iouType "keypoints"); PCK after them, as the original's
# keypoint_pck_accuracy averages it.
# ----------------------------------------------------------------------------------------------------
COCO_KEYPOINT_STATS = ("AP", "AP .5", "AP .75", "AP (M)", "AP (L)", "AR", "AR .5", "AR .75", "AR (M)", "AR (L)")


def coco_linspace(start: float, stop: float, count: int) -> torch.Tensor:
    """np.linspace's values to the last bit (i * step + start, the last one `stop`): COCOeval compares recalls
    with its recall points exactly (searchsorted), so they must be the same numbers."""
    values = torch.arange(count, dtype=torch.float64) * ((stop - start) / (count - 1)) + start
    values[-1] = stop
    return values


OKS_THRESHOLDS = coco_linspace(0.5, 0.95, 10)  # COCOeval's iouThrs: .50:.05:.95
RECALL_POINTS = coco_linspace(0.0, 1.0, 101)  # COCOeval's recThrs: 101-point interpolation
AREA_RANGES = ((0.0, 1e10), (32.0**2, 96.0**2), (96.0**2, 1e10))  # COCOeval's keypoint areaRng: all, medium, large
MAX_DETECTIONS = 20  # COCOeval's keypoint maxDets, per image
KEYPOINT_SCORE_THRESHOLD = 0.2  # Keypoints308Evaluator keypoint_score_thr: keypoints that count in a person's score
OKS_NMS_THRESHOLD = 0.9  # Keypoints308Evaluator nms_thr
PCK_THRESHOLD = 0.05
EPS = 2.220446049250313e-16  # np.spacing(1), as COCOeval and oks_iou add it to the area


class PoseEvaluation:
    """The pose validation metrics over a set of people: the original's COCO keypoint AP/AR names and values first
    (when the keypoint set has OKS sigmas: its annotations' or its official table's), then pck@0.05.

    One row per person (x, y and score of each keypoint, in its image), filled by the process that evaluates the
    person and zero on the others, so that one all_reduce of `sums` gathers them (Metric's interface)."""

    def __init__(self, info: dict, people: list[dict]):
        """people: PoseDataset.people (file, bbox xywh, keypoints (K, 3), area)."""
        self.info, self.people = info, people
        self.sums = torch.zeros(len(people), len(info["keypoint_names"]), 3, dtype=torch.float64)

    def update(self, heatmaps: torch.Tensor, batch: dict, valid: torch.Tensor, indices):
        """heatmaps: (B, K, h, w) of the crops (the flip test's mean); indices: which person each row is."""
        heatmaps = heatmaps.float()
        locations, scores = processing.decode_heatmaps(heatmaps)
        size = batch["pixel_values"].shape[-2:]
        scale = torch.tensor([(size[1] - 1) / (heatmaps.shape[-1] - 1), (size[0] - 1) / (heatmaps.shape[-2] - 1)])
        predicted = torch.stack([apply_affine(m, p * scale) for m, p in zip(batch["to_source"], locations.cpu())])
        rows = torch.cat([predicted, scores.cpu()[..., None]], -1).double()  # (B, K, 3)
        for row, index in zip(rows[valid.bool()], torch.as_tensor(indices)[valid.bool()]):
            self.sums[index] = row

    def result(self) -> dict:
        keypoints, keypoint_scores = self.sums[..., :2], self.sums[..., 2]
        truth = torch.stack([person["keypoints"] for person in self.people]).double()  # (N, K, 3)
        boxes = torch.tensor([person["bbox"] for person in self.people], dtype=torch.float64)  # (N, 4) xywh
        out = {}
        if self.info.get("sigmas") is not None:
            files = {file: i for i, file in enumerate(sorted({str(person["file"]) for person in self.people}))}
            image = torch.tensor([files[str(person["file"])] for person in self.people])
            areas = torch.tensor([person["area"] for person in self.people], dtype=torch.float64)
            sigmas = torch.tensor(self.info["sigmas"], dtype=torch.float64)
            out.update(original_keypoint_stats(image, keypoints, keypoint_scores, truth, boxes, areas, sigmas))
        # PCK normalised by the box as mmpose's PCKAccuracy(norm_item="bbox"): its longer side, for x and y
        norm = boxes[:, 2:].amax(-1, keepdim=True).expand(-1, 2)
        out["pck@0.05"] = keypoint_pck_accuracy(keypoints, truth[..., :2], truth[..., 2] > 0, PCK_THRESHOLD, norm)[1]
        return out


def original_keypoint_stats(image, keypoints, keypoint_scores, truth, boxes, areas, sigmas) -> dict:
    """Keypoints308Evaluator.evaluate for top-down predictions on the ground-truth boxes (box score 1): a person's
    score is the mean of its keypoint scores above 0.2 (score_mode "bbox_keypoint"), OKS NMS at 0.9 per image, then
    COCOeval. image (N,) ids; keypoints (N, K, 2) predicted; keypoint_scores (N, K); truth (N, K, 3); boxes (N, 4)
    xywh; areas (N,) of the ground truth."""
    scores = person_scores(keypoint_scores)
    extent = keypoint_extent_area(keypoints)
    keep = torch.cat([people[oks_nms(keypoints[people], scores[people], extent[people], sigmas, OKS_NMS_THRESHOLD)]
                      for people in (torch.nonzero(image == i)[:, 0] for i in image.unique())])
    return coco_keypoint_stats(image, truth, boxes, areas, image[keep], keypoints[keep], scores[keep], sigmas)


def person_scores(keypoint_scores: torch.Tensor) -> torch.Tensor:
    """(N, K) -> (N,): the mean of the keypoint scores above KEYPOINT_SCORE_THRESHOLD (0 when none is)."""
    counted = keypoint_scores > KEYPOINT_SCORE_THRESHOLD
    return torch.where(counted, keypoint_scores, 0).sum(-1) / counted.sum(-1).clamp(min=1)


def keypoint_extent_area(keypoints: torch.Tensor) -> torch.Tensor:
    """(N, K, 2) -> (N,): the area of the box around all keypoints (the evaluator's instance area, COCO's loadRes
    area of a keypoint result)."""
    size = keypoints.amax(-2) - keypoints.amin(-2)
    return size[..., 0] * size[..., 1]


def oks_nms(keypoints, scores, areas, sigmas, threshold: float) -> torch.Tensor:
    """Indices kept by the original's oks_nms: by descending score (ties: first first), drop the people whose OKS
    with a kept one exceeds `threshold` (the OKS of oks_iou: mean over all keypoints, areas averaged)."""
    order, keep = torch.sort(scores, descending=True, stable=True).indices, []
    variances = (2 * sigmas) ** 2
    while len(order):
        first, rest = order[0], order[1:]
        keep.append(int(first))
        squared = ((keypoints[rest] - keypoints[first]) ** 2).sum(-1)  # (R, K)
        e = squared / variances / ((areas[first] + areas[rest])[:, None] / 2 + EPS) / 2
        order = rest[torch.exp(-e).mean(-1) <= threshold]
    return torch.tensor(keep, dtype=torch.long)


def oks_matrix(keypoints, truth, boxes, areas, sigmas) -> torch.Tensor:
    """COCOeval.computeOks: (D, K, 2) predictions x (G, K, 3) ground truth -> (D, G) OKS over the visible truth
    keypoints; for a truth without visible keypoints, the distance to its box enlarged 3x (over every keypoint)."""
    visible = truth[..., 2] > 0  # (G, K)
    delta = keypoints[:, None] - truth[None, ..., :2]  # (D, G, K, 2)
    low = (boxes[:, :2] - boxes[:, 2:])[None, :, None]  # (1, G, 1, 2): x0 = x - w, y0 = y - h
    high = (boxes[:, :2] + 2 * boxes[:, 2:])[None, :, None]  # x1 = x + 2w, y1 = y + 2h
    outside = (low - keypoints[:, None]).clamp(min=0) + (keypoints[:, None] - high).clamp(min=0)
    any_visible = visible.any(-1)[None, :, None, None]
    squared = torch.where(any_visible, delta, outside).pow(2).sum(-1)  # (D, G, K)
    e = squared / ((2 * sigmas) ** 2) / (areas[None, :, None] + EPS) / 2
    counted = torch.where(visible.any(-1, keepdim=True), visible, True)[None]  # (1, G, K)
    return (torch.exp(-e) * counted).sum(-1) / counted.sum(-1)


def match_image(oks: torch.Tensor, truth_ignored: torch.Tensor, outside: torch.Tensor):
    """COCOeval.evaluateImg's greedy matching, per OKS threshold: predictions by descending score take the
    best-OKS free truth (the non-ignored truths first). oks (D, G); truth_ignored (G,); outside (D,) predictions
    outside the area range. -> matched, ignored: (T, D) bools (a prediction matched to an ignored truth, or
    unmatched and outside the range, is ignored)."""
    order = torch.sort(truth_ignored.int(), stable=True).indices
    rows, ignored_truth = oks[:, order].tolist(), truth_ignored[order].tolist()
    matched = torch.zeros(len(OKS_THRESHOLDS), len(rows), dtype=torch.bool)
    ignored = torch.zeros_like(matched)
    for t, threshold in enumerate(OKS_THRESHOLDS.tolist()):
        taken = [False] * len(ignored_truth)
        for d, row in enumerate(rows):
            best, match = min(threshold, 1 - 1e-10), -1
            for g, value in enumerate(row):
                if taken[g]:
                    continue
                if match > -1 and not ignored_truth[match] and ignored_truth[g]:
                    break  # matched a real truth; only ignored ones are left
                if value < best:
                    continue
                best, match = value, g
            if match > -1:
                matched[t, d], ignored[t, d], taken[match] = True, ignored_truth[match], True
    return matched, ignored | (~matched & outside[None])


def precision_recall(scores, matched, ignored, truths: int):
    """COCOeval.accumulate for one area range: (T, R) interpolated precision at RECALL_POINTS and (T,) recall of
    the predictions of all images ranked by score; None when no truth counts (COCO's -1)."""
    if truths == 0:
        return None
    order = torch.sort(scores, descending=True, stable=True).indices
    matched, ignored = matched[:, order], ignored[:, order]
    tp = (matched & ~ignored).double().cumsum(1)  # (T, D)
    fp = (~matched & ~ignored).double().cumsum(1)
    if tp.shape[1] == 0:  # no prediction: precision and recall 0
        return torch.zeros(len(tp), len(RECALL_POINTS), dtype=torch.float64), torch.zeros(len(tp), dtype=torch.float64)
    recall = tp / truths
    precision = (tp / (fp + tp + EPS)).flip(1).cummax(1).values.flip(1)  # the envelope: max precision to the right
    at = torch.searchsorted(recall.contiguous(), RECALL_POINTS.expand(len(recall), -1).contiguous(), side="left")
    interpolated = torch.where(at < recall.shape[1], precision.gather(1, at.clamp(max=recall.shape[1] - 1)), 0.0)
    return interpolated, recall[:, -1]


def coco_keypoint_stats(truth_image, truth, boxes, areas, image, keypoints, scores, sigmas) -> dict:
    """COCOeval (iouType "keypoints") of predictions against ground truth, its ten summary numbers by the original's
    names. truth_image (G,), truth (G, K, 3), boxes (G, 4) xywh, areas (G,); image (D,), keypoints (D, K, 2), scores
    (D,). A truth without visible keypoints is ignored (COCO's num_keypoints == 0); no crowd regions."""
    per_range = [[] for _ in AREA_RANGES]  # per image: scores, matched, ignored, truths that count
    for i in sorted(set(truth_image.tolist()) | set(image.tolist())):
        g = torch.nonzero(truth_image == i)[:, 0]
        d = torch.nonzero(image == i)[:, 0]
        d = d[torch.sort(scores[d], descending=True, stable=True).indices][:MAX_DETECTIONS]
        oks = oks_matrix(keypoints[d], truth[g], boxes[g], areas[g], sigmas)
        no_keypoints = ~(truth[g][..., 2] > 0).any(-1)
        extent = keypoint_extent_area(keypoints[d])
        for r, (low, high) in enumerate(AREA_RANGES):
            truth_ignored = no_keypoints | (areas[g] < low) | (areas[g] > high)
            matched, ignored = match_image(oks, truth_ignored, (extent < low) | (extent > high))
            per_range[r].append((scores[d], matched, ignored, int((~truth_ignored).sum())))
    curves = [precision_recall(torch.cat([s for s, *_ in images]), torch.cat([m for _, m, _, _ in images], 1),
                               torch.cat([ig for _, _, ig, _ in images], 1), sum(n for *_, n in images))
              for images in per_range]

    def mean(curve, which: int, threshold=None) -> float:  # COCOeval.summarize: -1 when nothing counts
        if curve is None:
            return -1.0
        values = curve[which] if threshold is None else curve[which][threshold]
        return values.mean().item()

    everything, medium, large = curves
    stats = [mean(everything, 0), mean(everything, 0, 0), mean(everything, 0, 5), mean(medium, 0), mean(large, 0),
             mean(everything, 1), mean(everything, 1, 0), mean(everything, 1, 5), mean(medium, 1), mean(large, 1)]
    return dict(zip(COCO_KEYPOINT_STATS, stats))


def keypoint_pck_accuracy(predicted, truth, visible, threshold: float, norm):
    """The original's keypoint_pck_accuracy (keypoints308_evaluator.py, with _calc_distances and _distance_acc):
    per keypoint, the share of its visible instances whose distance, divided per axis by `norm`, is below
    `threshold`; then the mean over the keypoints that have any. predicted, truth (N, K, 2); visible (N, K);
    norm (N, 2). -> (per-keypoint accuracy (K,), -1 where none is visible; the mean; how many keypoints count)."""
    counted = visible & ~(norm == 0).any(-1, keepdim=True)  # a person with a zero norm factor does not count
    norm = torch.where(norm > 0, norm, 1e6)
    distance = ((predicted - truth) / norm[:, None]).norm(dim=-1)  # (N, K)
    valid = counted.sum(0)
    correct = ((distance < threshold) & counted).sum(0)
    accuracy = torch.where(valid > 0, correct.double() / valid.clamp(min=1), -1.0)
    counting = accuracy[accuracy >= 0]
    return accuracy, counting.mean().item() if len(counting) else 0.0, len(counting)


class Metric:
    """A dense task's metrics (pose: PoseEvaluation): per-batch sums in one float64 vector (so processes add theirs
    with one all_reduce)."""

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


# Which metric says "better" for the log summary (and the tests): name -> +1 higher is better, -1 lower.
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
