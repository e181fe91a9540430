"""Loading and saving Sapiens2 checkpoints: every format in the wild, safetensors only (nothing is unpickled).

    model = weights.load("sapiens2_0.4b_pretrain.safetensors")           # a bare original file
    model = weights.load("path/to/dir")                                  # config.json + model.safetensors (or shards)
    model = weights.load("facebook/sapiens2-pretrain-0.4b")              # a hub id (hub.py: the HF cache or a download)
    model = weights.load(path, rope_dtype="float32", dtype=torch.bfloat16, device="cuda")
    weights.save(model, "out_dir", format="hf")                          # or format="original"

Key formats (detected from the keys):
    original pretrain   blocks.0.attn.wq.weight               (bare backbone keys, what our modules use)
    original task       backbone.blocks.0.attn.wq.weight      + decode_head.*
    HF-native base      embeddings.cls_token, model.layer.0.attention.q_proj.weight
    HF-native task      model.embeddings.cls_token, model.model.layer.0...   + decode_head.*, scale_head.*
transformers' save_pretrained() and the Hub's model.safetensors use the original names, with a config.json
(heads deeper than the released ones: a mix of both kinds of names, which loads too).

The architecture comes from the file's metadata when `save` wrote it, else from config.json (HF schema, read
field by field: see the tables before config_from_hf), else it is inferred from tensor shapes. The output count
and the pointmap scale MLP's input width are checked against the weights whatever the source. Loading is
strict: anything missing, unexpected or mis-shaped is reported by key, grouped by prefix; nothing is left
randomly initialized.

Numerics: a model computes RoPE as the released weights were trained (the original's bf16,
Sapiens2Config.rope_dtype="bfloat16"), unless the file's own config (written by `save`) says otherwise;
`load(..., rope_dtype="float32")` gives transformers'. processing's defaults are the original's too (pair
rope_dtype="float32" with its resample="hf" for transformers' results; docs/checkpoints.md).
"""

from __future__ import annotations

if __name__ == "weights":  # a bare `import weights` in a checkout gives the one module, sapiens2.weights
    __import__("sapiens2").one_module(__name__)

import functools
import json
import math
import os
import re
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from sapiens2 import PRESETS, Sapiens2, Sapiens2Config, hub, rope_periods_bf16
from sapiens2.heads import (OUT_CHANNELS, TASK_PRESETS, TASKS, TRANSPOSED_CONV_TASKS, HeadConfig, Sapiens2ForTask, build_task_model,
                   scale_branch_fits, scale_branch_problem, task_preset)

# ----------------------------------------------------------------------------------------------------
# The key mapping: our names (= the original's) <-> HF-native names.
# `{j}` is a layer index; `{3j}` an index that counts [conv, norm, act] triples (original Sequentials).
# ----------------------------------------------------------------------------------------------------

BACKBONE_KEY_MAP = {
    "cls_token": "embeddings.cls_token",
    "storage_tokens": "embeddings.register_tokens",
    "mask_token": "embeddings.mask_token",
    "patch_embed.projection.weight": "embeddings.patch_embeddings.weight",
    "patch_embed.projection.bias": "embeddings.patch_embeddings.bias",
    "blocks.{j}.ln1.weight": "model.layer.{j}.norm1.weight",
    "blocks.{j}.attn.wq.weight": "model.layer.{j}.attention.q_proj.weight",
    "blocks.{j}.attn.wq.bias": "model.layer.{j}.attention.q_proj.bias",
    "blocks.{j}.attn.wk.weight": "model.layer.{j}.attention.k_proj.weight",
    "blocks.{j}.attn.wk.bias": "model.layer.{j}.attention.k_proj.bias",
    "blocks.{j}.attn.wv.weight": "model.layer.{j}.attention.v_proj.weight",
    "blocks.{j}.attn.wv.bias": "model.layer.{j}.attention.v_proj.bias",
    "blocks.{j}.attn.q_norm.weight": "model.layer.{j}.attention.q_norm.weight",
    "blocks.{j}.attn.k_norm.weight": "model.layer.{j}.attention.k_norm.weight",
    "blocks.{j}.attn.proj.weight": "model.layer.{j}.attention.o_proj.weight",
    "blocks.{j}.attn.proj.bias": "model.layer.{j}.attention.o_proj.bias",
    "blocks.{j}.attn.gamma.weight": "model.layer.{j}.layer_scale1.lambda1",
    "blocks.{j}.ln2.weight": "model.layer.{j}.norm2.weight",
    "blocks.{j}.ffn.w3.weight": "model.layer.{j}.mlp.down_proj.weight",
    "blocks.{j}.ffn.w3.bias": "model.layer.{j}.mlp.down_proj.bias",
    "ln1.weight": "norm.weight",
}
# The one named transform: the original's fused SwiGLU input projection is [gate; up] along dim 0 (the
# first half feeds the SiLU); HF keeps the halves as two Linear layers.
W12 = re.compile(r"^blocks\.(\d+)\.ffn\.w12\.(weight|bias)$")
GATE_UP = re.compile(r"^model\.layer\.(\d+)\.mlp\.(gate|up)_proj\.(weight|bias)$")

_CONV = {"{3j}.weight": "{j}.convolution.weight", "{3j}.bias": "{j}.convolution.bias"}
TRANSPOSED_HEAD_KEY_MAP = {  # pose, seg
    "decode_head.deconv_layers.{3j}.weight": "decode_head.upsample_layers.{j}.convolution.weight",
    **{f"decode_head.conv_layers.{o}": f"decode_head.conv_layers.{h}" for o, h in _CONV.items()},
    "decode_head.predictor.weight": "decode_head.predictor.weight",
    "decode_head.predictor.bias": "decode_head.predictor.bias",
}
PIXEL_SHUFFLE_HEAD_KEY_MAP = {  # normal, pointmap, matting (albedo's RMSNorm weights have no HF name)
    "decode_head.input_conv.0.weight": "decode_head.input_conv.convolution.weight",
    "decode_head.input_conv.0.bias": "decode_head.input_conv.convolution.bias",
    "decode_head.upsample_blocks.{j}.0.weight": "decode_head.upsample_layers.{j}.convolution.weight",
    "decode_head.upsample_blocks.{j}.0.bias": "decode_head.upsample_layers.{j}.convolution.bias",
    **{f"decode_head.conv_layers.{o}": f"decode_head.conv_layers.{h}" for o, h in _CONV.items()},
    "decode_head.predictor.weight": "decode_head.predictor.weight",
    "decode_head.predictor.bias": "decode_head.predictor.bias",
    **{f"decode_head.scale_conv_layers.{o}": f"scale_head.conv_layers.{h}" for o, h in _CONV.items()},
    **{f"decode_head.scale_final_layer.{i}.{p}": f"scale_head.predictor.{hf}.{p}"
       for i, hf in ((1, "block1.layers.0"), (3, "block2.layers.0"), (5, "proj")) for p in ("weight", "bias")},
}

# Original task files name the 1x1 predictor after the task; ours is `predictor`.
ORIGINAL_PREDICTOR = re.compile(rf"^decode_head\.conv_({'|'.join(TASKS)})\.")
HF_TASK_CLASSES = {
    "Sapiens2ForPoseEstimation": "pose",
    "Sapiens2ForSemanticSegmentation": "seg",
    "Sapiens2ForNormalEstimation": "normal",
    "Sapiens2ForPointmapEstimation": "pointmap",
    "Sapiens2ForImageMatting": "matting",
}
ROPE_PERIODS_KEY = "rope_embed.periods"  # a buffer of the original (bf16), recomputed here, never loaded


