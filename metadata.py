"""Keypoint and class metadata (stored once, in data/*.json) and the one operation both the pose model
and post-processing need from it: mapping the heatmaps of a mirrored image back.

Imports only torch and the stdlib, so both heads.py and processing.py (which imports no model code) use it.
"""

import importlib.util
import json
from functools import lru_cache
from pathlib import Path

import torch

DATA_FILES = ("keypoints308.json", "seg29.json", "openpose.json")
INSTALLED_DATA = "sapiens2_data"  # what `pip install` names data/ in site-packages (pyproject.toml's package-dir)


def find_data_dir() -> Path:
    """data/ beside this file (a checkout, or an editable install), else the installed copy."""
    beside = Path(__file__).resolve().parent / "data"
    if beside.is_dir():
        return beside
    spec = importlib.util.find_spec(INSTALLED_DATA)
    return Path(next(iter(spec.submodule_search_locations))) if spec and spec.submodule_search_locations else beside


DATA_DIR = find_data_dir()


class MissingDataError(RuntimeError):
    """A data file of the package is missing or unreadable: the installation is incomplete."""


def read_data(name: str) -> dict:
    path = DATA_DIR / name
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise MissingDataError(
            f"sapiens2's data file {path} cannot be read ({type(error).__name__}: {error}): the installation is "
            f"incomplete; reinstall it (pip install --force-reinstall PATH_TO_THE_CHECKOUT) or run from the checkout"
        ) from None


def check_data_files():
    """Read every data file now, so that a broken installation stops a command before any model loads."""
    for name in DATA_FILES:
        read_data(name)


@lru_cache(maxsize=None)
def keypoint_metadata() -> dict:
    """The 308 keypoints: names, RGB colours, skeleton, flip indices/pairs, COCO-WholeBody mapping."""
    return read_data("keypoints308.json")


@lru_cache(maxsize=None)
def segmentation_metadata() -> dict:
    """The 29 body-part classes: names, RGB palette, training class weights."""
    return read_data("seg29.json")


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
