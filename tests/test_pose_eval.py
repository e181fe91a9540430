"""Pose fine-tuning as the original trains and evaluates it: the official flip pairs of the keypoint sets it ships
(data/, from sapiens/pose/configs/_base_/keypoints308.py), and the validation metrics of its Keypoints308Evaluator."""

import contextlib
import io
import json
import os
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from sapiens2 import processing
import train
from sapiens2 import weights
from fixtures import original_pose_eval as original
from sapiens2_app.train import dataset_files, datasets, distributed, pose_metrics, starting_model
from test_train import SIZE, make_dataset, read_log, run_train, tiny_backbone

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).parent / "fixtures"
ORIGINAL_REPO = os.environ.get("SAPIENS2_REPO", "/work/.mirror/facebookresearch+sapiens2/repo")
COCO17_PAIRS = [[1, 2], [3, 4], [5, 6], [7, 8], [9, 10], [11, 12], [13, 14], [15, 16]]  # COCO's own definition


def category(names, **extra) -> dict:
    return {"categories": [{"id": 1, "name": "person", "keypoints": list(names), **extra}]}


def official(set_name: str) -> tuple[list[str], list[list[int]], list[float]]:
    """Names, flip pairs and sigmas of a known set, as its data/ table holds them."""
    file, count = dataset_files.KNOWN_KEYPOINT_SETS[set_name]
    table = processing.read_data(file)
    pairs = [pair for pair in table["flip_pairs"] if max(pair) < count]
    return table["keypoint_names"][:count], pairs, table["sigmas"][:count]


def mirrors(count: int, pairs) -> list[int]:
    return dataset_files.flip_order(count, pairs).tolist()


# ----------------------------------------------------------------------------------------------------
# Flip pairs: the official tables of the known sets; the name rule only for the others, with a warning
# ----------------------------------------------------------------------------------------------------
# How many keypoints the name rule (left_/right_, l_/r_) gives another mirror than the official table: the bug of
# issue 23 (e.g. upper_startpoint_of_r_eyebrow, face-0 <-> face-16 and the rest of COCO-WholeBody's face contour).
NAME_RULE_WRONG = {"sapiens 308": 136, "COCO-WholeBody 133": 58, "COCO 17": 0}


@pytest.mark.parametrize("set_name", list(dataset_files.KNOWN_KEYPOINT_SETS))
def test_a_known_set_gets_its_official_pairs_and_sigmas(set_name):
    names, pairs, sigmas = official(set_name)
    meta = dataset_files.keypoint_set(category(names), Path("annotations.json"))
    assert meta["flip_pairs"] == pairs and meta["flip_pairs_from"] == set_name
    assert meta["sigmas"] == sigmas and dataset_files.inferred_pairs_warning(meta) is None
    by_names = dataset_files.flip_pairs_from_names(names)
    wrong = sum(a != b for a, b in zip(mirrors(len(names), by_names), mirrors(len(names), pairs)))
    assert wrong == NAME_RULE_WRONG[set_name]
    if set_name == "COCO 17":
        assert pairs == COCO17_PAIRS and sigmas[:3] == [0.026, 0.025, 0.025]
    if set_name == "sapiens 308":
        mirror = mirrors(308, meta["flip_pairs"])[names.index("upper_startpoint_of_r_eyebrow")]
        assert names[mirror] == "upper_startpoint_of_l_eyebrow"  # no l_/r_ prefix: the name rule leaves it alone
    if set_name == "COCO-WholeBody 133":
        assert names[mirrors(133, meta["flip_pairs"])[names.index("face-0")]] == "face-16"


def test_a_known_set_in_another_order_keeps_each_keypoints_mirror_and_sigma():
    names, pairs, sigmas = official("COCO-WholeBody 133")
    shuffled = list(names)
    random.Random(0).shuffle(shuffled)
    meta = dataset_files.keypoint_set(category(shuffled), Path("annotations.json"))
    mirror_of = {names[a]: names[b] for a, b in enumerate(mirrors(133, pairs))}
    got = mirrors(133, meta["flip_pairs"])
    assert all(mirror_of[shuffled[i]] == shuffled[got[i]] for i in range(133))
    assert meta["sigmas"] == [sigmas[names.index(name)] for name in shuffled]
    assert all(a < b for a, b in meta["flip_pairs"]) and len(meta["flip_pairs"]) == len(pairs)


