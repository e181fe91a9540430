"""The threads of the pipelined runner (pipeline.Run with workers > 0), each stage bounded so that memory stays
bounded on any number of images:

    Ahead     decodes the next inputs in a thread, at most `depth` batches ahead of the model
    InOrder   one thread that runs what it is given in the order given (writing files, reporting outcomes),
              at most `limit` things waiting; an error stops it (the rest is dropped, never half-done)

The files themselves are made (rendered and encoded) by a ThreadPoolExecutor; InOrder waits for each image's
files before writing them, so the files, run.json and the overlay videos come out in the order of the inputs.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable, Iterable, Iterator


class Ahead:
    """`function(x)` for each x of `items`, computed in a thread, at most `depth` results ahead of the consumer.
    The iterator yields them in order; an exception in `function` is the caller's to handle (function should
    return it as a value)."""

    _DONE = object()

    def __init__(self, function: Callable, items: Iterable, depth: int = 2):
        self.results: queue.Queue = queue.Queue(maxsize=depth)
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(function, items), daemon=True, name="sapiens2-decode")
        self.thread.start()

    def _run(self, function, items):
        for item in items:
            if self.stopped.is_set():
                return
            self._put(function(item))
        self._put(self._DONE)

    def _put(self, value):
        while not self.stopped.is_set():
            try:
                self.results.put(value, timeout=0.1)
                return
            except queue.Full:
                continue

    def __iter__(self) -> Iterator:
        while (value := self.results.get()) is not self._DONE:
            yield value

    def close(self):
        """Stop decoding (the decode in progress finishes) and wait for the thread."""
        self.stopped.set()
        self.thread.join()


class InOrder:
    """Runs the callables given to `submit` one after the other in a thread of its own, in the order given. At most
    `limit` wait at a time (submit blocks: the producer cannot run ahead of the writer without bound). The first
    exception a callable raises is kept (`error`): what is left is dropped, and the next submit or drain raises it.
    `drop()` drops what waits (after Ctrl-C: nothing is started that is not needed); the callable running ends."""

    def __init__(self, limit: int):
        self.waiting: queue.Queue = queue.Queue(maxsize=limit)
        self.error: BaseException | None = None
        self.dropping = False
        self.thread = threading.Thread(target=self._run, daemon=True, name="sapiens2-write")
        self.thread.start()

    def _run(self):
        while (call := self.waiting.get()) is not None:
            try:
                if self.error is None and not self.dropping:
                    call()
            except BaseException as error:  # noqa: BLE001 (kept, raised in the submitting thread)
                self.error = error
            finally:
                self.waiting.task_done()
        self.waiting.task_done()

    def submit(self, call: Callable[[], None]):
        self.raise_error()
        self.waiting.put(call)

    def raise_error(self):
        if self.error is not None:
            raise self.error

    def drain(self):
        """Wait until everything submitted has run (or was dropped after an error), then raise the error if any."""
        self.waiting.join()
        self.raise_error()

    def drop(self):
        """Drop what waits and wait for the callable running."""
        self.dropping = True
        self.waiting.join()

    def close(self):
        """End the thread (after drain or drop)."""
        self.waiting.put(None)
        self.thread.join()
