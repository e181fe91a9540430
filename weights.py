"""Loading and saving Sapiens2 checkpoints: every format in the wild, safetensors only (nothing is unpickled).

    model = weights.load("sapiens2_0.4b_pretrain.safetensors")           # a bare original file
    model = weights.load("path/to/dir")                                  # config.json + model.safetensors (or shards)
    model = weights.load("facebook/sapiens2-pretrain-0.4b")              # a hub id (downloaded once, cached)
    model = weights.load(path, rope_dtype="float32", dtype=torch.bfloat16, device="cuda")
    weights.save(model, "out_dir", format="hf")                          # or format="original"

Key formats (detected from the keys):
    original pretrain   blocks.0.attn.wq.weight               (bare backbone keys, what our modules use)
    original task       backbone.blocks.0.attn.wq.weight      + decode_head.*
    HF-native base      embeddings.cls_token, model.layer.0.attention.q_proj.weight
    HF-native task      model.embeddings.cls_token, model.model.layer.0...   + decode_head.*, scale_head.*
transformers' save_pretrained() and the Hub's model.safetensors use the original names, with a config.json.

The architecture comes from the file's metadata when `save` wrote it, else from config.json (HF schema),
else it is inferred from tensor shapes. Loading is strict: anything missing,
unexpected or mis-shaped is reported by key, grouped by prefix; nothing is left randomly initialized.
"""

from __future__ import annotations

import json
import os
import re
import sys
import urllib.error
import urllib.request
import warnings
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from sapiens2 import Sapiens2, Sapiens2Config, rope_periods_bf16

# ----------------------------------------------------------------------------------------------------
# The key mapping: original name <-> HF-native name. `{}` stands for a block index.
# ----------------------------------------------------------------------------------------------------

BACKBONE_KEY_MAP = {
    "cls_token": "embeddings.cls_token",
    "storage_tokens": "embeddings.register_tokens",
    "mask_token": "embeddings.mask_token",
    "patch_embed.projection.weight": "embeddings.patch_embeddings.weight",
    "patch_embed.projection.bias": "embeddings.patch_embeddings.bias",
    "blocks.{}.ln1.weight": "model.layer.{}.norm1.weight",
    "blocks.{}.attn.wq.weight": "model.layer.{}.attention.q_proj.weight",
    "blocks.{}.attn.wq.bias": "model.layer.{}.attention.q_proj.bias",
    "blocks.{}.attn.wk.weight": "model.layer.{}.attention.k_proj.weight",
    "blocks.{}.attn.wk.bias": "model.layer.{}.attention.k_proj.bias",
    "blocks.{}.attn.wv.weight": "model.layer.{}.attention.v_proj.weight",
    "blocks.{}.attn.wv.bias": "model.layer.{}.attention.v_proj.bias",
    "blocks.{}.attn.q_norm.weight": "model.layer.{}.attention.q_norm.weight",
    "blocks.{}.attn.k_norm.weight": "model.layer.{}.attention.k_norm.weight",
    "blocks.{}.attn.proj.weight": "model.layer.{}.attention.o_proj.weight",
    "blocks.{}.attn.proj.bias": "model.layer.{}.attention.o_proj.bias",
    "blocks.{}.attn.gamma.weight": "model.layer.{}.layer_scale1.lambda1",
    "blocks.{}.ln2.weight": "model.layer.{}.norm2.weight",
    "blocks.{}.ffn.w3.weight": "model.layer.{}.mlp.down_proj.weight",
    "blocks.{}.ffn.w3.bias": "model.layer.{}.mlp.down_proj.bias",
    "ln1.weight": "norm.weight",
}
# The one named transform: the original's fused SwiGLU input projection is [gate; up] along dim 0 (the
# first half feeds the SiLU); HF keeps the halves as two Linear layers.
FUSED_W12 = ("blocks.{}.ffn.w12.{}", ("model.layer.{}.mlp.gate_proj.{}", "model.layer.{}.mlp.up_proj.{}"))

# Decode-head names that identify the task of an original-format checkpoint.
TASK_PREDICTORS = {
    "conv_pose": "pose",
    "conv_seg": "seg",
    "conv_normal": "normal",
    "conv_pointmap": "pointmap",
    "conv_albedo": "albedo",
    "conv_matting": "matting",
}
HF_TASK_CLASSES = {
    "Sapiens2ForPoseEstimation": "pose",
    "Sapiens2ForSemanticSegmentation": "seg",
    "Sapiens2ForNormalEstimation": "normal",
    "Sapiens2ForPointmapEstimation": "pointmap",
    "Sapiens2ForImageMatting": "matting",
}
ROPE_PERIODS_KEY = "rope_embed.periods"  # a buffer of the original (bf16), recomputed here, never loaded


