#!/usr/bin/env python3
"""Fine-tune a Sapiens2 task model on your own data, on one CPU or many GPUs.

    python train.py seg --data my_seg/ --model seg-0.4b -o runs/seg1 --steps 2000 --batch-size 8 --lr 1e-4
    python train.py pose --data my_pose/ --model 0.4b -o runs/pose1 --epochs 50      # a new head on the backbone
    torchrun --nproc-per-node 8 train.py normal --data my_normals/ --model 1b -o runs/n1 --fsdp
    python train.py seg --data my_seg/ -o runs/seg1 --resume                       # continue where it stopped
    python train.py seg --teacher seg-1b --model 0.1b --data photos/ -o runs/s01   # distill: photos, no labels

Data formats: sapiens2_app/train/datasets.py and docs/training.md. Scale-out is PyTorch's: torchrun + DDP, or
FSDP2 (`fully_shard`) with --fsdp. `--batch-size` is per process; the global batch is batch x processes x
--accumulate, and the same global batch and seed give the same training on any number of processes.

OUT/ holds model.safetensors + config.json (what weights.load and `predict.py --model OUT/` read), the
optimizer state (optimizer.safetensors + train_state.json: no pickle), log.jsonl (one line per logged
step and per evaluation).

This file is the command and the run's outline (setup, then the loop); the parts are in sapiens2_app/train/: the
datasets (datasets.py, pose_dataset.py, dataset_files.py, targets.py; their augmentations in sapiens2_app/augment/:
dense_augmentation.py, pose_augmentation.py, pixel_augmentation.py, random_draws.py), what each process reads (data_loading.py), the model it starts
from (starting_model.py), the processes (distributed.py), the optimizer and schedule (optimization.py), the
checkpoints (train_checkpoints.py) and the metrics (pose_metrics.py, dense_metrics.py); with --teacher, the teacher,
its targets and losses (distillation.py), the photos (distill_data.py) and the agreement metrics (agreement.py).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import textwrap
import time
from pathlib import Path

import torch

from sapiens2 import PRESETS, heads, processing
from sapiens2_app.train import (dataset_files, datasets, distill_data, distillation, distributed, optimization,
                                pose_dataset, starting_model, train_checkpoints)
from sapiens2_app.train.agreement import NAMES as AGREEMENT_NAMES
from sapiens2_app.train.agreement import Agreement
from sapiens2_app.common.cli import INTERRUPTED, OneLineErrorParser, StopSignals, UsageError, number_in, parse_size
from sapiens2_app.train.data_loading import USER_ERRORS, Batches, StepSampler, data_loader, eval_batches
from sapiens2_app.train.dense_metrics import Metric, dense_metric_names
from sapiens2_app.train.distributed import Distributed
from sapiens2_app.predict.models import RANDOM_INIT
from sapiens2_app.train.pose_metrics import COCO_KEYPOINT_STATS, PoseEvaluation
from sapiens2_app.common.reporting import Progress
from sapiens2_app.common.safe_io import check_writable, json_text, os_error_text
from sapiens2_app.train.train_checkpoints import STATE_FILE, TrainingStopped, kept_checkpoint, read_state, stored

LOG_FILE = "log.jsonl"
MAX_SEED = 2**32 - 1  # (the sampler and the augmentations derive their seeds from it in 64 bits)
# Options that may differ on --resume (everything else comes from the run being resumed).
RESUME_MAY_CHANGE = {"steps", "epochs", "stop_at", "save_every", "eval_every", "log_every", "workers", "resume",
                     "out", "data", "device", "progress", "batch_size", "accumulate"}  # same global batch: checked
RECIPE_HELP = (
    "the recipe: --lr, --layer-decay, --clip-grad, --precision, --warmup, --schedule and --weight-decay default\n"
    "to the config of the released fine-tune of the task and backbone size (facebookresearch/sapiens2\n"
    "sapiens/*/configs); other backbones follow the released size nearest in embed_dim, matting the normal\n"
    'configs but at 1b. The run prints each value and where it came from; log.jsonl keeps them ("recipe").\n\n'
    f"lr, layer decay, gradient-norm clip, precision:\n{optimization.recipe_table()}\n\n"
    f"every config: AdamW (betas 0.9, 0.999), weight decay {optimization.WEIGHT_DECAY:g} (none on 1-D parameters, "
    f"biases and pos_embed),\n{optimization.WARMUP_STEPS} warmup steps linear from "
    f"{optimization.short_number(optimization.WARMUP_START_FACTOR)} x lr, then linear to 0 (a run of under "
    f"{optimization.WARMUP_STEPS / optimization.SHORT_RUN_WARMUP:.0f} steps warms up\nfor "
    f"{optimization.SHORT_RUN_WARMUP:.0%} of them); fp32 on a CPU. A new head starts as the original's: kaiming-normal "
    "convolutions\n(fan_out, relu), zero biases.")


# ----------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------
def build_parser(prog: str = "train.py") -> argparse.ArgumentParser:
    p = OneLineErrorParser(prog=prog, description=__doc__.split("\n\n")[0],
                           epilog=RECIPE_HELP + metrics_help(),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    whole = lambda low: number_in(int, low)  # noqa: E731
    p.add_argument("task", choices=heads.TASKS)
    p.add_argument("--data", required=True, help="dataset folder with train/ and optionally val/")
    p.add_argument("-o", "--out", required=True, help="output folder (checkpoints, log.jsonl)")
    p.add_argument("--model", help="what to start from: a size (0.4b: the pretrain backbone), a task preset "
                   "(seg-0.4b), a .safetensors file, a folder or a hub id. A checkpoint of the same task with the "
                   "data's output count continues its head; otherwise the head is new")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    p.add_argument("--steps", type=whole(1), help="optimizer steps (default: --epochs)")
    p.add_argument("--epochs", type=number_in(float, 0, low_open=True),
                   help="passes over train/ (default 10 when --steps is not given)")
    p.add_argument("--stop-at", type=whole(1), help="save and stop at this step without finishing the schedule "
                   "(e.g. to fit a job's time limit; --resume goes on)")
    p.add_argument("--batch-size", type=whole(1), default=4, help="samples per process and micro-step (default 4)")
    p.add_argument("--accumulate", type=whole(1), default=1, help="micro-steps per optimizer step (default 1)")
    p.add_argument("--lr", type=number_in(float, 0, low_open=True), help="peak learning rate (default: the "
                   "config's, below)")
    p.add_argument("--min-lr", type=number_in(float, 0), default=0.0,
                   help="learning rate at the last step (default 0, as the configs)")
    p.add_argument("--warmup", type=whole(0), help="steps of linear warmup from "
                   f"{optimization.short_number(optimization.WARMUP_START_FACTOR)}"
                   f" x lr (default {optimization.WARMUP_STEPS}, at most {optimization.SHORT_RUN_WARMUP:.0%}% of the "
                   "steps)")
    p.add_argument("--schedule", choices=optimization.SCHEDULES, help="after the warmup, down to --min-lr: "
                   "linearly (default, the configs') or along a cosine")
    p.add_argument("--weight-decay", type=number_in(float, 0), help=f"AdamW weight decay (default "
                   f"{optimization.WEIGHT_DECAY:g}; none on 1-D parameters, biases and pos_embed)")
    p.add_argument("--layer-decay", type=number_in(float, 0, 1, low_open=True), help="layer-wise lr decay: block "
                   "i of L learns at lr x decay^(L - i), the embeddings at lr x decay^(L + 1), the head at lr "
                   "(default: the config's; 1 = off)")
    p.add_argument("--freeze-backbone", action="store_true", help="train the head only")
    p.add_argument("--clip-grad", type=number_in(float, 0), help="gradient-norm clipping (default: the config's; "
                   "0 = off)")
    p.add_argument("--size", type=parse_size, help="network input HxW (default: the model's, 1024x768)")
    p.add_argument("--head", type=parse_head, help="widths of a new head, UPSAMPLE:CONV: 4 upsampling layers for "
                   "the dense tasks (e.g. 768,512,256,128:64,32), 2 for pose (e.g. 1024,768:512,512,256); pointmap "
                   "adds :SCALE_CONV:SCALE_HIDDEN (default: heads.default_head, the released head of the backbone's "
                   "size; for a size without one, the head of the released size nearest in embed_dim, its widths "
                   "scaled by the embed_dim ratio when the backbone is narrower)")
    p.add_argument("--no-augment", dest="augment", action="store_false", help="no training augmentation")
    p.add_argument("--checkpoint-activations", action="store_true", help="recompute each backbone block in "
                   "the backward pass (less memory, ~30%% more compute)")
    p.add_argument("--fsdp", action="store_true", help="shard parameters, gradients and optimizer state (FSDP2)")
    p.add_argument("--precision", choices=optimization.PRECISIONS, help="autocast dtype (default: the config's "
                   "on CUDA, fp32 on CPU); the weights and optimizer state stay fp32")
    p.add_argument("--device", help="default cuda:LOCAL_RANK when CUDA is available, else cpu")
    p.add_argument("--save-every", type=whole(0), default=1000, help="checkpoint every N steps (and at the end; "
                   "0 = end only)")
    p.add_argument("--eval-every", type=whole(0), default=1000, help="evaluate on val/ every N steps (and at the "
                   "end; 0 = end only)")
    p.add_argument("--log-every", type=whole(1), default=10, help="log.jsonl line every N steps (default 10)")
    p.add_argument("--workers", type=whole(0), default=min(4, os.cpu_count() or 1),
                   help="data loading processes per training process (default: 4, at most the CPU count; 0 = in "
                   "the training process)")
    p.add_argument("--seed", type=number_in(int, 0, MAX_SEED), default=0, help="of the sample order, the "
                   "augmentations and a new head (default 0)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    distillation.add_arguments(p)
    p.add_argument("--random-init", choices=RANDOM_INIT, default="never",
                   help="start from random weights instead of --model's checkpoint: 'fallback' when its download "
                        "fails, 'always' without trying (offline smoke tests; --model names the size)")
    p.add_argument("--random-backbone", choices=list(PRESETS),
                   help="backbone size of a random start (default: the size --model names, else 0.4b)")
    return p


def metrics_help() -> str:
    """--help's list of each task's validation metrics (docs/training.md#metrics-on-val says what each is)."""
    pose = f"{', '.join(COCO_KEYPOINT_STATS)} (with OKS sigmas), pck@0.05; on the flip test's heatmaps"
    names = "\n".join(textwrap.fill(f"{task}: {pose if task == 'pose' else ', '.join(dense_metric_names(task))}",
                                     110, initial_indent="  ", subsequent_indent="    ") for task in heads.TASKS)
    agreement = "; ".join(f"{task}: {', '.join(names)}" for task, names in AGREEMENT_NAMES.items())
    return ('\n\nvalidation metrics (log.jsonl "eval"), the original evaluators\' names and numbers first, extras '
            f"after:\n{names}\nwith --teacher, the agreement with it (and the above where val/ has labels):\n"
            + textwrap.fill(agreement, 110, initial_indent="  ", subsequent_indent="  "))


def parse_head(text: str) -> list[list[int]]:
    try:
        parts = text.split(":")
        if len(parts) not in (2, 4):
            raise ValueError
        widths = [[int(v) for v in part.split(",") if v] for part in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--head takes UPSAMPLE:CONV widths, e.g. 768,512,256,128:64,32, got {text!r}") from None
    if not widths[0] or any(v <= 0 for part in widths for v in part):
        raise argparse.ArgumentTypeError(f"--head {text}: at least one upsample width, all positive")
    return widths


def parse_args(argv, prog: str = "train.py") -> argparse.Namespace:
    """The command line; with --resume, what it does not set explicitly comes from the resumed run."""
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if not args.resume:
        if args.model is None:
            parser.error("--model is required (e.g. --model 0.4b for a new head on the pretrain backbone)")
        if (Path(args.out) / STATE_FILE).exists():
            parser.error(f"{args.out} already holds a training run: --resume continues it; for a new run choose "
                         "another -o (or delete that folder)")
        return checked_schedule(parser, args)
    state_path = Path(args.out) / STATE_FILE
    if not state_path.is_file():
        parser.error(f"--resume: {state_path} not found; nothing to resume in {args.out}")
    try:
        saved = read_state(args.out)["args"]
    except UsageError as error:
        parser.error(f"--resume: {error}")
    given = explicit_options(parser, argv)
    # The same value is not a change: compare in the form the run stored (a parsed --size is a tuple, stored a list)
    changed = sorted(k for k in given if k not in RESUME_MAY_CHANGE and k != "task"
                     and stored(getattr(args, k)) != saved.get(k, stored(parser.get_default(k))))
    if changed or args.task != saved["task"]:
        what = ", ".join(f"--{k.replace('_', '-')}" for k in changed) or f"the task ({saved['task']})"
        parser.error(f"--resume continues the run in {args.out} as it was started; {what} cannot change")
    for key, value in saved.items():
        if key not in given and key not in ("resume", "out", "data", "stop_at"):
            setattr(args, key, tuple(value) if key == "size" and value else value)
    return checked_schedule(parser, args)


def checked_schedule(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """The schedule's options that only make sense together, as far as they are known before the data and the
    model (the recipe's defaults come with the model: optimization.resolve_recipe checks again)."""
    try:
        optimization.check_schedule(args.lr, args.min_lr, args.warmup, args.steps)
    except UsageError as error:
        parser.error(str(error))
    return args


def explicit_options(parser: argparse.ArgumentParser, argv) -> set[str]:
    """Destinations set on the command line (not defaults)."""
    probe = argparse.ArgumentParser(add_help=False)
    for action in parser._actions:
        if action.option_strings and action.dest != "help":
            extra = {"action": "store_const", "const": True} if action.nargs == 0 else {}
            probe.add_argument(*action.option_strings, dest=action.dest, default=argparse.SUPPRESS, **extra)
    known, _ = probe.parse_known_args(argv)
    return set(vars(known))


def check_output_folder(out: Path):
    """-o, before any model loads: a folder (or one to make) that takes files. A probe file is written and removed,
    and so are the folders made for it (the run makes them again once the data and the model are ready)."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"-o {out}: is a file, not a folder")
    made = [folder for folder in (out, *out.parents) if not folder.exists()]  # innermost first
    try:
        out.mkdir(parents=True, exist_ok=True)
        check_writable(out)
    except OSError as error:
        raise UsageError(f"-o {out}: cannot write there ({os_error_text(error)})") from None
    finally:
        for folder in made:
            with contextlib.suppress(OSError):
                folder.rmdir()


class Log:
    """OUT/log.jsonl, main process only."""

    def __init__(self, out: Path, enabled: bool):
        self.path, self.enabled = out / LOG_FILE, enabled

    def write(self, record: dict):
        if not self.enabled:
            return
        try:
            with self.path.open("a") as f:
                f.write(json_text(record) + "\n")  # strict JSON: a NaN loss is null
        except OSError as error:  # a full disk meets the log as often as a checkpoint
            raise TrainingStopped(f"cannot write {self.path} ({os_error_text(error)}); "
                                  f"{kept_checkpoint(self.path.parent)}") from None


# ----------------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------------
def autocast(args, device: torch.device):
    """args.precision (the recipe's, optimization.resolve_recipe; unset: fp32)."""
    if args.precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def to_device(batch: dict, device) -> dict:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def forward_loss(model, batch: dict, task: str):
    kwargs = {k: batch[k] for k in datasets.LOSS_KEYS[task]}
    return model(batch["pixel_values"], **kwargs)


@torch.no_grad()
def evaluate(model, dataset, args, info, dist_info: Distributed, distiller=None, labelled: bool = True) -> dict:
    """val/'s metrics (when it has labels), and with a teacher (distiller) the agreement with it (agreement.py)."""
    model = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    model.eval()
    pose = args.task == "pose"
    metric = (PoseEvaluation(info, dataset.people) if pose else Metric(args.task, info)) if labelled else None
    agreement = Agreement(args.task, info, getattr(dataset, "people", None)) if distiller else None
    rows = list(eval_batches(len(dataset), args.batch_size, dist_info))
    loader = data_loader(dataset, [[(i, 0) for i in indices] for indices, _ in rows], args.workers)
    with Batches(loader) as batches:
        for (indices, valid), batch in zip(rows, batches):
            pixels = batch["pixel_values"].to(dist_info.device)
            with autocast(args, dist_info.device):
                # pose: the original's val_cfg flip_test=True, the mean of the crop's heatmaps and its mirror's
                output = model.flip_test(pixels) if pose else model(pixels)
                if agreement:
                    agreement.update(output, distiller.teacher_outputs(pixels), batch, valid, indices)
            if pose and metric:
                metric.update(output, batch, valid, indices)  # one row per person: gathered by its index
            elif metric:
                metric.update(output, batch, valid)
    results = {}
    for part in (metric, agreement):
        if part is not None:
            part.sums = dist_info.all_reduce(part.sums)
            results.update(part.result())
    model.train()
    return results


class Run:
    """Everything a training run holds, built once (setup) and stepped (loop)."""

    def __init__(self, args, argv):
        self.args, self.argv = args, argv
        self.given = None if argv is None else explicit_options(build_parser(), argv)  # for the recipe's sources
        self.dist = Distributed(args.device, args.fsdp)
        self.out = Path(args.out)
        self.notes = []
        self.dropped = 0  # training samples left out (and refetched) by the original's rules, this log window
        self.progress = Progress(0, unit="steps", bar=False, notes=self.dist.main)  # notes before the loop's bar

    def note(self, message: str):
        self.notes.append(message)
        self.progress.note(message)

    def setup(self):
        args, dist_info = self.args, self.dist
        if args.fsdp and not dist_info.grouped:
            raise UsageError("--fsdp shards over torch.distributed processes: launch with torchrun "
                             "(torchrun --nproc-per-node N train.py ...)")
        if dist_info.main:
            check_output_folder(self.out)
        processing.check_data_files()  # an incomplete installation stops here, before the data and the model
        self.distiller = None
        teacher = distillation.setup_teacher(args, dist_info.device) if args.teacher else None
        self.info = distillation.teacher_info(args.task, teacher) if teacher else datasets.dataset_info(
            args.task, Path(args.data))
        if args.task == "pose" and (warning := dataset_files.inferred_pairs_warning(self.info)):
            self.note(warning)  # a set of its own without flip_pairs: say what the name rule paired
        saved = read_state(self.out) if args.resume else {}
        if args.resume:
            train_checkpoints.check_same_outputs(self.out, saved["info"], self.info, args.task, Path(args.data))
            if dist_info.main:
                for name in train_checkpoints.remove_stale_temporaries(self.out):
                    self.note(f"removed {self.out / name}, left by a run that was killed")
        model, self.random = starting_model.build_model(args, self.info, self.note)
        if self.random or saved.get("info", {}).get("random_start"):  # config.json's sapiens2_training says so
            self.info["random_start"] = True
        if self.random and dist_info.main:
            print(starting_model.random_banner(args.task, args.random_init), file=sys.stderr)
        size = tuple(model.config.image_size)
        self.val_labelled = True
        if teacher is not None:  # distillation: the photos of --data, the teacher's outputs as targets
            self.distiller = distillation.Distiller(distillation.Teacher(teacher, args.task, size), args.task,
                                                    distillation.parse_weights(args.task, args.distill_weights))
            pose = args.task == "pose"
            people = distill_data.people_file(self.out, Path(args.data), args, dist_info) if pose else None
            self.train_set, self.val_set, self.val_labelled = distill_data.build_datasets(
                args.task, Path(args.data), size, args.augment, self.info, people)
            self.note(distillation.describe(self.distiller, args.teacher, people))
        else:
            self.train_set = datasets.build_dataset(args.task, Path(args.data), "train", size, args.augment, self.info)
            self.val_set = datasets.build_dataset(args.task, Path(args.data), "val", size, False, self.info)
        if getattr(self.train_set, "dropped", None):
            self.note(f"train/ people left out as the original's loaders do: "
                      f"{pose_dataset.describe_dropped(self.train_set.dropped)}")
        self.global_batch = args.batch_size * dist_info.world * args.accumulate
        if len(self.train_set) < self.global_batch:
            raise UsageError(
                f"train/ has {len(self.train_set)} samples, fewer than the global batch {self.global_batch} "
                f"(--batch-size {args.batch_size} x {dist_info.world} processes x --accumulate {args.accumulate})")
        steps_per_epoch = len(self.train_set) // self.global_batch
        self.total = args.steps or max(1, round((args.epochs or 10) * steps_per_epoch))
        self.recipe = optimization.resolve_recipe(args, model.config, dist_info.device.type, self.total, self.given)
        followed = optimization.followed_config(args.task, model.config)
        self.followed = followed.name + (f" ({followed.why})" if followed.why else "")
        self.note(f"recipe, following the {self.followed}: {optimization.describe_recipe(self.recipe, args.min_lr)}")
        self.warmup = self.recipe["warmup"].value
        self.stop = min(self.total, args.stop_at) if args.stop_at else self.total
        if args.freeze_backbone:
            model.backbone.requires_grad_(False)
        if args.checkpoint_activations:
            model.backbone.set_grad_checkpointing(True)
        self.model = distributed.wrap(model, args, dist_info)
        self.optimizer = optimization.adamw(distributed.unwrapped(self.model), args)
        self.start = 0
        if args.resume:
            saved_batch = saved.get("global_batch")
            if saved_batch != self.global_batch:
                raise UsageError(f"--resume: the run's global batch was {saved_batch}, now {self.global_batch} "
                                 f"(--batch-size {args.batch_size} x {dist_info.world} processes x --accumulate "
                                 f"{args.accumulate}); set --batch-size/--accumulate to give {saved_batch}")
            self.start = train_checkpoints.load_training_state(self.out, self.model, self.optimizer, dist_info)
        if not args.resume:
            torch.manual_seed(args.seed + dist_info.rank)  # dropout / drop-path, if configured
        if dist_info.main:
            self.out.mkdir(parents=True, exist_ok=True)
        self.note(f"{args.task}: {len(self.train_set)} training samples, {len(self.val_set) if self.val_set else 0} "
                  f"validation; global batch {self.global_batch}, steps {self.start} -> {self.stop} of {self.total}, "
                  f"{dist_info.world} process(es) on {dist_info.device}{', FSDP' if args.fsdp else ''}")

    def loop(self) -> int:
        """The steps from start to stop, or to a Ctrl-C / SIGTERM (then INTERRUPTED); each saved as --save-every
        says, and the last."""
        args, dist_info = self.args, self.dist
        progress = Progress(self.total, unit="steps", bar=dist_info.main and args.progress, notes=dist_info.main,
                            start=self.start)
        log = Log(self.out, dist_info.main)
        log.write({"start": self.start, "argv": self.argv, "notes": self.notes,
                   "random_weights": bool(self.info.get("random_start")),
                   "recipe": {name: {"value": s.value, "from": s.source} for name, s in self.recipe.items()},
                   "recipe_follows": self.followed})
        sampler = StepSampler(len(self.train_set), args, dist_info, self.start, self.stop)
        loader = data_loader(self.train_set, sampler, args.workers, pin_memory=dist_info.device.type == "cuda")
        stop_signals = StopSignals(on_request=lambda signum: progress.note(
            "stopping after this step (a checkpoint is saved first; Ctrl-C again to quit now)"))
        try:
            with stop_signals, Batches(loader) as batches:
                stopped_at = self.steps(batches, progress, log, stop_signals)
        finally:
            progress.close()
        if stopped_at is not None:
            progress.note(f"stopped at step {stopped_at} of {self.total}; saved; --resume continues")
            return INTERRUPTED
        progress.note(f"saved {self.out / 'model.safetensors'} at step {self.stop}" + (
            "" if self.stop == self.total else f"; continue with --resume (step {self.stop} of {self.total})"))
        if self.random:
            progress.note(starting_model.random_banner(args.task, args.random_init))
        return 0

    def steps(self, batches, progress: Progress, log: Log, stop_signals: StopSignals) -> int | None:
        """Train, log, evaluate and save; returns the step where a stop request ended the run, else None."""
        args, dist_info = self.args, self.dist
        params = [p for p in self.model.parameters() if p.requires_grad]
        losses, window_start, saved = [], time.perf_counter(), self.start
        for step in range(self.start, self.stop):
            try:
                losses.append(self.train_step(step, batches, params))
            except USER_ERRORS:  # a bad training file, found when read: the steps trained so far are kept
                if dist_info.world == 1 and step > saved:  # (other processes, in a collective, could not join in)
                    self.save(step, stop_signals)
                    progress.note(f"saved the checkpoint of step {step}; fix the file below, then --resume goes on")
                raise
            done = step + 1
            if dist_info.any(not math.isfinite(losses[-1])):  # (every process stops at the same step)
                raise TrainingStopped(f"the loss is {losses[-1]} at step {done}: the training diverged (a lower --lr, "
                                      f"or --clip-grad, may help); not saved; {kept_checkpoint(self.out)}")
            if done % args.log_every == 0 or done == self.stop:
                window = torch.tensor([sum(losses) / len(losses), self.dropped], dtype=torch.float64)
                sums = dist_info.all_reduce(window)
                loss, lr = sums[0].item() / dist_info.world, self.learning_rate(step)
                rate = len(losses) * self.global_batch / (time.perf_counter() - window_start)
                log.write({"step": done, "loss": loss, "lr": lr, "images_per_s": rate,
                           "dropped_samples": int(sums[1].item())})
                self.dropped = 0
                progress.update(done, f"loss {loss:.4f}  lr {lr:.2e}  {rate:.1f} img/s")
                losses, window_start = [], time.perf_counter()
            stopping = dist_info.any(stop_signals.requested)  # every process stops at the same step
            if (args.save_every and done % args.save_every == 0) or done == self.stop or stopping:
                saved = self.save(done, stop_signals)
            # after the save: a bad val/ file (found only when read) then costs no training
            if self.val_set is not None and ((args.eval_every and done % args.eval_every == 0) or done == self.total):
                metrics = evaluate(self.model, self.val_set, args, self.info, dist_info, self.distiller,
                                   self.val_labelled)
                log.write({"step": done, "eval": metrics})
                progress.note(f"eval at step {done}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
            if stopping:
                return done
        return None

    def save(self, done: int, stop_signals: StopSignals) -> int:
        train_checkpoints.save_checkpoint(self.out, self.model, self.optimizer, done, self.args, self.info, self.dist,
                                          self.global_batch, held=stop_signals.held)
        return done

    def learning_rate(self, step: int) -> float:
        args = self.args
        return optimization.learning_rate(step, self.total, self.warmup, args.lr, args.min_lr, args.schedule)

    def train_step(self, step: int, batches, params) -> float:
        """One optimizer step (over --accumulate micro-batches); returns its loss."""
        args, optimizer = self.args, self.optimizer
        optimization.set_learning_rate(optimizer, self.learning_rate(step))
        loss = sum(self.micro_step(self.model, next(batches), micro) for micro in range(args.accumulate))
        if args.clip_grad:
            torch.nn.utils.clip_grad_norm_(params, args.clip_grad)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    def micro_step(self, model, batch, micro: int) -> float:
        """Forward + backward of one micro-batch; gradients are synchronized after the last one only."""
        args = self.args
        self.dropped += int(batch["dropped"].sum())  # samples the original's rules left out, replaced
        batch = to_device(batch, self.dist.device)
        last = micro == args.accumulate - 1
        if args.fsdp:
            model.set_requires_gradient_sync(last)
        skip_sync = not last and hasattr(model, "no_sync")  # DDP
        with (model.no_sync() if skip_sync else contextlib.nullcontext()), autocast(args, self.dist.device):
            if self.distiller is not None:  # the teacher's outputs on the same augmented pixels are the targets
                loss = self.distiller.loss(model, batch["pixel_values"]) / args.accumulate
            else:
                loss = forward_loss(model, batch, args.task).loss / args.accumulate
        loss.backward()
        return loss.detach().float().item()


def train(args, argv=None) -> int:
    try:
        return run_to_the_end(args, argv)
    except USER_ERRORS as error:  # bad data, checkpoint or launch: the message names the file or setting
        print(f"error: {error}", file=sys.stderr)
        return 2
    except TrainingStopped as error:  # a full disk, a diverged run: the last good checkpoint is kept
        print(f"error: stopped: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # a second Ctrl-C (StopSignals), or one before the loop
        print(f"\ninterrupted: quit without saving; {kept_checkpoint(Path(args.out))}", file=sys.stderr)
        return INTERRUPTED
    finally:
        distributed.close()


def run_to_the_end(args, argv) -> int:
    """The run, in a frame of its own: when it returns, train() holds nothing of it, so that distributed.close()
    can free the model and its wrappers before it leaves the process group."""
    run = Run(args, argv)
    run.setup()
    status = run.loop()
    # every process leaves together, its collectives all complete: a process that tears down its gloo group
    # while work of it is still in flight can abort at exit ("terminate called without an active exception")
    run.dist.barrier()
    return status


def main(argv: list[str] | None = None, prog: str = "train.py") -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv, prog)
    return train(args, argv)


if __name__ == "__main__":
    sys.exit(main())
