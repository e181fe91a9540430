"""train.py and its sapiens2_app modules (datasets, augmentation, targets, metrics, ...) on tiny random
backbones and synthetic datasets whose labels are learnable: loss down and metric up when overfitting, checkpoints
that weights.load and predict.py read, exact resume, 1 process == 2 processes (gloo), augmentations that transform
the targets with the image."""

import gc
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from sapiens2 import heads
import predict
from sapiens2 import processing
import train
from sapiens2 import Sapiens2, Sapiens2Config, weights
from sapiens2_app.augment import pixel_augmentation, pose_augmentation
from sapiens2_app.train import (dataset_files, datasets, dense_metrics, distributed, pose_metrics, starting_model,
                                targets)

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
    """One person per image; its 17 keypoints always at the same places of its box, drawn as dots, each left/right
    pair mirrored about the box's centre line (so that a mirrored person is a person: the flip test agrees)."""
    pair = np.arange(1, 9).repeat(2)  # COCO's pairs (1, 2), (3, 4), ...: the nose, then left and right of each
    side = np.tile([-1, 1], 8)
    layout = np.stack([np.r_[0.5, 0.5 + 0.05 * pair * side], np.r_[0.1, 0.1 + 0.1 * pair]], 1)
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
    steps = 100 if task == "pose" else 30  # keypoints need more steps to localize than dense maps to fit
    assert run_train(task, data, out, backbone, "--steps", steps, "--lr", "3e-3", "--eval-every", steps,
                     "--log-every", 1, "--layer-decay", "1", "--clip-grad", "0") == 0
    log = read_log(out)
    losses = [r["loss"] for r in log if "loss" in r]
    assert len(losses) == steps and np.mean(losses[-5:]) < 0.8 * np.mean(losses[:3]), losses
    final = [r["eval"] for r in log if "eval" in r][-1]
    name, sign = dense_metrics.MAIN_METRIC[task] if task != "pose" else ("AP", 1)  # PCK@0.05: ~1 px here
    # the same metric of the untrained model (fresh head on the same backbone, seed 0)
    model = weights.load(out)
    info = datasets.dataset_info(task, data)
    val = datasets.build_dataset(task, data, "val", SIZE, False, info)
    dist_info = distributed.Distributed("cpu")
    args = train.build_parser().parse_args([task, "--data", str(data), "-o", str(out), "--batch-size", "4",
                                            "--workers", "0"])
    assert train.evaluate(model, val, args, info, dist_info)[name] == pytest.approx(final[name], rel=1e-4, abs=1e-6)
    start = train.build_parser().parse_args([task, "--data", str(data), "-o", str(out), "--model", str(backbone),
                                             "--head", HEADS[task]])
    fresh, _ = starting_model.build_model(start, info, log=lambda message: None)  # what training started from
    before = train.evaluate(fresh.eval(), val, args, info, dist_info)[name]
    assert sign * (final[name] - before) > 0, (before, final)
    assert isinstance(model, heads.TASK_MODELS[task]) and model.head_config.out_channels == info["out_channels"]
    if task != "pose":  # the checkpoint runs in predict.py (pose: test_pose_17_keypoints_train_and_predict)
        assert predict.main([task, str(data / "val" / "images" / "im0.png"), "-o", str(tmp_path / "pred"),
                             "--model", str(out), "--save", "raw"]) == 0
        assert len(list((tmp_path / "pred").glob("im0.*"))) >= 1


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
    info = datasets.dataset_info("pose", data)
    val = datasets.build_dataset("pose", data, "val", SIZE, False, info)
    person = val.people[0]
    sample = val[(0, 0)]
    image = processing.load_image(person["file"])
    expected = processing.preprocess_crops([image], [[person["bbox"]]], SIZE).pixel_values[0]  # uint8 levels
    torch.testing.assert_close(sample["pixel_values"], expected, atol=1e-4, rtol=0)
    heatmaps, weights_ = targets.pose_heatmap_targets([[person["bbox"]]], [[person["keypoints"].numpy()]], SIZE,
                                                      sigma=targets.heatmap_sigma((16, 12)))
    torch.testing.assert_close(sample["labels"], heatmaps[0], atol=1e-6, rtol=0)
    assert torch.equal(sample["label_weights"], weights_[0]) and sample["label_weights"][3] == 0
    batch = datasets.collate([val[(i, 0)] for i in range(len(val))])
    metric = pose_metrics.PoseEvaluation(info, val.people)
    metric.update(batch["labels"], batch, torch.ones(len(val)), range(len(val)))
    result = metric.result()
    assert (result["pck@0.05"], result["AP"]) == (pytest.approx(1.0), pytest.approx(1.0))


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
    assert train.main(["seg", "--data", str(data), "-o", str(split), "--resume", "--batch-size", "1",
                       "--no-progress"]) == 2  # a global batch of 1 x 2, not 2 x 2
    assert train.main(["seg", "--data", str(data), "-o", str(split), "--resume", "--workers", "0", "--no-progress"]) == 0
    a, b = checkpoint_tensors(whole), checkpoint_tensors(split)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    last_loss = lambda out: [r["loss"] for r in read_log(out) if "loss" in r][-1]  # noqa: E731
    assert last_loss(whole) == last_loss(split)
    assert not [p for out in (whole, split) for p in out.iterdir() if p.name.startswith(".")]  # no staging left


