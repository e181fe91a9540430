"""A person detector in plain PyTorch: D-FINE (HGNetV2 backbone, hybrid encoder, DETR decoder with
fine-grained distribution refinement), so top-down pose gets one box per person without mmdet or torchvision.

    detector = detect.load("ustc-community/dfine-small-coco")        # a hub id, a folder or a .safetensors file
    boxes = detector([image])                                          # per image (K, 5): x, y, w, h, score
    boxes = detect.load(source, dtype=torch.bfloat16, device="cuda", threshold=0.3)(images)

Any callable that takes a list of (3, H, W) uint8 images and returns, per image, a (K, 5) tensor
[x, y, w, h, score] (COCO xywh, image pixels) can stand in for it (see README, "Person detection").

Architecture (D-FINE, Peng et al. 2024, Apache-2.0; module names follow the checkpoints on the hub):
  * HGNetV2 backbone: a stem (conv, a 2x2-conv branch beside a max-pool, conv), then stages of HG blocks
    (a chain of convs whose outputs are all concatenated and squeezed by two 1x1 convs). Frozen batch norms,
    optional learnable affine (scale, bias) after each activation.
  * Hybrid encoder: 1x1 projections of the last stages to one width, one transformer layer (AIFI, with a
    2-D sine position embedding) on the coarsest map, then a top-down FPN and a bottom-up PAN of
    RepNCSPELAN4 blocks (CSP + RepVGG convs).
  * Query selection: every encoder position is an anchor box; a linear head scores them and the top
    `num_queries` become the decoder's queries (their features) and reference boxes.
  * Decoder: per layer self-attention, multi-scale deformable cross-attention (bilinear samples around each
    reference box via `grid_sample`; no value or output projection), a gated residual, an MLP. Boxes are
    refined as distributions over `max_num_bins + 1` offsets per edge (FDR): each layer adds to the previous
    layer's logits, and the edges are the expectation under a non-uniform weighting function.
  * Head (last layer): class logits + a location-quality term (LQE) from the sharpness of the edge
    distributions; boxes as normalized (cx, cy, w, h).
The parity oracle is transformers 5.23 `DFineForObjectDetection` (tests/test_detect.py: 1e-4 in fp32) and
its image processor's `post_process_object_detection`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import processing
import weights

DEFAULT_DETECTOR = "ustc-community/dfine-small-coco"
# Short names of the released COCO checkpoints (https://huggingface.co/ustc-community).
DETECTOR_IDS = {f"dfine-{s}": f"ustc-community/dfine-{s}-coco" for s in ("nano", "small", "medium", "large", "xlarge")}
# The D-FINE authors' inference tools (tools/inference/{torch,onnx,trt}_inf.py, `draw(..., thrh=0.4)`) keep
# boxes scoring above 0.4. COCO AP itself is computed on all 300 queries, without a threshold.
DEFAULT_THRESHOLD = 0.4
INPUT_SIZE = (640, 640)  # (H, W): `eval_spatial_size` of every released D-FINE config, the processor's `size`
RESCALE = 1 / 255  # the image processor's `rescale_factor`; no mean/std normalization (`do_normalize: false`)


# ----------------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------------
@dataclass
class DFineConfig:
    """The architecture, in transformers' `DFineConfig` field names (defaults = transformers' defaults)."""

    # HGNetV2 backbone (transformers' `backbone_config`)
    stem_channels: list = field(default_factory=lambda: [3, 32, 48])
    stem_strides: list = field(default_factory=lambda: [2, 1, 1, 2, 1])
    stage_in_channels: list = field(default_factory=lambda: [48, 128, 512, 1024])
    stage_mid_channels: list = field(default_factory=lambda: [48, 96, 192, 384])
    stage_out_channels: list = field(default_factory=lambda: [128, 512, 1024, 2048])
    stage_num_blocks: list = field(default_factory=lambda: [1, 1, 3, 1])
    stage_downsample: list = field(default_factory=lambda: [False, True, True, True])
    stage_downsample_strides: list = field(default_factory=lambda: [2, 2, 2, 2])
    stage_light_block: list = field(default_factory=lambda: [False, False, True, True])
    stage_kernel_size: list = field(default_factory=lambda: [3, 3, 5, 5])
    stage_numb_of_layers: list = field(default_factory=lambda: [6, 6, 6, 6])
    use_learnable_affine_block: bool = False
    hidden_act: str = "relu"
    out_indices: list = field(default_factory=lambda: [2, 3, 4])  # 0 = stem, i = stage i
    # hybrid encoder
    encoder_hidden_dim: int = 256
    encoder_layers: int = 1
    encoder_ffn_dim: int = 1024
    encoder_attention_heads: int = 8
    encode_proj_layers: list = field(default_factory=lambda: [2])
    positional_encoding_temperature: int = 10000
    encoder_activation_function: str = "gelu"
    activation_function: str = "silu"
    hidden_expansion: float = 1.0
    depth_mult: float = 1.0
    layer_norm_eps: float = 1e-5
    batch_norm_eps: float = 1e-5
    # decoder
    d_model: int = 256
    num_queries: int = 300
    decoder_in_channels: list = field(default_factory=lambda: [256, 256, 256])
    decoder_ffn_dim: int = 1024
    num_feature_levels: int = 3
    decoder_n_points: list | int = 4
    decoder_layers: int = 6
    decoder_attention_heads: int = 8
    decoder_activation_function: str = "relu"
    decoder_offset_scale: float = 0.5
    max_num_bins: int = 32
    reg_scale: float = 4.0
    up: float = 0.5
    top_prob_values: int = 4
    lqe_hidden_dim: int = 64
    lqe_layers: int = 2
    num_labels: int = 80
    id2label: dict = field(default_factory=dict)

    @property
    def points_per_level(self) -> list[int]:
        n = self.decoder_n_points
        return list(n) if isinstance(n, (list, tuple)) else [n] * self.num_feature_levels

    @classmethod
    def from_hf(cls, hf: dict, source: str = "config.json") -> "DFineConfig":
        """From a transformers config.json; features this port leaves out are refused by name."""
        if hf.get("model_type", "d_fine") != "d_fine":
            raise ValueError(f"{source}: model_type {hf.get('model_type')!r}, expected 'd_fine' (a D-FINE detector)")
        unsupported = {  # field: (value this port implements, why the others are left out)
            "eval_idx": ((-1, hf.get("decoder_layers", 6) - 1), "the released models predict from the last layer"),
            "decoder_method": (("default",), "'discrete' sampling is a deployment variant"),
            "learn_initial_query": ((False,), "the released models select their queries from the encoder"),
            "normalize_before": ((False,), "the released encoders are post-norm"),
        }
        for key, (allowed, why) in unsupported.items():
            if key in hf and hf[key] not in allowed:
                raise ValueError(f"{source}: {key}={hf[key]!r} is not supported ({why})")
        levels = hf.get("num_feature_levels", 3)
        if levels != len(hf.get("decoder_in_channels", [256] * 3)):
            raise ValueError(f"{source}: num_feature_levels={levels} differs from the number of encoder outputs; "
                             f"extra downsampled levels are not supported")
        # NOTE: `eval_size` and `anchor_image_size` are not read: the anchors and the AIFI position embedding are
        # computed for the input's feature maps, as the original does. (transformers drops the position embedding
        # at inference when `eval_size` is set; the released configs leave both null.)
        names = {f.name for f in fields(cls)}
        values = {k: v for k, v in {**hf.get("backbone_config", {}), **hf}.items() if k in names}
        if "id2label" in values:
            values["id2label"] = {int(k): v for k, v in values["id2label"].items()}
        values.setdefault("num_labels", len(values.get("id2label", {})) or 80)
        return cls(**values)


# ----------------------------------------------------------------------------------------------------
# Shared layers
# ----------------------------------------------------------------------------------------------------
ACTIVATIONS = {"relu": nn.ReLU, "silu": nn.SiLU, "gelu": nn.GELU, None: nn.Identity}


class FrozenBatchNorm2d(nn.Module):
    """Inference batch norm: a per-channel affine from stored statistics. No `num_batches_tracked` (a
    training counter; load() drops it), so the backbone's frozen norms and the encoder's ordinary ones load alike."""

    def __init__(self, channels: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        for name, init in (("weight", torch.ones), ("bias", torch.zeros), ("running_mean", torch.zeros),
                           ("running_var", torch.ones)):
            self.register_buffer(name, init(channels))

    def forward(self, x):
        return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps)


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


class SelfAttention(nn.Module):
    """Multi-head attention; the position embedding is added to queries and keys, not values."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x, pos=None):
        B, N, C = x.shape
        qk_in = x if pos is None else x + pos
        split = lambda t: t.view(B, N, self.heads, C // self.heads).transpose(1, 2)  # noqa: E731  (B, h, N, d)
        q, k, v = split(self.q_proj(qk_in)), split(self.k_proj(qk_in)), split(self.v_proj(x))
        out = F.scaled_dot_product_attention(q, k, v)  # (B, h, N, d)
        return self.out_proj(out.transpose(1, 2).reshape(B, N, C))


# ----------------------------------------------------------------------------------------------------
# HGNetV2 backbone
# ----------------------------------------------------------------------------------------------------
class LearnableAffine(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale, self.bias = nn.Parameter(torch.ones(1)), nn.Parameter(torch.zeros(1))

    def forward(self, x):
        return self.scale * x + self.bias


class HGConv(nn.Module):
    """conv (no bias, 'same' padding for odd kernels) -> frozen BN -> act -> learnable affine (if act and lab)."""

    def __init__(self, c_in, c_out, kernel, stride=1, groups=1, act="relu", lab=False):
        super().__init__()
        self.convolution = nn.Conv2d(c_in, c_out, kernel, stride, (kernel - 1) // 2, groups=groups, bias=False)
        self.normalization = FrozenBatchNorm2d(c_out)
        self.activation = ACTIVATIONS[act]()
        self.lab = LearnableAffine() if act and lab else nn.Identity()

    def forward(self, x):
        return self.lab(self.activation(self.normalization(self.convolution(x))))


class HGConvLight(nn.Module):
    """1x1 conv without activation, then a depthwise kxk conv."""

    def __init__(self, c_in, c_out, kernel, lab):
        super().__init__()
        self.conv1 = HGConv(c_in, c_out, 1, act=None, lab=lab)
        self.conv2 = HGConv(c_out, c_out, kernel, groups=c_out, lab=lab)

    def forward(self, x):
        return self.conv2(self.conv1(x))


class HGStem(nn.Module):
    def __init__(self, cfg: DFineConfig):
        super().__init__()
        c_in, c_mid, c_out = cfg.stem_channels
        s = cfg.stem_strides
        act, lab = cfg.hidden_act, cfg.use_learnable_affine_block
        self.stem1 = HGConv(c_in, c_mid, 3, s[0], act=act, lab=lab)
        self.stem2a = HGConv(c_mid, c_mid // 2, 2, s[1], act=act, lab=lab)
        self.stem2b = HGConv(c_mid // 2, c_mid, 2, s[2], act=act, lab=lab)
        self.stem3 = HGConv(2 * c_mid, c_mid, 3, s[3], act=act, lab=lab)
        self.stem4 = HGConv(c_mid, c_out, 1, s[4], act=act, lab=lab)
        self.pool = nn.MaxPool2d(kernel_size=2, stride=1, ceil_mode=True)

    def forward(self, x):
        x = F.pad(self.stem1(x), (0, 1, 0, 1))  # the 2x2 convs and the pool see the map padded right/bottom
        branch = self.stem2b(F.pad(self.stem2a(x), (0, 1, 0, 1)))
        x = torch.cat([self.pool(x), branch], dim=1)
        return self.stem4(self.stem3(x))


class HGBlock(nn.Module):
    """A chain of `num_layers` convs; the input and every output are concatenated, squeezed to out/2 then
    expanded to out channels (two 1x1 convs). Residual for all but a stage's first block."""

    def __init__(self, c_in, c_mid, c_out, num_layers, kernel, light, residual, lab):
        super().__init__()
        self.residual = residual
        self.layers = nn.ModuleList(
            HGConvLight(c_in if i == 0 else c_mid, c_mid, kernel, lab) if light
            else HGConv(c_in if i == 0 else c_mid, c_mid, kernel, lab=lab)
            for i in range(num_layers))
        total = c_in + num_layers * c_mid
        self.aggregation = nn.Sequential(HGConv(total, c_out // 2, 1, lab=lab), HGConv(c_out // 2, c_out, 1, lab=lab))

    def forward(self, x):
        outputs = [x]
        for layer in self.layers:
            outputs.append(layer(outputs[-1]))
        y = self.aggregation(torch.cat(outputs, dim=1))
        return y + x if self.residual else y


class HGStage(nn.Module):
    def __init__(self, cfg: DFineConfig, i: int):
        super().__init__()
        c_in, c_mid, c_out = cfg.stage_in_channels[i], cfg.stage_mid_channels[i], cfg.stage_out_channels[i]
        stride = cfg.stage_downsample_strides[i]
        self.downsample = (HGConv(c_in, c_in, 3, stride, groups=c_in, act=None)  # depthwise, no activation
                           if cfg.stage_downsample[i] else nn.Identity())
        self.blocks = nn.ModuleList(
            HGBlock(c_in if b == 0 else c_out, c_mid, c_out, cfg.stage_numb_of_layers[i], cfg.stage_kernel_size[i],
                    cfg.stage_light_block[i], residual=b > 0, lab=cfg.use_learnable_affine_block)
            for b in range(cfg.stage_num_blocks[i]))

    def forward(self, x):
        x = self.downsample(x)
        for block in self.blocks:
            x = block(x)
        return x


class HGNetV2(nn.Module):
    def __init__(self, cfg: DFineConfig):
        super().__init__()
        self.out_indices = cfg.out_indices
        widths = [cfg.stem_channels[-1], *cfg.stage_out_channels]  # of the stem's and each stage's output
        self.out_channels = [widths[i] for i in cfg.out_indices]
        self.stem = HGStem(cfg)
        self.stages = nn.ModuleList(HGStage(cfg, i) for i in range(len(cfg.stage_in_channels)))

    def forward(self, x) -> list[torch.Tensor]:
        maps = [self.stem(x)]
        for stage in self.stages:
            maps.append(stage(maps[-1]))
        return [maps[i] for i in self.out_indices]  # strides 8, 16, 32 for out_indices [2, 3, 4]


# ----------------------------------------------------------------------------------------------------
# Hybrid encoder: AIFI on the coarsest map, then FPN (top-down) and PAN (bottom-up)
# ----------------------------------------------------------------------------------------------------
class ConvNorm(nn.Module):
    def __init__(self, cfg: DFineConfig, c_in, c_out, kernel, stride=1, groups=1, act=None, padding=None):
        super().__init__()
        padding = (kernel - 1) // 2 if padding is None else padding
        self.conv = nn.Conv2d(c_in, c_out, kernel, stride, padding, groups=groups, bias=False)
        self.norm = FrozenBatchNorm2d(c_out, cfg.batch_norm_eps)
        self.activation = ACTIVATIONS[act]()

    def forward(self, x):
        return self.activation(self.norm(self.conv(x)))


class RepVGG(nn.Module):
    """act(3x3 conv-BN + 1x1 conv-BN): the two branches that RepVGG folds into one conv for deployment."""

    def __init__(self, cfg, channels):
        super().__init__()
        self.conv1 = ConvNorm(cfg, channels, channels, 3, padding=1)
        self.conv2 = ConvNorm(cfg, channels, channels, 1, padding=0)
        self.activation = ACTIVATIONS[cfg.activation_function]()

    def forward(self, x):
        return self.activation(self.conv1(x) + self.conv2(x))


class CSPRep(nn.Module):
    """Cross-stage partial: RepVGG blocks on one 1x1 branch, added to a second 1x1 branch."""

    def __init__(self, cfg, c_in, c_out, num_blocks):
        super().__init__()
        act = cfg.activation_function
        self.conv1 = ConvNorm(cfg, c_in, c_out, 1, act=act)
        self.conv2 = ConvNorm(cfg, c_in, c_out, 1, act=act)
        self.bottlenecks = nn.Sequential(*(RepVGG(cfg, c_out) for _ in range(num_blocks)))

    def forward(self, x):
        return self.bottlenecks(self.conv1(x)) + self.conv2(x)


class RepNCSPELAN4(nn.Module):
    """GELAN block: split a 1x1 conv's output in two halves, grow a chain (CSP, 3x3 conv) x 2 from the second,
    concatenate all four and fuse with a 1x1 conv back to the encoder width."""

    def __init__(self, cfg: DFineConfig, num_blocks: int, act: str = "silu"):
        super().__init__()
        hidden = cfg.encoder_hidden_dim
        branch = round(cfg.hidden_expansion * hidden // 2)
        self.conv1 = ConvNorm(cfg, 2 * hidden, 2 * hidden, 1, act=act)
        self.csp_rep1 = CSPRep(cfg, hidden, branch, num_blocks)
        self.conv2 = ConvNorm(cfg, branch, branch, 3, act=act)
        self.csp_rep2 = CSPRep(cfg, branch, branch, num_blocks)
        self.conv3 = ConvNorm(cfg, branch, branch, 3, act=act)
        self.conv4 = ConvNorm(cfg, 2 * hidden + 2 * branch, hidden, 1, act=act)

    def forward(self, x):
        a, b = self.conv1(x).chunk(2, dim=1)
        b1 = self.conv2(self.csp_rep1(b))
        b2 = self.conv3(self.csp_rep2(b1))
        return self.conv4(torch.cat([a, b, b1, b2], dim=1))


class SCDown(nn.Module):
    """Downsampling: a 1x1 conv, then a strided depthwise conv."""

    def __init__(self, cfg: DFineConfig, kernel=3, stride=2):
        super().__init__()
        c = cfg.encoder_hidden_dim
        self.conv1 = ConvNorm(cfg, c, c, 1)
        self.conv2 = ConvNorm(cfg, c, c, kernel, stride, groups=c)

    def forward(self, x):
        return self.conv2(self.conv1(x))


def sine_position_embedding(height: int, width: int, dim: int, temperature: float, device, dtype) -> torch.Tensor:
    """(H*W, dim) 2-D sine embedding, row-major positions, channels [sin(y f), cos(y f), sin(x f), cos(x f)],
    f = temperature^(-k / (dim/4)). Computed in float64 as transformers does, then cast."""
    omega = 1.0 / temperature ** (torch.arange(dim // 4, dtype=torch.float64, device=device) / (dim // 4))
    y, x = torch.meshgrid(torch.arange(height, dtype=torch.float64, device=device),
                          torch.arange(width, dtype=torch.float64, device=device), indexing="ij")
    y, x = y.flatten()[:, None] * omega, x.flatten()[:, None] * omega  # (H*W, dim/4)
    return torch.cat([y.sin(), y.cos(), x.sin(), x.cos()], dim=1).to(dtype)


class EncoderLayer(nn.Module):
    """Post-norm transformer layer."""

    def __init__(self, cfg: DFineConfig):
        super().__init__()
        dim = cfg.encoder_hidden_dim
        self.self_attn = SelfAttention(dim, cfg.encoder_attention_heads)
        self.self_attn_layer_norm = nn.LayerNorm(dim, eps=cfg.layer_norm_eps)
        self.fc1, self.fc2 = nn.Linear(dim, cfg.encoder_ffn_dim), nn.Linear(cfg.encoder_ffn_dim, dim)
        self.act = ACTIVATIONS[cfg.encoder_activation_function]()
        self.final_layer_norm = nn.LayerNorm(dim, eps=cfg.layer_norm_eps)

    def forward(self, x, pos):
        x = self.self_attn_layer_norm(x + self.self_attn(x, pos))
        return self.final_layer_norm(x + self.fc2(self.act(self.fc1(x))))


class AIFI(nn.Module):
    """Attention-based intra-scale feature interaction: transformer layers over one feature map's pixels."""

    def __init__(self, cfg: DFineConfig):
        super().__init__()
        self.temperature = cfg.positional_encoding_temperature
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.encoder_layers))

    def forward(self, x):
        B, C, H, W = x.shape
        pos = sine_position_embedding(H, W, C, self.temperature, x.device, x.dtype)[None]  # (1, H*W, C)
        x = x.flatten(2).transpose(1, 2)  # (B, H*W, C)
        for layer in self.layers:
            x = layer(x, pos)
        return x.transpose(1, 2).reshape(B, C, H, W)


class HybridEncoder(nn.Module):
    def __init__(self, cfg: DFineConfig, in_channels: list[int]):
        super().__init__()
        hidden, levels = cfg.encoder_hidden_dim, len(in_channels)
        self.input_proj = nn.ModuleList(
            nn.Sequential(nn.Conv2d(c, hidden, 1, bias=False), FrozenBatchNorm2d(hidden)) for c in in_channels)
        self.encode_proj_layers = cfg.encode_proj_layers
        self.aifi = nn.ModuleList(AIFI(cfg) for _ in cfg.encode_proj_layers)
        blocks = round(3 * cfg.depth_mult)
        self.lateral_convs = nn.ModuleList(ConvNorm(cfg, hidden, hidden, 1) for _ in range(levels - 1))
        self.fpn_blocks = nn.ModuleList(RepNCSPELAN4(cfg, blocks) for _ in range(levels - 1))
        self.downsample_convs = nn.ModuleList(SCDown(cfg) for _ in range(levels - 1))
        self.pan_blocks = nn.ModuleList(RepNCSPELAN4(cfg, blocks) for _ in range(levels - 1))

    def forward(self, features: list[torch.Tensor]) -> list[torch.Tensor]:
        maps = [proj(f) for proj, f in zip(self.input_proj, features)]  # fine to coarse, all `hidden` wide
        for level, aifi in zip(self.encode_proj_layers, self.aifi):
            maps[level] = aifi(maps[level])
        # top-down: each coarser map goes through its lateral conv, is upsampled 2x and fused with the finer one
        top_down = [maps[-1]]
        for i, (lateral, block) in enumerate(zip(self.lateral_convs, self.fpn_blocks)):
            top_down[-1] = lateral(top_down[-1])
            up = F.interpolate(top_down[-1], scale_factor=2.0, mode="nearest")
            top_down.append(block(torch.cat([up, maps[-2 - i]], dim=1)))
        top_down.reverse()  # fine to coarse
        # bottom-up: each finer output is downsampled and fused with the next coarser top-down map
        outputs = [top_down[0]]
        for i, (down, block) in enumerate(zip(self.downsample_convs, self.pan_blocks)):
            outputs.append(block(torch.cat([down(outputs[-1]), top_down[i + 1]], dim=1)))
        return outputs


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
    elif weights.HUB_ID.match(name) and not name.endswith(".safetensors"):
        folder = weights.download(name)
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
    return name in DETECTOR_IDS or (bool(weights.HUB_ID.match(name)) and not Path(name).exists()
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
        raise ValueError(f"unknown D-FINE config fields {unknown}; see detect.DFineConfig")
    cfg = DFineConfig(**{**values, **overrides})
    label = person_label if person_label is not None else person_label_of(cfg, name)
    with torch.device("meta"):
        model = DFine(cfg)
    weights.load_strict(model, state, f"{name} (D-FINE; keys as detect.py names them, see KEY_RENAMES)")
    size = preprocessor.get("size", {})
    input_size = (size["height"], size["width"]) if "height" in size and "width" in size else INPUT_SIZE
    if any(s % 32 for s in input_size):
        raise ValueError(f"{name}: input size {input_size} from preprocessor_config.json must be a multiple of 32 "
                         f"(the FPN fuses maps at strides 8, 16 and 32)")
    model = model.to(device=device, dtype=weights.parse_dtype(dtype)).eval()
    return PersonDetector(model, name, input_size, threshold, label)
