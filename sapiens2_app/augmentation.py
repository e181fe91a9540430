"""Where a training sample's pixels come from: the crop (the whole image as predict.py shows it to the network, or
a random one), the warps that move the image and its targets together, and colour jitter. Every random choice
comes from the sample's own generator (datasets.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import processing


# ----------------------------------------------------------------------------------------------------
# Augmentation settings (the original's kinds, in torch; every random choice from the sample's generator)
# ----------------------------------------------------------------------------------------------------
DENSE_SCALE = (0.6, 1.2)  # crop box size relative to the whole-image box: < 1 zooms in
DENSE_SHIFT = 0.2  # crop centre shift, as a share of the crop size
COLOR_JITTER = 0.2  # brightness, contrast and saturation factors in [1 - j, 1 + j]


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


def apply_affine(matrix: torch.Tensor, points: torch.Tensor) -> torch.Tensor:
    return points @ matrix[:2, :2].T + matrix[:2, 2]


def warp(image: torch.Tensor, to_source: torch.Tensor, size, upscale: bool) -> torch.Tensor:
    """(3, H, W) float -> (3, *size): grid_sample(align_corners=True) as processing.crop_people (bicubic when
    the crop is enlarged, else bilinear; zeros outside)."""
    h, w = image.shape[-2:]
    gy, gx = torch.meshgrid(torch.arange(size[0], dtype=torch.float32), torch.arange(size[1], dtype=torch.float32),
                            indexing="ij")
    source = apply_affine(to_source, torch.stack([gx, gy], -1).reshape(-1, 2)).reshape(*size, 2)
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
class Photometric:
    """PhotoMetricDistortion's choices (engine/datasets/transforms/common_transforms.py:72): None = that part skipped."""
    brightness: float | None  # added, in [-32, 32]
    contrast: float | None  # factor in [0.5, 1.5]
    contrast_first: bool  # contrast before saturation and hue (its `mode == 1`), else after them
    saturation: float | None  # factor on HSV's S in [0.5, 1.5]
    hue: int | None  # added to HSV's H (0..179), in [-18, 18]


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


def truncated_normal(generator: torch.Generator) -> float:
    """A standard normal truncated to (-1, 1) (scipy's truncnorm(-1, 1)), by inverting its CDF: one uniform
    draw per value, so the generator's stream does not depend on the values drawn."""
    low = torch.special.ndtr(torch.tensor(-1.0, dtype=torch.float64))
    u = torch.rand((), generator=generator, dtype=torch.float64)
    return torch.special.ndtri(low + u * (1 - 2 * low)).clamp(-1, 1).item()


def randint(generator: torch.Generator, low: int, high: int) -> int:
    """An integer in [low, high], both included (Python's random.randint)."""
    return int(torch.randint(low, high + 1, (), generator=generator).item())


def draw_photometric(generator: torch.Generator) -> Photometric:
    def maybe(value):  # each part with p 0.5 (random.randint(0, 1))
        return value if chance(generator, 0.5) else None
    brightness = maybe(uniform(generator, -32, 32))
    contrast_first = chance(generator, 0.5)
    contrast = maybe(uniform(generator, 0.5, 1.5))
    saturation = maybe(uniform(generator, 0.5, 1.5))
    hue = maybe(randint(generator, -18, 18))
    return Photometric(brightness, contrast, contrast_first, saturation, hue)


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


# ----------------------------------------------------------------------------------------------------
# Pixel-level augmentations on uint8 grey levels (held in float tensors), as OpenCV computes them
# ----------------------------------------------------------------------------------------------------
def saturate_linear(image: torch.Tensor, alpha: float = 1.0, beta: float = 0.0) -> torch.Tensor:
    """PhotoMetricDistortion.convert: float32 image * alpha + beta, clipped to 0..255 and truncated to uint8."""
    return (image.float() * alpha + beta).clamp(0, 255).trunc()


