"""What each task writes (the one table of output files), and the names derived from it.

    ARTEFACTS["seg"] == {".seg.png": {"raw"}, ".seg_overlay.jpg": {"vis"}}    # suffix -> the --save kinds asking for it
"""

from __future__ import annotations

from sapiens2 import heads

TASKS = (*heads.TASKS, "features")
KINDS = ("raw", "json", "vis", "openpose", "coco", "ply", "depth16")
DEFAULT_KINDS = ("raw", "json", "vis")  # the others are other tools' formats (formats.py), written when asked
ARTEFACTS = {
    "seg": {".seg.png": {"raw"}, ".seg_overlay.jpg": {"vis"}},
    "pose": {".pose.json": {"json"}, ".pose_overlay.jpg": {"vis"}, "_keypoints.json": {"openpose"}},
    "normal": {".normal.npy": {"raw"}, ".normal.png": {"vis"}},
    "pointmap": {".pointmap.npy": {"raw"}, ".depth.png": {"vis"}, ".pointmap.ply": {"ply"},
                 ".depth16.png": {"depth16"}},
    "matting": {".alpha.png": {"raw"}, ".composite.jpg": {"vis"}},
    "albedo": {".albedo.png": {"raw", "vis"}},
    "features": {".features.safetensors": {"raw"}},
}
MASKED_TASKS = ("normal", "pointmap", "albedo")  # what --mask-with-seg masks


def overlay_suffix(picture_suffix: str) -> str:
    """`.seg_overlay.jpg` -> `.seg_overlay.mp4`: the overlay video of a picture kind."""
    return picture_suffix.rsplit(".", 1)[0] + ".mp4"


PICTURE_SUFFIXES = tuple(s for files in ARTEFACTS.values() for s, kinds in files.items() if "vis" in kinds)
OUTPUT_SUFFIXES = (tuple(suffix for files in ARTEFACTS.values() for suffix in files)
                   + tuple(overlay_suffix(s) for s in PICTURE_SUFFIXES))  # + a video's overlay videos
