"""Triton implementation of qk_norm_rope: per-head RMSNorm of q and k, then rotate-half RoPE of the patches.

Imported lazily by kernels/qk_norm_rope.py (never at `import kernels` time). The definition is
`qk_norm_rope_reference`; this file computes the same function in one launch for q and k. Each program
takes one block of tokens of one image and a group of HEADS_PER_PROGRAM heads (q heads, then k heads): it
loads the block's cos/sin once and loops over its heads.

Forward, per head vector x of length D (the reference's op order and roundings, see below):

    r   = rsqrt(sum(x**2) / D + eps)                       fp32
    y   = round_in(x * r * w)                              RMSNorm, rounded once to the input dtype
    y   = round_rope(y)                                    the reference's `.to(cos.dtype)`
    [y1 | y2] = y                                          halves of D/2 (rotate_half pairs (j, j + D/2))
    o1  = round_rope(round_rope(y1 * c1) - round_rope(y2 * s1))     patch tokens only; the N - P prefix
    o2  = round_rope(round_rope(y2 * c2) + round_rope(y1 * s2))     tokens keep o = y
    out = round_in(o)

round_in / round_rope round an fp32 value to the input dtype / cos.dtype (no-ops for fp32).

bf16-RoPE decision: this kernel REPRODUCES the reference's rounding for every dtype pair, including the
original model's convention (fp32 q/k with bf16 cos/sin tables); it never falls back. Why that is exact: a
product of two bf16 (or fp16) numbers is exact in fp32 (8 x 8 <= 24 mantissa bits; 11 x 11 for fp16), so
rounding the fp32 product once to bf16 gives the bf16 product; and PyTorch's own bf16/fp16 add and
multiply (CPU and CUDA) compute in fp32 and round, which is what the kernel does after every op. The only
differences left are in the fp32 RMS reduction (summation order, rsqrt implementation: a few fp32 ulp), which
can move a value across a bf16 rounding boundary: at most 1 ulp of the rounding dtype, on a small fraction of
elements (the tests bound both).

Backward (straight-through for the roundings, all fp32): the rotation transposed on the patch tokens,
    dy1 = do1 * c1 + do2 * s2,   dy2 = do2 * c2 - do1 * s1        (prefix: dy = do)
then RMSNorm's backward with x_hat = x * r and g = dy * w,
    dx  = r * (g - x_hat * sum(g * x_hat) / D),   dw = sum over batch, heads and tokens of dy * x_hat
(dw from deterministic per-program partial sums, reduced by torch). cos/sin get no gradient.

Limits: D even with D/2 <= 512 (one program holds BLOCK_N full head vectors); q and k share a dtype
(fp32, bf16 or fp16); any strides for every tensor; outputs are (B, N, H, D) memory viewed as (B, H, N, D),
the layout the attention kernel and the head merge like, with each head of the forward's outputs stored in
a multiple of 16 columns (5b: 80 for 76, norm and rotation over the true 76) so that attention reads them
aligned (kernels/grid_triton.py).
"""

import torch
import triton
import triton.language as tl

from . import dispatch
from .dispatch import launched_on_device
from .grid_triton import check_image_elements, empty_heads, flat_grid, program_coords
from .qk_norm_rope import qk_norm_rope_reference

# ----------------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------------


