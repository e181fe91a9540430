"""The Hopper-only variants of the flash attention in attention_triton.py: opt-in, never chosen by auto.

Same function, same limits, same launch signatures as attention_triton.py (its forward and backward are the ones
to read first). One kernel per pass carries the variant flags; the autotuner times them beside the plain tiles:
    PACK        the GROUP query heads of one K/V head stacked in a forward tile's rows (K/V loaded once per group)
    TMA         K/V (forward, dQ) or q/dO (dK/dV) tiles through tensor descriptors (Hopper's copy engine)
    OVERLAP     the next tile's scores issued before this tile's P V (or dQ / dK) MMA: softmax under the MMA
    POLY_EXP2   half of the full tiles' exp2s on the FMA units (a degree-3 polynomial; bf16/fp16 only)
    PERSISTENT  one program per SM walks the tiles (grid-stride loop)
and r128 (maxnreg=128: two 8-warp programs per SM). None of them has been timed on a GPU: SAPIENS2_KERNELS=fastest
(kernels/attention.py) and bench/kernels.py's forced labels reach them; auto runs SDPA, SAPIENS2_KERNELS=triton
attention_triton.py. What each variant does to registers, spills and the SASS, and why each configuration is in
the lists below, is in docs/kernels.md (from bench/inspect_kernels.py's sm_90a compiles).
"""

import threading

import torch
import triton
import triton.language as tl

from . import attention_triton as base
from .attention_triton import (AUTOTUNE_KEY, LOG2E, FlashAttention, _dot, _load_rows, _store_chunks, attention_delta,
                               dot_precision, head_dim_chunks)
from .dispatch import launched_on_device
from .grid_triton import (aligned_heads, batch_bucket, check_attention_inputs, check_image_elements, check_out,
                          config_label, drop_excluded, empty_bnhd, excluded_configs, flat_grid, heads_aligned,
                          launch_options, program_coords, tile_configs, tile_coords)

# ----------------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------------


@triton.jit
def _key_rows(desc, base, b, g, start_n, N, stride_n, stride_d, col0, HEAD_DIM: tl.constexpr, COLS: tl.constexpr,
              BLOCK_N: tl.constexpr, MASK_N: tl.constexpr, TMA: tl.constexpr):
    """Rows start_n .. start_n + BLOCK_N, columns col0 .. col0 + COLS of K or V head g of image b: (BLOCK_N, COLS),
    zero where row >= N or column >= HEAD_DIM. TMA: one load through the (B, N, Hkv, HEAD_DIM) descriptor `desc`
    (the copy engine fills the out-of-bounds rows and columns with zeros); else pointer loads from `base` (head g
    of image b; cp.async when pipelined), masked only where needed."""
    if TMA:
        return tl.reshape(desc.load([b.to(tl.int32), start_n, g.to(tl.int32), col0]), [BLOCK_N, COLS])
    else:  # the base kernel's masked load of one head's rows
        return _load_rows(base, start_n, N, stride_n, stride_d, ROWS=BLOCK_N, COL0=col0, COLS=COLS,
                          HEAD_DIM=HEAD_DIM, MASK_ROWS=MASK_N)


@triton.jit
def _kv_descriptors(k_ptr, v_ptr, B, N, HKV, skb, skh, skn, svb, svh, svn, HEAD_DIM: tl.constexpr, D0: tl.constexpr,
                    D1: tl.constexpr, BLOCK_N: tl.constexpr, TMA: tl.constexpr):
    """TMA: descriptors of the whole K and V, (B, N, Hkv, HEAD_DIM), one per column chunk (made once per program,
    whatever heads it visits), so that the copy engine zero-fills the rows past N and the columns past HEAD_DIM
    (76 -> 80 at 5b). Else the base pointers (unused: _key_rows reads through pointers)."""
    if TMA:
        shape = [B, N, HKV, HEAD_DIM]
        k0 = tl.make_tensor_descriptor(k_ptr, shape, [skb, skn, skh, 1], [1, BLOCK_N, 1, D0])
        v0 = tl.make_tensor_descriptor(v_ptr, shape, [svb, svn, svh, 1], [1, BLOCK_N, 1, D0])
        if D1 > 0:
            k1 = tl.make_tensor_descriptor(k_ptr, shape, [skb, skn, skh, 1], [1, BLOCK_N, 1, D1])
            v1 = tl.make_tensor_descriptor(v_ptr, shape, [svb, svn, svh, 1], [1, BLOCK_N, 1, D1])
        else:
            k1, v1 = k0, v0  # unused
        return k0, k1, v0, v1
    else:
        return k_ptr, k_ptr, v_ptr, v_ptr


@triton.jit
def _scores(q0, q1, k_desc0, k_desc1, k_base, b, g, start_n, N, skn, skd,
            HEAD_DIM: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr, BLOCK_N: tl.constexpr, MASK_N: tl.constexpr,
            TMA: tl.constexpr, PRECISION: tl.constexpr):
    """S = Q K^T for one tile of keys: (BLOCK_M, BLOCK_N) fp32, unscaled; with MASK_N, keys >= N are -inf."""
    k0 = _key_rows(k_desc0, k_base, b, g, start_n, N, skn, skd, 0, HEAD_DIM, D0, BLOCK_N, MASK_N, TMA)
    s = _dot(q0, tl.trans(k0), None, PRECISION)
    if D1 > 0:
        k1 = _key_rows(k_desc1, k_base, b, g, start_n, N, skn, skd, D0, HEAD_DIM, D1, BLOCK_N, MASK_N, TMA)
        s = _dot(q1, tl.trans(k1), s, PRECISION)
    if MASK_N:
        s = tl.where((start_n + tl.arange(0, BLOCK_N) < N)[None, :], s, float("-inf"))
    return s


# 2^f on [-0.5, 0.5] as C0 + f (C1 + f (C2 + f C3)): a degree-3 fit of the relative error (max 7.5e-5 in fp32 on a
# grid of 20,001 points; tests/test_kernels.py checks it), far below the bf16 rounding of P (up to 2^-8 = 3.9e-3).
EXP2_COEFFS = (0.9999281167984009, 0.6932609677314758, 0.24261045455932617, 0.055171284824609756)
_C0, _C1, _C2, _C3 = (tl.constexpr(c) for c in EXP2_COEFFS)
# 1.5 * 2^23: adding it rounds a float below 2^22 in magnitude to an integer held in the low mantissa bits.
_ROUNDER = tl.constexpr(12582912.0)


@triton.jit
def _exp2_fma(x):
    """2^x for finite x <= 0 on the FMA and integer units only (no MUFU, no conversion instruction, which run at
    the same 16 per clock as MUFU): j = round(x) with the 1.5 * 2^23 trick, f = x - j in [-0.5, 0.5], a
    polynomial for 2^f, and j added to the float's exponent bits (the rounder's bits shifted by 23 leave exactly
    j). Clamped at -126 (no exponent underflow): below 2^-126 it returns tiny values instead of 0, which add
    nothing next to a row sum >= 1."""
    x = tl.maximum(x, -126.0)
    rounded = x + _ROUNDER
    f = x - (rounded - _ROUNDER)
    p = _C0 + f * (_C1 + f * (_C2 + f * _C3))
    return (p.to(tl.int32, bitcast=True) + (rounded.to(tl.int32, bitcast=True) << 23)).to(tl.float32, bitcast=True)


