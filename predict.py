#!/usr/bin/env python3
"""Run Sapiens2 on your images: every task, one command, files you can open.

    python predict.py seg photos/ -o out/                      # a folder (recursive)
    python predict.py seg,normal,pose "shots/**/*.jpg" -o out/ # several tasks; globs; a .txt list of paths
    python predict.py pose photos/ --boxes boxes.json          # your own person boxes (COCO xywh)
    python predict.py normal photos/ --model 1b --mask-with-seg
    torchrun --nproc-per-node 8 predict.py seg,pose photos/ -o out/   # each GPU takes its share
    python predict.py pose clip.mp4 -o out/ --smooth           # videos (sapiens2_app/predict/video.py): frames, overlays, track ids

Tasks: seg, pose, normal, pointmap, matting, albedo, features. Outputs are mirrored under OUT by input path
(`photos/a/b.jpg` -> `out/a/b.seg.png`, ...; see sapiens2_app/common/artefacts.py), plus a `run.json` manifest. A bad image is
reported and skipped; the run goes on. Exit status: 0 all good, 1 some images failed (single process only)
or the run stopped (disk full, OUT read-only), 2 nothing could run (bad arguments, inputs, OUT or checkpoints).

Pose is top-down: person boxes come from `--boxes`, else from a person detector (sapiens2_app/detector/detector.py, D-FINE; or
`--detector seg`: the segmentation's foreground blobs), else the whole image. The flip test is on by default,
as in the original demo.
"""


from __future__ import annotations

import argparse
import math
import os
import re
import sys
import time
from pathlib import Path

from PIL import Image

from sapiens2 import PRESETS, processing
from sapiens2_app.detector import detector
from sapiens2_app.predict import formats, models, tracking, video
from sapiens2_app.common.artefacts import ARTEFACTS, DEFAULT_KINDS, KINDS, TASKS
from sapiens2_app.predict.boxes import read_boxes_file, unmatched_boxes_warnings
from sapiens2_app.common.cli import (INTERRUPTED, TERMINATED, OneLineErrorParser, StopSignals, Terminated, UsageError,
                              one_line, parse_size, parse_tasks, pick_device, rank_and_world)
from sapiens2_app.predict.inference import Inference
from sapiens2_app.predict.inputs import IMAGE_SUFFIXES, InputImage, collect_inputs, is_video, output_names, shard
from sapiens2_app.predict.models import (CONVENTIONS, RANDOM_INIT, LoadedModel, ModelChoice, describe_model,
                                         keypoint_names, pick_dtype, random_banner)
from sapiens2_app.predict.outputs import Outputs, prepare_output_folder
from sapiens2_app.predict.pipeline import Run, StopRun, failure_report
from sapiens2_app.train.pseudo_labels import TrainingData
from sapiens2_app.common.reporting import (Progress, finish_manifest, manifest_path, manifest_reserve, utc_now,
                                    write_final_manifest, write_manifest)
from sapiens2_app.common.runtime_info import versions
from sapiens2_app.common.safe_io import atomic_write, os_error_text, remove_stale_temporaries

MAX_BATCH_SIZE = 1024
MAX_WORKERS = 64


# ----------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------
def parse_batch_size(text: str) -> int:
    return parse_count(text, 1, MAX_BATCH_SIZE)


def parse_workers(text: str) -> int:
    return parse_count(text, 0, MAX_WORKERS)


def parse_count(text: str, low: int, high: int) -> int:
    if not re.fullmatch(r"\d+", text.strip()) or not low <= int(text) <= high:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number from {low} to {high}")
    return int(text)


def parse_megapixels(text: str) -> float:
    """--max-megapixels: a positive number, at most Pillow's own limit (2 x 89 MP), above which it refuses anyway."""
    highest = 2 * Image.MAX_IMAGE_PIXELS / 1e6
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value <= highest:  # (NaN fails this too)
        raise argparse.ArgumentTypeError(f"{text!r}: expected megapixels, a number above 0 and at most {highest:g}")
    return value


