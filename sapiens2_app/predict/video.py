"""Videos for predict.py: frames decoded in order and pushed through the image pipeline in batches (never the
whole video in memory), per-frame files `OUT/NAME/000123.*`, one overlay video per picture kind at the source
frame rate, tracked (and optionally smoothed) people, `OUT/NAME.tracks.json`.

PyAV (`pip install av`) is optional: it is imported only when a video is read or written.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from PIL import Image

from sapiens2 import processing
from sapiens2_app.predict import formats, tracking
from sapiens2_app.common.artefacts import overlay_suffix
from sapiens2_app.predict.boxes import frame_keys_past_the_end
from sapiens2_app.predict.inference import resolved
from sapiens2_app.predict.inputs import InputImage, frame_name, frame_of
from sapiens2_app.predict.pipeline import Run, StopRun
from sapiens2_app.common.safe_io import atomic_write, hold, temporary_path

ENCODERS = ("libx264", "mpeg4")  # H.264 where FFmpeg has it, else MPEG-4 part 2 (in every FFmpeg build)
INSTALL_HINT = "pip install av  (or: pip install 'sapiens2[video]')"
H264_QUALITY = "18"  # x264 CRF: visually lossless for these pictures
DEFAULT_RATE = Fraction(30)  # when a file does not say its frame rate


def require_av():
    """The PyAV module, or an ImportError that says how to install it."""
    try:
        import av
    except ImportError:
        raise ImportError(f"reading and writing videos needs PyAV: {INSTALL_HINT}") from None
    return av


def check_video_file(path: Path):
    """The cheap part of reading a video, its header only (no frame decoded): the container opens and has a
    video stream. A ValueError naming the file otherwise (predict.py checks inputs with it before loading a model)."""
    av = require_av()
    try:
        with av.open(str(path)) as container:
            has_video = bool(container.streams.video)
    except Exception as error:  # noqa: BLE001 (whatever FFmpeg raises, this file's failure; as processing.decoding)
        raise ValueError(f"{path}: cannot be read as a video ({type(error).__name__}: {error})") from None
    if not has_video:
        raise ValueError(f"{path}: no video stream in it")


# ----------------------------------------------------------------------------------------------------
# Decoding
# ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FrameSelection:
    """--every N --start S --end E: frames S, S + N, S + 2N, ... before E (exclusive; None: to the end)."""
    every: int = 1
    start: int = 0
    end: int | None = None

    def selects(self, index: int) -> bool:
        return index >= self.start and not self.past(index) and (index - self.start) % self.every == 0

    def past(self, index: int) -> bool:
        return self.end is not None and index >= self.end

    def count(self, frames: int) -> int:
        """How many of `frames` frames are selected."""
        stop = frames if self.end is None else min(frames, self.end)
        return max(0, -(-(stop - self.start) // self.every))


def stream_rate(stream) -> Fraction:
    return Fraction(stream.average_rate or stream.guessed_rate or DEFAULT_RATE)


def expected_frames(path: Path, selection: FrameSelection) -> int:
    """The selected frames of a video by its header (for the progress bar); 0 when it does not say."""
    av = require_av()
    try:
        with av.open(str(path)) as container:
            stream = container.streams.video[0]
            frames = stream.frames or int(float(stream.duration * stream.time_base * stream_rate(stream))
                                          if stream.duration else 0)
    except Exception:  # noqa: BLE001 (the count is the progress bar's only: whatever reading the header raises
        return 0       # costs the bar its total, not the run; the video's own reading reports what is wrong)
    return selection.count(frames)


def decode(path: Path, selection: FrameSelection) -> Iterator[tuple[int, torch.Tensor | None]]:
    """(frame index, (3, H, W) uint8 RGB) of every frame, in order, one at a time; None for the pixels of a frame
    the selection skips (so the caller knows how far the video goes). Frames before --start are decoded and
    dropped (exact indices, no keyframe seeking); decoding stops at --end. Whatever the decoder raises is an
    ImageLoadError naming the file and the frame (processing.decoding): the video is damaged there."""
    av = require_av()
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"  # frame-parallel decoding; frames still come out in order
        frames = container.decode(stream)
        for index in itertools.count():
            if selection.past(index):
                break
            with processing.decoding(f"{path}: frame {index}"):
                frame = next(frames, None)
                if frame is None:
                    break
                pixels = (torch.from_numpy(frame.to_ndarray(format="rgb24")).permute(2, 0, 1).contiguous()
                          if selection.selects(index) else None)
            yield index, pixels


# ----------------------------------------------------------------------------------------------------
# Encoding
# ----------------------------------------------------------------------------------------------------
def pick_encoder(av) -> str:
    for name in ENCODERS:
        try:
            av.codec.Codec(name, "w")
            return name
        except (av.FFmpegError, ValueError):  # not in this FFmpeg build
            continue
    raise RuntimeError(f"FFmpeg has none of the video encoders {', '.join(ENCODERS)}")


class VideoWriter:
    """An MP4 written frame by frame to a temporary `.NAME.PID.RANDOM.held.partial` (safe_io's: unique per writer,
    locked while it writes, so --skip-existing removes it once its writer is gone, after a kill -9), renamed to
    NAME by `close` (an interrupted run leaves no file that looks complete). Frames of odd width/height are padded
    by one edge pixel (4:2:0 needs even); a frame of another size than the first is rescaled to it."""

    def __init__(self, path: Path, rate: Fraction):
        self.av = require_av()
        self.path, self.rate = path, rate
        self.partial = temporary_path(path, held=True)
        self.container = self.stream = self.lock = None
        self.size = None  # (width, height) of the first frame
        self.frames = 0

    def write(self, picture: Image.Image):
        if self.stream is None:
            self.size = picture.size
            self.open(picture.height, picture.width)
        if picture.size != self.size:  # the source changed its frame size mid-stream: the video keeps its first
            picture = picture.resize(self.size, Image.BILINEAR)
        pixels = np.asarray(picture.convert("RGB"))
        pixels = np.pad(pixels, ((0, pixels.shape[0] % 2), (0, pixels.shape[1] % 2), (0, 0)), mode="edge")
        frame = self.av.VideoFrame.from_ndarray(np.ascontiguousarray(pixels), format="rgb24")
        self.container.mux(self.stream.encode(frame))
        self.frames += 1

    def open(self, height: int, width: int):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.lock = hold(self.partial)  # created and locked here; FFmpeg writes into the same file
        self.container = self.av.open(str(self.partial), "w", format="mp4")
        encoder = pick_encoder(self.av)
        self.stream = self.container.add_stream(encoder, rate=self.rate)
        self.stream.width, self.stream.height = width + width % 2, height + height % 2
        self.stream.pix_fmt = "yuv420p"
        if encoder == "libx264":
            self.stream.options = {"crf": H264_QUALITY}
        else:  # MPEG-4's default 200 kb/s smears; ~2 bits per pixel-second of quality
            self.stream.bit_rate = max(400_000, int(2 * width * height * float(self.rate)))

    def close(self, keep: bool = True):
        """Flush and rename (keep), or drop the partial file."""
        if self.lock is None:  # no frame came: no file
            return
        try:
            if self.container is None:  # FFmpeg could not open it
                self.partial.unlink(missing_ok=True)
                return
            if keep:
                self.container.mux(self.stream.encode(None))
            self.container.close()
            if keep:
                self.partial.replace(self.path)
            else:
                self.partial.unlink(missing_ok=True)
        finally:
            self.lock.close()  # (a partial file left by an error is unlocked now: --skip-existing removes it)


class OverlayVideos:
    """OUT/NAME.seg_overlay.mp4, ... : one video per picture kind, a frame per processed frame."""

    def __init__(self, stem: Path, rate: Fraction, picture_suffixes: list[str]):
        self.writers = {suffix: VideoWriter(stem.with_name(stem.name + overlay_suffix(suffix)), rate)
                        for suffix in picture_suffixes}

    def add(self, pictures: dict, frame: torch.Tensor | None = None):
        """A frame's pictures; with `frame`, the source frame stands in for a picture its failed task lacks, so
        every overlay video keeps one frame per processed frame, in step with the source and each other."""
        for suffix, writer in self.writers.items():
            if suffix in pictures:
                writer.write(pictures[suffix])
            elif frame is not None:
                writer.write(Image.fromarray(frame.permute(1, 2, 0).numpy()))

    def close(self, keep: bool = True) -> list[str]:
        for writer in self.writers.values():
            writer.close(keep)
        return [w.path.name for w in self.writers.values() if w.frames and keep]


# ----------------------------------------------------------------------------------------------------
# A video through the pipeline
# ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class VideoSettings:
    selection: FrameSelection = FrameSelection()
    skip_existing: bool = False
    patience: int = tracking.DEFAULT_PATIENCE
    smoothing: tracking.OneEuroSettings | None = None
    picture_suffixes: tuple[str, ...] = ()  # the pictures that get an overlay video (empty: none)


def process_video(run: Run, clip: InputImage, settings: VideoSettings) -> dict:
    """A video's frames through the pipeline; one that cannot be read, or is damaged partway, is reported like a
    bad image (its frames before the damage are kept). Returns its summary for run.json."""
    try:
        summary = VideoRun(run, clip, settings).run()
    except StopRun:  # disk full, OUT read-only: the whole run stops (not this video alone)
        raise
    except Exception as error:  # noqa: BLE001 (as for images: one bad input must not end the run)
        summary = {"error": error}
    if "error" in summary:
        run.progress.total += 1  # the failure counts as one item done
        run.fail(clip, [(None, summary["error"])])
        summary["error"] = f"{type(summary['error']).__name__}: {summary['error']}"
    return summary


class VideoRun:
    """One video: frames in order -> batches -> the image pipeline; people tracked before their files are
    written, pictures encoded as they come, tracks.json at the end."""

    def __init__(self, run: Run, clip: InputImage, settings: VideoSettings):
        self.pipeline, self.outputs, self.clip, self.settings = run, run.outputs, clip, settings
        self.progress = run.progress
        self.name = self.outputs.names[clip]
        self.rate = self.probe_rate()
        self.tracker = (tracking.Tracker(float(self.rate), settings.patience, settings.smoothing)
                        if "pose" in self.outputs.tasks else None)
        self.overlays = OverlayVideos(self.outputs.stem(clip), self.rate, list(settings.picture_suffixes))
        self.index: dict = {}  # frame item -> frame index
        self.written = self.skipped = self.sent = 0  # frames written, skipped as done, sent to the pipeline
        self.decoded = 0  # frames decoded, selected or not
        self.first_size: tuple[int, int] | None = None  # (height, width) of the first selected frame
        self.size_change_noted = False

    def probe_rate(self) -> Fraction:
        av = require_av()
        with av.open(str(self.clip.path)) as container:
            return stream_rate(container.streams.video[0])

    def frame(self, index: int) -> InputImage:
        """A frame as an input item: `clip.mp4#12` (the --boxes key), written to OUT/clip/000012.*"""
        item = frame_of(self.clip, index)
        self.outputs.names[item] = frame_name(self.name, index)
        self.index[item] = index
        return item

    def run(self) -> dict:
        """Returns the video's summary for run.json; "error" when the file is damaged partway (the frames
        before the damage are written, overlays and tracks included)."""
        expected = expected_frames(self.clip.path, self.settings.selection)  # what the progress bar counted
        pending, completed, damaged = [], False, None
        try:
            try:
                for index, image in decode(self.clip.path, self.settings.selection):
                    self.decoded = index + 1
                    if image is None:  # not selected
                        continue
                    self.check_size(index, image)
                    item = self.frame(index)
                    if self.settings.skip_existing and self.outputs.all_written(item):
                        self.flush(pending)
                        if self.resume(item):
                            continue
                    pending.append((item, image))
                    if len(pending) == self.pipeline.inference.batch_size:
                        self.flush(pending)
            except processing.ImageLoadError as error:  # (decode's: the video is damaged at that frame)
                damaged = error
            self.flush(pending)
            self.pipeline.drain()  # every frame's files and overlay frames written
            completed = True
        except KeyboardInterrupt:
            self.pipeline.abandon()  # what waits is dropped: the overlays are closed next, not written to
            raise
        except Exception:
            self.pipeline.drain()  # the frames computed before the error are written (a StopRun from that wins)
            raise
        finally:
            self.progress.total += self.sent - expected
            overlays = self.overlays.close(keep=completed)
            if completed and self.tracker is not None:
                atomic_write(self.outputs.out / f"{self.name}.tracks.json", self.tracks_json())
        if completed and damaged is None and self.sent + self.skipped < expected:  # FFmpeg ends truncated files quietly
            self.progress.note(f"warning: {self.clip.path}: {self.sent + self.skipped} of the {expected} selected "
                               f"frames its header announces were decoded (a truncated file?)")
        if completed and damaged is None:
            for warning in self.past_the_end_warnings():
                self.progress.note(warning)
        summary = {"frames_written": self.written, "frames_skipped_existing": self.skipped, "fps": float(self.rate),
                   "frames_announced": expected, "overlays": overlays,
                   "tracks": len(self.tracker.tracks) if self.tracker else None}
        return summary if damaged is None else {**summary, "error": damaged}

    def check_size(self, index: int, image: torch.Tensor):
        """Each frame is processed at its own size; the overlay videos keep the first (VideoWriter): say so once."""
        size = tuple(image.shape[1:])
        self.first_size = self.first_size or size
        if size != self.first_size and self.settings.picture_suffixes and not self.size_change_noted:
            (h, w), (h0, w0) = size, self.first_size
            self.progress.note(f"note: {self.clip.path}: the frame size changes at frame {index} ({w}x{h}, before "
                               f"{w0}x{h0}): each frame's files keep its own size, the overlay videos show such "
                               f"frames rescaled to {w0}x{h0}")
            self.size_change_noted = True

    def past_the_end_warnings(self) -> list[str]:
        """--start, and --boxes frame keys, past the last frame of a video decoded to its end."""
        selection = self.settings.selection
        if selection.end is not None and self.decoded >= selection.end:  # stopped at --end: its length is unknown
            return []
        warnings = []
        if self.decoded <= selection.start:
            warnings.append(f"warning: {self.clip.path}: --start {selection.start} is past its last frame (it has "
                            f"{self.decoded}): no frame of it was processed")
        if keys := frame_keys_past_the_end(self.pipeline.inference.boxes, self.clip, self.decoded):
            named = ", ".join(map(repr, keys[:3])) + (", ..." if len(keys) > 3 else "")
            warnings.append(f"warning: --boxes: {named} {'match' if len(keys) > 1 else 'matches'} no frame: "
                            f"{self.clip.path} has {self.decoded} (#0 to #{self.decoded - 1})")
        return warnings

    def flush(self, pending: list):
        if pending:
            self.sent += len(pending)
            done = self.pipeline.infer(list(pending))
            for item, image, result in done:
                self.write(item, image, result)
            computed = {item for item, _, _ in done}
            self.pipeline.later(lambda frames=[item for item, _ in pending if item not in computed]: self.forget(frames))
            pending.clear()

    def forget(self, items: list):
        """Frames done: their names go, so a long video's bookkeeping stays small."""
        for item in items:
            self.outputs.names.pop(item, None)
            self.index.pop(item, None)

    def write(self, item: InputImage, image: torch.Tensor, result: dict):
        """The frame's files (people tracked first: ids, and smoothing, go into pose.json), then its pictures into
        the overlay videos, in frame order (the source frame where a task failed, so they keep one frame per
        processed frame)."""
        if self.tracker is not None and "pose" in result:  # tracked now, in frame order: decoded now
            result["pose"] = resolved(result["pose"])
            if isinstance(result["pose"], dict):  # not a failed pose
                self.tracker.update(self.index[item], result["pose"]["people"])

        def into_overlays(written: dict, complete: bool):
            if written or complete:
                self.overlays.add(written, image)
            else:  # nothing written (a write error): the frame keeps its place; a full disk may fail this too
                with contextlib.suppress(Exception):
                    self.overlays.add({}, image)
            self.written += complete  # as run.json's counts: a frame with a failed task is a failed frame
            self.forget([item])

        self.pipeline.write(item, image, result, then=into_overlays)

    def resume(self, item) -> bool:
        """A frame an earlier run wrote: its people and pictures read back, so tracks, overlay videos and the
        COCO results carry on as in one run. False, with a warning, when its pose.json is there but cannot be
        read (damaged): the frame is then run again. (Without --save json there is none to read.)"""
        pose = self.outputs.path(item, ".pose.json")
        if (self.tracker is not None or self.outputs.coco is not None) and pose.exists():
            try:
                image, people = formats.read_pose_json(pose)
            except ValueError as error:
                message = f"warning: {error}; running frame {self.index[item]} of {self.clip.path} again"
                self.pipeline.later(lambda: self.progress.note(message))
                return False
            if self.tracker is not None:
                self.tracker.restore(self.index[item], people)
        else:
            image = people = None
        self.skipped += 1
        pictures = {}
        for suffix in self.settings.picture_suffixes:
            path = self.outputs.path(item, suffix)
            if path.exists():
                with Image.open(path) as picture:
                    pictures[suffix] = picture.convert("RGB")

        def carry_on():  # in order with the frames before it (written where later() runs)
            if self.outputs.coco is not None and people is not None:
                self.outputs.coco.add(self.outputs.names[item], image, people)
            self.overlays.add(pictures)
            self.forget([item])

        self.pipeline.later(carry_on)
        return True

    def tracks_json(self) -> dict:
        return {"video": self.clip.relative, "fps": float(self.rate), "frames_processed": self.tracker.step,
                "patience": self.settings.patience,
                "smoothing": dataclasses.asdict(self.settings.smoothing) if self.settings.smoothing else None,
                "tracks": self.tracker.summary()}