def test_checkpoint_files_get_the_umask_mode(backbone, tmp_path):
    """model.safetensors and optimizer.safetensors as readable as the run's other files (safetensors alone: 0600)."""
    data = make_dataset("seg", tmp_path / "data")
    old = os.umask(0o027)
    try:
        assert run_train("seg", data, tmp_path / "out", backbone, "--steps", 2) == 0
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "out").iterdir() if p.is_file()}
    assert {"model.safetensors", "optimizer.safetensors", "config.json"} <= set(modes)
    assert set(modes.values()) == {0o640}, modes


def test_resume_refuses_changed_options(backbone, tmp_path, capsys):
    data = make_dataset("seg", tmp_path / "data", count=2)
    out = tmp_path / "run"
    assert run_train("seg", data, out, backbone, "--steps", 1, "--batch-size", 2) == 0
    with pytest.raises(SystemExit):
        train.main(["seg", "--data", str(data), "-o", str(out), "--resume", "--lr", "1"])
    assert "--lr cannot change" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a new run does not overwrite an old one
        run_train("seg", data, out, backbone, "--steps", 1, "--batch-size", 2)
    assert "already holds a training run: --resume continues it" in capsys.readouterr().err


def torchrun(*args, processes=2):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", processes,
               str(ROOT / "train.py"), *args]
    result = subprocess.run([str(c) for c in command], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.fixture(scope="module")
def one_process_run(backbone, tmp_path_factory):
    """3 seg steps, global batch 4 on one process: what the 2-process runs must reproduce."""
    root = tmp_path_factory.mktemp("one_process")
    data = make_dataset("seg", root / "data")
    common = ["seg", "--data", data, "--model", backbone, "--head", HEADS["seg"], "--workers", 0, "--no-progress",
              "--steps", 3, "--warmup", 1, "--lr", "1e-3"]
    assert train.main([str(a) for a in [*common, "-o", root / "one", "--batch-size", 4]]) == 0
    return data, common, root / "one"


@pytest.mark.parametrize("engine", ["ddp", "fsdp"])
def test_two_processes_equal_one(engine, one_process_run, tmp_path):
    """The same global batch (4) and seed on 1 process and on 2 (gloo): the same weights and optimizer state.
    The FSDP run also recomputes activations (--checkpoint-activations), which must not change the numbers,
    and stops after step 2 and resumes (the sharded optimizer state goes through the files)."""
    data, common, one_out = one_process_run
    if engine == "ddp":
        torchrun(*common, "-o", tmp_path / "two", "--batch-size", 2)
    else:
        torchrun(*common, "-o", tmp_path / "two", "--batch-size", 2, "--fsdp", "--checkpoint-activations", "--stop-at", 2)
        torchrun("seg", "--data", data, "-o", tmp_path / "two", "--resume")
    one, two = checkpoint_tensors(one_out), checkpoint_tensors(tmp_path / "two")
    assert one.keys() == two.keys()
    # A conv bias right before an InstanceNorm has a zero gradient in exact arithmetic; Adam turns its rounding
    # noise into +-lr steps, different on 1 and 2 processes, and without effect on the output: not compared.
    noise = [k for k in one if k.startswith("decode_head.conv_layers.") and "bias" in k]
    bad = {k: (two[k] - one[k]).abs().max().item() for k in one if k not in noise
           and not torch.allclose(two[k], one[k], atol=2e-5, rtol=1e-4)}
    assert not bad, bad


def test_the_run_is_freed_before_its_process_group(one_process_run, tmp_path, monkeypatch):
    """When train.py leaves its process group, nothing of the run that holds the group is alive, not even in a
    reference cycle (torch keeps frames of the optimizer's construction): freed later, at interpreter shutdown,
    gloo's threads can abort a rank that has finished ("terminate called without an active exception"). One
    process in a gloo group, as torchrun --nproc-per-node 1 --fsdp makes it."""
    data, common, _ = one_process_run
    for name, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(free_port())), ("RANK", "0"),
                        ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(name, value)
    _, fsdp_module = distributed.fsdp2()
    alive_at_destroy = []
    destroy = torch.distributed.destroy_process_group

    def destroy_and_count(*args, **kwargs):
        # type(o), not isinstance: isinstance reads o.__class__, which some torch objects warn on
        alive_at_destroy.append(sum(issubclass(type(o), (train.Run, fsdp_module)) for o in gc.get_objects()))
        return destroy(*args, **kwargs)
    monkeypatch.setattr(torch.distributed, "destroy_process_group", destroy_and_count)
    assert train.main([str(a) for a in [*common, "-o", tmp_path / "fsdp", "--fsdp", "--steps", 2]]) == 0
    assert alive_at_destroy == [0] and not torch.distributed.is_initialized()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ----------------------------------------------------------------------------------------------------
