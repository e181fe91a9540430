"""The pipelined runner (predict.py --workers N, sapiens2_app/predict/pipeline.py + stages.py) against the serial one
(--workers 0): the same files and run.json, files written in the order of the inputs, memory bounded whatever the
number of images, and a failing worker that fails what the serial runner fails, without a hang."""

import json
import signal
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open

import predict
from sapiens2 import processing
from sapiens2_app.predict import outputs as outputs_module
from sapiens2_app.common import safe_io
from sapiens2_app.predict import inference, pipeline
from test_predict import checkpoints, model_args, write_images  # noqa: F401, F811 (a fixture)

TASKS = "seg,normal,pose,features"
SIZES = {f"{folder}im{i}.{ext}": (20 + 3 * i, 16 + 2 * i) for i, (folder, ext) in
         enumerate([("", "jpg"), ("", "png"), ("sub/", "jpg"), ("sub/", "png"), ("", "jpg"), ("deep/er/", "png"),
                    ("", "png")])}


@contextmanager
def no_hang(seconds: int = 120):
    """Fail (instead of blocking the suite) when the block hangs: SIGALRM interrupts the main thread."""
    def timeout(signum, frame):
        raise TimeoutError(f"no result after {seconds} s: a hang")

    previous = signal.signal(signal.SIGALRM, timeout)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> Path:
    return write_images(tmp_path_factory.mktemp("photos"), SIZES)


def run(photos, out, workers, checkpoints, *extra) -> int:
    with no_hang():
        return predict.main([TASKS, str(photos), "-o", str(out), "--workers", str(workers), "--batch-size", "2",
                             "--detector", "seg", *model_args(checkpoints, TASKS.split(",")), *extra])


def contents(out: Path) -> dict[str, object]:
    """Every file under OUT by name: its bytes; the features file by its tensors and metadata (safetensors writes
    its metadata in a hash map's order, which differs from process to process); run.json without its times."""
    found = {}
    for path in sorted(p for p in out.rglob("*") if p.is_file()):
        name = str(path.relative_to(out))
        if path.suffix == ".safetensors":
            with safe_open(str(path), "pt") as f:
                found[name] = (f.metadata(), {k: f.get_tensor(k).tolist() for k in f.keys()})
        elif path.name == "run.json":
            manifest = json.loads(path.read_text())
            found[name] = {k: manifest[k] for k in ("status", "counts", "errors", "warnings", "not_attempted")}
        else:
            found[name] = path.read_bytes()
    return found


def test_pipelined_files_are_the_serial_files(checkpoints, photos, tmp_path):
    assert run(photos, tmp_path / "serial", 0, checkpoints) == 0
    assert run(photos, tmp_path / "pipelined", 3, checkpoints) == 0
    serial, pipelined = contents(tmp_path / "serial"), contents(tmp_path / "pipelined")
    assert serial.keys() == pipelined.keys() and len(serial) > 5 * len(SIZES)
    assert [name for name in serial if serial[name] != pipelined[name]] == []


@pytest.mark.parametrize("boxes", ["whole image", "--boxes"])
def test_pose_crops_made_ahead_give_the_serial_files(checkpoints, photos, tmp_path, monkeypatch, boxes):
    """Pose boxes that need no model (the whole image: --detector none; a --boxes entry) are cropped in the decode
    thread (Inference.pose_ahead): the same files as the serial runner, which crops in its batch."""
    extra = ["--detector", "none"]
    if boxes == "--boxes":  # two people in im0, none in im1, the whole image for the others (no entry: seg blobs)
        entries = {"im0.jpg": [[1, 1, 8, 10], [9, 4, 6, 12]], "im1.png": [], "sub/im2.jpg": [[0, 0, 30, 40]]}
        (tmp_path / "boxes.json").write_text(json.dumps(entries))
        extra = ["--boxes", str(tmp_path / "boxes.json")]
    made_ahead, real = [], inference.Inference.pose_ahead
    monkeypatch.setattr(inference.Inference, "pose_ahead",
                        lambda self, item, image: made_ahead.append(item.relative) or real(self, item, image))
    for workers in (0, 3):
        with no_hang():
            assert predict.main(["seg,pose", str(photos), "-o", str(tmp_path / f"w{workers}"), "--workers",
                                 str(workers), "--batch-size", "2", "--save", "raw,json,vis,openpose,coco", *extra,
                                 *model_args(checkpoints, ["seg", "pose"])]) == 0
    expected = sorted(SIZES) if boxes == "whole image" else ["im0.jpg", "im1.png", "sub/im2.jpg"]
    assert sorted(made_ahead) == expected  # by the pipelined run only, and only where no model decides
    serial, pipelined = contents(tmp_path / "w0"), contents(tmp_path / "w3")
    assert serial.keys() == pipelined.keys() and [name for name in serial if serial[name] != pipelined[name]] == []
    people = json.loads((tmp_path / "w3" / "im0.pose.json").read_text())["people"]
    assert len(people) == (1 if boxes == "whole image" else 2)