def photometric_distortion(image: torch.Tensor, draws: Photometric) -> torch.Tensor:
    """(3, H, W) RGB grey levels: brightness, contrast (first or last), saturation, hue (common_transforms.py:124)."""
    if draws.brightness is not None:
        image = saturate_linear(image, beta=draws.brightness)
    if draws.contrast is not None and draws.contrast_first:
        image = saturate_linear(image, alpha=draws.contrast)
    if draws.saturation is not None:
        h, s, v = rgb_to_hsv_uint8(image)
        image = hsv_to_rgb_uint8(h, saturate_linear(s, alpha=draws.saturation), v)
    if draws.hue is not None:
        h, s, v = rgb_to_hsv_uint8(image)
        image = hsv_to_rgb_uint8(torch.remainder(h + draws.hue, 180), s, v)
    if draws.contrast is not None and not draws.contrast_first:
        image = saturate_linear(image, alpha=draws.contrast)
    return image


HSV_SHIFT = 12  # OpenCV's 8-bit RGB -> HSV fixed point (imgproc/src/color_hsv.simd.hpp, RGB2HSV_b)


def rgb_to_hsv_uint8(image: torch.Tensor):
    """cv2.cvtColor(COLOR_RGB2HSV) on uint8: H in 0..179 (degrees / 2), S and V in 0..255, OpenCV's integer
    arithmetic (its division tables, rounded at 12 bits)."""
    r, g, b = image.long().unbind(0)
    v = torch.maximum(torch.maximum(r, g), b)
    diff = v - torch.minimum(torch.minimum(r, g), b)
    values = torch.arange(256, dtype=torch.float64)
    sdiv = torch.where(values > 0, ((255 << HSV_SHIFT) / values).round(), 0).long()
    hdiv = torch.where(values > 0, ((180 << HSV_SHIFT) / (6 * values)).round(), 0).long()
    half = 1 << (HSV_SHIFT - 1)
    s = (diff * sdiv[v] + half) >> HSV_SHIFT
    h = torch.where(v == r, g - b, torch.where(v == g, b - r + 2 * diff, r - g + 4 * diff))
    h = (h * hdiv[diff] + half) >> HSV_SHIFT
    h = torch.where(h < 0, h + 180, h)
    return h.float(), s.float(), v.float()


def hsv_to_rgb_uint8(h: torch.Tensor, s: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """cv2.cvtColor(COLOR_HSV2RGB) on uint8: OpenCV's float32 sector formula (HSV2RGB_native), rounded."""
    h = h.float() * (6.0 / 180.0)
    s, v = s.float() * (1 / 255.0), v.float() * (1 / 255.0)
    sector = h.floor()
    f = h - sector
    outside = (sector < 0) | (sector >= 6)  # OpenCV: sector 0, fraction 0
    sector, f = torch.where(outside, 0.0, sector).long(), torch.where(outside, 0.0, f)
    tab = torch.stack([v, v * (1 - s), v * (1 - s * f), v * (1 - s * (1 - f))])  # (4, H, W)
    sectors = torch.tensor([[1, 3, 0], [1, 0, 2], [3, 0, 1], [0, 2, 1], [0, 1, 3], [2, 1, 0]])  # (b, g, r) picks
    picks = sectors[sector]  # (H, W, 3)
    bgr = torch.gather(tab, 0, picks.permute(2, 0, 1))  # (3, H, W)
    rgb = torch.where(s[None] == 0, v[None].expand(3, -1, -1), bgr.flip(0))
    return (rgb * 255).round().clamp(0, 255)


def box_blur(image: torch.Tensor, kernel: int) -> torch.Tensor:
    """cv2.blur (albumentations Blur): the kernel x kernel mean, mirrored border (BORDER_REFLECT_101), rounded."""
    padded = F.pad(image[None].float(), [kernel // 2] * 4, mode="reflect")
    return F.avg_pool2d(padded, kernel, stride=1)[0].round()


def median_blur(image: torch.Tensor, kernel: int) -> torch.Tensor:
    """cv2.medianBlur (albumentations MedianBlur): the kernel x kernel median, replicated border."""
    padded = F.pad(image[None].float(), [kernel // 2] * 4, mode="replicate")[0]  # (C, H + k - 1, W + k - 1)
    windows = padded.unfold(1, kernel, 1).unfold(2, kernel, 1)  # (C, H, W, k, k)
    return windows.reshape(*windows.shape[:3], -1).median(-1).values


def coarse_dropout(image: torch.Tensor, hole) -> torch.Tensor:
    x0, y0, width, height = hole
    image = image.clone()
    image[:, y0:y0 + height, x0:x0 + width] = 0
    return image
