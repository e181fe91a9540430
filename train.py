"""Fine-tune a Sapiens2 task model on your own data, on one CPU or many GPUs.

    python train.py seg --data my_seg/ --model seg-0.4b -o runs/seg1 --steps 2000 --batch-size 8 --lr 1e-4
    python train.py pose --data my_pose/ --model 0.4b -o runs/pose1 --epochs 50      # a new head on the backbone
    torchrun --nproc-per-node 8 train.py normal --data my_normals/ --model 1b -o runs/n1 --fsdp
    python train.py seg --data my_seg/ -o runs/seg1 --resume                       # continue where it stopped

Data formats: train_data.py and README.md ("Fine-tune"). Scale-out is PyTorch's: torchrun + DDP, or FSDP2
(`fully_shard`) with --fsdp. `--batch-size` is per process; the global batch is batch x processes x
--accumulate, and the same global batch and seed give the same training on any number of processes.

OUT/ holds model.safetensors + config.json (what weights.load and `predict.py --model OUT/` read), the
optimizer state (optimizer.safetensors + train_state.json: no pickle), log.jsonl (one line per logged
step and per evaluation).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open

import heads
import metadata
import processing
import safe_io
import train_data
import weights
from predict import OneLineErrorParser, parse_size
from sapiens2 import PRESETS, Sapiens2

STATE_FILE, OPTIMIZER_FILE, LOG_FILE = "train_state.json", "optimizer.safetensors", "log.jsonl"
# Options that may differ on --resume (everything else comes from the run being resumed).
RESUME_MAY_CHANGE = {"steps", "epochs", "stop_at", "save_every", "eval_every", "log_every", "workers", "resume",
                     "out", "data", "device", "progress", "batch_size", "accumulate"}  # same global batch: checked


# ----------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = OneLineErrorParser(prog="train.py", description=__doc__.split("\n\n")[0],
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("task", choices=heads.TASKS)
    p.add_argument("--data", required=True, help="dataset folder with train/ and optionally val/")
    p.add_argument("-o", "--out", required=True, help="output folder (checkpoints, log.jsonl)")
    p.add_argument("--model", help="what to start from: a size (0.4b: the pretrain backbone), a task preset "
                   "(seg-0.4b), a .safetensors file, a folder or a hub id. A checkpoint of the same task with the "
                   "data's output count continues its head; otherwise the head is new")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    p.add_argument("--steps", type=int, help="optimizer steps (default: --epochs)")
    p.add_argument("--epochs", type=float, help="passes over train/ (default 10 when --steps is not given)")
    p.add_argument("--stop-at", type=int, help="save and stop at this step without finishing the schedule "
                   "(e.g. to fit a job's time limit; --resume goes on)")
    p.add_argument("--batch-size", type=int, default=4, help="samples per process and micro-step (default 4)")
    p.add_argument("--accumulate", type=int, default=1, help="micro-steps per optimizer step (default 1)")
    p.add_argument("--lr", type=float, default=1e-4, help="peak learning rate (default 1e-4)")
    p.add_argument("--min-lr", type=float, default=0.0, help="learning rate at the end of the cosine (default 0)")
    p.add_argument("--warmup", type=int, help="linear warmup steps (default 5%% of the steps, at most 500)")
    p.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay (default 0.1; none on "
                   "norms, biases and tokens)")
    p.add_argument("--layer-decay", type=float, default=0.85, help="block i of L gets lr x decay^(L - i); the "
                   "head gets lr (default 0.85; 1 = off)")
    p.add_argument("--freeze-backbone", action="store_true", help="train the head only")
    p.add_argument("--clip-grad", type=float, default=1.0, help="gradient norm clipping (default 1; 0 = off)")
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
    p.add_argument("--precision", choices=("bf16", "fp32"), help="autocast dtype (default bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--device", help="default cuda:LOCAL_RANK when CUDA is available, else cpu")
    p.add_argument("--save-every", type=int, default=1000, help="checkpoint every N steps (and at the end)")
    p.add_argument("--eval-every", type=int, default=1000, help="evaluate on val/ every N steps (and at the end; 0 = end only)")
    p.add_argument("--log-every", type=int, default=10, help="log.jsonl line every N steps (default 10)")
    p.add_argument("--workers", type=int, default=min(4, os.cpu_count() or 1),
                   help="data loading processes per training process (default: 4, at most the CPU count)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    p.add_argument("--random-init", choices=weights.RANDOM_INIT, default="never",
                   help="start from random weights instead of --model's checkpoint: 'fallback' when its download "
                        "fails, 'always' without trying (offline smoke tests; --model names the size)")
    p.add_argument("--random-backbone", choices=list(PRESETS),
                   help="backbone size of a random start (default: the size --model names, else 0.4b)")
    return p


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


def parse_args(argv) -> argparse.Namespace:
    """The command line; with --resume, what it does not set explicitly comes from the resumed run."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.resume:
        if args.model is None:
            parser.error("--model is required (e.g. --model 0.4b for a new head on the pretrain backbone)")
        if (Path(args.out) / STATE_FILE).exists():
            parser.error(f"{args.out} already holds a training run: --resume continues it; for a new run choose "
                         "another -o (or delete that folder)")
        return args
    state_path = Path(args.out) / STATE_FILE
    if not state_path.is_file():
        parser.error(f"--resume: {state_path} not found; nothing to resume in {args.out}")
    saved = json.loads(state_path.read_text())["args"]
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
    return args


