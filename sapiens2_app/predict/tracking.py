"""Who is who across the frames of a video, and keypoints without jitter.

- Tracking: each frame's people are matched greedily to the tracks of the previous frames, best pair first,
  by the larger of the IoU of their boxes and the OKS of their keypoints (COCO's object keypoint similarity,
  with the 308 keypoints' sigmas); a pair counts from MIN_SIMILARITY. Unmatched people start new tracks;
  a track that finds nobody for more than `patience` processed frames ends, and its id is never reused.
- Smoothing: a One-Euro filter (Casiez, Roussel and Vogel, CHI 2012) per track and keypoint coordinate. It
  low-passes each coordinate with a cutoff that rises with its speed: strong smoothing when still (no jitter),
  little when moving (no lag). The raw keypoints are kept beside the smoothed ones.

Works on predict.py's person dicts ({"keypoints" (K, 2), "scores" (K,), "bbox" (4,) xyxy, ...}) in place.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from sapiens2.processing import keypoint_metadata

MIN_SIMILARITY = 0.3  # below this IoU and OKS, two people are not the same person
VISIBLE_SCORE = 0.3  # OKS counts the keypoints scored above this in both people (the pictures' threshold)
DEFAULT_PATIENCE = 10  # processed frames a track may miss (a third of a second at 30 fps, every frame)


# ----------------------------------------------------------------------------------------------------
# Similarity
# ----------------------------------------------------------------------------------------------------
def box_iou(a: np.ndarray, b: np.ndarray) -> float:
    """Intersection over union of two xyxy boxes."""
    width = min(a[2], b[2]) - max(a[0], b[0])
    height = min(a[3], b[3]) - max(a[1], b[1])
    inter = max(width, 0.0) * max(height, 0.0)
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return float(inter / union) if union > 0 else 0.0


def keypoint_similarity(xy_a, scores_a, xy_b, scores_b, area: float, sigmas: np.ndarray) -> float:
    """COCO's OKS, mean of exp(-d^2 / (2 area (2 sigma)^2)) over the keypoints visible in both; 0 if none."""
    visible = (scores_a > VISIBLE_SCORE) & (scores_b > VISIBLE_SCORE)
    if not visible.any() or area <= 0:
        return 0.0
    squared = ((xy_a - xy_b) ** 2).sum(axis=-1)[visible]
    return float(np.exp(-squared / (2 * area * (2 * sigmas[visible]) ** 2)).mean())


# ----------------------------------------------------------------------------------------------------
# One-Euro filter
# ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class OneEuroSettings:
    """min_cutoff (Hz): the cutoff when still; lower = smoother and slower. beta: how fast the cutoff rises
    with speed, speed measured in person heights (the box) per second, so the same settings fit any
    resolution. d_cutoff (Hz): the cutoff of the speed estimate itself.

    Defaults, measured on synthetic tracks at 30 fps (tests/test_video.py): the jitter of a keypoint held
    still (Gaussian, 0.5% of the person's height per frame) falls to a third; a keypoint moving at half a
    person height per second lags by 0.85 frames, at one height per second by 0.55 frames (beta 10: jitter
    0.39, lags 0.55 and 0.33; beta 3: 0.33, lags 1.1 and 0.76)."""
    min_cutoff: float = 1.0
    beta: float = 5.0
    d_cutoff: float = 1.0


def smoothing_factor(cutoff, elapsed: float):
    """The exponential smoothing weight of the new sample for a first-order low-pass at `cutoff` Hz."""
    tau = 1.0 / (2 * math.pi * cutoff)
    return 1.0 / (1.0 + tau / elapsed)


class OneEuroFilter:
    """One filter per coordinate of an array (here (K, 2) keypoints); samples at increasing times (seconds)."""

    def __init__(self, settings: OneEuroSettings):
        self.settings = settings
        self.time = self.value = self.speed = None

    def __call__(self, time: float, value: np.ndarray, scale: float = 1.0) -> np.ndarray:
        value = np.asarray(value, np.float64)
        if self.value is None or time <= self.time:  # the first sample (or a repeated time) passes through
            self.time, self.value, self.speed = time, value, np.zeros_like(value)
            return value
        elapsed, s = time - self.time, self.settings
        speed = (value - self.value) / elapsed / max(scale, 1e-6)  # person heights per second
        self.speed = self.speed + smoothing_factor(s.d_cutoff, elapsed) * (speed - self.speed)
        cutoff = s.min_cutoff + s.beta * np.abs(self.speed)
        self.value = self.value + smoothing_factor(cutoff, elapsed) * (value - self.value)
        self.time = time
        return self.value


# ----------------------------------------------------------------------------------------------------
# Tracks
# ----------------------------------------------------------------------------------------------------
@dataclass
class Track:
    track_id: int
    box: np.ndarray  # xyxy of the last match
    keypoints: np.ndarray  # (K, 2) raw, of the last match
    scores: np.ndarray  # (K,)
    last_step: int  # the processed-frame count when last matched
    frames: list[int] = field(default_factory=list)  # frame indices
    people: list[int] = field(default_factory=list)  # the person's position in that frame's pose.json
    filter: OneEuroFilter | None = None


