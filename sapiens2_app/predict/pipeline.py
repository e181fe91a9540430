"""The run over the inputs: images a batch at a time through inference and into their files, and what a run does
when something fails. One image's failure (unreadable, a task that fails on it, a write refused for it) is reported
and skipped; a write error that every later image would hit too (disk full, OUT read-only) stops the run cleanly
(StopRun); an output folder found unwritable fails the images bound for it without computing them.

    run = Run(inference, outputs, progress, workers=4)
    with run.running():                            # the threads of the pipelined runner (none when workers == 0)
        run.process_all(todo)                      # images; videos call run.infer / run.write frame batch by batch

With workers > 0 the stages overlap (stages.py): the next images are decoded while the model runs, their files are
made (rendered, encoded) by `workers` threads while the model runs on the next batch, and one thread writes them in
the order of the inputs and reports each outcome, so that the files, run.json and the overlay videos are those of
workers == 0, where everything happens in this thread, one image after the other. An output folder is written to
once before more images bound for it are computed, so that an unwritable one is found as early as one at a time
would find it.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from sapiens2 import processing
from sapiens2_app.common.cli import one_line
from sapiens2_app.predict.inference import Inference, infer
from sapiens2_app.predict.inputs import InputImage
from sapiens2_app.predict.outputs import Outputs
from sapiens2_app.common.reporting import Progress
from sapiens2_app.common.safe_io import FOLDER_WRITE_ERRORS, os_error_text, probe_error
from sapiens2_app.predict.stages import Ahead, InOrder

DECODE_AHEAD = 2  # batches decoded ahead of the model
WRITES_WAITING = 4  # images per worker whose files may wait to be written (bounds the memory they hold)


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
    workers: int = 0  # threads that make the files beside the model (0: one image after the other, in this thread)
    makers: ThreadPoolExecutor | None = field(default=None, repr=False)
    writer: InOrder | None = field(default=None, repr=False)
    written_folders: set[Path] = field(default_factory=set, repr=False)  # output folders that took an image's files
    in_flight: Counter = field(default_factory=Counter, repr=False)  # output folder -> images waiting to be written
    changed: threading.Condition = field(default_factory=threading.Condition, repr=False)

    @property
    def done(self) -> int:
        return sum(outcome == "written" for outcome in self.outcomes.values())

    # ----- the threads ----------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def running(self):
        """The pipelined runner's threads for the duration of the block: on leaving, everything waiting is written
        (and a StopRun raised by it raised here), or, when the block raises (Ctrl-C, StopRun), dropped."""
        if self.workers == 0:
            yield self
            return
        self.makers = ThreadPoolExecutor(self.workers, thread_name_prefix="sapiens2-make")
        self.writer = InOrder(WRITES_WAITING * self.workers)
        try:
            yield self
            self.writer.drain()
        except BaseException:
            self.writer.drop()
            raise
        finally:
            self.writer.close()
            self.makers.shutdown(wait=True, cancel_futures=True)
            self.makers = self.writer = None

    def later(self, call: Callable[[], None]):
        """Run `call` after what was given before it: now when one thread does everything, else in the writer's."""
        if self.writer is None:
            call()
        else:
            self.writer.submit(call)

    def drain(self):
        """Wait until everything given to later() has run; raise what stopped it (StopRun)."""
        if self.writer is not None:
            self.writer.drain()

    def abandon(self):
        """Drop what waits to be written (the image being written is finished)."""
        if self.writer is not None:
            self.writer.drop()

    # ----- images -----------------------------------------------------------------------------------------------
    def process_all(self, todo: list[InputImage]):
        """Every image, a batch at a time. Images whose output folder turned out unwritable fail without being
        computed; a StopRun ends the loop (the caller finalises the manifest)."""
        size = self.inference.batch_size
        batches = [todo[i : i + size] for i in range(0, len(todo), size)]
        decoded = Ahead(self.decode, batches, DECODE_AHEAD) if self.workers else map(self.decode, batches)
        try:
            for batch in decoded:
                readable = self.readable(batch)
                pairs, prepared = [(item, image) for item, image, _ in readable], [ahead for *_, ahead in readable]
                for item, image, result in self.infer(pairs, prepared if self.workers else None):
                    self.write(item, image, result)
        finally:
            if isinstance(decoded, Ahead):
                decoded.close()

    def decode(self, batch: list[InputImage]) -> list[tuple[InputImage, torch.Tensor | Exception, dict]]:
        """Each image read (or why it cannot be), pinned for a copy to the GPU that does not wait for the CPU, with
        (pipelined) its inputs to the whole-image models made ahead of its batch (Inference.prepare_ahead)."""
        pinned = self.inference.device.type == "cuda"
        decoded = []
        for item in batch:
            try:
                image = processing.load_image(item.path)
                image = image.pin_memory() if pinned else image
                decoded.append((item, image, self.inference.prepare_ahead(image, item) if self.workers else {}))
            except Exception as error:  # noqa: BLE001 (reported in order by readable)
                decoded.append((item, error, {}))
        return decoded

    def readable(self, decoded: list[tuple[InputImage, torch.Tensor | Exception, dict]]) -> list[tuple]:
        """The (item, image, inputs made ahead) of a batch to compute: not those bound for a folder found unwritable
        (reported), nor those that could not be read (reported). Waits first for the writes that decide whether
        their folders are."""
        self.wait_for_first_writes([item for item, _, _ in decoded])
        computable = []
        for item, image, ahead in decoded:
            if (why := self.blocked_reason(item)) is not None:
                self.fail(item, [(None, why)])
            elif isinstance(image, Exception):
                self.fail(item, [(None, image)])
            else:
                computable.append((item, image, ahead))
        return computable

    def infer(self, pairs: list[tuple[InputImage, torch.Tensor]], prepared: list[dict] | None = None
              ) -> list[tuple[InputImage, torch.Tensor, dict]]:
        """(item, image, result) of each pair whose inference did not fail as a whole (each task on its own, failing
        images retried one by one inside); a failure outside the tasks (e.g. finding boxes) is retried image by
        image, and an image it still fails on is reported. `prepared`: the pairs' model inputs made ahead."""
        if not pairs:
            return []
        try:
            results = infer(self.inference, [item for item, _ in pairs], [image for _, image in pairs], prepared)
        except Exception as error:  # noqa: BLE001 (a failure outside the tasks)
            if len(pairs) > 1:
                return [done for i, pair in enumerate(pairs)
                        for done in self.infer([pair], prepared and prepared[i : i + 1])]
            self.fail(pairs[0][0], [(None, error)])
            return []
        for result in results:
            for message in result.pop("warnings"):
                self.warn(message)
        return [(item, image, result) for (item, image), result in zip(pairs, results)]

    def write(self, item: InputImage, image: torch.Tensor, result: dict, then: Callable | None = None):
        """Make and write an image's files (later(), in order), then `then(what went in them by suffix, whether all
        of its tasks were written)`. A write error that will repeat stops the run (StopRun) or blocks the image's
        output folder."""
        if self.makers is None:  # one thread: make and write now
            written, complete = self.commit(item, result, self.outputs.make(item, image, result))
            if then is not None:
                then(written, complete)
            return
        made = self.makers.submit(self.outputs.make, item, image, result)
        folder = self.outputs.stem(item).parent
        with self.changed:
            self.in_flight[folder] += 1

        def commit():
            try:
                written, complete = self.commit(item, result, made.result())
            finally:
                with self.changed:
                    self.in_flight[folder] -= 1
                    self.changed.notify_all()
            if then is not None:
                then(written, complete)

        self.later(commit)

    def commit(self, item: InputImage, result: dict, made: dict) -> tuple[dict, bool]:
        """Write what Outputs.make made (where later() runs) and report the outcome."""
        if (why := self.blocked_reason(item)) is not None:  # its folder failed for an earlier image
            self.report(item, [(None, why)])
            return {}, False
        try:
            written, failures = self.outputs.commit(item, result, made)
        except OSError as error:
            self.report(item, [(None, error)])
            self.stop_or_block(item, error)
            return {}, False
        with self.changed:
            self.written_folders.add(self.outputs.stem(item).parent)
        if failures:
            self.report(item, failures)
            return written, False
        self.outcomes[item] = "written"
        self.progress.advance()
        return written, True

    def wait_for_first_writes(self, items: list[InputImage]):
        """Until each item's output folder has taken files once (or has none waiting): a folder found unwritable is
        then known before the images bound for it are computed, as when one image goes after the other."""
        def unknown(item):
            folder = self.outputs.stem(item).parent
            return folder not in self.written_folders and self.in_flight[folder] > 0

        with self.changed:
            while any(unknown(item) for item in items):
                if self.writer is not None:
                    self.writer.raise_error()
                self.changed.wait(timeout=0.1)

    # ----- failures -----------------------------------------------------------------------------------------------
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
                with self.changed:
                    self.blocked[folder] = os_error_text(error)
                return
            reason = f"{os_error_text(out_error)} (OUT itself; after {reason})"
        raise StopRun(reason)

    def blocked_reason(self, item: InputImage) -> PermissionError | None:
        """Why the item's output folder cannot take its files (found unwritable for an earlier image), or None."""
        folder = self.outputs.stem(item).parent
        with self.changed:
            reason = next((why for blocked, why in self.blocked.items() if folder.is_relative_to(blocked)), None)
        return None if reason is None else PermissionError(f"skipped: its output folder is not writable ({reason})")

    def fail(self, item: InputImage, failures: list[tuple[str | None, Exception]]):
        """Report an image's failures (task None: the whole image), in order with the images written before it."""
        self.later(lambda: self.report(item, failures))

    def warn(self, message: str):
        self.later(lambda: self.record_warning(message))

    def report(self, item: InputImage, failures: list[tuple[str | None, Exception]]):
        """An image's failures on stderr and in the manifest (where later() runs)."""
        for task, error in failures:
            entry, line = failure_report(item, task, error)
            self.errors.append(entry)
            self.progress.note(line)
        self.outcomes[item] = "failed"
        self.progress.advance(failed=True)

    def record_warning(self, message: str):
        self.warnings.append(message)
        self.progress.note(f"warning: {message}")


def failure_report(item: InputImage, task: str | None, error: Exception) -> tuple[dict, str]:
    """A failure as its run.json entry and its `error: ... (skipped)` line."""
    message = os_error_text(error) if isinstance(error, OSError) and error.errno else str(error)
    message = f"{type(error).__name__}: {one_line(message)}"
    where = "" if str(item.path) in message else f"{item.path}: "
    return ({"image": str(item.path), **({"task": task} if task else {}), "error": message},
            f"error: {where}{f'{task}: ' if task else ''}{message} (skipped)")
