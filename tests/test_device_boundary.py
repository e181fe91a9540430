"""The model's device and the host in predict.py (docs/predict.md#where-the-work-runs): every file of every task is
byte-identical to what predict.py wrote before (commit REFERENCE, run from its own files in a process of its own, on
the same checkpoints and photos); results leave the device at one point (inference.HostCopies, mocked here) and only
as what the files need; no preprocessing or post-processing step runs on what crossed; each photo goes to the device
once. On CUDA only: how far the device's outputs may differ from the CPU's."""

import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import predict
from sapiens2 import processing
from sapiens2_app.predict import inference
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
            "--device", "cpu", "--detector", "seg", "--no-flip",  # pose: boxes from the uint8 class maps' blobs
            *model_args(checkpoints, {*tasks.split(","), "seg"}), *extra]


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
    # pose (one person: the whole image): keypoints, scores, keypoint ids, box; not 308 heatmaps
    ("pose", [((308, 2), torch.float32), ((308,), torch.float32), ((308,), torch.int64), ((4,), torch.float32)]),
])
def test_only_what_the_files_need_leaves_the_device(checkpoints, photos, tmp_path, monkeypatch, task, expected):
    recorders, real_init = [], inference.Inference.__init__

    def init(self, *args, **kwargs):  # the Inference predict.py builds gets a Recorder as its boundary
        real_init(self, *args, **kwargs)
        self.to_host = Recorder()
        recorders.append(self.to_host)

    monkeypatch.setattr(inference.Inference, "__init__", init)
    argv = [task, str(photos / "a.jpg"), "-o", str(tmp_path), "--workers", "0", "--detector", "none",
            *model_args(checkpoints, [task])]
    assert predict.main(argv) == 0
    (recorder,) = recorders
    assert sorted(recorder.seen, key=str) == sorted(expected, key=str)
    manifest = json.loads((tmp_path / "run.json").read_text())
    copied = sum(torch.Size(shape).numel() * dtype.itemsize for shape, dtype in expected)
    assert manifest["device_to_host"] == {"bytes": copied, "tensors": len(expected), "bytes_per_image": copied}


class Crossed(torch.Tensor):
    """A tensor that went through the device boundary; what torch computes from it keeps the mark."""


DEVICE_STAGES = ("preprocess", "preprocess_crops", "resize", "normalize", "crop_people", "postprocess_segmentation",
                 "class_ids", "postprocess_normals", "unit_length", "postprocess_pointmap", "gaussian_blur",
                 "postprocess_albedo", "albedo_to_uint8", "postprocess_matting", "float_to_uint8", "postprocess_pose",
                 "decode_heatmaps")  # the tensor math docs/predict.md puts on the model's device


def crossed_in(value) -> bool:
    if isinstance(value, (list, tuple)):
        return any(crossed_in(one) for one in value)
    if isinstance(value, dict):
        return any(crossed_in(one) for one in value.values())
    return isinstance(value, Crossed)


def test_no_device_stage_runs_on_what_crossed_to_the_host(checkpoints, photos, tmp_path, monkeypatch):
    """Every task (pose: the whole image): results are marked where they leave the device (the boundary, mocked),
    and no preprocessing or post-processing step is ever given a marked tensor, so with a GPU none of them runs on
    the host."""
    real_copy, device_calls = inference.HostCopies.__call__, []

    def mark(value):
        if isinstance(value, (list, tuple)):
            return type(value)(mark(one) for one in value)
        if isinstance(value, dict):
            return {key: mark(one) for key, one in value.items()}
        return value.as_subclass(Crossed) if torch.is_tensor(value) else value

    def guarded(name, function):
        def stage(*args, **kwargs):
            assert not crossed_in(args) and not crossed_in(kwargs), f"{name} ran on a tensor already on the host"
            device_calls.append(name)
            return function(*args, **kwargs)
        return stage

    monkeypatch.setattr(inference.HostCopies, "__call__", lambda self, value: mark(real_copy(self, value)))
    for name in DEVICE_STAGES:
        monkeypatch.setattr(processing, name, guarded(name, getattr(processing, name)))
    argv = [ALL_TASKS, str(photos / "a.jpg"), "-o", str(tmp_path), "--workers", "0", "--detector", "none",
            *model_args(checkpoints, ALL_TASKS.split(","))]
    assert predict.main(argv) == 0
    assert {"preprocess", "preprocess_crops", "postprocess_segmentation", "postprocess_pose", "postprocess_matting",
            "postprocess_albedo", "postprocess_pointmap", "postprocess_normals"} <= set(device_calls)
    assert len(list(tmp_path.glob("a.*"))) >= 10  # the files were made, from marked results


