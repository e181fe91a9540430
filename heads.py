"""Task heads and task models: pose, body-part segmentation, normals, pointmap (+ scale), albedo, matting.

Every head takes the backbone's final feature map (B, C, H/16, W/16) and is one of two shapes:

  transposed-conv head (pose, seg)
      [ConvTranspose2d k4 s2 p1 (no bias) -> InstanceNorm2d -> SiLU] x n     each doubles H and W
      [Conv2d k1 -> InstanceNorm2d -> SiLU] x m
      Conv2d 1x1 predictor
  pixel-shuffle head (normal, pointmap, albedo, matting)
      Conv2d 3x3 -> norm -> SiLU                                              the input conv
      [Conv2d 3x3 (4c out) -> PixelShuffle(2) -> norm -> SiLU] x n            each doubles H and W
      [Conv2d 3x3 -> norm -> SiLU] x m
      Conv2d 1x1 predictor
  (norm = InstanceNorm2d without parameters; albedo uses a channel RMSNorm with a weight instead)

The pointmap head adds a scale branch on the backbone features: stride-2 1x1 convs, flatten, an MLP to
one scale per image (= canonical focal 768 / the image's focal, in network-input pixels).

Module names follow the original checkpoints (`deconv_layers.{3j}`, `upsample_blocks.{j}.0`, ...); the
1x1 predictor is `predictor` here (`conv_pose`, `conv_seg`, ... in the original files; weights.py maps).
The losses are plain functions in losses.py (the original training code's, docs/losses.md); the task models
call them when labels are passed.
"""

from __future__ import annotations

if __name__ == "heads":  # a bare `import heads` in a checkout gives the one module, sapiens2.heads
    __import__("sapiens2").one_module(__name__)

import functools
from dataclasses import asdict, dataclass, fields, replace

import torch
import torch.nn.functional as F
from torch import nn

from sapiens2 import ACTIVATIONS, PRESETS, Sapiens2, Sapiens2Config
from sapiens2.losses import albedo_loss, keypoint_mse_loss, matting_loss, normal_loss, pointmap_loss, seg_loss
from sapiens2.processing import flip_heatmaps_back, flip_pairs

TASKS = ("seg", "pose", "normal", "pointmap", "matting", "albedo")  # seg first: predict.py's pose boxes and masks use it
TRANSPOSED_CONV_TASKS = ("pose", "seg")
CANONICAL_FOCAL = 768.0  # pointmaps are predicted for a camera with this focal length (network pixels)


# ----------------------------------------------------------------------------------------------------
# Head config and presets
# ----------------------------------------------------------------------------------------------------