class KeyTemplate:
    """A key with index placeholders: `{j}` (a layer) or `{3j}` (three module slots per layer)."""

    def __init__(self, template: str):
        self.template = template
        self.steps = [int(m[1] or 1) for m in re.finditer(r"\{(\d*)j\}", template)]
        self.regex = re.compile("^" + re.sub(r"\\\{\d*j\\\}", r"(\\d+)", re.escape(template)) + "$")

    def match(self, key: str) -> list[int] | None:
        m = self.regex.match(key)
        if not m:
            return None
        numbers = [int(g) for g in m.groups()]
        if any(n % step for n, step in zip(numbers, self.steps)):
            return None  # e.g. conv_layers.1.* is a norm slot, not a conv
        return [n // step for n, step in zip(numbers, self.steps)]

    def format(self, layers: list[int]) -> str:
        parts = iter(layer * step for layer, step in zip(layers, self.steps))
        return re.sub(r"\{\d*j\}", lambda _: str(next(parts)), self.template)


def _compile(mapping: dict[str, str], reverse: bool = False):
    pairs = [(h, o) if reverse else (o, h) for o, h in mapping.items()]
    return [(KeyTemplate(src), KeyTemplate(dst)) for src, dst in pairs]


_BACKBONE_TO_HF, _BACKBONE_FROM_HF = _compile(BACKBONE_KEY_MAP), _compile(BACKBONE_KEY_MAP, reverse=True)
_HEAD_TO_HF = {True: _compile(TRANSPOSED_HEAD_KEY_MAP), False: _compile(PIXEL_SHUFFLE_HEAD_KEY_MAP)}
_HEAD_FROM_HF = {True: _compile(TRANSPOSED_HEAD_KEY_MAP, True), False: _compile(PIXEL_SHUFFLE_HEAD_KEY_MAP, True)}


def _rename(key: str, table) -> str | None:
    for src, dst in table:
        layers = src.match(key)
        if layers is not None:
            return dst.format(layers)
    return None


def backbone_to_hf(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our (original) backbone names -> HF-native names (w12 split into gate/up)."""
    out = {}
    for key, tensor in state.items():
        m = W12.match(key)
        if m:
            out[f"model.layer.{m[1]}.mlp.gate_proj.{m[2]}"], out[f"model.layer.{m[1]}.mlp.up_proj.{m[2]}"] = (
                tensor.chunk(2, dim=0)
            )
            continue
        new = _rename(key, _BACKBONE_TO_HF)
        if new is None:
            raise ValueError(f"HF transformers has no name for {key!r}")
        out[new] = tensor
    return out


def backbone_from_hf(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF-native backbone names -> ours (gate/up merged into w12). Unknown keys pass through unchanged,
    so the strict load reports them as unexpected."""
    out, halves = {}, {}
    for key, tensor in state.items():
        m = GATE_UP.match(key)
        if m:
            halves.setdefault((m[1], m[3]), {})[m[2]] = tensor
            continue
        out[_rename(key, _BACKBONE_FROM_HF) or key] = tensor
    for (layer, kind), pair in halves.items():
        if set(pair) != {"gate", "up"}:
            raise KeyError(f"model.layer.{layer}.mlp: found {next(iter(pair))}_proj.{kind} without its other half")
        out[f"blocks.{layer}.ffn.w12.{kind}"] = torch.cat([pair["gate"], pair["up"]], dim=0)
    return out


def head_to_hf(state: dict[str, torch.Tensor], transposed: bool) -> dict[str, torch.Tensor]:
    out = {}
    for key, tensor in state.items():
        new = _rename(key, _HEAD_TO_HF[transposed])
        if new is None:
            raise ValueError(f"HF transformers has no name for {key!r}")
        out[new] = tensor
    return out


def head_from_hf(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF-native head names -> ours; keys already under our names pass through. (transformers' own
    save_pretrained renames only the layers its conversion table lists, so a head deeper than the released
    ones comes out with both kinds: `deconv_layers.{0,3}` next to `upsample_layers.{2,3}.convolution`.)"""
    transposed = not any(k.startswith("decode_head.input_conv.") for k in state)
    return {_rename(k, _HEAD_FROM_HF[transposed]) or k: v for k, v in state.items()}


def head_from_original(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], str | None]:
    """Rename decode_head.conv_<task>.* to decode_head.predictor.*; also return <task>."""
    out, task = {}, None
    for key, tensor in state.items():
        m = ORIGINAL_PREDICTOR.match(key)
        if m:
            task = m[1]
            key = "decode_head.predictor." + key[m.end():]
        out[key] = tensor
    return out, task


# ----------------------------------------------------------------------------------------------------
# Reading tensors
# ----------------------------------------------------------------------------------------------------


ALIGNMENT = 64  # bytes: what torch's CPU allocator gives every new tensor


def aligned(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`, copied if it does not start on an ALIGNMENT boundary. safetensors hands out tensors where they lie
    in the file (8-byte aligned at best), and a BLAS may take another code path, with another summation order, on
    data aligned otherwise (MKL does: a model loaded from a file computed other last bits than the same weights
    in new memory): a loaded model computes what the same model built in memory computes, bit for bit."""
    return tensor if tensor.data_ptr() % ALIGNMENT == 0 else tensor.clone()


def read_safetensors(path: str | Path, dtype: torch.dtype | None = None) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """All tensors and the metadata of one .safetensors file, with an error that names the file.
    Floating tensors are cast to `dtype` one at a time as they are read, so a 5b fp32 file loaded in
    bf16 never holds both copies in memory; every tensor comes back aligned (see `aligned`)."""
    path = Path(path)
    cast = lambda t: t.to(dtype) if dtype is not None and t.is_floating_point() else t  # noqa: E731
    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: aligned(cast(f.get_tensor(k))) for k in f.keys()}, dict(f.metadata() or {})
    except FileNotFoundError:
        raise
    except Exception as e:  # safetensors raises its own error types for truncated or corrupt files
        raise CheckpointError(_pickle_refusal(path) or f"{path}: not a readable safetensors file ({e})") from e


def read_checkpoint_dir(directory: Path, dtype: torch.dtype | None = None) -> tuple[dict[str, torch.Tensor], dict, dict]:
    """(tensors, config.json contents or {}, safetensors metadata) of a checkpoint directory."""
    config = read_json(directory / "config.json") if (directory / "config.json").exists() else {}
    index = directory / "model.safetensors.index.json"
    single = directory / "model.safetensors"
    if single.exists():
        tensors, meta = read_safetensors(single, dtype)
    elif index.exists():
        weight_map = _read_weight_map(index)
        tensors, meta = {}, {}
        for shard in sorted(set(weight_map.values())):
            part, meta = read_safetensors(directory / shard, dtype)
            tensors.update(part)
        listed = set(weight_map)
        if listed != set(tensors):
            missing = sorted(listed - set(tensors))
            raise ValueError(f"{index}: shards lack {len(missing)} listed tensors, e.g. {missing[:3]}")
    else:
        files = sorted(p.name for p in directory.glob("*.safetensors"))
        if len(files) != 1:
            raise FileNotFoundError(
                f"{directory}: expected model.safetensors or model.safetensors.index.json, found {files or 'none'}"
            )
        tensors, meta = read_safetensors(directory / files[0], dtype)
    return tensors, config, meta


# ----------------------------------------------------------------------------------------------------
# Formats and configs
# ----------------------------------------------------------------------------------------------------


def split_checkpoint(tensors: dict[str, torch.Tensor]) -> tuple[str, dict, dict, str | None]:
    """(format, backbone tensors, head tensors, task named by the keys) of a raw state dict, with the
    backbone under our names (no prefix) and the head under ours (`decode_head.*`)."""
    if "model.embeddings.cls_token" in tensors:
        fmt, prefix = "hf-task", "model."
    elif "embeddings.cls_token" in tensors:
        fmt, prefix = "hf", ""
    elif "backbone.cls_token" in tensors:
        fmt, prefix = "original-task", "backbone."
    elif "cls_token" in tensors:
        fmt, prefix = "original", ""
    else:
        sample = sorted(tensors)[:5]
        raise ValueError(f"not a Sapiens2 checkpoint: no cls_token in any known format (keys like {sample})")
    backbone, head = {}, {}
    for key, tensor in tensors.items():
        if key.startswith(("decode_head.", "scale_head.")):
            head[key] = tensor
        elif key.startswith(prefix):
            backbone[key[len(prefix) :]] = tensor
        else:
            backbone[key] = tensor  # reported as unexpected by the strict load
    task = None
    if fmt.startswith("hf"):
        backbone = backbone_from_hf(backbone)
    else:
        head, task = head_from_original(head)
    return fmt, backbone, head_from_hf(head), task


def config_from_shapes(state: dict[str, torch.Tensor]) -> Sapiens2Config:
    """Infer the architecture from an original-named backbone state dict (docs/checkpoints.md, file formats)."""
    try:
        C = state["cls_token"].shape[-1]
        depth = 1 + max(int(m[1]) for k in state if (m := re.match(r"^blocks\.(\d+)\.", k)))
        head_dim = state["blocks.0.attn.q_norm.weight"].shape[0]
        kv = [state[f"blocks.{i}.attn.wk.weight"].shape[0] // head_dim for i in range(depth)]
        cfg = dict(
            embed_dim=C,
            depth=depth,
            num_heads=C // head_dim,
            kv_heads_per_layer=kv,
            ffn_dim=state["blocks.0.ffn.w3.weight"].shape[1],
            patch_size=state["patch_embed.projection.weight"].shape[-1],
            in_channels=state["patch_embed.projection.weight"].shape[1],
            num_register_tokens=state["storage_tokens"].shape[1],
            use_mask_token="mask_token" in state,
        )
    except (KeyError, ValueError) as e:
        raise ValueError(f"cannot infer the architecture from the tensor shapes: missing {e}") from e
    if "tokenizer.local_pos_embed" in state:
        window = round((state["tokenizer.local_pos_embed"].shape[1] - 1) ** 0.5)
        layers = 1 + max(int(m[1]) for k in state if (m := re.match(r"^tokenizer\.blocks\.(\d+)\.", k)))
        cfg.update(use_tokenizer=True, tokenizer_window=window, tokenizer_layers=layers, image_size=(4096, 3072),
                   tokenizer_ffn_dim=state["tokenizer.blocks.0.ffn.w3.weight"].shape[1])
    return checked_config(cfg, "the tensor shapes")


# ----------------------------------------------------------------------------------------------------
# Config fields read from a file: each checked for its type and a sane range before anything is built from it.
# A crafted file could otherwise hang the loader (depth 2**63 builds a list of 2**63 kv-head counts), load a
# model whose every output is NaN (norm_eps NaN: json.loads accepts NaN), or one that fails at every forward
# (norm_eps "pointmap"). The bounds are far beyond every released model (the largest, 5b: C 2432, 56 blocks,
# 32 heads, heads of <= 1536 channels) and only keep a file from asking for what no machine can build.
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FieldRule:
    """What one config field may hold: `kind` int, float (finite), bool, str, or a list: ints, strs, pairs (of
    ints); each number in [low, high]. `optional`: None is allowed too. `length`: the most entries a list may have
    (2 for ints: exactly two, a pair such as image_size)."""

    kind: str
    low: float | None = None
    high: float | None = None
    optional: bool = False
    length: int = 64


MAX_WIDTH = 65536  # channels, hidden widths, FFN widths
BACKBONE_FIELD_RULES = {
    "embed_dim": FieldRule("int", 1, MAX_WIDTH),
    "depth": FieldRule("int", 1, 512),
    "num_heads": FieldRule("int", 1, 1024),
    "gqa_kv_heads": FieldRule("int", 1, 1024, optional=True),
    "full_attention_first": FieldRule("int", 0, 512),
    "full_attention_last": FieldRule("int", 0, 512),
    "kv_heads_per_layer": FieldRule("ints", 1, 1024, optional=True, length=512),
    "ffn_dim": FieldRule("int", 1, 4 * MAX_WIDTH, optional=True),
    "hidden_act": FieldRule("str"),
    "patch_size": FieldRule("int", 1, 1024),
    "in_channels": FieldRule("int", 1, 1024),
    "num_register_tokens": FieldRule("int", 0, 4096),
    "image_size": FieldRule("ints", 1, 65536, length=2),
    "norm_eps": FieldRule("float", 1e-30, 1.0),  # > 0: RMSNorm divides by sqrt(mean + eps)
    "layer_scale_init": FieldRule("float", -1e6, 1e6),
    "rope_base": FieldRule("float", 1e-6, 1e12),  # > 0: the periods are powers of it
    "rope_dtype": FieldRule("str"),
    "rope_shift": FieldRule("float", 0, 1e6, optional=True),
    "rope_jitter": FieldRule("float", 0, 1e6, optional=True),
    "rope_rescale": FieldRule("float", 0, 1e6, optional=True),
    "use_tokenizer": FieldRule("bool"),
    "tokenizer_window": FieldRule("int", 1, 64),
    "tokenizer_layers": FieldRule("int", 0, 64),
    "tokenizer_ffn_dim": FieldRule("int", 1, 4 * MAX_WIDTH, optional=True),
    "use_mask_token": FieldRule("bool"),
    "drop_path_rate": FieldRule("float", 0, 1),
}
HEAD_FIELD_RULES = {
    "task": FieldRule("str"),
    "upsample_channels": FieldRule("ints", 1, MAX_WIDTH, length=16),
    "conv_channels": FieldRule("ints", 1, MAX_WIDTH, length=16),
    "out_channels": FieldRule("int", 1, MAX_WIDTH),
    "upsample_kernel_sizes": FieldRule("ints", 1, 63, optional=True, length=16),
    "conv_kernel_sizes": FieldRule("ints", 1, 63, optional=True, length=16),
    "scale_conv_channels": FieldRule("ints", 1, MAX_WIDTH, length=16),
    "scale_hidden": FieldRule("ints", 1, MAX_WIDTH, length=16),
    "scale_conv_kernel_sizes": FieldRule("ints", 1, 63, optional=True, length=16),
    "scale_input_width": FieldRule("int", 1, 2**31, optional=True),
    "labels": FieldRule("strs", optional=True, length=MAX_WIDTH),
    "flip_pairs": FieldRule("pairs", 0, MAX_WIDTH - 1, optional=True, length=MAX_WIDTH),
}


def field_problem(value, rule: FieldRule) -> str | None:
    """Why `value` breaks `rule` (None when it does not)."""
    if value is None:
        return None if rule.optional else "must be set"
    if rule.kind in ("ints", "strs", "pairs"):
        if not isinstance(value, (list, tuple)):
            return f"must be a list, got {type(value).__name__}"
        if len(value) > rule.length or (rule.kind == "ints" and rule.length == 2 and len(value) != 2):
            return f"has {len(value)} entries; at most {rule.length}" if rule.length != 2 else "must have 2 entries"
        item = {"ints": FieldRule("int", rule.low, rule.high), "strs": FieldRule("str"),
                "pairs": FieldRule("ints", rule.low, rule.high, length=2)}[rule.kind]
        return next((f"entry {i} {p}" for i, v in enumerate(value) if (p := field_problem(v, item))), None)
    if rule.kind == "str":
        return None if isinstance(value, str) else f"must be a string, got {type(value).__name__}"
    if rule.kind == "bool":
        return None if isinstance(value, bool) else f"must be true or false, got {value!r}"
    number_types = (int,) if rule.kind == "int" else (int, float)
    if isinstance(value, bool) or not isinstance(value, number_types):
        return f"must be {'an integer' if rule.kind == 'int' else 'a number'}, got {type(value).__name__}"
    if isinstance(value, float) and not math.isfinite(value):
        return f"must be finite, got {value}"
    if not rule.low <= value <= rule.high:  # (Python compares any int with a float exactly, no overflow)
        return f"must be in [{rule.low:g}, {rule.high:g}], got {_short(value)}"
    return None


def _short(value) -> str:
    """A number for a message: a huge int as its size (str() refuses ints of more than 4300 digits)."""
    if isinstance(value, int) and value.bit_length() > 64:
        return f"an integer of {value.bit_length()} bits"
    return repr(value)


def checked_fields(d, rules: dict[str, FieldRule], what: str, file_names: dict[str, str] | None = None) -> dict:
    """`d` (a config dict from a file) when each of its fields follows its rule, else a ValueError naming the
    first field that does not, by the name the file uses (`file_names`: ours -> the file's, where they differ).
    Fields without a rule are the dataclass's to refuse."""
    if not isinstance(d, dict):
        raise ValueError(f"{what} must be a JSON object, got {type(d).__name__}")
    for name, value in d.items():
        problem = field_problem(value, rules[name]) if name in rules else None
        if problem:
            raise ValueError(f"{what} field {(file_names or {}).get(name, name)!r} {problem}")
    return d


def checked_config(d, what: str, file_names: dict[str, str] | None = None) -> Sapiens2Config:
    """A Sapiens2Config from a dict read from a file (`what` names it), its fields checked first."""
    return Sapiens2Config.from_dict(checked_fields(d, BACKBONE_FIELD_RULES, what, file_names))


def checked_head_config(d, what: str) -> HeadConfig:
    """A HeadConfig from a dict read from a file (`what` names it), its fields checked first (flip pairs must
    name outputs the head has)."""
    head = HeadConfig.from_dict(checked_fields(d, HEAD_FIELD_RULES, what))
    outside = [pair for pair in head.flip_pairs or () if max(pair) >= head.out_channels]
    if outside:
        raise ValueError(f"{what} field 'flip_pairs' names output {max(outside[0])} of {head.out_channels}")
    return head


# ----------------------------------------------------------------------------------------------------
# transformers' config.json. Every field transformers 5.23 writes for Sapiens2 is in exactly one of these
# tables (tests/test_weights.py checks that against transformers' own config): honoured (mapped onto our
# configs), required to have the value our model implements (any other value is refused), or irrelevant
# to the weights and to inference (the table says why). A field in none of them is named in a warning.
# ----------------------------------------------------------------------------------------------------

# Honoured: HF config.json field -> Sapiens2Config field
HF_CONFIG_FIELDS = {
    "hidden_size": "embed_dim",
    "num_hidden_layers": "depth",
    "num_attention_heads": "num_heads",
    "intermediate_size": "ffn_dim",
    "num_key_value_heads_per_layer": "kv_heads_per_layer",
    "patch_size": "patch_size",
    "num_channels": "in_channels",
    "num_register_tokens": "num_register_tokens",
    "image_size": "image_size",
    "rms_norm_eps": "norm_eps",
    "rope_theta": "rope_base",
    "use_mask_token": "use_mask_token",
    "pos_embed_shift": "rope_shift",
    "pos_embed_jitter": "rope_jitter",
    "pos_embed_rescale": "rope_rescale",
    "hidden_act": "hidden_act",  # the SwiGLU gate and the pointmap scale MLP, as in transformers
    "layerscale_value": "layer_scale_init",  # LayerScale's initial value (training from scratch)
    "drop_path_rate": "drop_path_rate",  # training; NOTE: ours rises linearly over the blocks (the original's schedule), HF's is flat
}
# Honoured too: the GQA rule (when num_key_value_heads_per_layer is absent) and the head with its outputs.
HF_GQA_RULE_FIELDS = ("num_key_value_attention_heads", "num_first_full_attention_layers", "num_last_full_attention_layers")
HF_HEAD_FIELDS = ("architectures", "head_config", "id2label", "label2id", "num_labels", "flip_pairs")
# Refused unless they have the value our model implements (every released model has these).
HF_REQUIRED_VALUES = {"use_gated_mlp": True, "use_qk_norm": True, "query_bias": True, "key_bias": True,
                      "value_bias": True, "proj_bias": True, "mlp_bias": True}
_TRANSFORMERS_RUNTIME = "a transformers run-time option"
_BACKBONE_OUTPUTS = "which blocks Sapiens2Backbone returns; here forward(layers=[...], normalize_layers=...)"
HF_IRRELEVANT_FIELDS = {
    "model_type": "checked to be sapiens2",
    "transformers_version": "the version that wrote the file",
    "dtype": "the dtype the file was saved in; load(dtype=...) chooses ours",
    "torch_dtype": "the dtype the file was saved in; load(dtype=...) chooses ours",
    "initializer_range": "random initialization only (a loaded model has no random weights)",
    "out_features": _BACKBONE_OUTPUTS, "out_indices": _BACKBONE_OUTPUTS, "stage_names": _BACKBONE_OUTPUTS,
    "_out_features": _BACKBONE_OUTPUTS, "_out_indices": _BACKBONE_OUTPUTS,
    "reshape_hidden_states": _BACKBONE_OUTPUTS, "normalize_backbone_outputs": _BACKBONE_OUTPUTS,
    "attention_dropout": "training only: our attention has no dropout (a nonzero value warns)",
    "semantic_loss_ignore_index": "training only: losses.seg_cross_entropy(ignore_index=255) (another value warns)",
    **{k: _TRANSFORMERS_RUNTIME for k in ("_name_or_path", "output_attentions", "output_hidden_states", "return_dict",
                                          "problem_type", "chunk_size_feed_forward", "is_encoder_decoder")},
}
# head_config: honoured for every head, for pointmap heads only (transformers ignores them elsewhere, so
# do we), or irrelevant.
HF_HEAD_CONFIG_FIELDS = ("use_pixel_shuffle", "upsample_out_channels", "upsample_kernel_sizes", "upsample_kernel_size",
                         "conv_out_channels", "conv_kernel_sizes", "conv_kernel_size")
HF_SCALE_HEAD_FIELDS = ("scale_conv_out_channels", "scale_conv_kernel_sizes", "scale_conv_kernel_size",
                        "scale_final_input_size", "scale_final_hidden_sizes")
HF_HEAD_IRRELEVANT_FIELDS = ("model_type", "transformers_version", "dtype", "torch_dtype", "architectures", "id2label",
                             "label2id", *(k for k, why in HF_IRRELEVANT_FIELDS.items() if why == _TRANSFORMERS_RUNTIME))
# Our own fields that HF has no name for (the 4K tokenizer, the RoPE convention), written under these names.
EXTRA_CONFIG_FIELDS = ("use_tokenizer", "tokenizer_window", "tokenizer_layers", "tokenizer_ffn_dim", "rope_dtype")
# Our field -> its config.json name, for messages; and the rules of config.json's head_config fields.
HF_NAME_OF = {**{ours: theirs for theirs, ours in HF_CONFIG_FIELDS.items()},
              **dict(zip(("gqa_kv_heads", "full_attention_first", "full_attention_last"), HF_GQA_RULE_FIELDS))}
# (transformers writes null for the fields a head does not use: each may be null)
_CHANNELS = replace(HEAD_FIELD_RULES["conv_channels"], optional=True)
_KERNELS = HEAD_FIELD_RULES["conv_kernel_sizes"]
HF_HEAD_FIELD_RULES = {
    **{k: _CHANNELS for k in ("upsample_out_channels", "conv_out_channels", "scale_conv_out_channels",
                              "scale_final_hidden_sizes")},
    **{k: _KERNELS for k in ("upsample_kernel_sizes", "conv_kernel_sizes", "scale_conv_kernel_sizes")},
    **{k: FieldRule("int", 1, 63, optional=True) for k in ("upsample_kernel_size", "conv_kernel_size",
                                                            "scale_conv_kernel_size")},
    "scale_final_input_size": HEAD_FIELD_RULES["scale_input_width"],
    "use_pixel_shuffle": FieldRule("bool", optional=True),
}


def config_from_hf(hf: dict) -> Sapiens2Config:
    """Our config from an HF config.json (missing fields take HF's defaults where they differ from ours)."""
    if hf.get("model_type", "sapiens2") != "sapiens2":
        raise ValueError(f"config.json is for model_type {hf.get('model_type')!r}, not sapiens2")
    _audit_hf_config(hf)
    cfg = {ours: hf[theirs] for theirs, ours in HF_CONFIG_FIELDS.items() if theirs in hf}
    if "kv_heads_per_layer" not in cfg and "num_hidden_layers" in hf:
        # HF's rule, with HF's defaults (8 first, 8 last, 8 kv heads)
        cfg.update(
            gqa_kv_heads=hf.get("num_key_value_attention_heads", 8),
            full_attention_first=hf.get("num_first_full_attention_layers", 8),
            full_attention_last=hf.get("num_last_full_attention_layers", 8),
        )
    patch = cfg.get("patch_size")
    if isinstance(patch, (list, tuple)):  # HF allows (h, w) patches; ours are square
        if patch[0] != patch[1]:
            raise ValueError(f"config.json: non-square patches {patch} are not supported")
        cfg["patch_size"] = patch[0]
    if isinstance(cfg.get("image_size"), int):
        cfg["image_size"] = (cfg["image_size"], cfg["image_size"])
    if type(cfg.get("drop_path_rate")) is int and abs(cfg["drop_path_rate"]) <= 1:  # (JSON's 0; the rest is checked)
        cfg["drop_path_rate"] = float(cfg["drop_path_rate"])
    cfg.update({k: hf[k] for k in EXTRA_CONFIG_FIELDS if k in hf})
    checked_fields(cfg, BACKBONE_FIELD_RULES, "config.json", HF_NAME_OF)
    try:
        return Sapiens2Config(**cfg)
    except ValueError as e:
        raise ValueError(f"config.json: {e}") from e


def _audit_hf_config(hf: dict):
    """Refuse what our model cannot be, warn about what it ignores that would matter."""
    refused = {k: hf[k] for k, want in HF_REQUIRED_VALUES.items() if k in hf and hf[k] != want}
    if refused:
        raise ValueError(
            f"config.json asks for {refused}: this implementation has the released architecture only "
            f"({', '.join(f'{k}={v}' for k, v in HF_REQUIRED_VALUES.items())})"
        )
    if hf.get("attention_dropout"):
        warnings.warn(f"config.json: attention_dropout={hf['attention_dropout']} is not applied (no attention dropout here)")
    if hf.get("semantic_loss_ignore_index", 255) != 255:
        warnings.warn(f"config.json: semantic_loss_ignore_index={hf['semantic_loss_ignore_index']} is not applied; "
                      "pass ignore_index= to losses.seg_cross_entropy")
    known = {*HF_CONFIG_FIELDS, *HF_GQA_RULE_FIELDS, *HF_HEAD_FIELDS, *HF_REQUIRED_VALUES, *HF_IRRELEVANT_FIELDS,
             *EXTRA_CONFIG_FIELDS, "sapiens2_head_config"}
    unknown = sorted(set(hf) - known)
    if unknown:
        warnings.warn(f"config.json: fields not used by this implementation: {unknown}")


def config_to_hf(config: Sapiens2Config, architecture: str = "Sapiens2Model") -> dict:
    """An HF config.json (transformers 5.23 can load it) plus our extra fields."""
    d = config.to_dict()
    hf = {"model_type": "sapiens2", "architectures": [architecture]}
    hf.update({theirs: d[ours] for theirs, ours in HF_CONFIG_FIELDS.items()})
    hf["intermediate_size"] = config.hidden_dim
    hf["num_key_value_heads_per_layer"] = list(config.layer_kv_heads)
    hf.update(HF_REQUIRED_VALUES)
    hf.update({k: d[k] for k in EXTRA_CONFIG_FIELDS})
    return hf


HF_TASK_CLASS_OF = {task: cls for cls, task in HF_TASK_CLASSES.items()}


def hf_head_problem(head: HeadConfig) -> str | None:
    """Why transformers cannot represent this head (None when it can)."""
    if head.task not in HF_TASK_CLASS_OF:
        return f"HF transformers has no {head.task} model"
    if head.task == "pointmap" and len(head.scale_hidden) != 2:
        return "HF's pointmap scale MLP has exactly two hidden layers"
    if head.transposed and (set(head.upsample_kernel_sizes) - {4} or set(head.conv_kernel_sizes) - {1}):
        return "HF transformers pads transposed heads differently unless their kernels are 4 (upsample) and 1 (conv)"
    return None


def head_config_to_hf(head: HeadConfig) -> dict:
    """The HF config.json fields of a head (architectures, num_labels, id2label, flip_pairs, head_config)."""
    problem = hf_head_problem(head)
    if problem:
        raise ValueError(problem)
    hf_head = {
        "use_pixel_shuffle": not head.transposed,
        "upsample_out_channels": list(head.upsample_channels),
        "upsample_kernel_sizes": list(head.upsample_kernel_sizes),
        "conv_out_channels": list(head.conv_channels),
        "conv_kernel_sizes": list(head.conv_kernel_sizes),
    }
    if head.task == "pointmap":
        hf_head.update(scale_conv_out_channels=list(head.scale_conv_channels),
                       scale_conv_kernel_sizes=list(head.scale_conv_kernel_sizes),
                       scale_final_hidden_sizes=list(head.scale_hidden),
                       scale_final_input_size=head.scale_input_width)
    hf = {"architectures": [HF_TASK_CLASS_OF[head.task]], "num_labels": head.out_channels, "head_config": hf_head}
    if head.labels is not None:
        hf["id2label"] = {str(i): name for i, name in enumerate(head.labels)}
        hf["label2id"] = {name: i for i, name in enumerate(head.labels)}
    if head.flip_pairs is not None:
        hf["flip_pairs"] = [list(pair) for pair in head.flip_pairs]
    return hf


def head_config_from_hf(hf: dict, predictor_rows: int | None = None) -> HeadConfig | None:
    """Our head config from an HF config.json. The output count comes from id2label (what transformers
    writes), else num_labels, else the predictor's weight (`predictor_rows`), and must agree with it."""
    if "sapiens2_head_config" in hf:  # a head HF cannot express (albedo), saved by `save`
        return checked_head_config(hf["sapiens2_head_config"], "config.json's sapiens2_head_config")
    task = _hf_task(hf)
    head = hf.get("head_config")
    if task is None or not head:
        return None
    checked_fields(head, HF_HEAD_FIELD_RULES, "config.json's head_config")
    if bool(head.get("use_pixel_shuffle")) == (task in TRANSPOSED_CONV_TASKS):
        kind = "pixel-shuffle" if head.get("use_pixel_shuffle") else "transposed-conv"
        raise ValueError(f"config.json: a {kind} head for {task} is not an architecture this implementation has")
    unknown = sorted(set(head) - {*HF_HEAD_CONFIG_FIELDS, *HF_SCALE_HEAD_FIELDS, *HF_HEAD_IRRELEVANT_FIELDS})
    if unknown:
        warnings.warn(f"config.json: head_config fields not used by this implementation: {unknown}")
    upsample, conv = head.get("upsample_out_channels") or (), head.get("conv_out_channels") or ()
    scale = {}
    if task == "pointmap":  # transformers reads the scale fields for pointmap heads only; so do we
        scale_convs = head.get("scale_conv_out_channels") or ()
        scale = dict(scale_conv_channels=scale_convs, scale_hidden=head.get("scale_final_hidden_sizes") or (),
                     scale_conv_kernel_sizes=_hf_kernel_sizes(head, "scale_conv", len(scale_convs), 1),
                     scale_input_width=head.get("scale_final_input_size"))
    upsample_kernels = _hf_kernel_sizes(head, "upsample", len(upsample), 4)
    conv_kernels = _hf_kernel_sizes(head, "conv", len(conv), 1)
    if task in TRANSPOSED_CONV_TASKS and (set(upsample_kernels) - {4} or set(conv_kernels) - {1}):
        # transformers pads these layers differently from the original (transposed convs: padding 1, no output
        # padding; refinement convs: no padding), which only agrees for the released kernel sizes 4 and 1
        raise ValueError(f"config.json: a {task} head with upsample kernels {upsample_kernels} and conv kernels "
                         f"{conv_kernels}: only 4 and 1 (the released sizes) compute the same here as in transformers")
    labels = _hf_label_names(hf)
    count, said = (len(labels), "id2label") if labels is not None else (hf.get("num_labels"), "num_labels")
    if count is None:
        count, said = predictor_rows, None
    elif predictor_rows is not None and count != predictor_rows:
        raise ValueError(f"config.json: {said} gives {count} outputs, but the predictor weight has {predictor_rows}")
    generic = labels is not None and all(name == f"LABEL_{i}" for i, name in enumerate(labels))
    return checked_head_config(dict(
        task=task, upsample_channels=upsample, conv_channels=conv, out_channels=count,
        upsample_kernel_sizes=upsample_kernels, conv_kernel_sizes=conv_kernels,
        labels=None if generic else labels, flip_pairs=hf.get("flip_pairs") if task == "pose" else None, **scale,
    ), "config.json")


def _hf_kernel_sizes(head: dict, kind: str, count: int, default: int) -> list[int]:
    """transformers' rule: the `<kind>_kernel_sizes` list, else `<kind>_kernel_size` (default) per layer."""
    return head.get(f"{kind}_kernel_sizes") or [head.get(f"{kind}_kernel_size") or default] * count


def _hf_label_names(hf: dict) -> list[str] | None:
    """The output names of id2label, in index order (transformers writes id2label, not num_labels)."""
    id2label = hf.get("id2label")
    if not id2label:
        return None
    ids = sorted(int(i) for i in id2label)
    if ids != list(range(len(ids))):
        raise ValueError(f"config.json: id2label must number the outputs 0..{len(ids) - 1}, got ids {ids[:10]}...")
    return [id2label[str(i)] if str(i) in id2label else id2label[i] for i in ids]


def _indexed(state: dict, template: str) -> list[torch.Tensor]:
    """The tensors of `template` (with `{3j}`/`{j}`) for j = 0, 1, ... in order."""
    t = KeyTemplate(template)
    found = {}
    for key, tensor in state.items():
        layers = t.match(key)
        if layers is not None:
            found[layers[0]] = tensor
    return [found[j] for j in sorted(found)]


def head_config_from_shapes(state: dict[str, torch.Tensor], task: str | None) -> HeadConfig:
    """Infer a head from our-named `decode_head.*` tensors (task from the key names when known)."""
    if "decode_head.predictor.weight" not in state:
        raise ValueError("cannot infer the head: no decode_head predictor weight")
    out_channels = state["decode_head.predictor.weight"].shape[0]
    convs = _indexed(state, "decode_head.conv_layers.{3j}.weight")
    conv = dict(conv_channels=[w.shape[0] for w in convs], conv_kernel_sizes=[w.shape[-1] for w in convs])
    deconvs = _indexed(state, "decode_head.deconv_layers.{3j}.weight")
    if deconvs:  # ConvTranspose2d weights are (in, out, k, k)
        task = task or ("pose" if out_channels == OUT_CHANNELS["pose"] else "seg")
        return checked_head_config(dict(task=task, upsample_channels=[w.shape[1] for w in deconvs],
                                        out_channels=out_channels, upsample_kernel_sizes=[w.shape[-1] for w in deconvs],
                                        **conv), "the tensor shapes")
    ups = _indexed(state, "decode_head.upsample_blocks.{j}.0.weight")  # (4 * out, in, k, k)
    scale_convs = _indexed(state, "decode_head.scale_conv_layers.{3j}.weight")
    linears = _indexed(state, "decode_head.scale_final_layer.{j}.weight")
    if task is None:
        has_norm_weights = any(k.endswith(".norm.weight") for k in state)
        task = ("pointmap" if scale_convs else "albedo" if has_norm_weights
                else "matting" if out_channels == OUT_CHANNELS["matting"] else "normal")
    scale = {}
    if scale_convs:
        scale = dict(scale_conv_channels=[w.shape[0] for w in scale_convs], scale_hidden=[w.shape[0] for w in linears[:-1]],
                     scale_conv_kernel_sizes=[w.shape[-1] for w in scale_convs], scale_input_width=linears[0].shape[1])
    return checked_head_config(dict(task=task, upsample_channels=[w.shape[0] // 4 for w in ups], out_channels=out_channels,
                                    upsample_kernel_sizes=[w.shape[-1] for w in ups], **scale, **conv), "the tensor shapes")


# ----------------------------------------------------------------------------------------------------
# Strict loading
# ----------------------------------------------------------------------------------------------------


def summarize_keys(keys) -> str:
    """'blocks.{0-23}.attn.wq.weight' style summary of many keys (one line per pattern)."""
    groups: dict[str, list[int]] = {}
    for key in sorted(keys):
        m = re.search(r"\.(\d+)\.", key)
        if m:
            groups.setdefault(key[: m.start()] + ".{}." + key[m.end() :], []).append(int(m[1]))
        else:
            groups.setdefault(key, [])
    lines = []
    for pattern, ids in groups.items():
        if not ids:
            lines.append(pattern)
            continue
        ids = sorted(set(ids))
        spans, start = [], ids[0]
        for a, b in zip(ids, ids[1:] + [None]):
            if b != a + 1:
                spans.append(f"{start}" if start == a else f"{start}-{a}")
                start = b
        lines.append(pattern.replace("{}", "{" + ",".join(spans) + "}"))
    return "\n    ".join(lines)


class CheckpointError(ValueError):
    """A checkpoint that exists but cannot be used (corrupt, pickled, wrong task, bad config, NaN weights...):
    the message names the file and the problem. A missing file, shard or download is a FileNotFoundError."""


class CheckpointMismatch(CheckpointError):
    pass


def load_strict(module: torch.nn.Module, state: dict[str, torch.Tensor], source: str = "checkpoint"):
    """Copy `state` into `module`; raise CheckpointMismatch listing missing/unexpected/mis-shaped keys."""
    expected = module.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    misshaped = [
        f"{k}: file {tuple(state[k].shape)} vs model {tuple(expected[k].shape)}"
        for k in sorted(set(state) & set(expected))
        if state[k].shape != expected[k].shape
    ]
    if missing or unexpected or misshaped:
        parts = [f"{source} does not match the model:"]
        if missing:
            parts.append(f"  missing ({len(missing)}):\n    " + summarize_keys(missing))
        if unexpected:
            parts.append(f"  unexpected ({len(unexpected)}):\n    " + summarize_keys(unexpected))
        if misshaped:
            parts.append(f"  mis-shaped ({len(misshaped)}):\n    " + "\n    ".join(misshaped))
        raise CheckpointMismatch("\n".join(parts))
    module.load_state_dict(state, strict=True, assign=True)


def _check_rope_periods(periods: torch.Tensor | None, config: Sapiens2Config, source: str):
    if periods is None:
        return
    expected = rope_periods_bf16(config.head_dim, config.rope_base)
    if periods.shape != expected.shape or not torch.equal(periods.to(torch.bfloat16), expected):
        warnings.warn(
            f"{source}: {ROPE_PERIODS_KEY} {periods.tolist()} differs from the original formula "
            f"{expected.tolist()}; the formula is used"
        )


# ----------------------------------------------------------------------------------------------------
# Sources: a .safetensors file, a checkpoint folder, or a preset name / hub id (found or downloaded by hub.py)
# ----------------------------------------------------------------------------------------------------


def resolve(source: str | os.PathLike, dtype: torch.dtype | None = None) -> tuple[dict[str, torch.Tensor], dict, dict, str]:
    """(tensors, config.json contents, metadata, description) of any source; floating tensors in `dtype`."""
    path = Path(source)
    if path.is_dir():
        tensors, config, meta = read_checkpoint_dir(path, dtype)
        return tensors, config, meta, str(path)
    if path.is_file():
        tensors, meta = read_safetensors(path, dtype)
        sidecar = path.with_name("config.json")
        config = read_json(sidecar) if sidecar.exists() and path.name == "model.safetensors" else {}
        return tensors, config, meta, str(path)
    name = str(source)
    if name in hub.HUB_IDS:
        name = hub.HUB_IDS[name]
    if hub.HUB_ID.match(name) and not name.endswith(".safetensors"):
        tensors, config, meta = read_checkpoint_dir(hub.download(name), dtype)
        return tensors, config, meta, name
    raise FileNotFoundError(f"{source}: no such file or directory, and not a hub id like facebook/sapiens2-pretrain-0.4b")


# ----------------------------------------------------------------------------------------------------
# Errors that name the file: bad JSON, bad index, pickles, NaN/Inf weights
# ----------------------------------------------------------------------------------------------------


def read_json(path: Path) -> dict:
    """A JSON object from a checkpoint's config.json or index (the one place they are read), with an error
    naming the file."""
    try:
        value = json.loads(Path(path).read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got a {type(value).__name__}")
    return value


def _read_weight_map(index: Path) -> dict[str, str]:
    """The index's tensor name -> shard file map; every shard a plain file name present beside the index."""
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f'{index}: no "weight_map" object mapping tensor names to shard files')
    shards = sorted(set(weight_map.values()))
    outside = [s for s in shards if Path(s).name != s]
    if outside:
        raise CheckpointError(f"{index}: shard names must be file names beside the index, got {outside[0]!r}")
    missing = [s for s in shards if not (index.parent / s).is_file()]
    if missing:
        raise FileNotFoundError(f"{index}: shard {missing[0]} is missing from {index.parent}"
                                + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    return weight_map


PICKLE_MAGIC = (b"PK\x03\x04", b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05")  # torch.save zip, raw pickle


def _pickle_refusal(path: Path) -> str | None:
    """The message for a torch.save (pickle) file given where safetensors were expected, else None."""
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError:
        return None
    if not head.startswith(PICKLE_MAGIC):
        return None
    return (f"{path}: a pickled PyTorch checkpoint (torch.save, .pt/.bin), which is never loaded here "
            f"(unpickling can run arbitrary code); convert it to .safetensors where you trust the file "
            f"(safetensors.torch.save_file of its state dict)")


def refuse_non_finite(model: torch.nn.Module, source) -> None:
    """NaN/Inf weights give silent garbage (e.g. every pixel class 0): refuse them, naming the tensors."""
    # a sum is finite only if every element is (fast, no temporary); an overflowing sum gets the exact test
    bad = [name for name, t in model.state_dict().items() if t.is_floating_point()
           and not bool(torch.isfinite(t.sum())) and not bool(torch.isfinite(t).all())]
    if bad:
        raise CheckpointError(f"{source}: {len(bad)} tensors hold NaN or Inf values ({', '.join(bad[:4])}"
                              f"{', ...' if len(bad) > 4 else ''}): a corrupt checkpoint, refused")


def _names_the_source(load_function):
    """Every failure of `load` other than a missing file (FileNotFoundError) or an allocation becomes a
    CheckpointError that names the source; the loaded weights are checked for NaN/Inf."""

    @functools.wraps(load_function)
    def load_checked(source, *args, **kwargs):
        try:
            model = load_function(source, *args, **kwargs)
        except (FileNotFoundError, CheckpointError, MemoryError, torch.cuda.OutOfMemoryError):
            raise
        except Exception as e:  # noqa: BLE001 (key errors, bad shapes, bad config fields...: all name the file)
            detail = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"  # KeyError: 'x' says little
            raise CheckpointError(detail if str(source) in detail else f"{source}: {detail}") from e
        refuse_non_finite(model, source)
        return model

    return load_checked


# ----------------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------------

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


def parse_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


@_names_the_source
def load(source, dtype=torch.float32, device="cpu", task: str | None = None, preset: str | None = None,
         **overrides) -> torch.nn.Module:
    """A model in eval mode from a .safetensors file, a checkpoint directory or a hub id: the backbone
    (Sapiens2) for a pretrain checkpoint, the task model (heads.Sapiens2For*) when it has a decode head.

    task:      require this task ("pose", "seg", ...); a checkpoint of another task is an error.
    preset:    build this architecture ("0.4b", "seg-0.4b", ...) instead of reading/inferring it; the
               checkpoint must match it exactly.
    overrides: Sapiens2Config fields that do not change the weights' shapes, e.g. rope_dtype="float32"
               (transformers' RoPE; the default is the original's bf16, as trained).
    Floating tensors of any dtype in the file are cast to `dtype`.
    """
    dtype = parse_dtype(dtype)
    tensors, hf_config, meta, name = resolve(source, dtype)
    fmt, backbone, head, named_task = split_checkpoint(tensors)
    config, head_config = _configs_for(backbone, head, named_task, hf_config, meta, preset, overrides)
    found = head_config.task if head_config else "pretrain (no decode head)"
    if task is not None and (head_config is None or head_config.task != task):
        raise CheckpointError(f"{name} is a {found} checkpoint, but a {task} model was requested")
    periods = backbone.pop(ROPE_PERIODS_KEY, None)
    with torch.device("meta"):
        model = Sapiens2(config) if head_config is None else build_task_model(config, head_config)
    state = backbone if head_config is None else {**{f"backbone.{k}": v for k, v in backbone.items()}, **head}
    load_strict(model, state, f"{name} ({fmt} format, {found})")
    _check_rope_periods(periods, config, name)
    return model.to(device).eval()


def _configs_for(backbone, head, named_task, hf_config, meta, preset, overrides):
    """(backbone config, head config or None): a preset if given, else our metadata, else config.json,
    else inferred from the shapes. Output count and scale-MLP width are checked against the weights."""
    head_config = None
    predictor = head.get("decode_head.predictor.weight")
    rows = predictor.shape[0] if predictor is not None else None
    if preset is not None:
        size, head_config = _preset(preset)
        config = Sapiens2Config.from_preset(size)
        found = named_task or _hf_task(hf_config) or ("task" if head else "pretrain (no decode head)")
        wanted = head_config.task if head_config else "pretrain"
        if bool(head) != (head_config is not None) or (head and found not in ("task", wanted)):
            raise ValueError(f"the checkpoint is a {found} checkpoint, but preset {preset} is a {wanted} model")
        source = f"preset {preset}"
    elif "sapiens2_config" in meta:  # written by `save`: exact
        config = checked_config(json.loads(meta["sapiens2_config"]), "metadata sapiens2_config")
        if "sapiens2_head_config" in meta:
            head_config = checked_head_config(json.loads(meta["sapiens2_head_config"]), "metadata sapiens2_head_config")
        source = "the file's metadata"
    elif hf_config:
        config, head_config = config_from_hf(hf_config), head_config_from_hf(hf_config, rows)
        source = "config.json"
    else:
        config = config_from_shapes(backbone)
    if head and head_config is None and preset is None:
        head_config, source = head_config_from_shapes(head, named_task or _hf_task(hf_config)), "the tensors"
    if head_config is not None and rows is not None and head_config.out_channels != rows:
        raise ValueError(f"{source} gives the {head_config.task} head {head_config.out_channels} outputs, "
                         f"but the predictor weight has {rows}")
    try:
        config = checked_config({**config.to_dict(), **overrides}, "the overrides")
    except TypeError as e:
        raise ValueError(f"bad override: {e}") from e
    if head_config is not None and head_config.task == "pointmap" and head:
        head_config, config = _fit_scale_branch(head, head_config, config, source, "image_size" in overrides)
    return config, head_config


def _fit_scale_branch(head, head_config: HeadConfig, config: Sapiens2Config, source: str, size_given: bool):
    """The scale MLP's input width is in its first weight: take it from there (a config that says
    otherwise is an error). When the backbone's image_size does not give that width and nobody set it,
    use the size that does with the aspect closest to image_size's (the run-time check names the rest)."""
    first = head.get("decode_head.scale_final_layer.1.weight")
    if first is None:
        return head_config, config
    width = first.shape[1]
    if head_config.scale_input_width not in (None, width):
        raise ValueError(f"{source} gives the pointmap scale MLP {head_config.scale_input_width} inputs, "
                         f"but its weight has {width}")
    head_config = replace(head_config, scale_input_width=width)
    m = config.size_multiple
    sizes = [(hs[-1] * m, ws[-1] * m) for hs, ws in scale_branch_fits(head_config, limit=None)]
    if not sizes:  # (a width of one cell per channel is one of these: instance norm cannot run on a 1 x 1 map)
        raise ValueError(f"the pointmap scale MLP takes {width} inputs: no input size gives that many "
                         f"(from a map of more than one cell after the {len(head_config.scale_conv_channels)} "
                         f"stride-2 convs)")
    if size_given or scale_branch_problem(head_config, config.image_size, m) is None:
        return head_config, config
    aspect = config.image_size[0] / config.image_size[1]
    best = min(sizes, key=lambda hw: abs(math.log(hw[0] / hw[1] / aspect)))
    return head_config, replace(config, image_size=best)


def _hf_task(hf_config: dict) -> str | None:
    return next((HF_TASK_CLASSES[a] for a in hf_config.get("architectures", []) if a in HF_TASK_CLASSES), None)


def _preset(name: str) -> tuple[str, HeadConfig | None]:
    if name in PRESETS:
        return name, None
    if name in TASK_PRESETS:
        return task_preset(name)
    raise ValueError(f"unknown preset {name!r}; backbones: {', '.join(PRESETS)}; tasks: {', '.join(TASK_PRESETS)}")


def current_umask() -> int:
    """The process umask, read without changing it where Linux shows it (/proc), else set-and-restore."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def new_file_mode() -> int:
    """The mode open() gives a new file (the umask read at each call: a process may change it)."""
    return 0o666 & ~current_umask()


def save_safetensors(tensors: dict[str, torch.Tensor], path, metadata: dict[str, str] | None = None):
    """safetensors' save_file with the usual mode: save_file creates its files 0600 (through a private temporary),
    which would keep colleagues on a shared machine from reading a saved model."""
    save_file(tensors, str(path), metadata=metadata)
    os.chmod(path, new_file_mode())


def save(model: Sapiens2 | Sapiens2ForTask, path, format: str = "original"):
    """Write `model` (a backbone or a task model) as safetensors.

    format="original": the original key names (+ the bf16 rope periods buffer), what the Hub files use;
    format="hf":       HF-native names (embeddings.*, model.layer.N.*, decode_head.*, scale_head.*), what
                       save_pretrained(..., save_original_format=False) writes.
    A path ending in .safetensors gets one file (configs in its metadata); any other path becomes a
    directory with config.json (HF schema, loadable by transformers) and model.safetensors.
    """
    if format not in ("original", "hf"):
        raise ValueError(f"format must be 'original' or 'hf', got {format!r}")
    is_task = isinstance(model, Sapiens2ForTask)
    backbone = model.backbone if is_task else model
    config = backbone.config
    state = {k: v.detach().contiguous().cpu() for k, v in backbone.state_dict().items()}
    head = {k: v.detach().contiguous().cpu() for k, v in model.decode_head.state_dict(prefix="decode_head.").items()} if is_task else {}
    if format == "hf":
        if config.use_tokenizer:
            raise ValueError("HF transformers has no 4K tokenizer: save a 4K model with format='original'")
        if is_task:
            head_config_to_hf(model.head_config)  # raises if HF cannot represent this head
        state = backbone_to_hf(state)
        head = head_to_hf(head, model.head_config.transposed) if is_task else {}
        state = {(f"model.{k}" if is_task else k): v for k, v in state.items()}
    else:
        state[ROPE_PERIODS_KEY] = rope_periods_bf16(config.head_dim, config.rope_base)
        if is_task:
            state = {f"backbone.{k}": v for k, v in state.items()}
            predictor = f"decode_head.conv_{model.head_config.task}."
            head = {k.replace("decode_head.predictor.", predictor): v for k, v in head.items()}
    metadata = {"format": "pt", "sapiens2_config": json.dumps(config.to_dict(), allow_nan=False),
                "sapiens2_format": format}
    hf_config = config_to_hf(config)
    if is_task:
        metadata["sapiens2_head_config"] = json.dumps(model.head_config.to_dict(), allow_nan=False)
        if hf_head_problem(model.head_config) is None:
            hf_config.update(head_config_to_hf(model.head_config))
        else:  # our own field; transformers cannot load this model, we can
            hf_config.update(architectures=[type(model).__name__], sapiens2_head_config=model.head_config.to_dict())
    path = Path(path)
    if path.suffix == ".safetensors":
        path.parent.mkdir(parents=True, exist_ok=True)
        save_safetensors({**state, **head}, path, metadata)
    else:
        path.mkdir(parents=True, exist_ok=True)
        save_safetensors({**state, **head}, path / "model.safetensors", metadata)
        (path / "config.json").write_text(json.dumps(hf_config, indent=2, allow_nan=False))
    return path