def _pattern(template: str) -> re.Pattern:
    return re.compile("^" + re.escape(template).replace(r"\{\}", r"(\d+)") + "$")


_TO_HF = [(_pattern(o), h) for o, h in BACKBONE_KEY_MAP.items()]
_FROM_HF = [(_pattern(h), o) for o, h in BACKBONE_KEY_MAP.items()]


def _rename(key: str, table) -> str | None:
    for pattern, template in table:
        m = pattern.match(key)
        if m:
            return template.format(*m.groups())
    return None


def backbone_to_hf(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Original backbone names -> HF-native names (w12 split into gate/up)."""
    out = {}
    for key, tensor in state.items():
        m = re.match(r"^blocks\.(\d+)\.ffn\.w12\.(weight|bias)$", key)
        if m:
            gate, up = tensor.chunk(2, dim=0)
            out[FUSED_W12[1][0].format(*m.groups())] = gate
            out[FUSED_W12[1][1].format(*m.groups())] = up
            continue
        new = _rename(key, _TO_HF)
        if new is None:
            raise KeyError(f"no HF name for backbone key {key!r}")
        out[new] = tensor
    return out


def backbone_from_hf(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF-native backbone names -> original names (gate/up merged into w12). Unknown keys pass through
    unchanged, so the strict load reports them as unexpected."""
    out, halves = {}, {}
    for key, tensor in state.items():
        m = re.match(r"^model\.layer\.(\d+)\.mlp\.(gate|up)_proj\.(weight|bias)$", key)
        if m:
            halves.setdefault((m[1], m[3]), {})[m[2]] = tensor
            continue
        out[_rename(key, _FROM_HF) or key] = tensor
    for (layer, kind), pair in halves.items():
        if set(pair) != {"gate", "up"}:
            present = next(iter(pair))
            raise KeyError(f"model.layer.{layer}.mlp: found {present}_proj.{kind} without its other half")
        out[f"blocks.{layer}.ffn.w12.{kind}"] = torch.cat([pair["gate"], pair["up"]], dim=0)
    return out


# ----------------------------------------------------------------------------------------------------
# Reading tensors
# ----------------------------------------------------------------------------------------------------


def read_safetensors(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """All tensors and the metadata of one .safetensors file, with an error that names the file."""
    path = Path(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})
    except FileNotFoundError:
        raise
    except Exception as e:  # safetensors raises its own error types for truncated or corrupt files
        raise ValueError(f"{path}: not a readable safetensors file ({e})") from e


def read_checkpoint_dir(directory: Path) -> tuple[dict[str, torch.Tensor], dict, dict]:
    """(tensors, config.json contents or {}, safetensors metadata) of a checkpoint directory."""
    config = json.loads((directory / "config.json").read_text()) if (directory / "config.json").exists() else {}
    index = directory / "model.safetensors.index.json"
    single = directory / "model.safetensors"
    if single.exists():
        tensors, meta = read_safetensors(single)
    elif index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        tensors, meta = {}, {}
        for shard in sorted(set(weight_map.values())):
            part, meta = read_safetensors(directory / shard)
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
        tensors, meta = read_safetensors(directory / files[0])
    return tensors, config, meta


# ----------------------------------------------------------------------------------------------------
# Formats and configs
# ----------------------------------------------------------------------------------------------------


def split_checkpoint(tensors: dict[str, torch.Tensor]) -> tuple[str, dict, dict]:
    """(format, backbone tensors in original names, head tensors) of a raw state dict."""
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
    if fmt.startswith("hf"):
        backbone = backbone_from_hf(backbone)
    return fmt, backbone, head


def config_from_shapes(state: dict[str, torch.Tensor]) -> Sapiens2Config:
    """Infer the architecture from an original-named backbone state dict (spec: checkpoints.md c.1)."""
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
        cfg.update(use_tokenizer=True, tokenizer_window=window, tokenizer_layers=layers, image_size=(4096, 3072))
    return Sapiens2Config(**cfg)


# HF config.json field <-> Sapiens2Config field
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
}
# Our own fields that HF has no name for (the 4K tokenizer), written under these names.
EXTRA_CONFIG_FIELDS = ("use_tokenizer", "tokenizer_window", "tokenizer_layers", "rope_dtype")


