"""predict.py end to end on tiny random checkpoints: every task's files exist, have the documented shapes and
equal what the Python API gives; bad inputs are reported and skipped; two ranks split the work exactly."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file

from sapiens2 import heads, hub
import predict
from sapiens2 import Sapiens2, Sapiens2Config, processing, weights
from sapiens2_app.detector import detector
from sapiens2_app.predict import boxes, inference, inputs, outputs
from sapiens2_app.predict.models import LoadedModel

ROOT = Path(__file__).resolve().parents[1]
ALL_TASKS = "seg,pose,normal,pointmap,matting,albedo,features"
SIZES = {"a.jpg": (80, 60), "sub/b.png": (50, 70), "sub/deeper/c.jpg": (64, 64)}  # (H, W)


def tiny_config(image_size=(64, 48)):
    return Sapiens2Config(32, 3, 2, full_attention_first=1, full_attention_last=1, image_size=image_size)


def tiny_model(task):
    if task == "features":
        return Sapiens2(tiny_config())
    # the pointmap scale branch needs a grid that survives three stride-2 convs with >1 pixel left
    config = tiny_config((256, 192) if task == "pointmap" else (64, 48))
    extra = dict(scale_conv_channels=(8, 8, 4), scale_hidden=(8, 4)) if task == "pointmap" else {}
    upsample = (16, 8) if task == "pose" else (16, 8, 8, 8)
    head = heads.HeadConfig(task, upsample, (8, 4), heads.OUT_CHANNELS[task], **extra)
    model = heads.build_task_model(config, head)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))  # so outputs are not near-constant
        if task == "seg":  # background vs one body part (~1/3 of the pixels): masks and person blobs to find
            model.decode_head.predictor.bias[2:] = -100.0
            model.decode_head.predictor.bias[1] -= 0.75
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("checkpoints")
    torch.manual_seed(0)
    paths = {}
    for task in predict.TASKS:
        paths[task] = weights.save(tiny_model(task), folder / f"{task}.safetensors")
    return paths


def write_images(folder: Path, sizes=SIZES) -> Path:
    rng = np.random.default_rng(0)
    for name, (h, w) in sizes.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        pixels = np.zeros((h, w, 3), np.uint8) + np.array([40, 90, 160], np.uint8)
        pixels[h // 4 : 3 * h // 4, w // 3 : 2 * w // 3] = rng.integers(0, 255, 3, np.uint8)  # a "person"
        Image.fromarray(pixels).save(folder / name)
    return folder


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    return write_images(tmp_path_factory.mktemp("images"))


def model_args(checkpoints, tasks=predict.TASKS):
    return [arg for task in tasks for arg in ("--model", f"{task}={checkpoints[task]}")]


def run_cli(*args, expect=0, capsys=None):
    code = predict.main([str(a) for a in args])
    assert code == expect, capsys.readouterr().err if capsys else code
    return code


@pytest.fixture(scope="module")
def all_tasks_run(checkpoints, images, tmp_path_factory):
    """One run of every task on the three images (boxes for a.jpg from a file, the others from seg)."""
    out = tmp_path_factory.mktemp("out")
    boxes = tmp_path_factory.mktemp("boxes") / "boxes.json"
    boxes.write_text(json.dumps({"a.jpg": [[5, 10, 40, 60], [0, 0, 20, 20]]}))
    assert predict.main([ALL_TASKS, str(images), "-o", str(out), "--boxes", str(boxes),
                         *model_args(checkpoints)]) == 0
    return out


# ----------------------------------------------------------------------------------------------------
# What the Python API gives (the README snippets), to compare the files against
# ----------------------------------------------------------------------------------------------------
def api(task, checkpoint, path, boxes=None, resample="original", rope_dtype="bfloat16"):
    """resample/rope_dtype: predict.py's default --conventions original (transformers: \"hf\", \"float32\")."""
    model = weights.load(checkpoint, task=None if task == "features" else task, rope_dtype=rope_dtype)
    size = tuple(model.config.image_size)
    image = processing.load_image(path)
    with torch.no_grad():
        if task == "seg":
            inputs = processing.preprocess([image], size, resample=resample)
            return processing.postprocess_segmentation(model(inputs.pixel_values).logits, inputs)[0]
        if task == "normal":
            inputs = processing.preprocess([image], size, pad=True, resample=resample)
            return processing.postprocess_normals(model(inputs.pixel_values).normals, inputs)[0]
        if task == "pointmap":
            inputs = processing.preprocess([image], size, pad=True, resample=resample)
            out = model(inputs.pixel_values)
            return processing.postprocess_pointmap(out.pointmaps, out.scales, inputs, smooth=True)[0]["pointmap"]
        if task == "albedo":
            inputs = processing.preprocess([image], size, pad=True, resample=resample)
            return processing.postprocess_albedo(model(inputs.pixel_values).albedo, inputs)[0]
        if task == "matting":
            inputs = processing.preprocess([image], size, resample=resample)
            out = model(inputs.pixel_values)
            return processing.postprocess_matting(out.foregrounds, out.alphas, target_sizes=inputs.image_sizes,
                                                  background=(255, 255, 255))[0]
        if task == "features":
            return model(processing.preprocess([image], size, resample=resample).pixel_values)
        if task == "pose":
            inputs = processing.preprocess_crops([image], [boxes], size, resample=resample)
            # one person per forward, as the CLI with its CPU batch size of 1: on random heatmaps the DARK
            # Newton step amplifies the last-bit differences that another batch size gives
            heatmaps = torch.cat([model.flip_test(crop[None]) for crop in inputs.pixel_values])
            return processing.postprocess_pose(heatmaps, inputs)[0]
    raise ValueError(task)