# Augmentations move the targets with the image
# ----------------------------------------------------------------------------------------------------
SEEDS = range(12)


def test_pose_augmentation_moves_keypoints_and_swaps_left_right(tmp_path):
    """Flip, scale, rotation, shift, half-body: each channel's target peak, mapped back through the crop,
    lands on that channel's keypoint in the photo (after a flip: the mirrored keypoint of the other side),
    and the crop shows the keypoint's white dot there."""
    data = make_dataset("pose", tmp_path / "data", count=2, h=96, w=72)
    info = datasets.dataset_info("pose", data)
    train_set = datasets.build_dataset("pose", data, "train", (128, 96), True, info)
    order = dataset_files.flip_order(17, info["flip_pairs"])
    flips = 0
    for seed in SEEDS:
        sample = train_set[(0, seed)]
        person = train_set.people[0]["keypoints"]
        flips += int(sample["flipped"])
        expected = person[order] if sample["flipped"] else person
        assert torch.equal(sample["keypoints"], expected)
        peaks, _ = processing.decode_heatmaps(sample["labels"][None])
        scale = torch.tensor([95 / 23, 127 / 31])
        in_photo = processing.apply_affine(sample["to_source"], peaks[0] * scale)
        inner = (peaks[0] >= 1).all(-1) & (peaks[0][:, 0] <= 22) & (peaks[0][:, 1] <= 30)  # DARK is biased at edges
        seen = (sample["label_weights"] > 0) & inner
        assert seen.sum() >= 4  # a half-body crop (the lower half: 6 keypoints) or a zoom may leave some out
        torch.testing.assert_close(in_photo[seen], expected[seen, :2], atol=0.3, rtol=0)
        pixels = sample["pixel_values"] * torch.tensor(processing.IMAGENET_STD).view(3, 1, 1) * 255
        pixels = pixels + torch.tensor(processing.IMAGENET_MEAN).view(3, 1, 1) * 255
        draws = pose_augmentation.draw_pose(torch.Generator().manual_seed(seed), (128, 96))  # the sample's first draws
        if draws.blur or draws.median_blur:  # a one-pixel dot does not survive them
            continue
        white = torch.full((3, 1, 1), 255.0)
        white = pixel_augmentation.photometric_distortion(white, draws.photometric) if draws.photometric else white
        hole_x, hole_y, hole_w, hole_h = draws.hole
        for x, y in (peaks[0][seen] * scale).round().long().tolist():
            if hole_x - 3 <= x < hole_x + hole_w + 3 and hole_y - 3 <= y < hole_y + hole_h + 3:
                continue  # (near) the coarse dropout's hole
            dot = pixels[:, max(y - 3, 0) : y + 4, max(x - 3, 0) : x + 4].amax()
            assert dot > 0.6 * white.amax()  # the dot, jittered
    assert 0 < flips < len(SEEDS)