def stored(value):
    """A parsed option's value as train_state.json holds it (JSON: tuples are lists)."""
    return json.loads(json.dumps(value))


def explicit_options(parser: argparse.ArgumentParser, argv) -> set[str]:
    """Destinations set on the command line (not defaults)."""
    probe = argparse.ArgumentParser(add_help=False)
    for action in parser._actions:
        if action.option_strings and action.dest != "help":
            extra = {"action": "store_const", "const": True} if action.nargs == 0 else {}
            probe.add_argument(*action.option_strings, dest=action.dest, default=argparse.SUPPRESS, **extra)
    known, _ = probe.parse_known_args(argv)
    return set(vars(known))


# ----------------------------------------------------------------------------------------------------
# Processes and devices
# ----------------------------------------------------------------------------------------------------
class Distributed:
    """This process's rank, the process count and device (torchrun's environment; one process without it)."""

    def __init__(self, device_name: str | None, fsdp: bool = False):
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if device_name is None:
            device_name = f"cuda:{local}" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device_name)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        launched = "MASTER_ADDR" in os.environ  # torchrun (FSDP needs the process group even for 1 process)
        if (self.world > 1 or (fsdp and launched)) and not dist.is_initialized():
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo")

    @property
    def main(self) -> bool:
        return self.rank == 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            moved = tensor.to(self.device)
            dist.all_reduce(moved)
            tensor = moved.to(tensor.device)
        return tensor

    def barrier(self):
        if self.world > 1:
            dist.barrier()

    def close(self):
        if dist.is_initialized():
            dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------------
# The model: a checkpoint's backbone + its head (continued) or a new one
# ----------------------------------------------------------------------------------------------------
class ModelError(ValueError):
    """--model cannot be loaded; the message says why."""


def new_head_config(task: str, out_channels: int, config, widths, like: heads.HeadConfig | None) -> heads.HeadConfig:
    """The head to build: --head widths, else those of the checkpoint's own head (same task), else
    heads.default_head for this backbone (the released head of its size; scaled from the nearest released size's
    for other sizes). A pointmap --head without SCALE_CONV:SCALE_HIDDEN keeps the checkpoint's scale branch, else
    takes the default head's."""
    default = heads.default_head(task, config, out_channels)
    if widths is None:
        return default if like is None else replace(like, out_channels=out_channels, labels=None, flip_pairs=None)
    extra = {}  # (the data's labels are set after: build_model)
    if task == "pointmap" and len(widths) == 4:
        extra = dict(scale_conv_channels=widths[2], scale_hidden=widths[3])
    elif task == "pointmap":
        kept = like or default
        extra = dict(scale_conv_channels=kept.scale_conv_channels, scale_hidden=kept.scale_hidden)
    return heads.HeadConfig(task, widths[0], widths[1], out_channels, **extra)


def head_option(head: heads.HeadConfig) -> str:
    """The --head text of this head's widths (what parse_head reads back)."""
    parts = [head.upsample_channels, head.conv_channels]
    if head.task == "pointmap":
        parts += [head.scale_conv_channels, head.scale_hidden]
    return ":".join(",".join(str(w) for w in part) for part in parts)


