"""Videos through predict.py (video.py, tracking.py) on a synthetic clip made here with PyAV and tiny random
models: per-frame files equal an image run on the decoded frames; overlay videos have one frame per processed
frame at the source rate; two moving people keep their track ids; frame selection, resuming, smoothing, and
the message when PyAV is missing."""

import json
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import predict
from sapiens2 import weights
from sapiens2_app.predict import tracking, video
from test_predict import model_args, read_png, run_cli, tiny_model

try:
    import av
except ImportError:  # CI has it (requirements-test.txt); without it, the tests that need no video still run
    av = None
requires_av = pytest.mark.skipif(av is None, reason="PyAV is not installed (pip install av)")

WIDTH, HEIGHT, FRAMES, RATE = 96, 64, 6, Fraction(25)
PERSON = (20, 40)  # w, h of the two synthetic people
TASKS = "seg,pose,normal,pointmap"


def person_boxes(index: int) -> list[list[int]]:
    """Two people walking right side by side, 3 px a frame: [x, y, w, h] of A and B."""
    return [[4 + 3 * index, 10, *PERSON], [50 + 3 * index, 14, *PERSON]]


def make_video(path: Path, frames: int = FRAMES) -> Path:
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=RATE)
        stream.width, stream.height, stream.pix_fmt = WIDTH, HEIGHT, "yuv420p"
        for index in range(frames):
            pixels = np.full((HEIGHT, WIDTH, 3), (40, 90, 160), np.uint8)
            for (x, y, w, h), colour in zip(person_boxes(index), ((200, 30, 30), (30, 200, 30))):
                pixels[y : y + h, x : x + w] = colour
            container.mux(stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")))
        container.mux(stream.encode(None))
    return path


def decoded_frames(path: Path) -> list[np.ndarray]:
    with av.open(str(path)) as container:
        return [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]


def read_video(path: Path) -> tuple[int, Fraction, str]:
    """(frames, frame rate, codec) of a video as PyAV decodes it."""
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        count = sum(1 for _ in container.decode(stream))
        return count, stream.average_rate, stream.codec_context.name


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("checkpoints")
    torch.manual_seed(0)
    return {task: weights.save(tiny_model(task), folder / f"{task}.safetensors") for task in TASKS.split(",")}


@pytest.fixture(scope="module")
def clip(tmp_path_factory) -> Path:
    if av is None:
        pytest.skip("PyAV is not installed (pip install av)")
    return make_video(tmp_path_factory.mktemp("videos") / "clip.mp4")


@pytest.fixture(scope="module")
def boxes(clip) -> Path:
    """Per frame `clip.mp4#N`; every other frame lists the people in the other order (ids must follow the
    people, not the list)."""
    entries = {f"clip.mp4#{i}": person_boxes(i)[:: 1 if i % 2 == 0 else -1] for i in range(FRAMES)}
    path = clip.parent / "boxes.json"
    path.write_text(json.dumps(entries))
    return path


@pytest.fixture(scope="module")
def video_run(checkpoints, clip, boxes, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("video_out")
    assert predict.main([TASKS, str(clip), "-o", str(out), "--boxes", str(boxes), "--batch-size", "2",
                         *model_args(checkpoints, TASKS.split(","))]) == 0
    return out


@pytest.fixture(scope="module")
def image_run(checkpoints, clip, boxes, tmp_path_factory) -> Path:
    """The decoded frames saved as lossless PNGs and run as images, with the same boxes and batch size."""
    frames = tmp_path_factory.mktemp("frames")
    for index, pixels in enumerate(decoded_frames(clip)):
        Image.fromarray(pixels).save(frames / f"{index:06d}.png")
    given = json.loads(boxes.read_text())
    image_boxes = frames.parent / "image_boxes.json"
    image_boxes.write_text(json.dumps({f"{i:06d}.png": given[f"clip.mp4#{i}"] for i in range(FRAMES)}))
    out = tmp_path_factory.mktemp("image_out")
    assert predict.main([TASKS, str(frames), "-o", str(out), "--boxes", str(image_boxes), "--batch-size", "2",
                         *model_args(checkpoints, TASKS.split(","))]) == 0
    return out


def test_frames_equal_the_image_run_on_the_decoded_frames(video_run, image_run):
    frame_files = sorted(p.relative_to(video_run / "clip").as_posix() for p in (video_run / "clip").iterdir())
    image_files = sorted(p.name for p in image_run.iterdir() if p.name != "run.json")
    assert frame_files == image_files and len(frame_files) == FRAMES * 8
    for name in frame_files:
        ours, theirs = video_run / "clip" / name, image_run / name
        if name.endswith(".npy"):
            np.testing.assert_array_equal(np.load(ours), np.load(theirs))
        elif name.endswith(".pose.json"):
            a, b = json.loads(ours.read_text()), json.loads(theirs.read_text())
            assert a["image"] == f"clip.mp4#{int(name[:6])}" and b["image"] == name.replace(".pose.json", ".png")
            assert [p.pop("track_id") for p in a["people"]] in ([0, 1], [1, 0])
            assert {k: v for k, v in a.items() if k != "image"} == {k: v for k, v in b.items() if k != "image"}
        else:  # PNG and JPEG pictures: the same pixels give the same bytes
            assert ours.read_bytes() == theirs.read_bytes(), name


def test_overlay_videos_have_a_frame_per_processed_frame_at_the_source_rate(video_run):
    videos = sorted(p.name for p in video_run.glob("*.mp4"))
    assert videos == ["clip.depth.mp4", "clip.normal.mp4", "clip.pose_overlay.mp4", "clip.seg_overlay.mp4"]
    for name in videos:
        count, rate, codec = read_video(video_run / name)
        assert (count, rate) == (FRAMES, RATE), name
        assert codec == ("h264" if "libx264" in av.codecs_available else "mpeg4")
    manifest = json.loads((video_run / "run.json").read_text())
    assert manifest["status"] == "finished" and manifest["counts"]["written"] == FRAMES
    assert manifest["videos"]["clip.mp4"]["frames_written"] == FRAMES
    first = decoded_frames(video_run / "clip.seg_overlay.mp4")[0].astype(int)
    picture = read_png(video_run / "clip" / "000000.seg_overlay.jpg").astype(int)
    assert first.shape == picture.shape and np.abs(first - picture).mean() < 8  # the same picture, re-encoded


def test_two_people_keep_their_track_ids(video_run):
    ids = {}  # person (by its box's left edge: A starts at 4, B at 50) -> track ids over the frames
    for index in range(FRAMES):
        people = json.loads((video_run / "clip" / f"{index:06d}.pose.json").read_text())["people"]
        for person in people:
            ids.setdefault("A" if person["box"][0] < 4 + 3 * index + 10 else "B", []).append(person["track_id"])
    assert len(set(ids["A"])) == 1 and len(set(ids["B"])) == 1 and ids["A"][0] != ids["B"][0]
    assert len(ids["A"]) == len(ids["B"]) == FRAMES
    tracks = json.loads((video_run / "clip.tracks.json").read_text())
    assert tracks["video"] == "clip.mp4" and tracks["fps"] == 25.0 and tracks["frames_processed"] == FRAMES
    by_id = {t["track_id"]: t for t in tracks["tracks"]}
    assert sorted(by_id) == [0, 1]
    a = by_id[ids["A"][0]]
    assert a["frames"] == list(range(FRAMES)) and a["people"] == [0, 1, 0, 1, 0, 1]  # the boxes' order


def test_track_patience(checkpoints, clip, tmp_path, capsys):
    """Person B is missing from frame 2: with --track-patience 1 they keep their id in frame 3; with 0 they come
    back as a new track. (--end 4: frames 0 to 3.)"""
    given = {f"clip.mp4#{i}": person_boxes(i) if i != 2 else person_boxes(i)[:1] for i in range(FRAMES)}
    (tmp_path / "boxes.json").write_text(json.dumps(given))
    for patience, expected in ((1, [[0, 1], [0, 1], [0], [0, 1]]), (0, [[0, 1], [0, 1], [0], [0, 2]])):
        out = tmp_path / f"patience{patience}"
        run_cli("pose", clip, "-o", out, "--boxes", tmp_path / "boxes.json", "--end", "4", "--save", "json",
                "--track-patience", patience, "--no-flip", *model_args(checkpoints, ["pose"]), capsys=capsys)
        ids = [[p["track_id"] for p in json.loads((out / "clip" / f"{i:06d}.pose.json").read_text())["people"]]
               for i in range(4)]
        assert ids == expected


def test_every_start_end_select_frames(checkpoints, clip, tmp_path, capsys):
    """--every 2 --start 1 --end 6 -> frames 1, 3, 5; the overlay video has those three, at the source rate."""
    run_cli("seg", clip, "-o", tmp_path, "--every", "2", "--start", "1", "--end", "6",
            *model_args(checkpoints, ["seg"]), capsys=capsys)
    assert sorted(p.name for p in (tmp_path / "clip").glob("*.seg.png")) == [
        "000001.seg.png", "000003.seg.png", "000005.seg.png"]
    assert read_video(tmp_path / "clip.seg_overlay.mp4")[:2] == (3, RATE)
    assert json.loads((tmp_path / "run.json").read_text())["status"] == "finished"


def test_skip_existing_resumes_by_frame(checkpoints, clip, tmp_path, capsys):
    args = ["seg", clip, "-o", tmp_path, "--save", "raw,vis", *model_args(checkpoints, ["seg"])]
    run_cli(*args, capsys=capsys)
    (tmp_path / "clip" / "000004.seg.png").unlink()
    before = (tmp_path / "clip" / "000000.seg.png").stat().st_mtime_ns
    run_cli(*args, "--skip-existing", capsys=capsys)
    summary = json.loads((tmp_path / "run.json").read_text())["videos"]["clip.mp4"]
    assert (summary["frames_written"], summary["frames_skipped_existing"]) == (1, FRAMES - 1)
    assert (tmp_path / "clip" / "000004.seg.png").exists()
    assert (tmp_path / "clip" / "000000.seg.png").stat().st_mtime_ns == before
    assert read_video(tmp_path / "clip.seg_overlay.mp4")[0] == FRAMES  # the overlay video is whole again
    assert json.loads((tmp_path / "run.json").read_text())["status"] == "finished"


def test_smoothing_keeps_the_raw_keypoints(checkpoints, clip, boxes, video_run, tmp_path, capsys):
    run_cli("pose", clip, "-o", tmp_path, "--boxes", boxes, "--batch-size", "2", "--smooth", "--save", "json",
            *model_args(checkpoints, ["pose"]), capsys=capsys)
    for index in range(FRAMES):
        smoothed = json.loads((tmp_path / "clip" / f"{index:06d}.pose.json").read_text())["people"]
        raw = json.loads((video_run / "clip" / f"{index:06d}.pose.json").read_text())["people"]
        for ours, theirs in zip(smoothed, raw):
            assert ours["track_id"] == theirs["track_id"] and ours["keypoints_raw"] == theirs["keypoints"]
            moved = np.abs(np.array(ours["keypoints"]) - np.array(theirs["keypoints"]))[:, :2].max()
            assert (moved == 0) if index == 0 else (moved > 0)  # the first sample passes through
    assert json.loads((tmp_path / "clip.tracks.json").read_text())["smoothing"]["beta"] == 5.0


def test_resuming_a_smoothed_tracked_video_gives_the_files_of_one_run(checkpoints, clip, boxes, tmp_path, capsys):
    """--skip-existing reads the done frames' people back (ids, raw keypoints for the filters): a frame redone
    after them gets the same ids and smoothed keypoints as in one uninterrupted run; tracks and COCO too."""
    args = ["pose", clip, "-o", tmp_path, "--boxes", boxes, "--smooth", "--save", "json,vis,coco",
            *model_args(checkpoints, ["pose"])]
    run_cli(*args, capsys=capsys)
    first = {p.name: p.read_bytes() for p in [*tmp_path.glob("clip/*.pose.json"), tmp_path / "clip.tracks.json",
                                               tmp_path / "coco_keypoints.json"]}
    (tmp_path / "clip" / "000003.pose.json").unlink()
    run_cli(*args, "--skip-existing", capsys=capsys)
    assert json.loads((tmp_path / "run.json").read_text())["videos"]["clip.mp4"]["frames_written"] == 1
    for name, content in first.items():
        path = tmp_path / ("clip" if name.startswith("0") else "") / name
        if name == "coco_keypoints.json":  # frame 3's entries are the redone frame's (below), the others exact
            ours, theirs = json.loads(path.read_text()), json.loads(content)
            assert [r for r in ours if r["image_id"] != 3] == [r for r in theirs if r["image_id"] != 3]
            for a, b in zip(ours, theirs):
                np.testing.assert_allclose(a["keypoints"], b["keypoints"], atol=0.0101)
            continue
        if name != "000003.pose.json":
            assert path.read_bytes() == content, name  # skipped, or rebuilt exactly (tracks)
            continue
        # the redone frame: same ids and raw keypoints; the filters were fed the files' raw keypoints, which are
        # rounded to 0.01 px, so the smoothed ones agree to that
        ours, theirs = json.loads(path.read_text())["people"], json.loads(content)["people"]
        assert [p["track_id"] for p in ours] == [p["track_id"] for p in theirs]
        for a, b in zip(ours, theirs):
            assert a["keypoints_raw"] == b["keypoints_raw"]
            np.testing.assert_allclose(np.array(a["keypoints"]), np.array(b["keypoints"]), atol=0.0101)
    results = json.loads(first["coco_keypoints.json"])
    assert [r["image_id"] for r in results] == [i for i in range(FRAMES) for _ in range(2)]
    assert results[0]["image_file"] == "clip.mp4#0"
    # a damaged pose.json (the tracks and COCO results need it) is not resumed from: that frame runs again
    (tmp_path / "clip" / "000002.pose.json").write_text('{"people": [')
    capsys.readouterr()
    run_cli(*args, "--skip-existing", capsys=capsys)
    assert "000002.pose.json: not a readable pose.json" in capsys.readouterr().err
    summary = json.loads((tmp_path / "run.json").read_text())["videos"]["clip.mp4"]
    assert (summary["frames_written"], summary["frames_skipped_existing"]) == (1, FRAMES - 1)
    redone = json.loads((tmp_path / "clip" / "000002.pose.json").read_text())["people"]
    assert [p["track_id"] for p in redone] == [p["track_id"] for p in json.loads(first["000002.pose.json"])["people"]]


def test_one_euro_defaults_remove_jitter_without_lag():
    """The documented numbers: 30 fps, a 200 px tall person, jitter 0.5% of the height."""
    fps, height, steps = 30.0, 200.0, 300
    noise = np.random.default_rng(0).normal(0, 0.005 * height, steps)

    def filtered(signal):
        one_euro = tracking.OneEuroFilter(tracking.OneEuroSettings())
        return np.array([one_euro(i / fps, np.array([[x, 0.0]]), scale=height)[0, 0] for i, x in enumerate(signal)])

    assert filtered(noise)[30:].std() / noise[30:].std() < 0.36
    for speed, max_lag in ((0.5, 0.9), (1.0, 0.6)):  # person heights per second -> frames of lag
        ramp = np.arange(steps) * speed * height / fps
        lag = (ramp - filtered(ramp))[100:].mean() / (speed * height / fps)
        assert 0 < lag < max_lag


def test_similarities():
    assert tracking.box_iou(np.array([0, 0, 10, 10.0]), np.array([5, 0, 15, 10.0])) == pytest.approx(50 / 150)
    assert tracking.box_iou(np.array([0, 0, 10, 10.0]), np.array([20, 20, 30, 30.0])) == 0
    sigmas = np.array([0.1, 0.1])
    xy, scores = np.array([[0, 0], [10, 10.0]]), np.array([0.9, 0.1])
    # one visible keypoint, moved 2 px, area 100: exp(-4 / (2 * 100 * 0.2^2))
    assert tracking.keypoint_similarity(xy, scores, xy + [2, 0], np.array([0.9, 0.9]), 100.0, sigmas) == \
        pytest.approx(np.exp(-4 / (2 * 100 * 0.04)))
    assert tracking.keypoint_similarity(xy, scores * 0, xy, scores, 100.0, sigmas) == 0


@requires_av
def test_overlay_writer_pads_odd_sizes_and_falls_back_to_mpeg4(tmp_path, monkeypatch):
    monkeypatch.setattr(video, "ENCODERS", ("no_such_encoder", "mpeg4"))
    writer = video.VideoWriter(tmp_path / "odd.mp4", Fraction(30000, 1001))
    for shade in (0, 120, 240):
        writer.write(Image.new("RGB", (33, 21), (shade, shade, shade)))
    assert not (tmp_path / "odd.mp4").exists()  # only the .partial until closed
    writer.close()
    assert read_video(tmp_path / "odd.mp4") == (3, Fraction(30000, 1001), "mpeg4")
    assert decoded_frames(tmp_path / "odd.mp4")[0].shape == (22, 34, 3)


def test_frame_selection_counts():
    selection = video.FrameSelection(every=3, start=2, end=11)
    assert [i for i in range(20) if selection.selects(i)] == [2, 5, 8] and selection.count(20) == 3
    assert video.FrameSelection().count(7) == 7 and video.FrameSelection(2, 5).count(4) == 0


def test_damaged_and_unreadable_videos_are_reported(checkpoints, clip, tmp_path, capsys):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "broken.mp4").write_bytes(b"not a video at all")
    (tmp_path / "in" / "clip.mp4").write_bytes(clip.read_bytes())
    assert predict.main(["seg", str(tmp_path / "in"), "-o", str(tmp_path / "out"),
                         *model_args(checkpoints, ["seg"])]) == 1
    assert "broken.mp4" in capsys.readouterr().err
    manifest = json.loads((tmp_path / "out" / "run.json").read_text())
    assert [Path(e["image"]).name for e in manifest["errors"]] == ["broken.mp4"]
    assert manifest["videos"]["clip.mp4"]["frames_written"] == FRAMES and "error" in manifest["videos"]["broken.mp4"]
    assert manifest["status"] == "finished"


@requires_av
def test_a_truncated_video_is_written_as_far_as_it_goes_with_a_warning(checkpoints, tmp_path, capsys):
    """FFmpeg reads a cut file as a shorter video without an error: the header's frame count gives it away."""
    whole = tmp_path / "whole.avi"  # AVI: its header counts the frames, and a cut file still opens
    with av.open(str(whole), "w") as container:
        stream = container.add_stream("mpeg4", rate=RATE)
        stream.width, stream.height, stream.pix_fmt = 32, 32, "yuv420p"
        for index in range(12):
            noise = np.random.default_rng(index).integers(0, 255, (32, 32, 3), np.uint8)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(noise, format="rgb24")))
        container.mux(stream.encode(None))
    data = whole.read_bytes()
    (tmp_path / "cut.avi").write_bytes(data[: len(data) // 2])
    run_cli("seg", tmp_path / "cut.avi", "-o", tmp_path / "out", "--save", "raw", *model_args(checkpoints, ["seg"]),
            capsys=capsys)
    summary = json.loads((tmp_path / "out" / "run.json").read_text())["videos"]["cut.avi"]
    assert summary["frames_announced"] == 12 and 0 < summary["frames_written"] < 12
    assert f"{summary['frames_written']} of the 12 selected frames" in capsys.readouterr().err


def test_bad_frame_options(checkpoints, clip, capsys):
    seg = model_args(checkpoints, ["seg"])
    assert predict.main(["seg", str(clip), "--every", "0", *seg]) == 2
    assert "--every N >= 1" in capsys.readouterr().err
    assert predict.main(["seg", str(clip), "--start", "5", "--end", "5", *seg]) == 2


def test_without_pyav_the_message_says_how_to_install_it(checkpoints, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "av", None)  # `import av` now raises ImportError
    (tmp_path / "clip.mp4").write_bytes(b"never opened")
    out = tmp_path / "out"
    assert predict.main(["seg", str(tmp_path / "clip.mp4"), "-o", str(out), *model_args(checkpoints, ["seg"])]) == 2
    err = capsys.readouterr().err
    assert "clip.mp4" in err and "reading and writing videos needs PyAV: pip install av" in err
    assert not out.exists()  # nothing written


def test_tracker_follows_a_custom_keypoint_set_by_boxes():
    """A 17-keypoint model (train.py) has no 308 sigmas: people are matched by their boxes."""
    tracker = tracking.Tracker(30.0)
    def person(x):
        return {"bbox": torch.tensor([x, 10.0, x + 40.0, 110.0]), "keypoints": torch.full((17, 2), x + 20.0),
                "scores": torch.ones(17)}
    first = [person(0.0), person(100.0)]
    tracker.update(0, first)
    second = [person(104.0), person(3.0)]  # moved a little, listed in the other order
    tracker.update(1, second)
    assert [p["track_id"] for p in second] == [first[1]["track_id"], first[0]["track_id"]]