@pytest.mark.parametrize("task", ["albedo", "seg"])
def test_dense_inputs_match_predict_preprocessing(task, tmp_path):
    """Without augmentation a dense sample's pixels are predict.py's (antialiased resize; padded to the
    network's aspect for normal/pointmap/albedo, stretched for seg/matting), here for a photo twice the
    network size and for one of another aspect."""
    data = make_dataset(task, tmp_path / "data", count=1, h=128, w=96)
    v, u = np.mgrid[0:70, 0:150]  # smooth: the two paddings may differ by a sub-pixel shift (predict.py rounds)
    wide = np.stack([u * 1.6, v * 3.0, 255 - u * 1.6], -1).astype(np.uint8)
    save_png(data / "train" / "images" / "wide.png", wide)
    save_png(data / "train" / dataset_files.TARGET_FOLDERS[task] / "wide.png", wide if task == "albedo" else wide[..., 0] % 3)
    info = datasets.dataset_info(task, data)
    dataset = datasets.build_dataset(task, data, "train", SIZE, False, info)
    for index, name in enumerate(dataset.names):
        image = processing.load_image(dataset.images[name])
        expected = processing.preprocess([image], SIZE, pad=task == "albedo", resample="hf").pixel_values[0]
        sample = dataset[(index, 0)]
        valid = sample["mask"][0] > 0 if task == "albedo" else torch.ones(SIZE, dtype=torch.bool)  # not the padding
        torch.testing.assert_close(sample["pixel_values"][:, valid], expected[:, valid], atol=0.05, rtol=0, msg=name)  # edge rows: 22 vs 22.4
        assert valid.float().mean() > (0.99 if name == "im0" or task == "seg" else 0.3)


def dense_augmented(task, tmp_path, classes=None):
    data = make_dataset(task, tmp_path / "data", count=1)
    if classes:
        (data / "classes.json").write_text(json.dumps(classes))
    info = datasets.dataset_info(task, data)
    dataset = datasets.build_dataset(task, data, "train", SIZE, True, info)
    return [dataset[(0, seed)] for seed in SEEDS]


def red_and_blue(sample):
    r, _, b = sample["pixel_values"]
    return (r > b + 1.5), (b > r + 1.5)


def test_normal_flip_negates_x(tmp_path):
    flips = 0
    for sample in dense_augmented("normal", tmp_path):
        red, blue = red_and_blue(sample)
        sign = -1 if sample["flipped"] else 1
        flips += int(sample["flipped"])
        for region, x in ((red, 0.6), (blue, -0.6)):
            if region.sum() > 20:  # most of the region (nearest vs bilinear edges aside) has its normal
                assert (sample["labels"][0][region] - sign * x).abs().lt(1e-3).float().mean() > 0.8
    assert 0 < flips < len(SEEDS)


def test_seg_flip_swaps_left_and_right_classes(tmp_path):
    for sample in dense_augmented("seg", tmp_path, classes=["background", "L_Arm", "R_Arm"]):
        red, _ = red_and_blue(sample)
        if red.sum() > 20:
            wanted = 2 if sample["flipped"] else 1
            assert (sample["labels"][red] == wanted).float().mean() > 0.8


def test_pointmap_augmentation_keeps_the_camera_consistent(tmp_path):
    """The canonical target is the back-projection of its own Z with the augmented intrinsics (flip, crop,
    scale), to within the one source pixel that nearest resampling may pick."""
    for sample in dense_augmented("pointmap", tmp_path):
        K, points, valid = sample["intrinsics"], sample["labels"], sample["mask"][0] > 0
        v, u = torch.meshgrid(torch.arange(64.0), torch.arange(48.0), indexing="ij")
        u_of_point = K[0, 0] * points[0] / points[2].clamp(min=1e-6) + K[0, 2]
        v_of_point = K[1, 1] * points[1] / points[2].clamp(min=1e-6) + K[1, 2]
        pixel = max(K[0, 0].item() / 500, 1.0)  # network pixels per source pixel
        assert (u_of_point - u)[valid].abs().max() <= pixel and (v_of_point - v)[valid].abs().max() <= pixel
        torch.testing.assert_close(sample["scales"], heads.CANONICAL_FOCAL / K[0, 0:1])