@dataclass
class HeadConfig:
    task: str
    upsample_channels: tuple[int, ...]
    conv_channels: tuple[int, ...]
    out_channels: int
    # Kernel sizes per layer; None = the released heads' (4 for transposed convs, 3 for pixel-shuffle
    # convs; 1 for refinement convs of transposed-conv heads, 3 for pixel-shuffle heads).
    upsample_kernel_sizes: tuple[int, ...] | None = None
    conv_kernel_sizes: tuple[int, ...] | None = None
    # Pointmap scale branch: stride-2 conv widths (and kernel sizes, None = 1x1 as released), the MLP's
    # hidden widths (output: 1 per image) and its input width (None = what the backbone config's
    # image_size gives; a loaded checkpoint sets it from the weight, like transformers' scale_final_input_size).
    scale_conv_channels: tuple[int, ...] = ()
    scale_hidden: tuple[int, ...] = ()
    scale_conv_kernel_sizes: tuple[int, ...] | None = None
    scale_input_width: int | None = None
    # Output names (transformers' id2label: class or keypoint names), when the checkpoint has them.
    labels: tuple[str, ...] | None = None
    # Pose: left/right keypoint pairs for the flip test (None = the 308-keypoint set's, from metadata).
    flip_pairs: tuple[tuple[int, int], ...] | None = None

    def __post_init__(self):
        if self.task not in TASKS:
            raise ValueError(f"unknown task {self.task!r}; choose one of {', '.join(TASKS)}")
        self.upsample_channels = tuple(self.upsample_channels)
        self.conv_channels = tuple(self.conv_channels)
        self.scale_conv_channels = tuple(self.scale_conv_channels)
        self.scale_hidden = tuple(self.scale_hidden)
        transposed = self.task in TRANSPOSED_CONV_TASKS
        if self.upsample_kernel_sizes is None:
            self.upsample_kernel_sizes = (4 if transposed else 3,) * len(self.upsample_channels)
        if self.conv_kernel_sizes is None:
            self.conv_kernel_sizes = (1 if transposed else 3,) * len(self.conv_channels)
        self.upsample_kernel_sizes = tuple(self.upsample_kernel_sizes)
        self.conv_kernel_sizes = tuple(self.conv_kernel_sizes)
        if len(self.upsample_kernel_sizes) != len(self.upsample_channels):
            raise ValueError("upsample_kernel_sizes needs one entry per upsample layer")
        if len(self.conv_kernel_sizes) != len(self.conv_channels):
            raise ValueError("conv_kernel_sizes needs one entry per conv layer")
        if bool(self.scale_conv_channels) != (self.task == "pointmap"):
            raise ValueError("the scale branch (scale_conv_channels) belongs to pointmap heads only")
        self.scale_conv_kernel_sizes = tuple(self.scale_conv_kernel_sizes or (1,) * len(self.scale_conv_channels))
        if len(self.scale_conv_kernel_sizes) != len(self.scale_conv_channels):
            raise ValueError("scale_conv_kernel_sizes needs one entry per scale conv layer")
        if self.task == "matting" and self.out_channels != 4:
            raise ValueError(f"a matting head predicts 3 foreground channels + alpha (4), not {self.out_channels}")
        if self.labels is not None:
            self.labels = tuple(self.labels)
            if len(self.labels) != self.out_channels:
                raise ValueError(f"{len(self.labels)} label names for {self.out_channels} output channels")
        if self.flip_pairs is not None:
            self.flip_pairs = tuple(tuple(int(i) for i in pair) for pair in self.flip_pairs)

    @property
    def transposed(self) -> bool:
        return self.task in TRANSPOSED_CONV_TASKS

    def to_dict(self) -> dict:
        as_list = lambda v: [as_list(x) for x in v] if isinstance(v, (tuple, list)) else v  # noqa: E731
        return {k: as_list(v) for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, d: dict) -> "HeadConfig":
        unknown = sorted(set(d) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"unknown HeadConfig fields: {unknown}")
        return cls(**d)


OUT_CHANNELS = {"pose": 308, "seg": 29, "normal": 3, "pointmap": 3, "albedo": 3, "matting": 4}

# Per size: (upsample channels, conv channels) of each released head (docs/checkpoints.md, task checkpoints).
_STANDARD = ((768, 512, 256, 128), (64, 32, 16))
HEAD_TABLE = {
    "pose": {"0.4b": ((1024, 768), (512, 512, 256)), "0.8b": ((1024, 768), (512, 512, 256)),
             "1b": ((1536, 1024), (768, 512, 256)), "5b": ((1024, 768), (512, 512, 256))},
    "seg": {s: ((512, 256, 128, 64), (64, 64)) for s in ("0.4b", "0.8b", "1b", "5b")},
    "normal": {"0.4b": _STANDARD, "0.8b": _STANDARD, "1b": _STANDARD,
               "5b": ((1536, 768, 512, 256), (128, 64, 32))},
    "pointmap": {"0.4b": ((1536, 768, 512, 256), (64, 32, 16)), "0.8b": ((1536, 768, 512, 256), (64, 32, 16)),
                 "1b": ((1536, 768, 512, 256), (64, 32, 16)), "5b": ((1536, 768, 768, 768), (128, 64, 32))},
    "albedo": {"0.4b": _STANDARD, "0.8b": _STANDARD, "1b": _STANDARD,
               "5b": ((1536, 768, 512, 256), (64, 32, 16))},
    # NOTE: the matting head's widths are not published with the original code; the 1b normal head's
    # are assumed. A real matting file whose widths differ still loads: its head is inferred from shapes.
    "matting": {"1b": _STANDARD},
}
POINTMAP_SCALE = dict(scale_conv_channels=(1536, 512, 128), scale_hidden=(512, 128))


def scale_branch_grid(feature_size: tuple[int, int], kernel_sizes) -> tuple[int, int]:
    """The (h, w) the pointmap scale branch's stride-2 convs (padding (k - 1) // 2) leave of a feature map:
    the one place this geometry is computed (the head, the loader and the size check use it)."""
    h, w = feature_size
    for k in kernel_sizes:
        pad = (k - 1) // 2
        h, w = (h + 2 * pad - k) // 2 + 1, (w + 2 * pad - k) // 2 + 1
    return h, w


