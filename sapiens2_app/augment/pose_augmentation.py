"""A pose training sample's augmentation, as the original's pose train_pipeline makes it (in torch): its random
choices (draw_pose), the top-down crop they give (pose_crop: the box, flip, half body, shift, scale and rotation as
one affine map) and the crop's pixels (pose_pixels: the warp, then pixel_augmentation.py's operations). The draws
are applied by deterministic functions, which tests/test_augmentation.py runs against the original's math on the
same draws; the dense tasks' augmentation is dense_augmentation.py's."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sapiens2 import processing
from sapiens2_app.augment.pixel_augmentation import (box_blur, coarse_dropout, median_blur,
                                                     photometric_distortion)
from sapiens2_app.augment.random_draws import Photometric, chance, draw_photometric, randint, truncated_normal, uniform


# ----------------------------------------------------------------------------------------------------
# Pose: top-down crops as affine maps (network pixel -> source pixel)
# ----------------------------------------------------------------------------------------------------
def crop_affine(center, crop, angle_degrees: float, size) -> torch.Tensor:
    """(3, 3) network pixel -> source pixel: the UDP crop of processing.crop_people, rotated about the
    centre: p = c + R^T S^-1 (o - (size - 1) / 2), S = (size - 1) / crop. Its inverse is the original's
    get_udp_warp_matrix (pose/datasets/transforms/bbox_transforms.py:108)."""
    theta = math.radians(angle_degrees)
    rotation_t = torch.tensor([[math.cos(theta), math.sin(theta)], [-math.sin(theta), math.cos(theta)]],
                              dtype=torch.float64)
    scale = torch.tensor([(size[1] - 1) / crop[0], (size[0] - 1) / crop[1]], dtype=torch.float64)
    linear = rotation_t @ torch.diag(1 / scale)
    center = torch.as_tensor(center, dtype=torch.float64)
    offset = center - linear @ torch.tensor([(size[1] - 1) / 2, (size[0] - 1) / 2], dtype=torch.float64)
    return torch.cat([torch.cat([linear, offset[:, None]], 1), torch.tensor([[0.0, 0.0, 1.0]], dtype=torch.float64)]
                     ).float()


def invert_affine(matrix: torch.Tensor) -> torch.Tensor:
    return torch.linalg.inv(matrix.double()).float()


def warp(image: torch.Tensor, to_source: torch.Tensor, size, upscale: bool) -> torch.Tensor:
    """(3, H, W) float -> (3, *size): grid_sample(align_corners=True) as processing.crop_people (bicubic when
    the crop is enlarged, else bilinear; zeros outside)."""
    h, w = image.shape[-2:]
    gy, gx = torch.meshgrid(torch.arange(size[0], dtype=torch.float32), torch.arange(size[1], dtype=torch.float32),
                            indexing="ij")
    source = processing.apply_affine(to_source, torch.stack([gx, gy], -1).reshape(-1, 2)).reshape(*size, 2)
    grid = torch.stack([2 * source[..., 0] / max(w - 1, 1) - 1, 2 * source[..., 1] / max(h - 1, 1) - 1], -1)[None]
    mode = "bicubic" if upscale else "bilinear"
    return F.grid_sample(image[None], grid, mode=mode, padding_mode="zeros", align_corners=True)[0]


# The original's pose train_pipeline (pose/configs/keypoints308/*/sapiens2_*.py: PoseRandomFlip, PoseRandomHalfBody,
# PoseRandomBBoxTransform with their defaults, pose/datasets/transforms/pose_transforms.py:224-532)
POSE_FLIP_PROB = 0.5
POSE_SHIFT, POSE_SHIFT_PROB = 0.16, 0.3  # centre shift, a share of the box size, truncated normal in (-1, 1)
POSE_SCALE = (0.5, 1.5)  # box size factor: truncated normal on (-1, 1), times 0.5, plus 1 (always)
POSE_ROTATION, POSE_ROTATION_PROB = 80.0, 0.6  # degrees: truncated normal on (-1, 1), times 80
BOX_PADDING = processing.CROP_PADDING  # PoseGetBBoxCenterScale: 1.25 on the annotated box (not the half body)
HALF_BODY_PROB, HALF_BODY_UPPER_PROB = 0.3, 0.7  # tried with p 0.3; the upper half preferred with p 0.7
HALF_BODY_MIN_VISIBLE, HALF_BODY_MIN_UPPER, HALF_BODY_MIN_LOWER = 9, 2, 3
HALF_BODY_PADDING = 1.5  # the half body's keypoint extent x1.5, centred on their mean
PHOTOMETRIC_PROB = 0.8  # RandomPhotoMetricDistortion(prob=0.8); dense configs: PhotoMetricDistortion (always)
BLUR_PROB, MEDIAN_BLUR_PROB = 0.1, 0.1  # albumentations Blur, MedianBlur (blur_limit 7: kernel 3, 5 or 7)
BLUR_KERNELS = (3, 5, 7)
DROPOUT_SIZE = (0.2, 0.4)  # CoarseDropout: one hole, height and width these shares of the crop, always


@dataclass(frozen=True)
class PoseDraws:
    """Every random choice of one pose sample (drawn by draw_pose; applied by pose_crop and pose_pixels)."""
    flip: bool = False
    half_body: bool = False  # the half-body crop is tried (if enough keypoints are visible)
    prefer_upper: bool = True
    shift: tuple[float, float] = (0.0, 0.0)  # centre shift, a share of the box size
    scale: float = 1.0  # box size factor
    rotation: float = 0.0  # degrees
    photometric: Photometric | None = None
    blur: int = 0  # box-blur kernel size, 0 = none
    median_blur: int = 0
    hole: tuple[int, int, int, int] | None = None  # coarse dropout (x0, y0, width, height) in network pixels


def draw_pose(generator: torch.Generator, size) -> PoseDraws:
    """The random choices of the original's pose train_pipeline, each with its configured probability."""
    flip = chance(generator, POSE_FLIP_PROB)
    half_body, prefer_upper = chance(generator, HALF_BODY_PROB), chance(generator, HALF_BODY_UPPER_PROB)
    shift = (truncated_normal(generator) * POSE_SHIFT, truncated_normal(generator) * POSE_SHIFT)
    shift = shift if chance(generator, POSE_SHIFT_PROB) else (0.0, 0.0)
    low, high = POSE_SCALE
    scale = truncated_normal(generator) * (high - low) / 2 + (high + low) / 2
    rotation = truncated_normal(generator) * POSE_ROTATION
    rotation = rotation if chance(generator, POSE_ROTATION_PROB) else 0.0
    photometric = draw_photometric(generator)
    photometric = photometric if chance(generator, PHOTOMETRIC_PROB) else None
    blur = BLUR_KERNELS[randint(generator, 0, 2)]
    blur = blur if chance(generator, BLUR_PROB) else 0
    median_blur = BLUR_KERNELS[randint(generator, 0, 2)]
    median_blur = median_blur if chance(generator, MEDIAN_BLUR_PROB) else 0
    return PoseDraws(flip, half_body, prefer_upper, shift, scale, rotation, photometric, blur, median_blur,
                     draw_hole(generator, size))