# ----------------------------------------------------------------------------------------------------
# The model: new or continued head, frozen backbone (the recipe: test_train_recipe.py); bad data named
# ----------------------------------------------------------------------------------------------------
def test_new_head_then_continued_head_and_frozen_backbone(backbone, tmp_path, capsys):
    data = make_dataset("seg", tmp_path / "data", count=2)
    first, second = tmp_path / "first", tmp_path / "second"
    assert run_train("seg", data, first, backbone, "--steps", 1, "--batch-size", 2) == 0
    assert "new seg head with 3 outputs: the checkpoint is a pretrain backbone" in capsys.readouterr().err
    before = weights.load(first)
    args = ["seg", "--data", data, "-o", second, "--model", first, "--workers", 0, "--batch-size", 2, "--steps", 2,
            "--freeze-backbone"]
    assert train.main([str(a) for a in args]) == 0
    err = capsys.readouterr().err
    assert "continuing the checkpoint's seg head (3 outputs)" in err and "2/2 steps" in err
    after = weights.load(second)
    for (name, a), b in zip(before.state_dict().items(), after.state_dict().values()):
        assert torch.equal(a, b) == name.startswith("backbone."), name
    (data / "classes.json").write_text(json.dumps(["background", "red", "blue", "green"]))
    assert train.main([str(a) for a in [*args[:4], tmp_path / "third", *args[5:]]]) == 0
    assert "new seg head with 4 outputs: the checkpoint's head has 3 outputs, the data 4" in capsys.readouterr().err


@pytest.mark.parametrize("task, damage, message", [
    ("seg", lambda d: (d / "train/masks/im1.png").unlink(), "missing masks file .*im1.png"),
    ("seg", lambda d: save_png(d / "train/masks/im0.png", np.full((64, 48), 7, np.uint8)),
     "im0.png: class id 7 but classes.json lists 3 classes"),
    ("seg", lambda d: save_png(d / "train/masks/im0.png", np.zeros((10, 10), np.uint8)),
     "masks/im0.png: size 10x10, but .*im0.png is 64x48"),
    ("normal", lambda d: np.save(d / "train/normals/im0.npy", np.zeros((5, 5, 3))),
     "normals/im0.npy: shape \\(5, 5, 3\\), expected \\(64, 48, 3\\)"),
    ("pose", lambda d: (d / "train/annotations.json").write_text(json.dumps({**json.loads(
        (d / "train/annotations.json").read_text()), "annotations": [{"id": 9, "image_id": 0, "bbox": [0, 0, 5, 5],
                                                                       "keypoints": [1, 1, 2] * 5}]})),
     "annotation id 9: 5 keypoints .* categories\\[0\\] lists 17 keypoint names"),
    ("matting", lambda d: (d / "train/alphas").rename(d / "train/alpha"), "alphas: no such folder"),
])
def test_bad_data_is_named(task, damage, message, backbone, tmp_path, capsys):
    data = make_dataset(task, tmp_path / "data", count=2)
    damage(data)
    code = run_train(task, data, tmp_path / "run", backbone, "--steps", 1, "--batch-size", 2)
    err = capsys.readouterr().err
    if code == 0:  # problems inside a file surface when it is read: the first step
        pytest.fail(f"no error for {message}")
    assert code == 2 and re.search(message, err), err


def test_pointmap_size_continues_the_head_its_scale_branch_takes(backbone, tmp_path, capsys):
    """--size for a pointmap checkpoint: the head continues where its scale branch takes that size
    (heads.scale_branch_fits: 48-64 x 48-64 for this one, trained at 64x48); elsewhere a new head, whose scale
    MLP is as wide as the new size needs (it kept the checkpoint's width and failed in the first forward)."""
    data = make_dataset("pointmap", tmp_path / "data", count=2)
    assert run_train("pointmap", data, tmp_path / "first", backbone, "--steps", 1, "--batch-size", 2) == 0
    common = ["pointmap", "--data", data, "--model", tmp_path / "first", "--workers", 0, "--batch-size", 2,
              "--steps", 1, "--no-progress"]
    capsys.readouterr()
    assert train.main([str(a) for a in [*common, "-o", tmp_path / "square", "--size", "64x64"]]) == 0
    assert "continuing the checkpoint's pointmap head (3 outputs)" in capsys.readouterr().err
    assert train.main([str(a) for a in [*common, "-o", tmp_path / "tall", "--size", "96x48"]]) == 0
    assert ("new pointmap head with 3 outputs: the pointmap scale branch is tied to the image size (64, 48)"
            in capsys.readouterr().err)
    assert weights.load(tmp_path / "tall").config.image_size == (96, 48)