def parse_kinds(text: str) -> set[str]:
    kinds = {k.strip() for k in text.split(",") if k.strip()}
    if not kinds or kinds - set(KINDS):
        raise UsageError(f"--save takes a comma list of {', '.join(KINDS)}, got {text!r}")
    return kinds


def build_parser(prog: str = "predict.py") -> argparse.ArgumentParser:
    parser = OneLineErrorParser(
        prog=prog, description="Run Sapiens2 on images: " + ", ".join(TASKS) + ".",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="outputs per image (under OUT, mirroring the inputs' paths):\n" + "\n".join(
            f"  {task:9s} " + "  ".join(f"NAME{s} ({'/'.join(sorted(k))})" for s, k in ARTEFACTS[task].items())
            for task in TASKS))
    parser.add_argument("task", help="one task or several: seg,normal,pose")
    parser.add_argument("inputs", nargs="+", metavar="INPUT",
                        help="image files, videos, folders (recursive), globs ('a/**/*.jpg'), .txt files listing "
                             "paths (one a line, relative to the list file's folder; # comments)")
    parser.add_argument("-o", "--output", default="predictions", metavar="OUT",
                        help="output folder (default: %(default)s)")
    parser.add_argument("--model", action="append", default=[], metavar="SOURCE",
                        help="a size (0.4b: the released checkpoint of each task; default, 1b for matting), a task "
                             "preset (seg-1b), a .safetensors file, a folder or a hub id; TASK=SOURCE for one task "
                             "(repeat the option)")
    parser.add_argument("--device", help="cuda, cuda:1, cpu (default: cuda:LOCAL_RANK when there is a GPU)")
    parser.add_argument("--dtype", choices=["float32", "fp32", "bfloat16", "bf16", "float16", "fp16"],
                        help="default: bfloat16 on GPUs that support it, else float32")
    parser.add_argument("--batch-size", type=parse_batch_size,
                        help="images per forward pass, people for pose (default: 4 on GPU, 1 on CPU)")
    parser.add_argument("--workers", type=parse_workers, metavar="N",
                        help="threads that render, encode and write the files while the model runs (default: the CPU "
                             "cores this process may use, at most 8); 0: one image after the other in one thread")
    parser.add_argument("--size", type=parse_size, metavar="HxW",
                        help="model input size (default: the model's, 1024x768)")
    parser.add_argument("--max-megapixels", type=parse_megapixels, default=processing.PIXEL_BUDGET / 1e6, metavar="MP",
                        help="refuse an image whose header declares more pixels, before decoding it (default: "
                             "%(default)g; a few hundred bytes can declare 130 MP and take gigabytes)")
    parser.add_argument("--no-flip", dest="flip", action="store_false", help="pose: skip the flip test (2x faster)")
    parser.add_argument("--boxes", metavar="FILE",
                        help="pose: person boxes, JSON {\"image.jpg\": [[x, y, w, h], ...]}")
    parser.add_argument("--detector", default=detector.DEFAULT_DETECTOR, metavar="SOURCE",
                        help="pose: person boxes from this D-FINE detector (hub id, folder or file; default "
                             "%(default)s), 'seg' for the segmentation's blobs, 'none' for the whole image; "
                             "--boxes wins")
    parser.add_argument("--conventions", choices=list(CONVENTIONS), default="original",
                        help="original: as the weights were trained (the original demos' OpenCV preprocessing, RoPE "
                             "in bf16; default); transformers: exactly what HF transformers computes (its "
                             "preprocessing, RoPE in fp32)")
    parser.add_argument("--mask-with-seg", action="store_true",
                        help="mask normal, pointmap and albedo outside the segmented people (NaN in .npy, black "
                             "in pictures)")
    parser.add_argument("--skip-existing", action="store_true",
                        help="skip images whose outputs all exist (resumes a run)")
    parser.add_argument("--save", type=parse_kinds_arg, default=set(DEFAULT_KINDS), metavar="KINDS",
                        help="which outputs: raw (npy, class-id/alpha PNGs, features), json (pose), vis (pictures), "
                             "openpose (NAME_keypoints.json), coco (OUT/coco_keypoints.json), ply (NAME.pointmap.ply), "
                             "depth16 (NAME.depth16.png, mm); default: raw,json,vis")
    parser.add_argument("--coco-format", choices=formats.COCO_FORMATS, default="coco17",
                        help="keypoints of --save coco: coco17 (COCO body, default), coco_wholebody (133), "
                             "keypoints308, model (the pose model's own keypoints, for a fine-tune with its own set)")
    parser.add_argument("--training-data", metavar="DIR", help="also write the predictions as training sets in "
                        "train.py's layout, one per task (DIR/TASK/train/images/ + masks/, normals/, ..., "
                        "annotations.json; docs/training.md#distillation)")
    clips = parser.add_argument_group("videos (.mp4 .mov .avi .mkv .webm .m4v inputs; needs PyAV: pip install av)")
    clips.add_argument("--every", type=int, default=1, metavar="N", help="every Nth frame (default: all)")
    clips.add_argument("--start", type=int, default=0, metavar="S", help="first frame index (zero-based)")
    clips.add_argument("--end", type=int, metavar="E", help="stop before frame index E (default: the end)")
    clips.add_argument("--track-patience", type=int, default=tracking.DEFAULT_PATIENCE, metavar="N",
                       help="pose: processed frames a person may be missed and keep their track id (default: "
                            "%(default)s)")
    clips.add_argument("--smooth", action="store_true",
                       help="pose: One-Euro filter the keypoints of each track (pose.json keeps keypoints_raw)")
    clips.add_argument("--smooth-min-cutoff", type=float, default=tracking.OneEuroSettings.min_cutoff,
                       metavar="HZ", help="One-Euro cutoff when still; lower = smoother (default: %(default)s)")
    clips.add_argument("--smooth-beta", type=float, metavar="BETA", default=tracking.OneEuroSettings.beta,
                       help="One-Euro speed coefficient, per person height per second; higher = less lag when "
                            "moving (default: %(default)s)")
    parser.add_argument("--random-init", choices=RANDOM_INIT, default="never",
                        help="random weights instead of checkpoints: 'fallback' when a download fails (for demos "
                             "and smoke tests; outputs are meaningless)")
    parser.add_argument("--random-backbone", choices=list(PRESETS),
                        help="backbone size of random models (default: the model's)")
    return parser


