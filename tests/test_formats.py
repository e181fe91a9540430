"""The formats other tools read (formats.py, `--save openpose,coco,ply,depth16`): the OpenPose mapping table is
made of real keypoint names and maps what it says; the files parse with plain numpy / Pillow / pycocotools
and hold the same numbers as predict.py's own outputs."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import predict
from sapiens2 import weights
from sapiens2.processing import DATA_DIR, keypoint_metadata
from sapiens2_app.predict import formats
from test_predict import model_args, run_cli, tiny_model, write_images

NAMES = keypoint_metadata()["keypoint_names"]
INDEX = {name: i for i, name in enumerate(NAMES)}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("checkpoints")
    torch.manual_seed(0)
    return {task: weights.save(tiny_model(task), folder / f"{task}.safetensors")
            for task in ("seg", "pose", "pointmap")}


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    return write_images(tmp_path_factory.mktemp("images"), {"a.jpg": (80, 60), "sub/000042.png": (50, 70)})


def random_person(seed=0, track_id=None):
    generator = torch.Generator().manual_seed(seed)
    person = {"keypoints": torch.rand(308, 2, generator=generator) * 100,
              "scores": torch.rand(308, generator=generator), "labels": torch.arange(308),
              "bbox": torch.tensor([1.0, 2.0, 50.0, 90.0])}
    if track_id is not None:
        person["track_id"] = track_id
    return person


# ----------------------------------------------------------------------------------------------------
# OpenPose
# ----------------------------------------------------------------------------------------------------
def test_openpose_table_uses_real_names_and_the_right_sides():
    table = json.loads((DATA_DIR / "openpose.json").read_text())
    lengths = {part: len(table[part]) for part in formats.OPENPOSE_PARTS}
    assert lengths == {"pose_keypoints_2d": 25, "face_keypoints_2d": 70, "hand_left_keypoints_2d": 21,
                       "hand_right_keypoints_2d": 21}
    indices = formats.openpose_table()  # raises on any name that is not a keypoints308 name
    assert [len(rows) for rows in indices.values()] == list(lengths.values())
    body = dict((label, source) for label, source in table["pose_keypoints_2d"])
    for label, source in body.items():  # RWrist -> right_wrist, LBigToe -> left_big_toe, ...
        side = {"R": "right_", "L": "left_"}.get(label[0]) if label[1].isupper() else None
        if side:
            assert source.startswith(side), (label, source)
    assert body["Neck"] == ["left_shoulder", "right_shoulder"] and body["MidHip"] == ["left_hip", "right_hip"]
    assert indices["pose_keypoints_2d"][4] == [41] and indices["pose_keypoints_2d"][7] == [62]  # wrists
    for side in ("left", "right"):
        rows = table[f"hand_{side}_keypoints_2d"]
        assert all(source.startswith(side + "_") for _, source in rows)
        assert len({source for _, source in rows}) == 21  # no point used twice
    for label, source in table["face_keypoints_2d"]:
        if source is not None and label.startswith(("right", "left")):
            assert source.startswith(("r_", "l_", "end_of_r", "end_of_l", "upper_startpoint_of_r",
                                      "upper_startpoint_of_l"))
            assert ("_r_" in f"_{source}" or source.endswith("_r_eyebrow")) == label.startswith("right"), label
    assert sum(source is not None for _, source in table["face_keypoints_2d"]) == 24


def test_openpose_json_layout_and_values():
    person = random_person(1, track_id=7)
    result = formats.openpose_json([person, random_person(2)])
    assert result["version"] == 1.3 and len(result["people"]) == 2
    first, second = result["people"]
    assert first["person_id"] == [7] and second["person_id"] == [-1]
    lengths = {key: len(value) for key, value in first.items() if key != "person_id"}
    assert lengths == {"pose_keypoints_2d": 75, "face_keypoints_2d": 210, "hand_left_keypoints_2d": 63,
                       "hand_right_keypoints_2d": 63, "pose_keypoints_3d": 0, "face_keypoints_3d": 0,
                       "hand_left_keypoints_3d": 0, "hand_right_keypoints_3d": 0}
    xy, scores = person["keypoints"].double().numpy(), person["scores"].double().numpy()
    pose = np.array(first["pose_keypoints_2d"]).reshape(25, 3)
    np.testing.assert_allclose(pose[0], [*xy[INDEX["nose"]], scores[INDEX["nose"]]], atol=5e-3)
    shoulders = [INDEX["left_shoulder"], INDEX["right_shoulder"]]
    np.testing.assert_allclose(pose[1], [*xy[shoulders].mean(0), scores[shoulders].min()], atol=5e-3)  # neck
    np.testing.assert_allclose(pose[4], [*xy[INDEX["right_wrist"]], scores[INDEX["right_wrist"]]], atol=5e-3)
    np.testing.assert_allclose(pose[24], [*xy[INDEX["right_heel"]], scores[INDEX["right_heel"]]], atol=5e-3)
    face = np.array(first["face_keypoints_2d"]).reshape(70, 3)
    assert np.all(face[:8] == 0) and np.all(face[9:17] == 0)  # no jaw contour in the 308
    np.testing.assert_allclose(face[8, :2], xy[INDEX["tip_of_chin"]], atol=5e-3)
    np.testing.assert_allclose(face[68, :2], xy[INDEX["r_center_of_pupil"]], atol=5e-3)
    left = np.array(first["hand_left_keypoints_2d"]).reshape(21, 3)
    np.testing.assert_allclose(left[0, :2], xy[INDEX["left_wrist"]], atol=5e-3)
    np.testing.assert_allclose(left[4, :2], xy[INDEX["left_thumb4"]], atol=5e-3)  # thumb tip
    np.testing.assert_allclose(left[5, :2], xy[INDEX["left_forefinger_third_joint"]], atol=5e-3)  # index MCP


def test_a_keypoint_the_result_lacks_is_written_as_zero():
    person = random_person(3)
    keep = torch.arange(308) != INDEX["right_wrist"]  # e.g. thresholded away
    person = {**person, "keypoints": person["keypoints"][keep], "scores": person["scores"][keep],
              "labels": person["labels"][keep]}
    pose = np.array(formats.openpose_json([person])["people"][0]["pose_keypoints_2d"]).reshape(25, 3)
    assert pose[4].tolist() == [0, 0, 0] and pose[3, 2] > 0


# ----------------------------------------------------------------------------------------------------
# The CLI: openpose + coco for pose, ply + depth16 for pointmap
# ----------------------------------------------------------------------------------------------------
def test_cli_openpose_and_coco_files_match_pose_json(checkpoints, images, tmp_path, capsys):
    boxes = tmp_path / "boxes.json"
    boxes.write_text(json.dumps({"a.jpg": [[5, 10, 40, 60], [0, 0, 20, 20]], "000042.png": [[10, 5, 30, 40]]}))
    out = tmp_path / "out"
    run_cli("pose", images, "-o", out, "--boxes", boxes, "--save", "json,openpose,coco",
            *model_args(checkpoints, ["pose"]), capsys=capsys)
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()) == [
        "a.pose.json", "a_keypoints.json", "coco_keypoints.json", "run.json", "sub/000042.pose.json",
        "sub/000042_keypoints.json"]
    pose = json.loads((out / "a.pose.json").read_text())
    openpose = json.loads((out / "a_keypoints.json").read_text())
    assert len(openpose["people"]) == len(pose["people"]) == 2
    for ours, theirs in zip(openpose["people"], pose["people"]):
        table = np.array(theirs["keypoints"])  # (308, 3)
        body = np.array(ours["pose_keypoints_2d"]).reshape(25, 3)
        np.testing.assert_allclose(body[5], table[INDEX["left_shoulder"]], atol=1e-6)
        np.testing.assert_allclose(body[8, :2], table[[INDEX["left_hip"], INDEX["right_hip"]], :2].mean(0), atol=0.01)
        right = np.array(ours["hand_right_keypoints_2d"]).reshape(21, 3)
        np.testing.assert_allclose(right[20], table[INDEX["right_pinky_finger4"]], atol=1e-6)

    results = json.loads((out / "coco_keypoints.json").read_text())
    assert [r["image_file"] for r in results] == ["a.jpg", "a.jpg", "sub/000042.png"]
    assert [r["image_id"] for r in results] == [0, 0, 1]  # not every name is a number: positions
    coco17 = [INDEX[n] for n in keypoint_metadata()["keypoint_groups"]["body_keypoint_names"]]
    for result, person in zip(results, pose["people"]):
        assert result["category_id"] == 1 and len(result["keypoints"]) == 51
        np.testing.assert_allclose(np.array(result["keypoints"]).reshape(17, 3),
                                   np.array(person["keypoints"])[coco17], atol=0.01)
        x0, y0, x1, y1 = person["box"]
        assert result["bbox"] == pytest.approx([x0, y0, x1 - x0, y1 - y0], abs=0.01)
        scores = np.array(person["keypoints"])[coco17, 2]
        assert result["score"] == pytest.approx(scores[scores > 0.2].mean(), abs=1e-3)  # rescored on the 17


def test_coco_results_are_accepted_by_cocoeval(tmp_path):
    """pycocotools reads the file and, against ground truth equal to the predictions, scores AP 1."""
    pytest.importorskip("pycocotools")
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    coco = formats.CocoResults("coco17")
    people = [random_person(4), random_person(5)]
    for person in people:
        person["scores"] = person["scores"] * 0.5 + 0.5
        x, y = person["keypoints"].min(0).values.tolist()
        w, h = (person["keypoints"].max(0).values - person["keypoints"].min(0).values).tolist()
        person["bbox"] = torch.tensor([x, y, x + w, y + h])
    coco.add("frames/000007", "clip.mp4#7", people)
    results = coco.results()
    assert {r["image_id"] for r in results} == {7}  # every name a number: the number
    ground_truth = {"images": [{"id": 7, "width": 200, "height": 200}],
                    "categories": [{"id": 1, "name": "person", "keypoints": [str(i) for i in range(17)],
                                    "skeleton": []}],
                    "annotations": [{"id": i + 1, "image_id": 7, "category_id": 1, "iscrowd": 0,
                                     "keypoints": [v if (j % 3) < 2 else 2 for j, v in enumerate(r["keypoints"])],
                                     "num_keypoints": 17, "bbox": r["bbox"], "area": r["bbox"][2] * r["bbox"][3]}
                                    for i, r in enumerate(results)]}
    (tmp_path / "gt.json").write_text(json.dumps(ground_truth))
    (tmp_path / "results.json").write_text(json.dumps(results))
    gt = COCO(str(tmp_path / "gt.json"))
    evaluation = COCOeval(gt, gt.loadRes(str(tmp_path / "results.json")), "keypoints")
    evaluation.evaluate(), evaluation.accumulate(), evaluation.summarize()
    assert evaluation.stats[0] == pytest.approx(1.0)


def read_ply(path: Path) -> np.ndarray:
    data = path.read_bytes()
    header, body = data.split(b"end_header\n", 1)
    lines = header.decode("ascii").splitlines()
    assert lines[:2] == ["ply", "format binary_little_endian 1.0"]
    count = int(next(line for line in lines if line.startswith("element vertex")).split()[-1])
    properties = [line.split()[1:] for line in lines if line.startswith("property")]
    assert properties == [["float", "x"], ["float", "y"], ["float", "z"], ["uchar", "red"], ["uchar", "green"],
                          ["uchar", "blue"]]
    return np.frombuffer(body, formats.PLY_VERTEX, count=count)


@pytest.mark.parametrize("masked", [False, True])
def test_cli_ply_and_depth16_match_the_pointmap(checkpoints, images, tmp_path, capsys, masked):
    run_cli("pointmap", images / "a.jpg", "-o", tmp_path, "--save", "raw,ply,depth16",
            *(["--mask-with-seg"] if masked else []), *model_args(checkpoints, ["seg", "pointmap"]), capsys=capsys)
    pointmap = np.load(tmp_path / "a.pointmap.npy")  # (H, W, 3), NaN outside the people when masked
    valid = np.isfinite(pointmap).all(-1)
    assert valid.any() and (not valid.all()) == masked
    vertices = read_ply(tmp_path / "a.pointmap.ply")
    assert (tmp_path / "a.pointmap.ply").stat().st_size == len((tmp_path / "a.pointmap.ply").read_bytes())
    assert len(vertices) == valid.sum()
    xyz = np.stack([vertices[k] for k in "xyz"], -1)
    np.testing.assert_array_equal(xyz, pointmap[valid])
    photo = np.array(Image.open(images / "a.jpg").convert("RGB"))
    np.testing.assert_array_equal(np.stack([vertices[k] for k in ("red", "green", "blue")], -1), photo[valid])

    with Image.open(tmp_path / "a.depth16.png") as picture:
        depth = np.array(picture)
    assert depth.dtype == np.uint16 and depth.shape == valid.shape
    z = pointmap[..., 2].astype(np.float64) * 1000
    expected = np.where(valid & (z >= 0.5) & (z < 65535.5), np.round(np.nan_to_num(z)), 0)
    np.testing.assert_array_equal(depth, expected)
    assert (depth > 0).any()


def test_depth16_conventions():
    depth = torch.tensor([[1.2344, float("nan"), -1.0, 70.0], [0.0004, 0.0006, 65.535, float("inf")]])
    values = np.array(formats.depth16_image(depth))
    assert values.tolist() == [[1234, 0, 0, 0], [0, 1, 65535, 0]]
    mask = torch.tensor([[False, True, True, True], [True, True, True, True]])
    assert np.array(formats.depth16_image(depth, mask))[0, 0] == 0


def test_save_coco_needs_pose(checkpoints, images, capsys):
    assert predict.main(["seg", str(images), "--save", "coco", *model_args(checkpoints, ["seg"])]) == 2
    assert "writes nothing" in capsys.readouterr().err