def test_the_annotations_own_pairs_and_sigmas_win():
    names, _, _ = official("COCO 17")
    meta = dataset_files.keypoint_set(category(names, flip_pairs=[[1, 2]], sigmas=[0.1] * 17), Path("a.json"))
    assert meta["flip_pairs"] == [[1, 2]] and meta["flip_pairs_from"] == "annotations" and meta["sigmas"] == [0.1] * 17


def test_the_tables_equal_the_original_config():
    """data/keypoints308.json and data/coco_wholebody133.json hold what the original's config defines (run with
    runpy from a scratch copy, as tests/fixtures/make_keypoint_tables.py writes them)."""
    if not Path(ORIGINAL_REPO).is_dir():
        pytest.skip(f"the original repository is not at {ORIGINAL_REPO} (set SAPIENS2_REPO)")
    sys.path.insert(0, str(FIXTURES))
    try:
        import make_keypoint_tables as maker
    finally:
        sys.path.remove(str(FIXTURES))
    import runpy
    import subprocess
    import tempfile

    source = subprocess.check_output(["git", "-C", ORIGINAL_REPO, "show", f"HEAD:{maker.CONFIG}"], text=True)
    with tempfile.TemporaryDirectory() as scratch:
        script = Path(scratch) / "keypoints308.py"
        script.write_text(source)
        config = runpy.run_path(str(script), run_name="config")
    for info, file in ((config["dataset_info"], "keypoints308.json"), (config["coco_wholebody_info"],
                                                                        "coco_wholebody133.json")):
        expected = maker.table(info["keypoint_info"], info["sigmas"], info["dataset_name"], {})
        stored = processing.read_data(file)
        for key in ("keypoint_names", "flip_pairs", "flip_indices", "sigmas"):
            assert stored[key] == expected[key], (file, key)


def test_an_unknown_set_is_paired_by_names_with_a_warning_in_the_train_log(tmp_path):
    data = make_dataset("pose", tmp_path / "data", count=4)
    names = ["head", "left_eye", "right_eye", "l_ear", "r_ear"] + [f"point{i}" for i in range(12)]
    for split in ("train", "val"):
        path = data / split / "annotations.json"
        coco = json.loads(path.read_text())
        coco["categories"][0]["keypoints"] = names
        path.write_text(json.dumps(coco))
    out = tmp_path / "run"
    assert run_train("pose", data, out, tiny_backbone(tmp_path), "--steps", 1) == 0
    notes = [note for note in read_log(out)[0]["notes"] if note.startswith("warning:")]
    assert len(notes) == 1, read_log(out)[0]["notes"]
    assert "2 pairs: left_eye<->right_eye, l_ear<->r_ear" in notes[0]
    assert "(unpaired): head, point0, point1" in notes[0] and "point11." in notes[0]
    saved = json.loads((out / "config.json").read_text())
    assert saved["flip_pairs"] == [[1, 2], [3, 4]] and saved["sapiens2_training"]["flip_pairs_from"] == "names"


def test_the_pairs_travel_with_the_model_into_its_flip_test(tmp_path):
    """keypoint_set -> the new head -> the saved model -> weights.load: the flip test (predict.py's) swaps the
    official COCO-WholeBody mirrors, here for a shuffled order of the names."""
    names, pairs, _ = official("COCO-WholeBody 133")
    shuffled = list(names)
    random.Random(1).shuffle(shuffled)
    meta = dataset_files.keypoint_set(category(shuffled), Path("annotations.json"))
    info = {"out_channels": 133, **meta}
    args = type("Args", (), {"resume": False, "model": str(tiny_backbone(tmp_path)), "out": None, "size": None,
                             "head": [[8, 8], [8]], "task": "pose", "seed": 0, "random_init": "never",
                             "random_backbone": None})()
    model, _ = starting_model.build_model(args, info, log=lambda message: None)
    loaded = weights.load(weights.save(model, tmp_path / "pose"), task="pose").eval()
    assert loaded.flip_pairs().tolist() == meta["flip_pairs"]
    x = torch.randn(1, 3, 64, 48)
    with torch.no_grad():
        plain, mirrored = loaded(x).heatmaps, loaded(x.flip(-1)).heatmaps
        got = loaded.flip_test(x)
    mirror_of = {names[a]: names[b] for a, b in enumerate(mirrors(133, pairs))}
    order = [shuffled.index(mirror_of[name]) for name in shuffled]  # channel k of the mirror holds k's mirror
    torch.testing.assert_close(got, (plain + mirrored[:, order].flip(-1)) / 2, atol=1e-6, rtol=0)


