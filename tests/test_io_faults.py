"""export.py, videos and the person detector under interrupts, full disks and odd inputs (issue 25): one clear line
with a documented exit status, no traceback, nothing half-written left beside the outputs, nothing that was there
before lost, every frame that can be processed processed.

The faults are real ones in real child processes on tiny models: signals sent by the process to itself at a
chosen moment, a file size limit (RLIMIT_FSIZE: writes past it fail with EFBIG, the way they fail with ENOSPC on a
full disk, inside torch's own writers too, which no Python-level injection reaches), kill -9."""

import dataclasses
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

import export
import predict
from sapiens2 import weights
from sapiens2_app.common import safe_io
from sapiens2_app.detector import dfine, dfine_config
from sapiens2_app.common.cli import StopSignals
from test_export import tiny_model as tiny_export_model
from test_predict import model_args, tiny_model, write_images

try:
    import av
except ImportError:  # CI has it (requirements-test.txt); without it, the tests that need no video still run
    av = None
requires_av = pytest.mark.skipif(av is None, reason="PyAV is not installed (pip install av)")

ROOT = Path(__file__).resolve().parents[1]
CHILD_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def hidden(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("error:")]


# ----------------------------------------------------------------------------------------------------
# export.py
# ----------------------------------------------------------------------------------------------------
# One child process, six exports of a tiny seg model, each reported as `=== CASE rc` on stderr after its own
# messages. Ctrl-C and SIGTERM land while the ONNX exporter imports torch._dynamo (in a tiny export, ~2 s of 5:
# where a real Ctrl-C lands most often); there the exporter turns the KeyboardInterrupt into a TorchExportError
# of its own. The failed import leaves torch._dynamo unimported, so the second stop lands at the same point. A
# Ctrl-C while torch.export's C++ zip writer calls back into Python. Then files over 100 kB cannot be written
# (the artifacts are ~0.8 MB): ONNX writes through Python, torch.export through its C++ zip writer. Last, a
# writer that stops for good once half a file is staged, for a kill -9.
EXPORT_DRIVER = r"""
import os, resource, signal, sys, time, traceback
import export
from sapiens2_app.export import formats

stop = {"signal": None}

class StopDuringImport:  # a meta path finder: sends the signal when torch._dynamo is looked up, finds nothing
    def find_spec(self, name, path=None, target=None):
        if name == "torch._dynamo" and stop["signal"]:
            os.kill(os.getpid(), stop["signal"])
        return None

real_write = formats.WriteErrorKept.write

def ctrl_c_then_write(self, data):  # at the third write: the first ones come back to Python in between
    stop["writes"] += 1
    if stop["while saving"] and stop["writes"] == 3:
        os.kill(os.getpid(), signal.SIGINT)
    return real_write(self, data)

def write_then_hang(wrapper, example, path, dynamic_batch, info):
    path.write_bytes(b"half an artifact")
    print("hanging", flush=True)
    time.sleep(600)

sys.meta_path.insert(0, StopDuringImport())
formats.WriteErrorKept.write = ctrl_c_then_write
model, out = sys.argv[1], sys.argv[2]
for case, fmt, signum in (("ctrl-c", "onnx", signal.SIGINT), ("sigterm", "onnx", signal.SIGTERM),
                          ("ctrl-c-saving", "torch-export", None), ("full-onnx", "onnx", None),
                          ("full-torch-export", "torch-export", None), ("killed", "torch-export", None)):
    stop["signal"], stop["while saving"], stop["writes"] = signum, case == "ctrl-c-saving", 0
    if case.startswith("full"):
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, resource.RLIM_INFINITY))
    if case == "killed":
        formats.WRITERS["torch-export"] = (write_then_hang, None)
    try:
        rc = export.main(["seg", "--model", model, "-o", out + (".onnx" if fmt == "onnx" else ".pt2"),
                          "--format", fmt])
    except BaseException as error:
        traceback.print_exc()
        rc = "raised " + type(error).__name__
    print(f"=== {case} {rc}", file=sys.stderr, flush=True)
"""


