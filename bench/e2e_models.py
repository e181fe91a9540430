"""The models that bench/e2e.py times, and what it counts and compares of them: the implementations (rows) and models
it knows, one random model per configuration written once for every child to load, the outputs compared (a
deterministic subsample), and the FLOP and byte counts of our unfused model. The method: bench/e2e.py's docstring."""

from __future__ import annotations

import dataclasses
import gc
import math
import pathlib

import torch

from sapiens2 import heads
import sapiens2
from sapiens2 import weights

IMPLS = ("hf", "hf-eager", "hf-compile", "ours", "ours-cl", "ours-triton", "ours-triton-cl", "ours-compile", "ours-graph")
# heads.TASKS is the one list of tasks; sorted (stably) only to keep the row order the tables have always had:
# backbone, pose, then heads.TASKS's order with matting last.
MODELS = ("backbone", *sorted(heads.TASKS, key=lambda task: (task != "pose", task == "matting")))
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SEED = 0

# A tiny architecture for the smoke test (not a released size): 10 blocks so that GQA blocks exist.
TINY = sapiens2.Sapiens2Config(64, 10, 4, full_attention_first=3, full_attention_last=3)
TINY_HEADS = {
    "pose": heads.HeadConfig("pose", (32, 16), (16,), 308),
    "seg": heads.HeadConfig("seg", (16, 16), (8,), 29),
    "normal": heads.HeadConfig("normal", (16, 8), (8,), 3),
    "pointmap": heads.HeadConfig("pointmap", (16, 8), (8,), 3, scale_conv_channels=(16, 8), scale_hidden=(8,)),
    "albedo": heads.HeadConfig("albedo", (16, 8), (8,), 3),
    "matting": heads.HeadConfig("matting", (16, 8), (8,), 4),
}


def build_ours(preset: str, model: str, size: tuple[int, int]) -> torch.nn.Module:
    """A randomly initialized model of ours (fp32, CPU) for (preset, model) at image size `size`."""
    overrides = dict(image_size=tuple(size), rope_dtype="float32")
    config = dataclasses.replace(TINY, **overrides) if preset == "tiny" else sapiens2.Sapiens2Config.from_preset(preset, **overrides)
    if model == "backbone":
        return sapiens2.Sapiens2(config)
    head = TINY_HEADS[model] if preset == "tiny" else heads.head_preset(model, preset)
    return heads.build_task_model(config, head)


@torch.no_grad()
def randomize(model: torch.nn.Module):
    """Make every parameter matter: LayerScale ~ U(0.5, 1) (init 1e-4 would hide the attention branch),
    norm weights 1 + 0.1 N(0, 1). Linear/conv weights keep their init."""
    g = torch.Generator().manual_seed(SEED + 1)
    for name, p in model.named_parameters():
        if name.endswith("gamma.weight"):
            p.copy_(torch.rand(p.shape, generator=g) * 0.5 + 0.5)
        elif p.dim() == 1 and ("ln" in name or "norm" in name):
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))


def prepare_weights(preset, model, size, dtype, directory: pathlib.Path) -> pathlib.Path:
    """Write one random model in HF format (loads in both ours and transformers). Returns the directory."""
    if (directory / "model.safetensors").exists():
        return directory
    torch.manual_seed(SEED)
    m = build_ours(preset, model, size)
    randomize(m)
    m.to(DTYPES[dtype])
    # HF cannot represent the albedo head (its ChannelRMSNorm has no HF name): ours only, original names.
    weights.save(m, directory, format="original" if model == "albedo" else "hf")
    del m
    gc.collect()
    return directory


def hf_class_name(model: str) -> str | None:
    if model == "backbone":
        return "Sapiens2Model"
    return weights.HF_TASK_CLASS_OF.get(model)


def outputs_of(model_name: str, impl: str, out) -> list[torch.Tensor]:
    """The tensors to compare, in the same order for ours and HF."""
    if impl.startswith("hf"):
        return {"backbone": lambda: [out.last_hidden_state], "pose": lambda: [out.heatmaps],
                "seg": lambda: [out.logits], "normal": lambda: [out.normals],
                "pointmap": lambda: [out.pointmaps, out.scales], "matting": lambda: [out.alphas, out.foregrounds],
                }[model_name]()
    return {"backbone": lambda: [out.tokens], "pose": lambda: [out.heatmaps], "seg": lambda: [out.logits],
            "normal": lambda: [out.normals], "pointmap": lambda: [out.pointmaps, out.scales],
            "albedo": lambda: [out.albedo], "matting": lambda: [out.alphas, out.foregrounds]}[model_name]()


def subsample(t: torch.Tensor, max_elements: int = 1 << 20) -> torch.Tensor:
    """The first batch item (items are independent), strided down to at most max_elements, as fp32 CPU."""
    flat = t[:1].reshape(-1)
    step = max(1, math.ceil(flat.numel() / max_elements))
    return flat[::step].float().cpu().clone()


# ----------------------------------------------------------------------------------------------------
# FLOP and byte counts (on the meta device, from our unfused model)
# ----------------------------------------------------------------------------------------------------


def count_flops(preset: str, model: str, batch: int, size: tuple[int, int], dtype: str, build=None) -> dict:
    """build(preset, model, size): the model to count (default build_ours)."""
    elt = torch.finfo(DTYPES[dtype]).bits // 8
    totals = {"linear": 0, "conv": 0, "attention": 0, "bytes": 0}

    def linear_hook(mod, inputs, output):
        x = inputs[0]
        totals["linear"] += 2 * x.numel() // mod.in_features * mod.in_features * mod.out_features
        totals["bytes"] += (x.numel() + output.numel() + mod.weight.numel()) * elt

    def conv_hook(mod, inputs, output):
        x = inputs[0]
        k = math.prod(mod.kernel_size)
        if isinstance(mod, torch.nn.ConvTranspose2d):  # every input pixel scatters a k x k x Cout patch
            macs = x.numel() * (mod.out_channels // mod.groups) * k
        else:  # every output pixel gathers a k x k x Cin/groups patch
            macs = output.numel() * (mod.in_channels // mod.groups) * k
        totals["conv"] += 2 * macs
        totals["bytes"] += (x.numel() + output.numel() + mod.weight.numel()) * elt

    def attention_hook(mod, inputs, output):
        B, N, _ = inputs[0].shape
        D = mod.head_dim
        totals["attention"] += 4 * B * mod.num_heads * N * N * D  # q k^T and p v, 2 FLOPs per MAC
        totals["bytes"] += B * N * D * (2 * mod.num_heads + 2 * mod.num_kv_heads) * elt

    with torch.device("meta"):
        m = (build or build_ours)(preset, model, size)
        for mod in m.modules():
            if isinstance(mod, torch.nn.Linear):
                mod.register_forward_hook(linear_hook)
            elif isinstance(mod, (torch.nn.Conv2d, torch.nn.ConvTranspose2d)):
                mod.register_forward_hook(conv_hook)
            elif isinstance(mod, sapiens2.Attention):
                mod.register_forward_hook(attention_hook)
        with torch.no_grad():
            m(torch.empty(batch, 3, *size))
    params = sum(p.numel() for p in m.parameters())
    flops = totals["linear"] + totals["conv"] + totals["attention"]
    return dict(flops=flops, flops_linear=totals["linear"], flops_conv=totals["conv"],
                flops_attention=totals["attention"], bytes=totals["bytes"], params=params)