def recording_writes(monkeypatch, delay: float = 0.0) -> list[str]:
    """The files written, in the order write_value is called (after `delay` seconds each: a slow disk)."""
    names, real = [], safe_io.write_value

    def write_value(file, value, suffix):
        time.sleep(delay)
        names.append(Path(file).name)
        return real(file, value, suffix)

    monkeypatch.setattr(safe_io, "write_value", write_value)
    return names


def test_files_are_written_in_the_order_of_the_inputs(checkpoints, photos, tmp_path, monkeypatch):
    written = recording_writes(monkeypatch)
    assert run(photos, tmp_path / "serial", 0, checkpoints) == 0
    serial = list(written)
    written.clear()
    assert run(photos, tmp_path / "pipelined", 4, checkpoints) == 0
    assert stems(written) == stems(serial) and len(written) > 5 * len(SIZES)


def stems(names: list[str]) -> list[str]:
    """Temporaries' names (.NAME.PID.RANDOM.partial: they differ from run to run) as the NAME they become."""
    return [safe_io.TEMPORARY.match(name)[1] if safe_io.TEMPORARY.match(name) else name for name in names]


def test_memory_is_bounded_on_many_images(checkpoints, tmp_path, monkeypatch):
    """With a slow disk, images wait to be written; at most a bounded number of them is alive at once (decoded and
    not yet written), whatever the number of inputs: DECODE_AHEAD batches ahead of the model, the batch the model
    runs, and WRITES_WAITING per worker waiting to be written, plus the one being written."""
    photos = write_images(tmp_path / "many", {f"p{i:03d}.png": (18, 14) for i in range(40)})
    alive, most, lock = set(), [0], threading.Lock()
    real_load, real_commit = processing.load_image, pipeline.Run.commit

    def load_image(image):
        if isinstance(image, Path):  # a file decoded (pictures call it on tensors too)
            with lock:
                alive.add(image.name)
                most[0] = max(most[0], len(alive))
        return real_load(image)

    def commit(self, item, result, made):
        time.sleep(0.02)  # a slow disk: the writer is the bottleneck, the model runs ahead as far as it may
        try:
            return real_commit(self, item, result, made)
        finally:
            with lock:
                alive.discard(item.path.name)

    monkeypatch.setattr(processing, "load_image", load_image)
    monkeypatch.setattr(pipeline.Run, "commit", commit)
    workers, batch = 2, 2
    with no_hang():
        assert predict.main(["seg", str(photos), "-o", str(tmp_path / "out"), "--workers", str(workers),
                             "--batch-size", str(batch), *model_args(checkpoints, ["seg"])]) == 0
    bound = pipeline.DECODE_AHEAD * batch + batch + pipeline.WRITES_WAITING * workers + 1 + batch  # + one being decoded
    assert len(alive) == 0 and 0 < most[0] <= bound, (most[0], bound)
    assert most[0] > batch  # the stages did overlap: more than one batch alive at a time


