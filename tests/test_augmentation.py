"""Training augmentations and sample rules against the original's (facebookresearch/sapiens2).

The original's transforms need its registry, albumentations and scipy, so their math is copied here (each block
cites its file and line at commit 3098c14) and run with numpy and cv2 on the same random draws as ours: the draws
are injected (pose_augmentation.py and dense_augmentation.py draw every random number in one function and apply
them in others), so both implementations see identical choices. Tolerances: geometry in float32 (the original's
warp matrix is float32) 1e-4 px; pixels: exact where both compute on integers, else within 1 grey level (the
reason is given at each).
"""

import json
import math
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch
from PIL import Image

from sapiens2 import processing
from sapiens2_app.augment import dense_augmentation, pixel_augmentation, pose_augmentation
from sapiens2_app.train import datasets, pose_dataset, targets
from sapiens2_app.train.dataset_files import TARGET_FOLDERS
from sapiens2_app.augment.random_draws import Photometric
from sapiens2_app.augment.pose_augmentation import PoseDraws

SIZE = (64, 48)  # network (H, W)


# ----------------------------------------------------------------------------------------------------
# The original's math (numpy + cv2), draws passed in instead of drawn
# ----------------------------------------------------------------------------------------------------
def original_pose_geometry(bbox_xyxy, keypoints, visible, img_w, flip_indices, upper_ids, lower_ids, rands, size):
    """rands: the values the original draws, in its order: flip (np.random.rand), half-body try and upper
    preference (np.random.rand, drawn only with >= 9 visible), shift (truncnorm x2, rand), scale (truncnorm),
    rotation (truncnorm, rand). Returns (center, scale after the aspect fix, warp_mat, keypoints, visible)."""
    # PoseGetBBoxCenterScale, pose_transforms.py:210 -> bbox_xyxy2cs, bbox_transforms.py:38-40 (padding 1.25)
    x1, y1, x2, y2 = np.hsplit(np.asarray(bbox_xyxy, np.float32)[None], [1, 2, 3])
    center = np.hstack([x1 + x2, y1 + y2]) * 0.5
    scale = np.hstack([x2 - x1, y2 - y1]) * 1.25
    keypoints, visible = keypoints[None].copy(), visible[None].copy()  # (1, K, 2), (1, K)
    # PoseRandomFlip.transform, pose_transforms.py:312 (flip unless rand > 0.5), 260, 296-303
    if not rands["flip"] > 0.5:
        center[..., 0] = img_w - center[..., 0] - 1
        keypoints, visible = keypoints[..., flip_indices, :], visible[..., flip_indices]
        keypoints[..., 0] = img_w - 1 - keypoints[..., 0]
    # PoseRandomHalfBody._random_select_half_body, pose_transforms.py:402-425 (defaults 9, 2, 3, 1.5, 0.3, 0.7)
    v = visible[0]
    indices = None
    if v.sum() >= 9 and not rands["half_body"] > 0.3:
        upper = [i for i in upper_ids if v[i] > 0]
        lower = [i for i in lower_ids if v[i] > 0]
        prefer_upper = rands["upper"] < 0.7
        if len(upper) < 2 and len(lower) < 3:
            indices = None
        elif len(lower) < 3:
            indices = upper
        elif len(upper) < 2:
            indices = lower
        else:
            indices = upper if prefer_upper else lower
    if indices is not None:  # _get_half_body_bbox, pose_transforms.py:385-392
        selected = keypoints[0][indices]
        c = selected.mean(axis=0)[:2]
        (sx1, sy1), (sx2, sy2) = selected.min(axis=0), selected.max(axis=0)
        center, scale = np.stack([c]), np.stack([np.array([sx2 - sx1, sy2 - sy1], dtype=c.dtype) * 1.5])
    # PoseRandomBBoxTransform._get_transform_params + transform, pose_transforms.py:496-520
    offset = np.asarray(rands["shift_tn"], np.float32)[None] * 0.16
    offset = np.where(np.array([[rands["shift"]]]) < 0.3, offset, 0.0)
    s = np.float32(rands["scale_tn"]) * 0.5 + 1.0
    rotate = np.float32(rands["rot_tn"]) * 80.0 if rands["rot"] < 0.6 else 0.0
    center = center + offset * scale
    scale = scale * s
    # PoseTopdownAffine._fix_aspect_ratio + transform, pose_transforms.py:113-175
    w_out, h_out = size[1], size[0]
    w, h = np.hsplit(scale, [1])
    aspect = w_out / h_out
    scale = np.where(w > h * aspect, np.hstack([w, w / aspect]), np.hstack([h * aspect, h]))
    warp_mat = original_udp_warp_matrix(center[0], scale[0], rotate, (w_out, h_out))
    transformed = cv2.transform(keypoints.astype(np.float32), warp_mat)
    out = (transformed[..., 0] < 0) | (transformed[..., 0] >= w_out) | (transformed[..., 1] < 0) | (
        transformed[..., 1] >= h_out)
    visible = visible.copy()
    visible[out] = 0
    return center[0], scale[0], warp_mat, transformed[0], visible[0]


def original_udp_warp_matrix(center, scale, rot, output_size):
    """get_udp_warp_matrix, bbox_transforms.py:108-137."""
    input_size = center * 2
    rot_rad = np.deg2rad(rot)
    warp_mat = np.zeros((2, 3), dtype=np.float32)
    scale_x = (output_size[0] - 1) / scale[0]
    scale_y = (output_size[1] - 1) / scale[1]
    warp_mat[0, 0] = math.cos(rot_rad) * scale_x
    warp_mat[0, 1] = -math.sin(rot_rad) * scale_x
    warp_mat[0, 2] = scale_x * (-0.5 * input_size[0] * math.cos(rot_rad) + 0.5 * input_size[1] * math.sin(rot_rad)
                                + 0.5 * scale[0])
    warp_mat[1, 0] = math.sin(rot_rad) * scale_y
    warp_mat[1, 1] = math.cos(rot_rad) * scale_y
    warp_mat[1, 2] = scale_y * (-0.5 * input_size[0] * math.sin(rot_rad) - 0.5 * input_size[1] * math.cos(rot_rad)
                                + 0.5 * scale[1])
    return warp_mat


def original_warp(image_bgr, warp_mat, size, flipped):
    """PoseRandomFlip (cv2.flip, pose_transforms.py:322) then PoseTopdownAffine's cv2.warpAffine (149-158)."""
    image = cv2.flip(image_bgr, 1) if flipped else image_bgr
    scale_factor = min(np.linalg.norm(warp_mat[0, :2]), np.linalg.norm(warp_mat[1, :2]))
    interp = cv2.INTER_AREA if scale_factor < 1.0 else cv2.INTER_CUBIC
    return cv2.warpAffine(image, warp_mat, (size[1], size[0]), flags=interp)


