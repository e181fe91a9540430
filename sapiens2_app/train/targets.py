"""Training targets: UDP Gaussian heatmaps for pose (in network pixels, what the pose dataset trains with, and
from image boxes, as transformers' `generate_udp_gaussian_heatmaps`) and segmentation label maps as transformers'
`Sapiens2ImageProcessor` prepares them."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from sapiens2 import processing


# ----------------------------------------------------------------------------------------------------
# Pose: UDP Gaussian heatmaps
# ----------------------------------------------------------------------------------------------------
def heatmap_sigma(heatmap_size) -> float:
    """The original's sigma (6 heatmap pixels at 256x192) scaled with the heatmap width, at least 1."""
    return max(1.0, processing.HEATMAP_SIGMA * heatmap_size[1] / 192)


def udp_heatmaps(points, visible, size, heatmap_size, sigma: float = processing.HEATMAP_SIGMA):
    """Keypoints in network pixels -> UDP Gaussian heatmaps (K, h, w) and weights (K,), the rule of
    pose_heatmap_targets, and weight 0 for a keypoint outside the network input too."""
    height, width = heatmap_size
    extent = torch.tensor([(width - 1) / (size[1] - 1), (height - 1) / (size[0] - 1)])
    heatmaps, touches = gaussian_windows(points * extent, heatmap_size, sigma)
    inside = (points[:, 0] >= 0) & (points[:, 0] < size[1]) & (points[:, 1] >= 0) & (points[:, 1] < size[0])
    weights = (visible & touches & inside).float()
    return heatmaps * weights[:, None, None], weights


def pose_heatmap_targets(boxes, keypoints, size: tuple[int, int] = processing.MODEL_SIZE,
                         downscale: int = processing.HEATMAP_DOWNSCALE, sigma: float = processing.HEATMAP_SIGMA,
                         device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """UDP Gaussian heatmaps for training, one row per person (HF `generate_udp_gaussian_heatmaps`).

    boxes: per image, a list of COCO xywh boxes. keypoints: per image, per person, `(K, 3)` `[x, y, visibility]`
    in image pixels (or `(K, 2)`: all visible). Returns heatmaps `(N, K, H/downscale, W/downscale)` and weights
    `(N, K)`: 1 for a visible keypoint whose 3-sigma window touches the heatmap, else 0 (its map is all zero).
    """
    flat_boxes = [box for image_boxes in boxes for box in image_boxes]
    flat_keypoints = [person for image_keypoints in keypoints for person in image_keypoints]
    if len(flat_boxes) != len(flat_keypoints):
        raise ValueError(f"got {len(flat_boxes)} boxes but keypoints for {len(flat_keypoints)} people")
    height, width = size[0] // downscale, size[1] // downscale
    boxes_xywh = torch.tensor(flat_boxes, dtype=torch.float32, device=device).reshape(-1, 4)
    centers, crops = processing.crop_geometry(boxes_xywh, size)
    people = torch.tensor(np.asarray(flat_keypoints, dtype=np.float32), device=device)  # (N, K, 2 or 3)
    visible = people[..., 2] > 0 if people.shape[-1] > 2 else torch.ones(people.shape[:2], dtype=torch.bool,
                                                                              device=device)
    heatmap_extent = torch.tensor([width - 1, height - 1], dtype=torch.float32, device=device)
    # image pixels -> heatmap pixels, the inverse of the decoder's mapping
    mu = ((people[..., :2] - centers[:, None]) / crops[:, None] + 0.5) * heatmap_extent  # (N, K, 2)
    heatmaps, touches = gaussian_windows(mu, (height, width), sigma)
    weights = (visible & touches).float()
    return heatmaps * weights[..., None, None], weights


def gaussian_windows(mu: torch.Tensor, heatmap_size, sigma: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Gaussians centred at `mu` (..., 2) (x, y in heatmap pixels) -> maps (..., h, w) truncated to the 3-sigma
    window around the rounded centre, and whether each window touches the map (a keypoint whose window misses
    it weighs 0). NOTE: `.to(int64)` truncates towards zero (not floor) for negative coordinates, as in HF and
    mmpose."""
    height, width = heatmap_size
    grid_y = torch.arange(height, dtype=torch.float32, device=mu.device).view(-1, 1)
    grid_x = torch.arange(width, dtype=torch.float32, device=mu.device).view(1, -1)
    mu_x, mu_y = mu[..., 0, None, None], mu[..., 1, None, None]  # (..., 1, 1)
    heatmaps = torch.exp(-((grid_x - mu_x) ** 2 + (grid_y - mu_y) ** 2) / (2 * sigma**2))
    radius = int(sigma * 3)
    center = (mu + 0.5).to(torch.int64)
    left, top = center[..., 0] - radius, center[..., 1] - radius
    right, bottom = center[..., 0] + radius + 1, center[..., 1] + radius + 1
    touches = ~((left >= width) | (top >= height) | (right < 0) | (bottom < 0))
    window = ((grid_x >= left[..., None, None]) & (grid_x < right[..., None, None])
              & (grid_y >= top[..., None, None]) & (grid_y < bottom[..., None, None]))
    return heatmaps * window, touches


# ----------------------------------------------------------------------------------------------------
# Segmentation: label maps as transformers prepares them
# ----------------------------------------------------------------------------------------------------
def preprocess_segmentation_maps(maps, size: tuple[int, int] = processing.MODEL_SIZE, pad: bool = False,
                                 reduce_labels: bool = False, resample: str = "nearest", pad_value: int = 0,
                                 device=None) -> torch.Tensor:
    """Label maps (`(H, W)` arrays/tensors or PIL "L"/"P" images) -> `(B, H, W)` int64 training targets.

    `reduce_labels`: 0 -> 255 (ignored), every other label minus 1 (HF `do_reduce_labels`, before resizing).
    `resample="nearest"` (default) keeps labels valid. `resample="hf"` reproduces HF exactly, which resizes label
    maps with the image filter (antialiased bilinear on uint8), so boundary pixels get blended, invalid ids.
    `pad`: as `preprocess(pad=True)`; use `pad_value=255` to ignore the padding in the loss (HF pads with 0).
    """
    if not isinstance(maps, (list, tuple)):
        maps = [maps]
    method = {"nearest": "nearest", "hf": "bilinear_antialias"}.get(resample)
    if method is None:
        raise ValueError(f"resample must be 'nearest' or 'hf', got {resample!r}")
    out = []
    for label_map in maps:
        labels = torch.as_tensor(np.array(label_map)) if not isinstance(label_map, torch.Tensor) else label_map
        labels = labels.to(device) if device is not None else labels
        if labels.ndim != 2:
            raise ValueError(f"segmentation map must be (H, W), got shape {tuple(labels.shape)}")
        if reduce_labels:
            labels = _reduce_labels(labels)
        # integer maps stay integer: resize rounds them as torchvision does (float maps are truncated below, as HF)
        if pad:
            top, left, bottom, right = processing.resized_content_box(tuple(labels.shape), size)
            labels = processing.resize(labels[None], (bottom - top, right - left), method)[0]
            labels = F.pad(labels, (left, size[1] - right, top, size[0] - bottom), value=pad_value)
        else:
            labels = processing.resize(labels[None], size, method)[0]
        out.append(labels.to(torch.int64))
    return torch.stack(out)


def _reduce_labels(labels: torch.Tensor) -> torch.Tensor:
    labels = labels.long()
    return torch.where(labels == 0, 255, torch.where(labels == 255, 255, labels - 1)).to(torch.uint8)