def test_a_file_that_cannot_be_made_fails_its_task_only(checkpoints, photos, tmp_path, monkeypatch):
    """A worker making im2's normal picture raises: its normal task fails, everything else is written, as with one
    thread."""
    real = outputs_module.render

    def render(task, item, image, result, loaded):
        made = real(task, item, image, result, loaded)
        if task == "normal" and item.path.name == "im2.jpg":
            made[".normal.png"] = lambda: (_ for _ in ()).throw(RuntimeError("simulated render failure"))
        return made

    monkeypatch.setattr(outputs_module, "render", render)
    for workers in (0, 3):
        out = tmp_path / f"w{workers}"
        assert run(photos, out, workers, checkpoints) == 1
        manifest = json.loads((out / "run.json").read_text())
        assert manifest["errors"] == [{"image": str(photos / "sub/im2.jpg"), "task": "normal",
                                       "error": "RuntimeError: simulated render failure"}]
        assert manifest["counts"]["written"] == len(SIZES) - 1 and not list(out.glob("sub/im2.normal.*"))


def test_a_failing_post_processing_fails_its_task_only(checkpoints, photos, tmp_path, monkeypatch):
    """Post-processing runs late (a Pending, in the workers that make the files): when decoding im2's pose or
    resizing im4's normals back raises there, that task of that image fails, everything else is written, as with
    one thread."""
    real_pose, real_normals = processing.postprocess_pose, processing.postprocess_normals

    def failing_on(size, real, what):
        def postprocess(maps, inputs, *args, **kwargs):
            if tuple(inputs.image_sizes[0]) == size:
                raise RuntimeError(f"simulated {what} failure")
            return real(maps, inputs, *args, **kwargs)
        return postprocess

    im2, im4 = SIZES["sub/im2.jpg"], SIZES["im4.jpg"]  # (height, width), one of each size
    monkeypatch.setattr(processing, "postprocess_pose", failing_on(im2, real_pose, "pose decoding"))
    monkeypatch.setattr(processing, "postprocess_normals", failing_on(im4, real_normals, "normal resizing"))
    for workers in (0, 3):
        out = tmp_path / f"w{workers}"
        assert run(photos, out, workers, checkpoints) == 1
        manifest = json.loads((out / "run.json").read_text())
        assert manifest["errors"] == [  # in the order of the inputs
            {"image": str(photos / "im4.jpg"), "task": "normal",
             "error": "RuntimeError: simulated normal resizing failure"},
            {"image": str(photos / "sub/im2.jpg"), "task": "pose",
             "error": "RuntimeError: simulated pose decoding failure"}]
        assert manifest["counts"]["written"] == len(SIZES) - 2
        assert not list(out.glob("sub/im2.pose*")) and (out / "sub/im2.seg.png").exists()
        assert not list(out.glob("im4.normal.*")) and (out / "im4.pose.json").exists()


def test_an_unexpected_error_in_the_writer_ends_the_run_without_a_hang(checkpoints, photos, tmp_path,
                                                                        monkeypatch):
    """A bug in the writer thread (not a write error) is raised in the main thread, as with one thread, and the
    manifest says the run did not finish."""
    real = pipeline.Run.commit

    def commit(self, item, result, made):
        if item.path.name == "im3.png":
            raise RuntimeError("a bug in the writer")
        return real(self, item, result, made)

    monkeypatch.setattr(pipeline.Run, "commit", commit)
    for workers in (0, 3):
        out = tmp_path / f"w{workers}"
        with pytest.raises(RuntimeError, match="a bug in the writer"):
            run(photos, out, workers, checkpoints)
        manifest = json.loads((out / "run.json").read_text())
        before = sorted(SIZES).index("sub/im3.png")  # the inputs before it, in the run's order
        assert manifest["status"] == "interrupted" and manifest["counts"]["written"] == before


def test_unreadable_images_are_reported_in_order(checkpoints, tmp_path):
    """A decode failure found ahead, in the decoding thread, is reported where the serial runner reports it."""
    photos = write_images(tmp_path / "in", {f"p{i}.png": (18, 14) for i in range(5)})
    (photos / "p2.png").write_bytes((photos / "p2.png").read_bytes()[:60])  # a valid header, then cut short
    runs = {}
    for workers in (0, 2):
        out = tmp_path / f"w{workers}"
        with no_hang():
            assert predict.main(["seg", str(photos), "-o", str(out), "--workers", str(workers),
                                 *model_args(checkpoints, ["seg"])]) == 1
        runs[workers] = contents(out)
    assert runs[0] == runs[2]
    assert [Path(e["image"]).name for e in runs[2]["run.json"]["errors"]] == ["p2.png"]


