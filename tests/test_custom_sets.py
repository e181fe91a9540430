"""Pictures and other-tool formats for models with label sets of their own (a 4-class seg fine-tune, a COCO-17
or other custom keypoint set): palettes that cover every class, skeletons only where one is known, OpenPose /
COCO files mapped by keypoint name or refused before any image."""

import json

import numpy as np
import pytest
import torch
from PIL import Image

from sapiens2 import heads
import predict
from sapiens2 import Sapiens2Config, processing, weights
from sapiens2.processing import keypoint_metadata, segmentation_metadata
from sapiens2_app.predict import formats, inputs, outputs, pictures
from sapiens2_app.predict.models import LoadedModel

COCO17 = processing.coco17_names()
OWN5 = ("head_top", "chin", "left_fin", "right_fin", "tail")


def person(points: dict[int, tuple[float, float]], score=0.9) -> dict:
    labels = sorted(points)
    return {"keypoints": torch.tensor([points[k] for k in labels], dtype=torch.float64),
            "scores": torch.full((len(labels),), score, dtype=torch.float64), "labels": torch.tensor(labels),
            "bbox": torch.tensor([1.0, 2.0, 90.0, 95.0], dtype=torch.float64)}


def coco17_person() -> dict:
    """A person of a COCO-17 model: the 17 points spread over a 100x100 image (labels 0..16 = COCO order)."""
    return person({k: (10.0 + 4.5 * k, 15.0 + (37 * k) % 70) for k in range(17)})


# ----------------------------------------------------------------------------------------------------
# Seg palettes
# ----------------------------------------------------------------------------------------------------
def test_palette_is_the_released_one_for_29_and_distinct_otherwise():
    assert pictures.segmentation_palette(29) == [tuple(c) for c in segmentation_metadata()["palette_rgb"]]
    for count in (1, 4, 17, 30, 256):
        palette = pictures.segmentation_palette(count)
        assert len(palette) == count == len(set(palette)), count
        assert palette == pictures.segmentation_palette(count)  # deterministic
        assert all(0 <= v <= 255 for color in palette for v in color)
    assert pictures.segmentation_palette(4) != pictures.segmentation_palette(29)[:4]  # not the 29's meanings


@pytest.mark.parametrize("count", [4, 40])
def test_colorize_covers_every_class_and_blacks_out_the_rest(count):
    ids = torch.arange(count + 2).repeat(3, 1)  # every class, then two ids the model cannot predict
    colours = pictures.colorize_segmentation(ids, count)
    expected = torch.tensor(pictures.segmentation_palette(count) + [(0, 0, 0)] * 2, dtype=torch.uint8)
    assert torch.equal(colours[:, 0].T, expected)
    default = pictures.colorize_segmentation(torch.arange(29)[None])  # the released call, unchanged
    assert torch.equal(default[:, 0].T, torch.tensor(segmentation_metadata()["palette_rgb"], dtype=torch.uint8))


# ----------------------------------------------------------------------------------------------------
# Pose overlays
# ----------------------------------------------------------------------------------------------------
def test_coco17_names_draw_the_coco17_skeleton_in_the_models_indexing():
    canvas = np.zeros((100, 100, 3), np.uint8)
    ours = pictures.draw_pose(canvas, [coco17_person()], names=COCO17, radius=2, thickness=1)
    ids308 = processing.coco17_indices()  # the same points labelled as the 308 model labels them
    as308 = coco17_person()
    as308["labels"] = torch.tensor([ids308[k] for k in as308["labels"].tolist()])
    reference = pictures.draw_pose(canvas, [as308], keypoint_set="coco17", radius=2, thickness=1)
    assert np.array_equal(np.array(ours), np.array(reference))
    points_only = pictures.draw_pose(canvas, [coco17_person()], names=COCO17[::-1], radius=2, thickness=1)
    assert (np.array(ours) != np.array(points_only)).any()  # the links: reversed names are no known set


def test_custom_names_draw_points_only_never_the_308_skeleton():
    canvas = np.zeros((100, 100, 3), np.uint8)
    # labels 0..4 are linked in the 308 skeleton (nose-eyes, eyes-ears): drawn with names, no link may appear
    points = {0: (10.0, 10.0), 1: (80.0, 10.0), 2: (10.0, 80.0), 3: (80.0, 80.0), 4: (45.0, 45.0)}
    drawn = np.array(pictures.draw_pose(canvas, [person(points)], names=OWN5, radius=3, thickness=2))
    colours = pictures.distinct_colors(5)
    for k, (x, y) in points.items():
        assert tuple(drawn[int(y), int(x)]) == colours[k]
    lit = drawn.any(axis=2)
    assert lit.sum() <= 5 * 7 * 7  # five dots of radius 3, nothing between them
    assert not lit[10, 20:70].any() and not lit[20:70, 10].any()
    assert np.array_equal(drawn, np.array(pictures.draw_pose(canvas, [person(points)], names=OWN5, radius=3,
                                                                thickness=2)))
    names308 = keypoint_metadata()["keypoint_names"]
    assert np.array_equal(np.array(pictures.draw_pose(canvas, [person(points)], names=names308)),
                          np.array(pictures.draw_pose(canvas, [person(points)])))