def test_a_bad_keypoint_set_is_not_called_invalid_json(backbone, tmp_path, capsys):
    """Valid JSON without the keypoint names: the one error line says what is missing (it used to be wrapped
    in "not valid JSON (...)", since the JSON check caught the keypoint set's own error too)."""
    data = make_dataset("pose", tmp_path / "data", count=2)
    path = data / "train" / "annotations.json"
    coco = json.loads(path.read_text())
    del coco["categories"][0]["keypoints"]
    path.write_text(json.dumps(coco))
    assert run_train("pose", data, tmp_path / "run", backbone, "--steps", 1, "--batch-size", 2) == 2
    err = capsys.readouterr().err
    assert err == f"error: {path}: categories[0].keypoints (the keypoint names) is missing\n", err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU tier: needs CUDA")
def test_bf16_autocast_training_on_cuda(backbone, tmp_path):
    """bf16 autocast by default on CUDA; the weights and the optimizer state stay fp32."""
    data = make_dataset("seg", tmp_path / "data")
    out = tmp_path / "run"
    assert run_train("seg", data, out, backbone, "--steps", 5, "--device", "cuda", "--log-every", 1) == 0
    assert all(np.isfinite(r["loss"]) for r in read_log(out) if "loss" in r)
    assert {t.dtype for t in checkpoint_tensors(out).values() if t.is_floating_point()} == {torch.float32}


def test_ctrl_c_saves_the_step_and_resume_continues(backbone, tmp_path):
    """SIGINT: the step finishes, a checkpoint is written, exit 130; --resume goes on from there."""
    data = make_dataset("seg", tmp_path / "data", count=2)
    out = tmp_path / "run"
    command = [sys.executable, str(ROOT / "train.py"), "seg", "--data", data, "-o", out, "--model", backbone, "--head",
               HEADS["seg"], "--workers", 1, "--batch-size", 2, "--steps", 100000, "--log-every", 1, "--no-progress"]
    process = subprocess.Popen([str(c) for c in command], stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.time() + 120
    while not ((out / "log.jsonl").exists() and '"loss"' in (out / "log.jsonl").read_text()):
        assert process.poll() is None and time.time() < deadline, process.stderr.read() if process.poll() else "slow"
        time.sleep(0.2)
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=120) == 130, process.stderr.read()
    step = json.loads((out / "train_state.json").read_text())["step"]
    assert 1 <= step < 100000 and "stopped at step" in process.stderr.read()
    assert train.main(["seg", "--data", str(data), "-o", str(out), "--resume", "--steps", str(step + 1),
                       "--workers", "0", "--no-progress"]) == 0
    assert json.loads((out / "train_state.json").read_text())["step"] == step + 1


# ----------------------------------------------------------------------------------------------------
# A default head for any backbone size; hints that work
# ----------------------------------------------------------------------------------------------------
TINY_CONFIG = dict(full_attention_first=1, full_attention_last=1, image_size=SIZE)  # as tiny_backbone's


def test_default_head_is_the_released_one_or_scaled_from_it():
    """Released sizes get exactly their released head; 0.1b (no released head) the 0.4b head's widths x 768/1024,
    rounded to multiples of 8; with as many upsampling layers as check_output_resolution asks, for any patch size."""
    from sapiens2 import PRESETS

    for task, sizes in heads.HEAD_TABLE.items():
        for size in sizes:
            assert heads.default_head(task, PRESETS[size]) == heads.head_preset(task, size), (task, size)
    normal_widths = heads.HEAD_TABLE["normal"]["0.4b"]
    assert heads.default_head("matting", PRESETS["0.4b"]) == heads.HeadConfig("matting", *normal_widths, 4)
    seg = heads.default_head("seg", PRESETS["0.1b"], out_channels=3)
    assert (seg.upsample_channels, seg.conv_channels, seg.out_channels) == ((384, 192, 96, 48), (48, 48), 3)
    pose = heads.default_head("pose", PRESETS["0.1b"])
    assert (pose.upsample_channels, pose.conv_channels) == ((768, 576), (384, 384, 192))
    assert heads.default_head("seg", PRESETS["5b"]).upsample_channels == (512, 256, 128, 64)  # never widened
    for patch, layers in ((16, {"pose": 2, "seg": 4}), (8, {"pose": 1, "seg": 3}), (32, {"pose": 3, "seg": 5})):
        config = Sapiens2Config(32, 2, 2, patch_size=patch, **TINY_CONFIG)
        for task, count in layers.items():
            head = heads.default_head(task, config, 3)
            assert len(head.upsample_channels) == count and min(head.upsample_channels + head.conv_channels) >= 8
            starting_model.check_output_resolution(head, config, "default")  # accepted