def original_photometric(img, d: Photometric):
    """PhotoMetricDistortion.transform on a BGR uint8 image, common_transforms.py:85-146, its random.randint(0, 1)
    and random.uniform/randint values taken from `d` (a part that is None is skipped)."""
    def convert(img, alpha=1, beta=0):
        img = img.astype(np.float32) * alpha + beta
        return np.clip(img, 0, 255).astype(np.uint8)
    if d.brightness is not None:
        img = convert(img, beta=d.brightness)
    if d.contrast_first and d.contrast is not None:
        img = convert(img, alpha=d.contrast)
    if d.saturation is not None:
        img = cv2.cvtColor(img, cv2.COLOR_BGR2HSV)
        img[:, :, 1] = convert(img[:, :, 1], alpha=d.saturation)
        img = cv2.cvtColor(img, cv2.COLOR_HSV2BGR)
    if d.hue is not None:
        img = cv2.cvtColor(img, cv2.COLOR_BGR2HSV)
        img[:, :, 0] = (img[:, :, 0].astype(int) + d.hue) % 180
        img = cv2.cvtColor(img, cv2.COLOR_HSV2BGR)
    if not d.contrast_first and d.contrast is not None:
        img = convert(img, alpha=d.contrast)
    return img


def smooth_image(rng, h, w):
    """uint8 (h, w, 3) whose values change by < 16 grey levels per pixel (see test_pose_crop_pixels)."""
    y, x = np.mgrid[0:h, 0:w].astype(np.float64)
    channels = [127 + 60 * np.sin(x / rng.uniform(6, 10) + rng.uniform(0, 6)) + 60 * np.cos(y / rng.uniform(6, 10))
                for _ in range(3)]
    return np.clip(np.stack(channels, -1), 0, 255).round().astype(np.uint8)


def to_tensor(image_hwc) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(image_hwc)).permute(2, 0, 1).float()


COCO_FLIP = [0, 2, 1, 4, 3, 6, 5, 8, 7, 10, 9, 12, 11, 14, 13, 16, 15]


def random_person(rng, img_h, img_w):
    """A COCO-17 person: box, keypoints (17, 2) inside it, visibility (some invisible)."""
    x0, y0 = rng.uniform(-10, img_w * 0.5), rng.uniform(-10, img_h * 0.5)
    bw, bh = rng.uniform(15, img_w * 0.7), rng.uniform(25, img_h * 0.9)
    keypoints = np.stack([rng.uniform(x0, x0 + bw, 17), np.sort(rng.uniform(y0, y0 + bh, 17))], 1).astype(np.float32)
    visible = (rng.uniform(size=17) > rng.choice([0.1, 0.3, 0.6])).astype(np.float32)
    return [x0, y0, bw, bh], keypoints, visible


def random_rands(rng) -> dict:
    return {"flip": rng.uniform(), "half_body": rng.uniform() * 0.6, "upper": rng.uniform(),
            "shift_tn": rng.uniform(-1, 1, 2), "shift": rng.uniform() * 0.6, "scale_tn": rng.uniform(-1, 1),
            "rot_tn": rng.uniform(-1, 1), "rot": rng.uniform()}


def draws_of(rands: dict, **pixels) -> PoseDraws:
    """Our PoseDraws for the original's draws (the mapping of draw_pose, whose sampling is tested apart)."""
    shift = tuple(float(v) * 0.16 for v in rands["shift_tn"]) if rands["shift"] < 0.3 else (0.0, 0.0)
    rotation = float(np.float32(rands["rot_tn"]) * 80.0) if rands["rot"] < 0.6 else 0.0
    return PoseDraws(flip=rands["flip"] <= 0.5, half_body=rands["half_body"] <= 0.3, prefer_upper=rands["upper"] < 0.7,
                     shift=shift, scale=float(rands["scale_tn"]) * 0.5 + 1.0, rotation=rotation, **pixels)


# ----------------------------------------------------------------------------------------------------
# Pose geometry and pixels
# ----------------------------------------------------------------------------------------------------
def test_pose_crop_geometry_is_the_originals():
    """Box (clipped), flip, half body, shift, scale, rotation, aspect and UDP matrix on 200 random people and draws:
    our affine map is the original's warp matrix (with its flip), the keypoints land where it puts them, and the
    same keypoints stay visible."""
    rng = np.random.default_rng(0)
    upper, lower = pose_dataset.body_halves(list(processing.coco17_names()))
    assert (upper, lower) == (list(range(11)), list(range(11, 17)))
    half_bodies = flips = 0
    for _ in range(200):
        img_h, img_w = int(rng.integers(60, 200)), int(rng.integers(60, 200))
        bbox, keypoints, visible = random_person(rng, img_h, img_w)
        rands = random_rands(rng)
        box = pose_augmentation.clip_box(bbox, (img_h, img_w))
        x, y, w, h = bbox  # pose_base_dataset.py:158-162
        expected_box = [np.clip(x, 0, img_w - 1), np.clip(y, 0, img_h - 1), np.clip(x + w, 0, img_w - 1),
                        np.clip(y + h, 0, img_h - 1)]
        np.testing.assert_allclose(box.numpy(), expected_box, atol=1e-9)
        if box[2] <= box[0] or box[3] <= box[1]:
            continue
        center, scale, warp_mat, points, vis = original_pose_geometry(
            box.numpy(), keypoints, visible, img_w, COCO_FLIP, upper, lower, rands, SIZE)
        draws = draws_of(rands)
        crop = pose_augmentation.pose_crop(box, torch.from_numpy(np.concatenate([keypoints, visible[:, None]], 1)),
                                           img_w, SIZE, draws, COCO_FLIP, (upper, lower))
        # the original's matrix maps the (flipped) image to the crop; ours maps the crop to the unflipped image
        mirror = np.array([[-1.0, 0, img_w - 1], [0, 1, 0], [0, 0, 1]]) if draws.flip else np.eye(3)
        ours = np.linalg.inv(crop.to_source.double().numpy()) @ mirror
        scale_of_crop = max(1.0, float(np.abs(warp_mat[:, :2]).max()))
        np.testing.assert_allclose(ours[:2], warp_mat, atol=1e-4 * scale_of_crop, rtol=1e-5)
        np.testing.assert_allclose(crop.points.numpy(), points, atol=1e-4 * max(1.0, float(np.abs(points).max()) / 100))
        assert crop.visible.tolist() == (vis > 0).tolist()
        assert crop.order.tolist() == (COCO_FLIP if draws.flip else list(range(17)))
        half_bodies += int(visible.sum() >= 9 and draws.half_body)
        flips += int(draws.flip)
    assert half_bodies > 20 and 60 < flips < 140  # both paths exercised