def parse_kinds_arg(text: str) -> set[str]:
    try:
        return parse_kinds(text)
    except UsageError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def default_workers() -> int:
    """The CPU cores this process may use (its affinity: a container's or a scheduler's share), at most 8."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return min(cores, 8)


def main(argv: list[str] | None = None, prog: str = "predict.py") -> int:
    args = build_parser(prog).parse_args(argv)
    try:
        with StopSignals():
            return run(args, argv if argv is not None else sys.argv[1:])
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as stop:
        print(f"\n{'terminated' if isinstance(stop, Terminated) else 'interrupted'}: the outputs written so far are "
              f"complete; --skip-existing resumes", file=sys.stderr)
        return TERMINATED if isinstance(stop, Terminated) else INTERRUPTED


def run(args, argv: list[str]) -> int:
    """Check everything that can be checked (arguments, environment, inputs, OUT) before loading a model, load the
    models, then every image and video, with run.json written at the start and finished at the end."""
    start = time.perf_counter()
    tasks, out, conventions = parse_tasks(args.task), Path(args.output), CONVENTIONS[args.conventions]
    try:
        processing.check_data_files()  # an incomplete installation stops here, not on every image after the models load
    except processing.MissingDataError as error:
        raise UsageError(str(error)) from None
    models.check_model_sources(args.model)
    coco = "coco" in args.save and "pose" in tasks
    if not coco and not any(kinds & args.save for task in tasks for kinds in ARTEFACTS[task].values()):
        raise UsageError(f"--save {','.join(sorted(args.save))} writes nothing for {','.join(tasks)}")
    rank, world = rank_and_world()
    if args.training_data and world > 1:
        raise UsageError("--training-data writes one annotations.json: run it in one process")
    device = pick_device(args.device)
    dtype = pick_dtype(args.dtype, device)
    batch_size = args.batch_size or (4 if device.type == "cuda" else 1)
    check_video_options(args)
    boxes = read_boxes_file(args.boxes) if args.boxes else None
    items = collect_inputs(args.inputs, exclude=out.resolve())
    names = output_names(items)
    require_av_for(items)
    mine, prefix = shard(items, rank, world), f"[rank {rank}/{world}] " if world > 1 else ""
    unreadable = unreadable_inputs(mine, world, round(args.max_megapixels * 1e6))
    warnings = unmatched_boxes_warnings(args.boxes, boxes, items) + renamed_notes(names)
    for message in warnings:
        print(f"warning: {message}", file=sys.stderr)
    for item, error in unreadable.items():  # reported before the models load; skipped as an image failing later is
        print(prefix + failure_report(item, None, error)[1], file=sys.stderr)
    prepare_output_folder(out)

    choice = ModelChoice(tuple(args.model), args.random_init, args.random_backbone, conventions["rope"])
    loaded, person_detector, boxes_from = models.load_for_tasks(
        choice, tasks, device, dtype, None if args.boxes else args.detector, args.mask_with_seg, args.size, args.flip)
    check_keypoint_formats(args, loaded)
    if any(m.random for m in loaded.values()):
        print(random_banner(loaded, args.random_init, boxes_from), file=sys.stderr)

    inference = Inference(tasks, loaded, device, dtype, batch_size, args.size, args.flip, args.mask_with_seg, boxes,
                          person_detector, seg_boxes=person_detector is None and boxes_from != "none",
                          resample=conventions["resample"])
    training_data = TrainingData(Path(args.training_data), tasks, loaded) if args.training_data else None
    outputs = Outputs(out, tasks, args.save, loaded, names,
                      coco=formats.CocoResults(args.coco_format, keypoint_names(loaded["pose"].model)) if coco else None,
                      training_data=training_data)
    readable = [item for item in mine if item not in unreadable]
    clips, settings = [item for item in readable if is_video(item.path)], video_settings(args, outputs)
    if args.skip_existing and (removed := remove_stale_temporaries(out)):
        print(f"note: removed {removed} temporary files left in {out} by an earlier run that was killed",
              file=sys.stderr)
    images = [item for item in readable if not is_video(item.path)]
    todo = [item for item in images if not (args.skip_existing and outputs.all_written(item))]
    manifest = new_manifest(args, argv, inference, outputs, boxes_from,
                            dict(rank=rank, world_size=world, images=len(mine), of=len(items)))
    manifest["timings_s"] = {"load_models": round(time.perf_counter() - start, 3)}
    path = manifest_path(out, rank, world)
    try:
        write_manifest(path, manifest, reserve=manifest_reserve(len(todo)))
    except OSError as error:
        raise UsageError(f"cannot write the manifest {path} ({os_error_text(error)})") from None

    frames = sum(video.expected_frames(clip.path, settings.selection) for clip in clips)
    progress = Progress(len(todo) + frames, prefix=prefix, bar=rank == 0 or not sys.stderr.isatty())
    pipeline = Run(inference, outputs, progress, warnings=warnings,
                   workers=default_workers() if args.workers is None else args.workers)
    record_unreadable(pipeline, manifest, unreadable)
    stopped = None
    try:
        with pipeline.running():
            pipeline.process_all(todo)
            for clip in clips:
                manifest.setdefault("videos", {})[clip.relative] = video.process_video(pipeline, clip, settings)
    except StopRun as stop:
        stopped = str(stop)
    finally:
        progress.close()
        skipped = len(images) - len(todo) + sum(v.get("frames_skipped_existing", 0) for v in
                                                manifest.get("videos", {}).values())  # frames count as images
        unfinished = [clip for clip in clips if clip.relative not in manifest.get("videos", {})]
        finish_manifest(manifest, pipeline, todo + unfinished, skipped=skipped, elapsed=time.perf_counter() - start,
                        rate=progress.rate(), stopped=stopped)
        if outputs.training_data is not None:
            outputs.training_data.finish()
        if outputs.coco is not None:
            pending = set(todo)
            try:
                write_coco_results(outputs, [item for item in images if item not in pending], rank, world)
            except OSError as error:
                print(f"error: cannot write the COCO results ({os_error_text(error)})", file=sys.stderr)
        try:
            write_final_manifest(path, manifest)
        except OSError as error:
            print(f"error: cannot write the manifest {path} ({os_error_text(error)})", file=sys.stderr)
    counts = manifest["counts"]
    print(f"{prefix}{counts['written']} images written to {out}/, {counts['failed']} failed, "
          f"{counts['skipped_existing']} skipped (already done); {progress.rate():.2f} img/s; manifest {path}",
          file=sys.stderr)
    if stopped:
        print(f"{prefix}error: stopped: {stopped}; {counts['not_attempted']} images not attempted. Fix that and "
              f"rerun the same command with --skip-existing to finish", file=sys.stderr)
    if any(m.random for m in loaded.values()):
        print(random_banner(loaded, args.random_init, boxes_from), file=sys.stderr)
    # NOTE: under torchrun a rank with failed images still exits 0: torchrun stops every rank as soon as one
    # exits non-zero, which would end the whole run. The failures are in each rank's manifest. A stopped run
    # (disk full, OUT read-only) exits 1 everywhere: the other ranks would hit the same wall.
    return 1 if stopped or (pipeline.errors and world == 1) else 0


# ----------------------------------------------------------------------------------------------------
# Pre-flight checks: before any model loads, or right after (what needs the loaded models), before any image
# ----------------------------------------------------------------------------------------------------
def renamed_notes(names: dict[InputImage, str]) -> list[str]:
    """Inputs whose output names had to differ from their stem (x.jpg + x.png in one folder)."""
    renamed = sorted((item.relative, name) for item, name in names.items() if name != item.stem)
    if not renamed:
        return []
    shown = ", ".join(f"{relative} -> {name}.*" for relative, name in renamed[:4])
    return [f"{len(renamed)} inputs would write the same outputs as another; named apart: {shown}"
            + (", ..." if len(renamed) > 4 else "")]


def check_keypoint_formats(args, loaded: dict[str, LoadedModel]):
    """--save openpose / coco against the pose model's own keypoint set, before any image (formats.py)."""
    if "pose" not in loaded:
        return
    names = keypoint_names(loaded["pose"].model)
    for save in ("openpose", "coco"):
        if save in args.save and (problem := formats.unsupported_keypoints(save, args.coco_format, names)):
            raise UsageError(problem)


