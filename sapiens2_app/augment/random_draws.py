"""The random numbers of a training sample's augmentation, drawn from the sample's own torch generator (datasets.py
seeds one per sample), each as the original draws it (Python's random, numpy, scipy's truncnorm): the primitives,
and the photometric distortion's choices, which the pose and the dense pipelines both draw."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Photometric:
    """PhotoMetricDistortion's choices (engine/datasets/transforms/common_transforms.py:72); None: part skipped."""
    brightness: float | None  # added, in [-32, 32]
    contrast: float | None  # factor in [0.5, 1.5]
    contrast_first: bool  # contrast before saturation and hue (its `mode == 1`), else after them
    saturation: float | None  # factor on HSV's S in [0.5, 1.5]
    hue: int | None  # added to HSV's H (0..179), in [-18, 18]


def uniform(generator: torch.Generator, low: float, high: float) -> float:
    return low + (high - low) * torch.rand((), generator=generator).item()


def chance(generator: torch.Generator, p: float) -> bool:
    return torch.rand((), generator=generator).item() < p


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
