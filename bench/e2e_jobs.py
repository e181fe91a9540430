"""bench/e2e.py's plan: the suites, the jobs a run expands to, their keys and groups (the rows compared together),
and one job run in a child process of its own."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys
import time

from sapiens2 import heads
from e2e_child import skip_reason
from e2e_models import prepare_weights

ROOT = pathlib.Path(__file__).resolve().parents[1]
COMMAND = ROOT / "bench" / "e2e.py"  # its --child runs one job (e2e_child.run_child)

# The suites: what `--suite` runs when no explicit --presets/--models/... narrow it. Each entry is
# (presets, models, batches, impls); image size, dtype, reps per suite. Ordered most important first.
SUITES = {
    "gpu": dict(size=(1024, 768), dtype="bf16", warmup=5, reps=20, runs=[
        (("0.4b",), ("backbone",), (8, 1), ("ours-triton", "hf", "hf-compile", "ours-compile", "ours")),
        (("0.4b",), ("seg", "pose", "normal", "pointmap", "albedo"), (8, 1), ("ours-triton", "ours-triton-cl", "hf", "hf-compile", "ours-compile")),
        (("0.1b", "1b"), ("backbone",), (8, 1), ("ours-triton", "hf", "hf-compile", "ours-compile")),
        (("1b",), ("seg", "normal", "pointmap", "matting"), (8,), ("ours-triton", "hf", "hf-compile")),
        (("5b",), ("backbone",), (8, 1), ("ours-triton", "hf", "hf-compile")),
    ]),
    # 2-core CPU: a few minutes in all. 256x192 keeps 201 tokens per image (CLS + 8 registers + 16x12).
    "cpu": dict(size=(256, 192), dtype="fp32", warmup=1, reps=5, rounds=2, runs=[
        (("0.1b", "0.4b"), ("backbone",), (1,), ("hf", "hf-compile", "ours", "ours-triton", "ours-compile")),
        (("0.4b",), ("backbone",), (4,), ("hf", "ours")),
        (("0.4b",), ("seg", "pose", "normal", "pointmap", "albedo"), (1,), ("hf", "ours", "ours-cl")),
        (("1b",), ("backbone",), (1,), ("hf", "ours")),
        (("1b",), ("matting",), (1,), ("hf", "ours", "ours-cl")),
    ]),
    # The smoke test: tiny architecture, tiny image, seconds.
    "smoke": dict(size=(64, 48), dtype="fp32", warmup=1, reps=3, runs=[
        (("tiny",), ("backbone", "seg"), (2,), ("hf", "ours", "ours-triton")),
    ]),
}


def job_key(job: dict) -> str:
    return f"{job['preset']}|{job['model']}|b{job['batch']}|{job['dtype']}|{job['size'][0]}x{job['size'][1]}|{job['impl']}"


def group_key(job: dict) -> str:
    return job_key(job).rsplit("|", 1)[0]


def plan(args) -> list[dict]:
    suite = SUITES[args.suite]
    size = tuple(args.size) if args.size else suite["size"]
    dtype = args.dtype or suite["dtype"]
    runs = suite["runs"]
    if any(v is not None for v in (args.presets, args.models, args.batches, args.impls)):
        # An explicit selection: the cross product, in the order given.
        runs = [(args.presets or ("0.4b",), args.models or ("backbone",), args.batches or (1,),
                 args.impls or ("hf", "hf-compile", "ours", "ours-triton", "ours-compile"))]
    jobs = []
    for presets, models, batches, impls in runs:
        for preset in presets:
            for model in models:
                if model != "backbone" and preset != "tiny" and preset not in heads.HEAD_TABLE[model]:
                    continue  # e.g. no 0.1b heads, matting only at 1b
                for batch in batches:
                    row_impls = list(impls)
                    if args.cuda_graphs and batch == 1 and "ours-graph" not in row_impls:
                        row_impls.append("ours-graph")
                    for impl in row_impls:
                        jobs.append(dict(preset=preset, model=model, batch=batch, size=size, dtype=dtype, impl=impl,
                                         device=args.device, warmup=args.warmup or suite["warmup"],
                                         reps=args.reps or suite["reps"],
                                         perturb=args.perturb and impl.startswith("ours")))
    return jobs


def outputs_file(work: pathlib.Path, job: dict) -> pathlib.Path:
    """Where a job's child saves its outputs: kept in the work dir, so that a later --append run can compare."""
    return work / f"{re.sub(r'[^A-Za-z0-9]+', '_', job_key(job))}.out.safetensors"


def run_job(job: dict, work: pathlib.Path, timeout: float) -> dict:
    spec = dict(job)
    reason = skip_reason(spec)
    if reason:
        return {"status": "skipped", "reason": reason}
    key = re.sub(r"[^A-Za-z0-9]+", "_", job_key(job))
    wdir = work / re.sub(r"[^A-Za-z0-9]+", "_", f"{job['preset']}_{job['model']}_{job['dtype']}_{job['size'][0]}x{job['size'][1]}")
    t0 = time.perf_counter()
    prepare_weights(job["preset"], job["model"], job["size"], job["dtype"], wdir)
    spec.update(weights=str(wdir), outputs=str(outputs_file(work, job)), result=str(work / f"{key}.json"))
    env = dict(os.environ)
    if job["device"] == "cpu":  # inductor's compile-worker pool would fight the timed process for the cores
        env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    env.setdefault("TRANSFORMERS_VERBOSITY", "error")
    env.setdefault("HF_HUB_OFFLINE", "1")
    cmd = [sys.executable, str(COMMAND), "--child", json.dumps(spec)]
    try:
        proc = subprocess.run(cmd, env=env, cwd=str(ROOT), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "reason": f"over {timeout:.0f} s"}
    wall = time.perf_counter() - t0
    if proc.returncode != 0 or not pathlib.Path(spec["result"]).exists():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-6:]
        oom = any("out of memory" in line.lower() for line in tail) or proc.returncode in (-9, 137)
        return {"status": "oom" if oom else "error", "reason": " | ".join(tail)[-600:], "wall_s": wall}
    result = json.loads(pathlib.Path(spec["result"]).read_text())
    result["wall_s"] = wall
    result["outputs_path"] = spec["outputs"]
    return result


def split_groups(jobs: list[dict]) -> list[list[dict]]:
    """Consecutive jobs of one (preset, model, batch, size, dtype): the rows that are compared together."""
    groups: list[list[dict]] = []
    for job in jobs:
        if groups and group_key(groups[-1][0]) == group_key(job):
            groups[-1].append(job)
        else:
            groups.append([job])
    return groups
