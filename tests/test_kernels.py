"""The Triton kernels against their PyTorch references (kernels/).

Without CUDA the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1, set below before anything
imports the kernel modules); with CUDA the same tests run the compiled kernels on the GPU. Shapes are small
but chosen to break kernels: N = 44 = 9 prefix tokens + 35 patches (not a multiple of any tile; the
interpreter uses 16-row tiles, so 2 full tiles + a ragged tail of 12), N = 9 (one partial tile) and 32 (no
tail); batch 1 and 3; GQA ratios 1, 2, 4; head dims 64, 80 (0.8b) and 76 (5b); inputs that are
(B, N, H, D) tensors viewed as (B, H, N, D) and other strides; fp32, bf16 (and fp16); outputs pre-filled
with NaN to catch elements a kernel forgets to write; gradients against the reference's autograd.
"""

import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first import of a kernel module

pytest.importorskip("triton")
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from sapiens2 import kernels  # noqa: E402
from sapiens2.kernels import attention_reference, qk_norm_rope_reference  # noqa: E402
from sapiens2.kernels import attention_triton_hopper as hopper  # noqa: E402
from sapiens2.kernels.attention_triton import attention_bwd, attention_fwd, attention_triton  # noqa: E402
from sapiens2.kernels.attention_triton_hopper import pack_heads  # noqa: E402
from sapiens2.kernels.qk_norm_rope_triton import qk_norm_rope_bwd, qk_norm_rope_fwd, qk_norm_rope_triton  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Tiles pinned: on CPU 16 x 16 (several tiles plus a tail at N = 44); on CUDA one Hopper-sized tile for every
# launch, autograd ones included (PINNED_BLOCKS), so the tests compile a few kernels instead of autotuning
# ~100 (the benchmarks autotune).
BLOCKS = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2} if DEVICE == "cuda" else {"BLOCK_M": 16, "BLOCK_N": 16}
QK_BLOCK_N = None if DEVICE == "cuda" else 16
if DEVICE == "cuda":
    import sapiens2.kernels.attention_triton

    kernels.attention_triton.PINNED_BLOCKS = BLOCKS

# Worst errors seen by each test, printed at the end of the run (pytest -s) for the record.
WORST: dict[str, float] = {}


def _record(name: str, err: float):
    WORST[name] = max(WORST.get(name, 0.0), err)


@pytest.fixture(scope="module", autouse=True)
def _report_worst():
    yield
    for name, err in sorted(WORST.items()):
        print(f"\nworst {name}: {err:.3e}", end="")