def test_pose_crop_pixels_are_the_originals_warp():
    """The crop's pixels against cv2.warpAffine on the (flipped) image, bilinear (a shrinking crop: INTER_AREA,
    which warpAffine runs as INTER_LINEAR) and bicubic (an enlarging one). Within 1 grey level: OpenCV rounds the
    source coordinates to 1/32 pixel and its weights to 15 bits; on an image changing by < 16 levels per pixel that
    moves a value by < 0.5 level, so rounding may differ by one."""
    rng = np.random.default_rng(1)
    upscaled = 0
    for case in range(12):
        img_h, img_w = (120, 90) if case % 2 else (40, 30)  # shrinking and enlarging crops
        image = smooth_image(rng, img_h, img_w)
        bbox, keypoints, visible = random_person(rng, img_h, img_w)
        rands = random_rands(rng)
        box = pose_augmentation.clip_box([max(bbox[0], 0), max(bbox[1], 0), bbox[2], bbox[3]], (img_h, img_w))
        *_, warp_mat, _, _ = original_pose_geometry(box.numpy(), keypoints, visible, img_w, COCO_FLIP,
                                                    range(11), range(11, 17), rands, SIZE)
        expected = original_warp(image[..., ::-1], warp_mat, SIZE, rands["flip"] <= 0.5)[..., ::-1]
        draws = draws_of(rands)
        crop = pose_augmentation.pose_crop(box, torch.from_numpy(np.concatenate([keypoints, visible[:, None]], 1)),
                                           img_w, SIZE, draws, COCO_FLIP, (range(11), range(11, 17)))
        ours = pose_augmentation.pose_pixels(to_tensor(image), crop, SIZE, draws)
        difference = (ours - to_tensor(expected)).abs()
        assert difference.max() <= 1, (case, crop.upscale, float(difference.max()))
        assert difference.gt(0).float().mean() < 0.05
        upscaled += int(crop.upscale)
    assert 0 < upscaled < 12


def test_photometric_distortion_is_the_originals():
    """Brightness, contrast (first or last), saturation and hue against the original's numpy/cv2 code on the same
    choices. Brightness and contrast (truncating float32 conversions) and RGB -> HSV (OpenCV's integer tables) are
    exact; HSV -> RGB is OpenCV 4's float formula, rounded: OpenCV 5 (installed here) computes it in fixed point and
    lands 1 level lower on about a third of the colours. So each HSV step is checked on the original's own input,
    within 1 level (a second HSV round trip would turn a 1-level difference into a different hue)."""
    rng = np.random.default_rng(2)
    image = rng.integers(0, 256, (40, 36, 3), dtype=np.uint8)
    image[:4, :4] = 0  # grey and black pixels (S = 0) take OpenCV's other branch
    image[4:8, :4] = 128
    for case in range(8):  # without HSV: exact, and the contrast's place in the order matters
        d = Photometric(brightness=rng.uniform(-32, 32), contrast=rng.uniform(0.5, 1.5), contrast_first=bool(case % 2),
                        saturation=None, hue=None)
        expected = original_photometric(image[..., ::-1].copy(), d)[..., ::-1]
        assert torch.equal(pixel_augmentation.photometric_distortion(to_tensor(image), d), to_tensor(expected)), d
    for case in range(8):  # one HSV step at a time
        d = Photometric(brightness=None, contrast=None, contrast_first=True,
                        saturation=rng.uniform(0.5, 1.5) if case % 2 else None,
                        hue=None if case % 2 else int(rng.integers(-18, 19)))
        expected = original_photometric(image[..., ::-1].copy(), d)[..., ::-1]
        difference = pixel_augmentation.photometric_distortion(to_tensor(image), d) - to_tensor(expected)
        assert difference.abs().max() <= 1 and difference.ne(0).float().mean() < 0.4, d
        assert difference.ge(0).all()  # OpenCV 5's fixed point only ever lands lower


@pytest.mark.parametrize("kernel", [3, 5, 7])
def test_blur_median_and_dropout_are_albumentations(kernel):
    """Blur = cv2.blur (BORDER_REFLECT_101), MedianBlur = cv2.medianBlur, CoarseDropout = the hole set to 0, as
    albumentations applies them (Blur(p=0.1), MedianBlur(p=0.1), CoarseDropout(...), the pose config's
    PoseAlbumentation). Blur within 1 level (OpenCV's fixed-point box filter rounds the mean), median exact."""
    image = np.random.default_rng(kernel).integers(0, 256, (29, 23, 3), dtype=np.uint8)
    blurred = pixel_augmentation.box_blur(to_tensor(image), kernel)
    assert (blurred - to_tensor(cv2.blur(image, (kernel, kernel)))).abs().max() <= 1
    median = pixel_augmentation.median_blur(to_tensor(image), kernel)
    assert torch.equal(median, to_tensor(cv2.medianBlur(image, kernel)))
    holed = pixel_augmentation.coarse_dropout(to_tensor(image), (3, 5, 7, 4))
    expected = image.copy()
    expected[5:9, 3:10] = 0
    assert torch.equal(holed, to_tensor(expected))


def test_pose_draws_follow_the_configured_distributions():
    """2000 draws of draw_pose: each choice at its configured probability (within 4 standard errors), the
    truncated normals inside (-1, 1) with scipy's truncnorm(-1, 1) mean 0 and std 0.5396, the kernels uniform over
    3/5/7, the hole's sides 0.2-0.4 of the crop and inside it."""
    generator = torch.Generator().manual_seed(0)
    n = 2000
    draws = [pose_augmentation.draw_pose(generator, (256, 192)) for _ in range(n)]

    def share(values, p):
        assert abs(np.mean(values) - p) < 4 * math.sqrt(p * (1 - p) / n), (np.mean(values), p)
    share([d.flip for d in draws], 0.5)
    share([d.half_body for d in draws], 0.3)
    share([d.prefer_upper for d in draws], 0.7)
    share([d.shift != (0.0, 0.0) for d in draws], 0.3)
    share([d.rotation != 0 for d in draws], 0.6)
    share([d.photometric is not None for d in draws], 0.8)
    share([d.blur > 0 for d in draws], 0.1)
    share([d.median_blur > 0 for d in draws], 0.1)
    photometric = [d.photometric for d in draws if d.photometric]
    share([p.brightness is not None for p in photometric], 0.5)
    share([p.contrast_first for p in photometric], 0.5)
    assert all(-32 <= p.brightness <= 32 for p in photometric if p.brightness is not None)
    assert all(0.5 <= p.contrast <= 1.5 for p in photometric if p.contrast is not None)
    assert {p.hue for p in photometric if p.hue is not None} == set(range(-18, 19))
    scales = np.array([d.scale for d in draws])
    rotations = np.array([d.rotation for d in draws if d.rotation != 0]) / 80
    shifts = np.array([d.shift for d in draws if d.shift != (0.0, 0.0)]).ravel() / 0.16
    truncnorm_std = math.sqrt(1 - 2 * math.exp(-0.5) / math.sqrt(2 * math.pi) / math.erf(1 / math.sqrt(2)))
    for values in ((scales - 1) / 0.5, rotations, shifts):
        assert values.min() > -1 and values.max() < 1
        assert abs(values.mean()) < 4 * truncnorm_std / math.sqrt(len(values))
        assert abs(values.std() - truncnorm_std) < 0.03
    assert {d.blur for d in draws} == {0, 3, 5, 7}
    holes = np.array([d.hole for d in draws])
    assert (holes[:, 2] >= int(192 * 0.2)).all() and (holes[:, 2] <= int(192 * 0.4)).all()
    assert (holes[:, 3] >= int(256 * 0.2)).all() and (holes[:, 3] <= int(256 * 0.4)).all()
    assert (holes[:, 0] + holes[:, 2] <= 192).all() and (holes[:, 1] + holes[:, 3] <= 256).all()
    assert holes[:, 0].min() == 0 and (holes[:, 0] + holes[:, 2]).max() == 192


