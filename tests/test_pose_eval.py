"""Pose fine-tuning as the original trains and evaluates it: the official flip pairs of the keypoint sets it ships
(data/, from sapiens/pose/configs/_base_/keypoints308.py), and the validation metrics of its Keypoints308Evaluator."""

import json
import os
import random
import sys
from pathlib import Path

import pytest
import torch

import processing
import weights
from sapiens2_app import dataset_files, starting_model
from test_train import make_dataset, read_log, run_train, tiny_backbone

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
