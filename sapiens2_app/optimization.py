"""The optimizer of a fine-tune: AdamW parameter groups with layer-wise learning-rate decay (no weight decay on
norms, biases and tokens), and the learning-rate schedule (linear warmup, cosine)."""

from __future__ import annotations

import math

import torch


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


def adamw(model, args) -> torch.optim.AdamW:
    """AdamW (betas 0.9, 0.999) over the parameter groups of the model's trainable parameters."""
    return torch.optim.AdamW(parameter_groups(model, args), lr=args.lr, betas=(0.9, 0.999),
                             weight_decay=args.weight_decay)


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float):
    """lr x each group's layer-wise scale."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group["lr_scale"]