def config_from_hf(hf: dict) -> Sapiens2Config:
    """Our config from an HF config.json (missing fields take HF's defaults where they differ from ours)."""
    if hf.get("model_type", "sapiens2") != "sapiens2":
        raise ValueError(f"config.json is for model_type {hf.get('model_type')!r}, not sapiens2")
    cfg = {ours: hf[theirs] for theirs, ours in HF_CONFIG_FIELDS.items() if theirs in hf}
    if "kv_heads_per_layer" not in cfg and "num_hidden_layers" in hf:
        # HF's rule, with HF's defaults (8 first, 8 last, 8 kv heads)
        cfg.update(
            gqa_kv_heads=hf.get("num_key_value_attention_heads", 8),
            full_attention_first=hf.get("num_first_full_attention_layers", 8),
            full_attention_last=hf.get("num_last_full_attention_layers", 8),
        )
    for name in ("patch_size", "image_size"):
        v = cfg.get(name)
        if name == "patch_size" and isinstance(v, (list, tuple)):
            if v[0] != v[1]:
                raise ValueError(f"non-square patches {v} are not supported")
            cfg[name] = v[0]
        if name == "image_size" and isinstance(v, int):
            cfg[name] = (v, v)
    cfg.update({k: hf[k] for k in EXTRA_CONFIG_FIELDS if k in hf})
    return Sapiens2Config(**cfg)


def config_to_hf(config: Sapiens2Config, architecture: str = "Sapiens2Model") -> dict:
    """An HF config.json (transformers 5.23 can load it) plus our extra fields."""
    d = config.to_dict()
    hf = {"model_type": "sapiens2", "architectures": [architecture]}
    hf.update({theirs: d[ours] for theirs, ours in HF_CONFIG_FIELDS.items()})
    hf["intermediate_size"] = config.hidden_dim
    hf["num_key_value_heads_per_layer"] = list(config.layer_kv_heads)
    hf.update(use_gated_mlp=True, use_qk_norm=True, hidden_act="silu", layerscale_value=config.layer_scale_init)
    hf.update({k: d[k] for k in EXTRA_CONFIG_FIELDS})
    return hf


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


class CheckpointMismatch(ValueError):
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
# Hub download (HF_ENDPOINT, HF_TOKEN, HF_HUB_OFFLINE are honoured)
# ----------------------------------------------------------------------------------------------------

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# Released pretrain checkpoints by preset name.
HUB_IDS = {name: f"facebook/sapiens2-pretrain-{name}" for name in ("0.1b", "0.4b", "0.8b", "1b", "5b")}


def cache_dir() -> Path:
    return Path(os.environ.get("SAPIENS2_CACHE", Path.home() / ".cache" / "sapiens2"))


def _fetch(url: str, target: Path, progress: bool = True) -> bool:
    """Download url to target, resuming a partial `.part` file. False on HTTP 404."""
    part = target.with_name(target.name + ".part")
    start = part.stat().st_size if part.exists() else 0
    request = urllib.request.Request(url, headers={"User-Agent": "sapiens2"})
    if os.environ.get("HF_TOKEN"):
        request.add_header("Authorization", f"Bearer {os.environ['HF_TOKEN']}")
    if start:
        request.add_header("Range", f"bytes={start}-")
    try:
        response = urllib.request.urlopen(request, timeout=60)
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return False
        if e.code == 416:  # the .part file is already complete
            part.rename(target)
            return True
        raise
    with response:
        resumed = response.status == 206
        total = int(response.headers.get("Content-Length", 0)) + (start if resumed else 0)
        done = start if resumed else 0
        with open(part, "ab" if resumed else "wb") as out:
            while chunk := response.read(1 << 20):
                out.write(chunk)
                done += len(chunk)
                if progress and total:
                    print(f"\r{target.name}: {done / 2**20:.0f}/{total / 2**20:.0f} MiB", end="", file=sys.stderr)
    if progress and total:
        print(file=sys.stderr)
    part.rename(target)
    return True


def download(repo_id: str, revision: str = "main", progress: bool = True) -> Path:
    """A local directory holding repo_id's config.json and weights, downloading what is not cached."""
    local = cache_dir() / repo_id.replace("/", "--") / revision
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    have = lambda name: (local / name).exists()  # noqa: E731
    if have("model.safetensors") or have("model.safetensors.index.json"):
        index = local / "model.safetensors.index.json"
        shards = set(json.loads(index.read_text())["weight_map"].values()) if index.exists() else set()
        if all(have(s) for s in shards):
            return local
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false"):
        raise FileNotFoundError(_how_to_get(repo_id, revision, local, "HF_HUB_OFFLINE is set"))
    local.mkdir(parents=True, exist_ok=True)
    url = f"{endpoint}/{repo_id}/resolve/{revision}/"
    try:
        _fetch(url + "config.json", local / "config.json", progress=False)  # optional
        if not _fetch(url + "model.safetensors", local / "model.safetensors", progress):
            if not _fetch(url + "model.safetensors.index.json", local / "model.safetensors.index.json", False):
                raise FileNotFoundError(f"{repo_id}@{revision} has neither model.safetensors nor an index at {url}")
            index = json.loads((local / "model.safetensors.index.json").read_text())
            for shard in sorted(set(index["weight_map"].values())):
                if not have(shard) and not _fetch(url + shard, local / shard, progress):
                    raise FileNotFoundError(f"{repo_id}: shard {shard} listed in the index is missing at {url}")
    except (urllib.error.URLError, OSError) as e:
        if isinstance(e, FileNotFoundError):
            raise
        raise FileNotFoundError(_how_to_get(repo_id, revision, local, f"download failed: {e}")) from e
    return local