def unreadable_inputs(items: list[InputImage], world: int, max_pixels: int) -> dict[InputImage, Exception]:
    """This process's inputs that cannot be read, by their header (not an image, empty, not ours to read, more
    pixels than `max_pixels`, not a video), found before any model loads and before any image is decoded. When none
    of a single process's inputs can be read, nothing can run."""
    unreadable = {}
    for item in items:
        try:
            if is_video(item.path):
                video.check_video_file(item.path)
            else:
                processing.check_image_file(item.path, max_pixels)
        except (OSError, ValueError) as error:  # whatever a decoder raises comes as one of these (processing.decoding)
            unreadable[item] = error
    if unreadable and len(unreadable) == len(items) and world == 1:
        reasons = [one_line(str(error)) for error in unreadable.values()]
        what = reasons[0] if len(reasons) == 1 else (f"none of the {len(reasons)} inputs can be read: "
                                                      + "; ".join(reasons[:3]) + ("; ..." if len(reasons) > 3 else ""))
        raise UsageError(f"{what}; inputs are images ({' '.join(sorted(IMAGE_SUFFIXES))}), videos, folders, globs "
                         f"or .txt lists of them")
    return unreadable


def record_unreadable(pipeline: Run, manifest: dict, unreadable: dict[InputImage, Exception]):
    """The inputs unreadable_inputs found (reported then) in run.json, as failed images (a video: as failed videos)."""
    for item, error in unreadable.items():
        entry, _ = failure_report(item, None, error)
        pipeline.errors.append(entry)
        pipeline.outcomes[item] = "failed"
        if is_video(item.path):
            manifest.setdefault("videos", {})[item.relative] = {"error": entry["error"]}