@triton.jit
def _round(x, dtype: tl.constexpr):
    """x (fp32) rounded to `dtype` (round to nearest even) and widened back to fp32: the rounding of one
    PyTorch op in `dtype`. bf16 rounds by integer arithmetic on the fp32 bits (keep the top 16 bits, add half
    an ulp plus the tie-to-even bit first) because the Triton interpreter truncates fp32 -> bf16 casts; that
    gives the compiled cast's result (and PyTorch's) for every finite value and for inf. NaN passes through
    unchanged: the bit trick would carry NVIDIA's canonical NaN 0x7FFFFFFF into the sign bit (-0.0), and
    0xFFFFFFFF to +0.0 (tests/test_kernels.py feeds those bit patterns)."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
        return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))
    else:
        return x.to(dtype).to(tl.float32)


@triton.jit
def _load_tables(cos_ptr, sin_ptr, n_start, N, P, scn, scd, ssn, ssd,
                 HALF: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, X_ALIGN: tl.constexpr):
    """The halves of cos/sin for BLOCK_N tokens, fp32, (BLOCK_N, BLOCK_H) each: loaded once per program and
    shared by all its heads. Prefix tokens (and tokens >= N) get cos = 1, sin = 0; is_patch marks the rest."""
    offs_n = n_start + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_H)
    p = offs_n - (N - P)  # position in the tables; negative for the prefix tokens
    is_patch = (offs_n < N) & (p >= 0)
    tmask = is_patch[:, None] & (offs_d < HALF)[None, :]
    c_rows = cos_ptr + tl.multiple_of(p * scn, X_ALIGN)[:, None]
    s_rows = sin_ptr + tl.multiple_of(p * ssn, X_ALIGN)[:, None]
    c1 = tl.load(c_rows + offs_d[None, :] * scd, mask=tmask, other=1.0).to(tl.float32)
    c2 = tl.load(c_rows + (offs_d[None, :] + HALF) * scd, mask=tmask, other=1.0).to(tl.float32)
    s1 = tl.load(s_rows + offs_d[None, :] * ssd, mask=tmask, other=0.0).to(tl.float32)
    s2 = tl.load(s_rows + (offs_d[None, :] + HALF) * ssd, mask=tmask, other=0.0).to(tl.float32)
    return c1, c2, s1, s2, is_patch


@triton.jit
def _norm_rope_fwd_tile(
    x_ptr, o_ptr,  # one (B, H, N, D) input of any strides, and its output
    w_ptr,  # (D,) RMSNorm weight of this tensor
    cos_ptr,  # the (P, D) cos table: its dtype is the rotation dtype
    c1, c2, s1, s2, is_patch,  # this token block's tables (_load_tables)
    b, h, n_start, N, eps,
    sxb, sxh, sxn, sxd,  # x strides
    sob, soh, son, sod,  # o strides
    HALF: tl.constexpr,  # D / 2
    BLOCK_N: tl.constexpr,  # tokens per program
    BLOCK_H: tl.constexpr,  # next power of two >= HALF
    X_ALIGN: tl.constexpr,  # a power of two (<= 16) dividing the batch/head strides of x
):
    in_dtype = x_ptr.dtype.element_ty
    rope_dtype = cos_ptr.dtype.element_ty  # the reference rotates in cos.dtype
    offs_n = n_start + tl.arange(0, BLOCK_N)  # (BLOCK_N,) token index
    offs_d = tl.arange(0, BLOCK_H)  # (BLOCK_H,) index within one half
    mask_n = offs_n < N
    mask_d = offs_d < HALF
    mask = mask_n[:, None] & mask_d[None, :]

    # x as its two halves [x1 | x2], each (BLOCK_N, BLOCK_H), fp32. The alignment hint lets 5b's heads
    # (76 elements: 8-byte aligned) load in pairs instead of 16-bit scalars.
    x_rows = x_ptr + tl.multiple_of(b * sxb + h * sxh, X_ALIGN) + offs_n[:, None] * sxn
    x1 = tl.load(x_rows + offs_d[None, :] * sxd, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_rows + (offs_d[None, :] + HALF) * sxd, mask=mask, other=0.0).to(tl.float32)
    w1 = tl.load(w_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + offs_d + HALF, mask=mask_d, other=0.0).to(tl.float32)

    # RMSNorm in fp32, in the reference's op order (x * r) * w, then its two roundings.
    ss = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)  # (BLOCK_N,)
    r = tl.rsqrt(ss / (2 * HALF) + eps)
    y1 = _round(_round((x1 * r[:, None]) * w1[None, :], in_dtype), rope_dtype)
    y2 = _round(_round((x2 * r[:, None]) * w2[None, :], in_dtype), rope_dtype)

    # RoPE of the patch tokens (index >= N - P), each op rounded to the rotation dtype.
    o1 = _round(_round(y1 * c1, rope_dtype) - _round(y2 * s1, rope_dtype), rope_dtype)
    o2 = _round(_round(y2 * c2, rope_dtype) + _round(y1 * s2, rope_dtype), rope_dtype)
    # Back to the input dtype (the reference's final `.to(x.dtype)`), rounded to nearest even.
    o1 = _round(tl.where(is_patch[:, None], o1, y1), in_dtype)
    o2 = _round(tl.where(is_patch[:, None], o2, y2), in_dtype)

    o_rows = o_ptr + b * sob + h * soh + offs_n[:, None] * son
    tl.store(o_rows + offs_d[None, :] * sod, o1.to(o_ptr.dtype.element_ty), mask=mask)
    tl.store(o_rows + (offs_d[None, :] + HALF) * sod, o2.to(o_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _qk_norm_rope_fwd_kernel(
    q_ptr, k_ptr, oq_ptr, ok_ptr,  # inputs (B, Hq|Hkv, N, D) of any strides; outputs
    wq_ptr, wk_ptr,  # (D,) RMSNorm weights
    cos_ptr, sin_ptr,  # (P, D) RoPE tables
    N, P, HQ, HKV, eps,
    sqb, sqh, sqn, sqd, skb, skh, skn, skd,  # q, k strides
    soqb, soqh, soqn, soqd, sokb, sokh, sokn, sokd,  # output strides
    scn, scd, ssn, ssd,  # cos, sin strides
    HALF: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, X_ALIGN: tl.constexpr,
    HEADS_PER_PROGRAM: tl.constexpr,
):
    """Flat grid of cdiv(N, BLOCK_N) * B * cdiv(Hq + Hkv, HEADS_PER_PROGRAM) programs (grid_triton.py). A
    program loads its token block's tables once and does HEADS_PER_PROGRAM heads with them: head h < Hq of
    image b is q head h, the others k head h - Hq (heads past Hq + Hkv in the last group are skipped)."""
    tile, b, group = program_coords(tl.cdiv(N, BLOCK_N), tl.cdiv(HQ + HKV, HEADS_PER_PROGRAM))
    n_start = tile * BLOCK_N
    c1, c2, s1, s2, is_patch = _load_tables(cos_ptr, sin_ptr, n_start, N, P, scn, scd, ssn, ssd,
                                            HALF, BLOCK_N, BLOCK_H, X_ALIGN)
    for i in range(HEADS_PER_PROGRAM):  # a loop, not unrolled: registers and compile time stay those of one head
        h = group * HEADS_PER_PROGRAM + i
        if h < HQ:
            _norm_rope_fwd_tile(q_ptr, oq_ptr, wq_ptr, cos_ptr, c1, c2, s1, s2, is_patch, b, h, n_start, N, eps,
                                sqb, sqh, sqn, sqd, soqb, soqh, soqn, soqd, HALF, BLOCK_N, BLOCK_H, X_ALIGN)
        elif h < HQ + HKV:
            _norm_rope_fwd_tile(k_ptr, ok_ptr, wk_ptr, cos_ptr, c1, c2, s1, s2, is_patch, b, h - HQ, n_start,
                                N, eps, skb, skh, skn, skd, sokb, sokh, sokn, sokd, HALF, BLOCK_N, BLOCK_H,
                                X_ALIGN)


@triton.jit
def _norm_rope_bwd_tile(
    x_ptr, do_ptr, dx_ptr,  # input, output gradient, input gradient: (B, H, N, D), any strides
    w_ptr, dw_part_ptr,  # (D,) weight; this (program, head)'s row of the fp32 dw partial sums
    c1, c2, s1, s2,  # this token block's tables (_load_tables)
    b, h, n_start, N, eps,
    sxb, sxh, sxn, sxd,
    sgb, sgh, sgn, sgd,  # do strides
    sdb, sdh, sdn, sdd,  # dx strides
    HALF: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, X_ALIGN: tl.constexpr,
):
    offs_n = n_start + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_H)
    mask_n = offs_n < N
    mask_d = offs_d < HALF
    mask = mask_n[:, None] & mask_d[None, :]

    x_rows = x_ptr + tl.multiple_of(b * sxb + h * sxh, X_ALIGN) + offs_n[:, None] * sxn
    x1 = tl.load(x_rows + offs_d[None, :] * sxd, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_rows + (offs_d[None, :] + HALF) * sxd, mask=mask, other=0.0).to(tl.float32)
    g_rows = do_ptr + tl.multiple_of(b * sgb + h * sgh, X_ALIGN) + offs_n[:, None] * sgn
    do1 = tl.load(g_rows + offs_d[None, :] * sgd, mask=mask, other=0.0).to(tl.float32)
    do2 = tl.load(g_rows + (offs_d[None, :] + HALF) * sgd, mask=mask, other=0.0).to(tl.float32)
    w1 = tl.load(w_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + offs_d + HALF, mask=mask_d, other=0.0).to(tl.float32)

    # Rotation transposed (patch tokens); the prefix passes do through (c = 1, s = 0 there).
    dy1 = do1 * c1 + do2 * s2
    dy2 = do2 * c2 - do1 * s1

    # RMSNorm backward.
    ss = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
    r = tl.rsqrt(ss / (2 * HALF) + eps)  # (BLOCK_N,)
    xh1 = x1 * r[:, None]
    xh2 = x2 * r[:, None]
    g1 = dy1 * w1[None, :]
    g2 = dy2 * w2[None, :]
    proj = (tl.sum(g1 * xh1, axis=1) + tl.sum(g2 * xh2, axis=1)) / (2 * HALF)  # (BLOCK_N,)
    dx1 = r[:, None] * (g1 - xh1 * proj[:, None])
    dx2 = r[:, None] * (g2 - xh2 * proj[:, None])

    dx_rows = dx_ptr + b * sdb + h * sdh + offs_n[:, None] * sdn
    dx_dtype = dx_ptr.dtype.element_ty
    tl.store(dx_rows + offs_d[None, :] * sdd, _round(dx1, dx_dtype).to(dx_dtype), mask=mask)
    tl.store(dx_rows + (offs_d[None, :] + HALF) * sdd, _round(dx2, dx_dtype).to(dx_dtype), mask=mask)
    # Masked rows and columns hold zeros in x and do, so they add nothing to the partial sums.
    tl.store(dw_part_ptr + offs_d, tl.sum(dy1 * xh1, axis=0), mask=mask_d)
    tl.store(dw_part_ptr + offs_d + HALF, tl.sum(dy2 * xh2, axis=0), mask=mask_d)


@triton.jit
def _qk_norm_rope_bwd_kernel(
    q_ptr, k_ptr, doq_ptr, dok_ptr, dq_ptr, dk_ptr,  # (B, H, N, D) tensors of any strides
    wq_ptr, wk_ptr,  # (D,) weights
    dw_part_ptr,  # (programs * HEADS_PER_PROGRAM, D) fp32 partial sums of dw, one row per (program, head)
    cos_ptr, sin_ptr,
    N, P, HQ, HKV, eps,
    sqb, sqh, sqn, sqd, skb, skh, skn, skd,
    sgqb, sgqh, sgqn, sgqd, sgkb, sgkh, sgkn, sgkd,  # doq, dok strides
    sdqb, sdqh, sdqn, sdqd, sdkb, sdkh, sdkn, sdkd,  # dq, dk strides
    scn, scd, ssn, ssd,
    HALF: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, X_ALIGN: tl.constexpr,
    HEADS_PER_PROGRAM: tl.constexpr,
):
    """Same grid as the forward; dw rows in (program, head) order, i.e. a (B, groups, tiles,
    HEADS_PER_PROGRAM, D) array (rows of the skipped heads past Hq + Hkv are never written)."""
    tile, b, group = program_coords(tl.cdiv(N, BLOCK_N), tl.cdiv(HQ + HKV, HEADS_PER_PROGRAM))
    n_start = tile * BLOCK_N
    c1, c2, s1, s2, _ = _load_tables(cos_ptr, sin_ptr, n_start, N, P, scn, scd, ssn, ssd,
                                     HALF, BLOCK_N, BLOCK_H, X_ALIGN)
    for i in range(HEADS_PER_PROGRAM):  # a loop, not unrolled: registers and compile time stay those of one head
        h = group * HEADS_PER_PROGRAM + i
        dw_row = dw_part_ptr + (tl.program_id(0).to(tl.int64) * HEADS_PER_PROGRAM + i) * (2 * HALF)
        if h < HQ:
            _norm_rope_bwd_tile(q_ptr, doq_ptr, dq_ptr, wq_ptr, dw_row, c1, c2, s1, s2, b, h, n_start, N, eps,
                                sqb, sqh, sqn, sqd, sgqb, sgqh, sgqn, sgqd, sdqb, sdqh, sdqn, sdqd,
                                HALF, BLOCK_N, BLOCK_H, X_ALIGN)
        elif h < HQ + HKV:
            _norm_rope_bwd_tile(k_ptr, dok_ptr, dk_ptr, wk_ptr, dw_row, c1, c2, s1, s2, b, h - HQ, n_start, N,
                                eps, skb, skh, skn, skd, sgkb, sgkh, sgkn, sgkd, sdkb, sdkh, sdkn, sdkd,
                                HALF, BLOCK_N, BLOCK_H, X_ALIGN)


# ----------------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------------

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _block_sizes(head_dim: int, block_n: int | None):
    """BLOCK_H covers one half of D; BLOCK_N tokens make a tile of about 4096 elements (memory bound)."""
    block_h = triton.next_power_of_2(head_dim // 2)
    if block_n is None:
        block_n = max(1, min(64, 4096 // (2 * block_h)))
    return block_n, block_h


def _alignment(cos, sin, *tensors) -> int:
    """The largest power of two <= 16 that divides every batch and head stride of these (B, H, N, D) tensors
    and the row strides of the tables: the X_ALIGN hint (5b, heads of 76 in (B, N, H, 76) memory: 4)."""
    align = 16
    strides = [cos.stride(0), sin.stride(0)] + [s for t in tensors for s in t.stride()[:2]]
    for stride in strides:
        while stride % align:
            align //= 2
    return align


def _check(q, k, q_weight, k_weight, cos, sin):
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"q and k must be (B, H, N, D); got {tuple(q.shape)} and {tuple(k.shape)}")
    B, _, N, D = q.shape
    if k.shape[0] != B or k.shape[2:] != q.shape[2:]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} differ in batch, tokens or head dim")
    if D % 2 or D // 2 > 512:
        raise ValueError(f"head dim {D} must be even and at most 1024")
    if q.dtype != k.dtype or q.dtype not in _DTYPES:
        raise TypeError(f"q and k must share a dtype among {_DTYPES}; got {q.dtype} and {k.dtype}")
    if q_weight.shape != (D,) or k_weight.shape != (D,):
        raise ValueError(f"weights must be ({D},); got {tuple(q_weight.shape)} and {tuple(k_weight.shape)}")
    if cos.dim() != 2 or cos.shape != sin.shape or cos.shape[1] != D or cos.dtype != sin.dtype:
        raise ValueError(f"cos/sin must be (P, {D}) of one dtype; got {tuple(cos.shape)} {cos.dtype} and "
                         f"{tuple(sin.shape)} {sin.dtype}")
    if cos.dtype not in _DTYPES:
        raise TypeError(f"cos/sin dtype {cos.dtype} is not among {_DTYPES}")
    if cos.shape[0] > N:
        raise ValueError(f"RoPE table has {cos.shape[0]} positions but x has only {N} tokens")
    devices = {t.device for t in (q, k, q_weight, k_weight, cos, sin)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device; got {devices}")


def _empty_bnhd(like: torch.Tensor, dtype=None) -> torch.Tensor:
    """An uninitialized (B, H, N, D) tensor whose memory is (B, N, H, D)-contiguous."""
    B, H, N, D = like.shape
    return torch.empty(B, N, H, D, dtype=dtype or like.dtype, device=like.device).transpose(1, 2)


def _check_out(out, *likes):
    for o, like in zip(out, likes):
        if o.shape != like.shape or o.dtype != like.dtype or o.device != like.device:
            raise ValueError(f"out tensor {tuple(o.shape)} {o.dtype} does not match {tuple(like.shape)} {like.dtype}")
    return out


HEADS_PER_PROGRAM = 8  # heads that share one load of a token block's tables (batch 1 still fills 132 SMs)


def _head_groups(num_heads: int, heads_per_program: int | None) -> tuple[int, int]:
    """(heads per program, groups of heads per image)."""
    g = min(heads_per_program or HEADS_PER_PROGRAM, num_heads)
    return g, triton.cdiv(num_heads, g)


@launched_on_device
def qk_norm_rope_fwd(q, k, q_weight, k_weight, cos, sin, eps: float = 1e-6, block_n: int | None = None,
                     out=None, heads_per_program: int | None = None):
    """The forward launch (no autograd). Returns (q_out, k_out): new tensors in (B, N, H, D) memory viewed as
    (B, H, N, D), each head stored in grid_triton.padded_head_dim(D) columns (76 -> 80), or the given `out`
    pair (any strides; the tests pass NaN-filled ones)."""
    _check(q, k, q_weight, k_weight, cos, sin)
    B, HQ, N, D = q.shape
    HKV, P = k.shape[1], cos.shape[0]
    if out is not None:
        oq, ok = _check_out(out, q, k)
    else:  # heads padded to a multiple of 16 (5b: 80 of 76), so that attention loads them aligned
        oq, ok = (empty_heads(*t.shape, t.dtype, t.device) for t in (q, k))
    check_image_elements(q, k, oq, ok)
    BLOCK_N, BLOCK_H = _block_sizes(D, block_n)
    G, groups = _head_groups(HQ + HKV, heads_per_program)
    grid = flat_grid(triton.cdiv(N, BLOCK_N), B * groups)
    _qk_norm_rope_fwd_kernel[grid](
        q, k, oq, ok, q_weight, k_weight, cos, sin,
        N, P, HQ, HKV, eps,
        *q.stride(), *k.stride(), *oq.stride(), *ok.stride(), *cos.stride(), *sin.stride(),
        HALF=D // 2, BLOCK_N=BLOCK_N, BLOCK_H=BLOCK_H, X_ALIGN=_alignment(cos, sin, q, k),
        HEADS_PER_PROGRAM=G, num_warps=4,
    )
    return oq, ok


@launched_on_device
def qk_norm_rope_bwd(q, k, q_weight, k_weight, cos, sin, grad_q, grad_k, eps: float = 1e-6,
                     block_n: int | None = None, out=None, heads_per_program: int | None = None):
    """The backward launch: (dq, dk, dq_weight, dk_weight) for output gradients grad_q, grad_k; dq and dk
    go to `out` when given."""
    B, HQ, N, D = q.shape
    HKV, P = k.shape[1], cos.shape[0]
    dq, dk = _check_out(out, q, k) if out is not None else (_empty_bnhd(q), _empty_bnhd(k))
    check_image_elements(q, k, grad_q, grad_k, dq, dk)
    BLOCK_N, BLOCK_H = _block_sizes(D, block_n)
    num_tiles = triton.cdiv(N, BLOCK_N)
    G, groups = _head_groups(HQ + HKV, heads_per_program)
    grid = flat_grid(num_tiles, B * groups)
    dw_part = torch.empty(grid[0] * G, D, dtype=torch.float32, device=q.device)
    _qk_norm_rope_bwd_kernel[grid](
        q, k, grad_q, grad_k, dq, dk, q_weight, k_weight, dw_part, cos, sin,
        N, P, HQ, HKV, eps,
        *q.stride(), *k.stride(), *grad_q.stride(), *grad_k.stride(), *dq.stride(), *dk.stride(),
        *cos.stride(), *sin.stride(),
        HALF=D // 2, BLOCK_N=BLOCK_N, BLOCK_H=BLOCK_H, X_ALIGN=_alignment(cos, sin, q, k, grad_q, grad_k),
        HEADS_PER_PROGRAM=G, num_warps=8,  # 4 warps spill at 5b (tables + one head: 255 registers)
    )
    # rows by (image, group, tile, head in group) -> (image, head, tile); the unwritten rows of the heads
    # past Hq + Hkv fall outside both slices
    dw_part = dw_part.view(B, groups, num_tiles, G, D).transpose(2, 3).reshape(B, groups * G, num_tiles, D)
    dwq = dw_part[:, :HQ].sum((0, 1, 2)).to(q_weight.dtype)
    dwk = dw_part[:, HQ:HQ + HKV].sum((0, 1, 2)).to(k_weight.dtype)
    return dq, dk, dwq, dwk


# ----------------------------------------------------------------------------------------------------
# Autograd
# ----------------------------------------------------------------------------------------------------


class QKNormRope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, q_weight, k_weight, cos, sin, eps):
        oq, ok = qk_norm_rope_fwd(q, k, q_weight, k_weight, cos, sin, eps)
        ctx.save_for_backward(q, k, q_weight, k_weight, cos, sin)
        ctx.eps = eps
        ctx.guarded = dispatch.guarded_backward()  # decided now: the backward runs outside the caller's context
        return oq, ok

    @staticmethod
    def backward(ctx, grad_q, grad_k):
        q, k, q_weight, k_weight, cos, sin = ctx.saved_tensors
        try:
            # An output that does not reach the loss has no gradient; zeros keep the one launch simple.
            dq, dk, dwq, dwk = qk_norm_rope_bwd(q, k, q_weight, k_weight, cos, sin,
                                                torch.zeros_like(q) if grad_q is None else grad_q,
                                                torch.zeros_like(k) if grad_k is None else grad_k, ctx.eps)
        except Exception as e:  # noqa: BLE001 - auto: a failed launch takes the reference, said once
            if not ctx.guarded:
                raise
            dq, dk, dwq, dwk = dispatch.reference_gradients(
                "qk_norm_rope", e, qk_norm_rope_reference, (q, k, q_weight, k_weight, cos, sin, ctx.eps), 4,
                (grad_q, grad_k))
        return dq, dk, dwq, dwk, None, None, None


def qk_norm_rope_triton(q, k, q_weight, k_weight, cos, sin, eps: float = 1e-6):
    """The `_qk_norm_rope_triton` hook: the fused kernels, differentiable in q, k and both weights (not in
    cos/sin: kernels/dispatch.py sends tables that require gradients to the reference)."""
    if cos.requires_grad or sin.requires_grad:
        raise ValueError("qk_norm_rope_triton gives cos/sin no gradient; use qk_norm_rope_reference for "
                         "RoPE tables that require one")
    return QKNormRope.apply(q, k, q_weight, k_weight, cos, sin, eps)
