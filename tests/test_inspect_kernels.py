"""bench/inspect_kernels.py on a small subset: the Triton kernels compiled ahead of time for Hopper (sm_90a),
with no GPU, and read back from the machine code (ptxas and cuobjdump ship inside the triton wheel).

Checks what a GPU-less CI can prove about the GPU path: every bf16 kernel spills nothing, attention runs on
wgmma (HGMMA in the SASS), and the 5b kernels (head dim 76) make no 16-bit scalar global loads (the aligned
layout, kernels/grid_triton.py). The full table for all presets is bench/results/inspect_kernels_sm90a.json.
"""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

# find_spec: no need to import triton just to know whether it is installed.
if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

from conftest import ROOT  # noqa: E402


def load_inspect_kernels():
    """bench/inspect_kernels.py as a module, by its path: putting bench/ on sys.path would let its kernels.py
    (the benchmark) shadow the kernels package for every later test."""
    spec = importlib.util.spec_from_file_location("inspect_kernels", ROOT / "bench" / "inspect_kernels.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_inspect(tmp_path, *args):
    """bench/inspect_kernels.py --arch sm_90a ARGS in its own process (compiling for real needs the kernel modules
    imported without TRITON_INTERPRET, which tests/conftest.py sets for this whole pytest process): the finished
    process and the rows it wrote."""
    out = tmp_path / "rows.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "inspect_kernels.py"), "--arch", "sm_90a", *args,
                          "--json", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return run, json.loads(out.read_text())["rows"]


@pytest.fixture(scope="module")
def cuobjdump():
    try:
        return load_inspect_kernels().nvidia_tool("cuobjdump")
    except FileNotFoundError as e:
        pytest.skip(str(e))


def test_5b_kernels_on_hopper(cuobjdump, tmp_path):
    """Both attention files (attention_triton.py's forward, and its Hopper variants' first configuration) and
    qk_norm_rope at 5b: no spills, no 16-bit scalar loads, wgmma and cp.async."""
    run, rows = run_inspect(tmp_path, "--presets", "5b", "--blocks", "mha", "--first-config",
                            "--only", "attn_fwd|qk_norm_rope_fwd")
    rows = {r["name"]: r for r in rows}
    assert sorted(rows) == ["_attn_fwd_hopper_kernel", "_attn_fwd_kernel", "_qk_norm_rope_fwd_kernel"]
    assert "_attn_fwd_kernel" in run.stdout and "_attn_fwd_hopper_kernel" in run.stdout  # the table
    for r in rows.values():
        assert r["dtype"] == "bfloat16" and r["D"] == 76 and r["N"] == 3081 and r["B"] == 8
        assert r["registers"] and r["spill_store_bytes"] == 0 and r["spill_load_bytes"] == 0, r
        assert r["ldl"] == 0 and r["stl"] == 0, r
        assert r["ldg_16bit"] == 0, f"{r['name']}: {r['ldg_16bit']} 16-bit scalar global loads"
    for attn in rows["_attn_fwd_kernel"], rows["_attn_fwd_hopper_kernel"]:
        assert attn["hgmma"] > 0 and attn["ldgsts"] > 0  # wgmma, and cp.async pipelining of K/V
        assert attn["constexprs"]["HEAD_DIM"] == 76 and attn["grid"] == [25 * 8 * 32]
    assert rows["_attn_fwd_kernel"]["loop_ex2_under_wgmma"] == 0  # the base kernel: MMA and softmax alternate
    # 128-bit loads at head dim 76 too: the first 64 columns are loaded without a column mask (a true cols < 76
    # that Triton cannot prove would narrow them; before, this row had none).
    assert rows["_attn_fwd_kernel"]["ldg_128bit"] > 0


def test_gqa_packed_forward_on_hopper(cuobjdump, tmp_path):
    """GQA packing at 0.8b (D = 80, GQA 2: the most registers): the packed 256-row tile (128 tokens x 2 heads)
    compiles to wgmma + cp.async without spills or local memory, and its launch reads half the K/V bytes of
    the unpacked 128-row tile (one program per K/V head instead of per query head, same tokens' worth of rows
    per K/V tile load)."""
    _, rows = run_inspect(tmp_path, "--presets", "0.8b", "--blocks", "gqa2", "--only", "attn_fwd_hopper",
                          "--cfg", "^(128x64w8s3|256x64w8s2p)$")
    rows = {r["constexprs"]["PACK"]: r for r in rows}
    plain, packed = rows[False], rows[True]
    assert (plain["constexprs"]["BLOCK_M"], packed["constexprs"]["BLOCK_M"]) == (128, 256)
    assert packed["spill_store_bytes"] == packed["spill_load_bytes"] == packed["ldl"] == packed["stl"] == 0, packed
    assert packed["hgmma"] > 0 and packed["ldgsts"] > 0 and packed["ldg_16bit"] == 0
    assert (packed["query_heads_per_program"], packed["tokens_per_program"]) == (2, 128)
    assert plain["grid"] == [25 * 8 * 16] and packed["grid"] == [25 * 8 * 8]  # N = 3081: 25 tiles, B = 8
    assert packed["kv_bytes_per_program"] == plain["kv_bytes_per_program"] == 2 * 3081 * 80 * 2
    assert packed["kv_bytes_total"] * 2 == plain["kv_bytes_total"]


def test_tma_and_overlapped_softmax_on_hopper(cuobjdump, tmp_path):
    """The 5b forward (D = 76, the awkward one) in three loop variants, compiled for sm_90a:
    - overlapped order (OVERLAP, suffix o): the exp2s of the softmax are issued while the previous tile's P V wgmma
      is in flight (all but at most the two rescale factors per thread and iteration);
    - the same with K/V through TMA descriptors (suffix to): UTMALDG tensor loads and no cp.async for K/V;
    - the plain order: MMAs and softmax alternate (no exp2 under a wgmma), which shows the count can tell them apart;
    - the TMA one on a persistent grid (suffix tog).
    None spills."""
    _, rows = run_inspect(tmp_path, "--presets", "5b", "--blocks", "mha", "--only", "attn_fwd_hopper",
                          "--cfg", "^128x64w8s3(|o|to|tog)$")
    persistent, = [r for r in rows if r["constexprs"]["PERSISTENT"]]
    rows = {(r["constexprs"]["TMA"], r["constexprs"]["OVERLAP"]): r for r in rows if not r["constexprs"]["PERSISTENT"]}
    assert sorted(rows) == [(False, False), (False, True), (True, True)]
    for r in rows.values():
        assert r["spill_store_bytes"] == r["spill_load_bytes"] == r["ldl"] == r["stl"] == 0, r
        assert r["hgmma"] > 0 and r["ldg_16bit"] == 0 and r["loop_ex2"] >= 34  # 128 x 64 scores / 256 threads
    plain, overlapped, tma = rows[False, False], rows[False, True], rows[True, True]
    assert plain["loop_ex2_under_wgmma"] == 0
    for r in (overlapped, tma):  # each thread's 32 exp2s of P overlap; its 2 rescale factors may not
        assert r["loop_ex2_under_wgmma"] >= r["loop_ex2"] - 2, r
    assert tma["utmaldg"] > 0 and tma["ldgsts"] == 0 and overlapped["utmaldg"] == 0 and overlapped["ldgsts"] > 0
    # the persistent grid (suffix g): one program per SM (132), the same loop, no spills; a few values wait in
    # local memory outside the loops (its registers reach 255 at D = 76)
    assert persistent["grid"] == [132] and persistent["kv_bytes_total"] == tma["kv_bytes_total"]
    assert persistent["loop_local_memory"] == 0 and persistent["spill_store_bytes"] <= 8  # 3.6: 4 B at GQA, outside
    assert persistent["utmaldg"] > 0 and persistent["loop_ex2_under_wgmma"] >= persistent["loop_ex2"] - 2


def test_two_programs_per_sm_with_128_registers(cuobjdump, tmp_path):
    """The r128 forward (plain order, registers capped at 128): at 0.8b (D = 80) and 5b (D = 76) two 8-warp programs
    fit an SM, with no local memory inside the loop. Outside it, at D = 80, a few values wait in local memory across
    the loop (stored before it, loaded after): with triton 3.9 none of it counts as spills, with triton 3.6 (the
    H200 machines') 8 bytes do, once per program."""
    _, rows = run_inspect(tmp_path, "--presets", "0.8b,5b", "--blocks", "mha", "--only", "attn_fwd_hopper",
                          "--cfg", "r128$")
    assert [r["preset"] for r in rows] == ["0.8b", "5b"]
    for r in rows:
        assert r["maxnreg"] == 128 and r["registers"] <= 128 and r["ctas_per_sm"] == 2, r
        assert r["loop_local_memory"] == 0 and r["spill_store_bytes"] <= 8, r
        assert r["hgmma"] > 0 and r["loop_ex2_under_wgmma"] == 0  # the plain order


def test_backward_variants_on_hopper(cuobjdump, tmp_path):
    """The 5b backward (D = 76) variants, compiled for sm_90a without spills: dQ with OVERLAP keeps its dQ MMA in
    flight under most of the next tile's exp2s, dK/dV with OVERLAP under some of them, and
    with TMA both load their streamed tiles with UTMALDG instead of cp.async."""
    _, rows = run_inspect(tmp_path, "--presets", "5b", "--blocks", "mha", "--only", "dkdv_hopper|dq_hopper",
                          "--cfg", "^(128x64w8s3(o|to)|32x128w8s3(o|t))$")
    rows = {(r["name"], r["constexprs"]["TMA"], r["constexprs"]["OVERLAP"]): r for r in rows}
    assert len(rows) == 4
    for r in rows.values():
        assert r["spill_store_bytes"] == r["spill_load_bytes"] == r["ldl"] == r["stl"] == 0, r
        assert r["hgmma"] > 0 and r["ldg_16bit"] == 0
    dq, dkdv = "_attn_bwd_dq_hopper_kernel", "_attn_bwd_dkdv_hopper_kernel"
    dq_overlap, dq_tma = rows[dq, False, True], rows[dq, True, True]
    dkdv_overlap, dkdv_tma = rows[dkdv, False, True], rows[dkdv, True, False]
    # dQ: 30-31 of 32 with triton 3.9, 29 with 3.6; the plain order reaches at most half (9-16 of 32)
    assert dq_overlap["loop_ex2_under_wgmma"] >= 0.75 * dq_overlap["loop_ex2"] > 0, dq_overlap
    # dK/dV: 16 of 16 with triton 3.9, 7 with 3.6; the plain order none
    assert dkdv_overlap["loop_ex2_under_wgmma"] >= 0.4 * dkdv_overlap["loop_ex2"] > 0, dkdv_overlap
    assert dq_tma["utmaldg"] > 0 and dq_tma["ldgsts"] == 0, dq_tma
    # dK/dV: the q and dO tiles move to TMA (the lse/delta vectors stay on cp.async: 6 with triton 3.9, 48 with 3.6)
    assert dkdv_tma["utmaldg"] > 0 and dkdv_tma["ldgsts"] < dkdv_overlap["ldgsts"], dkdv_tma


def test_softmax_overlap_reading():
    """The loop reader: a wgmma issued at the end of an iteration is in flight at the top of the next one; a wait
    to 0 ends it; a barrier-retry stub after EXIT is not a loop."""
    softmax_overlap = load_inspect_kernels().softmax_overlap
    overlapped = """
        /*0100*/                   MUFU.EX2 R1, R1 ;
        /*0110*/                   MUFU.EX2 R2, R2 ;
        /*0120*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT, gsb0 ;
        /*0130*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*0140*/                   HGMMA.64x64x16.F32.BF16 R56, R92, gdesc[UR8].tnspB, R56, gsb0 ;
        /*0150*/               @P0 BRA 0x100 ;
        /*0160*/                   EXIT ;
        /*0170*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR5], R4 ;
        /*0180*/               @!P0 BRA 0x100 ;
    """
    assert softmax_overlap(overlapped) == {"loop_ex2": 2, "loop_ex2_under_wgmma": 2, "loop_local_memory": 0}
    alternating = overlapped.replace("R56, gsb0 ;", "R56, gsb0 ;\n        /*0148*/ WARPGROUP.DEPBAR.LE gsb0, 0x0 ;")
    assert softmax_overlap(alternating) == {"loop_ex2": 2, "loop_ex2_under_wgmma": 0, "loop_local_memory": 0}
    spilling = overlapped.replace("/*0110*/                   MUFU.EX2 R2, R2 ;", "/*0110*/ STL [R1], R2 ;")
    assert softmax_overlap(spilling) == {"loop_ex2": 1, "loop_ex2_under_wgmma": 1, "loop_local_memory": 1}


def test_sass_counting():
    sass_counts = load_inspect_kernels().sass_counts

    sass = """
        /*0100*/                   LDG.E.U16 R2, desc[UR4][R2.64] ;
        /*0110*/              @!P0 LDG.E.128.CONSTANT R4, desc[UR4][R6.64] ;
        /*0120*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT ;
        /*0130*/               @P1 LDGSTS.E.BYPASS.LTC128B.128 [R3], desc[UR6][R8.64] ;
        /*0140*/                   STL.64 [R1], R4 ;
        /*0150*/                   UTMALDG.2D [UR8], [UR4] ;
    """
    counts = sass_counts(sass)
    assert counts == {"hgmma": 1, "ldl": 0, "stl": 1, "ldg_16bit": 1, "ldg_128bit": 1, "ldgsts": 1,
                      "utmaldg": 1, "stg_16bit": 0}
