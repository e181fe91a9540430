"""What the Triton kernels share: the launch grid (one flat axis of (batch, head, tile) programs), the
aligned-heads memory layout (below), and the attention kernels' launch functions (autotuning key buckets,
configuration labels, SAPIENS2_TRITON_EXCLUDE, output allocation).

CUDA limits grid axes 1 and 2 to 65,535 programs and axis 0 to 2**31 - 1, so a (tiles, B * H) grid fails from
B * H = 65,536 on (batch 2,048 with 32 heads). Every kernel here therefore launches `flat_grid(...)` programs on
axis 0 and recovers its coordinates with `program_coords`, tiles fastest (the tiles of one head run side by
side, as with the 2-D grid, so they share that head's K/V in L2).

The batch and head indices come back as int64: `b * stride_b` overflows int32 from 2**31 elements, e.g. the
5b model (N = 3,081, 32 heads of 76) at batch 287 for 1024x768 images and batch 72 for 2048x1536. Offsets
inside one image (token * stride_n + dim) stay int32, which keeps the per-element address math cheap; an image
of more than 2**31 elements is refused by `check_image_elements`.
"""

import os

import torch
import triton
import triton.language as tl

MAX_PROGRAMS = 2**31 - 1  # CUDA's limit on grid axis 0


@triton.jit
def program_coords(num_tiles, HEADS):
    """(tile, b, h) of this program in a flat grid of num_tiles * B * HEADS programs; b and h are int64."""
    return tile_coords(tl.program_id(0), num_tiles, HEADS)


