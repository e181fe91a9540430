"""What a run reads and where its files go: inputs (files, folders, globs, list files) -> InputImage (path, relative
name), the output name of each (distinct, inside OUT), the share of each process (sharding), and video frames as
inputs (`clip.mp4#12`: the frame key, built and read here only).
"""

from __future__ import annotations

import glob
import os
import posixpath
import re
import sys
from dataclasses import dataclass, replace
from pathlib import Path, PurePosixPath

from sapiens2_app.common.artefacts import OUTPUT_SUFFIXES
from sapiens2_app.common.cli import UsageError

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff", ".gif", ".ppm", ".pgm"}
VIDEO_SUFFIXES = {".mp4", ".mov", ".avi", ".mkv", ".webm", ".m4v"}
LIST_SUFFIXES = {".txt", ".lst", ".list"}
FRAME_KEY = re.compile(r"(.+)#(\d+)")  # a video frame's input name: `REL#N`


def is_video(path: Path) -> bool:
    return path.suffix.lower() in VIDEO_SUFFIXES


@dataclass(frozen=True)
class InputImage:
    path: Path
    relative: str  # the path relative to its input root, e.g. "a/b.jpg"; outputs go to OUT/a/b.<suffix>

    @property
    def stem(self) -> str:
        return PurePosixPath(self.relative).with_suffix("").as_posix()


def collect_inputs(specs: list[str], exclude: Path | None = None) -> list[InputImage]:
    """All images of the inputs, deduplicated, sorted by relative path (the order sharding splits).
    An existing path is taken literally, even with glob characters in its name (`shot [1].jpg`)."""
    files = [s for s in specs if Path(s).is_file() and not is_list_file(s)]
    items = relative_to_common([Path(f) for f in files])
    for spec in specs:
        if spec in files:
            continue
        found = expand_input(spec, exclude)
        if not found:
            print(f"warning: {spec}: no images found", file=sys.stderr)
        items += found
    unique = {item.path.resolve(): item for item in reversed(items)}  # the first mention wins
    items = sorted(unique.values(), key=lambda item: item.relative)
    clashes = [a.relative for a, b in zip(items, items[1:]) if a.relative == b.relative]
    if clashes:
        raise UsageError(f"different inputs would write the same outputs ({', '.join(clashes[:3])}); "
                         f"run them separately or with different -o folders")
    if not items:
        raise UsageError(f"no images found in {' '.join(specs)}")
    return items


def is_list_file(spec: str) -> bool:
    return Path(spec).suffix.lower() in LIST_SUFFIXES


def expand_input(spec: str, exclude: Path | None = None) -> list[InputImage]:
    path = Path(spec)
    if path.is_dir():  # rglob does not follow symlinked folders: a symlink loop cannot trap it
        paths = [p for p in sorted(path.rglob("*")) if wanted(p, exclude)
                 and not any(part.startswith(".") for part in p.relative_to(path).parts)]
        return [InputImage(p, p.relative_to(path).as_posix()) for p in paths]
    if path.is_file() and is_list_file(spec):
        return read_list_file(path, exclude)
    if path.is_file():
        return relative_to_common([path])
    if glob.has_magic(spec):
        return expand_glob(spec, exclude)
    raise UsageError(f"{spec}: no such file or folder")


def expand_glob(spec: str, exclude: Path | None) -> list[InputImage]:
    """A glob's images, named below its static part. pathlib's `**` does not follow symlinked folders (glob.glob's
    does, forever in a symlink loop). A name that would climb out of the static part (`photos/*/../../img/a.jpg`)
    is replaced by the names below the matches' common folder, so outputs always stay under OUT."""
    base, pattern = glob_base(spec)
    if Path(pattern).name == "**":  # pathlib's trailing `**` gives folders only; glob's gave everything below
        pattern = str(Path(pattern) / "*")
    hidden = lambda part: part.startswith(".") and part not in (".", "..")  # noqa: E731
    hidden_ok = any(hidden(part) for part in Path(pattern).parts)  # asked for: `photos/.cache/*.jpg`
    paths = [p for p in sorted(base.glob(pattern)) if wanted(p, exclude)
             and (hidden_ok or not any(hidden(part) for part in p.relative_to(base).parts))]
    names = [posixpath.normpath(p.relative_to(base).as_posix()) for p in paths]
    if any(climbs_out(name) for name in names):
        return relative_to_common(paths)
    return [InputImage(p, name) for p, name in zip(paths, names)]


def climbs_out(name: str) -> bool:
    """Would OUT/name land outside OUT?"""
    name = posixpath.normpath(name)
    return posixpath.isabs(name) or name == ".." or name.startswith("../")


def wanted(path: Path, exclude: Path | None) -> bool:
    """An image file by its name, and not one of our pictures in the output folder `exclude` (with -o inside
    the input folder, a second run would otherwise take the first one's overlays for photos)."""
    if not path.is_file() or not (path.suffix.lower() in IMAGE_SUFFIXES or is_video(path)):  # is_file: False for a symlink loop
        return False
    return not (path.name.endswith(OUTPUT_SUFFIXES) and exclude is not None and path.resolve().is_relative_to(exclude))


