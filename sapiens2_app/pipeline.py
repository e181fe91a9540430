"""The run over the inputs: images a batch at a time through inference and into their files, and what a run does
when something fails. One image's failure (unreadable, a task that fails on it, a write refused for it) is reported
and skipped; a write error that every later image would hit too (disk full, OUT read-only) stops the run cleanly
(StopRun); an output folder found unwritable fails the images bound for it without computing them.

    run = Run(inference, outputs, progress)
    run.process_all(todo)                          # images; videos call run.infer / run.write frame batch by batch
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

import processing
from sapiens2_app.cli import one_line
from sapiens2_app.inference import Inference, infer
from sapiens2_app.inputs import InputImage
from sapiens2_app.outputs import Outputs
from sapiens2_app.reporting import Progress
from sapiens2_app.safe_io import FOLDER_WRITE_ERRORS, os_error_text, probe_error


class StopRun(Exception):
    """A write error that every further image would hit (disk full, OUT no longer writable): stop cleanly."""


@dataclass
class Run:
    """A run's state: what it computes with (inference), where its files go (outputs), its progress, and what
    run.json reports: each image's outcome, the errors and warnings, the output folders found unwritable."""
    inference: Inference
    outputs: Outputs
    progress: Progress
    errors: list[dict] = field(default_factory=list)  # {"image", "task" (absent: the whole image), "error"}
    warnings: list[str] = field(default_factory=list)
    outcomes: dict[InputImage, str] = field(default_factory=dict)  # "written" or "failed"
    blocked: dict[Path, str] = field(default_factory=dict)  # output folders found unwritable -> why
    workers: int = 0  # render/encode threads beside the model (0: one image after the other, in this thread)

    @property
    def done(self) -> int:
        return sum(outcome == "written" for outcome in self.outcomes.values())

    def warn(self, message: str):
        self.warnings.append(message)
        self.progress.note(f"warning: {message}")

    def process_all(self, todo: list[InputImage]):
        """Every image, a batch at a time. Images whose output folder turned out unwritable fail without being
        computed; a StopRun ends the loop (the caller finalises the manifest)."""
        size = self.inference.batch_size
        for i in range(0, len(todo), size):
            batch = [item for item in todo[i : i + size] if not self.skip_blocked(item)]
            for item, image, result in self.infer(self.load_batch(batch)):
                self.write(item, image, result)

    def load_batch(self, batch: list[InputImage]) -> list[tuple[InputImage, torch.Tensor]]:
        pairs = []
        for item in batch:
            try:
                pairs.append((item, processing.load_image(item.path)))
            except Exception as error:  # noqa: BLE001
                self.fail(item, [(None, error)])
        return pairs

    def infer(self, pairs: list[tuple[InputImage, torch.Tensor]]) -> list[tuple[InputImage, torch.Tensor, dict]]:
        """(item, image, result) of each pair whose inference did not fail as a whole (each task on its own, failing
        images retried one by one inside); a failure outside the tasks (e.g. finding boxes) is retried image by
        image, and an image it still fails on is reported."""
        if not pairs:
            return []
        try:
            results = infer(self.inference, [item for item, _ in pairs], [image for _, image in pairs])
        except Exception as error:  # noqa: BLE001 (a failure outside the tasks)
            if len(pairs) > 1:
                return [done for pair in pairs for done in self.infer([pair])]
            self.fail(pairs[0][0], [(None, error)])
            return []
        for result in results:
            for message in result.pop("warnings"):
                self.warn(message)
        return [(item, image, result) for (item, image), result in zip(pairs, results)]

    def write(self, item: InputImage, image: torch.Tensor, result: dict) -> tuple[dict, bool]:
        """Write an image's files: (what went in them by suffix, whether all of its tasks were written). A write
        error that will repeat stops the run (StopRun) or blocks the image's output folder."""
        if self.skip_blocked(item):  # its folder failed for an earlier image of this batch
            return {}, False
        try:
            written, failures = self.outputs.write(item, image, result)
        except OSError as error:
            self.fail(item, [(None, error)])
            self.stop_or_block(item, error)
            return {}, False
        if failures:
            self.fail(item, failures)
            return written, False
        self.outcomes[item] = "written"
        self.progress.advance()
        return written, True

    def stop_or_block(self, item: InputImage, error: OSError):
        """After a repeating write error: stop the run when OUT itself cannot take more (disk full, OUT read-only).
        A permission error may be narrower: the image's output folder alone (later images bound there then fail
        without running), or one file alone (an immutable old output: only this image fails)."""
        reason = f"{os_error_text(error)} (while writing the outputs of {item.path})"
        if error.errno in FOLDER_WRITE_ERRORS:
            folder = self.outputs.stem(item).parent
            if probe_error(folder) is None:
                return
            out_error = probe_error(self.outputs.out)
            if out_error is None:
                self.blocked[folder] = os_error_text(error)
                return
            reason = f"{os_error_text(out_error)} (OUT itself; after {reason})"
        raise StopRun(reason)

    def skip_blocked(self, item: InputImage) -> bool:
        folder = self.outputs.stem(item).parent
        reason = next((why for blocked, why in self.blocked.items() if folder.is_relative_to(blocked)), None)
        if reason is not None:
            self.fail(item, [(None, PermissionError(f"skipped: its output folder is not writable ({reason})"))])
        return reason is not None

    def fail(self, item: InputImage, failures: list[tuple[str | None, Exception]]):
        """Report an image's failures (task None: the whole image) on stderr and in the manifest."""
        for task, error in failures:
            entry, line = failure_report(item, task, error)
            self.errors.append(entry)
            self.progress.note(line)
        self.outcomes[item] = "failed"
        self.progress.advance(failed=True)


def failure_report(item: InputImage, task: str | None, error: Exception) -> tuple[dict, str]:
    """A failure as its run.json entry and its `error: ... (skipped)` line."""
    message = os_error_text(error) if isinstance(error, OSError) and error.errno else str(error)
    message = f"{type(error).__name__}: {one_line(message)}"
    where = "" if str(item.path) in message else f"{item.path}: "
    return ({"image": str(item.path), **({"task": task} if task else {}), "error": message},
            f"error: {where}{f'{task}: ' if task else ''}{message} (skipped)")