def head_preset(task: str, size: str) -> HeadConfig:
    if task not in HEAD_TABLE or size not in HEAD_TABLE[task]:
        known = ", ".join(f"{t}-{s}" for t in HEAD_TABLE for s in HEAD_TABLE[t])
        raise ValueError(f"no preset {task}-{size}; known: {known}")
    upsample, conv = HEAD_TABLE[task][size]
    extra = POINTMAP_SCALE if task == "pointmap" else {}
    return HeadConfig(task, upsample, conv, OUT_CHANNELS[task], **extra)


TASK_PRESETS = [f"{t}-{s}" for t in HEAD_TABLE for s in HEAD_TABLE[t]]


def upsample_layers_needed(task: str, patch_size: int) -> int | None:
    """How many 2x upsampling layers take the H/p x W/p token grid to the targets' resolution, as in the released
    heads: pose heatmaps at 1/4 of the input size, the dense tasks at the input size. None when no count does
    (a patch size that is not a power of 2, or under 4 for pose)."""
    factor = patch_size // 4 if task == "pose" else patch_size
    layers = factor.bit_length() - 1
    exact = factor >= 1 and 2**layers == factor and (task != "pose" or patch_size % 4 == 0)
    return layers if exact else None


HEAD_WIDTH_STEP = 8  # default_head's widths are multiples of this, and at least this


def nearest_size(sizes, embed_dim: int) -> str:
    """Of these preset names, the one whose embed_dim is nearest to `embed_dim` (a tie: the narrower). What a
    backbone without released weights of its own follows: its default head, and train.py's recipe."""
    return min(sizes, key=lambda s: (abs(PRESETS[s].embed_dim - embed_dim), PRESETS[s].embed_dim))


def default_head(task: str, config: Sapiens2Config, out_channels: int | None = None) -> HeadConfig:
    """The head to build when none is given, for any backbone: the released head of the size whose embed_dim is
    nearest to the backbone's (the backbone's own size when it has one; matting, released at 1b only, takes the
    normal head's widths at the other sizes, as its 1b head does). A narrower backbone gets those widths scaled
    by the embed_dim ratio (0.1b: 768 / 1024 of the 0.4b head's), rounded to multiples of 8; a wider one keeps
    them, as the released heads do (seg's widths are the same from 0.4b to 5b). The upsampling layers are as
    many as upsample_layers_needed (extra ones repeat the last width)."""
    released = {**HEAD_TABLE["normal"], **HEAD_TABLE["matting"]} if task == "matting" else HEAD_TABLE[task]
    size = nearest_size(released, config.embed_dim)
    factor = min(1.0, config.embed_dim / PRESETS[size].embed_dim)
    step = HEAD_WIDTH_STEP
    scaled = lambda widths: tuple(max(step, step * round(w * factor / step)) for w in widths)  # noqa: E731
    upsample, conv = map(scaled, released[size])
    layers = upsample_layers_needed(task, config.patch_size)
    if layers is not None:  # (None: no count fits; train.py's check says why)
        upsample = upsample[:layers] + upsample[-1:] * (layers - len(upsample))
    extra = {k: scaled(v) for k, v in POINTMAP_SCALE.items()} if task == "pointmap" else {}
    return HeadConfig(task, upsample, conv, OUT_CHANNELS[task] if out_channels is None else out_channels, **extra)


# ----------------------------------------------------------------------------------------------------
# Head building blocks
# ----------------------------------------------------------------------------------------------------


class ChannelRMSNorm(nn.Module):
    """RMSNorm over the channels of each pixel, with a weight (the albedo head's norm)."""

    def __init__(self, channels: int, eps: float = 1e-6):
        super().__init__()
        self.norm = nn.RMSNorm(channels, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x.movedim(1, -1)).movedim(-1, 1)  # (B, C, H, W) -> (B, H, W, C) and back


class InstanceNorm(nn.Module):
    """nn.InstanceNorm2d's math (per image and channel, over H and W; no affine, no running stats, so no
    state-dict keys). By default it is torch's kernel, bit-identical with the original and HF; that kernel
    makes a channels-last input contiguous (a copy in, an NCHW tensor out that the next conv copies back).
    A head switched to channels-last (Sapiens2ForTask.channels_last_head) sets keep_channels_last, and a
    channels-last input is then normalized where it lies, in place when no gradient needs it (inplace=True,
    as the heads build it: like nn.SiLU(inplace=True), it overwrites its input; one image-sized tensor less
    at the peak)."""

    def __init__(self, eps: float = 1e-5, inplace: bool = False):
        super().__init__()
        self.eps, self.inplace = eps, inplace
        self.keep_channels_last = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        channels_last = x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
        if not (self.keep_channels_last and channels_last):
            return F.instance_norm(x, eps=self.eps)
        var, mean = torch.var_mean(x, dim=(-2, -1), keepdim=True, correction=0)
        rstd = (var + self.eps).rsqrt()
        if self.inplace and not (torch.is_grad_enabled() and x.requires_grad):
            return x.sub_(mean).mul_(rstd)
        return (x - mean) * rstd


