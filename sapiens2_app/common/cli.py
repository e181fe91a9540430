"""What the commands share on the command line: the one user-error type, the argument parser that reports in one
line, the parsers of shared options (tasks, --size, --device, --dtype) and of numbers within a range, the launcher's
environment (RANK, WORLD_SIZE) and the one handling of Ctrl-C and SIGTERM.

    try: ...
    except UsageError as error:        # bad arguments, inputs, data or checkpoints: `error: ...`, exit status 2
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import signal
import threading

import torch

from sapiens2 import Sapiens2Config
from sapiens2_app.common.artefacts import TASKS

PATCH_SIZE = Sapiens2Config.patch_size
SIZE_RANGE = (32, 4096)  # --size sides, pixels: a 2x2 patch grid at least (the heads' norms need >1 cell); 4K at most
MAX_WORLD_SIZE = 65536
INTERRUPTED, TERMINATED = 130, 143  # exit statuses after Ctrl-C and SIGTERM, as a shell reports them


class UsageError(Exception):
    """Bad arguments, inputs, data or checkpoints, found by any command: reported as one `error:` line naming the
    argument or file and what to do, without a traceback; exit status 2."""


class OneLineErrorParser(argparse.ArgumentParser):
    """Usage errors as one line, like every other error here (the usage text is one --help away)."""

    def error(self, message: str):
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def one_line(message: str, limit: int = 600) -> str:
    """A multi-line message (a checkpoint's key listing) as one line, shortened."""
    text = ""
    for line in (line.strip() for line in str(message).splitlines() if line.strip()):
        text += ("" if not text else " " if text.endswith(":") else "; ") + line
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ----------------------------------------------------------------------------------------------------
# Shared options
# ----------------------------------------------------------------------------------------------------
def parse_tasks(text: str) -> list[str]:
    """`seg,normal,pose` (predict.py's TASK, serve.py's --tasks and its jobs' tasks) -> the tasks in TASKS order."""
    tasks = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [t for t in tasks if t not in TASKS]
    if unknown or not tasks:
        raise UsageError(f"unknown task {', '.join(unknown) or text!r}; choose from {', '.join(TASKS)} "
                         f"(several: seg,normal,pose)")
    return [t for t in TASKS if t in tasks]  # seg first: pose boxes and masks use it


def parse_size(text: str) -> tuple[int, int]:
    """--size of predict.py, train.py and export.py: HxW (or H,W), each side a multiple of the patch size within
    SIZE_RANGE."""
    match = re.fullmatch(r"(\d+)[xX,](\d+)", text.strip())
    low, high = SIZE_RANGE
    if not match:
        raise argparse.ArgumentTypeError(f"size must be HEIGHTxWIDTH, e.g. 1024x768, got {text!r}")
    size = int(match[1]), int(match[2])
    if any(not low <= side <= high or side % PATCH_SIZE for side in size):
        raise argparse.ArgumentTypeError(f"{text}: each side must be a multiple of {PATCH_SIZE} from "
                                         f"{low} to {high}, e.g. 1024x768")
    return size


def number_in(kind: type, low: float | None = None, high: float | None = None, low_open: bool = False):
    """An argparse `type` for a numeric option: an int (written as one: 2.5 and 1e3 are refused) or a finite float,
    within [low, high] (low excluded when low_open). The message gives the range; argparse names the option:
    `error: argument --lr: expected a number > 0, got '-1e-4'`."""
    shown = lambda bound: str(bound) if kind is int else f"{bound:g}"  # noqa: E731
    bounds = [f"{'>' if low_open else '>='} {shown(low)}" if low is not None else "",
              f"<= {shown(high)}" if high is not None else ""]
    wanted = f"{'a whole number' if kind is int else 'a number'} {' and '.join(b for b in bounds if b)}".strip()

    def parse(text: str):
        try:
            value = int(text) if kind is int else float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {wanted}, got {text!r}") from None
        too_low = low is not None and (value <= low if low_open else value < low)
        if not math.isfinite(value) or too_low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"expected {wanted}, got {text!r}")
        return value

    parse.__name__ = wanted  # (what argparse would print for another exception)
    return parse


