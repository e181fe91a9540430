"""predict.py and weights.load under bad input, faults and concurrency (issue 12): a correct result, or one clear
line naming the file/argument with exit status 2; other images' outputs complete; no partial or stale files;
nothing written outside OUT. Write faults (disk full, read-only, no permission) are injected by wrapping
safe_io.write_value, the one function every output, manifest and probe goes through (tests run as root, where
chmod cannot make a folder read-only)."""

import errno
import json
import multiprocessing
import os
import re
import signal
import struct
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageFile
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from sapiens2 import heads
import predict
from sapiens2 import processing, weights
from sapiens2_app.common import safe_io
from sapiens2_app.predict import inference, inputs, models, pipeline
from sapiens2_app.predict.boxes import fit_boxes, read_boxes_file
from test_predict import model_args, tiny_model, write_images

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("checkpoints")
    torch.manual_seed(0)
    return {task: weights.save(tiny_model(task), folder / f"{task}.safetensors") for task in predict.TASKS}


@pytest.fixture(scope="module")
def image(tmp_path_factory) -> Path:
    return write_images(tmp_path_factory.mktemp("one"), {"a.jpg": (40, 30)}) / "a.jpg"


def strict_json(path: Path):
    """json.loads that refuses NaN/Infinity, as strict parsers do."""
    def refuse(name):
        raise ValueError(f"{path}: {name} is not JSON")
    return json.loads(path.read_text(), parse_constant=refuse)


def error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("error:")]


def no_partials(root: Path) -> bool:
    return not [p for p in root.rglob("*") if p.name.endswith(".partial")]


@pytest.fixture
def no_model_loads(monkeypatch):
    """For checks that must fail before any model is loaded."""
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the arguments were checked")
    monkeypatch.setattr(models, "load_models", refuse)


# ----------------------------------------------------------------------------------------------------
# Unusable checkpoints: one line naming the file, exit 2, no traceback; weights.load names the file
# ----------------------------------------------------------------------------------------------------
def seg_state(checkpoints):
    return load_file(checkpoints["seg"]), safe_metadata(checkpoints["seg"])


def safe_metadata(path):
    with safe_open(str(path), framework="pt") as f:
        return f.metadata()


