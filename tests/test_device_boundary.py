"""Where predict.py's results leave the model's device (inference.HostCopies): only what the files need crosses, and
moving the post-processing there left every file of every task byte-identical to what predict.py wrote before
(commit REFERENCE, run from its own files in a process of its own, on the same checkpoints and photos)."""

import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

import predict
from sapiens2_app import inference
from test_pipeline import contents
from test_predict import ALL_TASKS, checkpoints, model_args, write_images  # noqa: F401 (a fixture)

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = "801faeb"  # main before the post-processing moved to the device: its files are the reference
SIZES = {"a.jpg": (80, 60), "sub/b.png": (45, 70)}  # (H, W): upsampled from the tiny models' maps, one padded
EVERY_KIND = "raw,json,vis,openpose,coco,ply,depth16"
# masking acts on the host, after the copy: both ways for the tasks it masks
RUNS = {"plain": [ALL_TASKS], "masked": ["normal,pointmap,albedo", "--mask-with-seg"]}


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> Path:
    return write_images(tmp_path_factory.mktemp("photos"), SIZES)


def predict_args(photos: Path, out: Path, checkpoints, run: list[str]) -> list[str]:
    tasks, *extra = run
    return [tasks, str(photos), "-o", str(out), "--save", EVERY_KIND, "--workers", "0", "--batch-size", "2",
            "--device", "cpu", "--detector", "seg", *model_args(checkpoints, {*tasks.split(","), "seg"}), *extra]


def reference_checkout(folder: Path) -> Path:
    """The files of REFERENCE (skipped where this checkout has no git history to take them from)."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", REFERENCE], capture_output=True)
    if archive.returncode != 0:
        pytest.skip(f"commit {REFERENCE} is not in this checkout's history (a shallow clone or an archive): "
                    f"{archive.stderr.decode().strip()}")
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(folder, filter="data")
    return folder


def run_reference(code: Path, runs: dict[str, list[str]]):
    """predict.main of the REFERENCE checkout for each argument list, in one process whose modules are its own."""
    script = ("import json, sys; sys.path.insert(0, sys.argv[1]); import predict\n"
              "for argv in json.loads(sys.argv[2]): assert predict.main(argv) == 0, argv")
    done = subprocess.run([sys.executable, "-c", script, str(code), json.dumps(list(runs.values()))], cwd=code,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]


def test_every_file_of_every_task_is_byte_identical_to_the_reference(checkpoints, photos, tmp_path):
    code = reference_checkout(tmp_path / "reference-code")
    before = {name: predict_args(photos, tmp_path / f"before-{name}", checkpoints, run) for name, run in RUNS.items()}
    run_reference(code, before)
    for name, run in RUNS.items():
        assert predict.main(predict_args(photos, tmp_path / f"after-{name}", checkpoints, run)) == 0
        old, new = contents(tmp_path / f"before-{name}"), contents(tmp_path / f"after-{name}")
        suffixes = {path.split(".", 1)[1] for path in new if "." in path}
        assert len(suffixes) >= (15 if name == "plain" else 6), sorted(suffixes)  # every file kind: none untested
        assert old.keys() == new.keys()
        assert [path for path in old if old[path] != new[path]] == [], name


class Recorder(inference.HostCopies):
    """HostCopies that also records (shape, dtype) of every tensor that leaves the device."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[tuple, torch.dtype]] = []

    def __call__(self, value):
        if torch.is_tensor(value):
            self.seen.append((tuple(value.shape), value.dtype))
        return super().__call__(value)


@pytest.mark.parametrize("task, expected", [
    # seg: the photo's class map as uint8, not 29 x 64 x 48 fp32 logits (nor 29 full-size maps, nor int64)
    ("seg", [((80, 60), torch.uint8)]),
    # matting: what its two files hold, as uint8; the premultiplied foreground stays on the device
    ("matting", [((80, 60), torch.uint8), ((3, 80, 60), torch.uint8)]),
    ("albedo", [((3, 80, 60), torch.uint8)]),
    ("normal", [((3, 80, 60), torch.float32)]),  # the .npy stores these
])
def test_only_what_the_files_need_leaves_the_device(checkpoints, photos, tmp_path, monkeypatch, task, expected):
    recorders, real_init = [], inference.Inference.__init__

    def init(self, *args, **kwargs):  # the Inference predict.py builds gets a Recorder as its boundary
        real_init(self, *args, **kwargs)
        self.to_host = Recorder()
        recorders.append(self.to_host)

    monkeypatch.setattr(inference.Inference, "__init__", init)
    argv = [task, str(photos / "a.jpg"), "-o", str(tmp_path), "--workers", "0", *model_args(checkpoints, [task])]
    assert predict.main(argv) == 0
    (recorder,) = recorders
    assert sorted(recorder.seen, key=str) == sorted(expected, key=str)
    manifest = json.loads((tmp_path / "run.json").read_text())
    copied = sum(torch.Size(shape).numel() * dtype.itemsize for shape, dtype in expected)
    assert manifest["device_to_host"] == {"bytes": copied, "tensors": len(expected), "bytes_per_image": copied}


def test_seg_class_maps_are_uint8_up_to_256_classes():
    assert inference.class_map_dtype(29) == torch.uint8 and inference.class_map_dtype(256) == torch.uint8
    assert inference.class_map_dtype(257) == torch.int16  # a fine-tune with more classes keeps its ids (overlay)
