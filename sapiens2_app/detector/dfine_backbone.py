"""D-FINE's feature extractor in plain PyTorch: the HGNetV2 backbone and the hybrid encoder, with the layers the
decoder shares (activations, frozen batch norm, self-attention). sapiens2_app/detector/dfine.py puts the decoder on top.

Architecture (D-FINE, Peng et al. 2024, Apache-2.0; module names follow the checkpoints on the hub):
  * HGNetV2 backbone: a stem (conv, a 2x2-conv branch beside a max-pool, conv), then stages of HG blocks
    (a chain of convs whose outputs are all concatenated and squeezed by two 1x1 convs). Frozen batch norms,
    optional learnable affine (scale, bias) after each activation.
  * Hybrid encoder: 1x1 projections of the last stages to one width, one transformer layer (AIFI, with a
    2-D sine position embedding) on the coarsest map, then a top-down FPN and a bottom-up PAN of
    RepNCSPELAN4 blocks (CSP + RepVGG convs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sapiens2_app.detector.dfine_config import DFineConfig


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
