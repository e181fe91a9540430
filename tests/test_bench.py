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
    import e2e_measure

    x = torch.randn(1000, 1000)  # 4e6 bytes, allocated before: not counted

    def two_at_once():
        a = x + 1
        b = a * 2  # a and b alive: 8e6 bytes
        del a
        return (b - 1).sum()  # b and b - 1: 8e6 again, never 12e6

    assert e2e_measure.cpu_allocation_peak_mb(two_at_once) == pytest.approx(8e6 / 2**20, abs=1e-3)
    held = [torch.randn(1000, 1000)]

    def free_then_allocate():
        held.pop()  # frees 4e6 bytes allocated before the call: the profiler cannot see that free
        return torch.empty(2000, 1000).fill_(1).sum()

    # So the number is the peak of what the call's own allocations hold at once (8e6), an upper bound on
    # the net growth (4e6 here). A forward call frees nothing that existed before it, so there they agree.
    assert e2e_measure.cpu_allocation_peak_mb(free_then_allocate) == pytest.approx(8e6 / 2**20, abs=1e-3)


def test_rounds_pool_the_timed_calls_and_a_failed_round_fails_the_row():
    sys.path.insert(0, str(ROOT / "bench"))
    import e2e_measure

    rounds = [{"status": "ok", "times_ms": [10.0, 12.0], "median_ms": 11.0, "peak_mb": 5.0},
              {"status": "ok", "times_ms": [20.0, 22.0], "median_ms": 21.0, "peak_mb": 6.0}]
    row = e2e_measure.merge_rounds(rounds, batch=4)
    assert row["times_ms"] == [10.0, 12.0, 20.0, 22.0] and row["median_ms"] == 16.0
    assert row["round_medians_ms"] == [11.0, 21.0] and row["rounds"] == 2
    assert row["images_per_s"] == pytest.approx(4 / 0.016) and row["peak_mb"] == 5.0  # memory: first round
    failed = {"status": "timeout", "reason": "over 10 s"}
    assert e2e_measure.merge_rounds([rounds[0], failed], batch=4) is failed
    assert e2e_measure.merge_rounds(rounds[:1], batch=4) is rounds[0]


