"""Where a dense training sample's pixels come from (seg, normal, pointmap, matting, albedo), as the original's
train_pipelines make them (in torch): the crop (the whole image as predict.py shows it to the network, or the
pipeline's random one), the warps that move the image and its targets together, the camera matrix that follows
them, and which pixel augmentations (pixel_augmentation.py) run. The random choices are drawn in one function
(draw_dense) from the sample's own generator (datasets.py) and applied by deterministic ones, which
tests/test_augmentation.py runs against the original's math on the same draws; pose's are pose_augmentation.py's."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sapiens2 import processing
from sapiens2_app.augment.pixel_augmentation import (down_up, gaussian_blur, gaussian_noise,
                                             photometric_distortion, solarize)
from sapiens2_app.augment.random_draws import Photometric, chance, draw_photometric, randint, uniform


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


# The original's dense train_pipelines (dense/configs/{seg,normal,pointmap,albedo}/*/sapiens2_*.py)
DENSE_SCALE, DENSE_SCALE_PROB = (0.5, 2.0), 0.3  # {Normal,Pointmap,Albedo}RandomScale (normal_transforms.py:18)
CROP_ASPECT, CROP_AREA, CROP_ATTEMPTS, CROP_PROB = (0.5, 2.0), (0.4, 1.0), 8, 0.3  # ...RandomCropContinuous
DENSE_FLIP_PROB = 0.3  # {Normal,Pointmap,Albedo}RandomFlip
DOWN_UP_PROB, DOWN_UP_SCALE = 0.2, (0.1, 0.7)  # normal: RandomDownUpSampleImage (common_transforms.py:178)
RESIZE_METHODS = ("nearest", "bilinear", "bicubic", "area", "bicubic")  # its 5 cv2 modes; Lanczos4 -> bicubic
SEG_RESIZE, SEG_CROP_PROB, SEG_CAT_MAX_RATIO = (0.4, 2.0), 0.3, 0.75  # SegRandomResize, SegRandomCrop
SEG_ROTATION, SEG_ROTATION_PROB = 60.0, 0.5  # SegRandomRotate (seg_transforms.py:18), filled with background
SEG_FLIP_PROB = 0.5  # SegRandomHorizontalFlip
GAUSSIAN_BLUR_SIGMA = (0.1, 2.0)  # RandomGaussianBlur(kernel_size=(3, 3)), common_transforms.py:227
NOISE_VARIANCE = (5.0, 20.0)  # RandomGaussianNoise, common_transforms.py:285
PIXEL_PROBS = {  # (gaussian blur, noise, solarize) probabilities per task's config
    "seg": (0.3, 0.3, 0.0), "normal": (0.3, 0.3, 0.3), "pointmap": (0.0, 0.0, 0.0), "albedo": (0.0, 0.2, 0.0),
    "matting": (0.0, 0.0, 0.0)}
BACKGROUND_PROB = 0.8  # SegRandomBackground(prob=0.8)
PHOTOMETRIC_TASKS = ("seg", "normal", "pointmap")  # PhotoMetricDistortion() in their train_pipeline (always)


@dataclass(frozen=True)
class DenseDraws:
    """Every random choice of one dense sample (drawn by draw_dense, applied by dense_geometry and dense_pixels)."""
    photometric: Photometric | None = None
    down_up: tuple[float, str, str] | None = None  # (scale, down method, up method)
    scale: float | None = None  # normal/pointmap/albedo: the image resized by this first
    crop: tuple = ()  # normal/pointmap/albedo: CROP_ATTEMPTS (aspect, area share, u_y, u_x); empty = no crop
    seg_resize: float = 1.0  # seg: the keep-ratio resize's ratio of the network size
    seg_crop: tuple = ()  # seg: 10 (u_y, u_x) crop offsets (cat_max_ratio retries); empty = no crop
    rotation: float = 0.0  # seg, degrees counter-clockwise (cv2.getRotationMatrix2D)
    flip: bool = False
    blur_sigma: float = 0.0  # gaussian 3x3 blur, 0 = none
    noise: tuple[float, int] | None = None  # (standard deviation, seed of the noise field)
    solarize: bool = False
    background: float | None = None  # seg: which background photo (a share of their list), None = none


def draw_dense(task: str, generator: torch.Generator) -> DenseDraws:
    """The random choices of the task's train_pipeline, each with its configured probability."""
    photometric = draw_photometric(generator) if task in PHOTOMETRIC_TASKS else None
    down_up = (uniform(generator, *DOWN_UP_SCALE), RESIZE_METHODS[randint(generator, 0, 4)],
               RESIZE_METHODS[randint(generator, 0, 4)])
    down_up = down_up if task == "normal" and chance(generator, DOWN_UP_PROB) else None
    scale = uniform(generator, *DENSE_SCALE)
    scale = scale if chance(generator, DENSE_SCALE_PROB) else None
    crop = tuple((uniform(generator, *CROP_ASPECT), uniform(generator, *CROP_AREA), uniform(generator, 0, 1),
                  uniform(generator, 0, 1)) for _ in range(CROP_ATTEMPTS))
    crop = crop if chance(generator, CROP_PROB) else ()
    seg_resize = uniform(generator, *SEG_RESIZE)
    seg_crop = tuple((uniform(generator, 0, 1), uniform(generator, 0, 1)) for _ in range(11))
    seg_crop = seg_crop if chance(generator, SEG_CROP_PROB) else ()
    rotation = uniform(generator, -SEG_ROTATION, SEG_ROTATION)
    rotation = rotation if chance(generator, SEG_ROTATION_PROB) else 0.0
    flip = chance(generator, SEG_FLIP_PROB if task == "seg" else DENSE_FLIP_PROB)
    blur_p, noise_p, solarize_p = PIXEL_PROBS[task]
    blur_sigma = uniform(generator, *GAUSSIAN_BLUR_SIGMA)
    blur_sigma = blur_sigma if chance(generator, blur_p) else 0.0
    noise = (math.sqrt(uniform(generator, *NOISE_VARIANCE)), randint(generator, 0, 2**31 - 1))
    noise = noise if chance(generator, noise_p) else None
    solarize = chance(generator, solarize_p)
    background = uniform(generator, 0, 1)
    background = background if task == "seg" and chance(generator, BACKGROUND_PROB) else None
    if task == "seg":
        scale, crop = None, ()
    else:
        seg_resize, seg_crop, rotation = 1.0, (), 0.0
    if task == "matting":  # no original training pipeline: the normal-type crop and flip only
        photometric = None
    return DenseDraws(photometric, down_up, scale, crop, seg_resize, seg_crop, rotation, flip, blur_sigma, noise,
                      solarize, background)