def test_half_body_halves_of_the_known_sets():
    """The 308 set's upper/lower ids are the original's keypoint types (keypoints308.py: 51 upper, 12 lower);
    COCO-WholeBody's 133: nose-wrists / hips-feet; a known set in another order keeps its halves by name; an
    unknown set by name."""
    names308 = processing.keypoint_metadata()["keypoint_names"]
    upper, lower = pose_dataset.body_halves(names308)
    assert lower == list(range(9, 21)) and upper == list(range(9)) + list(range(21, 63))
    wholebody = processing.read_data("coco_wholebody133.json")["keypoint_names"]
    assert pose_dataset.body_halves(wholebody) == (list(range(11)), list(range(11, 23)))
    shuffled = list(reversed(processing.coco17_names()))
    assert pose_dataset.body_halves(shuffled) == (list(range(6, 17)), list(range(6)))
    assert pose_dataset.body_halves(["head", "left_hand", "left_knee", "right_foot"]) == ([0, 1], [2, 3])


# ----------------------------------------------------------------------------------------------------
# Sample rules
# ----------------------------------------------------------------------------------------------------
def write_pose_set(folder: Path, people: list[tuple[list, list]], h=80, w=60):
    (folder / "images").mkdir(parents=True)
    Image.fromarray(np.full((h, w, 3), 90, np.uint8)).save(folder / "images" / "a.png")
    annotations = [{"id": i, "image_id": 0, "bbox": box, "keypoints": keypoints}
                   for i, (box, keypoints) in enumerate(people)]
    category = {"id": 1, "name": "person", "keypoints": list(processing.coco17_names())}
    (folder / "annotations.json").write_text(json.dumps({
        "images": [{"id": 0, "file_name": "a.png", "height": h, "width": w}], "annotations": annotations,
        "categories": [category]}))


def keypoints_with(visible: int, x=20.0, y=30.0) -> list:
    return [v for k in range(17) for v in (x + k, y + k, 2 if k < visible else 0)]


def test_pose_people_the_original_leaves_out(tmp_path):
    """The released loaders' rules: a box outside the image (empty once clipped), keypoints all at (0, 0), fewer
    than 8 visible keypoints inside the image (training only); the rest kept and the count of each reason kept."""
    people = [([5, 5, 30, 40], keypoints_with(8)),  # kept
              ([70, 10, 20, 20], keypoints_with(17)),  # x >= width: outside the image
              ([5, 5, 30, 40], [0.0, 0.0, 2] * 17),  # all at (0, 0)
              ([5, 5, 30, 40], keypoints_with(7)),  # 7 visible
              ([5, 5, 30, 40], keypoints_with(10, x=-2.0)),  # 10 visible, 7 of them inside the image (x > 0)
              ([-20, -20, 60, 60], keypoints_with(17))]  # kept: clipped to the image
    write_pose_set(tmp_path / "train", people)
    dataset = pose_dataset.PoseDataset(tmp_path / "train", SIZE, True, min_visible=pose_dataset.MIN_VISIBLE_KEYPOINTS)
    assert len(dataset) == 2
    assert dataset.dropped == {"box outside the image": 1, "keypoints all at (0, 0)": 1,
                               "fewer than 8 visible keypoints in the image": 2}
    assert dataset.people[1]["box_xyxy"].tolist() == [0, 0, 40, 40]
    evaluation = pose_dataset.PoseDataset(tmp_path / "train", SIZE, False)  # val keeps the sparse people
    assert len(evaluation) == 4 and evaluation.dropped == {"box outside the image": 1, "keypoints all at (0, 0)": 1}


def save_png(path: Path, array):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.asarray(array, np.uint8)).save(path)


def dense_set(task: str, folder: Path, targets: dict, masks: dict | None = None, image=None) -> datasets.DenseDataset:
    """A folder of images (grey 64x48, or `image`) with the given targets (and masks/), as a training set with the
    drop rules."""
    for name, target in targets.items():
        save_png(folder / "images" / f"{name}.png", np.full((64, 48, 3), 100) if image is None else image)
        if task in ("normal", "pointmap"):
            (folder / dataset_folder(task)).mkdir(parents=True, exist_ok=True)
            np.save(folder / dataset_folder(task) / f"{name}.npy", target.astype(np.float32))
        else:
            save_png(folder / dataset_folder(task) / f"{name}.png", target)
    for name, mask in (masks or {}).items():
        save_png(folder / "masks" / f"{name}.png", mask * 255)
    names = ["background", "person"] if task == "seg" else None
    return datasets.DenseDataset(task, folder, SIZE, False, class_names=names, drop_rules=True)


def dataset_folder(task):
    return TARGET_FOLDERS[task]


def kept_and_dropped(dataset, name_of) -> tuple[list, list]:
    """Per image: (the names whose own sample is kept, those refetched)."""
    kept, dropped = [], []
    for index, name in enumerate(dataset.names):
        sample = dataset[(index, 7)]
        (dropped if sample["dropped"] > 0 else kept).append(name)
        assert name_of(sample) in kept + [n for n in dataset.names if n not in dropped]  # a kept one replaces it
    return sorted(kept), sorted(dropped)


def test_seg_samples_under_one_percent_foreground_are_refetched(tmp_path):
    few = np.zeros((64, 48), np.uint8)
    few[:2, :10] = 1  # 20 of 3072 pixels: 0.65%
    enough = np.zeros((64, 48), np.uint8)
    enough[:4, :10] = 1  # 1.3%
    ignored = np.full((64, 48), 255, np.uint8)  # 255 is not foreground
    dataset = dense_set("seg", tmp_path, {"few": few, "enough": enough, "ignored": ignored})
    kept, dropped = kept_and_dropped(dataset, lambda s: "enough")
    assert (kept, dropped) == (["enough"], ["few", "ignored"])
    sample = dataset.make_sample(dataset.names.index("few"), 0)[0]
    assert datasets.dense_drop_reason("seg", sample, False) == "under 1% foreground"


