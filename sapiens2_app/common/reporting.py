"""What a run reports while it runs and after: the one progress display of the commands (a bar redrawn in place on
a terminal, a line every 30 s in a log, notes above it), and predict.py's manifest, run.json (written at the start,
finished at the end, even on a full disk).

    progress = Progress(total=1000, unit="images")
    progress.advance()                                  # predict.py: one image done
    progress.update(step, "loss 0.1234  lr 1.0e-04")    # train.py: where the run is, and what to show beside it
"""

from __future__ import annotations

import errno
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from sapiens2_app.common.safe_io import atomic_write, json_text


class Progress:
    """`[#####---------------] 120/1000 images  3.40 img/s  ETA 4m20s  1 failed`.

    bar:   draw the bar (rank 0, or a log; train.py --no-progress turns it off)
    notes: print notes (train.py: the main process only)
    start: the count the run starts from (a resumed training run), for the rate and the ETA"""

    def __init__(self, total: int, unit: str = "images", prefix: str = "", bar: bool = True, notes: bool = True,
                 stream=None, start: int = 0, rate_unit: str = "img/s"):
        self.total, self.unit, self.prefix, self.bar, self.notes = total, unit, prefix, bar, notes
        self.rate_unit = rate_unit
        self.stream = stream or sys.stderr
        self.count = self.start = start
        self.failed = 0
        self.began = self.last = time.perf_counter()
        self.tty = self.stream.isatty()
        self.extra = ""
        self.drawn = False

    def advance(self, failed: bool = False):
        """One more item done (failed or not)."""
        self.failed += failed
        self.update(self.count + 1)

    def update(self, count: int, extra: str = ""):
        """The run is at `count`; `extra` is shown after the rate (a loss, a learning rate)."""
        self.count, self.extra = count, extra
        now = time.perf_counter()
        if self.bar and (now - self.last > (0.2 if self.tty else 30) or self.count == self.total):
            self.last = now
            self.draw()

    def rate(self) -> float:
        """Items per second since the start."""
        return (self.count - self.start) / max(time.perf_counter() - self.began, 1e-9)

    def draw(self):
        filled = int(20 * self.count / max(self.total, 1))
        eta = (self.total - self.count) / max(self.rate(), 1e-9)
        parts = [f"{self.prefix}[{'#' * filled}{'-' * (20 - filled)}] {self.count}/{self.total} {self.unit}",
                 self.extra, f"{self.rate():.2f} {self.rate_unit}" if not self.extra else "",
                 f"ETA {int(eta // 60)}m{int(eta % 60):02d}s", f"{self.failed} failed" if self.failed else ""]
        line = "  ".join(part for part in parts if part)
        if self.tty:
            print("\r" + line + "\033[K", end="", file=self.stream, flush=True)
        else:
            print(line, file=self.stream, flush=True)
        self.drawn = True

    def note(self, message: str):
        """A line above the bar (the bar is redrawn by the next update)."""
        if self.notes:
            print(("\r\033[K" if self.tty and self.drawn else "") + self.prefix + message, file=self.stream, flush=True)

    def close(self):
        if self.bar and self.tty and self.drawn:
            print(file=self.stream)


# ----------------------------------------------------------------------------------------------------
# run.json
# ----------------------------------------------------------------------------------------------------
def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def manifest_path(out: Path, rank: int, world: int) -> Path:
    return out / ("run.json" if world == 1 else f"run.rank{rank}-of-{world}.json")


def write_manifest(path: Path, manifest: dict, reserve: int = 0):
    """Atomically. `reserve`: pad the file with trailing blanks (valid JSON) to that many bytes, so the final
    manifest can still be written over it when the disk is full (write_final_manifest)."""
    text = json_text(manifest, indent=2)
    atomic_write(path, text + " " * (reserve - len(text) - 1) + "\n" if reserve > len(text) + 1 else text)


def manifest_reserve(images: int) -> int:
    """Bytes to set aside for the final manifest: its errors and not-attempted lists grow with the images."""
    return min(64 * 1024 + 512 * images, 16 * 2**20)


def write_final_manifest(path: Path, manifest: dict):
    """The final manifest; on a full disk, written over the space the first one reserved (in place, not atomic),
    shortened (lists cut, `"truncated": true`) if it does not fit."""
    try:
        return write_manifest(path, manifest)
    except OSError as error:
        if error.errno not in (errno.ENOSPC, errno.EDQUOT) or not path.is_file():
            raise
        room = path.stat().st_size
    text = json_text(manifest, indent=2)
    for keep in (100, 10, 0):
        if len(text.encode()) <= room:
            break
        text = json_text({**manifest, "truncated": True, "errors": manifest["errors"][:keep],
                          "not_attempted": manifest["not_attempted"][:keep]}, indent=2)
    with open(path, "r+b") as f:  # the blocks are already allocated: overwriting them needs no space
        f.write(text.encode())
        f.truncate()


def finish_manifest(manifest: dict, run, todo: list, skipped: int, elapsed: float, rate: float,
                    stopped: str | None = None):
    """Final status (finished, stopped: why, interrupted), counts, every error, and the images not attempted, from
    the run's state (a pipeline.Run)."""
    not_attempted = [str(item.path) for item in todo if item not in run.outcomes]
    status = "stopped" if stopped else "interrupted" if not_attempted else "finished"
    failed = sum(outcome == "failed" for outcome in run.outcomes.values())
    manifest.update(status=status, **({"stop_reason": stopped} if stopped else {}),
                    finished=utc_now(),
                    counts={"images": manifest["shard"]["images"], "written": run.done, "failed": failed,
                            "skipped_existing": skipped, "not_attempted": len(not_attempted)},
                    errors=run.errors, not_attempted=not_attempted, warnings=run.warnings,
                    images_per_s=round(rate, 3))
    manifest["timings_s"].update(total=round(elapsed, 3),
                                 model={t: round(s, 3) for t, s in run.inference.timings.items()})
    copies = run.inference.to_host  # what left the model's device (inference.HostCopies)
    manifest["device_to_host"] = {"bytes": copies.bytes, "tensors": copies.tensors,
                                  "bytes_per_image": round(copies.bytes / max(run.done, 1))}