def draw_hole(generator: torch.Generator, size) -> tuple[int, int, int, int]:
    """albumentations 1.x CoarseDropout(max_holes=1, min/max_height and width 0.2/0.4 as floats): hole sides
    int(side * U(0.2, 0.4)), its corner uniform over the positions that keep it inside."""
    height = int(size[0] * uniform(generator, *DROPOUT_SIZE))
    width = int(size[1] * uniform(generator, *DROPOUT_SIZE))
    y0, x0 = randint(generator, 0, size[0] - height), randint(generator, 0, size[1] - width)
    return (x0, y0, width, height)


def clip_box(box_xywh, image_size) -> torch.Tensor:
    """COCO xywh -> xyxy clipped to the image's pixel centres [0, W - 1] x [0, H - 1], as the original's loader
    (pose/datasets/pose_base_dataset.py:158); an empty result means the box lies outside the image."""
    x, y, w, h = (float(v) for v in box_xywh)
    height, width = image_size
    return torch.tensor([min(max(x, 0), width - 1), min(max(y, 0), height - 1),
                         min(max(x + w, 0), width - 1), min(max(y + h, 0), height - 1)], dtype=torch.float64)


@dataclass
class PoseCrop:
    to_source: torch.Tensor  # (3, 3) network pixel -> source pixel (a flip included)
    points: torch.Tensor  # (K, 2) keypoints in network pixels, in the sample's order (swapped after a flip)
    visible: torch.Tensor  # (K,) bool: labelled and inside the crop
    order: torch.Tensor  # (K,) the source keypoint of each of the sample's keypoints
    upscale: bool  # the crop is enlarged (bicubic), else shrunk (bilinear)


