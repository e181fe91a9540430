"""Keypoint and class metadata (stored once, in data/*.json) and the one operation both the pose model
and post-processing need from it: mapping the heatmaps of a mirrored image back.

Imports only torch and the stdlib, so both heads.py and processing.py (which imports no model code) use it.
"""

import json
from functools import lru_cache
from pathlib import Path

import torch

DATA_DIR = Path(__file__).resolve().parent / "data"


@lru_cache(maxsize=None)
def keypoint_metadata() -> dict:
    """The 308 keypoints: names, RGB colours, skeleton, flip indices/pairs, COCO-WholeBody mapping."""
    return json.loads((DATA_DIR / "keypoints308.json").read_text())


@lru_cache(maxsize=None)
def segmentation_metadata() -> dict:
    """The 29 body-part classes: names, RGB palette, training class weights."""
    return json.loads((DATA_DIR / "seg29.json").read_text())


def flip_pairs(device=None) -> torch.Tensor:
    """(146, 2) left/right keypoint pairs of the 308 (the other 16 keypoints are their own mirror)."""
    return torch.tensor(keypoint_metadata()["flip_pairs"], device=device)


def flip_heatmaps_back(heatmaps: torch.Tensor, pairs: torch.Tensor | None = None) -> torch.Tensor:
    """Heatmaps of a mirrored image -> heatmaps of the image: swap left/right channels, mirror x.
    No half-pixel shift is needed with UDP heatmaps. `pairs` (P, 2) defaults to the 308-keypoint pairs."""
    pairs = flip_pairs(heatmaps.device) if pairs is None else torch.as_tensor(pairs, device=heatmaps.device)
    order = torch.arange(heatmaps.shape[1], device=heatmaps.device)
    if pairs.numel() and int(pairs.max()) >= heatmaps.shape[1]:
        raise ValueError(f"flip pairs index keypoint {int(pairs.max())}, heatmaps have {heatmaps.shape[1]} channels")
    order[pairs[:, 0]], order[pairs[:, 1]] = pairs[:, 1], pairs[:, 0]
    return heatmaps[:, order].flip(-1)