# ----------------------------------------------------------------------------------------------------
# OpenPose / COCO for other sets
# ----------------------------------------------------------------------------------------------------
def test_which_keypoint_sets_each_format_accepts():
    names308 = tuple(keypoint_metadata()["keypoint_names"])
    for fmt in formats.COCO_FORMATS:
        assert formats.unsupported_keypoints("coco", fmt, names308) is None
    assert formats.unsupported_keypoints("openpose", "coco17", names308) is None
    for fmt in ("coco17", "coco_wholebody", "model"):
        assert formats.unsupported_keypoints("coco", fmt, COCO17) is None
    assert formats.unsupported_keypoints("openpose", "coco17", COCO17) is None
    assert "use --coco-format model" in formats.unsupported_keypoints("coco", "keypoints308", COCO17)
    assert formats.unsupported_keypoints("coco", "model", OWN5) is None
    line = formats.unsupported_keypoints("openpose", "coco17", OWN5)
    assert line.startswith("--save openpose: the pose model has its own 5 keypoints (head_top,") and "\n" not in line
    assert "--coco-format model" in formats.unsupported_keypoints("coco", "coco17", OWN5)


def test_openpose_of_a_coco17_model_maps_by_name():
    ours = formats.openpose_json([coco17_person()], COCO17)["people"][0]["pose_keypoints_2d"]
    ids308 = processing.coco17_indices()
    as308 = coco17_person()
    as308["labels"] = torch.tensor([ids308[k] for k in as308["labels"].tolist()])
    body = formats.openpose_table(COCO17)["pose_keypoints_2d"]
    assert sum(map(bool, body)) == 17 + 2  # COCO's 17 + Neck and MidHip (means of shoulders / hips); feet are 0
    ours, full = formats.openpose_json([coco17_person()], COCO17), formats.openpose_json([as308])
    for part in formats.OPENPOSE_PARTS:  # where the names give a point it is the 308 model's, elsewhere 0
        rows = formats.openpose_table(COCO17)[part]
        mapped = [i for i, sources in enumerate(rows) if sources]
        mine = np.array(ours["people"][0][part]).reshape(-1, 3)
        theirs = np.array(full["people"][0][part]).reshape(-1, 3)
        assert np.array_equal(mine[mapped], theirs[mapped]) and (mine[mapped] != 0).all()
        assert not mine[[i for i in range(len(rows)) if i not in mapped]].any()


def test_coco_results_carry_the_models_keypoints():
    coco17 = formats.CocoResults("coco17", COCO17)
    coco17.add("a", "a.jpg", [coco17_person()])
    expected = [v for (x, y), s in zip(coco17_person()["keypoints"].tolist(), [0.9] * 17) for v in (x, y, s)]
    assert np.allclose(coco17.results()[0]["keypoints"], expected, rtol=0, atol=0.005 + 1e-9)  # rounded to 0.01 px
    own = formats.CocoResults("model", OWN5)
    own.add("a", "a.jpg", [person({k: (5.0 * k, 6.0 * k) for k in range(5)})])
    assert own.results()[0]["keypoints"] == [v for k in range(5) for v in (5.0 * k, 6.0 * k, 0.9)]


# ----------------------------------------------------------------------------------------------------
# predict.py end to end with tiny models of their own sets
# ----------------------------------------------------------------------------------------------------
def tiny_task_model(task, labels):
    config = Sapiens2Config(32, 3, 2, full_attention_first=1, full_attention_last=1, image_size=(64, 48))
    upsample = (16, 8) if task == "pose" else (16, 8, 8, 8)
    model = heads.build_task_model(config, heads.HeadConfig(task, upsample, (8, 4), len(labels),
                                                            labels=tuple(labels)))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def own_set_run(tmp_path_factory):
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("own")
    seg4 = tiny_task_model("seg", ["background", "skin", "hair", "clothes"])
    with torch.no_grad():  # class 3 everywhere: a flat overlay that JPEG keeps, of the class the 29 colour otherwise
        seg4.decode_head.predictor.weight.zero_()
        seg4.decode_head.predictor.bias.copy_(torch.tensor([0.0, 0.0, 0.0, 5.0]))
    seg = weights.save(seg4, root / "seg4")
    pose = weights.save(tiny_task_model("pose", COCO17), root / "pose17")
    own = weights.save(tiny_task_model("pose", OWN5), root / "pose5")
    pixels = np.zeros((64, 48, 3), np.uint8) + np.array([40, 90, 160], np.uint8)
    pixels[16:48, 16:32] = (200, 120, 60)  # a "person": smooth, so JPEG keeps the overlay's colours
    Image.fromarray(pixels).save(root / "a.png")
    (root / "boxes.json").write_text(json.dumps({"a.png": [[4, 4, 40, 60]]}))
    return root, seg, pose, own