def continuous_crop(image_size, attempts) -> tuple[int, int, int, int] | None:
    """NormalRandomCropContinuous.transform (normal_transforms.py:189-221, the same in pointmap and albedo): the
    first attempt whose box (aspect, area share of the image) fits, rounded, its corner random.randint(0, margin
    + 1) (both ends included, so it may overhang by a pixel: the slice is then one shorter). (x0, y0, w, h)."""
    h, w = image_size
    for aspect, area, u_y, u_x in attempts:
        crop_h = math.sqrt(area * h * w / aspect)
        crop_w = aspect * crop_h
        if crop_w <= w and crop_h <= h:
            crop_h, crop_w = int(round(crop_h)), int(round(crop_w))
            y0 = min(int(u_y * (h - crop_h + 2)), h - crop_h + 1)
            x0 = min(int(u_x * (w - crop_w + 2)), w - crop_w + 1)
            return (x0, y0, min(crop_w, w - x0), min(crop_h, h - y0))
    return None


def seg_resized_size(image_size, out_size, ratio: float) -> tuple[int, int]:
    """SegRandomResize + SegResize(keep_ratio=True), seg_transforms.py:185-227: fit into int(network size x ratio)."""
    h, w = image_size
    factor = min(int(out_size[1] * ratio) / w, int(out_size[0] * ratio) / h)
    return (int(round(h * factor)), int(round(w * factor)))