def check_output_resolution(head: heads.HeadConfig, config, source):
    """The targets are at the input size (pose heatmaps at 1/4 of it), as the released heads' outputs; a head
    with another number of upsampling layers (loadable, e.g. from transformers) cannot be trained against them.
    The hint is the default head for this backbone, which has the right number."""
    wanted = heads.upsample_layers_needed(head.task, config.patch_size)
    layers = len(head.upsample_channels)  # each doubles H and W
    if layers == wanted:
        return
    where = f"{'1/4 of ' if head.task == 'pose' else ''}the input size, where the targets are"
    if wanted is None:
        raise ModelError(f"{source}: no {head.task} head can be trained on this backbone: its patch size "
                         f"{config.patch_size} is not {'4 x ' if head.task == 'pose' else ''}a power of 2, so no "
                         f"number of 2x upsampling layers brings its outputs to {where}")
    hint = head_option(heads.default_head(head.task, config, head.out_channels))
    raise ModelError(f"{source}: this {head.task} head has {layers} upsampling layers, its outputs are at "
                     f"{2 ** layers}/{config.patch_size} of the input size; training needs {wanted} (outputs at "
                     f"{where}): start a new head with --head UPSAMPLE:CONV, e.g. --head {hint} (the default "
                     f"head for this backbone)")


def starting_weights(args, source: str, log) -> tuple[torch.nn.Module, bool]:
    """(the model the run starts from, whether its weights are random): the checkpoint of `source` (OUT on
    --resume, else --model), or as --random-init says a random backbone (heads.random_model: the size --model
    names, or --random-backbone), the same on every process (seeded with --seed)."""
    random_init = "never" if args.resume else args.random_init  # a resumed run continues its own checkpoint

    def random_backbone():
        return heads.random_model("features", source, args.random_backbone, seed=args.seed)

    try:
        return weights.load_or_random(source, random_init, lambda: weights.load(source), random_backbone, note=log)
    except (ValueError, OSError) as error:  # not found, not downloadable, not a Sapiens2 checkpoint
        raise ModelError(f"--model {source}: {error}") from None


def build_model(args, info: dict, log) -> tuple[heads.Sapiens2ForTask, bool]:
    """Load --model (or random weights: --random-init), keep its backbone, continue or replace its head;
    returns a training-mode fp32 model and whether its weights started random."""
    source = args.out if args.resume else args.model
    loaded, random = starting_weights(args, source, log)
    backbone = loaded if isinstance(loaded, Sapiens2) else loaded.backbone
    config = backbone.config
    if args.size is not None:
        config = replace(config, image_size=tuple(args.size))
    old_head = None if isinstance(loaded, Sapiens2) else loaded.head_config
    K = info["out_channels"]
    same_task = old_head is not None and old_head.task == args.task
    size_ok = not (args.task == "pointmap" and tuple(config.image_size) != tuple(backbone.config.image_size))
    if args.resume or (same_task and old_head.out_channels == K and size_ok and args.head is None):
        head_config, why = old_head, f"continuing the checkpoint's {args.task} head ({K} outputs)"
    else:
        head_config = new_head_config(args.task, K, config, args.head, old_head if same_task else None)
        why = ("random weights (--random-init)" if random else
               "the checkpoint is a pretrain backbone" if old_head is None else
               f"the checkpoint's head is a {old_head.task} head" if not same_task else
               "--head was given" if args.head is not None else
               f"the checkpoint's head has {old_head.out_channels} outputs, the data {K}" if old_head.out_channels != K else
               f"the pointmap scale branch is tied to the image size {backbone.config.image_size}")
        why = f"new {args.task} head with {K} outputs: {why}"
    check_output_resolution(head_config, config, "--head" if args.head is not None else source)
    if args.task == "pose":  # the keypoint set travels with the model (predict.py's flip test and pose.json)
        head_config = replace(head_config, labels=info["keypoint_names"], flip_pairs=info["flip_pairs"])
    elif args.task == "seg":  # so do the class names (weights.load -> model.labels, id2label in config.json)
        head_config = replace(head_config, labels=info["class_names"])
    # Reuse the loaded modules (one copy of the weights in memory, even for 5b): the task model is built on
    # the meta device and gets the loaded backbone, and the loaded head or a new one.
    with torch.device("meta"):
        model = heads.build_task_model(config, head_config)
    backbone.config = config
    model.backbone = backbone
    if why.startswith("continuing"):
        model.decode_head = loaded.decode_head
    else:
        torch.manual_seed(args.seed)  # the same new head on every process
        model.decode_head = heads.build_head(model.head_config, config.embed_dim, config.size_multiple,
                                             config.hidden_act)
    log(f"model: {source} -> {why}")
    return model.train(), random


def layer_id(name: str, depth: int) -> int:
    """0 = embeddings and tokens, i + 1 = block i, depth + 1 = final norm and head."""
    if name.startswith("backbone.blocks."):
        return int(name.split(".")[2]) + 1
    if name.startswith("backbone.") and not name.startswith("backbone.ln1"):
        return 0
    return depth + 1


