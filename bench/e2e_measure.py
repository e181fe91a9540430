"""How bench/e2e.py measures (its docstring's Timing and Memory): the timed calls and their summary, the rounds pooled,
the CPU memory one call adds (PyTorch's allocation timeline, and the process's RSS as a cross-check), and the name
of the machine."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import pathlib
import platform
import re
import statistics
import time

import torch

# ----------------------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------------------


def time_calls(fn, device: str, warmup: int, reps: int) -> list[float]:
    for _ in range(warmup):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return [start.elapsed_time(end) for start, end in events]
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return times


def summarize_times(times: list[float], batch: int) -> dict:
    """Median, spread and throughput of the timed calls (milliseconds)."""
    q1, _, q3 = statistics.quantiles(times, n=4, method="inclusive") if len(times) >= 2 else (times[0],) * 3
    median = statistics.median(times)
    return dict(times_ms=times, median_ms=median, min_ms=min(times), max_ms=max(times), iqr_ms=q3 - q1,
                images_per_s=batch / (median / 1e3))


def merge_rounds(results: list[dict], batch: int) -> dict:
    """One row from the rounds of one job: the timed calls of all rounds pooled (median, IQR, min, max over
    all of them) and each round's median kept; memory, outputs and load times from the first round."""
    bad = next((r for r in results if r["status"] != "ok"), None)
    if bad is not None or len(results) == 1:
        return bad or results[0]
    row = dict(results[0])
    row.update(summarize_times([t for r in results for t in r["times_ms"]], batch),
               round_medians_ms=[r["median_ms"] for r in results], rounds=len(results))
    return row


# ----------------------------------------------------------------------------------------------------
# Memory (CPU)
# ----------------------------------------------------------------------------------------------------


def _proc_status_kb(field: str) -> int | None:
    try:
        for line in pathlib.Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def _release_free_memory():
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # glibc: give freed heap pages back, so RSS = live memory


class CpuRssPeak:
    """Peak RSS added by the code run inside the `with` block (a cross-check; see the module docstring)."""

    def __enter__(self):
        _release_free_memory()
        self.before_kb = _proc_status_kb("VmRSS")
        try:
            pathlib.Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
            self.method = "VmHWM (reset via /proc/self/clear_refs) - VmRSS before, after malloc_trim"
        except OSError:
            self.method = "ru_maxrss (process lifetime peak, an upper bound) - VmRSS before"
        return self

    def __exit__(self, *exc):
        if self.method.startswith("VmHWM"):
            peak_kb = _proc_status_kb("VmHWM")
        else:
            import resource

            peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        self.peak_mb = None if peak_kb is None or self.before_kb is None else (peak_kb - self.before_kb) / 1024
        return False


def cpu_allocation_peak_mb(fn) -> float:
    """Run fn once; return the peak of the bytes that fn's own allocations held at once, in MiB. The profiler
    records every allocation and free made while it runs (positive and negative nbytes) but not the free of a
    block allocated before it started, so this is an upper bound on the net growth; a forward call frees
    nothing that existed before it, and there the two agree."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    cpu = torch._C._autograd.DeviceType.CPU
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]" and e.device_type() == cpu]
    held = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        held += e.nbytes()
        peak = max(peak, held)
    return peak / 2**20


# ----------------------------------------------------------------------------------------------------
# The machine
# ----------------------------------------------------------------------------------------------------


def device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    model = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return f"{model} ({torch.get_num_threads()} threads)"


def device_slug(device: str) -> str:
    if device == "cuda":
        return re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name().lower().replace("nvidia", "")).strip("-")
    return f"cpu{torch.get_num_threads()}t"