def seg_crop_corner(labels_resized: torch.Tensor, out_size, offsets) -> tuple[int, int]:
    """SegRandomCrop._generate_crop_bbox + cat_max_ratio (seg_transforms.py:276-325) on the resized labels (padded
    with 255 to the crop size): up to 10 redraws until no class covers >= 75% of the crop's labelled pixels."""
    h, w = labels_resized.shape
    margin_h, margin_w = max(h - out_size[0], 0), max(w - out_size[1], 0)

    def corner(u_y, u_x):
        return min(int(u_y * (margin_h + 1)), margin_h), min(int(u_x * (margin_w + 1)), margin_w)
    y0, x0 = corner(*offsets[0])
    for u_y, u_x in offsets[1:]:
        window = labels_resized[y0:y0 + out_size[0], x0:x0 + out_size[1]]
        counts = torch.bincount(window[window != 255].long().flatten(), minlength=1)
        counts = counts[counts > 0]
        if len(counts) > 1 and counts.max() / counts.sum() < SEG_CAT_MAX_RATIO:
            break
        y0, x0 = corner(u_y, u_x)
    return y0, x0


def resample_box(maps: torch.Tensor, box, out_size, mode: str, fill: float = 0.0, window=None) -> torch.Tensor:
    """(C, H, W) float -> (C, *out_size): the box's content (pixel centres at +0.5, as a resize), `fill`
    outside the source (or outside `window`, (x0, y0, w, h) in its pixels: a crop's padding). mode: "bilinear"
    (images) or "nearest" (labels, normals, points, as the original)."""
    h, w = maps.shape[-2:]
    wx0, wy0, ww, wh = window or (0, 0, w, h)
    edges_x = (box[0] + (torch.arange(out_size[1], dtype=torch.float64) + 0.5) * box[2] / out_size[1] - wx0) / ww
    edges_y = (box[1] + (torch.arange(out_size[0], dtype=torch.float64) + 0.5) * box[3] / out_size[0] - wy0) / wh
    in_window = ((edges_y >= 0) & (edges_y <= 1))[:, None] & ((edges_x >= 0) & (edges_x <= 1))[None]
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
    return torch.where(inside & in_window, out, torch.full_like(out, fill))


def resample_affine(maps: torch.Tensor, to_source: torch.Tensor, out_size, mode: str) -> torch.Tensor:
    """(C, H, W) float -> (C, *out_size) through a (3, 3) map network pixel -> source pixel (pixel-centre
    coordinates), the border replicated (callers fill what lies outside); an antialiased shrink first where the map
    shrinks (bilinear), as resample_box."""
    h, w = maps.shape[-2:]
    step_x, step_y = to_source[:2, 0].norm().item(), to_source[:2, 1].norm().item()  # source pixels per output one
    if mode == "bilinear" and max(step_x, step_y) > 1:
        small = (max(1, round(h / max(step_y, 1))), max(1, round(w / max(step_x, 1))))
        maps = processing.resize(maps.float(), small, "bilinear_antialias")
        to_source, (h, w) = resize_matrix((h, w), small) @ to_source.double(), small
    source = source_points(to_source, out_size)  # (H, W, 2)
    grid = torch.stack([(2 * source[..., 0] + 1) / w - 1, (2 * source[..., 1] + 1) / h - 1], -1).float()[None]
    return F.grid_sample(maps[None].float(), grid, mode=mode, padding_mode="border", align_corners=False)[0]


def source_points(to_source: torch.Tensor, out_size) -> torch.Tensor:
    """(H, W, 2) source pixel (x, y) of each network pixel."""
    gy, gx = torch.meshgrid(torch.arange(out_size[0], dtype=torch.float64),
                            torch.arange(out_size[1], dtype=torch.float64), indexing="ij")
    points = torch.stack([gx, gy], -1)
    return points @ to_source[:2, :2].T.double() + to_source[:2, 2].double()


def inside(points: torch.Tensor, size) -> torch.Tensor:
    """Which (x, y) pixel-centre positions fall on an image of `size` (H, W)."""
    return ((points[..., 0] >= -0.5) & (points[..., 0] <= size[1] - 0.5) & (points[..., 1] >= -0.5)
            & (points[..., 1] <= size[0] - 0.5))


def resize_matrix(from_size, to_size) -> torch.Tensor:
    """(3, 3) pixel -> pixel of a resize (cv2.resize's pixel centres): x' = (x + 0.5) * W' / W - 0.5."""
    sx, sy = to_size[1] / from_size[1], to_size[0] / from_size[0]
    return torch.tensor([[sx, 0, 0.5 * sx - 0.5], [0, sy, 0.5 * sy - 0.5], [0, 0, 1]], dtype=torch.float64)