def parameter_groups(model, args) -> list[dict]:
    """AdamW groups: layer-wise lr decay over the blocks; no weight decay on 1-D parameters and tokens."""
    depth = model.config.depth
    groups = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        layer = layer_id(name, depth)
        no_decay = param.ndim <= 1 or name.endswith(("cls_token", "storage_tokens", "mask_token"))
        key = (layer, no_decay)
        if key not in groups:
            groups[key] = {"params": [], "lr_scale": args.layer_decay ** (depth + 1 - layer),
                           "weight_decay": 0.0 if no_decay else args.weight_decay, "lr": args.lr}
        groups[key]["params"].append(param)
    return [groups[key] for key in sorted(groups)]


def learning_rate(step: int, total: int, warmup: int, peak: float, floor: float) -> float:
    """Linear warmup to the peak, then a cosine down to the floor at the last step."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(total - warmup, 1)
    return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def checkpoint_activations(model):
    """Recompute each backbone block's activations in the backward pass (the modules and their state-dict
    keys stay as they are: only the blocks' forward is wrapped)."""
    from torch.utils.checkpoint import checkpoint

    for block in model.backbone.blocks:
        forward = block.forward
        block.forward = lambda *a, _f=forward, **k: checkpoint(_f, *a, use_reentrant=False, **k)


def wrap(model, args, dist_info: Distributed):
    """DDP (several processes), FSDP2 (--fsdp) or the plain model."""
    if args.fsdp:
        fully_shard, _ = fsdp2()
        for block in model.backbone.blocks:  # shard first: no process holds the whole model on its device
            fully_shard(block)
        fully_shard(model)
        return model.to(dist_info.device)
    model.to(dist_info.device)
    if dist_info.world > 1:
        from torch.nn.parallel import DistributedDataParallel

        ids = [dist_info.device.index] if dist_info.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids, find_unused_parameters=False)
    return model


def fsdp2():
    """(fully_shard, FSDPModule): public in torch.distributed.fsdp since torch 2.6, _composable before."""
    try:
        from torch.distributed.fsdp import FSDPModule, fully_shard
    except ImportError:
        from torch.distributed._composable.fsdp import FSDPModule, fully_shard
    return fully_shard, FSDPModule


def unwrapped(model):
    return getattr(model, "module", model)


# ----------------------------------------------------------------------------------------------------
# Sampling: the global order is a function of (seed, epoch); each process takes its slice of each step
# ----------------------------------------------------------------------------------------------------
class StepSampler:
    """Yields, per micro-step, this process's [(index, augmentation seed)] from step `start` to `stop`."""

    def __init__(self, count: int, args, dist_info: Distributed, start: int, stop: int):
        self.count, self.seed, self.start, self.stop = count, args.seed, start, stop
        self.per_process, self.accumulate = args.batch_size, args.accumulate
        self.world, self.rank = dist_info.world, dist_info.rank
        self.global_batch = self.per_process * self.world * self.accumulate
        self.steps_per_epoch = count // self.global_batch

    def order(self, epoch: int) -> torch.Tensor:
        return torch.randperm(self.count, generator=torch.Generator().manual_seed(self.seed * 100003 + epoch))

    def __iter__(self):
        for step in range(self.start, self.stop):
            epoch, within = divmod(step, self.steps_per_epoch)
            order = self.order(epoch)
            for micro in range(self.accumulate):
                first = within * self.global_batch + (micro * self.world + self.rank) * self.per_process
                positions = range(first, first + self.per_process)
                yield [(int(order[p]), self.sample_seed(epoch, p)) for p in positions]

    def sample_seed(self, epoch: int, position: int) -> int:
        return (self.seed * 1_000_003 + epoch * self.count + position) % (2**62)

    def __len__(self) -> int:
        return (self.stop - self.start) * self.accumulate


def eval_batches(count: int, batch_size: int, dist_info: Distributed):
    """Validation rows for this process: (index list, valid flags), the same number of batches on every
    process (FSDP needs every process in every forward); rows past the end repeat row 0 and do not count."""
    per_round = batch_size * dist_info.world
    rounds = math.ceil(count / per_round)
    for r in range(rounds):
        first = r * per_round + dist_info.rank * batch_size
        rows = list(range(first, first + batch_size))
        yield [i if i < count else 0 for i in rows], torch.tensor([i < count for i in rows])