def require_av_for(items: list[InputImage]):
    """Videos need PyAV: say so before anything is loaded or written."""
    clip = next((item for item in items if is_video(item.path)), None)
    if clip is not None:
        try:
            video.require_av()
        except ImportError as error:
            raise UsageError(f"{clip.path}: {error}") from None


def check_video_options(args):
    """--every/--start/--end, --track-patience, --smooth*: checked with the other arguments, before any model
    loads (argparse's float takes nan and inf, which would fill pose.json with nulls)."""
    if args.every < 1 or args.start < 0 or (args.end is not None and args.end <= args.start):
        raise UsageError(f"frames are selected by --every N >= 1, --start S >= 0, --end E > S; got --every "
                         f"{args.every} --start {args.start} --end {args.end}")
    if args.track_patience < 0:
        raise UsageError(f"--track-patience {args.track_patience}: expected a whole number >= 0")
    if not (math.isfinite(args.smooth_min_cutoff) and args.smooth_min_cutoff > 0):
        raise UsageError(f"--smooth-min-cutoff {args.smooth_min_cutoff}: expected a number of Hz above 0")
    if not (math.isfinite(args.smooth_beta) and args.smooth_beta >= 0):
        raise UsageError(f"--smooth-beta {args.smooth_beta}: expected a finite number >= 0")


