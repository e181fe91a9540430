"""Where issues 12 (reliability), 15 (video, tracking, formats) and 17 (detector) meet in predict.py: videos
under failing tasks and full disks, video options checked before loading, detector boxes on frames, --boxes
keys of frames, output names of a video beside a folder of frames, overlay temporaries, --save coco alone."""

import errno
import json
import os
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import predict
from sapiens2 import weights
from sapiens2_app.common import safe_io
from sapiens2_app.detector import detector
from sapiens2_app.predict import inference, models, video
from test_predict import model_args, tiny_model, write_images
from test_reliability import error_lines, faulty_writer, no_partials, strict_json
from test_video import av, make_video, person_boxes, read_video, requires_av

FRAMES = 4


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("checkpoints")
    torch.manual_seed(0)
    return {task: weights.save(tiny_model(task), folder / f"{task}.safetensors") for task in ("seg", "pose")}


@pytest.fixture(scope="module")
def clip(tmp_path_factory) -> Path:
    if av is None:
        pytest.skip("PyAV is not installed (pip install av)")
    return make_video(tmp_path_factory.mktemp("videos") / "clip.mp4", FRAMES)


def partials(root: Path) -> list[str]:
    return sorted(p.name for p in root.rglob("*") if "partial" in p.name)


# ----------------------------------------------------------------------------------------------------
# Video options: checked with the other arguments, before OUT is made or any model loads (issue 12's rule)
# ----------------------------------------------------------------------------------------------------
@requires_av
@pytest.mark.parametrize("option,value", [("--every", "0"), ("--start", "-1"), ("--end", "0"),
                                          ("--track-patience", "-1"), ("--smooth-min-cutoff", "0"),
                                          ("--smooth-min-cutoff", "nan"), ("--smooth-beta", "inf"),
                                          ("--smooth-beta", "nan")])
def test_video_options_are_checked_before_anything_loads(option, value, clip, tmp_path, monkeypatch, capsys):
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the arguments were checked")

    monkeypatch.setattr(models, "load_models", refuse)
    monkeypatch.setattr(models, "load_detector", refuse)
    out = tmp_path / "out"
    assert predict.main(["pose", str(clip), "-o", str(out), "--smooth", option, value]) == 2
    (line,) = error_lines(capsys.readouterr().err)
    assert option in line
    assert not out.exists()


# ----------------------------------------------------------------------------------------------------
# --boxes keys of video frames (REL#N) match their video: no "matches no input" warning
# ----------------------------------------------------------------------------------------------------
@requires_av
def test_frame_box_keys_are_not_reported_as_unmatched(checkpoints, clip, tmp_path, capsys):
    boxes = tmp_path / "boxes.json"
    boxes.write_text(json.dumps({**{f"clip.mp4#{i}": person_boxes(i) for i in range(2)},
                                 "other.mp4#0": [[1, 1, 5, 5]]}))
    out = tmp_path / "out"
    assert predict.main(["pose", str(clip), "-o", str(out), "--boxes", str(boxes), "--end", "2", "--no-flip",
                         "--save", "json", *model_args(checkpoints, ["pose"])]) == 0
    warnings = strict_json(out / "run.json")["warnings"]
    assert len(warnings) == 1 and "1 entries match no input" in warnings[0] and "other.mp4#0" in warnings[0]
    assert strict_json(out / "clip" / "000001.pose.json")["box_source"] == "boxes-file"