# ----------------------------------------------------------------------------------------------------
# Checkpoints (no pickle: safetensors for tensors, JSON for the rest)
# ----------------------------------------------------------------------------------------------------
def state_dict_options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True)


def save_checkpoint(out: Path, model, optimizer, step: int, args, info: dict, dist_info: Distributed, global_batch: int):
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    model_state = get_model_state_dict(model, options=state_dict_options())
    optimizer_state = get_optimizer_state_dict(model, optimizer, options=state_dict_options())
    rng = [torch.get_rng_state()] + ([torch.cuda.get_rng_state(dist_info.device)] if dist_info.device.type == "cuda" else [])
    if dist_info.world > 1:
        gathered = [None] * dist_info.world
        dist.all_gather_object(gathered, rng)
        rng = gathered
    else:
        rng = [rng]
    if dist_info.main:
        write_checkpoint(out, unwrapped(model), model_state, optimizer_state, rng, step, args, info, global_batch)
    dist_info.barrier()


def write_checkpoint(out: Path, model, model_state, optimizer_state, rng, step, args, info, global_batch):
    """Every file is written into a fresh staging folder first and moved into OUT only when all are written;
    train_state.json, moved last, names the step."""
    with safe_io.staging_folder(out, prefix=".checkpoint.", last=(STATE_FILE,)) as tmp:
        write_checkpoint_files(tmp, model, model_state, optimizer_state, rng, step, args, info, global_batch)


def write_checkpoint_files(tmp: Path, model, model_state, optimizer_state, rng, step, args, info, global_batch):
    with torch.device("meta"):
        plain = heads.build_task_model(model.config, model.head_config)
    plain.load_state_dict({k: v.float() for k, v in model_state.items()}, assign=True)
    weights.save(plain, tmp)
    config = json.loads((tmp / "config.json").read_text())
    config["sapiens2_training"] = {"task": args.task, "step": step, **{k: v for k, v in info.items() if k != "out_channels"}}
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    tensors, groups = {}, []
    for name, entries in optimizer_state["state"].items():
        for key, value in entries.items():
            tensors[f"state/{name}/{key}"] = torch.as_tensor(value).detach().cpu().contiguous()
    for group in optimizer_state["param_groups"]:
        groups.append({k: v for k, v in group.items()})
    for r, states in enumerate(rng):
        for i, state in enumerate(states):
            tensors[f"rng/{r}/{i}"] = state.cpu()
    weights.save_safetensors(tensors, tmp / OPTIMIZER_FILE, {"step": str(step)})
    state = {"step": step, "global_batch": global_batch, "args": {k: stored(v) for k, v in vars(args).items()},
             "param_groups": groups, "info": info, "torch": torch.__version__}
    (tmp / STATE_FILE).write_text(json.dumps(state, indent=2))


def load_training_state(out: Path, model, optimizer, dist_info: Distributed) -> int:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    state = json.loads((out / STATE_FILE).read_text())
    step = state["step"]
    # FSDP: only rank 0 reads the full optimizer state; the others receive their shards from it.
    broadcast = isinstance(model, fsdp2()[1]) and dist_info.world > 1
    with safe_open(str(out / OPTIMIZER_FILE), "pt") as f:
        wanted = [k for k in f.keys() if dist_info.main or not broadcast or k.startswith("rng/")]
        tensors = {k: weights.aligned(f.get_tensor(k)) for k in wanted}  # as the uninterrupted run's
    saved_step = json.loads((out / "config.json").read_text()).get("sapiens2_training", {}).get("step")
    if saved_step != step:
        raise ModelError(f"{out}: model.safetensors is from step {saved_step}, {STATE_FILE} from step {step} (a save "
                         f"was interrupted): the run cannot continue exactly; start a new one with --model {out}")
    entries = {}
    for key, value in tensors.items():
        if key.startswith("state/"):
            _, rest = key.split("/", 1)
            name, field = rest.rsplit("/", 1)
            entries.setdefault(name, {})[field] = value
    optimizer_state = {"state": entries, "param_groups": state["param_groups"]}
    if broadcast and not dist_info.main:
        optimizer_state = {}
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast)
    set_optimizer_state_dict(model, optimizer, optim_state_dict=optimizer_state, options=options)
    rank = dist_info.rank if f"rng/{dist_info.rank}/0" in tensors else 0
    torch.set_rng_state(tensors[f"rng/{rank}/0"])
    if dist_info.device.type == "cuda" and f"rng/{rank}/1" in tensors:
        torch.cuda.set_rng_state(tensors[f"rng/{rank}/1"], dist_info.device)
    return step