def video_settings(args, outputs: Outputs) -> video.VideoSettings:
    """--every/--start/--end, --track-patience, --smooth* (checked by check_video_options), and which pictures
    become overlay videos."""
    smoothing = tracking.OneEuroSettings(args.smooth_min_cutoff, args.smooth_beta) if args.smooth else None
    pictures = [s for task in outputs.tasks for s, kinds in ARTEFACTS[task].items() if "vis" in (kinds & outputs.kinds)]
    return video.VideoSettings(video.FrameSelection(args.every, args.start, args.end), args.skip_existing,
                               args.track_patience, smoothing, tuple(pictures))


# ----------------------------------------------------------------------------------------------------
# At the end: COCO results, run.json
# ----------------------------------------------------------------------------------------------------
def write_coco_results(outputs: Outputs, skipped: list[InputImage], rank: int, world: int):
    """OUT/coco_keypoints.json (one per rank, like run.json): this run's people, and those of the images
    --skip-existing skipped, read back from their pose.json."""
    for item in skipped:
        if not outputs.coco.add_from_pose_json(outputs.names[item], outputs.path(item, ".pose.json")):
            print(f"warning: {item.path}: skipped as done, but without a pose.json it is missing from the COCO "
                  f"results (rerun it without --skip-existing)", file=sys.stderr)
    name = "coco_keypoints.json" if world == 1 else f"coco_keypoints.rank{rank}-of-{world}.json"
    atomic_write(outputs.out / name, outputs.coco.results())


def new_manifest(args, argv: list[str], inference: Inference, outputs: Outputs, boxes_from: str | None,
                 shard_info: dict) -> dict:
    """run.json as the run starts: the command, the models, the settings in effect, versions, this process's share."""
    dtype = str(inference.dtype).replace("torch.", "")
    conventions = CONVENTIONS[args.conventions]
    return {
        "command": ["predict.py", *argv], "started": utc_now(), "status": "running", "tasks": inference.tasks,
        "models": {task: describe_model(m, dtype) for task, m in inference.models.items()},
        "settings": {"device": str(inference.device), "dtype": dtype, "batch_size": inference.batch_size,
                     "size": list(args.size) if args.size else None, "flip_test": args.flip,
                     "conventions": args.conventions, "rope": conventions["rope"], "resample": conventions["resample"],
                     "mask_with_seg": args.mask_with_seg, "boxes": args.boxes, "detector": boxes_from,
                     "save": sorted(args.save),
                     "coco_format": args.coco_format if "coco" in args.save else None,
                     "skip_existing": args.skip_existing, "output": str(outputs.out),
                     "video": {"every": args.every, "start": args.start, "end": args.end,
                               "track_patience": args.track_patience, "smooth": args.smooth and {
                                   "min_cutoff": args.smooth_min_cutoff, "beta": args.smooth_beta,
                                   "d_cutoff": tracking.OneEuroSettings.d_cutoff}}},
        "versions": versions(), "shard": shard_info,
    }


if __name__ == "__main__":
    sys.exit(main())
