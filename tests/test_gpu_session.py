"""bench/gpu_session.sh rehearsed on CPU: a stand-in `python3` and `nvidia-smi` first on PATH. The stand-in runs the
light helpers for real (the versions line, --list-forced, bench/session_report.py) and stands in for the GPU
programs: each writes its rows into the --out JSON as the real ones do (one row at a time, an atomic rewrite),
and the test makes steps die after their first row (SIGKILL), fault before any (abort), or hang past their limit.
What must hold: every step's rows written before the kill survive, the next steps still run, the variables every
step needs are set in each, a faulting forced variant is excluded from autotuning afterwards, and $OUT holds at
most 8 files."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from conftest import ROOT

pytestmark = pytest.mark.skipif(shutil.which("timeout") is None or shutil.which("bash") is None,
                                reason="needs bash and timeout")

STUB = '''#!{python}
import json, os, re, signal, sys, time
from pathlib import Path

args = sys.argv[1:]
command = " ".join(args)
with open(os.environ["STUB_LOG"], "a") as log:
    env = {{name: os.environ.get(name) for name in ("TRITON_DEFAULT_FP_FUSION", "TRITON_CACHE_AUTOTUNING",
                                                   "SAPIENS2_TRITON_EXCLUDE", "PYTHONPATH")}}
    log.write(json.dumps({{"args": args, "env": env}}) + "\\n")
if os.environ.get("STUB_FAKE_SETUP") and (args[:1] == ["-c"] or "--list-forced" in args):
    print("versions {{}}" if args[:1] == ["-c"] else "128x64w8s3\\n128x64w8s3o")  # seconds saved: no torch import
    sys.exit(0)
if args[:1] == ["-c"] or "--list-forced" in args or args[:1] == ["bench/session_report.py"]:
    os.execv({python!r}, [{python!r}, *args])  # the light helpers run for real
if args[:2] == ["-m", "pip"]:
    sys.exit(0)
if os.environ.get("STUB_CRASH") and os.environ["STUB_CRASH"] in command:
    os.abort()  # a device fault: the process dies before writing anything
if args[:2] == ["-m", "pytest"]:
    print("13 passed")
    sys.exit(0)


def value(flag):
    return args[args.index(flag) + 1]


script, out = args[0], Path(value("--out"))
if script == "bench/kernels.py":
    key = "rows"
    rows = [{{"op": "attention", "pass": "fwd", "impl": impl, "model": value("--presets"), "Hq": 16, "Hkv": 8,
             "D": 64, "ms_median": 1.0, "TFLOP/s": 100.0}} for impl in value("--impls").split(",")]
elif script == "bench/e2e.py":
    key = "rows"
    rows = [{{"preset": "0.4b", "model": "backbone", "batch": 8, "dtype": "bf16", "impl": impl, "median_ms": 9.0,
             "status": "ok"}} for impl in value("--impls").split(",")]
else:  # bench/pipeline.py
    key = "real_rows"
    rows = [{{"tasks": "seg", "photo": "1080x1440", "workers": w, "real": {{"images_per_s": 90.0}},
             "of_model_alone": 0.9}} for w in value("--workers").split(",")] * 2
if os.environ.get("STUB_STALL") and re.search(os.environ["STUB_STALL"], command):
    time.sleep(1000)  # stuck before its first row (compiling, or hung)
for row in rows:
    data = json.loads(out.read_text()) if out.exists() else {{}}
    data.setdefault(key, []).append(row)
    temp = out.with_name(f".{{out.name}}.{{os.getpid()}}.partial")
    temp.write_text(json.dumps(data))
    os.replace(temp, out)
    if os.environ.get("STUB_HANG") and re.search(os.environ["STUB_HANG"], command):
        time.sleep(1000)  # past its limit: timeout stops it
    if os.environ.get("STUB_KILL"):
        if os.environ.get("STUB_SLOW_KILL") and re.search(os.environ["STUB_SLOW_KILL"], command):
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # outlives timeout's INT at its limit, and then is
            time.sleep(1.5)  # killed from outside, before timeout's own KILL would come
        os.kill(os.getpid(), signal.SIGKILL)  # killed after its first row
'''


def rehearse(tmp_path, **env):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(STUB.format(python=sys.executable))
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho 'name, memory.total [MiB]'\necho 'NVIDIA H200, 143771 MiB'\n")
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    wheels = tmp_path / "whl"
    wheels.mkdir()
    (wheels / "transformers-5.23.0-py3-none-any.whl").write_bytes(b"stand-in")
    out, log = tmp_path / "out", tmp_path / "calls.jsonl"
    run_env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", OUT=str(out), STUB_LOG=str(log),
                   WHEELS=str(wheels), TRITON_CACHE_DIR=str(tmp_path / "triton"), **env)
    run_env.pop("PYTHON", None)
    run_env.pop("SAPIENS2_TRITON_EXCLUDE", None)
    started = time.time()
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_session.sh")], env=run_env, capture_output=True,
                          text=True, timeout=120)
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    return proc, out, calls, time.time() - started


def rows(path, key="rows"):
    return json.loads(path.read_text())[key]


def program_calls(calls):
    return [c for c in calls if c["args"][:1] and c["args"][0].startswith("bench/") and "--out" in c["args"]
            or c["args"][:2] == ["-m", "pytest"]]


def test_every_step_keeps_its_rows_when_killed(tmp_path):
    """Every GPU step dies (SIGKILL) right after its first row; one forced variant faults; autotune hangs past
    its limit. All steps still run in order, each one's first row is in $OUT, the faulting variant is named and
    kept out of autotuning, the two Triton variables are set in every step, at most 8 files come back, and the
    step limits fit the deadline."""
    proc, out, calls, seconds = rehearse(tmp_path, STUB_KILL="1", STUB_CRASH="--impls triton[128x64w8s3to]",
                                         STUB_HANG="--impls triton,auto$", STUB_SLOW_KILL="hf,ours-triton",
                                         LIMIT_DIVISOR="80")
    assert proc.returncode == 0, proc.stderr
    log = (out / "gpu-session.log").read_text()
    steps = [c["args"] for c in program_calls(calls)]
    impls = [a[a.index("--impls") + 1] if "--impls" in a else "pytest" for a in steps]
    assert impls[0] == "pytest" and "tests/test_cuda_only.py" in steps[0]  # the CUDA tests before any benchmark
    steps, impls = steps[1:], impls[1:]
    forced = [f"triton[{label}]" for label in ("128x64w8s3", "128x64w8s3r128", "128x64w8s3o", "128x64w8s3to",
                                                "128x128w8s2to", "128x64w8s3tog")]
    assert impls[:11] == ["sdpa", *forced, "triton,auto", "triton,reference", "triton,auto,sdpa_flash,reference",
                          "triton,auto,sdpa_flash,reference"]
    assert [a[0] for a in steps[11:]] == ["bench/e2e.py", "bench/pipeline.py", "bench/pipeline.py", "bench/e2e.py"]
    assert impls[11] == "hf,ours-triton" and impls[14] == "hf-compile"  # the cold compile alone, last
    predict_step = steps[13]  # predict.py against the model alone, seg, pose and normal
    assert predict_step[predict_step.index("--tasks") + 1 : predict_step.index("--photos")] == ["seg", "pose", "normal"]
    for call in program_calls(calls):  # in every step, after the wheel install
        assert call["env"]["TRITON_DEFAULT_FP_FUSION"] == "1" and call["env"]["TRITON_CACHE_AUTOTUNING"] == "1"
        assert call["env"]["PYTHONPATH"].startswith("/tmp/site")
    excluded = [c["env"]["SAPIENS2_TRITON_EXCLUDE"] for c in program_calls(calls)]
    assert set(excluded[:8]) == {""} and set(excluded[8:]) == {"128x64w8s3to"}
    assert "forced variants without a timed row: 128x64w8s3to" in log
    assert "== autotune: stopped at its 1s limit (exit 124)" in log
    # e2e is killed 1.5 s into its 1 s limit: still a kill, not a stop at the limit (timeout's KILL comes 5 s later)
    assert "== e2e: killed by signal 9 (exit 137)" in log and "== compile: killed by signal 9 (exit 137)" in log
    assert "== forced 128x64w8s3to: killed by signal 6 (exit 134)" in log  # the faulting one, named
    # the first row of each killed step survived
    kernel_impls = [(r["impl"], r["model"]) for r in rows(out / "kernels.json")]
    assert kernel_impls == [("sdpa", "0.4b"), *((f, "0.4b") for f in forced if f != "triton[128x64w8s3to]"),
                            ("triton", "0.4b"), ("triton", "0.4b,5b"), ("triton", "5b"), ("triton", "0.8b")]
    assert [r["impl"] for r in rows(out / "e2e.json")] == ["hf", "hf-compile"]
    assert len(rows(out / "pipeline.json", "real_rows")) == 1 and len(rows(out / "predict.json", "real_rows")) == 1
    files = sorted(p.name for p in out.rglob("*") if p.is_file())
    assert files == ["e2e.json", "gpu-session.log", "kernels.json", "pipeline.json", "predict.json"]  # <= 8
    assert "5 files in" in log and "(ok)" in log and "stub" not in " ".join(files)
    assert "versions {" in log and "== summary" in log
    plan = next(line for line in log.splitlines() if line.startswith("== plan"))
    total = int(plan.split("limits ")[1].split("s")[0])  # the undivided limits: setup + every step
    assert "forced 6 x 15s" in plan and total <= 540 < 600, plan  # the deadline, inside the tool's 600 s


def test_no_triton_row_stops_the_session_after_the_sdpa_rows(tmp_path):
    """Every forced variant faults: the SDPA rows are kept, the session stops before the Triton steps (which would
    fault the same way), says why, and still ends with its summary within the deadline."""
    proc, out, calls, seconds = rehearse(tmp_path, STUB_CRASH="--impls triton[", STEPS="sdpa forced autotune e2e",
                                         STUB_FAKE_SETUP="1")
    assert proc.returncode == 0, proc.stderr
    log = (out / "gpu-session.log").read_text()
    assert [r["impl"] for r in rows(out / "kernels.json")] == ["sdpa"]
    assert "stopping: no forced Triton variant came back" in log
    assert "== autotune: not run" in log and "== e2e: not run" in log
    assert not any("--impls" in c["args"] and "triton,auto" in c["args"] for c in calls)
    assert "== summary" in log and seconds < 60


def test_forced_variants_that_only_ran_out_of_time_do_not_stop_the_session(tmp_path):
    """Every forced variant is stuck past its limit before its first row (slow compiles look the same): they are
    excluded from autotuning, but the session goes on to it, since no process failed."""
    proc, out, calls, _ = rehearse(tmp_path, STUB_STALL=r"--impls triton\[", STEPS="forced autotune",
                                   STUB_FAKE_SETUP="1", LIMIT_DIVISOR="15")
    log = (out / "gpu-session.log").read_text()
    assert proc.returncode == 0 and "autotuning goes on" in log and "stopping" not in log
    autotune = next(c for c in calls if c["args"][-2:] == ["--impls", "triton,auto"])
    assert autotune["env"]["SAPIENS2_TRITON_EXCLUDE"] == "128x64w8s3,128x64w8s3o"


def test_the_cuda_tests_it_names_exist():
    """Step tests names a dozen node ids of tests/test_kernels.py: each must still be collected (a renamed test or
    case would silently vanish from the GPU run)."""
    script = (ROOT / "bench" / "gpu_session.sh").read_text()
    ids = [line.strip().strip('"') for line in script.splitlines()
           if line.strip().startswith('"tests/test_kernels.py::')]
    assert 12 <= len(ids) <= 14
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-p", "no:cacheprovider", *ids],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert sorted(line for line in proc.stdout.splitlines() if "::" in line) == sorted(ids)


def test_session_report_reads_what_killed_steps_left(tmp_path):
    """missing-forced / has-triton on a JSON with a failed row, on no file, and on a half-written one."""
    spec = importlib.util.spec_from_file_location("session_report", ROOT / "bench" / "session_report.py")
    session_report = importlib.util.module_from_spec(spec)  # by path: bench/ on sys.path would shadow kernels/
    spec.loader.exec_module(session_report)

    kernels = tmp_path / "kernels.json"
    kernels.write_text(json.dumps({"rows": [
        {"op": "attention", "pass": "fwd", "impl": "triton[a]", "ms_median": 1.0},
        {"op": "attention", "pass": "fwd", "impl": "triton[b]", "ms_median": None, "error": "CompilationError"}]}))
    assert session_report.missing_forced(kernels, ["a", "b", "c"]) == ["b", "c"]
    assert session_report.has_triton(kernels, "forced") and not session_report.has_triton(kernels, "autotuned")
    assert session_report.missing_forced(tmp_path / "none.json", ["a"]) == ["a"]
    (tmp_path / "half.json").write_text('{"rows": [{"op": "att')
    assert not session_report.has_triton(tmp_path / "half.json", "forced")


def test_excluded_configurations_leave_the_autotuner(monkeypatch):
    """SAPIENS2_TRITON_EXCLUDE names configurations by config_label; they leave every autotuned launcher, and
    excluding all of one launcher's is refused (the launch would have nothing to run)."""
    import types

    from sapiens2.kernels import attention_triton_hopper as hopper
    from sapiens2.kernels import grid_triton

    monkeypatch.setenv("SAPIENS2_TRITON_EXCLUDE", " 128x64w8s3to, 128x64w8s3r128 ,")
    assert grid_triton.excluded_configs() == {"128x64w8s3to", "128x64w8s3r128"}
    tuned = {("fwd", False, True): types.SimpleNamespace(configs=list(hopper._FWD_CONFIGS))}
    grid_triton.drop_excluded(tuned, grid_triton.excluded_configs())
    kept = tuned["fwd", False, True].configs
    labels = [grid_triton.config_label(c.kwargs, c.num_warps, c.num_stages, c.maxnreg) for c in kept]
    assert len(labels) == len(hopper._FWD_CONFIGS) - 2 and "128x64w8s3to" not in labels and "128x64w8s3o" in labels
    with pytest.raises(ValueError, match="leaves no fwd configuration"):
        grid_triton.drop_excluded(tuned, set(labels))