class OnDevice(torch.Tensor):
    """A photo copied to the model's device (on a CPU the copy is a no-op: the mark makes it visible)."""


@pytest.mark.parametrize("workers", [0, 2])
def test_each_photo_goes_to_the_device_once_for_every_task(checkpoints, photos, tmp_path, monkeypatch, workers):
    """seg, normal and pose (crops of the whole image), serial and pipelined (inputs made ahead): one copy of each
    photo, and every model input is made from it."""
    copies, real_preprocess, real_crops = [], processing.preprocess, processing.preprocess_crops

    def on_device(self, images):
        copies.extend(image for image in images if not isinstance(image, OnDevice))
        return [image if isinstance(image, OnDevice) else image.as_subclass(OnDevice) for image in images]

    def from_device_copies(function):
        def preprocess(images, *args, **kwargs):
            assert all(isinstance(image, OnDevice) for image in images), "an input made from the host's photo"
            return function(images, *args, **kwargs)
        return preprocess

    monkeypatch.setattr(inference.Inference, "on_device", on_device)
    monkeypatch.setattr(processing, "preprocess", from_device_copies(real_preprocess))
    monkeypatch.setattr(processing, "preprocess_crops", from_device_copies(real_crops))
    argv = ["seg,normal,pose", str(photos), "-o", str(tmp_path), "--workers", str(workers), "--detector", "none",
            "--batch-size", "2", *model_args(checkpoints, ["seg", "normal", "pose"])]
    assert predict.main(argv) == 0
    assert len(copies) == len(SIZES)


def test_seg_class_maps_are_uint8_up_to_256_classes():
    assert inference.class_map_dtype(29) == torch.uint8 and inference.class_map_dtype(256) == torch.uint8
    assert inference.class_map_dtype(257) == torch.int16  # a fine-tune with more classes keeps its ids (overlay)


# ----------------------------------------------------------------------------------------------------
# On CUDA: the device's post-processing against the CPU's, on the same inputs (docs/predict.md#where-the-work-runs)
# ----------------------------------------------------------------------------------------------------
EPS = torch.finfo(torch.float32).eps  # every step below computes in fp32 (pose's DARK step: float64, rounded to fp32)
PHOTO = (80, 60)  # the maps below are upsampled to it from 32x24, as a photo is from the model's output


def cuda_device() -> torch.device:
    if not torch.cuda.is_available():
        pytest.skip("CUDA only: compares the device's post-processing with the CPU's")
    return torch.device("cuda")


def both(function, *tensors, device):
    """`function` of `tensors` on the CPU and on `device`, the second brought back to the CPU."""
    on_device = function(*(t.to(device) for t in tensors))
    return function(*tensors), (on_device.cpu() if torch.is_tensor(on_device) else on_device)


def check_resized_inputs(device):
    """Area (shrinking), cubic (growing) and linear resizes, and person crops, rounded to uint8: at most one grey
    level apart, where a value sits at .5 before rounding (rare)."""
    generator = torch.Generator().manual_seed(0)
    photo = F.interpolate(torch.rand(1, 3, 12, 9, generator=generator) * 255, size=(300, 225), mode="bicubic")
    photo = photo.clamp(0, 255).round().to(torch.uint8)[0]
    cases = [lambda p: processing.resize(p, (64, 48), "area"), lambda p: processing.resize(p, (64, 48), "bilinear"),
             lambda p: processing.resize(p[:, :40, :30], (64, 48), "bicubic"),
             lambda p: processing.crop_people(p, [[20.0, 30.0, 100.0, 200.0], [0, 0, 40, 20]], (64, 48))]
    for case in cases:
        cpu, other = both(case, photo, device=device)
        difference = (cpu.float() - other.float()).abs()
        assert difference.max() <= 1 and (difference > 0).float().mean() < 0.01