@pytest.mark.parametrize("task", ["seg", "pose", "normal"])
def test_0_1b_and_custom_backbones_train_without_head(task, tmp_path, capsys):
    """No --head: 0.1b (no released head; its head is chosen and checked, not trained: 114M parameters) and a
    custom size (trained 2 steps) get the default head instead of an error."""
    from sapiens2 import PRESETS

    data = make_dataset(task, tmp_path / "data", count=2)
    info = datasets.dataset_info(task, data)
    head = starting_model.new_head_config(task, info["out_channels"], PRESETS["0.1b"], None, None)
    assert head == heads.default_head(task, PRESETS["0.1b"], info["out_channels"])
    starting_model.check_output_resolution(head, PRESETS["0.1b"], "0.1b")  # accepted
    torch.manual_seed(0)
    custom = weights.save(Sapiens2(Sapiens2Config(40, 2, 2, **TINY_CONFIG)), tmp_path / "custom.safetensors")
    out = tmp_path / "run"
    argv = [task, "--data", data, "-o", out, "--model", custom, "--workers", 0, "--steps", 2, "--batch-size", 2,
            "--no-progress"]
    assert train.main([str(a) for a in argv]) == 0
    trained = weights.load(out, task=task)
    assert trained.head_config.upsample_channels == heads.default_head(task, trained.backbone.config).upsample_channels
    assert f"new {task} head with {info['out_channels']} outputs" in capsys.readouterr().err


@pytest.mark.parametrize("task", ["seg", "pose"])
def test_hint_for_a_head_with_too_few_upsampling_layers_is_accepted(task, backbone, tmp_path, capsys):
    """A checkpoint whose head stops short of the targets' resolution is refused with a --head hint; that very
    hint trains."""
    data = make_dataset(task, tmp_path / "data", count=2)
    # patch 16: pose needs 2 upsampling layers, seg 4
    short_head = heads.HeadConfig("pose", (8,), (8,), 17) if task == "pose" else heads.HeadConfig("seg", (8, 8), (8,), 3)
    short = heads.build_task_model(weights.load(backbone).config, short_head)
    checkpoint = weights.save(short, tmp_path / "short.safetensors")
    common = [task, "--data", data, "--model", checkpoint, "--workers", 0, "--steps", 1, "--batch-size", 2,
              "--no-progress"]
    assert train.main([str(a) for a in [*common, "-o", tmp_path / "refused"]]) == 2
    err = capsys.readouterr().err
    hint = re.search(r"e\.g\. --head (\S+)", err)
    assert err.startswith("error: ") and hint, err
    assert train.main([str(a) for a in [*common, "-o", tmp_path / "hinted", "--head", hint[1]]]) == 0
    assert list(weights.load(tmp_path / "hinted").head_config.upsample_channels) == train.parse_head(hint[1])[0]


# ----------------------------------------------------------------------------------------------------
# Errors found by data workers; resuming with the same command line; one-line usage errors
# ----------------------------------------------------------------------------------------------------
def test_bad_label_found_by_a_worker_stops_with_one_line(backbone, tmp_path):
    """A class id the set does not have, met by one of 2 DataLoader workers on --resume: one `error:` line
    naming the file, exit 2, no hang (the workers ignore SIGTERM; a hang fails here by the timeout), the earlier
    checkpoint untouched."""
    data = make_dataset("seg", tmp_path / "data", count=4)
    out = tmp_path / "run"
    assert run_train("seg", data, out, backbone, "--steps", 1) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    save_png(data / "train/masks/im2.png", np.full((64, 48), 7, np.uint8))  # every step has all 4 samples
    command = [sys.executable, str(ROOT / "train.py"), "seg", "--data", data, "-o", out, "--resume", "--steps", 3,
               "--workers", 2, "--no-progress"]
    result = subprocess.run([str(c) for c in command], capture_output=True, text=True, timeout=90,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    errors = [line for line in result.stderr.splitlines() if line.startswith("error")]
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert errors == [f"error: {data / 'train/masks/im2.png'}: class id 7 but classes.json lists 3 classes "
                      "(ids 0..2, 255 = ignore)"], result.stderr
    after = {p.name: p.read_bytes() for p in out.iterdir() if p.name != "log.jsonl"}
    assert after == {k: v for k, v in before.items() if k != "log.jsonl"}  # (log.jsonl gains the start record)


def test_resume_with_the_same_command_line(backbone, tmp_path, capsys):
    """--resume with the first run's own options, --size, --head and the rest: the same values are no change."""
    data = make_dataset("seg", tmp_path / "data", count=2)
    out = tmp_path / "run"
    first = ["seg", "--data", data, "-o", out, "--model", backbone, "--head", HEADS["seg"], "--size", "64x48",
             "--lr", "2e-4", "--min-lr", "1e-6", "--warmup", 1, "--weight-decay", "0.05", "--layer-decay", "0.9",
             "--clip-grad", "0.5", "--precision", "fp32", "--seed", 3, "--no-augment", "--freeze-backbone",
             "--workers", 0, "--batch-size", 2, "--no-progress"]
    first = [str(a) for a in first]
    assert train.main([*first, "--steps", "2", "--stop-at", "1"]) == 0
    assert train.main([*first, "--steps", "2", "--resume"]) == 0
    assert json.loads((out / "train_state.json").read_text())["step"] == 2
    with pytest.raises(SystemExit):  # a real change is still refused
        train.main([*first, "--steps", "3", "--resume", "--size", "32x48"])
    assert "--size cannot change" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["train", "export"])