def pick_device(name: str | None) -> torch.device:
    """--device, else cuda:LOCAL_RANK when there is a GPU, else the CPU; a device that is not there is a UsageError.
    A CUDA device is made the current one (Triton launches on the current device)."""
    try:
        device = torch.device(name) if name else None
    except RuntimeError:
        raise UsageError(f"--device {name!r}: expected cpu, cuda or cuda:N") from None
    if device is None:
        if not torch.cuda.is_available():
            return torch.device("cpu")
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0").strip() or 0))
    if device.type == "cuda":
        count = torch.cuda.device_count()
        if count == 0:
            raise UsageError(f"--device {device}: no CUDA GPU is visible; use --device cpu")
        if (device.index or 0) >= count:
            raise UsageError(f"device {device} (--device or LOCAL_RANK): only GPUs 0 to {count - 1} are visible")
        # Made current: Triton launches its kernels, and torch allocates a bare "cuda", on the current device.
        torch.cuda.set_device(device)
    return device


# ----------------------------------------------------------------------------------------------------
# The launcher's environment (torchrun)
# ----------------------------------------------------------------------------------------------------
def rank_and_world() -> tuple[int, int]:
    """From torchrun's (or any launcher's) RANK / WORLD_SIZE environment variables; 0, 1 when absent.
    LOCAL_RANK (the GPU of this process) is checked here too, so a bad launch fails before any model loads."""
    world = env_int("WORLD_SIZE", 1, 1, MAX_WORLD_SIZE)
    rank = env_int("RANK", 0, 0, world - 1)
    env_int("LOCAL_RANK", 0, 0, world - 1)
    return rank, world


def env_int(name: str, default: int, low: int, high: int) -> int:
    """A whole number from the environment in [low, high], else a UsageError that gives the range."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    if not re.fullmatch(r"\d+", text) or not low <= int(text) <= high:
        raise UsageError(f"environment variable {name}={os.environ[name]!r}: expected a whole number from "
                         f"{low} to {high}" + (" (WORLD_SIZE - 1)" if name != "WORLD_SIZE" else ""))
    return int(text)


# ----------------------------------------------------------------------------------------------------
# Ctrl-C and SIGTERM
# ----------------------------------------------------------------------------------------------------
class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler's or `kill`'s stop), raised where Ctrl-C would be, so both stop a command the same way."""


class StopSignals:
    """The one handling of Ctrl-C and SIGTERM, for the duration of a `with` block (in the main thread; elsewhere
    Python delivers no signals).

    Without `on_request` (predict.py, export.py): both raise at once, Ctrl-C as KeyboardInterrupt and SIGTERM as
    Terminated; the command's cleanup runs as for Ctrl-C.
    With `on_request` (train.py: stop after the step, with a checkpoint): the first Ctrl-C or SIGTERM sets
    `requested` and calls on_request(signum); a second Ctrl-C raises KeyboardInterrupt at once, except inside a
    `held()` block (a checkpoint's renames, which must not be cut in two), which it ends instead. After that
    KeyboardInterrupt, further signals are ignored: a third Ctrl-C would cut the cleanup it starts (stopping the data
    workers, removing a staging folder) and leave the workers behind."""

    def __init__(self, on_request=None):
        self.on_request, self.requested, self.previous = on_request, False, {}
        self.holding = self.quit_pending = self.quitting = False

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self.previous[sig] = signal.signal(sig, self.handle)
        return self

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            # after a stop request the command is ending as asked: a Ctrl-C during its last steps (the process
            # group's shutdown, the interpreter's exit) would only turn that into a traceback
            signal.signal(sig, signal.SIG_IGN if self.requested else handler)

    def handle(self, signum, frame):
        if self.on_request is None:
            raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()
        if self.quitting:
            return
        if self.requested and signum == signal.SIGINT:
            self.quit_pending = True
            if not self.holding:
                self.quit()
            return
        self.requested = True
        self.on_request(signum)

    def quit(self):
        self.quitting = True
        raise KeyboardInterrupt()

    @contextlib.contextmanager
    def held(self):
        """`with stop.held() as hold: ...; hold()`: from hold() to the end of the block, a second Ctrl-C waits, and
        quits when the block ends (with a checkpoint: the renames into OUT, done by the staging folder's exit)."""
        try:
            yield self.hold
        finally:
            self.holding = False
        if self.quit_pending and not self.quitting:
            self.quit()

    def hold(self):
        self.holding = True


def not_held():
    """StopSignals.held for code run without a StopSignals block."""
    return contextlib.nullcontext(lambda: None)
