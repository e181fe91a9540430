"""Triton flash attention (FlashAttention-2, non-causal, GQA), forward and backward.

The definition is `attention_reference`: o[b, h] = softmax(q[b, h] @ k[b, g]^T * scale) @ v[b, g], g = h // (Hq / Hkv).

Forward: one program owns BLOCK_M query rows of one (b, h) and walks the keys and values of head g in BLOCK_N
tiles with the online softmax (base 2): a running max m, a running sum l and an fp32 accumulator, rescaled by
alpha = 2^(m_old - m_new) when the max grows. It writes o = acc / l and lse = m + log2(l) for the backward.
Backward (no atomics, deterministic): delta = rowsum(dO * O); a dK/dV program per BLOCK_N keys of one (b, g)
that loops over the query heads of its group (GQA's sum over the group stays in registers); a dQ program per
BLOCK_M queries that loops over the keys. P is recomputed from q, k and the saved lse.

    * GQA: K/V head g is read in place for its query heads; K/V are never repeated in memory.
    * Ragged N: the full key tiles load without masks; one masked tail tile follows (keys >= N score -inf).
    * Head dims that are not a power of two are not padded to 128: D = D0 + D1 with D0 the largest power of
      two <= D and D1 >= 16 (80 = 64 + 16, 76 = 64 + 12 padded to 16), one tl.dot per chunk.
    * Precision: fp32 accumulation; P and dS rounded to the input dtype for their MMA, as in FlashAttention.
    * Layout: o is (B, N, Hq, D)-contiguous memory viewed as (B, Hq, N, D): merging the heads is free.

Limits: D in [16, 256]; q, k, v of one dtype among fp16, bf16, fp32; any strides; Hq % Hkv == 0.
Block sizes: autotuned on CUDA, 16 x 16 in the CPU interpreter. The Hopper-only variants (TMA, persistent grid,
polynomial exp2, overlapped loops, GQA packing) are opt-in, in attention_triton_hopper.py (docs/kernels.md).
"""

import torch
import triton
import triton.language as tl

from . import dispatch
from .attention import attention_reference
from .dispatch import launched_on_device
from .grid_triton import (aligned_heads, batch_bucket, check_attention_inputs, check_image_elements, check_out,
                          drop_excluded, empty_bnhd, excluded_configs, flat_grid, launch_options,
                          program_coords, tile_configs)

LOG2E = 1.4426950408889634  # softmax(x) = 2^(x * log2(e)) / sum: exp2 is the hardware's exponential

# ---- Tiles: loads, stores and dots over the two head-dim chunks ---------------------------------------------