@triton.jit
def tile_coords(index, num_tiles, HEADS):
    """(tile, b, h) of work item `index` of num_tiles * B * HEADS, tiles fastest; b and h are int64. A persistent
    program walks several indices; a plain one has index = its program id."""
    tile = index % num_tiles
    bh = (index // num_tiles).to(tl.int64)
    return tile, bh // HEADS, bh % HEADS


def flat_grid(num_tiles: int, num_heads_total: int) -> tuple[int]:
    """The 1-D grid for num_tiles tiles of each of num_heads_total (batch x head) pairs."""
    programs = num_tiles * num_heads_total
    if programs > MAX_PROGRAMS:
        raise ValueError(f"{programs} programs exceed CUDA's grid limit of {MAX_PROGRAMS}: split the batch")
    return (programs,)


def check_image_elements(*tensors):
    """Per-image offsets are int32: refuse an image (one batch element) whose span reaches 2**31 elements."""
    for t in tensors:
        span = sum((size - 1) * abs(stride) for size, stride in zip(t.shape[1:], t.stride()[1:])) + 1
        if span >= 2**31:
            raise ValueError(f"one batch element of a {tuple(t.shape)} tensor spans {span} elements; the kernels "
                             "index within an image in int32 (at most 2**31 - 1)")


# ----------------------------------------------------------------------------------------------------
# Aligned heads: 16-element strides, so that loads are 128-bit (and cp.async-able) for any head dim
# ----------------------------------------------------------------------------------------------------

ALIGN = 16  # elements; the JIT marks an int argument "divisible by 16", nothing finer


def padded_head_dim(head_dim: int) -> int:
    """D rounded up to a multiple of 16: 76 (5b) -> 80; 64 and 80 unchanged."""
    return -(-head_dim // ALIGN) * ALIGN


def empty_heads(B, H, N, D, dtype, device, pad: bool = True) -> torch.Tensor:
    """An uninitialized (B, H, N, D) tensor in (B, N, H, D) memory; with `pad`, each head is stored in
    padded_head_dim(D) columns (the extra columns are never read or written: every kernel masks at D), so
    every head starts at a 16-element boundary. 5b: 80 columns per head of 76, 5% more memory."""
    stored = padded_head_dim(D) if pad else D
    return torch.empty(B, N, H, stored, dtype=dtype, device=device)[..., :D].transpose(1, 2)


def heads_aligned(t: torch.Tensor) -> bool:
    """True when t (B, H, N, D) has a unit stride on D and batch, head and token strides divisible by 16."""
    return t.stride(3) == 1 and all(s % ALIGN == 0 for s in t.stride()[:3])


def aligned_heads(t: torch.Tensor) -> torch.Tensor:
    """t itself when its heads are aligned, else a copy in padded (B, N, H, D) storage (same values).

    Why: with D = 76 in the model's (B, N, H * 76) projections, odd heads start 152 bytes apart, so the
    compiler can only prove 2-byte alignment and every load becomes a scalar 16-bit load (no cp.async, no
    pipelining). One copy of a tensor the kernel streams many times (K and V are read once per query tile)
    is cheap next to that."""
    if heads_aligned(t):
        return t
    B, H, N, D = t.shape
    out = empty_heads(B, H, N, D, t.dtype, t.device)
    out.copy_(t)
    return out


# ----------------------------------------------------------------------------------------------------
# Launch functions of the attention kernels (attention_triton.py and its Hopper variants)
# ----------------------------------------------------------------------------------------------------


def batch_bucket(rows: int) -> int:
    """B * H in the autotuning key: below the 132 SMs of an H100/H200 (a grid too small to fill the GPU), or the
    power of 4 at or above it (132+, 528+, 2112+, ...)."""
    if rows < 132:
        return 1
    bucket = 132
    while bucket * 4 <= rows:
        bucket *= 4
    return bucket


# The letters config_label gives the Hopper variants' flags (attention_triton_hopper.py).
VARIANT_LETTERS = (("p", "PACK"), ("t", "TMA"), ("o", "OVERLAP"), ("x", "POLY_EXP2"), ("g", "PERSISTENT"))


def config_label(constexprs: dict, num_warps: int, num_stages: int, maxnreg: int | None = None) -> str:
    """A configuration's name in benchmarks and tables: BLOCK_M x BLOCK_N, warps, stages, the variant letters
    that are on, rN for a cap of N registers per thread. e.g. 128x64w8s3, 128x64w8s3to, 128x64w8s3r128."""
    flags = "".join(letter for letter, key in VARIANT_LETTERS if constexprs.get(key))
    cap = f"r{maxnreg}" if maxnreg else ""
    return f"{constexprs.get('BLOCK_M', '')}x{constexprs.get('BLOCK_N', '')}w{num_warps}s{num_stages}{flags}{cap}"


def excluded_configs() -> set[str]:
    """SAPIENS2_TRITON_EXCLUDE=LABEL,LABEL (config_label names): configurations no autotuner here tries, read at
    import. The way around one that faults on a GPU (a fault loses the CUDA context)."""
    return {label.strip() for label in os.environ.get("SAPIENS2_TRITON_EXCLUDE", "").split(",") if label.strip()}


def drop_excluded(tuned: dict, excluded: set[str]):
    """Remove the excluded configurations from each autotuned launcher in `tuned` (an error if none is left)."""
    for key, launcher in tuned.items():
        kept = [c for c in launcher.configs
                if config_label(c.kwargs, c.num_warps, c.num_stages, c.maxnreg) not in excluded]
        if not kept:
            raise ValueError(f"SAPIENS2_TRITON_EXCLUDE={','.join(sorted(excluded))} leaves no {key[0]} configuration "
                             f"({'fp32' if key[1] else 'bf16/fp16'}, launcher {key}): keep one")
        launcher.configs = kept


def launch_options(blocks: dict) -> dict:
    """num_warps, num_stages (and maxnreg) of a fixed-tile launch."""
    options = {"num_warps": blocks.get("num_warps", 4), "num_stages": blocks.get("num_stages", 2)}
    if blocks.get("maxnreg"):
        options["maxnreg"] = blocks["maxnreg"]
    return options


def empty_bnhd(like: torch.Tensor) -> torch.Tensor:
    """An uninitialized tensor shaped like `like` (B, H, N, D) whose memory is (B, N, H, D)-contiguous."""
    B, H, N, D = like.shape
    return torch.empty(B, N, H, D, dtype=like.dtype, device=like.device).transpose(1, 2)


def check_out(out, *likes):
    """The `out` tensors, if each matches its `like` in shape, dtype and device."""
    for o, like in zip(out, likes):
        if o.shape != like.shape or o.dtype != like.dtype or o.device != like.device:
            raise ValueError(f"out tensor {tuple(o.shape)} {o.dtype} does not match {tuple(like.shape)} {like.dtype}")
    return out


def tile_configs(shapes, maxnreg=None, **constexprs):
    """triton.Config per (BLOCK_M, BLOCK_N, warps, stages)."""
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n, **constexprs}, num_warps=w, num_stages=s, maxnreg=maxnreg)
            for m, n, w, s in shapes]


_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_attention_inputs(q, k, v):
    """One-line errors for q, k, v the attention kernels cannot take."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be (B, H, N, D); got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    B, HQ, N, D = q.shape
    if k.shape != v.shape or k.shape[0] != B or k.shape[2:] != (N, D):
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must be (B={B}, Hkv, N={N}, D={D})")
    if HQ % k.shape[1]:
        raise ValueError(f"query heads ({HQ}) must be a multiple of key/value heads ({k.shape[1]})")
    if not 16 <= D <= 256:
        raise ValueError(f"head dim {D} is outside the supported [16, 256]")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in _DTYPES:
        raise TypeError(f"q, k, v must share a dtype among {_DTYPES}; got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v are on different devices: {q.device}, {k.device}, {v.device}")


def tuned_label(launcher) -> str | None:
    """config_label of the configuration an autotuned launcher ran last (None before its first launch)."""
    config = getattr(launcher, "best_config", None)
    return config and config_label(config.kwargs, config.num_warps, config.num_stages, config.maxnreg)