def pose_crop(box_xyxy, keypoints, image_width: int, size, draws: PoseDraws, flip_order, body_ids) -> PoseCrop:
    """The original's pose geometry for given draws: PoseGetBBoxCenterScale (padding 1.25), PoseRandomFlip (on the
    whole image), PoseRandomHalfBody, PoseRandomBBoxTransform and PoseTopdownAffine (aspect fixed, UDP matrix;
    keypoints that leave the crop are no longer visible). keypoints (K, 3): image pixels + visibility;
    body_ids: (upper ids, lower ids) of the keypoint set."""
    box = torch.as_tensor(box_xyxy, dtype=torch.float64)
    center, box_size = (box[:2] + box[2:]) / 2, (box[2:] - box[:2]) * BOX_PADDING
    points = keypoints[:, :2].double().clone()
    visible = keypoints[:, 2] > 0
    order = torch.arange(len(keypoints))
    if draws.flip:  # the original flips the image first: centre and keypoints mirrored, left and right swapped
        order = torch.as_tensor(flip_order)
        center = torch.stack([image_width - 1 - center[0], center[1]])
        points, visible = points[order], visible[order]
        points[:, 0] = image_width - 1 - points[:, 0]
    half = half_body_ids(visible, draws, *body_ids)
    if half is not None:
        selected = points[half]
        center = selected.mean(0)
        box_size = (selected.amax(0) - selected.amin(0)) * HALF_BODY_PADDING
    center = center + torch.tensor(draws.shift, dtype=torch.float64) * box_size
    box_size = box_size * draws.scale
    aspect = size[1] / size[0]
    w, h = box_size.tolist()
    crop = (w, w / aspect) if w > h * aspect else (h * aspect, h)
    to_crop = crop_affine(center, crop, draws.rotation, size).double().inverse()  # source -> network
    network = points @ to_crop[:2, :2].T + to_crop[:2, 2]
    inside = (network[:, 0] >= 0) & (network[:, 0] < size[1]) & (network[:, 1] >= 0) & (network[:, 1] < size[0])
    to_source = torch.linalg.inv(to_crop)
    if draws.flip:
        mirror = torch.tensor([[-1.0, 0, image_width - 1], [0, 1, 0], [0, 0, 1]], dtype=torch.float64)
        to_source = mirror @ to_source
    upscale = min((size[1] - 1) / crop[0], (size[0] - 1) / crop[1]) >= 1.0
    return PoseCrop(to_source.float(), network.float(), visible & inside, order, upscale)


def half_body_ids(visible: torch.Tensor, draws: PoseDraws, upper_ids, lower_ids) -> list[int] | None:
    """PoseRandomHalfBody._random_select_half_body (pose_transforms.py:394): with >= 9 visible keypoints and the
    draw, the visible upper (>= 2) or lower (>= 3) keypoints, the upper preferred; None = the whole box."""
    if int(visible.sum()) < HALF_BODY_MIN_VISIBLE or not draws.half_body:
        return None
    upper = [i for i in upper_ids if visible[i]]
    lower = [i for i in lower_ids if visible[i]]
    if len(upper) < HALF_BODY_MIN_UPPER and len(lower) < HALF_BODY_MIN_LOWER:
        return None
    if len(lower) < HALF_BODY_MIN_LOWER:
        return upper
    if len(upper) < HALF_BODY_MIN_UPPER:
        return lower
    return upper if draws.prefer_upper else lower


def pose_pixels(image: torch.Tensor, crop: PoseCrop, size, draws: PoseDraws) -> torch.Tensor:
    """(3, H, W) 0..255 -> the crop (3, *size), on integer grey levels as the original's uint8 pipeline:
    warped (rounded as cv2.warpAffine), photometric distortion, blur, median blur, coarse dropout."""
    pixels = warp(image, crop.to_source, size, crop.upscale).clamp(0, 255).round()
    if draws.photometric is not None:
        pixels = photometric_distortion(pixels, draws.photometric)
    if draws.blur:
        pixels = box_blur(pixels, draws.blur)
    if draws.median_blur:
        pixels = median_blur(pixels, draws.median_blur)
    if draws.hole is not None:
        pixels = coarse_dropout(pixels, draws.hole)
    return pixels