# ----------------------------------------------------------------------------------------------------
# Evaluation: COCO keypoint AP/AR as pycocotools computes it, the original's scores, OKS NMS and PCK
# ----------------------------------------------------------------------------------------------------
# float64 throughout; sums taken in another order than numpy's: equal to ~1e-15, asserted to 1e-12.
TOLERANCE = 1e-12


def synthetic_people(count_keypoints: int, noise: tuple[float, float], seed: int = 0) -> dict:
    """Ground truth and predictions over 9 images: 22 people of small, medium and large areas, some keypoints
    invisible and one person with none visible (COCO ignores them), predictions with varied errors and scores,
    missed people, false positives, an image with predictions only and one with 22 (over COCO's 20 per image)."""
    rng = np.random.default_rng(seed)
    truth, boxes, areas, truth_image, keypoints, scores, image = [], [], [], [], [], [], []
    people_per_image = [1, 3, 2, 4, 1, 5, 3, 0, 3]
    for i, count in enumerate(people_per_image):
        for _ in range(count):
            w, h = rng.uniform(15, 220), rng.uniform(20, 330)
            x, y = rng.uniform(0, 400), rng.uniform(0, 300)
            points = np.stack([rng.uniform(x, x + w, count_keypoints), rng.uniform(y, y + h, count_keypoints)], -1)
            visibility = rng.choice([0, 1, 2], count_keypoints, p=[0.2, 0.3, 0.5])
            if len(truth) == 5:
                visibility[:] = 0
            truth.append(np.concatenate([points, visibility[:, None]], -1))
            boxes.append([x, y, w, h])
            areas.append(w * h * rng.uniform(0.5, 0.9))
            truth_image.append(i)
            repeats = 8 if i == 8 else (0 if rng.uniform() < 0.15 else 1)  # image 8: 3 x 8 = 24 predictions
            for _ in range(repeats):
                spread = rng.uniform(*noise) * np.sqrt(w * h)
                keypoints.append(points + rng.normal(0, spread, points.shape))
                scores.append(rng.uniform(0.05, 1.0))
                image.append(i)
    for i in (0, 3, 7):  # false positives (image 7 has no people)
        keypoints.append(np.stack([rng.uniform(0, 500, count_keypoints), rng.uniform(0, 500, count_keypoints)], -1))
        scores.append(rng.uniform(0.05, 1.0))
        image.append(i)
    as_array = lambda values: np.array(values, dtype=np.float64)  # noqa: E731
    return {"truth": as_array(truth), "boxes": as_array(boxes), "areas": as_array(areas),
            "truth_image": np.array(truth_image), "keypoints": as_array(keypoints), "scores": as_array(scores),
            "image": np.array(image), "images": len(people_per_image)}


def pycocotools_stats(people: dict, sigmas, keep=None) -> np.ndarray:
    """COCOeval(iouType="keypoints") of the predictions (those in `keep`) with the keypoint set's sigmas."""
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    K = people["truth"].shape[1]
    annotations = [{"id": n + 1, "image_id": int(i), "category_id": 1, "iscrowd": 0, "area": float(area),
                    "bbox": [float(v) for v in box], "keypoints": truth.ravel().tolist(),
                    "num_keypoints": int((truth[:, 2] > 0).sum())}
                   for n, (i, truth, box, area) in enumerate(zip(people["truth_image"], people["truth"],
                                                                 people["boxes"], people["areas"]))]
    keep = range(len(people["scores"])) if keep is None else keep
    results = [{"image_id": int(people["image"][d]), "category_id": 1, "score": float(people["scores"][d]),
                "keypoints": np.concatenate([people["keypoints"][d], np.ones((K, 1))], -1).ravel().tolist()}
               for d in keep]
    with contextlib.redirect_stdout(io.StringIO()):
        truth = COCO()
        truth.dataset = {"images": [{"id": i} for i in range(people["images"])], "annotations": annotations,
                         "categories": [{"id": 1, "name": "person", "keypoints": [f"k{k}" for k in range(K)]}]}
        truth.createIndex()
        evaluation = COCOeval(truth, truth.loadRes(results), "keypoints")
        evaluation.params.kpt_oks_sigmas = np.array(sigmas)
        evaluation.evaluate()
        evaluation.accumulate()
        evaluation.summarize()
    return evaluation.stats


