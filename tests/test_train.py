"""train.py and train_data.py on tiny random backbones and synthetic datasets whose labels are learnable:
loss down and metric up when overfitting, checkpoints that weights.load and predict.py read, exact resume,
1 process == 2 processes (gloo), augmentations that transform the targets with the image."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

import heads
import predict
import processing
import train
import train_data
import weights
from sapiens2 import Sapiens2, Sapiens2Config

ROOT = Path(__file__).resolve().parents[1]
SIZE = (64, 48)  # network input (H, W)
COCO17 = ["nose", "left_eye", "right_eye", "left_ear", "right_ear", "left_shoulder", "right_shoulder", "left_elbow",
          "right_elbow", "left_wrist", "right_wrist", "left_hip", "right_hip", "left_knee", "right_knee", "left_ankle",
          "right_ankle"]
HEADS = {"pose": "16,8:8", "seg": "16,8,8,8:8", "normal": "16,8,8,8:8", "albedo": "16,8,8,8:8",
         "matting": "16,8,8,8:8", "pointmap": "16,8,8,8:8:8:8,4"}


def tiny_backbone(path: Path) -> Path:
    torch.manual_seed(0)
    config = Sapiens2Config(32, 2, 2, full_attention_first=1, full_attention_last=1, image_size=SIZE)
    return weights.save(Sapiens2(config), path / "backbone.safetensors")


def save_png(path: Path, array: np.ndarray):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(array).save(path)


def rectangles(rng, h, w):
    """Image with a red and a blue rectangle on grey, and the class map (1 red, 2 blue)."""
    image = np.full((h, w, 3), 128, np.uint8)
    labels = np.zeros((h, w), np.uint8)
    for cls, colour in ((1, (220, 30, 30)), (2, (30, 30, 220))):
        y, x = rng.integers(0, h // 2), rng.integers(0, w // 2)
        image[y : y + h // 2, x : x + w // 2] = colour
        labels[y : y + h // 2, x : x + w // 2] = cls
    return image, labels


def make_dataset(task: str, root: Path, count: int = 4, h: int = 64, w: int = 48) -> Path:
    rng = np.random.default_rng(1)
    for split in ("train", "val"):
        folder = root / split
        if task == "pose":
            make_pose_split(folder, rng, count, h, w)
            continue
        for i in range(count):
            image, labels = rectangles(rng, h, w)
            save_png(folder / "images" / f"im{i}.png", image)
            if task == "seg":
                save_png(folder / "masks" / f"im{i}.png", labels)
            elif task == "normal":  # the colour says which way the surface faces
                table = np.array([[0, 0, -1], [0.6, 0, -0.8], [-0.6, 0, -0.8]], np.float32)
                np.save(folder / "normals" / f"im{i}.npy", table[labels]) if (folder / "normals").mkdir(
                    parents=True, exist_ok=True) is None else None
            elif task == "pointmap":  # a pinhole camera looking at planes whose depth the colour gives
                (folder / "pointmaps").mkdir(parents=True, exist_ok=True)
                depth = np.array([3.0, 2.0, 2.5], np.float32)[labels]
                v, u = np.mgrid[0:h, 0:w].astype(np.float32)
                fx, cx, cy = 500.0, (w - 1) / 2, (h - 1) / 2
                points = np.stack([(u - cx) * depth / fx, (v - cy) * depth / fx, depth], -1)
                np.save(folder / "pointmaps" / f"im{i}.npy", points)
            elif task == "matting":
                save_png(folder / "alphas" / f"im{i}.png", np.where(labels > 0, 255, 0).astype(np.uint8))
            elif task == "albedo":
                save_png(folder / "albedo" / f"im{i}.png", image)
    if task == "seg":
        (root / "classes.json").write_text(json.dumps(["background", "red", "blue"]))
    return root


def make_pose_split(folder: Path, rng, count: int, h: int, w: int):
    """One person per image; its 17 keypoints always at the same places of its box, drawn as dots."""
    layout = np.stack([np.linspace(0.1, 0.9, 17), np.abs(np.linspace(-0.8, 0.8, 17)) + 0.1], 1)
    images, annotations = [], []
    for i in range(count):
        image = np.full((h, w, 3), 40, np.uint8)
        bw, bh = rng.integers(20, 30), rng.integers(40, 50)
        x0, y0 = rng.integers(0, w - bw), rng.integers(0, h - bh)
        image[y0 : y0 + bh, x0 : x0 + bw] = (200, 160, 120)
        points = layout * [bw, bh] + [x0, y0]
        keypoints = []
        for k, (x, y) in enumerate(points):
            image[int(y), int(x)] = (255, 255, 255)
            keypoints += [float(x), float(y), 2 if k != 3 else 0]  # one invisible keypoint
        save_png(folder / "images" / f"p{i}.png", image)
        images.append({"id": i, "file_name": f"p{i}.png", "height": h, "width": w})
        annotations.append({"id": i, "image_id": i, "bbox": [float(x0), float(y0), float(bw), float(bh)],
                            "keypoints": keypoints, "num_keypoints": 16})
    sigmas = [0.1] * 17
    category = {"id": 1, "name": "person", "keypoints": COCO17, "skeleton": [[1, 2]], "sigmas": sigmas}
    (folder / "annotations.json").write_text(json.dumps({"images": images, "annotations": annotations,
                                                         "categories": [category]}))


def run_train(task, data, out, model, *extra):
    args = [task, "--data", data, "-o", out, "--model", model, "--head", HEADS[task], "--workers", "0",
            "--no-progress", "--no-augment", "--batch-size", "4", "--warmup", "0", *extra]
    return train.main([str(a) for a in args])


def read_log(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]


# ----------------------------------------------------------------------------------------------------
# Overfitting every task: loss down, metric better, checkpoint loads, predict.py runs it
# ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def backbone(tmp_path_factory) -> Path:
    return tiny_backbone(tmp_path_factory.mktemp("backbone"))


@pytest.mark.parametrize("task", ["seg", "pose", "normal", "pointmap", "matting", "albedo"])
def test_overfit_each_task(task, backbone, tmp_path):
    data = make_dataset(task, tmp_path / "data")
    out = tmp_path / "run"
    steps = 30
    assert run_train(task, data, out, backbone, "--steps", steps, "--lr", "3e-3", "--eval-every", steps,
                     "--log-every", 1, "--layer-decay", "1", "--clip-grad", "0") == 0
    log = read_log(out)
    losses = [r["loss"] for r in log if "loss" in r]
    assert len(losses) == steps and np.mean(losses[-5:]) < 0.8 * np.mean(losses[:3]), losses
    final = [r["eval"] for r in log if "eval" in r][-1]
    name, sign = train_data.MAIN_METRIC[task]
    # the same metric of the untrained model (fresh head on the same backbone, seed 0)
    model = weights.load(out)
    info = train_data.dataset_info(task, data)
    val = train_data.build_dataset(task, data, "val", SIZE, False, info)
    dist_info = train.Distributed("cpu")
    args = train.build_parser().parse_args([task, "--data", str(data), "-o", str(out), "--batch-size", "4"])
    assert train.evaluate(model, val, args, info, dist_info)[name] == pytest.approx(final[name], rel=1e-4, abs=1e-6)
    torch.manual_seed(0)
    fresh = heads.build_task_model(model.config, model.head_config)
    fresh.backbone.load_state_dict(weights.load(backbone).state_dict())
    before = train.evaluate(fresh.eval(), val, args, info, dist_info)[name]
    if task != "pose":  # 30 steps of a 2-block backbone do not localize keypoints (test_pose_metrics_* instead)
        assert sign * (final[name] - before) > 0, (before, final)
    assert isinstance(model, heads.TASK_MODELS[task]) and model.head_config.out_channels == info["out_channels"]


def test_pose_17_keypoints_train_and_predict(backbone, tmp_path):
    data = make_dataset("pose", tmp_path / "data")
    out = tmp_path / "run"
    assert run_train("pose", data, out, backbone, "--steps", 2) == 0
    model = weights.load(out, task="pose")
    assert model.head_config.out_channels == 17
    saved = json.loads((out / "config.json").read_text())["sapiens2_training"]
    assert saved["keypoint_names"] == COCO17
    assert saved["flip_pairs"] == [[1, 2], [3, 4], [5, 6], [7, 8], [9, 10], [11, 12], [13, 14], [15, 16]]
    boxes = tmp_path / "boxes.json"
    boxes.write_text(json.dumps({"p0.png": [[2, 2, 40, 50]]}))
    assert predict.main(["pose", str(data / "val" / "images" / "p0.png"), "-o", str(tmp_path / "pred"),
                         "--model", str(out), "--boxes", str(boxes)]) == 0
    people = json.loads((tmp_path / "pred" / "p0.pose.json").read_text())["people"]
    assert len(people) == 1 and len(people[0]["keypoints"]) == 17


def test_seg_checkpoint_runs_in_predict(backbone, tmp_path):
    data = make_dataset("seg", tmp_path / "data")
    out = tmp_path / "run"
    assert run_train("seg", data, out, backbone, "--steps", 2) == 0
    assert json.loads((out / "config.json").read_text())["id2label"] == {"0": "background", "1": "red", "2": "blue"}
    assert predict.main(["seg", str(data / "val" / "images"), "-o", str(tmp_path / "pred"), "--model", str(out)]) == 0
    seg = np.array(Image.open(tmp_path / "pred" / "im0.seg.png"))
    assert seg.shape == (64, 48) and seg.max() <= 2


def test_pose_targets_match_processing_and_perfect_heatmaps_score_one(tmp_path):
    """Without augmentation the crop and the UDP targets are processing's (what predict.py uses); the target
    heatmaps decoded as a prediction give PCK 1 and OKS AP 1."""
    data = make_dataset("pose", tmp_path / "data")
    info = train_data.dataset_info("pose", data)
    val = train_data.build_dataset("pose", data, "val", SIZE, False, info)
    person = val.people[0]
    sample = val[(0, 0)]
    image = processing.load_image(person["file"])
    expected = processing.preprocess_crops([image], [[person["bbox"]]], SIZE).pixel_values[0]
    torch.testing.assert_close(sample["pixel_values"], expected, atol=1e-4, rtol=0)
    heatmaps, weights_ = processing.pose_heatmap_targets([[person["bbox"]]], [[person["keypoints"].numpy()]], SIZE,
                                                         sigma=train_data.heatmap_sigma((16, 12)))
    torch.testing.assert_close(sample["labels"], heatmaps[0], atol=1e-6, rtol=0)
    assert torch.equal(sample["label_weights"], weights_[0]) and sample["label_weights"][3] == 0
    batch = train_data.collate([val[(i, 0)] for i in range(len(val))])
    metric = train_data.Metric("pose", info)
    metric.update(heads.PoseOutput(batch["labels"]), batch, torch.ones(len(val)))
    assert metric.result() == {"pck@0.05": pytest.approx(1.0), "oks_ap": pytest.approx(1.0)}


# ----------------------------------------------------------------------------------------------------
# Resume and several processes
# ----------------------------------------------------------------------------------------------------
def checkpoint_tensors(out: Path) -> dict:
    return {**load_file(str(out / "model.safetensors")),
            **{k: v for k, v in load_file(str(out / "optimizer.safetensors")).items() if k.startswith("state/")}}


def test_resume_is_exact(backbone, tmp_path):
    """10 steps, stop, --resume to 20 == 20 steps in one go, bit for bit (augmentation on, accumulation 2)."""
    data = make_dataset("seg", tmp_path / "data")
    common = ["--steps", 20, "--batch-size", 2, "--accumulate", 2, "--warmup", 3, "--save-every", 7]
    whole, split = tmp_path / "whole", tmp_path / "split"
    for out, extra in ((whole, []), (split, ["--stop-at", 10])):
        assert train.main([str(a) for a in ["seg", "--data", data, "-o", out, "--model", backbone, "--head",
                                            HEADS["seg"], "--workers", 0, "--no-progress", *common, *extra]]) == 0
    assert json.loads((split / "train_state.json").read_text())["step"] == 10
    assert train.main(["seg", "--data", str(data), "-o", str(split), "--resume", "--workers", "0", "--no-progress"]) == 0
    a, b = checkpoint_tensors(whole), checkpoint_tensors(split)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    last_loss = lambda out: [r["loss"] for r in read_log(out) if "loss" in r][-1]  # noqa: E731
    assert last_loss(whole) == last_loss(split)


def test_resume_refuses_changed_options(backbone, tmp_path, capsys):
    data = make_dataset("seg", tmp_path / "data", count=2)
    out = tmp_path / "run"
    assert run_train("seg", data, out, backbone, "--steps", 1, "--batch-size", 2) == 0
    with pytest.raises(SystemExit):
        train.main(["seg", "--data", str(data), "-o", str(out), "--resume", "--lr", "1"])
    assert "--lr cannot change" in capsys.readouterr().err


def torchrun(*args, processes=2):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", processes,
               str(ROOT / "train.py"), *args]
    result = subprocess.run([str(c) for c in command], capture_output=True, text=True, timeout=300,
                            env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.parametrize("engine", ["ddp", "fsdp"])
def test_two_processes_equal_one(engine, backbone, tmp_path):
    """The same global batch (4) and seed on 1 process and on 2 (gloo): the same weights and optimizer state."""
    data = make_dataset("seg", tmp_path / "data")
    common = ["seg", "--data", data, "--model", backbone, "--head", HEADS["seg"], "--workers", 0, "--no-progress",
              "--steps", 3, "--warmup", 1, "--lr", "1e-3"]
    assert train.main([str(a) for a in [*common, "-o", tmp_path / "one", "--batch-size", 4]]) == 0
    torchrun(*common, "-o", tmp_path / "two", "--batch-size", 2, *(["--fsdp"] if engine == "fsdp" else []))
    one, two = checkpoint_tensors(tmp_path / "one"), checkpoint_tensors(tmp_path / "two")
    assert one.keys() == two.keys()
    # A conv bias right before an InstanceNorm has a zero gradient in exact arithmetic; Adam turns its rounding
    # noise into +-lr steps, different on 1 and 2 processes, and without effect on the output: not compared.
    noise = [k for k in one if k.startswith("decode_head.conv_layers.") and "bias" in k]
    bad = {k: (two[k] - one[k]).abs().max().item() for k in one if k not in noise
           and not torch.allclose(two[k], one[k], atol=2e-5, rtol=1e-4)}
    assert not bad, bad
