"""The optimizer of a fine-tune and its recipe, as the original training configs give them: the values per task and
backbone size (RELEASED_RECIPES), the defaults a run takes from them (resolve_recipe), the AdamW optimizer over the
library's parameter groups (sapiens2.layer_decay_groups: layer-wise learning-rate decay) and the learning-rate
schedule (warmup from 1e-3 x lr, then linear down; a cosine on request)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from sapiens2 import PRESETS, heads, layer_decay_groups
from sapiens2_app.common.cli import UsageError


# ----------------------------------------------------------------------------------------------------
# The recipe of the released fine-tunes
# ----------------------------------------------------------------------------------------------------
class Released(NamedTuple):
    lr: float
    layer_decay: float
    clip_grad: float  # max gradient norm
    precision: str  # autocast; the configs without `mixed_precision` train in accelerate's default, fp32


# Each released fine-tune's config: facebookresearch/sapiens2 sapiens/{pose,dense}/configs/** and, for matting, the
# upstream commit e07a5f8. tests/test_train.py checks this table against the values that
# tests/fixtures/make_recipe_fixture.py extracted from those configs.
RELEASED_RECIPES = {
    ("seg", "0.4b"): Released(5e-4, 0.8, 2.0, "bf16"),
    ("seg", "0.8b"): Released(5e-4, 0.85, 4.0, "fp32"),
    ("seg", "1b"): Released(5e-4, 0.9, 4.0, "bf16"),
    ("seg", "5b"): Released(5e-4, 0.94, 4.0, "bf16"),
    ("pose", "0.4b"): Released(5e-4, 0.8, 2.0, "bf16"),
    ("pose", "0.8b"): Released(5e-4, 0.85, 4.0, "bf16"),
    ("pose", "1b"): Released(5e-4, 0.9, 4.0, "bf16"),
    ("pose", "5b"): Released(1e-4, 0.94, 4.0, "bf16"),
    ("normal", "0.4b"): Released(5e-4, 0.8, 2.0, "bf16"),
    ("normal", "0.8b"): Released(5e-4, 0.85, 4.0, "bf16"),
    ("normal", "1b"): Released(5e-4, 0.9, 4.0, "bf16"),
    ("normal", "5b"): Released(1e-4, 0.94, 4.0, "bf16"),
    ("pointmap", "0.4b"): Released(5e-4, 0.8, 2.0, "fp32"),
    ("pointmap", "0.8b"): Released(5e-4, 0.85, 2.0, "fp32"),
    ("pointmap", "1b"): Released(5e-4, 0.9, 4.0, "fp32"),
    ("pointmap", "5b"): Released(1e-4, 0.94, 4.0, "fp32"),
    ("matting", "1b"): Released(5e-4, 0.9, 4.0, "bf16"),
    ("albedo", "0.4b"): Released(5e-4, 0.8, 2.0, "bf16"),
    ("albedo", "0.8b"): Released(5e-4, 0.85, 4.0, "bf16"),
    ("albedo", "1b"): Released(5e-4, 0.9, 4.0, "bf16"),
    ("albedo", "5b"): Released(5e-4, 0.94, 4.0, "bf16"),
}
# The same in every config: AdamW with these betas and weight decay; WARMUP_STEPS iterations linear from
# WARMUP_START_FACTOR x lr (LinearLR), then linear to 0 at the last iteration (PolynomialLR, power 1).
BETAS = (0.9, 0.999)
WEIGHT_DECAY = 0.1
WARMUP_STEPS, WARMUP_START_FACTOR = 500, 1e-3
SHORT_RUN_WARMUP = 0.05  # a run shorter than the configs' (10000 to 50000 steps) warms up at most this share
SCHEDULES = ("linear", "cosine")
PRECISIONS = ("bf16", "fp32")
RECIPE_OPTIONS = ("lr", "layer_decay", "warmup", "schedule", "clip_grad", "weight_decay", "precision")


class Followed(NamedTuple):
    recipe: Released
    name: str  # "seg 0.4b config": the source of the values it gives
    why: str  # "" for the backbone's own size, else why that config


def followed_config(task: str, config) -> Followed:
    """The released recipe a fine-tune of `task` on this backbone follows: the config of the backbone's size, else
    of the released size nearest in embed_dim (heads.nearest_size, as the default head). Matting, released at 1b
    only, follows the normal configs at the other sizes, as its default head takes the normal head's widths (the
    matting and normal 1b recipes are the same)."""
    size = heads.nearest_size(sorted({s for _, s in RELEASED_RECIPES}), config.embed_dim)
    followed = task if (task, size) in RELEASED_RECIPES else "normal"
    why = []
    if (PRESETS[size].embed_dim, PRESETS[size].depth) != (config.embed_dim, config.depth):
        why.append(f"{size} is the released size nearest to embed_dim {config.embed_dim}")
    if followed != task:
        why.append(f"{task} is released at {', '.join(s for t, s in RELEASED_RECIPES if t == task)} only")
    return Followed(RELEASED_RECIPES[followed, size], f"{followed} {size} config", "; ".join(why))


@dataclass
class Setting:
    value: object
    source: str  # "--lr", "the resumed run", "seg 0.4b config", ...


def resolve_recipe(args, config, device_type: str, total: int, given: set[str] | None) -> dict[str, Setting]:
    """Each RECIPE_OPTIONS value the command line left unset (None) from the followed config, set on `args` (the
    checkpoints keep them and a resumed run goes on with them), but for the default warmup, which follows the
    steps (a resumed run may change them); returns every value with where it came from. `given`: the options on
    the command line (None: every value set is one)."""
    released, config_name, _ = followed_config(args.task, config)
    warmup = min(WARMUP_STEPS, int(total * SHORT_RUN_WARMUP))
    on_gpu = device_type == "cuda"  # bf16 autocast is for GPUs; on a CPU the default is fp32
    defaults = {
        "lr": (released.lr, config_name),
        "layer_decay": (released.layer_decay, config_name),
        "warmup": (warmup, config_name if warmup == WARMUP_STEPS else
                   f"the {config_name}'s {WARMUP_STEPS}, at most {SHORT_RUN_WARMUP:.0%} of {total} steps"),
        "schedule": ("linear", config_name),
        "clip_grad": (released.clip_grad, config_name),
        "weight_decay": (WEIGHT_DECAY, config_name),
        "precision": (released.precision, config_name) if on_gpu or released.precision == "fp32" else
                     ("fp32", f"on {device_type}; {released.precision} on GPUs, {config_name}"),
    }
    settings = {}
    for name, (default, default_source) in defaults.items():
        value = getattr(args, name)
        if value is None:
            if name != "warmup":
                setattr(args, name, default)
            settings[name] = Setting(default, default_source)
        else:
            given_here = given is None or name in given or not args.resume
            settings[name] = Setting(value, f"--{name.replace('_', '-')}" if given_here else "the resumed run")
    check_schedule(args.lr, args.min_lr, settings["warmup"].value, total)
    return settings


def check_schedule(lr: float | None, min_lr: float | None, warmup: int | None, steps: int | None):
    """The values that make a schedule only together (those known: None is not yet known)."""
    if lr is not None and min_lr is not None and min_lr >= lr:
        raise UsageError(f"--min-lr {min_lr:g} is not below the peak lr {lr:g}: give a smaller --min-lr (or a "
                         "larger --lr)")
    if warmup is not None and steps is not None and warmup >= steps:
        raise UsageError(f"--warmup {warmup} is not shorter than the run ({steps} steps): give fewer warmup steps "
                         "or more --steps")


def describe_recipe(settings: dict[str, Setting], min_lr: float) -> str:
    """Each value of the recipe with its source, e.g. `lr 5e-4 (seg 0.4b config)`, in one line."""
    value = {name: setting.value for name, setting in settings.items()}
    words = {
        "lr": f"lr {short_number(value['lr'])}",
        "layer_decay": f"layer decay {value['layer_decay']:g}",
        "warmup": f"warmup {value['warmup']} steps from {short_number(WARMUP_START_FACTOR)} x lr" if value["warmup"]
                  else "no warmup",
        "schedule": f"then {value['schedule']} to {short_number(min_lr)}",
        "clip_grad": f"gradient-norm clip {value['clip_grad']:g}" if value["clip_grad"] else "no gradient clip",
        "weight_decay": f"weight decay {value['weight_decay']:g}",
        "precision": f"precision {value['precision']}",
    }
    return ", ".join(f"{words[name]} ({setting.source})" for name, setting in settings.items())


def short_number(value: float) -> str:
    """5e-4 rather than 0.0005 or 5.000000e-04."""
    if value == 0 or 1e-2 <= abs(value) < 1e4:
        return f"{value:g}"
    mantissa, exponent = f"{value:e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"


def recipe_table() -> str:
    """RELEASED_RECIPES as train.py --help shows them: a row per task, a column per released size."""
    sizes = sorted({s for _, s in RELEASED_RECIPES}, key=lambda s: PRESETS[s].embed_dim)
    cell = lambda r: f"{short_number(r.lr)} {r.layer_decay:g} {r.clip_grad:g} {r.precision}"  # noqa: E731
    rows = [f"  {'':9}" + "".join(f"{s:19}" for s in sizes).rstrip()]
    for task in heads.TASKS:
        cells = [cell(RELEASED_RECIPES[task, s]) if (task, s) in RELEASED_RECIPES else "(normal's)" for s in sizes]
        rows.append(f"  {task:9}" + "".join(f"{c:19}" for c in cells).rstrip())
    return "\n".join(rows)


# ----------------------------------------------------------------------------------------------------
# The schedule (the parameter groups, with layer-wise lr decay: sapiens2.layer_decay_groups)
# ----------------------------------------------------------------------------------------------------
def learning_rate(step: int, total: int, warmup: int, peak: float, floor: float, schedule: str = "linear") -> float:
    """The lr of optimizer step `step` (0-based) of `total`: `warmup` steps linear from WARMUP_START_FACTOR x peak
    toward the peak (the configs' LinearLR), then from the peak down to `floor` at step `total`, linearly (their
    PolynomialLR with power 1, whose floor is 0) or along a cosine."""
    if step < warmup:
        return peak * (WARMUP_START_FACTOR + (1 - WARMUP_START_FACTOR) * step / warmup)
    progress = min((step - warmup) / max(total - warmup, 1), 1.0)
    shape = 1 - progress if schedule == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
    return floor + (peak - floor) * shape


def adamw(model, args) -> torch.optim.AdamW:
    """AdamW (the configs' betas) over the parameter groups of the model's trainable parameters."""
    groups = layer_decay_groups(model, lr=args.lr, weight_decay=args.weight_decay, layer_decay=args.layer_decay)
    return torch.optim.AdamW(groups, lr=args.lr, betas=BETAS, weight_decay=args.weight_decay)


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float):
    """lr x each group's layer-wise scale."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group["lr_scale"]
