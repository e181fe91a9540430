"""End-to-end speed and memory: ours against HF transformers and torch.compile, backbone and task models.

    python bench/e2e.py                                  # the default suite of this machine (cuda or cpu)
    python bench/e2e.py --suite cpu                      # the CPU table: small image, small batch, fp32
    python bench/e2e.py --suite gpu                      # the GPU table: 1024x768, batch 1 and 8, bf16
    python bench/e2e.py --presets 0.4b --models backbone,seg --batches 8 --dtype bf16 \
                        --impls ours-triton,hf,hf-compile --out bench/results/x.json --append
    python bench/e2e.py --report bench/results/e2e-....json    # re-render the .md table and .png plot

Implementations (rows), each timed in a fresh subprocess on the same random weights and the same input:
    hf            transformers' Sapiens2* (attn_implementation="sdpa")
    hf-eager      transformers with its eager (materialized softmax) attention; not in the default sets
    hf-compile    torch.compile(hf)
    ours          this repo, eager, PyTorch reference kernels (SAPIENS2_KERNELS=torch)
    ours-triton   this repo, eager, Triton kernels (SAPIENS2_KERNELS=triton); CUDA only
    ours-compile  torch.compile(ours) over the reference kernels
    ours-graph    ours-triton replayed as one CUDA graph (--cuda-graphs adds it for batch 1); CUDA only
    ours-cl, ours-triton-cl
                  ours / ours-triton with the task head in channels-last (model.channels_last_head()):
                  NHWC convs, heads.InstanceNorm normalizing in place; task models only

Weights: for each (preset, model, dtype, image size) the parent builds one random model of ours (seeded;
LayerScale and norm weights randomized too, so that the attention branch matters to the output instead
of being scaled by 1e-4) and writes it with weights.save(format="hf"); every child loads that directory,
ours through weights.load, HF through Sapiens2*.from_pretrained. Ours runs with rope_dtype="float32", the
convention HF implements (bit-identical to HF in fp32), so the outputs are comparable.

Correctness: every child saves a deterministic subsample of its outputs; the parent compares each row with
the reference row of its group (hf when it ran, else ours): rel err = max|x - ref| / max|ref|, bound 1e-3 in
fp32. In bf16/fp16 the bound comes from the measured rounding noise: the reference child also runs its model
once in fp32 (the same bf16-valued weights and input upcast, so only the arithmetic differs) and records
noise_vs_fp32 = max|ref_bf16 - ref_fp32| / max|ref_fp32|; the bound is NOISE_MULTIPLE (3) times that (why 3:
at NOISE_MULTIPLE in e2e_compare.py). A row over the bound is marked MISMATCH and the script exits with status 1.

Timing: warm-up calls (at least 3 for compiled rows: the RoPE table cache fills on the first call and
causes one recompile), then --reps timed calls; median, min, max and the inter-quartile range are
reported. CUDA: torch.cuda.Event around each call. CPU: time.perf_counter. Under torch.inference_mode.
--rounds R (the CPU suite: 2) runs each group's processes R times interleaved (hf, ours, ..., hf, ours, ...)
and pools the timed calls, so that a slow minute of a shared machine does not land on one row only; each
round's median is kept in the JSON (round_medians_ms).

Memory (peak_mb: what one forward call adds on top of the loaded model and its input):
    cuda  torch.cuda.max_memory_allocated() during one call minus memory_allocated() before it
    cpu   the peak of the bytes that one call's own allocations hold at once in PyTorch's CPU allocator:
          the allocation timeline of torch.profiler (profile_memory=True; every tensor allocation and free,
          the temporaries inside ops included), summed in time order. Deterministic, and the CPU twin of
          max_memory_allocated. It does not see memory that libraries allocate outside PyTorch's allocator
          (oneDNN's own scratch), so the process's RSS is recorded beside it: rss_peak_mb = peak RSS during
          one call (VmHWM, reset through /proc/self/clear_refs) minus RSS before (after gc and malloc_trim).
          RSS moves by tens of MB from call to call with the heap's state: use it as a cross-check only.
          The methods used are written into the JSON.

FLOPs and bytes: counted on the meta device by hooks on every nn.Linear, nn.Conv2d and nn.ConvTranspose2d
of our (unfused) model (2 * MACs) plus 4 * N^2 * D per query head in each attention; bytes are each such
op's input + output + weight read/written once (an unfused lower bound on traffic, attention as q, k, v, o).
Achieved TFLOP/s = FLOPs / median time, and on a known GPU the fraction of its dense peak for the dtype
(runtime_info.DEVICE_PEAKS; fp32 rows use the non-tensor-core fp32 peak, since TF32 is left off). On CPU: GFLOP/s only.

Results: bench/results/e2e-<device>-<date>.json (+ .md table, + .png plot drawn with pillow; --no-render: the
JSON only, the rest later with --report). The JSON is rewritten (atomically) as each job finishes, so a run
that is stopped keeps every row it measured. With --append and the same --work-dir, a later run compares its
rows with the reference rows an earlier run measured (their outputs stay in the work dir): bench/gpu_session.sh
runs the slow cold torch.compile job alone, last.

This file is the command (its options, and the loop over jobs that saves each row as it finishes); the parts are
beside it in bench/: the models, their random weights and FLOP counts (e2e_models.py), the suites and jobs
(e2e_jobs.py), the child process that loads and times one implementation (e2e_child.py), the timing and memory
measurements (e2e_measure.py), the correctness check (e2e_compare.py), and the table and plot (e2e_report.py).
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import shutil
import sys
import tempfile

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.append(str(ROOT / "bench"))  # the e2e_* parts; after the root, so bench/kernels.py cannot shadow kernels/

from sapiens2_app.common import safe_io  # noqa: E402
from sapiens2_app.common.runtime_info import versions  # noqa: E402
from e2e_child import run_child  # noqa: E402
from e2e_compare import compare_group  # noqa: E402
from e2e_jobs import SUITES, group_key, job_key, outputs_file, plan, run_job, split_groups  # noqa: E402
from e2e_measure import device_name, device_slug, merge_rounds  # noqa: E402
from e2e_models import DTYPES, IMPLS, MODELS, count_flops  # noqa: E402
from e2e_report import add_derived, print_row, render  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--report", type=pathlib.Path, help="re-render the .md and .png of a results JSON and exit")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--suite", choices=sorted(SUITES), help="default: gpu on CUDA, cpu otherwise")
    split = lambda s: tuple(x for x in s.split(",") if x)  # noqa: E731
    ap.add_argument("--presets", type=split)
    ap.add_argument("--models", type=split, help=",".join(MODELS))
    ap.add_argument("--batches", type=lambda s: tuple(int(b) for b in s.split(",")))
    ap.add_argument("--impls", type=split, help=",".join(IMPLS))
    ap.add_argument("--size", type=int, nargs=2, metavar=("H", "W"))
    ap.add_argument("--dtype", choices=sorted(DTYPES))
    ap.add_argument("--warmup", type=int)
    ap.add_argument("--reps", type=int)
    ap.add_argument("--rounds", type=int, help="run each group this many times, interleaved (default: the suite's)")
    ap.add_argument("--cuda-graphs", action="store_true", help="add an ours-graph row (CUDA graph replay) at batch 1")
    ap.add_argument("--perturb", action="store_true", help=argparse.SUPPRESS)  # the smoke test's wrong model
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per child process")
    ap.add_argument("--out", type=pathlib.Path, help="results JSON (default bench/results/e2e-<device>-<date>.json)")
    ap.add_argument("--append", action="store_true", help="merge into an existing --out, replacing rows of the same key")
    ap.add_argument("--work-dir", type=pathlib.Path, help="where weights and outputs go (default: a temp dir, removed)")
    ap.add_argument("--no-render", action="store_true", help="write the JSON only (the .md and .png: --report later)")
    args = ap.parse_args(argv)

    if args.child:
        spec = json.loads(args.child)
        result = run_child(spec)
        pathlib.Path(spec["result"]).write_text(json.dumps(result))
        return 0
    if args.report:
        render(args.report)
        print(f"wrote {args.report.with_suffix('.md')} and {args.report.with_suffix('.png')}")
        return 0

    args.suite = args.suite or ("gpu" if args.device == "cuda" else "cpu")
    for impl in args.impls or ():
        if impl not in IMPLS:
            ap.error(f"unknown impl {impl!r}; choose from {', '.join(IMPLS)}")
    jobs = plan(args)
    dev_name = device_name(args.device)
    date = datetime.date.today().isoformat()
    out = args.out or ROOT / "bench" / "results" / f"e2e-{device_slug(args.device)}-{date}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    command = "python bench/e2e.py " + " ".join(argv if argv is not None else sys.argv[1:])
    print(f"{len(jobs)} runs on {dev_name}; results -> {out}", flush=True)

    def save(pending: list[dict] = ()):
        """Write the JSON with every row so far (atomically): a run cut short keeps what it measured. `pending`:
        the rows of the group in progress, compared on copies with the reference measured so far."""
        pending = [dict(r) for r in pending]
        if pending:
            compare_group(pending, earlier_rows(pending[0]))
        done = [{k: v for k, v in r.items() if k != "outputs_path"} for r in rows + pending]
        data = {"device": dev_name, "device_kind": args.device, "date": date, "versions": versions(),
                "command": command, "threads": torch.get_num_threads(),
                "memory_method": next((r["memory_method"] for r in done if r.get("memory_method")), None), "rows": done}
        if previous is not None:
            keep = {job_key(r): r for r in previous["rows"]}
            keep.update({job_key(r): r for r in done})
            data["rows"] = list(keep.values())
            data["command"] = previous.get("command", "") + " ; " + command
            data["memory_method"] = data["memory_method"] or previous.get("memory_method")
        add_derived(data["rows"], dev_name)
        safe_io.atomic_write(out, safe_io.json_text(data, indent=1))
        if not args.no_render:
            render(out)
        return pending

    def earlier_rows(like: dict) -> list[dict]:
        """The earlier run's rows of this group whose outputs are still in the work dir (--append)."""
        found = []
        for r in previous["rows"] if previous is not None else ():
            path = outputs_file(work, r)
            if group_key(r) == group_key(like) and r.get("status") == "ok" and path.exists():
                found.append({**r, "outputs_path": str(path)})
        return found

    previous = json.loads(out.read_text()) if args.append and out.exists() else None
    work = args.work_dir or pathlib.Path(tempfile.mkdtemp(prefix="sapiens2-e2e-"))
    work.mkdir(parents=True, exist_ok=True)
    flops_cache: dict = {}
    rows: list[dict] = []
    printed: dict[str, tuple] = {}  # job key -> (status, rel err) as printed when the job finished
    rounds = args.rounds or SUITES[args.suite].get("rounds", 1)

    def finished_row(job: dict, results: list[dict]) -> dict:
        fkey = (job["preset"], job["model"], job["batch"], tuple(job["size"]), job["dtype"])
        if fkey not in flops_cache:
            flops_cache[fkey] = count_flops(*fkey)
        row = {k: job[k] for k in ("preset", "model", "batch", "size", "dtype", "impl", "device")}
        row.update(flops_cache[fkey])
        row.update(merge_rounds(results, job["batch"]))
        return row

    try:
        for group_jobs in split_groups(jobs):
            results = {job_key(job): [] for job in group_jobs}
            group: list[dict] = []
            for round_index in range(rounds):  # interleaved: hf, ours, ..., hf, ours, ... so slow drift hits all alike
                for job in group_jobs:
                    results[job_key(job)].append(run_job(job, work, args.timeout))
                    if round_index == rounds - 1:  # the job's last round: its row is final, saved at once
                        group.append(finished_row(job, results[job_key(job)]))
                        shown = save(group)[-1]
                        print_row(shown)
                        printed[job_key(job)] = (shown["status"], shown.get("rel_err"))
            # The group complete: compared with its reference for good (rows measured before it was are now too).
            compare_group(group, earlier_rows(group[0]))
            for r in group:
                if printed.get(job_key(r)) != (r["status"], r.get("rel_err")):
                    print_row(r)
            rows.extend(group)
            save()
    finally:
        if args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    bad = [r for r in rows if r["status"] in ("MISMATCH", "error")]
    for r in bad:
        print(f"FAILED {job_key(r)}: {r['status']}: {r.get('reason')}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