def test_normal_and_albedo_masks_the_original_leaves_out(tmp_path):
    """> 96% valid or < 16 valid pixels: left out where masks/ (albedo: the alpha channel) says which pixels are
    valid; a set without masks keeps its (all valid) samples."""
    normals = np.tile(np.array([0, 0, -1.0]), (64, 48, 1))
    full, tiny, half = np.ones((64, 48)), np.zeros((64, 48)), np.zeros((64, 48))
    tiny[:3, :5] = 1  # 15 pixels
    half[:32] = 1
    masked = dense_set("normal", tmp_path / "n", {"full": normals, "tiny": normals, "half": normals},
                       {"full": full, "tiny": tiny, "half": half})
    kept, dropped = kept_and_dropped(masked, lambda s: "half" if s["mask"].mean() == 0.5 else "?")
    assert (kept, dropped) == (["half"], ["full", "tiny"])
    unmasked = dense_set("normal", tmp_path / "u", {"a": normals})
    assert unmasked[(0, 0)]["dropped"] == 0
    rgba = np.concatenate([np.full((64, 48, 3), 50), np.full((64, 48, 1), 255)], -1)
    rgba_half = rgba.copy()
    rgba_half[32:, :, 3] = 0
    albedo = dense_set("albedo", tmp_path / "a", {"opaque": rgba, "half": rgba_half, "rgb": rgba[..., :3]})
    kept, dropped = kept_and_dropped(albedo, lambda s: "half" if s["mask"].mean() == 0.5 else "rgb")
    assert (kept, dropped) == (["half", "rgb"], ["opaque"])


def test_pointmap_inside_the_canonical_camera_is_refetched(tmp_path):
    """Canonical depth (metric depth x 768 / the focal length in network pixels) under 0.04 is left out."""
    v, u = np.mgrid[0:64, 0:48].astype(np.float32)

    def plane(depth):
        return np.stack([(u - 23.5) * depth / 500, (v - 31.5) * depth / 500, np.full_like(u, depth)], -1)
    mask = np.zeros((64, 48))
    mask[10:50, 10:40] = 1  # 39% valid
    dataset = dense_set("pointmap", tmp_path, {"near": plane(0.02), "far": plane(3.0)}, {"near": mask, "far": mask})
    sample = dataset.make_sample(dataset.names.index("near"), 0)[0]
    assert 0 < sample["labels"][2][sample["mask"][0] > 0].max() < 0.04  # 0.02 x 768 / 500
    assert kept_and_dropped(dataset, lambda s: "far") == (["far"], ["near"])


def original_udp_heatmaps(heatmap_size, keypoints, visible, sigma):
    """generate_udp_gaussian_heatmaps (pose/datasets/codecs/utils/gaussian_heatmap.py:155-240) for one person:
    keypoints (K, 2) in heatmap pixels, visible (K,), heatmap_size (W, H) -> heatmaps (K, H, W), weights (K,)."""
    width, height = heatmap_size
    heatmaps = np.zeros((len(keypoints), height, width), np.float32)
    weights = visible.astype(np.float32).copy()
    radius = sigma * 3
    gaussian_size = 2 * radius + 1
    x = np.arange(0, gaussian_size, 1, dtype=np.float32)
    y = x[:, None]
    for k in range(len(keypoints)):
        if visible[k] < 0.5:
            continue
        mu = (keypoints[k] + 0.5).astype(np.int64)
        left, top = (mu - radius).astype(np.int64)
        right, bottom = (mu + radius + 1).astype(np.int64)
        if left >= width or top >= height or right < 0 or bottom < 0:
            weights[k] = 0
            continue
        x0 = gaussian_size // 2 + keypoints[k][0] - mu[0]
        y0 = gaussian_size // 2 + keypoints[k][1] - mu[1]
        gaussian = np.exp(-((x - x0) ** 2 + (y - y0) ** 2) / (2 * sigma**2))
        region = heatmaps[k, max(0, top):min(height, bottom), max(0, left):min(width, right)]
        np.maximum(region, gaussian[max(0, -top):min(height, bottom) - top, max(0, -left):min(width, right) - left],
                   out=region)
    return heatmaps, weights


NO_DRAWS = {"flip": 1.0, "half_body": 1.0, "upper": 0.0, "shift_tn": (0.0, 0.0), "shift": 1.0, "scale_tn": 0.0,
            "rot_tn": 0.0, "rot": 1.0}  # the original's draws that change nothing (no flip, half body, shift...)