def _how_to_get(repo_id, revision, local, why) -> str:
    return (
        f"cannot get {repo_id} ({why}). Download model.safetensors (and config.json) from "
        f"https://huggingface.co/{repo_id}/tree/{revision} and put them in {local}, or pass the file's path."
    )


def resolve(source: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict, dict, str]:
    """(tensors, config.json contents, metadata, description) of any source."""
    path = Path(source)
    if path.is_dir():
        tensors, config, meta = read_checkpoint_dir(path)
        return tensors, config, meta, str(path)
    if path.is_file():
        tensors, meta = read_safetensors(path)
        sidecar = path.with_name("config.json")
        config = json.loads(sidecar.read_text()) if sidecar.exists() and path.name == "model.safetensors" else {}
        return tensors, config, meta, str(path)
    name = str(source)
    if name in HUB_IDS:
        name = HUB_IDS[name]
    if HUB_ID.match(name) and not name.endswith(".safetensors"):
        tensors, config, meta = read_checkpoint_dir(download(name))
        return tensors, config, meta, name
    raise FileNotFoundError(f"{source}: no such file or directory, and not a hub id like facebook/sapiens2-pretrain-0.4b")


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


def load(source, dtype=torch.float32, device="cpu", **overrides) -> torch.nn.Module:
    """A model in eval mode from a .safetensors file, a checkpoint directory or a hub id.

    overrides: Sapiens2Config fields that do not change the weights' shapes, e.g. rope_dtype="float32".
    Floating tensors of any dtype in the file are cast to `dtype`.
    """
    tensors, hf_config, meta, name = resolve(source)
    fmt, backbone, head = split_checkpoint(tensors)
    config = _config_for(backbone, hf_config, meta, overrides)
    if head:
        task = _task_of(head, hf_config)
        raise NotImplementedError(
            f"{name} is a {task} checkpoint (it has a decode head); task models are not implemented yet"
        )
    _check_rope_periods(backbone.pop(ROPE_PERIODS_KEY, None), config, name)
    dtype = parse_dtype(dtype)
    with torch.device("meta"):
        model = Sapiens2(config)
    state = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in backbone.items()}
    load_strict(model, state, f"{name} ({fmt} format)")
    return model.to(device).eval()


def _config_for(backbone, hf_config: dict, meta: dict, overrides: dict) -> Sapiens2Config:
    # Our own metadata (written by `save`) is the exact config; config.json is HF's schema.
    if "sapiens2_config" in meta:
        config = Sapiens2Config.from_dict(json.loads(meta["sapiens2_config"]))
    elif hf_config:
        config = config_from_hf(hf_config)
    else:
        config = config_from_shapes(backbone)
    try:
        return Sapiens2Config.from_dict({**config.to_dict(), **overrides})
    except TypeError as e:
        raise ValueError(f"bad override: {e}") from e


def _task_of(head: dict, hf_config: dict) -> str:
    for arch in hf_config.get("architectures", []):
        if arch in HF_TASK_CLASSES:
            return HF_TASK_CLASSES[arch]
    for key in head:
        for predictor, task in TASK_PREDICTORS.items():
            if key.startswith(f"decode_head.{predictor}."):
                return task
    return "unknown-task"


def save(model: Sapiens2, path, format: str = "original"):
    """Write `model` as safetensors.

    format="original": the original key names (+ the bf16 rope periods buffer), what the Hub files use;
    format="hf":       HF-native names (embeddings.*, model.layer.N.*), what save_pretrained(...,
                       save_original_format=False) writes.
    A path ending in .safetensors gets one file (config in its metadata); any other path becomes a
    directory with config.json (HF schema, loadable by transformers) and model.safetensors.
    """
    if format not in ("original", "hf"):
        raise ValueError(f"format must be 'original' or 'hf', got {format!r}")
    config = model.config
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    if format == "hf":
        if config.use_tokenizer:
            raise ValueError("HF transformers has no 4K tokenizer: save a 4K model with format='original'")
        state = backbone_to_hf(state)
    else:
        state[ROPE_PERIODS_KEY] = rope_periods_bf16(config.head_dim, config.rope_base)
    metadata = {"format": "pt", "sapiens2_config": json.dumps(config.to_dict()), "sapiens2_format": format}
    path = Path(path)
    if path.suffix == ".safetensors":
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(state, str(path), metadata=metadata)
    else:
        path.mkdir(parents=True, exist_ok=True)
        save_file(state, str(path / "model.safetensors"), metadata=metadata)
        (path / "config.json").write_text(json.dumps(config_to_hf(config), indent=2))
    return path