def bnhd(B, H, N, D, dtype, seed):
    """A (B, H, N, D) view of (B, N, H, D) memory: how the model's projections hand q/k/v over."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, N, H, D, generator=g).to(dtype).to(DEVICE).transpose(1, 2)


def poisoned(like, layout="bnhd"):
    """A NaN-filled tensor shaped like `like`, (B, N, H, D)- or (B, H, N, D)-contiguous."""
    B, H, N, D = like.shape
    if layout == "bnhd":
        return torch.full((B, N, H, D), float("nan"), dtype=like.dtype, device=like.device).transpose(1, 2)
    return torch.full((B, H, N, D), float("nan"), dtype=like.dtype, device=like.device)


def rel_err(a, b):
    """max |a - b| / max |b|, in fp64: one number per tensor, insensitive to the tensor's scale."""
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def rope_tables(P, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    angles = torch.rand(P, D, generator=g) * 6.3
    return angles.cos().to(dtype).to(DEVICE), angles.sin().to(dtype).to(DEVICE)


ULP = {torch.float32: 2.0 ** -23, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}  # half an ulp, relative


def assert_same_up_to_dot_order(name, got, want, D):
    """Two tilings that give tl.dot the same rows in other places in the tile (GQA packing stacks the query heads
    of a K/V head in one tile) compute the same function, but not always the same bits: in the interpreter tl.dot
    is numpy's matmul, and the BLAS may sum a row's products in an order that depends on where the row sits (seen
    with OpenBLAS's Haswell kernels on an AMD EPYC: up to 6.5e-7 in fp32; bit-identical with its Sandybridge
    kernels, OPENBLAS_CORETYPE=Sandybridge). The bound, relative to the largest |value|:
      * fp32 accumulators: the two dots (q k^T over D, P V over a BLOCK_N-wide key tile) re-associated; a sum of n
        fp32 terms moves by at most about n units of 2^-24 of its terms' scale (Higham's gamma_n, to first order),
        so (D + BLOCK_N) * 2^-24;
      * bf16/fp16 outputs: also one unit in the last place of the output (its final rounding may land on the other
        side) and one of the P that the P V dot takes in the input dtype: 2 ulps of the output dtype.
    A tiling that computed another function (a wrong head, row or scale) misses this by orders of magnitude."""
    fp32 = (D + BLOCKS["BLOCK_N"]) * 2.0 ** -24
    tol = fp32 + (0.0 if got.dtype == torch.float32 else 4 * ULP[got.dtype])  # ULP holds half an ulp
    err = rel_err(got, want)
    _record(f"{name} vs other tiling", err)
    assert err <= tol, f"{name}: {err:.3e} from the other tiling (bound {tol:.3e})"


# ----------------------------------------------------------------------------------------------------
# qk_norm_rope
# ----------------------------------------------------------------------------------------------------

QK_CASES = [  # (q/k dtype, cos/sin dtype, D, B, Hq, Hkv)
    (torch.float32, torch.float32, 64, 3, 4, 2),
    (torch.float32, torch.float32, 80, 1, 4, 1),
    (torch.float32, torch.bfloat16, 64, 1, 4, 4),  # the original Sapiens2 convention: fp32 model, bf16 tables
    (torch.float32, torch.bfloat16, 80, 3, 4, 2),
    (torch.float32, torch.bfloat16, 76, 1, 4, 1),
    (torch.bfloat16, torch.bfloat16, 64, 3, 4, 2),  # HF convention in a bf16 model
    (torch.bfloat16, torch.bfloat16, 76, 1, 2, 2),
    (torch.bfloat16, torch.float32, 80, 1, 4, 2),
    (torch.float16, torch.float16, 80, 1, 4, 2),
]


@pytest.mark.parametrize("dtype,rope_dtype,D,B,HQ,HKV", QK_CASES)
def test_qk_norm_rope_forward(dtype, rope_dtype, D, B, HQ, HKV):
    N, P = 44, 35
    q, k = bnhd(B, HQ, N, D, dtype, 1), bnhd(B, HKV, N, D, dtype, 2)
    wq, wk = (torch.randn(D).to(DEVICE) for _ in range(2))
    cos, sin = rope_tables(P, D, rope_dtype)
    # Outputs in the other layout, NaN-filled: every element must be written, through any output strides.
    out = (poisoned(q, "bhnd"), poisoned(k, "bhnd"))
    # 4 heads per program: Hq + Hkv = 5, 6 or 8 heads make ragged and whole groups
    oq, ok = qk_norm_rope_fwd(q, k, wq, wk, cos, sin, 1e-6, block_n=QK_BLOCK_N, out=out, heads_per_program=4)
    rq, rk = qk_norm_rope_reference(q, k, wq, wk, cos, sin, 1e-6)
    for o, r, name in ((oq, rq, "q"), (ok, rk, "k")):
        assert not o.isnan().any(), f"{name}: unwritten (NaN) elements"
        diff = (o.double() - r.double()).abs()
        if dtype == rope_dtype == torch.float32:
            # fp32 throughout: only the RMS reduction order and rsqrt differ, a few fp32 ulp.
            tol = 1e-5 * (1 + r.double().abs())
            assert (diff <= tol).all(), f"{name}: max err {diff.max().item():.3e}"
        else:
            # The kernel repeats the reference's roundings (to bf16/fp16 after each op), so most elements
            # match exactly; the fp32 RMS factor can differ in its last bits and move a value across a
            # rounding boundary: at most one ulp of the coarsest dtype involved (2x the half-ulp), and rarely.
            half_ulp = max(ULP[dtype], ULP[rope_dtype])
            tol = 2 * half_ulp * r.double().abs() * 1.01 + 1e-30
            assert (diff <= tol).all(), f"{name}: max err {diff.max().item():.3e} exceeds one ulp"
            frac = (diff > 0).double().mean().item()
            assert frac <= 0.01, f"{name}: {frac:.2%} of elements differ from the reference's rounding"
            _record(f"qk_norm_rope fwd {dtype}/{rope_dtype} mismatch fraction", frac)
        _record(f"qk_norm_rope fwd {dtype}/{rope_dtype} rel err", rel_err(o, r))


@pytest.mark.parametrize("P", [44, 0])
def test_qk_norm_rope_prefix_edge_cases(P):
    """P = N: every token is a patch; P = 0: nothing is rotated (pure RMSNorm)."""
    B, HQ, HKV, N, D = 1, 2, 1, 44, 64
    q, k = bnhd(B, HQ, N, D, torch.float32, 3), bnhd(B, HKV, N, D, torch.float32, 4)
    wq, wk = (torch.randn(D).to(DEVICE) for _ in range(2))
    cos, sin = rope_tables(P, D, torch.float32)
    oq, ok = qk_norm_rope_fwd(q, k, wq, wk, cos, sin, 1e-6, block_n=QK_BLOCK_N)
    rq, rk = qk_norm_rope_reference(q, k, wq, wk, cos, sin, 1e-6)
    torch.testing.assert_close(oq, rq, rtol=1e-5, atol=1e-5)  # fp32: reduction order only
    torch.testing.assert_close(ok, rk, rtol=1e-5, atol=1e-5)


def test_qk_norm_rope_odd_strides():
    """q whose head dim is not the unit stride (a (B, H, D, N) tensor transposed), k a slice of a packed
    (B, N, 2, H, D) projection, tables that are a non-contiguous view."""
    B, H, N, D, P = 1, 2, 44, 80, 35
    q = torch.randn(B, H, D, N, device=DEVICE).transpose(-1, -2)
    k = torch.randn(B, N, 2, H, D, device=DEVICE)[:, :, 1].transpose(1, 2)
    wq, wk = torch.randn(D, device=DEVICE), torch.randn(D, device=DEVICE)
    angles = (torch.rand(D, P) * 6.3).to(DEVICE)
    cos, sin = angles.cos().t(), angles.sin().t()  # (P, D) with strides (1, P)
    oq, ok = qk_norm_rope_fwd(q, k, wq, wk, cos, sin, 1e-6, block_n=QK_BLOCK_N)
    rq, rk = qk_norm_rope_reference(q, k, wq, wk, cos, sin, 1e-6)
    torch.testing.assert_close(oq, rq, rtol=1e-5, atol=1e-5)  # fp32: reduction order only
    torch.testing.assert_close(ok, rk, rtol=1e-5, atol=1e-5)


QK_GRAD_CASES = [  # (q/k dtype, cos/sin dtype, D, B, Hq, Hkv, tolerance on rel_err, reason)
    (torch.float32, torch.float32, 64, 3, 4, 2, 1e-5),  # fp32: reduction order only
    (torch.float32, torch.float32, 76, 1, 4, 1, 1e-5),
    # The reference's autograd rounds gradients to bf16 where its forward casts to bf16; the kernel's
    # backward is fp32 throughout (straight-through): they differ by a few bf16 roundings, about 2**-8 each.
    (torch.float32, torch.bfloat16, 80, 1, 4, 2, 2e-2),
    (torch.bfloat16, torch.bfloat16, 64, 1, 4, 4, 2e-2),
]


@pytest.mark.parametrize("dtype,rope_dtype,D,B,HQ,HKV,tol", QK_GRAD_CASES)
def test_qk_norm_rope_backward(dtype, rope_dtype, D, B, HQ, HKV, tol):
    N, P = 44, 35
    q, k = bnhd(B, HQ, N, D, dtype, 5), bnhd(B, HKV, N, D, dtype, 6)
    wq, wk = (torch.randn(D).to(DEVICE) for _ in range(2))
    cos, sin = rope_tables(P, D, rope_dtype)
    gq, gk = bnhd(B, HQ, N, D, dtype, 7), bnhd(B, HKV, N, D, dtype, 8)  # output gradients, (B, N, H, D) memory

    dq, dk, dwq, dwk = qk_norm_rope_bwd(q, k, wq, wk, cos, sin, gq, gk, 1e-6, block_n=QK_BLOCK_N,
                                        out=(poisoned(q), poisoned(k)), heads_per_program=4)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, wq, wk)]
    rq, rk = qk_norm_rope_reference(*leaves, cos, sin, 1e-6)
    ref = torch.autograd.grad((rq, rk), leaves, (gq, gk))
    for name, got, want in zip(("dq", "dk", "dwq", "dwk"), (dq, dk, dwq, dwk), ref):
        assert not got.isnan().any(), f"{name}: unwritten (NaN) elements"
        err = rel_err(got, want)
        _record(f"qk_norm_rope bwd {dtype}/{rope_dtype} {name} rel err", err)
        assert err <= tol, f"{name}: relative error {err:.3e} > {tol}"


def test_qk_norm_rope_autograd_matches_launchers():
    """The autograd.Function wires the launchers correctly (inputs, weights, and an output that is unused)."""
    B, HQ, HKV, N, D, P = 1, 2, 1, 44, 64, 35
    q = bnhd(B, HQ, N, D, torch.float32, 9).requires_grad_()
    k = bnhd(B, HKV, N, D, torch.float32, 10).requires_grad_()
    wq = torch.randn(D, device=DEVICE, requires_grad=True)
    wk = torch.randn(D, device=DEVICE, requires_grad=True)
    cos, sin = rope_tables(P, D, torch.float32)
    oq, ok = qk_norm_rope_triton(q, k, wq, wk, cos, sin)
    (oq * oq.detach()).sum().backward()  # k's output unused: its gradient path gets zeros
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, wq, wk)]
    rq, _ = qk_norm_rope_reference(*leaves, cos, sin)
    (rq * rq.detach()).sum().backward()
    for got, want in zip((q, k, wq, wk), leaves):
        want_grad = torch.zeros_like(want) if want.grad is None else want.grad  # k, wk: no path to the loss
        torch.testing.assert_close(got.grad, want_grad, rtol=1e-5, atol=1e-5)  # fp32: reduction order only


# ----------------------------------------------------------------------------------------------------
# attention
# ----------------------------------------------------------------------------------------------------

ATTN_CASES = [  # (dtype, D, B, Hq, Hkv, N)
    (torch.float32, 64, 1, 4, 4, 44),  # GQA ratio 1
    (torch.float32, 64, 3, 4, 2, 44),  # ratio 2, batch 3
    (torch.float32, 80, 1, 4, 1, 44),  # ratio 4, head dim 80 = 64 + 16
    (torch.float32, 76, 1, 4, 2, 44),  # head dim 76 = 64 + 16 with 12 masked columns
    (torch.bfloat16, 64, 1, 4, 1, 44),
    (torch.bfloat16, 80, 3, 4, 2, 44),
    (torch.bfloat16, 80, 1, 2, 2, 44),
    (torch.bfloat16, 76, 1, 4, 4, 44),
    (torch.bfloat16, 64, 1, 2, 1, 9),  # a single partial tile
    (torch.bfloat16, 64, 1, 2, 1, 32),  # whole tiles, no tail
    (torch.float16, 80, 1, 2, 1, 44),
]
# Tolerances on rel_err against the fp32 reference evaluated on the same (rounded) inputs:
#  fp32: the kernel's math is the reference's up to summation order and exp2 vs exp: ~1e-6.
#  bf16/fp16: P (forward) and dS (backward) are rounded to the input dtype before their matmuls, and the
#  outputs are rounded (the interpreter truncates, the GPU rounds to nearest): a few 2**-8 (bf16) / 2**-11
#  (fp16) relative errors that partly cancel in the sums.
ATTN_TOL = {torch.float32: (2e-5, 5e-5), torch.bfloat16: (2.5e-2, 4e-2), torch.float16: (2e-3, 4e-3)}


