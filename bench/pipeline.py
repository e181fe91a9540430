"""predict.py's pipeline alone: everything but the model, per task and photo size, the serial runner against the
pipelined one, side by side in one run.

    python bench/pipeline.py                                   # the CPU table (bench/results/pipeline-cpu<N>t.json)
    python bench/pipeline.py --tasks seg --photos 1080x1440 --images 8 --workers 0,2
    python bench/pipeline.py --report bench/results/pipeline-cpu2t.json        # the table again, from the JSON
    python bench/pipeline.py --device cuda --real 0.4b --tasks seg            # on a GPU: real-size models too

Each row runs predict.main on synthetic photos (smooth random JPEGs) with the models replaced:
  free       the model costs nothing: each forward returns a cached output of the right shape (1024x768 input;
             pose: peaked maps, as a trained model's, not a random head's noise);
             images/s, and CPU ms per image per stage (thread CPU time, summed over the threads that ran it)
  stand-in   the models hold each batch for T ms per image in all (each model its share) without using the CPU
             (time.sleep), as a GPU would, with T = the time per image of the serial runner's free row (the CPU
             work of an image when nothing overlaps; the balanced case, where a serial loop gets 1/2 of the
             ideal); images/s against the ideal 1 / max(T, that CPU work) = 1 / T. (Not the process CPU time:
             torch's own threads make it larger than the wall time on a multi-core CPU, which would lower
             the ideal and flatter every row.)
  real       (--real SIZE) predict.py with real-size models (random weights: speed does not depend on them) against
             the model alone on the same batches (forward only, as bench/e2e.py times it): images/s of each, the
             ratio, and where the time goes (wall ms per image per stage)
`--workers 0` is the serial runner (decode, model, render, write, one image after the other); `--workers N` the
pipelined one (predict.py --workers). The files are the same either way (tests/test_pipeline.py).

Stages: decode (processing.load_image), preprocess (resizing, normalizing, crops), model, postprocess (back to the
photo: resize, argmax, heatmap decoding), to_host (inference.HostCopies: the results' copy off the model's device),
render (pictures and arrays), encode (PNG/JPEG/npy bytes), write (the atomic write of the bytes). preprocess and
postprocess run on the model's device: with --device cpu the CPU does them, with a GPU the host only launches them,
and its share of a photo is the HOST_STAGES (`host_ms_per_image_with_a_device`). Each row also gives the bytes that
left the device per photo (run.json's device_to_host).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
CODE_OF = "SAPIENS2_BENCH_CODE"  # a --baseline row's process: the checkout whose predict.py it runs
sys.path.insert(0, os.environ.get(CODE_OF, str(ROOT)))

from sapiens2 import heads  # noqa: E402
import predict  # noqa: E402
from sapiens2 import processing  # noqa: E402
from sapiens2 import Sapiens2Config  # noqa: E402
from sapiens2_app.common import safe_io  # noqa: E402
from sapiens2_app.predict import inference, models, outputs  # noqa: E402
from sapiens2_app.common.runtime_info import versions  # noqa: E402

MODEL_SIZE = (1024, 768)
# What stays on the host when the model's device is a GPU (preprocess and postprocess run on the device)
HOST_STAGES = ("decode", "to_host", "render", "encode", "write")
TASK_SETS = ("seg", "normal", "pose", "seg,normal,pose")
PHOTOS = ("1080x1440", "1920x1080")  # width x height
TINY = dict(embed_dim=32, depth=1, num_heads=2, full_attention_first=1, full_attention_last=1, image_size=MODEL_SIZE)
TINY_HEAD = ([16, 8, 8, 8], [8])  # only their outputs' shapes matter: the heads never run in a timed row


# ----------------------------------------------------------------------------------------------------
# Stand-in models
# ----------------------------------------------------------------------------------------------------
class CachedModel(torch.nn.Module):
    """A task model whose forward returns one cached output (expanded to the batch) after holding the batch for
    `hold_ms` per image without the CPU; everything else (head config, backbone config, flip pairs) is the real
    model's."""

    def __init__(self, real: heads.Sapiens2ForTask, hold_ms: float = 0.0):
        super().__init__()
        self.real, self.hold_ms = real, hold_ms
        self.task, self.head_config, self.backbone = real.task, real.head_config, real.backbone
        self.config = real.backbone.config  # where older checkouts look when the model is not a Sapiens2ForTask
        with torch.no_grad():
            self.cached = real(torch.zeros(1, 3, *MODEL_SIZE))
        if self.task == "pose":  # a trained model's maps: one peak each (a random head's noise decodes slower)
            self.cached.heatmaps = peaked_heatmaps(self.cached.heatmaps.shape)

    def forward(self, pixel_values: torch.Tensor):
        time.sleep(self.hold_ms * len(pixel_values) / 1000)
        fields = {name: value.expand(len(pixel_values), *value.shape[1:]) if torch.is_tensor(value) else value
                  for name, value in vars(self.cached).items()}
        return type(self.cached)(**fields)

    def flip_test(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self(pixel_values).heatmaps  # the model's cost is the stand-in's; the mean of two is not timed

    def flip_pairs(self, device=None):
        return self.real.flip_pairs(device)


def peaked_heatmaps(shape) -> torch.Tensor:
    """Heatmaps as a trained pose model's: per keypoint a Gaussian of the training sigma (processing.HEATMAP_SIGMA
    at 256x192) at a random place, its height 0.3 to 1, over faint noise."""
    generator = torch.Generator().manual_seed(0)
    people, keypoints, height, width = shape
    sigma = processing.HEATMAP_SIGMA * width / 192
    extent = torch.tensor([width - 1, height - 1]).view(2, 1, 1)
    centres = torch.rand(people, keypoints, 2, 1, 1, generator=generator) * extent
    y, x = torch.arange(height).view(-1, 1), torch.arange(width).view(1, -1)
    peaks = torch.exp(-((x - centres[:, :, 0]) ** 2 + (y - centres[:, :, 1]) ** 2) / (2 * sigma**2))
    heights = 0.3 + 0.7 * torch.rand(people, keypoints, 1, 1, generator=generator)
    return peaks * heights + 0.01 * torch.rand(shape, generator=generator)


def real_models(tasks: list[str]) -> dict[str, heads.Sapiens2ForTask]:
    torch.manual_seed(0)
    config = Sapiens2Config(**TINY)
    built = {}
    for task in tasks:
        head = heads.HeadConfig(task, TINY_HEAD[0][:2] if task == "pose" else TINY_HEAD[0], TINY_HEAD[1],
                                heads.OUT_CHANNELS[task])
        built[task] = heads.build_task_model(config, head).eval()
    return built


@contextlib.contextmanager
def stand_in_models(built: dict, hold_ms: float):
    """predict.py's model loading returns the cached models (the rest of predict.py runs as it is). `hold_ms`: per
    image, for all the models together (each model holds its share: an image of seg,normal,pose holds T in all)."""
    real = models.load_models
    share = hold_ms / len(built)
    cached = {task: models.LoadedModel(CachedModel(model, share), f"stand-in {task}") for task, model in built.items()}
    models.load_models = lambda choice, tasks, *args, **kwargs: {task: cached[task] for task in tasks}
    try:
        yield
    finally:
        models.load_models = real


# ----------------------------------------------------------------------------------------------------
# Stage timing: thread CPU time inside the functions each stage calls
# ----------------------------------------------------------------------------------------------------
class StageClock:
    """Per stage: the CPU time of the threads that ran it (thread_time: torch's own worker threads are not seen)
    and the wall time spent in it (on a GPU, the model's wall time includes waiting for the GPU)."""

    def __init__(self):
        self.cpu, self.wall, self.lock = {}, {}, threading.Lock()

    def add(self, stage: str, cpu: float, wall: float):
        with self.lock:
            self.cpu[stage] = self.cpu.get(stage, 0.0) + cpu
            self.wall[stage] = self.wall.get(stage, 0.0) + wall

    def timed(self, stage: str, function):
        def wrapper(*args, **kwargs):
            cpu, wall = time.thread_time(), time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.add(stage, time.thread_time() - cpu, time.perf_counter() - wall)
        return wrapper


@contextlib.contextmanager
def clocked(clock: StageClock):
    """Wrap the functions of each stage where the pipeline looks them up (module attributes)."""
    patches = [(processing, "load_image", "decode"), (inference.Inference, "prepare", "preprocess"),
               (processing, "preprocess_crops", "preprocess"), (inference.Inference, "forward", "model"),
               (getattr(inference, "HostCopies", None), "__call__", "to_host"),
               (outputs, "encode", "encode"), (safe_io, "write_value", "write")]
    patches += [(processing, name, "postprocess") for name in dir(processing) if name.startswith("postprocess_")]
    # an older checkout (--baseline) times the stages it has
    patches = [(owner, name, stage) for owner, name, stage in patches if hasattr(owner, name)]
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    real_render = outputs.render

    def render(*args, **kwargs):
        return {suffix: clock.timed("render", make) for suffix, make in real_render(*args, **kwargs).items()}

    try:
        for owner, name, stage in patches:
            setattr(owner, name, clock.timed(stage, getattr(owner, name)))
        outputs.render = render
        yield
    finally:
        for owner, name, function in originals:
            setattr(owner, name, function)
        outputs.render = real_render


# ----------------------------------------------------------------------------------------------------
# Rows
# ----------------------------------------------------------------------------------------------------
def write_photos(folder: Path, photo: str, count: int) -> list[Path]:
    """Smooth random photos (JPEG, quality 90): costs like a real photo's to decode and to encode."""
    width, height = (int(v) for v in photo.split("x"))
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    paths = []
    for i in range(count):
        small = rng.integers(0, 256, size=(height // 32 + 1, width // 32 + 1, 3), dtype=np.uint8)
        image = Image.fromarray(small).resize((width, height), Image.BICUBIC)
        paths.append(folder / f"photo{i:03d}.jpg")
        image.save(paths[-1], quality=90)
    return paths


def run_row(tasks: str, photos: Path, out: Path, workers: int | None, built: dict | None, hold_ms: float, batch: int,
            device: str, extra: tuple = ()) -> dict:
    """predict.py on the photos with the stand-in models (`built`; None: the models `extra` names). workers None:
    an older checkout's predict.py (--baseline) that has no --workers; the stages time what a checkout has."""
    clock = StageClock()
    argv = [tasks, str(photos), "-o", str(out), "--batch-size", str(batch),
            *(("--workers", str(workers)) if workers is not None else ()),
            "--device", device, "--no-flip", "--detector", "none", *extra]
    models_in_use = stand_in_models(built, hold_ms) if built is not None else contextlib.nullcontext()
    stages = clocked(clock)
    cpu_start, wall_start = time.process_time(), time.perf_counter()
    with models_in_use, stages, contextlib.redirect_stderr(open(os.devnull, "w")):
        status = predict.main(argv)
    wall, cpu = time.perf_counter() - wall_start, time.process_time() - cpu_start
    if status != 0:
        raise RuntimeError(f"predict.py {' '.join(argv)} exited {status}")
    manifest = json.loads((out / "run.json").read_text())
    images = manifest["counts"]["written"]
    stage_cpu = {k: round(1000 * v / images, 1) for k, v in sorted(clock.cpu.items())}
    return {"images": images, "images_per_s": manifest["images_per_s"], "wall_s": round(wall, 3),
            "cpu_ms_per_image": round(1000 * cpu / images, 1), "stage_cpu_ms_per_image": stage_cpu,
            "stage_wall_ms_per_image": {k: round(1000 * v / images, 1) for k, v in sorted(clock.wall.items())},
            "host_ms_per_image_with_a_device": round(sum(stage_cpu.get(k, 0.0) for k in HOST_STAGES), 1),
            "device_to_host_bytes_per_image": manifest.get("device_to_host", {}).get("bytes_per_image")}


def checkout(revision: str, folder: Path) -> Path:
    """The files of a git revision of this repository, in `folder` (the code a --baseline row runs)."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", revision], capture_output=True)
    if archive.returncode != 0:
        raise SystemExit(f"--baseline {revision}: git archive failed: {archive.stderr.decode().strip()}")
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(folder, filter="data")
    return folder


def revision_id(revision: str) -> str:
    done = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", revision + "^{commit}"],
                          capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else revision


def baseline_row(code: Path, tasks: str, photos: Path, out: Path, batch: int, device: str, workers: int) -> dict:
    """The free row of an older checkout's predict.py (`code`), in a process of its own: its modules, not ours;
    with `workers` where its predict.py has --workers."""
    result = out.with_suffix(".json")
    command = [sys.executable, __file__, "--baseline-row", str(photos), "--tasks", tasks, "--batch-size", str(batch),
               "--device", device, "--out", str(result), "--scratch", str(out), "--workers", str(workers)]
    done = subprocess.run(command, env={**os.environ, CODE_OF: str(code)}, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the baseline row ({' '.join(command)}) failed:\n{done.stderr[-2000:]}")
    return json.loads(result.read_text())


def bench(tasks_sets, photos, images: int, workers: list[int], batch: int, device: str,
          baseline: str | None = None) -> list[dict]:
    """Per photo size and task set, the free and stand-in rows of each runner; with `baseline` (a git revision),
    also the free row of that revision's predict.py, run on the same photos in the same run."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="sapiens2-pipeline-") as tmp:
        tmp = Path(tmp)
        code = checkout(baseline, tmp / "baseline-code") if baseline else None
        revision = revision_id(baseline) if baseline else None  # recorded as the commit, not as given (HEAD~3)
        for photo in photos:
            folder = tmp / f"photos-{photo}"
            write_photos(folder, photo, images)
            for tasks in tasks_sets:
                built = real_models(tasks.split(","))
                then = (baseline_row(code, tasks, folder, tmp / f"out-baseline-{len(rows)}", batch, device,
                                     min(workers)) if code else None)
                free = {w: run_row(tasks, folder, tmp / f"out-free-{w}", w, built, 0.0, batch, device) for w in workers}
                serial = free[min(workers)]
                hold = round(1000 / serial["images_per_s"], 1)  # the balanced case: the model as slow as the CPU work
                held = {w: run_row(tasks, folder, tmp / f"out-held-{w}", w, built, hold, batch, device) for w in workers}
                for w in workers:
                    ideal = 1000 / hold  # = 1 / max(T, the CPU work of an image), T being that work
                    rows.append({"tasks": tasks, "photo": photo, "workers": w, "batch": batch,
                                 "free": free[w], "stand_in": {**held[w], "hold_ms_per_image": hold,
                                                               "ideal_images_per_s": round(ideal, 3),
                                                               "of_ideal": round(held[w]["images_per_s"] / ideal, 3)},
                                 "speedup_free_vs_serial": round(free[w]["images_per_s"] / serial["images_per_s"], 3)})
                    if then is not None:
                        speedup = free[w]["images_per_s"] / then["images_per_s"]
                        rows[-1].update(baseline={"revision": revision, "free": then},
                                        speedup_free_vs_baseline=round(speedup, 3))
                    print(table_row(rows[-1]), flush=True)
    return rows


def real_rows(tasks_sets, photos, images: int, workers: list[int], batch: int, device: str, size: str,
              preset: str, on_row=lambda rows: None) -> list[dict]:
    """predict.py with real-size random models against the model alone, on the same photos and batch size;
    on_row(rows so far) after each row (the caller saves them: a run that is stopped keeps its rows)."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="sapiens2-pipeline-real-") as tmp:
        tmp = Path(tmp)
        for photo in photos:
            folder = tmp / f"photos-{photo}"
            write_photos(folder, photo, images)
            for tasks in tasks_sets:
                extra = ("--random-init", "always", "--model", preset, *(("--size", size) if size else ()))
                alone = {task: model_alone(task, preset, device, batch, size) for task in tasks.split(",")}
                ideal = 1 / sum(1 / rate for rate in alone.values())  # the models one after the other
                for w in workers:
                    run_row(tasks, folder, tmp / f"warm-{w}", w, None, 0.0, batch, device, extra)  # compiles, caches
                    row = run_row(tasks, folder, tmp / f"out-{w}", w, None, 0.0, batch, device, extra)
                    rows.append({"tasks": tasks, "photo": photo, "workers": w, "batch": batch, "preset": preset,
                                 "size": size or "model", "real": row, "model_alone_images_per_s": alone,
                                 "of_model_alone": round(row["images_per_s"] / ideal, 3)})
                    print(f"| {tasks} | {photo} | {w} | {row['images_per_s']} img/s | model alone "
                          f"{round(ideal, 2)} img/s | {rows[-1]['of_model_alone']} |", flush=True)
                    on_row(rows)
    return rows


def model_alone(task: str, preset: str, device: str, batch: int, size: str | None, reps: int = 5) -> float:
    """Images/s of the model's forward alone (random weights, the run's dtype), CUDA events on a GPU."""
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" and torch.cuda.is_bf16_supported() else torch.float32
    height, width = (int(v) for v in size.split("x")) if size else MODEL_SIZE
    overrides = {"image_size": (height, width)} if size else {}
    model = heads.random_model(task, preset, **overrides).to(device, dtype).eval()
    pixels = torch.randn(batch, 3, height, width, device=device, dtype=dtype)
    with torch.no_grad():
        model(pixels)  # warm-up: kernels, RoPE tables
        times = []
        for _ in range(reps):
            if device == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                model(pixels)
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end) / 1000)
            else:
                began = time.perf_counter()
                model(pixels)
                times.append(time.perf_counter() - began)
    return round(batch / sorted(times)[len(times) // 2], 3)


HEADER = ("| tasks | photo | workers | free img/s | vs serial | vs baseline | CPU ms/img | decode | pre | post "
          "| to host | render | encode | write | host ms/img with a device | MB to host/img | T ms/img | stand-in img/s "
          "| of ideal |\n" + "|---" * 19 + "|")
STAGE_COLUMNS = ("decode", "preprocess", "postprocess", "to_host", "render", "encode", "write")


def table_row(row: dict) -> str:
    free = row["free"]
    stages, copied = free["stage_cpu_ms_per_image"], free.get("device_to_host_bytes_per_image")
    cells = [row["tasks"], row["photo"], row["workers"], free["images_per_s"], row["speedup_free_vs_serial"],
             row.get("speedup_free_vs_baseline", "-"), free["cpu_ms_per_image"],
             *(stages.get(s, "-") for s in STAGE_COLUMNS), free.get("host_ms_per_image_with_a_device", "-"),
             "-" if copied is None else round(copied / 1e6, 2),
             row["stand_in"]["hold_ms_per_image"], row["stand_in"]["images_per_s"], row["stand_in"]["of_ideal"]]
    return "| " + " | ".join(str(c) for c in cells) + " |"


def baseline_table(rows: list[dict]) -> str:
    """Per row with a --baseline: the free runner's CPU ms per photo by stage, the baseline's and ours."""
    lines = ["| tasks | photo | workers | code | " + " | ".join(STAGE_COLUMNS) + " | all stages |",
             "|---" * (5 + len(STAGE_COLUMNS)) + "|"]
    for row in rows:
        if "baseline" not in row:
            continue
        for code, free in ((row["baseline"]["revision"][:7], row["baseline"]["free"]), ("this", row["free"])):
            stages = free.get("stage_cpu_ms_per_image", {})
            cells = [row["tasks"], row["photo"], row["workers"], code, *(stages.get(s, "-") for s in STAGE_COLUMNS),
                     round(sum(v for k, v in stages.items() if k != "model"), 1)]
            lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", nargs="+", default=list(TASK_SETS))
    parser.add_argument("--photos", nargs="+", default=list(PHOTOS), help="photo sizes, WIDTHxHEIGHT")
    parser.add_argument("--images", type=int, default=8)
    parser.add_argument("--workers", default=f"0,{os.cpu_count() or 2}", help="comma list; 0 = the serial runner")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--real", metavar="SIZE", help="also predict.py with real-size random models of this preset "
                        "(e.g. 0.4b) against the model alone")
    parser.add_argument("--size", help="with --real: the model input HxW (default the model's, 1024x768)")
    parser.add_argument("--only-real", action="store_true", help="with --real: skip the free and stand-in rows "
                        "(bench/gpu_session.sh: the GPU machine's time is for the real rows)")
    parser.add_argument("--baseline", metavar="REVISION", help="also the free rows of this git revision's "
                        "predict.py (e.g. the runner before the pipelined one), in the same run")
    parser.add_argument("--baseline-row", type=Path, help=argparse.SUPPRESS)  # the photos: one baseline row, alone
    parser.add_argument("--scratch", type=Path, help=argparse.SUPPRESS)  # with --baseline-row: its output folder
    parser.add_argument("--out", type=Path)
    parser.add_argument("--report", type=Path, help="print the table of a results file and exit")
    args = parser.parse_args(argv)
    if args.baseline_row:  # in the baseline's checkout (CODE_OF): its predict.py, the stages it has
        built = real_models(args.tasks[0].split(","))
        try:
            row = run_row(args.tasks[0], args.baseline_row, args.scratch, int(args.workers), built, 0.0,
                          args.batch_size, args.device)
        except (RuntimeError, SystemExit):  # a predict.py from before --workers
            row = run_row(args.tasks[0], args.baseline_row, args.scratch, None, built, 0.0, args.batch_size,
                          args.device)
        args.out.write_text(json.dumps(row))
        return 0
    if args.report:
        print(HEADER)
        rows = json.loads(args.report.read_text())["rows"]
        for row in rows:
            print(table_row(row))
        if any("baseline" in row for row in rows):
            print("\nCPU ms per photo by stage, the baseline's and this checkout's:\n" + baseline_table(rows))
        return 0
    if not args.only_real:
        print(HEADER)
    workers = [int(w) for w in args.workers.split(",")]
    out = args.out or ROOT / "bench" / "results" / f"pipeline-{args.device}{os.cpu_count()}t.json"
    result = {"bench": "pipeline", "device": args.device, "cpu_count": os.cpu_count(),
              "torch_threads": torch.get_num_threads(), "versions": versions(), "rows": []}
    if args.only_real and not args.real:
        parser.error("--only-real needs --real SIZE")
    if not args.only_real:
        result["rows"] = bench(args.tasks, args.photos, args.images, workers, args.batch_size, args.device,
                               args.baseline)
        safe_io.atomic_write(out, safe_io.json_text(result, indent=2))  # saved before the slower real rows

    def save_real(rows):
        result["real_rows"] = rows
        safe_io.atomic_write(out, safe_io.json_text(result, indent=2))

    if args.real:
        save_real(real_rows(args.tasks, args.photos, args.images, workers, args.batch_size, args.device,
                            args.size, args.real, save_real))
    safe_io.atomic_write(out, safe_io.json_text(result, indent=2))
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