def read_png(path):
    return np.array(Image.open(path))


@pytest.mark.parametrize("name", list(SIZES))
def test_dense_outputs_have_documented_shapes_and_match_the_api(all_tasks_run, checkpoints, images, name):
    out, stem, (h, w) = all_tasks_run, name.rsplit(".", 1)[0], SIZES[name]
    path = images / name
    seg = read_png(out / f"{stem}.seg.png")
    assert seg.shape == (h, w) and seg.dtype == np.uint8 and seg.max() < 29
    assert np.array_equal(seg, api("seg", checkpoints["seg"], path).numpy())
    normals = np.load(out / f"{stem}.normal.npy")
    assert normals.shape == (h, w, 3) and normals.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(normals, axis=-1), 1, atol=1e-5)
    expected = api("normal", checkpoints["normal"], path).permute(1, 2, 0).numpy()
    np.testing.assert_allclose(normals, expected, atol=1e-5)
    pointmap = np.load(out / f"{stem}.pointmap.npy")
    assert pointmap.shape == (h, w, 3) and pointmap.dtype == np.float32
    np.testing.assert_allclose(pointmap, api("pointmap", checkpoints["pointmap"], path).permute(1, 2, 0).numpy(),
                               rtol=1e-4, atol=1e-5)
    albedo = read_png(out / f"{stem}.albedo.png")
    expected = processing.albedo_to_uint8(api("albedo", checkpoints["albedo"], path)).permute(1, 2, 0).numpy()
    assert albedo.shape == (h, w, 3) and np.abs(albedo.astype(int) - expected).max() <= 1
    alpha, matte = read_png(out / f"{stem}.alpha.png"), api("matting", checkpoints["matting"], path)
    assert alpha.shape == (h, w) and alpha.dtype == np.uint8
    assert np.abs(alpha.astype(int) - processing.float_to_uint8(matte["alpha"][0]).numpy()).max() <= 1
    features = load_file(out / f"{stem}.features.safetensors")
    expected = api("features", checkpoints["features"], path)
    assert features["cls"].shape == (32,) and features["features"].shape == (32, 4, 3)
    torch.testing.assert_close(features["features"], expected.features[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(features["cls"], expected.cls[0], rtol=1e-4, atol=1e-5)
    for picture, mode in ((".seg_overlay.jpg", "RGB"), (".normal.png", "RGB"), (".depth.png", "RGB"),
                          (".composite.jpg", "RGB"), (".pose_overlay.jpg", "RGB")):
        with Image.open(out / f"{stem}{picture}") as im:
            assert im.size == (w, h) and im.mode == mode, picture


def test_pose_json_with_given_boxes_matches_the_api(all_tasks_run, checkpoints, images):
    result = json.loads((all_tasks_run / "a.pose.json").read_text())
    assert (result["image"], result["width"], result["height"]) == ("a.jpg", 60, 80)
    assert result["box_source"] == "boxes-file" and len(result["keypoint_names"]) == 308
    boxes = [[5, 10, 40, 60], [0, 0, 20, 20]]
    expected = api("pose", checkpoints["pose"], images / "a.jpg", boxes)
    assert len(result["people"]) == 2
    for person, box, want in zip(result["people"], boxes, expected):
        x, y, bw, bh = box
        assert person["box"] == [x, y, x + bw, y + bh]
        keypoints = np.array(person["keypoints"])
        assert keypoints.shape == (308, 3)
        np.testing.assert_allclose(keypoints[:, :2], want["keypoints"].numpy(), atol=0.01)  # JSON rounds to 0.01 px
        np.testing.assert_allclose(keypoints[:, 2], want["scores"].numpy(), atol=1e-4)


def test_pose_boxes_come_from_segmentation(all_tasks_run, checkpoints, images):
    """Without a --boxes entry: the seg foreground's blobs (each box inside the image), or the whole image."""
    for stem in ("sub/b", "sub/deeper/c"):
        result = json.loads((all_tasks_run / f"{stem}.pose.json").read_text())
        assert result["box_source"] == "segmentation"
        seg = read_png(all_tasks_run / f"{stem}.seg.png")
        expected = boxes.person_boxes(torch.from_numpy(seg).long())
        assert [p["box"] for p in result["people"]] == [[x, y, x + w, y + h] for x, y, w, h in expected]


def test_run_manifest(all_tasks_run):
    manifest = json.loads((all_tasks_run / "run.json").read_text())
    assert manifest["status"] == "finished" and manifest["counts"] == {
        "images": 3, "written": 3, "failed": 0, "skipped_existing": 0, "not_attempted": 0}
    assert set(manifest["models"]) == set(predict.TASKS) and manifest["settings"]["flip_test"] is True
    assert manifest["versions"]["torch"] == torch.__version__ and manifest["timings_s"]["total"] > 0
    assert not any(m["random_weights"] for m in manifest["models"].values())


# ----------------------------------------------------------------------------------------------------
# Options
# ----------------------------------------------------------------------------------------------------
def test_mask_with_seg_and_save_kinds(checkpoints, images, tmp_path, capsys):
    run_cli("normal,pointmap", images / "a.jpg", "-o", tmp_path, "--mask-with-seg", "--save", "raw",
            *model_args(checkpoints, ["seg", "normal", "pointmap"]), capsys=capsys)
    background = api("seg", checkpoints["seg"], images / "a.jpg").numpy() == 0
    assert background.any() and not background.all()
    for kind in ("normal", "pointmap"):
        array = np.load(tmp_path / f"a.{kind}.npy")
        assert np.array_equal(np.isnan(array).all(-1), background)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.normal.npy", "a.pointmap.npy", "run.json"]


def test_skip_existing_resumes(checkpoints, images, tmp_path, capsys):
    args = ["seg", images, "-o", tmp_path, *model_args(checkpoints, ["seg"])]
    run_cli(*args, capsys=capsys)
    (tmp_path / "sub" / "b.seg_overlay.jpg").unlink()
    before = (tmp_path / "a.seg.png").stat().st_mtime_ns
    run_cli(*args, "--skip-existing", capsys=capsys)
    counts = json.loads((tmp_path / "run.json").read_text())["counts"]
    assert counts == {"images": 3, "written": 1, "failed": 0, "skipped_existing": 2, "not_attempted": 0}
    assert (tmp_path / "sub" / "b.seg_overlay.jpg").exists() and (tmp_path / "a.seg.png").stat().st_mtime_ns == before


def test_no_flip_and_dtype(checkpoints, images, tmp_path, capsys):
    run_cli("pose", images / "a.jpg", "-o", tmp_path, "--no-flip", "--dtype", "bf16", "--batch-size", "2",
            *model_args(checkpoints, ["seg", "pose"]), capsys=capsys)
    manifest = json.loads((tmp_path / "run.json").read_text())
    assert manifest["settings"]["flip_test"] is False and manifest["models"]["pose"]["dtype"] == "bfloat16"
    assert len(json.loads((tmp_path / "a.pose.json").read_text())["people"][0]["keypoints"]) == 308


@pytest.mark.parametrize("conventions,resample,rope", [("original", "original", "bfloat16"),
                                                       ("transformers", "hf", "float32")])
def test_conventions(conventions, resample, rope, checkpoints, images, tmp_path, capsys):
    """--conventions original (the default): OpenCV preprocessing + bf16 RoPE, as the weights were trained;
    transformers: HF's preprocessing + fp32 RoPE. Each equals the API with those settings, not the other's."""
    extra = [] if conventions == "original" else ["--conventions", conventions]
    run_cli("normal", images / "a.jpg", "-o", tmp_path, *extra, *model_args(checkpoints, ["normal"]), capsys=capsys)
    settings = json.loads((tmp_path / "run.json").read_text())["settings"]
    assert (settings["conventions"], settings["resample"], settings["rope"]) == (conventions, resample, rope)
    normals = torch.from_numpy(np.load(tmp_path / "a.normal.npy")).permute(2, 0, 1)
    same = api("normal", checkpoints["normal"], images / "a.jpg", resample=resample, rope_dtype=rope)
    other = api("normal", checkpoints["normal"], images / "a.jpg", resample={"hf": "original"}.get(resample, "hf"),
                rope_dtype={"float32": "bfloat16"}.get(rope, "float32"))
    assert (normals - same).abs().max() < 1e-5 < (normals - other).abs().max()


# ----------------------------------------------------------------------------------------------------
# Bad inputs
# ----------------------------------------------------------------------------------------------------
def test_corrupt_images_are_reported_and_skipped(checkpoints, images, tmp_path, capsys):
    folder = tmp_path / "in"
    write_images(folder, {"good1.jpg": (40, 30), "good2.png": (30, 40)})
    (folder / "garbage.jpg").write_bytes(b"this is not a jpeg")
    jpeg = (folder / "good1.jpg").read_bytes()
    (folder / "truncated.jpg").write_bytes(jpeg[: len(jpeg) // 2])
    (folder / "empty.png").write_bytes(b"")
    code = predict.main(["seg", str(folder), "-o", str(tmp_path / "out"), "--batch-size", "2",
                         *model_args(checkpoints, ["seg"])])
    err = capsys.readouterr().err
    assert code == 1
    assert all(name in err for name in ("garbage.jpg", "truncated.jpg", "empty.png"))
    assert sorted(p.name for p in (tmp_path / "out").glob("*.seg.png")) == ["good1.seg.png", "good2.seg.png"]
    manifest = json.loads((tmp_path / "out" / "run.json").read_text())
    assert manifest["counts"]["failed"] == 3 and manifest["counts"]["written"] == 2
    assert sorted(Path(e["image"]).name for e in manifest["errors"]) == ["empty.png", "garbage.jpg", "truncated.jpg"]


def test_empty_folder_and_missing_input(checkpoints, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    seg = model_args(checkpoints, ["seg"])
    assert predict.main(["seg", str(tmp_path / "empty"), "-o", str(tmp_path / "o"), *seg]) == 2
    assert "no images found" in capsys.readouterr().err
    assert predict.main(["seg", str(tmp_path / "nope.jpg"), *seg]) == 2
    assert "nope.jpg: no such file or folder" in capsys.readouterr().err


def test_missing_checkpoint_says_what_to_do(images, tmp_path, capsys, monkeypatch):
    missing = tmp_path / "missing.safetensors"
    assert predict.main(["seg", str(images), "-o", str(tmp_path), "--model", str(missing)]) == 2
    assert "missing.safetensors: no such file" in capsys.readouterr().err
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("SAPIENS2_CACHE", str(tmp_path / "cache"))
    assert predict.main(["normal", str(images), "-o", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "https://huggingface.co/facebook/sapiens2-normal-0.4b" in err and str(tmp_path / "cache") in err
    assert predict.main(["albedo", str(images), "-o", str(tmp_path)]) == 2
    assert "albedo-0.4b: no released checkpoint" in capsys.readouterr().err
    # a mistyped local path never falls back to random weights
    assert predict.main(["seg", str(images), "--random-init", "fallback", "--model", "seg=nope/x.safetensors"]) == 2


def test_random_fallback_runs_the_real_architecture_and_says_so(images, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("SAPIENS2_CACHE", str(tmp_path / "cache"))
    run_cli("seg", images / "a.jpg", "-o", tmp_path, "--random-init", "fallback", "--random-backbone", "0.1b",
            "--size", "64x48", capsys=capsys)
    assert "RANDOM WEIGHTS" in capsys.readouterr().err
    seg = json.loads((tmp_path / "run.json").read_text())["models"]["seg"]
    assert seg["random_weights"] and seg["backbone"]["embed_dim"] == 768
    assert seg["head"]["upsample_channels"] == [512, 256, 128, 64]  # the released seg-0.4b head
    assert read_png(tmp_path / "a.seg.png").shape == (80, 60)


def test_random_init_always_downloads_nothing_and_says_so(images, tmp_path, capsys, monkeypatch):
    """No checkpoint and no person detector is loaded or downloaded; the banner says why the weights are random
    (no "see the message above": there is none) and where the pose boxes came from."""
    def refuse(*args, **kwargs):
        raise AssertionError("--random-init always loaded or downloaded something")

    monkeypatch.setattr(hub, "download", refuse)  # every hub download (checkpoints, detector) goes through it
    monkeypatch.setattr(detector, "load", refuse)
    run_cli("pose", images / "a.jpg", "-o", tmp_path, "--random-init", "always", "--random-backbone", "0.1b",
            "--size", "64x48", "--no-flip", capsys=capsys)
    err = capsys.readouterr().err
    assert "RANDOM WEIGHTS for pose: --random-init always, no checkpoint was loaded or downloaded" in err
    assert "Pose boxes: the whole image (no person detector was loaded)" in err and "message above" not in err
    assert json.loads((tmp_path / "a.pose.json").read_text())["box_source"] == "whole-image"
    manifest = json.loads((tmp_path / "run.json").read_text())
    assert manifest["settings"]["detector"] == "none" and manifest["models"]["pose"]["random_weights"]


def test_random_weight_stamp_is_on_pictures_only(images):
    """RANDOM WEIGHTS is written across the pictures (--save vis alone); files that are raw data (the albedo PNG,
    documented as the raw albedo, among them) are the same as with real weights. run.json marks them random."""
    models = {task: LoadedModel(tiny_model(task).eval(), task) for task in predict.TASKS}
    ctx = inference.Inference(list(predict.TASKS), models, torch.device("cpu"), torch.float32, 1, None, True, False, None)
    item = inputs.InputImage(images / "a.jpg", "a.jpg")
    image = processing.load_image(item.path)
    (result,) = inference.infer(ctx, [item], [image])
    for task, artefacts in predict.ARTEFACTS.items():
        real = outputs.render(task, item, image, result, models[task])
        random = outputs.render(task, item, image, result, LoadedModel(models[task].model, task, random=True))
        for suffix, kinds in artefacts.items():
            plain, marked = real[suffix](), random[suffix]()
            if isinstance(plain, Image.Image):
                stamped = not np.array_equal(np.asarray(plain), np.asarray(marked))
                assert stamped == (kinds == {"vis"}), (suffix, kinds)


def test_features_of_a_random_backbone_say_so(checkpoints, images, tmp_path, capsys, monkeypatch):
    """features.safetensors names what made the tensors: the random 0.1b backbone, not the 0.4b asked for."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("SAPIENS2_CACHE", str(tmp_path / "cache"))
    run_cli("features", images / "a.jpg", "-o", tmp_path / "random", "--random-init", "fallback",
            "--random-backbone", "0.1b", "--size", "64x48", capsys=capsys)
    with safe_open(str(tmp_path / "random" / "a.features.safetensors"), framework="pt") as f:
        metadata, channels = f.metadata(), f.get_tensor("cls").shape[0]
    assert channels == predict.PRESETS["0.1b"].embed_dim
    assert metadata["model"] == "random weights, 0.1b backbone (--random-init, in place of 0.4b)"
    assert metadata["random_weights"] == "true"
    run_cli("features", images / "a.jpg", "-o", tmp_path / "real", *model_args(checkpoints, ["features"]),
            capsys=capsys)
    with safe_open(str(tmp_path / "real" / "a.features.safetensors"), framework="pt") as f:
        metadata = f.metadata()
    assert (metadata["model"], metadata["random_weights"]) == (str(checkpoints["features"]), "false")


def test_usage_errors(checkpoints, images, capsys):
    seg = model_args(checkpoints, ["seg"])
    assert predict.main(["segment", str(images), *seg]) == 2
    assert "unknown task 'segment'" in capsys.readouterr().err
    assert predict.main(["seg", str(images), "--save", "json", *seg]) == 2
    assert "writes nothing" in capsys.readouterr().err
    assert predict.main(["seg", str(images), "--model", "a.safetensors", "--model", "b.safetensors"]) == 2
    assert "TASK=SOURCE" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------------
# Inputs, names, sharding, person boxes
# ----------------------------------------------------------------------------------------------------
def test_input_forms_and_output_names(tmp_path, monkeypatch):
    write_images(tmp_path, {"x/p.jpg": (8, 8), "y/p.jpg": (8, 8), "y/q.png": (8, 8), "y/q.jpg": (8, 8)})
    (tmp_path / "x" / "notes.md").write_text("not an image")
    (tmp_path / "list.txt").write_text("# people\nx/p.jpg\n\ny/q.png\n")
    monkeypatch.chdir(tmp_path)
    names = lambda specs: [i.relative for i in inputs.collect_inputs(specs)]  # noqa: E731
    assert names(["x/p.jpg", "y/p.jpg"]) == ["x/p.jpg", "y/p.jpg"]  # explicit files: below their common folder
    assert names(["y"]) == ["p.jpg", "q.jpg", "q.png"]  # a folder: below it
    assert names(["*/q.*"]) == ["y/q.jpg", "y/q.png"]  # a glob: below its static part
    assert names(["list.txt"]) == ["x/p.jpg", "y/q.png"]
    assert names(["y", "y/p.jpg"]) == ["p.jpg", "q.jpg", "q.png"]  # the same file twice counts once
    items = inputs.collect_inputs(["y"])
    assert sorted(inputs.output_names(items).values()) == ["p", "q.jpg", "q.png"]  # x.jpg + x.png keep suffixes
    with pytest.raises(predict.UsageError, match="same outputs"):
        inputs.collect_inputs(["x", "y"])  # both have p.jpg
    write_images(tmp_path, {"out/p.seg_overlay.jpg": (8, 8), "out/photo.jpg": (8, 8)})  # -o out, inside the input
    found = [i.relative for i in inputs.collect_inputs(["."], exclude=(tmp_path / "out").resolve())]
    assert found == ["out/photo.jpg", "x/p.jpg", "y/p.jpg", "y/q.jpg", "y/q.png"]  # not our own overlay


def test_a_list_file_names_paths_relative_to_its_own_folder(tmp_path, monkeypatch, capsys):
    """`lists/l.txt` saying `photos/a.jpg` means lists/photos/a.jpg, whatever the current folder holds (and
    --help says so)."""
    write_images(tmp_path, {"lists/photos/a.jpg": (8, 8), "cwd/photos/a.jpg": (8, 8), "lists/b.png": (8, 8)})
    (tmp_path / "lists" / "l.txt").write_text("photos/a.jpg\nb.png\n")
    monkeypatch.chdir(tmp_path / "cwd")
    items = inputs.collect_inputs(["../lists/l.txt"])
    assert [item.path.resolve() for item in items] == [tmp_path / "lists" / "b.png", tmp_path / "lists/photos/a.jpg"]
    with pytest.raises(SystemExit):
        predict.main(["--help"])
    assert "relative to the list file's folder" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("count,world", [(0, 2), (5, 2), (7, 3), (2, 4)])
def test_shards_are_disjoint_and_complete(count, world):
    items = list(range(count))
    shards = [inputs.shard(items, rank, world) for rank in range(world)]
    assert sorted(sum(shards, [])) == items and max(map(len, shards)) - min(map(len, shards)) <= 1


def test_two_ranks_split_the_work_exactly(checkpoints, images, tmp_path, capsys):
    """RANK / WORLD_SIZE as torchrun sets them; each rank writes to its own folder here, so we can see who did
    what: disjoint, together the single-process run, same numbers."""
    args = ["seg,normal", str(images), *model_args(checkpoints, ["seg", "normal"])]
    run_cli(*args, "-o", tmp_path / "single", capsys=capsys)
    ranks = [subprocess.Popen([sys.executable, str(ROOT / "predict.py"), *args, "-o", str(tmp_path / f"rank{r}")],
                              env={**os.environ, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2"},
                              cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    for process in ranks:
        _, err = process.communicate(timeout=300)
        assert process.returncode == 0, err
    def outputs(root):
        return {p.relative_to(root).as_posix() for p in root.rglob("*.*") if not p.name.startswith("run.")}

    single, rank0, rank1 = outputs(tmp_path / "single"), outputs(tmp_path / "rank0"), outputs(tmp_path / "rank1")
    assert rank0 and rank1 and not rank0 & rank1 and rank0 | rank1 == single
    for r, files in enumerate((rank0, rank1)):
        manifest = json.loads((tmp_path / f"rank{r}" / f"run.rank{r}-of-2.json").read_text())
        assert manifest["shard"] == {"rank": r, "world_size": 2, "images": 2 - r, "of": 3}
        for name in files:
            ours, theirs = tmp_path / f"rank{r}" / name, tmp_path / "single" / name
            if name.endswith(".npy"):
                np.testing.assert_allclose(np.load(ours), np.load(theirs), atol=1e-6)
            elif name.endswith(".seg.png"):
                assert np.array_equal(read_png(ours), read_png(theirs))


def test_torchrun_with_a_bad_image(checkpoints, images, tmp_path):
    """The real launcher, 2 CPU processes: all files in one folder, a manifest per rank, the bad image in one
    of them, and exit status 0 (a non-zero rank would make torchrun stop the others)."""
    folder = tmp_path / "in"
    write_images(folder, {"a.jpg": (40, 30), "b.jpg": (30, 40), "c.jpg": (32, 32)})
    (folder / "bad.jpg").write_bytes(b"not a jpeg")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(ROOT / "predict.py"), "seg", str(folder), "-o", str(tmp_path / "out"), "--model", checkpoints["seg"]]
    result = subprocess.run([str(c) for c in command], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in (tmp_path / "out").glob("*.seg.png")) == ["a.seg.png", "b.seg.png", "c.seg.png"]
    manifests = [json.loads((tmp_path / "out" / f"run.rank{r}-of-2.json").read_text()) for r in range(2)]
    assert [m["counts"]["images"] for m in manifests] == [2, 2]
    assert sum(m["counts"]["written"] for m in manifests) == 3
    assert [Path(e["image"]).name for m in manifests for e in m["errors"]] == ["bad.jpg"]


def test_python_dash_m_predict_works():
    result = subprocess.run([sys.executable, "-m", "predict", "--help"], cwd=ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0 and "NAME.seg.png" in result.stdout and "torch" not in result.stderr


def flood_fill_components(mask):
    """Reference: 8-connected components by breadth-first search -> sorted (area, x0, y0, x1, y1)."""
    seen, blobs = np.zeros_like(mask), []
    for y0, x0 in zip(*np.nonzero(mask)):
        if seen[y0, x0]:
            continue
        stack, pixels = [(y0, x0)], []
        seen[y0, x0] = True
        while stack:
            y, x = stack.pop()
            pixels.append((y, x))
            for dy in (-1, 0, 1):
                for dx in (-1, 0, 1):
                    ny, nx = y + dy, x + dx
                    if 0 <= ny < mask.shape[0] and 0 <= nx < mask.shape[1] and mask[ny, nx] and not seen[ny, nx]:
                        seen[ny, nx] = True
                        stack.append((ny, nx))
        ys, xs = zip(*pixels)
        blobs.append((len(pixels), min(xs), min(ys), max(xs), max(ys)))
    return sorted(blobs)


@pytest.mark.parametrize("density", [0.2, 0.45, 0.6])
def test_connected_components_match_flood_fill(density):
    rng = np.random.default_rng(int(density * 100))
    for shape in [(1, 1), (1, 9), (9, 1), (17, 23), (40, 31)]:
        mask = rng.random(shape) < density
        assert sorted(boxes.connected_components(mask)) == flood_fill_components(mask)


def test_person_boxes_from_segmentation():
    seg = torch.zeros(100, 80, dtype=torch.long)
    seg[10:60, 5:30] = 22  # a person (torso class)
    seg[20:90, 50:75] = 3  # another
    seg[95:97, 0:2] = 1  # a speck: dropped
    seg[30:35, 40:44] = 7  # a small blob, under a tenth of the largest: dropped
    assert boxes.person_boxes(seg) == [[50.0, 20.0, 24.0, 69.0], [5.0, 10.0, 24.0, 49.0]]
    assert boxes.person_boxes(torch.zeros(10, 10, dtype=torch.long)) == []
    big = torch.zeros(1500, 1100, dtype=torch.long)
    big[100:1400, 300:700] = 5  # found on a max-pooled grid: the box can only grow, by under one cell
    (x, y, w, h), = boxes.person_boxes(big)
    assert 297 <= x <= 300 and 97 <= y <= 100 and 699 <= x + w <= 702 and 1399 <= y + h <= 1402
    assert boxes.whole_image_box(torch.zeros(3, 40, 30)) == [[0.0, 0.0, 29.0, 39.0]]