@pytest.mark.parametrize("HQ,HKV", [(4, 4), (4, 2), (8, 1)])
def test_attention_probs_is_the_softmax_with_k_repeated_per_query_head(HQ, HKV):
    """p is softmax(q k^T * scale), query head h reading key head h // (HQ / HKV), fp64; and with these
    probabilities p @ v is the reference's attention (the same head grouping as `attention`)."""
    B, N, D = 2, 23, 16
    q, k, v = (torch.randn(B, h, N, D, dtype=torch.float64, generator=torch.Generator().manual_seed(h + i))
               for i, h in enumerate((HQ, HKV, HKV)))
    p = kernels.attention_probs(q, k, scale=0.3)
    kr, vr = (t.repeat_interleave(HQ // HKV, dim=1) for t in (k, v))
    assert p.shape == (B, HQ, N, N) and rel_err(p, torch.softmax(q @ kr.transpose(-1, -2) * 0.3, dim=-1)) < 1e-12
    assert rel_err(p @ vr, attention_reference(q, k, v, scale=0.3)) < 1e-12  # fp64: summation order only
    p_default = kernels.attention_probs(q, k)
    assert rel_err(p_default, torch.softmax(q @ kr.transpose(-1, -2) * D ** -0.5, dim=-1)) < 1e-12
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        kernels.attention_probs(q, k[:, :1].expand(B, 3, N, D))


@pytest.mark.parametrize("HQ,HKV", [(4, 4), (4, 2), (8, 2)])
def test_attention_reference_is_the_formula(HQ, HKV):
    """The reference (SDPA with enable_gqa) against softmax(q k^T * scale) v written out, with K and V
    repeated explicitly (head h reads key/value head h // (HQ / HKV)): outputs and gradients, fp64."""
    B, N, D = 2, 37, 16
    leaves = [torch.randn(B, h, N, D, dtype=torch.float64, generator=torch.Generator().manual_seed(h + i),
                          requires_grad=True) for i, h in enumerate((HQ, HKV, HKV))]
    q, k, v = leaves
    got = attention_reference(q, k, v, scale=0.3)
    kr, vr = (t.repeat_interleave(HQ // HKV, dim=1) for t in (k, v))
    want = torch.softmax(q @ kr.transpose(-1, -2) * 0.3, dim=-1) @ vr
    assert rel_err(got, want) < 1e-12
    g = torch.randn_like(want)
    for a, b in zip(torch.autograd.grad(got, leaves, g), torch.autograd.grad(want, leaves, g)):
        assert rel_err(a, b) < 1e-12
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        attention_reference(q, k[:, :1].expand(B, 3, N, D), v[:, :1].expand(B, 3, N, D))


@pytest.mark.parametrize("dtype,D,B,HQ,HKV,N", ATTN_CASES)
def test_attention_forward_backward(dtype, D, B, HQ, HKV, N):
    q, k, v = bnhd(B, HQ, N, D, dtype, 11), bnhd(B, HKV, N, D, dtype, 12), bnhd(B, HKV, N, D, dtype, 13)
    do = bnhd(B, HQ, N, D, dtype, 14)
    scale = None if D != 80 else 0.3  # the explicit-scale path once
    o, lse = attention_fwd(q, k, v, scale, blocks=BLOCKS, out=poisoned(q, "bhnd"))
    dq, dk, dv = attention_bwd(q, k, v, o, lse, do, scale, blocks=BLOCKS,
                               out=(poisoned(q), poisoned(k, "bhnd"), poisoned(v)))

    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = attention_reference(*leaves, scale=scale)
    grads = torch.autograd.grad(ref, leaves, do.double())
    tol_o, tol_g = ATTN_TOL[dtype]
    for name, got, want, tol in zip(("o", "dq", "dk", "dv"), (o, dq, dk, dv), (ref, *grads),
                                    (tol_o, tol_g, tol_g, tol_g)):
        assert not got.isnan().any(), f"{name}: unwritten (NaN) elements"
        err = rel_err(got, want)
        _record(f"attention {dtype} {name} rel err", err)
        assert err <= tol, f"{name}: relative error {err:.3e} > {tol}"
    # lse (base 2) against the reference's log-sum-exp of the scaled scores.
    kr = leaves[1].detach().repeat_interleave(HQ // HKV, dim=1)
    s = leaves[0].detach() @ kr.transpose(-1, -2) * (D ** -0.5 if scale is None else scale)
    lse_ref = torch.logsumexp(s, dim=-1).reshape(B * HQ, N) / torch.log(torch.tensor(2.0, dtype=torch.float64))
    assert (lse.double() - lse_ref).abs().max().item() <= (1e-4 if dtype == torch.float32 else 5e-2)


GQA_CASES = [case for case in ATTN_CASES if case[3] > case[4]]  # GQA ratios 2 and 4, D 64/80/76, fp32/bf16/fp16


@pytest.mark.parametrize("dtype,D,B,HQ,HKV,N", GQA_CASES)
def test_attention_forward_gqa_packed(dtype, D, B, HQ, HKV, N, monkeypatch):
    """GQA packing (PACK): one program stacks the HQ / HKV query heads of a K/V head in its tile's rows
    (16 rows: 8 tokens x 2 heads or 4 tokens x 4 heads, with a ragged last tile). Same tolerances as the
    unpacked forward; the grid has one program per (token tile, K/V head), not per query head."""
    at = hopper

    q, k, v = bnhd(B, HQ, N, D, dtype, 11), bnhd(B, HKV, N, D, dtype, 12), bnhd(B, HKV, N, D, dtype, 13)
    scale = None if D != 80 else 0.3
    grids = []
    launch = at._launch
    monkeypatch.setattr(at, "_launch", lambda kernel, name, grid, *a: launch(
        kernel, name, lambda meta: grids.append((meta, grid(meta))) or grid(meta), *a))
    o, lse = hopper.attention_fwd(q, k, v, scale, blocks=dict(BLOCKS, PACK=True), out=poisoned(q, "bhnd"))
    (meta, grid), = grids
    group, rows = HQ // HKV, BLOCKS["BLOCK_M"]
    assert meta["PACK"] and grid == (triton.cdiv(N, rows // group) * B * HKV,)

    leaves = [t.double() for t in (q, k, v)]
    ref = attention_reference(*leaves, scale=scale)
    assert not o.isnan().any(), "unwritten (NaN) elements"
    err = rel_err(o, ref)
    _record(f"attention packed {dtype} o rel err", err)
    assert err <= ATTN_TOL[dtype][0], f"o: relative error {err:.3e}"
    kr = leaves[1].repeat_interleave(group, dim=1)
    s = leaves[0] @ kr.transpose(-1, -2) * (D ** -0.5 if scale is None else scale)
    lse_ref = torch.logsumexp(s, dim=-1).reshape(B * HQ, N) / torch.log(torch.tensor(2.0, dtype=torch.float64))
    assert (lse.double() - lse_ref).abs().max().item() <= (1e-4 if dtype == torch.float32 else 5e-2)
    if DEVICE == "cpu":
        # Rows are independent, so stacking heads changes no row's math, but it moves rows within the tile (and a
        # BLAS may then sum them in another order): the unpacked forward's values up to that order.
        o_plain, lse_plain = hopper.attention_fwd(q, k, v, scale, blocks=BLOCKS)
        assert_same_up_to_dot_order(f"packed {dtype} o", o, o_plain, D)
        assert_same_up_to_dot_order(f"packed {dtype} lse", lse, lse_plain, D)


def test_gqa_packing_only_where_the_group_divides_the_tile():
    """pack_heads: the one rule for the grid and the kernel; the autotuner keeps packed configurations only
    for GQA blocks whose GROUP divides BLOCK_M (their unpacked twins always stay)."""
    from sapiens2.kernels.attention_triton_hopper import _FWD_CONFIGS, _prune_packing

    assert [pack_heads(16, True, g) for g in (1, 2, 3, 4)] == [1, 2, 1, 4]
    assert pack_heads(16, False, 2) == 1
    packed = [c for c in _FWD_CONFIGS if c.kwargs.get("PACK")]
    assert packed and len(packed) < len(_FWD_CONFIGS)
    assert _prune_packing(_FWD_CONFIGS, {}, GROUP=1) == [c for c in _FWD_CONFIGS if c not in packed]
    assert _prune_packing(_FWD_CONFIGS, {}, GROUP=3) == [c for c in _FWD_CONFIGS if c not in packed]
    assert _prune_packing(_FWD_CONFIGS, {}, GROUP=2) == _FWD_CONFIGS
    # a GROUP that does not divide the tile falls back to one head per program (same values, plain grid)
    q, kv = bnhd(1, 3, 20, 16, torch.float32, 40), bnhd(1, 1, 20, 16, torch.float32, 41)
    o, _ = hopper.attention_fwd(q, kv, kv, blocks=dict(BLOCKS, PACK=True))
    assert rel_err(o, attention_reference(q.double(), kv.double(), kv.double())) < ATTN_TOL[torch.float32][0]


FORWARD_VARIANTS = {  # attention_triton_hopper.py's forward, its flags beside its defaults (OVERLAP, pointer loads)
    "overlap": dict(),
    "tma": dict(TMA=True),
    "tma-packed": dict(TMA=True, PACK=True),
    "plain-order-r128": dict(OVERLAP=False, maxnreg=128),  # a register cap: no effect in the interpreter
    "tma-persistent": dict(TMA=True, PERSISTENT=True),  # 3 programs in the interpreter, each walking several tiles
    "persistent-packed-plain-order": dict(PERSISTENT=True, PACK=True, OVERLAP=False),
    "plain-order-tma-packed": dict(OVERLAP=False, TMA=True, PACK=True),
    "poly-exp2": dict(POLY_EXP2=True),  # half of the exp2s on the FMA units: bf16/fp16 only, not bit-identical
    "poly-exp2-tma-packed": dict(POLY_EXP2=True, TMA=True, PACK=True),
}
VARIANT_CASES = [ATTN_CASES[i] for i in (0, 3, 5, 8, 9, 10)]  # GQA 1/2, D 64/76/80, one tile, no tail, 3 dtypes


@pytest.mark.parametrize("variant", list(FORWARD_VARIANTS))
@pytest.mark.parametrize("dtype,D,B,HQ,HKV,N", VARIANT_CASES)
def test_attention_forward_variants(variant, dtype, D, B, HQ, HKV, N):
    """The Hopper variants (the overlapped loop, K/V through TMA descriptors, which zero-fill rows past N and columns
    past D = 76, packing, the persistent grid) compute the same function as attention_triton.py's forward: the
    reference's tolerances, and on CPU its bits (every dot gets the same operands in the same places; the packed
    variants move rows within the tile: assert_same_up_to_dot_order)."""
    q, k, v = bnhd(B, HQ, N, D, dtype, 11), bnhd(B, HKV, N, D, dtype, 12), bnhd(B, HKV, N, D, dtype, 13)
    blocks = dict(BLOCKS, **FORWARD_VARIANTS[variant])
    if blocks.get("POLY_EXP2") and dtype == torch.float32:
        with pytest.raises(ValueError, match="bf16/fp16"):
            hopper.attention_fwd(q, k, v, blocks=blocks)
        return
    o, lse = hopper.attention_fwd(q, k, v, blocks=blocks, out=poisoned(q, "bhnd"))
    ref = attention_reference(q.double(), k.double(), v.double())
    assert not o.isnan().any(), "unwritten (NaN) elements"
    err = rel_err(o, ref)
    _record(f"attention {variant} {dtype} o rel err", err)
    assert err <= ATTN_TOL[dtype][0], f"o: relative error {err:.3e}"
    if blocks.get("POLY_EXP2"):
        # Against the default forward: p is off by <= 7.5e-5 relative, which moves the rounding of some p to the
        # input dtype (for the P V MMA) by one unit in the last place, and then the rounding of o: bounded here by
        # 3 ulps of the largest |o| (bf16 2^-8, fp16 2^-11; seen: 1.9 ulps bf16, 0.9 fp16, ~27% of the elements
        # differ). The row sums stay in fp32: lse (base 2) moves by ~7.5e-5 / ln 2 at most.
        o_default, lse_default = attention_fwd(q, k, v, blocks=BLOCKS)
        ulp = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11
        err = rel_err(o, o_default)
        _record(f"attention {variant} {dtype} o vs default", err)
        assert err <= 3 * ulp, err
        assert (lse - lse_default).abs().max().item() <= 1.1e-4
    elif DEVICE == "cpu" and blocks.get("PACK") and pack_heads(BLOCKS["BLOCK_M"], True, HQ // HKV) > 1:
        # rows moved within the tile: the default's values up to the dots' summation order
        o_default, lse_default = attention_fwd(q, k, v, blocks=BLOCKS)
        assert_same_up_to_dot_order(f"{variant} {dtype} o", o, o_default, D)
        assert_same_up_to_dot_order(f"{variant} {dtype} lse", lse, lse_default, D)
    elif DEVICE == "cpu":  # every tl.dot gets the default's operands, element for element: the same numpy matmuls
        # (GQA ratio 1 packs nothing: pack_heads gives one head per program)
        o_default, lse_default = attention_fwd(q, k, v, blocks=BLOCKS)
        assert torch.equal(o, o_default) and torch.equal(lse, lse_default)


BACKWARD_VARIANTS = {  # attention_triton_hopper.py's backward, its flags beside its defaults (OVERLAP, pointers)
    "overlap": dict(),
    "plain-order": dict(OVERLAP=False),
    "tma": dict(TMA=True),  # dQ streams K/V, dK/dV streams q/dO through descriptors
}


@pytest.mark.parametrize("variant", list(BACKWARD_VARIANTS))
@pytest.mark.parametrize("dtype,D,B,HQ,HKV,N", VARIANT_CASES)
def test_attention_backward_variants(variant, dtype, D, B, HQ, HKV, N):
    """The Hopper dQ and dK/dV kernels (overlapped, plain order, TMA loads): the reference's gradients (the
    tolerances of attention_triton.py's) and, on CPU, attention_triton.py's backward's bits (same dots, same order)."""
    q, k, v = bnhd(B, HQ, N, D, dtype, 11), bnhd(B, HKV, N, D, dtype, 12), bnhd(B, HKV, N, D, dtype, 13)
    do = bnhd(B, HQ, N, D, dtype, 14)
    o, lse = attention_fwd(q, k, v, blocks=BLOCKS)
    grads = hopper.attention_bwd(q, k, v, o, lse, do, blocks=dict(BLOCKS, **BACKWARD_VARIANTS[variant]),
                                 out=(poisoned(q), poisoned(k, "bhnd"), poisoned(v)))
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = torch.autograd.grad(attention_reference(*leaves), leaves, do.double())
    for name, got, ref in zip(("dq", "dk", "dv"), grads, want):
        assert not got.isnan().any(), f"{name}: unwritten (NaN) elements"
        err = rel_err(got, ref)
        _record(f"attention bwd {variant} {dtype} {name} rel err", err)
        assert err <= ATTN_TOL[dtype][1], f"{name}: relative error {err:.3e}"
    if DEVICE == "cpu":
        for got, default in zip(grads, attention_bwd(q, k, v, o, lse, do, blocks=BLOCKS)):
            assert torch.equal(got, default)


@triton.jit
def _exp2_fma_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    from sapiens2.kernels.attention_triton_hopper import _exp2_fma

    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, _exp2_fma(tl.load(x_ptr + offs, mask=offs < n)), mask=offs < n)


def test_exp2_on_fma_units():
    """The FMA-unit exp2 (POLY_EXP2): relative error <= 7.6e-5 against 2^x in float64 for x in [-125, 0] (a dense
    grid, integers and half-integers included, where the rounding splits x); below that, tiny non-negative values
    (<= 2^-124: nothing next to a softmax row sum >= 1), including for -inf and -1e30."""
    x = torch.cat([torch.linspace(-125, 0, 200_001), torch.arange(-125, 1.0), torch.arange(-124.5, 0, 1.0)])
    tail = torch.tensor([-125.5, -126.0, -127.0, -200.0, -1e4, -1e30, float("-inf")])
    xs = torch.cat([x, tail]).float().to(DEVICE)
    y = torch.empty_like(xs)
    _exp2_fma_kernel[(triton.cdiv(xs.numel(), 1024),)](xs, y, xs.numel(), BLOCK=1024)
    want = torch.exp2(x.double())
    err = ((y[:x.numel()].double().cpu() - want) / want).abs().max().item()
    _record("exp2 on FMA units rel err", err)
    assert err <= 7.6e-5, err
    low = y[x.numel():].cpu()
    assert (low >= 0).all() and (low <= 2.0 ** -124).all(), low


def test_persistent_grid_walks_every_tile(monkeypatch):
    """PERSISTENT launches min(tiles, SMs) programs (3 in the interpreter) that take tiles program_id,
    program_id + 3, ...: 2 x 4 heads x 3 token tiles = 24 tiles, every one written (the output starts as NaN)."""
    at = hopper

    q, kv = bnhd(2, 4, 44, 64, torch.float32, 60), bnhd(2, 2, 44, 64, torch.float32, 61)
    grids = []
    launch = at._launch
    monkeypatch.setattr(at, "_launch", lambda kernel, name, grid, *a: launch(
        kernel, name, lambda meta: grids.append(grid(meta)) or grid(meta), *a))
    o, lse = hopper.attention_fwd(q, kv, kv, blocks=dict(BLOCKS, PERSISTENT=True), out=poisoned(q, "bhnd"))
    assert grids == [(min(at.num_sms(q), 2 * 4 * triton.cdiv(44, BLOCKS["BLOCK_M"])),)]
    assert DEVICE != "cpu" or grids == [(3,)]
    o_default, lse_default = attention_fwd(q, kv, kv, blocks=BLOCKS)
    assert not o.isnan().any()
    if DEVICE == "cpu":
        assert torch.equal(o, o_default) and torch.equal(lse, lse_default)
    else:
        assert rel_err(o, o_default) < ATTN_TOL[torch.float32][0]


def test_tma_needs_aligned_heads(monkeypatch):
    """TMA descriptors need 16-byte-aligned heads: a K/V tensor that starts 4 bytes off (or broadcasts with a zero
    stride) is refused when the tiles are pinned with TMA (a clear error), and every launch on such tensors goes to
    the autotuner without TMA configurations, whatever an earlier launch on aligned tensors of the same shape
    chose (the autotuner's cache key does not see alignment)."""
    at = hopper

    q, k = bnhd(1, 2, 20, 16, torch.float32, 50), bnhd(1, 2, 20, 16, torch.float32, 51)
    shifted = torch.randn(1 * 20 * 2 * 16 + 1, device=DEVICE)[1:].view(1, 20, 2, 16).transpose(1, 2)
    broadcast = k[:, :1].expand(1, 2, 20, 16)
    assert at.tma_usable(k, k) and not at.tma_usable(k, shifted) and not at.tma_usable(k, broadcast)
    with pytest.raises(ValueError, match="TMA"):
        hopper.attention_fwd(q, k, shifted, blocks=dict(BLOCKS, TMA=True))
    for fp32 in (False, True):
        for name in ("fwd", "dq", "dkdv"):
            assert not any(c.kwargs["TMA"] for c in at._TUNED[name, fp32, False].configs)
    assert any(c.kwargs["TMA"] for c in at._TUNED["fwd", False, True].configs)
    # which autotuner a (pretend) CUDA launch uses: the one without TMA for the shifted K/V, each time
    chosen = []

    class Launchers(dict):
        def __getitem__(self, key):
            chosen.append(key)
            return {None: lambda *args, **kwargs: None}

    monkeypatch.setattr(kernels.attention_triton, "compiled_for_gpu", lambda t: True)
    monkeypatch.setattr(at, "_has_tma_engine", lambda t: True)
    monkeypatch.setattr(at, "_ensure_allocator", lambda: None)
    monkeypatch.setattr(at, "_TUNED", Launchers())
    for v in (k, shifted, k):
        at._launch(at._attn_fwd_hopper_kernel, "fwd", None, (q, k, v), {}, None)
    assert chosen == [("fwd", True, True), ("fwd", True, False), ("fwd", True, True)]
    monkeypatch.undo()
    o, _ = attention_fwd(q, k, shifted, blocks=BLOCKS)  # the pointer path reads it
    assert rel_err(o, attention_reference(q.double(), k.double(), shifted.double())) < ATTN_TOL[torch.float32][0]


def test_base_kernel_refuses_the_hopper_flags():
    """attention_triton.py has no variant flags: asking it for one is an error that names the file that has them."""
    q = bnhd(1, 2, 20, 16, torch.float32, 70)
    with pytest.raises(ValueError, match="attention_triton_hopper"):
        attention_fwd(q, q, q, blocks=dict(BLOCKS, TMA=True))


def test_only_fastest_runs_the_hopper_variants(monkeypatch):
    """The Hopper variants are opt-in: SAPIENS2_KERNELS=fastest reaches them, triton and auto run the base kernel."""
    import importlib

    attention_module = importlib.import_module("sapiens2.kernels.attention")  # kernels.attention is the function
    calls = []
    monkeypatch.setattr(hopper, "attention_triton", lambda *args: calls.append("hopper"))
    monkeypatch.setattr(kernels.attention_triton, "attention_triton", lambda *args: calls.append("base"))
    for choice in ("triton", "fastest", "auto"):
        with dispatch.backend(choice):
            attention_module._attention_triton(None, None, None, None)
    assert calls == ["base", "hopper", "base"]


def test_base_kernel_names_its_arguments():
    """kernels/attention_triton.py stays a file to read: at most 450 lines, and no call passes a bare True/False
    positionally (a flag is named at the call site)."""
    import ast
    import inspect

    source = inspect.getsource(kernels.attention_triton)
    assert len(source.splitlines()) <= 450
    bare = [node.lineno for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Call)
            for arg in node.args if isinstance(arg, ast.Constant) and isinstance(arg.value, bool)]
    assert not bare, f"bare True/False passed positionally on lines {bare}"


def test_attention_autograd_and_layout():
    """Through the autograd.Function: the output is (B, N, Hq, D) memory (the head merge is a free view),
    and gradients match the reference's, including a gradient that arrives in the merged-head layout."""
    B, HQ, HKV, N, D = 1, 4, 2, 44, 64
    q, k, v = (bnhd(B, h, N, D, torch.float32, s).requires_grad_() for h, s in ((HQ, 15), (HKV, 16), (HKV, 17)))
    o = attention_triton(q, k, v)
    assert o.transpose(1, 2).is_contiguous()
    merged = o.transpose(1, 2).reshape(B, N, HQ * D)  # what the model's output projection consumes
    w = torch.randn(HQ * D, device=DEVICE)
    (merged * w).sum().backward()
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    (attention_reference(*leaves).transpose(1, 2).reshape(B, N, HQ * D) * w).sum().backward()
    for got, want in zip((q, k, v), leaves):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-4, atol=1e-5)  # fp32: summation order


def test_attention_rejects_bad_shapes():
    q = torch.randn(1, 3, 8, 64, device=DEVICE)
    kv = torch.randn(1, 2, 8, 64, device=DEVICE)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        attention_fwd(q, kv, kv)
    with pytest.raises(TypeError, match="share a dtype"):
        attention_fwd(q[:, :2], kv.half(), kv.half())


# ----------------------------------------------------------------------------------------------------
# dispatch
# ----------------------------------------------------------------------------------------------------


def test_dispatch(monkeypatch):
    B, HQ, HKV, N, D = 1, 2, 1, 20, 64
    q, k, v = (bnhd(B, h, N, D, torch.float32, s).contiguous() for h, s in ((HQ, 18), (HKV, 19), (HKV, 20)))
    ref = attention_reference(q, k, v)
    # With contiguous inputs the reference (SDPA) returns (B, Hq, N, D)-contiguous memory, the Triton kernel
    # (B, N, Hq, D) memory: the layout tells which implementation ran.
    monkeypatch.setenv("SAPIENS2_KERNELS", "triton")
    o = kernels.attention(q, k, v)
    assert o.transpose(1, 2).is_contiguous() and not o.is_contiguous()
    torch.testing.assert_close(o, ref, rtol=1e-4, atol=1e-5)
    monkeypatch.setenv("SAPIENS2_KERNELS", "torch")
    assert kernels.attention(q, k, v).is_contiguous()
    monkeypatch.setenv("SAPIENS2_KERNELS", "bogus")
    with pytest.raises(ValueError, match="SAPIENS2_KERNELS"):
        kernels.attention(q, k, v)
    if DEVICE == "cpu":
        monkeypatch.setenv("SAPIENS2_KERNELS", "auto")  # CPU tensors: the reference
        assert kernels.attention(q, k, v).is_contiguous()
        monkeypatch.setenv("SAPIENS2_KERNELS", "triton")
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
            kernels.attention(q, k, v)


def test_dispatch_qk_norm_rope(monkeypatch):
    B, HQ, HKV, N, D, P = 1, 2, 1, 20, 64, 16
    q, k = bnhd(B, HQ, N, D, torch.float32, 21), bnhd(B, HKV, N, D, torch.float32, 22)
    wq, wk = torch.randn(D, device=DEVICE), torch.randn(D, device=DEVICE)
    cos, sin = rope_tables(P, D, torch.bfloat16)
    monkeypatch.setenv("SAPIENS2_KERNELS", "triton")
    oq, ok = kernels.qk_norm_rope(q, k, wq, wk, cos, sin, eps=1e-6)
    assert oq.transpose(1, 2).is_contiguous()  # the Triton layout: it ran
    rq, rk = qk_norm_rope_reference(q, k, wq, wk, cos, sin, 1e-6)
    # bf16 tables: the kernel repeats the reference's roundings; at most one bf16 ulp apart (see above).
    torch.testing.assert_close(oq, rq, rtol=2 ** -7, atol=0)
    torch.testing.assert_close(ok, rk, rtol=2 ** -7, atol=0)


# ----------------------------------------------------------------------------------------------------
# The model on the fused path
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rope_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_model_forward_on_triton_kernels_matches_reference(rope_dtype, dtype, monkeypatch):
    """A whole forward with SAPIENS2_KERNELS=triton vs the reference kernels. Tolerances: fp32 1e-5
    (the kernels agree to ~1e-6 per op); bf16 3e-2 (bf16 activations: the flash kernel's fp32
    accumulation and the reference SDPA round differently, ~4e-3 per op over 3 blocks)."""
    from sapiens2 import Sapiens2, Sapiens2Config

    torch.manual_seed(0)
    config = Sapiens2Config(embed_dim=128, depth=3, num_heads=2, full_attention_first=1, full_attention_last=1,
                            gqa_kv_heads=1, rope_dtype=rope_dtype)
    model = Sapiens2(config).eval().to(DEVICE, dtype)
    x = torch.randn(2, 3, 48, 32, device=DEVICE, dtype=dtype)  # N = 9 + 6 tokens: a ragged tile
    calls = []
    for module_name, hook in (("sapiens2.kernels.attention", "_attention_triton"), ("sapiens2.kernels.qk_norm_rope", "_qk_norm_rope_triton")):
        module = sys.modules[module_name]
        original = getattr(module, hook)
        monkeypatch.setattr(module, hook, lambda *a, _f=original, _n=hook: calls.append(_n) or _f(*a))
    from sapiens2.kernels import dispatch

    monkeypatch.setattr(dispatch, "_CHECKED", {})  # each op's first-launch check calls its hook once more
    with torch.no_grad():
        monkeypatch.setenv("SAPIENS2_KERNELS", "torch")
        expected = model(x).tokens
        monkeypatch.setenv("SAPIENS2_KERNELS", "triton")
        got = model(x).tokens
    err = ((got.float() - expected.float()).abs().max() / expected.float().abs().max()).item()
    _record(f"model forward {dtype} rope {rope_dtype}", err)
    assert err < (1e-5 if dtype == torch.float32 else 3e-2)
    # the fused path really ran, once per block for each op
    assert sorted(set(calls)) == ["_attention_triton", "_qk_norm_rope_triton"]
    assert len(calls) == 2 * config.depth + len(dispatch.first_launch_results()) == 2 * config.depth + 2


# ----------------------------------------------------------------------------------------------------
# GPU-only hazards, checked on small shapes: NaN bit patterns, int64 offsets, the grid limit
# ----------------------------------------------------------------------------------------------------


from sapiens2.kernels import grid_triton  # noqa: E402
from sapiens2.kernels.qk_norm_rope_triton import _round  # noqa: E402


@triton.jit
def _round_bf16_kernel(x_ptr, o_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.store(o_ptr + offs, _round(x, tl.bfloat16), mask=offs < n)


def test_round_to_bf16_keeps_nan_and_matches_torch():
    """NVIDIA's canonical NaN is 0x7FFFFFFF; adding the rounding bias to its bits used to carry into the sign
    (-0.0), and 0xFFFFFFFF wrapped to +0.0. Every NaN must stay NaN, every other value round like torch."""
    nan_bits = [0x7FFFFFFF, 0xFFFFFFFF, 0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FBFFFFF]
    finite = torch.tensor([0.0, -0.0, 1.0, 1.00390625, 1.005859375, -3.1e38, 3.3895e38, 1e-40, 65504.0,
                           float("inf"), float("-inf"), 1.0 + 2**-8, 1.0 + 3 * 2**-8])
    bits = torch.tensor(nan_bits, dtype=torch.int64).to(torch.int32)  # two's complement for >= 2**31
    x = torch.cat([bits.view(torch.float32), finite, torch.randn(64) * 100]).to(DEVICE)
    out = torch.empty_like(x)
    _round_bf16_kernel[(1,)](x, out, x.numel(), BLOCK=triton.next_power_of_2(x.numel()))
    n = len(nan_bits)
    assert out[:n].isnan().all(), f"NaN patterns came out as {out[:n].tolist()}"
    torch.testing.assert_close(out[n:], x[n:].to(torch.bfloat16).float(), rtol=0, atol=0)


def test_qk_norm_rope_propagates_canonical_nan():
    """End to end on the released models' default path (bf16 tables): a token holding 0x7FFFFFFF comes out
    NaN in both implementations, never as zeros."""
    B, HQ, HKV, N, D, P = 1, 2, 1, 20, 64, 16
    q, k = bnhd(B, HQ, N, D, torch.float32, 23), bnhd(B, HKV, N, D, torch.float32, 24)
    q[0, 1, 12, 5] = torch.tensor(0x7FFFFFFF, dtype=torch.int32).view(torch.float32)
    wq, wk = torch.randn(D, device=DEVICE), torch.randn(D, device=DEVICE)
    cos, sin = rope_tables(P, D, torch.bfloat16)
    oq, _ = qk_norm_rope_fwd(q, k, wq, wk, cos, sin, 1e-6, block_n=QK_BLOCK_N)
    rq, _ = qk_norm_rope_reference(q, k, wq, wk, cos, sin, 1e-6)
    assert rq[0, 1, 12].isnan().all() and oq[0, 1, 12].isnan().all()
    assert not oq[0, 0].isnan().any() and not oq[0, 1, :12].isnan().any()


@triton.jit
def _coords_kernel(out_ptr, stride_b, stride_h, num_tiles, HEADS: tl.constexpr):
    tile, b, h = grid_triton.program_coords(num_tiles, HEADS)
    row = out_ptr + tl.program_id(0) * 4
    tl.store(row, tile.to(tl.int64))
    tl.store(row + 1, b)
    tl.store(row + 2, h)
    tl.store(row + 3, b * stride_b + h * stride_h)  # the kernels' base offset of head h of image b


def test_program_coords_cover_the_grid_in_int64():
    """The flat grid's (tile, b, h) in tiles-fastest order, and the base offset b * stride_b + h * stride_h
    in int64: with stride_b = 2**30 (an int32 argument) image 2 starts at 2**31, past int32."""
    num_tiles, B, H, stride_b, stride_h = 3, 3, 2, 2**30, 1000
    grid = grid_triton.flat_grid(num_tiles, B * H)
    out = torch.zeros(grid[0], 4, dtype=torch.int64, device=DEVICE)
    _coords_kernel[grid](out, stride_b, stride_h, num_tiles, HEADS=H)
    want = [[t, b, h, b * stride_b + h * stride_h] for b in range(B) for h in range(H) for t in range(num_tiles)]
    assert out.tolist() == want


def test_grid_has_no_65535_limit(monkeypatch):
    """B * H = 70,000 (head) programs: one flat axis, no axis above CUDA's 65,535 limit for axes 1 and 2."""
    from sapiens2.kernels import attention_triton as at

    grids = []
    monkeypatch.setattr(at, "_launch", lambda kernel, name, grid, *a: grids.append(grid({"BLOCK_M": 16, "BLOCK_N": 16})))
    q = torch.zeros(70_000, 1, 2, 16, device=DEVICE)
    at.attention_fwd(q, q, q)
    assert grids == [(70_000,)]
    with pytest.raises(ValueError, match="grid limit"):
        grid_triton.flat_grid(2**16, 2**15)


# ----------------------------------------------------------------------------------------------------
# fastest: never slower than SDPA (decision logic with injected timers)
# ----------------------------------------------------------------------------------------------------

import logging  # noqa: E402

from sapiens2.kernels import dispatch  # noqa: E402


@pytest.fixture
def fresh_dispatch(monkeypatch):
    monkeypatch.setattr(dispatch, "_DECIDED", {})
    monkeypatch.setattr(dispatch, "_LOGGED", set())
    monkeypatch.setattr(dispatch, "_CHECKED", {})
    monkeypatch.delenv("SAPIENS2_KERNELS_CACHE", raising=False)
    monkeypatch.setenv("SAPIENS2_KERNELS", "auto")
    return dispatch


def fake_timer(ms: dict, calls: list):
    """A timer that runs nothing: the time of each run function is looked up by its name."""
    def timer(fn):
        calls.append(fn.__name__)
        return ms[fn.__name__]
    return timer


def named(name):
    def fn():
        raise AssertionError("a fake timer must not run the function")
    fn.__name__ = name
    return fn


@pytest.mark.parametrize("ms,want", [({"tri": 1.0, "sdpa": 2.0}, "triton"), ({"tri": 2.0, "sdpa": 1.0}, "torch"),
                                     ({"tri": 1.0, "sdpa": 1.0}, "torch")])
def test_auto_picks_the_faster_once_and_logs_once(fresh_dispatch, caplog, ms, want):
    calls = []
    with caplog.at_level(logging.INFO, logger="sapiens2.kernels"):
        for _ in range(3):
            assert dispatch.faster("case-a", named("tri"), named("sdpa"), timer=fake_timer(ms, calls)) == want
    assert calls == ["tri", "sdpa"]  # timed once, then cached
    assert len([r for r in caplog.records if "case-a" in r.getMessage()]) == 1
    assert dispatch.decisions()["case-a"] == {"choice": want, "ms": {"triton": ms["tri"], "torch": ms["sdpa"]}}
    # another case is timed on its own
    dispatch.faster("case-b", named("tri"), named("sdpa"), timer=fake_timer({"tri": 5.0, "sdpa": 1.0}, calls))
    assert calls == ["tri", "sdpa", "tri", "sdpa"] and dispatch.decisions()["case-b"]["choice"] == "torch"


def test_auto_falls_back_when_triton_fails(fresh_dispatch, caplog, tmp_path, monkeypatch):
    """A Triton side that raises (a configuration this GPU or Triton cannot compile or launch) does not take the
    default path down: auto runs the reference, warns once with the error, remembers it in the process only (a
    fixed Triton is tried again in the next process), and never times the reference for nothing."""
    path = tmp_path / "choices.json"
    monkeypatch.setenv("SAPIENS2_KERNELS_CACHE", str(path))
    calls = []

    def timer(fn):
        calls.append(fn.__name__)
        if fn.__name__ == "tri":
            raise RuntimeError("out of resource: shared memory")
        return 1.0
    with caplog.at_level(logging.INFO, logger="sapiens2.kernels"):
        for _ in range(2):
            assert dispatch.faster("case-f", named("tri"), named("sdpa"), timer=timer) == "torch"
    assert calls == ["tri"]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "case-f" in r.getMessage()]
    assert len(warnings) == 1 and "out of resource" in warnings[0].getMessage()
    assert dispatch.decisions()["case-f"]["triton_error"] == "RuntimeError: out of resource: shared memory"
    assert not path.exists()


def test_auto_disk_cache(fresh_dispatch, tmp_path, monkeypatch):
    path = tmp_path / "sub" / "choices.json"
    monkeypatch.setenv("SAPIENS2_KERNELS_CACHE", str(path))
    calls = []
    assert dispatch.faster("case", named("tri"), named("sdpa"), fake_timer({"tri": 3.0, "sdpa": 1.0}, calls)) == "torch"
    assert len(calls) == 2 and path.exists()
    monkeypatch.setattr(dispatch, "_DECIDED", {})  # a new process: read from disk, time nothing
    assert dispatch.faster("case", named("tri"), named("sdpa"), fake_timer({}, calls)) == "torch"
    assert len(calls) == 2
    path.write_text("not json")  # a broken cache: timed again, not fatal
    monkeypatch.setattr(dispatch, "_DECIDED", {})
    assert dispatch.faster("case", named("tri"), named("sdpa"), fake_timer({"tri": 1.0, "sdpa": 3.0}, calls)) == "triton"


def test_fastest_attention_follows_the_timing(fresh_dispatch, monkeypatch):
    """kernels.attention under SAPIENS2_KERNELS=fastest on (pretend) CUDA tensors runs what the timer found
    faster; the case key separates inference from training; CPU tensors never time anything."""
    monkeypatch.setenv("SAPIENS2_KERNELS", "fastest")
    B, HQ, HKV, N, D = 1, 2, 1, 20, 16
    q, k, v = (bnhd(B, h, N, D, torch.float32, s).contiguous() for h, s in ((HQ, 25), (HKV, 26), (HKV, 27)))
    timed = []
    monkeypatch.setattr(dispatch, "time_ms", lambda fn: timed.append(fn) or 1.0)
    if DEVICE == "cpu":
        assert kernels.attention(q, k, v).is_contiguous() and not timed  # CPU: the reference, untimed
        monkeypatch.setattr(dispatch, "on_cuda", lambda tensors: True)
    # the timer says triton is slower: SDPA runs (contiguous (B, H, N, D) output)
    speeds = iter([2.0, 1.0, 1.0, 2.0])
    monkeypatch.setattr(dispatch, "time_ms", lambda fn: next(speeds))
    assert kernels.attention(q, k, v).is_contiguous()
    assert kernels.attention(q, k, v).is_contiguous()  # cached: the iterator is not consumed further
    # training is another case: timed again, and this time triton wins ((B, N, H, D) memory)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o = kernels.attention(*leaves)
    assert o.transpose(1, 2).is_contiguous() and not o.is_contiguous()
    keys = sorted(dispatch.decisions())
    assert [key.rsplit("|", 1)[1] for key in keys] == ["infer", "train"]
    # the runners the timer gets really run both implementations (inference, and training with a backward)
    ran = []
    monkeypatch.setattr(dispatch, "time_ms", lambda fn: (fn(), ran.append(1), 1.0)[-1])
    q2, k2, v2 = (t[:, :, :17] for t in (q, k, v))  # a new case
    kernels.attention(q2, k2, v2)
    kernels.attention(*(t.clone().requires_grad_() for t in (q2, k2, v2)))
    assert len(ran) == 4 and len(dispatch.decisions()) == 4
    monkeypatch.setenv("SAPIENS2_KERNELS", "triton")  # forced: no timing, triton
    assert kernels.attention(q, k, v).transpose(1, 2).is_contiguous()


def test_qk_norm_rope_with_learned_tables_takes_the_reference_visibly(fresh_dispatch, monkeypatch, caplog):
    B, HQ, HKV, N, D, P = 1, 2, 1, 20, 16, 16
    q, k = bnhd(B, HQ, N, D, torch.float32, 28).contiguous(), bnhd(B, HKV, N, D, torch.float32, 29).contiguous()
    w = torch.ones(D, device=DEVICE)
    cos, sin = (t.requires_grad_() for t in rope_tables(P, D, torch.float32))
    monkeypatch.setattr(dispatch, "on_cuda", lambda tensors: True)
    with caplog.at_level(logging.INFO, logger="sapiens2.kernels"):
        oq, _ = kernels.qk_norm_rope(q, k, w, w, cos, sin)
        kernels.qk_norm_rope(q, k, w, w, cos, sin)
    assert oq.is_contiguous()  # the reference's layout
    assert oq.requires_grad and torch.autograd.grad(oq.sum(), cos)[0].abs().sum() > 0
    assert len([r for r in caplog.records if "no gradient" in r.getMessage()]) == 1
    monkeypatch.setenv("SAPIENS2_KERNELS", "triton")
    with pytest.raises(RuntimeError, match="no gradient"):
        kernels.qk_norm_rope(q, k, w, w, cos, sin)
    with pytest.raises(ValueError, match="no gradient"):
        qk_norm_rope_triton(q, k, w, w, cos, sin)
    # tables without gradients: Triton in auto on CUDA, untimed
    oq, _ = kernels.qk_norm_rope(q, k, w, w, cos.detach(), sin.detach())
    assert oq.transpose(1, 2).is_contiguous()


def test_5b_heads_padded_to_80_in_storage():
    """Head dim 76: qk_norm_rope writes each head into 80 columns (norm and rotation over the true 76, the
    reference's values), attention takes those as they are and copies only the unaligned v, and the
    results are identical to attention on the unpadded layout."""
    B, HQ, HKV, N, D, P = 1, 2, 1, 20, 76, 16
    q, k, v = bnhd(B, HQ, N, D, torch.float32, 30), bnhd(B, HKV, N, D, torch.float32, 31), bnhd(B, HKV, N, D, torch.float32, 32)
    wq, wk = torch.randn(D, device=DEVICE), torch.randn(D, device=DEVICE)
    cos, sin = rope_tables(P, D, torch.float32)
    oq, ok = qk_norm_rope_fwd(q, k, wq, wk, cos, sin, 1e-6, block_n=QK_BLOCK_N)
    assert oq.stride() == (N * HQ * 80, 80, HQ * 80, 1) and ok.stride() == (N * HKV * 80, 80, HKV * 80, 1)
    rq, rk = qk_norm_rope_reference(q, k, wq, wk, cos, sin, 1e-6)
    torch.testing.assert_close(oq, rq, rtol=1e-5, atol=1e-5)  # fp32: reduction order only
    torch.testing.assert_close(ok, rk, rtol=1e-5, atol=1e-5)
    assert grid_triton.aligned_heads(oq) is oq and grid_triton.aligned_heads(ok) is ok  # no copy
    assert not grid_triton.heads_aligned(v) and grid_triton.heads_aligned(grid_triton.aligned_heads(v))
    o_padded, _ = attention_fwd(oq, ok, v, blocks=BLOCKS)
    o_plain, _ = attention_fwd(oq.contiguous(), ok.contiguous(), v, blocks=BLOCKS)
    assert torch.equal(o_padded, o_plain)
    assert rel_err(o_padded, attention_reference(rq, rk, v)) < 2e-5


@pytest.mark.parametrize("rope_dtype", ["bfloat16", "float32"])
def test_triton_rope_is_rope_reference(rope_dtype):
    """The NOTE in sapiens2.Attention: the Triton kernel re-implements kernels.rope_reference. On the model's
    own tables (RotaryEmbedding2D: [y | x | y | x] halves, both precision conventions) and prefix count, the
    kernel must equal rope_reference applied after RMSNorm, called here directly (not through
    qk_norm_rope_reference), so that a change to either side fails here."""
    from sapiens2.kernels import rms_norm_reference, rope_reference
    from sapiens2 import RotaryEmbedding2D, Sapiens2Config

    config = Sapiens2Config(embed_dim=152, depth=2, num_heads=2, rope_dtype=rope_dtype)  # head dim 76, like 5b
    h, w = 5, 4
    cos, sin = RotaryEmbedding2D(config)(h, w, torch.device(DEVICE), torch.float32)
    N, D = config.num_prefix_tokens + h * w, config.head_dim
    q, k = bnhd(1, 2, N, D, torch.float32, 33), bnhd(1, 1, N, D, torch.float32, 34)
    wq, wk = torch.randn(D, device=DEVICE), torch.randn(D, device=DEVICE)
    eps = config.norm_eps
    oq, ok = qk_norm_rope_fwd(q, k, wq, wk, cos, sin, eps, block_n=QK_BLOCK_N)
    for got, x, weight in ((oq, q, wq), (ok, k, wk)):
        want = rope_reference(rms_norm_reference(x, weight, eps), cos, sin)
        if rope_dtype == "float32":
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # fp32: reduction order only
        else:  # bf16 rotation: the same roundings, at most one bf16 ulp apart on rare elements
            torch.testing.assert_close(got, want, rtol=2 ** -7, atol=0)
            assert (got != want).double().mean().item() <= 0.01
