"""What the Triton kernels share: the launch grid (one flat axis of (batch, head, tile) programs) and the
aligned-heads memory layout (below).

CUDA limits grid axes 1 and 2 to 65,535 programs and axis 0 to 2**31 - 1, so a (tiles, B * H) grid fails from
B * H = 65,536 on (batch 2,048 with 32 heads). Every kernel here therefore launches `flat_grid(...)` programs on
axis 0 and recovers its coordinates with `program_coords`, tiles fastest (the tiles of one head run side by
side, as with the 2-D grid, so they share that head's K/V in L2).

The batch and head indices come back as int64: `b * stride_b` overflows int32 from 2**31 elements, e.g. the
5b model (N = 3,081, 32 heads of 76) at batch 287 for 1024x768 images and batch 72 for 2048x1536. Offsets
inside one image (token * stride_n + dim) stay int32, which keeps the per-element address math cheap; an image
of more than 2**31 elements is refused by `check_image_elements`.
"""

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