@triton.jit
def _dot(a, b, acc, PRECISION: tl.constexpr):
    """acc + a @ b in fp32 (acc None: a @ b). "ieee" (the CPU interpreter, which would multiply bf16 as raw integers)
    widens the operands to fp32 first: exact products; otherwise the tensor cores take them as they are."""
    if PRECISION == "ieee":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def _load_rows(head_ptr, row0, n_rows, stride_row, stride_col, ROWS: tl.constexpr, COL0: tl.constexpr,
               COLS: tl.constexpr, HEAD_DIM: tl.constexpr, MASK_ROWS: tl.constexpr):
    """Rows row0 .. row0 + ROWS, columns COL0 .. COL0 + COLS of one head: zero past n_rows and past HEAD_DIM.
    Masks only where a tile can be ragged, so the full tiles stay plain (vectorized, pipelined) loads. The columns are
    masked only in a chunk that runs past the head: inside it, cols < 76 is true but Triton cannot prove it, and
    would narrow the loads (no 128-bit loads at head dim 76)."""
    rows = row0 + tl.arange(0, ROWS)
    cols = COL0 + tl.arange(0, COLS)
    ptrs = head_ptr + rows[:, None] * stride_row + cols[None, :] * stride_col
    if MASK_ROWS and COL0 + COLS > HEAD_DIM:
        return tl.load(ptrs, mask=(rows < n_rows)[:, None] & (cols < HEAD_DIM)[None, :], other=0.0)
    elif MASK_ROWS:
        return tl.load(ptrs, mask=(rows < n_rows)[:, None], other=0.0)
    elif COL0 + COLS > HEAD_DIM:
        return tl.load(ptrs, mask=(cols < HEAD_DIM)[None, :], other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def _load_chunks(head_ptr, row0, n_rows, stride_row, stride_col, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
                 D0: tl.constexpr, D1: tl.constexpr, MASK_ROWS: tl.constexpr):
    """A (ROWS, HEAD_DIM) tile as its column chunks (ROWS, D0) and (ROWS, D1); with D1 == 0 the second is unused."""
    x0 = _load_rows(head_ptr, row0, n_rows, stride_row, stride_col, ROWS=ROWS, COL0=0, COLS=D0, HEAD_DIM=HEAD_DIM,
                    MASK_ROWS=MASK_ROWS)
    x1 = x0
    if D1 > 0:
        x1 = _load_rows(head_ptr, row0, n_rows, stride_row, stride_col, ROWS=ROWS, COL0=D0, COLS=D1,
                        HEAD_DIM=HEAD_DIM, MASK_ROWS=MASK_ROWS)
    return x0, x1


@triton.jit
def _store_chunks(head_ptr, row0, n_rows, stride_row, stride_col, x0, x1, ROWS: tl.constexpr,
                  HEAD_DIM: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr):
    """Store rows row0 .. row0 + ROWS (those < n_rows) of both column chunks, in the output's dtype."""
    rows = row0 + tl.arange(0, ROWS)
    row_ptrs = head_ptr + rows[:, None] * stride_row
    cols0, cols1 = tl.arange(0, D0), D0 + tl.arange(0, D1 if D1 > 0 else 16)
    tl.store(row_ptrs + cols0[None, :] * stride_col, x0.to(head_ptr.dtype.element_ty), mask=(rows < n_rows)[:, None])
    if D1 > 0:
        tl.store(row_ptrs + cols1[None, :] * stride_col, x1.to(head_ptr.dtype.element_ty),
                 mask=(rows < n_rows)[:, None] & (cols1 < HEAD_DIM)[None, :])


@triton.jit
def _dot_t(a0, a1, b0, b1, D1: tl.constexpr, PRECISION: tl.constexpr):
    """a @ b^T over both chunks (fp32): a0 @ b0^T + a1 @ b1^T."""
    c = _dot(a0, tl.trans(b0), None, PRECISION=PRECISION)
    if D1 > 0:
        c = _dot(a1, tl.trans(b1), c, PRECISION=PRECISION)
    return c


# ---- Forward -------------------------------------------------------------------------------------------------


@triton.jit
def _fwd_key_tile(q0, q1, acc0, acc1, m_i, l_i, k_head, v_head, start_n, N, skn, skd, svn, svd, qk_scale,
                  HEAD_DIM: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr, BLOCK_N: tl.constexpr,
                  MASK_N: tl.constexpr, PRECISION: tl.constexpr):
    """One step of the online softmax: keys start_n .. start_n + BLOCK_N into (acc, m, l)."""
    k0, k1 = _load_chunks(k_head, start_n, N, skn, skd, ROWS=BLOCK_N, HEAD_DIM=HEAD_DIM, D0=D0, D1=D1, MASK_ROWS=MASK_N)
    s = _dot_t(q0, q1, k0, k1, D1=D1, PRECISION=PRECISION)  # (BLOCK_M, BLOCK_N)
    if MASK_N:
        s = tl.where((start_n + tl.arange(0, BLOCK_N) < N)[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)  # finite: every tile holds at least one key < N
    p = tl.math.exp2(s * qk_scale - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)  # rescales what was accumulated under the old max
    l_i = l_i * alpha + tl.sum(p, 1)
    v0, v1 = _load_chunks(v_head, start_n, N, svn, svd, ROWS=BLOCK_N, HEAD_DIM=HEAD_DIM, D0=D0, D1=D1, MASK_ROWS=MASK_N)
    p = p.to(v0.dtype)
    acc0 = _dot(p, v0, acc0 * alpha[:, None], PRECISION=PRECISION)
    if D1 > 0:
        acc1 = _dot(p, v1, acc1 * alpha[:, None], PRECISION=PRECISION)
    return acc0, acc1, m_new, l_i


@triton.jit
def _attn_fwd_kernel(
    q_ptr, k_ptr, v_ptr,  # (B, Hq, N, D), (B, Hkv, N, D) x2, any strides
    o_ptr,  # (B, Hq, N, D) output
    lse_ptr,  # (B * Hq, N) fp32 output: base-2 log-sum-exp of the scaled scores, for the backward
    N, HQ, qk_scale,  # qk_scale = scale * log2(e)
    sqb, sqh, sqn, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, son, sod,
    BH_BUCKET,  # batch_bucket(B * Hq): only an autotuning key
    GROUP: tl.constexpr,  # Hq / Hkv
    HEAD_DIM: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Flat grid of cdiv(N, BLOCK_M) * B * Hq programs, tiles fastest (grid_triton.py)."""
    tile, b, h = program_coords(tl.cdiv(N, BLOCK_M), HQ)
    g = h // GROUP  # the K/V head serving query head h
    start_m = tile * BLOCK_M
    q0, q1 = _load_chunks(q_ptr + b * sqb + h * sqh, start_m, N, sqn, sqd, ROWS=BLOCK_M, HEAD_DIM=HEAD_DIM, D0=D0,
                          D1=D1, MASK_ROWS=True)
    acc0 = tl.zeros([BLOCK_M, D0], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_M, D1 if D1 > 0 else 16], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    k_head = k_ptr + b * skb + g * skh
    v_head = v_ptr + b * svb + g * svh

    n_full = (N // BLOCK_N) * BLOCK_N
    for start_n in range(0, n_full, BLOCK_N):
        acc0, acc1, m_i, l_i = _fwd_key_tile(q0, q1, acc0, acc1, m_i, l_i, k_head, v_head, start_n, N, skn, skd,
                                             svn, svd, qk_scale, HEAD_DIM=HEAD_DIM, D0=D0, D1=D1, BLOCK_N=BLOCK_N,
                                             MASK_N=False, PRECISION=PRECISION)
    if n_full < N:  # the ragged tail
        acc0, acc1, m_i, l_i = _fwd_key_tile(q0, q1, acc0, acc1, m_i, l_i, k_head, v_head, n_full, N, skn, skd,
                                             svn, svd, qk_scale, HEAD_DIM=HEAD_DIM, D0=D0, D1=D1, BLOCK_N=BLOCK_N,
                                             MASK_N=True, PRECISION=PRECISION)

    inv_l = 1.0 / l_i
    _store_chunks(o_ptr + b * sob + h * soh, start_m, N, son, sod, acc0 * inv_l[:, None], acc1 * inv_l[:, None],
                  ROWS=BLOCK_M, HEAD_DIM=HEAD_DIM, D0=D0, D1=D1)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    tl.store(lse_ptr + (b * HQ + h) * N + offs_m, m_i + tl.math.log2(l_i), mask=offs_m < N)


# ---- Backward ------------------------------------------------------------------------------------------------


@triton.jit
def _attn_bwd_delta_kernel(
    o_ptr, do_ptr,  # (B, Hq, N, D), any strides
    delta_ptr,  # (B * Hq, N) fp32 output: rowsum(dO * O)
    N, HQ, sob, soh, son, sod, sgb, sgh, sgn, sgd,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    tile, b, h = program_coords(tl.cdiv(N, BLOCK_M), HQ)
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m < N)[:, None] & (offs_d < HEAD_DIM)[None, :]
    o = tl.load(o_ptr + b * sob + h * soh + offs_m[:, None] * son + offs_d[None, :] * sod, mask=mask, other=0.0)
    do = tl.load(do_ptr + b * sgb + h * sgh + offs_m[:, None] * sgn + offs_d[None, :] * sgd, mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(delta_ptr + (b * HQ + h) * N + offs_m, delta, mask=offs_m < N)


@triton.jit
def _attn_bwd_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr,  # inputs, any strides
    dk_ptr, dv_ptr,  # (B, Hkv, N, D) outputs
    lse_ptr, delta_ptr,  # (B * Hq, N) fp32, from the forward and the delta kernel
    N, HQ, HKV, scale, qk_scale,
    sqb, sqh, sqn, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sgb, sgh, sgn, sgd,
    sdkb, sdkh, sdkn, sdkd, sdvb, sdvh, sdvn, sdvd,
    BH_BUCKET,  # batch_bucket(B * Hkv): only an autotuning key
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """cdiv(N, BLOCK_N) * B * Hkv programs: BLOCK_N keys of one (b, g), summed over the GROUP query heads of g.
    Transposed (rows = keys): P^T = 2^(K Q^T * qk_scale - lse), dV += P^T dO, dP^T = V dO^T,
    dS^T = P^T * (dP^T - delta), dK += dS^T Q (times scale at the end)."""
    tile, b, g = program_coords(tl.cdiv(N, BLOCK_N), HKV)
    start_n = tile * BLOCK_N
    k0, k1 = _load_chunks(k_ptr + b * skb + g * skh, start_n, N, skn, skd, ROWS=BLOCK_N, HEAD_DIM=HEAD_DIM, D0=D0,
                          D1=D1, MASK_ROWS=True)
    v0, v1 = _load_chunks(v_ptr + b * svb + g * svh, start_n, N, svn, svd, ROWS=BLOCK_N, HEAD_DIM=HEAD_DIM, D0=D0,
                          D1=D1, MASK_ROWS=True)
    dk0, dv0 = tl.zeros([BLOCK_N, D0], dtype=tl.float32), tl.zeros([BLOCK_N, D0], dtype=tl.float32)
    D1_COLS: tl.constexpr = D1 if D1 > 0 else 16  # a dummy chunk when D1 == 0, never used
    dk1, dv1 = tl.zeros([BLOCK_N, D1_COLS], dtype=tl.float32), tl.zeros([BLOCK_N, D1_COLS], dtype=tl.float32)

    num_tiles = tl.cdiv(N, BLOCK_M)
    for step in range(0, GROUP * num_tiles):  # (query head of group g, query tile): one loop, one pipeline
        h = g * GROUP + step // num_tiles
        start_m = (step % num_tiles) * BLOCK_M
        q0, q1 = _load_chunks(q_ptr + b * sqb + h * sqh, start_m, N, sqn, sqd, ROWS=BLOCK_M, HEAD_DIM=HEAD_DIM, D0=D0,
                              D1=D1, MASK_ROWS=True)
        do0, do1 = _load_chunks(do_ptr + b * sgb + h * sgh, start_m, N, sgn, sgd, ROWS=BLOCK_M, HEAD_DIM=HEAD_DIM,
                                D0=D0, D1=D1, MASK_ROWS=True)
        offs_m = start_m + tl.arange(0, BLOCK_M)
        lse = tl.load(lse_ptr + (b * HQ + h) * N + offs_m, mask=offs_m < N, other=float("inf"))  # rows >= N: P = 0
        delta = tl.load(delta_ptr + (b * HQ + h) * N + offs_m, mask=offs_m < N, other=0.0)
        qk_t = _dot_t(k0, k1, q0, q1, D1=D1, PRECISION=PRECISION)
        p_t = tl.math.exp2(qk_t * qk_scale - lse[None, :])  # (BLOCK_N, BLOCK_M)
        dv0 = _dot(p_t.to(do0.dtype), do0, dv0, PRECISION=PRECISION)
        dp_t = _dot(v0, tl.trans(do0), None, PRECISION=PRECISION)
        if D1 > 0:
            dv1 = _dot(p_t.to(do1.dtype), do1, dv1, PRECISION=PRECISION)
            dp_t = _dot(v1, tl.trans(do1), dp_t, PRECISION=PRECISION)
        ds_t = (p_t * (dp_t - delta[None, :])).to(q0.dtype)
        dk0 = _dot(ds_t, q0, dk0, PRECISION=PRECISION)
        if D1 > 0:
            dk1 = _dot(ds_t, q1, dk1, PRECISION=PRECISION)

    _store_chunks(dk_ptr + b * sdkb + g * sdkh, start_n, N, sdkn, sdkd, dk0 * scale, dk1 * scale, ROWS=BLOCK_N,
                  HEAD_DIM=HEAD_DIM, D0=D0, D1=D1)
    _store_chunks(dv_ptr + b * sdvb + g * sdvh, start_n, N, sdvn, sdvd, dv0, dv1, ROWS=BLOCK_N, HEAD_DIM=HEAD_DIM,
                  D0=D0, D1=D1)


@triton.jit
def _dq_key_tile(q0, q1, do0, do1, dq0, dq1, lse, delta, k_head, v_head, start_n, N, skn, skd, svn, svd, qk_scale,
                 HEAD_DIM: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr, BLOCK_N: tl.constexpr,
                 MASK_N: tl.constexpr, PRECISION: tl.constexpr):
    """dQ += dS K for keys start_n .. start_n + BLOCK_N, dS = P * (dP - delta), P recomputed from lse."""
    k0, k1 = _load_chunks(k_head, start_n, N, skn, skd, ROWS=BLOCK_N, HEAD_DIM=HEAD_DIM, D0=D0, D1=D1, MASK_ROWS=MASK_N)
    v0, v1 = _load_chunks(v_head, start_n, N, svn, svd, ROWS=BLOCK_N, HEAD_DIM=HEAD_DIM, D0=D0, D1=D1, MASK_ROWS=MASK_N)
    s = _dot_t(q0, q1, k0, k1, D1=D1, PRECISION=PRECISION)
    dp = _dot_t(do0, do1, v0, v1, D1=D1, PRECISION=PRECISION)
    p = tl.math.exp2(s * qk_scale - lse[:, None])
    if MASK_N:
        p = tl.where((start_n + tl.arange(0, BLOCK_N) < N)[None, :], p, 0.0)
    ds = (p * (dp - delta[:, None])).to(k0.dtype)
    dq0 = _dot(ds, k0, dq0, PRECISION=PRECISION)
    if D1 > 0:
        dq1 = _dot(ds, k1, dq1, PRECISION=PRECISION)
    return dq0, dq1


@triton.jit
def _attn_bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr,  # inputs, any strides
    dq_ptr,  # (B, Hq, N, D) output
    lse_ptr, delta_ptr,  # (B * Hq, N) fp32
    N, HQ, scale, qk_scale,
    sqb, sqh, sqn, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sgb, sgh, sgn, sgd, sdqb, sdqh, sdqn, sdqd,
    BH_BUCKET,  # batch_bucket(B * Hq): only an autotuning key
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """cdiv(N, BLOCK_M) * B * Hq programs: dQ = scale * sum over key tiles of dS K."""
    tile, b, h = program_coords(tl.cdiv(N, BLOCK_M), HQ)
    g = h // GROUP
    start_m = tile * BLOCK_M
    q0, q1 = _load_chunks(q_ptr + b * sqb + h * sqh, start_m, N, sqn, sqd, ROWS=BLOCK_M, HEAD_DIM=HEAD_DIM, D0=D0,
                          D1=D1, MASK_ROWS=True)
    do0, do1 = _load_chunks(do_ptr + b * sgb + h * sgh, start_m, N, sgn, sgd, ROWS=BLOCK_M, HEAD_DIM=HEAD_DIM,
                            D0=D0, D1=D1, MASK_ROWS=True)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    lse = tl.load(lse_ptr + (b * HQ + h) * N + offs_m, mask=offs_m < N, other=float("inf"))
    delta = tl.load(delta_ptr + (b * HQ + h) * N + offs_m, mask=offs_m < N, other=0.0)
    dq0 = tl.zeros([BLOCK_M, D0], dtype=tl.float32)
    dq1 = tl.zeros([BLOCK_M, D1 if D1 > 0 else 16], dtype=tl.float32)
    k_head = k_ptr + b * skb + g * skh
    v_head = v_ptr + b * svb + g * svh

    n_full = (N // BLOCK_N) * BLOCK_N
    for start_n in range(0, n_full, BLOCK_N):
        dq0, dq1 = _dq_key_tile(q0, q1, do0, do1, dq0, dq1, lse, delta, k_head, v_head, start_n, N, skn, skd, svn,
                                svd, qk_scale, HEAD_DIM=HEAD_DIM, D0=D0, D1=D1, BLOCK_N=BLOCK_N, MASK_N=False,
                                PRECISION=PRECISION)
    if n_full < N:
        dq0, dq1 = _dq_key_tile(q0, q1, do0, do1, dq0, dq1, lse, delta, k_head, v_head, n_full, N, skn, skd, svn,
                                svd, qk_scale, HEAD_DIM=HEAD_DIM, D0=D0, D1=D1, BLOCK_N=BLOCK_N, MASK_N=True,
                                PRECISION=PRECISION)
    _store_chunks(dq_ptr + b * sdqb + h * sdqh, start_m, N, sdqn, sdqd, dq0 * scale, dq1 * scale, ROWS=BLOCK_M,
                  HEAD_DIM=HEAD_DIM, D0=D0, D1=D1)


# ---- Block sizes: autotuned on CUDA, fixed when interpreting -------------------------------------------------

# Chosen for Hopper: 128-row tiles on 8 warps (two wgmma warpgroups) for large grids, 64-row tiles to fill the SMs
# at batch 1 (a tile too big for a GPU's shared memory is skipped by the autotuner). fp32: smaller, two stages.
_CONFIGS = {  # (kernel, operands are fp32) -> configurations
    ("fwd", False): tile_configs([(128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 4)]),
    ("dkdv", False): tile_configs([(64, 128, 8, 3), (32, 128, 8, 3), (64, 64, 4, 3), (32, 64, 4, 4)]),
    ("dq", False): tile_configs([(128, 64, 8, 3), (128, 32, 8, 3), (64, 64, 4, 3)]),
    ("fwd", True): tile_configs([(128, 32, 8, 2), (64, 32, 4, 2)]),
    ("dkdv", True): tile_configs([(16, 64, 4, 2), (32, 64, 8, 2)]),
    ("dq", True): tile_configs([(64, 16, 4, 2), (64, 32, 8, 2)]),
}
# GROUP in the key: an MHA and a GQA block of one model share N, B * Hq and D but not the best tile. B * H enters
# in buckets, so that the last, smaller batch of a run reuses the tuned choice instead of timing again.
AUTOTUNE_KEY = ["N", "BH_BUCKET", "HEAD_DIM", "GROUP"]
_KERNELS = {"fwd": _attn_fwd_kernel, "dkdv": _attn_bwd_dkdv_kernel, "dq": _attn_bwd_dq_kernel}
_TUNED = {(name, fp32): triton.autotune(configs, key=AUTOTUNE_KEY)(_KERNELS[name])
          for (name, fp32), configs in _CONFIGS.items()}
drop_excluded(_TUNED, excluded_configs())


INTERPRET_BLOCKS = {"BLOCK_M": 16, "BLOCK_N": 16}  # CPU: the tests' shapes run several tiles and a ragged tail
PINNED_BLOCKS: dict | None = None  # set by the CUDA tests: these tiles, not autotuning, in both attention files
_BLOCK_KEYS = {"BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "maxnreg"}


def compiled_for_gpu(t: torch.Tensor) -> bool:
    """CUDA tensors: compiled kernels; else the CPU interpreter (bench/inspect_kernels.py overrides this)."""
    return t.is_cuda


def _launch(kernel, name, grid, args, consts, blocks):
    """The autotuned `name` kernel on CUDA, unless `blocks` (or PINNED_BLOCKS) fixes the tiles; grid(tiles)."""
    blocks = blocks if blocks is not None else PINNED_BLOCKS
    if blocks is None and compiled_for_gpu(args[0]):
        _TUNED[name, args[0].dtype == torch.float32][grid](*args, **consts)
        return
    blocks = blocks or INTERPRET_BLOCKS
    variants = sorted(key for key, value in blocks.items() if key not in _BLOCK_KEYS and value)
    if variants:
        raise ValueError(f"blocks {variants}: Hopper variants, which kernels/attention_triton_hopper.py runs")
    tiles = {"BLOCK_M": blocks["BLOCK_M"], "BLOCK_N": blocks["BLOCK_N"]}
    kernel[grid(tiles)](*args, **consts, **tiles, **launch_options(blocks))


# ---- Launchers and autograd ----------------------------------------------------------------------------------

def head_dim_chunks(head_dim: int) -> tuple[int, int]:
    """(D0, D1): D0 the largest power of two <= D, D1 the rest padded to a power of two >= 16 (0: none)."""
    d0 = 1 << (head_dim.bit_length() - 1)
    rest = head_dim - d0
    return d0, (0 if rest == 0 else max(16, triton.next_power_of_2(rest)))


def dot_precision(q: torch.Tensor) -> str:
    """The kernels' PRECISION: "ieee" (exact) when interpreting; on CUDA "tf32" for bf16/fp16 (ignored: their dots
    are native) and fp32 when torch allows tf32 matmuls, else "tf32x3" (about fp32 accuracy on the tensor cores)."""
    if not compiled_for_gpu(q):
        return "ieee"
    if q.dtype != torch.float32 or torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "tf32x3"


@launched_on_device
def attention_fwd(q, k, v, scale: float | None = None, blocks: dict | None = None, out=None):
    """The forward launch (no autograd): (o, lse), lse (B * Hq, N) fp32. o is new and (B, N, Hq, D)-contiguous,
    or `out`. `blocks` fixes BLOCK_M / BLOCK_N (and num_warps, num_stages) instead of autotuning."""
    check_attention_inputs(q, k, v)
    q, k, v = aligned_heads(q), aligned_heads(k), aligned_heads(v)  # 5b: a copy of the unaligned ones
    B, HQ, N, D = q.shape
    scale = D ** -0.5 if scale is None else scale
    D0, D1 = head_dim_chunks(D)
    o = check_out((out,), q)[0] if out is not None else empty_bnhd(q)
    lse = torch.empty(B * HQ, N, dtype=torch.float32, device=q.device)
    check_image_elements(q, k, v, o)
    args = (q, k, v, o, lse, N, HQ, scale * LOG2E, *q.stride(), *k.stride(), *v.stride(), *o.stride(),
            batch_bucket(B * HQ))
    consts = dict(GROUP=HQ // k.shape[1], HEAD_DIM=D, D0=D0, D1=D1, PRECISION=dot_precision(q))
    _launch(_attn_fwd_kernel, "fwd", lambda meta: flat_grid(triton.cdiv(N, meta["BLOCK_M"]), B * HQ), args, consts,
            blocks)
    return o, lse


def attention_delta(o, do) -> torch.Tensor:
    """delta = rowsum(dO * O), (B * Hq, N) fp32: the backward's correction term."""
    B, HQ, N, D = o.shape
    delta = torch.empty(B * HQ, N, dtype=torch.float32, device=o.device)
    block_m = 64 if compiled_for_gpu(o) else 16
    _attn_bwd_delta_kernel[flat_grid(triton.cdiv(N, block_m), B * HQ)](
        o, do, delta, N, HQ, *o.stride(), *do.stride(), HEAD_DIM=D, BLOCK_M=block_m,
        BLOCK_D=triton.next_power_of_2(D), num_warps=4)
    return delta


@launched_on_device
def attention_bwd(q, k, v, o, lse, do, scale: float | None = None, blocks: dict | None = None, out=None):
    """The backward launches: (dq, dk, dv), each new and (B, N, H, D)-contiguous, or the `out` triple."""
    q, k, v, o, do = (aligned_heads(t) for t in (q, k, v, o, do))  # 5b: copies of the unaligned ones
    (B, HQ, N, D), HKV = q.shape, k.shape[1]
    scale = D ** -0.5 if scale is None else scale
    D0, D1 = head_dim_chunks(D)
    check_image_elements(q, k, v, o, do)
    delta = attention_delta(o, do)
    dq, dk, dv = check_out(out, q, k, v) if out is not None else (empty_bnhd(q), empty_bnhd(k), empty_bnhd(v))
    consts = dict(GROUP=HQ // HKV, HEAD_DIM=D, D0=D0, D1=D1, PRECISION=dot_precision(q))
    inputs = (*q.stride(), *k.stride(), *v.stride(), *do.stride())
    args = (q, k, v, do, dk, dv, lse, delta, N, HQ, HKV, scale, scale * LOG2E, *inputs, *dk.stride(), *dv.stride(),
            batch_bucket(B * HKV))
    _launch(_attn_bwd_dkdv_kernel, "dkdv", lambda meta: flat_grid(triton.cdiv(N, meta["BLOCK_N"]), B * HKV), args,
            consts, blocks)
    args = (q, k, v, do, dq, lse, delta, N, HQ, scale, scale * LOG2E, *inputs, *dq.stride(), batch_bucket(B * HQ))
    _launch(_attn_bwd_dq_kernel, "dq", lambda meta: flat_grid(triton.cdiv(N, meta["BLOCK_M"]), B * HQ), args,
            consts, blocks)
    return dq, dk, dv


class FlashAttention(torch.autograd.Function):
    """Differentiable in q, k and v through the given launchers (this file's, or the Hopper variants')."""

    @staticmethod
    def forward(ctx, q, k, v, scale, fwd, bwd):
        q, k, v = aligned_heads(q), aligned_heads(k), aligned_heads(v)  # saved aligned: no copy again
        o, lse = fwd(q, k, v, scale)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.scale, ctx.bwd = scale, bwd
        ctx.guarded = dispatch.guarded_backward()  # decided now: the backward runs outside the caller's context
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        try:
            dq, dk, dv = ctx.bwd(q, k, v, o, lse, do, ctx.scale)
        except Exception as e:  # noqa: BLE001 - auto: a failed launch takes the reference, said once
            if not ctx.guarded:
                raise
            dq, dk, dv = dispatch.reference_gradients("attention", e, attention_reference, (q, k, v, ctx.scale), 3,
                                                      (do,))
        return dq, dk, dv, None, None, None


def attention_triton(q, k, v, scale: float | None = None):
    """The `_attention_triton` hook: the fused kernels, differentiable in q, k and v."""
    return FlashAttention.apply(q, k, v, scale, attention_fwd, attention_bwd)
