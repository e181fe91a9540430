"""bench/inspect_kernels.py on a small subset: the Triton kernels compiled ahead of time for Hopper (sm_90a),
with no GPU, and read back from the machine code (ptxas and cuobjdump ship inside the triton wheel).

Checks what a GPU-less CI can prove about the GPU path: every bf16 kernel spills nothing, attention runs on
wgmma (HGMMA in the SASS), and the 5b kernels (head dim 76) make no 16-bit scalar global loads (the aligned
layout, kernels/grid_triton.py). The full table for all presets is bench/results/inspect_kernels_sm90a.json.
"""

import json
import sys

import pytest

pytest.importorskip("triton")

from conftest import ROOT  # noqa: E402

sys.path.insert(0, str(ROOT / "bench"))


@pytest.fixture(scope="module")
def inspect_kernels():
    module = pytest.importorskip("inspect_kernels")
    try:
        module.nvidia_tool("cuobjdump")
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return module


def test_5b_kernels_on_hopper(inspect_kernels, tmp_path, capsys):
    out = tmp_path / "rows.json"
    inspect_kernels.main(["--arch", "sm_90a", "--presets", "5b", "--blocks", "mha", "--first-config",
                          "--only", "attn_fwd|qk_norm_rope_fwd", "--json", str(out)])
    data = json.loads(out.read_text())
    rows = {r["name"]: r for r in data["rows"]}
    assert sorted(rows) == ["_attn_fwd_kernel", "_qk_norm_rope_fwd_kernel"]
    assert "_attn_fwd_kernel" in capsys.readouterr().out  # the table
    for r in rows.values():
        assert r["dtype"] == "bfloat16" and r["D"] == 76 and r["N"] == 3081 and r["B"] == 8
        assert r["registers"] and r["spill_store_bytes"] == 0 and r["spill_load_bytes"] == 0, r
        assert r["ldl"] == 0 and r["stl"] == 0, r
        assert r["ldg_16bit"] == 0, f"{r['name']}: {r['ldg_16bit']} 16-bit scalar global loads"
    attn = rows["_attn_fwd_kernel"]
    assert attn["hgmma"] > 0 and attn["ldgsts"] > 0  # wgmma, and cp.async pipelining of K/V
    assert attn["constexprs"]["HEAD_DIM"] == 76 and attn["grid"] == [25 * 8 * 32]


def test_sass_counting():
    from inspect_kernels import sass_counts

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
