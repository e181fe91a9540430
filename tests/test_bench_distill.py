"""bench/distill.py's measurements on things of known size: the peak RSS a block adds (CpuRssPeak, as each child
process measures its calls), one ONNX row measured in a fresh child process, and the agreement numbers."""

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT / "bench"))  # after the root, so bench/kernels.py cannot shadow kernels/
import distill  # noqa: E402
import e2e_measure  # noqa: E402

MiB = 2**20


def resettable_peak() -> bool:
    with e2e_measure.CpuRssPeak() as probe:
        pass
    return probe.method.startswith("VmHWM")


@pytest.mark.skipif(not resettable_peak(), reason="needs Linux's /proc/self/clear_refs to reset the peak RSS")
def test_peak_rss_counts_the_block_and_not_what_came_before():
    # RSS moves by whole pages and by what the interpreter itself allocates meanwhile (a few MiB): 8 MiB of slack
    before = torch.ones(64 * MiB // 4)  # 64 MiB, touched before the block: in RSS, not in the peak above it
    with e2e_measure.CpuRssPeak() as rss:
        block = torch.ones(256 * MiB // 4)  # 256 MiB written: resident
        del block
    print(f"256 MiB block: peak {rss.peak_mb:.1f} MiB above {rss.before_kb / 1024:.0f} MiB ({rss.method})")
    assert rss.peak_mb == pytest.approx(256, abs=8)
    del before
    with e2e_measure.CpuRssPeak() as rss:  # the earlier peak was reset: a smaller block reads as itself
        small = torch.ones(32 * MiB // 4)
        del small
    assert rss.peak_mb == pytest.approx(32, abs=8)


def test_onnx_row_in_a_fresh_child_times_and_returns_its_output(tmp_path):
    import onnx
    from onnx import TensorProto, helper

    weight = np.random.default_rng(0).standard_normal((8, 5)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "tiny",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 5])],
        [helper.make_tensor("w", TensorProto.FLOAT, weight.shape, weight.flatten())])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), tmp_path / "tiny.onnx")
    x = np.random.default_rng(1).standard_normal((3, 8)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    row = distill.in_child({"kind": "onnx", "path": str(tmp_path / "tiny.onnx"), "pixels": str(tmp_path / "x.npy"),
                            "output": str(tmp_path / "y.npy"), "task": "seg", "device": "cpu", "dtype": "fp32",
                            "warmup": 1, "reps": 3})
    assert len(row["times_ms"]) == 3 and row["median_ms"] == sorted(row["times_ms"])[1]
    assert row["rss_loaded_mb"] > 0 and row["peak_mb"] >= 0 and "one process per row" in row["memory_method"]
    # fp32 MatMul of 8 terms: onnxruntime and numpy may sum in another order, a few fp32 ulps of the result
    np.testing.assert_allclose(np.load(tmp_path / "y.npy"), x @ weight, rtol=1e-5, atol=1e-5)


def test_agreement_numbers_on_known_outputs():
    want = np.zeros((1, 3, 2, 2), np.float32)
    want[0, 0] = 1  # class 0 everywhere
    got = want.copy()
    got[0, 2, 1, 1] = 3  # one pixel of four becomes class 2
    assert distill.agreement("seg", got, want) == {"max_abs_difference": 3.0, "mean_abs_difference": 0.25,
                                                   "same_class_pixels": 0.75}
    assert distill.agreement("normal", got, want) == {"max_abs_difference": 3.0, "mean_abs_difference": 0.25}