# ----------------------------------------------------------------------------------------------------
# A video's frame folder OUT/clip/ and a folder of images named clip/ in the same run
# ----------------------------------------------------------------------------------------------------
@requires_av
def test_a_video_and_a_folder_of_its_frames_write_apart(checkpoints, clip, tmp_path, capsys):
    folder = tmp_path / "in"
    (folder / "clip").mkdir(parents=True)
    (folder / "clip.mp4").write_bytes(clip.read_bytes())
    Image.fromarray(np.full((30, 20, 3), 200, np.uint8)).save(folder / "clip" / "000000.png")  # not a frame of it
    out = tmp_path / "out"
    assert predict.main(["seg", str(folder), "-o", str(out), "--end", "1", "--save", "raw",
                         *model_args(checkpoints, ["seg"])]) == 0
    maps = sorted(p.relative_to(out).as_posix() for p in out.rglob("*.seg.png"))
    assert len(maps) == 2, maps  # one for the photo, one for the video's frame 0: neither overwrote the other
    shapes = sorted(Image.open(out / name).size for name in maps)
    assert shapes == [(20, 30), (96, 64)]
    assert all((out / name).resolve().is_relative_to(out.resolve()) for name in maps)


# ----------------------------------------------------------------------------------------------------
# A failing pose on one frame: the frame's other tasks, tracks, overlays, COCO and OpenPose files carry on
# ----------------------------------------------------------------------------------------------------
@requires_av
def test_a_frame_whose_pose_fails(checkpoints, clip, tmp_path, monkeypatch, capsys):
    real, calls = inference.run_pose, []

    def pose_fails_on_the_second_frame(ctx, images, boxes):
        calls.append(len(images))
        if len(calls) == 2:
            raise RuntimeError("simulated pose failure")
        return real(ctx, images, boxes)

    monkeypatch.setattr(inference, "run_pose", pose_fails_on_the_second_frame)
    boxes = tmp_path / "boxes.json"
    boxes.write_text(json.dumps({f"clip.mp4#{i}": person_boxes(i) for i in range(FRAMES)}))
    out = tmp_path / "out"
    assert predict.main(["seg,pose", str(clip), "-o", str(out), "--boxes", str(boxes), "--batch-size", "1",
                         "--no-flip", "--save", "raw,json,vis,openpose,coco",
                         *model_args(checkpoints, ["seg", "pose"])]) == 1
    manifest = strict_json(out / "run.json")
    assert [(e["image"], e["task"]) for e in manifest["errors"]] == [(f"{clip}#1", "pose")]
    assert manifest["status"] == "finished" and manifest["counts"]["written"] == FRAMES - 1
    assert manifest["videos"]["clip.mp4"]["frames_written"] == FRAMES - 1
    assert (out / "clip" / "000001.seg.png").exists() and not (out / "clip" / "000001.pose.json").exists()
    assert not (out / "clip" / "000001_keypoints.json").exists()
    tracks = strict_json(out / "clip.tracks.json")
    assert [t["frames"] for t in tracks["tracks"]] == [[0, 2, 3], [0, 2, 3]]
    for index in (0, 2, 3):
        openpose = strict_json(out / "clip" / f"{index:06d}_keypoints.json")
        assert sorted(p["person_id"][0] for p in openpose["people"]) == [0, 1]
    coco = strict_json(out / "coco_keypoints.json")
    assert sorted({r["image_id"] for r in coco}) == [0, 2, 3]
    # every overlay video keeps one frame per processed frame (in step with the source and with each other)
    assert read_video(out / "clip.seg_overlay.mp4")[0] == FRAMES
    assert read_video(out / "clip.pose_overlay.mp4")[0] == FRAMES
    assert partials(out) == []