def rotation_matrix(center, degrees: float) -> torch.Tensor:
    """cv2.getRotationMatrix2D(center, degrees, 1.0) as (3, 3): counter-clockwise on the screen."""
    a, b = math.cos(math.radians(degrees)), math.sin(math.radians(degrees))
    cx, cy = center
    return torch.tensor([[a, b, (1 - a) * cx - b * cy], [-b, a, b * cx + (1 - a) * cy], [0, 0, 1]],
                        dtype=torch.float64)


def translation(dx: float, dy: float) -> torch.Tensor:
    return torch.tensor([[1, 0, dx], [0, 1, dy], [0, 0, 1]], dtype=torch.float64)


def mirror(width: int) -> torch.Tensor:
    return torch.tensor([[-1.0, 0, width - 1], [0, 1, 0], [0, 0, 1]], dtype=torch.float64)


@dataclass
class SegGeometry:
    """The seg train_pipeline's geometry, source pixel -> network pixel, and the region each step keeps."""
    to_source: torch.Tensor  # (3, 3) network pixel -> source pixel
    to_window: torch.Tensor  # (3, 3) network pixel -> pixel of the crop window before its rotation
    window_size: tuple[int, int]  # (H, W) of that window


def seg_geometry(image_size, out_size, draws: DenseDraws, labels: torch.Tensor | None) -> SegGeometry:
    """SegRandomResize (keep ratio), SegRandomCrop (network size, padded), SegRandomRotate (about the window's
    centre), SegRandomHorizontalFlip, SegResize (stretch to the network size), composed into one map. labels: the
    (H, W) class map, for the crop's class-ratio retries (resized as cv2's INTER_NEAREST)."""
    resized = seg_resized_size(image_size, out_size, draws.seg_resize)
    window = (0, 0, *resized)  # (y0, x0, H, W) in the resized image
    if draws.seg_crop:
        small = processing.resize(labels[None].float(), resized, "nearest")[0]
        window = (*seg_crop_corner(small, out_size, draws.seg_crop), *out_size)
    y0, x0, wh, ww = window
    to_window = resize_matrix(out_size, (wh, ww))  # SegResize, undone
    if draws.flip:
        to_window = mirror(ww) @ to_window
    if draws.rotation:
        to_window = torch.linalg.inv(rotation_matrix((ww / 2, wh / 2), draws.rotation)) @ to_window
    to_source = resize_matrix(resized, image_size) @ translation(x0, y0) @ to_window
    return SegGeometry(to_source, to_window, (wh, ww))


def box_intrinsics(K: torch.Tensor, box, out_size) -> torch.Tensor:
    """Camera matrix of the resampled box: u_out = (u + 0.5 - x0) * s - 0.5."""
    x0, y0, bw, bh = box
    sx, sy = out_size[1] / bw, out_size[0] / bh
    K = K.clone()
    K[0, 0], K[1, 1] = K[0, 0] * sx, K[1, 1] * sy
    K[0, 2], K[1, 2] = (K[0, 2] + 0.5 - x0) * sx - 0.5, (K[1, 2] + 0.5 - y0) * sy - 0.5
    return K


def dense_pixels(task: str, pixels: torch.Tensor, draws: DenseDraws) -> torch.Tensor:
    """The pixel augmentations that follow the geometry, in the config's order (on grey levels): seg: blur, noise,
    photometric distortion; normal: blur, noise, solarize; albedo: noise."""
    if draws.blur_sigma:
        pixels = gaussian_blur(pixels, draws.blur_sigma)
    if draws.noise is not None:
        pixels = gaussian_noise(pixels, *draws.noise)
    if task == "seg" and draws.photometric is not None:
        pixels = photometric_distortion(pixels, draws.photometric)
    if draws.solarize:
        pixels = solarize(pixels)
    return pixels


def dense_source_pixels(task: str, image: torch.Tensor, draws: DenseDraws) -> torch.Tensor:
    """The pixel augmentations before the geometry, at the image's size: normal and pointmap: photometric
    distortion; normal: then the down-up sampling."""
    if task != "seg" and draws.photometric is not None:
        image = photometric_distortion(image, draws.photometric)
    if draws.down_up is not None:
        image = down_up(image, *draws.down_up)
    return image