def test_predict_seg_overlay_uses_the_models_palette(own_set_run, tmp_path):
    root, seg, _, _ = own_set_run
    assert predict.main(["seg", str(root / "a.png"), "-o", str(tmp_path), "--model", f"seg={seg}"]) == 0
    ids = torch.from_numpy(np.array(Image.open(tmp_path / "a.seg.png"))).long()
    assert (ids == 3).all()
    image = torch.from_numpy(np.array(Image.open(root / "a.png"))).permute(2, 0, 1).float()
    overlay = np.array(Image.open(tmp_path / "a.seg_overlay.jpg")).astype(np.float32)

    def error(count):
        palette = torch.tensor(pictures.segmentation_palette(count), dtype=torch.float32)
        expected = ((image + palette[ids].permute(2, 0, 1)) / 2).round().permute(1, 2, 0).numpy()
        return np.abs(overlay - expected).mean()
    assert error(4) < 4 < 4 * error(4) < error(29)  # JPEG-close to the 4-class palette, far from the 29's
    head = json.loads((tmp_path / "run.json").read_text())["models"]["seg"]["head"]
    assert head["labels"] == ["background", "skin", "hair", "clothes"]


def test_predict_coco17_pose_writes_openpose_and_coco(own_set_run, tmp_path):
    root, _, pose, _ = own_set_run
    assert predict.main(["pose", str(root / "a.png"), "-o", str(tmp_path), "--model", f"pose={pose}",
                         "--boxes", str(root / "boxes.json"), "--no-flip", "--save", "json,vis,openpose,coco"]) == 0
    written = json.loads((tmp_path / "a.pose.json").read_text())
    assert written["keypoint_names"] == list(COCO17) and len(written["people"][0]["keypoints"]) == 17
    coco = json.loads((tmp_path / "coco_keypoints.json").read_text())[0]["keypoints"]
    assert coco == [v for point in written["people"][0]["keypoints"] for v in point]  # the same rounded values
    body = np.array(json.loads((tmp_path / "a_keypoints.json").read_text())["people"][0]["pose_keypoints_2d"])
    assert np.allclose(body[:2], written["people"][0]["keypoints"][0][:2])  # BODY_25's Nose is COCO's nose
    assert (tmp_path / "a.pose_overlay.jpg").exists()


def test_predict_refuses_openpose_for_a_set_it_cannot_map_before_any_image(own_set_run, tmp_path, capsys):
    root, _, _, own = own_set_run
    args = ["pose", str(root / "a.png"), "-o", str(tmp_path), "--model", f"pose={own}",
            "--boxes", str(root / "boxes.json"), "--no-flip"]
    assert predict.main(args + ["--save", "json,openpose"]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("error: --save openpose: the pose model has its own 5 keypoints") and "\n" not in error
    assert not (tmp_path / "a.pose.json").exists()
    assert predict.main(args + ["--save", "json,vis,coco", "--coco-format", "model"]) == 0
    coco = json.loads((tmp_path / "coco_keypoints.json").read_text())[0]["keypoints"]
    written = json.loads((tmp_path / "a.pose.json").read_text())
    assert written["keypoint_names"] == list(OWN5) and len(coco) == 15


def test_predict_renders_a_coco17_models_overlay_and_openpose_with_its_names(own_set_run):
    """render() hands the model's names to the drawing and OpenPose (a 308 skeleton over labels 0..16 would
    link face points)."""
    _, _, pose, _ = own_set_run
    loaded = LoadedModel(weights.load(pose), str(pose))
    image = torch.zeros(3, 100, 100, dtype=torch.uint8)
    result = {"pose": {"people": [coco17_person()], "box_source": "boxes", "detector_scores": None}}
    made = outputs.render("pose", inputs.InputImage(pose, "a.png"), image, result, loaded)
    expected = pictures.draw_pose(image, [coco17_person()], names=COCO17)
    assert np.array_equal(np.array(made[".pose_overlay.jpg"]()), np.array(expected))
    assert (np.array(expected) != np.array(pictures.draw_pose(image, [coco17_person()]))).any()
    assert made["_keypoints.json"]() == formats.openpose_json([coco17_person()], COCO17)


def test_flip_test_without_pairs_is_refused_once_before_any_image(own_set_run, tmp_path, capsys):
    """A custom set saved without left/right pairs: one line naming --no-flip (exit 2), not a failure per image."""
    root, _, _, own = own_set_run
    args = ["pose", str(root / "a.png"), "-o", str(tmp_path), "--model", f"pose={own}",
            "--boxes", str(root / "boxes.json")]
    assert predict.main(args) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("error: --model pose:") and "--no-flip" in error and "\n" not in error
    assert not (tmp_path / "a.pose.json").exists()
    assert predict.main(args + ["--no-flip"]) == 0 and (tmp_path / "a.pose.json").exists()
