"""The person detector for top-down pose: D-FINE (sapiens2_app/detector/dfine.py) with its pre- and post-processing and
its loading from transformers' checkpoint format, so pose gets one box per person without mmdet or torchvision.

    from sapiens2_app.detector import detector
    find_people = detector.load("ustc-community/dfine-small-coco")    # a hub id, a folder or a .safetensors file
    boxes = find_people([image])                                       # per image (K, 5): x, y, w, h, score
    boxes = detector.load(source, dtype=torch.bfloat16, device="cuda", threshold=0.3)(images)

Any callable that takes a list of (3, H, W) uint8 images and returns, per image, a (K, 5) tensor
[x, y, w, h, score] (COCO xywh, image pixels) can stand in for it (docs/detector.md, another detector).
Pre- and post-processing follow transformers 5.23's RTDetrImageProcessor and its
`post_process_object_detection` (the parity oracles of tests/test_detect.py).
"""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

import torch

from sapiens2 import hub, processing, weights
from sapiens2_app.detector.dfine import DFine
from sapiens2_app.detector.dfine_config import DFineConfig

DEFAULT_DETECTOR = "ustc-community/dfine-small-coco"
# Short names of the released COCO checkpoints (https://huggingface.co/ustc-community).
DETECTOR_IDS = {f"dfine-{s}": f"ustc-community/dfine-{s}-coco" for s in ("nano", "small", "medium", "large", "xlarge")}
# The D-FINE authors' inference tools (tools/inference/{torch,onnx,trt}_inf.py, `draw(..., thrh=0.4)`) keep
# boxes scoring above 0.4. COCO AP itself is computed on all 300 queries, without a threshold.
DEFAULT_THRESHOLD = 0.4
INPUT_SIZE = (640, 640)  # (H, W): `eval_spatial_size` of every released D-FINE config, the processor's `size`
RESCALE = 1 / 255  # the image processor's `rescale_factor`; no mean/std normalization (`do_normalize: false`)


# ----------------------------------------------------------------------------------------------------
# Pre- and post-processing, the detector
# ----------------------------------------------------------------------------------------------------
def preprocess(images: list[torch.Tensor], size: tuple[int, int] = INPUT_SIZE) -> torch.Tensor:
    """uint8 (3, H, W) images -> (B, 3, h, w) float32 in [0, 1]: transformers' RTDetrImageProcessor (antialiased
    bilinear resize of the uint8 image to `size`, ignoring the aspect ratio, then `* rescale_factor`)."""
    return torch.stack([processing.resize(image, size, "bilinear_antialias").float() * RESCALE for image in images])


def postprocess(logits: torch.Tensor, boxes: torch.Tensor, image_sizes: list[tuple[int, int]], threshold: float,
                label: int) -> list[torch.Tensor]:
    """Per image a (K, 5) float32 tensor [x, y, w, h, score] of class `label`, best first.

    As transformers' `post_process_object_detection` (focal-loss branch): sigmoid scores, the top `Q` (query,
    class) pairs of the Q x classes grid, cxcywh -> corners scaled to the image, score > threshold; then the class.
    """
    logits, boxes = logits.float(), boxes.float()
    B, Q, classes = logits.shape
    cx, cy, w, h = boxes.unbind(-1)
    corners = torch.stack([cx - 0.5 * w, cy - 0.5 * h, cx + 0.5 * w, cy + 0.5 * h], dim=-1)  # (B, Q, 4)
    sizes = torch.tensor([[W, H, W, H] for H, W in image_sizes], dtype=torch.float32, device=boxes.device)
    corners = corners * sizes[:, None]
    scores, index = logits.sigmoid().flatten(1).topk(Q, dim=-1)  # (B, Q)
    labels, query = index % classes, index // classes
    corners = corners.gather(1, query[..., None].expand(-1, -1, 4))
    results = []
    for score, lab, box in zip(scores, labels, corners):
        keep = (score > threshold) & (lab == label)
        x0, y0, x1, y1 = box[keep].unbind(-1)
        results.append(torch.stack([x0, y0, x1 - x0, y1 - y0, score[keep]], dim=-1))
    return results


class PersonDetector:
    """`detector(images)` -> per image (K, 5) [x, y, w, h, score], COCO xywh in image pixels, best first."""

    def __init__(self, model: DFine, source: str, input_size=INPUT_SIZE, threshold: float = DEFAULT_THRESHOLD,
                 person_label: int = 0):
        self.model, self.source = model, source
        self.input_size, self.threshold, self.person_label = tuple(input_size), threshold, person_label

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @torch.no_grad()
    def __call__(self, images) -> list[torch.Tensor]:
        images = [image.to(self.device) for image in processing.load_images(images)]
        pixels = preprocess(images, self.input_size).to(self.dtype)
        out = self.model(pixels)
        sizes = [tuple(image.shape[-2:]) for image in images]
        return postprocess(out.logits, out.pred_boxes, sizes, self.threshold, self.person_label)


