"""The seams between train.py, weights.py, predict.py, export.py and transformers, end to end on tiny models:
what train.py writes loads with its labels, saves in both formats, is read by transformers 5.23 (same outputs,
fp32 RoPE, 1e-5) and exports (ONNX + torch.export, within export.py's own check); a transformers-saved gelu
model fine-tunes and keeps its activation; export.py takes predict.py's --conventions."""

import json
import os
import re

import pytest
import torch

import export
import predict
import train
from sapiens2 import weights
from sapiens2_app.export import checks, formats
from conftest import rel_err
from test_train import COCO17, make_dataset, run_train, tiny_backbone

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
transformers = pytest.importorskip("transformers")

SEG_NAMES = ["background", "red", "blue", "green"]  # 4 classes, the 4th never in the masks
COCO17_PAIRS = [(1, 2), (3, 4), (5, 6), (7, 8), (9, 10), (11, 12), (13, 14), (15, 16)]
HF_CLASS = {"seg": (transformers.Sapiens2ForSemanticSegmentation, "logits"),
            "pose": (transformers.Sapiens2ForPoseEstimation, "heatmaps")}
TOL = 1e-5  # fp32 RoPE, same fp32 arithmetic as transformers


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """train.py runs of 2 steps: seg with 4 named classes, pose with the COCO 17-keypoint set."""
    root = tmp_path_factory.mktemp("trained")
    backbone = tiny_backbone(root)
    runs = {}
    for task in ("seg", "pose"):
        data = make_dataset(task, root / f"{task}-data")
        if task == "seg":
            (data / "classes.json").write_text(json.dumps(SEG_NAMES))
        runs[task] = root / f"{task}-run"
        assert run_train(task, data, runs[task], backbone, "--steps", 2) == 0
    return runs


def outputs(model, x, name):
    with torch.no_grad():
        return getattr(model(x), name)


@pytest.mark.parametrize("task", ["seg", "pose"])
def test_trained_model_keeps_its_labels_through_both_formats_and_transformers(task, trained, tmp_path):
    names, pairs = (SEG_NAMES, None) if task == "seg" else (COCO17, tuple(COCO17_PAIRS))
    model = weights.load(trained[task], rope_dtype="float32")
    assert model.labels == tuple(names) and model.head_config.flip_pairs == pairs
    x = torch.randn(2, 3, 64, 48, generator=torch.Generator().manual_seed(0))
    hf_class, output = HF_CLASS[task]
    want = outputs(model, x, output)
    for fmt in ("original", "hf"):
        for path in (tmp_path / f"{fmt}.safetensors", tmp_path / fmt):
            weights.save(model, path, format=fmt)
            again = weights.load(path, rope_dtype="float32")
            assert again.labels == tuple(names) and again.head_config.flip_pairs == pairs, path
            assert torch.equal(outputs(again, x, output), want), path
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["id2label"] == {str(i): n for i, n in enumerate(names)}
    assert config.get("flip_pairs") == (None if pairs is None else [list(p) for p in pairs])
    hf = hf_class.from_pretrained(tmp_path / "hf").eval()
    assert [hf.config.id2label[i] for i in range(len(names))] == names
    err = rel_err(outputs(hf, x, output), want)
    print(f"{task}: transformers vs ours {err:.2e}")
    assert err < TOL


@pytest.mark.parametrize("task, fmt", [(t, f) for t in ("seg", "pose") for f in ("onnx", "torch-export")])
def test_trained_model_exports(task, fmt, trained, tmp_path, capsys):
    path = tmp_path / f"{task}.{'onnx' if fmt == 'onnx' else 'pt2'}"
    assert export.main([task, "--model", str(trained[task]), "--format", fmt, "-o", str(path)]) == 0
    differences = capsys.readouterr().out
    print(differences)
    assert "max relative difference vs eager" in differences and path.exists()
    measured = float(re.search(r"(?:logits|heatmaps) (\S+)", differences)[1])
    assert measured < 1e-4  # tiny models are held to 1e-4, as in test_export (export.py's own bound: 2e-3)
    if fmt == "onnx":  # the names travel inside the artifact (a user of the .onnx needs the class/keypoint order)
        import onnx
        info = json.loads({p.key: p.value for p in onnx.load(str(path)).metadata_props}["sapiens2"])
        assert info["head_config"]["labels"] == (SEG_NAMES if task == "seg" else COCO17)