# ----------------------------------------------------------------------------------------------------
# Progress and log
# ----------------------------------------------------------------------------------------------------
class Progress:
    """The bar (step, loss, lr, images/s, ETA) when `bar`; notes always, from the main process."""

    def __init__(self, total: int, start: int, main: bool, bar: bool = True, stream=None):
        self.total, self.start, self.stream = total, start, stream or sys.stderr
        self.enabled, self.bar = main, main and bar
        self.began = time.perf_counter()
        self.tty = self.stream.isatty()

    def update(self, step: int, loss: float, lr: float, images_per_s: float):
        if not self.bar:
            return
        done = step - self.start
        elapsed = time.perf_counter() - self.began
        eta = elapsed / max(done, 1) * (self.total - step)
        line = (f"step {step}/{self.total}  loss {loss:.4f}  lr {lr:.2e}  {images_per_s:.1f} img/s  "
                f"ETA {time.strftime('%H:%M:%S', time.gmtime(eta))}")
        print(f"\r{line}" if self.tty else line, end="" if self.tty else "\n", file=self.stream, flush=True)

    def note(self, message: str):
        if self.enabled:
            print(("\n" if self.bar and self.tty else "") + message, file=self.stream, flush=True)


class Log:
    """OUT/log.jsonl, main process only."""

    def __init__(self, out: Path, enabled: bool):
        self.path, self.enabled = out / LOG_FILE, enabled

    def write(self, record: dict):
        if self.enabled:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")


# ----------------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------------
def autocast(args, device: torch.device):
    precision = args.precision or ("bf16" if device.type == "cuda" else "fp32")
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def to_device(batch: dict, device) -> dict:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def forward_loss(model, batch: dict, task: str):
    kwargs = {k: batch[k] for k in train_data.LOSS_KEYS[task]}
    return model(batch["pixel_values"], **kwargs)


@torch.no_grad()
def evaluate(model, dataset, args, info, dist_info: Distributed) -> dict:
    model = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    model.eval()
    metric = train_data.Metric(args.task, info)
    rows = list(eval_batches(len(dataset), args.batch_size, dist_info))
    loader = data_loader(dataset, [[(i, 0) for i in indices] for indices, _ in rows], args.workers)
    with Batches(loader) as batches:
        for (_, valid), batch in zip(rows, batches):
            with autocast(args, dist_info.device):
                output = model(batch["pixel_values"].to(dist_info.device))
            metric.update(output, batch, valid)
    metric.sums = dist_info.all_reduce(metric.sums)
    model.train()
    return metric.result()


