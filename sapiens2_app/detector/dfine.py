"""The D-FINE detection model in plain PyTorch: the decoder (multi-scale deformable attention, fine-grained
distribution refinement) and `DFine`, which runs sapiens2_app/detector/dfine_backbone.py's backbone and encoder, selects the
queries and decodes their boxes. Its config: sapiens2_app/detector/dfine_config.py. Loading and pre/post-processing:
sapiens2_app/detector/detector.py.

Architecture (D-FINE, Peng et al. 2024, Apache-2.0; module names follow the checkpoints on the hub):
  * Query selection: every encoder position is an anchor box; a linear head scores them and the top
    `num_queries` become the decoder's queries (their features) and reference boxes.
  * Decoder: per layer self-attention, multi-scale deformable cross-attention (bilinear samples around each
    reference box via `grid_sample`; no value or output projection), a gated residual, an MLP. Boxes are
    refined as distributions over `max_num_bins + 1` offsets per edge (FDR): each layer adds to the previous
    layer's logits, and the edges are the expectation under a non-uniform weighting function.
  * Head (last layer): class logits + a location-quality term (LQE) from the sharpness of the edge
    distributions; boxes as normalized (cx, cy, w, h).
The parity oracle is transformers 5.23 `DFineForObjectDetection` (tests/test_detect.py: 1e-4 in fp32).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from sapiens2_app.detector.dfine_backbone import ACTIVATIONS, FrozenBatchNorm2d, HGNetV2, HybridEncoder, SelfAttention
from sapiens2_app.detector.dfine_config import DFineConfig


# ----------------------------------------------------------------------------------------------------
# The MLP of the heads (query selection, decoder, LQE)
# ----------------------------------------------------------------------------------------------------
class MLP(nn.Module):
    """`num_layers` Linear layers with `act` between them (`layers.{i}` in the checkpoints)."""

    def __init__(self, dim_in: int, hidden: int, dim_out: int, num_layers: int, act: str = "relu"):
        super().__init__()
        dims = [dim_in] + [hidden] * (num_layers - 1) + [dim_out]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))
        self.act = ACTIVATIONS[act]()

    def forward(self, x):
        for layer in self.layers[:-1]:
            x = self.act(layer(x))
        return self.layers[-1](x)


# ----------------------------------------------------------------------------------------------------
# Decoder: deformable attention, fine-grained distribution refinement (FDR), location quality (LQE)
# ----------------------------------------------------------------------------------------------------
def multiscale_deformable_attention(value: torch.Tensor, shapes: list[tuple[int, int]], locations: torch.Tensor,
                                    weights_: torch.Tensor, points: list[int]) -> torch.Tensor:
    """Bilinear samples of `value` at `locations`, summed with `weights_`.

    value (B, S, h, d) with S = sum(H_l W_l), levels fine to coarse; locations (B, Q, h, P, 2) in [0, 1] (x, y)
    with P = sum(points), level l owning points[l] consecutive entries; weights_ (B, Q, h, P). -> (B, Q, h*d).

    NOTE: sampled in float32 whatever the model's dtype, the result cast back (transformers samples in the model's
    dtype). grid_sample computes the source coordinates and the bilinear weights in its input's dtype: in bf16 a
    coordinate past 32 px moves in 0.25 px steps (23% error on a 20x20 map); and PyTorch's CPU kernel reads wrong
    elements of bf16 maps whose offsets pass 2^15, as the per-head views of one image's memory do at the released
    widths (NaN). tests/test_detect.py measures both.
    """
    B, S, heads, d = value.shape
    Q = locations.shape[1]
    per_level = value.float().permute(0, 2, 3, 1).flatten(0, 1).split([h * w for h, w in shapes], -1)  # (B*h, d, HW)
    grids = (2 * locations.float() - 1).permute(0, 2, 1, 3, 4).flatten(0, 1)  # (B*h, Q, P, 2)
    grids = grids.split(points, dim=-2)  # per level (B*h, Q, P_l, 2)
    samples = [F.grid_sample(v.reshape(B * heads, d, h, w), g, mode="bilinear", padding_mode="zeros",
                             align_corners=False)  # (B*h, d, Q, P_l)
               for v, g, (h, w) in zip(per_level, grids, shapes)]
    weights_ = weights_.float().permute(0, 2, 1, 3).reshape(B * heads, 1, Q, -1)
    out = (torch.cat(samples, dim=-1) * weights_).sum(-1)  # (B*h, d, Q)
    return out.view(B, heads * d, Q).transpose(1, 2).to(value.dtype)


class DeformableAttention(nn.Module):
    """Each head samples `points[l]` locations per level around the reference box: offsets are scaled by the
    box size / points[l] (D-FINE's variant), weights softmaxed over all points of the head."""

    def __init__(self, cfg: DFineConfig):
        super().__init__()
        self.heads, self.points = cfg.decoder_attention_heads, cfg.points_per_level
        self.offset_scale = cfg.decoder_offset_scale
        total = self.heads * sum(self.points)
        self.sampling_offsets = nn.Linear(cfg.d_model, total * 2)
        self.attention_weights = nn.Linear(cfg.d_model, total)
        self.register_buffer("num_points_scale", torch.tensor([1 / n for n in self.points for _ in range(n)]))

    def forward(self, query, reference, memory, shapes):
        """query (B, Q, C), reference (B, Q, 4) normalized cxcywh, memory (B, S, C) -> (B, Q, C)."""
        B, Q, C = query.shape
        P = sum(self.points)
        value = memory.view(B, -1, self.heads, C // self.heads)  # (B, S, h, d)
        offsets = self.sampling_offsets(query).view(B, Q, self.heads, P, 2)
        attention = self.attention_weights(query).view(B, Q, self.heads, P).softmax(-1)
        ref = reference[:, :, None, None]  # (B, Q, 1, 1, 4)
        scale = self.num_points_scale.float()[:, None]  # (P, 1)
        locations = ref[..., :2] + offsets * scale * ref[..., 2:] * self.offset_scale  # (B, Q, h, P, 2), float32
        return multiscale_deformable_attention(value, shapes, locations, attention, self.points)


class Gate(nn.Module):
    """norm(g1 * residual + g2 * x) with sigmoid gates from both: replaces the cross-attention's plain residual."""

    def __init__(self, dim):
        super().__init__()
        self.gate = nn.Linear(2 * dim, 2 * dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, residual, x):
        g1, g2 = torch.sigmoid(self.gate(torch.cat([residual, x], dim=-1))).chunk(2, dim=-1)
        return self.norm(g1 * residual + g2 * x)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DFineConfig):
        super().__init__()
        dim = cfg.d_model
        self.self_attn = SelfAttention(dim, cfg.decoder_attention_heads)
        self.self_attn_layer_norm = nn.LayerNorm(dim, eps=cfg.layer_norm_eps)
        self.encoder_attn = DeformableAttention(cfg)
        self.gateway = Gate(dim)
        self.fc1, self.fc2 = nn.Linear(dim, cfg.decoder_ffn_dim), nn.Linear(cfg.decoder_ffn_dim, dim)
        self.act = ACTIVATIONS[cfg.decoder_activation_function]()
        self.final_layer_norm = nn.LayerNorm(dim, eps=cfg.layer_norm_eps)

    def forward(self, x, pos, reference, memory, shapes):
        x = self.self_attn_layer_norm(x + self.self_attn(x, pos))
        x = self.gateway(x, self.encoder_attn(x + pos, reference, memory, shapes))
        x = x + self.fc2(self.act(self.fc1(x)))
        return self.final_layer_norm(x.clamp(-65504, 65504))  # NOTE: the fp16 range, as the original


class LQE(nn.Module):
    """Location quality: an MLP on the top-k probabilities (and their mean) of each edge's distribution,
    added to the class logits. Sharp distributions = confident boxes."""

    def __init__(self, cfg: DFineConfig):
        super().__init__()
        self.k, self.bins = cfg.top_prob_values, cfg.max_num_bins
        self.reg_conf = MLP(4 * (self.k + 1), cfg.lqe_hidden_dim, 1, cfg.lqe_layers)

    def forward(self, logits, corners):
        B, Q, _ = corners.shape
        top = corners.view(B, Q, 4, self.bins + 1).softmax(-1).topk(self.k, dim=-1).values  # (B, Q, 4, k)
        stats = torch.cat([top, top.mean(-1, keepdim=True)], dim=-1).reshape(B, Q, -1)
        return logits + self.reg_conf(stats.to(logits.dtype))


def weighting_function(num_bins: int, up: torch.Tensor, reg_scale: torch.Tensor) -> torch.Tensor:
    """The `num_bins + 1` edge offsets W(n) the distributions are over, in units of box size / reg_scale:
    0 in the middle, growing geometrically outwards (fine near 0), +-2 |up| |reg_scale| at the ends."""
    bound = up.abs() * reg_scale.abs()  # (1,)
    step = (bound + 1) ** (2 / (num_bins - 2))
    powers = step ** torch.arange(1, num_bins // 2, device=up.device, dtype=up.dtype)  # step^1 .. step^(N/2-1)
    return torch.cat([-2 * bound, 1 - powers.flip(0), torch.zeros_like(bound), powers - 1, 2 * bound])


def distance_to_box(anchor: torch.Tensor, distance: torch.Tensor, reg_scale: torch.Tensor) -> torch.Tensor:
    """Edges at (0.5 reg_scale + distance) * size / reg_scale from the anchor's centre -> cxcywh."""
    reg_scale = reg_scale.abs()
    cx, cy, w, h = anchor.unbind(-1)
    left, top, right, bottom = (0.5 * reg_scale + distance).unbind(-1)
    x0, y0 = cx - left * (w / reg_scale), cy - top * (h / reg_scale)
    x1, y1 = cx + right * (w / reg_scale), cy + bottom * (h / reg_scale)
    return torch.stack([(x0 + x1) / 2, (y0 + y1) / 2, x1 - x0, y1 - y0], dim=-1)


def inverse_sigmoid(x, eps=1e-5):
    x = x.clamp(0, 1)
    return torch.log(x.clamp(min=eps) / (1 - x).clamp(min=eps))


class Decoder(nn.Module):
    def __init__(self, cfg: DFineConfig):
        super().__init__()
        dim, bins, n = cfg.d_model, cfg.max_num_bins, cfg.decoder_layers
        self.bins = bins
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(n))
        self.query_pos_head = MLP(4, 2 * dim, dim, 2)
        self.pre_bbox_head = MLP(dim, dim, 4, 3)
        self.bbox_embed = nn.ModuleList(MLP(dim, dim, 4 * (bins + 1), 3) for _ in range(n))
        self.class_embed = nn.ModuleList(nn.Linear(dim, cfg.num_labels) for _ in range(n))  # only the last is used
        self.lqe_layers = nn.ModuleList(LQE(cfg) for _ in range(n))
        self.reg_scale = nn.Parameter(torch.tensor([cfg.reg_scale]), requires_grad=False)
        self.up = nn.Parameter(torch.tensor([cfg.up]), requires_grad=False)

    def forward(self, queries, reference_logits, memory, shapes):
        """queries (B, Q, C), reference_logits (B, Q, 4) inverse-sigmoid cxcywh -> logits (B, Q, classes),
        boxes (B, Q, 4) normalized cxcywh."""
        # NOTE: the box arithmetic (references, distributions, edges) runs in float32 whatever the model's dtype:
        # bf16 keeps 8 bits of mantissa, 2.5 px at 640, and every layer would add its rounding to the boxes.
        # (What else runs in float32, and the bf16 drift beside transformers': docs/detector.md, In bf16.)
        reg_scale = self.reg_scale.float()
        project = weighting_function(self.bins, self.up.float(), reg_scale)  # (bins + 1,)
        reference = reference_logits.float().sigmoid()
        x, corners, previous = queries, 0, 0
        for i, layer in enumerate(self.layers):
            pos = self.query_pos_head(reference.to(x.dtype)).clamp(-10, 10)
            x = layer(x, pos, reference, memory, shapes)
            if i == 0:  # the box every layer's distributions refine: a coarse regression from layer 0
                anchor = (self.pre_bbox_head(x).float() + inverse_sigmoid(reference)).sigmoid()
            # each layer adds to the distribution logits of the one before (residual refinement)
            corners = self.bbox_embed[i](x + previous).float() + corners  # (B, Q, 4 * (bins + 1))
            B, Q, _ = corners.shape
            distance = corners.view(B, Q, 4, self.bins + 1).softmax(-1) @ project  # (B, Q, 4)
            reference = distance_to_box(anchor, distance, reg_scale)
            previous = x
        logits = self.lqe_layers[-1](self.class_embed[-1](x), corners)
        return logits, reference


# ----------------------------------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------------------------------
def anchors_for(shapes: list[tuple[int, int]], device, dtype, grid_size: float = 0.05):
    """One anchor box per position of every level, as logits of normalized cxcywh (size 0.05 * 2^level),
    and whether it lies well inside the image; outside anchors get the dtype's max (sigmoid -> 1)."""
    anchors = []
    for level, (h, w) in enumerate(shapes):
        y, x = torch.meshgrid(torch.arange(h, device=device).to(dtype), torch.arange(w, device=device).to(dtype),
                              indexing="ij")
        centres = torch.stack([(x + 0.5) / w, (y + 0.5) / h], dim=-1)  # (h, w, 2)
        sizes = torch.full_like(centres, grid_size * 2.0**level)
        anchors.append(torch.cat([centres, sizes], dim=-1).reshape(h * w, 4))
    anchors = torch.cat(anchors)[None]  # (1, S, 4)
    valid = ((anchors > 0.01) & (anchors < 0.99)).all(-1, keepdim=True)
    logits = torch.log(anchors / (1 - anchors))
    return torch.where(valid, logits, torch.full((), torch.finfo(dtype).max, dtype=dtype, device=device)), valid


@dataclass
class DetectionOutput:
    logits: torch.Tensor  # (B, Q, classes), before the sigmoid
    pred_boxes: torch.Tensor  # (B, Q, 4) normalized cxcywh


class DFine(nn.Module):
    def __init__(self, cfg: DFineConfig):
        super().__init__()
        self.config = cfg
        dim = cfg.d_model
        self.backbone = HGNetV2(cfg)
        self.encoder = HybridEncoder(cfg, self.backbone.out_channels)
        # decoder inputs: identity when the encoder width is the decoder's (all released models)
        self.decoder_input_proj = nn.ModuleList(
            nn.Identity() if c == dim else nn.Sequential(nn.Conv2d(c, dim, 1, bias=False),
                                                         FrozenBatchNorm2d(dim, cfg.batch_norm_eps))
            for c in [cfg.decoder_in_channels[-1]] * cfg.num_feature_levels)
        self.enc_output = nn.Sequential(nn.Linear(dim, dim), nn.LayerNorm(dim, eps=cfg.layer_norm_eps))
        self.enc_score_head = nn.Linear(dim, cfg.num_labels)
        self.enc_bbox_head = MLP(dim, dim, 4, 3)
        self.decoder = Decoder(cfg)

    def forward(self, pixel_values: torch.Tensor) -> DetectionOutput:
        """pixel_values (B, 3, H, W) RGB in [0, 1]."""
        maps = [proj(m) for proj, m in zip(self.decoder_input_proj, self.encoder(self.backbone(pixel_values)))]
        shapes = [tuple(m.shape[-2:]) for m in maps]
        memory = torch.cat([m.flatten(2).transpose(1, 2) for m in maps], dim=1)  # (B, S, C), levels fine to coarse
        # query selection: score every position, keep the best `num_queries` as queries + reference boxes
        anchors, valid = anchors_for(shapes, memory.device, torch.float32)  # float32: see Decoder.forward
        features = self.enc_output(valid.to(memory.dtype) * memory)
        scores = self.enc_score_head(features)
        box_logits = self.enc_bbox_head(features).float() + anchors
        top = scores.max(-1).values.topk(self.config.num_queries, dim=1).indices[..., None]  # (B, Q, 1)
        queries = features.gather(1, top.expand(-1, -1, features.shape[-1]))
        reference = box_logits.gather(1, top.expand(-1, -1, 4))
        logits, boxes = self.decoder(queries, reference, memory, shapes)
        return DetectionOutput(logits, boxes)