# ----------------------------------------------------------------------------------------------------
# The detector's boxes on video frames (any callable, as tests/test_detect.py does)
# ----------------------------------------------------------------------------------------------------
@requires_av
def test_detector_boxes_on_video_frames(checkpoints, clip, tmp_path, monkeypatch, capsys):
    seen = []

    def two_people(images):
        seen.extend(tuple(image.shape) for image in images)
        return [torch.tensor([[4.0, 10.0, 20.0, 40.0, 0.9], [50.0, 14.0, 60.0, 40.0, 0.8]]) for _ in images]

    monkeypatch.setattr(detector, "load", lambda source, **kwargs: two_people)
    out = tmp_path / "out"
    assert predict.main(["pose", str(clip), "-o", str(out), "--end", "3", "--batch-size", "2", "--no-flip",
                         "--save", "json,coco", "--detector", "my/detector",
                         *model_args(checkpoints, ["pose"])]) == 0
    assert seen == [(3, 64, 96)] * 3
    for index in range(3):
        pose = strict_json(out / "clip" / f"{index:06d}.pose.json")
        assert pose["box_source"] == "detector"
        assert [p["detector_score"] for p in pose["people"]] == [0.9, 0.8]
        assert [p["track_id"] for p in pose["people"]] == [0, 1]
        assert pose["people"][1]["box"] == [50, 14, 110, 54]  # kept as detected (it reaches past the edge)
    assert strict_json(out / "run.json")["settings"]["detector"] == "my/detector"
    assert len(strict_json(out / "coco_keypoints.json")) == 6


# ----------------------------------------------------------------------------------------------------
# Disk full in the middle of a video: stopped cleanly, the video listed as not finished, resumable
# ----------------------------------------------------------------------------------------------------
@requires_av
def test_disk_full_during_a_video(checkpoints, clip, tmp_path, monkeypatch, capsys):
    folder = write_images(tmp_path / "in", {"a.jpg": (20, 16)})
    (folder / "clip.mp4").write_bytes(clip.read_bytes())
    out = tmp_path / "out"
    faulty_writer(monkeypatch, lambda file: errno.ENOSPC if file.parent.name == "clip"
                  and file.name.startswith(".000002") else None)
    args = ["seg,pose", str(folder), "-o", str(out), "--detector", "none", "--no-flip",
            *model_args(checkpoints, ["seg", "pose"])]
    assert predict.main(args) == 1
    assert "error: stopped: No space left on device (ENOSPC)" in capsys.readouterr().err
    manifest = strict_json(out / "run.json")
    assert manifest["status"] == "stopped"
    assert manifest["not_attempted"] == [str(folder / "clip.mp4")]  # the video did not finish
    assert manifest["counts"]["written"] == 3  # a.jpg, frames 0 and 1
    assert partials(tmp_path) == [] and no_partials(tmp_path)
    assert sorted(p.name for p in out.glob("clip.*")) == []  # no overlay video or tracks of a cut run
    monkeypatch.undo()
    assert predict.main([*args, "--skip-existing"]) == 0
    summary = strict_json(out / "run.json")["videos"]["clip.mp4"]
    assert (summary["frames_written"], summary["frames_skipped_existing"]) == (FRAMES - 2, 2)
    assert read_video(out / "clip.pose_overlay.mp4")[0] == FRAMES
    assert [t["frames"] for t in strict_json(out / "clip.tracks.json")["tracks"]] == [list(range(FRAMES))]


@requires_av
def test_ctrl_c_during_a_video_says_interrupted(checkpoints, clip, tmp_path, monkeypatch, capsys):
    real = safe_io.write_value

    def interrupted_at_frame_1(file, value, suffix):
        if Path(file).name.startswith(".000001"):
            raise KeyboardInterrupt
        return real(file, value, suffix)

    monkeypatch.setattr(safe_io, "write_value", interrupted_at_frame_1)
    out = tmp_path / "out"
    assert predict.main(["seg", str(clip), "-o", str(out), *model_args(checkpoints, ["seg"])]) == 130
    manifest = strict_json(out / "run.json")
    assert manifest["status"] == "interrupted" and manifest["not_attempted"] == [str(clip)]
    assert partials(tmp_path) == [] and sorted(p.name for p in out.glob("clip.*")) == []


