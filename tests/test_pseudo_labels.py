"""predict.py --training-data DIR (sapiens2_app/train/pseudo_labels.py): the predictions written in train.py's layout read
back, through train.py's own readers, as exactly what predict.py wrote to its raw outputs."""

import json

import numpy as np
import pytest
from PIL import Image

import predict
from sapiens2_app.train import dataset_files, datasets
from sapiens2_app.train.pseudo_labels import VISIBLE_SCORE
from test_predict import checkpoints, model_args, write_images  # noqa: F401 (checkpoints: a fixture)

TASKS = ["seg", "pose", "normal", "pointmap", "matting", "albedo"]
SIZES = {"a.jpg": (80, 60), "sub/b.png": (50, 70)}  # (H, W)


@pytest.fixture(scope="module")
def predicted(checkpoints, tmp_path_factory):  # noqa: F811
    root = tmp_path_factory.mktemp("pseudo")
    images = write_images(root / "photos", SIZES)
    boxes = root / "boxes.json"
    boxes.write_text(json.dumps({"a.jpg": [[5, 10, 40, 60], [0, 0, 20, 20]], "b.png": [[10, 5, 30, 40]]}))
    assert predict.main([",".join(TASKS), str(images), "-o", str(root / "out"), "--boxes", str(boxes), "--save",
                         "raw,json", "--mask-with-seg", "--training-data", str(root / "data"),
                         *model_args(checkpoints, TASKS)]) == 0
    return root / "out", root / "data"


@pytest.mark.parametrize("task", ["seg", "normal", "pointmap", "matting", "albedo"])
def test_dense_targets_read_back_as_predicted(task, predicted):
    out, data = predicted
    data = data / task
    info = datasets.dataset_info(task, data)
    dataset = datasets.DenseDataset(task, data / "train", (64, 48), False, class_names=info.get("class_names"))
    assert sorted(dataset.names) == ["a", "sub/b"]
    for name, (file, (h, w)) in zip(["a", "sub/b"], SIZES.items()):
        assert dataset.images[name].read_bytes() == (out.parent / "photos" / file).read_bytes()  # the photo itself
        target, mask, _ = dataset.read_target(name, (h, w))  # what train.py's loader makes of the file
        if task == "seg":
            written = np.array(Image.open(out / f"{name}.seg.png"))
            assert np.array_equal(target[0].numpy(), written.astype(np.float32))
        elif task in ("normal", "pointmap"):
            written = np.load(out / f"{name}.{task}.npy")  # NaN outside the person (--mask-with-seg)
            valid = np.isfinite(written).all(-1)
            assert 0 < valid.mean() < 1  # (both kinds of pixel are there to check)
            expected = np.where(valid[..., None], written, 0.0)
            if task == "normal":  # (the loader's renormalization)
                expected = expected / (np.linalg.norm(expected, axis=-1, keepdims=True) + 1e-6)
            assert np.array_equal(target.permute(1, 2, 0).numpy(), expected.astype(np.float32))
            assert np.array_equal(mask[0].numpy(), valid.astype(np.float32))
        elif task == "matting":
            written = np.array(Image.open(out / f"{name}.alpha.png"))
            assert np.array_equal(target[0].numpy(), written.astype(np.float32) / 255)
        else:  # RGB as NAME.albedo.png, the person's mask as the valid pixels
            written = np.array(Image.open(out / f"{name}.albedo.png"))
            assert np.array_equal(target.permute(1, 2, 0).numpy(), written.astype(np.float32) / 255)
            seg = np.array(Image.open(out / f"{name}.seg.png"))
            assert np.array_equal(mask[0].numpy() > 0, seg > 0) and 0 < (seg > 0).mean() < 1
    if task == "seg":
        assert info["class_names"] == json.loads((data / "classes.json").read_text())


def test_pose_annotations_read_back_as_predicted(predicted):
    out, data = predicted
    coco, path = dataset_files.read_annotations(data / "pose" / "train")
    meta = dataset_files.keypoint_set(coco, path)
    assert len(meta["keypoint_names"]) == 308 and meta["flip_pairs_from"] == "annotations"
    files = {image["id"]: image["file_name"] for image in coco["images"]}
    by_file = {}
    for ann in coco["annotations"]:
        by_file.setdefault(files[ann["image_id"]], []).append(ann)
    assert sorted(by_file) == ["a.jpg", "sub/b.png"] and len(by_file["a.jpg"]) == 2
    for file, people in by_file.items():
        written = json.loads((out / file).with_suffix(".pose.json").read_text())["people"]
        for ann, person in zip(people, written):
            x0, y0, x1, y1 = person["box"]
            assert ann["bbox"] == pytest.approx([x0, y0, x1 - x0, y1 - y0], abs=0.006)  # pose.json: 2 decimals
            points = np.array(ann["keypoints"]).reshape(-1, 3)
            expected = np.array(person["keypoints"])
            assert np.allclose(points[:, :2], expected[:, :2], atol=0.006)
            assert np.array_equal(points[:, 2], np.where(expected[:, 2] >= VISIBLE_SCORE, 2, 0))
