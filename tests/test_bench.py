"""Smoke test of bench/e2e.py: it runs end to end on CPU at a tiny config, writes a well-formed JSON (+ table
and plot), and its output comparison really fails when our model is wrong."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")  # the HF rows are the reference the comparison needs

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--device", "cpu", "--presets", "tiny", "--models", "backbone", "--batches", "2", "--size", "32", "32",
        "--impls", "hf,ours,ours-triton", "--warmup", "1", "--reps", "2", "--rounds", "2", "--timeout", "120"]


def run_bench(out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "bench" / "e2e.py"), *TINY, "--out", str(out), *extra],
                          capture_output=True, text=True, timeout=170, cwd=ROOT)


def test_e2e_runs_and_writes_the_schema(tmp_path):
    out = tmp_path / "e2e.json"
    proc = run_bench(out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    assert data["device_kind"] == "cpu" and data["device"]
    assert {"torch", "transformers", "triton", "python"} <= set(data["versions"])
    assert data["memory_method"].startswith("cpu: torch.profiler allocation timeline")
    rows = {r["impl"]: r for r in data["rows"]}
    assert set(rows) == {"hf", "ours", "ours-triton"}
    assert rows["ours-triton"]["status"] == "skipped" and "CUDA" in rows["ours-triton"]["reason"]
    for impl in ("hf", "ours"):
        r = rows[impl]
        assert r["status"] == "ok", r
        assert r["size"] == [32, 32] and r["batch"] == 2 and r["dtype"] == "fp32"
        # two interleaved rounds of two timed calls each, pooled
        assert 0 < r["min_ms"] <= r["median_ms"] <= r["max_ms"] and r["iqr_ms"] >= 0 and len(r["times_ms"]) == 4
        assert r["rounds"] == 2 and len(r["round_medians_ms"]) == 2
        assert r["images_per_s"] == pytest.approx(2 / (r["median_ms"] / 1e3))
        assert r["peak_mb"] > 0 and r["rss_peak_mb"] is not None and r["flops"] > r["flops_attention"] > 0 and r["bytes"] > 0
        assert r["achieved_tflops"] > 0 and r["peak_fraction"] is None  # no peak fraction on CPU
        assert r["reference"] == "hf" and r["rel_err"] <= r["tolerance"]
    assert rows["ours"]["speedup_vs_hf"] > 0
    assert out.with_suffix(".md").read_text().count("| tiny | backbone |") == 3
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_e2e_fails_loudly_on_a_wrong_model(tmp_path):
    out = tmp_path / "e2e.json"
    proc = run_bench(out, "--perturb")  # scales one weight of our model: fast, and wrong
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "MISMATCH" in proc.stderr
    rows = {r["impl"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["hf"]["status"] == "ok"
    assert rows["ours"]["status"] == "MISMATCH" and rows["ours"]["rel_err"] > rows["ours"]["tolerance"]


def test_cpu_allocation_peak_counts_live_tensors_exactly():
    """The CPU memory column: two 4 MB tensors alive at once, then one, then a third: the peak is 8 MB,
    whatever the heap or RSS does."""
    import torch

    sys.path.insert(0, str(ROOT / "bench"))
    import e2e

    x = torch.randn(1000, 1000)  # 4e6 bytes, allocated before: not counted

    def two_at_once():
        a = x + 1
        b = a * 2  # a and b alive: 8e6 bytes
        del a
        return (b - 1).sum()  # b and b - 1: 8e6 again, never 12e6

    assert e2e.cpu_allocation_peak_mb(two_at_once) == pytest.approx(8e6 / 2**20, abs=1e-3)
    held = [torch.randn(1000, 1000)]

    def free_then_allocate():
        held.pop()  # frees 4e6 bytes allocated before the call: the profiler cannot see that free
        return torch.empty(2000, 1000).fill_(1).sum()

    # So the number is the peak of what the call's own allocations hold at once (8e6), an upper bound on
    # the net growth (4e6 here). A forward call frees nothing that existed before it, so there they agree.
    assert e2e.cpu_allocation_peak_mb(free_then_allocate) == pytest.approx(8e6 / 2**20, abs=1e-3)


def test_rounds_pool_the_timed_calls_and_a_failed_round_fails_the_row():
    sys.path.insert(0, str(ROOT / "bench"))
    import e2e

    rounds = [{"status": "ok", "times_ms": [10.0, 12.0], "median_ms": 11.0, "peak_mb": 5.0},
              {"status": "ok", "times_ms": [20.0, 22.0], "median_ms": 21.0, "peak_mb": 6.0}]
    row = e2e.merge_rounds(rounds, batch=4)
    assert row["times_ms"] == [10.0, 12.0, 20.0, 22.0] and row["median_ms"] == 16.0
    assert row["round_medians_ms"] == [11.0, 21.0] and row["rounds"] == 2
    assert row["images_per_s"] == pytest.approx(4 / 0.016) and row["peak_mb"] == 5.0  # memory: first round
    failed = {"status": "timeout", "reason": "over 10 s"}
    assert e2e.merge_rounds([rounds[0], failed], batch=4) is failed
    assert e2e.merge_rounds(rounds[:1], batch=4) is rounds[0]