def person_arrays(person: dict, key: str = "keypoints") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return (torch.as_tensor(person["bbox"]).double().numpy(), torch.as_tensor(person[key]).double().numpy(),
            torch.as_tensor(person["scores"]).double().numpy())


class Tracker:
    """Track ids for the people of consecutive processed frames (call `update` in frame order); with
    `smoothing`, the keypoints of each tracked person are One-Euro filtered (`keypoints_raw` keeps them)."""

    def __init__(self, rate: float, patience: int = DEFAULT_PATIENCE, smoothing: OneEuroSettings | None = None):
        self.rate, self.patience, self.smoothing = float(rate), patience, smoothing
        self.sigmas = np.asarray(keypoint_metadata()["sigmas"], np.float64)
        self.tracks: list[Track] = []
        self.step, self.next_id = 0, 0

    def update(self, index: int, people: list[dict]):
        """Frame `index`'s people get "track_id" (and smoothed "keypoints" + "keypoints_raw")."""
        self.step += 1
        active = [t for t in self.tracks if self.step - t.last_step - 1 <= self.patience]
        arrays = [person_arrays(person) for person in people]
        pairs = sorted(((self.similarity(track, *array), -track.track_id, -p)
                        for track in active for p, array in enumerate(arrays)), reverse=True)
        matched, taken = {}, set()
        for similarity, negative_id, negative_p in pairs:
            track_id, p = -negative_id, -negative_p
            if similarity >= MIN_SIMILARITY and p not in matched and track_id not in taken:
                matched[p] = track_id
                taken.add(track_id)
        by_id = {t.track_id: t for t in self.tracks}
        for p, (person, array) in enumerate(zip(people, arrays)):
            track = by_id[matched[p]] if p in matched else self.new_track()
            self.follow(track, index, p, person, *array)

    def restore(self, index: int, people: list[dict]):
        """A frame whose pose.json an earlier run wrote (--skip-existing): its ids as they were, and the
        filters fed its raw keypoints, so the frames after it continue exactly as in one run."""
        self.step += 1
        by_id = {t.track_id: t for t in self.tracks}
        for p, person in enumerate(people):
            if "track_id" not in person:
                continue
            track = by_id.get(person["track_id"]) or self.new_track(person["track_id"])
            key = "keypoints_raw" if "keypoints_raw" in person else "keypoints"
            box, raw, scores = person_arrays(person, key)
            smoothed = person["keypoints"]
            self.follow(track, index, p, person, box, raw, scores)
            person["keypoints"] = smoothed  # what the file says

    def similarity(self, track: Track, box, keypoints, scores) -> float:
        iou = box_iou(track.box, box)
        if len(keypoints) != len(self.sigmas):  # a keypoint set of your own (train.py): no sigmas, boxes only
            return iou
        area = (track.box[2] - track.box[0]) * (track.box[3] - track.box[1])
        return max(iou, keypoint_similarity(track.keypoints, track.scores, keypoints, scores, area, self.sigmas))

    def new_track(self, track_id: int | None = None) -> Track:
        track_id = self.next_id if track_id is None else track_id
        self.next_id = max(self.next_id, track_id + 1)
        track = Track(track_id, np.zeros(4), np.zeros((0, 2)), np.zeros(0), self.step,
                      filter=OneEuroFilter(self.smoothing) if self.smoothing else None)
        self.tracks.append(track)
        return track

    def follow(self, track: Track, index: int, p: int, person: dict, box, keypoints, scores):
        track.box, track.keypoints, track.scores, track.last_step = box, keypoints, scores, self.step
        track.frames.append(index)
        track.people.append(p)
        person["track_id"] = track.track_id
        if track.filter is not None:
            height = box[3] - box[1]
            smoothed = track.filter(index / self.rate, keypoints, scale=height if height > 0 else 1.0)
            person["keypoints_raw"] = person["keypoints"]
            person["keypoints"] = torch.from_numpy(smoothed).to(torch.as_tensor(person["keypoints"]).dtype)

    def summary(self) -> list[dict]:
        """tracks.json: per track its frames and the person's position in each frame's pose.json."""
        return [{"track_id": t.track_id, "frames": t.frames, "people": t.people}
                for t in sorted(self.tracks, key=lambda t: t.track_id)]


def json_fields(person: dict) -> dict:
    """What a tracked person adds to pose.json: "track_id", and "keypoints_raw" ([x, y, score] x 308, as
    "keypoints") when smoothed."""
    fields = {}
    if "track_id" in person:
        fields["track_id"] = int(person["track_id"])
    if "keypoints_raw" in person:
        raw, scores = torch.as_tensor(person["keypoints_raw"]).tolist(), torch.as_tensor(person["scores"]).tolist()
        fields["keypoints_raw"] = [[round(x, 2), round(y, 2), round(s, 4)] for (x, y), s in zip(raw, scores)]
    return fields
