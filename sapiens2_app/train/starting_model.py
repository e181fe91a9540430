"""The model a fine-tune starts from: --model's checkpoint (or random weights, --random-init), its backbone, and
its head continued or a new one (--head widths, else heads.default_head; initialized as the original's), with the
data's labels."""

from __future__ import annotations

from dataclasses import replace

import torch

from sapiens2 import Sapiens2, heads, weights
from sapiens2_app.predict import models
from sapiens2_app.common.cli import UsageError


def new_head_config(task: str, out_channels: int, config, widths, like: heads.HeadConfig | None) -> heads.HeadConfig:
    """The head to build: --head widths, else those of the checkpoint's own head (same task), else
    heads.default_head for this backbone (the released head of its size; scaled from the nearest released size's
    for other sizes). A pointmap --head without SCALE_CONV:SCALE_HIDDEN keeps the checkpoint's scale branch, else
    takes the default head's. A pointmap scale MLP's input width follows config.image_size (the task model
    computes it), not the checkpoint's."""
    default = heads.default_head(task, config, out_channels)
    if widths is None:
        return default if like is None else replace(like, out_channels=out_channels, labels=None, flip_pairs=None,
                                                    scale_input_width=None)
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
        raise UsageError(f"{source}: no {head.task} head can be trained on this backbone: its patch size "
                         f"{config.patch_size} is not {'4 x ' if head.task == 'pose' else ''}a power of 2, so no "
                         f"number of 2x upsampling layers brings its outputs to {where}")
    hint = head_option(heads.default_head(head.task, config, head.out_channels))
    raise UsageError(f"{source}: this {head.task} head has {layers} upsampling layers, its outputs are at "
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
        return models.load_or_random(source, random_init, lambda: weights.load(source), random_backbone, note=log)
    except (ValueError, OSError) as error:  # not found, not downloadable, not a Sapiens2 checkpoint
        raise UsageError(f"--model {source}: {error}") from None


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
    size_ok = not (same_task and args.task == "pointmap") or scale_branch_takes(old_head, config)
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
        init_new_head(model.decode_head, args.task)
    log(f"model: {source} -> {why}")
    return model.train(), random


def init_new_head(head: torch.nn.Module, task: str):
    """A new head's weights as the original heads' _init_weights sets them (sapiens/dense/src/models/heads/*_head.py,
    sapiens/pose/src/models/heads/pose_heatmap_head.py): convolutions kaiming-normal (fan_out, relu), linear layers
    (the pointmap scale MLP) kaiming-normal (fan_in, linear), biases zero. The dense heads' rule names nn.Conv2d
    only, so their transposed convolutions (seg's) keep PyTorch's default, as there; the pose head's names both.
    (The norms keep theirs: ones, or no weights at all, as the original's InstanceNorm2d.)"""
    convolutions = (torch.nn.Conv2d, torch.nn.ConvTranspose2d) if task == "pose" else (torch.nn.Conv2d,)
    for module in head.modules():
        if isinstance(module, convolutions):
            torch.nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(module, torch.nn.Linear):
            torch.nn.init.kaiming_normal_(module.weight, mode="fan_in", nonlinearity="linear")
        else:
            continue
        if module.bias is not None:
            torch.nn.init.zeros_(module.bias)


def scale_branch_takes(head: heads.HeadConfig, config) -> bool:
    """Whether a pointmap head's scale branch takes inputs of config.image_size (heads.scale_branch_problem)."""
    return heads.scale_branch_problem(head, config.image_size, config.size_multiple) is None


def random_banner(task: str, random_init: str) -> str:
    return models.random_weights_banner(task, random_init, "Training starts from scratch, the backbone too: a "
                                         "smoke test of the pipeline, not a Sapiens2 fine-tune.")