def check_seg(device):
    """Class maps differ only where the two highest upsampled logits are within rounding of each other: bilinear
    weights and sums in fp32, a few ulp of the largest logit apart (16 ulp allowed)."""
    logits = torch.randn(1, 29, 32, 24, generator=torch.Generator().manual_seed(1)) * 4
    row = processing.ModelInputs(None, [PHOTO], [(0, 0, 32, 24)], (32, 24))
    scores = processing.postprocess_segmentation(logits, row, return_scores=True)[0]["scores"]
    cpu, other = both(lambda x: processing.postprocess_segmentation(x, row)[0], logits, device=device)
    top2 = scores.topk(2, dim=0).values
    clear = (top2[0] - top2[1]) > 16 * EPS * logits.abs().max()
    assert torch.equal(cpu[clear], other[clear]) and clear.float().mean() > 0.99


def check_dense(device):
    """Normals (unit vectors) and smoothed pointmaps within 16 ulp of their largest value: bilinear sums and the
    pointmap's four 3x3 blurs in fp32 in another order (TF32 convolutions would be ~1e-3 off and fail here)."""
    generator = torch.Generator().manual_seed(2)
    padded = processing.ModelInputs(None, [PHOTO], [(4, 0, 28, 24)], (32, 24))  # a padded task's row
    normals = torch.randn(1, 3, 32, 24, generator=generator)
    cpu, other = both(lambda n: processing.postprocess_normals(n, padded)[0], normals, device=device)
    assert (cpu - other).abs().max() <= 16 * EPS
    points, scales = torch.randn(1, 3, 32, 24, generator=generator) * 3, torch.tensor([[1.5]])
    cpu, other = both(lambda p, s: processing.postprocess_pointmap(p, s, padded)[0]["pointmap"], points, scales,
                      device=device)
    assert (cpu - other).abs().max() <= 16 * EPS * cpu.abs().max()


def check_uint8_files(device):
    """Albedo, alpha and composite as the PNG/JPEG files store them: one grey level apart at most, where x * 255
    lands on an integer within rounding (rare)."""
    generator = torch.Generator().manual_seed(3)
    maps = torch.rand(1, 4, 32, 24, generator=generator)
    row = processing.ModelInputs(None, [PHOTO], [(0, 0, 32, 24)], (32, 24))
    outputs = [lambda m: processing.albedo_to_uint8(processing.postprocess_albedo(m[:, :3], row)[0]),
               lambda m: processing.postprocess_matting(m[:, :3] * m[:, 3:], m[:, 3:], [PHOTO], (255, 255, 255))[0][
                   "composite"],
               lambda m: processing.float_to_uint8(processing.postprocess_matting(m[:, :3], m[:, 3:], [PHOTO])[0][
                   "alpha"])]
    for output in outputs:
        cpu, other = both(output, maps, device=device)
        difference = (cpu.float() - other.float()).abs()
        assert difference.max() <= 1 and (difference > 0).float().mean() < 0.01


def check_pose(device):
    """DARK-UDP on peaked maps (a trained model's): scores (the maxima) exactly; keypoints from float64 sums in
    another order, rounded to fp32: within 16 ulp of the map's width."""
    generator = torch.Generator().manual_seed(4)
    y, x = torch.arange(64.0).view(-1, 1), torch.arange(48.0).view(1, -1)
    centres = torch.rand(2, 17, 2, 1, 1, generator=generator) * torch.tensor([47.0, 63.0]).view(2, 1, 1)
    heatmaps = torch.exp(-((x - centres[:, :, 0]) ** 2 + (y - centres[:, :, 1]) ** 2) / (2 * 2.0**2))
    heatmaps = heatmaps + 0.01 * torch.rand(heatmaps.shape, generator=generator)
    (cpu_xy, cpu_scores), (xy, scores) = processing.decode_heatmaps(heatmaps), processing.decode_heatmaps(
        heatmaps.to(device))
    assert torch.equal(cpu_scores, scores.cpu())
    assert (cpu_xy - xy.cpu()).abs().max() <= 16 * EPS * 48


@pytest.mark.parametrize("check", [check_resized_inputs, check_seg, check_dense, check_uint8_files, check_pose])
def test_on_cuda_outputs_differ_from_the_cpu_only_in_their_last_bits(check):
    check(cuda_device())