# ----------------------------------------------------------------------------------------------------
# Loading (transformers' checkpoint format: what save_pretrained writes and the hub holds)
# ----------------------------------------------------------------------------------------------------
# File key -> our key, applied in order (first match per rule, all rules). Both of transformers' layouts load:
# the on-disk names (`out_proj`, `fc1`, `encoder.encoder.N`) and its in-memory ones (`o_proj`, `mlp.layers.0`, `aifi`).
KEY_RENAMES = [
    (r"^model\.backbone\.model\.embedder\.", "backbone.stem."),
    (r"^model\.backbone\.model\.encoder\.stages\.", "backbone.stages."),
    (r"^model\.encoder_input_proj\.", "encoder.input_proj."),
    (r"^model\.encoder\.(encoder|aifi)\.", "encoder.aifi."),
    (r"^model\.", ""),
    (r"\.o_proj\.", ".out_proj."),
    (r"\.mlp\.layers\.0\.", ".fc1."),
    (r"\.mlp\.layers\.1\.", ".fc2."),
]
# Training-only tensors: batch-norm step counters and the denoising queries' class embedding.
DROPPED_KEYS = re.compile(r"(\.num_batches_tracked$|^model\.denoising_class_embed\.)")


def rename_checkpoint(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    state = {k: v for k, v in state.items() if not DROPPED_KEYS.search(k)}
    # `class_embed.*` / `bbox_embed.*` at the top are transformers' tied copies of the decoder's heads
    for key in [k for k in state if k.startswith(("class_embed.", "bbox_embed."))]:
        state.setdefault("model.decoder." + key, state[key])
        del state[key]
    out = {}
    for key, tensor in state.items():
        for pattern, replacement in KEY_RENAMES:
            key = re.sub(pattern, replacement, key)
        out[key] = tensor
    return out


def person_label_of(cfg: DFineConfig, source: str) -> int:
    for index, name in cfg.id2label.items():
        if str(name).lower() == "person":
            return index
    raise ValueError(f"{source}: no 'person' class in config.json's id2label; pass person_label=INDEX")


def read_source(source) -> tuple[dict, dict, dict, str]:
    """(tensors, config.json, preprocessor_config.json ({} when absent), description) of a folder, a file, a hub id."""
    name = DETECTOR_IDS.get(str(source), str(source))
    path = Path(name)
    if path.is_file():
        tensors, _ = weights.read_safetensors(path)
        folder = path.parent
    elif path.is_dir():
        tensors, _, _ = weights.read_checkpoint_dir(path)
        folder = path
    elif hub.HUB_ID.match(name) and not name.endswith(".safetensors"):
        folder = hub.download(name)
        tensors, _, _ = weights.read_checkpoint_dir(folder)
        path = folder
    else:
        raise FileNotFoundError(f"{source}: no such file or folder, and not a hub id like {DEFAULT_DETECTOR} "
                                f"(short names: {', '.join(DETECTOR_IDS)})")
    def beside(file: str) -> dict:  # a broken one is named (weights.read_json), a missing one is {}
        return weights.read_json(folder / file) if (folder / file).exists() else {}
    return tensors, beside("config.json"), beside("preprocessor_config.json"), name


def config_from_weights(state: dict[str, torch.Tensor], source: str) -> dict:
    """DFineConfig fields read off the tensor shapes (our key names), for a file without config.json.

    Not in the shapes, so the released models' values are assumed: num_queries 300, 8 encoder heads, AIFI on the
    coarsest level, and for 80 classes the COCO order (person = 0). Pass others to load() as overrides.
    """
    def count(prefix: str) -> int:
        return len({m[1] for k in state if (m := re.match(re.escape(prefix) + r"(\d+)\.", k))})

    def shape(key: str) -> torch.Size:
        return state[key].shape

    try:
        stem = shape("backbone.stem.stem1.convolution.weight")
        cfg = dict(stem_channels=[stem[1], stem[0], shape("backbone.stem.stem4.convolution.weight")[0]],
                   use_learnable_affine_block="backbone.stem.stem1.lab.scale" in state)
        stages = []
        for i in range(count("backbone.stages.")):
            block = f"backbone.stages.{i}.blocks.0."
            light = f"{block}layers.0.conv1.convolution.weight" in state
            first = shape(f"{block}layers.0.{'conv1.' if light else ''}convolution.weight")  # (mid, in, k, k)
            kernel = shape(f"{block}layers.0.{'conv2.' if light else ''}convolution.weight")[-1]
            stages.append(dict(stage_in_channels=first[1], stage_mid_channels=first[0],
                               stage_out_channels=shape(f"{block}aggregation.1.convolution.weight")[0],
                               stage_num_blocks=count(f"backbone.stages.{i}.blocks."),
                               stage_numb_of_layers=count(f"{block}layers."), stage_light_block=light,
                               stage_kernel_size=kernel,
                               stage_downsample=f"backbone.stages.{i}.downsample.convolution.weight" in state))
        cfg.update({key: [stage[key] for stage in stages] for key in stages[0]})
        levels, aifi = count("encoder.input_proj."), count("encoder.aifi.")
        hidden = shape("encoder.input_proj.0.0.weight")[0]
        points_scale, points = state["decoder.layers.0.encoder_attn.num_points_scale"].tolist(), []
        while len(points) < levels:  # 1/n repeated n times per level
            points.append(round(1 / points_scale[sum(points)]))
        d_model = shape("decoder.query_pos_head.layers.1.weight")[0]
        lqe = "decoder.lqe_layers.0.reg_conf.layers."
        cfg.update(
            out_indices=list(range(len(stages) + 1 - levels, len(stages) + 1)), encoder_hidden_dim=hidden,
            encoder_layers=count("encoder.aifi.0.layers.") if aifi else 0,
            encode_proj_layers=list(range(levels - aifi, levels)),
            encoder_ffn_dim=shape("encoder.aifi.0.layers.0.fc1.weight")[0] if aifi else 1024,
            depth_mult=count("encoder.fpn_blocks.0.csp_rep1.bottlenecks.") / 3,
            # RepNCSPELAN4's branch width is round(hidden_expansion * hidden // 2): +1 keeps the floor exact
            hidden_expansion=(2 * shape("encoder.fpn_blocks.0.csp_rep1.conv1.conv.weight")[0] + 1) / hidden,
            d_model=d_model, num_feature_levels=levels, decoder_n_points=points,
            decoder_in_channels=[shape("decoder_input_proj.0.0.weight")[1] if "decoder_input_proj.0.0.weight" in state
                                 else d_model] * levels,
            decoder_layers=count("decoder.layers."), decoder_ffn_dim=shape("decoder.layers.0.fc1.weight")[0],
            decoder_attention_heads=shape("decoder.layers.0.encoder_attn.attention_weights.weight")[0] // sum(points),
            max_num_bins=shape("decoder.bbox_embed.0.layers.2.weight")[0] // 4 - 1,
            reg_scale=state["decoder.reg_scale"].item(), up=state["decoder.up"].item(),
            top_prob_values=shape(f"{lqe}0.weight")[1] // 4 - 1, lqe_hidden_dim=shape(f"{lqe}0.weight")[0],
            lqe_layers=count(lqe), num_labels=shape("enc_score_head.weight")[0])
    except (KeyError, IndexError) as error:
        raise ValueError(f"{source}: no config.json beside the weights, and they are not a D-FINE checkpoint in "
                         f"transformers' format (no {error}); put its config.json next to the file") from None
    cfg["id2label"] = {0: "person"} if cfg["num_labels"] == 80 else {}  # COCO order, as the released models
    return cfg


def is_hub_id(source) -> bool:
    """A hub id or short name that is not a local path: what may fail to download (a missing file is a typo)."""
    name = str(source)
    return name in DETECTOR_IDS or (bool(hub.HUB_ID.match(name)) and not Path(name).exists()
                                    and not name.endswith(".safetensors"))


def load(source=DEFAULT_DETECTOR, dtype=torch.float32, device="cpu", threshold: float = DEFAULT_THRESHOLD,
         person_label: int | None = None, **overrides) -> PersonDetector:
    """A PersonDetector from a hub id (downloaded once into the sapiens2 cache, like weights.load), a folder
    with config.json + model.safetensors (transformers' format) or such a .safetensors file (its architecture from
    a config.json beside it, else from the tensor shapes: see config_from_weights). `overrides`: DFineConfig fields.
    Loading is strict: missing, unexpected or mis-shaped tensors are listed (weights.CheckpointMismatch)."""
    tensors, hf_config, preprocessor, name = read_source(source)
    state = rename_checkpoint(tensors)
    values = vars(DFineConfig.from_hf(hf_config, f"{name} config.json")) if hf_config else config_from_weights(
        state, name)
    unknown = sorted(set(overrides) - {f.name for f in fields(DFineConfig)})
    if unknown:
        raise ValueError(f"unknown D-FINE config fields {unknown}; see sapiens2_app.detector.dfine_config.DFineConfig")
    cfg = DFineConfig(**{**values, **overrides})
    label = person_label if person_label is not None else person_label_of(cfg, name)
    with torch.device("meta"):
        model = DFine(cfg)
    weights.load_strict(model, state, f"{name} (D-FINE; keys as sapiens2_app/detector/detector.py names them, see KEY_RENAMES)")
    # NaN or Inf weights find nobody in any image, silently (a whole-image box for every photo): refused by name,
    # with the check weights.load applies to --model's checkpoints
    weights.refuse_non_finite(model, name)
    size = preprocessor.get("size", {})
    input_size = (size["height"], size["width"]) if "height" in size and "width" in size else INPUT_SIZE
    if any(s % 32 for s in input_size):
        raise ValueError(f"{name}: input size {input_size} from preprocessor_config.json must be a multiple of 32 "
                         f"(the FPN fuses maps at strides 8, 16 and 32)")
    model = model.to(device=device, dtype=weights.parse_dtype(dtype)).eval()
    return PersonDetector(model, name, input_size, threshold, label)