def test_outputs_decode_to_the_same_pixels_as_before(tmp_path):
    """PNGs are written at zlib level 1 (safe_io.PNG_COMPRESS_LEVEL): other bytes than Pillow's default, the same
    pixels."""
    pixels = np.random.default_rng(0).integers(0, 256, size=(30, 20, 3), dtype=np.uint8)
    safe_io.atomic_write(tmp_path / "a.png", Image.fromarray(pixels))
    Image.fromarray(pixels).save(tmp_path / "default.png")
    assert np.array_equal(np.array(Image.open(tmp_path / "a.png")), np.array(Image.open(tmp_path / "default.png")))
    assert torch.equal(torch.from_numpy(np.array(Image.open(tmp_path / "a.png"))), torch.from_numpy(pixels))


def test_features_files_are_the_same_bytes_every_time(tmp_path):
    """A features file's header lists its metadata and tensors in one order: safetensors writes them in a Rust
    HashMap's order, which changed from call to call (15 orders in 20 calls), so the same run gave other bytes."""
    tensors = {"cls": torch.arange(4.0), "features": torch.ones(4, 2, 3)}
    about = {"image": "é/a.jpg", "height": "80", "width": "60", "model": "m.safetensors", "random_weights": "false"}
    files = {safe_io.encode((tensors, about), ".features.safetensors") for _ in range(20)}
    assert len(files) == 1
    (tmp_path / "a.safetensors").write_bytes(files.pop())
    with safe_open(str(tmp_path / "a.safetensors"), framework="pt") as f:  # still a file safetensors reads
        assert f.metadata() == about and set(f.keys()) == set(tensors)
        assert all(torch.equal(f.get_tensor(name), tensor) for name, tensor in tensors.items())


def test_bench_pipeline_runs_its_rows(tmp_path):
    """bench/pipeline.py end to end on a tiny case: one row per runner, the stand-in's ideal from the serial row's
    CPU time, the stage times, the baseline checkout's row beside them, and the JSON."""
    import importlib.util

    from conftest import ROOT

    spec = importlib.util.spec_from_file_location("bench_pipeline", ROOT / "bench" / "pipeline.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "pipeline.json"
    with no_hang(300):
        assert bench.main(["--tasks", "seg", "--photos", "48x64", "--images", "3", "--workers", "0,2",
                           "--baseline", "HEAD", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [(r["tasks"], r["photo"], r["workers"]) for r in rows] == [("seg", "48x64", 0), ("seg", "48x64", 2)]
    for row in rows:
        assert row["free"]["images"] == 3 and row["free"]["images_per_s"] > 0
        assert {"decode", "preprocess", "model", "postprocess", "render", "encode", "write"} <= set(
            row["free"]["stage_wall_ms_per_image"])
        held = row["stand_in"]  # T: the serial free row's time per image (0.05 ms: its rounding)
        assert held["hold_ms_per_image"] == pytest.approx(1000 / rows[0]["free"]["images_per_s"], abs=0.05)
        assert held["ideal_images_per_s"] == pytest.approx(1000 / held["hold_ms_per_image"], abs=1e-3)
        assert "to_host" in row["free"]["stage_wall_ms_per_image"]
        assert row["free"]["device_to_host_bytes_per_image"] == 64 * 48  # seg: the photo's uint8 class map
        host = sum(row["free"]["stage_cpu_ms_per_image"][s] for s in bench.HOST_STAGES)
        assert row["free"]["host_ms_per_image_with_a_device"] == pytest.approx(host, abs=0.06)  # sum of 5 rounded
        then = row["baseline"]  # HEAD's predict.py, in a process of its own, on the same photos, its stages timed
        assert len(then["revision"]) == 40 and then["free"]["images"] == 3
        assert {"decode", "preprocess", "postprocess", "render"} <= set(then["free"]["stage_cpu_ms_per_image"])
        assert row["speedup_free_vs_baseline"] == pytest.approx(
            row["free"]["images_per_s"] / then["free"]["images_per_s"], rel=2e-3)  # both rounded to 3 digits
    assert result["device"] == "cpu" and "torch" in result["versions"]
