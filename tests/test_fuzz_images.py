"""Crafted photos (issue 35, class 4): NaN or infinite pixels are refused with the file named (NaN defeated the
[0, 1] range check, and a seg run on one reported success with every pixel class 0); float photos in [0, 1] work
(they were scaled to 0..255 by load_image, then refused by preprocess); a photo whose header declares more than the
pixel budget is refused before it is decoded (a few hundred bytes could declare 130 MP and take 3 GB). Then a seeded
mutation loop over one tiny file of each format (tests/fixtures/fuzz/images)."""

import io
import struct
import time
import warnings
import zlib

import numpy as np
import pytest
import torch
from PIL import Image

import predict
from fuzz_support import SEED_CORPUS, fuzz_loop, mutate
from sapiens2 import processing, weights
from test_predict import tiny_model

SEEDS = sorted((SEED_CORPUS / "images").iterdir())
NASTY_PIXELS = [np.nan, np.inf, -np.inf, 1e38, -1e38, -1e-30, 1.0000001, 255.0, 0.0, 1.0]


def float_tiff(path, values) -> str:
    Image.fromarray(np.asarray(values, np.float32)).save(path)  # mode F: what a float TIFF decodes to
    return path


def png_declaring(path, width: int, height: int):
    """A 60-byte PNG whose header declares width x height RGB pixels (its data is a few bytes of nothing)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 4))
                     + chunk(b"IEND", b""))
    return path


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_pixels_are_refused_naming_the_file(tmp_path, bad):
    values = np.full((12, 16), 0.5)
    values[3, 4] = bad  # one pixel
    path = float_tiff(tmp_path / "one-bad-pixel.tif", values)
    with pytest.raises(processing.ImageLoadError, match=rf"{path}: .*NaN or infinite values"):
        processing.load_image(path)
    with pytest.raises(ValueError, match="NaN or infinite values"):  # arrays and tensors too
        processing.load_image(torch.from_numpy(values).float())


@pytest.mark.parametrize("huge", [1e38, -1e38])
def test_float_pixels_outside_0_1_are_refused(tmp_path, huge):
    path = float_tiff(tmp_path / "huge.tif", np.full((12, 16), huge))
    with pytest.raises(processing.ImageLoadError, match=rf"{path}: .*float images must be in \[0, 1\]"):
        processing.load_image(path)


def test_float_photo_in_range_loads_as_8_bits_and_preprocesses(tmp_path):
    values = np.linspace(0, 1, 12 * 16).reshape(12, 16)
    image = processing.load_image(float_tiff(tmp_path / "float.tif", values))
    assert image.dtype == torch.uint8 and image.shape == (3, 12, 16)
    # float_to_uint8's rule (x * 255.999, truncated): exact, since both sides compute it from the same float32
    expected = torch.from_numpy((values.astype(np.float32) * np.float32(255.999)).astype(np.uint8))
    assert torch.equal(image[0], expected) and torch.equal(image[2], expected)
    inputs = processing.preprocess([image], size=(64, 48))  # refused before: "float images must be in [0, 1]"
    assert inputs.pixel_values.shape == (1, 3, 64, 48) and bool(torch.isfinite(inputs.pixel_values).all())


def tiff_declaring(path, width: int, height: int):
    """A 1x1 RGB TIFF of ~140 bytes whose ImageWidth and ImageLength tags say width x height."""
    buffer = io.BytesIO()
    Image.new("RGB", (1, 1)).save(buffer, format="TIFF")
    data = bytearray(buffer.getvalue())
    ifd = struct.unpack("<I", data[4:8])[0]
    for entry in range(ifd + 2, ifd + 2 + 12 * struct.unpack("<H", data[ifd : ifd + 2])[0], 12):
        tag, kind = struct.unpack("<HH", data[entry : entry + 4])
        if tag in (256, 257):  # (SHORT or LONG values)
            value = width if tag == 256 else height
            data[entry + 8 : entry + 12] = struct.pack("<HH", value, 0) if kind == 3 else struct.pack("<I", value)
    path.write_bytes(bytes(data))
    return path


@pytest.mark.parametrize("write", [png_declaring, tiff_declaring])
def test_a_header_over_the_pixel_budget_is_refused_before_decoding(tmp_path, write):
    path = write(tmp_path / f"bomb.{write.__name__[:3]}", 7100, 7100)  # 50.4 MP in ~100 bytes
    start = time.process_time()  # (CPU time: the work done, whatever else runs)
    with pytest.raises(processing.ImageLoadError, match=rf"{path}: declares 7100x7100 pixels \(50.4 megapixels\), "
                                                        r"over the budget of 40 megapixels"):
        processing.load_image(path, max_pixels=processing.PIXEL_BUDGET)
    assert time.process_time() - start < 1.0  # the header only (decoding it would take seconds and 150 MB)
    processing.check_image_file(path, max_pixels=60_000_000)  # within a raised budget the header passes


def test_predict_refuses_a_photo_over_its_pixel_budget_before_loading_a_model(tmp_path, capsys, monkeypatch):
    path = png_declaring(tmp_path / "bomb.png", 7100, 7100)
    monkeypatch.setattr(weights, "load", lambda *a, **k: pytest.fail("a model was loaded"))
    assert predict.main(["seg", str(path), "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "over the budget of 40 megapixels" in err and "Traceback" not in err
    with pytest.raises(SystemExit) as exit:  # (argparse's own exit for a bad option value)
        predict.main(["seg", str(path), "-o", str(tmp_path / "out"), "--max-megapixels", "nan"])
    assert exit.value.code == 2
    assert "--max-megapixels: 'nan': expected megapixels, a number above 0" in capsys.readouterr().err


@pytest.fixture(scope="module")
def seg_checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    return weights.save(tiny_model("seg"), tmp_path_factory.mktemp("seg") / "seg.safetensors")


def test_predict_fails_the_nan_photo_and_runs_the_float_one(seg_checkpoint, tmp_path, capsys):
    """The NaN photo was '1 images written, 0 failed' with an all-zero segmentation."""
    photos = tmp_path / "photos"
    photos.mkdir()
    values = np.full((48, 64), 0.5)
    float_tiff(photos / "good.tif", values)
    values[10, 10] = np.nan
    float_tiff(photos / "nan.tif", values)
    code = predict.main(["seg", str(photos), "-o", str(tmp_path / "out"), "--model", f"seg={seg_checkpoint}",
                         "--size", "64x48", "--workers", "0"])
    err = capsys.readouterr().err
    assert code == 1, err
    assert "nan.tif" in err and "NaN or infinite values" in err
    assert (tmp_path / "out" / "good.seg.png").exists() and not (tmp_path / "out" / "nan.seg.png").exists()


# ----------------------------------------------------------------------------------------------------
# The mutation loop: byte edits of one tiny file of each format
# ----------------------------------------------------------------------------------------------------


def test_mutated_photos_load_as_8_bit_rgb_or_are_refused_naming_the_file(tmp_path):
    """Every mutated file loads as a (3, H, W) uint8 image within the pixel budget, or is refused with an
    ImageLoadError naming it; nothing else escapes, and no file takes long."""
    seeds = {path.name: path.read_bytes() for path in SEEDS}

    def one(rng):
        name = rng.choice(sorted(seeds))
        path = tmp_path / f"mutated-{name}"
        if rng.random() < 0.2:  # valid files with nasty pixel values (byte edits rarely leave a TIFF readable)
            name, path = "float.tif pixels", tmp_path / "mutated-pixels.tif"
            values = np.array(Image.open(SEED_CORPUS / "images" / "float.tif"))
            values[rng.randrange(12), rng.randrange(16)] = rng.choice(NASTY_PIXELS)
            float_tiff(path, values)
        else:
            path.write_bytes(mutate(rng, seeds[name]))
        start = time.process_time()  # (CPU time: a long run shares the machine)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # Pillow warns about odd files it still reads
                image = processing.load_image(path, max_pixels=processing.PIXEL_BUDGET)
        except processing.ImageLoadError as error:
            assert str(path) in str(error), name
            outcome = f"refused {name}", str(error)[len(str(path)):][:80]
        else:
            assert image.dtype == torch.uint8 and image.ndim == 3 and image.shape[0] == 3, (name, image.dtype)
            assert image.shape[1] * image.shape[2] <= processing.PIXEL_BUDGET
            outcome = f"loaded {name}", None
        assert time.process_time() - start < 2.0, (name, path.read_bytes())
        return outcome

    tally = fuzz_loop("images", one, count=400)
    assert not tally.failures, tally.failures[:3]
    assert tally.total() >= 50 and any(k.startswith("loaded") for k in tally.counts), tally.counts