@triton.jit
def _exp2_split(x, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """2^x of a (BLOCK_M, BLOCK_N) tile, the even columns on the special-function unit (MUFU.EX2) and the odd ones
    on the FMA units (_exp2_fma): FlashAttention-4's answer to the exp unit being as slow as the tensor cores at
    D = 64 (16 exp2 vs 4,096 MMA flops per clock and SM on Hopper: a 128 x 64 score tile costs both 512 clocks).
    The columns are paired in each thread's registers in the wgmma layout, so the split and join move no data."""
    even, odd = tl.split(tl.reshape(x, [BLOCK_M, BLOCK_N // 2, 2]))
    return tl.reshape(tl.join(tl.math.exp2(even), _exp2_fma(odd)), [BLOCK_M, BLOCK_N])


@triton.jit
def _softmax_update(s, m_i, l_i, qk_scale, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    POLY_EXP2: tl.constexpr):
    """Online softmax (base 2): the tile's probabilities p, the factor alpha that rescales what was accumulated
    before, and the new running max and sum. POLY_EXP2: half of p from the FMA units (_exp2_split); the tile must
    have no masked (-inf) scores."""
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)  # finite: every tile holds at least one key < N
    if POLY_EXP2:
        p = _exp2_split(s * qk_scale - m_new[:, None], BLOCK_M, BLOCK_N)
    else:
        p = tl.math.exp2(s * qk_scale - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _accumulate(p, alpha, acc0, acc1, v_desc0, v_desc1, v_base, b, g, start_n, N, svn, svd,
                HEAD_DIM: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr, BLOCK_N: tl.constexpr,
                MASK_N: tl.constexpr, TMA: tl.constexpr, PRECISION: tl.constexpr):
    """acc * alpha + P V for one tile of values (P rounded to the input dtype for the MMA, as in FlashAttention)."""
    v0 = _key_rows(v_desc0, v_base, b, g, start_n, N, svn, svd, 0, HEAD_DIM, D0, BLOCK_N, MASK_N, TMA)
    p = p.to(v0.dtype)
    acc0 = _dot(p, v0, acc0 * alpha[:, None], PRECISION)
    if D1 > 0:
        v1 = _key_rows(v_desc1, v_base, b, g, start_n, N, svn, svd, D0, HEAD_DIM, D1, BLOCK_N, MASK_N, TMA)
        acc1 = _dot(p, v1, acc1 * alpha[:, None], PRECISION)
    return acc0, acc1


@triton.jit
def _attn_fwd_hopper_kernel(
    q_ptr, k_ptr, v_ptr,  # (B, Hq, N, D), (B, Hkv, N, D) x2, any strides (TMA: aligned heads, unit stride on D)
    o_ptr,  # (B, Hq, N, D) output, any strides (the launcher makes it (B, N, Hq, D)-contiguous)
    lse_ptr,  # (B * Hq, N) fp32: base-2 log-sum-exp of the scaled scores, for the backward
    N, HQ, qk_scale,
    sqb, sqh, sqn, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, son, sod,
    BH,  # B * Hq (the batch size is BH // HQ)
    BH_BUCKET,  # batch_bucket(BH): only an autotuning key
    GROUP: tl.constexpr,  # Hq / Hkv
    HEAD_DIM: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PACK: tl.constexpr,  # stack the GROUP query heads of one K/V head in the tile's rows (GQA packing)
    TMA: tl.constexpr,  # load K/V tiles through tensor descriptors (Hopper's TMA copy engine)
    OVERLAP: tl.constexpr,  # issue the next tile's Q K^T before this tile's P V (softmax under the MMA; more registers)
    POLY_EXP2: tl.constexpr,  # half of the full tiles' exp2 on the FMA units (bf16/fp16 only: 7.5e-5 relative error)
    PERSISTENT: tl.constexpr,  # one program per SM walks the tiles (grid-stride loop) instead of one per tile
    PRECISION: tl.constexpr,
):
    """Flat grid, tiles fastest (grid_triton.py): one tile of BLOCK_M query rows per program, or with PERSISTENT
    one program per SM that takes tiles program_id, program_id + programs, ... (no tail wave of short-lived
    programs, and the TMA descriptors are made once per program rather than once per tile)."""
    k_desc0, k_desc1, v_desc0, v_desc1 = _kv_descriptors(k_ptr, v_ptr, BH // HQ, N, HQ // GROUP, skb, skh, skn,
                                                         svb, svh, svn, HEAD_DIM, D0, D1, BLOCK_N, TMA)
    if PERSISTENT:
        tiles = tl.cdiv(N, BLOCK_M // GROUP if PACK else BLOCK_M) * (BH // GROUP if PACK else BH)
        for index in range(tl.program_id(0), tiles, tl.num_programs(0)):
            _attn_fwd_tile(index, q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, k_desc0, k_desc1, v_desc0, v_desc1, N, HQ,
                           qk_scale, sqb, sqh, sqn, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, son, sod,
                           GROUP, HEAD_DIM, D0, D1, BLOCK_M, BLOCK_N, PACK, TMA, OVERLAP, POLY_EXP2, PRECISION)
    else:
        _attn_fwd_tile(tl.program_id(0), q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, k_desc0, k_desc1, v_desc0, v_desc1,
                       N, HQ, qk_scale, sqb, sqh, sqn, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, son, sod,
                       GROUP, HEAD_DIM, D0, D1, BLOCK_M, BLOCK_N, PACK, TMA, OVERLAP, POLY_EXP2, PRECISION)


@triton.jit
def _attn_fwd_tile(
    index, q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, k_desc0, k_desc1, v_desc0, v_desc1, N, HQ, qk_scale,
    sqb, sqh, sqn, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, son, sod,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PACK: tl.constexpr, TMA: tl.constexpr, OVERLAP: tl.constexpr,
    POLY_EXP2: tl.constexpr, PRECISION: tl.constexpr,
):
    """Tile `index` (tiles fastest) of BLOCK_M query rows:
    PACK False: BLOCK_M tokens of one query head h (cdiv(N, BLOCK_M) * B * Hq tiles);
    PACK True:  BLOCK_M // GROUP tokens of each of the GROUP query heads that share K/V head g, stacked
                head-major in the rows (cdiv(N, BLOCK_M // GROUP) * B * Hkv tiles). Every K/V tile the
                program loads then serves all the heads of its group through one dot, instead of being loaded
                by GROUP programs. The launcher sets PACK only when GROUP > 1 divides BLOCK_M."""
    rows = tl.arange(0, BLOCK_M)
    if PACK:
        tl.static_assert(GROUP > 1 and BLOCK_M % GROUP == 0)
        TOKENS: tl.constexpr = BLOCK_M // GROUP
        tile, b, g = tile_coords(index, tl.cdiv(N, TOKENS), HQ // GROUP)
        h0 = g * GROUP  # first query head of the tile (int64)
        offs_m = tile * TOKENS + rows % TOKENS  # token of each row
        row_head = rows // TOKENS  # query head of each row, relative to h0
    else:
        tile, b, h0 = tile_coords(index, tl.cdiv(N, BLOCK_M), HQ)
        g = h0 // GROUP
        offs_m = tile * BLOCK_M + rows
        row_head = 0
    offs_d0 = tl.arange(0, D0)
    offs_d1 = D0 + tl.arange(0, D1 if D1 > 0 else 16)  # a dummy 16 when there is no second chunk
    mask_m = offs_m < N
    mask_d1 = offs_d1 < HEAD_DIM

    # Q is loaded once per tile and O stored once: plain pointer accesses (int64 base of head h0 of image b,
    # int32 offsets within the image). K and V are streamed: through TMA descriptors when asked for.
    q_rows = q_ptr + b * sqb + h0 * sqh + (row_head * sqh + offs_m * sqn)[:, None]
    q0 = tl.load(q_rows + offs_d0[None, :] * sqd, mask=mask_m[:, None], other=0.0)
    acc0 = tl.zeros([BLOCK_M, D0], dtype=tl.float32)
    if D1 > 0:
        q1 = tl.load(q_rows + offs_d1[None, :] * sqd, mask=mask_m[:, None] & mask_d1[None, :], other=0.0)
        acc1 = tl.zeros([BLOCK_M, D1], dtype=tl.float32)
    else:
        q1 = q0  # unused
        acc1 = acc0  # unused
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)

    k_base = k_ptr + b * skb + g * skh
    v_base = v_ptr + b * svb + g * svh

    # The full key tiles, then one masked tail tile. With OVERLAP the full tiles are software-pipelined by hand:
    # the scores of tile j + 1 are computed before the P V product of tile j, so that on Hopper the P V wgmma is
    # still running while the softmax of tile j + 1 is computed (FlashAttention-3's intra-warpgroup overlap;
    # bench/inspect_kernels.py counts the exp2s issued under a wgmma). It keeps two score tiles alive, so the
    # largest tiles use the plain order (softmax, then P V of the same tile), which Triton compiles to MMAs and
    # softmax that alternate.
    n_full = (N // BLOCK_N) * BLOCK_N
    if not OVERLAP:
        for start_n in range(0, n_full, BLOCK_N):
            s = _scores(q0, q1, k_desc0, k_desc1, k_base, b, g, start_n, N, skn, skd, HEAD_DIM, D0, D1, BLOCK_N, False,
                        TMA, PRECISION)
            p, alpha, m_i, l_i = _softmax_update(s, m_i, l_i, qk_scale, BLOCK_M, BLOCK_N, POLY_EXP2)
            acc0, acc1 = _accumulate(p, alpha, acc0, acc1, v_desc0, v_desc1, v_base, b, g, start_n, N, svn, svd,
                                     HEAD_DIM, D0, D1, BLOCK_N, False, TMA, PRECISION)
    elif n_full > 0:
        s = _scores(q0, q1, k_desc0, k_desc1, k_base, b, g, 0, N, skn, skd, HEAD_DIM, D0, D1, BLOCK_N, False, TMA,
                    PRECISION)
        for start_n in range(0, n_full - BLOCK_N, BLOCK_N):
            p, alpha, m_i, l_i = _softmax_update(s, m_i, l_i, qk_scale, BLOCK_M, BLOCK_N, POLY_EXP2)
            s = _scores(q0, q1, k_desc0, k_desc1, k_base, b, g, start_n + BLOCK_N, N, skn, skd, HEAD_DIM, D0, D1,
                        BLOCK_N, False, TMA, PRECISION)
            acc0, acc1 = _accumulate(p, alpha, acc0, acc1, v_desc0, v_desc1, v_base, b, g, start_n, N, svn, svd,
                                     HEAD_DIM, D0, D1, BLOCK_N, False, TMA, PRECISION)
        p, alpha, m_i, l_i = _softmax_update(s, m_i, l_i, qk_scale, BLOCK_M, BLOCK_N, POLY_EXP2)
        acc0, acc1 = _accumulate(p, alpha, acc0, acc1, v_desc0, v_desc1, v_base, b, g, n_full - BLOCK_N, N, svn, svd,
                                 HEAD_DIM, D0, D1, BLOCK_N, False, TMA, PRECISION)
    if n_full < N:
        s = _scores(q0, q1, k_desc0, k_desc1, k_base, b, g, n_full, N, skn, skd, HEAD_DIM, D0, D1, BLOCK_N, True, TMA,
                    PRECISION)
        p, alpha, m_i, l_i = _softmax_update(s, m_i, l_i, qk_scale, BLOCK_M, BLOCK_N, False)
        acc0, acc1 = _accumulate(p, alpha, acc0, acc1, v_desc0, v_desc1, v_base, b, g, n_full, N, svn, svd,
                                 HEAD_DIM, D0, D1, BLOCK_N, True, TMA, PRECISION)

    inv_l = 1.0 / l_i
    o_rows = o_ptr + b * sob + h0 * soh + (row_head * soh + offs_m * son)[:, None]
    o_dtype = o_ptr.dtype.element_ty
    tl.store(o_rows + offs_d0[None, :] * sod, (acc0 * inv_l[:, None]).to(o_dtype), mask=mask_m[:, None])
    if D1 > 0:
        tl.store(o_rows + offs_d1[None, :] * sod, (acc1 * inv_l[:, None]).to(o_dtype),
                 mask=mask_m[:, None] & mask_d1[None, :])
    lse_rows = lse_ptr + (b * HQ + h0) * N + row_head * N + offs_m
    tl.store(lse_rows, m_i + tl.math.log2(l_i), mask=mask_m)


# ----------------------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------------------


@triton.jit
def _query_rows(desc, image_base, h, start_m, N, sh, sn, sd, col0, HEAD_DIM: tl.constexpr, COLS: tl.constexpr,
                BLOCK_M: tl.constexpr, TMA: tl.constexpr):
    """Rows start_m .. start_m + BLOCK_M, columns col0 .. col0 + COLS of query-side head h (q or dO) of one image:
    (BLOCK_M, COLS), zero where row >= N or column >= HEAD_DIM. TMA: one load through the image's (N, Hq, D)
    descriptor (one descriptor serves every head the loop visits)."""
    if TMA:
        return tl.reshape(desc.load([start_m, h.to(tl.int32), col0]), [BLOCK_M, COLS])
    else:  # the base kernel's masked load of one head's rows
        return _load_rows(image_base + h * sh, start_m, N, sn, sd, ROWS=BLOCK_M, COL0=col0, COLS=COLS,
                          HEAD_DIM=HEAD_DIM, MASK_ROWS=True)


@triton.jit
def _query_descriptors(image_base, N, HQ, sh, sn, HEAD_DIM: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr,
                       BLOCK_M: tl.constexpr, TMA: tl.constexpr):
    """TMA: the (N, Hq, HEAD_DIM) descriptors of one image's q or dO for each column chunk; else the base pointer."""
    if TMA:
        d0 = tl.make_tensor_descriptor(image_base, shape=[N, HQ, HEAD_DIM], strides=[sn, sh, 1],
                                       block_shape=[BLOCK_M, 1, D0])
        if D1 > 0:
            d1 = tl.make_tensor_descriptor(image_base, shape=[N, HQ, HEAD_DIM], strides=[sn, sh, 1],
                                           block_shape=[BLOCK_M, 1, D1])
        else:
            d1 = d0  # unused
        return d0, d1
    else:
        return image_base, image_base


@triton.jit
def _query_chunks(desc0, desc1, image_base, h, start_m, N, sh, sn, sd, HEAD_DIM: tl.constexpr, D0: tl.constexpr,
                  D1: tl.constexpr, BLOCK_M: tl.constexpr, TMA: tl.constexpr):
    """Both column chunks of one query-side tile (_query_rows); the second is the first again when D1 == 0."""
    x0 = _query_rows(desc0, image_base, h, start_m, N, sh, sn, sd, 0, HEAD_DIM, D0, BLOCK_M, TMA)
    if D1 > 0:
        x1 = _query_rows(desc1, image_base, h, start_m, N, sh, sn, sd, D0, HEAD_DIM, D1, BLOCK_M, TMA)
    else:
        x1 = x0  # unused
    return x0, x1


@triton.jit
def _dkdv_scores(k0, k1, q_desc0, q_desc1, q_image, h, start_m, N, sqh, sqn, sqd,
                 HEAD_DIM: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr, BLOCK_M: tl.constexpr,
                 TMA: tl.constexpr, PRECISION: tl.constexpr):
    """S^T = K Q^T for one query tile of head h: (BLOCK_N, BLOCK_M) fp32, and the Q tile's chunks."""
    q0, q1 = _query_chunks(q_desc0, q_desc1, q_image, h, start_m, N, sqh, sqn, sqd, HEAD_DIM, D0, D1, BLOCK_M, TMA)
    qkT = _dot(k0, tl.trans(q0), None, PRECISION)
    if D1 > 0:
        qkT = _dot(k1, tl.trans(q1), qkT, PRECISION)
    return qkT, q0, q1


@triton.jit
def _dkdv_values(qkT, v0, v1, dv0, dv1, do_desc0, do_desc1, do_image, lse_ptr, delta_ptr, bh, h, start_m, N,
                 sgh, sgn, sgd, qk_scale, HEAD_DIM: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr,
                 BLOCK_M: tl.constexpr, TMA: tl.constexpr, PRECISION: tl.constexpr):
    """From S^T of one query tile: P^T = exp2(S^T * qk_scale - lse), dV += P^T dO, dP^T = V dO^T and
    dS^T = P^T * (dP^T - delta) (rounded to the input dtype for the dK MMA). Rows >= N get lse = +inf: P = 0."""
    offs_m = start_m + tl.arange(0, BLOCK_M)
    lse = tl.load(lse_ptr + bh * N + offs_m, mask=offs_m < N, other=float("inf"))
    delta = tl.load(delta_ptr + bh * N + offs_m, mask=offs_m < N, other=0.0)
    do0 = _query_rows(do_desc0, do_image, h, start_m, N, sgh, sgn, sgd, 0, HEAD_DIM, D0, BLOCK_M, TMA)
    pT = tl.math.exp2(qkT * qk_scale - lse[None, :])
    dv0 = _dot(pT.to(do0.dtype), do0, dv0, PRECISION)
    dpT = _dot(v0, tl.trans(do0), None, PRECISION)
    if D1 > 0:
        do1 = _query_rows(do_desc1, do_image, h, start_m, N, sgh, sgn, sgd, D0, HEAD_DIM, D1, BLOCK_M, TMA)
        dv1 = _dot(pT.to(do1.dtype), do1, dv1, PRECISION)
        dpT = _dot(v1, tl.trans(do1), dpT, PRECISION)
    dsT = (pT * (dpT - delta[None, :])).to(do0.dtype)
    return dv0, dv1, dsT


@triton.jit
def _dkdv_keys(dsT, q0, q1, dk0, dk1, D1: tl.constexpr, PRECISION: tl.constexpr):
    """dK += dS^T Q (the scale is applied at the end)."""
    dk0 = _dot(dsT, q0, dk0, PRECISION)
    if D1 > 0:
        dk1 = _dot(dsT, q1, dk1, PRECISION)
    return dk0, dk1


@triton.jit
def _attn_bwd_dkdv_hopper_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr,  # inputs, any strides (TMA: aligned q and dO heads, unit stride on D)
    dk_ptr, dv_ptr,  # (B, Hkv, N, D) outputs, any strides
    lse_ptr, delta_ptr,  # (B * Hq, N) fp32 from the forward and the delta kernel
    N, HQ, HKV, GROUP, scale, qk_scale,
    sqb, sqh, sqn, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sgb, sgh, sgn, sgd,
    sdkb, sdkh, sdkn, sdkd, sdvb, sdvh, sdvn, sdvd,
    BH_BUCKET,  # batch_bucket(B * Hkv): only an autotuning key
    HEAD_DIM: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    TMA: tl.constexpr,  # load the q and dO tiles through tensor descriptors
    OVERLAP: tl.constexpr,  # issue the next query tile's S^T before this tile's dK MMA (P^T under the MMA)
    PRECISION: tl.constexpr,
):
    """Flat grid of cdiv(N, BLOCK_N) * B * Hkv programs: BLOCK_N keys of one (b, g), summed over the GROUP
    query heads of g.

    Transposed formulation (rows = keys): pT = exp2(k q^T * qk_scale - lse), dV += pT dO,
    dpT = v dO^T, dsT = pT * (dpT - delta), dK += dsT q (times scale at the end). The loop visits the
    (query head, query tile) pairs of the group; with OVERLAP the next pair's S^T is issued before this pair's dK
    MMA, which is then in flight while the next P^T is computed (this pair's Q is loaded again for it).
    """
    tile, b, g = program_coords(tl.cdiv(N, BLOCK_N), HKV)
    start_n = tile * BLOCK_N
    # NOTE: the chunks in the order k0, v0, k1, v1 (the base file's _load_chunks of k, then of v, changes the
    # compiled code); each through its _load_rows.
    k_head = k_ptr + b * skb + g * skh
    v_head = v_ptr + b * svb + g * svh
    k0 = _load_rows(k_head, start_n, N, skn, skd, ROWS=BLOCK_N, COL0=0, COLS=D0, HEAD_DIM=HEAD_DIM, MASK_ROWS=True)
    v0 = _load_rows(v_head, start_n, N, svn, svd, ROWS=BLOCK_N, COL0=0, COLS=D0, HEAD_DIM=HEAD_DIM, MASK_ROWS=True)
    dk0 = tl.zeros([BLOCK_N, D0], dtype=tl.float32)
    dv0 = tl.zeros([BLOCK_N, D0], dtype=tl.float32)
    if D1 > 0:
        k1 = _load_rows(k_head, start_n, N, skn, skd, ROWS=BLOCK_N, COL0=D0, COLS=D1, HEAD_DIM=HEAD_DIM,
                        MASK_ROWS=True)
        v1 = _load_rows(v_head, start_n, N, svn, svd, ROWS=BLOCK_N, COL0=D0, COLS=D1, HEAD_DIM=HEAD_DIM,
                        MASK_ROWS=True)
        dk1 = tl.zeros([BLOCK_N, D1], dtype=tl.float32)
        dv1 = tl.zeros([BLOCK_N, D1], dtype=tl.float32)
    else:  # unused placeholders
        k1 = k0
        v1 = v0
        dk1 = dk0
        dv1 = dv0

    q_image = q_ptr + b * sqb
    do_image = do_ptr + b * sgb
    q_desc0, q_desc1 = _query_descriptors(q_image, N, HQ, sqh, sqn, HEAD_DIM, D0, D1, BLOCK_M, TMA)
    do_desc0, do_desc1 = _query_descriptors(do_image, N, HQ, sgh, sgn, HEAD_DIM, D0, D1, BLOCK_M, TMA)
    num_tiles = tl.cdiv(N, BLOCK_M)
    steps = GROUP * num_tiles  # (query head of the group, query tile) pairs
    if not OVERLAP:
        for i in range(0, steps):
            h = g * GROUP + i // num_tiles
            start_m = (i % num_tiles) * BLOCK_M
            qkT, q0, q1 = _dkdv_scores(k0, k1, q_desc0, q_desc1, q_image, h, start_m, N, sqh, sqn, sqd, HEAD_DIM,
                                       D0, D1, BLOCK_M, TMA, PRECISION)
            dv0, dv1, dsT = _dkdv_values(qkT, v0, v1, dv0, dv1, do_desc0, do_desc1, do_image, lse_ptr, delta_ptr,
                                         b * HQ + h, h, start_m, N, sgh, sgn, sgd, qk_scale, HEAD_DIM, D0, D1,
                                         BLOCK_M, TMA, PRECISION)
            dk0, dk1 = _dkdv_keys(dsT, q0, q1, dk0, dk1, D1, PRECISION)
    else:
        h = g * GROUP
        qkT, q0, q1 = _dkdv_scores(k0, k1, q_desc0, q_desc1, q_image, h, 0, N, sqh, sqn, sqd, HEAD_DIM, D0, D1,
                                   BLOCK_M, TMA, PRECISION)
        for i in range(0, steps - 1):
            h = g * GROUP + i // num_tiles
            start_m = (i % num_tiles) * BLOCK_M
            dv0, dv1, dsT = _dkdv_values(qkT, v0, v1, dv0, dv1, do_desc0, do_desc1, do_image, lse_ptr, delta_ptr,
                                         b * HQ + h, h, start_m, N, sgh, sgn, sgd, qk_scale, HEAD_DIM, D0, D1,
                                         BLOCK_M, TMA, PRECISION)
            next_h = g * GROUP + (i + 1) // num_tiles
            qkT, _, _ = _dkdv_scores(k0, k1, q_desc0, q_desc1, q_image, next_h, ((i + 1) % num_tiles) * BLOCK_M,
                                     N, sqh, sqn, sqd, HEAD_DIM, D0, D1, BLOCK_M, TMA, PRECISION)
            q0, q1 = _query_chunks(q_desc0, q_desc1, q_image, h, start_m, N, sqh, sqn, sqd, HEAD_DIM, D0, D1,
                                   BLOCK_M, TMA)
            dk0, dk1 = _dkdv_keys(dsT, q0, q1, dk0, dk1, D1, PRECISION)
        h = g * GROUP + (steps - 1) // num_tiles
        start_m = ((steps - 1) % num_tiles) * BLOCK_M
        dv0, dv1, dsT = _dkdv_values(qkT, v0, v1, dv0, dv1, do_desc0, do_desc1, do_image, lse_ptr, delta_ptr,
                                     b * HQ + h, h, start_m, N, sgh, sgn, sgd, qk_scale, HEAD_DIM, D0, D1,
                                     BLOCK_M, TMA, PRECISION)
        q0, q1 = _query_chunks(q_desc0, q_desc1, q_image, h, start_m, N, sqh, sqn, sqd, HEAD_DIM, D0, D1, BLOCK_M,
                               TMA)
        dk0, dk1 = _dkdv_keys(dsT, q0, q1, dk0, dk1, D1, PRECISION)

    # NOTE: stored chunk by chunk (dK and dV of chunk 0, then of chunk 1); the base file's _store_chunks order (all
    # of dK, then dV) changes the register allocation (5b, 32x64w4s4: 168 -> 255 registers).
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d0 = tl.arange(0, D0)
    offs_d1 = D0 + tl.arange(0, D1 if D1 > 0 else 16)
    mask_n = offs_n < N
    mask_d1 = offs_d1 < HEAD_DIM
    dk_rows = dk_ptr + b * sdkb + g * sdkh + offs_n[:, None] * sdkn
    dv_rows = dv_ptr + b * sdvb + g * sdvh + offs_n[:, None] * sdvn
    dk_dtype = dk_ptr.dtype.element_ty
    dv_dtype = dv_ptr.dtype.element_ty
    tl.store(dk_rows + offs_d0[None, :] * sdkd, (dk0 * scale).to(dk_dtype), mask=mask_n[:, None])
    tl.store(dv_rows + offs_d0[None, :] * sdvd, dv0.to(dv_dtype), mask=mask_n[:, None])
    if D1 > 0:
        tl.store(dk_rows + offs_d1[None, :] * sdkd, (dk1 * scale).to(dk_dtype),
                 mask=mask_n[:, None] & mask_d1[None, :])
        tl.store(dv_rows + offs_d1[None, :] * sdvd, dv1.to(dv_dtype), mask=mask_n[:, None] & mask_d1[None, :])


@triton.jit
def _dq_scores(q0, q1, do0, do1, k_desc0, k_desc1, v_desc0, v_desc1, k_base, v_base, b, g, start_n, N,
               skn, skd, svn, svd,
               HEAD_DIM: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr, BLOCK_N: tl.constexpr,
               MASK_N: tl.constexpr, TMA: tl.constexpr, PRECISION: tl.constexpr):
    """S = Q K^T and dP = dO V^T for one tile of keys: (BLOCK_M, BLOCK_N) fp32 each."""
    k0 = _key_rows(k_desc0, k_base, b, g, start_n, N, skn, skd, 0, HEAD_DIM, D0, BLOCK_N, MASK_N, TMA)
    v0 = _key_rows(v_desc0, v_base, b, g, start_n, N, svn, svd, 0, HEAD_DIM, D0, BLOCK_N, MASK_N, TMA)
    s = _dot(q0, tl.trans(k0), None, PRECISION)
    dp = _dot(do0, tl.trans(v0), None, PRECISION)
    if D1 > 0:
        k1 = _key_rows(k_desc1, k_base, b, g, start_n, N, skn, skd, D0, HEAD_DIM, D1, BLOCK_N, MASK_N, TMA)
        v1 = _key_rows(v_desc1, v_base, b, g, start_n, N, svn, svd, D0, HEAD_DIM, D1, BLOCK_N, MASK_N, TMA)
        s = _dot(q1, tl.trans(k1), s, PRECISION)
        dp = _dot(do1, tl.trans(v1), dp, PRECISION)
    return s, dp


@triton.jit
def _dq_grad_scores(s, dp, lse, delta, qk_scale, start_n, N, BLOCK_N: tl.constexpr, MASK_N: tl.constexpr):
    """dS = P * (dP - delta), P = exp2(S * qk_scale - lse) recomputed from the forward's log-sum-exp; keys >= N
    get P = 0 with MASK_N."""
    p = tl.math.exp2(s * qk_scale - lse[:, None])
    if MASK_N:
        p = tl.where((start_n + tl.arange(0, BLOCK_N) < N)[None, :], p, 0.0)
    return p * (dp - delta[:, None])


@triton.jit
def _dq_accumulate(ds, dq0, dq1, k_desc0, k_desc1, k_base, b, g, start_n, N, skn, skd,
                   HEAD_DIM: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr, BLOCK_N: tl.constexpr,
                   MASK_N: tl.constexpr, TMA: tl.constexpr, PRECISION: tl.constexpr):
    """dQ += dS K for one tile of keys (dS rounded to the input dtype for the MMA)."""
    k0 = _key_rows(k_desc0, k_base, b, g, start_n, N, skn, skd, 0, HEAD_DIM, D0, BLOCK_N, MASK_N, TMA)
    ds = ds.to(k0.dtype)
    dq0 = _dot(ds, k0, dq0, PRECISION)
    if D1 > 0:
        k1 = _key_rows(k_desc1, k_base, b, g, start_n, N, skn, skd, D0, HEAD_DIM, D1, BLOCK_N, MASK_N, TMA)
        dq1 = _dot(ds, k1, dq1, PRECISION)
    return dq0, dq1


@triton.jit
def _attn_bwd_dq_hopper_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr,  # inputs, any strides (TMA: aligned K/V heads, unit stride on D)
    dq_ptr,  # (B, Hq, N, D) output, any strides
    lse_ptr, delta_ptr,  # (B * Hq, N) fp32
    N, HQ, GROUP, scale, qk_scale,
    sqb, sqh, sqn, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sgb, sgh, sgn, sgd,
    sdqb, sdqh, sdqn, sdqd,
    BH,  # B * Hq (the batch size is BH // HQ)
    BH_BUCKET,  # batch_bucket(BH): only an autotuning key
    HEAD_DIM: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    TMA: tl.constexpr,  # load K/V tiles through tensor descriptors
    OVERLAP: tl.constexpr,  # issue the next tile's S and dP before this tile's dQ MMA (dS under the MMA)
    PRECISION: tl.constexpr,
):
    """Flat grid of cdiv(N, BLOCK_M) * B * Hq programs: dQ = scale * sum over key tiles of (P * (dP - delta)) K.
    The loop has the forward's two orders: plain (S, dP, dS, dQ += dS K for each tile) and OVERLAP, where tile
    j + 1's S and dP are issued before tile j's dQ MMA, which is then in flight while dS of tile j + 1 is computed
    (tile j's K is loaded again for it, from L2, rather than kept alive across the iteration)."""
    tile, b, h = program_coords(tl.cdiv(N, BLOCK_M), HQ)
    start_m = tile * BLOCK_M
    bh = b * HQ + h
    g = h // GROUP
    # NOTE: q and dO written out, not through the base file's _load_rows as k and v are in the dK/dV kernel: that
    # changes the register allocation of 5 of the 48 rows (bench/inspect_kernels.py; 0.4b TMA + overlap 206 -> 210).
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d0 = tl.arange(0, D0)
    offs_d1 = D0 + tl.arange(0, D1 if D1 > 0 else 16)
    mask_m = offs_m < N
    mask_d1 = offs_d1 < HEAD_DIM

    q_rows = q_ptr + b * sqb + h * sqh + offs_m[:, None] * sqn
    do_rows = do_ptr + b * sgb + h * sgh + offs_m[:, None] * sgn
    q0 = tl.load(q_rows + offs_d0[None, :] * sqd, mask=mask_m[:, None], other=0.0)
    do0 = tl.load(do_rows + offs_d0[None, :] * sgd, mask=mask_m[:, None], other=0.0)
    dq0 = tl.zeros([BLOCK_M, D0], dtype=tl.float32)
    if D1 > 0:
        q1 = tl.load(q_rows + offs_d1[None, :] * sqd, mask=mask_m[:, None] & mask_d1[None, :], other=0.0)
        do1 = tl.load(do_rows + offs_d1[None, :] * sgd, mask=mask_m[:, None] & mask_d1[None, :], other=0.0)
        dq1 = tl.zeros([BLOCK_M, D1], dtype=tl.float32)
    else:  # unused placeholders
        q1 = q0
        do1 = do0
        dq1 = dq0
    lse = tl.load(lse_ptr + bh * N + offs_m, mask=mask_m, other=float("inf"))
    delta = tl.load(delta_ptr + bh * N + offs_m, mask=mask_m, other=0.0)

    k_base = k_ptr + b * skb + g * skh
    v_base = v_ptr + b * svb + g * svh
    k_desc0, k_desc1, v_desc0, v_desc1 = _kv_descriptors(k_ptr, v_ptr, BH // HQ, N, HQ // GROUP, skb, skh, skn,
                                                         svb, svh, svn, HEAD_DIM, D0, D1, BLOCK_N, TMA)
    n_full = (N // BLOCK_N) * BLOCK_N
    if not OVERLAP:
        for start_n in range(0, n_full, BLOCK_N):
            s, dp = _dq_scores(q0, q1, do0, do1, k_desc0, k_desc1, v_desc0, v_desc1, k_base, v_base, b, g, start_n, N,
                               skn, skd, svn, svd, HEAD_DIM, D0, D1, BLOCK_N, False, TMA, PRECISION)
            ds = _dq_grad_scores(s, dp, lse, delta, qk_scale, start_n, N, BLOCK_N, False)
            dq0, dq1 = _dq_accumulate(ds, dq0, dq1, k_desc0, k_desc1, k_base, b, g, start_n, N, skn, skd, HEAD_DIM, D0,
                                      D1, BLOCK_N, False, TMA, PRECISION)
    elif n_full > 0:
        s, dp = _dq_scores(q0, q1, do0, do1, k_desc0, k_desc1, v_desc0, v_desc1, k_base, v_base, b, g, 0, N,
                           skn, skd, svn, svd, HEAD_DIM, D0, D1, BLOCK_N, False, TMA, PRECISION)
        for start_n in range(0, n_full - BLOCK_N, BLOCK_N):
            ds = _dq_grad_scores(s, dp, lse, delta, qk_scale, start_n, N, BLOCK_N, False)
            s, dp = _dq_scores(q0, q1, do0, do1, k_desc0, k_desc1, v_desc0, v_desc1, k_base, v_base, b, g,
                               start_n + BLOCK_N, N, skn, skd, svn, svd, HEAD_DIM, D0, D1, BLOCK_N, False, TMA,
                               PRECISION)
            dq0, dq1 = _dq_accumulate(ds, dq0, dq1, k_desc0, k_desc1, k_base, b, g, start_n, N, skn, skd, HEAD_DIM, D0,
                                      D1, BLOCK_N, False, TMA, PRECISION)
        ds = _dq_grad_scores(s, dp, lse, delta, qk_scale, n_full - BLOCK_N, N, BLOCK_N, False)
        dq0, dq1 = _dq_accumulate(ds, dq0, dq1, k_desc0, k_desc1, k_base, b, g, n_full - BLOCK_N, N, skn, skd, HEAD_DIM,
                                  D0, D1, BLOCK_N, False, TMA, PRECISION)
    if n_full < N:
        s, dp = _dq_scores(q0, q1, do0, do1, k_desc0, k_desc1, v_desc0, v_desc1, k_base, v_base, b, g, n_full, N,
                           skn, skd, svn, svd, HEAD_DIM, D0, D1, BLOCK_N, True, TMA, PRECISION)
        ds = _dq_grad_scores(s, dp, lse, delta, qk_scale, n_full, N, BLOCK_N, True)
        dq0, dq1 = _dq_accumulate(ds, dq0, dq1, k_desc0, k_desc1, k_base, b, g, n_full, N, skn, skd, HEAD_DIM, D0, D1,
                                  BLOCK_N, True, TMA, PRECISION)

    _store_chunks(dq_ptr + b * sdqb + h * sdqh, start_m, N, sdqn, sdqd, dq0 * scale, dq1 * scale, ROWS=BLOCK_M,
                  HEAD_DIM=HEAD_DIM, D0=D0, D1=D1)


# ----------------------------------------------------------------------------------------------------
# Configurations: autotuned on CUDA, fixed (with the flags from `blocks`) otherwise
# ----------------------------------------------------------------------------------------------------


def pack_heads(block_m: int, pack: bool, group: int) -> int:
    """Query heads stacked in one forward tile (GQA packing): GROUP when packing is asked for and GROUP > 1
    divides the tile's rows, else 1. The one rule for the launch grid and the kernel's PACK."""
    return group if pack and group > 1 and block_m % group == 0 else 1


# The tensors each kernel streams through TMA descriptors when its TMA flag is on (its argument names).
_TMA_OPERANDS = {"fwd": ("k_ptr", "v_ptr"), "dq": ("k_ptr", "v_ptr"), "dkdv": ("q_ptr", "do_ptr")}


def _prune_packing(configs, named_args, **kwargs):
    """Autotuning: drop the packed forward configurations that cannot pack (MHA, or GROUP not dividing BLOCK_M);
    their unpacked twins stay. (GROUP is in the autotuning key, so the pruning is redone for each GROUP.)"""
    group = kwargs.get("GROUP", named_args.get("GROUP"))
    return [c for c in configs if not c.kwargs.get("PACK") or pack_heads(c.kwargs["BLOCK_M"], True, group) > 1]


def tma_usable(*tensors: torch.Tensor) -> bool:
    """True when tiles can be loaded through TMA tensor descriptors: a Triton with `make_tensor_descriptor` (3.4+),
    a GPU with the TMA engine (the CPU interpreter emulates it), and tensors whose heads start on 16-byte
    boundaries with a unit stride on D and no broadcast (zero) strides."""
    if not hasattr(tl, "make_tensor_descriptor"):
        return False
    if base.compiled_for_gpu(tensors[0]) and not _has_tma_engine(tensors[0]):
        return False
    return all(heads_aligned(t) and t.data_ptr() % 16 == 0 and min(t.stride()[:3]) > 0 for t in tensors)


def _has_tma_engine(t: torch.Tensor) -> bool:
    """An NVIDIA Hopper GPU, compute capability 9.0 exactly: the TMA configurations are compiled and checked for
    sm_90a only (ROCm's MI300 reports 9.4 through the same call). bench/inspect_kernels.py overrides this."""
    return torch.version.hip is None and tuple(torch.cuda.get_device_capability(t.device)) == (9, 0)


def _ensure_allocator():
    """Descriptors made inside a kernel live in a per-launch scratch buffer that Triton asks an allocator for.
    Install one backed by torch's caching allocator, unless the user installed their own."""
    from triton.runtime import _allocation

    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_torch_scratch)


# The device of the launch in progress in this thread (_launch sets it): Triton's allocator is told no device.
_SCRATCH = threading.local()


def _torch_scratch(size: int, alignment: int, stream):
    """Scratch on the launch's own device (a bare "cuda" would be the current device, cuda:0 unless set)."""
    device = getattr(_SCRATCH, "device", None) or torch.device("cuda", torch.cuda.current_device())
    return torch.empty(size, dtype=torch.int8, device=device)


# Why each configuration is here (registers, spills, what it trades): docs/kernels.md, "The Hopper variants".
def _fwd_configs(shapes, pack=False, tma=False, overlap=False, poly_exp2=False, persistent=False, maxnreg=None):
    return tile_configs(shapes, maxnreg, PACK=pack, TMA=tma, OVERLAP=overlap, POLY_EXP2=poly_exp2,
                        PERSISTENT=persistent)


_FWD_CONFIGS = (
    _fwd_configs([(128, 64, 8, 3), (64, 64, 4, 4)], overlap=True)
    + _fwd_configs([(128, 64, 8, 3), (128, 128, 8, 3)])
    + _fwd_configs([(128, 64, 8, 3)], maxnreg=128)
    + _fwd_configs([(128, 64, 8, 3)], pack=True, overlap=True)
    + _fwd_configs([(256, 64, 8, 2)], pack=True)
    + _fwd_configs([(128, 64, 8, 3), (128, 128, 8, 2)], tma=True, overlap=True)
    + _fwd_configs([(128, 64, 8, 3)], tma=True, overlap=True, persistent=True)
    + _fwd_configs([(256, 64, 8, 2)], pack=True, tma=True)
    + _fwd_configs([(128, 64, 8, 3)], overlap=True, poly_exp2=True)
    + _fwd_configs([(128, 64, 8, 3)], tma=True, overlap=True, poly_exp2=True))


def _bwd_configs(shapes, tma=False, overlap=False):
    return tile_configs(shapes, TMA=tma, OVERLAP=overlap)


_DKDV_CONFIGS = (_bwd_configs([(64, 128, 8, 3), (32, 128, 8, 3), (64, 64, 4, 3), (32, 64, 4, 4)])
                 + _bwd_configs([(32, 128, 8, 3)], overlap=True)
                 + _bwd_configs([(32, 128, 8, 3), (64, 128, 8, 3)], tma=True))
_DQ_CONFIGS = (_bwd_configs([(128, 64, 8, 3), (128, 32, 8, 3), (64, 64, 4, 3)])
               + _bwd_configs([(128, 64, 8, 3), (64, 64, 4, 3)], overlap=True)
               + _bwd_configs([(128, 64, 8, 3)], tma=True, overlap=True))
# fp32 operands (3xTF32 dots): smaller tiles, two stages (these still spill a little at D = 80).
_FWD_CONFIGS_FP32 = _fwd_configs([(128, 32, 8, 2), (64, 32, 4, 2)]) + _fwd_configs([(128, 32, 8, 2)], pack=True)
_DKDV_CONFIGS_FP32 = _bwd_configs([(16, 64, 4, 2), (32, 64, 8, 2)])
_DQ_CONFIGS_FP32 = _bwd_configs([(64, 16, 4, 2), (64, 32, 8, 2)])


def _autotuned(kernel, configs, tma: bool):
    """The autotuned launcher over `configs`, or over those without TMA when `tma` is False. Two launchers per
    kernel, chosen at every launch by tma_usable: alignment is not in the autotuning key, so one launcher's cached
    TMA choice would otherwise be reused for tensors that TMA cannot read (a view 4 bytes off)."""
    configs = [c for c in configs if tma or not c.kwargs.get("TMA")]
    return triton.autotune(configs, key=AUTOTUNE_KEY, prune_configs_by={"early_config_prune": _prune_packing})(kernel)


_KERNELS = {"fwd": _attn_fwd_hopper_kernel, "dkdv": _attn_bwd_dkdv_hopper_kernel, "dq": _attn_bwd_dq_hopper_kernel}
_CONFIGS = {  # (kernel, operands are fp32) -> configurations
    ("fwd", False): _FWD_CONFIGS, ("dkdv", False): _DKDV_CONFIGS, ("dq", False): _DQ_CONFIGS,
    ("fwd", True): _FWD_CONFIGS_FP32, ("dkdv", True): _DKDV_CONFIGS_FP32, ("dq", True): _DQ_CONFIGS_FP32,
}
_TUNED = {  # (kernel, operands are fp32, TMA usable) -> autotuned launcher
    (name, fp32, tma): _autotuned(_KERNELS[name], configs, tma)
    for (name, fp32), configs in _CONFIGS.items() for tma in (False, True)
}
drop_excluded(_TUNED, excluded_configs())


# The variant flags a kernel may take (the constexprs it declares), and their values when the tiles are fixed and
# the flag is not given.
_FLAG_DEFAULTS = {"PACK": False, "TMA": False, "OVERLAP": True, "POLY_EXP2": False, "PERSISTENT": False}


def _launch(kernel, name, grid, args, consts, blocks, group=None):
    """Run the autotuned `name` kernel on CUDA unless `blocks` (or base.PINNED_BLOCKS) fixes the tiles. With fixed
    tiles the variant flags the kernel declares come from `blocks` (_FLAG_DEFAULTS otherwise): `group` (the
    forward's GROUP) resolves PACK with pack_heads; TMA must be usable for the tensors the kernel streams."""
    blocks = blocks if blocks is not None else base.PINNED_BLOCKS
    streamed = [args[kernel.arg_names.index(n)] for n in _TMA_OPERANDS[name]]
    tma = tma_usable(*streamed)
    on_gpu = base.compiled_for_gpu(args[0])
    if tma and on_gpu:
        _ensure_allocator()
        _SCRATCH.device = args[0].device
    if blocks is None and on_gpu:
        _TUNED[name, args[0].dtype == torch.float32, tma][grid](*args, **consts)
        return
    blocks = blocks or base.INTERPRET_BLOCKS
    tiles = {"BLOCK_M": blocks["BLOCK_M"], "BLOCK_N": blocks["BLOCK_N"]}
    tiles.update({flag: bool(blocks.get(flag, default)) for flag, default in _FLAG_DEFAULTS.items()
                  if flag in kernel.arg_names})
    if tiles.get("PACK"):
        tiles["PACK"] = pack_heads(tiles["BLOCK_M"], True, group) > 1
    if tiles.get("POLY_EXP2") and args[0].dtype == torch.float32:
        raise ValueError("blocks['POLY_EXP2'] is for bf16/fp16 inputs (its exp2 is 7.5e-5 off; fp32 keeps MUFU)")
    if tiles.get("TMA") and not tma:
        raise ValueError(f"blocks['TMA'] is set but {' and '.join(_TMA_OPERANDS[name])} cannot be read through TMA "
                         "descriptors here (needs triton >= 3.4, an NVIDIA sm_90 GPU, 16-byte-aligned heads)")
    kernel[grid(tiles)](*args, **consts, **tiles, **launch_options(blocks))


# ----------------------------------------------------------------------------------------------------
# Launchers (the same signatures as attention_triton.py's)
# ----------------------------------------------------------------------------------------------------


def _fwd_grid(meta, N, B, HQ, group, num_sms):
    """cdiv(N, tokens per tile) * B * (Hq / heads per tile) programs (a packed tile holds `group` heads); with
    PERSISTENT at most one per SM, each walking the tiles."""
    heads = group if meta.get("PACK") else 1
    grid = flat_grid(triton.cdiv(N, meta["BLOCK_M"] // heads), B * HQ // heads)
    return (min(grid[0], num_sms),) if meta.get("PERSISTENT") else grid


def num_sms(t: torch.Tensor) -> int:
    """The persistent grid's size: the GPU's SM count; 3 in the interpreter, so that the tests' programs each walk
    several tiles (bench/inspect_kernels.py sets 132, an H100/H200)."""
    return torch.cuda.get_device_properties(t.device).multi_processor_count if base.compiled_for_gpu(t) else 3


@launched_on_device
def attention_fwd(q, k, v, scale: float | None = None, blocks: dict | None = None, out=None):
    """attention_triton.attention_fwd with the variants: `blocks` may also set PACK, TMA, OVERLAP, POLY_EXP2,
    PERSISTENT (and maxnreg)."""
    check_attention_inputs(q, k, v)
    q, k, v = aligned_heads(q), aligned_heads(k), aligned_heads(v)  # 5b: a copy of the unaligned ones
    B, HQ, N, D = q.shape
    scale = D ** -0.5 if scale is None else scale
    D0, D1 = head_dim_chunks(D)
    o = check_out((out,), q)[0] if out is not None else empty_bnhd(q)
    lse = torch.empty(B * HQ, N, dtype=torch.float32, device=q.device)
    group = HQ // k.shape[1]
    args = (q, k, v, o, lse, N, HQ, scale * LOG2E, *q.stride(), *k.stride(), *v.stride(), *o.stride(), B * HQ,
            batch_bucket(B * HQ))
    consts = dict(GROUP=group, HEAD_DIM=D, D0=D0, D1=D1, PRECISION=dot_precision(q))
    check_image_elements(q, k, v, o)
    sms = num_sms(q)
    _launch(_attn_fwd_hopper_kernel, "fwd", lambda meta: _fwd_grid(meta, N, B, HQ, group, sms), args, consts, blocks,
            group)
    return o, lse


@launched_on_device
def attention_bwd(q, k, v, o, lse, do, scale: float | None = None, blocks: dict | None = None, out=None):
    """attention_triton.attention_bwd with the variants: `blocks` may also set TMA and OVERLAP."""
    q, k, v, o, do = (aligned_heads(t) for t in (q, k, v, o, do))  # 5b: copies of the unaligned ones
    B, HQ, N, D = q.shape
    HKV = k.shape[1]
    scale = D ** -0.5 if scale is None else scale
    D0, D1 = head_dim_chunks(D)
    check_image_elements(q, k, v, o, do)
    delta = attention_delta(o, do)
    dq, dk, dv = check_out(out, q, k, v) if out is not None else (empty_bnhd(q), empty_bnhd(k), empty_bnhd(v))
    consts = dict(HEAD_DIM=D, D0=D0, D1=D1, PRECISION=dot_precision(q))
    args = (q, k, v, do, dk, dv, lse, delta, N, HQ, HKV, HQ // HKV, scale, scale * LOG2E,
            *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dk.stride(), *dv.stride(), batch_bucket(B * HKV))
    _launch(_attn_bwd_dkdv_hopper_kernel, "dkdv", lambda meta: flat_grid(triton.cdiv(N, meta["BLOCK_N"]), B * HKV),
            args, consts, blocks)
    args = (q, k, v, do, dq, lse, delta, N, HQ, HQ // HKV, scale, scale * LOG2E,
            *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dq.stride(), B * HQ, batch_bucket(B * HQ))
    _launch(_attn_bwd_dq_hopper_kernel, "dq", lambda meta: flat_grid(triton.cdiv(N, meta["BLOCK_M"]), B * HQ), args,
            consts, blocks)
    return dq, dk, dv


def attention_triton(q, k, v, scale: float | None = None):
    """The variants' `_attention_triton` hook (SAPIENS2_KERNELS=fastest): differentiable in q, k and v."""
    return FlashAttention.apply(q, k, v, scale, attention_fwd, attention_bwd)