class Run:
    """Everything a training run holds, built once (setup) and stepped (loop)."""

    def __init__(self, args, argv):
        self.args, self.argv = args, argv
        self.dist = Distributed(args.device, args.fsdp)
        self.out = Path(args.out)
        self.notes = []

    def note(self, message: str):
        self.notes.append(message)
        Progress(0, 0, self.dist.main).note(message)

    def setup(self):
        args, dist_info = self.args, self.dist
        if args.fsdp and not dist.is_initialized():
            raise ModelError("--fsdp shards over torch.distributed processes: launch with torchrun "
                             "(torchrun --nproc-per-node N train.py ...)")
        metadata.check_data_files()  # an incomplete installation stops here, before the data and the model
        self.info = train_data.dataset_info(args.task, Path(args.data))
        model, self.random = build_model(args, self.info, self.note)
        saved_info = json.loads((self.out / STATE_FILE).read_text())["info"] if args.resume else {}
        if self.random or saved_info.get("random_start"):  # config.json's sapiens2_training says so, resumed too
            self.info["random_start"] = True
        if self.random and dist_info.main:
            print(random_banner(args.task, args.random_init), file=sys.stderr)
        size = tuple(model.config.image_size)
        self.train_set = train_data.build_dataset(args.task, Path(args.data), "train", size, args.augment, self.info)
        self.val_set = train_data.build_dataset(args.task, Path(args.data), "val", size, False, self.info)
        self.global_batch = args.batch_size * dist_info.world * args.accumulate
        if len(self.train_set) < self.global_batch:
            raise train_data.DataError(
                f"train/ has {len(self.train_set)} samples, fewer than the global batch {self.global_batch} "
                f"(--batch-size {args.batch_size} x {dist_info.world} processes x --accumulate {args.accumulate})")
        steps_per_epoch = len(self.train_set) // self.global_batch
        self.total = args.steps or max(1, round((args.epochs or 10) * steps_per_epoch))
        self.warmup = args.warmup if args.warmup is not None else min(500, self.total // 20)
        self.stop = min(self.total, args.stop_at) if args.stop_at else self.total
        if args.freeze_backbone:
            model.backbone.requires_grad_(False)
        if args.checkpoint_activations:
            checkpoint_activations(model)
        self.model = wrap(model, args, dist_info)
        groups = parameter_groups(unwrapped(self.model), args)
        self.optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.999), weight_decay=args.weight_decay)
        self.start = 0
        if args.resume:
            saved = json.loads((self.out / STATE_FILE).read_text()).get("global_batch")
            if saved != self.global_batch:
                raise ModelError(f"--resume: the run's global batch was {saved}, now {self.global_batch} (--batch-size "
                                 f"{args.batch_size} x {dist_info.world} processes x --accumulate {args.accumulate}); "
                                 f"set --batch-size/--accumulate to give {saved}")
            self.start = load_training_state(self.out, self.model, self.optimizer, dist_info)
        if not args.resume:
            torch.manual_seed(args.seed + dist_info.rank)  # dropout / drop-path, if configured
        if dist_info.main:
            self.out.mkdir(parents=True, exist_ok=True)
        self.note(f"{args.task}: {len(self.train_set)} training samples, {len(self.val_set) if self.val_set else 0} "
                  f"validation; global batch {self.global_batch}, steps {self.start} -> {self.stop} of {self.total}, "
                  f"{dist_info.world} process(es) on {dist_info.device}{', FSDP' if args.fsdp else ''}")

    def loop(self):
        args, dist_info, model, optimizer = self.args, self.dist, self.model, self.optimizer
        progress = Progress(self.total, self.start, dist_info.main, args.progress)
        log = Log(self.out, dist_info.main)
        log.write({"start": self.start, "argv": self.argv, "notes": self.notes,
                   "random_weights": bool(self.info.get("random_start"))})
        sampler = StepSampler(len(self.train_set), args, dist_info, self.start, self.stop)
        loader = data_loader(self.train_set, sampler, args.workers, pin_memory=dist_info.device.type == "cuda")
        params = [p for p in model.parameters() if p.requires_grad]
        losses, window_start = [], time.perf_counter()
        with StopRequests(progress.note) as stop_requests, Batches(loader) as batches:
            for step in range(self.start, self.stop):
                losses.append(self.train_step(step, batches, params))
                done = step + 1
                if done % args.log_every == 0 or done == self.stop:
                    mean = dist_info.all_reduce(torch.tensor([sum(losses) / len(losses)], dtype=torch.float64))
                    lr = learning_rate(step, self.total, self.warmup, args.lr, args.min_lr)
                    rate = len(losses) * self.global_batch / (time.perf_counter() - window_start)
                    log.write({"step": done, "loss": mean.item() / dist_info.world, "lr": lr, "images_per_s": rate})
                    progress.update(done, mean.item() / dist_info.world, lr, rate)
                    losses, window_start = [], time.perf_counter()
                if self.val_set is not None and ((args.eval_every and done % args.eval_every == 0) or done == self.total):
                    metrics = evaluate(model, self.val_set, args, self.info, dist_info)
                    log.write({"step": done, "eval": metrics})
                    progress.note(f"eval at step {done}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
                stopping = stop_requests.agreed(dist_info)
                if (args.save_every and done % args.save_every == 0) or done == self.stop or stopping:
                    save_checkpoint(self.out, model, optimizer, done, args, self.info, dist_info, self.global_batch)
                if stopping:
                    progress.note(f"stopped at step {done} of {self.total}; saved; --resume continues")
                    return INTERRUPTED
        progress.note(f"saved {self.out / 'model.safetensors'} at step {self.stop}" + (
            "" if self.stop == self.total else f"; continue with --resume (step {self.stop} of {self.total})"))
        if self.random:
            progress.note(random_banner(args.task, args.random_init))
        return 0

    def train_step(self, step: int, batches, params) -> float:
        """One optimizer step (over --accumulate micro-batches); returns its loss."""
        args, optimizer = self.args, self.optimizer
        lr = learning_rate(step, self.total, self.warmup, args.lr, args.min_lr)
        for group in optimizer.param_groups:
            group["lr"] = lr * group["lr_scale"]
        loss = sum(self.micro_step(self.model, next(batches), micro) for micro in range(args.accumulate))
        if args.clip_grad > 0:
            torch.nn.utils.clip_grad_norm_(params, args.clip_grad)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    def micro_step(self, model, batch, micro: int) -> float:
        """Forward + backward of one micro-batch; gradients are synchronized after the last one only."""
        args = self.args
        batch = to_device(batch, self.dist.device)
        last = micro == args.accumulate - 1
        if args.fsdp:
            model.set_requires_gradient_sync(last)
        skip_sync = not last and hasattr(model, "no_sync")  # DDP
        with (model.no_sync() if skip_sync else contextlib.nullcontext()), autocast(args, self.dist.device):
            loss = forward_loss(model, batch, args.task).loss / args.accumulate
        loss.backward()
        return loss.detach().float().item()


def random_banner(task: str, random_init: str) -> str:
    return weights.random_weights_banner(task, random_init, "Training starts from scratch, the backbone too: a "
                                         "smoke test of the pipeline, not a Sapiens2 fine-tune.")


# ----------------------------------------------------------------------------------------------------
# Data loading: user errors found by a worker come back as one line; the workers stop with the run
# ----------------------------------------------------------------------------------------------------
class SampleFailure:
    """A user error (USER_ERRORS: a bad label, an unreadable image) met while reading a sample, carried as a
    value from a data worker to the training process, which raises it as the one line it is (raised in the
    worker, torch would re-raise it with the worker's traceback in its message)."""

    def __init__(self, message: str):
        self.message = message


class ReadOrFail:
    """A dataset whose samples are the dataset's, or a SampleFailure."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key):
        try:
            return self.dataset[key]
        except USER_ERRORS as error:
            return SampleFailure(str(error))


def collate_or_fail(samples: list) -> dict | SampleFailure:
    return next((s for s in samples if isinstance(s, SampleFailure)), None) or train_data.collate(samples)


def data_loader(dataset, batch_sampler, workers: int, **options) -> torch.utils.data.DataLoader:
    """The training and validation loaders: batches, or SampleFailures that Batches raises."""
    return torch.utils.data.DataLoader(ReadOrFail(dataset), batch_sampler=batch_sampler, collate_fn=collate_or_fail,
                                       num_workers=workers, worker_init_fn=ignore_stop_signals, **options)


class Batches:
    """A loader's batches, as a context manager: a SampleFailure is raised here (train_data.DataError, exit
    status 2), and leaving stops the worker processes, however it is left. Left to garbage collection they
    could live on to interpreter exit (an exception's traceback can hold the iterator in a reference cycle),
    which stops them with SIGTERM, which they ignore (ignore_stop_signals): the run would hang."""

    def __init__(self, loader: torch.utils.data.DataLoader):
        self.iterator = iter(loader)

    def __enter__(self) -> "Batches":
        return self

    def __exit__(self, *exc):
        shutdown = getattr(self.iterator, "_shutdown_workers", None)  # torch has no public close; none without workers
        if shutdown is not None:
            shutdown()

    def __iter__(self) -> "Batches":
        return self

    def __next__(self) -> dict:
        batch = next(self.iterator)
        if isinstance(batch, SampleFailure):
            raise train_data.DataError(batch.message)
        return batch


def ignore_stop_signals(_worker_id: int):
    """Data workers leave Ctrl-C / SIGTERM to the training process, which finishes its step first."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


INTERRUPTED = 130  # exit status after Ctrl-C / SIGTERM (checkpoint saved), as a shell reports SIGINT


class StopRequests:
    """Ctrl-C or SIGTERM (e.g. a scheduler's notice) asks to stop at the end of the current step, after a
    checkpoint; a second Ctrl-C stops at once. All processes agree on the step (one all-reduce per step)."""

    def __init__(self, note):
        self.note, self.requested, self.previous = note, False, {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self.previous[sig] = signal.signal(sig, self.request)
        return self

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def request(self, signum, frame):
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True
        self.note("stopping after this step (a checkpoint is saved first; Ctrl-C again to quit now)")

    def agreed(self, dist_info: Distributed) -> bool:
        return dist_info.all_reduce(torch.tensor([float(self.requested)])).item() > 0


USER_ERRORS = (train_data.DataError, processing.ImageLoadError, FileNotFoundError, ModelError,
               metadata.MissingDataError)


def train(args, argv=None) -> int:
    run = Run(args, argv)
    try:
        run.setup()
        return run.loop()
    except USER_ERRORS as error:  # bad data or checkpoint: the message names the file
        print(f"error: {error}", file=sys.stderr)
        return 2
    finally:
        run.dist.close()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    return train(args, argv)


if __name__ == "__main__":
    sys.exit(main())