def glob_base(pattern: str) -> tuple[Path, str]:
    """(the folder part of a glob before its first wildcard, the rest): outputs mirror the paths below it."""
    parts = Path(pattern).parts
    first = next(i for i, p in enumerate(parts) if glob.has_magic(p))
    return Path(*parts[:first]) if first else Path("."), str(Path(*parts[first:]))


def read_list_file(path: Path, exclude: Path | None) -> list[InputImage]:
    """One image path (or folder) per line, relative to the list file's folder; blank lines and # comments skipped."""
    try:
        lines = [line.strip() for line in path.read_text().splitlines()]
    except (OSError, UnicodeDecodeError) as error:
        why = (error.strerror or str(error)) if isinstance(error, OSError) else "not a text file"
        raise UsageError(f"{path}: cannot read this list of inputs ({why})") from None
    entries = [path.parent / line for line in lines if line and not line.startswith("#")]
    missing = [str(e) for e in entries if not e.exists()]
    if missing:
        raise UsageError(f"{path}: {len(missing)} listed paths do not exist, e.g. {missing[:3]}")
    items = relative_to_common([e for e in entries if e.is_file()])
    for folder in (e for e in entries if e.is_dir()):
        items += expand_input(str(folder), exclude)
    return items


def relative_to_common(paths: list[Path]) -> list[InputImage]:
    """Files named relative to their common folder, so `a/x.jpg b/x.jpg` -> `a/x`, `b/x` (no clash)."""
    if not paths:
        return []
    base = Path(os.path.commonpath([str(p.resolve().parent) for p in paths]))
    return [InputImage(p, p.resolve().relative_to(base).as_posix()) for p in paths]


def output_names(items: list[InputImage]) -> dict[InputImage, str]:
    """Output name of each image, distinct for every input (compared case-blind, for macOS and Windows
    disks): its relative path without the suffix; where two clash, with it (`x.jpg`, `x.png` -> `x.jpg.*`,
    `x.png.*`); where that still clashes (`x.jpg.png` -> `x.jpg`), the relative path + `~2`, `~3`, ..."""
    names = {item: item.stem for item in items}
    clashing = set().union(*clashes(names).values())
    names.update({item: item.relative for item in clashing})
    for group in clashes(names).values():
        taken = {name.casefold() for name in names.values()}
        for item in sorted(group, key=lambda item: item.relative)[1:]:
            candidates = [item.relative] + [f"{item.relative}~{n}" for n in range(2, len(items) + 2)]
            names[item] = next(name for name in candidates if name.casefold() not in taken)
            taken.add(names[item].casefold())
    for clip in sorted((item for item in items if is_video(item.path)), key=lambda item: item.relative):
        if claims_folder_of_others(names, clip):  # OUT/clip/000000.* of clip.mp4 and of an image clip/000000.png
            taken = {name.casefold() for name in names.values()}
            candidates = [clip.relative] + [f"{clip.relative}~{n}" for n in range(2, len(items) + 2)]
            names[clip] = next(name for name in candidates if name.casefold() not in taken
                               and not claims_folder_of_others({**names, clip: name}, clip))
    escaping = [name for name in names.values() if climbs_out(name)]
    if escaping:  # collect_inputs never makes such names: a last guard that nothing is written outside OUT
        raise UsageError(f"output name {escaping[0]!r} would be outside the output folder")
    return names


def claims_folder_of_others(names: dict[InputImage, str], clip: InputImage) -> bool:
    """A video writes its frames into the folder OUT/NAME/: does another input's output name lie in it?"""
    folder = names[clip].casefold() + "/"
    return any(name.casefold().startswith(folder) for item, name in names.items() if item != clip)


def clashes(names: dict[InputImage, str]) -> dict[str, list[InputImage]]:
    """Groups of inputs whose output names are equal, ignoring case."""
    groups: dict[str, list[InputImage]] = {}
    for item, name in names.items():
        groups.setdefault(name.casefold(), []).append(item)
    return {key: group for key, group in groups.items() if len(group) > 1}


def shard(items: list, rank: int, world_size: int) -> list:
    """Rank r of N takes items r, r + N, r + 2N, ... of the sorted list: disjoint, together complete."""
    return items[rank::world_size]


# ----------------------------------------------------------------------------------------------------
# Video frames as inputs
# ----------------------------------------------------------------------------------------------------
def frame_of(clip: InputImage, index: int) -> InputImage:
    """Frame `index` of a video as an input: `clip.mp4#12` (also its --boxes key)."""
    return replace(clip, path=Path(f"{clip.path}#{index}"), relative=f"{clip.relative}#{index}")


def frame_name(video_name: str, index: int) -> str:
    """The output name of a frame: `clip/000123` (zero-based index, six digits)."""
    return f"{video_name}/{index:06d}"


def clip_of_frame_key(key: str) -> str | None:
    """`clip.mp4#12` -> `clip.mp4`; None for a key that names no frame."""
    match = FRAME_KEY.fullmatch(key)
    return match[1] if match else None
