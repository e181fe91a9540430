"""Pose's validation metrics: the original's evaluation (Keypoints308Evaluator, facebookresearch/sapiens2
sapiens/pose/src/evaluators/keypoints308_evaluator.py, with the defaults every released config keeps) on the heatmaps
of the flip test: each person's keypoints in its image, its score, OKS NMS per image, then COCO's keypoint AP/AR
(pycocotools' COCOeval, iouType "keypoints"); PCK after them, as the original's keypoint_pck_accuracy averages it
(docs/training.md#metrics-on-val). The dense tasks' metrics: dense_metrics.py."""

from __future__ import annotations

import torch

from sapiens2 import processing

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
    person and zero on the others, so that one all_reduce of `sums` gathers them (dense_metrics.Metric's
    interface)."""

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
        predicted = torch.stack([processing.apply_affine(m, p * scale)
                                 for m, p in zip(batch["to_source"], locations.cpu())])
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
