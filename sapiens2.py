"""Sapiens2: the backbone in one file, in the order a token meets the code.

Architecture (Meta's Sapiens2, all sizes):
  * 16x16 patch embedding (a strided conv), then [CLS, 8 register tokens, patches in row-major order].
    No absolute position embedding: position enters only through 2-D RoPE on the patch tokens.
  * Pre-norm transformer blocks with RMSNorm (eps 1e-6):
      x = x + gamma * proj(attention(rope(qk_norm(q)), rope(qk_norm(k)), v))   LayerScale on attention only
      x = x + w3(silu(a) * b),  a, b = w12(ln2(x)).chunk(2)                     SwiGLU of width 4C, no LayerScale
  * Grouped-query attention: the first 8 and the last 8 blocks are full multi-head, the blocks between
    use heads // 2 key/value heads.
  * A final RMSNorm over all tokens.
  * The 4K variant first turns each 4x4 window of patches into one token with a small windowed
    transformer (the "tokenizer"), so a 4096x3072 image costs the main blocks what 1024x768 does.

RoPE comes in two numerical conventions (`Sapiens2Config.rope_dtype`):
  * "bfloat16" (default): the original computation, step by step in bf16, with q and k rounded through
    bf16 around the rotation. The released weights were trained this way.
  * "float32": the HF transformers computation (tables in fp32, cast to the activation dtype).

Module and parameter names follow the original checkpoints (`blocks.{i}.attn.wq`, `ffn.w12`, ...), so an
original file loads without renaming; weights.py maps the other formats onto these names.
The attention and the q/k-norm+RoPE math live in kernels/ (a PyTorch reference, and Triton on CUDA).

The file reads config -> patch embed -> RoPE -> attention -> MLP -> block -> (4K tokenizer) -> model; the
plumbing comes last: the library namespace this file also is, the kernels (or, for this file copied alone, their
math in plain PyTorch), the activation table HF configs may name, and the size presets.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import os
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

__version__ = "0.1.0"  # the package's version, in this one place (the build reads it from here)


# ----------------------------------------------------------------------------------------------------
# Config (one row per released size: PRESETS, at the end of the file, after the activation table that
# building a config checks `hidden_act` against)
# ----------------------------------------------------------------------------------------------------
ROPE_DTYPES = ("bfloat16", "float32")

@dataclass
class Sapiens2Config:
    embed_dim: int = 1024  # C
    depth: int = 24  # L, number of main blocks
    num_heads: int = 16
    # GQA layout: blocks [0, full_attention_first) and [depth - full_attention_last, depth) use full
    # multi-head attention, the blocks between use `gqa_kv_heads` (default num_heads // 2) kv heads.
    # `kv_heads_per_layer` (one entry per block) overrides the rule.
    gqa_kv_heads: int | None = None
    full_attention_first: int = 8
    full_attention_last: int = 8
    kv_heads_per_layer: tuple[int, ...] | None = None
    ffn_dim: int | None = None  # SwiGLU hidden width F, default 4C
    hidden_act: str = "silu"  # the SwiGLU gate's activation (transformers' `hidden_act`; see ACTIVATIONS)
    patch_size: int = 16
    in_channels: int = 3
    num_register_tokens: int = 8
    image_size: tuple[int, int] = (1024, 768)  # (H, W) the model was trained at; forward accepts others
    norm_eps: float = 1e-6
    layer_scale_init: float = 1e-4
    # RoPE
    rope_base: float = 100.0
    rope_dtype: str = "bfloat16"  # "bfloat16": as the original (and the released weights); "float32": as HF
    # Training-time coordinate augmentation (None = off; the released models used none). As in HF: shift
    # adds U(-s, s) per axis, jitter and rescale multiply by a log-uniform factor in [1/j, j] (per axis)
    # and [1/r, r] (both axes).
    rope_shift: float | None = None
    rope_jitter: float | None = None
    rope_rescale: float | None = None
    # 4K variant: windowed tokenizer before the main blocks
    use_tokenizer: bool = False
    tokenizer_window: int = 4
    tokenizer_layers: int = 2
    tokenizer_ffn_dim: int | None = None  # the tokenizer blocks' SwiGLU width: 4C in the original, whatever ffn_dim is
    # Masked-image pretraining: a learned token that replaces masked patches
    use_mask_token: bool = False
    # Stochastic depth, rising linearly from 0 at the first block to drop_path_rate at the last
    drop_path_rate: float = 0.0

    def __post_init__(self):
        self.image_size = tuple(self.image_size)
        if self.kv_heads_per_layer is not None:
            self.kv_heads_per_layer = tuple(int(h) for h in self.kv_heads_per_layer)
            if len(self.kv_heads_per_layer) != self.depth:
                raise ValueError(f"kv_heads_per_layer has {len(self.kv_heads_per_layer)} entries for {self.depth} blocks")
        if self.embed_dim % self.num_heads:
            raise ValueError(f"embed_dim {self.embed_dim} is not divisible by num_heads {self.num_heads}")
        if self.head_dim % 4:
            raise ValueError(f"2-D RoPE needs a head dim divisible by 4, got {self.head_dim}")
        for heads in self.layer_kv_heads:
            if heads < 1 or self.num_heads % heads:
                raise ValueError(f"kv heads {heads} must divide num_heads {self.num_heads}")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(
                f"hidden_act {self.hidden_act!r} is not supported; use one of {', '.join(ACTIVATIONS)} "
                "(activations with learned parameters, such as prelu and xielu, are not)"
            )
        if self.rope_dtype not in ROPE_DTYPES:
            raise ValueError(f"rope_dtype must be one of {sorted(ROPE_DTYPES)}, got {self.rope_dtype!r}")

    # Derived values: computed here and nowhere else.
    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    @property
    def hidden_dim(self) -> int:
        return self.ffn_dim or 4 * self.embed_dim

    @property
    def tokenizer_hidden_dim(self) -> int:
        return self.tokenizer_ffn_dim or 4 * self.embed_dim

    @property
    def layer_kv_heads(self) -> tuple[int, ...]:
        """Key/value heads of each main block."""
        if self.kv_heads_per_layer is not None:
            return self.kv_heads_per_layer
        gqa = self.gqa_kv_heads or self.num_heads // 2
        last_gqa = self.depth - self.full_attention_last
        return tuple(self.num_heads if i < self.full_attention_first or i >= last_gqa else gqa
                     for i in range(self.depth))

    @property
    def size_multiple(self) -> int:
        """Input H and W must be multiples of this (a patch, or a tokenizer window of patches)."""
        return self.patch_size * (self.tokenizer_window if self.use_tokenizer else 1)

    @property
    def num_prefix_tokens(self) -> int:
        return 1 + self.num_register_tokens

    def to_dict(self) -> dict:
        d = asdict(self)
        d["image_size"] = list(self.image_size)
        if d["kv_heads_per_layer"] is not None:
            d["kv_heads_per_layer"] = list(d["kv_heads_per_layer"])
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Sapiens2Config":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown Sapiens2Config fields: {unknown}")
        return cls(**d)

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "Sapiens2Config":
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
        return replace(PRESETS[name], **overrides)


# ----------------------------------------------------------------------------------------------------
# Building blocks
# ----------------------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    """RMSNorm with a weight, computed in fp32 and rounded once (torch.nn.RMSNorm's numerics)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm_reference(x, self.weight, self.eps)


class PatchEmbed(nn.Module):
    """(B, 3, H, W) -> (B, H/16 * W/16, C), patches in row-major order."""

    def __init__(self, config: Sapiens2Config):
        super().__init__()
        p = config.patch_size
        self.projection = nn.Conv2d(config.in_channels, config.embed_dim, kernel_size=p, stride=p)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.projection(pixels).flatten(2).transpose(1, 2)  # (B, C, h, w) -> (B, h*w, C)


# ----------------------------------------------------------------------------------------------------
# 2-D rotary position embedding
# ----------------------------------------------------------------------------------------------------
class RotaryEmbedding2D(nn.Module):
    """cos/sin tables (h*w, D) for a grid of h x w patches.

    Each patch centre gets coordinates in [-1, 1], separately per axis: y = 2 (i + 0.5) / h - 1,
    x = 2 (j + 0.5) / w - 1. With D/4 frequencies f_k = 1 / base^(4k / D), the angles are
        ang = 2 pi * [y f_0 .. y f_{D/4-1} | x f_0 .. x f_{D/4-1} | y f_0 .. | x f_0 ..]     # (h*w, D)
    i.e. [y | x] tiled twice, which rotate_half pairs as (j, j + D/2): dims j and j + D/2 turn together
    with the same angle. Worked example, D = 8 (two frequencies): dims 0/4 turn by 2 pi y f_0, 1/5 by
    2 pi y f_1, 2/6 by 2 pi x f_0, 3/7 by 2 pi x f_1.
    """

    def __init__(self, config: Sapiens2Config):
        super().__init__()
        self.config = config
        self._cache: dict = {}

    def forward(self, h: int, w: int, device: torch.device, dtype: torch.dtype):
        """Tables for an h x w grid. `dtype` is the activation dtype (the fp32 convention casts to it)."""
        config = self.config
        augment = self.training and any(
            a is not None for a in (config.rope_shift, config.rope_jitter, config.rope_rescale)
        )
        if augment:
            return self._tables(h, w, device, dtype, augment=True)
        # Keyed by grad and inference mode too: tables made under torch.inference_mode() are inference tensors,
        # which a later training step could not save for its backward. (torch.compile cannot trace the inference
        # mode query, and a compiled graph makes no inference tensors.)
        inference = not torch.compiler.is_compiling() and torch.is_inference_mode_enabled()
        key = (h, w, device, dtype, config.rope_dtype, torch.is_grad_enabled(), inference)
        if key not in self._cache:
            self._cache[key] = self._tables(h, w, device, dtype, augment=False)
        return self._cache[key]

    def _apply(self, fn, *args, **kwargs):
        """.to(), .cuda(), .half(), ...: the cached tables are for the old device and dtype; drop them."""
        self._cache.clear()
        return super()._apply(fn, *args, **kwargs)

    def _tables(self, h, w, device, dtype, augment: bool):
        args = (self.config.head_dim, self.config.rope_base, h, w, device, self._augment if augment else None)
        if self.config.rope_dtype == "bfloat16":
            return rope_tables_bf16(*args)
        return tuple(t.to(dtype) for t in rope_tables_fp32(*args))  # cast to the activations, as HF does

    def _augment(self, coords: torch.Tensor) -> torch.Tensor:
        """Random shift / per-axis jitter / global rescale of the coordinates, in their own dtype."""
        c = self.config
        like = dict(device=coords.device, dtype=coords.dtype)
        if c.rope_shift is not None:
            coords = coords + torch.empty(1, 2, **like).uniform_(-c.rope_shift, c.rope_shift)
        if c.rope_jitter is not None:
            r = math.log(c.rope_jitter)
            coords = coords * torch.empty(1, 2, **like).uniform_(-r, r).exp()
        if c.rope_rescale is not None:
            r = math.log(c.rope_rescale)
            coords = coords * torch.empty(1, **like).uniform_(-r, r).exp()
        return coords


def patch_centre_coordinates(h: int, w: int, dtype: torch.dtype, device) -> torch.Tensor:
    """(h*w, 2) patch centres as (y, x) in [-1, 1], row-major, computed in `dtype`."""
    ys = torch.arange(0.5, h, dtype=dtype, device=device) / h  # (h,)
    xs = torch.arange(0.5, w, dtype=dtype, device=device) / w  # (w,)
    coords = torch.stack(torch.meshgrid(ys, xs, indexing="ij"), dim=-1).flatten(0, 1)  # (h*w, 2)
    return 2.0 * coords - 1.0


def rope_periods_bf16(head_dim: int, base: float, device=None) -> torch.Tensor:
    """The original's `rope_embed.periods` buffer: base ** (2k / (D/2)), k < D/4, every op in bf16."""
    k = torch.arange(head_dim // 4, dtype=torch.bfloat16, device=device)
    return base ** (2 * k / (head_dim // 2))


def rope_tables_fp32(head_dim: int, base: float, h: int, w: int, device=None, augment=None):
    """HF transformers' computation: inverse frequencies and angles in fp32."""
    inv_freq = 1 / base ** torch.arange(0, 1, 4 / head_dim, dtype=torch.float32, device=device)  # (D/4,)
    coords = patch_centre_coordinates(h, w, torch.float32, device)  # (h*w, 2)
    if augment is not None:
        coords = augment(coords)
    angles = 2 * math.pi * coords[:, :, None] * inv_freq[None, None, :]  # (h*w, 2, D/4)
    angles = angles.flatten(1, 2).tile(2)  # (h*w, D) = [y | x | y | x]
    return torch.cos(angles), torch.sin(angles)


def rope_tables_bf16(head_dim: int, base: float, h: int, w: int, device=None, augment=None):
    """The original computation. NOTE: every op rounds to bf16 and the op order matters: computing in
    fp32 and rounding at the end gives different tables (37-46% of the entries differ)."""
    periods = rope_periods_bf16(head_dim, base, device)  # (D/4,) bf16
    coords = patch_centre_coordinates(h, w, torch.bfloat16, device)  # (h*w, 2) bf16
    if augment is not None:
        coords = augment(coords)
    angles = 2 * math.pi * coords[:, :, None] / periods[None, None, :]  # (h*w, 2, D/4) bf16
    angles = angles.flatten(1, 2).tile(2)  # (h*w, D) bf16
    return torch.cos(angles), torch.sin(angles)


# ----------------------------------------------------------------------------------------------------
# Attention, MLP, block
# ----------------------------------------------------------------------------------------------------
class LayerScale(nn.Module):
    def __init__(self, dim: int, init: float):
        super().__init__()
        self.weight = nn.Parameter(torch.full((dim,), init))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


class Attention(nn.Module):
    """Multi-head attention with GQA, optional per-head q/k RMSNorm, and RoPE on the patch tokens."""

    def __init__(self, dim: int, num_heads: int, num_kv_heads: int, qk_norm: bool, eps: float,
                 layer_scale: float | None):
        super().__init__()
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim = dim // num_heads
        self.eps = eps
        self.wq = nn.Linear(dim, dim)
        self.wk = nn.Linear(dim, num_kv_heads * self.head_dim)
        self.wv = nn.Linear(dim, num_kv_heads * self.head_dim)
        # Per-head RMSNorm of q and k; their weights feed the fused kernels.qk_norm_rope.
        self.q_norm = RMSNorm(self.head_dim, eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps) if qk_norm else None
        self.proj = nn.Linear(dim, dim)
        self.gamma = LayerScale(dim, layer_scale) if layer_scale is not None else None

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None, keep_probs: bool = False):
        """x (B, N, C); rope = (cos, sin) tables (P, D) for the last P tokens (main blocks only).
        -> (output (B, N, C), the attention probabilities (B, Hq, N, N) if keep_probs else None)."""
        B, N, C = x.shape
        D = self.head_dim
        q = self.wq(x).view(B, N, self.num_heads, D).transpose(1, 2)  # (B, Hq, N, D)
        k = self.wk(x).view(B, N, self.num_kv_heads, D).transpose(1, 2)  # (B, Hkv, N, D)
        v = self.wv(x).view(B, N, self.num_kv_heads, D).transpose(1, 2)  # (B, Hkv, N, D)
        # Main blocks normalize and rotate q and k; the 4K tokenizer's blocks do neither.
        # NOTE: on CUDA this runs kernels/qk_norm_rope_triton.py, which RE-IMPLEMENTS kernels.rope_reference
        # (and its roundings) instead of calling it: a change to rope_reference or to the tables' layout
        # must be made in the kernel too (tests/test_kernels.py::test_triton_rope_is_rope_reference fails
        # when the two diverge).
        if self.q_norm is not None:
            q, k = kernels.qk_norm_rope(q, k, self.q_norm.weight, self.k_norm.weight, *rope, eps=self.eps)
        o = kernels.attention(q, k, v)
        # Probabilities asked for: written out beside the fused kernel (an N x N matrix per head), not instead
        # of it, so that looking at a block's attention leaves its output bit for bit what it was.
        probs = kernels.attention_probs(q, k) if keep_probs else None
        o = self.proj(o.transpose(1, 2).reshape(B, N, C))  # merge heads head-major: (B, N, Hq*D)
        return (self.gamma(o) if self.gamma is not None else o), probs


class SwiGLU(nn.Module):
    """w3(act(a) * b) with [a | b] = w12(x): the first half of w12's outputs is the gate branch.
    act is SiLU in every released model (`hidden_act` names another one, as transformers allows)."""

    def __init__(self, dim: int, hidden_dim: int, act: str = "silu"):
        super().__init__()
        self.w12 = nn.Linear(dim, 2 * hidden_dim)
        self.w3 = nn.Linear(hidden_dim, dim)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w12(x).chunk(2, dim=-1)  # (B, N, F) each, views of one (B, N, 2F) tensor
        if torch.is_grad_enabled() or torch.compiler.is_compiling() or observed(self.w12):
            # (torch.compile fuses silu * up into one kernel anyway; in place would only make it copy. A forward
            # hook on w12 holds its output: in place would change what the hook saw.)
            return self.w3(ACTIVATIONS[self.act](gate) * up)
        # Eager inference: the same ops in place in w12's output, so the block's peak stays at the 2F it
        # already holds (out of place adds silu's F and the product's F: the largest activations of the model).
        if self.act in ("silu", "swish"):
            return self.w3(F.silu(gate, inplace=True).mul_(up))
        return self.w3(ACTIVATIONS[self.act](gate).mul_(up))


def observed(module: nn.Module) -> bool:
    """True when forward hooks (the module's own or global ones) may hold on to the module's output."""
    return bool(module._forward_hooks or nn.modules.module._global_forward_hooks)


class DropPath(nn.Module):
    """Stochastic depth: drop a whole residual branch per sample while training."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        keep = torch.empty(x.shape[0], *([1] * (x.dim() - 1)), device=x.device, dtype=x.dtype).bernoulli_(1 - self.p)
        return x * keep / (1 - self.p)


class Block(nn.Module):
    """Pre-norm block: LayerScale on the attention branch only (the FFN branch has none)."""

    def __init__(self, config: Sapiens2Config, num_kv_heads: int, drop_path: float = 0.0):
        super().__init__()
        C = config.embed_dim
        self.ln1 = RMSNorm(C, config.norm_eps)
        self.attn = Attention(C, config.num_heads, num_kv_heads, qk_norm=True, eps=config.norm_eps,
                              layer_scale=config.layer_scale_init)
        self.ln2 = RMSNorm(C, config.norm_eps)
        self.ffn = SwiGLU(C, config.hidden_dim, config.hidden_act)
        self.drop_path = DropPath(drop_path)

    def forward(self, x: torch.Tensor, rope=None, keep_attention: bool = False):
        """x (B, N, C) -> x; with keep_attention (x, attention probabilities (B, heads, N, N))."""
        attn, probs = self.attn(self.ln1(x), rope, keep_attention)
        x = x + self.drop_path(attn)
        x = x + self.drop_path(self.ffn(self.ln2(x)))
        return (x, probs) if keep_attention else x


# ----------------------------------------------------------------------------------------------------
# The 4K windowed tokenizer
# ----------------------------------------------------------------------------------------------------
class TokenizerBlock(nn.Module):
    """A block of the 4K tokenizer: the main block's pre-norm attention and SwiGLU, with full multi-head attention
    and no RoPE, q/k-norm, LayerScale or drop path; its own FFN width (4C in the original) and always SiLU.
    Module names as Block's, as in the original checkpoints (tokenizer.blocks.{i}.attn.wq, ...)."""

    def __init__(self, config: Sapiens2Config):
        super().__init__()
        C = config.embed_dim
        self.ln1 = RMSNorm(C, config.norm_eps)
        self.attn = Attention(C, config.num_heads, config.num_heads, qk_norm=False, eps=config.norm_eps,
                              layer_scale=None)
        self.ln2 = RMSNorm(C, config.norm_eps)
        self.ffn = SwiGLU(C, config.tokenizer_hidden_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (B*windows, 1 + ws*ws, C) -> x."""
        x = x + self.attn(self.ln1(x), rope=None)[0]
        return x + self.ffn(self.ln2(x))


class WindowTokenizer(nn.Module):
    """Summarizes each ws x ws window of patch tokens into one token (the window's own CLS output).

    Per window: [w_cls, its ws*ws patches (row-major)] + local_pos_embed -> plain transformer blocks
    (full MHA, no RoPE, no q/k-norm, no LayerScale) -> token 0. Windows come out row-major, so the main
    blocks see an (H/16/ws) x (W/16/ws) grid.
    """

    def __init__(self, config: Sapiens2Config):
        super().__init__()
        ws, C = config.tokenizer_window, config.embed_dim
        self.window = ws
        self.w_cls = nn.Parameter(torch.zeros(1, 1, C))
        self.local_pos_embed = nn.Parameter(torch.zeros(1, 1 + ws * ws, C))
        self.blocks = nn.ModuleList(TokenizerBlock(config) for _ in range(config.tokenizer_layers))

    def forward(self, patches: torch.Tensor, hp: int, wp: int) -> torch.Tensor:
        B, _, C = patches.shape
        ws = self.window
        h, w = hp // ws, wp // ws
        z = patches.view(B, h, ws, w, ws, C).permute(0, 1, 3, 2, 4, 5)  # (B, h, w, ws, ws, C)
        z = z.reshape(B * h * w, ws * ws, C)  # one row per window, batch-major
        z = torch.cat([self.w_cls.expand(z.shape[0], -1, -1), z], dim=1) + self.local_pos_embed  # (Bhw, 1+ws², C)
        for block in self.blocks:
            z = block(z)
        return z[:, 0].view(B, h * w, C)


# ----------------------------------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------------------------------
@dataclass
class Sapiens2Output:
    """What the backbone returns.

    tokens:   (B, 1+R+h*w, C) every token (CLS, R registers, patches) after the final norm
    cls:      (B, C) the CLS token after the final norm (what HF calls pooler_output)
    features: (B, C, h, w) the patch tokens after the final norm, as a map (what the task heads take)
    layers:   one (B, C, h, w) map per entry of `layers=` in forward, in its order, normalized by the final
              norm only if `normalize_layers=True` (the original returns them raw; HF's Sapiens2Backbone
              normalizes by default)
    layer_cls, layer_registers: those blocks' CLS (B, C) and registers (B, R, C), normalized alike: with
              `layers`, each requested block's whole token sequence
    attentions: {block index, from 0: (B, heads, N, N)} the attention probabilities of the blocks named by
              `attentions=` in forward (rows: queries, columns: keys; tokens in the order of `tokens`)
    """

    tokens: torch.Tensor
    cls: torch.Tensor
    features: torch.Tensor
    layers: tuple[torch.Tensor, ...] = field(default_factory=tuple)
    layer_cls: tuple[torch.Tensor, ...] = field(default_factory=tuple)
    layer_registers: tuple[torch.Tensor, ...] = field(default_factory=tuple)
    attentions: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def registers(self) -> torch.Tensor:
        """(B, R, C) the register tokens after the final norm."""
        num_patches = self.features.shape[-2] * self.features.shape[-1]
        return self.tokens[:, 1 : self.tokens.shape[1] - num_patches]


class Sapiens2(nn.Module):
    def __init__(self, config: Sapiens2Config):
        super().__init__()
        self.config = config
        C = config.embed_dim
        self.patch_embed = PatchEmbed(config)
        self.tokenizer = WindowTokenizer(config) if config.use_tokenizer else None
        self.cls_token = nn.Parameter(torch.zeros(1, 1, C))
        self.storage_tokens = nn.Parameter(torch.zeros(1, config.num_register_tokens, C))  # the registers
        self.mask_token = nn.Parameter(torch.zeros(1, 1, C)) if config.use_mask_token else None
        self.rope_embed = RotaryEmbedding2D(config)
        drop_rates = [config.drop_path_rate * i / max(config.depth - 1, 1) for i in range(config.depth)]
        self.blocks = nn.ModuleList(Block(config, kv, drop) for kv, drop in zip(config.layer_kv_heads, drop_rates))
        self.ln1 = RMSNorm(C, config.norm_eps)  # the final norm (original key: ln1.weight)
        self.init_weights()

    # This model's kernel choice (auto, fastest, torch, triton; kernels/dispatch.py), over SAPIENS2_KERNELS, which
    # stays the default of every other model. None: the environment's.
    kernel_backend: str | None = None

    def use_kernels(self, choice: str | None) -> "Sapiens2":
        """Run this model's kernels as under SAPIENS2_KERNELS=choice (None: back to the environment's); returns
        the model. e.g. model.use_kernels("torch") for the PyTorch references in this model only."""
        with kernels.backend(choice):  # an unknown choice is an error here, not at the next forward
            self.kernel_backend = choice
        return self

    def kernel_choice(self):
        return kernels.backend(self.kernel_backend) if self.kernel_backend else contextlib.nullcontext()

    # Recompute each main block's activations in the backward pass instead of keeping them (less memory, about
    # one more forward of compute). The modules and their state-dict keys are unchanged.
    grad_checkpointing: bool = False

    def set_grad_checkpointing(self, enable: bool = True) -> "Sapiens2":
        """Gradient checkpointing of the main blocks on or off (as timm's models); returns the model. Blocks
        whose attention probabilities forward is asked for (`attentions=`) are not checkpointed, nor the 4K
        tokenizer's."""
        self.grad_checkpointing = enable
        return self

    def run_block(self, block: nn.Module, x: torch.Tensor, rope) -> torch.Tensor:
        """One main block, checkpointed when asked for and gradients are on. The recomputation runs in the
        backward pass, outside forward's kernel choice: it takes the choice again, to run the same kernels."""
        if not (self.grad_checkpointing and torch.is_grad_enabled()):
            return block(x, rope)

        def recomputable(x, rope):
            with self.kernel_choice():
                return block(x, rope)

        return checkpoint(recomputable, x, rope, use_reentrant=False)

    @torch.no_grad()
    def init_weights(self, std: float = 0.02):
        """Truncated-normal init as the original; for training from scratch (loading overwrites it)."""
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Conv2d)) and m.weight.device.type != "meta":
                nn.init.trunc_normal_(m.weight, std=std)
                nn.init.zeros_(m.bias)
        extra = (self.tokenizer.w_cls, self.tokenizer.local_pos_embed) if self.tokenizer is not None else ()
        for p in (self.cls_token, self.storage_tokens, *extra):
            if p.device.type != "meta":
                nn.init.trunc_normal_(p, std=std)

    def check_input(self, pixel_values: torch.Tensor):
        if pixel_values.dim() != 4:
            raise ValueError(f"expected pixel_values of shape (B, 3, H, W), got {tuple(pixel_values.shape)}")
        c, H, W = pixel_values.shape[1:]
        if c != self.config.in_channels:
            raise ValueError(f"expected {self.config.in_channels} channels (B, C, H, W), got {c} in {tuple(pixel_values.shape)}")
        m = self.config.size_multiple
        if H % m or W % m:
            what = f"a multiple of {m} (16-pixel patches" + (f" in {m // 16}x{m // 16} windows)" if m > 16 else ")")
            raise ValueError(
                f"image size {H}x{W} does not work: height and width must each be {what}, "
                f"e.g. {max(m, H // m * m)}x{max(m, W // m * m)}"
            )

    def embed(self, pixel_values: torch.Tensor, mask: torch.Tensor | None = None):
        """Pixels -> (tokens (B, 1+R+h*w, C), h, w)."""
        self.check_input(pixel_values)
        B = pixel_values.shape[0]
        hp, wp = (s // self.config.patch_size for s in pixel_values.shape[2:])
        x = self.patch_embed(pixel_values.to(self.patch_embed.projection.weight.dtype))  # (B, hp*wp, C)
        if mask is not None:
            if self.mask_token is None:
                raise ValueError("a mask was given but the model has no mask token (use_mask_token=False)")
            x = torch.where(mask.view(B, -1, 1), self.mask_token.to(x.dtype), x)
        h, w = hp, wp
        if self.tokenizer is not None:
            x = self.tokenizer(x, hp, wp)  # (B, h*w, C), one token per window
            h, w = hp // self.config.tokenizer_window, wp // self.config.tokenizer_window
        prefix = torch.cat([self.cls_token, self.storage_tokens], dim=1).to(x.dtype).expand(B, -1, -1)
        return torch.cat([prefix, x], dim=1), h, w

    def forward(self, pixel_values: torch.Tensor, layers: Sequence[int] = (), normalize_layers: bool = False,
                mask: torch.Tensor | None = None, attentions: Sequence[int] = ()) -> Sapiens2Output:
        """pixel_values (B, 3, H, W), normalized, H and W multiples of config.size_multiple.

        layers:     blocks whose outputs to return (out.layers, out.layer_cls, out.layer_registers).
        mask:       (B, h*w) bool, patches to replace by the mask token (masked-image pretraining).
        attentions: blocks whose attention probabilities to return (out.attentions), written out (an N x N
                    matrix per head) there only, beside the usual attention: every other output is identical
                    with and without. Main blocks only, not the 4K tokenizer's.
        Blocks are indexed as a Python list: 0..depth-1, or -depth..-1 from the end (-1 = the last block).
        """
        layers = block_indices(layers, self.config.depth, "layers")
        keep_attention = set(block_indices(attentions, self.config.depth, "attentions"))
        with self.kernel_choice():
            x, h, w = self.embed(pixel_values, mask)
            rope = self.rope_embed(h, w, x.device, x.dtype)
            captured, probs = {}, {}
            for i, block in enumerate(self.blocks):
                if i in keep_attention:
                    x, probs[i] = block(x, rope, keep_attention=True)
                else:
                    x = self.run_block(block, x, rope)
                if i in layers:
                    captured[i] = self.ln1(x) if normalize_layers else x
        x = self.ln1(x)
        prefix = self.config.num_prefix_tokens
        kept = [captured[i] for i in layers]
        return Sapiens2Output(
            tokens=x,
            cls=x[:, 0],
            features=tokens_to_map(x[:, prefix:], h, w),
            layers=tuple(tokens_to_map(t[:, prefix:], h, w) for t in kept),
            layer_cls=tuple(t[:, 0] for t in kept),
            layer_registers=tuple(t[:, 1:prefix] for t in kept),
            attentions=probs,
        )


def block_indices(indices: Sequence[int], depth: int, argument: str) -> list[int]:
    """Block indices as a Python list takes them (negative from the end), as 0..depth-1."""
    if wrong := [i for i in indices if not -depth <= i < depth]:
        raise IndexError(f"{argument}: block {wrong[0]} does not exist; this model has {depth} blocks "
                         f"(0..{depth - 1}, or {-depth}..-1)")
    return [range(depth)[i] for i in indices]  # (range, not i % depth: a float index is a TypeError)


def tokens_to_map(patch_tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """(B, h*w, C) -> (B, C, h, w)."""
    B, _, C = patch_tokens.shape
    return patch_tokens.transpose(1, 2).reshape(B, C, h, w)


# ----------------------------------------------------------------------------------------------------
# Fine-tuning: layer-wise learning-rate decay
# ----------------------------------------------------------------------------------------------------
def layer_decay_groups(model: nn.Module, *, lr: float, weight_decay: float, layer_decay: float) -> list[dict]:
    """AdamW parameter groups of `model`'s trainable parameters, as the original fine-tunes make them.

    `model` is a Sapiens2 or holds one (a task model's `backbone`). Layer 0 is the tokens and the patch embedding
    (with the 4K tokenizer), layer i + 1 block i, layer depth + 1 everything else (the final norm, a head); a
    group's "lr_scale" is layer_decay ** (depth + 1 - layer), and, as in timm, the schedule applies it
    (group["lr"] = lr_now * group["lr_scale"]): "lr" starts as the peak `lr`. Weight decay on all parameters but
    1-D ones (norms), biases and positional embeddings; the tokens (cls, registers, mask) are decayed, as there.
    """
    prefix, backbone = backbone_of(model)
    depth = backbone.config.depth
    groups = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        layer = layer_id(name[len(prefix):] if name.startswith(prefix) else None, depth)
        exempt = param.ndim == 1 or name.endswith(".bias") or "pos_embed" in name
        if (layer, exempt) not in groups:
            groups[layer, exempt] = {"params": [], "lr_scale": layer_decay ** (depth + 1 - layer),
                                     "weight_decay": 0.0 if exempt else weight_decay, "lr": lr}
        groups[layer, exempt]["params"].append(param)
    return [groups[key] for key in sorted(groups)]


def backbone_of(model: nn.Module) -> tuple[str, "Sapiens2"]:
    """(its parameter-name prefix, such as "backbone.", the Sapiens2 in `model`)."""
    for name, module in model.named_modules():
        if isinstance(module, Sapiens2):
            return (name + "." if name else ""), module
    raise TypeError(f"layer_decay_groups: {type(model).__name__} holds no Sapiens2 backbone; pass a Sapiens2 "
                    "or a model built on one (heads.build_task_model)")


def layer_id(backbone_name: str | None, depth: int) -> int:
    """The original's _get_layer_id_for_sapiens (sapiens/engine/runners/base_runner.py) for a parameter named
    `backbone_name` inside the backbone (None: outside it)."""
    if backbone_name is None:
        return depth + 1
    if backbone_name.startswith("blocks."):
        return int(backbone_name.split(".")[1]) + 1
    if backbone_name in ("cls_token", "mask_token", "pos_embed", "storage_tokens") or \
            backbone_name.startswith(("patch_embed", "tokenizer")):
        return 0
    return depth + 1


# ====================================================================================================
# Plumbing: the library's namespace, the kernels (or their plain-PyTorch math), the activation table, the sizes
# ====================================================================================================
# This file is also the namespace of the library around it: `from sapiens2 import weights, heads, processing,
# kernels, losses, hub`. Installed, it is sapiens2/__init__.py and Python gives it a __path__; in a checkout it is
# sapiens2.py beside those modules and gives itself the same one (to `import`, a module with a __path__ is a package).
if "__path__" not in globals():
    __path__ = [os.path.dirname(os.path.abspath(__file__))]


def one_module(bare_name: str) -> None:
    """A checkout's files are also importable by their bare names (`import heads`, `import kernels`), and each
    such file calls this first: the bare name then gives the namespace's own module (sapiens2.heads), so that a
    process never holds two copies, whose classes fail each other's isinstance and whose `kernels` the model never
    calls. What the bare file runs after the call fills a module object that nothing keeps (README.md, Install)."""
    import sys

    module = importlib.import_module(f"{__name__}.{bare_name}")
    prefix = module.__name__ + "."
    for name, submodule in list(sys.modules.items()):  # kernels.attention etc.: one copy under either name too
        if name.startswith(prefix):
            sys.modules.setdefault(bare_name + name[len(prefix) - 1:], submodule)
    sys.modules[bare_name] = module


# ----------------------------------------------------------------------------------------------------
# The fused ops: kernels/ beside this file, or the same math in plain PyTorch when this file is alone
# ----------------------------------------------------------------------------------------------------
class PlainKernels:
    """The math of kernels/' PyTorch references in a few lines, for this file copied alone into another project
    (torch and safetensors only). tests/test_install.py checks that it equals those references bit for bit."""

    @staticmethod
    def rms_norm_reference(x, weight, eps=1e-6):  # in fp32, rounded once to x's dtype
        return F.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps).to(x.dtype)

    @staticmethod
    def rope_reference(x, cos, sin):  # rotate the last P = len(cos) tokens, in cos.dtype
        prefix, patches = x.to(cos.dtype).split((x.shape[-2] - cos.shape[0], cos.shape[0]), dim=-2)
        half1, half2 = patches.chunk(2, dim=-1)
        patches = patches * cos + torch.cat((-half2, half1), dim=-1) * sin
        return torch.cat((prefix, patches), dim=-2).to(x.dtype)

    @staticmethod
    def qk_norm_rope(q, k, q_weight, k_weight, cos, sin, eps=1e-6):
        rope, norm = PlainKernels.rope_reference, PlainKernels.rms_norm_reference
        return rope(norm(q, q_weight, eps), cos, sin), rope(norm(k, k_weight, eps), cos, sin)

    @staticmethod
    def attention(q, k, v, scale=None):  # GQA: query head h reads key/value head h // (Hq / Hkv)
        D, gqa = q.shape[-1], q.shape[1] != k.shape[1]
        if q.is_cuda and D % 8:  # SDPA's flash/cuDNN need D % 8 == 0: zero columns to 80 (exact), sliced off
            q, k, v = (F.pad(t, (0, -D % 8)) for t in (q, k, v))
            return F.scaled_dot_product_attention(q, k, v, scale=D ** -0.5 if scale is None else scale,
                                                  enable_gqa=gqa)[..., :D]
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=gqa)

    @staticmethod
    def backend(choice):  # no Triton here: every choice runs the same PyTorch code
        return contextlib.nullcontext()

    @staticmethod
    def attention_probs(q, k, scale=None):  # softmax(q k^T * scale) in fp32 or wider, rounded to q's dtype
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        softmax_dtype = torch.promote_types(q.dtype, torch.float32)
        return torch.softmax(q @ k.transpose(-1, -2) * scale, dim=-1, dtype=softmax_dtype).to(q.dtype)


def load_kernels():
    """kernels/ beside this file, imported as part of this namespace (sapiens2.kernels): a `kernels` package of
    another distribution, such as Hugging Face's, stays what the rest of the process imports. Without kernels/,
    PlainKernels."""
    try:
        return importlib.import_module(f"{__name__}.kernels")
    except ModuleNotFoundError as error:
        if error.name != f"{__name__}.kernels":
            raise  # kernels/ is there, but something it imports is missing: say so rather than run without it
        return PlainKernels


kernels = load_kernels()


# ----------------------------------------------------------------------------------------------------
# The activations HF configs may name, and the size presets
# ----------------------------------------------------------------------------------------------------
# The activations transformers' `hidden_act` may name that have no parameters, as transformers computes
# them (activations.py ACT2CLS). `hidden_act` is the SwiGLU gate's activation in the main blocks and the
# pointmap scale MLP's (where transformers applies it); every released model uses "silu". The head convs
# (in transformers too) and the 4K tokenizer's blocks (which transformers lacks) always use SiLU.
# (Here, before PRESETS: building a config checks its `hidden_act` against this table.)
_tanh_gelu = lambda x: 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))  # noqa: E731
ACTIVATIONS = {
    "silu": F.silu, "swish": F.silu, "gelu": F.gelu,
    "gelu_python": lambda x: x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0))),
    "gelu_new": _tanh_gelu, "gelu_python_tanh": _tanh_gelu, "gelu_accurate": _tanh_gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_fast": lambda x: 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x))),
    "gelu_10": lambda x: torch.clip(F.gelu(x), -10, 10), "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "relu": F.relu, "relu2": lambda x: torch.square(F.relu(x)), "relu6": F.relu6, "leaky_relu": F.leaky_relu,
    "mish": lambda x: x * torch.tanh(F.softplus(x)), "tanh": torch.tanh, "sigmoid": torch.sigmoid,
    "hardswish": F.hardswish, "linear": lambda x: x,
}


# One row per released size. Parameter counts are of the backbone alone (buffers excluded), as computed
# from the original architecture table; tests/test_sapiens2.py checks every row on the meta device.
#           name        C     L   heads  tokenizer layers (used by the 4K variant only)    params
PRESETS: dict[str, Sapiens2Config] = {
    "0.1b": Sapiens2Config(768, 12, 12, tokenizer_layers=2),  # 113,993,472 (no GQA block: 12 <= 8 + 8)
    "0.4b": Sapiens2Config(1024, 24, 16, tokenizer_layers=2),  # 395,450,368
    "0.8b": Sapiens2Config(1280, 32, 16, tokenizer_layers=3),  # 814,283,520 (head dim 80)
    "1b": Sapiens2Config(1536, 40, 24, tokenizer_layers=4),  # 1,455,474,176
    "1b-4k": Sapiens2Config(1536, 40, 24, tokenizer_layers=4, use_tokenizer=True, image_size=(4096, 3072)),  # 1,606,588,928
    "5b": Sapiens2Config(2432, 56, 32, tokenizer_layers=6),  # 5,066,902,976 (head dim 76)
}