def test_pose_crop_with_two_keypoints_is_trained_on(tmp_path):
    """The original trains on every crop: its check for fewer than 3 visible keypoints after the crop
    (pose_base_dataset.py:57-78) is never reached in training (docs/training.md, 'Samples left out'). A person
    with 9 visible keypoints, 2 of them inside the crop, is its own sample (no refetch), with the original's
    targets: UDPHeatmap's Gaussians for the 2 (PoseTopdownAffine, PoseGenerateTarget, PosePackInputs), weight 0 for
    the 7 outside the crop and the 8 unlabelled."""
    inside = {0: (22.0, 33.0), 5: (28.0, 38.0)}  # the crop: x 18.75-31.25, y 26.7-43.3 (box 20-30 x 30-40, x1.25)
    outside = {1: (5.0, 5.0), 2: (55.0, 5.0), 3: (5.0, 75.0), 4: (55.0, 75.0), 6: (40.0, 35.0), 7: (10.0, 35.0),
               8: (25.0, 60.0)}  # in the 60x80 image, so the person is loaded (9 visible >= 8)
    points = {**inside, **outside}
    person = [v for k in range(17) for v in (*points.get(k, (0.0, 0.0)), 2 if k in points else 0)]
    write_pose_set(tmp_path / "train", [([20, 30, 10, 10], person), ([5, 5, 30, 40], keypoints_with(17))])
    info = datasets.dataset_info("pose", tmp_path)
    dataset = datasets.build_dataset("pose", tmp_path, "train", SIZE, False, info)  # train.py --no-augment
    assert len(dataset) == 2 and dataset.dropped == {}
    for seed in range(3):
        sample = dataset[(0, seed)]
        assert sample["dropped"] == 0 and sample["bbox"].tolist() == [20, 30, 10, 10]

    keypoints = np.asarray(person, np.float32).reshape(17, 3)
    upper, lower = pose_dataset.body_halves(list(processing.coco17_names()))
    box = pose_augmentation.clip_box([20, 30, 10, 10], (80, 60)).numpy()
    labelled = np.minimum(1, keypoints[:, 2])  # v = 2 -> 1, pose_base_dataset.py:169
    *_, network_points, visible = original_pose_geometry(box, keypoints[:, :2], labelled, 60, COCO_FLIP, upper, lower,
                                                         NO_DRAWS, SIZE)
    assert np.flatnonzero(visible).tolist() == [0, 5]  # the case: 2 of the 9 visible keypoints in the crop
    heatmap_size = (SIZE[1] // 4, SIZE[0] // 4)  # (W, H), the codec's
    scale_factor = (np.array([SIZE[1], SIZE[0]]) - 1) / (np.array(heatmap_size) - 1)  # UDPHeatmap.__init__
    expected, weights = original_udp_heatmaps(heatmap_size, network_points / scale_factor.astype(np.float32), visible,
                                              targets.heatmap_sigma(heatmap_size[::-1]))
    sample = dataset[(0, 0)]
    assert sample["label_weights"].tolist() == weights.tolist() and weights.sum() == 2
    # the keypoints reach the crop by two float32 chains (ours: float64 then cast; cv2.transform): a few ulps of
    # ~30 px (4e-6 px each) apart, times the Gaussian's slope (at most 1 / (sigma sqrt(e)) = 0.61 per heatmap
    # pixel at sigma 1, 4 network pixels each): ~1e-6; 1e-5 leaves room and fails on any misplaced Gaussian
    torch.testing.assert_close(sample["labels"], torch.from_numpy(expected), atol=1e-5, rtol=0)
    assert float(sample["labels"][0].max()) > 0.5 and float(sample["labels"][5].max()) > 0.5

    augmented = datasets.build_dataset("pose", tmp_path, "train", SIZE, True, info)  # random crops: never refetched
    kept = [augmented[(0, seed)] for seed in range(12)]
    assert all(s["dropped"] == 0 and s["bbox"].tolist() == [20, 30, 10, 10] for s in kept)
    assert min(int(s["label_weights"].sum()) for s in kept) < 3  # some crops hold fewer than 3 keypoints


def test_train_logs_the_samples_it_left_out(tmp_path):
    """train.py notes the people left out at load time and logs, per window, the samples refetched."""
    from test_train import make_dataset, read_log, run_train, tiny_backbone
    data = make_dataset("seg", tmp_path / "data", count=2)
    save_png(data / "train" / "masks" / "im0.png", np.zeros((64, 48)))  # no foreground: always refetched
    assert run_train("seg", data, tmp_path / "out", tiny_backbone(tmp_path), "--steps", 2, "--batch-size", 2,
                     "--log-every", 1) == 0
    windows = [record["dropped_samples"] for record in read_log(tmp_path / "out") if "loss" in record]
    assert len(windows) == 2 and all(n >= 1 for n in windows)  # each step fetches im0 (and may draw it again)


# ----------------------------------------------------------------------------------------------------
# Dense geometry and pixels
# ----------------------------------------------------------------------------------------------------
def original_continuous_crop(img, ar_area, corners):
    """NormalRandomCropContinuous.transform, normal_transforms.py:189-235 (area_range (0.4, 1.0) from the config),
    random.uniform values from `ar_area`, random.randint(0, margin + 1) values from `corners` (per attempt)."""
    orig_h, orig_w = img.shape[:2]
    for (ar, area_frac), corner in zip(ar_area, corners):
        target_area = area_frac * orig_h * orig_w
        crop_h = math.sqrt(target_area / ar)
        crop_w = ar * crop_h
        if crop_w <= orig_w and crop_h <= orig_h:
            crop_h, crop_w = int(round(crop_h)), int(round(crop_w))
            y1, x1 = corner(orig_h - crop_h, orig_w - crop_w)
            return img[y1:y1 + crop_h, x1:x1 + crop_w, ...]
    return img


def test_continuous_crop_is_the_originals():
    """300 images and 8-attempt draws: the same crop (its corner may overhang by one pixel, as random.randint(0,
    margin + 1) allows: the original's slice is then one shorter, and so is ours), or none."""
    rng = np.random.default_rng(4)
    cropped = 0
    for _ in range(300):
        h, w = int(rng.integers(20, 90)), int(rng.integers(20, 90))
        attempts = [(rng.uniform(0.5, 2.0), rng.uniform(0.4, 1.0), rng.uniform(), rng.uniform()) for _ in range(8)]
        coords = np.stack(np.mgrid[0:h, 0:w], -1)  # (y, x) of each pixel

        def corner_of(u_y, u_x):
            return lambda mh, mw: (min(int(u_y * (mh + 2)), mh + 1), min(int(u_x * (mw + 2)), mw + 1))
        expected = original_continuous_crop(coords, [a[:2] for a in attempts], [corner_of(*a[2:]) for a in attempts])
        box = dense_augmentation.continuous_crop((h, w), attempts)
        if box is None:
            assert expected.shape == coords.shape
            continue
        x0, y0, cw, ch = box
        assert expected.shape[:2] == (ch, cw) and tuple(expected[0, 0]) == (y0, x0)
        cropped += 1
    assert cropped > 200


def coordinate_map(h, w) -> np.ndarray:
    """float32 (h, w, 2): each pixel's own (x, y); linear interpolation moves such a map exactly with its geometry."""
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    return np.stack([x, y], -1)


def test_seg_geometry_is_the_originals_chain():
    """SegRandomResize (keep ratio) -> SegRandomCrop (padded) -> SegRandomRotate -> SegRandomHorizontalFlip ->
    SegResize, run with cv2 on a map of source coordinates (INTER_LINEAR: exact for an affine map), against our one
    composed map. Within 1/32 of a window pixel (warpAffine rounds its coordinates to 1/32 pixel), away from the
    borders (where interpolation meets the padding)."""
    rng = np.random.default_rng(5)
    out_size = (40, 30)
    for case in range(16):
        h, w = int(rng.integers(30, 120)), int(rng.integers(30, 120))
        labels = torch.from_numpy(rng.integers(0, 3, (h, w))).float()
        draws = dense_augmentation.DenseDraws(seg_resize=float(rng.uniform(0.4, 2.0)), flip=bool(case % 2),
                                        rotation=float(rng.uniform(-60, 60)) if case % 4 else 0.0,
                                        seg_crop=tuple((rng.uniform(), rng.uniform()) for _ in range(11))
                                        if case % 3 else ())
        geometry = dense_augmentation.seg_geometry((h, w), out_size, draws, labels)
        # the original's chain (seg_transforms.py:185-248, 292-329, 37-60, 86-88)
        new_h, new_w = dense_augmentation.seg_resized_size((h, w), out_size, draws.seg_resize)
        ratio = draws.seg_resize
        factor = min(int(out_size[1] * ratio) / w, int(out_size[0] * ratio) / h)
        assert (new_h, new_w) == (int(round(h * factor)), int(round(w * factor)))
        coords = cv2.resize(coordinate_map(h, w), (new_w, new_h), interpolation=cv2.INTER_LINEAR)
        if draws.seg_crop:
            pad_h, pad_w = max(out_size[0] - new_h, 0), max(out_size[1] - new_w, 0)
            coords = cv2.copyMakeBorder(coords, 0, pad_h, 0, pad_w, cv2.BORDER_CONSTANT, value=-1000)
            small = processing.resize(labels[None], (new_h, new_w), "nearest")[0]
            y0, x0 = dense_augmentation.seg_crop_corner(small, out_size, draws.seg_crop)
            coords = coords[y0:y0 + out_size[0], x0:x0 + out_size[1]]
        wh, ww = coords.shape[:2]
        if draws.rotation:
            M = cv2.getRotationMatrix2D((ww / 2, wh / 2), draws.rotation, 1.0)
            coords = cv2.warpAffine(coords, M, (ww, wh), flags=cv2.INTER_LINEAR, borderValue=-1000)
        if draws.flip:
            coords = cv2.flip(coords, 1)
        coords = cv2.resize(coords, (out_size[1], out_size[0]), interpolation=cv2.INTER_LINEAR)
        ours = dense_augmentation.source_points(geometry.to_source, out_size).numpy()
        window = dense_augmentation.source_points(geometry.to_window, out_size).numpy()
        step = w / new_w  # source pixels per window pixel
        stretched = dense_augmentation.source_points(dense_augmentation.resize_matrix(out_size, (wh, ww)),
                                                     out_size).numpy()
        interior = ((window >= 1.5) & (window <= np.array([ww, wh]) - 2.5)).all(-1) & (
            (ours >= 2 * step) & (ours <= np.array([w, h]) - 1 - 2 * step)).all(-1) & (
            (stretched >= 0.5) & (stretched <= np.array([ww, wh]) - 1.5)).all(-1)  # SegResize clamps its border
        assert interior.sum() > 30, case  # a small resized image padded to the crop leaves fewer
        np.testing.assert_allclose(ours[interior], coords[interior], atol=step / 32 + 1e-3, err_msg=str(case))


def test_normal_geometry_is_the_originals_chain(tmp_path):
    """NormalRandomScale -> NormalRandomCropContinuous -> NormalRandomFlip -> NormalResize (resize, centred on a
    black canvas) on a source-coordinate map, against our box: within one output pixel (the original rounds the
    resized size and the canvas offset to whole pixels; ours is the exact centred box, as predict.py's)."""
    rng = np.random.default_rng(6)
    out_size = (40, 30)
    for case in range(12):
        h, w = int(rng.integers(30, 100)), int(rng.integers(30, 100))
        draws = dense_augmentation.DenseDraws(
            scale=float(rng.uniform(0.5, 2.0)) if case % 2 else None, flip=bool(case % 3),
            crop=tuple((rng.uniform(0.5, 2), rng.uniform(0.4, 1), rng.uniform(), rng.uniform()) for _ in range(8)))
        dataset = datasets.DenseDataset.__new__(datasets.DenseDataset)
        dataset.task, dataset.size = "normal", out_size
        box, _, window, _, _ = dataset.augmented_boxes(torch.zeros(3, h, w), draws)
        # the original's chain on coordinates (normal_transforms.py:36-45, 189-235, 258-295, 340-341)
        coords = coordinate_map(h, w)
        if draws.scale:
            coords = cv2.resize(coords, (int(round(w * draws.scale)), int(round(h * draws.scale))),
                                interpolation=cv2.INTER_LINEAR)
        x0, y0, cw, ch = dense_augmentation.continuous_crop(coords.shape[:2], draws.crop)
        coords = coords[y0:y0 + ch, x0:x0 + cw]
        if draws.flip:
            coords = cv2.flip(coords, 1)
        factor = min(out_size[1] / cw, out_size[0] / ch)
        new_w, new_h = int(round(cw * factor)), int(round(ch * factor))
        resized = cv2.resize(coords, (new_w, new_h), interpolation=cv2.INTER_LINEAR)
        canvas = np.full((*out_size, 2), np.nan, np.float32)
        off_x, off_y = (out_size[1] - new_w) // 2, (out_size[0] - new_h) // 2
        canvas[off_y:off_y + new_h, off_x:off_x + new_w] = resized
        xs = box[0] + (np.arange(out_size[1]) + 0.5) * box[2] / out_size[1] - 0.5
        ys = box[1] + (np.arange(out_size[0]) + 0.5) * box[3] / out_size[0] - 0.5
        ours = np.stack(np.meshgrid(xs, ys), -1)
        if draws.flip:
            ours = ours[:, ::-1]
        step = box[2] / out_size[1]  # source pixels per output pixel
        in_crop = ((ours >= np.array(window[:2]) + 1.5 * step) &
                   (ours <= np.array(window[:2]) + np.array(window[2:]) - 1 - 1.5 * step)).all(-1)
        valid = in_crop & np.isfinite(canvas).all(-1)
        assert valid.sum() > 100
        assert np.abs(ours[valid] - canvas[valid]).max() <= step + 1e-3, case


def test_dense_pixel_augmentations_are_the_originals():
    """RandomGaussianBlur = cv2.GaussianBlur 3x3 (within 1 level: OpenCV's 8-bit kernel is fixed point), noise
    clipped and truncated, RandomSolarize exact, RandomDownUpSampleImage within 2 levels (two resizes, each within
    1 of OpenCV: processing.resize)."""
    rng = np.random.default_rng(7)
    image = smooth_image(rng, 33, 27)
    image[::5, ::3] = 255
    for sigma in (0.3, 1.0, 2.0):
        ours = pixel_augmentation.gaussian_blur(to_tensor(image), sigma)
        assert (ours - to_tensor(cv2.GaussianBlur(image, (3, 3), sigma))).abs().max() <= 1
    noise = torch.randn((3, 33, 27), generator=torch.Generator().manual_seed(5)) * 3.0
    noisy = np.clip(image.astype(np.float32) + noise.permute(1, 2, 0).numpy(), 0, 255).astype(np.uint8)
    assert torch.equal(pixel_augmentation.gaussian_noise(to_tensor(image), 3.0, 5), to_tensor(noisy))
    solarized = image.copy()
    solarized[solarized > 128] = 255 - solarized[solarized > 128]  # common_transforms.py:416-417
    assert torch.equal(pixel_augmentation.solarize(to_tensor(image)), to_tensor(solarized))
    methods = {"nearest": cv2.INTER_NEAREST, "bilinear": cv2.INTER_LINEAR, "bicubic": cv2.INTER_CUBIC,
               "area": cv2.INTER_AREA}
    for down, up in (("area", "bilinear"), ("bilinear", "bicubic"), ("nearest", "area")):
        small = cv2.resize(image, (max(1, int(27 * 0.4)), max(1, int(33 * 0.4))), interpolation=methods[down])
        expected = cv2.resize(small, (27, 33), interpolation=methods[up])
        ours = pixel_augmentation.down_up(to_tensor(image), 0.4, down, up)
        assert (ours - to_tensor(expected)).abs().max() <= 2, (down, up)


@pytest.mark.parametrize("task", ["seg", "normal", "pointmap", "albedo"])
def test_dense_draws_follow_the_configs(task):
    """600 draws per task: each choice at its config's probability (within 4 standard errors), in its range."""
    generator = torch.Generator().manual_seed(1)
    n = 600
    draws = [dense_augmentation.draw_dense(task, generator) for _ in range(n)]

    def share(values, p):
        assert abs(np.mean(values) - p) <= 4 * math.sqrt(p * (1 - p) / n) + 1e-9, (task, np.mean(values), p)
    seg = task == "seg"
    share([d.flip for d in draws], 0.5 if seg else 0.3)
    share([d.photometric is not None for d in draws], 0.0 if task == "albedo" else 1.0)
    share([d.scale is not None for d in draws], 0.0 if seg else 0.3)
    share([bool(d.crop) for d in draws], 0.0 if seg else 0.3)
    share([bool(d.seg_crop) for d in draws], 0.3 if seg else 0.0)
    share([d.rotation != 0 for d in draws], 0.5 if seg else 0.0)
    share([d.down_up is not None for d in draws], 0.2 if task == "normal" else 0.0)
    share([d.background is not None for d in draws], 0.8 if seg else 0.0)
    blur, noise, solarize = {"seg": (0.3, 0.3, 0), "normal": (0.3, 0.3, 0.3), "pointmap": (0, 0, 0),
                             "albedo": (0, 0.2, 0)}[task]
    share([d.blur_sigma > 0 for d in draws], blur)
    share([d.noise is not None for d in draws], noise)
    share([d.solarize for d in draws], solarize)
    for d in draws:
        assert d.scale is None or 0.5 <= d.scale <= 2.0
        assert abs(d.rotation) <= 60 and (not seg or 0.4 <= d.seg_resize <= 2.0)
        assert d.noise is None or math.sqrt(5) <= d.noise[0] <= math.sqrt(20)
        assert all(0.5 <= a <= 2.0 and 0.4 <= s <= 1.0 for a, s, _, _ in d.crop)


def test_augmented_dense_samples_keep_targets_on_the_pixels(tmp_path):
    """An augmented seg sample: rotation brings in background (0) with black pixels, a crop's padding is ignored
    (255) and black; classes stay on their colours (red = 1)."""
    image = np.zeros((80, 60, 3), np.uint8)
    image[20:60, 15:45] = (220, 30, 30)
    labels = np.zeros((80, 60), np.uint8)
    labels[20:60, 15:45] = 1
    dataset = dense_set("seg", tmp_path, {"a": labels}, image=image)
    dataset.augment = True
    checked = 0
    for seed in range(12):
        sample, _ = dataset.make_sample(0, seed)
        pixels = sample["pixel_values"] * torch.tensor(processing.IMAGENET_STD).view(3, 1, 1) * 255 + torch.tensor(
            processing.IMAGENET_MEAN).view(3, 1, 1) * 255
        red = (pixels[0] > pixels[1] + 60)
        if red.sum() > 30:
            assert (sample["labels"][red] == 1).float().mean() > 0.9
            checked += 1
        black = pixels.amax(0) < 1
        assert set(sample["labels"][black].unique().tolist()) <= {0, 255}
    assert checked >= 6


def original_random_background(image, gt_seg, background):
    """SegRandomBackground.transform + reinhard_alpha + weighted_mean_std, seg_transforms.py:372-479, on BGR uint8
    (the background photo passed in instead of random.choice)."""
    mask = (gt_seg > 0).astype(np.uint8)
    new_h = image.shape[0]
    new_w = int(new_h * background.shape[1] / background.shape[0])
    background = cv2.resize(background, (new_w, new_h))
    if new_w > image.shape[1]:
        start_x = (new_w - image.shape[1]) // 2
        background = background[:, start_x:start_x + image.shape[1]]
    if background.shape[:2] != image.shape[:2]:
        background = cv2.resize(background, (image.shape[1], image.shape[0]))
    alpha = np.stack([mask.astype(np.float32)] * 3, axis=-1)
    composite = (alpha * image + (1 - alpha) * background).astype(np.uint8)
    comp_lab = cv2.cvtColor(composite, cv2.COLOR_BGR2Lab)

    def weighted_mean_std(img, weights):
        weights_3d = np.repeat(weights[:, :, None], img.shape[2], axis=2)
        total = np.sum(weights_3d, axis=(0, 1))
        mean = np.sum(img * weights_3d, axis=(0, 1)) / total
        return mean, np.sqrt(np.sum(((img - mean) ** 2) * weights_3d, axis=(0, 1)) / total)
    a = mask.astype(np.float32)
    bg_mean, bg_std = weighted_mean_std(comp_lab, 1 - a)
    fg_mean, fg_std = weighted_mean_std(comp_lab, a)
    fg_std = np.maximum(fg_std, 1e-6)
    trans_lab = cv2.convertScaleAbs(comp_lab * (bg_std / fg_std) + (bg_mean - fg_mean * bg_std / fg_std))
    trans_img = cv2.cvtColor(trans_lab, cv2.COLOR_Lab2BGR)
    a3 = np.repeat(a[:, :, None], 3, axis=2)
    return (trans_img * a3 + composite * (1 - a3)).astype(np.uint8)


def test_random_background_is_the_originals():
    """The person pasted on a wider and a narrower photo and recoloured to its Lab statistics, against the original:
    the background pixels within 1 grey level (OpenCV's fixed-point bilinear resize); the person's within 2 on 95%
    of them and 12 at most: OpenCV's 8-bit Lab interpolates a table (our float formula is within 3 levels of it, the
    inverse within 2), and the transfer multiplies that by the ratio of the Lab deviations."""
    rng = np.random.default_rng(8)
    image = smooth_image(rng, 48, 36)
    labels = np.zeros((48, 36), np.uint8)
    labels[10:40, 8:28] = rng.integers(1, 4, (30, 20))
    for bh, bw in ((30, 70), (60, 20)):
        background = smooth_image(rng, bh, bw)[..., ::-1].copy()
        expected = original_random_background(image[..., ::-1].copy(), labels, background[..., ::-1].copy())[..., ::-1]
        ours = pixel_augmentation.random_background(to_tensor(image), torch.from_numpy(labels), to_tensor(background))
        difference = (ours - to_tensor(expected)).abs()
        person = torch.from_numpy(labels > 0)
        assert difference[:, person].max() <= 12 and difference[:, person].gt(2).float().mean() < 0.05
        assert difference[:, person].mean() < 0.7
        assert difference[:, ~person].max() <= 1
    lab = pixel_augmentation.rgb_to_lab_uint8(to_tensor(image)) - to_tensor(cv2.cvtColor(image, cv2.COLOR_RGB2Lab))
    assert lab.abs().max() <= 3


def test_seg_backgrounds_folder_is_used(tmp_path):
    """<data>/backgrounds/ photos go behind the people of an augmented seg sample (p 0.8)."""
    labels = np.zeros((64, 48), np.uint8)
    labels[20:40, 15:30] = 1
    dataset = dense_set("seg", tmp_path / "train", {"a": labels})
    save_png(tmp_path / "backgrounds" / "green.png", np.tile(np.array([0, 255, 0], np.uint8), (50, 50, 1)))
    dataset = datasets.DenseDataset("seg", tmp_path / "train", SIZE, True, class_names=["bg", "person"])
    greens = []
    for seed in range(10):
        sample, _ = dataset.make_sample(0, seed)
        green = sample["pixel_values"][1] - sample["pixel_values"][0] > 2  # grey image: green only from the photo
        greens.append(bool(green[sample["labels"] == 0].float().mean() > 0.5))
    assert 5 <= sum(greens) < 10
