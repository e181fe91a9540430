"""Pixel-level augmentations of the original's train_pipelines, in torch, on uint8 grey levels held in float tensors
(3, H, W), RGB, computed as OpenCV computes them: photometric distortion (its 8-bit HSV), box, median and Gaussian
blur, noise, solarize, down-up sampling, coarse dropout and the seg random background (its 8-bit Lab). No
randomness here: pose_augmentation.py and dense_augmentation.py draw every choice (random_draws.py) and pass it in."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from sapiens2 import processing
from sapiens2_app.augment.random_draws import Photometric

SOLARIZE_THRESHOLD = 128  # RandomSolarize, common_transforms.py:405


# ----------------------------------------------------------------------------------------------------
# Photometric distortion (PhotoMetricDistortion, engine/datasets/transforms/common_transforms.py:72-146)
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


# ----------------------------------------------------------------------------------------------------
# Blurs, noise, dropout, resampling
# ----------------------------------------------------------------------------------------------------
def box_blur(image: torch.Tensor, kernel: int) -> torch.Tensor:
    """cv2.blur (albumentations Blur): the kernel x kernel mean, mirrored border (BORDER_REFLECT_101), rounded."""
    padded = F.pad(image[None].float(), [kernel // 2] * 4, mode="reflect")
    return F.avg_pool2d(padded, kernel, stride=1)[0].round()


def median_blur(image: torch.Tensor, kernel: int) -> torch.Tensor:
    """cv2.medianBlur (albumentations MedianBlur): the kernel x kernel median of grey levels, replicated border.
    Found bit by bit (the median is the smallest level with more than half the window at or below it): 8 passes
    over the kernel^2 shifted views, no (H, W, kernel^2) copy (460 MB at 1024x768 for kernel 7)."""
    height, width = image.shape[-2:]
    padded = F.pad(image[None].float(), [kernel // 2] * 4, mode="replicate")[0].to(torch.uint8)
    views = [padded[:, dy:dy + height, dx:dx + width] for dy in range(kernel) for dx in range(kernel)]
    median = torch.zeros(image.shape, dtype=torch.uint8)
    count = torch.empty(image.shape, dtype=torch.uint8)
    for bit in (128, 64, 32, 16, 8, 4, 2, 1):
        candidate = median + (bit - 1)
        count.zero_()
        for view in views:
            count += view <= candidate
        median = torch.where(count > kernel * kernel // 2, median, median + bit)
    return median.float()


def coarse_dropout(image: torch.Tensor, hole) -> torch.Tensor:
    x0, y0, width, height = hole
    image = image.clone()
    image[:, y0:y0 + height, x0:x0 + width] = 0
    return image


def gaussian_blur(image: torch.Tensor, sigma: float) -> torch.Tensor:
    """cv2.GaussianBlur(image, (3, 3), sigma) on grey levels: the separable 3-tap kernel, BORDER_REFLECT_101."""
    taps = torch.tensor([math.exp(-1 / (2 * sigma**2)), 1.0, math.exp(-1 / (2 * sigma**2))], dtype=torch.float64)
    taps = (taps / taps.sum()).float()
    padded = F.pad(image[:, None].float(), [1, 1, 1, 1], mode="reflect")  # (C, 1, H + 2, W + 2)
    rows = F.conv2d(padded, taps.view(1, 1, 1, 3))
    return F.conv2d(rows, taps.view(1, 1, 3, 1))[:, 0].round()


def gaussian_noise(image: torch.Tensor, sigma: float, seed: int) -> torch.Tensor:
    """RandomGaussianNoise: + N(0, sigma) per value, clipped, truncated to uint8 (common_transforms.py:296-302)."""
    noise = torch.randn(image.shape, generator=torch.Generator().manual_seed(seed)) * sigma
    return (image.float() + noise).clamp(0, 255).trunc()


def solarize(image: torch.Tensor) -> torch.Tensor:
    """RandomSolarize: levels above 128 inverted."""
    return torch.where(image > SOLARIZE_THRESHOLD, 255 - image, image)


def down_up(image: torch.Tensor, scale: float, down: str, up: str) -> torch.Tensor:
    """RandomDownUpSampleImage: resized to max(1, int(side x scale)) and back, with the drawn cv2 methods."""
    h, w = image.shape[-2:]
    small = processing.resize(image, (max(1, int(h * scale)), max(1, int(w * scale))), down).round().clamp(0, 255)
    return processing.resize(small, (h, w), up).round().clamp(0, 255)


# ----------------------------------------------------------------------------------------------------
# Seg: random background (SegRandomBackground, seg_transforms.py:345-479)
# ----------------------------------------------------------------------------------------------------
SRGB_TO_XYZ = torch.tensor([[0.412453, 0.357580, 0.180423], [0.212671, 0.715160, 0.072169],
                            [0.019334, 0.119193, 0.950227]], dtype=torch.float64)  # OpenCV's, D65
WHITE = torch.tensor([0.950456, 1.0, 1.088754], dtype=torch.float64)


def rgb_to_lab_uint8(image: torch.Tensor) -> torch.Tensor:
    """cv2.cvtColor(COLOR_RGB2Lab) on uint8, in float: L x 255/100, a + 128, b + 128, rounded (OpenCV's tables
    and fixed point land within 1 level of it)."""
    rgb = image.double() / 255
    linear = torch.where(rgb <= 0.04045, rgb / 12.92, ((rgb + 0.055) / 1.055) ** 2.4)
    xyz = torch.einsum("ij,jhw->ihw", SRGB_TO_XYZ, linear) / WHITE.view(3, 1, 1)
    f = torch.where(xyz > 0.008856, xyz.clamp(min=0) ** (1 / 3), 7.787 * xyz + 16 / 116)
    lightness = torch.where(xyz[1] > 0.008856, 116 * f[1] - 16, 903.3 * xyz[1])
    lab = torch.stack([lightness * 255 / 100, 500 * (f[0] - f[1]) + 128, 200 * (f[1] - f[2]) + 128])
    return lab.round().clamp(0, 255)


def lab_to_rgb_uint8(lab: torch.Tensor) -> torch.Tensor:
    """cv2.cvtColor(COLOR_Lab2RGB) on uint8, in float (the inverse of rgb_to_lab_uint8), rounded."""
    lightness, a, b = lab.double()[0] * 100 / 255, lab.double()[1] - 128, lab.double()[2] - 128
    fy = torch.where(lightness <= 8, 7.787 * lightness / 903.3 + 16 / 116, (lightness + 16) / 116)
    y = torch.where(lightness <= 8, lightness / 903.3, fy**3)
    fx, fz = a / 500 + fy, fy - b / 200

    def inverse_f(t):
        return torch.where(t > 0.206893, t**3, (t - 16 / 116) / 7.787)
    xyz = torch.stack([inverse_f(fx), y, inverse_f(fz)]) * WHITE.view(3, 1, 1)
    linear = torch.einsum("ij,jhw->ihw", torch.linalg.inv(SRGB_TO_XYZ), xyz).clamp(0, 1)
    rgb = torch.where(linear <= 0.0031308, 12.92 * linear, 1.055 * linear ** (1 / 2.4) - 0.055)
    return (rgb * 255).round().clamp(0, 255)


def fit_background(background: torch.Tensor, image_size) -> torch.Tensor:
    """The background resized to the image's height (aspect kept, cv2's default bilinear), centred and cut to its
    width, or resized to its size when narrower (seg_transforms.py:394-418)."""
    h, w = image_size
    bh, bw = background.shape[-2:]
    new_w = int(h * bw / bh)
    background = processing.resize(background.float(), (h, new_w), "bilinear").clamp(0, 255).round()
    if new_w > w:
        start = (new_w - w) // 2
        background = background[..., start:start + w]
    if tuple(background.shape[-2:]) != (h, w):
        background = processing.resize(background, (h, w), "bilinear").clamp(0, 255).round()
    return background


def random_background(image: torch.Tensor, labels: torch.Tensor, background: torch.Tensor) -> torch.Tensor:
    """(3, H, W) grey levels: the person (labels > 0) pasted on the background, then recoloured to the background's
    Lab statistics (Reinhard's colour transfer, as the original's reinhard_alpha)."""
    alpha = (labels > 0).double()  # (H, W)
    composite = (alpha * image + (1 - alpha) * fit_background(background, image.shape[-2:])).trunc()
    lab = rgb_to_lab_uint8(composite)

    def mean_std(weights):
        total = weights.sum()
        mean = (lab * weights).sum((1, 2)) / total
        return mean, (((lab - mean.view(3, 1, 1)) ** 2 * weights).sum((1, 2)) / total).sqrt()
    if alpha.sum() == 0 or alpha.sum() == alpha.numel():
        return composite.float()  # NOTE: the original divides by a zero weight here (NaN colours); nothing to do
    bg_mean, bg_std = mean_std(1 - alpha)
    fg_mean, fg_std = mean_std(alpha)
    fg_std = fg_std.clamp(min=1e-6)
    ratio, offset = bg_std / fg_std, bg_mean - fg_mean * bg_std / fg_std
    transferred = lab_to_rgb_uint8((lab * ratio.view(3, 1, 1) + offset.view(3, 1, 1)).abs().round().clamp(0, 255))
    return (transferred * alpha + composite * (1 - alpha)).trunc().float()