def make_bad_checkpoint(kind: str, checkpoints, folder: Path) -> tuple[Path, str, str]:
    """(what to pass as --model seg=..., the file the message must name, a phrase it must contain)."""
    state, meta = seg_state(checkpoints)
    target = folder / f"{kind}.safetensors"
    if kind == "truncated":
        data = checkpoints["seg"].read_bytes()
        target.write_bytes(data[: len(data) // 2])
        return target, str(target), "not a readable safetensors file"
    if kind == "wrong-shapes":
        weight = state["decode_head.conv_seg.weight"]  # its class count kept: a wrong count has its own message
        state["decode_head.conv_seg.weight"] = torch.zeros(weight.shape[0], weight.shape[1] + 1, 1, 1)
        save_file(state, target, metadata=meta)
        return target, str(target), "mis-shaped"
    if kind == "missing-keys":
        del state["decode_head.conv_seg.bias"]
        save_file(state, target, metadata=meta)
        return target, str(target), "missing (1)"
    if kind == "extra-keys":
        state["decode_head.surprise.weight"] = torch.zeros(2)
        save_file(state, target, metadata=meta)
        return target, str(target), "unexpected (1)"
    if kind == "nan-weights":
        state["backbone.blocks.1.attn.wq.weight"][0, 0] = float("nan")
        state["decode_head.conv_seg.bias"][0] = float("inf")
        save_file(state, target, metadata=meta)
        return target, str(target), "2 tensors hold NaN or Inf values (backbone.blocks.1.attn.wq.weight"
    if kind in ("pickle-pt", "pickle-bin"):
        target = folder / ("model.pt" if kind == "pickle-pt" else "pytorch_model.bin")
        torch.save({"cls_token": torch.zeros(1, 1, 8)}, target)
        return target, str(target), "pickled PyTorch checkpoint"
    if kind == "wrong-task":
        return checkpoints["pose"], str(checkpoints["pose"]), "is a pose checkpoint, but a seg model was requested"
    directory = folder / kind
    directory.mkdir()
    if kind == "garbage-config":
        weights.save(tiny_model("seg"), directory)
        (directory / "config.json").write_text("{'hidden_size': 32,")
        return directory, str(directory / "config.json"), "not valid JSON"
    save_file(state, directory / "model-00001-of-00001.safetensors", metadata=meta)
    index = directory / "model.safetensors.index.json"
    if kind == "index-without-weight-map":
        index.write_text(json.dumps({"metadata": {"total_size": 1}}))
        return directory, str(index), 'no "weight_map"'
    if kind == "index-missing-shard":
        index.write_text(json.dumps({"weight_map": {k: "model-00002-of-00002.safetensors" for k in state}}))
        return directory, str(index), "shard model-00002-of-00002.safetensors is missing"
    raise ValueError(kind)


BAD_CHECKPOINTS = ["truncated", "wrong-shapes", "missing-keys", "extra-keys", "nan-weights", "pickle-pt", "pickle-bin",
                   "wrong-task", "garbage-config", "index-without-weight-map", "index-missing-shard"]


@pytest.mark.parametrize("kind", BAD_CHECKPOINTS)
def test_unusable_checkpoint_is_one_line_naming_the_file(kind, checkpoints, image, tmp_path, capsys):
    source, named, phrase = make_bad_checkpoint(kind, checkpoints, tmp_path)
    expected = FileNotFoundError if kind == "index-missing-shard" else weights.CheckpointError
    with pytest.raises(expected) as info:
        weights.load(source, task="seg")
    assert named in str(info.value) and phrase in str(info.value)
    code = predict.main(["seg", str(image), "-o", str(tmp_path / "out"), "--model", f"seg={source}"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    (line,) = error_lines(err)
    assert line == err.strip() and named in line and phrase in line
    assert not (tmp_path / "out" / "run.json").exists()


def test_nan_weights_are_refused_not_run(checkpoints, tmp_path):
    """Without the check the model loads and every pixel comes out class 0: refused at load instead."""
    state, meta = seg_state(checkpoints)
    state["decode_head.conv_seg.weight"].fill_(float("nan"))
    save_file(state, tmp_path / "nan.safetensors", metadata=meta)
    with pytest.raises(weights.CheckpointError, match=r"nan.safetensors: 1 tensors hold NaN or Inf values "
                                                      r"\(decode_head.predictor.weight\)"):
        weights.load(tmp_path / "nan.safetensors")


# ----------------------------------------------------------------------------------------------------
# Inputs that cannot be read: found by their header before any model loads
# ----------------------------------------------------------------------------------------------------
def deny_reading(monkeypatch, path: Path, owner, name: str):
    """chmod 000. The tests run as root, whom the kernel lets read it anyway: there the EACCES everyone else gets
    is raised where the file is opened (`owner.name`, called with the path first)."""
    path.chmod(0)
    if os.geteuid() != 0:
        return
    real = getattr(owner, name)

    def opener(target, *args, **kwargs):
        if Path(target) == path:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real(target, *args, **kwargs)

    monkeypatch.setattr(owner, name, opener)


def make_unreadable_input(kind: str, folder: Path, monkeypatch) -> tuple[Path, Path, str]:
    """(the input to pass, the file the message must name, a phrase it must contain)."""
    folder.mkdir(parents=True, exist_ok=True)
    if kind == "text":  # `predict.py seg README.md`
        (folder / "README.md").write_text("# not an image\n")
        return folder / "README.md", folder / "README.md", "not an image (Pillow does not recognise the format)"
    if kind == "text-named-jpg":  # found in a folder by its suffix
        (folder / "photo.jpg").write_text("not a jpeg")
        return folder, folder / "photo.jpg", "not an image"
    if kind == "empty":
        (folder / "empty.png").write_bytes(b"")
        return folder / "empty.png", folder / "empty.png", "the file is empty"
    if kind == "unreadable":
        write_images(folder, {"locked.jpg": (20, 16)})
        deny_reading(monkeypatch, folder / "locked.jpg", processing.Image, "open")
        return folder / "locked.jpg", folder / "locked.jpg", "cannot read it (Permission denied)"
    if kind == "list-entry":
        (folder / "notes.md").write_text("not an image")
        (folder / "list.txt").write_text("notes.md\n")
        return folder / "list.txt", folder / "notes.md", "not an image"
    if kind == "broken-video":
        pytest.importorskip("av")
        (folder / "clip.mp4").write_bytes(b"not a video at all")
        return folder / "clip.mp4", folder / "clip.mp4", "cannot be read as a video"
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["text", "text-named-jpg", "empty", "unreadable", "list-entry", "broken-video"])
def test_an_unreadable_input_is_refused_before_loading(kind, tmp_path, monkeypatch, capsys, no_model_loads):
    source, named, phrase = make_unreadable_input(kind, tmp_path / "in", monkeypatch)
    out = tmp_path / "out"
    assert predict.main(["seg", str(source), "-o", str(out), "--model", "seg=unused.safetensors"]) == 2
    err = capsys.readouterr().err
    (line,) = error_lines(err)
    assert line == err.strip() and str(named) in line and phrase in line
    assert not out.exists()  # nothing written


def test_unreadable_inputs_among_good_ones_are_skipped_before_the_models_load(checkpoints, tmp_path, monkeypatch,
                                                                              capsys):
    """As the README promises for a bad image: reported and skipped, the others written, exit 1; only the
    reporting comes before the models load (and is not repeated after)."""
    folder = write_images(tmp_path / "in", {"a.jpg": (20, 16), "b.png": (16, 20), "locked.jpg": (20, 16)})
    (folder / "notes.jpg").write_text("not a jpeg")
    (folder / "empty.png").write_bytes(b"")
    deny_reading(monkeypatch, folder / "locked.jpg", processing.Image, "open")
    before_loading, real = [], models.load_models

    def load_models(*args, **kwargs):
        before_loading.append(capsys.readouterr().err)
        return real(*args, **kwargs)

    monkeypatch.setattr(models, "load_models", load_models)
    out = tmp_path / "out"
    assert predict.main(["seg", str(folder), "-o", str(out), *model_args(checkpoints, ["seg"])]) == 1
    bad = ["empty.png", "locked.jpg", "notes.jpg"]
    lines = error_lines(before_loading[0])
    assert len(lines) == 3 and all(line.endswith("(skipped)") for line in lines)
    assert all(sum(f"{folder / name}: " in line for line in lines) == 1 for name in bad)
    assert not error_lines(capsys.readouterr().err)
    manifest = strict_json(out / "run.json")
    assert manifest["counts"] == {"images": 5, "written": 2, "failed": 3, "skipped_existing": 0, "not_attempted": 0}
    assert sorted(Path(e["image"]).name for e in manifest["errors"]) == bad
    assert sorted(p.name for p in out.glob("*.seg.png")) == ["a.seg.png", "b.seg.png"]


def bomb_png(path: Path, width: int = 30000, height: int = 30000) -> Path:
    """A 69-byte PNG whose header declares width x height RGB pixels (2.7 GB for 30000x30000): a decompression bomb,
    refused by Pillow when it opens it (over 2 * Image.MAX_IMAGE_PIXELS)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8 bits, RGB, no interlace
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64))
                     + chunk(b"IEND", b""))
    return path


BOMB_LINE = ("declares 30000x30000 pixels, over Pillow's limit of 178956970 pixels: refused as a possible "
             "decompression bomb (downscale it to use it)")
GOOD = {f"g{i}.jpg": (20 + i, 16) for i in range(5)}


def assert_only_failed(out: Path, folder: Path, err: str, bad: str, phrase: str):
    """`bad` has its one error line (naming it, with `phrase`) and its failed entry in run.json; every other input
    (GOOD) has all of its files."""
    assert "Traceback" not in err, err
    (line,) = error_lines(err)
    assert line.startswith(f"error: ImageLoadError: {folder / bad}: ") and phrase in line and line.endswith(
        "(skipped)"), line
    manifest = strict_json(out / "run.json")
    assert manifest["counts"] == {"images": 6, "written": 5, "failed": 1, "skipped_existing": 0, "not_attempted": 0}
    assert [(Path(e["image"]).name, "task" in e) for e in manifest["errors"]] == [(bad, False)]
    assert phrase in manifest["errors"][0]["error"]
    for name, (h, w) in GOOD.items():
        with Image.open(out / name.replace(".jpg", ".seg.png")) as seg:
            assert seg.size == (w, h)
        assert (out / name.replace(".jpg", ".seg_overlay.jpg")).is_file()
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [n.replace(".jpg", s) for n in GOOD for s in (".seg.png", ".seg_overlay.jpg")] + ["run.json"])


@pytest.mark.parametrize("workers", [0, 2])
def test_a_decompression_bomb_among_good_images_fails_alone(workers, checkpoints, tmp_path, capsys):
    """Issue 29: a PNG declaring 30000x30000 pixels among good images. Pillow's DecompressionBombError is neither
    an OSError nor a ValueError: the check of the inputs before loading stopped the whole run with a traceback."""
    folder = write_images(tmp_path / "in", GOOD)
    bomb_png(folder / "bomb.png")
    out = tmp_path / "out"
    code = predict.main(["seg", str(folder), "-o", str(out), "--workers", str(workers),
                         *model_args(checkpoints, ["seg"])])
    assert code == 1  # some images failed, one process (predict.py's exit statuses)
    assert_only_failed(out, folder, capsys.readouterr().err, "bomb.png", BOMB_LINE)


class DecoderBug(RuntimeError):
    """What a decoder might raise on a crafted file: a class nobody lists."""


def raise_decoder_bug_for(monkeypatch, bad: Path, where: str):
    """Pillow raises DecoderBug for `bad`: when opening it (its header: the check before the models load), or when
    decoding its pixels (the runner's decode; the header reads fine)."""
    if where == "open":
        real_open = processing.Image.open

        def fake_open(target, *args, **kwargs):
            if Path(target) == bad:
                raise DecoderBug("unexpected marker 0xff at byte 33")
            return real_open(target, *args, **kwargs)

        monkeypatch.setattr(processing.Image, "open", fake_open)
        return
    real_load = ImageFile.ImageFile.load

    def fake_load(image):
        if image.filename and Path(image.filename) == bad:
            raise DecoderBug("unexpected marker 0xff at byte 33")
        return real_load(image)

    monkeypatch.setattr(ImageFile.ImageFile, "load", fake_load)


@pytest.mark.parametrize("where", ["open", "load"])
@pytest.mark.parametrize("workers", [0, 2])
def test_whatever_a_decoder_raises_fails_its_image_alone(where, workers, checkpoints, tmp_path, monkeypatch, capsys):
    folder = write_images(tmp_path / "in", {**GOOD, "odd.png": (20, 16)})
    raise_decoder_bug_for(monkeypatch, folder / "odd.png", where)
    out = tmp_path / "out"
    code = predict.main(["seg", str(folder), "-o", str(out), "--workers", str(workers),
                         *model_args(checkpoints, ["seg"])])
    assert code == 1
    assert_only_failed(out, folder, capsys.readouterr().err, "odd.png",
                       "cannot decode it (DecoderBug: unexpected marker 0xff at byte 33)")


def test_an_unreadable_list_file_is_one_line(tmp_path, monkeypatch, capsys, no_model_loads):
    listing = tmp_path / "list.txt"
    listing.write_text("a.jpg\n")
    deny_reading(monkeypatch, listing, Path, "read_text")
    assert predict.main(["seg", str(listing), "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [f"error: {listing}: cannot read this list of inputs (Permission denied)"]
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"\xff\xd8\xff\xe0 a jpeg named .txt")
    assert predict.main(["seg", str(binary), "-o", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.splitlines() == [f"error: {binary}: cannot read this list of inputs (not a text file)"]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("spec", ["sgm-0.4b", "seg=sgm-0.4b"])
def test_a_model_name_that_names_nothing_lists_the_valid_ones(spec, image, tmp_path, capsys, no_model_loads):
    assert predict.main(["seg", str(image), "-o", str(tmp_path / "out"), "--model", spec]) == 2
    err = capsys.readouterr().err
    (line,) = error_lines(err)
    assert line == err.strip() and line.startswith(f"error: --model {spec}: no such file or folder")
    for name in ("0.1b", "1b-4k", "seg-0.4b", "pose-0.4b/0.8b/1b/5b", "matting-1b", "a hub id (owner/name)"):
        assert name in line
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------------------------------
# Paths: outputs always under OUT, distinct names, no symlink loops, existing names taken literally
# ----------------------------------------------------------------------------------------------------
def test_glob_climbing_out_of_its_folder_still_writes_under_out(checkpoints, tmp_path, monkeypatch, capsys):
    write_images(tmp_path, {"img/a.jpg": (20, 16)})
    (tmp_path / "photos" / "x").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert [i.relative for i in inputs.collect_inputs(["photos/*/../../img/a.jpg"])] == ["a.jpg"]
    code = predict.main(["seg", "photos/*/../../img/a.jpg", "-o", "out", *model_args(checkpoints, ["seg"])])
    assert code == 0, capsys.readouterr().err
    written = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.seg*"))
    assert written == ["out/a.seg.png", "out/a.seg_overlay.jpg"]


def test_output_names_never_leave_out():
    item = inputs.InputImage(Path("/x/a.jpg"), "../a.jpg")
    with pytest.raises(predict.UsageError, match="outside the output folder"):
        inputs.output_names([item])
    assert [inputs.climbs_out(n) for n in ("a/../../b", "a/../b", "/abs", "..", "..a")] == [
        True, False, True, True, False]


def test_colliding_output_names_are_told_apart(checkpoints, tmp_path, capsys):
    folder = write_images(tmp_path / "in", {"x.jpg": (20, 16), "x.png": (16, 20), "x.jpg.png": (24, 16),
                                            "y.JPG": (16, 16), "Y.png": (16, 16)})
    items = inputs.collect_inputs([str(folder)])
    names = {item.relative: name for item, name in inputs.output_names(items).items()}
    assert names == {"x.jpg": "x.jpg", "x.jpg.png": "x.jpg.png", "x.png": "x.png", "Y.png": "Y.png",
                     "y.JPG": "y.JPG"}
    assert len({name.casefold() for name in names.values()}) == 5
    out = tmp_path / "out"
    assert predict.main(["seg", str(folder), "-o", str(out), *model_args(checkpoints, ["seg"])]) == 0
    err = capsys.readouterr().err
    assert "inputs would write the same outputs as another; named apart" in err
    sizes = {p.name: Image.open(p).size for p in out.glob("*.seg.png")}
    assert sizes == {"x.jpg.seg.png": (16, 20), "x.png.seg.png": (20, 16), "x.jpg.png.seg.png": (16, 24),
                     "y.JPG.seg.png": (16, 16), "Y.png.seg.png": (16, 16)}
    assert json.loads((out / "run.json").read_text())["counts"]["written"] == 5


def test_still_clashing_names_get_a_number():
    items = [inputs.InputImage(Path(f"/{i}/{name}"), name) for i, name in enumerate(["a.jpg", "A.jpg", "a.png"])]
    names = sorted(inputs.output_names(items).values())
    assert names == ["A.jpg", "a.jpg~2", "a.png"]


def run_with_deadline(function, seconds=30):
    result = {}
    thread = threading.Thread(target=lambda: result.update(value=function()), daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "did not finish: a symlink loop was followed"
    return result["value"]


def test_symlink_loops_are_not_followed(tmp_path, monkeypatch):
    write_images(tmp_path / "photos", {"a.jpg": (8, 8), "sub/b.jpg": (8, 8)})
    (tmp_path / "photos" / "sub" / "loop").symlink_to("..", target_is_directory=True)
    (tmp_path / "photos" / "self").symlink_to(".", target_is_directory=True)
    (tmp_path / "photos" / "me.jpg").symlink_to("me.jpg")  # a file link to itself
    (tmp_path / "photos" / "x.seg.png").symlink_to("x.seg.png")
    monkeypatch.chdir(tmp_path)
    names = lambda spec: [i.relative for i in inputs.collect_inputs([spec], tmp_path / "photos")]  # noqa: E731
    assert run_with_deadline(lambda: names("photos/**/*.jpg")) == ["a.jpg", "sub/b.jpg"]
    assert run_with_deadline(lambda: names("photos/**")) == ["a.jpg", "sub/b.jpg"]
    assert run_with_deadline(lambda: names("photos")) == ["a.jpg", "sub/b.jpg"]


def test_existing_paths_with_glob_characters_are_taken_literally(tmp_path, monkeypatch):
    write_images(tmp_path, {"shot [1].jpg": (8, 8), "shot 1.jpg": (8, 8), "set[2]/c.jpg": (8, 8),
                            "set2/d.jpg": (8, 8)})
    monkeypatch.chdir(tmp_path)
    assert [i.relative for i in inputs.collect_inputs(["shot [1].jpg"])] == ["shot [1].jpg"]
    assert [i.relative for i in inputs.collect_inputs(["set[2]"])] == ["c.jpg"]
    assert [i.relative for i in inputs.collect_inputs(["set[2]/*.jpg"])] == ["set2/d.jpg"]  # not a path: a glob


# ----------------------------------------------------------------------------------------------------
# The output folder: unusable -> exit 2 before any model loads
# ----------------------------------------------------------------------------------------------------
def faulty_writer(monkeypatch, fault):
    """Wrap safe_io.write_value: `fault(file)` returns an errno to raise after half-writing the file, or None."""
    real = safe_io.write_value

    def write_value(file, value, suffix):
        code = fault(Path(file))
        if code is None:
            return real(file, value, suffix)
        Path(file).write_bytes(b"half a file")  # the temporary is left behind unless the writer removes it
        raise OSError(code, os.strerror(code), str(file))

    monkeypatch.setattr(safe_io, "write_value", write_value)


def test_unusable_output_folder_fails_fast(image, tmp_path, monkeypatch, capsys, no_model_loads):
    (tmp_path / "file").write_text("a file")
    args = ["seg", str(image), "--model", "seg=unused.safetensors"]
    assert predict.main([*args, "-o", str(tmp_path / "file")]) == 2
    assert error_lines(capsys.readouterr().err) == [f"error: -o {tmp_path / 'file'}: is a file, not a folder"]
    assert predict.main([*args, "-o", str(tmp_path / "file" / "out")]) == 2
    (line,) = error_lines(capsys.readouterr().err)
    assert "cannot write there (Not a directory (ENOTDIR)" in line
    faulty_writer(monkeypatch, lambda file: errno.EROFS)
    assert predict.main([*args, "-o", str(tmp_path / "ro")]) == 2
    (line,) = error_lines(capsys.readouterr().err)
    assert line.startswith(f"error: -o {tmp_path / 'ro'}: cannot write there (Read-only file system (EROFS)")
    assert no_partials(tmp_path) and list((tmp_path / "ro").iterdir()) == []


# ----------------------------------------------------------------------------------------------------
# Write errors during the run
# ----------------------------------------------------------------------------------------------------
def outputs_of(out: Path, name: str) -> set[str]:
    return {p.name for p in out.glob(f"{name}.*")}


def test_disk_full_stops_cleanly_and_skip_existing_resumes(checkpoints, tmp_path, monkeypatch, capsys):
    folder = write_images(tmp_path / "in", {f"im{i}.jpg": (20, 16) for i in range(6)})
    out, seg = tmp_path / "out", model_args(checkpoints, ["seg"])
    writes = []

    def disk_full_after_five_outputs(file):
        if file.name.startswith(".sapiens2-write-test"):
            return None  # the probe before the run
        writes.append(file)
        return errno.ENOSPC if len(writes) > 6 else None  # the first manifest and five outputs fit

    faulty_writer(monkeypatch, disk_full_after_five_outputs)
    assert predict.main(["seg", str(folder), "-o", str(out), *seg]) == 1
    err = capsys.readouterr().err
    assert "error: stopped: No space left on device (ENOSPC)" in err and "--skip-existing" in err
    assert err.count("No space left on device") == 2  # the image's error line and the stop line: not one per image
    manifest = strict_json(out / "run.json")  # written over the space the first manifest set aside
    assert manifest["status"] == "stopped" and "ENOSPC" in manifest["stop_reason"]
    assert manifest["counts"] == {"images": 6, "written": 2, "failed": 1, "skipped_existing": 0, "not_attempted": 3}
    assert [Path(e["image"]).name for e in manifest["errors"]] == ["im2.jpg"]
    assert [Path(p).name for p in manifest["not_attempted"]] == ["im3.jpg", "im4.jpg", "im5.jpg"]
    for name in ("im0", "im1"):  # complete: both files, readable
        assert outputs_of(out, name) == {f"{name}.seg.png", f"{name}.seg_overlay.jpg"}
        Image.open(out / f"{name}.seg.png").load()
    assert no_partials(tmp_path)
    monkeypatch.undo()
    assert predict.main(["seg", str(folder), "-o", str(out), "--skip-existing", *seg]) == 0
    counts = strict_json(out / "run.json")["counts"]
    assert counts == {"images": 6, "written": 4, "failed": 0, "skipped_existing": 2, "not_attempted": 0}
    assert all(outputs_of(out, f"im{i}") == {f"im{i}.seg.png", f"im{i}.seg_overlay.jpg"} for i in range(6))


def test_unwritable_subfolder_fails_its_images_only(checkpoints, tmp_path, monkeypatch, capsys):
    folder = write_images(tmp_path / "in", {"a.jpg": (20, 16), "ro/b.jpg": (20, 16), "ro/c.jpg": (20, 16),
                                            "ro/deeper/d.jpg": (20, 16), "z.jpg": (20, 16)})
    out = tmp_path / "out"
    computed = []
    real_infer = pipeline.infer
    monkeypatch.setattr(pipeline, "infer", lambda ctx, items, images, prepared=None: computed.extend(items) or
                        real_infer(ctx, items, images))
    faulty_writer(monkeypatch, lambda file: errno.EACCES if (out / "ro") in file.parents else None)
    assert predict.main(["seg", str(folder), "-o", str(out), "--batch-size", "2",
                         *model_args(checkpoints, ["seg"])]) == 1
    manifest = strict_json(out / "run.json")
    assert manifest["status"] == "finished"
    assert manifest["counts"] == {"images": 5, "written": 2, "failed": 3, "skipped_existing": 0, "not_attempted": 0}
    errors = {Path(e["image"]).name: e["error"] for e in manifest["errors"]}
    assert set(errors) == {"b.jpg", "c.jpg", "d.jpg"} and "Permission denied (EACCES)" in errors["b.jpg"]
    assert "skipped: its output folder is not writable" in errors["c.jpg"]
    assert "b.jpg" in [i.path.name for i in computed] and "d.jpg" not in [i.path.name for i in computed]
    assert outputs_of(out, "a") == {"a.seg.png", "a.seg_overlay.jpg"} and len(outputs_of(out, "z")) == 2
    assert no_partials(tmp_path)


def test_out_turning_read_only_mid_run_stops(checkpoints, tmp_path, monkeypatch, capsys):
    folder = write_images(tmp_path / "in", {f"im{i}.jpg": (20, 16) for i in range(4)})
    out = tmp_path / "out"
    read_only_after_im0 = (".im1", ".im2", ".im3", ".sapiens2-write-test")
    faulty_writer(monkeypatch, lambda file: errno.EROFS if file.name.startswith(read_only_after_im0)
                  and (out / "im0.seg_overlay.jpg").exists() else None)
    assert predict.main(["seg", str(folder), "-o", str(out), *model_args(checkpoints, ["seg"])]) == 1
    manifest = strict_json(out / "run.json")
    assert manifest["status"] == "stopped" and "Read-only file system (EROFS)" in manifest["stop_reason"]
    assert manifest["counts"]["written"] == 1 and manifest["counts"]["not_attempted"] == 2
    assert no_partials(tmp_path)


def write_many(path: str, payload: bytes, count: int):
    for _ in range(count):
        safe_io.atomic_write(Path(path), payload)


def test_temporary_names_are_unique_per_writer(tmp_path):
    """Two processes (and two threads) replacing the same file: no error, never a mixed or partial file."""
    target = tmp_path / "same.bin"
    payloads = [bytes([65 + i]) * 200_000 for i in range(4)]
    context = multiprocessing.get_context("fork")
    processes = [context.Process(target=write_many, args=(str(target), payloads[i], 30)) for i in range(2)]
    threads = [threading.Thread(target=write_many, args=(str(target), payloads[2 + i], 30)) for i in range(2)]
    for worker in processes + threads:
        worker.start()
    for worker in processes + threads:
        worker.join(120)
    assert [p.exitcode for p in processes] == [0, 0]
    assert target.read_bytes() in payloads and no_partials(tmp_path)
    names = []
    real = safe_io.write_value
    try:
        safe_io.write_value = lambda file, value, suffix: names.append(file.name) or real(file, value, suffix)
        safe_io.atomic_write(target, b"x")
        safe_io.atomic_write(target, b"y")
    finally:
        safe_io.write_value = real
    assert names[0] != names[1] and all(re.fullmatch(rf"\.same\.bin\.{os.getpid()}\.[0-9a-f]{{8}}"
                                                     r"\.partial", n) for n in names)


def test_staging_folder_moves_all_or_nothing(tmp_path, monkeypatch):
    """safe_io.staging_folder (train.py's checkpoints, export.py's artifacts): files appear in the destination
    together and only on success (the `last` names moved after the others); a failure leaves the destination as
    it was; the staging folder is gone either way; two writers never share one."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "state.json").write_text("old")
    with pytest.raises(RuntimeError), safe_io.staging_folder(out, prefix=".ckpt.", last=("state.json",)) as staging:
        (staging / "model.bin").write_text("new")
        raise RuntimeError("disk full")
    assert sorted(p.name for p in out.iterdir()) == ["state.json"] and (out / "state.json").read_text() == "old"
    moved = []
    real_replace = os.replace
    monkeypatch.setattr(safe_io.os, "replace", lambda a, b: moved.append(Path(b).name) or real_replace(a, b))
    with safe_io.staging_folder(out, prefix=".ckpt.", last=("state.json",)) as first, \
            safe_io.staging_folder(out, prefix=".ckpt.") as second:
        assert first != second and first.parent == second.parent == out and first.name.startswith(".ckpt.")
        for name in ("state.json", "b.bin", "a.bin"):
            (first / name).write_text(name)
    assert moved == ["a.bin", "b.bin", "state.json"]
    assert sorted(p.name for p in out.iterdir()) == ["a.bin", "b.bin", "state.json"]
    assert (out / "state.json").read_text() == "state.json"


# ----------------------------------------------------------------------------------------------------
# Boxes and strict JSON
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text,phrase", [
    ('{"a.jpg": [[0, 0, NaN, 10]]}', "NaN is not a number JSON allows"),
    ('{"a.jpg": [[0, 0, Infinity, 10]]}', "Infinity is not a number JSON allows"),
    ('{"a.jpg": [[0, 0, 0, 10]]}', "the width and height above 0"),
    ('{"a.jpg": [[0, 0, 10, -5]]}', "the width and height above 0"),
    ('{"a.jpg": [[0, 1e999, 10, 5]]}', "must be finite numbers"),
    ('{"a.jpg": [[0, 0, 10]]}', "must map to a list of [x, y, w, h] boxes"),
    ('{"a.jpg": [[0, true, 10, 4]]}', "must map to a list of [x, y, w, h] boxes"),
    ("[" * 100_000, "cannot read it as JSON (maximum recursion depth exceeded"),  # a RecursionError, no ValueError
])
def test_bad_boxes_are_refused(text, phrase, tmp_path):
    (tmp_path / "boxes.json").write_text(text)
    with pytest.raises(predict.UsageError) as info:
        read_boxes_file(str(tmp_path / "boxes.json"))
    assert phrase in str(info.value) and "boxes.json" in str(info.value)


def test_boxes_are_clipped_or_dropped():
    boxes = [[-10, -10, 30, 30], [5, 5, 100, 100], [50, 0, 10, 10], [-20, 0, 20, 10], [0, 0, 0.2, 0.2]]
    assert fit_boxes(boxes, 40, 30) == [[0.0, 0.0, 20.0, 20.0], [5.0, 5.0, 35.0, 25.0], None, None,
                                                [0.0, 0.0, 1.0, 1.0]]
    assert fit_boxes([[0, 0, 0, 0]], 1, 1) == [[0.0, 0.0, 1.0, 1.0]]  # a 1x1 image's whole-image box


def test_pose_with_odd_boxes(checkpoints, image, tmp_path, capsys):
    boxes = tmp_path / "boxes.json"
    boxes.write_text(json.dumps({"a.jpg": [[-5, -5, 20, 20], [100, 100, 5, 5]], "nobody.jpg": [[0, 0, 5, 5]]}))
    out = tmp_path / "out"
    code = predict.main(["pose", str(image), "-o", str(out), "--boxes", str(boxes), "--no-flip",
                         *model_args(checkpoints, ["seg", "pose"])])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "1 entries match no input image ('nobody.jpg')" in err
    assert "--boxes [[100, 100, 5, 5]] lie outside the 30x40 image; dropped" in err
    result = strict_json(out / "a.pose.json")
    assert [p["box"] for p in result["people"]] == [[0.0, 0.0, 15.0, 15.0]]
    assert len(strict_json(out / "run.json")["warnings"]) == 2


def test_json_is_strict():
    assert safe_io.json_text({"a": [float("nan"), 1.5, float("inf")], "b": (float("-inf"),)}) == \
        '{"a": [null, 1.5, null], "b": [null]}'


# ----------------------------------------------------------------------------------------------------
# Extreme images: every task works on any image from 1x1, or fails alone
# ----------------------------------------------------------------------------------------------------
ALL = "seg,pose,normal,pointmap,matting,albedo,features"


def test_extreme_image_shapes_work_for_every_task(checkpoints, tmp_path, capsys):
    folder = write_images(tmp_path / "in", {"dot.png": (1, 1), "wide.png": (3, 2000), "tall.png": (2000, 3)})
    out = tmp_path / "out"
    code = predict.main([ALL, str(folder), "-o", str(out), "--no-flip", *model_args(checkpoints)])
    assert code == 0, capsys.readouterr().err
    for name, (h, w) in {"dot": (1, 1), "wide": (3, 2000), "tall": (2000, 3)}.items():
        assert len(outputs_of(out, name)) == 12
        for suffix in (".seg.png", ".alpha.png"):
            assert np.array(Image.open(out / f"{name}{suffix}")).shape == (h, w)
        for suffix in (".normal.npy", ".pointmap.npy"):
            array = np.load(out / f"{name}{suffix}")
            assert array.shape == (h, w, 3) and np.isfinite(array).all()
        pose = strict_json(out / f"{name}.pose.json")
        assert pose["people"] and all(None not in point for person in pose["people"] for point in person["keypoints"])


def test_a_failing_task_fails_alone(checkpoints, tmp_path, monkeypatch, capsys):
    folder = write_images(tmp_path / "in", {"a.jpg": (20, 16), "b.jpg": (16, 20)})
    real = inference.run_normal

    def normal_fails_on_a(ctx, images, prepared=None):  # prepared: inputs made ahead (pipelined)
        if any(image.shape[-2:] == (20, 16) for image in images):
            raise RuntimeError("simulated kernel failure")
        return real(ctx, images, prepared)

    monkeypatch.setitem(inference.DENSE_RUNNERS, "normal", normal_fails_on_a)
    out = tmp_path / "out"
    assert predict.main(["seg,normal", str(folder), "-o", str(out), "--batch-size", "2",
                         *model_args(checkpoints, ["seg", "normal"])]) == 1
    assert outputs_of(out, "a") == {"a.seg.png", "a.seg_overlay.jpg"}
    assert len(outputs_of(out, "b")) == 4  # retried alone after the batch failed: complete
    manifest = strict_json(out / "run.json")
    assert manifest["errors"] == [{"image": str(folder / "a.jpg"), "task": "normal",
                                   "error": "RuntimeError: simulated kernel failure"}]
    assert manifest["counts"]["failed"] == 1 and manifest["counts"]["written"] == 1


# ----------------------------------------------------------------------------------------------------
# Arguments and environment: checked before any model loads, with the allowed range
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("option,value,phrase", [
    ("--size", "250x190", "each side must be a multiple of 16 from 32 to 4096"),
    ("--size", "0x0", "each side must be a multiple of 16 from 32 to 4096"),
    ("--size", "16x16", "each side must be a multiple of 16 from 32 to 4096"),
    ("--size", "10000000x16", "each side must be a multiple of 16 from 32 to 4096"),
    ("--size", "big", "size must be HEIGHTxWIDTH"),
    ("--batch-size", "0", "expected a whole number from 1 to 1024"),
    ("--batch-size", "100000", "expected a whole number from 1 to 1024"),
    ("--batch-size", "-3", "expected a whole number from 1 to 1024"),
])
def test_bad_options_exit_2_before_loading(option, value, phrase, image, capsys, no_model_loads):
    with pytest.raises(SystemExit) as info:
        predict.main(["seg", str(image), option, value])
    (line,) = capsys.readouterr().err.splitlines()  # one line, no usage banner
    assert info.value.code == 2 and line.startswith(f"error: argument {option}: ") and phrase in line


@pytest.mark.parametrize("env,phrase", [
    ({"RANK": "abc", "WORLD_SIZE": "2"}, "RANK='abc': expected a whole number from 0 to 1 (WORLD_SIZE - 1)"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK='2': expected a whole number from 0 to 1 (WORLD_SIZE - 1)"),
    ({"RANK": "-1", "WORLD_SIZE": "2"}, "RANK='-1': expected a whole number from 0 to 1 (WORLD_SIZE - 1)"),
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE='0': expected a whole number from 1 to 65536"),
    ({"WORLD_SIZE": "two"}, "WORLD_SIZE='two': expected a whole number from 1 to 65536"),
    ({"LOCAL_RANK": "x", "WORLD_SIZE": "4", "RANK": "0"},
     "LOCAL_RANK='x': expected a whole number from 0 to 3 (WORLD_SIZE - 1)"),
])
def test_bad_launcher_environment_exits_2_before_loading(env, phrase, image, tmp_path, monkeypatch, capsys,
                                                          no_model_loads):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert predict.main(["seg", str(image), "-o", str(tmp_path / "out")]) == 2
    assert error_lines(capsys.readouterr().err) == [f"error: environment variable {phrase}"]
    assert not (tmp_path / "out").exists()


def test_a_size_the_pointmap_scale_branch_takes_is_accepted(checkpoints, image, tmp_path):
    """The scale branch takes a range of sizes (heads.scale_branch_problem, the one statement of the rule), not only
    the one the model was built at: another size in that range runs (it was refused)."""
    model = weights.load(checkpoints["pointmap"])
    built, m = model.backbone.config.image_size, model.backbone.config.size_multiple
    fits = [(h * m, w * m) for heights, widths in heads.scale_branch_fits(model.head_config, limit=None)
            for h in heights for w in widths]
    other = next(size for size in fits if size != tuple(built) and min(size) >= 32)
    assert predict.main(["pointmap", str(image), "-o", str(tmp_path), "--size", f"{other[0]}x{other[1]}",
                         *model_args(checkpoints, ["pointmap"])]) == 0
    assert strict_json(tmp_path / "run.json")["settings"]["size"] == list(other)


def test_size_the_pointmap_model_cannot_take_is_refused_before_any_image(checkpoints, image, tmp_path, capsys):
    assert predict.main(["pointmap", str(image), "-o", str(tmp_path), "--size", "64x48",
                         *model_args(checkpoints, ["pointmap"])]) == 2
    (line,) = error_lines(capsys.readouterr().err)
    assert "--size 64x48: a 64x48 input does not fit the pointmap scale branch" in line


# ----------------------------------------------------------------------------------------------------
# Never unpickle, never eval, never a shell
# ----------------------------------------------------------------------------------------------------
FORBIDDEN = {  # built from pieces so this file does not match itself
    "torch" + ".load(": r"\btorch\.load\s*\(",
    "pickle": r"\bimport\s+c?pickle\b|\bfrom\s+c?pickle\s+import\b|\bc?pickle\.(loads?|Unpickler)\b|\bdill\b",
    "allow_pickle=True": r"allow_pickle\s*=\s*True",
    "eval(": r"(?<![\w.])eval\s*\(",
    "exec(": r"(?<![\w.])exec\s*\(",
    "shell=True": r"shell\s*=\s*True",
    "os.system": r"\bos\.(system|popen)\s*\(",
}


def test_no_unpickling_eval_exec_or_shell_anywhere():
    files = [p for p in ROOT.rglob("*.py") if not any(part.startswith(".") for part in p.relative_to(ROOT).parts)
             and p != Path(__file__).resolve()]  # this file holds the patterns themselves
    assert len(files) > 10
    found = [f"{p.relative_to(ROOT)}:{n}: {what}" for p in files for n, line in enumerate(p.read_text().splitlines(), 1)
             for what, pattern in FORBIDDEN.items() if re.search(pattern, line)]
    assert found == []


def test_the_scan_would_catch_them():
    bad = ["x = torch" + ".load(path)", "import " + "pickle", "ev" + "al(code)", "ex" + "ec(code)",
           "subprocess.run(cmd, shell" + "=True)", "np.load(f, allow_pickle" + "=True)"]
    assert all(any(re.search(p, line) for p in FORBIDDEN.values()) for line in bad)
    assert not any(re.search(p, "model.eval()") for p in FORBIDDEN.values())


# ----------------------------------------------------------------------------------------------------
# The whole story: 200 images, a corrupt file, an unwritable subfolder, the disk filling up mid-run
# ----------------------------------------------------------------------------------------------------
def test_200_images_with_faults_then_resume(checkpoints, tmp_path, monkeypatch, capsys):
    sizes = {f"a/{i:03d}.jpg": (12 + i % 5, 10 + i % 3) for i in range(100)}
    sizes.update({f"m_ro/{i:03d}.jpg": (12, 10) for i in range(10)})
    sizes.update({f"z/{i:03d}.jpg": (10 + i % 4, 12) for i in range(89)})
    folder = write_images(tmp_path / "in", sizes)
    (folder / "corrupt.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    out, seg = tmp_path / "out", model_args(checkpoints, ["seg"])
    args = ["seg", str(folder), "-o", str(out), "--batch-size", "4", *seg]
    written = []

    def faults(file):
        if (out / "m_ro") in file.parents:
            return errno.EACCES  # a read-only subfolder target
        if file.parent == out and file.name.startswith((".run.", ".sapiens2-write-test")):
            return None  # the manifest and the probe are small enough to fit
        if len(written) >= 260:
            return errno.ENOSPC  # the disk is full after 130 images' two files
        written.append(file)
        return None

    faulty_writer(monkeypatch, faults)
    assert predict.main(args) == 1
    manifest = strict_json(out / "run.json")
    assert manifest["status"] == "stopped" and "No space left on device (ENOSPC)" in manifest["stop_reason"]
    assert manifest["counts"] == {"images": 200, "written": 130, "failed": 12, "skipped_existing": 0,
                                  "not_attempted": 58}
    errors = {str(Path(e["image"]).relative_to(folder)): e["error"] for e in manifest["errors"]}
    assert "truncated or corrupt image" in errors.pop("corrupt.jpg") and "ENOSPC" in errors.pop("z/030.jpg")
    assert sorted(errors) == [f"m_ro/{i:03d}.jpg" for i in range(10)]
    assert all("Permission denied (EACCES)" in why for why in errors.values())
    assert sum("skipped: its output folder is not writable" in why for why in errors.values()) == 9
    assert manifest["not_attempted"] == [str(folder / f"z/{i:03d}.jpg") for i in range(31, 89)]
    done = {f"a/{i:03d}" for i in range(100)} | {f"z/{i:03d}" for i in range(30)}
    on_disk = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file() and p.name != "run.json"}
    assert on_disk == {name + suffix for name in done for suffix in (".seg.png", ".seg_overlay.jpg")}
    for name in ("a/000", "a/099", "z/029"):  # complete and right: the seg map has the image's size
        assert Image.open(out / f"{name}.seg.png").size[::-1] == sizes[name + ".jpg"]

    monkeypatch.undo()  # space freed, permissions fixed: the same command with --skip-existing finishes
    assert predict.main([*args, "--skip-existing"]) == 1  # the corrupt file still fails
    manifest = strict_json(out / "run.json")
    assert manifest["status"] == "finished" and manifest["counts"] == {
        "images": 200, "written": 69, "failed": 1, "skipped_existing": 130, "not_attempted": 0}
    assert len(list(out.rglob("*.seg.png"))) == 199 and no_partials(tmp_path)


def test_a_file_that_cannot_be_replaced_fails_its_image_only(checkpoints, tmp_path, monkeypatch):
    """EPERM on one file (say an immutable old output) while its folder takes new files: only that image fails."""
    folder = write_images(tmp_path / "in", {"a.jpg": (20, 16), "b.jpg": (20, 16), "c.jpg": (20, 16)})
    out = tmp_path / "out"
    faulty_writer(monkeypatch, lambda file: errno.EPERM if file.name.startswith(".b.seg.png") else None)
    assert predict.main(["seg", str(folder), "-o", str(out), *model_args(checkpoints, ["seg"])]) == 1
    manifest = strict_json(out / "run.json")
    assert manifest["status"] == "finished" and [Path(e["image"]).name for e in manifest["errors"]] == ["b.jpg"]
    assert len(outputs_of(out, "a")) == 2 and len(outputs_of(out, "c")) == 2 and not outputs_of(out, "b")


def test_skip_existing_removes_temporaries_of_killed_runs(checkpoints, image, tmp_path, capsys):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()  # a pid that has exited
    out = tmp_path / "out"
    (out / "sub").mkdir(parents=True)
    old = time.time() - 3600
    stale = [out / f".a.seg.png.{dead}.0123abcd.partial", out / "sub" / f".b.normal.npy.{dead}.89abcdef.partial"]
    kept = [out / f".a.seg.png.{os.getpid()}.0123abcd.partial",  # a live writer
            out / f".a.depth.png.{dead}.00000000.partial",  # too recent: maybe another machine's, still writing
            out / "notes.partial"]  # not one of ours
    for path in stale + kept:
        path.write_bytes(b"half")
        if path != kept[1]:
            os.utime(path, (old, old))
    assert predict.main(["seg", str(image), "-o", str(out), "--skip-existing", *model_args(checkpoints, ["seg"])]) == 0
    assert "removed 2 temporary files" in capsys.readouterr().err
    assert not any(p.exists() for p in stale) and all(p.exists() for p in kept)


def test_bad_device_exits_2_before_loading(image, tmp_path, capsys, no_model_loads):
    assert predict.main(["seg", str(image), "-o", str(tmp_path), "--device", "gpu7"]) == 2
    assert "--device 'gpu7': expected cpu, cuda or cuda:N" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert predict.main(["seg", str(image), "-o", str(tmp_path), "--device", "cuda"]) == 2
        assert "no CUDA GPU is visible; use --device cpu" in capsys.readouterr().err


def test_sigterm_finalises_the_manifest(checkpoints, tmp_path):
    """torchrun stops the other ranks with SIGTERM when one exits non-zero (a stopped run), schedulers do before
    SIGKILL: handled like Ctrl-C, the manifest says interrupted and lists what was not attempted."""
    folder = write_images(tmp_path / "in", {f"{i:03d}.png": (12, 10) for i in range(400)})
    out = tmp_path / "out"
    process = subprocess.Popen([sys.executable, str(ROOT / "predict.py"), "seg", str(folder), "-o", str(out),
                                "--model", str(checkpoints["seg"])], stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.time() + 120
    while not (out / "005.seg_overlay.jpg").exists() and process.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 143, err
    assert "terminated: the outputs written so far are complete" in err and "Traceback" not in err
    manifest = strict_json(out / "run.json")
    counts = manifest["counts"]
    assert manifest["status"] == "interrupted" and counts["not_attempted"] > 0
    assert counts["written"] + counts["failed"] + counts["not_attempted"] == 400 and counts["failed"] == 0
    assert len(list(out.glob("*.seg.png"))) == counts["written"] and no_partials(tmp_path)


def test_a_broken_cached_hub_index_names_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("SAPIENS2_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    index = tmp_path / "facebook--sapiens2-x" / "main" / "model.safetensors.index.json"
    index.parent.mkdir(parents=True)
    index.write_text('{"weight_map": ')
    with pytest.raises(weights.CheckpointError, match=re.escape(f"{index}: not valid JSON")):
        weights.load("facebook/sapiens2-x")
    index.write_text('{"metadata": {}}')
    with pytest.raises(weights.CheckpointError, match=re.escape(f'{index}: no "weight_map" object')):
        weights.load("facebook/sapiens2-x")


def test_processing_keeps_one_pixel_sides():
    assert processing.resized_content_box((3, 2000), (1024, 768)) == (511, 0, 512, 768)  # was a 0-pixel height
    assert processing.resized_content_box((2000, 3), (1024, 768)) == (0, 383, 1024, 384)
    dot = torch.tensor([10, 20, 30], dtype=torch.uint8).reshape(3, 1, 1)
    crop = processing.crop_people(dot, [[0.0, 0.0, 1.0, 1.0]], (64, 48))  # was NaN (a division by W - 1 = 0)
    assert crop.shape == (1, 3, 64, 48) and torch.equal(crop[0, :, 5, 7], torch.tensor([10.0, 20.0, 30.0]))


def test_a_failed_segmentation_fails_what_needs_it_only(checkpoints, tmp_path, monkeypatch, capsys):
    """--mask-with-seg tasks of that image fail (saying why); pose falls back to the whole image; b is whole."""
    folder = write_images(tmp_path / "in", {"a.jpg": (20, 16), "b.jpg": (16, 20)})
    real = inference.run_seg

    def seg_fails_on_a(ctx, images, prepared=None):  # prepared: inputs made ahead (pipelined)
        if any(image.shape[-2:] == (20, 16) for image in images):
            raise RuntimeError("simulated seg failure")
        return real(ctx, images, prepared)

    monkeypatch.setattr(inference, "run_seg", seg_fails_on_a)
    out = tmp_path / "out"
    assert predict.main(["pose,normal", str(folder), "-o", str(out), "--mask-with-seg", "--no-flip", "--batch-size",
                         "2", *model_args(checkpoints, ["seg", "pose", "normal"])]) == 1
    manifest = strict_json(out / "run.json")
    assert manifest["errors"] == [{"image": str(folder / "a.jpg"), "task": "normal", "error":
                                   "RuntimeError: --mask-with-seg: the segmentation failed (simulated seg failure)"}]
    assert outputs_of(out, "a") == {"a.pose.json", "a.pose_overlay.jpg"}
    assert strict_json(out / "a.pose.json")["box_source"] == "whole-image"
    assert len(outputs_of(out, "b")) == 4


def test_a_name_near_the_length_limit_still_gets_a_temporary(tmp_path):
    target = tmp_path / ("é" * 120 + ".seg.png")  # 248 bytes: the output fits, a longer temporary would not
    safe_io.atomic_write(target, b"ok")
    assert target.read_bytes() == b"ok" and no_partials(tmp_path)


def test_outputs_get_the_usual_file_mode(tmp_path):
    tensors = ({"x": torch.zeros(2)}, {"image": "a.jpg"})
    safe_io.atomic_write(tmp_path / "a.features.safetensors", tensors)  # safetensors alone writes 0600
    safe_io.atomic_write(tmp_path / "a.pose.json", {"a": 1})
    modes = {p.name: p.stat().st_mode & 0o777 for p in tmp_path.iterdir()}
    assert modes == {"a.features.safetensors": weights.new_file_mode(), "a.pose.json": weights.new_file_mode()}