def ours(people: dict, sigmas) -> dict:
    t = {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in people.items()}
    return pose_metrics.coco_keypoint_stats(t["truth_image"], t["truth"], t["boxes"], t["areas"], t["image"],
                                       t["keypoints"], t["scores"], torch.tensor(sigmas, dtype=torch.float64))


@pytest.mark.parametrize("set_name, noise", [("COCO 17", (0.002, 0.08)), ("sapiens 308", (0.0005, 0.015))])
def test_keypoint_ap_equals_pycocotools(set_name, noise):
    """The ten COCOeval numbers (AP over OKS .50:.05:.95 of the score-ranked predictions, 101 recall points, 20 per
    image, all/medium/large areas; AR) with COCO's 17 sigmas and the original's 308 (data/keypoints308.json)."""
    sigmas = official(set_name)[2]
    people = synthetic_people(len(sigmas), noise)
    got, expected = ours(people, sigmas), pycocotools_stats(people, sigmas)
    assert list(got) == list(pose_metrics.COCO_KEYPOINT_STATS)
    np.testing.assert_allclose(list(got.values()), expected, atol=TOLERANCE, rtol=0)
    assert 0.2 < got["AP"] < 0.8 and got["AP (M)"] >= 0 and got["AP (L)"] >= 0  # a set that tells them apart
    # today's unranked share (mean over the thresholds of the people with OKS >= t) is another number
    oks = pose_metrics.oks_matrix(torch.from_numpy(people["keypoints"]), torch.from_numpy(people["truth"]),
                             torch.from_numpy(people["boxes"]), torch.from_numpy(people["areas"]),
                             torch.tensor(sigmas, dtype=torch.float64))
    assert abs(got["AP"] - (oks.amax(0)[:, None] >= pose_metrics.OKS_THRESHOLDS).double().mean().item()) > 0.02


def test_the_original_scores_and_oks_nms_then_coco():
    """original_keypoint_stats = the original evaluator's person scores (mean keypoint score above 0.2) and OKS NMS
    at 0.9 per image (tests/fixtures/original_pose_eval.py), then pycocotools; two near-copies of one person in
    an image, so that NMS drops one."""
    sigmas = official("COCO 17")[2]
    people = synthetic_people(17, (0.005, 0.15), seed=1)
    n = len(people["truth"])  # one prediction per truth (top-down), its keypoint scores
    rng = np.random.default_rng(2)
    keypoints = people["truth"][..., :2] + rng.normal(0, 2.0, (n, 17, 2))
    keypoints[1] = keypoints[2] + 0.5  # two people of image 1 predicted at the same place
    keypoint_scores = rng.uniform(0, 1, (n, 17))
    keypoint_scores[0, :] = 0.1  # no keypoint above 0.2: score 0
    pipeline = {**people, "keypoints": keypoints, "image": people["truth_image"]}
    got = pose_metrics.original_keypoint_stats(torch.from_numpy(pipeline["image"]), torch.from_numpy(keypoints),
                                          torch.from_numpy(keypoint_scores), torch.from_numpy(people["truth"]),
                                          torch.from_numpy(people["boxes"]), torch.from_numpy(people["areas"]),
                                          torch.tensor(sigmas, dtype=torch.float64))
    pipeline["scores"] = np.array([original.instance_score(1.0, s) for s in keypoint_scores])
    keep = []
    for i in np.unique(pipeline["image"]):
        members = np.nonzero(pipeline["image"] == i)[0]
        extent = np.ptp(keypoints[members], axis=1)
        database = [{"score": pipeline["scores"][m], "area": extent[j, 0] * extent[j, 1],
                     "keypoints": np.concatenate([keypoints[m], keypoint_scores[m][:, None]], -1)}
                    for j, m in enumerate(members)]
        keep += [members[j] for j in original.oks_nms(database, 0.9, sigmas=np.array(sigmas))]
    assert len(keep) == n - 1 and pipeline["scores"][0] == 0
    np.testing.assert_allclose(list(got.values()), pycocotools_stats(pipeline, sigmas, sorted(keep)),
                               atol=TOLERANCE, rtol=0)