# ----------------------------------------------------------------------------------------------------
# Overlay videos' temporaries: unique per writer, and cleaned as stale like every other temporary
# ----------------------------------------------------------------------------------------------------
@requires_av
def test_overlay_temporaries_are_unique_and_cleaned_when_stale(tmp_path):
    first, second = (video.VideoWriter(tmp_path / "clip.seg_overlay.mp4", Fraction(25)) for _ in range(2))
    assert first.partial != second.partial and first.partial.parent == tmp_path
    for writer in (first, second):  # the pattern remove_stale_temporaries (--skip-existing) knows, with our pid
        match = safe_io.TEMPORARY.match(writer.partial.name)
        assert match and int(match[1]) == os.getpid() and writer.partial.name.startswith(".clip.seg_overlay.mp4.")


# ----------------------------------------------------------------------------------------------------
# --save coco as the only kind, with --skip-existing on a first run: every image is run
# ----------------------------------------------------------------------------------------------------
def test_save_coco_alone_with_skip_existing(checkpoints, tmp_path, capsys):
    folder = write_images(tmp_path / "in", {"000001.jpg": (40, 30), "000002.jpg": (40, 30)})
    out = tmp_path / "out"
    args = ["pose", str(folder), "-o", str(out), "--save", "coco", "--detector", "none", "--no-flip",
            *model_args(checkpoints, ["pose"])]
    assert predict.main([*args, "--skip-existing"]) == 0
    assert [r["image_id"] for r in strict_json(out / "coco_keypoints.json")] == [1, 2]
    assert strict_json(out / "run.json")["counts"]["written"] == 2


# ----------------------------------------------------------------------------------------------------
# The detector under issue 12's rules: its failure costs pose alone; boxes it cannot mean are dropped
# ----------------------------------------------------------------------------------------------------
@pytest.fixture
def photos(tmp_path) -> Path:
    return write_images(tmp_path / "in", {"a.jpg": (40, 30), "b.jpg": (30, 40)})


def test_a_failing_detector_fails_pose_alone(checkpoints, photos, tmp_path, monkeypatch, capsys):
    def fails_on_a(images):
        if any(image.shape[-2:] == (40, 30) for image in images):
            raise RuntimeError("detector out of memory")
        return [torch.tensor([[1.0, 2.0, 20.0, 25.0, 0.9]]) for _ in images]

    monkeypatch.setattr(detector, "load", lambda source, **kwargs: fails_on_a)
    out = tmp_path / "out"
    assert predict.main(["seg,pose", str(photos), "-o", str(out), "--batch-size", "2", "--no-flip",
                         "--detector", "my/detector", *model_args(checkpoints, ["seg", "pose"])]) == 1
    manifest = strict_json(out / "run.json")
    assert manifest["errors"] == [{"image": str(photos / "a.jpg"), "task": "pose",
                                   "error": "RuntimeError: detector out of memory"}]
    assert sorted(p.name for p in out.glob("a.*")) == ["a.seg.png", "a.seg_overlay.jpg"]  # seg kept
    assert len(list(out.glob("b.*"))) == 4 and strict_json(out / "b.pose.json")["box_source"] == "detector"


def test_non_finite_detector_boxes_are_dropped(checkpoints, photos, tmp_path, monkeypatch, capsys):
    def one_broken_box(images):  # e.g. an fp16 overflow: NaN / Inf coordinates
        return [torch.tensor([[float("nan"), 3.0, 10.0, 10.0, 0.8], [1.0, 2.0, float("inf"), 10.0, 0.7],
                              [1.0, 2.0, 20.0, 25.0, 0.9]]) for _ in images]

    monkeypatch.setattr(detector, "load", lambda source, **kwargs: one_broken_box)
    out = tmp_path / "out"
    assert predict.main(["pose", str(photos), "-o", str(out), "--no-flip", "--detector", "my/detector",
                         "--save", "json", *model_args(checkpoints, ["pose"])]) == 0
    pose = strict_json(out / "a.pose.json")
    assert [(p["box"], p["detector_score"]) for p in pose["people"]] == [([1, 2, 21, 27], 0.9)]
    assert all(None not in point for point in pose["people"][0]["keypoints"])