def cases_of(err: str) -> dict[str, tuple[str, list[str]]]:
    """`=== CASE rc` blocks of the driver's stderr: {case: (rc, the case's lines)}."""
    cases, lines = {}, []
    for line in err.splitlines():
        if line.startswith("=== "):
            _, case, rc = line.split(" ", 2)
            cases[case], lines = (rc, lines), []
        else:
            lines.append(line)
    return cases


def test_export_interrupted_out_of_space_or_killed_leaves_nothing(tmp_path, capsys):
    """Ctrl-C (in the exporter or while the file is saved): 130, SIGTERM: 143, a full disk: 1, each in one line
    without a traceback; no staging folder left, the earlier files at -o untouched. After a kill -9, the next
    export of that name removes its staging folder."""
    torch.manual_seed(0)
    model = weights.save(tiny_export_model("seg"), tmp_path / "seg.safetensors")
    out = tmp_path / "out"
    out.mkdir()
    for suffix in (".onnx", ".pt2"):  # an earlier export of the same name
        (out / f"model{suffix}").write_bytes(b"earlier")
    child = subprocess.Popen([sys.executable, "-c", EXPORT_DRIVER, str(model), str(out / "model")], cwd=ROOT,
                             env=CHILD_ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        hanging = child.stdout.readline() == "hanging\n"  # the last case (empty: the child died before it)
        staged = hidden(out)
        busy = safe_io.remove_abandoned_staging(out, ".model.pt2.")  # its writer still runs: kept
    finally:
        child.kill()  # SIGKILL: no cleanup of any kind
        _, err = child.communicate()
    cases = cases_of(err)
    assert hanging and len(cases) == 5, err[-3000:]  # -6: a C++ abort
    for case, (rc, lines) in cases.items():
        assert "Traceback" not in "\n".join(lines), f"{case}:\n" + "\n".join(lines)[-3000:]
        said = [line for line in lines if line.strip() and not line.startswith("exporting seg")]
        assert len(said) == 1, f"{case}: {said}"
    assert cases["ctrl-c"][0] == "130" and cases["ctrl-c"][1][-1].startswith("interrupted: the export did not")
    assert cases["sigterm"][0] == "143" and cases["sigterm"][1][-1].startswith("terminated: the export did not")
    assert cases["ctrl-c-saving"][0] == "130" and cases["ctrl-c-saving"][1][-1].startswith("interrupted: the export")
    for case, suffix in (("full-onnx", ".onnx"), ("full-torch-export", ".pt2")):
        rc, lines = cases[case]
        assert rc == "1" and lines[-1] == (f"error: -o {out / ('model' + suffix)}: writing the artifact failed: "
                                           "File too large (EFBIG); nothing was written; the earlier file there "
                                           "is unchanged; free some space or choose another location"), lines
    assert all((out / f"model{suffix}").read_bytes() == b"earlier" for suffix in (".onnx", ".pt2"))
    # only the killed export's staging folder, which the next export removes
    assert len(staged) == 1 and staged[0].startswith(".model.pt2.") and staged[0].endswith(".tmp") and busy == 0
    assert export.main(["seg", "--model", str(model), "-o", str(out / "model.pt2"), "--format", "torch-export"]) == 0
    err = capsys.readouterr().err
    assert (f"note: removed 1 staging folder (.model.pt2.XXXXXXXX.tmp) that an export killed earlier left in {out}"
            in err.splitlines()), err
    assert hidden(out) == [] and (out / "model.pt2").read_bytes() != b"earlier"


def test_a_second_signal_during_the_staging_cleanup_still_removes_it(tmp_path, monkeypatch):
    """A Ctrl-C (or SIGTERM) that arrives while staging_folder removes its folder after the first one is held
    back until the folder is gone, then raised as usual."""
    real_rmtree = safe_io.shutil.rmtree

    def second_ctrl_c_then_rmtree(path, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)
        real_rmtree(path, **kwargs)

    monkeypatch.setattr(safe_io.shutil, "rmtree", second_ctrl_c_then_rmtree)
    with pytest.raises(KeyboardInterrupt), StopSignals():
        with safe_io.staging_folder(tmp_path, prefix=".model.onnx.") as staging:
            (staging / "model.onnx").write_bytes(b"half")
            raise KeyboardInterrupt  # the first Ctrl-C
    assert hidden(tmp_path) == []


# ----------------------------------------------------------------------------------------------------
# Videos
# ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("checkpoints")
    torch.manual_seed(0)
    return {task: weights.save(tiny_model(task), folder / f"{task}.safetensors") for task in ("seg", "pose")}


def write_clip(path: Path, sizes: list[tuple[int, int]], container_format: str | None = None) -> Path:
    """MPEG-4 frames of the given (width, height), a colour ramp."""
    with av.open(str(path), "w", format=container_format) as container:
        stream = container.add_stream("mpeg4", rate=25)
        (stream.width, stream.height), stream.pix_fmt = sizes[0], "yuv420p"
        for index, (width, height) in enumerate(sizes):
            pixels = np.full((height, width, 3), (40 + 10 * index, 90, 160), np.uint8)
            pixels[height // 4: height // 2, width // 3: width // 2] = 220
            container.mux(stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")))
        container.mux(stream.encode(None))
    return path


def write_resizing_clip(path: Path) -> Path:
    """Four 48x32 frames, then four 64x48: two raw MPEG-4 streams end to end (`.m4v`), as a camera or a cut
    that changes resolution makes one; the decoder follows the new stream header."""
    parts = [write_clip(path.with_name(f"part{i}.m4v"), [size] * 4, "m4v") for i, size in enumerate(((48, 32),
                                                                                                     (64, 48)))]
    path.write_bytes(b"".join(part.read_bytes() for part in parts))
    for part in parts:
        part.unlink()
    return path


def write_audio_only(path: Path) -> Path:
    with av.open(str(path), "w") as container:
        stream = container.add_stream("aac", rate=8000)
        for index in range(4):
            frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
            frame.sample_rate, frame.pts = 8000, index * 1024
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    return path


def frame_sizes(path: Path) -> list[tuple[int, int]]:
    with av.open(str(path)) as container:
        return [(frame.width, frame.height) for frame in container.decode(video=0)]


@requires_av
def test_odd_videos_every_frame_processed_and_said_in_one_line(checkpoints, tmp_path, capsys):
    """An audio-only .mp4 fails alone ("no video stream"); a clip whose frame size changes mid-stream has every
    frame's files at that frame's size, and overlay videos of the first size (said once); a --boxes key past a
    clip's last frame is named."""
    clips = tmp_path / "in"
    clips.mkdir()
    resizing = write_resizing_clip(clips / "resize.m4v")
    write_clip(clips / "clip.mp4", [(48, 32)] * 12)
    write_audio_only(clips / "sound.mp4")
    boxes = tmp_path / "boxes.json"
    boxes.write_text(json.dumps({"clip.mp4#3": [[4, 4, 20, 20]], "clip.mp4#12": [[4, 4, 20, 20]]}))
    out = tmp_path / "out"
    code = predict.main(["seg,pose", str(clips), "-o", str(out), "--boxes", str(boxes), "--batch-size", "3",
                         *model_args(checkpoints, ["seg", "pose"])])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err, err  # 1: sound.mp4 failed
    assert error_lines(err) == [f"error: ValueError: {clips / 'sound.mp4'}: no video stream in it (skipped)"], err
    sizes = frame_sizes(resizing)
    assert sizes == [(48, 32)] * 4 + [(64, 48)] * 4
    for index, size in enumerate(sizes):
        with Image.open(out / "resize" / f"{index:06d}.seg.png") as seg:
            assert seg.size == size
        assert (out / "resize" / f"{index:06d}.pose.json").exists()
    assert frame_sizes(out / "resize.seg_overlay.mp4") == [(48, 32)] * 8
    assert frame_sizes(out / "resize.pose_overlay.mp4") == [(48, 32)] * 8
    assert (f"note: {resizing}: the frame size changes at frame 4 (64x48, before 48x32): each frame's files keep "
            "its own size, the overlay videos show such frames rescaled to 48x32") in err.splitlines()
    assert (f"warning: --boxes: 'clip.mp4#12' matches no frame: {clips / 'clip.mp4'} has 12 (#0 to #11)"
            in err.splitlines())
    manifest = json.loads((out / "run.json").read_text())
    assert manifest["videos"]["resize.m4v"]["frames_written"] == 8 and "error" not in manifest["videos"]["resize.m4v"]
    assert manifest["videos"]["clip.mp4"]["frames_written"] == 12


@requires_av
def test_a_start_past_the_last_frame_is_a_warning(checkpoints, tmp_path, capsys):
    clip = write_clip(tmp_path / "clip.mp4", [(48, 32)] * 12)
    out = tmp_path / "out"
    assert predict.main(["seg", str(clip), "-o", str(out), "--start", "50", *model_args(checkpoints, ["seg"])]) == 0
    err = capsys.readouterr().err
    assert f"warning: {clip}: --start 50 is past its last frame (it has 12): no frame of it was processed" in err
    assert json.loads((out / "run.json").read_text())["videos"]["clip.mp4"]["frames_written"] == 0


class DecoderBug(RuntimeError):
    """What a decoder might raise on a crafted file: a class nobody lists."""


class FailsAtFrame:
    """A PyAV container whose decoding raises DecoderBug at frame `at`; the frames before come as they are."""

    def __init__(self, container, at: int):
        self.container, self.at = container, at

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.container.close()

    def __getattr__(self, name):
        return getattr(self.container, name)

    def decode(self, *args, **kwargs):
        for index, frame in enumerate(self.container.decode(*args, **kwargs)):
            if index == self.at:
                raise DecoderBug("corrupt macroblock 3,1")
            yield frame


@requires_av
def test_whatever_the_decoder_raises_at_a_frame_ends_its_video_there(checkpoints, tmp_path, monkeypatch, capsys):
    """Issue 29: a frame on which the decoder raises a class nobody lists is where the video is damaged, as when
    FFmpeg says so (docs/videos.md): the frames before keep their files, its overlay video ends there, run.json
    lists it as failed; the other video and the image are written. (It was an error out of the video's loop: the
    overlay video dropped, the frames written missing from run.json.)"""
    folder = write_images(tmp_path / "in", {"a.jpg": (20, 16)})
    bad, good = (write_clip(folder / name, [(48, 32)] * 8) for name in ("bad.mp4", "good.mp4"))
    real_open = av.open
    monkeypatch.setattr(av, "open", lambda file, *args, **kwargs: (
        FailsAtFrame(real_open(file, *args, **kwargs), 3) if Path(file) == bad else real_open(file, *args, **kwargs)))
    out = tmp_path / "out"
    code = predict.main(["seg", str(folder), "-o", str(out), "--batch-size", "2", *model_args(checkpoints, ["seg"])])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err, err
    assert error_lines(err) == [f"error: ImageLoadError: {bad}: frame 3: cannot decode it (DecoderBug: corrupt "
                                f"macroblock 3,1) (skipped)"], err
    manifest = json.loads((out / "run.json").read_text())
    assert [e["image"] for e in manifest["errors"]] == [str(bad)]
    assert manifest["videos"]["bad.mp4"]["frames_written"] == 3 and "DecoderBug" in manifest["videos"]["bad.mp4"]["error"]
    assert manifest["videos"]["good.mp4"]["frames_written"] == 8 and "error" not in manifest["videos"]["good.mp4"]
    assert manifest["counts"]["written"] == 3 + 8 + 1 and manifest["counts"]["failed"] == 1
    assert sorted(p.name for p in (out / "bad").glob("*.seg.png")) == [f"{i:06d}.seg.png" for i in range(3)]
    assert frame_sizes(out / "bad.seg_overlay.mp4") == [(48, 32)] * 3
    assert frame_sizes(out / "good.seg_overlay.mp4") == [(48, 32)] * 8 and (out / "a.seg.png").is_file()


# A predict.py run whose overlay writer stops for good after its 44th frame of 48: kill -9 lands mid-video, with the
# overlay video's temporary open (FFmpeg creates the file only once x264's lookahead, 40 frames, has passed).
HANGING_PREDICT = r"""
import sys, time
import predict
from sapiens2_app.predict import video

real_write = video.VideoWriter.write

def write_then_hang(self, picture):
    real_write(self, picture)
    if self.frames == 44:
        print("hanging", flush=True)
        time.sleep(600)

video.VideoWriter.write = write_then_hang
sys.exit(predict.main(sys.argv[1:]))
"""


@requires_av
def test_skip_existing_after_kill_9_removes_the_overlay_temporaries_at_once(checkpoints, tmp_path, capsys):
    clip = write_clip(tmp_path / "clip.mp4", [(48, 32)] * 48)
    out = tmp_path / "out"
    args = ["seg", str(clip), "-o", str(out), "--batch-size", "4", *model_args(checkpoints, ["seg"])]
    child = subprocess.Popen([sys.executable, "-c", HANGING_PREDICT, *args], cwd=ROOT, env=CHILD_ENV,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "hanging\n", child.stderr.read()
        temporaries = [p.name for p in out.iterdir() if p.name.endswith(".partial")]
        assert len(temporaries) == 1 and temporaries[0].startswith(".clip.seg_overlay.mp4.")
        assert safe_io.remove_stale_temporaries(out) == 0  # its writer runs (and holds the lock): kept
    finally:
        child.kill()  # SIGKILL: no cleanup of any kind
        child.communicate()
    assert predict.main([*args, "--skip-existing"]) == 0
    err = capsys.readouterr().err
    assert f"note: removed 1 temporary files left in {out} by an earlier run that was killed" in err, err
    assert [p.name for p in out.rglob("*.partial")] == []
    assert frame_sizes(out / "clip.seg_overlay.mp4") == [(48, 32)] * 48
    assert sorted(p.name for p in (out / "clip").glob("*.seg.png")) == [f"{i:06d}.seg.png" for i in range(48)]


# ----------------------------------------------------------------------------------------------------
# The person detector
# ----------------------------------------------------------------------------------------------------
# tests/test_detect.py's "nano" shape (two levels), in this port's own names: no transformers to import
TINY_DFINE = dfine_config.DFineConfig(
    stem_channels=[3, 8, 8], stage_in_channels=[8, 16, 32, 48], stage_mid_channels=[8, 8, 16, 16],
    stage_out_channels=[16, 32, 48, 64], stage_num_blocks=[1, 1, 2, 1], stage_numb_of_layers=[2, 2, 2, 2],
    out_indices=[3, 4], decoder_in_channels=[32, 32], num_feature_levels=2, encode_proj_layers=[1],
    decoder_n_points=4, decoder_layers=2, encoder_hidden_dim=32, encoder_ffn_dim=64, encoder_attention_heads=2,
    d_model=32, decoder_ffn_dim=64, decoder_attention_heads=4, num_queries=20, depth_mult=0.34,
    hidden_expansion=0.5, lqe_hidden_dim=16, max_num_bins=8, id2label={0: "cat", 1: "person"}, num_labels=2)


def test_a_detector_with_nan_weights_is_refused_at_load(checkpoints, tmp_path, capsys):
    """As --model's are: one line naming the file, exit 2, before anything is written (it used to run, find no one
    in any image and fall back to the whole image, silently)."""
    folder = tmp_path / "dfine"
    folder.mkdir()
    state = {name: torch.full_like(t, float("nan")) if t.is_floating_point() else t
             for name, t in dfine.DFine(TINY_DFINE).state_dict().items()}
    save_file(state, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({"model_type": "d_fine", **dataclasses.asdict(TINY_DFINE)}))
    image = write_images(tmp_path / "in", {"a.jpg": (40, 30)}) / "a.jpg"
    out = tmp_path / "out"
    code = predict.main(["pose", str(image), "-o", str(out), "--detector", str(folder),
                         *model_args(checkpoints, ["pose"])])
    err = capsys.readouterr().err
    lines = error_lines(err)
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"error: --detector: {folder}: ") and "tensors hold NaN or Inf values" in lines[0]
    assert lines[0].endswith("a corrupt checkpoint, refused")
    assert not out.exists() or list(out.iterdir()) == []  # (the writability probe may have made the folder)