def load_bench(name: str):
    """A bench script as a module, by path (bench/ on sys.path would shadow the kernels package with kernels.py)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_each_job_row_is_saved_as_it_finishes_and_append_compares_with_earlier_outputs(tmp_path, monkeypatch):
    """bench/e2e.py rewrites the JSON after every job: a run stopped during its second job (the GPU session's step
    limit sends SIGINT) keeps the first job's row. A later --append run with the same work dir compares its rows
    with that earlier reference's saved outputs, against 3x the reference's measured bf16 noise: 2.5x passes, 4x
    is a MISMATCH (exit 1)."""
    from safetensors.torch import save_file
    import torch

    e2e = load_bench("e2e")
    offset = {"hf": 0.0, "ours": 0.025, "hf-compile": 0.04}  # each impl's output: 1 + offset (hf's noise: 1e-2)
    interrupt = {"ours"}  # the first run is stopped during its ours job

    def job_without_a_child(job, work, timeout):
        if job["impl"] == "ours" and not (tmp_path / "e2e.json").exists():
            raise AssertionError("the hf row must be on disk before the next job starts")
        if job["impl"] in interrupt:
            interrupt.discard(job["impl"])
            raise KeyboardInterrupt
        path = e2e.outputs_file(work, job)
        save_file({"0": torch.full((8,), 1 + offset[job["impl"]])}, str(path))
        return {"status": "ok", "times_ms": [2.0], "median_ms": 2.0, "min_ms": 2.0, "max_ms": 2.0, "iqr_ms": 0.0,
                "images_per_s": 500.0, "outputs_path": str(path),
                "noise_vs_fp32": 1e-2 if job["impl"] == "hf" else None}

    monkeypatch.setattr(e2e, "run_job", job_without_a_child)
    out = tmp_path / "e2e.json"
    args = ["--device", "cpu", "--presets", "tiny", "--models", "backbone", "--batches", "1", "--size", "32", "32",
            "--dtype", "bf16", "--rounds", "1", "--work-dir", str(tmp_path / "work"), "--out", str(out), "--no-render"]
    with pytest.raises(KeyboardInterrupt):
        e2e.main([*args, "--impls", "hf,ours"])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["impl"], r["status"]) for r in rows] == [("hf", "ok")]
    assert not out.with_suffix(".md").exists() and not out.with_suffix(".png").exists()  # --no-render

    assert e2e.main([*args, "--impls", "ours", "--append"]) == 0
    rows = {r["impl"]: r for r in json.loads(out.read_text())["rows"]}
    ours = rows["ours"]
    assert ours["reference"] == "hf" and ours["status"] == "ok" and ours["rel_err"] == pytest.approx(0.025, rel=1e-6)
    assert ours["tolerance"] == pytest.approx(3e-2) and ours["tolerance_from"] == "3 x hf noise_vs_fp32"
    assert e2e.main([*args, "--impls", "hf-compile", "--append"]) == 1
    compiled = {r["impl"]: r for r in json.loads(out.read_text())["rows"]}["hf-compile"]
    assert compiled["status"] == "MISMATCH" and compiled["rel_err"] == pytest.approx(0.04, rel=1e-6)
    assert set(rows) == {"hf", "ours"}  # the earlier rows stayed


def test_reduced_precision_bound_without_a_measured_noise():
    compare = load_bench("e2e_compare")
    assert compare.tolerance_of({"dtype": "fp32", "impl": "hf"}) == (1e-3, "fp32")
    bound, source = compare.tolerance_of({"dtype": "bf16", "impl": "hf", "noise_vs_fp32": None})
    assert bound == compare.REDUCED_PRECISION_FALLBACK and source.startswith("fixed")
    assert compare.tolerance_of({"dtype": "fp16", "impl": "ours", "noise_vs_fp32": 1e-5})[0] == 1e-3  # floor: fp32's


def test_kernel_rows_append_across_processes(tmp_path):
    """bench/kernels.py --append: each process's rows join the JSON the earlier ones wrote; a case measured again
    replaces its row; --impls picks rows by group or name; a JSON that does not parse is refused, not overwritten."""
    kernels_bench = load_bench("kernels")
    out = tmp_path / "kernels.json"
    case = dict(op="attention", model="0.4b", B=8, N=3081, Hq=16, Hkv=8, D=64, dtype="bfloat16")
    first = kernels_bench.Recorder({"device": "gpu"}, out)
    first.add({**case, "pass": "fwd", "impl": "reference", "ms_median": 3.0})
    first.add({**case, "pass": "fwd", "impl": "triton[128x64w8s3]", "ms_median": None, "error": "compile"})
    second = kernels_bench.Recorder({"device": "gpu"}, out, kernels_bench.read_previous(out))
    second.add({**case, "pass": "fwd", "impl": "triton[128x64w8s3]", "ms_median": 1.0})
    data = json.loads(out.read_text())
    assert [(r["impl"], r["ms_median"]) for r in data["rows"]] == [("reference", 3.0), ("triton[128x64w8s3]", 1.0)]
    assert len(data["runs"]) == 2
    wanted = kernels_bench.impl_filter("sdpa,triton[128x64w8s3]")
    names = ["triton", "auto", "reference", "sdpa_flash", "triton[128x64w8s3]", "triton[128x64w8s3o]"]
    assert [n for n in names if wanted(n)] == ["reference", "sdpa_flash", "triton[128x64w8s3]"]
    assert [n for n in names if kernels_bench.impl_filter("forced")(n)] == names[-2:]
    (tmp_path / "half.json").write_text('{"rows": [')
    with pytest.raises(SystemExit) as stopped:
        kernels_bench.read_previous(tmp_path / "half.json")
    assert stopped.value.code == 2