def test_pck_is_averaged_per_keypoint_as_the_original():
    rng = np.random.default_rng(3)
    truth = rng.uniform(0, 100, (30, 17, 2))
    predicted = truth + rng.normal(0, 4, truth.shape) * rng.uniform(0.2, 2, (1, 17, 1))
    visible = rng.uniform(size=(30, 17)) < np.linspace(0.1, 0.95, 17)  # keypoints seen unequally often
    visible[:, 4] = False  # never seen: does not count
    norm = np.repeat(rng.uniform(40, 120, (30, 1)), 2, 1)
    norm[7] = 0  # a zero norm factor: that person does not count
    accuracy, mean, count = pose_metrics.keypoint_pck_accuracy(torch.from_numpy(predicted), torch.from_numpy(truth),
                                                          torch.from_numpy(visible), 0.05, torch.from_numpy(norm))
    expected = original.keypoint_pck_accuracy(predicted, truth, visible, 0.05, norm.copy())
    np.testing.assert_allclose(accuracy.numpy(), expected[0], atol=1e-12, rtol=0)
    assert mean == pytest.approx(expected[1], abs=1e-12) and count == expected[2] == 16
    pooled = ((np.linalg.norm((predicted - truth) / norm.clip(1e-6)[:, None], axis=-1) < 0.05) & visible)
    assert abs(mean - pooled[np.arange(30) != 7].sum() / visible[np.arange(30) != 7].sum()) > 0.01


class FakeProcess:
    """Rank `rank` of 2 on the CPU; its all_reduce adds the other rank's tensor (`other`) to its own."""

    def __init__(self, rank: int, other):
        self.rank, self.world, self.device, self.other, self.reduced = rank, 2, torch.device("cpu"), other, None

    def all_reduce(self, tensor):
        self.reduced = tensor.clone()
        return tensor if self.other is None else tensor + self.other


def test_validation_runs_the_flip_test_and_logs_the_original_names_first(tmp_path):
    """train.evaluate on pose: the original's val_cfg flip_test=True (mean of the crop's heatmaps and its mirror's,
    flipped back with the pairs), then the metrics; COCO's names first, pck@0.05 after them."""
    data = make_dataset("pose", tmp_path / "data", count=4)
    info = datasets.dataset_info("pose", data)
    val = datasets.build_dataset("pose", data, "val", SIZE, False, info)
    args = type("Args", (), {"resume": False, "model": str(tiny_backbone(tmp_path)), "out": None, "size": None,
                             "head": [[8, 8], [8]], "task": "pose", "seed": 0, "random_init": "never",
                             "random_backbone": None, "batch_size": 3, "workers": 0, "precision": None})()
    model, _ = starting_model.build_model(args, info, log=lambda message: None)
    model.eval()
    got = train.evaluate(model, val, args, info, distributed.Distributed("cpu"))
    assert list(got) == [*pose_metrics.COCO_KEYPOINT_STATS, "pck@0.05"]
    # on two processes (rank 1 then rank 0 here, their all_reduce a sum): rank 0 gets rows 0-2, rank 1 row 3 and
    # two padding rows; the one all_reduce gathers every person once
    rank1 = FakeProcess(1, None)
    train.evaluate(model, val, args, info, rank1)
    assert train.evaluate(model, val, args, info, FakeProcess(0, rank1.reduced)) == got
    batch = datasets.collate([val[(i, 0)] for i in range(len(val))])
    expected = {}
    for flip in (True, False):
        evaluation = pose_metrics.PoseEvaluation(info, val.people)
        with torch.no_grad():
            heatmaps = model.flip_test(batch["pixel_values"]) if flip else model(batch["pixel_values"]).heatmaps
        evaluation.update(heatmaps, batch, torch.ones(len(val)), range(len(val)))
        expected[flip] = evaluation.result()
    assert got == pytest.approx(expected[True], abs=1e-6) and got != pytest.approx(expected[False], abs=1e-6)