def test_unknown_task_is_one_line(command, capsys):
    module = train if command == "train" else __import__("export")
    with pytest.raises(SystemExit) as exit_info:
        module.main(["segmentation", "--data", "d", "-o", "out"] if command == "train" else ["segmentation", "-o", "x.onnx"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and err.startswith("error: "), err
    tasks = heads.TASKS if command == "train" else (*heads.TASKS, "features")
    choices = re.search(r"invalid choice: '?segmentation'? \(choose from ([^)]*)\)", err)
    assert choices and sorted(re.findall(r"\w+", choices[1])) == sorted(tasks), err


# ----------------------------------------------------------------------------------------------------
# --random-init: offline runs without a checkpoint, which say their weights are random
# ----------------------------------------------------------------------------------------------------
@pytest.fixture
def tiny_preset(monkeypatch):
    """A backbone preset as small as the tests' (the released sizes take seconds per step on a CPU)."""
    import sapiens2

    monkeypatch.setitem(sapiens2.PRESETS, "tiny", Sapiens2Config(32, 2, 2, **TINY_CONFIG))
    return "tiny"


def test_random_init_always_trains_offline_and_says_so(tiny_preset, tmp_path, capsys):
    data = make_dataset("seg", tmp_path / "data", count=2)
    out = tmp_path / "run"
    argv = ["seg", "--data", data, "-o", out, "--model", "0.4b", "--random-init", "always", "--random-backbone",
            tiny_preset, "--workers", 0, "--steps", 2, "--batch-size", 2, "--no-progress"]
    assert train.main([str(a) for a in argv]) == 0
    err = capsys.readouterr().err
    assert err.count("RANDOM WEIGHTS for seg") == 2 and "random weights (--random-init)" in err  # before and after
    assert read_log(out)[0]["random_weights"] is True
    assert json.loads((out / "config.json").read_text())["sapiens2_training"]["random_start"] is True
    assert weights.load(out).backbone.config.embed_dim == 32
    assert train.main([str(a) for a in [*argv, "--resume", "--steps", 3]]) == 0  # its own checkpoint now
    assert "RANDOM WEIGHTS" not in capsys.readouterr().err
    assert json.loads((out / "config.json").read_text())["sapiens2_training"]["random_start"] is True


def test_random_init_fallback_only_for_downloads(tiny_preset, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # (HF_HUB_OFFLINE is set for every test: conftest)
    data = make_dataset("seg", tmp_path / "data", count=2)
    common = ["seg", "--data", str(data), "--workers", "0", "--steps", "1", "--batch-size", "2", "--no-progress",
              "--random-backbone", tiny_preset]
    assert train.main([*common, "-o", str(tmp_path / "never"), "--model", "0.4b"]) == 2
    assert "error: --model 0.4b: " in capsys.readouterr().err and not (tmp_path / "never").exists()
    assert train.main([*common, "-o", str(tmp_path / "typo"), "--model", str(tmp_path / "nope.safetensors"),
                       "--random-init", "fallback"]) == 2  # a local path is never replaced by random weights
    assert "nope.safetensors" in capsys.readouterr().err
    assert train.main([*common, "-o", str(tmp_path / "fallback"), "--model", "0.4b", "--random-init", "fallback"]) == 0
    err = capsys.readouterr().err
    assert "cannot load 0.4b" in err and "RANDOM WEIGHTS for seg" in err
    assert any("cannot load 0.4b" in note for note in read_log(tmp_path / "fallback")[0]["notes"])