def test_export_takes_predicts_conventions(trained, tmp_path, capsys):
    """export.py --conventions as predict.py: transformers = fp32 RoPE, held to 1e-4; original = bf16 RoPE."""
    for conventions, rope, bound in (("transformers", "float32", "1e-04"), ("original", "bfloat16", "2e-03")):
        path = tmp_path / f"{conventions}.pt2"
        assert export.main(["seg", "--model", str(trained["seg"]), "--format", "torch-export", "-o", str(path),
                            "--conventions", conventions]) == 0
        assert f"RoPE {rope}, tolerance {bound}" in capsys.readouterr().out
        x = checks.example_input(1, (64, 48))
        model = weights.load(trained["seg"], rope_dtype=rope)
        with torch.no_grad(), formats.reference_kernels():
            assert torch.equal(torch.export.load(str(path)).module()(x)["logits"], model(x).logits)
    with pytest.raises(SystemExit):  # predict.py has no --rope any more, nor has export.py
        export.build_parser().parse_args(["seg", "-o", "x.onnx", "--rope", "float32"])


def transformers_seg_model(directory, upsample_channels):
    torch.manual_seed(0)
    config = transformers.Sapiens2Config(
        hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=96,
        num_key_value_attention_heads=2, num_first_full_attention_layers=1, num_last_full_attention_layers=1,
        image_size=[64, 48], hidden_act="gelu", id2label=dict(enumerate(SEG_NAMES)),
        head_config=dict(upsample_out_channels=upsample_channels, conv_out_channels=[8]))
    transformers.Sapiens2ForSemanticSegmentation(config).save_pretrained(directory)
    return directory


def fine_tune(data, out, model, *extra):
    return train.main(["seg", "--data", str(data), "-o", str(out), "--model", str(model), "--steps", "2",
                       "--workers", "0", "--no-progress", "--no-augment", "--batch-size", "4", *extra])


def test_transformers_gelu_seg_model_fine_tunes_and_predicts(tmp_path):
    hf_dir = transformers_seg_model(tmp_path / "hf", [16, 8, 8, 8])  # outputs at the input size, as released
    data = make_dataset("seg", tmp_path / "data")
    (data / "classes.json").write_text(json.dumps(SEG_NAMES))
    out = tmp_path / "run"
    assert fine_tune(data, out, hf_dir) == 0
    start = json.loads((out / "log.jsonl").read_text().splitlines()[0])
    assert "continuing" in json.dumps(start), start  # same task, same 4 outputs: the head is fine-tuned
    saved = json.loads((out / "config.json").read_text())
    assert saved["hidden_act"] == "gelu"
    model = weights.load(out, rope_dtype="float32")
    assert model.config.hidden_act == "gelu" and model.labels == tuple(SEG_NAMES)
    hf = transformers.Sapiens2ForSemanticSegmentation.from_pretrained(out).eval()
    x = torch.randn(1, 3, 64, 48)
    assert hf.config.hidden_act == "gelu" and rel_err(outputs(hf, x, "logits"), outputs(model, x, "logits")) < TOL
    assert predict.main(["seg", str(data / "val" / "images" / "im0.png"), "-o", str(tmp_path / "pred"),
                         "--model", str(out)]) == 0
    assert (tmp_path / "pred" / "im0.seg.png").exists()


def test_a_head_with_outputs_below_the_target_size_is_refused_before_training(tmp_path, capsys):
    """transformers (and weights.load) take a seg head with 2 upsampling layers (outputs at H/4); its logits
    cannot meet the full-size masks: a clear error naming the checkpoint and --head, not a traceback mid-step."""
    hf_dir = transformers_seg_model(tmp_path / "hf", [16, 8])
    data = make_dataset("seg", tmp_path / "data")
    (data / "classes.json").write_text(json.dumps(SEG_NAMES))
    assert fine_tune(data, tmp_path / "run", hf_dir) == 2
    err = capsys.readouterr().err
    assert f"{hf_dir}: this seg head has 2 upsampling layers" in err, err
    hint = re.search(r"e\.g\. --head (\S+) \(the default head for this backbone\)", err)
    assert hint and len(hint[1].split(":")[0].split(",")) == 4, err  # 4 upsampling layers: outputs at full size
    assert fine_tune(data, tmp_path / "run2", hf_dir, "--head", hint[1]) == 0  # the way out it names


def test_pose_run_fine_tunes_on_another_keypoint_set(trained, tmp_path):
    """A new head shaped like the checkpoint's (17 named keypoints) for 15 keypoints gets the data's names."""
    data = make_dataset("pose", tmp_path / "data")
    for split in ("train", "val"):
        path = data / split / "annotations.json"
        coco = json.loads(path.read_text())
        for annotation in coco["annotations"]:
            annotation["keypoints"] = annotation["keypoints"][: 3 * 15]
        category = coco["categories"][0]
        category.update(keypoints=COCO17[:15], sigmas=category["sigmas"][:15])
        path.write_text(json.dumps(coco))
    out = tmp_path / "run"
    assert train.main(["pose", "--data", str(data), "-o", str(out), "--model", str(trained["pose"]), "--steps", "1",
                       "--workers", "0", "--no-progress", "--no-augment", "--batch-size", "4"]) == 0
    model = weights.load(out)
    assert model.labels == tuple(COCO17[:15]) and model.head_config.flip_pairs == tuple(COCO17_PAIRS[:7])
