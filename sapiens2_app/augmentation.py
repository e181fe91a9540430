"""Where a training sample's pixels come from: the crop (the whole image as predict.py shows it to the network, or
a random one), the warps that move the image and its targets together, and colour jitter. Every random choice
comes from the sample's own generator (datasets.py)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

import processing


# ----------------------------------------------------------------------------------------------------
# Augmentation settings (the original's kinds, in torch; every random choice from the sample's generator)
# ----------------------------------------------------------------------------------------------------
DENSE_SCALE = (0.6, 1.2)  # crop box size relative to the whole-image box: < 1 zooms in
DENSE_SHIFT = 0.2  # crop centre shift, as a share of the crop size
COLOR_JITTER = 0.2  # brightness, contrast and saturation factors in [1 - j, 1 + j]
POSE_SCALE = (0.75, 1.25)  # box size factor (mmpose RandomBBoxTransform-like)
POSE_SHIFT, POSE_SHIFT_PROB = 0.16, 0.3
POSE_ROTATION, POSE_ROTATION_PROB = 40.0, 0.6  # degrees
HALF_BODY_PROB, HALF_BODY_MIN_KEYPOINTS = 0.3, 8


def uniform(generator: torch.Generator, low: float, high: float) -> float:
    return low + (high - low) * torch.rand((), generator=generator).item()


def chance(generator: torch.Generator, p: float) -> bool:
    return torch.rand((), generator=generator).item() < p


def color_jitter(image: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """(3, H, W) float 0..255: random brightness, contrast and saturation."""
    j = COLOR_JITTER
    image = image * uniform(generator, 1 - j, 1 + j)
    mean = image.mean()
    image = (image - mean) * uniform(generator, 1 - j, 1 + j) + mean
    gray = (0.299 * image[0] + 0.587 * image[1] + 0.114 * image[2])[None]
    image = (image - gray) * uniform(generator, 1 - j, 1 + j) + gray
    return image.clamp(0, 255)


# ----------------------------------------------------------------------------------------------------
# Geometry: one crop box (x0, y0, width, height) in source pixels with the network's aspect, resampled
# ----------------------------------------------------------------------------------------------------
STRETCHED = ("seg", "matting")  # predict.py resizes these to the network size as they are (no padding)


def whole_image_box(task: str, image_size, out_size) -> tuple[float, float, float, float]:
    """The box predict.py's preprocessing shows the network: the image itself (seg, matting: a plain resize),
    or the smallest box with the network's aspect that holds it, centred (normal, pointmap, albedo: resize
    and pad)."""
    if task in STRETCHED:
        return (0.0, 0.0, float(image_size[1]), float(image_size[0]))
    return letterbox_box(image_size, out_size)


def letterbox_box(image_size, out_size) -> tuple[float, float, float, float]:
    h, w = image_size
    aspect = out_size[1] / out_size[0]
    bw, bh = (w, w / aspect) if w / h > aspect else (h * aspect, h)
    return ((w - bw) / 2, (h - bh) / 2, bw, bh)


def random_box(task: str, image_size, out_size, generator) -> tuple[float, float, float, float]:
    """The whole-image box, scaled and shifted at random."""
    x0, y0, bw, bh = whole_image_box(task, image_size, out_size)
    scale = uniform(generator, *DENSE_SCALE)
    cx = x0 + bw / 2 + uniform(generator, -DENSE_SHIFT, DENSE_SHIFT) * bw * scale
    cy = y0 + bh / 2 + uniform(generator, -DENSE_SHIFT, DENSE_SHIFT) * bh * scale
    return (cx - bw * scale / 2, cy - bh * scale / 2, bw * scale, bh * scale)


def resample_box(maps: torch.Tensor, box, out_size, mode: str, fill: float = 0.0) -> torch.Tensor:
    """(C, H, W) float -> (C, *out_size): the box's content (pixel centres at +0.5, as a resize), `fill`
    outside the source. mode: "bilinear" (images) or "nearest" (labels, normals, points, as the original)."""
    shrink_y, shrink_x = min(1.0, out_size[0] / box[3]), min(1.0, out_size[1] / box[2])
    if mode == "bilinear" and min(shrink_x, shrink_y) < 1:  # an antialiased resize first, as predict.py's
        h, w = maps.shape[-2:]
        small = (max(1, round(h * shrink_y)), max(1, round(w * shrink_x)))
        maps = processing.resize(maps.float(), small, "bilinear_antialias")
        sy, sx = small[0] / h, small[1] / w
        box = (box[0] * sx, box[1] * sy, box[2] * sx, box[3] * sy)  # edge coordinates scale exactly
    _, h, w = maps.shape
    x0, y0, bw, bh = box
    xs = x0 + (torch.arange(out_size[1], dtype=torch.float64) + 0.5) * bw / out_size[1]
    ys = y0 + (torch.arange(out_size[0], dtype=torch.float64) + 0.5) * bh / out_size[0]
    gy, gx = torch.meshgrid(ys / h * 2 - 1, xs / w * 2 - 1, indexing="ij")
    grid = torch.stack([gx, gy], dim=-1).float()[None]
    inside = (gx.abs() <= 1) & (gy.abs() <= 1)
    out = F.grid_sample(maps[None].float(), grid, mode=mode, padding_mode="border", align_corners=False)[0]
    return torch.where(inside, out, torch.full_like(out, fill))


def box_intrinsics(K: torch.Tensor, box, out_size) -> torch.Tensor:
    """Camera matrix of the resampled box: u_out = (u + 0.5 - x0) * s - 0.5."""
    x0, y0, bw, bh = box
    sx, sy = out_size[1] / bw, out_size[0] / bh
    K = K.clone()
    K[0, 0], K[1, 1] = K[0, 0] * sx, K[1, 1] * sy
    K[0, 2], K[1, 2] = (K[0, 2] + 0.5 - x0) * sx - 0.5, (K[1, 2] + 0.5 - y0) * sy - 0.5
    return K


# ----------------------------------------------------------------------------------------------------
# Pose: top-down crops as affine maps (network pixel -> source pixel)
# ----------------------------------------------------------------------------------------------------
def crop_affine(center, crop, angle_degrees: float, size) -> torch.Tensor:
    """(3, 3) network pixel -> source pixel: the UDP crop of processing.crop_people, rotated about the
    centre: p = c + R^T S^-1 (o - (size - 1) / 2), S = (size - 1) / crop."""
    theta = math.radians(angle_degrees)
    rotation_t = torch.tensor([[math.cos(theta), math.sin(theta)], [-math.sin(theta), math.cos(theta)]])
    scale = torch.tensor([(size[1] - 1) / crop[0], (size[0] - 1) / crop[1]])
    linear = rotation_t @ torch.diag(1 / scale)
    offset = center - linear @ torch.tensor([(size[1] - 1) / 2, (size[0] - 1) / 2])
    return torch.cat([torch.cat([linear, offset[:, None]], 1), torch.tensor([[0.0, 0.0, 1.0]])])


def invert_affine(matrix: torch.Tensor) -> torch.Tensor:
    return torch.linalg.inv(matrix.double()).float()


def apply_affine(matrix: torch.Tensor, points: torch.Tensor) -> torch.Tensor:
    return points @ matrix[:2, :2].T + matrix[:2, 2]


def warp(image: torch.Tensor, to_source: torch.Tensor, size, upscale: bool) -> torch.Tensor:
    """(3, H, W) float -> (3, *size): grid_sample(align_corners=True) as processing.crop_people (bicubic when
    the crop is enlarged, else bilinear; zeros outside)."""
    h, w = image.shape[-2:]
    gy, gx = torch.meshgrid(torch.arange(size[0], dtype=torch.float32), torch.arange(size[1], dtype=torch.float32),
                            indexing="ij")
    source = apply_affine(to_source, torch.stack([gx, gy], -1).reshape(-1, 2)).reshape(*size, 2)
    grid = torch.stack([2 * source[..., 0] / (w - 1) - 1, 2 * source[..., 1] / (h - 1) - 1], -1)[None]
    mode = "bicubic" if upscale else "bilinear"
    return F.grid_sample(image[None], grid, mode=mode, padding_mode="zeros", align_corners=True)[0]