def make_norm(task: str, channels: int) -> nn.Module:
    return ChannelRMSNorm(channels) if task == "albedo" else InstanceNorm(inplace=True)


def transposed_conv(c_in: int, c_out: int, k: int) -> nn.ConvTranspose2d:
    """A stride-2 transposed conv that exactly doubles H and W for k in 2, 3, 4 (the original's rule)."""
    padding, output_padding = {4: (1, 0), 3: (1, 1), 2: (0, 0)}[k]
    return nn.ConvTranspose2d(c_in, c_out, k, stride=2, padding=padding, output_padding=output_padding, bias=False)


def conv_norm_act(task: str, c_in: int, c_out: int, k: int, stride: int = 1) -> list[nn.Module]:
    return [nn.Conv2d(c_in, c_out, k, stride=stride, padding=(k - 1) // 2), make_norm(task, c_out), nn.SiLU()]


def run_in_order(layers, x: torch.Tensor) -> torch.Tensor:
    """Apply the layers one after another in this one frame. Calling nested Sequentials instead would keep
    each block's input alive until the whole block returns (it sits in the caller's frame): at full
    resolution that is one more image-sized tensor at the peak."""
    for layer in layers:
        x = layer(x)
    return x


class TransposedConvHead(nn.Module):
    """Pose and segmentation: each transposed conv doubles the resolution."""

    def __init__(self, config: HeadConfig, in_channels: int):
        super().__init__()
        layers, c = [], in_channels
        for c_out, k in zip(config.upsample_channels, config.upsample_kernel_sizes):
            layers += [transposed_conv(c, c_out, k), InstanceNorm(inplace=True), nn.SiLU()]
            c = c_out
        self.deconv_layers = nn.Sequential(*layers)  # original keys: deconv_layers.{3j}.weight
        layers = []
        for c_out, k in zip(config.conv_channels, config.conv_kernel_sizes):
            layers += conv_norm_act(config.task, c, c_out, k)
            c = c_out
        self.conv_layers = nn.Sequential(*layers)  # conv_layers.{3j}.{weight,bias}
        self.predictor = nn.Conv2d(c, config.out_channels, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return run_in_order([*self.deconv_layers, *self.conv_layers, self.predictor], features)


class PixelShuffleHead(nn.Module):
    """Normal, pointmap, albedo, matting: conv to 4x the channels, then PixelShuffle(2) doubles H and W."""

    def __init__(self, config: HeadConfig, in_channels: int):
        super().__init__()
        task = config.task
        self.input_conv = nn.Sequential(*conv_norm_act(task, in_channels, in_channels, 3))
        blocks, c = [], in_channels
        for c_out, k in zip(config.upsample_channels, config.upsample_kernel_sizes):
            conv = nn.Conv2d(c, 4 * c_out, k, padding=(k - 1) // 2)
            blocks.append(nn.Sequential(conv, nn.PixelShuffle(2), make_norm(task, c_out), nn.SiLU()))
            c = c_out
        self.upsample_blocks = nn.Sequential(*blocks)  # upsample_blocks.{j}.0.{weight,bias}
        layers = []
        for c_out, k in zip(config.conv_channels, config.conv_kernel_sizes):
            layers += conv_norm_act(task, c, c_out, k)
            c = c_out
        self.conv_layers = nn.Sequential(*layers)
        self.predictor = nn.Conv2d(c, config.out_channels, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        upsample = [layer for block in self.upsample_blocks for layer in block]
        return run_in_order([*self.input_conv, *upsample, *self.conv_layers, self.predictor], features)


class _Activation(nn.Module):
    def __init__(self, name: str):
        super().__init__()
        self.name = name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ACTIVATIONS[self.name](x)


class PointmapHead(PixelShuffleHead):
    """The pixel-shuffle head plus the scale branch, which reads the backbone features directly."""

    def __init__(self, config: HeadConfig, in_channels: int, patch_size: int, activation: str = "silu"):
        super().__init__(config, in_channels)
        self.head_config = config
        if config.scale_input_width is None:
            raise ValueError("a pointmap head needs scale_input_width (Sapiens2ForTask fills it in)")
        layers, c = [], in_channels
        for c_out, k in zip(config.scale_conv_channels, config.scale_conv_kernel_sizes):
            layers += conv_norm_act(config.task, c, c_out, k, stride=2)
            c = c_out
        self.scale_conv_layers = nn.Sequential(*layers)  # scale_conv_layers.{3j}.{weight,bias}
        self.patch_size = patch_size
        # NOTE: the MLP's input width fixes the feature-map size, so the scale branch only works at input
        # sizes that give that many features (64x48 features for 1024x768 input: 128 * 8 * 6 = 6144).
        # The activation is the backbone's hidden_act, as in transformers (SiLU in the original).
        mlp, width = [nn.Flatten()], config.scale_input_width
        for hidden in config.scale_hidden:
            mlp += [nn.Linear(width, hidden), nn.SiLU() if activation == "silu" else _Activation(activation)]
            width = hidden
        self.scale_final_layer = nn.Sequential(*mlp, nn.Linear(width, 1))  # Linear layers at 1, 3, 5

    def forward(self, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.check_feature_size(tuple(features.shape[-2:]))
        return super().forward(features), run_in_order([*self.scale_conv_layers, *self.scale_final_layer], features)

    def check_feature_size(self, feature_size: tuple[int, int]):
        p = self.patch_size
        problem = scale_branch_problem(self.head_config, (feature_size[0] * p, feature_size[1] * p), p)
        if problem is not None:
            raise ValueError(problem)


def scale_branch_problem(config: HeadConfig, input_size: tuple[int, int], size_multiple: int = 16) -> str | None:
    """Why an (H, W) input does not fit a pointmap head's scale branch, naming the sizes that do; None when it
    fits (or the head's scale MLP width is not fixed yet). The one statement of the pointmap input-size rule:
    the MLP takes scale_input_width inputs, so the (H / m, W / m) feature map (m: the backbone's size_multiple)
    must reduce to that many through the stride-2 convs, which a range of sizes does, not only the backbone
    config's image_size. The head checks it when run; a command checks its --size with it before any image."""
    if config.task != "pointmap" or config.scale_input_width is None:
        return None
    m = size_multiple
    h, w = scale_branch_grid((input_size[0] // m, input_size[1] // m), config.scale_conv_kernel_sizes)
    channels = config.scale_conv_channels[-1]
    if channels * h * w == config.scale_input_width and h * w > 1:
        return None
    span = lambda r: f"{r[0] * m}" if len(r) == 1 else f"{r[0] * m}-{r[-1] * m}"  # noqa: E731
    fits = " or ".join(f"{span(hs)} x {span(ws)}" for hs, ws in scale_branch_fits(config)) or "none"
    why = (f"its MLP takes {config.scale_input_width} inputs, this size gives {channels} x {h} x {w} = "
           f"{channels * h * w}" if channels * h * w != config.scale_input_width else
           "this size leaves it a 1 x 1 map, which its instance norm cannot normalize")
    return (f"a {input_size[0]}x{input_size[1]} input does not fit the pointmap scale branch: {why} after the "
            f"{len(config.scale_conv_channels)} stride-2 convs. Input sizes that fit (H x W, multiples of {m}): {fits}")


def scale_branch_fits(config: HeadConfig, limit: int | None = 6) -> list[tuple[range, range]]:
    """The feature-map heights and widths (ranges, in patches) that the scale branch turns into exactly
    scale_input_width inputs: one (heights, widths) pair per grid it can end at, squarest grid first. Grids of
    one cell are left out (the last conv's instance norm cannot normalize a single value). The work is bounded
    by the longest feature length searched, whatever width a file claims (a width of 10**12 once took minutes)."""
    channels = config.scale_conv_channels[-1]
    if config.scale_input_width % channels:
        return []
    cells = config.scale_input_width // channels
    reduced = _lengths_reduced_to(tuple(config.scale_conv_kernel_sizes))
    longest = max(reduced)
    grids = [(a, cells // a) for a in range(1, min(cells, longest) + 1) if cells % a == 0 and cells // a <= longest]
    grids = sorted((g for g in grids if g[0] * g[1] > 1), key=lambda g: abs(g[0] - g[1]))
    return [(reduced[a], reduced[b]) for a, b in grids[:limit]]


SCALE_SEARCH = 4096  # feature lengths searched for input sizes that fit: up to 65536 pixels at patch 16


@functools.lru_cache(maxsize=64)
def _lengths_reduced_to(kernel_sizes: tuple[int, ...]) -> dict[int, range]:
    """Each length the scale convs can end at -> the feature lengths under SCALE_SEARCH they reduce to it (a
    contiguous run: the map is monotone)."""
    found: dict[int, list[int]] = {}
    for n in range(1, SCALE_SEARCH):
        found.setdefault(scale_branch_grid((n, n), kernel_sizes)[0], []).append(n)
    return {target: range(lengths[0], lengths[-1] + 1) for target, lengths in found.items()}


def build_head(config: HeadConfig, in_channels: int, patch_size: int = 16, activation: str = "silu") -> nn.Module:
    if config.transposed:
        return TransposedConvHead(config, in_channels)
    if config.task == "pointmap":
        return PointmapHead(config, in_channels, patch_size, activation)
    return PixelShuffleHead(config, in_channels)


# ----------------------------------------------------------------------------------------------------
# Task models
# ----------------------------------------------------------------------------------------------------


@dataclass
class PoseOutput:
    heatmaps: torch.Tensor  # (B, 308, H/4, W/4)
    loss: torch.Tensor | None = None


@dataclass
class SegOutput:
    logits: torch.Tensor  # (B, 29, H, W)
    loss: torch.Tensor | None = None


@dataclass
class NormalOutput:
    normals: torch.Tensor  # (B, 3, H, W), raw (not unit length; processing normalizes)
    loss: torch.Tensor | None = None


@dataclass
class PointmapOutput:
    pointmaps: torch.Tensor  # (B, 3, H, W) XYZ in the canonical camera (focal 768 network pixels)
    scales: torch.Tensor  # (B, 1) canonical focal / actual focal: metric = pointmaps / scales
    loss: torch.Tensor | None = None


@dataclass
class AlbedoOutput:
    albedo: torch.Tensor  # (B, 3, H, W) RGB, raw (processing clamps to [0, 1])
    loss: torch.Tensor | None = None


@dataclass
class MattingOutput:
    alphas: torch.Tensor  # (B, 1, H, W) in [0, 1]
    foregrounds: torch.Tensor  # (B, 3, H, W) premultiplied RGB in [0, 1]
    loss: torch.Tensor | None = None


class Sapiens2ForTask(nn.Module):
    """Backbone + decode head. State-dict keys: `backbone.*`, `decode_head.*` (the original task format)."""

    task: str = ""

    def __init__(self, config: Sapiens2Config, head_config: HeadConfig):
        super().__init__()
        if self.task and head_config.task != self.task:
            raise ValueError(f"{type(self).__name__} needs a {self.task} head, got a {head_config.task} head")
        if head_config.task == "pointmap" and head_config.scale_input_width is None:
            grid = tuple(s // config.size_multiple for s in config.image_size)
            h, w = scale_branch_grid(grid, head_config.scale_conv_kernel_sizes)
            head_config = replace(head_config, scale_input_width=head_config.scale_conv_channels[-1] * h * w)
        self.config, self.head_config = config, head_config
        self.backbone = Sapiens2(config)
        self.decode_head = build_head(head_config, config.embed_dim, config.size_multiple, config.hidden_act)

    @property
    def labels(self) -> tuple[str, ...] | None:
        """The output names the checkpoint came with (transformers' id2label), if any."""
        return self.head_config.labels

    def features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.backbone(pixel_values).features  # (B, C, H/16, W/16), after the final norm

    def channels_last_head(self, enabled: bool = True) -> "Sapiens2ForTask":
        """Run the decode head in channels-last (NHWC): its conv weights are converted, and its norms keep
        that layout instead of copying to NCHW and back. Outputs are then channels-last tensors; numbers
        agree with the default layout to ~1e-6 (fp32). Off by default: the default path is op-for-op the
        original's (and HF's). Measured in bench/e2e.py as the ours-cl / ours-triton-cl rows."""
        self.decode_head.to(memory_format=torch.channels_last if enabled else torch.contiguous_format)
        for module in self.decode_head.modules():
            if isinstance(module, InstanceNorm):
                module.keep_channels_last = enabled
        return self


def _check_labels(name: str, labels: torch.Tensor, expected: tuple, what: str):
    if tuple(labels.shape) != tuple(expected):
        raise ValueError(f"{name} must have shape {tuple(expected)} ({what}), got {tuple(labels.shape)}")


class Sapiens2ForPose(Sapiens2ForTask):
    task = "pose"

    def forward(self, pixel_values, labels=None, label_weights=None, flip_pairs=None) -> PoseOutput:
        """labels: (B, K, H/4, W/4) target heatmaps; label_weights: (B, K) visibility weights.

        flip_pairs: (P, 2) left/right keypoint pairs, as in HF: the input is taken to be the mirrored
        image, and the heatmaps are mapped back (channels swapped, then mirrored). `flip_test` runs both.
        """
        heatmaps = self.decode_head(self.features(pixel_values))
        if flip_pairs is not None:
            heatmaps = flip_heatmaps_back(heatmaps, flip_pairs)
        loss = None
        if labels is not None:
            _check_labels("labels", labels, heatmaps.shape, "target heatmaps like the model's output")
            if label_weights is not None:
                _check_labels("label_weights", label_weights, heatmaps.shape[:2], "one weight per keypoint")
            loss = keypoint_mse_loss(heatmaps, labels, label_weights)
        return PoseOutput(heatmaps, loss)

    def flip_pairs(self, device=None) -> torch.Tensor:
        """The left/right keypoint pairs: the checkpoint's (transformers' flip_pairs), else the 308 set's."""
        if self.head_config.flip_pairs is not None:
            return torch.tensor(self.head_config.flip_pairs, dtype=torch.long, device=device).view(-1, 2)
        if self.head_config.out_channels != OUT_CHANNELS["pose"]:
            raise ValueError(
                f"the flip test needs the left/right pairs of this model's {self.head_config.out_channels} "
                "keypoints: set head_config.flip_pairs (transformers' config.json field flip_pairs)"
            )
        return flip_pairs(device)

    def flip_test(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """The original's test-time augmentation: mean of the heatmaps of the image and of its mirror."""
        plain = self(pixel_values).heatmaps
        mirrored = self(pixel_values.flip(-1), flip_pairs=self.flip_pairs(plain.device)).heatmaps
        return (plain + mirrored) / 2


class Sapiens2ForSegmentation(Sapiens2ForTask):
    task = "seg"

    def forward(self, pixel_values, labels=None) -> SegOutput:
        """labels: (B, H, W) class ids, 255 = ignore. The loss is the original's CE + Dice."""
        logits = self.decode_head(self.features(pixel_values))
        loss = None
        if labels is not None:
            _check_labels("labels", labels, (logits.shape[0], *logits.shape[2:]), "class ids per pixel")
            loss = seg_loss(logits, labels)
        return SegOutput(logits, loss)


def _dense_mask(mask, labels):
    if mask is None:
        return torch.ones_like(labels[:, :1])
    _check_labels("mask", mask, (labels.shape[0], 1, *labels.shape[2:]), "valid pixels")
    return mask.to(labels.dtype)


class Sapiens2ForNormal(Sapiens2ForTask):
    task = "normal"

    def forward(self, pixel_values, labels=None, mask=None) -> NormalOutput:
        """labels: (B, 3, H, W) unit normals; mask: (B, 1, H, W) valid pixels (default: all)."""
        normals = self.decode_head(self.features(pixel_values))
        loss = None
        if labels is not None:
            _check_labels("labels", labels, normals.shape, "unit normals")
            loss = normal_loss(normals, labels, _dense_mask(mask, labels))
        return NormalOutput(normals, loss)


class Sapiens2ForPointmap(Sapiens2ForTask):
    task = "pointmap"

    def forward(self, pixel_values, labels=None, mask=None, scales=None, intrinsics=None) -> PointmapOutput:
        """labels: (B, 3, H, W) canonical XYZ; mask: (B, 1, H, W); scales: (B, 1) = 768 / fx;
        intrinsics: (B, 3, 3) the pre-canonical K of the network input (needed by the K-consistency term,
        and gives `scales` when they are not passed)."""
        pointmaps, predicted_scales = self.decode_head(self.features(pixel_values))
        loss = None
        if labels is not None:
            _check_labels("labels", labels, pointmaps.shape, "canonical XYZ")
            if scales is None and intrinsics is None:
                raise ValueError("the pointmap loss needs the ground-truth scales or the intrinsics")
            if intrinsics is not None:
                _check_labels("intrinsics", intrinsics, (labels.shape[0], 3, 3), "camera matrices")
            if scales is None:
                scales = CANONICAL_FOCAL / intrinsics[:, 0, 0:1]
            _check_labels("scales", scales, (labels.shape[0], 1), "one scale per image")
            loss = pointmap_loss(pointmaps, predicted_scales, labels, _dense_mask(mask, labels), scales, intrinsics)
        return PointmapOutput(pointmaps, predicted_scales, loss)


class Sapiens2ForAlbedo(Sapiens2ForTask):
    task = "albedo"

    def forward(self, pixel_values, labels=None, mask=None) -> AlbedoOutput:
        """labels: (B, 3, H, W) albedo RGB in [0, 1]; mask: (B, 1, H, W)."""
        albedo = self.decode_head(self.features(pixel_values))
        loss = None
        if labels is not None:
            _check_labels("labels", labels, albedo.shape, "RGB albedo")
            loss = albedo_loss(albedo, labels, _dense_mask(mask, labels))
        return AlbedoOutput(albedo, loss)


class Sapiens2ForMatting(Sapiens2ForTask):
    task = "matting"

    def forward(self, pixel_values, labels=None, foregrounds=None, mask=None) -> MattingOutput:
        """labels: (B, 1, H, W) alpha in [0, 1]. With foregrounds (B, 3, H, W, the premultiplied RGB target in
        [0, 1]) and mask (B, 1, H, W, where that target is known; default: everywhere) the loss adds the
        foreground's terms (losses.matting_loss, the upstream's)."""
        out = self.decode_head(self.features(pixel_values)).sigmoid()  # (B, 4, H, W)
        foreground, alpha = out[:, :3], out[:, 3:]
        loss = None
        if labels is not None:
            _check_labels("labels", labels, alpha.shape, "alpha mattes")
            if foregrounds is not None:
                _check_labels("foregrounds", foregrounds, foreground.shape, "premultiplied foregrounds")
                mask = _dense_mask(mask, labels)
            loss = matting_loss(alpha, labels, foreground, foregrounds, mask)
        return MattingOutput(alpha, foreground, loss)


TASK_MODELS = {cls.task: cls for cls in (Sapiens2ForPose, Sapiens2ForSegmentation, Sapiens2ForNormal,
                                         Sapiens2ForPointmap, Sapiens2ForAlbedo, Sapiens2ForMatting)}


def build_task_model(config: Sapiens2Config, head_config: HeadConfig) -> Sapiens2ForTask:
    return TASK_MODELS[head_config.task](config, head_config)


def task_preset(name: str) -> tuple[str, HeadConfig]:
    """"seg-0.4b" -> ("0.4b", the released seg head of the 0.4b model)."""
    if name not in TASK_PRESETS:
        raise ValueError(f"unknown task preset {name!r}; choose one of {', '.join(TASK_PRESETS)}")
    task, size = name.split("-", 1)
    return size, head_preset(task, size)


def from_preset(name: str, **backbone_overrides) -> Sapiens2ForTask:
    """A randomly initialized task model, e.g. from_preset("seg-0.4b")."""
    size, head = task_preset(name)
    return build_task_model(Sapiens2Config.from_preset(size, **backbone_overrides), head)


RANDOM_MODEL_SIZE = "0.4b"  # the architecture of a random model whose source names no size (a file, a hub id)


def random_model(task: str, source: str, backbone_size: str | None = None, seed: int = 0,
                 **backbone_overrides) -> nn.Module:
    """Random weights with a real architecture, for runs without a checkpoint (--random-init of predict.py,
    train.py and export.py): the head of the size `source` names (a size, or a task preset such as seg-0.4b;
    any other source: RANDOM_MODEL_SIZE), default_head's where that size has no released head, on a
    `backbone_size` backbone (default: that size). task "features" gives the backbone alone. The same `seed`
    gives the same weights in every process; the caller's random state is left as it was."""
    size = source.split("-", 1)[1] if source in TASK_PRESETS else source if source in PRESETS else RANDOM_MODEL_SIZE
    config = Sapiens2Config.from_preset(backbone_size or size, **backbone_overrides)
    # The modules draw their init from torch's default CPU generator (nn.Linear's constructor takes no other), so
    # the weights come from it, seeded, inside fork_rng, which puts the caller's state back after. CPU only:
    # forking the CUDA generators would start a CUDA context on every GPU of every process.
    with torch.random.fork_rng(devices=[]):
        torch.random.default_generator.manual_seed(seed)
        if task == "features":
            return Sapiens2(config)
        return build_task_model(config, default_head(task, Sapiens2Config.from_preset(size)))
